"""FlashAttention-2 forward as a Triton-lowered Pallas kernel.

One program per (query block, batch, head): Q_i stays on chip while the program walks the
K/V blocks its rows can see, keeping the running max ``m_i``, sum ``l_i`` and the
unnormalised output in registers (FlashAttention-2, Algorithm 1). Blocks outside the mask
band are never loaded; blocks fully inside it run without any mask arithmetic (unless a
mask array is given, which may hide pairs anywhere). A bias is read tile by tile next to K
(see :mod:`pallas_flash.triton.tiles`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.contract import EMPTY_ROW_LSE, RowBounds, kernel_output
from pallas_flash.logits import LOG2_E, log2_logits
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.triton.config import TritonConfig, fit_row_operands, padded_head_dim
from pallas_flash.triton.tiles import (
    bounds_operand,
    cut_to_bounds,
    read_tile,
    row_block_operand,
    segment_operands,
    tile_visible,
    walk_tiles,
    zero_rows_outside,
)


def dot_precision(dtype):
    """float32 inputs get IEEE products (Triton would use TF32); 16-bit inputs the default."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def query_block_order(program: int, num_q_blocks: int, mask: MaskSpec):
    """Query block of the ``program``-th launch. Causal rows near the end see the most keys:
    launching them first leaves the short ones to fill the tail (less imbalance)."""
    return num_q_blocks - 1 - program if mask.is_causal else program


def _forward_kernel(q_ref, k_ref, v_ref, seg_refs, bounds_ref, bias_ref, mask_ref, o_ref,
                    lse_ref, *, mask: MaskSpec, scale: float, softcap: float | None,
                    block_q: int, block_kv: int, num_q_blocks: int):
    """seg_refs: None or (q ids, kv ids, spans)
    (tiles.segment_operands); bounds_ref: None or this sequence's ``(q_end, kv_start,
    kv_end)`` (tiles.bounds_operand); bias_ref, mask_ref: None or this program's
    ``[block_q or 1, padded_kv or 1]`` rows (tiles.row_block_operand)."""
    has_segments = seg_refs is not None
    q_seg_ref, kv_seg_ref, span_ref = seg_refs if has_segments else (None,) * 3
    q_block = query_block_order(pl.program_id(0), num_q_blocks, mask)
    q_start = q_block * block_q
    precision = dot_precision(q_ref.dtype)
    q = q_ref[...]
    q_seg = q_seg_ref[pl.ds(q_start, block_q)] if has_segments else None
    bounds = None if bounds_ref is None else tuple(bounds_ref[i] for i in range(3))

    def kv_step(j, carry, *, masked: bool):
        acc, m_i, l_i = carry
        k_start = j * block_kv
        cols = pl.ds(k_start, block_kv)
        k = k_ref[cols, :]
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)  # [block_q, block_kv]
        s, _ = log2_logits(qk, scale, softcap, read_tile(bias_ref, cols=cols))
        if masked:
            kv_seg = kv_seg_ref[cols] if has_segments else None
            visible = tile_visible(mask, q_start, block_q, k_start, block_kv, q_seg, kv_seg,
                                   read_tile(mask_ref, cols=cols), bounds)
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        # The running max starts at -inf, below any finite logit: a row whose biased logits
        # are all <= -1e30 still gets its softmax (as jax.nn), and only a row with no
        # visible key ends empty (l = 0). A row that has seen only -inf so far (hidden keys,
        # a -inf bias) subtracts 0 instead, so that its p and alpha are 0, not NaN; without
        # a mask or a bias every logit is finite and the guard is not needed.
        if masked or bias_ref is not None:
            m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_sub = m_new
        p = jnp.exp2(s - m_sub[:, None])
        # Rescale the running statistics to the new max (FA2: only the correction factor).
        alpha = jnp.exp2(m_i - m_sub)
        l_i = alpha * l_i + jnp.sum(p, axis=1)
        v = v_ref[cols, :]
        if masked and bounds is not None:  # hidden V rows may be NaN; P is 0 there
            v = zero_rows_outside(v, k_start, bounds[1], bounds[2])
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_i

    carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    ranges = mask.kv_blocks(q_start, block_q, block_kv)
    if bounds is not None:
        # Rows past q_end are computed with the others (each row's softmax is its own) and
        # replaced below, so only the key bounds decide which tiles need the mask.
        ranges = cut_to_bounds(ranges, bounds[1], bounds[2], block_kv,
                               own_seen=q_start < bounds[0], own_whole=True)
    acc, m_i, l_i = walk_tiles(kv_step, ranges, carry, span_ref=span_ref, own_tile=q_block,
                               mask_every_tile=mask_ref is not None)

    # Normalise once at the end (FA2, Algorithm 1 line 12); rows that saw nothing give 0.
    empty = l_i == 0.0
    if bounds is not None:
        empty = empty | (q_start + lax.broadcasted_iota(jnp.int32, (block_q,), 0) >= bounds[0])
    safe_l = jnp.where(empty, 1.0, l_i)
    out = acc / safe_l[:, None]
    if bounds is not None:  # a padding row's acc is its own (maybe NaN) softmax
        out = jnp.where(empty[:, None], 0.0, out)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(safe_l)) / LOG2_E)


def forward(q, k, v, segment_ids, *, mask: MaskSpec, scale: float, config: TritonConfig,
            interpret: bool, softcap: float | None = None, bias=None, attn_mask=None,
            bounds: RowBounds | None = None):
    """q: [B, T, N, D], k: [B, S, K, D], v: [B, S, K, Dv] -> (out [B, T, N, Dv],
    lse [B, N, T] float32). D and Dv are each zero-padded to a power of two.

    bias, attn_mask: None or canonical ``[B', N', T', S']`` (pallas_flash.bias); the mask
    goes to the kernel as int8 (one byte, like bool, and a type every Triton load takes).
    bounds: None or int32 ``[B]`` arrays (pallas_flash.contract.RowBounds).
    """
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    value_dim = v.shape[3]
    padded_d, padded_dv = padded_head_dim(head_dim), padded_head_dim(value_dim)
    # Bytes per (query row, key) of the bias/mask tiles that vary along queries.
    row_tile_bytes = sum(x.dtype.itemsize for x in (bias, attn_mask)
                         if x is not None and x.shape[2] > 1)
    config = fit_row_operands(config, padded_d, q.dtype.itemsize, row_tile_bytes,
                              value_dim=padded_dv)
    block_q, block_kv = config.block_q, config.block_kv
    padded_q, padded_kv = round_up(seq_q, block_q), round_up(seq_kv, block_kv)
    q_p = pad_axis(pad_axis(q, 1, padded_q), 3, padded_d)
    k_p = pad_axis(pad_axis(k, 1, padded_kv), 3, padded_d)
    v_p = pad_axis(pad_axis(v, 1, padded_kv), 3, padded_dv)
    num_q_blocks = padded_q // block_q

    def q_tile(i, b, h):
        return (b, query_block_order(i, num_q_blocks, mask), h, 0)

    def lse_tile(i, b, h):
        return (b, h, query_block_order(i, num_q_blocks, mask))

    def kv_rows(i, b, h):  # whole K/V of the head's KV head (GQA: shared by `group` heads)
        return (b, 0, h // group, 0)

    in_specs = [pl.BlockSpec((None, block_q, None, padded_d), q_tile),
                pl.BlockSpec((None, padded_kv, None, padded_d), kv_rows),
                pl.BlockSpec((None, padded_kv, None, padded_dv), kv_rows)]
    inputs = [q_p, k_p, v_p]
    # Optional operands: None, or arrays with their specs (pallas_call takes pytrees).
    segments = seg_specs = None
    if segment_ids is not None:
        segments, seg_specs = (tuple(x) for x in segment_operands(
            segment_ids, padded_q, padded_kv, block_q, block_kv, walk_kv=True))
    inputs.append(segments)
    in_specs.append(seg_specs)
    bounds_in, bounds_spec = (None, None) if bounds is None else bounds_operand(bounds)
    inputs.append(bounds_in)
    in_specs.append(bounds_spec)
    for x in (bias, None if attn_mask is None else attn_mask.astype(jnp.int8)):
        operand, spec = (None, None) if x is None else row_block_operand(
            x, padded_q, padded_kv, block_q,
            functools.partial(query_block_order, num_q_blocks=num_q_blocks, mask=mask))
        inputs.append(operand)
        in_specs.append(spec)

    kernel = functools.partial(
        _forward_kernel, mask=mask, scale=scale, softcap=softcap, block_q=block_q,
        block_kv=block_kv, num_q_blocks=num_q_blocks)
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_q, None, padded_dv), q_tile),
                   pl.BlockSpec((None, None, block_q), lse_tile)],
        out_shape=[kernel_output((batch, padded_q, heads, padded_dv), q.dtype, q),
                   kernel_output((batch, heads, padded_q), jnp.float32, q)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="pallas_flash_forward",
    )(*inputs)
    return out[:, :seq_q, :, :value_dim], lse[:, :, :seq_q]

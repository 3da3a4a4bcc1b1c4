"""FlashAttention-2 backward as two Triton-lowered Pallas kernels (no atomics).

Both kernels recompute P = exp(S - lse) tile by tile from the forward's lse
(FlashAttention-2, Algorithm 2), with ``delta = rowsum(dO ∘ O)`` precomputed:

* dK/dV kernel — one program per (key block, batch, KV head). K_j, V_j stay on chip; the
  program walks the query blocks that see them, for every query head of the GQA group, and
  accumulates dV_j += Pᵀ·dO and dK_j += dSᵀ·Q. The group's sum happens in registers, so
  dK/dV are never materialised per query head.
* dQ kernel — one program per (query block, batch, head), walking its visible key blocks:
  dQ_i += dS·K.

Each output tile is written by exactly one program, so the result is deterministic.

Bias gradient (``bias_grad``): dbias = dS of the biased logits, summed over the bias's
broadcast dims. The dK/dV kernel computes it, because its loops already run over two of
those dims: over the query tiles (a bias broadcast over queries, e.g. ``[B, 1, 1, S]``,
sums them in registers) and over the GQA group's heads (a bias broadcast over heads sums
them in registers too when it is also broadcast over queries). Every other broadcast dim
is summed outside the kernel from a float32 partial ``[B, K, G', T', S']`` whose dims are:
batch and KV heads always (a grid axis each); ``G' = G`` unless summed in registers;
``T' = seq_q`` unless summed; ``S' = seq_kv``, or one column per key tile for a bias
broadcast over keys. So a full-size bias costs one ``[B, N, T, S]`` float32 partial, a
``[T, S]`` bias shared by batch and heads also ``[B, N, T, S]`` (B·N times the bias), and
a padding-style ``[B, 1, 1, S]`` bias only ``[B, K, 1, S]``. Tiles a program never visits
must read 0, so when the partial has a query dim it starts as zeros
(``input_output_aliases``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.bias import sum_to_shape
from pallas_flash.contract import RowBounds, kernel_output
from pallas_flash.logits import LOG2_E, log2_logits, raw_score_gradient
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.triton.config import TritonConfig, padded_head_dim
from pallas_flash.triton.forward import dot_precision
from pallas_flash.triton.tiles import (
    bounds_operand,
    column_block_operand,
    cut_to_bounds,
    read_tile,
    row_block_operand,
    segment_operands,
    tile_visible,
    walk_tiles,
    zero_rows_outside,
)


def _probabilities(q, k, lse2, scale, softcap, precision, visible, bias_tile):
    """P = exp2(S·log2 e - lse·log2 e): the forward's softmax, recomputed.

    Returns ``(p, slope)``, slope as in :func:`log2_logits`.
    """
    qk = plgpu.dot(q, k, trans_b=True, precision=precision)
    s, slope = log2_logits(qk, scale, softcap, bias_tile)
    p = jnp.exp2(s - lse2[:, None])
    return (p if visible is None else jnp.where(visible, p, 0.0)), slope


def _score_gradient(p, dp, delta):
    """dS = P ∘ (dP - delta) (FA2, Alg. 2): the gradient of the (biased) logits."""
    return p * (dp - delta[:, None])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_refs, bounds_ref,
                 bias_ref, mask_ref, d_bias_init_ref, dk_ref, dv_ref, d_bias_ref, *, mask: MaskSpec,
                 scale: float, softcap: float | None, block_q: int, block_kv: int,
                 num_q_blocks: int, group: int):
    """One key tile of one (batch, KV head). bounds_ref: None or the sequence's
    ``(q_end, kv_start, kv_end)`` (tiles.bounds_operand); bias_ref, mask_ref: None or
    ``[G or 1, padded_q or 1, block_kv or 1]`` (tiles.column_block_operand); d_bias_ref: None
    or this program's block of the partial (module docstring), ``d_bias_init_ref`` its
    aliased zeros."""
    del d_bias_init_ref  # the same buffer as d_bias_ref
    has_segments = seg_refs is not None
    q_seg_ref, kv_seg_ref, span_ref = seg_refs if has_segments else (None,) * 3
    kv_block = pl.program_id(0)
    k_start = kv_block * block_kv
    precision = dot_precision(k_ref.dtype)
    k, v = k_ref[...], v_ref[...]
    bounds = None if bounds_ref is None else tuple(bounds_ref[i] for i in range(3))
    if bounds is not None:  # hidden keys may hold NaN, which P's zeros would not stop
        k, v = (zero_rows_outside(x, k_start, bounds[1], bounds[2]) for x in (k, v))
    kv_seg = kv_seg_ref[pl.ds(k_start, block_kv)] if has_segments else None
    # Which of the bias's dims the partial keeps (static): see the module docstring.
    if d_bias_ref is not None:
        partial_heads, partial_rows, partial_cols = d_bias_ref.shape
        key_broadcast = partial_cols == 1

    def d_bias_tile(ds):
        """dS summed over the tile's keys when the bias is broadcast over keys."""
        return jnp.sum(ds, axis=1, keepdims=True) if key_broadcast else ds

    def q_step(i, carry, *, head, masked: bool):
        dk, dv, d_bias_rows = carry
        q_start = i * block_q
        rows = pl.ds(q_start, block_q)
        q, do = q_ref[rows, head, :], do_ref[rows, head, :]
        lse2, delta = lse_ref[head, rows], delta_ref[head, rows]
        visible = None
        if masked:
            q_seg = q_seg_ref[rows] if has_segments else None
            visible = tile_visible(mask, q_start, block_q, k_start, block_kv, q_seg, kv_seg,
                                   read_tile(mask_ref, head=head, rows=rows), bounds)
            if bounds is not None:  # padding queries may hold NaN
                q, do = (zero_rows_outside(x, q_start, 0, bounds[0]) for x in (q, do))
        p, slope = _probabilities(q, k, lse2, scale, softcap, precision, visible,
                                  read_tile(bias_ref, head=head, rows=rows))
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = _score_gradient(p, dp, delta)
        if d_bias_ref is not None:
            if partial_rows == 1:  # bias broadcast over queries: sum the rows here
                d_bias_rows = d_bias_rows + jnp.sum(d_bias_tile(ds), axis=0, keepdims=True)
            else:  # each (head, query tile, key tile) is visited once: plain store
                d_bias_ref[head, rows, :] = d_bias_tile(ds)
        ds = raw_score_gradient(ds, slope)
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
        return dk, dv, d_bias_rows

    ranges = mask.q_blocks(k_start, block_kv, block_q, num_q_blocks)
    if bounds is not None:
        # A key tile partly outside the bounds masks every query tile: its hidden columns
        # must give exactly 0 (dK, dV and dbias).
        k_end = k_start + block_kv
        ranges = cut_to_bounds(ranges, 0, bounds[0], block_q,
                               own_seen=(k_start < bounds[2]) & (k_end > bounds[1]),
                               own_whole=(k_start >= bounds[1]) & (k_end <= bounds[2]))
    # Query-summed dbias row of the current head (or of the whole group when the partial
    # has one head); None when no such sum is kept.
    summed_rows = d_bias_ref is not None and partial_rows == 1
    d_bias_zeros = (jnp.zeros((1, partial_cols), jnp.float32) if summed_rows else None)

    def head_step(head, carry):  # the GQA group's query heads, summed in registers
        carry = walk_tiles(functools.partial(q_step, head=head), ranges, carry,
                           span_ref=span_ref, own_tile=kv_block,
                           mask_every_tile=mask_ref is not None)
        if summed_rows and partial_heads > 1:  # one row per head: store it, start afresh
            d_bias_ref[head, :, :] = carry[2]
            carry = (*carry[:2], d_bias_zeros)
        return carry

    dk, dv, d_bias_rows = lax.fori_loop(
        0, group, head_step,
        (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), d_bias_zeros))
    if summed_rows and partial_heads == 1:
        d_bias_ref[0, :, :] = d_bias_rows
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_refs, bounds_ref, bias_ref,
               mask_ref, dq_ref, *, mask: MaskSpec, scale: float, softcap: float | None,
               block_q: int, block_kv: int):
    """One query tile of one (batch, head). bounds_ref as in the dK/dV kernel; bias_ref,
    mask_ref: None or ``[block_q or 1, padded_kv or 1]`` (tiles.row_block_operand)."""
    has_segments = seg_refs is not None
    q_seg_ref, kv_seg_ref, span_ref = seg_refs if has_segments else (None,) * 3
    q_block = pl.program_id(0)
    q_start = q_block * block_q
    precision = dot_precision(q_ref.dtype)
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse_ref[...], delta_ref[...]
    q_seg = q_seg_ref[pl.ds(q_start, block_q)] if has_segments else None
    bounds = None if bounds_ref is None else tuple(bounds_ref[i] for i in range(3))

    def kv_step(j, dq, *, masked: bool):
        k_start = j * block_kv
        cols = pl.ds(k_start, block_kv)
        k, v = k_ref[cols, :], v_ref[cols, :]
        visible = None
        if masked:
            kv_seg = kv_seg_ref[cols] if has_segments else None
            visible = tile_visible(mask, q_start, block_q, k_start, block_kv, q_seg, kv_seg,
                                   read_tile(mask_ref, cols=cols), bounds)
            if bounds is not None:  # hidden keys may hold NaN
                k, v = (zero_rows_outside(x, k_start, bounds[1], bounds[2]) for x in (k, v))
        p, slope = _probabilities(q, k, lse2, scale, softcap, precision, visible,
                                  read_tile(bias_ref, cols=cols))
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = raw_score_gradient(_score_gradient(p, dp, delta), slope)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    ranges = mask.kv_blocks(q_start, block_q, block_kv)
    if bounds is not None:  # padding rows' dq is replaced below (each row's is its own)
        ranges = cut_to_bounds(ranges, bounds[1], bounds[2], block_kv,
                               own_seen=q_start < bounds[0], own_whole=True)
    dq = walk_tiles(kv_step, ranges, jnp.zeros(q.shape, jnp.float32), span_ref=span_ref,
                    own_tile=q_block, mask_every_tile=mask_ref is not None)
    if bounds is not None:
        dq = zero_rows_outside(dq, q_start, 0, bounds[0])
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _d_bias_partial(bias_shape, batch: int, kv_heads: int, group: int, padded_q: int,
                    padded_kv: int, block_kv: int):
    """Shape and block spec of the dK/dV kernel's dbias partial (module docstring)."""
    _, bias_heads, bias_rows, bias_cols = bias_shape
    rows = padded_q if bias_rows > 1 else 1
    heads = group if bias_heads > 1 or rows > 1 else 1
    cols, block_cols = (padded_kv, block_kv) if bias_cols > 1 else (padded_kv // block_kv, 1)
    spec = pl.BlockSpec((None, None, heads, rows, block_cols), lambda j, b, h: (b, h, 0, 0, j))
    return (batch, kv_heads, heads, rows, cols), spec


def _reduce_d_bias(partial, bias_shape, seq_q: int, seq_kv: int):
    """The float32 partial [B, K, G', T', S'] -> dbias [B', N', T', S'] (bias's shape)."""
    batch, kv_heads, heads, rows, cols = partial.shape
    partial = partial.reshape(batch, kv_heads * heads, rows, cols)[:, :, :seq_q]
    if bias_shape[3] == 1:  # one column per key tile: add them up
        partial = jnp.sum(partial, axis=3, keepdims=True)
    return sum_to_shape(partial[..., :seq_kv], bias_shape)


def backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask: MaskSpec, scale: float,
             config: TritonConfig, interpret: bool, softcap: float | None = None, bias=None,
             attn_mask=None, bounds: RowBounds | None = None, bias_grad: bool = False,
             deterministic: bool = False):
    """q: [B, T, N, D], k: [B, S, K, D], v: [B, S, K, Dv], d_out: [B, T, N, Dv]. Returns
    (dq [B, T, N, D], dk [B, S, K, D], dv [B, S, K, Dv]), and dbias (float32, shaped like
    ``bias``) when ``bias_grad``.

    bounds: None or int32 ``[B]`` arrays (pallas_flash.contract.RowBounds): padding
    queries get dq 0, hidden keys dk / dv 0 (and no dbias).
    bias, attn_mask: None or canonical ``[B', N', T', S']`` (pallas_flash.bias); the mask
    is passed to the kernels as int8.
    deterministic: accepted for the backend interface; this backward always is (no
    atomics: every output tile, dbias partials included, is written by one program, and
    the dbias partial is summed by XLA).
    """
    del out  # only needed for delta, which the caller computed
    del deterministic
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_kv = config.bwd_block_q, config.bwd_block_kv
    padded_q, padded_kv = round_up(seq_q, block_q), round_up(seq_kv, block_kv)
    value_dim = v.shape[3]
    padded_d, padded_dv = padded_head_dim(head_dim), padded_head_dim(value_dim)
    num_q_blocks, num_kv_blocks = padded_q // block_q, padded_kv // block_kv

    q_p = pad_axis(pad_axis(q, 1, padded_q), 3, padded_d)
    do_p = pad_axis(pad_axis(d_out, 1, padded_q), 3, padded_dv)
    k_p = pad_axis(pad_axis(k, 1, padded_kv), 3, padded_d)
    v_p = pad_axis(pad_axis(v, 1, padded_kv), 3, padded_dv)
    # lse in base 2; padded rows get +inf so that their P = exp2(S - inf) is exactly 0.
    lse2 = pad_axis(lse * LOG2_E, 2, padded_q, jnp.inf)
    delta = pad_axis(delta, 2, padded_q)
    if bounds is not None:  # a padding row's delta may be NaN (from its dO), P's 0 won't stop it
        delta = jnp.where(jnp.arange(padded_q) < bounds.q_end[:, None, None], delta, 0.0)
    # Optional operands: None, or arrays with their specs (pallas_call takes pytrees). Per
    # kernel: the segment ids and the spans of the tiles it walks.
    dkdv_segments = dq_segments = (None, None)
    if segment_ids is not None:
        dkdv_segments, dq_segments = (
            tuple(tuple(x) for x in segment_operands(segment_ids, padded_q, padded_kv, block_q,
                                                     block_kv, walk_kv=walk_kv))
            for walk_kv in (False, True))
    bounds_in, bounds_spec = (None, None) if bounds is None else bounds_operand(bounds)
    logit_arrays = (bias, None if attn_mask is None else attn_mask.astype(jnp.int8))
    params = plgpu.CompilerParams(num_warps=config.bwd_num_warps,
                                  num_stages=config.bwd_num_stages)
    static = dict(mask=mask, scale=scale, softcap=softcap, block_q=block_q,
                  block_kv=block_kv)

    # dK/dV: the group's query heads are viewed as one [T, G, D] block per KV head.
    def kv_tile(j, b, h):
        return (b, j, h, 0)

    def group_rows(j, b, h):
        return (b, 0, h, 0, 0)

    def group_stats(j, b, h):
        return (b, h, 0, 0)

    grouped = lambda x: x.reshape(batch, padded_q, kv_heads, group, x.shape[3])  # noqa: E731
    stats = lambda x: x.reshape(batch, kv_heads, group, padded_q)  # noqa: E731
    columns = [(None, None) if x is None else
               column_block_operand(x, kv_heads, padded_q, padded_kv, block_kv)
               for x in logit_arrays]
    inputs = [grouped(q_p), k_p, v_p, grouped(do_p), stats(lse2), stats(delta),
              dkdv_segments[0], bounds_in, *(x for x, _ in columns)]
    in_specs = [
        pl.BlockSpec((None, padded_q, None, group, padded_d), group_rows),
        pl.BlockSpec((None, block_kv, None, padded_d), kv_tile),
        pl.BlockSpec((None, block_kv, None, padded_dv), kv_tile),
        pl.BlockSpec((None, padded_q, None, group, padded_dv), group_rows),
        pl.BlockSpec((None, None, group, padded_q), group_stats),
        pl.BlockSpec((None, None, group, padded_q), group_stats),
        dkdv_segments[1],
        bounds_spec,
        *(spec for _, spec in columns),
    ]
    out_specs = [pl.BlockSpec((None, block_kv, None, padded_d), kv_tile),
                 pl.BlockSpec((None, block_kv, None, padded_dv), kv_tile)]
    out_shape = [kernel_output(k_p.shape, k.dtype, q), kernel_output(v_p.shape, v.dtype, q)]
    d_bias_init = d_bias_spec = d_bias_shape = None
    aliases = {}
    if bias_grad:
        partial_shape, d_bias_spec = _d_bias_partial(bias.shape, batch, kv_heads, group,
                                                     padded_q, padded_kv, block_kv)
        d_bias_shape = kernel_output(partial_shape, jnp.float32, q)
        if partial_shape[3] > 1:  # tiles no program visits must read 0
            d_bias_init = jnp.zeros(partial_shape, jnp.float32)
            aliases = {len(jax.tree.leaves(inputs)): 2}
    inputs.append(d_bias_init)
    in_specs.append(None if d_bias_init is None else d_bias_spec)
    dk, dv, d_bias = pl.pallas_call(
        functools.partial(_dkdv_kernel, num_q_blocks=num_q_blocks, group=group, **static),
        grid=(num_kv_blocks, batch, kv_heads),
        in_specs=in_specs,
        out_specs=[*out_specs, d_bias_spec],
        out_shape=[*out_shape, d_bias_shape],
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_backward_dkdv",
    )(*inputs)

    def q_tile(i, b, h):
        return (b, i, h, 0)

    def kv_rows(i, b, h):
        return (b, 0, h // group, 0)

    def row_stats(i, b, h):
        return (b, h, i)

    rows = [(None, None) if x is None else
            row_block_operand(x, padded_q, padded_kv, block_q, lambda i: i)
            for x in logit_arrays]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **static),
        grid=(num_q_blocks, batch, heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, padded_d), q_tile),
            pl.BlockSpec((None, padded_kv, None, padded_d), kv_rows),
            pl.BlockSpec((None, padded_kv, None, padded_dv), kv_rows),
            pl.BlockSpec((None, block_q, None, padded_dv), q_tile),
            pl.BlockSpec((None, None, block_q), row_stats),
            pl.BlockSpec((None, None, block_q), row_stats),
            dq_segments[1],
            bounds_spec,
            *(spec for _, spec in rows),
        ],
        out_specs=pl.BlockSpec((None, block_q, None, padded_d), q_tile),
        out_shape=kernel_output(q_p.shape, q.dtype, q),
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_backward_dq",
    )(q_p, k_p, v_p, do_p, lse2, delta, dq_segments[0], bounds_in, *(x for x, _ in rows))
    grads = (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
             dv[:, :seq_kv, :, :value_dim])
    if bias_grad:
        grads += (_reduce_d_bias(d_bias, bias.shape, seq_q, seq_kv),)
    return grads

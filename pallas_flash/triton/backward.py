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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.masking import MaskSpec
from pallas_flash.padding import next_power_of_2, pad_axis, round_up
from pallas_flash.triton.config import TritonConfig
from pallas_flash.triton.forward import LOG2_E, dot_precision, log2_logits
from pallas_flash.triton.tiles import segment_operands, walk_tiles


def _visible(mask: MaskSpec, q_start, block_q, k_start, block_kv, q_seg, kv_seg):
    visible = mask.block_visible(q_start, block_q, k_start, block_kv)
    if q_seg is not None:
        visible = visible & (q_seg[:, None] == kv_seg[None, :])
    return visible


def _probabilities(q, k, lse2, scale, softcap, precision, visible):
    """P = exp2(S·log2 e - lse·log2 e): the forward's softmax, recomputed.

    Returns ``(p, slope)``, slope as in :func:`log2_logits`.
    """
    qk = plgpu.dot(q, k, trans_b=True, precision=precision)
    s, slope = log2_logits(qk, scale, softcap)
    p = jnp.exp2(s - lse2[:, None])
    return (p if visible is None else jnp.where(visible, p, 0.0)), slope


def _score_gradient(p, dp, delta, slope):
    """dS = P ∘ (dP - delta) (FA2, Alg. 2), then through the soft-cap's tanh if any."""
    ds = p * (dp - delta[:, None])
    return ds if slope is None else ds * slope


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, mask: MaskSpec,
                 scale: float, softcap: float | None, block_q: int, block_kv: int,
                 num_q_blocks: int, group: int, has_segments: bool):
    if has_segments:
        q_seg_ref, kv_seg_ref, span_ref, dk_ref, dv_ref = rest
    else:
        span_ref = None
        dk_ref, dv_ref = rest
    kv_block = pl.program_id(0)
    k_start = kv_block * block_kv
    precision = dot_precision(k_ref.dtype)
    k, v = k_ref[...], v_ref[...]
    kv_seg = kv_seg_ref[pl.ds(k_start, block_kv)] if has_segments else None

    def q_step(i, carry, *, head, masked: bool):
        dk, dv = carry
        q_start = i * block_q
        rows = pl.ds(q_start, block_q)
        q, do = q_ref[rows, head, :], do_ref[rows, head, :]
        lse2, delta = lse_ref[head, rows], delta_ref[head, rows]
        visible = None
        if masked:
            q_seg = q_seg_ref[rows] if has_segments else None
            visible = _visible(mask, q_start, block_q, k_start, block_kv, q_seg, kv_seg)
        p, slope = _probabilities(q, k, lse2, scale, softcap, precision, visible)
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = _score_gradient(p, dp, delta, slope)
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
        return dk, dv

    ranges = mask.q_blocks(k_start, block_kv, block_q, num_q_blocks)

    def head_step(head, carry):  # the GQA group's query heads, summed in registers
        return walk_tiles(functools.partial(q_step, head=head), ranges, carry,
                          span_ref=span_ref, own_tile=kv_block)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_step, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, mask: MaskSpec,
               scale: float, softcap: float | None, block_q: int, block_kv: int,
               has_segments: bool):
    if has_segments:
        q_seg_ref, kv_seg_ref, span_ref, dq_ref = rest
    else:
        span_ref = None
        (dq_ref,) = rest
    q_block = pl.program_id(0)
    q_start = q_block * block_q
    precision = dot_precision(q_ref.dtype)
    q, do = q_ref[...], do_ref[...]
    lse2, delta = lse_ref[...], delta_ref[...]
    q_seg = q_seg_ref[pl.ds(q_start, block_q)] if has_segments else None

    def kv_step(j, dq, *, masked: bool):
        k_start = j * block_kv
        cols = pl.ds(k_start, block_kv)
        k, v = k_ref[cols, :], v_ref[cols, :]
        visible = None
        if masked:
            kv_seg = kv_seg_ref[cols] if has_segments else None
            visible = _visible(mask, q_start, block_q, k_start, block_kv, q_seg, kv_seg)
        p, slope = _probabilities(q, k, lse2, scale, softcap, precision, visible)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = _score_gradient(p, dp, delta, slope)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

    dq = walk_tiles(kv_step, mask.kv_blocks(q_start, block_q, block_kv),
                    jnp.zeros(q.shape, jnp.float32), span_ref=span_ref, own_tile=q_block)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask: MaskSpec, scale: float,
             config: TritonConfig, interpret: bool, softcap: float | None = None):
    """Returns (dq [B, T, N, D], dk [B, S, K, D], dv [B, S, K, D])."""
    del out  # only needed for delta, which the caller computed
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q, block_kv = config.bwd_block_q, config.bwd_block_kv
    padded_q, padded_kv = round_up(seq_q, block_q), round_up(seq_kv, block_kv)
    padded_d = max(16, next_power_of_2(head_dim))
    num_q_blocks, num_kv_blocks = padded_q // block_q, padded_kv // block_kv

    q_p, do_p = (pad_axis(pad_axis(x, 1, padded_q), 3, padded_d) for x in (q, d_out))
    k_p, v_p = (pad_axis(pad_axis(x, 1, padded_kv), 3, padded_d) for x in (k, v))
    # lse in base 2; padded rows get +inf so that their P = exp2(S - inf) is exactly 0.
    lse2 = pad_axis(lse * LOG2_E, 2, padded_q, jnp.inf)
    delta = pad_axis(delta, 2, padded_q)
    has_segments = segment_ids is not None
    # Per kernel: (operands, block specs) of the segment ids and the walked tiles' spans.
    dkdv_segments, dq_segments = ([], []), ([], [])
    if has_segments:
        dkdv_segments, dq_segments = (
            segment_operands(segment_ids, padded_q, padded_kv, block_q, block_kv,
                             walk_kv=walk_kv) for walk_kv in (False, True))
    params = plgpu.CompilerParams(num_warps=config.bwd_num_warps,
                                  num_stages=config.bwd_num_stages)
    static = dict(mask=mask, scale=scale, softcap=softcap, block_q=block_q,
                  block_kv=block_kv, has_segments=has_segments)

    # dK/dV: the group's query heads are viewed as one [T, G, D] block per KV head.
    def kv_tile(j, b, h):
        return (b, j, h, 0)

    def group_rows(j, b, h):
        return (b, 0, h, 0, 0)

    def group_stats(j, b, h):
        return (b, h, 0, 0)

    grouped = lambda x: x.reshape(batch, padded_q, kv_heads, group, padded_d)  # noqa: E731
    stats = lambda x: x.reshape(batch, kv_heads, group, padded_q)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, num_q_blocks=num_q_blocks, group=group, **static),
        grid=(num_kv_blocks, batch, kv_heads),
        in_specs=[
            pl.BlockSpec((None, padded_q, None, group, padded_d), group_rows),
            pl.BlockSpec((None, block_kv, None, padded_d), kv_tile),
            pl.BlockSpec((None, block_kv, None, padded_d), kv_tile),
            pl.BlockSpec((None, padded_q, None, group, padded_d), group_rows),
            pl.BlockSpec((None, None, group, padded_q), group_stats),
            pl.BlockSpec((None, None, group, padded_q), group_stats),
            *dkdv_segments[1],
        ],
        out_specs=[pl.BlockSpec((None, block_kv, None, padded_d), kv_tile)] * 2,
        out_shape=[jax.ShapeDtypeStruct(k_p.shape, k.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_backward_dkdv",
    )(grouped(q_p), k_p, v_p, grouped(do_p), stats(lse2), stats(delta), *dkdv_segments[0])

    def q_tile(i, b, h):
        return (b, i, h, 0)

    def kv_rows(i, b, h):
        return (b, 0, h // group, 0)

    def row_stats(i, b, h):
        return (b, h, i)

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **static),
        grid=(num_q_blocks, batch, heads),
        in_specs=[
            pl.BlockSpec((None, block_q, None, padded_d), q_tile),
            pl.BlockSpec((None, padded_kv, None, padded_d), kv_rows),
            pl.BlockSpec((None, padded_kv, None, padded_d), kv_rows),
            pl.BlockSpec((None, block_q, None, padded_d), q_tile),
            pl.BlockSpec((None, None, block_q), row_stats),
            pl.BlockSpec((None, None, block_q), row_stats),
            *dq_segments[1],
        ],
        out_specs=pl.BlockSpec((None, block_q, None, padded_d), q_tile),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="pallas_flash_backward_dq",
    )(q_p, k_p, v_p, do_p, lse2, delta, *dq_segments[0])
    return (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
            dv[:, :seq_kv, :, :head_dim])

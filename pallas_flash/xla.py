"""Memory-efficient attention in plain XLA: the online softmax over K/V chunks.

The default off-GPU. Memory is O(seq_q · block_kv) per head instead of O(seq_q · seq_kv):
a ``lax.scan`` walks the K/V chunks, carrying the unnormalised output and the running
row max ``m`` and sum ``l`` (FlashAttention-2's loop, with all query rows processed at
once). The backward recomputes P chunk by chunk from ``lse``. XLA cannot skip chunks
(the scan length is static), so the mask is applied everywhere; row bounds
(:class:`~pallas_flash.contract.RowBounds`) are one more mask, and the rows they hide are
selected to zero first (they may hold NaN). A ``bias`` / ``attn_mask``
is sliced per chunk with its broadcast dims kept at size 1; the bias gradient is reduced to
the bias's shape chunk by chunk, so it never takes more memory than the bias itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.bias import grouped, sum_to_shape
from pallas_flash.contract import EMPTY_ROW_LSE, Kernels, RowBounds, varying_like
from pallas_flash.masking import MaskSpec, segments_visible
from pallas_flash.padding import pad_axis


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """block_kv: keys processed per scan step (bounds the live score matrix)."""

    block_kv: int = 512

    def __post_init__(self) -> None:
        if self.block_kv < 1:
            raise ValueError(f"block_kv must be >= 1, got {self.block_kv}")


def _precision(dtype) -> lax.Precision:
    # float32 inputs get full float32 products (no TF32 on GPUs); 16-bit inputs don't care.
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _accumulator(dtype) -> jnp.dtype:
    """float32 (float64 for float64 inputs): the dtype of logits, statistics and sums."""
    return jnp.promote_types(dtype, jnp.float32)


def _chunks(x: jax.Array, block: int) -> jax.Array:
    """[B, S, K, D] -> [S/block, B, block, K, D], padding S with zeros."""
    b, s, n, d = x.shape
    pad = -s % block
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, (s + pad) // block, block, n, d), 1, 0)


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, N, D] -> [B, T, K, G, D]: query heads grouped by the KV head they share."""
    b, t, n, d = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, d)


def _bounds_visible(bounds: RowBounds, seq_q: int, k_start, block_kv: int) -> jax.Array:
    """[B, 1, 1, T, block_kv]: the pairs of one chunk inside each sequence's bounds."""
    rows = jnp.arange(seq_q)[None, :, None] < bounds.q_end[:, None, None]
    cols = k_start + jnp.arange(block_kv)[None, None, :]
    cols = (cols >= bounds.kv_start[:, None, None]) & (cols < bounds.kv_end[:, None, None])
    return (rows & cols)[:, None, None]


def _zero_outside_bounds(bounds: RowBounds | None, queries, keys):
    """Padding query rows (``queries``: [B, T, ...] arrays) and hidden key rows (``keys``:
    [B, S, ...]) selected to zero: they may hold NaN, and the matmuls multiply them by
    P's zeros. Returns the two lists (unchanged without bounds)."""
    if bounds is None:
        return list(queries), list(keys)

    def select(x, inside):
        return jnp.where(inside.reshape(*inside.shape, *(1,) * (x.ndim - 2)), x,
                         jnp.zeros((), x.dtype))

    def q_inside(x):
        return jnp.arange(x.shape[1])[None, :] < bounds.q_end[:, None]

    def k_inside(x):
        k = jnp.arange(x.shape[1])[None, :]
        return (k >= bounds.kv_start[:, None]) & (k < bounds.kv_end[:, None])

    return ([select(x, q_inside(x)) for x in queries],
            [select(x, k_inside(x)) for x in keys])


def _scores(q_g, k_j, scale, softcap, mask: MaskSpec, k_start, block_kv, segments, bias_j,
            mask_j, bounds=None):
    """Logits of all queries against one chunk, masked: [B, K, G, T, block_kv].

    segments: None or (q_segment_ids [B, T], kv_segment_ids of the chunk [B, block_kv]).
    bias_j, mask_j: None or the chunk of the bias / mask, [B', K', G', T', block_kv or 1].
    bounds: None or the call's RowBounds.
    Returns (masked logits, visible, d logits / d raw logits) — the last is
    ``1 - tanh²`` under soft-capping and None without it.
    """
    acc = _accumulator(q_g.dtype)
    s = jnp.einsum("btkgd,bskd->bkgts", q_g, k_j, preferred_element_type=acc,
                   precision=_precision(q_g.dtype)) * scale
    slope = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    if bias_j is not None:
        s = s + bias_j.astype(acc)
    # [1, 1, 1, T, block_kv]: the rank of the logits (no implicit rank promotion).
    visible = mask.block_visible(0, q_g.shape[1], k_start, block_kv)[None, None, None]
    if segments is not None:
        visible = visible & segments_visible(*segments)[:, None, None]
    if mask_j is not None:
        visible = visible & mask_j
    if bounds is not None:
        visible = visible & _bounds_visible(bounds, q_g.shape[1], k_start, block_kv)
    # Hidden pairs are -inf, below any finite logit: a row whose biased logits are all
    # <= -1e30 still gets its softmax (as jax.nn), and only a row with no visible key is
    # empty (l = 0). A select, not an add: NaN logits of hidden pairs never get through.
    return jnp.where(visible, s, -jnp.inf), visible, slope


def _padded_keys(x, num_chunks: int, block: int):
    """A canonical bias/mask padded along keys to whole chunks (None and size 1 pass)."""
    if x is None or x.shape[3] == 1:
        return x
    return pad_axis(x, 3, num_chunks * block)


def _chunk(x, index, block: int, kv_heads: int):
    """Chunk ``index`` of a padded canonical bias/mask: [B', K', G', T', block or 1]."""
    if x is None:
        return None
    if x.shape[3] > 1:
        x = lax.dynamic_slice_in_dim(x, index * block, block, axis=3)
    return grouped(x, kv_heads)


def _segment_chunks(segment_ids, block: int):
    """None, or (q_segment_ids [B, T], kv ids split into chunks [S/block, B, block])."""
    if segment_ids is None:
        return None, None
    q_seg, kv_seg = segment_ids
    b, s = kv_seg.shape
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, -s % block)), constant_values=-1)
    return q_seg, jnp.moveaxis(kv_seg.reshape(b, -1, block), 1, 0)


def forward(q, k, v, segment_ids, *, mask: MaskSpec, scale: float, config: XlaConfig,
            interpret: bool, softcap: float | None = None, bias=None, attn_mask=None,
            bounds: RowBounds | None = None):
    """q: [B, T, N, D], k: [B, S, K, D], v: [B, S, K, Dv] -> (out [B, T, N, Dv],
    lse [B, N, T] float32, float64 for float64 inputs).

    bounds: None or int32 ``[B]`` arrays (pallas_flash.contract.RowBounds), ANDed with
    every other mask; padding rows get out 0 and lse EMPTY_ROW_LSE.
    """
    del interpret
    # Only V: hidden logits are selected to -inf, but P·V multiplies V's hidden rows by 0.
    _, (v,) = _zero_outside_bounds(bounds, (), (v,))
    acc = _accumulator(q.dtype)
    batch, seq_q, heads, _ = q.shape
    kv_heads = k.shape[2]
    block = min(config.block_kv, k.shape[1])
    q_g = _grouped(q, kv_heads)
    k_chunks, v_chunks = _chunks(k, block), _chunks(v, block)
    group = heads // kv_heads

    q_seg, kv_seg_chunks = _segment_chunks(segment_ids, block)
    bias, attn_mask = (_padded_keys(x, k_chunks.shape[0], block) for x in (bias, attn_mask))

    def step(carry, xs):
        o, m, l = carry
        index, k_j, v_j, kv_seg = xs
        segments = None if q_seg is None else (q_seg, kv_seg)
        s, visible, _ = _scores(q_g, k_j, scale, softcap, mask, index * block, block, segments,
                                _chunk(bias, index, block, kv_heads),
                                _chunk(attn_mask, index, block, kv_heads), bounds)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # A row that has seen only hidden keys keeps m = -inf and subtracts 0 instead, so
        # that its p and alpha are 0, not NaN.
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(visible, jnp.exp(s - m_sub[..., None]), 0.0)
        alpha = jnp.exp(m - m_sub)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_j.dtype), v_j,
                        preferred_element_type=acc, precision=_precision(v_j.dtype))
        return (alpha[..., None] * o + pv, m_new, l), None

    # Inside shard_map the carry varies as q does; its initial value must too.
    value_dim = v.shape[3]
    init = tuple(varying_like(x, q) for x in (
        jnp.zeros((batch, kv_heads, group, seq_q, value_dim), acc),
        jnp.full((batch, kv_heads, group, seq_q), -jnp.inf, acc),
        jnp.zeros((batch, kv_heads, group, seq_q), acc),
    ))
    indices = jnp.arange(k_chunks.shape[0])
    (o, m, l), _ = lax.scan(step, init, (indices, k_chunks, v_chunks, kv_seg_chunks))
    empty = l == 0
    o = o / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, EMPTY_ROW_LSE, m + jnp.log(jnp.where(empty, 1.0, l)))
    out = jnp.transpose(o.reshape(batch, heads, seq_q, value_dim), (0, 2, 1, 3))
    return out.astype(q.dtype), lse.reshape(batch, heads, seq_q)


def backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask: MaskSpec, scale: float,
             config: XlaConfig, interpret: bool, softcap: float | None = None, bias=None,
             attn_mask=None, bounds: RowBounds | None = None, bias_grad: bool = False,
             deterministic: bool = False):
    """Gradients by recomputing P per K/V chunk (FlashAttention-2, Algorithm 2).

    q: [B, T, N, D], k: [B, S, K, D], v: [B, S, K, Dv], d_out: [B, T, N, Dv]. Returns
    (dq [B, T, N, D], dk [B, S, K, D], dv [B, S, K, Dv]), and dbias (float32, shaped like
    ``bias``) when ``bias_grad``. ``bounds``: as in :func:`forward`; padding rows get dq 0,
    hidden keys dk / dv 0.
    ``deterministic`` is accepted for the backend interface: these are XLA's einsums,
    scan and sums, with no scatter, so one compiled program gives the same bits on every
    run (across processes, GEMM autotuning may pick other algorithms: ``docs/api.md``).
    """
    del out, interpret, deterministic
    (q, d_out, delta), (k, v) = _zero_outside_bounds(
        bounds, (q, d_out, jnp.swapaxes(delta, 1, 2)), (k, v))
    delta = jnp.swapaxes(delta, 1, 2)
    acc = _accumulator(q.dtype)
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block = min(config.block_kv, seq_kv)
    q_g, do_g = _grouped(q, kv_heads), _grouped(d_out, kv_heads)
    lse_g = lse.reshape(batch, kv_heads, group, seq_q)
    delta_g = delta.reshape(batch, kv_heads, group, seq_q)
    prec = _precision(q.dtype)

    q_seg, kv_seg_chunks = _segment_chunks(segment_ids, block)
    k_chunks, v_chunks = _chunks(k, block), _chunks(v, block)
    num_chunks = k_chunks.shape[0]
    bias_shape = None if bias is None else bias.shape
    bias, attn_mask = (_padded_keys(x, num_chunks, block) for x in (bias, attn_mask))

    def step(dq, xs):
        index, k_j, v_j, kv_seg = xs
        segments = None if q_seg is None else (q_seg, kv_seg)
        bias_j = _chunk(bias, index, block, kv_heads)
        s, visible, slope = _scores(q_g, k_j, scale, softcap, mask, index * block, block,
                                    segments, bias_j, _chunk(attn_mask, index, block, kv_heads),
                                    bounds)
        p = jnp.where(visible, jnp.exp(s - lse_g[..., None]), 0.0)
        # dV_j = Pᵀ dO, dP = dO V_jᵀ, dS = P ∘ (dP - delta), dQ += dS K_j, dK_j = dSᵀ Q.
        dv_j = jnp.einsum("bkgts,btkgd->bskd", p.astype(q.dtype), do_g,
                          preferred_element_type=acc, precision=prec)
        dp = jnp.einsum("btkgd,bskd->bkgts", do_g, v_j,
                        preferred_element_type=acc, precision=prec)
        ds = p * (dp - delta_g[..., None])  # the gradient of the (biased) logits
        # The bias gradient, summed over the bias's broadcast dims now: bias-sized chunks.
        d_bias_j = sum_to_shape(ds, bias_j.shape) if bias_grad else None
        if slope is not None:  # chain rule through c·tanh(x/c)
            ds = ds * slope
        ds = ds.astype(q.dtype)
        dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k_j,
                             preferred_element_type=acc, precision=prec)
        dk_j = jnp.einsum("bkgts,btkgd->bskd", ds, q_g,
                          preferred_element_type=acc, precision=prec)
        return dq, (dk_j * scale, dv_j, d_bias_j)

    indices = jnp.arange(num_chunks)
    dq0 = varying_like(jnp.zeros((batch, seq_q, kv_heads, group, head_dim), acc), q)
    dq, (dk, dv, d_bias) = lax.scan(step, dq0, (indices, k_chunks, v_chunks, kv_seg_chunks))

    def unchunk(x):  # [S/block, B, block, K, D] -> [B, S, K, D]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(batch, -1, kv_heads, x.shape[-1])[:, :seq_kv]

    dq = (dq * scale).reshape(batch, seq_q, heads, head_dim)
    if not bias_grad:
        return dq, unchunk(dk), unchunk(dv)
    # d_bias: [chunks, B', K', G', T', block or 1] -> the bias's [B', N', T', S'].
    if bias_shape[3] == 1:
        d_bias = jnp.sum(d_bias, axis=0)
    else:
        d_bias = jnp.moveaxis(d_bias, 0, 4).reshape(*d_bias.shape[1:5], -1)[..., :seq_kv]
    return dq, unchunk(dk), unchunk(dv), d_bias.reshape(bias_shape)


def tangent(q, k, v, segment_ids, lse, dq, dk, dv, d_bias, *, mask: MaskSpec, scale: float,
            config: XlaConfig, softcap: float | None = None, bias=None, attn_mask=None):
    """Forward-mode derivative of the logits' softmax, from the residuals, per K/V chunk.

    With P = exp(S - lse) (recomputed, as the backward does) and dS the tangent of the
    (biased, capped) logits, ``dlse = rowsum(P ∘ dS)`` and ``dO = (P ∘ dS)·V + P·dV -
    dlse ∘ O``. Returns ``(P∘dS)·V + P·dV`` as ``[B, T, N, Dv]`` and ``dlse [B, N, T]``, both
    in the accumulator dtype; the caller subtracts ``dlse ∘ O`` (after adding the sinks'
    share of ``dlse``). ``dq``, ``dk``, ``dv``, ``d_bias``: tangents, or None for zero.
    """
    acc = _accumulator(q.dtype)
    batch, seq_q, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    block = min(config.block_kv, k.shape[1])
    prec = _precision(q.dtype)
    q_g = _grouped(q, kv_heads)
    dq_g = None if dq is None else _grouped(dq, kv_heads)
    lse_g = lse.reshape(batch, kv_heads, group, seq_q)
    q_seg, kv_seg_chunks = _segment_chunks(segment_ids, block)
    k_chunks, v_chunks = _chunks(k, block), _chunks(v, block)
    num_chunks = k_chunks.shape[0]
    dk_chunks, dv_chunks = (None if x is None else _chunks(x, block) for x in (dk, dv))
    bias, attn_mask, d_bias = (_padded_keys(x, num_chunks, block)
                               for x in (bias, attn_mask, d_bias))
    logits_move = dq is not None or dk is not None or d_bias is not None

    def step(carry, xs):
        pv, d_lse = carry
        index, k_j, v_j, kv_seg, dk_j, dv_j = xs
        segments = None if q_seg is None else (q_seg, kv_seg)
        s, visible, slope = _scores(q_g, k_j, scale, softcap, mask, index * block, block,
                                    segments, _chunk(bias, index, block, kv_heads),
                                    _chunk(attn_mask, index, block, kv_heads))
        p = jnp.where(visible, jnp.exp(s - lse_g[..., None]), 0.0)
        if dv_j is not None:
            pv = pv + jnp.einsum("bkgts,bskd->bkgtd", p.astype(dv_j.dtype), dv_j,
                                 preferred_element_type=acc, precision=prec)
        if not logits_move:
            return (pv, d_lse), None
        ds = 0.0
        if dq_g is not None:
            ds = ds + jnp.einsum("btkgd,bskd->bkgts", dq_g, k_j,
                                 preferred_element_type=acc, precision=prec)
        if dk_j is not None:
            ds = ds + jnp.einsum("btkgd,bskd->bkgts", q_g, dk_j,
                                 preferred_element_type=acc, precision=prec)
        ds = ds * scale
        if slope is not None:  # chain rule through c·tanh(x/c)
            ds = ds * slope
        if d_bias is not None:
            ds = ds + _chunk(d_bias, index, block, kv_heads).astype(acc)
        pds = p * ds  # 0 where hidden: P is
        pv = pv + jnp.einsum("bkgts,bskd->bkgtd", pds.astype(v_j.dtype), v_j,
                             preferred_element_type=acc, precision=prec)
        return (pv, d_lse + jnp.sum(pds, axis=-1)), None

    value_dim = v.shape[3]
    init = tuple(varying_like(x, q) for x in (
        jnp.zeros((batch, kv_heads, group, seq_q, value_dim), acc),
        jnp.zeros((batch, kv_heads, group, seq_q), acc),
    ))
    indices = jnp.arange(num_chunks)
    (pv, d_lse), _ = lax.scan(step, init, (indices, k_chunks, v_chunks, kv_seg_chunks,
                                           dk_chunks, dv_chunks))
    pv = jnp.transpose(pv.reshape(batch, heads, seq_q, value_dim), (0, 2, 1, 3))
    return pv, d_lse.reshape(batch, heads, seq_q)


KERNELS = Kernels(name="xla", forward=forward, backward=backward, row_bounds=True)


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False, value_head_dim: int | None = None) -> str | None:
    """The XLA path runs every call the API accepts, with any query/key head dim and any
    value head dim (``value_head_dim``, None: the queries')."""
    del q_shape, kv_shape, dtype, mask, has_segments, softcap, has_bias, has_mask
    del value_head_dim
    return None


def default_config(q_shape, kv_shape, dtype, mask: MaskSpec) -> XlaConfig:
    """512-key chunks: large enough for good matmuls, small enough for long sequences."""
    del q_shape, kv_shape, dtype, mask
    return XlaConfig()

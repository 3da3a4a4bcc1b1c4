"""Standard attention in plain JAX, and a float64 NumPy oracle.

* :func:`standard_attention` — the baseline the FlashAttention paper improves on: it
  materialises S = Q·Kᵀ·scale and P = softmax(S), O(L²) memory.
* :func:`attention_float64` — the oracle the tests compare every implementation against:
  float64 NumPy, forward and gradients derived directly from softmax.

The papers' tiled loops, written the same way, are :mod:`pallas_flash.tutorial.loops`.

Both take ``q: [batch, seq_q, heads, head_dim]``, ``k: [batch, seq_kv, kv_heads,
head_dim]`` and ``v: [batch, seq_kv, kv_heads, value_dim]`` (GQA: ``heads`` a multiple of
``kv_heads``; ``value_dim`` may differ from ``head_dim``), optionally a ``bias`` added to the
scaled logits and a boolean ``attn_mask`` (``False`` hides a pair), both broadcastable to
``[batch, heads, seq_q, seq_kv]`` (see :mod:`pallas_flash.bias`), and return ``out:
[batch, seq_q, heads, value_dim]`` and ``lse: [batch, heads, seq_q]`` (natural log,
float32; rows that see no key get out 0 and lse :data:`EMPTY_ROW_LSE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.bias import canonical, sum_to_shape
from pallas_flash.contract import EMPTY_ROW_LSE
from pallas_flash.masking import MaskSpec, segments_visible


def _expand_kv(x: jax.Array, heads: int) -> jax.Array:
    """[B, S, K, D] -> [B, S, heads, D] by repeating each KV head for its query group."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def _default_mask(q, k, mask: MaskSpec | None) -> MaskSpec:
    return mask if mask is not None else MaskSpec(seq_q=q.shape[1], seq_kv=k.shape[1])


def _scale(q, scale):
    return 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else scale


def _logit_arrays(q, k, bias, attn_mask):
    """bias, attn_mask in canonical rank-4 form (or None), for the logits [B, N, T, S]."""
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return (None if bias is None else canonical(bias, "bias", shape),
            None if attn_mask is None else canonical(attn_mask, "attn_mask", shape))


@functools.partial(jax.jit, static_argnames=("scale", "mask"))
def standard_attention(q, k, v, *, scale: float | None = None, mask: MaskSpec | None = None,
                       segment_ids=None, bias=None, attn_mask=None):
    """O = softmax(Q·Kᵀ·scale + bias)·V with S and P materialised. Returns ``(out, lse)``.

    ``segment_ids``: None or ``(q_segment_ids [B, Tq], kv_segment_ids [B, Tk])``.
    """
    mask = _default_mask(q, k, mask)
    heads = q.shape[2]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k, preferred_element_type=jnp.float32)
    s = s * _scale(q, scale)
    bias, attn_mask = _logit_arrays(q, k, bias, attn_mask)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    visible = mask.block_visible(0, q.shape[1], 0, k.shape[1])
    if segment_ids is not None:
        visible = visible & segments_visible(*segment_ids)[:, None]
    if attn_mask is not None:
        visible = visible & attn_mask
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bnqk,bknd->bqnd", p / jnp.where(l == 0, 1.0, l), v.astype(jnp.float32))
    lse = jnp.where(l[..., 0] == 0, EMPTY_ROW_LSE, m[..., 0] + jnp.log(l[..., 0]))
    return out.astype(q.dtype), lse


def attention_float64(q, k, v, *, scale: float | None = None, mask: MaskSpec | None = None,
                      segment_ids=None, softcap: float | None = None, sinks=None, bias=None,
                      attn_mask=None, d_out=None):
    """Float64 NumPy oracle. Returns ``(out, lse)``, or ``(out, lse, grads)`` when ``d_out``
    (shaped like ``out``) is given.

    Gradients come straight from the softmax Jacobian, not from the FlashAttention
    backward's delta identity, so the two derivations check each other. ``softcap``: logits
    become ``softcap · tanh(logits / softcap)``; ``bias`` is added after that; ``sinks``
    ([heads]): one extra logit per head with a zero value. ``grads`` is ``(dq, dk, dv)``,
    followed by ``d_sinks`` when ``sinks`` is given and ``d_bias`` (shaped like ``bias``)
    when ``bias`` is given.
    """
    bias_shape = np.shape(bias)
    bias, attn_mask = _logit_arrays(q, k, bias, attn_mask)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mask, scale = _default_mask(q, k, mask), _scale(q, scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    visible = np.asarray(mask.block_visible(0, q.shape[1], 0, k.shape[1]))
    if segment_ids is not None:
        q_seg, kv_seg = (np.asarray(x) for x in segment_ids)
        visible = visible & segments_visible(q_seg, kv_seg)[:, None]
    if attn_mask is not None:
        visible = visible & np.asarray(attn_mask)
    # optimize=True: einsum then calls BLAS (its own loops take ~30 s at L 2048, d 128).
    s = np.einsum("bqnd,bknd->bnqk", q, k_rep, optimize=True) * scale
    slope = 1.0
    if softcap is not None:
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1.0 - t * t
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    s = np.where(visible, s, -np.inf)
    if sinks is not None:  # the sink is one more column with logit sinks[head]
        sink_col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                   (*s.shape[:3], 1))
        s = np.concatenate([s, sink_col], axis=-1)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = p / np.where(l == 0, 1.0, l)
    p_sink = None
    if sinks is not None:
        p, p_sink = p[..., :-1], p[..., -1:]
    out = np.einsum("bnqk,bknd->bqnd", p, v_rep, optimize=True)
    l = l[..., 0]
    lse = np.where(l == 0, EMPTY_ROW_LSE, m[..., 0] + np.log(np.where(l == 0, 1.0, l)))
    if d_out is None:
        return out, lse
    d_out = np.asarray(d_out, np.float64)
    dv_rep = np.einsum("bnqk,bqnd->bknd", p, d_out, optimize=True)
    dp = np.einsum("bqnd,bknd->bnqk", d_out, v_rep, optimize=True)
    # Softmax Jacobian: dS_ij = P_ij (dP_ij - sum_l P_il dP_il) (the sink's dP is 0). It is
    # the gradient of the biased logits, so of the bias; the soft-cap's slope follows.
    row = np.sum(p * dp, axis=-1, keepdims=True)
    d_logits = p * (dp - row)
    ds = d_logits * slope
    dq = np.einsum("bnqk,bknd->bqnd", ds, k_rep, optimize=True) * scale
    dk_rep = np.einsum("bnqk,bqnd->bknd", ds, q, optimize=True) * scale
    b, s_kv = k.shape[:2]
    dk = dk_rep.reshape(b, s_kv, kv_heads, group, k.shape[3]).sum(axis=3)
    dv = dv_rep.reshape(b, s_kv, kv_heads, group, v.shape[3]).sum(axis=3)
    grads = (dq, dk, dv)
    if sinks is not None:
        grads += (np.sum(p_sink * (0.0 - row), axis=(0, 2, 3)),)
    if bias is not None:
        grads += (sum_to_shape(d_logits, bias.shape).reshape(bias_shape),)
    return out, lse, grads

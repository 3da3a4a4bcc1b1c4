"""The papers' algorithms in plain JAX, and a float64 NumPy oracle.

* :func:`standard_attention` — the baseline the FlashAttention paper improves on: it
  materialises S = Q·Kᵀ·scale and P = softmax(S), O(L²) memory.
* :func:`flash_attention_v1` — FlashAttention (Dao et al. 2022, Algorithm 1): the outer
  loop runs over K/V blocks, the inner loop over Q blocks; O, l and m live in "HBM" and are
  read, rescaled and written back at every step.
* :func:`flash_attention_v2` — FlashAttention-2 (Dao 2023, Algorithm 1): the outer loop
  runs over Q blocks (one per thread block on a GPU), the inner loop over K/V blocks with
  O, l, m kept "on chip"; the output is normalised once at the end, the causal loop stops
  at the diagonal, and only blocks crossing the mask boundary are masked.
* :func:`attention_float64` — the oracle the tests compare every implementation against:
  float64 NumPy, forward and gradients derived directly from softmax.

All take ``q: [batch, seq_q, heads, head_dim]`` and ``k, v: [batch, seq_kv, kv_heads,
head_dim]`` (GQA: ``heads`` a multiple of ``kv_heads``), optionally a ``bias`` added to the
scaled logits and a boolean ``attn_mask`` (``False`` hides a pair), both broadcastable to
``[batch, heads, seq_q, seq_kv]`` (see :mod:`pallas_flash.bias`), and return ``out`` shaped
like ``q`` and ``lse: [batch, heads, seq_q]`` (natural log, float32; rows that see no key
get out 0 and lse :data:`EMPTY_ROW_LSE`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.bias import canonical, sum_to_shape
from pallas_flash.contract import EMPTY_ROW_LSE
from pallas_flash.masking import MaskSpec, segments_visible

# Logit given to hidden pairs inside the loops: exp(MASKED - m) underflows to 0 for any
# real row maximum m, and it is finite, so (MASKED - MASKED) is 0, not NaN.
_MASKED = -1e30


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


def _logit_tile(x, q_start: int, block_q: int, k_start: int, block_kv: int):
    """The [.., block_q, block_kv] tile of a canonical bias/mask (broadcast dims kept 1)."""
    rows = slice(q_start, q_start + block_q) if x.shape[2] > 1 else slice(None)
    cols = slice(k_start, k_start + block_kv) if x.shape[3] > 1 else slice(None)
    return x[:, :, rows, cols]


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


def _tile_scores(q_i, k_j, scale, mask: MaskSpec, q_start, k_start, bias, attn_mask):
    """S_ij = Q_i·K_jᵀ·scale (+ bias) for one tile, hidden pairs set to _MASKED.

    q_i: [B, Br, N, D]; bias, attn_mask: None or canonical [B', N', T', S'] arrays.
    """
    block_q, block_kv = q_i.shape[1], k_j.shape[1]
    s = jnp.einsum("bqnd,bknd->bnqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        s = s + _logit_tile(bias, q_start, block_q, k_start, block_kv).astype(jnp.float32)
    visible = mask.block_visible(q_start, block_q, k_start, block_kv)
    if attn_mask is not None:
        visible = visible & _logit_tile(attn_mask, q_start, block_q, k_start, block_kv)
    return jnp.where(visible, s, _MASKED), visible


@functools.partial(jax.jit, static_argnames=("scale", "mask", "block_q", "block_kv"))
def flash_attention_v1(q, k, v, *, scale: float | None = None, mask: MaskSpec | None = None,
                       block_q: int = 32, block_kv: int = 32, bias=None, attn_mask=None):
    """FlashAttention (Algorithm 1): K/V blocks outer, Q blocks inner. Returns ``(out, lse)``.

    Sequence lengths must be multiples of the block sizes (this is a teaching reference).
    """
    mask, scale = _default_mask(q, k, mask), _scale(q, scale)
    bias, attn_mask = _logit_arrays(q, k, bias, attn_mask)
    batch, seq_q, heads, head_dim = q.shape
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    # Line 2: O = 0, l = 0, m = -inf in HBM (here: full-size arrays).
    o = jnp.zeros((batch, heads, seq_q, head_dim), jnp.float32)
    l = jnp.zeros((batch, heads, seq_q), jnp.float32)
    m = jnp.full((batch, heads, seq_q), _MASKED, jnp.float32)
    for k_start in range(0, k.shape[1], block_kv):          # line 5: outer loop over K_j, V_j
        k_j = k[:, k_start:k_start + block_kv]
        v_j = v[:, k_start:k_start + block_kv].astype(jnp.float32)
        for q_start in range(0, seq_q, block_q):            # line 7: inner loop over Q_i
            rows = slice(q_start, q_start + block_q)
            s_ij, visible = _tile_scores(q[:, rows], k_j, scale, mask, q_start, k_start,
                                         bias, attn_mask)
            # Line 10: tile statistics m~_ij, P~_ij, l~_ij.
            m_tile = jnp.max(s_ij, axis=-1)
            p_tile = jnp.where(visible, jnp.exp(s_ij - m_tile[..., None]), 0.0)
            l_tile = jnp.sum(p_tile, axis=-1)
            # Line 11: merge with the running statistics read from HBM.
            m_old, l_old = m[..., rows], l[..., rows]
            m_new = jnp.maximum(m_old, m_tile)
            l_new = jnp.exp(m_old - m_new) * l_old + jnp.exp(m_tile - m_new) * l_tile
            # Line 12: O_i = diag(l_new)^-1 (diag(l_old) e^(m_old-m_new) O_i + e^(m~-m_new) P~ V_j).
            pv = jnp.einsum("bnqk,bknd->bnqd", p_tile, v_j)
            o_i = (l_old * jnp.exp(m_old - m_new))[..., None] * o[:, :, rows] + \
                jnp.exp(m_tile - m_new)[..., None] * pv
            o_i = o_i / jnp.where(l_new == 0, 1.0, l_new)[..., None]
            # Line 13: write O_i, l_i, m_i back to HBM.
            o = o.at[:, :, rows].set(o_i)
            l = l.at[..., rows].set(l_new)
            m = m.at[..., rows].set(m_new)
    lse = jnp.where(l == 0, EMPTY_ROW_LSE, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    return jnp.transpose(o, (0, 2, 1, 3)).astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("scale", "mask", "block_q", "block_kv"))
def flash_attention_v2(q, k, v, *, scale: float | None = None, mask: MaskSpec | None = None,
                       block_q: int = 32, block_kv: int = 32, bias=None, attn_mask=None):
    """FlashAttention-2 (Algorithm 1): Q blocks outer, K/V blocks inner. Returns ``(out, lse)``.

    Sequence lengths must be multiples of the block sizes (this is a teaching reference).
    """
    mask, scale = _default_mask(q, k, mask), _scale(q, scale)
    bias, attn_mask = _logit_arrays(q, k, bias, attn_mask)
    batch, seq_q, heads, head_dim = q.shape
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    outs, lses = [], []
    for q_start in range(0, seq_q, block_q):                # line 3: one Q_i per thread block
        q_i = q[:, q_start:q_start + block_q]
        o_i = jnp.zeros((batch, heads, block_q, head_dim), jnp.float32)
        l_i = jnp.zeros((batch, heads, block_q), jnp.float32)
        m_i = jnp.full((batch, heads, block_q), _MASKED, jnp.float32)
        # Blocks outside [first, last) are never visited (causal: the loop ends at the
        # diagonal); blocks inside [full_first, full_last) need no mask.
        first, full_first, full_last, last = (
            int(x) for x in mask.kv_blocks(q_start, block_q, block_kv))
        for j in range(first, last):                         # line 6: loop over K_j, V_j
            k_start = j * block_kv
            k_j = k[:, k_start:k_start + block_kv]
            v_j = v[:, k_start:k_start + block_kv].astype(jnp.float32)
            s_ij = jnp.einsum("bqnd,bknd->bnqk", q_i, k_j,
                              preferred_element_type=jnp.float32) * scale
            if bias is not None:
                s_ij = s_ij + _logit_tile(bias, q_start, block_q, k_start, block_kv)
            # A mask array can hide pairs in any tile, not only at the band's edges.
            needs_mask = attn_mask is not None or not full_first <= j < full_last
            if needs_mask:
                visible = mask.block_visible(q_start, block_q, k_start, block_kv)
                if attn_mask is not None:
                    visible = visible & _logit_tile(attn_mask, q_start, block_q, k_start,
                                                    block_kv)
                s_ij = jnp.where(visible, s_ij, _MASKED)
            # Line 9: m_new = max(m_old, rowmax(S_ij)), P~ = exp(S_ij - m_new).
            m_new = jnp.maximum(m_i, jnp.max(s_ij, axis=-1))
            p_ij = jnp.exp(s_ij - m_new[..., None])
            if needs_mask:
                p_ij = jnp.where(visible, p_ij, 0.0)
            # Line 10: O_i stays unnormalised; only the e^(m_old - m_new) correction is applied.
            alpha = jnp.exp(m_i - m_new)
            l_i = alpha * l_i + jnp.sum(p_ij, axis=-1)
            o_i = alpha[..., None] * o_i + jnp.einsum("bnqk,bknd->bnqd", p_ij, v_j)
            m_i = m_new
        # Lines 12-13: normalise once; L_i = m_i + log(l_i).
        outs.append(o_i / jnp.where(l_i == 0, 1.0, l_i)[..., None])
        safe_l = jnp.where(l_i == 0, 1.0, l_i)
        lses.append(jnp.where(l_i == 0, EMPTY_ROW_LSE, m_i + jnp.log(safe_l)))
    out = jnp.concatenate(outs, axis=2)
    return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype), jnp.concatenate(lses, axis=-1)


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
    b, s_kv, _, d = k.shape
    dk = dk_rep.reshape(b, s_kv, kv_heads, group, d).sum(axis=3)
    dv = dv_rep.reshape(b, s_kv, kv_heads, group, d).sum(axis=3)
    grads = (dq, dk, dv)
    if sinks is not None:
        grads += (np.sum(p_sink * (0.0 - row), axis=(0, 2, 3)),)
    if bias is not None:
        grads += (sum_to_shape(d_logits, bias.shape).reshape(bias_shape),)
    return out, lse, grads

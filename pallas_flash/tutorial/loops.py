"""The FlashAttention papers' forward loops, line by line, in plain JAX.

* :func:`flash_attention_v1` — FlashAttention (Dao et al. 2022, Algorithm 1): the outer
  loop runs over K/V blocks, the inner loop over Q blocks; O, l and m live in "HBM" and are
  read, rescaled and written back at every step.
* :func:`flash_attention_v2` — FlashAttention-2 (Dao 2023, Algorithm 1): the outer loop
  runs over Q blocks (one per thread block on a GPU), the inner loop over K/V blocks with
  O, l, m kept "on chip"; the output is normalised once at the end, the causal loop stops
  at the diagonal, and only blocks crossing the mask boundary are masked.

Both take the arguments of :func:`pallas_flash.reference.standard_attention` plus the tile
sizes, and return what it returns: ``out`` shaped like ``q`` and ``lse: [batch, heads,
seq_q]`` (natural log, float32; rows that see no key get out 0 and lse
:data:`~pallas_flash.contract.EMPTY_ROW_LSE`). The loops unroll into the jitted program:
they are for reading and for checking the kernels, not for speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash.arguments import canonical_scale, check_positive_int
from pallas_flash.bias import canonical
from pallas_flash.contract import EMPTY_ROW_LSE
from pallas_flash.dispatch import check_arrays
from pallas_flash.masking import MaskSpec

# Logit given to hidden pairs inside the loops: exp(MASKED - m) underflows to 0 for any
# real row maximum m, and it is finite, so (MASKED - MASKED) is 0, not NaN.
_MASKED = -1e30


def _logit_tile(x, q_start: int, block_q: int, k_start: int, block_kv: int):
    """The [.., block_q, block_kv] tile of a canonical bias/mask (broadcast dims kept 1)."""
    rows = slice(q_start, q_start + block_q) if x.shape[2] > 1 else slice(None)
    cols = slice(k_start, k_start + block_kv) if x.shape[3] > 1 else slice(None)
    return x[:, :, rows, cols]


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
def flash_attention_v1(q: jax.Array, k: jax.Array, v: jax.Array, *,
                       scale: float | None = None, mask: MaskSpec | None = None,
                       block_q: int = 32, block_kv: int = 32, bias: jax.Array | None = None,
                       attn_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """FlashAttention (Algorithm 1): K/V blocks outer, Q blocks inner. Returns ``(out, lse)``.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]``
        (``heads`` a multiple of ``kv_heads``).
      scale: softmax scale, default ``1/√head_dim``.
      mask: the structured mask (default: none).
      block_q, block_kv: tile sizes B_r and B_c; they must divide ``seq_q`` and ``seq_kv``.
      bias, attn_mask: added to the scaled logits / ``False`` hides a pair; broadcastable
        to ``[batch, heads, seq_q, seq_kv]``.

    Returns:
      ``out`` shaped and typed like ``q``, ``lse: [batch, heads, seq_q]`` float32.
    """
    k, v, scale, mask, bias, attn_mask = _loop_inputs(q, k, v, scale, mask, bias, attn_mask,
                                                      block_q, block_kv)
    batch, seq_q, heads, head_dim = q.shape
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
def flash_attention_v2(q: jax.Array, k: jax.Array, v: jax.Array, *,
                       scale: float | None = None, mask: MaskSpec | None = None,
                       block_q: int = 32, block_kv: int = 32, bias: jax.Array | None = None,
                       attn_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """FlashAttention-2 (Algorithm 1): Q blocks outer, K/V blocks inner. Returns ``(out, lse)``.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]``
        (``heads`` a multiple of ``kv_heads``).
      scale: softmax scale, default ``1/√head_dim``.
      mask: the structured mask (default: none).
      block_q, block_kv: tile sizes B_r and B_c; they must divide ``seq_q`` and ``seq_kv``.
      bias, attn_mask: added to the scaled logits / ``False`` hides a pair; broadcastable
        to ``[batch, heads, seq_q, seq_kv]``.

    Returns:
      ``out`` shaped and typed like ``q``, ``lse: [batch, heads, seq_q]`` float32.
    """
    k, v, scale, mask, bias, attn_mask = _loop_inputs(q, k, v, scale, mask, bias, attn_mask,
                                                      block_q, block_kv)
    batch, seq_q, heads, head_dim = q.shape
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




def _loop_inputs(q, k, v, scale, mask, bias, attn_mask, block_q, block_kv):
    """The loops' arguments, checked, in the form the loops read them: K and V repeated to
    q's heads, the scale as a float, the mask (default: none hidden), and bias / attn_mask
    in :func:`pallas_flash.bias.canonical`'s rank-4 form (or None).

    Raises ValueError unless q, k, v are attention inputs and each tile size is a positive
    int dividing its sequence length (the loops take whole tiles).
    """
    check_arrays(q, k, v)
    batch, seq_q, heads, head_dim = q.shape
    seq_kv = k.shape[1]
    for name, block, length in (("block_q", block_q, seq_q), ("block_kv", block_kv, seq_kv)):
        check_positive_int(block, name)
        if length % block:
            raise ValueError(f"{name} ({block}) must divide the sequence length ({length}): "
                             "the loops take whole tiles")
    logits = (batch, heads, seq_q, seq_kv)
    group = heads // k.shape[2]
    return (jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2),
            canonical_scale(scale, head_dim),
            MaskSpec(seq_q, seq_kv) if mask is None else mask,
            None if bias is None else canonical(bias, "bias", logits),
            None if attn_mask is None else canonical(attn_mask, "attn_mask", logits))

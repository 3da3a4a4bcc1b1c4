"""The online softmax of the forward kernels (FlashAttention-3, Alg. 1 lines 9-11), in base 2.

m is kept in log2 units, so that ``p = exp2(s · scale·log2e − m)`` is one FMA and one
``ex2`` per element: the softmax scale is folded into the exponent instead of scaling the
tile. The bf16 kernel's scale is a Python float; the FP8 kernel's is traced, since it
also dequantizes S (``scale·log2e · s_Q · s_K,j``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.mosaic.tiles import row


def online_softmax_step(scores: jax.Array, m_i: jax.Array, scale_log2, *,
                        guard_empty: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of the online softmax: ``(p, m_new, alpha)``.

    Args:
      scores: ``[block_q, block_kv]`` float32 S_j, hidden pairs already ``-inf``.
      m_i: ``[block_q]`` the running row max, in log2 units.
      scale_log2: the factor that takes ``scores`` to log2 units (float or traced scalar),
        or None when they already are (a soft-cap or a bias changed the tile itself).
      guard_empty: some row may have seen only ``-inf`` so far (masked blocks, a bias):
        it keeps m = -inf and subtracts 0 instead, so that its p and alpha stay 0 rather
        than NaN (empty rows end with l = 0).

    Returns:
      ``p = exp2(s - m_new)`` unnormalised, the new max, and ``alpha = exp2(m_i - m_new)``,
      the factor that rescales O and l to the new max.
    """
    def to_log2(x):
        return x if scale_log2 is None else x * scale_log2

    m_new = jnp.maximum(m_i, to_log2(scores.max(axis=1)))
    m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard_empty else m_new
    p = jnp.exp2(to_log2(scores) - row(m_sub, scores.shape))
    alpha = jnp.exp2(m_i - m_sub)
    return p, m_new, alpha

"""The forward kernels' epilogue (FlashAttention-3, Alg. 1 lines 12-14): O is normalised
once, and O and the log-sum-exp leave through SMEM tiles with TMA stores; or, for ring
attention, the tile's partial result is first merged into a running one of other keys."""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_flash.contract import EMPTY_ROW_LSE
from pallas_flash.mosaic.tiles import LN2, LOG2E, row


def normalized(o: jax.Array, m_i: jax.Array, l_i: jax.Array, *, fp8_scales=None
               ) -> tuple[jax.Array, jax.Array]:
    """``(O / l, lse)`` of one consumer's rows.

    ``m_i`` (log2 units) and ``l_i``: the online softmax's running max and sum; rows that
    saw no key (l = 0) give O = 0 and lse ``EMPTY_ROW_LSE``. ``fp8_scales``: the FP8
    kernel's ``(s_V, P's scale)``: its accumulator holds O · P's scale / s_V of the last
    block, undone in the same multiply. lse is the natural log of the softmax denominator.
    """
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    scale = 1.0 if fp8_scales is None else fp8_scales[0] / fp8_scales[1]
    o = o * row(scale / l_safe, o.shape)
    lse = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(l_safe)) * LN2)
    return o, lse


def store_rows(o_tile, lse_tile, out_gmem, lse_gmem) -> None:
    """O and lse, already written to their SMEM tiles, to GMEM by TMA (not awaited);
    ``o_tile`` None: lse only (O was stored from the registers)."""
    plgpu.commit_smem()  # register stores -> visible to the TMA engine
    if o_tile is not None:
        plgpu.copy_smem_to_gmem(o_tile, out_gmem)
    plgpu.copy_smem_to_gmem(lse_tile, lse_gmem)


def merged_into(o: jax.Array, m_i: jax.Array, l_i: jax.Array, prev_out: jax.Array,
                prev_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(O, lse)`` of one consumer's rows merged with a partial result over other keys.

    ``prev_out`` ([rows, head_dim] float32, normalised) and ``prev_lse`` ([rows], natural
    log; ``EMPTY_ROW_LSE`` or -inf where no key was seen) stand for the running softmax
    state ``m = lse·log2e, l = 1, O = prev_out``: one more online-softmax rescale (Alg. 1
    line 10) joins it to this tile's ``(o, m_i, l_i)`` exactly, as
    :func:`pallas_flash.decode.merge_splits` joins two partials, with no pass of its own.
    Rows empty on both sides give O = 0 and lse ``EMPTY_ROW_LSE``.
    """
    m_prev = jnp.maximum(prev_lse, EMPTY_ROW_LSE) * LOG2E  # finite, so m below is too
    # One difference decides which side leads and scales the other: ``m_prev - max(...)``
    # is not reliably 0 when m_prev leads (the compiler may contract or recompute the
    # product: a rounding error of m_prev ~ 1e30 is ~ 1e22, and its exp2 is inf).
    gap = m_i - m_prev
    new_leads = gap >= 0
    scaled = jnp.exp2(-jnp.abs(gap))
    alpha = jnp.where(new_leads, 1.0, scaled)
    beta = jnp.where(new_leads, scaled, 1.0)
    m = jnp.where(new_leads, m_i, m_prev)
    o = o * row(alpha, o.shape) + prev_out * row(beta, o.shape)
    o, lse = normalized(o, m, l_i * alpha + beta)
    return o, jnp.where(m <= EMPTY_ROW_LSE * LOG2E / 2, EMPTY_ROW_LSE, lse)

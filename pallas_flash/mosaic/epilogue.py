"""The forward kernels' epilogue (FlashAttention-3, Alg. 1 lines 12-14): O is normalised
once, and O and the log-sum-exp leave through SMEM tiles with TMA stores."""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_flash.mosaic.tiles import LN2, row
from pallas_flash.reference import EMPTY_ROW_LSE


def normalized(o: jax.Array, m_i: jax.Array, l_i: jax.Array, o_scale=None
               ) -> tuple[jax.Array, jax.Array]:
    """``(O / l · o_scale, lse)`` of one consumer's rows.

    ``m_i`` (log2 units) and ``l_i``: the online softmax's running max and sum; rows that
    saw no key (l = 0) give O = 0 and lse ``EMPTY_ROW_LSE``. ``o_scale``: a factor folded
    into the normalisation (the FP8 kernel's dequantization), or None. lse is the natural
    log of the softmax denominator.
    """
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    o = o * row((1.0 if o_scale is None else o_scale) / l_safe, o.shape)
    lse = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(l_safe)) * LN2)
    return o, lse


def store_rows(o_tile, lse_tile, out_gmem, lse_gmem) -> None:
    """O and lse, already written to their SMEM tiles, to GMEM by TMA (not awaited)."""
    plgpu.commit_smem()  # register stores -> visible to the TMA engine
    plgpu.copy_smem_to_gmem(o_tile, out_gmem)
    plgpu.copy_smem_to_gmem(lse_tile, lse_gmem)

"""The forward kernels' epilogue (FlashAttention-3, Alg. 1 lines 12-14): O is normalised
once, and O and the log-sum-exp leave through SMEM tiles with TMA stores."""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_flash.mosaic.tiles import LN2, row
from pallas_flash.reference import EMPTY_ROW_LSE


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
    """O and lse, already written to their SMEM tiles, to GMEM by TMA (not awaited)."""
    plgpu.commit_smem()  # register stores -> visible to the TMA engine
    plgpu.copy_smem_to_gmem(o_tile, out_gmem)
    plgpu.copy_smem_to_gmem(lse_tile, lse_gmem)

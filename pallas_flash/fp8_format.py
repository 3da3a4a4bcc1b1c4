"""The FP8 format shared by the FP8 kernels and :mod:`pallas_flash.fp8` (which the kernels
cannot import: it imports them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: e4m3 without infinities (OCP "fn"): 3 mantissa bits, the operands of Hopper's FP8 wgmma.
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
#: Largest finite e4m3 value.
E4M3_MAX = float(jnp.finfo(E4M3).max)


def tile_scale(amax: jax.Array) -> jax.Array:
    """The e4m3 scale of tiles whose largest magnitudes are ``amax`` (any shape): the
    correctly rounded ``amax / E4M3_MAX``, so the largest magnitude lands on ``E4M3_MAX``;
    an all-zero tile keeps scale 1 (no 0/0).

    The barrier hides the constant divisor from XLA, which would otherwise compile the
    division as a multiply by the rounded reciprocal (XLA:CPU does, in some programs and
    not others, differently on jax 0.11 and 0.12); the GPU quantization kernel divides
    exactly (``div.rn``), and every path must agree with it bit for bit.
    """
    divisor = lax.optimization_barrier(jnp.full_like(amax, E4M3_MAX))
    return jnp.where(amax > 0, amax / divisor, 1.0)

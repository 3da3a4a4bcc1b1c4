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


def divide_exactly(x: jax.Array, divisor: float) -> jax.Array:
    """``x / divisor``, correctly rounded, in every program XLA compiles it into.

    Args:
      x: a float array, any shape.
      divisor: a Python number (a constant of the program, such as ``E4M3_MAX``).

    Returns:
      ``x / divisor`` in ``x``'s dtype and shape.

    XLA's simplifier compiles a division by a constant as a multiply by its rounded
    reciprocal (one ulp off for most ``x`` when the divisor is not a power of two), and
    ``A / broadcast(B)`` the same way on jax 0.11; whether it does depends on the program
    (on jax 0.12 an eager ``x / 448.0`` divides exactly and the same division inside a
    jit does not). The barrier hides the divisor, and a full-shaped one leaves no broadcast
    to rewrite, so the quotient is IEEE's, as the GPU kernels' ``div.rn``.
    """
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or divisor == 0:
        raise ValueError(f"divisor must be a nonzero Python number, got {divisor!r}")
    return x / lax.optimization_barrier(jnp.full_like(x, divisor))


def tile_scale(amax: jax.Array) -> jax.Array:
    """The e4m3 scale of tiles whose largest magnitudes are ``amax`` (any shape): the
    correctly rounded ``amax / E4M3_MAX`` (:func:`divide_exactly`: the GPU quantization
    kernel divides exactly, and every path must agree with it bit for bit), so the largest
    magnitude lands on ``E4M3_MAX``; an all-zero tile keeps scale 1 (no 0/0).
    """
    return jnp.where(amax > 0, divide_exactly(amax, E4M3_MAX), 1.0)

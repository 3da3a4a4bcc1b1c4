"""The FP8 format shared by the FP8 kernels and :mod:`pallas_flash.fp8` (which the kernels
cannot import: it imports them)."""

from __future__ import annotations

import jax.numpy as jnp

#: e4m3 without infinities (OCP "fn"): 3 mantissa bits, the operands of Hopper's FP8 wgmma.
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
#: Largest finite e4m3 value.
E4M3_MAX = float(jnp.finfo(E4M3).max)

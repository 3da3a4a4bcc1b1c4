"""Padding inputs to whole kernel tiles (and slicing the results back).

Kernels work on tiles of ``block`` rows and power-of-two head dims; the user never has to
pad. Padded keys are hidden by ``MaskSpec.seq_kv``; padded query rows are computed and
dropped; zero-padded head-dim columns leave Q·Kᵀ unchanged and give zero output columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pad_axis(x: jax.Array, axis: int, size: int, value: float = 0) -> jax.Array:
    """Pads ``x`` at the end of ``axis`` up to ``size`` (no copy when already there)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)

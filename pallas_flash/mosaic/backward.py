"""Backward of the Mosaic GPU backend: for now, the Triton dK/dV and dQ kernels.

Both backends share the residuals (q, k, v, out, lse) and delta (pallas_flash.autodiff),
so the Triton backward consumes the Mosaic forward's lse unchanged. The import is lazy:
the Triton package is only needed once a gradient is taken.
"""

from __future__ import annotations

import jax

from pallas_flash.masking import MaskSpec


def backward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, out: jax.Array,
             lse: jax.Array, d_out: jax.Array, delta: jax.Array, *, mask: MaskSpec,
             scale: float, config, interpret: bool
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) from the Triton backward with its own default config.

    ``config`` (a MosaicConfig) describes the forward's tiling and does not apply here.
    """
    del config
    from pallas_flash import triton as triton_backend  # lazy: see the module docstring

    triton_config = triton_backend.default_config(q.shape, k.shape, q.dtype, mask)
    return triton_backend.KERNELS.backward(
        q, k, v, segment_ids, out, lse, d_out, delta, mask=mask, scale=scale,
        config=triton_config, interpret=interpret)

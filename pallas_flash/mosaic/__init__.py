"""The Mosaic GPU (Hopper, sm90) backend: a FlashAttention-3 forward kernel.

Exposes the backend interface of :class:`pallas_flash.contract.Backend`: ``KERNELS``,
``default_config``, ``unsupported`` and ``unsupported_backward``; ``SMEM_BUDGET`` (the
shared memory of a Hopper CTA, which the command line reports); and
``DECODE_KERNELS`` (the decode kernel's forward, the same backward) with
:func:`decode_kernels`, which :mod:`pallas_flash.decode` asks for a packed split-KV call;
the FP8 forward (``fp8_forward``, ``Fp8Operands``, ``fp8_default_config``,
``fp8_check_config``) and ``padded_head_dim``, which :mod:`pallas_flash.fp8` reaches
through the dispatcher.
"""

from pallas_flash.contract import Kernels
from pallas_flash.mosaic import decode
from pallas_flash.mosaic.backward import backward, unsupported_backward
from pallas_flash.mosaic.config import (
    CONFIG_TYPES,
    SMEM_BUDGET,
    DecodeConfig,
    MosaicBackwardConfig,
    MosaicCallConfig,
    MosaicConfig,
    default_backward_config,
    default_config,
    padded_head_dim,
)
from pallas_flash.mosaic.forward import forward, unsupported
from pallas_flash.mosaic.forward_fp8 import Fp8Operands
from pallas_flash.mosaic.forward_fp8 import check_config as fp8_check_config
from pallas_flash.mosaic.forward_fp8 import default_config as fp8_default_config
from pallas_flash.mosaic.forward_fp8 import forward as fp8_forward

# The forward merges into a running (out, lse) in its epilogue (ring attention's steps).
# The kernels take bounds= (interpret-mode tests: tests/test_mosaic_bounds.py), but calls
# still reach them with the bounds as segment ids: row_bounds stays off until
# tests/gpu/test_mosaic_bounds_gpu.py passes on a Hopper card.
KERNELS = Kernels(name="mosaic", forward=forward, backward=backward, merges_into=True)
# The backward of a decode call is the main one: its config is the backward's default
# (mosaic.config.backward_config ignores a DecodeConfig).
DECODE_KERNELS = Kernels(name="mosaic", forward=decode.forward, backward=backward)


def decode_kernels(q_shape, kv_shape, dtype, mask, *, has_segments: bool, has_mask: bool,
                   config) -> tuple[Kernels, object] | None:
    """``(DECODE_KERNELS, its DecodeConfig)`` for a packed split-KV decode call (queries
    ``[chunks, rows, kv_heads, head_dim]`` against cache chunks) that the decode kernel
    runs, else None (the call takes :data:`KERNELS`). ``config``: the caller's, None or a
    :class:`DecodeConfig` for the decode kernel (any other Mosaic config: None).

    Raises:
      ValueError: a :class:`DecodeConfig` given for a call the decode kernel cannot run.
    """
    if config is not None and not isinstance(config, DecodeConfig):
        return None
    chosen = decode.decode_config(config, q_shape, kv_shape, dtype)
    reason = decode.unsupported(q_shape, kv_shape, dtype, mask, has_segments=has_segments,
                                has_mask=has_mask, config=chosen)
    if reason is None:
        return DECODE_KERNELS, chosen
    if config is not None:
        raise ValueError(f"config={config!r} is for the Mosaic decode kernel: {reason}")
    return None


__all__ = ["CONFIG_TYPES", "DECODE_KERNELS", "KERNELS", "SMEM_BUDGET", "DecodeConfig",
           "Fp8Operands", "MosaicBackwardConfig", "MosaicCallConfig", "MosaicConfig",
           "decode_kernels", "default_backward_config", "default_config", "forward",
           "fp8_check_config", "fp8_default_config", "fp8_forward", "padded_head_dim",
           "unsupported", "unsupported_backward"]

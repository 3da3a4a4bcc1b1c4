"""The Mosaic GPU (Hopper, sm90) backend: a FlashAttention-3 forward kernel.

Exposes the backend interface of :mod:`pallas_flash.api`: ``KERNELS``,
``default_config``, ``unsupported`` and ``unsupported_backward``.
"""

from pallas_flash.kernel_args import Kernels
from pallas_flash.mosaic.backward import backward, unsupported_backward
from pallas_flash.mosaic.config import (
    CONFIG_TYPES,
    MosaicBackwardConfig,
    MosaicCallConfig,
    MosaicConfig,
    default_backward_config,
    default_config,
)
from pallas_flash.mosaic.forward import forward, unsupported

KERNELS = Kernels(name="mosaic", forward=forward, backward=backward)

__all__ = ["CONFIG_TYPES", "KERNELS", "MosaicBackwardConfig", "MosaicCallConfig",
           "MosaicConfig", "default_backward_config", "default_config", "forward",
           "unsupported", "unsupported_backward"]

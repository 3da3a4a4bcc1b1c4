"""Triton-lowered Pallas kernels: any CUDA GPU, and CPU tests with ``interpret=True``."""

from __future__ import annotations

from pallas_flash.contract import Kernels
from pallas_flash.masking import MaskSpec
from pallas_flash.triton.backward import backward
from pallas_flash.triton.config import (
    PAGED_DECODE_STAGES,
    TritonConfig,
    default_config,
    padded_head_dim,
)
from pallas_flash.triton.decode import split_forward as split_decode_forward
from pallas_flash.triton.forward import forward
from pallas_flash.triton.quantize import kernel_available as fp8_quantizer_available
from pallas_flash.triton.quantize import quantize_tiles as fp8_quantize_tiles
from pallas_flash.triton.quantize import unsupported as fp8_quantizer_unsupported


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False) -> str | None:
    """Every call the API accepts runs here (head dims are padded to powers of two)."""
    del q_shape, kv_shape, dtype, mask, has_segments, softcap, has_bias, has_mask
    return None


KERNELS = Kernels(name="triton", forward=forward, backward=backward)

__all__ = ["KERNELS", "PAGED_DECODE_STAGES", "TritonConfig", "default_config",
           "fp8_quantize_tiles", "fp8_quantizer_available", "fp8_quantizer_unsupported",
           "padded_head_dim", "split_decode_forward", "unsupported"]

"""Triton-lowered Pallas kernels: any CUDA GPU, and CPU tests with ``interpret=True``."""

from __future__ import annotations

from pallas_flash.contract import Kernels
from pallas_flash.masking import MaskSpec
from pallas_flash.triton.backward import backward
from pallas_flash.triton.config import TritonConfig, default_config
from pallas_flash.triton.forward import forward


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False) -> str | None:
    """Every call the API accepts runs here (head dims are padded to powers of two)."""
    del q_shape, kv_shape, dtype, mask, has_segments, softcap, has_bias, has_mask
    return None


KERNELS = Kernels(name="triton", forward=forward, backward=backward, row_bounds=True)

__all__ = ["KERNELS", "TritonConfig", "default_config", "unsupported"]

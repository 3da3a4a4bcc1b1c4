"""Triton-lowered Pallas kernels: any CUDA GPU, and CPU tests with ``interpret=True``."""

from __future__ import annotations

from pallas_flash.contract import Kernels
from pallas_flash.masking import MaskSpec
from pallas_flash.triton.backward import backward
from pallas_flash.triton.config import (
    MAX_HEAD_DIM,
    PAGED_DECODE_STAGES,
    TritonConfig,
    default_config,
    padded_head_dim,
)
from pallas_flash.triton.decode import split_forward as split_decode_forward
from pallas_flash.triton.flex import flex_attention
from pallas_flash.triton.flex import unsupported as flex_unsupported
from pallas_flash.triton.forward import forward
from pallas_flash.triton.quantize import kernel_available as fp8_quantizer_available
from pallas_flash.triton.quantize import quantize_tiles as fp8_quantize_tiles
from pallas_flash.triton.quantize import unsupported as fp8_quantizer_unsupported


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False, value_head_dim: int | None = None) -> str | None:
    """None when these kernels run the call, else why not.

    ``q_shape``: ``[batch, seq_q, heads, head_dim]``, ``kv_shape``: the keys' ``[batch,
    seq_kv, kv_heads, head_dim]``; ``value_head_dim``: the values' head dim (None: the
    same as the queries'). Every call runs whose query/key and value head dims are each at
    most :data:`~pallas_flash.triton.config.MAX_HEAD_DIM` (each is zero-padded to its own
    power of two), whatever the mask, segment ids, soft cap or bias / mask arrays.
    """
    del kv_shape, dtype, mask, has_segments, softcap, has_bias, has_mask
    head_dim = q_shape[-1]
    value_dim = head_dim if value_head_dim is None else value_head_dim
    if max(head_dim, value_dim) > MAX_HEAD_DIM:
        return (f"the Triton kernels take head dims up to {MAX_HEAD_DIM}; got query/key "
                f"head_dim {head_dim} and value head_dim {value_dim}")
    return None


# The kernels take bounds= (interpret-mode tests: tests/test_row_bounds.py), but calls still
# reach them with the bounds as segment ids: row_bounds stays off until
# tests/gpu/test_triton_bounds_gpu.py passes on a GPU.
KERNELS = Kernels(name="triton", forward=forward, backward=backward)

__all__ = ["KERNELS", "PAGED_DECODE_STAGES", "TritonConfig", "default_config", "flex_attention",
           "flex_unsupported", "fp8_quantize_tiles", "fp8_quantizer_available",
           "fp8_quantizer_unsupported", "padded_head_dim", "split_decode_forward", "unsupported"]

"""pallas-flash: FlashAttention for JAX, written as Pallas kernels."""

from pallas_flash.api import (
    attention,
    available_implementations,
    default_implementation,
)
from pallas_flash.decode import decode_attention
from pallas_flash.flex import BlockMask, block_mask_from_dense, create_block_mask
from pallas_flash.masking import MaskSpec
from pallas_flash.paged import paged_attention, write_pages
from pallas_flash.ring import from_zigzag, ring_attention, to_zigzag
from pallas_flash.tuning import autotune

__all__ = ["BlockMask", "MaskSpec", "attention", "autotune", "available_implementations",
           "block_mask_from_dense", "create_block_mask", "decode_attention",
           "default_implementation", "from_zigzag", "paged_attention", "ring_attention",
           "to_zigzag", "write_pages"]
__version__ = "0.1.0"

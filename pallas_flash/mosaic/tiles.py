"""Operands and tiles of the Mosaic GPU kernels: what every kernel of the backend shares.

* the SMEM layout wgmma reads (tiling + swizzle), and GMEM operands padded to it;
* the register split between the consumer warpgroups and the TMA producer (``setmaxnreg``);
* per-row / per-column vectors spread over a WGMMA-layout tile;
* the one detour of interpret mode: a wgmma A operand from registers goes through SMEM.
"""

from __future__ import annotations

import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.mosaic.config import NUM_CONSUMERS
from pallas_flash.padding import pad_axis

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: Input dtypes of the bf16 / fp16 kernels (FP8 has its own, :mod:`.forward_fp8`).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Registers per thread (setmaxnreg): 2 x 232 (consumers) + 40 (producer) = 504 <= 512,
# i.e. the 64 K registers of an SM for 3 x 128 threads.
CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
#: Warpgroup index of the TMA producer with two consumers (it comes after them).
PRODUCER = NUM_CONSUMERS
#: (consumer, producer) registers per consumer count. With three consumers, 4 x 128
#: threads: 3 x 160 + 32 = 512 (FA3's split at head_dim 64).
REGISTERS = {2: (CONSUMER_REGISTERS, PRODUCER_REGISTERS), 3: (160, 32)}
# 128-byte swizzle: one swizzle row is 64 16-bit elements, so every SMEM tile is stored in
# (8, 64) tiles, the layout wgmma reads without bank conflicts.
SWIZZLE = 128


def smem_transforms(itemsize: int, swizzle: int = SWIZZLE) -> tuple:
    """Tiling + swizzle of an SMEM tile as wgmma reads it: (8, swizzle / itemsize) tiles."""
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def row(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcasts a per-row vector (``WGMMA.reduce(1)`` layout) over a [rows, n] tile."""
    return lax.broadcast_in_dim(x, shape, [0])


def col(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcasts a per-column vector (``WGMMA.reduce(0)`` layout) over a [m, cols] tile."""
    return lax.broadcast_in_dim(x, shape, [1])


def a_operand(x: jax.Array, scratch):
    """The A operand of a wgmma: ``x`` from registers (FA3), or with ``scratch`` (interpret
    mode, which cannot run a wgmma whose A operand is in registers) stored there first."""
    if scratch is None:
        return x
    scratch[...] = x
    plgpu.commit_smem()
    return scratch


def pad_operand(x: jax.Array, seq: int, head_dim: int) -> jax.Array:
    """Zero-pads [B, S, H, D] to [B, seq, H, head_dim] (no copy when nothing to pad)."""
    return pad_axis(pad_axis(x, 1, seq), 3, head_dim)

"""Tile sizes and launch parameters of the Triton-lowered kernels."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_flash.masking import MaskSpec
from pallas_flash.padding import next_power_of_2

_WARPS = (1, 2, 4, 8, 16)
#: Query rows up to which the 16-bit forward takes the decode tile (16 rows, 4 warps).
DECODE_ROWS = 16
#: Pipeline stages of the decode tile when it reads K/V through a page table. Each tile's
#: page id is a load the K/V loads wait on, and deeper pipelining hides it: with 5 stages
#: instead of 3 the paged read was 5-15 % faster on the H200 (2026-12-02, head_dim 128,
#: 8 × 32768: 3241 / 3346 GB/s against 3098 / 2914 with pages of 64 / 128; 1 × 131072:
#: 2771 / 2813 against 2494 / 2615; docs/decode.md).
#: fit_row_operands lowers it where the stages do not fit (head_dim 256).
PAGED_DECODE_STAGES = 5


#: The largest head dim (of Q and K, or of V) the kernels take: a row of 512 already needs
#: the smallest tiles (default_config) to keep its accumulator in registers.
MAX_HEAD_DIM = 512


def padded_head_dim(head_dim: int) -> int:
    """The head dim the Triton kernels compute with: a power of two (Triton's block shapes),
    at least 16 (``tl.dot``'s smallest K); inputs are zero-padded to it."""
    return max(16, next_power_of_2(head_dim))


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tiles and launch parameters for the forward and the two backward kernels.

    Attributes:
      block_q, block_kv: forward tile (B_r × B_c in the papers).
      num_warps, num_stages: forward launch; stages = depth of the K/V software pipeline.
      bwd_block_q, bwd_block_kv: backward tile, shared by the dK/dV and dQ kernels.
      bwd_num_warps, bwd_num_stages: backward launch.
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 8
    num_stages: int = 3
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv"):
            value = getattr(self, name)
            # Triton tiles are power-of-two shaped; tl.dot needs at least 16 rows.
            if not (_is_power_of_2(value) and value >= 16):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("num_warps", "bwd_num_warps"):
            if getattr(self, name) not in _WARPS:
                raise ValueError(f"{name} must be one of {_WARPS}, got {getattr(self, name)}")
        for name in ("num_stages", "bwd_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def default_config(q_shape, kv_shape, dtype, mask: MaskSpec) -> TritonConfig:
    """Heuristic tiles by head dim and dtype, shrunk for short sequences (less padding).

    float32: 128 x 64 tiles, 2 stages up to head_dim 128, 64 x 32 above. 16-bit with at
    most :data:`DECODE_ROWS` query rows (a decode step): 16 x 64, 4 warps, 3 stages. Other
    16-bit calls: 128 x 64 with 8 warps and 3 stages up to head_dim 64; 256 x 64 with 16
    warps and 3 stages up to 128; 128 x 64 with 8 warps and 2 stages up to 256 (backward
    64 x 64, 8 warps). Head dims above 256 (up to :data:`MAX_HEAD_DIM`): 64 x 32 tiles
    (backward 32 x 32), 32 x 16 for float32 (backward 16 x 16), sized to fit shared memory
    at head_dim 512, not measured on a GPU. Every tile
    is then capped at the sequence length rounded up to a power of two.
    (measurements: docs/tuning.md#triton-default_config)
    """
    del mask
    head_dim = q_shape[-1]
    if head_dim > 256:
        # Rows of 512: a [64, 512] float32 accumulator alone is 128 KiB of registers, and
        # 2 stages of K and V tiles of 32 (16 in float32) keys fill most of shared memory.
        if jnp.dtype(dtype).itemsize == 4:
            config = TritonConfig(block_q=32, block_kv=16, num_warps=4, num_stages=2,
                                  bwd_block_q=16, bwd_block_kv=16, bwd_num_warps=4)
        else:
            config = TritonConfig(block_q=64, block_kv=32, num_warps=8, num_stages=2,
                                  bwd_block_q=32, bwd_block_kv=32, bwd_num_warps=8)
    elif jnp.dtype(dtype).itemsize == 4:
        # float32 tiles take twice the shared memory of 16-bit ones (227 KiB per block).
        if head_dim <= 128:
            config = TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2)
        else:
            config = TritonConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2,
                                  bwd_block_q=32, bwd_block_kv=32)
    elif q_shape[1] <= DECODE_ROWS:
        # A decode step's packed query rows (pallas_flash.decode): one 16-row tile reads each
        # K/V byte once and does 16 FLOP per byte, so the kernel stays bound by HBM; four
        # warps and three stages of 64 keys were the best or within noise of it at every
        # decode point on the H200 (head_dim 64-256, 1-32 sequences, ragged too; 2026-12-02).
        config = TritonConfig(block_q=16, block_kv=64, num_warps=4, num_stages=3)
    # 16-bit: winners of benchmarks/tune_triton.py on an H200 (bf16, 16k tokens, 2026-11-29).
    elif head_dim <= 64:
        config = TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
    elif head_dim <= 128:
        # 256 query rows over 16 warps: four warpgroups of 64 rows, each K/V tile reused 4×.
        config = TritonConfig(block_q=256, block_kv=64, num_warps=16, num_stages=3)
    else:
        # 256-wide rows: smaller tiles keep Q, K, V and O within shared memory and registers.
        config = TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2,
                              bwd_block_q=64, bwd_block_kv=64, bwd_num_warps=8)
    return shrink_to_sequence(config, q_shape[1], kv_shape[1])


def shrink_to_sequence(config: TritonConfig, seq_q: int, seq_kv: int) -> TritonConfig:
    """Caps tiles at the (power-of-two rounded) sequence lengths."""
    cap_q, cap_kv = max(16, next_power_of_2(seq_q)), max(16, next_power_of_2(seq_kv))
    return dataclasses.replace(
        config,
        block_q=min(config.block_q, cap_q), block_kv=min(config.block_kv, cap_kv),
        bwd_block_q=min(config.bwd_block_q, cap_q), bwd_block_kv=min(config.bwd_block_kv, cap_kv),
    )


#: Shared memory one sm90 block may use; Triton stages each pipelined tile there.
SHARED_MEMORY = 232448


def fit_row_operands(config: TritonConfig, head_dim: int, itemsize: int,
                     row_tile_bytes: int, *, value_dim: int | None = None) -> TritonConfig:
    """The forward's config with ``num_stages``, then ``block_q`` (to 64), then ``block_kv``
    (to 16), then ``block_q`` (to 16) lowered until its pipelined tiles fit in shared memory
    next to a bias/mask tile. ``head_dim`` / ``value_dim``: the (padded) head dims of Q
    and K / of V (None: ``head_dim``).

    ``row_tile_bytes``: bytes per (query row, key) of the bias/mask tiles the forward reads
    with each K/V tile (0 without them; a bias constant along queries counts as one row).
    Triton software-pipelines every load of the K/V loop, so each stage holds a K tile, a V
    tile and the bias/mask tile: a float32 bias tile of 256 × 64 alone is 64 KiB per stage,
    and the bf16 default (256 × 64, 3 stages) then asks for 288 KiB (seen on the H200).
    Stages and tiles change the speed, never the result.
    """
    value_dim = head_dim if value_dim is None else value_dim

    def need(c: TritonConfig) -> int:
        per_stage = (c.block_kv * (head_dim + value_dim) * itemsize
                     + c.block_q * c.block_kv * row_tile_bytes)
        return c.num_stages * per_stage + c.block_q * head_dim * itemsize

    while need(config) > SHARED_MEMORY:
        if config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif config.block_q > 64:
            config = dataclasses.replace(config, block_q=config.block_q // 2)
        elif config.block_kv > 16:
            config = dataclasses.replace(config, block_kv=config.block_kv // 2)
        elif config.block_q > 16:
            config = dataclasses.replace(config, block_q=config.block_q // 2)
        else:
            break
    return config

"""FP8 (e4m3) FlashAttention-3 forward for Hopper (sm90): its operands, configs and entry.

Shah et al. 2024, "FlashAttention-3", Sec. 3.3: both GEMMs run on FP8 tensor cores (twice
the bf16 rate) with one scale per tile (block quantization). The kernel is the bf16 one
(:mod:`pallas_flash.mosaic.forward`) with its operand format set to FP8 (FA3's
``Is_FP8``): a TMA producer warpgroup filling a ``num_stages``-deep K/V ring and two (or
three, ``MosaicConfig.num_consumers``) consumer warpgroups of ``block_q`` rows each that
take turns on the tensor cores, with the same barriers, block skipping
(:meth:`MaskSpec.kv_blocks`) and schedules. This module holds what only FP8 has: its
operands (:class:`Fp8Operands`), default configs and shared-memory accounting.
What FP8 changes, and why:

* **Operands are quantized outside the kernel** (:func:`pallas_flash.fp8.quantize_operands`):
  one float32 scale per tile of ``block_q`` query rows (one consumer's tile) or ``block_kv``
  keys (one ring slot), per head. The kernel reads them as scalars from GMEM.
* **S = Q̃·K̃ᵀ is dequantized in the exponent**: ``s_Q · s_K,j · scale · log2(e)`` is one
  scalar per (Q tile, K tile), so p = exp2(s · c_j − m) stays one FMA + ex2 per element.
* **V is transposed in HBM** (``vt``: ``[batch, kv_heads, head_dim, seq_kv]``): FP8 wgmma
  has no hardware transpose, both operands must be K-major, and for P·V the contraction
  runs over keys, so the B tile must be stored (head_dim × keys). The fused quantization
  (:mod:`pallas_flash.triton.quantize`) writes Vᵀ in the pass that rounds V, so it costs
  no pass of its own; in XLA at most one more pass over V in e4m3 (1 byte per element, ~1 %
  of the kernel at L 16384; ``docs/fp8.md`` has the times). In-kernel it would
  cost a register round trip through SMEM per tile (FA3 does it in the producer warpgroup
  with LDSM/STSM; here the producer has 40 registers).
* **P goes through SMEM**: there is no relayout from the f32 accumulator layout to the 8-bit
  wgmma A layout, so each consumer rounds P·448 to e4m3 (P ∈ [0, 1]: the fixed scale uses
  the format's range, as :func:`pallas_flash.fp8.attention_fp8_reference` does), stores it
  into its own swizzled tile and feeds the tile to wgmma. The row sums use the unrounded P.
* **V's scale is folded into O's rescale factor**: O is accumulated in place by wgmma,
  so the accumulator holds ``O · 448 / s_V,j`` for the last block j; before P̃_j·Ṽ_j is
  added, it is rescaled by ``alpha_j · s_V,j-1 / s_V,j`` (one scalar times the per-row
  alpha the online softmax multiplies by anyway), and the epilogue multiplies by
  ``s_V,last / 448 / l``. Folding s_V into P instead would change P's rounding; a fresh
  accumulator per block would cost head_dim / 2 registers per thread (128 at head_dim 256).

Both consumer schedules of the bf16 kernel exist (``MosaicConfig.overlap``): serial, and
FA3's intra-warpgroup overlap, where P̃ going through SMEM costs a second P tile per
consumer instead of P's registers (``forward._overlapped_loop``). So do its persistent CTAs
(``MosaicConfig.persistent``, :mod:`pallas_flash.mosaic.scheduler`): the K/V ring and each
consumer's next Q load run on across tiles; O gets tiles of its own where they fit
(:func:`separate_o_tiles`), else it is stored through the P tiles' memory and the
consumers meet once more per tile, after the O stores have read it.

CPU testing: interpret mode runs FP8 wgmma, but not ``pl.run_state`` (how wgmma accumulates
into the O registers). With ``interpret=True`` P·V lands in a fresh accumulator and is added
to the rescaled O: the same arithmetic, the bf16 kernel's detour.
"""

from __future__ import annotations

import jax

from pallas_flash.contract import RowBounds
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.config import SMEM_BUDGET, MosaicConfig, padded_head_dim
from pallas_flash.mosaic.forward import (
    FP8_OUT_DTYPE,
    P_SCALE,
    Fp8Operands,
    check_fp8_operands,
    forward_fp8_operands,
)
from pallas_flash.padding import round_up

OUT_DTYPE = FP8_OUT_DTYPE
__all__ = ["OUT_DTYPE", "P_SCALE", "SHORT_CAUSAL_KEYS", "Fp8Operands", "check_config",
           "default_config", "forward", "separate_o_tiles", "smem_bytes"]


#: With three consumers: the most S and O columns (block_kv + head_dim) one thread holds.
_THREE_CONSUMER_COLUMNS = 256


def smem_bytes(config: MosaicConfig, head_dim: int, *, o_apart: bool | None = None) -> int:
    """Shared memory of the kernel, as Mosaic GPU's lowering counts it (1 KiB per buffer).

    Q tiles and the K / Vᵀ rings in e4m3; one e4m3 P tile per consumer (two with
    ``overlap``) and a bf16 O tile per consumer (the e4m3 Q tile is too small to hold it)
    in one union, since O is stored only once every P tile is dead, or side by side
    (``o_apart``; default :func:`separate_o_tiles`); LSE, mbarriers.
    """
    if o_apart is None:
        o_apart = separate_o_tiles(config, head_dim)
    def align(nbytes):
        return round_up(nbytes, 1024)
    bq, bkv, stages = config.block_q, config.block_kv, config.num_stages
    consumers = config.num_consumers
    q = align(consumers * bq * head_dim)
    kv = 2 * align(stages * bkv * head_dim)
    p = align(consumers * (2 if config.overlap else 1) * bq * bkv)
    o = align(consumers * bq * head_dim * OUT_DTYPE.itemsize)
    lse = align(consumers * bq * 4)
    turns = consumers if config.overlap else 1  # as the bf16 kernel's barriers
    barriers = 8 * (consumers + 4 * stages + turns + 1)  # + P's end of use
    return q + kv + (p + o if o_apart else max(p, o)) + lse + barriers


def separate_o_tiles(config: MosaicConfig, head_dim: int) -> bool:
    """Whether the O tiles get memory of their own: in a persistent CTA, where that fits.
    Through the P tiles' memory, each tile's O store must have read it before any consumer
    writes the next tile's P, so the consumers wait for it and meet once more per tile."""
    return config.persistent and smem_bytes(config, head_dim, o_apart=True) <= SMEM_BUDGET


def check_config(config: MosaicConfig, head_dim: int) -> None:
    """Raises ValueError when ``config`` cannot run this kernel at ``head_dim`` on sm90."""
    if not isinstance(config, MosaicConfig):
        raise ValueError(f"config must be a MosaicConfig or None, got {config!r}")
    if config.num_consumers == 3 and config.block_kv + head_dim > _THREE_CONSUMER_COLUMNS:
        # S (block_kv / 2 f32 registers per thread) and O (head_dim / 2) in 160 registers;
        # at 320 columns ptxas gives up (64x256 at head_dim 64, 64x64 at 256, on an H200).
        raise ValueError(
            f"config.num_consumers=3 needs block_kv + head_dim <= {_THREE_CONSUMER_COLUMNS} "
            f"(S and O in 160 registers per thread), got block_kv={config.block_kv}, "
            f"head_dim={head_dim}; use num_consumers=2")
    need = smem_bytes(config, head_dim)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"config {config} needs {need} bytes of shared memory for the FP8 kernel at "
            f"head_dim={head_dim}, more than the {SMEM_BUDGET} an sm90 CTA has; lower "
            "block_kv or num_stages")


#: Causal rows up to this many keys take 128-key blocks at head_dim 65-128.
SHORT_CAUSAL_KEYS = 8192


def default_config(head_dim: int, *, is_causal: bool = False,
                   seq_kv: int | None = None) -> MosaicConfig:
    """64 rows per consumer and 2 stages, as the bf16 kernel, with FA3's overlapped
    schedule: 128-key blocks above head_dim 128, 256-key blocks at 65-128 (128-key
    blocks for causal rows of at most :data:`SHORT_CAUSAL_KEYS` keys, whose CTAs see few
    blocks: a 256-key block then leaves much of the diagonal masked and the schedule's
    first and last steps, which overlap nothing, weigh more), and three consumers of
    128-key blocks up to 64.
    (measurements: docs/tuning.md#fp8-forward-default_config)
    """
    head_dim = padded_head_dim(head_dim)
    if head_dim > 128:
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2, overlap=True)
    if head_dim > 64:
        short_causal = is_causal and seq_kv is not None and seq_kv <= SHORT_CAUSAL_KEYS
        return MosaicConfig(block_q=64, block_kv=128 if short_causal else 256, num_stages=2,
                            overlap=True)
    return MosaicConfig(block_q=64, block_kv=128, num_stages=2, overlap=True, num_consumers=3)


def forward(ops: Fp8Operands, *, mask: MaskSpec, scale: float, config: MosaicConfig,
            interpret: bool, bounds: RowBounds | None = None) -> tuple[jax.Array, jax.Array]:
    """FP8 attention forward on Hopper, from block-quantized operands.

    Args:
      ops: the quantized inputs (:class:`Fp8Operands`), scales per ``config.block_q`` /
        ``config.block_kv`` tile; head_dim at most 256.
      mask: visibility; its ``seq_q``/``seq_kv`` are the real lengths.
      scale: logit scale (applied to the dequantized Q·Kᵀ).
      config: tiles and schedule; :func:`check_config` must pass.
      interpret: run in Mosaic GPU interpret mode on the CPU.
      bounds: None or per-sequence :class:`~pallas_flash.contract.RowBounds` (int32
        ``[batch]`` each): rows ``>= q_end`` give out 0 and lse ``EMPTY_ROW_LSE``, only
        keys in ``[kv_start, kv_end)`` are visible (as the bf16 forward takes them).

    Returns:
      ``out: [batch, seq_q, heads, head_dim]`` bfloat16 and ``lse: [batch, heads, seq_q]``
      float32 (natural log).

    Any lengths: the sequences are zero-padded to whole tiles (padded keys are hidden by
    ``mask.seq_kv``, padded rows dropped, padded tiles get scale 1), the head dim to a
    multiple of 64.
    """
    check_fp8_operands(ops, config)
    dim = padded_head_dim(ops.q.shape[-1])
    check_config(config, dim)
    return forward_fp8_operands(ops, mask=mask, scale=scale, config=config,
                                interpret=interpret,
                                o_apart=config.persistent and separate_o_tiles(config, dim),
                                bounds=bounds)

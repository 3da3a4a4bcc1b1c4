"""FP8 (e4m3) FlashAttention-3 forward for Hopper (sm90), as a Pallas Mosaic GPU kernel.

Shah et al. 2024, "FlashAttention-3", Sec. 3.3: both GEMMs run on FP8 tensor cores (twice
the bf16 rate) with one scale per tile (block quantization). The CTA is the bf16 kernel's
(:mod:`pallas_flash.mosaic.forward`): a TMA producer warpgroup filling a ``num_stages``-deep
K/V ring and two (or three, ``MosaicConfig.num_consumers``) consumer warpgroups of
``block_q`` rows each that take turns on the tensor cores, with the same barriers, block
skipping (:meth:`MaskSpec.kv_blocks`) and epilogue.
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
consumer instead of P's registers (:func:`_overlapped_loop`). So do its persistent CTAs
(``MosaicConfig.persistent``, :mod:`pallas_flash.mosaic.scheduler`): the K/V ring and each
consumer's next Q load run on across tiles; O gets tiles of its own where they fit
(:func:`separate_o_tiles`), else it is stored through the P tiles' memory and the
consumers meet once more per tile, after the O stores have read it.

CPU testing: interpret mode runs FP8 wgmma, but not ``pl.run_state`` (how wgmma accumulates
into the O registers). With ``interpret=True`` P·V lands in a fresh accumulator and is added
to the rescaled O: the same arithmetic, the bf16 kernel's detour.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.fp8_format import E4M3, E4M3_MAX
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.block_walk import walk, walk_overlapped
from pallas_flash.mosaic.config import (
    MAX_HEAD_DIM,
    SMEM_BUDGET,
    MosaicConfig,
    padded_head_dim,
)
from pallas_flash.mosaic.epilogue import normalized, store_rows
from pallas_flash.mosaic.interpret import interpret_params
from pallas_flash.mosaic.mainloop import (
    OverlappedTurns,
    SerialTurns,
    accumulate_pv,
    head_scores,
    overlapped_skip_step,
    round_robin,
    serial_skip_step,
    softmax_under_pv,
    sync,
)
from pallas_flash.mosaic.pipeline import block_slots, observe_releases, stream_kv
from pallas_flash.mosaic.scheduler import Tile, TileGrid, for_each_tile, persistent_ctas
from pallas_flash.mosaic.softmax import online_softmax_step
from pallas_flash.mosaic.tiles import LOG2E, REGISTERS, row
from pallas_flash.padding import pad_axis, round_up

#: P ∈ [0, 1] is stored as e4m3(P · 448): 448 is e4m3's largest finite value.
P_SCALE = E4M3_MAX
OUT_DTYPE = jnp.dtype(jnp.bfloat16)


class Fp8Operands(NamedTuple):
    """Quantized inputs of :func:`forward` (``x ≈ x_fp8 · scale`` per tile and head).

    Attributes:
      q: ``[batch, seq_q, heads, head_dim]`` e4m3.
      q_scale: ``[batch, ceil(seq_q / block_q), heads]`` float32.
      k: ``[batch, seq_kv, kv_heads, head_dim]`` e4m3.
      k_scale: ``[batch, ceil(seq_kv / block_kv), kv_heads]`` float32.
      vt: V transposed, ``[batch, kv_heads, head_dim, seq_kv]`` e4m3.
      v_scale: ``[batch, ceil(seq_kv / block_kv), kv_heads]`` float32.
    """

    q: jax.Array
    q_scale: jax.Array
    k: jax.Array
    k_scale: jax.Array
    vt: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs that is not a ref (all Python values)."""

    mask: MaskSpec
    scale_log2: float  # softmax scale * log2(e); times s_Q * s_K,j per tile in the kernel
    block_q: int
    block_kv: int
    num_stages: int
    head_dim: int
    group: int  # query heads per K/V head (GQA)
    num_consumers: int  # consumer warpgroups of block_q rows; the producer comes after
    num_q_tiles: int  # CTAs along the sequence, each of num_consumers * block_q rows
    kv_padded: bool  # seq_kv was padded up to whole blocks
    interpret: bool  # P·V into a fresh accumulator (see the module docstring)
    batch: int
    heads: int
    overlap: bool = False  # FA3's intra-warpgroup pipelining (MosaicConfig.overlap)
    persistent_ctas: int = 0  # CTAs that loop over the work tiles; 0: one CTA per tile
    o_apart: bool = False  # O tiles beside the P tiles, not in their memory

    @property
    def tile_grid(self) -> TileGrid:
        return TileGrid(num_q_tiles=self.num_q_tiles, reverse_q_tiles=self.reverse_q_tiles,
                        batch=self.batch, heads=self.heads,
                        persistent_ctas=self.persistent_ctas)

    @property
    def reverse_q_tiles(self) -> bool:
        return self.mask.is_causal  # heaviest CTAs first, as the bf16 kernel

    @property
    def has_lower_band(self) -> bool:
        return self.mask.window is not None  # only a window hides keys before a query

    @property
    def has_upper_mask(self) -> bool:
        return self.mask.is_causal or self.mask.window is not None or self.kv_padded

    @property
    def has_mask(self) -> bool:
        return self.has_lower_band or self.has_upper_mask


def _transforms(minor: int, dtype) -> tuple:
    """SMEM tiling + swizzle for a tile whose minor dim holds ``minor`` elements.

    wgmma reads (8, swizzle / itemsize) tiles; the widest swizzle that divides a row avoids
    bank conflicts. FP8 rows of 64 elements are 64 bytes, so they get the 64-byte swizzle
    (the bf16 kernel's 128 bytes need 128 e4m3 elements).
    """
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, plgpu.find_swizzle(minor * itemsize * 8))
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


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


def _kernel(q_ref, k_ref, vt_ref, q_scale_ref, k_scale_ref, v_scale_ref, out_ref, lse_ref, *,
            st: _Static, q_smem, k_smem, vt_smem, lse_smem, q_ready, k_ready, v_ready, k_free,
            v_free, turn, p_done, p_o_smem=None, p_smem=None, o_smem=None):
    """One CTA: one work tile, or a persistent CTA's tiles (:class:`TileGrid`). GMEM: q/out
    [B, Tq, N, D], k [B, Tk, K, D], vt [B, K, D, Tk], lse [B, N, Tq], scales [B, tiles,
    heads]. SMEM: q/p/o per consumer (p and o in one union ``p_o_smem`` unless
    ``st.o_apart``), k/vt rings of ``num_stages``, filled across a persistent CTA's tiles
    as in the bf16 kernel."""
    if p_o_smem is not None:
        p_smem, o_smem = p_o_smem
    bq, bkv, consumers = st.block_q, st.block_kv, st.num_consumers
    count, tile_at = st.tile_grid.tiles()

    def cta_blocks(tile: Tile):
        first, _, _, last = st.mask.kv_blocks(tile.q_tile * (consumers * bq), consumers * bq,
                                              bkv)
        return first, last

    wg = lax.axis_index("wg")
    consumer_registers, producer_registers = REGISTERS[consumers]

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")

        def load_q(tile: Tile):
            rows = pl.ds((tile.q_tile * consumers + wg) * bq, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[tile.batch, rows, tile.head], q_smem.at[wg],
                                    q_ready.at[wg])

        def tile_work(i, ring_base):
            tile = tile_at(i)
            batch, head = tile.batch, tile.head
            kv_head = lax.div(head, st.group)  # GQA: K/V are indexed, never repeated
            cta_first, cta_last = cta_blocks(tile)
            q0 = (tile.q_tile * consumers + wg) * bq
            scales = (q_scale_ref[batch, lax.div(q0, bq), head],
                      k_scale_ref.at[batch, :, kv_head], v_scale_ref.at[batch, :, kv_head])

            def load_next_q():
                pl.when(i + 1 < count)(lambda: load_q(tile_at(i + 1)))

            _consumer_warpgroup(
                wg, st, out_ref.at[batch, pl.ds(q0, bq), head],
                lse_ref.at[batch, head, pl.ds(q0, bq)], scales, q_smem.at[wg], k_smem,
                vt_smem, p_smem.at[wg], o_smem.at[wg], lse_smem.at[wg], q_ready.at[wg],
                k_ready, v_ready, k_free, v_free, turn, p_done, q0=q0, cta_first=cta_first,
                cta_last=cta_last, slot=block_slots(st.num_stages, ring_base, cta_first),
                load_next_q=load_next_q if st.persistent_ctas else None)
            return ring_base + cta_last - cta_first

        load_q(tile_at(0))
        for_each_tile(count, tile_work, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)  # the last warpgroup
    def _producer():
        # The bf16 kernel's producer, with Vᵀ tiles: (head_dim, block_kv) of vt.
        plgpu.set_max_registers(producer_registers, action="decrease")

        def tile_loads(i, loaded):
            tile = tile_at(i)
            batch, kv_head = tile.batch, lax.div(tile.head, st.group)
            cta_first, cta_last = cta_blocks(tile)
            slot = block_slots(st.num_stages, loaded, cta_first)

            def load_k(j):
                plgpu.copy_gmem_to_smem(k_ref.at[batch, pl.ds(j * bkv, bkv), kv_head],
                                        k_smem.at[slot(j)], k_ready.at[slot(j)])

            def load_v(j):
                plgpu.copy_gmem_to_smem(vt_ref.at[batch, kv_head, :, pl.ds(j * bkv, bkv)],
                                        vt_smem.at[slot(j)], v_ready.at[slot(j)])

            stream_kv(num_stages=st.num_stages, first=cta_first, last=cta_last, slot=slot,
                      load_k=load_k, load_v=load_v, k_free=k_free, v_free=v_free,
                      loaded_before=loaded)
            return loaded + cta_last - cta_first

        loaded = for_each_tile(count, tile_loads, 0)
        observe_releases(num_stages=st.num_stages, loaded=loaded, k_free=k_free,
                         v_free=v_free)


def _consumer_warpgroup(wg, st: _Static, out_gmem, lse_gmem, scales, q_tile, k_smem, vt_smem,
                        p_tile, o_tile, lse_tile, q_ready, k_ready, v_ready, k_free, v_free,
                        turn, p_done, *, q0, cta_first, cta_last, slot, load_next_q):
    """Rows [q0, q0 + block_q) of one tile: the bf16 kernel's consumer with FP8 GEMMs and
    scales. The Q tile's copy into ``q_tile`` was issued on ``q_ready`` by the caller.

    ``p_tile``: this consumer's e4m3 P tile, two of them ([2, block_q, block_kv]) with the
    overlapped schedule. Unless ``st.o_apart``, ``o_tile`` shares its memory with every
    consumer's P tiles: it is written once all have passed ``p_done`` (one arrival each),
    after their last P·V, and a persistent CTA (``load_next_q``: issues the next tile's Q
    copy, once this tile's last Q·Kᵀ has read Q) meets at ``p_done`` once more after the O
    stores have read their tiles, so that no consumer writes the next tile's P over
    another's O before it has left.
    """
    bq, bkv, d = st.block_q, st.block_kv, st.head_dim
    q_scale, k_scales, v_scales = scales
    ranges = tuple(jnp.clip(x, cta_first, cta_last) for x in st.mask.kv_blocks(q0, bq, bkv))
    # Dequantization of S_j = Q̃·K̃_jᵀ: s_Q·s_K,j folded into the exponent's scale.
    q_scale_log2 = q_scale * st.scale_log2

    def softmax(scores, m_i, l_i, j, k_scale, p_out, *, masked: bool):
        """Online softmax of S_j in base 2 (FA3 Alg. 1 lines 9-11); P̃_j = e4m3(P_j·448)
        goes to ``p_out``. Returns the new m and l, and alpha, O's factor to the new m.
        ``k_scale``: s_K,j, loaded before the GEMM so that the GEMM hides the load."""
        if masked:  # as the bf16 kernel's boundary mask, in the same op order
            rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
            scores = jnp.where(st.mask.visible(rows + q0, cols + j * bkv), scores, -jnp.inf)
        # A masked row that has seen no key yet keeps m = -inf, its P and l 0.
        p, m_new, alpha = online_softmax_step(scores, m_i, q_scale_log2 * k_scale,
                                              guard_empty=masked)
        p_out[...] = (p * P_SCALE).astype(E4M3)
        plgpu.commit_smem()  # register stores -> visible to wgmma
        return m_new, l_i * alpha + p.sum(axis=1), alpha  # l from the unrounded P

    carry = (
        plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        # s_V of the previous block; O is still 0, so any value works. Read from the scales
        # (not a literal) so that it has their manual-axis type inside shard_map.
        v_scales[0],
    )
    plgpu.barrier_wait(q_ready)
    # The turns start and end with each tile (not once per CTA, as in the bf16 kernel):
    # the consumers meet at p_done below, which the serial stagger would deadlock.
    loop, turns = (_overlapped_loop, OverlappedTurns) if st.overlap else (_serial_loop,
                                                                          SerialTurns)
    turns.begin(st.num_consumers, wg, turn)
    o, m_i, l_i, v_scale = loop(
        wg, st, carry, ranges, softmax, q_tile, k_smem, vt_smem, p_tile, k_ready, v_ready,
        k_free, v_free, turn, scales=(k_scales, v_scales), cta_first=cta_first,
        cta_last=cta_last, slot=slot)
    turns.end(st.num_consumers, wg, turn)
    if load_next_q is not None:
        load_next_q()  # its TMA runs under this epilogue

    # Epilogue: undo P's 448 and the last V scale, normalise; O and LSE leave via TMA.
    o, lse = normalized(o, m_i, l_i, fp8_scales=(v_scale, P_SCALE))
    if st.o_apart:  # the previous tile's O and LSE stores must have read their tiles
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    lse_tile[...] = lse
    if not st.o_apart:
        sync(p_done)  # every P tile is read: O may overwrite them
    o_tile[...] = o.astype(OUT_DTYPE)
    store_rows(o_tile, lse_tile, out_gmem, lse_gmem)
    if load_next_q is not None and not st.o_apart:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        sync(p_done)  # every O tile is read: the next tile's P may overwrite them


def _pv(st: _Static, o, p_tile, vt_tile, during):
    """O += P̃·Ṽ with Vᵀ's (D, keys) tile read through a transposed view (K-major B);
    ``during()`` runs while the GEMM does (the bf16 kernel's :func:`accumulate_pv`)."""
    return accumulate_pv(o, p_tile, vt_tile.T, during, interpret=st.interpret)


def _serial_loop(wg, st: _Static, carry, ranges, softmax, q_tile, k_smem, vt_smem, p_tile,
                 k_ready, v_ready, k_free, v_free, turn, *, scales, cta_first, cta_last,
                 slot):
    """The bf16 kernel's serial schedule: S_j, softmax (P̃_j to SMEM), P̃_j·Ṽ_j.
    ``scales``: s_K and s_V per key block ([blocks] GMEM refs)."""
    del wg
    bq, bkv = st.block_q, st.block_kv
    k_scales, v_scales = scales

    def wait_k(j):
        @pl.when(j < cta_last)
        def _():
            plgpu.barrier_wait(k_ready.at[slot(j)])

    def step(j, carry, *, masked: bool):
        o, m_i, l_i, v_scale_prev = carry
        s = slot(j)
        k_scale, v_scale = k_scales[j], v_scales[j]  # scalar loads, hidden by the GEMM

        def qk(s_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[s].T)
            sync(turn)  # ping (see the bf16 kernel's _serial_loop)
            return s_acc[...]
        scores = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[s])
        m_new, l_i, alpha = softmax(scores, m_i, l_i, j, k_scale, p_tile, masked=masked)
        o = o * row(alpha * (v_scale_prev / v_scale), o.shape)
        plgpu.barrier_arrive(turn)  # pong: softmax done, the other consumer may go on
        plgpu.barrier_wait(v_ready.at[s])
        plgpu.barrier_wait(turn)
        o = _pv(st, o, p_tile, vt_smem.at[s], during=lambda: wait_k(j + 1))
        plgpu.barrier_arrive(v_free.at[s])
        return o, m_new, l_i, v_scale

    skip_step = functools.partial(serial_skip_step, slot=slot, turn=turn, k_free=k_free,
                                  v_ready=v_ready, v_free=v_free, wait_k=wait_k)
    wait_k(cta_first)
    return walk(carry, ranges, cta_first=cta_first, cta_last=cta_last, step=step,
                skip_step=skip_step, lower_band=st.has_lower_band,
                upper_mask=st.has_upper_mask)


def _overlapped_loop(wg, st: _Static, carry, ranges, softmax, q_tile, k_smem, vt_smem,
                     p_tiles, k_ready, v_ready, k_free, v_free, turn, *, scales, cta_first,
                     cta_last, slot):
    """The bf16 kernel's overlapped schedule (FA3 Sec. 3.2) with FP8 GEMMs.

    Step j issues S_j = Q̃·K̃_jᵀ and O += P̃_{j-1}·Ṽ_{j-1}, waits for S_j only, and runs the
    softmax of S_j while the P·V GEMM runs. P̃ goes through SMEM, so overlapping costs no
    registers for P̃_{j-1}, only a second P tile: P̃_j is stored into tile j % 2 while
    the GEMM reads tile (j - 1) % 2. Once that GEMM is done, O is rescaled by
    ``alpha_j · s_V,j-1 / s_V,j`` (the accumulator holds O · 448 / s_V of the last block
    added, as in the serial schedule).
    """
    first, last = ranges[0], ranges[3]
    bq, bkv = st.block_q, st.block_kv
    k_scales, v_scales = scales
    take_turn, pass_turn = turns = round_robin(turn, wg, st.num_consumers)

    def p_tile(j):
        return p_tiles.at[lax.rem(j, 2)]

    def head(carry):
        """The first visible block: S, softmax, no P·V yet (O is still 0)."""
        o, m_i, l_i, _ = carry
        s = slot(first)
        k_scale, v_scale = k_scales[first], v_scales[first]
        scores = head_scores(q_tile, k_smem.at[s], k_ready.at[s], turns)
        plgpu.barrier_arrive(k_free.at[s])
        m_new, l_new, _ = softmax(scores, m_i, l_i, first, k_scale, p_tile(first),
                                  masked=st.has_mask)
        return o, m_new, l_new, v_scale

    def step(j, carry, *, masked: bool):
        """Block j > first: S_j and P̃_{j-1}·Ṽ_{j-1} in flight together."""
        o, m_i, l_i, v_scale_prev = carry
        s, s_prev = slot(j), slot(j - 1)
        k_scale, v_scale = k_scales[j], v_scales[j]
        plgpu.barrier_wait(k_ready.at[s])
        take_turn()

        def gemms(s_acc, pv_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[s].T)
            plgpu.barrier_wait(v_ready.at[s_prev])
            plgpu.wgmma(pv_acc, p_tile(j - 1), vt_smem.at[s_prev].T)
            pass_turn()  # the other warpgroup's GEMMs queue behind ours
            scores = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # S_j; P·V still runs
            plgpu.barrier_arrive(k_free.at[s])
            return softmax(scores, m_i, l_i, j, k_scale, p_tile(j), masked=masked)

        o, (m_new, l_new, alpha) = softmax_under_pv(
            o, (bq, bkv), gemms, lambda zeros: (m_i, l_i, m_i), interpret=st.interpret)
        plgpu.barrier_arrive(v_free.at[s_prev])  # Ṽ_{j-1} is read
        return o * row(alpha * (v_scale_prev / v_scale), o.shape), m_new, l_new, v_scale

    def tail(o):
        """O += P̃·Ṽ of the last visible block."""
        s = slot(last - 1)
        take_turn()
        plgpu.barrier_wait(v_ready.at[s])
        o = _pv(st, o, p_tile(last - 1), vt_smem.at[s], during=pass_turn)
        plgpu.barrier_arrive(v_free.at[s])
        return o

    def no_tail(o):
        take_turn()  # one turn per consumer either way, so that the turns stay paired
        pass_turn()
        return o

    def last_pv(nonempty, carry):
        o, m_i, l_i, v_scale = carry
        return lax.cond(nonempty, tail, no_tail, o), m_i, l_i, v_scale

    skip_step = functools.partial(overlapped_skip_step, slot=slot, turns=turns,
                                  k_ready=k_ready, k_free=k_free, v_ready=v_ready,
                                  v_free=v_free)
    return walk_overlapped(
        carry, ranges, cta_first=cta_first, cta_last=cta_last, head=head, step=step,
        last_pv=last_pv, skip_step=skip_step, lower_band=st.has_lower_band, unmasked=True,
        upper_mask=st.has_upper_mask)


def _check_operands(ops: Fp8Operands, config: MosaicConfig) -> None:
    batch, seq_q, heads, head_dim = ops.q.shape
    seq_kv, kv_heads = ops.k.shape[1], ops.k.shape[2]
    tiles_q, tiles_kv = -(-seq_q // config.block_q), -(-seq_kv // config.block_kv)
    expected = Fp8Operands(
        q=ops.q.shape, q_scale=(batch, tiles_q, heads), k=(batch, seq_kv, kv_heads, head_dim),
        k_scale=(batch, tiles_kv, kv_heads), vt=(batch, kv_heads, head_dim, seq_kv),
        v_scale=(batch, tiles_kv, kv_heads))
    for name, array, shape in zip(Fp8Operands._fields, ops, expected, strict=True):
        if array.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {array.shape}")
        want = jnp.float32 if name.endswith("scale") else E4M3
        if array.dtype != want:
            raise ValueError(f"{name} must be {jnp.dtype(want).name}, got {array.dtype}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")


def forward(ops: Fp8Operands, *, mask: MaskSpec, scale: float, config: MosaicConfig,
            interpret: bool) -> tuple[jax.Array, jax.Array]:
    """FP8 attention forward on Hopper, from block-quantized operands.

    Args:
      ops: the quantized inputs (:class:`Fp8Operands`), scales per ``config.block_q`` /
        ``config.block_kv`` tile; head_dim at most 256.
      mask: visibility; its ``seq_q``/``seq_kv`` are the real lengths.
      scale: logit scale (applied to the dequantized Q·Kᵀ).
      config: tiles and schedule; :func:`check_config` must pass.
      interpret: run in Mosaic GPU interpret mode on the CPU.

    Returns:
      ``out: [batch, seq_q, heads, head_dim]`` bfloat16 and ``lse: [batch, heads, seq_q]``
      float32 (natural log).

    Any lengths: the sequences are zero-padded to whole tiles here (padded keys are hidden
    by ``mask.seq_kv``, padded rows dropped, padded tiles get scale 1), the head dim to a
    multiple of 64.
    """
    _check_operands(ops, config)
    batch, seq_q, heads, head_dim = ops.q.shape
    seq_kv, kv_heads = ops.k.shape[1], ops.k.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    dim = padded_head_dim(head_dim)
    check_config(config, dim)
    consumers = config.num_consumers
    rows_per_cta = consumers * config.block_q
    seq_q_pad = round_up(seq_q, rows_per_cta)
    seq_kv_pad = round_up(seq_kv, config.block_kv)
    st = _Static(
        mask=mask, scale_log2=scale * LOG2E, block_q=config.block_q,
        block_kv=config.block_kv, num_stages=config.num_stages, head_dim=dim,
        group=heads // kv_heads, num_consumers=consumers, num_q_tiles=seq_q_pad // rows_per_cta,
        kv_padded=seq_kv_pad != seq_kv, interpret=interpret, batch=batch, heads=heads,
        overlap=config.overlap)
    if config.persistent:
        st = dataclasses.replace(
            st, persistent_ctas=persistent_ctas(st.tile_grid, interpret=interpret),
            o_apart=separate_o_tiles(config, dim))

    bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
    scratch = dict(
        q_smem=plgpu.SMEM((consumers, bq, dim), E4M3, transforms=_transforms(dim, E4M3)),
        k_smem=plgpu.SMEM((stages, bkv, dim), E4M3, transforms=_transforms(dim, E4M3)),
        vt_smem=plgpu.SMEM((stages, dim, bkv), E4M3, transforms=_transforms(bkv, E4M3)),
        lse_smem=plgpu.SMEM((consumers, bq), jnp.float32),
        q_ready=plgpu.Barrier(num_barriers=consumers),
        k_ready=plgpu.Barrier(num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        # Serial schedule: one barrier the two consumers meet at; overlapped: one per consumer.
        turn=(plgpu.Barrier(num_barriers=consumers) if st.overlap
              else plgpu.Barrier(num_arrivals=consumers)),
        p_done=plgpu.Barrier(num_arrivals=consumers),
    )
    p_tiles = plgpu.SMEM((consumers, *((2,) if st.overlap else ()), bq, bkv), E4M3,
                         transforms=_transforms(bkv, E4M3))
    o_tiles = plgpu.SMEM((consumers, bq, dim), OUT_DTYPE, transforms=_transforms(dim, OUT_DTYPE))
    if st.o_apart:
        scratch.update(p_smem=p_tiles, o_smem=o_tiles)
    else:
        scratch.update(p_o_smem=plgpu.RefUnion(p_tiles, o_tiles))
    grid, grid_names = st.tile_grid.launch()
    call = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=(
            jax.ShapeDtypeStruct((batch, seq_q_pad, heads, dim), OUT_DTYPE),
            jax.ShapeDtypeStruct((batch, heads, seq_q_pad), jnp.float32),
        ),
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params(interpret, consumers + 1),
    )
    ones = functools.partial(pad_axis, value=1.0)  # padded tiles: scale 1, data 0
    out, lse = call(
        pad_axis(pad_axis(ops.q, 1, seq_q_pad), 3, dim),
        pad_axis(pad_axis(ops.k, 1, seq_kv_pad), 3, dim),
        pad_axis(pad_axis(ops.vt, 3, seq_kv_pad), 2, dim),
        ones(ops.q_scale, 1, seq_q_pad // bq), ops.k_scale, ops.v_scale)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]

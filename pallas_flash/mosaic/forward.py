"""FlashAttention-3 forward for Hopper (sm90), as a Pallas Mosaic GPU kernel.

Shah et al. 2024, "FlashAttention-3", Sec. 3. One CTA owns ``2 * block_q`` query rows of
one (batch, head) and runs three warpgroups (``lax.axis_index("wg")``):

* **producer** (wg 2, Sec. 3.1 "warp specialization"): gives its registers away
  (``setmaxnreg`` 40) and only issues TMA copies of K_j and V_j into a ``num_stages``-deep
  SMEM ring (:func:`pallas_flash.mosaic.pipeline.stream_kv`). Each slot has a *ready*
  mbarrier (arrived by the TMA engine) and a *free* mbarrier (arrived by both consumers
  once they no longer read the slot).
* **two consumers** (wg 0 and 1, ``setmaxnreg`` 232): each owns ``block_q`` rows, keeps
  O, m and l in registers and runs, per K/V block j (Algorithm 1):
  S = Q·K_jᵀ (wgmma) → online softmax in base 2 with the scale folded into the exponent →
  O = diag(alpha)·O + P·V_j (wgmma).
  ``turn`` mbarriers make the two consumers *ping-pong* (Sec. 3.1, Fig. 1): the softmax of
  one warpgroup runs while the tensor cores execute the other's GEMMs.

Two consumer schedules (``MosaicConfig.overlap``):

* serial (:func:`_serial_loop`, the default): S_j, wait, softmax, P·V_j, wait. The two
  consumers meet twice per block at one 2-arrival ``turn`` barrier.
* overlapped (:func:`_overlapped_loop`, FA3 Sec. 3.2 "intra-warpgroup pipelining"): step j
  issues S_j and O += P_{j-1}·V_{j-1} back to back, waits for S_j only, and runs the
  softmax of S_j while P·V is still on the tensor cores; O is rescaled, and P_j cast to
  16 bits, after. Each consumer has its own single-arrival ``turn`` barrier: it waits on
  it before issuing its two GEMMs and arrives at the other's right after, so GEMM issue
  strictly alternates. Its first version (P_j cast before the wait) was correct on the
  H200 at every size probed but slow, as ptxas serialised its wgmmas; the current one is
  checked in interpret mode and by lowering, not yet on the card (see :class:`MosaicConfig`).

**Three consumers** (``MosaicConfig.num_consumers = 3``, FA3's choice at head_dim 64, where
the softmax of a block takes as long as its GEMMs): CTAs of ``3 * block_q`` rows, the
register file split 3 x 160 + 32, and the overlapped schedule's turns passed round robin.

**Persistent CTAs** (``MosaicConfig.persistent``, FA3's persistent kernel): one CTA per SM
loops over work tiles (:func:`_tiles`). The producer's ring runs on across tiles, each
consumer loads its next Q tile once its last Q·Kᵀ has read the current one, and O leaves
through an SMEM tile of its own, so the next tile's loads run under this tile's epilogue;
the consumers' ping-pong stagger is set up once per CTA (:class:`SerialTurns`,
:class:`OverlappedTurns`).

Block skipping comes from :class:`~pallas_flash.masking.MaskSpec.kv_blocks`: K/V blocks
outside the CTA's ``[first, last)`` are never loaded (causal: nothing above the diagonal),
blocks inside a consumer's ``[full_first, full_last)`` run the unmasked fast loop, and
only the boundary blocks build the mask tile. The epilogue normalises O once, writes it
through SMEM with a TMA store, and writes the log-sum-exp (natural log) the same way.

Variants. **Segment ids** (packed documents; padding lengths arrive as ids too): each
consumer's band is cut to the span of K/V blocks whose id ranges can meet its rows'
(:func:`pallas_flash.segments.tile_spans`, computed in XLA once per call); the producer
loads the hull of the two consumers' ranges, and every block a consumer visits is masked,
comparing its rows' ids (loaded once) with the block's key ids (a ``num_stages`` ring of
``block_kv`` int32 in SMEM, filled by TMA next to K on K's ready barrier, read before K's
slot is freed). **Soft-capping**: logits become ``c·tanh(scale·s/c)`` (``tanh.approx``, as
FA3) before the mask and the base-2 softmax.

**Bias and mask arrays** (as ``jax.nn``; canonical ``[B', N', T', S']``, see
:mod:`pallas_flash.bias`) are read where they vary (:class:`LogitArray`), never expanded
along a broadcast dim: a tile that varies along queries and keys rides in an SMEM ring next
to K (one ``[block_q, block_kv]`` tile per consumer and block, TMA'd on K's ready barrier and
read, like the key ids, before K's slot is freed), one that varies along keys only is a
``[block_kv]`` row per block in such a ring, and one that varies along queries only is a
``[block_q]`` column loaded once per consumer. A bias is added to the scaled (and capped)
logits in base 2; a mask that broadcasts to the bias's shape is folded into it as -inf,
otherwise it is read as int8 and makes every block take the masked path. Every block
guards its softmax against rows that have seen only -inf so far.

**Row bounds** (:class:`~pallas_flash.contract.RowBounds`, per sequence, read as scalars
from GMEM like the segment spans): each consumer's KV blocks are cut to ``[kv_start,
kv_end)`` (:func:`_cut_to_bounds`; blocks wholly outside never loaded, wholly inside run
unmasked, the cut ones masked), a block of rows at or past ``q_end`` visits none, and the
epilogue clears the padding rows of a block that straddles ``q_end`` (out 0, lse
``EMPTY_ROW_LSE``). V's hidden rows are zeroed before the call (:mod:`.bounds`).

**FP8** (``_Static.fp8``, FA3's ``Is_FP8``; entry and configs in
:mod:`pallas_flash.mosaic.forward_fp8`, which explains each choice): e4m3 operands with one
float32 scale per Q tile / K/V block read as scalars from GMEM and folded into the
exponent's scale, V transposed in GMEM and in the ring (K-major B operand), P̃ = e4m3(P·448)
through per-consumer SMEM tiles (two with the overlapped schedule) instead of registers,
s_V folded into O's rescale, O leaving as bfloat16 through tiles of its own or the P
tiles' memory (then the consumers meet at ``p_done`` first, and their turns start and end
with each tile).

CPU testing: Mosaic GPU interpret mode cannot run ``pl.run_state`` nor a wgmma whose A
operand is in registers, which is how FA3 feeds P to the P·V GEMM. With
``interpret=True`` the kernel takes one documented detour (:func:`_p_operand`,
:func:`accumulate_pv`): P is stored to SMEM and P·V lands in a fresh accumulator that is
added to O. Everything
else (pipeline, barriers, ping-pong, masking, epilogue) is the same code on both paths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.contract import EMPTY_ROW_LSE, RowBounds, kernel_output
from pallas_flash.fp8_format import E4M3, E4M3_MAX
from pallas_flash.logits import log2_logits
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import bounds as row_bounds
from pallas_flash.mosaic.block_walk import hull, walk, walk_overlapped
from pallas_flash.mosaic.config import (
    MAX_HEAD_DIM,
    NUM_CONSUMERS,
    MosaicConfig,
    fit_logit_rings,
    forward_config,
    padded_head_dim,
)
from pallas_flash.mosaic.epilogue import merged_into, normalized, store_rows
from pallas_flash.mosaic.interpret import interpret_params
from pallas_flash.mosaic.logit_arrays import LogitArray, fold_mask, logit_array, logit_operand
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
from pallas_flash.mosaic.tiles import (
    DTYPES,
    LOG2E,
    REGISTERS,
    a_operand,
    col,
    pad_operand,
    row,
    smem_transforms,
)
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.segments import cut_to_span, pad_segment_ids, tile_spans

# With a bias or mask array up to head_dim 192: at 256 the Q/O tiles and a 64-key K/V ring
# already take 192 KiB, and a float32 bias tile ring (64 KiB) no longer fits in 227 KiB.
_MAX_LOGIT_ARRAY_HEAD_DIM = 192
#: FP8: P ∈ [0, 1] is stored as e4m3(P · 448): 448 is e4m3's largest finite value.
P_SCALE = E4M3_MAX
#: FP8: the dtype of O.
FP8_OUT_DTYPE = jnp.dtype(jnp.bfloat16)


class _ScoreInputs(NamedTuple):
    """What a consumer combines with S = Q·Kᵀ besides the band, per row or per block; each
    None when absent: segment ids, the bias array's part, the mask array's part.

    Per row: values loaded once per consumer ([block_q], the rows of S). Per block: the
    SMEM rings filled next to K (refs), or what :func:`_release_k` read from a slot.
    """

    ids: Any = None
    bias: Any = None
    mask: Any = None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs that is not a ref (all Python values)."""

    mask: MaskSpec
    # softmax scale * log2(e): exp(scale*s - m) = exp2(s*scale_log2 - m2); FP8: times
    # s_Q * s_K,j per tile in the kernel
    scale_log2: float
    block_q: int
    block_kv: int
    num_stages: int
    head_dim: int
    dtype: jnp.dtype  # of Q, K, V (e4m3 with ``fp8``)
    group: int  # query heads per K/V head (GQA)
    num_q_tiles: int  # CTAs along the sequence, each of num_consumers * block_q rows
    kv_padded: bool  # seq_kv was padded up to whole blocks
    overlap: bool  # FA3's intra-warpgroup pipelining (MosaicConfig.overlap)
    interpret: bool  # P·V into a fresh accumulator (see the module docstring)
    softcap: float | None = None  # logits become softcap * tanh(scale * s / softcap)
    segmented: bool = False  # segment ids: a pair is visible only if its ids are equal
    num_consumers: int = NUM_CONSUMERS  # consumer warpgroups; the producer comes after
    bias: LogitArray | None = None  # added to the scaled logits
    attn_mask: LogitArray | None = None  # 0 hides a pair
    heads: int = 1  # query heads; with batch and num_q_tiles, the grid of work tiles
    batch: int = 1
    persistent_ctas: int = 0  # CTAs that loop over the work tiles; 0: one CTA per tile
    merges_into: bool = False  # the epilogue merges O into a running (out, lse): ``into``
    # The FP8 operand format (FA3's Is_FP8): per-tile scales, Vᵀ in GMEM and SMEM, P̃ =
    # e4m3(P·448) through SMEM tiles, O leaving as bfloat16 (see the module docstring).
    fp8: bool = False
    o_apart: bool = False  # FP8: O tiles beside the P tiles, not in their memory
    bounded: bool = False  # per-sequence RowBounds (q_end, kv_start, kv_end)

    @property
    def tile_grid(self) -> TileGrid:
        return TileGrid(num_q_tiles=self.num_q_tiles, reverse_q_tiles=self.reverse_q_tiles,
                        batch=self.batch, heads=self.heads,
                        persistent_ctas=self.persistent_ctas)

    @property
    def logits_in_base2(self) -> bool:
        # A soft-cap or a bias changes the tile itself, so the tile is taken to base 2
        # first; otherwise the scale is folded into exp2's FMA.
        return self.softcap is not None or self.bias is not None

    @property
    def masks_every_block(self) -> bool:
        # Segment ids and a mask array can hide pairs anywhere in the band.
        return self.segmented or self.attn_mask is not None

    @property
    def reads_key_slots(self) -> bool:
        # Consumers read more than K from K's ring slots (through the generic proxy).
        return self.segmented or any(
            x is not None and x.ring is not None for x in (self.bias, self.attn_mask))

    @property
    def key_slot_copies(self) -> int:
        """TMA copies (arrivals) on a K ready barrier: K, and what rides along it."""
        return 1 + self.segmented + sum(x.copies_per_block(self.num_consumers)
                                        for x in (self.bias, self.attn_mask) if x is not None)

    @property
    def reverse_q_tiles(self) -> bool:
        # Causal work grows with the query index: launch the heaviest CTAs first so the
        # last wave holds the short ones (FA3/tokamax's causal load balancing).
        return self.mask.is_causal

    @property
    def has_lower_band(self) -> bool:
        # Only a window, segment ids or a mask array hide keys *before* a query; otherwise
        # every row starts at key 0 and the leading skip/masked loops are statically empty.
        # Row bounds hide the keys before kv_start.
        return self.mask.window is not None or self.masks_every_block or self.bounded

    @property
    def has_unmasked_blocks(self) -> bool:
        # With segment ids or a mask array every visited block is masked: a consumer's
        # ranges are (first, last, last, last) and its leading masked loop runs all blocks.
        return not self.masks_every_block

    @property
    def has_upper_mask(self) -> bool:
        # Causal/window rows end before the last key, and padded keys must be hidden;
        # otherwise every visited block is full and the trailing masked loop is empty.
        band = (self.mask.is_causal or self.mask.window is not None or self.kv_padded
                or self.bounded)
        return band and self.has_unmasked_blocks

    @property
    def has_mask(self) -> bool:
        return self.has_lower_band or self.has_upper_mask


def _consumer_ranges(st: _Static, gmem: _Gmem, batch, q_block):
    """KV blocks of query block ``q_block`` (``block_q`` rows), as ``MaskSpec.kv_blocks``.

    With segment ids the band is cut to the span of KV blocks whose ids can meet the
    block's (``gmem.spans``: [B, 2, num_q_blocks] from :func:`segments.tile_spans`), and
    every block of it needs the mask: ``(first, last, last, last)``; so does every block of
    the band with a mask array. Row bounds cut it further (:func:`_cut_to_bounds`).
    """
    ranges = st.mask.kv_blocks(q_block * st.block_q, st.block_q, st.block_kv)
    if st.segmented:
        ranges = cut_to_span(ranges, gmem.spans[batch, 0, q_block],
                             gmem.spans[batch, 1, q_block])
    elif st.attn_mask is not None:
        first, *_, last = ranges
        ranges = first, last, last, last
    if st.bounded:
        ranges = _cut_to_bounds(ranges, _row_bounds(gmem, batch), q_block * st.block_q,
                                st.block_kv)
    return ranges


def _row_bounds(gmem: _Gmem, batch) -> tuple:
    """``(q_end, kv_start, kv_end)`` of sequence ``batch``: scalars read from GMEM."""
    return tuple(gmem.bounds[i, batch] for i in range(3))


def _cut_to_bounds(ranges, bounds, q0, block_kv: int):
    """Block ranges ``(first, full_first, full_last, last)`` of the rows from ``q0`` cut
    to the keys ``[kv_start, kv_end)``: blocks wholly outside are dropped, blocks cut by a
    bound are masked; no block at all when ``q0 >= q_end`` (every row is padding)."""
    q_end, kv_start, kv_end = bounds
    first, full_first, full_last, last = ranges
    first = jnp.maximum(first, lax.div(kv_start, block_kv))
    last = jnp.minimum(last, lax.div(kv_end + block_kv - 1, block_kv))
    last = jnp.where((q0 < q_end) & (kv_start < kv_end), jnp.maximum(last, first), first)
    full_first = jnp.clip(jnp.maximum(full_first, lax.div(kv_start + block_kv - 1, block_kv)),
                          first, last)
    full_last = jnp.clip(jnp.minimum(full_last, lax.div(kv_end, block_kv)), full_first, last)
    return first, full_first, full_last, last


def _release_k(st: _Static, k_free, key_rings: _ScoreInputs, s, wg) -> _ScoreInputs:
    """S_j is in registers: K_j's ring slot ``s`` may be refilled.

    Returns what else the slot holds, read by consumer ``wg`` before the slot is released
    (None where absent): the keys' segment ids ([block_kv] int32, laid out as the columns
    of S) and its part of the bias / mask (:meth:`LogitArray.read_slot`).
    """
    ids = bias = mask = None
    if key_rings.ids is not None:
        ids = plgpu.load(key_rings.ids.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
    if key_rings.bias is not None:
        bias = st.bias.read_slot(key_rings.bias.at[s], wg)
    if key_rings.mask is not None:
        mask = st.attn_mask.read_slot(key_rings.mask.at[s], wg)
    plgpu.barrier_arrive(k_free.at[s])
    return _ScoreInputs(ids, bias, mask)


class _Gmem(NamedTuple):
    """The kernel's GMEM refs: q/out [B, Tq, N, D], k/v [B, Tk, K, D] (FP8: v is Vᵀ, [B, K,
    D, Tk]), lse [B, N, Tq]; FP8: the scales [B, tiles, heads] of q / k / v; with segment
    ids q_ids [B, Tq], kv_ids [B, Tk], spans [B, 2, Tq / block_q]; the bias and mask
    operands (:class:`LogitArray`); the running result to merge into (``into``: out [B, Tq,
    N, D] float32, lse [B, N, Tq]); the row bounds [3, B] int32 (q_end, kv_start, kv_end);
    None where absent."""

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    q_ids: Any = None
    kv_ids: Any = None
    spans: Any = None
    bias: Any = None
    mask: Any = None
    into_out: Any = None
    into_lse: Any = None
    q_scale: Any = None
    k_scale: Any = None
    v_scale: Any = None
    bounds: Any = None


class _Smem(NamedTuple):
    """The kernel's SMEM scratch and barriers (C consumers): q [C, block_q, D], the k / v
    rings [num_stages, block_kv, D] (FP8: v [num_stages, D, block_kv]), lse [C, block_q];
    the rings riding along K's (``key_rings``: key ids, bias, mask; one more TMA arrival on
    ``k_ready`` per copy: ``st.key_slot_copies``); p [C, block_q, block_kv] in interpret
    mode, and always with FP8 (two per consumer with ``overlap``); o like q when persistent
    (else O leaves through Q's tile), and always with FP8 (bfloat16, in the P tiles' memory
    unless ``st.o_apart``); FP8: ``p_done``, where the consumers meet once every P tile is
    read."""

    q: Any
    k: Any
    v: Any
    lse: Any
    q_ready: Any
    k_ready: Any
    v_ready: Any
    k_free: Any
    v_free: Any
    turn: Any
    key_rings: _ScoreInputs
    p: Any = None
    o: Any = None
    p_done: Any = None


class _Own(NamedTuple):
    """One consumer's part of :class:`_Smem`: its Q tile and barrier, P tile(s) (None on
    the bf16 GPU path), O tile and LSE tile."""

    q: Any
    q_ready: Any
    p: Any
    o: Any
    lse: Any


def _kernel(*refs, st: _Static, q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready,
            k_free, v_free, turn, kv_ids_smem=None, bias_smem=None, mask_smem=None,
            p_done=None, p_smem=None, o_smem=None, p_o_smem=None):
    """One CTA: one work tile, or a persistent CTA's tiles (:class:`TileGrid`). ``refs``
    is ``q_ref, k_ref, v_ref``, then the FP8 scales, or, when present, the segment ids',
    the bias / mask and the ``into`` operands; the row bounds when present; then
    ``out_ref, lse_ref`` (:class:`_Gmem`);
    the scratch is :class:`_Smem`'s (FP8 without ``st.o_apart``: the P and O tiles in one
    union, ``p_o_smem``).

    K/V ring steps are counted over the CTA's tiles (``ring_base``: the steps of its
    earlier tiles), so the producer fills the ring for the next tile as slots free up.
    """
    q_ref, k_ref, v_ref, *inputs, out_ref, lse_ref = refs
    inputs = iter(inputs)
    scales = (next(inputs), next(inputs), next(inputs)) if st.fp8 else (None,) * 3
    ids = (next(inputs), next(inputs), next(inputs)) if st.segmented else (None,) * 3
    gmem = _Gmem(q_ref, k_ref, v_ref, out_ref, lse_ref, *ids,
                 bias=next(inputs) if st.bias is not None else None,
                 mask=next(inputs) if st.attn_mask is not None else None,
                 into_out=next(inputs) if st.merges_into else None,
                 into_lse=next(inputs) if st.merges_into else None,
                 q_scale=scales[0], k_scale=scales[1], v_scale=scales[2],
                 bounds=next(inputs) if st.bounded else None)
    if p_o_smem is not None:
        p_smem, o_smem = p_o_smem
    smem = _Smem(q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free,
                 turn, _ScoreInputs(kv_ids_smem, bias_smem, mask_smem), p_smem, o_smem, p_done)
    tiles = st.tile_grid.tiles()
    wg = lax.axis_index("wg")
    consumer_registers, producer_registers = REGISTERS[st.num_consumers]

    @pl.when(wg < st.num_consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        _consumer_tiles(st, gmem, smem, wg, tiles)

    @pl.when(wg == st.num_consumers)  # the last warpgroup
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        _producer_tiles(st, gmem, smem, tiles)


def _cta_blocks(st: _Static, gmem: _Gmem, tile: Tile):
    """The K/V blocks any row of the tile sees; the producer loads exactly these, once."""
    consumers, bq = st.num_consumers, st.block_q
    if st.segmented or st.bounded:  # each consumer's range may differ: load their union
        first_block = tile.q_tile * consumers
        return functools.reduce(hull, (
            _consumer_ranges(st, gmem, tile.batch, first_block + c)[::3]
            for c in range(consumers)))
    first, _, _, last = st.mask.kv_blocks(tile.q_tile * (consumers * bq), consumers * bq,
                                          st.block_kv)
    return first, last


def _consumer_tiles(st: _Static, gmem: _Gmem, smem: _Smem, wg, tiles) -> None:
    """Consumer ``wg``: its rows of each of the CTA's tiles (``tiles``: count, tile_at)."""
    bq, consumers = st.block_q, st.num_consumers
    count, tile_at = tiles
    own = _Own(q=smem.q.at[wg], q_ready=smem.q_ready.at[wg],
               p=None if smem.p is None else smem.p.at[wg],
               o=smem.q.at[wg] if smem.o is None else smem.o.at[wg], lse=smem.lse.at[wg])

    def load_q(tile: Tile):
        rows = (tile.batch, pl.ds((tile.q_tile * consumers + wg) * bq, bq), tile.head)
        plgpu.copy_gmem_to_smem(gmem.q.at[rows], own.q, own.q_ready)

    def tile_work(i, ring_base):
        tile = tile_at(i)
        batch, head = tile.batch, tile.head
        cta_first, cta_last = _cta_blocks(st, gmem, tile)
        # This warpgroup's block ranges, inside the CTA's (it must step through all of
        # the CTA's blocks to keep the ring and the ping-pong in lockstep with the
        # other consumers).
        ranges = tuple(jnp.clip(x, cta_first, cta_last) for x in _consumer_ranges(
            st, gmem, batch, tile.q_tile * consumers + wg))
        q0 = (tile.q_tile * consumers + wg) * bq
        # This warpgroup's per-row inputs, laid out as the rows of S, loaded once.
        rows = pl.ds(q0, bq)
        q_ids = bias_rows = mask_rows = None
        if st.segmented:  # (plain loads from GMEM: Mosaic GPU vectorises SMEM loads only)
            q_ids = plgpu.load(gmem.q_ids.at[batch, rows],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        if st.bias is not None and st.bias.kind == "rows":
            bias_rows = st.bias.read_rows(gmem.bias, batch=batch, head=head, rows=rows)
        if st.attn_mask is not None and st.attn_mask.kind == "rows":
            mask_rows = st.attn_mask.read_rows(gmem.mask, batch=batch, head=head, rows=rows)
        scales = None
        if st.fp8:  # s_Q of the rows (a scalar), s_K and s_V per key block
            kv_head = lax.div(head, st.group)
            scales = (gmem.q_scale[batch, lax.div(q0, bq), head],
                      gmem.k_scale.at[batch, :, kv_head], gmem.v_scale.at[batch, :, kv_head])

        def load_next_q():
            pl.when(i + 1 < count)(lambda: load_q(tile_at(i + 1)))

        _consumer_warpgroup(
            wg, st, gmem, smem, own, load_next_q=load_next_q if st.persistent_ctas else None,
            batch=batch, head=head, q0=q0, row_inputs=_ScoreInputs(q_ids, bias_rows, mask_rows),
            scales=scales, bounds=_row_bounds(gmem, batch) if st.bounded else None,
            ranges=ranges, cta_first=cta_first, cta_last=cta_last,
            slot=block_slots(st.num_stages, ring_base, cta_first))
        return ring_base + cta_last - cta_first

    load_q(tile_at(0))
    turns = OverlappedTurns if st.overlap else SerialTurns
    if not st.fp8:  # FP8 staggers the turns per tile (_consumer_warpgroup)
        turns.begin(consumers, wg, smem.turn)
    for_each_tile(count, tile_work, 0)
    if not st.fp8:
        turns.end(consumers, wg, smem.turn)
    plgpu.wait_smem_to_gmem(0)


def _producer_tiles(st: _Static, gmem: _Gmem, smem: _Smem, tiles) -> None:
    """The producer: K_j, V_j (and what rides along K) of each of the CTA's tiles into
    the ring (:func:`~pallas_flash.mosaic.pipeline.stream_kv`)."""
    bq, bkv, consumers = st.block_q, st.block_kv, st.num_consumers
    count, tile_at = tiles
    key_rings = smem.key_rings

    def tile_loads(i, loaded):
        tile = tile_at(i)
        batch, head = tile.batch, tile.head
        kv_head = lax.div(head, st.group)  # GQA: K/V are indexed, never repeated
        cta_first, cta_last = _cta_blocks(st, gmem, tile)
        slot = block_slots(st.num_stages, loaded, cta_first)

        def load(ref, ring, ready, j):
            rows = (batch, pl.ds(j * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(ref.at[rows], ring.at[slot(j)], ready.at[slot(j)])

        cta_q0 = tile.q_tile * (consumers * bq)
        consumer_rows = [pl.ds(cta_q0 + c * bq, bq) for c in range(consumers)]

        def load_k(j):
            load(gmem.k, smem.k, smem.k_ready, j)
            keys, ready = pl.ds(j * bkv, bkv), smem.k_ready.at[slot(j)]
            if st.segmented:  # the keys' ids, 4 * block_kv bytes, on K's barrier
                plgpu.copy_gmem_to_smem(gmem.kv_ids.at[batch, keys],
                                        key_rings.ids.at[slot(j)], ready)
            for array, ref, ring in ((st.bias, gmem.bias, key_rings.bias),
                                     (st.attn_mask, gmem.mask, key_rings.mask)):
                if ring is not None:  # bias / mask tiles or rows of block j, on K's barrier
                    array.load_block(ref, ring.at[slot(j)], ready, batch=batch, head=head,
                                     rows=consumer_rows, keys=keys)
        load_v = functools.partial(load, gmem.v, smem.v, smem.v_ready)
        if st.fp8:
            def load_v(j):  # Vᵀ: its (head_dim, block_kv) tile
                plgpu.copy_gmem_to_smem(gmem.v.at[batch, kv_head, :, pl.ds(j * bkv, bkv)],
                                        smem.v.at[slot(j)], smem.v_ready.at[slot(j)])

        # The consumers read the slots' key ids / bias / mask through the generic
        # proxy: a proxy fence orders those reads before the TMA (async proxy)
        # overwrites them.
        stream_kv(num_stages=st.num_stages, first=cta_first, last=cta_last, slot=slot,
                  load_k=load_k, load_v=load_v, k_free=smem.k_free, v_free=smem.v_free,
                  before_k_refill=plgpu.commit_smem if st.reads_key_slots else None,
                  loaded_before=loaded)
        return loaded + cta_last - cta_first

    loaded = for_each_tile(count, tile_loads, 0)
    observe_releases(num_stages=st.num_stages, loaded=loaded, k_free=smem.k_free,
                     v_free=smem.v_free)


def _consumer_warpgroup(wg, st: _Static, gmem: _Gmem, smem: _Smem, own: _Own, *, load_next_q,
                        batch, head, q0, row_inputs, scales, bounds, ranges, cta_first,
                        cta_last, slot):
    """Rows [q0, q0 + block_q) of one head: Algorithm 1 of FA3 for one consumer warpgroup.

    The Q tile's copy into ``own.q`` was issued on ``own.q_ready`` by the caller.
    ``ranges``: this warpgroup's (first, full_first, full_last, last) KV blocks, inside
    the CTA's [cta_first, cta_last); ``row_inputs``: its rows' segment ids, bias and mask
    ([block_q] each, None where absent); ``scales`` (FP8, else None): s_Q, and the GMEM
    refs of s_K and s_V per key block; ``bounds`` (None without): the sequence's
    ``(q_end, kv_start, kv_end)``. ``own.o``: where O goes before its TMA store (Q's
    tile, or a tile of its own for a persistent CTA, which calls ``load_next_q`` as soon
    as the last Q·Kᵀ has read Q). With ``st.merges_into``, O is merged into the running
    result in ``gmem.into_out`` / ``gmem.into_lse`` (float32 out).
    """
    bq, bkv, d = st.block_q, st.block_kv, st.head_dim
    shape = (bq, bkv)
    if st.fp8:
        # Dequantization of S_j = Q̃·K̃_jᵀ: s_Q·s_K,j folded into the exponent's scale.
        q_scale_log2 = scales[0] * st.scale_log2

    def softmax(scores, m_i, j, block: _ScoreInputs, *, masked: bool, k_scale=None):
        """S_j's logits (soft-cap, bias, mask) and its online softmax step
        (:func:`~pallas_flash.mosaic.softmax.online_softmax_step`): ``(p, m_new, alpha)``.
        ``block``: block j's key ids, bias and mask (from :func:`_release_k`); ``k_scale``:
        FP8's s_K,j, loaded before the GEMM so that the GEMM hides the load."""
        if st.logits_in_base2:  # c * tanh(scale * s / c) and/or + bias, in base 2
            bias = None
            if st.bias is not None:
                bias = st.bias.tile(row_inputs.bias, block.bias, shape)
            scores, _ = log2_logits(scores, st.scale_log2 / LOG2E, st.softcap, bias)
        if masked:  # boundary block: hide pairs outside the band and keys >= seq_kv
            # As block_walk.visible_tile, but in the op order of the kernel measured on the
            # H200 (its lowering changes with the order; see benchmarks/tools/lowered_modules.py).
            rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            visible = st.mask.visible(rows + q0, cols + j * bkv)
            if st.segmented:  # ... and pairs of one document
                visible &= row(row_inputs.ids, shape) == col(block.ids, shape)
            if st.attn_mask is not None:  # ... and pairs the mask array shows
                visible &= st.attn_mask.tile(row_inputs.mask, block.mask, shape) != 0
            if st.bounded:  # ... and keys inside the row bounds
                keys = cols + j * bkv
                visible &= (keys >= bounds[1]) & (keys < bounds[2])
            scores = jnp.where(visible, scores, -jnp.inf)
        # A soft-cap or a bias took the tile to base 2 already; otherwise the scale is
        # folded into exp2's FMA. Masked blocks and -inf biases can leave a row empty.
        if st.fp8:
            scale_log2 = q_scale_log2 * k_scale
        else:
            scale_log2 = None if st.logits_in_base2 else st.scale_log2
        return online_softmax_step(scores, m_i, scale_log2,
                                   guard_empty=masked or st.bias is not None)

    carry = (
        plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    if st.fp8:
        # s_V of the previous block; O is still 0, so any value works. Read from the scales
        # (not a literal) so that it has their manual-axis type inside shard_map.
        carry += (scales[2][0],)
    plgpu.barrier_wait(own.q_ready)
    loop = _overlapped_loop if st.overlap else _serial_loop
    turns = OverlappedTurns if st.overlap else SerialTurns
    if st.fp8:
        # The turns start and end with each tile (not once per CTA, as in the bf16
        # kernel): the consumers meet at p_done in the epilogue, which the serial stagger
        # would deadlock.
        turns.begin(st.num_consumers, wg, smem.turn)
    o, m_i, l_i, *v_scale = loop(wg, st, carry, ranges, softmax, smem, own, scales=scales,
                                 cta_first=cta_first, cta_last=cta_last, slot=slot)
    if st.fp8:
        turns.end(st.num_consumers, wg, smem.turn)
        _fp8_epilogue(st, gmem, smem, own, o, m_i, l_i, v_scale[0], load_next_q=load_next_q,
                      batch=batch, head=head, q0=q0, bounds=bounds)
        return

    # Epilogue (Alg. 1 lines 12-14): normalise once, O and LSE leave through SMEM + TMA.
    if load_next_q is not None:
        load_next_q()  # its TMA runs under this epilogue
        # The previous tile's O and LSE stores must have read their tiles.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    rows = pl.ds(q0, bq)
    o_tile = own.o
    if not st.merges_into:
        o, lse = normalized(o, m_i, l_i)
        if st.bounded:
            o, lse = _padding_rows_cleared(o, lse, q0, bounds[0])
        o_tile[...] = o.astype(st.dtype)  # Q's tile unless persistent: Q is dead by now
    else:  # ring attention: merged with the running result of the earlier steps
        prev_out = plgpu.load(gmem.into_out.at[batch, rows, head], layout=plgpu.Layout.WGMMA,
                              optimized=False)
        prev_lse = plgpu.load(gmem.into_lse.at[batch, head, rows],
                              layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        o, lse = merged_into(o, m_i, l_i, prev_out, prev_lse)
        if st.bounded:
            o, lse = _padding_rows_cleared(o, lse, q0, bounds[0])
        # A float32 tile would not fit in SMEM beside the K/V ring: O is stored from the
        # registers (each thread's pairs of columns: whole 32-byte sectors per row).
        gmem.out.at[batch, rows, head][...] = o
        o_tile = None
    own.lse[...] = lse
    store_rows(o_tile, own.lse, gmem.out.at[batch, rows, head],
               gmem.lse.at[batch, head, rows])


def _padding_rows_cleared(o, lse, q0, q_end):
    """``(o, lse)`` of the rows from ``q0`` with the padding rows (``>= q_end``) set to
    out 0 and lse ``EMPTY_ROW_LSE``: they were computed as real rows (a block of rows
    walks one range of keys), whatever their queries hold."""
    real = plgpu.broadcasted_iota(jnp.int32, (o.shape[0],), 0,
                                  layout=plgpu.Layout.WGMMA.reduce(1)) + q0 < q_end
    return jnp.where(row(real, o.shape), o, 0.0), jnp.where(real, lse, EMPTY_ROW_LSE)


def _fp8_epilogue(st: _Static, gmem: _Gmem, smem: _Smem, own: _Own, o, m_i, l_i, v_scale, *,
                  load_next_q, batch, head, q0, bounds) -> None:
    """The FP8 epilogue: undo P's 448 and the last V scale, normalise; O (bfloat16) and
    LSE leave via TMA.

    Unless ``st.o_apart``, ``own.o`` shares its memory with every consumer's P tiles: it
    is written once all have passed ``smem.p_done`` (one arrival each), after their last
    P·V, and a persistent CTA (``load_next_q``) meets at ``p_done`` once more after the O
    stores have read their tiles, so that no consumer writes the next tile's P over
    another's O before it has left.
    """
    rows = pl.ds(q0, st.block_q)
    if load_next_q is not None:
        load_next_q()  # its TMA runs under this epilogue
    o, lse = normalized(o, m_i, l_i, fp8_scales=(v_scale, P_SCALE))
    if st.bounded:
        o, lse = _padding_rows_cleared(o, lse, q0, bounds[0])
    if st.o_apart:  # the previous tile's O and LSE stores must have read their tiles
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    own.lse[...] = lse
    if not st.o_apart:
        sync(smem.p_done)  # every P tile is read: O may overwrite them
    own.o[...] = o.astype(FP8_OUT_DTYPE)
    store_rows(own.o, own.lse, gmem.out.at[batch, rows, head], gmem.lse.at[batch, head, rows])
    if load_next_q is not None and not st.o_apart:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        sync(smem.p_done)  # every O tile is read: the next tile's P may overwrite them


def _p_to_smem(p, p_tile) -> None:
    """FP8's P̃ = e4m3(P·448) into this consumer's SMEM tile, where wgmma reads it (there is
    no relayout from the f32 accumulator layout to the 8-bit wgmma A layout)."""
    p_tile[...] = (p * P_SCALE).astype(E4M3)
    plgpu.commit_smem()  # register stores -> visible to wgmma


def _serial_loop(wg, st: _Static, carry, ranges, softmax, smem: _Smem, own: _Own, *, scales,
                 cta_first, cta_last, slot):
    """Per block: S = Q·K_jᵀ, wait, softmax, O += P·V_j, wait (no intra-warpgroup overlap).

    ``turn`` is one 2-arrival mbarrier at which the two consumers meet twice per block
    (consumer 1 one turn behind: :class:`SerialTurns`). FP8: ``scales`` holds s_K and s_V
    per key block ([blocks] GMEM refs), the carry s_V of the previous block, and P̃ goes
    through ``own.p``.
    """
    turn, k_ready, v_ready = smem.turn, smem.k_ready, smem.v_ready

    def wait_k(j):
        """K_j must have landed before S = Q·K_jᵀ is issued."""
        @pl.when(j < cta_last)
        def _():
            plgpu.barrier_wait(k_ready.at[slot(j)])

    def pv(o, p_operand, s, j):
        """O += P·V_j, on the tensor cores; the wait for K_{j+1} overlaps the GEMM."""
        v_tile = smem.v.at[s].T if st.fp8 else smem.v.at[s]  # FP8: Vᵀ, K-major B
        return accumulate_pv(o, p_operand, v_tile, lambda: wait_k(j + 1),
                             interpret=st.interpret)

    def give_turn(s):
        plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may go on
        plgpu.barrier_wait(v_ready.at[s])
        plgpu.barrier_wait(turn)  # Pong: our turn on the tensor cores again

    def step(j, carry, *, masked: bool):
        o, m_i, l_i, *v_scale_prev = carry
        s = slot(j)
        k_scale = None
        if st.fp8:
            k_scale, v_scale = scales[1][j], scales[2][j]  # scalar loads, hidden by the GEMM

        def qk(s_acc):
            plgpu.wgmma(s_acc, own.q, smem.k.at[s].T)
            # Ping: meet the other warpgroup as it finishes its softmax; it issues its P·V
            # while this GEMM runs, then its softmax overlaps our next GEMMs.
            sync(turn)
            return s_acc[...]
        scores = pl.run_scoped(qk, plgpu.ACC((st.block_q, st.block_kv), jnp.float32))
        block = _release_k(st, smem.k_free, smem.key_rings, s, wg)
        p, m_new, alpha = softmax(scores, m_i, j, block, masked=masked, k_scale=k_scale)
        if st.fp8:
            _p_to_smem(p, own.p)
            l_i = l_i * alpha + p.sum(axis=1)  # from the unrounded P
            # The accumulator holds O·448/s_V of the previous block.
            o = o * row(alpha * (v_scale_prev[0] / v_scale), o.shape)
            give_turn(s)
            o = pv(o, own.p, s, j)
            plgpu.barrier_arrive(smem.v_free.at[s])
            return o, m_new, l_i, v_scale
        o = o * row(alpha, o.shape)
        p16 = p.astype(st.dtype)
        if st.head_dim <= 128:
            # Row sum before handing over the turn, pinned there: JAX's reference kernel
            # (attention_mgpu) found this order faster at head_dim <= 128, and the other
            # one at larger head dims.
            l_i = l_i * alpha + p.sum(axis=1)
            o, l_i, m_new, p16 = lax.optimization_barrier((o, l_i, m_new, p16))
            give_turn(s)
        else:
            give_turn(s)
            l_i = l_i * alpha + p.sum(axis=1)
        o = pv(o, a_operand(p16, own.p), s, j)
        plgpu.barrier_arrive(smem.v_free.at[s])
        return o, m_new, l_i

    skip_step = functools.partial(serial_skip_step, slot=slot, turn=turn, k_free=smem.k_free,
                                  v_ready=v_ready, v_free=smem.v_free, wait_k=wait_k)
    wait_k(cta_first)
    return walk(carry, ranges, cta_first=cta_first, cta_last=cta_last, step=step,
                skip_step=skip_step, lower_band=st.has_lower_band,
                unmasked=st.has_unmasked_blocks, upper_mask=st.has_upper_mask)


def _overlapped_loop(wg, st: _Static, carry, ranges, softmax, smem: _Smem, own: _Own, *,
                     scales, cta_first, cta_last, slot):
    """FA3's intra-warpgroup pipelining (Sec. 3.2, Algorithm 2), inside the ping-pong.

    Step j issues S_j = Q·K_jᵀ and then O += P_{j-1}·V_{j-1}, waits for S_j only, and
    runs the softmax of S_j while the P·V GEMM is still on the tensor cores; O is
    rescaled by alpha_j after that GEMM is done. The first visible block has no P·V yet
    (``head``) and the last P·V has no S after it (``tail``).

    ``turn`` holds one single-arrival mbarrier per consumer: a consumer waits on its own
    before issuing its GEMMs and arrives at the next one's right after, so the consumers
    issue their GEMMs in a strict round robin (alternation with two) and each one's
    softmax overlaps the others' GEMMs.

    The carry's last entry is what P·V of the previous block needs: bf16 P_{j-1} in
    registers; FP8 s_V,j-1, since P̃ goes through SMEM, which costs no registers for
    P̃_{j-1}, only a second P tile: P̃_j is stored into tile j % 2 while the GEMM reads
    tile (j - 1) % 2, and O is rescaled by ``alpha_j · s_V,j-1 / s_V,j`` (the accumulator
    holds O · 448 / s_V of the last block added).
    """
    first, last = ranges[0], ranges[3]
    bq, bkv = st.block_q, st.block_kv
    k_ready, v_ready, k_free, v_free = smem.k_ready, smem.v_ready, smem.k_free, smem.v_free
    take_turn, pass_turn = turns = round_robin(smem.turn, wg, st.num_consumers)

    def p_tile(j):
        """FP8: P̃_j's SMEM tile (two per consumer)."""
        return own.p.at[lax.rem(j, 2)]

    def pv_operand(p16):
        """bf16 P as wgmma's A operand: from registers (through SMEM in interpret mode)."""
        return a_operand(p16, own.p)

    def v_tile(s):
        return smem.v.at[s].T if st.fp8 else smem.v.at[s]  # FP8: Vᵀ, K-major B

    def block_scales(j):
        return (scales[1][j], scales[2][j]) if st.fp8 else (None, None)

    def head(carry):
        """The first visible block: S, softmax, no P·V yet (O is still 0)."""
        o, m_i, l_i, _ = carry
        s = slot(first)
        k_scale, v_scale = block_scales(first)
        scores = head_scores(own.q, smem.k.at[s], k_ready.at[s], turns)
        block = _release_k(st, k_free, smem.key_rings, s, wg)
        p_out = p_tile(first) if st.fp8 else None
        p, m_new, alpha = softmax(scores, m_i, first, block, masked=st.has_mask,
                                  k_scale=k_scale)
        if st.fp8:
            _p_to_smem(p, p_out)
            return o, m_new, l_i * alpha + p.sum(axis=1), v_scale
        return o, m_new, p.sum(axis=1), p.astype(st.dtype)

    def step(j, carry, *, masked: bool):
        """Block j > first: S_j and P_{j-1}·V_{j-1} in flight together, softmax under P·V."""
        o, m_i, l_i, prev = carry
        s, s_prev = slot(j), slot(j - 1)
        k_scale, v_scale = block_scales(j)
        plgpu.barrier_wait(k_ready.at[s])
        take_turn()

        def gemms(s_acc, pv_acc):
            plgpu.wgmma(s_acc, own.q, smem.k.at[s].T)
            plgpu.barrier_wait(v_ready.at[s_prev])
            plgpu.wgmma(pv_acc, p_tile(j - 1) if st.fp8 else pv_operand(prev),
                        v_tile(s_prev))
            pass_turn()  # the other warpgroup's GEMMs queue behind ours
            scores = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # S_j; P·V still runs
            block = _release_k(st, k_free, smem.key_rings, s, wg)
            p_out = p_tile(j) if st.fp8 else None
            p, m_new, alpha = softmax(scores, m_i, j, block, masked=masked, k_scale=k_scale)
            if st.fp8:
                _p_to_smem(p, p_out)
                return m_new, l_i * alpha + p.sum(axis=1), alpha
            return p, m_new, l_i * alpha + p.sum(axis=1), alpha

        if st.fp8:
            o, (m_new, l_new, alpha) = softmax_under_pv(
                o, (bq, bkv), gemms, lambda zeros: (m_i, l_i, m_i), interpret=st.interpret)
            plgpu.barrier_arrive(v_free.at[s_prev])  # Ṽ_{j-1} is read
            return o * row(alpha * (prev / v_scale), o.shape), m_new, l_new, v_scale
        o, (p, m_new, l_new, alpha) = softmax_under_pv(
            o, (bq, bkv), gemms, lambda zeros: (zeros, m_i, l_i, m_i),
            interpret=st.interpret)
        if not st.interpret:
            # P_j must not be cast to 16 bits before P·V's wait: LLVM gives P_j the
            # registers of P_{j-1} (the loop carry), which the P·V GEMM is still reading,
            # and ptxas then serialises every wgmma of the kernel (warning C7513). The
            # barrier pins the cast after the wait.
            p = lax.optimization_barrier(p)
        plgpu.barrier_arrive(v_free.at[s_prev])  # V_{j-1} is read
        return o * row(alpha, o.shape), m_new, l_new, p.astype(st.dtype)

    def tail(o, p_last):
        """O += P·V of the last visible block."""
        s = slot(last - 1)
        take_turn()
        plgpu.barrier_wait(v_ready.at[s])
        p = p_tile(last - 1) if st.fp8 else pv_operand(p_last)
        o = accumulate_pv(o, p, v_tile(s), pass_turn, interpret=st.interpret)
        plgpu.barrier_arrive(v_free.at[s])
        return o

    skip_step = functools.partial(overlapped_skip_step, slot=slot, turns=turns,
                                  k_ready=k_ready, k_free=k_free, v_ready=v_ready,
                                  v_free=v_free)

    def no_tail(o, p_last):
        take_turn()  # one turn per consumer either way, so that the turns stay paired
        pass_turn()
        return o

    def last_pv(nonempty, carry):
        o, m_i, l_i, prev = carry
        if st.fp8:  # the tail reads P̃ from SMEM; s_V of the last block stays for the epilogue
            return lax.cond(nonempty, tail, no_tail, o, None), m_i, l_i, prev
        return lax.cond(nonempty, tail, no_tail, o, prev), m_i, l_i

    if not st.fp8:
        # P of the previous block rides in the carry; a placeholder until the head's.
        p_none = plgpu.layout_cast(jnp.zeros((bq, bkv), st.dtype), plgpu.Layout.WGMMA)
        carry = (*carry, p_none)
    return walk_overlapped(
        carry, ranges, cta_first=cta_first, cta_last=cta_last, head=head,
        step=step, last_pv=last_pv, skip_step=skip_step, lower_band=st.has_lower_band,
        unmasked=st.has_unmasked_blocks, upper_mask=st.has_upper_mask)


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False, value_head_dim: int | None = None) -> str | None:
    """Why the Mosaic GPU forward cannot run this call, or None if it can.

    ``value_head_dim``: the values' head dim where it differs from the queries' (None:
    the same); the kernel's tiles are built for one head dim, so such calls are refused.

    Every mask, segment ids (hence padding lengths) and soft-capping are supported (and by
    the backward too, see :mod:`.backward`); bias and mask arrays up to head_dim 192 (their
    gradients come from the Triton backward).
    """
    del kv_shape, mask, has_segments, softcap
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU kernel takes bfloat16 or float16 inputs, got {jnp.dtype(dtype)}"
    if q_shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q_shape[-1]} is above the kernel's maximum {MAX_HEAD_DIM}"
    if value_head_dim is not None and value_head_dim != q_shape[-1]:
        return (f"the Mosaic GPU kernel needs one head dim for query, key and value; got "
                f"query/key head_dim {q_shape[-1]} and value head_dim {value_head_dim}")
    if (has_bias or has_mask) and padded_head_dim(q_shape[-1]) > _MAX_LOGIT_ARRAY_HEAD_DIM:
        return (f"bias and mask arrays need head_dim <= {_MAX_LOGIT_ARRAY_HEAD_DIM} in the "
                f"Mosaic GPU kernel (got {q_shape[-1]}): above it the K/V rings leave no "
                "shared memory for a bias tile")
    return None


def forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, *, mask: MaskSpec,
            scale: float, config: MosaicConfig, interpret: bool, softcap: float | None = None,
            bias: jax.Array | None = None, attn_mask: jax.Array | None = None,
            bounds: RowBounds | None = None, into: tuple[jax.Array, jax.Array] | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """Attention forward on Hopper.

    Args:
      q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim],
        bfloat16 or float16, ``heads % kv_heads == 0``.
      segment_ids: None or ``(q_ids [batch, seq_q], kv_ids [batch, seq_kv])`` int32: a pair
        is visible only if its ids are equal (and ``mask`` shows it). Each consumer only
        visits the KV blocks whose id range can meet its rows' (:mod:`pallas_flash.segments`).
      mask: visibility; its ``seq_q``/``seq_kv`` are the real lengths.
      scale: logit scale.
      config: block sizes (or any of :data:`~pallas_flash.mosaic.config.CONFIG_TYPES`: its
        forward part); ``config.check_fits`` must pass at the padded head dim. With
        bias / mask arrays it is first shrunk to fit their rings
        (:func:`~pallas_flash.mosaic.config.fit_logit_rings`).
      interpret: run in Mosaic GPU interpret mode on the CPU.
      softcap: ``c``: logits become ``c * tanh(scale * q·k / c)`` before the softmax.
      bias: None or canonical ``[B', N', T', S']`` (:mod:`pallas_flash.bias`), floating,
        added to the scaled (and capped) logits; read where it varies, broadcast dims never
        expanded (:class:`LogitArray`; only a ``[B', N', 1, 1]`` one is expanded to
        ``[B', N', T]``).
      attn_mask: None or canonical ``[B', N', T', S']`` bool, False hides a pair; folded
        into the bias as -inf when it broadcasts to the bias's shape, else read as int8.
      into: None, or ``(out [batch, seq_q, heads, head_dim] float32, lse [batch, heads,
        seq_q] float32)``: the same queries' attention over other keys (ring attention's
        running result). Each consumer merges its rows into it in the epilogue
        (:func:`~pallas_flash.mosaic.epilogue.merged_into`), and the merged result is
        returned, ``out`` in float32.
      bounds: None or :class:`~pallas_flash.contract.RowBounds` (int32 ``[batch]`` each):
        rows ``>= q_end`` give out 0 and lse ``EMPTY_ROW_LSE``, only keys in ``[kv_start,
        kv_end)`` are visible. Each consumer's KV blocks are cut to them (blocks wholly
        outside never loaded, wholly inside unmasked); V's hidden rows are zeroed first
        (one pass over V), as a hidden row's NaN would leak through P·V in a cut block.

    Returns:
      ``out`` like ``q`` (float32 with ``into``) and ``lse: [batch, heads, seq_q]`` float32
      (natural log); rows that see no key give out 0 and lse ``EMPTY_ROW_LSE``.

    Any lengths work: the wrapper zero-pads the sequences to whole blocks (padded keys
    are hidden by ``mask.seq_kv``, padded query rows are cut off) and the head dim to a
    multiple of 64 (zero columns change neither Q·Kᵀ nor the kept columns of P·V).
    """
    config = forward_config(config, q.shape, k.shape, q.dtype, mask)
    if bounds is not None:
        bounds = row_bounds.checked(bounds, q.shape[0])
        v = row_bounds.outside_zeroed(v, bounds, axis=1, keys=True)
    segmented = segment_ids is not None
    reason = unsupported(q.shape, k.shape, q.dtype, mask, segmented, softcap,
                         has_bias=bias is not None, has_mask=attn_mask is not None)
    if reason is not None:
        raise ValueError(reason)
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    dim = padded_head_dim(head_dim)
    itemsize = jnp.dtype(q.dtype).itemsize
    _check_into(into, q.shape)
    bias, attn_mask = fold_mask(bias, attn_mask)
    bias_array = logit_array(bias, is_mask=False)
    mask_array = logit_array(attn_mask, is_mask=True)
    logit_arrays = [(x, a) for x, a in ((bias, bias_array), (attn_mask, mask_array))
                    if a is not None]
    rings = tuple(a.ring for _, a in logit_arrays if a.ring is not None)
    config = fit_logit_rings(config, dim, itemsize, segments=segmented, logit_rings=rings)
    config.check_fits(dim, itemsize, segments=segmented, logit_rings=rings)
    rows_per_cta = config.rows_per_cta
    seq_q_pad = round_up(seq_q, rows_per_cta)
    seq_kv_pad = round_up(seq_kv, config.block_kv)
    st = _Static(
        mask=mask, scale_log2=scale * LOG2E, block_q=config.block_q,
        block_kv=config.block_kv, num_stages=config.num_stages, head_dim=dim,
        dtype=jnp.dtype(q.dtype), group=heads // kv_heads,
        num_q_tiles=seq_q_pad // rows_per_cta, kv_padded=seq_kv_pad != seq_kv,
        overlap=config.overlap, interpret=interpret, softcap=softcap,
        segmented=segmented, num_consumers=config.num_consumers, bias=bias_array,
        attn_mask=mask_array, heads=heads, batch=batch, merges_into=into is not None,
        bounded=bounds is not None)
    if config.persistent:
        st = dataclasses.replace(
            st, persistent_ctas=persistent_ctas(st.tile_grid, interpret=interpret))

    operands = [pad_operand(q, seq_q_pad, dim), pad_operand(k, seq_kv_pad, dim),
                pad_operand(v, seq_kv_pad, dim)]
    if segmented:
        q_ids, kv_ids = pad_segment_ids(segment_ids, seq_q_pad, seq_kv_pad)
        operands += [q_ids, kv_ids,
                     tile_spans(q_ids, kv_ids, st.block_q, st.block_kv, walk_kv=True)]
    # The bias, then the mask, as _kernel unpacks them.
    operands += [logit_operand(x, array, seq_q_pad, seq_kv_pad) for x, array in logit_arrays]
    if into is not None:
        operands += [pad_operand(into[0], seq_q_pad, dim), pad_axis(into[1], 2, seq_q_pad)]
    if bounds is not None:  # as the kernel reads them: [3, batch] (q_end, kv_start, kv_end)
        operands.append(jnp.stack(bounds))
    out, lse = _launch(st, operands, scratch=_scratch(st, config, [a for _, a in logit_arrays]),
                       out_type=(kernel_output((batch, seq_q_pad, heads, dim),
                                               q.dtype if into is None else jnp.float32, q),
                                 kernel_output((batch, heads, seq_q_pad), jnp.float32, q)))
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]


def _launch(st: _Static, operands: list, *, scratch: dict, out_type: tuple) -> tuple:
    """Runs :func:`_kernel` over the tile grid on ``operands`` (as ``_kernel`` unpacks them)."""
    grid, grid_names = st.tile_grid.launch()
    call = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        num_threads=st.num_consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params(st.interpret, st.num_consumers + 1),
    )
    return call(*operands)


class Fp8Operands(NamedTuple):
    """Quantized inputs of the FP8 forward (``x ≈ x_fp8 · scale`` per tile and head).

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


def check_fp8_operands(ops: Fp8Operands, config: MosaicConfig) -> None:
    """Raises ValueError unless ``ops`` are FP8 operands (shapes and dtypes as
    :class:`Fp8Operands` says) with scales per ``config``'s tiles, head_dim at most
    :data:`MAX_HEAD_DIM`."""
    if not isinstance(ops, Fp8Operands):
        raise ValueError(f"ops must be Fp8Operands, got {type(ops).__name__}")
    if ops.q.ndim != 4 or ops.k.ndim != 4:
        raise ValueError(f"q and k must be [batch, seq, heads, head_dim], got q "
                         f"{ops.q.shape} and k {ops.k.shape}")
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
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def forward_fp8_operands(ops: Fp8Operands, *, mask: MaskSpec, scale: float,
                         config: MosaicConfig, interpret: bool, o_apart: bool,
                         bounds: RowBounds | None = None) -> tuple[jax.Array, jax.Array]:
    """The kernel on the FP8 operand format (:mod:`pallas_flash.mosaic.forward_fp8`, which
    picks and checks ``config`` for it: its shared memory must fit).

    Args:
      ops: the quantized inputs (:func:`check_fp8_operands`), scales per ``config.block_q``
        / ``config.block_kv`` tile.
      mask: visibility; its ``seq_q``/``seq_kv`` are the real lengths.
      scale: logit scale (applied to the dequantized Q·Kᵀ).
      config: tiles and schedule.
      interpret: run in Mosaic GPU interpret mode on the CPU.
      o_apart: (persistent CTAs only) O tiles of their own beside the P tiles, else O
        leaves through the P tiles' memory.
      bounds: None or per-sequence :class:`~pallas_flash.contract.RowBounds`, as
        :func:`forward` takes them (Vᵀ's hidden keys are zeroed first).

    Returns:
      ``out: [batch, seq_q, heads, head_dim]`` bfloat16 and ``lse: [batch, heads, seq_q]``
      float32 (natural log).

    The sequences are zero-padded to whole tiles here (padded keys are hidden by
    ``mask.seq_kv``, padded rows dropped, padded Q tiles get scale 1), the head dim to a
    multiple of 64.
    """
    check_fp8_operands(ops, config)
    if o_apart and not config.persistent:
        raise ValueError("o_apart=True needs a persistent config (config.persistent)")
    batch, seq_q, heads, head_dim = ops.q.shape
    if bounds is not None:
        bounds = row_bounds.checked(bounds, batch)
        ops = ops._replace(vt=row_bounds.outside_zeroed(ops.vt, bounds, axis=3, keys=True))
    seq_kv, kv_heads = ops.k.shape[1], ops.k.shape[2]
    dim = padded_head_dim(head_dim)
    consumers = config.num_consumers
    rows_per_cta = consumers * config.block_q
    seq_q_pad = round_up(seq_q, rows_per_cta)
    seq_kv_pad = round_up(seq_kv, config.block_kv)
    st = _Static(
        mask=mask, scale_log2=scale * LOG2E, block_q=config.block_q,
        block_kv=config.block_kv, num_stages=config.num_stages, head_dim=dim,
        dtype=jnp.dtype(E4M3), group=heads // kv_heads, num_consumers=consumers,
        num_q_tiles=seq_q_pad // rows_per_cta, kv_padded=seq_kv_pad != seq_kv,
        interpret=interpret, batch=batch, heads=heads, overlap=config.overlap, fp8=True,
        o_apart=o_apart, bounded=bounds is not None)
    if config.persistent:
        st = dataclasses.replace(
            st, persistent_ctas=persistent_ctas(st.tile_grid, interpret=interpret))
    ones = functools.partial(pad_axis, value=1.0)  # padded tiles: scale 1, data 0
    operands = [
        pad_axis(pad_axis(ops.q, 1, seq_q_pad), 3, dim),
        pad_axis(pad_axis(ops.k, 1, seq_kv_pad), 3, dim),
        pad_axis(pad_axis(ops.vt, 3, seq_kv_pad), 2, dim),
        ones(ops.q_scale, 1, seq_q_pad // st.block_q), ops.k_scale, ops.v_scale]
    if bounds is not None:  # as the kernel reads them: [3, batch] (q_end, kv_start, kv_end)
        operands.append(jnp.stack(bounds))
    out, lse = _launch(st, operands, scratch=_scratch(st, config, []),
                       out_type=(jax.ShapeDtypeStruct((batch, seq_q_pad, heads, dim),
                                                      FP8_OUT_DTYPE),
                                 jax.ShapeDtypeStruct((batch, heads, seq_q_pad), jnp.float32)))
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]


def _check_into(into, q_shape) -> None:
    """Raises ValueError unless ``into`` is None or a running ``(out, lse)`` for queries
    of ``q_shape``: out float32 shaped like q, lse float32 [batch, heads, seq_q]."""
    if into is None:
        return
    batch, seq_q, heads, _ = q_shape
    expected = ((tuple(q_shape), "out"), ((batch, heads, seq_q), "lse"))
    if not (isinstance(into, tuple) and len(into) == 2):
        raise ValueError(f"into must be a pair (out, lse), got {type(into).__name__}")
    for x, (shape, name) in zip(into, expected, strict=True):
        if tuple(x.shape) != shape or x.dtype != jnp.float32:
            raise ValueError(
                f"into's {name} must be float32 of shape {shape}, got {x.dtype} "
                f"{tuple(x.shape)}")


def _fp8_transforms(minor: int, dtype) -> tuple:
    """SMEM tiling + swizzle for an FP8-kernel tile whose minor dim holds ``minor`` elements.

    wgmma reads (8, swizzle / itemsize) tiles; the widest swizzle that divides a row avoids
    bank conflicts. FP8 rows of 64 elements are 64 bytes, so they get the 64-byte swizzle
    (the bf16 kernel's 128 bytes need 128 e4m3 elements).
    """
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, plgpu.find_swizzle(minor * itemsize * 8))
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _scratch(st: _Static, config: MosaicConfig, logit_arrays: list[LogitArray]) -> dict:
    """The kernel's SMEM scratch and barriers (:class:`_Smem`), in the order they are
    allocated."""
    consumers, dtype, dim = st.num_consumers, st.dtype, st.head_dim
    if st.fp8:
        k_transforms = _fp8_transforms(dim, dtype)
        v_tile, v_transforms = (dim, st.block_kv), _fp8_transforms(st.block_kv, dtype)  # Vᵀ
    else:
        k_transforms = v_transforms = smem_transforms(dtype.itemsize)
        v_tile = (st.block_kv, dim)
    scratch = dict(
        q_smem=plgpu.SMEM((consumers, st.block_q, dim), dtype, transforms=k_transforms),
        k_smem=plgpu.SMEM((st.num_stages, st.block_kv, dim), dtype, transforms=k_transforms),
        v_smem=plgpu.SMEM((st.num_stages, *v_tile), dtype, transforms=v_transforms),
        lse_smem=plgpu.SMEM((consumers, st.block_q), jnp.float32),
        q_ready=plgpu.Barrier(num_barriers=consumers),
        # One TMA arrival per copy: K, and what rides along (key ids, bias / mask tiles).
        k_ready=plgpu.Barrier(num_arrivals=st.key_slot_copies, num_barriers=st.num_stages),
        v_ready=plgpu.Barrier(num_barriers=st.num_stages),
        k_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=st.num_stages),
        v_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=st.num_stages),
        # Serial schedule: one barrier both consumers meet at; overlapped: one per consumer.
        turn=(plgpu.Barrier(num_barriers=consumers) if st.overlap
              else plgpu.Barrier(num_arrivals=consumers)),
    )
    if st.fp8:
        # P̃ tiles (two per consumer when overlapped) and bfloat16 O tiles: in one union
        # unless st.o_apart (forward_fp8.smem_bytes counts both ways).
        scratch["p_done"] = plgpu.Barrier(num_arrivals=consumers)
        p_tiles = plgpu.SMEM((consumers, *((2,) if st.overlap else ()), st.block_q,
                              st.block_kv), dtype, transforms=v_transforms)
        o_tiles = plgpu.SMEM((consumers, st.block_q, dim), FP8_OUT_DTYPE,
                             transforms=_fp8_transforms(dim, FP8_OUT_DTYPE))
        if st.o_apart:
            scratch.update(p_smem=p_tiles, o_smem=o_tiles)
        else:
            scratch["p_o_smem"] = plgpu.RefUnion(p_tiles, o_tiles)
        return scratch
    if st.segmented:
        scratch["kv_ids_smem"] = plgpu.SMEM((st.num_stages, st.block_kv), jnp.int32)
    for array in logit_arrays:
        if array.ring is not None:
            scratch["mask_smem" if array.is_mask else "bias_smem"] = array.smem(config)
    if st.interpret:
        scratch["p_smem"] = plgpu.SMEM(
            (consumers, st.block_q, st.block_kv), dtype, transforms=k_transforms)
    if st.persistent_ctas:
        scratch["o_smem"] = plgpu.SMEM((consumers, st.block_q, dim), dtype,
                                       transforms=k_transforms)
    return scratch

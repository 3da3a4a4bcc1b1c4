"""FlashAttention-3 forward for Hopper (sm90), as a Pallas Mosaic GPU kernel.

Shah et al. 2024, "FlashAttention-3", Sec. 3. One CTA owns ``2 * block_q`` query rows of
one (batch, head) and runs three warpgroups (``lax.axis_index("wg")``):

* **producer** (wg 2, Sec. 3.1 "warp specialization"): gives its registers away
  (``setmaxnreg`` 40) and only issues TMA copies of K_j and V_j into a ``num_stages``-deep
  SMEM ring. Each slot has a *ready* mbarrier (arrived by the TMA engine) and a *free*
  mbarrier (arrived by both consumers once they no longer read the slot).
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

CPU testing: Mosaic GPU interpret mode cannot run ``pl.run_state`` nor a wgmma whose A
operand is in registers, which is how FA3 feeds P to the P·V GEMM. With
``interpret=True`` the kernel takes one documented detour (:func:`_pv_through_smem`):
P is stored to SMEM and P·V lands in a fresh accumulator that is added to O. Everything
else (pipeline, barriers, ping-pong, masking, epilogue) is the same code on both paths.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.config import (
    MAX_HEAD_DIM,
    NUM_CONSUMERS,
    MosaicConfig,
    padded_head_dim,
)
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.reference import EMPTY_ROW_LSE
from pallas_flash.segments import cut_to_span, pad_segment_ids, tile_spans

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Registers per thread (setmaxnreg): 2 x 232 (consumers) + 40 (producer) = 504 <= 512,
# i.e. the 64 K registers of an SM for 3 x 128 threads.
_CONSUMER_REGISTERS = 232
_PRODUCER_REGISTERS = 40
_PRODUCER = NUM_CONSUMERS  # warpgroup index of the TMA producer (two consumers)
# With three consumers, 4 x 128 threads: 3 x 160 + 32 = 512 (FA3's split at head_dim 64).
_REGISTERS = {2: (_CONSUMER_REGISTERS, _PRODUCER_REGISTERS), 3: (160, 32)}
# 128-byte swizzle: one swizzle row is 64 16-bit elements, so every SMEM tile is stored in
# (8, 64) tiles, the layout wgmma reads without bank conflicts.
_SWIZZLE = 128


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs that is not a ref (all Python values)."""

    mask: MaskSpec
    scale_log2: float  # softmax scale * log2(e): exp(scale*s - m) = exp2(s*scale_log2 - m2)
    block_q: int
    block_kv: int
    num_stages: int
    head_dim: int
    dtype: jnp.dtype
    group: int  # query heads per K/V head (GQA)
    num_q_tiles: int  # CTAs along the sequence, each of num_consumers * block_q rows
    kv_padded: bool  # seq_kv was padded up to whole blocks
    overlap: bool  # FA3's intra-warpgroup pipelining (MosaicConfig.overlap)
    pv_through_smem: bool  # the interpret-mode detour, see the module docstring
    softcap: float | None = None  # logits become softcap * tanh(scale * s / softcap)
    segmented: bool = False  # segment ids: a pair is visible only if its ids are equal
    num_consumers: int = NUM_CONSUMERS  # consumer warpgroups; the producer comes after

    @property
    def reverse_q_tiles(self) -> bool:
        # Causal work grows with the query index: launch the heaviest CTAs first so the
        # last wave holds the short ones (FA3/tokamax's causal load balancing).
        return self.mask.is_causal

    @property
    def has_lower_band(self) -> bool:
        # Only a window or segment ids hide keys *before* a query; otherwise every row
        # starts at key 0 and the leading skip/masked loops are statically empty.
        return self.mask.window is not None or self.segmented

    @property
    def has_unmasked_blocks(self) -> bool:
        # With segment ids every visited block compares ids: a consumer's ranges are
        # (first, last, last, last) and its leading masked loop runs all of its blocks.
        return not self.segmented

    @property
    def has_upper_mask(self) -> bool:
        # Causal/window rows end before the last key, and padded keys must be hidden;
        # otherwise every visited block is full and the trailing masked loop is empty.
        band = self.mask.is_causal or self.mask.window is not None or self.kv_padded
        return band and self.has_unmasked_blocks

    @property
    def has_mask(self) -> bool:
        return self.has_lower_band or self.has_upper_mask


def _smem_transforms(itemsize: int):
    return (plgpu.TilingTransform((8, _SWIZZLE // itemsize)), plgpu.SwizzleTransform(_SWIZZLE))


def _row(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcasts a per-row vector (``WGMMA.reduce(1)`` layout) over a [rows, n] tile."""
    return lax.broadcast_in_dim(x, shape, [0])


def _sync(barrier) -> None:
    """Both consumers meet: arrive at the 2-arrival barrier and wait for the other."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def _consumer_ranges(st: _Static, spans_ref, batch, q_block):
    """KV blocks of query block ``q_block`` (``block_q`` rows), as ``MaskSpec.kv_blocks``.

    With segment ids the band is cut to the span of KV blocks whose ids can meet the
    block's (``spans_ref``: [B, 2, num_q_blocks] from :func:`segments.tile_spans`), and
    every block of it needs the mask: ``(first, last, last, last)``.
    """
    ranges = st.mask.kv_blocks(q_block * st.block_q, st.block_q, st.block_kv)
    if not st.segmented:
        return ranges
    return cut_to_span(ranges, spans_ref[batch, 0, q_block], spans_ref[batch, 1, q_block])


def _hull(a, b):
    """The smallest block range ``[first, last)`` holding ranges ``a`` and ``b``; an empty
    range (first == last) adds nothing, wherever it sits."""
    (a_first, a_last), (b_first, b_last) = a, b
    a_empty, b_empty = a_first == a_last, b_first == b_last
    first = jnp.where(a_empty, b_first, jnp.where(b_empty, a_first, jnp.minimum(a_first, b_first)))
    last = jnp.where(a_empty, b_last, jnp.where(b_empty, a_last, jnp.maximum(a_last, b_last)))
    return first, last


def _release_k(k_free, kv_ids_smem, s):
    """S_j is in registers: K_j's ring slot may be refilled.

    Returns the slot's key segment ids ([block_kv] int32, laid out as the columns of S),
    read before the slot is released, or None without segment ids.
    """
    kv_ids = None
    if kv_ids_smem is not None:
        kv_ids = plgpu.load(kv_ids_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
    plgpu.barrier_arrive(k_free.at[s])
    return kv_ids


def _kernel(q_ref, k_ref, v_ref, *refs, st: _Static, q_smem, k_smem, v_smem, lse_smem,
            q_ready, k_ready, v_ready, k_free, v_free, turn, kv_ids_smem=None, p_smem=None):
    """One CTA. Refs: q/out [B, Tq, N, D], k/v [B, Tk, K, D], lse [B, N, Tq] (GMEM);
    q_smem [2, block_q, D], k_smem/v_smem [num_stages, block_kv, D], lse_smem [2, block_q].

    With segment ids ``refs`` starts with q_ids [B, Tq], kv_ids [B, Tk] and spans
    [B, 2, Tq / block_q] (GMEM), and kv_ids_smem [num_stages, block_kv] rides along K's
    ring (one more TMA arrival on ``k_ready``).
    """
    if st.segmented:
        q_ids_ref, kv_ids_ref, spans_ref, out_ref, lse_ref = refs
    else:
        (out_ref, lse_ref), q_ids_ref, kv_ids_ref, spans_ref = refs, None, None, None
    bq, bkv = st.block_q, st.block_kv
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    q_tile = lax.axis_index("q_tiles")
    if st.reverse_q_tiles:
        q_tile = st.num_q_tiles - 1 - q_tile
    consumers = st.num_consumers
    cta_q0 = q_tile * (consumers * bq)
    # The K/V blocks any row of this CTA sees; the producer loads exactly these, once.
    if st.segmented:  # each consumer's span may differ: load their union
        first_block = q_tile * consumers
        cta_first, cta_last = functools.reduce(_hull, (
            _consumer_ranges(st, spans_ref, batch, first_block + c)[::3]
            for c in range(consumers)))
    else:
        cta_first, _, _, cta_last = st.mask.kv_blocks(cta_q0, consumers * bq, bkv)

    def slot(j):
        """Ring slot of K/V block j (blocks are numbered from the CTA's first)."""
        return lax.rem(j - cta_first, st.num_stages)

    wg = lax.axis_index("wg")
    consumer_registers, producer_registers = _REGISTERS[consumers]

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        # This warpgroup's block ranges, inside the CTA's (it must step through all of the
        # CTA's blocks to keep the ring and the ping-pong in lockstep with the other one).
        ranges = tuple(jnp.clip(x, cta_first, cta_last) for x in _consumer_ranges(
            st, spans_ref, batch, q_tile * consumers + wg))
        q0 = cta_q0 + wg * bq
        q_ids = None
        if st.segmented:  # this warpgroup's query ids, laid out as the rows of S, once
            # (plain loads from GMEM: Mosaic GPU vectorises ("optimizes") SMEM loads only)
            q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q0, bq)],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        _consumer_warpgroup(
            wg, st, q_ref, out_ref, lse_ref, q_smem.at[wg], k_smem, v_smem, lse_smem.at[wg],
            q_ready.at[wg], k_ready, v_ready, k_free, v_free, turn,
            None if p_smem is None else p_smem.at[wg], kv_ids_smem,
            batch=batch, head=head, q0=q0, q_ids=q_ids, ranges=ranges,
            cta_first=cta_first, cta_last=cta_last, slot=slot)

    @pl.when(wg == consumers)  # the last warpgroup
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        kv_head = lax.div(head, st.group)  # GQA: K/V are indexed, never repeated

        def load(ref, smem, ready, j):
            rows = (batch, pl.ds(j * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(ref.at[rows], smem.at[slot(j)], ready.at[slot(j)])

        def load_k(j):
            load(k_ref, k_smem, k_ready, j)
            if st.segmented:  # the keys' ids, 4 * block_kv bytes, on K's barrier
                plgpu.copy_gmem_to_smem(kv_ids_ref.at[batch, pl.ds(j * bkv, bkv)],
                                        kv_ids_smem.at[slot(j)], k_ready.at[slot(j)])
        load_v = functools.partial(load, v_ref, v_smem, v_ready)

        # Prologue: fill the ring.
        for i in range(st.num_stages):
            @pl.when(cta_first + i < cta_last)
            def _fill(j=cta_first + i):
                load_k(j)
                load_v(j)

        # Steady state: a slot is refilled once both consumers freed it. K is reloaded
        # before V because consumers free K_j first (right after S = Q·K_jᵀ).
        @pl.loop(cta_first + st.num_stages, cta_last)
        def _refill(j):
            plgpu.barrier_wait(k_free.at[slot(j)])
            if st.segmented:
                # The consumers read the slot's key ids through the generic proxy; the
                # proxy fence orders those reads before the TMA (async proxy) overwrites.
                plgpu.commit_smem()
            load_k(j)
            plgpu.barrier_wait(v_free.at[slot(j)])
            load_v(j)

        # Observe the last releases too: a thread that waits on an mbarrier must see every
        # phase of it (the phase bit would otherwise be out of step; interpret mode checks).
        @pl.loop(jnp.maximum(cta_first, cta_last - st.num_stages), cta_last)
        def _drain(j):
            plgpu.barrier_wait(k_free.at[slot(j)])
            plgpu.barrier_wait(v_free.at[slot(j)])


def _consumer_warpgroup(wg, st: _Static, q_ref, out_ref, lse_ref, q_tile, k_smem, v_smem,
                        lse_tile, q_ready, k_ready, v_ready, k_free, v_free, turn, p_tile,
                        kv_ids_smem, *, batch, head, q0, q_ids, ranges, cta_first, cta_last,
                        slot):
    """Rows [q0, q0 + block_q) of one head: Algorithm 1 of FA3 for one consumer warpgroup.

    ``ranges``: this warpgroup's (first, full_first, full_last, last) KV blocks, inside the
    CTA's [cta_first, cta_last); ``q_ids``: its rows' segment ids ([block_q] int32) or None.
    """
    bq, bkv, d = st.block_q, st.block_kv, st.head_dim
    q_rows = (batch, pl.ds(q0, bq), head)
    plgpu.copy_gmem_to_smem(q_ref.at[q_rows], q_tile, q_ready)
    shape = (bq, bkv)

    def softmax(scores, m_i, j, kv_ids, *, masked: bool):
        """Online softmax of S_j in base 2 (FA3 Alg. 1 lines 9-11).

        m is kept in log2 units so that p = exp2(s * scale_log2 - m) is one FMA + ex2 per
        element. ``kv_ids``: the segment ids of block j's keys (from :func:`_release_k`).
        Returns P_j in the input dtype, the new m and alpha, the factor that rescales O
        (and l) to the new m.
        """
        def to_log2(x):  # scale * log2(e), applied in exp2's FMA rather than to the tile
            return x if st.softcap is not None else x * st.scale_log2

        if st.softcap is not None:  # soft-capping: c * tanh(scale * s / c), in base 2
            scale = st.scale_log2 / _LOG2E
            scores = jnp.tanh(scores * (scale / st.softcap)) * (st.softcap * _LOG2E)
        if masked:  # boundary block: hide pairs outside the band and keys >= seq_kv
            rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            visible = st.mask.visible(rows + q0, cols + j * bkv)
            if st.segmented:  # ... and pairs of different documents
                visible &= _row(q_ids, shape) == lax.broadcast_in_dim(kv_ids, shape, [1])
            scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m_i, to_log2(scores.max(axis=1)))
        if masked:
            # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
            # that exp2(-inf - m) stays 0 rather than NaN (empty rows end with l = 0).
            m_new_finite = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new_finite = m_new
        p = jnp.exp2(to_log2(scores) - _row(m_new_finite, shape))
        alpha = jnp.exp2(m_i - m_new_finite)
        return p, m_new, alpha

    carry = (
        plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    plgpu.barrier_wait(q_ready)
    loop = _overlapped_loop if st.overlap else _serial_loop
    o, m_i, l_i = loop(
        wg, st, carry, ranges, softmax, q_tile, k_smem, v_smem, k_ready, v_ready, k_free,
        v_free, turn, p_tile, kv_ids_smem, cta_first=cta_first, cta_last=cta_last, slot=slot)

    # Epilogue (Alg. 1 lines 12-14): normalise once, O and LSE leave through SMEM + TMA.
    empty = l_i == 0.0  # rows that saw no key: O = 0, lse = EMPTY_ROW_LSE
    l_safe = jnp.where(empty, 1.0, l_i)
    o = o * _row(1.0 / l_safe, o.shape)
    lse = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(l_safe)) * _LN2)
    q_tile[...] = o.astype(st.dtype)  # Q is dead after the last Q·Kᵀ: reuse its tile
    lse_tile[...] = lse
    plgpu.commit_smem()  # register stores -> visible to the TMA engine
    plgpu.copy_smem_to_gmem(q_tile, out_ref.at[q_rows])
    plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[batch, head, pl.ds(q0, bq)])
    plgpu.wait_smem_to_gmem(0)


def _serial_loop(wg, st: _Static, carry, ranges, softmax, q_tile, k_smem, v_smem, k_ready,
                 v_ready, k_free, v_free, turn, p_tile, kv_ids_smem, *, cta_first, cta_last,
                 slot):
    """Per block: S = Q·K_jᵀ, wait, softmax, O += P·V_j, wait (no intra-warpgroup overlap).

    ``turn`` is one 2-arrival mbarrier at which the two consumers meet twice per block.
    """
    first, full_first, full_last, last = ranges

    def wait_k(j):
        """K_j must have landed before S = Q·K_jᵀ is issued."""
        @pl.when(j < cta_last)
        def _():
            plgpu.barrier_wait(k_ready.at[slot(j)])

    def pv(o, p16, s, j):
        """O += P·V_j, on the tensor cores; the wait for K_{j+1} overlaps the GEMM."""
        if st.pv_through_smem:
            return _pv_through_smem(o, p16, p_tile, v_smem.at[s], functools.partial(wait_k, j + 1))

        def gemm(o_acc):
            plgpu.wgmma(o_acc, p16, v_smem.at[s])  # A = P straight from registers (FA3)
            wait_k(j + 1)
        return pl.run_state(gemm)(plgpu.ACC.init(o))

    def step(j, carry, *, masked: bool):
        o, m_i, l_i = carry
        s = slot(j)

        def qk(s_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[s].T)
            # Ping: meet the other warpgroup as it finishes its softmax; it issues its P·V
            # while this GEMM runs, then its softmax overlaps our next GEMMs.
            _sync(turn)
            return s_acc[...]
        scores = pl.run_scoped(qk, plgpu.ACC((st.block_q, st.block_kv), jnp.float32))
        kv_ids = _release_k(k_free, kv_ids_smem, s)
        p, m_new, alpha = softmax(scores, m_i, j, kv_ids, masked=masked)
        o = o * _row(alpha, o.shape)
        p16 = p.astype(st.dtype)

        def give_turn():
            plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may go on
            plgpu.barrier_wait(v_ready.at[s])
            plgpu.barrier_wait(turn)  # Pong: our turn on the tensor cores again

        if st.head_dim <= 128:
            # Row sum before handing over the turn, pinned there: JAX's reference kernel
            # (attention_mgpu) found this order faster at head_dim <= 128, and the other
            # one at larger head dims.
            l_i = l_i * alpha + p.sum(axis=1)
            o, l_i, m_new, p16 = lax.optimization_barrier((o, l_i, m_new, p16))
            give_turn()
        else:
            give_turn()
            l_i = l_i * alpha + p.sum(axis=1)
        o = pv(o, p16, s, j)
        plgpu.barrier_arrive(v_free.at[s])
        return o, m_new, l_i

    def skip_step(j, carry):
        """A block another row range of this CTA needs: same barriers as `step`, no math."""
        s = slot(j)
        _sync(turn)
        plgpu.barrier_arrive(k_free.at[s])
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(v_ready.at[s])
        plgpu.barrier_wait(turn)
        wait_k(j + 1)
        plgpu.barrier_arrive(v_free.at[s])
        return carry

    wait_k(cta_first)
    # Consumer 1 starts one turn late, so the two alternate on the tensor cores.
    pl.when(wg == 1)(functools.partial(_sync, turn))
    masked_step = functools.partial(step, masked=True)
    unmasked_step = functools.partial(step, masked=False)
    if st.has_lower_band:
        carry = lax.fori_loop(cta_first, first, skip_step, carry)
        carry = lax.fori_loop(first, full_first, masked_step, carry)
    if st.has_unmasked_blocks:
        carry = lax.fori_loop(full_first, full_last, unmasked_step, carry)  # the fast loop
    if st.has_upper_mask:
        carry = lax.fori_loop(full_last, last, masked_step, carry)
    carry = lax.fori_loop(last, cta_last, skip_step, carry)
    pl.when(wg == 0)(functools.partial(_sync, turn))  # ... and consumer 0 ends one late
    return carry


def _overlapped_loop(wg, st: _Static, carry, ranges, softmax, q_tile, k_smem, v_smem,
                     k_ready, v_ready, k_free, v_free, turn, p_tile, kv_ids_smem, *, cta_first,
                     cta_last, slot):
    """FA3's intra-warpgroup pipelining (Sec. 3.2, Algorithm 2), inside the ping-pong.

    Step j issues S_j = Q·K_jᵀ and then O += P_{j-1}·V_{j-1}, waits for S_j only, and
    runs the softmax of S_j while the P·V GEMM is still on the tensor cores; O is
    rescaled by alpha_j after that GEMM is done. The first visible block has no P·V yet
    (``head``) and the last P·V has no S after it (``tail``).

    ``turn`` holds one single-arrival mbarrier per consumer: a consumer waits on its own
    before issuing its GEMMs and arrives at the next one's right after, so the consumers
    issue their GEMMs in a strict round robin (alternation with two) and each one's
    softmax overlaps the others' GEMMs.
    """
    first, full_first, full_last, last = ranges
    bq, bkv = st.block_q, st.block_kv

    def take_turn():
        plgpu.barrier_wait(turn.at[wg])

    def pass_turn():
        plgpu.barrier_arrive(turn.at[lax.rem(wg + 1, st.num_consumers)])

    def pv_operand(p16):
        """P as wgmma's A operand: from registers (FA3); through SMEM when interpreting."""
        if not st.pv_through_smem:
            return p16
        p_tile[...] = p16
        plgpu.commit_smem()
        return p_tile

    def head(carry):
        """The first visible block: S, softmax, no P·V yet (O is still 0)."""
        o, m_i, _, _ = carry
        s = slot(first)
        plgpu.barrier_wait(k_ready.at[s])
        take_turn()

        def qk(s_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[s].T)
            pass_turn()
            return s_acc[...]
        scores = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
        kv_ids = _release_k(k_free, kv_ids_smem, s)
        p, m_new, _ = softmax(scores, m_i, first, kv_ids, masked=st.has_mask)
        return o, m_new, p.sum(axis=1), p.astype(st.dtype)

    def step(j, carry, *, masked: bool):
        """Block j > first: S_j and P_{j-1}·V_{j-1} in flight together, softmax under P·V."""
        o, m_i, l_i, p_prev = carry
        s, s_prev = slot(j), slot(j - 1)
        plgpu.barrier_wait(k_ready.at[s])
        take_turn()

        def gemms(s_acc, pv_acc):
            plgpu.wgmma(s_acc, q_tile, k_smem.at[s].T)
            plgpu.barrier_wait(v_ready.at[s_prev])
            plgpu.wgmma(pv_acc, pv_operand(p_prev), v_smem.at[s_prev])
            pass_turn()  # the other warpgroup's GEMMs queue behind ours
            return plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # S_j; P·V still runs

        def softmax_of(scores):
            kv_ids = _release_k(k_free, kv_ids_smem, s)
            p, m_new, alpha = softmax(scores, m_i, j, kv_ids, masked=masked)
            return p, m_new, l_i * alpha + p.sum(axis=1), alpha

        if st.pv_through_smem:  # interpret mode: P·V into a fresh accumulator, then added
            scores, pv = pl.run_scoped(
                lambda s_acc, pv_acc: (gemms(s_acc, pv_acc), pv_acc[...]),
                plgpu.ACC((bq, bkv), jnp.float32), plgpu.ACC(o.shape, jnp.float32))
            o = o + pv
            p, m_new, l_new, alpha = softmax_of(scores)
        else:
            def body(refs):
                o_acc, s_acc, results = refs
                for ref, x in zip(results, softmax_of(gemms(s_acc, o_acc)), strict=True):
                    ref[...] = x
            zeros = plgpu.layout_cast(jnp.zeros((bq, bkv), jnp.float32), plgpu.Layout.WGMMA)
            # Leaving run_state waits for the P·V GEMM (wgmma.wait_group 0).
            o, _, (p, m_new, l_new, alpha) = pl.run_state(body)((
                plgpu.ACC.init(o), plgpu.ACC.init(zeros), (zeros, m_i, l_i, m_i)))
            # P_j must not be cast to 16 bits before that wait: LLVM gives P_j the registers
            # of P_{j-1} (the loop carry), which the P·V GEMM is still reading, and ptxas
            # then serialises every wgmma of the kernel (warning C7513). The barrier pins
            # the cast after the wait.
            p = lax.optimization_barrier(p)
        plgpu.barrier_arrive(v_free.at[s_prev])  # V_{j-1} is read
        return o * _row(alpha, o.shape), m_new, l_new, p.astype(st.dtype)

    def tail(o, p_last):
        """O += P·V of the last visible block."""
        s = slot(last - 1)
        take_turn()
        plgpu.barrier_wait(v_ready.at[s])
        if st.pv_through_smem:
            o = _pv_through_smem(o, p_last, p_tile, v_smem.at[s], pass_turn)
        else:
            def gemm(o_acc):
                plgpu.wgmma(o_acc, p_last, v_smem.at[s])
                pass_turn()
            o = pl.run_state(gemm)(plgpu.ACC.init(o))
        plgpu.barrier_arrive(v_free.at[s])
        return o

    def skip_step(j, carry):
        """A block only the other consumer needs: the same barriers and turn, no math."""
        s = slot(j)
        plgpu.barrier_wait(k_ready.at[s])
        take_turn()
        pass_turn()
        plgpu.barrier_arrive(k_free.at[s])
        plgpu.barrier_wait(v_ready.at[s])
        plgpu.barrier_arrive(v_free.at[s])
        return carry

    # P of the previous block rides in the carry; a placeholder until the head's.
    p_none = plgpu.layout_cast(jnp.zeros((bq, bkv), st.dtype), plgpu.Layout.WGMMA)
    carry = (*carry, p_none)
    # Consumer 0 issues first: the last consumer hands it the first turn.
    pl.when(wg == st.num_consumers - 1)(pass_turn)
    masked_step = functools.partial(step, masked=True)
    unmasked_step = functools.partial(step, masked=False)
    carry = lax.fori_loop(cta_first, first, skip_step, carry)
    nonempty = first < last
    carry = lax.cond(nonempty, head, lambda carry: carry, carry)
    after_head = first + 1
    if st.has_lower_band:
        carry = lax.fori_loop(after_head, full_first, masked_step, carry)
    if st.has_unmasked_blocks:
        carry = lax.fori_loop(jnp.maximum(after_head, full_first), full_last, unmasked_step,
                              carry)
    if st.has_upper_mask:
        carry = lax.fori_loop(jnp.maximum(after_head, full_last), last, masked_step, carry)
    o, m_i, l_i, p_last = carry

    def no_tail(o, p_last):
        take_turn()  # one turn per consumer either way, so that the turns stay paired
        pass_turn()
        return o
    o = lax.cond(nonempty, tail, no_tail, o, p_last)
    carry = lax.fori_loop(last, cta_last, skip_step, (o, m_i, l_i))
    pl.when(wg == 0)(take_turn)  # the turn the last consumer handed over at its last step
    return carry


def _pv_through_smem(o, p16, p_tile, v_tile, wait_next_k):
    """Interpret-mode P·V: P via SMEM, P·V into a fresh accumulator, then O + P·V.

    Same arithmetic as the register path; it costs a second [block_q, D] f32 accumulator
    of registers and an SMEM round trip, so the GPU path does not use it.
    """
    p_tile[...] = p16
    plgpu.commit_smem()

    def gemm(pv_acc):
        plgpu.wgmma(pv_acc, p_tile, v_tile)
        wait_next_k()
        return pv_acc[...]
    return o + pl.run_scoped(gemm, plgpu.ACC(o.shape, jnp.float32))


def _pad(x: jax.Array, seq: int, head_dim: int) -> jax.Array:
    """Zero-pads [B, S, H, D] to [B, seq, H, head_dim] (no copy when nothing to pad)."""
    return pad_axis(pad_axis(x, 1, seq), 3, head_dim)


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                softcap: float | None = None, has_bias: bool = False,
                has_mask: bool = False) -> str | None:
    """Why the Mosaic GPU forward cannot run this call, or None if it can.

    Every mask, segment ids (hence padding lengths) and soft-capping are supported (and by
    the backward too, see :mod:`.backward`).
    """
    del kv_shape, mask, has_segments, softcap
    if has_bias or has_mask:
        return "bias and mask arrays are not supported by the Mosaic GPU kernel yet"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"the Mosaic GPU kernel takes bfloat16 or float16 inputs, got {jnp.dtype(dtype)}"
    if q_shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q_shape[-1]} is above the kernel's maximum {MAX_HEAD_DIM}"
    return None


def forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, *, mask: MaskSpec,
            scale: float, config: MosaicConfig, interpret: bool, softcap: float | None = None
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
      config: block sizes; ``config.check_fits`` must pass at the padded head dim.
      interpret: run in Mosaic GPU interpret mode on the CPU.
      softcap: ``c``: logits become ``c * tanh(scale * q·k / c)`` before the softmax.

    Returns:
      ``out`` like ``q`` and ``lse: [batch, heads, seq_q]`` float32 (natural log); rows
      that see no key give out 0 and lse ``EMPTY_ROW_LSE``.

    Any lengths work: the wrapper zero-pads the sequences to whole blocks (padded keys
    are hidden by ``mask.seq_kv``, padded query rows are cut off) and the head dim to a
    multiple of 64 (zero columns change neither Q·Kᵀ nor the kept columns of P·V).
    """
    segmented = segment_ids is not None
    reason = unsupported(q.shape, k.shape, q.dtype, mask, segmented, softcap)
    if reason is not None:
        raise ValueError(reason)
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    dim = padded_head_dim(head_dim)
    itemsize = jnp.dtype(q.dtype).itemsize
    config.check_fits(dim, itemsize, segments=segmented)
    rows_per_cta = config.rows_per_cta
    seq_q_pad = round_up(seq_q, rows_per_cta)
    seq_kv_pad = round_up(seq_kv, config.block_kv)
    st = _Static(
        mask=mask, scale_log2=scale * _LOG2E, block_q=config.block_q,
        block_kv=config.block_kv, num_stages=config.num_stages, head_dim=dim,
        dtype=jnp.dtype(q.dtype), group=heads // kv_heads,
        num_q_tiles=seq_q_pad // rows_per_cta, kv_padded=seq_kv_pad != seq_kv,
        overlap=config.overlap, pv_through_smem=interpret, softcap=softcap,
        segmented=segmented, num_consumers=config.num_consumers)
    consumers = st.num_consumers

    transforms = _smem_transforms(itemsize)
    scratch = dict(
        q_smem=plgpu.SMEM((consumers, st.block_q, dim), q.dtype, transforms=transforms),
        k_smem=plgpu.SMEM((st.num_stages, st.block_kv, dim), q.dtype, transforms=transforms),
        v_smem=plgpu.SMEM((st.num_stages, st.block_kv, dim), q.dtype, transforms=transforms),
        lse_smem=plgpu.SMEM((consumers, st.block_q), jnp.float32),
        q_ready=plgpu.Barrier(num_barriers=consumers),
        # One TMA arrival per copy: K, and with segment ids the keys' ids.
        k_ready=plgpu.Barrier(num_arrivals=1 + segmented, num_barriers=st.num_stages),
        v_ready=plgpu.Barrier(num_barriers=st.num_stages),
        k_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=st.num_stages),
        v_free=plgpu.Barrier(num_arrivals=consumers, num_barriers=st.num_stages),
        # Serial schedule: one barrier both consumers meet at; overlapped: one per consumer.
        turn=(plgpu.Barrier(num_barriers=consumers) if st.overlap
              else plgpu.Barrier(num_arrivals=consumers)),
    )
    operands = [_pad(q, seq_q_pad, dim), _pad(k, seq_kv_pad, dim), _pad(v, seq_kv_pad, dim)]
    if segmented:
        q_ids, kv_ids = pad_segment_ids(segment_ids, seq_q_pad, seq_kv_pad)
        operands += [q_ids, kv_ids,
                     tile_spans(q_ids, kv_ids, st.block_q, st.block_kv, walk_kv=True)]
        scratch["kv_ids_smem"] = plgpu.SMEM((st.num_stages, st.block_kv), jnp.int32)
    if st.pv_through_smem:
        scratch["p_smem"] = plgpu.SMEM(
            (consumers, st.block_q, st.block_kv), q.dtype, transforms=transforms)

    call = plgpu.kernel(
        functools.partial(_kernel, st=st),
        out_type=(
            jax.ShapeDtypeStruct((batch, seq_q_pad, heads, dim), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq_q_pad), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(heads, st.num_q_tiles, batch),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    out, lse = call(*operands)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]

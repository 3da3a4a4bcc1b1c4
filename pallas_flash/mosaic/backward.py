"""FlashAttention backward for Hopper (sm90): two warp-specialized Mosaic GPU kernels.

FlashAttention-2, Algorithm 2, on FlashAttention-3's machinery (Shah et al. 2024, Sec. 3.1):
P is never stored; it is recomputed tile by tile from Q, K and the forward's LSE, in base 2
with the softmax scale folded into the exponent (``P = exp2(S·scale·log2e − lse·log2e)``),
and ``delta = rowsum(dO ∘ O)`` (minus the lse cotangent) comes precomputed from
:mod:`pallas_flash.autodiff`. Each kernel runs one TMA **producer** warpgroup
(``setmaxnreg`` down to 40, or 24 above head_dim 64: :func:`_registers`) that streams
tiles through a ``num_stages``-deep SMEM ring with *ready* mbarriers (arrived by the TMA
engine) and *free* mbarriers (arrived by the consumers), and two **consumer** warpgroups
(``setmaxnreg`` up to 232, or 240) that run the GEMMs with wgmma and
keep their accumulators in registers.

* :func:`_dkdv_kernel` — one CTA per ``2·block_kv`` keys of one KV head; each consumer owns
  ``block_kv`` keys, keeps K_j and V_j in SMEM and dK_j, dV_j in registers. The producer
  streams (Q_i, dO_i, lse_i, delta_i) for every query block i that sees the CTA's keys, for
  every query head of the GQA group (the group's sum happens in the accumulators; K/V are
  never repeated). The consumer works on the transposed tiles, so that dK and dV stay
  row-major per key and every GEMM reads its B operand straight from SMEM::

      Sᵀ = K_j·Q_iᵀ          Pᵀ = exp2(Sᵀ·scale·log2e − lse_i)       dV_j += Pᵀ·dO_i
      dPᵀ = V_j·dO_iᵀ        dSᵀ = Pᵀ ∘ (dPᵀ − delta_i)               dK_j += dSᵀ·Q_i

  (Pᵀ and dSᵀ are the A operands, from registers; ``dK_j`` is scaled once at the end.)

**dQ, two modes** (``MosaicBackwardConfig.deterministic``):

* deterministic (the default at head_dim 256, for causal sequences up to 2048 tokens at
  head_dim 65-128, wherever ``XLA_FLAGS`` has ``--xla_gpu_deterministic_ops``, and beside
  bias / mask rings the fused dQ cannot fit) — :func:`_dq_kernel`, one CTA per
  ``2·dq_block_q`` query rows of one head; each consumer owns ``dq_block_q`` rows and the
  producer streams (K_j, V_j)::

      S = Q_i·K_jᵀ   P = exp2(S·scale·log2e − lse_i)   dP = dO_i·V_jᵀ
      dS = P ∘ (dP − delta_i)                           dQ_i += dS·K_j

  Every dQ tile is written by exactly one CTA, so the result is bitwise reproducible. The
  price is recomputing S and dP: seven GEMMs instead of five.
* fused (FA3) — the dK/dV consumers publish dSᵀ of the streamed query block in SMEM and
  add ``dS·K`` into a zeroed float32 dQ in GMEM with TMA reduce-adds (:func:`_reduce_dq`);
  the order of the additions varies between runs. Once both dSᵀ of the step are in SMEM
  (the ``exchanged`` barrier), dS·K over all the CTA's keys is added once per step — one
  reduce-add of the CTA's partial, which halves the float32 staging stores and the L2
  traffic of each consumer adding its own. At head_dim 128 the two consumers share that
  work as FA3 does (:func:`~pallas_flash.mosaic.config.splits_dq`): consumer c adds
  columns ``[c·D/2, (c+1)·D/2)``, with a [block_q, D/2] accumulator, one step late: at
  step t it adds step t-1's dQ, so that one proxy fence serves both the dQ staging tile
  and step t's dSᵀ, and the exchange it waits for is one the other consumer finished a
  step ago. At head_dim 64 the halves would cut a swizzle width, so the consumer that owns
  the step's ring slot adds all of it, with K and V in registers (:func:`_resident`); that
  is the faster mode there. Both are the default up to head_dim 128, but for short
  causal sequences at 128
  (:func:`~pallas_flash.mosaic.config.default_backward_config` has the timings and where
  their time goes). Interpret mode has no TMA reduce-add: there each consumer stores its
  partial sums per key tile, and XLA adds them.

**Block skipping** comes from :class:`~pallas_flash.masking.MaskSpec`: ``q_blocks`` (dK/dV)
and ``kv_blocks`` (dQ) give ``(first, full_first, full_last, last)``; blocks outside the
CTA's ``[first, last)`` are never loaded, a consumer's ``[full_first, full_last)`` runs the
unmasked loop, the boundary blocks build the mask tile, and blocks that only the other
consumer needs are stepped through without math (to keep the ring in lockstep).

**Segment ids** (packed documents; padding lengths arrive as ids too), as the forward:
each consumer's band is cut to the span of walked blocks whose ids can meet its owned
block (:func:`pallas_flash.segments.tile_spans`: query blocks per key block for dK/dV, key
blocks per query block for dQ), the producer streams the hull of the two consumers'
ranges, and every visited block is masked, comparing the owned ids (loaded once from GMEM)
with the walked block's (an int32 ring in SMEM, filled by TMA next to the data on lse's
(dK/dV) or K's (dQ) ready barrier and read before the slot is freed). A query that sees no
key has lse = ``EMPTY_ROW_LSE`` and only hidden (−inf) logits, so its P, dS and dQ are 0.

**Soft-capping**: the logits are ``c·tanh(scale·s/c)`` (``tanh.approx``, as the forward),
so dS is multiplied by the cap's derivative ``1 − tanh²`` before the dK and dQ GEMMs
(:func:`pallas_flash.logits.log2_logits`); hidden pairs are masked after the cap.

**Head dim 256**: dK and dV of 64 keys are 256 f32 registers per thread on their own,
above the 240 a consumer can hold, so the two consumers of a CTA split one key block
(:mod:`pallas_flash.mosaic.backward_d256`), and the dQ kernel streams 32-key blocks (Q and
dO of its two consumers fill 128 KiB), with 64-byte swizzled tiles (:class:`_Static`).

**Bias / mask arrays** are read with the forward's readers
(:class:`~pallas_flash.mosaic.forward.LogitArray`): the dQ kernel as the forward does (tiles
or key rows in rings next to K, query rows once), the dK/dV kernel on the arrays transposed
to ``[B', N', S, T]``, so that its tiles come laid out as Sᵀ (tiles or query rows in rings
next to lse, key rows once per head). The transpose is an XLA copy of the array as the
kernel reads it (broadcast dims stay 1): one more pass over a ``[.., T, S]`` bias. A mask
that broadcasts to the bias's shape is folded into it as −inf; any other mask makes every
block take the masked path. The rings are fitted
to shared memory by :func:`~pallas_flash.mosaic.config.fit_backward_logit_rings`. dbias is not
computed here: calls that need it take the Triton backward.

**Fallback**: float32, head dims 129-192 (:func:`unsupported` says why), dbias, and bias /
mask arrays at head_dim 256 go to the Triton backward.

**CPU testing**: Mosaic GPU interpret mode cannot run a wgmma whose A operand is in
registers. With ``interpret=True`` the A operands (Pᵀ, dSᵀ, dS) are stored to an SMEM
scratch tile first (:func:`_operand_a`); everything else is the same code on both paths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.logits import log2_logits, raw_score_gradient
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.block_walk import hull
from pallas_flash.mosaic.config import (
    MAX_HEAD_DIM,
    MAX_PER_CONSUMER_HEAD_DIM,
    NUM_CONSUMERS,
    MosaicBackwardConfig,
    default_backward_config,
    fit_backward_logit_rings,
    padded_head_dim,
    ring_view,
    splits_dq,
)
from pallas_flash.mosaic.logit_arrays import LogitArray, fold_mask, logit_array, logit_operand
from pallas_flash.mosaic.tiles import (
    CONSUMER_REGISTERS,
    DTYPES,
    LOG2E,
    PRODUCER,
    PRODUCER_REGISTERS,
    SWIZZLE,
    pad_operand,
    row,
    smem_transforms,
)
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.segments import cut_to_span, pad_segment_ids, tile_spans


def _registers(head_dim: int) -> tuple[int, int]:
    """``setmaxnreg`` of the (consumer, producer) warpgroups; 2 x consumer + producer <= 512.

    At head_dim 128 dK and dV alone hold 128 f32 registers per thread, and the dK/dV
    kernel spills: FA3's split, 240 + 24, ran 0-10 % faster than 232 + 40 on an H200; at
    head_dim 64 it was 1-7 % slower (2026-11-29, L 4096 / 16384, causal or not,
    ``benchmarks/mosaic_bwd_probe.py --impls 'mosaic;mosaic:regs=240x24;cudnn'``).
    """
    if head_dim > 64:
        return 240, 24
    return CONSUMER_REGISTERS, PRODUCER_REGISTERS


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel bodies need that is not a ref (all Python values)."""

    mask: MaskSpec
    scale: float
    block_q: int  # the streamed (dK/dV) or owned (dQ) query rows per step / consumer
    block_kv: int  # the owned (dK/dV) or streamed (dQ) keys per consumer / step
    num_stages: int
    head_dim: int
    dtype: jnp.dtype
    group: int  # query heads per K/V head (GQA)
    num_q_blocks: int  # of block_q rows, padding included
    num_tiles: int  # CTAs along the owned sequence
    needs_mask: bool  # some (q, k) pair of the padded problem is hidden
    fuse_dq: bool  # the dK/dV kernel also reduce-adds dS·K into a float32 dQ (FA3)
    # Interpret mode has no TMA reduce-add: the fused dQ's partial sums are stored per
    # consumer of each key tile instead ([2·tiles, B, Tq, N, D] float32), summed by XLA.
    dq_partials: bool = False
    softcap: float | None = None  # logits become softcap * tanh(scale * s / softcap)
    segmented: bool = False  # segment ids: a pair is visible only if its ids are equal
    # Swizzle (bytes) of every SMEM tile. wgmma steps through K one swizzle width at a
    # time and wants both SMEM operands equally swizzled, so a GEMM that contracts over
    # 32 rows (32-key blocks of the dQ kernel at head_dim 256) takes 64 bytes throughout.
    swizzle: int = SWIZZLE
    # Bias / mask arrays (the forward's reader), in this kernel's orientation: the dK/dV
    # kernel reads them transposed ([B', N', S, T]: its rows are keys, its ring walks
    # queries), the dQ kernel as they are.
    bias: LogitArray | None = None
    attn_mask: LogitArray | None = None

    @property
    def split_dq(self) -> bool:
        """The fused dQ split by columns between the consumers
        (:func:`~pallas_flash.mosaic.config.splits_dq`) and added one step late: half the
        dQ accumulator, and both consumers busy at every step; otherwise one consumer per
        step adds all of it, in the step."""
        return self.fuse_dq and splits_dq(self.head_dim, self.dtype.itemsize)

    @property
    def logit_arrays(self) -> tuple[LogitArray, ...]:
        return tuple(a for a in (self.bias, self.attn_mask) if a is not None)

    @property
    def reads_walked_slots(self) -> bool:
        # Consumers read ids / bias / mask from the walked ring's slots (generic proxy).
        return self.segmented or any(a.ring is not None for a in self.logit_arrays)

    def logit_copies(self) -> int:
        """TMA copies of bias / mask per walked block (arrivals on its ready barrier)."""
        return sum(a.copies_per_block(NUM_CONSUMERS) for a in self.logit_arrays)


def _col(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcasts a per-column vector (``WGMMA.reduce(0)`` layout) over a [m, cols] tile."""
    return lax.broadcast_in_dim(x, shape, [1])


def _operand_a(x: jax.Array, scratch):
    """The A operand of a wgmma: ``x`` from registers (FA3), or via SMEM when interpreting."""
    if scratch is None:
        return x
    scratch[...] = x
    plgpu.commit_smem()
    return scratch


#: Head dims up to which the fused dK/dV kernel keeps K and V in registers (:func:`_resident`).
_RESIDENT_MAX_HEAD_DIM = 64


def _resident(st: _Static, tile, interpreting: bool):
    """K or V of a fused dK/dV consumer, the A operand of its Sᵀ and dPᵀ GEMMs at every
    step: at head_dim 64 loaded into registers once (16 per thread), so that those wgmmas
    read only B from SMEM, which the fused dQ's float32 staging tile also needs. Measured
    on the H200 (2026-11-30, ``mosaic_bwd_probe.py --head-dims 64``): the fused backward
    went from 0.87-0.96x cuDNN to 0.97-1.06x; the deterministic one gained at some points
    and lost at others, and keeps the SMEM tiles. Interpret mode keeps them too."""
    if interpreting or not st.fuse_dq or st.head_dim > _RESIDENT_MAX_HEAD_DIM:
        return tile
    return plgpu.load(tile, (), layout=plgpu.Layout.WGMMA, optimized=True)


def _probabilities(st: _Static, scores, lse2, visible, bias=None):
    """P = exp2(logits·log2e − lse·log2e) of one tile, and the soft-cap's slope (or None).

    ``scores``: raw Q·Kᵀ (or K·Qᵀ) in f32; ``lse2``: the forward's lse in base 2, already
    broadcast over the tile; ``visible``: None (a full block) or the tile's mask; ``bias``:
    None or the tile's bias, added after the cap. Hidden pairs become −inf after the cap
    (before it, tanh would make them finite): P = 0 even for a row that sees no key (lse =
    ``EMPTY_ROW_LSE``, finite).
    """
    logits2, slope = log2_logits(scores, st.scale, st.softcap, bias)
    if visible is not None:
        logits2 = jnp.where(visible, logits2, -jnp.inf)
    return jnp.exp2(logits2 - lse2), slope


def _visible(st: _Static, shape, q_first, k_first, q_ids, kv_ids, *, keys_are_rows: bool,
             mask_tile=None):
    """The mask of a boundary tile: pairs the mask spec shows and, with segment ids, of one
    document. ``q_first``/``k_first``: the tile's first query row and key; ``q_ids``/``kv_ids``:
    their ids laid out along the tile's query / key axis (None without segment ids).
    ``keys_are_rows``: the dK/dV kernel's transposed tiles (Sᵀ, keys along the rows)."""
    def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
    q_axis, k_axis = (1, 0) if keys_are_rows else (0, 1)
    visible = st.mask.visible(iota(q_axis) + q_first, iota(k_axis) + k_first)
    if st.segmented:  # ... and pairs of the same document
        spread = {0: row, 1: _col}
        visible &= spread[q_axis](q_ids, shape) == spread[k_axis](kv_ids, shape)
    if mask_tile is not None:  # ... and pairs the mask array shows
        visible &= mask_tile != 0
    return visible


def _owned_ranges(st: _Static, band, spans_ref, batch, own_block):
    """The walked blocks of one owned block: the mask ``band`` (``MaskSpec.kv_blocks`` /
    ``q_blocks``), cut with segment ids to the span of blocks whose ids can meet it
    (``spans_ref`` [B, 2, owned blocks] from :func:`segments.tile_spans`)."""
    if not st.segmented:
        return band
    return cut_to_span(band, spans_ref[batch, 0, own_block], spans_ref[batch, 1, own_block])


def _cta_range(st: _Static, cta_band, ranges_of):
    """``(first, last)`` blocks the CTA's producer streams: its mask band, or with segment
    ids the hull of its consumers' ranges (``ranges_of(c)``: consumer c's)."""
    if not st.segmented:
        return cta_band[0], cta_band[3]
    return functools.reduce(hull, (ranges_of(c)[::3] for c in range(NUM_CONSUMERS)))


def _unpack_refs(st: _Static, refs):
    """The kernels' extra GMEM refs in order: (q_ids, kv_ids, spans) with segment ids, the
    bias and mask operands, then the rest (outputs)."""
    refs = iter(refs)
    ids = tuple(next(refs) for _ in range(3)) if st.segmented else (None,) * 3
    bias_ref = next(refs) if st.bias is not None else None
    mask_ref = next(refs) if st.attn_mask is not None else None
    return ids, (bias_ref, mask_ref), tuple(refs)


def _load_logit_slots(st: _Static, logit_refs, rings, s, ready, *, batch, head, owned,
                      walked) -> None:
    """Producer: the bias / mask tiles (or rows) of walked block ``walked`` into slot ``s``
    of their rings, on ``ready`` (``owned``: each consumer's ``pl.ds``)."""
    for array, ref, ring in zip((st.bias, st.attn_mask), logit_refs, rings, strict=True):
        if array is not None and array.ring is not None:
            array.load_block(ref, ring.at[s], ready, batch=batch, head=head, rows=owned,
                             keys=walked)


def _owned_logit_parts(st: _Static, logit_refs, *, batch, head, owned):
    """Consumer: (bias, mask) values of arrays constant along the walked axis, laid out as
    its ``owned`` rows (read from GMEM once per head), else None."""
    return tuple(array.read_rows(ref, batch=batch, head=head, rows=owned)
                 if array is not None and array.ring is None else None
                 for array, ref in zip((st.bias, st.attn_mask), logit_refs, strict=True))


def _logit_tiles(st: _Static, owned_parts, rings, s, wg, shape):
    """Consumer ``wg``: (bias tile, mask tile) of the step in slot ``s`` (each None when
    absent), read before the slot is freed."""
    tiles = []
    for array, owned, ring in zip((st.bias, st.attn_mask), owned_parts, rings, strict=True):
        walked = None if array is None or ring is None else array.read_slot(ring.at[s], wg)
        tiles.append(None if array is None else array.tile(owned, walked, shape))
    return tuple(tiles)


def _wait_all(barriers, s) -> None:
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[s])


def _walk(st: _Static, step, skip, cta_range, ranges, carry):
    """Runs ``step``/``skip`` over a consumer's blocks, in the order the producer loads them.

    ``cta_range``: the CTA's ``(first, last)`` blocks (the producer loads all of them);
    ``ranges``: this consumer's ``(first, full_first, full_last, last)`` inside it.
    """
    cta_first, cta_last = cta_range
    if not st.needs_mask:  # every block of every consumer is full
        return lax.fori_loop(cta_first, cta_last, functools.partial(step, masked=False), carry)
    first, full_first, full_last, last = ranges
    if st.attn_mask is not None:  # a mask array can hide pairs in any block
        full_first = full_last = first
    masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
    carry = lax.fori_loop(cta_first, first, skip, carry)
    carry = lax.fori_loop(first, full_first, masked, carry)
    carry = lax.fori_loop(full_first, full_last, unmasked, carry)  # the fast loop
    carry = lax.fori_loop(full_last, last, masked, carry)
    return lax.fori_loop(last, cta_last, skip, carry)


def _walked_head_and_block(st: _Static, t, first, blocks_per_head, kv_head):
    """Step t of a dK/dV producer, which streams ``blocks_per_head`` query blocks from
    ``first`` for each query head of the GQA group in turn: (query head, query block)."""
    g = lax.div(t, blocks_per_head)
    return kv_head * st.group + g, first + lax.rem(t, blocks_per_head)


def _stream(st: _Static, free, num_steps, load) -> None:
    """Producer loop: ``load(t)`` for steps ``0 .. num_steps-1`` into slot ``t % stages``.

    A slot is refilled once every consumer freed it; the last releases are observed too (a
    thread that waits on an mbarrier must see every phase of it).
    """
    for t in range(st.num_stages):
        pl.when(t < num_steps)(functools.partial(load, jnp.int32(t)))

    @pl.loop(st.num_stages, num_steps)
    def _refill(t):
        plgpu.barrier_wait(free.at[lax.rem(t, st.num_stages)])
        if st.reads_walked_slots:
            # The consumers read the slot's ids / bias / mask through the generic proxy;
            # the proxy fence orders those reads before the TMA (async proxy) overwrites.
            plgpu.commit_smem()
        load(t)

    @pl.loop(jnp.maximum(num_steps - st.num_stages, 0), num_steps)
    def _drain(t):
        plgpu.barrier_wait(free.at[lax.rem(t, st.num_stages)])


def _warp_specialized(st: _Static, free, num_steps, load, consume, *,
                      per_consumer_copies: bool) -> None:
    """FA3's warp specialization of a backward kernel: the producer warpgroup gives
    registers up and streams ``num_steps`` walked blocks with ``load`` (:func:`_stream`),
    the consumer warpgroups take the registers and run ``consume(wg)``.

    ``per_consumer_copies``: each consumer runs its own copy of ``consume``, with its
    index ``wg`` a constant, not read at run time. What follows from it (its keys, its
    loop bounds, tile addresses) is then uniform across the warp and stays in uniform
    registers; with a run-time index a masked walk's loop counters went to vector
    registers. In the dK/dV kernel at head_dim 128 (causal) that took the spills from 400
    to 32 bytes per thread (deterministic) and from 740 to 288 (fused dQ), and the
    backward from 0.96 / 0.98x cuDNN to 1.01 / 1.06x at L 16384 (H200, 2026-11-30). The
    dQ kernels, and the head-dim-256 dK/dV kernel, spilled more or ran no faster that way.
    """
    consumer_registers, producer_registers = _registers(st.head_dim)
    wg = lax.axis_index("wg")

    @pl.when(wg == PRODUCER)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        _stream(st, free, num_steps, load)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        if per_consumer_copies:
            for c in range(NUM_CONSUMERS):
                pl.when(wg == c)(functools.partial(consume, c))
        else:
            consume(wg)


# --- dK/dV ------------------------------------------------------------------------------


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static,
                 k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, k_ready, v_ready,
                 q_ready, do_ready, lse_ready, delta_ready, free, q_ids_smem=None,
                 a_smem=None, ds_smem=None, dq_smem=None, exchanged=None, dq_done=None,
                 bias_smem=None, mask_smem=None):
    """One CTA: keys ``[2·block_kv·tile, +2·block_kv)`` of one KV head.

    GMEM refs: q/do [B, Tq, N, D], k/v [B, Tk, K, D], lse (log2 units)/delta [B, N, Tq];
    ``refs`` = (q_ids [B, Tq], kv_ids [B, Tk], spans [B, 2, Tk / block_kv] int32 with
    ``st.segmented``;) (dq_acc [B, Tq, N, D] float32, zero-initialised — with
    ``st.dq_partials`` [2·tiles, B, Tq, N, D] — with ``st.fuse_dq``;) dk/dv [B, Tk, K, D].
    SMEM: k/v [2, block_kv, D] (one tile per consumer), q/do [stages, block_q, D],
    lse/delta [stages, block_q]; with segment ids q_ids_smem [stages, block_q] int32 (the
    rows' ids, on lse's ready barrier: one more TMA arrival); a_smem [2, block_kv, block_q]
    (interpret mode only); with ``st.fuse_dq``: ds_smem [stages, 2, block_kv, block_q]
    (each consumer's dSᵀ), dq_smem [2, block_q, D or D/2] float32 (each consumer's dQ
    staging tile), the ``exchanged`` barriers (both dSᵀ of a step are in SMEM) and
    ``dq_done`` (neither consumer reads the other's K tile again).
    """
    (q_ids_ref, kv_ids_ref, spans_ref), logit_refs, refs = _unpack_refs(st, refs)
    dq_ref, dk_ref, dv_ref = refs if st.fuse_dq else (None, *refs)
    rings = (bias_smem, mask_smem)
    bq, bkv = st.block_q, st.block_kv
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    kv_tile = lax.axis_index("kv_tiles")
    cta_k0 = kv_tile * (NUM_CONSUMERS * bkv)

    def ranges_of(c):
        """Consumer c's query blocks: (first, full_first, full_last, last)."""
        band = st.mask.q_blocks(cta_k0 + c * bkv, bkv, bq, st.num_q_blocks)
        return _owned_ranges(st, band, spans_ref, batch, kv_tile * NUM_CONSUMERS + c)

    # The query blocks any key of this CTA is seen by; streamed once per head of the group.
    cta_first, cta_last = _cta_range(
        st, st.mask.q_blocks(cta_k0, NUM_CONSUMERS * bkv, bq, st.num_q_blocks), ranges_of)
    blocks_per_head = cta_last - cta_first

    def slot(t):
        return lax.rem(t, st.num_stages)

    def load(t):
        head, i = _walked_head_and_block(st, t, cta_first, blocks_per_head, kv_head)
        rows, s = pl.ds(i * bq, bq), slot(t)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[s], q_ready.at[s])
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[s],
                                do_ready.at[s])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[s],
                                lse_ready.at[s])
        if st.segmented:  # the rows' ids, 4·block_q bytes, on lse's barrier
            plgpu.copy_gmem_to_smem(q_ids_ref.at[batch, rows], q_ids_smem.at[s],
                                    lse_ready.at[s])
        # Bias / mask (transposed: [keys, queries]) tiles or rows, on lse's barrier.
        owned = [pl.ds(cta_k0 + c * bkv, bkv) for c in range(NUM_CONSUMERS)]
        _load_logit_slots(st, logit_refs, rings, s, lse_ready.at[s], batch=batch,
                          head=head, owned=owned, walked=rows)
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem.at[s],
                                delta_ready.at[s])

    def consume(wg: int):
        k0 = cta_k0 + wg * bkv
        keys = (batch, pl.ds(k0, bkv), kv_head)
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_tile, k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_tile, v_ready.at[wg])
        # Inside the CTA's range: the consumer steps through all of it (the ring is shared).
        ranges = tuple(jnp.clip(x, cta_first, cta_last) for x in ranges_of(wg))
        kv_ids = None
        if st.segmented:  # this warpgroup's key ids, laid out as the rows of Sᵀ, once
            # (plain loads from GMEM: Mosaic GPU vectorises ("optimizes") SMEM loads only)
            kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(k0, bkv)],
                                layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        a_tile = None if a_smem is None else a_smem.at[wg]
        ready = (q_ready, do_ready, lse_ready, delta_ready)

        def dq_rows(i, head):
            """Where query block i's dQ goes: the reduce-adds' target, or this tile's
            partial sums (interpret mode)."""
            rows = pl.ds(i * bq, bq)
            if st.dq_partials:  # one partial sum per consumer of each key tile
                return dq_ref.at[kv_tile * NUM_CONSUMERS + wg, batch, rows, head]
            return dq_ref.at[batch, rows, head]

        def add_dq(s, i, head):
            """FA3's dQ for query block i, all columns, by the consumer that owns the ring
            slot (``s % 2``, so that each exchange barrier has one waiter, which sees all
            of its phases): dS·K over both consumers' keys, added once per step."""
            @pl.when(wg == lax.rem(s, NUM_CONSUMERS))
            def _add():
                plgpu.barrier_wait(exchanged.at[s])  # the other consumer's dSᵀ is in SMEM
                pairs = tuple((ds_smem.at[s, c], k_smem.at[c]) for c in range(NUM_CONSUMERS))
                _reduce_dq(st, pairs, dq_smem.at[wg], dq_rows(i, head))

        def publish_ds(s, ds_t):
            """This consumer's dSᵀ into the step's exchange slot (the dQ GEMMs read it)."""
            ds_smem.at[s, wg][...] = ds_t
            plgpu.commit_smem()
            plgpu.barrier_arrive(exchanged.at[s])

        # Split dQ (``st.split_dq``): consumer wg's column half.
        half = pl.ds(wg * (st.head_dim // NUM_CONSUMERS), st.head_dim // NUM_CONSUMERS)

        def half_pairs(s):
            """(dSᵀ, K columns) of both consumers for this consumer's half of a dQ tile."""
            return tuple((ds_smem.at[s, c], k_smem.at[c, :, half])
                         for c in range(NUM_CONSUMERS))

        def previous_step(t):
            """(ring slot, query head, query block) of step t-1 (for t = 0: the slot of
            step -1 and step 0's rows)."""
            s_prev = lax.rem(t - 1 + st.num_stages, st.num_stages)
            head, i = _walked_head_and_block(st, jnp.maximum(t - 1, 0), cta_first,
                                             blocks_per_head, kv_head)
            return s_prev, head, i

        def add_previous_dq(t, s, ds_t, issue_dk=None):
            """Split dQ, one step late: at step t this consumer adds its half of step
            t-1's dQ, stages it and publishes step t's dSᵀ behind one proxy fence (two
            per step otherwise), and the exchange it waits for is that of step t-1, which
            the other consumer has long finished. ``issue_dk``: issues dK += dSᵀ·Q_i
            first, so that it runs back to back with the dQ GEMM."""
            s_prev, head_prev, i_prev = previous_step(t)
            if issue_dk is not None:
                issue_dk()
            plgpu.barrier_wait(exchanged.at[s_prev])  # both dSᵀ of step t-1 are in SMEM
            dq = _dq_gemm(half_pairs(s_prev), dq_smem.at[wg].shape)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read the tile
            dq_smem.at[wg][...] = dq
            ds_smem.at[s, wg][...] = ds_t
            plgpu.commit_smem()
            plgpu.barrier_arrive(exchanged.at[s])

            @pl.when(t > 0)  # step -1's dQ is zero (see first_exchange)
            def _add():
                _add_staged_dq(st, dq_smem.at[wg], dq_rows(i_prev, head_prev).at[:, half])

        def first_exchange():
            """Split dQ: a zero dSᵀ in the slot of step -1, so that step 0 has a
            previous step to wait for."""
            s_init = st.num_stages - 1
            ds_smem.at[s_init, wg][...] = _zero_tile(st)
            plgpu.commit_smem()
            plgpu.barrier_arrive(exchanged.at[s_init])

        def last_dq():
            """Split dQ: this consumer's half of the last step's dQ."""
            num_steps = st.group * blocks_per_head
            s_last, head_last, i_last = previous_step(num_steps)
            plgpu.barrier_wait(exchanged.at[s_last])

            @pl.when(num_steps > 0)
            def _add():
                _reduce_dq(st, half_pairs(s_last), dq_smem.at[wg],
                           dq_rows(i_last, head_last).at[:, half])
        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])
        k_a, v_a = (_resident(st, t, a_tile is not None) for t in (k_tile, v_tile))

        def accumulate(dk_acc, dv_acc):
            def step(i, head_step0, *, head, owned_parts, masked: bool):
                """Query block i of one head: dV_j += Pᵀ·dO_i, dK_j += dSᵀ·Q_i."""
                s = slot(head_step0 + i)
                _wait_all(ready, s)
                q_tile, do_tile = q_smem.at[s], do_smem.at[s]
                lse2 = plgpu.load(lse_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0))

                def load_delta():
                    return plgpu.load(delta_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
                # The fused kernel's dQ accumulator adds to the register pressure: there
                # delta is loaded where dSᵀ needs it (see default_backward_config).
                delta = None if st.fuse_dq else load_delta()
                q_ids = None
                if st.segmented:  # read before the slot is freed (the producer refills it)
                    q_ids = plgpu.load(q_ids_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
                shape = (bkv, bq)  # rows are keys, columns queries
                bias_t, mask_t = _logit_tiles(st, owned_parts, rings, s, wg, shape)

                def gemms(st_acc, dpt_acc):
                    plgpu.wgmma(st_acc, k_a, q_tile.T)
                    plgpu.wgmma(dpt_acc, v_a, do_tile.T)
                    # Sᵀ is ready once at most the dPᵀ GEMM is in flight: Pᵀ overlaps it.
                    scores_t = plgpu.wgmma_accumulator_load(st_acc, wait_n=1)
                    visible = None
                    if masked:
                        visible = _visible(st, shape, i * bq, k0, q_ids, kv_ids,
                                           keys_are_rows=True, mask_tile=mask_t)
                    p_t, slope_t = _probabilities(st, scores_t, _col(lse2, shape), visible,
                                                  bias_t)
                    plgpu.wgmma(dv_acc, _operand_a(p_t.astype(st.dtype), a_tile), do_tile)
                    # dPᵀ is ready once at most the dV GEMM is in flight: dSᵀ overlaps it.
                    dp_t = plgpu.wgmma_accumulator_load(dpt_acc, wait_n=1)
                    delta_t = _col(load_delta() if delta is None else delta, shape)
                    ds_t = raw_score_gradient(p_t * (dp_t - delta_t), slope_t)
                    ds_t = ds_t.astype(st.dtype)

                    def issue_dk():
                        plgpu.wgmma(dk_acc, _operand_a(ds_t, a_tile), q_tile)
                    if st.split_dq:  # dS = (dSᵀ)ᵀ is read from SMEM, transposed
                        # The dQ GEMM's wait retires the step's GEMMs: Q_i, dO_i are read.
                        add_previous_dq(head_step0 + i, s, ds_t, issue_dk)
                        return
                    if st.fuse_dq:
                        publish_ds(s, ds_t)
                    issue_dk()
                    plgpu.wgmma_wait(0)  # Q_i and dO_i are read: the slot may be refilled
                    if st.fuse_dq:  # once dK's GEMM has retired: its A operand is free
                        add_dq(s, i, head)

                pl.run_scoped(gemms, plgpu.ACC((bkv, bq), jnp.float32),
                              plgpu.ACC((bkv, bq), jnp.float32))
                plgpu.barrier_arrive(free.at[s])
                return head_step0

            def skip(i, head_step0, *, head):
                """A block only the other consumer needs: same barriers, no math (with the
                fused dQ: a zero dSᵀ, and this consumer's share of the step's dS·K)."""
                s = slot(head_step0 + i)
                _wait_all(ready, s)
                if st.split_dq:
                    add_previous_dq(head_step0 + i, s, _zero_tile(st))
                elif st.fuse_dq:
                    publish_ds(s, _zero_tile(st))
                    add_dq(s, i, head)
                plgpu.barrier_arrive(free.at[s])
                return head_step0

            def head(g, carry):  # the GQA group's query heads, summed in dK/dV
                head_step0 = g * blocks_per_head - cta_first  # step of block i: head_step0 + i
                q_head = kv_head * st.group + g
                owned_parts = _owned_logit_parts(st, logit_refs, batch=batch, head=q_head,
                                                 owned=pl.ds(k0, bkv))
                _walk(st, functools.partial(step, head=q_head, owned_parts=owned_parts),
                      functools.partial(skip, head=q_head), (cta_first, cta_last), ranges,
                      head_step0)
                return carry

            if st.split_dq:
                first_exchange()
            lax.fori_loop(0, st.group, head, 0)
            if st.split_dq:
                last_dq()
            return dk_acc[...], dv_acc[...]

        dk, dv = pl.run_scoped(accumulate, plgpu.ACC((bkv, st.head_dim), jnp.float32),
                               plgpu.ACC((bkv, st.head_dim), jnp.float32))
        if st.fuse_dq:  # the other consumer's last dQ GEMM has read this one's K tile
            plgpu.barrier_arrive(dq_done)
            plgpu.barrier_wait(dq_done)
        # Epilogue: dK_j = scale · Σ dSᵀ·Q (S was scaled); out through the K/V tiles + TMA.
        k_tile[...] = (dk * st.scale).astype(st.dtype)
        v_tile[...] = dv.astype(st.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[keys])
        plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    _warp_specialized(st, free, st.group * blocks_per_head, load, consume,
                      per_consumer_copies=True)



def _zero_tile(st: _Static) -> jax.Array:
    """A zero dSᵀ tile [block_kv, block_q] in the layout of the computed ones."""
    zeros = jnp.zeros((st.block_kv, st.block_q), st.dtype)
    return plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)


def _dq_gemm(pairs, shape: tuple[int, int]) -> jax.Array:
    """``Σ dS·K`` over ``pairs`` of (dSᵀ [block_kv, block_q], K [block_kv, columns]) SMEM
    tiles: a [block_q, columns] float32 dQ tile."""
    def gemm(acc):
        for ds_tile, k_tile in pairs:  # A: dS, the transposed view of dSᵀ
            plgpu.wgmma(acc, ds_tile.T, k_tile)
        return plgpu.wgmma_accumulator_load(acc, wait_n=0)
    return pl.run_scoped(gemm, plgpu.ACC(shape, jnp.float32))


def _add_staged_dq(st: _Static, dq_tile, dq_rows) -> None:
    """``dq_rows += dq_tile`` (the float32 staging tile, committed to the async proxy) with
    a TMA reduce-add in L2; with ``st.dq_partials`` (interpret mode) a plain store into
    this key tile's partial sums."""
    plgpu.copy_smem_to_gmem(dq_tile, dq_rows,
                            reduction_op=None if st.dq_partials else "add")


def _reduce_dq(st: _Static, pairs, dq_tile, dq_rows) -> None:
    """FA3's dQ: ``dq_rows += Σ dS·K`` over ``pairs`` (:func:`_dq_gemm`), staged in
    ``dq_tile`` ([block_q, columns] float32, still read by the previous step's add)."""
    dq = _dq_gemm(pairs, dq_tile.shape)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's add read the tile
    dq_tile[...] = dq
    plgpu.commit_smem()
    _add_staged_dq(st, dq_tile, dq_rows)


# --- dQ ---------------------------------------------------------------------------------


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_ready, do_ready,
               lse_ready, delta_ready, k_ready, v_ready, free, kv_ids_smem=None,
               a_smem=None, bias_smem=None, mask_smem=None):
    """One CTA: query rows ``[2·block_q·tile, +2·block_q)`` of one head.

    GMEM refs as in :func:`_dkdv_kernel`; ``refs`` = (q_ids [B, Tq], kv_ids [B, Tk], spans
    [B, 2, Tq / block_q] int32 with ``st.segmented``;) dq [B, Tq, N, D]. SMEM: q/do
    [2, block_q, D] and lse/delta [2, block_q] (one per consumer), k/v
    [stages, block_kv, D]; with segment ids kv_ids_smem [stages, block_kv] int32 (the keys'
    ids, on K's ready barrier: one more TMA arrival); a_smem [2, block_q, block_kv]
    (interpret mode only).
    """
    (q_ids_ref, kv_ids_ref, spans_ref), logit_refs, (dq_ref,) = _unpack_refs(st, refs)
    rings = (bias_smem, mask_smem)
    bq, bkv = st.block_q, st.block_kv
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    q_tile_idx = lax.axis_index("q_tiles")
    if st.mask.is_causal:
        # Causal work grows with the query index: heaviest CTAs first (as the forward).
        q_tile_idx = st.num_tiles - 1 - q_tile_idx
    cta_q0 = q_tile_idx * (NUM_CONSUMERS * bq)

    def ranges_of(c):
        """Consumer c's key blocks: (first, full_first, full_last, last)."""
        band = st.mask.kv_blocks(cta_q0 + c * bq, bq, bkv)
        return _owned_ranges(st, band, spans_ref, batch, q_tile_idx * NUM_CONSUMERS + c)

    cta_first, cta_last = _cta_range(
        st, st.mask.kv_blocks(cta_q0, NUM_CONSUMERS * bq, bkv), ranges_of)

    def slot(j):
        return lax.rem(j - cta_first, st.num_stages)

    kv_head = lax.div(head, st.group)  # GQA: K/V are indexed, never repeated

    def load(t):
        j = cta_first + t
        keys, s = (batch, pl.ds(j * bkv, bkv), kv_head), slot(j)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[s], k_ready.at[s])
        if st.segmented:  # the keys' ids, 4·block_kv bytes, on K's barrier
            plgpu.copy_gmem_to_smem(kv_ids_ref.at[batch, pl.ds(j * bkv, bkv)],
                                    kv_ids_smem.at[s], k_ready.at[s])
        owned = [pl.ds(cta_q0 + c * bq, bq) for c in range(NUM_CONSUMERS)]
        _load_logit_slots(st, logit_refs, rings, s, k_ready.at[s], batch=batch, head=head,
                          owned=owned, walked=pl.ds(j * bkv, bkv))
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[s], v_ready.at[s])

    def consume(wg):
        q0 = cta_q0 + wg * bq
        rows = (batch, pl.ds(q0, bq), head)
        stats = (batch, head, pl.ds(q0, bq))
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tile, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_tile, do_ready.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[wg], lse_ready.at[wg])
        plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[wg], delta_ready.at[wg])
        # Inside the CTA's range: the consumer steps through all of it (the ring is shared).
        ranges = tuple(jnp.clip(x, cta_first, cta_last) for x in ranges_of(wg))
        q_ids = None
        if st.segmented:  # this warpgroup's query ids, laid out as the rows of S, once
            q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q0, bq)],
                               layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        a_tile = None if a_smem is None else a_smem.at[wg]
        _wait_all((q_ready, do_ready, lse_ready, delta_ready), wg)
        lse2 = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        shape = (bq, bkv)
        owned_parts = _owned_logit_parts(st, logit_refs, batch=batch, head=head,
                                         owned=pl.ds(q0, bq))

        def accumulate(dq_acc):
            def step(j, carry, *, masked: bool):
                """Key block j: dQ_i += dS·K_j."""
                s = slot(j)
                _wait_all((k_ready, v_ready), s)
                k_tile, v_tile = k_smem.at[s], v_smem.at[s]
                kv_ids = None
                if st.segmented:  # read before the slot is freed (the producer refills it)
                    kv_ids = plgpu.load(kv_ids_smem.at[s],
                                        layout=plgpu.Layout.WGMMA.reduce(0))
                bias, mask = _logit_tiles(st, owned_parts, rings, s, wg, shape)

                def gemms(s_acc, dp_acc):
                    plgpu.wgmma(s_acc, q_tile, k_tile.T)
                    plgpu.wgmma(dp_acc, do_tile, v_tile.T)
                    # S is ready once at most the dP GEMM is in flight: P overlaps it.
                    scores = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
                    visible = None
                    if masked:
                        visible = _visible(st, shape, q0, j * bkv, q_ids, kv_ids,
                                           keys_are_rows=False, mask_tile=mask)
                    p, slope = _probabilities(st, scores, row(lse2, shape), visible, bias)
                    dp = plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
                    ds = raw_score_gradient(p * (dp - row(delta, shape)), slope)
                    plgpu.wgmma(dq_acc, _operand_a(ds.astype(st.dtype), a_tile), k_tile)
                    plgpu.wgmma_wait(0)  # K_j is read: the slot may be refilled

                pl.run_scoped(gemms, plgpu.ACC((bq, bkv), jnp.float32),
                              plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_arrive(free.at[s])
                return carry

            def skip(j, carry):
                """A block only the other consumer needs: same barriers, no math."""
                s = slot(j)
                _wait_all((k_ready, v_ready), s)
                plgpu.barrier_arrive(free.at[s])
                return carry

            _walk(st, step, skip, (cta_first, cta_last), ranges, 0)
            return dq_acc[...]

        dq = pl.run_scoped(accumulate, plgpu.ACC((bq, st.head_dim), jnp.float32))
        q_tile[...] = (dq * st.scale).astype(st.dtype)  # Q is dead: dQ leaves through its tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    _warp_specialized(st, free, cta_last - cta_first, load, consume,
                      per_consumer_copies=False)



# --- entry points -----------------------------------------------------------------------


def unsupported(q_shape, dtype, has_segments: bool, softcap: float | None = None
                ) -> str | None:
    """Why the Mosaic GPU backward cannot run this call (it then uses Triton's), or None.

    Segment ids (hence padding lengths) and soft-capping are supported.
    """
    del has_segments, softcap
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU backward takes bfloat16 or float16, got {jnp.dtype(dtype)}"
    dim = padded_head_dim(q_shape[-1])
    if MAX_PER_CONSUMER_HEAD_DIM < dim < MAX_HEAD_DIM:
        return (f"head_dim {q_shape[-1]}: dK and dV of 64 keys do not fit a consumer "
                f"warpgroup's registers above head_dim {MAX_PER_CONSUMER_HEAD_DIM}, and "
                "only head_dim 256 splits into two 128-column halves")
    return None


def _triton_backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask, scale, interpret,
                     softcap, bias, attn_mask, bias_grad):
    """Triton's backward on the Mosaic forward's (out, lse), dbias included."""
    from pallas_flash import triton as triton_backend  # lazy: only for the fallback cases

    kwargs = {} if softcap is None else dict(softcap=softcap)
    config = triton_backend.default_config(q.shape, k.shape, q.dtype, mask)
    return triton_backend.KERNELS.backward(
        q, k, v, segment_ids, out, lse, d_out, delta, mask=mask, scale=scale, config=config,
        interpret=interpret, bias=bias, attn_mask=attn_mask, bias_grad=bias_grad, **kwargs)


def backward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, out: jax.Array,
             lse: jax.Array, d_out: jax.Array, delta: jax.Array, *, mask: MaskSpec,
             scale: float, config, interpret: bool, softcap: float | None = None,
             bias: jax.Array | None = None, attn_mask: jax.Array | None = None,
             bias_grad: bool = False) -> tuple[jax.Array, ...]:
    """(dq, dk, dv) of attention on Hopper, and dbias when ``bias_grad``.

    Args:
      q, d_out: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim].
      out: unused (delta already holds rowsum(dO ∘ O)).
      lse, delta: [batch, heads, seq_q] float32; lse in natural log, delta minus the lse
        cotangent (:mod:`pallas_flash.autodiff`).
      config: the forward's ``MosaicConfig`` (its tiling does not apply here: the backward
        tiling comes from :func:`default_backward_config`), or a ``MosaicBackwardConfig``
        to choose the backward tiling explicitly.
      interpret: run in Mosaic GPU interpret mode on the CPU.
      bias, attn_mask: None or canonical ``[B', N', T', S']`` (:mod:`pallas_flash.bias`),
        read by both kernels (see the module docstring); with ``bias_grad`` the Triton
        backward runs instead and returns dbias (float32, shaped like ``bias``) after dq,
        dk, dv.

    Calls that :func:`unsupported` refuses go to the Triton backward. Any lengths work:
    sequences are zero-padded to whole CTAs (padded rows get lse = +inf, so P = 0; padded
    keys are hidden by ``mask.seq_kv``) and the head dim to a multiple of 64.
    """
    del out
    segmented = segment_ids is not None
    dim = padded_head_dim(q.shape[-1])
    has_logits = bias is not None or attn_mask is not None
    # dbias, and bias / mask arrays at head_dim 256, are Triton's.
    triton_only = bias_grad or (has_logits and dim > MAX_PER_CONSUMER_HEAD_DIM)
    if triton_only or unsupported(q.shape, q.dtype, segmented, softcap) is not None:
        return _triton_backward(q, k, v, segment_ids, None, lse, d_out, delta, mask=mask,
                                scale=scale, interpret=interpret, softcap=softcap, bias=bias,
                                attn_mask=attn_mask, bias_grad=bias_grad)
    if not isinstance(config, MosaicBackwardConfig):
        config = default_backward_config(q.shape, k.shape, q.dtype, mask)
    _, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    itemsize = jnp.dtype(q.dtype).itemsize
    # Bias / mask arrays: the dQ kernel reads them as the forward does, the dK/dV kernel
    # transposed ([B', N', S, T]), so that its tiles are laid out as Sᵀ.
    bias, attn_mask = fold_mask(bias, attn_mask)
    logits = [(x, is_mask) for x, is_mask in ((bias, False), (attn_mask, True))
              if x is not None]
    dq_logits = [(x, logit_array(x, is_mask=m)) for x, m in logits]
    dkdv_logits = [(x, logit_array(x, is_mask=m))
                   for x, m in ((jnp.swapaxes(x, 2, 3), m) for x, m in logits)]
    rings = {name: tuple(a.ring for _, a in arrays if a.ring is not None)
             for name, arrays in (("dkdv_rings", dkdv_logits), ("dq_rings", dq_logits))}
    config = fit_backward_logit_rings(config, dim, itemsize, segments=segmented, **rings)
    config.check_fits(dim, itemsize, segments=segmented, **rings)
    # One padded length serves both kernels: whole dK/dV query blocks and dQ CTAs, whole
    # dK/dV CTAs and dQ key blocks (all block sizes are powers of two times 64).
    seq_q_pad = round_up(seq_q, max(config.block_q, NUM_CONSUMERS * config.dq_block_q))
    seq_kv_pad = round_up(seq_kv, max(NUM_CONSUMERS * config.block_kv, config.dq_block_kv))
    q_p, do_p = (pad_operand(x, seq_q_pad, dim) for x in (q, d_out))
    k_p, v_p = (pad_operand(x, seq_kv_pad, dim) for x in (k, v))
    # lse in base 2 (the kernels' exponent); padded rows get +inf so that their P is 0.
    # Rows that see no key have lse = EMPTY_ROW_LSE and only hidden (-inf) logits: P = 0.
    lse2 = pad_axis(lse * LOG2E, 2, seq_q_pad, jnp.inf)
    delta = pad_axis(delta, 2, seq_q_pad)
    fuse_dq = not config.deterministic
    common = dict(
        mask=mask, scale=scale, num_stages=config.num_stages,
        head_dim=dim, dtype=jnp.dtype(q.dtype), group=heads // kv_heads,
        needs_mask=(not mask.is_dense or seq_kv_pad != seq_kv or segmented
                    or attn_mask is not None),
        fuse_dq=fuse_dq, dq_partials=fuse_dq and interpret, softcap=softcap,
        segmented=segmented)
    operands = (q_p, k_p, v_p, do_p, lse2, delta)
    ids = pad_segment_ids(segment_ids, seq_q_pad, seq_kv_pad) if segmented else None

    def with_ids(st: _Static, *, walk_kv: bool):
        """The operands, with segment ids the ids and the spans of the kernel's tiles, and
        the bias / mask operands in the kernel's orientation."""
        extra = () if ids is None else (
            *ids, tile_spans(*ids, st.block_q, st.block_kv, walk_kv=walk_kv))
        if walk_kv:  # the dQ kernel
            arrays = [logit_operand(x, a, seq_q_pad, seq_kv_pad) for x, a in dq_logits]
        else:
            arrays = [logit_operand(x, a, seq_kv_pad, seq_q_pad) for x, a in dkdv_logits]
        return (*operands, *extra, *arrays)

    def logit_arrays(arrays):
        """_Static's bias / attn_mask fields for one kernel's readers."""
        by_kind = {a.is_mask: a for _, a in arrays}
        return dict(bias=by_kind.get(False), attn_mask=by_kind.get(True))

    # Up to head_dim 128 a dK/dV CTA holds one key block per consumer; at 256 its two
    # consumers split one block (backward_d256).
    split = dim > MAX_PER_CONSUMER_HEAD_DIM
    dkdv_static = _Static(
        block_q=config.block_q, block_kv=config.block_kv,
        num_q_blocks=seq_q_pad // config.block_q,
        num_tiles=seq_kv_pad // ((1 if split else NUM_CONSUMERS) * config.block_kv),
        # Split: dV/dK contract over the 32 rows of a consumer's half of the query block.
        swizzle=min(SWIZZLE, config.block_q // NUM_CONSUMERS * itemsize) if split
        else SWIZZLE, **logit_arrays(dkdv_logits), **common)
    dkdv_operands = with_ids(dkdv_static, walk_kv=False)  # owns key tiles, walks queries
    if fuse_dq:
        # The reduce-adds' target (interpret mode: a partial sum per consumer and key tile).
        partials = ((NUM_CONSUMERS * dkdv_static.num_tiles,) if dkdv_static.dq_partials
                    else ())
        dq_acc = jax.new_ref(jnp.zeros((*partials, *q_p.shape), jnp.float32))
        dk, dv = _call_dkdv(dkdv_static, dkdv_operands, dq_acc, interpret=interpret)
        dq = jax.freeze(dq_acc)
        dq = ((dq.sum(0) if partials else dq) * scale).astype(q.dtype)
    else:
        if split:
            from pallas_flash.mosaic import backward_d256  # it imports this module

            dk, dv = backward_d256.call_dkdv(dkdv_static, dkdv_operands,
                                             interpret=interpret)
        else:
            dk, dv = _call_dkdv(dkdv_static, dkdv_operands, None, interpret=interpret)
        dq_static = _Static(block_q=config.dq_block_q, block_kv=config.dq_block_kv,
                            num_q_blocks=seq_q_pad // config.dq_block_q,
                            num_tiles=seq_q_pad // (NUM_CONSUMERS * config.dq_block_q),
                            swizzle=min(SWIZZLE, config.dq_block_kv * itemsize),
                            **logit_arrays(dq_logits), **common)
        dq = _call_dq(dq_static, with_ids(dq_static, walk_kv=True), interpret=interpret)
    return (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
            dv[:, :seq_kv, :, :head_dim])


def _kernel_params(interpret: bool) -> dict:
    return dict(num_threads=NUM_CONSUMERS + 1, thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=plgpu.InterpretGPUParams() if interpret else None)


def _tiles(st: _Static, *shape, dtype=None):
    """A swizzled SMEM buffer (the layout TMA writes and wgmma reads)."""
    dtype = jnp.dtype(dtype or st.dtype)
    swizzle = min(st.swizzle, shape[-1] * dtype.itemsize)  # float32 staging: 128 bytes
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype.itemsize, swizzle))


def _logit_scratch(st: _Static, *, owned: int, walked: int) -> dict:
    """The bias / mask rings of one kernel whose consumers own ``owned`` rows and whose
    ring walks blocks of ``walked`` (its tiling in the forward's terms)."""
    rings = [a for a in st.logit_arrays if a.ring is not None]
    if not rings:
        return {}
    view = ring_view(owned=owned, walked=walked, num_stages=st.num_stages)
    return {"mask_smem" if a.is_mask else "bias_smem": a.smem(view) for a in rings}


def _call_dkdv(st: _Static, operands, dq_acc, *, interpret: bool):
    """dK, dV [B, Tk_pad, K, D_pad]: one CTA per 2·block_kv keys of one KV head.

    ``dq_acc``: None, or a zeroed float32 ref [B, Tq_pad, N, D_pad] that receives dS·K.
    """
    q_p, k_p = operands[:2]
    batch, kv_heads = k_p.shape[0], k_p.shape[2]
    bq, bkv, d, stages = st.block_q, st.block_kv, st.head_dim, st.num_stages
    scratch = dict(
        k_smem=_tiles(st, NUM_CONSUMERS, bkv, d), v_smem=_tiles(st, NUM_CONSUMERS, bkv, d),
        q_smem=_tiles(st, stages, bq, d), do_smem=_tiles(st, stages, bq, d),
        lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
        delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
        k_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        v_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        q_ready=plgpu.Barrier(num_barriers=stages), do_ready=plgpu.Barrier(num_barriers=stages),
        # One TMA arrival per copy: lse, with segment ids the rows' ids, bias / mask.
        lse_ready=plgpu.Barrier(num_arrivals=1 + st.segmented + st.logit_copies(),
                                num_barriers=stages),
        delta_ready=plgpu.Barrier(num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    )
    if st.segmented:
        scratch["q_ids_smem"] = plgpu.SMEM((stages, bq), jnp.int32)
    # Consumers own block_kv keys, the ring walks block_q queries (transposed arrays).
    scratch.update(_logit_scratch(st, owned=bkv, walked=bq))
    if interpret:
        scratch["a_smem"] = _tiles(st, NUM_CONSUMERS, bkv, bq)
    extra = ()
    if dq_acc is not None:
        scratch["ds_smem"] = _tiles(st, stages, NUM_CONSUMERS, bkv, bq)
        dq_columns = d // NUM_CONSUMERS if st.split_dq else d
        scratch["dq_smem"] = _tiles(st, NUM_CONSUMERS, bq, dq_columns, dtype=jnp.float32)
        # Both dSᵀ of a step are in SMEM; neither consumer reads the other's K tile again.
        scratch["exchanged"] = plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages)
        scratch["dq_done"] = plgpu.Barrier(num_arrivals=NUM_CONSUMERS)
        extra = (dq_acc,)
    return plgpu.kernel(
        functools.partial(_dkdv_kernel, st=st),
        out_type=(jax.ShapeDtypeStruct(k_p.shape, q_p.dtype),) * 2,
        scratch_types=scratch,
        grid=(kv_heads, st.num_tiles, batch),
        grid_names=("heads", "kv_tiles", "batch"),
        **_kernel_params(interpret),
    )(*operands, *extra)


def _call_dq(st: _Static, operands, *, interpret: bool):
    """dQ [B, Tq_pad, N, D_pad]: one CTA per 2·dq_block_q query rows of one head."""
    q_p = operands[0]
    batch, heads = q_p.shape[0], q_p.shape[2]
    bq, bkv, d, stages = st.block_q, st.block_kv, st.head_dim, st.num_stages
    scratch = dict(
        q_smem=_tiles(st, NUM_CONSUMERS, bq, d), do_smem=_tiles(st, NUM_CONSUMERS, bq, d),
        lse_smem=plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
        delta_smem=plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
        k_smem=_tiles(st, stages, bkv, d), v_smem=_tiles(st, stages, bkv, d),
        q_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        do_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        lse_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        delta_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        # One TMA arrival per copy: K, with segment ids the keys' ids, bias / mask.
        k_ready=plgpu.Barrier(num_arrivals=1 + st.segmented + st.logit_copies(),
                              num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    )
    if st.segmented:
        scratch["kv_ids_smem"] = plgpu.SMEM((stages, bkv), jnp.int32)
    scratch.update(_logit_scratch(st, owned=bq, walked=bkv))
    if interpret:
        scratch["a_smem"] = _tiles(st, NUM_CONSUMERS, bq, bkv)
    return plgpu.kernel(
        functools.partial(_dq_kernel, st=st),
        out_type=jax.ShapeDtypeStruct(q_p.shape, q_p.dtype),
        scratch_types=scratch,
        grid=(heads, st.num_tiles, batch),
        grid_names=("heads", "q_tiles", "batch"),
        **_kernel_params(interpret),
    )(*operands)

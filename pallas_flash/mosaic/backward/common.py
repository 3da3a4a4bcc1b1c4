"""What the Hopper backward kernels share: their static config, the walk over the ring, P.

Both kernels (dK/dV, :mod:`.dkdv` and :mod:`.dkdv_d256`; dQ, :mod:`.dq`) own a block of
one sequence and walk the other through the producer's ring (:func:`warp_specialized`,
:func:`walk`); a walked block is masked, unmasked or skipped by the mask spec and the
segment ids (:func:`owned_ranges`, :func:`cta_range`), P is recomputed from the forward's
lse (:func:`probabilities`), and bias / mask arrays come in rings next to the walked block
or once along the owned one (:func:`load_logit_slots`, :func:`owned_logit_parts`,
:func:`logit_tiles`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.logits import log2_logits
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.block_walk import hull
from pallas_flash.mosaic.config import NUM_CONSUMERS, ring_view, splits_dq
from pallas_flash.mosaic.interpret import interpret_params
from pallas_flash.mosaic.logit_arrays import LogitArray
from pallas_flash.mosaic.pipeline import stream_steps
from pallas_flash.mosaic.tiles import (
    CONSUMER_REGISTERS,
    PRODUCER,
    PRODUCER_REGISTERS,
    SWIZZLE,
    smem_transforms,
)
from pallas_flash.segments import cut_to_span


@dataclasses.dataclass(frozen=True)
class BackwardStatic:
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
    # The fused dQ by FA3's path instead (:mod:`.dq_bulk`); ``interpret``: the kernels run
    # in interpret mode, where its inline PTX takes its plain-Pallas paths.
    bulk_dq: bool = False
    interpret: bool = False
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


def probabilities(st: BackwardStatic, scores, lse2, visible, bias=None):
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


def owned_ranges(st: BackwardStatic, band, spans_ref, batch, own_block):
    """The walked blocks of one owned block: the mask ``band`` (``MaskSpec.kv_blocks`` /
    ``q_blocks``), cut with segment ids to the span of blocks whose ids can meet it
    (``spans_ref`` [B, 2, owned blocks] from :func:`segments.tile_spans`)."""
    if not st.segmented:
        return band
    return cut_to_span(band, spans_ref[batch, 0, own_block], spans_ref[batch, 1, own_block])


def cta_range(st: BackwardStatic, cta_band, ranges_of):
    """``(first, last)`` blocks the CTA's producer streams: its mask band, or with segment
    ids the hull of its consumers' ranges (``ranges_of(c)``: consumer c's)."""
    if not st.segmented:
        return cta_band[0], cta_band[3]
    return functools.reduce(hull, (ranges_of(c)[::3] for c in range(NUM_CONSUMERS)))


@dataclasses.dataclass(frozen=True)
class QueryStream:
    """What a dK/dV CTA's producer streams: query blocks ``[first, last)`` of each query
    head of the GQA group in turn (one ring step per block)."""

    group: int
    kv_head: jax.Array
    first: jax.Array
    last: jax.Array
    blocks_per_head: jax.Array  # last - first

    @classmethod
    def between(cls, group: int, kv_head, first, last) -> QueryStream:
        return cls(group, kv_head, first, last, last - first)

    def num_steps(self) -> jax.Array:
        return self.group * self.blocks_per_head

    def head_step0(self, g) -> jax.Array:
        """The step of block 0 of the group's head ``g`` (block i is step head_step0 + i)."""
        return g * self.blocks_per_head - self.first

    def head(self, g) -> jax.Array:
        """The query head of the group's head ``g``."""
        return self.kv_head * self.group + g

    def head_and_block(self, t):
        """(query head, query block) of step t. Without GQA no division: an integer
        division by a run-time count is some 20 dependent instructions per step."""
        if self.group == 1:
            return self.head(0), self.first + t
        g = lax.div(t, self.blocks_per_head)
        return self.head(g), self.first + lax.rem(t, self.blocks_per_head)

    def before(self, head, i):
        """(query head, query block) of the step before block i of ``head`` (the last
        block of the previous head when i is its first; meaningless before step 0)."""
        if self.group == 1:
            return head, i - 1
        starts_head = i == self.first
        return (jnp.where(starts_head, head - 1, head),
                jnp.where(starts_head, self.last - 1, i - 1))


def unpack_refs(st: BackwardStatic, refs):
    """The kernels' extra GMEM refs in order: (q_ids, kv_ids, spans) with segment ids, the
    bias and mask operands, then the rest (outputs)."""
    refs = iter(refs)
    ids = tuple(next(refs) for _ in range(3)) if st.segmented else (None,) * 3
    bias_ref = next(refs) if st.bias is not None else None
    mask_ref = next(refs) if st.attn_mask is not None else None
    return ids, (bias_ref, mask_ref), tuple(refs)


def load_logit_slots(st: BackwardStatic, logit_refs, rings, s, ready, *, batch, head, owned,
                     walked) -> None:
    """Producer: the bias / mask tiles (or rows) of walked block ``walked`` into slot ``s``
    of their rings, on ``ready`` (``owned``: each consumer's ``pl.ds``)."""
    for array, ref, ring in zip((st.bias, st.attn_mask), logit_refs, rings, strict=True):
        if array is not None and array.ring is not None:
            array.load_block(ref, ring.at[s], ready, batch=batch, head=head, rows=owned,
                             keys=walked)


def owned_logit_parts(st: BackwardStatic, logit_refs, *, batch, head, owned):
    """Consumer: (bias, mask) values of arrays constant along the walked axis, laid out as
    its ``owned`` rows (read from GMEM once per head), else None."""
    return tuple(array.read_rows(ref, batch=batch, head=head, rows=owned)
                 if array is not None and array.ring is None else None
                 for array, ref in zip((st.bias, st.attn_mask), logit_refs, strict=True))


def logit_tiles(st: BackwardStatic, owned_parts, rings, s, wg, shape):
    """Consumer ``wg``: (bias tile, mask tile) of the step in slot ``s`` (each None when
    absent), read before the slot is freed."""
    tiles = []
    for array, owned, ring in zip((st.bias, st.attn_mask), owned_parts, rings, strict=True):
        walked = None if array is None or ring is None else array.read_slot(ring.at[s], wg)
        tiles.append(None if array is None else array.tile(owned, walked, shape))
    return tuple(tiles)


def wait_all(barriers, s) -> None:
    for barrier in barriers:
        plgpu.barrier_wait(barrier.at[s])


def walk(st: BackwardStatic, step, skip, cta_range, ranges, carry):
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


def _registers(head_dim: int) -> tuple[int, int]:
    """``setmaxnreg`` of the (consumer, producer) warpgroups; 2 x consumer + producer <= 512.

    Above head_dim 64 dK and dV alone hold up to 128 f32 registers per thread: FA3's
    split, 240 + 24; at 64 the forward's 232 + 40
    (measurements: docs/tuning.md#mosaic-backward-registers-and-per-consumer-code).
    """
    if head_dim > 64:
        return 240, 24
    return CONSUMER_REGISTERS, PRODUCER_REGISTERS


def warp_specialized(st: BackwardStatic, free, num_steps, load, consume, *,
                     per_consumer_copies: bool) -> None:
    """FA3's warp specialization of a backward kernel: the producer warpgroup gives
    registers up and streams ``num_steps`` walked blocks with ``load``
    (:func:`~pallas_flash.mosaic.pipeline.stream_steps`), the consumer warpgroups take the
    registers and run ``consume(wg)``.

    ``per_consumer_copies``: each consumer runs its own copy of ``consume``, with its
    index ``wg`` a constant, not read at run time. What follows from it (its keys, its
    loop bounds, tile addresses) is then uniform across the warp and stays in uniform
    registers; with a run-time index a masked walk's loop counters go to vector
    registers and spill. The dK/dV kernel up to head_dim 128 takes the copies; the dQ
    kernel and the head-dim-256 dK/dV kernel do not (they spilled more or ran no faster)
    (measurements: docs/tuning.md#mosaic-backward-registers-and-per-consumer-code).
    """
    consumer_registers, producer_registers = _registers(st.head_dim)
    wg = lax.axis_index("wg")

    @pl.when(wg == PRODUCER)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        # The consumers read the slot's ids / bias / mask through the generic proxy; the
        # proxy fence orders those reads before the TMA (async proxy) overwrites.
        stream_steps(num_stages=st.num_stages, num_steps=num_steps, free=free, load=load,
                     before_refill=plgpu.commit_smem if st.reads_walked_slots else None)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(consumer_registers, action="increase")
        if per_consumer_copies:
            for c in range(NUM_CONSUMERS):
                pl.when(wg == c)(functools.partial(consume, c))
        else:
            consume(wg)


def kernel_params(interpret: bool) -> dict:
    """``plgpu.kernel``'s arguments every backward kernel takes: 2 consumers + 1 producer."""
    return dict(num_threads=NUM_CONSUMERS + 1, thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=interpret_params(interpret, NUM_CONSUMERS + 1))


def smem_tiles(st: BackwardStatic, *shape, dtype=None):
    """A swizzled SMEM buffer (the layout TMA writes and wgmma reads)."""
    dtype = jnp.dtype(dtype or st.dtype)
    swizzle = min(st.swizzle, shape[-1] * dtype.itemsize)  # float32 staging: 128 bytes
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype.itemsize, swizzle))


def logit_scratch(st: BackwardStatic, *, owned: int, walked: int) -> dict:
    """The bias / mask rings of one kernel whose consumers own ``owned`` rows and whose
    ring walks blocks of ``walked`` (its tiling in the forward's terms)."""
    rings = [a for a in st.logit_arrays if a.ring is not None]
    if not rings:
        return {}
    view = ring_view(owned=owned, walked=walked, num_stages=st.num_stages)
    return {"mask_smem" if a.is_mask else "bias_smem": a.smem(view) for a in rings}

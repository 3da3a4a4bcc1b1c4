"""The dK/dV kernel up to head_dim 128: one CTA per ``2·block_kv`` keys of one KV head.

Each consumer warpgroup owns ``block_kv`` keys, keeps K_j and V_j in SMEM and dK_j, dV_j in
registers. The producer streams (Q_i, dO_i, lse_i, delta_i) for every query block i that
sees the CTA's keys, for every query head of the GQA group (the group's sum happens in the
accumulators; K/V are never repeated). The consumer works on the transposed tiles, so that
dK and dV stay row-major per key and every GEMM reads its B operand straight from SMEM::

    Sᵀ = K_j·Q_iᵀ          Pᵀ = exp2(Sᵀ·scale·log2e − lse_i)       dV_j += Pᵀ·dO_i
    dPᵀ = V_j·dO_iᵀ        dSᵀ = Pᵀ ∘ (dPᵀ − delta_i)               dK_j += dSᵀ·Q_i

(Pᵀ and dSᵀ are the A operands, from registers; ``dK_j`` is scaled once at the end.) What
happens to dSᵀ next, for dQ, is the dQ mode's (:mod:`.dq_modes`): the step calls its hooks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.contract import kernel_output
from pallas_flash.logits import raw_score_gradient
from pallas_flash.mosaic.backward.common import (
    BackwardStatic,
    QueryStream,
    cta_range,
    kernel_params,
    load_logit_slots,
    logit_scratch,
    logit_tiles,
    owned_logit_parts,
    owned_ranges,
    probabilities,
    smem_tiles,
    unpack_refs,
    wait_all,
    walk,
    warp_specialized,
)
from pallas_flash.mosaic.backward.dq_bulk import BulkDqRefs, kernel_interpret_params
from pallas_flash.mosaic.backward.dq_modes import (
    DqMode,
    FusedDqRefs,
    Step,
    dq_mode,
    dq_scratch,
)
from pallas_flash.mosaic.block_walk import visible_tile
from pallas_flash.mosaic.config import NUM_CONSUMERS
from pallas_flash.mosaic.pipeline import ring_slot
from pallas_flash.mosaic.tiles import a_operand, col


@dataclasses.dataclass(frozen=True)
class _QueryRing:
    """The producer's ring of walked query blocks (SMEM, ``stages`` slots)."""

    q: Any  # [stages, block_q, D]
    do: Any  # [stages, block_q, D]
    lse: Any  # [stages, block_q] float32, base 2
    delta: Any  # [stages, block_q] float32
    q_ids: Any  # [stages, block_q] int32 with segment ids, else None
    logits: tuple  # (bias ring, mask ring), each None when absent
    # FA3's two pipelines: what Sᵀ and Pᵀ need (Q, lse, ids, bias / mask) arrives on
    # q_ready, what dPᵀ and dSᵀ need (dO, delta) on do_ready, which a consumer waits for
    # only once its Sᵀ GEMM is issued.
    q_ready: Any  # [stages] barriers
    do_ready: Any  # [stages] barriers
    free: Any  # [stages] barriers, one arrival per consumer

    def wait_all(self, s) -> None:
        wait_all((self.q_ready, self.do_ready), s)


@dataclasses.dataclass(frozen=True)
class _Consumer:
    """What the walk of one consumer reads: fixed from its first step to its last."""

    st: BackwardStatic
    wg: int
    k0: jax.Array  # its first key
    batch: jax.Array
    ring: _QueryRing
    logit_refs: tuple  # GMEM (bias, mask), each None when absent
    stream: QueryStream
    ranges: tuple  # its (first, full_first, full_last, last) query blocks in the CTA's
    k_a: Any  # K_j, the A operand of Sᵀ (SMEM tile or registers)
    v_a: Any  # V_j, the A operand of dPᵀ
    kv_ids: Any  # its keys' ids laid out as the rows of Sᵀ, or None
    a_tile: Any  # interpret mode: the SMEM detour of register A operands, else None
    dq: DqMode


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: BackwardStatic,
                 k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, k_ready, v_ready,
                 q_ready, do_ready, free, q_ids_smem=None,
                 a_smem=None, bias_smem=None, mask_smem=None, **mode_smem):
    """One CTA: keys ``[2·block_kv·tile, +2·block_kv)`` of one KV head.

    GMEM refs: q/do [B, Tq, N, D], k/v [B, Tk, K, D], lse (log2 units)/delta [B, N, Tq];
    ``refs`` = (q_ids [B, Tq], kv_ids [B, Tk], spans [B, 2, Tk / block_kv] int32 with
    ``st.segmented``;) (bias, mask operands;) (dq_acc [B, Tq, N, D] float32,
    zero-initialised — with ``st.dq_partials`` [2·tiles, B, Tq, N, D] — with
    ``st.fuse_dq``;) dk/dv [B, Tk, K, D]. SMEM: k/v [2, block_kv, D] (one tile per
    consumer), the query ring (:class:`_QueryRing`: Q, lse, q_ids and bias / mask tiles on
    q_ready, dO and delta on do_ready, one TMA arrival per copy), a_smem [2, block_kv,
    block_q] (interpret mode only); ``mode_smem``: the dQ mode's SMEM and barriers
    (:func:`~.dq_modes.dq_scratch`).
    """
    (q_ids_ref, kv_ids_ref, spans_ref), logit_refs, refs = unpack_refs(st, refs)
    dq_ref, dk_ref, dv_ref = refs if st.fuse_dq else (None, *refs)
    ring = _QueryRing(q_smem, do_smem, lse_smem, delta_smem, q_ids_smem,
                      (bias_smem, mask_smem), q_ready, do_ready, free)
    bq, bkv = st.block_q, st.block_kv
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    kv_tile = lax.axis_index("kv_tiles")
    cta_k0 = kv_tile * (NUM_CONSUMERS * bkv)

    def ranges_of(c):
        """Consumer c's query blocks: (first, full_first, full_last, last)."""
        band = st.mask.q_blocks(cta_k0 + c * bkv, bkv, bq, st.num_q_blocks)
        return owned_ranges(st, band, spans_ref, batch, kv_tile * NUM_CONSUMERS + c)

    # The query blocks any key of this CTA is seen by; streamed once per head of the group.
    cta_first, cta_last = cta_range(
        st, st.mask.q_blocks(cta_k0, NUM_CONSUMERS * bkv, bq, st.num_q_blocks), ranges_of)
    stream = QueryStream.between(st.group, kv_head, cta_first, cta_last)
    dq_refs = (BulkDqRefs if st.bulk_dq else FusedDqRefs)(
        dq_ref, k_smem, batch=batch, kv_tile=kv_tile, **mode_smem) if st.fuse_dq else None

    def load(t):
        head, i = stream.head_and_block(t)
        rows, s = pl.ds(i * bq, bq), ring_slot(t, st.num_stages)
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[s], q_ready.at[s])
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_smem.at[s],
                                q_ready.at[s])
        if st.segmented:  # the rows' ids, 4·block_q bytes
            plgpu.copy_gmem_to_smem(q_ids_ref.at[batch, rows], q_ids_smem.at[s],
                                    q_ready.at[s])
        # Bias / mask (transposed: [keys, queries]) tiles or rows.
        owned = [pl.ds(cta_k0 + c * bkv, bkv) for c in range(NUM_CONSUMERS)]
        load_logit_slots(st, logit_refs, ring.logits, s, q_ready.at[s], batch=batch,
                         head=head, owned=owned, walked=rows)
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[s],
                                do_ready.at[s])
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_smem.at[s],
                                do_ready.at[s])

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
        dq = dq_mode(st, wg, dq_refs, stream)
        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])
        # Interpret mode keeps K and V in SMEM (its wgmma reads no A from registers).
        resident = dq.resident_kv and a_tile is None
        k_a, v_a = (plgpu.load(t, layout=plgpu.Layout.WGMMA, optimized=True)
                    if resident else t for t in (k_tile, v_tile))
        consumer = _Consumer(st, wg, k0, batch, ring, logit_refs, stream, ranges, k_a, v_a,
                             kv_ids, a_tile, dq)
        dk, dv = pl.run_scoped(functools.partial(_accumulate, consumer),
                               plgpu.ACC((bkv, st.head_dim), jnp.float32),
                               plgpu.ACC((bkv, st.head_dim), jnp.float32))
        dq.before_epilogue()
        # Epilogue: dK_j = scale · Σ dSᵀ·Q (S was scaled); out through the K/V tiles + TMA.
        k_tile[...] = (dk * st.scale).astype(st.dtype)
        v_tile[...] = dv.astype(st.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[keys])
        plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    warp_specialized(st, free, stream.num_steps(), load, consume, per_consumer_copies=True)


def _accumulate(c: _Consumer, dk_acc, dv_acc):
    """One consumer's walk: the streamed query blocks of every query head of the GQA group
    (summed into the accumulators); returns dK_j, dV_j [block_kv, D] float32."""
    st, stream = c.st, c.stream

    def head(g, carry):
        head_step0 = stream.head_step0(g)  # step of block i: head_step0 + i
        q_head = stream.head(g)
        owned_parts = owned_logit_parts(st, c.logit_refs, batch=c.batch, head=q_head,
                                        owned=pl.ds(c.k0, st.block_kv))
        walk(st, functools.partial(_step, c, (dk_acc, dv_acc), head=q_head,
                                   owned_parts=owned_parts),
             functools.partial(_skip, c, head=q_head), (stream.first, stream.last), c.ranges,
             head_step0)
        return carry

    c.dq.before_walk()
    lax.fori_loop(0, st.group, head, 0)
    c.dq.after_walk()
    return dk_acc[...], dv_acc[...]


def _step(c: _Consumer, accs, i, head_step0, *, head, owned_parts, masked: bool):
    """Query block i of one head: dV_j += Pᵀ·dO_i, dK_j += dSᵀ·Q_i, then the dQ mode."""
    st, ring = c.st, c.ring
    s = ring_slot(head_step0 + i, st.num_stages)
    plgpu.barrier_wait(ring.q_ready.at[s])
    q_tile, do_tile = ring.q.at[s], ring.do.at[s]
    lse2 = plgpu.load(ring.lse.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
    q_ids = None
    if st.segmented:  # read before the slot is freed (the producer refills it)
        q_ids = plgpu.load(ring.q_ids.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
    shape = (st.block_kv, st.block_q)  # rows are keys, columns queries
    bias_t, mask_t = logit_tiles(st, owned_parts, ring.logits, s, c.wg, shape)

    def gemms(st_acc, dpt_acc):
        dk_acc, dv_acc = accs
        plgpu.wgmma(st_acc, c.k_a, q_tile.T)
        plgpu.barrier_wait(ring.do_ready.at[s])  # the Sᵀ GEMM runs while dO lands
        plgpu.wgmma(dpt_acc, c.v_a, do_tile.T)
        # Sᵀ is ready once at most the dPᵀ GEMM is in flight: Pᵀ overlaps it.
        scores_t = plgpu.wgmma_accumulator_load(st_acc, wait_n=1)
        visible = None
        if masked:
            visible = visible_tile(st.mask, shape, i * st.block_q, c.k0, keys_are_rows=True,
                                   q_ids=q_ids, kv_ids=c.kv_ids, mask_tile=mask_t)
        p_t, slope_t = probabilities(st, scores_t, col(lse2, shape), visible, bias_t)
        plgpu.wgmma(dv_acc, a_operand(p_t.astype(st.dtype), c.a_tile), do_tile)
        # dPᵀ is ready once at most the dV GEMM is in flight: dSᵀ overlaps it.
        dp_t = plgpu.wgmma_accumulator_load(dpt_acc, wait_n=1)
        # delta is loaded where dSᵀ needs it: fewer live registers across the GEMMs.
        delta_t = col(plgpu.load(ring.delta.at[s], layout=plgpu.Layout.WGMMA.reduce(0)),
                      shape)
        ds_t = raw_score_gradient(p_t * (dp_t - delta_t), slope_t).astype(st.dtype)

        def issue_dk():
            plgpu.wgmma(dk_acc, a_operand(ds_t, c.a_tile), q_tile)
        c.dq.after_ds(Step(i, head, head_step0, s), ds_t, issue_dk)

    pl.run_scoped(gemms, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
    plgpu.barrier_arrive(ring.free.at[s])
    return head_step0


def _skip(c: _Consumer, i, head_step0, *, head):
    """A block only the other consumer needs: same barriers, no math (the dQ mode may
    still take its share of the step's dQ)."""
    s = ring_slot(head_step0 + i, c.st.num_stages)
    c.ring.wait_all(s)
    c.dq.skipped(Step(i, head, head_step0, s))
    plgpu.barrier_arrive(c.ring.free.at[s])
    return head_step0


def call_dkdv(st: BackwardStatic, operands, dq_acc, *, interpret: bool):
    """dK, dV [B, Tk_pad, K, D_pad]: one CTA per 2·block_kv keys of one KV head.

    ``dq_acc``: None (deterministic dQ), or a zeroed float32 ref [B, Tq_pad, N, D_pad] that
    receives dS·K.
    """
    q_p, k_p = operands[:2]
    batch, kv_heads = k_p.shape[0], k_p.shape[2]
    bq, bkv, d, stages = st.block_q, st.block_kv, st.head_dim, st.num_stages
    scratch = dict(
        k_smem=smem_tiles(st, NUM_CONSUMERS, bkv, d),
        v_smem=smem_tiles(st, NUM_CONSUMERS, bkv, d),
        q_smem=smem_tiles(st, stages, bq, d), do_smem=smem_tiles(st, stages, bq, d),
        lse_smem=plgpu.SMEM((stages, bq), jnp.float32),
        delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
        k_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        v_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        # One TMA arrival per copy: Q and lse, with segment ids the rows' ids, bias / mask.
        q_ready=plgpu.Barrier(num_arrivals=2 + st.segmented + st.logit_copies(),
                              num_barriers=stages),
        do_ready=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # dO and delta
        free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    )
    if st.segmented:
        scratch["q_ids_smem"] = plgpu.SMEM((stages, bq), jnp.int32)
    # Consumers own block_kv keys, the ring walks block_q queries (transposed arrays).
    scratch.update(logit_scratch(st, owned=bkv, walked=bq))
    if interpret:
        scratch["a_smem"] = smem_tiles(st, NUM_CONSUMERS, bkv, bq)
    scratch.update(dq_scratch(st))
    params = kernel_params(interpret)
    if st.bulk_dq and interpret:  # its named barriers, modelled by the interpreter
        params["interpret"] = kernel_interpret_params(st)
    return plgpu.kernel(
        functools.partial(_dkdv_kernel, st=st),
        out_type=(kernel_output(k_p.shape, q_p.dtype, q_p),) * 2,
        scratch_types=scratch,
        grid=(kv_heads, st.num_tiles, batch),
        grid_names=("heads", "kv_tiles", "batch"),
        **params,
    )(*operands, *(() if dq_acc is None else (dq_acc,)))

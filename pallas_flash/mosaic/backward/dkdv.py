"""The dK/dV kernel up to head_dim 128: one CTA per ``2·block_kv`` keys of one KV head.

Each consumer warpgroup owns ``block_kv`` keys, keeps K_j and V_j in SMEM and dK_j, dV_j in
registers. The producer streams (Q_i, dO_i, lse_i, delta_i) for every query block i that
sees the CTA's keys, for every query head of the GQA group (the group's sum happens in the
accumulators; K/V are never repeated). The consumer works on the transposed tiles, so that
dK and dV stay row-major per key and every GEMM reads its B operand straight from SMEM::

    Sᵀ = K_j·Q_iᵀ          Pᵀ = exp2(Sᵀ·scale·log2e − lse_i)       dV_j += Pᵀ·dO_i
    dPᵀ = V_j·dO_iᵀ        dSᵀ = Pᵀ ∘ (dPᵀ − delta_i)               dK_j += dSᵀ·Q_i

(Pᵀ and dSᵀ are the A operands, from registers; ``dK_j`` is scaled once at the end.)
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

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
from pallas_flash.mosaic.block_walk import visible_tile
from pallas_flash.mosaic.config import NUM_CONSUMERS
from pallas_flash.mosaic.tiles import a_operand, col

#: Head dims up to which the fused dK/dV kernel keeps K and V in registers (:func:`_resident`).
_RESIDENT_MAX_HEAD_DIM = 64


def _resident(st: BackwardStatic, tile, interpreting: bool):
    """K or V of a fused dK/dV consumer, the A operand of its Sᵀ and dPᵀ GEMMs at every
    step: at head_dim 64 loaded into registers once (16 per thread), so that those wgmmas
    read only B from SMEM, which the fused dQ's float32 staging tile also needs. Measured
    on the H200 (2026-11-30, ``mosaic_bwd_probe.py --head-dims 64``): the fused backward
    went from 0.87-0.96x cuDNN to 0.97-1.06x; the deterministic one gained at some points
    and lost at others, and keeps the SMEM tiles. Interpret mode keeps them too."""
    if interpreting or not st.fuse_dq or st.head_dim > _RESIDENT_MAX_HEAD_DIM:
        return tile
    return plgpu.load(tile, (), layout=plgpu.Layout.WGMMA, optimized=True)



def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: BackwardStatic,
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
    (q_ids_ref, kv_ids_ref, spans_ref), logit_refs, refs = unpack_refs(st, refs)
    dq_ref, dk_ref, dv_ref = refs if st.fuse_dq else (None, *refs)
    rings = (bias_smem, mask_smem)
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
    stream = QueryStream(st.group, kv_head, cta_first, cta_last - cta_first)

    def slot(t):
        return lax.rem(t, st.num_stages)

    def load(t):
        head, i = stream.head_and_block(t)
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
        load_logit_slots(st, logit_refs, rings, s, lse_ready.at[s], batch=batch,
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
            head, i = stream.head_and_block(jnp.maximum(t - 1, 0))
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
            num_steps = stream.num_steps()
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
                wait_all(ready, s)
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
                bias_t, mask_t = logit_tiles(st, owned_parts, rings, s, wg, shape)

                def gemms(st_acc, dpt_acc):
                    plgpu.wgmma(st_acc, k_a, q_tile.T)
                    plgpu.wgmma(dpt_acc, v_a, do_tile.T)
                    # Sᵀ is ready once at most the dPᵀ GEMM is in flight: Pᵀ overlaps it.
                    scores_t = plgpu.wgmma_accumulator_load(st_acc, wait_n=1)
                    visible = None
                    if masked:
                        visible = visible_tile(st.mask, shape, i * bq, k0, keys_are_rows=True,
                                               q_ids=q_ids, kv_ids=kv_ids, mask_tile=mask_t)
                    p_t, slope_t = probabilities(st, scores_t, col(lse2, shape), visible,
                                                  bias_t)
                    plgpu.wgmma(dv_acc, a_operand(p_t.astype(st.dtype), a_tile), do_tile)
                    # dPᵀ is ready once at most the dV GEMM is in flight: dSᵀ overlaps it.
                    dp_t = plgpu.wgmma_accumulator_load(dpt_acc, wait_n=1)
                    delta_t = col(load_delta() if delta is None else delta, shape)
                    ds_t = raw_score_gradient(p_t * (dp_t - delta_t), slope_t)
                    ds_t = ds_t.astype(st.dtype)

                    def issue_dk():
                        plgpu.wgmma(dk_acc, a_operand(ds_t, a_tile), q_tile)
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
                wait_all(ready, s)
                if st.split_dq:
                    add_previous_dq(head_step0 + i, s, _zero_tile(st))
                elif st.fuse_dq:
                    publish_ds(s, _zero_tile(st))
                    add_dq(s, i, head)
                plgpu.barrier_arrive(free.at[s])
                return head_step0

            def head(g, carry):  # the GQA group's query heads, summed in dK/dV
                head_step0 = stream.head_step0(g)  # step of block i: head_step0 + i
                q_head = kv_head * st.group + g
                owned_parts = owned_logit_parts(st, logit_refs, batch=batch, head=q_head,
                                                 owned=pl.ds(k0, bkv))
                walk(st, functools.partial(step, head=q_head, owned_parts=owned_parts),
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

    warp_specialized(st, free, stream.num_steps(), load, consume,
                      per_consumer_copies=True)



def _zero_tile(st: BackwardStatic) -> jax.Array:
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


def _add_staged_dq(st: BackwardStatic, dq_tile, dq_rows) -> None:
    """``dq_rows += dq_tile`` (the float32 staging tile, committed to the async proxy) with
    a TMA reduce-add in L2; with ``st.dq_partials`` (interpret mode) a plain store into
    this key tile's partial sums."""
    plgpu.copy_smem_to_gmem(dq_tile, dq_rows,
                            reduction_op=None if st.dq_partials else "add")


def _reduce_dq(st: BackwardStatic, pairs, dq_tile, dq_rows) -> None:
    """FA3's dQ: ``dq_rows += Σ dS·K`` over ``pairs`` (:func:`_dq_gemm`), staged in
    ``dq_tile`` ([block_q, columns] float32, still read by the previous step's add)."""
    dq = _dq_gemm(pairs, dq_tile.shape)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's add read the tile
    dq_tile[...] = dq
    plgpu.commit_smem()
    _add_staged_dq(st, dq_tile, dq_rows)



def call_dkdv(st: BackwardStatic, operands, dq_acc, *, interpret: bool):
    """dK, dV [B, Tk_pad, K, D_pad]: one CTA per 2·block_kv keys of one KV head.

    ``dq_acc``: None, or a zeroed float32 ref [B, Tq_pad, N, D_pad] that receives dS·K.
    """
    q_p, k_p = operands[:2]
    batch, kv_heads = k_p.shape[0], k_p.shape[2]
    bq, bkv, d, stages = st.block_q, st.block_kv, st.head_dim, st.num_stages
    scratch = dict(
        k_smem=smem_tiles(st, NUM_CONSUMERS, bkv, d), v_smem=smem_tiles(st, NUM_CONSUMERS, bkv, d),
        q_smem=smem_tiles(st, stages, bq, d), do_smem=smem_tiles(st, stages, bq, d),
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
    scratch.update(logit_scratch(st, owned=bkv, walked=bq))
    if interpret:
        scratch["a_smem"] = smem_tiles(st, NUM_CONSUMERS, bkv, bq)
    extra = ()
    if dq_acc is not None:
        scratch["ds_smem"] = smem_tiles(st, stages, NUM_CONSUMERS, bkv, bq)
        dq_columns = d // NUM_CONSUMERS if st.split_dq else d
        scratch["dq_smem"] = smem_tiles(st, NUM_CONSUMERS, bq, dq_columns, dtype=jnp.float32)
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
        **kernel_params(interpret),
    )(*operands, *extra)


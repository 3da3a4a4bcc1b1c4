"""dK/dV at head_dim 256 on Hopper: the two consumer warpgroups split one key block.

At head_dim 256, dK and dV of 64 keys are 256 f32 registers per thread, more than a
warpgroup can hold, so the dK/dV kernel of :mod:`.dkdv` (one 64-key block per
consumer) cannot run. FlashAttention-3 splits the work on one 64-key block between its
two consumer warpgroups instead, and so does this kernel. For each streamed query block
i (Q_i, dO_i, lse_i, delta_i, 64 rows), consumer c

1. computes Sᵀ = K_j·Q_iᵀ and dPᵀ = V_j·dO_iᵀ for **its half of the rows** of block i
   (32 queries, contracting over the whole head dim), then Pᵀ and dSᵀ for that half,
   exactly as the kernel of :mod:`.dkdv` does for a whole block;
2. stores its Pᵀ and dSᵀ halves to SMEM and meets the other consumer (``exchanged``);
3. accumulates **its half of the head dim** of dV_j += Pᵀ·dO_i and dK_j += dSᵀ·Q_i over
   all 64 rows, reading both halves of Pᵀ and dSᵀ from SMEM.

Every GEMM is computed once, a consumer holds dK and dV of 64 keys × 128 columns (128
registers), and Sᵀ and dPᵀ are [64, 32] tiles. Tiles live in SMEM cut into halves along
leading dims (K/V by column, Q/dO by column and by row, Pᵀ/dSᵀ by row), so that a
consumer's half is an index, never a slice of a swizzled tile, and a contraction over the
whole head dim is two wgmmas. Step 3 contracts over 32 rows per wgmma, and wgmma steps
through K one swizzle width at a time: every tile uses the 64-byte swizzle. The SMEM of
one CTA (2-stage rings of Q and dO, K, V, the exchange tiles) is 226 KiB of the 227.

A slot's exchange tiles are rewritten ``num_stages`` steps later, by which time the
other consumer has passed the exchange of the step in between, hence finished the GEMMs
that read them: no further barrier is needed.

Masking, segment ids, soft-capping, GQA and the producer's ring are those of
:mod:`.common`; dQ comes from the dQ kernel (:mod:`.dq`, with 32-key blocks at this
head dim).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.contract import kernel_output
from pallas_flash.logits import raw_score_gradient
from pallas_flash.mosaic.backward.common import (
    BackwardStatic,
    QueryStream,
    kernel_params,
    owned_ranges,
    probabilities,
    smem_tiles,
    wait_all,
    walk,
    warp_specialized,
)
from pallas_flash.mosaic.block_walk import visible_tile
from pallas_flash.mosaic.config import NUM_CONSUMERS
from pallas_flash.mosaic.tiles import col


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: BackwardStatic,
                 k_smem, v_smem, q_smem, do_smem, stats_smem, pt_smem, dst_smem, k_ready,
                 v_ready, q_ready, do_ready, free, exchanged,
                 q_ids_smem=None):
    """One CTA: keys ``[block_kv·tile, +block_kv)`` of one KV head.

    GMEM refs as in the kernel of :mod:`.dkdv` (without the fused dQ). SMEM (``h``: a
    column half of the head dim, ``r``: a row half of the query block, ``s``: a ring slot):
    k/v [h, block_kv, D/2]; q/do [s, h, r, block_q/2, D/2]; stats [s, lse|delta, r,
    block_q/2] float32; pt/dst [s, r, block_kv, block_q/2] (Pᵀ and dSᵀ, row half r
    written by consumer r); with segment ids q_ids_smem [s, r, block_q/2] int32. Q, the
    stats and the ids arrive on q_ready, dO on do_ready (waited once the Sᵀ GEMMs are
    issued). Halves are leading dims, so that a consumer's half is an index, never a slice
    of a swizzled tile.
    """
    q_ids_ref, kv_ids_ref, spans_ref = refs[:3] if st.segmented else (None,) * 3
    dk_ref, dv_ref = refs[3:] if st.segmented else refs
    bq, bkv = st.block_q, st.block_kv
    half_q, half_d = bq // NUM_CONSUMERS, st.head_dim // NUM_CONSUMERS
    halves = range(NUM_CONSUMERS)
    batch, kv_head = lax.axis_index("batch"), lax.axis_index("heads")
    kv_tile = lax.axis_index("kv_tiles")
    k0 = kv_tile * bkv
    # Both consumers own the same keys, so they walk the same query blocks.
    band = owned_ranges(st, st.mask.q_blocks(k0, bkv, bq, st.num_q_blocks), spans_ref,
                         batch, kv_tile)
    first, last = band[0], band[3]
    stream = QueryStream.between(st.group, kv_head, first, last)

    def slot(t):
        return lax.rem(t, st.num_stages)

    def load(t):
        head, i = stream.head_and_block(t)
        s = slot(t)
        for r in halves:  # one TMA copy per (row half, column half)
            rows = pl.ds(i * bq + r * half_q, half_q)
            for h in halves:
                cols = pl.ds(h * half_d, half_d)
                plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head, cols],
                                        q_smem.at[s, h, r], q_ready.at[s])
                plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head, cols],
                                        do_smem.at[s, h, r], do_ready.at[s])
            for stat, ref in enumerate((lse_ref, delta_ref)):
                plgpu.copy_gmem_to_smem(ref.at[batch, head, rows], stats_smem.at[s, stat, r],
                                        q_ready.at[s])
            if st.segmented:  # the rows' ids
                plgpu.copy_gmem_to_smem(q_ids_ref.at[batch, rows], q_ids_smem.at[s, r],
                                        q_ready.at[s])

    def consume(wg):
        own_cols = pl.ds(wg * half_d, half_d)  # this consumer's half of dK and dV
        keys = (batch, pl.ds(k0, bkv), kv_head, own_cols)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[wg], k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[wg], v_ready.at[wg])
        kv_ids = None
        if st.segmented:  # the keys' ids, laid out as the rows of Sᵀ, once
            kv_ids = plgpu.load(kv_ids_ref.at[batch, pl.ds(k0, bkv)],
                                layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        for h in halves:  # Sᵀ and dPᵀ read both halves of K and V
            wait_all((k_ready, v_ready), h)
        shape = (bkv, half_q)  # rows are keys, columns this consumer's queries

        c = _Half(st, wg, slot, shape, k0, kv_ids, k_smem, v_smem, q_smem, do_smem,
                  stats_smem, pt_smem, dst_smem, q_ids_smem, q_ready, do_ready, free,
                  exchanged)

        dk, dv = pl.run_scoped(functools.partial(_accumulate, c, band, stream),
                               plgpu.ACC((bkv, half_d), jnp.float32),
                               plgpu.ACC((bkv, half_d), jnp.float32))
        # After the last exchange neither consumer reads K or V again (their GEMMs finished
        # before it): this consumer's halves carry its dK and dV out.
        k_smem.at[wg][...] = (dk * st.scale).astype(st.dtype)
        v_smem.at[wg][...] = dv.astype(st.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[keys])
        plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    warp_specialized(st, free, stream.num_steps(), load, consume,
                      per_consumer_copies=False)



class _Half(NamedTuple):
    """What consumer ``wg`` (row half ``wg`` of each query block, column half ``wg`` of
    dK and dV) reads at each step: its keys' first index and ids, the SMEM tiles and the
    ring's barriers (as :func:`_dkdv_kernel` describes them)."""

    st: BackwardStatic
    wg: int
    slot: Any
    shape: tuple[int, int]  # of Sᵀ: rows are keys, columns this consumer's queries
    k0: Any
    kv_ids: Any
    k_smem: Any
    v_smem: Any
    q_smem: Any
    do_smem: Any
    stats_smem: Any
    pt_smem: Any
    dst_smem: Any
    q_ids_smem: Any
    q_ready: Any  # Q, lse, delta and the rows' ids
    do_ready: Any  # dO, waited once the Sᵀ GEMMs are issued
    free: Any
    exchanged: Any


def _accumulate(c: _Half, band, stream: QueryStream, dk_acc, dv_acc):
    """The consumer's walk over ``band`` (:func:`owned_ranges`) for every query head of
    the GQA group, summed in the accumulators; returns dK_j, dV_j halves float32."""
    st = c.st
    step = functools.partial(_step, c, (dk_acc, dv_acc))

    def skip(i, head_step0):
        """Never runs (both consumers walk the same band); the ring's protocol."""
        s = c.slot(head_step0 + i)
        wait_all((c.q_ready, c.do_ready), s)
        plgpu.barrier_arrive(c.free.at[s])
        return head_step0

    def head(g, carry):
        walk(st, step, skip, (band[0], band[3]), band, stream.head_step0(g))
        return carry

    lax.fori_loop(0, st.group, head, 0)
    return dk_acc[...], dv_acc[...]


def _step(c: _Half, accs, i, head_step0, *, masked: bool):
    """Query block i of one head: this consumer's columns of dV_j += Pᵀ·dO_i and
    dK_j += dSᵀ·Q_i (FA3's split of a 64-key block between the two consumers)."""
    st, wg, shape = c.st, c.wg, c.shape
    dk_acc, dv_acc = accs
    halves = range(NUM_CONSUMERS)
    half_q = st.block_q // NUM_CONSUMERS
    s = c.slot(head_step0 + i)
    plgpu.barrier_wait(c.q_ready.at[s])
    layout = plgpu.Layout.WGMMA.reduce(0)
    lse2 = plgpu.load(c.stats_smem.at[s, 0, wg], layout=layout)
    delta = plgpu.load(c.stats_smem.at[s, 1, wg], layout=layout)
    q_ids = None
    if st.segmented:
        q_ids = plgpu.load(c.q_ids_smem.at[s, wg], layout=layout)

    def own_rows(st_acc, dpt_acc):
        """Step 1: Pᵀ and dSᵀ of this consumer's rows of block i."""
        for h in halves:  # the contraction over the head dim, half by half
            plgpu.wgmma(st_acc, c.k_smem.at[h], c.q_smem.at[s, h, wg].T)
        plgpu.barrier_wait(c.do_ready.at[s])  # the Sᵀ GEMMs run while dO lands
        for h in halves:
            plgpu.wgmma(dpt_acc, c.v_smem.at[h], c.do_smem.at[s, h, wg].T)
        # Sᵀ is ready once at most the two dPᵀ GEMMs are in flight.
        scores_t = plgpu.wgmma_accumulator_load(st_acc, wait_n=len(halves))
        visible = None
        if masked:
            visible = visible_tile(st.mask, shape, i * st.block_q + wg * half_q, c.k0,
                                   keys_are_rows=True, q_ids=q_ids, kv_ids=c.kv_ids)
        p_t, slope_t = probabilities(st, scores_t, col(lse2, shape), visible)
        dp_t = plgpu.wgmma_accumulator_load(dpt_acc, wait_n=0)
        ds_t = raw_score_gradient(p_t * (dp_t - col(delta, shape)), slope_t)
        return p_t.astype(st.dtype), ds_t.astype(st.dtype)

    p_t, ds_t = pl.run_scoped(own_rows, plgpu.ACC(shape, jnp.float32),
                              plgpu.ACC(shape, jnp.float32))
    # Step 2: publish this row half; the wgmmas below read both.
    c.pt_smem.at[s, wg][...] = p_t
    c.dst_smem.at[s, wg][...] = ds_t
    plgpu.commit_smem()
    plgpu.barrier_arrive(c.exchanged.at[s])
    plgpu.barrier_wait(c.exchanged.at[s])
    # Step 3: this consumer's columns of dV and dK, over all rows of block i.
    for r in halves:
        plgpu.wgmma(dv_acc, c.pt_smem.at[s, r], c.do_smem.at[s, wg, r])
        plgpu.wgmma(dk_acc, c.dst_smem.at[s, r], c.q_smem.at[s, wg, r])
    plgpu.wgmma_wait(0)  # Q_i and dO_i are read: the slot may be refilled
    plgpu.barrier_arrive(c.free.at[s])
    return head_step0


def call_dkdv_d256(st: BackwardStatic, operands, *, interpret: bool):
    """dK, dV [B, Tk_pad, K, 256]: one CTA per ``block_kv`` keys of one KV head."""
    q_p, k_p = operands[:2]
    batch, kv_heads = k_p.shape[0], k_p.shape[2]
    bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
    half_q, half_d = bq // NUM_CONSUMERS, st.head_dim // NUM_CONSUMERS
    scratch = dict(
        k_smem=smem_tiles(st, NUM_CONSUMERS, bkv, half_d),
        v_smem=smem_tiles(st, NUM_CONSUMERS, bkv, half_d),
        q_smem=smem_tiles(st, stages, NUM_CONSUMERS, NUM_CONSUMERS, half_q, half_d),
        do_smem=smem_tiles(st, stages, NUM_CONSUMERS, NUM_CONSUMERS, half_q, half_d),
        stats_smem=plgpu.SMEM((stages, 2, NUM_CONSUMERS, half_q), jnp.float32),
        pt_smem=smem_tiles(st, stages, NUM_CONSUMERS, bkv, half_q),
        dst_smem=smem_tiles(st, stages, NUM_CONSUMERS, bkv, half_q),
        k_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        v_ready=plgpu.Barrier(num_barriers=NUM_CONSUMERS),
        # One TMA arrival per copy: Q and dO in four quarters each; lse, delta (and the
        # rows' ids) in two halves each, on Q's barrier.
        q_ready=plgpu.Barrier(num_arrivals=NUM_CONSUMERS ** 2 + NUM_CONSUMERS
                              * (2 + st.segmented), num_barriers=stages),
        do_ready=plgpu.Barrier(num_arrivals=NUM_CONSUMERS ** 2, num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
        exchanged=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    )
    if st.segmented:
        scratch["q_ids_smem"] = plgpu.SMEM((stages, NUM_CONSUMERS, half_q), jnp.int32)
    return plgpu.kernel(
        functools.partial(_dkdv_kernel, st=st),
        out_type=(kernel_output(k_p.shape, q_p.dtype, q_p),) * 2,
        scratch_types=scratch,
        grid=(kv_heads, st.num_tiles, batch),
        grid_names=("heads", "kv_tiles", "batch"),
        **kernel_params(interpret),
    )(*operands)

"""The deterministic dQ kernel: one CTA per ``2·block_q`` query rows of one head.

FlashAttention-2, Algorithm 2, transposed to own query rows: each consumer warpgroup keeps
Q_i, dO_i, lse_i and delta_i of its ``block_q`` rows in SMEM / registers and dQ_i in
registers, and the producer streams (K_j, V_j) for every key block j the rows see::

    S = Q_i·K_jᵀ   P = exp2(S·scale·log2e − lse_i)   dP = dO_i·V_jᵀ
    dS = P ∘ (dP − delta_i)                           dQ_i += dS·K_j

Every dQ tile is written by exactly one CTA, so the result is bitwise reproducible. The
price is recomputing S and dP next to the dK/dV kernel: seven GEMMs instead of five.
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
from pallas_flash.mosaic.tiles import a_operand, row


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: BackwardStatic,
               q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, q_ready, do_ready,
               lse_ready, delta_ready, k_ready, v_ready, free, kv_ids_smem=None,
               a_smem=None, bias_smem=None, mask_smem=None):
    """One CTA: query rows ``[2·block_q·tile, +2·block_q)`` of one head.

    GMEM refs as in the dK/dV kernel (:mod:`.dkdv`); ``refs`` = (q_ids [B, Tq], kv_ids
    [B, Tk], spans [B, 2, Tq / block_q] int32 with ``st.segmented``;) dq [B, Tq, N, D].
    SMEM: q/do [2, block_q, D] and lse/delta [2, block_q] (one per consumer), k/v
    [stages, block_kv, D]; with segment ids kv_ids_smem [stages, block_kv] int32 (the keys'
    ids, on K's ready barrier: one more TMA arrival); a_smem [2, block_q, block_kv]
    (interpret mode only).
    """
    (q_ids_ref, kv_ids_ref, spans_ref), logit_refs, (dq_ref,) = unpack_refs(st, refs)
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
        return owned_ranges(st, band, spans_ref, batch, q_tile_idx * NUM_CONSUMERS + c)

    cta_first, cta_last = cta_range(
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
        load_logit_slots(st, logit_refs, rings, s, k_ready.at[s], batch=batch, head=head,
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
        wait_all((q_ready, do_ready, lse_ready, delta_ready), wg)
        lse2 = plgpu.load(lse_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        owned_parts = owned_logit_parts(st, logit_refs, batch=batch, head=head,
                                         owned=pl.ds(q0, bq))

        c = _Consumer(st, wg, slot, q0, q_tile, do_tile, q_ids, lse2, delta, owned_parts,
                      a_tile, rings, k_smem, v_smem, kv_ids_smem, k_ready, v_ready, free)

        def accumulate(dq_acc):
            walk(st, functools.partial(_step, c, dq_acc), functools.partial(_skip, c),
                 (cta_first, cta_last), ranges, 0)
            return dq_acc[...]

        dq = pl.run_scoped(accumulate, plgpu.ACC((bq, st.head_dim), jnp.float32))
        q_tile[...] = (dq * st.scale).astype(st.dtype)  # Q is dead: dQ leaves through its tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    warp_specialized(st, free, cta_last - cta_first, load, consume,
                      per_consumer_copies=False)


class _Consumer(NamedTuple):
    """What a dQ consumer's steps read: its rows' tiles and values (``q0`` its first row;
    ``q_ids``, ``lse2``, ``delta`` laid out as the rows of S), the key ring and its
    barriers, the bias / mask readers' per-row parts and rings."""

    st: BackwardStatic
    wg: int
    slot: Any
    q0: Any
    q_tile: Any
    do_tile: Any
    q_ids: Any
    lse2: Any
    delta: Any
    owned_parts: Any
    a_tile: Any
    rings: Any
    k_smem: Any
    v_smem: Any
    kv_ids_smem: Any
    k_ready: Any
    v_ready: Any
    free: Any


def _step(c: _Consumer, dq_acc, j, carry, *, masked: bool):
    """Key block j: dQ_i += dS·K_j."""
    st = c.st
    shape = (st.block_q, st.block_kv)
    s = c.slot(j)
    wait_all((c.k_ready, c.v_ready), s)
    k_tile, v_tile = c.k_smem.at[s], c.v_smem.at[s]
    kv_ids = None
    if st.segmented:  # read before the slot is freed (the producer refills it)
        kv_ids = plgpu.load(c.kv_ids_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0))
    bias, mask = logit_tiles(st, c.owned_parts, c.rings, s, c.wg, shape)

    def gemms(s_acc, dp_acc):
        plgpu.wgmma(s_acc, c.q_tile, k_tile.T)
        plgpu.wgmma(dp_acc, c.do_tile, v_tile.T)
        # S is ready once at most the dP GEMM is in flight: P overlaps it.
        scores = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
        visible = None
        if masked:
            visible = visible_tile(st.mask, shape, c.q0, j * st.block_kv, q_ids=c.q_ids,
                                   kv_ids=kv_ids, mask_tile=mask)
        p, slope = probabilities(st, scores, row(c.lse2, shape), visible, bias)
        dp = plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
        ds = raw_score_gradient(p * (dp - row(c.delta, shape)), slope)
        plgpu.wgmma(dq_acc, a_operand(ds.astype(st.dtype), c.a_tile), k_tile)
        plgpu.wgmma_wait(0)  # K_j is read: the slot may be refilled

    pl.run_scoped(gemms, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
    plgpu.barrier_arrive(c.free.at[s])
    return carry


def _skip(c: _Consumer, j, carry):
    """A block only the other consumer needs: same barriers, no math."""
    s = c.slot(j)
    wait_all((c.k_ready, c.v_ready), s)
    plgpu.barrier_arrive(c.free.at[s])
    return carry


def call_dq(st: BackwardStatic, operands, *, interpret: bool):
    """dQ [B, Tq_pad, N, D_pad]: one CTA per 2·dq_block_q query rows of one head."""
    q_p = operands[0]
    batch, heads = q_p.shape[0], q_p.shape[2]
    bq, bkv, d, stages = st.block_q, st.block_kv, st.head_dim, st.num_stages
    scratch = dict(
        q_smem=smem_tiles(st, NUM_CONSUMERS, bq, d), do_smem=smem_tiles(st, NUM_CONSUMERS, bq, d),
        lse_smem=plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
        delta_smem=plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
        k_smem=smem_tiles(st, stages, bkv, d), v_smem=smem_tiles(st, stages, bkv, d),
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
    scratch.update(logit_scratch(st, owned=bq, walked=bkv))
    if interpret:
        scratch["a_smem"] = smem_tiles(st, NUM_CONSUMERS, bq, bkv)
    return plgpu.kernel(
        functools.partial(_dq_kernel, st=st),
        out_type=kernel_output(q_p.shape, q_p.dtype, q_p),
        scratch_types=scratch,
        grid=(heads, st.num_tiles, batch),
        grid_names=("heads", "q_tiles", "batch"),
        **kernel_params(interpret),
    )(*operands)

"""FlashAttention-3's dQ path (``hopper/`` mainloop_bwd) as a dK/dV kernel dQ mode
(``MosaicBackwardConfig.bulk_dq``), on the inline-PTX primitives of :mod:`..ptx`.

Per step, as in the fused dQ of :mod:`.dq_modes`, each consumer publishes dSᵀ of the
streamed query block in SMEM, and dQ of the step is ``Σ dS·K`` over both consumers' keys,
shared as there: at head_dim 128 consumer c adds columns ``[c·D/2, (c+1)·D/2)``, otherwise
the consumer that owns the step's ring slot adds the whole tile. What differs is FA3's:

* the hand-off: both consumers meet at a named barrier (``bar.sync``, FA3's ``PdS``)
  once their dSᵀ are in SMEM, instead of arriving at and waiting on a per-slot mbarrier;
  a second one (instead of the ``dq_done`` mbarrier) keeps each K tile until the other
  consumer's last dQ GEMM has read it;
* the staging: the consumer's float32 dQ accumulator goes to SMEM in register order
  (:func:`~pallas_flash.mosaic.ptx.store_fragment`: no relayout, no swizzle), and ONE
  non-tensor bulk reduce-add (:func:`~pallas_flash.mosaic.ptx.bulk_reduce_add`) adds that
  contiguous buffer into the dQ accumulator in GMEM, with commit and wait;
* the accumulator: float32 ``[B, N, q_blocks, parts, block_q · columns]``, each tile in
  the same register order (``parts``: 2 column halves, or 1 whole tile), which
  :func:`convert_dq` (FA3's ``convert_dQ`` kernel, here in XLA) turns into
  ``[B, T, N, D]`` and scales once.

Interpret mode runs the PTX's plain-Pallas paths (a synchronous read-add-write of GMEM)
and needs the named barriers modelled (:func:`kernel_interpret_params`). Its race detector
does not order one CTA's GMEM writes before the next CTA's, so there the accumulator has a
leading axis of key tiles, each CTA adding into its own (no two warpgroups of a CTA add
into the same elements), summed by :func:`convert_dq`.
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

from pallas_flash.mosaic import ptx
from pallas_flash.mosaic.backward.common import BackwardStatic, QueryStream, smem_tiles
from pallas_flash.mosaic.config import NUM_CONSUMERS, splits_dq

#: Head dims up to which K and V stay in registers (as the fused dQ, for the same reason:
#: the Sᵀ and dPᵀ wgmmas then read only B from SMEM).
_RESIDENT_MAX_HEAD_DIM = 64
# Warpgroups of the dK/dV kernel (two consumers, one producer) and the threads that meet
# at the consumers' named barriers.
_WARPGROUPS = NUM_CONSUMERS + 1
_CONSUMER_THREADS = NUM_CONSUMERS * 128
# The named barriers: both dSᵀ of a step are in SMEM; neither consumer reads the other's
# K tile again.
_EXCHANGED, _DQ_DONE = ptx.barrier_ids(_WARPGROUPS, 2)


def _parts(st: BackwardStatic) -> int:
    """Column parts of a dQ tile: one per consumer where halves are whole swizzle widths
    of K (:func:`~pallas_flash.mosaic.config.splits_dq`), else one."""
    return NUM_CONSUMERS if splits_dq(st.head_dim, st.dtype.itemsize) else 1


def _columns(st: BackwardStatic) -> int:
    return st.head_dim // _parts(st)


def accumulator_shape(st: BackwardStatic, q_shape) -> tuple[int, ...]:
    """The float32 dQ accumulator of ``q_shape = [B, T_pad, N, D_pad]``:
    ``[B, N, T_pad / block_q, parts, block_q · columns]``, each tile in register order
    (interpret mode: ``[key tiles, B, ...]``, one per CTA)."""
    batch, seq, heads, _ = q_shape
    per_cta = (st.num_tiles,) if st.interpret else ()
    return (*per_cta, batch, heads, seq // st.block_q, _parts(st), st.block_q * _columns(st))


def convert_dq(st: BackwardStatic, acc: jax.Array, dtype) -> jax.Array:
    """FA3's ``convert_dQ``: the accumulator ``[B, N, q_blocks, parts, block_q · columns]``
    (:func:`accumulator_shape`; summed over its key tiles in interpret mode) as
    ``dq: [B, T_pad, N, D_pad]`` in ``dtype``, scaled by the softmax scale (the kernel adds
    unscaled dS·K, as for dK)."""
    if st.interpret:
        acc = acc.sum(0)
    batch, heads, blocks, parts, size = acc.shape
    tile = (st.block_q, _columns(st))
    tiles = jax.vmap(functools.partial(ptx.from_fragment_order, shape=tile))(
        acc.reshape(-1, size))
    tiles = tiles.reshape(batch, heads, blocks, parts, *tile)
    dq = tiles.transpose(0, 2, 4, 1, 3, 5).reshape(batch, blocks * tile[0], heads,
                                                   parts * tile[1])
    return (dq * st.scale).astype(dtype)


def kernel_interpret_params(st: BackwardStatic):
    """The dK/dV kernel's ``interpret=`` in interpret mode: the named barriers modelled."""
    return ptx.interpret_params(_WARPGROUPS) if st.interpret else None


@dataclasses.dataclass(frozen=True)
class BulkDqRefs:
    """A dK/dV CTA's refs of the bulk dQ."""

    dq: Any  # GMEM float32 accumulator (accumulator_shape), zeroed
    k_smem: Any  # both consumers' K tiles [2, block_kv, D]: dS·K reads them
    ds_smem: Any  # [stages, 2, block_kv, block_q]: each consumer's dSᵀ of a step
    dq_smem: Any  # [2, block_q · columns] float32: each consumer's register-order staging
    batch: jax.Array
    kv_tile: jax.Array


@dataclasses.dataclass(frozen=True)
class BulkDq:
    """FA3's dQ path for consumer ``wg``; the hooks are those of the modes in
    :mod:`.dq_modes` (``step``: their ``Step``, with ``i``, ``head`` and ``slot``)."""

    st: BackwardStatic
    wg: int
    refs: BulkDqRefs
    stream: QueryStream

    @property
    def resident_kv(self) -> bool:
        return self.st.head_dim <= _RESIDENT_MAX_HEAD_DIM

    @classmethod
    def scratch(cls, st: BackwardStatic) -> dict:
        """The SMEM fields of :class:`BulkDqRefs` (the staging tiles are flat: no swizzle)."""
        bq, bkv = st.block_q, st.block_kv
        return dict(
            ds_smem=smem_tiles(st, st.num_stages, NUM_CONSUMERS, bkv, bq),
            dq_smem=plgpu.SMEM((NUM_CONSUMERS, bq * _columns(st)), jnp.float32))

    @property
    def split(self) -> bool:
        return _parts(self.st) == NUM_CONSUMERS

    def exchange(self, slot, ds_t) -> None:
        """This consumer's dSᵀ into the step's slot, then both consumers meet: both dSᵀ
        of the step are in SMEM. (Two slots suffice: a consumer writes slot s again two
        steps later, after the other has passed the barrier of the step in between, hence
        finished its dQ GEMM on slot s.)"""
        self.refs.ds_smem.at[slot, self.wg][...] = ds_t
        plgpu.commit_smem()  # visible to the other consumer's wgmma (async proxy)
        ptx.bar_sync(_EXCHANGED, _CONSUMER_THREADS)

    def add(self, step) -> None:
        """This consumer's share of the step's dS·K: staged in register order and added
        to the accumulator by one bulk reduce-add."""
        st, refs = self.st, self.refs
        columns = _columns(st)
        part = self.wg if self.split else 0
        cols = pl.ds(part * columns, columns)

        def gemm(acc):
            for c in range(NUM_CONSUMERS):  # A: dS, the transposed view of dSᵀ
                plgpu.wgmma(acc, refs.ds_smem.at[step.slot, c].T, refs.k_smem.at[c, :, cols])
            return plgpu.wgmma_accumulator_load(acc, wait_n=0)

        dq = pl.run_scoped(gemm, plgpu.ACC((st.block_q, columns), jnp.float32))
        staging = refs.dq_smem.at[self.wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last bulk add read it
        ptx.store_fragment(dq, staging, interpret=st.interpret)
        plgpu.commit_smem()  # the bulk copy reads it through the async proxy
        dq_acc = refs.dq.at[refs.kv_tile] if st.interpret else refs.dq
        ptx.bulk_reduce_add(staging, dq_acc.at[refs.batch, step.head, step.i, part],
                            interpret=st.interpret)

    def share(self, step) -> None:
        """After the exchange: this consumer's share of the step's dQ, if it has one."""
        if self.split:
            self.add(step)
        else:
            pl.when(self.wg == lax.rem(step.slot, NUM_CONSUMERS))(
                functools.partial(self.add, step))

    def before_walk(self) -> None:
        pass

    def after_ds(self, step, ds_t, issue_dk) -> None:
        issue_dk()
        if not self.split:  # the slot's owner alone runs a GEMM that would retire dK's
            plgpu.wgmma_wait(0)  # Q_i and dO_i are read: the slot may be refilled
        self.exchange(step.slot, ds_t)
        self.share(step)  # its GEMM's wait retires dK's too

    def skipped(self, step) -> None:
        zeros = jnp.zeros((self.st.block_kv, self.st.block_q), self.st.dtype)
        self.exchange(step.slot, plgpu.layout_cast(zeros, plgpu.Layout.WGMMA))
        self.share(step)

    def after_walk(self) -> None:
        pass

    def before_epilogue(self) -> None:
        ptx.bar_sync(_DQ_DONE, _CONSUMER_THREADS)

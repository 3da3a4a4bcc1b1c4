"""The dK/dV kernel's dQ, one class per mode (``MosaicBackwardConfig.deterministic``).

* :class:`DeterministicDq` — no dQ in the dK/dV kernel: the dQ kernel (:mod:`.dq`)
  recomputes S and dP and writes every dQ tile once, bitwise reproducibly.
* :class:`FusedDq` — FA3's fused dQ: each consumer publishes dSᵀ of the streamed query
  block in SMEM, and once both are there (the ``exchanged`` barrier) the consumer that owns
  the step's ring slot adds dS·K over all the CTA's keys into a zeroed float32 dQ in GMEM,
  with one TMA reduce-add per step (half the staging stores and L2 traffic of each
  consumer adding its own). The order of the additions varies between runs.
* :class:`~.dq_bulk.BulkDq` (``MosaicBackwardConfig.bulk_dq``) — the fused dQ by FA3's
  path: register-order staging, one non-tensor bulk reduce-add per consumer, named
  barriers (:mod:`.dq_bulk`).
* :class:`SplitDq` — the fused dQ where a consumer's column half is whole 128-byte swizzle
  widths of K (:func:`~pallas_flash.mosaic.config.splits_dq`: head_dim 128): consumer c
  adds columns ``[c·D/2, (c+1)·D/2)`` with a [block_q, D/2] accumulator, one step late, so
  that one proxy fence serves both the dQ staging tile and the step's dSᵀ, and the exchange
  it waits for is one the other consumer finished a step ago.

The dK/dV consumer (:mod:`.dkdv`) calls a mode's hooks at fixed points of its walk:
``before_walk()``; per step either ``after_ds(step, ds_t, issue_dk)`` (dSᵀ of a computed
step is in registers; the hook issues dK += dSᵀ·Q_i with ``issue_dk`` and retires the
step's GEMMs) or ``skipped(step)`` (a block only the other consumer needs);
``after_walk()``; ``before_epilogue()`` (before dK and dV leave through the K/V tiles). It
reads ``resident_kv`` (K and V are loaded into registers once, as the A operands of Sᵀ
and dPᵀ).
:func:`dq_scratch` gives a mode's SMEM and barriers, :func:`dq_mode` one consumer's mode.

Interpret mode has no TMA reduce-add: there each consumer stores its partial sums per key
tile (``BackwardStatic.dq_partials``), and XLA adds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.mosaic.backward.common import BackwardStatic, QueryStream, smem_tiles
from pallas_flash.mosaic.backward.dq_bulk import BulkDq, BulkDqRefs
from pallas_flash.mosaic.config import NUM_CONSUMERS
from pallas_flash.mosaic.pipeline import ring_slot

#: Head dims up to which the fused dQ keeps K and V in registers (:attr:`FusedDq.resident_kv`).
_RESIDENT_MAX_HEAD_DIM = 64


class Step(NamedTuple):
    """One ring step of a dK/dV consumer: query block ``i`` of query head ``head``, in ring
    slot ``slot``; the step's index is ``head_step0 + i`` (:meth:`index`)."""

    i: jax.Array
    head: jax.Array
    head_step0: jax.Array
    slot: jax.Array

    def index(self) -> jax.Array:
        return self.head_step0 + self.i


@dataclasses.dataclass(frozen=True)
class FusedDqRefs:
    """A dK/dV CTA's refs of the fused dQ, and where its partial sums go."""

    dq: Any  # GMEM float32 [B, Tq, N, D], zeroed (interpret: [2·tiles, B, Tq, N, D])
    k_smem: Any  # both consumers' K tiles [2, block_kv, D]: dS·K reads them
    ds_smem: Any  # [stages, 2, block_kv, block_q]: each consumer's dSᵀ of a step
    dq_smem: Any  # [2, block_q, D or D/2] float32: each consumer's dQ staging tile
    exchanged: Any  # [stages] barriers, 2 arrivals: both dSᵀ of a step are in SMEM
    dq_done: Any  # 2 arrivals: neither consumer reads the other's K tile again
    batch: jax.Array
    kv_tile: jax.Array


@dataclasses.dataclass(frozen=True)
class DeterministicDq:
    """No dQ in the dK/dV kernel (the dQ kernel computes it)."""

    resident_kv: ClassVar[bool] = False

    def before_walk(self) -> None:
        pass

    def after_ds(self, step: Step, ds_t, issue_dk) -> None:
        del step, ds_t
        issue_dk()
        plgpu.wgmma_wait(0)  # Q_i and dO_i are read: the slot may be refilled

    def skipped(self, step: Step) -> None:
        del step

    def after_walk(self) -> None:
        pass

    def before_epilogue(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class FusedDq:
    """FA3's fused dQ, all columns of a step added by the consumer that owns its ring slot
    (``slot % 2``, so that each exchange barrier has one waiter, which sees all of its
    phases)."""

    st: BackwardStatic
    wg: int  # this consumer
    refs: FusedDqRefs
    stream: QueryStream

    @property
    def resident_kv(self) -> bool:
        """At head_dim 64, K and V in registers (16 per thread), so that the Sᵀ and dPᵀ
        wgmmas read only B from SMEM, which the float32 staging tile also needs; the
        deterministic mode keeps the SMEM tiles
        (measurements: docs/tuning.md#mosaic-backward-registers-and-per-consumer-code)."""
        return self.st.head_dim <= _RESIDENT_MAX_HEAD_DIM

    @classmethod
    def dq_columns(cls, st: BackwardStatic) -> int:
        return st.head_dim

    @classmethod
    def scratch(cls, st: BackwardStatic) -> dict:
        """The fields of :class:`FusedDqRefs` in SMEM."""
        bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
        return dict(
            ds_smem=smem_tiles(st, stages, NUM_CONSUMERS, bkv, bq),
            dq_smem=smem_tiles(st, NUM_CONSUMERS, bq, cls.dq_columns(st), dtype=jnp.float32),
            exchanged=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
            dq_done=plgpu.Barrier(num_arrivals=NUM_CONSUMERS))

    def rows(self, i, head):
        """Where query block i's dQ goes: the reduce-adds' target, or this consumer's
        partial sums (interpret mode)."""
        refs, rows = self.refs, pl.ds(i * self.st.block_q, self.st.block_q)
        if self.st.dq_partials:  # one partial sum per consumer of each key tile
            return refs.dq.at[refs.kv_tile * NUM_CONSUMERS + self.wg, refs.batch, rows, head]
        return refs.dq.at[refs.batch, rows, head]

    def publish(self, s, ds_t) -> None:
        """This consumer's dSᵀ into the step's exchange slot (the dQ GEMMs read it)."""
        self.refs.ds_smem.at[s, self.wg][...] = ds_t
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.refs.exchanged.at[s])

    def add(self, step: Step) -> None:
        """dS·K of the step over both consumers' keys, added once, by the slot's owner."""
        refs = self.refs

        @pl.when(self.wg == lax.rem(step.slot, NUM_CONSUMERS))
        def _add():
            plgpu.barrier_wait(refs.exchanged.at[step.slot])  # the other consumer's dSᵀ
            pairs = tuple((refs.ds_smem.at[step.slot, c], refs.k_smem.at[c])
                          for c in range(NUM_CONSUMERS))
            _reduce_dq(self.st, pairs, refs.dq_smem.at[self.wg], self.rows(step.i, step.head))

    def before_walk(self) -> None:
        pass

    def after_ds(self, step: Step, ds_t, issue_dk) -> None:
        self.publish(step.slot, ds_t)
        issue_dk()
        plgpu.wgmma_wait(0)  # Q_i and dO_i are read: the slot may be refilled
        self.add(step)  # once dK's GEMM has retired: its A operand is free

    def skipped(self, step: Step) -> None:
        self.publish(step.slot, _zero_tile(self.st))  # the step's share of dS·K is zero
        self.add(step)

    def after_walk(self) -> None:
        pass

    def before_epilogue(self) -> None:
        # The other consumer's last dQ GEMM has read this one's K tile.
        plgpu.barrier_arrive(self.refs.dq_done)
        plgpu.barrier_wait(self.refs.dq_done)


@dataclasses.dataclass(frozen=True)
class SplitDq(FusedDq):
    """The fused dQ split by columns: at step t each consumer adds its half of step t-1's
    dQ (``exchanged`` of step t-1, which both consumers passed a step ago), stages it and
    publishes step t's dSᵀ behind one proxy fence (two per step otherwise)."""

    @classmethod
    def dq_columns(cls, st: BackwardStatic) -> int:
        return st.head_dim // NUM_CONSUMERS

    @property
    def half(self):
        """This consumer's column half of dQ (and of K)."""
        width = self.st.head_dim // NUM_CONSUMERS
        return pl.ds(self.wg * width, width)

    def half_pairs(self, s):
        """(dSᵀ, K columns) of both consumers for this consumer's half of a dQ tile."""
        refs = self.refs
        return tuple((refs.ds_smem.at[s, c], refs.k_smem.at[c, :, self.half])
                     for c in range(NUM_CONSUMERS))

    def previous_slot(self, t):
        """The ring slot of step t-1 (for t = 0: of step -1, see before_walk)."""
        return ring_slot(t - 1 + self.st.num_stages, self.st.num_stages)

    def add_previous(self, step: Step, ds_t, issue_dk=None) -> None:
        """At ``step``: this consumer's half of the previous step's dQ, and the step's dSᵀ
        published. ``issue_dk``: issues dK += dSᵀ·Q_i first, so that it runs back to back
        with the dQ GEMM, whose wait retires the step's GEMMs (Q_i, dO_i are read)."""
        refs, dq_tile = self.refs, self.refs.dq_smem.at[self.wg]
        t, s = step.index(), step.slot
        s_prev = self.previous_slot(t)
        head_prev, i_prev = self.stream.before(step.head, step.i)
        if issue_dk is not None:
            issue_dk()
        plgpu.barrier_wait(refs.exchanged.at[s_prev])  # both dSᵀ of step t-1 are in SMEM
        dq = _dq_gemm(self.half_pairs(s_prev), dq_tile.shape)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read the tile
        dq_tile[...] = dq
        refs.ds_smem.at[s, self.wg][...] = ds_t
        plgpu.commit_smem()
        plgpu.barrier_arrive(refs.exchanged.at[s])

        @pl.when(t > 0)  # step -1's dQ is zero (see before_walk)
        def _add():
            _add_staged_dq(self.st, dq_tile, self.rows(i_prev, head_prev).at[:, self.half])

    def before_walk(self) -> None:
        # A zero dSᵀ in the slot of step -1, so that step 0 has a previous step to wait for.
        s_init = self.st.num_stages - 1
        self.refs.ds_smem.at[s_init, self.wg][...] = _zero_tile(self.st)
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.refs.exchanged.at[s_init])

    def after_ds(self, step: Step, ds_t, issue_dk) -> None:
        self.add_previous(step, ds_t, issue_dk)

    def skipped(self, step: Step) -> None:
        self.add_previous(step, _zero_tile(self.st))

    def after_walk(self) -> None:
        """This consumer's half of the last step's dQ."""
        stream, num_steps = self.stream, self.stream.num_steps()
        s_last = self.previous_slot(num_steps)
        head_last, i_last = stream.head(stream.group - 1), stream.last - 1
        plgpu.barrier_wait(self.refs.exchanged.at[s_last])

        @pl.when(num_steps > 0)
        def _add():
            _reduce_dq(self.st, self.half_pairs(s_last), self.refs.dq_smem.at[self.wg],
                       self.rows(i_last, head_last).at[:, self.half])


DqMode = DeterministicDq | FusedDq | BulkDq


def _fused_mode(st: BackwardStatic) -> type[FusedDq]:
    return SplitDq if st.split_dq else FusedDq


def dq_scratch(st: BackwardStatic) -> dict:
    """The SMEM and barriers of the kernel's dQ mode (none for the deterministic one)."""
    if st.bulk_dq:
        return BulkDq.scratch(st)
    return _fused_mode(st).scratch(st) if st.fuse_dq else {}


def dq_mode(st: BackwardStatic, wg: int, refs: FusedDqRefs | BulkDqRefs | None,
            stream: QueryStream) -> DqMode:
    """Consumer ``wg``'s dQ mode; ``refs``: None in the deterministic one."""
    if not st.fuse_dq:
        return DeterministicDq()
    if st.bulk_dq:
        return BulkDq(st, wg, refs, stream)
    return _fused_mode(st)(st, wg, refs, stream)


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

"""The consumer warpgroups' main loop machinery, shared by the bf16 and FP8 forwards.

FlashAttention-3, Sec. 3.1-3.2: the consumers *ping-pong* on the tensor cores (one
warpgroup's softmax runs while another's GEMMs execute), through ``turn`` mbarriers:

* the serial schedule (:class:`SerialTurns`): one 2-arrival barrier the two consumers meet
  at twice per block, consumer 1 one turn behind;
* the overlapped schedule (:class:`OverlappedTurns`, :func:`round_robin`): one
  single-arrival barrier per consumer, passed round robin; each step issues S_j and
  P_{j-1}·V_{j-1} together and runs the softmax of S_j under P·V
  (:func:`softmax_under_pv`).

A consumer that does not need a block of its CTA still takes its turns and releases the
ring slots (:func:`serial_skip_step`, :func:`overlapped_skip_step`), so that the ring and
the ping-pong stay in lockstep.

Interpret mode cannot run ``pl.run_state``: there P·V lands in a fresh accumulator that is
added to O (:func:`accumulate_pv`, :func:`softmax_under_pv`).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax


def sync(barrier) -> None:
    """Both consumers meet: arrive at the 2-arrival barrier and wait for the other."""
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


class SerialTurns:
    """The serial schedule's stagger, once per CTA (it carries over a persistent CTA's
    tiles): consumer 1 starts one turn late, so the two alternate on the tensor cores,
    and consumer 0 ends one late."""

    @staticmethod
    def begin(num_consumers: int, wg, turn) -> None:
        del num_consumers
        pl.when(wg == 1)(functools.partial(sync, turn))

    @staticmethod
    def end(num_consumers: int, wg, turn) -> None:
        del num_consumers
        pl.when(wg == 0)(functools.partial(sync, turn))


class OverlappedTurns:
    """The overlapped schedule's round robin, once per CTA: the last consumer hands
    consumer 0 the first turn, and consumer 0 takes the one the last consumer hands over
    at its last step."""

    @staticmethod
    def begin(num_consumers: int, wg, turn) -> None:
        pl.when(wg == num_consumers - 1)(lambda: plgpu.barrier_arrive(turn.at[0]))

    @staticmethod
    def end(num_consumers: int, wg, turn) -> None:
        del num_consumers
        pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))


def serial_skip_step(j, carry, *, slot, turn, k_free, v_ready, v_free, wait_k):
    """The serial schedule's step for block j when another row range of the CTA needs it
    and this one does not: the same barriers and turns as a real step, no math."""
    s = slot(j)
    sync(turn)
    plgpu.barrier_arrive(k_free.at[s])
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(v_ready.at[s])
    plgpu.barrier_wait(turn)
    wait_k(j + 1)
    plgpu.barrier_arrive(v_free.at[s])
    return carry


def softmax_under_pv(o, s_shape, gemms, results_like, *, interpret: bool):
    """One step of the overlapped schedule once the turn is taken: ``gemms(s_acc, pv_acc)``
    issues S_j ([s_shape] float32) and P_{j-1}·V_{j-1} (into ``pv_acc``) and returns what
    it computes while P·V runs (the softmax of S_j). Returns O + P·V and those results,
    after P·V's wait.

    ``results_like(zeros)``: arrays shaped as the results, given a zero S tile. On the GPU
    P·V accumulates into O's registers (``run_state``, whose exit waits for the GEMM:
    wgmma.wait_group 0); interpret mode cannot run ``run_state``, so there P·V lands in a
    fresh accumulator that is added to O.
    """
    if interpret:
        results, pv = pl.run_scoped(
            lambda s_acc, pv_acc: (gemms(s_acc, pv_acc), pv_acc[...]),
            plgpu.ACC(s_shape, jnp.float32), plgpu.ACC(o.shape, jnp.float32))
        return o + pv, results

    def body(refs):
        o_acc, s_acc, results = refs
        for ref, x in zip(results, gemms(s_acc, o_acc), strict=True):
            ref[...] = x
    zeros = plgpu.layout_cast(jnp.zeros(s_shape, jnp.float32), plgpu.Layout.WGMMA)
    o, _, results = pl.run_state(body)((
        plgpu.ACC.init(o), plgpu.ACC.init(zeros), results_like(zeros)))
    return o, results


def round_robin(turn, wg, num_consumers: int):
    """``(take_turn, pass_turn)`` of the overlapped schedule: ``turn`` holds one
    single-arrival mbarrier per consumer; a consumer waits on its own before issuing its
    GEMMs and arrives at the next consumer's after."""
    def take_turn():
        plgpu.barrier_wait(turn.at[wg])

    def pass_turn():
        plgpu.barrier_arrive(turn.at[lax.rem(wg + 1, num_consumers)])
    return take_turn, pass_turn


def head_scores(q_tile, k_tile, k_ready, turns) -> jax.Array:
    """S = Q·Kᵀ of a consumer's first visible block in the overlapped schedule (no P·V to
    issue with it yet): wait for K, take the turn, issue, pass the turn, wait for S."""
    take_turn, pass_turn = turns
    plgpu.barrier_wait(k_ready)
    take_turn()

    def qk(s_acc):
        plgpu.wgmma(s_acc, q_tile, k_tile.T)
        pass_turn()
        return s_acc[...]
    return pl.run_scoped(qk, plgpu.ACC((q_tile.shape[0], k_tile.shape[0]), jnp.float32))


def overlapped_skip_step(j, carry, *, slot, turns, k_ready, k_free, v_ready, v_free):
    """The overlapped schedule's step for block j when another consumer of the CTA needs
    it and this one does not: the same barriers and turn (``turns``: take, pass) as a
    real step, no math."""
    take_turn, pass_turn = turns
    s = slot(j)
    plgpu.barrier_wait(k_ready.at[s])
    take_turn()
    pass_turn()
    plgpu.barrier_arrive(k_free.at[s])
    plgpu.barrier_wait(v_ready.at[s])
    plgpu.barrier_arrive(v_free.at[s])
    return carry


def accumulate_pv(o, p, v_tile, during, *, interpret: bool):
    """O + P·V on the tensor cores, with ``during()`` issued while the GEMM runs.

    On the GPU P·V accumulates into O's registers (``run_state``, whose exit waits for the
    GEMM). Interpret mode cannot run ``run_state``: there P·V lands in a fresh accumulator
    that is added to O, the same arithmetic for a second [block_q, D] f32 accumulator.
    """
    if interpret:
        def fresh(pv_acc):
            plgpu.wgmma(pv_acc, p, v_tile)
            during()
            return pv_acc[...]
        return o + pl.run_scoped(fresh, plgpu.ACC(o.shape, jnp.float32))

    def gemm(o_acc):
        plgpu.wgmma(o_acc, p, v_tile)
        during()
    return pl.run_state(gemm)(plgpu.ACC.init(o))



"""The producer warpgroup's rings, shared by the Mosaic GPU kernels (forward and backward).

FlashAttention-3, Sec. 3.1 ("warp specialization"): one warpgroup only issues TMA copies of
K_j and V_j into a ``num_stages``-deep ring of SMEM slots. Each slot has a *ready* mbarrier
per tensor (arrived by the TMA engine, awaited by the consumers) and a *free* mbarrier per
tensor (arrived by every consumer once it no longer reads the slot, awaited here).

The ring is one stream per CTA: a persistent CTA (one that loops over several work tiles)
keeps filling it across its tiles, so the next tile's first blocks load while the
consumers finish the current one. Ring step ``g`` (counted from the CTA's first load) uses
slot ``g % num_stages`` (:func:`ring_slot`).

The backward kernels' rings (:func:`stream_steps`) carry one walked block per step (Q,
dO, lse and delta for dK/dV; K and V for dQ) with one free barrier per slot; they do
not persist across tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax


def ring_slot(step: jax.Array, num_stages: int) -> jax.Array:
    """The slot of ring step ``step`` (counted from the CTA's first load)."""
    return lax.rem(step, num_stages)


def block_slots(num_stages: int, ring_base, first) -> Callable[[jax.Array], jax.Array]:
    """``slot(j)``: the ring slot of K/V block j of a tile whose first block is ``first``,
    after ``ring_base`` ring steps of the CTA's earlier tiles."""
    def slot(j):
        return ring_slot(ring_base + j - first, num_stages)
    return slot


def stream_kv(*, num_stages: int, first: jax.Array, last: jax.Array,
              slot: Callable[[jax.Array], jax.Array], load_k: Callable[[jax.Array], None],
              load_v: Callable[[jax.Array], None], k_free, v_free,
              before_k_refill: Callable[[], None] | None = None,
              loaded_before: jax.Array | int = 0) -> None:
    """Loads K/V blocks ``[first, last)`` into the ring, each once.

    ``load_k(j)`` / ``load_v(j)`` issue the TMA copies of block j into ring slot
    ``slot(j)`` (on its ready barriers); ``k_free`` / ``v_free``: the slots' free barriers.
    ``loaded_before``: ring steps this CTA issued before block ``first`` (earlier tiles
    of a persistent CTA); the first ``num_stages`` steps of the CTA fill empty slots, every
    later one waits until the consumers freed its slot. ``before_k_refill``: runs once K's
    slot is free and before it is overwritten (e.g. a proxy fence after the consumers read
    the slot through the generic proxy). The caller ends with :func:`observe_releases`.
    """
    @pl.loop(first, last)
    def _load(j):
        refill = j - first + loaded_before >= num_stages

        # K is reloaded before V because the consumers free K_j first (right after
        # S = Q·K_jᵀ).
        @pl.when(refill)
        def _():
            plgpu.barrier_wait(k_free.at[slot(j)])
            if before_k_refill is not None:
                before_k_refill()
        load_k(j)
        pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot(j)]))
        load_v(j)


def observe_releases(*, num_stages: int, loaded: jax.Array | int, k_free, v_free) -> None:
    """Waits for the consumers' releases of the last ``num_stages`` of ``loaded`` ring steps.

    A thread that waits on an mbarrier must see every phase of it (the phase bit would
    otherwise be out of step; interpret mode checks), and :func:`stream_kv` waits only on
    the releases of the slots it refills.
    """
    @pl.loop(jnp.maximum(0, loaded - num_stages), loaded)
    def _drain(step):
        slot = ring_slot(step, num_stages)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])


def stream_steps(*, num_stages: int, num_steps: jax.Array, free,
                 load: Callable[[jax.Array], None],
                 before_refill: Callable[[], None] | None = None) -> None:
    """The backward kernels' producer loop: ``load(t)`` for ring steps ``0 .. num_steps-1``.

    Unlike :func:`stream_kv`, a step is one walked block of every tensor it carries, freed
    at once: ``free`` [num_stages] holds one barrier per slot, arrived by every consumer.
    ``load(t)`` issues step t's TMA copies into slot :func:`ring_slot` (t). The first
    ``num_stages`` steps fill empty slots; every later one waits until its slot is free,
    then runs ``before_refill`` (e.g. a proxy fence after the consumers read the slot
    through the generic proxy). The last releases are observed too: a thread that waits on
    an mbarrier must see every phase of it.
    """
    for t in range(num_stages):
        pl.when(t < num_steps)(functools.partial(load, jnp.int32(t)))

    @pl.loop(num_stages, num_steps)
    def _refill(t):
        plgpu.barrier_wait(free.at[ring_slot(t, num_stages)])
        if before_refill is not None:
            before_refill()
        load(t)

    @pl.loop(jnp.maximum(num_steps - num_stages, 0), num_steps)
    def _drain(t):
        plgpu.barrier_wait(free.at[ring_slot(t, num_stages)])

"""The producer warpgroup's K/V ring, shared by the Mosaic GPU forward kernels.

FlashAttention-3, Sec. 3.1 ("warp specialization"): one warpgroup only issues TMA copies of
K_j and V_j into a ``num_stages``-deep ring of SMEM slots. Each slot has a *ready* mbarrier
per tensor (arrived by the TMA engine, awaited by the consumers) and a *free* mbarrier per
tensor (arrived by every consumer once it no longer reads the slot, awaited here).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


def stream_kv(*, num_stages: int, first: jax.Array, last: jax.Array,
              slot: Callable[[jax.Array], jax.Array], load_k: Callable[[jax.Array], None],
              load_v: Callable[[jax.Array], None], k_free, v_free,
              before_k_refill: Callable[[], None] | None = None) -> None:
    """Loads K/V blocks ``[first, last)`` into the ring, each once.

    ``load_k(j)`` / ``load_v(j)`` issue the TMA copies of block j into ring slot
    ``slot(j)`` (on its ready barriers); ``k_free`` / ``v_free``: the slots' free barriers.
    ``before_k_refill``: runs once K's slot is free and before it is overwritten (e.g. a
    proxy fence after the consumers read the slot through the generic proxy).
    """
    # Prologue: fill the ring.
    for i in range(num_stages):
        @pl.when(first + i < last)
        def _fill(j=first + i):
            load_k(j)
            load_v(j)

    # Steady state: a slot is refilled once every consumer freed it. K is reloaded before V
    # because the consumers free K_j first (right after S = Q·K_jᵀ).
    @pl.loop(first + num_stages, last)
    def _refill(j):
        plgpu.barrier_wait(k_free.at[slot(j)])
        if before_k_refill is not None:
            before_k_refill()
        load_k(j)
        plgpu.barrier_wait(v_free.at[slot(j)])
        load_v(j)

    # Observe the last releases too: a thread that waits on an mbarrier must see every
    # phase of it (the phase bit would otherwise be out of step; interpret mode checks).
    @pl.loop(jnp.maximum(first, last - num_stages), last)
    def _drain(j):
        plgpu.barrier_wait(k_free.at[slot(j)])
        plgpu.barrier_wait(v_free.at[slot(j)])

"""Packed sequences in the Triton kernels: padded segment ids and per-tile id ranges.

A tile of S = Q·Kᵀ can hold a visible pair only if the id ranges of its query rows and key
columns overlap. The wrapper reduces the ids to one ``[min, max]`` per tile (in XLA, cheap);
the kernels test two scalars per tile and skip the whole tile — its loads and both matmuls —
when the ranges are disjoint. With documents packed in order, a query tile then only visits
the key tiles of its own documents, so attention over 8 packed documents costs about an
eighth of one long one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.padding import pad_axis

# Ids of padded rows/columns: they differ from each other, so padding never meets padding.
_PAD_Q, _PAD_KV = -1, -2


def segment_operands(segment_ids, padded_q: int, padded_kv: int, block_q: int,
                     block_kv: int) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """Kernel operands for packed sequences, for grids ordered (tile, batch, head).

    Returns ``[q_ids [B, Tp], kv_ids [B, Sp], q_ranges [B, 2, Tp/block_q],
    kv_ranges [B, 2, Sp/block_kv]]`` and their block specs (one batch row each).
    """
    q_ids, kv_ids = segment_ids
    q_ids, kv_ids = pad_axis(q_ids, 1, padded_q, _PAD_Q), pad_axis(kv_ids, 1, padded_kv, _PAD_KV)
    arrays = [q_ids, kv_ids, _tile_ranges(q_ids, block_q), _tile_ranges(kv_ids, block_kv)]
    return arrays, [_batch_row(x) for x in arrays]


def _tile_ranges(ids: jax.Array, block: int) -> jax.Array:
    """ids [B, L] (L a multiple of block) -> [B, 2, L / block]: per tile (min, max)."""
    tiles = ids.reshape(ids.shape[0], -1, block)
    return jnp.stack([tiles.min(axis=-1), tiles.max(axis=-1)], axis=1)


def _batch_row(x: jax.Array) -> pl.BlockSpec:
    rest = (0,) * (x.ndim - 1)
    return pl.BlockSpec((None, *x.shape[1:]), lambda tile, b, h: (b, *rest))


def skip_disjoint_tiles(step, q_range_ref, q_tile, kv_range_ref, *, kv_is_loop_index: bool):
    """Wraps a loop body ``step(index, carry)`` so it runs only on tiles whose ids can meet.

    ``q_tile`` is the fixed tile of the other operand; the loop index walks key tiles
    (``kv_is_loop_index``, forward and dQ) or query tiles (dK/dV).
    """
    def guarded(index, carry):
        i, j = (q_tile, index) if kv_is_loop_index else (index, q_tile)
        meet = ((q_range_ref[1, i] >= kv_range_ref[0, j])
                & (kv_range_ref[1, j] >= q_range_ref[0, i]))
        return lax.cond(meet, lambda c: step(index, c), lambda c: c, carry)

    return guarded

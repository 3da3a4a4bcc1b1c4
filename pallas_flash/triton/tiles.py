"""How the Triton kernels walk their tiles: mask-band ranges and packed-sequence skipping.

Every kernel loops over the tiles of one row (or column) of S = Q·Kᵀ that
``MaskSpec.kv_blocks`` / ``q_blocks`` name: tiles outside ``[first, last)`` are never
visited, tiles inside ``[full_first, full_last)`` run without mask arithmetic.

With packed sequences, a tile of S = Q·Kᵀ can hold a visible pair only if the id ranges of
its query rows and key columns overlap. The wrapper reduces the ids to one ``[min, max]``
per tile (in XLA, cheap); the kernels test two scalars per tile and skip the whole tile —
its loads and both matmuls — when the ranges are disjoint. With documents packed in order, a
query tile then only visits the key tiles of its own documents, so attention over 8 packed
documents should cost about an eighth of one long one (a prediction: not yet timed on a
GPU).
"""

from __future__ import annotations

import functools

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


def skip_disjoint_tiles(q_range_ref, kv_range_ref, fixed_tile, *, kv_is_loop_index: bool):
    """A guard for :func:`walk_tiles`: runs a step only on tiles whose ids can meet.

    ``fixed_tile`` is the program's own tile; the loop index walks key tiles
    (``kv_is_loop_index``: forward and dQ) or query tiles (dK/dV).
    """
    def guard(step):
        def guarded(index, carry):
            i, j = (fixed_tile, index) if kv_is_loop_index else (index, fixed_tile)
            meet = ((q_range_ref[1, i] >= kv_range_ref[0, j])
                    & (kv_range_ref[1, j] >= q_range_ref[0, i]))
            return lax.cond(meet, lambda c: step(index, c), lambda c: c, carry)

        return guarded

    return guard


def walk_tiles(step, ranges, carry, *, has_segments: bool, guard=None):
    """Runs ``step(index, carry, masked=...)`` over the tiles ``ranges`` names.

    ``ranges`` = (first, full_first, full_last, last) from the MaskSpec. With segment ids
    every tile needs the segment mask, and ``guard`` (from :func:`skip_disjoint_tiles`)
    skips tiles whose ids cannot meet.
    """
    first, full_first, full_last, last = ranges
    masked_step = functools.partial(step, masked=True)
    fast_step = functools.partial(step, masked=has_segments)
    if guard is not None:
        masked_step, fast_step = guard(masked_step), guard(fast_step)
    carry = lax.fori_loop(first, full_first, masked_step, carry)
    carry = lax.fori_loop(full_first, full_last, fast_step, carry)
    return lax.fori_loop(full_last, last, masked_step, carry)

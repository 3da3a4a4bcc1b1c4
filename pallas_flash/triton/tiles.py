"""How the Triton kernels walk their tiles: mask-band ranges and packed-sequence spans.

Every kernel loops over the tiles of one row (or column) of S = Q·Kᵀ that
``MaskSpec.kv_blocks`` / ``q_blocks`` name: tiles outside ``[first, last)`` are never
visited, tiles inside ``[full_first, full_last)`` run without mask arithmetic.

With packed sequences, a tile of S = Q·Kᵀ can hold a visible pair only if the id ranges of
its query rows and key columns overlap. The wrapper works out, in XLA and once per call,
each tile's *span*: the first and one-past-last tile on the other axis whose ids can meet
it. The kernels intersect their band with that span, so the loop never visits (never loads)
a tile outside it, and stays a plain counted loop that Triton software-pipelines. (An
earlier version tested every tile with a branch inside the loop; the branch stopped the
pipelining and 8 packed documents cost 0.48 of one long one instead of about an eighth.)
With documents packed in order the span is exact; with ids in any other order it is a
superset, and the segment mask inside the tile keeps the result exact.
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
                     block_kv: int, *, walk_kv: bool
                     ) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """Kernel operands for packed sequences, for grids ordered (tile, batch, head).

    ``walk_kv``: the kernel's loop walks key tiles (forward, dQ) rather than query tiles
    (dK/dV). Returns ``[q_ids [B, Tp], kv_ids [B, Sp], spans [B, 2, n]]`` and their block
    specs (one batch row each), where ``n`` counts the kernel's own tiles (query tiles when
    ``walk_kv``) and ``spans[b, :, i]`` is the ``(lo, hi)`` range of walked tiles whose ids
    can meet tile ``i``.
    """
    q_ids, kv_ids = segment_ids
    q_ids, kv_ids = pad_axis(q_ids, 1, padded_q, _PAD_Q), pad_axis(kv_ids, 1, padded_kv, _PAD_KV)
    q_lo, q_hi = _tile_id_range(q_ids, block_q)
    kv_lo, kv_hi = _tile_id_range(kv_ids, block_kv)
    # meet[b, i, j]: query tile i and key tile j hold ids that could be equal.
    meet = (q_hi[:, :, None] >= kv_lo[:, None, :]) & (kv_hi[:, None, :] >= q_lo[:, :, None])
    arrays = [q_ids, kv_ids, _spans(meet if walk_kv else jnp.swapaxes(meet, 1, 2))]
    return arrays, [_batch_row(x) for x in arrays]


def _tile_id_range(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """ids [B, L] (L a multiple of block) -> per tile (min, max), each [B, L / block]."""
    tiles = ids.reshape(ids.shape[0], -1, block)
    return tiles.min(axis=-1), tiles.max(axis=-1)


def _spans(meet: jax.Array) -> jax.Array:
    """meet [B, own, walked] -> [B, 2, own] int32: first and one-past-last walked tile that
    meets each own tile; (0, 0) when none does."""
    walked = meet.shape[-1]
    lo = jnp.argmax(meet, axis=-1)
    hi = walked - jnp.argmax(meet[..., ::-1], axis=-1)
    empty = ~jnp.any(meet, axis=-1)
    spans = jnp.stack([jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)], axis=1)
    return spans.astype(jnp.int32)


def _batch_row(x: jax.Array) -> pl.BlockSpec:
    rest = (0,) * (x.ndim - 1)
    return pl.BlockSpec((None, *x.shape[1:]), lambda tile, b, h: (b, *rest))


def walk_tiles(step, ranges, carry, *, span_ref=None, own_tile=None):
    """Runs ``step(index, carry, masked=...)`` over the tiles ``ranges`` names.

    ``ranges`` = (first, full_first, full_last, last) from the MaskSpec. With segment ids
    (``span_ref``: the ``spans`` operand of :func:`segment_operands`, ``own_tile``: the
    program's tile) the walk is cut to the span of tiles whose ids can meet, and every tile
    needs the segment mask.
    """
    first, full_first, full_last, last = ranges
    if span_ref is not None:
        start = jnp.maximum(first, span_ref[0, own_tile])
        stop = jnp.minimum(last, span_ref[1, own_tile])
        return lax.fori_loop(start, stop, functools.partial(step, masked=True), carry)
    masked_step = functools.partial(step, masked=True)
    carry = lax.fori_loop(first, full_first, masked_step, carry)
    carry = lax.fori_loop(full_first, full_last, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_last, last, masked_step, carry)

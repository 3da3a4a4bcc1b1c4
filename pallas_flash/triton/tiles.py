"""How the Triton kernels walk their tiles: mask-band ranges and packed-sequence spans.

Every kernel loops over the tiles of one row (or column) of S = Q·Kᵀ that
``MaskSpec.kv_blocks`` / ``q_blocks`` name: tiles outside ``[first, last)`` are never
visited, tiles inside ``[full_first, full_last)`` run without mask arithmetic.

With packed sequences the band is intersected with each tile's span
(:mod:`pallas_flash.segments`), so the loop stays a plain counted loop that Triton
software-pipelines. (An earlier version tested every tile with a branch inside the loop;
the branch stopped the pipelining and 8 packed documents cost 0.48 of one long one instead
of about an eighth.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.segments import pad_segment_ids, tile_spans


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
    q_ids, kv_ids = pad_segment_ids(segment_ids, padded_q, padded_kv)
    arrays = [q_ids, kv_ids, tile_spans(q_ids, kv_ids, block_q, block_kv, walk_kv=walk_kv)]
    return arrays, [_batch_row(x) for x in arrays]


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

"""How the Triton kernels walk their tiles: mask-band ranges, packed-sequence spans, and
the tiles of a bias / mask array.

Every kernel loops over the tiles of one row (or column) of S = Q·Kᵀ that
``MaskSpec.kv_blocks`` / ``q_blocks`` name: tiles outside ``[first, last)`` are never
visited, tiles inside ``[full_first, full_last)`` run without mask arithmetic.

With packed sequences the band is intersected with each tile's span
(:mod:`pallas_flash.segments`), so the loop stays a plain counted loop that Triton
software-pipelines; a branch inside the loop that tests each tile would stop the
pipelining. (measurements: docs/tuning.md#triton-packed-sequence-spans)

A ``bias`` / ``mask`` array keeps its broadcast dims at size 1 (pallas_flash.bias): its block
specs give those dims block size 1 and index 0 (the same element for every program, as a
stride-0 view would), and :func:`read_tile` reads a full dim in tiles and a size-1 dim
whole, so the kernels add a ``[block_q or 1, block_kv or 1]`` tile that broadcasts against
the logits. Nothing is expanded in HBM.

Row bounds (:class:`~pallas_flash.contract.RowBounds`) cut the walk the same way
(:func:`cut_to_bounds`): tiles wholly outside a sequence's bounds are never visited, tiles
wholly inside keep the unmasked range, and only the edge tiles test each row and column.
Rows outside the bounds may hold anything, NaN included (a stale cache), and a matmul
multiplies them by the zeros of P: the edge tiles select them to zero before any matmul
(:func:`zero_rows_outside`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_flash.bias import grouped
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis
from pallas_flash.segments import pad_segment_ids, tile_spans, uniform_spans


def segment_operands(segment_ids, padded_q: int, padded_kv: int, block_q: int,
                     block_kv: int, *, walk_kv: bool
                     ) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """Kernel operands for packed sequences, for grids ordered (tile, batch, head).

    ``walk_kv``: the kernel's loop walks key tiles (forward, dQ) rather than query tiles
    (dK/dV). Returns ``[q_ids [B, Tp], kv_ids [B, Sp], spans [B, 4, n]]`` and their block
    specs (one batch row each), where ``n`` counts the kernel's own tiles (query tiles when
    ``walk_kv``), ``spans[b, :2, i]`` is the ``(lo, hi)`` range of walked tiles whose ids
    can meet tile ``i`` (:func:`~pallas_flash.segments.tile_spans`) and ``spans[b, 2:, i]``
    the range of those that need no segment mask
    (:func:`~pallas_flash.segments.uniform_spans`).
    """
    q_ids, kv_ids = pad_segment_ids(segment_ids, padded_q, padded_kv)
    spans = jnp.concatenate(
        [tile_spans(q_ids, kv_ids, block_q, block_kv, walk_kv=walk_kv),
         uniform_spans(q_ids, kv_ids, block_q, block_kv, walk_kv=walk_kv)], axis=1)
    arrays = [q_ids, kv_ids, spans]
    return arrays, [_batch_row(x) for x in arrays]


def _batch_row(x: jax.Array) -> pl.BlockSpec:
    rest = (0,) * (x.ndim - 1)
    return pl.BlockSpec((None, *x.shape[1:]), lambda tile, b, h: (b, *rest))


def bounds_operand(bounds) -> tuple[jax.Array, pl.BlockSpec]:
    """A :class:`~pallas_flash.contract.RowBounds` as one kernel operand, for grids ordered
    (tile, batch, head): ``[B, 3]`` int32 rows ``(q_end, kv_start, kv_end)`` and its block
    spec (each program reads its sequence's row)."""
    x = jnp.stack([jnp.asarray(b, jnp.int32) for b in bounds], axis=1)
    return x, _batch_row(x)


_FAR = 1 << 30


def _div(a, b: int):
    """Floor division of non-negative traced indices (lax.div: Triton lowers it)."""
    return lax.div(a, jnp.asarray(b, a.dtype))


def cut_to_bounds(ranges, start, end, block: int, *, own_seen, own_whole):
    """``ranges`` (first, full_first, full_last, last) of a walk over tiles of ``block``
    rows, cut to the walked indices ``[start, end)`` (traced int32 scalars).

    ``own_seen``: the program's own tile holds a row or column inside its bounds (False:
    nothing to walk). ``own_whole``: every row or column of it is inside (False: every tile
    needs the bounds mask, so none is unmasked).
    """
    first, full_first, full_last, last = (jnp.asarray(x, jnp.int32) for x in ranges)
    # Clipped below 2**30 (past any tile) so that rounding up cannot overflow int32: a
    # bound of 2**31 - 1 stands for "none".
    start = jnp.clip(jnp.asarray(start, jnp.int32), 0, _FAR)
    end = jnp.clip(jnp.asarray(end, jnp.int32), start, _FAR)
    seen = own_seen & (end > start)
    first = jnp.maximum(first, _div(start, block))
    last = jnp.where(seen, jnp.maximum(first, jnp.minimum(last, _div(end + block - 1, block))),
                     first)
    full_first = jnp.clip(jnp.maximum(full_first, _div(start + block - 1, block)), first, last)
    full_last = jnp.clip(jnp.minimum(full_last, _div(end, block)), full_first, last)
    full_last = jnp.where(own_whole, full_last, full_first)
    return first, full_first, full_last, last


def zero_rows_outside(x, row_start, lo, hi):
    """The ``[rows, ...]`` tile ``x`` whose row ``i`` (index ``row_start + i``) is selected
    to 0 unless ``lo <= row_start + i < hi``: a select, so NaN there leaves no trace."""
    index = row_start + lax.broadcasted_iota(jnp.int32, (x.shape[0], 1), 0)
    return jnp.where((index >= lo) & (index < hi), x, jnp.zeros((), x.dtype))


def walk_tiles(step, ranges, carry, *, span_ref=None, own_tile=None,
               mask_every_tile: bool = False):
    """Runs ``step(index, carry, masked=...)`` over the tiles ``ranges`` names.

    ``ranges`` = (first, full_first, full_last, last) from the MaskSpec. With segment ids
    (``span_ref``: the ``spans`` operand of :func:`segment_operands`, ``own_tile``: the
    program's tile) the walk is cut to the span of tiles whose ids can meet, and only the
    tiles that are both fully inside the band and of one id run unmasked.
    ``mask_every_tile``: a mask array can hide pairs in any tile.
    """
    first, full_first, full_last, last = ranges
    masked_step = functools.partial(step, masked=True)
    if span_ref is not None:
        first = jnp.maximum(first, span_ref[0, own_tile])
        last = jnp.maximum(first, jnp.minimum(last, span_ref[1, own_tile]))
        full_first = jnp.clip(jnp.maximum(full_first, span_ref[2, own_tile]), first, last)
        full_last = jnp.clip(jnp.minimum(full_last, span_ref[3, own_tile]), full_first, last)
    if mask_every_tile:
        return lax.fori_loop(first, last, masked_step, carry)
    carry = lax.fori_loop(first, full_first, masked_step, carry)
    carry = lax.fori_loop(full_first, full_last, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_last, last, masked_step, carry)


def tile_visible(mask: MaskSpec, q_start, block_q: int, k_start, block_kv: int, q_seg,
                 kv_seg, mask_tile, bounds=None):
    """Visibility of a ``[block_q, block_kv]`` tile: the band, and where given the segment
    ids of its rows / columns, the tile of the mask array (int8, non-zero = visible) and
    the sequence's ``bounds`` (scalars ``(q_end, kv_start, kv_end)``)."""
    visible = mask.block_visible(q_start, block_q, k_start, block_kv)
    if bounds is not None:
        q_end, kv_start, kv_end = bounds
        rows = q_start + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        visible = visible & (rows < q_end) & (cols >= kv_start) & (cols < kv_end)
    if q_seg is not None:
        visible = visible & (q_seg[:, None] == kv_seg[None, :])
    if mask_tile is not None:
        visible = visible & (mask_tile != 0)
    return visible


def read_tile(ref, *, head=None, rows=None, cols=None):
    """A ``[rows or 1, cols or 1]`` tile of a bias / mask block (None for a None ref).

    ``rows`` / ``cols`` (``pl.ds``; None: the block's own rows) slice full dims only: a
    broadcast dim has size 1 in the block (blocks of full dims are >= 16) and is read
    whole. ``head`` indexes a leading head dim, or its single entry when it is broadcast.
    """
    if ref is None:
        return None
    index = () if head is None else (head if ref.shape[0] > 1 else 0,)
    for window, size in zip((rows, cols), ref.shape[-2:], strict=True):
        index += (window if window is not None and size > 1 else slice(None),)
    return ref[index]


def _padded(x, padded_q: int, padded_kv: int):
    """A canonical [B', N', T', S'] bias/mask padded to whole tiles along its full dims.
    Padded keys are hidden by the MaskSpec and padded rows discarded, so zeros do."""
    if x.shape[2] > 1:
        x = pad_axis(x, 2, padded_q)
    return x if x.shape[3] == 1 else pad_axis(x, 3, padded_kv)


def _broadcast_index(size: int, index):
    """Block index along a bias/mask dim: the program's own, or 0 for a broadcast dim."""
    return index if size > 1 else 0


def row_block_operand(x, padded_q: int, padded_kv: int, block_q: int, q_block_of):
    """A bias/mask operand for grids (query tile, batch, head): the forward and dQ kernels.

    ``x``: canonical ``[B', N', T', S']``. Each program sees ``[block_q or 1, padded_kv or
    1]``: its query rows (tile ``q_block_of(program)``) against every key.
    """
    x = _padded(x, padded_q, padded_kv)
    b, n, t, s = x.shape

    def index(i, batch, head):
        return (_broadcast_index(b, batch), _broadcast_index(n, head),
                _broadcast_index(t, q_block_of(i)), 0)

    return x, pl.BlockSpec((None, None, block_q if t > 1 else 1, s), index)


def column_block_operand(x, kv_heads: int, padded_q: int, padded_kv: int, block_kv: int):
    """A bias/mask operand for grids (key tile, batch, KV head): the dK/dV kernel.

    ``x``: canonical ``[B', N', T', S']``, viewed as ``[B', K', G', T', S']``. Each program
    sees ``[G or 1, padded_q or 1, block_kv or 1]``: the query heads of its GQA group, every
    query row, its key tile.
    """
    x = grouped(_padded(x, padded_q, padded_kv), kv_heads)
    b, k, g, t, s = x.shape

    def index(j, batch, head):
        return (_broadcast_index(b, batch), _broadcast_index(k, head), 0, 0,
                _broadcast_index(s, j))

    return x, pl.BlockSpec((None, None, g, t, block_kv if s > 1 else 1), index)

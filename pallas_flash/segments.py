"""Packed sequences: which tiles of S = Q·Kᵀ can hold a pair with equal segment ids.

Backend-neutral: the Triton kernels and the Mosaic GPU kernels use the same spans.

A tile of S = Q·Kᵀ can hold a visible pair only if the id ranges of its query rows and
key columns overlap. Each tile's *span* is the first and one-past-last tile on the other
axis whose ids can meet it; the wrapper computes the spans in XLA, once per call, and the
kernels intersect their mask band with them, so a tile outside the span is never visited
(never loaded) and the loop stays a plain counted loop. With documents packed in order the
span is exact; with ids in any other order it is a superset, and the segment mask inside
the tile keeps the result exact. :func:`uniform_spans` names, inside the span, the tiles of
one id: as a band's fully visible blocks, they need no mask (the Triton kernels use it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_flash.padding import pad_axis

# Ids of padded rows/columns: they differ from each other, so padding never meets padding.
_PAD_Q, _PAD_KV = -1, -2


def pad_segment_ids(segment_ids, padded_q: int, padded_kv: int
                    ) -> tuple[jax.Array, jax.Array]:
    """``(q_ids [B, Tq], kv_ids [B, Tk])`` -> the same padded to ``[B, padded_q]`` and
    ``[B, padded_kv]`` (whole tiles) with ids no real row or key has in common."""
    q_ids, kv_ids = segment_ids
    return pad_axis(q_ids, 1, padded_q, _PAD_Q), pad_axis(kv_ids, 1, padded_kv, _PAD_KV)


def tile_spans(q_ids: jax.Array, kv_ids: jax.Array, block_q: int, block_kv: int, *,
               walk_kv: bool) -> jax.Array:
    """Spans of the tiles a kernel walks, per tile it owns.

    Args:
      q_ids: ``[B, Tq]`` int32, ``Tq`` a multiple of ``block_q`` (see :func:`pad_segment_ids`).
      kv_ids: ``[B, Tk]`` int32, ``Tk`` a multiple of ``block_kv``.
      walk_kv: the kernel owns query tiles and walks key tiles (forward, dQ); otherwise it
        owns key tiles and walks query tiles (dK/dV).

    Returns:
      ``spans [B, 2, n]`` int32, ``n`` the number of owned tiles: ``spans[b, :, i]`` is the
      ``(lo, hi)`` range of walked tiles whose ids can meet owned tile ``i``; ``(0, 0)``
      when none can.
    """
    q_lo, q_hi = _tile_id_range(q_ids, block_q)
    kv_lo, kv_hi = _tile_id_range(kv_ids, block_kv)
    # meet[b, i, j]: query tile i and key tile j hold ids that could be equal.
    meet = (q_hi[:, :, None] >= kv_lo[:, None, :]) & (kv_hi[:, None, :] >= q_lo[:, :, None])
    return _spans(meet if walk_kv else jnp.swapaxes(meet, 1, 2))


def uniform_spans(q_ids: jax.Array, kv_ids: jax.Array, block_q: int, block_kv: int, *,
                  walk_kv: bool) -> jax.Array:
    """Per owned tile, the walked tiles that need no segment mask: every query row and key
    of the pair of tiles has one and the same id.

    As with a causal band's fully visible blocks, only the tiles at a span's edges then
    compare ids. With ``walk_kv`` the owned query tiles' padded rows are left out of the
    test. Rows are independent in the forward and in dQ, and a padded row's results are
    dropped. The dK/dV kernel sums over rows, so there padding keeps its tile masked.

    Args: as :func:`tile_spans`.

    Returns:
      ``[B, 2, n]`` int32: ``(lo, hi)`` of the walked tiles that share the owned tile's one
      id, when they are contiguous (they are for documents packed in order), else
      ``(0, 0)``; ``(0, 0)`` too when there are none.
    """
    q_lo, q_hi = _tile_id_range(q_ids, block_q, padding=_PAD_Q if walk_kv else None)
    kv_lo, kv_hi = _tile_id_range(kv_ids, block_kv)
    uniform = ((q_lo == q_hi)[:, :, None] & (kv_lo == kv_hi)[:, None, :]
               & (q_lo[:, :, None] == kv_lo[:, None, :]))
    uniform = uniform if walk_kv else jnp.swapaxes(uniform, 1, 2)
    spans = _spans(uniform)
    contiguous = jnp.sum(uniform, axis=-1) == spans[:, 1] - spans[:, 0]
    return jnp.where(contiguous[:, None], spans, 0)


def _tile_id_range(ids: jax.Array, block: int, padding: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """ids [B, L] (L a multiple of block) -> per tile (min, max), each [B, L / block];
    ``padding``: an id left out (a tile of nothing else gets min > max)."""
    tiles = ids.reshape(ids.shape[0], -1, block)
    if padding is None:
        return tiles.min(axis=-1), tiles.max(axis=-1)
    info = jnp.iinfo(ids.dtype)
    return (jnp.where(tiles == padding, info.max, tiles).min(axis=-1),
            jnp.where(tiles == padding, info.min, tiles).max(axis=-1))


def _spans(meet: jax.Array) -> jax.Array:
    """meet [B, own, walked] -> [B, 2, own] int32: first and one-past-last walked tile that
    meets each own tile; (0, 0) when none does."""
    walked = meet.shape[-1]
    lo = jnp.argmax(meet, axis=-1)
    hi = walked - jnp.argmax(meet[..., ::-1], axis=-1)
    empty = ~jnp.any(meet, axis=-1)
    spans = jnp.stack([jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)], axis=1)
    return spans.astype(jnp.int32)


def cut_to_span(ranges, lo, hi):
    """A ``MaskSpec`` block range cut to the span ``[lo, hi)`` of one owned tile.

    ``ranges``: ``(first, full_first, full_last, last)`` from ``MaskSpec.kv_blocks`` /
    ``q_blocks``; ``lo, hi``: that tile's entry of :func:`tile_spans`. Every block left
    compares ids, so it needs the mask: returns ``(first, last, last, last)``, empty
    (``first == last``) when the band and the span do not meet.
    """
    first = jnp.maximum(ranges[0], lo)
    last = jnp.maximum(first, jnp.minimum(ranges[3], hi))
    return first, last, last, last

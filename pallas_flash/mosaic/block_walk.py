"""Block visibility and the walk of one consumer over its CTA's blocks.

Block skipping comes from :class:`~pallas_flash.masking.MaskSpec` (``kv_blocks`` for the
forward and the dQ kernel, ``q_blocks`` for dK/dV): a consumer's walked blocks are
``(first, full_first, full_last, last)``. Blocks outside the CTA's ``[cta_first,
cta_last)`` are never loaded; inside it, blocks outside the consumer's ``[first, last)``
are stepped through without math (the ring and the ping-pong are shared by the CTA's
consumers), ``[full_first, full_last)`` runs the unmasked fast loop, and only the boundary
blocks build the mask tile (:func:`visible_tile`).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.tiles import col, row


def hull(a, b):
    """The smallest block range ``[first, last)`` holding ranges ``a`` and ``b``; an empty
    range (first == last) adds nothing, wherever it sits."""
    (a_first, a_last), (b_first, b_last) = a, b
    a_empty, b_empty = a_first == a_last, b_first == b_last
    first = jnp.where(a_empty, b_first, jnp.where(b_empty, a_first, jnp.minimum(a_first, b_first)))
    last = jnp.where(a_empty, b_last, jnp.where(b_empty, a_last, jnp.maximum(a_last, b_last)))
    return first, last

def visible_tile(mask: MaskSpec, shape: tuple[int, int], q_first, k_first, *,
                 keys_are_rows: bool = False, q_ids=None, kv_ids=None,
                 mask_tile=None) -> jax.Array:
    """The mask of a boundary tile (WGMMA layout): the pairs ``mask`` shows, with segment
    ids only those of one document, with a mask array only those it shows.

    ``q_first`` / ``k_first``: the tile's first query row and key; ``q_ids`` / ``kv_ids``:
    their segment ids laid out along the tile's query / key axis (None without segment
    ids); ``mask_tile``: the mask array's values for the tile (0 hides), or None.
    ``keys_are_rows``: the dK/dV kernel's transposed tiles (Sᵀ, keys along the rows).
    """
    def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)
    q_axis, k_axis = (1, 0) if keys_are_rows else (0, 1)
    visible = mask.visible(iota(q_axis) + q_first, iota(k_axis) + k_first)
    if q_ids is not None:  # ... and pairs of the same document
        spread = {0: row, 1: col}
        visible &= spread[q_axis](q_ids, shape) == spread[k_axis](kv_ids, shape)
    if mask_tile is not None:  # ... and pairs the mask array shows
        visible &= mask_tile != 0
    return visible


def walk(carry, ranges, *, cta_first, cta_last, step, skip_step, lower_band: bool = True,
         unmasked: bool = True, upper_mask: bool = True):
    """One consumer's walk over its CTA's blocks ``[cta_first, cta_last)``, in the order
    the producer loads them: ``skip_step(j, carry)`` outside its ``ranges`` (first,
    full_first, full_last, last), ``step(j, carry, masked=)`` inside. The flags say which
    loops can be non-empty (no window, segment ids or mask array: no block before
    ``full_first``; segment ids or a mask array: no unmasked block; no causal band, window
    or padded keys: no masked block after ``full_last``), so that empty ones are not
    emitted."""
    first, full_first, full_last, last = ranges
    masked_step = functools.partial(step, masked=True)
    if lower_band:
        carry = lax.fori_loop(cta_first, first, skip_step, carry)
        carry = lax.fori_loop(first, full_first, masked_step, carry)
    if unmasked:
        carry = lax.fori_loop(full_first, full_last, functools.partial(step, masked=False),
                              carry)  # the fast loop
    if upper_mask:
        carry = lax.fori_loop(full_last, last, masked_step, carry)
    return lax.fori_loop(last, cta_last, skip_step, carry)


def walk_overlapped(carry, ranges, *, cta_first, cta_last, head, step, last_pv, skip_step,
                     lower_band: bool, unmasked: bool, upper_mask: bool):
    """One consumer's walk over its CTA's blocks [cta_first, cta_last) in the overlapped
    schedule: ``skip_step`` for the blocks outside its ``ranges`` (first, full_first,
    full_last, last), ``head`` for its first visible block, ``step(j, carry, masked=)`` for
    the others (the loops the flags say can be non-empty), and ``last_pv(nonempty,
    carry)`` for the P·V of its last block (only the turn when it sees no block)."""
    first, full_first, full_last, last = ranges
    masked_step = functools.partial(step, masked=True)
    carry = lax.fori_loop(cta_first, first, skip_step, carry)
    nonempty = first < last
    carry = lax.cond(nonempty, head, lambda carry: carry, carry)
    after_head = first + 1
    if lower_band:
        carry = lax.fori_loop(after_head, full_first, masked_step, carry)
    if unmasked:
        carry = lax.fori_loop(jnp.maximum(after_head, full_first), full_last,
                              functools.partial(step, masked=False), carry)
    if upper_mask:
        carry = lax.fori_loop(jnp.maximum(after_head, full_last), last, masked_step, carry)
    return lax.fori_loop(last, cta_last, skip_step, last_pv(nonempty, carry))


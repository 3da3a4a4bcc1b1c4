"""Per-sequence row bounds (:class:`~pallas_flash.contract.RowBounds`) in the Mosaic GPU
kernels: their checks and the operand passes they need.

The forward cuts each consumer's KV blocks to ``[kv_start, kv_end)`` and clears its padding
rows in the epilogue (:mod:`.forward`). The backward takes the bounds as segment ids
(:func:`pallas_flash.contract.segment_ids_with_bounds`): its kernels then skip the blocks
outside the bounds, as for packed documents, but mask every block they visit.

A cut block still reads the hidden rows of K and V (and the backward those of padding
queries), where P = 0 does not hide a NaN (0·NaN = NaN): :func:`outside_zeroed` clears them
first, one pass over each operand it is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash.contract import RowBounds


def checked(bounds, batch: int) -> RowBounds:
    """``bounds``, if it is a RowBounds of int32 ``[batch]`` arrays; else ValueError naming
    the field and what it must be."""
    if not isinstance(bounds, RowBounds):
        raise ValueError(f"bounds must be a RowBounds or None, got {type(bounds).__name__}")
    for name, x in zip(RowBounds._fields, bounds, strict=True):
        if jnp.shape(x) != (batch,) or jnp.result_type(x) != jnp.int32:
            raise ValueError(f"bounds.{name} must be int32 of shape ({batch},), got "
                             f"{jnp.result_type(x)} {jnp.shape(x)}")
    return bounds


def _inside(bounds: RowBounds, length: int, *, keys: bool) -> jax.Array:
    """[batch, length] bool: the visible keys, or (``keys=False``) the real query rows."""
    positions = lax.broadcasted_iota(jnp.int32, (bounds.q_end.shape[0], length), 1)
    if keys:
        return (positions >= bounds.kv_start[:, None]) & (positions < bounds.kv_end[:, None])
    return positions < bounds.q_end[:, None]


def outside_zeroed(x: jax.Array, bounds: RowBounds, *, axis: int, keys: bool) -> jax.Array:
    """``x`` ([batch, ...], positions along ``axis``) with the hidden keys (``keys``) or
    the padding query rows set to 0."""
    inside = _inside(bounds, x.shape[axis], keys=keys)
    inside = lax.expand_dims(inside, [d for d in range(1, x.ndim) if d != axis])
    return jnp.where(inside, x, jnp.zeros((), x.dtype))

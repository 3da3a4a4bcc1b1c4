"""The ``bias`` and ``mask`` arrays: checks, canonical shape, and broadcasting helpers.

Both follow ``jax.nn.dot_product_attention``: arrays broadcastable to the logits'
``[batch, heads, seq_q, seq_kv]`` (``heads`` = query heads, also under GQA). ``bias`` is
added to the logits after scaling (and after soft-capping), ``mask`` is boolean, and
``False`` hides a pair; both combine with the causal / window / segment masks. Unlike
``jax.nn``, an integer mask is taken too, nonzero meaning visible (Keras passes 0/1 masks).

Every path keeps them in their *canonical* form: rank 4, each dimension either the full
size or 1 (a broadcast dimension). Kernels read the size-1 dimensions with a constant
index, so a ``[seq_q, seq_kv]`` bias shared by the whole batch is never expanded to
``[batch, heads, seq_q, seq_kv]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def canonical(x, name: str, logits_shape: tuple[int, int, int, int]):
    """``x`` as a rank-4 array whose dims are 1 or those of ``logits_shape``.

    Leading size-1 dims are added as in ``jax.nn`` (``[T, S]`` -> ``[1, 1, T, S]``). Raises
    ``ValueError`` naming ``name`` for a rank above 4 or a shape that does not broadcast.
    """
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) > 4:
        raise ValueError(
            f"{name} must be an array of rank <= 4 broadcastable to [batch, heads, seq_q, "
            f"seq_kv] = {logits_shape}, got shape {shape}")
    shape = (1,) * (4 - len(shape)) + tuple(shape)
    if any(n not in (1, full) for n, full in zip(shape, logits_shape, strict=True)):
        raise ValueError(
            f"{name} shape {x.shape} does not broadcast to [batch, heads, seq_q, seq_kv] = "
            f"{logits_shape}")
    return x.reshape(shape)  # NumPy stays NumPy (the float64 oracle)


def canonical_mask(mask: jax.Array | None, logits_shape: tuple[int, int, int, int]
                   ) -> jax.Array | None:
    """``mask`` (None, or boolean or integer, broadcastable to ``logits_shape`` =
    ``[batch, heads, seq_q, seq_kv]``) as a canonical boolean array (:func:`canonical`).

    An integer mask's nonzero entries are visible, as ``jnp.where`` reads it and as
    ``mask.astype(bool)`` converts it. A floating mask is refused with ``ValueError``: 0 /
    1 or 0 / -inf are both common there, so it is ambiguous.
    """
    if mask is None:
        return None
    dtype = getattr(mask, "dtype", None)
    if dtype is None or not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(
            "mask must be a boolean or integer array (True or nonzero = visible), got dtype "
            f"{dtype}: pass an additive mask as bias, or cast it (mask.astype(bool))")
    mask = canonical(mask, "mask", logits_shape)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def grouped(x: jax.Array, kv_heads: int) -> jax.Array:
    """Canonical ``[B', N', T', S']`` -> ``[B', K', G', T', S']``: query heads grouped by the
    KV head they share (GQA), as the kernels see them; a broadcast head dim stays 1, 1."""
    b, n, t, s = x.shape
    if n == 1:
        return x.reshape(b, 1, 1, t, s)
    return x.reshape(b, kv_heads, n // kv_heads, t, s)


def sum_to_shape(x, shape: tuple[int, ...]):
    """Sums ``x`` over the dims where ``shape`` is 1 and ``x`` is not (a broadcast's
    gradient). Same rank; NumPy and JAX arrays alike."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape, strict=True))
                 if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x

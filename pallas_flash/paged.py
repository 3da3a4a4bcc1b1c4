"""A paged KV cache: pages of a shared pool, addressed per sequence through a page table.

Layout: ``key_pages, value_pages: [num_pages, page_size, kv_heads, head_dim]``; sequence
``b``'s token at position ``p`` lives in page ``page_table[b, p // page_size]``, slot
``p % page_size``; ``cache_lengths[b]`` tokens are cached.

Reading (:func:`paged_attention`) is a documented fallback for now: the pages of every
sequence are gathered into a contiguous ``[batch, max_pages_per_seq · page_size, kv_heads,
head_dim]`` cache (one extra read and write of the addressed K/V, so about three times the
HBM traffic of a kernel that fetches pages through the table itself), then attended by
:func:`pallas_flash.decode.decode_attention` (``seq_q <= 16``) or, for longer query
chunks (chunked prefill), by :func:`pallas_flash.attention` with a per-row causal mask.

Page ids are not range-checked (they cannot be, inside ``jit``): an id outside
``[0, num_pages)`` is clamped into it on reads (the gather's ``mode="clip"``) and the write is
dropped by :func:`write_pages`. Table entries past a sequence's length are never attended,
whatever they hold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import dispatch
from pallas_flash.api import attention
from pallas_flash.arguments import Implementation, canonical_window
from pallas_flash.decode import MAX_DECODE_SEQ_Q, CacheVisibility, decode_attention

#: Page sizes the paged functions take (powers of two: the future kernel's tiles).
PAGE_SIZES = (8, 16, 32, 64, 128, 256)


def paged_attention(
    query: jax.Array,
    key_pages: jax.Array,
    value_pages: jax.Array,
    page_table: jax.Array,
    cache_lengths: jax.Array,
    *,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of new tokens to a paged KV cache that already holds them.

    Query ``t`` of sequence ``b`` is at position ``cache_lengths[b] - seq_q + t`` (the new
    tokens are the last ``seq_q`` cached, see :func:`write_pages`) and sees the cached keys
    up to its own position.

    Args:
      query: ``[batch, seq_q, heads, head_dim]``.
      key_pages: ``[num_pages, page_size, kv_heads, head_dim]``, same dtype as ``query``;
        ``page_size`` one of :data:`PAGE_SIZES`.
      value_pages: like ``key_pages``.
      page_table: ``[batch, max_pages_per_seq]`` int32 page ids.
      cache_lengths: ``[batch]`` integer tokens cached per sequence, at most
        ``max_pages_per_seq · page_size`` (checked when concrete).
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      local_window_size: ``w`` or ``(left, right)`` around each query's position.
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)``.
      sinks: ``[heads]`` logits joining each row's softmax denominator.
      return_lse: also return the lse.
      implementation: the per-chunk forward's backend, as :func:`pallas_flash.attention`.
      interpret: run Pallas kernels in interpret mode (CPU testing).

    Returns:
      ``out: [batch, seq_q, heads, head_dim]``, or ``(out, lse [batch, seq_q, heads])``.
    """
    _check_pages(key_pages, value_pages, page_table, cache_lengths)
    if getattr(query, "ndim", None) != 4 or query.shape[0] != page_table.shape[0]:
        raise ValueError(
            "query must have rank 4 [batch, seq_q, heads, head_dim] with the page_table's "
            f"batch {page_table.shape[0]}, got shape {getattr(query, 'shape', None)}")
    key, value = gather_pages(key_pages, page_table), gather_pages(value_pages, page_table)
    dispatch.check_arrays(query, key, value)
    lengths = cache_lengths.astype(jnp.int32)
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                   return_lse=return_lse, implementation=implementation,
                   interpret=interpret)
    seq_q = query.shape[1]
    if seq_q <= MAX_DECODE_SEQ_Q:
        return decode_attention(query, key, value, is_causal=True,
                                local_window_size=local_window_size,
                                key_value_seq_lengths=lengths, **options)
    # Chunked prefill: pallas_flash.attention's static bottom-right alignment would use the
    # gathered length, not each row's, so the causal band (and window) come as a mask array
    # [B, 1, T, S]; the lengths still let the kernels skip the tiles past each row's end.
    bands = CacheVisibility(seq_q=seq_q, group=1, is_causal=True,
                            window=canonical_window(local_window_size))
    visible = bands.token_visible(lengths, jnp.arange(key.shape[1], dtype=jnp.int32))
    return attention(query, key, value, mask=visible[:, None], key_value_seq_lengths=lengths,
                     **options)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """``pages [P, page_size, K, D]`` through ``page_table [B, M]`` -> the contiguous cache
    ``[B, M · page_size, K, D]`` (a copy); out-of-range ids are clamped."""
    batch, max_pages = page_table.shape
    gathered = jnp.take(pages, page_table, axis=0, mode="clip")  # [B, M, page, K, D]
    return gathered.reshape(batch, max_pages * pages.shape[1], *pages.shape[2:])


def write_pages(key_pages: jax.Array, value_pages: jax.Array, page_table: jax.Array,
                cache_lengths: jax.Array, new_key: jax.Array, new_value: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """Writes ``seq_new`` new tokens per sequence at positions ``cache_lengths[b] + t``.

    Jit-friendly (one scatter per pool). To update the pools in place, donate them:
    ``jax.jit(write_pages, donate_argnums=(0, 1))``; then call
    :func:`paged_attention` with ``cache_lengths + seq_new``.

    Args:
      key_pages, value_pages: ``[num_pages, page_size, kv_heads, head_dim]``.
      page_table: ``[batch, max_pages_per_seq]`` int32.
      cache_lengths: ``[batch]`` tokens cached before the write; ``cache_lengths +
        seq_new`` must fit the table (checked when concrete).
      new_key, new_value: ``[batch, seq_new, kv_heads, head_dim]``, the pools' dtype.

    Returns:
      The updated ``(key_pages, value_pages)``. A write through an out-of-range page id is
      dropped.
    """
    _check_pages(key_pages, value_pages, page_table, cache_lengths)
    batch, max_pages = page_table.shape
    page_size = key_pages.shape[1]
    expected = (batch, None, *key_pages.shape[2:])
    for name, x in (("new_key", new_key), ("new_value", new_value)):
        shape = getattr(x, "shape", None)
        if (shape is None or len(shape) != 4 or shape[0] != batch
                or shape[2:] != key_pages.shape[2:]):
            raise ValueError(f"{name} must have shape [batch, seq_new, kv_heads, head_dim] = "
                             f"{expected}, got {shape}")
        if x.dtype != key_pages.dtype:
            raise ValueError(f"{name} dtype must be the pages' {key_pages.dtype}, got {x.dtype}")
    if new_key.shape != new_value.shape:
        raise ValueError(f"new_key and new_value must have the same shape, got "
                         f"{new_key.shape} and {new_value.shape}")
    seq_new = new_key.shape[1]
    _check_capacity(cache_lengths + seq_new, max_pages * page_size, "cache_lengths + seq_new")
    positions = cache_lengths.astype(jnp.int32)[:, None] + jnp.arange(seq_new, dtype=jnp.int32)
    page_ids = jnp.take_along_axis(page_table, positions // page_size, axis=1, mode="clip")
    slots = positions % page_size
    return (key_pages.at[page_ids, slots].set(new_key, mode="drop"),
            value_pages.at[page_ids, slots].set(new_value, mode="drop"))


def _check_pages(key_pages, value_pages, page_table, cache_lengths) -> None:
    """ValueError naming the argument for a malformed pool, table or lengths."""
    for name, pages in (("key_pages", key_pages), ("value_pages", value_pages)):
        if getattr(pages, "ndim", None) != 4:
            raise ValueError(f"{name} must have rank 4 [num_pages, page_size, kv_heads, "
                             f"head_dim], got shape {getattr(pages, 'shape', None)}")
        if jnp.dtype(pages.dtype) not in dispatch.DTYPES:
            raise ValueError(
                f"{name} dtype must be one of bfloat16, float16, float32, got {pages.dtype}")
    if key_pages.shape != value_pages.shape or key_pages.dtype != value_pages.dtype:
        raise ValueError("key_pages and value_pages must have the same shape and dtype, got "
                         f"{key_pages.shape} {key_pages.dtype} and {value_pages.shape} "
                         f"{value_pages.dtype}")
    if key_pages.shape[1] not in PAGE_SIZES:
        raise ValueError(
            f"page_size (key_pages.shape[1]) must be one of {PAGE_SIZES}, got {key_pages.shape[1]}")
    if getattr(page_table, "ndim", None) != 2 or getattr(page_table, "dtype", None) != jnp.int32:
        raise ValueError("page_table must be an int32 array [batch, max_pages_per_seq], got "
                         f"shape {getattr(page_table, 'shape', None)} dtype "
                         f"{getattr(page_table, 'dtype', None)}")
    if min(page_table.shape) < 1:
        raise ValueError(f"page_table must not be empty, got shape {page_table.shape}")
    batch = page_table.shape[0]
    if getattr(cache_lengths, "shape", None) != (batch,) or not jnp.issubdtype(
            cache_lengths.dtype, jnp.integer):
        raise ValueError(f"cache_lengths must be an integer array [batch] = {(batch,)}, got "
                         f"shape {getattr(cache_lengths, 'shape', None)} dtype "
                         f"{getattr(cache_lengths, 'dtype', None)}")
    _check_capacity(cache_lengths, page_table.shape[1] * key_pages.shape[1], "cache_lengths")


def _check_capacity(lengths, capacity: int, name: str) -> None:
    """When ``lengths`` is concrete: every value in ``[0, capacity]``."""
    if isinstance(lengths, jax.core.Tracer):
        return
    concrete = np.asarray(lengths)  # numpy: jnp ops would trace under an outer jit
    low, high = int(concrete.min()), int(concrete.max())
    if low < 0 or high > capacity:
        raise ValueError(f"{name} must lie in [0, {capacity}] (max_pages_per_seq · page_size, "
                         f"what the page_table addresses), got values in [{low}, {high}]")

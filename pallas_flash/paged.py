"""A paged KV cache: pages of a shared pool, addressed per sequence through a page table.

Layout: ``key_pages, value_pages: [num_pages, page_size, kv_heads, head_dim]``; sequence
``b``'s token at position ``p`` lives in page ``page_table[b, p // page_size]``, slot
``p % page_size``; ``cache_lengths[b]`` tokens are cached.

Reading (:func:`paged_attention`): a decode step (``seq_q <= 16``) whose backend is Triton
(the decode default on GPUs, :func:`pallas_flash.dispatch.choose_decode`) with pages of at
least 16 tokens (:func:`pallas_flash.plan.reads_pages`) runs the split-KV decode straight
from the pages: the Triton forward reads each K/V tile from its page through the table
(:func:`pallas_flash.decode.paged_split_forward`). Every other call is a documented
fallback: the pages of every sequence are gathered into a contiguous ``[batch,
max_pages_per_seq · page_size, kv_heads, head_dim]`` cache (one extra read and write of
the addressed K/V, so about three times the HBM traffic), then attended by
:func:`pallas_flash.decode.decode_attention` (``seq_q <= 16``) or, for longer query chunks
(chunked prefill), by :func:`pallas_flash.attention` with a per-row causal mask. The
derivatives of the direct path (forward and reverse mode) are those of the gathered
formulation (they gather).

Page ids of a concrete ``page_table`` are checked: every entry that a sequence's tokens
use must lie in ``[0, num_pages)`` (``ValueError`` naming ``page_table``). A traced table
cannot be checked: an id outside the pool is clamped into it on reads (the gather's
``mode="clip"``) and the write is dropped by :func:`write_pages`. Table entries past a
sequence's length are never attended, whatever they hold (with concrete lengths they are not
checked either; with traced lengths, a concrete table's every entry is).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import dispatch
from pallas_flash.api import attention
from pallas_flash.arguments import (
    Implementation,
    canonical_scale,
    canonical_window,
    check_bools,
    check_concrete_range,
    check_deterministic,
    check_lengths,
    check_sinks,
    check_soft_cap,
)
from pallas_flash.autodiff import add_sinks
from pallas_flash.decode import (
    CacheVisibility,
    decode_attention,
    default_num_splits,
    jvp_of_differentiated,
    paged_split_forward,
)
from pallas_flash.plan import is_decode_step, reads_pages

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
    deterministic: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal attention of new tokens to a paged KV cache that already holds them.

    Query ``t`` of sequence ``b`` is at position ``cache_lengths[b] - seq_q + t`` (the new
    tokens are the last ``seq_q`` cached, see :func:`write_pages`) and sees the cached keys
    up to its own position. Later slots are hidden, whatever they hold (NaN or inf in a
    stale page reaches no output or gradient).

    Args:
      query: ``[batch, seq_q, heads, head_dim]``.
      key_pages: ``[num_pages, page_size, kv_heads, head_dim]``, same dtype as ``query``;
        ``page_size`` one of :data:`PAGE_SIZES`.
      value_pages: like ``key_pages``.
      page_table: ``[batch, max_pages_per_seq]`` int32 page ids, those the cached tokens
        use in ``[0, num_pages)`` (checked when concrete; traced ids are clamped into it).
      cache_lengths: ``[batch]`` integer tokens cached per sequence, at most
        ``max_pages_per_seq · page_size`` (checked when concrete; traced lengths cannot be,
        and are clamped into ``[0, max_pages_per_seq · page_size]``).
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      local_window_size: ``w`` or ``(left, right)`` around each query's position.
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)``.
      sinks: ``[heads]`` logits joining each row's softmax denominator.
      return_lse: also return the lse.
      deterministic: bitwise-reproducible gradients of the attention, as
        :func:`pallas_flash.attention`. The gradient of a page that several table entries
        name (a shared prefix, clamped out-of-range ids) is summed by XLA's scatter-add,
        reproducible only under ``XLA_FLAGS=--xla_gpu_deterministic_ops=true``.
      implementation: the per-chunk forward's backend, as :func:`pallas_flash.attention`.
      interpret: run Pallas kernels in interpret mode (CPU testing).

    Returns:
      ``out: [batch, seq_q, heads, head_dim]``, or ``(out, lse [batch, seq_q, heads])``.
    """
    _check_pools(key_pages, value_pages)
    if getattr(query, "ndim", None) != 4:
        raise ValueError("query must have rank 4 [batch, seq_q, heads, head_dim], got shape "
                         f"{getattr(query, 'shape', None)}")
    lengths = _check_table(page_table, cache_lengths, key_pages.shape, query.shape[0], "query")
    if query.shape[1] < 1:
        raise ValueError(f"query must hold at least one new token (seq_q >= 1), got shape "
                         f"{query.shape}")
    if query.dtype != key_pages.dtype:
        raise ValueError(f"query and key_pages / value_pages must share one dtype, got "
                         f"{query.dtype} and {key_pages.dtype}")
    if query.shape[3] != key_pages.shape[3]:
        raise ValueError(f"query's head_dim ({query.shape[3]}) must equal key_pages' "
                         f"({key_pages.shape[3]})")
    if query.shape[2] % key_pages.shape[2]:
        raise ValueError(f"query's heads ({query.shape[2]}) must be a multiple of key/value "
                         f"heads (key_pages' kv_heads, {key_pages.shape[2]})")
    # The contiguous cache's shape: what decode_attention checks against the query.
    cache = jax.ShapeDtypeStruct((page_table.shape[0], page_table.shape[1] * key_pages.shape[1],
                                  *key_pages.shape[2:]), key_pages.dtype)
    dispatch.check_arrays(query, cache, cache)
    check_bools(return_lse=return_lse)
    dispatch.check_implementation(implementation, interpret)
    deterministic = dispatch.deterministic_backward(check_deterministic(deterministic))
    seq_q = query.shape[1]
    if is_decode_step(seq_q) and reads_pages(query.shape, key_pages.shape, page_table.shape,
                                             query.dtype, implementation, interpret):
        head_dim = query.shape[3]
        direct = _DirectOptions(
            window=canonical_window(local_window_size),
            scale=float(canonical_scale(scale, head_dim)),
            softcap=check_soft_cap(logits_soft_cap), interpret=interpret,
            num_splits=_page_splits(page_table.shape, key_pages.shape),
            deterministic=deterministic)
        sinks = check_sinks(sinks, query.shape[2])
        out, lse = _paged_decode(query, key_pages, value_pages, page_table, lengths, direct)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        return (out, jnp.swapaxes(lse, 1, 2)) if return_lse else out
    key, value = gather_pages(key_pages, page_table), gather_pages(value_pages, page_table)
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
                   return_lse=return_lse, deterministic=deterministic,
                   implementation=implementation, interpret=interpret)
    if is_decode_step(seq_q):
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


#: What bounds a sequence's cached tokens, for the length checks' messages.
_ADDRESSED = "max_pages_per_seq · page_size, what the page_table addresses"

def _page_splits(table_shape, pages_shape) -> int:
    """The decode split count for this cache (:func:`default_num_splits` of the cache the
    table addresses; the splits are balanced per row, so a row's length leaves none idle)."""
    batch, max_pages = table_shape
    return default_num_splits(batch, pages_shape[2], max_pages * pages_shape[1])


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["window", "scale", "softcap", "interpret", "num_splits",
                                "deterministic"])
@dataclasses.dataclass(frozen=True)
class _DirectOptions:
    window: tuple[int, int] | None
    scale: float
    softcap: float | None
    interpret: bool
    num_splits: int
    deterministic: bool


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _paged_decode(query, key_pages, value_pages, page_table, lengths, options: _DirectOptions):
    """``(out [B, T, H, D], lse [B, H, T])`` of a decode step read from the pages in place."""
    return paged_split_forward(query, key_pages, value_pages, page_table, lengths,
                               window=options.window, scale=options.scale,
                               softcap=options.softcap, interpret=options.interpret,
                               num_splits=options.num_splits)


def _gathered_decode(query, key_pages, value_pages, page_table, lengths,
                     options: _DirectOptions):
    """The same function through the gathered cache: what differentiation goes through."""
    out, lse = decode_attention(
        query, gather_pages(key_pages, page_table), gather_pages(value_pages, page_table),
        is_causal=True, local_window_size=options.window, key_value_seq_lengths=lengths,
        scale=options.scale, logits_soft_cap=options.softcap, return_lse=True,
        deterministic=options.deterministic, interpret=options.interpret)
    return out, jnp.swapaxes(lse, 1, 2)


def _paged_decode_jvp(options, primals, tangents):
    # Differentiated, the call runs the gathered formulation, whose attention has forward-
    # and reverse-mode rules; undifferentiated, it reads the pages in place. The page table
    # and lengths are integers: no tangent.
    # Its primal too: the residuals of that formulation's backward are its own (out, lse),
    # so taking the value from the pages as well would run a second forward.
    page_table, lengths = primals[3:]
    return jvp_of_differentiated(
        lambda q, kp, vp: _gathered_decode(q, kp, vp, page_table, lengths, options),
        primals[:3], tangents[:3])


_paged_decode.defjvp(_paged_decode_jvp, symbolic_zeros=True)


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
      page_table: ``[batch, max_pages_per_seq]`` int32; the ids that the cached and new
        tokens use in ``[0, num_pages)`` (checked when concrete).
      cache_lengths: ``[batch]`` tokens cached before the write; ``cache_lengths +
        seq_new`` must fit the table (checked when concrete).
      new_key, new_value: ``[batch, seq_new, kv_heads, head_dim]``, the pools' dtype.

    Returns:
      The updated ``(key_pages, value_pages)``. A write through an out-of-range page id
      (negative, or past the pool) is dropped, and so is one to a position outside the
      table: possible only under ``jit``, where the table or ``cache_lengths`` cannot be
      checked.
    """
    _check_pools(key_pages, value_pages)
    expected = ("batch", "seq_new", *key_pages.shape[2:])
    for name, x in (("new_key", new_key), ("new_value", new_value)):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) != 4 or shape[2:] != key_pages.shape[2:]:
            raise ValueError(f"{name} must have shape [batch, seq_new, kv_heads, head_dim] = "
                             f"{expected}, got {shape}")
        if x.dtype != key_pages.dtype:
            raise ValueError(f"{name} dtype must be the pages' {key_pages.dtype}, got {x.dtype}")
    if new_key.shape != new_value.shape:
        raise ValueError(f"new_key and new_value must have the same shape, got "
                         f"{new_key.shape} and {new_value.shape}")
    seq_new = new_key.shape[1]
    _check_table(page_table, cache_lengths, key_pages.shape, new_key.shape[0], "new_key",
                 seq_new=seq_new)
    max_pages, page_size = page_table.shape[1], key_pages.shape[1]
    # Not clamp_lengths: a negative traced length would become 0 and write over cached
    # tokens. Positions outside the table are dropped below; this clip keeps them outside
    # and the int32 cast from wrapping (concrete lengths, checked, pass unchanged).
    starts = jnp.clip(jnp.asarray(cache_lengths), -seq_new, max_pages * page_size)
    positions = starts.astype(jnp.int32)[:, None] + jnp.arange(seq_new, dtype=jnp.int32)
    table_index = positions // page_size
    page_ids = jnp.take_along_axis(page_table, table_index, axis=1, mode="clip")
    # Dropped like an id past the pool: a negative id (which indexing would wrap to a page
    # from the end) and, under jit, a position outside the table (which the clipped lookup
    # would send to a real page, over tokens already cached).
    outside = (page_ids < 0) | (positions < 0) | (table_index >= max_pages)
    page_ids = jnp.where(outside, key_pages.shape[0], page_ids)
    slots = positions % page_size
    # jnp.asarray: NumPy pools (which paged_attention reads) have no .at.
    return (jnp.asarray(key_pages).at[page_ids, slots].set(new_key, mode="drop"),
            jnp.asarray(value_pages).at[page_ids, slots].set(new_value, mode="drop"))


def _check_pools(key_pages, value_pages) -> None:
    """ValueError naming the argument for a malformed page pool."""
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
    if key_pages.shape[0] < 1:
        raise ValueError(f"key_pages must hold at least one page, got shape {key_pages.shape}")
    if key_pages.shape[1] not in PAGE_SIZES:
        raise ValueError(
            f"page_size (key_pages.shape[1]) must be one of {PAGE_SIZES}, got {key_pages.shape[1]}")


def _check_table(page_table, cache_lengths, pages_shape: tuple, batch: int, batch_of: str, *,
                 seq_new: int = 0) -> jax.Array:
    """ValueError naming the argument for a malformed table or lengths, for ``batch``
    sequences (the batch of the array named ``batch_of``); ``seq_new`` tokens to be written
    after each row's ``cache_lengths``. Returns the lengths as int32 ``[batch]``."""
    if getattr(page_table, "ndim", None) != 2 or getattr(page_table, "dtype", None) != jnp.int32:
        raise ValueError("page_table must be an int32 array [batch, max_pages_per_seq], got "
                         f"shape {getattr(page_table, 'shape', None)} dtype "
                         f"{getattr(page_table, 'dtype', None)}")
    if min(page_table.shape) < 1:
        raise ValueError(f"page_table must not be empty, got shape {page_table.shape}")
    table_batch = page_table.shape[0]
    if table_batch != batch:
        if getattr(cache_lengths, "shape", None) == (table_batch,):  # the two agree
            raise ValueError(f"{batch_of} must have the batch of page_table and cache_lengths, "
                             f"{table_batch}, got {batch}")
        raise ValueError(f"page_table must have one row per sequence, {batch_of}'s batch "
                         f"{batch}, got shape {page_table.shape}")
    num_pages, page_size = pages_shape[:2]
    addressed = page_table.shape[1] * page_size
    lengths = check_lengths(cache_lengths, "cache_lengths", batch, addressed, _ADDRESSED)
    if seq_new:
        check_concrete_range(lengths + seq_new, "cache_lengths + seq_new", 0, addressed,
                             _ADDRESSED)
    _check_page_ids(page_table, num_pages, page_size, lengths + seq_new)
    return lengths


def _check_page_ids(page_table, num_pages: int, page_size: int, reach) -> None:
    """ValueError naming ``page_table`` for a concrete table whose entries that a row's
    first ``reach[b]`` tokens use (every entry where ``reach`` is traced) name no page of
    the pool. A traced table cannot be checked: its ids are clamped (reads) or dropped
    (writes), as documented."""
    if isinstance(page_table, jax.core.Tracer):
        return
    table = np.asarray(page_table)
    used = np.ones(table.shape, bool)
    if not isinstance(reach, jax.core.Tracer):
        # The entries past a row's tokens are never read: free ones may hold anything.
        used = np.arange(table.shape[1])[None, :] * page_size < np.asarray(reach)[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        row, entry = np.argwhere(bad)[0]
        raise ValueError(
            f"page_table ids must lie in [0, {num_pages}) (the pool holds {num_pages} pages, "
            f"key_pages.shape[0]), got {table[row, entry]} at [{row}, {entry}]")

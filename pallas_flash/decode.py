"""Attention of a few new tokens to a KV cache, composed from the main forward kernels.

Two ideas, each in one place:

* **GQA head packing** (:func:`_pack_queries`): the ``group = heads // kv_heads`` query
  heads of one kv head, times the ``seq_q`` new tokens, become the query rows of one plain
  multi-head call with ``kv_heads`` heads, so a kernel tile reads each K/V byte once for the
  whole group. Rows are ordered token-major (row ``t · group + g``).
* **Split-KV** (:func:`_split_forward`, :func:`merge_splits`): the cache is cut into
  ``num_splits`` chunks along the sequence, the chunks become extra batch entries
  (``[batch · num_splits, ...]``, a reshape, no copy when the split divides the cache), and
  the partial ``(out_i, lse_i)`` are merged exactly by their log-sum-exp. A short query on
  a long cache then keeps every SM busy (:func:`default_num_splits`).

Per-row positions. The cache of row ``b`` holds ``key_value_seq_lengths[b]`` tokens, the
last ``seq_q`` of which are the queries' own (they were written before the call): query
``t`` sits at position ``p = length_b - seq_q + t`` (bottom-right alignment, per row), sees
keys ``<= p`` when causal and ``[p - left, p + right]`` with a window
(:class:`CacheVisibility`). On the Triton backend a call with lengths or a window runs
the split kernel (:mod:`pallas_flash.triton.decode`), which computes each split's keys and
the per-token band from the lengths itself. Elsewhere (the fixed chunks), the kernels'
static :class:`~pallas_flash.masking.MaskSpec` cannot say this for ragged lengths, so
visibility is carried by arrays the kernels already take: kv segment ids mark each row's
interval of keys that any of its queries can see (so tiles outside it are skipped, never
read), and, only when ``seq_q > 1`` with a causal or window mask (where visibility differs
between tokens), a boolean mask array ``[batch · num_splits, 1, seq_q · group, chunk]``
gives the exact band (it costs ``seq_q · group`` bytes per key, ~1.5 % of the K/V bytes at
16 tokens, group 4, 8 kv heads, head_dim 128; Mosaic takes mask arrays up to head_dim 192,
above it the call runs on the next backend).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from pallas_flash import dispatch
from pallas_flash.arguments import (
    Implementation,
    canonical_scale,
    canonical_window,
    check_bools,
    check_deterministic,
    check_lengths,
    check_sinks,
    check_soft_cap,
)
from pallas_flash.autodiff import add_sinks, attention_with_lse
from pallas_flash.contract import EMPTY_ROW_LSE, PADDED_KEY_ID, StaticArgs
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis
from pallas_flash.plan import MAX_DECODE_SEQ_Q, balances_rows, is_decode_step
from pallas_flash.tuning import resolve_config

#: Work units the split heuristic aims at: two per SM of an H200 (132 SMs).
TARGET_WORK_UNITS = 2 * 132
#: Fraction of :data:`TARGET_WORK_UNITS` one wave of CTAs must fill to need no more splits.
#: Past it, one more split adds a second wave and a merge for little more occupancy. At
#: 8 kv heads on the H200 (2026-12-02, docs/decode.md),
#: 1 split against 2, over cuDNN's GB/s: 1.06 against 0.90 at 32 × 8192 (256 units, 97 %),
#: 1.12 against 1.08 at 24 × 8192 (73 %), 1.08 against 1.07 at 20 × 8192 (61 %).
FULL_WAVE = 0.6
#: Shortest chunk the split heuristic makes (shorter ones are dominated by the merge).
MIN_SPLIT_KEYS = 256


def default_num_splits(batch: int, kv_heads: int, seq_kv: int, *, ragged: bool = False
                       ) -> int:
    """The heuristic number of K/V chunks for a decode call.

    One unit of work is a (sequence, kv head, chunk) triple: the packed query rows of one kv
    head are one tile. Returns the smallest ``n`` with ``batch · kv_heads · n >=``
    :data:`FULL_WAVE` ``·`` :data:`TARGET_WORK_UNITS` (twice the target when ``ragged``:
    with per-row lengths, about half of the chunks lie past their row's length and cost
    nothing, so twice as many keep the SMs as busy), at most ``seq_kv //``
    :data:`MIN_SPLIT_KEYS`, then raised to a divisor of ``seq_kv`` (so that the split is a
    reshape, not a padded copy; lowered when no divisor lies above); at least 1.
    E.g. 32 × 8192 with 8 kv heads: 1 (ragged: 2); 8 × 32768: 4 (ragged: 8); 1 × 131072: 32.
    (measurements: docs/decode.md,
    where 8 × 32768 ragged read 2274–2348 GB/s with 8–16 splits against 1684 with 4, and
    32 × 8192 ragged was fastest with 2)
    """
    target = TARGET_WORK_UNITS * (2 if ragged else 1)
    most = max(1, seq_kv // MIN_SPLIT_KEYS)
    wanted = min(math.ceil(FULL_WAVE * target / max(1, batch * kv_heads)), most)
    n = next((n for n in range(wanted, most + 1) if seq_kv % n == 0), wanted)
    while seq_kv % n:
        n -= 1
    return n


def decode_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: int | tuple[int, int] | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
    config: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of ``seq_q <= 16`` new tokens per sequence to a KV cache.

    Alignment is bottom-right *per row*: the cache of sequence ``b`` holds
    ``key_value_seq_lengths[b]`` tokens (default: all ``seq_kv``), the last ``seq_q`` of
    which are the new tokens themselves, so query ``t`` is at position
    ``key_value_seq_lengths[b] - seq_q + t``. Keys at or past the length are hidden,
    whatever they hold: NaN or inf in a stale cache reaches no output or gradient.

    Args:
      query: ``[batch, seq_q, heads, head_dim]``, ``seq_q <= 16``.
      key: ``[batch, seq_kv, kv_heads, head_dim]``, ``heads`` a multiple of ``kv_heads``.
      value: ``[batch, seq_kv, kv_heads, head_dim]``.
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      is_causal: a query hides the keys after its own position (for ``seq_q == 1`` the
        length alone does that).
      local_window_size: ``w`` or ``(left, right)``: query at ``p`` sees keys in
        ``[p - left, p + right]``.
      key_value_seq_lengths: ``[batch]`` integer tokens in each row's cache, in
        ``[0, seq_kv]``, or a scalar when every row holds that many (a cache filled up to
        one index: it lets the splits be sized for equal rows); keys past a row's length
        are hidden (and their tiles skipped by the Pallas kernels). Checked when concrete;
        traced lengths cannot be, and are clamped into ``[0, seq_kv]``.
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)``.
      sinks: ``[heads]`` logits joining each row's softmax denominator once (not once per
        split).
      num_splits: K/V chunks along the sequence (None: :func:`default_num_splits`). One
        that does not divide ``seq_kv`` pads the cache to a multiple (a copy), except
        where the splits are balanced per row (see below).
      return_lse: also return ``lse: [batch, seq_q, heads]`` float32.
      deterministic: bitwise-reproducible gradients, as :func:`pallas_flash.attention`.
      implementation, interpret, config: as :func:`pallas_flash.attention`; ``config``
        configures the per-chunk forward (packed shapes ``[batch · num_splits,
        seq_q · group, kv_heads, head_dim]`` against chunks ``[batch · num_splits,
        seq_kv / num_splits, kv_heads, head_dim]``) and so keeps the chunked layout. With
        ``implementation="mosaic"`` a full cache (no lengths, window or per-token mask)
        runs the Mosaic decode kernel, which ``config`` may tune with a
        :class:`~pallas_flash.mosaic.config.DecodeConfig` (a ``MosaicConfig`` selects the
        main forward instead).

    Splits balanced per row. On the Triton backend, with ``key_value_seq_lengths`` or a
    window, no ``config``: split ``i`` of row ``b`` takes the ``i``-th of equal parts of the
    keys the row's queries see, wherever its length ends, so a row's time follows its own
    length (docs/decode.md, "Splits balanced per row"). With ``num_splits=None``, rows of
    one length (a scalar ``key_value_seq_lengths``, one row, or a window alone) take a
    full cache's count (:func:`default_num_splits`); ``[batch]`` lengths take a count per
    row at run time, as many parts as a full cache has spread over the keys actually
    visible, at most the ragged count (a longer row gets more of them; the CTAs of unused
    parts cost 7–17 % on a full cache on the H200, where ragged rows gained 10–18 %;
    2026-12-03).

    Returns:
      ``out: [batch, seq_q, heads, head_dim]`` in the input dtype, or ``(out, lse)``; rows
      that see no key (and no sink) output 0 with lse ``-1e30``. Differentiable in query,
      key, value and sinks.
    """
    dispatch.check_arrays(query, key, value)
    batch, seq_q, heads, head_dim = query.shape
    seq_kv, kv_heads = key.shape[1], key.shape[2]
    if seq_q < 1 or seq_kv < 1:
        # The cache holds the new tokens too (they are written before the call).
        raise ValueError(f"decode_attention needs at least one new token (query seq_q) and "
                         f"one cached position (key / value seq_kv), got seq_q {seq_q}, "
                         f"seq_kv {seq_kv}")
    if not is_decode_step(seq_q):
        raise ValueError(
            f"query seq_q must be at most {MAX_DECODE_SEQ_Q} for decode_attention, got "
            f"{seq_q}; use pallas_flash.attention for longer queries")
    scale = canonical_scale(scale, head_dim)
    check_bools(is_causal=is_causal, return_lse=return_lse)
    dispatch.check_implementation(implementation, interpret)
    window = canonical_window(local_window_size)
    softcap = check_soft_cap(logits_soft_cap)
    sinks = check_sinks(sinks, heads)
    deterministic = dispatch.deterministic_backward(check_deterministic(deterministic))
    lengths, uniform = _check_lengths(key_value_seq_lengths, batch, seq_kv)
    if num_splits is not None and (not isinstance(num_splits, int)
                                   or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    balanced_splits, full_splits = num_splits, None
    if num_splits is None:
        # Rows of one length take a full cache's count, balanced; rows of any lengths up to
        # the ragged count, as many as their length asks for (_row_split_count).
        balanced_splits = default_num_splits(batch, kv_heads, seq_kv, ragged=not uniform)
        full_splits = None if uniform else default_num_splits(batch, kv_heads, seq_kv)
        num_splits = default_num_splits(batch, kv_heads, seq_kv, ragged=lengths is not None)

    rows = CacheVisibility(seq_q=seq_q, group=heads // kv_heads, is_causal=is_causal, window=window)
    options = _SplitOptions(rows=rows, num_splits=num_splits, balanced_splits=balanced_splits,
                            full_splits=full_splits,
                            scale=float(scale), softcap=softcap,
                            implementation=implementation, interpret=interpret,
                            config=config, deterministic=deterministic)
    if balances_rows(query.shape, key.shape, query.dtype, has_lengths=lengths is not None,
                     window=window, implementation=implementation, interpret=interpret,
                     config=config):
        full = jnp.full((batch,), seq_kv, jnp.int32)
        out, lse = _balanced_decode(query, key, value, full if lengths is None else lengths,
                                    options)
    else:
        out, lse = _chunked_decode(query, key, value, lengths, options)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    if return_lse:
        return out, jnp.transpose(lse, (0, 2, 1))
    return out


def _check_lengths(lengths, batch: int, seq_kv: int) -> tuple[jax.Array | None, bool]:
    """``key_value_seq_lengths`` as int32 ``[batch]`` (None: every key), range-checked when
    concrete, and whether every row has one length (given as a scalar, None, or one row)."""
    if lengths is None:
        return None, True
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = np.asarray(lengths)  # 64-bit: its range is checked before the int32 cast
    if getattr(lengths, "shape", None) == ():
        lengths = check_lengths(lengths[None], "key_value_seq_lengths", 1, seq_kv,
                                "the cache length")
        return jnp.broadcast_to(lengths, (batch,)), True
    return (check_lengths(lengths, "key_value_seq_lengths", batch, seq_kv, "the cache length"),
            batch == 1)


@dataclasses.dataclass(frozen=True)
class CacheVisibility:
    """Which cached keys each query token sees, with per-row bottom-right alignment.

    Token ``t`` of row ``b`` is at ``p = lengths[b] - seq_q + t``; packed query rows
    ``t · group + g`` (``g < group``) share token ``t``'s keys.
    """

    seq_q: int
    group: int
    is_causal: bool
    window: tuple[int, int] | None

    @property
    def needs_mask_array(self) -> bool:
        """Whether tokens of one row see different keys (else segment ids say it all)."""
        return self.seq_q > 1 and (self.is_causal or self.window is not None)

    def first_visible(self, lengths: jax.Array) -> jax.Array:
        """``[B]``: the first key any token of the row can see (the window's left edge)."""
        if self.window is None:
            return jnp.zeros_like(lengths)
        return jnp.maximum(lengths - self.seq_q - self.window[0], 0)

    def token_visible(self, lengths: jax.Array, positions: jax.Array) -> jax.Array:
        """``[B, T, P]``: token ``t`` of row ``b`` sees the key at ``positions[p]`` (``[P]``,
        or per row ``[B, P]``)."""
        query_pos = (lengths[:, None] - self.seq_q + jnp.arange(self.seq_q))[:, :, None]
        keys = positions[:, None, :] if positions.ndim == 2 else positions[None, None, :]
        return self._sees(query_pos, keys, lengths[:, None, None])

    def packed_visible(self, length: jax.Array, rows: jax.Array, keys: jax.Array
                       ) -> jax.Array:
        """``[r, k]``, inside a kernel: packed query row ``rows[i]`` (``[r, 1]``; row ``t ·
        group + g`` is token ``t``) of a cache row of ``length`` tokens sees key
        ``keys[j]`` (``[1, k]``)."""
        return self._sees(length - self.seq_q + rows // self.group, keys, length)

    def uniform_keys(self, length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys ``[lo, hi)`` that every token of a row of ``length`` tokens sees (a kernel's
        tiles inside them need no per-token mask): from the last token's left window edge
        to the first token's right edge."""
        first_pos, last_pos = length - self.seq_q, length - 1
        lo, hi = jnp.zeros_like(length), length
        if self.is_causal:
            hi = jnp.minimum(hi, first_pos + 1)
        if self.window is not None:
            lo = jnp.maximum(lo, last_pos - self.window[0])
            hi = jnp.minimum(hi, first_pos + self.window[1] + 1)
        return lo, hi

    def _sees(self, query_pos, keys, length):
        visible = (keys < length) & (keys >= 0)
        if self.is_causal:
            visible &= keys <= query_pos
        if self.window is not None:
            visible &= (keys >= query_pos - self.window[0]) & (keys <= query_pos + self.window[1])
        return visible

    def chunk_mask(self, lengths: jax.Array, positions: jax.Array,
                   num_splits: int) -> jax.Array:
        """The packed chunks' mask array ``[B·n, 1, T·G, C]``: chunk ``i`` of row ``b``
        holds the keys at ``positions[..., i·C : (i+1)·C]`` (``positions`` ``[n·C]``, or
        per row ``[B, n·C]``)."""
        batch, chunk = lengths.shape[0], positions.shape[-1] // num_splits
        visible = jnp.repeat(self.token_visible(lengths, positions), self.group, axis=1)
        visible = visible.reshape(batch, -1, num_splits, chunk)  # [B, T·G, n, C]
        return jnp.swapaxes(visible, 1, 2).reshape(batch * num_splits, 1, -1, chunk)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["rows", "num_splits", "balanced_splits", "full_splits",
                                "scale", "softcap",
                                "implementation", "interpret", "config", "deterministic"])
@dataclasses.dataclass(frozen=True)
class _SplitOptions:
    """A decode call's static choices. ``num_splits``: the fixed chunks per row;
    ``balanced_splits``: the balanced splits per row the kernel grid holds;
    ``full_splits``: None (every row takes them all), or (splits counted per row at run
    time) the splits of a full cache."""

    rows: CacheVisibility
    num_splits: int
    balanced_splits: int
    full_splits: int | None
    scale: float
    softcap: float | None
    implementation: Implementation | None
    interpret: bool
    config: Any
    deterministic: bool


def _chunked_decode(query, key, value, lengths, options: _SplitOptions):
    """``(out [B, T, H, D], lse [B, H, T])``: fixed chunks of the cache as batch entries."""
    out, lse = _split_forward(
        _pack_queries(query, key.shape[2]), key, value, lengths, options.rows,
        num_splits=options.num_splits, scale=options.scale, softcap=options.softcap,
        implementation=options.implementation, interpret=options.interpret,
        config=options.config, deterministic=options.deterministic)
    return _unpack(out, lse, query.shape[2])


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _balanced_decode(query, key, value, lengths, options: _SplitOptions):
    """``(out [B, T, H, D], lse [B, H, T])`` with splits balanced per row."""
    return _balanced_split_forward(query, key, value, lengths, options)


def _balanced_decode_jvp(options, primals, tangents):
    # The balanced layout is a forward-only kernel call; differentiated, the call runs the
    # fixed chunks, whose attention has forward- and reverse-mode rules (primal included:
    # that formulation's backward keeps its own (out, lse) as residuals).
    lengths = primals[3]
    return jvp_of_differentiated(lambda q, k, v: _chunked_decode(q, k, v, lengths, options),
                                 primals[:3], tangents[:3])


_balanced_decode.defjvp(_balanced_decode_jvp, symbolic_zeros=True)


def jvp_of_differentiated(fn, primals: tuple, tangents: tuple):
    """``jax.jvp`` of ``fn(*primals)`` in the primals being differentiated, for a
    ``custom_jvp`` rule defined with ``symbolic_zeros=True``: the others (``SymbolicZero``
    tangents) are closed over as constants. Given zero tangents instead, they would enter
    the attention's linear rule as linear inputs, which its transpose (reverse mode, e.g.
    ``jax.grad`` in the query alone) cannot take."""
    live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

    def of_live(*xs):
        args = list(primals)
        for i, x in zip(live, xs, strict=True):
            args[i] = x
        return fn(*args)

    return jax.jvp(of_live, tuple(primals[i] for i in live), tuple(tangents[i] for i in live))


def _balanced_split_forward(query, key, value, lengths, options: _SplitOptions):
    """Split-KV decode with every row's visible keys cut into equal parts, on the Triton
    kernel that finds each part's keys itself (forward only; :func:`_split_kernel_decode`
    with ``options``' counts). Returns ``(out [B, T, H, D], lse [B, H, T])``."""
    return _split_kernel_decode(query, key, value, lengths, options.rows,
                                num_splits=options.balanced_splits,
                                full_splits=options.full_splits, scale=options.scale,
                                softcap=options.softcap, interpret=options.interpret)


def _split_kernel_decode(query, key, value, lengths, rows: CacheVisibility, *,
                         num_splits: int, full_splits: int | None, scale: float, softcap,
                         interpret: bool, page_table=None):
    """``(out [B, T, H, D], lse [B, H, T])`` on the split kernel
    (:mod:`pallas_flash.triton.decode`), from the cache ``[B, S, K, D]`` or, with
    ``page_table [B, M]``, from page pools ``[P, page_size, K, D]`` read in place.

    Part ``i`` of row ``b`` covers the ``i``-th of ``count_b`` equal parts of the keys the
    row's queries see (:func:`_part_bound`), wherever its length ends, so a row's time
    follows its own length; the cache is neither copied nor padded. ``count_b`` is
    ``num_splits``, or with ``full_splits`` counted per row at run time
    (:func:`_row_split_count`).
    """
    batch, _, heads, _ = query.shape
    kv_heads = key.shape[2]
    packed = _pack_queries(query, kv_heads)  # [B, R, K, D]
    seq_kv = key.shape[1] if page_table is None else page_table.shape[1] * key.shape[1]
    triton = dispatch.backend("triton")
    config = triton.default_config(packed.shape, (batch, seq_kv, *key.shape[2:]),
                                   packed.dtype, MaskSpec(packed.shape[1], seq_kv))
    if page_table is not None:  # each K/V load waits for its page id: a deeper pipeline
        config = dataclasses.replace(config, num_stages=triton.PAGED_DECODE_STAGES)

    def part_interval(all_lengths, length, part):
        first = rows.first_visible(length)
        visible = jnp.maximum(length - first, 0)
        count = num_splits
        if full_splits is not None:
            total = jnp.sum(jnp.maximum(all_lengths - rows.first_visible(all_lengths), 0))
            count = _row_split_count(visible, _part_size(total, batch, full_splits),
                                     num_splits)
        return (_part_bound(first, visible, count, part),
                _part_bound(first, visible, count, part + 1))

    out, lse = triton.split_decode_forward(
        packed, key, value, lengths, part_interval, rows, num_splits=num_splits, scale=scale,
        softcap=softcap, config=config, interpret=interpret, page_table=page_table)
    out, lse = merge_splits(out, lse)
    return _unpack(out.astype(query.dtype), lse, heads)


def _part_size(total_visible, batch: int, full_splits: int):
    """Keys per part when the rows' parts together should be as many as a full cache's
    ``full_splits`` per row would make of the keys visible now (at least
    :data:`MIN_SPLIT_KEYS`), so that the kernel's work stays spread over the same number of
    CTAs whatever the lengths."""
    return jnp.maximum(-(-total_visible // (batch * full_splits)), MIN_SPLIT_KEYS)


def _row_split_count(visible, part_size, num_splits: int):
    """Parts of a row with ``visible`` keys: enough of ``part_size`` keys, 1 to
    ``num_splits``."""
    return jnp.clip(-(-visible // part_size), 1, num_splits)


def _part_bound(first, visible, count, index):
    """Where part ``index`` of ``count`` equal parts (to a key) of the keys ``[first, first +
    visible)`` starts (``index = count``: where the last ends); parts past ``count`` are
    empty. Scalars (inside a kernel) or arrays."""
    return first + (visible * jnp.minimum(index, count)) // count


def _pack_queries(query: jax.Array, kv_heads: int) -> jax.Array:
    """``[B, T, K·G, D]`` -> ``[B, T·G, K, D]``, row ``t·G + g`` = head ``k·G + g`` of token
    ``t`` (query head ``h`` uses kv head ``h // G``, as ``jnp.repeat`` of the kv heads)."""
    batch, seq_q, heads, head_dim = query.shape
    group = heads // kv_heads
    grouped = query.reshape(batch, seq_q, kv_heads, group, head_dim)
    return jnp.swapaxes(grouped, 2, 3).reshape(batch, seq_q * group, kv_heads, head_dim)


def _unpack(out: jax.Array, lse: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """The inverse of :func:`_pack_queries` on ``out [B, T·G, K, D]`` and
    ``lse [B, K, T·G]``: returns ``out [B, T, H, D]`` and ``lse [B, H, T]``."""
    batch, rows, kv_heads, head_dim = out.shape
    group = heads // kv_heads
    seq_q = rows // group
    out = jnp.swapaxes(out.reshape(batch, seq_q, group, kv_heads, head_dim), 2, 3)
    lse = jnp.swapaxes(lse.reshape(batch, kv_heads, seq_q, group), 2, 3)
    return out.reshape(batch, seq_q, heads, head_dim), lse.reshape(batch, heads, seq_q)


def _split_forward(packed_q, key, value, lengths, rows: CacheVisibility, *, num_splits: int,
                   scale: float, softcap, implementation, interpret: bool, config,
                   deterministic: bool):
    """Packed queries ``[B, R, K, D]`` against ``num_splits`` chunks of the cache, merged.

    Returns ``out [B, R, K, D]`` and ``lse [B, K, R]`` float32 of the whole cache.
    """
    batch, seq_kv = key.shape[0], key.shape[1]
    chunk = -(-seq_kv // num_splits)
    padded_kv = chunk * num_splits

    def split(x):  # [B, S, ...] -> [B·n, S/n, ...] (padded when n does not divide S)
        x = pad_axis(x, 1, padded_kv)
        return x.reshape(batch * num_splits, chunk, *x.shape[2:])

    q_chunks = jnp.repeat(packed_q, num_splits, axis=0)  # [B·n, R, K, D], small
    seen, segment_ids, attn_mask = _chunk_visibility(batch, q_chunks.shape[1], lengths, rows,
                                                     seq_kv, num_splits, chunk)
    if lengths is not None or rows.window is not None:
        # Keys no query of the row sees (past its length: a stale cache may hold anything,
        # NaN included) have their logits hidden by a select, but P·V and dS·K are matmuls,
        # where 0 · NaN is NaN. A select zeroes them on the way into the chunks (one
        # elementwise pass, as attention's zero_unseen_rows), for every backend's forward
        # and backward; their dk, dv are then exactly 0. (A full cache hides only the
        # padding of its last chunk, zeros already: no pass.)
        visible = seen[:, :seq_kv, None, None]
        key, value = (jnp.where(visible, x, jnp.zeros((), x.dtype)) for x in (key, value))
    k_chunks, v_chunks = split(key), split(value)
    spec = MaskSpec(seq_q=q_chunks.shape[1], seq_kv=chunk)
    features = dispatch.Features(has_segments=segment_ids is not None, softcap=softcap,
                                 has_mask=attn_mask is not None)
    if implementation is None:
        implementation = dispatch.choose_decode(q_chunks.shape, k_chunks.shape,
                                                q_chunks.dtype, spec, features,
                                                interpret=interpret)
    reason = dispatch.unsupported(implementation, q_chunks.shape, k_chunks.shape,
                                  q_chunks.dtype, spec, features)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    module = dispatch.backend(implementation)
    # A backend may have a kernel of its own for packed decode calls (Mosaic: one
    # warpgroup per chunk and kv head, pallas_flash.mosaic.decode).
    decode_kernels = getattr(module, "decode_kernels", None)
    own = None if decode_kernels is None else decode_kernels(
        q_chunks.shape, k_chunks.shape, q_chunks.dtype, spec,
        has_segments=segment_ids is not None, has_mask=attn_mask is not None, config=config)
    if own is not None:
        kernels, config = own
    else:
        kernels = module.KERNELS
        config = resolve_config(config, implementation, q_chunks, k_chunks, v_chunks, spec,
                                interpret)
    static = StaticArgs(kernels=kernels, mask=spec, scale=scale, config=config,
                        interpret=interpret, softcap=softcap, deterministic=deterministic)
    out, lse = attention_with_lse(q_chunks, k_chunks, v_chunks, segment_ids, None, None,
                                  attn_mask, static)
    return _merge_chunks(out, lse, batch, num_splits)


def paged_split_forward(query, key_pages, value_pages, page_table, lengths, *,
                        window, scale: float, softcap, interpret: bool, num_splits: int):
    """Split-KV decode straight from a paged cache, on the Triton split kernel (forward
    only).

    Like :func:`decode_attention` (``is_causal=True``, per-row ``lengths [B]`` int32) on the
    cache that ``page_table [B, M]`` addresses in ``key_pages, value_pages [P, page_size,
    K, D]``, without gathering it: split ``i`` of sequence ``b`` covers the ``i``-th of
    ``num_splits`` equal parts of the keys its queries can see, and reads each K/V tile
    from its page through the row's table (:func:`_split_kernel_decode`).

    Returns ``(out [B, T, H, D], lse [B, H, T] float32)``.
    """
    rows = CacheVisibility(seq_q=query.shape[1], group=query.shape[2] // key_pages.shape[2],
                           is_causal=True, window=window)
    return _split_kernel_decode(query, key_pages, value_pages, lengths, rows,
                                num_splits=num_splits, full_splits=None, scale=scale,
                                softcap=softcap, interpret=interpret, page_table=page_table)


def _chunk_visibility(batch: int, rows_per_chunk: int, lengths, rows: CacheVisibility,
                      seq_kv: int, num_splits: int, chunk: int):
    """``(seen, segment_ids, attn_mask)`` of the packed chunks ``[B·n, R]`` x ``[B·n,
    chunk]``: ``seen [B, n·chunk]`` marks the keys some query of the row sees, kv segment
    ids hide the others (past its length or padding, before its window), a mask array gives
    the per-token band where tokens differ. ``seen`` and the ids are None where no key is
    hidden from a whole row."""
    padded_kv = chunk * num_splits
    # Segment ids are needed whenever some key is hidden from a whole row (length, padding,
    # a window's left edge); without any, the chunks run unmasked.
    needs_ids = lengths is not None or padded_kv != seq_kv or rows.window is not None
    if lengths is None:
        lengths = jnp.full((batch,), seq_kv, jnp.int32)
    positions = jnp.arange(padded_kv, dtype=jnp.int32)
    seen = segment_ids = attn_mask = None
    if needs_ids:
        seen = (positions[None, :] < lengths[:, None]) & (
            positions[None, :] >= rows.first_visible(lengths)[:, None])
        kv_ids = jnp.where(seen, 0, PADDED_KEY_ID).astype(jnp.int32)
        q_ids = jnp.zeros((batch * num_splits, rows_per_chunk), jnp.int32)
        segment_ids = (q_ids, kv_ids.reshape(batch * num_splits, chunk))
    if rows.needs_mask_array:
        attn_mask = rows.chunk_mask(lengths, positions, num_splits)
    return seen, segment_ids, attn_mask


def _merge_chunks(out, lse, batch: int, num_splits: int):
    """The kernels' per-chunk ``out [B·n, R, K, D]``, ``lse [B·n, K, R]`` merged over n."""
    out = out.reshape(batch, num_splits, *out.shape[1:])
    lse = lse.reshape(batch, num_splits, *lse.shape[1:])
    return merge_splits(out, lse)


def merge_splits(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact merge of partial attentions over disjoint key chunks.

    Args:
      out: ``[B, n, R, K, D]``, each chunk's softmax-normalised output.
      lse: ``[B, n, K, R]`` float32 (or float64), each chunk's log-denominator; a chunk in
        which a row sees no key has lse ``-1e30`` (or ``-inf``) and out 0.

    Raises:
      ValueError: ranks or shapes that do not match as above, or a non-float dtype.

    Returns:
      ``out [B, R, K, D]`` (dtype of ``out``) ``= Σ_i exp(lse_i - lse) · out_i`` and
      ``lse [B, K, R] = logsumexp_i lse_i``; rows empty in every chunk give out 0 and lse
      ``-1e30`` (no NaN, also in the gradients).
    """
    out_shape, lse_shape = getattr(out, "shape", None), getattr(lse, "shape", None)
    if out_shape is None or len(out_shape) != 5:
        raise ValueError(f"out must have rank 5 [B, n, R, K, D], got shape {out_shape}")
    batch, splits, rows, kv_heads, _ = out_shape
    if lse_shape != (batch, splits, kv_heads, rows):
        raise ValueError(f"lse must have shape [B, n, K, R] = "
                         f"{(batch, splits, kv_heads, rows)} for out {out_shape}, got "
                         f"{lse_shape}")
    for name, x in (("out", out), ("lse", lse)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating, got {x.dtype}")
    # At least float32; float64 stays float64 (a float64 decode is exact).
    acc = jnp.promote_types(lse.dtype, jnp.float32)
    lse = jnp.maximum(lse.astype(acc), EMPTY_ROW_LSE)  # -inf -> a finite floor
    top = jnp.max(lse, axis=1, keepdims=True)
    weights = jnp.exp(lse - top)  # [B, n, K, R]; the largest is 1, so the sum is >= 1
    total = jnp.sum(weights, axis=1)
    empty = top[:, 0] <= EMPTY_ROW_LSE / 2
    merged_lse = jnp.where(empty, EMPTY_ROW_LSE, top[:, 0] + jnp.log(total))
    shares = jnp.transpose(weights / total[:, None], (0, 1, 3, 2))[..., None]  # [B,n,R,K,1]
    merged = jnp.sum(shares * out.astype(jnp.promote_types(out.dtype, acc)), axis=1)
    return merged.astype(out.dtype), merged_lse

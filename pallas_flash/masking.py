"""Which (query, key) pairs are visible, and which tiles of S = Q·Kᵀ can be skipped.

One description shared by every implementation (reference, XLA, Triton, Mosaic GPU).

Every static mask this package supports is a *band* on the diagonal index ``k - q``:
``band_lo <= k - q <= band_hi``, intersected with ``k < seq_kv`` (keys past the real
length are padding added to fill the last block). Causal attention is the band
``(-inf, offset]``; a sliding window ``(left, right)`` is ``[offset - left, offset + right]``
(with ``right`` clipped to 0 when causal). ``offset`` is 0 for top-left alignment
(query ``i`` sees keys ``<= i``, the convention of ``jax.nn.dot_product_attention``) and
``seq_kv - seq_q`` for bottom-right alignment (the last query sees the last key, as when
new queries attend to a KV cache).

Because the visible region of a row is one interval, the key blocks a query block touches
are a contiguous range of block indices, and inside it the blocks that need no mask at
all form a contiguous sub-range. That is the FlashAttention-2 causal trick generalised:
loop over ``[first, last)``, apply the mask only outside ``[full_first, full_last)``. The
helpers below compute these ranges with ``jnp`` integer ops so that the same code runs on
Python ints (XLA path, tests) and on traced program ids inside Pallas kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash.bias import grouped

CausalAlignment = Literal["top_left", "bottom_right"]

# A band limit that no index difference reaches: stands for "unbounded".
_UNBOUNDED = 1 << 30


def _static_int(value, name: str) -> int:
    """A Python int from a Python / NumPy integer (not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static description of the visible (query, key) pairs of one attention call.

    Attributes:
      seq_q: number of real query positions.
      seq_kv: number of real key/value positions; keys at ``k >= seq_kv`` are never visible.
      is_causal: keys after the (aligned) query position are hidden.
      causal_alignment: ``"top_left"`` (query ``i`` sees keys ``<= i``) or
        ``"bottom_right"`` (query ``i`` sees keys ``<= i + seq_kv - seq_q``).
      window: ``(left, right)``: query ``i`` sees keys in ``[i - left, i + right]`` (after
        alignment), or ``None`` for no window. Each side is clamped to the sequences (a
        side of ``2**31 - 1`` or ``10**12`` means unbounded), and a window that hides
        nothing becomes ``None``: the attribute holds the clamped window.
      q_start, kv_start: global positions of the first query and the first key, when this
        call sees a chunk of a longer sequence (ring attention: a query chunk at ``a``
        against a K/V chunk at ``b``). Causality and the window apply to global positions:
        local query ``i`` is aligned with local key ``i + offset`` where ``offset`` adds
        ``q_start - kv_start``. Both 0 for a whole sequence.
    """

    seq_q: int
    seq_kv: int
    is_causal: bool = False
    causal_alignment: CausalAlignment = "top_left"
    window: tuple[int, int] | None = None
    q_start: int = 0
    kv_start: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_q", "seq_kv", "q_start", "kv_start"):
            object.__setattr__(self, name, _static_int(getattr(self, name), name))
        if not isinstance(self.is_causal, (bool, np.bool_)):
            raise ValueError(f"is_causal must be a bool, got {self.is_causal!r}")
        object.__setattr__(self, "is_causal", bool(self.is_causal))
        if self.window is not None:
            if not isinstance(self.window, (tuple, list)) or len(self.window) != 2:
                raise ValueError(
                    f"window must be (left, right) with both >= 0, got {self.window!r}")
            object.__setattr__(self, "window",
                               tuple(_static_int(w, "window") for w in self.window))
        if self.q_start < 0 or self.kv_start < 0:
            raise ValueError(f"q_start and kv_start must be >= 0, got {self.q_start=}, "
                             f"{self.kv_start=}")
        if self.seq_q < 1 or self.seq_kv < 1:
            raise ValueError(
                f"sequence lengths must be positive, got {self.seq_q=}, {self.seq_kv=}")
        if self.causal_alignment not in ("top_left", "bottom_right"):
            raise ValueError(
                "causal_alignment must be 'top_left' or 'bottom_right', "
                f"got {self.causal_alignment!r}"
            )
        if self.window is not None and (len(self.window) != 2 or min(self.window) < 0):
            raise ValueError(f"window must be (left, right) with both >= 0, got {self.window!r}")
        # Kernels compute i - left and i + right in int32: a window of 2**31 - 1 ("unbounded")
        # or 10**12 would overflow. Clamped here, once, every backend sees small values.
        object.__setattr__(self, "window", self._clamped_window())

    def _clamped_window(self) -> tuple[int, int] | None:
        """The window with each side clamped to the widest one that still hides something;
        None when it hides nothing (a window as long as the sequences is no window)."""
        if self.window is None:
            return None
        # k - q spans [-(seq_q - 1), seq_kv - 1]: a side reaching past that end is unbounded.
        # (With chunk offsets the diagonal may lie outside the block: a side is then at
        # least 0 here, which hides no more than the unclamped side would.)
        widest_left = max(self.offset + self.seq_q - 1, 0)
        widest_right = max(self.seq_kv - 1 - self.offset, 0)
        left, right = min(self.window[0], widest_left), min(self.window[1], widest_right)
        # Under causal masking the right side never widens the band past the diagonal.
        if left == widest_left and (right == widest_right or self.is_causal):
            return None
        return int(left), int(right)

    @property
    def offset(self) -> int:
        """Diagonal offset: query ``i`` is aligned with key ``i + offset`` (the alignment's,
        plus ``q_start - kv_start`` for chunks of a longer sequence)."""
        aligned = self.seq_kv - self.seq_q if self.causal_alignment == "bottom_right" else 0
        return aligned + self.q_start - self.kv_start

    @property
    def band(self) -> tuple[int, int]:
        """``(band_lo, band_hi)``: visible pairs satisfy ``band_lo <= k - q <= band_hi``."""
        lo, hi = -_UNBOUNDED, _UNBOUNDED
        if self.window is not None:
            lo, hi = self.offset - self.window[0], self.offset + self.window[1]
        if self.is_causal:
            hi = min(hi, self.offset)
        return lo, hi

    @property
    def is_dense(self) -> bool:
        """True when every real (q, k) pair is visible."""
        lo, hi = self.band
        return lo <= -(self.seq_q - 1) and hi >= self.seq_kv - 1

    def visible(self, q_idx: jnp.ndarray, k_idx: jnp.ndarray) -> jnp.ndarray:
        """Boolean visibility of pairs; ``q_idx`` and ``k_idx`` broadcast against each other."""
        lo, hi = self.band
        diff = k_idx - q_idx
        ok = k_idx < self.seq_kv
        if lo > -_UNBOUNDED:
            ok = ok & (diff >= lo)
        if hi < _UNBOUNDED:
            ok = ok & (diff <= hi)
        return jnp.broadcast_to(ok, diff.shape)

    def block_visible(self, q_start, block_q: int, k_start, block_kv: int) -> jnp.ndarray:
        """``visible`` on the ``[block_q, block_kv]`` tile whose corner is (q_start, k_start)."""
        q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)[:, None]
        k_idx = k_start + jnp.arange(block_kv, dtype=jnp.int32)[None, :]
        return self.visible(q_idx, k_idx)

    # --- block ranges for a query block (forward and dQ kernels) -----------------------

    def kv_blocks(self, q_start, block_q: int, block_kv: int):
        """Key blocks touched by queries ``[q_start, q_start + block_q)``.

        Returns ``(first, full_first, full_last, last)``: blocks ``[first, last)`` hold every
        visible key; of those, ``[full_first, full_last)`` are visible to every query of the
        block and need no mask. Everything outside ``[first, last)`` is skipped (never loaded).
        """
        lo, hi = self.band
        xp = _array_module(q_start)
        q_last = q_start + block_q - 1
        # Last visible key index of any row in the block, +1; at most seq_kv.
        k_end = xp.minimum(q_last + hi, self.seq_kv - 1) + 1
        k_begin = xp.maximum(q_start + lo, 0)
        first = _div(k_begin, block_kv)
        last = xp.where(k_end > k_begin, _cdiv(xp.maximum(k_end, 0), block_kv), first)
        # Keys visible to *every* row: k >= q_last + lo and k <= q_start + hi (and < seq_kv).
        full_begin = xp.maximum(q_last + lo, 0)
        full_end = xp.minimum(q_start + hi, self.seq_kv - 1) + 1
        full_first = xp.clip(_cdiv(full_begin, block_kv), first, last)
        full_last = xp.clip(_div(xp.maximum(full_end, 0), block_kv), full_first, last)
        return first, full_first, full_last, last

    # --- block ranges for a key block (dK/dV kernel) -------------------------------------

    def q_blocks(self, k_start, block_kv: int, block_q: int, num_q_blocks: int):
        """Query blocks that see any key of ``[k_start, k_start + block_kv)``.

        Returns ``(first, full_first, full_last, last)`` as in :meth:`kv_blocks`, with the
        roles of queries and keys swapped. ``num_q_blocks`` bounds the range (padded rows).
        """
        lo, hi = self.band
        xp = _array_module(k_start)
        k_last = xp.minimum(k_start + block_kv, self.seq_kv) - 1
        # Rows that see some key of the block: q >= k_start - hi and q <= k_last - lo.
        q_begin = xp.clip(k_start - hi, 0, num_q_blocks * block_q)
        q_end = xp.clip(k_last - lo + 1, 0, num_q_blocks * block_q)
        first = _div(q_begin, block_q)
        last = xp.where(q_end > q_begin, _cdiv(q_end, block_q), first)
        # Rows that see every key of the block: q >= k_last - hi and q <= k_start - lo,
        # and the block holds no padded key.
        full_begin = xp.clip(k_last - hi, 0, num_q_blocks * block_q)
        full_end = xp.clip(k_start - lo + 1, 0, num_q_blocks * block_q)
        full_first = xp.clip(_cdiv(full_begin, block_q), first, last)
        full_last = xp.clip(_div(full_end, block_q), full_first, last)
        no_padding = k_start + block_kv <= self.seq_kv
        full_last = xp.where(no_padding, full_last, full_first)
        return first, full_first, full_last, last

    def visible_fraction(self) -> float:
        """Fraction of the ``seq_q × seq_kv`` pairs that are visible (for FLOP counting)."""
        lo, hi = self.band
        q = np.arange(self.seq_q, dtype=np.int64)
        k_from = np.maximum(q + lo, 0)
        k_to = np.minimum(q + hi, self.seq_kv - 1)
        return float(np.maximum(k_to - k_from + 1, 0).sum()) / (self.seq_q * self.seq_kv)


def segments_visible(q_segment_ids, kv_segment_ids):
    """Packed sequences: ``[..., Tq]`` and ``[..., Tk]`` ids -> ``[..., Tq, Tk]`` equality."""
    return q_segment_ids[..., :, None] == kv_segment_ids[..., None, :]


def zero_unseen_rows(q, k, v, spec: MaskSpec, segment_ids=None, attn_mask=None):
    """``(q, k, v)`` with the rows that no visible pair uses set to zero.

    A key hidden from every query (past ``key_value_seq_lengths``, a segment id no query
    of its band has, outside every query's causal / window band, or a column the mask
    hides from every query of its KV head's group) may hold anything, NaN included (a
    stale KV-cache region): its logits are hidden by a select, but ``P·V`` and ``dSᵀ·Q``
    are matmuls, where ``0 · NaN`` is NaN. Likewise a query that sees no key (past
    ``query_seq_lengths``, ...) enters ``dK = dSᵀ·Q``. Selecting those rows to zero once,
    before any backend runs, keeps them out of every output and gradient on every path;
    the select's own gradient makes their dq / dk / dv exactly 0. An elementwise pass over
    the inputs, O(L·D) (the kernels' work is O(L²·D)), and none at all for a call where
    nothing can be hidden (no segment ids, lengths or mask, and a band that leaves no row
    empty). A key some query sees is used as given: NaN in it is that query's NaN, and it
    may also reach queries that do not see it (those sharing its tile in a matmul).

    The band and the segment ids are checked together exactly (a key whose document's
    queries all lie outside its window counts as unseen); the mask array is checked on its
    own (a key is zeroed when its mask column is False for every query, not when the mask
    and the other criteria together hide it).

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]``.
      spec: the call's band (``spec.seq_q == T``, ``spec.seq_kv == S``).
      segment_ids: None or ``(q_ids [B, T], kv_ids [B, S])`` int32, padding folded in.
      attn_mask: None or a canonical boolean ``[B', N', T', S']`` (pallas_flash.bias).

    Returns:
      ``(q, k, v)`` of the same shapes and dtypes.
    """
    lo, hi = spec.band
    queries, keys = np.arange(spec.seq_q), np.arange(spec.seq_kv)
    # Query i sees keys [i + lo, i + hi], key j is seen by queries [j - hi, j - lo].
    q_range, k_range = (queries + lo, queries + hi), (keys - hi, keys - lo)
    if segment_ids is None:
        q_band, k_band = _band_meets(*q_range, spec.seq_kv), _band_meets(*k_range, spec.seq_q)
        if attn_mask is None and q_band.all() and k_band.all():
            return q, k, v  # nothing can be hidden: no pass at all
        q_seen = jnp.asarray(q_band).reshape(1, -1, 1)                      # [1, T, 1]
        k_seen = jnp.asarray(k_band).reshape(1, -1, 1)                      # [1, S, 1]
    else:
        q_ids, kv_ids = segment_ids
        q_seen = _meets_in_range(q_ids, kv_ids, *q_range)[:, :, None]     # [B, T, 1]
        k_seen = _meets_in_range(kv_ids, q_ids, *k_range)[:, :, None]     # [B, S, 1]
    if attn_mask is not None:
        q_seen = q_seen & jnp.transpose(jnp.any(attn_mask, axis=3), (0, 2, 1))  # [B', T, N']
        by_kv_head = grouped(attn_mask, k.shape[2])                           # [B', K', G', T', S']
        k_seen = k_seen & jnp.transpose(jnp.any(by_kv_head, axis=(2, 3)), (0, 2, 1))
    q = jnp.where(q_seen[..., None], q, jnp.zeros((), q.dtype))
    k_seen = k_seen[..., None]
    return (q, jnp.where(k_seen, k, jnp.zeros((), k.dtype)),
            jnp.where(k_seen, v, jnp.zeros((), v.dtype)))


def _band_meets(start: np.ndarray, stop: np.ndarray, length: int) -> np.ndarray:
    """Whether ``[start, stop]`` (per row) meets ``[0, length)``."""
    return np.maximum(start, 0) <= np.minimum(stop, length - 1)


def _meets_in_range(ids: jax.Array, other_ids: jax.Array, start: np.ndarray,
                    stop: np.ndarray) -> jax.Array:
    """Whether each position ``p`` of ``ids [B, n]`` has an equal id in ``other_ids [B, m]``
    at some position of ``[start[p], stop[p]]``: ``[B, n]`` bool.

    ``other_ids``' positions sorted by (id, position) are a lexicographically ascending
    list, so the first entry ``>= (ids[p], start[p])`` answers it: a vectorised binary
    search, O((n + m) log m) instead of the O(n·m) comparison.
    """
    m = other_ids.shape[1]
    order = jnp.argsort(other_ids, axis=1, stable=True).astype(jnp.int32)  # ties by position
    sorted_ids = jnp.take_along_axis(other_ids, order, axis=1)
    start = jnp.asarray(np.clip(start, 0, m), jnp.int32)[None, :]
    stop = jnp.asarray(np.clip(stop, -1, m), jnp.int32)[None, :]

    def entry(index):
        at = jnp.minimum(index, m - 1)
        return (jnp.take_along_axis(sorted_ids, at, axis=1),
                jnp.take_along_axis(order, at, axis=1))

    def halve(_, bounds):  # lower bound: the first entry not before (ids, start)
        low, high = bounds
        mid = (low + high) // 2
        mid_id, mid_position = entry(mid)
        before = (mid_id < ids) | ((mid_id == ids) & (mid_position < start))
        searching = low < high
        return (jnp.where(searching & before, mid + 1, low),
                jnp.where(searching & ~before, mid, high))

    # Derived from ids, so that inside shard_map the loop carry varies as ids do.
    low = (ids * 0).astype(jnp.int32)
    bounds = (low, low + m)
    first, _ = lax.fori_loop(0, m.bit_length(), halve, bounds)
    found_id, found_position = entry(first)
    return (first < m) & (found_id == ids) & (found_position <= stop)


def _array_module(index):
    """jnp for traced indices (inside kernels), numpy for concrete Python ints."""
    return jnp if isinstance(index, jax.Array) else np


def _div(a, b: int):
    """Floor division of non-negative indices (lax.div: Triton lowers it, not ``//``)."""
    return lax.div(a, jnp.asarray(b, a.dtype)) if isinstance(a, jax.Array) else a // b


def _cdiv(a, b: int):
    return _div(a + b - 1, b)

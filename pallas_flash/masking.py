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

CausalAlignment = Literal["top_left", "bottom_right"]

# A band limit that no index difference reaches: stands for "unbounded".
_UNBOUNDED = 1 << 30


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
        alignment), or ``None`` for no window.
    """

    seq_q: int
    seq_kv: int
    is_causal: bool = False
    causal_alignment: CausalAlignment = "top_left"
    window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
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

    @property
    def offset(self) -> int:
        """Diagonal offset: query ``i`` is aligned with key ``i + offset``."""
        return self.seq_kv - self.seq_q if self.causal_alignment == "bottom_right" else 0

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


def _array_module(index):
    """jnp for traced indices (inside kernels), numpy for concrete Python ints."""
    return jnp if isinstance(index, jax.Array) else np


def _div(a, b: int):
    """Floor division of non-negative indices (lax.div: Triton lowers it, not ``//``)."""
    return lax.div(a, jnp.asarray(b, a.dtype)) if isinstance(a, jax.Array) else a // b


def _cdiv(a, b: int):
    return _div(a + b - 1, b)

"""Block ranges of MaskSpec against brute force over every tile."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_flash.masking import MaskSpec


def _tiles(mask: MaskSpec, block_q: int, block_kv: int):
    """(any visible, all visible) per tile, brute force; padded keys count as hidden."""
    num_q = -(-mask.seq_q // block_q)
    num_kv = -(-mask.seq_kv // block_kv)
    vis = np.asarray(mask.block_visible(0, num_q * block_q, 0, num_kv * block_kv))
    tiles = vis.reshape(num_q, block_q, num_kv, block_kv).transpose(0, 2, 1, 3)
    return tiles.any(axis=(2, 3)), tiles.all(axis=(2, 3)), num_q


specs = st.builds(
    MaskSpec,
    seq_q=st.integers(1, 90),
    seq_kv=st.integers(1, 90),
    is_causal=st.booleans(),
    causal_alignment=st.sampled_from(["top_left", "bottom_right"]),
    window=st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(0, 40))),
)
blocks = st.sampled_from([16, 32])


def _check_range(ranges, any_visible, all_visible):
    first, full_first, full_last, last = (int(x) for x in ranges)
    assert first <= full_first <= full_last <= last
    visible_idx = np.flatnonzero(any_visible)
    # Every tile with a visible pair is inside [first, last); the range is tight.
    if visible_idx.size:
        assert first == visible_idx[0] and last == visible_idx[-1] + 1
    else:
        assert first == last
    # Tiles run without a mask are exactly the fully visible ones.
    fast = np.zeros_like(all_visible)
    fast[full_first:full_last] = True
    assert np.array_equal(fast, all_visible)


@settings(max_examples=150, deadline=None)
@given(mask=specs, block_q=blocks, block_kv=blocks)
def test_kv_blocks_match_brute_force(mask, block_q, block_kv):
    any_visible, all_visible, num_q = _tiles(mask, block_q, block_kv)
    for i in range(num_q):
        ranges = mask.kv_blocks(i * block_q, block_q, block_kv)
        _check_range(ranges, any_visible[i], all_visible[i])


@settings(max_examples=150, deadline=None)
@given(mask=specs, block_q=blocks, block_kv=blocks)
def test_q_blocks_match_brute_force(mask, block_q, block_kv):
    any_visible, all_visible, num_q = _tiles(mask, block_q, block_kv)
    for j in range(any_visible.shape[1]):
        ranges = mask.q_blocks(j * block_kv, block_kv, block_q, num_q)
        _check_range(ranges, any_visible[:, j], all_visible[:, j])


def test_visible_fraction_causal_is_about_half():
    assert MaskSpec(1000, 1000, is_causal=True).visible_fraction() == 1000 * 1001 / 2 / 1e6
    assert MaskSpec(10, 10).visible_fraction() == 1.0


# Window sides from tight to far past any sequence (2**31 - 1: a common "unbounded").
window_sides = st.one_of(st.integers(0, 100), st.sampled_from([2**31 - 1, 10**12, 2**62]))


@settings(max_examples=25, deadline=None)
@given(seq_q=st.integers(1, 60), seq_kv=st.integers(1, 60), is_causal=st.booleans(),
       alignment=st.sampled_from(["top_left", "bottom_right"]),
       window=st.tuples(window_sides, window_sides))
def test_window_is_clamped_to_the_sequences(seq_q, seq_kv, is_causal, alignment, window):
    """Any window, however wide, gives the band it spells (brute force in int64 here),
    with small sides every kernel can add in int32; one that hides nothing is no window."""
    spec = MaskSpec(seq_q, seq_kv, is_causal, alignment, window)
    diff = np.arange(seq_kv, dtype=np.int64)[None, :] - np.arange(seq_q, dtype=np.int64)[:, None]
    offset = seq_kv - seq_q if alignment == "bottom_right" else 0
    want = (diff >= offset - window[0]) & (diff <= offset + window[1])
    if is_causal:
        want &= diff <= offset
    assert np.array_equal(np.asarray(spec.block_visible(0, seq_q, 0, seq_kv)), want)
    if spec.window is None:
        assert spec.band == MaskSpec(seq_q, seq_kv, is_causal, alignment).band
    else:
        assert max(spec.window) < seq_q + seq_kv
        assert not np.array_equal(want, np.asarray(
            MaskSpec(seq_q, seq_kv, is_causal, alignment).block_visible(0, seq_q, 0, seq_kv)))

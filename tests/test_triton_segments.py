"""The Triton kernels skip whole tiles whose segment ids cannot meet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv

import pallas_flash as pf
from pallas_flash.triton import TritonConfig
from pallas_flash.triton.tiles import segment_operands


def test_disjoint_tiles_are_never_read():
    # Keys 32..63 belong to a segment no query has, and their values are NaN. Any kernel that
    # touched those tiles would compute 0 · NaN = NaN; skipped tiles leave no trace.
    q, k, v, d_out = random_qkv(1, 64, 64, 2, 2, 32)
    v = v.at[:, 32:].set(jnp.nan)
    k = k.at[:, 32:].set(jnp.nan)
    q_ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 32)[None]       # queries: 0 and 1
    kv_ids = jnp.concatenate([q_ids[:, :32], jnp.full((1, 32), 99, jnp.int32)], axis=1)
    config = TritonConfig(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)

    def f(q, k, v):
        return pf.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                            implementation="triton", interpret=True, config=config)

    out, vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp(d_out)
    assert np.all(np.isfinite(np.asarray(out)))
    # Queries of segment 1 see no key: output 0. Segment 0 attends to keys 0..31.
    assert np.all(np.asarray(out[:, 32:]) == 0)
    assert np.abs(np.asarray(out[:, :32])).max() > 0
    for g in (dq, dk[:, :32], dv[:, :32]):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dk[:, 32:]) == 0) and np.all(np.asarray(dv[:, 32:]) == 0)


def _meets(q_ids, kv_ids, block):
    """Brute force: does query tile i hold an id equal to one of key tile j's?"""
    q_tiles, kv_tiles = q_ids.reshape(-1, block), kv_ids.reshape(-1, block)
    return np.array([[bool(np.intersect1d(a, b).size) for b in kv_tiles] for a in q_tiles])


@pytest.mark.parametrize("packed_in_order", [True, False])
def test_spans_cover_every_tile_that_can_meet(packed_in_order):
    rng = np.random.default_rng(int(packed_in_order))
    ids = np.sort(rng.integers(0, 6, 128)) if packed_in_order else rng.integers(0, 6, 128)
    ids = jnp.asarray(ids, jnp.int32)[None]
    for walk_kv in (True, False):
        (_, _, spans), _ = segment_operands((ids, ids), 128, 128, 16, 16, walk_kv=walk_kv)
        meets = _meets(np.asarray(ids[0]), np.asarray(ids[0]), 16)
        meets = meets if walk_kv else meets.T
        for tile, (lo, hi) in enumerate(np.asarray(spans[0]).T):
            hits = np.flatnonzero(meets[tile])
            assert lo <= hits.min() and hits.max() < hi   # nothing that can meet is cut
            if packed_in_order:                             # and in order, nothing else
                assert (lo, hi) == (hits.min(), hits.max() + 1)


def test_span_of_a_tile_that_meets_nothing_is_empty():
    q_ids = jnp.zeros((1, 32), jnp.int32)
    kv_ids = jnp.concatenate([jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 16), jnp.int32)], 1)
    (_, _, spans), _ = segment_operands((q_ids, kv_ids), 32, 32, 16, 16, walk_kv=False)
    np.testing.assert_array_equal(np.asarray(spans[0]).T, [[0, 2], [0, 0]])

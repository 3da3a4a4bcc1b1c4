"""The Triton kernels' tile spans: every tile whose segment ids can meet is visited (that
NaN in tiles that cannot meet leaves no trace: the shared suite, tests/test_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.triton.tiles import segment_operands


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
        for tile, (lo, hi) in enumerate(np.asarray(spans[0, :2]).T):
            hits = np.flatnonzero(meets[tile])
            assert lo <= hits.min() and hits.max() < hi   # nothing that can meet is cut
            if packed_in_order:                             # and in order, nothing else
                assert (lo, hi) == (hits.min(), hits.max() + 1)


def _uniform(q_ids, kv_ids, block, ignore_q_padding: bool):
    """Brute force: do query tile i and key tile j hold one id only (padded query rows,
    id -1, left out when ``ignore_q_padding``)?"""
    q_tiles, kv_tiles = q_ids.reshape(-1, block), kv_ids.reshape(-1, block)
    def ids(tile, padding):
        return set(tile.tolist()) - ({-1} if padding else set())
    return np.array([[len(ids(a, ignore_q_padding) | ids(b, False)) == 1
                      and bool(ids(a, ignore_q_padding)) for b in kv_tiles]
                     for a in q_tiles])


@pytest.mark.parametrize("packed_in_order", [True, False])
@pytest.mark.parametrize("walk_kv", [True, False])
def test_unmasked_tiles_hold_one_id(packed_in_order, walk_kv):
    """spans[:, 2:] names only tiles of one id (so they may skip the segment mask), and,
    with documents packed in order, all of them; padded query rows count only in dK/dV."""
    rng = np.random.default_rng(7 + int(packed_in_order))
    lengths = rng.integers(1, 60, 12)
    ids = np.repeat(np.arange(12), lengths)[:120]
    if not packed_in_order:
        ids = rng.permutation(ids)
    q_ids = jnp.asarray(ids[:100], jnp.int32)[None]    # 100 rows: the last tile padded
    kv_ids = jnp.asarray(ids, jnp.int32)[None]
    (q_pad, kv_pad, spans), _ = segment_operands((q_ids, kv_ids), 112, 128, 16, 16,
                                                 walk_kv=walk_kv)
    uniform = _uniform(np.asarray(q_pad[0]), np.asarray(kv_pad[0]), 16,
                       ignore_q_padding=walk_kv)
    uniform = uniform if walk_kv else uniform.T
    for tile, (lo, hi, full_lo, full_hi) in enumerate(np.asarray(spans[0]).T):
        assert lo <= full_lo <= full_hi <= hi or full_lo == full_hi == 0
        assert uniform[tile, full_lo:full_hi].all()
        if packed_in_order:
            assert full_hi - full_lo == uniform[tile].sum()
    if packed_in_order:   # the test holds tiles that skip the mask
        assert (np.asarray(spans[0, 3]) > np.asarray(spans[0, 2])).any()


def test_span_of_a_tile_that_meets_nothing_is_empty():
    q_ids = jnp.zeros((1, 32), jnp.int32)
    kv_ids = jnp.concatenate([jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 16), jnp.int32)], 1)
    (_, _, spans), _ = segment_operands((q_ids, kv_ids), 32, 32, 16, 16, walk_kv=False)
    np.testing.assert_array_equal(np.asarray(spans[0, :2]).T, [[0, 2], [0, 0]])


def test_segment_walk_lowers_for_hopper():
    """The compiled kernels' walk with segment ids (masked edges, unmasked one-id tiles)
    lowers to Triton for an H200 on the CPU: forward, dK/dV and dQ; only a GPU compiles
    and runs them (tests/gpu)."""
    import jax

    import pallas_flash as pf

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                       platform="gpu")

    def gradients(q, k, v, q_ids, kv_ids):
        def loss(q, k, v):
            return pf.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                is_causal=True, implementation="triton").sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    qkv = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
        text = jax.jit(gradients).trace(qkv, qkv, qkv, ids, ids).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3

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


def test_segment_walk_lowers_for_hopper():
    """The compiled kernels' walk with segment ids (each tile's span, the segment mask)
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

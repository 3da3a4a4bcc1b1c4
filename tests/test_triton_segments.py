"""The Triton kernels skip whole tiles whose segment ids cannot meet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support import random_qkv

import pallas_flash as pf
from pallas_flash.triton import TritonConfig


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

"""The compiled Triton flex kernels (pallas_flash/triton/flex.py) on the GPU against
flex_reference, at real sizes: functions of the tile's indices, and functions that read
captured arrays (loads from their refs at the tile's indices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.flex import convert_score_mod, create_block_mask, flex_reference
from pallas_flash.triton.flex import flex_attention

PREFIX = jnp.asarray(300, jnp.int32)  # a captured scalar: read whole, no traced index
SEQ = 1100  # a padded last block for both tilings
DOCUMENTS = jnp.asarray(np.searchsorted([250, 600, 610], np.arange(SEQ), side="right"),
                        jnp.int32)[None].repeat(2, 0)
SLOPES = jnp.asarray([2.0 ** -(i + 1) for i in range(8)], jnp.float32)
TABLE = jax.random.normal(jax.random.PRNGKey(7), (16, 8), jnp.float32)


def _bucket(relative):
    """A relative-position bucket of ``kv - q`` (16 buckets, clamped)."""
    return jnp.clip(relative // 8, -8, 7) + 8

CASES = {
    "causal": (lambda b, h, q, kv: q >= kv, None),
    "sliding_window": (lambda b, h, q, kv: (kv <= q) & (q - kv < 256), None),
    "prefix_lm": (lambda b, h, q, kv: (kv <= q) | (kv < PREFIX), None),
    "alibi_by_arithmetic": (lambda b, h, q, kv: q >= kv,
                            lambda s, b, h, q, kv: s - 0.05 * (h + 1) * (q - kv)),
    "tanh_cap": (lambda b, h, q, kv: kv < 1000,
                 lambda s, b, h, q, kv: 20.0 * jnp.tanh(s / 20.0)),
    "documents": (lambda b, h, q, kv: DOCUMENTS[b, q] == DOCUMENTS[b, kv], None),
    "alibi_slopes": (lambda b, h, q, kv: q >= kv,
                     lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q)),
    "bucket_table": (lambda b, h, q, kv: q >= 0,
                     lambda s, b, h, q, kv: s + TABLE[_bucket(kv - q), h]),
}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("block_size", [(64, 64), (128, 64)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", CASES)
def test_compiled_flex_matches_reference(name, head_dim, block_size):
    mask_mod, score_mod = CASES[name]
    batch, seq, heads, kv_heads = 2, SEQ, 8, 2  # GQA
    keys = jax.random.split(jax.random.PRNGKey(head_dim), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, seq, kv_heads, head_dim), jnp.bfloat16)
            for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    bm = create_block_mask(mask_mod, batch=batch if name == "documents" else None, seq_q=seq,
                           seq_kv=seq, block_size=block_size)
    score = None if score_mod is None else convert_score_mod(score_mod)

    def run(attention):
        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return out, lse, vjp((d_out, jnp.zeros_like(lse)))

    got = jax.jit(lambda: run(lambda q, k, v: flex_attention(q, k, v, bm, score_mod=score)))()
    want = jax.jit(lambda: run(lambda q, k, v: flex_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        block_mask=bm, score_mod=score_mod)))()
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got[:2], *got[2]),
                           (*want[:2], *want[2]), strict=True):
        assert _rel(a, b) < (1e-3 if label == "lse" else 2e-2), (label, _rel(a, b))

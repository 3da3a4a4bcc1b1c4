"""Compiled Triton kernels on the GPU vs a float32 XLA reference, at real sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import standard_attention

CASES = [
    # (batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, dtype)
    (2, 2048, 2048, 16, 16, 128, False, jnp.bfloat16),
    (2, 2048, 2048, 16, 16, 128, True, jnp.bfloat16),
    (1, 4096, 4096, 32, 32, 64, True, jnp.bfloat16),
    (1, 2048, 2048, 8, 8, 256, True, jnp.bfloat16),
    (1, 2048, 2048, 8, 8, 256, False, jnp.float16),
    (2, 1000, 1000, 8, 2, 128, True, jnp.bfloat16),   # GQA, odd length
    (1, 777, 1500, 12, 4, 96, False, jnp.float16),    # padded head dim, seq_q != seq_kv
    (1, 513, 513, 4, 1, 192, True, jnp.float32),      # MQA, float32 (IEEE products)
    (1, 1024, 1024, 8, 8, 32, True, jnp.float32),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, dtype = case
    keys = jax.random.split(jax.random.PRNGKey(seq_q * head_dim), 4)
    q = jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_kv, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_kv, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(keys[3], q.shape, dtype)
    mask = MaskSpec(seq_q, seq_kv, causal)

    def ours(q, k, v):
        return pf.attention(q, k, v, is_causal=causal, implementation="triton")

    def ref(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        with jax.default_matmul_precision("highest"):
            return standard_attention(q, k, v, mask=mask)[0]

    out, vjp = jax.vjp(ours, q, k, v)
    ref_out, ref_vjp = jax.vjp(ref, q, k, v)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    assert _rel(out, ref_out) < tol
    for got, want in zip(vjp(d_out), ref_vjp(d_out.astype(jnp.float32)), strict=True):
        assert _rel(got, want) < 2 * tol

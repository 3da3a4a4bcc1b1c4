"""Variants through the compiled kernels on the GPU vs a float32 XLA reference.

Segment ids (with tile skipping), padding lengths, sliding window, soft-cap, sinks, bias and
mask at real sizes, for every GPU implementation that accepts them (the API falls back to
Triton where the Mosaic kernel does not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64

IMPLEMENTATIONS = ["triton", None]  # None: the API's choice (mosaic on Hopper when it can)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(seq + heads), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(keys[3], q.shape, dtype)
    return q, k, v, d_out


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents(implementation, causal):
    q, k, v, d_out = _inputs(2, 1024, 4, 2, 128)
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 128)[None].repeat(2, axis=0)
    ids = ids.at[1].set(jnp.sort(jax.random.randint(jax.random.PRNGKey(0), (1024,), 0, 5)))
    lengths = jnp.array([1024, 900])

    def f(q, k, v):
        return pf.attention(q, k, v, is_causal=causal, q_segment_ids=ids,
                            query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                            implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(d_out)
    valid = jnp.arange(1024)[None] < lengths[:, None]
    segments = (jnp.where(valid, ids, -1), jnp.where(valid, ids, -2))
    ref_out, _, ref_grads = attention_float64(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        mask=MaskSpec(1024, 1024, causal), segment_ids=segments,
        d_out=d_out.astype(jnp.float32))
    assert _rel(out, ref_out) < 1e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_window_softcap_sinks(implementation):
    q, k, v, d_out = _inputs(1, 777, 8, 2, 64)
    sinks = jnp.linspace(-2.0, 2.0, 8)

    def f(q, k, v, sinks):
        return pf.attention(q, k, v, is_causal=True, local_window_size=(200, 0),
                            logits_soft_cap=20.0, sinks=sinks, implementation=implementation)

    out, vjp = jax.vjp(f, q * 3, k, v, sinks)
    grads = vjp(d_out)
    ref_out, _, ref_grads = attention_float64(
        (q * 3).astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        mask=MaskSpec(777, 777, True, window=(200, 0)), softcap=20.0, sinks=sinks,
        d_out=d_out.astype(jnp.float32))
    assert _rel(out, ref_out) < 1e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 2e-2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bias_shape", [(1, 1, 999, 999), (2, 1, 1, 999), (2, 8, 999, 999)])
def test_bias_and_mask(implementation, bias_shape):
    """Broadcasting bias (with its gradient) and a padding-style mask through the kernels."""
    q, k, v, d_out = _inputs(2, 999, 8, 2, 128)
    bias = jax.random.normal(jax.random.PRNGKey(5), bias_shape, jnp.float32)
    lengths = jnp.array([999, 700])
    mask = jnp.arange(999)[None, None, None, :] < lengths[:, None, None, None]

    def f(q, k, v, bias):
        return pf.attention(q, k, v, bias, mask, is_causal=True, implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v, bias)
    grads = vjp(d_out)
    ref_out, _, ref_grads = attention_float64(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        mask=MaskSpec(999, 999, True), bias=bias, attn_mask=mask,
        d_out=d_out.astype(jnp.float32))
    assert _rel(out, ref_out) < 1e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert _rel(got, want) < 2e-2

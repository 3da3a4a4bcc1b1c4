"""Shared test helpers: fresh random inputs, error metrics, the implementations under test."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf

_seed = itertools.count(1000)

# Every implementation runs the same suite. Pallas kernels run in interpret mode on CPU;
# small tiles so that short test sequences still span several blocks and partial masks.
IMPLEMENTATIONS = {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="triton", interpret=True, config=None),
}


def implementation_kwargs(name: str, head_dim: int) -> dict:
    kwargs = dict(IMPLEMENTATIONS[name])
    if name == "triton":
        from pallas_flash.triton import TritonConfig

        kwargs["config"] = TritonConfig(block_q=32, block_kv=16, bwd_block_q=16,
                                        bwd_block_kv=32)
    return kwargs


def fresh_key() -> jax.Array:
    """A new PRNG key for every draw: inputs are never reused across checks."""
    return jax.random.PRNGKey(next(_seed))


def random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype=jnp.float32):
    """q [B, T, N, D], k/v [B, S, K, D] and a cotangent dO, all N(0, 1) (never zeros)."""
    keys = jax.random.split(fresh_key(), 4)
    q = jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, seq_kv, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, seq_kv, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(keys[3], (batch, seq_q, heads, head_dim), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, d_out))


def rel_err(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ over every element; NaN/inf anywhere gives inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


def run_attention(impl: str, q, k, v, d_out, **kwargs):
    """Forward (out, lse [B, T, N]) and (dq, dk, dv) of <out, d_out> through `impl`."""
    extra = implementation_kwargs(impl, q.shape[-1])

    def f(q, k, v):
        return pf.attention(q, k, v, return_residual=True, **extra, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    return out, lse, grads

"""FlashSelfAttention's decode step on the GPU: a prefill, then one token at a time through
the cache (split-KV decode on the compiled kernels), against the whole sequence through the
layer without a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_flash.nn import FlashSelfAttention


def _decode_then_compare(implementation):
    layer = FlashSelfAttention(1024, 8, num_kv_heads=2, rngs=nnx.Rngs(0),
                               implementation=implementation, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (4, 640, 1024), jnp.bfloat16)
    whole = layer(x)                                   # causal, no cache
    layer.init_cache(4, 1024)
    steps = [layer(x[:, :512], decode=True)]           # the prefill: 512 tokens
    step = nnx.jit(lambda layer, token: layer(token, decode=True))
    steps += [step(layer, x[:, t:t + 1]) for t in range(512, 640)]
    return np.asarray(jnp.concatenate(steps, axis=1), np.float64), np.asarray(whole, np.float64)


def test_decode_steps_match_the_whole_sequence():
    decoded, whole = _decode_then_compare(None)        # the GPU's choice of kernels
    assert np.isfinite(decoded).all()
    assert np.linalg.norm(decoded - whole) / np.linalg.norm(whole) < 2e-2

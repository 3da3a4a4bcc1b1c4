"""The Mosaic GPU forward on a real Hopper GPU, at real sizes for each shape class.

Skipped unless the default device is a GPU of compute capability 9.0. The reference is
``reference.standard_attention`` on float32 copies of the inputs (on the same GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import reference
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, default_config, forward


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16, F16 = jnp.bfloat16, jnp.float16


def _inputs(shape_q, shape_kv, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], shape_q, dtype),
            jax.random.normal(keys[1], shape_kv, dtype),
            jax.random.normal(keys[2], shape_kv, dtype))


def _check(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, *, config=None, seed=0,
           **mask_kwargs):
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed)
    config = config or default_config(q.shape, k.shape, dtype, mask)
    scale = head_dim ** -0.5
    out, lse = jax.jit(lambda q, k, v: forward(q, k, v, None, mask=mask, scale=scale,
                                               config=config, interpret=False))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seq_q) and lse.dtype == jnp.float32
    ref_out, ref_lse = reference.standard_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale, mask=mask)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    ref_out, ref_lse = np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_shape_classes(head_dim, causal, dtype):
    _check(2, 2048, 2048, 2048 // head_dim // 2, 2048 // head_dim // 2, head_dim, dtype,
           is_causal=causal)


@pytest.mark.parametrize("config", [MosaicConfig(64, 128, 2), MosaicConfig(64, 64, 3),
                                    MosaicConfig(64, 256, 2), MosaicConfig(128, 128, 2),
                                    MosaicConfig(64, 128, 2, overlap=True),
                                    MosaicConfig(64, 64, 3, overlap=True)])
def test_configs(config):
    _check(1, 1024, 1024, 8, 8, 64, BF16, config=config, is_causal=True)


def test_gqa_odd_lengths_bottom_right():
    _check(2, 1000, 1500, 16, 4, 128, BF16, is_causal=True, causal_alignment="bottom_right")


def test_padded_head_dim_mqa():
    _check(3, 777, 777, 4, 1, 96, F16)


def test_window_and_empty_rows():
    _check(1, 4096, 4096, 4, 2, 64, BF16, window=(512, 128))
    # Queries past the last key see nothing under a window: out 0, lse EMPTY_ROW_LSE.
    _check(1, 1024, 200, 2, 2, 128, BF16, window=(16, 16))


def test_api_dispatch_and_gradients():
    q, k, v = _inputs((2, 512, 8, 128), (2, 512, 2, 128), BF16, seed=3)

    def loss(impl):
        return lambda q, k, v: jnp.sum(pallas_flash.attention(
            q, k, v, is_causal=True, implementation=impl).astype(jnp.float32) ** 2)

    assert pallas_flash.default_implementation() == "mosaic"
    value, grads = jax.jit(jax.value_and_grad(loss("mosaic"), argnums=(0, 1, 2)))(q, k, v)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2

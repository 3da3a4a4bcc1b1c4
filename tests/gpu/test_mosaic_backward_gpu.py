"""The Mosaic GPU backward on a real Hopper GPU, against the float64 oracle.

Skipped unless the default device is a GPU of compute capability 9.0. Every case draws
fresh inputs, computes ``(out, lse)`` with the Mosaic forward and ``(dq, dk, dv)`` with
:func:`pallas_flash.mosaic.backward.backward`, and compares all three with
``reference.attention_float64`` (‖got − ref‖ / ‖ref‖ < 1e-2; NaN never passes). Head dim
256 checks the documented fallback to the Triton backward.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err

import pallas_flash
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, default_config, forward
from pallas_flash.reference import attention_float64

mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16, F16 = jnp.bfloat16, jnp.float16


def _gradients(q, k, v, d_out, mask: MaskSpec, scale: float, config):
    def run(q, k, v, d_out):
        fwd_config = default_config(q.shape, k.shape, q.dtype, mask)
        out, lse = forward(q, k, v, None, mask=mask, scale=scale, config=fwd_config,
                           interpret=False)
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        return mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                        scale=scale, config=config or fwd_config,
                                        interpret=False)
    return jax.jit(run)(q, k, v, d_out)


def _check(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, *, config=None,
           **mask_kwargs):
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    grads = _gradients(q, k, v, d_out, mask, scale, config)
    _, _, want = attention_float64(q, k, v, scale=scale, mask=mask,
                                   d_out=np.asarray(d_out, np.float64))
    for name, got, ref, x in zip("qkv", grads, want, (q, k, v), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        err = rel_err(got, ref)
        assert err < 1e-2, f"d{name}: relative error {err}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_shape_classes(head_dim, causal, dtype):
    _check(1, 512, 512, 4, 2, head_dim, dtype, is_causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fused_dq_mode(head_dim, causal, dtype):
    """dQ by TMA reduce-adds from the dK/dV kernel (``deterministic=False``)."""
    config = MosaicBackwardConfig(block_q=64, deterministic=False)
    _check(1, 512, 512, 4, 2, head_dim, dtype, config=config, is_causal=causal)


def test_default_mode_is_bitwise_reproducible():
    mask = MaskSpec(seq_q=512, seq_kv=512, is_causal=True)
    q, k, v, d_out = random_qkv(1, 512, 512, 4, 1, 128, BF16)
    config = MosaicBackwardConfig()
    assert config.deterministic
    first = _gradients(q, k, v, d_out, mask, 0.1, config)
    second = _gradients(q, k, v, d_out, mask, 0.1, config)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_odd_lengths_bottom_right(deterministic):
    _check(1, 600, 900, 4, 2, 128, BF16, is_causal=True, causal_alignment="bottom_right",
           config=MosaicBackwardConfig(deterministic=deterministic))


def test_more_queries_than_keys_bottom_right():  # the first 400 rows see no key
    _check(1, 600, 200, 4, 4, 64, F16, is_causal=True, causal_alignment="bottom_right")


def test_padded_head_dim_mqa_window():
    _check(2, 377, 450, 2, 1, 96, BF16, window=(100, 30))


def test_through_the_api():
    """pallas_flash.attention(implementation="mosaic"): forward and backward both Mosaic."""
    q, k, v, d_out = random_qkv(1, 700, 700, 4, 2, 128, BF16)

    def f(q, k, v):
        return pallas_flash.attention(q, k, v, is_causal=True, implementation="mosaic")

    grads = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(q, k, v, d_out)
    mask = MaskSpec(seq_q=700, seq_kv=700, is_causal=True)
    _, _, want = attention_float64(q, k, v, mask=mask, d_out=np.asarray(d_out, np.float64))
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2

"""``fp8.attention_fp8_quantized`` and ``out_scale`` through the FP8 Mosaic GPU kernel on a
real Hopper GPU (skipped elsewhere): pre-quantized operands give what ``attention_fp8``
gives on the same operands, bit for bit (the same kernel on the same bytes), and per-tensor
scales give the per-tensor XLA reference to the kernel's known tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import bits, rel_err

from pallas_flash import fp8
from pallas_flash.mosaic import forward_fp8
from pallas_flash.tutorial import fp8_study


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")


def _inputs(batch, seq_q, seq_kv, heads, kv_heads, head_dim, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), jnp.bfloat16),
            *(jax.random.normal(key, (batch, seq_kv, kv_heads, head_dim), jnp.bfloat16)
              for key in keys[1:]))


@pytest.mark.parametrize(("shape", "causal", "v_transposed"), [
    ((2, 2048, 2048, 8, 8, 128), True, True),
    ((1, 1000, 1500, 16, 4, 64), True, False),      # GQA, odd lengths, V sequence-major
    ((1, 2048, 2048, 8, 8, 256), False, False),
])
def test_quantized_operands_match_attention_fp8(shape, causal, v_transposed):
    q, k, v = _inputs(*shape, seed=sum(shape))
    config = forward_fp8.default_config(shape[-1], is_causal=causal, seq_kv=shape[2])
    ops = jax.jit(lambda q, k, v: fp8.quantize_operands(
        q, k, v, block_q=config.block_q, block_kv=config.block_kv))(q, k, v)
    v8 = ops.vt if v_transposed else jnp.transpose(ops.vt, (0, 3, 1, 2))
    out, lse = jax.jit(lambda *a: fp8.attention_fp8_quantized(
        *a, v_transposed=v_transposed, is_causal=causal, implementation="mosaic",
        return_residual=True))(ops.q, ops.k, v8, ops.q_scale, ops.k_scale, ops.v_scale)
    want, want_lse = jax.jit(lambda q, k, v: fp8.attention_fp8(
        q, k, v, is_causal=causal, implementation="mosaic", return_residual=True))(q, k, v)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


def test_per_tensor_scales_and_e4m3_output():
    """cuDNN's FP8 convention (scales per tensor, e4m3 output with a given scale) through
    the kernel: within the kernel's tolerance of the per-tensor reference (1e-2 against
    the online emulation, 3e-2 against the reference: tests/gpu/test_fp8_gpu.py)."""
    q, k, v = _inputs(2, 2048, 2048, 8, 8, 128, seed=7)
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize(x, None) for x in (q, k, v))
    ref = np.asarray(fp8_study.attention_fp8_reference(q, k, v, scaling="tensor"), np.float32)
    out_scale = float(np.abs(ref).max()) / fp8.E4M3_MAX
    out, (out8, amax) = (jax.jit(lambda *a, s=s: fp8.attention_fp8_quantized(
        *a, implementation="mosaic", out_scale=s))(q8, k8, v8, sq, sk, sv)
        for s in (None, out_scale))
    assert rel_err(out, ref) < 3e-2
    back = np.asarray(out8, np.float32) * out_scale
    assert np.isfinite(back).all()
    assert float(amax) == float(np.abs(np.asarray(out, np.float32)).max())
    assert rel_err(back, out) < 4e-2  # e4m3's rounding of the output: ≤ 2^-4 relative


@pytest.mark.parametrize("causal", [False, True])
def test_gradient_through_the_kernel(causal):
    """jax.grad of attention_fp8 on the kernel (the bf16 backward kernels on its residuals)
    within a few % of float32 attention's gradient, as on the CPU."""
    q, k, v = _inputs(1, 2048, 2048, 8, 2, 128, seed=11 + causal)
    ct = jax.random.normal(jax.random.key(3), q.shape, jnp.bfloat16)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)
                                       * ct.astype(jnp.float32))
    grads = jax.jit(jax.grad(loss(lambda q, k, v: fp8.attention_fp8(
        q, k, v, is_causal=causal, implementation="mosaic")), argnums=(0, 1, 2)))(q, k, v)
    exact = jax.jit(jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal,
        implementation="xla")), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, exact, strict=True):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert rel_err(got, want) < 5e-2


def test_deterministic_gradient_is_reproducible():
    """attention_fp8(..., deterministic=True): two runs of jax.grad give the same bits, and
    the same gradient as the default backward up to its float32 summation order."""
    q, k, v = _inputs(1, 4096, 4096, 16, 16, 128, seed=21)
    ct = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)

    def grads(deterministic):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fp8.attention_fp8(
            q, k, v, is_causal=True, implementation="mosaic", deterministic=deterministic
        ).astype(jnp.float32) * ct.astype(jnp.float32)), argnums=(0, 1, 2)))(q, k, v)

    first, second, fused = grads(True), grads(True), grads(False)
    for a, b, c in zip(first, second, fused, strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(bits(a), bits(b))
        assert rel_err(a, c) < 1e-2

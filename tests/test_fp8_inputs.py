"""FP8 inputs, outputs and gradients of ``pallas_flash.fp8``: ``attention_fp8_quantized``
(operands that are already e4m3, per tensor or per block), ``out_scale`` (an e4m3 output)
and ``jax.grad`` of ``attention_fp8`` (the bf16 backward on the FP8 forward's residuals).

On the CPU these run the XLA implementation, whose arithmetic is the kernel's
specification; the kernel on the same operands is in ``tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import fp8, fp8_format
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig
from pallas_flash.reference import attention_float64
from pallas_flash.tutorial import fp8_study
from tests.support import fresh_key, rel_err

CONFIG = MosaicConfig(64, 64, 2)


def _inputs(batch, seq_q, seq_kv, heads, kv_heads, head_dim):
    keys = jax.random.split(fresh_key(), 3)
    return (jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), jnp.bfloat16),
            *(jax.random.normal(key, (batch, seq_kv, kv_heads, head_dim), jnp.bfloat16)
              for key in keys[1:]))


def _same(got, want):
    """Bit for bit (NaN never equals)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("v_transposed", [False, True])
def test_quantized_operands_give_what_attention_fp8_gives(v_transposed):
    """The operands attention_fp8 quantizes, handed over already quantized (GQA, causal,
    odd lengths): the same out and lse, bit for bit, in either V layout."""
    q, k, v = _inputs(2, 90, 150, 4, 2, 64)
    ops = fp8.quantize_operands(q, k, v, block_q=CONFIG.block_q, block_kv=CONFIG.block_kv)
    v8 = ops.vt if v_transposed else jnp.transpose(ops.vt, (0, 3, 1, 2))
    out, lse = jax.jit(lambda *a: fp8.attention_fp8_quantized(
        *a, v_transposed=v_transposed, is_causal=True, config=CONFIG,
        return_residual=True))(ops.q, ops.k, v8, ops.q_scale, ops.k_scale, ops.v_scale)
    want_out, want_lse = fp8.attention_fp8(q, k, v, is_causal=True, config=CONFIG,
                                           return_residual=True)
    assert out.dtype == jnp.bfloat16 and lse.shape == (2, 90, 4)
    _same(out, want_out)
    _same(lse, want_lse)


def test_per_tensor_scales_match_the_per_tensor_reference():
    """cuDNN's FP8 convention (one scale per tensor): the scalars are broadcast to the
    kernel's tiles, which changes no product: equal to the per-tensor reference."""
    q, k, v = _inputs(1, 128, 128, 2, 2, 64)
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize(x, None) for x in (q, k, v))
    assert sq.ndim == 0
    out = fp8.attention_fp8_quantized(q8, k8, v8, sq, sk, sv, config=CONFIG)
    _same(out, fp8_study.attention_fp8_reference(q, k, v, scaling="tensor"))


def test_coarser_scale_blocks_are_repeated_over_the_kernel_tiles():
    """Scales per 128 queries / 256 keys (an FP8 KV cache's blocks, say) on 64 x 64 tiles:
    the reference quantized with those blocks."""
    q, k, v = _inputs(1, 200, 300, 2, 2, 64)
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize(x, b) for x, b in ((q, 128), (k, 256),
                                                                      (v, 256)))
    out = fp8.attention_fp8_quantized(q8, k8, v8, sq, sk, sv, scale_blocks=(128, 256),
                                      config=CONFIG)
    _same(out, fp8_study.attention_fp8_reference(q, k, v, block_q=128, block_kv=256))
    with pytest.raises(ValueError, match="scale_blocks"):  # the scales are per 256, not 64
        fp8.attention_fp8_quantized(q8, k8, v8, sq, sk, sv, config=CONFIG)


def test_e4m3_output_with_a_given_scale():
    """out_scale: out ≈ out_fp8 · out_scale to e4m3's precision, the amax of the bf16 out;
    a scale too small saturates at ±448 instead of making NaN."""
    q, k, v = _inputs(1, 64, 64, 2, 1, 64)
    out = np.asarray(fp8.attention_fp8(q, k, v, config=CONFIG), np.float32)
    amax = float(np.abs(out).max())
    out8, got_amax, lse = fp8.attention_fp8(q, k, v, config=CONFIG, out_scale=amax / 448,
                                            return_residual=True)
    assert out8.dtype == fp8.E4M3 and out8.shape == out.shape and lse.shape == (1, 64, 2)
    assert float(got_amax) == amax
    back = np.asarray(out8, np.float32) * (amax / 448)
    assert not np.isnan(back).any()
    # e4m3: 3 mantissa bits, so half an ulp is 2^-4 relative; below 2^-6 · 448 it is
    # subnormal with an absolute step of 2^-9 · scale.
    np.testing.assert_array_less(np.abs(back - out),
                                 np.abs(out) / 16 + 2.0 ** -10 * amax / 448 + 1e-12)
    saturated, _ = fp8.quantize_output(jnp.asarray(out), amax / 448 / 4)
    saturated = np.asarray(saturated, np.float32)
    assert not np.isnan(saturated).any() and np.abs(saturated).max() == 448
    np.testing.assert_array_equal(np.sign(saturated), np.sign(out))


@pytest.mark.parametrize(("change", "message"), [
    (dict(q=jnp.zeros((1, 64, 2, 64), jnp.bfloat16)), "q must be a 4-d float8_e4m3fn"),
    (dict(v=jnp.zeros((1, 1, 64, 64), fp8.E4M3)), "v must be"),
    (dict(v_transposed=True), "v must be"),
    (dict(k_scale=jnp.ones((1, 2, 2))), "k_scale must be a scalar or"),
    (dict(q_scale=jnp.ones((), jnp.int32)), "q_scale must be float32"),
    (dict(scale_blocks=(64,)), "scale_blocks"),
    (dict(scale_blocks=(96, 64)), "multiple of the kernel's tile"),
    (dict(out_scale=-1.0), "out_scale"),
    (dict(out_scale=jnp.ones(2)), "out_scale"),
    (dict(is_causal=True, q=jnp.zeros((1, 80, 2, 64), fp8.E4M3)), "is_causal"),
    (dict(implementation="triton"), "implementation"),
])
def test_bad_arguments_are_refused(change, message):
    args = dict(q=jnp.zeros((1, 64, 2, 64), fp8.E4M3), k=jnp.zeros((1, 64, 1, 64), fp8.E4M3),
                v=jnp.zeros((1, 64, 1, 64), fp8.E4M3), q_scale=jnp.ones(()),
                k_scale=jnp.ones(()), v_scale=jnp.ones(()), config=CONFIG) | change
    with pytest.raises(ValueError, match=message):
        fp8.attention_fp8_quantized(**args)


def _mixed_residual_grads(q, k, v, out, lse, d_out, d_lse, *, scale, causal):
    """float64 FlashAttention-2 backward (Alg. 2) on given residuals ``out [B, T, N, D]``,
    ``lse [B, T, N]`` (GQA by repeating k, v and summing their gradients back)."""
    q, k, v, out, lse, d_out, d_lse = (np.asarray(x, np.float64)
                                       for x in (q, k, v, out, lse, d_out, d_lse))
    group = q.shape[2] // k.shape[2]
    k_rep, v_rep = (np.repeat(x, group, axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale
    if causal:  # bottom-right
        seq_q, seq_kv = s.shape[-2:]
        s = np.where(np.tri(seq_q, seq_kv, seq_kv - seq_q, dtype=bool), s, -np.inf)
    p = np.exp(s - np.transpose(lse, (0, 2, 1))[..., None])
    delta = np.einsum("bqhd,bqhd->bhq", d_out, out) - np.transpose(d_lse, (0, 2, 1))
    d_s = p * (np.einsum("bqhd,bkhd->bhqk", d_out, v_rep) - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", d_s, k_rep) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", d_s, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, d_out)

    def fold(x):  # [B, S, N, D] -> [B, S, K, D]
        return x.reshape(*x.shape[:2], -1, group, x.shape[-1]).sum(axis=3)
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("rotate", [False, True])
def test_gradient_is_the_bf16_backward_on_the_fp8_residuals(rotate):
    """jax.grad of attention_fp8 (GQA, bottom-right causal, odd lengths; through out and
    lse): FlashAttention-2's backward on the FP8 forward's own (out, lse), checked in
    float64 (0.23 % seen; the exact lse instead would be 1.0-1.8 % off), and within a few %
    of exact attention's gradient."""
    q, k, v = _inputs(1, 70, 100, 4, 2, 64)
    ct_out = jax.random.normal(fresh_key(), q.shape, jnp.bfloat16)
    ct_lse = jax.random.normal(fresh_key(), (1, 70, 4), jnp.float32)
    key = fresh_key() if rotate else None

    def attention(q, k, v):
        return fp8.attention_fp8(q, k, v, is_causal=True, config=CONFIG, hadamard_key=key,
                                 return_residual=True)

    def loss(q, k, v):
        out, lse = attention(q, k, v)
        return (jnp.sum(out.astype(jnp.float32) * ct_out.astype(jnp.float32))
                + jnp.sum(lse * ct_lse))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    out, lse = attention(q, k, v)
    want = _mixed_residual_grads(q, k, v, out, lse, ct_out, ct_lse, scale=64 ** -0.5,
                                 causal=True)
    for name, got, ref in zip("qkv", grads, want, strict=True):
        assert got.dtype == jnp.bfloat16 and not np.isnan(np.asarray(got, np.float32)).any()
        assert rel_err(got, ref) < 6e-3, (name, rel_err(got, ref))
    # Through out alone, against exact attention's gradient: the FP8 forward's error, damped.
    grads_out = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        attention(q, k, v)[0].astype(jnp.float32) * ct_out.astype(jnp.float32)),
        argnums=(0, 1, 2)))(q, k, v)
    exact = attention_float64(*(np.asarray(x, np.float64) for x in (q, k, v)),
                              scale=64 ** -0.5, d_out=np.asarray(ct_out, np.float64),
                              mask=MaskSpec(70, 100, is_causal=True,
                                            causal_alignment="bottom_right"))[2]
    for name, got, true in zip("qkv", grads_out, exact, strict=True):
        assert rel_err(got, true) < 5e-2, (name, rel_err(got, true))


def test_deterministic_reaches_the_backward(monkeypatch):
    """attention_fp8's deterministic (or XLA_FLAGS' deterministic ops) is the flag its
    backward kernels get; a non-bool is refused by name. (Whether the flag makes Hopper's
    gradients reproducible is tests/gpu/test_fp8_inputs_gpu.py's.)"""
    seen = []
    backward = fp8.attention_backward

    def spy(static, *args):
        seen.append(static.deterministic)
        return backward(static, *args)

    monkeypatch.setattr(fp8, "attention_backward", spy)
    monkeypatch.setenv("XLA_FLAGS", "")
    q, k, v = _inputs(1, 40, 40, 2, 1, 64)

    def grads(**kwargs):
        return jax.grad(lambda q: jnp.sum(fp8.attention_fp8(
            q, k, v, config=CONFIG, **kwargs).astype(jnp.float32)))(q)

    plain, reproducible = grads(), grads(deterministic=True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    grads()
    assert seen == [False, True, True]
    np.testing.assert_array_equal(np.asarray(plain, np.float32),
                                  np.asarray(reproducible, np.float32))
    with pytest.raises(ValueError, match="deterministic"):
        fp8.attention_fp8(q, k, v, deterministic="yes")


def test_divide_exactly_is_correctly_rounded_inside_jit():
    """XLA compiles ``x / 448.0`` inside a jit as a multiply by the rounded 1/448 (one ulp
    off for most e4m3 values); divide_exactly gives the correctly rounded quotient there."""
    x = jax.random.uniform(fresh_key(), (4096,), jnp.float32, 0.0, fp8_format.E4M3_MAX)
    x = x.astype(fp8_format.E4M3).astype(jnp.float32)
    want = (np.asarray(x, np.float64) / fp8_format.E4M3_MAX).astype(np.float32)
    got = jax.jit(lambda x: fp8_format.divide_exactly(x, fp8_format.E4M3_MAX))(x)
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="divisor"):
        fp8_format.divide_exactly(x, 0.0)
    with pytest.raises(ValueError, match="divisor"):
        fp8_format.divide_exactly(x, jnp.float32(2.0))

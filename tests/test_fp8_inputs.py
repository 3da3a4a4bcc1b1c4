"""FP8 inputs and outputs of ``pallas_flash.fp8``: ``attention_fp8_quantized`` (operands that
are already e4m3, per tensor or per block) and ``out_scale`` (an e4m3 output).

On the CPU these run the XLA implementation, whose arithmetic is the kernel's
specification; the kernel on the same operands is in ``tests/gpu/test_fp8_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import fp8
from pallas_flash.mosaic import MosaicConfig
from tests.support import fresh_key

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
    _same(out, fp8.attention_fp8_reference(q, k, v, scaling="tensor"))


def test_coarser_scale_blocks_are_repeated_over_the_kernel_tiles():
    """Scales per 128 queries / 256 keys (an FP8 KV cache's blocks, say) on 64 x 64 tiles:
    the reference quantized with those blocks."""
    q, k, v = _inputs(1, 200, 300, 2, 2, 64)
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize(x, b) for x, b in ((q, 128), (k, 256),
                                                                      (v, 256)))
    out = fp8.attention_fp8_quantized(q8, k8, v8, sq, sk, sv, scale_blocks=(128, 256),
                                      config=CONFIG)
    _same(out, fp8.attention_fp8_reference(q, k, v, block_q=128, block_kv=256))
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

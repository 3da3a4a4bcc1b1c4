"""pallas_flash.fp8: block quantization, the Hadamard rotation and the FP8 reference forward."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import fp8_accuracy
from benchmarks.fp8_accuracy import with_outliers
from pallas_flash import fp8
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("block", [None, 16])
def test_quantize_round_trip_keeps_e4m3_precision(block):
    x = jax.random.normal(jax.random.key(0), (2, 40, 3, 32)) * 5.0   # 40: not a multiple
    x_fp8, scales = fp8.quantize(x, block)
    assert x_fp8.dtype == fp8.E4M3 and x_fp8.shape == x.shape
    assert scales.shape == (() if block is None else (2, 3, 3))
    back = np.asarray(fp8.dequantize(x_fp8, scales, block))
    # 3 mantissa bits: a normal number is off by at most 2^-4 of itself.
    normal = np.abs(np.asarray(x)) > 2.0 ** -6 * np.max(np.abs(np.asarray(x)))
    err = np.abs(back - np.asarray(x))[normal] / np.abs(np.asarray(x))[normal]
    assert err.max() <= 2.0 ** -4 + 1e-7
    # The largest magnitude of each tile (or the tensor) lands exactly on E4M3_MAX.
    assert np.max(np.abs(np.asarray(x_fp8, np.float32))) == fp8.E4M3_MAX


def test_block_scales_isolate_an_outlier():
    x = jax.random.normal(jax.random.key(1), (1, 64, 1, 16))
    x = x.at[0, 3, 0, 0].set(1e4)
    _, tensor_scale = fp8.quantize(x, None)
    _, block_scales = fp8.quantize(x, 16)
    assert float(tensor_scale) == pytest.approx(1e4 / fp8.E4M3_MAX)
    assert float(block_scales[0, 0, 0]) == pytest.approx(1e4 / fp8.E4M3_MAX)
    assert np.all(np.asarray(block_scales[0, 1:, 0]) < 10 / fp8.E4M3_MAX)


def test_all_zero_tile_gets_a_finite_scale():
    x = jnp.zeros((1, 32, 1, 16)).at[0, 20:, 0, :].set(1.0)
    x_fp8, scales = fp8.quantize(x, 16)
    assert float(scales[0, 0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(x_fp8, scales, 16)), np.asarray(x))


def test_hadamard_is_orthogonal_and_keeps_qk():
    rotation = np.asarray(fp8.random_hadamard(jax.random.key(2), 64), np.float64)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(64), atol=1e-6)
    q, k = np.random.default_rng(3).normal(size=(2, 10, 64))
    np.testing.assert_allclose((q @ rotation) @ (k @ rotation).T, q @ k.T, atol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True])
def test_fp8_reference_is_close_to_exact_attention(is_causal):
    keys = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(key, (1, 96, 2, 64)).astype(jnp.bfloat16) for key in keys)
    out = fp8.attention_fp8_reference(q, k, v, block_q=32, block_kv=32, is_causal=is_causal,
                                      hadamard_key=jax.random.key(5))
    want, _ = attention_float64(q, k, v, mask=MaskSpec(96, 96, is_causal=is_causal))
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel(out, want) < 0.08          # e4m3: ~2^-4 relative rounding per operand
    # ...and clearly less accurate than bf16, which it should not pretend to be.
    assert _rel(out, want) > 5 * _rel(jax.nn.dot_product_attention(q, k, v,
                                                                   is_causal=is_causal), want)


def test_block_scaling_with_rotation_beats_per_tensor_on_outliers():
    # The FlashAttention-3 paper's test inputs; the FP8 Q·Kᵀ is what scaling acts on.
    keys = jax.random.split(jax.random.key(6), 4)
    q, k, v = (with_outliers(key, (1, 512, 2, 128)).astype(jnp.bfloat16) for key in keys[:3])
    want, _ = attention_float64(q, k, v)
    errors = {}
    for scaling, rotate in (("tensor", False), ("block", True)):
        out = fp8.attention_fp8_reference(q, k, v, scaling=scaling, fp8_pv=False,
                                          hadamard_key=keys[3] if rotate else None)
        errors[scaling] = _rel(out, want)
    assert errors["block"] < errors["tensor"] / 1.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(scaling="row"), "scaling"),
    (dict(hadamard_key=jax.random.key(0), q_dim=48), "power of two"),
])
def test_bad_arguments_are_refused(kwargs, message):
    d = kwargs.pop("q_dim", 64)
    q = jnp.ones((1, 8, 1, d), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        fp8.attention_fp8_reference(q, q, q, **kwargs)


def test_accuracy_study_writes_its_table(tmp_path, capsys):
    fp8_accuracy.main(["--seq-lens", "64", "--head-dims", "64", "--heads", "1",
                       "--out", str(tmp_path)])
    (json_file,) = tmp_path.glob("fp8-accuracy-*.json")
    (row,) = json.loads(json_file.read_text())["rows"]
    assert row["per-tensor"] > row["bf16"] > 0
    assert "| 64 | 64 |" in capsys.readouterr().out

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
from pallas_flash.tutorial import fp8_study


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
    out = fp8_study.attention_fp8_reference(q, k, v, block_q=32, block_kv=32, is_causal=is_causal,
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
        out = fp8_study.attention_fp8_reference(q, k, v, scaling=scaling, fp8_pv=False,
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
        fp8_study.attention_fp8_reference(q, q, q, **kwargs)


def test_accuracy_study_writes_its_table(tmp_path, capsys):
    fp8_accuracy.main(["--seq-lens", "64", "--head-dims", "64", "--heads", "1",
                       "--out", str(tmp_path)])
    (json_file,) = tmp_path.glob("fp8-accuracy-*.json")
    (row,) = json.loads(json_file.read_text())["rows"]
    assert row["per-tensor"] > row["bf16"] > 0
    assert "| 64 | 64 |" in capsys.readouterr().out


# --- the FP8 backward's numerics ---------------------------------------------------------


def _backward_case(causal: bool, seq_q: int = 96, seq_kv: int = 160):
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (1, seq_q, 2, 64)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, seq_kv, 2, 64)).astype(jnp.bfloat16)
            for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape).astype(jnp.bfloat16)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=causal,
                    causal_alignment="bottom_right")
    out, lse, grads = attention_float64(q, k, v, mask=mask,
                                        d_out=np.asarray(d_out, np.float64))
    residuals = (jnp.asarray(out, jnp.bfloat16),
                 jnp.transpose(jnp.asarray(lse, jnp.float32), (0, 2, 1)))
    return (q, k, v, *residuals, d_out), grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_backward_reference_without_fp8_is_the_bf16_backward(causal, rotate):
    """No GEMM in FP8: the FA2 backward with bf16 operands, so the float64 oracle's
    gradients to bf16 accuracy; with the Hadamard rotation, dQ and dK rotated back."""
    args, grads = _backward_case(causal)
    key = jax.random.key(3) if rotate else None
    got = fp8_study.attention_fp8_backward_reference(*args, fp8_gemms=frozenset(),
                                               hadamard_key=key, block_q=32, block_kv=64,
                                               is_causal=causal)
    for name, g, want, x in zip("qkv", got, grads, args[:3], strict=True):
        assert g.shape == x.shape
        assert _rel(g, want) < 1e-2, name


@pytest.mark.parametrize(("gemm", "changed"), [
    ("dp", "qk"), ("dv", "v"), ("dq", "q"), ("dk", "k"), ("s", "qkv")])
def test_backward_fp8_gemm_rounds_only_what_it_feeds(gemm, changed):
    """One GEMM in FP8 changes exactly the gradients that depend on it, and costs more
    accuracy there than bf16 does (e4m3 keeps 3 mantissa bits, bf16 7)."""
    args, grads = _backward_case(causal=True)
    kwargs = dict(block_q=32, block_kv=64, is_causal=True)
    bf16 = fp8_study.attention_fp8_backward_reference(*args, fp8_gemms=frozenset(), **kwargs)
    got = fp8_study.attention_fp8_backward_reference(*args, fp8_gemms=frozenset({gemm}), **kwargs)
    for name, g, b, want in zip("qkv", got, bf16, grads, strict=True):
        assert np.isfinite(np.asarray(g)).all()
        if name in changed:
            assert _rel(g, want) > 2 * _rel(b, want), name
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(b), err_msg=name)


def test_backward_probabilities_saturate_instead_of_nan():
    """A backward's P = exp(S - lse) may exceed 1 when its S is rounded differently from
    the forward's: e4m3 conversion saturates at 448 (cvt.satfinite) rather than NaN."""
    p = jnp.asarray([0.0, 0.5, 1.0, 1.3])
    rounded = np.asarray(fp8.round_probabilities(p))
    np.testing.assert_array_equal(rounded, [0.0, 0.5, 1.0, 1.0])


def test_backward_reference_refuses_unknown_gemms():
    args, _ = _backward_case(causal=False, seq_q=8, seq_kv=8)
    with pytest.raises(ValueError, match="fp8_gemms"):
        fp8_study.attention_fp8_backward_reference(*args, fp8_gemms=frozenset({"pv"}))


def test_backward_accuracy_study_writes_its_table(tmp_path, capsys):
    fp8_accuracy.main(["--backward", "--seq-lens", "64", "--head-dims", "64", "--heads", "1",
                       "--out", str(tmp_path)])
    (json_file,) = tmp_path.glob("fp8-backward-accuracy-*.json")
    rows = json.loads(json_file.read_text())["rows"]
    assert [row["causal"] for row in rows] == [False, True]
    for row in rows:
        assert all(e > b for e, b in zip(row["all fp8, per-block"], row["bf16"], strict=True))
        assert row["best / bf16"] > 1
    assert "| 64 | 64 | True |" in capsys.readouterr().out


_Q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
_Q8, _S = fp8.quantize(_Q, None)


@pytest.mark.parametrize("call, name", [
    (lambda: fp8.quantize(_Q, 1.5), "block"),
    (lambda: fp8.quantize(_Q.astype(jnp.int32), 64), "x"),
    (lambda: fp8.dequantize(_Q8, _S, 0), "block"),
    (lambda: fp8.random_hadamard(3, 64), "key"),
    (lambda: fp8.random_hadamard(jax.random.key(0), 64.0), "head_dim"),
    (lambda: fp8.quantize_operands(_Q, _Q, _Q, block_q=1.5, block_kv=64), "block_q"),
    (lambda: fp8.quantize_operands(_Q, _Q, _Q, block_q=64, block_kv=True), "block_kv"),
    (lambda: fp8.quantize_operands(_Q[0], _Q, _Q, block_q=64, block_kv=64), "q"),
    (lambda: fp8.quantize_operands(_Q, _Q, _Q, block_q=64, block_kv=64, hadamard_key=3),
     "hadamard_key"),
    (lambda: fp8.quantize_operands(_Q, _Q, _Q, block_q=64, block_kv=64, interpret="no"),
     "interpret"),
    (lambda: fp8.attention_fp8(_Q, _Q, _Q, scale=-1.0), "scale"),
    (lambda: fp8.attention_fp8(_Q, _Q, _Q, scale="x"), "scale"),
    (lambda: fp8.attention_fp8(_Q, _Q, _Q, is_causal="yes"), "is_causal"),
    (lambda: fp8.attention_fp8(_Q, _Q, _Q, return_residual=1), "return_residual"),
    (lambda: fp8.attention_fp8(_Q, _Q, _Q, hadamard_key=5), "hadamard_key"),
    (lambda: fp8.attention_fp8([1.0], _Q, _Q), "q"),
    (lambda: fp8.attention_fp8_quantized(_Q8, _Q8, _Q8, "a", _S, _S), "q_scale"),
    (lambda: fp8.attention_fp8_quantized(_Q8, _Q8, _Q8, _S, _S, _S, v_transposed="x"),
     "v_transposed"),
    (lambda: fp8.attention_fp8_quantized(_Q8, _Q8, _Q8, _S, _S, _S, scale=0.0), "scale"),
    (lambda: fp8.quantize_output([1.0], 1.0), "out"),
    (lambda: fp8.quantize_output(_Q, "a"), "out_scale"),
    (lambda: fp8_study.attention_fp8_reference(_Q, _Q, _Q, block_kv=0), "block_kv"),
    (lambda: fp8_study.attention_fp8_reference(_Q, _Q, _Q, is_causal="x"), "is_causal"),
    (lambda: fp8_study.attention_fp8_online(_Q, _Q, _Q, block_q=64, block_kv=-1), "block_kv"),
])
def test_public_functions_name_the_bad_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()

"""Bad input gets a ValueError that names the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import dispatch


def _qkv(q_shape=(1, 16, 4, 32), kv_shape=(1, 16, 2, 32), dtype=jnp.float32):
    q = jnp.ones(q_shape, dtype)
    k = jnp.ones(kv_shape, dtype)
    return q, k, k


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(q=jnp.ones((16, 32))), "query must have rank 4"),
        (dict(q=jnp.ones((1, 16, 0, 32))), "at least one head"),
        (dict(k=jnp.ones((1, 16, 2, 2, 32))), "key must have rank 4"),
        (dict(v=jnp.ones((1, 15, 2, 32))), r"same \[batch, seq_kv, kv_heads\]"),
        (dict(k=jnp.ones((2, 16, 2, 32)), v=jnp.ones((2, 16, 2, 32))), "batch size"),
        (dict(k=jnp.ones((1, 16, 2, 16)), v=jnp.ones((1, 16, 2, 16))), "head_dim"),
        (dict(k=jnp.ones((1, 16, 3, 32)), v=jnp.ones((1, 16, 3, 32))), "multiple of key/value"),
        (dict(q=jnp.ones((1, 16, 4, 32), jnp.bfloat16)), "share one dtype"),
        (dict(q=jnp.ones((1, 16, 4, 32), jnp.int32)), "query dtype"),
        (dict(q=jnp.ones((1, 16, 4, 0)), k=jnp.ones((1, 16, 2, 0)),
              v=jnp.ones((1, 16, 2, 0))), "head_dim must be at least 1"),
        (dict(scale=0.0), "scale must be a positive"),
        (dict(scale=-1.0), "scale must be a positive"),
        (dict(scale=float("nan")), "scale must be a positive"),
        (dict(scale=True), "scale must be a positive"),
        (dict(scale=jnp.ones(2)), "scale must be a positive"),
        (dict(is_causal=jnp.ones(())), "is_causal"),
        (dict(return_residual=1), "return_residual must be a bool"),
        (dict(return_lse="yes"), "return_lse must be a bool"),
        (dict(return_residual=True, return_lse=True), "cannot both be True"),
        (dict(implementation="cudnn", q_segment_ids=jnp.zeros((1, 16), jnp.int32),
              logits_soft_cap=5.0), "no q_segment_ids, logits_soft_cap"),
        (dict(implementation="cudnn", sinks=jnp.zeros(4)), "no sinks"),
        (dict(implementation="cudnn", return_lse=True), "no return_lse"),
        (dict(local_window_size=-1), "local_window_size"),
        (dict(local_window_size=(1, 2, 3)), "local_window_size"),
        (dict(causal_alignment="center"), "causal_alignment"),
        (dict(is_causal="yes"), "is_causal"),
        (dict(implementation="cuda"), "implementation must be one of"),
        (dict(q_segment_ids=jnp.zeros((1, 15), jnp.int32)), "q_segment_ids must have shape"),
        (dict(q_segment_ids=jnp.zeros((1, 16), jnp.float32)), "integer dtype"),
        (dict(q_segment_ids=jnp.zeros((1, 16), jnp.int32),
              kv_segment_ids=jnp.zeros((2, 16), jnp.int32)), "kv_segment_ids must have shape"),
        (dict(query_seq_lengths=jnp.array([3, 4])), "query_seq_lengths must have shape"),
        (dict(key_value_seq_lengths=jnp.array([3.0])), "key_value_seq_lengths must have an int"),
        (dict(logits_soft_cap=0.0), "logits_soft_cap must be a positive"),
        (dict(logits_soft_cap=-5), "logits_soft_cap must be a positive"),
        (dict(sinks=jnp.zeros(3)), "sinks must have shape"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks must have a floating"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    q, k, v = _qkv()
    q, k, v = kwargs.pop("q", q), kwargs.pop("k", k), kwargs.pop("v", v)
    with pytest.raises(ValueError, match=match):
        pf.attention(q, k, v, **kwargs)


def test_traced_scale_raises_value_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a concrete number"):
        jax.jit(lambda s: pf.attention(q, k, v, scale=s))(0.5)


def test_segment_ids_required_together_when_lengths_differ():
    q, k, v = _qkv(kv_shape=(1, 8, 2, 32))
    with pytest.raises(ValueError, match="given together"):
        pf.attention(q, k, v, q_segment_ids=jnp.zeros((1, 16), jnp.int32))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = (x * jnp.arange(16.0)[None, :, None, None] / 16 for x in _qkv())
    assert jnp.allclose(pf.attention(q, k, v), pf.attention(q, k, v, scale=32 ** -0.5))
    assert not jnp.allclose(pf.attention(q, k, v), pf.attention(q, k, v, scale=1.0))


@pytest.mark.parametrize(("head_dim", "features", "chosen"), [
    (64, dict(has_segments=True, softcap=30.0, has_bias=False, has_mask=False), "mosaic"),
    (128, dict(has_segments=False, softcap=None, has_bias=True, has_mask=False), "mosaic"),
    (192, dict(has_segments=False, softcap=None, has_bias=False, has_mask=True), "mosaic"),
    # Above head_dim 192 the Mosaic forward has no shared memory left for a bias tile.
    (256, dict(has_segments=False, softcap=None, has_bias=True, has_mask=True), "triton"),
    (256, dict(has_segments=True, softcap=None, has_bias=False, has_mask=False), "mosaic"),
])
def test_automatic_choice_on_hopper(monkeypatch, head_dim, features, chosen):
    """On a Hopper GPU ``implementation=None`` picks Mosaic for every call its kernels
    support, and Triton for the rest."""
    from pallas_flash.masking import MaskSpec

    monkeypatch.setattr(dispatch, "available_implementations",
                        lambda: ("mosaic", "triton", "xla"))
    shape = (1, 256, 4, head_dim)
    spec = MaskSpec(seq_q=256, seq_kv=256, is_causal=True)
    assert dispatch.choose(shape, shape, jnp.bfloat16, spec, dispatch.Features(**features),
                           interpret=False) == chosen


# --- the backward's backend ------------------------------------------------------------------

def _refusing(reason, *, only_bias_grad=False):
    """An ``unsupported_backward`` that refuses every call (or those with ``bias_grad``)."""
    def unsupported_backward(q_shape, kv_shape, dtype, mask, has_segments, softcap=None,
                             has_bias=False, has_mask=False, bias_grad=False):
        del q_shape, kv_shape, dtype, mask, has_segments, softcap, has_bias, has_mask
        return reason if bias_grad or not only_bias_grad else None
    return unsupported_backward


def _record_passes(monkeypatch, *names):
    """Replaces the KERNELS of these backends by ones that log (backend, pass) as they are
    traced; returns the log."""
    from pallas_flash.contract import Kernels

    ran = []

    def logged(name, pass_, fn):
        def run(*args, **kwargs):
            ran.append((name, pass_))
            return fn(*args, **kwargs)
        return run
    for name in names:
        module = dispatch.backend(name)
        real = module.KERNELS
        monkeypatch.setattr(module, "KERNELS", Kernels(
            name, logged(name, "forward", real.forward), logged(name, "backward", real.backward)))
    return ran


def _random(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _gradients_vs_oracle(implementation, *, bias_grad, interpret=True):
    """Causal attention with a bias through ``implementation``: jitted gradients (dbias too
    with ``bias_grad``) against the float64 oracle's."""
    from pallas_flash.masking import MaskSpec
    from pallas_flash.reference import attention_float64

    q, k, v = (_random((1, 16, 2, 16), seed) for seed in range(3))
    bias, d_out = _random((1, 2, 16, 16), 3), _random((1, 16, 2, 16), 4)

    def loss(q, k, v, bias):
        out = pf.attention(q, k, v, bias, is_causal=True, implementation=implementation,
                           interpret=interpret)
        return jnp.sum(out * d_out)

    argnums = (0, 1, 2, 3) if bias_grad else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)
    _, _, expected = attention_float64(q, k, v, mask=MaskSpec(16, 16, is_causal=True),
                                       bias=bias, d_out=d_out)
    expected = expected[:3] + (expected[3:] if bias_grad else ())
    for got, want in zip(grads, expected, strict=True):
        assert jnp.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias_grad", [False, True])
def test_backward_falls_back_when_the_forward_backend_refuses(monkeypatch, bias_grad):
    """Triton's forward; its backward refuses only calls that want dbias, which then run
    XLA's backward on Triton's residuals. Gradients match the float64 oracle either way."""
    monkeypatch.setattr(dispatch.backend("triton"), "unsupported_backward",
                        _refusing("no dbias here", only_bias_grad=True), raising=False)
    ran = _record_passes(monkeypatch, "triton", "xla")
    _gradients_vs_oracle("triton", bias_grad=bias_grad)
    backward = "xla" if bias_grad else "triton"
    assert ran == [("triton", "forward"), (backward, "backward")]


def test_a_fake_backend_without_a_backward_gets_the_fastest_other(monkeypatch):
    """A registered backend whose forward is XLA's and whose backward refuses everything:
    in interpret mode Triton (the fastest other candidate) runs the backward, with its own
    default config."""
    import types

    xla_backend = dispatch.backend("xla")
    fake = types.ModuleType("fake_backend")
    fake.KERNELS = dataclasses.replace(xla_backend.KERNELS, name="fake")
    fake.default_config = xla_backend.default_config
    fake.unsupported = xla_backend.unsupported
    fake.unsupported_backward = _refusing("the fake backend has no backward")
    monkeypatch.setitem(dispatch.BACKENDS, "fake", lambda: fake)
    ran = _record_passes(monkeypatch, "triton", "xla")
    _gradients_vs_oracle("fake", bias_grad=True)
    assert ran == [("triton", "backward")]


def test_kernels_run_first_order_and_xla_second_order(monkeypatch):
    """jax.grad (also under jax.vmap, and of a vmapped call) runs the chosen kernels, and
    so does jax.jvp's primal (its tangent is plain JAX, no kernel pass); the forward that
    second-order AD differentiates (here jax.jvp of jax.grad) runs on the XLA path, which
    has the forward-mode rules Pallas kernels lack, and JAX transposes the tangent."""
    ran = _record_passes(monkeypatch, "triton", "xla")
    q = _random((2, 8, 1, 16), 7)

    def loss(q):
        return jnp.sum(jnp.sin(pf.attention(q, q, q, implementation="triton", interpret=True)))

    for grad in (jax.grad(loss), lambda q: jax.vmap(jax.grad(loss))(q[:, None]),
                 lambda q: jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x)))(q[:, None])):
        jax.clear_caches()  # each traces the kernel call anew (not the jit cache's trace)
        grad(q)
    assert ran == [("triton", "forward"), ("triton", "backward")] * 3
    ran.clear()
    jax.clear_caches()
    jax.jvp(loss, (q,), (q,))
    assert ran == [("triton", "forward")]
    ran.clear()
    jax.clear_caches()
    jax.jvp(jax.grad(loss), (q,), (q,))
    assert ran == [("xla", "forward")]


def test_identical_calls_trace_the_kernels_once(monkeypatch):
    """A model's layers (the same call on arrays of the same types) share one trace of the
    kernels, forward and backward, and so one lowering; other shapes trace anew; eager
    calls of the same types reuse the compiled kernels. The results are the XLA path's."""
    ran = _record_passes(monkeypatch, "triton")
    jax.clear_caches()

    def layers(q, k, v, implementation):
        for _ in range(3):
            q = pf.attention(q, k, v, is_causal=True, implementation=implementation,
                             interpret=implementation == "triton")
        return jnp.sum(jnp.sin(q))

    for seq in (16, 32):
        q, k, v = (_random((1, seq, 2, 16), seed) for seed in range(3))
        grads = jax.jit(jax.grad(layers, argnums=(0, 1, 2)), static_argnums=3)(
            q, k, v, "triton")
        assert ran == [("triton", "forward"), ("triton", "backward")]
        ran.clear()
        want = jax.grad(layers, argnums=(0, 1, 2))(q, k, v, "xla")
        for got, expected in zip(grads, want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    # Eager calls too: once traced (and compiled), a call of the same types is not again.
    def eager(q):
        return pf.attention(q, k, v, implementation="triton", interpret=True)

    eager(q)
    ran.clear()
    outs = [eager(q + i) for i in range(2)]
    assert ran == []
    np.testing.assert_allclose(outs[1], pf.attention(q + 1, k, v, implementation="xla"),
                               rtol=1e-5, atol=1e-5)


def test_choose_backward():
    from pallas_flash.masking import MaskSpec

    shape, spec = (1, 16, 2, 16), MaskSpec(16, 16)
    call = (shape, shape, jnp.float32, spec, dispatch.PLAIN_CALL)
    assert dispatch.choose_backward("triton", *call, bias_grad=True, interpret=True) == "triton"
    assert dispatch.choose_backward("xla", *call, bias_grad=False, interpret=False) == "xla"


def test_choose_backward_says_why_when_nothing_can_run(monkeypatch):
    from pallas_flash.masking import MaskSpec

    for name in ("triton", "xla"):
        monkeypatch.setattr(dispatch.backend(name), "unsupported_backward",
                            _refusing(f"{name} says no"), raising=False)
    shape = (1, 16, 2, 16)
    with pytest.raises(ValueError, match="triton: triton says no; xla: xla says no"):
        dispatch.choose_backward("triton", shape, shape, jnp.float32, MaskSpec(16, 16),
                                 dispatch.PLAIN_CALL, bias_grad=False, interpret=True)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: dispatch.backend("cuda"), "implementation must be one of"),
    (lambda: dispatch.candidates(1), "interpret must be a bool"),
    (lambda: dispatch.unsupported("xla", (1, 1, 1, 1), (1, 1, 1, 1), jnp.float32,
                                  None, dict(has_bias=True)), "features must be"),
    (lambda: dispatch.unsupported_backward("xla", (1, 1, 1, 1), (1, 1, 1, 1), jnp.float32,
                                           None, dispatch.PLAIN_CALL, bias_grad=None),
     "bias_grad must be a bool"),
    (lambda: pf.attention(*_qkv(), interpret="yes"), "interpret must be a bool"),
])
def test_dispatch_rejects_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()

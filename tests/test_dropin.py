"""``pallas_flash.attention`` as a drop-in for ``jax.nn.dot_product_attention``.

A table of jax.nn calls runs through both functions on every backend that can run it:
outputs and gradients must match, and bad calls must raise the same exception types. The
expected values are jax.nn's on float32 copies of the inputs (jax.nn is the specification
here; the float64 oracle checks the kernels elsewhere). Shapes are tiny: the table is about
arguments, not tiling. Rows that see no key are left out of the table on purpose: there
``jax.nn`` spreads the row over every key and we output 0 (documented in docs/api.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from tests.support import BACKENDS, F32, backends, fresh_key, rel_err, tolerance

B, T, S, N, K, D = 2, 8, 8, 2, 2, 16


@dataclasses.dataclass(frozen=True)
class Call:
    """One jax.nn call: input shapes, and keywords built from fresh random arrays.

    ``kwargs(key)`` returns the keywords (bias and mask included) of both functions.
    ``backends``: where it runs. The table is about the API's handling of arguments, which
    is shared by every backend, and the kernels' side of each argument is in the shared
    suite: the Pallas interpreters (slow) run only a few calls.
    """

    name: str
    kwargs: Callable[[jax.Array], dict] = lambda key: {}
    q_shape: tuple[int, ...] = (B, T, N, D)
    kv_shape: tuple[int, ...] = (B, S, K, D)
    backends: tuple[str, ...] = ("xla",)


def _normal(key, shape):
    return jax.random.normal(key, shape, jnp.float32)


def _mask(key, shape):
    """A random boolean mask whose diagonal is visible (no row without a key)."""
    eye = jnp.eye(shape[-2], shape[-1], dtype=bool)
    return jax.random.bernoulli(key, 0.6, shape) | eye


_TRITON = ("xla", "triton")
CALLS = [
    Call("causal_numpy_bool_numpy_scale", lambda key: dict(is_causal=np.bool_(True),
                                                          scale=np.float32(0.3))),
    Call("mask_and_bias", lambda key: dict(mask=_mask(key, (1, N, T, S)),
                                           bias=_normal(key, (B, N, T, S))),
         backends=_TRITON),
    Call("gqa_cross_causal", lambda key: dict(is_causal=True), q_shape=(B, T, 4, D),
         kv_shape=(B, 12, 1, D), backends=_TRITON),
    Call("lengths_list", lambda key: dict(query_seq_lengths=[5, 8],
                                          key_value_seq_lengths=[3, 8])),
    Call("window_lengths_numpy", lambda key: dict(
        local_window_size=(3, 1), key_value_seq_lengths=np.array([8, 6], np.int32))),
    Call("rank3_causal", lambda key: dict(is_causal=True), q_shape=(T, N, D),
         kv_shape=(S, K, D)),
    Call("rank3_bias_lengths", lambda key: dict(bias=_normal(key, (N, T, S)),
                                                key_value_seq_lengths=jnp.array([5])),
         q_shape=(T, N, D), kv_shape=(S, K, D), backends=("xla", "triton", "mosaic")),
]


def _cases():
    return [pytest.param(b, call, id=f"{b.name}-{call.name}")
            for call in CALLS for b in BACKENDS.values() if b.name in call.backends]


def _inputs(call: Call, dtype):
    keys = jax.random.split(fresh_key(), 5)
    q = _normal(keys[0], call.q_shape).astype(dtype)
    k = _normal(keys[1], call.kv_shape).astype(dtype)
    v = _normal(keys[2], call.kv_shape).astype(dtype)
    d_out = _normal(keys[3], call.q_shape)
    return q, k, v, d_out, call.kwargs(keys[4])


def _value_and_grads(fn, q, k, v, d_out, kwargs):
    """out and the gradients of <out, d_out> w.r.t. q, k, v (and bias when given), in one
    jit (one compilation: much faster than op by op). ``kwargs`` are closed over, so they
    reach ``fn`` as given (NumPy scalars, lists)."""
    bias = kwargs.pop("bias", None)

    def f(q, k, v, bias):
        return fn(q, k, v, bias, **kwargs).astype(jnp.float32)

    @jax.jit
    def run(q, k, v, bias, d_out):
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(d_out)

    out, grads = run(q, k, v, bias, d_out)
    return out, [g for g in grads if g is not None]


@pytest.mark.parametrize(("backend", "call"), _cases())
def test_matches_jax_nn(backend, call):
    """Output and gradients as jax.nn's, under jax_numpy_rank_promotion="raise" (item 9)."""
    dtype = backend.dtype
    q, k, v, d_out, kwargs = _inputs(call, dtype)
    want, want_grads = _value_and_grads(
        jax.nn.dot_product_attention, *(x.astype(F32) for x in (q, k, v)), d_out,
        {name: x.astype(F32) if name == "bias" else x for name, x in kwargs.items()})
    with jax.numpy_rank_promotion("raise"):
        out, grads = _value_and_grads(backend.attention, q, k, v, d_out, dict(kwargs))
    assert out.shape == want.shape == call.q_shape
    tol = tolerance(dtype)
    assert rel_err(out, want) < tol, rel_err(out, want)
    primals = [q, k, v] + ([kwargs["bias"]] if "bias" in kwargs else [])
    for got, expected, primal in zip(grads, want_grads, primals, strict=True):
        assert got.dtype == primal.dtype
        assert rel_err(got, expected) < 2 * tol, rel_err(got, expected)


@pytest.mark.parametrize("backend", backends())
def test_vmap_over_batch(backend):
    """jax.vmap maps the rank-3 form over a batch axis: output and gradients (vmap of
    grad) as the batched call's."""
    dtype = backend.dtype
    q, k, v, d_out, _ = _inputs(Call("vmap"), dtype)
    lengths = jnp.array([3, 8])

    def loss(q, k, v, lengths):
        out = backend.attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
        return jnp.sum(out.astype(jnp.float32) * d_out[0])

    mapped_out = jax.jit(jax.vmap(lambda q, k, v, n: backend.attention(
        q, k, v, is_causal=True, key_value_seq_lengths=n)))(q, k, v, lengths)
    mapped_grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, lengths)
    want = jax.nn.dot_product_attention(*(x.astype(F32) for x in (q, k, v)), is_causal=True,
                                        key_value_seq_lengths=lengths)

    def jax_nn_loss(q, k, v, lengths):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           key_value_seq_lengths=lengths)
        return jnp.sum(out * d_out[0])

    jax_nn_grads = jax.jit(jax.grad(jax_nn_loss, argnums=(0, 1, 2)))
    want_grads = [jax_nn_grads(q[i].astype(F32), k[i].astype(F32), v[i].astype(F32),
                               lengths[i:i + 1]) for i in range(B)]
    tol = tolerance(dtype)
    assert rel_err(mapped_out, want) < tol
    for index, got in enumerate(mapped_grads):
        expected = np.stack([g[index] for g in want_grads])
        assert rel_err(got, expected) < 2 * tol, (index, rel_err(got, expected))


def test_return_residual_is_jax_nns():
    """``return_residual=True``: jax.nn's residual (input dtype, natural log, [B, T, N], no
    gradient through it); ``return_lse=True``: our float32 lse, differentiable. (The API
    builds both from every backend's lse: one backend suffices.)"""
    backend = BACKENDS["xla"]
    dtype = backend.dtype
    q, k, v, _, _ = _inputs(Call("residual"), dtype)
    out, residual = backend.attention(q, k, v, is_causal=True, return_residual=True)
    want_out, want_residual = jax.nn.dot_product_attention(
        *(x.astype(F32) for x in (q, k, v)), is_causal=True, return_residual=True)
    assert residual.dtype == dtype and residual.shape == want_residual.shape == (B, T, N)
    assert rel_err(residual, want_residual) < tolerance(dtype)
    assert rel_err(out, want_out) < tolerance(dtype)

    def residual_sum(fn, **kwargs):
        return lambda q: jnp.sum(fn(q, k, v, is_causal=True, **kwargs)[1].astype(F32))

    no_grad = jax.grad(residual_sum(backend.attention, return_residual=True))(q)
    assert not np.any(np.asarray(no_grad, np.float32))
    # Our lse carries the gradient jax.nn's residual drops: d lse / dq = scale · Σ P k.
    lse_grad = jax.grad(residual_sum(backend.attention, return_lse=True))(q)
    assert backend.attention(q, k, v, return_lse=True)[1].dtype == jnp.float32

    def causal_lse_sum(q):
        logits = jnp.einsum("btnd,bsnd->bnts", q, k.astype(F32)) / np.sqrt(D)
        visible = jnp.tril(jnp.ones((T, S), bool))
        return jnp.sum(jax.nn.logsumexp(jnp.where(visible, logits, -jnp.inf), axis=-1))
    assert rel_err(lse_grad, jax.grad(causal_lse_sum)(q.astype(F32))) < 2 * tolerance(dtype)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize(("seq_q", "seq_kv"), [(0, S), (T, 0)])
def test_empty_sequences_as_jax_nn(backend, seq_q, seq_kv):
    """A sequence of length 0: the output shape of jax.nn, zeros, zero gradients."""
    dtype = backend.dtype
    q = jnp.ones((B, seq_q, N, D), dtype)
    k = jnp.ones((B, seq_kv, K, D), dtype)
    out, residual = backend.attention(q, k, k, is_causal=True, return_residual=True)
    want_out, want_residual = jax.nn.dot_product_attention(q, k, k, is_causal=True,
                                                           return_residual=True)
    assert out.shape == want_out.shape and out.dtype == dtype
    assert residual.shape == want_residual.shape
    assert not np.any(np.asarray(out, np.float32))
    grad = jax.grad(lambda q: jnp.sum(backend.attention(q, k, k).astype(F32)))(q)
    assert grad.shape == q.shape and not np.any(np.asarray(grad, np.float32))


def _raised(fn) -> type[BaseException] | None:
    try:
        fn()
    except Exception as error:
        return type(error)
    return None


_q = jnp.ones((B, T, N, D))
_kv = jnp.ones((B, S, K, D))
BAD_CALLS = {
    "head_dim_mismatch": (_q, jnp.ones((B, S, K, 8)), jnp.ones((B, S, K, 8)), {}),
    "heads_not_multiple": (jnp.ones((B, T, 3, D)), _kv, _kv, {}),
    "key_value_shapes": (_q, _kv, jnp.ones((B, 4, K, D)), {}),
    "dtype_mismatch": (_q.astype(jnp.bfloat16), _kv, _kv, {}),
    "float_mask": (_q, _kv, _kv, dict(mask=jnp.ones((T, S)))),
    "bias_rank5": (_q, _kv, _kv, dict(bias=jnp.ones((1, B, N, T, S)))),
    "lengths_shape": (_q, _kv, _kv, dict(key_value_seq_lengths=jnp.array([1, 2, 3]))),
    "lengths_float": (_q, _kv, _kv, dict(query_seq_lengths=jnp.array([1.0, 2.0]))),
    "unknown_implementation": (_q, _kv, _kv, dict(implementation="flash")),
    # Handed to jax.nn: on this CPU it raises jax.nn's error (no cuDNN).
    "cudnn": (_q, _kv, _kv, dict(implementation="cudnn")),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_errors_as_jax_nn(name):
    """A call jax.nn refuses raises the same exception type here."""
    q, k, v, kwargs = BAD_CALLS[name]
    expected = _raised(lambda: jax.nn.dot_product_attention(q, k, v, **kwargs))
    assert expected is not None
    assert _raised(lambda: pf.attention(q, k, v, **kwargs)) is expected


def test_cudnn_is_jax_nns_call():
    """``implementation="cudnn"`` raises jax.nn's own error, message included."""
    with pytest.raises(Exception) as want:
        jax.nn.dot_product_attention(_q, _kv, _kv, is_causal=True, implementation="cudnn")
    with pytest.raises(want.type, match=str(want.value)):
        pf.attention(_q, _kv, _kv, is_causal=True, implementation="cudnn")


# --- float64 (XLA path) -------------------------------------------------------------------

def test_float64_runs_on_xla_in_float64():
    """float64 inputs (under jax_enable_x64) take the XLA path and are computed in float64:
    out, lse and gradients against the float64 oracle at float64 precision."""
    mask = MaskSpec(T, S, is_causal=True)
    with jax.enable_x64(True):
        keys = jax.random.split(fresh_key(), 4)
        q, k, v, d_out = (jax.random.normal(key, (B, T, N, D), jnp.float64) for key in keys)
        (out, lse), vjp = jax.vjp(lambda q, k, v: pf.attention(
            q, k, v, is_causal=True, return_lse=True), q, k, v)
        grads = vjp((d_out, jnp.zeros_like(lse)))
        assert out.dtype == lse.dtype == jnp.float64
        want_out, want_lse, want_grads = attention_float64(q, k, v, mask=mask, d_out=d_out)
        assert rel_err(out, want_out) < 1e-12
        assert rel_err(lse, np.transpose(want_lse, (0, 2, 1))) < 1e-12
        for got, want in zip(grads, want_grads, strict=True):
            assert got.dtype == jnp.float64 and rel_err(got, want) < 1e-12
        for name in ("triton", "mosaic"):
            with pytest.raises(ValueError, match="float64 inputs run only on"):
                pf.attention(q, k, v, implementation=name, interpret=True)


# --- rank promotion: the arguments jax.nn lacks ---------------------------------------------

@pytest.mark.parametrize("backend", backends(dtype=F32))
def test_rank_promotion_raise_with_segments_and_sinks(backend):
    """Segment ids, sinks and soft-capping under jax_numpy_rank_promotion="raise": the same
    output and gradients as without it. (The table above runs every backend, Mosaic
    included, under "raise" with bias and lengths.)"""
    q, k, v, d_out, _ = _inputs(Call("segments"), backend.dtype)
    ids = jnp.array([[0] * 3 + [1] * 5, [0] * 8], jnp.int32)
    kwargs = dict(q_segment_ids=ids, kv_segment_ids=ids, sinks=jnp.linspace(-1, 1, N),
                  logits_soft_cap=5.0, query_seq_lengths=jnp.array([8, 6]))
    want, want_grads = _value_and_grads(backend.attention, q, k, v, d_out, dict(kwargs))
    with jax.numpy_rank_promotion("raise"):
        out, grads = _value_and_grads(backend.attention, q, k, v, d_out, dict(kwargs))
    for got, expected in zip([out, *grads], [want, *want_grads], strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(expected, np.float32))


# --- higher-order AD ----------------------------------------------------------------------

def _second_order_cases():
    # jax.hessian is jacfwd of jacrev: forward over reverse, as jax.jvp of jax.grad. The
    # XLA path is plain JAX: its reverse over reverse needs no test here.
    return [pytest.param(b, mode, id=f"{b.name}-{mode}") for b in BACKENDS.values()
            for mode in ("hessian", "grad_of_grad")
            if b.name != "xla" or mode == "hessian"]


@pytest.mark.parametrize(("backend", "mode"), _second_order_cases())
def test_second_order_as_jax_nn(backend, mode):
    """Second derivatives through the kernels' custom VJP (Pallas kernels take the XLA
    path's derivatives) match jax.nn's, on every backend."""
    shape = (1, 4, 1, 4)
    keys = jax.random.split(fresh_key(), 4)
    q, k, v, t = (_normal(key, shape) for key in keys)
    dtype = backend.dtype

    def loss(fn, q):
        out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), is_causal=True)
        return jnp.sum(jnp.sin(out.astype(F32)))

    ours, theirs = (lambda q: loss(backend.attention, q),
                    lambda q: loss(jax.nn.dot_product_attention, q))
    if mode == "hessian":
        got, want = (jax.jit(jax.hessian(fn))(q) for fn in (ours, theirs))
    else:
        got, want = (jax.jit(jax.grad(lambda q, fn=fn: jnp.sum(jax.grad(fn)(q) * t)))(q)
                     for fn in (ours, theirs))
    # jax.nn's 16-bit path rounds too: compare at the 16-bit tolerance, 4x for 2nd order.
    assert rel_err(got, want) < 4 * tolerance(dtype), rel_err(got, want)


@pytest.mark.parametrize("backend", [BACKENDS["xla"], BACKENDS["triton"]], ids=str)
def test_first_order_forward_mode_as_jax_nn(backend):
    """jax.jvp of attention (the custom JVP's tangent, plain JAX on every backend) matches
    jax.nn's (every backend and jax.jacfwd: tests/test_forward_mode.py)."""
    shape = (1, 4, 1, 4)
    keys = jax.random.split(fresh_key(), 6)
    q, k, v, tq, tk, tv = (_normal(key, shape).astype(backend.dtype) for key in keys)
    kwargs = dict(is_causal=True)
    _, got = jax.jvp(lambda *a: backend.attention(*a, **kwargs), (q, k, v), (tq, tk, tv))
    _, want = jax.jvp(lambda *a: jax.nn.dot_product_attention(*a, **kwargs),
                      *(tuple(x.astype(F32) for x in xs) for xs in ((q, k, v), (tq, tk, tv))))
    assert rel_err(got, want) < 2 * tolerance(backend.dtype), rel_err(got, want)

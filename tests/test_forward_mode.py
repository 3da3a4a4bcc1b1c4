"""First-order forward-mode AD of ``pallas_flash.attention``: ``jax.jvp``, ``jax.jacfwd``,
``jax.linearize`` on every backend (``pallas_flash.autodiff``: a ``custom_jvp`` whose tangent
is a ``linear_call`` transposed by the backward kernels).

Tangents are checked against central differences of the float64 oracle (whose rounding is
far below float32's), and against the backward kernels (jacfwd vs jacrev, <ct, J·t> vs
<Jᵀ·ct, t>). The Mosaic case also runs ``jax.jit(jax.grad)`` through the fused dQ, whose
``jax.new_ref`` accumulator now sits in the transpose of a ``linear_call``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from tests.support import BACKENDS, F32, fresh_key, rel_err, tolerance

# The differentiable inputs of a case, in this order.
NAMES = ("q", "k", "v", "sinks", "bias")


def _normal(shape, dtype=jnp.float32):
    return jax.random.normal(fresh_key(), shape, jnp.float32).astype(dtype)


def _case(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype):
    """Primals and tangents of every differentiable input (a [1, N, T, S] bias)."""
    shapes = dict(q=(batch, seq_q, heads, head_dim), k=(batch, seq_kv, kv_heads, head_dim),
                  v=(batch, seq_kv, kv_heads, head_dim), sinks=(heads,),
                  bias=(1, heads, seq_q, seq_kv))
    dtypes = dict(q=dtype, k=dtype, v=dtype, sinks=jnp.float32, bias=jnp.float32)
    primals = {n: _normal(shapes[n], dtypes[n]) for n in NAMES}
    tangents = {n: _normal(shapes[n], dtypes[n]) for n in NAMES}
    return primals, tangents


def _oracle_jvp(primals, tangents, *, eps=1e-6, **kwargs):
    """(out, lse [B, T, N]) and their tangents: central differences of the float64 oracle
    at the (rounded) inputs."""
    def f(x):
        out, lse = attention_float64(x["q"], x["k"], x["v"], sinks=x["sinks"],
                                     bias=x["bias"], **kwargs)
        return out, np.swapaxes(lse, 1, 2)

    x0 = {n: np.asarray(a, np.float64) for n, a in primals.items()}
    t = {n: np.asarray(a, np.float64) for n, a in tangents.items()}
    plus, minus = (f({n: x0[n] + s * eps * t[n] for n in x0}) for s in (1, -1))
    return f(x0), tuple((a - b) / (2 * eps) for a, b in zip(plus, minus, strict=True))


def _assert_close(got, want, dtype, what, factor=1):
    err = rel_err(got, want)
    assert err < factor * tolerance(dtype), (what, err)


@pytest.mark.parametrize("backend", [BACKENDS["xla"], BACKENDS["triton"]], ids=str)
def test_jvp_matches_float64_oracle(backend):
    """jax.jvp and jax.linearize in every input at once (GQA, causal bottom-right, segment
    ids with a query length that empties rows, soft-cap, sinks, a bias), out and lse."""
    primals, tangents = _case(2, 24, 40, 4, 2, 16, F32)
    ids = jnp.array([[0] * 10 + [1] * 30, [0] * 40], jnp.int32)
    q_ids = ids[:, :24]
    lengths = jnp.array([24, 20])
    kwargs = dict(is_causal=True, causal_alignment="bottom_right", logits_soft_cap=4.0,
                  q_segment_ids=q_ids, kv_segment_ids=ids, query_seq_lengths=lengths)

    def f(q, k, v, sinks, bias):
        return backend.attention(q, k, v, bias=bias, sinks=sinks, return_lse=True, **kwargs)

    args = tuple(primals[n] for n in NAMES)
    dirs = tuple(tangents[n] for n in NAMES)
    (out, _), (d_out, d_lse) = jax.jit(lambda p, t: jax.jvp(f, p, t))(args, dirs)
    # The oracle masks with segment ids; the query lengths become ids of their own.
    q_oracle = np.where(np.arange(24)[None] < np.asarray(lengths)[:, None], q_ids, -2)
    (want_out, _), (want_d_out, want_d_lse) = _oracle_jvp(
        primals, tangents, scale=16 ** -0.5, softcap=4.0, segment_ids=(q_oracle, ids),
        mask=MaskSpec(24, 40, is_causal=True, causal_alignment="bottom_right"))
    _assert_close(out, want_out, F32, "out")
    _assert_close(d_out, want_d_out, F32, "d_out")
    _assert_close(d_lse, want_d_lse, F32, "d_lse")
    if backend.name == "xla":  # the same linear map (jit and eager round differently)
        linearized = jax.jit(lambda p, t: jax.linearize(f, *p)[1](*t))(args, dirs)
        for got, want in zip(linearized, (d_out, d_lse), strict=True):
            assert rel_err(got, want) < 1e-6
    # Rows that see no key output 0 whatever the inputs; their lse is the sink's.
    empty = np.asarray(lengths)[:, None] <= np.arange(24)[None]
    assert np.all(np.asarray(d_out)[empty] == 0)


def test_jacfwd_equals_jacrev():
    """The tangent (plain JAX) and its transpose (the Triton backward kernels) are one
    linear map: jacfwd and jacrev agree in every differentiable input (with a window and
    an explicit scale among the static arguments)."""
    backend = BACKENDS["triton"]
    primals, _ = _case(1, 4, 6, 2, 1, 4, F32)

    def f(*args):
        x = dict(zip(NAMES, args, strict=True))
        return backend.attention(x["q"], x["k"], x["v"], sinks=x["sinks"], bias=x["bias"],
                                 is_causal=True, causal_alignment="bottom_right",
                                 local_window_size=(3, 0), scale=0.7, return_lse=True)

    args = tuple(primals[n] for n in NAMES)
    argnums = tuple(range(len(NAMES)))
    forward = jax.jit(jax.jacfwd(f, argnums=argnums))(*args)
    reverse = jax.jit(jax.jacrev(f, argnums=argnums))(*args)
    for got, want in zip(jax.tree.leaves(forward), jax.tree.leaves(reverse), strict=True):
        assert rel_err(got, want) < 1e-5, rel_err(got, want)


def test_jvp_and_jit_grad_on_mosaic():
    """Mosaic GPU (interpret mode, 16-bit): jax.jit of jax.jvp vs the oracle, and
    jax.jit(jax.grad) through the fused dQ (its jax.new_ref accumulator is discharged in
    the lowering of the linear_call transpose) vs the oracle's gradients.

    No <ct, J·t> = <Jᵀ·ct, t> check here: both sides are sums of ~16k bf16-rounded terms
    that cancel to O(1), so their rounding is not small next to the sum (CI saw 8 %); the
    float32 backends check that identity as jacfwd == jacrev above."""
    from pallas_flash.mosaic import default_backward_config

    backend = BACKENDS["mosaic"]
    dtype = backend.dtype
    primals, tangents = _case(1, 128, 128, 2, 1, 64, dtype)
    mask = MaskSpec(128, 128)
    assert not default_backward_config((1, 128, 2, 64), (1, 128, 1, 64), dtype,
                                       mask).deterministic  # the fused dQ

    def f(q, k, v, sinks):
        return backend.attention(q, k, v, sinks=sinks, return_lse=True)

    args = tuple(primals[n] for n in NAMES[:4])
    dirs = tuple(tangents[n] for n in NAMES[:4])
    (out, _), (d_out, d_lse) = jax.jit(lambda p, t: jax.jvp(f, p, t))(args, dirs)
    primals["bias"] = tangents["bias"] = np.zeros((1, 1, 1, 1))  # no bias
    _, (want_d_out, want_d_lse) = _oracle_jvp(primals, tangents, scale=64 ** -0.5, mask=mask)
    _assert_close(d_out, want_d_out, dtype, "d_out")
    _assert_close(d_lse, want_d_lse, jnp.float32, "d_lse")

    # A cotangent the 16-bit backward takes exactly (it reads dO in the input dtype), so
    # the float64 oracle sees the same one.
    ct = _normal(out.shape, dtype).astype(jnp.float32)

    def loss(*args):
        return jnp.sum(f(*args)[0].astype(jnp.float32) * ct)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    x = {n: np.asarray(a, np.float64) for n, a in primals.items()}
    _, _, want = attention_float64(x["q"], x["k"], x["v"], scale=64 ** -0.5, mask=mask,
                                   sinks=x["sinks"], d_out=np.asarray(ct, np.float64))
    for name, got, ref in zip(NAMES[:4], grads, want, strict=True):
        _assert_close(got, ref, dtype, name, factor=2)  # gradients: twice out's


def test_one_input_at_a_time_and_vmap():
    """Tangents in one input at a time (the others closed over: symbolic zeros; the integer
    segment ids with a float0 tangent) add up to the oracle's; jax.vmap of jax.jvp too."""
    primals, tangents = _case(2, 8, 8, 2, 2, 8, F32)
    ids = jnp.array([[0] * 3 + [1] * 5, [0] * 8], jnp.int32)

    def f(x, ids):
        return pf.attention(x["q"], x["k"], x["v"], bias=x["bias"], sinks=x["sinks"],
                            q_segment_ids=ids, kv_segment_ids=ids, implementation="xla")

    def one_input(name):
        def g(x_name, ids):
            return f({**primals, name: x_name}, ids)
        return lambda t: jax.jvp(g, (primals[name], ids),
                                 (t, np.zeros(ids.shape, jax.dtypes.float0)))[1]

    _, (want, _) = _oracle_jvp(primals, tangents, scale=8 ** -0.5, segment_ids=(ids, ids))
    total = sum(jax.jit(one_input(name))(tangents[name]) for name in NAMES)
    _assert_close(total, want, F32, "sum of one-input tangents")
    stacked = jax.tree.map(lambda t: jnp.stack([t, -2 * t]), tangents)
    batched = jax.jit(jax.vmap(lambda t: jax.jvp(lambda x: f(x, ids), (primals,), (t,))[1]))(
        stacked)
    _assert_close(batched[0], want, F32, "vmap(jvp)")
    _assert_close(batched[1], -2 * want, F32, "vmap(jvp)")


def test_jvp_inside_shard_map():
    """Inside jax.shard_map (8 CPU devices, check_vma=True) the tangent runs on the local
    shards as the kernels do: equal to the unsharded call's."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    primals, tangents = _case(4, 16, 16, 4, 2, 8, F32)
    spec = P("data", None, "model", None)

    def f(q, k, v):
        return pf.attention(q, k, v, is_causal=True, implementation="xla", return_lse=True)

    def jvp(p, t):
        return jax.jvp(f, p, t)

    names = NAMES[:3]
    p, t = tuple(primals[n] for n in names), tuple(tangents[n] for n in names)
    lse_spec = P("data", None, "model")
    sharded = jax.jit(jax.shard_map(jvp, mesh=mesh, in_specs=((spec,) * 3,) * 2,
                                    out_specs=((spec, lse_spec),) * 2))(p, t)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(jax.jit(jvp)(p, t)),
                         strict=True):
        assert rel_err(got, want) < 1e-6


def test_jvp_of_decode_and_paged_attention():
    """decode_attention and paged_attention run the same custom_jvp: their tangents
    equal those of attention on the equivalent call."""
    from pallas_flash import paged

    q = _normal((2, 2, 4, 16))
    k, v = _normal((2, 32, 2, 16)), _normal((2, 32, 2, 16))
    tq, tk, tv = _normal(q.shape), _normal(k.shape), _normal(v.shape)
    lengths = jnp.array([32, 32])

    def reference(q, k, v):
        return pf.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                            implementation="xla")

    def tangent(fn):
        return jax.jit(lambda *p: jax.jvp(fn, p, (tq, tk, tv))[1])(q, k, v)

    want = tangent(reference)
    decode = tangent(lambda q, k, v: pf.decode_attention(
        q, k, v, key_value_seq_lengths=lengths, num_splits=2, implementation="xla"))
    assert rel_err(decode, want) < 1e-5

    table = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
    pages = lambda x: x.reshape(4, 16, 2, 16)  # noqa: E731  [2, 32] keys -> 4 pages of 16
    paged_out = tangent(lambda q, k, v: paged.paged_attention(
        q, pages(k), pages(v), table, lengths, implementation="xla"))
    assert rel_err(paged_out, want) < 1e-5


def test_compiled_mosaic_grad_and_jvp_lower_for_cuda():
    """The real Mosaic GPU kernels through the API, lowered for CUDA on the CPU: the fused
    dQ's jax.new_ref accumulator inside the linear_call transpose is discharged by its
    lowering (a custom_jvp_call around the kernel could not be), and jax.jvp lowers."""
    q = jax.ShapeDtypeStruct((2, 1024, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.bfloat16)

    def f(q, k, v):
        return pf.attention(q, k, v, implementation="mosaic")

    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    traced = grad.trace(q, kv, kv)
    assert "new_ref" in str(traced.jaxpr)  # the fused dQ (default at head_dim 64, dense)
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    jvp = jax.jit(lambda p, t: jax.jvp(f, p, t)).trace((q, kv, kv), (q, kv, kv))
    assert "mosaic_gpu" in jvp.lower(lowering_platforms=("cuda",)).as_text()

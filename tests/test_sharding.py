"""Attention on sharded arrays (pallas_flash/sharding.py), on the eight CPU devices of
tests/conftest.py: under ``jit`` with automatic mesh axes (custom_partitioning), with
explicit mesh axes (shard_map inside), and inside a user's ``shard_map``.

Every sharded result is checked against the float64 oracle and against the same call on
unsharded arrays; the compiled program must hold no collective, and out / dq / dk / dv
must keep the inputs' sharding. The Mosaic kernels' interpreter runs on one device only:
for it the tests check that a sharded call is refused rather than left to hang.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support import (
    BACKENDS,
    assert_matches,
    collectives,
    fresh_key,
    random_qkv,
    random_segments,
    rel_err,
)

from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64

# [batch, seq, heads, head_dim] split over batch (2) and heads (4).
QKV_SPEC = P("data", None, "model", None)


def mesh_of(axis_type: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


class Case(NamedTuple):
    name: str
    heads: int
    kv_heads: int
    causal: bool = False
    window: tuple[int, int] | None = None
    segments: bool = False
    softcap: float | None = None


CASES = [
    Case("dense", 4, 4),
    # GQA: a head shard holds 2 query heads of one KV head.
    Case("causal-gqa", 8, 4, causal=True),
    Case("segments-window", 4, 4, window=(9, 3), segments=True),
    Case("causal-softcap", 4, 4, causal=True, softcap=5.0),
]
# The interpreted Triton kernels compile slowly: the same features in two cases.
TRITON_CASES = [
    Case("dense-gqa-softcap", 8, 4, softcap=5.0),
    Case("causal-segments-window", 4, 4, causal=True, window=(9, 3), segments=True),
]
BATCH, SEQ, HEAD_DIM = 2, 48, 32




def forward_and_vjp(backend, case: Case, segment_ids):
    """(q, k, v, d_out) -> (out, lse, dq, dk, dv) through ``backend``, one function."""

    def f(q, k, v, d_out):
        kwargs = dict(is_causal=case.causal, local_window_size=case.window,
                      logits_soft_cap=case.softcap, return_residual=True)
        if segment_ids is not None:
            kwargs["q_segment_ids"] = kwargs["kv_segment_ids"] = segment_ids

        def attend(q, k, v):
            return backend.attention(q, k, v, **kwargs)

        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((d_out, jnp.zeros_like(lse))))

    return f


def oracle(case: Case, q, k, v, d_out, segment_ids):
    mask = MaskSpec(seq_q=SEQ, seq_kv=SEQ, is_causal=case.causal, window=case.window)
    segments = None if segment_ids is None else (segment_ids, segment_ids)
    return attention_float64(q, k, v, mask=mask, segment_ids=segments, softcap=case.softcap,
                             d_out=d_out)


SHARDED_BACKENDS = [BACKENDS["xla"], BACKENDS["triton"]]


# Automatic axes for every case; explicit axes (the same specs, through shard_map) for a
# GQA case (CI time).
JIT_PARAMS = [
    pytest.param(backend, case, axis_type, id=f"{backend}-{case.name}-{axis_type.name}")
    for backend, cases in ((BACKENDS["xla"], CASES), (BACKENDS["triton"], TRITON_CASES))
    for case in cases for axis_type in (AxisType.Auto, AxisType.Explicit)
    if axis_type == AxisType.Auto or case.name in ("causal-gqa", "dense-gqa-softcap")
]


@pytest.mark.parametrize(("backend", "case", "axis_type"), JIT_PARAMS)
def test_jit_keeps_batch_and_head_sharding(backend, case, axis_type):
    """Under jit, each device runs the kernels on its own batch and heads: no collective
    in the compiled forward + backward, every output sharded as its input, and results
    equal to the unsharded call's and the oracle's."""
    mesh = mesh_of(axis_type)
    q, k, v, d_out = random_qkv(BATCH, SEQ, SEQ, case.heads, case.kv_heads, HEAD_DIM,
                                backend.dtype)
    segment_ids = random_segments(BATCH, SEQ) if case.segments else None
    qkv_sharding = NamedSharding(mesh, QKV_SPEC)
    sharded = [jax.device_put(x, qkv_sharding) for x in (q, k, v, d_out)]
    if segment_ids is not None:
        segment_ids_sharded = jax.device_put(segment_ids, NamedSharding(mesh, P("data", None)))
    else:
        segment_ids_sharded = None

    compiled = jax.jit(forward_and_vjp(backend, case, segment_ids_sharded)).lower(
        *sharded).compile()
    assert collectives(compiled.as_text()) == {}
    results = compiled(*sharded)
    out, lse, dq, dk, dv = results
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert x.sharding.is_equivalent_to(qkv_sharding, 4), (name, x.sharding)
    # lse: [B, T, N]
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 3)

    # The unsharded call costs a compile: on automatic axes only, and for the slow Triton
    # interpreter in one case (the oracle checks every case).
    if axis_type == AxisType.Auto and (backend.name == "xla" or case.segments):
        unsharded = jax.jit(forward_and_vjp(backend, case, segment_ids))(q, k, v, d_out)
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results, unsharded,
                                   strict=True):
            assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, d_out, segment_ids)
    assert_matches(out, lse, (dq, dk, dv), ref_out, ref_lse, ref_grads, backend.dtype)


def shard_map_attention(backend, case: Case, mesh, *, check_vma: bool):
    """forward_and_vjp inside ``jax.shard_map`` over batch and heads, under jit."""

    def local(q, k, v, d_out, segment_ids):
        return forward_and_vjp(backend, case, segment_ids)(q, k, v, d_out)

    return jax.jit(jax.shard_map(
        local, mesh=mesh, check_vma=check_vma,
        in_specs=(QKV_SPEC,) * 4 + (P("data", None),),
        out_specs=(QKV_SPEC, P("data", None, "model"), QKV_SPEC, QKV_SPEC, QKV_SPEC)))


# XLA under check_vma=True (the default); Triton's interpreter needs check_vma=False (a
# limitation of Pallas's interpret mode: test_triton_interpret_refuses_check_vma).
SHARD_MAP_PARAMS = [pytest.param(BACKENDS["xla"], case, True, id=f"xla-{case.name}")
                    for case in CASES]
SHARD_MAP_PARAMS.append(pytest.param(BACKENDS["triton"], CASES[2], False,
                                     id=f"triton-{CASES[2].name}-check_vma_false"))


@pytest.mark.parametrize(("backend", "case", "check_vma"), SHARD_MAP_PARAMS)
def test_inside_shard_map(backend, case, check_vma):
    """Inside shard_map the kernels run on the local shards: forward and gradients equal
    the oracle's of the whole arrays."""
    mesh = mesh_of(AxisType.Auto)
    q, k, v, d_out = random_qkv(BATCH, SEQ, SEQ, case.heads, case.kv_heads, HEAD_DIM,
                                backend.dtype)
    segment_ids = (random_segments(BATCH, SEQ) if case.segments
                   else jnp.zeros((BATCH, SEQ), jnp.int32))
    out, lse, dq, dk, dv = shard_map_attention(backend, case, mesh, check_vma=check_vma)(
        q, k, v, d_out, segment_ids)
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, d_out, segment_ids)
    assert_matches(out, lse, (dq, dk, dv), ref_out, ref_lse, ref_grads, backend.dtype)


def test_triton_interpret_refuses_check_vma():
    """Pallas's interpreter cannot lower the kernels' loops under check_vma=True: a
    ValueError that says so, rather than jax's internal error."""
    mesh = mesh_of(AxisType.Auto)
    q, k, v, d_out = random_qkv(BATCH, SEQ, SEQ, 4, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="check_vma=False"):
        shard_map_attention(BACKENDS["triton"], CASES[0], mesh, check_vma=True)(
            q, k, v, d_out, jnp.zeros((BATCH, SEQ), jnp.int32))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_mosaic_interpret_refuses_several_devices(axis_type):
    """Mosaic GPU's interpreter fails or hangs on several CPU devices: a sharded call (jit
    or shard_map) raises a ValueError at trace time instead."""
    mosaic = BACKENDS["mosaic"]
    mesh = mesh_of(axis_type)
    q, k, v, _ = random_qkv(BATCH, 64, 64, 4, 4, 64, mosaic.dtype)
    sharded = [jax.device_put(x, NamedSharding(mesh, QKV_SPEC)) for x in (q, k, v)]
    with pytest.raises(ValueError, match="one device only"):
        jax.jit(lambda q, k, v: mosaic.attention(q, k, v)).lower(*sharded)
    local = jax.shard_map(lambda q, k, v: mosaic.attention(q, k, v), mesh=mesh,
                          in_specs=QKV_SPEC, out_specs=QKV_SPEC)
    with pytest.raises(ValueError, match="one device only"):
        jax.jit(local).lower(*sharded)


def test_mosaic_inside_a_one_device_shard_map_varies_and_differentiates():
    """plgpu.kernel drops the manual axes of its out_type: the results must still vary
    over the shard_map's axis (check_vma=True), forward and VJP, with the plain values."""
    mosaic = BACKENDS["mosaic"]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    spec = P(None, "seq")
    q, k, v, d_out = random_qkv(1, 64, 64, 2, 1, 64, mosaic.dtype)

    def fwd_vjp(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: mosaic.attention(q, k, v, is_causal=True), q, k, v)
        return (out, *vjp(d_out))

    def checked(*args):
        results = fwd_vjp(*args)
        assert all("seq" in jax.typeof(x).manual_axis_type.varying for x in results)
        return results

    local = jax.jit(jax.shard_map(checked, mesh=mesh, in_specs=(spec,) * 4,
                                  out_specs=(spec,) * 4))(q, k, v, d_out)
    for got, want in zip(local, jax.jit(fwd_vjp)(q, k, v, d_out), strict=True):
        assert rel_err(got, want) < 1e-6


SEQUENCE_SPEC = P("data", "model", None, None)
GATHERED_PARAMS = [
    pytest.param(BACKENDS["xla"], 4, SEQUENCE_SPEC, SEQUENCE_SPEC, id="xla-sequence"),
    pytest.param(BACKENDS["triton"], 4, SEQUENCE_SPEC, SEQUENCE_SPEC, id="triton-sequence"),
    # 8 query heads over 4 head shards, 2 KV heads (replicated): a shard would split a KV
    # head's group.
    pytest.param(BACKENDS["triton"], 2, QKV_SPEC, P("data", None, None, None),
                 id="triton-split-groups"),
]


@pytest.mark.parametrize(("backend", "kv_heads", "q_spec", "kv_spec"), GATHERED_PARAMS)
def test_splits_the_kernels_cannot_keep_are_gathered(backend, kv_heads, q_spec, kv_spec):
    """A split the kernels cannot keep (the sequence, head_dim, a GQA group) is gathered
    first: correct results, gradients too, at the cost of collectives (which
    :func:`collectives` finds)."""
    case = Case("causal", 8, kv_heads, causal=True)
    mesh = mesh_of(AxisType.Auto)
    q, k, v, d_out = random_qkv(BATCH, SEQ, SEQ, case.heads, case.kv_heads, HEAD_DIM,
                                backend.dtype)
    q_sharding, kv_sharding = NamedSharding(mesh, q_spec), NamedSharding(mesh, kv_spec)
    sharded = [jax.device_put(x, s) for x, s in ((q, q_sharding), (k, kv_sharding),
                                                 (v, kv_sharding), (d_out, q_sharding))]
    compiled = jax.jit(forward_and_vjp(backend, case, None)).lower(*sharded).compile()
    assert collectives(compiled.as_text())  # the gathers (the check above can fail)
    out, lse, dq, dk, dv = compiled(*sharded)
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, d_out, None)
    assert_matches(out, lse, (dq, dk, dv), ref_out, ref_lse, ref_grads, backend.dtype)


def test_vmap_of_sharded_arrays():
    """custom_partitioning has no vmap rule: under vmap the vmapped kernels run (as without
    sharding), and the results are right."""
    triton = BACKENDS["triton"]
    mesh = mesh_of(AxisType.Auto)
    case = Case("causal", 4, 4, causal=True)
    q, k, v, d_out = random_qkv(2 * BATCH, SEQ, SEQ, case.heads, case.kv_heads, HEAD_DIM)
    stacked = [x.reshape(2, BATCH, *x.shape[1:]) for x in (q, k, v, d_out)]
    sharding = NamedSharding(mesh, P(None, "data", None, "model", None))
    sharded = [jax.device_put(x, sharding) for x in stacked]
    out, lse, dq, dk, dv = jax.jit(jax.vmap(forward_and_vjp(triton, case, None)))(*sharded)
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, d_out, None)
    merged = [x.reshape(2 * BATCH, *x.shape[2:]) for x in (out, lse, dq, dk, dv)]
    assert_matches(*merged[:2], merged[2:], ref_out, ref_lse, ref_grads, triton.dtype)


def test_bias_mask_sinks_follow_the_shards():
    """A bias broadcast over batch, a mask broadcast over heads and per-head sinks, all
    differentiated where they can be: no gather or permute, only the all-reduces that sum
    the broadcast bias's and the sinks' gradients over batch shards; correct results."""
    triton = BACKENDS["triton"]
    mesh = mesh_of(AxisType.Auto)
    heads = 4
    q, k, v, d_out = random_qkv(BATCH, SEQ, SEQ, heads, heads, HEAD_DIM)
    keys = jax.random.split(fresh_key(), 3)
    bias = jax.random.normal(keys[0], (1, heads, SEQ, SEQ), jnp.float32)
    mask = jax.random.bernoulli(keys[1], 0.8, (BATCH, 1, SEQ, SEQ))
    sinks = jax.random.normal(keys[2], (heads,), jnp.float32)

    def f(q, k, v, bias, sinks, d_out):
        def attend(q, k, v, bias, sinks):
            return triton.attention(q, k, v, bias, mask, sinks=sinks)

        out, vjp = jax.vjp(attend, q, k, v, bias, sinks)
        return (out, *vjp(d_out))

    qkv = NamedSharding(mesh, QKV_SPEC)
    args = (*(jax.device_put(x, qkv) for x in (q, k, v)),
            jax.device_put(bias, NamedSharding(mesh, P(None, "model", None, None))),
            jax.device_put(sinks, NamedSharding(mesh, P("model"))), jax.device_put(d_out, qkv))
    mask = jax.device_put(mask, NamedSharding(mesh, P("data", None, None, None)))
    compiled = jax.jit(f).lower(*args).compile()
    assert set(collectives(compiled.as_text())) <= {"all-reduce"}
    out, dq, dk, dv, d_bias, d_sinks = compiled(*args)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert x.sharding.is_equivalent_to(qkv, 4), name
    ref_out, _, ref_grads = attention_float64(q, k, v, bias=bias, attn_mask=mask, sinks=sinks,
                                              d_out=d_out)
    assert rel_err(out, ref_out) < 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "d_sinks", "d_bias"),
                               (dq, dk, dv, d_sinks, d_bias), ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5, (name, rel_err(got, want))
    assert np.asarray(d_bias).shape == bias.shape

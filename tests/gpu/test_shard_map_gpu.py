"""The compiled kernels inside ``jax.shard_map`` with ``check_vma=True`` and in a ring, on
a one-device mesh (the GPU machine has one): the vma typing of the kernels' results, which
the CPU interpreters cannot check for Triton (tests/test_sharding.py, tests/test_ring.py
check the rest on eight CPU devices). Forward and gradients against the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import bits, rel_err

import pallas_flash as pf
from pallas_flash import fp8
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from pallas_flash.ring import simulated_ring_attention

AXIS = "seq"


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, seq, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, seq, kv_heads, head_dim), jnp.bfloat16)
            for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape, jnp.bfloat16)


def _check(results, q, k, v, d_out, causal: bool):
    out, dq, dk, dv = results
    want_out, _, want_grads = attention_float64(
        *(np.asarray(x, np.float64) for x in (q, k, v)),
        mask=MaskSpec(q.shape[1], k.shape[1], is_causal=causal),
        d_out=np.asarray(d_out, np.float64))
    assert rel_err(out, want_out) < 1e-2
    for got, want in zip((dq, dk, dv), want_grads[:3], strict=True):
        assert rel_err(got, want) < 2e-2


def _vjp_in_shard_map(attend, q, k, v, d_out):
    def local(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(d_out))

    spec = P(None, AXIS)
    mapped = jax.shard_map(local, mesh=_mesh(), in_specs=(spec,) * 4, out_specs=(spec,) * 4,
                           check_vma=True)
    return jax.jit(mapped)(q, k, v, d_out)


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_in_shard_map(implementation, causal):
    q, k, v, d_out = _inputs(1024, 8, 2, 128, seed=3 + causal)
    results = _vjp_in_shard_map(lambda q, k, v: pf.attention(
        q, k, v, is_causal=causal, implementation=implementation), q, k, v, d_out)
    _check(results, q, k, v, d_out, causal)


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_of_one_device(implementation, layout):
    """ring_attention on a one-device axis: the plain call, through the ring's code."""
    q, k, v, d_out = _inputs(2048, 8, 8, 128, seed=11)
    results = _vjp_in_shard_map(lambda q, k, v: pf.ring_attention(
        q, k, v, axis_name=AXIS, is_causal=True, layout=layout,
        implementation=implementation), q, k, v, d_out)
    _check(results, q, k, v, d_out, causal=True)


def test_fp8_attention_in_shard_map():
    """attention_fp8 on the FP8 kernel inside shard_map(check_vma=True), forward and grad
    (its tracing is checked on the CPU: tests/test_fp8_kernel.py)."""
    q, k, v, d_out = _inputs(1024, 8, 2, 128, seed=17)
    out, dq, dk, dv = _vjp_in_shard_map(lambda q, k, v: fp8.attention_fp8(
        q, k, v, is_causal=True, implementation="mosaic"), q, k, v, d_out)
    want_out, _, want_grads = attention_float64(
        *(np.asarray(x, np.float64) for x in (q, k, v)),
        mask=MaskSpec(1024, 1024, is_causal=True), d_out=np.asarray(d_out, np.float64))
    assert rel_err(out, want_out) < 0.1          # FP8's own error (tests/gpu/test_fp8_gpu.py)
    for got, want in zip((dq, dk, dv), want_grads[:3], strict=True):
        assert rel_err(got, want) < 5e-2         # the bf16 backward on the FP8 residuals


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_matches_xla_and_is_deterministic(implementation, causal):
    """Four ring steps on the one-device axis (simulated_ring_attention: each block passed
    to itself), so the unrolled steps, their barriers and the shared step function run on
    the compiled kernels (Mosaic: each step merged in the forward kernel's epilogue):
    forward and gradients against the same ring on XLA in float32, and with
    deterministic=True the same gradient bits on a second run."""
    q, k, v, d_out = _inputs(2048, 8, 2, 128, seed=23)

    def run(q, k, v, d_out, implementation, deterministic=False):
        return _vjp_in_shard_map(lambda q, k, v: simulated_ring_attention(
            q, k, v, num_steps=4, axis_name=AXIS, is_causal=causal,
            deterministic=deterministic, implementation=implementation), q, k, v, d_out)

    got = run(q, k, v, d_out, implementation, deterministic=True)
    want = run(*(x.astype(jnp.float32) for x in (q, k, v, d_out)), "xla")
    assert rel_err(got[0], want[0]) < 1e-2
    for a, b in zip(got[1:], want[1:], strict=True):
        assert rel_err(a, b) < 2e-2
    again = run(q, k, v, d_out, implementation, deterministic=True)
    for a, b in zip(got, again, strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))

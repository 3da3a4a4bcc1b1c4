"""Attention on sharded arrays (pallas_flash/sharding.py), on the eight CPU devices of
tests/conftest.py: under ``jit`` with automatic mesh axes (custom_partitioning), with
explicit mesh axes (shard_map inside), and inside a user's ``shard_map``.

Every sharded result is checked against the float64 oracle and against the same call on
unsharded arrays; the compiled program must hold no collective, and out / dq / dk / dv
must keep the inputs' sharding. The Mosaic kernels' interpreter runs on one device only:
for it the tests check that a sharded call is refused rather than left to hang.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support import BACKENDS, assert_matches, fresh_key, random_qkv, rel_err

from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")
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
    Case("causal", 4, 4, causal=True),
    Case("gqa", 8, 4, causal=True),  # a head shard holds 2 query heads of one KV head
    Case("segments", 4, 4, segments=True),
    Case("window", 4, 4, window=(9, 3)),
    Case("softcap", 4, 4, causal=True, softcap=5.0),
]
BATCH, SEQ, HEAD_DIM = 2, 64, 32


def random_segments(batch: int, seq: int) -> jax.Array:
    """Sorted ids of 1-4 packed documents per row."""
    cuts = jax.random.randint(fresh_key(), (batch, 3), 0, seq)
    return jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1, dtype=jnp.int32)


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO holds (only the nonzero ones)."""
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", compiled_text)) for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


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


# Automatic axes for every case; explicit axes (the same specs, through shard_map) for the
# GQA and segment cases, which cover every operand's spec (CI time).
JIT_PARAMS = [
    pytest.param(backend, case, axis_type, id=f"{backend}-{case.name}-{axis_type.name}")
    for backend in SHARDED_BACKENDS for case in CASES
    for axis_type in (AxisType.Auto, AxisType.Explicit)
    if axis_type == AxisType.Auto or case.name in ("gqa", "segments")
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

    unsharded = jax.jit(forward_and_vjp(backend, case, segment_ids))(q, k, v, d_out)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results, unsharded,
                               strict=True):
        assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))
    ref_out, ref_lse, ref_grads = oracle(case, q, k, v, d_out, segment_ids)
    assert_matches(out, lse, (dq, dk, dv), ref_out, ref_lse, ref_grads, backend.dtype)

"""Ring attention (pallas_flash/ring.py) on sub-meshes of the eight CPU devices of
tests/conftest.py: the sequence split over n = 2, 4, 8 devices, both layouts, against the
float64 oracle on the whole sequence, forward and dq / dk / dv (and dsinks); the zigzag
reordering; the argument checks; the compiled program's collectives and per-device memory.

The XLA backend runs most cases (the interpreted Triton kernels compile slowly: one case);
Mosaic's interpreter runs on one device only and is refused on a ring.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
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

import pallas_flash as pf
from pallas_flash import ring
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

AXIS = "seq"
SEQ_SPEC = P(None, AXIS)  # [batch, seq, ...] split over the ring
HEAD_DIM = 16


def ring_mesh(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:n])


class Case(NamedTuple):
    name: str
    n: int
    layout: str
    causal: bool = False
    heads: int = 2
    kv_heads: int = 2
    window: tuple[int, int] | None = None
    segments: bool = False
    softcap: float | None = None
    sinks: bool = False
    local_seq: int = 32


CASES = [
    Case("n2-zigzag-causal", 2, "zigzag", causal=True),
    Case("n4-contiguous-causal-gqa", 4, "contiguous", causal=True, heads=4, kv_heads=2),
    Case("n2-contiguous-segments-window", 2, "contiguous", window=(9, 3), segments=True),
    # A window shorter than a chunk (16): most (device, step) pairs see nothing and are
    # skipped, the others are calls at global offsets.
    Case("n8-zigzag-causal-window-softcap-sinks-gqa", 8, "zigzag", causal=True, heads=4,
         kv_heads=1, window=(8, 0), softcap=5.0, sinks=True),
]


def ring_vjp(case: Case, check_vma: bool = True, **kwargs):
    """Global (q, k, v, d_out, segment_ids, sinks) -> global (out, residual, dq, dk, dv,
    dsinks) of ``ring_attention`` in a shard_map over ``case.n`` devices: the arrays are
    put in the layout's order first and back after."""
    n, zigzag = case.n, case.layout == "zigzag"
    into = (lambda x: pf.to_zigzag(x, n)) if zigzag else (lambda x: x)
    back = (lambda x: pf.from_zigzag(x, n)) if zigzag else (lambda x: x)

    def local(q, k, v, d_out, ids, sinks):
        def attend(q, k, v, sinks):
            return pf.ring_attention(
                q, k, v, axis_name=AXIS, is_causal=case.causal, layout=case.layout,
                q_segment_ids=ids, local_window_size=case.window,
                logits_soft_cap=case.softcap, sinks=sinks, return_residual=True, **kwargs)

        (out, residual), vjp = jax.vjp(attend, q, k, v, sinks)
        return (out, residual, *vjp((d_out, jnp.zeros_like(residual))))

    def run(q, k, v, d_out, ids, sinks):
        in_specs = (SEQ_SPEC,) * 4 + (None if ids is None else SEQ_SPEC, P())
        out_specs = (SEQ_SPEC,) * 5 + (P() if sinks is not None else None,)
        mapped = jax.shard_map(local, mesh=ring_mesh(n), in_specs=in_specs,
                               out_specs=out_specs, check_vma=check_vma)
        results = jax.jit(mapped)(*(into(x) for x in (q, k, v, d_out)),
                                  None if ids is None else into(ids), sinks)
        return (*(back(x) for x in results[:5]), results[5])

    return run


def inputs(case: Case):
    seq = case.local_seq * case.n
    q, k, v, d_out = random_qkv(1, seq, seq, case.heads, case.kv_heads, HEAD_DIM)
    ids = random_segments(1, seq) if case.segments else None
    sinks = jax.random.normal(fresh_key(), (case.heads,)) if case.sinks else None
    return q, k, v, d_out, ids, sinks


def check_against_oracle(case: Case, results, q, k, v, d_out, ids, sinks):
    out, residual, dq, dk, dv, d_sinks = results
    seq = q.shape[1]
    mask = MaskSpec(seq, seq, is_causal=case.causal, window=case.window)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=mask, segment_ids=None if ids is None else (ids, ids),
        softcap=case.softcap, sinks=sinks, d_out=d_out)
    names = ("dq", "dk", "dv") + (("dsinks",) if sinks is not None else ())
    grads = (dq, dk, dv) + ((d_sinks,) if sinks is not None else ())
    # The residual is the lse in the input dtype (float32 here), without gradient.
    assert_matches(out, residual, grads, ref_out, ref_lse, ref_grads, q.dtype, names=names)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_matches_the_oracle(case):
    """Forward, residual and every gradient equal attention on the whole sequence."""
    args = inputs(case)
    results = ring_vjp(case, implementation="xla")(*args)
    check_against_oracle(case, results, *args)


def test_ring_inside_a_data_parallel_mesh():
    """A (data 2) x (seq 2) mesh: batch split over "data", a ring per batch shard over
    "seq"; the sinks (replicated) get their gradient summed over both axes."""
    case = Case("data-parallel", 2, "contiguous", sinks=True)
    seq = case.local_seq * case.n
    q, k, v, d_out = random_qkv(2, seq, seq, 2, 2, HEAD_DIM)
    sinks = jax.random.normal(fresh_key(), (2,))
    mesh = jax.make_mesh((2, 2), ("data", AXIS), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])

    def local(q, k, v, d_out, sinks):
        def attend(q, k, v, sinks):
            return pf.ring_attention(q, k, v, axis_name=AXIS, layout="contiguous",
                                     sinks=sinks, return_residual=True,
                                     implementation="xla")

        (out, residual), vjp = jax.vjp(attend, q, k, v, sinks)
        return (out, residual, *vjp((d_out, jnp.zeros_like(residual))))

    spec = P("data", AXIS)
    results = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + (P(),),
                                    out_specs=(spec,) * 5 + (P(),)))(q, k, v, d_out, sinks)
    check_against_oracle(case, results, q, k, v, d_out, None, sinks)


def test_ring_triton_interpret():
    """The Triton kernels (interpreted: shard_map(check_vma=False), as for attention) in
    the ring: causal with a window reaching into the previous shard (a call at a global
    offset)."""
    case = Case("triton", 2, "contiguous", causal=True, window=(20, 0))
    args = inputs(case)
    backend = BACKENDS["triton"]
    results = ring_vjp(case, check_vma=False, **backend.kwargs(HEAD_DIM))(*args)
    check_against_oracle(case, results, *args)


def test_nan_rows_leave_no_trace():
    """A query document with no keys and a key document with no queries, filled with NaN,
    leave exact zeros (rows zeroed per step, as attention zeroes them once), and the rest
    equals the oracle on the same inputs."""
    case = Case("nan", 2, "contiguous", causal=True)
    seq = case.local_seq * case.n
    q, k, v, d_out = random_qkv(1, seq, seq, 2, 2, HEAD_DIM)
    # Query documents 0 | 1 (no keys) | 2; key documents 0 | 3 (no queries) | 2.
    q_ids = jnp.asarray([[0] * 16 + [1] * 16 + [2] * 32], jnp.int32)
    kv_ids = jnp.asarray([[0] * 16 + [3] * 16 + [2] * 32], jnp.int32)
    rows = slice(16, 32)

    def local(q, k, v, d_out, q_ids, kv_ids):
        def attend(q, k, v):
            return pf.ring_attention(q, k, v, axis_name=AXIS, is_causal=True,
                                     layout="contiguous", q_segment_ids=q_ids,
                                     kv_segment_ids=kv_ids, return_residual=True,
                                     implementation="xla")

        (out, residual), vjp = jax.vjp(attend, q, k, v)
        return (out, residual, *vjp((d_out, jnp.zeros_like(residual))))

    mapped = jax.jit(jax.shard_map(local, mesh=ring_mesh(2), in_specs=(SEQ_SPEC,) * 6,
                                   out_specs=(SEQ_SPEC,) * 5))
    out, residual, dq, dk, dv = mapped(q.at[:, rows].set(jnp.nan), k.at[:, rows].set(jnp.nan),
                                       v.at[:, rows].set(jnp.nan), d_out, q_ids, kv_ids)
    for x in (out, dq, dk, dv):
        assert np.all(np.asarray(x[:, rows]) == 0)
    assert np.all(np.asarray(residual[:, rows]) == np.float32(EMPTY_ROW_LSE))
    ref = attention_float64(q, k, v, mask=MaskSpec(seq, seq, is_causal=True),
                            segment_ids=(q_ids, kv_ids), d_out=d_out)
    assert_matches(out, residual, (dq, dk, dv), *ref, jnp.float32)


def test_one_device_ring_and_simulated_ring():
    """n = 1 is attention on the shard; the simulated ring (benchmarks/ring.py) runs n steps
    on one device, each against the same K/V here (not causal): the merged softmax is the
    same, its log-denominator log(n) larger."""
    q, k, v, _ = random_qkv(1, 32, 32, 2, 2, HEAD_DIM)
    mesh = ring_mesh(1)

    def local(q, k, v):
        one = pf.ring_attention(q, k, v, axis_name=AXIS, return_residual=True,
                                implementation="xla")
        sim = ring.simulated_ring_attention(q, k, v, num_steps=3, axis_name=AXIS,
                                            return_residual=True, implementation="xla")
        return one, sim

    (out1, res1), (out3, res3) = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC))(q, k, v)
    want, want_res = pf.attention(q, k, v, return_residual=True, implementation="xla")
    assert rel_err(out1, want) < 1e-6 and rel_err(res1, want_res) < 1e-6
    assert rel_err(out3, want) < 1e-6 and rel_err(res3, want_res + np.log(3)) < 1e-6


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_mosaic_steps_merge_in_the_kernel(causal):
    """On the Mosaic backend the steps' merges happen in the forward kernel's epilogue
    (``into=``, interpret mode on the one-device axis): the simulated ring's output,
    residual and gradients equal the same ring on XLA (merge_splits), and its forward
    program holds no merge outside the kernels."""
    q, k, v, d_out = random_qkv(1, 256, 256, 2, 1, 64, jnp.bfloat16)

    def attend(implementation):
        return lambda q, k, v: ring.simulated_ring_attention(
            q, k, v, num_steps=3, axis_name=AXIS, is_causal=causal, return_residual=True,
            implementation=implementation, interpret=implementation == "mosaic")

    def run(implementation):
        def local(q, k, v, d_out):
            (out, res), vjp = jax.vjp(attend(implementation), q, k, v)
            return (out, res, *vjp((d_out, jnp.zeros_like(res))))
        return jax.jit(jax.shard_map(local, mesh=ring_mesh(1), in_specs=(SEQ_SPEC,) * 4,
                                     out_specs=SEQ_SPEC))

    got = run("mosaic")(q, k, v, d_out)
    want = run("xla")(*(x.astype(jnp.float32) for x in (q, k, v, d_out)))
    for a, b in zip(got, want, strict=True):
        assert not np.isnan(np.asarray(a, np.float32)).any()
        assert rel_err(a, b) < 2e-2
    # Two later steps, each merged by its kernel: no exp of a merge weight in XLA.
    forward = jax.jit(jax.shard_map(attend("mosaic"), mesh=ring_mesh(1),
                                    in_specs=(SEQ_SPEC,) * 3, out_specs=SEQ_SPEC))
    assert str(forward.trace(q, k, v).jaxpr).count(" exp ") == 0


# --- the static plan ------------------------------------------------------------------------

@pytest.mark.parametrize(("q_start", "kv_start", "causal", "window"), [
    (48, 16, True, None), (16, 48, True, (40, 0)), (32, 0, False, (9, 3)),
    (0, 32, False, (20, 20)), (64, 0, True, (10, 0))])
def test_mask_offsets_are_a_block_of_the_global_mask(q_start, kv_start, causal, window):
    """``MaskSpec(q_start=a, kv_start=b)`` on a 16 x 24 block is the global mask's block at
    (a, b): its visibility, and the key / query block ranges every kernel walks."""
    whole = MaskSpec(128, 128, is_causal=causal, window=window)
    part = MaskSpec(16, 24, is_causal=causal, window=window, q_start=q_start,
                    kv_start=kv_start)
    want = np.asarray(whole.block_visible(q_start, 16, kv_start, 24))
    np.testing.assert_array_equal(np.asarray(part.block_visible(0, 16, 0, 24)), want)
    first, full_first, full_last, last = (int(x) for x in part.kv_blocks(0, 16, 8))
    seen = [bool(want[:, 8 * j:8 * j + 8].any()) for j in range(3)]
    full = [bool(want[:, 8 * j:8 * j + 8].all()) for j in range(3)]
    assert [first <= j < last for j in range(3)] == seen or not any(seen)
    assert all(full[j] for j in range(full_first, full_last))
    first, _, _, last = (int(x) for x in part.q_blocks(0, 24, 8, 2))
    assert [first <= i < last for i in range(2)] == [
        bool(want[8 * i:8 * i + 8].any()) for i in range(2)] or not want.any()

def plan_of(n: int, layout: str, causal: bool, window=None, local_seq: int = 32):
    """{(device, step): kernel calls} of a ring through the module's planner."""
    chunks = 2 if layout == "zigzag" else 1
    band = MaskSpec(n * local_seq, n * local_seq, is_causal=causal, window=window).band
    r = ring._Ring(axis_name=AXIS, size=n, layout=layout, chunk_q=local_seq // chunks,
                   chunk_kv=local_seq // chunks, is_causal=causal, window=window, band=band,
                   scale=1.0, softcap=None, implementation="xla", interpret=False,
                   config=None)
    return {(d, s): r.plan(d, s) for d in range(n) for s in range(n)}


def work(calls) -> int:
    """Visible (query, key) pairs of a step's calls."""
    return sum(round(c.mask.visible_fraction() * c.mask.seq_q * c.mask.seq_kv) for c in calls)


def test_zigzag_causal_work_is_equal_and_one_call_per_step():
    n, local_seq = 4, 32
    plans = plan_of(n, "zigzag", causal=True, local_seq=local_seq)
    assert all(len(calls) == 1 for calls in plans.values())
    half = local_seq * local_seq // 2
    for (device, step), calls in plans.items():
        if step == 0:  # the local causal block, as attention(is_causal=True) on it
            assert calls[0].mask == MaskSpec(local_seq, local_seq, is_causal=True)
        else:  # half the block, no mask
            assert calls[0].mask.is_dense and work(calls) == half, (device, step)
    # Contiguous: the steps from higher devices are skipped, the work is uneven.
    contiguous = plan_of(n, "contiguous", causal=True, local_seq=local_seq)
    assert [sum(work(contiguous[d, s]) for s in range(n)) for d in range(n)] == [
        528, 1552, 2576, 3600]
    assert contiguous[0, 1] == ()


def test_window_steps_with_nothing_visible_launch_no_kernel():
    plans = plan_of(4, "zigzag", causal=True, window=(20, 0))
    assert plans[0, 1] == () and plans[3, 3] == ()
    # Every visible pair is covered exactly once: the calls' work adds up to the mask's.
    seq = 4 * 32
    total = MaskSpec(seq, seq, is_causal=True, window=(20, 0)).visible_fraction() * seq * seq
    assert sum(work(calls) for calls in plans.values()) == round(total)


# --- layouts -------------------------------------------------------------------------------

def test_zigzag_hand_checked_and_round_trip():
    x = jnp.arange(8)
    # 2 shards, 4 chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    np.testing.assert_array_equal(pf.to_zigzag(x, 2, axis=0), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(pf.from_zigzag(pf.to_zigzag(x, 2, axis=0), 2, axis=0), x)
    y = jax.random.normal(fresh_key(), (2, 48, 3))
    for n in (1, 4, 6):
        np.testing.assert_array_equal(pf.from_zigzag(pf.to_zigzag(y, n), n), y)
        np.testing.assert_array_equal(pf.to_zigzag(pf.from_zigzag(y, n), n), y)
    with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
        pf.to_zigzag(y, 5)
    with pytest.raises(ValueError, match="num_shards"):
        pf.from_zigzag(y, 0)


# --- bad input -----------------------------------------------------------------------------

def _inside_ring(fn, n: int = 2, seq_q: int = 64, seq_kv: int = 64):
    """Traces ``fn(q, k, v)`` inside a shard_map over ``n`` devices (nothing runs)."""
    q = jnp.ones((1, seq_q, 2, HEAD_DIM), jnp.bfloat16)
    k = jnp.ones((1, seq_kv, 2, HEAD_DIM), jnp.bfloat16)
    mapped = jax.shard_map(fn, mesh=ring_mesh(n), in_specs=(SEQ_SPEC,) * 3,
                           out_specs=SEQ_SPEC, check_vma=False)
    return jax.jit(mapped).trace(q, k, k)


@pytest.mark.parametrize(("kwargs", "seq_q", "seq_kv", "match"), [
    (dict(axis_name="other"), 32, 32, "axis_name must name a mesh axis"),
    (dict(axis_name=AXIS, layout="striped"), 32, 32, "layout must be one of"),
    (dict(axis_name=AXIS), 32, 16, "layout='zigzag' needs local query and key/value"),
    (dict(axis_name=AXIS), 5, 5, "even local length"),
    (dict(axis_name=AXIS, implementation="mosaic", interpret=True), 32, 32,
     "runs on one device only"),
    (dict(axis_name=AXIS, implementation="cudnn"), 32, 32, "implementation must be one of"),
    (dict(axis_name=AXIS, local_window_size=-1), 32, 32, "local_window_size"),
    (dict(axis_name=AXIS, sinks=jnp.zeros(3)), 32, 32, "sinks must have shape"),
    (dict(axis_name=AXIS, deterministic="yes"), 32, 32, "deterministic must be a bool"),
])
def test_bad_arguments_raise(kwargs, seq_q, seq_kv, match):
    """Local lengths ``seq_q``, ``seq_kv`` on a ring of 2."""
    with pytest.raises(ValueError, match=match):
        _inside_ring(lambda q, k, v: pf.ring_attention(q, k, v, **kwargs),
                     seq_q=seq_q * 2, seq_kv=seq_kv * 2)


def test_deterministic_reaches_every_backward_step(monkeypatch):
    """ring_attention(deterministic=True): each step's backward kernels get it."""
    from pallas_flash import sharding
    seen = []
    real = sharding.backward

    def spy(static, *args, **kwargs):
        seen.append(static.deterministic)
        return real(static, *args, **kwargs)

    monkeypatch.setattr(sharding, "backward", spy)

    def loss(q, k, v):
        return jnp.sum(pf.ring_attention(q, k, v, axis_name=AXIS, is_causal=True,
                                         deterministic=True, implementation="xla"))

    q = jnp.ones((1, 128, 2, HEAD_DIM), jnp.float32)
    grad = jax.shard_map(jax.grad(loss), mesh=ring_mesh(2), in_specs=(SEQ_SPEC,) * 3,
                         out_specs=SEQ_SPEC)
    jax.jit(grad).trace(q, q, q)
    assert seen and all(seen)


def test_outside_shard_map_raises():
    q = jnp.ones((1, 32, 2, HEAD_DIM))
    with pytest.raises(ValueError, match="not inside shard_map"):
        pf.ring_attention(q, q, q, axis_name=AXIS)


def test_contiguous_takes_unequal_lengths():
    """Cross-attention shards of different lengths need no equal chunks."""
    seq_q, seq_kv, n = 32, 64, 2
    q, k, v, _ = random_qkv(1, seq_q, seq_kv, 2, 2, HEAD_DIM)

    def local(q, k, v):
        return pf.ring_attention(q, k, v, axis_name=AXIS, layout="contiguous",
                                 is_causal=True, implementation="xla")

    out = jax.jit(jax.shard_map(local, mesh=ring_mesh(n), in_specs=(SEQ_SPEC,) * 3,
                                out_specs=SEQ_SPEC))(q, k, v)
    # Query chunk i (16 rows) at 16 i, key chunk j (32 keys) at 32 j: query p sees keys <= p.
    ref_out, _ = attention_float64(q, k, v, mask=MaskSpec(seq_q, seq_kv, is_causal=True))
    assert rel_err(out, ref_out) < 1e-5


# --- the compiled program: collectives and memory ------------------------------------------

def compiled_ring(n: int, local_seq: int, heads: int, head_dim: int):
    """The compiled forward + backward of a zigzag ring over ``n`` devices (not causal:
    one kernel call per step, the quickest to compile)."""
    shape = jax.ShapeDtypeStruct((1, local_seq * n, heads, head_dim), jnp.float32)

    def local(q, k, v, d_out):
        def attend(q, k, v):
            return pf.ring_attention(q, k, v, axis_name=AXIS, implementation="xla")

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(d_out))

    mapped = jax.shard_map(local, mesh=ring_mesh(n), in_specs=(SEQ_SPEC,) * 4,
                           out_specs=(SEQ_SPEC,) * 4)
    return jax.jit(mapped).lower(shape, shape, shape, shape).compile()


def test_ring_memory_is_per_shard_and_it_only_permutes():
    """Per-device temp memory does not grow with the ring: from n = 4 to n = 8 the global
    sequence doubles, and an all-gather of K/V would add the 4 new shards' K and V (1 MiB
    here), a global L x L score buffer 1.5 MiB; the ring adds nothing. (n = 2 is left out:
    XLA unrolls its one-trip loop, a different program.) The compiled program passes K/V
    with collective-permutes and gathers nothing."""
    local_seq, heads, head_dim = 64, 2, 256
    local_bytes = local_seq * heads * head_dim * 4  # one local shard of q, k or v
    temp = {}
    for n in (4, 8):
        compiled = compiled_ring(n, local_seq, heads, head_dim)
        counts = collectives(compiled.as_text())
        assert counts.get("collective-permute", 0) > 0, counts
        assert set(counts) == {"collective-permute"}, counts
        temp[n] = compiled.memory_analysis().temp_size_in_bytes
    gathered_growth = 2 * 4 * local_bytes  # K and V of the 4 more shards
    assert temp[8] - temp[4] < gathered_growth / 8, temp
    # O(seq / n · head_dim): a fixed number of local-shard-sized buffers (float32
    # accumulators, the block in flight, the XLA backend's chunks), not a function of n.
    assert temp[8] < 16 * local_bytes, temp


def _lowered_simulated_ring(num_steps: int, backward: bool) -> str:
    """The HLO text of a simulated ring of ``num_steps`` on the Mosaic kernels, lowered
    for CUDA (no GPU needed to lower)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (AXIS,))
    spec = P(None, AXIS)

    def attend(q, k, v):
        return ring.simulated_ring_attention(q, k, v, num_steps=num_steps, axis_name=AXIS,
                                             is_causal=True, implementation="mosaic")

    def local(q, k, v):
        if backward:
            return jax.grad(lambda *x: attend(*x).astype(jnp.float32).sum(),
                            argnums=(0, 1, 2))(q, k, v)
        return attend(q, k, v)

    out_specs = (spec,) * 3 if backward else spec
    mapped = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                                   out_specs=out_specs))
    args = [jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)] * 3
    return mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwdbwd"])
def test_ring_kernels_are_lowered_once_whatever_the_steps(backward):
    """The ring's steps are unrolled; steps 1..n-1 share one jitted function, so the
    program holds the same kernels for 4 and 8 steps (lowering a Pallas kernel is most of
    its compile time: 8 steps lowered step by step took 5× as long)."""
    def kernels(text: str) -> int:
        return text.count("custom_call")

    four, eight = (_lowered_simulated_ring(n, backward) for n in (4, 8))
    assert kernels(four) > 0
    assert kernels(eight) == kernels(four)
    # The steps themselves are unrolled: one barrier between consecutive steps.
    assert eight.count("optimization_barrier") > four.count("optimization_barrier")


def _barrier_operands_from_ppermute(closed_jaxpr) -> list[int]:
    """For each ``optimization_barrier`` of the program (sub-jaxprs included): how many of
    its operands a ``ppermute`` produced."""
    counts = []

    def walk(jaxpr):
        producer = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "optimization_barrier":
                counts.append(sum(producer.get(v) == "ppermute" for v in eqn.invars))
            producer.update((v, eqn.primitive.name) for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed_jaxpr.jaxpr)
    return counts


def test_travelling_gradients_are_not_waited_for_before_the_next_kernels():
    """Each step is fenced from the next by a barrier over (dq, the incoming K/V block);
    the dK/dV accumulators that arrive from the previous device are added only after the
    step's kernels, so their transfer runs behind them: no barrier takes them. (Before:
    the backward's barriers took 4 transferred arrays, K, V, dK and dV.)"""
    n = 4

    def local(q, k, v):
        def loss(q, k, v):
            return pf.ring_attention(q, k, v, axis_name=AXIS, implementation="xla").sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    mapped = jax.shard_map(local, mesh=ring_mesh(n), in_specs=(SEQ_SPEC,) * 3,
                           out_specs=(SEQ_SPEC,) * 3)
    x = jax.ShapeDtypeStruct((1, 16 * n, 2, HEAD_DIM), jnp.bfloat16)
    program = jax.make_jaxpr(mapped)(x, x, x)
    counts = _barrier_operands_from_ppermute(program)
    # n - 1 barriers in the forward, n - 1 in the backward, each over K and V only.
    assert counts == [2] * (2 * (n - 1)), counts
    # The dK / dV sums travel in float32 from step 1 on (step 0's hop carries the kernel's
    # bfloat16 part alone, exactly): summed in bfloat16 they would lose precision each step.
    hops = re.findall(r"(\w+)\[[\d,]+\]\S* = ppermute", str(program))
    assert hops.count("f32") == 2 * (n - 1), hops

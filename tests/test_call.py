"""The canonical call (pallas_flash.call) and the planner (pallas_flash.plan)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import dispatch, plan
from pallas_flash.call import canonicalize
from pallas_flash.contract import PADDED_KEY_ID, PADDED_QUERY_ID, RowBounds, segment_ids_with_bounds


def _inputs(batch=2, seq_q=24, seq_kv=24, heads=2, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (batch, seq_q, heads, 16), dtype),
            *(jax.random.normal(kk, (batch, seq_kv, heads, 16), dtype) for kk in keys[1:]))


def test_lengths_become_row_bounds():
    q, k, v = _inputs(seq_kv=30)
    call = canonicalize(q, k, v, key_value_seq_lengths=[5, 30])
    np.testing.assert_array_equal(call.bounds.q_end, [24, 24])  # not given: every query
    np.testing.assert_array_equal(call.bounds.kv_start, [0, 0])
    np.testing.assert_array_equal(call.bounds.kv_end, [5, 30])
    assert call.bounds.kv_end.dtype == jnp.int32
    assert canonicalize(q, k, v).bounds is None


def test_an_unbatched_call_is_batched_and_keeps_its_shape():
    q, k, v = (x[0] for x in _inputs())
    call = canonicalize(q, k, v, query_seq_lengths=3, is_causal=np.bool_(True))
    assert call.query.shape == (1, 24, 2, 16) and call.output_shape == (24, 2, 16)
    np.testing.assert_array_equal(call.bounds.q_end, [3])
    assert call.mask.is_causal is True


def test_bounds_fold_into_segment_ids():
    bounds = RowBounds(q_end=jnp.array([2, 3]), kv_start=jnp.array([1, 0]),
                       kv_end=jnp.array([3, 4]))
    ids = (jnp.array([[7, 7, 8], [7, 8, 8]]), jnp.array([[7, 7, 8, 8], [7, 8, 8, 8]]))
    q_ids, kv_ids = segment_ids_with_bounds(ids, bounds, 3, 4)
    np.testing.assert_array_equal(q_ids, [[7, 7, PADDED_QUERY_ID], [7, 8, 8]])
    np.testing.assert_array_equal(kv_ids, [[PADDED_KEY_ID, 7, 8, PADDED_KEY_ID],
                                           [7, 8, 8, 8]])
    q_ids, kv_ids = segment_ids_with_bounds(None, bounds, 3, 4)
    np.testing.assert_array_equal(q_ids, [[0, 0, PADDED_QUERY_ID], [0, 0, 0]])
    assert segment_ids_with_bounds(ids, None, 3, 4) is ids


def test_the_planner_takes_decode_steps_on_the_gpu_only(monkeypatch):
    q, k, v = _inputs(seq_q=4, seq_kv=64, dtype=jnp.bfloat16)
    assert plan.plan(canonicalize(q, k, v)).path == "plain"  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert plan.decodes(canonicalize(q, k, v))
    assert plan.decodes(canonicalize(q, k, v, is_causal=True,
                                     causal_alignment="bottom_right"))
    for kwargs in (dict(is_causal=True), dict(key_value_seq_lengths=[3, 64]),
                   dict(local_window_size=4), dict(returns_lse=True),
                   dict(implementation="triton"), dict(interpret=True)):
        assert not plan.decodes(canonicalize(q, k, v, **kwargs)), kwargs
    long_q, long_k, long_v = _inputs(seq_q=plan.MAX_DECODE_SEQ_Q + 1, seq_kv=64,
                                     dtype=jnp.bfloat16)
    assert not plan.decodes(canonicalize(long_q, long_k, long_v))
    assert plan.is_decode_step(plan.MAX_DECODE_SEQ_Q) and not plan.is_decode_step(0)


def test_the_planner_names_the_path_and_the_forward_kernels():
    q, k, v = _inputs()
    assert plan.plan(canonicalize(q[:, :0], k, v)).path == "empty"
    route = plan.plan(canonicalize(q, k, v, logits_soft_cap=5.0, implementation="triton",
                                   interpret=True))
    assert route.path == "plain" and route.static.kernels.name == "triton"
    assert route.static.softcap == 5.0
    with pytest.raises(ValueError, match="float64 inputs run only"):
        with jax.enable_x64():
            plan.plan(canonicalize(*(x.astype(jnp.float64) for x in (q, k, v)),
                                   implementation="triton", interpret=True))


def test_kernels_with_row_bounds_receive_them(monkeypatch):
    """A backend whose kernels take ``bounds=`` gets them in both passes, with segment ids
    untouched; the answer is the folded one's."""
    q, k, v = _inputs()
    lengths = dict(query_seq_lengths=jnp.array([20, 24]),
                   key_value_seq_lengths=jnp.array([9, 17]))
    want, want_vjp = jax.vjp(lambda q: pf.attention(q, k, v, is_causal=True,
                                                    implementation="xla", **lengths), q)
    xla = dispatch.backend("xla")
    kernels, seen = xla.KERNELS, []

    def folded(run, pass_name):
        def kernel(q, k, v, segment_ids, *args, bounds, **kwargs):
            seen.append((pass_name, segment_ids))
            ids = segment_ids_with_bounds(segment_ids, bounds, q.shape[1], k.shape[1])
            return run(q, k, v, ids, *args, **kwargs)
        return kernel

    monkeypatch.setattr(xla, "KERNELS", dataclasses.replace(
        kernels, row_bounds=True, forward=folded(kernels.forward, "forward"),
        backward=folded(kernels.backward, "backward")))
    got, got_vjp = jax.vjp(lambda q: pf.attention(q, k, v, is_causal=True,
                                                  implementation="xla", **lengths), q)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got_vjp(jnp.ones_like(got))[0],
                               want_vjp(jnp.ones_like(want))[0], atol=1e-6)
    assert [name for name, _ in seen] == ["forward", "backward"]
    assert all(ids is None for _, ids in seen)

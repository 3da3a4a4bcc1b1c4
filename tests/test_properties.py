"""Property-based check: random shapes and variant combinations vs the float64 oracle, on
every backend (tests/support.py; the Mosaic kernels in interpret mode: few examples)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import BACKENDS, backends, rel_err, tolerance

from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64


@st.composite
def problems(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        batch=draw(st.integers(1, 2)),
        seq_q=draw(st.integers(1, 70)),
        seq_kv=draw(st.integers(1, 70)),
        kv_heads=kv_heads,
        heads=kv_heads * draw(st.sampled_from([1, 2])),
        head_dim=draw(st.sampled_from([8, 16, 32])),
        causal=draw(st.booleans()),
        alignment=draw(st.sampled_from(["top_left", "bottom_right"])),
        window=draw(st.one_of(st.none(), st.tuples(st.integers(0, 30), st.integers(0, 30)))),
        softcap=draw(st.one_of(st.none(), st.floats(2.0, 30.0))),
        segments=draw(st.booleans()),
        sinks=draw(st.booleans()),
        # bias / mask shapes over B N T S, "1" a broadcast dim (see tests/test_bias_mask.py)
        bias=draw(st.sampled_from([None, "TS", "B11S", "1NTS", "BN1S"])),
        mask=draw(st.sampled_from([None, "B1TS", "11TS", "BN1S"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _check(backend, p: dict) -> None:
    keys = jax.random.split(jax.random.PRNGKey(p["seed"]), 8)
    b, t, s, n, k, d = (p[x] for x in ("batch", "seq_q", "seq_kv", "heads", "kv_heads",
                                       "head_dim"))
    dtype = backend.dtype
    q = (jax.random.normal(keys[0], (b, t, n, d)) * 2).astype(dtype)
    key = jax.random.normal(keys[1], (b, s, k, d)).astype(dtype)
    value = jax.random.normal(keys[2], (b, s, k, d)).astype(dtype)
    d_out = jax.random.normal(keys[3], (b, t, n, d)).astype(dtype)
    segment_ids = None
    kwargs = {}
    if p["segments"]:
        q_ids = jnp.cumsum(jax.random.bernoulli(keys[4], 0.1, (b, t)), axis=1)
        kv_ids = jnp.cumsum(jax.random.bernoulli(keys[5], 0.1, (b, s)), axis=1)
        segment_ids = (q_ids, kv_ids)
        kwargs = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    sinks = jnp.linspace(-1.0, 1.0, n) if p["sinks"] else None
    mask = MaskSpec(t, s, p["causal"], p["alignment"], p["window"])
    dims = {"B": b, "N": n, "T": t, "S": s, "1": 1}
    bias = attn_mask = None
    if p["bias"] is not None:
        bias = jax.random.normal(keys[6], tuple(dims[c] for c in p["bias"]))
    if p["mask"] is not None:
        attn_mask = jax.random.bernoulli(keys[7], 0.8, tuple(dims[c] for c in p["mask"]))

    def f(q, key, value, bias):
        return backend.attention(q, key, value, bias, attn_mask, is_causal=p["causal"],
                                 causal_alignment=p["alignment"],
                                 local_window_size=p["window"], logits_soft_cap=p["softcap"],
                                 sinks=sinks, return_lse=True, **kwargs)

    # One jitted program (eagerly, every small op around the kernels compiles on its own:
    # most of an example's time); the same computation.
    @jax.jit
    def forward_and_grads(q, key, value, bias, d_out):
        (out, lse), vjp = jax.vjp(f, q, key, value, bias)
        return out, lse, vjp((d_out, jnp.zeros_like(lse)))

    out, lse, grads = forward_and_grads(q, key, value, bias, d_out)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, key, value, mask=mask, segment_ids=segment_ids, softcap=p["softcap"], sinks=sinks,
        bias=bias, attn_mask=attn_mask, d_out=d_out)
    # dq, dk, dv and, with a bias, dbias (the oracle's last gradient; d_sinks not checked).
    grads, ref_grads = (grads, ref_grads[:3] + ref_grads[-1:]) if bias is not None else (
        grads[:3], ref_grads[:3])
    # Relative, or absolute where the reference is (nearly) zero: e.g. a row that sees one
    # key has dq = 0 exactly, which float32 reproduces only up to rounding (~1e-7).
    tol = tolerance(dtype)
    grad_tol = 5 * tol if dtype == jnp.float32 else 2 * tol
    out_abs = np.abs(np.asarray(out, np.float64) - ref_out).max()
    assert rel_err(out, ref_out) < tol or out_abs < tol
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    # dbias in 16 bits gets twice the gradients' bound: it sums dS = P ∘ (dP − δ) over the
    # bias's broadcast rows, and δ = rowsum(dO ∘ O) reads the rounded output (FA2's backward,
    # as every kernel does), so where dP − δ cancels over a few rows the rounding of O shows.
    # Seen once (bf16, 7 × 47, causal, segments, sinks, softcap, a [B, N, 1, S] bias): 0.030
    # on every backend alike, the float32 dbias being one XLA computation for all of them.
    bounds = [grad_tol] * 3 + [grad_tol if dtype == jnp.float32 else 2 * grad_tol]
    for got, want, bound in zip(grads, ref_grads, bounds[:len(grads)], strict=True):
        assert (rel_err(got, want) < bound
                or np.abs(np.asarray(got, np.float64) - want).max() < tol)


# The case behind dbias's 16-bit bound in _check (drawn in a full run here, 2026-12-03).
_DBIAS_CANCELS = dict(batch=1, seq_q=7, seq_kv=47, kv_heads=1, heads=1, head_dim=32, causal=True,
                      alignment="top_left", window=None, softcap=29.720672906462678,
                      segments=True, sinks=True, bias="BN1S", mask="11TS", seed=2**31 - 1)

# Examples per backend: interpret mode compiles every new shape (Mosaic's is the slowest).
EXAMPLES = {"xla": 5, "triton": 3, "mosaic": 3}  # each example compiles anew: suite time


@pytest.mark.parametrize("backend", backends())
def test_random_problems(backend):
    assert set(EXAMPLES) == set(BACKENDS)

    # derandomize: CI draws the same examples every run (a failure is reproducible there).
    @settings(max_examples=EXAMPLES[backend.name], deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(p=problems())
    @example(p=_DBIAS_CANCELS)
    def check(p):
        _check(backend, p)

    check()

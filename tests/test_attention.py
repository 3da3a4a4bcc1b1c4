"""One suite for every implementation: forward, lse and gradients vs the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err, run_attention, tolerance

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, alignment, window, dtype)
CASES = [
    (2, 64, 64, 2, 2, 32, False, "top_left", None, jnp.float32),
    (2, 64, 64, 2, 2, 64, True, "top_left", None, jnp.float32),
    (1, 100, 77, 4, 2, 32, False, "top_left", None, jnp.float32),      # GQA, odd lengths
    (1, 77, 100, 4, 1, 32, True, "top_left", None, jnp.float32),       # MQA, seq_q < seq_kv
    (1, 40, 72, 2, 1, 32, True, "bottom_right", None, jnp.float32),    # KV-cache alignment
    (1, 72, 40, 2, 2, 32, True, "bottom_right", None, jnp.float32),    # empty leading rows
    (1, 90, 90, 2, 2, 32, False, "top_left", (17, 5), jnp.float32),    # sliding window
    (1, 64, 64, 2, 1, 96, True, "top_left", None, jnp.float32),        # head_dim padded to 128
    (1, 80, 80, 4, 2, 64, True, "top_left", None, jnp.bfloat16),
    (1, 64, 96, 2, 2, 128, False, "top_left", None, jnp.bfloat16),
    (1, 48, 48, 2, 1, 64, True, "top_left", None, jnp.float16),
]


def _case_id(case):
    b, t, s, n, k, d, causal, align, window, dtype = case
    return (f"b{b}-t{t}-s{s}-n{n}k{k}-d{d}-{'causal-' + align if causal else 'full'}"
            f"{'-w' + str(window) if window else ''}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_float64_oracle(impl, case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, align, window, dtype = case
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    kwargs = dict(is_causal=causal, causal_alignment=align, local_window_size=window)
    out, lse, (dq, dk, dv) = run_attention(impl, q, k, v, d_out, **kwargs)

    mask = MaskSpec(seq_q, seq_kv, causal, align, window)
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = attention_float64(
        q, k, v, mask=mask, d_out=d_out)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, seq_q, heads) and lse.dtype == jnp.float32
    assert dk.shape == k.shape and dv.shape == v.shape
    tol = tolerance(dtype)
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < tol
    for name, got, want in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        assert rel_err(got, want) < 2 * tol, name


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids(impl, causal):
    q, k, v, d_out = random_qkv(2, 70, 70, 2, 1, 32)
    ids = jax.random.bernoulli(jax.random.PRNGKey(7), 0.06, (2, 70))
    segments = jnp.cumsum(ids, axis=1).astype(jnp.int32)
    out, lse, grads = run_attention(impl, q, k, v, d_out, is_causal=causal,
                                    q_segment_ids=segments)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=MaskSpec(70, 70, causal), segment_ids=(segments, segments), d_out=d_out)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5


def test_fully_masked_rows_give_zero(impl):
    # Bottom-right alignment with seq_q > seq_kv: the first 24 queries see no key.
    q, k, v, d_out = random_qkv(1, 56, 32, 2, 2, 32)
    out, lse, (dq, dk, dv) = run_attention(impl, q, k, v, d_out, is_causal=True,
                                           causal_alignment="bottom_right")
    assert np.all(np.asarray(out[:, :24]) == 0.0)
    assert np.all(np.asarray(lse[:, :24]) == EMPTY_ROW_LSE)
    assert np.all(np.asarray(dq[:, :24]) == 0.0)
    for x in (out, lse, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x)))
    assert np.abs(np.asarray(out[:, 24:])).max() > 0


def test_huge_logits_stay_finite(impl):
    q, k, v, d_out = random_qkv(1, 48, 48, 2, 2, 32)
    # Logits of order ±1e4: a naive exp overflows; the online softmax must not.
    q = q * (1e4 / 32 ** 0.5)
    out, lse, grads = run_attention(impl, q, k, v, d_out, is_causal=True)
    ref_out, ref_lse = attention_float64(q, k, v, mask=MaskSpec(48, 48, True))
    # A float32 logit near 1e4 carries an absolute rounding error of ~1e4 · 2^-24 ≈ 6e-4,
    # which exp turns into a relative error of that size in P: the bound is the input's
    # conditioning, not the kernel's. The point here is that nothing overflows.
    assert rel_err(out, ref_out) < 5e-3
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


def test_gradient_through_lse(impl):
    q, k, v, _ = random_qkv(1, 40, 40, 2, 2, 32)
    weights = jax.random.normal(jax.random.PRNGKey(3), (1, 40, 2))
    from support import implementation_kwargs

    extra = implementation_kwargs(impl, 32)

    def loss(q, k, v, fn):
        return jnp.sum(fn(q, k, v) * weights)

    def ours(q, k, v):
        return pf.attention(q, k, v, is_causal=True, return_residual=True, **extra)[1]

    def ref(q, k, v):
        s = jnp.einsum("bqnd,bknd->bnqk", q, k) / 32 ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((40, 40), bool)), s, -jnp.inf)
        return jnp.transpose(jax.nn.logsumexp(s, axis=-1), (0, 2, 1))

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ours)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ref)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-5


def test_jit_vmap_grad(impl):
    from support import implementation_kwargs

    extra = implementation_kwargs(impl, 32)
    q, k, v, _ = random_qkv(3, 32, 32, 2, 2, 32)

    def loss(q, k, v):
        return jnp.sum(pf.attention(q[None], k[None], v[None], is_causal=True, **extra) ** 2)

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    for i in range(3):
        single = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
        for b, s in zip(batched, single, strict=True):
            assert rel_err(b[i], s) < 1e-5


def test_default_implementation_on_cpu():
    assert pf.default_implementation() == "xla"
    assert pf.available_implementations() == ("xla",)


def _variant_check(impl, q, k, v, d_out, *, mask, segment_ids=None, softcap=None, sinks=None,
                   **kwargs):
    """Output, lse and every gradient (sinks too) of `impl` vs the float64 oracle."""
    from support import implementation_kwargs

    extra = implementation_kwargs(impl, q.shape[-1])

    def f(q, k, v, sinks):
        return pf.attention(q, k, v, is_causal=mask.is_causal,
                            causal_alignment=mask.causal_alignment,
                            local_window_size=mask.window, logits_soft_cap=softcap,
                            sinks=sinks, return_residual=True, **kwargs, **extra)

    (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=mask, segment_ids=segment_ids, softcap=softcap, sinks=sinks,
        d_out=d_out)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    grads = grads if sinks is not None else grads[:3]
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5


def test_soft_cap(impl):
    q, k, v, d_out = random_qkv(1, 60, 60, 2, 2, 32)
    _variant_check(impl, 4 * q, k, v, d_out, mask=MaskSpec(60, 60, True), softcap=3.0)


def test_sinks(impl):
    q, k, v, d_out = random_qkv(2, 50, 50, 4, 2, 32)
    sinks = jax.random.normal(jax.random.PRNGKey(11), (4,)) * 2
    _variant_check(impl, q, k, v, d_out, mask=MaskSpec(50, 50, True), sinks=sinks)


def test_sequence_lengths(impl):
    q, k, v, d_out = random_qkv(2, 64, 48, 2, 1, 32)
    q_len, kv_len = jnp.array([40, 64]), jnp.array([48, 17])
    q_ids = jnp.where(jnp.arange(64)[None] < q_len[:, None], 0, -1)
    kv_ids = jnp.where(jnp.arange(48)[None] < kv_len[:, None], 0, -2)
    _variant_check(impl, q, k, v, d_out, mask=MaskSpec(64, 48), segment_ids=(q_ids, kv_ids),
                   query_seq_lengths=q_len, key_value_seq_lengths=kv_len)


def test_all_variants_together(impl):
    """causal + segments + window + GQA + soft-cap + sinks + padding, odd lengths."""
    q, k, v, d_out = random_qkv(2, 75, 75, 4, 2, 32)
    ids = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(2), 0.05, (2, 75)), axis=1)
    lengths = jnp.array([75, 61])
    valid = jnp.arange(75)[None] < lengths[:, None]
    sinks = jax.random.normal(jax.random.PRNGKey(4), (4,))
    _variant_check(
        impl, 3 * q, k, v, d_out, mask=MaskSpec(75, 75, True, window=(20, 0)),
        segment_ids=(jnp.where(valid, ids, -1), jnp.where(valid, ids, -2)),
        softcap=5.0, sinks=sinks, q_segment_ids=ids.astype(jnp.int32),
        query_seq_lengths=lengths, key_value_seq_lengths=lengths)

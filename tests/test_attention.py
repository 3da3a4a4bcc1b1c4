"""One suite for every backend (tests/support.py): out, lse and gradients vs the float64
oracle, through ``pallas_flash.attention``.

Each case runs on every backend that supports it (its dtype, head dim, features);
the Mosaic GPU kernels run in interpret mode, so the cases are a few hundred rows at most.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import (
    BF16,
    F16,
    F32,
    assert_matches,
    backend_cases,
    backends,
    fresh_key,
    random_qkv,
    rel_err,
    run_attention,
    tolerance,
)

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64


class Case(NamedTuple):
    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    alignment: str
    window: tuple[int, int] | None
    dtype: jnp.dtype
    scale: float | None = None  # None: 1 / sqrt(head_dim)


CASES = [
    Case(2, 64, 64, 2, 2, 32, False, "top_left", None, F32),
    Case(2, 64, 64, 2, 2, 64, True, "top_left", None, F32),
    Case(1, 100, 77, 4, 2, 32, False, "top_left", None, F32),      # GQA, odd lengths
    Case(1, 77, 100, 4, 1, 32, True, "top_left", None, F32),       # MQA, seq_q < seq_kv
    Case(1, 40, 72, 2, 1, 32, True, "bottom_right", None, F32),    # KV-cache alignment
    Case(1, 72, 40, 2, 2, 32, True, "bottom_right", None, F32),    # empty leading rows
    Case(1, 90, 90, 2, 2, 32, False, "top_left", (17, 5), F32),    # sliding window
    Case(1, 64, 64, 2, 1, 96, True, "top_left", None, F32),        # head_dim padded to 128
    Case(1, 80, 80, 4, 2, 64, True, "top_left", None, BF16),
    Case(1, 64, 96, 2, 2, 128, False, "top_left", None, BF16),
    Case(1, 48, 48, 2, 1, 64, True, "top_left", None, F16),
    # 16-bit cases over several of the Mosaic kernels' 128-row CTAs and 64-key blocks.
    Case(2, 128, 128, 2, 1, 64, False, "top_left", None, BF16),    # unmasked: whole blocks
    Case(1, 100, 70, 2, 2, 64, False, "top_left", None, F16, 0.7 / 8),  # padded rows, keys
    Case(1, 200, 130, 2, 1, 64, True, "top_left", None, F16, 0.7 / 8),  # seq_q > seq_kv
    Case(1, 150, 200, 2, 1, 64, True, "bottom_right", None, BF16),
    Case(1, 200, 70, 1, 1, 64, True, "bottom_right", None, BF16),  # rows 0..129 see nothing
    Case(1, 192, 192, 1, 1, 64, False, "top_left", (50, 10), BF16),
    Case(1, 192, 192, 1, 1, 64, True, "top_left", (70, 0), F16),
    Case(1, 200, 60, 1, 1, 64, False, "top_left", (10, 10), BF16),  # rows 71.. see nothing
    Case(1, 192, 150, 2, 1, 96, False, "top_left", (40, 20), BF16),
    Case(1, 130, 130, 2, 1, 128, True, "top_left", None, BF16),
    # head_dim 256: Mosaic's split dK/dV kernel and 32-key dQ blocks (the slowest to
    # interpret: two cases).
    Case(1, 128, 192, 2, 1, 256, False, "top_left", (40, 20), BF16),
    Case(1, 200, 130, 2, 1, 256, True, "bottom_right", None, F16),
]


def _case_id(case: Case) -> str:
    b, t, s, n, k, d, causal, align, window, dtype, scale = case
    return (f"b{b}-t{t}-s{s}-n{n}k{k}-d{d}-{'causal-' + align if causal else 'full'}"
            f"{'-w' + str(window) if window else ''}-{jnp.dtype(dtype).name}"
            f"{'-scaled' if scale else ''}")


@pytest.mark.parametrize(("backend", "case"), backend_cases(
    CASES, _case_id, lambda c: dict(dtype=c.dtype, head_dim=c.head_dim)))
def test_matches_float64_oracle(backend, case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, align, window, dtype, scale = case
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    kwargs = dict(is_causal=causal, causal_alignment=align, local_window_size=window,
                  scale=scale)
    out, lse, grads = run_attention(backend, q, k, v, d_out, **kwargs)

    mask = MaskSpec(seq_q, seq_kv, causal, align, window)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=mask, scale=scale, d_out=d_out)
    assert out.dtype == q.dtype
    assert all(g.dtype == x.dtype for g, x in zip(grads, (q, k, v), strict=True))
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


def _doc_ids(batch: int, seq: int, starts) -> jax.Array:
    """[batch, seq] int32 ids of packed documents: the id goes up by one at each start."""
    ids = np.searchsorted(np.asarray(starts), np.arange(seq), side="right")
    return jnp.asarray(np.broadcast_to(ids, (batch, seq)), jnp.int32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", backends())
def test_segment_ids(backend, causal):
    dtype = backend.dtype
    q, k, v, d_out = random_qkv(2, 70, 70, 2, 1, 32, dtype)
    ids = jax.random.bernoulli(fresh_key(), 0.06, (2, 70))
    segments = jnp.cumsum(ids, axis=1).astype(jnp.int32)
    out, lse, grads = run_attention(backend, q, k, v, d_out, is_causal=causal,
                                    q_segment_ids=segments)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=MaskSpec(70, 70, causal), segment_ids=(segments, segments), d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


# (head_dim, mask kwargs, softcap): packed documents where rows of a document see no key.
DOCUMENT_CASES = [
    (64, dict(local_window_size=(40, 10)), 20.0),
    (256, dict(is_causal=True), 20.0),
    (64, {}, None),
]


@pytest.mark.parametrize(("backend", "case"), backend_cases(
    DOCUMENT_CASES, lambda c: f"d{c[0]}-{'-'.join(c[1]) or 'full'}-cap{c[2]}",
    lambda c: dict(head_dim=c[0])))
def test_packed_documents_with_empty_rows(backend, case):
    """Query documents 0, 2, 4 and key documents 0, 1, 2: rows of document 4 see no key
    (out, dq exactly 0), keys of document 1 no query (dk, dv exactly 0); padded keys (130);
    batch row 1 with ids in no order (every tile's id range meets most others)."""
    head_dim, mask_kwargs, softcap = case
    dtype, seq_q, seq_kv = backend.dtype, 200, 130
    q, k, v, d_out = random_qkv(2, seq_q, seq_kv, 1, 1, head_dim, dtype)
    if softcap is not None:  # logits of several softcaps, where tanh bends them
        q = q * 8
    q_ids = _doc_ids(2, seq_q, [60, 150]) * 2
    kv_ids = _doc_ids(2, seq_kv, [50, 110])
    q_ids = q_ids.at[1].set(jax.random.randint(fresh_key(), (seq_q,), 0, 3))
    kv_ids = kv_ids.at[1].set(jax.random.randint(fresh_key(), (seq_kv,), 0, 3))
    out, lse, grads = run_attention(backend, q, k, v, d_out, q_segment_ids=q_ids,
                                    kv_segment_ids=kv_ids, logits_soft_cap=softcap,
                                    **mask_kwargs)
    mask = MaskSpec(seq_q, seq_kv, mask_kwargs.get("is_causal", False),
                    window=mask_kwargs.get("local_window_size"))
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=mask, segment_ids=(q_ids, kv_ids), softcap=softcap, d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)
    assert np.all(np.asarray(out[0, 150:]) == 0) and np.all(np.asarray(grads[0][0, 150:]) == 0)
    for g in grads[1:]:
        assert np.all(np.asarray(g[0, 50:110]) == 0)


@pytest.mark.parametrize("backend", backends())
def test_segment_tiles_outside_the_span_are_never_read(backend):
    """Q of a query document without keys and K/V of a key document without queries are
    NaN: they must leave no trace (0 · NaN is NaN in a softmax or a GEMM), and they leave
    exact zeros. The API zeroes such rows before any backend runs
    (``masking.zero_unseen_rows``); the kernels' own skipping of those tiles is checked on
    the kernels directly (tests/test_hidden_positions.py for Triton, tests/test_mosaic.py
    and tests/test_mosaic_backward.py for Mosaic). With 64-row tiles, a Mosaic CTA where
    one consumer meets no key tile while the other does; the keys without queries fill a
    whole CTA of the Mosaic dK/dV kernel (2 x 64 keys: the fused dQ skips per CTA)."""
    seq = 256
    q, k, v, d_out = random_qkv(1, seq, seq, 2, 1, 64, backend.dtype)
    q_ids = _doc_ids(1, seq, [64, 128])                     # 0 | 1 (no keys) | 2, 2
    kv_ids = _doc_ids(1, seq, [64, 128]) + 1                # 0 | 2 | 3, 3 (no query)
    kv_ids = kv_ids.at[:, :64].set(0)
    rows, keys = slice(64, 128), slice(128, 256)
    out, lse, grads = run_attention(
        backend, q.at[:, rows].set(jnp.nan), k.at[:, keys].set(jnp.nan),
        v.at[:, keys].set(jnp.nan), d_out, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, segment_ids=(q_ids, kv_ids), d_out=d_out)
    for x in (out, grads[0]):
        assert np.all(np.asarray(x[:, rows]) == 0)
    for x in grads[1:]:
        assert np.all(np.asarray(x[:, keys]) == 0)
    assert np.all(np.asarray(lse[:, rows]) == np.float32(EMPTY_ROW_LSE))
    # The NaN rows and keys contribute nothing: the oracle on the same inputs, any values
    # there.
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, backend.dtype)


@pytest.mark.parametrize("backend", backends())
def test_fully_masked_rows_give_zero(backend):
    # Bottom-right alignment with seq_q > seq_kv: the first 24 queries see no key.
    q, k, v, d_out = random_qkv(1, 56, 32, 2, 2, 32, backend.dtype)
    out, lse, (dq, dk, dv) = run_attention(backend, q, k, v, d_out, is_causal=True,
                                           causal_alignment="bottom_right")
    assert np.all(np.asarray(out[:, :24]) == 0.0)
    assert np.all(np.asarray(lse[:, :24]) == EMPTY_ROW_LSE)
    assert np.all(np.asarray(dq[:, :24]) == 0.0)
    for x in (out, lse, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x, np.float32)))
    assert np.abs(np.asarray(out[:, 24:], np.float32)).max() > 0


@pytest.mark.parametrize("backend", backends())
def test_huge_logits_stay_finite(backend):
    dtype = backend.dtype
    q, k, v, d_out = random_qkv(1, 48, 48, 2, 2, 32)
    # Logits of order ±1e4: a naive exp overflows; the online softmax must not.
    q, k, v, d_out = ((q * (1e4 / 32 ** 0.5)).astype(dtype), *(x.astype(dtype)
                                                                for x in (k, v, d_out)))
    out, lse, grads = run_attention(backend, q, k, v, d_out, is_causal=True)
    ref_out, ref_lse = attention_float64(q, k, v, mask=MaskSpec(48, 48, True))
    # A float32 logit near 1e4 carries an absolute rounding error of ~1e4 · 2^-24 ≈ 6e-4,
    # which exp turns into a relative error of that size in P: the bound is the input's
    # conditioning, not the kernel's. The point here is that nothing overflows.
    assert rel_err(out, ref_out) < max(5e-3, tolerance(dtype))
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))


@pytest.mark.parametrize("backend", backends())
def test_gradient_through_lse(backend):
    q, k, v, _ = random_qkv(1, 40, 40, 2, 2, 32, backend.dtype)
    weights = jax.random.normal(fresh_key(), (1, 40, 2))

    def loss(q, k, v, fn):
        return jnp.sum(fn(q, k, v) * weights)

    def ours(q, k, v):
        return backend.attention(q, k, v, is_causal=True, return_lse=True)[1]

    def ref(q, k, v):
        q, k = (x.astype(jnp.float32) for x in (q, k))
        s = jnp.einsum("bqnd,bknd->bnqk", q, k) / 32 ** 0.5
        s = jnp.where(jnp.tril(jnp.ones((40, 40), bool)), s, -jnp.inf)
        return jnp.transpose(jax.nn.logsumexp(s, axis=-1), (0, 2, 1))

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ours)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ref)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < tolerance(backend.dtype)


@pytest.mark.parametrize("backend", backends())
def test_jit_vmap_grad(backend):
    q, k, v, _ = random_qkv(3, 32, 32, 2, 2, 32, backend.dtype)

    def loss(q, k, v):
        out = backend.attention(q[None], k[None], v[None], is_causal=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    single_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # one compilation, 3 calls
    for i in range(3):
        single = single_grad(q[i], k[i], v[i])
        for b, s in zip(batched, single, strict=True):
            assert rel_err(b[i], s) < tolerance(backend.dtype)


def test_default_implementation_on_cpu():
    assert pf.default_implementation() == "xla"
    assert pf.available_implementations() == ("xla",)


def _variant_check(backend, q, k, v, d_out, *, mask, segment_ids=None, softcap=None,
                   sinks=None, **kwargs):
    """Output, lse and every gradient (sinks too) of ``backend`` vs the float64 oracle."""

    def f(q, k, v, sinks):
        return backend.attention(q, k, v, is_causal=mask.is_causal,
                                 causal_alignment=mask.causal_alignment,
                                 local_window_size=mask.window, logits_soft_cap=softcap,
                                 sinks=sinks, return_lse=True, **kwargs)

    (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=mask, segment_ids=segment_ids, softcap=softcap, sinks=sinks,
        d_out=d_out)
    grads = grads if sinks is not None else grads[:3]
    names = ("dq", "dk", "dv", "dsinks")[:len(grads)]
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, q.dtype, names=names)


@pytest.mark.parametrize(("causal", "seq"), [(True, 60), (False, 128)],
                         ids=["causal", "full"])
@pytest.mark.parametrize("backend", backends())
def test_soft_cap(backend, causal, seq):
    q, k, v, d_out = random_qkv(1, seq, seq, 2, 2, 32, backend.dtype)
    _variant_check(backend, 4 * q, k, v, d_out, mask=MaskSpec(seq, seq, causal),
                   softcap=3.0)


@pytest.mark.parametrize("backend", backends())
def test_sinks(backend):
    q, k, v, d_out = random_qkv(2, 50, 50, 4, 2, 32, backend.dtype)
    sinks = jax.random.normal(fresh_key(), (4,)) * 2
    _variant_check(backend, q, k, v, d_out, mask=MaskSpec(50, 50, True), sinks=sinks)


@pytest.mark.parametrize("backend", backends())
def test_sequence_lengths(backend):
    q, k, v, d_out = random_qkv(2, 64, 48, 2, 1, 32, backend.dtype)
    q_len, kv_len = jnp.array([40, 64]), jnp.array([48, 17])
    q_ids = jnp.where(jnp.arange(64)[None] < q_len[:, None], 0, -1)
    kv_ids = jnp.where(jnp.arange(48)[None] < kv_len[:, None], 0, -2)
    _variant_check(backend, q, k, v, d_out, mask=MaskSpec(64, 48),
                   segment_ids=(q_ids, kv_ids), query_seq_lengths=q_len,
                   key_value_seq_lengths=kv_len)


@pytest.mark.parametrize("backend", backends())
def test_all_variants_together(backend):
    """causal + segments + window + GQA + soft-cap + sinks + padding, odd lengths."""
    q, k, v, d_out = random_qkv(2, 75, 75, 4, 2, 32, backend.dtype)
    ids = jnp.cumsum(jax.random.bernoulli(fresh_key(), 0.05, (2, 75)), axis=1)
    lengths = jnp.array([75, 61])
    valid = jnp.arange(75)[None] < lengths[:, None]
    sinks = jax.random.normal(fresh_key(), (4,))
    _variant_check(
        backend, 3 * q, k, v, d_out, mask=MaskSpec(75, 75, True, window=(20, 0)),
        segment_ids=(jnp.where(valid, ids, -1), jnp.where(valid, ids, -2)),
        softcap=5.0, sinks=sinks, q_segment_ids=ids.astype(jnp.int32),
        query_seq_lengths=lengths, key_value_seq_lengths=lengths)

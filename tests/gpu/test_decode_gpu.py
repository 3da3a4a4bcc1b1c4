"""Decode through the compiled Triton (the decode default) and Mosaic kernels at realistic
shapes vs the float64 oracle; paged caches read in place (Triton) and gathered (Mosaic).

32 query heads / 8 kv heads, bf16, ragged cache lengths, the split heuristic's num_splits;
the oracle runs each sequence on its own cache cut to its length (tests/test_decode.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_matches, rel_err
from test_decode import Case, _oracle, _scattered_pool
from test_hidden_slots import _poisoned

import pallas_flash as pf
from pallas_flash.mosaic import DecodeConfig
from pallas_flash.mosaic.config import SMEM_BUDGET

BF16 = jnp.dtype(jnp.bfloat16)


def _inputs(case: Case, seed: int):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (case.batch, case.seq_q, case.heads, case.head_dim), BF16)
    kv_shape = (case.batch, case.seq_kv, case.kv_heads, case.head_dim)
    k, v = (jax.random.normal(key, kv_shape, BF16) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, BF16)
    lengths = np.random.default_rng(seed).integers(case.seq_q, case.seq_kv + 1, case.batch)
    lengths[0] = case.seq_kv
    return q, k, v, d_out, lengths.astype(np.int32)


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


@pytest.mark.parametrize("case", [
    Case(batch=8, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128),
    Case(batch=4, seq_q=4, seq_kv=8192, heads=32, kv_heads=8, head_dim=128, window=(2048, 0)),
    Case(batch=4, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=64, softcap=30.0,
         sinks=True),
    Case(batch=2, seq_q=1, seq_kv=16384, heads=32, kv_heads=8, head_dim=256),
    Case(batch=1, seq_q=16, seq_kv=32768, heads=32, kv_heads=8, head_dim=128),
    Case(batch=3, seq_q=1, seq_kv=32768, heads=32, kv_heads=8, head_dim=128, window=(5000, 0)),
], ids=lambda c: f"b{c.batch}-s{c.seq_kv}-d{c.head_dim}-{c}")
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_decode_matches_oracle(case, implementation):
    q, k, v, _, lengths = _inputs(case, seed=case.seq_kv + case.head_dim)
    sinks = jnp.linspace(-1.0, 1.0, case.heads) if case.sinks else None
    decode = jax.jit(lambda q, k, v, lengths, sinks: pf.decode_attention(
        q, k, v, local_window_size=case.window, key_value_seq_lengths=lengths,
        logits_soft_cap=case.softcap, sinks=sinks, return_lse=True,
        implementation=implementation))
    out, lse = decode(q, k, v, jnp.asarray(lengths), sinks)
    ref_out, ref_lse = _oracle(case, *_f32(q, k, v), lengths, sinks)
    assert_matches(out, lse, (), ref_out, ref_lse, (), BF16, names=())


def test_decode_mosaic_gradients():
    case = Case(batch=2, seq_q=2, seq_kv=4096, heads=32, kv_heads=8, head_dim=128)
    q, k, v, d_out, lengths = _inputs(case, seed=7)

    def f(q, k, v):
        return pf.decode_attention(q, k, v, key_value_seq_lengths=jnp.asarray(lengths),
                                   num_splits=4, implementation="mosaic")

    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    grads = vjp(d_out)
    ref_out, _, ref_grads = _oracle(case, *_f32(q, k, v), lengths, None,
                                    d_out.astype(jnp.float32))
    assert rel_err(out, ref_out) < 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-2, name


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("implementation", [None, "mosaic"])  # in place, gathered
def test_paged_matches_oracle(page_size, implementation):
    case = Case(batch=8, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128)
    q, k, v, _, lengths = _inputs(case, seed=page_size)
    key_pages, value_pages, table = _scattered_pool(k, v, page_size)
    paged = jax.jit(lambda *args: pf.paged_attention(*args, return_lse=True,
                                                     implementation=implementation))
    out, lse = paged(q, key_pages, value_pages, table, jnp.asarray(lengths))
    ref_out, ref_lse = _oracle(case, *_f32(q, k, v), lengths, None)
    assert_matches(out, lse, (), ref_out, ref_lse, (), BF16, names=())


@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_forward_mode_matches_contiguous(page_size):
    """jax.jvp of the in-place paged read (Triton) equals that of decode_attention on the
    same cache laid out contiguously, tangents of Q and of the key pages included."""
    case = Case(batch=4, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128)
    q, k, v, _, lengths = _inputs(case, seed=5 + page_size)
    lengths = jnp.asarray(lengths)
    key_pages, value_pages, table = _scattered_pool(k, v, page_size)
    keys = jax.random.split(jax.random.PRNGKey(page_size), 2)
    t_q = jax.random.normal(keys[0], q.shape, BF16)
    t_pages = jax.random.normal(keys[1], key_pages.shape, BF16)
    paged = jax.jit(lambda q, kp: pf.paged_attention(q, kp, value_pages, table, lengths))
    primal, t_out = jax.jvp(paged, (q, key_pages), (t_q, t_pages))
    contiguous = jax.jit(lambda q, k: pf.decode_attention(q, k, v,
                                                          key_value_seq_lengths=lengths))
    t_k = t_pages[table].reshape(k.shape)  # the pages' tangents in sequence order
    want_primal, want = jax.jvp(contiguous, (q, k), (t_q, t_k))
    assert rel_err(primal, want_primal) < 1e-2
    assert rel_err(t_out, want) < 2e-2


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_routes_decode_steps_through_decode(is_causal, monkeypatch):
    # One new token against the cache: pallas_flash.attention takes the decode path
    # (jax.nn's bottom-right causal meaning), with the same answer as the main kernels.
    calls = []
    real = pf.decode_attention
    monkeypatch.setattr(pf.decode, "decode_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    case = Case(batch=4, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128)
    q, k, v, _, _ = _inputs(case, seed=11)
    lengths = np.full(case.batch, case.seq_kv, np.int32)
    kwargs = dict(is_causal=is_causal, causal_alignment="bottom_right")
    out = pf.attention(q, k, v, **kwargs)
    assert calls == [1]
    main = pf.attention(q, k, v, implementation="triton", **kwargs)
    ref_out, _ = _oracle(case, *_f32(q, k, v), lengths, None)
    assert rel_err(out, ref_out) < 1e-2
    assert rel_err(out, main) < 1e-2


@pytest.mark.parametrize("config", [None, DecodeConfig(block_kv=64, num_stages=3),
                                    DecodeConfig(block_kv=128, num_stages=3)],
                         ids=["default", "b64s3", "b128s3"])
@pytest.mark.parametrize("case", [
    Case(batch=8, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128),
    Case(batch=4, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=64, softcap=30.0,
         sinks=True),
    Case(batch=2, seq_q=1, seq_kv=16384, heads=32, kv_heads=8, head_dim=256),
    Case(batch=1, seq_q=16, seq_kv=32768, heads=32, kv_heads=8, head_dim=128,
         is_causal=False),
], ids=lambda c: f"b{c.batch}-s{c.seq_kv}-d{c.head_dim}-{c}")
def test_mosaic_decode_kernel_on_a_full_cache_matches_oracle(case, config):
    """A full cache (no lengths) takes the Mosaic decode kernel (pallas_flash.mosaic.decode)."""
    q, k, v, _, _ = _inputs(case, seed=case.seq_kv + case.head_dim + 1)
    sinks = jnp.linspace(-1.0, 1.0, case.heads) if case.sinks else None
    decode = jax.jit(lambda q, k, v, sinks: pf.decode_attention(
        q, k, v, is_causal=case.is_causal, logits_soft_cap=case.softcap, sinks=sinks,
        return_lse=True, implementation="mosaic", config=config))
    if config is not None and config.smem_bytes(case.head_dim) > SMEM_BUDGET:
        with pytest.raises(ValueError, match="shared memory"):  # raised before lowering
            decode(q, k, v, sinks)
        return
    out, lse = decode(q, k, v, sinks)
    full = np.full((case.batch,), case.seq_kv, np.int32)
    ref_out, ref_lse = _oracle(case, *_f32(q, k, v), full, sinks)
    assert_matches(out, lse, (), ref_out, ref_lse, (), BF16, names=())


def test_mosaic_decode_kernel_gradients():
    case = Case(batch=2, seq_q=1, seq_kv=4096, heads=32, kv_heads=8, head_dim=128)
    q, k, v, d_out, _ = _inputs(case, seed=11)

    def f(q, k, v):
        return pf.decode_attention(q, k, v, num_splits=4, implementation="mosaic")

    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    grads = vjp(d_out)
    full = np.full((case.batch,), case.seq_kv, np.int32)
    ref_out, _, ref_grads = _oracle(case, *_f32(q, k, v), full, None, d_out.astype(jnp.float32))
    assert rel_err(out, ref_out) < 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-2, name


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("implementation", [None, "mosaic"])  # split kernel, main forward
def test_decode_hidden_slots_leave_no_trace(implementation, poison):
    """NaN / inf in the cache past each row's length (tests/test_hidden_slots.py, compiled):
    out and lse called and differentiated, gradients, the hidden slots' dk, dv exactly 0."""
    case = Case(batch=4, seq_q=4, seq_kv=4096, heads=32, kv_heads=8, head_dim=128)
    q, k, v, d_out, lengths = _inputs(case, seed=13)
    lengths[1:] = (1001, 2050, 4)  # inside tiles of every size; a row of seq_q tokens
    (k_bad, hidden), (v_bad, _) = (_poisoned(x, lengths, poison) for x in (k, v))
    decode = jax.jit(lambda q, k, v: pf.decode_attention(
        q, k, v, key_value_seq_lengths=jnp.asarray(lengths), return_lse=True,
        implementation=implementation))
    ref_out, ref_lse, ref_grads = _oracle(case, *_f32(q, k, v), lengths, None,
                                          d_out.astype(jnp.float32))
    out, lse = decode(q, k_bad, v_bad)
    assert_matches(out, lse, (), ref_out, ref_lse, (), BF16, names=())
    (out, lse), vjp = jax.vjp(decode, q, k_bad, v_bad)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, BF16)
    for name, g in zip(("dk", "dv"), grads[1:], strict=True):
        assert np.all(np.asarray(g)[hidden] == 0), name


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_hidden_slots_leave_no_trace(page_size, poison):
    """The same poison in the pages, read in place by the compiled split kernel."""
    case = Case(batch=4, seq_q=1, seq_kv=8192, heads=32, kv_heads=8, head_dim=128)
    q, k, v, _, lengths = _inputs(case, seed=17 + page_size)
    lengths[1:] = (1001, 4100, 5)
    k_bad, v_bad = (_poisoned(x, lengths, poison)[0] for x in (k, v))
    key_pages, value_pages, table = _scattered_pool(k_bad, v_bad, page_size)
    paged = jax.jit(lambda *args: pf.paged_attention(*args, return_lse=True))
    out, lse = paged(q, key_pages, value_pages, table, jnp.asarray(lengths))
    ref_out, ref_lse = _oracle(case, *_f32(q, k, v), lengths, None)
    assert_matches(out, lse, (), ref_out, ref_lse, (), BF16, names=())

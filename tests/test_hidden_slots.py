"""KV-cache slots past a row's length hold NaN or inf (a stale or uninitialised cache): they
are hidden, and never reach an output or a gradient.

``decode_attention`` and ``paged_attention`` on every path that runs on CPU (XLA, the Triton
split kernel and fixed chunks, the Mosaic main forward and backward, both in interpret
mode; the paged direct read, the gathered fallback and chunked prefill), and ``attention``
with the same lengths, against the float64 oracle of tests/test_decode.py on the visible
part: out, lse and the gradients in query, key and value, with the hidden slots' gradients
exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import BACKENDS, F32, assert_matches, random_qkv, rel_err
from test_decode import Case, _oracle, _scattered_pool

import pallas_flash as pf

POISONS = (np.nan, np.inf)


def _poisoned(x, lengths, poison):
    """``x [B, S, ...]`` with ``poison`` at the positions ``>= lengths[b]``."""
    hidden = np.arange(x.shape[1])[None, :] >= np.asarray(lengths)[:, None]
    return jnp.where(hidden.reshape(*hidden.shape, *[1] * (x.ndim - 2)), poison, x), hidden


def _check_poisoned(call, case: Case, lengths, dtype):
    """``call(q, k, v) -> (out, lse [B, T, H])`` on caches poisoned past ``lengths`` with
    each of :data:`POISONS` matches the oracle on the clean cache, called (the forward
    kernels) and differentiated (the rules' own formulation, which may differ); dk, dv of
    the hidden slots are exactly 0."""
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim, dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    ref_out, ref_lse, ref_grads = _oracle(case, *f32[:3], lengths, None, d_out=f32[3])
    call = jax.jit(call)
    for poison in POISONS:
        (k_bad, hidden), (v_bad, _) = (_poisoned(x, lengths, poison) for x in (k, v))
        out, lse = call(q, k_bad, v_bad)
        assert_matches(out, lse, (), ref_out, ref_lse, (), dtype, names=())
        (out, lse), vjp = jax.vjp(call, q, k_bad, v_bad)
        got = vjp((d_out, jnp.zeros_like(lse)))
        assert_matches(out, lse, got, ref_out, ref_lse, ref_grads, dtype)
        for name, g in zip(("dk", "dv"), got[1:], strict=True):
            assert np.all(np.asarray(g)[hidden] == 0), (name, poison)


def _decode(case: Case, **kwargs):
    return lambda q, k, v, lengths: pf.decode_attention(
        q, k, v, is_causal=case.is_causal, local_window_size=case.window,
        key_value_seq_lengths=lengths, return_lse=True, **kwargs)


# Lengths end inside a tile (16-key Triton tiles, 64-key Mosaic blocks); row 1 is shorter
# than seq_q; row 0 is the whole cache (nothing hidden).
LENGTHS = np.array([48, 2, 37], np.int32)
DECODE_CASES = [
    # Five splits do not divide 48: the cache is padded to chunks of 10 keys, four of them
    # wholly past row 1's length.
    pytest.param("xla", Case(seq_kv=48), dict(num_splits=5), id="xla-t1"),
    # Several tokens with a window: the per-token mask array.
    pytest.param("xla", Case(seq_q=4, seq_kv=48, window=(9, 0)), dict(num_splits=3),
                 id="xla-t4-window"),
    # No config: the split kernel, balanced per row (its gradients: the fixed chunks).
    pytest.param("triton", Case(seq_kv=48), dict(num_splits=2, interpret=True),
                 id="triton-split-t1"),
    pytest.param("triton", Case(seq_q=3, seq_kv=48, heads=4, kv_heads=1),
                 dict(num_splits=2, interpret=True), id="triton-split-t3"),
    # A config: the fixed chunks on the Triton forward and backward.
    pytest.param("triton", Case(seq_q=4, seq_kv=48, window=(20, 0)),
                 dict(num_splits=2, **BACKENDS["triton"].kwargs(16)), id="triton-chunks-t4"),
]


@pytest.mark.parametrize(("implementation", "case", "kwargs"), DECODE_CASES)
def test_decode_hidden_slots_leave_no_trace(implementation, case, kwargs):
    kwargs = dict(kwargs, implementation=implementation)
    decode = _decode(case, **kwargs)
    _check_poisoned(lambda q, k, v: decode(q, k, v, jnp.asarray(LENGTHS)), case, LENGTHS, F32)


def test_decode_hidden_slots_leave_no_trace_on_mosaic():
    """The Mosaic main forward (a length takes it, not the decode kernel) and backward,
    bf16, interpret mode: a 64-key block that the length cuts."""
    case = Case(batch=1, seq_q=2, seq_kv=128, heads=4, kv_heads=2, head_dim=64)
    lengths = np.array([70], np.int32)
    decode = _decode(case, num_splits=2, **BACKENDS["mosaic"].kwargs(case.head_dim))
    _check_poisoned(lambda q, k, v: decode(q, k, v, jnp.asarray(lengths)), case, lengths,
                    jnp.bfloat16)


def test_decode_grad_in_the_query_alone():
    """Reverse mode in the query alone (key and value not differentiated) through the
    balanced split kernel's rule, on a poisoned cache."""
    case = Case(seq_kv=48)
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim)
    _, _, (ref_dq, _, _) = _oracle(case, q, k, v, LENGTHS, None, d_out=d_out)
    k_bad, v_bad = (_poisoned(x, LENGTHS, np.nan)[0] for x in (k, v))
    dq = jax.grad(lambda q: jnp.sum(d_out * pf.decode_attention(
        q, k_bad, v_bad, key_value_seq_lengths=jnp.asarray(LENGTHS), num_splits=2,
        implementation="triton", interpret=True)))(q)
    assert rel_err(dq, ref_dq) < 2e-5, rel_err(dq, ref_dq)


PAGED_CASES = [
    # The gathered fallback (8-token pages), one token and a window with four.
    pytest.param(8, Case(seq_kv=48), dict(implementation="xla"), id="gathered-t1"),
    pytest.param(8, Case(seq_q=4, seq_kv=48, window=(30, 0)), dict(implementation="xla"),
                 id="gathered-t4-window"),
    # The Triton read in place (16-token pages); gradients through the gathered cache.
    pytest.param(16, Case(seq_kv=48), dict(implementation="triton", interpret=True),
                 id="direct-t1"),
    pytest.param(16, Case(seq_q=4, seq_kv=48), dict(implementation="triton", interpret=True),
                 id="direct-t4"),
    # Chunked prefill: pallas_flash.attention with a per-row mask.
    pytest.param(8, Case(seq_q=20, seq_kv=48), dict(implementation="xla"),
                 id="prefill-t20"),
]


@pytest.mark.parametrize(("page_size", "case", "kwargs"), PAGED_CASES)
def test_paged_hidden_slots_leave_no_trace(page_size, case, kwargs):
    """The cache is poisoned past each row's length before it is cut into scattered pages;
    out and lse called and differentiated (the direct read runs only undifferentiated) and
    the pages' gradients, back in sequence order, are the oracle's."""
    lengths = np.maximum(LENGTHS, case.seq_q)  # chunked prefill: rows hold their queries
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim)
    ref_out, ref_lse, ref_grads = _oracle(case, q, k, v, lengths, None, d_out=d_out)

    @jax.jit
    def call(q, key_pages, value_pages, table):
        return pf.paged_attention(q, key_pages, value_pages, table, jnp.asarray(lengths),
                                  local_window_size=case.window, return_lse=True, **kwargs)

    for poison in POISONS:
        (k_bad, hidden), (v_bad, _) = (_poisoned(x, lengths, poison) for x in (k, v))
        key_pages, value_pages, table = _scattered_pool(k_bad, v_bad, page_size)
        out, lse = call(q, key_pages, value_pages, table)  # undifferentiated: in place
        assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())
        (out, lse), vjp = jax.vjp(call, q, key_pages, value_pages, table)
        dq, dkp, dvp, _ = vjp((d_out, jnp.zeros_like(lse)))
        dk, dv = (np.asarray(g)[np.asarray(table)].reshape(k.shape) for g in (dkp, dvp))
        assert_matches(out, lse, (dq, dk, dv), ref_out, ref_lse, ref_grads, F32)
        assert np.all(dk[hidden] == 0) and np.all(dv[hidden] == 0), poison


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_attention_hidden_slots_leave_no_trace(implementation):
    """``attention`` with the same lengths and poison (it zeroes hidden rows first)."""
    case = Case(seq_q=4, seq_kv=48, is_causal=False)
    backend = BACKENDS[implementation]
    _check_poisoned(lambda q, k, v: pf.attention(
        q, k, v, key_value_seq_lengths=jnp.asarray(LENGTHS), return_lse=True,
        **backend.kwargs(case.head_dim)), case, LENGTHS, F32)

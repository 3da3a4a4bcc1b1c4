"""Hidden positions never reach the output, on every backend (tests/support.py).

* NaN in the K/V rows of keys no query sees (past ``key_value_seq_lengths``, a segment id
  no query of the band has, outside every query's band, a mask column False for every
  query) and in the Q rows of queries that see no key leaves out, lse, dq, dk, dv and dbias
  as the float64 oracle gives them on finite inputs; those rows' gradients are exactly 0.
* Windows far wider than the sequences (``2**31 - 1``, ``10**12``: "unbounded") behave as
  the window they spell.
* A row whose visible logits a finite bias pushes to <= -1e30 gets its softmax (as
  ``jax.nn``); a row with no visible key still outputs 0.

The oracle's visibility is built here in NumPy (int64) from the arguments, not by
``MaskSpec``: it reaches :func:`attention_float64` as a mask array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import (
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

from pallas_flash import triton
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

BATCH = 2


def _visible(seq_q, seq_kv, *, is_causal=False, causal_alignment="top_left",
             local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
             query_seq_lengths=None, key_value_seq_lengths=None) -> np.ndarray:
    """The visible pairs of a call, ``[BATCH, 1, T, S]`` bool, from its keywords."""
    diff = np.arange(seq_kv, dtype=np.int64)[None, :] - np.arange(seq_q, dtype=np.int64)[:, None]
    offset = seq_kv - seq_q if causal_alignment == "bottom_right" else 0
    visible = np.ones((BATCH, seq_q, seq_kv), bool)
    if is_causal:
        visible &= diff <= offset
    if local_window_size is not None:
        left, right = ((local_window_size,) * 2 if isinstance(local_window_size, int)
                       else local_window_size)
        visible &= (diff >= offset - left) & (diff <= offset + right)
    if q_segment_ids is not None:
        visible &= np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None]
    if query_seq_lengths is not None:
        visible &= (np.arange(seq_q)[None, :] < np.asarray(query_seq_lengths)[:, None])[..., None]
    if key_value_seq_lengths is not None:
        visible &= (np.arange(seq_kv)[None, :] < np.asarray(key_value_seq_lengths)[:, None]
                    )[:, None, :]
    return visible[:, None]


def _doc_ids(*docs) -> jax.Array:
    """``[BATCH, seq]`` int32 ids, one row per ``docs`` entry: ``[(id, length), ...]``."""
    return jnp.asarray(np.stack([np.concatenate([np.full(n, i) for i, n in row])
                                 for row in docs]), jnp.int32)


# Causal, seq_kv > seq_q: keys past the last query are seen by nobody. A KV cache filled up
# to 20 in sequence 0; queries past 28 of sequence 1 are padding. Window 3 and documents:
# keys 5..9 of document 1 lie after every query of document 1 (0..4), and queries 5..9 of
# document 2 lie more than 3 after its first key: only the two criteria together hide
# them. (Documents without queries / keys: tests/test_attention.py.)
SEQ_Q, SEQ_KV = 32, 48
HIDING = dict(is_causal=True, local_window_size=(3, 0),
              q_segment_ids=_doc_ids([(1, 5), (2, 27)], [(1, 5), (2, 27)]),
              kv_segment_ids=_doc_ids([(1, 10), (2, 38)], [(1, 10), (2, 38)]),
              key_value_seq_lengths=jnp.array([20, 48]), query_seq_lengths=jnp.array([32, 28]))


def _with_nan_where_unused(q, k, v, visible):
    """NaN in the K/V rows no query sees and in the Q rows that see no key (one KV head)."""
    unseen_keys = ~visible.any(axis=(1, 2))                         # [B, S]
    unseeing_queries = ~visible.any(axis=3).transpose(0, 2, 1)      # [B, T, N']
    assert unseen_keys.any() or unseeing_queries.any()              # the case hides some
    k, v = (jnp.where(unseen_keys[:, :, None, None], jnp.nan, x) for x in (k, v))
    return jnp.where(unseeing_queries[..., None], jnp.nan, q), k, v, unseen_keys, \
        unseeing_queries


def _cases(cases, case_id, mosaic_cases: int):
    """backend_cases for every backend, Mosaic (slow to interpret) on the first
    ``mosaic_cases`` cases only."""
    params = backend_cases(cases, case_id, lambda c: {})
    mosaic_ids = {f"mosaic-{case_id(c)}" for c in cases[mosaic_cases:]}
    return [p for p in params if p.id not in mosaic_ids]


@pytest.mark.parametrize("backend", backends())
def test_nan_in_unused_rows_leaves_no_trace(backend):
    """Out, lse and gradients are the oracle's on finite inputs; the unused rows'
    gradients are exactly 0 (and the outputs of queries that see no key)."""
    q, k, v, d_out = random_qkv(BATCH, SEQ_Q, SEQ_KV, 2, 1, 32, backend.dtype)
    visible = _visible(SEQ_Q, SEQ_KV, **HIDING)
    q_nan, k_nan, v_nan, unseen_keys, unseeing = _with_nan_where_unused(q, k, v, visible)
    out, lse, grads = run_attention(backend, q_nan, k_nan, v_nan, d_out, **HIDING)
    ref_out, ref_lse, ref_grads = attention_float64(q, k, v, attn_mask=visible, d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, backend.dtype)
    for g in grads[1:]:
        assert np.all(np.asarray(g)[unseen_keys] == 0)
    for x in (out, grads[0]):
        assert np.all(np.asarray(x)[np.broadcast_to(unseeing, x.shape[:3])] == 0)


# The rows are zeroed before any backend runs, the same code for all: Mosaic (slow to
# interpret) runs the case above and the segment case of tests/test_attention.py.
@pytest.mark.parametrize("backend", [b for b in backends(bias=True) if b.id != "mosaic"])
def test_nan_in_rows_the_mask_hides_leaves_no_trace(backend):
    """A mask column False for every query (of the heads sharing the KV head) and a mask
    row False for every key: NaN in those K/V / Q rows reaches neither out nor dq, dk, dv,
    dbias."""
    seq = 40
    q, k, v, d_out = random_qkv(BATCH, seq, seq, 2, 1, 32, backend.dtype)
    bias = 2 * jax.random.normal(fresh_key(), (BATCH, 2, seq, seq), F32)
    # Shared by the heads ([B, 1, T, S]): a broadcast dim in the KV-head grouping.
    mask = np.array(jax.random.bernoulli(fresh_key(), 0.7, (BATCH, 1, seq, seq)))
    mask[0, :, :, 25:] = False       # keys 25.. of sequence 0: padding
    mask[1, :, :, 30:33] = False     # keys 30..32 of sequence 1: no query
    mask[0, :, 5:8] = False          # queries 5..7 of sequence 0: no key
    visible = np.broadcast_to(mask, (BATCH, 2, seq, seq))
    q_nan, k_nan, v_nan, unseen_keys, unseeing = _with_nan_where_unused(q, k, v, visible)

    def f(q, k, v, bias):
        return backend.attention(q, k, v, bias, jnp.asarray(mask), return_lse=True)

    (out, lse), vjp = jax.vjp(f, q_nan, k_nan, v_nan, bias)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(q, k, v, bias=bias, attn_mask=mask,
                                                    d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, backend.dtype,
                   names=("dq", "dk", "dv", "dbias"))
    for g in grads[1:3]:
        assert np.all(np.asarray(g)[unseen_keys] == 0)
    assert np.all(np.asarray(grads[0])[unseeing] == 0)


# Windows that spell "unbounded" on one side or both, with the band they must give.
WIDE_WINDOWS = [
    (10**12, True, "top_left"),
    ((2**31 - 1, 3), False, "bottom_right"),
]


@pytest.mark.parametrize(("backend", "window"), _cases(
    WIDE_WINDOWS, lambda w: f"{w[0]}-{'causal' if w[1] else 'dense'}-{w[2]}", 1))
def test_windows_wider_than_the_sequences(backend, window):
    """int32 would overflow in ``i - left`` / ``i + right``: the window is clamped to the
    sequences once, and behaves as the window it spells."""
    size, causal, alignment = window
    seq_q, seq_kv = 24, 40
    q, k, v, d_out = random_qkv(BATCH, seq_q, seq_kv, 2, 1, 32, backend.dtype)
    kwargs = dict(is_causal=causal, causal_alignment=alignment, local_window_size=size)
    out, lse, grads = run_attention(backend, q, k, v, d_out, **kwargs)
    ref = attention_float64(q, k, v, attn_mask=_visible(seq_q, seq_kv, **kwargs), d_out=d_out)
    assert_matches(out, lse, grads, *ref, backend.dtype)


@pytest.mark.parametrize("backend", backends(bias=True))
def test_bias_rows_at_or_below_minus_1e30_get_their_softmax(backend):
    """Very negative finite bias is not a mask: the row's softmax over its visible keys
    (as jax.nn and the float64 oracle), whichever keys the mask hides; only a row with no
    visible key outputs 0. Rows of distinct logits (one key wins, exactly) through the
    gradients; a row of equal logits -1e30 (the mean of V) through the forward only:
    its lse, -1e30 + log(S) rounded to float32, is -1e30, and P = exp(S - lse), which the
    backward recomputes, cannot resolve log(S) there."""
    seq = 40
    q, k, v, d_out = random_qkv(BATCH, seq, seq, 2, 1, 32, backend.dtype)
    bias = np.array(2 * jax.random.normal(fresh_key(), (seq, seq)), np.float32)
    spread = np.asarray(jax.random.uniform(fresh_key(), (seq, seq), minval=1, maxval=3))
    bias[5:9] = -1e30 * spread[5:9]          # distinct: one visible key wins
    bias[9] = -1e35 * spread[9]
    bias[11] = -1e30 * spread[11]            # ... but the mask hides all of row 11
    mask = np.array(jax.random.bernoulli(fresh_key(), 0.6, (BATCH, 1, seq, seq)))
    mask[:, :, 11] = False
    # Row 5 sees keys 0..5 (causal): the winner among them is hidden, the next one wins.
    mask[:, :, 5, :6] = True
    mask[:, :, 5, np.argmax(bias[5, :6])] = False
    kwargs = dict(is_causal=True)
    visible = mask & _visible(seq, seq, **kwargs)

    def f(q, k, v, bias):
        return backend.attention(q, k, v, bias, jnp.asarray(mask), return_lse=True,
                                 **kwargs)

    tol = tolerance(backend.dtype)
    (out, lse), vjp = jax.vjp(f, q, k, v, jnp.asarray(bias))
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(q, k, v, bias=bias, attn_mask=visible,
                                                    d_out=d_out)
    ref_lse = ref_lse.transpose(0, 2, 1)
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, ref_lse) < 1e-5
    assert np.all(np.asarray(out[:, 11]) == 0) and np.all(np.asarray(lse[:, 11]) == EMPTY_ROW_LSE)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2 * tol
    # Rows of equal logits -1e30 on visible keys: the mean of their V, not 0.
    bias[3:5] = -1e30
    out, lse = f(q, k, v, jnp.asarray(bias))
    ref_out, ref_lse = attention_float64(q, k, v, bias=bias, attn_mask=visible)
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, ref_lse.transpose(0, 2, 1)) < 1e-5


def test_triton_kernels_never_read_tiles_outside_the_span():
    """The Triton kernels themselves (the API zeroes unused rows first): Q of a query
    document without keys and K/V of a key document without queries are NaN, in whole
    tiles of every kernel, and leave exact zeros, so those tiles are never read."""
    seq, config = 128, triton.TritonConfig(block_q=32, block_kv=16, bwd_block_q=16,
                                           bwd_block_kv=32)
    q, k, v, d_out = random_qkv(1, seq, seq, 2, 1, 32)
    q_ids = _doc_ids([(0, 32), (1, 32), (2, 64)])[:1]      # document 1: no key
    kv_ids = _doc_ids([(0, 32), (2, 32), (3, 64)])[:1]     # document 3: no query
    rows, keys = slice(32, 64), slice(64, 128)
    q_nan, k_nan, v_nan = q.at[:, rows].set(jnp.nan), k.at[:, keys].set(jnp.nan), \
        v.at[:, keys].set(jnp.nan)
    static = dict(mask=MaskSpec(seq, seq), scale=32 ** -0.5, config=config, interpret=True)
    out, lse = triton.forward(q_nan, k_nan, v_nan, (q_ids, kv_ids), **static)
    delta = jnp.einsum("btnd,btnd->bnt", out, d_out)
    grads = triton.backward(q_nan, k_nan, v_nan, (q_ids, kv_ids), out, lse, d_out, delta,
                            **static)
    ref_out, ref_lse, ref_grads = attention_float64(q, k, v, segment_ids=(q_ids, kv_ids),
                                                    d_out=d_out)
    assert_matches(out, jnp.transpose(lse, (0, 2, 1)), grads, ref_out, ref_lse, ref_grads, F32)
    for x in (out, grads[0]):
        assert np.all(np.asarray(x[:, rows]) == 0)
    for x in grads[1:]:
        assert np.all(np.asarray(x[:, keys]) == 0)

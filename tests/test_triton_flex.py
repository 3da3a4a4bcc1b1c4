"""The Triton flex kernels (pallas_flash/triton/flex.py) in interpret mode: out, lse, dq, dk
and dv against the float64 oracle and against flex_reference, for masks and score
functions that capture arrays."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import BF16, F32, assert_matches, fresh_rng, random_qkv, rel_err, tolerance
from test_flex import documents, grid, t5_bucket

from pallas_flash.contract import EMPTY_ROW_LSE
from pallas_flash.flex import (
    block_mask_from_dense,
    convert_score_mod,
    create_block_mask,
    flex_reference,
)
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from pallas_flash.triton import TritonConfig
from pallas_flash.triton.flex import flex_attention, unsupported


def _run(attention, q, k, v, d_out, d_lse):
    """out, lse ([B, T, N]) and (dq, dk, dv) of ``attention(q, k, v) -> (out, lse)``
    against the cotangents ``d_out`` and ``d_lse`` ([B, N, T])."""
    (out, lse), vjp = jax.vjp(attention, q, k, v)
    return out, jnp.swapaxes(lse, 1, 2), vjp((d_out, d_lse))


@functools.partial(jax.jit, static_argnames=("score_fn", "scale", "softcap"))
def _kernel(q, k, v, d_out, d_lse, block_mask, score_operands, *, score_fn=None, **kwargs):
    score_mod = None if score_fn is None else (score_fn, score_operands)
    return _run(lambda q, k, v: flex_attention(q, k, v, block_mask, score_mod=score_mod,
                                               interpret=True, **kwargs), q, k, v, d_out, d_lse)


def kernel(q, k, v, d_out, block_mask, *, score_mod=None, d_lse=None, **kwargs):
    """The kernels' results, one jitted program; ``score_mod`` a plain function."""
    score_fn, score_operands = (None, ()) if score_mod is None else convert_score_mod(score_mod)
    d_lse = _zero_lse(q) if d_lse is None else d_lse
    return _kernel(q, k, v, d_out, d_lse, block_mask, score_operands, score_fn=score_fn,
                   **kwargs)


def reference(q, k, v, d_out, block_mask, *, d_lse=None, **kwargs):
    """flex_reference's results for the same call."""
    d_lse = _zero_lse(q) if d_lse is None else d_lse
    return jax.jit(lambda *xs: _run(
        lambda q, k, v: flex_reference(q, k, v, block_mask=block_mask, **kwargs),
        *xs))(q, k, v, d_out, d_lse)


def _zero_lse(q):
    return jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)


def check(q, k, v, d_out, block_mask, oracle_kwargs, *, score_mod=None, d_lse=None,
          **kwargs):
    """The kernels against the float64 oracle (``oracle_kwargs``: its dense statement of
    the call; skipped with a lse cotangent, which it does not take) and flex_reference."""
    got = kernel(q, k, v, d_out, block_mask, score_mod=score_mod, d_lse=d_lse, **kwargs)
    if d_lse is None:
        oracle = attention_float64(q, k, v, d_out=d_out, **oracle_kwargs, **kwargs)
        assert_matches(*got, *oracle[:2], oracle[2][:3], q.dtype)
    want = reference(q, k, v, d_out, block_mask, score_mod=score_mod, d_lse=d_lse, **kwargs)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, (*got[:2], *got[2]), (*want[:2], *want[2]), strict=True):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 2 * tolerance(q.dtype), (name, rel_err(a, b))
    return got


@pytest.mark.parametrize("seq_q, seq_kv, dtype", [(64, 64, F32), (72, 88, F32),
                                                  (96, 64, BF16)],
                         ids=["64x64", "72x88-padded", "96x64-bf16"])
def test_causal_mask_mod_equals_is_causal(seq_q, seq_kv, dtype):
    q, k, v, d_out = random_qkv(2, seq_q, seq_kv, 2, 2, 16, dtype)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=seq_q, seq_kv=seq_kv,
                           block_size=32)
    check(q, k, v, d_out, bm, {"mask": MaskSpec(seq_q, seq_kv, is_causal=True)})


def test_sliding_window():
    q, k, v, d_out = random_qkv(1, 96, 96, 2, 1, 32)
    bm = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 20), seq_q=96,
                           seq_kv=96, block_size=32)
    check(q, k, v, d_out, bm, {"mask": MaskSpec(96, 96, is_causal=True, window=(19, 0))})


def test_document_mask_over_captured_ids():
    q, k, v, d_out = random_qkv(2, 80, 80, 2, 2, 16)
    ids = documents(2, 80)
    ids_j = jnp.asarray(ids)
    bm = create_block_mask(lambda b, h, q, kv: ids_j[b, q] == ids_j[b, kv], batch=2,
                           seq_q=80, seq_kv=80, block_size=(32, 16))
    check(q, k, v, d_out, bm, {"segment_ids": (ids, ids)})


def test_captured_reads_in_every_gather_mode():
    """Reads past the ids' end (the padded rows and keys of the last blocks) in fill mode
    give the fill value, in clip mode the last id: hidden either way."""
    q, k, v, d_out = random_qkv(1, 72, 72, 2, 2, 16)
    ids = documents(1, 72)
    ids_j = jnp.asarray(ids)
    bm = create_block_mask(
        lambda b, h, q, kv: (ids_j.at[b, q].get(mode="fill", fill_value=-1)
                             == ids_j.at[b, kv].get(mode="clip")) & (kv <= q),
        batch=1, seq_q=72, seq_kv=72, block_size=32)
    check(q, k, v, d_out, bm, {"segment_ids": (ids, ids),
                               "mask": MaskSpec(72, 72, is_causal=True)})


def test_prefix_lm():
    q, k, v, d_out = random_qkv(2, 64, 96, 2, 1, 16)
    prefix = jnp.asarray([5, 70], jnp.int32)
    bm = create_block_mask(lambda b, h, q, kv: (kv <= q) | (kv < prefix[b]), batch=2,
                           seq_q=64, seq_kv=96, block_size=32)
    _, _, qi, ki = grid(2, 1, 64, 96)
    visible = (ki <= qi) | (ki < np.asarray(prefix).reshape(-1, 1, 1, 1))
    check(q, k, v, d_out, bm, {"attn_mask": visible})


def test_alibi_score_mod():
    q, k, v, d_out = random_qkv(2, 64, 64, 4, 2, 16)
    slopes = jnp.asarray([2.0 ** -(i + 1) for i in range(4)], jnp.float32)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=64, seq_kv=64, block_size=32)
    _, _, qi, ki = grid(1, 1, 64, 64)
    bias = np.asarray(slopes, np.float64).reshape(1, 4, 1, 1) * (ki - qi)
    check(q, k, v, d_out, bm, {"mask": MaskSpec(64, 64, is_causal=True), "bias": bias},
          score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q))


def test_soft_cap_as_argument_and_as_score_mod():
    q, k, v, d_out = random_qkv(1, 64, 96, 2, 2, 16)
    q = q * 4.0  # logits well past the cap
    everything = create_block_mask(lambda b, h, q, kv: q >= 0, seq_q=64, seq_kv=96,
                                   block_size=32)
    got = check(q, k, v, d_out, everything, {}, softcap=3.0)
    as_mod = kernel(q, k, v, d_out, everything,
                    score_mod=lambda s, b, h, q, kv: 3.0 * jnp.tanh(s / 3.0))
    for a, b in zip((*got[:2], *got[2]), (*as_mod[:2], *as_mod[2]), strict=True):
        assert rel_err(a, b) < 1e-5


def test_t5_bucket_table_with_soft_cap():
    q, k, v, d_out = random_qkv(1, 64, 96, 4, 2, 16)
    table = jnp.asarray(fresh_rng().standard_normal((16, 4)), jnp.float32)
    _, _, qi, ki = grid(1, 1, 64, 96)
    buckets = np.asarray(t5_bucket(jnp.asarray(ki - qi)))[0, 0]
    bias = np.transpose(np.asarray(table, np.float64)[buckets], (2, 0, 1))[None]
    bm = create_block_mask(lambda b, h, q, kv: kv < 80, seq_q=64, seq_kv=96, block_size=32)
    check(q, k, v, d_out, bm, {"bias": bias, "attn_mask": ki < 80}, softcap=4.0,
          score_mod=lambda s, b, h, q, kv: s + table[t5_bucket(kv - q), h])


def test_gqa_per_head_mask_with_lse_cotangent():
    q, k, v, d_out = random_qkv(2, 64, 64, 6, 2, 16)
    windows = jnp.asarray([0, 10, 20, 30, 40, 64], jnp.int32)
    bm = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv <= windows[h]), heads=6,
                           seq_q=64, seq_kv=64, block_size=16)
    d_lse = jnp.asarray(fresh_rng().standard_normal((2, 6, 64)), jnp.float32)
    check(q, k, v, d_out, bm, {}, d_lse=d_lse, scale=0.3,
          score_mod=lambda s, b, h, q, kv: s * (1.0 + 0.1 * h))


def test_dense_mask_operand():
    q, k, v, d_out = random_qkv(2, 64, 64, 2, 2, 16)
    visible = fresh_rng().random((2, 1, 64, 64)) < 0.3
    visible[:, :, :32, :32] = True  # one full tile
    bm = block_mask_from_dense(jnp.asarray(visible), 32)
    check(q, k, v, d_out, bm, {"attn_mask": visible})


def _lists(partial: np.ndarray, full: np.ndarray) -> dict[str, jax.Array]:
    """The eight lists of a BlockMask (its field names) from tile flags ``[B', N', nq,
    nk]``: the set blocks ascending, then the last of them repeated (0 for none)."""
    def ordered(flags):
        counts = flags.sum(-1).astype(np.int32)
        indices = np.zeros(flags.shape, np.int32)
        for at in np.ndindex(flags.shape[:-1]):
            found = np.flatnonzero(flags[at])
            indices[at] = found[-1] if len(found) else 0
            indices[at][:len(found)] = found
        return jnp.asarray(counts), jnp.asarray(indices)

    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    flags = (partial, full, np.swapaxes(partial, -1, -2), np.swapaxes(full, -1, -2))
    return dict(zip(names, (x for f in flags for x in ordered(f)), strict=True))


def test_rows_emptied_by_the_block_mask():
    """Rows before 24 see nothing through the mask function, and a hand-emptied query
    block sees nothing through the lists alone: zeros, EMPTY_ROW_LSE, zero gradients."""
    q, k, v, d_out = random_qkv(1, 64, 64, 2, 2, 16)
    bm = create_block_mask(lambda b, h, q, kv: (q >= 24) & (kv <= q), seq_q=64, seq_kv=64,
                           block_size=16)
    _, _, qi, ki = grid(1, 1, 64, 64)
    visible = (qi >= 24) & (ki <= qi)
    out, lse, grads = check(q, k, v, d_out, bm, {"attn_mask": visible})
    assert np.all(np.asarray(lse)[:, :24] == np.float32(EMPTY_ROW_LSE))
    assert np.all(np.asarray(out)[:, :24] == 0) and np.all(np.asarray(grads[0])[:, :24] == 0)

    partial, full = (np.asarray(x).copy() for x in bm.block_classes())
    partial[:, :, 2] = full[:, :, 2] = False  # query block 2 (rows 32-47) emptied
    emptied = dataclasses.replace(bm, **_lists(partial, full))
    visible = visible & ((qi < 32) | (qi >= 48))
    out, lse, grads = check(q, k, v, d_out, emptied, {"attn_mask": visible})
    assert np.all(np.asarray(lse)[:, 32:48] == np.float32(EMPTY_ROW_LSE))
    assert np.all(np.asarray(grads[0])[:, 32:48] == 0)


def test_new_captured_values_do_not_retrace():
    q, k, v, _ = random_qkv(2, 64, 64, 2, 2, 16)
    traces = []

    @jax.jit
    def run(q, k, v, ids, slopes):
        traces.append(None)
        bm = create_block_mask(lambda b, h, q, kv: ids[b, q] == ids[b, kv], batch=2,
                               seq_q=64, seq_kv=64, block_size=32)
        score = convert_score_mod(lambda s, b, h, q, kv: s - slopes[h] * jnp.abs(kv - q))
        return flex_attention(q, k, v, bm, score_mod=score, interpret=True)

    for _ in range(2):
        ids, slopes = documents(2, 64), fresh_rng().random(2).astype(np.float32)
        out, _ = run(q, k, v, jnp.asarray(ids), jnp.asarray(slopes))
        _, _, qi, ki = grid(1, 1, 64, 64)
        bias = -np.asarray(slopes, np.float64).reshape(1, 2, 1, 1) * np.abs(ki - qi)
        want, _ = attention_float64(q, k, v, segment_ids=(ids, ids), bias=bias)
        assert rel_err(out, want) < 1e-5
    assert len(traces) == 1


def _bm(seq_q=64, seq_kv=64, block_size=32, **kwargs):
    return create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=seq_q, seq_kv=seq_kv,
                             block_size=block_size, **kwargs)


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((1, 64, 2))), "q must be"),
    (dict(k=jnp.zeros((1, 64, 3, 16))), "k and v must"),
    (dict(v=jnp.zeros((1, 64, 2, 16), jnp.bfloat16)), "k and v must"),
    (dict(block_mask="causal"), "block_mask must be a"),
    (dict(block_mask=_bm(seq_kv=48)), "block_mask was built for"),
    (dict(block_mask=_bm(heads=3)), "block_mask was built for heads=3"),
    (dict(block_mask=_bm(block_size=24)), "powers of two >= 16"),
    (dict(score_mod=lambda s, b, h, q, kv: s), "score_mod must be None or"),
    (dict(scale=0.0), "scale must be"),
    (dict(softcap=-1.0), "softcap must be None or"),
    (dict(interpret=1), "interpret must be"),
    (dict(config=TritonConfig(block_q=32, block_kv=32)), "config must be"),
])
def test_bad_arguments(change, match):
    arguments = dict(q=jnp.zeros((1, 64, 2, 16)), k=jnp.zeros((1, 64, 2, 16)),
                     v=jnp.zeros((1, 64, 2, 16)), block_mask=_bm(), interpret=True)
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        flex_attention(**arguments)


def test_unsupported_reasons():
    assert unsupported((1, 64, 2, 256), (1, 64, 2, 256), jnp.bfloat16, (128, 64)) is None
    assert "head_dim up to 256" in unsupported((1, 64, 2, 512), (1, 64, 2, 512), F32, (64, 64))
    assert "powers of two" in unsupported((1, 64, 2, 64), (1, 64, 2, 64), F32, (48, 64))
    assert "not int32" in unsupported((1, 64, 2, 64), (1, 64, 2, 64), jnp.int32, (64, 64))


def test_compiled_refuses_reads_that_are_not_ref_loads():
    """Compiled, a captured array read element-wise at traced indices becomes ref loads
    (supported); reads that cannot are refused (ValueError, the planner's fallback
    reason), and interpret mode runs them all."""
    shapes = ((1, 64, 2, 16), (1, 64, 2, 16), F32, (32, 32))
    ids = jnp.zeros((1, 64), jnp.int32)
    slopes = jnp.ones((2,), jnp.float32)
    lengths = jnp.asarray([5, 9, 60], jnp.int32)

    def mask_fn(mask_mod):
        return create_block_mask(mask_mod, batch=1, seq_q=64, seq_kv=64, block_size=32).mask_fn

    alibi_fn, _ = convert_score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    supported = (_bm().mask_fn, alibi_fn,
                 mask_fn(lambda b, h, q, kv: ids[b, q] == ids[b, kv]))
    assert unsupported(*shapes, supported) is None
    for mask_mod, match in [
        (lambda b, h, q, kv: (ids * 2)[b, q] == ids[b, kv], "reads a computed array"),
        (lambda b, h, q, kv: jnp.sum(ids[b]) > q + kv, "more than one element"),
        (lambda b, h, q, kv: kv < jnp.max(lengths), "not a power of two"),
    ]:
        assert match in unsupported(*shapes, (mask_fn(mask_mod),))
        assert unsupported(*shapes, (mask_fn(mask_mod),), interpret=True) is None
    q = jnp.zeros((1, 64, 2, 16))
    bm = create_block_mask(lambda b, h, q, kv: kv < jnp.max(lengths), seq_q=64, seq_kv=64,
                           block_size=32)
    with pytest.raises(ValueError, match="cannot lower this mask_mod"):
        flex_attention(q, q, q, bm)

"""Block masks and user mask / score functions (pallas_flash/flex.py): the lists against
brute force, conversion under jit, and the dense reference against the float64 oracle."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_matches, fresh_rng, random_qkv

from pallas_flash.contract import EMPTY_ROW_LSE, RowBounds
from pallas_flash.flex import (
    BlockMask,
    block_mask_from_dense,
    convert_mask_mod,
    convert_score_mod,
    create_block_mask,
    flex_reference,
)
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64

F32 = jnp.dtype(jnp.float32)


# --- brute force --------------------------------------------------------------------------

def brute_flags(visible: np.ndarray, block_size: tuple[int, int]):
    """``(partial, full)`` ``[B', N', nq, nk]`` of a dense ``[B', N', T, S]`` visibility, tile
    by tile: full = every pair of the tile visible and no padded key in its block."""
    (bq, bk), (b, n, t, s) = block_size, visible.shape
    nq, nk = -(-t // bq), -(-s // bk)
    partial, full = np.zeros((2, b, n, nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            tile = visible[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            every = tile.all(axis=(2, 3)) & ((j + 1) * bk <= s)
            full[:, :, i, j] = every
            partial[:, :, i, j] = tile.any(axis=(2, 3)) & ~every
    return partial, full


def assert_list(counts, indices, flags) -> None:
    """``counts [..., rows]`` / ``indices [..., rows, cols]`` list ``flags [..., rows, cols]``:
    the set columns ascending, then the last of them repeated (0 for none)."""
    counts, indices = np.asarray(counts), np.asarray(indices)
    assert counts.shape == flags.shape[:-1] and indices.shape == flags.shape
    assert counts.dtype == np.int32 and indices.dtype == np.int32
    for at in np.ndindex(flags.shape[:-1]):
        want = np.flatnonzero(flags[at])
        assert counts[at] == len(want), at
        tail = want[-1] if len(want) else 0
        np.testing.assert_array_equal(indices[at][:len(want)], want, err_msg=str(at))
        assert np.all(indices[at][len(want):] == tail), at


def assert_block_mask(bm: BlockMask, visible: np.ndarray) -> None:
    """Every list of ``bm`` equals brute force on the dense ``visible [B', N', T, S]``."""
    assert (bm.batch, bm.heads, bm.seq_q, bm.seq_kv) == (visible.shape[0], visible.shape[1],
                                                         *visible.shape[2:])
    partial, full = brute_flags(visible, bm.block_size)
    assert_list(bm.kv_num_blocks, bm.kv_indices, partial)
    assert_list(bm.full_kv_num_blocks, bm.full_kv_indices, full)
    assert_list(bm.q_num_blocks, bm.q_indices, np.swapaxes(partial, -1, -2))
    assert_list(bm.full_q_num_blocks, bm.full_q_indices, np.swapaxes(full, -1, -2))
    got_partial, got_full = bm.block_classes()
    np.testing.assert_array_equal(got_partial, partial)
    np.testing.assert_array_equal(got_full, full)


def grid(b: int, n: int, t: int, s: int):
    """NumPy index grids ``[b,1,1,1]``, ``[1,n,1,1]``, ``[1,1,t,1]``, ``[1,1,1,s]``."""
    return (np.arange(b).reshape(-1, 1, 1, 1), np.arange(n).reshape(1, -1, 1, 1),
            np.arange(t).reshape(1, 1, -1, 1), np.arange(s).reshape(1, 1, 1, -1))


def documents(batch: int, seq: int) -> np.ndarray:
    """Sorted document ids ``[batch, seq]``, 1-5 documents a row at random cuts."""
    cuts = fresh_rng().integers(0, seq, (batch, 4))
    return np.sum(np.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1).astype(np.int32)


# --- the lists ------------------------------------------------------------------------------

B, N, T, S = 2, 3, 200, 232


def _case(name):
    """``(mask_mod, create_block_mask kwargs, dense visibility [B', N', T, S])``."""
    _, _, q, kv = grid(B, N, T, S)
    if name == "causal":
        return (lambda b, h, q, kv: q >= kv), {}, np.broadcast_to(q >= kv, (1, 1, T, S))
    if name == "everything":  # full tiles but for the key block holding padding
        return (lambda b, h, q, kv: q >= 0), {}, np.ones((1, 1, T, S), bool)
    if name == "sliding_window":
        return ((lambda b, h, q, kv: (kv <= q + 40) & (kv >= q - 40)), {},
                np.broadcast_to((kv <= q + 40) & (kv >= q - 40), (1, 1, T, S)))
    if name == "documents":
        ids_q, ids_kv = documents(B, T), documents(B, S)
        visible = ids_q[:, None, :, None] == ids_kv[:, None, None, :]
        ids_q, ids_kv = jnp.asarray(ids_q), jnp.asarray(ids_kv)
        return ((lambda b, h, q, kv: (ids_q[b, q] == ids_kv[b, kv]) & (kv <= q + S - T)),
                {"batch": B}, np.broadcast_to(visible & (kv <= q + S - T), (B, 1, T, S)))
    if name == "prefix_lm":
        prefix = jnp.asarray([17, 150], jnp.int32)
        visible = (kv <= q) | (kv < np.asarray(prefix).reshape(-1, 1, 1, 1))
        return ((lambda b, h, q, kv: (kv <= q) | (kv < prefix[b])), {"batch": B},
                np.broadcast_to(visible, (B, 1, T, S)))
    if name == "per_head_window":  # broadcast over the batch, one window a head
        windows = jnp.asarray([0, 33, 120], jnp.int32)
        visible = (kv <= q) & (q - kv <= np.asarray(windows).reshape(1, -1, 1, 1))
        return ((lambda b, h, q, kv: (kv <= q) & (q - kv <= windows[h])), {"heads": N},
                np.broadcast_to(visible, (1, N, T, S)))
    raise AssertionError(name)


CASES = ("causal", "everything", "sliding_window", "documents", "prefix_lm", "per_head_window")


@pytest.mark.parametrize("block_size", [(64, 32), (48, 80)], ids=["64x32", "48x80"])
@pytest.mark.parametrize("name", CASES)
def test_lists_match_brute_force(name, block_size):
    mask_mod, kwargs, visible = _case(name)
    bm = create_block_mask(mask_mod, seq_q=T, seq_kv=S, block_size=block_size, **kwargs)
    assert_block_mask(bm, visible)
    # The mask function it carries is the user's, lifted over index arrays.
    indices = grid(bm.batch, bm.heads, T, S)
    np.testing.assert_array_equal(bm.mask_mod(*indices), visible)


def test_lists_for_both_batch_and_head():
    windows = jnp.asarray([[3, 90], [64, 0]], jnp.int32)   # [batch, heads]
    bm = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q - kv <= windows[b, h]), batch=2,
                           heads=2, seq_q=150, seq_kv=150, block_size=16)
    _, _, q, kv = grid(1, 1, 150, 150)
    assert_block_mask(bm, (kv <= q) & (q - kv <= np.asarray(windows)[:, :, None, None]))


def test_strips_bound_the_memory():
    """The mask is evaluated a strip of query blocks at a time: the compiled program's
    scratch stays far below the dense [T, S] mask (64 MiB of bools here)."""
    def build():
        return create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=8192, seq_kv=8192,
                                 block_size=128).kv_num_blocks

    stats = jax.jit(build).lower().compile().memory_analysis()
    assert stats.temp_size_in_bytes < 16 * 2**20, stats.temp_size_in_bytes


# --- under jit --------------------------------------------------------------------------------

def test_traced_ids_under_jit_compile_once():
    traces = []

    @jax.jit
    def build(ids):
        traces.append(1)
        return create_block_mask(lambda b, h, q, kv: ids[b, q] == ids[b, kv], batch=2,
                                 seq_q=T, seq_kv=T, block_size=32)

    for _ in range(2):
        ids = documents(2, T)
        bm = build(jnp.asarray(ids))
        assert_block_mask(bm, (ids[:, None, :, None] == ids[:, None, None, :]))
    assert len(traces) == 1


def test_block_mask_as_jit_argument_compiles_once():
    """A BlockMask rebuilt from a fresh lambda over new ids has the same tree structure (the
    converted function compares by its program), so a jitted consumer traces once."""
    traces = []

    @jax.jit
    def visible_pairs(bm):
        traces.append(1)
        return jnp.sum(bm.mask_mod(*grid(bm.batch, 1, T, T)))

    masks = []
    for _ in range(3):
        ids = jnp.asarray(documents(2, T))
        masks.append(create_block_mask(lambda b, h, q, kv, ids=ids: ids[b, q] == ids[b, kv],
                                       batch=2, seq_q=T, seq_kv=T, block_size=32))
        expected = np.sum(np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :])
        assert int(visible_pairs(masks[-1])) == expected
    assert len(traces) == 1
    assert masks[0].mask_fn == masks[1].mask_fn
    assert hash(masks[0].mask_fn) == hash(masks[1].mask_fn)
    assert jax.tree.structure(masks[0]) == jax.tree.structure(masks[2])


def test_converted_functions_hoist_captured_arrays():
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)
    fn, operands = convert_score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    assert len(operands) == 1 and operands[0] is slopes
    assert (fn.uses_batch, fn.uses_head) == (False, True)
    other, _ = convert_score_mod(lambda s, b, h, q, kv: s + slopes[h] * (q - kv))
    assert fn != other
    score = jnp.zeros((2, 1, 4, 1))
    got = fn(score, 0, jnp.arange(2).reshape(2, 1, 1, 1), jnp.arange(4).reshape(1, 1, 4, 1),
             jnp.arange(3).reshape(1, 1, 1, 3), jnp.asarray([1.0, 2.0]))
    q, kv = np.arange(4)[:, None], np.arange(3)[None, :]
    np.testing.assert_allclose(got, np.stack([1.0 * (kv - q), 2.0 * (kv - q)])[:, None])
    with pytest.raises(ValueError, match="takes 5 arguments and 1 operands, got 5 values"):
        fn(score, 0, 0, 0, 0)
    mask, operands = convert_mask_mod(lambda b, h, q, kv: q >= kv)
    assert operands == () and (mask.uses_batch, mask.uses_head) == (False, False)


# --- dense masks ----------------------------------------------------------------------------

def test_dense_mask_matches_brute_force():
    rng = fresh_rng()
    # Whole tiles on and off, plus scattered pairs: full, partial and empty tiles.
    tiles = rng.random((2, 1, 5, 8)) < 0.5
    visible = np.repeat(np.repeat(tiles, 32, axis=2), 16, axis=3)[:, :, :150, :120]
    visible = visible ^ (rng.random(visible.shape) < 0.02)
    bm = block_mask_from_dense(jnp.asarray(visible), (32, 16))
    assert_block_mask(bm, visible)
    as_int = block_mask_from_dense(jnp.asarray(visible, jnp.int32), (32, 16))
    assert_block_mask(as_int, visible)


def test_dense_bias_hides_very_negative_entries():
    rng = fresh_rng()
    bias = rng.standard_normal((1, 2, 70, 90)).astype(np.float32)
    bias[:, 0, 10:40, :] = -np.inf
    bias[:, 1, :, 50:] = -1e9
    bias[:, 1, 5, 3] = -1e8              # very negative, but above the default threshold
    bm = block_mask_from_dense(jnp.asarray(bias), 16)
    assert_block_mask(bm, bias > -1e9)
    stricter = block_mask_from_dense(jnp.asarray(bias), 16, hidden_at_or_below=-1e7)
    assert_block_mask(stricter, bias > -1e7)
    # float16: its lowest value (the usual "minus infinity" there) is hidden, -30000 is not.
    half = rng.standard_normal((2, 1, 40, 50)).astype(np.float16)
    half[0, :, :, :8] = np.finfo(np.float16).min
    half[1, :, 20:, 30:] = -30000
    assert_block_mask(block_mask_from_dense(jnp.asarray(half), 16),
                      half > np.finfo(np.float16).min)


def test_dense_broadcast_dims():
    keep = fresh_rng().random(90) < 0.7                     # a key-padding style mask [S]
    bm = block_mask_from_dense(jnp.asarray(keep), (16, 32), seq_q=50)
    assert_block_mask(bm, np.broadcast_to(keep, (1, 1, 50, 90)))
    rows = (np.arange(50) < 37)[:, None]                 # [T, 1]: per-query rows
    bm = block_mask_from_dense(jnp.asarray(rows), (16, 32), seq_kv=90)
    assert_block_mask(bm, np.broadcast_to(rows, (1, 1, 50, 90)))


# --- flex_reference against the float64 oracle ----------------------------------------------

def _run(q, k, v, d_out, **kwargs):
    """out, lse ([B, T, N], the oracle's checks' layout) and (dq, dk, dv) of flex_reference,
    one jitted program."""
    @jax.jit
    def run(q, k, v, d_out):
        (out, lse), vjp = jax.vjp(lambda q, k, v: flex_reference(q, k, v, **kwargs), q, k, v)
        return out, jnp.swapaxes(lse, 1, 2), vjp((d_out, jnp.zeros_like(lse)))

    return run(q, k, v, d_out)


def _oracle(q, k, v, d_out, **kwargs):
    out, lse, grads = attention_float64(q, k, v, d_out=d_out, **kwargs)
    return out, lse, grads


@pytest.mark.parametrize("seq_q, seq_kv", [(48, 48), (40, 56)])
def test_causal_mask_mod_is_causal(seq_q, seq_kv):
    q, k, v, d_out = random_qkv(2, seq_q, seq_kv, 4, 2, 16)
    ref_out, ref_lse, ref_grads = _oracle(q, k, v, d_out,
                                          mask=MaskSpec(seq_q, seq_kv, is_causal=True))
    out, lse, grads = _run(q, k, v, d_out, mask_mod=lambda b, h, q, kv: q >= kv)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, F32)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=seq_q, seq_kv=seq_kv,
                           block_size=16)
    out, lse, grads = _run(q, k, v, d_out, block_mask=bm)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, F32)


def test_alibi_score_mod_with_gradient_to_its_slopes():
    q, k, v, d_out = random_qkv(2, 40, 40, 4, 2, 16)
    slopes = jnp.asarray([2.0 ** -(i + 1) for i in range(4)], jnp.float32)
    _, _, qi, ki = grid(1, 1, 40, 40)
    distance = (ki - qi).astype(np.float64)
    bias = np.asarray(slopes, np.float64).reshape(1, 4, 1, 1) * distance
    causal = MaskSpec(40, 40, is_causal=True)
    ref_out, ref_lse, (*ref_grads, d_bias) = _oracle(q, k, v, d_out, mask=causal, bias=bias)

    def loss(q, k, v, slopes):
        out, lse = flex_reference(q, k, v, mask_spec=causal,
                                  score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
        return jnp.sum(out * d_out), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, slopes)
    assert_matches(out, jnp.swapaxes(lse, 1, 2), grads[:3], ref_out, ref_lse, ref_grads, F32)
    d_slopes = np.sum(d_bias * distance, axis=(0, 2, 3))
    np.testing.assert_allclose(grads[3], d_slopes, rtol=1e-4, atol=1e-6)


def test_soft_cap_as_score_mod():
    q, k, v, d_out = random_qkv(2, 40, 56, 4, 4, 16)
    q = q * 4.0  # logits well past the cap
    ref = _oracle(q, k, v, d_out, softcap=3.0)
    cap = 3.0
    out, lse, grads = _run(q, k, v, d_out,
                           score_mod=lambda s, b, h, q, kv: cap * jnp.tanh(s / cap))
    assert_matches(out, lse, grads, *ref, F32)
    out, lse, grads = _run(q, k, v, d_out, softcap=cap)
    assert_matches(out, lse, grads, *ref, F32)


def t5_bucket(relative, num_buckets: int = 16, max_distance: int = 64):
    """T5's bidirectional relative-position bucket of ``kv - q`` (jnp, int32)."""
    half = num_buckets // 2
    exact = half // 2
    distance = jnp.abs(relative)
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(max_distance / exact)
    large = jnp.minimum(exact + (log_ratio * (half - exact)).astype(jnp.int32), half - 1)
    return jnp.where(relative > 0, half, 0) + jnp.where(distance < exact, distance, large)


def test_t5_relative_bucket_table_with_gradient_to_the_table():
    q, k, v, d_out = random_qkv(2, 48, 80, 4, 2, 16)
    table = jnp.asarray(fresh_rng().standard_normal((16, 4)), jnp.float32)
    _, _, qi, ki = grid(1, 1, 48, 80)
    buckets = np.asarray(t5_bucket(jnp.asarray(ki - qi)))[0, 0]        # [T, S]
    bias = np.transpose(np.asarray(table, np.float64)[buckets], (2, 0, 1))[None]
    ref_out, ref_lse, (*ref_grads, d_bias) = _oracle(q, k, v, d_out, bias=bias)

    def loss(q, k, v, table):
        out, lse = flex_reference(
            q, k, v, score_mod=lambda s, b, h, q, kv: s + table[t5_bucket(kv - q), h])
        return jnp.sum(out * d_out), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, table)
    assert_matches(out, jnp.swapaxes(lse, 1, 2), grads[:3], ref_out, ref_lse, ref_grads, F32)
    d_table = np.zeros((16, 4))
    np.add.at(d_table, buckets, np.transpose(d_bias[0], (1, 2, 0)))
    np.testing.assert_allclose(grads[3], d_table, rtol=1e-4, atol=1e-6)


def test_block_mask_that_empties_rows():
    """Rows before 24 see nothing through the mask function, and a hand-emptied query
    block sees nothing through the lists alone: zeros, EMPTY_ROW_LSE, zero gradients."""
    q, k, v, d_out = random_qkv(1, 64, 64, 2, 2, 16)
    bm = create_block_mask(lambda b, h, q, kv: (q >= 24) & (kv <= q), seq_q=64, seq_kv=64,
                           block_size=8)
    _, _, qi, ki = grid(1, 1, 64, 64)
    visible = (qi >= 24) & (ki <= qi)
    out, lse, grads = _run(q, k, v, d_out, block_mask=bm)
    assert_matches(out, lse, grads, *_oracle(q, k, v, d_out, attn_mask=visible), F32)
    assert np.all(np.asarray(lse)[:, :24] == np.float32(EMPTY_ROW_LSE))
    assert np.all(np.asarray(grads[0])[:, :24] == 0)

    emptied = dataclasses.replace(bm, kv_num_blocks=bm.kv_num_blocks.at[:, :, 5].set(0),
                                  full_kv_num_blocks=bm.full_kv_num_blocks.at[:, :, 5].set(0))
    visible = visible & ((qi < 40) | (qi >= 48))
    out, lse, grads = _run(q, k, v, d_out, block_mask=emptied)
    assert_matches(out, lse, grads, *_oracle(q, k, v, d_out, attn_mask=visible), F32)


def test_dense_block_mask_in_reference():
    q, k, v, d_out = random_qkv(2, 50, 70, 4, 2, 16)
    visible = fresh_rng().random((2, 4, 50, 70)) < 0.3
    visible[0, 1, 7] = False                                    # one empty row
    bm = block_mask_from_dense(jnp.asarray(visible), (16, 16))
    out, lse, grads = _run(q, k, v, d_out, block_mask=bm)
    assert_matches(out, lse, grads, *_oracle(q, k, v, d_out, attn_mask=visible), F32)


def test_every_mask_and_the_order_of_operations():
    """soft cap, then bias, then score_mod (additive here: it folds into the oracle's bias),
    and the band, segment ids, row bounds, mask and mask_mod all ANDed."""
    batch, seq_q, seq_kv, heads = 2, 40, 48, 4
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, 2, 16)
    q = q * 3.0
    rng = fresh_rng()
    bias = rng.standard_normal((1, heads, seq_q, seq_kv)).astype(np.float32)
    mask = rng.random((batch, 1, seq_q, seq_kv)) < 0.8
    q_ids, kv_ids = documents(batch, seq_q), documents(batch, seq_kv)
    bounds = RowBounds(jnp.asarray([30, 40], jnp.int32), jnp.asarray([2, 0], jnp.int32),
                       jnp.asarray([48, 37], jnp.int32))
    spec = MaskSpec(seq_q, seq_kv, is_causal=True, causal_alignment="bottom_right",
                    window=(20, 0))
    _, h, qi, ki = grid(batch, heads, seq_q, seq_kv)
    visible = (mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
               & ((qi + ki) % 5 != 0)
               & (qi < np.asarray(bounds.q_end).reshape(-1, 1, 1, 1))
               & (ki >= np.asarray(bounds.kv_start).reshape(-1, 1, 1, 1))
               & (ki < np.asarray(bounds.kv_end).reshape(-1, 1, 1, 1)))
    extra = 0.1 * (h + 1) * np.cos(qi - ki)
    ref = _oracle(q, k, v, d_out, mask=spec, segment_ids=(q_ids, kv_ids), softcap=5.0,
                  bias=bias + extra, attn_mask=visible)
    out, lse, grads = _run(
        q, k, v, d_out, softcap=5.0, bias=jnp.asarray(bias), mask=jnp.asarray(mask),
        mask_spec=spec, segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)), bounds=bounds,
        score_mod=lambda s, b, h, q, kv: s + 0.1 * (h + 1) * jnp.cos((q - kv).astype(F32)),
        mask_mod=lambda b, h, q, kv: (q + kv) % 5 != 0)
    assert_matches(out, lse, grads, *ref[:2], ref[2][:3], F32)


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_mod, match", [
    ("not a function", "mask_mod must be a callable"),
    (lambda b, h, q: q > 0, "mask_mod must take 4 positional arguments"),
    (lambda b, h, q, kv: q - kv, "mask_mod must return bool"),
    (lambda b, h, q, kv: jnp.stack([q >= kv, q < kv]), "mask_mod must return one scalar"),
    (lambda b, h, q, kv: (q >= kv, q < kv), "mask_mod must return one scalar"),
])
def test_bad_mask_mod(mask_mod, match):
    with pytest.raises(ValueError, match=match):
        create_block_mask(mask_mod, seq_q=8, seq_kv=8, block_size=4)


@pytest.mark.parametrize("score_mod, match", [
    (lambda s, b, h, q: s, "score_mod must take 5 positional arguments"),
    (lambda s, b, h, q, kv: s > 0, "score_mod must return float32"),
    (lambda s, b, h, q, kv: s.astype(jnp.bfloat16), "score_mod must return float32"),
    (lambda s, b, h, q, kv: jnp.full(3, s), "score_mod must return one scalar"),
])
def test_bad_score_mod(score_mod, match):
    q, k, v, _ = random_qkv(1, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match=match):
        flex_reference(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("kwargs, match", [
    ({"mask_mod": lambda b, h, q, kv: b == q, "seq_q": 8, "seq_kv": 8}, "needs batch="),
    ({"mask_mod": lambda b, h, q, kv: h == q, "batch": 2, "seq_q": 8, "seq_kv": 8},
     "needs heads="),
    ({"seq_q": 0, "seq_kv": 8}, "seq_q must be a positive int"),
    ({"seq_q": 8, "seq_kv": 8.0}, "seq_kv must be a positive int"),
    ({"seq_q": 8, "seq_kv": 8, "batch": 0}, "batch must be a positive int"),
    ({"seq_q": 8, "seq_kv": 8, "block_size": (4, 0)}, "block_size must be a positive int"),
    ({"seq_q": 8, "seq_kv": 8, "block_size": (4, 4, 4)}, "block_size must be"),
])
def test_bad_create_block_mask_arguments(kwargs, match):
    kwargs = {"mask_mod": lambda b, h, q, kv: q >= kv, **kwargs}
    with pytest.raises(ValueError, match=match):
        create_block_mask(kwargs.pop("mask_mod"), **kwargs)


def test_block_mask_for_another_call_is_refused():
    q, k, v, _ = random_qkv(2, 16, 16, 2, 2, 8)
    other_lengths = create_block_mask(lambda b, h, q, kv: q >= kv, seq_q=16, seq_kv=24,
                                      block_size=8)
    with pytest.raises(ValueError, match="block_mask was built for seq_q=16, seq_kv=24"):
        flex_reference(q, k, v, block_mask=other_lengths)
    ids = jnp.zeros((3, 16), jnp.int32)
    three = create_block_mask(lambda b, h, q, kv: ids[b, q] == ids[b, kv], batch=3,
                              seq_q=16, seq_kv=16, block_size=8)
    with pytest.raises(ValueError, match="batch=3, which does not broadcast"):
        flex_reference(q, k, v, block_mask=three)
    heads = create_block_mask(lambda b, h, q, kv: h <= q, heads=4, seq_q=16, seq_kv=16,
                              block_size=8)
    with pytest.raises(ValueError, match="heads=4, which does not broadcast"):
        flex_reference(q, k, v, block_mask=heads)
    with pytest.raises(ValueError, match=r"block_mask has block_size=\(8, 8\)"):
        heads.check(batch=2, heads=4, seq_q=16, seq_kv=16, block_size=(16, 16))
    with pytest.raises(ValueError, match="block_mask must be a BlockMask"):
        flex_reference(q, k, v, block_mask=np.ones((16, 16), bool))


@pytest.mark.parametrize("array, kwargs, match", [
    (np.ones((1, 1, 1, 8, 8), bool), {}, "rank <= 4"),
    ([[True]], {}, "rank <= 4"),
    (np.ones((8, 8), np.complex64), {}, "boolean, integer or floating"),
    (np.ones((8, 8), bool), {"seq_q": 16}, "does not broadcast to seq_q=16"),
    (np.ones((8, 8), bool), {"hidden_at_or_below": -1.0}, "floating bias only"),
    (np.ones((8, 8), np.float32), {"hidden_at_or_below": float("nan")}, "a number"),
])
def test_bad_dense_arguments(array, kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_mask_from_dense(array, 4, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"softcap": -1.0}, "softcap must be a positive"),
    ({"scale": 0.0}, "scale must be a positive"),
    ({"bias": np.zeros((3, 8, 8), np.float32)}, "bias shape"),
    ({"bias": np.zeros((8, 8), np.int32)}, "bias must be floating"),
    ({"mask": np.zeros((8, 8), np.float32)}, "mask must be a boolean or integer"),
    ({"mask_spec": MaskSpec(8, 9)}, "mask_spec must be a MaskSpec with seq_q=8, seq_kv=8"),
    ({"segment_ids": (np.zeros((2, 8), np.int32),)}, "segment_ids must be"),
    ({"segment_ids": (np.zeros((2, 8), np.int32), np.zeros((2, 7), np.int32))},
     "segment_ids must be integer arrays"),
    ({"bounds": (1, 2, 3)}, "bounds must be a RowBounds"),
])
def test_bad_reference_arguments(kwargs, match):
    q, k, v, _ = random_qkv(2, 8, 8, 2, 2, 8)
    with pytest.raises(ValueError, match=match):
        flex_reference(q, k, v, **kwargs)


@pytest.mark.parametrize("shapes, match", [
    (((2, 8, 4), (2, 8, 2, 8), (2, 8, 2, 8)), "q must have rank 4"),
    (((2, 8, 3, 8), (2, 8, 2, 8), (2, 8, 2, 8)), "multiple of kv heads"),
    (((2, 8, 4, 8), (2, 8, 2, 8), (2, 9, 2, 8)), "k and v must have the same shape"),
    (((2, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2, 8)), "q's batch and head_dim"),
])
def test_bad_qkv(shapes, match):
    q, k, v = (jnp.zeros(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        flex_reference(q, k, v)

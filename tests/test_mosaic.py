"""CPU tests of the Mosaic GPU backend that are particular to it.

The shared suite (tests/test_attention.py, tests/test_bias_mask.py, tests/test_properties.py)
runs every case on the Mosaic kernels in interpret mode with the smallest config (serial
schedule, two consumers, 64-row / 64-key tiles; see tests/support.py). Here:

* Numerics of the other schedules, in Mosaic GPU interpret mode (``interpret=True``; the
  same kernel, pipeline, barriers and masking as on the GPU, with P·V fed through SMEM):
  the overlapped schedule, three consumers, persistent CTAs, a 3-stage ring; and the
  producer/consumer protocols under the interpreter's race detector. Compared with the
  float64 oracle, through ``pallas_flash.attention(implementation="mosaic")``.
* The real GPU kernel, lowered for ``cuda`` on the CPU: register layouts, wgmma operand
  checks and the shared-memory budget of every default config.
* Config validation and the backend interface.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_flash
from pallas_flash import mosaic
from pallas_flash.compat import interpret_pallas_call
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig
from pallas_flash.mosaic import config as mosaic_config
from pallas_flash.mosaic.config import LogitRing
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

BF16, F16 = jnp.bfloat16, jnp.float16
# Small blocks so that the tiny test sequences still span several CTAs and K/V blocks.
# SMALL (the serial schedule) is the shared suite's config: here only as the base of the
# persistent variant and in the race checks.
SMALL = MosaicConfig(block_q=64, block_kv=64, num_stages=2)
OVERLAP = MosaicConfig(block_q=64, block_kv=64, num_stages=2, overlap=True)
THREE = MosaicConfig(block_q=64, block_kv=64, num_stages=2, overlap=True, num_consumers=3)


def _persistent(config: MosaicConfig) -> MosaicConfig:
    """``config`` with persistent CTAs: 2 in interpret mode, each looping over several
    tiles (an uneven number when the tile count is odd)."""
    return dataclasses.replace(config, persistent=True)


def _inputs(shape_q, shape_kv, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_q), dtype),
            jnp.asarray(rng.standard_normal(shape_kv), dtype),
            jnp.asarray(rng.standard_normal(shape_kv), dtype))


def _forward(q, k, v, segment_ids=None, *, mask: MaskSpec, scale: float, config, softcap=None,
             bias=None, attn_mask=None):
    """The Mosaic forward through ``pallas_flash.attention``: (out, lse [B, N, T])."""
    ids = {} if segment_ids is None else dict(q_segment_ids=segment_ids[0],
                                              kv_segment_ids=segment_ids[1])
    out, lse = pallas_flash.attention(
        q, k, v, bias, attn_mask, scale=scale, is_causal=mask.is_causal,
        causal_alignment=mask.causal_alignment, local_window_size=mask.window,
        logits_soft_cap=softcap, return_lse=True, implementation="mosaic",
        interpret=True, config=config, **ids)
    return out, jnp.transpose(lse, (0, 2, 1))


def _assert_matches_oracle(q, k, v, out, lse, mask: MaskSpec, scale: float, *,
                           segment_ids=None, softcap=None, bias=None, attn_mask=None):
    ref_out, ref_lse = attention_float64(q, k, v, scale=scale, mask=mask,
                                         segment_ids=segment_ids, softcap=softcap, bias=bias,
                                         attn_mask=attn_mask)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert out.shape == q.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    seen = ref_lse > EMPTY_ROW_LSE / 2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-3)
    # Rows that see no key: out exactly 0, lse exactly EMPTY_ROW_LSE.
    assert np.all(lse[~seen] == np.float32(EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)


# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask kwargs, config); the serial
# schedule's cases are the shared suite's (tests/test_attention.py).
CASES = {
    "head_dim_128_3_stages": (1, 128, 384, 2, 2, 128, BF16, {}, MosaicConfig(64, 128, 3)),
    # The overlapped schedule: its head (first visible block) and tail (last P·V) around
    # the loops, for rows that see every block, some blocks, or none.
    "overlap_dense_gqa": (2, 128, 192, 2, 1, 64, BF16, {}, OVERLAP),
    "overlap_causal_odd_gqa": (1, 200, 330, 4, 2, 64, F16, dict(is_causal=True), OVERLAP),
    "overlap_causal_more_queries_than_keys": (
        1, 300, 130, 2, 2, 64, BF16,
        dict(is_causal=True, causal_alignment="bottom_right"), OVERLAP),
    "overlap_window": (1, 256, 256, 2, 1, 64, BF16, dict(window=(50, 10)), OVERLAP),
    "overlap_window_rows_past_keys": (1, 320, 60, 1, 1, 64, BF16, dict(window=(10, 10)),
                                      OVERLAP),
    "overlap_head_dim_128_3_stages": (1, 128, 384, 2, 2, 128, BF16, dict(is_causal=True),
                                      MosaicConfig(64, 128, 3, overlap=True)),
    # Three consumers: the turn goes round 0 -> 1 -> 2 -> 0; CTAs of 192 rows.
    "three_consumers_dense_gqa": (1, 192, 256, 2, 1, 64, BF16, {}, THREE),
    "three_consumers_causal_odd": (1, 250, 330, 2, 2, 64, F16, dict(is_causal=True), THREE),
    "three_consumers_window_rows_past_keys": (1, 320, 60, 1, 1, 64, BF16,
                                              dict(window=(10, 10)), THREE),
    # Persistent CTAs: the K/V ring, Q prefetch, O tile and turns carry over tiles of
    # different lengths (causal), of rows that see nothing, and over batch/head changes.
    "persistent_dense_gqa": (2, 128, 192, 3, 1, 64, BF16, {}, _persistent(SMALL)),
    "persistent_causal_odd_gqa": (1, 330, 330, 4, 2, 64, F16, dict(is_causal=True),
                                  _persistent(SMALL)),
    "persistent_overlap_causal_more_queries_than_keys": (
        1, 300, 130, 3, 1, 64, BF16, dict(is_causal=True, causal_alignment="bottom_right"),
        _persistent(OVERLAP)),
    "persistent_three_consumers_window": (2, 250, 330, 2, 2, 64, F16, dict(window=(40, 20)),
                                          _persistent(THREE)),
    "persistent_head_dim_128": (1, 200, 300, 3, 3, 128, BF16, dict(is_causal=True),
                                _persistent(MosaicConfig(64, 128, 2, overlap=True))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpret_matches_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask_kwargs, config = CASES[case]
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed=len(case))
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = 0.7 / head_dim ** 0.5
    out, lse = _forward(q, k, v, mask=mask, scale=scale, config=config)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    _assert_matches_oracle(q, k, v, out, lse, mask, scale)


@pytest.mark.parametrize("config", [SMALL, OVERLAP, THREE, _persistent(SMALL),
                                    _persistent(THREE)],
                         ids=["serial", "overlap", "three", "persistent", "persistent_three"])
def test_interpret_no_races(config):
    """The producer/consumer protocol under the interpreter's vector-clock race detector."""
    q, k, v = _inputs((1, 128, 2, 64), (1, 192, 1, 64), BF16, seed=7)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        out, lse = _forward(q, k, v, mask=mask, scale=0.125, config=config)
        out.block_until_ready()
    assert not interpret_pallas_call.get_races().races_found
    _assert_matches_oracle(q, k, v, out, lse, mask, 0.125)


# --- merging into a running result (ring attention's steps) ----------------------------

_FORWARD = importlib.import_module("pallas_flash.mosaic.forward")


@pytest.mark.parametrize(("config", "mask_kwargs"), [
    (SMALL, {}),
    (OVERLAP, dict(is_causal=True)),
    # Keys from global position 40 on, window (10, 5): rows 0..34 see no key of either
    # half, so they must come out as 0 with lse EMPTY_ROW_LSE after the merge.
    (_persistent(OVERLAP), dict(window=(10, 5), kv_start=40)),
], ids=["serial_dense", "overlap_causal", "persistent_window_empty_rows"])
def test_interpret_merges_into_a_running_result(config, mask_kwargs):
    """``into=(out, lse)``: the float64 attention over the first half of the keys, merged
    in the epilogue with the kernel's own second half, is attention over all keys."""
    batch, seq_q, half, heads, kv_heads, head_dim = 1, 200, 120, 2, 1, 64
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, 2 * half, kv_heads, head_dim),
                      BF16, seed=11)
    scale = head_dim ** -0.5
    whole = MaskSpec(seq_q=seq_q, seq_kv=2 * half, **mask_kwargs)
    first = dataclasses.replace(whole, seq_kv=half)
    second = dataclasses.replace(first, kv_start=first.kv_start + half)
    prev_out, prev_lse = attention_float64(q, k[:, :half], v[:, :half], scale=scale,
                                           mask=first)
    into = (jnp.asarray(prev_out, jnp.float32), jnp.asarray(prev_lse, jnp.float32))
    out, lse = _FORWARD.forward(q, k[:, half:], v[:, half:], None, mask=second,
                                scale=scale, config=config, interpret=True, into=into)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    _assert_matches_oracle(q, k, v, out, lse, whole, scale)
    if "window" in mask_kwargs:
        assert (np.asarray(lse) == np.float32(EMPTY_ROW_LSE)).sum() == batch * heads * 35


@pytest.mark.parametrize(("into", "match"), [
    ("out", "into must be a pair"),
    ((jnp.zeros((1, 64, 1, 64), jnp.bfloat16), jnp.zeros((1, 1, 64))), "into's out"),
    ((jnp.zeros((1, 64, 1, 64)), jnp.zeros((1, 64, 1))), "into's lse"),
])
def test_into_is_validated(into, match):
    q = jnp.zeros((1, 64, 1, 64), BF16)
    with pytest.raises(ValueError, match=match):
        _FORWARD.forward(q, q, q, None, mask=MaskSpec(seq_q=64, seq_kv=64), scale=1.0,
                         config=SMALL, interpret=True, into=into)


# --- segment ids and soft-capping -------------------------------------------------------


def _doc_ids(batch: int, seq: int, starts) -> jax.Array:
    """[batch, seq] int32 ids of packed documents: the id goes up by one at each start."""
    ids = np.searchsorted(np.asarray(starts), np.arange(seq), side="right")
    return jnp.asarray(np.broadcast_to(ids, (batch, seq)), jnp.int32)


def _shuffled_ids(seq: int, seed: int) -> jax.Array:
    """[1, seq] ids in no order: every tile's id range meets most others (wide spans)."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, 3, (1, seq)), jnp.int32)


# (batch, seq_q, seq_kv, heads, kv_heads, dtype, mask kwargs, softcap, config)
VARIANT_CASES = {
    # Three documents, boundaries off the 64-row tiles; GQA.
    "segments_causal_softcap_overlap": (1, 256, 256, 2, 1, F16, dict(is_causal=True), 20.0,
                                        OVERLAP),
    # Window + soft-cap + segments, padded keys (230 -> 256), queries of a document that
    # has no keys (rows 150..199: empty), and a second batch row with unordered ids.
    "segments_softcap_window_padded_persistent": (2, 200, 230, 2, 2, BF16,
                                                  dict(window=(40, 10)), 20.0,
                                                  _persistent(OVERLAP)),
}


def _variant_ids(case, batch, seq_q, seq_kv):
    if case.startswith("segments_softcap_window_padded"):
        q_ids = _doc_ids(batch, seq_q, [60, 150]) * 2  # 0, 2, 4: 4 has no keys
        kv_ids = _doc_ids(batch, seq_kv, [50, 140])  # 0, 1, 2
        return (q_ids.at[1].set(_shuffled_ids(seq_q, 1)[0]),
                kv_ids.at[1].set(_shuffled_ids(seq_kv, 2)[0]))
    return _doc_ids(batch, seq_q, [70, 150]), _doc_ids(batch, seq_kv, [70, 150])


@pytest.mark.parametrize("case", sorted(VARIANT_CASES))
def test_interpret_variants_match_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, dtype, mask_kwargs, softcap, config = (
        VARIANT_CASES[case])
    head_dim = 64
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed=len(case))
    if softcap is not None:  # logits of several softcaps, where tanh bends them
        q = q * 8
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    segment_ids = _variant_ids(case, batch, seq_q, seq_kv)
    scale = head_dim ** -0.5
    out, lse = _forward(q, k, v, segment_ids, mask=mask, scale=scale, config=config,
                        softcap=softcap)
    _assert_matches_oracle(q, k, v, out, lse, mask, scale, segment_ids=segment_ids,
                           softcap=softcap)
    if case.startswith("segments_softcap_window_padded"):
        assert np.all(np.asarray(out[0, 150:]) == 0)  # the document without keys


@pytest.mark.parametrize("config", [OVERLAP, THREE], ids=["overlap", "three"])
def test_segment_tiles_outside_the_span_are_never_read(config):
    """K/V of a document no query belongs to are NaN: a kernel that loaded them into a
    softmax would give NaN (0 · NaN); skipped tiles leave no trace. Also: a consumer whose
    rows meet no key tile while the other consumer's do (rows 64..127 of CTA 0)."""
    seq = 256
    q, k, v = _inputs((1, seq, 2, 64), (1, seq, 1, 64), BF16, seed=11)
    q_ids = _doc_ids(1, seq, [64, 128])                     # 0 | 1 | 2, 2
    kv_ids = _doc_ids(1, seq, [64, 128]) * 3                # 0 | 3 (no query) | 6, 6
    kv_ids = kv_ids.at[:, 128:].set(2)
    k, v = k.at[:, 64:128].set(jnp.nan), v.at[:, 64:128].set(jnp.nan)
    mask = MaskSpec(seq_q=seq, seq_kv=seq)
    out, lse = _forward(q, k, v, (q_ids, kv_ids), mask=mask, scale=0.125, config=config)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert np.all(np.asarray(out[:, 64:128]) == 0)          # document 1: no keys
    assert np.all(np.asarray(lse[:, :, 64:128]) == np.float32(EMPTY_ROW_LSE))
    _assert_matches_oracle(q, k.at[:, 64:128].set(0), v.at[:, 64:128].set(0), out, lse,
                           mask, 0.125, segment_ids=(q_ids, kv_ids))


@pytest.mark.parametrize("config", [SMALL, OVERLAP], ids=["serial", "overlap"])
def test_interpret_segments_no_races(config):
    """The key ids' SMEM ring (on K's barrier, read before K's slot is freed, fenced before
    the producer refills it) under the race detector."""
    q, k, v = _inputs((1, 128, 1, 64), (1, 192, 1, 64), BF16, seed=5)
    ids = (_doc_ids(1, 128, [40, 100]), _doc_ids(1, 192, [40, 100]))
    mask = MaskSpec(seq_q=128, seq_kv=192)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        out, lse = _forward(q, k, v, ids, mask=mask, scale=0.125, config=config)
        out.block_until_ready()
    assert not interpret_pallas_call.get_races().races_found
    _assert_matches_oracle(q, k, v, out, lse, mask, 0.125, segment_ids=ids)


# --- bias and mask arrays --------------------------------------------------------------
# Shapes as strings over B N T S (batch, heads, seq_q, seq_kv), 1 for a broadcast dim.


def _shape(spec: str, sizes: dict) -> tuple[int, ...]:
    return tuple(sizes.get(c, 1) for c in spec)


def _logit_arrays(bias_spec, mask_spec, sizes, seed, bias_dtype=jnp.float32):
    """A N(0, 2²) bias and a mask keeping ~70 % of the pairs, fresh per case (None for
    None)."""
    rng = np.random.default_rng(seed)
    bias = attn_mask = None
    if bias_spec is not None:
        bias = jnp.asarray(2 * rng.standard_normal(_shape(bias_spec, sizes)), bias_dtype)
    if mask_spec is not None:
        attn_mask = jnp.asarray(rng.random(_shape(mask_spec, sizes)) < 0.7)
    return bias, attn_mask


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


# (batch, seq_q, seq_kv, heads, kv_heads, dtype, bias, mask, mask kwargs, config). Bias tiles
# ride in a ring next to K ("tile": ..TS, "keys": ..1S), per-row ones are loaded once (..T1,
# and 1111 expanded to ..T1); a mask is int8 unless it broadcasts to the bias's shape
# (then folded into it as -inf).
LOGIT_CASES = {
    "bias_11TS_overlap": (1, 128, 192, 2, 1, F16, "11TS", None, {}, OVERLAP),
    "bias_B11S_three": (2, 192, 128, 2, 2, BF16, "B11S", None, {}, THREE),
    "bias_1111_overlap": (2, 128, 128, 2, 1, BF16, "1111", None, {}, OVERLAP),
    "mask_B11S_overlap_odd": (2, 100, 130, 2, 1, F16, None, "B11S", {}, OVERLAP),
    "mask_1NT1_three": (1, 192, 128, 2, 1, BF16, None, "1NT1", {}, THREE),
    # Two rings (tile bias, key-row mask), causal, GQA, odd lengths.
    "bias_mask_causal_gqa_odd_overlap": (2, 100, 170, 2, 1, BF16, "B1TS", "1N1S",
                                         dict(is_causal=True), OVERLAP),
    "bias_mask_window_three": (1, 200, 150, 2, 1, BF16, "B11S", "11TS", dict(window=(60, 20)),
                               THREE),
    # Persistent CTAs: the rings and per-row reads follow each tile's batch and head.
    "bias_mask_causal_gqa_odd_persistent": (2, 100, 170, 2, 1, BF16, "B1TS", "1N1S",
                                            dict(is_causal=True), _persistent(OVERLAP)),
    "bias_BNT1_persistent_three": (2, 192, 128, 2, 2, BF16, "BNT1", None, {},
                                   _persistent(THREE)),
}


@pytest.mark.parametrize("case", sorted(LOGIT_CASES))
def test_interpret_bias_mask_match_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, dtype, bias_spec, mask_spec, mask_kwargs, config = (
        LOGIT_CASES[case])
    head_dim = 64
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed=_seed(case))
    sizes = dict(B=batch, N=heads, T=seq_q, S=seq_kv)
    bias, attn_mask = _logit_arrays(bias_spec, mask_spec, sizes, _seed(case) + 1)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = head_dim ** -0.5
    out, lse = _forward(q, k, v, mask=mask, scale=scale, config=config, bias=bias,
                        attn_mask=attn_mask)
    _assert_matches_oracle(q, k, v, out, lse, mask, scale, bias=bias, attn_mask=attn_mask)


@pytest.mark.parametrize(("config", "folded"), [
    (OVERLAP, True), (THREE, False), (THREE, True)],
    ids=["overlap_folded", "three_int8_mask", "three_folded"])
def test_interpret_fully_masked_rows(config, folded):
    """Rows the mask hides entirely give out 0 and lse EMPTY_ROW_LSE, never NaN: through the
    int8 mask (every block masked), or folded into a bias as -inf, where the unmasked
    blocks' softmax must also survive rows that have seen only -inf."""
    seq = 192
    q, k, v = _inputs((1, seq, 2, 64), (1, seq, 1, 64), BF16, seed=_seed(f"rows{folded}"))
    keep = np.ones((1, 2, seq, seq), bool)
    keep[:, 0, 10:80] = False           # head 0: rows over two consumers' tiles
    keep[:, 1, 150:] = False            # head 1: the last rows
    keep[:, 1, :, 64:128] = False       # and a whole key block for everyone
    bias = None
    if folded:
        bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, seq, seq)),
                           jnp.float32)
    mask = MaskSpec(seq_q=seq, seq_kv=seq)
    out, lse = _forward(q, k, v, mask=mask, scale=0.125, config=config, bias=bias,
                        attn_mask=jnp.asarray(keep))
    assert np.all(np.asarray(out[0, 10:80, 0]) == 0)
    assert np.all(np.asarray(lse[0, 1, 150:]) == np.float32(EMPTY_ROW_LSE))
    _assert_matches_oracle(q, k, v, out, lse, mask, 0.125, bias=bias, attn_mask=keep)


@pytest.mark.parametrize("config", [SMALL, OVERLAP], ids=["serial", "overlap"])
def test_interpret_bias_mask_no_races(config):
    """A bias tile ring and a mask key-row ring on K's barrier (read before K's slot is
    freed, fenced before the producer refills it) under the race detector."""
    q, k, v = _inputs((1, 128, 2, 64), (1, 192, 1, 64), BF16, seed=13)
    sizes = dict(B=1, N=2, T=128, S=192)
    bias, attn_mask = _logit_arrays("1NTS", "B11S", sizes, seed=14)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        out, lse = _forward(q, k, v, mask=mask, scale=0.125, config=config, bias=bias,
                            attn_mask=attn_mask)
        out.block_until_ready()
    assert not interpret_pallas_call.get_races().races_found
    _assert_matches_oracle(q, k, v, out, lse, mask, 0.125, bias=bias, attn_mask=attn_mask)


# --- the GPU kernel, lowered for CUDA on the CPU ----------------------------------------


def _lower_for_cuda(shape_q, shape_kv, dtype, mask: MaskSpec, config: MosaicConfig, *,
                    segments: bool = False, softcap: float | None = None,
                    bias: str | None = None, bias_dtype=jnp.float32, attn_mask: str | None = None):
    """``bias`` / ``attn_mask``: None or the array's shape spec over ``BNTS1``."""
    def f(q, k, v, q_ids, kv_ids, bias, attn_mask):
        return mosaic.KERNELS.forward(
            q, k, v, (q_ids, kv_ids) if segments else None, mask=mask, scale=0.1,
            config=config, interpret=False, softcap=softcap, bias=bias, attn_mask=attn_mask)
    sizes = dict(B=shape_q[0], N=shape_q[2], T=shape_q[1], S=shape_kv[1])
    args = (jax.ShapeDtypeStruct(shape_q, dtype), jax.ShapeDtypeStruct(shape_kv, dtype),
            jax.ShapeDtypeStruct(shape_kv, dtype),
            jax.ShapeDtypeStruct(shape_q[:2], jnp.int32),
            jax.ShapeDtypeStruct(shape_kv[:2], jnp.int32),
            None if bias is None else jax.ShapeDtypeStruct(_shape(bias, sizes), bias_dtype),
            None if attn_mask is None else jax.ShapeDtypeStruct(_shape(attn_mask, sizes),
                                                                jnp.bool_))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


# Every head-dim class with every (causal, overlap) pair; the two 16-bit dtypes (same
# layouts, another wgmma type) alternate over those pairs, so each head dim, causal and
# overlap value meets both.
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize(("dtype", "causal", "overlap"), [
    (BF16, False, False), (F16, False, True), (F16, True, False), (BF16, True, True)],
    ids=["bfloat16-full-serial", "float16-full-overlap", "float16-causal-serial",
         "bfloat16-causal-overlap"])
def test_default_configs_lower_for_cuda(head_dim, dtype, causal, overlap):
    """Layout inference, wgmma operand checks and the 227 KiB SMEM budget, per shape class."""
    shape_q, shape_kv = (2, 1024, 8, head_dim), (2, 1024, 2, head_dim)
    mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=causal)
    config = mosaic.default_config(shape_q, shape_kv, dtype, mask)
    config = dataclasses.replace(config, overlap=overlap)
    assert config.smem_bytes(head_dim) <= mosaic_config.SMEM_BUDGET
    _lower_for_cuda(shape_q, shape_kv, dtype, mask, config)


@pytest.mark.parametrize("block_kv", [64, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers_lower_for_cuda(block_kv, causal):
    """Four warpgroups (3 x 160 + 32 registers), CTAs of 192 rows; with segment ids when
    causal (every block masked)."""
    shape = (2, 1000, 4, 64)
    mask = MaskSpec(seq_q=1000, seq_kv=1000, is_causal=causal)
    config = MosaicConfig(64, block_kv, 2, overlap=True, num_consumers=3)
    _lower_for_cuda(shape, shape, BF16, mask, config, segments=causal)


@pytest.mark.parametrize(("head_dim", "config"), [
    (64, MosaicConfig(128, 128, 2, persistent=True)),
    (64, MosaicConfig(64, 128, 2, overlap=True, num_consumers=3, persistent=True)),
    (128, MosaicConfig(64, 128, 2, overlap=True, persistent=True)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_lower_for_cuda(head_dim, config, causal):
    """Persistent CTAs (grid = SM count, a loop over tiles, an O tile of their own), with
    segment ids when causal (the tile's spans are read inside the loop)."""
    shape_q, shape_kv = (2, 1000, 8, head_dim), (2, 900, 2, head_dim)
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=causal)
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config, segments=causal)


@pytest.mark.parametrize("overlap", [False, True])
def test_masked_odd_shapes_lower_for_cuda(overlap):
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=True, causal_alignment="bottom_right",
                    window=(100, 0))
    _lower_for_cuda((1, 1000, 4, 80), (1, 900, 2, 80), F16, mask,
                    MosaicConfig(64, 128, 2, overlap=overlap))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("overlap", [False, True])
def test_variants_lower_for_cuda(head_dim, overlap):
    """Segment ids (ids ring on K's barrier, GMEM span loads) with soft-capping (tanh),
    causal and not, at each head-dim class's default config."""
    causal = head_dim != 128
    shape_q, shape_kv = (2, 1000, 8, head_dim), (2, 900, 2, head_dim)
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=causal)
    config = mosaic.default_config(shape_q, shape_kv, BF16, mask)
    config = dataclasses.replace(config, overlap=overlap)
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config, segments=True, softcap=30.0)
    _lower_for_cuda(shape_q, shape_kv, F16, mask, config, softcap=30.0)


@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize(("bias", "bias_dtype", "attn_mask"), [
    ("1NTS", jnp.float32, "B11S"),   # float32 tile ring + int8 key-row ring
    ("BNT1", BF16, "B1TS"),          # per-row bias (GMEM, once) + int8 tile ring
    ("B11S", F16, "1NT1"),           # 16-bit key-row ring + int8 per-row mask
    ("B1TS", jnp.float32, "B11S"),   # the mask folded into the bias
])
def test_bias_mask_lower_for_cuda(head_dim, bias, bias_dtype, attn_mask):
    """Every kind of bias / mask operand (WGMMA-layout loads of swizzled f32 / 16-bit / int8
    tiles, key rows, row columns) at each head-dim class's default config, shrunk to fit:
    the serial schedule at head_dim 64, the overlapped one above."""
    shape_q, shape_kv = (2, 1000, 4, head_dim), (2, 900, 2, head_dim)
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=True)
    config = mosaic.default_config(shape_q, shape_kv, BF16, mask)
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config, bias=bias, bias_dtype=bias_dtype,
                    attn_mask=attn_mask)


@pytest.mark.parametrize("block_kv", [64, 128])
def test_bias_mask_three_consumers_and_segments_lower_for_cuda(block_kv):
    """Three consumers (a tile per consumer, 3 copies per block on K's barrier), with segment
    ids and a soft-cap alongside a bias tile and an int8 mask tile."""
    shape = (2, 1000, 4, 64)
    mask = MaskSpec(seq_q=1000, seq_kv=1000, is_causal=True)
    config = MosaicConfig(64, block_kv, 2, overlap=True, num_consumers=3)
    _lower_for_cuda(shape, shape, F16, mask, config, segments=True, softcap=30.0, bias="BNTS",
                    attn_mask="1NTS")


@pytest.mark.parametrize(("head_dim", "config", "segments", "logits"), [
    (128, MosaicConfig(64, 128, 3), False, None),   # fits, 1.9 KiB to spare
    (128, MosaicConfig(64, 128, 3), True, None),    # fits: the key ids' ring takes 1 KiB
    (128, MosaicConfig(64, 128, 4), False, None),   # does not fit
    (256, MosaicConfig(64, 128, 2), False, None),   # does not fit: why head_dim 256 needs 64
    (256, MosaicConfig(64, 128, 2), True, None),
    (256, MosaicConfig(64, 128, 2, overlap=True), False, None),  # a turn barrier per consumer
    (64, MosaicConfig(64, 256, 4, overlap=True, num_consumers=3), True, None),
    (128, MosaicConfig(64, 128, 2, overlap=True, persistent=True), False, None),  # + O tile
    (128, MosaicConfig(64, 128, 3, persistent=True), False, None),  # does not fit
    # (bias, bias dtype, mask): a float32 tile ring and an int8 key-row ring; fits.
    (128, MosaicConfig(64, 64, 2), False, ("1NTS", jnp.float32, "B11S")),
    # ... does not fit at 128 keys (fit_logit_rings would shrink it; here it must not).
    (128, MosaicConfig(64, 128, 2), True, ("1NTS", jnp.float32, "B11S")),
    # an int8 tile per consumer (64-byte swizzle) and a 16-bit key-row ring.
    (192, MosaicConfig(64, 64, 2, overlap=True, num_consumers=3), False, ("B11S", BF16, "1NTS")),
])
def test_smem_accounting_matches_lowering(head_dim, config, segments, logits, monkeypatch):
    """config.smem_bytes is exactly what Mosaic GPU allocates (its error message says)."""
    mask = MaskSpec(seq_q=1024, seq_kv=1024)
    shape = (2, 1024, 2, head_dim)  # batch 2: a B11S mask must not fold into a 1NTS bias
    arrays, rings = {}, ()
    if logits is not None:
        bias, bias_dtype, attn_mask = logits
        arrays = dict(bias=bias, bias_dtype=bias_dtype, attn_mask=attn_mask)
        tile = LogitRing(per_query=True, itemsize=jnp.dtype(bias_dtype).itemsize)
        keys = LogitRing(per_query=False, itemsize=jnp.dtype(bias_dtype).itemsize)
        mask_tile, mask_keys = LogitRing(True, 1), LogitRing(False, 1)
        rings = {"1NTS": (tile, mask_keys), "B11S": (keys, mask_tile)}[bias]
        # The config under test, not the one the forward would shrink it to.
        forward_module = importlib.import_module("pallas_flash.mosaic.forward")
        monkeypatch.setattr(forward_module, "fit_logit_rings", lambda config, *_, **__: config)
    need = config.smem_bytes(head_dim, segments=segments, logit_rings=rings)
    lower = functools.partial(_lower_for_cuda, shape, shape, BF16, mask, config,
                                segments=segments, **arrays)
    if need <= mosaic_config.SMEM_BUDGET:
        lower()
        return
    with pytest.raises(ValueError, match="shared memory"):
        lower()
    monkeypatch.setattr(MosaicConfig, "check_fits", lambda *_, **__: None)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        lower()
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


# --- config and interface -----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(block_q=32), "block_q"), (dict(block_q=192), "block_q"),
    (dict(block_kv=96), "block_kv"), (dict(block_kv=512), "block_kv"),
    (dict(num_stages=1), "num_stages"), (dict(num_stages=5), "num_stages"),
    (dict(num_consumers=4), "num_consumers"),
    (dict(num_consumers=3, overlap=False), "num_consumers=3 needs"),
    (dict(num_consumers=3, overlap=True, block_q=128), "num_consumers=3 needs"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MosaicConfig(**kwargs)


def test_config_is_frozen_and_hashable():
    config = MosaicConfig()
    with pytest.raises(AttributeError):
        config.block_q = 128
    assert hash(config) == hash(MosaicConfig())


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_default_config_fits(head_dim, causal):
    mask = MaskSpec(seq_q=4096, seq_kv=4096, is_causal=causal)
    config = mosaic.default_config((1, 4096, 8, head_dim), (1, 4096, 8, head_dim), BF16, mask)
    config.check_fits(mosaic_config.padded_head_dim(head_dim))
    if head_dim > 128:
        assert config.block_kv == 64


@pytest.mark.parametrize("block_kv", [64, 128, 192, 256])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("per_query", [False, True])
def test_logit_ring_slots_are_tma_aligned(block_kv, itemsize, per_query):
    """Every slot of a bias / mask ring starts at a 128-byte boundary, where TMA can write
    (an int8 row of 64 keys in 64-byte slots faulted on the H200: misaligned address)."""
    config = MosaicConfig(64, block_kv, 2)
    ring = LogitRing(per_query=per_query, itemsize=itemsize)
    shape = ring.shape(config)
    slot_bytes = math.prod(shape[1:]) * itemsize
    assert slot_bytes % mosaic_config.TMA_SMEM_ALIGNMENT == 0
    assert shape[-1] == block_kv and ring.nbytes(config) == shape[0] * slot_bytes
    if not per_query:  # no more padding rows than alignment needs
        assert slot_bytes == math.lcm(mosaic_config.TMA_SMEM_ALIGNMENT, block_kv * itemsize)


@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [1024, 4096, 16384])
def test_fit_logit_rings(head_dim, causal, seq):
    """The default configs, shrunk for the largest rings (a float32 tile, an int8 tile and
    the key ids), fit; a per-query tile takes 64-row warpgroups; key rows alone (small)
    leave the default as it is."""
    mask = MaskSpec(seq_q=seq, seq_kv=seq, is_causal=causal)
    default = mosaic.default_config((1, seq, 8, head_dim), (1, seq, 8, head_dim), BF16, mask)
    worst = (LogitRing(True, 4), LogitRing(True, 1))
    config = mosaic_config.fit_logit_rings(default, head_dim, 2, segments=True,
                                           logit_rings=worst)
    config.check_fits(head_dim, segments=True, logit_rings=worst)
    assert config.block_q == 64 and config.num_consumers == default.num_consumers
    keys = (LogitRing(False, 4),)
    assert mosaic_config.fit_logit_rings(default, head_dim, 2, segments=False,
                                         logit_rings=keys) == default
    assert mosaic_config.fit_logit_rings(default, head_dim, 2, segments=False,
                                         logit_rings=()) == default


def test_fit_logit_rings_gives_up_persistence_before_block_sizes():
    """A persistent CTA's O tile is the first thing a bias ring displaces."""
    persistent = MosaicConfig(64, 128, 2, overlap=True, persistent=True)
    tile = (LogitRing(True, 4),)
    assert mosaic_config.fit_logit_rings(persistent, 128, 2, segments=False,
                                         logit_rings=tile) == MosaicConfig(64, 64, 2,
                                                                           overlap=True)
    small = MosaicConfig(128, 128, 2, persistent=True)
    keys = (LogitRing(False, 2),)
    assert mosaic_config.fit_logit_rings(small, 64, 2, segments=False,
                                         logit_rings=keys) == small


def test_unsupported_reasons():
    mask = MaskSpec(seq_q=128, seq_kv=128)
    shape = (1, 128, 2, 64)
    assert mosaic.unsupported(shape, shape, BF16, mask, False) is None
    assert mosaic.unsupported(shape, shape, BF16, mask, True, has_bias=True,
                              has_mask=True) is None
    assert mosaic.unsupported((1, 128, 2, 192), shape, F16, mask, False, has_bias=True) is None
    for kwargs in (dict(has_bias=True), dict(has_mask=True)):
        assert "192" in mosaic.unsupported((1, 128, 2, 200), shape, BF16, mask, False,
                                           **kwargs)
        # Bias / mask arrays up to head_dim 192: at 256 the K/V rings leave no shared
        # memory for a bias tile.
        for head_dim, supported in ((64, True), (192, True), (256, False)):
            q_shape = (1, 128, 2, head_dim)
            reason = mosaic.unsupported(q_shape, q_shape, BF16, mask, False, **kwargs)
            assert (reason is None) == supported, (head_dim, kwargs, reason)
    assert mosaic.unsupported(shape, shape, F16, mask, False) is None
    assert mosaic.unsupported(shape, shape, BF16, mask, True, softcap=30.0) is None
    assert "float32" in mosaic.unsupported(shape, shape, jnp.float32, mask, False)
    assert "float32" in mosaic.unsupported(shape, shape, jnp.float32, mask, True, softcap=5.0)
    assert "head_dim" in mosaic.unsupported((1, 128, 2, 320), shape, BF16, mask, False)
    assert mosaic.KERNELS.name == "mosaic"


def test_api_rejects_unsupported_when_forced():
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="mosaic"):
        pallas_flash.attention(q, q, q, implementation="mosaic", interpret=True)
    q = jnp.zeros((1, 64, 2, 256), BF16)
    with pytest.raises(ValueError, match=r"implementation='mosaic' cannot run this call: bias.*"
                                         r"head_dim <= 192"):
        pallas_flash.attention(q, q, q, jnp.zeros((64, 64)), implementation="mosaic",
                               interpret=True)

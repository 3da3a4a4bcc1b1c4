"""Per-sequence row bounds (``pallas_flash.contract.RowBounds``) in the Mosaic GPU kernels.

The kernels run in Mosaic GPU interpret mode on small shapes and are compared, element by
element, with the float64 oracle given the equivalent dense mask (rows ``q < q_end``, keys
``kv_start <= k < kv_end``): with causal, window, segment ids, GQA, the overlapped and
three-consumer schedules and persistent CTAs, and sequences with ``q_end`` or ``kv_end``
0; the backward's dq / dk / dv too, from both dQ modes. Hidden K/V rows and padding query
rows hold NaN, which must not reach the outputs. The bounded forward also lowers for
``cuda`` (layouts of the bound masks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import fresh_rng, rel_err

from pallas_flash import fp8, mosaic
from pallas_flash.contract import RowBounds
from pallas_flash.fp8_format import E4M3
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, forward_fp8
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

BF16 = jnp.bfloat16
SERIAL = MosaicConfig(block_q=64, block_kv=64, num_stages=2)
OVERLAP = dataclasses.replace(SERIAL, overlap=True)
THREE = dataclasses.replace(OVERLAP, num_consumers=3)


def _bounds(batch: int, seq_q: int, seq_kv: int, rng) -> RowBounds:
    """Random bounds; sequence 1 has no real query, sequence 2 no visible key, and the
    others cut their blocks anywhere (not on block edges)."""
    q_end = rng.integers(1, seq_q + 1, batch)
    kv_start = rng.integers(0, seq_kv // 2, batch)
    kv_end = rng.integers(kv_start + 1, seq_kv + 1)
    q_end[1] = 0
    kv_start[2] = kv_end[2] = rng.integers(0, seq_kv)
    return RowBounds(*(jnp.asarray(x, jnp.int32) for x in (q_end, kv_start, kv_end)))


def _dense_mask(bounds: RowBounds, seq_q: int, seq_kv: int) -> np.ndarray:
    """The bounds as the oracle's ``attn_mask``: [batch, 1, seq_q, seq_kv] bool."""
    q_end, kv_start, kv_end = (np.asarray(x)[:, None, None, None] for x in bounds)
    rows = np.arange(seq_q)[None, None, :, None]
    keys = np.arange(seq_kv)[None, None, None, :]
    return (rows < q_end) & (keys >= kv_start) & (keys < kv_end)


def _poisoned(q, k, v, bounds: RowBounds):
    """NaN in the hidden K/V rows and the padding query rows."""
    q_end = np.asarray(bounds.q_end)[:, None]
    real_rows = np.arange(q.shape[1])[None] < q_end
    kv_start, kv_end = (np.asarray(x)[:, None] for x in bounds[1:])
    keys = np.arange(k.shape[1])[None]
    visible_keys = (keys >= kv_start) & (keys < kv_end)

    def poison(x, keep):
        return jnp.where(jnp.asarray(keep)[:, :, None, None], x, jnp.nan).astype(x.dtype)
    return poison(q, real_rows), poison(k, visible_keys), poison(v, visible_keys)


def _check(out, lse, q, k, v, bounds, mask: MaskSpec, scale, *, segment_ids=None,
           out_tol=2e-2, lse_atol=2e-3):
    """Every element against the oracle (clean inputs, dense mask); rows that see no key
    (padding rows among them) exactly out 0 and lse EMPTY_ROW_LSE."""
    ref_out, ref_lse = attention_float64(
        q, k, v, scale=scale, mask=mask, segment_ids=segment_ids,
        attn_mask=_dense_mask(bounds, q.shape[1], k.shape[1]))
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, atol=out_tol, rtol=out_tol)
    # A masking error moves many outputs; rounding moves a few far (FP8): the mean is tight.
    assert np.mean(np.abs(out - ref_out)) < out_tol / 8
    seen = ref_lse > EMPTY_ROW_LSE / 2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=lse_atol)
    assert np.mean(np.abs(lse[seen] - ref_lse[seen])) < lse_atol / 8
    assert np.all(lse[~seen] == np.float32(EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)
    q_end = np.asarray(bounds.q_end)
    assert (~seen).any(axis=(1, 2))[q_end == 0].all()


# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, mask kwargs, segments, config)
CASES = {
    "dense_gqa_serial": (4, 150, 230, 2, 1, 64, {}, False, SERIAL),
    "causal_overlap": (4, 200, 200, 2, 2, 64, dict(is_causal=True), False, OVERLAP),
    "window_three_consumers": (4, 200, 260, 1, 1, 64, dict(window=(70, 30)), False, THREE),
    "segments_gqa_overlap": (4, 130, 190, 2, 1, 64, {}, True, OVERLAP),
    "persistent_causal_bottom_right_head_dim_128": (
        4, 170, 250, 2, 1, 128, dict(is_causal=True, causal_alignment="bottom_right"), False,
        dataclasses.replace(SERIAL, persistent=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, mask_kwargs, segments, config = CASES[case]
    rng = fresh_rng()
    q = jnp.asarray(rng.standard_normal((batch, seq_q, heads, head_dim)), BF16)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_kv, kv_heads, head_dim)), BF16)
            for _ in range(2))
    bounds = _bounds(batch, seq_q, seq_kv, rng)
    segment_ids = None
    if segments:  # documents of random lengths, the same on both sides
        ids = jnp.asarray(np.cumsum(rng.random((batch, max(seq_q, seq_kv))) < 0.02, axis=1),
                          jnp.int32)
        segment_ids = (ids[:, :seq_q], ids[:, :seq_kv])
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = head_dim ** -0.5
    out, lse = mosaic.KERNELS.forward(*_poisoned(q, k, v, bounds), segment_ids, mask=mask,
                                      scale=scale, config=config, interpret=True,
                                      bounds=bounds)
    _check(out, lse, q, k, v, bounds, mask, scale, segment_ids=segment_ids)


# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, mask kwargs, segments, deterministic)
BACKWARD_CASES = {
    "dense_gqa_fused_dq": (4, 150, 230, 2, 1, 64, {}, False, False),
    "causal_deterministic_dq": (4, 200, 200, 2, 2, 64, dict(is_causal=True), False, True),
    "window_segments_gqa": (4, 130, 190, 2, 1, 64, dict(window=(60, 20)), True, False),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_backward_matches_oracle(case):
    """dq, dk, dv against the oracle's, every element; exactly 0 for padding rows (dq)
    and hidden keys (dk, dv)."""
    (batch, seq_q, seq_kv, heads, kv_heads, head_dim, mask_kwargs, segments,
     deterministic) = BACKWARD_CASES[case]
    rng = fresh_rng()
    q, d_out = (jnp.asarray(rng.standard_normal((batch, seq_q, heads, head_dim)), BF16)
                for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_kv, kv_heads, head_dim)), BF16)
            for _ in range(2))
    bounds = _bounds(batch, seq_q, seq_kv, rng)
    segment_ids = None
    if segments:
        ids = jnp.asarray(np.cumsum(rng.random((batch, max(seq_q, seq_kv))) < 0.02, axis=1),
                          jnp.int32)
        segment_ids = (ids[:, :seq_q], ids[:, :seq_kv])
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = head_dim ** -0.5
    dense = _dense_mask(bounds, seq_q, seq_kv)
    out, lse, want = attention_float64(q, k, v, scale=scale, mask=mask,
                                       segment_ids=segment_ids, attn_mask=dense,
                                       d_out=np.asarray(d_out, np.float64))
    out = jnp.asarray(out, BF16)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    q_bad, k_bad, v_bad = _poisoned(q, k, v, bounds)
    got = mosaic.KERNELS.backward(
        q_bad, k_bad, v_bad, segment_ids, out, jnp.asarray(lse, jnp.float32), d_out, delta,
        mask=mask, scale=scale, config=SERIAL, interpret=True, bounds=bounds,
        deterministic=deterministic)
    real_rows = np.arange(seq_q)[None] < np.asarray(bounds.q_end)[:, None]
    keys = np.arange(seq_kv)[None]
    visible = (keys >= np.asarray(bounds.kv_start)[:, None]) & (
        keys < np.asarray(bounds.kv_end)[:, None])
    for name, g, ref, inside in zip("qkv", got, want[:3], (real_rows, visible, visible),
                                    strict=True):
        g = np.asarray(g, np.float64)
        assert not np.isnan(g).any(), f"d{name}"
        assert rel_err(g, ref) < 1e-2, f"d{name}: {rel_err(g, ref)}"
        np.testing.assert_allclose(g, ref, atol=0.05 * np.abs(ref).max(), rtol=0.05,
                                   err_msg=f"d{name}")
        assert np.all(g[~inside] == 0), f"d{name} outside the bounds"


@pytest.mark.parametrize("overlap", [False, True])
def test_fp8_forward_matches_oracle(overlap):
    """The FP8 operand format through the same bounded kernel, against the oracle on the
    unquantized inputs (FP8 tolerance: e4m3 operands and P). The hidden K/V rows hold
    random data here, not NaN (which would make their tiles' scales NaN): it must not
    reach a visible pair either."""
    batch, seq_q, seq_kv, heads, head_dim = 4, 150, 200, 2, 64
    rng = fresh_rng()
    q = jnp.asarray(rng.standard_normal((batch, seq_q, heads, head_dim)), BF16)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_kv, 1, head_dim)), BF16)
            for _ in range(2))
    bounds = _bounds(batch, seq_q, seq_kv, rng)
    config = dataclasses.replace(SERIAL, overlap=overlap)
    ops = fp8.quantize_operands(q, k, v, block_q=config.block_q, block_kv=config.block_kv,
                                implementation="xla")
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=True,
                    causal_alignment="bottom_right")
    scale = head_dim ** -0.5
    out, lse = forward_fp8.forward(ops, mask=mask, scale=scale, config=config,
                                   interpret=True, bounds=bounds)
    # e4m3 operands and P (3 mantissa bits on each tile's scale): a few outputs and lse of
    # a fresh draw land 0.1-0.15 off; the means stay far below (a masking error moves many).
    _check(out, lse, q, k, v, bounds, mask, scale, out_tol=0.25, lse_atol=0.25)


def test_bounds_are_checked():
    q = jnp.zeros((2, 64, 1, 64), BF16)
    mask = MaskSpec(seq_q=64, seq_kv=64)
    ones = jnp.ones((2,), jnp.int32)
    for bad, match in ((RowBounds(ones, ones, ones.astype(jnp.float32)), "bounds.kv_end"),
                       (RowBounds(ones[:1], ones, ones), "bounds.q_end"),
                       ((ones, ones, ones), "RowBounds")):
        with pytest.raises(ValueError, match=match):
            mosaic.KERNELS.forward(q, q, q, None, mask=mask, scale=1.0, config=SERIAL,
                                   interpret=True, bounds=bad)


@pytest.mark.parametrize("config", [SERIAL, OVERLAP, THREE,
                                    dataclasses.replace(OVERLAP, persistent=True)],
                         ids=["serial", "overlap", "three", "persistent"])
@pytest.mark.parametrize("causal", [False, True])
def test_bounded_forward_lowers_for_cuda(config, causal):
    """Layouts of the key-bound mask and the padding-row epilogue, for the GPU."""
    shape = (2, 1000, 2, 64)
    mask = MaskSpec(seq_q=1000, seq_kv=1000, is_causal=causal)

    def f(q, k, v, bounds):
        return mosaic.KERNELS.forward(q, k, v, None, mask=mask, scale=0.1, config=config,
                                      interpret=False, bounds=RowBounds(*bounds))
    spec = jax.ShapeDtypeStruct(shape, BF16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    jax.jit(f).trace(spec, spec, spec, (lengths,) * 3).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(("head_dim", "persistent"), [(64, False), (256, True)])
def test_bounded_fp8_forward_lowers_for_cuda(head_dim, persistent):
    """The FP8 operand format with bounds, in its default causal config, for the GPU."""
    batch, seq, heads = 2, 2048, 4
    config = dataclasses.replace(
        forward_fp8.default_config(head_dim, is_causal=True, seq_kv=seq), persistent=persistent)
    mask = MaskSpec(seq_q=seq, seq_kv=seq, is_causal=True)

    def f(ops, bounds):
        return forward_fp8.forward(forward_fp8.Fp8Operands(*ops), mask=mask, scale=0.1,
                                   config=config, interpret=False, bounds=RowBounds(*bounds))
    e4m3, f32 = E4M3, jnp.float32
    kv_tiles = -(-seq // config.block_kv)
    ops = (jax.ShapeDtypeStruct((batch, seq, heads, head_dim), e4m3),
           jax.ShapeDtypeStruct((batch, seq // config.block_q, heads), f32),
           jax.ShapeDtypeStruct((batch, seq, heads, head_dim), e4m3),
           jax.ShapeDtypeStruct((batch, kv_tiles, heads), f32),
           jax.ShapeDtypeStruct((batch, heads, head_dim, seq), e4m3),
           jax.ShapeDtypeStruct((batch, kv_tiles, heads), f32))
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    jax.jit(f).trace(ops, (lengths,) * 3).lower(lowering_platforms=("cuda",))

"""Row bounds (pallas_flash.contract.RowBounds) in each backend's kernels, called directly:
every element of out, lse, dq, dk, dv (and dbias) against the float64 oracle given the
equivalent dense mask, with NaN in every padding query row and hidden key row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.contract import EMPTY_ROW_LSE, RowBounds
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from tests.support import assert_matches, random_qkv, random_segments


def _triton():
    from pallas_flash.triton import KERNELS, TritonConfig

    # 16-row tiles: the bounds below fall inside tiles and leave whole tiles on each side.
    return KERNELS, TritonConfig(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)


def _xla():
    from pallas_flash.xla import KERNELS, XlaConfig

    return KERNELS, XlaConfig(block_kv=16)


# Mosaic joins by adding its entry here once its kernels take bounds=.
KERNEL_SETS = {"triton": _triton, "xla": _xla}

BATCH, SEQ_Q, SEQ_KV, HEADS, KV_HEADS, HEAD_DIM = 3, 40, 56, 4, 2, 32
# Per sequence (q_end, kv_start, kv_end): edges inside tiles with whole tiles between them;
# no key at all; no query at all.
BOUNDS = ((37, 5, 50), (23, 0, 0), (0, 16, 56))

CASES = {
    "dense": dict(),
    "causal": dict(mask=dict(is_causal=True)),
    "causal_bottom_right": dict(mask=dict(is_causal=True, causal_alignment="bottom_right")),
    "window": dict(mask=dict(window=(9, 4))),
    "segments": dict(segments=True),
    "causal_segments": dict(mask=dict(is_causal=True), segments=True),
    "softcap": dict(softcap=5.0),
    "bias_and_mask": dict(bias=True, attn_mask=True),
}


def _bounds(bounds=BOUNDS) -> RowBounds:
    return RowBounds(*(jnp.asarray(x, jnp.int32) for x in zip(*bounds, strict=True)))


def _inside(bounds=BOUNDS, seq_q=SEQ_Q, seq_kv=SEQ_KV):
    """Boolean [B, T] real queries and [B, S] visible keys."""
    q_end, kv_start, kv_end = (np.asarray(x)[:, None] for x in zip(*bounds, strict=True))
    keys = np.arange(seq_kv)[None]
    return np.arange(seq_q)[None] < q_end, (keys >= kv_start) & (keys < kv_end)


def _with_nan(x, inside):
    """x with NaN in every row outside the bounds."""
    return jnp.where(jnp.asarray(inside)[:, :, None, None], x, jnp.nan).astype(x.dtype)


def _run(kernels, config, q, k, v, d_out, segment_ids, *, mask, scale, bounds, softcap=None,
         **extra):
    """The kernels' forward, then their backward on its residuals (one jitted program).
    ``extra``: array keywords (bias, attn_mask)."""
    bias_grad = extra.get("bias") is not None
    static = {} if softcap is None else dict(softcap=softcap)

    @jax.jit
    def run(q, k, v, d_out, segment_ids, bounds, extra):
        out, lse = kernels.forward(q, k, v, segment_ids, mask=mask, scale=scale,
                                   config=config, interpret=True, bounds=bounds, **extra,
                                   **static)
        delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32),
                           out.astype(jnp.float32))
        kwargs = dict(bias_grad=True) if bias_grad else {}
        grads = kernels.backward(q, k, v, segment_ids, out, lse, d_out, delta, mask=mask,
                                 scale=scale, config=config, interpret=True, bounds=bounds,
                                 **extra, **static, **kwargs)
        return out, lse, grads

    return run(q, k, v, d_out, segment_ids, bounds, extra)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(KERNEL_SETS))
def test_bounds_match_oracle(name, case):
    kernels, config = KERNEL_SETS[name]()
    spec = CASES[case]
    mask = MaskSpec(seq_q=SEQ_Q, seq_kv=SEQ_KV, **spec.get("mask", {}))
    q, k, v, d_out = random_qkv(BATCH, SEQ_Q, SEQ_KV, HEADS, KV_HEADS, HEAD_DIM)
    q_in, k_in = _inside()
    segment_ids = None
    if spec.get("segments"):
        ids = random_segments(BATCH, SEQ_KV)
        segment_ids = (ids[:, :SEQ_Q], ids)
    rng = np.random.default_rng(len(case))
    extra, ref_extra = {}, {}
    if spec.get("softcap"):
        extra["softcap"] = ref_extra["softcap"] = spec["softcap"]
    if spec.get("bias"):
        bias = jnp.asarray(rng.standard_normal((BATCH, 1, SEQ_Q, SEQ_KV)), jnp.float32)
        extra["bias"] = ref_extra["bias"] = bias
    attn_mask = None
    if spec.get("attn_mask"):
        attn_mask = jnp.asarray(rng.random((1, HEADS, SEQ_Q, SEQ_KV)) < 0.8)
        extra["attn_mask"] = attn_mask
    scale = 0.3

    out, lse, grads = _run(kernels, config, _with_nan(q, q_in), _with_nan(k, k_in),
                           _with_nan(v, k_in), _with_nan(d_out, q_in), segment_ids,
                           mask=mask, scale=scale, bounds=_bounds(), **extra)

    dense = jnp.asarray(q_in[:, None, :, None] & k_in[:, None, None, :])
    if attn_mask is not None:
        dense = dense & attn_mask
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, scale=scale, mask=mask, segment_ids=segment_ids, attn_mask=dense,
        d_out=jnp.where(jnp.asarray(q_in)[:, :, None, None], d_out, 0.0), **ref_extra)
    names = ("dq", "dk", "dv", "dbias") if "bias" in extra else ("dq", "dk", "dv")
    assert_matches(out, jnp.swapaxes(lse, 1, 2), grads, ref_out, ref_lse, ref_grads,
                   jnp.float32, names=names)
    # Exactly zero, not merely small: padding rows and hidden keys.
    assert np.all(np.asarray(out)[~q_in] == 0)
    assert np.all(np.asarray(jnp.swapaxes(lse, 1, 2))[~q_in] == np.float32(EMPTY_ROW_LSE))
    assert np.all(np.asarray(grads[0])[~q_in] == 0)
    for g in grads[1:3]:
        assert np.all(np.asarray(g)[~k_in] == 0)


@pytest.mark.parametrize("name", list(KERNEL_SETS))
def test_bounds_all_empty(name):
    """Every sequence without queries or without keys: all zeros, no NaN anywhere."""
    kernels, config = KERNEL_SETS[name]()
    bounds = ((0, 0, SEQ_KV), (SEQ_Q, 7, 7), (SEQ_Q, 30, 10))
    mask = MaskSpec(seq_q=SEQ_Q, seq_kv=SEQ_KV, is_causal=True)
    q, k, v, d_out = (jnp.full_like(x, jnp.nan) for x in
                      random_qkv(BATCH, SEQ_Q, SEQ_KV, HEADS, KV_HEADS, HEAD_DIM))
    q_in, k_in = _inside(bounds)
    q, k, v, d_out = (jnp.where(jnp.asarray(inside)[:, :, None, None], 1.0, x)
                      for x, inside in ((q, q_in), (k, k_in), (v, k_in), (d_out, q_in)))
    out, lse, grads = _run(kernels, config, q, k, v, d_out, None, mask=mask, scale=0.5,
                           bounds=_bounds(bounds))
    assert np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == np.float32(EMPTY_ROW_LSE))
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_cut_to_bounds_keeps_only_edge_tiles_masked():
    """The walk over 16-row tiles cut to keys [5, 50): tiles 0 and 3 are edges (masked),
    1 and 2 inside (unmasked), 4 and beyond skipped."""
    from pallas_flash.triton.tiles import cut_to_bounds

    def cut(start, end, *, own_seen=True, own_whole=True, ranges=(0, 0, 7, 7)):
        return tuple(int(x) for x in cut_to_bounds(
            ranges, jnp.int32(start), jnp.int32(end), 16, own_seen=jnp.bool_(own_seen),
            own_whole=jnp.bool_(own_whole)))

    assert cut(5, 50) == (0, 1, 3, 4)
    assert cut(16, 64) == (1, 1, 4, 4)
    assert cut(0, 2**31 - 1) == (0, 0, 7, 7)               # no bound: the band's walk
    assert cut(2**31 - 1, 2**31 - 1)[0] == cut(2**31 - 1, 2**31 - 1)[3]
    assert cut(5, 50, own_whole=False) == (0, 1, 1, 4)     # every tile masked
    first, _, _, last = cut(5, 50, own_seen=False)
    assert first == last                                   # nothing walked
    first, _, _, last = cut(7, 7)
    assert first == last
    first, _, _, last = cut(30, 10)
    assert first == last
    # The band's own range is kept: a causal row block seeing tiles [0, 2) only.
    assert cut(5, 50, ranges=(0, 0, 1, 2)) == (0, 1, 1, 2)


def test_bounds_lower_for_hopper():
    """The Triton kernels with bounds (scalar reads, the cut walk, the edge selects) lower to
    Triton for an H200 on the CPU: forward, dK/dV and dQ; only a GPU runs them."""
    from pallas_flash.triton import KERNELS, TritonConfig

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                       platform="gpu")
    mask = MaskSpec(seq_q=300, seq_kv=300, is_causal=True)
    config = TritonConfig()

    def both(q, k, v, d_out, bounds):
        out, lse = KERNELS.forward(q, k, v, None, mask=mask, scale=0.125, config=config,
                                   interpret=False, bounds=bounds)
        delta = jnp.zeros(lse.shape, jnp.float32)
        return KERNELS.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                scale=0.125, config=config, interpret=False, bounds=bounds)

    qkv = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    ends = jax.ShapeDtypeStruct((2,), jnp.int32)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
        text = jax.jit(both).trace(qkv, qkv, qkv, qkv, RowBounds(ends, ends, ends)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3

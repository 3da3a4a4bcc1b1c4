"""CPU tests of the Mosaic GPU backward (``pallas_flash/mosaic/backward.py``) that are
particular to it.

The shared suite (tests/test_attention.py, tests/test_bias_mask.py) checks the Mosaic
backward's gradients through ``pallas_flash.attention`` with the API's backward config
(the fused dQ up to head_dim 128, the separate dQ kernel for short causal calls above 64,
the split dK/dV kernel at 256), with masks, segment ids, padding, soft-capping and bias /
mask arrays. Here:

* Both dQ modes at head dims 64 and 128 with explicit configs, and the producer/consumer
  protocols under the interpreter's race detector, in Mosaic GPU interpret mode (the
  register A operands of wgmma detoured through SMEM; the fused dQ stored per consumer and
  key tile, as the interpreter has no TMA reduce-add), vs the float64 oracle.
* Which calls take the Triton backward (dbias, bias / mask arrays at head_dim 256,
  head_dim 192).
* The real GPU kernels (fused and deterministic dQ), lowered for ``cuda`` on the CPU:
  layouts, wgmma operands and the shared-memory budget, which the config's accounting
  must match exactly.
* Config validation and the fallback to the Triton backward.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from support import random_qkv, rel_err

import pallas_flash
from pallas_flash import dispatch, mosaic
from pallas_flash.compat import interpret_pallas_call
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, MosaicConfig, default_backward_config
from pallas_flash.mosaic import config as mosaic_config
from pallas_flash.mosaic.config import LogitRing
from pallas_flash.reference import attention_float64

# The backend interface (pallas_flash.autodiff.Kernels): (dq, dk, dv[, dbias]).
mosaic_backward = mosaic.KERNELS.backward

BF16, F16 = jnp.bfloat16, jnp.float16
SMALL = MosaicBackwardConfig(block_q=64, dq_block_kv=64)


def _residuals(q, k, v, d_out, mask: MaskSpec, scale: float, segment_ids=None,
               softcap=None):
    """(out, lse, delta) from the float64 oracle, and its (dq, dk, dv)."""
    out, lse, grads = attention_float64(q, k, v, scale=scale, mask=mask,
                                        segment_ids=segment_ids, softcap=softcap,
                                        d_out=np.asarray(d_out, np.float64))
    out = jnp.asarray(out, q.dtype)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    return out, jnp.asarray(lse, jnp.float32), delta, grads


def test_interpret_head_dim_256_no_races():
    """The split dK/dV kernel's exchange of Pᵀ / dSᵀ halves between its consumers (the
    head_dim 256 default config), under the interpreter's race detector; bottom-right
    causal, odd lengths, GQA. (The numbers of head_dim 256: the shared suite.)"""
    q, k, v, d_out = random_qkv(1, 200, 130, 2, 1, 256, F16)
    mask = MaskSpec(seq_q=200, seq_kv=130, is_causal=True, causal_alignment="bottom_right")
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.05)
    config = default_backward_config(q.shape, k.shape, F16, mask)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        grads = jax.block_until_ready(mosaic_backward(
            q, k, v, None, out, lse, d_out, delta, mask=mask, scale=0.05, config=config,
            interpret=True))
    assert not interpret_pallas_call.get_races().races_found
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


def _logit_array(spec: str, sizes: dict, seed: int, *, mask: bool, dtype=jnp.float32):
    """A ``spec``-shaped array over ``BNTS1``: N(0, 2²) bias, or a mask keeping ~80 %."""
    shape = tuple(sizes.get(c, 1) for c in spec)
    if mask:
        return jax.random.bernoulli(jax.random.key(seed), 0.8, shape)
    return (2 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


# (bias spec, bias dtype, mask spec, mask kwargs): every reader kind of both kernels has
# its numbers checked by tests/test_bias_mask.py (cases with a constant bias); here the
# race check of the rings.
LOGIT_CASES = {
    # A bf16 key-row bias ring; an int8 tile mask (rows with no key: lse EMPTY_ROW_LSE).
    "key_bias_tile_mask_causal": ("B11S", BF16, "B1TS", dict(is_causal=True)),
}


def _backward_with_logits(case: str, *, races: bool = False):
    bias_spec, bias_dtype, mask_spec, mask_kwargs = LOGIT_CASES[case]
    batch, seq_q, seq_kv, heads, kv_heads, head_dim = 2, 200, 130, 2, 1, 64
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, BF16)
    sizes = dict(B=batch, N=heads, T=seq_q, S=seq_kv)
    bias = _logit_array(bias_spec, sizes, 1, mask=False, dtype=bias_dtype)
    attn_mask = _logit_array(mask_spec, sizes, 2, mask=True)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = head_dim ** -0.5
    out, lse, grads = attention_float64(q, k, v, scale=scale, mask=mask, bias=bias,
                                        attn_mask=attn_mask,
                                        d_out=np.asarray(d_out, np.float64))
    out = jnp.asarray(out, q.dtype)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    # The forward's config, as the API passes it: the backward picks its own tiling.
    config = MosaicConfig()
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=races)):
        got = jax.block_until_ready(mosaic_backward(
            q, k, v, None, out, jnp.asarray(lse, jnp.float32), d_out, delta, mask=mask,
            scale=scale, config=config, interpret=True, bias=bias, attn_mask=attn_mask))
    return got, grads[:3], (q, k, v)  # the oracle's dbias is not computed here


def test_interpret_bias_mask_no_races():
    """The bias / mask rings (on lse's / K's ready barrier, read before the slot is freed)
    under the interpreter's race detector."""
    got, want, _ = _backward_with_logits("key_bias_tile_mask_causal", races=True)
    assert not interpret_pallas_call.get_races().races_found
    for g, ref in zip(got, want, strict=True):
        assert rel_err(g, ref) < 1e-2


@pytest.fixture
def triton_backward_calls(monkeypatch) -> list:
    """Records each call of the Triton backward (the Mosaic backward's fallback)."""
    from pallas_flash import triton

    kernels, calls = triton.KERNELS, []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("bias_grad", False))
        return kernels.backward(*args, **kwargs)

    monkeypatch.setattr(triton, "KERNELS", dataclasses.replace(kernels, backward=spy))
    return calls


@pytest.mark.parametrize(("head_dim", "bias", "bias_grad", "takes_triton"), [
    (64, True, True, True),       # dbias is Triton's
    (64, True, False, False),     # a constant bias is read by the Mosaic kernels
    (192, True, False, True),     # head_dim 192: the Mosaic backward has no kernel for it
    (256, False, False, False),   # head_dim 256: the split dK/dV kernel
])
def test_which_calls_take_the_triton_backward(head_dim, bias, bias_grad, takes_triton,
                                              triton_backward_calls):
    """pallas_flash.attention(implementation="mosaic"): dbias, bias / mask arrays at
    head_dim 256 and head_dim 192 take the Triton backward; the rest, segment ids and
    soft-capping included, the Mosaic kernels (the numbers: the shared suite)."""
    q, k, v, d_out = random_qkv(1, 64, 64, 1, 1, head_dim, BF16)
    bias_array = jnp.zeros((1, 1, 64, 64), jnp.float32) if bias else None
    ids = jnp.asarray(np.arange(64)[None] // 40, jnp.int32)

    def f(q, k, v, b):
        return pallas_flash.attention(q, k, v, b, is_causal=True, q_segment_ids=ids,
                                      logits_soft_cap=20.0, implementation="mosaic",
                                      interpret=True)

    if bias_grad:
        _, vjp = jax.vjp(f, q, k, v, bias_array)
    else:
        _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, bias_array), q, k, v)
    jax.block_until_ready(vjp(d_out))
    assert triton_backward_calls == ([bias_grad] if takes_triton else [])


@pytest.mark.parametrize("head_dim", [192, 256])
def test_bias_above_head_dim_128_is_refused(head_dim):
    """The Mosaic backward has no bias reader above head_dim 128: it says so to the
    dispatcher (which then takes another backend's backward, see above) and refuses a
    direct call with the same reason instead of running anything."""
    q, k, v, d_out = random_qkv(1, 64, 64, 1, 1, head_dim, BF16)
    lse = delta = jnp.zeros((1, 1, 64), jnp.float32)
    bias = jnp.zeros((1, 1, 64, 64), jnp.float32)
    mask = MaskSpec(seq_q=64, seq_kv=64)
    reason = mosaic.unsupported_backward(q.shape, k.shape, q.dtype, mask, False,
                                         has_bias=True)
    assert reason is not None and "128" in reason
    with pytest.raises(ValueError, match="128"):
        mosaic_backward(q, k, v, None, None, lse, d_out, delta, mask=mask, scale=0.1,
                        config=MosaicConfig(), interpret=True, bias=bias)


def test_interpret_no_races():
    """Both kernels' producer/consumer protocols under the interpreter's race detector."""
    q, k, v, d_out = random_qkv(1, 128, 192, 2, 1, 64, BF16)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.125)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        grads = mosaic_backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                         scale=0.125, config=SMALL, interpret=True)
        jax.block_until_ready(grads)
    assert not interpret_pallas_call.get_races().races_found
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


# --- both dQ modes ---------------------------------------------------------------------

# (head_dim, causal, num_stages, deterministic). The fused dQ (deterministic=False): at
# head_dim 128 dQ's columns are split between the consumers (splits_dq); at 64 the consumer
# that owns a step's ring slot adds all of it (with three slots, consumer 0 owns two of
# them). The separate dQ kernel with 64-key blocks (the API's default at head_dim 64 is the
# fused dQ).
DQ_CASES = [(64, True, 2, False), (64, True, 3, False), (128, False, 2, False),
            (128, True, 2, False), (64, False, 2, True), (64, True, 2, True)]


@pytest.mark.parametrize(("head_dim", "causal", "num_stages", "deterministic"), DQ_CASES)
def test_interpret_dq_modes_match_oracle(head_dim, causal, num_stages, deterministic):
    """dQ from the dK/dV kernel (in interpret mode stored per consumer and key tile, as
    TMA has no reduce-add there) or from the dQ kernel; GQA, odd lengths, rows that see no
    key: near the diagonal one consumer skips a block while the other adds its dS·K."""
    q, k, v, d_out = random_qkv(1, 200, 330, 2, 1, head_dim, BF16)
    mask = MaskSpec(seq_q=200, seq_kv=330, is_causal=causal, causal_alignment="bottom_right")
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.1)
    config = MosaicBackwardConfig(num_stages=num_stages, deterministic=deterministic,
                                  dq_block_kv=64 if deterministic else 128)
    assert mosaic_config.splits_dq(head_dim, 2) == (head_dim == 128)
    races = causal and not deterministic  # (the deterministic kernels: below)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=races)):
        grads = jax.block_until_ready(mosaic_backward(
            q, k, v, None, out, lse, d_out, delta, mask=mask, scale=0.1, config=config,
            interpret=True))
    assert not (races and interpret_pallas_call.get_races().races_found)
    for name, got, ref, x in zip("qkv", grads, want, (q, k, v), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert rel_err(got, ref) < 1e-2, f"d{name}: {rel_err(got, ref)}"


# --- segment ids and soft-capping --------------------------------------------------------


def _doc_ids(batch: int, seq: int, starts) -> jax.Array:
    """[batch, seq] int32 ids of packed documents: the id goes up by one at each start."""
    ids = np.searchsorted(np.asarray(starts), np.arange(seq), side="right")
    return jnp.asarray(np.broadcast_to(ids, (batch, seq)), jnp.int32)


def test_segment_tiles_outside_the_span_are_never_read():
    """The separate dQ kernel (64-key blocks): Q/dO of a query document without keys and
    K/V of a key document without queries are NaN: a kernel that loaded them into its
    GEMMs would give NaN; skipped tiles leave exact zeros. CTA 0 of both kernels has one
    consumer with no block to visit. (dO cannot be NaN through the API, whose delta reads
    it; the fused dQ skips key tiles per CTA: the shared suite's version.)"""
    seq = 256
    q, k, v, d_out = random_qkv(1, seq, seq, 2, 1, 64, BF16)
    q_ids = _doc_ids(1, seq, [64, 128])                     # 0 | 1 (no keys) | 2, 2
    kv_ids = _doc_ids(1, seq, [64, 128]) * 3                # 0 | 3 (no query) | 6, 6
    kv_ids = kv_ids.at[:, 128:].set(2)
    ids = (q_ids, kv_ids)
    mask = MaskSpec(seq_q=seq, seq_kv=seq)
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.125, ids)
    hidden = slice(64, 128)
    q, d_out, k, v = (x.at[:, hidden].set(jnp.nan) for x in (q, d_out, k, v))
    grads = mosaic_backward(q, k, v, ids, out, lse, d_out, delta, mask=mask, scale=0.125,
                            config=SMALL, interpret=True)
    for got, ref in zip(grads, want, strict=True):
        assert np.all(np.asarray(got[:, hidden]) == 0)
        assert rel_err(got, ref) < 1e-2


def test_interpret_segments_softcap_no_races():
    """The ids rings (on lse's / K's ready barrier, read before the slot is freed, fenced
    before the producer refills it) under the interpreter's race detector."""
    q, k, v, d_out = random_qkv(1, 128, 192, 2, 1, 64, F16)
    ids = (_doc_ids(1, 128, [40, 100]), _doc_ids(1, 192, [40, 100]))
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True)
    out, lse, delta, want = _residuals(q * 4, k, v, d_out, mask, 0.125, ids, 10.0)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        grads = mosaic_backward(q * 4, k, v, ids, out, lse, d_out, delta, mask=mask,
                                         scale=0.125, config=SMALL, interpret=True,
                                         softcap=10.0)
        jax.block_until_ready(grads)
    assert not interpret_pallas_call.get_races().races_found
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


def test_backward_unsupported_reasons():
    """The reasons the Mosaic backward gives for taking the Triton backward."""
    unsupported = importlib.import_module("pallas_flash.mosaic.backward").unsupported
    assert "head_dim 192" in unsupported((1, 64, 1, 192), BF16, True, 5.0)
    assert "float32" in unsupported((1, 64, 1, 64), jnp.float32, True)
    assert unsupported((1, 64, 1, 128), F16, False) is None
    assert unsupported((1, 64, 1, 256), BF16, True, 5.0) is None


def test_head_dim_256_needs_the_deterministic_dq():
    with pytest.raises(ValueError, match="deterministic"):
        MosaicBackwardConfig(deterministic=False).check_fits(256)


# --- the GPU kernels, lowered for CUDA on the CPU ----------------------------------------


def _lower_for_cuda(shape_q, shape_kv, dtype, mask: MaskSpec, config, *,
                    segments: bool = False, softcap: float | None = None,
                    bias: str | None = None, bias_dtype=jnp.float32,
                    attn_mask: str | None = None):
    """``bias`` / ``attn_mask``: None or the array's shape spec over ``BNTS1``."""
    def f(q, k, v, out, lse, d_out, delta, q_ids, kv_ids, bias, attn_mask):
        return mosaic_backward(
            q, k, v, (q_ids, kv_ids) if segments else None, out, lse, d_out, delta,
            mask=mask, scale=0.1, config=config, interpret=False, softcap=softcap, bias=bias,
            attn_mask=attn_mask)
    q, kv = jax.ShapeDtypeStruct(shape_q, dtype), jax.ShapeDtypeStruct(shape_kv, dtype)
    stats = jax.ShapeDtypeStruct((shape_q[0], shape_q[2], shape_q[1]), jnp.float32)
    q_ids, kv_ids = (jax.ShapeDtypeStruct(shape[:2], jnp.int32) for shape in (shape_q, shape_kv))
    sizes = dict(B=shape_q[0], N=shape_q[2], T=shape_q[1], S=shape_kv[1])

    def spec(s, dtype):
        return None if s is None else jax.ShapeDtypeStruct(
            tuple(sizes.get(c, 1) for c in s), dtype)
    return jax.jit(f).trace(q, kv, kv, q, stats, q, stats, q_ids, kv_ids,
                            spec(bias, bias_dtype), spec(attn_mask, jnp.bool_)).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize(("head_dim", "bias", "bias_dtype", "attn_mask", "segments"), [
    (64, "1NTS", jnp.float32, "B11S", False),
    (128, "1NTS", jnp.float32, "B11S", True),
    (128, "B11S", BF16, "B1TS", False),
    (128, "BNT1", jnp.float32, "1NT1", False),
])
def test_bias_mask_lower_for_cuda(head_dim, bias, bias_dtype, attn_mask, segments):
    """Both kernels' bias / mask rings (fitted: 64-key dQ blocks, or the separate dQ
    kernel, beside a float32 tile ring) lower for CUDA within the shared memory budget."""
    shape_q, shape_kv = (2, 1000, 8, head_dim), (2, 1000, 2, head_dim)
    mask = MaskSpec(seq_q=1000, seq_kv=1000, is_causal=True)
    config = MosaicBackwardConfig(deterministic=False)  # what the fitting starts from
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config, segments=segments, bias=bias,
                    bias_dtype=bias_dtype, attn_mask=attn_mask)


@pytest.mark.parametrize(("tile_ring", "deterministic"), [(False, False), (True, True)])
def test_fused_dq_gives_way_to_a_tile_ring(tile_ring, deterministic):
    """Beside a float32 bias tile ring the fused dQ's dSᵀ ring and staging tiles do not
    fit at head_dim 128: the separate dQ kernel runs; a key-row ring leaves it fused."""
    ring = LogitRing(per_query=tile_ring, itemsize=4 if tile_ring else 2)
    config = mosaic_config.fit_backward_logit_rings(
        MosaicBackwardConfig(deterministic=False), 128, 2, segments=False,
        dkdv_rings=(ring,), dq_rings=(ring,))
    assert config.deterministic is deterministic
    config.check_fits(128, 2, dkdv_rings=(ring,), dq_rings=(ring,))


def test_bias_mask_smem_accounting_matches_lowering(monkeypatch):
    """Unfitted (128-key dQ blocks beside a float32 tile ring: over the budget), the
    config's count with the rings is what Mosaic GPU reports."""
    config = MosaicBackwardConfig()
    dq_rings = (LogitRing(per_query=True, itemsize=4), LogitRing(per_query=False, itemsize=1))
    need = config.dq_smem_bytes(128, logit_rings=dq_rings)
    assert need > mosaic_config.SMEM_BUDGET
    backward_module = importlib.import_module("pallas_flash.mosaic.backward")
    monkeypatch.setattr(backward_module, "fit_backward_logit_rings", lambda c, *_, **__: c)
    monkeypatch.setattr(MosaicBackwardConfig, "check_fits", lambda *_, **__: None)
    shape = (2, 1024, 2, 128)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        _lower_for_cuda(shape, shape, BF16, MaskSpec(seq_q=1024, seq_kv=1024), config,
                        bias="1NTS", attn_mask="B11S")
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


@pytest.mark.parametrize(("head_dim", "deterministic", "causal"), [
    (64, True, False), (64, True, True), (128, True, False), (128, True, True),
    (64, False, False), (128, False, True), (256, True, False), (256, True, True),
])
def test_default_configs_lower_for_cuda(head_dim, deterministic, causal):
    shape_q, shape_kv = (2, 1024, 8, head_dim), (2, 1024, 2, head_dim)
    mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=causal)
    config = default_backward_config(shape_q, shape_kv, BF16, mask)
    config = MosaicBackwardConfig(**{**vars(config), "deterministic": deterministic})
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config)


@pytest.mark.parametrize(("head_dim", "deterministic", "causal"), [
    (64, True, False), (128, True, True), (64, False, True), (128, False, False),
    (256, True, True),
])
def test_segments_softcap_lower_for_cuda(head_dim, deterministic, causal):
    """Packed documents + soft-capping: both kernels' ids rings, fused dQ included."""
    shape_q, shape_kv = (2, 1000, 8, head_dim), (2, 1000, 2, head_dim)
    mask = MaskSpec(seq_q=1000, seq_kv=1000, is_causal=causal)
    config = MosaicBackwardConfig(
        deterministic=deterministic, dq_block_kv=32 if head_dim > 128 else 128)
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config, segments=True, softcap=30.0)


def test_softcap_window_lowers_for_cuda():
    mask = MaskSpec(seq_q=700, seq_kv=900, window=(100, 0))
    _lower_for_cuda((1, 700, 4, 80), (1, 900, 2, 80), F16, mask, None, softcap=30.0)


def test_masked_odd_shapes_lower_for_cuda():
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=True, causal_alignment="bottom_right",
                    window=(100, 0))
    _lower_for_cuda((1, 1000, 4, 80), (1, 900, 2, 80), F16, mask, None)


@pytest.mark.parametrize(("head_dim", "config", "segments"), [
    (128, MosaicBackwardConfig(num_stages=2), False),  # the default: both kernels fit
    (128, MosaicBackwardConfig(num_stages=3), False),  # the dQ kernel's K/V ring: over
    (128, MosaicBackwardConfig(num_stages=2, deterministic=False), False),  # fused dQ: fits
    (128, MosaicBackwardConfig(num_stages=3, deterministic=False), False),  # staging: over
    (64, MosaicBackwardConfig(block_q=128, num_stages=3, deterministic=False), False),  # over
    # With segment ids: the ids rings (rows' ids in dK/dV, keys' ids in dQ).
    (128, MosaicBackwardConfig(num_stages=2), True),  # both fit
    (128, MosaicBackwardConfig(num_stages=2, deterministic=False), True),  # fits
    (128, MosaicBackwardConfig(num_stages=3), True),  # dQ over: its keys' ids ring counted
    (64, MosaicBackwardConfig(block_q=128, num_stages=3, deterministic=False), True),  # dK/dV
    # Head dim 256: the split dK/dV kernel (226 KiB with the ids ring) and 32-key dQ blocks.
    (256, MosaicBackwardConfig(dq_block_kv=32), False),  # fits
    (256, MosaicBackwardConfig(dq_block_kv=32), True),  # fits
    (256, MosaicBackwardConfig(dq_block_kv=32, num_stages=3), False),  # dK/dV over
    (256, MosaicBackwardConfig(dq_block_kv=64), False),  # dQ's K/V ring: over
])
def test_smem_accounting_matches_lowering(head_dim, config, segments, monkeypatch):
    """The config's SMEM bytes are exactly what Mosaic GPU allocates (its error says)."""
    mask = MaskSpec(seq_q=1024, seq_kv=1024)
    shape = (1, 1024, 2, head_dim)
    need = max(config.dkdv_smem_bytes(head_dim, segments=segments),
               config.dq_smem_bytes(head_dim, segments=segments) if config.deterministic
               else 0)
    lower = functools.partial(_lower_for_cuda, shape, shape, BF16, mask, config,
                              segments=segments)
    if need <= mosaic_config.SMEM_BUDGET:
        lower()
        return
    with pytest.raises(ValueError, match="shared memory"):
        lower()
    monkeypatch.setattr(MosaicBackwardConfig, "check_fits", lambda *_, **__: None)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        lower()
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(block_q=32), "block_q"), (dict(dq_block_kv=256), "dq_block_kv"),
    (dict(num_stages=1), "num_stages"), (dict(num_stages=5), "num_stages"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MosaicBackwardConfig(**kwargs)


def test_config_is_frozen_and_hashable():
    config = MosaicBackwardConfig()
    with pytest.raises(AttributeError):
        config.block_q = 128
    assert hash(config) == hash(MosaicBackwardConfig())


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128, 256])
@pytest.mark.parametrize("xla_flags", ["", "--xla_gpu_deterministic_ops=true",
                                       "--xla_dump_to=/tmp --xla_gpu_deterministic_ops"])
@pytest.mark.parametrize("causal", [False, True])
def test_default_backward_config_fits(head_dim, xla_flags, causal, monkeypatch):
    """The fused dQ (faster there) up to head_dim 128, unless XLA_FLAGS asks XLA for
    deterministic ops (decided by the dispatcher, passed on to the config); at head_dim
    256 there is only the separate dQ kernel."""
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    mask = MaskSpec(seq_q=4096, seq_kv=4096, is_causal=causal)
    config = default_backward_config((1, 4096, 8, head_dim), (1, 4096, 8, head_dim), BF16,
                                     mask, deterministic=dispatch.deterministic_backward())
    config.check_fits(mosaic_config.padded_head_dim(head_dim))
    assert config.deterministic == (head_dim > 128 or "deterministic" in xla_flags)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("seq", [1000, 2048, 2049, 4096])
@pytest.mark.parametrize("causal", [False, True])
def test_short_causal_takes_the_separate_dq_kernel(head_dim, seq, causal, monkeypatch):
    """Causal at head_dim 65-128 up to SHORT_CAUSAL_SEQ tokens (queries or keys): the
    separate dQ kernel, measured faster there; the fused dQ everywhere else."""
    monkeypatch.setenv("XLA_FLAGS", "")
    mask = MaskSpec(seq_q=seq, seq_kv=1024, is_causal=causal)
    config = default_backward_config((2, seq, 8, head_dim), (2, 1024, 8, head_dim), BF16,
                                     mask)
    short = seq <= mosaic_config.SHORT_CAUSAL_SEQ
    assert config.deterministic == (causal and head_dim > 64 and short)

"""CPU tests of the Mosaic GPU backend.

* Numerics, in Mosaic GPU interpret mode (``interpret=True``): the same kernel, pipeline,
  barriers and masking as on the GPU, with P·V fed through SMEM (see
  ``pallas_flash/mosaic/forward.py``). Compared with the float64 oracle.
* The real GPU kernel, lowered for ``cuda`` on the CPU: register layouts, wgmma operand
  checks and the shared-memory budget of every default config.
* Config validation and the backend interface.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_flash
from pallas_flash import mosaic
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig
from pallas_flash.mosaic import config as mosaic_config
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64

BF16, F16 = jnp.bfloat16, jnp.float16
# Small blocks so that the tiny test sequences still span several CTAs and K/V blocks.
SMALL = MosaicConfig(block_q=64, block_kv=64, num_stages=2)
OVERLAP = MosaicConfig(block_q=64, block_kv=64, num_stages=2, overlap=True)


def _inputs(shape_q, shape_kv, dtype, seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape_q), dtype),
            jnp.asarray(rng.standard_normal(shape_kv), dtype),
            jnp.asarray(rng.standard_normal(shape_kv), dtype))


def _assert_matches_oracle(q, k, v, out, lse, mask: MaskSpec, scale: float):
    ref_out, ref_lse = attention_float64(q, k, v, scale=scale, mask=mask)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert out.shape == q.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    seen = ref_lse > EMPTY_ROW_LSE / 2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-3)
    # Rows that see no key: out exactly 0, lse exactly EMPTY_ROW_LSE.
    assert np.all(lse[~seen] == np.float32(EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)


# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask kwargs, config)
CASES = {
    "dense_gqa_bf16": (2, 128, 128, 2, 1, 64, BF16, {}, SMALL),
    "dense_odd_f16": (1, 100, 70, 2, 2, 64, F16, {}, SMALL),
    "causal_odd_gqa_f16": (1, 200, 330, 4, 2, 64, F16, dict(is_causal=True), SMALL),
    "causal_bottom_right_bf16": (
        1, 200, 330, 2, 1, 64, BF16,
        dict(is_causal=True, causal_alignment="bottom_right"), SMALL),
    "causal_more_queries_than_keys": (  # bottom-right: the first 170 rows see nothing
        1, 300, 130, 2, 2, 64, BF16,
        dict(is_causal=True, causal_alignment="bottom_right"), SMALL),
    "window": (1, 256, 256, 2, 1, 64, BF16, dict(window=(50, 10)), SMALL),
    "causal_window": (1, 256, 256, 2, 1, 64, F16, dict(is_causal=True, window=(70, 0)), SMALL),
    "window_rows_past_keys": (1, 320, 60, 1, 1, 64, BF16, dict(window=(10, 10)), SMALL),
    "head_dim_96_padded": (1, 130, 130, 2, 1, 96, BF16, dict(is_causal=True), SMALL),
    "head_dim_128_3_stages": (1, 128, 384, 2, 2, 128, BF16, {}, MosaicConfig(64, 128, 3)),
    "head_dim_256": (1, 128, 128, 1, 1, 256, F16, dict(is_causal=True), SMALL),
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
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpret_matches_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask_kwargs, config = CASES[case]
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed=len(case))
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = 0.7 / head_dim ** 0.5
    out, lse = mosaic.forward(q, k, v, None, mask=mask, scale=scale, config=config,
                              interpret=True)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    _assert_matches_oracle(q, k, v, out, lse, mask, scale)


@pytest.mark.parametrize("config", [SMALL, OVERLAP], ids=["serial", "overlap"])
def test_interpret_no_races(config):
    """The producer/consumer protocol under the interpreter's vector-clock race detector."""
    q, k, v = _inputs((1, 128, 2, 64), (1, 192, 1, 64), BF16, seed=7)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        out, lse = mosaic.forward(q, k, v, None, mask=mask, scale=0.125, config=config,
                                  interpret=True)
        out.block_until_ready()
    assert not interpret_pallas_call.get_races().races_found
    _assert_matches_oracle(q, k, v, out, lse, mask, 0.125)


def test_api_forward_and_gradients_interpret():
    """pallas_flash.attention(implementation="mosaic"): our forward, Triton's backward."""
    pytest.importorskip("pallas_flash.triton")
    q, k, v = _inputs((1, 96, 4, 64), (1, 96, 2, 64), F16, seed=3)
    d_out = np.random.default_rng(4).standard_normal(q.shape)
    mask = MaskSpec(seq_q=96, seq_kv=96, is_causal=True)

    def f(q, k, v):
        return pallas_flash.attention(q, k, v, is_causal=True, implementation="mosaic",
                                      interpret=True, config=SMALL)

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(jnp.asarray(d_out, F16))
    ref_out, _, ref_grads = attention_float64(q, k, v, mask=mask, d_out=d_out)
    for got, want in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        got = np.asarray(got, np.float64)
        assert not np.isnan(got).any()
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


# --- the GPU kernel, lowered for CUDA on the CPU ----------------------------------------


def _lower_for_cuda(shape_q, shape_kv, dtype, mask: MaskSpec, config: MosaicConfig):
    def f(q, k, v):
        return mosaic.forward(q, k, v, None, mask=mask, scale=0.1, config=config,
                              interpret=False)
    args = (jax.ShapeDtypeStruct(shape_q, dtype), jax.ShapeDtypeStruct(shape_kv, dtype),
            jax.ShapeDtypeStruct(shape_kv, dtype))
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_default_configs_lower_for_cuda(head_dim, dtype, causal, overlap):
    """Layout inference, wgmma operand checks and the 227 KiB SMEM budget, per shape class."""
    shape_q, shape_kv = (2, 1024, 8, head_dim), (2, 1024, 2, head_dim)
    mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=causal)
    config = mosaic.default_config(shape_q, shape_kv, dtype, mask)
    config = dataclasses.replace(config, overlap=overlap)
    assert config.smem_bytes(head_dim) <= mosaic_config.SMEM_BUDGET
    _lower_for_cuda(shape_q, shape_kv, dtype, mask, config)


@pytest.mark.parametrize("overlap", [False, True])
def test_masked_odd_shapes_lower_for_cuda(overlap):
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=True, causal_alignment="bottom_right",
                    window=(100, 0))
    _lower_for_cuda((1, 1000, 4, 80), (1, 900, 2, 80), F16, mask,
                    MosaicConfig(64, 128, 2, overlap=overlap))


@pytest.mark.parametrize(("head_dim", "config"), [
    (128, MosaicConfig(64, 128, 3)),   # fits, 1.9 KiB to spare
    (128, MosaicConfig(64, 128, 4)),   # does not fit
    (256, MosaicConfig(64, 128, 2)),   # does not fit: why head_dim 256 needs block_kv 64
])
def test_smem_accounting_matches_lowering(head_dim, config, monkeypatch):
    """config.smem_bytes is exactly what Mosaic GPU allocates (its error message says)."""
    mask = MaskSpec(seq_q=1024, seq_kv=1024)
    shape = (1, 1024, 2, head_dim)
    need = config.smem_bytes(head_dim)
    if need <= mosaic_config.SMEM_BUDGET:
        _lower_for_cuda(shape, shape, BF16, mask, config)
        return
    with pytest.raises(ValueError, match="shared memory"):
        _lower_for_cuda(shape, shape, BF16, mask, config)
    monkeypatch.setattr(MosaicConfig, "check_fits", lambda *_: None)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        _lower_for_cuda(shape, shape, BF16, mask, config)
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


# --- config and interface -----------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(block_q=32), "block_q"), (dict(block_q=192), "block_q"),
    (dict(block_kv=96), "block_kv"), (dict(block_kv=512), "block_kv"),
    (dict(num_stages=1), "num_stages"), (dict(num_stages=5), "num_stages"),
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


def test_unsupported_reasons():
    mask = MaskSpec(seq_q=128, seq_kv=128)
    shape = (1, 128, 2, 64)
    assert mosaic.unsupported(shape, shape, BF16, mask, False) is None
    assert mosaic.unsupported(shape, shape, F16, mask, False) is None
    assert "segment" in mosaic.unsupported(shape, shape, BF16, mask, True)
    assert "float32" in mosaic.unsupported(shape, shape, jnp.float32, mask, False)
    assert mosaic.KERNELS.name == "mosaic"


def test_api_rejects_unsupported_when_forced():
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="mosaic"):
        pallas_flash.attention(q, q, q, implementation="mosaic", interpret=True)

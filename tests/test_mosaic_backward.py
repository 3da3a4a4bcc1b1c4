"""CPU tests of the Mosaic GPU backward (``pallas_flash/mosaic/backward.py``).

* Numerics in Mosaic GPU interpret mode: the same kernels, pipeline, barriers and masking
  as on the GPU, with the register A operands of wgmma detoured through SMEM and dQ from
  the deterministic dQ kernel (the interpreter has no TMA reduce-add). Compared with the
  float64 oracle on fresh random inputs.
* The real GPU kernels (fused and deterministic dQ), lowered for ``cuda`` on the CPU:
  layouts, wgmma operands and the shared-memory budget, which the config's accounting
  must match exactly.
* Config validation and the fallback to the Triton backward.
"""

from __future__ import annotations

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu
from support import random_qkv, rel_err

from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, MosaicConfig, default_backward_config
from pallas_flash.mosaic import config as mosaic_config
from pallas_flash.reference import attention_float64

mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")

BF16, F16 = jnp.bfloat16, jnp.float16
SMALL = MosaicBackwardConfig(block_q=64, dq_block_kv=64)


def _residuals(q, k, v, d_out, mask: MaskSpec, scale: float):
    """(out, lse, delta) from the float64 oracle, and its (dq, dk, dv)."""
    out, lse, grads = attention_float64(q, k, v, scale=scale, mask=mask,
                                        d_out=np.asarray(d_out, np.float64))
    out = jnp.asarray(out, q.dtype)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    return out, jnp.asarray(lse, jnp.float32), delta, grads


# (batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask kwargs)
CASES = {
    "dense_gqa_bf16": (1, 128, 256, 2, 1, 64, BF16, {}),
    "causal_odd_gqa_f16": (1, 200, 130, 2, 1, 64, F16, dict(is_causal=True)),
    "causal_bottom_right_empty_rows": (  # the first 60 rows see no key
        1, 190, 130, 1, 1, 64, BF16, dict(is_causal=True, causal_alignment="bottom_right")),
    "window_head_dim_96": (1, 192, 150, 1, 1, 96, BF16, dict(window=(40, 20))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpret_matches_oracle(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, mask_kwargs = CASES[case]
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = 0.7 / head_dim ** 0.5
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, scale)
    grads = mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                     scale=scale, config=SMALL, interpret=True)
    for name, got, ref, x in zip("qkv", grads, want, (q, k, v), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert rel_err(got, ref) < 1e-2, f"d{name}: {rel_err(got, ref)}"


def test_interpret_no_races():
    """Both kernels' producer/consumer protocols under the interpreter's race detector."""
    q, k, v, d_out = random_qkv(1, 128, 192, 2, 1, 64, BF16)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.125)
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        grads = mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                         scale=0.125, config=SMALL, interpret=True)
        jax.block_until_ready(grads)
    assert not interpret_pallas_call.get_races().races_found
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


def test_fallback_to_triton_for_head_dim_256():
    """unsupported() names the reason, and backward() still gives the right gradients."""
    assert "head_dim 256" in mosaic_backward.unsupported((1, 64, 1, 256), BF16, False)
    assert "segment ids" in mosaic_backward.unsupported((1, 64, 1, 64), BF16, True)
    assert "float32" in mosaic_backward.unsupported((1, 64, 1, 64), jnp.float32, False)
    assert "soft-capping" in mosaic_backward.unsupported((1, 64, 1, 64), BF16, False, 5.0)
    assert mosaic_backward.unsupported((1, 64, 1, 128), F16, False) is None
    q, k, v, d_out = random_qkv(1, 40, 40, 1, 1, 256, BF16)
    mask = MaskSpec(seq_q=40, seq_kv=40, is_causal=True)
    out, lse, delta, want = _residuals(q, k, v, d_out, mask, 0.06)
    grads = mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                     scale=0.06, config=MosaicConfig(), interpret=True)
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


# --- the GPU kernels, lowered for CUDA on the CPU ----------------------------------------


def _lower_for_cuda(shape_q, shape_kv, dtype, mask: MaskSpec, config):
    def f(q, k, v, out, lse, d_out, delta):
        return mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                        scale=0.1, config=config, interpret=False)
    q, kv = jax.ShapeDtypeStruct(shape_q, dtype), jax.ShapeDtypeStruct(shape_kv, dtype)
    stats = jax.ShapeDtypeStruct((shape_q[0], shape_q[2], shape_q[1]), jnp.float32)
    return jax.jit(f).trace(q, kv, kv, q, stats, q, stats).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(("head_dim", "deterministic", "causal"), [
    (64, True, False), (64, True, True), (128, True, False), (128, True, True),
    (64, False, False), (128, False, True),
])
def test_default_configs_lower_for_cuda(head_dim, deterministic, causal):
    shape_q, shape_kv = (2, 1024, 8, head_dim), (2, 1024, 2, head_dim)
    mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=causal)
    config = default_backward_config(shape_q, shape_kv, BF16, mask)
    config = MosaicBackwardConfig(**{**vars(config), "deterministic": deterministic})
    _lower_for_cuda(shape_q, shape_kv, BF16, mask, config)


def test_masked_odd_shapes_lower_for_cuda():
    mask = MaskSpec(seq_q=1000, seq_kv=900, is_causal=True, causal_alignment="bottom_right",
                    window=(100, 0))
    _lower_for_cuda((1, 1000, 4, 80), (1, 900, 2, 80), F16, mask, None)


@pytest.mark.parametrize(("head_dim", "config"), [
    (128, MosaicBackwardConfig(num_stages=2)),  # the default: both kernels fit
    (128, MosaicBackwardConfig(num_stages=3)),  # the dQ kernel's K/V ring does not fit
    (128, MosaicBackwardConfig(num_stages=2, deterministic=False)),  # fused dQ: fits
    (128, MosaicBackwardConfig(num_stages=3, deterministic=False)),  # fused dQ staging: over
    (64, MosaicBackwardConfig(block_q=128, num_stages=3, deterministic=False)),  # just over
])
def test_smem_accounting_matches_lowering(head_dim, config, monkeypatch):
    """The config's SMEM bytes are exactly what Mosaic GPU allocates (its error says)."""
    mask = MaskSpec(seq_q=1024, seq_kv=1024)
    shape = (1, 1024, 2, head_dim)
    need = max(config.dkdv_smem_bytes(head_dim),
               config.dq_smem_bytes(head_dim) if config.deterministic else 0)
    if need <= mosaic_config.SMEM_BUDGET:
        _lower_for_cuda(shape, shape, BF16, mask, config)
        return
    with pytest.raises(ValueError, match="shared memory"):
        _lower_for_cuda(shape, shape, BF16, mask, config)
    monkeypatch.setattr(MosaicBackwardConfig, "check_fits", lambda *_: None)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        _lower_for_cuda(shape, shape, BF16, mask, config)
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(block_q=32), "block_q"), (dict(block_kv=128), "block_kv"),
    (dict(dq_block_q=128), "dq_block_q"), (dict(dq_block_kv=256), "dq_block_kv"),
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


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
def test_default_backward_config_fits(head_dim):
    mask = MaskSpec(seq_q=4096, seq_kv=4096, is_causal=True)
    config = default_backward_config((1, 4096, 8, head_dim), (1, 4096, 8, head_dim), BF16,
                                     mask)
    config.check_fits(mosaic_config.padded_head_dim(head_dim))
    assert config.deterministic

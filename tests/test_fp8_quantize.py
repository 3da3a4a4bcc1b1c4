"""pallas_flash.triton.quantize: the fused e4m3 block quantization, in Pallas interpret mode.

Every element is compared as bits (uint8 for e4m3, uint32 for the scales) with
``fp8.quantize``, so a NaN cannot pass. The compiled kernel (IEEE ``div.rn.f32`` in
inline PTX, which interpret mode cannot run) is checked on the CPU only as far as it
lowers to a Triton module; tests/gpu/test_fp8_gpu.py runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import fp8
from pallas_flash.triton import quantize
from tests.support import bits, quantize_ieee


def _inputs(shape, block: int, dtype, seed: int = 0) -> jax.Array:
    """Normal values with a different magnitude per tile and head, a few outliers (x100; at
    most about 5e3, within float16) and an all-zero tile (the first tile of head 0 of
    sequence 0)."""
    rng = np.random.default_rng(seed)
    batch, seq, heads, head_dim = shape
    tiles = -(-seq // block)
    magnitude = 10.0 ** rng.uniform(-3, 1, (batch, tiles, 1, heads, 1))
    x = rng.standard_normal((batch, tiles, block, heads, head_dim)) * magnitude
    x = x.reshape(batch, tiles * block, heads, head_dim)[:, :seq]
    outliers = rng.random(x.shape) < 1e-3
    x = np.where(outliers, x * 100, x)
    x[0, :block, 0] = 0.0
    return jnp.asarray(x, dtype)


def _assert_samebits(got: jax.Array, want: jax.Array) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize(("shape", "block", "dtype", "transpose"), [
    ((1, 128, 2, 64), 64, jnp.bfloat16, False),
    ((1, 128, 2, 64), 64, jnp.bfloat16, True),
    ((2, 70, 3, 80), 64, jnp.bfloat16, True),      # tail tile, padded head_dim
    ((1, 100, 2, 96), 32, jnp.float16, False),
    ((1, 100, 2, 96), 32, jnp.float16, True),
    ((1, 256, 1, 128), 128, jnp.float32, True),
    ((1, 130, 1, 256), 128, jnp.bfloat16, False),   # head_dim 256, 2-row tail tile
    ((1, 130, 1, 256), 128, jnp.float32, True),
])
def test_matches_xla_quantize(shape, block, dtype, transpose):
    x = _inputs(shape, block, dtype, seed=sum(shape))
    x8, scales = quantize.quantize_tiles(x, block, transpose=transpose, interpret=True)
    want8, want_scales = fp8.quantize(x, block)
    if transpose:
        want8 = jnp.transpose(want8, (0, 2, 3, 1))
    _assert_samebits(x8, want8)
    _assert_samebits(scales, want_scales)
    assert float(scales[0, 0, 0]) == 1.0          # the all-zero tile
    assert np.abs(np.asarray(x8, np.float32)).max() == fp8.E4M3_MAX


def test_ieee_reference_is_quantize_up_to_reciprocals():
    """tests.support.quantize_ieee, the GPU tests' bitwise reference for the compiled
    kernel, is fp8.quantize but for XLA's reciprocals: scales within a float32 ulp, e4m3
    bytes within one step, few of them off."""
    x = _inputs((2, 200, 3, 80), 64, jnp.bfloat16, seed=5)
    for transpose in (False, True):
        got8, got_scales = quantize_ieee(x, 64, transpose=transpose)
        want8, want_scales = fp8.quantize(x, 64)
        if transpose:
            want8 = jnp.transpose(want8, (0, 2, 3, 1))
        assert got8.shape == want8.shape and got_scales.shape == want_scales.shape
        np.testing.assert_allclose(got_scales, np.asarray(want_scales), rtol=2 ** -23, atol=0)
        step = np.abs(bits(got8).astype(np.int16) - bits(want8).astype(np.int16))
        assert step.max() <= 1 and step.mean() < 1e-2
        assert np.abs(np.asarray(got8, np.float32)).max() == fp8.E4M3_MAX


def test_float64_input_is_read_as_float32():
    with jax.enable_x64():
        x = _inputs((1, 64, 1, 64), 64, jnp.float64)
        x8, scales = quantize.quantize_tiles(x, 64, interpret=True)
        want8, want_scales = fp8.quantize(x, 64)
    _assert_samebits(x8, want8)
    _assert_samebits(scales, want_scales)


@pytest.mark.parametrize("rotate", [False, True])
def test_quantize_operands_kernel_matches_xla(rotate):
    """GQA, lengths that are no multiple of the tiles, with and without the rotation."""
    q = _inputs((1, 100, 4, 64), 64, jnp.bfloat16, seed=1)
    k, v = (_inputs((1, 150, 2, 64), 128, jnp.bfloat16, seed=s) for s in (2, 3))
    kwargs = dict(block_q=64, block_kv=128, hadamard_key=jax.random.key(4) if rotate else None)
    got = fp8.quantize_operands(q, k, v, implementation="triton", interpret=True, **kwargs)
    want = fp8.quantize_operands(q, k, v, implementation="xla", **kwargs)
    for name, a, b in zip(got._fields, got, want, strict=True):
        assert a.shape == b.shape, name
        _assert_samebits(a, b)


def test_quantize_operands_default_matches_quantize():
    """On the CPU the default is XLA (the compiled kernel needs a GPU): quantize's bits."""
    q = _inputs((1, 64, 2, 64), 64, jnp.bfloat16)
    ops = fp8.quantize_operands(q, q, q, block_q=64, block_kv=64)
    _assert_samebits(ops.vt, jnp.transpose(fp8.quantize(q, 64)[0], (0, 2, 3, 1)))


def test_compiled_kernel_lowers_for_hopper():
    """The compiled path (inline ``div.rn.f32``, e4m3 conversion, transposed store) builds
    a Triton module for an H200 on the CPU; only a GPU can compile and run it."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                       platform="gpu")
    x = jax.ShapeDtypeStruct((1, 200, 2, 80), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
        lowered = jax.jit(lambda x: quantize.quantize_tiles(x, 128, transpose=True)).trace(
            x).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "div.rn.f32" in text


@pytest.mark.parametrize(("shape", "kwargs", "message"), [
    ((64, 2, 64), dict(block=64), "x must be"),
    ((1, 64, 2, 64), dict(block=64, dtype=jnp.int32), "float dtype"),
    ((1, 64, 2, 64), dict(block=48), "block must be a power of two"),
    ((1, 64, 2, 64), dict(block=0), "block must be a power of two"),
    ((1, 64, 2, 200), dict(block=512), "at most"),
    ((1, 64, 2, 64), dict(block=64, transpose=1), "transpose must be"),
    ((1, 64, 2, 64), dict(block=64, interpret=None), "interpret must be"),
])
def test_bad_arguments_are_refused(shape, kwargs, message):
    x = jnp.zeros(shape, kwargs.pop("dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=message):
        quantize.quantize_tiles(x, **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(implementation="mosaic"), "implementation must be"),
    pytest.param(dict(implementation="triton"), "compute capability",
                 marks=pytest.mark.skipif(quantize.kernel_available(), reason="runs here")),
    (dict(implementation="triton", interpret=True, block_kv=192), "power of two"),
])
def test_quantize_operands_refuses(kwargs, message):
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    kwargs = dict(dict(block_q=64, block_kv=128), **kwargs)
    with pytest.raises(ValueError, match=message):
        fp8.quantize_operands(q, q, q, **kwargs)

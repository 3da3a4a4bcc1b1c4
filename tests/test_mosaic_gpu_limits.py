"""What Pallas Mosaic GPU (jax 0.11.2) cannot say that FA3's Hopper backward does.

The minimal repros behind ``docs/architecture.md``'s "What Pallas Mosaic GPU 0.11.2 does
not let us say": each builds the smallest kernel that needs the control, lowers it for CUDA
on the CPU (the Pallas and Mosaic GPU lowering, layout inference and wgmma's shape checks
run there; only ptxas does not), and checks that it is refused, beside a control kernel
that differs only in what is missing and lowers. Both lowering semantics are tried: our
kernels use the default (warpgroup), the lane one is the other way in.

When a jax upgrade makes one of these pass, the test fails: the control exists then, and
the backward's notes on it (and #27's gap) are worth revisiting.
"""

from __future__ import annotations

import inspect

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import launch_context as mgpu_launch_context
from jax.experimental.mosaic.gpu import utils as mgpu_utils

SEMANTICS = (plgpu.LoweringSemantics.Warpgroup, plgpu.LoweringSemantics.Lane)
BF16 = jnp.bfloat16


def _smem(shape, swizzle: int = 128, dtype=BF16):
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _lower_gemm(semantics, a_shape, b_shape, *, a_swizzle=128, b_swizzle=128, a_op=None,
                out=None, extra_scratch=None):
    """Lowers for CUDA a one-warpgroup kernel: A and B to SMEM by TMA, then
    ``acc = A·B`` with ``plgpu.wgmma``. ``a_op(a_smem)``: the A operand (default: the SMEM
    tile); ``out(acc_value, o_ref, scratch)``: what is done with the result (default: stored
    to the output)."""
    m, n = a_shape[0], b_shape[1]

    def body(a_ref, b_ref, o_ref, a_smem, b_smem, ready, **scratch):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, ready)
        plgpu.copy_gmem_to_smem(b_ref, b_smem, ready)
        plgpu.barrier_wait(ready)
        a = a_smem if a_op is None else a_op(a_smem)

        def gemm(acc):
            plgpu.wgmma(acc, a, b_smem)
            return plgpu.wgmma_accumulator_load(acc, wait_n=0)
        result = pl.run_scoped(gemm, plgpu.ACC((m, n), jnp.float32))
        if out is None:
            o_ref[...] = result
        else:
            out(result, o_ref, scratch)

    scratch = dict(a_smem=_smem(a_shape, a_swizzle), b_smem=_smem(b_shape, b_swizzle),
                   ready=plgpu.Barrier(num_arrivals=2), **(extra_scratch or {}))
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
                          scratch_types=scratch, num_threads=1, thread_name="wg",
                          compiler_params=plgpu.CompilerParams(lowering_semantics=semantics))
    operands = (jax.ShapeDtypeStruct(a_shape, BF16), jax.ShapeDtypeStruct(b_shape, BF16))
    return jax.jit(kernel).trace(*operands).lower(lowering_platforms=("cuda",))


def _register_a(transpose: bool):
    def a_op(a_smem):
        a = plgpu.load(a_smem, layout=plgpu.Layout.WGMMA, optimized=True)
        return a.T if transpose else a
    return a_op


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_no_transposed_register_operand(semantics):
    """FA3's dQ = dS·K with dS from registers would need dSᵀ (our consumers hold dSᵀ) as
    wgmma's A: a register value is taken as A, but not its transpose."""
    _lower_gemm(semantics, (64, 64), (64, 128), a_op=_register_a(False))  # control
    with pytest.raises(NotImplementedError, match="transpose"):
        _lower_gemm(semantics, (64, 64), (64, 128), a_op=_register_a(True))


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_no_register_order_staging(semantics):
    """FA3 stages its float32 dQ in register order for a flat bulk reduce-add; a WGMMA-layout
    value stores to a tile of its own shape, but cannot be flattened to stage it as is."""
    def store_flat(result, o_ref, scratch):
        scratch["flat"][...] = result.reshape(-1)

    _lower_gemm(semantics, (64, 64), (64, 64))  # control: stored as a [64, 64] tile
    with pytest.raises(ValueError, match=r"Can't reshape|Failed to infer a possible set"):
        _lower_gemm(semantics, (64, 64), (64, 64), out=store_flat,
                    extra_scratch=dict(flat=plgpu.SMEM((64 * 64,), jnp.float32)))


@pytest.mark.parametrize("semantics", SEMANTICS)
@pytest.mark.parametrize("swizzle", [128, 64])
def test_eighty_row_contraction_needs_the_32_byte_swizzle(semantics, swizzle):
    """FA3's 80-query block at head_dim 128 puts 80 in the K of dV += Pᵀ·dO (Pᵀ [64 keys,
    80 queries] from registers, dO [80, 128] in SMEM): wgmma steps through K one swizzle
    width at a time, so 80 lowers only with a 32-byte swizzled dO (and Q, for dK)."""
    def lower(k, b_swizzle):
        return _lower_gemm(semantics, (64, k), (k, 128), a_swizzle=32, b_swizzle=b_swizzle,
                           a_op=_register_a(False))
    lower(80, 32)  # the controls: 80 at 32 bytes, 128 and 96 at the wider swizzles
    lower(128, 128)
    lower(96, 64)
    with pytest.raises(ValueError, match="K must be a multiple of"):
        lower(80, swizzle)


def test_named_barrier_only_as_inline_ptx():
    """FA3 syncs chosen warpgroups with named barriers (``bar.sync id, n``); plgpu has
    mbarriers and cluster barriers only, but the Mosaic GPU layer beneath takes the PTX
    (``plgpu.inline_mgpu`` + ``mosaic.gpu.utils.inline_ptx``), and it lowers."""
    names = [n for n in dir(plgpu) if "barrier" in n.lower()]
    assert "barrier_wait" in names and "barrier_arrive" in names  # the control
    assert not [n for n in names if "named" in n.lower() or "sync" in n.lower()], names

    @plgpu.inline_mgpu()
    def consumers_meet(ctx):
        del ctx
        mgpu_utils.inline_ptx("bar.sync 5, 256;", has_side_effects=True)

    def body(o_ref):
        wg = jax.lax.axis_index("wg")
        pl.when(wg < 2)(consumers_meet)  # the two consumer warpgroups, 256 threads

        @pl.when(wg == 0)
        def _store():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
                          num_threads=3, thread_name="wg")
    lowered = jax.jit(kernel).trace().lower(lowering_platforms=("cuda",))
    assert "bar.sync 5, 256;" in lowered.as_text()


def test_no_cache_hint_on_tma():
    """FA3 loads Q and dO and reduces dQ with ``EVICT_LAST``; plgpu's TMA copies take no
    cache hint, nor does the Mosaic GPU layer's ``LaunchContext.async_copy`` they lower to."""
    for copy in (plgpu.copy_gmem_to_smem, plgpu.copy_smem_to_gmem,
                 mgpu_launch_context.LaunchContext.async_copy):
        params = inspect.signature(copy).parameters
        assert "predicate" in params  # the control: the signature is what we read
        assert not [p for p in params if "cache" in p or "evict" in p], list(params)
    assert "reduction_op" in inspect.signature(plgpu.copy_smem_to_gmem).parameters

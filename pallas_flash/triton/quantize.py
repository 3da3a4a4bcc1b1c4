"""Block quantization to e4m3 in one pass: a Triton-lowered Pallas kernel.

:func:`pallas_flash.fp8.quantize` in XLA reads each tensor twice (the tile maxima, then the
division and conversion) and, for the FP8 kernel's Vᵀ operand, transposes in a third
pass. Here one program owns one tile — ``block`` sequence positions of one head — and
reads it once: it takes the tile's maximum magnitude, the scale ``amax / 448`` (1 for an
all-zero tile), divides, rounds to e4m3 and writes the tile (transposed for Vᵀ) and its
scale.

The arithmetic is IEEE float32's: both divisions correctly rounded (the quotients through
the tile's reciprocal and an FMA correction, :func:`_divide_by_tile_scale`), the rounding
to e4m3 to nearest, ties to even. :func:`~pallas_flash.fp8.quantize` writes the same divisions, but
XLA's results were not IEEE's on the H200 nor on the CPU (2026-12-02): its scales
``amax / 448`` and 28 % of its quotients on the H200 were one float32 ulp off, as from
multiplying by a reciprocal. At rounding ties the two can then differ by one e4m3 step
(0.02 % of the bytes of a test on the H200). In interpret mode the divisions are XLA's and
the bits match ``fp8.quantize``'s.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.contract import DTYPES, kernel_output
from pallas_flash.fp8_format import E4M3, E4M3_MAX
from pallas_flash.padding import next_power_of_2

#: Elements of one tile at most: a program holds its tile in registers (float32, up to 16
#: warps of 32 threads: 128 values per thread at this size).
MAX_TILE_ELEMENTS = 1 << 16


def kernel_available() -> bool:
    """Whether the default device runs the compiled kernel: a CUDA GPU of compute
    capability 8.9 or newer (the first with e4m3 conversions; ROCm reports none)."""
    device = jax.devices()[0]
    capability = re.match(r"(\d+)\.(\d+)", str(getattr(device, "compute_capability", "")))
    return (device.platform == "gpu" and capability is not None
            and (int(capability[1]), int(capability[2])) >= (8, 9))


def unsupported(block: int, head_dim: int) -> str | None:
    """Why the kernel cannot quantize tiles of ``block`` positions at ``head_dim``, or None."""
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        return f"block must be a power of two, got {block!r}"
    padded_d = next_power_of_2(head_dim)
    if block * padded_d > MAX_TILE_ELEMENTS:
        return (f"block * padded head_dim must be at most {MAX_TILE_ELEMENTS} (a tile lives "
                f"in registers), got block {block} with head_dim {head_dim} (padded to "
                f"{padded_d})")
    return None


def _divide(a: jax.Array, b: jax.Array, *, interpret: bool) -> jax.Array:
    """``a / b`` correctly rounded. Triton lowers float32 ``/`` to ``div.full.f32``, which
    is off by up to 2 ulp; ``div.rn.f32`` is IEEE division."""
    if interpret:
        # Hidden from XLA's rewrite of a division by a constant into a multiply by its
        # rounded reciprocal (see fp8_format.tile_scale): exact, as div.rn.
        return a / lax.optimization_barrier(b)
    [quotient] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return quotient


#: Tiles whose scale lies below this are rescaled by :data:`_RESCALE` before dividing by
#: a reciprocal: the reciprocal of a scale below about 2**-128 overflows float32, and
#: rescaled scales (at least 2**-85) keep the residuals of quotients that matter in e4m3
#: (at least 2**-10) normal, as Markstein's correction needs.
_TINY_SCALE = 2.0 ** -60
_RESCALE = 2.0 ** 64


def _divide_by_tile_scale(x: jax.Array, scale: jax.Array, *, interpret: bool) -> jax.Array:
    """``x / scale`` correctly rounded, for one ``scale`` [1, 1] per tile, at the cost of
    a multiply and two FMAs per element instead of a ``div.rn`` per element (on the H200,
    2026-12-02, quantizing K took 0.065 ms with ``div.rn`` and 0.047 ms with a bare
    multiply by the reciprocal).

    Markstein's theorem: with ``r = RN(1/scale)`` and ``q = RN(x·r)`` within an ulp of the
    quotient, the residual ``x − q·scale`` is exact in one FMA and ``RN(q + residual·r)``
    is the correctly rounded ``x / scale``, barring overflow and underflow. Quotients here
    are at most 448 in magnitude; those small enough to be subnormal round to 0 in e4m3
    whatever their last bits. A tiny scale is first multiplied, with ``x``, by a power of
    two (exact: ``|x| <= 448 · scale``), so that its reciprocal stays finite.
    """
    if interpret:
        return x / scale
    factor = jnp.where(scale < _TINY_SCALE, _RESCALE, 1.0)
    scale = scale * factor
    reciprocal = _divide(jnp.ones_like(scale), scale, interpret=False)
    # mul.rn and fma.rn are never contracted or reassociated by ptxas. The sign is copied
    # from x: for x = -0 the correction computes +0 + -0 = +0 (the H200 test, 2026-12-02).
    [quotient] = plgpu.elementwise_inline_asm(
        "{ .reg .f32 q, e; mul.rn.f32 q, $1, $2; neg.f32 e, q;"
        " fma.rn.f32 e, e, $3, $1; fma.rn.f32 q, e, $2, q; copysign.f32 $0, $1, q; }",
        args=[x * factor, jnp.broadcast_to(reciprocal, x.shape),
              jnp.broadcast_to(scale, x.shape)],
        constraints="=r,r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return quotient


def _quantize_kernel(x_ref, x8_ref, scale_ref, *, block: int, seq: int, head_dim: int,
                     transpose: bool, interpret: bool):
    """One tile: x_ref ``[block, padded_d]`` (rows past ``seq`` and columns past
    ``head_dim`` lie outside the array), x8_ref the same (``[padded_d, block]`` with
    ``transpose``), scale_ref ``[1, 1]``."""
    padded_d = x_ref.shape[-1]
    rows = jnp.arange(block) < seq - pl.program_id(1) * block
    cols = jnp.arange(padded_d) < head_dim
    masked = seq % block or padded_d != head_dim
    # Outside the array the tile reads zeros: they change neither the maximum nor (being
    # masked on the way out) the output, as fp8.quantize's zero padding.
    mask = rows[:, None] & cols[None, :] if masked else None
    x = plgpu.load(x_ref, mask=mask, other=0 if masked else None).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), keepdims=True)                               # [1, 1]
    # An all-zero tile keeps scale 1 (no 0/0), as fp8.quantize.
    scale = jnp.where(amax > 0, _divide(amax, jnp.full_like(amax, E4M3_MAX),
                                        interpret=interpret), 1.0)
    x8 = _divide_by_tile_scale(x, scale, interpret=interpret).astype(E4M3)
    if transpose:  # the mask is built transposed rather than moved through shared memory
        x8, mask = x8.T, cols[:, None] & rows[None, :] if masked else None
    plgpu.store(x8_ref, x8, mask=mask)
    scale_ref[...] = scale


def quantize_tiles(x: jax.Array, block: int, *, transpose: bool = False,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_flash.fp8.quantize` (per tile) in one read of ``x``, optionally with
    the output transposed to ``[batch, heads, head_dim, seq]`` (the FP8 kernel's Vᵀ).

    Args:
      x: ``[batch, seq, heads, head_dim]``, a float dtype (bfloat16, float16 and float32
        are read as they are; others are cast to float32 first, an extra pass).
      block: sequence positions per scale and head, a power of two with
        ``block * next_power_of_2(head_dim) <= MAX_TILE_ELEMENTS``.
      transpose: write the e4m3 tensor as ``[batch, heads, head_dim, seq]``.
      interpret: run the kernel in Pallas interpret mode (on the CPU); otherwise it needs a
        CUDA GPU of compute capability >= 8.9 (:func:`kernel_available`).

    Returns:
      ``(x_fp8, scales)``: e4m3 ``x_fp8`` of ``x``'s shape (transposed with
      ``transpose``) and float32 ``scales`` of shape ``[batch, ceil(seq / block), heads]``:
      ``fp8.quantize(x, block)`` in IEEE arithmetic (see the module docstring).
    """
    if x.ndim != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must have a float dtype, got {x.dtype}")
    batch, seq, heads, head_dim = x.shape
    reason = unsupported(block, head_dim)
    if reason is not None:
        raise ValueError(reason)
    if not isinstance(transpose, bool):
        raise ValueError(f"transpose must be a bool, got {transpose!r}")
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if jnp.dtype(x.dtype) not in DTYPES:
        x = x.astype(jnp.float32)
    tiles, padded_d = -(-seq // block), next_power_of_2(head_dim)

    def tile(h, t, b):
        return (b, t, h, 0)

    if transpose:
        out_spec = pl.BlockSpec((None, None, padded_d, block), lambda h, t, b: (b, h, 0, t))
        out_shape = (batch, heads, head_dim, seq)
    else:
        out_spec = pl.BlockSpec((None, block, None, padded_d), tile)
        out_shape = x.shape
    tile_elements = block * padded_d
    kernel = functools.partial(_quantize_kernel, block=block, seq=seq, head_dim=head_dim,
                               transpose=transpose, interpret=interpret)
    return pl.pallas_call(
        kernel,
        # Heads vary fastest across launches: a row of x holds all heads, so neighbouring
        # programs read neighbouring bytes of the same rows.
        grid=(heads, tiles, batch),
        in_specs=[pl.BlockSpec((None, block, None, padded_d), tile)],
        out_specs=[out_spec, pl.BlockSpec((None, 1, 1), lambda h, t, b: (b, t, h))],
        out_shape=[kernel_output(out_shape, E4M3, x),
                   kernel_output((batch, tiles, heads), jnp.float32, x)],
        # One warp per 2048 elements (64 float32 registers per thread for the tile), 4 to 16.
        compiler_params=plgpu.CompilerParams(
            num_warps=min(16, max(4, tile_elements // 2048)), num_stages=1),
        interpret=interpret,
        name="pallas_flash_quantize",
    )(x)

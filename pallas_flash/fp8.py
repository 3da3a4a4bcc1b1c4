"""FP8 (e4m3) attention numerics: block quantization and incoherent processing.

FlashAttention-3 (Shah et al. 2024, Sec. 3.3) runs both GEMMs of attention in FP8, whose
tensor cores are twice as fast as bf16. e4m3 keeps 3 mantissa bits and a range of ±448, so
how the inputs are scaled decides the error:

* **Per-tensor scaling** (the baseline): one scale ``s = max|X| / 448`` for the whole tensor.
  One outlier sets the scale for everything and small values lose their bits.
* **Block quantization**: one scale per tile of ``block`` sequence positions of one head —
  the tile a kernel loads anyway, so dequantizing costs one multiply per tile: for Q·Kᵀ the
  scales of the Q tile and the K tile fold into the softmax scale. An outlier only coarsens
  its own tile.
* **Incoherent processing**: multiply Q and K by the same random orthogonal matrix
  ``M = H · diag(±1) / √d`` (H a Hadamard matrix) along head_dim. ``(QM)(KM)ᵀ = QKᵀ``
  exactly, but every entry of QM mixes all d entries of its row with random signs, so an
  outlier is spread over the row and the tile maximum — hence the scale — shrinks.

:func:`reference_forward` is the FP8 forward written in XLA with exactly these numerics
(FP8 operands, float32 accumulation, P rounded to FP8 before P·V): the specification an
FP8 kernel must reproduce, and :func:`attention_fp8`'s path where the kernel cannot run; it
is not fast (XLA on most devices upcasts FP8). The accuracy study around it (the public
reference, the tile-by-tile online version, the FP8 backward) lives in
:mod:`pallas_flash.tutorial.fp8_study`.

:func:`attention_fp8` is the fast path: :func:`quantize_operands` (on the GPU one fused
Triton pass per operand, :mod:`pallas_flash.triton.quantize`; XLA elsewhere), then the Hopper
kernel of :mod:`pallas_flash.mosaic.forward_fp8` (or the reference where it cannot run).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import dispatch
from pallas_flash.api import available_implementations
from pallas_flash.arguments import canonical_bool, canonical_scale, check_deterministic
from pallas_flash.autodiff import attention_backward
from pallas_flash.contract import DTYPES, StaticArgs, varying_like
from pallas_flash.fp8_format import E4M3, E4M3_MAX, divide_exactly, tile_scale
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis, round_up


def quantize(x: jax.Array, block: int | None) -> tuple[jax.Array, jax.Array]:
    """Rounds ``x`` to e4m3 with one scale per tile (``block`` positions) or per tensor.

    Args:
      x: ``[batch, seq, heads, head_dim]``, any float dtype.
      block: sequence positions per scale, per head; ``None`` for one scale per tensor.

    Returns:
      ``(x_fp8, scales)``: ``x_fp8`` like ``x`` in e4m3 and float32 ``scales`` of shape
      ``[batch, ceil(seq / block), heads]`` (``[]`` per tensor), so that
      ``x ≈ x_fp8 · scale`` (:func:`dequantize`). All-zero tiles get scale 1.
    """
    check_float_array(x, "x")
    block = _check_block(block, "block", allow_none=True)
    x = x.astype(jnp.float32)
    if block is None:
        scale = tile_scale(jnp.max(jnp.abs(x)))
        return (x / scale).astype(E4M3), scale
    batch, seq, heads, head_dim = x.shape
    tiles = pad_axis(x, 1, round_up(seq, block)).reshape(batch, -1, block, heads, head_dim)
    scales = tile_scale(jnp.max(jnp.abs(tiles), axis=(2, 4)))     # [batch, tiles, heads]
    x_fp8 = (tiles / scales[:, :, None, :, None]).astype(E4M3)
    return x_fp8.reshape(batch, -1, heads, head_dim)[:, :seq], scales



def dequantize(x_fp8: jax.Array, scales: jax.Array, block: int | None) -> jax.Array:
    """Inverse of :func:`quantize` (up to its rounding): float32 ``[batch, seq, heads, d]``.

    ``scales``: ``quantize``'s, ``[batch, ceil(seq / block), heads]`` (a scalar when
    ``block`` is None).
    """
    block = _check_block(block, "block", allow_none=True)
    if getattr(x_fp8, "ndim", None) != 4:
        raise ValueError(f"x_fp8 must be an array [batch, seq, heads, head_dim], got "
                         f"{describe(x_fp8)}")
    batch, seq, heads, _ = x_fp8.shape
    want = () if block is None else (batch, -(-seq // block), heads)
    if np.shape(scales) != want or not jnp.issubdtype(jnp.result_type(scales), jnp.floating):
        raise ValueError(f"scales must be float of shape {want} (quantize's, for block "
                         f"{block}), got {describe(scales)}")
    x = x_fp8.astype(jnp.float32)
    per = per_position(scales, block, x.shape[1])
    return x * (per if per.ndim == 0 else per[..., None])


def random_hadamard(key: jax.Array, head_dim: int) -> jax.Array:
    """A random orthogonal ``[head_dim, head_dim]`` float32 matrix ``H · diag(±1) / √d``.

    ``head_dim`` must be a power of two (Sylvester's construction of H).
    """
    if (isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer))
            or head_dim < 1 or head_dim & (head_dim - 1) or head_dim > dispatch.MAX_HEAD_DIM):
        raise ValueError(f"head_dim must be a power of two up to {dispatch.MAX_HEAD_DIM} (the "
                         f"kernels' largest) for a Hadamard matrix, got {head_dim!r}")
    _check_key(key, "key", allow_none=False)
    hadamard = np.ones((1, 1), np.float32)
    while hadamard.shape[0] < head_dim:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = jax.random.rademacher(key, (head_dim,), jnp.float32)
    return jnp.asarray(hadamard) * signs[None, :] / math.sqrt(head_dim)


def round_probabilities(p: jax.Array) -> jax.Array:
    """P ∈ [0, 1] through e4m3 with the fixed scale 448, as the FP8 forward rounds it; a
    backward's P = exp(S − lse) can exceed 1 where its S is rounded differently from the
    forward's, and saturates (``cvt.satfinite``) instead of becoming NaN."""
    # Divided exactly: XLA would compile "/ 448" as a multiply by a rounded 1/448 in some
    # programs and not in others (jit or eager, jax 0.11 or 0.12), where the kernel divides.
    return divide_exactly(
        jnp.minimum(p * E4M3_MAX, E4M3_MAX).astype(E4M3).astype(jnp.float32), E4M3_MAX)


def quantize_operands(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int,
                      block_kv: int, hadamard_key: jax.Array | None = None,
                      implementation: Literal["triton", "xla"] | None = None,
                      interpret: bool = False) -> Any:
    """The FP8 kernel's inputs: block quantization as :func:`reference_forward` does it.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]``.
      block_q, block_kv: the kernel's tiles, one scale per tile and head.
      hadamard_key: rotate Q and K first (incoherent processing).
      implementation: ``"triton"``: the fused kernel
        (:func:`pallas_flash.triton.quantize.quantize_tiles`: one read of each operand,
        Vᵀ written by the same pass; a CUDA GPU of compute capability >= 8.9, or
        ``interpret=True``; power-of-two blocks); ``"xla"``: :func:`quantize` (a pass for
        the tile maxima, another for the rounding); ``None``: triton where it runs
        compiled (the GPU, blocks it takes), else xla. The kernel's divisions are IEEE's
        and XLA's are not always (one float32 ulp off), so a few e4m3 bytes at rounding
        ties can differ by one step (0.02 % on the H200). On the H200 (2026-12-02,
        ``benchmarks/fp8_cudnn.py``, head_dim 128, L 4096, dense) the whole
        ``attention_fp8`` ran at 535 TFLOP/s with XLA's quantization, 594 with the
        kernel dividing by ``div.rn`` and 657 with its reciprocal and FMA correction
        (``docs/fp8.md``).
      interpret: run the Triton kernel in Pallas interpret mode (CPU).

    Returns:
      :class:`~pallas_flash.mosaic.forward_fp8.Fp8Operands`; V comes transposed to
      ``[batch, kv_heads, head_dim, seq_kv]`` (FP8 wgmma reads only K-major operands, and
      P·V contracts over keys).
    """
    block_q, block_kv = check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    check_shapes(q, k, v, is_causal=False)
    interpret = canonical_bool(interpret, "interpret")
    if implementation not in (None, "triton", "xla"):
        raise ValueError(f"implementation must be 'triton', 'xla' or None, got "
                         f"{implementation!r}")
    triton = dispatch.backend("triton")
    if implementation == "triton" and not (interpret or triton.fp8_quantizer_available()):
        raise ValueError("implementation='triton' needs a CUDA GPU of compute capability "
                         ">= 8.9 or interpret=True")
    if implementation is None:
        head_dim = q.shape[-1]
        compiled = not interpret and triton.fp8_quantizer_available() and not any(
            triton.fp8_quantizer_unsupported(block, head_dim) for block in (block_q, block_kv))
        implementation = "triton" if compiled else "xla"
    if hadamard_key is not None:
        q, k, _ = rotate(q, k, hadamard_key)
    if implementation == "xla":
        (q8, q_scale), (k8, k_scale) = quantize(q, block_q), quantize(k, block_kv)
        v8, v_scale = quantize(v, block_kv)
        vt = jnp.transpose(v8, (0, 2, 3, 1))
    else:  # bf16 / f16 operands are read as they are: the kernel widens them to float32
        tiles = functools.partial(triton.fp8_quantize_tiles, interpret=interpret)
        (q8, q_scale), (k8, k_scale) = tiles(q, block_q), tiles(k, block_kv)
        vt, v_scale = tiles(v, block_kv, transpose=True)
    return dispatch.backend("mosaic").Fp8Operands(q=q8, q_scale=q_scale, k=k8, k_scale=k_scale,
                                                  vt=vt, v_scale=v_scale)


def attention_fp8(q: jax.Array, k: jax.Array, v: jax.Array, *, is_causal: bool = False,
                  scale: float | None = None, hadamard_key: jax.Array | None = None,
                  config: Any = None, out_scale: float | jax.Array | None = None,
                  return_residual: bool = False, deterministic: bool = False,
                  implementation: Literal["mosaic", "xla"] | None = None,
                  interpret: bool = False):
    """FP8 (e4m3) attention forward: FlashAttention-3's block-quantized kernel on Hopper.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]``, bfloat16, float16 or float32 (one dtype),
        ``N % K == 0`` (GQA: K/V are not repeated), ``D <= 256``.
      is_causal: query ``i`` sees keys ``<= i + S - T``. The diagonal is aligned
        bottom-right, as in :func:`reference_forward`; with ``T == S`` that is the
        usual causal mask. ``T > S`` is refused (rows that see no key).
      scale: softmax scale, default ``1/√D``.
      hadamard_key: rotate Q and K by :func:`random_hadamard` before quantizing (D must
        be a power of two).
      config: the kernel's tiles and schedule (:class:`~pallas_flash.mosaic.MosaicConfig`;
        three consumers need ``block_kv + head_dim <= 256``); Q is
        quantized per ``block_q`` rows and K, V per ``block_kv`` keys, whichever
        implementation runs. Default:
        :func:`pallas_flash.mosaic.forward_fp8.default_config` for this head_dim, mask and
        key length.
      out_scale: return the output in e4m3 as well: ``out ≈ out_fp8 · out_scale`` (a
        positive float32 scalar, the delayed scaling of FP8 training recipes; values
        beyond ``±448 · out_scale`` saturate). The output's ``amax`` (max ``|out|`` before
        rounding, float32) comes with it, for the caller's next scale.
      return_residual: also return ``lse: [B, T, N]`` float32 (natural log).
      deterministic: ``True``: the gradients are bitwise identical on every run, as with
        :func:`pallas_flash.attention`'s ``deterministic`` (on Hopper the separate dQ
        kernel); ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` does the same. The forward
        is reproducible either way.
      implementation: ``"mosaic"`` (the kernel: sm90, or the CPU with ``interpret=True``),
        ``"xla"`` (:func:`reference_forward`, any backend, same numerics, slow);
        ``None``: mosaic where it can run, else xla.
      interpret: run the kernel in Mosaic GPU interpret mode (CPU).

    Returns:
      ``out: [B, T, N, D]`` bfloat16; with ``out_scale``, ``(out_fp8, amax)`` in its place;
      with ``return_residual``, ``lse`` after them: ``(out, lse)``, ``(out_fp8, amax, lse)``.

    The kernel follows the reference's rounding exactly (the same e4m3 operands and scales,
    P rounded as P·448, row sums of the unrounded P) except in one respect: it rounds P
    relative to the running row maximum of the online softmax, the reference relative to
    the final one, so the two differ by a few FP8 roundings where a row's maximum moves.

    ``jax.grad`` (``jax.vjp``) runs the backward kernels of the inputs' dtype on this
    forward's (out, lse): the gradient of exact attention, straight through the rounding,
    with no second forward. Forward-mode AD is not defined (a ``jax.custom_vjp``).
    """
    is_causal, return_residual, interpret = (canonical_bool(flag, name) for name, flag in (
        ("is_causal", is_causal), ("return_residual", return_residual),
        ("interpret", interpret)))
    _check_inputs(q, k, v, is_causal)
    head_dim = q.shape[3]
    scale = canonical_scale(scale, head_dim)
    _check_key(hadamard_key, "hadamard_key", allow_none=True)
    config = _kernel_config(config, head_dim, is_causal=is_causal, seq_kv=k.shape[1])
    _check_out_scale(out_scale)
    call = _Fp8Call(is_causal=is_causal, scale=scale, config=config,
                    kernel=_implementation(implementation, interpret) == "mosaic",
                    interpret=interpret,
                    deterministic=dispatch.deterministic_backward(
                        check_deterministic(deterministic)))
    out, lse = _differentiable_fp8(q, k, v, hadamard_key, call)
    return _results(out, lse, out_scale, return_residual)


@dataclasses.dataclass(frozen=True)
class _Fp8Call:
    """The static part of an :func:`attention_fp8` call (``kernel``: the Mosaic kernel,
    else the XLA reference)."""

    is_causal: bool
    scale: float
    config: Any
    kernel: bool
    interpret: bool
    deterministic: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _differentiable_fp8(q, k, v, hadamard_key, call: _Fp8Call):
    """``(out [B, T, N, D], lse [B, N, T])`` of the FP8 forward, with the bf16 backward.

    The FP8 forward rounds its operands, a step function whose derivative is zero almost
    everywhere; its gradient is taken as exact attention's (straight through the rounding,
    as FP8 training does), by the backward kernels of the inputs' dtype on the FP8
    forward's own (O, lse): no second forward. The residuals' FP8 error reaches the
    gradients damped: on the CPU (L 1024, head_dim 128, N(0, 1)) 0.5-0.8 % (dense) and
    1.7-1.8 % (causal) from float64 gradients, where the FP8 output itself is 5 % off. A
    backward with FP8 GEMMs loses far more (docs/measured.md, the FP8 backward study).
    """
    return _fp8_forward(q, k, v, hadamard_key, call)


def _fp8_forward(q, k, v, hadamard_key, call: _Fp8Call):
    config = call.config
    if not call.kernel:
        group = q.shape[2] // k.shape[2]
        return reference_forward(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2),
                          hadamard_key=hadamard_key, block_q=config.block_q,
                          block_kv=config.block_kv, scale=call.scale,
                          is_causal=call.is_causal, fp8_pv=True)
    operands = quantize_operands(q, k, v, block_q=config.block_q, block_kv=config.block_kv,
                                 hadamard_key=hadamard_key)
    return _run_kernel(operands, is_causal=call.is_causal, scale=call.scale, config=config,
                       interpret=call.interpret)


def _fp8_forward_rule(q, k, v, hadamard_key, call: _Fp8Call):
    out, lse = _fp8_forward(q, k, v, hadamard_key, call)
    return (out, lse), (q, k, v, hadamard_key, out, lse)


def _fp8_backward_rule(call: _Fp8Call, residuals, cotangents):
    q, k, v, hadamard_key, out, lse = residuals
    d_out, d_lse = cotangents
    # Q·Kᵀ is the same with or without the rotation, so the backward reads q, k unrotated.
    mask = MaskSpec(q.shape[1], k.shape[1], is_causal=call.is_causal,
                    causal_alignment="bottom_right")
    name = dispatch.choose(q.shape, k.shape, q.dtype, mask, dispatch.PLAIN_CALL,
                           interpret=False)
    backend = dispatch.backend(name)
    static = StaticArgs(kernels=backend.KERNELS, mask=mask, scale=call.scale,
                        config=backend.default_config(q.shape, k.shape, q.dtype, mask),
                        interpret=False, deterministic=call.deterministic)
    dq, dk, dv = attention_backward(static, q, k, v, out, lse, d_out, d_lse)
    key_cotangent = (None if hadamard_key is None
                     else np.zeros(hadamard_key.shape, jax.dtypes.float0))
    return dq, dk, dv, key_cotangent


_differentiable_fp8.defvjp(_fp8_forward_rule, _fp8_backward_rule)


def attention_fp8_quantized(q: jax.Array, k: jax.Array, v: jax.Array, q_scale: jax.Array,
                            k_scale: jax.Array, v_scale: jax.Array, *,
                            scale_blocks: tuple[int, int] | None = None,
                            v_transposed: bool = False, is_causal: bool = False,
                            scale: float | None = None, config: Any = None,
                            out_scale: float | jax.Array | None = None,
                            return_residual: bool = False,
                            implementation: Literal["mosaic", "xla"] | None = None,
                            interpret: bool = False):
    """FP8 attention on inputs that are already e4m3, with their scales: no quantization.

    What an FP8 training recipe (per-tensor scales) or an FP8 KV cache (per-block scales)
    hands over goes to the kernel as it is: no pass over Q, K or V is spent, except V's
    transpose to ``[B, K, D, S]`` when it comes sequence-major (FP8 wgmma reads only
    K-major operands, and P·V contracts over keys) — pass ``v_transposed=True`` to skip it.

    Args:
      q: ``[B, T, N, D]`` float8_e4m3fn; k: ``[B, S, K, D]`` float8_e4m3fn (``N % K == 0``,
        ``D <= 256``).
      v: ``[B, S, K, D]`` float8_e4m3fn, or ``[B, K, D, S]`` with ``v_transposed=True``.
      q_scale, k_scale, v_scale: ``x ≈ x_fp8 · scale``, float32: a scalar (one scale per
        tensor, as cuDNN's FP8 attention takes them) or ``[B, ceil(L / block), heads]``
        (one per ``block`` positions of one head, :func:`quantize`'s layout; ``heads`` is
        N for q and K for k, v).
      scale_blocks: ``(q_block, kv_block)``, the positions per scale of q and of k, v when
        the scales are per block. Each must be a multiple of the kernel's tile
        (``config.block_q``, ``config.block_kv``), whose scales are then repeated; default:
        the kernel's tiles.
      v_transposed: v is ``[B, K, D, S]`` (the kernel's layout).
      is_causal, scale, config, out_scale, return_residual, implementation, interpret: as
        in :func:`attention_fp8`. A Hadamard rotation (incoherent processing) is the
        caller's to apply to Q and K before quantizing them.

    Returns:
      As :func:`attention_fp8`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "dtype") or x.ndim != 4 or x.dtype != E4M3:
            raise ValueError(f"{name} must be a 4-d float8_e4m3fn array, got {describe(x)}")
    v_transposed, is_causal, return_residual, interpret = (
        canonical_bool(flag, name) for name, flag in (
            ("v_transposed", v_transposed), ("is_causal", is_causal),
            ("return_residual", return_residual), ("interpret", interpret)))
    batch, seq_kv, kv_heads, head_dim = k.shape
    if v.shape != ((batch, kv_heads, head_dim, seq_kv) if v_transposed else k.shape):
        layout = "[B, K, D, S]" if v_transposed else "[B, S, K, D]"
        raise ValueError(f"v must be {layout} matching k {k.shape}, got {v.shape}")
    check_shapes(q, k, k, is_causal)
    heads, seq_q = q.shape[2], q.shape[1]
    scale = canonical_scale(scale, head_dim)
    config = _kernel_config(config, head_dim, is_causal=is_causal, seq_kv=seq_kv)
    _check_out_scale(out_scale)
    q_block, kv_block = (config.block_q, config.block_kv) if scale_blocks is None \
        else _check_scale_blocks(scale_blocks, config)
    q_scale = _kernel_tile_scales(q_scale, "q_scale", (batch, seq_q, heads), q_block,
                                  config.block_q)
    k_scale, v_scale = (_kernel_tile_scales(x, name, (batch, seq_kv, kv_heads), kv_block,
                                            config.block_kv)
                        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    if _implementation(implementation, interpret) == "xla":
        group = heads // kv_heads
        k_rows = jnp.repeat(k, group, axis=2)
        v_rows = jnp.transpose(v, (0, 3, 1, 2)) if v_transposed else v
        v_rows = jnp.repeat(dequantize(v_rows, v_scale, config.block_kv), group, axis=2)
        out, lse = _reference_quantized(
            q, q_scale, k_rows, jnp.repeat(k_scale, group, axis=2), v_rows,
            block_q=config.block_q, block_kv=config.block_kv, scale=scale,
            is_causal=is_causal, round_p=True)
    else:
        vt = v if v_transposed else jnp.transpose(v, (0, 2, 3, 1))
        operands = dispatch.backend("mosaic").Fp8Operands(q=q, q_scale=q_scale, k=k,
                                                          k_scale=k_scale, vt=vt,
                                                          v_scale=v_scale)
        out, lse = _run_kernel(operands, is_causal=is_causal, scale=scale, config=config,
                               interpret=interpret)
    return _results(out, lse, out_scale, return_residual)


def _kernel_config(config, head_dim: int, *, is_causal: bool, seq_kv: int):
    """The FP8 kernel's ``MosaicConfig``: ``config``, checked, or its default for this
    head_dim, mask and key length (which the XLA path's tiles follow too)."""
    mosaic = dispatch.backend("mosaic")
    if config is None:
        config = mosaic.fp8_default_config(head_dim, is_causal=is_causal, seq_kv=seq_kv)
    mosaic.fp8_check_config(config, mosaic.padded_head_dim(head_dim))
    return config


def _run_kernel(operands, *, is_causal: bool, scale: float, config, interpret: bool):
    """The Mosaic FP8 forward on ``operands`` (the backend's ``Fp8Operands``)."""
    mask = MaskSpec(seq_q=operands.q.shape[1], seq_kv=operands.k.shape[1],
                    is_causal=is_causal, causal_alignment="bottom_right")
    out, lse = dispatch.backend("mosaic").fp8_forward(operands, mask=mask, scale=scale,
                                                      config=config, interpret=interpret)
    # Inside shard_map(check_vma=True): plgpu.kernel (jax 0.11.2) returns its results
    # invariant; they vary as the operands do (as pallas_flash.attention's kernels).
    return (varying_like(out, operands.q), varying_like(lse, operands.q))


def _results(out, lse, out_scale, return_residual: bool):
    """The public return value from the kernel's (or reference's) ``out`` and
    ``lse: [B, N, T]``."""
    results = (out,) if out_scale is None else quantize_output(out, out_scale)
    if return_residual:
        results += (jnp.transpose(lse, (0, 2, 1)),)
    return results[0] if len(results) == 1 else results


def quantize_output(out: jax.Array, out_scale: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """``out`` in e4m3 with a given scale (delayed scaling), saturating, and its ``amax``.

    Args:
      out: any shape, any float dtype.
      out_scale: a positive float32 scalar; ``out ≈ out_fp8 · out_scale``.

    Returns:
      ``(out_fp8, amax)``: float8_e4m3fn like ``out`` (values beyond ``±448 · out_scale``
      clipped to ±448, where a plain cast would give NaN: e4m3fn has no infinity) and the
      float32 ``max |out|`` before rounding, from which a recipe derives its next scale.
    """
    if not hasattr(out, "dtype") or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"out must be a float array, got {describe(out)}")
    if out_scale is None:
        raise ValueError("out_scale must be a positive float scalar, got None")
    _check_out_scale(out_scale)
    x = out.astype(jnp.float32)
    scaled = jnp.clip(x / jnp.asarray(out_scale, jnp.float32), -E4M3_MAX, E4M3_MAX)
    return scaled.astype(E4M3), jnp.max(jnp.abs(x))


def _check_out_scale(out_scale) -> None:
    if out_scale is None:
        return
    if (not isinstance(out_scale, (int, float, np.number, np.ndarray, jax.Array))
            or isinstance(out_scale, bool) or jnp.ndim(out_scale) != 0
            or not jnp.issubdtype(jnp.result_type(out_scale), jnp.floating)):
        raise ValueError(f"out_scale must be a positive float scalar or None, got {out_scale!r}")
    if not isinstance(out_scale, jax.core.Tracer) and not 0 < float(out_scale) < math.inf:
        raise ValueError(f"out_scale must be a positive finite float scalar, got "
                         f"{float(out_scale)}")


def _check_scale_blocks(scale_blocks, config) -> tuple[int, int]:
    if not isinstance(scale_blocks, tuple) or len(scale_blocks) != 2:
        raise ValueError("scale_blocks must be (q_block, kv_block), two positive ints, got "
                         f"{scale_blocks!r}")
    scale_blocks = tuple(_check_block(b, f"scale_blocks' {name}", allow_none=False)
                         for name, b in zip(("q_block", "kv_block"), scale_blocks, strict=True))
    for name, block, tile in (("q_block", scale_blocks[0], config.block_q),
                              ("kv_block", scale_blocks[1], config.block_kv)):
        if block % tile:
            raise ValueError(f"scale_blocks' {name} ({block}) must be a multiple of the "
                             f"kernel's tile ({tile}): the kernel applies one scale per tile "
                             "it loads; quantize again with the kernel's tiles otherwise")
    return scale_blocks


def _kernel_tile_scales(scales: jax.Array, name: str, shape: tuple[int, int, int], block: int,
                        tile: int) -> jax.Array:
    """Scales per tensor or per ``block`` positions -> float32 ``[B, ceil(L / tile), H]``
    (``block`` a multiple of ``tile``: each block's scale repeated over its tiles)."""
    batch, length, heads = shape
    tiles = -(-length // tile)
    if not isinstance(scales, (float, np.floating, np.ndarray, jax.Array)):
        raise ValueError(f"{name} must be a float32 scalar or array, got {describe(scales)}")
    scales = jnp.asarray(scales)
    if not jnp.issubdtype(scales.dtype, jnp.floating):
        raise ValueError(f"{name} must be float32, got {scales.dtype}")
    scales = scales.astype(jnp.float32)
    if not isinstance(scales, jax.core.Tracer) and scales.size:
        concrete = np.asarray(scales)  # numpy: jnp ops would trace under an outer jit
        if not (np.all(np.isfinite(concrete)) and np.all(concrete > 0)):
            raise ValueError(f"{name} must hold positive finite scales, got values in "
                             f"[{concrete.min()}, {concrete.max()}]")
    if scales.ndim == 0:
        return jnp.broadcast_to(scales, (batch, tiles, heads))
    want = (batch, -(-length // block), heads)
    if scales.shape != want:
        raise ValueError(f"{name} must be a scalar or {want} (one scale per {block} positions "
                         f"and head; scale_blocks names other blocks), got {scales.shape}")
    return jnp.repeat(scales, block // tile, axis=1)[:, :tiles]


def describe(x) -> str:
    """``x`` for an error message: its dtype and shape, or its type."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def check_float_array(x, name: str) -> None:
    """Raises ValueError naming ``name`` unless ``x`` is a non-empty floating array
    ``[batch, seq, heads, head_dim]``."""
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 4:
        raise ValueError(f"{name} must be a float array [batch, seq, heads, head_dim], got "
                         f"{describe(x)}")
    _check_not_empty(x, name)


def _check_not_empty(x, name: str) -> None:
    if 0 in x.shape:
        raise ValueError(f"{name} must have no empty dimension, got shape {tuple(x.shape)}")


def check_quantization(q, k, v, block_q, block_kv, hadamard_key) -> tuple[int, int]:
    """The arguments every block-quantizing function takes: float ``[B, L, H, D]`` q, k, v,
    positive int blocks (returned as Python ints) and an optional PRNG key."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_array(x, name)
    _check_key(hadamard_key, "hadamard_key", allow_none=True)
    return (_check_block(block_q, "block_q", allow_none=False),
            _check_block(block_kv, "block_kv", allow_none=False))


def _check_block(block, name: str, *, allow_none: bool) -> int | None:
    """``block`` (positions per scale) as a Python int, or None where allowed."""
    if block is None and allow_none:
        return None
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        allowed = "a positive int" + (" or None (per tensor)" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {block!r}")
    return int(block)


def _check_key(key, name: str, *, allow_none: bool) -> None:
    """A typed PRNG key (``jax.random.key``), a raw one (``jax.random.PRNGKey``) or, where
    allowed, None."""
    if key is None and allow_none:
        return
    typed = hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = hasattr(key, "dtype") and key.dtype == jnp.uint32 and key.shape == (2,)
    if not ((typed and key.shape == ()) or raw):
        allowed = "None or one PRNG key" if allow_none else "one PRNG key"
        raise ValueError(f"{name} must be {allowed} (jax.random.key(seed) or "
                         f"jax.random.PRNGKey(seed)), got {key!r}")


def _check_inputs(q, k, v, is_causal: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or x.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got "
                             f"{describe(x)}")
        if x.dtype != q.dtype or jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"q, k, v must share one dtype of bfloat16, float16, float32; "
                             f"{name} is {x.dtype}")
        _check_not_empty(x, name)
    check_shapes(q, k, v, is_causal)


def check_shapes(q, k, v, is_causal: bool) -> None:
    """Raises ValueError unless ``q: [B, T, N, D]``, ``k, v: [B, S, K, D]`` fit together
    (``N % K == 0``, ``D`` at most the kernels' largest) and, when ``is_causal``, every row
    sees a key under the bottom-right diagonal (``T <= S``)."""
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must be [batch, seq_kv, kv_heads, head_dim] like q's batch "
                         f"and head_dim, got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q's heads ({q.shape[2]}) must be a multiple of k's ({k.shape[2]})")
    if q.shape[3] > dispatch.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {dispatch.MAX_HEAD_DIM}, got {q.shape[3]}")
    if is_causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"is_causal with seq_q {q.shape[1]} > seq_kv {k.shape[1]}: the first "
                         "rows would see no key under the bottom-right diagonal")


def _implementation(name: str | None, interpret: bool) -> str:
    hopper = "mosaic" in available_implementations()
    if name is None:
        return "mosaic" if interpret or hopper else "xla"
    if name not in ("mosaic", "xla"):
        raise ValueError(f"implementation must be 'mosaic', 'xla' or None, got {name!r}")
    if name == "mosaic" and not (interpret or hopper):
        raise ValueError("implementation='mosaic' needs a Hopper (sm90) GPU or interpret=True")
    return name


def rotate(q: jax.Array, k: jax.Array, hadamard_key: jax.Array | None):
    """Float32 Q and K, multiplied by the random Hadamard matrix if a key is given, and
    that matrix (or None)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if hadamard_key is None:
        return q, k, None
    rotation = random_hadamard(hadamard_key, q.shape[-1])
    return q @ rotation, k @ rotation, rotation


def hide_future(s: jax.Array) -> jax.Array:
    """Scores ``[.., seq_q, seq_kv]`` with the keys after each query's (bottom-right causal
    alignment, as the FP8 kernel's) set to −inf."""
    seq_q, seq_kv = s.shape[-2:]
    mask = MaskSpec(seq_q, seq_kv, is_causal=True, causal_alignment="bottom_right")
    return jnp.where(mask.block_visible(0, seq_q, 0, seq_kv), s, -jnp.inf)


def reference_forward(q, k, v, *, hadamard_key, block_q, block_kv, scale, is_causal, fp8_pv):
    """Attention with FP8 operands, as an FP8 FlashAttention-3 forward computes it.

    ``q: [batch, seq_q, heads, head_dim]``, ``k, v: [batch, seq_kv, heads, head_dim]``
    (quantized here, per ``block_q`` / ``block_kv`` tile and head, or per tensor with
    ``None``): Q·Kᵀ multiplies e4m3 operands with float32 accumulation and applies the two
    tiles' scales afterwards; the softmax runs in float32; with ``fp8_pv``, P (in [0, 1],
    each row's maximum exactly 1) is rounded to e4m3 with the fixed scale 448 and V through
    e4m3 (the row sums use the unrounded P, as a kernel computes them from its float32
    registers). Returns ``(out [batch, seq_q, heads, head_dim] bfloat16, lse [batch, heads,
    seq_q])`` (natural log of the row sums of the dequantized S)."""
    q, k, _ = rotate(q, k, hadamard_key)
    (q8, sq), (k8, sk) = quantize(q, block_q), quantize(k, block_kv)
    v = v.astype(jnp.float32)
    if fp8_pv:
        v = dequantize(*quantize(v, block_kv), block_kv)
    return _reference_quantized(q8, sq, k8, sk, v, block_q=block_q, block_kv=block_kv,
                                scale=scale, is_causal=is_causal, round_p=fp8_pv)


def _reference_quantized(q8, q_scale, k8, k_scale, v, *, block_q, block_kv, scale, is_causal,
                         round_p):
    """The FP8 arithmetic of :func:`reference_forward` on quantized Q, K (scales per ``block_q`` /
    ``block_kv`` tile, or per tensor with ``None``) and a float32 V (already dequantized,
    or exact with ``round_p=False``): ``(out bf16, lse [batch, heads, seq_q])``."""
    # The FP8 GEMM: exact products of e4m3 values, accumulated in float32.
    s = jnp.einsum("bqhd,bkhd->bhqk", q8.astype(jnp.float32), k8.astype(jnp.float32))
    s = s * scale * _per_row(q_scale, block_q, q8.shape[1]) * _per_col(k_scale, block_kv,
                                                                      k8.shape[1])
    if is_causal:
        s = hide_future(s)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    row_sum = jnp.sum(p, axis=-1)                                        # [b, h, q]
    if round_p:
        p = round_probabilities(p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v) / jnp.transpose(row_sum, (0, 2, 1))[..., None]
    return out.astype(jnp.bfloat16), jnp.max(s, axis=-1) + jnp.log(row_sum)


def per_position(scales: jax.Array, block: int | None, length: int) -> jax.Array:
    """Tile scales -> ``[batch, length, heads]`` (or the scalar of a per-tensor scale)."""
    if block is None or scales.ndim == 0:
        return scales
    return jnp.repeat(scales, block, axis=1)[:, :length]


def _per_row(scales, block, length):   # -> broadcastable to [b, h, q, k]
    per = per_position(scales, block, length)
    return per if per.ndim == 0 else jnp.transpose(per, (0, 2, 1))[..., None]


def _per_col(scales, block, length):
    per = per_position(scales, block, length)
    return per if per.ndim == 0 else jnp.transpose(per, (0, 2, 1))[:, :, None, :]

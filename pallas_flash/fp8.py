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

:func:`attention_fp8_reference` is the FP8 forward written in XLA with exactly these
numerics (FP8 operands, float32 accumulation, P rounded to FP8 before P·V). It is the
specification an FP8 kernel must reproduce and the subject of the accuracy study in
``benchmarks/fp8_accuracy.py``; it is not fast (XLA on most devices upcasts FP8).
:func:`attention_fp8_online` is the same computation tile by tile, as a kernel's online
softmax rounds it.

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
from jax import lax

from pallas_flash import dispatch
from pallas_flash.api import available_implementations
from pallas_flash.arguments import canonical_bool, canonical_scale, check_deterministic
from pallas_flash.autodiff import attention_backward
from pallas_flash.contract import DTYPES, StaticArgs, varying_like
from pallas_flash.fp8_format import E4M3, E4M3_MAX, tile_scale
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import pad_axis, round_up

Scaling = Literal["tensor", "block"]


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
    _check_float_array(x, "x")
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
                         f"{_describe(x_fp8)}")
    batch, seq, heads, _ = x_fp8.shape
    want = () if block is None else (batch, -(-seq // block), heads)
    if np.shape(scales) != want or not jnp.issubdtype(jnp.result_type(scales), jnp.floating):
        raise ValueError(f"scales must be float of shape {want} (quantize's, for block "
                         f"{block}), got {_describe(scales)}")
    x = x_fp8.astype(jnp.float32)
    per = _per_position(scales, block, x.shape[1])
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


def attention_fp8_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                            scaling: Scaling = "block", hadamard_key: jax.Array | None = None,
                            block_q: int = 128, block_kv: int = 128,
                            scale: float | None = None, is_causal: bool = False,
                            fp8_pv: bool = True, return_residual: bool = False):
    """Attention with FP8 operands, as an FP8 FlashAttention-3 forward computes it.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, heads, head_dim]``
        (bf16/float32: quantized here).
      scaling: ``"block"`` (one scale per ``block_q`` / ``block_kv`` tile and head) or
        ``"tensor"`` (one per tensor).
      hadamard_key: if given, Q and K are first multiplied by :func:`random_hadamard`
        (incoherent processing); the product Q·Kᵀ is unchanged in exact arithmetic.
      scale: softmax scale, default ``1/√head_dim``.
      fp8_pv: run P·V in FP8 too (FlashAttention-3); False keeps P and V in float32, which
        isolates the error of the FP8 Q·Kᵀ (the part that scaling and rotation act on).
      return_residual: also return ``lse: [batch, seq_q, heads]`` float32 (natural log of
        the row sums of the dequantized S), as :func:`attention_fp8` does.

    Returns:
      ``[batch, seq_q, heads, head_dim]`` bfloat16 (and ``lse`` with ``return_residual``).

    Q·Kᵀ multiplies e4m3 operands with float32 accumulation and applies the two tiles'
    scales afterwards; the softmax runs in float32; P (in [0, 1], each row's maximum exactly
    1) is rounded to e4m3 with the fixed scale 448, which uses the format's whole range at
    no cost; the row sums use the unrounded P, as a kernel computes them from its float32
    registers; P·V multiplies e4m3 operands and applies V's tile scale.
    """
    if scaling not in ("tensor", "block"):
        raise ValueError(f"scaling must be 'tensor' or 'block', got {scaling!r}")
    block_q, block_kv = _check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    is_causal, fp8_pv, return_residual = (canonical_bool(flag, name) for name, flag in (
        ("is_causal", is_causal), ("fp8_pv", fp8_pv), ("return_residual", return_residual)))
    if q.shape[2] != k.shape[2]:
        raise ValueError("q, k, v must have the same number of heads, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    _check_shapes(q, k, v, is_causal)
    scale = canonical_scale(scale, q.shape[-1])
    block_q, block_kv = (block_q, block_kv) if scaling == "block" else (None, None)
    out, lse = _reference(q, k, v, hadamard_key=hadamard_key, block_q=block_q,
                          block_kv=block_kv, scale=scale, is_causal=is_causal, fp8_pv=fp8_pv)
    return (out, jnp.transpose(lse, (0, 2, 1))) if return_residual else out


def attention_fp8_online(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int,
                         block_kv: int, scale: float | None = None, is_causal: bool = False,
                         hadamard_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The FP8 kernel's arithmetic in XLA, block by block: the online softmax over K tiles.

    Same operands, scales and P rounding as :func:`attention_fp8_reference`, but P is
    rounded relative to the *running* row maximum (as the kernel and FlashAttention-3 do)
    and O is rescaled as the maximum grows. The kernel must match this to float32
    summation order; it differs from :func:`attention_fp8_reference` by a few FP8
    roundings in rows whose maximum moves after the first visible tile.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` (GQA: ``N % K == 0``).
      block_q, block_kv: quantization tiles; K/V tiles are also the softmax steps.
      is_causal: bottom-right aligned, as :func:`attention_fp8_reference`.

    Returns:
      ``out: [B, T, N, D]`` bfloat16 and ``lse: [B, N, T]`` float32 (natural log).
    """
    block_q, block_kv = _check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    _check_shapes(q, k, v, is_causal=False)
    is_causal = canonical_bool(is_causal, "is_causal")
    scale = canonical_scale(scale, q.shape[-1])
    q, k, _ = _rotate(q, k, hadamard_key)
    (q8, q_scale), (k8, k_scale) = quantize(q, block_q), quantize(k, block_kv)
    v8, v_scale = quantize(v, block_kv)
    batch, seq_q, heads = q.shape[:3]
    seq_kv, group = k.shape[1], heads // k.shape[2]
    num_blocks = -(-seq_kv // block_kv)

    def tiles(x):  # [B, S, K, ...] -> [blocks, B, block_kv, N, ...]: scan over K/V tiles
        x = jnp.repeat(pad_axis(x, 1, num_blocks * block_kv), group, axis=2)
        return jnp.moveaxis(x.reshape(batch, num_blocks, block_kv, *x.shape[2:]), 1, 0)
    q_scale_rows = _per_position(q_scale, block_q, seq_q)                   # [B, T, N]
    rows = jnp.arange(seq_q)[:, None]

    def step(carry, tile):
        o, m, l = carry
        j, k_j, v_j, k_scale_j, v_scale_j = tile      # k_scale_j, v_scale_j: [B, N]
        s = jnp.einsum("bqhd,bkhd->bqhk", q8.astype(jnp.float32), k_j.astype(jnp.float32))
        s = s * (scale * q_scale_rows * k_scale_j[:, None, :])[..., None]
        cols = j * block_kv + jnp.arange(block_kv)[None, :]
        visible = (cols < seq_kv) & ((cols <= rows + seq_kv - seq_q) if is_causal else True)
        s = jnp.where(visible[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet stay 0
        p = jnp.exp(s - m_sub[..., None])
        alpha = jnp.exp(m - m_sub)
        p8 = (p * E4M3_MAX).astype(E4M3).astype(jnp.float32)
        pv = jnp.einsum("bqhk,bkhd->bqhd", p8, v_j.astype(jnp.float32))
        o = o * alpha[..., None] + pv * (v_scale_j[:, None, :, None] / E4M3_MAX)
        return (o, m_new, l * alpha + p.sum(axis=-1)), None

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], -jnp.inf),
            jnp.zeros(q.shape[:3]))
    per_tile = (jnp.arange(num_blocks), tiles(k8), tiles(v8),
                jnp.moveaxis(jnp.repeat(k_scale, group, axis=2), 1, 0),
                jnp.moveaxis(jnp.repeat(v_scale, group, axis=2), 1, 0))
    (o, m, l), _ = lax.scan(step, init, per_tile)
    out = o / jnp.where(l == 0, 1.0, l)[..., None]
    return out.astype(jnp.bfloat16), jnp.transpose(m + jnp.log(l), (0, 2, 1))


#: The five GEMMs of the FlashAttention-2 backward (Algorithm 2), named by what they make.
BACKWARD_GEMMS = frozenset({"s", "dp", "dv", "dq", "dk"})


def attention_fp8_backward_reference(
        q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
        d_out: jax.Array, *, fp8_gemms: frozenset[str] = BACKWARD_GEMMS,
        scaling: Scaling = "block", hadamard_key: jax.Array | None = None,
        block_q: int = 64, block_kv: int = 128, scale: float | None = None,
        is_causal: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) as a backward kernel computes them with FP8 operands in ``fp8_gemms``.

    The FlashAttention-2 backward recomputes ``S = Q·Kᵀ`` and ``P = exp(S − lse)`` and runs
    four more GEMMs: ``dP = dO·Vᵀ``, ``dV = Pᵀ·dO``, ``dQ = dS·K`` and ``dK = dSᵀ·Q`` with
    ``dS = P ∘ (dP − rowsum(dO ∘ O))``. Each GEMM named in ``fp8_gemms`` multiplies e4m3
    operands (float32 accumulation, scales applied after); the others multiply bf16
    operands, as the bf16 kernels do — ``fp8_gemms=frozenset()`` is the bf16 backward.
    Operand scales: Q, dO per ``block_q`` rows and K, V per ``block_kv`` keys (per tensor
    with ``scaling="tensor"``); P ∈ [0, 1] with the fixed scale 448 (as the forward);
    dS, which has no bound and changes sign, one scale per ``block_q × block_kv`` tile
    (per tensor with ``scaling="tensor"``): a kernel takes its max in registers before
    rounding it. ``hadamard_key`` rotates Q and K (incoherent processing); the
    gradients of the rotated Q and K are rotated back.

    Args:
      q, d_out, out: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, heads,
        head_dim]``; lse: ``[batch, seq_q, heads]`` float32 (natural log). ``out`` and
        ``lse`` are the forward's residuals (``return_residual=True``).

    Returns:
      float32 ``(dq, dk, dv)`` shaped like q, k, v.
    """
    if not isinstance(fp8_gemms, (set, frozenset, list, tuple)) \
            or not set(fp8_gemms) <= BACKWARD_GEMMS:
        raise ValueError(f"fp8_gemms must be a set of GEMM names among "
                         f"{sorted(BACKWARD_GEMMS)}, got {fp8_gemms!r}")
    if scaling not in ("tensor", "block"):
        raise ValueError(f"scaling must be 'tensor' or 'block', got {scaling!r}")
    block_q, block_kv = _check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    is_causal = canonical_bool(is_causal, "is_causal")
    if q.shape[2] != k.shape[2]:
        raise ValueError("q, k, v must have the same number of heads, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    _check_shapes(q, k, v, is_causal)
    for name, x in (("out", out), ("d_out", d_out)):
        _check_float_array(x, name)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}, got {x.shape}")
    want_lse = (q.shape[0], q.shape[1], q.shape[2])
    if getattr(lse, "shape", None) != want_lse or not jnp.issubdtype(lse.dtype, jnp.floating):
        raise ValueError(f"lse must be float [batch, seq_q, heads] = {want_lse}, got "
                         f"{_describe(lse)}")
    scale = canonical_scale(scale, q.shape[-1])
    rows, cols = (block_q, block_kv) if scaling == "block" else (None, None)
    q, k, rotation = _rotate(q, k, hadamard_key)

    def operand(gemm, x, block):  # [b, seq, h, d] as the GEMM reads it
        return dequantize(*quantize(x, block), block) if gemm in fp8_gemms else _bf16(x)

    d_out32 = d_out.astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", operand("s", q, rows), operand("s", k, cols)) * scale
    if is_causal:
        s = _hide_future(s)
    p = jnp.exp(s - jnp.transpose(lse, (0, 2, 1))[..., None])         # float32 registers
    dp = jnp.einsum("bqhd,bkhd->bhqk", operand("dp", d_out32, rows), operand("dp", v, cols))
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out32, out.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    p_dv = _round_p(p) if "dv" in fp8_gemms else _bf16(p)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p_dv, operand("dv", d_out32, rows))

    def ds_operand(gemm):
        return _round_tiles(ds, rows, cols) if gemm in fp8_gemms else _bf16(ds)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds_operand("dq"), operand("dq", k, cols)) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds_operand("dk"), operand("dk", q, rows)) * scale
    if rotation is not None:  # Q' = Q·M  =>  dQ = dQ'·Mᵀ (and the same for K)
        dq, dk = dq @ rotation.T, dk @ rotation.T
    return dq, dk, dv


def _round_p(p: jax.Array) -> jax.Array:
    """P ∈ [0, 1] through e4m3 with the fixed scale 448, as the FP8 forward rounds it; a
    backward's P = exp(S − lse) can exceed 1 where its S is rounded differently from the
    forward's, and saturates (``cvt.satfinite``) instead of becoming NaN."""
    return (jnp.minimum(p * E4M3_MAX, E4M3_MAX).astype(E4M3).astype(jnp.float32)
            / E4M3_MAX)


def _round_tiles(x: jax.Array, rows: int | None, cols: int | None) -> jax.Array:
    """``x: [b, h, q, k]`` through e4m3, one scale per ``rows × cols`` tile (or per tensor)."""
    if rows is None:
        return dequantize(*quantize(x, None), None)
    b, h, seq_q, seq_kv = x.shape
    tiles = pad_axis(pad_axis(x, 2, round_up(seq_q, rows)), 3, round_up(seq_kv, cols))
    tiles = tiles.reshape(b, h, -1, rows, tiles.shape[3] // cols, cols)
    scales = tile_scale(jnp.max(jnp.abs(tiles), axis=(3, 5), keepdims=True))
    rounded = (tiles / scales).astype(E4M3).astype(jnp.float32) * scales
    return rounded.reshape(b, h, tiles.shape[2] * rows, -1)[:, :, :seq_q, :seq_kv]


def quantize_operands(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int,
                      block_kv: int, hadamard_key: jax.Array | None = None,
                      implementation: Literal["triton", "xla"] | None = None,
                      interpret: bool = False) -> Any:
    """The FP8 kernel's inputs: block quantization as :func:`attention_fp8_reference` does it.

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
    block_q, block_kv = _check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    _check_shapes(q, k, v, is_causal=False)
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
        q, k, _ = _rotate(q, k, hadamard_key)
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
        bottom-right, as in :func:`attention_fp8_reference`; with ``T == S`` that is the
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
        ``"xla"`` (:func:`attention_fp8_reference`, any backend, same numerics, slow);
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
        return _reference(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2),
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
            raise ValueError(f"{name} must be a 4-d float8_e4m3fn array, got {_describe(x)}")
    v_transposed, is_causal, return_residual, interpret = (
        canonical_bool(flag, name) for name, flag in (
            ("v_transposed", v_transposed), ("is_causal", is_causal),
            ("return_residual", return_residual), ("interpret", interpret)))
    batch, seq_kv, kv_heads, head_dim = k.shape
    if v.shape != ((batch, kv_heads, head_dim, seq_kv) if v_transposed else k.shape):
        layout = "[B, K, D, S]" if v_transposed else "[B, S, K, D]"
        raise ValueError(f"v must be {layout} matching k {k.shape}, got {v.shape}")
    _check_shapes(q, k, k, is_causal)
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
        raise ValueError(f"out must be a float array, got {_describe(out)}")
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
        raise ValueError(f"{name} must be a float32 scalar or array, got {_describe(scales)}")
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


def _describe(x) -> str:
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def _check_float_array(x, name: str) -> None:
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 4:
        raise ValueError(f"{name} must be a float array [batch, seq, heads, head_dim], got "
                         f"{_describe(x)}")
    _check_not_empty(x, name)


def _check_not_empty(x, name: str) -> None:
    if 0 in x.shape:
        raise ValueError(f"{name} must have no empty dimension, got shape {tuple(x.shape)}")


def _check_quantization(q, k, v, block_q, block_kv, hadamard_key) -> tuple[int, int]:
    """The arguments every block-quantizing function takes: float ``[B, L, H, D]`` q, k, v,
    positive int blocks (returned as Python ints) and an optional PRNG key."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float_array(x, name)
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
                             f"{_describe(x)}")
        if x.dtype != q.dtype or jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"q, k, v must share one dtype of bfloat16, float16, float32; "
                             f"{name} is {x.dtype}")
        _check_not_empty(x, name)
    _check_shapes(q, k, v, is_causal)


def _check_shapes(q, k, v, is_causal: bool) -> None:
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


def _rotate(q: jax.Array, k: jax.Array, hadamard_key: jax.Array | None):
    """Float32 Q and K, multiplied by the random Hadamard matrix if a key is given, and
    that matrix (or None)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if hadamard_key is None:
        return q, k, None
    rotation = random_hadamard(hadamard_key, q.shape[-1])
    return q @ rotation, k @ rotation, rotation


def _hide_future(s: jax.Array) -> jax.Array:
    """Scores ``[.., seq_q, seq_kv]`` with the keys after each query's (bottom-right causal
    alignment, as the FP8 kernel's) set to −inf."""
    seq_q, seq_kv = s.shape[-2:]
    mask = MaskSpec(seq_q, seq_kv, is_causal=True, causal_alignment="bottom_right")
    return jnp.where(mask.block_visible(0, seq_q, 0, seq_kv), s, -jnp.inf)


def _bf16(x: jax.Array) -> jax.Array:
    """``x`` rounded to bf16, as a bf16 GEMM reads it (float32 for XLA's einsum)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _reference(q, k, v, *, hadamard_key, block_q, block_kv, scale, is_causal, fp8_pv):
    """:func:`attention_fp8_reference` (blocks ``None``: per tensor), also returning
    ``lse: [batch, heads, seq_q]`` (natural log of the row sums of the dequantized S)."""
    q, k, _ = _rotate(q, k, hadamard_key)
    (q8, sq), (k8, sk) = quantize(q, block_q), quantize(k, block_kv)
    v = v.astype(jnp.float32)
    if fp8_pv:
        v = dequantize(*quantize(v, block_kv), block_kv)
    return _reference_quantized(q8, sq, k8, sk, v, block_q=block_q, block_kv=block_kv,
                                scale=scale, is_causal=is_causal, round_p=fp8_pv)


def _reference_quantized(q8, q_scale, k8, k_scale, v, *, block_q, block_kv, scale, is_causal,
                         round_p):
    """The FP8 arithmetic of :func:`_reference` on quantized Q, K (scales per ``block_q`` /
    ``block_kv`` tile, or per tensor with ``None``) and a float32 V (already dequantized,
    or exact with ``round_p=False``): ``(out bf16, lse [batch, heads, seq_q])``."""
    # The FP8 GEMM: exact products of e4m3 values, accumulated in float32.
    s = jnp.einsum("bqhd,bkhd->bhqk", q8.astype(jnp.float32), k8.astype(jnp.float32))
    s = s * scale * _per_row(q_scale, block_q, q8.shape[1]) * _per_col(k_scale, block_kv,
                                                                      k8.shape[1])
    if is_causal:
        s = _hide_future(s)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    row_sum = jnp.sum(p, axis=-1)                                        # [b, h, q]
    if round_p:
        p = _round_p(p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v) / jnp.transpose(row_sum, (0, 2, 1))[..., None]
    return out.astype(jnp.bfloat16), jnp.max(s, axis=-1) + jnp.log(row_sum)


def _per_position(scales: jax.Array, block: int | None, length: int) -> jax.Array:
    """Tile scales -> ``[batch, length, heads]`` (or the scalar of a per-tensor scale)."""
    if block is None or scales.ndim == 0:
        return scales
    return jnp.repeat(scales, block, axis=1)[:, :length]


def _per_row(scales, block, length):   # -> broadcastable to [b, h, q, k]
    per = _per_position(scales, block, length)
    return per if per.ndim == 0 else jnp.transpose(per, (0, 2, 1))[..., None]


def _per_col(scales, block, length):
    per = _per_position(scales, block, length)
    return per if per.ndim == 0 else jnp.transpose(per, (0, 2, 1))[:, :, None, :]

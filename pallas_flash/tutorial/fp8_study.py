"""The FP8 accuracy study: FlashAttention-3's FP8 numerics written out in XLA.

:func:`attention_fp8_reference` is the FP8 forward with exactly the numerics of
:func:`pallas_flash.fp8.attention_fp8` (FP8 operands, float32 accumulation, P rounded to FP8
before P·V), with the per-tensor baseline and the choice of FP8 P·V the study compares. It
is the specification an FP8 kernel must reproduce and the subject of
``benchmarks/fp8_accuracy.py``. :func:`attention_fp8_online` is the same computation tile
by tile, as a kernel's online softmax rounds it, and :func:`attention_fp8_backward_reference`
the FlashAttention-2 backward with any of its five GEMMs in FP8 (docs/measured.md, the FP8
backward study). None of them is fast: XLA on most devices upcasts FP8.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import fp8
from pallas_flash.arguments import canonical_bool, canonical_scale
from pallas_flash.fp8_format import E4M3, E4M3_MAX, tile_scale
from pallas_flash.padding import pad_axis, round_up

#: How the study scales an operand: one scale per tensor, or one per tile and head.
Scaling = Literal["tensor", "block"]


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
      hadamard_key: if given, Q and K are first multiplied by
        :func:`pallas_flash.fp8.random_hadamard` (incoherent processing); the product Q·Kᵀ
        is unchanged in exact arithmetic.
      scale: softmax scale, default ``1/√head_dim``.
      fp8_pv: run P·V in FP8 too (FlashAttention-3); False keeps P and V in float32, which
        isolates the error of the FP8 Q·Kᵀ (the part that scaling and rotation act on).
      return_residual: also return ``lse: [batch, seq_q, heads]`` float32 (natural log of
        the row sums of the dequantized S), as :func:`pallas_flash.fp8.attention_fp8` does.

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
    block_q, block_kv = fp8.check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    is_causal, fp8_pv, return_residual = (canonical_bool(flag, name) for name, flag in (
        ("is_causal", is_causal), ("fp8_pv", fp8_pv), ("return_residual", return_residual)))
    if q.shape[2] != k.shape[2]:
        raise ValueError("q, k, v must have the same number of heads, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    fp8.check_shapes(q, k, v, is_causal)
    scale = canonical_scale(scale, q.shape[-1])
    block_q, block_kv = (block_q, block_kv) if scaling == "block" else (None, None)
    out, lse = fp8.reference_forward(q, k, v, hadamard_key=hadamard_key, block_q=block_q,
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
    block_q, block_kv = fp8.check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    fp8.check_shapes(q, k, v, is_causal=False)
    is_causal = canonical_bool(is_causal, "is_causal")
    scale = canonical_scale(scale, q.shape[-1])
    q, k, _ = fp8.rotate(q, k, hadamard_key)
    (q8, q_scale), (k8, k_scale) = fp8.quantize(q, block_q), fp8.quantize(k, block_kv)
    v8, v_scale = fp8.quantize(v, block_kv)
    batch, seq_q, heads = q.shape[:3]
    seq_kv, group = k.shape[1], heads // k.shape[2]
    num_blocks = -(-seq_kv // block_kv)

    def tiles(x):  # [B, S, K, ...] -> [blocks, B, block_kv, N, ...]: scan over K/V tiles
        x = jnp.repeat(pad_axis(x, 1, num_blocks * block_kv), group, axis=2)
        return jnp.moveaxis(x.reshape(batch, num_blocks, block_kv, *x.shape[2:]), 1, 0)
    q_scale_rows = fp8.per_position(q_scale, block_q, seq_q)                   # [B, T, N]
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
    block_q, block_kv = fp8.check_quantization(q, k, v, block_q, block_kv, hadamard_key)
    is_causal = canonical_bool(is_causal, "is_causal")
    if q.shape[2] != k.shape[2]:
        raise ValueError("q, k, v must have the same number of heads, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    fp8.check_shapes(q, k, v, is_causal)
    for name, x in (("out", out), ("d_out", d_out)):
        fp8.check_float_array(x, name)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}, got {x.shape}")
    want_lse = (q.shape[0], q.shape[1], q.shape[2])
    if getattr(lse, "shape", None) != want_lse or not jnp.issubdtype(lse.dtype, jnp.floating):
        raise ValueError(f"lse must be float [batch, seq_q, heads] = {want_lse}, got "
                         f"{fp8.describe(lse)}")
    scale = canonical_scale(scale, q.shape[-1])
    rows, cols = (block_q, block_kv) if scaling == "block" else (None, None)
    q, k, rotation = fp8.rotate(q, k, hadamard_key)

    def operand(gemm, x, block):  # [b, seq, h, d] as the GEMM reads it
        return fp8.dequantize(*fp8.quantize(x, block), block) if gemm in fp8_gemms else _bf16(x)

    d_out32 = d_out.astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", operand("s", q, rows), operand("s", k, cols)) * scale
    if is_causal:
        s = fp8.hide_future(s)
    p = jnp.exp(s - jnp.transpose(lse, (0, 2, 1))[..., None])         # float32 registers
    dp = jnp.einsum("bqhd,bkhd->bhqk", operand("dp", d_out32, rows), operand("dp", v, cols))
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out32, out.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    p_dv = fp8.round_probabilities(p) if "dv" in fp8_gemms else _bf16(p)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p_dv, operand("dv", d_out32, rows))

    def ds_operand(gemm):
        return _round_tiles(ds, rows, cols) if gemm in fp8_gemms else _bf16(ds)
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds_operand("dq"), operand("dq", k, cols)) * scale
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds_operand("dk"), operand("dk", q, rows)) * scale
    if rotation is not None:  # Q' = Q·M  =>  dQ = dQ'·Mᵀ (and the same for K)
        dq, dk = dq @ rotation.T, dk @ rotation.T
    return dq, dk, dv


def _round_tiles(x: jax.Array, rows: int | None, cols: int | None) -> jax.Array:
    """``x: [b, h, q, k]`` through e4m3, one scale per ``rows × cols`` tile (or per tensor)."""
    if rows is None:
        return fp8.dequantize(*fp8.quantize(x, None), None)
    b, h, seq_q, seq_kv = x.shape
    tiles = pad_axis(pad_axis(x, 2, round_up(seq_q, rows)), 3, round_up(seq_kv, cols))
    tiles = tiles.reshape(b, h, -1, rows, tiles.shape[3] // cols, cols)
    scales = tile_scale(jnp.max(jnp.abs(tiles), axis=(3, 5), keepdims=True))
    rounded = (tiles / scales).astype(E4M3).astype(jnp.float32) * scales
    return rounded.reshape(b, h, tiles.shape[2] * rows, -1)[:, :, :seq_q, :seq_kv]


def _bf16(x: jax.Array) -> jax.Array:
    """``x`` rounded to bf16, as a bf16 GEMM reads it (float32 for XLA's einsum)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)

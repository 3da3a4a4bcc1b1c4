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
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.padding import pad_axis, round_up

E4M3 = jnp.float8_e4m3fn
#: Largest finite e4m3 value.
E4M3_MAX = float(jnp.finfo(E4M3).max)

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
    if x.ndim != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {x.shape}")
    x = x.astype(jnp.float32)
    if block is None:
        scale = _scale_for(jnp.max(jnp.abs(x)))
        return (x / scale).astype(E4M3), scale
    if block < 1:
        raise ValueError(f"block must be a positive number of positions or None, got {block}")
    batch, seq, heads, head_dim = x.shape
    tiles = pad_axis(x, 1, round_up(seq, block)).reshape(batch, -1, block, heads, head_dim)
    scales = _scale_for(jnp.max(jnp.abs(tiles), axis=(2, 4)))     # [batch, tiles, heads]
    x_fp8 = (tiles / scales[:, :, None, :, None]).astype(E4M3)
    return x_fp8.reshape(batch, -1, heads, head_dim)[:, :seq], scales


def _scale_for(amax: jax.Array) -> jax.Array:
    # The largest magnitude lands on E4M3_MAX; an all-zero tile keeps scale 1 (no 0/0).
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def dequantize(x_fp8: jax.Array, scales: jax.Array, block: int | None) -> jax.Array:
    """Inverse of :func:`quantize` (up to its rounding): float32 ``[batch, seq, heads, d]``."""
    x = x_fp8.astype(jnp.float32)
    per = _per_position(scales, block, x.shape[1])
    return x * (per if per.ndim == 0 else per[..., None])


def random_hadamard(key: jax.Array, head_dim: int) -> jax.Array:
    """A random orthogonal ``[head_dim, head_dim]`` float32 matrix ``H · diag(±1) / √d``.

    ``head_dim`` must be a power of two (Sylvester's construction of H).
    """
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for a Hadamard matrix, got {head_dim}")
    hadamard = np.ones((1, 1), np.float32)
    while hadamard.shape[0] < head_dim:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    signs = jax.random.rademacher(key, (head_dim,), jnp.float32)
    return jnp.asarray(hadamard) * signs[None, :] / math.sqrt(head_dim)


def attention_fp8_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                            scaling: Scaling = "block", hadamard_key: jax.Array | None = None,
                            block_q: int = 128, block_kv: int = 128,
                            scale: float | None = None, is_causal: bool = False,
                            fp8_pv: bool = True) -> jax.Array:
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

    Returns:
      ``[batch, seq_q, heads, head_dim]`` bfloat16.

    Q·Kᵀ multiplies e4m3 operands with float32 accumulation and applies the two tiles'
    scales afterwards; the softmax runs in float32; P (in [0, 1], each row's maximum exactly
    1) is rounded to e4m3 with the fixed scale 448, which uses the format's whole range at
    no cost; the row sums use the unrounded P, as a kernel computes them from its float32
    registers; P·V multiplies e4m3 operands and applies V's tile scale.
    """
    if scaling not in ("tensor", "block"):
        raise ValueError(f"scaling must be 'tensor' or 'block', got {scaling!r}")
    if q.shape[2] != k.shape[2] or k.shape != v.shape:
        raise ValueError("q, k, v must have the same number of heads and k, v the same shape, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if hadamard_key is not None:
        rotation = random_hadamard(hadamard_key, q.shape[-1])
        q, k = q @ rotation, k @ rotation
    block_q, block_kv = (block_q, block_kv) if scaling == "block" else (None, None)
    (q8, sq), (k8, sk) = quantize(q, block_q), quantize(k, block_kv)
    # The FP8 GEMM: exact products of e4m3 values, accumulated in float32.
    s = jnp.einsum("bqhd,bkhd->bhqk", q8.astype(jnp.float32), k8.astype(jnp.float32))
    s = s * scale * _per_row(sq, block_q, q.shape[1]) * _per_col(sk, block_kv, k.shape[1])
    if is_causal:
        visible = jnp.tril(jnp.ones(s.shape[-2:], bool), k.shape[1] - q.shape[1])
        s = jnp.where(visible, s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    row_sum = jnp.sum(p, axis=-1)                                        # [b, h, q]
    v = v.astype(jnp.float32)
    if fp8_pv:
        p = (p * E4M3_MAX).astype(E4M3).astype(jnp.float32) / E4M3_MAX
        v = dequantize(*quantize(v, block_kv), block_kv)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v) / jnp.transpose(row_sum, (0, 2, 1))[..., None]
    return out.astype(jnp.bfloat16)


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

"""FLOP conventions of the FlashAttention papers.

Problem shapes: hidden size ``hidden`` (heads = hidden / head_dim) and ``tokens`` = batch ×
seq_len tokens per step (2048 and 16384 in the papers). Forward FLOPs count the two matmuls,
``4 · batch · heads · seq_len² · head_dim``, halved when causal (the papers count half the
square, not ``L(L+1)/2``). The backward pass is counted as 2.5 × the forward (five matmuls
instead of two), so forward+backward is 3.5 × the forward.
"""

from __future__ import annotations

from typing import Literal

Pass = Literal["fwd", "bwd", "fwdbwd"]
PASSES: tuple[Pass, ...] = ("fwd", "bwd", "fwdbwd")
BWD_FACTOR = 2.5
_PASS_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": BWD_FACTOR, "fwdbwd": 1.0 + BWD_FACTOR}


def problem_shape(head_dim: int, seq_len: int, *, tokens: int = 16384,
                  hidden: int = 2048) -> tuple[int, int]:
    """``(batch, heads)`` of one benchmark point: ``heads = hidden / head_dim``,
    ``batch = tokens / seq_len``.

    Raises:
      ValueError: if either division is not exact.
    """
    if head_dim <= 0 or hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {head_dim}")
    if seq_len <= 0 or tokens % seq_len:
        raise ValueError(f"tokens {tokens} is not a multiple of seq_len {seq_len}")
    return tokens // seq_len, hidden // head_dim


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, *, causal: bool,
                    pass_: Pass) -> float:
    """FLOPs of one attention pass by the papers' convention (see the module docstring)."""
    if pass_ not in _PASS_FACTOR:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    forward = 4.0 * batch * heads * seq_len * seq_len * head_dim
    if causal:
        forward /= 2
    return forward * _PASS_FACTOR[pass_]


def tflops_per_s(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"time must be positive, got {ms} ms")
    return flops / (ms * 1e-3) / 1e12

"""The argument checks and canonical forms shared by the public entry points
(:func:`pallas_flash.attention`, :func:`pallas_flash.decode_attention`,
:func:`pallas_flash.paged_attention`): each raises ``ValueError`` naming the argument."""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.contract import PADDED_KEY_ID

Implementation = Literal["mosaic", "triton", "xla", "cudnn"]


def check_deterministic(flag) -> bool:
    """``deterministic`` (a Python or NumPy bool) as a Python bool."""
    if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(f"deterministic must be a bool, got {flag!r}")
    return bool(flag)


def check_soft_cap(cap) -> float | None:
    if cap is None:
        return None
    if not (isinstance(cap, (int, float)) and not isinstance(cap, bool)
            and math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number, got {cap!r}")
    return float(cap)


def check_sinks(sinks, heads: int):
    if sinks is None:
        return None
    if getattr(sinks, "shape", None) != (heads,):
        raise ValueError(
            f"sinks must have shape [heads] = {(heads,)}, got {getattr(sinks, 'shape', None)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must have a floating dtype, got {sinks.dtype}")
    return sinks


def canonical_scale(scale, head_dim: int) -> float:
    """``scale`` as a Python float (default ``1 / sqrt(head_dim)``)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise ValueError("scale must be a concrete number, not a traced value "
                         "(to scale by a traced value, multiply query by it)")
    if isinstance(scale, (jax.Array, np.ndarray, np.generic)) and np.ndim(scale) == 0 \
            and jnp.issubdtype(scale.dtype, np.number):
        scale = scale.item()
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
            and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def canonical_window(window) -> tuple[int, int] | None:
    """``(left, right)`` Python ints from ``w`` or ``(left, right)`` (Python or NumPy ints,
    as ``jax.nn`` takes them; not bools), or None."""
    if window is None:
        return None

    def is_int(w) -> bool:
        return isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))

    if is_int(window):
        window = (window, window)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(is_int(w) for w in window) or min(window) < 0):
        raise ValueError(
            f"local_window_size must be a non-negative int or a (left, right) pair of them, "
            f"got {window!r}")
    return (int(window[0]), int(window[1]))


def canonical_segments(q_segment_ids, kv_segment_ids, batch, seq_q, seq_kv):
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if kv_segment_ids is None and seq_q == seq_kv:
        kv_segment_ids = q_segment_ids
    if q_segment_ids is None:
        raise ValueError("kv_segment_ids needs q_segment_ids (only q_segment_ids may be given "
                         "alone, when seq_q == seq_kv)")
    if kv_segment_ids is None:
        raise ValueError(
            "q_segment_ids and kv_segment_ids must be given together when seq_q != seq_kv")
    for name, ids, seq in (("q_segment_ids", q_segment_ids, seq_q),
                           ("kv_segment_ids", kv_segment_ids, seq_kv)):
        if getattr(ids, "shape", None) != (batch, seq):
            raise ValueError(
                f"{name} must have shape [batch, seq] = {(batch, seq)}, "
                f"got {getattr(ids, 'shape', None)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must have an integer dtype, got {ids.dtype}")
        # Ids that are (or wrap in int32 into) the padding ids would read as padding.
        check_concrete_range(ids, name, PADDED_KEY_ID + 1, np.iinfo(np.int32).max,
                             "the two lowest int32 values are reserved for padding")
    return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def check_positive_int(value, name: str) -> int:
    """``value`` (a Python or NumPy integer, not a bool, at least 1) as a Python int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_concrete_range(values, name: str, low: int, high: int, bounds: str) -> None:
    """When ``values`` is concrete (traced values cannot be read): every value in
    ``[low, high]``; ``bounds`` says where the limits come from."""
    if isinstance(values, jax.core.Tracer) or not np.size(values):
        return
    concrete = np.asarray(values)  # numpy: jnp ops would trace under an outer jit
    found_low, found_high = int(concrete.min()), int(concrete.max())
    if found_low < low or found_high > high:
        raise ValueError(f"{name} must lie in [{low}, {high}] ({bounds}), got values in "
                         f"[{found_low}, {found_high}]")


def check_lengths(lengths, name: str, batch: int, seq: int, bounds: str) -> jax.Array:
    """Per-sequence lengths: an integer array ``[batch]`` (JAX or NumPy, or a list),
    concrete values in ``[0, seq]``.

    The range is checked on the values as given, before any cast: with 64-bit types off,
    ``jnp.asarray`` would wrap an int64 ``2**32 + 3`` to 3, a valid length. Returns them as
    int32 (:func:`clamp_lengths`)."""
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)
    if getattr(lengths, "shape", None) != (batch,):
        raise ValueError(f"{name} must have shape [batch] = {(batch,)}, "
                         f"got {getattr(lengths, 'shape', None)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {lengths.dtype}")
    check_concrete_range(lengths, name, 0, seq, bounds)
    return clamp_lengths(lengths, seq)


def clamp_lengths(lengths, seq: int) -> jax.Array:
    """Integer lengths as int32, clamped into ``[0, seq]`` when traced: under ``jit`` they
    cannot be checked, and a kernel that reads up to a row's length must not read past the
    array (concrete lengths are checked instead, and pass unchanged)."""
    if isinstance(lengths, jax.core.Tracer):
        lengths = jnp.clip(lengths, 0, seq)  # before the cast: an int64 length cannot wrap
    return jnp.asarray(lengths).astype(jnp.int32)


def check_bools(**flags) -> None:
    """Raise ValueError naming the first of ``flags`` (in order) that is not a Python
    bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")


def canonical_bool(flag, name: str) -> bool:
    """A Python bool from a Python / NumPy bool or a concrete 0-d boolean JAX array."""
    if isinstance(flag, (jax.Array, np.ndarray)) and not isinstance(flag, jax.core.Tracer) \
            and flag.shape == () and flag.dtype == jnp.bool_:
        flag = flag.item()
    if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {flag!r}")
    return bool(flag)

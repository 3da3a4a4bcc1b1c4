"""``pallas_flash.attention``: argument checks, canonicalisation and dispatch."""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

from pallas_flash import bias as bias_lib
from pallas_flash import dispatch
from pallas_flash.autodiff import StaticArgs, attention_with_lse
from pallas_flash.dispatch import available_implementations, default_implementation
from pallas_flash.masking import CausalAlignment, MaskSpec, zero_unseen_rows
from pallas_flash.tuning import config_for_attention

Implementation = Literal["mosaic", "triton", "xla"]

# The public names of the package's entry point, some defined by the dispatcher.
__all__ = ["PADDED_KEY_ID", "PADDED_QUERY_ID", "Implementation", "attention",
           "available_implementations", "default_implementation"]


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    return_residual: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
    config: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention, computed tile by tile without materialising the scores.

    Same layout and meaning as ``jax.nn.dot_product_attention``.

    Args:
      query: ``[batch, seq_q, heads, head_dim]``.
      key: ``[batch, seq_kv, kv_heads, head_dim]``; ``heads`` must be a multiple of
        ``kv_heads`` (grouped-query / multi-query attention; K and V are never repeated).
      value: ``[batch, seq_kv, kv_heads, head_dim]``.
      bias: floating array broadcastable to ``[batch, heads, seq_q, seq_kv]`` (rank <= 4,
        leading dims added as in ``jax.nn``), added to the scaled logits (after the
        soft-cap, if any); differentiable. Broadcast (size-1) dims are never expanded in
        the forward. Its gradient is computed only when one is requested; for a bias that
        broadcasts over batch or heads, it costs a float32 partial of up to
        ``[batch, heads, seq_q, seq_kv]`` (see ``docs/api.md``).
      mask: boolean array broadcastable to ``[batch, heads, seq_q, seq_kv]``; ``False``
        hides the pair. Combined (and) with ``is_causal``, the window, segment ids and
        lengths. Unlike ``jax.nn`` (which spreads a fully masked row evenly over every key),
        a row with no visible key outputs 0.
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      is_causal: hide keys after the query position.
      causal_alignment: ``"top_left"`` (default, as ``jax.nn``: query ``i`` sees keys
        ``<= i``) or ``"bottom_right"`` (query ``i`` sees keys ``<= i + seq_kv - seq_q``,
        so the last query sees every key, as when queries extend a KV cache).
      local_window_size: ``w`` or ``(left, right)``: query ``i`` sees only keys in
        ``[i - left, i + right]`` (after alignment), as ``jax.nn``.
      q_segment_ids: ``[batch, seq_q]`` integer ids of packed documents; a query sees only
        keys with the same id (combined with the causal/window mask). Give both or neither;
        ``kv_segment_ids`` defaults to ``q_segment_ids`` when ``seq_q == seq_kv``.
      kv_segment_ids: ``[batch, seq_kv]`` integer ids. The two values ``-2**31`` and
        ``-2**31 + 1`` are reserved (they mark padding, below).
      query_seq_lengths: ``[batch]`` number of real queries per sequence (as ``jax.nn``);
        rows past it output 0.
      key_value_seq_lengths: ``[batch]`` number of real keys per sequence; later keys are
        hidden (and their tiles skipped).
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)`` before the softmax
        (Gemma-2 style soft-capping), with its gradient.
      sinks: ``[heads]`` learnable logits, one per query head, that join every row's softmax
        denominator without contributing a value (attention sinks); differentiable.
      return_residual: also return ``lse: [batch, seq_q, heads]`` (float32, natural log of
        the softmax denominator; gradients flow through it). Rows that see no key have
        output 0 and lse ``-1e30``.
      implementation: the forward's backend: ``"mosaic"`` (Hopper), ``"triton"`` (any GPU,
        or CPU with ``interpret=True``) or ``"xla"``; ``None`` picks the fastest available
        that supports the call. The backward runs on the same backend when it can; when it
        cannot (the Mosaic backward takes no float32 input, for instance), it runs on the
        first other one that can, fastest first: ``"triton"``, then ``"xla"``
        (:func:`pallas_flash.dispatch.choose_backward`). Every backward reads the same
        residuals, so the gradients are those of the same function.
      interpret: run Pallas kernels in interpret mode (CPU testing).
      config: ``None`` (the backend's heuristic for the shape), a config of the chosen
        backend (``pallas_flash.triton.TritonConfig``, ``pallas_flash.xla.XlaConfig``; for
        Mosaic a ``MosaicConfig`` (forward), a ``MosaicBackwardConfig`` (backward) or a
        ``MosaicCallConfig(forward=..., backward=...)``, the pass not given taking its
        heuristic), or ``"autotune"``: the fastest measured config for
        this device and shape class, read from the cache of :func:`pallas_flash.autotune`
        (a forward + backward tuning first, then a forward one). On a miss the forward is
        tuned and cached right away, which compiles and times every candidate (seconds to
        minutes; the first call only). The tuning needs only shapes and dtype: under
        ``jax.jit`` it runs at trace time on fresh random arrays of the traced shapes, and
        the compiled function keeps the config chosen then. The tuning is of the plain call
        (causal or not); a window, bias, mask or segment ids reuse that choice. The XLA
        backend has nothing to tune and uses its heuristic.

    Returns:
      ``out: [batch, seq_q, heads, head_dim]`` in the input dtype, or ``(out, lse)``.
    """
    dispatch.check_arrays(query, key, value)
    batch, seq_q, _, head_dim = query.shape
    seq_kv = key.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    _check_scale(scale)
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    window = _canonical_window(local_window_size)
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    spec = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=is_causal,
                    causal_alignment=causal_alignment, window=window)
    segment_ids = _canonical_segments(q_segment_ids, kv_segment_ids, batch, seq_q, seq_kv)
    segment_ids = _fold_lengths(segment_ids, query_seq_lengths, key_value_seq_lengths,
                                batch, seq_q, seq_kv)
    softcap = _check_soft_cap(logits_soft_cap)
    sinks = _check_sinks(sinks, query.shape[2])
    logits_shape = (batch, query.shape[2], seq_q, seq_kv)
    bias, mask = _check_bias(bias, logits_shape), _check_mask(mask, logits_shape)
    query, key, value = zero_unseen_rows(query, key, value, spec, segment_ids, mask)
    features = dispatch.Features(has_segments=segment_ids is not None, softcap=softcap,
                                 has_bias=bias is not None, has_mask=mask is not None)

    if implementation is None:
        implementation = dispatch.choose(query.shape, key.shape, query.dtype, spec, features,
                                         interpret=interpret)
    backend = dispatch.backend(implementation)
    reason = dispatch.unsupported(implementation, query.shape, key.shape, query.dtype, spec,
                                  features)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    config = _resolve_config(config, implementation, query, key, value, spec, interpret)
    static = StaticArgs(kernels=backend.KERNELS, mask=spec, scale=float(scale),
                        config=config, interpret=interpret, softcap=softcap)
    out, lse = attention_with_lse(query, key, value, segment_ids, sinks, bias, mask, static)
    if return_residual:
        return out, jnp.transpose(lse, (0, 2, 1))
    return out


def _resolve_config(config, implementation: str, query, key, value, spec: MaskSpec,
                    interpret: bool):
    """The backend config for ``attention``'s ``config`` argument (see its docstring)."""
    default = dispatch.backend(implementation).default_config(query.shape, key.shape,
                                                              query.dtype, spec)
    if config is None:
        return default
    if isinstance(config, str) and config == "autotune":
        return config_for_attention(query, key, value, implementation=implementation,
                                    is_causal=spec.is_causal, interpret=interpret)
    # A backend may take configs of several types (Mosaic: forward, backward or both).
    accepted = getattr(dispatch.backend(implementation), "CONFIG_TYPES", (type(default),))
    if not isinstance(config, accepted):
        names = " or ".join(t.__name__ for t in accepted)
        raise ValueError(
            f"config must be None, 'autotune' or a {names} for "
            f"implementation={implementation!r}, got {config!r}")
    return config


def _canonical_segments(q_segment_ids, kv_segment_ids, batch, seq_q, seq_kv):
    if q_segment_ids is None and kv_segment_ids is None:
        return None
    if kv_segment_ids is None and seq_q == seq_kv:
        kv_segment_ids = q_segment_ids
    if q_segment_ids is None or kv_segment_ids is None:
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
    return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


# Segment ids given to padding: a padded query's id matches no key, a padded key's no query.
PADDED_QUERY_ID = -(2**31)
PADDED_KEY_ID = -(2**31) + 1


def _fold_lengths(segment_ids, q_lengths, kv_lengths, batch, seq_q, seq_kv):
    """Padding as segment ids: every path that handles segments handles padding too."""
    if q_lengths is None and kv_lengths is None:
        return segment_ids
    if segment_ids is None:
        segment_ids = (jnp.zeros((batch, seq_q), jnp.int32), jnp.zeros((batch, seq_kv), jnp.int32))
    q_ids, kv_ids = segment_ids
    for name, lengths, ids, pad_id in (
        ("query_seq_lengths", q_lengths, q_ids, PADDED_QUERY_ID),
        ("key_value_seq_lengths", kv_lengths, kv_ids, PADDED_KEY_ID),
    ):
        if lengths is None:
            continue
        if getattr(lengths, "shape", None) != (batch,):
            raise ValueError(
                f"{name} must have shape [batch] = {(batch,)}, "
                f"got {getattr(lengths, 'shape', None)}")
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"{name} must have an integer dtype, got {lengths.dtype}")
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        padded = jnp.where(positions < lengths[:, None], ids, pad_id)
        if pad_id == PADDED_QUERY_ID:
            q_ids = padded
        else:
            kv_ids = padded
    return q_ids, kv_ids


def _check_soft_cap(cap) -> float | None:
    if cap is None:
        return None
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number, got {cap!r}")
    return float(cap)


def _check_sinks(sinks, heads: int):
    if sinks is None:
        return None
    if getattr(sinks, "shape", None) != (heads,):
        raise ValueError(
            f"sinks must have shape [heads] = {(heads,)}, got {getattr(sinks, 'shape', None)}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must have a floating dtype, got {sinks.dtype}")
    return sinks


def _check_bias(bias, logits_shape):
    if bias is None:
        return None
    dtype = getattr(bias, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"bias must be an array with a floating dtype, got {dtype}")
    return bias_lib.canonical(bias, "bias", logits_shape)


def _check_mask(mask, logits_shape):
    if mask is None:
        return None
    if getattr(mask, "dtype", None) != jnp.bool_:
        raise ValueError(
            "mask must be a boolean array (True = visible; pass an additive mask as bias), "
            f"got dtype {getattr(mask, 'dtype', None)}")
    return bias_lib.canonical(mask, "mask", logits_shape)


def _check_scale(scale) -> None:
    if isinstance(scale, jax.core.Tracer):
        raise ValueError("scale must be a Python float, not a traced value")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def _canonical_window(window) -> tuple[int, int] | None:
    if window is None:
        return None
    if isinstance(window, int):
        window = (window, window)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) for w in window) or min(window) < 0):
        raise ValueError(
            f"local_window_size must be a non-negative int or a (left, right) pair of them, "
            f"got {window!r}")
    return (window[0], window[1])

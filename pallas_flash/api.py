"""``pallas_flash.attention``: a thin door. The call is checked and put in canonical form
(:func:`pallas_flash.call.canonicalize`), the planner picks its path and kernels
(:func:`pallas_flash.plan.plan`), and the kernels run through
:func:`pallas_flash.autodiff.attention_with_lse`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallas_flash import decode, dispatch
from pallas_flash.arguments import (
    Implementation,
    check_bools,
)
from pallas_flash.autodiff import add_sinks, attention_with_lse
from pallas_flash.call import canonicalize
from pallas_flash.contract import (
    EMPTY_ROW_LSE,
    PADDED_KEY_ID,
    PADDED_QUERY_ID,
    segment_ids_with_bounds,
)
from pallas_flash.dispatch import available_implementations, default_implementation
from pallas_flash.flex import BlockMask, flex_reference
from pallas_flash.masking import CausalAlignment, zero_unseen_rows
from pallas_flash.plan import plan

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
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
    config: Any = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention, computed tile by tile without materialising the scores.

    Same layout, arguments and results as ``jax.nn.dot_product_attention``: a call written
    for it runs unchanged (the differences are listed in ``docs/api.md``).

    Args:
      query: ``[batch, seq_q, heads, head_dim]``, or ``[seq_q, heads, head_dim]`` (one
        sequence, as ``jax.nn``: the output then has no batch dim either). bfloat16,
        float16, float32, or float64 (under ``jax_enable_x64``; XLA path only, computed
        in float64).
      key: ``[batch, seq_kv, kv_heads, head_dim]`` (or without ``batch``); ``heads`` must
        be a multiple of ``kv_heads`` (grouped-query / multi-query attention; K and V are
        never repeated). A sequence of length 0 (``seq_q`` or ``seq_kv``) gives zeros,
        as ``jax.nn``.
      value: ``[batch, seq_kv, kv_heads, value_head_dim]`` (or without ``batch``): shaped
        like ``key``, or with a head dim of its own (multi-head latent attention's 192 /
        128); the output then has ``value_head_dim``. Head dims have no upper bound here:
        the Triton kernels take up to 512, the Mosaic ones up to 256 with one head dim for
        all three, the XLA path any (``implementation=None`` picks one that runs the call).
      bias: floating array broadcastable to ``[batch, heads, seq_q, seq_kv]`` (rank <= 4,
        leading dims added as in ``jax.nn``), added to the scaled logits (after the
        soft-cap, if any); differentiable. Broadcast (size-1) dims are never expanded in
        the forward. Its gradient is computed only when one is requested; for a bias that
        broadcasts over batch or heads, it costs a float32 partial of up to
        ``[batch, heads, seq_q, seq_kv]`` (see ``docs/api.md``).
      mask: boolean array broadcastable to ``[batch, heads, seq_q, seq_kv]``; ``False``
        hides the pair. Combined (and) with ``is_causal``, the window, segment ids and
        lengths. Unlike ``jax.nn`` (which spreads a fully masked row evenly over every key),
        a row with no visible key outputs 0. An integer mask is taken too (``jax.nn``
        refuses it): nonzero = visible.
      scale: logit scale, a concrete positive number (Python, NumPy or a 0-d JAX array;
        not a traced value); default ``1 / sqrt(head_dim)``.
      is_causal: hide keys after the query position (a Python or NumPy bool).
      causal_alignment: ``"top_left"`` (default, as ``jax.nn``: query ``i`` sees keys
        ``<= i``) or ``"bottom_right"`` (query ``i`` sees keys ``<= i + seq_kv - seq_q``,
        so the last query sees every key, as when queries extend a KV cache).
      local_window_size: ``w`` or ``(left, right)``: query ``i`` sees only keys in
        ``[i - left, i + right]`` (after alignment), as ``jax.nn``.
      q_segment_ids: ``[batch, seq_q]`` integer ids of packed documents; a query sees only
        keys with the same id (combined with the causal/window mask). Give both or neither;
        ``kv_segment_ids`` defaults to ``q_segment_ids`` when ``seq_q == seq_kv``. For a
        query without batch dim, ``[seq_q]`` also works (as under ``jax.vmap``).
      kv_segment_ids: ``[batch, seq_kv]`` integer ids. The two values ``-2**31`` and
        ``-2**31 + 1`` are reserved (they mark padding, below).
      query_seq_lengths: ``[batch]`` integers (an array, NumPy array or list) giving the
        number of real queries per sequence (as ``jax.nn``); rows past it output 0. For
        a query without batch dim, ``[1]`` (as ``jax.nn``) or a scalar.
      key_value_seq_lengths: ``[batch]`` number of real keys per sequence, as
        ``query_seq_lengths``; later keys are hidden (and their tiles skipped).
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)`` before the softmax
        (Gemma-2 style soft-capping), with its gradient.
      sinks: ``[heads]`` learnable logits, one per query head, that join every row's softmax
        denominator without contributing a value (attention sinks); differentiable.
      return_residual: also return the residual of ``jax.nn.dot_product_attention``:
        ``[batch, seq_q, heads]`` in the input dtype, the natural log of each row's softmax
        denominator, with ``jax.lax.stop_gradient`` applied (no gradient flows through it,
        as in ``jax.nn``). Rows that see no key have output 0 and residual ``-1e30``
        (``jax.nn``: a large negative number).
      return_lse: also return ``lse: [batch, seq_q, heads]`` (float32, or float64 for
        float64 inputs; natural log of the softmax denominator) that is differentiable:
        gradients flow through it into ``query``, ``key``, ``bias`` and ``sinks``. Rows
        that see no key have output 0 and lse ``-1e30``. Not together with
        ``return_residual``.
      deterministic: ``True``: the gradients are bitwise identical on every run (same
        inputs, same compiled program), on every backend. The default, ``False``, is the
        fastest backward and is not reproducible: on Hopper the Mosaic backward up to
        head_dim 128 adds each CTA's share of dQ into float32 with TMA reduce-adds whose
        order, hence rounding, varies between runs (FlashAttention-3's fused dQ). With
        ``True`` it computes dQ in a separate kernel in which one CTA owns each dQ tile
        (``docs/tuning.md`` has the cost). The Triton and XLA backwards are reproducible
        either way. ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` has the same effect
        for every call (:func:`pallas_flash.dispatch.deterministic_backward`). With a
        Mosaic ``MosaicBackwardConfig(deterministic=False)`` in ``config``, ``True``
        raises ``ValueError`` (in the backward). The forward is reproducible either way.
      implementation: the forward's backend: ``"mosaic"`` (Hopper), ``"triton"`` (any GPU,
        or CPU with ``interpret=True``) or ``"xla"``; ``None`` picks the fastest available
        that supports the call. ``"cudnn"`` hands the call to
        ``jax.nn.dot_product_attention(..., implementation="cudnn")`` unchanged (it raises
        what ``jax.nn`` raises, e.g. off an NVIDIA GPU); arguments ``jax.nn`` lacks then
        raise ``ValueError``. The backward runs on the same backend when it can; when it
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
      score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score``: a function of
        the float32 logit (after scale, soft cap and bias) and the int32 positions,
        written as for scalars with ``jnp`` ops; it may close over JAX arrays, which are
        constants for differentiation (``docs/flex.md``).
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool``: True where query
        ``q_idx`` may see key ``kv_idx``; ANDed with every other mask.
      block_mask: a :class:`pallas_flash.BlockMask` from :func:`pallas_flash.create_block_mask`
        for these lengths (it carries its ``mask_mod``). With any of the three the call
        runs on ``"xla"`` (the default: the functions evaluated densely, every other option
        taken) or, when named, ``"triton"`` (fused kernels walking the block mask; with
        scale, soft cap and sinks only).

    Returns:
      ``out``, shaped like ``query`` (with the values' head dim), in the input dtype;
      with ``return_residual`` or ``return_lse`` the pair ``(out, residual or lse)``, the
      second shaped like ``query`` without its last dim.
    """
    if implementation == "cudnn":
        return _through_cudnn(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, return_residual=return_residual,
            ours=dict(causal_alignment=causal_alignment != "top_left",
                      q_segment_ids=q_segment_ids is not None,
                      kv_segment_ids=kv_segment_ids is not None,
                      logits_soft_cap=logits_soft_cap is not None, sinks=sinks is not None,
                      return_lse=return_lse is not False, interpret=interpret is not False,
                      deterministic=deterministic is not False,
                      config=config is not None, score_mod=score_mod is not None,
                      mask_mod=mask_mod is not None, block_mask=block_mask is not None))
    call = canonicalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        causal_alignment=causal_alignment, local_window_size=local_window_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        logits_soft_cap=logits_soft_cap, sinks=sinks,
        returns_lse=return_residual or return_lse, deterministic=deterministic,
        implementation=implementation, interpret=interpret, config=config,
        score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask)
    check_bools(interpret=interpret, return_residual=return_residual, return_lse=return_lse)
    if return_residual and return_lse:
        raise ValueError("return_residual and return_lse cannot both be True: "
                         "return_lse=True returns the differentiable float32 lse")
    outputs = dict(return_residual=return_residual, return_lse=return_lse,
                   output_shape=call.output_shape)
    route = plan(call)
    query, key, value = call.query, call.key, call.value
    if route.path == "decode":
        out = decode.decode_attention(
            query, key, value, scale=call.scale, is_causal=call.mask.is_causal,
            logits_soft_cap=call.softcap, sinks=call.sinks,
            deterministic=call.deterministic, implementation=call.implementation)
        return out.reshape(call.output_shape)
    if route.path == "empty":
        # jax.nn's answer for empty sequences: rows that see no key output 0.
        batch, seq_q, heads = query.shape[:3]
        lse = jnp.full((batch, heads, seq_q), EMPTY_ROW_LSE,
                       jnp.promote_types(query.dtype, jnp.float32))
        return _outputs(jnp.zeros((*query.shape[:3], value.shape[3]), query.dtype), lse,
                        **outputs)
    # Rows that no pair sees are zeroed before any kernel (the bounds as segment ids tell
    # which; the kernels take them as the backend does).
    query, key, value = zero_unseen_rows(
        query, key, value, call.mask,
        segment_ids_with_bounds(call.segment_ids, call.bounds, call.mask.seq_q,
                                call.mask.seq_kv),
        call.attn_mask)
    if route.path == "flex":
        out, lse = _user_functions(call, route, query, key, value)
        if call.sinks is not None:
            out, lse = add_sinks(out, lse, call.sinks)
        return _outputs(out, lse, **outputs)
    out, lse = attention_with_lse(query, key, value, call.segment_ids, call.sinks, call.bias,
                                  call.attn_mask, route.static, call.bounds)
    return _outputs(out, lse, **outputs)


def _user_functions(call, route, query, key, value):
    """``(out, lse [B, N, T])`` of a call with ``score_mod`` / ``mask_mod`` /
    ``block_mask`` on the planned backend (:func:`pallas_flash.plan.plan`)."""
    flex = call.flex
    if route.implementation == "triton":
        return dispatch.backend("triton").flex_attention(
            query, key, value, route.block_mask, score_mod=flex.score_converted, scale=call.scale,
            softcap=call.softcap, interpret=call.interpret, config=call.config)
    return flex_reference(
        query, key, value, score_mod=flex.score_mod, mask_mod=flex.mask_mod,
        block_mask=flex.block_mask, scale=call.scale, bias=call.bias, mask=call.attn_mask,
        softcap=call.softcap, mask_spec=call.mask, segment_ids=call.segment_ids,
        bounds=call.bounds)


def _outputs(out, lse, *, return_residual: bool, return_lse: bool, output_shape):
    """``attention``'s result from ``out [B, T, N, D]`` and ``lse [B, N, T]``, shaped as
    the caller's query (no batch dim for a rank-3 query)."""
    out = out.reshape(output_shape)
    if not (return_residual or return_lse):
        return out
    lse = jnp.transpose(lse, (0, 2, 1)).reshape(output_shape[:-1])
    if return_lse:
        return out, lse
    # jax.nn's residual: in the input dtype, and no gradient flows through it.
    return out, lax.stop_gradient(lse.astype(out.dtype))


# jax.nn's function as it was when this module was imported: a program that sets
# jax.nn.dot_product_attention = pallas_flash.attention would otherwise send "cudnn" calls
# back here, forever (RecursionError).
_JAX_NN_ATTENTION = jax.nn.dot_product_attention


def _through_cudnn(query, key, value, bias, mask, *, ours: dict[str, bool], **kwargs):
    """``implementation="cudnn"``: the call as ``jax.nn.dot_product_attention`` takes it.

    ``ours``: for each argument ``jax.nn`` lacks, whether the call set it.
    """
    given = [name for name, is_set in ours.items() if is_set]
    if given:
        raise ValueError(
            f"implementation='cudnn' runs jax.nn.dot_product_attention, which has no "
            f"{', '.join(given)}: leave them at their defaults or pick another "
            "implementation")
    return _JAX_NN_ATTENTION(query, key, value, bias, mask, implementation="cudnn", **kwargs)

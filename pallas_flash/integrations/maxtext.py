"""MaxText: pallas-flash as the attention kernel of MaxText models.

Tested with ``maxtext`` 0.2.5 (jax 0.11.2). :class:`FlashAttentionOp` is MaxText's
``AttentionOp`` with its kernel choice (``apply_attention``) replaced by
:func:`pallas_flash.attention`; its parameters, cache and everything around the kernel
stay MaxText's. Models built inside :func:`use_flash_attention` get it::

    from flax import nnx
    from maxtext.models import models
    from pallas_flash.integrations import maxtext as pf_maxtext

    with pf_maxtext.use_flash_attention():
        model = models.Transformer(config, mesh, None, model_mode="train", rngs=nnx.Rngs(0))
    logits = model(tokens, positions, decoder_segment_ids=segment_ids)  # no context needed

MaxText's NNX modules are built eagerly, so the context is needed only around the
construction (of every model whose layers use ``maxtext.layers.attentions.Attention``,
MLA's included; ``gpt3`` builds its own ``AttentionOp`` and is not covered).

What the kernel gets, from MaxText's own arguments and config (so tiles are skipped instead
of reading MaxText's dense additive ``[b, 1, 1, t, s]`` mask):

- ``scale=1``: MaxText scales the query in its projection already (its own kernels get
  ``logits_scale=1.0``); the default ``1/sqrt(head_dim)`` would scale twice.
- training and prefill: ``is_causal`` (unless ``attention_type="full"``), the
  ``decoder_segment_ids`` as segment ids (MaxText also hides keys with a negative id), and
  for ``local_sliding`` layers the window ``(sliding_window_size - 1, 0)``.
- autoregressive steps: the active cache slots (segment id 1) as segment ids and, for
  ``local_sliding`` layers, the same window counted back from the last slot, as MaxText.
- ``attn_logits_soft_cap`` and the ``sinks`` of gpt-oss style layers.
- MaxText merges the prefill cache's and the autoregressive cache's partial results as
  ``(unnormalized out, max, sum)`` triples; this op returns ``(out, lse, 1)``, for which
  that merge is the exact log-sum-exp combination.

Calls it cannot honour run MaxText's own ``apply_attention``, with a warning (once per
reason): quantized KV caches, ragged decoding, chunked prefill, bidirectional (multimodal)
masks, sparse-indexer, compressed, chunked, MoBA or block-diffusion attention,
``record_max_logits``, context parallelism, and a value head size unlike the key's.

One difference remains: a query that sees no key at all (only with negative segment ids)
outputs 0 here and the mean of the values in MaxText.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.api import attention
from pallas_flash.integrations.checks import require

_TESTED = "maxtext 0.2.5"

try:
    from maxtext.common import common_types
    from maxtext.inference.kvcache import KVTensor
    from maxtext.layers import attention_op, attentions
except ImportError as error:
    raise ImportError(
        f"pallas_flash.integrations.maxtext needs maxtext (tested with {_TESTED}): {error}"
    ) from error

require(attentions, ["AttentionOp"], tested=_TESTED)
require(attention_op.AttentionOp, ["_context_parallel_size", "_load_balanced_context_parallel"],
        tested=_TESTED)
# Stored under the same names (attention_type resolved against the config).
require(attention_op.AttentionOp.__init__, [], tested=_TESTED,
        call_parameters=["attention_type", "sliding_window_size", "attn_logits_soft_cap"])
require(attention_op.AttentionOp.apply_attention, [], tested=_TESTED,
        call_parameters=["query", "key", "value", "decoder_segment_ids", "segment_positions",
                         "model_mode", "use_ragged_attention", "previous_chunk",
                         "bidirectional_mask", "sinks", "indexer_mask", "compressed_mask",
                         "record_max_logits", "decoder_segment_ids_kv", "compress_ratio"])
require(common_types, ["AttentionType", "DECODING_ACTIVE_SEQUENCE_INDICATOR",
                       "MODEL_MODE_AUTOREGRESSIVE"], tested=_TESTED)

_AttentionType = common_types.AttentionType
_SUPPORTED_TYPES = (_AttentionType.GLOBAL, _AttentionType.LOCAL_SLIDING, _AttentionType.FULL)
# apply_attention arguments that select a mask or result this op does not produce: arrays
# (unsupported when given) and flags (when true or nonzero).
_UNSUPPORTED_ARRAYS = {
    "previous_chunk": "chunked prefill (previous_chunk)",
    "bidirectional_mask": "a bidirectional (multimodal) mask",
    "indexer_mask": "a sparse-indexer mask",
    "compressed_mask": "compressed attention",
}
_UNSUPPORTED_FLAGS = {
    "compress_ratio": "compressed attention",
    "record_max_logits": "record_max_logits",
}


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"pallas_flash: MaxText's own attention runs instead: {reason} is not "
                  f"supported by the adapter", stacklevel=4)


class FlashAttentionOp(attention_op.AttentionOp):
    """MaxText's ``AttentionOp`` whose attention is :func:`pallas_flash.attention`.

    Built by MaxText (``maxtext.layers.attentions.Attention``) with ``AttentionOp``'s
    arguments; see the module docstring for what it passes to the kernel.
    """

    def apply_attention(self, query: jax.Array, key: jax.Array, value: jax.Array,
                        decoder_segment_ids: jax.Array | None, model_mode: str,
                        **options: Any) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """MaxText's per-cache attention, as ``(out, lse, 1)``.

        Args:
          query: ``[batch, seq_q, heads, head_dim]``, already scaled by MaxText.
          key: ``[batch, seq_kv, kv_heads, head_dim]``.
          value: ``[batch, seq_kv, kv_heads, head_dim]``.
          decoder_segment_ids: ``[batch, seq_kv]`` (MaxText's), or None.
          model_mode: ``"train"``, ``"prefill"`` or ``"autoregressive"``.
          **options: the rest of MaxText's ``apply_attention`` arguments (keywords).

        Returns:
          ``out: [batch, seq_q, heads, head_dim]`` (normalized), ``lse`` and ones, both
          ``[batch, seq_q, heads, 1]``, in the place of MaxText's (unnormalized out, max,
          sum); MaxText's own triple where it runs instead.
        """
        reason = self._unsupported(query, key, value, model_mode, options)
        if reason is not None:
            _warn_fallback(reason)
            return super().apply_attention(
                query=query, key=key, value=value, decoder_segment_ids=decoder_segment_ids,
                model_mode=model_mode, **options)
        decoding = model_mode == common_types.MODEL_MODE_AUTOREGRESSIVE
        q_ids = kv_ids = None
        if decoder_segment_ids is not None and decoding:
            # Decoding hides the cache slots not marked active; no causal mask.
            active = common_types.DECODING_ACTIVE_SEQUENCE_INDICATOR
            # The autoregressive cache's ids may be [1, seq_kv] for the whole batch.
            kv_ids = jnp.broadcast_to(decoder_segment_ids == active,
                                      (key.shape[0], key.shape[1])).astype(jnp.int32)
            q_ids = jnp.ones(query.shape[:2], jnp.int32)
        elif decoder_segment_ids is not None:
            kv = options.get("decoder_segment_ids_kv")
            kv = decoder_segment_ids if kv is None else kv
            # MaxText hides keys with a negative id: distinct stand-ins that match nothing.
            q_ids = jnp.where(decoder_segment_ids >= 0, decoder_segment_ids, -2)
            kv_ids = jnp.where(kv >= 0, kv, -1)
        window = None
        if self.attention_type == _AttentionType.LOCAL_SLIDING:
            window = (self.sliding_window_size - 1, 0)
        out, lse = attention(
            query, key, value, scale=1.0,
            is_causal=not decoding and self.attention_type != _AttentionType.FULL,
            causal_alignment="bottom_right" if decoding else "top_left",
            local_window_size=window, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            logits_soft_cap=self.attn_logits_soft_cap or None, sinks=options.get("sinks"),
            return_lse=True)
        lse = lse[..., None]
        return out, lse, jnp.ones_like(lse)

    def _unsupported(self, query, key, value, model_mode: str, options: dict) -> str | None:
        """Why MaxText's own attention must run for this call, or None."""
        if isinstance(key, KVTensor) or isinstance(value, KVTensor):
            return "a quantized KV cache (kv_quant)"
        if self.attention_type not in _SUPPORTED_TYPES:
            return f"attention_type={self.attention_type.value!r}"
        if (self.attention_type == _AttentionType.LOCAL_SLIDING
                and self.sliding_window_size is None):
            return "a local_sliding layer without sliding_window_size"
        if value.shape != key.shape:
            return "a value head size unlike the key's"
        decoding = model_mode == common_types.MODEL_MODE_AUTOREGRESSIVE
        if decoding and options.get("use_ragged_attention"):
            return "ragged decoding (use_ragged_attention)"
        if decoding and query.shape[1] != 1:
            return "an autoregressive step of several tokens"
        for name, what in _UNSUPPORTED_ARRAYS.items():
            if options.get(name) is not None:
                return what
        for name, what in _UNSUPPORTED_FLAGS.items():
            if options.get(name):
                return what
        if getattr(self.config, "moba", False):
            return "MoBA attention"
        if self._context_parallel_size() > 1 or (
                options.get("segment_positions") is not None
                and self._load_balanced_context_parallel()):
            return "context parallelism"
        return None


@contextlib.contextmanager
def use_flash_attention() -> Iterator[None]:
    """MaxText attention layers built inside this context use :class:`FlashAttentionOp`.

    Replaces ``maxtext.layers.attentions.AttentionOp`` for the duration of the context;
    the layers keep their op afterwards. Not thread-safe (it patches a module global).
    """
    original = attentions.AttentionOp
    attentions.AttentionOp = FlashAttentionOp
    try:
        yield
    finally:
        attentions.AttentionOp = original

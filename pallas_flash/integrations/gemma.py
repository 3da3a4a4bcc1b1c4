"""Gemma: pallas-flash as the attention of ``gemma`` (``gm.nn``) models.

Tested with ``gemma`` 4.0.1 (jax 0.11.2), for the Gemma 2 and 3 architectures built on
``gemma.gm.nn._modules.Attention`` (``gm.nn.Gemma2_*``, ``gm.nn.Gemma3_*``; not Gemma 3n
or Gemma 4, whose attention modules are separate). :class:`FlashAttention` is Gemma's
``Attention`` with the scores computed by :func:`pallas_flash.attention`: same parameters
(checkpoints load unchanged), projections, qk-norm, RoPE and ring-buffer KV cache, so the
sampler works as before. :func:`flash_model` gives the model class that uses it::

    from gemma import gm
    from pallas_flash.integrations import gemma as pf_gemma

    model = pf_gemma.flash_model(gm.nn.Gemma3_1B, assume_causal=True)()
    out = model.apply({"params": params}, tokens)      # params of gm.nn.Gemma3_1B
    text = gm.text.Sampler(model=model, params=params).sample(prompt)

Gemma's conventions, kept: the logits are scaled by ``query_pre_attn_scalar`` (not
``1/sqrt(head_dim)``), soft-capped by ``attn_logits_soft_cap``, and a query that sees no
key outputs the mean of the values (Gemma's softmax over a fully masked row), where
:func:`pallas_flash.attention` alone would give 0. The attention probabilities are not
formed, so ``attention_weights`` captures nothing.

Gemma hands each layer a dense ``[batch, seq_q, cache]`` mask and its sliding window is on
token positions, so by default the kernel gets that mask (exact, no tile skipped).
``assume_causal=True`` declares what the layer cannot see: the masks are Gemma's default
text masks (causal, padding only at the end, positions counting from 0; no images, no
prefix-LM masks). Calls without a cache (training, scoring) then also pass ``is_causal``
and, on sliding layers, ``local_window_size=(sliding_window_size - 1, 0)``, so tiles
outside them are skipped; padded queries (past the end) may then differ from Gemma's, the
real tokens do not. Calls with a cache (the sampler) keep the dense mask.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_flash.api import attention
from pallas_flash.integrations.checks import require

_TESTED = "gemma 4.0.1"

try:
    from gemma.gm.math import _positional_embeddings
    from gemma.gm.nn import _modules, _transformer
except ImportError as error:
    raise ImportError(
        f"pallas_flash.integrations.gemma needs gemma (tested with {_TESTED}): {error}"
    ) from error

require(_modules, ["Attention", "AttentionType", "create_sliding_mask"], tested=_TESTED)
require(_transformer.Transformer, ["_apply_attention"], tested=_TESTED)
require(_positional_embeddings, ["apply_rope"], tested=_TESTED)
require(_modules.Attention, ["use_qkv_einsum", "use_gqa", "setup", "init_cache"], tested=_TESTED,
        call_parameters=["num_heads", "num_kv_heads", "head_dim", "attn_type",
                         "query_pre_attn_scalar", "rope_base_frequency", "rope_scale_factor",
                         "attn_logits_soft_cap", "sliding_window_size", "use_qk_norm"])
require(_modules.Attention.__call__, [], tested=_TESTED,
        call_parameters=["x", "segment_pos", "cache", "attn_mask"])

LayerCache = dict[str, jax.Array]


class FlashAttention(_modules.Attention):
    """Gemma's ``Attention`` computed by :func:`pallas_flash.attention` (dense mask)."""

    #: Whether the masks are declared causal text masks (:func:`flash_model`).
    ASSUME_CAUSAL: ClassVar[bool] = False

    def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: LayerCache | None,
                 attn_mask: jax.Array) -> tuple[LayerCache | None, jax.Array]:
        """Gemma's attention layer.

        Args:
          x: ``[batch, seq_q, features]``.
          segment_pos: ``[batch, seq_q]`` absolute token positions.
          cache: Gemma's layer cache (``k``, ``v``: ``[batch, cache_size, kv_heads,
            head_dim]``, ``positions: [batch, cache_size]``, ``end_index: [batch]``) or None.
          attn_mask: ``[batch, seq_q, cache_size]`` (``seq_q`` without a cache), True where
            the query may see the key.

        Returns:
          The updated cache (None without one) and ``[batch, seq_q, features]``.
        """
        if self.use_qkv_einsum:
            query, key, value = self.qkv_einsum("BTD,SNDH->SBTNH", x)
        else:
            query = self.q_einsum("BTD,NDH->BTNH", x)
            key, value = self.kv_einsum("BSD,CKDH->CBSKH", x)
        if self.use_qk_norm:
            query, key = self._query_norm(query), self._key_norm(key)
        rope = dict(base_frequency=self.rope_base_frequency, scale_factor=self.rope_scale_factor)
        query = _positional_embeddings.apply_rope(query, segment_pos, **rope)
        key = _positional_embeddings.apply_rope(key, segment_pos, **rope)

        key_positions = segment_pos
        if cache is not None:
            # Gemma's ring buffer: the new tokens overwrite slots from end_index on.
            start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
            key = jax.lax.dynamic_update_slice(cache["k"], key, start)
            value = jax.lax.dynamic_update_slice(cache["v"], value, start)
            key_positions = jax.lax.dynamic_update_slice(cache["positions"], segment_pos,
                                                         start[:2])

        sliding = self.attn_type == _modules.AttentionType.LOCAL_SLIDING
        if sliding and self.sliding_window_size is None:
            raise ValueError("sliding_window_size must be set for AttentionType.LOCAL_SLIDING")
        if self.attn_type not in (_modules.AttentionType.GLOBAL,
                                  _modules.AttentionType.LOCAL_SLIDING):
            raise ValueError(f"attn_type must be GLOBAL or LOCAL_SLIDING, got {self.attn_type}")
        mask = attn_mask.astype(bool)
        if sliding:
            mask = mask & _modules.create_sliding_mask(
                segment_pos, cache_positions=key_positions,
                sliding_window_size=self.sliding_window_size)
        structured = self.ASSUME_CAUSAL and cache is None
        encoded = attention(
            query, key, value, mask=mask[:, None], scale=self.query_pre_attn_scalar,
            is_causal=structured,
            local_window_size=(self.sliding_window_size - 1, 0) if structured and sliding
            else None,
            logits_soft_cap=self.attn_logits_soft_cap)
        # Gemma's softmax spreads a row that sees nothing evenly over every key.
        mean_value = jnp.repeat(value.mean(axis=1), self.num_heads // self.num_kv_heads, axis=1)
        unseen = ~jnp.any(mask, axis=-1)
        encoded = jnp.where(unseen[..., None, None], mean_value[:, None].astype(encoded.dtype),
                            encoded)
        output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)

        if cache is None:
            return None, output
        return {"v": value, "k": key, "end_index": cache["end_index"] + x.shape[1],
                "positions": key_positions}, output


class CausalFlashAttention(FlashAttention):
    """:class:`FlashAttention` for models whose masks are declared causal text masks."""

    ASSUME_CAUSAL: ClassVar[bool] = True


def flash_model(model_class: type, *, assume_causal: bool = False) -> type:
    """A subclass of a Gemma 2/3 model class whose attention layers are :class:`FlashAttention`.

    Args:
      model_class: a subclass of ``gm.nn.Transformer`` (``gm.nn.Gemma3_1B``, ...).
      assume_causal: declare that every mask the model gets is Gemma's default causal text
        mask (see the module docstring), so that calls without a cache skip tiles.

    Returns:
      The subclass (the same one for the same arguments), with the same fields and
      parameters as ``model_class``; being a class of its own, it never shares a jitted
      trace with ``model_class``.
    """
    if not (isinstance(model_class, type) and issubclass(model_class, _transformer.Transformer)):
        raise ValueError(
            f"model_class must be a subclass of gm.nn.Transformer, got {model_class!r}")
    if not isinstance(assume_causal, bool):
        raise ValueError(f"assume_causal must be a bool, got {assume_causal!r}")
    return _flash_subclass(model_class, CausalFlashAttention if assume_causal else FlashAttention)


@functools.cache
def _flash_subclass(model_class: type, attention_class: type) -> type:
    """``model_class`` whose blocks are set up with ``attention_class`` as their Attention."""

    def _apply_attention(self, inputs, cache):
        # Gemma's blocks build their Attention lazily, on their first call, which is here.
        original = _modules.Attention
        _modules.Attention = attention_class
        try:
            return model_class._apply_attention(self, inputs, cache)
        finally:
            _modules.Attention = original

    name = f"Flash{model_class.__name__}"
    return type(name, (model_class,), {"_apply_attention": _apply_attention,
                                       "__module__": model_class.__module__,
                                       "__qualname__": name})

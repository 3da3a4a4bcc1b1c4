"""Gemma: pallas-flash as the attention of ``gemma`` (``gm.nn``) models.

Tested with ``gemma`` 4.0.1 (jax 0.11.2), for the Gemma 2 and 3 architectures built on
``gemma.gm.nn._modules.Attention`` (``gm.nn.Gemma2_*``, ``gm.nn.Gemma3_*``), Gemma 3n
(``gm.nn.Gemma3n_*``) and Gemma 4 (``gm.nn.Gemma4_*``), whose attention modules are
classes of their own. :class:`FlashAttention` is Gemma's ``Attention`` with the scores
computed by :func:`pallas_flash.attention`, :class:`FlashAttention3n` and
:class:`FlashAttention4` are Gemma 3n's and Gemma 4's: same parameters (checkpoints load
unchanged), projections, norms, RoPE, KV sharing and ring-buffer KV cache, so the sampler
works as before. :func:`flash_model` gives the model class that uses them::

    from gemma import gm
    from pallas_flash.integrations import gemma as pf_gemma

    model = pf_gemma.flash_model(gm.nn.Gemma3_1B, assume_causal=True)()
    out = model.apply({"params": params}, tokens)      # params of gm.nn.Gemma3_1B
    text = gm.text.Sampler(model=model, params=params).sample(prompt)

Gemma's conventions, kept: the logits are scaled by ``query_pre_attn_scalar`` (not
``1/sqrt(head_dim)``; Gemma 4 scales them by nothing), soft-capped by
``attn_logits_soft_cap``, and a query that sees no key outputs the mean of the values
(Gemma's softmax over a fully masked row), where
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
from types import ModuleType
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_flash.api import attention
from pallas_flash.integrations.checks import require

_TESTED = "gemma 4.0.1"

try:
    from gemma.gm.math import _positional_embeddings
    from gemma.gm.nn import _modules, _transformer
    from gemma.gm.nn.gemma3n import _modules as _modules3n
    from gemma.gm.nn.gemma3n import _transformer as _transformer3n
    from gemma.gm.nn.gemma4 import _modules as _modules4
    from gemma.gm.nn.gemma4 import _transformer as _transformer4
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
require(_transformer3n, ["Gemma3nTransformer"], tested=_TESTED)
require(_modules3n.Attention, ["use_qkv_einsum", "setup"], tested=_TESTED,
        call_parameters=["num_heads", "num_kv_heads", "head_dim", "attn_type",
                         "query_pre_attn_scalar", "rope_base_frequency", "rope_scale_factor",
                         "attn_logits_soft_cap", "sliding_window_size", "use_qk_norm",
                         "use_value_norm"])
require(_modules3n.Attention.__call__, [], tested=_TESTED,
        call_parameters=["x", "segment_pos", "cache", "attn_mask", "kv_shared_cache"])
require(_modules4, ["Attention", "AttentionType", "_create_sliding_mask"], tested=_TESTED)
require(_transformer4.Transformer, ["_apply_attention"], tested=_TESTED)
require(_modules4.Attention, ["setup"], tested=_TESTED,
        call_parameters=["num_heads", "num_kv_heads", "features", "key_size", "attn_type",
                         "rope_base_frequency", "rope_scale_factor", "rope_proportion",
                         "attn_logits_soft_cap", "sliding_window_size", "k_eq_v"])
require(_modules4.Attention.__call__, [], tested=_TESTED,
        call_parameters=["x", "segment_pos", "cache", "attn_mask", "kv_shared_cache"])

LayerCache = dict[str, jax.Array]


def _attend(layer, query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array,
            segment_pos: jax.Array, key_positions: jax.Array, *, scale: float,
            structured: bool, sliding_mask) -> jax.Array:
    """The scores of a Gemma attention ``layer`` (2, 3 or 4) by :func:`attention`.

    ``query: [batch, seq_q, heads, head_dim]``, ``key``/``value: [batch, keys, kv_heads,
    head_dim]``, ``attn_mask: [batch, seq_q, keys]``, ``key_positions: [batch, keys]``;
    ``sliding_mask``: the Gemma version's sliding-window mask function; ``structured``:
    also pass ``is_causal`` and the window (the masks are declared causal text masks and
    there is no cache). Returns ``[batch, seq_q, heads, head_dim]``.
    """
    sliding = layer.attn_type.name == "LOCAL_SLIDING"
    if sliding and layer.sliding_window_size is None:
        raise ValueError("sliding_window_size must be set for AttentionType.LOCAL_SLIDING")
    if layer.attn_type.name not in ("GLOBAL", "LOCAL_SLIDING"):
        raise ValueError(f"attn_type must be GLOBAL or LOCAL_SLIDING, got {layer.attn_type}")
    mask = attn_mask.astype(bool)
    if sliding:
        mask = mask & sliding_mask(segment_pos, cache_positions=key_positions,
                                   sliding_window_size=layer.sliding_window_size)
    encoded = attention(
        query, key, value, mask=mask[:, None], scale=scale, is_causal=structured,
        local_window_size=(layer.sliding_window_size - 1, 0) if structured and sliding
        else None,
        logits_soft_cap=layer.attn_logits_soft_cap)
    # Gemma's softmax spreads a row that sees nothing evenly over every key.
    mean_value = jnp.repeat(value.mean(axis=1), layer.num_heads // layer.num_kv_heads, axis=1)
    unseen = ~jnp.any(mask, axis=-1)
    return jnp.where(unseen[..., None, None], mean_value[:, None].astype(encoded.dtype),
                     encoded)


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

        encoded = _attend(self, query, key, value, attn_mask, segment_pos, key_positions,
                          scale=self.query_pre_attn_scalar, structured=self.ASSUME_CAUSAL
                          and cache is None, sliding_mask=_modules.create_sliding_mask)
        output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)

        if cache is None:
            return None, output
        return {"v": value, "k": key, "end_index": cache["end_index"] + x.shape[1],
                "positions": key_positions}, output


class CausalFlashAttention(FlashAttention):
    """:class:`FlashAttention` for models whose masks are declared causal text masks."""

    ASSUME_CAUSAL: ClassVar[bool] = True


class FlashAttention4(_modules4.Attention):
    """Gemma 4's ``Attention`` computed by :func:`pallas_flash.attention` (dense mask).

    As Gemma 4 computes it: no query scaling (the logits are the products of the
    RMS-normalised query and key), the sliding window on token positions, a key projection
    that is also the value projection where ``k_eq_v`` (global layers of the larger models;
    the value then goes through its own unscaled norm), and the K/V of an earlier layer in
    place of its own where the layer shares a KV cache (``kv_shared_cache``).
    """

    #: Whether the masks are declared causal text masks (:func:`flash_model`).
    ASSUME_CAUSAL: ClassVar[bool] = False

    def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: LayerCache | None,
                 attn_mask: jax.Array, kv_shared_cache: LayerCache | None = None,
                 ) -> tuple[LayerCache, jax.Array]:
        """Gemma 4's attention layer.

        Args:
          x: ``[batch, seq_q, features]``.
          segment_pos: ``[batch, seq_q]`` absolute token positions.
          cache: the layer cache (``k``, ``v``: ``[batch, cache_size, kv_heads, head_dim]``,
            ``positions: [batch, cache_size]``, ``end_index: [batch]``) or None.
          attn_mask: ``[batch, seq_q, cache_size]`` (``seq_q`` without a cache), True where
            the query may see the key.
          kv_shared_cache: the ``k``, ``v`` (and, with a cache, ``positions``) of the layer
            whose KV this one shares, or None.

        Returns:
          The layer's new cache (``k``, ``v``, and with a cache ``end_index`` and
          ``positions``: later layers may share it) and ``[batch, seq_q, features]``.
        """
        rope = dict(base_frequency=self.rope_base_frequency,
                    scale_factor=self.rope_scale_factor, rope_proportion=self.rope_proportion)
        query = self.query_norm(self.q_einsum("BTD,NDH->BTNH", x))
        query = _positional_embeddings.apply_rope(query, segment_pos, **rope)
        # Computed even for a layer that shares its KV: Gemma 4 does, and its checkpoints
        # hold these projections, so the parameters stay the same.
        if self.k_eq_v:
            key = value = self.k_einsum("BSD,KDH->BSKH", x)
        else:
            key, value = self.kv_einsum("BSD,CKDH->CBSKH", x)
        key, value = self.key_norm(key), self.value_norm(value)

        key_positions = segment_pos
        if kv_shared_cache is not None:
            key, value = kv_shared_cache["k"], kv_shared_cache["v"]
            key_positions = kv_shared_cache.get("positions", segment_pos)
        else:
            key = _positional_embeddings.apply_rope(key, segment_pos, **rope)
            if cache is not None:
                # Gemma 4's ring buffer, per sequence: slots from end_index on.
                slots = ((cache["end_index"][:, None] + jnp.arange(x.shape[1])[None])
                         % cache["v"].shape[1])
                rows = jnp.arange(x.shape[0])[:, None]
                value = cache["v"].at[rows, slots].set(value)
                key = cache["k"].at[rows, slots].set(key)
                key_positions = cache["positions"].at[rows, slots].set(segment_pos)

        encoded = _attend(self, query, key, value, attn_mask, segment_pos, key_positions,
                          scale=1.0, structured=self.ASSUME_CAUSAL and cache is None,
                          sliding_mask=_modules4._create_sliding_mask)
        output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)
        new_cache = {"v": value, "k": key}
        if cache is not None:
            new_cache.update(end_index=cache["end_index"] + x.shape[1],
                             positions=key_positions)
        return new_cache, output


class CausalFlashAttention4(FlashAttention4):
    """:class:`FlashAttention4` for models whose masks are declared causal text masks."""

    ASSUME_CAUSAL: ClassVar[bool] = True


class FlashAttention3n(_modules3n.Attention):
    """Gemma 3n's ``Attention`` computed by :func:`pallas_flash.attention` (dense mask).

    As Gemma 3n computes it: the query scaled by ``query_pre_attn_scalar``, qk-norm and
    the unscaled value norm where configured, Gemma 3's sliding window, and the K/V of an
    earlier layer in place of its own where the layer shares a KV cache
    (``kv_shared_cache``; the layer then computes no K/V projection, as in Gemma 3n, so the
    parameters are the same). ``guard_against_excess_precision`` rounds Gemma's logits to
    their dtype; the kernels keep theirs in float32 (a no-op for float32 models, within
    the logits' own rounding for bfloat16 ones).
    """

    #: Whether the masks are declared causal text masks (:func:`flash_model`).
    ASSUME_CAUSAL: ClassVar[bool] = False

    def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: LayerCache | None,
                 attn_mask: jax.Array, kv_shared_cache: LayerCache | None = None,
                 ) -> tuple[LayerCache, jax.Array]:
        """Gemma 3n's attention layer.

        Args:
          x: ``[batch, seq_q, features]``.
          segment_pos: ``[batch, seq_q]`` absolute token positions.
          cache: the layer cache (``k``, ``v``: ``[batch, cache_size, kv_heads, head_dim]``,
            ``positions: [batch, cache_size]``, ``end_index: [batch]``) or None.
          attn_mask: ``[batch, seq_q, cache_size]`` (``seq_q`` without a cache), True where
            the query may see the key.
          kv_shared_cache: the ``k``, ``v`` of the layer whose KV this one shares, or None.

        Returns:
          The layer's new cache (``k``, ``v``, and with a cache ``end_index`` and
          ``positions``) and ``[batch, seq_q, features]``.
        """
        shared = kv_shared_cache is not None
        if self.use_qkv_einsum:
            query, key, value = self.qkv_einsum("BTD,SNDH->SBTNH", x)
        else:
            query = self.q_einsum("BTD,NDH->BTNH", x)
            if not shared:
                key, value = self.kv_einsum("BSD,CKDH->CBSKH", x)
        if shared:
            key, value = kv_shared_cache["k"], kv_shared_cache["v"]
        if self.use_qk_norm:
            query = self.query_norm(query)
            if not shared:
                key = self.key_norm(key)
        if self.use_value_norm and not shared:
            value = self.value_norm(value)
        rope = dict(base_frequency=self.rope_base_frequency, scale_factor=self.rope_scale_factor)
        query = _positional_embeddings.apply_rope(query, segment_pos, **rope)
        if not shared:
            key = _positional_embeddings.apply_rope(key, segment_pos, **rope)

        key_positions = segment_pos
        if cache is not None:
            # Gemma 3n's ring buffer: the new tokens overwrite slots from end_index on.
            start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
            if not shared:
                value = jax.lax.dynamic_update_slice(cache["v"], value, start)
                key = jax.lax.dynamic_update_slice(cache["k"], key, start)
            key_positions = jax.lax.dynamic_update_slice(cache["positions"], segment_pos,
                                                         start[:2])

        encoded = _attend(self, query, key, value, attn_mask, segment_pos, key_positions,
                          scale=self.query_pre_attn_scalar,
                          structured=self.ASSUME_CAUSAL and cache is None,
                          sliding_mask=_modules.create_sliding_mask)
        output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)
        new_cache = {"v": value, "k": key}
        if cache is not None:
            new_cache.update(end_index=cache["end_index"] + x.shape[1],
                             positions=key_positions)
        return new_cache, output


class CausalFlashAttention3n(FlashAttention3n):
    """:class:`FlashAttention3n` for models whose masks are declared causal text masks."""

    ASSUME_CAUSAL: ClassVar[bool] = True


def flash_model(model_class: type, *, assume_causal: bool = False) -> type:
    """A subclass of a Gemma 2/3/3n/4 model class whose attention layers are pallas-flash's
    (:class:`FlashAttention`; :class:`FlashAttention3n`, :class:`FlashAttention4`).

    Args:
      model_class: a subclass of ``gm.nn.Transformer`` (``gm.nn.Gemma3_1B``,
        ``gm.nn.Gemma3n_E2B``, ...) or of Gemma 4's transformer (``gm.nn.Gemma4_E2B``, ...).
      assume_causal: declare that every mask the model gets is Gemma's default causal text
        mask (see the module docstring), so that calls without a cache skip tiles.

    Returns:
      The subclass (the same one for the same arguments), with the same fields and
      parameters as ``model_class``; being a class of its own, it never shares a jitted
      trace with ``model_class``.
    """
    if not isinstance(assume_causal, bool):
        raise ValueError(f"assume_causal must be a bool, got {assume_causal!r}")
    if isinstance(model_class, type) and issubclass(model_class,
                                                    _transformer3n.Gemma3nTransformer):
        # A gm.nn.Transformer too, but its blocks build Gemma 3n's own Attention, in
        # __call__ (it has no _apply_attention).
        attention_class = CausalFlashAttention3n if assume_causal else FlashAttention3n
        return _flash_subclass(model_class, _modules3n, attention_class, "__call__")
    if isinstance(model_class, type) and issubclass(model_class, _transformer.Transformer):
        attention_class = CausalFlashAttention if assume_causal else FlashAttention
        return _flash_subclass(model_class, _modules, attention_class, "_apply_attention")
    if isinstance(model_class, type) and issubclass(model_class, _transformer4.Transformer):
        attention_class = CausalFlashAttention4 if assume_causal else FlashAttention4
        return _flash_subclass(model_class, _modules4, attention_class, "_apply_attention")
    raise ValueError(f"model_class must be a subclass of gm.nn.Transformer (Gemma 2, 3, "
                     f"3n) or of Gemma 4's transformer, got {model_class!r}")


@functools.cache
def _flash_subclass(model_class: type, modules: ModuleType, attention_class: type,
                    method: str) -> type:
    """``model_class`` whose blocks are set up with ``attention_class`` as the
    ``Attention`` of ``modules`` (its Gemma version's module of layers), inside
    ``method``, the one that first calls the blocks."""
    original_method = getattr(model_class, method)

    @functools.wraps(original_method)
    def patched(self, *args, **kwargs):
        # Gemma's blocks build their Attention lazily, on their first call, which is here.
        original = modules.Attention
        modules.Attention = attention_class
        try:
            return original_method(self, *args, **kwargs)
        finally:
            modules.Attention = original

    name = f"Flash{model_class.__name__}"
    return type(name, (model_class,), {method: patched, "__module__": model_class.__module__,
                                       "__qualname__": name})

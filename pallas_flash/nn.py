"""Flax layers on top of :func:`pallas_flash.attention`.

* :class:`FlashSelfAttention` — an NNX self-attention layer: fused or separate Q/K/V
  projections, grouped-query attention, rotary position embeddings, causal / sliding-window
  masks, segment ids for packed sequences, and a KV cache for autoregressive decoding.
* :func:`make_attention_fn` — a drop-in ``attention_fn`` for ``flax.nnx.MultiHeadAttention``
  and ``flax.linen.MultiHeadDotProductAttention``, decoding (``decode=True``) included.

Needs flax (``pip install 'pallas-flash[flax]'``); the rest of ``pallas_flash`` does not.

Both only ever call the attention through keyword arguments of
:func:`pallas_flash.attention`; soft-capping and sinks are passed only when the layer uses
them, so a replacement ``attention_fn`` needs them only then.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

try:
    from flax import nnx
    from flax.linen.dtypes import promote_dtype
except ImportError as error:   # the core package needs only jax; the layers need flax
    raise ImportError(
        "pallas_flash.nn needs flax (>= 0.12), which the core package does not install: "
        "pip install 'pallas-flash[flax]'") from error

from pallas_flash import dispatch
from pallas_flash.api import Implementation, attention
from pallas_flash.arguments import (
    canonical_window,
    check_bools,
    check_positive_int,
    check_sinks,
    check_soft_cap,
)
from pallas_flash.decode import decode_attention
from pallas_flash.masking import CausalAlignment
from pallas_flash.plan import MAX_DECODE_SEQ_Q

#: ``fn(query, key, value, *, is_causal, local_window_size, q_segment_ids, kv_segment_ids)``
#: -> ``out`` with :func:`pallas_flash.attention`'s layout and meaning. Swap it to compare
#: the layer against a reference or a baseline with everything else unchanged.
AttentionFn = Callable[..., jax.Array]

_default_kernel_init = nnx.initializers.lecun_normal()


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotate pairs ``(x[..., i], x[..., i + D/2])`` by ``position · base^(-2i/D)``.

    The "rotate-half" RoPE of GPT-NeoX / LLaMA. Computed in float32: at positions in the
    thousands the angles need more than bfloat16's 8 bits of mantissa.

    Args:
      x: ``[batch, seq, heads, head_dim]``, ``head_dim`` even.
      positions: ``[batch, seq]`` integer position of each token.
      base: wavelength base (10000 in the RoPE paper).

    Returns:
      ``[batch, seq, heads, head_dim]`` in ``x.dtype``.
    """
    _check_rope_base(base, "base")
    if getattr(x, "ndim", None) != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [batch, seq, heads, head_dim] with an even head_dim, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if (getattr(positions, "ndim", None) != 2 or positions.shape[1] != x.shape[1]
            or positions.shape[0] not in (1, x.shape[0])):
        raise ValueError(f"positions must be [batch, seq] (or [1, seq]) = "
                         f"{(x.shape[0], x.shape[1])}, got "
                         f"{getattr(positions, 'shape', type(positions).__name__)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integers, got {positions.dtype}")
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq     # [B, T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def masked_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     visible: jax.Array, *, logits_soft_cap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention with an explicit mask, GQA without repeating K/V.

    Used over the KV cache, where the number of valid keys changes every step (a dynamic
    length the static masks of :func:`pallas_flash.attention` cannot express). Decoding
    reads each cached key once per step, so materialising the scores costs nothing extra.

    Args:
      query: ``[batch, seq_q, heads, head_dim]``.
      key: ``[batch, seq_kv, kv_heads, head_dim]``.
      value: ``[batch, seq_kv, kv_heads, head_dim]``.
      visible: ``[seq_q, seq_kv]`` bool; a query row that sees no key outputs 0.
      logits_soft_cap, sinks: as in :func:`pallas_flash.attention`.

    Returns:
      ``[batch, seq_q, heads, head_dim]`` in ``query.dtype``.
    """
    dispatch.check_arrays(query, key, value)
    batch, seq_q, heads, head_dim = query.shape
    logits_soft_cap, sinks = check_soft_cap(logits_soft_cap), check_sinks(sinks, heads)
    if getattr(visible, "shape", None) != (seq_q, key.shape[1]) \
            or visible.dtype != jnp.bool_:
        raise ValueError(f"visible must be bool [seq_q, seq_kv] = {(seq_q, key.shape[1])}, "
                         f"got {getattr(visible, 'dtype', None)} "
                         f"{getattr(visible, 'shape', type(visible).__name__)}")
    kv_heads = key.shape[2]
    q = query.reshape(batch, seq_q, kv_heads, heads // kv_heads, head_dim)
    s = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32)
    s = s / math.sqrt(head_dim)
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    # A row that sees no key outputs 0, as in pallas_flash.attention: its logits become
    # zeros before the softmax (all -inf would give NaN, in the gradients too) and its
    # weights are dropped after.
    seen = jnp.any(visible, axis=-1, keepdims=True)
    s = jnp.where(visible, s, jnp.where(seen, -jnp.inf, 0.0))
    if sinks is not None:  # one more logit per head, with no value behind it
        sink = sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1)
        s = jnp.concatenate([s, jnp.broadcast_to(sink, (*s.shape[:-1], 1))], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    if sinks is not None:
        p = p[..., :-1]
    p = jnp.where(seen, p, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p, value.astype(jnp.float32))
    return out.reshape(query.shape).astype(query.dtype)


def _check_rope_base(base, name: str) -> None:
    if isinstance(base, bool) or not isinstance(base, (int, float)) \
            or not math.isfinite(base) or base <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {base!r}")


def check_cache_room(index: jax.Array | int, new_tokens: int, max_length: int) -> None:
    """Raise if writing ``new_tokens`` at cache slot ``index`` would run past ``max_length``.

    ``lax.dynamic_update_slice`` clamps its start index, so an overflowing write would
    silently overwrite the newest cached tokens instead. A concrete ``index`` (eager
    decoding) raises ``ValueError`` here. Under ``jax.jit`` / ``nnx.jit`` the index is
    traced: the comparison runs on the device and, only when it fails, calls back to the
    host (``io_callback``), which raises; the computation then fails with a
    ``jax.errors.JaxRuntimeError`` carrying this message when its result is read (jit
    dispatches asynchronously). The passing case costs one scalar comparison, no transfer.

    Args:
      index: scalar int32, the first free cache slot.
      new_tokens: tokens about to be written.
      max_length: cache slots.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, (int, np.integer)) \
            or new_tokens < 0:
        raise ValueError(f"new_tokens must be a non-negative int, got {new_tokens!r}")
    check_positive_int(max_length, "max_length")
    if not isinstance(index, jax.core.Tracer) and (
            isinstance(index, (bool, str)) or np.ndim(index) != 0
            or not np.issubdtype(np.result_type(index), np.integer)):
        raise ValueError(f"index must be a scalar int, got {index!r}")

    def message(at: object) -> str:
        if isinstance(at, int) and at < 0:
            # dynamic_update_slice would clamp it to 0 and overwrite the oldest tokens.
            return f"index must be >= 0 (a cache slot), got {at}"
        return (f"decoding {new_tokens} token(s) at cache index {at} runs past the cache's "
                f"max_length {max_length}: call init_cache with a larger max_length")

    if not isinstance(index, jax.core.Tracer):
        if int(index) < 0 or int(index) + new_tokens > max_length:
            raise ValueError(message(int(index)))
        return
    if new_tokens > max_length:   # fails at every index: say so while tracing
        raise ValueError(message("(any)"))

    def fail(at: np.ndarray) -> None:
        raise ValueError(message(int(at)))

    lax.cond((index < 0) | (index + new_tokens > max_length),
             lambda: io_callback(fail, None, index), lambda: None)


def _check_compute_dtype(dtype: Any) -> None:
    """ValueError unless ``dtype`` is None or names a dtype the attention takes: the
    projections would accept any and fail only at the first call."""
    allowed = (*dispatch.DTYPES, dispatch.FLOAT64)
    try:
        ok = dtype is None or jnp.dtype(dtype) in allowed
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"dtype must be None or one of {', '.join(d.name for d in allowed)}, "
                         f"got {dtype!r}")


class FlashSelfAttention(nnx.Module):
    """Multi-head self-attention computed by :func:`pallas_flash.attention`.

    Call with ``x: [batch, seq, d_model]``; returns ``[batch, seq, d_model]``.

    Args:
      d_model: input and output features.
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention); default ``num_heads``.
        Must divide ``num_heads``.
      head_dim: features per head; default ``d_model // num_heads``.
      fused_qkv: one ``d_model -> (heads + 2·kv_heads)·head_dim`` matmul instead of three.
      use_bias: biases on the projections.
      is_causal: each token sees only itself and earlier tokens.
      local_window_size: ``w`` or ``(left, right)`` sliding window, as in
        :func:`pallas_flash.attention`.
      rope_base: rotary embedding base, or ``None`` for no position encoding.
      logits_soft_cap: ``c``: logits become ``c·tanh(logits / c)`` (Gemma-2 style).
      use_sinks: learn one attention-sink logit per head (initialised to 0), as in
        :func:`pallas_flash.attention`'s ``sinks``.
      implementation: passed to :func:`pallas_flash.attention` (``None``: fastest available)
        and to :func:`pallas_flash.decode_attention` for decode steps (``"cudnn"``: decode
        steps take the package's choice).
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      deterministic_backward: bitwise-reproducible gradients, passed to
        :func:`pallas_flash.attention` as ``deterministic`` (named apart from Flax's
        ``deterministic``, which means "no dropout").
      attention_fn: replaces :func:`pallas_flash.attention` (see :data:`AttentionFn`);
        exclusive with ``implementation`` / ``interpret`` / ``deterministic_backward``.
      decode: default for ``__call__``'s ``decode``.
      dtype: computation dtype, None (that of the inputs and parameters) or one that
        :func:`pallas_flash.attention` takes: bfloat16, float16, float32, float64.
      param_dtype: parameter dtype.
      kernel_init: initialiser of the projection kernels.
      rngs: parameter initialisation keys.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        fused_qkv: bool = True,
        use_bias: bool = False,
        is_causal: bool = True,
        local_window_size: int | tuple[int, int] | None = None,
        rope_base: float | None = 10_000.0,
        logits_soft_cap: float | None = None,
        use_sinks: bool = False,
        implementation: Implementation | None = None,
        interpret: bool = False,
        deterministic_backward: bool = False,
        attention_fn: AttentionFn | None = None,
        decode: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: nnx.Initializer = _default_kernel_init,
        rngs: nnx.Rngs,
    ) -> None:
        check_positive_int(d_model, "d_model")
        check_positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive_int(num_kv_heads, "num_kv_heads")
        head_dim = d_model // num_heads if head_dim is None else head_dim
        check_positive_int(head_dim, "head_dim")
        if rope_base is not None:
            _check_rope_base(rope_base, "rope_base")
        # Everything the first call would refuse is refused here, at construction.
        check_bools(fused_qkv=fused_qkv, use_bias=use_bias, is_causal=is_causal,
                    use_sinks=use_sinks, interpret=interpret,
                    deterministic_backward=deterministic_backward, decode=decode)
        canonical_window(local_window_size)
        check_soft_cap(logits_soft_cap)
        _check_compute_dtype(dtype)
        # cuDNN has no split-KV decode of its own here: decode steps take the package's
        # choice (decode_attention refuses the name).
        decode_implementation = None if implementation == "cudnn" else implementation
        dispatch.check_implementation(decode_implementation, interpret, also=("cudnn",))
        if attention_fn is not None and not callable(attention_fn):
            raise ValueError(f"attention_fn must be callable or None, got {attention_fn!r}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if rope_base is not None and head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        if attention_fn is not None and (implementation is not None or interpret
                                         or deterministic_backward):
            raise ValueError("give either attention_fn or implementation/interpret/"
                             "deterministic_backward, not both")
        # A decode step (a few new tokens against the cache) runs split-KV decode on the
        # package's own kernels; with a caller's attention_fn, the cache is attended by
        # masked_attention (that function cannot take per-step cache lengths).
        self.decode_fn = None
        if attention_fn is None:
            options = dict(implementation=implementation, interpret=interpret,
                           deterministic=deterministic_backward)
            attention_fn = functools.partial(attention, **options)
            self.decode_fn = functools.partial(
                decode_attention, **(options | dict(implementation=decode_implementation)))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.is_causal = is_causal
        self.local_window_size = local_window_size
        self.rope_base = rope_base
        self.logits_soft_cap = logits_soft_cap
        self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if use_sinks else None
        self.attention_fn = attention_fn
        self.decode = decode
        self.dtype = dtype

        linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype,
                                   param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs)
        q_features, kv_features = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.qkv_proj = linear(d_model, q_features + 2 * kv_features)
        else:
            self.q_proj = linear(d_model, q_features)
            self.k_proj = linear(d_model, kv_features)
            self.v_proj = linear(d_model, kv_features)
        self.out_proj = linear(q_features, d_model)
        self.fused_qkv = fused_qkv
        # Data attributes (not static) so that init_cache can fill them in later.
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> None:
        """Allocate an empty KV cache for decoding up to ``max_length`` tokens.

        ``dtype`` defaults to the computation dtype (float32 if that is unset). A decode
        call that would run past ``max_length`` raises (see :func:`check_cache_room`).
        """
        if not self.is_causal:
            raise ValueError("decoding with a KV cache needs is_causal=True")
        check_positive_int(batch_size, "batch_size")
        check_positive_int(max_length, "max_length")
        dtype = dtype or self.dtype or jnp.float32
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"dtype must be a floating dtype for the cache, got {dtype}")
        shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(
        self,
        x: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        decode: bool | None = None,
    ) -> jax.Array:
        """Self-attention over ``x``.

        Args:
          x: ``[batch, seq, d_model]``.
          positions: ``[batch, seq]`` integer positions for the rotary embedding
            (default ``0 .. seq-1``; packed documents restart at 0). Ignored when decoding:
            positions continue from the cache.
          segment_ids: ``[batch, seq]`` integer document ids; tokens attend only within
            their document. Not allowed when decoding.
          decode: append ``x``'s keys/values to the cache (see :meth:`init_cache`) and
            attend to everything cached so far; ``x`` holds the next ``seq`` tokens.

        Returns:
          ``[batch, seq, d_model]``.
        """
        decode = self.decode if decode is None else decode
        if not isinstance(decode, (bool, np.bool_)):
            raise ValueError(f"decode must be a bool or None, got {decode!r}")
        d_model = self.out_proj.out_features
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != d_model:
            raise ValueError(f"x must be [batch, seq, d_model] with d_model {d_model}, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        batch, seq, _ = x.shape
        if decode and self.cached_key is not None and batch != self.cached_key.shape[0]:
            raise ValueError(f"x's batch ({batch}) must match the cache's (init_cache "
                             f"batch_size {self.cached_key.shape[0]})")
        query, key, value = self._project(x)
        if decode:
            if self.cache_index is None:
                raise ValueError("decode=True needs a cache: call init_cache first")
            if segment_ids is not None:
                raise ValueError("segment_ids are not supported when decoding")
            positions = self.cache_index[...] + jnp.arange(seq)[None]
        elif positions is None:
            positions = jnp.arange(seq)[None]
        if self.rope_base is not None:
            query = rotary_embedding(query, positions, self.rope_base)
            key = rotary_embedding(key, positions, self.rope_base)
        if decode:
            out = self._attend_to_cache(query, key, value)
        else:
            out = self.attention_fn(
                query, key, value, is_causal=self.is_causal,
                local_window_size=self.local_window_size,
                q_segment_ids=segment_ids, kv_segment_ids=segment_ids, **self._score_options())
        return self.out_proj(out.reshape(batch, seq, self.num_heads * self.head_dim))

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, d_model] -> q [B, T, N, D], k and v [B, T, K, D]."""
        batch, seq, _ = x.shape
        n, k, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused_qkv:
            query, key, value = jnp.split(self.qkv_proj(x), [n * d, (n + k) * d], axis=-1)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (query.reshape(batch, seq, n, d), key.reshape(batch, seq, k, d),
                value.reshape(batch, seq, k, d))

    def _attend_to_cache(self, query, key, value) -> jax.Array:
        """Write key/value [B, T, K, D] at the cache index, attend from query [B, T, N, D]."""
        index = self.cache_index[...]
        check_cache_room(index, query.shape[1], self.cached_key.shape[1])
        start = (0, index, 0, 0)
        cached_key = lax.dynamic_update_slice(self.cached_key[...],
                                              key.astype(self.cached_key.dtype), start)
        cached_value = lax.dynamic_update_slice(self.cached_value[...],
                                                value.astype(self.cached_value.dtype), start)
        self.cached_key[...], self.cached_value[...] = cached_key, cached_value
        self.cache_index[...] = index + query.shape[1]

        left = self.local_window_size
        left = left[0] if isinstance(left, (tuple, list)) else left
        if self.decode_fn is not None and query.shape[1] <= MAX_DECODE_SEQ_Q:
            # The cache holds index + T tokens, the last T the queries' own: decode's
            # per-row bottom-right alignment. Slots past them hold zeros or stale (finite)
            # entries, which the length hides (one for every row: the splits are sized
            # for equal rows).
            return self.decode_fn(
                query, cached_key.astype(query.dtype), cached_value.astype(query.dtype),
                is_causal=True, key_value_seq_lengths=index + query.shape[1],
                local_window_size=None if left is None else (left, 0),
                **self._score_options())
        # Slots past the newest token hold zeros (or stale entries): the causal mask with
        # the query's absolute position hides them.
        q_pos = index + jnp.arange(query.shape[1])[:, None]
        k_pos = jnp.arange(cached_key.shape[1])[None, :]
        visible = k_pos <= q_pos
        if left is not None:
            visible &= k_pos >= q_pos - left
        return masked_attention(query, cached_key.astype(query.dtype),
                                cached_value.astype(query.dtype), visible,
                                **self._score_options())

    def _score_options(self) -> dict:
        """Soft-cap and sinks, passed only when used (so any attention_fn still fits)."""
        options = {}
        if self.logits_soft_cap is not None:
            options["logits_soft_cap"] = self.logits_soft_cap
        if self.sinks is not None:
            options["sinks"] = self.sinks[...]
        return options


def make_attention_fn(
    *,
    is_causal: bool = False,
    causal_alignment: CausalAlignment | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Implementation | None = None,
    interpret: bool = False,
    deterministic_backward: bool = False,
) -> Callable[..., jax.Array]:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` and Linen's
    ``MultiHeadDotProductAttention``.

    Prefer ``is_causal`` / ``local_window_size`` here to a causal ``mask`` array: the kernels
    skip the tiles a causal or window band hides, while a mask array is read tile by tile
    and skips nothing (and on Hopper sends the call to the Triton kernels).

    Example::

        nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=rngs,
                               attention_fn=make_attention_fn(is_causal=True))

    The returned function takes the arguments of ``flax.nnx.dot_product_attention`` and
    ``flax.linen.dot_product_attention`` (``query: [..., seq_q, heads, head_dim]``,
    ``key, value: [..., seq_kv, kv_heads, head_dim]``, ``bias`` / ``mask`` broadcastable
    to ``[..., heads, seq_q, seq_kv]``, combined with the band chosen here). NNX's
    call-time ``is_causal`` adds a causal band to the one chosen here. It raises
    ``ValueError`` for dropout while training (``dropout_rate > 0`` and not
    ``deterministic``), for ``module`` (Flax passes it to sow attention weights, which are
    never formed) and for ``input_positions`` (rotary embeddings are not applied here).
    ``precision`` is accepted and ignored: float32 inputs are always computed at full
    float32 precision.

    Where the queries sit among the keys (which the causal band and window depend on):

    * ``seq_q == seq_kv`` (training, prefill, Linen's cache-initialising call): query ``i``
      is key ``i``.
    * one query row against a longer key sequence: a Flax decode step (``decode=True``;
      Flax decodes one token at a time). The query is the newest token: a causal band
      hides nothing, and the cache slots not written yet are hidden by the mask Flax
      passes (``arange(max_length) <= cache_index``), which is that row's causal mask.
      Flax does not pass the cache index, so a window cannot be placed: that raises.
    * any other ``seq_q != seq_kv`` with a band (a chunk of queries against a cache, or
      causal cross-attention): ambiguous, so it raises unless ``causal_alignment`` is
      given: ``"top_left"`` (query ``i`` is key ``i``: a prefill written at the start of
      the cache) or ``"bottom_right"`` (the queries are the last ``seq_q`` keys: keys
      concatenated as ``[past; new]``, or a chunk that fills the cache to its end).

    Flax's own caches (Linen and NNX) write past their end by overwriting the last slot;
    the index never reaches ``attention_fn``, so that cannot be caught here
    (:class:`FlashSelfAttention` raises instead).

    Args:
      is_causal: each query sees only keys at or before its position.
      causal_alignment: ``None`` (the rules above), ``"top_left"`` or ``"bottom_right"``
        (as :func:`pallas_flash.attention`).
      local_window_size: ``w`` or ``(left, right)``, as :func:`pallas_flash.attention`.
      implementation, interpret: passed to :func:`pallas_flash.attention`.
      deterministic_backward: passed to :func:`pallas_flash.attention` as
        ``deterministic`` (bitwise-reproducible gradients). Not the call's
        ``deterministic``, which Flax passes to mean "no dropout".

    Returns:
      ``attention_fn(query, key, value, bias=None, mask=None, ...) -> [..., seq_q, heads,
      head_dim]``.
    """
    check_bools(is_causal=is_causal)
    if causal_alignment not in (None, "top_left", "bottom_right"):
        raise ValueError("causal_alignment must be None, 'top_left' or 'bottom_right', "
                         f"got {causal_alignment!r}")
    causal_default = is_causal   # the call's own is_causal (NNX passes one) shadows it

    def attention_fn(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: Any = None,
        is_causal: bool = False,
        input_positions: jax.Array | None = None,
    ) -> jax.Array:
        del broadcast_dropout, dropout_rng, precision
        for name, x in (("query", query), ("key", key), ("value", value)):
            if getattr(x, "ndim", 0) < 3:
                raise ValueError(f"{name} must be an array [..., seq, heads, head_dim], got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
        if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:
            raise ValueError(f"query, key and value must share their batch dims, got "
                             f"{query.shape}, {key.shape}, {value.shape}")
        if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)) \
                or not 0.0 <= dropout_rate <= 1.0:
            raise ValueError(f"dropout_rate must be a number in [0, 1], got {dropout_rate!r}")
        if not isinstance(is_causal, (bool, np.bool_)):
            raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError("pallas_flash attention_fn does not support attention dropout "
                             "while training (dropout_rate > 0, deterministic=False)")
        if module is not None:
            raise ValueError("pallas_flash attention_fn cannot sow attention weights: "
                             "they are never materialised")
        if input_positions is not None:
            raise ValueError("pallas_flash attention_fn does not apply rotary embeddings: "
                             "input_positions must be None")
        causal = causal_default or bool(is_causal)
        alignment = _alignment(query.shape[-3], key.shape[-3], causal, local_window_size,
                               causal_alignment)
        query, key, value = promote_dtype(query, key, value, dtype=dtype)
        # Flax allows any number of batch dimensions; the API takes exactly one.
        batch_shape = query.shape[:-3]
        flat = [x.reshape((int(np.prod(batch_shape)), *x.shape[-3:]))
                for x in (query, key, value)]
        if mask is not None:   # Flax's masks are float 0/1 by default (make_attention_mask)
            mask = mask.astype(bool)
        bias, mask = (_flatten_batch(x, batch_shape) for x in (bias, mask))
        out = attention(*flat, bias, mask, is_causal=causal, causal_alignment=alignment,
                        local_window_size=local_window_size, implementation=implementation,
                        interpret=interpret, deterministic=deterministic_backward)
        return out.reshape(*batch_shape, *out.shape[1:])

    return attention_fn


def _alignment(seq_q: int, seq_kv: int, causal: bool, window, given: CausalAlignment | None,
               ) -> CausalAlignment:
    """The causal alignment of :func:`make_attention_fn` (the rules in its docstring)."""
    if given is not None or seq_q == seq_kv or not (causal or window is not None):
        return given or "top_left"
    if seq_q == 1 and seq_kv > 1:
        if window is not None:
            raise ValueError(
                "local_window_size with one query row against a longer key sequence (a Flax "
                "decode step): Flax does not pass the query's cache index, so the window "
                "cannot be placed; decode with pallas_flash.nn.FlashSelfAttention (its cache "
                "tracks the position), or give causal_alignment if the query is the first "
                "('top_left') or last ('bottom_right') key")
        return "bottom_right"   # the newest token: Flax's decode mask hides the empty slots
    raise ValueError(
        f"a causal band or window with seq_q={seq_q} != seq_kv={seq_kv} is ambiguous: give "
        "make_attention_fn causal_alignment='top_left' (query i is key i, e.g. a prefill at "
        "the start of a cache) or 'bottom_right' (the queries are the last seq_q keys)")


def _flatten_batch(x: jax.Array | None, batch_shape: tuple[int, ...]) -> jax.Array | None:
    """A Linen bias/mask ``[..., heads, seq_q, seq_kv]`` with the query's batch dims folded
    into one, as the query's are; batch dims of size 1 stay broadcast (not expanded)."""
    if x is None or x.ndim <= 3:
        return x
    lead, tail = x.shape[:-3], x.shape[-3:]
    if all(d == 1 for d in lead):
        return x.reshape((1, *tail))
    return jnp.broadcast_to(x, (*batch_shape, *tail)).reshape((-1, *tail))

"""Keras 3 (JAX backend) and KerasHub: attention through :func:`pallas_flash.attention`.

Keras has one extension point for attention: every ``keras.ops.dot_product_attention``
call (``keras.layers.MultiHeadAttention``, ``GroupedQueryAttention`` and KerasHub's
attention layers all go through it) ends in the backend function
``keras.src.backend.jax.nn.dot_product_attention``. :func:`install` replaces that function
with :func:`dot_product_attention`, which takes the same arguments::

    import keras
    from pallas_flash.integrations import keras as pf_keras

    pf_keras.install()          # before the model's functions are compiled
    model.fit(...)              # attention now runs pallas_flash.attention
    pf_keras.uninstall()        # Keras's own path again

Patching ``jax.nn.dot_product_attention`` instead does not reach the kernels: Keras always
calls it with ``implementation="xla"`` or ``"cudnn"``.

Keras's layers hand over dense masks (``[batch, 1, seq_q, seq_kv]``), so no block would be
skipped. While :func:`install` is in force, the self-attention of KerasHub decoders whose
mask is causal by construction (:data:`CAUSAL_DECODERS`: Llama, Mistral, Qwen) also passes
``is_causal=True`` when ``seq_q == seq_kv`` (the prompt, training), and Mistral's
``sliding_window=w`` as ``local_window_size=(w - 1, 0)``: the mask stays, and the kernel
skips the blocks it hides. Decode steps (one query against the cache) keep the dense mask.

Differences from Keras's own path: a query row that sees no key outputs 0 (Keras, through
``jax.nn``, outputs the mean of V); integer 0/1 masks are read as booleans, as Keras's
layers do. Calls with arguments this path cannot honour run Keras's own function, with a
one-time warning saying why: ``attn_logits_soft_cap`` (Keras documents its cap as
``logits / (1 + |logits| / cap)``, not the ``cap · tanh(logits / cap)`` of
``pallas_flash.attention``). ``flash_attention=False`` (``keras.config.disable_flash_attention()``)
runs Keras's own path without a warning: the user asked for it.

Needs ``keras`` (tested: 3.15) with the JAX backend; KerasHub (tested: 0.32) is optional.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

try:
    import keras
except ImportError as error:  # the core package needs only jax
    raise ImportError(
        "pallas_flash.integrations.keras needs keras (>= 3.15): pip install keras") from error

from pallas_flash.api import attention
from pallas_flash.integrations.checks import warn_once

#: The library versions this adapter was tested against.
TESTED_VERSIONS = "keras 3.15, keras-hub 0.32"

#: KerasHub decoder layers ``(module, class, window attribute or None)`` whose
#: self-attention mask is causal by construction: their ``_compute_self_attention_mask``
#: ands the padding mask with ``compute_causal_mask`` (and, where the attribute is named and
#: not None, with the band ``k > q - w``), and no cross-attention goes through them. Within
#: their ``call``, a square self-attention call from the first cache slot is causal,
#: top-left, with that window.
CAUSAL_DECODERS = (
    ("keras_hub.src.models.llama.llama_decoder", "LlamaTransformerDecoder", None),
    ("keras_hub.src.models.mistral.mistral_transformer_decoder", "MistralTransformerDecoder",
     "sliding_window"),
    ("keras_hub.src.models.qwen.qwen_decoder", "QwenTransformerDecoder", None),
)

# The private names this adapter depends on: the backend function every keras.ops
# attention call ends in.
_BACKEND_MODULE = "keras.src.backend.jax.nn"
_BACKEND_FUNCTION = "dot_product_attention"


@dataclasses.dataclass(frozen=True)
class _DecoderMask:
    """What a :data:`CAUSAL_DECODERS` layer's mask is, for square calls: causal, and this
    ``local_window_size`` (None: no window)."""

    window: tuple[int, int] | None


# Set inside the call of a CAUSAL_DECODERS layer, from the first cache slot.
_DECODER_MASK: contextvars.ContextVar[_DecoderMask | None] = contextvars.ContextVar(
    "pallas_flash_keras_decoder_mask", default=None)

_lock = threading.Lock()
# A call this adapter cannot honour runs Keras's own function, warned once per reason.
_warn_once = functools.partial(warn_once, __name__, fallback="Keras's own dot_product_attention")
# What install() replaced: class -> its call, backend module -> its function.
_installed: dict[Any, Callable] = {}


def _backend_module():
    """``keras.src.backend.jax.nn``, checked to hold the function we replace."""
    try:
        module = importlib.import_module(_BACKEND_MODULE)
    except ImportError as error:
        raise ImportError(
            f"pallas_flash.integrations.keras needs {_BACKEND_MODULE}, which this Keras "
            f"({keras.__version__}) does not have; tested with {TESTED_VERSIONS}") from error
    if not callable(getattr(module, _BACKEND_FUNCTION, None)):
        raise ImportError(
            f"{_BACKEND_MODULE}.{_BACKEND_FUNCTION} is missing in Keras {keras.__version__}: "
            f"pallas_flash.integrations.keras was tested with {TESTED_VERSIONS}")
    return module


#: Keras's own backend attention, which the fallbacks and :func:`uninstall` restore.
keras_dot_product_attention: Callable[..., jax.Array] = getattr(
    _backend_module(), _BACKEND_FUNCTION)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    flash_attention: bool | None = None,
    attn_logits_soft_cap: float | None = None,
) -> jax.Array:
    """Keras's backend ``dot_product_attention``, computed by :func:`pallas_flash.attention`.

    Same arguments as ``keras.src.backend.jax.nn.dot_product_attention`` (Keras's layout).

    Args:
      query: ``[batch, seq_q, heads, head_dim]``.
      key: ``[batch, seq_kv, kv_heads, head_dim]`` (``heads`` a multiple of ``kv_heads``).
      value: shaped like ``key``.
      bias: float array broadcastable to ``[batch, heads, seq_q, seq_kv]``, added to the
        scaled logits.
      mask: boolean (or 0/1 integer, as Keras's layers pass) array broadcastable to
        ``[batch, heads, seq_q, seq_kv]``; ``False`` hides the pair.
      scale: logit scale; default ``1 / sqrt(head_dim)``.
      is_causal: hide keys after the query position.
      flash_attention: ``None`` or ``True``: ours. ``False``: Keras's own path.
      attn_logits_soft_cap: not supported here (Keras documents a cap other than
        ``pallas_flash``'s ``tanh`` one): any value runs Keras's own path, with a one-time
        warning.

    Returns:
      ``[batch, seq_q, heads, head_dim]`` in the promoted dtype of the inputs.
    """
    if flash_attention is False:
        return keras_dot_product_attention(query, key, value, bias, mask, scale, is_causal,
                                           flash_attention, attn_logits_soft_cap)
    if flash_attention not in (None, True):
        raise ValueError(f"flash_attention must be None, True or False, got {flash_attention!r}")
    if attn_logits_soft_cap is not None:
        _warn_once("attn_logits_soft_cap is Keras's own cap (documented as "
                   "logits / (1 + |logits| / cap)), not pallas_flash's tanh soft-cap")
        return keras_dot_product_attention(query, key, value, bias, mask, scale, is_causal,
                                           flash_attention, attn_logits_soft_cap)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim] (Keras's "
                             f"layout), got shape {x.shape}")
    # Keras computes in the promoted dtype of the three inputs (and casts the bias to it).
    dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if bias is not None:
        bias = jnp.asarray(bias).astype(dtype)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask.astype(bool)
    window = None
    decoder_mask = _DECODER_MASK.get()
    if decoder_mask is not None and mask is not None and query.shape[1] == key.shape[1]:
        is_causal, window = True, decoder_mask.window
    return attention(query, key, value, bias=bias, mask=mask, scale=scale,
                     is_causal=bool(is_causal), local_window_size=window)


def _causal_decoder_call(call: Callable, window_attribute: str | None) -> Callable:
    """``call`` of a :data:`CAUSAL_DECODERS` layer, run with :data:`_DECODER_MASK` set.

    From the first cache slot only: a square call at a later slot (which no KerasHub model
    makes) would see a shifted mask, not a causal one.
    """

    @functools.wraps(call)
    def wrapped(self, *args, **kwargs):
        index = kwargs.get("self_attention_cache_update_index")
        from_start = index is None or (isinstance(index, int) and index == 0)
        size = getattr(self, window_attribute, None) if window_attribute else None
        # KerasHub's band k > q - w: w keys, the query's own included.
        window = (size - 1, 0) if isinstance(size, int) and size >= 1 else None
        token = _DECODER_MASK.set(_DecoderMask(window) if from_start else None)
        try:
            return call(self, *args, **kwargs)
        finally:
            _DECODER_MASK.reset(token)

    return wrapped


def _causal_decoder_classes(
        decoders: tuple[tuple[str, str, str | None], ...]) -> list[tuple[type, str | None]]:
    """The classes and window attributes of ``decoders``; none without KerasHub."""
    if not decoders:
        return []
    try:
        importlib.import_module("keras_hub")
    except ImportError:
        return []
    classes = []
    for module_name, class_name, window_attribute in decoders:
        try:
            classes.append((getattr(importlib.import_module(module_name), class_name),
                            window_attribute))
        except (ImportError, AttributeError) as error:
            raise ImportError(
                f"{module_name}.{class_name} is missing in this KerasHub: "
                f"pallas_flash.integrations.keras was tested with {TESTED_VERSIONS}"
            ) from error
    return classes


def install(*, causal_decoders: tuple[tuple[str, str, str | None], ...] = CAUSAL_DECODERS,
            ) -> None:
    """Route Keras's attention (``keras.ops.dot_product_attention``) through
    :func:`dot_product_attention`, and mark KerasHub's causal decoders.

    Takes effect for functions traced afterwards: install before the model's first
    ``fit`` / ``predict`` / ``generate`` (Keras keeps their compiled functions). Calling it
    again changes nothing.

    Args:
      causal_decoders: ``(module, class, window attribute or None)`` of the KerasHub
        decoder layers whose square self-attention calls also pass ``is_causal=True``
        (and their window), so hidden tiles are skipped; default :data:`CAUSAL_DECODERS`.
        ``()`` passes KerasHub's dense masks alone.

    Raises:
      ValueError: Keras's backend is not ``"jax"``, or ``causal_decoders`` is not a tuple
        of ``(str, str, str or None)`` triples.
      ImportError: this Keras or KerasHub has moved a name the adapter relies on.
    """
    if keras.config.backend() != "jax":
        raise ValueError(f"pallas_flash.integrations.keras needs the JAX backend "
                         f"(KERAS_BACKEND=jax), got backend {keras.config.backend()!r}")
    if not isinstance(causal_decoders, tuple) or not all(
            isinstance(d, tuple) and len(d) == 3 and isinstance(d[0], str)
            and isinstance(d[1], str) and (d[2] is None or isinstance(d[2], str))
            for d in causal_decoders):
        raise ValueError("causal_decoders must be a tuple of (module, class, window attribute "
                         f"or None) string triples, got {causal_decoders!r}")
    module = _backend_module()
    with _lock:
        if _installed:
            return
        classes = _causal_decoder_classes(causal_decoders)
        for cls, window_attribute in classes:
            _installed[cls] = cls.call
            cls.call = _causal_decoder_call(cls.call, window_attribute)
        _installed[module] = getattr(module, _BACKEND_FUNCTION)
        setattr(module, _BACKEND_FUNCTION, dot_product_attention)


def uninstall() -> None:
    """Undo :func:`install` (nothing to do if it is not in force)."""
    with _lock:
        for owner, original in _installed.items():
            setattr(owner, "call" if isinstance(owner, type) else _BACKEND_FUNCTION, original)
        _installed.clear()


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return bool(_installed)

"""Equinox: an ``eqx.nn.MultiheadAttention`` with its attention in :func:`pallas_flash.attention`.

Equinox has no extension point for attention: ``MultiheadAttention.__call__`` maps the
module-private ``equinox.nn._attention.dot_product_attention`` over the heads, one
``[seq, head_dim]`` head at a time. :func:`multihead_attention` runs the same module (its
projections, its parameters) with all heads in one :func:`pallas_flash.attention` call::

    import equinox as eqx
    from pallas_flash.integrations import equinox as pf_eqx

    mha = eqx.nn.MultiheadAttention(num_heads=8, query_size=512, key=jax.random.key(0))
    out = pf_eqx.multihead_attention(mha, x, x, x, is_causal=True)   # was: mha(x, x, x, mask)

Equinox's masks are dense (``[seq_q, seq_kv]`` or ``[heads, seq_q, seq_kv]``): nothing
tells a causal one from any other, so pass the structure as arguments (``is_causal``,
``local_window_size``, segment ids): the kernel then skips the blocks they hide. A
``mask`` may be given as well; it is anded with them.

Differences from ``mha(...)``: a query row that sees no key outputs 0 (Equinox: the mean
of V). Attention-weight dropout (``dropout_p > 0`` outside inference) is not something
the kernels do: such calls run ``mha(...)`` itself, with a one-time warning.

Needs ``equinox`` (tested: 0.13).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

try:
    import equinox as eqx
except ImportError as error:  # the core package needs only jax
    raise ImportError("pallas_flash.integrations.equinox needs equinox (>= 0.13): "
                      "pip install equinox") from error

from pallas_flash.api import attention
from pallas_flash.integrations.checks import warn_once

#: The library versions this adapter was tested against.
TESTED_VERSIONS = "equinox 0.13"
# A call this adapter cannot honour runs the module's own attention, with a warning once per reason.
_warn_once = functools.partial(warn_once, __name__, fallback="the module's own attention")


# The public fields of eqx.nn.MultiheadAttention this adapter reads.
_FIELDS = ("query_proj", "key_proj", "value_proj", "output_proj", "dropout", "num_heads")


def multihead_attention(
    mha: eqx.nn.MultiheadAttention,
    query: jax.Array,
    key_: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    inference: bool | None = None,
    process_heads: Callable | None = None,
    is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``mha(query, key_, value, mask, key=..., inference=..., process_heads=...)`` with the
    attention computed by :func:`pallas_flash.attention`, all heads in one call.

    One sequence, as ``eqx.nn.MultiheadAttention`` takes it (``jax.vmap`` over a batch).

    Args:
      mha: the ``eqx.nn.MultiheadAttention`` whose parameters are used.
      query: ``[seq_q, query_size]``.
      key_: ``[seq_kv, key_size]``.
      value: ``[seq_kv, value_size]``.
      mask: optional boolean ``[seq_q, seq_kv]`` or ``[num_heads, seq_q, seq_kv]``;
        ``False`` hides the pair.
      key: PRNG key for dropout (as ``mha``; used only when the call falls back to it).
      inference: as ``mha``: ``True`` turns dropout off; ``None`` uses the module's setting.
      process_heads: as ``mha``: ``f(q, k, v) -> (q, k, v)`` on ``[seq, num_heads, size]``
        heads (rotary embeddings, for instance); must keep their shapes.
      is_causal: hide keys after the query position (top-left, as ``jax.nn``).
      local_window_size: ``w`` or ``(left, right)``, as :func:`pallas_flash.attention`;
        ``docs/conventions.md`` maps other libraries' windows to it.
      q_segment_ids: ``[seq_q]`` integer document ids (packed sequences).
      kv_segment_ids: ``[seq_kv]`` integer document ids.

    Returns:
      ``[seq_q, output_size]``.
    """
    missing = [name for name in _FIELDS if not hasattr(mha, name)]
    if missing:
        raise ValueError(f"mha must be an eqx.nn.MultiheadAttention (tested: {TESTED_VERSIONS}); "
                         f"{type(mha).__name__} has no {', '.join(missing)}")
    for name, x in (("query", query), ("key_", key_), ("value", value)):
        if getattr(x, "ndim", None) != 2:
            raise ValueError(f"{name} must be [seq, features] (one sequence; jax.vmap over a "
                             f"batch), got shape {getattr(x, 'shape', type(x).__name__)}")
    if key_.shape[0] != value.shape[0]:
        raise ValueError(f"key_ and value must have the same length, got {key_.shape[0]} "
                         f"and {value.shape[0]}")
    dropout = mha.dropout
    drops = dropout.p > 0 and not (dropout.inference if inference is None else inference)
    if drops:
        if is_causal or local_window_size is not None or q_segment_ids is not None \
                or kv_segment_ids is not None:
            raise ValueError("is_causal, local_window_size and segment ids need the "
                             "pallas_flash path, which has no dropout: with dropout, "
                             "pass them as mask instead")
        _warn_once("attention-weight dropout (dropout_p > 0 outside inference) is not "
                   "supported by pallas_flash")
        return mha(query, key_, value, mask, key=key, inference=inference,
                   process_heads=process_heads)

    heads = [jax.vmap(proj)(x).reshape(x.shape[0], mha.num_heads, -1)
             for proj, x in ((mha.query_proj, query), (mha.key_proj, key_),
                             (mha.value_proj, value))]
    if process_heads is not None:
        shapes = [h.shape for h in heads]
        heads = list(process_heads(*heads))
        if [h.shape for h in heads] != shapes:
            raise ValueError("process_heads must not change the shape of the heads")
    out = attention(*heads, mask=mask, is_causal=is_causal,
                    local_window_size=local_window_size, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids)
    return jax.vmap(mha.output_proj)(out.reshape(query.shape[0], -1))

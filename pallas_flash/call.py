"""One canonical attention call: every argument checked once and put in one form.

:func:`canonicalize` turns the arguments of :func:`pallas_flash.attention` (the layout and
options of ``jax.nn.dot_product_attention``) into an :class:`AttentionCall`: batched
``[batch, seq, heads, head_dim]`` arrays, the static :class:`~pallas_flash.masking.MaskSpec`,
the per-sequence lengths as a :class:`~pallas_flash.contract.RowBounds`, segment ids,
canonical bias and mask arrays, and the decisions already made (scale, soft cap,
``deterministic``). The planner (:mod:`pallas_flash.plan`) decides the path from it.

Kernels without ``row_bounds`` (:class:`~pallas_flash.contract.Kernels`) see the bounds as
segment ids: :func:`segment_ids_with_bounds` is that fold, the one place it is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash import bias as bias_lib
from pallas_flash import dispatch
from pallas_flash.arguments import (
    canonical_bool,
    canonical_scale,
    canonical_segments,
    canonical_window,
    check_deterministic,
    check_lengths,
    check_sinks,
    check_soft_cap,
)
from pallas_flash.contract import RowBounds
from pallas_flash.flex import FlexFunctions, flex_functions
from pallas_flash.masking import CausalAlignment, MaskSpec


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """A checked attention call in canonical form.

    ``query: [batch, seq_q, heads, head_dim]``, ``key: [batch, seq_kv, kv_heads,
    head_dim]``, ``value: [batch, seq_kv, kv_heads, value_head_dim]`` (a rank-3 input gets
    its batch dim here; ``output_shape`` is the caller's query shape with the values' head
    dim, which the results take). ``mask``: the static band (causal, alignment,
    window); None when a sequence is empty (:attr:`empty`), where no band exists.
    ``bounds``: None or the lengths as :class:`RowBounds` of int32 ``[batch]`` (``q_end =
    query_seq_lengths``, ``kv_start = 0``, ``kv_end = key_value_seq_lengths``, a length not
    given being the whole sequence). ``segment_ids``: None or int32 ``(q_ids [batch, seq_q],
    kv_ids [batch, seq_kv])``. ``bias`` / ``attn_mask``: None or canonical ``[B', N', T',
    S']`` arrays (:mod:`pallas_flash.bias`). ``sinks``: None or ``[heads]``.
    ``deterministic`` is already decided (the argument or ``XLA_FLAGS``); ``returns_lse``:
    the caller wants the lse or the residual. ``flex``: the call's ``score_mod`` /
    ``mask_mod`` / ``block_mask`` (:mod:`pallas_flash.flex`), or None.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    mask: MaskSpec | None
    scale: float
    output_shape: tuple[int, ...]
    bounds: RowBounds | None = None
    segment_ids: tuple[jax.Array, jax.Array] | None = None
    bias: jax.Array | None = None
    attn_mask: jax.Array | None = None
    sinks: jax.Array | None = None
    softcap: float | None = None
    implementation: str | None = None
    config: Any = None
    deterministic: bool = False
    interpret: bool = False
    returns_lse: bool = False
    flex: FlexFunctions | None = None

    @property
    def empty(self) -> bool:
        """Whether the batch or a sequence is empty (every row then sees no key)."""
        return min(self.query.shape[0], self.query.shape[1], self.key.shape[1]) == 0

    @property
    def features(self) -> dispatch.Features:
        """What the call uses beyond q, k, v and the band, as the backends' checks take it
        (bounds count as segment ids: kernels without ``row_bounds`` read them so)."""
        return dispatch.Features(
            has_segments=self.segment_ids is not None or self.bounds is not None,
            softcap=self.softcap, has_bias=self.bias is not None,
            has_mask=self.attn_mask is not None, value_head_dim=self.value_head_dim)

    @property
    def value_head_dim(self) -> int | None:
        """The values' head dim where it differs from the queries' (MLA), else None."""
        dv = self.value.shape[3]
        return None if dv == self.query.shape[3] else dv


def canonicalize(
    query, key, value, bias=None, mask=None, *, scale: float | None = None,
    is_causal: bool = False, causal_alignment: CausalAlignment = "top_left",
    local_window_size: int | tuple[int, int] | None = None, q_segment_ids=None,
    kv_segment_ids=None, query_seq_lengths=None, key_value_seq_lengths=None,
    logits_soft_cap: float | None = None, sinks=None, returns_lse: bool = False,
    deterministic: bool = False, implementation: str | None = None,
    interpret: bool = False, config: Any = None, score_mod=None, mask_mod=None,
    block_mask=None,
) -> AttentionCall:
    """The :class:`AttentionCall` of a :func:`pallas_flash.attention` call (its arguments,
    documented there, but ``"cudnn"``, which never reaches the package's kernels).

    Raises:
      ValueError: naming the first argument that is not as documented.
    """
    # A bad name raises before anything else.
    dispatch.check_implementation(implementation, interpret, also=("cudnn",))
    query, key, value = (as_array(x) for x in (query, key, value))
    output_shape = getattr(query, "shape", None)
    unbatched = getattr(query, "ndim", None) == 3
    query, key, value = (_batched(x) for x in (query, key, value))
    dispatch.check_arrays(query, key, value, any_head_dims=True)
    # The output has the query's layout and the values' head dim.
    output_shape = (*output_shape[:-1], value.shape[3])
    batch, seq_q, heads, head_dim = query.shape
    seq_kv = key.shape[1]
    scale = canonical_scale(scale, head_dim)
    window = canonical_window(local_window_size)
    is_causal = canonical_bool(is_causal, "is_causal")
    deterministic = dispatch.deterministic_backward(check_deterministic(deterministic))
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}")
    if unbatched:
        q_segment_ids, kv_segment_ids = (
            _unbatched_ids(ids) for ids in (q_segment_ids, kv_segment_ids))
        query_seq_lengths, key_value_seq_lengths = (
            _unbatched_lengths(n) for n in (query_seq_lengths, key_value_seq_lengths))
    segment_ids = canonical_segments(q_segment_ids, kv_segment_ids, batch, seq_q, seq_kv)
    bounds = _row_bounds(query_seq_lengths, key_value_seq_lengths, batch, seq_q, seq_kv)
    softcap = check_soft_cap(logits_soft_cap)
    sinks = check_sinks(sinks, heads)
    logits_shape = (batch, heads, seq_q, seq_kv)
    bias = _check_bias(as_array(bias), logits_shape)
    mask = bias_lib.canonical_mask(as_array(mask), logits_shape)
    flex = flex_functions(score_mod, mask_mod, block_mask, batch=batch, heads=heads,
                          seq_q=seq_q, seq_kv=seq_kv)
    spec = None if min(seq_q, seq_kv) == 0 else MaskSpec(
        seq_q=seq_q, seq_kv=seq_kv, is_causal=is_causal, causal_alignment=causal_alignment,
        window=window)
    return AttentionCall(query=query, key=key, value=value, mask=spec, scale=scale,
                         output_shape=output_shape, bounds=bounds, segment_ids=segment_ids,
                         bias=bias, attn_mask=mask, sinks=sinks, softcap=softcap,
                         implementation=implementation, config=config,
                         deterministic=deterministic, interpret=interpret,
                         returns_lse=returns_lse, flex=flex)


def _row_bounds(q_lengths, kv_lengths, batch: int, seq_q: int, seq_kv: int
                ) -> RowBounds | None:
    """The lengths as :class:`RowBounds` (None when neither is given); each checked as
    given (:func:`pallas_flash.arguments.check_lengths` reads the range before the int32
    cast), a missing one the whole sequence."""
    if q_lengths is None and kv_lengths is None:
        return None

    def ends(lengths, name: str, seq: int):
        if lengths is None:
            return jnp.full((batch,), seq, jnp.int32)
        return check_lengths(lengths, name, batch, seq, "the sequence length")

    q_end = ends(q_lengths, "query_seq_lengths", seq_q)
    kv_end = ends(kv_lengths, "key_value_seq_lengths", seq_kv)
    return RowBounds(q_end=q_end, kv_start=jnp.zeros((batch,), jnp.int32), kv_end=kv_end)


def as_array(x):
    """NumPy arrays, NumPy and Python scalars and lists as JAX arrays (as ``jax.nn`` takes
    them: ``mask=True``, ``bias=0.5``); JAX arrays, None and anything else (which the checks
    then reject) unchanged."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple, bool, int, float)):
        return jnp.asarray(x)
    return x


def _batched(x):
    """A rank-3 ``[seq, heads, head_dim]`` input as one sequence of a batch (as
    ``jax.nn``); other ranks unchanged (the checks reject them)."""
    return x[None] if getattr(x, "ndim", None) == 3 else x


def _unbatched_ids(ids):
    """Segment ids of a query without batch dim: ``[seq]`` as ``[1, seq]``."""
    ids = as_array(ids)
    return ids[None] if getattr(ids, "ndim", None) == 1 else ids


def _unbatched_lengths(lengths):
    """Lengths of a query without batch dim: a scalar (as ``jax.vmap`` hands it) as
    ``[1]``. Python and NumPy values stay NumPy (64-bit), so that their range is checked
    before the int32 cast (:func:`pallas_flash.arguments.check_lengths`)."""
    if isinstance(lengths, (list, tuple, int, np.generic)):
        lengths = np.asarray(lengths)
    return lengths[None] if getattr(lengths, "ndim", None) == 0 else lengths


def _check_bias(bias, logits_shape):
    if bias is None:
        return None
    dtype = getattr(bias, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"bias must be an array with a floating dtype, got {dtype}")
    return bias_lib.canonical(bias, "bias", logits_shape)

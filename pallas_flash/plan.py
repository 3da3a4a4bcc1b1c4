"""The planner: from a canonical call (:class:`pallas_flash.call.AttentionCall`), the path
it takes and the kernels of its forward.

Paths (:class:`Plan`): ``"empty"`` (a batch or sequence of length 0: zeros, no kernel),
``"decode"`` (a decode step that :func:`pallas_flash.decode_attention`'s split-KV forward
answers identically and faster, :func:`decodes`) and ``"plain"`` (the kernels of one
backend on the whole call). The forward's backend is the call's ``implementation`` or the
fastest that runs the call (:func:`pallas_flash.dispatch.choose`); the backward's is chosen
per pass in :mod:`pallas_flash.autodiff` (:func:`pallas_flash.dispatch.choose_backward`),
where it is known whether the bias needs a gradient.

A decode step (:func:`pallas_flash.decode_attention`) takes splits balanced per row on
the Triton split kernel where :func:`balances_rows` says so, else fixed chunks; a paged one
(:func:`pallas_flash.paged_attention`) reads the pages in place where :func:`reads_pages`
says so, else gathers them.

What makes a call a decode step is decided here alone: :data:`MAX_DECODE_SEQ_Q` and
:func:`is_decode_step` (``decode_attention``, ``paged_attention`` and the Flax layers ask).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_flash import dispatch
from pallas_flash.call import AttentionCall
from pallas_flash.contract import StaticArgs
from pallas_flash.flex import BlockMask
from pallas_flash.masking import MaskSpec
from pallas_flash.tuning import resolve_config

#: Longest query (new tokens per sequence) a decode step has.
MAX_DECODE_SEQ_Q = 16
#: Smallest page the direct paged read takes: a Triton tile has at least 16 rows and lies
#: within one page.
MIN_DIRECT_PAGE_SIZE = 16


def is_decode_step(seq_q: int) -> bool:
    """Whether ``seq_q`` new tokens per sequence make a decode step (the split-KV decode's
    queries: at least one, at most :data:`MAX_DECODE_SEQ_Q`)."""
    return 0 < seq_q <= MAX_DECODE_SEQ_Q


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a call runs. ``path``: ``"empty"``, ``"decode"``, ``"plain"`` or ``"flex"`` (the
    module docstring); ``static``: the forward's kernels and static arguments (``"plain"``
    only); ``implementation`` and ``block_mask``: the backend of a ``"flex"`` call and, on
    Triton, the block mask its kernels walk."""

    path: Literal["empty", "decode", "plain", "flex"]
    static: StaticArgs | None = None
    implementation: str | None = None
    block_mask: BlockMask | None = None


def plan(call: AttentionCall) -> Plan:
    """The path of ``call`` and, for the plain path, its forward's :class:`StaticArgs`.

    Raises:
      ValueError: the call names an implementation that cannot run it (with the reason).
    """
    if call.empty:
        return Plan("empty")
    if call.flex is not None:
        return _flex_plan(call)
    if decodes(call):
        return Plan("decode")
    q, k = call.query, call.key
    name = call.implementation
    if name is None:
        name = dispatch.choose(q.shape, k.shape, q.dtype, call.mask, call.features,
                               interpret=call.interpret)
    reason = dispatch.unsupported(name, q.shape, k.shape, q.dtype, call.mask, call.features)
    if reason is not None:
        raise ValueError(f"implementation={name!r} cannot run this call: {reason}")
    config = resolve_config(call.config, name, q, k, call.value, call.mask, call.interpret)
    return Plan("plain", StaticArgs(
        kernels=dispatch.backend(name).KERNELS, mask=call.mask, scale=call.scale,
        config=config, interpret=call.interpret, softcap=call.softcap,
        deterministic=call.deterministic))


def _flex_plan(call: AttentionCall) -> Plan:
    """A call with ``score_mod`` / ``mask_mod`` / ``block_mask``: on ``"xla"`` (the
    default: :func:`pallas_flash.flex.flex_reference`, every option of ``attention``) or,
    when named, on the Triton flex kernels, which take the functions with scale, soft cap
    and sinks alone (their GPU tests are not yet run; until then they run when asked for).

    Raises:
      ValueError: the named implementation cannot run the call (with the reason).
    """
    name = call.implementation
    if name in (None, "xla"):
        return Plan("flex", implementation="xla")
    block_mask = None
    if name == "triton":
        reason, block_mask = _triton_flex_gap(call)
    else:
        reason = "score_mod, mask_mod and block_mask run on implementation 'triton' or 'xla'"
    if reason is not None:
        raise ValueError(f"implementation={name!r} cannot run this call: {reason}")
    return Plan("flex", implementation=name, block_mask=block_mask)


def _triton_flex_gap(call: AttentionCall) -> tuple[str | None, BlockMask | None]:
    """Why the Triton flex kernels cannot run ``call`` (None: they can), and the block
    mask they would walk."""
    mask = call.mask
    others = [name for name, given in (
        ("is_causal / local_window_size", mask.is_causal or mask.window is not None),
        ("segment ids", call.segment_ids is not None), ("lengths", call.bounds is not None),
        ("bias", call.bias is not None), ("mask", call.attn_mask is not None),
        ("a value head dim of its own", call.value_head_dim is not None)) if given]
    if others:
        return (f"the Triton flex kernels take the functions with scale, soft cap and sinks "
                f"only, not {', '.join(others)}: express them in mask_mod, or use "
                "implementation='xla'"), None
    q, k = call.query, call.key
    block_mask = call.flex.kernel_block_mask(batch=q.shape[0], heads=q.shape[2],
                                             seq_q=mask.seq_q, seq_kv=mask.seq_kv)
    if block_mask is None:
        return ("a block_mask and a different mask_mod (their AND is no single block "
                "mask): fold one into the other, or use implementation='xla'"), None
    functions = [block_mask.mask_fn]
    if call.flex.score_mod is not None:
        functions.append(call.flex.score_converted[0])
    reason = dispatch.backend("triton").flex_unsupported(
        q.shape, k.shape, q.dtype, block_mask.block_size, tuple(functions),
        interpret=call.interpret)
    return reason, block_mask


def decodes(call: AttentionCall) -> bool:
    """Whether ``call`` is a decode step that :func:`pallas_flash.decode.decode_attention`
    answers identically and faster: on a GPU, a few new queries (:func:`is_decode_step`)
    against a longer cache, 16-bit inputs, no arrays or options decode does not take
    (measured: ``docs/decode.md``). Only calls in which no query's hidden keys lie outside
    the step's own tokens: no lengths, no window (kept from when decode let a NaN in a
    hidden cache row reach the output through P·V, which it no longer does; taking such
    calls too is a change of its own, not measured yet).
    """
    mask = call.mask
    return (jax.default_backend() == "gpu" and not call.interpret
            and call.implementation in (None, "mosaic") and call.config is None
            and is_decode_step(mask.seq_q) and MAX_DECODE_SEQ_Q < mask.seq_kv
            and jnp.dtype(call.query.dtype) in (jnp.bfloat16, jnp.float16)
            and call.bias is None and call.attn_mask is None and not call.returns_lse
            and call.segment_ids is None and call.bounds is None and mask.window is None
            and call.value_head_dim is None and call.query.shape[3] <= dispatch.MAX_HEAD_DIM
            and (not mask.is_causal or mask.causal_alignment == "bottom_right"))


def _packed_shape(q_shape, kv_heads: int) -> tuple[int, int, int, int]:
    """A decode step's packed query shape: the ``heads // kv_heads`` query heads of each kv
    head, times the new tokens, as the rows of one head (:mod:`pallas_flash.decode`)."""
    batch, seq_q, heads, head_dim = q_shape
    return (batch, seq_q * heads // kv_heads, kv_heads, head_dim)


def _triton_split_runs(packed, kv_shape, dtype, implementation, interpret: bool) -> bool:
    """Whether the decode forward of these packed shapes runs on Triton (named, or chosen
    as the decode default), and Triton takes the call."""
    spec = MaskSpec(packed[1], kv_shape[1])
    features = dispatch.Features(has_segments=True)
    name = implementation or dispatch.choose_decode(packed, kv_shape, dtype, spec, features,
                                                    interpret=interpret)
    return name == "triton" and dispatch.unsupported(name, packed, kv_shape, dtype, spec,
                                                     features) is None


def balances_rows(q_shape, kv_shape, dtype, *, has_lengths: bool, window, implementation,
                  interpret: bool, config) -> bool:
    """Whether a decode step ``q: [batch, seq_q, heads, head_dim]`` on a cache ``[batch,
    seq_kv, kv_heads, head_dim]`` takes splits balanced per row on the Triton split kernel
    (:func:`pallas_flash.decode_attention`): with lengths or a window (a full cache's fixed
    chunks are balanced already and need no key ids), no ``config``, on Triton."""
    if not has_lengths and window is None:
        return False
    if config is not None or implementation not in (None, "triton"):
        return False
    return _triton_split_runs(_packed_shape(q_shape, kv_shape[2]), kv_shape, dtype,
                              implementation, interpret)


def reads_pages(q_shape, pages_shape, table_shape, dtype, implementation,
                interpret: bool) -> bool:
    """Whether a paged decode step (``q: [batch, seq_q, heads, head_dim]``, pages
    ``[num_pages, page_size, kv_heads, head_dim]``, ``page_table [batch, max_pages]``) runs
    straight from the pages: on Triton, pages of at least :data:`MIN_DIRECT_PAGE_SIZE`
    tokens, a head dim the kernel does not pad."""
    page_size = pages_shape[1]
    if page_size < MIN_DIRECT_PAGE_SIZE or implementation not in (None, "triton"):
        return False
    cache = (q_shape[0], table_shape[1] * page_size, *pages_shape[2:])
    # A call Triton refuses (float64, say) goes the gathered way, which says why; a head
    # dim the kernel pads would pad the whole page pool, far more than the gather copies.
    return (_triton_split_runs(_packed_shape(q_shape, pages_shape[2]), cache, dtype,
                               implementation, interpret)
            and dispatch.backend("triton").padded_head_dim(q_shape[3]) == q_shape[3])

"""The contract between the backends and the layer that drives them: everything a backend
needs from the rest of the package, and what every backend module must provide.

* :class:`Kernels` — a backend's forward and backward, one calling convention for all;
* :class:`StaticArgs` — the static (non-array) part of a call, decided before any kernel;
* :class:`Backend` — the interface of a backend module (what
  :func:`pallas_flash.dispatch.backend` returns);
* :func:`kernel_output`, :func:`varying_like` — the output types and loop carries a kernel
  needs to run inside ``jax.shard_map``;
* :data:`EMPTY_ROW_LSE` and :data:`DTYPES` — the values every backend agrees on.

The backends (``mosaic/``, ``triton/``, ``xla.py``) import this module, the core (masking,
padding, logits, segments, bias, the FP8 format) and themselves, nothing else; this module
imports only the core (``tools/check_structure.py`` holds both to it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from pallas_flash.masking import MaskSpec

#: lse reported for a row that sees no key: finite, and exp(lse) == 0 in float32.
EMPTY_ROW_LSE = -1e30
#: Segment ids given to padding (reserved: users' ids are above them): a padded query's id
#: matches no key, a hidden key's no query.
PADDED_QUERY_ID = -(2**31)
PADDED_KEY_ID = -(2**31) + 1
#: Input dtypes every backend accepts (some through another backend's kernels).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# forward(q, k, v, segment_ids, *, mask, scale, config, interpret, [softcap, bias, attn_mask,
#         bounds, into]) -> (out, lse)
#   q: [batch, seq_q, heads, head_dim], k/v: [batch, seq_kv, kv_heads, head_dim]
#   segment_ids: None or (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_kv]) int32;
#     a pair is visible only if its segment ids are equal (and the MaskSpec allows it).
#   bias (float) / attn_mask (bool): canonical [B', N', T', S'], each dim 1 or full (see
#     pallas_flash.bias); only passed when set.
#   out: like q, lse: [batch, heads, seq_q] float32, natural log.
#   bounds (only when set): a RowBounds of int32 [batch] arrays: per sequence, queries at
#     q >= q_end are padding (output 0, lse EMPTY_ROW_LSE, no gradient), and only keys with
#     kv_start <= k < kv_end are visible (ANDed with the MaskSpec band, segment ids and
#     arrays). Blocks wholly inside the bounds run unmasked; blocks wholly outside are skipped.
#   into (only to kernels with ``merges_into``): (out [batch, seq_q, heads, head_dim] float32,
#     lse [batch, heads, seq_q] float32), a partial attention of the same queries over other
#     keys; the kernel merges its own partial into it and returns the merged (out float32,
#     lse), as pallas_flash.decode.merge_splits would (ring attention's running result).
ForwardFn = Callable[..., tuple[jax.Array, jax.Array]]
# backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask, scale, config, interpret,
#          [softcap, bias, attn_mask, bounds, bias_grad, deterministic]) -> (dq, dk, dv), and dbias
#   (shaped like bias) appended when bias_grad=True; delta: [batch, heads, seq_q] float32
#   (already minus the lse cotangent); deterministic=True: gradients bitwise reproducible
#   from run to run (passed only when set).
BackwardFn = Callable[..., tuple[jax.Array, ...]]


class RowBounds(NamedTuple):
    """Dynamic per-sequence bounds of the visible region (padding lengths, cache lengths,
    ring offsets), each an int32 ``[batch]`` array: query ``q`` of sequence ``b`` is real
    iff ``q < q_end[b]``, and sees key ``k`` only if ``kv_start[b] <= k < kv_end[b]``
    (ANDed with the static :class:`~pallas_flash.masking.MaskSpec` band). Positions are
    local to the arrays the kernel receives."""

    q_end: jax.Array
    kv_start: jax.Array
    kv_end: jax.Array


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A forward and a backward that together implement attention for one backend.

    ``name``: the backend's key in :data:`pallas_flash.dispatch.BACKENDS`.
    ``merges_into``: the forward takes ``into=(out, lse)`` and merges its result into it
    in its epilogue (the calling convention above), so a ring step costs no merge pass.
    ``row_bounds``: the forward and backward take ``bounds=RowBounds(...)``; for kernels
    without it the caller expresses the bounds as segment ids.
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    merges_into: bool = False
    row_bounds: bool = False


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Everything about a call that is not an array (hashable: it keys the jit cache).

    ``softcap``: logits become ``softcap · tanh(logits / softcap)`` (None: off). Passed to
    the kernels only when set, so backends without it keep their signature.

    ``deterministic``: the backward must give bitwise-identical gradients on every run
    (already decided: the call's argument or ``XLA_FLAGS``,
    :func:`pallas_flash.dispatch.deterministic_backward`; the backends read no flags).
    Passed to the backward only when set.
    """

    kernels: Kernels
    mask: MaskSpec
    scale: float
    config: Any
    interpret: bool
    softcap: float | None = None
    deterministic: bool = False

    def kernel_kwargs(self, bias=None, attn_mask=None, bounds: RowBounds | None = None
                      ) -> dict:
        """The kernels' keyword arguments; the optional ones (``softcap``, ``bias``,
        ``attn_mask``, ``bounds``) only when set."""
        kwargs = dict(mask=self.mask, scale=self.scale, config=self.config,
                      interpret=self.interpret)
        if bounds is not None:
            kwargs["bounds"] = bounds
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        if bias is not None:
            kwargs["bias"] = bias
        if attn_mask is not None:
            kwargs["attn_mask"] = attn_mask
        return kwargs

    def backward_kwargs(self, bias=None, attn_mask=None, bounds: RowBounds | None = None, *,
                        bias_grad: bool) -> dict:
        """The backward kernels' keyword arguments: :meth:`kernel_kwargs`, and
        ``bias_grad`` / ``deterministic`` when set."""
        kwargs = self.kernel_kwargs(bias, attn_mask, bounds)
        if bias_grad:
            kwargs["bias_grad"] = True
        if self.deterministic:
            kwargs["deterministic"] = True
        return kwargs


@runtime_checkable
class Backend(Protocol):
    """A backend module, as :func:`pallas_flash.dispatch.backend` returns it.

    Optional members, which callers look up with ``getattr``:

    * ``unsupported_backward(q_shape, kv_shape, dtype, mask, has_segments, softcap=None,
      has_bias=False, has_mask=False, bias_grad=False) -> str | None``: the same as
      :meth:`unsupported` for the backward (without it, every backward its forward runs);
    * ``CONFIG_TYPES``: the config types ``attention(config=...)`` accepts (without it, the
      type :meth:`default_config` returns);
    * ``decode_kernels(q_shape, kv_shape, dtype, mask, *, has_segments, has_mask, config)``:
      ``(Kernels, config)`` of a kernel of its own for a packed decode call, or None;
    * ``padded_head_dim(head_dim) -> int``: the head dim its kernels compute with (inputs
      are padded to it).

    Members of one backend, which the entry points reach through the dispatcher (they
    import no backend):

    * Triton: ``split_decode_forward(packed_q, key, value, lengths, part_interval, rows, *,
      num_splits, scale, softcap, config, interpret, page_table=None) -> (out, lse)``, the
      split-KV decode forward that finds each split's keys from the lengths (from page pools
      through ``page_table`` when given; :mod:`pallas_flash.decode`);
      ``PAGED_DECODE_STAGES``, its pipeline depth on a paged cache; the FP8 quantizer
      ``fp8_quantize_tiles(x, block, *, transpose=False, interpret=False) -> (x_fp8,
      scales)`` with ``fp8_quantizer_available() -> bool`` and
      ``fp8_quantizer_unsupported(block, head_dim) -> str | None``
      (:func:`pallas_flash.fp8.quantize_operands`).
    * Mosaic: the FP8 forward ``fp8_forward(operands, *, mask, scale, config, interpret) ->
      (out, lse)`` on ``Fp8Operands(q, q_scale, k, k_scale, vt, v_scale)``, with
      ``fp8_default_config(head_dim, *, is_causal, seq_kv)`` and
      ``fp8_check_config(config, head_dim)`` (:mod:`pallas_flash.fp8`).
    """

    #: Its forward and backward; ``KERNELS.name`` is its key in the dispatcher's registry.
    KERNELS: Kernels

    def default_config(self, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype,
                       mask: MaskSpec) -> Any:
        """Its frozen config dataclass for a call ``q: [batch, seq_q, heads, head_dim]``,
        ``k, v: [batch, seq_kv, kv_heads, head_dim]`` of ``dtype`` under ``mask``."""

    def unsupported(self, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype,
                    mask: MaskSpec, has_segments: bool, softcap: float | None = None,
                    has_bias: bool = False, has_mask: bool = False) -> str | None:
        """None if its forward runs this call, else a sentence saying why not."""


def kernel_output(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A Pallas kernel's output type: ``shape`` and ``dtype``, varying over the manual mesh
    axes that ``like`` (an operand) varies over, as ``shard_map(check_vma=True)`` requires
    of every ``out_shape``; outside ``shard_map``, the plain struct."""
    manual = jax.typeof(like).manual_axis_type
    if not manual.varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` cast to vary over the manual mesh axes ``like`` varies over (a loop carry's
    initial value must have the type of the carry the body returns)."""
    missing = jax.typeof(like).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying
    if not missing:
        return x
    mesh_order = jax.sharding.get_abstract_mesh().axis_names
    return jax.lax.pcast(x, tuple(a for a in mesh_order if a in missing), to="varying")


def segment_ids_with_bounds(segment_ids, bounds: RowBounds | None, seq_q: int, seq_kv: int):
    """``segment_ids`` (None or int32 ``(q_ids [B, T], kv_ids [B, S])``) with ``bounds``
    folded in, for kernels that take no ``bounds=``: a query at or past ``q_end`` gets
    ``PADDED_QUERY_ID``, which matches no key, and a key outside ``[kv_start, kv_end)``
    ``PADDED_KEY_ID``, which matches no query; every path that handles segment ids handles
    the bounds then. Unchanged without bounds."""
    if bounds is None:
        return segment_ids
    batch = bounds.q_end.shape[0]
    if segment_ids is None:
        segment_ids = (jnp.zeros((batch, seq_q), jnp.int32),
                       jnp.zeros((batch, seq_kv), jnp.int32))
    q_ids, kv_ids = segment_ids
    queries = jnp.arange(seq_q, dtype=jnp.int32)[None, :]
    keys = jnp.arange(seq_kv, dtype=jnp.int32)[None, :]
    q_ids = jnp.where(queries < bounds.q_end[:, None], q_ids, PADDED_QUERY_ID)
    seen = (keys >= bounds.kv_start[:, None]) & (keys < bounds.kv_end[:, None])
    return q_ids, jnp.where(seen, kv_ids, PADDED_KEY_ID)

"""What every backend's kernels are: a forward and a backward with one calling convention,
and the static (non-array) part of a call. Shared by the autodiff rules, the sharding
rules and the backends; it imports none of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from pallas_flash.masking import MaskSpec

# forward(q, k, v, segment_ids, *, mask, scale, config, interpret, [softcap, bias, attn_mask,
#         into]) -> (out, lse)
#   q: [batch, seq_q, heads, head_dim], k/v: [batch, seq_kv, kv_heads, head_dim]
#   segment_ids: None or (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_kv]) int32;
#     a pair is visible only if its segment ids are equal (and the MaskSpec allows it).
#   bias (float) / attn_mask (bool): canonical [B', N', T', S'], each dim 1 or full (see
#     pallas_flash.bias); only passed when set.
#   out: like q, lse: [batch, heads, seq_q] float32, natural log.
#   into (only to kernels with ``merges_into``): (out [batch, seq_q, heads, head_dim] float32,
#     lse [batch, heads, seq_q] float32), a partial attention of the same queries over other
#     keys; the kernel merges its own partial into it and returns the merged (out float32,
#     lse), as pallas_flash.decode.merge_splits would (ring attention's running result).
ForwardFn = Callable[..., tuple[jax.Array, jax.Array]]
# backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask, scale, config, interpret,
#          [softcap, bias, attn_mask, bias_grad, deterministic]) -> (dq, dk, dv), and dbias
#   (shaped like bias) appended when bias_grad=True; delta: [batch, heads, seq_q] float32
#   (already minus the lse cotangent); deterministic=True: gradients bitwise reproducible
#   from run to run (passed only when set).
BackwardFn = Callable[..., tuple[jax.Array, ...]]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A forward and a backward that together implement attention for one backend.

    ``name``: the backend's key in :data:`pallas_flash.dispatch.BACKEND_MODULES`.
    ``merges_into``: the forward takes ``into=(out, lse)`` and merges its result into it
    in its epilogue (the calling convention above), so a ring step costs no merge pass.
    """

    name: str
    forward: ForwardFn
    backward: BackwardFn
    merges_into: bool = False


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Everything about a call that is not an array (hashable: it keys the jit cache).

    ``softcap``: logits become ``softcap · tanh(logits / softcap)`` (None: off). Passed to
    the kernels only when set, so backends without it keep their signature.

    ``deterministic``: the backward must give bitwise-identical gradients on every run
    (already decided: the call's argument or ``XLA_FLAGS``,
    :func:`pallas_flash.dispatch.deterministic_backward`). Passed to the backward only
    when set.
    """

    kernels: Kernels
    mask: MaskSpec
    scale: float
    config: Any
    interpret: bool
    softcap: float | None = None
    deterministic: bool = False

    def kernel_kwargs(self, bias=None, attn_mask=None) -> dict:
        """The kernels' keyword arguments; the optional ones only when set."""
        kwargs = dict(mask=self.mask, scale=self.scale, config=self.config,
                      interpret=self.interpret)
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        if bias is not None:
            kwargs["bias"] = bias
        if attn_mask is not None:
            kwargs["attn_mask"] = attn_mask
        return kwargs

    def backward_kwargs(self, bias=None, attn_mask=None, *, bias_grad: bool) -> dict:
        """The backward kernels' keyword arguments: :meth:`kernel_kwargs`, and
        ``bias_grad`` / ``deterministic`` when set."""
        kwargs = self.kernel_kwargs(bias, attn_mask)
        if bias_grad:
            kwargs["bias_grad"] = True
        if self.deterministic:
            kwargs["deterministic"] = True
        return kwargs

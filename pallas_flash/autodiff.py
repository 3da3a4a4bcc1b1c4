"""The custom VJP shared by every implementation.

FlashAttention's backward never stores P: it keeps only (q, k, v, out, lse) and
recomputes P = exp(S - lse) tile by tile (FlashAttention paper, Sec. 3.1 "recomputation").
Each implementation supplies a ``forward`` and a ``backward`` with the signatures of
:class:`Kernels`; this module wires them into one ``jax.custom_vjp`` so that they all
share the same residuals and the same ``delta = rowsum(dO ∘ O)``.

The cotangent of lse folds into delta: ``∂lse_i/∂s_ij = P_ij``, so
``dS = P ∘ (dP - delta) + P ∘ dlse = P ∘ (dP - (delta - dlse))``. Every backend gets
gradients through ``lse`` for free by receiving ``delta - dlse``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash.masking import MaskSpec

# forward(q, k, v, segment_ids, *, mask, scale, config, interpret) -> (out, lse)
#   q: [batch, seq_q, heads, head_dim], k/v: [batch, seq_kv, kv_heads, head_dim]
#   segment_ids: None or (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_kv]) int32;
#     a pair is visible only if its segment ids are equal (and the MaskSpec allows it).
#   out: like q, lse: [batch, heads, seq_q] float32, natural log.
ForwardFn = Callable[..., tuple[jax.Array, jax.Array]]
# backward(q, k, v, segment_ids, out, lse, d_out, delta, *, mask, scale, config, interpret)
#   -> (dq, dk, dv); delta: [batch, heads, seq_q] float32 (already minus the lse cotangent).
BackwardFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A forward and a backward that together implement attention for one backend."""

    name: str
    forward: ForwardFn
    backward: BackwardFn


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Everything about a call that is not an array (hashable: it keys the jit cache).

    ``softcap``: logits become ``softcap · tanh(logits / softcap)`` (None: off). Passed to
    the kernels only when set, so backends without it keep their signature.
    """

    kernels: Kernels
    mask: MaskSpec
    scale: float
    config: Any
    interpret: bool
    softcap: float | None = None

    def kernel_kwargs(self) -> dict:
        kwargs = dict(mask=self.mask, scale=self.scale, config=self.config,
                      interpret=self.interpret)
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, sinks,
                       static: StaticArgs):
    """Returns ``(out [B, T, N, D], lse [B, N, T] float32)`` computed by ``static.kernels``.

    ``sinks``: None or ``[heads]`` float32 logits that join every row's softmax denominator
    without contributing a value (attention sinks). They need no kernel support: with
    ``lse0`` the kernels' log-denominator, the full one is ``lse = logaddexp(lse0, sink)``
    and ``out = out0 · exp(lse0 - lse)``; the backward recomputes P = exp(S - lse) with the
    full lse, which is exactly the sink-normalised softmax.
    """
    return _forward(q, k, v, segment_ids, sinks, static)


def _forward(q, k, v, segment_ids, sinks, static: StaticArgs):
    out, lse = static.kernels.forward(q, k, v, segment_ids, **static.kernel_kwargs())
    if sinks is None:
        return out, lse
    full_lse = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
    rescale = jnp.exp(lse - full_lse)  # [B, N, T]: share of the mass that is not the sink
    out = (out * jnp.transpose(rescale, (0, 2, 1))[..., None]).astype(out.dtype)
    return out, full_lse


def _fwd_rule(q, k, v, segment_ids, sinks, static: StaticArgs):
    out, lse = _forward(q, k, v, segment_ids, sinks, static)
    return (out, lse), (q, k, v, segment_ids, sinks, out, lse)


def _bwd_rule(static: StaticArgs, residuals, cotangents):
    q, k, v, segment_ids, sinks, out, lse = residuals
    d_out, d_lse = cotangents
    # delta_i = sum_d dO_id · O_id (FlashAttention-2, Alg. 2 line 4), in float32.
    delta = jnp.einsum(
        "btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32)
    )
    delta = delta - d_lse.astype(jnp.float32)
    dq, dk, dv = static.kernels.backward(
        q, k, v, segment_ids, out, lse, d_out.astype(q.dtype), delta,
        **static.kernel_kwargs(),
    )
    d_sinks = None
    if sinks is not None:
        # A sink is one more logit with a zero value: dS_sink = P_sink · (0 - delta).
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
        d_sinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    # Segment ids are integers: no cotangent.
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks


attention_with_lse.defvjp(_fwd_rule, _bwd_rule)

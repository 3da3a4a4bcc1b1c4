"""The custom VJP shared by every implementation.

FlashAttention's backward never stores P: it keeps only (q, k, v, out, lse) and
recomputes P = exp(S - lse) tile by tile (FlashAttention paper, Sec. 3.1 "recomputation").
Each implementation supplies a ``forward`` and a ``backward`` with the signatures of
:class:`Kernels`; this module wires them into one ``jax.custom_vjp`` so that they all
share the same residuals and the same ``delta = rowsum(dO ∘ O)``.

The VJP is defined with ``symbolic_zeros=True``: the forward rule then learns which inputs
are differentiated (``CustomVJPPrimal.perturbed``), and the backward computes the bias
gradient only when the caller asks for it (a bias used as an additive mask never is).

The backward need not run on the forward's backend: :func:`pallas_flash.dispatch.
choose_backward` picks it in the backward rule, where ``bias_grad`` is known, and a backend
other than the forward's runs with its default config.

Second-order AD (``jax.hessian``, ``jax.jvp`` / ``jax.grad`` of ``jax.grad``) differentiates
the forward and backward rules themselves. The Pallas kernels have no forward-mode rule, so
a pass whose inputs are being differentiated runs on the XLA path (plain JAX, the same
function): :func:`_kernel_pass`. First-order forward mode of the custom VJP itself is
refused by JAX (``jax.jvp`` of a ``custom_vjp`` function).

The cotangent of lse folds into delta: ``∂lse_i/∂s_ij = P_ij``, so
``dS = P ∘ (dP - delta) + P ∘ dlse = P ∘ (dP - (delta - dlse))``. Every backend gets
gradients through ``lse`` for free by receiving ``delta - dlse``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad, batching
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_flash import dispatch, sharding
from pallas_flash.kernel_args import StaticArgs


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, sinks, bias,
                       attn_mask, static: StaticArgs):
    """Returns ``(out [B, T, N, D], lse [B, N, T] float32)`` computed by ``static.kernels``.

    ``bias`` (floating, differentiable) and ``attn_mask`` (bool): None or canonical
    ``[B', N', T', S']`` arrays (:func:`pallas_flash.bias.canonical`).

    ``sinks``: None or ``[heads]`` float32 logits that join every row's softmax denominator
    without contributing a value (attention sinks). They need no kernel support: with
    ``lse0`` the kernels' log-denominator, the full one is ``lse = logaddexp(lse0, sink)``
    and ``out = out0 · exp(lse0 - lse)``; the backward recomputes P = exp(S - lse) with the
    full lse, which is exactly the sink-normalised softmax.
    """
    return _forward(q, k, v, segment_ids, sinks, bias, attn_mask, static)


def _pass_static(static: StaticArgs, operands) -> StaticArgs:
    """``static`` for one kernel pass (forward or backward) over ``operands``: the same,
    or the XLA path's when the pass itself is differentiated.

    The kernels' inputs in the forward and backward rules are differentiated only under
    second-order AD (``jax.hessian``, ``jax.jvp`` or ``jax.grad`` of ``jax.grad``). The XLA
    path is plain JAX; a Pallas kernel (Triton, Mosaic) has no forward-mode or linearize
    rule, so such a pass runs on the XLA path, which computes the same function. (A
    ``custom_jvp`` around the kernel would not do: the Mosaic backward's ``jax.new_ref``
    accumulator cannot be discharged through ``custom_jvp_call`` under ``jax.jit``.)
    """
    if static.kernels.name == "xla" or not _differentiated(operands):
        return static
    xla = dispatch.backend("xla")
    q, k = operands[:2]
    return dataclasses.replace(static, kernels=xla.KERNELS, config=xla.default_config(
        q.shape, k.shape, q.dtype, static.mask))


def _differentiated(tree) -> bool:
    """Whether a forward-mode or linearize transformation (JVP / linearize tracers, also
    under vmap's batch tracers) holds any leaf of ``tree``.

    JAX has no public test for this; it reads the tracer classes of jax._src (pinned to
    jax 0.11). A tracer it does not see through makes it answer False: the kernel then
    runs, as without this check.
    """
    pending = jax.tree.leaves(tree)
    while pending:
        leaf = pending.pop()
        if isinstance(leaf, (ad.JVPTracer, ad.LinearizeTracer)):
            return True
        if isinstance(leaf, batching.BatchTracer):
            pending.append(leaf.val)
    return False


def _forward(q, k, v, segment_ids, sinks, bias, attn_mask, static: StaticArgs):
    static = _pass_static(static, (q, k, v, segment_ids, bias, attn_mask))
    # Each device runs the kernels on its shard of a sharded call (pallas_flash.sharding).
    out, lse = sharding.forward(static, q, k, v, segment_ids, bias, attn_mask)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def add_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """Joins one sink logit per head to the softmax denominator.

    ``out [B, T, H, D]``, ``lse [B, H, T]`` of the keys alone, ``sinks [H]`` -> the same
    with ``lse = logaddexp(lse, sink)`` and ``out`` scaled by the keys' share
    ``exp(lse_keys - lse)`` (the mass that is not the sink's).
    """
    full_lse = jnp.logaddexp(lse, sinks.astype(lse.dtype)[None, :, None])
    share = jnp.exp(lse - full_lse)
    return (out * jnp.swapaxes(share, 1, 2)[..., None]).astype(out.dtype), full_lse


def _fwd_rule(q, k, v, segment_ids, sinks, bias, attn_mask, static: StaticArgs):
    # symbolic_zeros=True wraps every array leaf in CustomVJPPrimal(value, perturbed).
    bias_grad = bias is not None and bias.perturbed
    arrays = jax.tree.map(lambda x: x.value, (q, k, v, segment_ids, sinks, bias, attn_mask),
                          is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    out, lse = _forward(*arrays, static)
    return (out, lse), (*arrays, out, lse, bias_grad)


def _dense(cotangent, like: jax.Array) -> jax.Array:
    """A cotangent as an array (symbolic_zeros=True may hand over a SymbolicZero)."""
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(like.shape, like.dtype)
    return cotangent


def _backward_static(static: StaticArgs, q, k, features: dispatch.Features,
                     bias_grad: bool) -> StaticArgs:
    """``static`` with the backward's kernels: the forward's, or another backend's with its
    default config (the forward's config is of the forward's backend)."""
    name = dispatch.choose_backward(static.kernels.name, q.shape, k.shape, q.dtype,
                                    static.mask, features, bias_grad=bias_grad,
                                    interpret=static.interpret)
    if name == static.kernels.name:
        return static
    module = dispatch.backend(name)
    return dataclasses.replace(static, kernels=module.KERNELS, config=module.default_config(
        q.shape, k.shape, q.dtype, static.mask))


def row_delta(out: jax.Array, lse: jax.Array, d_out: jax.Array, d_lse: jax.Array | None
              ) -> jax.Array:
    """``delta [B, N, T] = rowsum(dO ∘ O) - dlse`` (FlashAttention-2, Alg. 2 line 4, with
    lse's cotangent folded in: module docstring), in lse's float32 (float64 for float64
    inputs), from ``out``, ``d_out [B, T, N, D]`` and ``lse``, ``d_lse [B, N, T]``."""
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(lse.dtype), d_out.astype(lse.dtype))
    return delta if d_lse is None else delta - d_lse.astype(lse.dtype)


def sinks_grad(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """The gradient of ``sinks [N]`` from the full ``lse`` and ``delta [B, N, T]``."""
    # A sink is one more logit with a zero value: dS_sink = P_sink · (0 - delta).
    p_sink = jnp.exp(sinks.astype(lse.dtype)[None, :, None] - lse)
    return (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)


def _bwd_rule(static: StaticArgs, residuals, cotangents):
    q, k, v, segment_ids, sinks, bias, attn_mask, out, lse, bias_grad = residuals
    d_out, d_lse = cotangents
    d_out = _dense(d_out, out)
    delta = row_delta(out, lse, d_out, None if isinstance(d_lse, SymbolicZero) else d_lse)
    features = dispatch.Features(has_segments=segment_ids is not None, softcap=static.softcap,
                                 has_bias=bias is not None, has_mask=attn_mask is not None)
    static = _backward_static(static, q, k, features, bias_grad)
    static = _pass_static(
        static, (q, k, v, segment_ids, out, lse, d_out, delta, bias, attn_mask))
    dq, dk, dv, *d_bias = sharding.backward(
        static, q, k, v, segment_ids, out, lse, d_out.astype(q.dtype), delta, bias, attn_mask,
        bias_grad)
    d_bias = d_bias[0].astype(bias.dtype) if bias_grad else None
    d_sinks = None if sinks is None else sinks_grad(sinks, lse, delta)
    # Segment ids are integers and the mask is boolean: no cotangent.
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks,
            d_bias, None)


attention_with_lse.defvjp(_fwd_rule, _bwd_rule, symbolic_zeros=True)

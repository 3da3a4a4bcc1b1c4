"""The derivatives shared by every implementation: one ``jax.custom_jvp``.

FlashAttention's backward never stores P: it keeps only (q, k, v, out, lse) and
recomputes P = exp(S - lse) tile by tile (FlashAttention paper, Sec. 3.1 "recomputation").
Each implementation supplies a ``forward`` and a ``backward`` with the signatures of
:class:`Kernels`; this module wires them into one ``jax.custom_jvp`` so that they all
share the same residuals and the same ``delta = rowsum(dO ∘ O)``.

The JVP rule runs the forward kernels for the primal and returns the tangent as a
``jax.custom_derivatives.linear_call``: :func:`_tangent` computes it (forward mode:
``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) in plain JAX from the residuals, with the
XLA path's O(seq_q · block_kv) memory (:func:`pallas_flash.xla.tangent`), and its
transpose, :func:`_transpose`, is the backend's backward kernels (reverse mode: ``jax.grad``,
``jax.vjp``, ``jax.jacrev``). A ``custom_vjp`` would give reverse mode alone (JAX refuses
``jax.jvp`` of one).

The rule is defined with ``symbolic_zeros=True``: an input that is not differentiated has a
``SymbolicZero`` tangent and is no linear argument, so the transpose computes no cotangent
for it (the bias gradient only for a perturbed bias; a bias used as an additive mask never
is). Segment ids and row bounds (integers) and the mask (boolean) have no tangent.

Row bounds (:class:`pallas_flash.contract.RowBounds`, the lengths) go to kernels with
``row_bounds`` as ``bounds=``; for the others, each pass folds them into the segment ids
(:func:`pallas_flash.contract.segment_ids_with_bounds`), so a backend that takes them needs no
change here.

The backward need not run on the forward's backend: :func:`pallas_flash.dispatch.
choose_backward` picks it in the transpose, where ``bias_grad`` is known, and a backend
other than the forward's runs with its default config.

Second-order AD (``jax.hessian``, ``jax.jvp`` / ``jax.grad`` of ``jax.grad``) differentiates
the rule itself. The Pallas kernels have no forward-mode rule, and ``linear_call`` none for
differentiated residuals, so a rule whose primal inputs are being differentiated runs the
forward on the XLA path (plain JAX, the same function, :func:`_pass_static`) and returns
:func:`_tangent` itself, which JAX differentiates and transposes to any order.

The cotangent of lse folds into delta: ``∂lse_i/∂s_ij = P_ij``, so
``dS = P ∘ (dP - delta) + P ∘ dlse = P ∘ (dP - (delta - dlse))``. Every backend gets
gradients through ``lse`` for free by receiving ``delta - dlse``; in forward mode,
``dlse = rowsum(P ∘ dS)``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from pallas_flash import compat, dispatch, sharding
from pallas_flash.compat import batching
from pallas_flash.contract import RowBounds, StaticArgs, segment_ids_with_bounds


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, sinks, bias,
                       attn_mask, static: StaticArgs, bounds: RowBounds | None = None):
    """Returns ``(out [B, T, N, D], lse [B, N, T] float32)`` computed by ``static.kernels``.

    ``bias`` (floating, differentiable) and ``attn_mask`` (bool): None or canonical
    ``[B', N', T', S']`` arrays (:func:`pallas_flash.bias.canonical`). ``bounds``: None or
    int32 ``[B]`` :class:`RowBounds` (no gradient).

    ``sinks``: None or ``[heads]`` float32 logits that join every row's softmax denominator
    without contributing a value (attention sinks). They need no kernel support: with
    ``lse0`` the kernels' log-denominator, the full one is ``lse = logaddexp(lse0, sink)``
    and ``out = out0 · exp(lse0 - lse)``; the backward recomputes P = exp(S - lse) with the
    full lse, which is exactly the sink-normalised softmax.
    """
    return _forward(q, k, v, segment_ids, sinks, bias, attn_mask, bounds, static)


def _row_operands(static: StaticArgs, segment_ids, bounds, q, k):
    """``(segment_ids, bounds)`` as ``static.kernels`` take them: the bounds as they are
    for kernels with ``row_bounds``, else folded into the segment ids."""
    if bounds is None or static.kernels.row_bounds:
        return segment_ids, bounds
    return segment_ids_with_bounds(segment_ids, bounds, q.shape[1], k.shape[1]), None


def _pass_static(static: StaticArgs, operands) -> StaticArgs:
    """``static`` for the forward pass over ``operands``: the same, or the XLA path's
    when the pass itself is differentiated.

    The forward's inputs are differentiated inside the JVP rule only under second-order AD
    (``jax.hessian``, ``jax.jvp`` or ``jax.grad`` of ``jax.grad``). The XLA path is plain
    JAX; a Pallas kernel (Triton, Mosaic) has no forward-mode or linearize rule, so such a
    pass runs on the XLA path, which computes the same function. (A ``custom_jvp`` around
    the kernel would not do: the Mosaic backward's ``jax.new_ref`` accumulator cannot be
    discharged through ``custom_jvp_call`` under ``jax.jit``.)
    """
    if not _differentiated(operands):
        return static
    return _on_backend(static, "xla", *operands[:2])


def _on_backend(static: StaticArgs, name: str, q, k) -> StaticArgs:
    """``static`` with backend ``name``'s kernels: itself if it already has them, else
    with that backend's default config (a config belongs to one backend)."""
    if name == static.kernels.name:
        return static
    module = dispatch.backend(name)
    return dataclasses.replace(static, kernels=module.KERNELS, config=module.default_config(
        q.shape, k.shape, q.dtype, static.mask))


def _differentiated(tree) -> bool:
    """Whether a forward-mode or linearize transformation (JVP / linearize tracers, also
    under vmap's batch tracers) holds any leaf of ``tree``.

    JAX has no public test for this; it reads the tracer classes of jax._src
    (:mod:`pallas_flash.compat`). A tracer it does not see through makes it answer False:
    the kernel then runs, as without this check.
    """
    pending = jax.tree.leaves(tree)
    while pending:
        leaf = pending.pop()
        if isinstance(leaf, (compat.JVPTracer, compat.LinearizeTracer)):
            return True
        if isinstance(leaf, compat.BatchTracer):
            pending.append(leaf.val)
    return False


def _forward(q, k, v, segment_ids, sinks, bias, attn_mask, bounds, static: StaticArgs):
    static = _pass_static(static, (q, k, v, segment_ids, bias, attn_mask))
    segment_ids, bounds = _row_operands(static, segment_ids, bounds, q, k)
    # Each device runs the kernels on its shard of a sharded call (pallas_flash.sharding).
    out, lse = sharding.forward(static, q, k, v, segment_ids, bias, attn_mask, bounds=bounds)
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


# The differentiable inputs, in the order of attention_with_lse's arguments (the keys of
# the linear arguments).
_DIFFERENTIABLE = ("q", "k", "v", "sinks", "bias")


def _jvp_rule(static: StaticArgs, primals, tangents):
    """Primal by the kernels, tangent by :func:`_tangent`, transposed by :func:`_transpose`.

    ``symbolic_zeros=True``: an input that is not differentiated has a ``SymbolicZero``
    tangent and is left out of the linear arguments, so that the transpose computes no
    cotangent for it (the bias gradient only for a perturbed bias).
    """
    q, k, v, segment_ids, sinks, bias, attn_mask, bounds = primals
    out, lse = _forward(*primals, static)
    dq, dk, dv, _, d_sinks, d_bias, _, _ = tangents  # segment ids, mask, bounds: no tangent
    linear = {name: t for name, t in zip(_DIFFERENTIABLE, (dq, dk, dv, d_sinks, d_bias),
                                         strict=True)
              if t is not None and not isinstance(t, SymbolicZero)}
    residuals = (q, k, v, segment_ids, sinks, bias, attn_mask, bounds, out, lse)
    tangent = functools.partial(_tangent, static)
    if _differentiated(primals):
        # Second-order AD differentiates the tangent itself: plain JAX (the XLA path's
        # formulation), which JAX differentiates and transposes to any order. linear_call's
        # JVP rule requires residuals that are not differentiated.
        d_out, d_lse = tangent(residuals, linear)
    else:
        d_out, d_lse = jax.custom_derivatives.linear_call(
            tangent, functools.partial(_transpose, static, tuple(linear)), residuals, linear)
    return (out, lse), (d_out, d_lse)


attention_with_lse.defjvp(_jvp_rule, symbolic_zeros=True)


def _tangent(static: StaticArgs, residuals, linear: dict):
    """``(d_out, d_lse)``: the tangent of attention, linear in ``linear`` (the tangents of
    ``_DIFFERENTIABLE`` inputs that are not zero), in plain JAX with O(seq_q · block_kv)
    memory per head (:func:`pallas_flash.xla.tangent`) on every backend. It is one pass
    over the keys from the forward's residuals, about a forward's work; a Pallas kernel for
    it would be a third kernel per backend for the least used mode of differentiation."""
    q, k, v, segment_ids, sinks, bias, attn_mask, bounds, out, lse = residuals
    config = _on_backend(static, "xla", q, k).config
    # The XLA path's tangent takes the bounds as segment ids.
    segment_ids = segment_ids_with_bounds(segment_ids, bounds, q.shape[1], k.shape[1])
    pv, d_lse = dispatch.backend("xla").tangent(
        q, k, v, segment_ids, lse, linear.get("q"), linear.get("k"), linear.get("v"),
        linear.get("bias"), mask=static.mask, scale=static.scale, config=config,
        softcap=static.softcap, bias=bias, attn_mask=attn_mask)
    if "sinks" in linear:
        # A sink is one more logit, with a zero value: its tangent moves lse alone.
        p_sink = jnp.exp(sinks.astype(lse.dtype)[None, :, None] - lse)
        d_lse = d_lse + p_sink * linear["sinks"].astype(lse.dtype)[None, :, None]
    d_out = pv - jnp.swapaxes(d_lse, 1, 2)[..., None] * out.astype(pv.dtype)
    return d_out.astype(out.dtype), d_lse.astype(lse.dtype)


def _backward_static(static: StaticArgs, q, k, features: dispatch.Features,
                     bias_grad: bool) -> StaticArgs:
    """``static`` with the backward's kernels: the forward's, or another backend's with its
    default config (the forward's config is of the forward's backend)."""
    name = dispatch.choose_backward(static.kernels.name, q.shape, k.shape, q.dtype,
                                    static.mask, features, bias_grad=bias_grad,
                                    interpret=static.interpret)
    return _on_backend(static, name, q, k)


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


def _transpose(static: StaticArgs, wanted: tuple[str, ...], residuals, cotangents) -> dict:
    """The transpose of :func:`_tangent`: the backend's backward kernels (``jax.grad``,
    ``jax.vjp``), cotangents for the ``wanted`` inputs (the linear arguments' keys)."""
    q, k, v, segment_ids, sinks, bias, attn_mask, bounds, out, lse = residuals
    d_out, d_lse = cotangents
    bias_grad = "bias" in wanted
    delta = row_delta(out, lse, d_out, d_lse)
    features = dispatch.Features(has_segments=segment_ids is not None or bounds is not None,
                                 softcap=static.softcap, has_bias=bias is not None,
                                 has_mask=attn_mask is not None)
    static = _backward_static(static, q, k, features, bias_grad)
    segment_ids, bounds = _row_operands(static, segment_ids, bounds, q, k)
    dq, dk, dv, *d_bias = sharding.backward(
        static, q, k, v, segment_ids, out, lse, d_out.astype(q.dtype), delta, bias, attn_mask,
        bias_grad, bounds=bounds)
    grads = dict(q=dq.astype(q.dtype), k=dk.astype(k.dtype), v=dv.astype(v.dtype))
    if bias_grad:
        grads["bias"] = d_bias[0].astype(bias.dtype)
    if "sinks" in wanted:
        grads["sinks"] = sinks_grad(sinks, lse, delta)
    return {name: grads[name] for name in wanted}


def attention_backward(static: StaticArgs, q: jax.Array, k: jax.Array, v: jax.Array,
                       out: jax.Array, lse: jax.Array, d_out: jax.Array,
                       d_lse: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of attention without segment ids, bias, mask or sinks: the backward
    kernels of ``static`` (or of the backend :func:`pallas_flash.dispatch.choose_backward`
    picks) on the residuals of any forward that computed ``out [B, T, N, D]`` and
    ``lse [B, N, T]`` for these ``q``, ``k``, ``v`` (``[B, S, K, D]``). The FP8 forward
    (:mod:`pallas_flash.fp8`) hands over its own: P is recomputed from q, k in their dtype
    against the FP8 forward's lse (FlashAttention's recomputation, Sec. 3.1)."""
    residuals = (q, k, v, None, None, None, None, None, out, lse)
    grads = _transpose(static, ("q", "k", "v"), residuals, (d_out, d_lse))
    return grads["q"], grads["k"], grads["v"]


# --- jax.custom_derivatives.linear_call: the two rules jax 0.11 and 0.12 lack --------------
# The transpose of the tangent is the backward kernels through ``linear_call``. JAX's
# ``linear_call_p`` drops its callee's effects from its type and has no batching rule: with
# both, ``jax.jit`` of the transposed call lowers when the backward has effects (the
# ordered callbacks of Mosaic GPU's interpreter), and ``jax.vmap`` of ``jax.grad`` /
# ``jax.jvp`` works. Registered here, for every ``linear_call`` of the process.


def _linear_call_abstract_eval(*args, callee, **params):
    del args, params
    # A jax.new_ref inside the callee (the Mosaic backward's dQ accumulator) stays inside:
    # the lowering (mlir.lower_fun) discharges it. Declaring it here would make jax.jit
    # discharge the caller's jaxpr, which has no rule for linear_call.
    return callee.out_avals, {e for e in callee.effects
                              if not isinstance(e, compat.InternalMutableArrayEffect)}


def _batch_jaxpr(jaxpr, axis_data, in_batched):
    """``jaxpr`` batched along axis 0 of the ``in_batched`` inputs, every output batched;
    as linear_call's (jaxpr, consts): its new consts detached as leading inputs."""
    batched, _ = batching.batch_jaxpr(jaxpr, axis_data, in_batched, instantiate=True)
    return compat.convert_constvars_jaxpr(batched), list(batched.consts)


def _linear_call_batcher(axis_data, args, dims, *, callee, transpose_thunk,
                         num_callee_consts, num_res):
    """Batches the callee and, lazily, its transpose. Every linear input and output is
    batched (an unbatched linear input is broadcast), so that the transpose's cotangents
    have the linear inputs' types."""
    num_fixed = num_callee_consts + num_res
    args = [x if d is None else batching.moveaxis(x, d, 0)
            for x, d in zip(args, dims, strict=True)]
    args[num_fixed:] = [x if d is not None else batching.broadcast(
        x, axis_data.size, 0, axis_data.explicit_mesh_axis)
        for x, d in zip(args[num_fixed:], dims[num_fixed:], strict=True)]
    fixed_batched = [d is not None for d in dims[:num_fixed]]
    callee_b, new_consts = _batch_jaxpr(
        callee, axis_data, fixed_batched + [True] * (len(args) - num_fixed))
    res_batched = fixed_batched[num_callee_consts:]

    @functools.cache
    def batched_transpose():
        transpose, t_consts = transpose_thunk()
        transpose_b, t_new_consts = _batch_jaxpr(
            transpose, axis_data,
            [False] * len(t_consts) + res_batched + [True] * len(callee.out_avals))
        return transpose_b, [*t_new_consts, *t_consts]

    outs = compat.linear_call_p.bind(
        *new_consts, *args, callee=callee_b, transpose_thunk=batched_transpose,
        num_callee_consts=len(new_consts) + num_callee_consts, num_res=num_res)
    return outs, [0] * len(outs)


compat.linear_call_p.def_effectful_abstract_eval(_linear_call_abstract_eval)
batching.fancy_primitive_batchers.setdefault(compat.linear_call_p,
                                             _linear_call_batcher)

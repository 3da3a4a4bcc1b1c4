"""The attention kernels on sharded arrays: each device runs them on its own shard.

Attention is independent across batch rows and across KV-head groups, so a call whose
inputs are split over batch and/or heads needs no communication: every device runs the
kernels on its local shard. A Pallas kernel is opaque to XLA's partitioner, which would
otherwise gather its operands onto every device and compute the whole attention
replicated. :func:`forward` and :func:`backward` run a backend's kernels so that it does
not, in each of the three ways an array can be sharded:

* **inside** ``jax.shard_map``: the arrays already are the local shards; the operands are
  cast to the union of their varying mesh axes (``check_vma=True`` needs every operand and
  every kernel output to agree) and the kernels run as they are;
* **under** ``jax.jit`` **with explicit mesh axes** (``AxisType.Explicit``: the shardings
  are in the arrays' types at trace time): the kernels run in a ``jax.shard_map`` over the
  batch and head axes of the query's sharding;
* **under** ``jax.jit`` **with automatic axes** (Shardy propagation, the default of
  ``jax.sharding.Mesh``): the kernels run in a ``jax.experimental.custom_partitioning``
  whose Shardy rule names the batch and head factors as shardable and the sequence and
  head_dim factors as needing replication; its ``partition`` callback keeps the batch and
  head sharding of the query (K / V heads split as its heads) and runs the kernels on the
  local shapes.

Batch and heads shard; the sequence and head_dim do not: an input split along them is
gathered first (correct, but every device then holds the whole sequence). A head shard must
hold whole GQA groups (``kv_heads`` divisible by the number of head shards); otherwise the
heads are gathered too. Segment ids follow the batch, bias / mask arrays follow batch and
heads on their full dims and are replicated on their broadcast (size-1) dims. The gradient
of a bias broadcast over a sharded dim is a sum over shards: its all-reduce is the one
collective the kernels' backward needs (the sinks' gradient, summed by XLA outside the
kernels, is another when the batch is split). The XLA backend is plain XLA, which the
partitioner already splits by itself, so under ``jit`` its calls are left to it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_flash.contract import RowBounds, StaticArgs, varying_like

# Dimension roles of the kernels' operands and results. A role's mesh axes: batch -> the
# query's batch axes, heads / kv_heads -> its head axes, the others none. ``_UNIT``: a
# broadcast (size-1) dim of a bias / mask array.
_BATCH, _Q_SEQ, _KV_SEQ, _HEADS, _KV_HEADS, _DIM, _UNIT = "b", "t", "s", "h", "k", "d", "1"
_QUERY_LIKE = (_BATCH, _Q_SEQ, _HEADS, _DIM)  # q, out, d_out, dq: [B, T, N, D]
_KEY_LIKE = (_BATCH, _KV_SEQ, _KV_HEADS, _DIM)  # k, v, dk, dv: [B, S, K, D]
_ROW_STATS = (_BATCH, _HEADS, _Q_SEQ)  # lse, delta: [B, N, T]
_SEGMENT_IDS = ((_BATCH, _Q_SEQ), (_BATCH, _KV_SEQ))
_BOUNDS = ((_BATCH,), (_BATCH,), (_BATCH,))  # RowBounds: three [B], split as the batch


def _logit_roles(x) -> tuple[str, ...] | None:
    """Roles of a canonical bias / mask ``[B', N', T', S']`` (each dim 1 or full)."""
    if x is None:
        return None
    full = (_BATCH, _HEADS, _Q_SEQ, _KV_SEQ)
    return tuple(_UNIT if size == 1 else role for size, role in zip(x.shape, full, strict=True))


@dataclasses.dataclass(frozen=True)
class _Call:
    """One kernel call, everything static: the pass, the kernels and their arguments, and
    the dim roles of its operands and results (pytrees of role tuples, None where an
    optional operand is absent)."""

    backward: bool
    static: StaticArgs
    bias_grad: bool
    operand_roles: tuple
    result_roles: tuple

    def run(self, operands):
        """The kernels on (local) operands, as ``autodiff`` calls them."""
        return _run_kernels(self, operands)


@functools.partial(jax.jit, static_argnums=0)
def _run_kernels(call: _Call, operands):
    """``call``'s kernels on ``operands``, traced once per call and operand types.

    A model's layers make the same call on arrays of the same types: through one jitted
    function they share its jaxpr, and so one lowering and compilation of the Pallas
    kernels, instead of one per layer. On the H200 (2026-12-04,
    ``benchmarks/results/compile-time-nvidia-h200-2026-12-04.md``) the grad of 12
    Mosaic attention layers took 40 s to lower and 43 s to compile with a copy of the
    kernels per layer, 3 s and 7 s through this function.
    """
    static = call.static
    if not call.backward:
        q, k, v, segment_ids, bias, attn_mask, into, bounds = operands
        kwargs = static.kernel_kwargs(bias, attn_mask, _row_bounds(bounds))
        if into is not None:
            kwargs["into"] = into
        return tuple(static.kernels.forward(q, k, v, segment_ids, **kwargs))
    q, k, v, segment_ids, bias, attn_mask, out, lse, d_out, delta, bounds = operands
    kwargs = static.backward_kwargs(bias, attn_mask, _row_bounds(bounds),
                                    bias_grad=call.bias_grad)
    return tuple(static.kernels.backward(q, k, v, segment_ids, out, lse, d_out, delta,
                                         **kwargs))


def forward(static, q, k, v, segment_ids, bias, attn_mask, into=None, bounds=None
            ) -> tuple[jax.Array, jax.Array]:
    """``static.kernels.forward`` on each device's shard: ``(out [B, T, N, D], lse [B, N,
    T])``, sharded as ``q`` over batch and heads (arguments as ``autodiff._forward``;
    ``into``: a running ``(out, lse)`` to merge into, for kernels with ``merges_into``;
    ``bounds``: a :class:`~pallas_flash.contract.RowBounds` for kernels with
    ``row_bounds``, split over the batch as the segment ids)."""
    operands = (q, k, v, segment_ids, bias, attn_mask, into, _bounds_tuple(bounds))
    into_roles = None if into is None else (_QUERY_LIKE, _ROW_STATS)
    call = _Call(backward=False, static=static, bias_grad=False,
                 operand_roles=(_QUERY_LIKE, _KEY_LIKE, _KEY_LIKE,
                                _segment_roles(segment_ids), _logit_roles(bias),
                                _logit_roles(attn_mask), into_roles, _bounds_roles(bounds)),
                 result_roles=(_QUERY_LIKE, _ROW_STATS))
    return _sharded(call, operands)


def backward(static, q, k, v, segment_ids, out, lse, d_out, delta, bias, attn_mask,
             bias_grad: bool, bounds=None) -> tuple[jax.Array, ...]:
    """``static.kernels.backward`` on each device's shard: ``(dq, dk, dv)``, and dbias when
    ``bias_grad``, each sharded as its primal (arguments as ``autodiff._transpose``;
    ``bounds`` as in :func:`forward`)."""
    operands = (q, k, v, segment_ids, bias, attn_mask, out, lse, d_out, delta,
                _bounds_tuple(bounds))
    results = (_QUERY_LIKE, _KEY_LIKE, _KEY_LIKE)
    if bias_grad:
        results += (_logit_roles(bias),)
    call = _Call(backward=True, static=static, bias_grad=bias_grad,
                 operand_roles=(_QUERY_LIKE, _KEY_LIKE, _KEY_LIKE,
                                _segment_roles(segment_ids), _logit_roles(bias),
                                _logit_roles(attn_mask), _QUERY_LIKE, _ROW_STATS,
                                _QUERY_LIKE, _ROW_STATS, _bounds_roles(bounds)),
                 result_roles=results)
    return _sharded(call, operands)


def _segment_roles(segment_ids):
    return None if segment_ids is None else _SEGMENT_IDS


def _bounds_roles(bounds):
    return None if bounds is None else _BOUNDS


def _bounds_tuple(bounds):
    """``bounds`` as a plain tuple (the role pytrees are tuples: the operands' structure
    must match theirs), or None."""
    return None if bounds is None else tuple(bounds)


def _row_bounds(bounds):
    """The kernels' :class:`~pallas_flash.contract.RowBounds` from the operand tuple."""
    return None if bounds is None else RowBounds(*bounds)


def _sharded(call: _Call, operands):
    """``call`` on ``operands`` in the way their sharding asks for (the module docstring)."""
    kernels, interpret = call.static.kernels.name, call.static.interpret
    context = jax.sharding.get_abstract_mesh()
    mesh = context if context.manual_axes else jax.typeof(operands[0]).sharding.mesh
    if interpret and kernels == "mosaic" and not mesh.empty and mesh.size > 1:
        # Seen here: with several CPU devices its interpreter fails on a barrier it finds
        # still allocated, or hangs; one device per process is what it supports.
        raise ValueError(
            "implementation='mosaic' with interpret=True runs on one device only, got a "
            f"computation over a mesh of {mesh.size} devices ({dict(mesh.shape)}): Mosaic "
            "GPU's interpreter does not support several devices in one process; use "
            "implementation='triton' or 'xla' to test sharding on the CPU")
    if any(jax.typeof(x).manual_axis_type.varying for x in jax.tree.leaves(operands)):
        if interpret and kernels == "triton":
            raise ValueError(
                "implementation='triton' with interpret=True cannot run inside "
                "jax.shard_map(check_vma=True): Pallas's interpreter re-binds the kernels' "
                "loop carries, traced invariant, to varying blocks; pass check_vma=False "
                "(compiled kernels do not go through this interpreter)")
        operands = _vary_together(operands)  # inside shard_map: already local
        # plgpu.kernel (jax 0.11.2) drops the manual axes of its out_type, so the Mosaic
        # kernels' results come back invariant; they vary as their operands do.
        return tuple(varying_like(r, operands[0]) for r in call.run(operands))
    if kernels == "xla" or mesh.empty or mesh.size == 1 or context.manual_axes:
        # Plain XLA, which the partitioner splits by itself; one device; or inside
        # shard_map(check_vma=False), where the operands already are the local shards.
        return call.run(operands)
    if mesh.explicit_axes:
        return _explicit(call, operands, mesh)
    return _auto(call, operands)


def _vary_together(operands):
    """Every operand varying over the union of the operands' varying manual axes (what
    ``check_vma=True`` needs of a kernel's operands, whose outputs vary as the query)."""
    varying = frozenset().union(
        *(jax.typeof(x).manual_axis_type.varying for x in jax.tree.leaves(operands)))
    mesh_order = jax.sharding.get_abstract_mesh().axis_names

    def vary(x):
        missing = varying - jax.typeof(x).manual_axis_type.varying
        if not missing:
            return x
        return jax.lax.pcast(x, tuple(a for a in mesh_order if a in missing), to="varying")

    return jax.tree.map(vary, operands)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _split_axes(mesh, q_spec, q_shape, kv_heads: int):
    """(batch axes, head axes): the query's sharding of batch and heads, each kept only if
    it splits its dim evenly (heads: whole KV-head groups on every shard)."""
    q_spec = tuple(q_spec) + (None,) * (4 - len(tuple(q_spec)))
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    batch_axes, head_axes = _axes(q_spec[0]), _axes(q_spec[2])
    if q_shape[0] % size(batch_axes):
        batch_axes = ()
    if kv_heads % size(head_axes):
        head_axes = ()
    return batch_axes, head_axes


def _spec(roles, batch_axes, head_axes) -> P | None:
    if roles is None:
        return None
    entry = {_BATCH: batch_axes, _HEADS: head_axes, _KV_HEADS: head_axes}
    return P(*(entry.get(role) or None for role in roles))


def _specs(tree, batch_axes, head_axes):
    """PartitionSpecs for a pytree of role tuples (None stays None)."""
    return jax.tree.map(lambda roles: _spec(roles, batch_axes, head_axes), tree,
                        is_leaf=lambda x: x is None or (isinstance(x, tuple)
                                                        and all(isinstance(r, str) for r in x)))


def _local_run(call: _Call, batch_axes, head_axes):
    """The kernels on local shards, then the sum over shards that a bias gradient on a
    broadcast dim needs (the batch or heads it was broadcast over are split)."""

    def run(*operands):
        results = call.run(operands)
        if not call.bias_grad:
            return results
        *grads, d_bias = results
        roles = call.result_roles[-1]
        summed = ((batch_axes if roles[0] == _UNIT else ())
                  + (head_axes if roles[1] == _UNIT else ()))
        if summed:
            d_bias = jax.lax.psum(d_bias, summed)
        return (*grads, d_bias)

    return run


def _explicit(call: _Call, operands, mesh):
    """Explicit mesh axes: a ``shard_map`` over the query's batch and head axes; operands
    split elsewhere (sequence, head_dim) are resharded to the layout it takes first."""
    q, k = operands[0], operands[1]
    batch_axes, head_axes = _split_axes(mesh, jax.typeof(q).sharding.spec, q.shape,
                                        k.shape[2])
    in_specs = _specs(call.operand_roles, batch_axes, head_axes)
    out_specs = _specs(call.result_roles, batch_axes, head_axes)
    operands = jax.tree.map(
        lambda x, spec: None if x is None else jax.sharding.reshard(x, NamedSharding(mesh, spec)),
        operands, in_specs, is_leaf=lambda x: x is None)
    manual = frozenset(batch_axes + head_axes)
    if not manual:
        return call.run(operands)
    run = _local_run(call, batch_axes, head_axes)
    # check_vma=False: the specs above say how every result varies, and Pallas's interpret
    # mode cannot lower a kernel with loops under check_vma=True (its HLO interpreter
    # re-binds the kernel's invariant loop carries to varying blocks).
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=manual, check_vma=False)(*operands)


# --- automatic axes: custom_partitioning with a Shardy rule -------------------------------

_FACTOR = {_BATCH: "b", _Q_SEQ: "t", _KV_SEQ: "s", _HEADS: "h", _KV_HEADS: "k", _DIM: "d"}


def _sharding_rule(call: _Call, mesh, operand_types, result_types):
    """The Shardy rule: batch ``b``, query heads ``h`` and KV heads ``k`` pass through, the
    sequences and head_dim need replication, a broadcast dim is a factor of its own.

    Query and KV heads are separate factors: as the compound ``(k g)`` (group ``g``), Shardy
    would split a mesh axis larger than ``kv_heads`` into sub-axes over ``k`` and ``g``,
    which custom_partitioning cannot hand to ``partition`` as a PartitionSpec. ``partition``
    ties them: K / V heads split as the query's.
    """
    del mesh, operand_types, result_types
    units = (f"u{i}" for i in itertools.count())
    unit_factors = []

    def mapping(roles):
        factors = []
        for role in roles:
            if role == _UNIT:
                unit_factors.append(next(units))
                factors.append(unit_factors[-1])
            else:
                factors.append(_FACTOR[role])
        return " ".join(factors)

    def flat(tree):
        return [mapping(r) for r in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(r, str) for r in x))]

    rule = ", ".join(flat(call.operand_roles)) + " -> " + ", ".join(flat(call.result_roles))
    # Shardy wants the special factors in the order the factors first appear in the rule.
    appearance = list(dict.fromkeys(re.findall(r"[a-z]\w*", rule)))
    replicated = {"t", "s", "d", *unit_factors}
    options = dict(need_replication_factors=tuple(
        f for f in appearance if f in replicated))
    return rule, options


def _partition(call: _Call, mesh, operand_shapes, result_shapes):
    """Keeps the query's batch and head sharding (where it splits evenly), replicates the
    rest, and runs the kernels on the local shards."""
    del result_shapes
    q_sharding = operand_shapes[0].sharding
    if isinstance(q_sharding, NamedSharding):
        batch_axes, head_axes = _split_axes(mesh, q_sharding.spec, operand_shapes[0].shape,
                                            operand_shapes[1].shape[2])
    else:  # no mesh to read axes from: replicated
        batch_axes = head_axes = ()

    def shardings(tree):
        return jax.tree.map(lambda s: None if s is None else NamedSharding(mesh, s),
                            _specs(tree, batch_axes, head_axes), is_leaf=lambda x: x is None)

    return (mesh, _local_run(call, batch_axes, head_axes), shardings(call.result_roles),
            shardings(call.operand_roles))


def _partitioned_call(call: _Call, *operands):
    return call.run(operands)


_partitioned = custom_partitioning(_partitioned_call, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, sharding_rule=_sharding_rule)


def _auto(call: _Call, operands):
    """The kernels under ``custom_partitioning``; under ``vmap`` (which it has no rule for)
    the vmapped kernels run instead, as without sharding."""
    leaves, tree = jax.tree.flatten(operands)

    @custom_vmap
    def run(*leaves):
        return _partitioned(call, *jax.tree.unflatten(tree, leaves))

    @run.def_vmap
    def _vmap_rule(axis_size, in_batched, *leaves):
        del axis_size
        axes = [0 if batched else None for batched in in_batched]
        results = jax.vmap(lambda *xs: call.run(jax.tree.unflatten(tree, xs)),
                           in_axes=axes)(*leaves)
        return results, tuple(True for _ in results)

    return run(*leaves)


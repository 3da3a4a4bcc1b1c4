"""Flex attention (user mask and score functions over a block mask) as Triton-lowered
Pallas kernels: a forward and a two-kernel backward that walk a block mask's lists.

The block mask and the converted functions come in as arguments (this backend does not
import ``pallas_flash.flex``): ``block_mask`` is read through the fields of a
``pallas_flash.flex.BlockMask`` and its ``check`` method, and ``score_mod`` is a converted
function with its captured operands (``pallas_flash.flex.convert_score_mod``).

* forward — one program per (batch, head, query block). It walks the partial key blocks
  (``kv_num_blocks`` / ``kv_indices``: the mask function evaluated on the tile's row and
  column index vectors), then the full ones (``full_kv_*``: no mask function), with the
  FlashAttention-2 online softmax. ``score_mod`` is applied to the logits tile in
  registers, after the scale and the soft cap and before the masks (the package's order).
* dK/dV — one program per (batch, KV head, key block): for each query head of the GQA
  group it walks the transposed lists (``q_num_blocks`` / ``q_indices``, then ``full_q_*``),
  recomputes P from the forward's lse, and accumulates dV += Pᵀ·dO and dK += dSᵀ·Q, where
  dS = P∘(dP − delta) is pulled back through ``score_mod`` with JAX's own derivative of the
  converted function (``jax.vjp`` of the elementwise function on the tile), then through
  the soft cap.
* dQ — one program per (batch, head, query block) walking the forward's lists:
  dQ += dS·K. Every output tile is written by one program: deterministic, no atomics.

The captured arrays of both functions are whole kernel inputs. The converted function is
traced on the tile's index vectors and evaluated with each captured array left in its ref
(:func:`_eval_with_refs`): an element-wise read (``ids[b, q_idx]``, ``slopes[h]``,
``table[bucket(kv - q), h]``: a gather or dynamic slice) becomes a load of the ref at the
index arrays, the Triton lowering's pointer gather, since it has no rule for a gather of a
value; :func:`unsupported` refuses what cannot become such a load. The captured arrays are
constants of the attention: no gradient reaches them (use
``pallas_flash.flex.flex_reference`` to differentiate a captured table or slope).

Positions past ``seq_q`` / ``seq_kv`` (the last blocks' padding) are hidden whatever the
functions return there, so a function that reads a captured array past its end (a
gather there returns a fill value, NaN for floats) cannot leak into the result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend import core as jex_core

from pallas_flash.contract import DTYPES, EMPTY_ROW_LSE, kernel_output
from pallas_flash.logits import LOG2_E, log2_logits, raw_score_gradient
from pallas_flash.padding import pad_axis
from pallas_flash.triton.config import TritonConfig, padded_head_dim
from pallas_flash.triton.forward import dot_precision

#: Largest head dim the kernels take: Q, K, V and the accumulators of a tile must fit on
#: chip (the main Triton kernels' limit is the same padded 256).
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: the custom_vjp's static argument).

    ``mask_fn`` / ``score_fn``: converted functions (``score_fn`` None without a
    score_mod); ``mask_batch`` / ``mask_heads``: the block mask's ``B'`` / ``N'``.
    """

    mask_fn: Any
    score_fn: Any
    scale: float
    softcap: float | None
    seq_q: int
    seq_kv: int
    mask_batch: int
    mask_heads: int
    group: int
    config: TritonConfig
    interpret: bool

    @property
    def block_q(self) -> int:
        return self.config.block_q

    @property
    def block_kv(self) -> int:
        return self.config.block_kv

    def list_index(self, batch, head):
        """The block mask's (batch, head) entry for a program's query batch and head."""
        return (batch if self.mask_batch > 1 else 0, head if self.mask_heads > 1 else 0)


def _whole(x: jax.Array) -> pl.BlockSpec:
    """Every program sees all of ``x`` (lists and captured arrays: indexed in the kernel)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _tile_indices(static: _Static, q_block, kv_block):
    """Row and column index vectors of a tile: int32 ``[block_q, 1]``, ``[1, block_kv]``."""
    rows = q_block * static.block_q + lax.broadcasted_iota(jnp.int32, (static.block_q, 1), 0)
    cols = kv_block * static.block_kv + lax.broadcasted_iota(jnp.int32,
                                                             (1, static.block_kv), 1)
    return rows, cols


class _Captured:
    """A captured array's kernel ref, standing in for the array while a converted function
    is evaluated (:func:`_call_with_refs`)."""

    def __init__(self, ref):
        self.ref = ref


def _gather_default_fill(dtype):
    """lax.gather's fill for an index out of bounds in ``FILL_OR_DROP`` mode."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if dtype == jnp.bool_:
        return True
    return jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.signedinteger) \
        else jnp.iinfo(dtype).max


def _gather_from_ref(ref, indices, *, dimension_numbers, slice_sizes, mode, fill_value,
                     **_):
    """A pointwise ``gather`` (every slice one element, what ``x[i, j]`` on index arrays
    becomes) as a load of ``ref`` at integer-array indices: the Triton lowering's pointer
    gather. Indices are clamped into the array, as ``CLIP`` does (and every mode must, to
    read no memory outside it); ``FILL_OR_DROP`` then puts its fill value where they were
    outside."""
    numbers = dimension_numbers
    if any(size != 1 for size in slice_sizes) or numbers.operand_batching_dims:
        raise NotImplementedError("only element-wise reads of a captured array lower")
    batch_shape = indices.shape[:-1]
    parts = lax.split(indices, (1,) * indices.shape[-1], axis=indices.ndim - 1)
    index, inside = [], None
    for dim, size in enumerate(ref.shape):
        if dim not in numbers.start_index_map:
            index.append(jnp.zeros(batch_shape, jnp.int32))
            continue
        i = parts[numbers.start_index_map.index(dim)].reshape(batch_shape).astype(jnp.int32)
        if mode == lax.GatherScatterMode.FILL_OR_DROP:
            ok = (i >= 0) & (i < size)
            inside = ok if inside is None else inside & ok
        index.append(jnp.clip(i, 0, size - 1))
    value = ref[tuple(index)]
    if inside is not None:
        fill = _gather_default_fill(ref.dtype) if fill_value is None else fill_value
        value = jnp.where(inside, value, jnp.asarray(fill, ref.dtype))
    batch_dims = iter(batch_shape)
    rank = len(batch_shape) + len(numbers.offset_dims)
    return value.reshape(tuple(1 if d in numbers.offset_dims else next(batch_dims)
                               for d in range(rank)))


def _dynamic_slice_from_ref(ref, *starts, slice_sizes):
    """``dynamic_slice`` (``x[h]`` at a scalar index) as a load of ``ref``; starts are
    clamped as dynamic_slice clamps them."""
    return ref[tuple(pl.ds(jnp.clip(start, 0, dim - size), size)
                     for start, dim, size in zip(starts, ref.shape, slice_sizes, strict=True))]


def _eval_with_refs(jaxpr, consts, args):
    """``jaxpr`` evaluated on ``args``, some of them :class:`_Captured`: a gather or dynamic
    slice of one reads its ref at the indices, any other use loads it whole."""
    env = {}

    def read(var):
        return var.val if isinstance(var, jex_core.Literal) else env[var]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr")
        captured = any(isinstance(x, _Captured) for x in values)
        if captured and isinstance(inner, jex_core.ClosedJaxpr):  # a nested jit: look inside
            out = _eval_with_refs(inner.jaxpr, inner.consts, values)
        elif captured and eqn.primitive.name == "gather" and isinstance(values[0], _Captured):
            out = [_gather_from_ref(values[0].ref, values[1], **eqn.params)]
        elif captured and eqn.primitive.name == "dynamic_slice" and isinstance(values[0],
                                                                               _Captured):
            out = [_dynamic_slice_from_ref(values[0].ref, *values[1:], **eqn.params)]
        else:
            values = [x.ref[...] if isinstance(x, _Captured) else x for x in values]
            out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
            out = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, out, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _call_with_refs(fn, args, refs):
    """``fn(*args, *operands)`` (a converted function lifted over the tile's index arrays)
    with each captured operand read from its kernel ref where the function indexes it,
    rather than loaded whole (the Triton lowering has no gather of a value)."""
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    avals += [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in refs]
    closed = jax.make_jaxpr(fn)(*avals)
    (out,) = _eval_with_refs(closed.jaxpr, closed.consts,
                             [*args, *(_Captured(r) for r in refs)])
    return out


def _visible(static: _Static, batch, head, rows, cols, mask_ops, *, partial: bool):
    """Which pairs of the tile count (None: all): the mask function on a partial tile, and
    real positions only where the sequences do not fill their last block."""
    conditions = []
    if partial:
        conditions.append(_call_with_refs(static.mask_fn, (batch, head, rows, cols),
                                          mask_ops))
    if static.seq_kv % static.block_kv:
        conditions.append(cols < static.seq_kv)
    if static.seq_q % static.block_q:
        conditions.append(rows < static.seq_q)
    if not conditions:
        return None
    return functools.reduce(jnp.logical_and, conditions)


def _logits(static: _Static, q, k, batch, head, rows, cols, score_ops, *,
            pullback: bool = False):
    """Base-2 logits of a tile: scale·q·kᵀ, the soft cap, then score_mod (which takes and
    returns natural-log units, as the user wrote it).

    Returns ``(s2, slope, score_vjp)``: ``slope`` as in :func:`log2_logits`, ``score_vjp``
    (only with ``pullback`` and a score_mod) maps dS of the modified logits to dS of its
    input.
    """
    qk = plgpu.dot(q, k, trans_b=True, precision=dot_precision(q.dtype))
    s2, slope = log2_logits(qk, static.scale, static.softcap)
    if static.score_fn is None:
        return s2, slope, None

    def modded(s):
        return _call_with_refs(static.score_fn, (s, batch, head, rows, cols), score_ops)

    s = s2 * (1.0 / LOG2_E)
    score_vjp = None
    if pullback:
        s, score_vjp = jax.vjp(modded, s)
    else:
        s = modded(s)
    return s * LOG2_E, slope, score_vjp


def _walk(step, carry, lists):
    """``step(n, carry, indices=..., partial=...)`` over the partial list, then the full
    one; ``lists`` = (count, indices ref, full count, full indices ref)."""
    count, indices, full_count, full_indices = lists
    carry = lax.fori_loop(0, count, functools.partial(step, indices=indices, partial=True),
                          carry)
    return lax.fori_loop(0, full_count,
                         functools.partial(step, indices=full_indices, partial=False), carry)


def _forward_kernel(list_refs, q_ref, k_ref, v_ref, mask_ops, score_ops, o_ref, lse_ref,
                    *, static: _Static):
    batch, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    counts, indices, full_counts, full_indices = list_refs
    at = (*static.list_index(batch, head), q_block)
    q = q_ref[...]
    block_kv = static.block_kv

    def kv_step(n, carry, *, indices, partial: bool):
        acc, m_i, l_i = carry
        kv_block = indices[(*at, n)]
        rows, cols = _tile_indices(static, q_block, kv_block)
        window = pl.ds(kv_block * block_kv, block_kv)
        s, _, _ = _logits(static, q, k_ref[window, :], batch, head, rows, cols, score_ops)
        visible = _visible(static, batch, head, rows, cols, mask_ops, partial=partial)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        # A row that has seen only hidden (or -inf scored) keys subtracts 0, so that its p
        # and alpha are 0, not NaN.
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_sub[:, None])
        alpha = jnp.exp2(m_i - m_sub)
        l_i = alpha * l_i + jnp.sum(p, axis=1)
        v = v_ref[window, :]
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v,
                                               precision=dot_precision(v.dtype))
        return acc, m_new, l_i

    carry = (jnp.zeros(q.shape, jnp.float32),
             jnp.full((static.block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((static.block_q,), jnp.float32))
    acc, m_i, l_i = _walk(kv_step, carry,
                          (counts[at], indices, full_counts[at], full_indices))
    empty = l_i == 0.0
    safe_l = jnp.where(empty, 1.0, l_i)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(safe_l)) / LOG2_E)


def _score_gradient(static: _Static, q, k, v, do, lse2, delta, batch, head, rows, cols,
                    mask_ops, score_ops, *, partial: bool):
    """``(p, ds)`` of a tile: P recomputed from the base-2 lse, and dS carried back
    through score_mod and the soft cap to scale·q·kᵀ (FA2, Algorithm 2)."""
    s, slope, score_vjp = _logits(static, q, k, batch, head, rows, cols, score_ops,
                                  pullback=True)
    p = jnp.exp2(s - lse2[:, None])
    visible = _visible(static, batch, head, rows, cols, mask_ops, partial=partial)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    dp = plgpu.dot(do, v, trans_b=True, precision=dot_precision(do.dtype))
    ds = p * (dp - delta[:, None])
    if score_vjp is not None:
        (ds,) = score_vjp(ds)
        if visible is not None:  # score_mod's derivative at a hidden pair may be NaN
            ds = jnp.where(visible, ds, 0.0)
    return p, raw_score_gradient(ds, slope)


def _dkdv_kernel(list_refs, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_ops,
                 score_ops, dk_ref, dv_ref, *, static: _Static):
    """One key block of one (batch, KV head); q/dO ``[padded_q, group, D]``, lse/delta
    ``[group, padded_q]`` of the KV head's query heads."""
    batch, kv_head, kv_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    counts, indices, full_counts, full_indices = list_refs
    k, v = k_ref[...], v_ref[...]
    precision = dot_precision(k.dtype)

    def head_step(member, carry):  # the GQA group's query heads, summed in registers
        head = kv_head * static.group + member
        at = (*static.list_index(batch, head), kv_block)

        def q_step(n, carry, *, indices, partial: bool):
            dk, dv = carry
            q_block = indices[(*at, n)]
            rows, cols = _tile_indices(static, q_block, kv_block)
            window = pl.ds(q_block * static.block_q, static.block_q)
            q, do = q_ref[window, member, :], do_ref[window, member, :]
            p, ds = _score_gradient(static, q, k, v, do, lse_ref[member, window],
                                    delta_ref[member, window], batch, head, rows, cols,
                                    mask_ops, score_ops, partial=partial)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
            return dk, dv

        return _walk(q_step, carry, (counts[at], indices, full_counts[at], full_indices))

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, static.group, head_step, (zeros, zeros))
    dk_ref[...] = (dk * static.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(list_refs, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_ops,
               score_ops, dq_ref, *, static: _Static):
    """One query block of one (batch, head), walking the forward's lists."""
    batch, head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    counts, indices, full_counts, full_indices = list_refs
    at = (*static.list_index(batch, head), q_block)
    q, do, lse2, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def kv_step(n, dq, *, indices, partial: bool):
        kv_block = indices[(*at, n)]
        rows, cols = _tile_indices(static, q_block, kv_block)
        window = pl.ds(kv_block * static.block_kv, static.block_kv)
        k = k_ref[window, :]
        _, ds = _score_gradient(static, q, k, v_ref[window, :], do, lse2, delta, batch,
                                head, rows, cols, mask_ops, score_ops, partial=partial)
        return dq + plgpu.dot(ds.astype(k.dtype), k, precision=dot_precision(k.dtype))

    dq = _walk(kv_step, jnp.zeros(q.shape, jnp.float32),
               (counts[at], indices, full_counts[at], full_indices))
    dq_ref[...] = (dq * static.scale).astype(dq_ref.dtype)


def _padded(static: _Static, q, k, v, num_q_blocks: int, num_kv_blocks: int):
    """q, k, v padded to whole blocks and a power-of-two head dim."""
    head_dim = padded_head_dim(q.shape[3])
    rows, keys = num_q_blocks * static.block_q, num_kv_blocks * static.block_kv
    return (pad_axis(pad_axis(q, 1, rows), 3, head_dim),
            *(pad_axis(pad_axis(x, 1, keys), 3, head_dim) for x in (k, v)))


def _params(config: TritonConfig, *, backward: bool) -> plgpu.CompilerParams:
    if backward:
        return plgpu.CompilerParams(num_warps=config.bwd_num_warps,
                                    num_stages=config.bwd_num_stages)
    return plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


def _forward(static: _Static, q, k, v, lists, mask_ops, score_ops):
    """(out [B, T, N, D], lse [B, N, T] float32) of the forward kernel."""
    batch, seq_q, heads, head_dim = q.shape
    forward_lists = tuple(lists[:4])
    num_q_blocks, num_kv_blocks = lists[1].shape[-2:]
    q_p, k_p, v_p = _padded(static, q, k, v, num_q_blocks, num_kv_blocks)
    padded_q, padded_d = q_p.shape[1], q_p.shape[3]
    q_spec = pl.BlockSpec((None, static.block_q, None, padded_d),
                          lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, k_p.shape[1], None, padded_d),
                           lambda b, h, i: (b, 0, h // static.group, 0))
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, static=static),
        grid=(batch, heads, num_q_blocks),
        in_specs=[tuple(_whole(x) for x in forward_lists), q_spec, kv_spec, kv_spec,
                  tuple(_whole(x) for x in mask_ops), tuple(_whole(x) for x in score_ops)],
        out_specs=[q_spec, pl.BlockSpec((None, None, static.block_q), lambda b, h, i: (b, h, i))],
        out_shape=[kernel_output((batch, padded_q, heads, padded_d), q.dtype, q),
                   kernel_output((batch, heads, padded_q), jnp.float32, q)],
        compiler_params=_params(static.config, backward=False),
        interpret=static.interpret,
        name="pallas_flash_flex_forward",
    )(forward_lists, q_p, k_p, v_p, tuple(mask_ops), tuple(score_ops))
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]


def _backward(static: _Static, q, k, v, lists, mask_ops, score_ops, lse, d_out, delta):
    """(dq, dk, dv): the dK/dV kernel on the transposed lists, the dQ kernel on the
    forward's. ``delta``: ``[B, N, T]`` float32, rowsum(dO∘O) minus the lse cotangent."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = static.group
    num_q_blocks, num_kv_blocks = lists[1].shape[-2:]
    q_p, k_p, v_p = _padded(static, q, k, v, num_q_blocks, num_kv_blocks)
    do_p = _padded(static, d_out, k, v, num_q_blocks, num_kv_blocks)[0]
    padded_q, padded_kv, padded_d = q_p.shape[1], k_p.shape[1], q_p.shape[3]
    # Base-2 lse; padded rows get +inf, so that their P = exp2(S - inf) is 0.
    lse2 = pad_axis(lse * LOG2_E, 2, padded_q, jnp.inf)
    delta = pad_axis(delta, 2, padded_q)
    operand_specs = [tuple(_whole(x) for x in mask_ops), tuple(_whole(x) for x in score_ops)]
    operands = [tuple(mask_ops), tuple(score_ops)]

    # dK/dV: a KV head's query heads viewed as one [T, G, D] block.
    transposed = tuple(lists[4:])
    kv_tile = pl.BlockSpec((None, static.block_kv, None, padded_d),
                           lambda b, h, j: (b, j, h, 0))
    group_rows = pl.BlockSpec((None, padded_q, None, group, padded_d),
                              lambda b, h, j: (b, 0, h, 0, 0))
    group_stats = pl.BlockSpec((None, None, group, padded_q), lambda b, h, j: (b, h, 0, 0))
    grouped = lambda x: x.reshape(batch, padded_q, kv_heads, group, padded_d)  # noqa: E731
    stats = lambda x: x.reshape(batch, kv_heads, group, padded_q)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, static=static),
        grid=(batch, kv_heads, num_kv_blocks),
        in_specs=[tuple(_whole(x) for x in transposed), group_rows, kv_tile, kv_tile,
                  group_rows, group_stats, group_stats, *operand_specs],
        out_specs=[kv_tile, kv_tile],
        out_shape=[kernel_output(k_p.shape, k.dtype, q)] * 2,
        compiler_params=_params(static.config, backward=True),
        interpret=static.interpret,
        name="pallas_flash_flex_backward_dkdv",
    )(transposed, grouped(q_p), k_p, v_p, grouped(do_p), stats(lse2), stats(delta), *operands)

    forward_lists = tuple(lists[:4])
    q_tile = pl.BlockSpec((None, static.block_q, None, padded_d), lambda b, h, i: (b, i, h, 0))
    kv_rows = pl.BlockSpec((None, padded_kv, None, padded_d),
                           lambda b, h, i: (b, 0, h // group, 0))
    row_stats = pl.BlockSpec((None, None, static.block_q), lambda b, h, i: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, static=static),
        grid=(batch, heads, num_q_blocks),
        in_specs=[tuple(_whole(x) for x in forward_lists), q_tile, kv_rows, kv_rows, q_tile,
                  row_stats, row_stats, *operand_specs],
        out_specs=q_tile,
        out_shape=kernel_output(q_p.shape, q.dtype, q),
        compiler_params=_params(static.config, backward=True),
        interpret=static.interpret,
        name="pallas_flash_flex_backward_dq",
    )(forward_lists, q_p, k_p, v_p, do_p, lse2, delta, *operands)
    return (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
            dv[:, :seq_kv, :, :head_dim])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _Static, q, k, v, lists, mask_ops, score_ops):
    return _forward(static, q, k, v, lists, mask_ops, score_ops)


def _attention_fwd(static: _Static, q, k, v, lists, mask_ops, score_ops):
    out, lse = _forward(static, q, k, v, lists, mask_ops, score_ops)
    return (out, lse), (q, k, v, lists, mask_ops, score_ops, out, lse)


def _attention_bwd(static: _Static, residuals, cotangents):
    q, k, v, lists, mask_ops, score_ops, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32),
                       precision=lax.Precision.HIGHEST) - d_lse
    dq, dk, dv = _backward(static, q, k, v, lists, mask_ops, score_ops, lse, d_out, delta)
    # The lists and the captured arrays are constants of the attention (module docstring).
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)

#: The BlockMask fields the kernels read, in the order ``lists`` holds them.
_LIST_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


#: Primitives that read an array at a traced index: what ``ids[b, q_idx]``, ``slopes[h]``
#: or ``table[bucket]`` become. On a captured array they become ref loads
#: (:func:`_eval_with_refs`); the Triton lowering has no rule for them on a value.
_INDEXED_READS = frozenset({"gather", "dynamic_slice"})


def _lowering_gap(jaxpr, captured) -> str | None:
    """What in a converted function's ``jaxpr`` the compiled kernels cannot lower (None:
    nothing): an indexed read of a computed value, a gather of more than one element per
    index, or a captured array used whole with a size that is not a power of two (Triton's
    shapes). ``captured``: the vars that hold captured arrays."""
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr")
        flags = [isinstance(v, jex_core.Var) and v in captured for v in eqn.invars]
        held = [v for v, flag in zip(eqn.invars, flags, strict=True) if flag]
        if held and isinstance(inner, jex_core.ClosedJaxpr):
            gap = _lowering_gap(inner.jaxpr, {w for w, flag in zip(inner.jaxpr.invars, flags,
                                                                 strict=True) if flag})
            if gap is not None:
                return gap
        elif eqn.primitive.name in _INDEXED_READS:
            if not flags[0]:
                return "reads a computed array at a traced index (a gather of a value)"
            numbers = eqn.params.get("dimension_numbers")
            if any(size != 1 for size in eqn.params["slice_sizes"]) or (
                    numbers is not None and numbers.operand_batching_dims):
                return "reads more than one element of a captured array per index"
        elif any(v.aval.size & (v.aval.size - 1) for v in held):
            return ("uses a captured array whose size is not a power of two whole (Triton's "
                    "shapes); index it instead")
    return None


def unsupported(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype,
                block_size: tuple[int, int], functions: tuple[Any, ...] = (),
                interpret: bool = False) -> str | None:
    """None if these kernels run a call ``q: [batch, seq_q, heads, head_dim]``, ``k, v:
    [batch, seq_kv, kv_heads, head_dim]`` of ``dtype`` over a block mask of ``block_size``
    (its tiles are the kernels' tiles) with the converted mask / score ``functions``, else
    a sentence saying why not (the caller then runs ``pallas_flash.flex.flex_reference``).
    Compiled (``interpret`` False), a function is refused where its reads cannot become
    ref loads (:func:`_lowering_gap`)."""
    del kv_shape
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Triton flex kernels take {[str(d) for d in DTYPES]}, not {jnp.dtype(dtype)}"
    if q_shape[-1] > MAX_HEAD_DIM:
        return (f"the Triton flex kernels take head_dim up to {MAX_HEAD_DIM}, got "
                f"{q_shape[-1]}")
    for size in block_size:
        if size < 16 or size & (size - 1):
            return (f"the Triton flex kernels tile by the block mask's block_size, which must "
                    f"be powers of two >= 16 (Triton's tile shapes), got {tuple(block_size)}")
    if not interpret:
        for fn in functions:
            gap = _lowering_gap(fn.jaxpr, set(fn.jaxpr.constvars))
            if gap is not None:
                return f"the compiled Triton flex kernels cannot lower this {fn.kind}: it {gap}"
    return None


def _check_number(value, name: str, *, optional: bool) -> float | None:
    """A positive finite Python number as a float (None passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        allowed = "None or " if optional else ""
        raise ValueError(f"{name} must be {allowed}a positive finite number, got {value!r}")
    return float(value)


def _default_config(block_size: tuple[int, int]) -> TritonConfig:
    """The block mask's tile for all three kernels; launch parameters of the main
    kernels' small tiles (not tuned for flex)."""
    block_q, block_kv = block_size
    warps = 4 if block_q * block_kv <= 64 * 64 else 8
    return TritonConfig(block_q=block_q, block_kv=block_kv, num_warps=warps, num_stages=2,
                        bwd_block_q=block_q, bwd_block_kv=block_kv, bwd_num_warps=warps,
                        bwd_num_stages=2)


def flex_attention(q: jax.Array, k: jax.Array, v: jax.Array, block_mask, *,
                   score_mod: tuple[Any, tuple[jax.Array, ...]] | None = None,
                   scale: float | None = None, softcap: float | None = None,
                   interpret: bool = False, config: TritonConfig | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """Attention over a block mask with an optional score function, differentiable in q, k
    and v (the lists and every captured array are constants).

    Logits ``scale·q·kᵀ``, the soft cap ``softcap·tanh(s / softcap)``, then ``score_mod``;
    a pair is visible iff its tile is in the block mask's lists and the tile is full or the
    mask function shows it. A row that sees nothing gives zeros and ``EMPTY_ROW_LSE``.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``.
      k, v: ``[batch, seq_kv, kv_heads, head_dim]``, q's dtype; ``heads`` a multiple of
        ``kv_heads`` (GQA: the functions' ``head`` argument is the query head).
      block_mask: a ``pallas_flash.flex.BlockMask`` built for these lengths, its batch and
        head dims 1 or the call's; its block size is the kernels' tile.
      score_mod: ``(fn, operands)`` from ``pallas_flash.flex.convert_score_mod``, or None.
      scale: the logit scale (default ``1 / sqrt(head_dim)``).
      softcap: a positive cap, or None.
      interpret: run the kernels in Pallas interpret mode (CPU tests).
      config: launch parameters; its ``block_q`` / ``block_kv`` and ``bwd_block_q`` /
        ``bwd_block_kv`` must equal the block mask's block size (default: those, with
        the main kernels' launch parameters for small tiles).

    Returns:
      ``(out [batch, seq_q, heads, head_dim]`` in q's dtype, ``lse [batch, heads, seq_q]``
      float32, natural log).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                             f"{getattr(x, 'shape', None)}")
    batch, seq_q, heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim or (
            heads % k.shape[2]) or not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"k and v must both be [batch, seq_kv, kv_heads, head_dim] of q's "
                         f"batch, head_dim and dtype, with kv_heads dividing q's heads; got "
                         f"q {q.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype}")
    if not all(hasattr(block_mask, name) for name in (*_LIST_FIELDS, "mask_fn", "check")):
        raise ValueError(f"block_mask must be a pallas_flash.flex.BlockMask, got "
                         f"{type(block_mask).__name__}")
    block_size = tuple(block_mask.block_size)
    block_mask.check(batch=batch, heads=heads, seq_q=seq_q, seq_kv=k.shape[1])
    score_fn, score_ops = None, ()
    if score_mod is not None:
        if not (isinstance(score_mod, tuple) and len(score_mod) == 2
                and getattr(score_mod[0], "kind", None) == "score_mod"
                and len(score_mod[1]) == score_mod[0].num_operands):
            raise ValueError("score_mod must be None or the (fn, operands) pair of "
                             f"pallas_flash.flex.convert_score_mod, got {score_mod!r}")
        score_fn, score_ops = score_mod
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    functions = (block_mask.mask_fn,) if score_fn is None else (block_mask.mask_fn, score_fn)
    reason = unsupported(q.shape, k.shape, q.dtype, block_size, functions, interpret)
    if reason is not None:
        raise ValueError(reason)
    scale = (1.0 / math.sqrt(head_dim) if scale is None
             else _check_number(scale, "scale", optional=False))
    softcap = _check_number(softcap, "softcap", optional=True)
    if config is None:
        config = _default_config(block_size)
    elif not isinstance(config, TritonConfig) or {
            (config.block_q, config.block_kv), (config.bwd_block_q, config.bwd_block_kv)
    } != {block_size}:
        raise ValueError(f"config must be None or a TritonConfig whose forward and backward "
                         f"tiles are the block mask's block_size {block_size}, got {config!r}")
    static = _Static(mask_fn=block_mask.mask_fn, score_fn=score_fn, scale=scale,
                     softcap=softcap, seq_q=seq_q, seq_kv=k.shape[1],
                     mask_batch=block_mask.kv_num_blocks.shape[0],
                     mask_heads=block_mask.kv_num_blocks.shape[1], group=heads // k.shape[2],
                     config=config, interpret=interpret)
    lists = tuple(getattr(block_mask, name) for name in _LIST_FIELDS)
    return _attention(static, q, k, v, lists, tuple(block_mask.mask_operands),
                      tuple(score_ops))

"""Ring attention: attention over a sequence split across the devices of a mesh axis.

Inside ``jax.shard_map``, each of the ``n`` devices of a mesh axis holds a chunk of the
query and of K/V (``[batch, seq/n, heads, head_dim]``). The K/V chunks travel round the
ring with ``jax.lax.ppermute``: at step ``s`` device ``i`` holds the block of device
``i - s`` (mod ``n``) and runs the existing forward kernels of a backend on (its queries,
that block), and the partial ``(out, lse)`` of the steps merge exactly by their
log-sum-exp: inside the kernel's epilogue where the backend's forward takes ``into=``
(Mosaic: :func:`pallas_flash.mosaic.epilogue.merged_into`, no pass of its own), else
with :func:`pallas_flash.decode.merge_splits` (the same join as split-KV decode).
The next block's transfer is issued before the current step's kernels, so the
communication can hide behind them (Liu et al., "Ring Attention with Blockwise
Transformers", 2023). The backward recomputes from ``(out, lse)`` with the backends'
backward kernels (FlashAttention-2's ``delta = rowsum(dO ∘ O)``, computed once), K/V
circulate again and the dK/dV accumulators travel with their block, one more hop bringing
each home.

Which (query, key) pairs of a step are visible is static for each (device, step): the
global positions of both chunks are known from the layout. Each step's work is planned in
Python for every device (the chunk pairs that are fully hidden are dropped, the rest are
grouped into as few kernel calls as the band allows, each a :class:`~pallas_flash.masking.
MaskSpec` with the chunks' global offsets ``q_start`` / ``kv_start``), and the distinct
plans become the branches of a ``lax.switch`` indexed by (step, ``lax.axis_index``). A
``lax.switch`` runs only the taken branch, so a device whose step is fully masked launches
no kernel; the alternative, a Python branch, cannot see the device index (it is traced in
the SPMD program), and a mask applied to every step would spend the masked steps' work.

Layouts (``layout=``), the global sequence cut into chunks of ``c`` positions:

* ``"zigzag"``: ``2n`` chunks, device ``i`` holds chunks ``i`` and ``2n - 1 - i``
  (:func:`to_zigzag`). Under causal masking each device then does the same work at every
  step: step 0 is a causal block; at a step whose block comes from a lower device, both
  local query chunks see the block's first chunk only; from a higher one, the second query
  chunk sees the whole block (the load-balanced layout of zhuzilin's ring-flash-attention
  and of Llama 3's context parallelism).
* ``"contiguous"``: ``n`` chunks, device ``i`` holds chunk ``i``. Causal work is uneven
  (device ``n - 1`` does ``n`` blocks, device 0 one).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_flash import dispatch, sharding
from pallas_flash.arguments import (
    Implementation,
    canonical_bool,
    canonical_scale,
    canonical_segments,
    canonical_window,
    check_bools,
    check_deterministic,
    check_positive_int,
    check_sinks,
    check_soft_cap,
)
from pallas_flash.autodiff import add_sinks, row_delta, sinks_grad
from pallas_flash.contract import EMPTY_ROW_LSE, StaticArgs, varying_like
from pallas_flash.decode import merge_splits
from pallas_flash.masking import MaskSpec, zero_unseen_rows
from pallas_flash.tuning import resolve_config

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "Layout", "from_zigzag", "ring_attention", "to_zigzag"]


# --- layouts ----------------------------------------------------------------------------

def _zigzag_order(num_shards: int) -> list[int]:
    """Global chunk indices in zigzag storage order: 0, 2n-1, 1, 2n-2, ..."""
    num_shards = check_positive_int(num_shards, "num_shards")
    return [c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)]


def _reorder_chunks(x, num_shards: int, axis: int, order: list[int], name: str) -> jax.Array:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int, got {axis!r}")
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"x must be an array, got {type(x).__name__}")
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must index a dim of the array (ndim {x.ndim}), got {axis}")
    axis %= x.ndim
    length = x.shape[axis]
    if length % (2 * num_shards):
        raise ValueError(
            f"{name}: the length along axis {axis} ({length}) must be a multiple of "
            f"2 * num_shards = {2 * num_shards}")
    chunks = x.reshape(*x.shape[:axis], 2 * num_shards, length // (2 * num_shards),
                       *x.shape[axis + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def to_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """A global array reordered along ``axis`` into the zigzag layout of ``ring_attention``.

    The sequence (length ``L``, a multiple of ``2 · num_shards``) is cut into ``2 ·
    num_shards`` chunks; the result holds chunks ``0, 2n-1, 1, 2n-2, ...``, so that splitting
    it evenly over ``num_shards`` devices gives device ``i`` chunks ``i`` and ``2n-1-i``.
    Reorder everything that is indexed by sequence position the same way: q, k, v
    (``[batch, L, heads, head_dim]``, ``axis=1``), segment ids (``[batch, L]``, ``axis=1``)
    and the positions used for RoPE (``to_zigzag(jnp.arange(L), n, axis=0)``): a token keeps
    its global position, only its storage place moves. :func:`from_zigzag` is the inverse.
    """
    return _reorder_chunks(x, num_shards, axis, _zigzag_order(num_shards), "to_zigzag")


def from_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of :func:`to_zigzag`: an array in zigzag order (e.g. ``ring_attention``'s
    output, gathered) back in sequence order along ``axis``."""
    order = _zigzag_order(num_shards)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return _reorder_chunks(x, num_shards, axis, inverse, "from_zigzag")


# --- the static plan: which kernel calls a (device, step) makes --------------------------

_HIDDEN, _FULL, _PARTIAL = "hidden", "full", "partial"


@dataclasses.dataclass(frozen=True)
class _Call:
    """One kernel call of a step: local query chunks ``[q_first, q_last)`` against the
    visiting block's chunks ``[kv_first, kv_last)``, with its mask (global offsets in it)."""

    q_chunks: tuple[int, int]
    kv_chunks: tuple[int, int]
    mask: MaskSpec


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Everything static about a ring call (hashable: a ``custom_vjp`` nondiff argument).

    ``chunk_q`` / ``chunk_kv``: positions per chunk (zigzag: half the local length).
    ``band``: the global mask's ``(lo, hi)`` on ``key - query`` positions.
    """

    axis_name: Any
    size: int
    layout: str
    chunk_q: int
    chunk_kv: int
    is_causal: bool
    window: tuple[int, int] | None
    band: tuple[int, int]
    scale: float
    softcap: float | None
    implementation: str | None
    interpret: bool
    config: Any
    deterministic: bool = False

    def chunks(self, device: int) -> tuple[int, ...]:
        """Global indices of the chunks ``device`` holds, in storage order."""
        if self.layout == "zigzag":
            return (device, 2 * self.size - 1 - device)
        return (device,)

    def _kind(self, diagonal: int) -> str:
        """A chunk pair whose key - query positions span ``diagonal + [-(cq-1), ckv-1]``."""
        lo, hi = self.band
        least, most = diagonal - (self.chunk_q - 1), diagonal + self.chunk_kv - 1
        if most < lo or least > hi:
            return _HIDDEN
        return _FULL if lo <= least and most <= hi else _PARTIAL

    def _call(self, q_glob, kv_glob, rows: range, cols: range) -> _Call | None:
        """One call over local chunks ``rows`` x ``cols`` whose mask reproduces the true
        visibility of every chunk pair in it, or None if no single band does (the chunks of
        a zigzag shard are not adjacent globally: one offset fits only some pairs)."""
        cq, ckv = self.chunk_q, self.chunk_kv
        truth = {(a, b): kv_glob[b] * ckv - q_glob[a] * cq for a in rows for b in cols}
        kinds = {pair: self._kind(d) for pair, d in truth.items()}
        shape = dict(seq_q=len(rows) * cq, seq_kv=len(cols) * ckv)
        if all(kind == _FULL for kind in kinds.values()):
            return _Call((rows[0], rows[-1] + 1), (cols[0], cols[-1] + 1), MaskSpec(**shape))
        for a0, b0 in truth:  # candidate offset: the one that places pair (a0, b0) exactly
            offset = truth[a0, b0] - ((b0 - cols[0]) * ckv - (a0 - rows[0]) * cq)
            fits = True
            for (a, b), d in truth.items():
                local = (b - cols[0]) * ckv - (a - rows[0]) * cq + offset
                kind = self._kind(local)
                if kind != kinds[a, b] or (kind == _PARTIAL and local != d):
                    fits = False
                    break
            if fits:
                mask = MaskSpec(**shape, is_causal=self.is_causal, window=self.window,
                                q_start=max(-offset, 0), kv_start=max(offset, 0))
                return _Call((rows[0], rows[-1] + 1), (cols[0], cols[-1] + 1), mask)
        return None

    @functools.cached_property
    def plans(self) -> tuple[tuple[tuple[_Call, ...], ...], ...]:
        """``plans[step][device]``: :meth:`plan` for every step and device, computed once
        per ring (the forward, the backward and its key-overlap check all walk them)."""
        return tuple(tuple(self.plan(device, step) for device in range(self.size))
                     for step in range(self.size))

    def plan(self, device: int, step: int) -> tuple[_Call, ...]:
        """The kernel calls of ``device`` at ``step`` (holding the block of device
        ``device - step``): none for a fully masked step; else one call if one band covers
        every visible chunk pair, else one per query chunk, else one per chunk pair."""
        q_glob = self.chunks(device)
        kv_glob = self.chunks((device - step) % self.size)
        seen = {(a, b) for a, b in itertools.product(range(len(q_glob)), range(len(kv_glob)))
                if self._kind(kv_glob[b] * self.chunk_kv - q_glob[a] * self.chunk_q)
                != _HIDDEN}
        if not seen:
            return ()
        rows = sorted({a for a, _ in seen})
        cols = sorted({b for _, b in seen})
        if rows == list(range(rows[0], rows[-1] + 1)) and cols == list(
                range(cols[0], cols[-1] + 1)):
            whole = self._call(q_glob, kv_glob, range(rows[0], rows[-1] + 1),
                               range(cols[0], cols[-1] + 1))
            if whole is not None:
                return (whole,)
        calls = []
        for a in rows:
            row_cols = sorted(b for b in cols if (a, b) in seen)
            call = None
            if row_cols == list(range(row_cols[0], row_cols[-1] + 1)):
                call = self._call(q_glob, kv_glob, range(a, a + 1),
                                  range(row_cols[0], row_cols[-1] + 1))
            if call is not None:
                calls.append(call)
                continue
            calls.extend(self._call(q_glob, kv_glob, range(a, a + 1), range(b, b + 1))
                         for b in row_cols)
        return tuple(calls)

    # --- kernels of one call ------------------------------------------------------------

    def static(self, mask: MaskSpec, q, k, backward: bool = False,
               has_segments: bool = False) -> StaticArgs:
        """The kernels and config of one call (the backward's: as ``autodiff`` picks it).
        With no implementation given, each call's backend is chosen for its own shape, as
        ``attention`` would choose it (a half-size zigzag step may suit another one)."""
        features = dispatch.Features(has_segments=has_segments, softcap=self.softcap)
        name = self.implementation or dispatch.choose(q.shape, k.shape, q.dtype, mask,
                                                      features, interpret=self.interpret)
        if backward:
            name = dispatch.choose_backward(name, q.shape, k.shape, q.dtype, mask, features,
                                            bias_grad=False, interpret=self.interpret)
        reason = dispatch.unsupported(name, q.shape, k.shape, q.dtype, mask, features)
        if reason is not None:
            raise ValueError(
                f"implementation={name!r} cannot run a ring step of shape q {q.shape}, "
                f"k {k.shape}: {reason}")
        module = dispatch.backend(name)
        config = self.config
        if config is None or name != self.implementation:
            config = module.default_config(q.shape, k.shape, q.dtype, mask)
        return StaticArgs(kernels=module.KERNELS, mask=mask, scale=self.scale,
                          config=config, interpret=self.interpret, softcap=self.softcap,
                          deterministic=self.deterministic)

    def slices(self, call: _Call) -> tuple[slice, slice]:
        (q0, q1), (k0, k1) = call.q_chunks, call.kv_chunks
        return (slice(q0 * self.chunk_q, q1 * self.chunk_q),
                slice(k0 * self.chunk_kv, k1 * self.chunk_kv))


def _forward_calls(ring: _Ring, plan, first: bool, acc, k, v, kv_ids, q_ids, q):
    """``(acc, None)``: ``acc = (out [B, T, N, D] float32, lse [B, N, T])`` with the plan's
    calls merged in (nothing travels with the block in the forward).

    ``first``: ``acc`` is still empty (step 0): a call's rows that no earlier call of the
    plan wrote take its result as it is, with no merge (n = 1 is then the plain call).
    """
    out_acc, lse_acc = acc
    written = _Written()
    for call in plan:
        rows, cols = ring.slices(call)
        segment_ids = None if q_ids is None else (q_ids[:, rows], kv_ids[:, cols])
        qs, ks, vs = zero_unseen_rows(q[:, rows], k[:, cols], v[:, cols], call.mask,
                                      segment_ids)
        static = ring.static(call.mask, qs, ks, has_segments=segment_ids is not None)
        fresh = first and written.fresh(rows)
        # A kernel that merges in its epilogue joins its partial to the running one.
        into = None if fresh or not static.kernels.merges_into else (
            out_acc[:, rows], lse_acc[:, :, rows])
        out, lse = sharding.forward(static, qs, ks, vs, segment_ids, None, None, into=into)
        if into is None:
            out, lse = out.astype(out_acc.dtype), lse.astype(lse_acc.dtype)
            if not fresh:
                # The exact join of two partial softmaxes over disjoint keys (split-KV
                # decode's).
                out, lse = merge_splits(jnp.stack([out_acc[:, rows], out], 1),
                                        jnp.stack([lse_acc[:, :, rows], lse], 1))
        out_acc = _put(out_acc, out, rows, axis=1)
        lse_acc = _put(lse_acc, lse, rows, axis=2)
    return (out_acc, lse_acc), None


def _backward_calls(ring: _Ring, part_dtype, plan, first: bool, dq, k, v, kv_ids, q_ids,
                    q, out, lse, d_out, delta):
    """``(dq, (dk, dv))``: ``dq`` float32 with the plan's calls' dQ added (``first``: it is
    still zeros, step 0); ``dk`` / ``dv`` the plan's own part of the visiting block's
    gradients, in ``part_dtype``, zero where no call reached. The caller adds them to the
    block's travelling accumulators after this step's kernels."""
    q_written, kv_written = _Written(), _Written()
    # Dead where one call covers every key.
    dk = dv = varying_like(jnp.zeros(k.shape, part_dtype), k)
    for call in plan:
        rows, cols = ring.slices(call)
        segment_ids = None if q_ids is None else (q_ids[:, rows], kv_ids[:, cols])
        qs, ks, vs = zero_unseen_rows(q[:, rows], k[:, cols], v[:, cols], call.mask,
                                      segment_ids)
        static = ring.static(call.mask, qs, ks, backward=True,
                             has_segments=segment_ids is not None)
        dqs, dks, dvs = sharding.backward(
            static, qs, ks, vs, segment_ids, out[:, rows], lse[:, :, rows], d_out[:, rows],
            delta[:, :, rows], None, None, False)
        if not (first and q_written.fresh(rows)):
            dqs = dq[:, rows] + dqs.astype(dq.dtype)
        if not kv_written.fresh(cols):
            dks = dk[:, cols] + dks.astype(part_dtype)
            dvs = dv[:, cols] + dvs.astype(part_dtype)
        dq = _put(dq, dqs, rows, axis=1)
        dk = _put(dk, dks, cols, axis=1)
        dv = _put(dv, dvs, cols, axis=1)
    return dq, (dk, dv)


def _writes_keys_once(ring: _Ring, plan) -> bool:
    """Whether no two calls of ``plan`` reach the same key positions."""
    written = _Written()
    return all([written.fresh(ring.slices(call)[1]) for call in plan])


class _Written:
    """The position ranges a plan's calls have written so far (static)."""

    def __init__(self) -> None:
        self.ranges: list[slice] = []

    def fresh(self, where: slice) -> bool:
        """Whether no earlier range meets ``where``; records it."""
        fresh = all(where.stop <= r.start or r.stop <= where.start for r in self.ranges)
        self.ranges.append(where)
        return fresh


def _put(x: jax.Array, part: jax.Array, where: slice, axis: int) -> jax.Array:
    """``x`` with ``part`` written at ``where`` along ``axis``.

    A ``dynamic_update_slice`` at a static index: ``x.at[...].set`` lowers to a scatter
    with an empty index operand, which XLA's CPU compiler (jax 0.11.2) crashes on
    (segmentation fault) inside ``shard_map`` next to a ``collective-permute``.
    """
    if where.start == 0 and where.stop == x.shape[axis]:
        return part.astype(x.dtype)
    return lax.dynamic_update_slice_in_dim(x, part.astype(x.dtype), where.start, axis)


def _pass_on(ring: _Ring, tree):
    """Every array of ``tree`` sent to the next device of the ring (device ``i`` to
    ``i + 1``): one ``collective-permute`` each."""
    if ring.size == 1:
        return tree  # a ring of one: the block is already here
    # The axis's own size: smaller than ring.size only in simulated_ring_attention.
    devices = lax.axis_size(ring.axis_name)
    perm = [(i, (i + 1) % devices) for i in range(devices)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis_name, perm), tree)


def _round_the_ring(ring: _Ring, run, carry, block, operands):
    """``(carry, travelling)`` after the ``n`` steps of the ring: at step ``s`` this device
    holds ``block`` of device ``i - s`` and ``carry, part = run(plan, carry, *block,
    *operands)`` with its plan of that step. ``part`` (None in the forward; the backward's
    dK/dV) is this step's share of accumulators that travel with the block: it is added to
    the ones that arrive from the previous device and the sum goes on to the next, one more
    hop after the last step bringing each home (``travelling``).

    The accumulators are added after the step's kernels, not before, and are not fenced
    with the block: their transfer runs behind the next step's kernels, as the K/V
    transfer does (ring-flash-attention's backward waits for them the same way). Fenced,
    each step's float32 dK/dV would have to arrive before the next kernels could start.

    The steps are unrolled, each fenced from the next by an ``optimization_barrier`` over
    (carry, incoming block). Without the fence XLA is free to issue every
    collective-permute of the chain up front and keep all ``n`` blocks alive at once
    (measured: per-device temp memory grew with ``n``, as under an all-gather); with it,
    step ``s + 1``'s transfer starts only once step ``s`` is done, and runs behind step
    ``s + 1``'s kernels, so two blocks are alive (the current one and the incoming one).
    A ``fori_loop`` gives the same schedule but cost 0.04-0.05 ms per step on the H200
    (2026-12-02, 8 simulated steps at L 8192: 7.81 against 8.17 ms dense, 4.39 against 4.64
    causal; ``benchmarks/ring.py``), the loop's own control on the device. Steps 1 to
    ``n - 1`` call one jitted function, so their kernels are lowered once, not once per
    step. Lowered for CUDA on the CPU, a causal 8-step forward + backward with the Mosaic
    kernels took 3.8 s this way, 19.4 s with each step lowered separately and 5.1 s with
    the loop. Step 0 (each device's own block) merges nothing: its results are written into
    the empty carry. The last step passes no block on. Each step's plan depends on
    (device, step): the distinct plans of the later steps are the branches of a
    ``lax.switch`` indexed by a static ``[step, device]`` table, so only the taken branch
    runs and a fully masked step launches no kernel.
    """
    plans = ring.plans

    def switch(rows, first: bool):
        """``(row, carry, block, operands) -> (carry, part)`` running this device's plan
        of ``rows[row]``."""
        distinct = list(dict.fromkeys(p for row in rows for p in row))
        table = np.asarray([[distinct.index(p) for p in row] for row in rows], np.int32)
        branches = [functools.partial(run, plan, first) for plan in distinct]

        def step_fn(row, carry, block, operands):
            if len(branches) == 1:
                return branches[0](carry, *block, *operands)
            index = jnp.asarray(table)[row, lax.axis_index(ring.axis_name)]
            return lax.switch(index, branches, carry, *block, *operands)
        return step_fn

    # The later steps are one jitted function: its kernels are lowered once for all steps
    # (lowering, not XLA, is most of the compile time of Pallas kernels).
    first_step, later_step = switch(plans[:1], True), jax.jit(switch(plans[1:], False))
    incoming = _pass_on(ring, block)
    carry, part = first_step(0, carry, block, operands)
    travelling = _pass_on(ring, part)
    for step in range(1, ring.size):
        carry, block = lax.optimization_barrier((carry, incoming))
        incoming = _pass_on(ring, block) if step < ring.size - 1 else None
        carry, part = later_step(np.int32(step - 1), carry, block, operands)
        # The sums are at least float32 (a part, step 0's included, may be bf16: exact as
        # the kernel gave it).
        travelling = _pass_on(ring, jax.tree.map(
            lambda sum_, p: sum_.astype(jnp.promote_types(sum_.dtype, jnp.float32)) + p,
            travelling, part))
    return carry, travelling


def _ring_forward(ring: _Ring, q, k, v, q_ids, kv_ids):
    accumulator = jnp.promote_types(q.dtype, jnp.float32)
    acc = (varying_like(jnp.zeros(q.shape, accumulator), q),
           varying_like(jnp.full((q.shape[0], q.shape[2], q.shape[1]),
                                 EMPTY_ROW_LSE, accumulator), q))
    return _round_the_ring(ring, functools.partial(_forward_calls, ring), acc,
                           (k, v, kv_ids), (q_ids, q))[0]


def _ring_backward(ring: _Ring, q, k, v, q_ids, kv_ids, out, lse, d_out, delta):
    """``(dq, dk, dv)`` float32. dK / dV travel with their block, as float32 sums; a step
    hands over its own part in the kernels' dtype where no two of its calls reach the
    same keys (the add then converts it for free, and step 0's hop, the part alone,
    carries it as the kernel gave it), else in float32."""
    grad_dtype = jnp.promote_types(q.dtype, jnp.float32)
    dq = varying_like(jnp.zeros(q.shape, grad_dtype), q)
    once = all(_writes_keys_once(ring, plan) for row in ring.plans for plan in row)
    part_dtype = k.dtype if once else grad_dtype
    dq, (dk, dv) = _round_the_ring(
        ring, functools.partial(_backward_calls, ring, part_dtype), dq, (k, v, kv_ids),
        (q_ids, q, out, lse, d_out, delta))
    return dq, dk.astype(grad_dtype), dv.astype(grad_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring_attention(q, k, v, q_ids, kv_ids, sinks, ring: _Ring):
    return _ring_fwd(q, k, v, q_ids, kv_ids, sinks, ring)[0]


def _ring_fwd(q, k, v, q_ids, kv_ids, sinks, ring: _Ring):
    out, lse = _ring_forward(ring, q, k, v, q_ids, kv_ids)
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    out = out.astype(q.dtype)
    lse = lse.astype(jnp.promote_types(q.dtype, jnp.float32))
    return (out, lse), (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _ring_bwd(ring: _Ring, residuals, cotangents):
    q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
    d_out, d_lse = cotangents
    delta = row_delta(out, lse, d_out, d_lse)
    dq, dk, dv = _ring_backward(ring, q, k, v, q_ids, kv_ids, out, lse,
                                d_out.astype(q.dtype), delta)
    d_sinks = None
    if sinks is not None:
        # Every row of the global sequence adds to a sink's gradient: summed over the ring
        # (one all-reduce of [heads]), and over the other axes the rows vary along (batch
        # shards, under check_vma), unless the sinks themselves vary along them.
        d_sinks = sinks_grad(sinks, lse, delta)
        ring_axes = ring.axis_name if isinstance(ring.axis_name, tuple) else (ring.axis_name,)
        rows_vary = jax.typeof(d_sinks).manual_axis_type.varying
        sinks_vary = jax.typeof(sinks).manual_axis_type.varying
        summed = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names
                       if (a in ring_axes or a in rows_vary) and a not in sinks_vary)
        if summed:
            d_sinks = lax.psum(d_sinks, summed)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _axis_size(axis_name) -> int:
    """The size of mesh axis ``axis_name`` of the enclosing ``shard_map``."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or any(not isinstance(a, str) or a not in manual for a in names):
        raise ValueError(
            f"axis_name must name a mesh axis of the enclosing jax.shard_map, got "
            f"{axis_name!r} (axes bound here: {sorted(manual) or 'none: not inside shard_map'})"
            "; ring_attention runs on the local shards inside shard_map")
    return lax.axis_size(axis_name)


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis_name: str | tuple[str, ...],
    is_causal: bool = False,
    layout: Layout = "zigzag",
    scale: float | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    return_residual: bool = False,
    deterministic: bool = False,
    implementation: Implementation | None = None,
    interpret: bool = False,
    config: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact attention over a sequence split across the ``n`` devices of mesh axis
    ``axis_name``: call it inside ``jax.shard_map`` on the local shards.

    Equal to ``pallas_flash.attention`` on the whole (global) sequence, to rounding, for the
    local rows of the output: the K/V shards circulate round the ring (module docstring).
    Per device, memory is that of the local shards (a second K/V block in flight, float32
    dK/dV accumulators in the backward), never the global sequence.

    Args:
      query: local shard ``[batch, seq_q / n, heads, head_dim]``, in the order of
        ``layout`` (for ``"zigzag"``: the global array passed through :func:`to_zigzag`
        and split evenly over the axis).
      key, value: local shards ``[batch, seq_kv / n, kv_heads, head_dim]``; ``heads`` a
        multiple of ``kv_heads`` (GQA). ``"zigzag"`` needs ``seq_kv == seq_q`` and an even
        local length.
      axis_name: the mesh axis (or a tuple of axes) of the enclosing ``shard_map`` that the
        sequence is split over; its size is ``n``.
      is_causal: hide keys after the query's global position (top-left alignment).
      layout: ``"zigzag"`` (device ``i`` holds global chunks ``i`` and ``2n - 1 - i`` of
        ``2n``: equal causal work on every device) or ``"contiguous"`` (device ``i`` holds
        chunk ``i`` of ``n``).
      scale: logit scale, default ``1 / sqrt(head_dim)``.
      q_segment_ids: local ``[batch, seq_q / n]`` ids of packed documents (same order as
        ``query``); ``kv_segment_ids`` (local ``[batch, seq_kv / n]``) defaults to them
        when the lengths are equal. The K/V ids circulate with K/V.
      local_window_size: ``w`` or ``(left, right)`` on global positions, as ``attention``.
      logits_soft_cap: ``c > 0``: logits become ``c · tanh(logits / c)``.
      sinks: ``[heads]`` attention-sink logits (replicated over the axis); differentiable.
      return_residual: also return ``[batch, seq_q / n, heads]`` log-sum-exp of each row
        (in the input dtype, no gradient), as ``attention``.
      deterministic: bitwise-reproducible gradients, as ``attention`` (every step's
        backward kernels run their reproducible variant; the ring's own sums are in a
        fixed order).
      implementation: the backend of every step's kernels (``"mosaic"``, ``"triton"``,
        ``"xla"``); None picks as ``attention`` does, for each kernel call's shape.
      interpret: run Pallas kernels in interpret mode (CPU testing; Mosaic's interpreter
        supports one device only and is refused on a ring of several).
      config: a config of the chosen backend for every step (None: each call's
        heuristic for its shape).

    Returns:
      ``out`` shaped like ``query`` (the local rows), or ``(out, residual)``.

    Raises:
      ValueError: ``axis_name`` not bound by an enclosing ``shard_map``, an unknown
        ``layout``, local q and k/v lengths that the layout cannot pair, an odd local length
        under ``"zigzag"``, or any argument ``attention`` would refuse.
    """
    dispatch.check_arrays(query, key, value)
    return _attend(query, key, value, _axis_size(axis_name), axis_name=axis_name,
                   is_causal=is_causal, layout=layout, scale=scale,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                   sinks=sinks, return_residual=return_residual, deterministic=deterministic,
                   implementation=implementation, interpret=interpret, config=config)


def simulated_ring_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                             num_steps: int, axis_name: str, **kwargs
                             ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """For benchmarks on one device: every step of a ring of ``num_steps`` devices, as
    device 0 of that ring runs them, on a mesh axis ``axis_name`` of size 1.

    The shards are device 0's (``[batch, seq / num_steps, ...]`` of a sequence
    ``num_steps`` times longer), and each step's "incoming" block is the local one passed
    to itself with the same ``ppermute`` (a collective-permute from the device to
    itself), so the program is the ring's: the steps, the plan switch, the kernels, the
    merges. The result is not attention over any sequence (every step sees the same
    K/V); the time is that of ``num_steps`` ring steps. ``kwargs``: as
    :func:`ring_attention`.
    """
    dispatch.check_arrays(query, key, value)
    if _axis_size(axis_name) != 1:
        raise ValueError(f"simulated_ring_attention runs on a mesh axis of size 1, got "
                         f"axis {axis_name!r} of size {lax.axis_size(axis_name)}")
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    return _attend(query, key, value, num_steps, axis_name=axis_name, **kwargs)


def _attend(query, key, value, size: int, *, axis_name, is_causal=False, layout="zigzag",
            scale=None, q_segment_ids=None, kv_segment_ids=None, local_window_size=None,
            logits_soft_cap=None, sinks=None, return_residual=False, deterministic=False,
            implementation=None, interpret=False, config=None):
    """:func:`ring_attention` on a ring of ``size`` steps (checked arrays)."""
    # A bad name (or "cudnn": no lse) raises first.
    dispatch.check_implementation(implementation, interpret)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    batch, seq_q, heads, head_dim = query.shape
    seq_kv = key.shape[1]
    if min(seq_q, seq_kv) == 0:
        raise ValueError(f"the local sequences must be non-empty, got query length {seq_q} "
                         f"and key/value length {seq_kv}")
    if layout == "zigzag":
        if seq_q != seq_kv:
            raise ValueError(
                f"layout='zigzag' needs local query and key/value shards of equal length "
                f"(the same sequence, in chunks of equal size), got {seq_q} and {seq_kv}")
        if seq_q % 2:
            raise ValueError(
                f"layout='zigzag' needs an even local length (two chunks per device), got "
                f"{seq_q}")
    check_bools(interpret=interpret, return_residual=return_residual)
    is_causal = canonical_bool(is_causal, "is_causal")
    scale = canonical_scale(scale, head_dim)
    window = canonical_window(local_window_size)
    softcap = check_soft_cap(logits_soft_cap)
    sinks = check_sinks(sinks, heads)
    segment_ids = canonical_segments(q_segment_ids, kv_segment_ids, batch, seq_q, seq_kv)
    features = dispatch.Features(has_segments=segment_ids is not None, softcap=softcap)
    local_mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=is_causal, window=window)
    chosen = implementation or dispatch.choose(query.shape, key.shape, query.dtype,
                                               local_mask, features, interpret=interpret)
    devices = lax.axis_size(axis_name)  # the simulated ring's steps run on one
    if chosen == "mosaic" and interpret and devices > 1:
        raise ValueError(
            f"implementation='mosaic' with interpret=True runs on one device only, got a "
            f"ring of {devices} devices over axis {axis_name!r}: Mosaic GPU's interpreter does "
            "not support several devices in one process; use implementation='triton' or "
            "'xla' to test ring attention on the CPU")
    if config is not None:  # a config is one backend's: every call runs on it
        implementation = chosen
        config = resolve_config(config, implementation, query, key, value, local_mask,
                                interpret)
    chunks = 2 if layout == "zigzag" else 1
    global_mask = MaskSpec(seq_q=seq_q * size, seq_kv=seq_kv * size, is_causal=is_causal,
                           window=window)
    ring = _Ring(axis_name=axis_name, size=size, layout=layout, chunk_q=seq_q // chunks,
                 chunk_kv=seq_kv // chunks, is_causal=is_causal, window=window,
                 band=global_mask.band, scale=scale, softcap=softcap,
                 implementation=implementation, interpret=interpret, config=config,
                 deterministic=dispatch.deterministic_backward(
                     check_deterministic(deterministic)))
    q_ids, kv_ids = (None, None) if segment_ids is None else segment_ids
    out, lse = _ring_attention(query, key, value, q_ids, kv_ids, sinks, ring)
    if not return_residual:
        return out
    # As attention's residual: [B, T, N] in the input dtype, no gradient through it.
    return out, lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(out.dtype))

"""Block masks and user mask / score functions (the programming model of PyTorch's
FlexAttention), independent of any kernel.

The user's functions
--------------------
``mask_mod(batch, head, q_idx, kv_idx) -> bool`` (True: the pair is visible) and
``score_mod(score, batch, head, q_idx, kv_idx) -> score`` (float32 in and out) are written
as for scalars with ``jnp`` ops, and may close over JAX arrays (document ids ``[B, T]``,
ALiBi slopes ``[N]``, a relative-position table). :func:`convert_mask_mod` /
:func:`convert_score_mod` trace a function once on int32 / float32 scalars into a
:class:`ConvertedMod` and the arrays it captured (its *operands*): the converted function
takes them as explicit arguments, so a new value of a captured array is a new operand of
the same program (no retrace, no recompile, and gradients reach them through a
``custom_vjp``, which cannot see a closure). Calling a :class:`ConvertedMod` lifts the
scalar function elementwise over index arrays that broadcast (``q_idx [bq, 1]``,
``kv_idx [1, bk]``): each axis is a ``vmap`` that batches only the arguments that vary
along it, so ``ids[b, q_idx]`` is read once per row, not once per pair. Two conversions of
the same code with operands of the same types compare equal (the key is the printed
program), so a :class:`BlockMask` rebuilt from a fresh ``lambda`` for every batch still
hits ``jit``'s cache.

The block mask
--------------
For a tiling of ``S = Q·Kᵀ`` into ``block_size = (bq, bk)`` tiles, :class:`BlockMask`
lists, per (batch, head, query block), the key blocks that are *full* (every pair visible:
no mask is built) and those that are *partial* (some pairs visible: the mask is evaluated
on the tile); blocks in neither list are *empty* and never loaded. Like FlexAttention's
``kv_num_blocks`` / ``kv_indices`` / ``full_kv_num_blocks`` / ``full_kv_indices``, each
list is a count and an index array whose first ``count`` entries are the blocks in
ascending order; the transposed lists (``q_*``: per key block, its query blocks) drive the
dK/dV pass. Batch and head dims are 1 when the mask does not depend on them. The
definition every path implements (:func:`flex_reference` is its dense statement): a pair
is visible iff its tile is listed and (the tile is full or the mask function says so);
for masks built here the lists only skip work, and a hand-edited list (emptying a block)
changes the result as the kernels would.

How a kernel walks the lists (the plan for the Mosaic GPU and Triton kernels):

* forward and dQ: one program per (batch, head, query block) reads its two counts from
  SMEM (scalar prefetch / a scalar load) and walks the partial list (tile mask from the
  mask function and every other mask) then the full list (the unmasked fast loop);
  the producer loads ``K, V[kv_indices[j]]`` ahead of the consumers. Past a list's
  count the entries repeat its last block (0 for an empty list), so a pipeline that
  prefetches one block past the end reads a valid block and discards it. Softmax
  statistics do not depend on the order, so the two loops can run in either order;
  the per-row ``m``/``l`` merge is the same as for the band masks.
* dK/dV: one program per (batch, KV head, key block) walks ``q_indices`` then
  ``full_q_indices`` the same way; dQ reuses the forward's lists. Under GQA a KV head's
  program walks each of its query heads' lists in turn (the one list when ``N'`` is 1).
* counts vary per query block (causal: linear in the block index), so work tiles should
  run heaviest first, as the causal band's do (``mosaic/scheduler.py``), ordered by
  their counts; a query block with both counts 0 writes zeros and lse
  ``EMPTY_ROW_LSE`` without loading anything.

What Mosaic GPU can and cannot lower (checked against its lowering rules, not yet on
a GPU): elementwise integer and float arithmetic, comparisons, ``select_n``, ``min`` /
``max``, ``exp`` / ``log`` / ``tanh``, iota and broadcasts of row / column vectors
lower on WGMMA-layout tiles, so masks that are index arithmetic (causal, sliding windows,
prefix-LM against a per-batch scalar, ALiBi's ``slope[head]·(kv - q)`` with the slope
read as a scalar) can be evaluated on the tile from iotas. It has no rule for ``gather``
or ``dynamic_slice`` of a value, which is what reading a captured array at ``q_idx`` /
``kv_idx`` becomes (``ids[b, q_idx]``, ``table[bucket(kv - q)]``). A kernel therefore
interprets the converted jaxpr itself: an operand read at a scalar index (``slopes[h]``)
becomes a scalar load from the operand's ref; one indexed by ``q_idx`` (or ``kv_idx``)
alone plus scalars becomes a row (column) vector loaded with the tile, as segment ids are
(document masking is then as fast as segment ids); one indexed by both (a relative bucket
table) has no Mosaic lowering and goes to the Triton backend (whose ref loads take
integer-array indices, i.e. a pointer gather) or to the XLA path. ``mask_fn.uses_batch``
/ ``uses_head`` say which grid axes the lists need.

A dense boolean mask or an additive bias (-inf or very negative entries hidden) gets the
same skipping through :func:`block_mask_from_dense`, one reduction pass over the array;
its mask function looks the array up (a kernel loads the tile instead).

Order of operations (:func:`flex_reference`): ``s = scale·q·kᵀ``, the soft cap, ``+
bias`` (the package's order, as in ``pallas_flash.reference`` and every kernel), then
``score_mod``, then every mask ANDed (band, segment ids, row bounds, ``mask``,
``mask_mod``, the block mask). A row that sees nothing gives zeros and lse
:data:`~pallas_flash.contract.EMPTY_ROW_LSE`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from pallas_flash.arguments import canonical_scale, check_positive_int, check_soft_cap
from pallas_flash.bias import canonical, canonical_mask
from pallas_flash.contract import DTYPES, EMPTY_ROW_LSE, RowBounds
from pallas_flash.masking import MaskSpec, segments_visible

#: The arguments of each kind of user function, in order.
MOD_ARGUMENTS = {
    "mask_mod": ("batch", "head", "q_idx", "kv_idx"),
    "score_mod": ("score", "batch", "head", "q_idx", "kv_idx"),
}
_RESULT_DTYPES = {"mask_mod": jnp.dtype(jnp.bool_), "score_mod": jnp.dtype(jnp.float32)}

# Pairs of (query, key) evaluated at once by create_block_mask (a strip of query blocks
# against every key): bounds its live memory (a few bytes a pair) whatever the lengths.
_STRIP_PAIRS = 1 << 22


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertedMod:
    """A user ``mask_mod`` / ``score_mod`` traced on scalars, its captured arrays hoisted
    into explicit operands (:func:`convert_mask_mod`, :func:`convert_score_mod`).

    Call it as ``mod(*args, *operands)`` with the user function's arguments (int32 index
    arrays, and for a score_mod the float32 scores first) that broadcast against each
    other; it returns their broadcast shape, bool (mask_mod) or float32 (score_mod).
    Hashable, and equal to another conversion of the same program: a static argument
    and pytree metadata.

    Attributes:
      kind: ``"mask_mod"`` or ``"score_mod"``.
      jaxpr: the program; its constvars are the operands, its invars the arguments.
      key: the printed program (what equality and the hash compare).
      uses_batch, uses_head: whether the result depends on the batch / head argument.
    """

    kind: str
    jaxpr: jex_core.Jaxpr
    key: str
    uses_batch: bool
    uses_head: bool

    def __eq__(self, other) -> bool:
        return isinstance(other, ConvertedMod) and (self.kind, self.key) == (other.kind,
                                                                               other.key)

    def __hash__(self) -> int:
        return hash((self.kind, self.key))

    @property
    def num_operands(self) -> int:
        """How many captured arrays the call takes after the arguments."""
        return len(self.jaxpr.constvars)

    def __call__(self, *args) -> jax.Array:
        arity = len(MOD_ARGUMENTS[self.kind])
        if len(args) != arity + self.num_operands:
            raise ValueError(
                f"this {self.kind} takes {arity} arguments and {self.num_operands} operands, "
                f"got {len(args)} values")
        indices, operands = args[:arity], args[arity:]
        if self.kind == "score_mod":
            indices = (jnp.asarray(indices[0], jnp.float32),
                       *(jnp.asarray(i, jnp.int32) for i in indices[1:]))
        else:
            indices = tuple(jnp.asarray(i, jnp.int32) for i in indices)

        def scalar(*xs):
            return jnp.asarray(jax.core.eval_jaxpr(self.jaxpr, operands, *xs)[0])

        return _elementwise(scalar, indices)


def _elementwise(fn: Callable, args: tuple[jax.Array, ...]) -> jax.Array:
    """``fn`` (scalars -> scalar) over ``args`` that broadcast: one ``vmap`` per axis of the
    broadcast shape, batching only the arguments that vary along it (a gather indexed by
    ``q_idx [T, 1]`` alone runs T times, not T·S)."""
    rank = max(a.ndim for a in args)
    args = tuple(a.reshape((1,) * (rank - a.ndim) + a.shape) for a in args)
    jnp.broadcast_shapes(*(a.shape for a in args))  # raises on shapes that do not broadcast

    def lift(*xs):
        if not xs[0].ndim:
            return fn(*xs)
        axes = tuple(0 if x.shape[0] > 1 else None for x in xs)
        rest = tuple(x if axis == 0 else x[0] for x, axis in zip(xs, axes, strict=True))
        if all(axis is None for axis in axes):
            return lift(*rest)[None]
        return jax.vmap(lift, in_axes=axes)(*rest)

    return lift(*args)


def _live_inputs(jaxpr: jex_core.Jaxpr) -> tuple[bool, ...]:
    """For each invar of ``jaxpr``, whether an output depends on it (an equation with a
    live output makes all its inputs live; sub-programs count as one equation)."""
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return tuple(v in live for v in jaxpr.invars)


def _convert(fn, kind: str) -> tuple[ConvertedMod, tuple[jax.Array, ...]]:
    """``fn`` traced on scalars into a :class:`ConvertedMod` and its operands; ValueError
    naming ``kind`` for a non-callable, a wrong arity or a result that is not one scalar
    of the kind's dtype."""
    params = MOD_ARGUMENTS[kind]
    want = _RESULT_DTYPES[kind]
    if not callable(fn):
        raise ValueError(f"{kind} must be a callable {kind}({', '.join(params)}), got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have none
        signature = None
    if signature is not None:
        try:
            signature.bind(*params)
        except TypeError:
            raise ValueError(
                f"{kind} must take {len(params)} positional arguments ({', '.join(params)}), "
                f"got a callable with signature {signature}") from None
    example = [jax.ShapeDtypeStruct((), jnp.float32 if p == "score" else jnp.int32)
               for p in params]
    closed, result = jax.make_jaxpr(fn, return_shape=True)(*example)
    if not isinstance(result, jax.ShapeDtypeStruct) or result.shape != ():
        shape = getattr(result, "shape", jax.tree.structure(result))
        raise ValueError(
            f"{kind} must return one scalar per scalar ({', '.join(params)}) (write it as "
            f"for scalars; it is lifted over index arrays), got {shape}")
    if jnp.dtype(result.dtype) != want:
        raise ValueError(f"{kind} must return {want}, got {jnp.dtype(result.dtype)}")
    live = dict(zip(params, _live_inputs(closed.jaxpr), strict=True))
    mod = ConvertedMod(kind=kind, jaxpr=closed.jaxpr, key=str(closed.jaxpr),
                       uses_batch=live["batch"], uses_head=live["head"])
    return mod, tuple(jnp.asarray(c) for c in closed.consts)


def convert_mask_mod(mask_mod) -> tuple[ConvertedMod, tuple[jax.Array, ...]]:
    """``mask_mod(batch, head, q_idx, kv_idx) -> bool`` as ``(mod, operands)``:
    ``mod(batch, head, q_idx, kv_idx, *operands)`` computes it with the captured arrays
    passed explicitly (:class:`ConvertedMod`). Works under ``jit`` and ``grad`` (traced
    captured arrays become traced operands). Raises ValueError naming ``mask_mod``."""
    return _convert(mask_mod, "mask_mod")


def convert_score_mod(score_mod) -> tuple[ConvertedMod, tuple[jax.Array, ...]]:
    """``score_mod(score, batch, head, q_idx, kv_idx) -> score`` (float32) as ``(mod,
    operands)``, as :func:`convert_mask_mod` does. Raises ValueError naming
    ``score_mod``."""
    return _convert(score_mod, "score_mod")


def _block_size(block_size) -> tuple[int, int]:
    """``block_size`` (an int or a ``(bq, bk)`` pair of positive ints) as a pair."""
    pair = (block_size, block_size) if not isinstance(block_size, (tuple, list)) \
        else block_size
    if len(pair) != 2:
        raise ValueError(f"block_size must be a positive int or a (block_q, block_kv) pair of "
                         f"them, got {block_size!r}")
    return (check_positive_int(pair[0], "block_size"),
            check_positive_int(pair[1], "block_size"))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
                 "mask_operands"],
    meta_fields=["mask_fn", "seq_q", "seq_kv", "block_size"])
@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """Which tiles of ``S = Q·Kᵀ`` are full, partial or empty, in the order kernels walk
    them, and the mask function for the partial ones (a pytree: the lists and the mask's
    operands are its leaves). Built by :func:`create_block_mask` or
    :func:`block_mask_from_dense`; the module docstring says how kernels use it.

    ``B'`` is 1 (the mask is the same for every sequence) or the batch, ``N'`` 1 or the
    number of query heads; ``nq = ceil(seq_q / bq)``, ``nk = ceil(seq_kv / bk)``. In each
    list the first ``count`` entries are block indices in ascending order and the rest
    repeat the last of them (0 when the count is 0).

    Attributes:
      kv_num_blocks: int32 ``[B', N', nq]``: per query block, how many partial key blocks.
      kv_indices: int32 ``[B', N', nq, nk]``: those key blocks.
      full_kv_num_blocks: int32 ``[B', N', nq]``: per query block, how many full key blocks.
      full_kv_indices: int32 ``[B', N', nq, nk]``: those key blocks.
      q_num_blocks, q_indices: int32 ``[B', N', nk]``, ``[B', N', nk, nq]``: per key block,
        its partial query blocks (the dK/dV pass).
      full_q_num_blocks, full_q_indices: likewise, its full query blocks.
      mask_operands: the arrays ``mask_fn`` captured (document ids, a dense mask, ...).
      mask_fn: the converted mask function (static).
      seq_q, seq_kv: the lengths it was built for (static).
      block_size: ``(bq, bk)`` (static).
    """

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    q_num_blocks: jax.Array
    q_indices: jax.Array
    full_q_num_blocks: jax.Array
    full_q_indices: jax.Array
    mask_operands: tuple[jax.Array, ...]
    mask_fn: ConvertedMod
    seq_q: int
    seq_kv: int
    block_size: tuple[int, int]

    @property
    def batch(self) -> int:
        """``B'``: 1 (broadcast over the batch) or the batch it was built for."""
        return self.kv_num_blocks.shape[0]

    @property
    def heads(self) -> int:
        """``N'``: 1 (broadcast over heads) or the number of query heads."""
        return self.kv_num_blocks.shape[1]

    def mask_mod(self, batch, head, q_idx, kv_idx) -> jax.Array:
        """The mask function on index arrays that broadcast: bool, their broadcast shape."""
        return self.mask_fn(batch, head, q_idx, kv_idx, *self.mask_operands)

    def block_classes(self) -> tuple[jax.Array, jax.Array]:
        """``(partial, full)``: bool ``[B', N', nq, nk]``, which tiles each list holds."""
        nk = self.kv_indices.shape[-1]
        blocks = jnp.arange(nk, dtype=jnp.int32)

        def listed(counts, indices):
            valid = blocks < counts[..., None]                              # [.., nq, nk]
            hit = (indices[..., None] == blocks) & valid[..., None]         # [.., nq, nk, nk]
            return jnp.any(hit, axis=-2)

        return (listed(self.kv_num_blocks, self.kv_indices),
                listed(self.full_kv_num_blocks, self.full_kv_indices))

    def check(self, *, batch: int, heads: int, seq_q: int, seq_kv: int,
              block_size: tuple[int, int] | None = None) -> None:
        """Raise ValueError naming ``block_mask`` unless it fits a call with these sizes
        (``batch`` and ``heads`` of the queries; ``block_size``: the kernel's tiles, when
        it must use the mask's)."""
        if (self.seq_q, self.seq_kv) != (seq_q, seq_kv):
            raise ValueError(
                f"block_mask was built for seq_q={self.seq_q}, seq_kv={self.seq_kv}, but the "
                f"call has seq_q={seq_q}, seq_kv={seq_kv}: build it for these lengths")
        if block_size is not None and tuple(block_size) != self.block_size:
            raise ValueError(f"block_mask has block_size={self.block_size}, but the kernel "
                             f"tiles by {tuple(block_size)}")
        for name, built, call in (("batch", self.batch, batch), ("heads", self.heads, heads)):
            if built not in (1, call):
                raise ValueError(f"block_mask was built for {name}={built}, which does not "
                                 f"broadcast to the call's {name}={call} (build it for "
                                 f"{name}={call}, or {name}=None if it does not depend on it)")


def _ordered(flags: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``flags [..., rows, cols]`` bool -> ``(counts [..., rows], indices [..., rows,
    cols])`` int32: per row the set columns in ascending order, the tail repeating the
    last of them (0 for an empty row)."""
    counts = jnp.sum(flags, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~flags, axis=-1, stable=True).astype(jnp.int32)  # set ones first
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    last = jnp.where(counts[..., None] > 0, last, 0)
    position = jnp.arange(flags.shape[-1], dtype=jnp.int32)
    return counts, jnp.where(position < counts[..., None], order, last)


def _lists(any_visible: jax.Array, all_visible: jax.Array) -> tuple[jax.Array, ...]:
    """The eight lists of a :class:`BlockMask` (its fields' order) from per-tile flags
    ``[B', N', nq, nk]``: some / every real pair of the tile visible (``all_visible``
    already False for a tile with padded keys)."""
    full = all_visible
    partial = any_visible & ~all_visible
    return (*_ordered(partial), *_ordered(full), *_ordered(jnp.swapaxes(partial, -1, -2)),
            *_ordered(jnp.swapaxes(full, -1, -2)))


def _tile_flags(any_pairs: jax.Array, all_pairs: jax.Array, rows: int, cols: int):
    """``[B', N', R, C]`` pair flags -> per ``rows × cols`` tile: any of ``any_pairs``, all
    of ``all_pairs`` (``[B', N', R / rows, C / cols]``)."""
    b, n, r, c = any_pairs.shape
    shape = (b, n, r // rows, rows, c // cols, cols)
    return (jnp.any(any_pairs.reshape(shape), axis=(3, 5)),
            jnp.all(all_pairs.reshape(shape), axis=(3, 5)))


def _no_padded_keys(seq_kv: int, bk: int) -> jax.Array:
    """``[nk]``: whether key block ``j`` holds only real keys (a tile with a padded key is
    never full: the kernel must mask the padding)."""
    nk = -(-seq_kv // bk)
    return (jnp.arange(nk) + 1) * bk <= seq_kv


@functools.partial(jax.jit, static_argnames=("mask_fn", "batch", "heads", "seq_q", "seq_kv",
                                             "block_size"))
def _mod_lists(operands, *, mask_fn: ConvertedMod, batch: int, heads: int, seq_q: int,
               seq_kv: int, block_size: tuple[int, int]) -> tuple[jax.Array, ...]:
    """create_block_mask's work: the mask function over strips of query blocks."""
    bq, bk = block_size
    nq, nk = -(-seq_q // bq), -(-seq_kv // bk)
    # Positions past the lengths (the last blocks' padding) are evaluated too, and their
    # results ignored: a gather past an array's end is safe in JAX.
    keys = jnp.arange(nk * bk, dtype=jnp.int32)
    key_real = keys < seq_kv
    b_idx = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
    h_idx = jnp.arange(heads, dtype=jnp.int32).reshape(1, -1, 1, 1)
    blocks_per_strip = max(1, min(nq, _STRIP_PAIRS // (batch * heads * bq * nk * bk)))
    strips = -(-nq // blocks_per_strip)

    def strip(first_block):
        rows = first_block * bq + jnp.arange(blocks_per_strip * bq, dtype=jnp.int32)
        row_real = (rows < seq_q)[:, None]
        visible = mask_fn(b_idx, h_idx, rows.reshape(1, 1, -1, 1), keys.reshape(1, 1, 1, -1),
                          *operands)
        visible = jnp.broadcast_to(visible, (batch, heads, rows.shape[0], keys.shape[0]))
        # Padded rows are no one's output: they neither make a tile partial nor keep it
        # from being full. Padded keys are never visible.
        return _tile_flags(visible & row_real & key_real, (visible | ~row_real) & key_real,
                           bq, bk)

    starts = jnp.arange(strips, dtype=jnp.int32) * blocks_per_strip
    any_visible, all_visible = lax.map(strip, starts)       # [strips, B', N', per strip, nk]

    def merge(x):
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(batch, heads, strips * blocks_per_strip, nk)[:, :, :nq]

    return _lists(merge(any_visible), merge(all_visible))


def create_block_mask(mask_mod: Callable, *, batch: int | None = None,
                      heads: int | None = None, seq_q: int, seq_kv: int,
                      block_size: int | tuple[int, int] = (128, 128)) -> BlockMask:
    """The :class:`BlockMask` of ``mask_mod(batch, head, q_idx, kv_idx) -> bool``.

    ``mask_mod`` is written as for scalars with ``jnp`` ops (True: visible) and may close
    over JAX arrays, which become the mask's operands (:func:`convert_mask_mod`): this
    works under ``jit`` with traced captured arrays, and a new value compiles nothing.
    The function is evaluated over strips of query blocks against every key, never on
    the whole ``[B, N, T, S]`` at once: O(B'·N'·T·S) cheap elementwise work with a
    bounded footprint, far below one attention call's O(B·N·T·S·D).

    Args:
      mask_mod: the mask function.
      batch: the batch size it is built for, or None when it does not depend on its batch
        argument (evaluated with batch 0; a mask_mod that reads it is refused).
      heads: the number of query heads, or None likewise.
      seq_q, seq_kv: the query and key lengths (positive ints).
      block_size: ``(bq, bk)``, or one int for both: the kernels' tile.

    Returns:
      The BlockMask, of batch dim ``batch or 1`` and head dim ``heads or 1``.
    """
    mask_fn, operands = convert_mask_mod(mask_mod)
    seq_q, seq_kv = check_positive_int(seq_q, "seq_q"), check_positive_int(seq_kv, "seq_kv")
    block_size = _block_size(block_size)
    sizes = {}
    for name, size, uses in (("batch", batch, mask_fn.uses_batch),
                             ("heads", heads, mask_fn.uses_head)):
        if size is None and uses:
            raise ValueError(
                f"mask_mod reads its {'batch' if name == 'batch' else 'head'} argument, so "
                f"create_block_mask needs {name}= (None broadcasts the mask over it)")
        sizes[name] = 1 if size is None else check_positive_int(size, name)
    lists = _mod_lists(operands, mask_fn=mask_fn, batch=sizes["batch"], heads=sizes["heads"],
                       seq_q=seq_q, seq_kv=seq_kv, block_size=block_size)
    return BlockMask(*lists, mask_operands=operands, mask_fn=mask_fn, seq_q=seq_q,
                     seq_kv=seq_kv, block_size=block_size)


def default_hidden_threshold(dtype) -> float:
    """The bias value at or below which :func:`block_mask_from_dense` hides a pair: -1e9,
    or half the dtype's lowest value when that is higher (float16's ``-65504``, the usual
    'minus infinity' there, is hidden; no real logit offset comes near either)."""
    return max(-1e9, float(jnp.finfo(dtype).min) / 2)


def _shown(value: jax.Array, threshold: float | None) -> jax.Array:
    """Which entries of a dense mask (``threshold`` None: nonzero) or bias (above
    ``threshold``; NaN stays visible, as it computes) show their pair."""
    if threshold is None:
        return value if value.dtype == jnp.bool_ else value != 0
    return ~(value.astype(jnp.float32) <= threshold)


@functools.partial(jax.jit, static_argnames=("seq_q", "seq_kv", "block_size", "threshold"))
def _dense_lists(x, *, seq_q: int, seq_kv: int, block_size: tuple[int, int],
                 threshold: float | None) -> tuple[jax.Array, ...]:
    """block_mask_from_dense's work on a canonical ``[B', N', T', S']`` array."""
    bq, bk = block_size
    nq, nk = -(-seq_q // bq), -(-seq_kv // bk)
    b, n, t, s = x.shape
    any_pairs = all_pairs = _shown(x, threshold)
    rows = cols = 1  # a broadcast dim is one row (column) shared by every tile
    if t > 1:  # padded rows: no one's output (as in create_block_mask)
        rows, pad = bq, ((0, 0), (0, 0), (0, nq * bq - t), (0, 0))
        any_pairs = jnp.pad(any_pairs, pad, constant_values=False)
        all_pairs = jnp.pad(all_pairs, pad, constant_values=True)
    if s > 1:  # padded keys: never visible
        cols, pad = bk, ((0, 0), (0, 0), (0, 0), (0, nk * bk - s))
        any_pairs = jnp.pad(any_pairs, pad, constant_values=False)
        all_pairs = jnp.pad(all_pairs, pad, constant_values=False)
    any_visible, all_visible = _tile_flags(any_pairs, all_pairs, rows, cols)
    shape = (b, n, nq, nk)
    any_visible = jnp.broadcast_to(any_visible, shape)
    all_visible = jnp.broadcast_to(all_visible, shape) & _no_padded_keys(seq_kv, bk)
    return _lists(any_visible, all_visible)


def block_mask_from_dense(mask_or_bias, block_size: int | tuple[int, int] = (128, 128), *,
                          seq_q: int | None = None, seq_kv: int | None = None,
                          hidden_at_or_below: float | None = None) -> BlockMask:
    """The :class:`BlockMask` of a dense mask or additive bias, in one pass over it.

    Args:
      mask_or_bias: broadcastable to ``[batch, heads, seq_q, seq_kv]`` (rank <= 4, leading
        dims added as in ``jax.nn``; each dim 1 or full). Boolean or integer: nonzero is
        visible. Floating (an additive bias): a pair is hidden when its entry is -inf or
        ``<= hidden_at_or_below``; a row whose entries are all hidden then gives zeros and
        lse ``EMPTY_ROW_LSE``, not a softmax over very negative logits.
      block_size: ``(bq, bk)``, or one int for both.
      seq_q, seq_kv: the lengths, needed only when the array broadcasts along that dim
        (default: the array's dim).
      hidden_at_or_below: floating arrays only; default
        :func:`default_hidden_threshold` of its dtype.

    Returns:
      The BlockMask, batch and head dims those of the array; its mask function looks the
      array (its operand, in rank-4 form) up.
    """
    shape = getattr(mask_or_bias, "shape", None)
    dtype = getattr(mask_or_bias, "dtype", None)
    if shape is None or len(shape) > 4 or dtype is None or 0 in shape:
        raise ValueError(f"mask_or_bias must be a non-empty array of rank <= 4, got "
                         f"{type(mask_or_bias).__name__} of shape {shape}")
    floating = jnp.issubdtype(dtype, jnp.floating)
    if not (floating or dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer)):
        raise ValueError(f"mask_or_bias must be boolean, integer or floating, got {dtype}")
    if hidden_at_or_below is not None and not floating:
        raise ValueError("hidden_at_or_below applies to a floating bias only, got a "
                         f"{dtype} mask")
    shape = (1,) * (4 - len(shape)) + tuple(shape)
    lengths = {}
    for name, given, dim in (("seq_q", seq_q, shape[2]), ("seq_kv", seq_kv, shape[3])):
        length = dim if given is None else check_positive_int(given, name)
        if dim not in (1, length):
            raise ValueError(f"mask_or_bias shape {tuple(mask_or_bias.shape)} does not "
                             f"broadcast to {name}={length}")
        lengths[name] = length
    threshold = None
    if floating:
        threshold = (default_hidden_threshold(dtype) if hidden_at_or_below is None
                     else float(hidden_at_or_below))
        if math.isnan(threshold):
            raise ValueError("hidden_at_or_below must be a number, got nan")
    block_size = _block_size(block_size)
    x = jnp.asarray(mask_or_bias).reshape(shape)
    b, n, t, s = shape

    def lookup(batch, head, q_idx, kv_idx):
        # A broadcast dim is read at 0 (the function is then independent of that index).
        return _shown(x[batch if b > 1 else 0, head if n > 1 else 0, q_idx if t > 1 else 0,
                        kv_idx if s > 1 else 0], threshold)

    mask_fn, operands = convert_mask_mod(lookup)
    lists = _dense_lists(x, **lengths, block_size=block_size, threshold=threshold)
    return BlockMask(*lists, mask_operands=operands, mask_fn=mask_fn, **lengths,
                     block_size=block_size)


def _check_inputs(q, k, v) -> None:
    """q: [B, T, N, D], k/v: [B, S, K, D] of one dtype of ``DTYPES``, N a multiple of K."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have rank 4 ([batch, seq, heads, head_dim]), got "
                             f"shape {getattr(x, 'shape', None)}")
        if jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{name} dtype must be one of {[str(d) for d in DTYPES]}, got "
                             f"{x.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k must be [batch, seq_kv, kv_heads, head_dim] with q's batch and "
                         f"head_dim, got q {q.shape}, k {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]})")


def _check_masks(mask_spec, segment_ids, bounds, batch: int, seq_q: int, seq_kv: int):
    """The band, segment ids and row bounds of :func:`flex_reference`, checked."""
    if mask_spec is None:
        mask_spec = MaskSpec(seq_q=seq_q, seq_kv=seq_kv)
    if not isinstance(mask_spec, MaskSpec) or (mask_spec.seq_q, mask_spec.seq_kv) != (
            seq_q, seq_kv):
        raise ValueError(f"mask_spec must be a MaskSpec with seq_q={seq_q}, seq_kv={seq_kv}, "
                         f"got {mask_spec!r}")
    if segment_ids is not None:
        if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
            raise ValueError("segment_ids must be (q_segment_ids [batch, seq_q], "
                             f"kv_segment_ids [batch, seq_kv]), got {segment_ids!r}")
        for ids, seq in zip(segment_ids, (seq_q, seq_kv), strict=True):
            if getattr(ids, "shape", None) != (batch, seq) or not jnp.issubdtype(
                    ids.dtype, jnp.integer):
                raise ValueError(f"segment_ids must be integer arrays [batch, seq] = "
                                 f"{(batch, seq)}, got shape {getattr(ids, 'shape', None)}")
    if bounds is not None:
        if not isinstance(bounds, RowBounds) or any(
                getattr(x, "shape", None) != (batch,) or not jnp.issubdtype(x.dtype,
                                                                            jnp.integer)
                for x in bounds):
            raise ValueError(f"bounds must be a RowBounds of integer [batch] = {(batch,)} "
                             f"arrays, got {bounds!r}")
    return mask_spec


def flex_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                   score_mod: Callable | None = None, mask_mod: Callable | None = None,
                   block_mask: BlockMask | None = None, scale: float | None = None,
                   bias: jax.Array | None = None, mask: jax.Array | None = None,
                   softcap: float | None = None, mask_spec: MaskSpec | None = None,
                   segment_ids: tuple[jax.Array, jax.Array] | None = None,
                   bounds: RowBounds | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention with user score and mask functions, evaluated densely in XLA (the
    definition the kernels implement; gradients by JAX, to every input and every array
    the functions capture).

    Logits ``s = scale · q·kᵀ`` (float32), then ``softcap · tanh(s / softcap)``, then ``+
    bias``, then ``score_mod``; a pair is visible iff every mask shows it: ``mask_spec``'s
    band, equal segment ids, ``bounds``, ``mask``, ``mask_mod`` and ``block_mask`` (its
    tile listed, and full or its mask function true).

    Args:
      q: ``[batch, seq_q, heads, head_dim]``.
      k, v: ``[batch, seq_kv, kv_heads, head_dim]``, same dtype (bfloat16, float16 or
        float32); ``heads`` a multiple of ``kv_heads`` (GQA: a head's ``head`` argument is
        its query head).
      score_mod: ``score_mod(score, batch, head, q_idx, kv_idx) -> score``, or None.
      mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool``, or None.
      block_mask: a :class:`BlockMask` built for these lengths, or None.
      scale: the logit scale (default ``1 / sqrt(head_dim)``).
      bias: floating, broadcastable to ``[batch, heads, seq_q, seq_kv]``, or None.
      mask: boolean or integer (nonzero visible), broadcastable likewise, or None.
      softcap: a positive cap, or None.
      mask_spec: the causal / window band (a :class:`MaskSpec` of these lengths), or None.
      segment_ids: ``(q_ids [batch, seq_q], kv_ids [batch, seq_kv])`` integer, or None.
      bounds: a :class:`~pallas_flash.contract.RowBounds`, or None.

    Returns:
      ``(out [batch, seq_q, heads, head_dim]`` in q's dtype, ``lse [batch, heads, seq_q]``
      float32, natural log); a row that sees no key gives zeros and ``EMPTY_ROW_LSE``.
    """
    _check_inputs(q, k, v)
    batch, seq_q, heads, head_dim = q.shape
    seq_kv = k.shape[1]
    logits_shape = (batch, heads, seq_q, seq_kv)
    scale = canonical_scale(scale, head_dim)
    try:
        softcap = check_soft_cap(softcap)
    except ValueError:
        raise ValueError(f"softcap must be a positive finite number, got {softcap!r}") from None
    if bias is not None:
        bias = canonical(bias, "bias", logits_shape)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"bias must be floating, got {bias.dtype}")
    mask = canonical_mask(mask, logits_shape)
    mask_spec = _check_masks(mask_spec, segment_ids, bounds, batch, seq_q, seq_kv)
    score_fn = None if score_mod is None else convert_score_mod(score_mod)
    mask_fn = None if mask_mod is None else convert_mask_mod(mask_mod)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise ValueError(f"block_mask must be a BlockMask, got {type(block_mask)}")
        block_mask.check(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv)

    def indices(size_b: int, size_h: int):
        return (jnp.arange(size_b).reshape(-1, 1, 1, 1), jnp.arange(size_h).reshape(1, -1, 1, 1),
                jnp.arange(seq_q).reshape(1, 1, -1, 1), jnp.arange(seq_kv).reshape(1, 1, 1, -1))

    group = heads // k.shape[2]
    k_rep, v_rep = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("bqnd,bknd->bnqk", q, k_rep, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if score_fn is not None:
        s = score_fn[0](s, *indices(batch, heads), *score_fn[1])

    visible = mask_spec.block_visible(0, seq_q, 0, seq_kv)[None, None]
    if segment_ids is not None:
        visible = visible & segments_visible(*segment_ids)[:, None]
    if bounds is not None:
        _, _, q_idx, kv_idx = indices(1, 1)
        q_end, kv_start, kv_end = (x.reshape(-1, 1, 1, 1) for x in bounds)
        visible = visible & (q_idx < q_end) & (kv_start <= kv_idx) & (kv_idx < kv_end)
    if mask is not None:
        visible = visible & mask
    if mask_fn is not None:
        visible = visible & mask_fn[0](*indices(1 if not mask_fn[0].uses_batch else batch,
                                                1 if not mask_fn[0].uses_head else heads),
                                       *mask_fn[1])
    if block_mask is not None:
        bq, bk = block_mask.block_size

        def tiles_to_pairs(x):
            return jnp.repeat(jnp.repeat(x, bq, axis=2), bk, axis=3)[:, :, :seq_q, :seq_kv]

        partial, full = block_mask.block_classes()
        shown = block_mask.mask_mod(*indices(block_mask.batch, block_mask.heads))
        visible = visible & tiles_to_pairs(partial | full) & (tiles_to_pairs(full) | shown)
    visible = jnp.broadcast_to(visible, logits_shape)

    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # an empty row: p = exp(-inf) = 0, not NaN
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bnqk,bknd->bqnd", p / jnp.where(l == 0, 1.0, l),
                     v_rep.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    l = l[..., 0]
    lse = jnp.where(l == 0, EMPTY_ROW_LSE, m[..., 0] + jnp.log(jnp.where(l == 0, 1.0, l)))
    return out.astype(q.dtype), lse


#: The tiles of a block mask that :func:`pallas_flash.attention` builds from a ``mask_mod``
#: for the Triton flex kernels (their tiles are the block mask's).
DEFAULT_BLOCK_SIZE = (128, 64)


@dataclasses.dataclass(frozen=True, eq=False)
class FlexFunctions:
    """The user-programmed part of one attention call, checked: ``score_mod`` and
    ``mask_mod`` (callables or None) and ``block_mask`` (a :class:`BlockMask` built for the
    call's lengths, or None); at least one is set."""

    score_mod: Callable | None
    mask_mod: Callable | None
    block_mask: BlockMask | None
    #: ``convert_score_mod(score_mod)`` / ``convert_mask_mod(mask_mod)``, or None: the
    #: conversion that checked them, kept for the kernels.
    score_converted: tuple[ConvertedMod, tuple[jax.Array, ...]] | None = None
    mask_converted: tuple[ConvertedMod, tuple[jax.Array, ...]] | None = None

    def kernel_block_mask(self, *, batch: int, heads: int, seq_q: int, seq_kv: int
                          ) -> BlockMask | None:
        """The one block mask a kernel walks for these functions: the call's, or one built
        from ``mask_mod`` (:data:`DEFAULT_BLOCK_SIZE` tiles), or every tile full when
        neither is given; None when the call gives both a block mask and a different
        ``mask_mod`` (the two masks ANDed: no single list says that)."""
        if self.block_mask is not None:
            if self.mask_mod is None or self.mask_converted[0] == self.block_mask.mask_fn:
                return self.block_mask
            return None
        mask_mod = self.mask_mod if self.mask_mod is not None else _everything
        mask_fn = (self.mask_converted or convert_mask_mod(mask_mod))[0]
        return create_block_mask(
            mask_mod, batch=batch if mask_fn.uses_batch else None,
            heads=heads if mask_fn.uses_head else None, seq_q=seq_q, seq_kv=seq_kv,
            block_size=DEFAULT_BLOCK_SIZE)


def _everything(batch, head, q_idx, kv_idx):
    """The mask function of a call with a ``score_mod`` alone: every pair visible."""
    del batch, head, kv_idx
    return q_idx >= 0


def flex_functions(score_mod, mask_mod, block_mask, *, batch: int, heads: int, seq_q: int,
                   seq_kv: int) -> FlexFunctions | None:
    """``attention``'s ``score_mod``, ``mask_mod`` and ``block_mask``, checked against a
    call ``q: [batch, seq_q, heads, ...]``, ``k: [batch, seq_kv, ...]`` (None when none
    is given).

    Raises:
      ValueError: naming the argument that is not a callable / a fitting BlockMask.
    """
    if score_mod is None and mask_mod is None and block_mask is None:
        return None
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function or None, got {fn!r}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise ValueError("block_mask must be a pallas_flash.BlockMask (from "
                             f"create_block_mask) or None, got {type(block_mask).__name__}")
        block_mask.check(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv)
    # The conversions check the functions' arity and results before any kernel traces them.
    return FlexFunctions(
        score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
        score_converted=None if score_mod is None else convert_score_mod(score_mod),
        mask_converted=None if mask_mod is None else convert_mask_mod(mask_mod))

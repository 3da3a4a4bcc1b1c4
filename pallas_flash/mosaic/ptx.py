"""Below Pallas: the FlashAttention-3 controls that Pallas Mosaic GPU (jax 0.11.2) lacks,
each a small ``plgpu.inline_mgpu`` function around one line of inline PTX.

**Named barriers** (:func:`bar_sync`, :func:`bar_arrive`). FA3 hands turns between its two
consumer warpgroups (the ping-pong of Fig. 1: one warpgroup's softmax under the other's
GEMMs) and hands buffers from consumers back to the producer with ``bar.sync id, n`` /
``bar.arrive id, n``: a hardware barrier that completes once ``n`` threads have arrived,
with no phase to track and no SMEM word. plgpu only has mbarriers. Mosaic GPU itself
takes hardware barrier 0 (``gpu.barrier()``: the whole CTA, at kernel start and around
the profiler) and ``1 + w`` for warpgroup ``w`` (``mosaic.gpu.utils.warpgroup_barrier_idx``:
``commit_smem``, ``wait_smem_to_gmem``, the warpgroup-wide ``bar.red`` of mbarrier
waits). With ``W`` warpgroups it uses ids ``0 .. W``, so ``1 + W`` (:func:`first_free_barrier_id`)
is the first one free, and a CTA has 16 (ids up to 15). Cost: one instruction, no SMEM
word and no phase to track (an mbarrier wait is a polling loop plus a warpgroup
``bar.red``); ``bar.arrive`` does not block, ``bar.sync`` blocks until the count is
reached. Both are convergent: every thread of a warp must execute them together.

**Non-tensor bulk reduce-add** (:func:`bulk_reduce_add`). FA3's backward adds each
consumer's float32 dQ contribution into a dQ accumulator in GMEM with
``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: one contiguous run of
bytes, no tensor map, no tiling or swizzle, so the SMEM staging buffer can be in register
order (below). plgpu's ``copy_smem_to_gmem(..., reduction_op="add")`` is the *tensor*
form, which needs a tiled SMEM image of a GMEM box. One elected thread of the warpgroup
issues it; its completion uses the same bulk-async groups as TMA stores, so
``plgpu.commit_smem_to_gmem_group()`` and ``plgpu.wait_smem_to_gmem(n,
wait_read_only=True)`` commit and await it (``cp.async.bulk.commit_group`` /
``cp.async.bulk.wait_group.read n``). Cost: one instruction per tile, asynchronous; the
adds happen at L2.

**Register-order store** (:func:`store_fragment`). The f32 WGMMA accumulator lives in
registers in a fixed fragment order; storing it as a ``[m, n]`` tile scatters each
thread's pairs across rows. FA3 stores dQ in register order instead: register ``r`` of
thread ``t`` (a pair of floats) goes to float offset ``(r · 128 + t) · 2``, so each warp's
store is 256 contiguous bytes (no bank conflicts, no relayout, one ``st.shared.v2.f32``
per register pair, ``m · n / 256`` per thread). The GMEM accumulator is then in that
order too; :func:`to_fragment_order` / :func:`from_fragment_order` convert on the host or
in XLA. plgpu cannot say it: a WGMMA-layout value cannot be reshaped to a flat buffer.

**L2 cache hints on TMA loads**: not provided. FA3 loads Q / dO with ``EVICT_LAST``; the
NVVM op beneath Mosaic's TMA load takes an ``l2_cache_hint`` operand, but Mosaic's
``LaunchContext.async_copy`` (what ``plgpu.copy_gmem_to_smem`` lowers to) never passes
one and has no parameter for it, and the TMA descriptor it needs is only reachable through
a private method: a hint would mean re-implementing the TMA load in inline PTX.

**Interpret mode** (the CPU). The interpreter runs named barriers when its parameters say
``inline_mgpu=MODEL_NAMED_BARRIERS`` (:func:`interpret_params`): it recognises an inline
function named ``bar_op`` whose closure holds ``operation``, ``num_threads`` and, when
static, ``barrier_id`` (the shape of tokamax's), counted in whole warpgroups; so the
functions here keep that shape. That mode is private to jax and may change with it; the
tests pin it. The other two functions have no model there: with ``interpret=True`` they run
their plain-Pallas equivalent (a GMEM read-add-write; a permuted store).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_flash.mosaic import interpret as mosaic_interpret

#: Hardware named barriers per CTA (ids 0-15).
NUM_NAMED_BARRIERS = 16
#: The interpreter's ``inline_mgpu`` mode that runs ``bar_op`` functions as named barriers.
MODEL_NAMED_BARRIERS = "_hack_model_inline_mgpu_tokamax"
# Threads per warpgroup, the unit of a Pallas Mosaic GPU thread.
_WARPGROUP = 128
# The bulk copy engine moves whole 16-byte units from 16-byte aligned addresses.
_BULK_ALIGN = 16


def first_free_barrier_id(num_warpgroups: int) -> int:
    """The lowest named-barrier id Mosaic GPU leaves free in a kernel of
    ``num_warpgroups`` warpgroups (``plgpu.kernel``'s ``num_threads``, 1 if unset).

    Raises:
      ValueError: ``num_warpgroups`` is not in 1..8 (a CTA has at most 1024 threads).
    """
    if not isinstance(num_warpgroups, int) or not 1 <= num_warpgroups <= 8:
        raise ValueError(f"num_warpgroups must be an int in 1..8, got {num_warpgroups!r}")
    return 1 + num_warpgroups


def barrier_ids(num_warpgroups: int, count: int) -> tuple[int, ...]:
    """``count`` consecutive free named-barrier ids, from :func:`first_free_barrier_id`.

    Raises:
      ValueError: ``num_warpgroups`` out of 1..8, ``count`` < 1, or fewer than ``count``
        ids free below 16.
    """
    first = first_free_barrier_id(num_warpgroups)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive int, got {count!r}")
    if first + count > NUM_NAMED_BARRIERS:
        raise ValueError(
            f"count={count}: with {num_warpgroups} warpgroups Mosaic GPU uses ids 0..{first - 1}, "
            f"leaving {NUM_NAMED_BARRIERS - first} of the {NUM_NAMED_BARRIERS} named barriers")
    return tuple(range(first, first + count))


def interpret_params(num_threads: int) -> plgpu.InterpretGPUParams:
    """``plgpu.kernel``'s ``interpret=`` for a kernel of ``num_threads`` warpgroups that
    uses :func:`bar_sync` / :func:`bar_arrive`: the project's interpreter parameters, with
    named barriers modelled.

    Raises:
      ValueError: the CPU client has fewer threads than ``num_threads`` (the call would
        hang; see :func:`pallas_flash.mosaic.interpret.interpret_params`).
    """
    params = mosaic_interpret.interpret_params(True, num_threads)
    return dataclasses.replace(params, inline_mgpu=MODEL_NAMED_BARRIERS)


def _check_barrier(barrier_id, num_threads: int) -> None:
    if not isinstance(num_threads, int) or not (
            num_threads % 32 == 0 and 32 <= num_threads <= 1024):
        raise ValueError(
            f"num_threads must be a multiple of 32 in 32..1024 (whole warps), got {num_threads!r}")
    if isinstance(barrier_id, int):
        if not 1 <= barrier_id < NUM_NAMED_BARRIERS:
            raise ValueError(
                f"barrier_id must be in 1..{NUM_NAMED_BARRIERS - 1} (0 is the CTA-wide "
                f"barrier), got {barrier_id}")
    elif jnp.shape(barrier_id) != () or not jnp.issubdtype(jnp.result_type(barrier_id),
                                                           jnp.integer):
        raise ValueError(f"barrier_id must be an int or an int32 scalar, got {barrier_id!r}")


def _named_barrier(operation: str, barrier_id, num_threads: int) -> None:
    if isinstance(barrier_id, np.integer):  # a static id, checked and emitted as one
        barrier_id = int(barrier_id)
    _check_barrier(barrier_id, num_threads)
    # The inline function is named bar_op with operation / num_threads (/ barrier_id) in its
    # closure: the shape interpret mode recognises as a named barrier (module docstring).
    if isinstance(barrier_id, int):
        @plgpu.inline_mgpu()
        def bar_op(_):
            mgpu_utils.inline_ptx(f"bar.{operation} {barrier_id}, {num_threads};",
                                  has_side_effects=True, convergent=True)
        bar_op()
    else:
        @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
        def bar_op(_, barrier_id):
            mgpu_utils.inline_ptx(f"bar.{operation} $0, {num_threads};",
                                  barrier_id.registers.item(),
                                  has_side_effects=True, convergent=True)
        bar_op(jnp.asarray(barrier_id, jnp.int32))


def bar_sync(barrier_id: int | jax.Array, num_threads: int) -> None:
    """``bar.sync barrier_id, num_threads``: the calling warpgroup arrives at the named
    barrier and waits until ``num_threads`` threads in all have arrived (FA3: a consumer
    waits for its turn at the tensor cores, or the producer for a freed buffer).

    ``barrier_id``: a static int (from :func:`barrier_ids`) or an int32 scalar (e.g. a
    base id plus the warpgroup index). In interpret mode ``num_threads`` must be whole
    warpgroups and the kernel run under :func:`interpret_params`.

    Raises:
      ValueError: ``barrier_id`` not in 1..15 or not an integer scalar, ``num_threads``
        not whole warps of a CTA.
    """
    _named_barrier("sync", barrier_id, num_threads)


def bar_arrive(barrier_id: int | jax.Array, num_threads: int) -> None:
    """``bar.arrive barrier_id, num_threads``: the calling warpgroup counts towards the
    named barrier without waiting (FA3: a consumer hands the turn to the other one, or
    releases a K/V buffer to the producer). Arguments as for :func:`bar_sync`.

    Raises:
      ValueError: as :func:`bar_sync`.
    """
    _named_barrier("arrive", barrier_id, num_threads)


def _flat_f32(ref, name: str) -> int:
    if len(ref.shape) != 1 or ref.dtype != jnp.float32:
        raise ValueError(f"{name} must be a 1-D float32 ref, got {ref.dtype}{list(ref.shape)}")
    return ref.shape[0]


def bulk_reduce_add(src_smem, dst_gmem, *, interpret: bool, commit_group: bool = True) -> None:
    """``dst_gmem += src_smem`` by one non-tensor bulk reduce-add, issued by one thread of
    the calling warpgroup (FA3's backward: a consumer adds its dQ contribution, staged by
    :func:`store_fragment`, into the dQ accumulator in GMEM). Asynchronous: SMEM may be
    overwritten only after ``plgpu.wait_smem_to_gmem(n, wait_read_only=True)``; GMEM holds
    the sum after the kernel (or ``wait_smem_to_gmem(n)``). The SMEM writes it reads must
    be made visible first with ``plgpu.commit_smem()``.

    ``src_smem: [n]`` float32 in SMEM; ``dst_gmem: [n]`` float32 in GMEM (e.g. a
    ``.at[pl.ds(start, n)]`` slice of a flat accumulator; its start must be 16-byte
    aligned, a multiple of 4 elements). ``commit_group``: close the bulk-async group here
    (as ``plgpu.copy_smem_to_gmem`` does). ``interpret``: run the plain-Pallas equivalent
    (a GMEM read, add and write), for the CPU interpreter.

    Raises:
      ValueError: refs not 1-D float32, of different lengths, or not whole 16 bytes.
    """
    n = _flat_f32(src_smem, "src_smem")
    if _flat_f32(dst_gmem, "dst_gmem") != n:
        raise ValueError(f"dst_gmem has {dst_gmem.shape[0]} elements, src_smem {n}")
    nbytes = 4 * n
    if nbytes % _BULK_ALIGN:
        raise ValueError(f"src_smem must hold whole {_BULK_ALIGN} bytes, got {nbytes}")
    if interpret:
        dst_gmem[...] = dst_gmem[...] + src_smem[...]
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def bulk_reduce(_, src, dst):
        i32 = ir.IntegerType.get_signless(32)
        mgpu_utils.inline_ptx(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
            mgpu_utils.memref_ptr(dst), mgpu_utils.memref_ptr(src),
            arith.constant(i32, nbytes),
            predicate=mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP),
            has_side_effects=True)

    bulk_reduce(src_smem, dst_gmem)
    if commit_group:
        plgpu.commit_smem_to_gmem_group()


# Register order of Mosaic GPU's WGMMA layout (float32, pairs of columns per register):
# row = 64·mi + 16·warp + 8·half + lane // 4, column = 8·nj + 2·(lane % 4) + e, and a
# thread's registers run over (mi, nj, half). Register order is [mi, nj, half, warp,
# lane // 4, lane % 4, e]: these are the split axes of a row-major [m, n] array...
def _split(m: int, n: int) -> tuple[int, ...]:
    return (m // 64, 4, 2, 8, n // 8, 4, 2)  # (mi, warp, half, lane // 4, nj, lane % 4, e)


# ...and the transpose that puts them in register order.
_TO_REGISTER_ORDER = (0, 4, 2, 1, 3, 5, 6)


def _check_fragment_shape(shape, name: str) -> tuple[int, int]:
    if len(shape) != 2 or shape[0] % 64 or shape[1] % 8 or not shape[0] or not shape[1]:
        raise ValueError(
            f"{name} must be [m, n] with m a multiple of 64 and n of 8 (a WGMMA "
            f"accumulator), got {list(shape)}")
    return shape[0], shape[1]


def to_fragment_order(x: jax.Array) -> jax.Array:
    """``x: [m, n]`` as :func:`store_fragment` lays it out: ``[m * n]`` in register order.

    Raises:
      ValueError: ``x`` not ``[m, n]`` with m % 64 == 0 and n % 8 == 0.
    """
    m, n = _check_fragment_shape(jnp.shape(x), "x")
    split = jnp.transpose(jnp.reshape(x, _split(m, n)), _TO_REGISTER_ORDER)
    return jnp.reshape(split, (m * n,))


def from_fragment_order(flat: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The inverse of :func:`to_fragment_order`: ``flat: [m * n]`` in register order back
    to ``[m, n]`` (FA3's dQ conversion, after the accumulation).

    Raises:
      ValueError: ``shape`` not a WGMMA accumulator's, or ``flat`` not ``[m * n]``.
    """
    m, n = _check_fragment_shape(tuple(shape), "shape")
    if jnp.shape(flat) != (m * n,):
        raise ValueError(f"flat must be [{m * n}] for shape {list(shape)}, got "
                         f"{list(jnp.shape(flat))}")
    registers = jnp.reshape(flat, tuple(_split(m, n)[i] for i in _TO_REGISTER_ORDER))
    return jnp.reshape(jnp.transpose(registers, np.argsort(_TO_REGISTER_ORDER)), (m, n))


def store_fragment(acc: jax.Array, dst_smem, *, interpret: bool) -> None:
    """Stores the calling warpgroup's WGMMA accumulator value ``acc: [m, n]`` float32 to
    ``dst_smem: [m * n]`` float32 in register order (:func:`to_fragment_order`), each
    thread writing its registers as they are: no relayout, conflict-free 256-byte warp
    stores. FA3's backward stages dQ this way for :func:`bulk_reduce_add`. Follow it with
    ``plgpu.commit_smem()`` before a bulk copy or another warpgroup reads the buffer.

    ``interpret``: store ``to_fragment_order(acc)`` with a plain Pallas store, for the CPU
    interpreter.

    Raises:
      ValueError: ``acc`` not float32 ``[m, n]`` (m % 64 == 0, n % 8 == 0), or
        ``dst_smem`` not 1-D float32 of ``m * n``.
    """
    m, n = _check_fragment_shape(jnp.shape(acc), "acc")
    if jnp.result_type(acc) != jnp.float32:
        raise ValueError(f"acc must be float32, got {jnp.result_type(acc)}")
    if _flat_f32(dst_smem, "dst_smem") != m * n:
        raise ValueError(f"dst_smem must hold m * n = {m * n} floats, got {dst_smem.shape[0]}")
    if interpret:
        dst_smem[...] = to_fragment_order(acc)
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store_registers(_, fragment, dst):
        i32 = ir.IntegerType.get_signless(32)
        registers = fragment.registers.reshape(-1)
        (vec,) = ir.VectorType(registers[0].type).shape
        lane = arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, _WARPGROUP))
        base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(dst))
        thread_base = arith.addi(base, arith.muli(lane, arith.constant(i32, 4 * vec)))
        operands = ", ".join(f"${i + 1}" for i in range(vec))
        for r, reg in enumerate(registers):
            offset = 4 * vec * _WARPGROUP * r
            mgpu_utils.inline_ptx(
                f"st.shared.v{vec}.f32 [$0+{offset}], {{{operands}}};", thread_base,
                *(vector.extract(reg, [], [i]) for i in range(vec)),
                has_side_effects=True)

    store_registers(acc, dst_smem)

"""pallas_flash.mosaic.ptx on the CPU: the interpret-mode paths against the plain results,
a ping-pong between two warpgroups on named barriers under the interpreter's race
detector, the register order against Mosaic GPU's own WGMMA layout, and the lowering for
CUDA (the PTX lines reach the module). The kernels themselves: tests/gpu/test_mosaic_ptx_gpu.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_flash.compat import interpret_pallas_call
from pallas_flash.mosaic import ptx

TURNS = 3  # turns per warpgroup in the ping-pong
LANES = 128


def ping_pong_kernel(*, dynamic_ids: bool, interpret):
    """Two warpgroups take turns on one SMEM vector, each turn ``x = 3·x + (wg + 1)``,
    handing the turn over with named barriers as FA3's consumers do (warpgroup 1 first
    arrives at warpgroup 0's barrier, so 0 goes first). The result depends on the order.
    ``dynamic_ids``: the ids as traced scalars (base + warpgroup index), else static."""
    turn = ptx.barrier_ids(2, 2)  # turn[w]: warpgroup w may go

    def sync(wg, own: bool):
        if dynamic_ids:
            (ptx.bar_sync if own else ptx.bar_arrive)(turn[0] + (wg if own else 1 - wg), 256)
            return
        for w in (0, 1):
            @pl.when(wg == w)
            def _(w=w):
                (ptx.bar_sync if own else ptx.bar_arrive)(turn[w if own else 1 - w], 256)

    def body(o_ref, x_smem):
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == 0)
        def _init():
            x_smem[...] = jnp.zeros((LANES,), jnp.int32)

        @pl.when(wg == 1)
        def _first_turn_to_zero():
            sync(wg, own=False)

        for t in range(TURNS):
            sync(wg, own=True)
            x_smem[...] = x_smem[...] * 3 + (wg + 1)
            if t < TURNS - 1:
                sync(wg, own=False)
            else:
                @pl.when(wg == 0)
                def _last_turn_to_one():
                    sync(wg, own=False)

        @pl.when(wg == 1)  # it took the last turn
        def _store():
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((LANES,), jnp.int32),
                        scratch_types=[plgpu.SMEM((LANES,), jnp.int32)], num_threads=2,
                        thread_name="wg", interpret=interpret)


def ping_pong_expected() -> np.ndarray:
    x = 0
    for _ in range(TURNS):
        x = 3 * (3 * x + 1) + 2
    return np.full((LANES,), x, np.int32)


def stage_and_reduce_kernel(m: int, n: int, rounds: int, *, interpret):
    """One warpgroup: ``acc = a · b`` (wgmma), then ``rounds`` times: store acc in register
    order, reduce-add it into the output (initialised from ``init``), and wait for the
    read before the next store reuses the buffer. Out: ``init + rounds · order(a · b)``."""
    def body(a_ref, b_ref, init_ref, o_ref, a_smem, b_smem, flat, loaded):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, loaded)
        plgpu.copy_gmem_to_smem(b_ref, b_smem, loaded)
        plgpu.copy_gmem_to_smem(init_ref, flat, loaded,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.barrier_wait(loaded)
        plgpu.copy_smem_to_gmem(flat, o_ref)
        plgpu.wait_smem_to_gmem(0)  # the output holds init before anything adds to it

        def scope(acc):
            plgpu.wgmma(acc, a_smem, b_smem)
            value = acc[...]
            for _ in range(rounds):
                ptx.store_fragment(value, flat, interpret=interpret)
                plgpu.commit_smem()
                ptx.bulk_reduce_add(flat, o_ref, interpret=interpret)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pl.run_scoped(scope, plgpu.ACC((m, n), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((m * n,), jnp.float32),
        scratch_types=[plgpu.SMEM((m, 64), jnp.bfloat16), plgpu.SMEM((64, n), jnp.bfloat16),
                       plgpu.SMEM((m * n,), jnp.float32), plgpu.Barrier(num_arrivals=3)],
        interpret=interpret)


def small_integers(shape, dtype, seed: int) -> jax.Array:
    """Integer-valued floats: every sum and product here is exact in any order."""
    return jnp.asarray(np.random.default_rng(seed).integers(-3, 4, shape), dtype)


def stage_and_reduce_inputs(m: int, n: int):
    return (small_integers((m, 64), jnp.bfloat16, 0), small_integers((64, n), jnp.bfloat16, 1),
            small_integers((m * n,), jnp.float32, 2))


def stage_and_reduce_expected(a, b, init, rounds: int) -> np.ndarray:
    product = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    return np.asarray(init) + rounds * np.asarray(ptx.to_fragment_order(product))


def interpreted(kernel, *args, races: bool = False):
    """Runs ``kernel`` and says whether the race detector (when on) found a race."""
    try:
        out = jax.block_until_ready(kernel(*args))
    except Exception:
        interpret_pallas_call.reset_gpu_interpret_mode_state()
        raise
    return out, races and interpret_pallas_call.get_races().races_found


def mosaic_register_order(m: int, n: int) -> np.ndarray:
    """``perm[k]``: the row-major index of the element at flat offset ``(r·128 + t)·v + e``
    (register r, thread t, vector element e), from Mosaic GPU's WGMMA layout itself, as
    its TiledLayout.thread_idxs walks it."""
    layout = mgpu.WGMMA_LAYOUT
    strides = layout.tiling.tile_strides((n, 1))
    tiled = layout.tiled_tiling_shape
    tile_strides = strides[-len(tiled):]

    def offset(dims, index):
        sizes = [tiled[d] for d in dims]
        return sum((index // s) % size * tile_strides[d]
                   for d, size, s in zip(dims, sizes, mgpu_utils.get_contiguous_strides(sizes),
                                             strict=True))

    regs = [sum(i * s for i, s in zip(idx, strides, strict=True))
            for idx in np.ndindex(layout.registers_shape((m, n)))]
    threads = [offset(layout.warp_dims, t // 32) + offset(layout.lane_dims, t % 32)
               for t in range(LANES)]
    vec = np.arange(layout.vector_length) * tile_strides[layout.vector_dim]
    return (np.asarray(regs)[:, None, None] + np.asarray(threads)[None, :, None]
            + vec[None, None, :]).reshape(-1)


@pytest.mark.parametrize("shape", [(64, 8), (64, 64), (128, 96), (192, 256)])
def test_register_order_is_mosaic_wgmma_layout(shape):
    m, n = shape
    x = np.arange(m * n, dtype=np.float32).reshape(m, n)
    flat = np.asarray(ptx.to_fragment_order(jnp.asarray(x)))
    np.testing.assert_array_equal(flat, mosaic_register_order(m, n).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ptx.from_fragment_order(jnp.asarray(flat), shape)),
                                  x)


def test_register_order_of_the_ptx_fragment():
    """PTX's wgmma m64nNk16 f32 accumulator: lane l of warp w holds rows 16w + l/4 (+ 8)
    and columns 2·(l % 4) (+ 1) of every 8 columns; in register order thread t's pairs
    start at (r·128 + t)·2."""
    flat = np.asarray(ptx.to_fragment_order(jnp.arange(64 * 16, dtype=jnp.float32)
                                            .reshape(64, 16)))
    t = 32 * 2 + 5  # warp 2, lane 5
    row, col = 16 * 2 + 5 // 4, 2 * (5 % 4)
    for r in range(4):  # registers run over (column block nj, row half)
        dr, dc = 8 * (r % 2), 8 * (r // 2)
        k = (r * LANES + t) * 2
        assert flat[k:k + 2].tolist() == [(row + dr) * 16 + col + dc,
                                          (row + dr) * 16 + col + dc + 1]


def test_barrier_ids_start_after_mosaic_s():
    assert ptx.first_free_barrier_id(1) == 2
    assert ptx.first_free_barrier_id(3) == 4  # tokamax's 2 consumers + 1 producer: 4..15
    assert ptx.barrier_ids(3, 12) == tuple(range(4, 16))
    with pytest.raises(ValueError, match="count=13"):
        ptx.barrier_ids(3, 13)
    with pytest.raises(ValueError, match="num_warpgroups"):
        ptx.first_free_barrier_id(9)


@pytest.mark.parametrize("call, match", [
    (lambda: ptx.bar_sync(0, 256), "barrier_id"),
    (lambda: ptx.bar_arrive(16, 256), "barrier_id"),
    (lambda: ptx.bar_arrive(np.int32(0), 256), "barrier_id"),
    (lambda: ptx.bar_sync(4, 100), "num_threads"),
    (lambda: ptx.bar_arrive(jnp.zeros((2,), jnp.int32), 256), "barrier_id"),
    (lambda: ptx.to_fragment_order(jnp.zeros((32, 8))), "x must be"),
    (lambda: ptx.from_fragment_order(jnp.zeros((64,)), (64, 8)), "flat must be"),
])
def test_arguments_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("fn, args, match", [
    ("store", ((64, 64), (64 * 32,)), "dst_smem must hold"),
    ("reduce", ((64 * 64,), (64 * 32,)), "dst_gmem has"),
    ("reduce", ((6,), (6,)), "whole 16 bytes"),
])
def test_ref_arguments_validated(fn, args, match):
    acc_shape, flat_len = args

    def body(o_ref, flat):
        if fn == "store":
            ptx.store_fragment(jnp.zeros(acc_shape, jnp.float32), flat, interpret=False)
        else:
            ptx.bulk_reduce_add(flat, o_ref, interpret=False)
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(acc_shape, jnp.float32),
                          scratch_types=[plgpu.SMEM(flat_len, jnp.float32)])
    with pytest.raises(ValueError, match=match):
        jax.jit(kernel).trace()


@pytest.mark.parametrize("dynamic_ids", [False, True], ids=["static_ids", "dynamic_ids"])
def test_ping_pong_on_named_barriers(dynamic_ids):
    params = dataclasses.replace(ptx.interpret_params(2), detect_races=True)
    out, races = interpreted(ping_pong_kernel(dynamic_ids=dynamic_ids, interpret=params),
                             races=True)
    assert not races
    np.testing.assert_array_equal(np.asarray(out), ping_pong_expected())


def test_ping_pong_races_without_the_barriers():
    """The control: the interpreter skipping the inline functions sees the turns race, so
    the test above passes because the barriers are modelled."""
    params = dataclasses.replace(ptx.interpret_params(2), detect_races=True,
                                 inline_mgpu="ignore")
    try:
        _, races = interpreted(ping_pong_kernel(dynamic_ids=True, interpret=params),
                               races=True)
    except jax.errors.JaxRuntimeError as error:  # jax 0.12 raises at the first race
        races = "RACE DETECTED" in str(error)
    assert races


@pytest.mark.parametrize("shape, rounds", [((64, 64), 1), ((128, 32), 2)])
def test_stage_and_reduce_interpret(shape, rounds):
    m, n = shape
    a, b, init = stage_and_reduce_inputs(m, n)
    out, _ = interpreted(stage_and_reduce_kernel(m, n, rounds,
                                                 interpret=ptx.interpret_params(1)), a, b, init)
    np.testing.assert_array_equal(np.asarray(out), stage_and_reduce_expected(a, b, init, rounds))


def test_lowers_for_cuda_with_the_ptx():
    """The whole Pallas -> Mosaic GPU lowering (layout inference included) on the CPU."""
    a, b, init = stage_and_reduce_inputs(64, 64)
    staged = jax.jit(stage_and_reduce_kernel(64, 64, 1, interpret=None)).trace(
        a, b, init).lower(lowering_platforms=("cuda",)).as_text()
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;" in staged
    assert "st.shared.v2.f32 [$0+0], {$1, $2};" in staged
    # Register r of a thread lands 128 pairs after register r - 1: 64·64 floats, 16 pairs.
    assert f"st.shared.v2.f32 [$0+{15 * 1024}], {{$1, $2}};" in staged
    for dynamic_ids, lines in [(False, ("bar.sync 3, 256;", "bar.arrive 4, 256;")),
                               (True, ("bar.sync $0, 256;", "bar.arrive $0, 256;"))]:
        text = jax.jit(ping_pong_kernel(dynamic_ids=dynamic_ids, interpret=None)).trace(
            ).lower(lowering_platforms=("cuda",)).as_text()
        for line in lines:
            assert line in text

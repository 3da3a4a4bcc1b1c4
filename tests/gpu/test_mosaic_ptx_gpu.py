"""pallas_flash.mosaic.ptx compiled on a Hopper GPU: each inline-PTX primitive against its
plain Pallas equivalent, bit for bit.

- named barriers: the ping-pong of tests/test_mosaic_ptx.py (static and traced ids) and
  the same protocol on mbarriers give the order-dependent result;
- register-order store: a WGMMA accumulator stored by ``store_fragment`` equals the plain
  ``[m, n]`` tile store of the same value permuted by ``to_fragment_order``;
- bulk reduce-add: integer-valued tiles (exact in any order) added by one and by two
  warpgroups at once, into slices of one GMEM accumulator, across CTAs.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest
from test_mosaic_ptx import (
    LANES,
    TURNS,
    ping_pong_expected,
    ping_pong_kernel,
    small_integers,
    stage_and_reduce_expected,
    stage_and_reduce_inputs,
    stage_and_reduce_kernel,
)

from pallas_flash.mosaic import ptx


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")


def _mbarrier_ping_pong():
    """The plain equivalent of ``ping_pong_kernel``: each turn handed over on an mbarrier
    (``turn[w]`` completes once per turn of warpgroup w, and only w waits on it)."""
    def body(o_ref, x_smem, turn):
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == 0)
        def _init():
            x_smem[...] = jnp.zeros((LANES,), jnp.int32)
            plgpu.barrier_arrive(turn.at[0])

        for t in range(TURNS):
            plgpu.barrier_wait(turn.at[wg])
            x_smem[...] = x_smem[...] * 3 + (wg + 1)
            if t < TURNS - 1:
                plgpu.barrier_arrive(turn.at[1 - wg])
            else:
                @pl.when(wg == 0)
                def _last_turn_to_one():
                    plgpu.barrier_arrive(turn.at[1])

        @pl.when(wg == 1)
        def _store():
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((LANES,), jnp.int32),
                        scratch_types=[plgpu.SMEM((LANES,), jnp.int32),
                                       plgpu.Barrier(num_barriers=2)],
                        num_threads=2, thread_name="wg")


@pytest.mark.parametrize("dynamic_ids", [False, True], ids=["static_ids", "dynamic_ids"])
def test_ping_pong_named_barriers(dynamic_ids):
    out = ping_pong_kernel(dynamic_ids=dynamic_ids, interpret=None)()
    np.testing.assert_array_equal(np.asarray(out), ping_pong_expected())
    np.testing.assert_array_equal(np.asarray(_mbarrier_ping_pong()()), ping_pong_expected())


def _fragment_and_tile(m: int, n: int):
    """``acc = a · b`` stored twice: in register order (``store_fragment``) to a flat
    output, and as a plain ``[m, n]`` tile store."""
    def body(a_ref, b_ref, flat_ref, tile_ref, a_smem, b_smem, flat, tile, loaded):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, loaded)
        plgpu.copy_gmem_to_smem(b_ref, b_smem, loaded)
        plgpu.barrier_wait(loaded)

        def scope(acc):
            plgpu.wgmma(acc, a_smem, b_smem)
            value = acc[...]
            ptx.store_fragment(value, flat, interpret=False)
            tile[...] = value
        pl.run_scoped(scope, plgpu.ACC((m, n), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(flat, flat_ref)
        plgpu.copy_smem_to_gmem(tile, tile_ref)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((m * n,), jnp.float32),
                        jax.ShapeDtypeStruct((m, n), jnp.float32)),
        scratch_types=[plgpu.SMEM((m, 64), jnp.bfloat16), plgpu.SMEM((64, n), jnp.bfloat16),
                       plgpu.SMEM((m * n,), jnp.float32), plgpu.SMEM((m, n), jnp.float32),
                       plgpu.Barrier(num_arrivals=2)])


@pytest.mark.parametrize("shape", [(64, 64), (128, 128), (64, 256)])
def test_store_fragment_is_the_permuted_tile(shape):
    m, n = shape
    keys = jax.random.split(jax.random.key(3), 2)
    a = jax.random.normal(keys[0], (m, 64), jnp.bfloat16)
    b = jax.random.normal(keys[1], (64, n), jnp.bfloat16)
    flat, tile = _fragment_and_tile(m, n)(a, b)
    np.testing.assert_array_equal(np.asarray(flat), np.asarray(ptx.to_fragment_order(tile)))
    np.testing.assert_array_equal(np.asarray(ptx.from_fragment_order(flat, shape)),
                                  np.asarray(tile))


@pytest.mark.parametrize("shape, rounds", [((64, 64), 1), ((128, 128), 3)])
def test_bulk_reduce_add_one_warpgroup(shape, rounds):
    m, n = shape
    a, b, init = stage_and_reduce_inputs(m, n)
    out = stage_and_reduce_kernel(m, n, rounds, interpret=None)(a, b, init)
    np.testing.assert_array_equal(np.asarray(out), stage_and_reduce_expected(a, b, init, rounds))


def _two_warpgroups_add(m: int, n: int, rounds: int, ctas: int):
    """CTA g: warpgroup 0 copies ``init`` to slice g of the output; after a named barrier
    both warpgroups add their ``a · b[w]`` into that slice ``rounds`` times, concurrently."""
    size = m * n
    start = ptx.first_free_barrier_id(2)

    def body(a_ref, b_ref, init_ref, o_ref, a_smem, b_smem, flat, loaded):
        g, wg = jax.lax.axis_index("g"), jax.lax.axis_index("wg")
        out = o_ref.at[pl.ds(g * size, size)]

        @pl.when(wg == 0)
        def _load():
            for ref, dst in ((a_ref, a_smem), (b_ref.at[0], b_smem.at[0]),
                             (b_ref.at[1], b_smem.at[1])):
                plgpu.copy_gmem_to_smem(ref, dst, loaded)
            plgpu.copy_gmem_to_smem(init_ref.at[pl.ds(g * size, size)], flat.at[0], loaded,
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            plgpu.barrier_wait(loaded)
            plgpu.copy_smem_to_gmem(flat.at[0], out)
            plgpu.wait_smem_to_gmem(0)  # the slice holds init before anyone adds to it

        ptx.bar_sync(start, 256)

        def scope(acc):
            plgpu.wgmma(acc, a_smem, b_smem.at[wg])
            value = acc[...]
            for _ in range(rounds):
                ptx.store_fragment(value, flat.at[wg], interpret=False)
                plgpu.commit_smem()
                ptx.bulk_reduce_add(flat.at[wg], out, interpret=False)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        pl.run_scoped(scope, plgpu.ACC((m, n), jnp.float32))
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ctas * size,), jnp.float32),
        scratch_types=[plgpu.SMEM((m, 64), jnp.bfloat16), plgpu.SMEM((2, 64, n), jnp.bfloat16),
                       plgpu.SMEM((2, size), jnp.float32), plgpu.Barrier(num_arrivals=4)],
        grid=(ctas,), grid_names=("g",), num_threads=2, thread_name="wg")


def test_bulk_reduce_add_two_warpgroups_at_once():
    m, n, rounds, ctas = 64, 128, 4, 3
    a = small_integers((m, 64), jnp.bfloat16, 10)
    b = small_integers((2, 64, n), jnp.bfloat16, 11)
    init = small_integers((ctas * m * n,), jnp.float32, 12)
    out = _two_warpgroups_add(m, n, rounds, ctas)(a, b, init)
    a32 = np.asarray(a, np.float32)
    added = sum(np.asarray(ptx.to_fragment_order(a32 @ np.asarray(b[w], np.float32)))
                for w in (0, 1))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(init) + rounds * np.tile(added, ctas))

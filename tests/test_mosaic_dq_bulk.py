"""The bulk dQ mode of the Mosaic backward (``MosaicBackwardConfig.bulk_dq``:
pallas_flash/mosaic/backward/dq_bulk.py, FA3's dQ path) on the CPU.

* In interpret mode, under the race detector with the named barriers modelled: dq, dk, dv
  against the float64 oracle and against the fused dQ of the same kernel (TMA
  reduce-adds), at head_dim 64 (the slot's owner adds the whole tile) and 128 (column
  halves), causal and not, GQA, odd lengths (rows that see no key). The detector does
  not see wgmma's operand reads (jax 0.11.2's interpreter: "TODO: Vector clocks"), so it
  checks the ring, the staging and the accumulator's adds, not the dSᵀ exchange that the
  named barrier orders (without the barrier it reports no race there either); the
  barriers themselves: tests/test_mosaic_ptx.py's ping-pong, and the GPU test.
* The fragment-ordered accumulator and its conversion (FA3's ``convert_dQ``).
* Lowered for ``cuda``: the PTX lines reach the kernel, and the config's shared-memory
  count is what Mosaic GPU allocates.
The real kernels: tests/gpu/test_mosaic_dq_bulk_gpu.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from support import random_qkv, rel_err

from pallas_flash import mosaic
from pallas_flash.compat import interpret_pallas_call
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, ptx
from pallas_flash.mosaic import config as mosaic_config
from pallas_flash.mosaic.backward import dq_bulk
from pallas_flash.mosaic.backward.common import BackwardStatic
from pallas_flash.reference import attention_float64

mosaic_backward = mosaic.KERNELS.backward
BF16 = jnp.bfloat16
BULK = MosaicBackwardConfig(deterministic=False, bulk_dq=True)
FUSED = MosaicBackwardConfig(deterministic=False)


def _residuals(q, k, v, d_out, mask: MaskSpec, scale: float):
    """(out, lse, delta) from the float64 oracle, and its (dq, dk, dv)."""
    out, lse, grads = attention_float64(q, k, v, scale=scale, mask=mask,
                                        d_out=np.asarray(d_out, np.float64))
    out = jnp.asarray(out, q.dtype)
    delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    return out, jnp.asarray(lse, jnp.float32), delta, grads


def _run(config, params, q, k, v, d_out, out, lse, delta, mask, scale):
    try:
        with plgpu.force_gpu_interpret_mode(params):
            return jax.block_until_ready(mosaic_backward(
                q, k, v, None, out, lse, d_out, delta, mask=mask, scale=scale,
                config=config, interpret=True))
    except Exception:
        interpret_pallas_call.reset_gpu_interpret_mode_state()
        raise


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize(("head_dim", "num_stages"), [(64, 2), (64, 3), (128, 2)])
def test_interpret_bulk_dq_matches_oracle_and_fused(head_dim, num_stages, causal):
    """GQA (2 query heads per KV head), 200 queries x 330 keys, bottom-right causal: near
    the diagonal one consumer skips a block while the other has dS·K to add (its zero dSᵀ
    still meets the other's at the barrier). Three stages at head_dim 64: consumer 0 owns
    two of the three slots."""
    q, k, v, d_out = random_qkv(1, 200, 330, 2, 1, head_dim, BF16)
    mask = MaskSpec(seq_q=200, seq_kv=330, is_causal=causal, causal_alignment="bottom_right")
    residuals = _residuals(q, k, v, d_out, mask, 0.1)
    out, lse, delta, want = residuals
    bulk_params = dataclasses.replace(ptx.interpret_params(3), detect_races=True)
    got = _run(dataclasses.replace(BULK, num_stages=num_stages), bulk_params, q, k, v,
               d_out, out, lse, delta, mask, 0.1)
    assert not interpret_pallas_call.get_races().races_found
    fused = _run(dataclasses.replace(FUSED, num_stages=num_stages), plgpu.InterpretGPUParams(),
                 q, k, v, d_out, out, lse, delta, mask, 0.1)
    for name, g, ref, x in zip("qkv", got, want, (q, k, v), strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert rel_err(g, ref) < 1e-2, f"d{name}: {rel_err(g, ref)}"
    # The same dS·K, added in another order: dQ equal to rounding; dK, dV untouched.
    assert rel_err(got[0], fused[0]) < 2e-3, rel_err(got[0], fused[0])
    for g, f in zip(got[1:], fused[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(f))


def _static(head_dim: int, *, interpret: bool, block_q: int = 64,
            num_tiles: int = 3) -> BackwardStatic:
    return BackwardStatic(
        mask=MaskSpec(seq_q=256, seq_kv=256), scale=0.5, block_q=block_q, block_kv=64,
        num_stages=2, head_dim=head_dim, dtype=jnp.dtype(BF16), group=1,
        num_q_blocks=256 // block_q, num_tiles=num_tiles, needs_mask=False, fuse_dq=True,
        bulk_dq=True, interpret=interpret)


@pytest.mark.parametrize(("head_dim", "block_q", "parts"), [(64, 64, 1), (64, 128, 1),
                                                            (128, 64, 2)])
@pytest.mark.parametrize("interpret", [False, True])
def test_convert_dq_reads_fragment_ordered_tiles(head_dim, block_q, parts, interpret):
    """A dQ written as the kernel adds it (each [block_q, columns] tile of query block i,
    part p, in register order; in interpret mode split over the key tiles' partial sums)
    comes back as [B, T, N, D], scaled."""
    st = _static(head_dim, interpret=interpret, block_q=block_q)
    batch, seq, heads = 2, 256, 3
    dq = np.random.default_rng(0).standard_normal((batch, seq, heads, head_dim), np.float32)
    shape = dq_bulk.accumulator_shape(st, dq.shape)
    columns = head_dim // parts
    assert shape[-2:] == (parts, block_q * columns)
    acc = np.zeros(shape[-5:], np.float32)
    for b, n, i, p in np.ndindex(batch, heads, seq // block_q, parts):
        tile = dq[b, i * block_q:(i + 1) * block_q, n, p * columns:(p + 1) * columns]
        acc[b, n, i, p] = ptx.to_fragment_order(jnp.asarray(tile))
    if interpret:  # partial sums of the CTAs: the sum is acc
        assert shape[0] == st.num_tiles
        acc = np.stack([acc * 0.5, acc * 0.25, acc * 0.25])
    got = dq_bulk.convert_dq(st, jnp.asarray(acc), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), dq * st.scale, rtol=1e-6)


def _lower(head_dim: int, config: MosaicBackwardConfig, *, causal: bool = True) -> str:
    shape_q, shape_kv = (2, 1024, 8, head_dim), (2, 1024, 2, head_dim)
    mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=causal)

    def f(q, k, v, out, lse, d_out, delta):
        return mosaic_backward(q, k, v, None, out, lse, d_out, delta, mask=mask, scale=0.1,
                               config=config, interpret=False)
    q, kv = (jax.ShapeDtypeStruct(s, BF16) for s in (shape_q, shape_kv))
    stats = jax.ShapeDtypeStruct((2, 8, 1024), jnp.float32)
    return jax.jit(f).trace(q, kv, kv, q, stats, q, stats).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(("head_dim", "causal"), [(64, True), (128, False)])
def test_lowers_for_cuda_with_the_ptx(head_dim, causal):
    """The GPU kernel: register-order stores, the bulk reduce-add and both named barriers
    (ids after Mosaic GPU's: 4 and 5 with three warpgroups), no TMA reduce-add of dQ."""
    lines = ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32",
             "st.shared.v2.f32", "bar.sync 4, 256;", "bar.sync 5, 256;")
    text = _lower(head_dim, BULK, causal=causal)
    fused = _lower(head_dim, FUSED, causal=causal)
    for line in lines:
        assert line in text and line not in fused, line


@pytest.mark.parametrize(("head_dim", "config"), [
    (128, dataclasses.replace(BULK, num_stages=2)),  # fits
    (128, dataclasses.replace(BULK, num_stages=3)),  # the dSᵀ ring and staging: over
    (64, dataclasses.replace(BULK, block_q=128, num_stages=3)),  # over
])
def test_smem_accounting_matches_lowering(head_dim, config, monkeypatch):
    """The config's count for the bulk dQ (flat staging tiles, no exchange mbarriers) is
    what Mosaic GPU allocates (its error says, where over the budget)."""
    need = config.dkdv_smem_bytes(head_dim)
    assert need == dataclasses.replace(config, bulk_dq=False).dkdv_smem_bytes(head_dim) - 8 * (
        config.num_stages + 1)
    if need <= mosaic_config.SMEM_BUDGET:
        _lower(head_dim, config)
        return
    monkeypatch.setattr(MosaicBackwardConfig, "check_fits", lambda *_, **__: None)
    with pytest.raises(ValueError, match="exceeds available shared memory") as error:
        _lower(head_dim, config)
    assert int(re.search(r"smem_bytes=(\d+)", str(error.value)).group(1)) == need


def test_config_field():
    assert MosaicBackwardConfig().bulk_dq is False
    with pytest.raises(ValueError, match="bulk_dq"):
        MosaicBackwardConfig(deterministic=False, bulk_dq=1)
    # With the separate dQ kernel there is no fused dQ to take FA3's path: no effect.
    assert MosaicBackwardConfig(bulk_dq=True).smem_bytes(128) == MosaicBackwardConfig(
        ).smem_bytes(128)


def test_benchmark_dq_modes_switch(monkeypatch):
    """benchmarks/backward.py --dq-modes: each mode a row timed with the others, whose
    backward config is the default tiling with the fused dQ in that mode."""
    from benchmarks import backward as backward_bench

    args = backward_bench.parse_args(["--out", "x", "--impls", "xla", "--dq-modes",
                                      "fused,bulk"])
    assert args.dq_modes == "fused,bulk"
    with pytest.raises(SystemExit):
        backward_bench.parse_args(["--out", "x", "--dq-modes", "tma"])
    with pytest.raises(ValueError, match="mode"):
        backward_bench.dq_mode_fn("tma")
    seen = []
    monkeypatch.setattr("pallas_flash.attention",
                        lambda *_, config, **kwargs: seen.append((config, kwargs)))
    q = jnp.zeros((1, 4096, 2, 128), BF16)
    for mode in ("fused", "bulk"):
        backward_bench.dq_mode_fn(mode)(q, q, q, True)
    (fused, kwargs), (bulk, _) = seen
    assert kwargs == dict(is_causal=True, implementation="mosaic")
    assert not fused.deterministic and not fused.bulk_dq
    assert bulk == dataclasses.replace(fused, bulk_dq=True)
    runs = []
    monkeypatch.setattr(backward_bench, "run",
                        lambda args, impls, supports: runs.append((impls, supports)) or 0)
    assert backward_bench.main(["--out", "x", "--impls", "xla", "--dq-modes", "bulk"]) == 0
    ((impls, supports),) = runs
    assert list(impls) == ["xla", "pallas_flash_mosaic_dq_bulk"]
    assert supports("pallas_flash_mosaic_dq_bulk", 128)
    assert not supports("pallas_flash_mosaic_dq_bulk", 256)


"""Read floors for the decode benchmark: kernels that only read a decode step's K/V.

A decode step is bound by HBM: what it must do is read the cache once. These kernels do
exactly that in the decode's layout and grid (``[batch, seq_kv, kv_heads, head_dim]``, one
program per (row, kv head, split)) and nothing else, so their time is the floor a decode
kernel of the same memory path can reach on this card, measured rather than taken from the
datasheet (the H200's copy bandwidth is well below its 4.8 TB/s):

* ``read_triton``: a Pallas-Triton loop of ``block_kv``-row loads of K and V, summed (the
  path of the package's Triton decode);
* ``read_tma``: a Mosaic GPU kernel whose ``plgpu.emit_pipeline`` brings ``[block_kv,
  head_dim]`` K and V tiles into shared memory through a ring of TMA loads, and touches
  nothing (the path a Mosaic decode kernel would take).

Both take ``(q, k, v)`` like the attention calls (``q`` unused) and return a small float32
array; ``read_triton``'s is the per-split column sums of K + V (so its reads are checked).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton


def _split_rows(seq_kv: int, num_splits: int, block_kv: int) -> int:
    chunk, rest = divmod(seq_kv, num_splits)
    if rest or chunk % block_kv:
        raise ValueError(f"seq_kv {seq_kv} must split into {num_splits} parts of a multiple "
                         f"of block_kv {block_kv} keys")
    return chunk


def triton_reader(shape: tuple[int, int, int, int], num_splits: int, *, block_kv: int = 128,
                  num_stages: int = 4, num_warps: int = 8, interpret: bool = False
                  ) -> Callable:
    """``(q, k, v) -> [batch, kv_heads, num_splits, head_dim]`` float32: each split's column
    sums of K + V over its keys. ``shape``: K's ``[batch, seq_kv, kv_heads, head_dim]``."""
    batch, seq_kv, kv_heads, head_dim = shape
    chunk = _split_rows(seq_kv, num_splits, block_kv)

    def kernel(k_ref, v_ref, o_ref):
        def body(i, acc):
            rows = pl.ds(i * block_kv, block_kv)
            return (acc + k_ref[rows, :].astype(jnp.float32)
                    + v_ref[rows, :].astype(jnp.float32))
        acc = lax.fori_loop(0, chunk // block_kv, body,
                            jnp.zeros((block_kv, head_dim), jnp.float32))
        o_ref[...] = jnp.sum(acc, axis=0)

    spec = pl.BlockSpec((None, chunk, None, head_dim), lambda b, h, s: (b, s, h, 0))
    call = pl.pallas_call(
        kernel, grid=(batch, kv_heads, num_splits), in_specs=[spec, spec],
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda b, h, s: (b, h, s, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, num_splits, head_dim), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="read_floor_triton")
    return jax.jit(lambda q, k, v: call(k, v))


def tma_reader(shape: tuple[int, int, int, int], num_splits: int, *, block_kv: int = 128,
               num_stages: int = 2, interpret: bool = False) -> Callable:
    """``(q, k, v) -> [batch · kv_heads · num_splits, 8, head_dim]`` float32 zeros, after
    every K and V tile has landed in shared memory (the pipeline waits for each TMA load
    before its empty step). ``shape``: K's ``[batch, seq_kv, kv_heads, head_dim]``."""
    batch, seq_kv, kv_heads, head_dim = shape
    steps = _split_rows(seq_kv, num_splits, block_kv) // block_kv
    programs = batch * kv_heads * num_splits

    def body(k_gmem, v_gmem, o_gmem, o_smem):
        program = lax.axis_index("program")
        row, head, split = (program // (kv_heads * num_splits),
                            program // num_splits % kv_heads, program % num_splits)
        spec = plgpu.BlockSpec((block_kv, head_dim), lambda i: (split * steps + i, 0))
        plgpu.emit_pipeline(lambda index, k_tile, v_tile: None, grid=(steps,),
                            in_specs=[spec, spec], max_concurrent_steps=num_stages)(
            k_gmem.at[row, :, head, :], v_gmem.at[row, :, head, :])
        o_smem[...] = jnp.zeros((8, head_dim), jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[program])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((programs, 8, head_dim), jnp.float32),
        grid=(programs,), grid_names=("program",),
        scratch_types=[plgpu.SMEM((8, head_dim), jnp.float32)],
        **({"interpret": plgpu.InterpretGPUParams()} if interpret else {}))
    return jax.jit(lambda q, k, v: call(k, v))

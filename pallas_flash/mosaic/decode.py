"""Split-KV decode on Hopper: one warpgroup per (cache chunk, kv head), K/V through TMA.

A decode step reads the cache once and does almost no math per byte, so what matters is
keeping HBM busy. The main forward's CTA (two 64-row consumers and a producer) computes at
least 128 query rows per K/V tile, where a decode tile has ``group · seq_q`` real rows
(e.g. 4); here one warpgroup computes the 64 rows of one wgmma, and
``plgpu.emit_pipeline`` keeps ``num_stages`` K and V tiles in flight through TMA, the path
whose bare reads reached 3.8-3.9 TB/s on the H200 (``benchmarks/read_floor.py``), against
3.2-3.9 for the Triton loads.

Measured on the H200 (2026-12-03, ``docs/decode.md``)
it reads the cache at 0.95-1.00x the Triton decode's rate, so :func:`pallas_flash.dispatch.
choose_decode` keeps Triton first; ``decode_attention(..., implementation="mosaic")`` runs
it on a full cache (no lengths, window or per-token mask) instead of the main forward,
whose 128-row CTAs made that call 1.0-1.7x slower.

The caller (:mod:`pallas_flash.decode`) packs the queries (GQA: the query heads of one kv
head, times the new tokens, are the rows of one tile) and splits the cache into chunks
that become batch entries; this kernel sees a plain multi-head call ``q [B', R, K, D]``
against ``k, v [B', S, K, D]`` with every key visible, and returns each chunk's normalised
``out`` and ``lse``, which the caller merges.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.logits import log2_logits
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.config import (
    DECODE_ROWS,
    SMEM_BUDGET,
    DecodeConfig,
    default_decode_config,
    padded_head_dim,
)
from pallas_flash.mosaic.epilogue import normalized, store_rows
from pallas_flash.mosaic.interpret import interpret_params
from pallas_flash.mosaic.mainloop import accumulate_pv
from pallas_flash.mosaic.softmax import online_softmax_step
from pallas_flash.mosaic.tiles import DTYPES, LOG2E, a_operand, pad_operand, smem_transforms


def unsupported(q_shape, kv_shape, dtype, mask: MaskSpec, *, has_segments: bool,
                has_mask: bool, config: DecodeConfig) -> str | None:
    """Why :func:`forward` cannot run this call, or None."""
    rows, seq_kv, head_dim = q_shape[1], kv_shape[1], q_shape[3]
    if has_segments or has_mask:
        return "the Mosaic decode kernel reads a full cache (no lengths, window or mask)"
    if mask != MaskSpec(seq_q=mask.seq_q, seq_kv=mask.seq_kv):
        return f"the Mosaic decode kernel shows every key, got mask {mask}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic decode kernel takes bfloat16 or float16, got {jnp.dtype(dtype)}"
    if rows > DECODE_ROWS:
        return (f"the Mosaic decode kernel computes at most {DECODE_ROWS} packed rows, got "
                f"{rows}")
    if head_dim > 256:
        return f"the Mosaic decode kernel takes head_dim up to 256, got {head_dim}"
    smem = config.smem_bytes(padded_head_dim(head_dim), jnp.dtype(dtype).itemsize)
    if smem > SMEM_BUDGET:
        return (f"{config} needs about {smem} bytes of shared memory at head_dim "
                f"{head_dim}, more than the {SMEM_BUDGET} a CTA has")
    if seq_kv % config.block_kv:
        return (f"the Mosaic decode kernel needs chunks of whole blocks: {seq_kv} keys, "
                f"block_kv {config.block_kv}")
    return None


def decode_config(config, q_shape, kv_shape, dtype) -> DecodeConfig:
    """``config`` if it is a :class:`DecodeConfig`; else :func:`default_decode_config` for
    the head dim, its ``block_kv`` lowered by 64s until it divides the chunk if it must."""
    if isinstance(config, DecodeConfig):
        return config
    config = default_decode_config(q_shape[3], jnp.dtype(dtype).itemsize)
    block_kv = config.block_kv
    while kv_shape[1] % block_kv and block_kv > 64:
        block_kv -= 64
    return dataclasses.replace(config, block_kv=block_kv)


def forward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, *, mask: MaskSpec,
            scale: float, config, interpret: bool, softcap: float | None = None
            ) -> tuple[jax.Array, jax.Array]:
    """Attention of packed query rows to one cache chunk each, every key visible (the
    forward of :data:`pallas_flash.mosaic.DECODE_KERNELS`, in the backends' convention).

    Args:
      q: ``[chunks, rows, kv_heads, head_dim]``, ``rows <= 64`` packed query rows.
      k, v: ``[chunks, seq_kv, kv_heads, head_dim]``, ``seq_kv`` a multiple of
        ``config.block_kv``.
      segment_ids: must be None; mask: must show every key (:func:`unsupported`).
      scale: logit scale; softcap: ``c`` of ``c · tanh(scale · q·k / c)``, or None.
      config: a :class:`DecodeConfig` (anything else: :func:`default_decode_config`).
      interpret: Mosaic GPU interpret mode (CPU).

    Returns:
      ``out [chunks, rows, kv_heads, head_dim]`` like ``q`` and ``lse [chunks, kv_heads,
      rows]`` float32 (natural log).
    """
    config = decode_config(config, q.shape, k.shape, q.dtype)
    reason = unsupported(q.shape, k.shape, q.dtype, mask, has_segments=segment_ids is not None,
                         has_mask=False, config=config)
    if reason is not None:
        raise ValueError(reason)
    chunks, rows, kv_heads, head_dim = q.shape
    dim = padded_head_dim(head_dim)
    block_kv, dtype = config.block_kv, q.dtype
    steps = k.shape[1] // block_kv
    transforms = smem_transforms(jnp.dtype(dtype).itemsize)
    scale_log2 = scale * LOG2E

    def decode_kernel(q_gmem, k_gmem, v_gmem, out_gmem, lse_gmem, q_tile, lse_tile, q_ready,
                      p_tile=None):
        program = lax.axis_index("program")
        chunk, head = program // kv_heads, program % kv_heads

        def step(_, k_tile, v_tile, carry):
            o, m_i, l_i = carry

            def qk(s_acc):
                plgpu.wgmma(s_acc, q_tile, k_tile.T)
                return s_acc[...]
            scores = pl.run_scoped(qk, plgpu.ACC((DECODE_ROWS, block_kv), jnp.float32))
            if softcap is not None:  # the tile in base 2 already; no scale in exp2
                scores, _ = log2_logits(scores, scale, softcap, None)
            p, m_new, alpha = online_softmax_step(
                scores, m_i, None if softcap is not None else scale_log2, guard_empty=False)
            l_i = l_i * alpha + p.sum(axis=1)
            o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
            o = accumulate_pv(o, a_operand(p.astype(dtype), p_tile), v_tile, lambda: None,
                              interpret=interpret)
            return o, m_new, l_i

        plgpu.copy_gmem_to_smem(q_gmem.at[chunk, :, head], q_tile, q_ready)
        carry = (
            plgpu.layout_cast(jnp.zeros((DECODE_ROWS, dim), jnp.float32),
                              plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((DECODE_ROWS,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((DECODE_ROWS,), jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1)),
        )
        plgpu.barrier_wait(q_ready)
        # emit_pipeline keeps up to num_stages K / V tile pairs in flight: a slot's next
        # TMA load is issued once the step that read it is done, so HBM keeps streaming
        # under each step's GEMMs and softmax.
        spec = plgpu.BlockSpec((block_kv, dim), lambda i: (i, 0), transforms=transforms)
        o, m_i, l_i = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[spec, spec], max_concurrent_steps=config.num_stages,
            init_carry=carry)(k_gmem.at[chunk, :, head], v_gmem.at[chunk, :, head])
        o, lse = normalized(o, m_i, l_i)
        q_tile[...] = o.astype(dtype)  # Q is dead: its tile carries O out
        lse_tile[...] = lse
        store_rows(q_tile, lse_tile, out_gmem.at[chunk, :, head], lse_gmem.at[chunk, head])
        plgpu.wait_smem_to_gmem(0)

    scratch = dict(q_tile=plgpu.SMEM((DECODE_ROWS, dim), dtype, transforms=transforms),
                   lse_tile=plgpu.SMEM((DECODE_ROWS,), jnp.float32), q_ready=plgpu.Barrier())
    if interpret:  # a wgmma A operand from registers goes through SMEM there
        scratch["p_tile"] = plgpu.SMEM((DECODE_ROWS, block_kv), dtype, transforms=transforms)
    call = plgpu.kernel(
        decode_kernel,
        out_type=(jax.ShapeDtypeStruct((chunks, DECODE_ROWS, kv_heads, dim), dtype),
                  jax.ShapeDtypeStruct((chunks, kv_heads, DECODE_ROWS), jnp.float32)),
        grid=(chunks * kv_heads,),
        grid_names=("program",),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret, 1),
    )
    out, lse = call(pad_operand(q, DECODE_ROWS, dim), pad_operand(k, k.shape[1], dim),
                    pad_operand(v, v.shape[1], dim))
    return out[:, :rows, :, :head_dim], lse[:, :, :rows]

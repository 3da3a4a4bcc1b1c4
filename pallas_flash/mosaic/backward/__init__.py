"""FlashAttention backward for Hopper (sm90): two warp-specialized Mosaic GPU kernels.

FlashAttention-2, Algorithm 2, on FlashAttention-3's machinery (Shah et al. 2024, Sec. 3.1):
P is never stored; it is recomputed tile by tile from Q, K and the forward's LSE, in base 2
with the softmax scale folded into the exponent (``P = exp2(S·scale·log2e − lse·log2e)``),
and ``delta = rowsum(dO ∘ O)`` (minus the lse cotangent) comes precomputed from
:mod:`pallas_flash.autodiff`. Each kernel runs one TMA **producer** warpgroup
(``setmaxnreg`` down to 40, or 24 above head_dim 64) that streams
tiles through a ``num_stages``-deep SMEM ring with *ready* mbarriers (arrived by the TMA
engine) and *free* mbarriers (arrived by the consumers), and two **consumer** warpgroups
(``setmaxnreg`` up to 232, or 240) that run the GEMMs with wgmma and
keep their accumulators in registers.

The package:

* :mod:`.common` — what the kernels share: the static config (:class:`.BackwardStatic`),
  the walk over the producer's ring, P's recomputation, the bias / mask slots.
* :mod:`.dkdv` — the dK/dV kernel up to head_dim 128: one CTA per ``2·block_kv`` keys of one
  KV head, each consumer owning ``block_kv`` keys; the producer streams (Q_i, dO_i, lse_i,
  delta_i) for every query block i that sees the CTA's keys, for every query head of the
  GQA group. The consumers work on the transposed tiles (Sᵀ = K_j·Q_iᵀ, ...), so that dK
  and dV stay row-major per key.
* :mod:`.dkdv_d256` — the dK/dV kernel at head_dim 256 (the two consumers split one key
  block).
* :mod:`.dq` — the deterministic dQ kernel.

**dQ, two modes** (``MosaicBackwardConfig.deterministic``):

* deterministic (the default at head_dim 256, for causal sequences up to 2048 tokens at
  head_dim 65-128, wherever the call asks for it with ``attention(..., deterministic=True)``
  or ``XLA_FLAGS`` has ``--xla_gpu_deterministic_ops``
  (:func:`pallas_flash.dispatch.deterministic_backward`), and beside bias / mask rings
  the fused dQ cannot fit) — the dQ kernel (:mod:`.dq`), one CTA per
  ``2·dq_block_q`` query rows of one head; each consumer owns ``dq_block_q`` rows and the
  producer streams (K_j, V_j)::

      S = Q_i·K_jᵀ   P = exp2(S·scale·log2e − lse_i)   dP = dO_i·V_jᵀ
      dS = P ∘ (dP − delta_i)                           dQ_i += dS·K_j

  Every dQ tile is written by exactly one CTA, so the result is bitwise reproducible. The
  price is recomputing S and dP: seven GEMMs instead of five.
* fused (FA3) — the dK/dV consumers publish dSᵀ of the streamed query block in SMEM and
  add ``dS·K`` into a zeroed float32 dQ in GMEM with TMA reduce-adds;
  the order of the additions varies between runs. Once both dSᵀ of the step are in SMEM
  (the ``exchanged`` barrier), dS·K over all the CTA's keys is added once per step — one
  reduce-add of the CTA's partial, which halves the float32 staging stores and the L2
  traffic of each consumer adding its own. At head_dim 128 the two consumers share that
  work as FA3 does (:func:`~pallas_flash.mosaic.config.splits_dq`): consumer c adds
  columns ``[c·D/2, (c+1)·D/2)``, with a [block_q, D/2] accumulator, one step late: at
  step t it adds step t-1's dQ, so that one proxy fence serves both the dQ staging tile
  and step t's dSᵀ, and the exchange it waits for is one the other consumer finished a
  step ago. At head_dim 64 the halves would cut a swizzle width, so the consumer that owns
  the step's ring slot adds all of it, with K and V in registers; that
  is the faster mode there. Both are the default up to head_dim 128, but for short
  causal sequences at 128
  (:func:`~pallas_flash.mosaic.config.default_backward_config` has the timings and where
  their time goes). Interpret mode has no TMA reduce-add: there each consumer stores its
  partial sums per key tile, and XLA adds them.

**Block skipping** comes from :class:`~pallas_flash.masking.MaskSpec`: ``q_blocks`` (dK/dV)
and ``kv_blocks`` (dQ) give ``(first, full_first, full_last, last)``; blocks outside the
CTA's ``[first, last)`` are never loaded, a consumer's ``[full_first, full_last)`` runs the
unmasked loop, the boundary blocks build the mask tile, and blocks that only the other
consumer needs are stepped through without math (to keep the ring in lockstep).

**Segment ids** (packed documents; padding lengths arrive as ids too), as the forward:
each consumer's band is cut to the span of walked blocks whose ids can meet its owned
block (:func:`pallas_flash.segments.tile_spans`: query blocks per key block for dK/dV, key
blocks per query block for dQ), the producer streams the hull of the two consumers'
ranges, and every visited block is masked, comparing the owned ids (loaded once from GMEM)
with the walked block's (an int32 ring in SMEM, filled by TMA next to the data on lse's
(dK/dV) or K's (dQ) ready barrier and read before the slot is freed). A query that sees no
key has lse = ``EMPTY_ROW_LSE`` and only hidden (−inf) logits, so its P, dS and dQ are 0.

**Row bounds** (:class:`~pallas_flash.contract.RowBounds`) become segment ids
(:func:`pallas_flash.contract.segment_ids_with_bounds`): the blocks outside the bounds are
skipped as above, but every visited block is masked (the forward cuts its blocks to the
bounds directly).

**Soft-capping**: the logits are ``c·tanh(scale·s/c)`` (``tanh.approx``, as the forward),
so dS is multiplied by the cap's derivative ``1 − tanh²`` before the dK and dQ GEMMs
(:func:`pallas_flash.logits.log2_logits`); hidden pairs are masked after the cap.

**Head dim 256**: dK and dV of 64 keys are 256 f32 registers per thread on their own,
above the 240 a consumer can hold, so the two consumers of a CTA split one key block
(:mod:`.dkdv_d256`), and the dQ kernel streams 32-key blocks (Q and dO of its two
consumers fill 128 KiB), with 64-byte swizzled tiles (:class:`.BackwardStatic`).

**Bias / mask arrays** are read with the forward's readers
(:class:`~pallas_flash.mosaic.logit_arrays.LogitArray`): the dQ kernel as the forward does (tiles
or key rows in rings next to K, query rows once), the dK/dV kernel on the arrays transposed
to ``[B', N', S, T]``, so that its tiles come laid out as Sᵀ (tiles or query rows in rings
next to lse, key rows once per head). The transpose is an XLA copy of the array as the
kernel reads it (broadcast dims stay 1): one more pass over a ``[.., T, S]`` bias. A mask
that broadcasts to the bias's shape is folded into it as −inf; any other mask makes every
block take the masked path. The rings are fitted
to shared memory by :func:`~pallas_flash.mosaic.config.fit_backward_logit_rings`. dbias is not
computed here.

**Refused calls** (:func:`unsupported_backward` says why; the dispatcher,
:mod:`pallas_flash.dispatch`, then picks another backend's backward): float32, head dims
129-192, dbias, and bias / mask arrays above head_dim 128.

**CPU testing**: Mosaic GPU interpret mode cannot run a wgmma whose A operand is in
registers. With ``interpret=True`` the A operands (Pᵀ, dSᵀ, dS) are stored to an SMEM
scratch tile first (:func:`~pallas_flash.mosaic.tiles.a_operand`); everything else is the
same code on both paths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_flash.contract import RowBounds, segment_ids_with_bounds
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import bounds as row_bounds
from pallas_flash.mosaic.backward.common import BackwardStatic
from pallas_flash.mosaic.backward.dkdv import call_dkdv
from pallas_flash.mosaic.backward.dkdv_d256 import call_dkdv_d256
from pallas_flash.mosaic.backward.dq import call_dq
from pallas_flash.mosaic.backward.dq_bulk import accumulator_shape, convert_dq
from pallas_flash.mosaic.config import (
    MAX_HEAD_DIM,
    MAX_PER_CONSUMER_HEAD_DIM,
    NUM_CONSUMERS,
    backward_config,
    fit_backward_logit_rings,
    padded_head_dim,
)
from pallas_flash.mosaic.logit_arrays import fold_mask, logit_array, logit_operand
from pallas_flash.mosaic.tiles import DTYPES, LOG2E, SWIZZLE, pad_operand
from pallas_flash.padding import pad_axis, round_up
from pallas_flash.segments import pad_segment_ids, tile_spans


def unsupported(q_shape, dtype, has_segments: bool, softcap: float | None = None
                ) -> str | None:
    """Why the Mosaic GPU kernels cannot run a backward of this dtype and head dim, or
    None (:func:`unsupported_backward` has the rest). Segment ids (hence padding lengths)
    and soft-capping are supported.
    """
    del has_segments, softcap
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU backward takes bfloat16 or float16, got {jnp.dtype(dtype)}"
    dim = padded_head_dim(q_shape[-1])
    if MAX_PER_CONSUMER_HEAD_DIM < dim < MAX_HEAD_DIM:
        return (f"head_dim {q_shape[-1]}: dK and dV of 64 keys do not fit a consumer "
                f"warpgroup's registers above head_dim {MAX_PER_CONSUMER_HEAD_DIM}, and "
                "only head_dim 256 splits into two 128-column halves")
    return None


def unsupported_backward(q_shape, kv_shape, dtype, mask: MaskSpec, has_segments: bool,
                         softcap: float | None = None, has_bias: bool = False,
                         has_mask: bool = False, bias_grad: bool = False,
                         value_head_dim: int | None = None) -> str | None:
    """Why the Mosaic GPU backward cannot run this call, or None (the dispatcher's
    interface, :mod:`pallas_flash.dispatch`).

    Refused: dtypes other than bfloat16 / float16, head dims 129-192 (:func:`unsupported`),
    ``bias_grad`` (dbias), and bias / mask arrays above head_dim 128 (at 256 the dK/dV
    kernel's two consumers split one key block, with no room for their rings).
    """
    # Other value head dims never get here: the forward's check refuses them first
    # (pallas_flash.dispatch.unsupported_backward).
    del kv_shape, mask, value_head_dim
    reason = unsupported(q_shape, dtype, has_segments, softcap)
    if reason is not None:
        return reason
    if bias_grad:
        return "the Mosaic GPU backward does not compute dbias (bias_grad)"
    if (has_bias or has_mask) and padded_head_dim(q_shape[-1]) > MAX_PER_CONSUMER_HEAD_DIM:
        return (f"head_dim {q_shape[-1]}: the Mosaic GPU backward reads bias / mask arrays "
                f"only up to head_dim {MAX_PER_CONSUMER_HEAD_DIM}")
    return None


def backward(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids, out: jax.Array,
             lse: jax.Array, d_out: jax.Array, delta: jax.Array, *, mask: MaskSpec,
             scale: float, config, interpret: bool, softcap: float | None = None,
             bias: jax.Array | None = None, attn_mask: jax.Array | None = None,
             bounds: RowBounds | None = None, bias_grad: bool = False,
             deterministic: bool = False) -> tuple[jax.Array, ...]:
    """(dq, dk, dv) of attention on Hopper, and dbias when ``bias_grad``.

    Args:
      q, d_out: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim].
      out: unused (delta already holds rowsum(dO ∘ O)).
      lse, delta: [batch, heads, seq_q] float32; lse in natural log, delta minus the lse
        cotangent (:mod:`pallas_flash.autodiff`).
      config: any of :data:`~pallas_flash.mosaic.config.CONFIG_TYPES`: its backward part
        (a ``MosaicBackwardConfig``, alone or in a ``MosaicCallConfig``), else the tiling
        of :func:`~pallas_flash.mosaic.config.default_backward_config`.
      interpret: run in Mosaic GPU interpret mode on the CPU.
      bias, attn_mask: None or canonical ``[B', N', T', S']`` (:mod:`pallas_flash.bias`),
        read by both kernels (see the module docstring).
      bounds: None or :class:`~pallas_flash.contract.RowBounds` (int32 ``[batch]`` each):
        rows ``>= q_end`` get dq 0 and add nothing to dk / dv, keys outside ``[kv_start,
        kv_end)`` get dk = dv = 0. Taken as segment ids
        (:func:`pallas_flash.contract.segment_ids_with_bounds`): the blocks outside the
        bounds are skipped, every visited one is masked. Hidden K /
        V rows and padding Q / dO rows are zeroed first (one pass over each).
      bias_grad: must be False (dbias is not computed here).
      deterministic: the call's ``attention(..., deterministic=...)``: the separate dQ
        kernel, whatever the heuristic's choice (:func:`~pallas_flash.mosaic.config.
        backward_config`).

    Raises:
      ValueError: :func:`unsupported_backward` refuses the call (its reason), or
        ``deterministic`` with a given backward config of the fused dQ.

    Any lengths work:
    sequences are zero-padded to whole CTAs (padded rows get lse = +inf, so P = 0; padded
    keys are hidden by ``mask.seq_kv``) and the head dim to a multiple of 64.
    """
    del out
    if bounds is not None:
        bounds = row_bounds.checked(bounds, q.shape[0])
        q, d_out = (row_bounds.outside_zeroed(x, bounds, axis=1, keys=False)
                    for x in (q, d_out))
        k, v = (row_bounds.outside_zeroed(x, bounds, axis=1, keys=True) for x in (k, v))
        segment_ids = segment_ids_with_bounds(segment_ids, bounds, q.shape[1], k.shape[1])
    segmented = segment_ids is not None
    dim = padded_head_dim(q.shape[-1])
    reason = unsupported_backward(q.shape, k.shape, q.dtype, mask, segmented, softcap,
                                  has_bias=bias is not None, has_mask=attn_mask is not None,
                                  bias_grad=bias_grad)
    if reason is not None:
        raise ValueError(reason)
    config = backward_config(config, q.shape, k.shape, q.dtype, mask,
                             deterministic=deterministic)
    _, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    itemsize = jnp.dtype(q.dtype).itemsize
    dq_logits, dkdv_logits, rings = _logit_readers(bias, attn_mask)
    # A mask array left after folding (one that does not broadcast to the bias's shape).
    has_mask_array = any(a.is_mask for _, a in dq_logits)
    config = fit_backward_logit_rings(config, dim, itemsize, segments=segmented, **rings)
    config.check_fits(dim, itemsize, segments=segmented, **rings)
    # One padded length serves both kernels: whole dK/dV query blocks and dQ CTAs, whole
    # dK/dV CTAs and dQ key blocks (all block sizes are powers of two times 64).
    seq_q_pad = round_up(seq_q, max(config.block_q, NUM_CONSUMERS * config.dq_block_q))
    seq_kv_pad = round_up(seq_kv, max(NUM_CONSUMERS * config.block_kv, config.dq_block_kv))
    q_p, do_p = (pad_operand(x, seq_q_pad, dim) for x in (q, d_out))
    k_p, v_p = (pad_operand(x, seq_kv_pad, dim) for x in (k, v))
    # lse in base 2 (the kernels' exponent); padded rows get +inf so that their P is 0.
    # Rows that see no key have lse = EMPTY_ROW_LSE and only hidden (-inf) logits: P = 0.
    lse2 = pad_axis(lse * LOG2E, 2, seq_q_pad, jnp.inf)
    delta = pad_axis(delta, 2, seq_q_pad)
    fuse_dq = not config.deterministic
    common = dict(
        mask=mask, scale=scale, num_stages=config.num_stages,
        head_dim=dim, dtype=jnp.dtype(q.dtype), group=heads // kv_heads,
        needs_mask=(not mask.is_dense or seq_kv_pad != seq_kv or segmented
                    or has_mask_array),
        fuse_dq=fuse_dq, dq_partials=fuse_dq and interpret and not config.bulk_dq,
        bulk_dq=fuse_dq and config.bulk_dq, interpret=interpret, softcap=softcap,
        segmented=segmented)
    operands = (q_p, k_p, v_p, do_p, lse2, delta)
    ids = pad_segment_ids(segment_ids, seq_q_pad, seq_kv_pad) if segmented else None
    with_ids = functools.partial(_kernel_operands, operands, ids, dq_logits, dkdv_logits,
                                 (seq_q_pad, seq_kv_pad))

    # Up to head_dim 128 a dK/dV CTA holds one key block per consumer; at 256 its two
    # consumers split one block (backward_d256).
    split = dim > MAX_PER_CONSUMER_HEAD_DIM
    dkdv_static = BackwardStatic(
        block_q=config.block_q, block_kv=config.block_kv,
        num_q_blocks=seq_q_pad // config.block_q,
        num_tiles=seq_kv_pad // ((1 if split else NUM_CONSUMERS) * config.block_kv),
        # Split: dV/dK contract over the 32 rows of a consumer's half of the query block.
        swizzle=min(SWIZZLE, config.block_q // NUM_CONSUMERS * itemsize) if split
        else SWIZZLE, **_static_fields(dkdv_logits), **common)
    dkdv_operands = with_ids(dkdv_static, walk_kv=False)  # owns key tiles, walks queries
    if fuse_dq:
        dq, dk, dv = _fused_dq(dkdv_static, dkdv_operands, interpret=interpret)
    else:
        if split:
            dk, dv = call_dkdv_d256(dkdv_static, dkdv_operands, interpret=interpret)
        else:
            dk, dv = call_dkdv(dkdv_static, dkdv_operands, None, interpret=interpret)
        dq_static = BackwardStatic(block_q=config.dq_block_q, block_kv=config.dq_block_kv,
                            num_q_blocks=seq_q_pad // config.dq_block_q,
                            num_tiles=seq_q_pad // (NUM_CONSUMERS * config.dq_block_q),
                            swizzle=min(SWIZZLE, config.dq_block_kv * itemsize),
                            **_static_fields(dq_logits), **common)
        dq = call_dq(dq_static, with_ids(dq_static, walk_kv=True), interpret=interpret)
    return (dq[:, :seq_q, :, :head_dim], dk[:, :seq_kv, :, :head_dim],
            dv[:, :seq_kv, :, :head_dim])


def _kernel_operands(operands, ids, dq_logits, dkdv_logits, padded_lengths,
                     st: BackwardStatic, *, walk_kv: bool) -> tuple:
    """A kernel's operands: ``operands``, then with segment ids the ids and the spans of
    the kernel's tiles, then the bias / mask operands in the kernel's orientation."""
    seq_q_pad, seq_kv_pad = padded_lengths
    extra = () if ids is None else (
        *ids, tile_spans(*ids, st.block_q, st.block_kv, walk_kv=walk_kv))
    if walk_kv:  # the dQ kernel
        arrays = [logit_operand(x, a, seq_q_pad, seq_kv_pad) for x, a in dq_logits]
    else:
        arrays = [logit_operand(x, a, seq_kv_pad, seq_q_pad) for x, a in dkdv_logits]
    return (*operands, *extra, *arrays)


def _logit_readers(bias, attn_mask):
    """``(dq_logits, dkdv_logits, rings)``: each kernel's (operand, reader) pairs of the
    bias / mask arrays and the SMEM rings they need (``dkdv_rings`` / ``dq_rings``).

    The dQ kernel reads them as the forward does, the dK/dV kernel transposed
    ([B', N', S, T]), so that its tiles are laid out as Sᵀ. A mask that broadcasts to the
    bias's shape is folded into it first.
    """
    bias, attn_mask = fold_mask(bias, attn_mask)
    logits = [(x, is_mask) for x, is_mask in ((bias, False), (attn_mask, True))
              if x is not None]
    dq_logits = [(x, logit_array(x, is_mask=m)) for x, m in logits]
    dkdv_logits = [(x, logit_array(x, is_mask=m))
                   for x, m in ((jnp.swapaxes(x, 2, 3), m) for x, m in logits)]
    rings = {name: tuple(a.ring for _, a in arrays if a.ring is not None)
             for name, arrays in (("dkdv_rings", dkdv_logits), ("dq_rings", dq_logits))}
    return dq_logits, dkdv_logits, rings


def _static_fields(arrays) -> dict:
    """BackwardStatic's bias / attn_mask fields for one kernel's readers."""
    by_kind = {a.is_mask: a for _, a in arrays}
    return dict(bias=by_kind.get(False), attn_mask=by_kind.get(True))


def _fused_dq(st: BackwardStatic, operands, *, interpret: bool):
    """(dq, dk, dv) padded, from the dK/dV kernel alone: it reduce-adds dS·K into a
    zeroed float32 dQ (interpret mode: a partial sum per consumer and key tile, summed
    here); dQ is scaled once at the end, as dK is in the kernel."""
    q_p = operands[0]
    partials = (NUM_CONSUMERS * st.num_tiles,) if st.dq_partials else ()
    shape = accumulator_shape(st, q_p.shape) if st.bulk_dq else (*partials, *q_p.shape)
    dq_acc = jax.new_ref(jnp.zeros(shape, jnp.float32))
    dk, dv = call_dkdv(st, operands, dq_acc, interpret=interpret)
    dq = jax.freeze(dq_acc)
    if st.bulk_dq:  # fragment-ordered tiles (dq_bulk)
        return convert_dq(st, dq, q_p.dtype), dk, dv
    return ((dq.sum(0) if partials else dq) * st.scale).astype(q_p.dtype), dk, dv

"""The bulk dQ mode of the Mosaic backward (``MosaicBackwardConfig.bulk_dq``, FA3's dQ
path: register-order staging, non-tensor bulk reduce-adds, named barriers) on a real
Hopper GPU, against the default fused dQ (TMA reduce-adds) and the float64 oracle.

Skipped unless the default device is a GPU of compute capability 9.0. Each case computes
``(out, lse)`` with the Mosaic forward, then ``(dq, dk, dv)`` with both dQ modes of the
same tiling (``default_backward_config``'s, with ``deterministic=False``), in one jitted
function: both against the oracle (‖got − ref‖ / ‖ref‖ < 1e-2, as the other GPU backward
tests; NaN never passes), and the bulk mode against the fused one (dQ: the same sums in
another order; dK, dV: the same GEMMs).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err

import pallas_flash
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, default_backward_config, default_config
from pallas_flash.mosaic import forward as mosaic_forward
from pallas_flash.reference import attention_float64

mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16 = jnp.bfloat16


def _both_modes(q, k, v, d_out, mask: MaskSpec, scale: float):
    """((dq, dk, dv) of the fused dQ, (dq, dk, dv) of the bulk dQ)."""
    tiling = default_backward_config(q.shape, k.shape, q.dtype, mask)
    configs = [MosaicBackwardConfig(block_q=tiling.block_q, dq_block_kv=tiling.dq_block_kv,
                                    num_stages=tiling.num_stages, deterministic=False,
                                    bulk_dq=bulk) for bulk in (False, True)]

    def run(q, k, v, d_out):
        fwd_config = default_config(q.shape, k.shape, q.dtype, mask)
        out, lse = mosaic_forward(q, k, v, None, mask=mask, scale=scale, config=fwd_config,
                                  interpret=False)
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        return tuple(mosaic_backward.backward(q, k, v, None, out, lse, d_out, delta,
                                              mask=mask, scale=scale, config=config,
                                              interpret=False)
                     for config in configs)
    return jax.jit(run)(q, k, v, d_out)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("batch", "seq", "heads", "kv_heads"), [
    (2, 2048, 8, 2),  # GQA
    (1, 4096, 16, 16),
    (1, 1000, 4, 1),  # odd length, MQA: padded rows and keys
])
def test_bulk_dq_matches_fused_and_oracle(head_dim, causal, batch, seq, heads, kv_heads):
    mask = MaskSpec(seq_q=seq, seq_kv=seq, is_causal=causal)
    q, k, v, d_out = random_qkv(batch, seq, seq, heads, kv_heads, head_dim, BF16)
    scale = head_dim ** -0.5
    fused, bulk = _both_modes(q, k, v, d_out, mask, scale)
    _, _, want = attention_float64(q, k, v, scale=scale, mask=mask,
                                   d_out=np.asarray(d_out, np.float64))
    for name, f, b, ref, x in zip("qkv", fused, bulk, want, (q, k, v), strict=True):
        assert b.shape == x.shape and b.dtype == x.dtype, name
        assert rel_err(b, ref) < 1e-2, f"bulk d{name}: relative error {rel_err(b, ref)}"
        assert rel_err(f, ref) < 1e-2, f"fused d{name}: relative error {rel_err(f, ref)}"
        # Both round the same float32 sums to bf16 (dQ's in another order).
        assert rel_err(b, f) < 1e-2, f"d{name}: bulk vs fused {rel_err(b, f)}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bulk_dq_through_the_api(head_dim):
    """``pallas_flash.attention(..., config=MosaicBackwardConfig(bulk_dq=True))``: the
    gradients of a causal GQA call, against the default backward's."""
    q, k, v, d_out = random_qkv(2, 1536, 1536, 8, 2, head_dim, BF16)
    bulk = MosaicBackwardConfig(deterministic=False, bulk_dq=True)

    def grads(config):
        def f(q, k, v):
            return pallas_flash.attention(q, k, v, is_causal=True, implementation="mosaic",
                                          config=config)
        _, vjp = jax.vjp(f, q, k, v)
        return jax.jit(vjp)(d_out)

    for name, b, d in zip("qkv", grads(bulk), grads(None), strict=True):
        assert rel_err(b, d) < 1e-2, f"d{name}: bulk vs default {rel_err(b, d)}"

"""``attention(config=...)`` reaches both passes of the Mosaic backend.

A ``MosaicConfig`` sets the forward, a ``MosaicBackwardConfig`` the backward, a
``MosaicCallConfig`` either or both; the pass not given takes its heuristic. Each kernel
checks the config it gets against the shared-memory budget, so a config that cannot fit
shows which pass received it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_flash
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import (
    MosaicBackwardConfig,
    MosaicCallConfig,
    MosaicConfig,
    default_backward_config,
    default_config,
)
from pallas_flash.mosaic.config import backward_config, forward_config
from pallas_flash.reference import attention_float64
from pallas_flash.triton import TritonConfig
from tests.support import random_qkv, rel_err

# At head_dim 256 neither of these fits an sm90 CTA's shared memory.
TOO_BIG_FORWARD = MosaicConfig(block_q=128, block_kv=256, num_stages=4)
TOO_BIG_BACKWARD = MosaicBackwardConfig(block_q=128, dq_block_kv=128, num_stages=4)


def _loss(config, head_dim=256):
    q, k, v, _ = random_qkv(1, 128, 128, 2, 1, head_dim, jnp.bfloat16)

    def loss(q, k, v):
        out = pallas_flash.attention(q, k, v, implementation="mosaic", interpret=True,
                                     config=config)
        return jnp.sum(out.astype(jnp.float32))
    return loss, (q, k, v)


@pytest.mark.parametrize("config", [TOO_BIG_FORWARD, MosaicCallConfig(forward=TOO_BIG_FORWARD)])
def test_forward_config_reaches_the_forward(config):
    loss, args = _loss(config)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(loss, *args)


@pytest.mark.parametrize("config", [TOO_BIG_BACKWARD, MosaicCallConfig(backward=TOO_BIG_BACKWARD)])
def test_backward_config_reaches_the_backward(config):
    loss, args = _loss(config)
    jax.eval_shape(loss, *args)  # the forward takes its heuristic and fits
    with pytest.raises(ValueError, match="MosaicBackwardConfig"):
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), *args)


def test_the_pass_not_given_takes_its_heuristic():
    shape, mask = (1, 4096, 8, 128), MaskSpec(seq_q=4096, seq_kv=4096, is_causal=True)
    fwd, bwd = MosaicConfig(block_kv=64), MosaicBackwardConfig(num_stages=3)
    args = (shape, shape, jnp.bfloat16, mask)
    assert forward_config(fwd, *args) == fwd
    assert backward_config(fwd, *args) == default_backward_config(*args)
    assert forward_config(bwd, *args) == default_config(*args)
    assert backward_config(MosaicCallConfig(forward=fwd, backward=bwd), *args) == bwd
    assert forward_config(MosaicCallConfig(), *args) == default_config(*args)


def test_call_config_checks_its_fields():
    with pytest.raises(ValueError, match="forward must be a MosaicConfig"):
        MosaicCallConfig(forward=MosaicBackwardConfig())
    with pytest.raises(ValueError, match="backward must be a MosaicBackwardConfig"):
        MosaicCallConfig(backward=MosaicConfig())


def test_attention_names_the_accepted_configs():
    q, k, v, _ = random_qkv(1, 64, 64, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="MosaicCallConfig"):
        pallas_flash.attention(q, k, v, implementation="mosaic", interpret=True,
                               config=TritonConfig())


def test_fused_dq_chosen_through_the_api_matches_the_reference():
    """The backward config picks the dQ mode: the fused dQ (its interpret-mode partial
    sums) through ``attention``, gradients against the float64 reference."""
    q, k, v, d_out = random_qkv(1, 192, 192, 4, 2, 64, jnp.bfloat16)
    config = MosaicCallConfig(backward=MosaicBackwardConfig(deterministic=False))

    def grads(fn):
        return jax.vjp(fn, q, k, v)[1](d_out)

    got = grads(lambda q, k, v: pallas_flash.attention(
        q, k, v, is_causal=True, implementation="mosaic", interpret=True, config=config))
    _, _, want = attention_float64(q, k, v, mask=MaskSpec(seq_q=192, seq_kv=192,
                                                          is_causal=True), d_out=d_out)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-2

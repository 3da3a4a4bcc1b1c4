"""``pallas_flash.attention`` with ``score_mod``, ``mask_mod`` and ``block_mask``: on the
XLA path (the default) and the Triton flex kernels (interpret mode), forward, lse and
gradients against the float64 oracle with the same functions written as dense masks and
biases; what the planner refuses, and why."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from tests.support import assert_matches, fresh_rng

B, T, N, K, D = 2, 80, 4, 2, 32
BACKENDS = [("xla", {}), ("triton", {"interpret": True})]


def _inputs():
    rng = fresh_rng()
    q, k, v, d_out = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
                      ((B, T, N, D), (B, T, K, D), (B, T, K, D), (B, T, N, D)))
    return q, k, v, d_out


def _run(q, k, v, d_out, **kwargs):
    def loss(q, k, v):
        out, lse = pf.attention(q, k, v, return_lse=True, **kwargs)
        return jnp.sum(out * d_out), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, lse, grads


def _dense(fn, batch_dims=(B, N)):
    """A mask_mod / score-term as a dense [B, N, T, T] array (the oracle's form)."""
    b, h, i, j = np.meshgrid(*(np.arange(n) for n in (*batch_dims, T, T)), indexing="ij")
    return np.asarray(fn(jnp.asarray(b), jnp.asarray(h), jnp.asarray(i), jnp.asarray(j)))


@pytest.mark.parametrize("implementation,options", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_documents_and_alibi(implementation, options):
    """Document masking over captured ids ANDed with causality (a mask_mod), ALiBi over
    captured slopes (a score_mod), sinks: everything against the oracle's dense form."""
    q, k, v, d_out = _inputs()
    ids = jnp.asarray(np.sort(fresh_rng().integers(0, 3, (B, T)), axis=1), jnp.int32)
    slopes = jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)
    sinks = jnp.asarray(fresh_rng().standard_normal(N), jnp.float32)

    def documents(b, h, i, j):
        del h
        return (ids[b, i] == ids[b, j]) & (i >= j)

    def alibi(score, b, h, i, j):
        del b
        return score - slopes[h] * (i - j).astype(jnp.float32)

    out, lse, grads = _run(q, k, v, d_out, mask_mod=documents, score_mod=alibi,
                           sinks=sinks if implementation == "xla" else None,
                           implementation=implementation, **options)
    visible = _dense(documents)
    bias = np.broadcast_to(-np.asarray(slopes)[None, :, None, None]
                           * (np.arange(T)[:, None] - np.arange(T)[None, :]), visible.shape)
    ref = attention_float64(q, k, v, scale=1 / np.sqrt(D), mask=MaskSpec(T, T),
                            bias=bias, attn_mask=visible, d_out=d_out,
                            sinks=sinks if implementation == "xla" else None)
    assert_matches(out, lse, grads, ref[0], ref[1], ref[2][:3], jnp.float32)


@pytest.mark.parametrize("implementation,options", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_causal_as_mask_mod_equals_is_causal(implementation, options):
    q, k, v, _ = _inputs()
    block_mask = pf.create_block_mask(lambda b, h, i, j: i >= j, seq_q=T, seq_kv=T,
                                       block_size=(32, 16))
    by_block_mask = pf.attention(q, k, v, block_mask=block_mask,
                                 implementation=implementation, **options)
    by_mask_mod = pf.attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j,
                               implementation=implementation, **options)
    built_in = pf.attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(by_block_mask, built_in, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(by_mask_mod, built_in, rtol=1e-5, atol=1e-6)


def test_xla_combines_functions_with_every_option():
    """Prefix-LM as a mask_mod, with soft cap, segment ids and lengths (the XLA path)."""
    q, k, v, d_out = _inputs()
    prefix = 24
    seg = jnp.asarray(np.repeat([[0, 1]], B, 0).repeat(T // 2, 1), jnp.int32)
    lengths = jnp.asarray([T, 61], jnp.int32)

    def prefix_lm(b, h, i, j):
        del b, h
        return (j < prefix) | (i >= j)

    out, lse, grads = _run(q, k, v, d_out, mask_mod=prefix_lm, logits_soft_cap=5.0,
                           q_segment_ids=seg, key_value_seq_lengths=lengths)
    visible = _dense(prefix_lm) & (np.arange(T)[None, None, None, :]
                                   < np.asarray(lengths)[:, None, None, None])
    ref = attention_float64(q, k, v, scale=1 / np.sqrt(D), mask=MaskSpec(T, T),
                            segment_ids=(seg, seg), softcap=5.0, attn_mask=visible,
                            d_out=d_out)
    assert_matches(out, lse, grads, ref[0], ref[1], ref[2][:3], jnp.float32)


def test_new_captured_values_compile_once():
    q, k, v, _ = _inputs()
    traces = []

    @jax.jit
    def run(q, k, v, ids):
        traces.append(1)
        return pf.attention(q, k, v, mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j])

    for seed in range(2):
        ids = jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (B, T)), 1),
                          jnp.int32)
        jax.block_until_ready(run(q, k, v, ids))
    assert len(traces) == 1


@pytest.mark.parametrize("kwargs,message", [
    (dict(mask_mod=3), "mask_mod must be a function"),
    (dict(score_mod="alibi"), "score_mod must be a function"),
    (dict(block_mask=np.ones((2, 2))), "block_mask must be a pallas_flash.BlockMask"),
    (dict(mask_mod=lambda b, h, i: i > 0), "mask_mod"),
    (dict(mask_mod=lambda b, h, i, j: i >= j, implementation="mosaic"),
     "run on implementation 'triton' or 'xla'"),
    (dict(mask_mod=lambda b, h, i, j: i >= j, is_causal=True, implementation="triton",
          interpret=True), "express them in mask_mod"),
])
def test_bad_calls_name_the_argument(kwargs, message):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=message):
        pf.attention(q, k, v, **kwargs)


def test_block_mask_for_other_lengths_is_refused():
    q, k, v, _ = _inputs()
    block_mask = pf.create_block_mask(lambda b, h, i, j: i >= j, seq_q=T + 1, seq_kv=T)
    with pytest.raises(ValueError, match="block_mask"):
        pf.attention(q, k, v, block_mask=block_mask)

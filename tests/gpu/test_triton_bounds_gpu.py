"""Compiled Triton kernels, called directly, with row bounds and with head dims the API's
check does not pass yet (value head dim != query head dim, up to 512), vs a float32 XLA
reference, at real sizes and with each config's default tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash.contract import EMPTY_ROW_LSE, RowBounds
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import standard_attention
from pallas_flash.triton import KERNELS, default_config

CASES = [
    # (batch, seq_q, seq_kv, heads, kv_heads, head_dim, value_dim, causal, dtype, bounds)
    # bounds: per sequence (q_end, kv_start, kv_end), or None.
    (3, 1000, 1500, 8, 2, 128, 128, True, jnp.bfloat16,
     ((1000, 0, 1500), (700, 200, 1300), (0, 0, 1500))),
    (2, 2048, 2048, 8, 8, 64, 64, False, jnp.float16, ((1500, 100, 1999), (2048, 7, 7))),
    (2, 513, 513, 4, 1, 192, 192, True, jnp.float32, ((513, 0, 300), (400, 100, 513))),
    (1, 1024, 1024, 8, 8, 192, 128, True, jnp.bfloat16, None),
    (1, 1024, 1024, 8, 4, 64, 128, False, jnp.bfloat16, None),
    (1, 1024, 1024, 8, 8, 512, 512, True, jnp.bfloat16, None),
    (1, 777, 777, 4, 4, 320, 320, False, jnp.bfloat16, ((600, 50, 700),)),
    (1, 512, 512, 4, 4, 512, 512, True, jnp.float32, None),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_kernels_match_reference(case):
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, value_dim, causal, dtype, bounds = case
    keys = jax.random.split(jax.random.PRNGKey(seq_q * head_dim + value_dim), 4)
    q = jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_kv, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_kv, kv_heads, value_dim), dtype)
    d_out = jax.random.normal(keys[3], (batch, seq_q, heads, value_dim), dtype)
    mask = MaskSpec(seq_q, seq_kv, causal)
    config = default_config(q.shape, k.shape, dtype, mask)
    scale = 1.0 / np.sqrt(head_dim)
    q_in = np.ones((batch, seq_q), bool)
    k_in = np.ones((batch, seq_kv), bool)
    kwargs = {}
    if bounds is not None:
        q_end, kv_start, kv_end = (np.asarray(x)[:, None] for x in zip(*bounds, strict=True))
        q_in = np.arange(seq_q)[None] < q_end
        k_in = (np.arange(seq_kv)[None] >= kv_start) & (np.arange(seq_kv)[None] < kv_end)
        kwargs["bounds"] = RowBounds(*(jnp.asarray(x[:, 0], jnp.int32)
                                       for x in (q_end, kv_start, kv_end)))

    def nan_outside(x, inside):  # the kernels must never let these through
        return jnp.where(jnp.asarray(inside)[:, :, None, None], x, jnp.nan).astype(x.dtype)

    @jax.jit
    def ours(q, k, v, d_out):
        out, lse = KERNELS.forward(q, k, v, None, mask=mask, scale=scale, config=config,
                                   interpret=False, **kwargs)
        delta = jnp.einsum("btnd,btnd->bnt", d_out.astype(jnp.float32),
                           out.astype(jnp.float32))
        return out, lse, KERNELS.backward(q, k, v, None, out, lse, d_out, delta, mask=mask,
                                          scale=scale, config=config, interpret=False,
                                          **kwargs)

    out, lse, grads = ours(nan_outside(q, q_in), nan_outside(k, k_in), nan_outside(v, k_in),
                           nan_outside(d_out, q_in))

    dense = jnp.asarray(q_in[:, None, :, None] & k_in[:, None, None, :])

    def ref(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        with jax.default_matmul_precision("highest"):
            return standard_attention(q, k, v, scale=scale, mask=mask, attn_mask=dense)

    (ref_out, ref_lse), vjp = jax.vjp(ref, q, k, v)
    ref_grads = vjp((jnp.where(jnp.asarray(q_in)[:, :, None, None], d_out, 0)
                     .astype(jnp.float32), jnp.zeros_like(ref_lse)))
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    assert out.shape == (batch, seq_q, heads, value_dim)
    assert _rel(out, ref_out) < tol
    seen = np.asarray(ref_lse) > EMPTY_ROW_LSE / 2
    assert _rel(np.asarray(lse)[seen], np.asarray(ref_lse)[seen]) < 1e-4
    assert np.all(np.asarray(lse)[~seen] == np.float32(EMPTY_ROW_LSE))
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.shape == want.shape
        assert _rel(got, want) < 2 * tol

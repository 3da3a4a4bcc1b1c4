"""Per-sequence row bounds in the Mosaic GPU kernels on a real Hopper GPU, bfloat16, at
real sizes with the default configs.

Skipped unless the default device is a GPU of compute capability 9.0. The same checks as
``tests/test_mosaic_bounds.py``: out, lse, dq, dk, dv against the float64 oracle (on the
CPU) given the equivalent dense mask, every element; padding rows out 0 and lse
``EMPTY_ROW_LSE``, dq 0 there and dk = dv = 0 at hidden keys; NaN in the hidden K/V rows
and the padding query rows must not reach any output; sequences with ``q_end`` or
``kv_end`` 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_flash import mosaic
from pallas_flash.contract import RowBounds
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16 = jnp.bfloat16


def _bounds(batch: int, seq_q: int, seq_kv: int, rng) -> RowBounds:
    q_end = rng.integers(1, seq_q + 1, batch)
    kv_start = rng.integers(0, seq_kv // 2, batch)
    kv_end = rng.integers(kv_start + 1, seq_kv + 1)
    q_end[1] = 0
    kv_start[2] = kv_end[2] = rng.integers(0, seq_kv)
    return RowBounds(*(jnp.asarray(x, jnp.int32) for x in (q_end, kv_start, kv_end)))


def _inside(bounds: RowBounds, seq_q: int, seq_kv: int):
    """([batch, seq_q] real rows, [batch, seq_kv] visible keys) as NumPy bools."""
    q_end, kv_start, kv_end = (np.asarray(x)[:, None] for x in bounds)
    keys = np.arange(seq_kv)[None]
    return np.arange(seq_q)[None] < q_end, (keys >= kv_start) & (keys < kv_end)


@pytest.mark.parametrize(("batch", "seq_q", "seq_kv", "heads", "kv_heads", "head_dim",
                          "mask_kwargs", "segments"), [
    (4, 1000, 1100, 4, 2, 64, {}, False),
    (4, 1024, 1024, 4, 4, 128, dict(is_causal=True), False),
    (4, 900, 1300, 4, 1, 128, dict(window=(300, 100)), True),
    (4, 777, 777, 2, 2, 256, dict(is_causal=True, causal_alignment="bottom_right"), False),
])
def test_bounds_match_oracle(batch, seq_q, seq_kv, heads, kv_heads, head_dim, mask_kwargs,
                             segments):
    rng = np.random.default_rng(seq_q + head_dim)
    q, d_out = (jnp.asarray(rng.standard_normal((batch, seq_q, heads, head_dim)), BF16)
                for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_kv, kv_heads, head_dim)), BF16)
            for _ in range(2))
    bounds = _bounds(batch, seq_q, seq_kv, rng)
    segment_ids = None
    if segments:
        ids = jnp.asarray(np.cumsum(rng.random((batch, max(seq_q, seq_kv))) < 0.004, axis=1),
                          jnp.int32)
        segment_ids = (ids[:, :seq_q], ids[:, :seq_kv])
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    scale = head_dim ** -0.5
    real_rows, visible = _inside(bounds, seq_q, seq_kv)
    dense = real_rows[:, None, :, None] & visible[:, None, None, :]
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, scale=scale, mask=mask, segment_ids=segment_ids, attn_mask=dense,
        d_out=np.asarray(d_out, np.float64))

    def poison(x, keep):
        return jnp.where(jnp.asarray(keep)[:, :, None, None], x, jnp.nan).astype(x.dtype)
    q_bad, k_bad, v_bad = poison(q, real_rows), poison(k, visible), poison(v, visible)
    config = mosaic.default_config(q.shape, k.shape, BF16, mask)

    @jax.jit
    def run(q, k, v, d_out, bounds):
        out, lse = mosaic.KERNELS.forward(q, k, v, segment_ids, mask=mask, scale=scale,
                                          config=config, interpret=False, bounds=bounds)
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        grads = mosaic.KERNELS.backward(q, k, v, segment_ids, out, lse, d_out, delta,
                                        mask=mask, scale=scale, config=config,
                                        interpret=False, bounds=bounds)
        return out, lse, grads

    out, lse, grads = run(q_bad, k_bad, v_bad, d_out, bounds)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, atol=2e-2, rtol=2e-2)
    seen = ref_lse > EMPTY_ROW_LSE / 2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-2)
    assert np.all(lse[~seen] == np.float32(EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)
    for name, g, ref, inside in zip("qkv", grads, ref_grads[:3], (real_rows, visible, visible),
                                    strict=True):
        g = np.asarray(g, np.float64)
        assert not np.isnan(g).any(), f"d{name}"
        assert np.linalg.norm(g - ref) / np.linalg.norm(ref) < 1e-2, f"d{name}"
        np.testing.assert_allclose(g, ref, atol=0.05 * np.abs(ref).max(), rtol=0.05,
                                   err_msg=f"d{name}")
        assert np.all(g[~inside] == 0), f"d{name} outside the bounds"

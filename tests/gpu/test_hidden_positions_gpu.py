"""Hidden positions on the GPU backends at real sizes (tests/test_hidden_positions.py on
the CPU): NaN in unused K/V / Q rows leaves no trace, wide windows are no window, a bias
<= -1e30 is not a mask. Every implementation available on the device, head dims 64 (the
Mosaic fused dQ, whose 128-key CTAs made dq NaN from K/V of a document no query of the CTA
uses) and 128."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64

BF16 = jnp.bfloat16
IMPLEMENTATIONS = pf.available_implementations() if jax.default_backend() == "gpu" else ()


def _run(implementation, q, k, v, d_out, *args, **kwargs):
    """(out, dq, dk, dv) through ``implementation``."""
    def f(q, k, v):
        return pf.attention(q, k, v, *args, implementation=implementation, **kwargs)

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(d_out))


def _assert_same_results(a, b):
    """out bit for bit (every forward is deterministic); the gradients too, except where
    the backward accumulates dQ in a nondeterministic order (the default Mosaic backward's
    fused dQ adds into GMEM across CTAs): there within bf16 rounding. NaN never passes."""
    assert np.array_equal(np.asarray(a[0]), np.asarray(b[0]))
    for x, y in zip(a[1:], b[1:], strict=True):
        assert rel_err(y, x) < 1e-2, rel_err(y, x)


def _doc_ids(starts, seq: int) -> jax.Array:
    return jnp.asarray(np.broadcast_to(
        np.searchsorted(np.asarray(starts), np.arange(seq), side="right"), (2, seq)), jnp.int32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nan_in_unused_rows_leaves_no_trace(implementation, head_dim):
    """The same results, bit for bit, as with zeros in those rows (the API zeroes them)."""
    q, k, v, d_out = random_qkv(2, 1024, 1024, 8, 2, head_dim, BF16)
    cases = [
        # A KV cache filled to 600 in sequence 0; queries past 700 of sequence 1 padding.
        (dict(key_value_seq_lengths=jnp.array([600, 1024]),
              query_seq_lengths=jnp.array([1024, 700]), is_causal=True),
         [(0, slice(600, None))], [(1, slice(700, None))]),
        # Key document 3 (keys 300..399, inside 128-key CTAs whose other keys are used:
        # the fused dQ cannot skip them) has no query; query document 5 has no key.
        (dict(q_segment_ids=_doc_ids([256, 512], 1024).at[:, 900:].set(5),
              kv_segment_ids=_doc_ids([256, 512], 1024).at[:, 300:400].set(3)),
         [(slice(None), slice(300, 400))], [(slice(None), slice(900, None))]),
    ]
    for kwargs, keys, rows in cases:
        runs = []
        for fill in (0.0, jnp.nan):
            q_x, k_x, v_x = q, k, v
            for b, s in keys:
                k_x, v_x = k_x.at[b, s].set(fill), v_x.at[b, s].set(fill)
            for b, t in rows:
                q_x = q_x.at[b, t].set(fill)
            runs.append(_run(implementation, q_x, k_x, v_x, d_out, **kwargs))
        _assert_same_results(*runs)
        assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in runs[1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_wide_windows_are_no_window(implementation):
    q, k, v, d_out = random_qkv(2, 1024, 1024, 8, 2, 128, BF16)
    for causal, window in ((False, 2**31 - 1), (True, (2**31 - 1, 0)), (True, 10**12)):
        wide = _run(implementation, q, k, v, d_out, is_causal=causal, local_window_size=window)
        none = _run(implementation, q, k, v, d_out, is_causal=causal)
        _assert_same_results(wide, none)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bias_rows_below_minus_1e30_get_their_softmax(implementation):
    q, k, v, _ = random_qkv(1, 256, 256, 2, 2, 64, BF16)
    bias = np.array(2 * jax.random.normal(jax.random.PRNGKey(3), (256, 256)), np.float32)
    spread = np.asarray(jax.random.uniform(jax.random.PRNGKey(4), (256, 256), minval=1,
                                           maxval=3))
    bias[5:9] = -1e30 * spread[5:9]   # one key wins
    bias[3:5] = -1e30                 # the mean of V
    out = pf.attention(q, k, v, jnp.asarray(bias), is_causal=True,
                       implementation=implementation)
    ref, _ = attention_float64(q, k, v, bias=bias, mask=MaskSpec(256, 256, True))
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out[:, 3:9], ref[:, 3:9]) < 1e-2

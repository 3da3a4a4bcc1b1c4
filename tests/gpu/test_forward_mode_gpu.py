"""First-order forward-mode AD (``jax.jvp``) through the compiled kernels, and
``jax.jit(jax.grad)`` through the transpose of its ``linear_call`` (the Mosaic fused dQ's
``jax.new_ref`` accumulator is discharged in that call's lowering), vs the float64 oracle.

The tangent is plain JAX (``pallas_flash.xla.tangent``) from the kernels' ``out`` and
``lse``; the oracle's is a central difference of ``reference.attention_float64``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


IMPLEMENTATIONS = [
    "triton",
    pytest.param("mosaic", marks=pytest.mark.skipif(not _is_sm90(),
                                                    reason="needs a Hopper (sm90) GPU")),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("causal", "head_dim"), [(False, 64), (True, 128)])
def test_jvp_and_grad(implementation, causal, head_dim):
    """bf16, GQA, odd lengths; dense at head_dim 64 takes the fused dQ on Mosaic."""
    q, k, v, d_out = random_qkv(2, 700, 900, 4, 2, head_dim, jnp.bfloat16)
    tq, tk, tv, _ = random_qkv(2, 700, 900, 4, 2, head_dim, jnp.bfloat16)
    mask = MaskSpec(seq_q=700, seq_kv=900, is_causal=causal, causal_alignment="bottom_right")

    def f(q, k, v):
        return pf.attention(q, k, v, is_causal=causal, causal_alignment="bottom_right",
                            implementation=implementation)

    _, tangent = jax.jit(lambda p, t: jax.jvp(f, p, t))((q, k, v), (tq, tk, tv))
    x = [np.asarray(a, np.float64) for a in (q, k, v)]
    t = [np.asarray(a, np.float64) for a in (tq, tk, tv)]
    eps = 1e-6
    plus, minus = (attention_float64(*(a + s * eps * b for a, b in zip(x, t, strict=True)),
                                     mask=mask)[0] for s in (1, -1))
    assert rel_err(tangent, (plus - minus) / (2 * eps)) < 2e-2

    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        f(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32)), argnums=(0, 1, 2)))(
        q, k, v)
    _, _, want = attention_float64(q, k, v, mask=mask, d_out=np.asarray(d_out, np.float64))
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2

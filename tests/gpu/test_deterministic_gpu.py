"""``attention(..., deterministic=True)`` on a GPU: the same gradient bits on every call.

The Mosaic backward's default (the fused dQ, up to head_dim 128) adds each dK/dV CTA's
dS·K into a float32 dQ with TMA reduce-adds, in an order that varies between runs. The
shapes here give every dQ row many such additions (L 2048-4096: 16-32 dK/dV CTAs of 128
keys per row, GQA groups of 4 query heads on each KV head). With ``deterministic=True``
the separate dQ kernel runs: several calls of one compiled gradient, and one of a fresh
compilation, must agree bit for bit in dq, dk and dv, and stay within bf16 tolerance of
the default mode. The Triton and XLA backwards, and a decode step's gradient, likewise.

Run on the H200: ``python -m pytest -q -rA tests/gpu/test_deterministic_gpu.py`` (the
default mode's run-to-run differences are reported, not asserted: they are what the
argument removes, and may happen not to show in a given run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import bits, random_qkv, rel_err

import pallas_flash

BF16 = jnp.bfloat16
CALLS = 5


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _gradients_fn(deterministic: bool, causal: bool, implementation: str):
    def loss(q, k, v, d_out):
        out = pallas_flash.attention(q, k, v, is_causal=causal, deterministic=deterministic,
                                     implementation=implementation)
        return jnp.vdot(out.astype(jnp.float32), d_out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def _runs(deterministic: bool, causal: bool, implementation: str, args) -> list:
    """CALLS calls of one compiled gradient, then one of a fresh compilation, as NumPy."""
    compiled = jax.jit(_gradients_fn(deterministic, causal, implementation))
    runs = [jax.device_get(compiled(*args)) for _ in range(CALLS)]
    fresh = jax.jit(_gradients_fn(deterministic, causal, implementation))
    return [*runs, jax.device_get(fresh(*args))]


def _differing_runs(runs) -> int:
    """How many runs differ from the first in some bit of dq, dk or dv."""
    return sum(any(not np.array_equal(bits(a), bits(b)) for a, b in zip(runs[0], run,
                                                                           strict=True))
               for run in runs[1:])


def _assert_samebits(runs) -> None:
    for index, run in enumerate(runs[1:], 1):
        for name, first, later in zip("qkv", runs[0], run, strict=True):
            mismatched = int(np.sum(bits(first) != bits(later)))
            assert mismatched == 0, f"d{name}: call {index} differs in {mismatched} elements"


MOSAIC_CASES = [(seq, head_dim, causal) for seq in (2048, 4096) for head_dim in (64, 128)
                for causal in (False, True)]


@pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")
@pytest.mark.parametrize(("seq", "head_dim", "causal"), MOSAIC_CASES)
def test_mosaic_deterministic_gives_the_samebits(seq, head_dim, causal, record_property):
    args = random_qkv(2, seq, seq, 8, 2, head_dim, BF16)
    runs = _runs(True, causal, "mosaic", args)
    _assert_samebits(runs)
    default = _runs(False, causal, "mosaic", args)
    # Reported, not asserted: the default mode's run-to-run differences at this shape.
    record_property("default_runs_differing", _differing_runs(default))
    print(f"L={seq} d={head_dim} causal={causal}: default mode, "
          f"{_differing_runs(default)} of {len(default) - 1} runs differ from the first")
    for name, det, fused in zip("qkv", runs[0], default[0], strict=True):
        err = rel_err(det, fused)
        assert err < 1e-2, f"d{name}: deterministic vs default, relative difference {err}"


@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("causal", [False, True])
def test_other_backends_give_the_samebits(implementation, causal):
    args = random_qkv(2, 2048, 2048, 8, 2, 64, BF16)
    _assert_samebits(_runs(True, causal, implementation, args))


@pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")
def test_decode_step_gradient_gives_the_samebits():
    """A decode-shaped call (8 new queries on a 4096-token cache), which attention routes
    to decode_attention: its chunked call's backward (on the Mosaic kernels, whose default
    is the fused dQ; a decode step left to the dispatcher runs on Triton) takes the same
    argument."""
    q, _, _, d_out = random_qkv(2, 8, 8, 8, 2, 128, BF16)
    _, k, v, _ = random_qkv(2, 8, 4096, 8, 2, 128, BF16)
    _assert_samebits(_runs(True, False, "mosaic", (q, k, v, d_out)))

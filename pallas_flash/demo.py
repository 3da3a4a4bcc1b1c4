"""The tutorial's equivalence check: tiled attention equals standard attention.

    python -m pallas_flash.demo

B=2, H=4, L=128, d=64, float32, causal and not: the papers' loops (reference.py) and every
implementation that runs here are compared with standard attention, which materialises
softmax(Q·Kᵀ/√d). Pallas kernels run in interpret mode when no GPU is present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import flash_attention_v1, flash_attention_v2, standard_attention

TOLERANCE = 1e-5


def _candidates(causal: bool) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    candidates = {
        "FlashAttention-1 loops (reference)":
            lambda q, k, v, m: flash_attention_v1(q, k, v, mask=m)[0],
        "FlashAttention-2 loops (reference)":
            lambda q, k, v, m: flash_attention_v2(q, k, v, mask=m)[0],
        "xla (chunked online softmax)": lambda q, k, v, m: pf.attention(
            q, k, v, is_causal=causal, implementation="xla"),
        "triton" + ("" if on_gpu else " (interpret mode)"): lambda q, k, v, m: pf.attention(
            q, k, v, is_causal=causal, implementation="triton", interpret=not on_gpu),
    }
    if "mosaic" in pf.available_implementations():
        candidates["mosaic"] = lambda q, k, v, m: pf.attention(
            q, k, v, is_causal=causal, implementation="mosaic")
    return candidates


def main() -> int:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (2, 128, 4, 64), jnp.float32) for key in keys)
    print(f"tiled vs standard attention, B=2 H=4 L=128 d=64 float32 on {jax.devices()[0]}")
    print(f"{'implementation':40s} {'causal':>6s} {'max |error|':>12s}  result")
    failures = 0
    for causal in (False, True):
        mask = MaskSpec(128, 128, is_causal=causal)
        expected = np.asarray(standard_attention(q, k, v, mask=mask)[0])
        for name, fn in _candidates(causal).items():
            error = float(np.max(np.abs(np.asarray(fn(q, k, v, mask)) - expected)))
            ok = error < TOLERANCE
            failures += not ok
            print(f"{name:40s} {causal!s:>6s} {error:12.2e}  {'pass' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The tutorial's equivalence check: tiled attention equals standard attention.

    python -m pallas_flash.tutorial.demo

B=2, H=4, L=128, d=64, float32, causal and not: the papers' loops
(:mod:`pallas_flash.tutorial.loops`) and every implementation that runs here are compared
with standard attention computed in float64
(:func:`pallas_flash.reference.attention_float64`). Pallas kernels run in interpret mode
when no GPU is present. ``pallas-flash check`` runs the same comparison with gradients.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from pallas_flash.tutorial.loops import flash_attention_v1, flash_attention_v2

#: Largest accepted ``max |error| / max |reference|`` per input dtype.
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
TOLERANCE = TOLERANCES["float32"]

# (q, k, v, causal) -> out, with q [B, T, N, D] and k/v [B, S, K, D]: the signature of
# benchmarks.implementations.AttentionFn.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One attention implementation under check.

    Attributes:
      label: the name printed in the table.
      fn: ``(q, k, v, causal) -> out``.
      grads: also compare dQ, dK, dV (through ``jax.vjp``) when gradients are checked.
    """

    label: str
    fn: AttentionFn
    grads: bool = True


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: one quantity of one candidate, against the float64 oracle."""

    label: str
    causal: bool
    quantity: str  # "out", "dq", "dk" or "dv"
    max_abs: float
    max_rel: float  # max |x - ref| / max |ref|
    ok: bool
    error: str | None = None  # the exception, when the candidate raised


def _loop_block(seq_len: int) -> int:
    """Block size of the papers' loops at ``seq_len``: 32, doubled (while it divides) until
    at most 8 blocks per sequence, because the loops unroll into the jitted program and
    64 x 64 tiles of 32 take minutes to compile."""
    block = 32
    while seq_len // block > 8 and seq_len % (2 * block) == 0:
        block *= 2
    return block


def _loops(version: int) -> AttentionFn:
    loop = flash_attention_v1 if version == 1 else flash_attention_v2

    def fn(q, k, v, causal):
        block = _loop_block(q.shape[1])
        return loop(q, k, v, mask=MaskSpec(q.shape[1], k.shape[1], is_causal=causal),
                    block_q=block, block_kv=block)[0]

    return fn


def _package(implementation: str, interpret: bool) -> AttentionFn:
    def fn(q, k, v, causal):
        return pf.attention(q, k, v, is_causal=causal, implementation=implementation,
                            interpret=interpret)

    return fn


def candidates(*, reference_loops: bool = True) -> dict[str, Candidate]:
    """Everything that runs on this machine, by short name: the papers' loops in plain JAX
    (forward only), ``xla``, ``triton`` (interpret mode without a GPU) and ``mosaic`` (on
    Hopper)."""
    on_gpu = jax.default_backend() == "gpu"
    found: dict[str, Candidate] = {}
    if reference_loops:
        found["fa1-loops"] = Candidate("FlashAttention-1 loops (reference)", _loops(1), False)
        found["fa2-loops"] = Candidate("FlashAttention-2 loops (reference)", _loops(2), False)
    found["xla"] = Candidate("xla (chunked online softmax)", _package("xla", False))
    found["triton"] = Candidate("triton" + ("" if on_gpu else " (interpret mode)"),
                                _package("triton", not on_gpu))
    if "mosaic" in pf.available_implementations():
        found["mosaic"] = Candidate("mosaic", _package("mosaic", False))
    return found


def _errors(actual: Any, expected: np.ndarray) -> tuple[float, float]:
    diff = np.abs(np.asarray(actual, np.float64) - expected)
    max_abs = float(np.max(diff)) if np.all(np.isfinite(diff)) else math.inf
    scale = float(np.max(np.abs(expected)))
    return max_abs, max_abs / scale if scale > 0 else max_abs


def compare(found: Mapping[str, Candidate], *, batch: int = 2, seq_len: int = 128,
            heads: int = 4, head_dim: int = 64, dtype: Any = jnp.float32,
            causal: Iterable[bool] = (False, True), grads: bool = False,
            tolerance: float | None = None, seed: int = 0,
            progress: Callable[[Iterable], Iterable] | None = None) -> list[Row]:
    """Run every candidate on random ``[batch, seq_len, heads, head_dim]`` inputs and
    compare its output (and, with ``grads``, dQ, dK, dV for a random dO) with the float64
    oracle. A candidate that raises gets one failing row with the error.

    Args:
      tolerance: largest accepted ``max |error| / max |reference|``; default by dtype
        (:data:`TOLERANCES`).
      progress: wraps the iterable of (causal, name) jobs, e.g. ``tqdm.tqdm``.
    """
    dtype = jnp.dtype(dtype)
    tolerance = TOLERANCES[dtype.name] if tolerance is None else tolerance
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, d_out = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.float32)
                      .astype(dtype) for key in keys)
    jobs = [(c, name) for c in causal for name in found]
    rows: list[Row] = []
    expected: dict[bool, tuple] = {}
    for is_causal, name in (progress(jobs) if progress else jobs):
        if is_causal not in expected:
            out, _, (dq, dk, dv) = attention_float64(
                q, k, v, mask=MaskSpec(seq_len, seq_len, is_causal=is_causal), d_out=d_out)
            expected[is_causal] = (out, dq, dk, dv)
        cand = found[name]
        quantities = ("out", "dq", "dk", "dv") if grads and cand.grads else ("out",)
        try:
            if len(quantities) == 1:
                results = (cand.fn(q, k, v, is_causal),)
            else:
                out, vjp = jax.vjp(lambda q, k, v, c=cand, m=is_causal: c.fn(q, k, v, m),
                                   q, k, v)
                results = (out, *vjp(d_out))
            results = jax.block_until_ready(results)
        except Exception as exc:
            message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}" \
                if str(exc).strip() else type(exc).__name__
            rows.append(Row(cand.label, is_causal, "-", math.nan, math.nan, False, message))
            continue
        for quantity, actual, ref in zip(quantities, results, expected[is_causal],
                                         strict=False):
            max_abs, max_rel = _errors(actual, ref)
            rows.append(Row(cand.label, is_causal, quantity, max_abs, max_rel,
                            max_rel <= tolerance))
    return rows


def format_table(rows: Iterable[Row]) -> str:
    """The rows as a fixed-width text table."""
    rows = list(rows)
    width = max([len(r.label) for r in rows] + [len("implementation")])
    lines = [f"{'implementation':{width}s} {'causal':>6s} {'value':>5s} {'max |error|':>12s} "
             f"{'relative':>10s}  result"]
    for r in rows:
        result = "pass" if r.ok else "FAIL" + (f"  {r.error}" if r.error else "")
        lines.append(f"{r.label:{width}s} {r.causal!s:>6s} {r.quantity:>5s} {r.max_abs:12.2e} "
                     f"{r.max_rel:10.2e}  {result}")
    return "\n".join(lines)


def main() -> int:
    print(f"tiled vs standard attention (float64), B=2 H=4 L=128 d=64 float32 on "
          f"{jax.devices()[0]}")
    rows = compare(candidates())
    print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Wall-clock timing of jitted JAX functions on an accelerator.

Each sample enqueues several back-to-back calls (JAX dispatches asynchronously, so the device
stays busy and the per-call dispatch cost is hidden once a sample holds a few milliseconds of
work), blocks on all their outputs and divides by the number of calls. Calls rotate among
several input sets so that caches are not flattered by re-reading the same arrays. The median
over samples is reported.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    """Result of :func:`time_fn`; all times in milliseconds per call."""

    median_ms: float
    min_ms: float
    max_ms: float
    samples: int
    calls_per_sample: int


def time_fn(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, iters: int = 30,
            warmup: int = 3, min_sample_ms: float = 2.0, max_calls_per_sample: int = 32,
            max_seconds: float = 2.0, min_samples: int = 5) -> Timing:
    """Time ``fn(*arg_sets[i])`` after warm-up; ``fn`` should already be jitted.

    Args:
      fn: the function to time; its outputs are blocked on, so nothing is left pending.
      arg_sets: input sets, used in rotation.
      iters: the number of samples wanted.
      warmup: untimed calls first (the first one compiles).
      min_sample_ms: each sample holds enough calls to last about this long.
      max_calls_per_sample: upper bound on the calls of one sample.
      max_seconds: stop sampling after this long once ``min_samples`` samples are taken.
      min_samples: samples always taken, whatever ``max_seconds`` says.

    Returns:
      The median, min and max per-call time over samples.
    """
    if not arg_sets:
        raise ValueError("need at least one input set")
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    n_sets = len(arg_sets)
    for i in range(max(warmup, 1)):
        jax.block_until_ready(fn(*arg_sets[i % n_sets]))
    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    estimate_ms = (time.perf_counter() - start) * 1e3
    calls = max(1, min(max_calls_per_sample, math.ceil(min_sample_ms / max(estimate_ms, 1e-3))))

    per_call_ms: list[float] = []
    call_index = 0
    deadline = time.perf_counter() + max_seconds
    while len(per_call_ms) < iters:
        start = time.perf_counter()
        outputs = []
        for _ in range(calls):
            outputs.append(fn(*arg_sets[call_index % n_sets]))
            call_index += 1
        jax.block_until_ready(outputs)
        per_call_ms.append((time.perf_counter() - start) * 1e3 / calls)
        del outputs
        if len(per_call_ms) >= min_samples and time.perf_counter() > deadline:
            break
    return Timing(median_ms=statistics.median(per_call_ms), min_ms=min(per_call_ms),
                  max_ms=max(per_call_ms), samples=len(per_call_ms), calls_per_sample=calls)

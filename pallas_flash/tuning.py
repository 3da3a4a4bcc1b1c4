"""Measured block-size configs, cached per device: ``attention(..., config="autotune")``.

The backends' ``default_config`` heuristics come from H200 sweeps at the papers' shapes; on
another card, or another shape, a different tiling can be faster
(measurements: docs/tuning.md#autotuning).
:func:`autotune` times a small list of candidate configs on fresh inputs of the call's
shapes, keeps only those whose output agrees with the default config's, and caches the
fastest in a JSON file keyed by device kind, jax version and shape class.
:func:`resolve_config` turns the entry points' ``config`` argument into a backend's config.

:func:`time_fn` is the one timer of the project: the benchmark scripts use it too (through
``benchmarks/timing.py``). Each sample enqueues several back-to-back calls (JAX dispatches
asynchronously, so the device stays busy and the per-call dispatch cost is hidden once a
sample holds a few milliseconds of work), blocks on all their outputs and divides by the
number of calls. Calls rotate among several input sets so that caches are not flattered by
re-reading the same arrays. The median over samples is reported.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from pallas_flash import dispatch
from pallas_flash.autodiff import attention_with_lse
from pallas_flash.contract import StaticArgs
from pallas_flash.masking import MaskSpec
from pallas_flash.padding import next_power_of_2

#: Directory of the cache file; default ``~/.cache/pallas_flash``.
CACHE_DIR_ENV = "PALLAS_FLASH_CACHE_DIR"
CACHE_FILE_NAME = "autotune.json"
#: Bumped when the file's layout changes; files of another version are ignored.
CACHE_FORMAT = 1

#: Largest relative L2 difference from the default config's outputs that a candidate may
#: show, by itemsize. Tilings only reorder float32 accumulations; with 16-bit inputs P is
#: also rounded to 16 bits per tile. A broken kernel (a race, a wrong mask) is far above.
_TOLERANCE = {4: 1e-4, 2: 2e-2}

# Mosaic forward (MosaicConfig fields), crossed and kept where check_fits passes.
_MOSAIC_BLOCK_Q = (64, 128)
_MOSAIC_BLOCK_KV = (64, 128, 192, 256)
_MOSAIC_NUM_STAGES = (2, 3)
_MOSAIC_OVERLAP = (False, True)
# Triton forward (block_q, block_kv, num_warps, num_stages): the tilings of
# benchmarks/tune_triton.py's H200 sweeps (docs/tuning.md).
_TRITON_FORWARD = (
    (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
    (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 16, 3),
)
# Triton backward (bwd_block_q, bwd_block_kv, bwd_num_warps, bwd_num_stages), tried on the
# forward's winner: the backward kernels do not depend on the forward's fields.
_TRITON_BACKWARD = (
    (32, 32, 4, 2), (32, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2),
    (128, 64, 8, 2),
)

# timer(config, fn, args) -> milliseconds per call of fn(*args); fn is jitted and has run.
Timer = Callable[[Any, Callable[..., Any], tuple], float]


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


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate: its median time, or why it was not timed or not accepted."""

    config: Any
    median_ms: float | None = None
    skipped: str | None = None


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What :func:`tune` chose, every candidate's outcome, and the cache entry's key."""

    config: Any
    trials: tuple[Trial, ...]
    cache_key: str
    from_cache: bool


def cache_path() -> Path:
    """The cache file: ``$PALLAS_FLASH_CACHE_DIR/autotune.json``, by default under
    ``~/.cache/pallas_flash``. Deleting it clears every tuned choice."""
    directory = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pallas_flash"
    return Path(directory) / CACHE_FILE_NAME


def cache_key(q_shape: Sequence[int], kv_shape: Sequence[int], dtype, *, implementation: str,
              is_causal: bool, backward: bool = False, interpret: bool = False,
              device_kind: str | None = None) -> str:
    """The shape class a tuned config is reused for.

    Lengths count by their next power of two (the Triton tiles are capped there too), heads
    by the GQA group size; batch and head counts only scale the grid. ``device_kind``
    defaults to the first device's (``jax.devices()[0].device_kind``).
    """
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    fields = [
        device_kind, f"jax {jax.__version__}", implementation, jnp.dtype(dtype).name,
        f"d{q_shape[3]}", "causal" if is_causal else "dense",
        f"q{next_power_of_2(q_shape[1])}", f"kv{next_power_of_2(kv_shape[1])}",
        f"group{q_shape[2] // kv_shape[2]}", "fwd+bwd" if backward else "fwd",
    ]
    if interpret:
        fields.append("interpret")
    return "|".join(fields)


def candidate_configs(implementation: str, q_shape: Sequence[int], kv_shape: Sequence[int],
                      dtype, *, is_causal: bool = False) -> list:
    """The forward tilings :func:`tune` tries by default, the heuristic's first.

    Mosaic: ``block_q`` × ``block_kv`` × ``num_stages`` × ``overlap``, and three consumers
    with ``block_kv`` 64 or 128 (192 and up spilled on the H200), kept where
    ``check_fits`` passes with a segment-id ring (so that the choice also serves calls with
    segment ids). Triton: the swept tilings, fitted to shared memory and capped at the
    sequence lengths as the kernel would, without duplicates. XLA: only the heuristic (its
    ``block_kv`` sets the memory of the scan, which a timing should not decide).
    """
    spec = MaskSpec(seq_q=q_shape[1], seq_kv=kv_shape[1], is_causal=is_causal)
    default = dispatch.backend(implementation).default_config(q_shape, kv_shape, dtype, spec)
    itemsize = jnp.dtype(dtype).itemsize
    if implementation == "mosaic":
        from pallas_flash.mosaic import MosaicConfig
        from pallas_flash.mosaic.config import padded_head_dim

        head_dim = padded_head_dim(q_shape[3])
        configs = [MosaicConfig(*fields) for fields in itertools.product(
            _MOSAIC_BLOCK_Q, _MOSAIC_BLOCK_KV, _MOSAIC_NUM_STAGES, _MOSAIC_OVERLAP)]
        # Three consumers (160 registers each) only in the combination they allow.
        configs += [MosaicConfig(64, block_kv, stages, overlap=True, num_consumers=3)
                    for block_kv, stages in itertools.product((64, 128), _MOSAIC_NUM_STAGES)]
        # Persistent CTAs with 64-row warpgroups (128-row ones spill in the tile loop).
        configs += [dataclasses.replace(c, persistent=True) for c in configs
                    if c.block_q == 64]
        configs = [c for c in configs if _fits_mosaic(c, head_dim, itemsize)]
    elif implementation == "triton":
        from pallas_flash.triton.config import (
            fit_row_operands,
            padded_head_dim,
            shrink_to_sequence,
        )

        head_dim = padded_head_dim(q_shape[3])
        configs = [
            fit_row_operands(shrink_to_sequence(dataclasses.replace(
                default, block_q=block_q, block_kv=block_kv, num_warps=warps,
                num_stages=stages), q_shape[1], kv_shape[1]), head_dim, itemsize, 0)
            for block_q, block_kv, warps, stages in _TRITON_FORWARD]
    else:
        configs = []
    return _unique([default, *configs])


def backward_candidates(implementation: str, config, q_shape: Sequence[int],
                        kv_shape: Sequence[int]) -> list:
    """Variants of ``config`` that change only the backward's fields (Triton only: the
    Mosaic backward takes its tiling from ``default_backward_config``, not from the API's
    config)."""
    if implementation != "triton":
        return []
    from pallas_flash.triton.config import shrink_to_sequence

    return _unique([shrink_to_sequence(dataclasses.replace(
        config, bwd_block_q=block_q, bwd_block_kv=block_kv, bwd_num_warps=warps,
        bwd_num_stages=stages), q_shape[1], kv_shape[1])
        for block_q, block_kv, warps, stages in _TRITON_BACKWARD])


def _fits_mosaic(config, head_dim: int, itemsize: int) -> bool:
    try:
        config.check_fits(head_dim, itemsize, segments=True)
    except ValueError:
        return False
    return True


def _unique(configs: list) -> list:
    return list(dict.fromkeys(configs))


def autotune(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool = False,
             implementation: str | None = None, interpret: bool = False,
             backward: bool = False, candidates: Sequence[Any] | None = None, iters: int = 10,
             cache: bool = True, timer: Timer | None = None) -> Any:
    """The fastest config of ``implementation`` for calls shaped like these arrays.

    ``tune(...).config``; see :func:`tune` for the arguments. Pass the result as
    ``pallas_flash.attention(..., config=...)``, or call ``attention(..., config="autotune")``,
    which reads the same cache.
    """
    return tune(query, key, value, is_causal=is_causal, implementation=implementation,
                interpret=interpret, backward=backward, candidates=candidates, iters=iters,
                cache=cache, timer=timer).config


def tune(query: jax.Array, key: jax.Array, value: jax.Array, *, is_causal: bool = False,
         implementation: str | None = None, interpret: bool = False, backward: bool = False,
         candidates: Sequence[Any] | None = None, iters: int = 10, cache: bool = True,
         timer: Timer | None = None) -> Tuning:
    """Times candidate configs on fresh random inputs shaped like ``query``/``key``/``value``.

    Each candidate first runs once and its outputs (with ``backward``, also dq, dk, dv) are
    compared with the default config's: a candidate that fails to compile or run, or whose
    outputs differ by more than rounding, is skipped and the reason kept in its
    :class:`Trial`. The fastest of the rest is chosen (the default config when none is left).
    Only the arrays' shapes and dtype are used, so tracers are fine: under ``jax.jit`` the
    tuning runs at trace time, eagerly, in a thread outside the trace.

    Args:
      query, key, value: as for :func:`pallas_flash.attention` (arrays or tracers).
      is_causal: tune the causal attention.
      implementation: ``"mosaic"``, ``"triton"`` or ``"xla"``; ``None``: the one
        ``attention`` would pick.
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      backward: time forward + backward (``jax.vjp``) instead of the forward. Triton then
        also tries backward tilings on the forward's winner.
      candidates: configs to try instead of :func:`candidate_configs` (no backward round).
      iters: timing samples per candidate (the default timer's median is over these).
      cache: read the choice from, and write it to, :func:`cache_path`.
      timer: ``timer(config, fn, args) -> milliseconds`` per call of the jitted
        ``fn(*args)``, which has already run once; default :func:`time_fn`'s median.

    Returns:
      A :class:`Tuning`; ``from_cache`` is True when nothing was timed.
    """
    dispatch.check_arrays(query, key, value)
    if min(query.shape[1], key.shape[1]) < 1:
        raise ValueError(f"autotune needs non-empty sequences, got query length "
                         f"{query.shape[1]} and key/value length {key.shape[1]}")
    for name, flag in (("is_causal", is_causal), ("backward", backward), ("cache", cache)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
        raise ValueError(f"iters must be a positive int, got {iters!r}")
    if timer is not None and not callable(timer):
        raise ValueError(f"timer must be callable or None, got {timer!r}")
    if candidates is not None and not isinstance(candidates, (list, tuple)):
        raise ValueError(f"candidates must be a list or tuple of configs, got {candidates!r}")
    dispatch.check_implementation(implementation, interpret)
    spec = MaskSpec(seq_q=query.shape[1], seq_kv=key.shape[1], is_causal=is_causal)
    if implementation is None:
        implementation = dispatch.choose(query.shape, key.shape, query.dtype, spec,
                                         dispatch.PLAIN_CALL, interpret=interpret)
    reason = dispatch.unsupported(implementation, query.shape, key.shape, query.dtype, spec,
                                  dispatch.PLAIN_CALL)
    if reason is not None:
        raise ValueError(f"implementation={implementation!r} cannot run this call: {reason}")
    default = dispatch.backend(implementation).default_config(
        query.shape, key.shape, query.dtype, spec)
    if candidates is not None:
        if not candidates:
            raise ValueError("candidates must not be empty")
        for config in candidates:
            if not isinstance(config, type(default)):
                raise ValueError(f"candidates for implementation={implementation!r} must be "
                                 f"{type(default).__name__}s, got {config!r}")
        candidates = _unique(list(candidates))

    entry_key = cache_key(query.shape, key.shape, query.dtype, implementation=implementation,
                          is_causal=is_causal, backward=backward, interpret=interpret)
    path = cache_path()
    if cache:
        cached = _cached_tuning(path, entry_key, type(default))
        if cached is not None:
            return cached
    pool = candidates if candidates is not None else candidate_configs(
        implementation, query.shape, key.shape, query.dtype, is_causal=is_causal)
    tunes_backward = backward and candidates is None and implementation == "triton"
    if pool == [default] and not tunes_backward:  # nothing to compare (XLA's default list)
        return Tuning(config=default, trials=(), cache_key=entry_key, from_cache=False)
    if timer is None:
        def timer(config, fn, args):
            del config
            return time_fn(fn, [args], iters=iters, warmup=1, max_seconds=1.0).median_ms

    def measure() -> list[Trial]:
        run = _Runner(default, query.shape, key.shape, query.dtype,
                      implementation=implementation, is_causal=is_causal, interpret=interpret,
                      backward=backward, timer=timer)
        trials = [run.trial(config) for config in pool]
        if tunes_backward:
            tried = {trial.config for trial in trials}
            winner = _fastest(trials, default)
            trials += [run.trial(config) for config in backward_candidates(
                implementation, winner, query.shape, key.shape) if config not in tried]
        return trials

    # In a thread of its own: JAX's tracing state is per thread, so when the caller is
    # being traced (jit, grad, vmap) the candidates still run eagerly on concrete arrays.
    # (jax.ensure_compile_time_eval would also fold the Pallas kernels' program_id.)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        trials = executor.submit(measure).result()
    tuning = Tuning(config=_fastest(trials, default), trials=tuple(trials),
                    cache_key=entry_key, from_cache=False)
    if cache:
        _store(path, tuning, query.shape, key.shape)
    return tuning


def config_for_attention(query, key, value, *, implementation: str, is_causal: bool,
                         interpret: bool) -> Any:
    """``attention(..., config="autotune")``: the cached forward + backward choice, else the
    cached forward choice, else a forward tuning (cached) with the default candidates."""
    config_type = type(dispatch.backend(implementation).default_config(
        query.shape, key.shape, query.dtype,
        MaskSpec(seq_q=query.shape[1], seq_kv=key.shape[1], is_causal=is_causal)))
    path = cache_path()
    fields = dict(implementation=implementation, is_causal=is_causal, interpret=interpret)
    entry_key = cache_key(query.shape, key.shape, query.dtype, backward=True, **fields)
    cached = _cached_tuning(path, entry_key, config_type)
    if cached is not None:
        return cached.config
    return autotune(query, key, value, **fields)


def resolve_config(config, implementation: str, query: jax.Array, key: jax.Array,
                   value: jax.Array, spec: MaskSpec, interpret: bool) -> Any:
    """The config of backend ``implementation`` for an entry point's ``config`` argument
    (see :func:`pallas_flash.attention`): None -> the backend's default, ``"autotune"`` ->
    :func:`config_for_attention`, else a config of a type the backend accepts, as given.

    ``query: [batch, seq_q, heads, head_dim]``, ``key, value: [batch, seq_kv, kv_heads,
    head_dim]``; ``spec``: the call's mask.

    Raises:
      ValueError: ``implementation`` is no backend's name, or ``config`` is of a type the
        backend does not take.
    """
    default = dispatch.backend(implementation).default_config(query.shape, key.shape,
                                                              query.dtype, spec)
    if config is None:
        return default
    if isinstance(config, str) and config == "autotune":
        return config_for_attention(query, key, value, implementation=implementation,
                                    is_causal=spec.is_causal, interpret=interpret)
    # A backend may take configs of several types (Mosaic: forward, backward or both).
    accepted = getattr(dispatch.backend(implementation), "CONFIG_TYPES", (type(default),))
    if not isinstance(config, accepted):
        names = " or ".join(t.__name__ for t in accepted)
        raise ValueError(
            f"config must be None, 'autotune' or a {names} for "
            f"implementation={implementation!r}, got {config!r}")
    return config


class _Runner:
    """Runs candidates on one set of fresh inputs and checks them against the outputs of the
    default config (a failure of the default is the heuristic's, so it raises)."""

    def __init__(self, default, q_shape, kv_shape, dtype, *, implementation: str,
                 is_causal: bool, interpret: bool, backward: bool, timer: Timer) -> None:
        keys = jax.random.split(jax.random.key(0), 4)
        self.args = (jax.random.normal(keys[0], q_shape, dtype),
                     jax.random.normal(keys[1], kv_shape, dtype),
                     jax.random.normal(keys[2], kv_shape, dtype))
        if backward:
            self.args += (jax.random.normal(keys[3], q_shape, dtype),)
        self.implementation = implementation
        self.mask = MaskSpec(seq_q=q_shape[1], seq_kv=kv_shape[1], is_causal=is_causal)
        self.interpret = interpret
        self.backward = backward
        self.timer = timer
        self.tolerance = _TOLERANCE.get(jnp.dtype(dtype).itemsize, _TOLERANCE[2])
        self.default = default
        self.default_fn = self.compiled(default)
        self.reference = jax.block_until_ready(self.default_fn(*self.args))

    def compiled(self, config) -> Callable[..., tuple[jax.Array, ...]]:
        def forward(q, k, v):
            # A plain call straight to the custom VJP: what attention(q, k, v, is_causal=...,
            # implementation=..., config=config) runs, without going back through the API
            # (whose backward is reproducible when XLA_FLAGS asks for deterministic ops).
            static = StaticArgs(kernels=dispatch.backend(self.implementation).KERNELS,
                                mask=self.mask, scale=1.0 / math.sqrt(q.shape[3]),
                                config=config, interpret=self.interpret,
                                deterministic=dispatch.deterministic_backward())
            return attention_with_lse(q, k, v, None, None, None, None, static)[0]

        def forward_backward(q, k, v, d_out):
            out, vjp = jax.vjp(forward, q, k, v)
            return (out, *vjp(d_out))

        return jax.jit(forward_backward if self.backward else lambda q, k, v: (forward(q, k, v),))

    def trial(self, config) -> Trial:
        try:
            fn = self.default_fn if config == self.default else self.compiled(config)
            outputs = jax.block_until_ready(fn(*self.args))
        except Exception as error:  # a tiling that does not compile or fit is skipped
            return Trial(config, skipped=f"failed: {_summary(error)}")
        difference = max(_relative_difference(out, ref)
                         for out, ref in zip(outputs, self.reference, strict=True))
        if not difference <= self.tolerance:  # NaN is rejected too
            return Trial(config, skipped=f"rejected: outputs differ from the default config's "
                                         f"by {difference:.3g} (relative), more than "
                                         f"{self.tolerance:g}")
        return Trial(config, median_ms=float(self.timer(config, fn, self.args)))


def _relative_difference(x: jax.Array, reference: jax.Array) -> float:
    x, reference = x.astype(jnp.float32), reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.linalg.norm(reference), jnp.finfo(jnp.float32).tiny)
    return float(jnp.linalg.norm(x - reference) / scale)


def _summary(error: BaseException) -> str:
    """``"<type>: <first line of the message>"``, at most 300 characters."""
    line = next((s.strip() for s in str(error).splitlines() if s.strip()), "")
    return (f"{type(error).__name__}: {line}" if line else type(error).__name__)[:300]


def _fastest(trials: Sequence[Trial], default) -> Any:
    timed = [trial for trial in trials if trial.median_ms is not None]
    if not timed:
        return default
    return min(timed, key=lambda trial: trial.median_ms).config


# --- the cache file ----------------------------------------------------------------------

def _read_entries(path: Path) -> dict[str, dict]:
    """The file's entries; a missing file is empty, an unreadable one too (with a warning)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"ignoring the autotune cache {path}: {_summary(error)}", stacklevel=3)
        return {}
    if (not isinstance(data, dict) or data.get("format") != CACHE_FORMAT
            or not isinstance(data.get("entries"), dict)):
        warnings.warn(f"ignoring the autotune cache {path}: not a format-{CACHE_FORMAT} "
                      "pallas_flash cache", stacklevel=3)
        return {}
    return data["entries"]


def _cached_tuning(path: Path, entry_key: str, config_type: type) -> Tuning | None:
    entry = _read_entries(path).get(entry_key)
    if entry is None:
        return None
    try:
        config = config_type(**entry["config"])
        trials = tuple(Trial(config_type(**t["config"]), t["median_ms"], t["skipped"])
                       for t in entry["trials"])
    except (KeyError, TypeError, ValueError) as error:  # e.g. the config's fields changed
        warnings.warn(f"ignoring the autotune cache entry {entry_key!r} of {path}: "
                      f"{_summary(error)}", stacklevel=3)
        return None
    return Tuning(config=config, trials=trials, cache_key=entry_key, from_cache=True)


def _store(path: Path, tuning: Tuning, q_shape, kv_shape) -> None:
    """Adds the entry to the file, replacing the file atomically (a reader never sees half
    of it; two processes tuning at once may each drop the other's new entry)."""
    entries = _read_entries(path)
    entries[tuning.cache_key] = {
        "config": dataclasses.asdict(tuning.config),
        "trials": [dict(config=dataclasses.asdict(t.config), median_ms=t.median_ms,
                        skipped=t.skipped) for t in tuning.trials],
        "query_shape": list(q_shape),
        "key_shape": list(kv_shape),
        "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                     delete=False) as f:
        json.dump({"format": CACHE_FORMAT, "entries": entries}, f, indent=1)
    os.replace(f.name, path)

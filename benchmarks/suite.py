"""The FlashAttention papers' benchmark, every implementation side by side in one process.

``python -m benchmarks.suite --out DIR`` times forward, backward and forward+backward of each
available implementation (``benchmarks.implementations``) over head dims × sequence lengths ×
causal, with the papers' shapes and FLOP conventions (``benchmarks.flops``), and writes
``DIR/suite-<device>-<date>.json``, ``.md`` and bar charts (``benchmarks.report``). A point
that fails (compile error, out of memory, wrong result) is recorded with its error and the
suite goes on.
``--quick`` runs tiny shapes in seconds on CPU. Variants of an implementation run only when
``--impls`` names them: ``--impls pallas_flash_mosaic,pallas_flash_mosaic_deterministic``
times the default and the reproducible backward (``deterministic=True``) point by point.
Each point is timed in ``--rounds`` interleaved rounds (every implementation once per
round, after the first round's correctness check); a point reports the median over rounds,
the backward as the median of the rounds' forward+backward minus forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import report
from benchmarks.flops import PASSES, Pass, attention_flops, problem_shape, tflops_per_s
from benchmarks.implementations import (
    IMPLEMENTATIONS,
    REFERENCE,
    Implementation,
    error_summary,
    probe,
)
from benchmarks.timing import time_fn
from pallas_flash.tutorial.cli import int_list

DTYPES: dict[str, jnp.dtype] = {
    "bf16": jnp.dtype(jnp.bfloat16),
    "fp16": jnp.dtype(jnp.float16),
    "fp32": jnp.dtype(jnp.float32),
}
_CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}
# Defaults of the size options; --quick swaps in the second set (CPU smoke test, seconds).
_FULL = {"head_dims": "64,128,256", "seq_lens": "1024,2048,4096,8192,16384", "tokens": 16384,
         "hidden": 2048, "iters": 30, "warmup": 3, "max_seconds": 2.0, "rounds": 3}
_QUICK = {"head_dims": "64", "seq_lens": "64,128", "tokens": 256, "hidden": 128,
          "iters": 3, "warmup": 1, "max_seconds": 0.5, "rounds": 1}


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """What to run. Sizes follow ``benchmarks.flops.problem_shape``."""

    impls: tuple[str, ...] | None = None  # None: every available implementation
    head_dims: tuple[int, ...] = (64, 128, 256)
    seq_lens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    causal: tuple[bool, ...] = (False, True)
    passes: tuple[Pass, ...] = PASSES
    dtype: str = "bf16"
    iters: int = 30
    warmup: int = 3
    max_seconds: float = 2.0  # per timing, once 5 samples are taken
    tokens: int = 16384
    hidden: int = 2048
    tolerance: float = 0.05  # max |out - ref| / max |ref| over out and gradients
    input_sets: int = 3
    time_limit: float | None = None  # seconds; later points are recorded as not run
    seed: int = 0
    rounds: int = 3  # interleaved: each round times every implementation once


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The timings of one implementation at one point: ``round_ms`` per round (empty when
    it failed)."""

    round_ms: tuple[float, ...] = ()
    max_rel_err: float | None = None
    error: str | None = None

    @property
    def ms(self) -> float | None:
        """The median over rounds; None when it failed."""
        return statistics.median(self.round_ms) if self.round_ms else None

    def timed_again(self, fn: Callable[..., Any], arg_sets: Sequence[Sequence[jax.Array]],
                    config: SuiteConfig) -> Measurement:
        """One more round (a measurement that failed stays as it is)."""
        if self.ms is None:
            return self
        try:
            ms = _time(fn, arg_sets, config)
        except Exception as exc:
            return Measurement(error=error_summary(exc), max_rel_err=self.max_rel_err)
        return dataclasses.replace(self, round_ms=(*self.round_ms, ms))


def _time(fn: Callable[..., Any], arg_sets: Sequence[Sequence[jax.Array]],
          config: SuiteConfig) -> float:
    return time_fn(fn, arg_sets, iters=config.iters, warmup=config.warmup,
                   max_seconds=config.max_seconds).median_ms


def relative_error(actual: Any, expected: Any) -> float:
    """``max |actual - expected| / max |expected|`` over matching pytree leaves (NaN-aware:
    a NaN anywhere gives NaN)."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a32, e32 = jnp.asarray(a, jnp.float32), jnp.asarray(e, jnp.float32)
        scale = float(jnp.max(jnp.abs(e32)))
        diff = float(jnp.max(jnp.abs(a32 - e32)))
        err = diff / scale if scale > 0 else diff
        if math.isnan(err):
            return math.nan
        worst = max(worst, err)
    return worst


def _forward(impl: Implementation, causal: bool) -> Callable[..., Any]:
    return jax.jit(lambda q, k, v: impl.fn(q, k, v, causal))


def _forward_backward(impl: Implementation, causal: bool) -> Callable[..., Any]:
    def fwdbwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array) -> tuple[jax.Array, ...]:
        out, vjp = jax.vjp(lambda q, k, v: impl.fn(q, k, v, causal), q, k, v)
        return (out, *vjp(do))

    return jax.jit(fwdbwd)


class _Runner:
    """Jitted functions per (implementation, causal, measured pass), reused across points so
    the reference and the timed calls share one compilation."""

    def __init__(self, config: SuiteConfig):
        self.config = config
        self._fns: dict[tuple[str, bool, str], Callable[..., Any]] = {}

    def fn(self, impl: Implementation, causal: bool, kind: str) -> Callable[..., Any]:
        key = (impl.name, causal, kind)
        if key not in self._fns:
            make = _forward if kind == "fwd" else _forward_backward
            self._fns[key] = make(impl, causal)
        return self._fns[key]

    def measure_impl(self, impl: Implementation, causal: bool, kinds: Sequence[str],
                     sets: Sequence[tuple[jax.Array, ...]], expected: Mapping[str, Any],
                     before: Mapping[str, Measurement] | None = None
                     ) -> dict[str, Measurement]:
        """Measure each kind (``fwd``, ``fwdbwd``) of ``impl`` on input sets ``(q, k, v, do)``,
        cast to the implementation's own dtype if it has one; with ``before`` (the earlier
        rounds' measurements) time one more round, unchecked."""
        dtype = sets[0][0].dtype
        if impl.dtype is not None and impl.dtype != dtype:
            sets = [tuple(x.astype(impl.dtype) for x in s) for s in sets]
        measured = {}
        for kind in kinds:
            args = sets if kind == "fwdbwd" else [s[:3] for s in sets]
            fn = self.fn(impl, causal, kind)
            measured[kind] = (self.measure(fn, args, expected.get(kind)) if before is None
                              else before[kind].timed_again(fn, args, self.config))
        del sets
        gc.collect()
        return measured

    def measure(self, fn: Callable[..., Any], arg_sets: Sequence[Sequence[jax.Array]],
                expected: Any) -> Measurement:
        """Check ``fn`` against ``expected`` (if given) on the first input set, then time it."""
        cfg = self.config
        try:
            out = jax.block_until_ready(fn(*arg_sets[0]))
            err = None if expected is None else relative_error(out, expected)
            del out
            if err is not None and not err <= cfg.tolerance:
                return Measurement(max_rel_err=err,
                                   error=f"wrong result: max rel err {err:.3g} > {cfg.tolerance}")
            ms = _time(fn, arg_sets, cfg)
        except Exception as exc:
            return Measurement(error=error_summary(exc))
        return Measurement(round_ms=(ms,), max_rel_err=err)


@jax.jit(static_argnums=(1, 2, 3))
def _inputs(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype,
            n_sets: int) -> list[tuple[jax.Array, ...]]:
    """``n_sets`` tuples ``(q, k, v, do)`` of standard-normal values (one compilation)."""
    keys = jax.random.split(key, (n_sets, 4))
    return [tuple(jax.random.normal(keys[i, j], shape, dtype) for j in range(4))
            for i in range(n_sets)]


def _kinds(passes: Sequence[str]) -> tuple[str, ...]:
    """The measured functions the reported passes need (bwd = fwdbwd - fwd)."""
    kinds = []
    if "fwd" in passes or "bwd" in passes:
        kinds.append("fwd")
    if "fwdbwd" in passes or "bwd" in passes:
        kinds.append("fwdbwd")
    return tuple(kinds)


def _point_record(impl: Implementation, dtype: str, head_dim: int, seq_len: int, batch: int,
                  heads: int, causal: bool, pass_: Pass,
                  measured: Mapping[str, Measurement]) -> dict[str, Any]:
    """The JSON record of one (implementation, point, pass) from its measurements."""
    if pass_ == "bwd":
        fwd, both = measured["fwd"], measured["fwdbwd"]
        error = both.error or (fwd.error and f"forward: {fwd.error}")
        rounds = ()
        if error is None and fwd.ms is not None and both.ms is not None:
            rounds = tuple(b - f for f, b in zip(fwd.round_ms, both.round_ms, strict=True))
            if statistics.median(rounds) <= 0:
                error, rounds = (f"forward+backward ({both.ms:.3f} ms) not slower than "
                                 "forward"), ()
        result = Measurement(round_ms=rounds, max_rel_err=both.max_rel_err, error=error)
    else:
        result = measured[pass_]
    flops = attention_flops(batch, heads, seq_len, head_dim, causal=causal, pass_=pass_)
    return {
        "impl": impl.name, "dtype": dtype, "head_dim": head_dim, "seq_len": seq_len,
        "batch": batch, "heads": heads, "causal": causal, "pass": pass_,
        "flops": flops, "ms": result.ms, "round_ms": list(result.round_ms),
        "tflops": None if result.ms is None else tflops_per_s(flops, result.ms),
        "ratio_to_cudnn": None, "max_rel_err": result.max_rel_err, "error": result.error,
    }


def add_ratios(points: list[dict[str, Any]]) -> None:
    """Fill ``ratio_to_cudnn`` of every point that has a cuDNN point to compare with."""
    key = ("head_dim", "seq_len", "causal", "pass")
    cudnn = {tuple(p[k] for k in key): p["tflops"] for p in points
             if p["impl"] == REFERENCE and p["tflops"]}
    for p in points:
        base = cudnn.get(tuple(p[k] for k in key))
        p["ratio_to_cudnn"] = p["tflops"] / base if base and p["tflops"] is not None else None


def _progress(index: int, total: int, records: list[dict[str, Any]]) -> str:
    first = records[0]
    parts = [f"[{index:>3}/{total}] d={first['head_dim']:<3} L={first['seq_len']:<5} "
             f"{'causal' if first['causal'] else 'full  '} {first['impl']:<19}"]
    for r in records:
        if r["error"] is not None:
            parts.append(f"{r['pass']} FAILED {r['error'][:100]}")
        else:
            parts.append(f"{r['pass']} {r['ms']:.3f} ms {report.fmt_tflops(r['tflops'])} TF/s")
    errs = [r["max_rel_err"] for r in records if r["max_rel_err"] is not None]
    if errs:
        parts.append(f"err {max(errs):.1e}")
    return " | ".join(parts)


def select_implementations(
        config: SuiteConfig, registry: Mapping[str, Implementation],
        log: Callable[[str], None] = print,
) -> tuple[list[Implementation], str | None, dict[str, str]]:
    """Probe every registered implementation; returns (those to run, the reference's name or
    None, {name: why unavailable})."""
    dtype = DTYPES[config.dtype]
    unknown = sorted(set(config.impls or ()) - set(registry))
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; known: {sorted(registry)}")
    available, unavailable = {}, {}
    for name, impl in registry.items():
        reason = probe(impl, dtype)
        if reason is None:
            available[name] = impl
        else:
            unavailable[name] = reason
        log(f"probe {name:<20} {'ok' if reason is None else reason}")
    # Variants (by_default=False) run only when named.
    wanted = config.impls or tuple(name for name, impl in registry.items() if impl.by_default)
    run = [available[name] for name in wanted if name in available]
    reference = next((n for n in (REFERENCE, "xla") if n in available), None)
    return run, reference, {n: r for n, r in unavailable.items() if n in wanted}


def run_suite(config: SuiteConfig, registry: Mapping[str, Implementation] | None = None,
              on_point: Callable[[dict[str, Any]], None] | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the suite; returns the result document (see ``benchmarks/README.md``).

    Args:
      config: what to run.
      registry: the implementations to choose from (default ``IMPLEMENTATIONS``).
      on_point: called with the result so far after every point (to save partial results).
      log: where progress lines go.
    """
    registry = IMPLEMENTATIONS if registry is None else registry
    dtype = DTYPES[config.dtype]
    for d in config.head_dims:
        for length in config.seq_lens:
            problem_shape(d, length, tokens=config.tokens, hidden=config.hidden)
    impls, reference_name, unavailable = select_implementations(config, registry, log)
    device = jax.devices()[0]
    result: dict[str, Any] = {
        "schema": 1,
        "date": datetime.date.today().isoformat(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "config": {**dataclasses.asdict(config), "impls": [i.name for i in impls]},
        "reference": reference_name,
        "implementations": {i.name: {"dtype": _dtype_name(i.dtype or dtype), "note": i.note}
                            for i in impls},
        "unavailable": unavailable,
        "points": [],
    }
    runner = _Runner(config)
    kinds = _kinds(config.passes)
    key = jax.random.key(config.seed)
    start = time.perf_counter()
    grid = [(d, c, n) for d in config.head_dims for c in config.causal for n in config.seq_lens]
    total, index = len(grid) * len(impls), 0
    for head_dim, causal, seq_len in grid:
        batch, heads = problem_shape(head_dim, seq_len, tokens=config.tokens, hidden=config.hidden)
        key, point_key = jax.random.split(key)
        sets, expected = None, {}
        if config.time_limit is None or time.perf_counter() - start <= config.time_limit:
            sets = _inputs(point_key, (batch, seq_len, heads, head_dim), dtype, config.input_sets)
            expected = _reference_outputs(runner, registry.get(reference_name), causal, kinds,
                                          sets)
        measured_by: dict[str, dict[str, Measurement]] = {}
        for impl in impls:  # the first round checks each result against the reference
            if sets is None:
                skipped = Measurement(error=f"not run: --time-limit {config.time_limit:g} s")
                measured_by[impl.name] = dict.fromkeys(kinds, skipped)
            elif not impl.supports(head_dim):
                skipped = Measurement(error=f"not run: {impl.name} takes head_dim "
                                            f"{impl.head_dims} only")
                measured_by[impl.name] = dict.fromkeys(kinds, skipped)
            else:
                check = {} if impl.name == reference_name else expected
                measured_by[impl.name] = runner.measure_impl(impl, causal, kinds, sets, check)
        for _ in range(config.rounds - 1 if sets is not None else 0):
            for impl in impls:  # those not run, or failed in every kind, are not retried
                if any(m.ms is not None for m in measured_by[impl.name].values()):
                    measured_by[impl.name] = runner.measure_impl(
                        impl, causal, kinds, sets, expected, before=measured_by[impl.name])
        for impl in impls:
            index += 1
            measured = measured_by[impl.name]
            records = [_point_record(impl, _dtype_name(impl.dtype or dtype), head_dim, seq_len,
                                     batch, heads, causal, p, measured) for p in config.passes]
            result["points"].extend(records)
            log(_progress(index, total, records))
        del sets, expected
        gc.collect()
        add_ratios(result["points"])
        if on_point is not None:
            on_point(result)
    add_ratios(result["points"])
    return result


def _reference_outputs(runner: _Runner, reference: Implementation | None, causal: bool,
                       kinds: Sequence[str], sets: Sequence[tuple[jax.Array, ...]]) -> dict:
    """The reference implementation's outputs on the first input set, per measured kind
    (a kind is missing when the reference fails there)."""
    expected = {}
    if reference is None:
        return expected
    for kind in kinds:
        args = sets[0] if kind == "fwdbwd" else sets[0][:3]
        try:
            expected[kind] = jax.block_until_ready(runner.fn(reference, causal, kind)(*args))
        except Exception:
            continue
    return expected


def _dtype_name(dtype: jnp.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == jnp.dtype(dtype))


def write_json(result: Mapping[str, Any], path: Path) -> None:
    """Write ``result`` atomically (a killed run leaves the previous complete file)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def _names(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None = None) -> tuple[SuiteConfig, Path, str | None]:
    """Command line → (config, output directory, file-name tag)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = [n for n, i in IMPLEMENTATIONS.items() if i.by_default]
    variants = [n for n in IMPLEMENTATIONS if n not in defaults]
    parser.add_argument("--impls", type=_names(tuple(IMPLEMENTATIONS)),
                        help=f"comma list (default: every available one of "
                             f"{','.join(defaults)}; run only when named: {','.join(variants)})")
    parser.add_argument("--head-dims", type=int_list, help=f"default {_FULL['head_dims']}")
    parser.add_argument("--seq-lens", type=int_list, help=f"default {_FULL['seq_lens']}")
    parser.add_argument("--causal", choices=tuple(_CAUSAL), default="both")
    parser.add_argument("--passes", type=_names(PASSES), default=PASSES,
                        help="comma list of fwd,bwd,fwdbwd (default all)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, help="timing samples per measurement (default 30)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default 3)")
    parser.add_argument("--max-seconds", type=float,
                        help="stop sampling a measurement after this long, once 5 samples are "
                             "taken (default 2)")
    parser.add_argument("--tokens", type=int, help="batch × seq_len (default 16384)")
    parser.add_argument("--hidden", type=int, help="heads × head_dim (default 2048)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="max relative error vs the reference before a point counts as "
                             "wrong (default 0.05)")
    parser.add_argument("--time-limit", type=float,
                        help="seconds; points not started by then are recorded as not run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds per point (default 3; --quick: 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", help="appended to the output file names")
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny sizes for a CPU smoke test: {_QUICK}")
    args = parser.parse_args(argv)
    sizes = _QUICK if args.quick else _FULL
    pick = {name: getattr(args, name) if getattr(args, name) is not None else default
            for name, default in sizes.items()}
    config = SuiteConfig(
        impls=args.impls,
        head_dims=pick["head_dims"] if isinstance(pick["head_dims"], tuple)
        else int_list(pick["head_dims"]),
        seq_lens=pick["seq_lens"] if isinstance(pick["seq_lens"], tuple)
        else int_list(pick["seq_lens"]),
        causal=_CAUSAL[args.causal], passes=tuple(args.passes), dtype=args.dtype,
        iters=pick["iters"], warmup=pick["warmup"], max_seconds=pick["max_seconds"],
        tokens=pick["tokens"], hidden=pick["hidden"], tolerance=args.tolerance,
        time_limit=args.time_limit, seed=args.seed, rounds=pick["rounds"])
    if config.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {config.rounds}")
    try:
        for d in config.head_dims:
            for length in config.seq_lens:
                problem_shape(d, length, tokens=config.tokens, hidden=config.hidden)
    except ValueError as exc:
        parser.error(str(exc))
    return config, args.out, args.tag


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.suite``."""
    config, out_dir, tag = parse_args(argv)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    stem = report.file_stem("suite", device.device_kind, datetime.date.today().isoformat(), tag)
    json_path = out_dir / f"{stem}.json"
    print(f"pallas-flash benchmark suite: {device.device_kind}, jax {jax.__version__}, "
          f"writing {json_path}", flush=True)
    result = run_suite(config, on_point=lambda r: write_json(r, json_path),
                       log=lambda line: print(line, flush=True))
    write_json(result, json_path)
    status = 0
    try:
        md_path, charts = report.write_report(result, out_dir, stem)
        print(f"\nwrote {json_path}, {md_path} and {len(charts)} charts\n")
    except Exception as exc:  # the JSON is safe; `python -m benchmarks.report` can retry
        print(f"\nwrote {json_path}; markdown/charts failed: {error_summary(exc)}\n")
        status = 1
    print(report.text_table(result), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""``pallas-flash``: the tutorial's experiments from the command line.

    pallas-flash check    every implementation vs the float64 oracle (forward, causal, dQ/dK/dV)
    pallas-flash bench    standard attention vs ours (and cuDNN, XLA, JAX's Pallas ops on a GPU)
    pallas-flash memory   peak memory of standard vs tiled attention as L grows
    pallas-flash io       the HBM-traffic model for the kernels' real block sizes

``python -m pallas_flash`` is the same program. Without a GPU everything runs on the CPU on
small sizes (Pallas kernels in interpret mode) and says so. Everything here runs from an
installed wheel; the full benchmark suite (more implementations, per-point correctness checks,
the backward alone) is the repository's ``python -m benchmarks.suite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import pallas_flash as pf
from pallas_flash import dispatch
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import standard_attention
from pallas_flash.tuning import time_fn
from pallas_flash.tutorial import demo, io_model

DTYPES = {"fp32": jnp.dtype(jnp.float32), "bf16": jnp.dtype(jnp.bfloat16),
          "fp16": jnp.dtype(jnp.float16)}
_CAUSAL = {"no": (False,), "yes": (True,), "both": (False, True)}
_MIB = 1 << 20

# (q, k, v, causal) -> out, on [batch, seq, heads, head_dim] arrays.
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _device_line() -> str:
    device = jax.devices()[0]
    where = "GPU" if _on_gpu() else "CPU (no GPU found: small sizes, Pallas in interpret mode)"
    return f"device: {device.device_kind} [{where}], jax {jax.__version__}"


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: ``"512,1024"`` -> (512, 1024), positive integers only."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    """argparse type: one positive integer."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: one positive finite number."""
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from exc
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _require_matplotlib(command: str) -> None:
    """Exit with one line unless matplotlib imports: ``--plot`` needs it, and finding out
    after the table has been computed would waste the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"pallas-flash {command}: --plot needs matplotlib, which the core "
                         'package does not install: pip install "pallas-flash[bench]"') from None


class _NoBar:
    """Stands in for a tqdm bar when tqdm is not installed (it comes with the train extra)."""

    def __init__(self, iterable=None, **_):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        del n

    def close(self) -> None:
        pass


def _progress(iterable, **kwargs):
    """A tqdm bar on stderr (the tables go to stdout)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    return tqdm(iterable, file=sys.stderr, leave=False, **kwargs)


# --- check -----------------------------------------------------------------------------


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser,
           candidates: Mapping[str, demo.Candidate] | None) -> int:
    found = dict(demo.candidates() if candidates is None else candidates)
    if args.impls:
        unknown = sorted(set(args.impls) - set(found))
        if unknown:
            parser.error(f"--impls: unknown or unavailable here: {', '.join(unknown)}; "
                         f"choose from {', '.join(found)}")
        found = {name: found[name] for name in args.impls}
    dtype = DTYPES[args.dtype]
    print(_device_line())
    print(f"check vs float64 oracle: B={args.batch} H={args.heads} L={args.seq_len} "
          f"d={args.head_dim} {dtype.name}, forward" + ("" if args.no_grads else
                                                       " and dQ, dK, dV"))
    rows = demo.compare(
        found, batch=args.batch, seq_len=args.seq_len, heads=args.heads,
        head_dim=args.head_dim, dtype=dtype, causal=_CAUSAL[args.causal],
        grads=not args.no_grads, tolerance=args.tolerance, seed=args.seed,
        progress=lambda jobs: _progress(jobs, desc="check", unit="impl"))
    print(demo.format_table(rows))
    failed = sorted({r.label for r in rows if not r.ok})
    tolerance = demo.TOLERANCES[dtype.name] if args.tolerance is None else args.tolerance
    print(f"tolerance: max |error| / max |reference| <= {tolerance:g}; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all passed"))
    return 1 if failed else 0


# --- bench -----------------------------------------------------------------------------


def _standard(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return standard_attention(q, k, v, mask=MaskSpec(q.shape[1], k.shape[1],
                                                     is_causal=causal))[0]


def _jax_nn(implementation: str) -> AttentionFn:
    def run(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                            implementation=implementation)
    return run


def _ours(implementation: str) -> AttentionFn:
    def run(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        return pf.attention(q, k, v, is_causal=causal, implementation=implementation)
    return run


def bench_registry() -> dict[str, AttentionFn]:
    """What ``bench`` can time here, by name: ``standard`` (S and P materialised), each
    ``pallas_flash`` implementation available on this device (``pallas_flash_<name>``), and
    ``jax.nn.dot_product_attention`` as ``xla`` and, on a GPU, ``cudnn``. Every function is
    ``(q, k, v, causal) -> out``."""
    registry: dict[str, AttentionFn] = {"standard": _standard}
    if _on_gpu():
        registry["cudnn"] = _jax_nn("cudnn")
    registry["xla"] = _jax_nn("xla")
    for name in pf.available_implementations():
        registry[f"pallas_flash_{name}"] = _ours(name)
    return registry


def problem_shape(head_dim: int, seq_len: int, *, tokens: int, hidden: int) -> tuple[int, int]:
    """``(batch, heads)`` of the papers' benchmark shapes: ``batch = tokens / seq_len``,
    ``heads = hidden / head_dim``; ValueError when a division is not exact."""
    if head_dim <= 0 or hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of head_dim {head_dim}")
    if seq_len <= 0 or tokens % seq_len:
        raise ValueError(f"tokens {tokens} is not a multiple of seq_len {seq_len}")
    return tokens // seq_len, hidden // head_dim


def _bench_point(fn: AttentionFn, pass_: str, shape: tuple[int, ...], dtype: jnp.dtype,
                 causal: bool, args: argparse.Namespace) -> tuple[float | None, str | None]:
    """Median milliseconds of one pass (``fwd`` or ``fwdbwd``) on fresh inputs, or the
    error that stopped it."""
    def forward(q, k, v):
        return fn(q, k, v, causal)

    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(forward, q, k, v)
        return out, *vjp(d_out)

    # Three input sets in rotation, so that caches are not flattered by one set re-read.
    arg_sets = [tuple(jax.random.normal(key, shape, dtype) for key in
                      jax.random.split(jax.random.key(seed), 4 if pass_ == "fwdbwd" else 3))
                for seed in range(3)]
    timed = jax.jit(forward_backward if pass_ == "fwdbwd" else forward)
    gpu = _on_gpu()
    try:
        timing = time_fn(timed, arg_sets, iters=args.iters or (20 if gpu else 3),
                         warmup=2 if gpu else 1, max_seconds=2.0 if gpu else 0.5)
    except Exception as error:  # a point that does not compile or fit is reported, not fatal
        line = next((x for x in str(error).splitlines() if x.strip()), "")
        return None, f"{type(error).__name__}: {line}"[:300]
    return timing.median_ms, None


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, _) -> int:
    gpu = _on_gpu()
    registry = bench_registry()
    if args.impls:
        unknown = sorted(set(args.impls) - set(registry))
        if unknown:
            parser.error(f"--impls: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(registry)}")
        registry = {name: registry[name] for name in args.impls}
    seq_lens = args.seq_lens or ((512, 1024, 2048, 4096, 8192, 16384) if gpu
                                 else (128, 256, 512))
    tokens = args.tokens or (16384 if gpu else 1024)
    hidden = args.hidden or (2048 if gpu else 128)
    shapes = {}
    for length in seq_lens:
        try:
            shapes[length] = problem_shape(args.head_dim, length, tokens=tokens, hidden=hidden)
        except ValueError as exc:
            parser.error(str(exc))
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    passes = ("fwd", "fwdbwd") if args.backward else ("fwd",)
    print(_device_line())
    print(f"bench: batch × L = {tokens} tokens, hidden {hidden} (heads = {hidden // args.head_dim}"
          f" of {args.head_dim}), {dtype.name}; FLOPs 4·B·H·L²·D (halved when causal)"
          + (", forward+backward 3.5× forward" if args.backward else ""))
    jobs = [(length, causal, pass_, name) for length in seq_lens
            for causal in _CAUSAL[args.causal] for pass_ in passes for name in registry]
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    points = []
    for length, causal, pass_, name in _progress(jobs, desc="bench", unit="point"):
        batch, heads = shapes[length]
        ms, error = None, "not run: --time-limit reached"
        if deadline is None or time.monotonic() < deadline:
            ms, error = _bench_point(registry[name], pass_, (batch, length, heads, args.head_dim),
                                     dtype, causal, args)
        flops = (4.0 * batch * heads * length * length * args.head_dim / (2 if causal else 1)
                 * (3.5 if pass_ == "fwdbwd" else 1.0))
        points.append({"impl": name, "pass": pass_, "causal": causal, "seq_len": length,
                       "head_dim": args.head_dim, "batch": batch, "heads": heads, "ms": ms,
                       "tflops": flops / (ms * 1e9) if ms else None, "error": error})
    result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  config=dict(dtype=dtype.name, tokens=tokens, hidden=hidden,
                              head_dim=args.head_dim, seq_lens=list(seq_lens),
                              causal=list(_CAUSAL[args.causal]), passes=list(passes)),
                  points=points)
    add_speedups(points)
    print(bench_table(result))
    if not gpu:
        print("on CPU there is no small fast on-chip memory to tile for: expect no speedup "
              "here; the numbers that matter come from a GPU (benchmarks/results/)")
    print("more implementations (JAX's Pallas ops, tokamax), the backward alone and a "
          "correctness check per point: python -m benchmarks.suite, from a source checkout")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        _plot_bench(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def add_speedups(points: list[dict[str, Any]]) -> None:
    """Set ``speedup_vs_standard`` = standard's time / the point's time (None if either
    is missing) on every bench point."""
    key = ("seq_len", "causal", "pass", "head_dim")
    standard = {tuple(p[k] for k in key): p["ms"] for p in points
                if p["impl"] == "standard" and p["ms"]}
    for p in points:
        base = standard.get(tuple(p[k] for k in key))
        p["speedup_vs_standard"] = base / p["ms"] if base and p["ms"] else None


def bench_table(result: Mapping[str, Any]) -> str:
    """The points of a bench result as a text table: time, TFLOP/s and speedup vs standard."""
    lines = [f"{'pass':6s} {'causal':6s} {'L':>6s}  {'implementation':22s} {'ms':>9s} "
             f"{'TFLOP/s':>8s} {'vs standard':>11s}"]
    order = sorted(result["points"], key=lambda p: (p["pass"], p["causal"], p["seq_len"]))
    for p in order:
        if p["error"]:
            cells = f"{'-':>9s} {'-':>8s} {'-':>11s}  {p['error'][:60]}"
        else:
            speedup = p.get("speedup_vs_standard")
            cells = (f"{p['ms']:9.3f} {p['tflops']:8.3g} "
                     f"{(f'{speedup:.2f}×' if speedup else '-'):>11s}")
        lines.append(f"{p['pass']:6s} {'yes' if p['causal'] else 'no':6s} {p['seq_len']:6d}  "
                     f"{p['impl']:22s} {cells}")
    return "\n".join(lines)


def _plot_bench(result: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list[tuple[int, float, float]]] = {}
    for p in result["points"]:
        if p["ms"]:
            label = (p["impl"], p["pass"], p["causal"])
            series.setdefault(label, []).append((p["seq_len"], p["ms"], p["tflops"]))
    for (impl, pass_, causal), values in sorted(series.items()):
        values.sort()
        lengths = [v[0] for v in values]
        name = f"{impl} {pass_}" + (" causal" if causal else "")
        axes[0].plot(lengths, [v[1] for v in values], marker="o", label=name)
        axes[1].plot(lengths, [v[2] for v in values], marker="o", label=name)
    for ax, ylabel in zip(axes, ("time per call (ms)", "TFLOP/s"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{result['device']}, {result['config']['dtype']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- memory ----------------------------------------------------------------------------


def compiled_temp_bytes(fn: Callable[..., Any], *shapes: jax.ShapeDtypeStruct) -> int | None:
    """Temporary buffer bytes XLA assigns to ``jit(fn)`` for these input shapes (compiled,
    never run), or None when the backend does not say.

    Raises:
      MemoryError: compiling ran out of device memory (XLA's GPU autotuner allocates the
        program's buffers to time its candidates: on the H200, standard attention's
        backward at L 32768 asked for 64 GiB there).
    """
    try:
        analysis = jax.jit(fn).lower(*shapes).compile().memory_analysis()
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        raise MemoryError(f"compiling ran out of device memory: {error}") from error
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def _device_memory_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() if _on_gpu() else None
    return None if not stats else stats.get("bytes_limit")


@dataclasses.dataclass
class MemoryRow:
    """One sequence length of ``pallas-flash memory`` (bytes; measured = compiled temps)."""

    seq_len: int
    standard_peak: int
    tiled_peak: int
    standard_temp: int | None
    tiled_temp: int | None
    why_not: str = ""  # where standard attention does not fit the device: what said so

    @property
    def fits(self) -> bool:
        return not self.why_not


def _memory(args: argparse.Namespace, parser: argparse.ArgumentParser, _) -> int:
    gpu = _on_gpu()
    impl = args.impl or pf.default_implementation()
    interpret = impl == "triton" and not gpu
    if impl == "mosaic" and "mosaic" not in pf.available_implementations():
        parser.error("--impl mosaic needs a Hopper GPU")
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    heads = args.heads or (16 if gpu else 4)
    head_dim = args.head_dim or (128 if gpu else 64)
    seq_lens = args.seq_lens or (tuple(1024 << i for i in range(9)) if gpu
                                 else (256, 512, 1024, 2048, 4096))
    limit = _device_memory_limit()
    print(_device_line())
    print(f"memory: batch {args.batch}, {heads} heads of {head_dim}, {dtype.name}, "
          f"{'forward+backward' if args.backward else 'forward'}; tiled = {impl}"
          + (" (interpret mode)" if interpret else ""))
    print("analytic: inputs + output + scratch (standard: S and P in float32; tiled: the lse); "
          "measured: XLA's temporary buffers for the compiled program")
    if limit:
        print(f"device memory: {limit / 2**30:.1f} GiB (memory_stats bytes_limit)")
    else:
        print("on CPU: compiled (not run) up to a modest L; the kernels' tiles live on chip "
              "only on a GPU (the CPU's tiled path is XLA's chunked scan, O(L·block) scratch)")

    def tiled(q, k, v):
        return pf.attention(q, k, v, is_causal=args.causal, implementation=impl,
                            interpret=interpret)

    def standard(q, k, v):
        return _standard(q, k, v, args.causal)

    def with_backward(fn):
        def fwd_bwd(q, k, v, d_out):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, *vjp(d_out)
        return fwd_bwd

    rows: list[MemoryRow] = []
    itemsize = dtype.itemsize
    for length in _progress(seq_lens, desc="memory", unit="L"):
        shape = jax.ShapeDtypeStruct((args.batch, length, heads, head_dim), dtype)
        shapes = (shape,) * (4 if args.backward else 3)
        std = io_model.standard_attention_memory(args.batch, heads, length, head_dim,
                                                 itemsize=itemsize)
        til = io_model.tiled_attention_memory(args.batch, heads, length, head_dim,
                                              itemsize=itemsize)
        std_fn, til_fn = (with_backward(f) if args.backward else f for f in (standard, tiled))
        # Standard attention is compiled only where its analytic peak fits the device.
        std_temp, why_not = None, ""
        if limit is not None and std.peak_bytes > limit:
            why_not = f"analytic peak {std.peak_bytes / 2**30:.1f} GiB"
        else:
            try:
                std_temp = compiled_temp_bytes(std_fn, *shapes)
            except MemoryError:
                why_not = "compiling it ran out of device memory"
            else:
                if limit is not None and std.io_bytes + (std_temp or 0) > limit:
                    why_not = f"compiled: {(std.io_bytes + (std_temp or 0)) / 2**30:.1f} GiB"
        til_temp = compiled_temp_bytes(til_fn, *shapes)
        rows.append(MemoryRow(length, std.peak_bytes, til.peak_bytes, std_temp, til_temp,
                              why_not))
        if why_not:
            break
    print(memory_table(rows))
    if limit and not rows[-1].fits:
        print(f"standard attention no longer fits at L={rows[-1].seq_len} "
              f"({rows[-1].why_not}; the device has {limit / 2**30:.1f} GiB)")
    if args.plot:
        _plot_memory(rows, limit, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / _MIB:,.1f}"


def memory_table(rows: Sequence[MemoryRow]) -> str:
    """Rows as text: MiB analytic and measured, and standard / tiled."""
    lines = [f"{'L':>7s} {'standard MiB':>13s} {'tiled MiB':>10s} {'ratio':>7s}   "
             f"{'measured temp: standard':>23s} {'tiled':>9s}  fits"]
    for r in rows:
        lines.append(f"{r.seq_len:7d} {_mib(r.standard_peak):>13s} {_mib(r.tiled_peak):>10s} "
                     f"{r.standard_peak / r.tiled_peak:7.1f}   {_mib(r.standard_temp):>23s} "
                     f"{_mib(r.tiled_temp):>9s}  {'yes' if r.fits else 'NO'}")
    return "\n".join(lines)


def _plot_memory(rows: Sequence[MemoryRow], limit: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = [r.seq_len for r in rows]
    ax.plot(lengths, [r.standard_peak / _MIB for r in rows], "o-", label="standard (model)")
    ax.plot(lengths, [r.tiled_peak / _MIB for r in rows], "o-", label="tiled (model)")
    for attr, label in (("standard_temp", "standard: XLA temp buffers"),
                        ("tiled_temp", "tiled: XLA temp buffers")):
        points = [(r.seq_len, getattr(r, attr)) for r in rows if getattr(r, attr)]
        if points:
            ax.plot(*zip(*[(n, b / _MIB) for n, b in points], strict=True), "x--", label=label)
    if limit:
        ax.axhline(limit / _MIB, color="gray", ls=":", label="device memory")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- io --------------------------------------------------------------------------------


def kernel_blocks(impl: str, q_shape: tuple[int, ...], dtype: Any,
                  mask: MaskSpec) -> tuple[int, int, str]:
    """``(B_r, B_c, description)`` of the forward kernel's default tiles: the query rows
    one program keeps on chip (a Mosaic CTA holds ``num_consumers`` warpgroups of
    ``block_q`` rows) and the keys per K/V block."""
    config = dispatch.backend(impl).default_config(q_shape, q_shape, dtype, mask)
    if impl == "triton":
        return config.block_q, config.block_kv, repr(config)
    return config.rows_per_cta, config.block_kv, repr(config)


def shared_memory_bytes(device_kind: str) -> int | None:
    """Shared memory one thread block may use: 227 KiB on Hopper (H100/H200/H800/H20),
    None for devices this package has no number for."""
    if not re.search(r"\bH(100|200|800|20)\b", device_kind):
        return None
    return dispatch.backend("mosaic").SMEM_BUDGET


def _io(args: argparse.Namespace, parser: argparse.ArgumentParser, _) -> int:
    gpu = _on_gpu()
    impl = args.impl or ("mosaic" if "mosaic" in pf.available_implementations() else "triton")
    if gpu and impl == "mosaic" and "mosaic" not in pf.available_implementations():
        parser.error("--impl mosaic needs a Hopper GPU")
    dtype = DTYPES[args.dtype]
    if impl == "mosaic" and dtype.itemsize != 2:
        parser.error("--impl mosaic takes bf16 or fp16 (the Mosaic kernel has no float32 path)")
    seq_lens = args.seq_lens or (1024, 2048, 4096, 8192, 16384)
    for length in seq_lens:
        try:
            problem_shape(args.head_dim, length, tokens=args.tokens, hidden=args.hidden)
        except ValueError as exc:
            parser.error(str(exc))
    device_kind = jax.devices()[0].device_kind
    smem = shared_memory_bytes(device_kind) if gpu else None
    print(_device_line())
    if gpu and smem is None:
        print(f"shared memory of a {device_kind} is not known here; assuming Hopper's 227 KiB")
    if not gpu:
        print("no GPU: this is the model only (no kernel is timed); shared memory per block "
              "of an H100/H200 assumed")
    smem = smem or shared_memory_bytes("H100")
    itemsize = dtype.itemsize
    print(f"io: {impl} forward, {dtype.name}, {args.tokens} tokens, hidden {args.hidden}, "
          f"head_dim {args.head_dim}, causal {args.causal}; shared memory M = "
          f"{smem / 1024:.0f} KiB = {smem // itemsize} elements of {itemsize} bytes")
    lines = [f"{'L':>6s} {'B×H':>7s} {'B_r×B_c':>8s} {'K/V passes':>10s} {'standard MiB':>13s} "
             f"{'tiled MiB':>10s} {'ratio':>6s} {'L²d²/M MiB':>11s}"
             + (f" {'fwd ms':>8s} {'model GB/s':>10s}" if gpu else "")]
    config_line = ""
    for length in _progress(seq_lens, desc="io", unit="L"):
        batch, heads = problem_shape(args.head_dim, length, tokens=args.tokens,
                                     hidden=args.hidden)
        q_shape = (batch, length, heads, args.head_dim)
        mask = MaskSpec(length, length, is_causal=args.causal)
        block_q, block_kv, config_line = kernel_blocks(impl, q_shape, dtype, mask)
        std = io_model.standard_attention_traffic(batch, heads, length, args.head_dim,
                                                  itemsize=itemsize)
        til = io_model.tiled_attention_traffic(batch, heads, length, args.head_dim,
                                               block_q=block_q, block_kv=block_kv,
                                               itemsize=itemsize, causal=args.causal)
        passes = io_model.kv_keys_loaded(length, length, block_q, block_kv, mask=mask) / length
        bound = batch * heads * itemsize * io_model.io_bound_elements(
            length, args.head_dim, smem // itemsize)
        line = (f"{length:6d} {f'{batch}×{heads}':>7s} {f'{block_q}×{block_kv}':>8s} "
                f"{passes:10.1f} {_mib(std.total_bytes):>13s} {_mib(til.total_bytes):>10s} "
                f"{std.total_bytes / til.total_bytes:6.1f} {bound / _MIB:11,.1f}")
        if gpu:
            keys = jax.random.split(jax.random.PRNGKey(length), 3)
            q, k, v = (jax.random.normal(key, q_shape, dtype) for key in keys)
            fn = jax.jit(lambda q, k, v: pf.attention(q, k, v, is_causal=args.causal,
                                                      implementation=impl))
            ms = time_fn(fn, [(q, k, v)], iters=args.iters).median_ms
            line += f" {ms:8.3f} {til.total_bytes / (ms * 1e-3) / 1e9:10.0f}"
        lines.append(line)
    print(f"tiles (default config at the last L): {config_line}")
    working = io_model.sram_elements(block_q, block_kv, args.head_dim)
    print(f"tutorial constraint B_r·d + B_c·d + B_r·B_c = {working} elements = "
          f"{working * itemsize / 1024:.0f} KiB ≤ M = {smem / 1024:.0f} KiB: "
          f"{'holds' if io_model.fits_sram(block_q, block_kv, args.head_dim, smem, itemsize=itemsize) else 'violated'}"  # noqa: E501
          f"; paper's choice for this M: (B_r, B_c) = "
          f"{io_model.paper_block_sizes(smem // itemsize, args.head_dim)}")
    print("\n".join(lines))
    print("K/V passes: times each key is read (once per query block; causal skips blocks "
          "above the diagonal). ratio = standard / tiled bytes."
          + (" model GB/s = tiled bytes / forward time." if gpu else ""))
    return 0


# --- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``pallas-flash`` (subcommands check, bench, memory, io)."""
    parser = argparse.ArgumentParser(
        prog="pallas-flash", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pallas-flash {pf.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="every implementation vs the float64 oracle",
                           description="Forward (and dQ, dK, dV) of every implementation that "
                                       "runs here vs pallas_flash.reference.attention_float64;"
                                       " exit code 1 on any failure.")
    check.add_argument("--impls", type=lambda s: tuple(x for x in s.split(",") if x),
                       help="comma list of fa1-loops,fa2-loops,xla,triton,mosaic "
                            "(default: all that run here)")
    check.add_argument("--batch", type=_positive_int, default=2)
    check.add_argument("--heads", type=_positive_int, default=4)
    check.add_argument("--seq-len", type=_positive_int, default=128)
    check.add_argument("--head-dim", type=_positive_int, default=64)
    check.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    check.add_argument("--causal", choices=tuple(_CAUSAL), default="both")
    check.add_argument("--tolerance", type=_positive_float,
                       help="max |error| / max |reference| (default: 1e-5 fp32, 2e-2 bf16, "
                            "5e-3 fp16)")
    check.add_argument("--no-grads", action="store_true", help="forward only")
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(run=_check, subparser=check)

    bench = sub.add_parser(
        "bench", help="standard attention vs ours (time, TFLOP/s, speedup)",
        description="Times standard attention (S and P materialised) against pallas-flash "
                    "and jax.nn.dot_product_attention (xla; cudnn on a GPU), with the "
                    "papers' shapes (batch × L = --tokens, heads = --hidden / --head-dim). "
                    "GPU defaults: L 512…16384, bf16; CPU: L 128…512, fp32, 1024 tokens, "
                    "hidden 128. More implementations: python -m benchmarks.suite, from a "
                    "source checkout.")
    bench.add_argument("--seq-lens", type=int_list)
    bench.add_argument("--head-dim", type=_positive_int, default=64)
    bench.add_argument("--tokens", type=_positive_int, help="batch × L")
    bench.add_argument("--hidden", type=_positive_int, help="heads × head_dim")
    bench.add_argument("--causal", choices=tuple(_CAUSAL), default="no")
    bench.add_argument("--backward", action="store_true",
                       help="also time forward+backward (pass fwdbwd)")
    bench.add_argument("--dtype", choices=tuple(DTYPES))
    bench.add_argument("--impls", type=lambda s: tuple(x for x in s.split(",") if x),
                       help="comma list (default: every one that runs here)")
    bench.add_argument("--iters", type=_positive_int, help="timing samples")
    bench.add_argument("--time-limit", type=_positive_float,
                       help="seconds; later points are not run")
    bench.add_argument("--json", type=Path, help="write the results (JSON) here")
    bench.add_argument("--plot", type=Path, help="write a PNG of time and TFLOP/s vs L")
    bench.set_defaults(run=_bench, subparser=bench)

    memory = sub.add_parser(
        "memory", help="peak memory of standard vs tiled attention as L grows",
        description="Analytic (pallas_flash.tutorial.io_model) and compiled (XLA memory_analysis "
                    "temp bytes) memory of standard vs tiled attention, up to the L where "
                    "standard attention no longer fits the GPU (CPU: up to --seq-lens).")
    memory.add_argument("--seq-lens", type=int_list)
    memory.add_argument("--batch", type=_positive_int, default=1)
    memory.add_argument("--heads", type=_positive_int)
    memory.add_argument("--head-dim", type=_positive_int)
    memory.add_argument("--dtype", choices=tuple(DTYPES))
    memory.add_argument("--impl", choices=("xla", "triton", "mosaic"),
                        help="the tiled implementation (default: the fastest here)")
    memory.add_argument("--causal", action="store_true")
    memory.add_argument("--backward", action="store_true", help="measure forward+backward")
    memory.add_argument("--plot", type=Path, help="write a PNG of memory vs L")
    memory.set_defaults(run=_memory, subparser=memory)

    io = sub.add_parser(
        "io", help="HBM traffic of standard vs tiled attention for the real block sizes",
        description="The FlashAttention IO model (pallas_flash.tutorial.io_model) for the block "
                    "sizes of the kernel's default config and the device's shared memory; "
                    "on a GPU also the measured forward time.")
    io.add_argument("--impl", choices=("triton", "mosaic"),
                    help="whose tiles (default: mosaic on Hopper, else triton)")
    io.add_argument("--seq-lens", type=int_list)
    io.add_argument("--head-dim", type=_positive_int, default=128)
    io.add_argument("--tokens", type=_positive_int, default=16384, help="batch × L")
    io.add_argument("--hidden", type=_positive_int, default=2048, help="heads × head_dim")
    io.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    io.add_argument("--causal", action="store_true")
    io.add_argument("--iters", type=_positive_int, default=10)
    io.set_defaults(run=_io, subparser=io)
    return parser


def main(argv: Sequence[str] | None = None, *,
         candidates: Mapping[str, demo.Candidate] | None = None) -> int:
    """Entry point of ``pallas-flash`` and ``python -m pallas_flash``.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).
      candidates: the implementations ``check`` runs, by name (default
        :func:`pallas_flash.tutorial.demo.candidates`: everything that runs on this machine).

    Returns:
      The exit status: 0, or 1 when ``check`` finds a wrong implementation. Bad options
      exit with status 2 (argparse); ``--plot`` without matplotlib exits at once with
      status 1 and a line naming the ``bench`` extra.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "plot", None) is not None:
        _require_matplotlib(args.command)
    return args.run(args, args.subparser, candidates)


"""Compile time of a model with many attention layers: lowering, compiling, one call.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.compile_time --out $OUT
    [--impls pallas_flash_mosaic,cudnn] [--layers 12] [--seq-lens 8192,32768] [--quick]

A model calls attention once per layer, with the same shapes in every layer. For each
implementation (:data:`benchmarks.implementations.IMPLEMENTATIONS`) and length this builds
``jax.jit(jax.grad(f))``, where ``f`` chains ``--layers`` causal GQA attention calls (the
output of one layer is the query of the next; q ``[batch, L, heads, head_dim]``, K / V
``kv_heads`` heads), and times, once each and in this order, ``.lower()`` (tracing and
lowering to StableHLO, where Pallas kernels become Mosaic GPU / Triton modules) and
``.compile()`` (XLA, and the kernels' own compilation), then the compiled gradient
(:func:`benchmarks.timing.time_fn`, median). The gradients are compared with the first
implementation's (``max_abs_diff``, float32): a fast compile of a wrong program is moot.

``--quick``: a CPU smoke run (float32, tiny shapes, ``pallas_flash_xla`` against
``jax.nn``'s XLA path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import jax.numpy as jnp

from benchmarks import report
from benchmarks.implementations import IMPLEMENTATIONS, error_summary
from benchmarks.timing import time_fn


def layered_grad(attend, layers: int):
    """``jax.jit`` of the gradient (w.r.t. q, k, v) of ``layers`` chained causal calls."""

    def model(q, k, v):
        x = q
        for _ in range(layers):
            x = attend(x, k, v, True)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(model, argnums=(0, 1, 2)))


def run_point(name: str, seq: int, args, inputs) -> dict:
    """Lower, compile and time one implementation's gradient at one length."""
    row: dict = dict(impl=name, seq=seq, layers=args.layers, batch=args.batch,
                     heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     dtype=args.dtype, error=None)
    try:
        fn = layered_grad(IMPLEMENTATIONS[name].fn, args.layers)
        start = time.perf_counter()
        lowered = fn.lower(*inputs)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        row.update(lower_s=lowered_at - start, compile_s=time.perf_counter() - lowered_at)
        grads = jax.block_until_ready(compiled(*inputs))
        row["call_ms"] = time_fn(compiled, [inputs], iters=args.iters, warmup=1).median_ms
        row["grads"] = grads
    except Exception as exc:  # one implementation failing (e.g. out of memory) is a row
        row["error"] = error_summary(exc)
    return row


def table(header: str, rows: list[dict]) -> str:
    lines = [f"# Compile time of chained attention layers: {header}", "",
             "`jax.jit(jax.grad(f))`, `f` = the layers' causal attention calls chained. "
             "lower, compile: seconds, once each; call: ms, median; max abs diff: the "
             "gradients against the first implementation's.", "",
             "| impl | L | layers | lower (s) | compile (s) | call (ms) | max abs diff |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["error"] is None:
            lines.append(f"| {r['impl']} | {r['seq']} | {r['layers']} | {r['lower_s']:.2f} | "
                         f"{r['compile_s']:.2f} | {r['call_ms']:.3f} | "
                         f"{r['max_abs_diff']:.2g} |")
    lines += report.not_run([f"{r['impl']} at L {r['seq']}: {r['error']}"
                             for r in rows if r["error"] is not None])
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU smoke run")
    parser.add_argument("--impls", default=None,
                        help="comma list (default pallas_flash_mosaic,cudnn; --quick: "
                             "pallas_flash_xla,xla)")
    parser.add_argument("--seq-lens", default=None, help="default 8192,32768")
    parser.add_argument("--layers", type=int, default=None, help="default 12")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default 12")
    parser.add_argument("--kv-heads", type=int, default=None, help="default 4")
    parser.add_argument("--head-dim", type=int, default=None, help="default 64")
    parser.add_argument("--dtype", default=None, help="default bfloat16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    defaults = (dict(impls="pallas_flash_xla,xla", seq_lens="32", layers=3, heads=2,
                     kv_heads=1, head_dim=16, dtype="float32") if args.quick else
                dict(impls="pallas_flash_mosaic,cudnn", seq_lens="8192,32768", layers=12,
                     heads=12, kv_heads=4, head_dim=64, dtype="bfloat16"))
    report.fill_defaults(args, defaults)
    args.impl_names = args.impls.split(",")
    for name in args.impl_names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"--impls takes names from {sorted(IMPLEMENTATIONS)}, got {name!r}")
    if args.layers < 1:
        raise ValueError(f"--layers must be at least 1, got {args.layers}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads "
                         f"({args.kv_heads})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, batch {args.batch}, {args.heads} heads "
              f"({args.kv_heads} KV), head_dim {args.head_dim}, {args.dtype}")
    rows: list[dict] = []
    stem = report.file_stem("compile-time", jax.devices()[0].device_kind,
                            datetime.date.today().isoformat())
    for seq in (int(s) for s in args.seq_lens.split(",")):
        keys = jax.random.split(jax.random.PRNGKey(args.seed), 3)
        inputs = [jax.random.normal(key, (args.batch, seq, heads, args.head_dim), args.dtype)
                  for key, heads in zip(keys, (args.heads, args.kv_heads, args.kv_heads),
                                        strict=True)]
        first = None
        for name in args.impl_names:
            row = run_point(name, seq, args, inputs)
            grads = row.pop("grads", None)
            if grads is not None:
                first = grads if first is None else first
                row["max_abs_diff"] = max(
                    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    for a, b in zip(grads, first, strict=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # after every point: a run cut short keeps what it measured
                report.write_rows(args.out, stem, header, jax.__version__, rows,
                                  table(header, rows))
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

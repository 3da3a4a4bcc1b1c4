"""Ring attention across devices: per-device TFLOP/s and scaling efficiency.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.ring_scaling --out $OUT
    [--seq-lens 131072,262144,524288] [--devices 2,4,8] [--layouts zigzag,contiguous]
    [--quick]

For each global sequence length ``L``, device count ``n`` (the first ``n`` local
devices, one mesh axis ``ring``) and layout, this times, in interleaved rounds:

* ``ring``: :func:`pallas_flash.ring_attention` inside ``jax.shard_map`` on the sequence
  shards ``[batch, L / n, heads, head_dim]`` (causal by default; zigzag inputs reordered
  with :func:`pallas_flash.to_zigzag`); up to ``--check-max`` its forward is compared with
  :func:`pallas_flash.attention` on the whole sequence (``max_abs_diff``);
* ``plain``: :func:`pallas_flash.attention` on one device at the local length ``L / n``
  (the single-device kernel the ring's steps call);
* ``cudnn_gather`` (with ``--cudnn``): ``jax.nn.dot_product_attention(implementation=
  "cudnn")`` under plain ``jit`` with q, k, v sharded along the sequence: what a JAX user
  gets without a ring (XLA all-gathers what the call needs). It may run out of memory at
  long lengths; that is a row's error, not a crash.

Reported per device: ``TFLOP/s = FLOPs(L) / n / time`` with the FlashAttention papers'
conventions (:mod:`benchmarks.flops`: forward ``4·B·H·L²·D``, halved when causal; the
backward 2.5×), and the **scaling efficiency** ``ring TFLOP/s per device / plain TFLOP/s
at L / n`` (the goal: ≥ 0.95 on 2 devices, ≥ 0.90 on 8). Forward, and forward + backward
(``--passes``).

XLA overlaps one asynchronous collective at a time by default, which leaves one of each
step's K / V transfers synchronous (``docs/multi_device.md``); each row records
``XLA_FLAGS`` and the compiled program's collective-permutes (sync / async), so a run can
be repeated with ``XLA_FLAGS=--xla_gpu_collective_permute_combine_threshold_bytes=...``.

``--quick``: tiny float32 shapes on the XLA backend over the host's (fake) devices, for a
CPU smoke run (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import pallas_flash as pf
from benchmarks import report
from benchmarks.flops import attention_flops, tflops_per_s
from benchmarks.ring import AXIS, SEQ, collective_permutes, fwd_or_fwdbwd
from benchmarks.timing import time_fn


def make_calls(devices: list, layout: str, causal: bool, backward: bool,
               implementation: str | None, cudnn: bool) -> dict[str, tuple[Callable, Mesh]]:
    """name -> (jitted ``(q, k, v, d_out)`` function, the mesh its inputs live on)."""
    mesh = Mesh(np.array(devices), (AXIS,))
    one = Mesh(np.array(devices[:1]), (AXIS,))

    def ring(q, k, v):
        return pf.ring_attention(q, k, v, axis_name=AXIS, is_causal=causal, layout=layout,
                                 implementation=implementation)

    def plain(q, k, v):
        return pf.attention(q, k, v, is_causal=causal, implementation=implementation)

    specs = (SEQ,) * 4 if backward else SEQ
    calls = {
        "ring": (jax.jit(jax.shard_map(fwd_or_fwdbwd(ring, backward), mesh=mesh,
                                       in_specs=(SEQ,) * 4, out_specs=specs)), mesh),
        "plain": (jax.jit(fwd_or_fwdbwd(plain, backward)), one),
    }
    if cudnn:
        def gathered(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                implementation="cudnn")
        calls["cudnn_gather"] = (jax.jit(fwd_or_fwdbwd(gathered, backward)), mesh)
    return calls


def _inputs(shape: tuple[int, ...], dtype, mesh: Mesh, seed: int) -> list[jax.Array]:
    """q, k, v, d_out of ``shape``, drawn on the devices of ``mesh`` (sharded along the
    sequence; a 512k-token q is 2 GiB in bf16, too much to draw on the host and copy)."""
    draw = jax.jit(lambda key: jax.random.normal(key, shape, dtype),
                   out_shardings=NamedSharding(mesh, SEQ))
    return [draw(key) for key in jax.random.split(jax.random.PRNGKey(seed), 4)]


def _check(out: jax.Array, inputs: list[jax.Array], n: int, layout: str, args) -> float:
    """Max |ring output - attention on the whole sequence| (both in natural order): a wrong
    ring would make its time moot."""
    q, k, v = (jax.device_put(x, jax.devices()[0]) for x in inputs[:3])
    out = jax.device_put(out, jax.devices()[0])
    if layout == "zigzag":
        q, k, v, out = (pf.from_zigzag(x, n) for x in (q, k, v, out))
    want = pf.attention(q, k, v, is_causal=args.causal, implementation=args.implementation)
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))


def run_point(seq: int, n: int, layout: str, backward: bool, args) -> dict:
    """One (L, n, layout, pass) point: every variant timed in interleaved rounds."""
    devices = jax.devices()[:n]
    dtype = jnp.dtype(args.dtype)
    local = seq // n
    pass_ = "fwdbwd" if backward else "fwd"
    row: dict = dict(seq=seq, devices=n, seq_local=local, layout=layout, pass_=pass_,
                     causal=args.causal, batch=args.batch, heads=args.heads,
                     head_dim=args.head_dim, dtype=dtype.name,
                     implementation=args.implementation,
                     xla_flags=os.environ.get("XLA_FLAGS", ""), ms={}, errors={})
    calls = make_calls(devices, layout, args.causal, backward, args.implementation,
                       args.cudnn)
    runnable = {}
    for name, (fn, mesh) in calls.items():
        length = local if name == "plain" else seq
        inputs = _inputs((args.batch, length, args.heads, args.head_dim), dtype, mesh,
                         args.seed)
        if name == "ring" and layout == "zigzag":  # the global sequence in the ring's order
            inputs = [pf.to_zigzag(x, n) for x in inputs]
        try:
            out = jax.block_until_ready(fn(*inputs))
            runnable[name] = (fn, inputs)
            if name == "ring":
                row["collective_permutes"] = collective_permutes(
                    fn.lower(*inputs).compile().as_text())
                if not backward and seq <= args.check_max:
                    row["max_abs_diff"] = _check(out, inputs, n, layout, args)
        except Exception as e:  # a variant that fails (e.g. out of memory) is a row entry
            row["errors"][name] = str(e).splitlines()[0][:200]
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.rounds):
        for name, (fn, inputs) in runnable.items():
            samples[name].append(time_fn(fn, [inputs], iters=args.iters, warmup=1,
                                         max_seconds=args.max_seconds).median_ms)
    row["round_ms"] = samples
    per_device = {}
    for name, times in samples.items():
        ms = statistics.median(times)
        row["ms"][name] = ms
        length, share = (local, 1) if name == "plain" else (seq, n)
        flops = attention_flops(args.batch, args.heads, length, args.head_dim,
                                causal=args.causal, pass_=pass_)
        per_device[name] = tflops_per_s(flops / share, ms)
    row["tflops_per_device"] = per_device
    row["efficiency"] = (per_device["ring"] / per_device["plain"]
                         if {"ring", "plain"} <= per_device.keys() else None)
    return row


def table(header: str, rows: list[dict]) -> str:
    """A markdown table: one line per (pass, L, n, layout)."""
    lines = [f"# Ring attention across devices: {header}", "",
             "TFLOP/s per device (papers' FLOP conventions; median over interleaved rounds). "
             "efficiency: ring per device / plain at L / n on one device; max abs diff: the "
             "ring's forward against attention on the whole sequence; — where it did not "
             "run (or was not checked).", "",
             "| pass | L | n | layout | L / n | ring | plain (L / n, one device) | "
             "cudnn_gather | efficiency | permutes sync / async | max abs diff |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]

    def cell(r, name):
        value = r["tflops_per_device"].get(name)
        return "—" if value is None else f"{value:.4g}"

    for r in rows:
        eff = "—" if r["efficiency"] is None else f"{r['efficiency']:.3f}"
        permutes = r.get("collective_permutes")
        permutes = "—" if permutes is None else f"{permutes['sync']} / {permutes['async']}"
        lines.append(f"| {r['pass_']} | {r['seq']} | {r['devices']} | {r['layout']} | "
                     f"{r['seq_local']} | {cell(r, 'ring')} | {cell(r, 'plain')} | "
                     f"{cell(r, 'cudnn_gather')} | {eff} | {permutes} | "
                     f"{r.get('max_abs_diff', '—')} |")
    lines += report.not_run([f"{name} at {r['pass_']}, L {r['seq']}, n {r['devices']}, "
                             f"{r['layout']}: {e}"
                             for r in rows for name, e in r["errors"].items()])
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny float32 shapes on the XLA backend (CPU smoke run)")
    parser.add_argument("--seq-lens", default=None,
                        help="comma list of global lengths (default 131072,262144,524288)")
    parser.add_argument("--devices", default=None,
                        help="comma list of device counts (default: 2, 4, 8 up to the "
                             "local device count)")
    parser.add_argument("--layouts", default="zigzag,contiguous")
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--causal", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--cudnn", default=None, action=argparse.BooleanOptionalAction,
                        help="also time cuDNN under jit with the sequence sharded (default: "
                             "on unless --quick)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default 16")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128")
    parser.add_argument("--dtype", default=None, help="default bfloat16")
    parser.add_argument("--implementation", default=None,
                        help="pallas_flash backend (mosaic, triton, xla; default: its choice)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--iters", type=int, default=None, help="default 5")
    parser.add_argument("--max-seconds", type=float, default=2.0)
    parser.add_argument("--check-max", type=int, default=131072,
                        help="compare the ring's forward with attention on the whole "
                             "sequence (one device) up to this global length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    defaults = (dict(seq_lens="64", heads=2, head_dim=16, dtype="float32",
                     implementation="xla", rounds=1, iters=1, cudnn=False) if args.quick else
                dict(seq_lens="131072,262144,524288", heads=16, head_dim=128,
                     dtype="bfloat16", implementation=None, rounds=5, iters=5, cudnn=True))
    report.fill_defaults(args, defaults)
    available = jax.device_count()
    counts = ([int(n) for n in args.devices.split(",")] if args.devices else
              [n for n in (2, 4, 8) if n <= available])
    for n in counts:
        if not 1 <= n <= available:
            raise ValueError(f"--devices takes counts from 1 to the {available} local "
                             f"devices, got {n}")
    if not counts:
        raise ValueError(f"ring scaling needs at least 2 devices, this host has {available}")
    args.device_counts = counts
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = (f"{jax.device_count()} × {jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, batch {args.batch}, {args.heads} heads, head_dim "
              f"{args.head_dim}, {args.dtype}, {'causal' if args.causal else 'not causal'}, "
              f"implementation {args.implementation or 'auto'}")
    rows: list[dict] = []
    stem = report.file_stem("ring-scaling", jax.devices()[0].device_kind,
                            datetime.date.today().isoformat())
    for pass_ in args.passes.split(","):
        if pass_ not in ("fwd", "fwdbwd"):
            raise ValueError(f"--passes takes fwd and fwdbwd, got {pass_!r}")
        for seq in (int(s) for s in args.seq_lens.split(",")):
            for n in args.device_counts:
                for layout in args.layouts.split(","):
                    rows.append(run_point(seq, n, layout, pass_ == "fwdbwd", args))
                    print(json.dumps(rows[-1]), flush=True)
                    if args.out:  # after every point: a run cut short keeps what it measured
                        report.write_rows(args.out, stem, header, jax.__version__, rows,
                                          table(header, rows))
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

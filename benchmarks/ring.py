"""Ring attention on one GPU: does a ring step cost more than the plain kernel?

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.ring --out $OUT [--quick]

:func:`pallas_flash.ring_attention` runs the same kernels as :func:`pallas_flash.attention`
on the local shards, plus the steps' plan switch, the LSE merges and the K/V transfers.
On one device, for local shapes ``[batch, L, heads, head_dim]`` (bf16, head_dim 128, 16
heads by default), causal and not, forward and forward + backward, this times:

* ``plain``: ``pallas_flash.attention`` on the local shapes;
* ``ring1``: ``ring_attention`` (zigzag) in a ``shard_map`` over a 1-device mesh (n = 1:
  one step, no transfer) — should be within noise of ``plain``;
* ``sim{n}``: :func:`pallas_flash.ring.simulated_ring_attention`: the ``n`` steps that
  device 0 of an ``n``-device zigzag ring runs, each block passed to itself with the
  ring's ``ppermute`` (a collective-permute over the 1-device axis);
* ``calls{n}``: the same kernel calls as ``sim{n}``, as separate plain ``attention`` calls
  (causal: one causal call on ``L``, then ``n - 1`` dense calls of the second half of the
  queries on all keys; not causal: ``n`` dense calls on ``L``) — ``sim{n}`` should be
  within noise of it.

Two readings of "a ring step costs no more than the plain kernel": ``step / plain`` is
``sim{n} / n`` over ``plain``, the mean step against one plain call on the local shapes
(a zigzag causal ring's later steps are dense calls on half the queries, about the FLOPs
of the local causal call); ``sim{n} / calls{n}`` is the ring against its own kernel calls
made alone, i.e. what the transfers, merges and plan switch add on top of the kernels. On
one device the transfer is a copy through the same memory the kernels use, where on a
real ring it crosses NVLink.

Every variant is timed in each of ``--rounds`` interleaved rounds with the package's timer
(:func:`benchmarks.timing.time_fn`); the table shows medians over rounds, and the ratios
``ring1 / plain``, ``step / plain`` and ``sim{n} / calls{n}``. ``--quick``: tiny float32
shapes on the XLA backend (a CPU smoke run, seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_flash as pf
from benchmarks import report
from benchmarks.timing import time_fn
from pallas_flash.ring import simulated_ring_attention

AXIS = "ring"
SEQ = P(None, AXIS)


def fwd_or_fwdbwd(attend: Callable, backward: bool) -> Callable:
    """``(q, k, v, d_out) -> out`` or, with ``backward``, ``-> (out, dq, dk, dv)``."""
    if not backward:
        return lambda q, k, v, d_out: attend(q, k, v)

    def fwdbwd(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(d_out))
    return fwdbwd


def _on_one_device_ring(fn: Callable, backward: bool) -> Callable:
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    out_specs = (SEQ,) * 4 if backward else SEQ
    return jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 4, out_specs=out_specs)


def make_calls(causal: bool, steps: int, backward: bool, implementation: str | None
               ) -> dict[str, Callable]:
    """name -> jitted ``(q, k, v, d_out) -> ...`` for one (causal, pass) point."""
    kw = dict(is_causal=causal, implementation=implementation)

    def plain(q, k, v):
        return pf.attention(q, k, v, **kw)

    def ring1(q, k, v):
        return pf.ring_attention(q, k, v, axis_name=AXIS, **kw)

    def simulated(q, k, v):
        return simulated_ring_attention(q, k, v, num_steps=steps, axis_name=AXIS, **kw)

    def separate_calls(q, k, v):
        # Device 0 of a zigzag ring: step 0 the local causal block; every later step
        # brings a block from a higher device, seen whole by the second half of the queries.
        # Not causal: the whole block at every step.
        if not causal:
            return [pf.attention(q, k, v, implementation=implementation)
                    for _ in range(steps)]
        half = q.shape[1] // 2
        return [plain(q, k, v)] + [
            pf.attention(q[:, half:], k, v, implementation=implementation)
            for _ in range(steps - 1)]

    def calls(q, k, v, d_out):
        if not backward:
            return separate_calls(q, k, v)
        outs, vjp = jax.vjp(separate_calls, q, k, v)
        half = q.shape[1] // 2
        d_outs = [d_out if o.shape == d_out.shape else d_out[:, half:] for o in outs]
        return (outs, *vjp(d_outs))

    return {
        "plain": jax.jit(fwd_or_fwdbwd(plain, backward)),
        "ring1": jax.jit(_on_one_device_ring(fwd_or_fwdbwd(ring1, backward), backward)),
        f"sim{steps}": jax.jit(_on_one_device_ring(fwd_or_fwdbwd(simulated, backward),
                                                   backward)),
        f"calls{steps}": jax.jit(calls),
    }


def collective_permutes(hlo_text: str) -> dict[str, int]:
    """The collective-permutes of a compiled program's entry computation: ``async`` (a
    start / done pair, which can run behind the kernels) and ``sync`` (blocking the
    stream). XLA overlaps one asynchronous collective at a time by default, so the second
    of a step's K and V transfers comes out synchronous unless XLA combines them
    (``--xla_gpu_collective_permute_combine_threshold_bytes``) or overlaps more
    (``--xla_gpu_experimental_parallel_collective_overlap_limit``)."""
    entry = hlo_text[hlo_text.find("\nENTRY"):]
    return {"sync": len(re.findall(r" collective-permute\(", entry)),
            "async": len(re.findall(r" collective-permute-start\(", entry))}


def run_point(seq: int, causal: bool, backward: bool, args) -> dict:
    """Every variant at one point, timed in interleaved rounds; ``ms[name]`` medians."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    shape = (args.batch, seq, args.heads, args.head_dim)
    q, k, v, d_out = (jax.random.normal(key, shape, dtype) for key in keys)
    row: dict = dict(seq_local=seq, causal=causal, pass_="fwdbwd" if backward else "fwd",
                     batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                     dtype=dtype.name, steps=args.steps,
                     implementation=args.implementation,
                     xla_flags=os.environ.get("XLA_FLAGS", ""), ms={}, errors={})
    calls = make_calls(causal, args.steps, backward, args.implementation)
    runnable = {}
    for name, fn in calls.items():
        try:
            jax.block_until_ready(fn(q, k, v, d_out))
            runnable[name] = fn
            if name.startswith("sim"):
                row["collective_permutes"] = collective_permutes(
                    fn.lower(q, k, v, d_out).compile().as_text())
        except Exception as e:  # a variant that fails is a row entry, not a crash
            row["errors"][name] = str(e).splitlines()[0][:200]
    # ring1 computes the same function as plain: a wrong result would make the time moot.
    if "plain" in runnable and "ring1" in runnable:
        want, got = (np.asarray(jax.tree.leaves(runnable[n](q, k, v, d_out))[0], np.float32)
                     for n in ("plain", "ring1"))
        row["ring1_max_abs_diff"] = float(np.max(np.abs(got - want)))
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.rounds):
        for name, fn in runnable.items():
            samples[name].append(time_fn(fn, [(q, k, v, d_out)], iters=args.iters, warmup=1,
                                         max_seconds=args.max_seconds).median_ms)
    for name in runnable:
        row["ms"][name] = statistics.median(samples[name])
    row["round_ms"] = samples
    ms = row["ms"]
    row["ring1_over_plain"] = (ms["ring1"] / ms["plain"]
                               if "ring1" in ms and "plain" in ms else None)
    sim, sep = f"sim{args.steps}", f"calls{args.steps}"
    row["sim_over_calls"] = ms[sim] / ms[sep] if sim in ms and sep in ms else None
    row["step_over_plain"] = (ms[sim] / args.steps / ms["plain"]
                              if sim in ms and "plain" in ms else None)
    return row


def table(header: str, rows: list[dict]) -> str:
    """A markdown table: one line per (pass, causal, local length)."""
    steps = rows[0]["steps"] if rows else 0
    names = ["plain", "ring1", f"sim{steps}", f"calls{steps}"]
    lines = [f"# Ring attention on one device: {header}", "",
             "Milliseconds per call (median over interleaved rounds; — where it did not "
             "run).", "",
             "| pass | causal | L local | " + " | ".join(names)
             + f" | ring1 / plain | step / plain | sim{steps} / calls{steps} |",
             "|---|---|---:|" + "---:|" * (len(names) + 3)]

    def ratio(x):
        return "—" if x is None else f"{x:.3f}"

    for r in rows:
        cells = [f"{r['ms'][n]:.3f}" if n in r["ms"] else "—" for n in names]
        lines.append(f"| {r['pass_']} | {'yes' if r['causal'] else 'no'} | {r['seq_local']} | "
                     + " | ".join(cells)
                     + f" | {ratio(r['ring1_over_plain'])} | {ratio(r['step_over_plain'])} "
                     f"| {ratio(r['sim_over_calls'])} |")
    lines += report.not_run([f"{name} at {r['pass_']}, causal {r['causal']}, "
                             f"L {r['seq_local']}: {e}"
                             for r in rows for name, e in r["errors"].items()])
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny float32 shapes on the XLA backend (CPU smoke run)")
    parser.add_argument("--seq-lens", default=None,
                        help="comma list of local lengths (default 4096,8192,16384)")
    parser.add_argument("--causal", default="both", choices=("yes", "no", "both"))
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps of the simulated ring (default 8)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default 16")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128")
    parser.add_argument("--dtype", default=None, help="default bfloat16")
    parser.add_argument("--implementation", default=None,
                        help="pallas_flash backend (mosaic, triton, xla; default: its choice)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5")
    parser.add_argument("--iters", type=int, default=None, help="default 10")
    parser.add_argument("--max-seconds", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    defaults = (dict(seq_lens="64", steps=2, heads=2, head_dim=32, dtype="float32",
                     implementation="xla", rounds=1, iters=2) if args.quick else
                dict(seq_lens="4096,8192,16384", steps=8, heads=16, head_dim=128,
                     dtype="bfloat16", implementation=None, rounds=5, iters=10))
    report.fill_defaults(args, defaults)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, batch {args.batch}, {args.heads} heads, head_dim "
              f"{args.head_dim}, {args.dtype}, implementation {args.implementation or 'auto'}")
    causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    rows: list[dict] = []
    for pass_ in args.passes.split(","):
        if pass_ not in ("fwd", "fwdbwd"):
            raise ValueError(f"--passes takes fwd and fwdbwd, got {pass_!r}")
        for is_causal in causal:
            for seq in (int(s) for s in args.seq_lens.split(",")):
                rows.append(run_point(seq, is_causal, pass_ == "fwdbwd", args))
                print(json.dumps(rows[-1]), flush=True)
                if args.out:  # after every point: a run cut short keeps what it measured
                    _write(args.out, header, rows)
    print(table(header, rows))
    return 0


def _write(out: str, header: str, rows: list[dict]) -> None:
    stem = report.file_stem("ring", jax.devices()[0].device_kind,
                            datetime.date.today().isoformat())
    report.write_rows(out, stem, header, jax.__version__, rows, table(header, rows))


if __name__ == "__main__":
    raise SystemExit(main())

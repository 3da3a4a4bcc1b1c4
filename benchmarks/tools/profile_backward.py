"""Where a backward's kernels spend their time, from Nsight Compute (ncu) on the GPU.

Two commands. ``workload`` runs one forward + backward per implementation, for ncu to
profile (nothing is timed here: the ``benchmarks.backward`` table is the speed record)::

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section SourceCounters \\
        --section InstructionStats --section ComputeWorkloadAnalysis -f -o /tmp/prof \\
        python3 -m benchmarks.tools.profile_backward workload --impls pallas_flash_mosaic,fa3 \\
            --seq-len 4096 --causal
    ncu --import /tmp/prof.ncu-rep --page details > details.txt
    ncu --import /tmp/prof.ncu-rep --page source --csv --print-source sass > source.csv

(set ``XLA_FLAGS=--xla_gpu_autotune_level=0``, or XLA's autotuner adds its own launches).
``summarize`` turns the two text exports into a markdown table, one row per kernel:
duration, executed instructions, registers, local-memory (spill) requests, the tensor
pipe's share (ncu's "Compute (SM) Throughput", which the tensor pipe dominates in these
kernels), shared / L1 throughput, issue-slot use, and from the SASS page the warp-stall
reasons (shares of all samples) and the executed local loads / stores::

    python3 -m benchmarks.tools.profile_backward summarize --details details.txt \\
        --source source.csv --out profile.md
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: ncu's details-page metrics reported per kernel: (column, metric name, unit scale).
DETAIL_METRICS = (
    ("duration ms", "Duration", {"ms": 1.0, "us": 1e-3, "usecond": 1e-3, "msecond": 1.0,
                                 "s": 1e3, "ns": 1e-6}),
    ("instructions", "Executed Instructions", None),
    ("registers", "Registers Per Thread", None),
    ("spill requests", "Local Memory Spilling Requests", None),
    ("SM (tensor) %", "Compute (SM) Throughput", None),
    ("L1/shared %", "L1/TEX Cache Throughput", None),
    ("issue slots %", "Issue Slots Busy", None),
)
_KERNEL_LINE = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
# Name, unit (none for counts), value; a wide value leaves one space after its unit.
_METRIC_LINE = re.compile(r"^    (\S.*?)\s{2,}(?:(\S+)\s+)?([\d,.]+)\s*$")
_STALLS_SHOWN = 6


def parse_details(text: str) -> list[dict]:
    """Kernels of an ncu details page in launch order: ``name``, ``grid``, ``block`` and
    the :data:`DETAIL_METRICS` found (floats; durations in ms)."""
    kernels: list[dict] = []
    wanted = {metric: (column, scale) for column, metric, scale in DETAIL_METRICS}
    for line in text.splitlines():
        head = _KERNEL_LINE.match(line)
        if head:
            dims = [int(x) for x in head.groups()[1:]]
            kernels.append({"name": head.group(1), "grid": tuple(dims[:3]),
                            "block": tuple(dims[3:])})
            continue
        metric = _METRIC_LINE.match(line)
        if metric and kernels and metric.group(1) in wanted:
            column, scale = wanted[metric.group(1)]
            value = float(metric.group(3).replace(",", ""))
            if scale is not None:
                if metric.group(2) not in scale:  # (None: no unit)
                    raise ValueError(f"unknown unit {metric.group(2)!r} of {metric.group(1)}")
                value *= scale[metric.group(2)]
            kernels[-1].setdefault(column, value)
    return kernels


def _opcode(sass: str) -> str:
    """``LDL`` of ``@!P1 LDL.LU R3, [R1]``."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_source(rows: Iterable[Sequence[str]]) -> list[dict]:
    """Kernels of an ncu source page (``--csv --print-source sass``) in launch order:
    ``name``, ``samples``, ``stalls`` {reason: samples}, ``executed`` {opcode: count}.
    ncu prints some kernels twice in a row; identical consecutive blocks count once."""
    blocks: list[tuple[str, list[Sequence[str]]]] = []
    for row in rows:
        if row and row[0] == "Kernel Name":
            blocks.append((row[1], []))
        elif blocks and row:
            blocks[-1][1].append(row)
    kernels: list[dict] = []
    previous = None
    for name, block in blocks:
        if (name, block) == previous:
            continue
        previous = (name, block)
        header, body = block[0], block[1:]
        column = {title: i for i, title in enumerate(header)}
        stall_columns = [t for t in header if t.startswith("stall_") and "Not Issued" not in t]
        stalls: collections.Counter = collections.Counter()
        executed: collections.Counter = collections.Counter()
        samples = 0
        for row in body:
            samples += int(row[column["Warp Stall Sampling (All Samples)"]] or 0)
            executed[_opcode(row[column["Source"]])] += int(
                row[column["Instructions Executed"]] or 0)
            for title in stall_columns:
                stalls[title.removeprefix("stall_")] += int(row[column[title]] or 0)
        kernels.append({"name": name, "samples": samples, "stalls": stalls,
                        "executed": executed})
    return kernels


def table(details: list[dict], source: list[dict] | None, *, min_ms: float) -> str:
    """A markdown table of the kernels that ran at least ``min_ms``; the source page's
    columns only where it lists the same number of kernels as the details page."""
    if source is not None and len(source) != len(details):
        print(f"source page has {len(source)} kernels, details {len(details)}: stall "
              "columns left out", file=sys.stderr)
        source = None
    columns = [c for c, _, _ in DETAIL_METRICS]
    title = ["kernel", "grid x block", *columns]
    if source is not None:
        title += ["top stalls (% of samples)", "local loads / stores executed"]
    lines = ["| " + " | ".join(title) + " |", "|" + "---|" * len(title)]
    for i, kernel in enumerate(details):
        if kernel.get("duration ms", 0.0) < min_ms:
            continue
        name = kernel["name"] if len(kernel["name"]) <= 60 else kernel["name"][:57] + "..."
        cells = [name.replace("|", "/"), f"{kernel['grid']} x {kernel['block']}"]
        cells += [_number(kernel.get(c)) for c in columns]
        if source is not None:
            src = source[i]
            total = max(src["samples"], 1)
            top = ", ".join(f"{reason} {100 * n / total:.1f}"
                            for reason, n in src["stalls"].most_common(_STALLS_SHOWN))
            cells += [top, f"{src['executed']['LDL']:,} / {src['executed']['STL']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def workload(impl_names: Sequence[str], seq_len: int, head_dim: int, causal: bool,
             tokens: int, hidden: int, seed: int) -> None:
    """One jitted forward + backward of each implementation at one point (bf16)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.implementations import IMPLEMENTATIONS

    unknown = [n for n in impl_names if n not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"--impls: unknown {unknown}; known: {sorted(IMPLEMENTATIONS)}")
    if tokens % seq_len or hidden % head_dim:
        raise ValueError(f"--tokens {tokens} / --seq-len {seq_len} and --hidden {hidden} / "
                         f"--head-dim {head_dim} must divide")
    shape = (tokens // seq_len, seq_len, hidden // head_dim, head_dim)
    rng = np.random.default_rng(seed)
    # Inputs made on the host: no XLA kernels of their own in the profile.
    q, k, v, d_out = (jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
                      for _ in range(4))
    for name in impl_names:
        fn = IMPLEMENTATIONS[name].fn

        def forward(q, k, v, fn=fn):
            return fn(q, k, v, causal)

        # dO is an argument: closed over, a 64 MB array would be a constant of the program.
        grads = jax.jit(lambda q, k, v, d_out, forward=forward:
                        jax.vjp(forward, q, k, v)[1](d_out))
        jax.block_until_ready(grads(q, k, v, d_out))
        print(f"ran {name}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("workload", help="one forward + backward per implementation")
    run.add_argument("--impls", default="pallas_flash_mosaic,fa3")
    run.add_argument("--seq-len", type=int, default=4096)
    run.add_argument("--head-dim", type=int, default=128)
    run.add_argument("--causal", action="store_true")
    run.add_argument("--tokens", type=int, default=16384, help="batch · L")
    run.add_argument("--hidden", type=int, default=2048, help="heads · head_dim")
    run.add_argument("--seed", type=int, default=0)
    summary = commands.add_parser("summarize", help="markdown from ncu's text exports")
    summary.add_argument("--details", required=True, help="ncu --page details output")
    summary.add_argument("--source", default=None,
                         help="ncu --page source --csv --print-source sass output")
    summary.add_argument("--out", default=None, help="markdown file (default: stdout)")
    summary.add_argument("--min-ms", type=float, default=0.05,
                         help="leave out kernels shorter than this")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "workload":
        workload(args.impls.split(","), args.seq_len, args.head_dim, args.causal,
                 args.tokens, args.hidden, args.seed)
        return 0
    details = parse_details(Path(args.details).read_text())
    source = None
    if args.source is not None:
        with open(args.source, newline="") as f:
            source = parse_source(csv.reader(f))
    text = table(details, source, min_ms=args.min_ms)
    if args.out is None:
        print(text, end="")
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU tests and the maintained benchmarks, in one call of a GPU machine.

Run from the repository root on the GPU machine::

    PYTHONPATH=. python3 -m benchmarks.gpu_report --out $OUT --budget 560

Each *part* is one or a few commands (below), run in order, each part with a share of
``--budget`` seconds (``timeout``; what a part wrote before its time ran out is kept; the
suite is also told its share, so that it stops starting points and still writes its
tables). Everything lands in ``--out/gpu-report/`` — every part's log and its results
(JSON, markdown, PNG) — and is packed into one ``gpu-report.tar.gz`` beside it, because the
device machine returns only a few files per call. The last lines printed are one row per
part: exit status, seconds, and the last line of its log.

Parts (``--parts``, comma list, in this order by default):

* ``tests``: ``pytest tests/gpu`` (every kernel against the float64 oracle at real sizes;
  all of it takes about 7 minutes on an H200, ``test_mosaic_gpu.py`` alone 150 s:
  ``--pytest-k`` selects);
* ``suite``: the papers' benchmark grid, every implementation side by side
  (``benchmarks.suite``, fwd / bwd / fwd+bwd, causal and not, L 512…16384, the head dims of
  ``--suite-head-dims``: about 4 minutes each for the five implementations, so the whole
  grid takes two or three calls);
* ``backward``: forward and backward against FA3 and cuDNN at head_dim 128
  (``benchmarks.backward``; FA3 only where the ``flash-attn3-jax`` wheel imports), then
  against cuDNN at head_dims 64 and 256;
* ``variants``: one row per attention variant vs dense causal (``benchmarks.variants``;
  about 150 s for Mosaic and cuDNN);
* ``training``: the small transformer, ours vs cuDNN vs XLA attention
  (``benchmarks.training``, 300 steps; 100 steps of ours and cuDNN took 140 s, jax.nn's XLA
  attention runs out of memory at this size and pallas-flash's XLA path is ~5x slower);
* ``cli``: ``pallas-flash io``, ``memory``, ``check`` and ``bench`` at GPU sizes, cheapest
  first (io 16 s, check 77 s, bench with its time limit).

On a machine with several GPUs, ``;`` in ``--parts`` splits the parts into lanes that run at
the same time, lane ``i`` on GPU ``i`` (``CUDA_VISIBLE_DEVICES``), each lane with the whole
budget shared among its own parts: ``--parts "tests,backward;suite;training,cli"`` on three
GPUs. (Timings of different GPUs of one host do not disturb each other: each point of the
suite still compares implementations on one GPU.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_PY = sys.executable


#: Stands for the part's time share (seconds, 85 %) in a command's arguments.
TIME_LIMIT = "{time_limit}"


@dataclasses.dataclass(frozen=True)
class Part:
    """Commands of the report run together; ``weight``: the part's share of the budget."""

    name: str
    weight: float
    commands: tuple[tuple[str, ...], ...]


def parts(out: Path, pytest_k: str = "", suite_head_dims: str = "64,128,256"
          ) -> dict[str, Part]:
    """The report's parts, writing under ``out``."""
    suite = ("-m", "benchmarks.suite", "--impls",
             "cudnn,pallas_flash_mosaic,pallas_flash_triton,jax_pallas_triton,xla",
             "--head-dims", suite_head_dims, "--seq-lens", "512,1024,2048,4096,8192,16384",
             "--causal", "both", "--iters", "10", "--time-limit", TIME_LIMIT,
             "--out", str(out / "suite"))
    select = ("-k", pytest_k) if pytest_k else ()
    tests = (_PY, "-m", "pytest", "-q", "-rfE", "tests/gpu", *select)
    cli = ("-m", "pallas_flash")
    return {p.name: p for p in (
        Part("tests", 3.0, (tests,)),
        Part("suite", 4.0, ((_PY, *suite),)),
        Part("backward", 3.0, (
            # FA3 where its wheel imports, else a row saying why.
            (_PY, "-m", "benchmarks.backward", "--out", str(out / "backward")),
            (_PY, "-m", "benchmarks.backward", "--head-dims", "64,256", "--impls",
             "pallas_flash_mosaic,cudnn", "--out", str(out / "backward"), "--tag", "d64-d256"),
        )),
        Part("variants", 1.0, ((_PY, "-m", "benchmarks.variants", "--out", str(out)),)),
        Part("training", 2.0, ((_PY, "-m", "benchmarks.training", "--steps", "300",
                                "--implementations", "ours,cudnn,xla,xla_dense", "--out",
                                str(out / "training")),)),
        Part("cli", 1.0, (
            (_PY, *cli, "io", "--head-dim", "128"),
            (_PY, *cli, "memory", "--causal", "--backward", "--plot",
             str(out / "cli-memory.png")),
            (_PY, *cli, "check", "--dtype", "bf16", "--seq-len", "2048", "--head-dim", "128"),
            (_PY, *cli, "bench", "--head-dim", "128", "--backward", "--impls",
             "standard,cudnn,pallas_flash_mosaic,pallas_flash_xla", "--time-limit", TIME_LIMIT,
             "--json", str(out / "cli-bench.json"), "--plot", str(out / "cli-bench.png")),
        )),
    )}


def run_part(part: Part, seconds: float, log: Path, gpu: int | None = None
             ) -> tuple[int, float]:
    """Runs the part's commands one after the other within ``seconds`` (on GPU ``gpu``
    alone when given); returns the first non-zero exit status (124: out of time) and the
    seconds spent."""
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    start = time.perf_counter()
    status = 0
    with log.open("w") as f:
        for command in part.commands:
            left = seconds - (time.perf_counter() - start)
            if left <= 1:
                status = status or 124
                print(f"(out of time before {' '.join(command)})", file=f, flush=True)
                break
            command = tuple(arg.replace(TIME_LIMIT, f"{0.85 * left:.0f}") for arg in command)
            print(f"$ {' '.join(command)}", file=f, flush=True)
            try:
                code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=left, check=False, env=env).returncode
            except subprocess.TimeoutExpired:
                code = 124
                print(f"(stopped after {left:.0f} s)", file=f, flush=True)
            status = status or code
    return status, time.perf_counter() - start


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:120] if lines else ""


Row = tuple[str, int | None, int, float, str]  # part, GPU, exit status, seconds, last line


def run_lane(names: list[str], catalogue: dict[str, Part], budget: float, report: Path,
             gpu: int | None) -> list[Row]:
    """Runs the named parts in order within ``budget`` seconds, each with its weight's
    share of the time left (time a part does not use goes to the next)."""
    start = time.perf_counter()
    rows = []
    for i, name in enumerate(names):
        part = catalogue[name]
        left = budget - (time.perf_counter() - start)
        share = left * part.weight / sum(catalogue[n].weight for n in names[i:])
        log = report / f"{name}.log"
        status, spent = run_part(part, share, log, gpu)
        rows.append((name, gpu, status, spent, _last_line(log)))
        where = "" if gpu is None else f" (GPU {gpu})"
        print(f"{name}{where}: exit {status} in {spent:.0f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="e.g. $OUT on the device")
    parser.add_argument("--budget", type=float, default=560.0,
                        help="seconds for all parts together (default 560)")
    parser.add_argument("--parts", default="tests,suite,backward,variants,training,cli",
                        help="comma list, run in this order; ';' separates lanes that run "
                             "at the same time, one GPU each")
    parser.add_argument("--pytest-k", default="", help="pytest -k expression for 'tests'")
    parser.add_argument("--suite-head-dims", default="64,128,256",
                        help="comma list of head dims for 'suite'")
    args = parser.parse_args(argv)
    report = args.out / "gpu-report"
    report.mkdir(parents=True, exist_ok=True)
    catalogue = parts(report, args.pytest_k, args.suite_head_dims)
    lanes = [[name for name in lane.split(",") if name] for lane in args.parts.split(";")]
    names = [name for lane in lanes for name in lane]
    unknown = sorted(set(names) - set(catalogue))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {sorted(catalogue)}")
    if len(set(names)) != len(names) or not all(lanes):
        parser.error(f"--parts: each part at most once, no empty lane: {args.parts!r}")
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")

    if len(lanes) == 1:
        rows = run_lane(lanes[0], catalogue, args.budget, report, None)
    else:
        with ThreadPoolExecutor(len(lanes)) as pool:
            lane_rows = pool.map(lambda gpu: run_lane(lanes[gpu], catalogue, args.budget,
                                                      report, gpu), range(len(lanes)))
            rows = [row for lane in lane_rows for row in lane]

    with tarfile.open(args.out / "gpu-report.tar.gz", "w:gz") as tar:
        tar.add(report, arcname="gpu-report")
    print(f"\n{'part':<9} {'gpu':>3} {'exit':>4} {'s':>5}  last line of the log")
    for name, gpu, status, spent, last in rows:
        print(f"{name:<9} {'-' if gpu is None else gpu:>3} {status:>4} {spent:5.0f}  {last}")
    return max((status for _, _, status, _, _ in rows), default=0)


if __name__ == "__main__":
    raise SystemExit(main())

"""The same training run with different attention implementations, side by side.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.training --out $OUT     # GPU: small preset, L 4096

Same model, seed, data order and steps for each implementation: the loss curves must agree
within bf16 noise, and the tokens/s say what the attention kernel buys end to end. The
rows are packed documents with segment ids, so every implementation sees the same masks
(the jax.nn baselines as a dense [batch, 1, L, L] mask). Writes
``training-<device>-<date>[-<tag>].{json,md,png}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.report import file_stem
from benchmarks.suite import write_json
from models import train as training

#: Our API's choice (mosaic/triton on a GPU) and the jax.nn baselines of models.train.
DEFAULT_IMPLEMENTATIONS = ("ours", "cudnn", "xla_dense")


def _train_args(impl: str, args: argparse.Namespace, out: Path) -> argparse.Namespace:
    flags = ["--preset", args.preset, "--steps", str(args.steps), "--out", str(out),
             "--overwrite", "--sample-tokens", "0", "--seed", str(args.seed),
             "--eval-every", str(max(1, args.steps // 5)), "--data-parallel", "1"]
    for name in ("seq_len", "batch_size", "warmup_steps"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if impl != "ours":
        flags += ["--implementation", impl]
    return training.parse_args(flags)


def summarize(history: dict[str, list]) -> dict[str, float]:
    """Steady-state throughput (the first interval, which compiles, left out) and losses."""
    rates = history["tokens_per_s"][1:] or history["tokens_per_s"]
    return {"tokens_per_s": statistics.median(rates),
            "final_train_loss": float(np.mean(history["loss"][-20:])),
            "final_val_loss": history["val_loss"][-1]}


def loss_gaps(a: dict[str, list], b: dict[str, list], early_steps: int = 20
              ) -> tuple[float, float]:
    """|train loss difference| of two runs: mean over the first ``early_steps`` steps (same
    weights up to rounding, so this is the attention's own numerical difference) and max
    over all steps (rounding differences grow as the trajectories drift apart)."""
    b_loss = dict(zip(b["step"], b["loss"], strict=True))
    gaps = [(s, abs(loss - b_loss[s])) for s, loss in zip(a["step"], a["loss"], strict=True)
            if s in b_loss]
    if not gaps:
        return float("nan"), float("nan")
    early = [gap for s, gap in gaps if s <= early_steps] or [gaps[0][1]]
    return float(np.mean(early)), max(gap for _, gap in gaps)


def markdown(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = [f"# Training comparison — {result['device']}, {result['date']}, "
             f"jax {result['jax_version']}", "",
             f"`{result['command']}`", "",
             f"preset {result['preset']}, {result['steps']} steps, "
             f"{result['tokens_per_step']} tokens/step, seed {result['seed']}", "",
             "| attention | tokens/s | vs cuDNN | final train loss | final val loss "
             "| loss gap to first run: mean steps 1-20 / max |",
             "|---|---:|---:|---:|---:|---:|"]
    cudnn = runs.get("cudnn", {}).get("tokens_per_s")
    first = next((run for run in runs.values() if "error" not in run), None)
    for impl, run in runs.items():
        if "error" in run:
            lines.append(f"| {impl} | failed: `{run['error']}` | | | | |")
            continue
        ratio = f"{run['tokens_per_s'] / cudnn:.2f}×" if cudnn else "–"
        early, worst = loss_gaps(run["history"], first["history"])
        lines.append(f"| {impl} | {run['tokens_per_s']:,.0f} | {ratio} | "
                     f"{run['final_train_loss']:.4f} | {run['final_val_loss']:.4f} | "
                     f"{early:.5f} / {worst:.4f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in result["runs"].items() if "error" not in v}
    fig, (loss_ax, rate_ax) = plt.subplots(1, 2, figsize=(11, 4),
                                           gridspec_kw={"width_ratios": [2, 1]})
    for impl, run in runs.items():
        line, = loss_ax.plot(run["history"]["step"], run["history"]["loss"], lw=0.8,
                             alpha=0.7, label=f"{impl} (train)")
        loss_ax.plot(run["history"]["val_step"], run["history"]["val_loss"], "o--",
                     color=line.get_color(), ms=3, label=f"{impl} (validation)")
    loss_ax.set(xlabel="step", ylabel="loss (nats / byte)",
                title=f"{result['preset']} preset, {result['tokens_per_step']} tokens/step")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    rate_ax.bar(list(runs), [run["tokens_per_s"] for run in runs.values()])
    rate_ax.set(ylabel="tokens / s (training step)", title=result["device"])
    rate_ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace, command: str,
        save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Trains once per implementation; ``save`` gets the result so far after each one (a
    run cut short by a time limit keeps what finished)."""
    runs: dict[str, Any] = {}
    result = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
              "jax_version": jax.__version__, "date": datetime.date.today().isoformat(),
              "command": command, "preset": args.preset, "steps": args.steps,
              "seed": args.seed, "tokens_per_step": None, "runs": runs}
    with tempfile.TemporaryDirectory() as scratch:
        for impl in args.implementations:
            train_args = _train_args(impl, args, Path(scratch) / impl)
            result["tokens_per_step"] = train_args.batch_size * train_args.seq_len
            print(f"=== {impl} ===", flush=True)
            try:
                history = training.train(train_args)
            except Exception as error:  # one failed baseline must not lose the others
                traceback.print_exc()
                runs[impl] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            else:
                runs[impl] = {**summarize(history), "history": history}
            if save is not None:
                save(result)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--implementations", type=lambda s: tuple(s.split(",")),
                        default=DEFAULT_IMPLEMENTATIONS,
                        help="comma list: ours (the API's choice) or a models.train "
                             "--implementation (mosaic, triton, xla, cudnn, xla_dense)")
    parser.add_argument("--preset", default="small", choices=sorted(training.PRESETS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    choices = {"ours", *training.OUR_IMPLEMENTATIONS, *training.BASELINE_IMPLEMENTATIONS}
    bad = [impl for impl in args.implementations if impl not in choices]
    if bad:
        parser.error(f"--implementations: unknown {bad}; choose from {sorted(choices)}")
    if args.steps < 20:
        parser.error("--steps must be at least 20 (two throughput intervals of 10 steps)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python -m benchmarks.training " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = file_stem("training", jax.devices()[0].device_kind,
                     datetime.date.today().isoformat(), args.tag)

    def save(result: dict[str, Any]) -> None:
        write_json(result, args.out / f"{stem}.json")
        (args.out / f"{stem}.md").write_text(markdown(result))

    result = run(args, command, save)
    plot(result, args.out / f"{stem}.png")
    print(markdown(result))


if __name__ == "__main__":
    main()

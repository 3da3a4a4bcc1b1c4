"""Benchmark results (JSON written by ``benchmarks.suite``) → markdown tables and bar charts.

``python -m benchmarks.report A.json [B.json ...] --out DIR`` merges result files of one device
(e.g. a suite run split by head dim) and writes ``DIR/<stem>.md`` and one PNG per
(head_dim, causal, pass), in the style of the FlashAttention papers' figures: bars grouped by
sequence length, one bar per implementation, TFLOP/s on top.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PASS_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwdbwd": "Forward + backward"}
_KEY = ("impl", "head_dim", "seq_len", "causal", "pass")


def load(paths: Sequence[Path]) -> dict[str, Any]:
    """Read result files and merge them; a later file's point replaces an earlier one's.

    Raises:
      ValueError: if the files come from different devices.
    """
    if not paths:
        raise ValueError("no result files given")
    results = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["device"] for r in results}
    if len(devices) > 1:
        raise ValueError(f"results from different devices cannot be merged: {sorted(devices)}")
    merged = dict(results[0])
    points: dict[tuple, dict[str, Any]] = {}
    for r in results:
        merged["implementations"] = {**r.get("implementations", {}),
                                     **merged.get("implementations", {})}
        merged["unavailable"] = {**r.get("unavailable", {}), **merged.get("unavailable", {})}
        for p in r["points"]:
            points[tuple(p[k] for k in _KEY)] = p
    merged["points"] = list(points.values())
    if len(results) > 1:
        merged["merged_from"] = [str(p) for p in paths]
    return merged


def fmt_tflops(value: float) -> str:
    """TFLOP/s as the papers print it (integers), with 3 significant digits below 100."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _impls(result: dict[str, Any]) -> list[str]:
    """Implementations in the order they were run."""
    return list(dict.fromkeys(p["impl"] for p in result["points"]))


def _label(result: dict[str, Any], impl: str) -> str:
    """Column label: the name, plus the dtype when it differs from the suite's."""
    dtypes = {p["dtype"] for p in result["points"] if p["impl"] == impl}
    other = sorted(dtypes - {result["config"]["dtype"]})
    return f"{impl} ({','.join(other)})" if other else impl


def _cell(point: dict[str, Any] | None) -> str:
    if point is None:
        return ""
    if point["error"] is not None:
        return _status(point["error"])
    ratio = point["ratio_to_cudnn"]
    return fmt_tflops(point["tflops"]) + ("" if ratio is None else f" ({ratio:.2f}×)")


def _status(error: str) -> str:
    """How a failed point shows in a table cell."""
    if error.startswith("wrong result"):
        return "WRONG"
    return "not run" if error.startswith("not run") else "failed"


def _rows(result: dict[str, Any], pass_: str) -> list[tuple[int, bool, int]]:
    return sorted({(p["head_dim"], p["causal"], p["seq_len"])
                   for p in result["points"] if p["pass"] == pass_})


def _index(result: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    return {tuple(p[k] for k in _KEY): p for p in result["points"]}


def _passes(result: dict[str, Any]) -> list[str]:
    present = {p["pass"] for p in result["points"]}
    return [p for p in PASS_TITLES if p in present]


def failures(result: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """``(impl, error, ["pass d L causal", ...])`` grouped by implementation and error."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p in result["points"]:
        if p["error"] is not None:
            causal = " causal" if p["causal"] else ""
            where = f"{p['pass']} d{p['head_dim']} L{p['seq_len']}{causal}"
            groups[(p["impl"], p["error"])].append(where)
    return [(impl, error, where) for (impl, error), where in groups.items()]


def markdown(result: dict[str, Any]) -> str:
    """A header (date, device, jax version, conventions) and one table per pass."""
    cfg = result["config"]
    impls = _impls(result)
    index = _index(result)
    lines = [
        f"# Attention benchmark: {result['device']}, {result['date']}",
        "",
        f"jax {result['jax_version']} · {cfg['dtype']} · batch × seq_len = {cfg['tokens']} "
        f"tokens · hidden {cfg['hidden']} (heads = {cfg['hidden']} / head_dim) · layout "
        f"(batch, seq, heads, head_dim) · median of up to {cfg['iters']} samples after "
        f"{cfg['warmup']} warm-up calls, {cfg['input_sets']} input sets in rotation.",
        "",
        "FLOPs: forward 4·B·H·L²·D, halved when causal; backward 2.5 × forward; backward time = "
        "(forward + backward through `jax.vjp`) − forward. Cells: TFLOP/s (× cuDNN). "
        f"Outputs and gradients are checked against `{result.get('reference')}` at every point "
        f"(max |Δ| / max |ref| ≤ {cfg['tolerance']}, else *wrong*).",
        "",
    ]
    for name in impls:
        note = result.get("implementations", {}).get(name, {}).get("note", "")
        lines.append(f"- `{name}`: {note}" if note else f"- `{name}`")
    for name, reason in result.get("unavailable", {}).items():
        lines.append(f"- `{name}`: not available ({reason})")
    for pass_ in _passes(result):
        labels = " | ".join(_label(result, i) for i in impls)
        lines += ["", f"## {PASS_TITLES[pass_]} (TFLOP/s)", "",
                  f"| head_dim | causal | L | {labels} |",
                  "|---:|:---|---:|" + "---:|" * len(impls)]
        for d, causal, length in _rows(result, pass_):
            cells = [_cell(index.get((i, d, length, causal, pass_))) for i in impls]
            lines.append(f"| {d} | {'yes' if causal else 'no'} | {length} | "
                         + " | ".join(cells) + " |")
    fails = failures(result)
    if fails:
        lines += ["", "## Failures", "", "| implementation | error | points |", "|---|---|---|"]
        for impl, error, where in fails:
            shown = ", ".join(where[:6]) + (f" (+{len(where) - 6} more)" if len(where) > 6 else "")
            lines.append(f"| {impl} | {error.replace('|', '/')} | {shown} |")
    return "\n".join(lines) + "\n"


def text_table(result: dict[str, Any]) -> str:
    """A compact fixed-width table for the terminal: TFLOP/s and × cuDNN per implementation."""
    impls = _impls(result)
    index = _index(result)
    widths = [max(len(i), 12) for i in impls]
    header = f"{'pass':<6} {'d':>3} {'causal':<6} {'L':>6} | " + " ".join(
        f"{i:>{w}}" for i, w in zip(impls, widths, strict=True))
    lines = [f"{result['device']} {result['date']} jax {result['jax_version']} "
             f"{result['config']['dtype']} (TFLOP/s, ×cuDNN)", header, "-" * len(header)]
    for pass_ in _passes(result):
        for d, causal, length in _rows(result, pass_):
            cells = []
            for i, w in zip(impls, widths, strict=True):
                p = index.get((i, d, length, causal, pass_))
                if p is None:
                    text = ""
                elif p["error"] is not None:
                    text = _status(p["error"])
                else:
                    ratio = p["ratio_to_cudnn"]
                    text = fmt_tflops(p["tflops"]) + ("" if ratio is None else f" {ratio:.2f}x")
                cells.append(f"{text:>{w}}")
            lines.append(f"{pass_:<6} {d:>3} {'yes' if causal else 'no':<6} {length:>6} | "
                         + " ".join(cells))
    for impl, error, where in failures(result):
        lines.append(f"{impl}: no number at {len(where)} point(s), e.g. {where[0]}: {error[:160]}")
    return "\n".join(lines)


def plot(result: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """One bar chart per (head_dim, causal, pass); returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = _impls(result)
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}
    index = _index(result)
    paths = []
    charts = sorted({(p["head_dim"], p["causal"], p["pass"]) for p in result["points"]},
                    key=lambda c: (c[0], c[1], list(PASS_TITLES).index(c[2])))
    for d, causal, pass_ in charts:
        lengths = sorted({p["seq_len"] for p in result["points"]
                          if (p["head_dim"], p["causal"], p["pass"]) == (d, causal, pass_)})
        width = 0.8 / len(impls)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(lengths) + 2), 4.2))
        for j, impl in enumerate(impls):
            for x, length in enumerate(lengths):
                p = index.get((impl, d, length, causal, pass_))
                pos = x - 0.4 + width * (j + 0.5)
                if p is not None and p["tflops"] is not None:
                    ax.bar(pos, p["tflops"], width, color=colors[impl],
                           label=_label(result, impl) if x == 0 else None)
                    ax.text(pos, p["tflops"], fmt_tflops(p["tflops"]), ha="center", va="bottom",
                            fontsize=7)
                else:
                    ax.bar(pos, 0, width, color=colors[impl],
                           label=_label(result, impl) if x == 0 else None)
                    if p is not None:
                        ax.text(pos, 0, "✗", ha="center", va="bottom", fontsize=8,
                                color=colors[impl])
        ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
        ax.set_xlabel("Sequence length")
        ax.set_ylabel("Speed (TFLOP/s)")
        ax.set_title(f"{PASS_TITLES[pass_]}, head dim {d}, {'causal' if causal else 'no causal'}"
                     f" ({result['device']}, {result['config']['dtype']})", fontsize=10)
        ax.legend(fontsize=7, ncols=min(len(impls), 4), loc="upper left")
        ax.margins(y=0.25)
        fig.tight_layout()
        path = out_dir / f"{stem}-d{d}-{'causal' if causal else 'full'}-{pass_}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def not_run(items: list[str]) -> list[str]:
    """The markdown lines listing what a row-per-point benchmark could not run (none when
    ``items`` is empty): each item says what and why."""
    return ["", "Not run:", ""] + [f"- {item}" for item in items] if items else []


def fill_defaults(args, defaults: dict[str, Any]) -> None:
    """Set each of ``args``' attributes that the command line left at None to its value
    in ``defaults`` (the row-per-point benchmarks' ``--quick`` and GPU defaults)."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def file_stem(benchmark: str, device_kind: str, date: str, tag: str | None = None) -> str:
    """``<benchmark>-<device>-<date>[-<tag>]``: what was measured, where and when.

    The device kind is lower-cased with runs of other characters as single dashes
    (``"NVIDIA H200"`` -> ``nvidia-h200``). A result file is named after the benchmark and
    the configuration it measured, never after a run: re-measuring overwrites it.
    """
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9.]+)*", benchmark):
        raise ValueError(f"benchmark name must be lower-case words joined by dashes, "
                         f"got {benchmark!r}")
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    return f"{benchmark}-{slug}-{date}" + (f"-{tag}" if tag else "")


def write_rows(out: str, stem: str, header: str, jax_version: str, rows: list[dict],
               markdown_table: str) -> None:
    """``OUT/<stem>.json`` (``{"device": header, "jax_version", "rows"}``) and
    ``OUT/<stem>.md`` (the table): what the row-per-point benchmarks (decode, ring) write."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"device": header, "jax_version": jax_version, "rows": rows}, indent=1))
    (out_dir / f"{stem}.md").write_text(markdown_table + "\n")


def write_report(result: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, list[Path]]:
    """Write ``<stem>.md`` and the charts into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(markdown(result))
    return md_path, plot(result, out_dir, stem)


def main(argv: Iterable[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.report``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="JSON files from benchmarks.suite")
    parser.add_argument("--out", type=Path, help="default: the first file's folder")
    parser.add_argument("--stem", help="output file name stem (default: the first file's)")
    args = parser.parse_args(None if argv is None else list(argv))
    result = load(args.results)
    out_dir = args.out or args.results[0].parent
    stem = args.stem or args.results[0].stem
    md_path, charts = write_report(result, out_dir, stem)
    print(f"wrote {md_path} and {len(charts)} charts\n")
    print(text_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

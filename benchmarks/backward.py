"""Forward, backward and forward+backward against FlashAttention-3 and cuDNN, side by side.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.backward --out DIR [--tag TAG]

The FlashAttention-3 comparison: bf16, the papers' setup (``batch · L = 16384`` tokens, ``heads ·
head_dim = 2048``), TFLOP/s by :mod:`benchmarks.flops` (forward ``4·B·H·L²·D``, halved
causal; backward 2.5 × that). Every implementation of ``--impls`` (names of
:data:`benchmarks.implementations.IMPLEMENTATIONS`; ``fa3`` needs the ``flash-attn3-jax``
wheel and head_dim 128) is, at each point:

1. checked: its output and its gradients (``jax.vjp`` with a random dO) of batch row 0,
   head 0 against a float32 reference of that one head (``reference.standard_attention``
   at ``highest`` matmul precision; heads are independent, so the slice is exact). A
   non-finite value or an error above ``--tolerance`` marks the row ``correct: false``
   and the table says "WRONG"; it is still timed (FA3's wheel returns wrong dense
   gradients, and its speed is part of the comparison), but no ratio is taken against a
   wrong anchor;
2. timed in ``--rounds`` interleaved rounds: each round times every implementation's
   jitted forward, then its jitted forward + backward, with the package's timer
   (:func:`pallas_flash.tuning.time_fn`), in samples of ``--sample-ms`` of work (the
   timer's default 2 ms samples read 13-24 % below a loop of 50 calls at L 1024-4096 on
   the H200: the device idles after each sample's wait; ``docs/tuning.md``). The
   backward of a round is
   the round's difference; a row reports medians over rounds, and its ratio to each
   anchor is the median of the per-round ratios (the card drifts more between rounds
   than within one).
3. with ``--control``: the first implementation is timed a second time as a separately
   jitted copy (``<impl>_again``, right after it in every round), and the markdown adds
   the per-round ratio of the two: the spread that a difference between implementations
   must exceed to be a finding.

``--dq-modes fused,bulk`` adds the Mosaic backward with a given dQ mode, as rows
``pallas_flash_mosaic_dq_<mode>`` timed in the same interleaved rounds (head_dim up to
128): the default tiling (``default_backward_config``) with the fused dQ forced
(``deterministic=False``; ``fused``: TMA reduce-adds of swizzled tiles, ``bulk``: FA3's
path, ``MosaicBackwardConfig.bulk_dq``). The default ``pallas_flash_mosaic`` takes the
separate dQ kernel for short causal calls at head_dim 65-128, so ``fused`` is the like
for like of ``bulk`` there.

Writes ``backward-<device>-<date>[-tag].json`` and a markdown table of the same name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.flops import attention_flops, problem_shape, tflops_per_s
from benchmarks.implementations import IMPLEMENTATIONS, AttentionFn, error_summary
from benchmarks.timing import time_fn
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, default_backward_config
from pallas_flash.reference import standard_attention

DEFAULT_IMPLS = "pallas_flash_mosaic,pallas_flash_mosaic_deterministic,fa3,cudnn"
ANCHORS = ("fa3", "cudnn")
PASSES = ("fwd", "bwd", "fwdbwd")
#: The name of ``--control``'s second copy of the first implementation.
CONTROL_SUFFIX = "_again"
#: Enough calls for ``--sample-ms`` of the shortest forward (about 0.15 ms).
MAX_CALLS_PER_SAMPLE = 1024
#: ``--dq-modes``: the Mosaic backward's fused dQ modes, as ``MosaicBackwardConfig.bulk_dq``.
DQ_MODES = {"fused": False, "bulk": True}
#: The rows of ``--dq-modes`` are named this prefix plus the mode.
DQ_MODE_PREFIX = "pallas_flash_mosaic_dq_"
#: Largest head dim of the fused dQ modes.
DQ_MODE_MAX_HEAD_DIM = 128


def dq_mode_fn(mode: str) -> AttentionFn:
    """``pallas_flash.attention(implementation="mosaic")`` whose backward runs the fused dQ
    in ``mode`` (a key of :data:`DQ_MODES`) with the default tiling."""
    if mode not in DQ_MODES:
        raise ValueError(f"mode must be one of {sorted(DQ_MODES)}, got {mode!r}")

    def fn(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        import pallas_flash

        mask = MaskSpec(seq_q=q.shape[1], seq_kv=k.shape[1], is_causal=causal)
        tiling = default_backward_config(q.shape, k.shape, q.dtype, mask)
        config = MosaicBackwardConfig(block_q=tiling.block_q, dq_block_kv=tiling.dq_block_kv,
                                      num_stages=tiling.num_stages, deterministic=False,
                                      bulk_dq=DQ_MODES[mode])
        return pallas_flash.attention(q, k, v, is_causal=causal, implementation="mosaic",
                                      config=config)

    return fn


def _calls(fn: AttentionFn, causal: bool) -> tuple[Callable, Callable]:
    """The jitted ``(q, k, v) -> out`` and ``(q, k, v, do) -> (out, dq, dk, dv)``."""
    def forward(q, k, v):
        return fn(q, k, v, causal)

    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(forward, q, k, v)
        return (out, *vjp(d_out))

    return jax.jit(forward), jax.jit(forward_backward)


def reference_head(q, k, v, d_out, causal: bool) -> list[np.ndarray]:
    """(out, dq, dk, dv) of batch row 0, head 0 in float32, from the bf16 inputs."""
    head = [x[:1, :, :1].astype(jnp.float32) for x in (q, k, v, d_out)]
    mask = MaskSpec(seq_q=q.shape[1], seq_kv=k.shape[1], is_causal=causal)

    def attend(q, k, v):
        return standard_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)[0]

    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(attend, *head[:3])
        return [np.asarray(x, np.float32) for x in (out, *vjp(head[3]))]


def head_errors(outputs: Sequence[jax.Array], expected: Sequence[np.ndarray]) -> list[float]:
    """Per output, ``‖got − expected‖ / ‖expected‖`` on batch row 0, head 0 (NaN if any
    value there is not finite)."""
    errors = []
    for got, want in zip(outputs, expected, strict=True):
        got = np.asarray(got[:1, :, :1], np.float32)
        errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want))
                      if np.all(np.isfinite(got)) else math.nan)
    return errors


def run_point(head_dim: int, seq_len: int, causal: bool, impls: Mapping[str, AttentionFn],
              args: argparse.Namespace, supports: Callable[[str, int], bool]) -> list[dict]:
    """Every implementation at one point: checked, then timed in interleaved rounds."""
    batch, heads = problem_shape(head_dim, seq_len, tokens=args.tokens, hidden=args.hidden)
    keys = jax.random.split(jax.random.key(args.seed + seq_len + head_dim + causal), 4)
    q, k, v, d_out = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16)
                      for key in keys)
    base = dict(head_dim=head_dim, seq_len=seq_len, batch=batch, heads=heads, causal=causal)
    rows = {name: dict(base, impl=name, error=None) for name in impls}
    expected = reference_head(q, k, v, d_out, causal)
    calls = {}
    for name, fn in impls.items():
        if not supports(name, head_dim):
            rows[name]["error"] = f"not run: {name} does not take head_dim {head_dim}"
            continue
        try:
            forward, forward_backward = _calls(fn, causal)
            errors = head_errors(jax.block_until_ready(forward_backward(q, k, v, d_out)),
                                 expected)
            jax.block_until_ready(forward(q, k, v))
        except Exception as e:  # a failing implementation is a row, not a crash
            rows[name]["error"] = error_summary(e)
            continue
        rows[name]["rel_err"] = dict(zip(("out", "dq", "dk", "dv"), errors, strict=True))
        rows[name]["correct"] = all(e <= args.tolerance for e in errors)  # NaN fails
        calls[name] = (forward, forward_backward)
    samples: dict[str, dict[str, list[float]]] = {
        name: {p: [] for p in PASSES} for name in calls}
    timing = dict(iters=args.iters, warmup=1, max_seconds=args.max_seconds,
                  min_sample_ms=args.sample_ms, max_calls_per_sample=MAX_CALLS_PER_SAMPLE)
    for _ in range(args.rounds):
        for name, (forward, forward_backward) in calls.items():
            fwd = time_fn(forward, [(q, k, v)], **timing).median_ms
            both = time_fn(forward_backward, [(q, k, v, d_out)], **timing).median_ms
            for pass_, ms in zip(PASSES, (fwd, both - fwd, both), strict=True):
                samples[name][pass_].append(ms)
    for name, by_pass in samples.items():
        row = rows[name]
        for pass_, ms in by_pass.items():
            flops = attention_flops(batch, heads, seq_len, head_dim, causal=causal,
                                    pass_=pass_)
            median = statistics.median(ms)
            row[f"{pass_}_ms"] = median
            row[f"{pass_}_round_ms"] = ms
            row[f"{pass_}_tflops"] = tflops_per_s(flops, median) if median > 0 else None
            for anchor in ANCHORS:
                if (anchor != name and anchor in samples and rows[anchor]["correct"]
                        and min(ms) > 0):
                    row[f"{pass_}_vs_{anchor}"] = statistics.median(
                        a / x for a, x in zip(samples[anchor][pass_], ms, strict=True))
    return list(rows.values())


def table(rows: list[dict]) -> str:
    """Markdown: one line per (point, implementation), TFLOP/s and ratios per pass."""
    anchors = [a for a in ANCHORS if any(r["impl"] == a for r in rows)]
    head = ["D", "L", "causal", "impl"] + [f"{p} TFLOP/s" for p in PASSES] + [
        f"{p} × {a}" for a in anchors for p in PASSES] + ["max rel err (out, dq, dk, dv)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["seq_len"]), "yes" if r["causal"] else "no",
                 r["impl"]]
        if r.get("error"):
            cells += [r["error"][:120]] + [""] * (len(head) - 5)
        else:
            cells += [f"{r[f'{p}_tflops']:.0f}" if r[f"{p}_tflops"] else "–" for p in PASSES]
            cells += [f"{r[f'{p}_vs_{a}']:.2f}" if f"{p}_vs_{a}" in r else ""
                      for a in anchors for p in PASSES]
            worst = max(r["rel_err"].values(), key=lambda e: math.inf if math.isnan(e) else e)
            cells.append(f"{worst:.1e}" if r["correct"] else f"WRONG ({worst:.1e})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def control_spread(rows: list[dict]) -> str:
    """Markdown: for each point timed with ``--control``, the median per-round ratio of the
    first implementation's time to its second, separately jitted copy's, per pass (the run's
    noise: a difference between implementations smaller than this spread is not a finding)."""
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_point.setdefault((r["head_dim"], r["seq_len"], r["causal"]), {})[r["impl"]] = r
    lines = []
    for (head_dim, seq_len, causal), point in by_point.items():
        for name, again in point.items():
            first = point.get(name.removesuffix(CONTROL_SUFFIX))
            if (not name.endswith(CONTROL_SUFFIX) or first is None or first.get("error")
                    or again.get("error")):
                continue
            ratios = [statistics.median(a / b for a, b in zip(
                first[f"{p}_round_ms"], again[f"{p}_round_ms"], strict=True))
                for p in PASSES]
            lines.append(f"| {head_dim} | {seq_len} | {'yes' if causal else 'no'} | "
                         f"{first['impl']} | " + " | ".join(f"{x:.3f}" for x in ratios) + " |")
    if not lines:
        return ""
    head = "| D | L | causal | impl | " + " | ".join(f"{p} first / again" for p in PASSES)
    return "\n".join([head + " |", "|" + "---|" * (4 + len(PASSES)), *lines])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON and markdown")
    parser.add_argument("--tag", default=None)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--seq-lens", default="1024,4096,16384")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--impls", default=DEFAULT_IMPLS,
                        help=f"comma list from {sorted(IMPLEMENTATIONS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=0.5)
    parser.add_argument("--sample-ms", type=float, default=20.0,
                        help="work per timing sample: the host's wait between samples and "
                             "the first dispatch after it leave the device idle (about 0.1 ms "
                             "on the H200 host: 13-24 %% of 2 ms samples at L 1024-4096)")
    parser.add_argument("--tolerance", type=float, default=2e-2,
                        help="largest relative error of out, dq, dk, dv on the checked head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16384, help="batch · L per point")
    parser.add_argument("--hidden", type=int, default=2048, help="heads · head_dim")
    parser.add_argument("--dq-modes", default="",
                        help=f"comma list from {sorted(DQ_MODES)}: also time the Mosaic "
                             f"backward with that fused dQ mode ('{DQ_MODE_PREFIX}<mode>')")
    parser.add_argument("--control", action="store_true",
                        help=f"time the first implementation twice (the copy named "
                             f"'<impl>{CONTROL_SUFFIX}') and report the spread between them")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.impls.split(",")) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"unknown implementations {unknown}; known: {sorted(IMPLEMENTATIONS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = sorted(set(filter(None, args.dq_modes.split(","))) - set(DQ_MODES))
    if unknown:
        parser.error(f"unknown --dq-modes {unknown}; known: {sorted(DQ_MODES)}")
    return args


def run(args: argparse.Namespace, impls: Mapping[str, AttentionFn],
        supports: Callable[[str, int], bool]) -> int:
    """Every point of ``args``; writes the JSON and markdown after each."""
    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    device = jax.devices()[0]
    date = datetime.date.today().isoformat()
    stem = Path(args.out) / report.file_stem("backward", device.device_kind, date, args.tag)
    stem.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for head_dim in map(int, args.head_dims.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            for causal in causal_modes:
                rows += run_point(head_dim, seq_len, causal, impls, args, supports)
                doc = dict(date=date, device=device.device_kind, jax_version=jax.__version__,
                           command=vars(args), rows=rows)
                stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
                text = (f"# Forward and backward vs FA3 and cuDNN ({device.device_kind}, "
                        f"{date}, jax {jax.__version__}, {args.rounds} interleaved rounds)\n\n"
                        f"{table(rows)}\n")
                spread = control_spread(rows)
                if spread:
                    text += f"\n## Noise: one implementation timed twice\n\n{spread}\n"
                stem.with_suffix(".md").write_text(text)
                print(table([r for r in rows if r["seq_len"] == seq_len
                             and r["head_dim"] == head_dim and r["causal"] == causal]),
                      flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.impls.split(",")
    impls = {n: IMPLEMENTATIONS[n].fn for n in names}
    if args.control:  # right after the first, so that the two alternate in every round
        copy = {names[0] + CONTROL_SUFFIX: impls[names[0]]}
        impls = {names[0]: impls[names[0]], **copy, **impls}
    for mode in filter(None, args.dq_modes.split(",")):
        impls[DQ_MODE_PREFIX + mode] = dq_mode_fn(mode)

    def supports(name: str, head_dim: int) -> bool:
        if name.startswith(DQ_MODE_PREFIX):
            return head_dim <= DQ_MODE_MAX_HEAD_DIM
        return IMPLEMENTATIONS[name.removesuffix(CONTROL_SUFFIX)].supports(head_dim)
    return run(args, impls, supports)


if __name__ == "__main__":
    raise SystemExit(main())

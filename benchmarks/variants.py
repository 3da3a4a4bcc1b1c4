"""One benchmark row per attention variant: what masking and packing cost, or save.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.variants --out $OUT

bf16, head_dim 128, hidden 2048, one sequence of ``--seq-len`` tokens (default 16384).
FLOPs are counted on the *visible* pairs only (4·H·pairs·D forward, 2.5× that backward),
so a kernel that skips invisible tiles keeps its TFLOP/s while its time drops. ``vs dense``
is the variant's time over the dense causal time of the same implementation: 8 packed
documents should approach 1/8. cuDNN runs where jax.nn can express the variant (window,
padding, bias, mask); pallas-flash runs every row. Per variant, the implementations are
timed in ``--rounds`` interleaved rounds (each round times each one in turn; the median
over rounds is reported), so a slow drift of the GPU's clock reaches all of them alike.

The variants, all causal except the dense padded ones:

* masking: packed documents (segment ids), a window, soft-cap, sinks;
* arrays: one bf16 ``[seq, seq]`` random bias shared by all heads (512 MiB at 16k tokens),
  a padding-style ``[1, 1, 1, seq]`` mask that hides nothing;
* a causal model's own mask handed over as an array: the dense ``[1, 1, seq, seq]``
  lower-triangular boolean mask without ``is_causal`` (the kernel learns nothing from it
  and visits every tile), the same mask with ``is_causal=True``, and the mask as an
  additive ``[seq, seq]`` bias of 0 / -inf without ``is_causal`` (what MaxText passes);
  their ``vs dense`` is the cost of not passing ``is_causal``;
* padding: ``query_seq_lengths`` = ``key_value_seq_lengths`` = 50 % and 90 % of the
  sequence, dense and causal: per-sequence lengths are row bounds, so the padded calls
  must not be slower than the unpadded ones and should be faster.

The backward differentiates q, k, v only, so no row computes a bias gradient.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import report
from benchmarks.flops import BWD_FACTOR, tflops_per_s
from benchmarks.implementations import error_summary
from benchmarks.timing import time_fn


class Variant(NamedTuple):
    """One row's call: ``kwargs`` for :func:`pallas_flash.attention` (``is_causal`` always
    among them) and the variant whose time its ``vs dense`` divides by (the same visible
    structure without masks, padding or extras: ``"dense causal"`` or ``"dense"``)."""

    kwargs: dict
    baseline: str


def variants(seq: int, heads: int) -> dict[str, Variant]:
    """name -> :class:`Variant`, baselines first (they are timed before the rows that
    divide by them)."""
    docs = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seq // 8)[None]
    tril = jnp.tril(jnp.ones((seq, seq), bool))
    causal = dict(is_causal=True)
    table = {
        "dense causal": Variant(causal, "dense causal"),
        "dense": Variant(dict(is_causal=False), "dense"),
        "8 packed documents": Variant(dict(causal, q_segment_ids=docs), "dense causal"),
        "window 1024": Variant(dict(causal, local_window_size=(1024, 0)), "dense causal"),
        "soft-cap 30": Variant(dict(causal, logits_soft_cap=30.0), "dense causal"),
        "sinks": Variant(dict(causal, sinks=jnp.zeros((heads,), jnp.float32)), "dense causal"),
        "bias [T, S]": Variant(dict(causal, bias=jax.random.normal(
            jax.random.PRNGKey(1), (seq, seq), jnp.bfloat16)), "dense causal"),
        "mask [1, 1, 1, S]": Variant(dict(causal, mask=jnp.ones((1, 1, 1, seq), bool)),
                                     "dense causal"),
        "causal mask [1, 1, T, S], no is_causal": Variant(
            dict(is_causal=False, mask=tril[None, None]), "dense causal"),
        "causal mask [1, 1, T, S] + is_causal": Variant(
            dict(is_causal=True, mask=tril[None, None]), "dense causal"),
        "causal 0/-inf bias [T, S], no is_causal": Variant(
            dict(is_causal=False, bias=jnp.where(tril, 0.0, -jnp.inf).astype(jnp.bfloat16)),
            "dense causal"),
    }
    for percent in (50, 90):
        lengths = jnp.array([seq * percent // 100], jnp.int32)
        padded = dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths)
        table[f"causal, padded to {percent} %"] = Variant(dict(causal, **padded),
                                                          "dense causal")
        table[f"dense, padded to {percent} %"] = Variant(dict(is_causal=False, **padded),
                                                         "dense")
    return table


def visible_pairs(seq: int, kwargs: dict) -> int:
    """Visible (query, key) pairs of one head under a variant's ``kwargs``, counted exactly.

    Each query row sees an interval of keys (causal, window, its document, the key
    length); padded queries see none. A ``mask`` or ``bias`` (leading dims of size 1, as
    :func:`variants` builds them; -inf bias entries hide their pair) is counted within
    the intervals. Documents (``q_segment_ids``) are contiguous runs of ascending ids.
    """
    rows = np.arange(seq)
    lo = np.zeros(seq, np.int64)
    hi = np.full(seq, seq, np.int64)
    if kwargs.get("is_causal"):
        hi = rows + 1
    window = kwargs.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        lo, hi = np.maximum(lo, rows - left), np.minimum(hi, rows + right + 1)
    if "q_segment_ids" in kwargs:
        ids = np.asarray(kwargs["q_segment_ids"])[0]
        lo = np.maximum(lo, np.searchsorted(ids, ids, side="left"))
        hi = np.minimum(hi, np.searchsorted(ids, ids, side="right"))
    if "key_value_seq_lengths" in kwargs:
        hi = np.minimum(hi, int(kwargs["key_value_seq_lengths"][0]))
    if "query_seq_lengths" in kwargs:
        hi = np.where(rows < int(kwargs["query_seq_lengths"][0]), hi, lo)
    hi = np.maximum(hi, lo)
    arrays = [kwargs["mask"].astype(bool)] if "mask" in kwargs else []
    if "bias" in kwargs:
        arrays.append(kwargs["bias"] > -jnp.inf)
    if not arrays:
        return int(np.sum(hi - lo))
    visible = jnp.ones((1, 1), bool)
    for array in arrays:
        visible = visible & array.reshape(array.shape[-2:])
    per_row = _count_in_intervals(visible, jnp.asarray(lo), jnp.asarray(hi), seq)
    return int(np.sum(np.asarray(per_row), dtype=np.int64))


@functools.partial(jax.jit, static_argnums=3)
def _count_in_intervals(visible, lo, hi, seq):
    """Per row, the True entries of ``visible`` (broadcast to ``[seq, seq]``) with
    ``lo <= col < hi`` (int32: at most ``seq``); fused under jit, so no ``[seq, seq]``
    temporary is kept."""
    cols = jnp.arange(seq)[None, :]
    inside = (cols >= lo[:, None]) & (cols < hi[:, None])
    return jnp.sum(jnp.broadcast_to(visible, (seq, seq)) & inside, axis=1, dtype=jnp.int32)


_ANCHOR_TAKES = {"is_causal", "local_window_size", "query_seq_lengths",
                 "key_value_seq_lengths", "bias", "mask"}


def anchor(kwargs: dict, implementation: str = "cudnn") -> Callable | None:
    """``jax.nn.dot_product_attention`` for the variant (``implementation``: cuDNN on the
    GPU, ``"xla"`` to check numerics on the CPU), or None when it has no such option."""
    if not set(kwargs) <= _ANCHOR_TAKES:
        return None
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation=implementation, **kwargs)


def ours(implementation: str | None, kwargs: dict) -> Callable:
    """:func:`pallas_flash.attention` for the variant (``implementation`` as it takes it)."""
    return lambda q, k, v: pf.attention(q, k, v, implementation=implementation, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds per variant (median over rounds)")
    parser.add_argument("--impls", default="cudnn,pallas_flash,pallas_flash_mosaic,"
                        "pallas_flash_triton",
                        help="comma list of cudnn, pallas_flash (API's choice), "
                             "pallas_flash_mosaic, pallas_flash_triton, xla (pallas-flash's "
                             "XLA path)")
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT",
                        help="run this variant (repeatable; default: all); its baseline "
                             "runs too")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    seq, head_dim = args.seq_len, args.head_dim
    heads = 2048 // head_dim if jax.default_backend() == "gpu" else 2
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, g = (jax.random.normal(key, (1, seq, heads, head_dim), dtype) for key in keys)
    makers = {
        "cudnn": anchor,
        "pallas_flash": lambda kw: ours(None, kw),
        "pallas_flash_mosaic": lambda kw: ours("mosaic", kw),
        "pallas_flash_triton": lambda kw: ours("triton", kw),
        "xla": lambda kw: ours("xla", kw),
    }
    impls = args.impls.split(",")
    if unknown := set(impls) - set(makers):
        parser.error(f"--impls: unknown {sorted(unknown)}; known: {sorted(makers)}")
    table = variants(seq, heads)
    chosen = args.only or list(table)
    if unknown := set(chosen) - set(table):
        parser.error(f"--only: unknown {sorted(unknown)}; known: {list(table)}")
    chosen = [name for name in table
              if name in chosen or name in {table[c].baseline for c in chosen}]
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, L={seq}, D={head_dim}, {jnp.dtype(dtype).name}, "
              f"{args.rounds} interleaved rounds")
    rows, times = [], {}
    for name in chosen:
        variant = table[name]
        calls, by_impl = {}, {}
        for impl in impls:
            row = by_impl[impl] = {"impl": impl, "variant": name, "seq_len": seq,
                                   "head_dim": head_dim, "baseline": variant.baseline}
            rows.append(row)
            attn = makers[impl](variant.kwargs)
            if attn is None:
                row["error"] = "not expressible"
                continue
            fwd = jax.jit(attn)
            fwd_bwd = jax.jit(lambda q, k, v, g, attn=attn: jax.vjp(attn, q, k, v)[1](g))
            try:  # compiles both; a failing implementation is a row, not a crash
                jax.block_until_ready((fwd(q, k, v), fwd_bwd(q, k, v, g)))
            except Exception as e:
                row["error"] = error_summary(e)
                print(json.dumps(row), flush=True)
                continue
            calls[impl] = (fwd, fwd_bwd)
        samples = {impl: ([], []) for impl in calls}
        for _ in range(args.rounds):
            for impl, (fwd, fwd_bwd) in calls.items():
                t_fwd = time_fn(fwd, [(q, k, v)], iters=args.iters).median_ms
                t_both = time_fn(fwd_bwd, [(q, k, v, g)], iters=args.iters).median_ms
                samples[impl][0].append(t_fwd)
                samples[impl][1].append(t_both - t_fwd)
        pairs = visible_pairs(seq, variant.kwargs)
        flops = 4.0 * heads * pairs * head_dim
        for impl, (fwd_ms, bwd_ms) in samples.items():
            t_fwd, t_bwd = statistics.median(fwd_ms), statistics.median(bwd_ms)
            times[impl, name] = (t_fwd, t_bwd)
            row = by_impl[impl]
            row.update(visible_pairs=pairs, fwd_ms=t_fwd, bwd_ms=t_bwd,
                       fwd_round_ms=fwd_ms, bwd_round_ms=bwd_ms,
                       fwd_tflops=tflops_per_s(flops, t_fwd),
                       bwd_tflops=tflops_per_s(BWD_FACTOR * flops, max(t_bwd, 1e-9)))
            if (impl, variant.baseline) in times:
                base_fwd, base_bwd = times[impl, variant.baseline]
                row.update(fwd_vs_dense=t_fwd / base_fwd, bwd_vs_dense=t_bwd / base_bwd)
            print(json.dumps(row), flush=True)
        if args.out:  # after every variant: a run cut short by a time limit keeps its rows
            _write(args.out, header, rows)
    print(_table(header, rows))
    if args.out:
        _write(args.out, header, rows)


def _table(header: str, rows: list[dict]) -> str:
    lines = [f"# Variants: {header}", "",
             "\"vs dense\": time over the same implementation's time on the baseline (the "
             "same visible structure without masks, padding or extras).", "",
             "| impl | variant | baseline | fwd ms | fwd TF/s | fwd vs dense | bwd ms | "
             "bwd TF/s | bwd vs dense |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['variant']} | {r['baseline']} | {r['error']} "
                         "||||||")
        elif "fwd_ms" in r:
            ratios = [f"{r[key]:.2f}" if key in r else "–"
                      for key in ("fwd_vs_dense", "bwd_vs_dense")]
            lines.append(f"| {r['impl']} | {r['variant']} | {r['baseline']} | "
                         f"{r['fwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {ratios[0]} | "
                         f"{r['bwd_ms']:.3f} | {r['bwd_tflops']:.1f} | {ratios[1]} |")
    return "\n".join(lines)


def _write(out: str, header: str, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, report.file_stem("variants", jax.devices()[0].device_kind,
                                              datetime.date.today().isoformat()))
    with open(stem + ".json", "w") as f:
        json.dump({"device": header, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_table(header, rows) + "\n")


if __name__ == "__main__":
    main()

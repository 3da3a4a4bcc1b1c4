"""One benchmark row per attention variant: what masking and packing cost, or save.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.variants --out $OUT

bf16, head_dim 128, hidden 2048, one sequence of ``--seq-len`` tokens (default 16384).
Every variant is causal; FLOPs are counted on the *visible* pairs only (4·H·pairs·D forward,
2.5× that backward), so a kernel that skips invisible tiles keeps its TFLOP/s while its time
drops. ``vs dense`` is the variant's time over the dense causal time of the same
implementation: 8 packed documents should approach 1/8. cuDNN runs where jax.nn can express
the variant (window, padding, bias, mask); pallas-flash runs every row. The bias row is one
bf16 ``[seq, seq]`` bias shared by all heads (512 MiB at 16k tokens), the mask row a
padding-style ``[1, 1, 1, seq]`` mask that hides nothing; the backward differentiates q, k,
v only, so neither row computes a bias gradient.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_flash as pf
from benchmarks import report
from benchmarks.flops import BWD_FACTOR, tflops_per_s
from benchmarks.timing import time_fn
from pallas_flash.masking import MaskSpec


def variants(seq: int, heads: int) -> dict[str, dict]:
    """name -> pallas_flash.attention keyword arguments (all causal)."""
    docs = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seq // 8)[None]
    return {
        "dense causal": {},
        "8 packed documents": dict(q_segment_ids=docs),
        "window 1024": dict(local_window_size=(1024, 0)),
        "half padded": dict(query_seq_lengths=jnp.array([seq // 2]),
                            key_value_seq_lengths=jnp.array([seq // 2])),
        "soft-cap 30": dict(logits_soft_cap=30.0),
        "sinks": dict(sinks=jnp.zeros((heads,), jnp.float32)),
        "bias [T, S]": dict(bias=jax.random.normal(jax.random.PRNGKey(1), (seq, seq),
                                                   jnp.bfloat16)),
        "mask [1, 1, 1, S]": dict(mask=jnp.ones((1, 1, 1, seq), bool)),
    }


def visible_pairs(seq: int, kwargs: dict) -> float:
    """Visible (query, key) pairs of one head under a variant, counted exactly."""
    window = kwargs.get("local_window_size")
    pairs = MaskSpec(seq, seq, is_causal=True, window=window).visible_fraction() * seq * seq
    if "q_segment_ids" in kwargs:
        doc = seq // 8
        pairs = 8 * doc * (doc + 1) / 2
    if "query_seq_lengths" in kwargs:
        n = int(kwargs["query_seq_lengths"][0])
        pairs = n * (n + 1) / 2
    return pairs


def _cudnn(kwargs: dict) -> Callable | None:
    """jax.nn's cuDNN call for the variant, or None when it has no such option."""
    supported = {"local_window_size", "query_seq_lengths", "key_value_seq_lengths", "bias",
                 "mask"}
    if not set(kwargs) <= supported:
        return None
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn", **kwargs)


def _ours(implementation: str | None, kwargs: dict) -> Callable:
    return lambda q, k, v: pf.attention(q, k, v, is_causal=True,
                                        implementation=implementation, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--impls", default="cudnn,pallas_flash,pallas_flash_mosaic,"
                        "pallas_flash_triton",
                        help="comma list of cudnn, pallas_flash (API's choice), "
                             "pallas_flash_mosaic, pallas_flash_triton, xla (pallas-flash's "
                             "XLA path)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)

    seq, head_dim = args.seq_len, args.head_dim
    heads = 2048 // head_dim if jax.default_backend() == "gpu" else 2
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, g = (jax.random.normal(key, (1, seq, heads, head_dim), dtype) for key in keys)
    makers = {
        "cudnn": _cudnn,
        "pallas_flash": lambda kw: _ours(None, kw),
        "pallas_flash_mosaic": lambda kw: _ours("mosaic", kw),
        "pallas_flash_triton": lambda kw: _ours("triton", kw),
        "xla": lambda kw: _ours("xla", kw),
    }
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, L={seq}, D={head_dim}, {jnp.dtype(dtype).name}")
    rows = []
    for impl in args.impls.split(","):
        dense_ms = {}
        for name, kwargs in variants(seq, heads).items():
            row = {"impl": impl, "variant": name, "seq_len": seq, "head_dim": head_dim}
            rows.append(row)
            attn = makers[impl](kwargs)
            if attn is None:
                row["error"] = "not expressible"
                continue
            fwd = jax.jit(attn)
            fwd_bwd = jax.jit(lambda q, k, v, g, attn=attn: jax.vjp(attn, q, k, v)[1](g))
            try:
                t_fwd = time_fn(fwd, [(q, k, v)], iters=args.iters).median_ms
                t_bwd = time_fn(fwd_bwd, [(q, k, v, g)], iters=args.iters).median_ms - t_fwd
            except Exception as e:
                row["error"] = str(e).splitlines()[0][:160]
                print(json.dumps(row), flush=True)
                continue
            flops = 4.0 * heads * visible_pairs(seq, kwargs) * head_dim
            dense_ms.setdefault("fwd", t_fwd)
            dense_ms.setdefault("bwd", t_bwd)
            row.update(fwd_ms=t_fwd, bwd_ms=t_bwd,
                       fwd_tflops=tflops_per_s(flops, t_fwd),
                       bwd_tflops=tflops_per_s(BWD_FACTOR * flops, max(t_bwd, 1e-9)),
                       fwd_vs_dense=t_fwd / dense_ms["fwd"], bwd_vs_dense=t_bwd / dense_ms["bwd"])
            print(json.dumps(row), flush=True)
            if args.out:  # after every row: a run cut short by a time limit keeps its rows
                _write(args.out, header, rows)
    print(_table(header, rows))
    if args.out:
        _write(args.out, header, rows)


def _table(header: str, rows: list[dict]) -> str:
    lines = [f"# Variants: {header}", "",
             "| impl | variant | fwd ms | fwd TF/s | fwd vs dense | bwd ms | bwd TF/s | "
             "bwd vs dense |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['variant']} | {r['error']} ||||||")
        elif "fwd_ms" in r:
            lines.append(f"| {r['impl']} | {r['variant']} | {r['fwd_ms']:.3f} | "
                         f"{r['fwd_tflops']:.1f} | {r['fwd_vs_dense']:.2f} | {r['bwd_ms']:.3f} | "
                         f"{r['bwd_tflops']:.1f} | {r['bwd_vs_dense']:.2f} |")
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

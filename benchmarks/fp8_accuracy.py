"""Accuracy of FP8 attention: per-tensor vs per-block scaling, with and without rotation.

    python -m benchmarks.fp8_accuracy --out benchmarks/results      # CPU, about a minute

The FlashAttention-3 paper's test (Sec. 4.3): Q, K, V drawn from N(0, 1) with 0.1 % of the
entries replaced by 10·N(0, 1) outliers; the output of :func:`pallas_flash.tutorial.
fp8_study.attention_fp8_reference` is compared with the float64 oracle by RMSE. Two
columns split the error: ``fp8 Q·Kᵀ only`` keeps P and V in float32 (the error the
scaling and the rotation act on); the full FP8 forward adds the rounding of V and P, which
no scale removes: e4m3's rounding error is relative (3 mantissa bits), whatever the scale.

The backward (``--backward``, same inputs, dO from N(0, 1)): the relative error of dq, dk,
dv against the float64 oracle of
:func:`pallas_flash.tutorial.fp8_study.attention_fp8_backward_reference`
with FP8 operands in one GEMM at a time (the others bf16, residuals from the bf16
forward), and in all five (residuals from the FP8 forward with the same scaling, as an
FP8 training step would have them), next to the bf16 backward (no GEMM in FP8). The bar for
an FP8 backward is gradients within 2x the bf16 backward's error.
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import file_stem
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from pallas_flash.tutorial import fp8_study
from pallas_flash.tutorial.cli import int_list

#: (name, scaling, incoherent processing)
METHODS = (("per-tensor", "tensor", False), ("per-block", "block", False),
           ("per-tensor + Hadamard", "tensor", True), ("per-block + Hadamard", "block", True))


def with_outliers(key: jax.Array, shape: tuple[int, ...], fraction: float = 1e-3,
                  magnitude: float = 10.0) -> jax.Array:
    """N(0, 1) with a ``fraction`` of the entries replaced by ``magnitude``·N(0, 1)."""
    normal, pick, big = jax.random.split(key, 3)
    x = jax.random.normal(normal, shape)
    outlier = jax.random.bernoulli(pick, fraction, shape)
    return jnp.where(outlier, magnitude * jax.random.normal(big, shape), x)


def measure(seq_len: int, head_dim: int, heads: int, seed: int) -> dict:
    """RMSE against the float64 oracle of bf16 attention and of each FP8 method."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (1, seq_len, heads, head_dim)
    q, k, v = (with_outliers(key, shape).astype(jnp.bfloat16) for key in keys[:3])
    expected = np.asarray(attention_float64(q, k, v)[0], np.float64)

    def rmse(out) -> float:
        return float(np.sqrt(np.mean((np.asarray(out, np.float64) - expected) ** 2)))

    row = {"seq_len": seq_len, "head_dim": head_dim, "heads": heads,
           "bf16": rmse(jax.nn.dot_product_attention(q, k, v))}
    for name, scaling, rotate in METHODS:
        kwargs = dict(scaling=scaling, hadamard_key=keys[3] if rotate else None)
        row[name] = rmse(fp8_study.attention_fp8_reference(q, k, v, **kwargs))
        row[f"{name} (fp8 Q·Kᵀ only)"] = rmse(
            fp8_study.attention_fp8_reference(q, k, v, fp8_pv=False, **kwargs))
    row["gain"] = row["per-tensor"] / row["per-block + Hadamard"]
    row["gain (fp8 Q·Kᵀ only)"] = (row["per-tensor (fp8 Q·Kᵀ only)"]
                                   / row["per-block + Hadamard (fp8 Q·Kᵀ only)"])
    return row


#: (name, GEMMs in FP8, scaling, incoherent processing) of the backward study.
BACKWARD_METHODS = (
    ("bf16", frozenset(), "block", False),
    *((f"fp8 {gemm} only", frozenset({gemm}), "block", False)
      for gemm in ("s", "dp", "dv", "dq", "dk")),
    ("all fp8, per-tensor", fp8_study.BACKWARD_GEMMS, "tensor", False),
    ("all fp8, per-block", fp8_study.BACKWARD_GEMMS, "block", False),
    ("all fp8, per-block + Hadamard", fp8_study.BACKWARD_GEMMS, "block", True),
)


def measure_backward(seq_len: int, head_dim: int, heads: int, seed: int,
                     causal: bool) -> dict:
    """Relative error of (dq, dk, dv) vs the float64 oracle for each backward method."""
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (1, seq_len, heads, head_dim)
    q, k, v = (with_outliers(key, shape).astype(jnp.bfloat16) for key in keys[:3])
    d_out = jax.random.normal(keys[3], shape).astype(jnp.bfloat16)
    mask = MaskSpec(seq_q=seq_len, seq_kv=seq_len, is_causal=causal)
    out, lse, expected = attention_float64(q, k, v, mask=mask,
                                           d_out=np.asarray(d_out, np.float64))
    bf16_residuals = (jnp.asarray(out, jnp.bfloat16),
                      jnp.transpose(jnp.asarray(lse, jnp.float32), (0, 2, 1)))
    block_q, block_kv = 64, 128
    row = {"seq_len": seq_len, "head_dim": head_dim, "heads": heads, "causal": causal}
    for name, gemms, scaling, rotate in BACKWARD_METHODS:
        hadamard_key = keys[4] if rotate else None
        residuals = bf16_residuals
        if gemms == fp8_study.BACKWARD_GEMMS:  # an FP8 training step: the FP8 forward's out, lse
            residuals = fp8_study.attention_fp8_reference(
                q, k, v, scaling=scaling, hadamard_key=hadamard_key, block_q=block_q,
                block_kv=block_kv, is_causal=causal, return_residual=True)
        grads = fp8_study.attention_fp8_backward_reference(
            q, k, v, *residuals, d_out, fp8_gemms=gemms, scaling=scaling,
            hadamard_key=hadamard_key, block_q=block_q, block_kv=block_kv, is_causal=causal)
        row[name] = [float(np.linalg.norm(np.asarray(g, np.float64) - e) / np.linalg.norm(e))
                     for g, e in zip(grads, expected, strict=True)]
    best = min((n for n, *_ in BACKWARD_METHODS if n != "bf16"), key=lambda n: max(row[n]))
    row["best"] = best
    row["best / bf16"] = max(a / b for a, b in zip(row[best], row["bf16"], strict=True))
    return row


def backward_markdown(rows: list[dict], header: str) -> str:
    names = [name for name, *_ in BACKWARD_METHODS]
    lines = [header, "", "| L | D | causal | " + " | ".join(names) + " | best / bf16 |",
             "|---:|---:|:---|" + "---:|" * len(names) + "---:|"]
    for row in rows:
        cells = [" / ".join(f"{e:.1e}" for e in row[n]) for n in names]
        lines.append(f"| {row['seq_len']} | {row['head_dim']} | {row['causal']} | "
                     + " | ".join(cells) + f" | {row['best / bf16']:.1f}× ({row['best']}) |")
    lines += ["", "Relative error ‖g − g₆₄‖ / ‖g₆₄‖ of dq / dk / dv vs the float64 oracle; "
              "`fp8 X only`: the GEMM that makes X with e4m3 operands, the others bf16. "
              "best / bf16: the largest of the three ratios for the most accurate FP8 "
              "method (the bar: ≤ 2×)."]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], header: str) -> str:
    names = [name for name, _, _ in METHODS]
    lines = [header, "",
             "| L | D | bf16 | " + " | ".join(names) + " | per-tensor / per-block+Hadamard |",
             "|---:|---:|---:|" + "---:|" * len(names) + "---:|"]
    for row in rows:
        cells = [f"{row[n]:.2e} ({row[n + ' (fp8 Q·Kᵀ only)']:.2e})" for n in names]
        lines.append(f"| {row['seq_len']} | {row['head_dim']} | {row['bf16']:.1e} | "
                     + " | ".join(cells)
                     + f" | {row['gain']:.2f}× ({row['gain (fp8 Q·Kᵀ only)']:.2f}×) |")
    lines += ["", "RMSE vs the float64 oracle; in parentheses: FP8 Q·Kᵀ only (P and V in "
              "float32)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int_list, default=(1024,))
    parser.add_argument("--head-dims", type=int_list, default=(64, 128, 256))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backward", action="store_true",
                        help="the backward study instead (fp8-backward-accuracy-<date>.*)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for fp8-accuracy-<date>.{json,md} (default: print only)")
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    setup = (f"{jax.devices()[0].device_kind}, {date}, jax {jax.__version__}, "
             f"{args.heads} heads, seed {args.seed}")
    if args.backward:
        rows = [measure_backward(seq_len, head_dim, args.heads, args.seed, causal)
                for seq_len in args.seq_lens for head_dim in args.head_dims
                for causal in (False, True)]
        name = "fp8-backward-accuracy"
        text = backward_markdown(rows, f"# FP8 attention backward accuracy — {setup}")
    else:
        rows = [measure(seq_len, head_dim, args.heads, args.seed)
                for seq_len in args.seq_lens for head_dim in args.head_dims]
        name = "fp8-accuracy"
        text = markdown(rows, f"# FP8 attention accuracy — {setup}")
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = file_stem(name, jax.devices()[0].device_kind, date)
        (args.out / f"{stem}.json").write_text(json.dumps(
            {"date": date, "jax_version": jax.__version__, "rows": rows}, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()

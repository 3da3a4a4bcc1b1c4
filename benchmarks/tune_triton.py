"""Correctness check and config sweep of the Triton kernels on a GPU, cuDNN side by side.

    PYTHONPATH=. python3 benchmarks/tune_triton.py --out results.json

For each head dim: checks every candidate config against a float32 XLA reference on a
small shape, then times forward and backward (fwd+bwd through jax.vjp minus fwd) at the
papers' setup (bf16, batch·seq = 16384 tokens, hidden 2048) next to cuDNN and JAX's own
Pallas-Triton op. Prints one table; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks.implementations import jax_pallas_triton
from pallas_flash.triton import default_config


def _median_ms(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _timed(attn, q, k, v, d_out, iters):
    fwd = jax.jit(attn)
    fwd_bwd = jax.jit(lambda q, k, v, g: jax.vjp(attn, q, k, v)[1](g))
    t_fwd = _median_ms(fwd, q, k, v, iters=iters)
    t_all = _median_ms(fwd_bwd, q, k, v, d_out, iters=iters)
    return t_fwd, t_all - t_fwd


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check(config, head_dim, causal):
    keys = jax.random.split(jax.random.PRNGKey(head_dim + causal), 4)
    shape = (2, 1000, 4, head_dim)
    q, k, v, g = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)

    def ours(q, k, v):
        return pf.attention(q, k, v, is_causal=causal, implementation="triton", config=config)

    def ref(q, k, v):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    out, vjp = jax.vjp(ours, q, k, v)
    out_ref, vjp_ref = jax.vjp(ref, q, k, v)
    errors = [_rel(out, out_ref)]
    errors += [_rel(a, b) for a, b in zip(vjp(g), vjp_ref(g.astype(jnp.float32)), strict=True)]
    finite = all(bool(jnp.isfinite(x).all()) for x in (out, *vjp(g)))
    return max(errors) if finite else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", default="", help="JSON list of TritonConfig kwargs")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    rows = []
    seq = args.seq_len
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        batch, heads = 16384 // seq, 2048 // head_dim
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        shape = (batch, seq, heads, head_dim)
        q, k, v, g = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        base = default_config(shape, shape, jnp.bfloat16, None)
        candidates = [base] + [dataclasses.replace(base, **kw)
                               for kw in json.loads(args.configs or "[]")]
        for causal in (False, True):
            flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            impls = {
                "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                    q, k, v, is_causal=c, implementation="cudnn"),
                # Raises on jax >= 0.12.1 (module deleted): the row then records why.
                "jax_pallas_triton": lambda q, k, v, c=causal: jax_pallas_triton(q, k, v, c),
            }
            for i, config in enumerate(candidates):
                impls[f"triton#{i}"] = lambda q, k, v, c=causal, cfg=config: pf.attention(
                    q, k, v, is_causal=c, implementation="triton", config=cfg)
            for name, attn in impls.items():
                row = {"impl": name, "head_dim": head_dim, "seq_len": seq, "causal": causal}
                if name.startswith("triton#"):
                    config = candidates[int(name[7:])]
                    row["config"] = dataclasses.asdict(config)
                    row["max_rel_err"] = _check(config, head_dim, causal)
                try:
                    t_fwd, t_bwd = _timed(attn, q, k, v, g, args.iters)
                    row.update(fwd_ms=t_fwd, bwd_ms=t_bwd, fwd_tflops=flops / t_fwd / 1e9,
                               bwd_tflops=2.5 * flops / t_bwd / 1e9)
                except Exception as e:
                    row["error"] = str(e).splitlines()[0][:200]
                rows.append(row)
                print(json.dumps(row), flush=True)

    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'impl':20s} {'D':>4s} {'causal':>6s} {'fwd TF/s':>9s} {'bwd TF/s':>9s} {'err':>8s}")
    for row in rows:
        fwd, bwd = row.get("fwd_tflops", float("nan")), row.get("bwd_tflops", float("nan"))
        print(f"{row['impl']:20s} {row['head_dim']:4d} {row['causal']!s:>6s} "
              f"{fwd:9.1f} {bwd:9.1f} "
              f"{row.get('max_rel_err', float('nan')):8.2e} {row.get('error', '')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

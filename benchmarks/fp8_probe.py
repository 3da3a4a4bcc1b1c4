"""GPU probe of the FP8 Mosaic GPU forward: correctness at the benchmark shape, then speed.

Run on an H200/H100 from the repository root::

    PYTHONPATH=. python3 benchmarks/fp8_probe.py --head-dims 128 --lengths 16384

The FlashAttention papers' setup: batch * seq_len = 16384 tokens, heads * head_dim = 2048,
bf16 inputs, TFLOP/s = 4·B·H·L²·D / t (halved when causal). Per point (head_dim, causal,
L):

1. Correctness first: the kernel's output on the first two heads of the first sequence
   against ``fp8.attention_fp8_online`` (the kernel's arithmetic in XLA; relative error
   < 5e-3) and ``fp8.attention_fp8_reference`` (< 3e-2). Quantization is per head, so the
   slice sees exactly the kernel's scales. A point that fails is not timed.
2. Times (median of ``--repeats`` batches of ``--iters`` back-to-back calls): the FP8
   kernel alone on pre-quantized operands, the quantization alone
   (``fp8.quantize_operands``: scales, e4m3 rounding, Vᵀ), the whole ``attention_fp8``,
   cuDNN bf16 (``jax.nn.dot_product_attention(implementation="cudnn")``) and our bf16
   Mosaic forward.

Every point runs under ``try``, with an alarm of ``--point-limit`` seconds (it interrupts
Python code, not a kernel that never returns), and no new point starts after
``--time-limit`` seconds. Results go to ``--out`` (default ``$OUT/fp8_probe.json`` when
``$OUT`` is set) after every measurement. The last lines printed are a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.mosaic_probe import seconds_per_call
from pallas_flash import fp8, mosaic
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import forward_fp8

RESULTS: list[dict] = []
_TIMED = ("fp8_kernel", "quantize", "fp8_total", "cudnn_bf16", "mosaic_bf16")


def record(path: str | None, entry: dict) -> None:
    RESULTS.append(entry)
    print(json.dumps(entry), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)


class PointTimeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: int):
    """Raises PointTimeout in the main thread after ``seconds`` (0: no limit)."""
    def handler(signum, frame):
        raise PointTimeout(f"point took more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def check(q, k, v, out, *, causal: bool, config) -> dict:
    """Errors of the kernel's ``out`` on heads 0-1 of sequence 0 against the XLA specs."""
    sl = (slice(0, 1), slice(None), slice(0, 2))
    q, k, v, out = q[sl], k[sl], v[sl], out[sl]
    online, _ = jax.jit(lambda q, k, v: fp8.attention_fp8_online(
        q, k, v, block_q=config.block_q, block_kv=config.block_kv, is_causal=causal))(q, k, v)
    ref = jax.jit(lambda q, k, v: fp8.attention_fp8_reference(
        q, k, v, block_q=config.block_q, block_kv=config.block_kv, is_causal=causal))(q, k, v)
    errors = dict(rel_err_vs_online=rel_err(out, online), rel_err_vs_reference=rel_err(out, ref))
    errors["ok"] = errors["rel_err_vs_online"] < 5e-3 and errors["rel_err_vs_reference"] < 3e-2
    return errors


def bench(path, head_dim: int, causal: bool, seq_len: int, *, iters: int, repeats: int,
          point_limit: int, tokens: int = 16384, hidden: int = 2048) -> None:
    batch, heads = tokens // seq_len, hidden // head_dim
    flops = 4 * batch * heads * seq_len**2 * head_dim / (2 if causal else 1)
    entry = dict(kind="bench", head_dim=head_dim, causal=causal, seq_len=seq_len, batch=batch,
                 heads=heads)
    try:
        with alarm(point_limit):
            keys = jax.random.split(jax.random.key(seq_len + head_dim), 3)
            q, k, v = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16)
                       for key in keys)
            mask = MaskSpec(seq_q=seq_len, seq_kv=seq_len, is_causal=causal)
            scale = head_dim ** -0.5
            config = forward_fp8.default_config(head_dim)
            entry["config"] = f"{config.block_q}x{config.block_kv}x{config.num_stages}"
            quantize = jax.jit(lambda q, k, v: fp8.quantize_operands(
                q, k, v, block_q=config.block_q, block_kv=config.block_kv))
            kernel = jax.jit(lambda ops: forward_fp8.forward(
                ops, mask=mask, scale=scale, config=config, interpret=False)[0])
            total = jax.jit(lambda q, k, v: fp8.attention_fp8(
                q, k, v, is_causal=causal, config=config, implementation="mosaic"))
            cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"))
            bf16_config = mosaic.default_config(q.shape, k.shape, q.dtype, mask)
            bf16 = jax.jit(lambda q, k, v: mosaic.forward(
                q, k, v, None, mask=mask, scale=scale, config=bf16_config, interpret=False)[0])

            ops = jax.block_until_ready(quantize(q, k, v))
            entry.update(check(q, k, v, kernel(ops), causal=causal, config=config))
            entry["rel_err_fp8_vs_cudnn_bf16"] = rel_err(kernel(ops), cudnn(q, k, v))
            timed = [("quantize", quantize, (q, k, v)), ("cudnn_bf16", cudnn, (q, k, v)),
                     ("mosaic_bf16", bf16, (q, k, v))]
            if entry["ok"]:  # a wrong kernel is not timed
                timed[:0] = [("fp8_kernel", kernel, (ops,)), ("fp8_total", total, (q, k, v))]
        for name, fn, args in timed:
            try:
                with alarm(point_limit):
                    t = seconds_per_call(fn, args, iters, repeats)
                entry[f"{name}_ms"] = t * 1e3
                if name != "quantize":
                    entry[f"{name}_tflops"] = flops / t / 1e12
            except Exception as e:  # keep the other timings of this point
                entry[f"{name}_error"] = f"{type(e).__name__}: {e}"[:1000]
    except Exception as e:
        entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    record(path, entry)


def table() -> str:
    lines = ["point               | fp8 kernel | quant ms | fp8 total | cuDNN bf16 | mosaic bf16 "
             "| kernel/cuDNN | err vs online, ref"]

    def cell(e, name):
        value = e.get(f"{name}_tflops")
        return f"{value:10.0f}" if value else f"{'FAILED' if f'{name}_error' in e else '-':>10}"
    for e in RESULTS:
        if e["kind"] != "bench":
            continue
        point = f"d{e['head_dim']:<3} {'causal' if e['causal'] else 'dense ':6} L{e['seq_len']:<5}"
        if "error" in e and "fp8_kernel_tflops" not in e:
            lines.append(f"{point} | FAILED: {e['error'][:120]}")
            continue
        ratio = (e["fp8_kernel_tflops"] / e["cudnn_bf16_tflops"]
                 if "fp8_kernel_tflops" in e and "cudnn_bf16_tflops" in e else float("nan"))
        quant = e.get("quantize_ms", float("nan"))
        lines.append(f"{point} | {cell(e, 'fp8_kernel')} | {quant:8.2f} | {cell(e, 'fp8_total')}"
                     f" | {cell(e, 'cudnn_bf16')} | {cell(e, 'mosaic_bf16')} | {ratio:12.2f}"
                     f" | {e.get('rel_err_vs_online', float('nan')):.1e}, "
                     f"{e.get('rel_err_vs_reference', float('nan')):.1e}"
                     + ("" if e.get("ok") else " NOT OK"))
    lines.append("TFLOP/s (4·B·H·L²·D, halved causal); quant = fp8.quantize_operands alone; "
                 "bar: d128 L16384 >= 1100, d256 >= 1200")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "fp8_probe.json") if "OUT" in os.environ \
        else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq_len")
    parser.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds after which no new point is started")
    parser.add_argument("--point-limit", type=int, default=120,
                        help="seconds one point (or one timing) may take")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device = jax.devices()[0]
    record(args.out, dict(kind="device", name=device.device_kind, jax=jax.__version__,
                          compute_capability=getattr(device, "compute_capability", None)))
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for head_dim in args.head_dims:
        for seq_len in args.lengths:
            for causal in causals:
                if time.perf_counter() - start > args.time_limit:
                    print(f"time limit: skipping d{head_dim} causal={causal} L{seq_len}",
                          flush=True)
                    continue
                bench(args.out, head_dim, causal, seq_len, iters=args.iters,
                      repeats=args.repeats, point_limit=args.point_limit,
                      tokens=args.tokens, hidden=args.hidden)
    print(f"--- {device.device_kind}, jax {jax.__version__}, "
          f"{time.perf_counter() - start:.0f} s")
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

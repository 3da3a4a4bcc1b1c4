"""GPU probe of the FP8 Mosaic GPU forward: correctness at the benchmark shape, then speed.

Run on an H200/H100 from the repository root::

    PYTHONPATH=. python3 benchmarks/fp8_probe.py --head-dims 128 --lengths 16384

The FlashAttention papers' setup: batch * seq_len = 16384 tokens, heads * head_dim = 2048,
bf16 inputs, TFLOP/s = 4·B·H·L²·D / t (halved when causal). Per point (head_dim, causal,
L):

1. Correctness first: the kernel's output on the first two heads of the first sequence
   against ``fp8.attention_fp8_online`` (the kernel's arithmetic in XLA; relative error
   < 1e-2) and ``fp8.attention_fp8_reference`` (< 3e-2). Quantization is per head, so the
   slice sees exactly the kernel's scales. A point that fails is not timed.
2. Times (median of ``--repeats`` batches of ``--iters`` back-to-back calls): the FP8
   kernel alone on pre-quantized operands and the whole ``attention_fp8`` (on the GPU its
   quantization is the fused Triton kernel; with XLA's quantization instead, the whole
   call is timed as ``fp8_total_xla``); with the first config of a point also the
   quantization alone (``fp8.quantize_operands``: scales, e4m3 rounding, Vᵀ) by the fused
   kernel (``implementation="triton"``) and by XLA (``implementation="xla"``), XLA's
   quantization of V with and without the transpose (the cost of the Vᵀ layout) — these
   four each as :data:`QUANTIZE_COPIES` calls in one program, divided — cuDNN bf16
   (``jax.nn.dot_product_attention(implementation="cudnn")``) and our bf16 Mosaic forward.
   ``--configs 128=64x128x2,64x128x3`` times several FP8 configs.

Every point runs under ``try``, with an alarm of ``--point-limit`` seconds (it interrupts
Python code, not a kernel that never returns), and no new point starts after
``--time-limit`` seconds. Results go to ``--out`` (default ``$OUT/fp8_probe.json`` when
``$OUT`` is set) after every measurement. The last lines printed are a table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.mosaic_probe import parse_configs, seconds_per_call, short
from pallas_flash import fp8, mosaic
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, forward_fp8

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
    errors["ok"] = errors["rel_err_vs_online"] < 1e-2 and errors["rel_err_vs_reference"] < 3e-2
    return errors


def bench(path, head_dim: int, causal: bool, seq_len: int, *, config: MosaicConfig | None,
          baselines: bool, iters: int, repeats: int, point_limit: int, tokens: int = 16384,
          hidden: int = 2048) -> None:
    """One point with one FP8 config (None: the default); ``baselines`` also times the
    quantization, V's transpose, cuDNN bf16 and the bf16 Mosaic forward."""
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
            config = config or forward_fp8.default_config(head_dim, is_causal=causal,
                                                              seq_kv=seq_len)
            entry["config"] = short(config)
            quantize, quantize_xla = (jax.jit(functools.partial(
                fp8.quantize_operands, block_q=config.block_q, block_kv=config.block_kv,
                implementation=name)) for name in ("triton", "xla"))
            kernel = jax.jit(lambda ops: forward_fp8.forward(
                ops, mask=mask, scale=scale, config=config, interpret=False)[0])
            total = jax.jit(lambda q, k, v: fp8.attention_fp8(
                q, k, v, is_causal=causal, config=config, implementation="mosaic"))
            # The kernel's operands from XLA: a quantization kernel that fails to build
            # costs its own timings, not the point (the fused one's bytes differ from
            # XLA's by at most one e4m3 step, at rounding ties).
            ops = jax.block_until_ready(quantize_xla(q, k, v))
            entry.update(check(q, k, v, kernel(ops), causal=causal, config=config))
            timed = []
            if entry["ok"]:  # a wrong kernel is not timed
                timed += [("fp8_kernel", kernel, (ops,)), ("fp8_total", total, (q, k, v)),
                          ("fp8_total_xla", jax.jit(lambda q, k, v: kernel(quantize_xla(q, k, v))),
                           (q, k, v))]
            if baselines:
                cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn"))
                entry["rel_err_fp8_vs_cudnn_bf16"] = rel_err(kernel(ops), cudnn(q, k, v))
                bf16_config = mosaic.default_config(q.shape, k.shape, q.dtype, mask)
                bf16 = jax.jit(lambda q, k, v: mosaic.forward(
                    q, k, v, None, mask=mask, scale=scale, config=bf16_config,
                    interpret=False)[0])
                # V's share of the quantization, with and without the transpose to Vᵀ.
                def quantize_v(v, transpose: bool):
                    v8, v_scale = fp8.quantize(v, config.block_kv)
                    return (jnp.transpose(v8, (0, 2, 3, 1)) if transpose else v8), v_scale
                v_only = jax.jit(functools.partial(quantize_v, transpose=False))
                v_transposed = jax.jit(functools.partial(quantize_v, transpose=True))
                timed += [("quantize", *_batched(quantize, (q, k, v))),
                          ("quantize_xla", *_batched(quantize_xla, (q, k, v))),
                          ("quantize_v", *_batched(v_only, (v,))),
                          ("quantize_v_transposed", *_batched(v_transposed, (v,))),
                          ("cudnn_bf16", cudnn, (q, k, v)), ("mosaic_bf16", bf16, (q, k, v))]
        for name, fn, args in timed:
            try:
                with alarm(point_limit):
                    t = seconds_per_call(fn, args, iters, repeats)
                    if name.startswith("quantize"):
                        t /= QUANTIZE_COPIES
                entry[f"{name}_ms"] = t * 1e3
                if not name.startswith("quantize"):
                    entry[f"{name}_tflops"] = flops / t / 1e12
            except Exception as e:  # keep the other timings of this point
                entry[f"{name}_error"] = f"{type(e).__name__}: {e}"[:1000]
    except Exception as e:
        entry.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    record(path, entry)


#: Quantizations per timed call: one alone lasts tens of microseconds, about what the host
#: takes to dispatch a call, so separate calls time the dispatch (on the H200, 2026-12-02:
#: 0.17-0.23 ms for either quantization; ``x * 2`` over the same three tensors, 0.15 ms).
QUANTIZE_COPIES = 8


def _batched(fn, args: tuple) -> tuple:
    """``(jitted, its args)`` running ``fn`` on :data:`QUANTIZE_COPIES` copies of ``args``
    in one program. The copies are separate buffers, so XLA cannot merge the calls, and
    every output is returned, so none is cut to what a slice would need."""
    copies = tuple(jnp.array(x, copy=True) for _ in range(QUANTIZE_COPIES) for x in args)
    n = len(args)
    return jax.jit(lambda *xs: [fn(*xs[i:i + n]) for i in range(0, len(xs), n)]), copies


def table() -> str:
    """One row per (point, FP8 config): TFLOP/s, quantization ms, errors; cuDNN per point."""
    benches = [e for e in RESULTS if e["kind"] == "bench"]
    cudnn = {(e["head_dim"], e["causal"], e["seq_len"]): e["cudnn_bf16_tflops"]
             for e in benches if "cudnn_bf16_tflops" in e}
    nan = float("nan")
    lines = ["point             config | fp8 kernel  fp8 total | cuDNN  mosaic bf16 | "
             "kernel/cuDNN | quant ms fused, xla (xla V, V+transpose) | err vs online, ref"]
    for e in benches:
        point = (f"d{e['head_dim']:<3} {'causal' if e['causal'] else 'dense ':6} "
                 f"L{e['seq_len']:<5} {e.get('config', '?'):>6}")
        if "error" in e:
            lines.append(f"{point} | FAILED: {e['error'][:150]}")
            continue
        base = cudnn.get((e["head_dim"], e["causal"], e["seq_len"]), nan)
        kernel = e.get("fp8_kernel_tflops", nan)
        quant = (f"{e.get('quantize_ms', nan):6.3f}, {e.get('quantize_xla_ms', nan):6.3f} "
                 f"({e.get('quantize_v_ms', nan):.3f}, "
                 f"{e.get('quantize_v_transposed_ms', nan):.3f})")
        lines.append(
            f"{point} | {kernel:10.0f} {e.get('fp8_total_tflops', nan):10.0f} | {base:5.0f} "
            f"{e.get('mosaic_bf16_tflops', nan):12.0f} | {kernel / base:12.2f} | {quant:>40} | "
            f"{e.get('rel_err_vs_online', nan):.1e}, {e.get('rel_err_vs_reference', nan):.1e}"
            + ("" if e.get("ok") else "  NOT OK (not timed)"))
        lines += [f"    {key}: {value[:150]}" for key, value in e.items()
                  if key.endswith("_error")]
    lines.append("TFLOP/s = 4·B·H·L²·D / t (halved causal); quant = fp8.quantize_operands (Q, K, "
                 "V: fused Triton kernel, XLA); bar: d128 L16384 >= 1100, d256 >= 1200")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = os.path.join(os.environ["OUT"], "fp8_probe.json") if "OUT" in os.environ \
        else None
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128, 256])
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--configs", action="append", default=[],
                        help="HEAD_DIM=SPEC,...: FP8 configs to time, e.g. 128=64x128x2,64x128x3 "
                             "(block_q x block_kv x num_stages); baselines with the first")
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
    chosen = parse_configs(args.configs)
    for head_dim in args.head_dims:
        for seq_len in args.lengths:
            for causal in causals:
                for i, config in enumerate(chosen.get(head_dim, [None])):
                    if time.perf_counter() - start > args.time_limit:
                        print(f"time limit: skipping d{head_dim} causal={causal} L{seq_len}",
                              flush=True)
                        continue
                    bench(args.out, head_dim, causal, seq_len, config=config, baselines=i == 0,
                          iters=args.iters, repeats=args.repeats, point_limit=args.point_limit,
                          tokens=args.tokens, hidden=args.hidden)
    print(f"--- {device.device_kind}, jax {jax.__version__}, "
          f"{time.perf_counter() - start:.0f} s")
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

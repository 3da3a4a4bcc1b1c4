"""GPU probe of the Mosaic GPU forward: correctness at real sizes, then speed vs cuDNN.

Run on an H200/H100 from the repository root::

    PYTHONPATH=. python3 benchmarks/mosaic_probe.py --out results.json [--sweep]

1. Correctness: ``pallas_flash.mosaic.forward`` against ``reference.standard_attention``
   on float32 copies of the inputs, at a few real sizes per shape class (head_dim
   64/128/256, causal or not, bf16/fp16, GQA, odd lengths, windows), plus one call through
   ``pallas_flash.attention(implementation="mosaic")``.
2. Speed: the FlashAttention papers' setup (batch * seq_len = 16384, heads = 2048 /
   head_dim, bf16), TFLOP/s = 4·B·H·L²·D / t (halved when causal), for our forward and
   ``jax.nn.dot_product_attention(implementation="cudnn")`` in the same process. t is the
   median over ``--repeats`` batches of ``--iters`` back-to-back calls after warm-up.
3. ``--sweep``: the same timing for a few block configs per (head_dim, causal), at
   ``--sweep-len``. ``--configs 128=64x128x2,64x128x2o`` instead times exactly these
   configs (``block_q x block_kv x num_stages``, ``o`` = ``overlap=True``) at every length.
   ``--check-with 128=64x128x2o`` replaces step 1 by the odd-shape checks (masks, GQA,
   padding, empty rows) run with the given configs.

Before a config is timed, its output at the benchmark shape is compared with cuDNN's
(relative error < 1e-2, no NaN); a config that fails is not timed. ``--time-limit`` stops
starting new benchmark points after that many seconds. The last lines printed are a table
of TFLOP/s and ratios to cuDNN.

``--compile-only`` just compiles (the default configs, or ``--configs``) for head_dim
64/128/256, causal: run it with ``MOSAIC_GPU_DUMP_PTXAS=1`` (and ``MOSAIC_GPU_DUMP_TO=dir``)
to read ptxas' register and spill counts.

Every result is appended to the JSON file as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash
from pallas_flash import reference
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, default_config, forward
from pallas_flash.mosaic.config import padded_head_dim

RESULTS: list[dict] = []


def record(path: str, entry: dict) -> None:
    RESULTS.append(entry)
    print(json.dumps(entry), flush=True)
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)


def inputs(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_kv, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_kv, kv_heads, head_dim), dtype)
    return q, k, v


def mosaic_fn(mask: MaskSpec, scale: float, config: MosaicConfig):
    return jax.jit(lambda q, k, v: forward(q, k, v, None, mask=mask, scale=scale,
                                           config=config, interpret=False))


def check(path, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, *, causal=False,
          window=None, alignment="top_left", config=None):
    case = dict(kind="check", shape=[batch, seq_q, seq_kv, heads, kv_heads, head_dim],
                dtype=jnp.dtype(dtype).name, causal=causal, window=window,
                alignment=alignment)
    try:
        mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=causal, window=window,
                        causal_alignment=alignment)
        q, k, v = inputs(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
        config = config or default_config(q.shape, k.shape, dtype, mask)
        scale = head_dim ** -0.5
        out, lse = mosaic_fn(mask, scale, config)(q, k, v)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref_out, ref_lse = reference.standard_attention(*f32, scale=scale, mask=mask)
        out = np.asarray(out, np.float64)
        ref_out, ref_lse, lse = (np.asarray(x, np.float64) for x in (ref_out, ref_lse, lse))
        seen = ref_lse > reference.EMPTY_ROW_LSE / 2
        case.update(
            config=short(config),
            rel_err=float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)),
            lse_max_err=float(np.abs(lse - ref_lse)[seen].max(initial=0.0)),
            # The kernel writes EMPTY_ROW_LSE as a float32 (-1e30 is not exact in float32).
            empty_rows_ok=bool(np.all(lse[~seen] == np.float32(reference.EMPTY_ROW_LSE))
                               and np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)),
            nan=bool(np.isnan(out).any() or np.isnan(lse).any()))
        case["ok"] = (case["rel_err"] < 1e-2 and case["lse_max_err"] < 1e-2
                      and case["empty_rows_ok"] and not case["nan"])
    except Exception as e:  # keep probing the other cases
        case.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    record(path, case)


def check_api(path):
    case = dict(kind="check_api")
    try:
        q, k, v = inputs(2, 1024, 1024, 16, 4, 128, jnp.bfloat16, seed=1)
        out = jax.jit(lambda q, k, v: pallas_flash.attention(
            q, k, v, is_causal=True, implementation="mosaic"))(q, k, v)
        ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        diff = np.asarray(out, np.float64) - np.asarray(ref, np.float64)
        case["rel_err_vs_cudnn"] = float(np.linalg.norm(diff)
                                         / np.linalg.norm(np.asarray(ref, np.float64)))
        case["ok"] = case["rel_err_vs_cudnn"] < 1e-2
    except Exception as e:
        case.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        traceback.print_exc()
    record(path, case)


def parse_config(spec: str) -> MosaicConfig:
    """``"64x128x2o"`` -> MosaicConfig(64, 128, 2, overlap=True); a ``c3`` suffix
    (``"64x128x2oc3"``) asks for three consumer warpgroups, a final ``p``
    (``"128x128x2p"``, ``"64x128x2oc3p"``) for persistent CTAs."""
    persistent = spec.endswith("p")
    spec, _, consumers = spec.removesuffix("p").partition("c")
    overlap = spec.endswith("o")
    block_q, block_kv, stages = (int(x) for x in spec.rstrip("o").split("x"))
    return MosaicConfig(block_q, block_kv, stages, overlap=overlap,
                        num_consumers=int(consumers or 2), persistent=persistent)


def parse_configs(items: list[str]) -> dict[int, list[MosaicConfig]]:
    """``["128=64x128x2,64x128x2o", ...]`` -> {128: [config, config], ...}."""
    configs = {}
    for item in items:
        dim, specs = item.split("=")
        configs[int(dim)] = [parse_config(x) for x in specs.split(",")]
    return configs


def short(config: MosaicConfig) -> str:
    return (f"{config.block_q}x{config.block_kv}x{config.num_stages}"
            + ("o" if config.overlap else "")
            + (f"c{config.num_consumers}" if config.num_consumers != 2 else "")
            + ("p" if config.persistent else ""))


def seconds_per_call(fn, args, iters: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            result = fn(*args)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def bench(path, seq_len, head_dim, causal, *, iters, repeats, configs=(None,), cudnn=True):
    batch, heads = 16384 // seq_len, 2048 // head_dim
    flops = 4 * batch * heads * seq_len**2 * head_dim / (2 if causal else 1)
    q, k, v = inputs(batch, seq_len, seq_len, heads, heads, head_dim, jnp.bfloat16)
    mask = MaskSpec(seq_q=seq_len, seq_kv=seq_len, is_causal=causal)
    base = dict(kind="bench", seq_len=seq_len, head_dim=head_dim, causal=causal,
                batch=batch, heads=heads)
    cudnn_fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    reference_out = cudnn_fn(q, k, v)
    timings = [("cudnn", None, cudnn_fn)] if cudnn else []
    for config in configs:
        config = config or default_config(q.shape, k.shape, q.dtype, mask)
        timings.append(("mosaic", config, mosaic_fn(mask, head_dim ** -0.5, config)))
    for name, config, fn in timings:
        entry = dict(base, impl=name, config=None if config is None else short(config))
        try:
            if config is not None:  # correctness at the benchmark shape first
                out = fn(q, k, v)[0]
                entry["rel_err_vs_cudnn"] = rel_err(out, reference_out)
                if not entry["rel_err_vs_cudnn"] < 1e-2:  # NaN fails too
                    raise ValueError(f"wrong output: rel_err {entry['rel_err_vs_cudnn']}")
            t = seconds_per_call(fn, (q, k, v), iters, repeats)
            entry.update(ms=t * 1e3, tflops=flops / t / 1e12)
        except Exception as e:
            entry.update(error=f"{type(e).__name__}: {e}"[:1500])
        record(path, entry)


def table() -> str:
    """TFLOP/s per benchmark point: cuDNN, then each config with its ratio to cuDNN."""
    lines = []
    points: dict[tuple, dict[str, dict]] = {}
    for e in RESULTS:
        if e["kind"] == "bench":
            key = (e["head_dim"], e["causal"], e["seq_len"])
            points.setdefault(key, {})[e["config"] or "cudnn"] = e
    for (d, causal, seq_len), row in sorted(points.items()):
        cudnn = row.get("cudnn", {}).get("tflops")
        cells = [f"d{d:<3} {'causal' if causal else 'dense ':6} L{seq_len:<5} cudnn "
                 + (f"{cudnn:5.0f}" if cudnn else "  n/a")]
        for name, e in row.items():
            if name == "cudnn":
                continue
            if "tflops" in e:
                ratio = f" {e['tflops'] / cudnn:.3f}x" if cudnn else ""
                cells.append(f"{name} {e['tflops']:5.0f}{ratio}")
            else:
                cells.append(f"{name} FAILED")
        lines.append(" | ".join(cells))
    failed = [e for e in RESULTS if e["kind"].startswith("check") and not e.get("ok")]
    lines.append(f"checks: {sum(e['kind'].startswith('check') for e in RESULTS)} run, "
                 f"{len(failed)} failed"
                 + "".join(f"\n  FAILED {e}" for e in failed))
    return "\n".join(lines)


SWEEP = {
    64: [MosaicConfig(64, 128, 2), MosaicConfig(64, 256, 2), MosaicConfig(64, 128, 3)],
    128: [MosaicConfig(64, 128, 2), MosaicConfig(64, 128, 3)],
    256: [MosaicConfig(64, 64, 2)],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mosaic_probe.json")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sweep", action="store_true", help="time several block configs")
    parser.add_argument("--sweep-len", type=int, default=4096, help="seq_len of the sweep")
    parser.add_argument("--configs", action="append", default=[],
                        help="HEAD_DIM=SPEC,SPEC,...: time these configs (e.g. 128=64x128x2o)")
    parser.add_argument("--check-with", action="append", default=[],
                        help="HEAD_DIM=SPEC,...: run only the odd-shape checks, with these")
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128, 64, 256])
    parser.add_argument("--lengths", type=int, nargs="*",
                        help="seq_len to time (default: 1024/4096/16384 at d128, else 4096/16384)")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds after which no new benchmark point is started")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    chosen = parse_configs(args.configs)
    if args.compile_only:
        for d in args.head_dims:
            q, k, v = inputs(1, 1024, 1024, 2, 2, d, jnp.bfloat16)
            mask = MaskSpec(seq_q=1024, seq_kv=1024, is_causal=True)
            for config in chosen.get(d, [default_config(q.shape, k.shape, q.dtype, mask)]):
                print(f"head_dim={d} {config}", flush=True)
                jax.block_until_ready(mosaic_fn(mask, d ** -0.5, config)(q, k, v))
        return 0
    device = jax.devices()[0]
    record(args.out, dict(kind="device", name=device.device_kind,
                          compute_capability=getattr(device, "compute_capability", None),
                          jax=jax.__version__))

    bf16, f16 = jnp.bfloat16, jnp.float16
    odd = [
        ((1, 1000, 1500, 16, 4, 128, bf16), dict(causal=True, alignment="bottom_right")),
        ((3, 777, 777, 4, 1, 96, f16), {}),
        ((1, 4096, 4096, 4, 2, 64, bf16), dict(window=(512, 128))),
        ((1, 1024, 200, 2, 2, 128, bf16), dict(window=(16, 16))),  # rows that see nothing
        ((1, 2048, 2048, 4, 4, 256, f16), dict(causal=True)),
        ((2, 2048, 2048, 8, 8, 128, bf16), dict(causal=True)),
    ]
    if args.check_with:
        check_with = parse_configs(args.check_with)
        for shape, kwargs in odd:
            for config in check_with.get(padded_head_dim(shape[5]), []):
                check(args.out, *shape, **kwargs, config=config)
    elif not args.skip_checks:
        for d in (64, 128, 256):
            for causal in (False, True):
                check(args.out, 2, 2048, 2048, 8, 8, d, bf16, causal=causal)
        check(args.out, 2, 2048, 2048, 8, 8, 128, f16, causal=True)
        for shape, kwargs in odd:
            check(args.out, *shape, **kwargs)
        check_api(args.out)

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    lengths = {128: (1024, 4096, 16384), 64: (4096, 16384), 256: (4096, 16384)}
    for d in args.head_dims:
        for causal in causals:
            for seq_len in args.lengths or lengths.get(d, (4096, 16384)):
                if time.perf_counter() - start > args.time_limit:
                    print(f"time limit: skipping d{d} causal={causal} L{seq_len}", flush=True)
                    continue
                if d in chosen:
                    configs = chosen[d]
                else:
                    sweep = args.sweep and seq_len == args.sweep_len
                    configs = SWEEP[d] if sweep else (None,)
                bench(args.out, seq_len, d, causal, iters=args.iters, repeats=args.repeats,
                      configs=configs)
    print(f"--- {device.device_kind}, jax {jax.__version__}, bf16, TFLOP/s "
          f"({time.perf_counter() - start:.0f} s)")
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

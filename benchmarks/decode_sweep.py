"""Decode tiles and split counts, swept side by side with cuDNN (GB/s of K/V read).

    PYTHONUNBUFFERED=1 python3 -m benchmarks.decode_sweep --out $OUT [--ragged]

Each point ``BxS@D`` (32 query / 8 kv heads, one new token, bf16) times, in interleaved
rounds of one process: cuDNN through ``jax.nn``, ``decode_attention`` on Mosaic with its
default config, and on Triton with each ``--tiles`` entry ``block_kv:stages:warps`` (16
query rows) times each ``--split-factors`` multiple of the split heuristic. This is the
sweep behind the Triton decode tile (``pallas_flash.triton.config.DECODE_ROWS``) and the
split heuristic; ``benchmarks.decode`` measures the package's defaults against every anchor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks.decode import jax_nn, kv_gbps, parse_point
from benchmarks.timing import time_fn
from pallas_flash.decode import default_num_splits
from pallas_flash.triton import TritonConfig


def _calls(q, k, v, lengths, tiles: list[str], factors: list[int]) -> dict:
    calls = {"cudnn": jax.jit(jax_nn("cudnn", lengths))}
    base = default_num_splits(k.shape[0], k.shape[2], k.shape[1])

    def decode(implementation, config, num_splits):
        return jax.jit(lambda q, k, v: pf.decode_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=implementation,
            config=config, num_splits=num_splits))

    calls["mosaic"] = decode("mosaic", None, None)
    for tile in tiles:
        block_kv, stages, warps = (int(x) for x in tile.split(":"))
        config = TritonConfig(block_q=16, block_kv=block_kv, num_stages=stages, num_warps=warps)
        for factor in factors:
            if k.shape[1] % (base * factor) == 0:
                calls[f"triton {tile} x{factor}"] = decode("triton", config, base * factor)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="32x8192@64,32x8192@128,8x32768@128,"
                        "1x131072@128,32x8192@256")
    parser.add_argument("--tiles", default="64:3:4,64:4:4,128:3:4,64:4:8",
                        help="Triton decode tiles block_kv:stages:warps")
    parser.add_argument("--split-factors", default="1,2", help="multiples of the heuristic")
    parser.add_argument("--ragged", action="store_true", help="lengths uniform in [1, S]")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rows = []
    for point in args.points.split(","):
        batch, seq_kv, head_dim = parse_point(point)
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (batch, 1, 32, head_dim), jnp.bfloat16)
        k, v = (jax.random.normal(key, (batch, seq_kv, 8, head_dim), jnp.bfloat16)
                for key in keys[1:])
        lengths = None
        if args.ragged:
            lengths = jnp.asarray(np.random.default_rng(0).integers(1, seq_kv + 1, batch),
                                  jnp.int32)
        cached = batch * seq_kv if lengths is None else int(jnp.sum(lengths))
        calls = _calls(q, k, v, lengths, args.tiles.split(","),
                       [int(f) for f in args.split_factors.split(",")])
        samples = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                samples[name].append(time_fn(fn, [(q, k, v)], iters=10, warmup=1,
                                             max_seconds=0.4).median_ms)
        for name, ms in samples.items():
            row = dict(point=point, ragged=args.ragged, impl=name, ms=statistics.median(ms),
                       gbps=kv_gbps(cached, 8, head_dim, 2, statistics.median(ms)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = f"decode-sweep{'-ragged' if args.ragged else ''}-{datetime.date.today()}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

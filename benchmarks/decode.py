"""Decode bandwidth: one new token (or a few) against a KV cache, in GB/s of K/V read.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.decode --out $OUT [--ragged | --fill F]

GB/s = ``2 · (cached tokens) · kv_heads · head_dim · itemsize / time``: the K and V bytes a
decode step must read (the cached tokens are ``batch · seq_kv``, or the sum of the ragged
lengths). ``--ragged`` draws each row's length uniformly in ``[seq_q, S]``; ``--fill F``
gives every row ``round(F · S)`` tokens (a cache filled up to the step's index, as in
:class:`pallas_flash.nn.FlashSelfAttention`'s decode, which passes that one length as a
scalar; the anchors take it per row). Points ``BxS@D``: batch × cache length at head_dim
D, 32 query heads / 8 kv heads, bf16 on GPU. Every implementation of a point is timed in
each of ``--rounds`` interleaved rounds (same process, same inputs) with the package's
timer; the table shows each one's median over rounds.

Implementations (``--impls``):

* ``pallas_flash``: :func:`pallas_flash.decode_attention` (GQA packing + split-KV);
* ``paged64``, ``paged128``: :func:`pallas_flash.paged_attention` on pools whose pages are
  scattered at random (page size 64 / 128);
* ``cudnn``, ``xla``: ``jax.nn.dot_product_attention(implementation=...)``;
* ``fa3``: ``flash_attn3_jax.flash_mha_with_kvcache`` when importable (head_dim 128);
* ``read_triton``, ``read_tma``: the read floors of :mod:`benchmarks.read_floor`, kernels
  that only read the cache in the decode's grid (its split count for a full cache), through
  Pallas-Triton loads or through a TMA ring (full caches only; their output is no attention
  and is not compared).

``--implementation`` is passed to the pallas_flash calls (None: the package's choice).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import read_floor, report
from benchmarks.timing import time_fn
from pallas_flash.decode import default_num_splits

DEFAULT_POINTS = "32x8192@128,8x32768@128,1x131072@128,32x8192@64,32x8192@256"
DEFAULT_IMPLS = "pallas_flash,paged64,paged128,cudnn,xla,fa3"
#: What the table's ratios compare against: the anchors, and the contiguous read (for the
#: paged rows).
RATIO_BASES = ("cudnn", "fa3", "pallas_flash", "read_triton", "read_tma")
READ_FLOORS = ("read_triton", "read_tma")


def parse_point(text: str) -> tuple[int, int, int]:
    """``"BxS@D"`` -> ``(batch, seq_kv, head_dim)``."""
    try:
        sizes, head_dim = text.split("@")
        batch, seq_kv = sizes.split("x")
        point = int(batch), int(seq_kv), int(head_dim)
    except ValueError:
        raise ValueError(f"a point must look like 32x8192@128, got {text!r}") from None
    if min(point) < 1:
        raise ValueError(f"a point's sizes must be positive, got {text!r}")
    return point


def kv_gbps(cached_tokens: int, kv_heads: int, head_dim: int, itemsize: int, ms: float
            ) -> float:
    """GB/s (1e9 bytes) of K and V read: ``2 · tokens · kv_heads · head_dim · itemsize``."""
    return 2.0 * cached_tokens * kv_heads * head_dim * itemsize / (ms * 1e-3) / 1e9


def scattered_pools(key: jax.Array, value: jax.Array, page_size: int, seed: int):
    """Contiguous caches ``[B, S, K, D]`` -> (key_pages, value_pages, page_table) holding the
    same tokens in pages placed at random in the pools."""
    batch, seq_kv = key.shape[:2]
    if seq_kv % page_size:
        raise ValueError(f"seq_kv {seq_kv} must be a multiple of page_size {page_size}")
    num_pages = batch * seq_kv // page_size
    order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
    table = jnp.asarray(order.reshape(batch, seq_kv // page_size))

    def pool(x):
        pages = x.reshape(num_pages, page_size, *x.shape[2:])
        return jnp.zeros_like(pages).at[order].set(pages)

    return pool(key), pool(value), table


def jax_nn(implementation: str, lengths) -> Callable:
    """``jax.nn.dot_product_attention`` on a decode step (per-row cache ``lengths`` or
    None), as ``(q, k, v) -> out``."""
    def call(q, k, v):
        extra = {}
        if lengths is not None:
            extra = dict(query_seq_lengths=jnp.ones_like(lengths),
                         key_value_seq_lengths=lengths)
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **extra)
    return call


def _fa3(lengths, num_splits: int) -> Callable:
    from flash_attn3_jax import flash_mha_with_kvcache  # optional: a cp312 wheel, GPU only

    def call(q, k, v):
        seqlens = lengths if lengths is not None else jnp.full((q.shape[0],), k.shape[1],
                                                               jnp.int32)
        return flash_mha_with_kvcache(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)
    return call


def _read_floor(name: str, shape: tuple[int, ...]) -> Callable:
    splits = default_num_splits(shape[0], shape[2], shape[1])
    chunk = shape[1] // splits
    # Tiles of at most 128 keys and 32 KiB of bf16 (two stages of K and V fit in SMEM).
    block_kv = next(b for b in (128, 64, 32, 16, 8, 1)
                    if chunk % b == 0 and b * shape[3] <= 16384)
    reader = read_floor.triton_reader if name == "read_triton" else read_floor.tma_reader
    return reader(shape, splits, block_kv=block_kv, interpret=jax.default_backend() == "cpu")


def make_calls(impls: list[str], q, k, v, lengths, implementation: str | None,
               seed: int, *, uniform: bool = False) -> dict[str, tuple[Callable, tuple] | str]:
    """name -> (jitted fn, its args), or a sentence saying why it cannot run here.

    ``uniform``: every row of ``lengths`` is equal, and ``pallas_flash`` gets it as the
    scalar its decode takes for a cache filled up to one index."""
    full = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
    cache_lengths = full if lengths is None else lengths
    own_lengths = lengths[0] if uniform and lengths is not None else lengths
    calls: dict[str, tuple[Callable, tuple] | str] = {}
    for name in impls:
        try:
            if name == "pallas_flash":
                fn = jax.jit(lambda q, k, v: pf.decode_attention(
                    q, k, v, key_value_seq_lengths=own_lengths,
                    implementation=implementation))
                calls[name] = (fn, (q, k, v))
            elif name.startswith("paged"):
                pools = scattered_pools(k, v, int(name.removeprefix("paged")), seed)
                fn = jax.jit(lambda q, kp, vp, table: pf.paged_attention(
                    q, kp, vp, table, cache_lengths, implementation=implementation))
                calls[name] = (fn, (q, *pools))
            elif name in ("cudnn", "xla"):
                calls[name] = (jax.jit(jax_nn(name, lengths)), (q, k, v))
            elif name == "fa3":
                if q.shape[-1] != 128:
                    calls[name] = "FA3's kv-cache kernel is benchmarked at head_dim 128 only"
                    continue
                splits = default_num_splits(k.shape[0], k.shape[2], k.shape[1])
                calls[name] = (jax.jit(_fa3(lengths, splits)), (q, k, v))
            elif name in READ_FLOORS:
                if lengths is not None:
                    calls[name] = "the read floors read a full cache"
                    continue
                calls[name] = (_read_floor(name, k.shape), (q, k, v))
            else:
                raise ValueError(f"unknown implementation {name!r}; choose from "
                                 f"{DEFAULT_IMPLS}")
        except ImportError as e:
            calls[name] = f"not importable: {e}"
    return calls


def run_point(point: tuple[int, int, int], args) -> list[dict]:
    """Every implementation at one point, timed in interleaved rounds."""
    batch, seq_kv, head_dim = point
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    q = jax.random.normal(keys[0], (batch, args.seq_q, args.heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_kv, args.kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_kv, args.kv_heads, head_dim), dtype)
    lengths = None
    if args.ragged:  # uniform in [seq_q, S]: every query token has its own key
        rng = np.random.default_rng(args.seed)
        lengths = jnp.asarray(rng.integers(args.seq_q, seq_kv + 1, batch), jnp.int32)
    elif args.fill is not None:
        lengths = jnp.full((batch,), max(args.seq_q, round(args.fill * seq_kv)), jnp.int32)
    cached = batch * seq_kv if lengths is None else int(jnp.sum(lengths))
    calls = make_calls(args.impls.split(","), q, k, v, lengths, args.implementation,
                       args.seed, uniform=args.fill is not None)
    base = dict(batch=batch, seq_kv=seq_kv, head_dim=head_dim, heads=args.heads,
                kv_heads=args.kv_heads, seq_q=args.seq_q, ragged=args.ragged, fill=args.fill,
                cached_tokens=cached, dtype=dtype.name, implementation=args.implementation)
    rows = {name: dict(base, impl=name) for name in calls}
    reference = None
    for name, call in calls.items():  # compile, and compare with the first that runs
        if isinstance(call, str):
            rows[name]["error"] = call
            continue
        try:
            out = np.asarray(jax.block_until_ready(call[0](*call[1])), np.float32)
        except Exception as e:  # a failing implementation is a row, not a crash
            rows[name]["error"] = str(e).splitlines()[0][:160]
            continue
        if name in READ_FLOORS:
            continue
        if reference is None:
            reference = (name, out)
        rows[name]["max_abs_diff"] = float(np.max(np.abs(out - reference[1])))
        rows[name]["diff_vs"] = reference[0]
    runnable = [n for n, c in calls.items() if not isinstance(c, str) and "error" not in rows[n]]
    samples: dict[str, list[float]] = {n: [] for n in runnable}
    for _ in range(args.rounds):
        for name in runnable:
            fn, fn_args = calls[name]
            samples[name].append(time_fn(fn, [fn_args], iters=args.iters, warmup=1,
                                         max_seconds=args.max_seconds).median_ms)
    for name in runnable:
        ms = statistics.median(samples[name])
        rows[name].update(ms=ms, round_ms=samples[name],
                          gbps=kv_gbps(cached, args.kv_heads, head_dim, dtype.itemsize, ms))
        # Paired ratios: the card drifts by several percent between runs, much less within
        # one round, so the median of per-round ratios is steadier than a ratio of medians.
        for base in RATIO_BASES:
            if base != name and base in samples:
                rows[name][f"vs_{base}"] = statistics.median(
                    b / x for b, x in zip(samples[base], samples[name], strict=True))
    return list(rows.values())


def table(header: str, rows: list[dict]) -> str:
    """A markdown table: one line per point, one GB/s column per implementation."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    points = list(dict.fromkeys((r["batch"], r["seq_kv"], r["head_dim"]) for r in rows))
    lines = [f"# Decode: {header}", "",
             "GB/s of K/V read (median over interleaved rounds; — where it did not run).", "",
             "| batch × cache @ head_dim | " + " | ".join(impls) + " |",
             "|---|" + "---:|" * len(impls)]
    by_key = {(r["batch"], r["seq_kv"], r["head_dim"], r["impl"]): r for r in rows}
    for b, s, d in points:
        cells = []
        for impl in impls:
            row = by_key.get((b, s, d, impl), {})
            cells.append(f"{row['gbps']:.0f}" if "gbps" in row else "—")
        lines.append(f"| {b} × {s} @ {d} | " + " | ".join(cells) + " |")
    ours = [impl for impl in impls if impl == "pallas_flash" or impl.startswith("paged")]
    pairs = [(impl, base) for base in RATIO_BASES for impl in ours
             if any(f"vs_{base}" in r for r in rows if r["impl"] == impl)]
    if pairs:
        lines += ["", "Speed ratios (median over rounds of the per-round ratio; above 1: faster "
                  "than the base).", "",
                  "| batch × cache @ head_dim | "
                  + " | ".join(f"{impl} / {base}" for impl, base in pairs) + " |",
                  "|---|" + "---:|" * len(pairs)]
        for b, s, d in points:
            cells = [by_key.get((b, s, d, impl), {}).get(f"vs_{base}") for impl, base in pairs]
            lines.append(f"| {b} × {s} @ {d} | "
                         + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " |")
    lines += report.not_run([f"{r['impl']} at {r['batch']} × {r['seq_kv']} @ {r['head_dim']}: "
                             f"{r['error']}" for r in rows if "error" in r])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default=DEFAULT_POINTS, help="comma list of BxS@D")
    parser.add_argument("--impls", default=DEFAULT_IMPLS)
    parser.add_argument("--implementation", default=None,
                        help="pallas_flash backend (mosaic, triton, xla; default: its choice)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seq-q", type=int, default=1, help="new tokens per sequence")
    parser.add_argument("--ragged", action="store_true",
                        help="cache lengths uniform in [seq_q, S] (seeded)")
    parser.add_argument("--fill", type=float, default=None,
                        help="every row's cache length round(F · S), F in (0, 1]")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.fill is not None and (args.ragged or not 0 < args.fill <= 1):
        parser.error(f"--fill must be in (0, 1] and without --ragged, got {args.fill}")
    lengths = ", ragged" if args.ragged else ""
    if args.fill is not None:
        lengths = f", lengths {args.fill:g} · S"
    points = [parse_point(p) for p in args.points.split(",")]
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{datetime.date.today()}, {args.heads} q heads / {args.kv_heads} kv heads, "
              f"seq_q {args.seq_q}, {args.dtype}{lengths}")
    if args.implementation:
        header += f", pallas_flash on implementation={args.implementation!r}"
    rows: list[dict] = []
    for point in points:
        rows += run_point(point, args)
        for row in rows[-len(args.impls.split(",")):]:
            print(json.dumps(row), flush=True)
        if args.out:  # after every point: a run cut short keeps what it measured
            _write(args.out, header, rows, args)
    print(table(header, rows))
    return 0


def _write(out: str, header: str, rows: list[dict], args) -> None:
    lengths = "-ragged" if args.ragged else ""
    if args.fill is not None:
        lengths = f"-fill{args.fill:g}"
    stem = report.file_stem(f"decode{lengths}", jax.devices()[0].device_kind,
                            datetime.date.today().isoformat())
    report.write_rows(out, stem, header, jax.__version__, rows, table(header, rows))


if __name__ == "__main__":
    raise SystemExit(main())

"""Accuracy of masked bf16 attention, per backend, against a float64 oracle.

    python -m benchmarks.masked_accuracy --out benchmarks/results      # GPU (Mosaic, Triton)

Counts the output elements that miss ``|out - ref| <= atol + rtol·|ref|`` (the bar of
issue 26, item 5: atol 4.5e-3, rtol 4.5e-4) for boolean masks, windows, causal
cross-attention and a position-index mask. It also splits the error by how many keys a row
sees, and compares each backend with two emulations of its arithmetic in float64: P (from
the final row max) rounded to bf16 before P·V, with the row sum l of the rounded or of the
unrounded P — the error that rounding P leaves is largest in rows that see few keys —
and counts how many bf16 steps each element lies from the correctly rounded output (the
bf16 output alone misses the bar where a row sees a few large values).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf

ATOL, RTOL = 4.5e-3, 4.5e-4


def _cases(seq: int, rng: np.random.Generator) -> dict[str, dict]:
    positions = rng.permutation(seq)
    return {
        "bool-mask": dict(seq_kv=seq, mask=rng.random((1, 1, seq, seq)) < 0.7),
        "window-64": dict(seq_kv=seq, local_window_size=64),
        "causal-window-64": dict(seq_kv=seq, is_causal=True, local_window_size=(64, 0)),
        "cross-causal": dict(seq_kv=2 * seq, is_causal=True),
        "position-mask": dict(seq_kv=seq,
                              mask=(positions[:, None] >= positions[None, :])[None, None]),
        "causal": dict(seq_kv=seq, is_causal=True),
    }


def _visible(q_len: int, kv_len: int, case: dict) -> np.ndarray:
    """[T, S] bool: the pairs the call shows."""
    vis = np.ones((q_len, kv_len), bool)
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    if case.get("is_causal"):
        vis &= j <= i
    window = case.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (j >= i - left) & (j <= i + right)
    if case.get("mask") is not None:
        vis &= case["mask"][0, 0]
    return vis


def _oracles(q, k, v, vis: np.ndarray) -> dict[str, np.ndarray]:
    """float64 outputs [B, T, N, D]: exact, and with P rounded to bf16 before P·V."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    p_bf16 = np.asarray(jnp.asarray(p, jnp.float32).astype(jnp.bfloat16), np.float64)
    out = {}
    for name, weights, row_sum in (("exact", p, p), ("P bf16, l of P", p_bf16, p),
                                   ("P bf16, l of bf16 P", p_bf16, p_bf16)):
        l_sum = row_sum.sum(-1, keepdims=True)
        o = np.einsum("bnts,bsnd->btnd", weights, v)
        out[name] = o / np.maximum(l_sum.transpose(0, 2, 1, 3), 1e-300)
    return out


def _bf16_ulps(out: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """How many bf16 steps ``out`` (bf16 values) lies from the rounding of ``ref``."""
    def ordered(x):
        bits = np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)).view(np.int16)
        bits = bits.astype(np.int32)
        return np.where(bits < 0, -32768 - bits, bits)
    return np.abs(ordered(out) - ordered(ref))


def _stats(out: np.ndarray, oracles: dict, vis_count: np.ndarray) -> dict:
    ref = oracles["exact"]
    ulps = _bf16_ulps(out, ref)
    err = np.abs(out - ref)
    miss = err > ATOL + RTOL * np.abs(ref)
    rows_miss = miss.any(-1)  # [B, T, N]
    by_count = {}
    for lo, hi in ((1, 4), (5, 16), (17, 64), (65, 10**9)):
        rows = (vis_count >= lo) & (vis_count <= hi)
        if rows.any():
            by_count[f"{lo}-{hi}"] = dict(
                rows=int(rows.sum()), max_err=float(err[:, rows].max()),
                misses=int(miss[:, rows].sum()))
    return dict(
        elements=int(out.size), misses=int(miss.sum()), max_err=float(err.max()),
        nan=int(np.isnan(out).sum()),
        # The output is bf16: 0 ulps is the correctly rounded result.
        ulps_hist={str(u): int((ulps == u).sum()) for u in range(4)},
        ulps_more=int((ulps >= 4).sum()), ulps_max=int(ulps.max()),
        miss_rows_visible_keys=sorted({int(c) for c in vis_count[rows_miss.any((0, 2))]})[:20],
        by_visible_keys=by_count,
        max_diff_to={name: float(np.abs(out - o).max()) for name, o in oracles.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--implementations", default=",".join(pf.available_implementations()))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for name, case in _cases(args.seq, rng).items():
        case = dict(case)
        seq_kv = case.pop("seq_kv")
        keys = jax.random.split(jax.random.PRNGKey(len(results)), 3)
        q = jax.random.normal(keys[0], (2, args.seq, args.heads, args.head_dim), jnp.bfloat16)
        k, v = (jax.random.normal(x, (2, seq_kv, args.heads, args.head_dim), jnp.bfloat16)
                for x in keys[1:])
        vis = _visible(args.seq, seq_kv, case)
        oracles = _oracles(q, k, v, vis)
        mask = case.pop("mask", None)
        for impl in args.implementations.split(","):
            out = pf.attention(q, k, v, mask=None if mask is None else jnp.asarray(mask),
                               implementation=impl, **case)
            stats = _stats(np.asarray(out, np.float64), oracles, vis.sum(-1))
            results.append(dict(case=name, implementation=impl, **stats))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.date.today().isoformat()
        path = args.out / f"masked_accuracy-{stamp}.json"
        path.write_text(json.dumps(dict(date=stamp, device=jax.devices()[0].device_kind,
                                        jax=jax.__version__, atol=ATOL, rtol=RTOL,
                                        results=results), indent=1))
        print(path)


if __name__ == "__main__":
    main()

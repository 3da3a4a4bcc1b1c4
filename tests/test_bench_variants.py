"""benchmarks.variants: visible-pair counting, and a tiny run on CPU."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import variants


def test_visible_pairs_match_brute_force():
    seq = 64
    rows = np.arange(seq)[:, None]
    cols = np.arange(seq)[None, :]
    causal = cols <= rows
    docs = rows // 8 == cols // 8
    for name, kwargs in variants.variants(seq, heads=2).items():
        expected = causal
        if name == "8 packed documents":
            expected = causal & docs
        elif name == "window 1024":
            expected = causal & (cols >= rows - 1024)
        elif name == "half padded":
            expected = causal & (rows < 32) & (cols < 32)
        assert variants.visible_pairs(seq, kwargs) == expected.sum(), name


def test_tiny_cpu_run_writes_results(tmp_path):
    variants.main(["--seq-len", "64", "--head-dim", "16", "--iters", "2", "--impls", "xla",
                   "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("variants-*.json")
    rows = json.loads(json_file.read_text())["rows"]
    assert {r["variant"] for r in rows} == set(variants.variants(64, 2))
    assert all(r["fwd_ms"] > 0 and "error" not in r for r in rows)
    assert (tmp_path / json_file.name.replace(".json", ".md")).exists()

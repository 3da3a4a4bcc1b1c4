"""benchmarks.variants: visible-pair counting, ours against the jax.nn anchor, and a tiny
run on CPU."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import variants

SEQ = 64


def _brute_force_visible(seq: int, kwargs: dict) -> np.ndarray:
    """``[seq, seq]`` bool: which (query, key) pairs a call with ``kwargs`` lets through,
    built pair by pair from each argument's definition in ``jax.nn.dot_product_attention``."""
    rows = np.arange(seq)[:, None]
    cols = np.arange(seq)[None, :]
    visible = np.ones((seq, seq), bool)
    if kwargs["is_causal"]:
        visible &= cols <= rows
    if "local_window_size" in kwargs:
        left, right = kwargs["local_window_size"]
        visible &= (cols >= rows - left) & (cols <= rows + right)
    if "q_segment_ids" in kwargs:
        ids = np.asarray(kwargs["q_segment_ids"])[0]
        visible &= ids[:, None] == ids[None, :]
    if "query_seq_lengths" in kwargs:
        visible &= rows < int(kwargs["query_seq_lengths"][0])
    if "key_value_seq_lengths" in kwargs:
        visible &= cols < int(kwargs["key_value_seq_lengths"][0])
    if "mask" in kwargs:
        visible &= np.broadcast_to(np.asarray(kwargs["mask"]), (1, 1, seq, seq))[0, 0]
    if "bias" in kwargs:
        bias = np.asarray(kwargs["bias"], np.float32)
        visible &= np.broadcast_to(bias, (seq, seq)) > -np.inf
    return visible


def test_visible_pairs_match_brute_force():
    table = variants.variants(SEQ, heads=2)
    for name, variant in table.items():
        want = _brute_force_visible(SEQ, variant.kwargs).sum()
        assert variants.visible_pairs(SEQ, variant.kwargs) == want, name
    # A few by hand, so that the brute force cannot share a mistake with the counter.
    causal = SEQ * (SEQ + 1) // 2
    by_hand = {"dense causal": causal, "dense": SEQ * SEQ,
               "8 packed documents": 8 * (8 * 9 // 2),
               "causal mask [1, 1, T, S], no is_causal": causal,
               "causal 0/-inf bias [T, S], no is_causal": causal,
               "causal, padded to 50 %": 32 * 33 // 2, "dense, padded to 50 %": 32 * 32,
               "dense, padded to 90 %": 57 * 57}
    for name, pairs in by_hand.items():
        assert variants.visible_pairs(SEQ, table[name].kwargs) == pairs, name


def test_every_baseline_is_a_variant_timed_before_its_rows():
    names = list(variants.variants(SEQ, heads=2))
    for i, (name, variant) in enumerate(variants.variants(SEQ, heads=2).items()):
        assert variant.baseline in names[:i + 1], name


@pytest.mark.parametrize("name", [name for name, variant in variants.variants(SEQ, 2).items()
                                  if variants.anchor(variant.kwargs) is not None])
def test_ours_matches_the_anchor(name):
    """pallas-flash's XLA path against jax.nn's on every variant jax.nn takes: outputs and
    gradients of the real (not padded) queries."""
    kwargs = variants.variants(SEQ, heads=2)[name].kwargs
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v, g = (jax.random.normal(key, (1, SEQ, 2, 16), jnp.float32) for key in keys)
    real = int(kwargs["query_seq_lengths"][0]) if "query_seq_lengths" in kwargs else SEQ
    # jax.nn spreads a padded query over every key where ours outputs 0: their cotangent is 0.
    g = g.at[:, real:].set(0.0)
    results = []
    for attn in (variants.ours("xla", kwargs), variants.anchor(kwargs, "xla")):
        out, vjp = jax.vjp(attn, q, k, v)
        results.append((out[:, :real], *vjp(g)))
    for got, want in zip(*results, strict=True):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_tiny_cpu_run_writes_results(tmp_path):
    variants.main(["--seq-len", str(SEQ), "--head-dim", "16", "--iters", "2", "--rounds", "2",
                   "--impls", "xla", "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("variants-*.json")
    rows = json.loads(json_file.read_text())["rows"]
    table = variants.variants(SEQ, 2)
    assert [r["variant"] for r in rows] == list(table)
    for r in rows:
        assert "error" not in r and r["fwd_ms"] > 0 and len(r["fwd_round_ms"]) == 2
        assert r["visible_pairs"] == variants.visible_pairs(SEQ, table[r["variant"]].kwargs)
        # On a shared CPU the backward (fwd+bwd minus fwd) can come out negative: only present.
        assert r["fwd_vs_dense"] > 0 and "bwd_vs_dense" in r
    assert (tmp_path / json_file.name.replace(".json", ".md")).exists()


def test_only_runs_the_named_variants_and_their_baselines(tmp_path):
    variants.main(["--seq-len", str(SEQ), "--head-dim", "16", "--iters", "1", "--rounds", "1",
                   "--impls", "xla", "--only", "dense, padded to 50 %", "--out", str(tmp_path)])
    [json_file] = tmp_path.glob("variants-*.json")
    rows = json.loads(json_file.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["dense", "dense, padded to 50 %"]
    with pytest.raises(SystemExit):
        variants.main(["--only", "no such variant"])

"""CPU tests of the benchmark suite: FLOP conventions, timing, the report writer, a tiny run."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import backward as backward_bench
from benchmarks import (
    compile_time,
    fp8_cudnn,
    report,
    ring_scaling,
    suite,
)
from benchmarks import ring as ring_bench
from benchmarks.flops import attention_flops, problem_shape, tflops_per_s
from benchmarks.implementations import IMPLEMENTATIONS, Implementation, error_summary
from benchmarks.timing import time_fn
from benchmarks.tools import lowered_modules, profile_backward

# --- FLOP conventions ------------------------------------------------------------------------

@pytest.mark.parametrize(("head_dim", "seq_len", "expected"), [
    (128, 16384, (1, 16)),
    (64, 1024, (16, 32)),
    (256, 512, (32, 8)),
])
def test_problem_shape_follows_the_papers(head_dim, seq_len, expected):
    assert problem_shape(head_dim, seq_len) == expected


@pytest.mark.parametrize(("head_dim", "seq_len"), [(96, 1024), (128, 3000)])
def test_problem_shape_rejects_inexact_divisions(head_dim, seq_len):
    with pytest.raises(ValueError, match="not a multiple"):
        problem_shape(head_dim, seq_len)


def test_forward_flops_hand_computed():
    # 4 · 1 · 16 · 16384² · 128 = 2^41.
    assert attention_flops(1, 16, 16384, 128, causal=False, pass_="fwd") == 2**41
    # 4 · 16 · 32 · 1024² · 64 = 2^37.
    assert attention_flops(16, 32, 1024, 64, causal=False, pass_="fwd") == 2**37
    # 4 · 3 · 5 · 7² · 11 (not a power of two).
    assert attention_flops(3, 5, 7, 11, causal=False, pass_="fwd") == 32340


def test_causal_halves_and_backward_is_two_and_a_half_forwards():
    fwd = attention_flops(1, 16, 16384, 128, causal=False, pass_="fwd")
    assert attention_flops(1, 16, 16384, 128, causal=True, pass_="fwd") == fwd / 2
    assert attention_flops(1, 16, 16384, 128, causal=False, pass_="bwd") == 2.5 * fwd
    assert attention_flops(1, 16, 16384, 128, causal=True, pass_="bwd") == 1.25 * fwd
    assert attention_flops(1, 16, 16384, 128, causal=False, pass_="fwdbwd") == 3.5 * fwd
    with pytest.raises(ValueError, match="pass"):
        attention_flops(1, 1, 1, 1, causal=False, pass_="both")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_flops_depend_only_on_tokens_hidden_and_length(head_dim):
    # With batch·L = tokens and heads·D = hidden, the forward is 4·tokens·L·hidden.
    batch, heads = problem_shape(head_dim, 4096)
    flops = attention_flops(batch, heads, 4096, head_dim, causal=False, pass_="fwd")
    assert flops == 4 * 16384 * 4096 * 2048


def test_tflops_per_s():
    assert tflops_per_s(1e12, 1.0) == pytest.approx(1000.0)
    # The anchors' cuDNN forward at head_dim 128, L 16384: 2^41 FLOPs in 3.373 ms ≈ 652.
    assert tflops_per_s(2**41, 3.373) == pytest.approx(651.9, abs=0.1)
    with pytest.raises(ValueError):
        tflops_per_s(1.0, 0.0)


# --- timing and helpers ----------------------------------------------------------------------

def test_time_fn_rotates_inputs_and_counts_samples():
    seen = []

    def fn(x):
        seen.append(x)
        return x

    timing = time_fn(fn, [(0,), (1,), (2,)], iters=4, warmup=2, min_sample_ms=0.0)
    assert timing.samples == 4
    assert timing.calls_per_sample == 1
    assert 0 < timing.min_ms <= timing.median_ms <= timing.max_ms
    # Two warm-up calls, one estimate, then timed calls cycling through the three sets.
    assert seen == [0, 1, 0, 0, 1, 2, 0]


def test_time_fn_stops_at_the_time_cap_after_min_samples():
    timing = time_fn(lambda: None, [()], iters=10**6, warmup=1, max_seconds=0.0, min_samples=3)
    assert timing.samples == 3


def test_relative_error():
    ref = jnp.array([1.0, -2.0, 4.0])
    assert suite.relative_error(ref, ref) == 0.0
    assert suite.relative_error((ref, ref * 1.1), (ref, ref)) == pytest.approx(0.1, rel=1e-5)
    assert math.isnan(suite.relative_error(ref.at[0].set(jnp.nan), ref))


def test_error_summary_keeps_type_and_first_line():
    assert error_summary(ValueError("\nshared memory overflow\n  details")) == (
        "ValueError: shared memory overflow")
    assert error_summary(AssertionError()) == "AssertionError"


def test_file_stem_names_benchmark_device_and_date():
    assert report.file_stem("suite", "NVIDIA H200", "2026-11-29") == \
        "suite-nvidia-h200-2026-11-29"
    assert report.file_stem("decode-fill0.5", "cpu", "2026-11-29", "d128") == \
        "decode-fill0.5-cpu-2026-11-29-d128"
    with pytest.raises(ValueError, match="benchmark name"):
        report.file_stem("Suite run 3", "cpu", "2026-11-29")


def _rounds(*ms):
    return suite.Measurement(round_ms=ms)


def test_backward_time_is_forward_backward_minus_forward():
    """Round by round: the median of (fwdbwd - fwd) over rounds, not of medians."""
    impl = IMPLEMENTATIONS["xla"]
    measured = {"fwd": _rounds(1.0), "fwdbwd": _rounds(3.0)}
    record = suite._point_record(impl, "bf16", 128, 16384, 1, 16, False, "bwd", measured)
    assert record["ms"] == pytest.approx(2.0) and record["round_ms"] == [2.0]
    assert record["tflops"] == pytest.approx(2.5 * 2**41 / 2e-3 / 1e12)
    measured = {"fwd": _rounds(1.0, 2.0, 1.5), "fwdbwd": _rounds(3.0, 3.1, 4.5)}
    record = suite._point_record(impl, "bf16", 128, 16384, 1, 16, False, "bwd", measured)
    assert record["round_ms"] == pytest.approx([2.0, 1.1, 3.0])
    assert record["ms"] == pytest.approx(2.0)  # medians' difference: 3.1 - 1.5 = 1.6
    measured["fwdbwd"] = _rounds(0.9, 0.9, 0.9)
    record = suite._point_record(impl, "bf16", 128, 16384, 1, 16, False, "bwd", measured)
    assert record["ms"] is None and "not slower" in record["error"]
    measured["fwd"] = suite.Measurement(error="ValueError: boom")
    record = suite._point_record(impl, "bf16", 128, 16384, 1, 16, False, "bwd", measured)
    assert record["error"] == "forward: ValueError: boom"


def test_parse_args_quick_defaults_and_overrides():
    config, out_dir, tag = suite.parse_args(["--quick", "--head-dims", "32", "--causal", "yes",
                                         "--passes", "fwd,bwd", "--tag", "x"])
    assert config.head_dims == (32,)
    assert config.tokens == 256 and config.causal == (True,)
    assert config.passes == ("fwd", "bwd") and tag == "x"
    assert out_dir == Path("benchmarks/results")
    config, _, _ = suite.parse_args([])
    assert config.seq_lens == (1024, 2048, 4096, 8192, 16384)
    assert config.head_dims == (64, 128, 256) and config.tokens == 16384
    assert config.rounds == 3 and suite.parse_args(["--quick"])[0].rounds == 1
    assert suite.parse_args(["--quick", "--rounds", "2"])[0].rounds == 2
    for bad in (["--seq-lens", "3000"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            suite.parse_args(bad)
    with pytest.raises(SystemExit):
        suite.parse_args(["--impls", "nope"])


# --- report ----------------------------------------------------------------------------------

def _point(impl, pass_, tflops, *, causal=False, seq_len=1024, error=None, dtype="bf16"):
    batch, heads = problem_shape(128, seq_len)
    flops = attention_flops(batch, heads, seq_len, 128, causal=causal, pass_=pass_)
    return {"impl": impl, "dtype": dtype, "head_dim": 128, "seq_len": seq_len, "batch": batch,
            "heads": heads, "causal": causal, "pass": pass_, "flops": flops,
            "ms": None if tflops is None else flops / (tflops * 1e9),
            "tflops": tflops, "ratio_to_cudnn": None, "max_rel_err": None, "error": error}


def _result(points, device="NVIDIA H200"):
    suite.add_ratios(points)
    return {"schema": 1, "date": "2026-11-29", "device": device, "platform": "gpu",
            "jax_version": "0.11.2", "reference": "cudnn",
            "config": {"dtype": "bf16", "tokens": 16384, "hidden": 2048, "iters": 30,
                       "warmup": 3, "input_sets": 3, "tolerance": 0.05},
            "implementations": {"cudnn": {"dtype": "bf16", "note": "jax.nn (cuDNN)"}},
            "unavailable": {"tokamax": "ModuleNotFoundError: No module named 'tokamax'"},
            "points": points}


def _sample_result():
    return _result([
        _point("cudnn", "fwd", 500.0), _point("xla", "fwd", 125.0),
        _point("jax_mgpu", "fwd", 600.0, dtype="fp16"),
        _point("cudnn", "fwd", 400.0, seq_len=2048), _point("xla", "fwd", 100.0, seq_len=2048),
        _point("jax_mgpu", "fwd", None, seq_len=2048, error="ValueError: smem overflow"),
        _point("cudnn", "bwd", 400.0), _point("xla", "bwd", 40.0),
        _point("jax_mgpu", "bwd", None, error="wrong result: max rel err 0.9 > 0.05"),
    ])


def test_ratios_to_cudnn():
    points = {(p["impl"], p["seq_len"], p["pass"]): p for p in _sample_result()["points"]}
    assert points[("cudnn", 1024, "fwd")]["ratio_to_cudnn"] == 1.0
    assert points[("xla", 1024, "fwd")]["ratio_to_cudnn"] == 0.25
    assert points[("jax_mgpu", 1024, "fwd")]["ratio_to_cudnn"] == pytest.approx(1.2)
    assert points[("xla", 1024, "bwd")]["ratio_to_cudnn"] == pytest.approx(0.1)
    assert points[("jax_mgpu", 2048, "fwd")]["ratio_to_cudnn"] is None


def test_report_round_trips_json_into_markdown(tmp_path):
    path = tmp_path / "nvidia-h200-2026-11-29.json"
    path.write_text(json.dumps(_sample_result()))
    result = report.load([path])
    md = report.markdown(result)
    assert md.startswith("# Attention benchmark: NVIDIA H200, 2026-11-29")
    assert "jax 0.11.2" in md
    assert "| head_dim | causal | L | cudnn | xla | jax_mgpu (fp16) |" in md
    assert "| 128 | no | 1024 | 500 (1.00×) | 125 (0.25×) | 600 (1.20×) |" in md
    assert "| 128 | no | 2048 | 400 (1.00×) | 100 (0.25×) | failed |" in md
    assert "| 128 | no | 1024 | 400 (1.00×) | 40 (0.10×) | WRONG |" in md
    assert "## Forward (TFLOP/s)" in md and "## Backward (TFLOP/s)" in md
    assert "| jax_mgpu | ValueError: smem overflow | fwd d128 L2048 |" in md
    assert "`tokamax`: not available" in md
    table = report.text_table(result)
    assert "125 0.25x" in table and "WRONG" in table and "failed" in table


def test_report_writes_one_chart_per_head_dim_causal_and_pass(tmp_path):
    md_path, charts = report.write_report(_sample_result(), tmp_path, "h200")
    assert md_path == tmp_path / "h200.md"
    assert sorted(p.name for p in charts) == ["h200-d128-full-bwd.png", "h200-d128-full-fwd.png"]
    for chart in charts:
        assert chart.read_bytes().startswith(b"\x89PNG")


def test_report_merges_files_later_points_win(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_sample_result()))
    second.write_text(json.dumps(_result([_point("cudnn", "fwd", 800.0),
                                          _point("cudnn", "fwd", 300.0, causal=True)])))
    merged = report.load([first, second])
    cudnn = {(p["seq_len"], p["causal"], p["pass"]): p["tflops"]
             for p in merged["points"] if p["impl"] == "cudnn"}
    assert cudnn[(1024, False, "fwd")] == 800.0
    assert cudnn[(1024, True, "fwd")] == 300.0
    assert len(merged["points"]) == len(_sample_result()["points"]) + 1
    other = tmp_path / "c.json"
    other.write_text(json.dumps(_result([], device="cpu")))
    with pytest.raises(ValueError, match="different devices"):
        report.load([first, other])


# --- a tiny run of the suite on CPU ----------------------------------------------------------

def _xla(q, k, v, causal):
    return IMPLEMENTATIONS["xla"].fn(q, k, v, causal)


def _wrong(q, k, v, causal):
    return 2 * _xla(q, k, v, causal)


def _fails_at_64(q, k, v, causal):
    if q.shape[1] == 64:  # passes the probe (L 256), fails at the point, like an smem overflow
        raise ValueError("Mosaic GPU kernel exceeds available shared memory\nmore detail")
    return _xla(q, k, v, causal)


def test_suite_records_timings_wrong_results_and_failures():
    registry = {
        "xla": IMPLEMENTATIONS["xla"],
        "wrong": Implementation("wrong", _wrong),
        "fails": Implementation("fails", _fails_at_64),
        "fp32": Implementation("fp32", _xla, dtype=jnp.dtype(jnp.float32)),
        "missing": Implementation("missing", lambda q, k, v, c: __import__("no_such_module")),
        "only128": Implementation("only128", _xla, head_dims=(128,)),
    }
    config = suite.SuiteConfig(head_dims=(32,), seq_lens=(64,), causal=(True,), tokens=128,
                               hidden=64, iters=2, warmup=1, max_seconds=0.05, rounds=2)
    saved = []
    result = suite.run_suite(config, registry, on_point=saved.append, log=lambda _: None)
    assert result["reference"] == "xla"
    assert result["unavailable"] == {"missing": "ModuleNotFoundError: No module named "
                                                "'no_such_module'"}
    assert len(saved) == 1
    points = {(p["impl"], p["pass"]): p for p in result["points"]}
    assert len(points) == 5 * 3
    for pass_ in ("fwd", "bwd", "fwdbwd"):
        xla = points[("xla", pass_)]
        assert (xla["batch"], xla["heads"], xla["causal"]) == (2, 2, True)
        assert xla["flops"] == attention_flops(2, 2, 64, 32, causal=True, pass_=pass_)
        assert points[("wrong", pass_)]["error"].startswith("wrong result: max rel err 1")
        assert points[("wrong", pass_)]["tflops"] is None
        assert "exceeds available shared memory" in points[("fails", pass_)]["error"]
        assert points[("fp32", pass_)]["dtype"] == "fp32"
        assert points[("fp32", pass_)]["max_rel_err"] < 0.05
        assert points[("fp32", pass_)]["ratio_to_cudnn"] is None
        assert points[("only128", pass_)]["error"] == "not run: only128 takes head_dim (128,) only"
    assert points[("xla", "fwd")]["error"] is None and points[("xla", "fwd")]["ms"] > 0
    assert points[("xla", "fwdbwd")]["error"] is None
    for pass_ in ("fwd", "fwdbwd"):  # two interleaved rounds, their median reported
        xla = points[("xla", pass_)]
        assert len(xla["round_ms"]) == 2 and xla["ms"] == pytest.approx(
            float(np.median(xla["round_ms"])))
        assert points[("wrong", pass_)]["round_ms"] == []  # not timed


@jax.custom_vjp
def _nan_cotangent(x):
    return x


_nan_cotangent.defvjp(lambda x: (x, None), lambda _, g: (jnp.full_like(g, jnp.nan),))


def _nan_dv(q, k, v, causal):
    """The right output and dq, dk; a NaN dv (the last gradient checked)."""
    return _xla(q, k, _nan_cotangent(v), causal)


def test_backward_benchmark_checks_each_gradient_and_pairs_rounds(tmp_path):
    """benchmarks/backward.py on a tiny point: every output and gradient is checked (a NaN
    in the last one too); wrong rows are timed but flagged, and give no ratios as anchors;
    bwd is fwdbwd - fwd per round; ratios are medians of per-round ratios."""
    args = backward_bench.parse_args([
        "--out", str(tmp_path), "--head-dims", "32", "--seq-lens", "64", "--causal", "yes",
        "--tokens", "128", "--hidden", "64", "--rounds", "3", "--iters", "2",
        "--max-seconds", "0.02", "--impls", "xla"])
    impls = {"ours": _xla, "cudnn": _xla, "fa3": _nan_dv, "wrong": _wrong, "only128": _xla}
    assert backward_bench.run(args, impls, lambda name, head_dim: name != "only128") == 0
    (json_path,) = tmp_path.glob("backward-*.json")
    rows = {r["impl"]: r for r in json.loads(json_path.read_text())["rows"]}
    ours, cudnn, fa3 = rows["ours"], rows["cudnn"], rows["fa3"]
    assert ours["correct"] and max(ours["rel_err"].values()) < 1e-2
    assert (ours["batch"], ours["heads"]) == (2, 2)
    assert ours["bwd_round_ms"] == pytest.approx(
        [b - f for f, b in zip(ours["fwd_round_ms"], ours["fwdbwd_round_ms"], strict=True)])
    assert ours["fwd_vs_cudnn"] == pytest.approx(statistics.median(
        c / o for c, o in zip(cudnn["fwd_round_ms"], ours["fwd_round_ms"], strict=True)))
    assert ours["fwdbwd_tflops"] == pytest.approx(tflops_per_s(
        attention_flops(2, 2, 64, 32, causal=True, pass_="fwdbwd"), ours["fwdbwd_ms"]))
    assert not fa3["correct"] and math.isnan(fa3["rel_err"]["dv"])
    assert fa3["rel_err"]["dq"] < 1e-2 and fa3["fwd_ms"] > 0  # timed all the same
    assert not any(key.endswith("_vs_fa3") for key in ours)  # a wrong anchor: no ratio
    assert not rows["wrong"]["correct"]
    assert rows["wrong"]["rel_err"]["out"] == pytest.approx(1, rel=1e-2)
    assert rows["only128"]["error"] == "not run: only128 does not take head_dim 32"
    assert "| 32 | 64 | yes | fa3 |" in json_path.with_suffix(".md").read_text()
    assert "WRONG (nan)" in json_path.with_suffix(".md").read_text()


def test_backward_control_times_the_first_implementation_twice(tmp_path):
    """--control (through main, on CPU with xla): a separately timed copy of the first
    implementation, right after it, and the per-round spread between the two."""
    assert backward_bench.main([
        "--out", str(tmp_path), "--head-dims", "32", "--seq-lens", "64", "--causal", "no",
        "--tokens", "128", "--hidden", "64", "--rounds", "3", "--iters", "2",
        "--max-seconds", "0.02", "--impls", "xla,cudnn", "--control"]) == 0
    (json_path,) = tmp_path.glob("backward-*.json")
    doc = json.loads(json_path.read_text())
    assert [r["impl"] for r in doc["rows"]] == ["xla", "xla_again", "cudnn"]
    first, again = doc["rows"][0], doc["rows"][1]
    assert first["fwd_round_ms"] != again["fwd_round_ms"]  # timed apart, not copied
    spread = backward_bench.control_spread(doc["rows"])
    want = [statistics.median(a / b for a, b in zip(
        first[f"{p}_round_ms"], again[f"{p}_round_ms"], strict=True))
        for p in backward_bench.PASSES]
    assert "| 32 | 64 | no | xla | " + " | ".join(f"{x:.3f}" for x in want) + " |" in spread
    assert spread in json_path.with_suffix(".md").read_text()
    assert backward_bench.control_spread([dict(r, impl="other") for r in doc["rows"]]) == ""


def test_variants_run_only_when_named():
    """An implementation with by_default=False (pallas_flash_mosaic_deterministic) is
    probed, but run only when --impls names it."""
    registry = {"xla": IMPLEMENTATIONS["xla"],
                "variant": Implementation("variant", _xla, by_default=False)}
    assert not IMPLEMENTATIONS["pallas_flash_mosaic_deterministic"].by_default
    for impls, run in ((None, ["xla"]), (("xla", "variant"), ["xla", "variant"])):
        config = suite.SuiteConfig(impls=impls)
        chosen, reference, _ = suite.select_implementations(config, registry, lambda _: None)
        assert [i.name for i in chosen] == run and reference == "xla"


def test_suite_main_quick_on_cpu(tmp_path, capsys):
    assert suite.main(["--quick", "--impls", "xla", "--causal", "no", "--seq-lens", "64",
                       "--passes", "fwd", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("suite-cpu-*.json")
    result = json.loads(json_path.read_text())
    assert result["device"] and result["jax_version"]
    assert json_path.with_suffix(".md").exists()
    assert list(tmp_path.glob("*-d64-full-fwd.png"))
    (point,) = result["points"]
    assert point["impl"] == "xla" and point["error"] is None and point["tflops"] > 0
    out = capsys.readouterr().out
    assert "fwd     64 no         64 |" in out


def test_ring_main_quick_on_cpu(tmp_path, capsys):
    """benchmarks/ring.py --quick: every variant runs, ring1 equals plain, JSON + table."""
    assert ring_bench.main(["--quick", "--passes", "fwd", "--causal", "yes",
                            "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("ring-*.json")
    (row,) = json.loads(json_path.read_text())["rows"]
    assert row["errors"] == {} and set(row["ms"]) == {"plain", "ring1", "sim2", "calls2"}
    assert row["ring1_max_abs_diff"] < 1e-5 and row["sim_over_calls"] > 0
    assert row["step_over_plain"] == row["ms"]["sim2"] / 2 / row["ms"]["plain"]
    # n = 2: one step passes K and V on (the last step passes nothing).
    permutes = row["collective_permutes"]
    assert permutes["sync"] + permutes["async"] == 2, permutes
    assert json_path.with_suffix(".md").exists()
    assert "| fwd | yes | 64 |" in capsys.readouterr().out


def test_compile_time_quick_on_cpu(tmp_path, capsys):
    """benchmarks/compile_time.py --quick: both implementations lower, compile and run the
    layered gradient, which agrees between them; JSON + table; bad flags raise."""
    assert compile_time.main(["--quick", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("compile-time-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["pallas_flash_xla", "xla"]
    for r in rows:
        assert r["error"] is None and r["layers"] == 3, r
        assert r["lower_s"] > 0 and r["compile_s"] > 0 and r["call_ms"] > 0
    assert rows[0]["max_abs_diff"] == 0 and rows[1]["max_abs_diff"] < 1e-4
    assert "| xla | 32 | 3 |" in capsys.readouterr().out
    assert json_path.with_suffix(".md").exists()
    for flags, match in ((["--impls", "nope"], "--impls"), (["--layers", "0"], "--layers"),
                         (["--heads", "3", "--kv-heads", "2"], "--kv-heads")):
        with pytest.raises(ValueError, match=match):
            compile_time.main(["--quick", *flags])


def test_ring_scaling_quick_on_fake_devices(tmp_path, capsys):
    """benchmarks/ring_scaling.py --quick on the CPU's 8 fake devices: the ring's forward
    matches attention on the whole sequence in both layouts, efficiency is the ratio of the
    per-device rates, n - 1 hops of K and V each."""
    assert ring_scaling.main(["--quick", "--devices", "2,4", "--passes", "fwd",
                              "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("ring-scaling-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert {(r["devices"], r["layout"]) for r in rows} == {
        (n, layout) for n in (2, 4) for layout in ("zigzag", "contiguous")}
    for r in rows:
        assert r["errors"] == {} and r["max_abs_diff"] < 1e-5, r
        rate = r["tflops_per_device"]
        assert r["efficiency"] == rate["ring"] / rate["plain"]
        permutes = r["collective_permutes"]
        assert permutes["sync"] + permutes["async"] == 2 * (r["devices"] - 1)
    assert "| fwd | 64 | 4 | zigzag | 16 |" in capsys.readouterr().out
    assert json_path.with_suffix(".md").exists()
    with pytest.raises(ValueError, match="--devices"):
        ring_scaling.main(["--quick", "--devices", "16"])


def test_lowered_modules_fingerprints_tell_kernels_apart(tmp_path):
    """benchmarks/tools/lowered_modules.py: the same kernel lowers to the same fingerprint in
    another order of cases (dump counters and names are blanked), different kernels to
    different ones, and ``--compare`` names a case whose module changed."""
    dense, causal = "fwd-d64-dense-plain", "fwd-d64-causal-plain"
    available = lowered_modules.fp8.available_implementations
    got = lowered_modules.fingerprints(only=f"^({dense}|{causal})$")
    assert set(got) == {dense, causal} and all(len(v) == 1 for v in got.values())
    assert got[dense] != got[causal]
    assert lowered_modules.fingerprints(only=f"^{dense}$") == {dense: got[dense]}
    saved = tmp_path / "before.json"
    saved.write_text(json.dumps({dense: got[causal]}))
    assert lowered_modules.main(["--only", f"^{dense}$", "--compare", str(saved)]) == 1
    saved.write_text(json.dumps({dense: got[dense]}))
    assert lowered_modules.main(["--only", f"^{dense}$", "--compare", str(saved)]) == 0
    assert lowered_modules.fp8.available_implementations is available  # restored


# --- benchmarks/fp8_cudnn.py -----------------------------------------------------------------

def test_fp8_cudnn_passes_our_scales_as_cudnns_descales(monkeypatch):
    """cuDNN multiplies by every scale/descale: descale_x = our x ≈ x8 · scale, P rounded as
    P · 448 then · 1/448, scale_o = 1 / out_scale; every key of fp8_params set."""
    from pallas_flash.compat import cudnn_fused_attention as cudnn
    seen = {}
    monkeypatch.setattr(cudnn, "dot_product_attention",
                        lambda *a, **kw: seen.update(args=a, **kw) or "out")
    q8 = jnp.zeros((1, 128, 2, 64), jnp.float8_e4m3fn)
    assert fp8_cudnn.cudnn_fp8(q8, q8, q8, 0.5, 0.25, 2.0, 0.125, is_causal=True) == "out"
    params = {name: float(np.asarray(x).reshape(())) for name, x in seen["fp8_params"].items()}
    assert set(params) == set(cudnn.fp8_params_keys)
    assert all(seen["fp8_params"][n].shape == (1, 1, 1, 1) for n in params)
    assert (params["descale_q"], params["descale_k"], params["descale_v"]) == (0.5, 0.25, 2.0)
    assert params["scale_s"] == 448 and params["descale_s"] == np.float32(1 / 448)
    assert params["scale_o"] == 8.0
    assert seen["mask_type"] == cudnn.MaskType.CAUSAL and seen["use_fp8"]
    assert seen["qkv_layout"] == "BTNH" and seen["scale"] == 64 ** -0.5


def test_fp8_cudnn_accuracy_on_cpu(tmp_path):
    """--accuracy on a tiny point: ours filled in, cuDNN "not available", and the e4m3
    output costs ours_tensor_e4m3out an output rounding (more error than ours_tensor's,
    but not much more: the dequantization uses the right scale)."""
    assert fp8_cudnn.main(["--accuracy", "--seq-lens", "128", "--head-dims", "64", "--heads",
                           "2", "--distributions", "outliers", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("fp8-cudnn-accuracy-*.json")
    (row,) = json.loads(json_path.read_text())["rows"]
    rel = row["rel"]
    assert set(rel) == set(row["rmse"]) == {"bf16", *fp8_cudnn.OURS_METHODS}
    assert set(row["errors"]) == set(fp8_cudnn.CUDNN_METHODS)
    assert all(e.startswith("not available") for e in row["errors"].values())
    assert rel["bf16"] < 1e-2 < rel["ours_tensor"] < 0.15
    assert rel["ours_tensor"] < rel["ours_tensor_e4m3out"] < 1.5 * rel["ours_tensor"]
    assert row["ours / cudnn"] is None and row["ours best / cudnn best"] is None
    text = json_path.with_suffix(".md").read_text()
    assert "| 128 | 64 | outliers | no | " in text and "| n/a | n/a |" in text


def test_fp8_cudnn_speed_on_cpu(tmp_path):
    """The speed mode on a tiny point: what cannot run here is a row with its reason, ours
    are checked against float64, timed and divided by ours_bf16; a call failing the check
    is not timed."""
    common = ["--head-dims", "64", "--seq-lens", "128", "--tokens", "256", "--hidden", "128",
              "--causal", "yes", "--rounds", "1", "--iters", "2", "--max-seconds", "0.05"]
    assert fp8_cudnn.main([*common, "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("fp8-cudnn-cpu-*.json")
    rows = {r["impl"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert set(rows) == set(fp8_cudnn.DEFAULT_SPEED_IMPLS)
    for name in ("cudnn_fp8", "cudnn_bf16", "fa3"):
        assert rows[name]["error"].startswith("not available") and "tflops" not in rows[name]
    for name in ("ours_fp8", "ours_fp8_quantized", "ours_bf16"):
        row = rows[name]
        assert row["error"] is None and row["tflops"] > 0 and row["batch"] == 2
        assert row["rel_err"] < row["tolerance"]
    # The same block-quantized operands: the same output, bit for bit.
    assert rows["ours_fp8"]["rel_err"] == rows["ours_fp8_quantized"]["rel_err"] > 1e-2
    assert rows["ours_fp8"]["ratios"] == {"ours_bf16": pytest.approx(
        rows["ours_fp8"]["tflops"] / rows["ours_bf16"]["tflops"])}
    assert "| ours_fp8 / cudnn_fp8 |" in json_path.with_suffix(".md").read_text()
    assert fp8_cudnn.main([*common, "--impls", "ours_fp8", "--fp8-tolerance", "1e-3",
                           "--tag", "strict", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / json_path.name.replace(".json", "-strict.json"))
                        .read_text())["rows"]
    assert row["error"].startswith("wrong result") and "tflops" not in row


# --- the ncu profile summary (benchmarks.tools.profile_backward) -----------------------------

_DETAILS = """\
  first_kernel (4, 32, 16)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Duration                         ms         1.19
    Compute (SM) Throughput           %        62.14
    L1/TEX Cache Throughput           %        73.25
    Section: Compute Workload Analysis
    Issue Slots Busy               %        31.31
    Local Memory Spilling Requests                        7,372,288
    Executed Instructions                           inst  346,574,326
    Registers Per Thread             register/thread             168
  small_fusion (64, 1, 1)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                         us        20.50
    Executed Instructions                           inst 1,125,144,859
"""


def _source_block(name, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]
    return [["Kernel Name", name], header, *rows]


def test_profile_details_are_parsed_per_kernel_with_units():

    first, second = profile_backward.parse_details(_DETAILS)
    assert first["name"] == "first_kernel" and first["grid"] == (4, 32, 16)
    assert first["duration ms"] == 1.19 and first["spill requests"] == 7372288
    assert first["instructions"] == 346574326 and first["registers"] == 168
    assert first["SM (tensor) %"] == 62.14 and first["issue slots %"] == 31.31
    assert second["duration ms"] == pytest.approx(0.0205) and second["block"] == (128, 1, 1)
    assert second["instructions"] == 1125144859  # one space between a unit and a wide value
    with pytest.raises(ValueError, match="unknown unit"):
        profile_backward.parse_details(_DETAILS.replace("us        20.50", "ks        20.50"))


def test_profile_source_counts_stalls_and_spills_once_per_kernel():

    rows = [["0x10", "  @!P1 LDL.LU R3, [R1]", "5", "100", "1", "4", "9"],
            ["0x20", "  STL [R1+0x4], R2", "3", "7", "3", "0", "9"],
            ["0x30", "  HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "2", "50", "2", "0", "0"]]
    block = _source_block("k", rows)
    # ncu prints some kernels twice in a row: counted once; a different block is kept.
    other = _source_block("k", [["0x10", "  LDL R3, [R1]", "1", "1", "1", "0", "0"]])
    kernels = profile_backward.parse_source(block + block + other)
    assert len(kernels) == 2
    first = kernels[0]
    assert first["samples"] == 10
    assert first["stalls"] == {"wait": 6, "long_sb": 4}  # "Not Issued" columns left out
    assert first["executed"]["LDL"] == 100 and first["executed"]["STL"] == 7
    assert first["executed"]["HGMMA"] == 50


def test_profile_table_filters_short_kernels_and_checks_alignment(capsys):

    details = profile_backward.parse_details(_DETAILS)
    rows = [["0x10", "  LDL R3, [R1]", "6", "11", "6", "0", "0"],
            ["0x20", "  STL [R1], R3", "4", "2", "0", "4", "0"]]
    source = profile_backward.parse_source(
        _source_block("first_kernel", rows)
        + _source_block("small_fusion", [["0x1", "  EXIT", "1", "1", "1", "0", "0"]]))
    text = profile_backward.table(details, source, min_ms=0.05)
    assert "first_kernel" in text and "small_fusion" not in text
    assert "wait 60.0, long_sb 40.0" in text and "| 11 / 2 |" in text
    lone = profile_backward.table(details, source[:1], min_ms=0.0)
    assert "top stalls" not in lone and "small_fusion" in lone
    assert "stall columns left out" in capsys.readouterr().err


def test_profile_workload_runs_and_validates(capsys):

    profile_backward.workload(["xla"], seq_len=128, head_dim=64, causal=True, tokens=256,
                              hidden=128, seed=0)
    assert "ran xla" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--impls"):
        profile_backward.workload(["nope"], 128, 64, True, 256, 128, 0)
    with pytest.raises(ValueError, match="must divide"):
        profile_backward.workload(["xla"], 100, 64, True, 256, 128, 0)

"""The pallas-flash command line on CPU, tiny sizes."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from pallas_flash.tutorial import cli, demo

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--batch", "1", "--heads", "2", "--seq-len", "32", "--head-dim", "16"]


def _exit_code(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


def test_check_passes_for_correct_implementations(capsys):
    assert cli.main(["check", *TINY, "--impls", "xla,fa2-loops"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "all passed" in out
    # Forward and the three gradients, causal and not.
    for quantity in ("out", "dq", "dk", "dv"):
        assert f" {quantity} " in out


def test_check_fails_on_a_wrong_implementation(capsys):
    good = demo.candidates(reference_loops=False)["xla"]
    wrong = demo.Candidate("off by a little", lambda q, k, v, causal: good.fn(q, k, v, causal)
                           * 1.001)
    broken = demo.Candidate("raises", lambda q, k, v, causal: jnp.zeros(()).reshape(5))
    code = cli.main(["check", *TINY, "--causal", "no"],
                    candidates={"xla": good, "wrong": wrong, "broken": broken})
    out = capsys.readouterr().out
    assert code == 1
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(
        ("xla", "off", "raises"))}
    assert lines["xla"].endswith("pass")
    assert "FAIL" in lines["off"] and "FAIL" in lines["raises"] and "TypeError" in out
    assert "FAILED: off by a little, raises" in out


def test_check_triton_interpret_forward(capsys):
    assert cli.main(["check", *TINY, "--impls", "triton", "--causal", "yes",
                     "--no-grads"]) == 0
    assert "interpret mode" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["check", "--impls", "nope"], "unknown or unavailable"),
    (["check", "--seq-len", "0"], "positive integer"),
    (["check", "--dtype", "fp64"], "invalid choice"),
    (["bench", "--seq-lens", "48", "--tokens", "128"], "not a multiple"),
    (["bench", "--impls", "standard,nope"], "unknown nope"),
    (["bench", "--seq-lens", "a,b"], "comma-separated integers"),
    (["memory", "--impl", "cuda"], "invalid choice"),
    (["io", "--head-dim", "-3"], "positive integer"),
    (["io", "--impl", "mosaic", "--dtype", "fp32"], "bf16 or fp16"),
    ([], "required"),
    # Tiny and forward-only: before these were refused, the check ran with them.
    *((["check", *TINY, "--impls", "xla", "--no-grads", "--tolerance", value],
       "--tolerance: expected a positive number") for value in ("-1", "0", "nan", "inf")),
    *((["bench", "--seq-lens", "32", "--tokens", "64", "--hidden", "32", "--head-dim", "16",
        "--impls", "standard", "--time-limit", value], "--time-limit: expected a positive number")
      for value in ("-1", "0", "nan", "x")),
])
def test_bad_options_exit_2(argv, message, capsys):
    code, err = _exit_code(argv, capsys)
    assert code == 2 and message in err


def test_bench_tiny(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--seq-lens", "32,64", "--tokens", "128", "--hidden", "32",
            "--head-dim", "16", "--impls", "standard,pallas_flash_xla", "--iters", "1",
            "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "CPU" in out and "pallas_flash_xla" in out and "1.00×" in out
    result = json.loads(out_json.read_text())
    points = result["points"]
    assert len(points) == 2 * 2
    assert all(p["error"] is None and p["speedup_vs_standard"] > 0 for p in points)
    assert out_png.stat().st_size > 0


def test_bench_backward_stops_at_the_time_limit(tmp_path, monkeypatch, capsys):
    """Points that would start after --time-limit are listed as not run."""
    ticks = iter(range(0, 1000, 10))  # a clock that moves 10 s each time it is read
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    monkeypatch.setattr(cli, "_bench_point", lambda *args: (1.0, None))
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--seq-lens", "32", "--tokens", "64", "--hidden", "32", "--head-dim", "16",
            "--impls", "pallas_flash_xla", "--backward", "--time-limit", "15",
            "--json", str(out_json)]
    assert cli.main(argv) == 0
    points = json.loads(out_json.read_text())["points"]
    assert [p["pass"] for p in points] == ["fwd", "fwdbwd"]
    assert points[0]["ms"] == 1.0 and points[0]["error"] is None   # read at 10 s of 15
    assert points[1]["ms"] is None and points[1]["error"].startswith("not run")   # at 20 s
    assert "python -m benchmarks.suite" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["memory", "--seq-lens", "64", "--heads", "1", "--head-dim", "16"],
    ["bench", "--seq-lens", "32", "--tokens", "64", "--hidden", "32", "--head-dim", "16",
     "--impls", "standard"],
], ids=["memory", "bench"])
def test_plot_without_matplotlib_stops_before_any_work(argv, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed

    def work(*args):
        raise AssertionError("the table was computed before --plot was checked")
    monkeypatch.setattr(cli, "compiled_temp_bytes", work)
    monkeypatch.setattr(cli, "_bench_point", work)
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--plot", str(tmp_path / "plot.png")])
    message = str(info.value.code)
    assert "\n" not in message and "--plot needs matplotlib" in message
    assert 'pip install "pallas-flash[bench]"' in message
    assert not (tmp_path / "plot.png").exists()


def test_the_package_imports_neither_benchmarks_nor_models(tmp_path):
    """They are not installed with the wheel: the CLI must work without them, even where
    the repository root is on the path."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = ("import sys, pallas_flash.tutorial.cli, pallas_flash.tuning; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'models')))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_the_product_never_imports_the_tutorial():
    """pallas_flash/tutorial/ sits on top of the package: no other module of it imports the
    tutorial (``__main__``, the command line's second entry point, aside)."""
    package = ROOT / "pallas_flash"
    imports = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("tutorial", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imports += [(path.name, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                imports += [(path.name, f"{node.module}.{alias.name}") for alias in node.names]
    assert len(imports) > 100   # the walk saw the package
    assert [(name, module) for name, module in imports
            if module.startswith("pallas_flash.tutorial")] == []


def test_memory_tiny(tmp_path, capsys):
    png = tmp_path / "memory.png"
    argv = ["memory", "--seq-lens", "64,128", "--heads", "1", "--head-dim", "16",
            "--backward", "--plot", str(png)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("64 ", "128 "))]
    assert [r[0] for r in rows] == ["64", "128"]
    assert all(r[-1] == "yes" for r in rows)
    assert png.stat().st_size > 0


def test_compile_out_of_memory_is_a_memory_error():
    def runs_out(q):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 64 GiB")

    def other_failure(q):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    shape = jax.ShapeDtypeStruct((4,), jnp.float32)
    with pytest.raises(MemoryError, match="out of device memory"):
        cli.compiled_temp_bytes(runs_out, shape)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        cli.compiled_temp_bytes(other_failure, shape)


def test_memory_stops_where_standard_attention_does_not_compile(monkeypatch, capsys):
    """On the H200, compiling standard attention's backward at L 32768 ran out of device
    memory (XLA's autotuner): that length is where standard attention no longer fits."""
    compiled = []

    def temp_bytes(fn, *shapes):
        length = shapes[0].shape[1]
        compiled.append((fn.__name__, length))
        if (fn.__name__, length) == ("standard", 128):
            raise MemoryError("compiling ran out of device memory")
        return 1024
    monkeypatch.setattr(cli, "compiled_temp_bytes", temp_bytes)
    monkeypatch.setattr(cli, "_device_memory_limit", lambda: 2**40)
    argv = ["memory", "--seq-lens", "64,128,256", "--heads", "1", "--head-dim", "16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()
            if line.strip().startswith(("64 ", "128 ", "256 "))]
    assert [(r[0], r[-1]) for r in rows] == [("64", "yes"), ("128", "NO")]
    assert "no longer fits at L=128" in out and "compiling it ran out" in out
    assert ("standard", 256) not in compiled and ("tiled", 128) in compiled


def test_io_model_only_on_cpu(capsys):
    assert cli.main(["io", "--seq-lens", "1024,2048", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "model only" in out and "227 KiB" in out
    assert "256×64" in out  # the Triton heuristic's tiles at head_dim 128, bf16


def test_io_mosaic_tiles(capsys):
    assert cli.main(["io", "--impl", "mosaic", "--seq-lens", "4096", "--head-dim", "64"]) == 0
    assert "192×128" in capsys.readouterr().out  # CTA = 3 consumers × 64 rows, 128-key blocks


def test_python_dash_m(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pallas_flash", "--help"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "check" in done.stdout and "memory" in done.stdout

"""``benchmarks.gpu_report``: parts in order, time shares, logs and the one archive."""

from __future__ import annotations

import sys
import tarfile

import pytest

from benchmarks import gpu_report


def _fake_parts(out, pytest_k="", suite_head_dims=""):
    del pytest_k, suite_head_dims
    say = (sys.executable, "-c")
    return {
        "fast": gpu_report.Part("fast", 1.0, (
            (*say, "print('limit', '{time_limit}')"),
            (*say, f"open({str(out / 'result.json')!r}, 'w').write('{{}}')"),
        )),
        "slow": gpu_report.Part("slow", 1.0, ((*say, "import time; time.sleep(30)"),)),
        "fails": gpu_report.Part("fails", 1.0, ((*say, "raise SystemExit(3)"),)),
    }


def test_runs_parts_in_order_and_packs_everything(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_report, "parts", _fake_parts)
    status = gpu_report.main(["--out", str(tmp_path), "--budget", "9",
                              "--parts", "fast,slow,fails"])
    assert status == 124  # the slow part ran out of its share
    report = tmp_path / "gpu-report"
    fast_log = (report / "fast.log").read_text()
    assert "limit" in fast_log and "{time_limit}" not in fast_log  # share substituted
    assert "stopped after" in (report / "slow.log").read_text()
    assert "raise SystemExit(3)" in (report / "fails.log").read_text()
    with tarfile.open(tmp_path / "gpu-report.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-report/fast.log", "gpu-report/slow.log", "gpu-report/fails.log",
            "gpu-report/result.json"} <= names
    table = capsys.readouterr().out.splitlines()[-3:]
    assert [row.split()[:3] for row in table] == [["fast", "-", "0"], ["slow", "-", "124"],
                                                  ["fails", "-", "3"]]


def _lane_parts(out, pytest_k="", suite_head_dims=""):
    del out, pytest_k, suite_head_dims
    gpu_and_sleep = ("import os, time; start = time.time(); time.sleep(2); "
                     "print('gpu', os.environ['CUDA_VISIBLE_DEVICES'], start, time.time())")
    return {name: gpu_report.Part(name, 1.0, ((sys.executable, "-c", gpu_and_sleep),))
            for name in ("a", "b", "c")}


def test_lanes_run_at_the_same_time_one_gpu_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_report, "parts", _lane_parts)
    assert gpu_report.main(["--out", str(tmp_path), "--budget", "60",
                            "--parts", "a,b;c"]) == 0
    printed = {name: (tmp_path / "gpu-report" / f"{name}.log").read_text().split("gpu ")[1]
               for name in "abc"}
    gpu, start, end = ({name: cast(words.split()[i]) for name, words in printed.items()}
                       for i, cast in enumerate((int, float, float)))
    assert gpu == {"a": 0, "b": 0, "c": 1}
    assert end["a"] <= start["b"]  # one lane: in order
    assert start["c"] < min(end["a"], end["b"]) and start["a"] < end["c"]  # lanes: together
    table = capsys.readouterr().out.splitlines()[-3:]
    assert [row.split()[:3] for row in table] == [["a", "0", "0"], ["b", "0", "0"],
                                                  ["c", "1", "0"]]


def test_real_catalogue_and_bad_options(tmp_path):
    catalogue = gpu_report.parts(tmp_path, pytest_k="mosaic", suite_head_dims="128,256")
    assert list(catalogue) == ["tests", "suite", "backward", "variants", "training", "cli"]
    assert catalogue["tests"].commands[0][-2:] == ("-k", "mosaic")
    suite = catalogue["suite"].commands[0]
    assert gpu_report.TIME_LIMIT in suite
    assert suite[suite.index("--head-dims") + 1] == "128,256"
    assert gpu_report.TIME_LIMIT in catalogue["cli"].commands[-1]  # bench stops in time
    with pytest.raises(SystemExit):
        gpu_report.main(["--out", str(tmp_path), "--parts", "tests,nope"])
    with pytest.raises(SystemExit):
        gpu_report.main(["--out", str(tmp_path), "--budget", "0"])
    for repeated in ("tests;tests", "tests;", "suite,cli;;training"):
        with pytest.raises(SystemExit):
            gpu_report.main(["--out", str(tmp_path), "--parts", repeated])

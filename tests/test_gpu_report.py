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
    assert [row.split()[:2] for row in table] == [["fast", "0"], ["slow", "124"],
                                                  ["fails", "3"]]


def test_real_catalogue_and_bad_options(tmp_path):
    catalogue = gpu_report.parts(tmp_path, pytest_k="mosaic", suite_head_dims="128,256")
    assert list(catalogue) == ["tests", "suite", "probes", "variants", "training", "cli"]
    assert catalogue["tests"].commands[0][-2:] == ("-k", "mosaic")
    suite = catalogue["suite"].commands[0]
    assert gpu_report.TIME_LIMIT in suite
    assert suite[suite.index("--head-dims") + 1] == "128,256"
    assert gpu_report.TIME_LIMIT in catalogue["cli"].commands[-1]  # bench stops in time
    with pytest.raises(SystemExit):
        gpu_report.main(["--out", str(tmp_path), "--parts", "tests,nope"])
    with pytest.raises(SystemExit):
        gpu_report.main(["--out", str(tmp_path), "--budget", "0"])

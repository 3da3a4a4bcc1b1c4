"""benchmarks.training: the summary, the loss comparison and the report of a failed run."""

from __future__ import annotations

import json

import pytest

from benchmarks import training


def _history(losses, rates):
    steps = list(range(1, len(losses) + 1))
    return {"step": steps, "loss": losses, "val_step": [0, len(losses)],
            "val_loss": [5.0, losses[-1]], "rate_step": steps[9::10],
            "tokens_per_s": rates}


def test_summary_leaves_out_the_compiling_interval():
    history = _history([3.0] * 30, [10.0, 100.0, 120.0])
    summary = training.summarize(history)
    assert summary["tokens_per_s"] == 110.0
    assert summary["final_val_loss"] == 3.0


def test_loss_gaps_separate_early_rounding_from_later_drift():
    a = _history([4.0] * 20 + [2.0] * 10, [1.0])
    b = _history([4.001] * 20 + [2.5] * 10, [1.0])
    early, worst = training.loss_gaps(a, b)
    assert early == pytest.approx(0.001)
    assert worst == pytest.approx(0.5)


def test_markdown_reports_ratios_and_failures():
    runs = {"ours": {**training.summarize(_history([3.0] * 30, [1.0, 300.0, 300.0])),
                     "history": _history([3.0] * 30, [1.0, 300.0, 300.0])},
            "cudnn": {**training.summarize(_history([3.0] * 30, [1.0, 200.0, 200.0])),
                      "history": _history([3.0] * 30, [1.0, 200.0, 200.0])},
            "xla_dense": {"error": "JaxRuntimeError: RESOURCE_EXHAUSTED"}}
    text = training.markdown({"device": "cpu", "date": "2026-11-29", "jax_version": "0.11.2",
                              "command": "python -m benchmarks.training", "preset": "tiny",
                              "steps": 30, "seed": 0, "tokens_per_step": 64, "runs": runs})
    assert "| ours | 300 | 1.50× |" in text
    assert "| xla_dense | failed: `JaxRuntimeError: RESOURCE_EXHAUSTED` |" in text


@pytest.mark.parametrize("argv, message", [
    (["--implementations", "ours,flash9"], "--implementations"),
    (["--steps", "5"], "--steps"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        training.parse_args(argv)
    assert message in capsys.readouterr().err


def test_each_finished_run_is_saved_before_the_next_starts(tmp_path, monkeypatch):
    """A run stopped by a time limit keeps the implementations that finished."""
    seen_on_disk = []

    def fake_train(args):
        saved = sorted(tmp_path.glob("training-*.json"))
        seen_on_disk.append(json.loads(saved[0].read_text())["runs"] if saved else None)
        if args.implementation == "cudnn":
            raise RuntimeError("out of memory")
        return _history([3.0] * 30, [1.0, 200.0, 200.0])
    monkeypatch.setattr(training.training, "train", fake_train)
    training.main(["--preset", "tiny", "--steps", "30", "--implementations", "ours,cudnn,xla",
                   "--out", str(tmp_path)])
    assert seen_on_disk[0] is None
    assert list(seen_on_disk[1]) == ["ours"] and list(seen_on_disk[2]) == ["ours", "cudnn"]
    result = json.loads(next(tmp_path.glob("training-*.json")).read_text())
    assert result["runs"]["cudnn"]["error"] == "RuntimeError: out of memory"
    assert result["runs"]["xla"]["tokens_per_s"] == 200.0
    assert next(tmp_path.glob("training-*.png")).stat().st_size > 0

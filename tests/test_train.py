"""models.train: the loss falls, and a resumed run continues exactly where it stopped."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from models.train import build_parser, check_schedule, main, parse_args, train

_TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        (root / f"module{i}.py").write_text(f"# module {i}\n" + _TEXT * (3 + i))
    return root


def _args(corpus: Path, out: Path, *extra: str):
    return parse_args(["--data", str(corpus), "--out", str(out), "--seq-len", "32",
                       "--batch-size", "8", "--eval-rows", "8", "--warmup-steps", "3",
                       "--val-fraction", "0.25", "--data-parallel", "1", *extra])


def test_a_few_steps_reduce_the_loss(corpus, tmp_path, capsys):
    history = train(_args(corpus, tmp_path, "--steps", "25", "--sample-tokens", "8"))
    assert history["step"] == list(range(1, 26))
    assert history["val_step"][0] == 0
    assert np.mean(history["loss"][-5:]) < history["loss"][0] - 2.0
    assert history["val_loss"][-1] < history["val_loss"][0] - 2.0
    assert (tmp_path / "loss.png").stat().st_size > 0
    captured = capsys.readouterr()
    printed = captured.out
    assert f"loss plot: {tmp_path / 'loss.png'}" in printed
    # The progress bar goes to stderr, so the results on stdout can be piped.
    assert "25/25" in captured.err and "25/25" not in printed
    assert "--- sample" in printed and "checkpoint: " in printed


def test_resume_gives_the_same_next_losses(corpus, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    flags = ("--steps", "6", "--checkpoint-every", "3", "--eval-every", "3",
             "--sample-tokens", "0", "--learning-rate", "3e-3")
    want = train(_args(corpus, straight, *flags))
    with pytest.raises(ValueError, match="--resume"):
        train(_args(corpus, straight, *flags))      # a fresh run must not mix into it
    # Nor a resumed run with another schedule (refused before any work). Step 7 (update
    # count 6) of the 6-step run is past the decay's end: 10% of the peak 3e-3. On 9 steps
    # (warm-up over counts 0..2, cosine over 3..9) it is half-way down: 1.65e-3.
    longer = (*flags[:1], "9", *flags[2:], "--resume")
    with pytest.raises(ValueError, match=r"\(--steps 6 -> 9\): resuming at step 7, its "
                                         r"learning rate would change from 0\.0003 to "
                                         r"0\.00165, .* pass --new-schedule"):
        train(_args(corpus, straight, *longer))
    with pytest.raises(ValueError, match="--steps 5 is before the checkpoint's step 6"):
        train(_args(corpus, straight, *flags[:1], "5", *flags[2:], "--resume"))
    with pytest.raises(ValueError, match="--resume only"):
        _args(corpus, straight, *flags, "--new-schedule")
    # A run that died after its step-3 checkpoint: same folder, minus what came later.
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "6")
    got = train(_args(corpus, crashed, *flags, "--resume"))
    assert got["step"] == want["step"]
    np.testing.assert_allclose(got["loss"][3:], want["loss"][3:], rtol=1e-6)
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)


def test_a_second_run_on_the_same_out_is_a_one_line_error(tmp_path, capsys):
    """Not a traceback: the command stops before any work and says what to pass."""
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    manager.save(3, args=ocp.args.StandardSave({"w": np.zeros(2)}))
    manager.wait_until_finished()
    with pytest.raises(SystemExit) as info:
        main(["--preset", "tiny", "--out", str(tmp_path), "--data-parallel", "1"])
    message = str(info.value.code)
    assert "\n" not in message and "latest: step 3" in message
    assert "--resume" in message and "--overwrite" in message
    assert "parameters" not in capsys.readouterr().out   # the model was never built


def test_help_describes_every_option():
    text = build_parser().format_help()
    for flag in ("--preset", "--steps", "--batch-size", "--seq-len", "--implementation",
                 "--out", "--seed", "--resume", "--data", "cudnn", "xla_dense",
                 "--data-parallel", "--context-parallel"):
        assert flag in text
    args = parse_args(["--preset", "small"])
    assert (args.seq_len, str(args.out)) == (4096, "runs/small")


def test_new_schedule_on_resume_is_explained_and_recorded(tmp_path, capsys):
    args = argparse.Namespace(steps=2, warmup_steps=1, learning_rate=3e-3, new_schedule=False)
    check_schedule(args, tmp_path, checkpoint_step=None)    # a fresh run records its flags
    capsys.readouterr()
    args.steps, args.new_schedule = 3, True
    check_schedule(args, tmp_path, checkpoint_step=2)
    # Step 3 (update count 2) of the 2-step run is past the decay's end: 10% of the peak,
    # 3e-4. On the 3-step schedule (warm-up over count 0, cosine over counts 1..3) it is
    # half-way down the cosine: 3e-4 + (3e-3 - 3e-4) / 2 = 1.65e-3.
    assert capsys.readouterr().out == (
        "new schedule: the run in this folder was trained on another schedule (--steps 2 -> "
        "3): resuming at step 3, its learning rate would change from 0.0003 to 0.00165, and "
        "the cosine decay end at step 3 (was 2)\n")
    assert json.loads((tmp_path / "schedule.json").read_text())["steps"] == 3
    check_schedule(args, tmp_path, checkpoint_step=2)        # now the run's own schedule
    assert capsys.readouterr().out == ""

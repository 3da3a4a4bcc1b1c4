"""models.train: the loss falls, and a resumed run continues exactly where it stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from models.train import build_parser, parse_args, train

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
                       "--val-fraction", "0.25", *extra])


def test_a_few_steps_reduce_the_loss(corpus, tmp_path, capsys):
    history = train(_args(corpus, tmp_path, "--steps", "25", "--sample-tokens", "8"))
    assert history["step"] == list(range(1, 26))
    assert history["val_step"][0] == 0
    assert np.mean(history["loss"][-5:]) < history["loss"][0] - 2.0
    assert history["val_loss"][-1] < history["val_loss"][0] - 2.0
    assert (tmp_path / "loss.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert f"loss plot: {tmp_path / 'loss.png'}" in printed
    assert "--- sample" in printed and "checkpoint: " in printed


def test_resume_gives_the_same_next_losses(corpus, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    flags = ("--steps", "6", "--checkpoint-every", "3", "--eval-every", "3",
             "--sample-tokens", "0")
    want = train(_args(corpus, straight, *flags))
    with pytest.raises(ValueError, match="--resume"):
        train(_args(corpus, straight, *flags))      # a fresh run must not mix into it
    # A run that died after its step-3 checkpoint: same folder, minus what came later.
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "6")
    got = train(_args(corpus, crashed, *flags, "--resume"))
    assert got["step"] == want["step"]
    np.testing.assert_allclose(got["loss"][3:], want["loss"][3:], rtol=1e-6)
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)


def test_help_describes_every_option():
    text = build_parser().format_help()
    for flag in ("--preset", "--steps", "--batch-size", "--seq-len", "--implementation",
                 "--out", "--seed", "--resume", "--data", "cudnn", "xla_dense"):
        assert flag in text
    args = parse_args(["--preset", "small"])
    assert (args.seq_len, str(args.out)) == (4096, "runs/small")

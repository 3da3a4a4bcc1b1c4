"""benchmarks/keras_hub.py --quick: the CPU smoke run of the KerasHub Llama benchmark."""

from __future__ import annotations

import json
import os

import pytest

# Keras picks its backend once, at import (the benchmark sets it too; this is for the skip).
os.environ["KERAS_BACKEND"] = "jax"
pytest.importorskip("keras_hub")  # the test set-up installs it: this runs in `make test`

from benchmarks import keras_hub as keras_hub_bench


def test_keras_hub_quick_on_cpu(tmp_path, capsys):
    """Every implementation trains and generates; in float32 the first losses agree and the
    greedy tokens are identical; JSON + table; bad flags raise."""
    assert keras_hub_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("keras-hub-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["impl"] for r in rows] == list(keras_hub_bench.IMPLEMENTATIONS)
    for r in rows:
        assert r["error"] is None, r
        assert r["train_tokens_per_s"] > 0 and r["generate_tokens_per_s"] > 0
        assert r["loss_gap"] < 1e-5 and r["tokens_equal"] == 1.0, r
    assert "| pallas_flash | " in capsys.readouterr().out
    assert json_path.with_suffix(".md").exists()
    for flags, match in ((["--impls", "nope"], "--impls"), (["--steps", "0"], "--steps"),
                         (["--heads", "3"], "--kv-heads"),
                         (["--max-length", "64"], "--max-length")):
        with pytest.raises(ValueError, match=match):
            keras_hub_bench.parse_args(["--quick", *flags])

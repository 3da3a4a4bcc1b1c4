"""models.train across devices, on the eight CPU devices of tests/conftest.py: data and
context parallel steps give the losses and parameters of one device, bad mesh flags fail
before any work, and a run checkpointed on a mesh resumes where it stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from support import collectives

from models import data
from models import train as training
from models.train import (
    CONTEXT,
    DATA,
    batch_placer,
    init_training,
    make_mesh,
    parse_args,
    train,
    with_targets,
)
from models.transformer import TransformerConfig

# Small enough to compile in seconds; GQA, and several documents per row (_rows).
CONFIG = TransformerConfig(d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=64,
                           seq_len=32)
STEPS = 3


def _rows() -> data.PackedRows:
    """Packed rows of 32 bytes holding 1-5 random documents each."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(32, 127, n).astype(np.uint8).tobytes()
            for n in rng.integers(3, 40, 60)]
    return data.pack(docs, CONFIG.seq_len)


def _steps(data_parallel: int, context_parallel: int = 1):
    """Losses of STEPS training steps, the parameters after them, and the collectives of
    the compiled step ({op: count}), on a mesh."""
    args = parse_args(["--seq-len", str(CONFIG.seq_len), "--batch-size", "8", "--steps", "10",
                       "--warmup-steps", "1", "--data-parallel", str(data_parallel),
                       "--context-parallel", str(context_parallel)])
    mesh = make_mesh(args)
    assert dict(mesh.shape) == {DATA: data_parallel, CONTEXT: context_parallel}
    _, (params, opt_state), (train_step, _) = init_training(args, CONFIG, mesh)
    place, rows = batch_placer(mesh, CONFIG.seq_len), _rows()
    batches = [place(data.train_batch(rows, args.batch_size, args.seed, step))
               for step in range(1, STEPS + 1)]
    compiled = train_step.lower(params, opt_state, batches[0]).compile()
    losses = []
    for batch in batches:
        params, opt_state, loss = compiled(params, opt_state, batch)
        losses.append(float(loss))
    for leaf in jax.tree.leaves(params):   # replicated over the mesh, not gathered to one
        assert leaf.sharding.mesh == mesh and leaf.sharding.is_fully_replicated
    return np.array(losses), jax.device_get(params), collectives(compiled.as_text())


@pytest.fixture(scope="module")
def one_device():
    return _steps(1)


def _assert_same_run(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 got[1], want[1])


def test_data_parallel_steps_match_one_device(one_device):
    got = _steps(4)
    assert got[0][-1] < got[0][0]          # the steps trained something
    _assert_same_run(got, one_device)
    # The loss terms and the gradient are all-reduced; no activation is gathered.
    assert one_device[2] == {} and set(got[2]) == {"all-reduce"}


@pytest.mark.parametrize(("data_parallel", "context_parallel"), [(2, 2)])
def test_context_parallel_steps_match_one_device(one_device, data_parallel,
                                                 context_parallel):
    got = _steps(data_parallel, context_parallel)
    _assert_same_run(got, one_device)
    # K/V go round the ring; the sequence is never gathered.
    assert set(got[2]) == {"all-reduce", "collective-permute"}


def test_targets_skip_document_starts_padding_and_the_last_column():
    rows = {"tokens": np.array([[5, 6, 7, 8, 0]]), "segment_ids": np.array([[1, 1, 2, 2, 0]]),
            "positions": np.array([[0, 1, 0, 1, 0]])}
    got = with_targets(rows)
    np.testing.assert_array_equal(got["targets"], [[6, 7, 8, 0, 0]])
    np.testing.assert_array_equal(got["weights"], [[1, 0, 1, 0, 0]])


def test_rows_are_split_in_zigzag_order_with_their_targets():
    """Device (d, i) of a 2 x 2 mesh holds rows 4d..4d+3, columns of global chunks i and
    3 - i (of 8 tokens): tokens, positions, segment ids and targets alike."""
    mesh = make_mesh(parse_args(["--batch-size", "8", "--seq-len", "32", "--data-parallel",
                                 "2", "--context-parallel", "2"]))
    rows = _rows().rows(np.arange(8))
    batch = batch_placer(mesh, 32)(rows)
    want = with_targets(rows)
    assert sorted(batch) == sorted(want) == ["positions", "segment_ids", "targets", "tokens",
                                             "weights"]
    for name, array in batch.items():
        assert len(array.addressable_shards) == 4
        for shard in array.addressable_shards:
            row_slice, col_slice = shard.index
            i = col_slice.start // 16
            cols = np.r_[8 * i:8 * i + 8, 8 * (3 - i):8 * (3 - i) + 8]
            np.testing.assert_array_equal(shard.data, want[name][row_slice][:, cols])


def test_data_parallel_defaults_to_every_local_device():
    assert jax.local_device_count() == 8
    for flags, shape in [([], (8, 1)), (["--context-parallel", "2"], (4, 2)),
                         (["--context-parallel", "3", "--seq-len", "48"], (2, 3))]:
        mesh = make_mesh(parse_args(["--batch-size", "8", *flags]))
        assert (mesh.shape[DATA], mesh.shape[CONTEXT]) == shape


@pytest.mark.parametrize(("flags", "message"), [
    (["--data-parallel", "4", "--context-parallel", "4"],
     r"--data-parallel 4 x --context-parallel 4 needs 16 devices; there are 8"),
    (["--data-parallel", "3"], r"--batch-size 8 does not split over --data-parallel 3: "),
    (["--batch-size", "6"], r"--batch-size 6 does not split over --data-parallel 8 \(the "
                            r"default: the 8 local device"),
    (["--context-parallel", "2", "--seq-len", "30"],
     r"--seq-len 30 does not split over --context-parallel 2: .* a multiple of 4"),
    (["--context-parallel", "2", "--implementation", "xla_dense"],
     r"--context-parallel 2 runs attention through pallas_flash.ring_attention, which "
     r"--implementation xla_dense"),
    (["--implementation", "mosaic"], r"--implementation mosaic cannot run on the cpu"),
    (["--data-parallel", "0"], r"--data-parallel must be at least 1, got 0"),
    (["--context-parallel", "0"], r"--context-parallel must be at least 1, got 0"),
])
def test_bad_mesh_flags_fail_before_any_work(tmp_path, flags, message):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train(parse_args(["--batch-size", "8", "--seq-len", "32", "--out", str(out), *flags]))
    assert not out.exists()


def test_resume_on_a_mesh_continues_the_run(tmp_path, monkeypatch):
    """Checkpointed on a 2 x 2 mesh (data x context): resuming on it gives the losses of
    the uninterrupted run; resuming on one device gives them to rounding."""
    monkeypatch.setitem(training.PRESETS, "tiny", CONFIG)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, length in enumerate([200, 310, 90, 150]):
        (corpus / f"doc{i}.txt").write_bytes(bytes(range(32, 127)) * (length // 95 + 1))
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"

    def run(out: Path, *extra: str):
        return train(parse_args([
            "--data", str(corpus), "--out", str(out), "--seq-len", "32", "--batch-size", "4",
            "--eval-rows", "4", "--warmup-steps", "1", "--steps", "4", "--eval-every", "2",
            "--sample-tokens", "0", "--val-fraction", "0.25", "--data-parallel", "2",
            "--context-parallel", "2", *extra]))

    want = run(straight)
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "4")     # died after its step-2 checkpoint
    shutil.copytree(crashed, tmp_path / "moved")
    got = run(crashed, "--resume")
    assert got["step"] == want["step"] == [1, 2, 3, 4]
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)
    moved = run(tmp_path / "moved", "--resume", "--data-parallel", "1", "--context-parallel",
                "1")
    np.testing.assert_allclose(moved["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(moved["val_loss"], want["val_loss"], rtol=1e-5)

"""The autotuner on CPU: Triton kernels in interpret mode, a fake timer, a temporary cache."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
import pallas_flash.triton as triton_backend
from pallas_flash import tuning as tuning_module
from pallas_flash.contract import Kernels
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic.config import SMEM_BUDGET, padded_head_dim
from pallas_flash.triton import TritonConfig
from pallas_flash.tuning import (
    cache_key,
    cache_path,
    candidate_configs,
    tune,
)
from pallas_flash.xla import XlaConfig

Q_SHAPE, KV_SHAPE = (1, 32, 2, 16), (1, 32, 1, 16)  # a GQA group of 2
DEFAULT = triton_backend.default_config(Q_SHAPE, KV_SHAPE, jnp.float32, MaskSpec(32, 32))
FAST = TritonConfig(block_q=16, block_kv=16)
BROKEN = TritonConfig(block_q=16, block_kv=32)  # its kernel output is corrupted below
FAILING = TritonConfig(block_q=32, block_kv=16)  # its kernel raises below
TUNE = dict(implementation="triton", interpret=True)


class FakeTimer:
    """Milliseconds from a table, so that the choice does not depend on the machine."""

    def __init__(self, ms: dict) -> None:
        self.ms = ms
        self.timed: list = []

    def __call__(self, config, fn, args) -> float:
        del fn, args
        self.timed.append(config)
        return self.ms[config]


def inputs(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(7), 3)
    return (jax.random.normal(keys[0], Q_SHAPE, dtype),
            jax.random.normal(keys[1], KV_SHAPE, dtype),
            jax.random.normal(keys[2], KV_SHAPE, dtype))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets an empty cache directory (never the user's)."""
    monkeypatch.setenv("PALLAS_FLASH_CACHE_DIR", str(tmp_path))
    return tmp_path


def install_faulty_kernels(monkeypatch) -> list:
    """The Triton forward raises for FAILING (as a tiling over the shared memory would) and
    returns a wrong output for BROKEN; returns the configs the forward was traced with."""
    real = triton_backend.KERNELS
    seen = []

    def forward(q, k, v, segment_ids, *, config, **kwargs):
        seen.append(config)
        if config == FAILING:
            raise RuntimeError("out of shared memory: 300000 bytes, 232448 available")
        out, lse = real.forward(q, k, v, segment_ids, config=config, **kwargs)
        return (out + 1 if config == BROKEN else out), lse

    monkeypatch.setattr(triton_backend, "KERNELS",
                        Kernels(name="triton", forward=forward, backward=real.backward))
    return seen


@pytest.fixture
def faulty_kernels(monkeypatch) -> list:
    return install_faulty_kernels(monkeypatch)


@pytest.fixture(scope="module")
def tuned():
    """One tuning over four candidates; BROKEN would be the fastest if it were timed."""
    timer = FakeTimer({DEFAULT: 3.0, FAST: 1.0, BROKEN: 0.5, FAILING: 0.1})
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_faulty_kernels(monkeypatch)
        tuning = tune(*inputs(), candidates=[DEFAULT, BROKEN, FAILING, FAST], timer=timer,
                      cache=False, **TUNE)
    return tuning, timer


def trial_of(tuning, config):
    return next(trial for trial in tuning.trials if trial.config == config)


def test_chooses_the_fastest_candidate_that_runs_and_agrees(tuned):
    tuning, timer = tuned
    assert tuning.config == FAST
    assert timer.timed == [DEFAULT, FAST]
    assert trial_of(tuning, FAST).median_ms == 1.0 and trial_of(tuning, FAST).skipped is None


def test_a_failing_candidate_is_skipped_with_its_reason(tuned):
    trial = trial_of(tuned[0], FAILING)
    assert trial.median_ms is None
    assert trial.skipped == "failed: RuntimeError: out of shared memory: 300000 bytes, " \
                            "232448 available"


def test_a_candidate_whose_output_disagrees_is_rejected(tuned):
    trial = trial_of(tuned[0], BROKEN)
    assert trial.median_ms is None
    assert trial.skipped.startswith("rejected: outputs differ from the default config's")


def test_the_cache_round_trips_without_timing_again(cache_dir):
    timer = FakeTimer({DEFAULT: 2.0, FAST: 1.0})
    first = tune(*inputs(), candidates=[DEFAULT, FAST], timer=timer, **TUNE)
    assert not first.from_cache and len(timer.timed) == 2
    assert cache_path() == cache_dir / "autotune.json"

    second = tune(*inputs(), candidates=[DEFAULT, FAST], timer=timer, **TUNE)
    assert second.from_cache and len(timer.timed) == 2  # nothing timed again
    assert (second.config, second.trials) == (first.config, first.trials)
    # Another length in the same power-of-two bucket reuses the entry.
    q, k, v = (x[:, :30] for x in inputs())
    assert pf.autotune(q, k, v, timer=timer, **TUNE) == FAST and len(timer.timed) == 2
    entry = json.loads(cache_path().read_text())["entries"][first.cache_key]
    assert entry["config"] == dataclasses.asdict(FAST)


def test_the_cache_key_separates_devices_dtypes_causal_and_groups():
    def key(q_shape=Q_SHAPE, kv_shape=KV_SHAPE, dtype=jnp.bfloat16, **kwargs):
        kwargs = dict(dict(implementation="triton", is_causal=False,
                           device_kind="NVIDIA H200"), **kwargs)
        return cache_key(q_shape, kv_shape, dtype, **kwargs)

    base = key()
    variants = [key(device_kind="NVIDIA H100 80GB HBM3"), key(dtype=jnp.float16),
                key(is_causal=True), key(q_shape=(1, 32, 4, 16)),
                key(implementation="mosaic"), key(backward=True), key(interpret=True),
                key(q_shape=(1, 64, 2, 16)), key(q_shape=(1, 32, 2, 32), kv_shape=(1, 32, 1, 32))]
    assert len({base, *variants}) == len(variants) + 1
    # Same bucket: lengths rounded up to a power of two; batch and head counts scale the grid.
    assert key(q_shape=(8, 17, 8, 16), kv_shape=(8, 20, 4, 16)) == base
    assert jax.__version__ in base


def test_a_corrupt_cache_file_is_ignored_with_a_warning():
    cache_path().write_text("{this is not json")
    timer = FakeTimer({DEFAULT: 2.0, FAST: 1.0})
    with pytest.warns(UserWarning, match="ignoring the autotune cache"):
        tuning = tune(*inputs(), candidates=[DEFAULT, FAST], timer=timer, **TUNE)
    assert tuning.config == FAST
    assert tuning.cache_key in json.loads(cache_path().read_text())["entries"]  # rewritten


def test_attention_autotune_tunes_under_jit_and_matches_the_reference(monkeypatch,
                                                                       faulty_kernels):
    # Two forward candidates instead of the full table keep the test fast.
    monkeypatch.setattr(tuning_module, "_TRITON_FORWARD", ((16, 16, 4, 2),))
    q, k, v = inputs()

    @jax.jit
    def attend(q, k, v):
        return pf.attention(q, k, v, is_causal=True, config="autotune", **TUNE)

    out = attend(q, k, v)  # a cache miss: tunes at trace time, on fresh arrays
    entries = json.loads(cache_path().read_text())["entries"]
    (entry,) = entries.values()
    chosen = TritonConfig(**entry["config"])
    expected = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2),
                                            jnp.repeat(v, 2, axis=2), is_causal=True)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)

    # Cache hits, under jit and eagerly: no tuning, one trace of the kernels with the tuned
    # config. (The jit caches are cleared first: the traced call above reused the kernel
    # trace that the tuner's timing of that config had made.)
    eager = functools.partial(pf.attention, is_causal=True, config="autotune", **TUNE)
    for call in (attend, eager):
        jax.clear_caches()
        traced = len(faulty_kernels)
        again = call(q, k, v)
        assert faulty_kernels[traced:] == [chosen]
        np.testing.assert_allclose(again, out, atol=1e-6)


def test_backward_tuning_compares_gradients_too(faulty_kernels):
    timer = FakeTimer({DEFAULT: 2.0, FAST: 1.0})
    tuning = tune(*inputs(), candidates=[DEFAULT, FAST], backward=True, timer=timer,
                  cache=False, **TUNE)
    assert tuning.config == FAST and timer.timed == [DEFAULT, FAST]


def test_xla_has_nothing_to_time():
    timer = FakeTimer({})
    tuning = tune(*inputs(), implementation="xla", timer=timer)
    assert tuning.config == XlaConfig() and tuning.trials == () and timer.timed == []
    assert not cache_path().exists()


def test_candidate_lists():
    for head_dim in (64, 128, 256):
        shape = (1, 4096, 8, head_dim)
        configs = candidate_configs("mosaic", shape, shape, jnp.bfloat16)
        assert len(configs) == len(set(configs)) >= 2
        for config in configs:
            need = config.smem_bytes(padded_head_dim(head_dim), 2, segments=True)
            assert need <= SMEM_BUDGET
    configs = candidate_configs("triton", Q_SHAPE, KV_SHAPE, jnp.float32)
    assert configs[0] == DEFAULT and len(configs) == len(set(configs)) >= 2
    assert max(max(c.block_q, c.block_kv) for c in configs) == 32  # capped at the lengths


def test_bad_arguments_raise_value_error():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="config must be None, 'autotune' or a TritonConfig"):
        pf.attention(q, k, v, config="fastest", **TUNE)
    with pytest.raises(ValueError, match="config must be"):
        pf.attention(q, k, v, config=XlaConfig(), **TUNE)
    with pytest.raises(ValueError, match="candidates must not be empty"):
        tune(q, k, v, candidates=[], **TUNE)
    with pytest.raises(ValueError, match="candidates for implementation='triton'"):
        tune(q, k, v, candidates=[XlaConfig()], **TUNE)
    with pytest.raises(ValueError, match="iters"):
        tune(q, k, v, iters=0, **TUNE)
    with pytest.raises(ValueError, match="is_causal"):
        tune(q, k, v, is_causal=1, **TUNE)
    with pytest.raises(ValueError, match="implementation must be one of"):
        tune(q, k, v, implementation="cuda")
    with pytest.raises(ValueError, match="rank 4"):
        tune(q[0], k, v, **TUNE)

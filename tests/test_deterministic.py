"""``attention(..., deterministic=True)``: bitwise-reproducible gradients on every backend.

* The argument's checks, and the one decision (:func:`pallas_flash.dispatch.
  deterministic_backward`: the argument or ``XLA_FLAGS``).
* On the Mosaic path, that it selects the separate dQ kernel where the heuristic picks the
  fused one (traced, not run), and refuses a given fused-dQ backward config.
* On every backend (Mosaic and Triton in interpret mode), the VJP twice: the same bits,
  and gradients within tolerance of the float64 oracle. On the CPU every backward is
  reproducible anyway (the interpreter has no TMA reduce-add): these pin the argument's
  path through the API; the bits that can differ are checked on the H200
  (tests/gpu/test_deterministic_gpu.py).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import BACKENDS, bits, random_qkv, rel_err, tolerance

import pallas_flash as pf
from pallas_flash import dispatch
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import (
    MosaicBackwardConfig,
    MosaicCallConfig,
    MosaicConfig,
    default_backward_config,
)
from pallas_flash.mosaic.config import backward_config
from pallas_flash.reference import attention_float64

BF16 = jnp.bfloat16
# The package, not the function pallas_flash.mosaic re-exports under the same name.
mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")


@pytest.mark.parametrize("flag", [1, "true", None, jnp.asarray(True)])
def test_deterministic_must_be_a_bool(flag):
    q = jnp.zeros((1, 8, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="deterministic"):
        pf.attention(q, q, q, deterministic=flag)
    with pytest.raises(ValueError, match="deterministic"):
        pf.decode_attention(q[:, :1], q, q, deterministic=flag)
    pages = q.reshape(1, 8, 1, 16)
    with pytest.raises(ValueError, match="deterministic"):
        pf.paged_attention(q[:, :1], pages, pages, jnp.zeros((1, 1), jnp.int32),
                           jnp.ones((1,), jnp.int32), deterministic=flag)


def test_numpy_bool_is_taken():
    q = jnp.zeros((1, 8, 1, 16), jnp.float32)
    assert pf.attention(q, q, q, deterministic=np.bool_(True)).shape == q.shape


def test_cudnn_has_no_deterministic_argument():
    q = jnp.zeros((1, 8, 1, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="deterministic"):
        pf.attention(q, q, q, implementation="cudnn", deterministic=True)


@pytest.mark.parametrize(("xla_flags", "requested", "decided"), [
    ("", False, False), ("", True, True),
    ("--xla_gpu_deterministic_ops=false", False, False),
    ("--xla_gpu_deterministic_ops=false", True, True),
    ("--xla_gpu_deterministic_ops=1", False, True),
    ("--xla_dump_to=/tmp --xla_gpu_deterministic_ops", False, True),
    ("--xla_gpu_deterministic_ops_x=true", False, False)])
def test_one_decision_reads_argument_and_xla_flags(xla_flags, requested, decided,
                                                   monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    assert dispatch.deterministic_backward(requested) is decided


# --- the Mosaic path's choice ----------------------------------------------------------

# Shapes where the heuristic picks the fused dQ (head_dim <= 128, not short causal).
FUSED_BY_DEFAULT = [(64, False), (64, True), (128, False)]


@pytest.mark.parametrize(("head_dim", "causal"), FUSED_BY_DEFAULT)
def test_default_backward_config_honours_deterministic(head_dim, causal, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    shape = (1, 4096, 8, head_dim)
    mask = MaskSpec(seq_q=4096, seq_kv=4096, is_causal=causal)
    assert not default_backward_config(shape, shape, BF16, mask).deterministic
    config = default_backward_config(shape, shape, BF16, mask, deterministic=True)
    assert config.deterministic
    config.check_fits(head_dim)


def test_backward_config_refuses_a_given_fused_dq():
    shape = (1, 256, 2, 64)
    mask = MaskSpec(seq_q=256, seq_kv=256)
    fused = MosaicBackwardConfig(deterministic=False)
    for config in (fused, MosaicCallConfig(forward=MosaicConfig(), backward=fused)):
        assert backward_config(config, shape, shape, BF16, mask) == fused
        with pytest.raises(ValueError, match="deterministic"):
            backward_config(config, shape, shape, BF16, mask, deterministic=True)
    separate = MosaicBackwardConfig(deterministic=True, dq_block_kv=64)
    assert backward_config(separate, shape, shape, BF16, mask, deterministic=True) == separate
    # A forward config alone: the backward's heuristic, in its deterministic mode.
    assert backward_config(MosaicConfig(), shape, shape, BF16, mask,
                           deterministic=True).deterministic


@pytest.fixture
def dq_paths(monkeypatch) -> list:
    """Records which dQ path each traced Mosaic backward takes: ``"fused"`` (TMA
    reduce-adds from the dK/dV kernel) or ``"separate"`` (the dQ kernel)."""
    paths: list = []
    fused, separate = mosaic_backward._fused_dq, mosaic_backward.call_dq

    def spy_fused(*args, **kwargs):
        paths.append("fused")
        return fused(*args, **kwargs)

    def spy_separate(*args, **kwargs):
        paths.append("separate")
        return separate(*args, **kwargs)

    monkeypatch.setattr(mosaic_backward, "_fused_dq", spy_fused)
    monkeypatch.setattr(mosaic_backward, "call_dq", spy_separate)
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.clear_caches()  # a kernel call traced by an earlier test would not be traced again
    return paths


def _trace_mosaic_grads(deterministic, config=None, head_dim=64, causal=False):
    """Traces (does not run) the gradient of a GQA call through the Mosaic backward."""
    q, k, v, _ = random_qkv(1, 256, 256, 4, 2, head_dim, BF16)

    def loss(q, k, v):
        out = pf.attention(q, k, v, is_causal=causal, implementation="mosaic",
                           interpret=True, deterministic=deterministic, config=config)
        return out.astype(jnp.float32).sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(("head_dim", "causal"), FUSED_BY_DEFAULT)
def test_attention_selects_the_separate_dq_kernel(head_dim, causal, dq_paths):
    _trace_mosaic_grads(False, head_dim=head_dim, causal=causal)
    _trace_mosaic_grads(True, head_dim=head_dim, causal=causal)
    assert dq_paths == ["fused", "separate"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_decode_attention_passes_it_on(deterministic, dq_paths):
    """decode_attention's gradient (through its own chunked call), also where attention
    routes a decode step to it (on a GPU only, so here it is called directly)."""
    q, k, v, _ = random_qkv(2, 4, 1024, 4, 2, 64, BF16)

    def loss(q, k, v):
        out = pf.decode_attention(q, k, v, implementation="mosaic", interpret=True,
                                  deterministic=deterministic)
        return out.astype(jnp.float32).sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert dq_paths == ["separate" if deterministic else "fused"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_paged_attention_passes_it_on(deterministic, dq_paths):
    """paged_attention on the Mosaic kernels: its gathered decode's gradient."""
    q, k, v, _ = random_qkv(2, 4, 1024, 4, 2, 64, BF16)
    pages = [x.reshape(2 * 8, 128, 2, 64) for x in (k, v)]
    table = jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8)
    lengths = jnp.full((2,), 1024, jnp.int32)

    def loss(q, key_pages, value_pages):
        out = pf.paged_attention(q, key_pages, value_pages, table, lengths,
                                 implementation="mosaic", interpret=True,
                                 deterministic=deterministic)
        return out.astype(jnp.float32).sum()

    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, *pages)
    assert dq_paths == ["separate" if deterministic else "fused"]


def test_xla_flag_selects_the_separate_dq_kernel(dq_paths, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    _trace_mosaic_grads(False)
    assert dq_paths == ["separate"]


def test_attention_refuses_a_given_fused_dq(dq_paths):
    with pytest.raises(ValueError, match="separate dQ kernel"):
        _trace_mosaic_grads(True, MosaicCallConfig(backward=MosaicBackwardConfig(
            deterministic=False)))
    assert dq_paths == []


# --- the same bits twice, and accuracy --------------------------------------------------


@pytest.mark.parametrize("backend", [pytest.param(b, id=b.name) for b in BACKENDS.values()])
def test_vjp_twice_gives_the_samebits(backend):
    """GQA (two query heads on one KV head, whose dK/dV a backward sums), causal, bottom-right
    with more keys than queries: the VJP twice (traced anew each time), bit for bit, and
    the float64 oracle's gradients."""
    dtype = backend.dtype if backend.name != "mosaic" else BF16
    q, k, v, d_out = random_qkv(1, 128, 192, 2, 1, 64, dtype)
    mask = MaskSpec(seq_q=128, seq_kv=192, is_causal=True, causal_alignment="bottom_right")

    def f(q, k, v):
        return backend.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                 deterministic=True)

    runs = [jax.vjp(f, q, k, v)[1](d_out) for _ in range(2)]
    for name, first, second in zip("qkv", *runs, strict=True):
        np.testing.assert_array_equal(bits(first), bits(second), err_msg=f"d{name}")
    _, _, want = attention_float64(q, k, v, mask=mask, d_out=np.asarray(d_out, np.float64))
    for name, got, ref in zip("qkv", runs[0], want, strict=True):
        assert rel_err(got, ref) < 2 * tolerance(dtype), (f"d{name}", rel_err(got, ref))

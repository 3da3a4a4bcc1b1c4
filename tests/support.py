"""Shared test helpers: the backends under test, fresh random inputs, error metrics.

Every backend of ``pallas_flash.attention`` runs the same suite (tests/test_attention.py,
tests/test_bias_mask.py, tests/test_properties.py): each is described once here by a
:class:`Backend`, whose flags say what it cannot run. Tests draw their parameters from
:func:`backends` / :func:`backend_cases`, so that a combination a backend lacks is never
generated (rather than generated and skipped: a skipped test is not a passing one), and a
new backend gets every case it supports by adding one entry to :data:`BACKENDS`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.fp8_format import E4M3_MAX
from pallas_flash.reference import EMPTY_ROW_LSE

_seed = itertools.count(1000)

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)


def _triton_config(head_dim: int):
    from pallas_flash.triton import TritonConfig

    del head_dim
    # Small tiles, so that short test sequences still span several blocks and partial masks.
    return TritonConfig(block_q=32, block_kv=16, bwd_block_q=16, bwd_block_kv=32)


def _mosaic_config(head_dim: int):
    from pallas_flash.mosaic import MosaicConfig

    del head_dim
    # The smallest tiles (CTAs of 2 x 64 rows, 64-key blocks): every case spans several
    # CTAs or key blocks. The backward picks its own tiling (the API's default).
    return MosaicConfig(block_q=64, block_kv=64, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of ``pallas_flash.attention`` and what it can run on this CPU.

    Attributes:
      name: its ``implementation=`` argument.
      interpret: run its kernels in interpret mode (Pallas kernels on CPU).
      dtypes: the input dtypes it takes; the first is the one single-dtype tests use
        (float32 where supported: the tightest tolerance).
      bias_max_head_dim: bias / mask arrays are taken up to this head dim.
      native_bias_grad: dbias comes from its own backward (else the API's call takes the
        Triton backward for it, on this backend's forward residuals).
      make_config: ``head_dim -> config`` for ``config=`` (None: the backend's default).
    """

    name: str
    interpret: bool
    dtypes: tuple[jnp.dtype, ...]
    bias_max_head_dim: int = 256
    native_bias_grad: bool = True
    make_config: Callable[[int], Any] | None = None

    @property
    def supports_float32(self) -> bool:
        return F32 in self.dtypes

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the tests that run one dtype per backend."""
        return self.dtypes[0]

    def supports(self, *, dtype=None, head_dim: int | None = None, bias: bool = False
                 ) -> bool:
        """Whether this backend runs a call with these properties (None: any)."""
        if dtype is not None and jnp.dtype(dtype) not in self.dtypes:
            return False
        return not (bias and head_dim is not None and head_dim > self.bias_max_head_dim)

    def kwargs(self, head_dim: int) -> dict:
        """``pallas_flash.attention`` keywords that select this backend."""
        kwargs: dict = dict(implementation=self.name)
        if self.interpret:
            kwargs["interpret"] = True
        if self.make_config is not None:
            kwargs["config"] = self.make_config(head_dim)
        return kwargs

    def attention(self, q, k, v, *args, **kwargs):
        """``pallas_flash.attention`` through this backend."""
        return pf.attention(q, k, v, *args, **kwargs, **self.kwargs(q.shape[-1]))

    def __str__(self) -> str:
        return self.name


BACKENDS = {
    "xla": Backend("xla", interpret=False, dtypes=(F32, BF16, F16)),
    # The Pallas Triton kernels in Pallas's interpret mode.
    "triton": Backend("triton", interpret=True, dtypes=(F32, BF16, F16),
                      make_config=_triton_config),
    # The Mosaic GPU kernels in Mosaic GPU interpret mode (plgpu.InterpretGPUParams): the
    # same barriers, pipelines and masking as on a Hopper GPU, but slow, so its cases are
    # small. 16-bit inputs only; bias / mask arrays up to head_dim 192; dbias from the
    # Triton backward (pallas_flash.mosaic.backward).
    "mosaic": Backend("mosaic", interpret=True, dtypes=(BF16, F16), bias_max_head_dim=192,
                      native_bias_grad=False, make_config=_mosaic_config),
}

# Backends that run float32 (tests/test_reference.py's seed check, ...).
IMPLEMENTATIONS = {name: b.kwargs(0) for name, b in BACKENDS.items() if b.supports_float32}


def implementation_kwargs(name: str, head_dim: int) -> dict:
    """``pallas_flash.attention`` keywords for backend ``name`` (see Backend.kwargs)."""
    return BACKENDS[name].kwargs(head_dim)


def backends(**needs) -> list:
    """``pytest.param(backend)`` for every backend that supports ``needs``
    (:meth:`Backend.supports` keywords)."""
    return [pytest.param(b, id=b.name) for b in BACKENDS.values() if b.supports(**needs)]


def backend_cases(cases: Iterable, case_id: Callable[[Any], str],
                  needs: Callable[[Any], dict]) -> list:
    """``pytest.param(backend, case)`` for every case and every backend that supports
    ``needs(case)``; ids ``backend-case``."""
    return [pytest.param(b, case, id=f"{b.name}-{case_id(case)}")
            for case in cases for b in BACKENDS.values() if b.supports(**needs(case))]


def fresh_key() -> jax.Array:
    """A new PRNG key for every draw: inputs are never reused across checks."""
    return jax.random.PRNGKey(next(_seed))


def fresh_rng() -> np.random.Generator:
    """A NumPy generator on a new seed: host-side draws, which compile nothing (an eager
    ``jax.random`` draw compiles one small XLA program per shape, ~50 ms each on CPU)."""
    return np.random.default_rng(next(_seed))


def random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype=jnp.float32):
    """q [B, T, N, D], k/v [B, S, K, D] and a cotangent dO, all N(0, 1) (never zeros)."""
    rng = fresh_rng()
    shapes = [(batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
              (batch, seq_kv, kv_heads, head_dim), (batch, seq_q, heads, head_dim)]
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
                 for shape in shapes)


def bits(x) -> np.ndarray:
    """``x``'s raw bit patterns as unsigned integers of its item size: equal bits compare
    equal, a NaN never matches a number, and -0.0 differs from 0.0."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def rel_err(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ over every element; NaN/inf anywhere gives inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def tolerance(dtype) -> float:
    """Relative error bound of out (gradients: twice it) for inputs of ``dtype``."""
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


def lse_tolerance(dtype) -> float:
    """lse is float32 for every input dtype, from logits of exact products of the inputs:
    tight even for 16-bit inputs."""
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-4


def run_attention(backend: Backend | str, q, k, v, d_out, *, bias=None, bias_grad=True,
                  **kwargs):
    """Forward (out, lse [B, T, N]) and (dq, dk, dv) of <out, d_out> through ``backend``;
    with a ``bias`` and ``bias_grad``, dbias follows dv (without ``bias_grad`` the bias is a
    constant of the call, as an additive mask)."""
    backend = BACKENDS[backend] if isinstance(backend, str) else backend
    differentiated = bias is not None and bias_grad

    # One jitted program: run eagerly, every small op around the kernels would compile
    # on its own (most of a CPU test's time).
    @jax.jit
    def forward_and_grads(q, k, v, bias, d_out):
        def f(q, k, v, *grad_bias):
            return backend.attention(q, k, v, *(grad_bias or (bias,)), return_lse=True,
                                     **kwargs)

        (out, lse), vjp = jax.vjp(f, q, k, v, *((bias,) if differentiated else ()))
        return out, lse, vjp((d_out, jnp.zeros_like(lse)))

    return forward_and_grads(q, k, v, bias, d_out)


def assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, dtype, *,
                   names=("dq", "dk", "dv")) -> None:
    """out, lse ([B, T, N]; the oracle's is [B, N, T]) and gradients vs the float64
    oracle: relative errors over every element (NaN/inf never pass), and rows that see no
    key exactly: out 0 and lse EMPTY_ROW_LSE."""
    tol = tolerance(dtype)
    ref_lse = np.transpose(np.asarray(ref_lse), (0, 2, 1))
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert lse.dtype == jnp.float32
    assert rel_err(out, ref_out) < tol, ("out", rel_err(out, ref_out))
    seen = ref_lse > EMPTY_ROW_LSE / 2
    assert rel_err(np.asarray(lse)[seen], ref_lse[seen]) < lse_tolerance(dtype), "lse"
    assert np.all(np.asarray(lse)[~seen] == np.float32(EMPTY_ROW_LSE)), "empty rows' lse"
    assert np.all(np.asarray(out, np.float32)[~seen] == 0), "empty rows' out"
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 2 * tol, (name, rel_err(got, want))


# --- sharded programs -------------------------------------------------------------------

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")


def random_segments(batch: int, seq: int) -> jax.Array:
    """Sorted ids of 1-4 packed documents per row."""
    cuts = jax.random.randint(fresh_key(), (batch, 3), 0, seq)
    return jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1, dtype=jnp.int32)


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO holds (only the nonzero ones)."""
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", compiled_text)) for op in COLLECTIVES}
    return {op: n for op, n in counts.items() if n}


def quantize_ieee(x, block: int, *, transpose: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``fp8.quantize(x, block)`` computed on the host in IEEE float32: per tile the scale
    ``amax / 448`` and the quotient ``x / scale``, each correctly rounded, then rounded to
    e4m3 (nearest, ties to even) by ml_dtypes. XLA's divisions can be one float32 ulp
    off IEEE's (as from multiplying by a reciprocal), so this is the reference for bits.

    Returns ``(x_fp8, scales)`` as numpy arrays, ``x_fp8`` ``[batch, seq, heads, head_dim]``
    (``[batch, heads, head_dim, seq]`` with ``transpose``), scales ``[batch, tiles, heads]``.
    """
    import ml_dtypes

    x = np.asarray(x, np.float32)
    batch, seq, heads, head_dim = x.shape
    tiles = -(-seq // block)
    padded = np.zeros((batch, tiles * block, heads, head_dim), np.float32)
    padded[:, :seq] = x
    padded = padded.reshape(batch, tiles, block, heads, head_dim)
    amax = np.abs(padded).max(axis=(2, 4))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    quotient = (padded / scales[:, :, None, :, None]).astype(np.float32)
    x_fp8 = quotient.astype(ml_dtypes.float8_e4m3fn).reshape(batch, -1, heads, head_dim)[:, :seq]
    return (np.transpose(x_fp8, (0, 2, 3, 1)) if transpose else x_fp8), scales

"""The attention implementations the suite runs side by side, with availability detection.

Each implementation is a function ``(q, k, v, causal) -> out`` on ``[batch, seq, heads,
head_dim]`` arrays with the softmax scale ``1 / sqrt(head_dim)``. Imports happen inside the
functions so that a missing package or an unsupported platform shows up as a failed probe,
not as an import error of this module.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]

REFERENCE = "cudnn"
_PROBE_SHAPE = (1, 256, 2, 64)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One benchmarked implementation.

    Attributes:
      name: the name used on the command line and in reports.
      fn: ``(q, k, v, causal) -> out``.
      dtype: the input dtype it is forced to run in (``None``: the suite's dtype).
      note: one line for the report (what exactly is called).
      by_default: run when the command line names no implementations (a variant of
        another one is run only when named).
      head_dims: the only head dims it runs (None: any); probed at the first of them.
    """

    name: str
    fn: AttentionFn
    dtype: jnp.dtype | None = None
    note: str = ""
    by_default: bool = True
    head_dims: tuple[int, ...] | None = None

    def supports(self, head_dim: int) -> bool:
        return self.head_dims is None or head_dim in self.head_dims


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _xla(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def jax_pallas_triton(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """JAX's own Pallas-Triton attention op (``q, k, v: [batch, seq, heads, head_dim]``).

    JAX deleted that module in 0.12.1: on such a JAX this raises RuntimeError, which the
    suite's probe reports as the reason the implementation is unavailable.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention
    except ImportError as exc:
        raise RuntimeError(
            f"jax {jax.__version__} has no jax.experimental.pallas.ops.gpu.attention (deleted "
            "in jax 0.12.1): jax_pallas_triton needs jax 0.11.2 to 0.12.0") from exc
    return attention.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal)


def mgpu_config(head_dim: int, causal: bool):
    """The ``attention_mgpu.TuningConfig`` used for ``jax_mgpu``.

    Forward: block_q 64 per compute warpgroup, block_kv 128 (64 at head_dim > 128, where 128
    overflows shared memory), 2 stages. Backward: 64 × 64 blocks, 2 compute warpgroups (1 at
    head_dim > 128 for registers).
    """
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    wide = head_dim > 128
    return attention_mgpu.TuningConfig(
        block_q=64, block_kv=64 if wide else 128, max_concurrent_steps=2, causal=causal,
        compute_wgs_bwd=1 if wide else 2, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
        block_kv_dq=64)


def _jax_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    # The kernel applies no logit scale: fold it into q (one elementwise op, ~1% of the time).
    q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    return attention_mgpu.attention(q, k, v, mgpu_config(q.shape[-1], causal))


def _tokamax(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    import tokamax

    return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")


def _fa3(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    # An optional cp312 wheel (flash-attn3-jax), built for sm90 and head_dim 128 only.
    from flash_attn3_jax import flash_mha

    return flash_mha(q, k, v, softmax_scale=q.shape[-1] ** -0.5, is_causal=causal)


def _pallas_flash(implementation: str, deterministic: bool = False) -> AttentionFn:
    def fn(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        import pallas_flash

        return pallas_flash.attention(q, k, v, is_causal=causal, implementation=implementation,
                                      deterministic=deterministic)

    return fn


IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation("cudnn", _cudnn,
                       note='jax.nn.dot_product_attention(implementation="cudnn")'),
        Implementation("xla", _xla, note='jax.nn.dot_product_attention(implementation="xla")'),
        Implementation("jax_pallas_triton", jax_pallas_triton,
                       note="jax.experimental.pallas.ops.gpu.attention.mha (jax < 0.12.1)"),
        Implementation("jax_mgpu", _jax_mgpu, dtype=jnp.dtype(jnp.float16),
                       note="jax.experimental.pallas.ops.gpu.attention_mgpu.attention, float16 "
                            "only, no causal backward; q pre-scaled"),
        Implementation("tokamax", _tokamax,
                       note='tokamax.dot_product_attention(implementation="mosaic")'),
        Implementation("fa3", _fa3, head_dims=(128,),
                       note="flash_attn3_jax.flash_mha (FlashAttention-3's CUDA kernels, "
                            "head_dim 128 only)"),
        Implementation("pallas_flash_triton", _pallas_flash("triton"),
                       note='pallas_flash.attention(implementation="triton")'),
        Implementation("pallas_flash_mosaic", _pallas_flash("mosaic"),
                       note='pallas_flash.attention(implementation="mosaic")'),
        # Our XLA backend (plain JAX): what the benchmarks' CPU smoke runs call.
        Implementation("pallas_flash_xla", _pallas_flash("xla"), by_default=False,
                       note='pallas_flash.attention(implementation="xla")'),
        # Beside pallas_flash_mosaic in one run (--impls), the cost of a reproducible
        # backward: the separate dQ kernel instead of the fused dQ's reduce-adds.
        Implementation("pallas_flash_mosaic_deterministic",
                       _pallas_flash("mosaic", deterministic=True), by_default=False,
                       note='pallas_flash.attention(implementation="mosaic", '
                            'deterministic=True)'),
    )
}


def error_summary(exc: BaseException) -> str:
    """``"<ExceptionType>: <first non-empty line of the message>"``, at most 300 characters."""
    line = next((s.strip() for s in str(exc).splitlines() if s.strip()), "")
    text = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return text[:300]


def probe(impl: Implementation, dtype: jnp.dtype) -> str | None:
    """Run ``impl`` once on a tiny problem; ``None`` if it works, else why it does not."""
    shape = _PROBE_SHAPE[:-1] + (impl.head_dims or _PROBE_SHAPE[-1:])[:1]
    values = np.random.default_rng(0).standard_normal((3, *shape), np.float32)
    q, k, v = jnp.asarray(values, impl.dtype or dtype)
    try:
        jax.block_until_ready(jax.jit(impl.fn, static_argnums=3)(q, k, v, False))
    except Exception as exc:
        return error_summary(exc)
    return None

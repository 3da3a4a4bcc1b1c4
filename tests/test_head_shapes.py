"""Head shapes of today's models: a value head dim that differs from the query/key one
(``v: [B, S, K, Dv]`` -> ``out: [B, T, N, Dv]``, MLA's 192/128) and head dims up to 512,
in the kernels themselves and through :func:`pallas_flash.attention`, forward, lse and
backward against the float64 oracle; what each backend's ``unsupported`` says about them,
and the arguments the API refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64
from tests.support import assert_matches, fresh_rng, random_segments


def _triton():
    from pallas_flash.triton import KERNELS, TritonConfig

    return KERNELS, TritonConfig(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)


def _xla():
    from pallas_flash.xla import KERNELS, XlaConfig

    return KERNELS, XlaConfig(block_kv=16)


KERNEL_SETS = {"triton": _triton, "xla": _xla}
# (query/key head dim, value head dim)
PAIRS = ((192, 128), (128, 64), (64, 128), (512, 512), (320, 320), (40, 72))


def _inputs(batch, seq_q, seq_kv, heads, kv_heads, head_dim, value_dim):
    rng = fresh_rng()
    shapes = [(batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
              (batch, seq_kv, kv_heads, value_dim), (batch, seq_q, heads, value_dim)]
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("dims", PAIRS, ids=[f"{d}x{dv}" for d, dv in PAIRS])
@pytest.mark.parametrize("name", list(KERNEL_SETS))
def test_head_dims_match_oracle(name, dims, causal):
    kernels, config = KERNEL_SETS[name]()
    head_dim, value_dim = dims
    seq_q, seq_kv = 24, 40
    q, k, v, d_out = _inputs(2, seq_q, seq_kv, 4, 2, head_dim, value_dim)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=causal)
    ids = random_segments(2, seq_kv)
    segment_ids = (ids[:, :seq_q], ids)
    scale = 1.0 / np.sqrt(head_dim)

    @jax.jit
    def run(q, k, v, d_out, segment_ids):
        out, lse = kernels.forward(q, k, v, segment_ids, mask=mask, scale=scale,
                                   config=config, interpret=True)
        delta = jnp.einsum("btnd,btnd->bnt", d_out, out)
        grads = kernels.backward(q, k, v, segment_ids, out, lse, d_out, delta, mask=mask,
                                 scale=scale, config=config, interpret=True)
        return out, lse, grads

    out, lse, grads = run(q, k, v, d_out, segment_ids)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, scale=scale, mask=mask, segment_ids=segment_ids, d_out=d_out)
    assert out.shape == (2, seq_q, 4, value_dim)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert_matches(out, jnp.swapaxes(lse, 1, 2), grads, ref_out, ref_lse, ref_grads,
                   jnp.float32)


def test_triton_unsupported_names_both_dims():
    from pallas_flash.triton import unsupported

    mask = MaskSpec(seq_q=8, seq_kv=8)

    def reason(head_dim, value_dim):
        return unsupported((1, 8, 2, head_dim), (1, 8, 2, head_dim), jnp.bfloat16, mask,
                           False, value_head_dim=value_dim)

    for dims in PAIRS:
        assert reason(*dims) is None
    assert reason(64, None) is None  # value head dim not given: the queries'
    for head_dim, value_dim in ((1024, 64), (64, 1024), (640, 640)):
        message = reason(head_dim, value_dim)
        assert f"head_dim {head_dim}" in message and f"value head_dim {value_dim}" in message


def test_xla_unsupported_takes_any_head_dims():
    from pallas_flash.xla import unsupported

    mask = MaskSpec(seq_q=8, seq_kv=8)
    for head_dim, value_dim in (*PAIRS, (1024, 48), (7, 2048)):
        assert unsupported((1, 8, 2, head_dim), (1, 8, 2, head_dim), jnp.float32, mask,
                           False, value_head_dim=value_dim) is None


@pytest.mark.parametrize("dims", [(192, 128), (64, 128), (512, 512), (320, 320)],
                         ids=lambda d: f"{d[0]}x{d[1]}")
def test_triton_head_dims_lower_for_hopper(dims):
    """Forward, dK/dV and dQ with these head dims and their default tiles lower to Triton
    for an H200 on the CPU (only a GPU compiles and runs them: tests/gpu)."""
    from pallas_flash.triton import KERNELS, default_config

    head_dim, value_dim = dims
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                       platform="gpu")
    mask = MaskSpec(seq_q=300, seq_kv=300, is_causal=True)
    q_shape, v_shape = (2, 300, 4, head_dim), (2, 300, 4, value_dim)
    config = default_config(q_shape, q_shape, jnp.bfloat16, mask)

    def both(q, k, v, d_out):
        out, lse = KERNELS.forward(q, k, v, None, mask=mask, scale=0.1, config=config,
                                   interpret=False)
        return KERNELS.backward(q, k, v, None, out, lse, d_out, lse, mask=mask, scale=0.1,
                                config=config, interpret=False)

    qk = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    vo = jax.ShapeDtypeStruct(v_shape, jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
        text = jax.jit(both).trace(qk, qk, vo, vo).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


# Through the public function: the planner picks a backend that takes the shape.
API_CASES = [("xla", (192, 128)), ("triton", (192, 128)), ("xla", (512, 512)),
             ("triton", (64, 128)), (None, (320, 320))]


@pytest.mark.parametrize("implementation,dims", API_CASES,
                         ids=[f"{i}-{d}x{dv}" for i, (d, dv) in API_CASES])
def test_attention_takes_other_head_shapes(implementation, dims):
    head_dim, value_dim = dims
    seq_q, seq_kv = 24, 40
    q, k, v, d_out = _inputs(2, seq_q, seq_kv, 4, 2, head_dim, value_dim)
    lengths = jnp.array([seq_kv, 29], jnp.int32)
    kwargs = dict(is_causal=True, causal_alignment="bottom_right",
                  key_value_seq_lengths=lengths, implementation=implementation,
                  interpret=implementation == "triton", return_lse=True)

    def loss(q, k, v):
        out, lse = pf.attention(q, k, v, **kwargs)
        return jnp.sum(out * d_out), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, is_causal=True,
                    causal_alignment="bottom_right")
    kv_ids = jnp.where(jnp.arange(seq_kv)[None] < lengths[:, None], 0, 1).astype(jnp.int32)
    segment_ids = (jnp.zeros((2, seq_q), jnp.int32), kv_ids)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, scale=1.0 / np.sqrt(head_dim), mask=mask, segment_ids=segment_ids,
        d_out=d_out)
    assert out.shape == (2, seq_q, 4, value_dim)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, jnp.float32)


def test_attention_mosaic_refuses_other_value_head_dim():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 192, 128)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(ValueError, match="head_dim 192 and value head_dim 128"):
        pf.attention(q, k, v, implementation="mosaic")


@pytest.mark.parametrize("value_shape,message", [
    ((1, 9, 2, 64), r"same \[batch, seq_kv, kv_heads\]"),
    ((1, 8, 1, 64), r"same \[batch, seq_kv, kv_heads\]"),
    ((1, 8, 2, 0), "value head_dim must be at least 1"),
])
def test_attention_refuses_mismatched_value(value_shape, message):
    q, k, _, _ = _inputs(1, 8, 8, 2, 2, 64, 64)
    with pytest.raises(ValueError, match=message):
        pf.attention(q, k, jnp.zeros(value_shape, jnp.float32))


def test_decode_keeps_one_head_dim():
    """The decode path reads K and V of one head dim; the API says so."""
    q, k, v, _ = _inputs(1, 1, 8, 2, 2, 64, 32)
    with pytest.raises(ValueError, match="key and value must have the same shape"):
        pf.decode_attention(q, k, v)

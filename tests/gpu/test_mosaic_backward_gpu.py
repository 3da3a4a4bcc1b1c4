"""The Mosaic GPU backward on a real Hopper GPU, against the float64 oracle.

Skipped unless the default device is a GPU of compute capability 9.0. Every case draws
fresh inputs, computes ``(out, lse)`` with the Mosaic forward and ``(dq, dk, dv)`` with
:func:`pallas_flash.mosaic.backward.backward`, and compares all three with
``reference.attention_float64`` (‖got − ref‖ / ‖ref‖ < 1e-2; NaN never passes). Head dim
256 runs its own kernels (``backward_d256``, 32-key dQ blocks). Packed documents (segment
ids, padding lengths) and soft-capping run the Mosaic backward too.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import random_qkv, rel_err

import pallas_flash
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicBackwardConfig, default_config, forward
from pallas_flash.reference import attention_float64

mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16, F16 = jnp.bfloat16, jnp.float16


def _gradients(q, k, v, d_out, mask: MaskSpec, scale: float, config, segment_ids=None,
               softcap=None):
    def run(q, k, v, d_out, segment_ids):
        fwd_config = default_config(q.shape, k.shape, q.dtype, mask)
        out, lse = forward(q, k, v, segment_ids, mask=mask, scale=scale, config=fwd_config,
                           interpret=False, softcap=softcap)
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        return mosaic_backward.backward(q, k, v, segment_ids, out, lse, d_out, delta,
                                        mask=mask, scale=scale, config=config or fwd_config,
                                        interpret=False, softcap=softcap)
    return jax.jit(run)(q, k, v, d_out, segment_ids)


def _check(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, *, config=None,
           segment_ids=None, softcap=None, **mask_kwargs):
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    if softcap is not None:  # logits of several softcaps, where tanh bends them
        q = q * 4
    scale = head_dim ** -0.5
    grads = _gradients(q, k, v, d_out, mask, scale, config, segment_ids, softcap)
    _, _, want = attention_float64(q, k, v, scale=scale, mask=mask, segment_ids=segment_ids,
                                   softcap=softcap, d_out=np.asarray(d_out, np.float64))
    for name, got, ref, x in zip("qkv", grads, want, (q, k, v), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        err = rel_err(got, ref)
        assert err < 1e-2, f"d{name}: relative error {err}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_shape_classes(head_dim, causal, dtype):
    _check(1, 512, 512, 4, 2, head_dim, dtype, is_causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fused_dq_mode(head_dim, causal, dtype):
    """dQ by TMA reduce-adds from the dK/dV kernel (``deterministic=False``)."""
    config = MosaicBackwardConfig(block_q=64, deterministic=False)
    _check(1, 512, 512, 4, 2, head_dim, dtype, config=config, is_causal=causal)


def test_deterministic_mode_is_bitwise_reproducible():
    mask = MaskSpec(seq_q=512, seq_kv=512, is_causal=True)
    q, k, v, d_out = random_qkv(1, 512, 512, 4, 1, 128, BF16)
    config = MosaicBackwardConfig()
    assert config.deterministic
    first = _gradients(q, k, v, d_out, mask, 0.1, config)
    second = _gradients(q, k, v, d_out, mask, 0.1, config)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_odd_lengths_bottom_right(deterministic):
    _check(1, 600, 900, 4, 2, 128, BF16, is_causal=True, causal_alignment="bottom_right",
           config=MosaicBackwardConfig(deterministic=deterministic))


def test_more_queries_than_keys_bottom_right():  # the first 400 rows see no key
    _check(1, 600, 200, 4, 4, 64, F16, is_causal=True, causal_alignment="bottom_right")


def test_padded_head_dim_mqa_window():
    _check(2, 377, 450, 2, 1, 96, BF16, window=(100, 30))


def _packed_ids(batch: int, seq: int, seed: int) -> jax.Array:
    """[batch, seq] int32 ids of 3 to 8 packed documents per row, of random lengths (the
    boundaries fall inside tiles)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        starts = np.sort(rng.choice(np.arange(1, seq), rng.integers(2, 8), replace=False))
        rows.append(np.searchsorted(starts, np.arange(seq), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


D256 = MosaicBackwardConfig(dq_block_kv=32)  # the head_dim 256 default, made explicit


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_head_dim_256_kernels(causal, dtype):
    """The split dK/dV kernel (backward_d256) and the 32-key dQ blocks, GQA, odd lengths."""
    _check(2, 1000, 1100, 4, 2, 256, dtype, config=D256, is_causal=causal,
           causal_alignment="bottom_right")


def test_head_dim_256_packed_documents_softcap_window():
    ids = _packed_ids(2, 2048, seed=256)
    _check(2, 2048, 2048, 4, 1, 256, BF16, segment_ids=(ids, ids), softcap=30.0,
           config=D256, is_causal=True, window=(700, 0))


@pytest.mark.parametrize(("head_dim", "bias_spec", "bias_dtype", "mask_spec"), [
    (128, "1NTS", jnp.float32, "B11S"),  # tile ring + key rows (rows read once in dK/dV)
    (128, "B11S", BF16, "B1TS"),  # key-row ring + int8 tile ring
    (64, "BNT1", jnp.float32, "1NT1"),  # query rows: read once in dQ, rings in dK/dV
    (128, "BNTS", BF16, "B1TS"),  # the mask folded into the bias as -inf
])
def test_bias_and_mask(head_dim, bias_spec, bias_dtype, mask_spec):
    """Bias / mask arrays in both Mosaic kernels (the forward's config, as the API passes
    it), vs the float64 oracle. The arrays are arguments of the jitted function: as
    constants, XLA's constant folding of their padding and transposes took minutes on the
    H200."""
    batch, seq, heads, kv_heads = 2, 1500, 8, 2
    q, k, v, d_out = random_qkv(batch, seq, seq, heads, kv_heads, head_dim, BF16)
    sizes = dict(B=batch, N=heads, T=seq, S=seq)

    def array(spec, seed, mask):
        shape = tuple(sizes.get(c, 1) for c in spec)
        if mask:
            return jax.random.bernoulli(jax.random.key(seed), 0.8, shape)
        return (2 * jax.random.normal(jax.random.key(seed), shape)).astype(bias_dtype)
    bias, attn_mask = array(bias_spec, 1, False), array(mask_spec, 2, True)
    mask = MaskSpec(seq_q=seq, seq_kv=seq, is_causal=True)
    scale = head_dim ** -0.5

    def run(q, k, v, d_out, bias, attn_mask):
        fwd_config = default_config(q.shape, k.shape, q.dtype, mask)
        out, lse = forward(q, k, v, None, mask=mask, scale=scale, config=fwd_config,
                           interpret=False, bias=bias, attn_mask=attn_mask)
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        return mosaic_backward.backward(
            q, k, v, None, out, lse, d_out, delta, mask=mask, scale=scale,
            config=fwd_config, interpret=False, bias=bias, attn_mask=attn_mask)

    grads = jax.jit(run)(q, k, v, d_out, bias, attn_mask)
    _, _, want = attention_float64(q, k, v, scale=scale, mask=mask, bias=bias,
                                   attn_mask=attn_mask, d_out=np.asarray(d_out, np.float64))
    for name, got, ref in zip("qkv", grads, want[:3], strict=True):  # want[3]: dbias
        assert np.all(np.isfinite(np.asarray(got, np.float32))), name
        assert rel_err(got, ref) < 1e-2, f"d{name}: relative error {rel_err(got, ref)}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [True, False])
def test_packed_documents_softcap(head_dim, causal, deterministic):
    """Segment ids (both kernels cut their walks to the ids' spans) and soft-capping."""
    ids = _packed_ids(2, 2048, seed=head_dim + causal)
    _check(2, 2048, 2048, 4, 2, head_dim, BF16, segment_ids=(ids, ids), softcap=30.0,
           config=MosaicBackwardConfig(deterministic=deterministic), is_causal=causal)


def test_packed_documents_padding_lengths_through_the_api():
    """Training with packed documents and padding (lengths arrive as segment ids): the
    Mosaic forward and backward, soft-capped, odd lengths, GQA, bottom-right causal."""
    q, k, v, d_out = random_qkv(2, 1500, 1700, 8, 2, 128, BF16)
    q_ids, kv_ids = _packed_ids(2, 1500, seed=3), _packed_ids(2, 1700, seed=4)
    q_len, kv_len = jnp.asarray([1500, 1111], jnp.int32), jnp.asarray([1650, 1234], jnp.int32)

    def f(q, k, v):
        return pallas_flash.attention(
            q, k, v, is_causal=True, causal_alignment="bottom_right", q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
            logits_soft_cap=20.0, implementation="mosaic")

    assert mosaic_backward.unsupported(q.shape, q.dtype, True, 20.0) is None
    grads = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(q, k, v, d_out)
    pad_q = jnp.where(jnp.arange(1500) < q_len[:, None], q_ids, -1)
    pad_kv = jnp.where(jnp.arange(1700) < kv_len[:, None], kv_ids, -2)
    mask = MaskSpec(seq_q=1500, seq_kv=1700, is_causal=True, causal_alignment="bottom_right")
    _, _, want = attention_float64(q, k, v, mask=mask, segment_ids=(pad_q, pad_kv),
                                   softcap=20.0, d_out=np.asarray(d_out, np.float64))
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("causal", [False, True])
def test_through_the_api(causal):
    """pallas_flash.attention(implementation="mosaic"): forward and backward both Mosaic
    (the default backward at head_dim 128, L 700: the fused dQ dense, the separate dQ
    kernel causal)."""
    q, k, v, d_out = random_qkv(1, 700, 700, 4, 2, 128, BF16)

    def f(q, k, v):
        return pallas_flash.attention(q, k, v, is_causal=causal, implementation="mosaic")

    grads = jax.jit(lambda *a: jax.vjp(f, *a[:3])[1](a[3]))(q, k, v, d_out)
    mask = MaskSpec(seq_q=700, seq_kv=700, is_causal=causal)
    _, _, want = attention_float64(q, k, v, mask=mask, d_out=np.asarray(d_out, np.float64))
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(got, ref) < 1e-2

"""The Mosaic GPU forward on a real Hopper GPU, at real sizes for each shape class.

Skipped unless the default device is a GPU of compute capability 9.0. The reference is
``reference.standard_attention`` on float32 copies of the inputs (on the same GPU); the
segment-id and soft-capping variants are compared with the float64 oracle
``reference.attention_float64`` (on the CPU, so their sizes stay moderate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash
from pallas_flash import dispatch, reference
from pallas_flash import triton as triton_backend
from pallas_flash.api import PADDED_KEY_ID
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, default_config, forward


def _is_sm90() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


pytestmark = pytest.mark.skipif(not _is_sm90(), reason="needs a Hopper (sm90) GPU")

BF16, F16 = jnp.bfloat16, jnp.float16


def _inputs(shape_q, shape_kv, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], shape_q, dtype),
            jax.random.normal(keys[1], shape_kv, dtype),
            jax.random.normal(keys[2], shape_kv, dtype))


def _check(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, *, config=None, seed=0,
           **mask_kwargs):
    mask = MaskSpec(seq_q=seq_q, seq_kv=seq_kv, **mask_kwargs)
    q, k, v = _inputs((batch, seq_q, heads, head_dim), (batch, seq_kv, kv_heads, head_dim),
                      dtype, seed)
    config = config or default_config(q.shape, k.shape, dtype, mask)
    scale = head_dim ** -0.5
    out, lse = jax.jit(lambda q, k, v: forward(q, k, v, None, mask=mask, scale=scale,
                                               config=config, interpret=False))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seq_q) and lse.dtype == jnp.float32
    ref_out, ref_lse = reference.standard_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale, mask=mask)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    ref_out, ref_lse = np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_shape_classes(head_dim, causal, dtype):
    _check(2, 2048, 2048, 2048 // head_dim // 2, 2048 // head_dim // 2, head_dim, dtype,
           is_causal=causal)


@pytest.mark.parametrize("config", [MosaicConfig(64, 128, 2), MosaicConfig(64, 64, 3),
                                    MosaicConfig(64, 256, 2), MosaicConfig(128, 128, 2),
                                    MosaicConfig(64, 128, 2, overlap=True),
                                    MosaicConfig(64, 64, 3, overlap=True),
                                    MosaicConfig(64, 128, 2, overlap=True, num_consumers=3)])
def test_configs(config):
    _check(1, 1024, 1024, 8, 8, 64, BF16, config=config, is_causal=True)


@pytest.mark.parametrize(("head_dim", "config"), [
    (64, MosaicConfig(128, 128, 2, persistent=True)),
    (64, MosaicConfig(64, 128, 2, persistent=True)),
    (64, MosaicConfig(64, 128, 2, overlap=True, num_consumers=3, persistent=True)),
    (128, MosaicConfig(64, 128, 2, overlap=True, persistent=True)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas(head_dim, config, causal):
    """Persistent CTAs with 2-3 tiles each (3 x 16 heads x 6-8 row tiles over 132 SMs):
    odd lengths, GQA, and causal tiles of different lengths in one CTA."""
    _check(3, 1500, 1500, 16, 4, head_dim, BF16, config=config, seed=head_dim + causal,
           is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_three_consumers_long_rows_gqa_odd_lengths(causal):
    """Three consumers (the head_dim 64 default for long dense rows: 192-row CTAs,
    round-robin turns), at a length that is not a multiple of 192, with GQA."""
    config = MosaicConfig(64, 128, 2, overlap=True, num_consumers=3)
    _check(1, 4500, 4500, 8, 2, 64, F16, config=config, seed=31, is_causal=causal)


def test_gqa_odd_lengths_bottom_right():
    _check(2, 1000, 1500, 16, 4, 128, BF16, is_causal=True, causal_alignment="bottom_right")


def test_padded_head_dim_mqa():
    _check(3, 777, 777, 4, 1, 96, F16)


def test_window_and_empty_rows():
    _check(1, 4096, 4096, 4, 2, 64, BF16, window=(512, 128))
    # Queries past the last key see nothing under a window: out 0, lse EMPTY_ROW_LSE.
    _check(1, 1024, 200, 2, 2, 128, BF16, window=(16, 16))


def test_api_dispatch_and_gradients():
    q, k, v = _inputs((2, 512, 8, 128), (2, 512, 2, 128), BF16, seed=3)

    def loss(impl):
        return lambda q, k, v: jnp.sum(pallas_flash.attention(
            q, k, v, is_causal=True, implementation=impl).astype(jnp.float32) ** 2)

    assert pallas_flash.default_implementation() == "mosaic"
    value, grads = jax.jit(jax.value_and_grad(loss("mosaic"), argnums=(0, 1, 2)))(q, k, v)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2


# --- segment ids and soft-capping (vs the float64 oracle) ------------------------------


def _doc_ids(seq: int, starts) -> np.ndarray:
    """[seq] int32 ids of packed documents: the id goes up by one at each start."""
    return np.searchsorted(np.asarray(starts), np.arange(seq), side="right").astype(np.int32)


def _check_variant(q, k, v, segment_ids, *, softcap=None, **mask_kwargs):
    """The default config's kernel vs ``attention_float64``; rows that see no key must give
    out 0 and lse EMPTY_ROW_LSE exactly. NaN in K/V (keys no query may see) is 0 for the
    oracle, which would otherwise compute 0 · NaN.

    Soft-capping runs ``tanh.approx.f32`` (as FA3), whose error reaches ``c · 2^-11`` in a
    logit, hence the wider lse tolerance with a cap.
    """
    mask = MaskSpec(seq_q=q.shape[1], seq_kv=k.shape[1], **mask_kwargs)
    config = default_config(q.shape, k.shape, q.dtype, mask)
    scale = q.shape[-1] ** -0.5
    out, lse = jax.jit(lambda q, k, v, ids: forward(
        q, k, v, ids, mask=mask, scale=scale, config=config, interpret=False,
        softcap=softcap))(q, k, v, segment_ids)
    ref_out, ref_lse = reference.attention_float64(
        q, *(np.nan_to_num(np.asarray(x, np.float64)) for x in (k, v)), scale=scale,
        mask=mask, segment_ids=segment_ids, softcap=softcap)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    seen = ref_lse > reference.EMPTY_ROW_LSE / 2
    atol = 1e-2 if softcap is None else 2e-2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=atol)
    assert np.all(lse[~seen] == np.float32(reference.EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)


def test_segments_causal_gqa_d64_skips_foreign_tiles():
    """Eight documents, most boundaries off the tiles. The keys of document 4 (1024..1279,
    two whole 128-key tiles) are NaN and carry an id no query has: only span skipping keeps
    them out of P·V, and document 4's queries see nothing (empty rows, whole empty CTAs)."""
    seq = 2048
    q, k, v = _inputs((1, seq, 2, 64), (1, seq, 1, 64), BF16, seed=21)
    ids = _doc_ids(seq, [100, 333, 700, 1024, 1280, 1500, 1999])
    kv_ids = ids.copy()
    kv_ids[1024:1280] = 99
    k, v = k.at[:, 1024:1280].set(jnp.nan), v.at[:, 1024:1280].set(jnp.nan)
    _check_variant(q, k, v, (jnp.asarray(ids[None]), jnp.asarray(kv_ids[None])),
                   is_causal=True)


def test_segments_key_padding_softcap_d128():
    """Two sequences: different documents, key padding (as the API folds
    ``key_value_seq_lengths``: PADDED_KEY_ID), queries of a document with no keys (empty
    rows), seq_q != seq_kv, soft-capping with logits well past the cap."""
    seq_q, seq_kv = 1900, 2048
    q, k, v = _inputs((2, seq_q, 2, 128), (2, seq_kv, 1, 128), BF16, seed=22)
    q = q * 4  # logits of a few tens: tanh bends them
    q_ids = np.stack([_doc_ids(seq_q, [500, 1200]), _doc_ids(seq_q, [64, 900]) * 2])
    kv_ids = np.stack([_doc_ids(seq_kv, [480, 1300]), _doc_ids(seq_kv, [64, 900])])
    kv_ids[1, 1500:] = PADDED_KEY_ID  # sequence 1 has 1500 real keys
    # Sequence 1: query documents 0, 2, 4; key documents 0, 1, 2: document 4 sees nothing.
    _check_variant(q, k, v, (jnp.asarray(q_ids), jnp.asarray(kv_ids)), softcap=30.0)


def test_segments_softcap_window_d256():
    seq = 2048
    q, k, v = _inputs((1, seq, 2, 256), (1, seq, 2, 256), F16, seed=23)
    ids = jnp.asarray(_doc_ids(seq, [77, 500, 1234, 1300])[None])
    _check_variant(q * 4, k, v, (ids, ids), softcap=20.0, is_causal=True, window=(300, 0))


def test_api_packed_documents_gradients():
    """pallas_flash.attention(implementation="mosaic") with segment ids, key lengths and a
    soft-cap: the Mosaic forward's (out, lse) feed the Mosaic backward."""
    q, k, v = _inputs((2, 512, 4, 128), (2, 512, 2, 128), BF16, seed=24)
    ids = jnp.asarray(np.stack([_doc_ids(512, [100, 300]), _doc_ids(512, [250])]))
    lengths = jnp.asarray([512, 400], jnp.int32)
    d_out = np.asarray(jax.random.normal(jax.random.key(25), q.shape), np.float64)

    def f(q, k, v):
        return pallas_flash.attention(q, k, v, is_causal=True, q_segment_ids=ids,
                                      key_value_seq_lengths=lengths, logits_soft_cap=30.0,
                                      implementation="mosaic")

    out, vjp = jax.vjp(f, q, k, v)
    grads = vjp(jnp.asarray(d_out, BF16))
    kv_ids = jnp.where(jnp.arange(512)[None] < lengths[:, None], ids, PADDED_KEY_ID)
    ref_out, _, ref_grads = reference.attention_float64(
        q, k, v, mask=MaskSpec(seq_q=512, seq_kv=512, is_causal=True),
        segment_ids=(ids, kv_ids), softcap=30.0, d_out=d_out)
    for got, want in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        got = np.asarray(got, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


# --- bias and mask arrays (vs standard_attention in float32, on the GPU) ---------------


def _logit_array(spec: str, sizes: dict, seed: int, *, mask: bool, dtype=jnp.float32):
    """A ``spec``-shaped array over ``BNTS1``: N(0, 2²) bias, or a mask keeping ~80 %."""
    shape = tuple(sizes.get(c, 1) for c in spec)
    if mask:
        return jax.random.bernoulli(jax.random.key(seed), 0.8, shape)
    return (2 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


@pytest.mark.parametrize(("head_dim", "bias_spec", "bias_dtype", "mask_spec", "config"), [
    # The brief's case: a per-batch [B, 1, T, S] bias and a [B, 1, 1, S] padding mask, folded
    # into the bias as -inf (one float32 tile ring).
    (128, "B1TS", jnp.float32, "B11S", None),
    # Not foldable: a per-head tile ring and an int8 key-row ring, on K's barrier together.
    (128, "1NTS", jnp.float32, "B11S", None),
    # A bf16 key-row bias and an int8 tile mask (causal row 0 sees one key: some rows are
    # empty).
    (128, "B11S", BF16, "B1TS", None),
    # Head dim 64: the default 128-row warpgroups drop to 64 for the tile; three consumers.
    (64, "BNTS", BF16, "B1T1", None),
    (64, "1NTS", jnp.float32, "B11S",
     MosaicConfig(64, 128, 2, overlap=True, num_consumers=3)),
    (192, "11TS", jnp.float32, "BN1S", None),
])
def test_bias_and_mask_causal(head_dim, bias_spec, bias_dtype, mask_spec, config):
    batch, seq, heads, kv_heads = 2, 2048, 8, 2
    mask = MaskSpec(seq_q=seq, seq_kv=seq, is_causal=True)
    q, k, v = _inputs((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), BF16,
                      seed=41)
    sizes = dict(B=batch, N=heads, T=seq, S=seq)
    bias = _logit_array(bias_spec, sizes, 42, mask=False, dtype=bias_dtype)
    attn_mask = _logit_array(mask_spec, sizes, 43, mask=True)
    config = config or default_config(q.shape, k.shape, BF16, mask)
    scale = head_dim ** -0.5
    out, lse = jax.jit(lambda q, k, v, b, m: forward(
        q, k, v, None, mask=mask, scale=scale, config=config, interpret=False, bias=b,
        attn_mask=m))(q, k, v, bias, attn_mask)
    ref_out, ref_lse = reference.standard_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), scale=scale, mask=mask, bias=bias,
        attn_mask=attn_mask)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    ref_out, ref_lse = np.asarray(ref_out, np.float64), np.asarray(ref_lse, np.float64)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2
    seen = ref_lse > reference.EMPTY_ROW_LSE / 2
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-2)
    assert np.all(lse[~seen] == np.float32(reference.EMPTY_ROW_LSE))
    assert np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)


def test_api_bias_mask_dispatch_and_gradients(monkeypatch):
    """implementation="mosaic" with bias / mask: dq, dk, dv and dbias (from the Triton
    backward on its out, lse) match the XLA path; without dbias, dq, dk, dv come from the
    Mosaic backward kernels; ``implementation=None`` picks Mosaic."""
    batch, seq, heads, kv_heads, head_dim = 2, 1024, 8, 2, 128
    q, k, v = _inputs((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim), BF16,
                      seed=44)
    sizes = dict(B=batch, N=heads, T=seq, S=seq)
    bias = _logit_array("1NTS", sizes, 45, mask=False)
    attn_mask = _logit_array("B11S", sizes, 46, mask=True)
    assert dispatch.choose(
        q.shape, k.shape, q.dtype, MaskSpec(seq_q=seq, seq_kv=seq, is_causal=True),
        dispatch.Features(has_bias=True, has_mask=True), interpret=False) == "mosaic"

    def loss(impl):
        return lambda q, k, v, b: jnp.sum(pallas_flash.attention(
            q, k, v, b, attn_mask, is_causal=True, implementation=impl
        ).astype(jnp.float32) ** 2)

    argnums = (0, 1, 2, 3)
    value, grads = jax.jit(jax.value_and_grad(loss("mosaic"), argnums))(q, k, v, bias)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss("xla"), argnums))(q, k, v, bias)
    np.testing.assert_allclose(value, ref_value, rtol=1e-2)
    # A constant bias (not differentiated): no dbias, so the dispatcher keeps the Mosaic
    # backward (the Triton one would fail here).
    monkeypatch.setattr(triton_backend, "KERNELS", None)
    qkv_grads = jax.jit(jax.grad(loss("mosaic"), (0, 1, 2)))(q, k, v, bias)
    for g, r in zip(grads + qkv_grads, ref_grads + ref_grads[:3], strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.all(np.isfinite(g))
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2

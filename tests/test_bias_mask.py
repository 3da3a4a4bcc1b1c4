"""``bias`` and ``mask`` arrays (as ``jax.nn.dot_product_attention``) vs the float64 oracle.

Shapes are written as strings over ``B N T S`` (batch, query heads, seq_q, seq_kv) with
``1`` for a broadcast dim: ``"TS"`` is a rank-2 ``[seq_q, seq_kv]`` array, ``"B11S"`` a
padding-mask style ``[batch, 1, 1, seq_kv]`` one.
"""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import fresh_key, implementation_kwargs, random_qkv, rel_err, tolerance

import pallas_flash as pf
from pallas_flash import mosaic
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64


def _shape(spec: str, batch, heads, seq_q, seq_kv) -> tuple[int, ...]:
    sizes = {"B": batch, "N": heads, "T": seq_q, "S": seq_kv, "1": 1}
    return tuple(sizes[c] for c in spec)


def random_bias(spec: str, batch, heads, seq_q, seq_kv, dtype=jnp.float32):
    return 2 * jax.random.normal(fresh_key(), _shape(spec, batch, heads, seq_q, seq_kv), dtype)


def random_mask(spec: str, batch, heads, seq_q, seq_kv, keep=0.7):
    return jax.random.bernoulli(fresh_key(), keep, _shape(spec, batch, heads, seq_q, seq_kv))


def run(impl, q, k, v, d_out, *, bias=None, mask=None, **kwargs):
    """(out, lse [B, T, N], (dq, dk, dv[, dbias])) through ``impl``."""
    extra = implementation_kwargs(impl, q.shape[-1])

    def f(q, k, v, bias):
        return pf.attention(q, k, v, bias, mask, return_residual=True, **kwargs, **extra)

    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    return out, lse, grads if bias is not None else grads[:3]


def check(impl, q, k, v, d_out, *, bias=None, mask=None, spec: MaskSpec | None = None,
          segment_ids=None, **kwargs):
    """out, lse, dq, dk, dv and dbias of ``impl`` vs the float64 oracle; returns
    ``(out, lse, grads)`` as :func:`run`."""
    spec = spec or MaskSpec(q.shape[1], k.shape[1])
    out, lse, grads = run(impl, q, k, v, d_out, bias=bias, mask=mask,
                          is_causal=spec.is_causal, causal_alignment=spec.causal_alignment,
                          local_window_size=spec.window, **kwargs)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=spec, segment_ids=segment_ids, bias=bias, attn_mask=mask, d_out=d_out)
    tol = tolerance(q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref_out) < tol
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < tol
    names = ("dq", "dk", "dv", "dbias")[:len(ref_grads)]
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 2 * tol, name
    if bias is not None:
        assert grads[3].dtype == bias.dtype
    return out, lse, grads


# (batch, seq_q, seq_kv, heads, kv_heads, causal, bias shape, mask shape)
CASES = [
    (2, 40, 56, 4, 2, False, "TS", "BN1S"),         # one [T, S] bias for every batch, head
    (2, 48, 48, 2, 1, True, "B11S", "B11S"),        # padding-style bias and mask, MQA
    (1, 37, 45, 4, 2, False, "1NTS", "11TS"),       # per-head bias shared by the batch
    (1, 64, 40, 4, 2, False, "1N1S", "B1T1"),       # per-head key bias, GQA; row mask
]


def _case_id(case):
    b, t, s, n, k, causal, bias, mask = case
    return f"b{b}-t{t}-s{s}-n{n}k{k}-{'causal' if causal else 'full'}-bias{bias}-mask{mask}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_float64_oracle(impl, case):
    batch, seq_q, seq_kv, heads, kv_heads, causal, bias_spec, mask_spec = case
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, 32)
    dims = (batch, heads, seq_q, seq_kv)
    bias = None if bias_spec is None else random_bias(bias_spec, *dims)
    mask = None if mask_spec is None else random_mask(mask_spec, *dims)
    check(impl, q, k, v, d_out, bias=bias, mask=mask, spec=MaskSpec(seq_q, seq_kv, causal))


def test_bfloat16(impl):
    q, k, v, d_out = random_qkv(1, 48, 48, 4, 2, 64, jnp.bfloat16)
    bias = random_bias("1NTS", 1, 4, 48, 48, jnp.bfloat16)
    check(impl, q, k, v, d_out, bias=bias, mask=random_mask("11TS", 1, 4, 48, 48),
          spec=MaskSpec(48, 48, True))


def test_bias_constant_along_keys_has_zero_gradient(impl):
    # Softmax is shift invariant: a bias that is constant over the keys of a row changes
    # nothing, and its gradient (the row sum of dS) is zero up to rounding.
    q, k, v, d_out = random_qkv(1, 40, 40, 2, 2, 32)
    bias = random_bias("BNT1", 1, 2, 40, 40)
    out, _, grads = run(impl, q, k, v, d_out, bias=bias, is_causal=True)
    ref_out, _ = attention_float64(q, k, v, mask=MaskSpec(40, 40, True))
    assert rel_err(out, ref_out) < 1e-5
    assert grads[3].shape == bias.shape
    assert np.abs(np.asarray(grads[3])).max() < 1e-5


def test_with_segments_window_and_softcap(impl):
    q, k, v, d_out = random_qkv(2, 60, 60, 2, 1, 32)
    ids = jnp.cumsum(jax.random.bernoulli(fresh_key(), 0.06, (2, 60)), axis=1)
    ids = ids.astype(jnp.int32)
    spec = MaskSpec(60, 60, True, window=(25, 0))
    bias = random_bias("1NTS", 2, 2, 60, 60)
    mask = random_mask("B11S", 2, 2, 60, 60, keep=0.8)
    extra = implementation_kwargs(impl, 32)

    def f(q, k, v, bias):
        return pf.attention(q, k, v, bias, mask, is_causal=True, local_window_size=(25, 0),
                            q_segment_ids=ids, logits_soft_cap=4.0, return_residual=True,
                            **extra)

    (out, lse), vjp = jax.vjp(f, 3 * q, k, v, bias)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(
        3 * q, k, v, mask=spec, segment_ids=(ids, ids), softcap=4.0, bias=bias,
        attn_mask=mask, d_out=d_out)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, np.transpose(ref_lse, (0, 2, 1))) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5


def test_fully_masked_rows_give_zero(impl):
    q, k, v, d_out = random_qkv(2, 40, 40, 2, 2, 32)
    # Rows 5-8 hidden by the mask, row 12 by an additive -inf bias.
    mask = random_mask("B1TS", 2, 2, 40, 40).at[:, :, 5:9].set(False)
    bias = random_bias("BNTS", 2, 2, 40, 40).at[:, :, 12].set(-jnp.inf)  # full size
    out, lse, (dq, dk, dv, d_bias) = check(impl, q, k, v, d_out, bias=bias, mask=mask)
    for x in (out, lse, dq, dk, dv, d_bias):
        assert np.all(np.isfinite(np.asarray(x)))
    for rows in (slice(5, 9), slice(12, 13)):
        assert np.all(np.asarray(out[:, rows]) == 0.0)
        assert np.all(np.asarray(lse[:, rows]) == EMPTY_ROW_LSE)
        assert np.all(np.asarray(dq[:, rows]) == 0.0)
        assert np.all(np.asarray(d_bias[:, :, rows]) == 0.0)


def test_bias_gradient_only_when_differentiated(impl, monkeypatch):
    """A bias nobody differentiates (an additive mask) costs no dbias work."""
    backend = importlib.import_module(f"pallas_flash.{impl}")
    kernels, bias_grad_flags = backend.KERNELS, []

    def spy(*args, **kwargs):
        bias_grad_flags.append(kwargs.get("bias_grad", False))
        return kernels.backward(*args, **kwargs)

    monkeypatch.setattr(backend, "KERNELS", dataclasses.replace(kernels, backward=spy))
    q, k, v, d_out = random_qkv(1, 40, 40, 2, 2, 32)
    bias = jnp.where(random_mask("TS", 1, 2, 40, 40), 0.0, -1e9)
    extra = implementation_kwargs(impl, 32)

    def loss(q, bias):
        return jnp.sum(pf.attention(q, k, v, bias, **extra) * d_out)

    dq = jax.grad(loss)(q, bias)
    _, _, (ref_dq, *_) = attention_float64(q, k, v, bias=bias, d_out=d_out)
    assert rel_err(dq, ref_dq) < 2e-5
    assert bias_grad_flags == [False]  # (differentiated biases: every other test)


def test_jit_and_vmap(impl):
    q, k, v, d_out = random_qkv(3, 32, 32, 2, 2, 32)
    bias = random_bias("BNTS", 3, 2, 32, 32)
    mask = random_mask("B11S", 3, 2, 32, 32, keep=0.8).at[..., 0].set(True)
    extra = implementation_kwargs(impl, 32)

    def loss(q, k, v, bias, mask, d_out):
        out = pf.attention(q[None], k[None], v[None], bias[None], mask[None], is_causal=True,
                           **extra)
        return jnp.sum(out * d_out[None])

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, k, v, bias, mask,
                                                                      d_out)
    spec = MaskSpec(32, 32, True)
    for i in range(3):
        _, _, want = attention_float64(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask=spec,
                                       bias=bias[i:i + 1], attn_mask=mask[i:i + 1],
                                       d_out=d_out[i:i + 1])
        for got, w in zip(batched, want, strict=True):
            assert rel_err(got[i:i + 1], w) < 2e-5


def test_references_accept_bias_and_mask():
    from pallas_flash.reference import (
        flash_attention_v1,
        flash_attention_v2,
        standard_attention,
    )

    q, k, v, _ = random_qkv(2, 64, 64, 2, 1, 32)
    bias = random_bias("1NTS", 2, 2, 64, 64)
    mask = random_mask("B11S", 2, 2, 64, 64)
    spec = MaskSpec(64, 64, True)
    ref_out, ref_lse = attention_float64(q, k, v, mask=spec, bias=bias, attn_mask=mask)
    for fn in (standard_attention, flash_attention_v1, flash_attention_v2):
        out, lse = fn(q, k, v, mask=spec, bias=bias, attn_mask=mask)
        assert rel_err(out, ref_out) < 1e-5, fn.__name__
        assert rel_err(lse, ref_lse) < 1e-5, fn.__name__


def test_matches_jax_nn():
    """Same convention as jax.nn.dot_product_attention (bias after scaling, mask AND causal)."""
    q, k, v, _ = random_qkv(2, 32, 32, 4, 2, 16)
    bias = random_bias("1NTS", 2, 4, 32, 32)
    mask = random_mask("B11S", 2, 4, 32, 32).at[:, :, :, 0].set(True)  # no empty rows
    want = jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=True)
    got = pf.attention(q, k, v, bias, mask, is_causal=True, implementation="xla")
    assert rel_err(got, want) < 1e-5


BAD = [
    (dict(bias=jnp.zeros((1, 1, 1, 2, 8, 8))), "bias must be an array of rank <= 4"),
    (dict(bias=jnp.zeros((2, 3, 8, 8))), "bias shape"),
    (dict(bias=jnp.zeros((8, 7))), "bias shape"),
    (dict(bias=jnp.zeros((8, 8), jnp.int32)), "bias must be an array with a floating dtype"),
    (dict(bias=[[0.0]]), "bias must be an array with a floating dtype"),
    (dict(mask=jnp.ones((8, 8), jnp.float32)), "mask must be a boolean array"),
    (dict(mask=jnp.ones((2, 1, 8, 9), bool)), "mask shape"),
    (dict(mask=jnp.ones((1, 1, 1, 1, 1), bool)), "mask must be an array of rank <= 4"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs(kwargs, message):
    q = jnp.zeros((2, 8, 2, 16))
    with pytest.raises(ValueError, match=message):
        pf.attention(q, q, q, **kwargs)


def test_mosaic_reports_bias_and_mask_unsupported_above_head_dim_192():
    """The Mosaic forward takes bias / mask arrays up to head_dim 192 (at 256 the K/V rings
    leave no shared memory for a bias tile); above, the API names the reason."""
    spec = MaskSpec(128, 128)
    for head_dim, supported in ((64, True), (192, True), (256, False)):
        shape = (1, 128, 2, head_dim)
        for kwargs in (dict(has_bias=True), dict(has_mask=True)):
            reason = mosaic.unsupported(shape, shape, jnp.bfloat16, spec, False, **kwargs)
            assert (reason is None) == supported, (head_dim, kwargs, reason)
    q = jnp.zeros((1, 64, 2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='mosaic' cannot run this call: bias"):
        pf.attention(q, q, q, jnp.zeros((64, 64)), implementation="mosaic", interpret=True)

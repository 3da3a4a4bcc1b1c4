"""``bias`` and ``mask`` arrays (as ``jax.nn.dot_product_attention``) vs the float64 oracle.

Shapes are written as strings over ``B N T S`` (batch, query heads, seq_q, seq_kv) with
``1`` for a broadcast dim: ``"TS"`` is a rank-2 ``[seq_q, seq_kv]`` array, ``"B11S"`` a
padding-mask style ``[batch, 1, 1, seq_kv]`` one.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import (
    BF16,
    F16,
    F32,
    assert_matches,
    backend_cases,
    backends,
    fresh_key,
    fresh_rng,
    random_qkv,
    rel_err,
    run_attention,
    tolerance,
)

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64


def _shape(spec: str, batch, heads, seq_q, seq_kv) -> tuple[int, ...]:
    sizes = {"B": batch, "N": heads, "T": seq_q, "S": seq_kv, "1": 1}
    return tuple(sizes[c] for c in spec)


def random_bias(spec: str, batch, heads, seq_q, seq_kv, dtype=jnp.float32):
    shape = _shape(spec, batch, heads, seq_q, seq_kv)
    return jnp.asarray(2 * fresh_rng().standard_normal(shape, np.float32)).astype(dtype)


def random_mask(spec: str, batch, heads, seq_q, seq_kv, keep=0.7):
    return jnp.asarray(fresh_rng().random(_shape(spec, batch, heads, seq_q, seq_kv)) < keep)


def check(backend, q, k, v, d_out, *, bias=None, mask=None, spec: MaskSpec | None = None,
          segment_ids=None, bias_grad=True, **kwargs):
    """out, lse, dq, dk, dv and dbias of ``backend`` vs the float64 oracle; returns
    ``(out, lse, grads)`` as ``support.run_attention``."""
    spec = spec or MaskSpec(q.shape[1], k.shape[1])
    out, lse, grads = run_attention(
        backend, q, k, v, d_out, bias=bias, mask=mask, bias_grad=bias_grad,
        is_causal=spec.is_causal, causal_alignment=spec.causal_alignment,
        local_window_size=spec.window, **kwargs)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=spec, segment_ids=segment_ids, bias=bias, attn_mask=mask, d_out=d_out)
    assert out.dtype == q.dtype
    assert_matches(out, lse, grads[:3], ref_out, ref_lse, ref_grads[:3], q.dtype)
    if len(grads) == 4:  # dbias, rounded to the bias's dtype
        assert grads[3].dtype == bias.dtype and grads[3].shape == bias.shape
        tol = max(tolerance(q.dtype), tolerance(bias.dtype))
        assert rel_err(grads[3], ref_grads[3]) < 2 * tol, rel_err(grads[3], ref_grads[3])
    return out, lse, grads


class Case(NamedTuple):
    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    kv_heads: int
    causal: bool
    bias: str | None          # shape spec, None: no bias
    mask: str | None          # shape spec, None: no mask
    bias_dtype: jnp.dtype = F32
    bias_grad: bool = True    # differentiate the bias (else dq, dk, dv only)
    window: tuple[int, int] | None = None
    head_dim: int = 32


CASES = [
    Case(2, 40, 56, 4, 2, False, "TS", "BN1S"),      # one [T, S] bias for every batch, head
    Case(2, 48, 48, 2, 1, True, "B11S", "B11S"),     # padding-style bias and mask, MQA
    Case(1, 37, 45, 4, 2, False, "1NTS", "11TS"),    # per-head bias shared by the batch
    Case(1, 64, 40, 4, 2, False, "1N1S", "B1T1"),    # per-head key bias, GQA; row mask
    # Over several 128-row CTAs and 64-key blocks of the Mosaic kernels, each kind of
    # reader: a bias / mask tile ring ("..TS"), a key-row ring ("..1S"), rows read once
    # ("..T1"); a mask that broadcasts to the bias's shape folds into it as -inf. With the
    # bias a constant, the Mosaic backward reads them too (dbias is Triton's).
    Case(2, 128, 128, 2, 1, False, "BNTS", None, BF16, False, head_dim=64),
    Case(2, 128, 128, 2, 1, False, None, "B1TS", head_dim=64),
    Case(2, 100, 170, 2, 1, True, "1NTS", "B11S", F32, False, head_dim=64),
    Case(2, 128, 100, 2, 1, True, "B11S", "B1TS", BF16, False, head_dim=64),
    Case(2, 128, 100, 2, 1, False, "BNT1", "1NT1", F32, False, (50, 30), head_dim=64),
    Case(2, 100, 130, 2, 1, True, "1NTS", "B11S", F16, True, head_dim=64),
    Case(2, 128, 160, 2, 1, True, "B1TS", "B11S", BF16, True, head_dim=64),  # folded
    Case(1, 128, 128, 2, 1, False, "BNTS", "B1TS", BF16, False, head_dim=64),  # folded
    Case(1, 130, 130, 2, 1, True, "11TS", "B11S", F32, False, head_dim=192),
]


def _case_id(case: Case):
    b, t, s, n, k, causal, bias, mask, bias_dtype, bias_grad, window, d = case
    return (f"b{b}-t{t}-s{s}-n{n}k{k}-d{d}-{'causal' if causal else 'full'}"
            f"{'-w' + str(window) if window else ''}-bias{bias}"
            f"{'-' + jnp.dtype(bias_dtype).name if bias else ''}"
            f"{'-dbias' if bias and bias_grad else ''}-mask{mask}")


@pytest.mark.parametrize(("backend", "case"), backend_cases(
    CASES, _case_id, lambda c: dict(head_dim=c.head_dim, bias=True)))
def test_matches_float64_oracle(backend, case):
    batch, seq_q, seq_kv, heads, kv_heads, causal, bias_spec, mask_spec = case[:8]
    q, k, v, d_out = random_qkv(batch, seq_q, seq_kv, heads, kv_heads, case.head_dim,
                                backend.dtype)
    dims = (batch, heads, seq_q, seq_kv)
    bias = None if bias_spec is None else random_bias(bias_spec, *dims, case.bias_dtype)
    mask = None if mask_spec is None else random_mask(mask_spec, *dims)
    check(backend, q, k, v, d_out, bias=bias, mask=mask, bias_grad=case.bias_grad,
          spec=MaskSpec(seq_q, seq_kv, causal, window=case.window))


@pytest.mark.parametrize("backend", backends(dtype=BF16, bias=True))
def test_bfloat16(backend):
    q, k, v, d_out = random_qkv(1, 48, 48, 4, 2, 64, jnp.bfloat16)
    bias = random_bias("1NTS", 1, 4, 48, 48, jnp.bfloat16)
    check(backend, q, k, v, d_out, bias=bias, mask=random_mask("11TS", 1, 4, 48, 48),
          spec=MaskSpec(48, 48, True))


@pytest.mark.parametrize("backend", backends(bias=True))
def test_integer_mask_is_read_as_nonzero_visible(backend):
    """A 0/1 integer mask (Keras passes one) gives the results of the boolean mask it
    encodes; jax.nn refuses it."""
    q, k, v, d_out = random_qkv(2, 48, 56, 2, 1, 32, backend.dtype)
    visible = random_mask("B1TS", 2, 2, 48, 56)
    out, lse, grads = run_attention(backend, q, k, v, d_out, mask=visible.astype(jnp.int32),
                                    is_causal=True)
    ref_out, ref_lse, ref_grads = attention_float64(
        q, k, v, mask=MaskSpec(48, 56, True), attn_mask=visible, d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, q.dtype)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16])
def test_integer_mask_any_nonzero_value_is_visible(dtype):
    """Every integer dtype; every nonzero value (not only 1) shows the key, as
    ``mask.astype(bool)`` and ``jnp.where`` read it."""
    q, k, v, _ = random_qkv(1, 32, 32, 2, 2, 16)
    visible = random_mask("1NTS", 1, 2, 32, 32).at[..., 0].set(True)  # no empty rows
    values = jnp.asarray(fresh_rng().integers(1, 100, visible.shape))
    if jnp.issubdtype(dtype, jnp.signedinteger):
        values = values * jnp.where(fresh_rng().random(visible.shape) < 0.5, -1, 1)
    mask = jnp.where(visible, values, 0).astype(dtype)
    assert mask.dtype == dtype and bool(jnp.all((mask != 0) == visible))
    out = pf.attention(q, k, v, mask=mask, implementation="xla")
    ref_out, _ = attention_float64(q, k, v, attn_mask=visible)
    assert rel_err(out, ref_out) < tolerance(q.dtype)


@pytest.mark.parametrize("backend", backends(bias=True))
def test_bias_constant_along_keys_has_zero_gradient(backend):
    # Softmax is shift invariant: a bias that is constant over the keys of a row changes
    # nothing, and its gradient (the row sum of dS) is zero up to rounding.
    q, k, v, d_out = random_qkv(1, 40, 40, 2, 2, 32, backend.dtype)
    bias = random_bias("BNT1", 1, 2, 40, 40)
    out, _, grads = run_attention(backend, q, k, v, d_out, bias=bias, is_causal=True)
    ref_out, _, ref_grads = attention_float64(q, k, v, mask=MaskSpec(40, 40, True),
                                              d_out=d_out)
    assert rel_err(out, ref_out) < tolerance(q.dtype)
    assert grads[3].shape == bias.shape
    # dbias_i = Σ_j P_ij (dP_ij − delta_i) = dO_i·O_i − delta_i, and delta_i = dO_i·out_i
    # reads the output as returned: dbias is exactly dO_i·(O_i − out_i), which the rounding
    # of a 16-bit out makes nonzero. It must be that, to float32 accumulation error.
    d_out64, out64 = (np.asarray(x, np.float64) for x in (d_out, out))
    expected = np.einsum("bqhd,bqhd->bhq", d_out64, np.asarray(ref_out) - out64)
    err = np.abs(np.asarray(grads[3], np.float64)[..., 0] - expected).max()
    assert err < tolerance(F32) * np.abs(ref_grads[0]).max(), err


@pytest.mark.parametrize("backend", backends(bias=True))
def test_with_segments_window_and_softcap(backend):
    q, k, v, d_out = random_qkv(2, 60, 60, 2, 1, 32, backend.dtype)
    ids = jnp.cumsum(jax.random.bernoulli(fresh_key(), 0.06, (2, 60)), axis=1)
    ids = ids.astype(jnp.int32)
    spec = MaskSpec(60, 60, True, window=(25, 0))
    bias = random_bias("1NTS", 2, 2, 60, 60)
    mask = random_mask("B11S", 2, 2, 60, 60, keep=0.8)

    def f(q, k, v, bias):
        return backend.attention(q, k, v, bias, mask, is_causal=True,
                                 local_window_size=(25, 0), q_segment_ids=ids,
                                 logits_soft_cap=4.0, return_lse=True)

    (out, lse), vjp = jax.vjp(f, 3 * q, k, v, bias)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    ref_out, ref_lse, ref_grads = attention_float64(
        3 * q, k, v, mask=spec, segment_ids=(ids, ids), softcap=4.0, bias=bias,
        attn_mask=mask, d_out=d_out)
    assert_matches(out, lse, grads, ref_out, ref_lse, ref_grads, q.dtype,
                   names=("dq", "dk", "dv", "dbias"))


@pytest.mark.parametrize("with_bias", [True, False], ids=["folded", "mask"])
@pytest.mark.parametrize("backend", backends(bias=True))
def test_fully_masked_rows_give_zero(backend, with_bias):
    """Rows the mask hides entirely give out 0 and lse EMPTY_ROW_LSE, never NaN: through
    the mask alone (every block masked), or with an additive -inf bias row and the mask
    folded into the bias, where the other blocks' softmax must also survive rows that have
    seen only -inf. Also a whole 64-key block hidden for one head."""
    seq, batch = 130, 1  # (batched masks and biases: test_matches_float64_oracle)
    q, k, v, d_out = random_qkv(batch, seq, seq, 2, 2, 32, backend.dtype)
    # Rows 60-69 (over two 64-row tiles) hidden by the mask, row 12 by an additive -inf
    # bias, rows 110.. of head 1.
    mask = random_mask("B1TS", batch, 2, seq, seq).at[:, :, 60:70].set(False)
    mask = jnp.broadcast_to(mask, (batch, 2, seq, seq)).at[:, 1, 110:].set(False)
    mask = mask.at[:, 1, :, 64:128].set(False)
    bias = None
    if with_bias:
        bias = random_bias("BNTS", batch, 2, seq, seq).at[:, :, 12].set(-jnp.inf)  # full size
    out, lse, grads = check(backend, q, k, v, d_out, bias=bias, mask=mask)
    for x in (out, lse, *grads):
        assert np.all(np.isfinite(np.asarray(x, np.float32)))
    hidden = [(slice(60, 70), slice(None)), (slice(110, None), 1)]
    if with_bias:
        hidden.append((slice(12, 13), slice(None)))
    for rows, heads in hidden:
        assert np.all(np.asarray(out[:, rows, heads]) == 0.0)
        assert np.all(np.asarray(lse[:, rows, heads]) == EMPTY_ROW_LSE)
        assert np.all(np.asarray(grads[0][:, rows, heads]) == 0.0)
        if with_bias:
            assert np.all(np.asarray(grads[3][:, heads, rows]) == 0.0)


@pytest.mark.parametrize("backend", backends(bias=True))
def test_bias_gradient_only_when_differentiated(backend, monkeypatch):
    """A bias nobody differentiates (an additive mask) costs no dbias work."""
    module = importlib.import_module(f"pallas_flash.{backend.name}")
    kernels, bias_grad_flags = module.KERNELS, []

    def spy(*args, **kwargs):
        bias_grad_flags.append(kwargs.get("bias_grad", False))
        return kernels.backward(*args, **kwargs)

    monkeypatch.setattr(module, "KERNELS", dataclasses.replace(kernels, backward=spy))
    q, k, v, d_out = random_qkv(1, 40, 40, 2, 2, 32, backend.dtype)
    bias = jnp.where(random_mask("TS", 1, 2, 40, 40), 0.0, -1e9)

    def loss(q, bias):
        return jnp.sum(backend.attention(q, k, v, bias).astype(jnp.float32) * d_out)

    dq = jax.grad(loss)(q, bias)
    _, _, (ref_dq, *_) = attention_float64(q, k, v, bias=bias, d_out=d_out)
    assert rel_err(dq, ref_dq) < 2 * tolerance(q.dtype)
    assert bias_grad_flags == [False]  # (differentiated biases: every other test)


@pytest.mark.parametrize("backend", backends(bias=True))
def test_jit_and_vmap(backend):
    q, k, v, d_out = random_qkv(3, 32, 32, 2, 2, 32, backend.dtype)
    bias = random_bias("BNTS", 3, 2, 32, 32)
    mask = random_mask("B11S", 3, 2, 32, 32, keep=0.8).at[..., 0].set(True)

    def loss(q, k, v, bias, mask, d_out):
        out = backend.attention(q[None], k[None], v[None], bias[None], mask[None],
                                is_causal=True)
        return jnp.sum(out.astype(jnp.float32) * d_out[None])

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(q, k, v, bias, mask,
                                                                      d_out)
    spec = MaskSpec(32, 32, True)
    for i in range(3):
        _, _, want = attention_float64(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask=spec,
                                       bias=bias[i:i + 1], attn_mask=mask[i:i + 1],
                                       d_out=d_out[i:i + 1])
        for got, w in zip(batched, want, strict=True):
            assert rel_err(got[i:i + 1], w) < 2 * tolerance(q.dtype)


def test_references_accept_bias_and_mask():
    from pallas_flash.reference import standard_attention
    from pallas_flash.tutorial.loops import flash_attention_v1, flash_attention_v2

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
    (dict(bias=[[1]]), "bias must be an array with a floating dtype"),
    (dict(mask=jnp.ones((8, 8), jnp.float32)),
     r"mask must be a boolean or integer array .*, got dtype float32: pass an additive mask "
     r"as bias, or cast it \(mask.astype\(bool\)\)"),
    (dict(mask=jnp.ones((8, 8), jnp.complex64)), "mask must be a boolean or integer array"),
    (dict(mask=jnp.ones((2, 1, 8, 9), jnp.int32)), "mask shape"),
    (dict(mask=jnp.ones((2, 1, 8, 9), bool)), "mask shape"),
    (dict(mask=jnp.ones((1, 1, 1, 1, 1), bool)), "mask must be an array of rank <= 4"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs(kwargs, message):
    q = jnp.zeros((2, 8, 2, 16))
    with pytest.raises(ValueError, match=message):
        pf.attention(q, q, q, **kwargs)

"""pallas_flash.nn: the NNX layer and the Linen attention_fn against plain references."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_flash.masking import MaskSpec
from pallas_flash.nn import (
    FlashSelfAttention,
    check_cache_room,
    make_attention_fn,
    masked_attention,
    rotary_embedding,
)
from pallas_flash.reference import attention_float64, standard_attention

D_MODEL, HEADS = 32, 4
ROOT = Path(__file__).resolve().parents[1]


def reference_attention(query, key, value, *, is_causal, local_window_size, q_segment_ids,
                        kv_segment_ids):
    """The layer's AttentionFn contract, computed by the materialised-softmax reference."""
    window = local_window_size
    if isinstance(window, int):
        window = (window, window)
    mask = MaskSpec(seq_q=query.shape[1], seq_kv=key.shape[1], is_causal=is_causal,
                    window=window)
    segments = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    out, _ = standard_attention(query, key, value, mask=mask, segment_ids=segments)
    return out


def _layer(**kwargs) -> FlashSelfAttention:
    """Same seed, so two layers differing only in attention_fn share their parameters."""
    return FlashSelfAttention(D_MODEL, HEADS, rngs=nnx.Rngs(0), **kwargs)


def _inputs(batch=2, seq=16, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, seq, D_MODEL))


def _value_and_param_grads(layer, x, **call_kwargs):
    """(out, d sum(out * cotangent) / d params), in one jitted call."""
    graphdef, params = nnx.split(layer)
    cotangent = jax.random.normal(jax.random.key(7), x.shape)

    def loss(params):
        out = nnx.merge(graphdef, params)(x, **call_kwargs)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("kwargs, segmented", [
    ({"num_kv_heads": 2}, True),                                  # GQA, causal, packed
    ({"fused_qkv": False, "local_window_size": 3}, False),        # separate projections
    ({"num_kv_heads": 1, "is_causal": False, "use_bias": True,    # MQA, bidirectional,
      "rope_base": None, "local_window_size": (2, 1)}, True),     # asymmetric window
])
def test_layer_matches_reference_attention(kwargs, segmented):
    x = _inputs()
    call = {}
    if segmented:
        call["segment_ids"] = jnp.array([[1] * 5 + [2] * 11, [1] * 9 + [2] * 4 + [3] * 3])
        call["positions"] = jnp.array([list(range(5)) + list(range(11)),
                                       list(range(9)) + list(range(4)) + list(range(3))])
    out, grads = _value_and_param_grads(_layer(**kwargs), x, **call)
    want_out, want_grads = _value_and_param_grads(
        _layer(attention_fn=reference_attention, **kwargs), x, **call)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gqa_projection_shapes_and_shared_heads():
    layer = _layer(num_kv_heads=2, fused_qkv=False)
    assert layer.q_proj.kernel.shape == (D_MODEL, HEADS * 8)
    assert layer.k_proj.kernel.shape == layer.v_proj.kernel.shape == (D_MODEL, 2 * 8)
    fused = _layer(num_kv_heads=2)
    assert fused.qkv_proj.kernel.shape == (D_MODEL, (HEADS + 2 * 2) * 8)
    # Copying each KV head to the query heads that share it gives the same layer as MHA.
    mha = _layer(fused_qkv=False)
    for name in ("k_proj", "v_proj"):
        kernel = getattr(layer, name).kernel[...].reshape(D_MODEL, 2, 1, 8)
        getattr(mha, name).kernel[...] = jnp.repeat(kernel, 2, axis=2).reshape(D_MODEL, -1)
    mha.q_proj.kernel[...] = layer.q_proj.kernel[...]
    mha.out_proj.kernel[...] = layer.out_proj.kernel[...]
    x = _inputs()
    np.testing.assert_allclose(layer(x), mha(x), rtol=1e-5, atol=1e-5)


def test_packed_documents_equal_separate_documents():
    layer = _layer(num_kv_heads=2)
    forward = jax.jit(lambda x, **kw: layer(x, **kw))
    x = _inputs(batch=1, seq=16)
    packed = forward(x, segment_ids=jnp.array([[1] * 8 + [2] * 8]),
                     positions=jnp.array([list(range(8)) * 2]))
    separate = jnp.concatenate([forward(x[:, :8]), forward(x[:, 8:])], axis=1)
    np.testing.assert_allclose(packed, separate, rtol=1e-5, atol=1e-5)


def test_cached_decoding_reproduces_full_forward():
    layer = _layer(num_kv_heads=2, local_window_size=4)
    x = _inputs(seq=12)
    full = layer(x)
    layer.init_cache(batch_size=2, max_length=12)
    # A 5-token prefill, then one token at a time.
    steps = [layer(x[:, :5], decode=True)]
    steps += [layer(x[:, t:t + 1], decode=True) for t in range(5, 12)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(layer.cache_index[...]) == 12


def test_soft_cap_and_sinks_decode_equals_full_forward():
    # The full forward runs pallas_flash.attention; decoding runs decode_attention over the
    # cache (split-KV, per-step lengths): two paths of soft-cap + sinks agree.
    layer = _layer(num_kv_heads=2, logits_soft_cap=2.0, use_sinks=True)
    layer.sinks[...] = jnp.array([-1.0, 0.0, 0.5, 2.0])
    x = _inputs(seq=10) * 4
    full = layer(x)
    assert not np.allclose(full, _layer(num_kv_heads=2)(x), atol=1e-3)
    layer.init_cache(batch_size=2, max_length=10)
    steps = [layer(x[:, :4], decode=True)]
    steps += [layer(x[:, t:t + 1], decode=True) for t in range(4, 10)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)


def test_decode_steps_run_decode_attention_unless_an_attention_fn_is_given(monkeypatch):
    from pallas_flash import nn as pnn
    lengths = []
    real = pnn.decode_attention

    def spy(*args, **kwargs):
        lengths.append(int(kwargs["key_value_seq_lengths"]))  # one for every row
        return real(*args, **kwargs)

    monkeypatch.setattr(pnn, "decode_attention", spy)
    x = _inputs(seq=20)
    for layer, expected in ((_layer(num_kv_heads=2), [3, 4, 20]),
                            (_layer(num_kv_heads=2, attention_fn=pnn.attention), [])):
        lengths.clear()
        layer.init_cache(batch_size=2, max_length=20)
        layer(x[:, :3], decode=True)   # a short prefill is a decode step too
        layer(x[:, 3:4], decode=True)
        layer(x[:, 4:], decode=True)   # 16 tokens: the longest decode step
        assert lengths == expected


def test_a_cudnn_layer_decodes_on_the_package_choice(monkeypatch):
    """implementation="cudnn" (which decode_attention refuses) still decodes: its steps
    call decode_attention with the package's choice, and match a default layer's."""
    from pallas_flash import nn as pnn
    names = []
    real = pnn.decode_attention

    def spy(*args, **kwargs):
        names.append(kwargs["implementation"])
        return real(*args, **kwargs)

    monkeypatch.setattr(pnn, "decode_attention", spy)
    x = _inputs(seq=3)
    outs = []
    for implementation in ("cudnn", None):
        layer = _layer(implementation=implementation)
        layer.init_cache(batch_size=2, max_length=8)
        outs.append(np.asarray(layer(x[:, :1], decode=True)))
    assert names == [None, None]
    assert np.all(np.isfinite(outs[0]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_sinks_are_trained():
    _, grads = _value_and_param_grads(_layer(use_sinks=True), _inputs())
    assert grads["sinks"].shape == (HEADS,)
    assert np.all(np.abs(grads["sinks"]) > 0)


def test_rotary_embedding_depends_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def score(q_pos, k_pos):
        rq = rotary_embedding(q, jnp.array([[q_pos]]), 10_000.0)
        rk = rotary_embedding(k, jnp.array([[k_pos]]), 10_000.0)
        return jnp.sum(rq * rk)

    np.testing.assert_allclose(score(7, 3), score(107, 103), rtol=1e-4)
    np.testing.assert_allclose(rotary_embedding(q, jnp.array([[0]]), 10_000.0), q)


@pytest.fixture
def attention_calls(monkeypatch) -> list:
    """The keyword arguments of each pallas_flash.attention call the layers make."""
    from pallas_flash import nn

    calls: list = []
    original = nn.attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(nn, "attention", spy)
    return calls


def test_deterministic_backward_reaches_attention(attention_calls):
    """Both layers pass ``deterministic_backward`` on as attention's ``deterministic``;
    Flax's call-time ``deterministic`` (no dropout) does not."""
    x = _inputs(seq=8)
    _layer(deterministic_backward=True, implementation="xla")(x)
    fn = make_attention_fn(deterministic_backward=True)
    q = x.reshape(2, 8, HEADS, D_MODEL // HEADS)
    fn(q, q, q, deterministic=False)
    make_attention_fn()(q, q, q, deterministic=True)
    assert [c["deterministic"] for c in attention_calls] == [True, True, False]
    with pytest.raises(ValueError, match="deterministic_backward"):
        _layer(attention_fn=reference_attention, deterministic_backward=True)


def test_layer_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _layer(num_kv_heads=3)
    with pytest.raises(ValueError, match="either attention_fn or implementation"):
        _layer(attention_fn=reference_attention, implementation="xla")
    with pytest.raises(ValueError, match="init_cache"):
        _layer()(_inputs(), decode=True)
    with pytest.raises(ValueError, match="is_causal"):
        _layer(is_causal=False).init_cache(1, 4)


@pytest.mark.parametrize("dtype", ["float13", jnp.int8, "bool", 3])
def test_layer_refuses_a_dtype_at_construction(dtype):
    """Not at the first call, where it used to fail inside the projections."""
    with pytest.raises(ValueError, match="dtype must be None or one of bfloat16, float16, "
                                         "float32, float64"):
        _layer(dtype=dtype)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, "float16", jnp.dtype(jnp.float32)])
def test_layer_takes_float_dtypes(dtype):
    out = _layer(dtype=dtype, implementation="xla")(_inputs())
    assert out.dtype == (jnp.float32 if dtype is None else jnp.dtype(dtype))


def _linen_pair(attention_fn, x, our_kwargs=None, **call_kwargs):
    """Outputs of MultiHeadDotProductAttention with flax's default and with attention_fn,
    on the same parameters."""
    default = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)
    ours = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL,
                                              attention_fn=attention_fn)
    params = default.init(jax.random.key(0), x)
    return ours.apply(params, x, **(our_kwargs or {})), default.apply(params, x, **call_kwargs)


@pytest.mark.parametrize("is_causal", [False, True])
def test_linen_attention_fn_matches_flax_default(is_causal):
    x = _inputs()
    mask = {"mask": linen.make_causal_mask(x[..., 0])} if is_causal else {}
    got, want = _linen_pair(make_attention_fn(is_causal=is_causal), x, **mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_linen_attention_fn_extra_batch_dims():
    x = _inputs(batch=6).reshape(2, 3, 16, D_MODEL)
    got, want = _linen_pair(make_attention_fn(), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_dims", [(6,), (2, 3)])
def test_linen_attention_fn_takes_linen_masks(batch_dims):
    # A padding mask per example (Linen's make_attention_mask) and a causal one, combined.
    x = _inputs(batch=6).reshape(*batch_dims, 16, D_MODEL)
    lengths = jnp.arange(11, 17).reshape(batch_dims)
    valid = jnp.arange(16) < lengths[..., None]
    mask = linen.combine_masks(linen.make_attention_mask(valid, valid),
                               linen.make_causal_mask(x[..., 0]))
    got, want = _linen_pair(make_attention_fn(), x, our_kwargs={"mask": mask}, mask=mask)
    # Padded query rows see keys in flax's version only through its uniform fallback; ours
    # gives them 0 (documented): compare the valid rows.
    np.testing.assert_allclose(np.asarray(got)[np.asarray(valid)],
                               np.asarray(want)[np.asarray(valid)], rtol=1e-5, atol=1e-5)


def test_linen_attention_fn_rejects_what_it_cannot_do():
    fn = make_attention_fn()
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="dropout"):
        fn(q, q, q, dropout_rate=0.1, deterministic=False)
    fn(q, q, q, dropout_rate=0.1, deterministic=True)   # inference: dropout is off
    with pytest.raises(ValueError, match="mask"):
        fn(q, q, q, mask=jnp.ones((1, 1, 5, 4), bool))   # does not broadcast
    with pytest.raises(ValueError, match="rotary"):
        fn(q, q, q, input_positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="causal_alignment"):
        make_attention_fn(causal_alignment="center")
    with pytest.raises(ValueError, match="is_causal"):
        make_attention_fn(is_causal=1)


def _random(shape, seed):
    return jax.random.normal(jax.random.key(seed), shape)


def _linen_param_grads(module, params, x, **call_kwargs):
    """(out, d sum(out * cotangent) / d (params, x)) of a Linen module."""
    cotangent = _random(x.shape, 7)

    def loss(params, x):
        out = module.apply(params, x, **call_kwargs)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    return out, grads


def _assert_trees_close(got, want, tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def _padding_and_causal_mask(seq, key_lengths, combine):
    """Keys past each sequence's length hidden, plus causal: every query row keeps key 0,
    so no row is fully masked (where Flax's and our conventions differ)."""
    valid = jnp.arange(seq) < jnp.asarray(key_lengths)[:, None]
    padding = valid[:, None, None, :]
    causal = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    return combine(padding, causal)


def test_linen_attention_fn_gradients_match_flax_with_mask_and_inference_dropout():
    # dropout_rate > 0 with deterministic=True: inference, so no dropout (Flax's own
    # attention then takes its explicit-weights path; ours runs the kernels).
    x = _inputs(seq=12)
    mask = _padding_and_causal_mask(12, [12, 9], linen.combine_masks)
    mha = functools.partial(linen.MultiHeadDotProductAttention, num_heads=HEADS,
                            qkv_features=D_MODEL, dropout_rate=0.2)
    params = mha().init(jax.random.key(0), x, mask=mask, deterministic=True)
    got = _linen_param_grads(mha(attention_fn=make_attention_fn()), params, x,
                             mask=mask, deterministic=True)
    want = _linen_param_grads(mha(), params, x, mask=mask, deterministic=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    _assert_trees_close(got[1], want[1], 1e-4)


def test_linen_decode_matches_full_causal_forward_at_every_step():
    # Flax decodes one token at a time: the query is one row against the whole cache,
    # and Flax's mask hides the slots not written yet.
    seq = 10
    x = _inputs(seq=seq)
    fn = make_attention_fn(is_causal=True)
    full = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)
    decoder = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL,
                                                 attention_fn=fn, decode=True)
    params = full.init(jax.random.key(0), x)
    want = full.apply(params, x, mask=linen.make_causal_mask(x[..., 0]))   # Flax's own
    cache = decoder.init(jax.random.key(0), x)["cache"]   # sized by x: seq slots
    step = jax.jit(lambda cache, token: decoder.apply({**params, "cache": cache}, token,
                                                      mutable=["cache"]))
    for t in range(seq):
        out, variables = step(cache, x[:, t:t + 1])
        cache = variables["cache"]
        np.testing.assert_allclose(out[:, 0], want[:, t], rtol=1e-5, atol=1e-5,
                                   err_msg=f"step {t}")


def _nnx_attention(attention_fn=None, **kwargs) -> nnx.MultiHeadAttention:
    """Same seed, so layers differing only in attention_fn share their parameters."""
    if attention_fn is not None:
        kwargs["attention_fn"] = attention_fn
    return nnx.MultiHeadAttention(num_heads=HEADS, in_features=D_MODEL, num_kv_heads=2,
                                  decode=False, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("key_padding", [False, True])
def test_nnx_decode_matches_full_causal_forward_at_every_step(key_padding):
    seq = 10
    x = _inputs(seq=seq)
    # A key-padding mask [batch, 1, 1, seq] is combined with Flax's cache mask in decode.
    mask = ((jnp.arange(seq) < jnp.array([seq, 6])[:, None])[:, None, None, :]
            if key_padding else None)
    want = _nnx_attention()(x, mask=mask, is_causal=True)   # Flax's nnx.dot_product_attention
    layer = _nnx_attention(make_attention_fn(is_causal=True))
    layer.init_cache(x.shape)
    step = nnx.jit(lambda layer, token: layer(token, mask=mask, decode=True))
    for t in range(seq):
        np.testing.assert_allclose(step(layer, x[:, t:t + 1])[:, 0], want[:, t],
                                   rtol=1e-5, atol=1e-5, err_msg=f"step {t}")


def _nnx_grads(layer, x, **call_kwargs):
    """(out, d sum(out * cotangent) / d (params, x)) of an NNX layer."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    cotangent = _random(x.shape, 7)

    def loss(params, x):
        out = nnx.merge(graphdef, params, rest)(x, **call_kwargs)
        return jnp.sum(out * cotangent), out

    (_, out), (d_params, d_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, (nnx.to_pure_dict(d_params), d_x)


@pytest.mark.parametrize("ours, layer_kwargs, call_kwargs", [
    # NNX's call-time is_causal reaches our function.
    ({}, {}, {"is_causal": True}),
    # The band from make_attention_fn, a padding mask, and inference with dropout set.
    ({"is_causal": True}, {"dropout_rate": 0.2},
     {"mask": "padding", "deterministic": True}),
])
def test_nnx_attention_fn_matches_flax(ours, layer_kwargs, call_kwargs):
    x = _inputs(seq=12)
    if call_kwargs.get("mask") == "padding":
        padding = (jnp.arange(12) < jnp.array([12, 7])[:, None])[:, None, None, :]
        call_kwargs = {**call_kwargs, "mask": padding}
        # Flax's explicit-weights path cannot broadcast is_causal to a broadcast mask:
        # give it the combined mask.
        flax_call = {**call_kwargs,
                     "mask": _padding_and_causal_mask(12, [12, 7], nnx.combine_masks)}
    else:
        flax_call = call_kwargs
    got = _nnx_grads(_nnx_attention(make_attention_fn(**ours), **layer_kwargs), x,
                     **call_kwargs)
    want = _nnx_grads(_nnx_attention(**layer_kwargs), x, **flax_call)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    _assert_trees_close(got[1], want[1], 1e-4)


def test_dropout_while_training_raises_through_the_flax_layers():
    x = _inputs(seq=4)
    layer = _nnx_attention(make_attention_fn(), dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout"):
        layer(x, deterministic=False)
    mha = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL,
                                             dropout_rate=0.1, attention_fn=make_attention_fn())
    params = mha.init(jax.random.key(0), x, deterministic=True)
    with pytest.raises(ValueError, match="dropout"):
        mha.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    with pytest.raises(ValueError, match="sow"):
        layer(x, sow_weights=True, deterministic=True)


def test_attention_fn_placement_of_queries_shorter_than_keys():
    q = _random((2, 3, HEADS, 8), 1)
    k, v = _random((2, 8, HEADS, 8), 2), _random((2, 8, HEADS, 8), 3)
    with pytest.raises(ValueError, match="ambiguous"):
        make_attention_fn(is_causal=True)(q, k, v)
    with pytest.raises(ValueError, match="window cannot be placed"):
        make_attention_fn(is_causal=True, local_window_size=2)(q[:, :1], k, v)
    # A 3-token prefill written at the start of an 8-slot cache, empty slots masked.
    written = (jnp.arange(8) < 3)[None, None, None, :]
    prefill = make_attention_fn(is_causal=True, causal_alignment="top_left")
    np.testing.assert_allclose(
        prefill(q, k, v, mask=written),
        jax.nn.dot_product_attention(q, k[:, :3], v[:, :3], is_causal=True),
        rtol=1e-5, atol=1e-5)
    # Keys concatenated as [past; new]: the queries are the last three.
    chunk = make_attention_fn(is_causal=True, causal_alignment="bottom_right")
    visible = jnp.arange(8)[None, :] <= jnp.arange(5, 8)[:, None]
    np.testing.assert_allclose(chunk(q, k, v),
                               jax.nn.dot_product_attention(q, k, v, mask=visible),
                               rtol=1e-5, atol=1e-5)


def test_decoding_past_the_cache_raises():
    layer = _layer(num_kv_heads=2)
    x = _inputs(seq=6)
    layer.init_cache(batch_size=2, max_length=5)
    layer(x[:, :4], decode=True)
    with pytest.raises(ValueError, match="cache index 4 runs past the cache's max_length 5"):
        layer(x[:, 4:6], decode=True)
    assert int(layer.cache_index[...]) == 4                       # nothing was written
    with pytest.raises(ValueError, match="larger max_length"):   # never fits
        nnx.jit(lambda layer, x: layer(x, decode=True))(layer, x)
    # Under jit the index is traced: the device checks it and the host raises.
    step = nnx.jit(lambda layer, token: layer(token, decode=True))
    step(layer, x[:, 4:5]).block_until_ready()                    # slot 4: the last one
    with pytest.raises(jax.errors.JaxRuntimeError, match="cache index 5 runs past"):
        step(layer, x[:, 5:6]).block_until_ready()


def test_check_cache_room_concrete_bounds():
    check_cache_room(jnp.array(3, jnp.int32), 2, 5)     # fills the cache exactly
    with pytest.raises(ValueError, match="cache index 4"):
        check_cache_room(4, 2, 5)
    # dynamic_update_slice would clamp a negative slot to 0: refused, eagerly and under jit.
    with pytest.raises(ValueError, match="index must be >= 0"):
        check_cache_room(-1, 1, 5)
    checked = jax.jit(lambda index: check_cache_room(index, 1, 5) or index)
    checked(jnp.int32(0)).block_until_ready()
    with pytest.raises(jax.errors.JaxRuntimeError, match="index must be >= 0"):
        checked(jnp.int32(-1)).block_until_ready()


_EXTRAS = ("flax", "optax", "orbax", "matplotlib", "tqdm")


def _run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter at the repository root (this checkout's package)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_core_package_imports_no_extra():
    done = _run_python(
        "import sys, pallas_flash, pallas_flash.tutorial.cli\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {_EXTRAS!r})\n"
        "assert not loaded, loaded\n")
    assert done.returncode == 0, done.stderr
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(re.match(r"[\w-]+", d).group() for d in core) == ["jax", "jaxlib", "numpy"]


def test_nn_without_flax_says_how_to_install_it():
    done = _run_python("import sys\nsys.modules['flax'] = None   # as if not installed\n"
                       "import pallas_flash.nn\n")
    assert done.returncode != 0
    assert "pallas_flash.nn needs flax" in done.stderr
    assert "pip install 'pallas-flash[flax]'" in done.stderr


def test_masked_attention_rows_that_see_nothing_give_zero():
    """A query row with no visible key outputs 0 with finite gradients, as
    pallas_flash.attention's empty rows do (it gave NaN); the other rows match the float64
    oracle's masked attention, with and without sinks."""
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (1, 4, 4, 8))
    k, v = (jax.random.normal(x, (1, 6, 2, 8)) for x in keys[1:3])
    visible = jnp.tril(jnp.ones((4, 6), bool), k=2).at[1].set(False)  # row 1 sees nothing
    for sinks in (None, jax.random.normal(keys[3], (4,))):
        grads = jax.grad(
            lambda q, k, v, s=sinks: (masked_attention(q, k, v, visible, sinks=s) ** 2).sum(),
            argnums=(0, 1, 2))(q, k, v)
        got = masked_attention(q, k, v, visible, sinks=sinks)
        assert np.all(np.asarray(got[:, 1]) == 0)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
        want = attention_float64(q, k, v, attn_mask=visible[None, None], sinks=sinks,
                                 mask=MaskSpec(4, 6))[0]
        rows = np.array([0, 2, 3])
        assert np.max(np.abs(np.asarray(got)[:, rows] - np.asarray(want)[:, rows])) < 1e-5
        assert np.max(np.abs(np.asarray(want)[:, 1])) == 0

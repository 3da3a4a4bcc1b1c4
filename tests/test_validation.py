"""Bad input to the public functions raises ValueError naming the argument: the cases an
audit of the public surface found accepted silently or failing deep inside (2026-12-02)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_flash as pf
from pallas_flash import fp8
from pallas_flash.nn import FlashSelfAttention, rotary_embedding
from pallas_flash.tutorial import fp8_study


def _normal(*shape):
    return jax.random.normal(jax.random.key(sum(shape)), shape, jnp.float32)


Q = _normal(1, 8, 2, 8)
IDS = jnp.zeros((1, 8), jnp.int32)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(key_value_seq_lengths=jnp.array([-1])), "key_value_seq_lengths must lie in"),
    (dict(key_value_seq_lengths=np.array([9])), "key_value_seq_lengths must lie in"),
    (dict(query_seq_lengths=jnp.array([-5])), "query_seq_lengths must lie in"),
    (dict(q_segment_ids=IDS, kv_segment_ids=jnp.full((1, 8), -2**31, jnp.int32)),
     "kv_segment_ids must lie in"),
    (dict(q_segment_ids=jnp.full((1, 8), 2**31, jnp.uint32), kv_segment_ids=IDS),
     "q_segment_ids must lie in"),
    (dict(local_window_size=True), "local_window_size"),
    (dict(local_window_size=(True, 0)), "local_window_size"),
    (dict(logits_soft_cap=True), "logits_soft_cap"),
    (dict(implementation=["xla"]), "implementation"),
])
def test_attention_rejects(kwargs, match):
    kwargs.setdefault("implementation", "xla")
    with pytest.raises(ValueError, match=match):
        pf.attention(Q, Q, Q, **kwargs)


@pytest.mark.parametrize("lengths", [
    np.array([2**32 + 3, 5]),  # int64: the int32 cast would make it 3, a valid length
    [5, 2**32 + 3], np.array([-1, 5]), np.array([5, 9]), jnp.array([9, 5]),
], ids=["int64-wraps", "list-wraps", "negative", "past-seq", "jax-past-seq"])
def test_lengths_are_range_checked_before_the_int32_cast(lengths):
    """The one check (pallas_flash.arguments.check_lengths) of attention, decode_attention
    and paged_attention, on the values as given (x64 off), against 8 keys."""
    q, kv = _normal(2, 1, 2, 8), _normal(2, 8, 2, 8)
    pages, table = _normal(2, 8, 2, 8), jnp.array([[0], [1]], jnp.int32)
    calls = [
        ("key_value_seq_lengths", lambda: pf.attention(
            q, kv, kv, key_value_seq_lengths=lengths, implementation="xla")),
        ("query_seq_lengths", lambda: pf.attention(
            kv, kv, kv, query_seq_lengths=lengths, implementation="xla")),
        ("key_value_seq_lengths", lambda: pf.decode_attention(
            q, kv, kv, key_value_seq_lengths=lengths, implementation="xla")),
        ("cache_lengths", lambda: pf.paged_attention(
            q, pages, pages, table, lengths, implementation="xla")),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"{name} must lie in \[0, 8\]"):
            call()


def test_scalar_lengths_are_range_checked_before_the_int32_cast():
    """A Python int for one sequence (attention's unbatched query, decode's scalar)."""
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 8\]"):
        pf.attention(Q[0], Q[0], Q[0], key_value_seq_lengths=2**32 + 3, implementation="xla")
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in \[0, 8\]"):
        pf.decode_attention(Q[:, :1], Q, Q, key_value_seq_lengths=2**32 + 3,
                            implementation="xla")


def test_attention_takes_lengths_at_the_ends_and_traced():
    for lengths in (jnp.array([0]), jnp.array([8])):
        out = pf.attention(Q, Q, Q, key_value_seq_lengths=lengths, implementation="xla")
        assert np.all(np.isfinite(np.asarray(out)))
    traced = jax.jit(lambda n: pf.attention(Q, Q, Q, key_value_seq_lengths=n,
                                            implementation="xla"))
    assert traced(jnp.array([3])).shape == Q.shape


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(seq_q=4, seq_kv=4, is_causal="no"), "is_causal"),
    (dict(seq_q=True, seq_kv=4), "seq_q"),
    (dict(seq_q=2.5, seq_kv=4), "seq_q"),
    (dict(seq_q="4", seq_kv=4), "seq_q"),
    (dict(seq_q=4, seq_kv=4, window=(1.5, 1)), "window"),
    (dict(seq_q=4, seq_kv=4, window=2), "window"),
    (dict(seq_q=4, seq_kv=4, q_start=-1), "q_start"),
])
def test_mask_spec_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pf.MaskSpec(**kwargs)


def test_mask_spec_takes_numpy_ints():
    spec = pf.MaskSpec(np.int64(4), 4, window=(np.int32(1), 2))
    assert type(spec.seq_q) is int and spec.window == (1, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(rope_base=0.0), "rope_base"),
    (dict(rope_base=float("nan")), "rope_base"),
    (dict(rope_base=True), "rope_base"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_kv_heads=-2), "num_kv_heads"),
    (dict(head_dim=8.0), "head_dim"),
    (dict(attention_fn=1), "attention_fn"),
    # Refused at construction, not at the first call.
    (dict(is_causal=1), "is_causal"),
    (dict(fused_qkv="yes"), "fused_qkv"),
    (dict(use_sinks=None), "use_sinks"),
    (dict(decode=0), "decode"),
    (dict(deterministic_backward=1), "deterministic_backward"),
    (dict(local_window_size=-3), "local_window_size"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(implementation="tpu"), "implementation"),
    (dict(interpret="yes"), "interpret"),
])
def test_flash_self_attention_rejects(kwargs, match):
    args = dict(d_model=16, num_heads=2, rngs=nnx.Rngs(0)) | kwargs
    with pytest.raises(ValueError, match=match):
        FlashSelfAttention(**args)


def test_flash_self_attention_call_and_cache_reject_bad_input():
    layer = FlashSelfAttention(16, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dtype"):
        layer.init_cache(1, 16, jnp.int32)
    with pytest.raises(ValueError, match="batch_size"):
        layer.init_cache(0, 16)
    with pytest.raises(ValueError, match="x must be"):
        layer(_normal(1, 8, 12))
    layer.init_cache(1, 16)
    with pytest.raises(ValueError, match="batch"):
        layer(_normal(2, 1, 16), decode=True)
    with pytest.raises(ValueError, match="decode"):
        layer(_normal(1, 1, 16), decode="no")
    with pytest.raises(ValueError, match="base"):
        rotary_embedding(Q, jnp.arange(8)[None], 0.0)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(Q, jnp.arange(8), 10_000.0)
    with pytest.raises(ValueError, match="positions must be integers"):
        rotary_embedding(Q, jnp.arange(8.0)[None], 10_000.0)
    x = _normal(1, 8, 16)
    with pytest.raises(ValueError, match="positions"):  # lax's broadcasting error before
        layer(x, positions=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(ValueError, match="positions must be integers"):
        layer(x, positions=jnp.arange(8.0)[None])


def test_zigzag_and_fp8_and_pages_reject_or_take():
    with pytest.raises(ValueError, match="num_shards"):
        pf.to_zigzag(Q, 2.0)
    with pytest.raises(ValueError, match="axis"):
        pf.from_zigzag(Q, 2, axis=True)
    x = _normal(1, 16, 2, 16)
    with pytest.raises(ValueError, match="config"):
        fp8.attention_fp8(x, x, x, config="fast", implementation="xla")
    with pytest.raises(ValueError, match="k must have no empty dimension"):
        fp8.attention_fp8(x, x[:, :, :0], x[:, :, :0], implementation="xla")
    with pytest.raises(ValueError, match="no empty dimension"):
        fp8.quantize(x[:0], 8)
    # NumPy page pools, which paged_attention reads, are written as well.
    pages = np.zeros((4, 8, 1, 4), np.float32)
    new = jnp.ones((1, 3, 1, 4))
    key_pages, _ = pf.write_pages(pages, pages, jnp.array([[2, 1]], jnp.int32),
                                  jnp.array([0]), new, new)
    np.testing.assert_array_equal(np.asarray(key_pages)[2, :3], 1.0)
    assert not np.any(np.asarray(key_pages)[[0, 1, 3]])


def test_attention_fn_rejects_bad_input():
    from pallas_flash.nn import make_attention_fn

    fn = make_attention_fn(implementation="xla")
    with pytest.raises(ValueError, match="query must be"):
        fn(Q[0, 0], Q, Q)
    with pytest.raises(ValueError, match="batch dims"):
        fn(Q, _normal(2, 8, 2, 8), _normal(2, 8, 2, 8))
    with pytest.raises(ValueError, match="dropout_rate"):
        fn(Q, Q, Q, dropout_rate=-1.0)
    with pytest.raises(ValueError, match="is_causal"):
        fn(Q, Q, Q, is_causal="y")
    assert fn(Q, Q, Q, dropout_rate=0.5, deterministic=True).shape == Q.shape


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(backward="y"), "backward"), (dict(cache="y"), "cache"), (dict(iters=True), "iters"),
    (dict(timer=1), "timer"), (dict(candidates=5), "candidates"),
])
def test_autotune_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pf.autotune(Q, Q, Q, implementation="xla", **kwargs)


def test_autotune_and_decode_reject_empty_or_unhashable_input():
    with pytest.raises(ValueError, match=r"candidates .* must be"):  # a TypeError before
        pf.autotune(Q, Q, Q, implementation="xla", candidates=[{}])
    empty = jnp.zeros((1, 0, 2, 8))
    with pytest.raises(ValueError, match="non-empty sequences"):
        pf.autotune(Q, empty, empty, implementation="xla")
    for q, kv in ((Q[:, :1], empty), (empty, Q)):
        with pytest.raises(ValueError, match="at least one new token"):
            pf.decode_attention(q, kv, kv, implementation="xla")
    pages = jnp.ones((4, 16, 2, 8))
    with pytest.raises(ValueError, match="at least one new token"):
        pf.paged_attention(empty, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.array([3]))


def test_fp8_references_and_scales_reject_bad_input():
    x = _normal(1, 16, 2, 16)
    with pytest.raises(ValueError, match="batch"):
        fp8_study.attention_fp8_reference(x, _normal(2, 16, 2, 16), _normal(2, 16, 2, 16))
    with pytest.raises(ValueError, match="is_causal"):
        fp8_study.attention_fp8_reference(_normal(1, 32, 2, 16), x, x, is_causal=True)
    out, lse = fp8_study.attention_fp8_reference(x, x, x, block_q=8, block_kv=8,
                                           return_residual=True)
    backward = functools.partial(fp8_study.attention_fp8_backward_reference, block_q=8, block_kv=8)
    for kwargs, match in ((dict(scale=-1.0), "scale"), (dict(is_causal="y"), "is_causal"),
                          (dict(fp8_gemms=None), "fp8_gemms")):
        with pytest.raises(ValueError, match=match):
            backward(x, x, x, out, lse, x, **kwargs)
    with pytest.raises(ValueError, match="lse"):
        backward(x, x, x, out, lse[..., :1], x)
    with pytest.raises(ValueError, match="out must have"):
        backward(x, x, x, out[..., :1], lse, x)
    with pytest.raises(ValueError, match="heads"):
        backward(x, x[:, :, :1], x[:, :, :1], out, lse, x)
    x8, scales = fp8.quantize(x, 8)
    with pytest.raises(ValueError, match="scales must be"):
        fp8.dequantize(x8, scales, 16)
    with pytest.raises(ValueError, match="q_scale"):
        fp8.attention_fp8_quantized(x8, x8, x8, jnp.array(-1.0), scales, scales,
                                    implementation="xla")
    with pytest.raises(ValueError, match="out_scale"):
        fp8.attention_fp8(x, x, x, out_scale=float("inf"), implementation="xla")
    with pytest.raises(ValueError, match="head_dim"):
        fp8.random_hadamard(jax.random.key(0), 2**20)


def test_nn_helpers_reject_bad_input():
    from pallas_flash.nn import check_cache_room, masked_attention

    visible = jnp.ones((8, 8), bool)
    with pytest.raises(ValueError, match="heads"):
        masked_attention(_normal(1, 8, 3, 8), Q, Q, visible)
    with pytest.raises(ValueError, match="sinks"):
        masked_attention(Q, Q, Q, visible, sinks=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="logits_soft_cap"):
        masked_attention(Q, Q, Q, visible, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="visible"):
        masked_attention(Q, Q, Q, visible[:4])
    with pytest.raises(ValueError, match="max_length"):
        check_cache_room(0, 1, -4)
    with pytest.raises(ValueError, match="new_tokens"):
        check_cache_room(0, -5, 4)
    with pytest.raises(ValueError, match="index"):
        check_cache_room("a", 1, 4)
    check_cache_room(jnp.array(3), 1, 4)


def test_paged_attention_names_the_pages_in_mismatches():
    pages = jnp.zeros((4, 8, 1, 8))
    table, lengths = jnp.array([[0, 1]], jnp.int32), jnp.array([4])
    for query, match in ((_normal(1, 1, 2, 4), "key_pages' .8."),
                         (_normal(1, 1, 2, 8).astype(jnp.bfloat16), "key_pages / value_pages")):
        with pytest.raises(ValueError, match=match):
            pf.paged_attention(query, pages, pages, table, lengths, implementation="xla")


def test_bad_implementation_names_and_flags():
    with pytest.raises(ValueError, match=r"one of \['mosaic', 'triton', 'xla', 'cudnn'\]"):
        pf.attention(Q, Q, Q, implementation="flash")
    pages = jnp.ones((4, 16, 2, 8))
    with pytest.raises(ValueError, match="return_lse must be a bool"):
        pf.paged_attention(Q[:, :1], pages, pages, jnp.zeros((1, 2), jnp.int32),
                           jnp.array([3]), return_lse="yes", implementation="triton",
                           interpret=True)


def test_scalars_and_numpy_ints_are_taken_as_jax_nn_takes_them():
    """``mask=True``, ``bias=0.5`` (Python scalars) and NumPy ints in ``local_window_size``
    give jax.nn's result (they were refused: "got dtype None", "local_window_size")."""
    q, k, v = (_normal(1, 8, 2, 8) * s for s in (1.0, 0.9, 1.1))
    cases = [dict(mask=True), dict(bias=0.5), dict(local_window_size=(np.int64(2), 1))]
    for kwargs in cases:
        want = jax.nn.dot_product_attention(q, k, v, **kwargs)
        got = pf.attention(q, k, v, implementation="xla", **kwargs)
        assert np.max(np.abs(np.asarray(got) - np.asarray(want))) < 1e-5, kwargs
    # One NumPy int for both sides (jax.nn takes only a pair), as a Python int is taken.
    want = jax.nn.dot_product_attention(q, k, v, local_window_size=(3, 3))
    got = pf.attention(q, k, v, implementation="xla", local_window_size=np.int32(3))
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) < 1e-5


def test_kv_segment_ids_alone_are_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="kv_segment_ids needs q_segment_ids"):
        pf.attention(Q, Q, Q, kv_segment_ids=IDS, implementation="xla")


def test_mosaic_interpret_refuses_a_thread_pool_that_would_hang(monkeypatch):
    """The interpreter's warpgroup threads block in host callbacks on the CPU client's pool:
    with fewer pool threads than warpgroups the call hung (seen: attention_fp8 at head_dim
    64, 4 warpgroups, on 2 cores); it is refused by name instead."""
    from pallas_flash.mosaic.interpret import interpret_params
    monkeypatch.setenv("PJRT_NPROC", "2")
    with pytest.raises(ValueError, match="PJRT_NPROC=8"):
        interpret_params(True, 3)
    assert interpret_params(True, 2) is not None
    assert interpret_params(False, 99) is None
    with pytest.raises(ValueError, match=r"3 warpgroups .*\(PJRT_NPROC=2\)"):
        x = _normal(1, 64, 2, 64).astype(jnp.bfloat16)
        pf.attention(x, x, x, implementation="mosaic", interpret=True)

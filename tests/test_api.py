"""Bad input gets a ValueError that names the argument."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import pallas_flash as pf


def _qkv(q_shape=(1, 16, 4, 32), kv_shape=(1, 16, 2, 32), dtype=jnp.float32):
    q = jnp.ones(q_shape, dtype)
    k = jnp.ones(kv_shape, dtype)
    return q, k, k


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(q=jnp.ones((16, 4, 32))), "query must have rank 4"),
        (dict(k=jnp.ones((1, 16, 2, 2, 32))), "key must have rank 4"),
        (dict(v=jnp.ones((1, 16, 2, 16))), "key and value must have the same shape"),
        (dict(k=jnp.ones((2, 16, 2, 32)), v=jnp.ones((2, 16, 2, 32))), "batch size"),
        (dict(k=jnp.ones((1, 16, 2, 16)), v=jnp.ones((1, 16, 2, 16))), "head_dim"),
        (dict(k=jnp.ones((1, 16, 3, 32)), v=jnp.ones((1, 16, 3, 32))), "multiple of key/value"),
        (dict(q=jnp.ones((1, 16, 4, 32), jnp.bfloat16)), "share one dtype"),
        (dict(q=jnp.ones((1, 16, 4, 32), jnp.int32)), "query dtype"),
        (dict(q=jnp.ones((1, 16, 4, 512)), k=jnp.ones((1, 16, 2, 512)),
              v=jnp.ones((1, 16, 2, 512))), "head_dim must be in"),
        (dict(scale=0.0), "scale must be a positive"),
        (dict(scale=-1.0), "scale must be a positive"),
        (dict(scale=float("nan")), "scale must be a positive"),
        (dict(local_window_size=-1), "local_window_size"),
        (dict(local_window_size=(1, 2, 3)), "local_window_size"),
        (dict(causal_alignment="center"), "causal_alignment"),
        (dict(is_causal="yes"), "is_causal"),
        (dict(implementation="cuda"), "implementation must be one of"),
        (dict(q_segment_ids=jnp.zeros((1, 15), jnp.int32)), "q_segment_ids must have shape"),
        (dict(q_segment_ids=jnp.zeros((1, 16), jnp.float32)), "integer dtype"),
        (dict(q_segment_ids=jnp.zeros((1, 16), jnp.int32),
              kv_segment_ids=jnp.zeros((2, 16), jnp.int32)), "kv_segment_ids must have shape"),
        (dict(query_seq_lengths=jnp.array([3, 4])), "query_seq_lengths must have shape"),
        (dict(key_value_seq_lengths=jnp.array([3.0])), "key_value_seq_lengths must have an int"),
        (dict(logits_soft_cap=0.0), "logits_soft_cap must be a positive"),
        (dict(logits_soft_cap=-5), "logits_soft_cap must be a positive"),
        (dict(sinks=jnp.zeros(3)), "sinks must have shape"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks must have a floating"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    q, k, v = _qkv()
    q, k, v = kwargs.pop("q", q), kwargs.pop("k", k), kwargs.pop("v", v)
    with pytest.raises(ValueError, match=match):
        pf.attention(q, k, v, **kwargs)


def test_segment_ids_required_together_when_lengths_differ():
    q, k, v = _qkv(kv_shape=(1, 8, 2, 32))
    with pytest.raises(ValueError, match="given together"):
        pf.attention(q, k, v, q_segment_ids=jnp.zeros((1, 16), jnp.int32))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = (x * jnp.arange(16.0)[None, :, None, None] / 16 for x in _qkv())
    assert jnp.allclose(pf.attention(q, k, v), pf.attention(q, k, v, scale=32 ** -0.5))
    assert not jnp.allclose(pf.attention(q, k, v), pf.attention(q, k, v, scale=1.0))


@pytest.mark.parametrize(("head_dim", "features", "chosen"), [
    (64, dict(has_segments=True, softcap=30.0, has_bias=False, has_mask=False), "mosaic"),
    (128, dict(has_segments=False, softcap=None, has_bias=True, has_mask=False), "mosaic"),
    (192, dict(has_segments=False, softcap=None, has_bias=False, has_mask=True), "mosaic"),
    # Above head_dim 192 the Mosaic forward has no shared memory left for a bias tile.
    (256, dict(has_segments=False, softcap=None, has_bias=True, has_mask=True), "triton"),
    (256, dict(has_segments=True, softcap=None, has_bias=False, has_mask=False), "mosaic"),
])
def test_automatic_choice_on_hopper(monkeypatch, head_dim, features, chosen):
    """On a Hopper GPU ``implementation=None`` picks Mosaic for every call its kernels
    support, and Triton for the rest."""
    from pallas_flash import api
    from pallas_flash.masking import MaskSpec

    monkeypatch.setattr(api, "available_implementations", lambda: ("mosaic", "triton", "xla"))
    q = jnp.zeros((1, 256, 4, head_dim), jnp.bfloat16)
    spec = MaskSpec(seq_q=256, seq_kv=256, is_causal=True)
    assert api._choose(q, q, spec, features, interpret=False) == chosen

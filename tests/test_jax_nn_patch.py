"""``jax.nn.dot_product_attention = pallas_flash.attention``: a process-wide patch (how some
programs adopt a drop-in) must not make pallas_flash call itself."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from support import random_qkv, rel_err, tolerance

import pallas_flash as pf


def test_cudnn_under_the_patch_reaches_jax_nn(monkeypatch):
    """``implementation="cudnn"`` hands the call to jax.nn's own function: on this CPU it
    raises jax.nn's error (no cuDNN), message included, not RecursionError."""
    q, k, v, _ = random_qkv(1, 16, 16, 2, 2, 16, jnp.bfloat16)
    with pytest.raises(Exception) as want:
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert want.type is not RecursionError
    monkeypatch.setattr(jax.nn, "dot_product_attention", pf.attention)
    with pytest.raises(want.type, match=re.escape(str(want.value))):
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def test_xla_under_the_patch_matches_jax_nn(monkeypatch):
    q, k, v, _ = random_qkv(2, 24, 32, 4, 2, 16)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    monkeypatch.setattr(jax.nn, "dot_product_attention", pf.attention)
    got = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < tolerance(q.dtype)

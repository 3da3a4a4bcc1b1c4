"""pallas_flash.integrations.maxtext against MaxText's own attention (maxtext 0.2.5, tiny
random Gemma-2-style model: sliding and global layers, soft-capping, grouped-query
attention; float32): logits and gradients on packed sequences, a training step, and the
tokens of prefill + greedy decoding."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

maxtext = pytest.importorskip("maxtext")

from flax import nnx  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers import attention_op  # noqa: E402
from maxtext.models import models  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

from pallas_flash.integrations import maxtext as pf_maxtext  # noqa: E402

_PREFILL = 8


@pytest.fixture(scope="module")
def config():
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    overrides = dict(
        run_name="pallas_flash", enable_checkpointing=False, skip_jax_distributed_system=True,
        decoder_block="gemma2", base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2,
        head_dim=16, base_mlp_dim=64, base_num_decoder_layers=1, vocab_size=64,
        mlp_activations="['gelu','linear']", logits_via_embedding=True,
        sliding_window_size=3, attn_logits_soft_cap=50.0, final_logits_soft_cap=30.0,
        max_target_length=16, max_prefill_predict_length=_PREFILL, per_device_batch_size=2,
        dtype="float32", weight_dtype="float32", matmul_precision="highest",
        attention="dot_product", scan_layers=False)
    return pyconfig.initialize(["", base, *(f"{k}={v}" for k, v in overrides.items())])


def _build(config, mode, flash):
    mesh = maxtext_utils.get_mesh_from_config(config)
    if not flash:
        return models.Transformer(config, mesh, None, model_mode=mode, rngs=nnx.Rngs(0))
    with pf_maxtext.use_flash_attention():
        model = models.Transformer(config, mesh, None, model_mode=mode, rngs=nnx.Rngs(0))
    ops = [op for _, op in nnx.iter_graph(model) if isinstance(op, attention_op.AttentionOp)]
    assert ops and all(isinstance(op, pf_maxtext.FlashAttentionOp) for op in ops)
    return model


@pytest.fixture()
def spy(monkeypatch):
    """The adapter's kernel calls (at trace time), with their structured arguments."""
    calls = []
    original = pf_maxtext.attention

    def counting(*args, **kwargs):
        calls.append((kwargs["is_causal"], kwargs["local_window_size"],
                      kwargs["q_segment_ids"] is not None))
        return original(*args, **kwargs)

    monkeypatch.setattr(pf_maxtext, "attention", counting)
    return calls


def _batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 1, 64)
    # Two packed documents in the first sequence, one in the second.
    segments = jnp.array([[1] * 10 + [2] * 6, [1] * 16])
    positions = jnp.arange(16) - jnp.where(segments == 2, 10, 0)
    return tokens, positions, segments


def _loss(model, tokens, positions, segments):
    logits = model(tokens, positions, decoder_segment_ids=segments, enable_dropout=False)
    same = segments[:, 1:] == segments[:, :-1]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(losses * same) / jnp.sum(same)


def test_logits_and_gradients(config, spy):
    tokens, positions, segments = _batch()
    reference, ours = _build(config, "train", False), _build(config, "train", True)
    want = reference(tokens, positions, decoder_segment_ids=segments, enable_dropout=False)
    got = ours(tokens, positions, decoder_segment_ids=segments, enable_dropout=False)
    # The local layer, then the global one: causal, packed documents as segment ids.
    assert spy == [(True, (2, 0), True), (True, None, True)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    want_grads = nnx.grad(_loss)(reference, tokens, positions, segments)
    got_grads = nnx.grad(_loss)(ours, tokens, positions, segments)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_training_step(config):
    batch = _batch()

    def step(model):
        grads = nnx.grad(_loss)(model, *batch)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return _loss(model, *batch)

    reference = _build(config, "train", False)
    before = _loss(reference, *batch)
    want = step(reference)
    got = step(_build(config, "train", True))
    assert want < before
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _generate(model, prompt, steps):
    """Prefill, then greedy autoregressive steps: the tokens and each step's logits."""
    positions = jnp.broadcast_to(jnp.arange(_PREFILL), prompt.shape)
    logits = model(prompt, positions, decoder_segment_ids=jnp.ones_like(prompt),
                   model_mode="prefill", enable_dropout=False)[:, -1]
    tokens, all_logits = [], []
    for step in range(steps):
        token = jnp.argmax(logits, axis=-1)
        tokens.append(token)
        all_logits.append(logits)
        logits = model(token[:, None], jnp.full((prompt.shape[0], 1), _PREFILL + step),
                       model_mode="autoregressive", enable_dropout=False)[:, -1]
    return np.stack(tokens, 1), np.stack(all_logits, 1)


def test_prefill_and_decode_tokens(config, spy):
    prompt = jax.random.randint(jax.random.key(3), (2, _PREFILL), 1, 64)
    want_tokens, want_logits = _generate(_build(config, "prefill", False), prompt, 6)
    got_tokens, got_logits = _generate(_build(config, "prefill", True), prompt, 6)
    # Decoding: the prefill cache and the new tokens' cache, merged through the lse, with
    # the active slots as segment ids and no causal mask.
    assert (False, (2, 0), True) in spy and (False, None, True) in spy
    np.testing.assert_array_equal(got_tokens, want_tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("mode", ["train", "autoregressive"])
def test_attention_op_contract(config, mode, with_sinks):
    """Each layer's op against MaxText's own on the same call: the normalized output and
    lse in the place of MaxText's (unnormalized output, max, sum)."""
    model = _build(config, "train", True)
    ops = [op for _, op in nnx.iter_graph(model) if isinstance(op, pf_maxtext.FlashAttentionOp)]
    assert {op.attention_type.value for op in ops} == {"global", "local_sliding"}
    keys = jax.random.split(jax.random.key(5), 4)
    seq_q = 1 if mode == "autoregressive" else 16
    q = jax.random.normal(keys[0], (2, seq_q, 4, 16))
    k, v = jax.random.normal(keys[1], (2, 2, 16, 2, 16))
    if mode == "autoregressive":
        segments = (jax.random.uniform(keys[2], (2, 16)) < 0.6).astype(jnp.int32).at[:, -1].set(1)
        seen = np.ones((2, 1), bool)
    else:
        # Two documents and keys MaxText hides (negative ids); rows of those see no key.
        segments = jnp.array([[1] * 6 + [-1] * 2 + [2] * 8, [3] * 16])
        seen = np.asarray(segments >= 0)
    sinks = jax.random.normal(keys[3], (4,)) if with_sinks else None
    for op in ops:
        call = dict(query=q, key=k, value=v, decoder_segment_ids=segments,
                    segment_positions=None, lengths=None, model_mode=mode, sinks=sinks,
                    qk_product_einsum=jnp.einsum, wv_product_einsum=jnp.einsum)
        out, lse, ones = op.apply_attention(**call)
        unnormalized, maximum, total = attention_op.AttentionOp.apply_attention(op, **call)
        np.testing.assert_array_equal(ones, 1)
        np.testing.assert_allclose(out[seen], (unnormalized / total)[seen], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse[seen], (maximum + jnp.log(total))[seen], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("option", ["record_max_logits", "bidirectional_mask"])
def test_unsupported_call_falls_back_with_warning(config, option):
    model = _build(config, "train", True)
    op = next(op for _, op in nnx.iter_graph(model)
              if isinstance(op, pf_maxtext.FlashAttentionOp))
    q, k, v = jax.random.normal(jax.random.key(4), (3, 2, 16, 4, 16))
    k, v = k[:, :, :2], v[:, :, :2]
    call = dict(query=q, key=k, value=v, decoder_segment_ids=None, segment_positions=None,
                lengths=None, model_mode="train", qk_product_einsum=jnp.einsum,
                wv_product_einsum=jnp.einsum)
    call[option] = (True if option == "record_max_logits"
                    else jnp.broadcast_to(jnp.arange(16) % 5 == 1, (2, 16)))
    with pytest.warns(UserWarning, match="record_max_logits|bidirectional"):
        got = op.apply_attention(**call)
    want = attention_op.AttentionOp.apply_attention(op, **call)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_import_pallas_flash_imports_no_library():
    code = ("import sys, pallas_flash, pallas_flash.nn; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('gemma', 'maxtext', 'keras', 'equinox') or m.startswith('pallas_flash.integ')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.stdout.strip() == "[]"

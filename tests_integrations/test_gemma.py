"""pallas_flash.integrations.gemma against Gemma's own attention (gemma 4.0.1, tiny random
model, float32): logits, gradients, a training step and the sampler's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

gm = pytest.importorskip("gemma.gm")

from pallas_flash.integrations import gemma as pf_gemma  # noqa: E402

_CONFIG = gm.nn.config.TransformerConfig(
    num_embed=13,  # gm.testing.DummyTokenizer's vocabulary
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention
    head_dim=16,
    final_logit_softcap=30.0,
    attention_types=(gm.nn.config.AttentionType.LOCAL_SLIDING,
                     gm.nn.config.AttentionType.GLOBAL),
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    attn_logits_soft_cap=50.0,
    sliding_window_size=3,
    use_qk_norm=True,
)


class _Model(gm.nn.Transformer):
    config: gm.nn.config.TransformerConfig = _CONFIG


@pytest.fixture(scope="module")
def params():
    tokens = jnp.ones((1, 8), jnp.int32)
    params = _Model(dtype=jnp.float32).init(jax.random.key(0), tokens)["params"]
    # Random RMSNorm scales and a larger embedding, so attention is far from uniform.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [leaf + 0.5 * jax.random.normal(k, leaf.shape)
                                     for leaf, k in zip(leaves, keys, strict=True)])


@pytest.fixture()
def spy(monkeypatch):
    """Counts the adapter's kernel calls (at trace time) with their structured arguments."""
    calls = []
    original = pf_gemma.attention

    def counting(*args, **kwargs):
        calls.append((kwargs["is_causal"], kwargs["local_window_size"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(pf_gemma, "attention", counting)
    return calls


def _tokens():
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 3, 13)
    return tokens.at[1, 9:].set(0)  # padding at the end of the second sequence


def _loss(model, params, tokens):
    logits = model.apply({"params": params}, tokens).logits
    targets = tokens[:, 1:]
    weights = ((targets != 0) & (tokens[:, :-1] != 0)).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def _real(tokens, x):
    """The entries of real (not padding) tokens."""
    return np.asarray(x)[np.asarray(tokens) != 0]


@pytest.mark.parametrize("assume_causal", [False, True])
def test_logits_and_gradients(params, spy, assume_causal):
    tokens = _tokens()
    reference = _Model(dtype=jnp.float32)
    want = reference.apply({"params": params}, tokens).logits
    want_grads = jax.grad(_loss, argnums=1)(reference, params, tokens)
    model = pf_gemma.flash_model(_Model, assume_causal=assume_causal)(dtype=jnp.float32)
    got = model.apply({"params": params}, tokens).logits
    got_grads = jax.grad(_loss, argnums=1)(model, params, tokens)
    window = (_CONFIG.sliding_window_size - 1, 0) if assume_causal else None
    assert spy[:2] == [(assume_causal, window), (assume_causal, None)]
    np.testing.assert_allclose(_real(tokens, got), _real(tokens, want), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_training_step(params):
    tokens = _tokens()
    optimizer = optax.adam(1e-2)

    def step(model):
        grads = jax.grad(_loss, argnums=1)(model, params, tokens)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return _loss(model, optax.apply_updates(params, updates), tokens)

    want = step(_Model(dtype=jnp.float32))
    got = step(pf_gemma.flash_model(_Model, assume_causal=True)(dtype=jnp.float32))
    assert want < _loss(_Model(dtype=jnp.float32), params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_sampler_tokens(params, spy):
    def sample(model):
        sampler = gm.text.Sampler(model=model, params=params, tokenizer=gm.testing.DummyTokenizer(),
                                  cache_length=32, max_out_length=8, pad_length=None)
        out = sampler.sample(["hello world", "My name is Morgane"], max_new_tokens=8,
                             return_state=True)
        return np.asarray(out.tokens), out.state.cache

    want_tokens, want_cache = sample(_Model(dtype=jnp.float32))
    got_tokens, got_cache = sample(
        pf_gemma.flash_model(_Model, assume_causal=True)(dtype=jnp.float32))
    assert spy, "the sampler did not run the adapter"
    assert all(not causal for causal, _ in spy)  # with a cache: the dense mask only
    assert len(set(want_tokens.ravel().tolist())) > 1
    np.testing.assert_array_equal(got_tokens, want_tokens)
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_row_without_keys_is_mean_of_values(params):
    """A fully masked row: Gemma's softmax gives the mean of the values; so does the adapter."""
    tokens = _tokens()
    mask = jnp.tril(jnp.ones((2, 12, 12), bool)).at[0, 4].set(False)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    kwargs = dict(positions=positions, attention_mask=mask)
    want = _Model(dtype=jnp.float32).apply({"params": params}, tokens, **kwargs).logits
    model = pf_gemma.flash_model(_Model)(dtype=jnp.float32)
    got = model.apply({"params": params}, tokens, **kwargs).logits
    np.testing.assert_allclose(_real(tokens, got), _real(tokens, want), rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="assume_causal"):
        pf_gemma.flash_model(_Model, assume_causal=1)
    with pytest.raises(ValueError, match="model_class"):
        pf_gemma.flash_model(gm.nn.config.TransformerConfig)

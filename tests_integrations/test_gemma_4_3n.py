"""pallas_flash.integrations.gemma on Gemma 4 and Gemma 3n (gemma 4.0.1, tiny random models,
float32): logits, gradients and the sampler's tokens against their own attention. Both have
sliding and global layers and later layers that share the KV of earlier ones; Gemma 4 also a
global key size and KV heads of its own and K = V projections on its global layers, Gemma
3n qk-norm and value norm with AltUp and LAuReL around them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gm = pytest.importorskip("gemma.gm")

from gemma.gm.nn.gemma3n import _config as _config3n  # noqa: E402
from gemma.gm.nn.gemma3n import _modules as _modules3n  # noqa: E402
from gemma.gm.nn.gemma3n import _transformer as _transformer3n  # noqa: E402
from gemma.gm.nn.gemma4 import _config as _config4  # noqa: E402
from gemma.gm.nn.gemma4 import _modules as _modules4  # noqa: E402
from gemma.gm.nn.gemma4 import _transformer as _transformer4  # noqa: E402

from pallas_flash.integrations import gemma as pf_gemma  # noqa: E402

_LOCAL4, _GLOBAL4 = _modules4.AttentionType.LOCAL_SLIDING, _modules4.AttentionType.GLOBAL
_LOCAL3N, _GLOBAL3N = _modules3n.AttentionType.LOCAL_SLIDING, _modules3n.AttentionType.GLOBAL
_CONFIG4 = _config4.TransformerConfig(
    num_embed=13,  # gm.testing.DummyTokenizer's vocabulary
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,  # grouped-query attention on the sliding layers
    num_global_kv_heads=1,  # multi-query on the global ones
    global_key_size=32,
    k_eq_v_global=True,
    global_rope_proportion=0.25,
    local_rope_proportion=1.0,
    final_logit_softcap=30.0,
    attention_types=(_LOCAL4, _GLOBAL4, _LOCAL4, _GLOBAL4),
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    sliding_window_size=3,
    # Layers 2 and 3 use the KV of layers 0 and 1.
    kv_cache_sharing_config=_config4.KVCacheSharingConfig(
        frac_shared_layers=0.5, share_global=True, share_local=True),
)


_CONFIG3N = _config3n.TransformerConfig(
    num_embed=13,  # gm.testing.DummyTokenizer's vocabulary
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,  # grouped-query attention
    final_logit_softcap=30.0,
    attention_types=(_LOCAL3N, _GLOBAL3N, _LOCAL3N, _GLOBAL3N),
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    # The query scaled by 1/sqrt(head_dim) (the released models scale it by nothing).
    query_pre_attn_norm=_config3n.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
    sliding_window_size=3,
    use_qk_norm=True,
    use_value_norm=True,
    use_altup=True,
    altup_coef_clip=120.0,
    per_layer_input_dim=8,
    use_laurel=True,
    laurel_rank=4,
    # Layers 2 and 3 use the KV of layers 0 and 1.
    kv_cache_sharing_config=_config3n.KVCacheSharingConfig(
        frac_shared_layers=0.5, share_global=True, share_local=True),
    scale_plus_one=False,
    guard_against_excess_precision=True,
)


class _Gemma4(_transformer4.Transformer):
    config: _config4.TransformerConfig = _CONFIG4


class _Gemma3n(_transformer3n.Gemma3nTransformer):
    config: _config3n.TransformerConfig = _CONFIG3N


def _first_calls(model_class: type, assume_causal: bool) -> list[tuple]:
    """The adapter's first four kernel calls, one per layer: (scale, is_causal, window,
    kv heads)."""
    window = (2, 0) if assume_causal else None  # sliding_window_size 3
    if model_class is _Gemma4:  # no query scaling; the global layers have one KV head
        return [(1.0, assume_causal, window, 2), (1.0, assume_causal, None, 1)] * 2
    scale = _CONFIG3N.query_pre_attn_scalar()
    return [(scale, assume_causal, window, 2), (scale, assume_causal, None, 2)] * 2


@pytest.fixture(scope="module", params=[_Gemma4, _Gemma3n], ids=["gemma4", "gemma3n"])
def model_class(request):
    return request.param


@pytest.fixture(scope="module")
def params(model_class):
    tokens = jnp.ones((1, 8), jnp.int32)
    params = model_class(dtype=jnp.float32).init(jax.random.key(0), tokens)["params"]
    # Random norm scales and a larger embedding, so attention is far from uniform.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [leaf + 0.5 * jax.random.normal(k, leaf.shape)
                                     for leaf, k in zip(leaves, keys, strict=True)])


@pytest.fixture()
def spy(monkeypatch):
    """The adapter's kernel calls (at trace time): scale, is_causal, window, kv heads."""
    calls = []
    original = pf_gemma.attention

    def counting(query, key, value, **kwargs):
        calls.append((kwargs["scale"], kwargs["is_causal"], kwargs["local_window_size"],
                      key.shape[2]))
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(pf_gemma, "attention", counting)
    return calls


def _tokens():
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 3, 13)
    return tokens.at[1, 9:].set(0)  # padding at the end of the second sequence


def _loss(model, params, tokens):
    logits = model.apply({"params": params}, tokens).logits
    targets = tokens[:, 1:]
    weights = ((targets != 0) & (tokens[:, :-1] != 0)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1])
    losses = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(losses * weights) / jnp.sum(weights)


def _real(tokens, x):
    """The entries of real (not padding) tokens."""
    return np.asarray(x)[np.asarray(tokens) != 0]


@pytest.mark.parametrize("assume_causal", [False, True])
def test_logits_and_gradients(model_class, params, spy, assume_causal):
    tokens = _tokens()
    reference = model_class(dtype=jnp.float32)
    want = reference.apply({"params": params}, tokens).logits
    want_grads = jax.grad(_loss, argnums=1)(reference, params, tokens)
    model = pf_gemma.flash_model(model_class, assume_causal=assume_causal)(dtype=jnp.float32)
    got = model.apply({"params": params}, tokens).logits
    got_grads = jax.grad(_loss, argnums=1)(model, params, tokens)
    assert spy[:4] == _first_calls(model_class, assume_causal)
    np.testing.assert_allclose(_real(tokens, got), _real(tokens, want), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_sampler_tokens(model_class, params, spy):
    def sample(model):
        sampler = gm.text.Sampler(model=model, params=params, tokenizer=gm.testing.DummyTokenizer(),
                                  cache_length=32, max_out_length=8, pad_length=None)
        out = sampler.sample(["hello world", "My name is Morgane"], max_new_tokens=8,
                             return_state=True)
        return np.asarray(out.tokens), out.state.cache

    want_tokens, want_cache = sample(model_class(dtype=jnp.float32))
    got_tokens, got_cache = sample(
        pf_gemma.flash_model(model_class, assume_causal=True)(dtype=jnp.float32))
    assert spy, "the sampler did not run the adapter"
    assert all(not causal for _, causal, _, _ in spy)  # with a cache: the dense mask only
    assert len(set(want_tokens.ravel().tolist())) > 1
    np.testing.assert_array_equal(got_tokens, want_tokens)
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_row_without_keys_is_mean_of_values(model_class, params):
    """A fully masked row: Gemma's softmax gives the mean of the values; so does the adapter."""
    tokens = _tokens()
    mask = jnp.tril(jnp.ones((2, 12, 12), bool)).at[0, 4].set(False)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    kwargs = dict(positions=positions, attention_mask=mask)
    want = model_class(dtype=jnp.float32).apply({"params": params}, tokens, **kwargs).logits
    model = pf_gemma.flash_model(model_class)(dtype=jnp.float32)
    got = model.apply({"params": params}, tokens, **kwargs).logits
    np.testing.assert_allclose(_real(tokens, got), _real(tokens, want), rtol=1e-5, atol=1e-5)


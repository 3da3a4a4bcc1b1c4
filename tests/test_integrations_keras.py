"""pallas_flash.integrations.keras against Keras's own attention: the backend function,
keras.layers.MultiHeadAttention, and a tiny random KerasHub Llama (forward, a training step,
greedy generation), float32 on the CPU."""

from __future__ import annotations

import os

import pytest

# Keras picks its backend once, at import.
os.environ["KERAS_BACKEND"] = "jax"
keras = pytest.importorskip("keras")  # the test extra installs it: this runs in `make test`
keras_hub = pytest.importorskip("keras_hub")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_flash.integrations import checks  # noqa: E402
from pallas_flash.integrations import keras as pf_keras  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture
def spy(monkeypatch):
    """Installs the adapter for the test; records ``(is_causal, local_window_size)`` of each
    pallas_flash.attention call it makes."""
    calls: list[tuple[bool, tuple[int, int] | None]] = []
    original = pf_keras.attention

    def recording(*args, **kwargs):
        calls.append((kwargs["is_causal"], kwargs["local_window_size"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(pf_keras, "attention", recording)
    pf_keras.install()
    yield calls
    pf_keras.uninstall()


def _inputs(seq_q=16, seq_kv=16, heads=4, kv_heads=2, head_dim=8):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(keys[0], (2, seq_q, heads, head_dim)),
            jax.random.normal(keys[1], (2, seq_kv, kv_heads, head_dim)),
            jax.random.normal(keys[2], (2, seq_kv, kv_heads, head_dim)))


def _padding_mask(seq_q, seq_kv, dtype):
    lengths = jnp.array([seq_kv, seq_kv - 5])
    visible = jnp.arange(seq_kv)[None, :] < lengths[:, None]                 # [B, S]
    return jnp.broadcast_to(visible[:, None, None, :], (2, 1, seq_q, seq_kv)).astype(dtype)


@pytest.mark.parametrize("case", ["plain", "causal", "bool mask", "int mask", "bias",
                                  "scale", "cross"])
def test_backend_function_matches_keras(case):
    """Outputs and gradients (q, k, v, bias) equal Keras's own backend function's."""
    seq_kv = 24 if case == "cross" else 16
    q, k, v = _inputs(seq_kv=seq_kv)
    kwargs = {}
    if case == "causal":
        kwargs["is_causal"] = True
    if case in ("bool mask", "cross"):
        kwargs["mask"] = _padding_mask(16, seq_kv, bool)
    if case == "int mask":
        kwargs["mask"] = _padding_mask(16, seq_kv, jnp.int32)
    if case == "scale":
        kwargs["scale"] = 0.3
    bias = jax.random.normal(jax.random.PRNGKey(5), (1, 4, 16, 16)) if case == "bias" else None

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias=bias, **kwargs)
        return jnp.sum(out * jnp.cos(out)), out

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    results = []
    for fn in (pf_keras.dot_product_attention, pf_keras.keras_dot_product_attention):
        (_, out), grads = jax.value_and_grad(loss, argnums=tuple(a + 1 for a in argnums),
                                             has_aux=True)(fn, q, k, v, bias)
        results.append((out, grads))
    (ours, our_grads), (theirs, their_grads) = results
    np.testing.assert_allclose(ours, theirs, **TOL)
    for a, b in zip(our_grads, their_grads, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_install_routes_keras_ops_and_layers(spy):
    """After install(), keras.ops.dot_product_attention and MultiHeadAttention run ours, with
    the same output as before; uninstall() restores Keras's own function."""
    from keras.src.backend import nn as backend_nn

    assert pf_keras.installed() and backend_nn.dot_product_attention is \
        pf_keras.dot_product_attention
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, seed=0)
    x = np.random.RandomState(0).randn(2, 12, 16).astype("float32")
    ours = layer(x, x, use_causal_mask=True)
    assert spy == [(True, None)]
    q, k, v = _inputs()
    np.testing.assert_allclose(keras.ops.dot_product_attention(q, k, v),
                               pf_keras.keras_dot_product_attention(q, k, v), **TOL)
    assert spy == [(True, None), (False, None)]
    pf_keras.install()            # a second install changes nothing
    pf_keras.uninstall()
    assert not pf_keras.installed()
    assert backend_nn.dot_product_attention is pf_keras.keras_dot_product_attention
    np.testing.assert_allclose(layer(x, x, use_causal_mask=True), ours, **TOL)
    assert len(spy) == 2


def test_fallbacks_and_bad_input(recwarn):
    """attn_logits_soft_cap runs Keras's own path with one warning for any number of calls;
    flash_attention=False runs it without one; bad arguments raise ValueError."""
    q, k, v = _inputs()
    checks.reset_warnings()
    for _ in range(2):
        np.testing.assert_allclose(
            pf_keras.dot_product_attention(q, k, v, attn_logits_soft_cap=20.0),
            pf_keras.keras_dot_product_attention(q, k, v, attn_logits_soft_cap=20.0), **TOL)
    (warning,) = recwarn.list
    assert "attn_logits_soft_cap" in str(warning.message)
    np.testing.assert_allclose(pf_keras.dot_product_attention(q, k, v, flash_attention=False),
                               pf_keras.keras_dot_product_attention(q, k, v), **TOL)
    assert len(recwarn.list) == 1
    with pytest.raises(ValueError, match="query must be 4-D"):
        pf_keras.dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="flash_attention"):
        pf_keras.dot_product_attention(q, k, v, flash_attention="yes")
    with pytest.raises(ValueError, match="mask"):
        pf_keras.dot_product_attention(q, k, v, mask=jnp.ones((3, 16), bool))


def test_install_needs_the_jax_backend(monkeypatch):
    monkeypatch.setattr(keras.config, "backend", lambda: "torch")
    with pytest.raises(ValueError, match="JAX backend"):
        pf_keras.install()
    assert not pf_keras.installed()


def test_moved_private_names_raise_naming_tested_versions(monkeypatch):
    monkeypatch.setattr(pf_keras, "_BACKEND_MODULE", "keras.src.backend.jax.no_such_module")
    with pytest.raises(ImportError, match=r"keras 3\.15"):
        pf_keras.install()
    monkeypatch.undo()
    with pytest.raises(ImportError, match=r"keras-hub 0\.32"):
        pf_keras.install(causal_decoders=(("keras_hub.src.models.llama", "Gone", None),))
    assert not pf_keras.installed()


@pytest.mark.parametrize("decoders", [[("m", "C", None)], (("m", "C"),), (("m", "C", 3),)])
def test_install_refuses_malformed_causal_decoders(decoders):
    with pytest.raises(ValueError, match="causal_decoders"):
        pf_keras.install(causal_decoders=decoders)
    assert not pf_keras.installed()


def _llama(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=32, intermediate_dim=64, max_sequence_length=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def test_keras_hub_llama_forward_training_step_and_generate(spy):
    """A tiny random KerasHub Llama: logits, one SGD step (its loss and every updated
    weight) and greedy generate tokens equal Keras's own attention's. Square calls
    (training, the prompt) pass is_causal=True; generation steps keep the dense mask."""
    rng = np.random.RandomState(0)
    x = {"token_ids": rng.randint(1, 64, (2, 12)).astype("int32"),
         "padding_mask": np.array([[1] * 12, [1] * 8 + [0] * 4], bool)}
    y = rng.randint(1, 64, (2, 12)).astype("int32")
    prompt = {"token_ids": np.array([[5, 6, 7] + [0] * 7, [8, 9] + [0] * 8], "int32"),
              "padding_mask": np.array([[1] * 3 + [0] * 7, [1] * 2 + [0] * 8], bool)}
    results = {}
    for name in ("ours", "keras"):
        if name == "keras":
            pf_keras.uninstall()
        model = _llama()
        model.compile(optimizer=keras.optimizers.SGD(1.0), sampler="greedy",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        logits = np.asarray(model(x))
        loss = model.train_on_batch(x, y, sample_weight=x["padding_mask"])
        weights = [np.asarray(w) for w in model.get_weights()]
        tokens = model.generate(prompt, stop_token_ids=None)["token_ids"]
        results[name] = (logits, loss, weights, tokens)
        if name == "ours":
            # forward, training (forward and its backward's trace), prompt: square, causal;
            # then one call per generated token, against the cache.
            causal = [c for c, _ in spy]
            assert causal[:2] == [True, True] and False in causal  # 2 layers
            assert all(causal[: causal.index(False)])
    (logits, loss, weights, tokens), (ref_logits, ref_loss, ref_weights, ref_tokens) = (
        results["ours"], results["keras"])
    valid = x["padding_mask"][:, :, None]
    np.testing.assert_allclose(logits * valid, ref_logits * valid, **TOL)
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for a, b in zip(weights, ref_weights, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.parametrize("family", ["mistral", "qwen"])
def test_keras_hub_mistral_and_qwen_forward(spy, family):
    """The other marked decoders: logits equal Keras's own; square calls pass is_causal,
    and Mistral's sliding_window=w as local_window_size=(w - 1, 0)."""
    sizes = dict(vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
                 hidden_dim=32, intermediate_dim=64)
    keras.utils.set_random_seed(0)
    if family == "mistral":
        backbone = keras_hub.models.MistralBackbone(sliding_window=5, **sizes)
    else:
        backbone = keras_hub.models.QwenBackbone(**sizes)
    x = {"token_ids": np.random.RandomState(0).randint(1, 64, (2, 12)).astype("int32"),
         "padding_mask": np.array([[1] * 12, [1] * 8 + [0] * 4], bool)}
    ours = np.asarray(backbone(x))
    assert spy == [(True, (4, 0) if family == "mistral" else None)]
    pf_keras.uninstall()
    valid = x["padding_mask"][:, :, None]
    np.testing.assert_allclose(ours * valid, np.asarray(backbone(x)) * valid, **TOL)

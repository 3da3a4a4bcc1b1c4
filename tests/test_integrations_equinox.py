"""pallas_flash.integrations.equinox against eqx.nn.MultiheadAttention's own attention:
outputs, gradients, one optax training step, the fallback, float32 on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

eqx = pytest.importorskip("equinox")  # the test extra installs it: this runs in `make test`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from pallas_flash.integrations import checks  # noqa: E402
from pallas_flash.integrations import equinox as pf_eqx  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-5)
HEADS, SIZE = 4, 32


def _mha(dropout_p=0.0):
    return eqx.nn.MultiheadAttention(HEADS, SIZE, dropout_p=dropout_p,
                                     key=jax.random.PRNGKey(0))


def _rope(q, k, v):
    rope = eqx.nn.RotaryPositionalEmbedding(SIZE // HEADS)
    rotate = jax.vmap(rope, in_axes=1, out_axes=1)
    return rotate(q), rotate(k), v


@pytest.mark.parametrize("case", ["plain", "causal", "per-head mask", "rope", "cross"])
def test_matches_equinox(case):
    """Outputs and gradients (parameters and inputs) equal the module's own call's. The
    structured form (is_causal) goes with the same dense mask Equinox gets."""
    seq_q, seq_kv = 16, 24 if case == "cross" else 16
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    x = jax.random.normal(keys[0], (seq_q, SIZE))
    kv = jax.random.normal(keys[1], (seq_kv, SIZE)) if case == "cross" else x
    mask, ours_kwargs, theirs_kwargs = None, {}, {}
    if case == "causal":
        mask = jnp.tril(jnp.ones((seq_q, seq_kv), bool))
        ours_kwargs["is_causal"] = True
    if case == "per-head mask":
        mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (HEADS, seq_q, seq_kv))
        mask = mask.at[:, :, 0].set(True)  # no empty rows: there the two conventions differ
    if case == "rope":
        ours_kwargs["process_heads"] = theirs_kwargs["process_heads"] = _rope
    if case == "cross":
        mask = jnp.arange(seq_kv)[None, :] < jnp.array([[20]] * seq_q)

    def loss(mha, x, kv, ours):
        if ours:
            out = pf_eqx.multihead_attention(mha, x, kv, kv, mask, **ours_kwargs)
        else:
            out = mha(x, kv, kv, mask, **theirs_kwargs)
        return jnp.sum(out * jnp.cos(out)), out

    results = [eqx.filter_value_and_grad(loss, has_aux=True)(_mha(), x, kv, ours)
               for ours in (True, False)]
    input_grads = [jax.grad(lambda x, ours: loss(_mha(), x, kv, ours)[0])(x, ours)
                   for ours in (True, False)]
    ((_, ours), our_grads), ((_, theirs), their_grads) = results
    np.testing.assert_allclose(ours, theirs, **TOL)
    for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(their_grads), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(*input_grads, **TOL)


class _TinyLM(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(50, SIZE, key=k1)
        self.attn = eqx.nn.MultiheadAttention(HEADS, SIZE, key=k2)
        self.head = eqx.nn.Linear(SIZE, 50, key=k3)

    def __call__(self, tokens, ours: bool):
        x = jax.vmap(self.embed)(tokens)
        if ours:
            x = x + pf_eqx.multihead_attention(self.attn, x, x, x, is_causal=True)
        else:
            causal = jnp.tril(jnp.ones((tokens.shape[0],) * 2, bool))
            x = x + self.attn(x, x, x, causal)
        return jax.vmap(self.head)(x)


def test_training_step_matches_equinox():
    """One Adam step of a tiny causal LM, batched with jax.vmap: the loss and every updated
    parameter equal those with Equinox's own attention (and its dense causal mask)."""
    tokens = jax.random.randint(jax.random.PRNGKey(3), (3, 17), 0, 50)
    optimizer = optax.adam(1e-2)
    updated = []
    for ours in (True, False):
        model = _TinyLM(jax.random.PRNGKey(4))
        state = optimizer.init(eqx.filter(model, eqx.is_array))

        @eqx.filter_value_and_grad
        def loss(model, ours=ours):
            logits = jax.vmap(lambda t: model(t, ours))(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = eqx.filter_jit(loss)(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
        updated.append((value, eqx.apply_updates(model, updates)))
    (our_loss, ours), (their_loss, theirs) = updated
    np.testing.assert_allclose(our_loss, their_loss, **TOL)
    for a, b in zip(jax.tree.leaves(eqx.filter(ours, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(theirs, eqx.is_array)), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_empty_rows_output_zero_before_the_output_projection():
    """A query that sees no key: 0 here (Equinox: the mean of V), so the layer returns
    output_proj(0) (0: Equinox's output projection has no bias by default)."""
    mha = _mha()
    x = jax.random.normal(jax.random.PRNGKey(5), (8, SIZE))
    mask = jnp.ones((8, 8), bool).at[3].set(False)
    out = pf_eqx.multihead_attention(mha, x, x, x, mask)
    np.testing.assert_array_equal(out[3], jnp.zeros(SIZE))
    assert np.abs(mha(x, x, x, mask)[3]).max() > 0.01
    np.testing.assert_allclose(np.delete(out, 3, 0), np.delete(mha(x, x, x, mask), 3, 0), **TOL)


def test_dropout_falls_back_with_one_warning_and_bad_input_raises(recwarn):
    mha = _mha(dropout_p=0.5)
    x = jax.random.normal(jax.random.PRNGKey(6), (8, SIZE))
    checks.reset_warnings()
    drop_key = jax.random.PRNGKey(7)
    for _ in range(2):
        np.testing.assert_allclose(pf_eqx.multihead_attention(mha, x, x, x, key=drop_key),
                                   mha(x, x, x, key=drop_key), **TOL)
    (warning,) = recwarn.list
    assert "dropout" in str(warning.message)
    # In inference, dropout is off: ours runs, with no further warning.
    np.testing.assert_allclose(pf_eqx.multihead_attention(mha, x, x, x, inference=True),
                               mha(x, x, x, inference=True), **TOL)
    assert len(recwarn.list) == 1
    with pytest.raises(ValueError, match="is_causal"):
        pf_eqx.multihead_attention(mha, x, x, x, key=drop_key, is_causal=True)
    with pytest.raises(ValueError, match="query must be"):
        pf_eqx.multihead_attention(mha, x[None], x, x, inference=True)
    with pytest.raises(ValueError, match="same length"):
        pf_eqx.multihead_attention(mha, x, x, x[:5], inference=True)
    with pytest.raises(ValueError, match="MultiheadAttention"):
        pf_eqx.multihead_attention(eqx.nn.Linear(2, 2, key=drop_key), x, x, x)
    with pytest.raises(ValueError, match="process_heads"):
        pf_eqx.multihead_attention(mha, x, x, x, inference=True,
                                   process_heads=lambda q, k, v: (q[:4], k, v))


def test_importing_pallas_flash_imports_no_model_library():
    code = ("import sys, pallas_flash, pallas_flash.integrations; "
            "print(sorted(m for m in ('keras', 'keras_hub', 'equinox') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"

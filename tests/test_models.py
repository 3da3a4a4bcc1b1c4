"""models.transformer and models.data: the model, cached generation, corpus packing."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import data
from models.transformer import (
    PRESETS,
    Transformer,
    TransformerConfig,
    attention_kwargs,
    baseline_attention_fn,
    count_params,
    generate,
)

CONFIG = TransformerConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64,
                           seq_len=16)


def _model(config=CONFIG, **kwargs) -> Transformer:
    return Transformer(config, rngs=nnx.Rngs(0), **kwargs)


def test_model_matches_dense_jax_baseline_on_packed_rows():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    packed = {"segment_ids": jnp.array([[1] * 7 + [2] * 9, [1] * 16]),
              "positions": jnp.array([list(range(7)) + list(range(9)), list(range(16))])}
    ours = _model()(tokens, **packed)
    dense = _model(attention_fn=baseline_attention_fn("xla"))(tokens, **packed)
    assert ours.shape == (2, 16, 256) and ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, dense, rtol=1e-4, atol=1e-4)


def test_cached_decoding_reproduces_full_forward():
    model = _model(TransformerConfig(**{**CONFIG.__dict__, "local_window_size": 5}))
    tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, 256)
    full = model(tokens)
    model.init_cache(batch_size=2, max_length=10)
    stepwise = jnp.concatenate([model(tokens[:, t:t + 1], decode=True) for t in range(10)], 1)
    np.testing.assert_allclose(stepwise, full, rtol=1e-4, atol=1e-4)


def test_greedy_generate_follows_the_full_forward_argmax():
    model = _model()
    prompt = jnp.array([[100, 101, 102], [7, 8, 9]], jnp.int32)
    new = generate(model, prompt, 6)
    assert new.shape == (2, 6)
    logits = model(jnp.concatenate([prompt, new], axis=1))
    np.testing.assert_array_equal(jnp.argmax(logits[:, 2:-1], axis=-1), new)


def test_embeddings_tied_or_untied():
    tied, untied = _model(), _model(TransformerConfig(**{**CONFIG.__dict__,
                                                        "tie_embeddings": False}))
    assert tied.lm_head is None
    assert count_params(untied) - count_params(tied) == CONFIG.d_model * CONFIG.vocab_size


def test_small_preset_size():
    abstract = nnx.eval_shape(lambda: Transformer(PRESETS["small"], rngs=nnx.Rngs(0)))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert 30e6 <= params <= 120e6
    assert PRESETS["small"].seq_len == 4096


def test_attention_kwargs():
    assert attention_kwargs("triton") == {"implementation": "triton"}
    assert "attention_fn" in attention_kwargs("cudnn")
    with pytest.raises(ValueError, match="implementation must be one of"):
        attention_kwargs("flash")


def _document_of_each_token(documents, seq_len):
    """[rows, seq_len] index of the document each packed token came from (-1: padding)."""
    owner = np.concatenate([np.full(len(d), i) for i, d in enumerate(documents)])
    rows = -(-len(owner) // seq_len)
    return np.pad(owner, (0, rows * seq_len - len(owner)), constant_values=-1).reshape(rows, -1)


def test_packing_keeps_documents_apart():
    documents = [b"a" * 5, b"bb" * 7, b"c", b"d" * 30, b"e" * 3]
    packed = data.pack(documents, seq_len=8)
    owner = _document_of_each_token(documents, 8)
    assert packed.tokens.shape == packed.segment_ids.shape == packed.positions.shape
    np.testing.assert_array_equal(packed.tokens[owner >= 0],
                                  np.frombuffer(b"".join(documents), np.uint8))
    # Same segment id <=> same document (within a row), padding is segment 0.
    same_segment = packed.segment_ids[:, :, None] == packed.segment_ids[:, None, :]
    same_document = owner[:, :, None] == owner[:, None, :]
    np.testing.assert_array_equal(same_segment, same_document)
    np.testing.assert_array_equal(packed.segment_ids == 0, owner == -1)
    # Positions restart at 0 at each document piece and count up inside it.
    starts = np.diff(packed.segment_ids, axis=1, prepend=-1) != 0
    np.testing.assert_array_equal(packed.positions[starts & (owner >= 0)], 0)
    inside = ~starts & (owner >= 0)
    np.testing.assert_array_equal(packed.positions[:, 1:][inside[:, 1:]],
                                  packed.positions[:, :-1][inside[:, 1:]] + 1)
    np.testing.assert_array_equal(packed.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(packed.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])


def _write_corpus(root: Path, n_files: int) -> None:
    for i in range(n_files):
        (root / f"doc{i}.txt").write_text(f"document {i}\n" * (i + 1))
    (root / "image.bin").write_bytes(b"\x89PNG\0\0binary")


def test_split_by_file_is_deterministic_and_disjoint(tmp_path):
    _write_corpus(tmp_path, 20)
    files = data.list_files(tmp_path)
    assert len(files) == 20 and all(p.suffix == ".txt" for p in files)   # binary skipped
    train, val = data.split_files(files, tmp_path, 0.2)
    assert len(val) == 4 and not set(train) & set(val) and len(train) + len(val) == 20
    assert data.split_files(list(reversed(files)), tmp_path, 0.2)[1] == val[::-1]


def test_load_corpus_folder_and_single_file(tmp_path):
    _write_corpus(tmp_path, 5)
    train, val = data.load_corpus(16, tmp_path, val_fraction=0.2)
    assert train.tokens.shape[1] == val.tokens.shape[1] == 16
    single = tmp_path / "doc4.txt"
    train, val = data.load_corpus(8, single, val_fraction=0.25)
    assert bytes(train.tokens[train.segment_ids > 0].astype(np.uint8)) + bytes(
        val.tokens[val.segment_ids > 0].astype(np.uint8)) == single.read_bytes()


def test_stdlib_corpus_files():
    files = data.list_files(data.stdlib_dir(), ".py")
    assert len(files) > 500
    assert not any("site-packages" in p.parts for p in files)
    assert data.stdlib_dir() / "os.py" in files


def test_train_batches_are_a_function_of_seed_and_step():
    packed = data.pack([bytes(range(200))], seq_len=8)
    first = data.train_batch(packed, 4, seed=0, step=3)
    np.testing.assert_array_equal(first["tokens"], data.train_batch(packed, 4, 0, 3)["tokens"])
    assert not np.array_equal(first["tokens"], data.train_batch(packed, 4, 0, 4)["tokens"])
    assert set(first) == {"tokens", "segment_ids", "positions"}

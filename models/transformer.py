"""A decoder-only transformer built from :class:`pallas_flash.nn.FlashSelfAttention`.

Pre-norm blocks (RMSNorm), rotary positions, SwiGLU feed-forward, grouped-query attention,
tied or untied input/output embeddings. Byte-level by default (``vocab_size=256``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_flash import ring_attention
from pallas_flash.masking import segments_visible
from pallas_flash.nn import AttentionFn, FlashSelfAttention

#: ``--implementation`` choices: ours, then jax.nn.dot_product_attention baselines.
OUR_IMPLEMENTATIONS = ("mosaic", "triton", "xla")
BASELINE_IMPLEMENTATIONS = {"cudnn": "cudnn", "xla_dense": "xla"}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture. ``seq_len`` is the training context (RoPE itself has no maximum)."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 384
    seq_len: int = 128
    rope_base: float = 10_000.0
    tie_embeddings: bool = True
    local_window_size: int | None = None


PRESETS: dict[str, TransformerConfig] = {
    # About two minutes of training on a 2-core laptop CPU.
    "tiny": TransformerConfig(),
    # ~76M parameters; head_dim 64, 3 query heads per KV head; meant for one GPU at 4096.
    "small": TransformerConfig(d_model=768, num_layers=12, num_heads=12, num_kv_heads=4,
                               d_ff=2048, seq_len=4096, rope_base=500_000.0),
}


def baseline_attention_fn(implementation: str) -> AttentionFn:
    """An :data:`~pallas_flash.nn.AttentionFn` running ``jax.nn.dot_product_attention``.

    ``implementation``: ``"cudnn"`` or ``"xla"`` (the dense XLA path). Segment ids become a
    dense ``[batch, 1, seq, seq]`` mask, which is what those baselines need.
    """

    def attention_fn(query, key, value, *, is_causal, local_window_size, q_segment_ids,
                     kv_segment_ids):
        mask = None
        if q_segment_ids is not None:
            mask = segments_visible(q_segment_ids, kv_segment_ids)[:, None]
        return jax.nn.dot_product_attention(
            query, key, value, mask=mask, is_causal=is_causal,
            local_window_size=local_window_size, implementation=implementation)

    return attention_fn


def ring_attention_fn(axis_name: str, implementation: str | None = None) -> AttentionFn:
    """An :data:`~pallas_flash.nn.AttentionFn` running :func:`pallas_flash.ring_attention`
    over mesh axis ``axis_name``, for a model called inside ``jax.shard_map`` on rows split
    over that axis in zigzag order (:func:`pallas_flash.to_zigzag`), their positions and
    segment ids split the same way."""
    return functools.partial(ring_attention, axis_name=axis_name, layout="zigzag",
                             implementation=implementation)


def attention_kwargs(implementation: str | None, *,
                     context_axis: str | None = None) -> dict[str, Any]:
    """Keyword arguments of :class:`Transformer` selecting an attention implementation;
    with ``context_axis``, ring attention over that mesh axis (:func:`ring_attention_fn`)."""
    if context_axis is not None:
        if implementation not in (None, *OUR_IMPLEMENTATIONS):
            raise ValueError(f"ring attention runs {OUR_IMPLEMENTATIONS} or None, got "
                             f"{implementation!r}")
        return {"attention_fn": ring_attention_fn(context_axis, implementation)}
    if implementation in BASELINE_IMPLEMENTATIONS:
        return {"attention_fn": baseline_attention_fn(BASELINE_IMPLEMENTATIONS[implementation])}
    if implementation is None or implementation in OUR_IMPLEMENTATIONS:
        return {"implementation": implementation}
    choices = (*OUR_IMPLEMENTATIONS, *BASELINE_IMPLEMENTATIONS)
    raise ValueError(f"implementation must be one of {choices} or None, got {implementation!r}")


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``: ``[..., d_model] -> [..., d_model]``."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: Any, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        # gate and up share one matmul.
        self.gate_up = nnx.Linear(d_model, 2 * d_ff, use_bias=False, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(nnx.silu(gate) * up)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: TransformerConfig, *, attention: dict[str, Any], dtype: Any,
                 param_dtype: Any, rngs: nnx.Rngs) -> None:
        d = config.d_model
        self.attn_norm = nnx.RMSNorm(d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn = FlashSelfAttention(
            d, config.num_heads, num_kv_heads=config.num_kv_heads, is_causal=True,
            local_window_size=config.local_window_size, rope_base=config.rope_base,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs, **attention)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp = SwiGLU(d, config.d_ff, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, *, positions: jax.Array | None,
                 segment_ids: jax.Array | None, decode: bool) -> jax.Array:
        """x: [batch, seq, d_model] -> [batch, seq, d_model]."""
        x = x + self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids,
                          decode=decode)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """Decoder-only language model.

    Args:
      config: architecture.
      implementation: :func:`pallas_flash.attention` implementation (``None``: fastest).
      attention_fn: replaces :func:`pallas_flash.attention` (exclusive with
        ``implementation``); see :func:`attention_kwargs`.
      dtype: computation dtype (``None``: the parameters' dtype).
      param_dtype: parameter dtype.
      rngs: initialisation keys.
    """

    def __init__(self, config: TransformerConfig, *, implementation: str | None = None,
                 attention_fn: AttentionFn | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        attention = ({"attention_fn": attention_fn} if attention_fn is not None
                     else {"implementation": implementation})
        self.config = config
        # std 1/sqrt(d): with tied embeddings the initial logits have unit variance.
        self.embed = nnx.Embed(config.vocab_size, config.d_model, dtype=dtype,
                               param_dtype=param_dtype,
                               embedding_init=nnx.initializers.normal(config.d_model ** -0.5),
                               rngs=rngs)
        self.blocks = nnx.List([
            Block(config, attention=attention, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.lm_head = None if config.tie_embeddings else nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, decode: bool = False) -> jax.Array:
        """Next-token logits.

        Args:
          tokens: ``[batch, seq]`` integer ids.
          positions: ``[batch, seq]`` (default ``0 .. seq-1``; restart per packed document).
          segment_ids: ``[batch, seq]`` packed-document ids (attention stays inside one).
          decode: extend the KV cache (see :meth:`init_cache`) with these tokens.

        Returns:
          ``[batch, seq, vocab_size]`` float32 logits.
        """
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions=positions, segment_ids=segment_ids, decode=decode)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32)

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Empty KV caches in every layer, for decoding up to ``max_length`` tokens."""
        for block in self.blocks:
            block.attn.init_cache(batch_size, max_length)


def count_params(model: nnx.Module) -> int:
    """Number of parameter scalars."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def generate(model: Transformer, prompt: jax.Array, max_new_tokens: int, *,
             temperature: float = 0.0, rng: jax.Array | None = None) -> jax.Array:
    """Continue ``prompt`` token by token using the KV cache.

    Allocates a fresh cache of ``prompt_len + max_new_tokens`` on ``model``, feeds the
    prompt in one decode call, then one token per step inside a ``lax.scan``.

    Args:
      prompt: ``[batch, prompt_len]`` token ids.
      max_new_tokens: tokens to append.
      temperature: 0 for greedy decoding, else the softmax temperature of sampling.
      rng: PRNG key (needed when ``temperature > 0``).

    Returns:
      ``[batch, max_new_tokens]`` new token ids.
    """
    if temperature > 0 and rng is None:
        raise ValueError("sampling with temperature > 0 needs rng")
    rng = jax.random.key(0) if rng is None else rng
    model.init_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens)
    graphdef, state = nnx.split(model)

    def pick(logits, key):
        if temperature == 0:
            return jnp.argmax(logits, axis=-1)
        return jax.random.categorical(key, logits / temperature, axis=-1)

    def step(carry, key):
        state, logits = carry
        token = pick(logits, key).astype(prompt.dtype)
        model = nnx.merge(graphdef, state)
        logits = model(token[:, None], decode=True)[:, -1]
        return (nnx.state(model), logits), token

    @jax.jit
    def run(state, prompt, rng):
        model = nnx.merge(graphdef, state)
        logits = model(prompt, decode=True)[:, -1]
        _, tokens = jax.lax.scan(step, (nnx.state(model), logits),
                                 jax.random.split(rng, max_new_tokens))
        return tokens.T

    return run(state, prompt, rng)

"""Recipes that route other model libraries' attention through :func:`pallas_flash.attention`.

One small module per library; each imports its library only when imported itself, so
``import pallas_flash`` (and this package) never imports any of them:

* :mod:`pallas_flash.integrations.keras` — Keras 3 on the JAX backend (and KerasHub):
  a backend-level ``dot_product_attention`` and :func:`~pallas_flash.integrations.keras.install`,
  which routes ``keras.ops.dot_product_attention`` (hence ``keras.layers.MultiHeadAttention``
  and KerasHub's models) through it.
* :mod:`pallas_flash.integrations.equinox` — Equinox:
  :func:`~pallas_flash.integrations.equinox.multihead_attention` runs an
  ``eqx.nn.MultiheadAttention`` with all heads in one kernel call.
* :mod:`pallas_flash.integrations.gemma` — Gemma 2 / 3 (``gemma``):
  :func:`~pallas_flash.integrations.gemma.flash_model` subclasses a ``gm.nn`` model so its
  ``Attention`` layers (same parameters, RoPE, qk-norm, cache) call the kernels.
* :mod:`pallas_flash.integrations.maxtext` — MaxText: ``FlashAttentionOp``, an
  ``AttentionOp`` whose attention runs here (pre-scaled queries, segment ids, sinks, the
  prefill/decode merge through the lse).

:mod:`pallas_flash.integrations.checks` holds the check each adapter runs at import: the
library names it relies on still exist, or an ``ImportError`` naming the tested versions.

Use: ``from pallas_flash.integrations import keras as pf_keras``. The argument conventions
that differ between libraries (scale, window, masks) are in ``docs/conventions.md``.
"""

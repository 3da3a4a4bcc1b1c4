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

Use: ``from pallas_flash.integrations import keras as pf_keras``. The argument conventions
that differ between libraries (scale, window, masks) are in ``docs/conventions.md``.
"""

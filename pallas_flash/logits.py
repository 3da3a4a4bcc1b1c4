"""Logits in base 2 and the soft-cap's derivative: backend-neutral tile arithmetic.

Every kernel runs its softmax in base 2 (``exp(x) = exp2(x·log2 e)``), so the logit scale
and log2 e fold into one factor. Soft-capping (Gemma 2) replaces the logits ``x`` by
``c·tanh(x / c)``; the backward then needs the cap's derivative, ``1 − tanh²``, to carry
dS from the capped logits back to ``scale·Q·Kᵀ``. Used by the Triton kernels and the
Mosaic GPU backward.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

LOG2_E = math.log2(math.e)


def log2_logits(qk, scale: float, softcap: float | None, bias_tile=None):
    """Logits in base 2 from raw Q·Kᵀ: exp(x) = exp2(x·log2 e), so the scale folds in.

    Returns ``(logits2, slope)``; with soft-capping the logits are ``c·tanh(scale·qk/c)`` and
    ``slope = 1 - tanh²`` is their derivative w.r.t. ``scale·qk`` (None without it).
    ``bias_tile`` (``[block_q or 1, block_kv or 1]``) is added after the soft-cap.
    """
    if softcap is None:
        s, slope = qk * (scale * LOG2_E), None
    else:
        t = jnp.tanh(qk * (scale / softcap))
        s, slope = t * (softcap * LOG2_E), 1.0 - t * t
    if bias_tile is not None:
        s = s + bias_tile.astype(jnp.float32) * LOG2_E
    return s, slope


def raw_score_gradient(ds, slope):
    """dS through the soft-cap's tanh, if any: the gradient of scale·Q·Kᵀ.

    ``slope``: from :func:`log2_logits` (None without soft-capping).
    """
    return ds if slope is None else ds * slope

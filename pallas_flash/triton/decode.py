"""Split-KV decode as one Triton-lowered Pallas kernel, each part's keys found in the kernel.

One program per (part of a row's keys × query tile, row, kv head). It reads the row lengths,
asks the caller's ``part_interval`` which keys ``[lo, hi)`` its part covers, and walks only
the key tiles of that interval, from the cache or through the row's page table. Where the
query tokens of a row see different keys (several tokens, causal or windowed: the caller's
``band``), the tiles that the per-token band cuts are masked with it too; the others run
unmasked but for the interval's two edge tiles, masked by key position (their logits, and
their rows of V, so that whatever a hidden slot holds, NaN included, never reaches the
output). The packed query rows of the row are read in place by every part (no repeated
copy), and no per-key id or mask array, span table, split bound or page window is built
outside the kernel: each of those was a small XLA kernel of 2–4 µs that a decode step
paid on every call (seven of them, 16 µs of GPU time, before a ragged step at 8 × 32768 on
the H200; ncu, docs/decode.md). The parts' ``(out,
lse)`` are merged by the caller (:func:`pallas_flash.decode.merge_splits`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_flash.contract import EMPTY_ROW_LSE, kernel_output
from pallas_flash.logits import LOG2_E, log2_logits
from pallas_flash.padding import next_power_of_2, pad_axis, round_up
from pallas_flash.triton.config import TritonConfig, padded_head_dim
from pallas_flash.triton.forward import dot_precision
from pallas_flash.triton.tiles import walk_tiles

#: ``part_interval(lengths, length, part) -> (lo, hi)``: see :func:`split_forward`.
PartInterval = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


class RowBand(Protocol):
    """Which keys the packed query rows of one cache row see (traced inside the kernel).

    ``length``: the row's cache length (int32 scalar); ``rows``: packed query row indices
    ``[r, 1]``; ``keys``: key positions ``[1, k]``.
    """

    def uniform_keys(self, length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys ``[lo, hi)`` that every packed row sees (where the row's part has them)."""

    def packed_visible(self, length: jax.Array, rows: jax.Array, keys: jax.Array
                       ) -> jax.Array:
        """``[r, k]`` bool: packed row ``rows[i]`` sees key ``keys[j]``."""


def _kv_tile(ref, page_ref, k_start, block_kv: int):
    """Keys ``[k_start, k_start + block_kv)`` of a program's K or V: a slice of its rows,
    or, with a page table (``page_ref``: this sequence's page ids), a slice of the page that
    holds them (``block_kv`` divides the page size, so a tile never straddles two pages).
    Page ids outside the pool are clamped into it (they cannot be checked under jit)."""
    if page_ref is None:
        return ref[pl.ds(k_start, block_kv), :]
    num_pages, page_size = ref.shape[0], ref.shape[1]
    page = jnp.clip(page_ref[k_start // page_size], 0, num_pages - 1)
    return ref[page, pl.ds(k_start % page_size, block_kv), :]


def _kernel(lengths_ref, q_ref, k_ref, v_ref, page_ref, o_ref, lse_ref, *,
            part_interval: PartInterval, band: RowBand, num_q_tiles: int, scale: float,
            softcap: float | None, block_q: int, block_kv: int):
    part, q_tile = pl.program_id(0) // num_q_tiles, pl.program_id(0) % num_q_tiles
    length = lengths_ref[pl.program_id(1)]
    lo, hi = part_interval(lengths_ref[...], length, part)
    precision = dot_precision(q_ref.dtype)
    q = q_ref[...]
    rows = q_tile * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)

    def kv_step(j, carry, *, masked: bool):
        acc, m_i, l_i = carry
        k_start = j * block_kv
        k = _kv_tile(k_ref, page_ref, k_start, block_kv)
        qk = plgpu.dot(q, k, trans_b=True, precision=precision)  # [rows, block_kv]
        s, _ = log2_logits(qk, scale, softcap, None)
        if masked:  # a tile at the interval's edges, or one that the token band cuts
            keys = k_start + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
            visible = (keys >= lo) & (keys < hi) & band.packed_visible(length, rows, keys)
            s = jnp.where(visible, s, -jnp.inf)
            # A row that has seen only hidden keys subtracts 0, so that p and alpha are 0.
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new = m_sub = jnp.maximum(m_i, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_sub[:, None])
        alpha = jnp.exp2(m_i - m_sub)  # FA2: rescale the running statistics only
        l_i = alpha * l_i + jnp.sum(p, axis=1)
        v = _kv_tile(v_ref, page_ref, k_start, block_kv)
        if masked:
            # A hidden key's logit is replaced above, but P·V is a matmul, where 0 · NaN is
            # NaN: the rows of V outside the part (past the row's length a stale cache may
            # hold anything) are zeroed too. Only edge tiles hold such rows.
            key_rows = k_start + lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
            v = jnp.where((key_rows >= lo) & (key_rows < hi), v, jnp.zeros((), v.dtype))
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_i

    # Tiles overlapping [lo, hi), of which those inside it and inside the keys every row
    # sees need no mask; none when the part is empty.
    uniform_lo, uniform_hi = band.uniform_keys(length)
    first = lo // block_kv
    last = jnp.where(hi > lo, -(-hi // block_kv), first)
    full_first = jnp.clip(-(-jnp.maximum(lo, uniform_lo) // block_kv), first, last)
    full_last = jnp.clip(jnp.minimum(hi, uniform_hi) // block_kv, full_first, last)
    head_dim = q.shape[1]
    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, m_i, l_i = walk_tiles(kv_step, (first, full_first, full_last, last), carry)
    empty = l_i == 0.0  # a part with no key: out 0, lse at the empty floor
    safe_l = jnp.where(empty, 1.0, l_i)
    o_ref[...] = acc / safe_l[:, None]
    lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, (m_i + jnp.log2(safe_l)) / LOG2_E)


def split_forward(packed_q: jax.Array, key: jax.Array, value: jax.Array, lengths: jax.Array,
                  part_interval: PartInterval, band: RowBand, *, num_splits: int,
                  scale: float, softcap: float | None, config: TritonConfig, interpret: bool,
                  page_table: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Every row's keys in ``num_splits`` parts, each part attended by its own programs.

    Args:
      packed_q: ``[B, R, K, D]``: the ``R`` packed query rows of each kv head
        (:func:`pallas_flash.decode.decode_attention`'s GQA packing).
      key, value: the cache ``[B, S, K, D]``, or with ``page_table`` page pools
        ``[num_pages, page_size, K, D]`` (``S = pages · page_size``); read in place.
      lengths: ``[B]`` int32 cache lengths, handed to ``part_interval`` and ``band``.
      part_interval: traced inside the kernel: ``(lengths, length, part) -> (lo, hi)``,
        int32 scalars, the keys ``[lo, hi)`` (within ``[0, S)``; empty when ``hi <= lo``)
        that part ``part`` of the row whose length is ``length`` covers; ``lengths`` holds
        every row's length followed by zeros (a power-of-two vector).
      band: which of its part's keys each packed query row sees (:class:`RowBand`).
      num_splits: parts per row.
      scale, softcap: the logits' scale and soft cap (None: none).
      config: ``block_q`` query rows per program, ``block_kv`` keys per tile (capped at
        the page size), warps and stages.
      interpret: run in Pallas's interpret mode.
      page_table: None, or ``[B, pages]`` int32: row ``b``'s key ``p`` is slot ``p %
        page_size`` of page ``page_table[b, p // page_size]`` (ids outside the pool are
        clamped into it).

    Returns:
      ``out [B, n, R, K, D]`` and ``lse [B, n, K, R]``, float32: each part's normalised
      output and log-sum-exp (0 and ``-1e30`` for a part without keys).
    """
    batch, rows, kv_heads, head_dim = packed_q.shape
    padded_d = padded_head_dim(head_dim)
    block_q, block_kv = config.block_q, config.block_kv
    padded_rows = round_up(rows, block_q)
    q_p = pad_axis(pad_axis(packed_q, 1, padded_rows), 3, padded_d)
    if page_table is None:
        padded_kv = round_up(key.shape[1], block_kv)
        k_p, v_p = (pad_axis(pad_axis(x, 1, padded_kv), 3, padded_d) for x in (key, value))
        kv_spec = pl.BlockSpec((None, padded_kv, None, padded_d),
                               lambda i, b, h: (b, 0, h, 0))
        page_spec = None
    else:
        # A K/V tile must lie within one page (page sizes and tiles are powers of two).
        block_kv = min(block_kv, key.shape[1])
        k_p, v_p = pad_axis(key, 3, padded_d), pad_axis(value, 3, padded_d)
        kv_spec = pl.BlockSpec((key.shape[0], key.shape[1], None, padded_d),
                               lambda i, b, h: (0, 0, h, 0))  # the head's whole pool
        page_spec = pl.BlockSpec((None, page_table.shape[1]), lambda i, b, h: (b, 0))
    # A power-of-two vector, so that every program can load it whole (Triton's loads).
    lengths_p = pad_axis(lengths.astype(jnp.int32), 0, max(16, next_power_of_2(batch)))
    num_q_tiles = padded_rows // block_q

    kernel = functools.partial(
        _kernel, part_interval=part_interval, band=band, num_q_tiles=num_q_tiles,
        scale=scale, softcap=softcap, block_q=block_q, block_kv=block_kv)
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_splits * num_q_tiles, batch, kv_heads),
        in_specs=[pl.BlockSpec(lengths_p.shape, lambda i, b, h: (0,)),
                  pl.BlockSpec((None, block_q, None, padded_d),
                               lambda i, b, h: (b, i % num_q_tiles, h, 0)),
                  kv_spec, kv_spec, page_spec],
        out_specs=[pl.BlockSpec((None, block_q, None, padded_d), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[kernel_output((batch, num_splits * padded_rows, kv_heads, padded_d),
                                 jnp.float32, packed_q),
                   kernel_output((batch, kv_heads, num_splits * padded_rows), jnp.float32,
                                 packed_q)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="pallas_flash_split_decode",
    )(lengths_p, q_p, k_p, v_p, page_table)
    out = out.reshape(batch, num_splits, padded_rows, kv_heads, padded_d)
    lse = lse.reshape(batch, kv_heads, num_splits, padded_rows)
    return out[:, :, :rows, :, :head_dim], jnp.swapaxes(lse, 1, 2)[..., :rows]

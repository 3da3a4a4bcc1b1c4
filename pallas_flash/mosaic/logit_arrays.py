"""Bias and mask arrays as the Mosaic GPU kernels read them (as ``jax.nn``: canonical
``[B', N', T', S']``, see :mod:`pallas_flash.bias`), never expanded along a broadcast dim.

An array that varies along queries and keys rides in an SMEM ring next to the walked
operand (one ``[block_q, block_kv]`` tile per consumer and block, TMA'd on its ready
barrier), one that varies along keys only is a ``[block_kv]`` row per block in such a ring,
and one that varies along queries only is a ``[block_q]`` column loaded once per consumer.
The backward kernels use the same readers on the arrays transposed where their tiles are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_flash.mosaic.config import LogitRing, MosaicConfig
from pallas_flash.mosaic.tiles import DTYPES, SWIZZLE, row, smem_transforms
from pallas_flash.padding import pad_axis


@dataclasses.dataclass(frozen=True)
class LogitArray:
    """How the kernel reads a ``bias`` or ``mask`` array (operand from :func:`logit_operand`).

    ``kind``, what the array varies along, decides where it lives:

    * ``"tile"``: queries and keys (operand ``[B', N', T, S]``): a ``[block_q, block_kv]`` tile
      per consumer and K/V block, in an SMEM ring filled next to K;
    * ``"keys"``: keys only (``[B', N', S]``): a ``[block_kv]`` row per block in such a ring,
      spread over the rows in registers;
    * ``"rows"``: queries only (``[B', N', T]``): a ``[block_q]`` column per consumer, loaded
      once from GMEM and spread over the keys.

    ``B'`` / ``N'`` are full or 1; a size-1 dim is read at index 0 (:func:`batch_head`).
    ``is_mask``: int8, 0 hides the pair; otherwise a float bias added to the logits.
    """

    kind: str
    is_mask: bool
    dtype: jnp.dtype

    @property
    def ring(self) -> LogitRing | None:
        if self.kind == "rows":
            return None
        return LogitRing(per_query=self.kind == "tile", itemsize=self.dtype.itemsize)

    def copies_per_block(self, num_consumers: int) -> int:
        """TMA copies, hence arrivals on K's ready barrier, per K/V block."""
        return {"tile": num_consumers, "keys": 1, "rows": 0}[self.kind]

    def smem(self, config: MosaicConfig) -> plgpu.SMEM:
        """The ring's scratch; tiles swizzled as wgmma's operands, to spare bank conflicts
        when each consumer reads its tile in the WGMMA layout."""
        transforms = ()
        if self.kind == "tile":
            swizzle = min(SWIZZLE, config.block_kv * self.dtype.itemsize)
            transforms = smem_transforms(self.dtype.itemsize, swizzle)
        return plgpu.SMEM(self.ring.shape(config), self.dtype, transforms=transforms)

    def load_block(self, ref, smem, barrier, *, batch, head, rows, keys) -> None:
        """Producer: TMA of K/V block ``keys`` (``pl.ds``) into ring slot ``smem``; ``rows``:
        the ``pl.ds`` of each consumer's query rows, in order."""
        b, n = batch_head(ref, batch, head)
        if self.kind == "keys":  # row 0 of the slot (LogitRing.row_slot_rows)
            plgpu.copy_gmem_to_smem(ref.at[b, n, keys], smem.at[0], barrier)
            return
        for consumer, consumer_rows in enumerate(rows):
            plgpu.copy_gmem_to_smem(ref.at[b, n, consumer_rows, keys], smem.at[consumer],
                                    barrier)

    def read_slot(self, smem, wg) -> jax.Array:
        """Consumer ``wg``: its part of a ring slot, laid out as S (tile) or its columns."""
        if self.kind == "tile":
            return plgpu.load(smem.at[wg], layout=plgpu.Layout.WGMMA)
        return plgpu.load(smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))

    def read_rows(self, ref, *, batch, head, rows) -> jax.Array:
        """Consumer: its rows' values (``rows``: a ``pl.ds``), laid out as the rows of S.
        A plain load from GMEM (Mosaic GPU vectorises SMEM loads only), once per CTA."""
        b, n = batch_head(ref, batch, head)
        return plgpu.load(ref.at[b, n, rows], layout=plgpu.Layout.WGMMA.reduce(1),
                          optimized=False)

    def tile(self, row_part, block_part, shape: tuple[int, int]) -> jax.Array:
        """This array's ``shape`` = [block_q, block_kv] values for S_j, from the consumer's
        rows (kind ``rows``) or from block j's slot."""
        if self.kind == "rows":
            return row(row_part, shape)
        if self.kind == "keys":
            return lax.broadcast_in_dim(block_part, shape, [1])
        return block_part


def batch_head(ref, batch, head):
    """(batch, head) index into a bias / mask operand: 0 along a broadcast (size-1) dim."""
    return (batch if ref.shape[0] > 1 else 0, head if ref.shape[1] > 1 else 0)


def fold_mask(bias, attn_mask):
    """(bias, attn_mask) with the mask folded into the bias as -inf where the mask
    broadcasts to the bias's shape: one array to read, no larger than the bias."""
    if bias is None or attn_mask is None:
        return bias, attn_mask
    if jnp.broadcast_shapes(bias.shape, attn_mask.shape) != bias.shape:
        return bias, attn_mask
    return jnp.where(attn_mask, bias, -jnp.inf), None  # -inf is weakly typed: bias's dtype


def logit_array(x, *, is_mask: bool) -> LogitArray | None:
    """How the kernel reads canonical ``x`` [B', N', T', S'] (None for None): a mask as
    int8, a bias in its own dtype if 16 or 32 bits wide, else as float32."""
    if x is None:
        return None
    if is_mask:
        dtype = jnp.dtype(jnp.int8)
    elif x.dtype in (*DTYPES, jnp.dtype(jnp.float32)):
        dtype = jnp.dtype(x.dtype)
    else:
        dtype = jnp.dtype(jnp.float32)
    t, s = x.shape[2:]
    kind = "tile" if t > 1 and s > 1 else "keys" if s > 1 else "rows"
    return LogitArray(kind=kind, is_mask=is_mask, dtype=dtype)


def logit_operand(x, array: LogitArray, seq_q_pad: int, seq_kv_pad: int) -> jax.Array:
    """The kernel operand of canonical ``x`` [B', N', T', S']: [B', N', Tp, Sp] (tile),
    [B', N', Sp] (keys) or [B', N', Tp] (rows), zero-padded to whole blocks (padded keys
    are hidden by the MaskSpec, padded rows dropped).

    An array constant over queries and keys ([B', N', 1, 1]) is expanded along the queries
    (B'·N'·T elements, small), so that it is read as rows.
    """
    x = x.astype(array.dtype)
    b, n = x.shape[:2]
    if array.kind == "tile":
        return pad_axis(pad_axis(x, 2, seq_q_pad), 3, seq_kv_pad)
    if array.kind == "keys":
        return pad_axis(x.reshape(b, n, -1), 2, seq_kv_pad)
    rows = jnp.broadcast_to(x, (b, n, x.shape[2] if x.shape[2] > 1 else seq_q_pad, 1))
    return pad_axis(rows.reshape(b, n, -1), 2, seq_q_pad)



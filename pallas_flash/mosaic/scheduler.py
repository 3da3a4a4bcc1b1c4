"""The tile scheduler of the forward kernels: which work tiles a CTA runs, in what order.

A work tile is ``num_consumers * block_q`` query rows of one (batch, head). Either one CTA
per tile (the launch grid is ``(heads, q_tiles, batch)``), or FA3's persistent kernel: one
CTA per SM that loops over tiles, so that a CTA's fixed costs (pipeline fill, epilogue,
launch) overlap the next tile's loads. Causal rows run heaviest first either way
(FA3 / tokamax's causal load balancing: the last tiles to start are the short ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
from jax import lax

#: Persistent CTAs in interpret mode: few, so that the CPU tests give each several tiles.
INTERPRET_CTAS = 2


class Tile(NamedTuple):
    """One work tile: ``num_consumers * block_q`` query rows of one (batch, head)."""

    batch: jax.Array
    head: jax.Array
    q_tile: jax.Array  # index along the sequence, in CTA-sized tiles


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The work tiles of one call and how CTAs take them.

    Attributes:
      num_q_tiles: tiles along the query sequence.
      reverse_q_tiles: run the tiles of the last query rows first (causal: they are the
        heaviest).
      batch, heads: tiles along those axes.
      persistent_ctas: CTAs that loop over the tiles; 0 for one CTA per tile.
    """

    num_q_tiles: int
    reverse_q_tiles: bool
    batch: int = 1
    heads: int = 1
    persistent_ctas: int = 0

    @property
    def num_tiles(self) -> int:
        return self.batch * self.heads * self.num_q_tiles

    def launch(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(grid, grid_names)`` of ``plgpu.kernel``."""
        if self.persistent_ctas:
            return (self.persistent_ctas,), ("ctas",)
        return (self.heads, self.num_q_tiles, self.batch), ("heads", "q_tiles", "batch")

    def tiles(self) -> tuple[jax.Array | int, Callable[[jax.Array | int], Tile]]:
        """This CTA's work tiles: ``(count, tile_at)``, ``tile_at(i)`` the i-th one.

        One CTA per tile: the grid's indices, one tile. Persistent CTAs: tiles are numbered
        in the order that grid launches its CTAs (Pallas makes the last grid axis CUDA's
        fastest: batch, then q tiles, then heads), and CTA c takes tiles c, c + num_ctas,
        ... That order matters: the tiles running at one time then share a head, hence the
        K/V blocks they stream, which stay in L2.
        """
        def tile(batch, head, q_tile):
            if self.reverse_q_tiles:
                q_tile = self.num_q_tiles - 1 - q_tile
            return Tile(batch, head, q_tile)

        if not self.persistent_ctas:
            only = tile(lax.axis_index("batch"), lax.axis_index("heads"),
                        lax.axis_index("q_tiles"))
            return 1, lambda i: only
        cta, ctas = lax.axis_index("ctas"), self.persistent_ctas

        def tile_at(i):
            t = cta + i * ctas
            rest = lax.div(t, self.batch)
            return tile(lax.rem(t, self.batch), lax.div(rest, self.num_q_tiles),
                        lax.rem(rest, self.num_q_tiles))
        return lax.div(self.num_tiles - cta + ctas - 1, ctas), tile_at


def for_each_tile(count, body, init):
    """``body(i, carry)`` for the CTA's tiles ``i < count``; a plain call for one tile."""
    if isinstance(count, int) and count == 1:
        return body(0, init)
    return lax.fori_loop(0, count, body, init)


def persistent_ctas(num_tiles: int, *, interpret: bool) -> int:
    """CTAs of a persistent launch: one per streaming multiprocessor of the first GPU (one
    CTA fills an SM: 3-4 warpgroups at up to 232 registers per thread), at most one per
    tile; few in interpret mode (:data:`INTERPRET_CTAS`)."""
    # 132 (H100/H200 SXM) where the device does not say, e.g. when lowering on a CPU.
    sm_count = getattr(jax.devices()[0], "core_count", 132)
    return min(num_tiles, INTERPRET_CTAS if interpret else sm_count)

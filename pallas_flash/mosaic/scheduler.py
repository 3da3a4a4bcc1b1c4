"""The tile scheduler of the forward kernels: which work tiles a CTA runs, in what order.

A work tile is ``num_consumers * block_q`` query rows of one (batch, head). Either one CTA
per tile (the launch grid is ``(heads, q_tiles, batch)``), or FA3's persistent kernel: one
CTA per SM that loops over tiles, so that a CTA's fixed costs (pipeline fill, epilogue,
launch) overlap the next tile's loads. Causal rows run heaviest first either way
(FA3 / tokamax's causal load balancing: the last tiles to start are the short ones).

A persistent CTA's tiles are fixed before launch, so under a causal mask they must add up
to the same work on every CTA: there the CTAs take *pairs* of one (batch, head)'s q tiles,
the k-th heaviest with the k-th lightest (``n - 1 - k`` and ``k`` of ``n`` tiles, together
``n + 1`` tiles' worth of key blocks whatever ``k``), heavier first. Handing out single
tiles in turn instead gives some CTAs only long tiles and others only short ones.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
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

    @property
    def pairs_tiles(self) -> bool:
        """Whether a persistent CTA takes causal tiles in balanced pairs (an even count)."""
        return self.reverse_q_tiles and self.num_q_tiles % 2 == 0

    @property
    def num_units(self) -> int:
        """Units of work a persistent CTA takes whole: pairs of tiles or single tiles."""
        return self.num_tiles // 2 if self.pairs_tiles else self.num_tiles

    def launch(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(grid, grid_names)`` of ``plgpu.kernel``."""
        if self.persistent_ctas:
            return (self.persistent_ctas,), ("ctas",)
        return (self.heads, self.num_q_tiles, self.batch), ("heads", "q_tiles", "batch")

    def tiles(self) -> tuple[jax.Array | int, Callable[[jax.Array | int], Tile]]:
        """This CTA's work tiles: ``(count, tile_at)``, ``tile_at(i)`` the i-th one.

        One CTA per tile: the grid's indices, one tile. Persistent CTAs:
        :meth:`persistent_tile`.
        """
        if not self.persistent_ctas:
            batch, head = lax.axis_index("batch"), lax.axis_index("heads")
            only = Tile(batch, head, self._in_order(lax.axis_index("q_tiles")))
            return 1, lambda i: only
        cta = lax.axis_index("ctas")
        return self.persistent_count(cta), functools.partial(self.persistent_tile, cta)

    def _in_order(self, q_tile):
        """The q tile run ``q_tile``-th along the sequence: the last rows first if
        ``reverse_q_tiles``."""
        return self.num_q_tiles - 1 - q_tile if self.reverse_q_tiles else q_tile

    def persistent_count(self, cta):
        """How many tiles persistent CTA ``cta`` runs (it takes units cta, cta + ctas, ...)."""
        ctas = self.persistent_ctas
        units = lax.div(self.num_units - cta + ctas - 1, ctas)
        return 2 * units if self.pairs_tiles else units

    def persistent_tile(self, cta, i) -> Tile:
        """The ``i``-th tile of persistent CTA ``cta``.

        Units are numbered in the order the one-CTA-per-tile grid launches its CTAs (Pallas
        makes the last grid axis CUDA's fastest: batch, then q tiles or pairs, then heads),
        and CTA c takes units c, c + num_ctas, ... That order matters: the tiles running at
        one time then share a head, hence the K/V blocks they stream, which stay in L2.
        """
        if not self.pairs_tiles:
            t = cta + i * self.persistent_ctas
            rest = lax.div(t, self.batch)
            return Tile(lax.rem(t, self.batch), lax.div(rest, self.num_q_tiles),
                        self._in_order(lax.rem(rest, self.num_q_tiles)))
        half = self.num_q_tiles // 2
        unit = cta + lax.div(i, 2) * self.persistent_ctas
        rest = lax.div(unit, self.batch)
        k = lax.rem(rest, half)
        # The pair's heavier tile (the later rows) first: its loads start the CTA's ring.
        q_tile = jnp.where(lax.rem(i, 2) == 0, self.num_q_tiles - 1 - k, k)
        return Tile(lax.rem(unit, self.batch), lax.div(rest, half), q_tile)


def for_each_tile(count, body, init):
    """``body(i, carry)`` for the CTA's tiles ``i < count``; a plain call for one tile."""
    if isinstance(count, int) and count == 1:
        return body(0, init)
    return lax.fori_loop(0, count, body, init)


def persistent_ctas(grid: TileGrid, *, interpret: bool) -> int:
    """CTAs of a persistent launch of ``grid``'s tiles: one per streaming multiprocessor of
    the first GPU (one CTA fills an SM: 3-4 warpgroups at up to 232 registers per thread),
    at most one per unit of work (:attr:`TileGrid.num_units`); few in interpret mode
    (:data:`INTERPRET_CTAS`)."""
    # 132 (H100/H200 SXM) where the device does not say, e.g. when lowering on a CPU.
    sm_count = getattr(jax.devices()[0], "core_count", 132)
    return min(grid.num_units, INTERPRET_CTAS if interpret else sm_count)

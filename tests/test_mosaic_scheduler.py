"""The forward kernels' tile scheduler (:mod:`pallas_flash.mosaic.scheduler`).

A persistent CTA's tiles are fixed at launch. These tests enumerate every CTA's tiles on the
host: each work tile must run exactly once, and under a causal mask every CTA must get
about the same number of key blocks (the kernels' own interpret-mode tests run persistent
CTAs end to end, in tests/test_mosaic.py and tests/test_fp8_kernel.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from pallas_flash.mosaic.scheduler import INTERPRET_CTAS, TileGrid, persistent_ctas


def _cta_tiles(grid: TileGrid) -> list[list[tuple[int, int, int]]]:
    """Every persistent CTA's tiles, in order, as (batch, head, q_tile) ints."""
    out = []
    for cta in range(grid.persistent_ctas):
        count = int(grid.persistent_count(cta))
        out.append([tuple(int(x) for x in grid.persistent_tile(cta, i))
                    for i in range(count)])
    return out


@pytest.mark.parametrize("num_q_tiles", [1, 2, 5, 8, 32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("batch", "heads", "ctas"), [(1, 1, 1), (3, 2, 4), (4, 16, 132),
                                                      (2, 3, 7)])
def test_every_tile_runs_once(num_q_tiles, causal, batch, heads, ctas):
    grid = TileGrid(num_q_tiles=num_q_tiles, reverse_q_tiles=causal, batch=batch, heads=heads)
    grid = dataclasses.replace(grid, persistent_ctas=min(ctas, grid.num_units))
    ran = [tile for tiles in _cta_tiles(grid) for tile in tiles]
    expected = [(b, h, q) for b in range(batch) for h in range(heads)
                for q in range(num_q_tiles)]
    assert sorted(ran) == expected
    assert all(_cta_tiles(grid)), "a CTA without tiles"


@pytest.mark.parametrize(("batch", "heads", "num_q_tiles"), [(4, 16, 32), (1, 16, 128),
                                                             (16, 16, 8)])
def test_causal_tiles_balance_work(batch, heads, num_q_tiles):
    """Key blocks per CTA (q tile t of a causal row sees t + 1 blocks): no CTA does more
    than a whole pair (n + 1 blocks) above the mean."""
    grid = TileGrid(num_q_tiles=num_q_tiles, reverse_q_tiles=True, batch=batch, heads=heads)
    grid = dataclasses.replace(grid, persistent_ctas=persistent_ctas(grid, interpret=False))
    work = [sum(q + 1 for _, _, q in tiles) for tiles in _cta_tiles(grid)]
    mean = batch * heads * num_q_tiles * (num_q_tiles + 1) / 2 / len(work)
    assert max(work) <= mean + num_q_tiles + 1, (max(work), mean)
    # Heaviest tile of a pair first: the CTA's first tile is one of the longest rows.
    assert all(tiles[0][2] >= num_q_tiles // 2 for tiles in _cta_tiles(grid))


def test_persistent_launch_has_no_idle_cta():
    grid = TileGrid(num_q_tiles=4, reverse_q_tiles=True, batch=1, heads=1)
    assert persistent_ctas(grid, interpret=False) == 2  # two pairs of tiles
    assert persistent_ctas(dataclasses.replace(grid, reverse_q_tiles=False),
                           interpret=False) == 4
    assert persistent_ctas(dataclasses.replace(grid, heads=64),
                           interpret=True) == INTERPRET_CTAS

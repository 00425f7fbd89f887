"""Python twin of the drawn tile order's counter protocol (kernels_cu/sm90/tile_feed.cuh, TileSource):
CTAs interleaved at random, each taking its first tile statically and drawing the next one after each
tile (t = atomicAdd(counter, 1) + grid) until a draw fails; the draw that returns tiles - 1 stores 0.
Every tile runs exactly once, and the counter ends at 0 for the next launch on the stream."""
from __future__ import annotations

import random

import pytest


def run_launch(tiles: int, grid: int, counter: list, rng: random.Random) -> list:
    """One launch; returns the tiles in the order they started. counter: a one-element list (the word)."""
    assert 1 <= grid <= tiles  # the plan's grid: min(tiles, SMs)
    current = {cta: cta for cta in range(grid)}  # each CTA's first tile: blockIdx.x
    started = []
    while current:
        cta = rng.choice(sorted(current))  # any CTA may be the next to finish its tile
        started.append(current[cta])
        drawn = counter[0]  # atomicAdd(counter, 1)
        counter[0] += 1
        if drawn == tiles - 1:  # the launch's last draw
            counter[0] = 0
        nxt = drawn + grid
        if nxt >= tiles:
            del current[cta]  # its draw failed: it publishes the end
        else:
            current[cta] = nxt
    return started


@pytest.mark.parametrize("tiles,grid", [(1, 1), (5, 5), (6, 1), (200, 3), (1000, 132), (133, 132), (2048, 132)])
def test_every_tile_runs_once_and_the_counter_returns_to_zero(tiles, grid):
    rng = random.Random(tiles * 1000 + grid)
    counter = [0]
    for _ in range(5):  # launches in a row on one stream, each finding the word at 0
        started = run_launch(tiles, grid, counter, rng)
        assert sorted(started) == list(range(tiles))
        assert counter == [0]


"""NumPy twin of kernels_cu/attn/tile_order.cuh (the sm90 forward's causal tile order): every work
tile is visited exactly once, each rank holds the same block of every (batch, head), and a grid
that strides over the order gives every CTA a near-equal share of the causal work."""
import numpy as np
import pytest


def heaviest_first(tile, n_blocks, bh_count, n_heads):
    """(block, batch, head) of `tile`, as schedule_tiles_heaviest_first."""
    rank = tile // bh_count
    bh = tile - rank * bh_count
    return n_blocks - 1 - rank, bh // n_heads, bh % n_heads


@pytest.mark.parametrize("n_blocks,batch,heads", [(1, 1, 1), (16, 8, 16), (128, 1, 16), (7, 3, 5)])
def test_every_tile_once_heaviest_first(n_blocks, batch, heads):
    bh = batch * heads
    seen = [heaviest_first(t, n_blocks, bh, heads) for t in range(n_blocks * bh)]
    assert len(set(seen)) == n_blocks * bh
    assert all(0 <= b < n_blocks and 0 <= x < batch and 0 <= h < heads for b, x, h in seen)
    blocks = [b for b, _, _ in seen]
    assert blocks == sorted(blocks, reverse=True)  # non-increasing: the heaviest blocks first


@pytest.mark.parametrize("n_blocks,batch,heads,grid", [(128, 1, 16, 132), (16, 8, 16, 132), (64, 2, 16, 132)])
def test_strided_grid_balances_causal_work(n_blocks, batch, heads, grid):
    """Causal: block i of a head visits i + 1 key blocks. Striding the heaviest-first order keeps the
    busiest CTA within ~one tile of the mean; the block-fastest order would not."""
    bh = batch * heads
    tiles = n_blocks * bh
    work = np.zeros(grid)
    for t in range(tiles):
        block, _, _ = heaviest_first(t, n_blocks, bh, heads)
        work[t % grid] += block + 1
    busiest, mean = work.max(), work.sum() / min(grid, tiles)
    assert busiest <= mean + n_blocks
    block_fastest = np.zeros(grid)
    for t in range(tiles):
        block_fastest[t % grid] += (n_blocks - 1 - t % n_blocks) + 1
    assert busiest <= block_fastest.max()

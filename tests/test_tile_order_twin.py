"""NumPy twin of kernels_cu/attn/tile_order.cuh (the sm90 forward's causal tile order): every work
tile is visited exactly once, each rank of a section holds the same block of each of the section's
(batch, head)s, a grid that strides over the order gives every CTA a near-equal share of the causal
work, and the CTAs resident together touch few heads' K/V (the sections)."""
import numpy as np
import pytest

KV_HEADS = 32  # kSectionKVHeads


def section_heads(gqa, bh_count):
    """section_heads of tile_order.cuh."""
    return min(bh_count, KV_HEADS * max(gqa, 1))


def heaviest_first(tile, n_blocks, bh_count, n_heads, sec=None):
    """(block, batch, head) of `tile`, as schedule_tiles_heaviest_first (sec None: one section)."""
    sec = bh_count if sec is None else sec
    per_section = n_blocks * sec
    section = tile // per_section
    first = section * sec
    heads_in = min(sec, bh_count - first)
    rem = tile - section * per_section
    rank = rem // heads_in
    bh = first + rem - rank * heads_in
    return n_blocks - 1 - rank, bh // n_heads, bh % n_heads


SHAPES = [(1, 1, 1), (16, 8, 16), (128, 1, 16), (7, 3, 5), (4, 32, 16)]


@pytest.mark.parametrize("sec", [None, 1, 3, 8, 32])
@pytest.mark.parametrize("n_blocks,batch,heads", SHAPES)
def test_every_tile_once_heaviest_first_per_section(n_blocks, batch, heads, sec):
    bh = batch * heads
    seen = [heaviest_first(t, n_blocks, bh, heads, sec) for t in range(n_blocks * bh)]
    assert len(set(seen)) == n_blocks * bh
    assert all(0 <= b < n_blocks and 0 <= x < batch and 0 <= h < heads for b, x, h in seen)
    s = bh if sec is None else min(sec, bh)
    for start in range(0, n_blocks * bh, n_blocks * s):  # within each section: the heaviest blocks first
        blocks = [b for b, _, _ in seen[start:start + n_blocks * s]]
        assert blocks == sorted(blocks, reverse=True)
        heads_of = {x * heads + h for _, x, h in seen[start:start + n_blocks * s]}
        assert len(heads_of) == min(s, bh - start // n_blocks)  # the section's own (batch, head)s


@pytest.mark.parametrize("n_blocks,batch,heads", SHAPES)
def test_one_section_is_the_rank_by_rank_order(n_blocks, batch, heads):
    bh = batch * heads
    for t in range(n_blocks * bh):
        rank = t // bh
        assert heaviest_first(t, n_blocks, bh, heads, bh) == (n_blocks - 1 - rank, (t % bh) // heads, (t % bh) % heads)
        assert heaviest_first(t, n_blocks, bh, heads, 10 * bh) == heaviest_first(t, n_blocks, bh, heads, bh)


def test_section_heads():
    assert section_heads(1, 128) == 32
    assert section_heads(1, 16) == 16  # fewer (batch, head)s than a section: one section
    assert section_heads(4, 128) == 128  # GQA: 32 K/V heads of 4 query heads each
    assert section_heads(0, 5) == 5


CAUSAL_GRIDS = [(128, 1, 16, 132), (16, 8, 16, 132), (64, 2, 16, 132), (4, 32, 16, 132), (32, 4, 16, 132)]


@pytest.mark.parametrize("n_blocks,batch,heads,grid", CAUSAL_GRIDS)
def test_strided_grid_balances_causal_work(n_blocks, batch, heads, grid):
    """Causal: block i of a head visits i + 1 key blocks. Striding the heaviest-first order (one
    section: the kernel gives a strided grid no others) keeps the busiest CTA within ~one tile of the
    mean; the block-fastest order would not."""
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


def test_resident_ctas_share_heads():
    """d128 N2048 causal at 16k tokens (8 x 16 heads, 16 query blocks of 128), 132 CTAs drawing in
    order: any 132 consecutive tiles hold at most ~section heads' K/V, where one section held ~one
    tile of 128 different heads."""
    n_blocks, bh, grid = 16, 128, 132
    sec = section_heads(1, bh)
    def widest(order_sec):
        tiles = [heaviest_first(t, n_blocks, bh, 16, order_sec) for t in range(n_blocks * bh)]
        return max(len({x * 16 + h for _, x, h in tiles[i:i + grid]}) for i in range(0, len(tiles) - grid))

    assert sec <= 32
    assert widest(sec) <= 2 * sec
    assert widest(bh) > 2 * sec  # one section: the resident CTAs span (nearly) every (batch, head)


@pytest.mark.parametrize("n_blocks,batch,heads,grid", CAUSAL_GRIDS)
def test_drawn_sections_balance_causal_work(n_blocks, batch, heads, grid):
    """CTAs drawing the sectioned order as they free up (the drawn order; one CTA per tile likewise)
    finish within ~one heavy tile of the ideal: the tail is the last section's lightest tiles."""
    import heapq

    bh = batch * heads
    sec = section_heads(1, bh)
    free = [(0.0, c) for c in range(grid)]
    for t in range(n_blocks * bh):
        block, _, _ = heaviest_first(t, n_blocks, bh, heads, sec)
        at, c = heapq.heappop(free)
        heapq.heappush(free, (at + block + 1, c))
    makespan = max(at for at, _ in free)
    ideal = n_blocks * (n_blocks + 1) / 2 * bh / grid
    assert makespan <= ideal + n_blocks

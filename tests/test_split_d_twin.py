"""A Python twin of the split-head-dim Hopper backward's shared-memory addressing (kernels_cu/sm90/bwd.cuh,
Sm90BwdTraits::kSplitD, head_dim 256): the P^T and dS^T images both consumers write (rows = the
CTA's 64 keys, 128-byte rows of 64 queries, 128-byte swizzle: wgmma's K-major A layout for dV and
dK, MN-major for dQ), and the dK/dV epilogue's staging and copy. Each written element must land
where the canonical swizzled layout puts it, every element exactly once across the two consumers.
The formulas below are the kernel's, term for term (warp w, lane = 4 g + t, consumer cw)."""
from __future__ import annotations

import itertools

D, BR, BC, QN = 256, 64, 64, 32  # head_dim, queries a block, keys a CTA, queries a consumer's S^T


def canonical(row: int, col: int) -> int:
    """Byte offset of bf16 element (row, col) in a [rows][64] image with 128-byte rows, 128-byte
    swizzle: 16-byte chunk col / 8 XOR row % 8."""
    return row * 128 + (((col // 8) ^ (row % 8)) << 4) + (col % 8) * 2


def threads():
    for cw, w, lane in itertools.product(range(2), range(4), range(32)):
        yield cw, w, lane // 4, lane % 4


def chunk(cw: int, g: int, t: int, nt: int) -> int:  # the kernel's slot_at(rows, nt) - rows
    return ((((QN // 8) * cw + nt) ^ g) << 4) + 4 * t


def test_p_image_stores_cover_the_swizzled_layout_once():
    """P^T from p_frag: register r of k16 step kk holds the pair (half r % 2 of n8 tile 2 kk + r / 2)."""
    seen = {}
    for cw, w, g, t in threads():
        for kk, r in itertools.product(range(QN // 16), range(4)):
            addr = (16 * w + g) * 128 + 8 * (r % 2) * 128 + chunk(cw, g, t, 2 * kk + r // 2)
            row = 16 * w + g + 8 * (r % 2)
            col = QN * cw + 8 * (2 * kk + r // 2) + 2 * t
            for e in range(2):
                assert addr + 2 * e == canonical(row, col + e)
                assert (row, col + e) not in seen
                seen[(row, col + e)] = addr + 2 * e
    assert len(seen) == BC * BR


def test_ds_image_stores_cover_the_swizzled_layout_once():
    """dS^T (and softcap's parked P o grad) from acc_dp's layout: element (nt, 2 half + e)."""
    seen = set()
    for cw, w, g, t in threads():
        for nt, half in itertools.product(range(QN // 8), range(2)):
            addr = (16 * w + g) * 128 + 8 * half * 128 + chunk(cw, g, t, nt)
            row, col = 16 * w + g + 8 * half, QN * cw + 8 * nt + 2 * t
            assert addr == canonical(row, col)
            seen |= {(row, col), (row, col + 1)}
    assert len(seen) == BC * BR


def test_lse_and_delta_rows_are_the_consumers_queries():
    """lrow / drow: the float of query 32 cw + 8 nt + 2 t (and the next) of the block."""
    for cw, _, _, t in threads():
        for nt in range(QN // 8):
            assert (4 * QN * cw + 8 * t + 32 * nt) // 4 == QN * cw + 8 * nt + 2 * t


def test_epilogue_staging_and_copy_cover_every_row_and_column_once():
    """Each consumer stages its column half of all 64 rows, then copies 32 whole rows."""
    pitch = D * 2 + 16
    staged = set()
    for cw, w, g, t in threads():
        srow = (16 * w + g) * pitch + cw * (D // 2) * 2 + 4 * t
        for half, nt in itertools.product(range(2), range(D // 2 // 8)):
            off = srow + 8 * half * pitch + 16 * nt
            row, col = divmod(off, pitch)
            assert row == 16 * w + g + 8 * half and col == cw * D + 16 * nt + 4 * t
            staged.add((row, col // 2))  # a bf16 pair: columns col / 2 and col / 2 + 1
    assert {(r, c + e) for r, c in staged for e in range(2)} == {(r, c) for r in range(BC) for c in range(D)}
    ch, rows_per_pass, rows_per_wg = D // 8, 128 // (D // 8), BC // 2
    copied = set()
    for cw, ctid in itertools.product(range(2), range(128)):
        for p in range(rows_per_wg // rows_per_pass):
            r = rows_per_wg * cw + p * rows_per_pass + ctid // ch
            copied |= {(r, 8 * (ctid % ch) + e) for e in range(8)}
    assert copied == {(r, c) for r in range(BC) for c in range(D)}


def test_smem_mirror_matches_the_traits():
    """tiles.Sm90BwdConfig.smem_bytes at d256: K, V, two Q / dO stages, the P^T image, two dS^T
    images, lse2 / delta, the alignment KiB and the static barriers' KiB; within 227 KiB."""
    from cuflash.tiles import Sm90BwdConfig

    cfg = Sm90BwdConfig(256, 64, 2, 2, 0, 0)
    assert cfg.split_d and cfg.block_k == BC
    k_v, q_do, p, ds, stats = 2 * BC * D * 2, 2 * 2 * BR * D * 2, BC * BR * 2, 2 * BC * BR * 2, 2 * 2 * BR * 4
    assert cfg.smem_bytes == k_v + q_do + p + ds + stats + 2048 <= 227 * 1024
    assert cfg.structural_problem() is None
    assert "dq_bulk 0" in Sm90BwdConfig(256, 64, 2, 2, 4, 1).structural_problem()


def test_dq_staging_over_the_stage_touches_only_its_consumers_column_half():
    """Sm90BwdTraits::kDqInStage (dq_bulk 4): consumer cw stages dQ chunk jj (64 x 64 fp32, fragment
    order: float4 nt of thread ctid at (nt 128 + ctid) 16) at (jj ? dO : Q) image + cw x 16 KB. That
    must be exactly the bytes of its own column half of the image (chunks 2 cw, 2 cw + 1 of the
    [D / 64 chunk][BR rows][64] layout), which only its dK / dV read after the dS^T barrier, never the
    other consumer's half; and the epilogue's dK / dV staging reaches into stage 0's Q image (why
    the consumers wait for the store warp's frees before it)."""
    q_chunk, frag = BR * 128, 64 * 64 * 4
    for cw in range(2):
        staged = {16 * ctid + nt * 128 * 16 + b for ctid in range(128) for nt in range(8) for b in range(16)}
        assert staged == set(range(frag))  # the fragment order fills its 16 KB once
        # what this consumer's dK (B: Q) and dV (B: dO) read: the kernel's colh (cw x kColsWg / 64
        # chunks, in bytes) and kColsWg / 64 chunks from there
        chunks = (D // 2) // 64
        colh = cw * chunks * q_chunk
        assert {cw * frag + b for b in staged} == set(range(colh, colh + chunks * q_chunk))
    k_v = 2 * BC * D * 2
    assert 2 * BC * (D * 2 + 16) > k_v  # the epilogue's staging overruns K and V into stage 0's Q


def test_dq_bulk_4_split_tile_keeps_the_shared_memory_of_the_atomic_one():
    from cuflash.tiles import Sm90BwdConfig

    atomic, staged = Sm90BwdConfig(256, 64, 2, 2, 0, 0), Sm90BwdConfig(256, 64, 2, 2, 4, 0)
    assert staged.structural_problem() is None and staged.smem_bytes == atomic.smem_bytes
    assert "dq_bulk 0 or 4" in Sm90BwdConfig(256, 64, 2, 2, 2, 0).structural_problem()

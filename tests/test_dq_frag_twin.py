"""NumPy twin of the sm90 backward's fragment-order dQ workspace (kernels_cu/sm90/bwd.cuh, dq_bulk 2 and 4)
for variable-length batches and of the kernel that reads it back, bwd_dq_convert_frag_varlen
(kernels_cu/rowwise/bwd_post.cuh: one thread per row and 8 columns, each sequence's 64-row blocks from
SeqSpan::varlen_ws_row0). The GPU tests check the kernels themselves; this checks the layout's
reasoning on ragged lengths, where a mistake would only show for some of them."""
from __future__ import annotations

import numpy as np
import pytest

ROW_PAD = 128  # SeqSpan::kVarlenRowPad, cuflash/_backward.py's _ROW_PAD


def store_block(ws, row0, c, block, d):
    """A consumer warpgroup's 64 x 64 block (rows row0.., columns 64 c..) stored as its bulk reduction
    writes it: thread ctid's acc_dq[nt][0..3] (rows 16 warp + g and + 8, columns 8 nt + 2 t, + 1) at
    float4 nt * 128 + ctid of the block at floats row0 * d + c * 4096."""
    base = row0 * d + c * 4096
    for ctid in range(128):
        warp, g, t = ctid // 32, ctid % 32 // 4, ctid % 4
        for nt in range(8):
            r, col = 16 * warp + g, 8 * nt + 2 * t
            ws[base + 4 * (nt * 128 + ctid): base + 4 * (nt * 128 + ctid) + 4] = (
                block[r, col], block[r, col + 1], block[r + 8, col], block[r + 8, col + 1])


def convert_frag_varlen(ws, row0_of_seq, seqlen, d):
    """bwd_dq_convert_frag_varlen's reads for one (sequence, head): row i, columns 8 c8 .. + 7."""
    out = np.zeros((seqlen, d), np.float32)
    for i in range(seqlen):
        row0 = row0_of_seq + (i & ~63)
        r = i & 63
        half = (r >> 3) & 1
        ctid0 = 32 * (r >> 4) + 4 * (r & 7)
        for c8 in range(d // 8):
            blk = row0 * d + (c8 // 8) * 4096
            nt = c8 % 8
            for t in range(4):
                a = ws[blk + 4 * (nt * 128 + ctid0 + t): blk + 4 * (nt * 128 + ctid0 + t) + 4]
                out[i, 8 * c8 + 2 * t: 8 * c8 + 2 * t + 2] = (a[2], a[3]) if half else (a[0], a[1])
    return out


def varlen_ws_row0(q_start, b, h, pad):
    return h * pad + ((q_start + ROW_PAD * b) & ~(ROW_PAD - 1))


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_fragment_blocks_read_back_row_major(d):
    """Ragged sequences (0, 1, 17, 64, 65, 200 rows) and two heads: every sequence's blocks written in
    fragment order at its workspace rows read back as its rows; no block reaches another sequence's."""
    rng = np.random.default_rng(d)
    lens = [0, 1, 17, 64, 65, 200]
    cu = np.concatenate([[0], np.cumsum(lens)])
    heads = 2
    pad = -(-(cu[-1] + ROW_PAD * len(lens)) // ROW_PAD) * ROW_PAD  # _backward.varlen_ws_rows_per_head
    ws = np.full(heads * pad * d, np.nan, np.float32)
    owner = np.full(heads * pad * d, -1)
    want = {}
    for h in range(heads):
        for b, n in enumerate(lens):
            row0 = varlen_ws_row0(int(cu[b]), b, h, pad)
            assert row0 % 64 == 0
            rows = -(-n // 64) * 64
            full = rng.standard_normal((max(rows, 0), d)).astype(np.float32)
            for m in range(rows // 64):
                for c in range(d // 64):
                    store_block(ws, row0 + 64 * m, c, full[64 * m: 64 * m + 64, 64 * c: 64 * c + 64], d)
            span = slice(row0 * d, (row0 + rows) * d)
            assert (owner[span] == -1).all(), "a sequence's blocks overlap another's"
            owner[span] = b
            assert row0 + rows <= (h + 1) * pad
            want[h, b] = (row0, full[:n])
    for (h, b), (row0, rows) in want.items():
        np.testing.assert_array_equal(convert_frag_varlen(ws, row0, len(rows), d), rows)


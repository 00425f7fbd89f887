"""Block masks for mask snippets (cuflash.BlockMask, issue 13) on the GPU: the cells and lists
passes against the NumPy twin (cuflash.testing.block_mask_reference, itself checked against the
definition on the CPU), and attention with a block mask against the same call without it, bit for
bit (a skipped block is one whose every score the snippet masks: it would add nothing), and against
the float64 reference with FlashAttention's 2x rule: documents, a band, per-head masks, broadcast
batch and heads, with causal and windows, both dtypes, head dims 64 and 128. Outputs poisoned."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import cuflash
from cuflash.mask import MaskOptions
from cuflash.testing import block_mask_reference, dtype_of, fa_rule, random_qkv

pytestmark = pytest.mark.gpu


def _docs(rng, n, mean_len):
    """Document ids of n packed tokens (lengths around mean_len), as int32 CuPy and NumPy arrays."""
    import cupy

    lens = rng.integers(max(1, mean_len // 3), 2 * mean_len, n)
    ids = np.repeat(np.arange(n), lens)[:n].astype(np.int32)
    return cupy.asarray(ids), ids


def _cells_of(bm, bits=None):
    """The BlockMask's cells (or `bits`, its full cells) as bool (bh, query cells, key cells)."""
    import cupy

    bits = cupy.asnumpy(bm.cells if bits is None else bits)
    unpacked = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little").astype(bool)
    return unpacked[..., :-(-bm.seqlen_k // 16)]


@pytest.mark.parametrize("nq,nk,mean_len", [(1000, 1000, 130), (777, 1213, 60), (64, 64, 5), (5000, 5000, 700)])
def test_cells_and_lists_match_the_twin(nq, nk, mean_len):
    import cupy

    rng = np.random.default_rng(zlib.crc32(repr((nq, nk, mean_len)).encode()))
    dq, dq_np = _docs(rng, nq, mean_len)
    dk_np = dq_np[:nk] if nk <= nq else np.concatenate([dq_np, np.full(nk - nq, dq_np[-1] + 1, np.int32)])
    dk = cupy.asarray(dk_np)
    mod = cuflash.ScoreMod(mask="dq[q_idx] == dk[kv_idx]", aux={"dq": dq, "dk": dk})
    bm = mod.block_mask(1, 1, nq, nk)
    keep = (dq_np[:, None] == dk_np[None, :])[None, None]
    for bq, bk in ((128, 96), (64, 64), (128, 128), (192, 176)):
        cells, full, counts, index = block_mask_reference(keep, bq, bk)
        assert (_cells_of(bm) == cells).all() and (_cells_of(bm, bm.full_cells) == full).all()
        got_c, got_i = (cupy.asnumpy(a) for a in bm.lists(bq, bk))
        assert (got_c == counts).all(), (bq, bk)
        for i in range(counts.shape[1]):
            assert (got_i[0, i, :counts[0, i]] == index[0, i, :counts[0, i]]).all(), (bq, bk, i)
    assert 0 < bm.density() < 1


def test_per_head_masks_and_batches():
    """A mask that reads b and h: (batch, heads) of its own, each row of lists its (b, h)'s."""
    import cupy

    b, h, n = 2, 3, 300
    mod = cuflash.ScoreMod(mask="(kv_idx / 32) % (h + 2) == b")
    bm = mod.block_mask(b, h, n, n)
    bb, hh, qi, kj = np.ix_(np.arange(b), np.arange(h), np.arange(n), np.arange(n))
    keep = np.broadcast_to((kj // 32) % (hh + 2) == bb, (b, h, n, n))
    _, _, counts, index = block_mask_reference(keep, 64, 64)
    got_c, got_i = (cupy.asnumpy(a) for a in bm.lists(64, 64))
    assert (got_c == counts).all() and all((got_i[x, i, :counts[x, i]] == index[x, i, :counts[x, i]]).all()
                                           for x in range(b * h) for i in range(counts.shape[1]))


# (seqlen, mean document length, causal, window)
CASES = [(1024, 150, False, (-1, -1)), (1024, 150, True, (-1, -1)), (777, 40, True, (-1, -1)),
         (1500, 300, False, (200, 50)), (300, 1000, False, (-1, -1))]


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,mean_len,causal,window", CASES)
def test_a_block_mask_gives_the_same_bits(n, mean_len, causal, window, d, dtype, backend):
    from cuflash.testing import backend_unavailable

    why = backend_unavailable(backend)
    if why:
        pytest.skip(why)
    import cupy

    from cuflash import _forward, families

    rng = np.random.default_rng(zlib.crc32(repr((n, mean_len, causal, window, d, dtype)).encode()))
    b, h = 2, 4
    q, k, v = random_qkv(rng, b, n, n, h, d, dtype_of(dtype))
    docs, _ = _docs(rng, n, mean_len)
    mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
    bm = mod.block_mask(1, 1, n, n)
    mask = MaskOptions.of(causal=causal, window_size=window)

    def run(**kw):
        out = cupy.full(q.shape, cupy.nan, dtype=cupy.float32).astype(q.dtype)
        lse = cupy.full((b, h, n), cupy.nan, dtype=cupy.float32)
        return _forward.forward(q, k, v, mask=mask, score_mod=mod, out=out, lse=lse, backend=backend, **kw)

    # the same tile both ways (the automatic choice may differ: a snippet's tile is the first that
    # does not spill, and the block-mask instance has more live registers)
    cfg = (families.FWD_SM90 if backend == "sm90" else families.FWD).default(d)
    out0, lse0 = run(config=cfg)
    out1, lse1 = run(config=cfg, block_mask=bm)
    assert bool((out0.view(cupy.uint16) == out1.view(cupy.uint16)).all())
    assert bool(((lse0 == lse1) | (cupy.isinf(lse0) & cupy.isinf(lse1))).all())
    out2, _ = run(block_mask=bm)  # the automatic tile
    err, pt, allowed = fa_rule(out2, q, k, v, mask, 1 / math.sqrt(d),
                               mods=(None, lambda bb, hh, qi, kj: docs[qi] == docs[kj], None))
    assert err <= allowed, (err, allowed, pt)


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_a_score_snippet_still_runs_on_full_blocks(backend):
    """A modification with a score and a mask snippet: full blocks skip only the mask, so the score
    snippet (here a per-head temperature) still applies there; same bits as without the block mask."""
    import cupy

    from cuflash import _forward
    from cuflash.testing import backend_unavailable

    if backend_unavailable(backend):
        pytest.skip(backend_unavailable(backend))
    rng = np.random.default_rng(13)
    n, h, d = 1024, 4, 128
    q, k, v = random_qkv(rng, 1, n, n, h, d, dtype_of("bfloat16"))
    docs = cupy.asarray((np.arange(n) // 256).astype(np.int32))  # documents of 256: every visited block full
    temp = cupy.asarray(rng.uniform(0.5, 2.0, h).astype(np.float32))
    mod = cuflash.ScoreMod("score * temp[h]", grad="temp[h]", mask="doc[q_idx] == doc[kv_idx]",
                           aux={"doc": docs, "temp": temp})
    bm = mod.block_mask(1, 1, n, n)
    a = _forward.forward(q, k, v, score_mod=mod, backend=backend)
    b = _forward.forward(q, k, v, score_mod=mod, block_mask=bm, backend=backend)
    assert bool((a[0].view(cupy.uint16) == b[0].view(cupy.uint16)).all()) and bool((a[1] == b[1]).all())
    counts, index = (cupy.asnumpy(x) for x in bm.lists(128, 128))
    assert (index[0, :, 0] & cuflash.block_mask.FULL_BLOCK).all()  # the premise: full blocks
    err, pt, allowed = fa_rule(b[0], q, k, v, False, 1 / math.sqrt(d),
                               mods=(lambda s, bb, hh, qi, kj: s * temp.astype(s.dtype)[hh],
                                     lambda bb, hh, qi, kj: docs[qi] == docs[kj], None))
    assert err <= allowed, (err, allowed, pt)


def test_the_public_call_and_its_errors():
    import cupy

    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 512, 512, 2, 64, dtype_of("bfloat16"))
    docs, _ = _docs(rng, 512, 100)
    mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
    bm = mod.block_mask(1, 1, 512, 512)
    out = cuflash.attention(q, k, v, score_mod=mod, block_mask=bm)
    ref = cuflash.attention(q, k, v, score_mod=mod)
    assert bool((out.view(cupy.uint16) == ref.view(cupy.uint16)).all())
    assert bool((cuflash.attention(q, k, v, score_mod=mod, block_mask=bm).view(cupy.uint16)
                 == out.view(cupy.uint16)).all())  # the cached plan, again
    with pytest.raises(ValueError, match="seqlen_q=512, seqlen_k=512; the call has seqlen_q=256"):
        cuflash.attention(q[:, :256], k[:, :256], v[:, :256], score_mod=mod, block_mask=bm)
    with pytest.raises(ValueError, match="another ScoreMod"):
        cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod(mask="true"), block_mask=bm)
    with pytest.raises(ValueError, match="block_mask needs the score_mod"):
        cuflash.attention(q, k, v, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be a cuflash.BlockMask"):
        cuflash.attention(q, k, v, score_mod=mod, block_mask="docs")
    three_heads = mod.block_mask(1, 3, 512, 512)
    with pytest.raises(ValueError, match="heads=3; the call has batch=1, heads=2"):
        cuflash.attention(q, k, v, score_mod=mod, block_mask=three_heads)


@pytest.mark.parametrize("backend,deterministic", [("sm80", False), ("sm80", True), ("sm90", False)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,mean_len,causal,window", CASES[:4])
def test_the_backward_gives_the_same_bits(n, mean_len, causal, window, d, backend, deterministic):
    """dK, dV (and dQ when deterministic) bit for bit as without the block mask (the same dK/dV
    kernel both ways: sm80, or the Hopper one at d128), and all three by the 2x rule against the
    float64 gradients."""
    from cuflash.testing import backend_unavailable

    if backend == "sm90" and (d != 128 or backend_unavailable("sm90")):
        pytest.skip("the Hopper backward: d128 on a cc 9.0 GPU")
    import cupy

    from cuflash import _backward, _forward
    from cuflash.testing import fa_rule_grads

    rng = np.random.default_rng(zlib.crc32(repr((n, mean_len, causal, window, d, deterministic, "bwd")).encode()))
    b, h = 2, 4
    q, k, v = random_qkv(rng, b, n, n, h, d, dtype_of("bfloat16"))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    docs, _ = _docs(rng, n, mean_len)
    mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
    bm = mod.block_mask(1, 1, n, n)
    mask = MaskOptions.of(causal=causal, window_size=window)
    out, lse = _forward.forward(q, k, v, mask=mask, score_mod=mod, block_mask=bm)
    kw = dict(mask=mask, score_mod=mod, deterministic=deterministic, backend=backend)
    g0 = _backward.backward(dout, q, k, v, out, lse, **kw)
    g1 = _backward.backward(dout, q, k, v, out, lse, block_mask=bm, **kw)
    same = [bool((a.view(cupy.uint16) == c.view(cupy.uint16)).all()) for a, c in zip(g0, g1)]
    assert same[1] and same[2] and (same[0] or not deterministic), same
    mods = (None, lambda bb, hh, qi, kj: docs[qi] == docs[kj], None)
    for name, (err, pt, allowed) in fa_rule_grads(g1, q, k, v, dout, mask, 1 / math.sqrt(d), mods=mods).items():
        assert err <= allowed, (name, err, allowed, pt)


def test_torch_autograd_through_a_block_mask(monkeypatch):
    torch = pytest.importorskip("torch")
    from cuflash import families

    # backend= picks the forward; the backward's kernel follows CUFLASH_BACKEND: sm80 for both calls
    # (the Hopper backward's deterministic mode takes no block mask, so the masked call would run
    # sm80's and the other the Hopper one's: other fp32 orders)
    monkeypatch.setenv(families.BACKEND_ENV, "sm80")
    rng = np.random.default_rng(8)
    mk = lambda: torch.from_numpy(rng.standard_normal((1, 256, 2, 64)).astype(np.float32)).to("cuda", torch.bfloat16)
    q, k, v, dout = mk(), mk(), mk(), mk()
    docs = torch.from_numpy(np.repeat(np.arange(8), 32).astype(np.int32)).cuda()
    mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": docs})
    bm = mod.block_mask(1, 1, 256, 256)
    grads = []
    for extra in ({}, {"block_mask": bm}):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = cuflash.attention(*x, score_mod=mod, backend="sm80", deterministic=True, **extra)
        out.backward(dout)
        grads.append((out.detach(), *(t.grad for t in x)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_million_query_cells_fit_the_cells_grid():
    """seqlen_q past 65,535 query cells (1M + 16 tokens: 65,537 cells) builds: the cells pass puts the
    query cells on the grid's x (issue 14: grids beyond 65,535 blocks in any dimension)."""
    import cupy

    nq, nk = (1 << 20) + 16, 40
    mod = cuflash.ScoreMod(mask="(q_idx & 31) >= kv_idx")  # rows see 0..31 keys; k >= 32 never kept
    bm = mod.block_mask(1, 1, nq, nk)
    cells = _cells_of(bm)
    assert cells.shape == (1, -(-nq // 16), 3)
    odd = np.arange(cells.shape[1]) % 2 == 1  # query cells of rows with q & 31 in 16..31
    assert cells[0, :, 0].all() and (cells[0, :, 1] == odd).all() and not cells[0, :, 2].any()
    full = _cells_of(bm, bm.full_cells)
    assert (full[0, :, 0] == odd).all() and not full[0, :, 1:].any()
    counts, _ = bm.lists(128, 64)
    assert int(cupy.asnumpy(counts).min()) == 1 and counts.shape == (1, -(-nq // 128))


def test_more_than_65535_batch_head_pairs_grid_axis():
    """A block mask of 70,000 (batch, head) pairs (issue 14: grids beyond 65,535 blocks in any
    dimension): the cells and lists passes stride over the pairs past the grid's y / z limit; the
    cells and lists match the twin, and attention with the mask agrees with the call without it
    (within a bf16 rounding: the automatic tiles may differ), forward and deterministic backward;
    a pair the passes missed would have no listed block and a zero output."""
    import cupy

    batch, heads, n = 35000, 2, 40
    # per (b, h) a band whose width the pair decides: 0, 16 or 32 keys behind the query
    mod = cuflash.ScoreMod(mask="kv_idx <= q_idx && q_idx - kv_idx <= ((b + h) % 3) * 16")
    bm = mod.block_mask(batch, heads, n, n)
    bb, hh = np.meshgrid(np.arange(batch), np.arange(heads), indexing="ij")
    width = ((bb + hh) % 3) * 16
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = (ki <= qi)[None, None] & ((qi - ki)[None, None] <= width[..., None, None])
    cells, full, counts, index = block_mask_reference(keep, 32, 16)
    assert (_cells_of(bm) == cells).all() and (_cells_of(bm, bm.full_cells) == full).all()
    got_c, got_i = (cupy.asnumpy(a) for a in bm.lists(32, 16))
    assert (got_c == counts).all()
    live = np.arange(index.shape[-1])[None, None, :] < counts[..., None]
    assert (np.where(live, got_i, 0) == np.where(live, index, 0)).all()
    q, k, v = random_qkv(np.random.default_rng(70000), batch, n, n, heads, 64, dtype_of("bfloat16"))
    dout = random_qkv(np.random.default_rng(70001), batch, n, 1, heads, 64, dtype_of("bfloat16"))[0]
    outs = []
    for extra in ({}, {"block_mask": bm}):
        out, lse = cuflash.attention(q, k, v, score_mod=mod, return_lse=True, **extra)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=mod, deterministic=True, **extra)
        outs.append((out, *grads))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        a, b = a.astype(cupy.float32), b.astype(cupy.float32)
        assert bool(cupy.isfinite(b).all()), name
        assert float(cupy.abs(a - b).max()) <= 2e-2 * max(1.0, float(cupy.abs(a).max())), name

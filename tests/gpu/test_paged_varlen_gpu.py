"""attention_varlen over paged K/V caches (block_table; flash_attn_varlen_func's paged form;
cuflash/paged_varlen.py): each packed query sequence against its keys scattered into shuffled
pages of a pool. Checked per sequence by FlashAttention's 2x rule against the float64 reference
and against the same call on the packed (unpaged) keys; page sizes 1, 16, 100 and 256; host and
device tables; lengths from cu_seqlens_k and from seqused_k; torch through flash_attn_varlen_func;
gradients refused."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import varlen
from cuflash.mask import MaskOptions
from cuflash.testing import dtype_of, fa_rule
from tests.gpu.test_paged_gpu import _scatter, _table

pytestmark = pytest.mark.gpu

LENS_Q, LENS_K = [17, 0, 113, 1, 64, 5], [40, 5, 300, 1, 64, 0]


def _offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _paged(rng, k, v, lens_k, page_size, hk, d):
    """The packed k, v as (batch, capacity) caches scattered into shuffled pages: (kp, vp, table)."""
    import cupy

    ok = _offsets(lens_k)
    cap = max(max(lens_k), 1)
    dense = [cupy.zeros((len(lens_k), cap, hk, d), dtype=k.dtype) for _ in range(2)]
    for b, n in enumerate(lens_k):
        dense[0][b, :n], dense[1][b, :n] = k[ok[b]:ok[b + 1]], v[ok[b]:ok[b + 1]]
    table, n_pages = _table(rng, len(lens_k), cap, page_size)
    return _scatter(dense[0], table, n_pages, page_size), _scatter(dense[1], table, n_pages, page_size), table


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16, 100, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device_table", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
def test_paged_varlen_matches_each_sequence(h, hk, device_table, causal, page_size, dtype):
    import cupy

    rng = np.random.default_rng(hash((h, hk, device_table, causal, page_size, dtype)) % 2**32)
    d, dt = 128, dtype_of(dtype)
    mk = lambda n, heads: cupy.asarray(rng.standard_normal((n, heads, d)).astype(np.float32)).astype(dt)  # noqa: E731
    oq, ok = _offsets(LENS_Q), _offsets(LENS_K)
    q, k, v = mk(oq[-1], h), mk(ok[-1], hk), mk(ok[-1], hk)
    kp, vp, table = _paged(rng, k, v, LENS_K, page_size, hk, d)
    cu_q, cu_k = cupy.asarray(oq), cupy.asarray(ok)
    tab = cupy.asarray(table) if device_table else table
    out = varlen.attention_varlen(q, kp, vp, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, block_table=tab)
    flat = varlen.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal)
    mask = MaskOptions.of(causal=causal)
    for b, (nq, nk) in enumerate(zip(LENS_Q, LENS_K)):
        rq, rk = slice(int(oq[b]), int(oq[b + 1])), slice(int(ok[b]), int(ok[b + 1]))
        if nq == 0:
            continue
        if nk == 0:
            assert not bool(out[rq].astype(cupy.float32).any()), b
            continue
        err, pt, allowed = fa_rule(out[rq][None], q[rq][None], k[rk][None], v[rk][None], mask, 1 / math.sqrt(d))
        assert err <= allowed, f"sequence {b}: {err:.3e} > allowed {allowed:.3e} (same-dtype {pt:.3e})"
        diff = float(cupy.abs(out[rq].astype(cupy.float32) - flat[rq].astype(cupy.float32)).max())
        assert diff <= allowed, f"sequence {b}: paged and packed keys differ by {diff:.3e}"


def test_seqused_k_shortens_the_paged_sequences():
    import cupy

    rng = np.random.default_rng(4)
    h = hk = 4
    d, dt = 64, dtype_of("bfloat16")
    oq, ok = _offsets(LENS_Q), _offsets(LENS_K)
    mk = lambda n: cupy.asarray(rng.standard_normal((n, h, d)).astype(np.float32)).astype(dt)  # noqa: E731
    q, k, v = mk(oq[-1]), mk(ok[-1]), mk(ok[-1])
    kp, vp, table = _paged(rng, k, v, LENS_K, 16, hk, d)
    used = [30, 5, 17, 0, 64, 0]
    out = varlen.attention_varlen(q, kp, vp, cupy.asarray(oq), cupy.asarray(ok), max(LENS_Q), max(LENS_K),
                                  block_table=cupy.asarray(table), seqused_k=used)
    for b, (nq, nk) in enumerate(zip(LENS_Q, used)):
        rq = slice(int(oq[b]), int(oq[b + 1]))
        if nq and nk:
            rk = slice(int(ok[b]), int(ok[b]) + nk)
            err, _, allowed = fa_rule(out[rq][None], q[rq][None], k[rk][None], v[rk][None], MaskOptions.of(),
                                      1 / math.sqrt(d))
            assert err <= allowed, b
        elif nq:
            assert not bool(out[rq].astype(cupy.float32).any()), b


def test_paged_varlen_through_torch_and_flash_attn_interface():
    torch = pytest.importorskip("torch")
    from cuflash import flash_attn_interface as fai

    g = torch.Generator(device="cuda").manual_seed(0)
    lens, page, hk, h, d = [37, 100, 3], 16, 2, 8, 64
    cu = torch.tensor(_offsets(lens), device="cuda")
    total = int(cu[-1])
    q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    per = -(-max(lens) // page)
    table = torch.randperm(len(lens) * per, device="cuda", generator=g).to(torch.int32).reshape(len(lens), per)
    kp = torch.zeros(len(lens) * per, page, hk, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    for b, n in enumerate(lens):
        rows = torch.arange(n, device="cuda")
        kp[table[b, rows // page].long(), rows % page] = k[int(cu[b]):int(cu[b + 1])]
        vp[table[b, rows // page].long(), rows % page] = v[int(cu[b]):int(cu[b + 1])]
    out = fai.flash_attn_varlen_func(q, kp, vp, cu, cu, max(lens), max(lens), causal=True, block_table=table)
    ref = fai.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert float((out.float() - ref.float()).abs().max()) <= 2e-2
    with pytest.raises(NotImplementedError, match="forward only"):
        fai.flash_attn_varlen_func(q.requires_grad_(), kp, vp, cu, cu, max(lens), max(lens), block_table=table)

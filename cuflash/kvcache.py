"""Attention to a KV cache (inference): `attention_with_kvcache`, FlashAttention's
`flash_attn_with_kvcache`, contiguous and paged caches, forward only.

A cache is (batch, capacity, heads_kv, head_dim); batch b's valid keys are its first
cache_seqlens[b] rows. With `k_new`/`v_new` (batch, n_new, heads_kv, head_dim) the new keys and
values are first written in place at rows cache_seqlens[b] .. + n_new (a small CuPy kernel on the
call's stream, so the attention that follows sees them), then q attends to the first
cache_seqlens[b] + n_new keys of each batch. The causal mask and windows are bottom-right aligned
to that per-batch length: query i of n_q sits at key position len_b - n_q + i (FlashAttention's
convention for the cache).

Two kernels, both reading one int32 length per batch from the device and moving the mask
geometry with it (kernels_cu/attn/mask.cuh MaskGeometry::for_batch), on every GPU; the decode
kernel reads the cache's lengths as given and adds n_new and clips them itself (FwdParams'
seqused_add), so a device cache_seqlens costs no launch of its own there:
  * decoding (group x n_q <= 16 rows per K/V head, head_dim 32/64/96/128/192/256): the decode kernel
    (families.DECODE, kernels_cu/sm80/decode.cuh), a GQA group's query heads packed into one tile
    so each K/V element is read once, keys split over warps and, by decode_splits, over blocks;
  * otherwise (chunked prefill, other head dims) the sm80 v2 forward's per-batch-length instances
    (Features.seqused_k). The Hopper family does not have them.

What is checked before any launch:
  * shapes, dtypes, devices, head dims, GQA divisibility (as cuflash.attention);
  * cache_seqlens on the HOST (an int, a sequence, a NumPy array, a CPU torch tensor): every length
    in [0, capacity - n_new], so that the appended rows fit: ValueError otherwise;
  * cache_seqlens on the DEVICE (CuPy / CUDA torch int32 or int64 array of batch lengths): its
    shape and dtype only; reading the values would synchronise. Out-of-range values are clipped on
    the device instead: appended rows past the capacity are dropped, and each batch attends to
    min(max(cache_seqlens[b] + n_new, 0), capacity) keys. Never an out-of-bounds access, but also
    no error: check on the host when the lengths may be wrong.

cuflash.attention sends dense calls of decoding's shape to the decode kernel too
(dense_decode_problem, plan_dense_decode: seqused_k a null pointer, every batch at seqlen_k). A
prepared decode call with one int length and no new rows captured into a CUDA graph runs the same
null-pointer plan with the length as a parameter (_uniform_plan): the graph holds the kernel alone.

Split-KV decoding (num_splits) spreads a decode step's keys over several blocks per work tile,
whose fp32 partial results the decode kernel's last split block of each tile merges in the same
launch (sm80/decode.cuh merge_splits, its counters per stream), or, for the prefill kernel's splits and
past a stream's scratch words, one fused kernel (_COMBINE_SRC, the split plans' last launch); rotary
embedding (rotary_cos / rotary_sin, cuflash/rotary.py) rotates q and k_new first.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _compile, _forward, _interop, families, launch, problem, staging, stream_scratch
from . import _plans as plan_cache
from ._forward import empty_plan
from .launch import Buffer, Launch, Plan, check_grid
from .mask import MaskOptions
from .params import pack_fwd
from .tiles import DECODE_MIN_SPLIT_BLOCKS

MAX_SPLITS = 128
DECODE_ROWS = 16  # the decode kernel's packed rows per block (tiles.DecodeConfig.ROWS)

_plans = plan_cache.PlanCache()

# One int for every batch's length: its staged (lens, seqused) arrays by (stream, device, batch, length,
# n_new), so that a loop calling with the same length (a benchmark, a fixed-size cache) uploads them
# once, not per call; the per-call upload and its pinned ring were a fifth of the 8 x 8k decode step's
# host time on the H200 (docs/perf-notes.md, 2026-12-04). Per stream: a stream only reads arrays it
# staged itself, so CuPy's stream-ordered pool keeps them as it keeps any per-call array. Kernels
# only read them. A loop whose length changes every step stages each once, as before.
_UNIFORM_LENGTHS: dict = {}
_UNIFORM_LENGTHS_MAX = 64
_uniform_plans = plan_cache.PlanCache(max_plans=256)  # _uniform_plan's, built during graph captures

# Per element of k_new/v_new (b, t, h, c) in logical C order: row cache_seqlens[b] + t of the cache,
# dropped when it falls outside [0, capacity). Logical indexing of the raw caches follows their
# strides, so any layout the attention accepts is written correctly.
_APPEND = None
_LENGTHS = None
# Both append kernels: element i of k_new / v_new as (b, t, h, c) and the cache row it goes to.
_APPEND_ROW = """
            const int c = i % dim;
            const int h = (i / dim) % heads;
            const int t = (i / ((ptrdiff_t)dim * heads)) % n_new;
            const ptrdiff_t b = i / ((ptrdiff_t)dim * heads * n_new);
            const int row = lens[b] + t;"""


def _append_kernel():
    global _APPEND
    if _APPEND is None:
        import cupy

        _APPEND = cupy.ElementwiseKernel(
            "T kn, T vn, raw int32 lens, int32 n_new, int32 heads, int32 dim, int32 cap",
            "raw T kc, raw T vc",
            _APPEND_ROW + """
            if (row >= 0 && row < cap) {
                const ptrdiff_t at = ((b * cap + row) * heads + h) * dim + c;
                kc[at] = kn;
                vc[at] = vn;
            }
            """,
            "cuflash_kvcache_append")
    return _APPEND


_COMBINE = None  # the combine's RawModule, and its kernels by dtype name (looked up once per plan)
_COMBINE_KERNELS: dict = {}


def _combine_kernel(dtype_name: str):
    global _COMBINE
    kernel = _COMBINE_KERNELS.get(dtype_name)
    if kernel is None:
        import cupy

        if _COMBINE is None:
            _COMBINE = cupy.RawModule(code=_COMBINE_SRC)
        kernel = _COMBINE_KERNELS[dtype_name] = _COMBINE.get_function(f"cuflash_split_combine_{dtype_name}")
    return kernel
# The split-KV partial results merged in one launch (cuflash.merge_attention's arithmetic, fused):
# one thread per (batch, query, head, 4 columns) reads the splits' lse (max first, so no exp
# overflows) and their fp32 O; out = sum_s exp(lse_s - m) O_s / sum_s exp(lse_s - m), lse = m +
# log of that sum; -inf rows (no key in any split) give 0 and -inf, a NaN lse a NaN row. merge_attention
# takes a Python list and runs a few kernels per split: at 33 splits that was 3 ms of launches
# for 0.13 ms of decoding (docs/perf-notes.md). out is written in the call's dtype (one kernel per
# output type: fp32, fp16, bf16, rounded to nearest even by cvt), so no cast follows. Blocks of 64
# threads and unrolled split loops: a decode step's combine is a few thousand threads (1 x 128k,
# 32 heads: 1,024), each a chain of loads per split; 256-thread blocks put them on 4 SMs (9.5 us).
_COMBINE_SRC = r"""
#define CF_NEG_INF __int_as_float(0xff800000)
#define CF_NAN __int_as_float(0x7fffffff)
struct cf_f32 { static __device__ void store(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; } };
template <bool BF16> struct cf_16 {
    static __device__ unsigned short cvt(float x) {
        unsigned short h;
        if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
    static __device__ void store(unsigned short* p, float4 v) {
        const unsigned lo = cvt(v.x) | ((unsigned)cvt(v.y) << 16), hi = cvt(v.z) | ((unsigned)cvt(v.w) << 16);
        *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
    }
};
template <class Store, class T>
__device__ void cf_combine(const float* __restrict__ o_acc, const float* __restrict__ lse_acc, T* __restrict__ out,
                           float* __restrict__ lse, int splits, int batch, int n_q, int heads, int dim) {
    const int d4 = dim / 4;
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (idx >= (long long)batch * n_q * heads * d4) return;
    const int c4 = (int)(idx % d4);
    const long long row = idx / d4;  // (b * n_q + i) * heads + h
    const int h = (int)(row % heads);
    const long long bi = row / heads;
    const int i = (int)(bi % n_q), b = (int)(bi / n_q);
    const long long lrow = ((long long)b * heads + h) * n_q + i, lstep = (long long)batch * heads * n_q;
    const long long ostep = (long long)batch * n_q * heads * dim;
    float m = CF_NEG_INF;
    bool nan = false;
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
        const float l = lse_acc[s * lstep + lrow];
        nan |= l != l;
        m = fmaxf(m, l);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float sum = 0.f;
    if (m != CF_NEG_INF) {
#pragma unroll 8
        for (int s = 0; s < splits; ++s) {
            const float w = expf(lse_acc[s * lstep + lrow] - m);
            const float4 x = reinterpret_cast<const float4*>(o_acc + s * ostep + row * dim)[c4];
            sum += w;
            acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
        }
    }
    const float inv = nan ? CF_NAN : (sum > 0.f ? 1.f / sum : 0.f);
    Store::store(out + row * dim + 4 * c4, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    if (c4 == 0) lse[lrow] = nan ? CF_NAN : (m == CF_NEG_INF ? CF_NEG_INF : m + logf(sum));
}
#define CF_COMBINE(NAME, STORE, T) \
extern "C" __global__ void NAME(const float* __restrict__ o_acc, const float* __restrict__ lse_acc, \
                                T* __restrict__ out, float* __restrict__ lse, int splits, int batch, int n_q, \
                                int heads, int dim) { \
    cf_combine<STORE>(o_acc, lse_acc, out, lse, splits, batch, n_q, heads, dim); \
}
CF_COMBINE(cuflash_split_combine_float32, cf_f32, float)
CF_COMBINE(cuflash_split_combine_float16, cf_16<false>, unsigned short)
CF_COMBINE(cuflash_split_combine_bfloat16, cf_16<true>, unsigned short)
"""
_COMBINE_THREADS = 64


_APPEND_PAGED = None


def _append_paged_kernel():
    """The append into a paged cache: row cache_seqlens[b] + t of batch b is row (that) % page_size
    of page block_table[b, (that) / page_size]; rows past the capacity are dropped."""
    global _APPEND_PAGED
    if _APPEND_PAGED is None:
        import cupy

        _APPEND_PAGED = cupy.ElementwiseKernel(
            "T kn, T vn, raw int32 lens, raw int32 table, int32 table_stride, int32 page_size, int32 n_new, "
            "int32 heads, int32 dim, int32 cap",
            "raw T kc, raw T vc",
            _APPEND_ROW + """
            if (row >= 0 && row < cap) {
                const ptrdiff_t page = table[b * table_stride + row / page_size];
                const ptrdiff_t at = ((page * page_size + row % page_size) * heads + h) * dim + c;
                kc[at] = kn;
                vc[at] = vn;
            }
            """,
            "cuflash_kvcache_append_paged")
    return _APPEND_PAGED


def checked_block_table(block_table, batch: int, num_pages: int, device: int):
    """block_table as a CuPy int32 (batch, pages per sequence) array with unit stride along its rows,
    checked: a host table (NumPy, a list, a CPU torch tensor) for its values too (every entry a page
    index in [0, num_pages)), then copied asynchronously; a device one for shape, dtype and device
    only (reading it would synchronise: its entries are the caller's to keep in range)."""
    import cupy

    if isinstance(block_table, cupy.ndarray):
        if block_table.dtype != np.int32 or block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must be an int32 array of shape (batch={batch}, pages per sequence), got "
                             f"{block_table.dtype} {block_table.shape}")
        if block_table.device.id != device:
            raise ValueError(f"block_table is on device {block_table.device.id}, q on {device}")
        if block_table.shape[1] and block_table.strides[1] != 4:
            block_table = cupy.ascontiguousarray(block_table)
        return block_table
    host = np.asarray(block_table)
    if host.dtype.kind not in "iu" or host.ndim != 2 or host.shape[0] != batch:
        raise ValueError(f"block_table must be integers of shape (batch={batch}, pages per sequence), got "
                         f"{host.dtype} {host.shape}")
    bad = np.argwhere((host < 0) | (host >= num_pages))
    if bad.size:
        b, j = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(host[b, j])} is not a page of the cache (it has {num_pages})")
    return staging.upload(host.astype(np.int32), "block_table")


def _paged_infos(q_info, k_cache, v_cache, table):
    """The caches described as (batch, capacity, heads_kv, head_dim) arrays whose batch stride is the
    page stride (pack_fwd then hands the kernel k_sb / v_sb = the page strides)."""
    out = []
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        info = problem.describe(x, name)
        if len(info.shape) != 4:
            raise ValueError(f"{name} must be (num_pages, page_size, heads_kv, head_dim) with block_table, "
                             f"got shape {info.shape}")
        n_pages, page, hk, d = info.shape
        if page and (why := page_layout_problem(info.shape, info.strides, info.itemsize)):
            raise ValueError(f"{name}: {why}")
        out.append(dataclasses.replace(info, shape=(q_info.shape[0], table.shape[1] * page, hk, d)))
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape (num_pages, page_size, heads_kv, head_dim), got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if k_cache.shape[1] == 0:
        raise ValueError("page_size (k_cache.shape[1]) must be at least 1")
    return out


def page_layout_problem(shape: tuple, strides: tuple, itemsize: int) -> str | None:
    """Why the decode kernel cannot address a paged cache of this (num_pages, page_size, heads_kv,
    head_dim) shape and these byte strides, or None: it forms a page's offset as an unsigned 64-bit
    product and a row's offset within its page in 32 bits (kernels_cu/sm80/decode.cuh,
    load_kv_tile_paged)."""
    n_pages, page, _, d = shape
    page_stride, row_stride = (s // itemsize for s in strides[:2])
    if (n_pages > 1 and page_stride < 0) or (page > 1 and row_stride < 0):
        return f"pages and their rows need non-negative strides, got strides {tuple(strides)} bytes"
    if (page - 1) * row_stride + d >= 2**31:
        return (f"a page spans 2^31 elements or more (page_size {page}, row stride {row_stride} elements); "
                f"use smaller pages")
    return None


def _lengths_kernel():
    global _LENGTHS
    if _LENGTHS is None:
        import cupy

        _LENGTHS = cupy.ElementwiseKernel(
            "I lens, int32 n_new, int32 cap", "int32 used",
            "used = (int)min(max((long long)lens + n_new, 0LL), (long long)cap)",
            "cuflash_kvcache_seqused")
    return _LENGTHS


def _host_lengths(cache_seqlens, batch: int):
    """cache_seqlens as host int64 (batch,), or None when it lives on a CUDA device."""
    import cupy

    if isinstance(cache_seqlens, cupy.ndarray):
        return None
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError(f"cache_seqlens must be an int or integers, one per batch, got {cache_seqlens!r}")
    if isinstance(cache_seqlens, (int, np.integer)):
        return np.full(batch, int(cache_seqlens), dtype=np.int64)
    arr = np.asarray(cache_seqlens)
    if arr.dtype.kind not in "iu" and arr.size:
        raise TypeError(f"cache_seqlens must hold integers, got dtype {arr.dtype}")
    if arr.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},) (one length per batch), got {arr.shape}")
    return arr.astype(np.int64)


def _check_new(k_new, v_new, q, k_cache):
    """n_new, after checking k_new / v_new against the cache's geometry (k_cache: its ArrayInfo,
    (batch, capacity, heads_kv, head_dim); a paged cache's as the batch sees it)."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or neither)")
    if k_new is None:
        return 0
    kn, vn = problem.describe(k_new, "k_new"), problem.describe(v_new, "v_new")
    b, cap, hk, d = k_cache.shape
    for info, name in ((kn, "k_new"), (vn, "v_new")):
        if len(info.shape) != 4 or info.shape[0] != b or info.shape[2:] != (hk, d):
            raise ValueError(f"{name} must have shape (batch={b}, n_new, heads_kv={hk}, head_dim={d}), got {info.shape}")
        if info.dtype != k_cache.dtype or info.device != k_cache.device:
            raise ValueError(f"{name} must have the caches' dtype {k_cache.dtype} and device {k_cache.device}, "
                             f"got {info.dtype} on device {info.device}")
    if kn.shape != vn.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {kn.shape} and {vn.shape}")
    return kn.shape[1]


def check_num_splits(num_splits) -> int:
    """num_splits as an int in [0, MAX_SPLITS] (0: the heuristic chooses); ValueError otherwise."""
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) \
            or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0: chosen by a heuristic), got {num_splits!r}")
    return int(num_splits)


def num_splits_heuristic(tiles: int, sm_count: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits of the keys that fill the GPU (FlashAttention-2's rule): none when the work tiles
    already fill 80% of the SMs; else the fewest splits whose last wave is at least 85% as full as
    the best split count's, skipping counts that give the same blocks per split as one fewer."""
    if tiles <= 0 or key_blocks <= 1 or tiles >= 0.8 * sm_count:
        return 1
    top = max(1, min(max_splits, sm_count, key_blocks))
    per = lambda s: -(-key_blocks // s)
    eligible = [s for s in range(1, top + 1) if s == 1 or per(s) != per(s - 1)]
    eff = {s: (tiles * s / sm_count) / -(-tiles * s // sm_count) for s in eligible}
    best = max(eff.values())
    return next(s for s in eligible if eff[s] >= 0.85 * best)


def _plan_split(p, cfg, dtype) -> Plan:
    """The split-KV forward: n_splits blocks per work tile, each over split_blocks key blocks,
    writing fp32 partial O and lse, merged by the plan's second launch (_split_plan)."""
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    key_blocks = -(-p.seqlen_k // cfg.block_k)
    split_blocks = -(-key_blocks // p.n_splits)
    n_splits = -(-key_blocks // split_blocks)  # no split without a key block
    tiles = m_blocks * p.heads * p.batch
    check_grid(tiles * n_splits)
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    alibi = ("alibi_slopes",) if p.alibi else ()  # the slopes after the other pointers (the kernel's order)
    slots = ("q", "k", "v", "o_acc", "lse_acc", "seqused_k", *alibi)
    params = pack_fwd(p, m_blocks)
    params["n_splits"], params["split_blocks"] = n_splits, split_blocks
    d = p.head_dim
    params["o_sb"], params["o_sn"], params["o_sh"] = p.seqlen_q * p.heads * d, p.heads * d, d  # fp32 elements
    launch = Launch(kernel, (tiles * n_splits,), (cfg.threads,), cfg.smem_bytes, pointers=slots)
    return _split_plan(p, dtype, n_splits, launch, alibi, params)


def _split_plan(p, dtype, n_splits: int, attend: Launch, extra: tuple, params, dense: bool = False,
                extra_buffers: tuple = ()) -> Plan:
    """A split-KV plan: `attend` writes the fp32 partial results o_acc (n_splits, batch, seqlen_q,
    heads, head_dim) and lse_acc (n_splits, batch, heads, seqlen_q), the combine merges them into out
    and lse (the plan's outputs, as the unsplit plans'). One plan, so one driver launch each: the
    combine through CuPy's kernel call was ~35 us of a decode step's host time (docs/perf-notes.md).
    `extra`: the inputs after seqused_k (block table, ALiBi slopes); `dense`: plan_decode's."""
    d = p.head_dim
    buffers = (*_forward.output_buffers(p, dtype),
               Buffer("o_acc", (n_splits, p.batch, p.seqlen_q, p.heads, d), np.float32),
               Buffer("lse_acc", (n_splits, p.batch, p.heads, p.seqlen_q), np.float32), *extra_buffers)
    inputs, null = _lengths_slot((*_forward.INPUTS_SEQUSED_K, *extra), dense)
    return Plan(p.device, inputs, (*buffers, *null), (attend, _combine_launch(p, dtype, n_splits)), _forward.OUTPUTS,
                params)


def _combine_launch(p, dtype, n_splits: int) -> Launch:
    """The combine kernel (_COMBINE_SRC) as a plan's launch, its sizes as the launch's own scalars."""
    b, n_q, h, d = p.batch, p.seqlen_q, p.heads, p.head_dim
    blocks = -(-b * n_q * h * (d // 4) // _COMBINE_THREADS)
    check_grid(blocks)
    return Launch(_combine_kernel(np.dtype(dtype).name), (max(1, blocks),), (_COMBINE_THREADS,), 0,
                  pointers=("o_acc", "lse_acc", "out", "lse"),
                  params=tuple(np.int32(x) for x in (n_splits, b, n_q, h, d)))


def decode_problem(p) -> str | None:
    """Why the decode kernel (families.DECODE) cannot take this KV-cache call, or None: it packs a
    GQA group's query heads times the queries into one 16-row tile."""
    rows = p.group * p.seqlen_q
    if rows > DECODE_ROWS:
        return f"group x seqlen_q = {p.group} x {p.seqlen_q} = {rows} rows, more than the decode tile's {DECODE_ROWS}"
    if not families.DECODE.supports(dataclasses.replace(p, n_splits=1).features):
        return f"no decode instance for head_dim {p.head_dim} (instantiated: {sorted(families.DECODE.defaults)})"
    return None


# K/V bytes in flight per SM (cp.async stages loading while one is computed, over its resident decode
# blocks) at which the decode kernel reads at the copy rate: fitted to scripts/sweep_decode_splits.py
# on the H200 (2026-12-05: d128 tiles of 32 KiB stages at 2 stages, 16 KiB at 4 and 64 KiB at 2;
# one block per SM reached 0.94-1.07x copy with 64 KiB in flight, two were needed with 32 or 48)
DECODE_INFLIGHT_BYTES = 64 * 1024
# a wave that doubles some SMs' blocks: measured 2-10% below one block per SM on each (same sweep)
DECODE_DOUBLED_FILL = 0.9
# the fewest splits whose fill is within this of the best count's (fewer partial results to merge)
DECODE_FILL_SLACK = 0.95


def decode_blocks_per_sm(cfg, resident: int) -> int:
    """Blocks of decode tile `cfg` an SM needs for DECODE_INFLIGHT_BYTES of K/V in flight (each has
    stages - 1 K and V tiles loading), at most the `resident` it holds."""
    inflight = (cfg.stages - 1) * 2 * cfg.block_k * cfg.head_dim * 2  # fp16 / bf16 K and V rows
    return max(1, min(resident, -(-DECODE_INFLIGHT_BYTES // inflight)))


def decode_splits(work: int, blocks_per_sm: int, sm_count: int, key_blocks: int, max_splits: int = MAX_SPLITS,
                  min_split_blocks: int = DECODE_MIN_SPLIT_BLOCKS, per_sm: int = 1) -> int:
    """Splits of each (K/V head, batch)'s keys for the decode kernel, `work` such pairs, at least
    `min_split_blocks` key blocks per split (the tile's: the tuner searches it per cache length).

    The decode kernel reads at the copy bandwidth once every SM holds `per_sm` blocks
    (decode_blocks_per_sm: enough K/V in flight), so splits fill that quantum of per_sm x SMs
    blocks, not the `blocks_per_sm` resident slots: on the H200, 1 x 128k (8 pairs, d128, 2 slots
    per SM) read at 0.94x copy with 16 splits (128 blocks, one per SM) and 0.83x with the slots'
    29 (232 blocks); 8 x 8k at 0.93x with 2 splits, 0.91x with 4 (sweep_decode_splits.py).
    Fill of s splits (n = work x s blocks): n / (per_sm x SMs) up to that quantum; DECODE_DOUBLED_FILL
    up to the resident slots; past them (several waves) the slots' wave efficiency. The fewest
    splits within DECODE_FILL_SLACK of the best fill."""
    top = max(1, min(max_splits, key_blocks // max(1, min_split_blocks)))
    if work <= 0 or top == 1:
        return 1
    quantum, slots = max(1, per_sm) * sm_count, max(blocks_per_sm, per_sm) * sm_count
    per = lambda s: -(-key_blocks // s)  # noqa: E731

    def fill(s: int) -> float:
        n = work * s
        if n <= quantum:
            return n / quantum
        if n <= slots:
            return DECODE_DOUBLED_FILL
        return n / (slots * -(-n // slots))

    eligible = [s for s in range(1, top + 1) if s == 1 or per(s) != per(s - 1)]
    fills = {s: fill(s) for s in eligible}
    best = max(fills.values())
    return next(s for s in eligible if fills[s] >= DECODE_FILL_SLACK * best)


def decode_resident(cfg, props) -> int:
    """Blocks of decode tile `cfg` one SM holds at once (its shared memory with the driver's KiB
    per block, and 2,048 threads)."""
    return max(1, min(props.smem_per_sm // (cfg.smem_bytes + 1024), 2048 // cfg.threads))


def plan_decode(p, cfg, dtype, dense: bool = False, seqused_add: int = 0) -> Plan:
    """The decode kernel's plan (families.DECODE.plan): one block per (split, K/V head, batch).
    `seqused_add`: what the kernel adds to seqused_k[b] before it clips the length into [0,
    seqlen_k] (n_new when the plan's seqused_k input is the cache's lengths before the append).
    p.n_splits 1: out and lse directly; more: fp32 partial results that the last split block of each
    (K/V head, batch) merges into out and lse (one launch; its counters per stream), or, past a
    stream's scratch words, the plan's combine launch (_split_plan). `dense`: seqused_k is not an input but a null pointer, which
    the kernel reads as seqlen_k for every batch, seqused_add added (plan_dense_decode: 0; _uniform_plan: n - seqlen_k)."""
    grid = p.n_splits * p.heads_kv * p.batch
    check_grid(grid)
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    params = pack_fwd(p, 1)
    # the decode kernel's work tiles are (K/V head, batch) pairs; each split divides its own batch's
    # key blocks (kernels_cu/sm80/decode.cuh), so split_blocks is not used
    params["tiles"], params["n_splits"], params["split_blocks"] = p.heads_kv * p.batch, p.n_splits, 0
    params["seqused_add"] = seqused_add
    paged = ("block_table",) if p.paged else ()  # the kernel's pointer after seqused_k
    paged += ("alibi_slopes",) if p.alibi else ()  # and ALiBi's slopes after that (sm80/decode.cuh)
    if p.n_splits == 1:
        slots = (*_forward.INPUTS_SEQUSED_K, *paged)
        launch = Launch(kernel, (grid,), (cfg.threads,), cfg.smem_bytes, pointers=slots)
        inputs, null = _lengths_slot(slots, dense)
        return Plan(p.device, inputs, (*_forward.output_buffers(p, dtype), *null), (launch,), _forward.OUTPUTS, params)
    d = p.head_dim
    params["o_sb"], params["o_sn"], params["o_sh"] = p.seqlen_q * p.heads * d, p.heads * d, d  # fp32 elements
    slots = ("q", "k", "v", "o_acc", "lse_acc", "seqused_k", *paged)
    tiles = p.heads_kv * p.batch
    if tiles > stream_scratch.POOL_WORDS:  # more counters than a stream's scratch: the combine launch merges
        launch = Launch(kernel, (grid,), (cfg.threads,), cfg.smem_bytes, pointers=(*slots, *("no_merge",) * 3))
        plan = _split_plan(p, dtype, p.n_splits, launch, paged, params, dense, extra_buffers=(Buffer("no_merge", None),))
        return plan
    # the in-kernel merge (sm80/decode.cuh merge_splits): one zeroed counter per (K/V head, batch) on
    # each stream, which the tile's last split block sets back to 0; no combine launch. (The counters'
    # scratch name carries their count: a stream's words are handed out once per name.)
    counters = f"split_counters_{tiles}"
    launch = Launch(kernel, (grid,), (cfg.threads,), cfg.smem_bytes, pointers=(*slots, "out", "lse", counters))
    buffers = (*_forward.output_buffers(p, dtype),
               Buffer("o_acc", (p.n_splits, p.batch, p.seqlen_q, p.heads, d), np.float32),
               Buffer("lse_acc", (p.n_splits, p.batch, p.heads, p.seqlen_q), np.float32),
               Buffer(counters, (tiles,), np.int32, per_stream=True))
    inputs, null = _lengths_slot((*_forward.INPUTS_SEQUSED_K, *paged), dense)
    return Plan(p.device, inputs, (*buffers, *null), (launch,), _forward.OUTPUTS, params)


def _lengths_slot(inputs: tuple, dense: bool) -> tuple:
    """(inputs, buffers) of a decode plan: `inputs` as they are, or (`dense`) without seqused_k,
    which becomes a buffer of no shape: the kernel gets a null pointer (MaskGeometry::for_batch:
    every batch at seqlen_k)."""
    if not dense:
        return inputs, ()
    return tuple(n for n in inputs if n != "seqused_k"), (Buffer("seqused_k", None),)


def dense_decode_problem(p) -> str | None:
    """Why a dense forward call (cuflash.attention: one length for every batch) does not go to the
    decode kernel, or None: it goes there when its query rows per K/V head (the GQA group's heads
    times seqlen_q) fit the decode tile and the decode kernel has its features (no dropout, no user
    modification or block mask, an instantiated head dim, ...). Such calls are decoding steps that
    pass the whole cache as k and v (Hugging Face's attention interface does): the prefill kernels
    would run one block per query head, each reading its group's keys and values again."""
    if p.empty or p.varlen or p.seqused_k or p.mod is not None or p.block_mask is not None:
        return "not a dense call of the decode kernel's features"
    return decode_problem(dataclasses.replace(p, seqused_k=True))


def plan_dense_decode(p, dtype) -> Plan:
    """The decode kernel's plan for a dense call (dense_decode_problem None): seqused_k a null
    pointer, every batch at seqlen_k (MaskGeometry::for_batch leaves the call's geometry, either
    alignment, as it is); splits by decode_splits."""
    return _build_decode(dataclasses.replace(p, seqused_k=True), 0, dtype, dense=True)[0]


def _build_decode(p, splits: int, dtype, dense: bool = False, n_new: int = 0, config=None):
    """(plan, split) of the decode kernel for this call: `splits` blocks per (K/V head, batch), or
    decode_splits' choice for 0 (with the tile's min_split_blocks); `dense`: plan_decode's; `n_new`:
    the rows appended before it attends (the plan's seqused_k input is the cache's lengths before
    the append); `config`: the tile (the tuner's; checked), else the selected one."""
    from . import device

    if config is None:
        cfg = families.select(families.DECODE, p)
    else:
        cfg = config
        families.DECODE.check_explicit(cfg, p.features)
        why = families.DECODE.can_implement(cfg, device.supported(p.device))
        if why:
            raise ValueError(f"config {cfg} cannot run here: {why}")
    if splits == 0:
        props = device.query(p.device)
        resident = decode_resident(cfg, props)
        splits = decode_splits(p.heads_kv * p.batch, resident, props.sm_count, -(-p.seqlen_k // cfg.block_k),
                               min_split_blocks=cfg.min_split_blocks, per_sm=decode_blocks_per_sm(cfg, resident))
    ps = dataclasses.replace(p, n_splits=splits)
    return plan_decode(ps, cfg, dtype, dense, seqused_add=n_new), splits > 1, (ps, cfg)


def _uniform_plan(prep: _Prepared, n: int, dtype) -> Plan:
    """The decode plan of a prepared call for one host length n of every batch, no new rows: its
    seqused_k a null pointer, which the kernel reads as the capacity, and seqused_add n - capacity
    (sm80/decode.cuh). What a CUDA graph captures of an int cache_seqlens: the kernel alone, where
    the lengths array would be two fill kernels in the graph (_uniform_lengths: ~2 us a replay,
    1-3% of a decoding step at 8 x 8k on an H200). One plan per length, built at capture time."""
    ps, cfg = prep.decode
    return _uniform_plans.get(lambda: (ps, cfg, np.dtype(dtype).str, n),
                              lambda: plan_decode(ps, cfg, dtype, dense=True, seqused_add=n - ps.seqlen_k))


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A KV-cache call resolved once per signature (_call_key): its problem, plan, and whether the
    plan splits the keys (its combine writes out through 8-byte stores). Repeated calls (a decode loop) skip the
    describing, resolving and choosing: only the lengths are checked and staged per call."""

    p: object  # problem.AttnProblem against the capacity, seqused_k (and paged) set
    plan: object
    split: bool
    n_new: int
    # the decode kernel's plan: (its problem, n_splits set; its tile), and its seqused_k input is the
    # cache's lengths as given, before the append (the kernel adds n_new and clips); None: another
    # plan, whose seqused_k is the attended lengths, n_new added and clipped before the launch
    decode: tuple | None = None


def _call_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, mask: MaskOptions, softmax_scale,
              num_splits, alibi_slopes=None, config=None):
    """The fast path's key: everything the validation and the plan depend on (array_key of the CuPy
    arrays: shapes, strides, dtypes, devices, pointer alignment; the kinds of the lengths and the
    table; the options, a given decode config), or None for calls it does not take (rotary embedding, host block tables,
    arrays that are not CuPy's: the slow path checks and runs those)."""
    import cupy

    if isinstance(cache_seqlens, cupy.ndarray):
        lk = (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device.id)
    elif _one_length(cache_seqlens):
        lk = 0
    else:
        lk = 1  # host integers, checked per call
    if block_table is None:
        tk = None
    elif isinstance(block_table, cupy.ndarray):
        tk = (block_table.shape, block_table.strides, block_table.dtype, block_table.device.id)
    else:
        return None
    arrays = (q, k_cache, v_cache) if k_new is None else (q, k_cache, v_cache, k_new, v_new)
    try:
        ak = None if alibi_slopes is None else plan_cache.array_key((alibi_slopes,))
        return ("call", plan_cache.array_key(arrays), lk, tk, mask.key, softmax_scale, num_splits, ak, config)
    except AttributeError:  # not CuPy arrays: the slow path names the argument
        return None


def _one_length(cache_seqlens) -> bool:
    """Whether cache_seqlens is one host int for every batch."""
    return type(cache_seqlens) is int or isinstance(cache_seqlens, np.integer)


def _capturing() -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph (torch's capture too: its
    calls run on an external stream of torch's)."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def _lengths(cache_seqlens, batch: int, n_new: int, cap: int, device: int, capturing: bool | None = None):
    """(lens, seqused) int32 device arrays of the cache lengths and the attended lengths (+ n_new);
    seqused None for device lengths (the decode kernel reads lens and clips them itself; for the
    other plans the lengths kernel derives seqused, clipped, on the device). Host
    lengths are checked to fit the appended rows and staged in one asynchronous copy
    (cuflash/staging.py: cupy.asarray's pageable copy waited for the previous step's kernels).
    `capturing`: whether the stream is being captured, when the caller knows (None: asked here)."""
    import cupy

    if isinstance(cache_seqlens, cupy.ndarray):
        if cache_seqlens.shape != (batch,) or cache_seqlens.dtype.kind not in "iu":
            raise ValueError(f"cache_seqlens must be an integer array of shape ({batch},), got "
                             f"{cache_seqlens.dtype} {cache_seqlens.shape}")
        if cache_seqlens.device.id != device:
            raise ValueError(f"cache_seqlens is on device {cache_seqlens.device.id}, q on {device}")
        with launch.graph_temporaries():  # (an int64 array's int32 copy lives only as long as the call)
            return cache_seqlens.astype(cupy.int32, copy=False), None
    if _one_length(cache_seqlens):  # one length: no array to check
        n = int(cache_seqlens)
        if not 0 <= n <= cap - n_new:
            _lengths_do_not_fit(0, n, n_new, cap)
        return _uniform_lengths(batch, n, n_new, device, capturing)
    else:
        host = _host_lengths(cache_seqlens, batch)
        bad = np.flatnonzero((host < 0) | (host + n_new > cap))
        if bad.size:
            _lengths_do_not_fit(int(bad[0]), int(host[bad[0]]), n_new, cap)
        both = np.concatenate([host, host + n_new]).astype(np.int32)
    both = staging.upload(both, "cache_seqlens")
    return both[:batch], both[batch:]


def _uniform_lengths(batch: int, n: int, n_new: int, device: int, capturing: bool | None = None):
    """(lens, seqused) int32 device arrays of one length n for every batch (+ n_new), staged once per
    (stream, ...) (_UNIFORM_LENGTHS). During a CUDA graph capture: written by two fill kernels into
    the graph's own memory (launch.graph_temporaries), so each replay writes them again (a staged
    copy would read a pinned buffer the ring reuses, and the staged array would go back to CuPy's
    pool after the call). (A prepared decode call without new rows captures no lengths at all:
    _uniform_plan.)"""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing() if capturing is None else capturing:
        with launch.graph_temporaries():
            both = cupy.empty(2 * batch, dtype=cupy.int32)
        both[:batch].fill(n)
        both[batch:].fill(n + n_new)
        return both[:batch], both[batch:]
    key = (stream.ptr, device, batch, n, n_new)
    both = _UNIFORM_LENGTHS.get(key)
    if both is None:
        host = np.full(2 * batch, n, dtype=np.int32)
        host[batch:] += n_new
        both = staging.upload(host, "cache_seqlens")
        if len(_UNIFORM_LENGTHS) >= _UNIFORM_LENGTHS_MAX:
            _UNIFORM_LENGTHS.pop(next(iter(_UNIFORM_LENGTHS)))  # the oldest
        _UNIFORM_LENGTHS[key] = both
    return both[:batch], both[batch:]


def _lengths_do_not_fit(b: int, n: int, n_new: int, cap: int):
    raise ValueError(f"cache_seqlens[{b}] = {n}: with n_new = {n_new} new rows the cache needs "
                     f"0 <= cache_seqlens <= capacity - n_new = {cap - n_new} (k_cache has capacity {cap})")


def _forward_cupy(q, k_cache, v_cache, cache_seqlens, k_new, v_new, mask: MaskOptions, softmax_scale, out=None,
                  lse=None, num_splits: int = 0, rotary_cos=None, rotary_sin=None, rotary_interleaved: bool = True,
                  block_table=None, alibi_slopes=None, config=None, rotary_seqlens=None):
    """The CuPy body: (out, lse). Checks everything it can before the first launch. `out`, `lse`:
    given buffers (internal: the GPU tests poison them), checked as the forward's. A call whose
    signature was seen before (_call_key) takes the prepared plan (_Prepared). `alibi_slopes`:
    ALiBi's (problem.check_alibi_slopes), aligned as the mask (to each batch's length). `config`: a
    DecodeConfig for a call the decode kernel takes (the tuner's trials; ValueError for another).
    `rotary_seqlens`: the lengths rotary positions count from, where they are not cache_seqlens
    (cache_leftpad's calls: cuflash/cache_leftpad.py)."""
    key = None
    # (a given config too: the tuner times its trials as a decode loop runs, on the prepared call)
    if rotary_cos is None and rotary_sin is None:
        key = _call_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, mask, softmax_scale,
                        num_splits, alibi_slopes, config)
        prep = _plans.lookup(key)
        if prep is not None:
            p = prep.p
            capturing = None  # (asked once a call: an int length's staging asks it too)
            if prep.decode is not None and not prep.n_new and _one_length(cache_seqlens):
                capturing = _capturing()
                if capturing:
                    n = int(cache_seqlens)
                    if not 0 <= n <= p.seqlen_k:
                        _lengths_do_not_fit(0, n, 0, p.seqlen_k)
                    return _execute(prep, q, k_cache, v_cache, None, None, None, None, block_table, out, lse,
                                    alibi_slopes, uniform=n)
            lens, seqused = _lengths(cache_seqlens, p.batch, prep.n_new, p.seqlen_k, p.device, capturing)
            return _execute(prep, q, k_cache, v_cache, lens, seqused, k_new, v_new, block_table, out, lse,
                            alibi_slopes)

    import cupy

    q_info = problem.describe(q, "q")
    table = None
    if block_table is not None:  # paged: the geometry of (batch, pages per sequence x page_size) caches
        table = checked_block_table(block_table, q_info.shape[0] if len(q_info.shape) == 4 else -1,
                             k_cache.shape[0] if k_cache.ndim == 4 else 0, q_info.device)
        infos = [q_info, *_paged_infos(q_info, k_cache, v_cache, table)]
    else:
        infos = [q_info, problem.describe(k_cache, "k_cache"), problem.describe(v_cache, "v_cache")]
        if len(infos[1].shape) != 4 or infos[1].shape != infos[2].shape:
            raise ValueError(f"k_cache and v_cache must have one shape (batch, capacity, heads_kv, head_dim), got "
                             f"{infos[1].shape} and {infos[2].shape}")
    slopes_info = None if alibi_slopes is None else problem.describe(alibi_slopes, "alibi_slopes")

    def resolved():  # (again after rotary replaces q)
        p = problem.resolve_forward(*infos, mask, softmax_scale)  # geometry against the capacity
        p = dataclasses.replace(p, seqused_k=True)  # the kernel moves it to each batch's length
        p = problem.with_alibi(p, slopes_info)
        if table is not None:
            p = dataclasses.replace(p, paged=True, page_size=k_cache.shape[1], table_stride=table.strides[0] // 4)
        return p

    p = resolved()
    n_new = _check_new(k_new, v_new, q, infos[1])
    batch, cap = p.batch, p.seqlen_k
    host = _host_lengths(cache_seqlens, batch)
    one = _one_length(cache_seqlens)  # (staged once: _uniform_lengths)
    lens, seqused = _lengths(cache_seqlens if host is None or one else host, batch, n_new, cap, p.device)

    splits = check_num_splits(num_splits)
    if rotary_cos is not None or rotary_sin is not None:  # q and k_new rotated before anything reads them
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        from . import rotary

        cos32, sin32 = rotary.check_tables(rotary_cos, rotary_sin, p.head_dim, p.device)
        per_token = bool(mask.causal) or tuple(mask.window_size) != (-1, -1)  # FlashAttention's rule for q
        reach = max(n_new, q.shape[1] if per_token else 1)
        rot_host, rot_lens = host, lens
        if rotary_seqlens is not None:
            rot_host = _host_lengths(rotary_seqlens, batch)
            rot_lens = _lengths(rotary_seqlens, batch, 0, 2**31 - 1, p.device)[0]
        why = rotary.host_positions_problem(rot_host, reach, cos32.shape[0]) if rot_host is not None else None
        if why:
            raise ValueError(why)
        with launch.graph_temporaries():  # the rotated q and k_new live only as long as the call
            q = rotary.apply(q, cos32, sin32, rotary.positions(rot_lens, q.shape[1], per_token),
                             bool(rotary_interleaved))
            if n_new:
                k_new = rotary.apply(k_new, cos32, sin32, rotary.positions(rot_lens, n_new, True),
                                     bool(rotary_interleaved))
        infos[0] = problem.describe(q, "q")
        p = resolved()  # (a paged cache's fields too: without them the kernels read the pages as batches)

    why_not_decode = None if p.empty else decode_problem(p)
    if config is not None and why_not_decode is not None:
        raise ValueError(f"config {config}: this call does not run the decode kernel ({why_not_decode})")
    if table is not None and why_not_decode is not None:
        # more rows per K/V head than the decode kernel's tile (chunked prefill): append into the
        # pages, gather each batch's pages into a contiguous cache (entries clipped into range: past
        # a batch's length they may be anything) and attend to that with the lengths + n_new
        _append(k_new, v_new, lens, n_new, p, k_cache, v_cache, table)
        with launch.graph_temporaries():  # the gathered caches live only as long as the call
            if seqused is None:
                seqused = _lengths_kernel()(lens, n_new, cap)
            pages = cupy.clip(table, 0, k_cache.shape[0] - 1)
            kg, vg = (c[pages].reshape(batch, cap, *c.shape[2:]) for c in (k_cache, v_cache))
        return _forward_cupy(q, kg, vg, seqused, None, None, mask, softmax_scale, out=out, lse=lse,
                             num_splits=num_splits, alibi_slopes=alibi_slopes)

    def build():  # (plan, whether it splits the keys, _Prepared.decode)
        if p.empty:
            return empty_plan(p, q.dtype), False, None
        if why_not_decode is None:  # few rows per K/V head: the decode kernel, on every GPU
            return _build_decode(p, splits, q.dtype, n_new=n_new, config=config)
        family = families.choose(families.FORWARDS, p, None)  # the Hopper family refuses seqused_k: sm80
        s = splits
        if s == 0:  # the heuristic, on the plain tile's work
            from . import device

            cfg = families.select(family, p)
            tiles = -(-p.seqlen_q // cfg.block_q) * p.heads * p.batch
            s = num_splits_heuristic(tiles, device.query(p.device).sm_count, -(-p.seqlen_k // cfg.block_k))
        if s > 1:
            ps = dataclasses.replace(p, n_splits=s)
            return _plan_split(ps, families.select(families.FWD, ps), q.dtype), True, None
        return family.plan(p, families.select(family, p), q.dtype), False, None

    # every check (the plan's family and tile, the buffers) before the cache is written
    # the plan's key holds everything the plan depends on: ALiBi's slopes decide the kernel (kAlibi)
    # and their batch stride a parameter, so a call with other (or no) slopes must not take it; n_new
    # is the decode kernel's seqused_add
    plan, split, decode = _plans.get(lambda: (*plan_cache.array_key((q, k_cache, v_cache)), mask.key, softmax_scale,
                                                splits, None if table is None else (table.shape, table.strides),
                                                None if alibi_slopes is None else alibi_slopes.shape, n_new, config),
                                     build)
    prep = _Prepared(p, plan, split, n_new, decode)
    if key is not None and table is block_table and not p.empty:  # the table as given (not a contiguous copy)
        _plans.put(key, prep)
    return _execute(prep, q, k_cache, v_cache, lens, seqused, k_new, v_new, table, out, lse, alibi_slopes)


def _execute(prep: _Prepared, q, k_cache, v_cache, lens, seqused, k_new, v_new, table, out, lse, alibi_slopes=None,
             uniform: int | None = None):
    """Append k_new / v_new, attend, combine split results: the launches of a prepared call.
    `uniform`: one host length of every batch, no new rows, run by its _uniform_plan (no lengths)."""
    p = prep.p
    if out is not None:
        out = _forward._checked_out(out, q)
    if lse is not None:
        lse = _forward._checked_lse(lse, (q.shape[0], q.shape[2], q.shape[1]))
    plan = prep.plan
    if uniform is not None:
        plan, lengths = _uniform_plan(prep, uniform, q.dtype), ()
    else:
        _append(k_new, v_new, lens, prep.n_new, p, k_cache, v_cache, table)
        if prep.decode is not None:  # the decode kernel adds n_new and clips (FwdParams.seqused_add)
            seqused = lens
        elif seqused is None:
            with launch.graph_temporaries():
                seqused = _lengths_kernel()(lens, prep.n_new, p.seqlen_k)
        lengths = (seqused,)
    paged = () if table is None else (table,)
    if prep.p.alibi:  # the slopes after the table (the plans' input order)
        paged += (alibi_slopes,)
    if prep.split and out is not None and out.data.ptr % 8:  # the combine stores 4 columns at once
        got, lse = plan.run((q, k_cache, v_cache, None, lse, *lengths, *paged))
        out[...] = got
        return out, lse
    return plan.run((q, k_cache, v_cache, out, lse, *lengths, *paged))


def _append(k_new, v_new, lens, n_new, p, k_cache, v_cache, table):
    """k_new / v_new written into the cache at rows lens[b] .. + n_new (its pages with a table)."""
    import cupy

    if not (n_new and p.batch):
        return
    u16 = cupy.uint16  # both dtypes are 16-bit: the copy moves bits (CuPy's bfloat16 support varies)
    if table is None:
        _append_kernel()(k_new.view(u16), v_new.view(u16), lens, n_new, p.heads_kv, p.head_dim, p.seqlen_k,
                         k_cache.view(u16), v_cache.view(u16))
    else:
        _append_paged_kernel()(k_new.view(u16), v_new.view(u16), lens, table, p.table_stride, p.page_size, n_new,
                               p.heads_kv, p.head_dim, p.seqlen_k, k_cache.view(u16), v_cache.view(u16))


def _left_padded(cache_leftpad, q, k_cache, v_cache, table, cache_seqlens, k_new):
    """cache_leftpad's call as a paged one (cuflash/cache_leftpad.py): (k_rows, v_rows, row table,
    the lengths the rows' table sees)."""
    from . import cache_leftpad as leftpad

    q_info = problem.describe(q, "q")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        info = problem.describe(x, name)
        if len(info.shape) != 4 or info.shape != tuple(k_cache.shape):
            raise ValueError(f"k_cache and v_cache must have one shape (batch, capacity, heads_kv, head_dim) "
                             f"(pages with block_table), got {k_cache.shape} and {v_cache.shape}")
    if len(q_info.shape) != 4:
        raise ValueError(f"q must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {q_info.shape}")
    if table is not None:
        table = checked_block_table(table, q_info.shape[0], k_cache.shape[0], q_info.device)
    n_new = 0 if k_new is None else problem.describe(k_new, "k_new").shape[1]
    return leftpad.as_rows(cache_leftpad, q, k_cache, v_cache, table, cache_seqlens, n_new)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, causal: bool = False,
                           softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0,
                           return_lse: bool = False, num_splits: int = 0, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved: bool = True, block_table=None, alibi_slopes=None,
                           cache_batch_idx=None, cache_leftpad=None):
    """Attention of q (batch, n_q, heads, head_dim) to each batch's first cache_seqlens[b] (+ n_new)
    keys of k_cache / v_cache (batch, capacity, heads_kv, head_dim), after appending k_new / v_new
    (batch, n_new, heads_kv, head_dim) in place at row cache_seqlens[b] (module docstring: the
    alignment, what is checked). Forward only, no autograd.

    cache_seqlens: an int (every batch), integers one per batch on the host, or an int32/int64 array on
    q's CUDA device. causal / window_size / softcap / softmax_scale: as cuflash.attention, bottom-right
    aligned to each batch's length. Returns out like q, and with return_lse also lse float32
    (batch, heads, n_q); rows that see no key (a length of 0) get out 0 and lse -inf.
    num_splits: split-KV ("flash-decoding"): the keys of each (query block, head, batch) split over
    this many blocks, whose fp32 partial results one combine kernel merges; 0 (the
    default) chooses by the work's size against the GPU's SMs (num_splits_heuristic: 1 when the
    work already fills the GPU); 1: no split. At most 128.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) tables (cuflash/rotary.py): k_new is rotated
    at positions cache_seqlens[b] + t before it is appended, q at cache_seqlens[b] + i with causal
    or a window, else at cache_seqlens[b] for every query (FlashAttention's convention);
    rotary_interleaved: GPT-J pairs (2i, 2i + 1) (the default, as FlashAttention's) or GPT-NeoX's
    (i, i + rotary_dim / 2). Host lengths whose positions pass the tables raise ValueError; device
    lengths are clipped to the last row.
    block_table: a paged cache (vLLM's and FlashAttention's layout): k_cache / v_cache are then
    (num_pages, page_size, heads_kv, head_dim), any page size, and block_table (batch, pages per
    sequence) int32 names batch b's pages in order: its key row r is row r % page_size of page
    block_table[b, r // page_size], its capacity pages per sequence x page_size. A host table
    (NumPy, a list, a CPU tensor) is checked (every entry a page of the cache); a device one (int32,
    on q's device) is not: entries a batch's length reaches must be pages of the cache, the rest
    are never read. The decode kernel reads the pages in place; calls with more rows per K/V head
    than its tile (group x n_q > 16) gather the pages into a contiguous copy first.
    alibi_slopes: ALiBi (FlashAttention's): float32 (heads,) or (batch, heads) of q's framework and
    device; each score gains -slope |i + offset - j|, aligned as the mask to each batch's length
    (query i of the n_q new ones at key position cache_seqlens[b] + n_new - n_q + i). Every path:
    the decode kernel (each packed row its head's slope), split-KV, the forward kernel.
    cache_batch_idx: integers (batch,) (FlashAttention's): batch b of q attends to and appends into
    sequence cache_batch_idx[b] of a contiguous cache (batch_cache, capacity, heads_kv, head_dim),
    batch_cache any size; cache_seqlens, k_new, v_new and the slopes stay per batch of q. Runs as a
    paged cache whose pages are the cache's sequences (cuflash/cache_batch.py: no copy). Host
    indices are checked (each a sequence of the cache); device ones (integers on q's device) are
    not: an index out of range reads and writes out of bounds. Indices that repeat with k_new /
    v_new append into one sequence more than once, in no set order. Not with block_table.
    cache_leftpad: integers (batch,) (FlashAttention's): batch b's keys are rows cache_leftpad[b] ..
    cache_seqlens[b] + n_new of its sequence (left-padded prompts); k_new / v_new are still appended
    at cache_seqlens[b], rotary positions still count from row 0, masks and ALiBi align to the last
    key as always. With contiguous caches (any strides: a transposed (batch, heads, seq, dim) cache
    too), cache_batch_idx or block_table; runs as a paged cache of one-row pages
    (cuflash/cache_leftpad.py: no copy). Host pads are checked against host lengths (each pad at
    most its batch's cache_seqlens); device ones are not.
    CuPy arrays, or torch tensors (through DLPack on torch's current stream; the caches are written
    in place either way).
    """
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx and block_table cannot be combined: a paged cache names each batch's "
                         "pages in block_table")
    mask = MaskOptions.of(causal=causal, window_size=window_size, softcap=softcap)
    check_num_splits(num_splits)
    names = ["q", "k_cache", "v_cache"]
    arrays = [q, k_cache, v_cache]
    if k_new is not None or v_new is not None:
        if k_new is None or v_new is None:
            raise ValueError("k_new and v_new must be given together (or neither)")
        names += ["k_new", "v_new"]
        arrays += [k_new, v_new]
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        names += ["rotary_cos", "rotary_sin"]
        arrays += [rotary_cos, rotary_sin]
    fw, dev = _interop.common_framework(arrays, names)
    # CUDA lengths, tables, indices of another framework travel with the arrays (CuPy ones are used as is)
    n_fixed = len(arrays)
    behind = _interop.optional_inputs(fw, names, arrays, cache_seqlens=cache_seqlens, block_table=block_table,
                                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    optional = tuple(names[n_fixed:])
    if alibi_slopes is not None:  # of q's framework and device, as the other arrays
        names.append("alibi_slopes")
        arrays.append(alibi_slopes)
        fw, dev = _interop.common_framework(arrays, names)

    def body(q, k_cache, v_cache, *rest):
        rest = list(rest)
        kn, vn = (rest.pop(0), rest.pop(0)) if k_new is not None else (None, None)
        cos, sin = (rest.pop(0), rest.pop(0)) if rotary else (None, None)
        given = _interop.rejoin(optional, rest[:len(optional)], behind)
        lens, table, index = given["cache_seqlens"], given["block_table"], given["cache_batch_idx"]
        slopes = rest[len(optional)] if alibi_slopes is not None else None
        if index is not None:  # the cache's sequences as pages, the indices as their table
            from . import cache_batch

            k_cache, v_cache, table = cache_batch.as_paged(index, q, k_cache, v_cache)
        absolute = None  # rotary's lengths where they differ from those the kernels see
        if given["cache_leftpad"] is not None:  # each row a page, the table from each batch's pad on
            absolute = lens
            k_cache, v_cache, table, lens = _left_padded(given["cache_leftpad"], q, k_cache, v_cache, table, lens, kn)
        out, lse = _forward_cupy(q, k_cache, v_cache, lens, kn, vn, mask, softmax_scale, num_splits=num_splits,
                                 rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary_interleaved,
                                 block_table=table, alibi_slopes=slopes, rotary_seqlens=absolute)
        return out, lse

    if fw == _interop.CUPY:
        out, lse = body(*arrays)
    else:
        out, lse = _interop.run(body, arrays, fw, dev, names)
    return (out, lse) if return_lse else out

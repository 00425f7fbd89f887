// cuflash/kernels_cu/core/ptx_sm90.cuh
// Inline-PTX wrappers for the Hopper (sm_90 / sm_90a) machinery the sm90 mainloops use: tensor
// maps and TMA loads (cp.async.bulk.tensor), mbarriers, wgmma fences and shared-memory matrix
// descriptors, named barriers, setmaxnreg. The wgmma instructions themselves are generated:
// core/wgmma_sm90.cuh. Facts checked on an H200 by shared/device/hopper_probe (design/hopper.md
// §2-3); nothing here knows about attention.
#pragma once
#include "core/ptx_sm80.cuh"
#include "core/wgmma_sm90.cuh"

namespace cuflash {

typedef unsigned long long u64;

// A CUtensorMap (cuTensorMapEncodeTiled, built on the host by cuflash/tma.py): 128 opaque bytes,
// passed by value as a `const __grid_constant__` kernel parameter so that its generic address is
// in the parameter space (without __grid_constant__ taking the address would copy it to local
// memory, which TMA cannot read). PTX needs 64-byte alignment.
struct __align__(64) TmaMap {
    u64 opaque[16];
};

// ---- mbarriers (shared::cta, 64-bit). Phase parity: a wait on parity P returns once the phase
// with that parity has completed; a fresh barrier counts as having completed parity 1.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// Makes the inits visible to the async proxy (TMA) and the other threads (with a CTA barrier after).
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 ok;
    asm volatile("{\n.reg .pred P1;\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\nselp.u32 %0, 1, 0, P1;\n}"
                 : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
    return ok != 0;
}
// Blocks until the phase of `parity` completed; try_wait suspends in hardware between polls.
// (No clock64/__trap timeout here: a trap path in the kernel makes ptxas ignore setmaxnreg for
// the consumer branch, measured: 168 registers, spills and serialized wgmma instead of 240.)
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

// ---- TMA: a 5-D tile load into shared memory, completing on an mbarrier (complete_tx::bytes).
// Coordinates in elements, innermost first. The `.shared::cluster` destination is valid without
// a cluster launch (the CTA is its own cluster).
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaMap& map, u32 bar, int c0, int c1, int c2, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
}
// The same from a 4-D map (the sm90 forward's column-masking maps: cuflash/tma.py's 4-D form).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap& map, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];"
        :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ void prefetch_tma_map(const TmaMap& map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}
// Generic-proxy shared-memory writes become visible to the async proxy (TMA, wgmma) readers.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The same between the generic proxy's and the async proxy's (bulk copies') accesses to global memory.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---- GPU-scope flags in global memory (the deterministic backward's per-block turn counters)
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// ---- wgmma ordering (PTX §9.7.15.7)
// Before a batch of wgmma whose registers (accumulators, A operands) ordinary code wrote.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Compiler fences on the registers a wgmma reads or writes asynchronously: without them the
// compiler may move their uses across the asm that issues or retires the wgmma (the memory
// clobber does not cover registers).
template <int NT>
__device__ __forceinline__ void fence_regs(float (&d)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e]) :: "memory");
}
template <int K>
__device__ __forceinline__ void fence_regs(u32 (&a)[K][4]) {
#pragma unroll
    for (int i = 0; i < K; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e]) :: "memory");
}

// ---- shared-memory matrix descriptors (PTX §9.7.15.5.1.2.2), 128-byte swizzle only: bits 0-13
// start address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 layout (1 = 128B swizzle). The tile
// is the TMA image: [64-column chunk][row][64], rows of 128 B, 1024-B aligned chunks.
// K-major (Q, K: the contraction dim is the 64-column one): LBO unused (1), SBO = 8 rows = 1024 B.
// A k-step of 16 columns moves the start by 32 B inside a chunk, then by a chunk.
constexpr u64 kDescKMajorSw128 = (1ull << 16) | (64ull << 32) | (1ull << 62);
// MN-major (V: the contraction dim is the row one): LBO = the stride between 64-column chunks
// (rows * 128 B), SBO = 8 rows = 1024 B; a k-step of 16 rows moves the start by 2048 B.
__host__ __device__ constexpr u64 desc_mn_major_sw128(int rows) {
    return ((u64)(rows * 128 >> 4) << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ u64 make_desc(u32 smem_addr, u64 fields) { return fields | (u64)((smem_addr & 0x3FFFF) >> 4); }

// ---- named barriers (0 is __syncthreads); count = threads taking part, a multiple of 32
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");
}

// ---- register reallocation between warpgroups (sm_90a): every warp of the warpgroup executes it;
// the kernel needs a register cap at entry (__launch_bounds__(threads, 1)).
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS)); }

}  // namespace cuflash

// cuflash/kernels_cu/sm90/tile_feed.cuh
// Which work tiles a CTA of a warp-specialised kernel runs, decided by its producer thread and handed
// to the consumer warps through a two-slot ring in shared memory (an id per slot, a full and an empty
// mbarrier per slot). The producer walks the tiles first (it loads their data), so the consumers
// learn each tile when they are about to start it, and never need to know which tile is their last.
//
// Two ways to pick the tiles (TileSource):
//   static   CTA i runs tiles i, i + gridDim.x, ... (any grid: one CTA per tile, or one per SM)
//   dynamic  the first tile as static, then each next one drawn from a grid-wide counter once the
//            producer has issued the current one's loads: t = atomicAdd(counter, 1) + gridDim.x. A CTA
//            takes more work exactly when it is about to run out, so tiles of unequal cost (causal
//            rows, the sequences of a variable-length batch) balance the way the hardware's block
//            scheduler balances one CTA per tile, while the CTA keeps its K/V ring and Q buffers
//            running across tiles.
// The counter returns to 0 by itself: every CTA draws until one draw fails (t >= tiles), so the
// draws of a launch number exactly `tiles` (tiles - gridDim.x successes, gridDim.x failures), and
// the draw that returned tiles - 1 was the launch's last; its CTA stores 0. A launch on a stream
// therefore finds its counter at 0 as long as no other launch uses the counter at the same time
// (cuflash keeps one per device and stream: launch.Buffer's per_stream). The grid must not exceed
// the tiles (every CTA's first tile exists).
#pragma once
#include "core/ptx_sm90.cuh"

namespace cuflash {

// A count the producer thread keeps in shared memory instead of a register: the Hopper forward's
// producer has 24, and the tile loop's counts there spilled (volatile: never cached in a register).
struct SmemCount {
    u32 addr;
    __device__ __forceinline__ int get() const {
        int v;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
        return v;
    }
    __device__ __forceinline__ void set(int v) const { asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory"); }
};

struct TileSource {
    int* counter;  // nullptr: static
    int tiles;

    __device__ __forceinline__ int first() const { return blockIdx.x; }
    // The tile after `tile` (the producer thread, once `tile`'s loads are issued: the consumers still
    // have its last blocks to run, under which a draw's round trip hides).
    __device__ __forceinline__ int next(int tile) const {
        if (counter == nullptr) return tile + gridDim.x;
        const int drawn = atomicAdd(counter, 1);
        if (drawn == tiles - 1) atomicExch(counter, 0);  // the launch's last draw: no CTA draws after it
        return drawn + gridDim.x;
    }
};

// The ring: storage of 3 ints (the ids of slots 0 and 1, then the producer's count of published tiles)
// and 4 mbarriers (full 0, full 1, empty 0, empty 1), static shared memory of the kernel. `readers`:
// the arrivals that free a slot (one per consumer warp). The producer's count lives in shared memory,
// not in a register: the Hopper forward's producer has 24 (a register more spilled there).
struct TileFeed {
    u32 ids, bars;
    static constexpr int kEnd = 0x7fffffff;  // published after the last tile

    __device__ __forceinline__ SmemCount count() const { return SmemCount{ids + 8}; }  // tiles published
    __device__ __forceinline__ u32 full(int slot) const { return bars + 8 * slot; }
    __device__ __forceinline__ u32 empty(int slot) const { return bars + 8 * (2 + slot); }
    __device__ __forceinline__ void init(int readers) const {  // one thread, before the CTA's first barrier
        mbar_init(full(0), 1);
        mbar_init(full(1), 1);
        mbar_init(empty(0), readers);
        mbar_init(empty(1), readers);
        count().set(0);
        fence_barrier_init();
    }
    // The producer thread: its next tile (kEnd after the last), once the slot is free.
    __device__ __forceinline__ void publish(int tile) const {
        const int n = count().get();
        count().set(n + 1);
        const int slot = n & 1;
        mbar_wait(empty(slot), ((n >> 1) & 1) ^ 1);  // a fresh barrier counts as released
        asm volatile("st.shared.b32 [%0], %1;" :: "r"(ids + 4 * slot), "r"(tile) : "memory");
        mbar_arrive(full(slot));  // release: the id is visible to the waiters' acquire
    }
    // The producer thread: the tile it published last, read back from its slot (its callers keep the
    // id out of registers while they issue the tile's loads: the 24-register producer spilled it)
    __device__ __forceinline__ int last() const { return SmemCount{ids + 4 * ((count().get() - 1) & 1)}.get(); }
    // A consumer warp (every lane): the n-th tile; lane 0 frees the slot once the warp has read it.
    __device__ __forceinline__ int receive(int n, int lane) const {
        const int slot = n & 1;
        mbar_wait(full(slot), (n >> 1) & 1);
        int tile;
        asm volatile("ld.shared.b32 %0, [%1];" : "=r"(tile) : "r"(ids + 4 * slot) : "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(slot));
        return tile;
    }
};

}  // namespace cuflash

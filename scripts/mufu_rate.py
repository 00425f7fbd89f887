"""Throughput of the special-function unit's forms on the GPU it runs on (issue 13: softcap adds a
tanh to every score's exp2): tanh / ex2 in fp32, and the packed f16x2 / bf16x2 forms, which NVRTC
13.0 compiles to two MUFU instructions each on sm_90a (MUFU.TANH.F16 on each half). Whether a
half-precision MUFU instruction issues at a higher rate than the fp32 one decides whether the packed
forms can cut softcap's MUFU time.

    python scripts/mufu_rate.py

Each kernel: every thread runs 8 independent chains of N dependent operations (enough in flight to
cover the unit's latency), 132 x 8 blocks of 256 threads. Prints elements per clock per SM (an
element: one fp32 result or one 16-bit half of a packed result)."""
from __future__ import annotations

import cupy

N = 4096
SRC = r'''
extern "C" __global__ void k_%(name)s(unsigned* out, unsigned seed) {
    unsigned v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = seed * (threadIdx.x + 1) + j * 0x3c003c00u;
    for (int i = 0; i < %(n)d; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) asm volatile("%(op)s %%0, %%0;" : "+r"(v[j]));
    }
    unsigned r = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) r ^= v[j];
    if (r == 0x12345678u) out[0] = r;
}
'''
# (name, PTX op on a 32-bit register, elements per op)
FORMS = [("tanh_f32", "tanh.approx.f32", 1), ("ex2_f32", "ex2.approx.ftz.f32", 1),
         ("tanh_f16x2", "tanh.approx.f16x2", 2), ("tanh_bf16x2", "tanh.approx.bf16x2", 2),
         ("ex2_f16x2", "ex2.approx.f16x2", 2), ("ex2_bf16x2", "ex2.approx.ftz.bf16x2", 2)]


def main() -> None:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    sms, clock_khz = props["multiProcessorCount"], props["clockRate"]
    out = cupy.zeros(1, dtype=cupy.uint32)
    blocks, threads = sms * 8, 256
    print(f"{props['name'].decode()}: {sms} SMs, max clock {clock_khz / 1e3:.0f} MHz (rates below assume it)")
    for name, op, per in FORMS:
        src = SRC % {"name": name, "n": N, "op": op}
        if op.endswith("f32"):  # an fp32 operand: the same 32 bits, as a float register
            src = src.replace('"+r"(v[j])', '"+f"(*reinterpret_cast<float*>(&v[j]))')
        kern = cupy.RawKernel(src, f"k_{name}", options=("--gpu-architecture=sm_90a",))
        kern((blocks,), (threads,), (out, cupy.uint32(3)))
        cupy.cuda.Device().synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(5):
            kern((blocks,), (threads,), (out, cupy.uint32(3)))
        end.record()
        end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end) / 5
        elems = blocks * threads * 8 * N * per
        per_clk_sm = elems / (ms * 1e-3) / (clock_khz * 1e3) / sms
        print(f"{name:12s} {op:24s} {ms:8.3f} ms  {per_clk_sm:6.1f} elements / clock / SM")


if __name__ == "__main__":
    main()

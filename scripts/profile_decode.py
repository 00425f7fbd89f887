"""Where a decode step's time goes (issue 17): per cell of bench_decode (bf16, 32/8 heads, d128,
one query), the host time per call (perf_counter over back-to-back calls, no sync), the stream's
time per call over the same loop (events around it: the larger of host and GPU when they overlap),
the kernels' own durations (torch.profiler / CUPTI, which sees CuPy's launches too), and cProfile's
top functions of the host path. --device-lens: the lengths as a device array."""
import argparse
import cProfile
import gc
import io
import pstats
import sys
import time

sys.path.insert(0, ".")


def main():
    import cupy
    import torch

    import cuflash

    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="+", default=["1x131072", "8x8192", "64x2048"])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--splits", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--device-lens", action="store_true",
                    help="cache_seqlens as a device int32 array (a serving loop's) instead of an int")
    a = ap.parse_args()
    for cell in a.cells:
        b, n = map(int, cell.split("x"))
        kc, vc = (cupy.random.standard_normal((b, n, 8, 128), dtype=cupy.float32).astype(cupy.float16) for _ in "kv")
        q = cupy.random.standard_normal((b, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
        lens = cupy.full(b, n, dtype=cupy.int32) if a.device_lens else n
        for s in a.splits:
            fn = lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s)  # noqa: E731
            for _ in range(10):
                fn()
            cupy.cuda.Device().synchronize()
            hosts, streams = [], []
            gc.disable()  # a collection inside a loop is not the call's cost
            for _ in range(5):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn()
                t1 = time.perf_counter()
                e1.record()
                e1.synchronize()
                hosts.append((t1 - t0) / a.calls * 1e6)
                streams.append(cupy.cuda.get_elapsed_time(e0, e1) / a.calls * 1e3)
            gc.enable()
            print(f"   host us/call per loop {[round(h) for h in hosts]}, stream {[round(x) for x in streams]}")
            host_us, stream_us = sorted(hosts)[2], sorted(streams)[2]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                cupy.cuda.Device().synchronize()
            kern = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    k = kern.setdefault(ev.name[:60], [0, 0.0])
                    k[0] += 1
                    k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            gpu_us = sum(v[1] for v in kern.values()) / 20
            mb = 2 * kc.nbytes / 1e6
            print(f"== {cell} splits {s}: host {host_us:.1f} us/call, stream {stream_us:.1f} us/call, kernels "
                  f"{gpu_us:.1f} us/call ({mb / gpu_us * 1e3:.0f} GB/s of {mb:.0f} MB; stream: "
                  f"{mb / stream_us * 1e3:.0f} GB/s)")
            for name, (cnt, t) in sorted(kern.items(), key=lambda x: -x[1][1]):
                print(f"   {cnt / 20:4.1f} x {t / cnt:8.1f} us  {name}")
            if s == a.splits[0]:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(a.calls):
                    fn()
                pr.disable()
                cupy.cuda.Device().synchronize()
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
                print("\n".join(out.getvalue().splitlines()[6:30]))


if __name__ == "__main__":
    main()

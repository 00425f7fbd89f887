"""Where a kernel's warps stall, from ncu's PC sampling: reads the source page of a report
(`ncu --import R --page source --csv --print-source sass`, plain or gzipped, or stdin) and prints
the sampled total, the instructions with the most samples (each with its top stall reasons; samples
that the page's stall columns do not name, e.g. warpgroup_arrive, show as `other`) and the samples
per run of 40 instructions, so a loop's phases stand out. How the backward's two stalls of the
twenty-second session were found (docs/perf-notes.md).

    python scripts/ncu_stall_summary.py stall-ours-sass.csv.gz [--top 40] [--chunk 40]
"""
import argparse
import csv
import gzip
import io
import sys

ap = argparse.ArgumentParser()
ap.add_argument("path", nargs="?", default="-")
ap.add_argument("--top", type=int, default=40)
ap.add_argument("--chunk", type=int, default=40)
a = ap.parse_args()
if a.path == "-":
    text = sys.stdin.read()
else:
    with open(a.path, "rb") as fh:
        raw = fh.read()
    text = (gzip.decompress(raw) if a.path.endswith(".gz") else raw).decode()
rows = list(csv.reader(io.StringIO(text)))
hdr_at = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
hdr, data = rows[hdr_at], [r for r in rows[hdr_at + 1:] if len(r) == len(rows[hdr_at])]
ix = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]


def num(r, col):
    v = r[ix[col]].replace(",", "") if col in ix else ""
    return int(float(v)) if v not in ("", "-") else 0


samples = [num(r, "Warp Stall Sampling (All Samples)") for r in data]
total = sum(samples) or 1
print(f"{len(data)} instructions, {total} samples")
print(f"\ntop {a.top} instructions (index, samples, share, SASS, top reasons, times executed):")
for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:a.top]):
    r = data[i]
    reasons = sorted(((num(r, h), h[6:]) for h in stalls), reverse=True)
    named = sum(n for n, _ in reasons)
    top = [(n, h) for n, h in reasons[:2] if n] + ([(samples[i] - named, "other")] if samples[i] - named > samples[i] // 4 else [])
    print(f"{i:5d} {samples[i]:7d} {100 * samples[i] / total:5.1f}%  {r[ix['Source']].strip()[:58]:58s} "
          + " ".join(f"{h}={n}" for n, h in top) + f"  ex={num(r, 'Instructions Executed')}")
print(f"\nsamples per {a.chunk} instructions (first instruction, samples, share, most executed count there):")
for s0 in range(0, len(data), a.chunk):
    part = samples[s0:s0 + a.chunk]
    ex = max(num(r, "Instructions Executed") for r in data[s0:s0 + a.chunk])
    print(f"{s0:5d} {sum(part):7d} {100 * sum(part) / total:5.1f}%  ex<={ex:<9d} {data[s0][ix['Source']].strip()[:50]}")

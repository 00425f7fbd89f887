"""Keep a shipped tuning table across a kernel-source change that changes no tuned instance's code.

A table entry is stale when its kernel family's source fingerprint changes (cuflash/tuning_store.py),
whatever the change: a new feature's compiled-out code or a refactor of the shells makes every entry
stale although the instances the tuner timed compile to the same machine code. This script checks
that, and only that: for every entry of the table it compiles the winning and the default tile of
the entry's instance (dtype, head dim, perf class) under the base revision's sources and the working
tree's, for sm_90a, and compares their SASS (nvdisasm of the cubin: the instructions, without
addresses; a parameter struct that gains fields at its end leaves the others' constant-bank offsets,
so the instructions, as they were). Entries whose instances are unchanged get the current
fingerprint; the others stay stale (re-tune them). The other tiles an entry timed are instances of
the same templates with other constants.

Each side is dumped --repeats times (default 3), each time in a new process, and an entry is
carried where the two sides share a code for each of its instances: NVRTC 13.0 gives some sources
a different register allocation from one process to the next (bwd_sm90's d64 three-stage tile,
2026-12-04: two codes for one source, one process each), so one dump a side made such entries look
changed at random. (Within a process the code repeats.)

    python scripts/carry_tuning.py --base main tuning/nvidia-h200.json [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_DUMP = r'''
import glob, hashlib, json, os, re, shutil, subprocess, sys, sysconfig, tempfile
sys.path.insert(0, ".")
from cuda.bindings import nvrtc
from cuflash import _compile, families
from cuflash.features import Features


def nvdisasm():
    found = shutil.which("nvdisasm") or next(iter(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*",
                                                                          "bin", "nvdisasm"))), None)
    if found is None:
        sys.exit("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    return found


def sass(source):
    # cupy's getCUBIN drops the cubin's last byte (CuPy 14.2): NVIDIA's bindings instead
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"cuflash_shell.cu", 0, [], [])
    opts = [o.encode() for o in _compile.nvrtc_options(("--gpu-architecture=sm_90a",))]
    try:
        if nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            sys.exit("NVRTC failed")
        n = nvrtc.nvrtcGetCUBINSize(prog)[1]
        cubin = b" " * n
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(f.name)
    # the instructions only: addresses, encodings and symbol names dropped
    keep = [re.sub(r"/\*[0-9a-fx]+\*/", "", l).strip() for l in text.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", l)]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()


NVDISASM = nvdisasm()
out = {}
for e in json.load(open(sys.argv[1]))["entries"]:
    fam = families.REGISTRY[e["kernel"]]
    feats = Features.of_class(e["dtype"], e["head_dim"], e["perf_class"])  # ALiBi's class too
    for which in ("config", "default_config"):
        tile = fam.tile_cls(**e[which])
        key = f'{e["kernel"]}|{tile}|{feats.tag()}'
        if key not in out:
            out[key] = sass(_compile.kernel_source(tile, feats))
json.dump(out, open(sys.argv[2], "w"))
'''


def _dump(tree: str, table: str, out: str) -> subprocess.Popen:
    script = os.path.join(tree, "_carry_tuning_dump.py")
    with open(script, "w") as f:
        f.write(_DUMP)
    env = {**os.environ, "CUDA_CACHE_DISABLE": "1"}
    return subprocess.Popen([sys.executable, script, table, out], cwd=tree, env=env)


def _keys(entry) -> list:
    from cuflash import families
    from cuflash.features import Features

    fam = families.REGISTRY[entry["kernel"]]
    tag = Features.of_class(entry["dtype"], entry["head_dim"], entry["perf_class"]).tag()
    return [f'{entry["kernel"]}|{fam.tile_cls(**entry[w])}|{tag}' for w in ("config", "default_config")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--base", required=True, help="the git revision the table was tuned on")
    ap.add_argument("--write", action="store_true", help="rewrite the carried entries' source fingerprints")
    ap.add_argument("--repeats", type=int, default=3, help="dumps per side, each its own process (default 3)")
    a = ap.parse_args()
    table = os.path.abspath(a.table)
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", base_tree, a.base], check=True)
        try:
            # each side dumped in `repeats` processes: the codes an instance got, as sets (module docstring)
            codes = {"base": {}, "now": {}}
            for r in range(a.repeats):
                jobs = [_dump(base_tree, table, os.path.join(tmp, f"base{r}.json")),
                        _dump(".", table, os.path.join(tmp, f"now{r}.json"))]
                if any(j.wait() for j in jobs):
                    print("a PTX dump failed", file=sys.stderr)
                    return 1
                for side in codes:
                    for k, h in json.load(open(os.path.join(tmp, f"{side}{r}.json"))).items():
                        codes[side].setdefault(k, set()).add(h)
            before, now = codes["base"], codes["now"]
        finally:
            os.remove(os.path.join(".", "_carry_tuning_dump.py"))
            subprocess.run(["git", "worktree", "remove", "--force", base_tree], check=True)
    from cuflash import _compile, families

    doc = json.load(open(table))
    carried = stale = 0
    for e in doc["entries"]:
        same = all(before[k] & now[k] for k in _keys(e))
        fp = _compile.kernel_fingerprint(families.REGISTRY[e["kernel"]])
        print(f'{"carried" if same else "CHANGED"}  {e["kernel"]} d{e["head_dim"]} {e["perf_class"]} '
              f'causal={e["causal"]} {e["config"]}')
        if same:
            carried += 1
            e["source"] = fp
        else:
            stale += 1
    print(f"{carried} entries carried, {stale} changed (re-tune those)")
    if a.write and carried:
        with open(table, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

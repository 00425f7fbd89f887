
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
    feats = Features(e["dtype"], e["head_dim"], dropout=e["perf_class"] == "dropout", softcap=e["perf_class"] == "softcap")
    for which in ("config", "default_config"):
        tile = fam.tile_cls(**e[which])
        key = f'{e["kernel"]}|{tile}|{feats.tag()}'
        if key not in out:
            out[key] = sass(_compile.kernel_source(tile, feats))
json.dump(out, open(sys.argv[2], "w"))

"""Every tile a shipped table (tuning/*.json) names compiles for its GPU's target with the features
its class is tuned with, both NVRTC versions CI and the GPU machine use: no register spills, no
stack, no wgmma serialisation. The tuner checks this when it picks a tile, under the GPU machine's
NVRTC; this keeps it true under CI's too, and after edits carried across with
scripts/carry_tuning.py (which compares machine code, not resources)."""
from __future__ import annotations

import json
import pathlib

import pytest

from cuflash import _compile, families
from cuflash.features import Features
from tests.test_compile import _nvrtc_available

TABLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "tuning").glob("*.json"))

# (kernel, head_dim, perf class, target) -> spill bytes known and accepted, NVRTC 13.0 and 13.5: the
# H200 table's entries where the tuner kept the sm80 family's own default, which spills for sm_90
# (clean for sm_80 / 86 / 89; found by this test, 2026-12-07). On a Hopper GPU the sm80 kernels run
# only the calls the Hopper ones lack (seqused_k, split-KV, backend="sm80"). Not yet fixed: a
# default per target is not something the families have.
KNOWN_SPILLS: dict = {("fwd", 64, "softcap", "sm_90"): 40, ("fwd", 128, "softcap", "sm_90"): 4,
                      ("bwd", 128, "dropout", "sm_90"): 4}


def _instances() -> list:
    """One pytest.param(table name, entry) per (kernel, tile, perf class, dtype, target) of the shipped entries."""
    seen = {}
    for path in TABLES:
        for e in json.loads(path.read_text())["entries"]:
            fam = families.get(e["kernel"])
            target = "sm_" + e["cc"].replace(".", "") + ("a" if fam.arch_specific else "")
            key = (e["kernel"], e["perf_class"], str(fam.tile_from_dict(e["config"])), e["dtype"], target)
            seen.setdefault(key, (path.name, e, target))
    return [pytest.param(*v, id=" ".join(k)) for k, v in sorted(seen.items())]


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("table,e,target", _instances())
def test_shipped_tiles_compile_clean_for_their_class(table, e, target):
    fam = families.get(e["kernel"])
    tile = fam.tile_from_dict(e["config"])
    features = Features.of_class(e["dtype"], e["head_dim"], e["perf_class"])
    rep = _compile.compile_report(_compile.kernel_source(tile, features), target)
    log = rep["log"]
    assert rep["registers"] > 0, log
    known = KNOWN_SPILLS.get((e["kernel"], e["head_dim"], e["perf_class"], target), 0)
    if known:  # only where the entry is the family's default: a tuned pick must be clean
        assert tile == fam.untuned(e["head_dim"], features=features, causal=e["causal"]), (table, tile)
    assert rep["spill_stores"] <= known and (known or rep["spill_loads"] == 0 and rep["stack_bytes"] == 0), \
        (table, tile, log[-2000:])
    assert "serialized" not in log.lower(), (table, tile, log[-2000:])

"""Tuner search spaces and pruning, from recorded device properties of real GPUs (no GPU needed)."""
from __future__ import annotations

import pathlib

import pytest

from cuflash import families, tiles
from cuflash.features import Features
from cuflash.tune import space
from cuflash.device import DeviceProps

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "devices"
DEVICES = {p.stem: DeviceProps.from_json(p) for p in sorted(FIXTURES.glob("*.json"))}


def test_fixtures_hold_the_recorded_properties():
    a100, h100, h200, l4, rtx = (DEVICES[k] for k in ("a100-80gb", "h100-sxm", "h200", "l4", "rtx4090"))
    assert (a100.cc, a100.sm_count, a100.smem_optin, a100.regs_per_sm) == ((8, 0), 108, 163 * 1024, 65536)
    for h in (h100, h200):
        assert (h.cc, h.sm_count, h.smem_optin) == ((9, 0), 132, 227 * 1024)
    assert (l4.cc, l4.sm_count, l4.smem_optin) == ((8, 9), 58, 99 * 1024)
    assert (rtx.cc, rtx.sm_count, rtx.smem_optin) == ((8, 9), 128, 99 * 1024)
    assert a100.arch == "sm_80" and h200.arch == "sm_90" and l4.arch == "sm_89"
    assert h200.arch_specific == "sm_90a" and a100.arch_specific == "sm_80" and l4.arch_specific == "sm_89"
    assert DeviceProps.from_dict(h200.to_dict()) == h200


@pytest.mark.parametrize("name", sorted(DEVICES))
@pytest.mark.parametrize("kernel", sorted(families.REGISTRY))
@pytest.mark.parametrize("d", tiles.SUPPORTED_HEAD_DIMS)
def test_space_is_split_into_candidates_and_pruned_with_reasons(name, kernel, d):
    props = DEVICES[name]
    sp = space.build_space(families.get(kernel), d, props)
    searched = families.get(kernel).space(d, 1 << 40)
    # nothing is lost; a default outside the searched domain (a ~99 KB last resort) is added
    assert sp.size == len(searched) + (sp.default is not None and sp.default not in searched)
    for c in sp.candidates:
        assert c.structural_problem() is None
        assert c.smem_bytes <= props.smem_optin
        assert c.threads <= props.max_threads_per_block
        assert families.get(kernel).accumulator_registers(c) <= families.get(kernel).register_cap(c, props)
    for c, why in sp.pruned.items():
        assert why and space.static_problem(c, props) == why
    if sp.default is not None:  # the heuristic default is always a candidate
        assert sp.default in sp.candidates
    else:
        assert not sp.candidates


def test_forward_space_exists_on_every_gpu_and_shrinks_with_shared_memory():
    sizes = {}
    for name, props in DEVICES.items():
        for d in (64, 128):
            sp = space.build_space(families.get("fwd"), d, props)
            assert sp.candidates and sp.default is not None, (name, d)
            sizes[name, d] = len(sp.candidates)
    assert sizes["l4", 128] == sizes["rtx4090", 128] < sizes["a100-80gb", 128] < sizes["h200", 128]
    assert sizes["h100-sxm", 128] == sizes["h200", 128]


def test_shared_memory_prunes_what_fits_on_hopper_but_not_on_ada():
    cfg = tiles.FwdConfig(128, 128, 128, 8, 3)  # 224 KiB: the H200 default
    assert space.static_problem(cfg, DEVICES["h200"]) is None
    assert "shared memory" in space.static_problem(cfg, DEVICES["a100-80gb"])
    assert "shared memory" in space.static_problem(cfg, DEVICES["l4"])
    # the backward at d128 fits 99 KB only with 32-query tiles (4 warps)
    sp = space.build_space(families.get("bwd"), 128, DEVICES["l4"])
    assert sp.candidates and all(c.block_q == 32 for c in sp.candidates)
    assert sp.default == tiles.BwdConfig(128, 32, 64, 4, 2)
    # d256's searched backward tiles do not fit in 99 KB at all: the 2-warp last resort alone
    sp = space.build_space(families.get("bwd"), 256, DEVICES["l4"])
    assert sp.candidates == [tiles.BwdConfig(256, 32, 32, 2, 2)] == [sp.default]
    assert len(sp.pruned) == len(families.get("bwd").space(256, 1 << 40))


def test_register_lower_bound_prunes_sure_spills_without_compiling():
    h200 = DEVICES["h200"]
    # O (192x128) + S (192x128) fp32 over 128 threads = 384 registers per thread > 255
    why = space.static_problem(tiles.FwdConfig(128, 192, 128, 4, 2), h200)
    assert why is not None and "registers" in why
    assert space.static_problem(tiles.FwdConfig(128, 128, 128, 8, 2), h200) is None  # 128 per thread
    assert families.register_cap(256, h200) == 255 and families.register_cap(512, h200) == 128
    # a device with half the registers per block halves the cap and prunes more
    small = DeviceProps.from_dict({**h200.to_dict(), "regs_per_block": 16384})
    assert families.register_cap(256, small) == 64
    assert "registers" in space.static_problem(tiles.FwdConfig(128, 128, 128, 8, 2), small)


def test_old_gpus_get_no_configs():
    volta = DeviceProps.from_dict({**DEVICES["a100-80gb"].to_dict(), "cc": [7, 0], "name": "Tesla V100"})
    sp = space.build_space(families.get("fwd"), 64, volta)
    assert not sp.candidates and all("compute capability" in r for r in sp.pruned.values())


def test_resource_problem_from_compiled_resources():
    h200 = DEVICES["h200"]
    cfg = tiles.FwdConfig(128, 128, 64, 8, 2)
    ok = {"registers": 216, "local_bytes": 0, "smem_static_bytes": 0, "max_threads_per_block": 256}
    assert space.resource_problem(cfg, ok, h200) is None
    assert "local memory" in space.resource_problem(cfg, {**ok, "local_bytes": 24}, h200)
    assert space.resource_problem(cfg, {**ok, "local_bytes": 24}, h200, allow_local_bytes=32) is None
    big = tiles.FwdConfig(128, 256, 64, 16, 2)  # 512 threads x 216 registers > 65536
    assert "registers" in space.resource_problem(big, ok, h200)
    assert "threads per block" in space.resource_problem(cfg, {**ok, "max_threads_per_block": 128}, h200)
    assert "static" in space.resource_problem(cfg, {**ok, "smem_static_bytes": h200.smem_optin}, h200)
    # ptxas' offline report has the same meaning
    rep = {"registers": 255, "spill_stores": 20, "spill_loads": 20, "stack_bytes": 24, "smem_static_bytes": 0}
    assert "local memory" in space.resource_problem(cfg, rep, h200)


def test_config_json_round_trip_and_rejects_malformed():
    cfg = tiles.BwdConfig(128, 64, 128, 8, 2)
    assert families.get("bwd").tile_from_dict(space.config_to_dict(cfg)) == cfg
    for bad in ({"head_dim": 128}, {**space.config_to_dict(cfg), "block_q": "64"},
                {**space.config_to_dict(cfg), "extra": 1}, [1, 2], None):
        with pytest.raises(ValueError):
            families.get("bwd").tile_from_dict(bad)
    with pytest.raises(ValueError):
        families.get("nope")


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable")
def test_offline_compile_check_prunes_a_spilling_config_and_keeps_the_default():
    h200 = DEVICES["h200"]
    check = space.offline_check(Features("bfloat16", 128), h200)
    assert check(families.FWD.default(128)) is None
    # passes the static register bound (176 per thread) but spills when compiled (recorded: 20 B)
    spilling = tiles.FwdConfig(128, 128, 48, 4, 2)
    assert space.static_problem(spilling, h200) is None
    assert "local memory" in check(spilling)


def test_query_maps_cupy_device_properties(monkeypatch):
    """device.query reads the fields CuPy's getDeviceProperties returns (names as in cudaDeviceProp)."""
    import cupy

    from cuflash import device

    h = DEVICES["h200"]
    raw = {"name": h.name.encode(), "major": 9, "minor": 0, "multiProcessorCount": 132,
           "sharedMemPerBlockOptin": h.smem_optin, "sharedMemPerMultiprocessor": h.smem_per_sm,
           "regsPerBlock": 65536, "regsPerMultiprocessor": 65536, "maxThreadsPerBlock": 1024,
           "maxThreadsPerMultiProcessor": 2048, "l2CacheSize": h.l2_bytes, "totalGlobalMem": h.total_mem}
    rt = cupy.cuda.runtime
    monkeypatch.setattr(rt, "getDeviceProperties", lambda i: raw)
    monkeypatch.setattr(rt, "driverGetVersion", lambda: 13000)
    monkeypatch.setattr(rt, "runtimeGetVersion", lambda: 13000)
    monkeypatch.setattr(device, "nvrtc_version", lambda: (13, 0))
    device.query.cache_clear()
    try:
        assert device.query(0) == h
    finally:
        device.query.cache_clear()

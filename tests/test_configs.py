"""The forward search space and the heuristic default, from device properties alone."""
from cuflash._configs import FwdConfig, default_fwd_config, fwd_space, selectable_fwd_configs


def test_space_respects_shared_memory_and_structure():
    for limit in (99 * 1024, 163 * 1024, 227 * 1024):
        for d in (64, 128):
            space = fwd_space(d, limit)
            assert space, (d, limit)
            for c in space:
                assert c.smem_bytes <= limit and c.structural_problem() is None
                assert c.block_q % (16 * c.warps) == 0 and c.block_k % 16 == 0


def test_smaller_gpus_get_smaller_space():
    assert len(fwd_space(128, 99 * 1024)) < len(fwd_space(128, 163 * 1024)) < len(fwd_space(128, 227 * 1024))


def test_smem_formula():
    c = FwdConfig(128, 128, 128, 8, 3)
    assert c.smem_bytes == 2 * 128 * (128 + 2 * 3 * 128) == 229376


def test_default_falls_back_on_small_smem():
    assert default_fwd_config(128) == FwdConfig(128, 128, 128, 8, 3)
    assert default_fwd_config(128, 163 * 1024).smem_bytes <= 163 * 1024
    assert default_fwd_config(128, 99 * 1024).smem_bytes <= 99 * 1024
    assert all(c.structural_problem() is None for c in selectable_fwd_configs())

"""The families' search spaces and heuristic defaults, from device properties alone."""
from cuflash import families
from cuflash.tiles import BwdConfig, DqConfig, FwdConfig

fwd_space, default_fwd_config = families.FWD.space, families.FWD.default


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
    assert all(c.structural_problem() is None for c in families.FWD.selectable())


def test_backward_spaces_respect_shared_memory_and_structure():
    bwd_space, dq_space = families.BWD.space, families.BWD_DQ.space
    for limit in (99 * 1024, 163 * 1024, 227 * 1024):
        for d in (64, 128):
            for c in bwd_space(d, limit) + dq_space(d, limit):
                assert c.smem_bytes <= limit and c.structural_problem() is None


def test_backward_structure_rules():
    assert BwdConfig(128, 64, 96, 8, 2).structural_problem()  # block_k must be 16*warps
    assert BwdConfig(128, 48, 128, 8, 2).structural_problem()  # dS^T rows: whole 64-byte halves
    assert BwdConfig(128, 32, 128, 8, 2).structural_problem() is None  # a padded 32-query dS^T row
    assert BwdConfig(128, 64, 128, 8, 1).structural_problem()  # single-barrier ring needs 2 stages
    assert DqConfig(128, 64, 64, 8, 2).structural_problem()  # block_q must be 16*warps
    assert BwdConfig(128, 64, 128, 8, 2).structural_problem() is None
    # K, V + 2 x (Q, dO) + 2 x dS^T + 2 x (lse, delta)
    assert BwdConfig(128, 64, 128, 8, 2).smem_bytes == 2 * 128 * (256 + 256) + 4 * 128 * 64 + 2 * 2 * 64 * 4


def test_backward_defaults():
    default_bwd_config, default_dq_config = families.BWD.default, families.BWD_DQ.default
    assert default_bwd_config(128) == BwdConfig(128, 64, 128, 8, 3)
    assert default_bwd_config(128, 163 * 1024) == BwdConfig(128, 64, 128, 8, 2)
    for d in (64, 128):
        assert default_bwd_config(d, 163 * 1024).smem_bytes <= 163 * 1024
        assert default_dq_config(d, 99 * 1024).smem_bytes <= 99 * 1024
    assert default_bwd_config(64, 99 * 1024).smem_bytes <= 99 * 1024

"""CUFLASH_EMULATOR_ARCH: the emulator backend plans, compiles and launches what the named GPU
would -- its shared-memory limit's curated tiles, its SM count, ``-arch`` for the kernels (no
tensor cores before sm_80) -- and refuses a name it does not know."""
import numpy as np
import pytest

import cuflash
import oracle
from cuflash import emulator as em
from cuflash import emulator_backend, tiling


@pytest.fixture
def arch_env(monkeypatch):
    def set_arch(arch):
        if arch is None:
            monkeypatch.delenv(tiling.EMULATOR_ARCH_ENV, raising=False)
        else:
            monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, arch)
    return set_arch


def _plan(arch):
    return tiling.plan("flash_fwd_tc_masked", 64, 64, "float16", limit=tiling.EMULATOR_ARCHES[arch])


@pytest.mark.parametrize("arch", [None, "sm_80", "sm_90", "sm_86", "sm_75"])
def test_plans_and_launches_for_the_named_gpu(arch_env, arch, rng):
    arch_env(arch)
    Nq = 200
    q, k, v = oracle.qkv(rng, (1, 2, Nq, 64), (1, 2, Nq, 64), dtype="float16")
    feat = dict(window=(32, 0))
    m = cuflash.memory_analysis(Nq, 64, "float16", backend="emulator", **feat)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **feat)
    st = em.last_launch_stats()
    name = arch or "sm_80"
    assert m["sram_limit_bytes"] == tiling.EMULATOR_ARCHES[name] and name in m["sram_limit_source"]
    if name == "sm_75":  # no tensor cores: the SIMT kernel
        assert st["kernel"] == m["kernel"] == "flash_fwd_masked"
    else:
        want = _plan(name)
        assert st["kernel"] == m["kernel"] == "flash_fwd_tc_masked"
        assert (m["block_q"], m["block_kv"]) == (want.block_q, want.block_kv)
        assert st["dynamic_shared_bytes"] == want.shared_bytes == m["sram_bytes_per_block"]
        assert st["block"][0] == want.threads == m["threads_per_block"]
    assert emulator_backend.runtime().device_key == ("emulator", False, arch)
    assert tiling.device_sm_count("emulator")[0] == tiling.EMULATOR_SMS[name]
    oracle.check_forward(o, q, k, v, lse=lse, dtype="float16", **feat)


def test_the_grid_distinguishes_the_archs():
    """The case above picks different tiles on sm_80 and sm_90 (else it would test nothing)."""
    a, b = _plan("sm_80"), _plan("sm_90")
    assert (a.block_q, a.block_kv) != (b.block_q, b.block_kv)


def test_an_unknown_arch_is_refused(arch_env):
    arch_env("sm_99")
    q = np.zeros((1, 1, 8, 16), np.float16)
    with pytest.raises(ValueError, match="CUFLASH_EMULATOR_ARCH='sm_99'.*sm_75, sm_80, sm_86, sm_89, sm_90"):
        cuflash.tiled_attention(q, q, q, backend="emulator")
    with pytest.raises(ValueError, match="sm_99"):
        cuflash.memory_analysis(8, 16, "float16", backend="emulator")
    arch_env("")  # empty: unset
    assert tiling.emulator_arch() == "sm_80"

"""cuflash.emulator: the sm_90 asynchronous-copy plumbing of kernels_cu/hopper.cuh.

mbarrier phases (arrival count, transaction bytes, parity) and cp.async.bulk global ->
shared, through a producer/consumer pipeline (tests/emulator/kernels/hopper.cu) checked
against NumPy; a read of a copy's destination before its mbarrier wait (reported by
memcheck; NaN without it), a wait no arrival or copy can complete (a deadlock, not a hang),
a bulk copy from outside the arrays (memcheck), the sm_90 requirement, named barriers
(bar.sync, and bar.arrive with the ping-pong of two warpgroups it makes possible), and the
machine code NVRTC makes of it for sm_90a.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

SRC = Path(__file__).resolve().parent / "kernels" / "hopper.cu"
TILE, STAGES = 256, 2
SHARED = STAGES * TILE * 4 + 2 * STAGES * 8


def line_of(text):
    lines = SRC.read_text().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if text in ln)


@pytest.fixture(scope="module")
def mods():
    cache = {}

    def get(arch="sm_90a", engine=()):
        key = (arch, engine)
        if key not in cache:
            cache[key] = em.RawModule(path=SRC, options=(f"-arch={arch}", *engine))
        return cache[key]
    return get


def expected_sums(x, nconsumers):
    """y[t][j] = x[t][j] + x[t][j + nc] + ... in float32, in the kernel's order."""
    ntiles = x.shape[0]
    y = np.zeros((ntiles, nconsumers), np.float32)
    for k in range(TILE // nconsumers):
        y += x[:, k * nconsumers:(k + 1) * nconsumers]
    return y


def run_pipeline(mod, ntiles, mode=0, threads=96, seed=0):
    nc = threads - 32
    x = np.random.default_rng(seed).standard_normal((ntiles, TILE)).astype(np.float32)
    y = np.full((ntiles, nc), np.nan, np.float32)
    mod.get_function("bulk_pipeline")(1, threads, (x, y, np.int32(ntiles), np.int32(mode)), shared_mem=SHARED)
    return x, y


@pytest.mark.parametrize("ntiles", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("threads", [96, 160])
def test_bulk_pipeline_matches_numpy(mods, ntiles, threads):
    x, y = run_pipeline(mods(), ntiles, threads=threads, seed=ntiles)
    np.testing.assert_array_equal(y, expected_sums(x, threads - 32))
    st = em.last_launch_stats()
    assert st["global_bytes_read"] == x.nbytes  # each tile copied once
    assert st["global_bytes_written"] == y.nbytes


def test_bulk_pipeline_random_schedule(mods, monkeypatch):
    for seed in (1, 2, 3):
        monkeypatch.setenv("CUFLASH_EMULATOR_SCHEDULE", f"random:{seed}")
        x, y = run_pipeline(mods(), 7, seed=seed)
        np.testing.assert_array_equal(y, expected_sums(x, 64))


def test_bulk_pipeline_on_threads(mods):
    """The threaded engine (race_check builds) blocks and wakes mbarrier waiters the same way."""
    mod = mods(engine=("-DCUFLASH_EMULATOR_THREADS=1",))
    x, y = run_pipeline(mod, 5, seed=5)
    np.testing.assert_array_equal(y, expected_sums(x, 64))
    with pytest.raises(em.LaunchError, match="64 at an mbarrier wait"):
        run_pipeline(mod, 3, mode=2)


def test_race_check(mods):
    """Under ThreadSanitizer the wait orders the copy before the reads; skipping it is a race."""
    mod = em.RawModule(path=SRC, options=("-arch=sm_90a",), race_check=True)
    x, y = run_pipeline(mod, 5, seed=5)
    np.testing.assert_array_equal(y, expected_sums(x, 64))
    with pytest.raises(em.RaceError, match=f"hopper.cu:{line_of('acc += tiles')}"):
        run_pipeline(mod, 2, mode=1)


def test_mbarrier_count_and_parity(mods):
    out = np.zeros(128, np.int32)
    mods().get_function("mbarrier_count")(1, 128, (out, np.int32(0)))
    np.testing.assert_array_equal(out, 129)  # nobody passed the wait before all 128 arrived


def test_read_before_the_wait_is_reported(mods):
    with pytest.raises(em.MemcheckError) as e:
        run_pipeline(mods(), 2, mode=1)
    msg = str(e.value)
    assert msg.startswith("memcheck: shared-memory load of 4 bytes in kernel bulk_pipeline"), msg
    assert f"hopper.cu:{line_of('acc += tiles')}" in msg, msg
    assert "cp.async.bulk of 1024 bytes (issued by thread 0) is still writing there" in msg, msg


def test_read_before_the_wait_sees_nan_without_memcheck(mods):
    nc = 64
    x = np.ones((2, TILE), np.float32)
    y = np.zeros((2, nc), np.float32)
    with em.memcheck(False), pytest.raises(em.LaunchError, match=r"block \(0,0,0\) of kernel bulk_pipeline ended "
                                                                  r"with 2 cp.async.bulk copies still in flight"):
        mods().get_function("bulk_pipeline")(1, 32 + nc, (x, y, np.int32(2), np.int32(1)), shared_mem=SHARED)
    assert np.isnan(y).all()  # the consumers summed the poison, not the ones


@pytest.mark.parametrize("ntiles", [1, 3])
def test_wait_that_cannot_complete_is_a_deadlock(mods, ntiles):
    # the last tile's expect_tx announces 1024 bytes that no copy delivers
    with pytest.raises(em.LaunchError, match=r"deadlock in block \(0,0,0\): 0 thread\(s\) wait at __syncthreads\(\), "
                                             r"0 at a warp collective .*, 64 at an mbarrier wait"):
        run_pipeline(mods(), ntiles, mode=2)


def test_missing_arrival_is_a_deadlock(mods):
    with pytest.raises(em.LaunchError, match=r"deadlock.*127 at an mbarrier wait"):
        mods().get_function("mbarrier_count")(1, 128, (np.zeros(128, np.int32), np.int32(1)))


def test_bulk_source_out_of_bounds(mods):
    with pytest.raises(em.MemcheckError) as e:
        run_pipeline(mods(), 3, mode=3)
    msg = str(e.value)
    assert msg.startswith("memcheck: out-of-bounds cp.async.bulk source of 1024 bytes"), msg
    assert f"hopper.cu:{line_of('bulk_copy_g2s(tiles')}" in msg and "argument 'x'" in msg, msg


def test_needs_sm90(mods):
    with pytest.raises(em.LaunchError, match=r"mbarrier.init needs sm_90 or later \(emulating sm_80\)"):
        run_pipeline(mods("sm_80"), 1)


def test_nvrtc_sm90a_machine_code(sm90_nvrtc):
    _nvrtc, _sass = sm90_nvrtc
    root = SRC.parents[3]
    r = _nvrtc.compile(SRC.read_text(), SRC.name, options=("-arch=sm_90a", f"-I{root / 'kernels_cu'}",
                                                            f"-I{SRC.parent}", "-std=c++17"))
    assert r.warnings == []
    sass = _sass.disassemble(r.cubin)
    ops = set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    print(sorted(o for o in ops if o.startswith(("SYNCS", "UBLKCP", "FENCE"))))
    assert "SYNCS.EXCH.64" in ops                    # mbarrier.init
    assert "SYNCS.ARRIVE.TRANS64.A1T0" in ops        # mbarrier.arrive
    assert "SYNCS.ARRIVE.TRANS64" in ops             # mbarrier.arrive.expect_tx
    assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in ops   # mbarrier.try_wait.parity
    assert "UBLKCP.S.G" in ops                       # cp.async.bulk global -> shared
    assert "FENCE.VIEW.ASYNC.S" in ops               # fence.proxy.async.shared::cta
    assert "BAR.ARV" in ops                          # bar.arrive (named_barrier_arrive)


def run_named(mod, threads, mode):
    out = np.full((2, threads), -1, np.int32)
    mod.get_function("named_barrier")(1, threads, (out, np.int32(mode)))
    return out


@pytest.mark.parametrize("threads", [96, 288])
def test_named_barrier_orders_the_warps(mods, threads):
    """bar.sync 4, n: the n threads of warps 1.. (warp 0 has returned) pass together, at both
    phase parities; each reads a store of another warp made before the barrier."""
    out = run_named(mods(), threads, 0)
    n = threads - 32
    for r in range(2):
        want = [1000 * r + 32 + (t - 32 + 32) % n for t in range(32, threads)]
        np.testing.assert_array_equal(out[r, 32:], want)


def test_named_barrier_race_check(mods):
    """Under ThreadSanitizer the barrier orders the stores before the reads; without it, a race."""
    mod = em.RawModule(path=SRC, options=("-arch=sm_90a",), race_check=True)
    out = run_named(mod, 160, 0)
    assert out[1, 32] == 1000 + 64
    with pytest.raises(em.RaceError, match=f"hopper.cu:{line_of('(int)slot[r][32 + (tid - 32 + 32) % n]')}"):
        run_named(mod, 160, 1)


def test_named_barrier_misuse_is_reported(mods):
    with pytest.raises(em.LaunchError, match=r"bar.sync 4 at .*hopper.cu:\d+: this thread's count 128 differs "
                                             r"from the 96 of the threads already at the barrier"):
        run_named(mods(), 160, 2)
    with pytest.raises(em.LaunchError, match=r"deadlock in block \(0,0,0\)"):
        run_named(mods(), 160, 3)


def run_arrive(mod, threads, mode):
    out = np.full((2, threads), -1, np.int32)
    mod.get_function("named_arrive")(1, threads, (out, np.int32(mode)))
    return out


@pytest.mark.parametrize("threads", [96, 288])
@pytest.mark.parametrize("mode", [0, 1])
def test_named_arrive_releases_the_syncing_threads(mods, threads, mode):
    """bar.arrive 5, n by the producer half and bar.sync 5, n by the consumer half complete the
    barrier together, at both parities; the consumers read the producers' stores.  mode 1: the
    producers go on to a barrier the consumers pass first (bar.arrive does not wait)."""
    out = run_arrive(mods(), threads, mode)
    half = (threads - 32) // 2
    for r in range(2):
        np.testing.assert_array_equal(out[r, 32:], [1000 * r + 32 + (t - 32) % half for t in range(32, threads)])


def test_named_arrive_race_check(mods):
    """Under ThreadSanitizer the arrival orders the producers' stores before the consumers'
    reads; without the barrier, a race at the read."""
    mod = em.RawModule(path=SRC, options=("-arch=sm_90a",), race_check=True)
    out = run_arrive(mod, 160, 0)
    assert out[1, 96] == 1000 + 32
    with pytest.raises(em.RaceError, match=f"hopper.cu:{line_of('(int)slot[r][tid - half]')}"):
        run_arrive(mod, 160, 2)


@pytest.mark.parametrize("race_check", [False, True])
def test_named_arrive_ping_pong(mods, race_check):
    """Two halves alternate turns through two barriers, each syncing at its own and arriving at
    the other's: the log of turns is 0 1 0 1 ..., its writes ordered by the barriers alone."""
    mod = em.RawModule(path=SRC, options=("-arch=sm_90a",), race_check=True) if race_check else mods()
    out = run_arrive(mod, 288, 3)
    np.testing.assert_array_equal(out[0, :8], [0, 1] * 4)


def test_named_arrive_misuse_is_reported(mods):
    """bar.arrive takes bar.sync's checks (here a count past the block's threads), and a thread
    that arrives again before the phase it arrived at completed is reported: on the GPU its
    second arrival would complete the phase without the threads the barrier waits for."""
    with pytest.raises(em.LaunchError, match=r"bar.arrive 5, 192 at .*hopper.cu:\d+: the count must be a multiple "
                                             r"of 32 up to the block's 160 threads"):
        run_arrive(mods(), 160, 4)
    with pytest.raises(em.LaunchError, match=r"bar.arrive 5 at .*hopper.cu:\d+: this thread comes to the barrier a "
                                             r"second time before the phase it arrived at completed"):
        run_arrive(mods(), 160, 5)

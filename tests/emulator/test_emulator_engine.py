"""cuflash.emulator: the execution engine (fibers; real threads for race checks).

The CUDA threads of a block run as fibers on one OS thread (fiber_engine.h),
or as real threads with -DCUFLASH_EMULATOR_THREADS=1 (what race_check=True
builds use).  Checked here: context switches with deep stacks and large
frames, the per-thread floating-point state, failures in the middle of a
block (trap, C++ exception, assert) unwinding every thread, more than 65,535
blocks, the watchdog, stack overflow reports, the pseudo-random scheduling
order, the ucontext fallback, that both engines compute the same, and that processes needing
the same library at once build it once.
"""
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

HERE = Path(__file__).resolve().parent
ENGINE_CU = HERE / "kernels" / "emulator_only" / "engine.cu"
SELFTEST_CPP = HERE / "kernels" / "emulator_only" / "engine_selftest.cpp"
BASICS_CU = HERE / "kernels" / "basics.cu"
REDUCE_CU = HERE / "kernels" / "reduce.cu"
ROOT = HERE.parent

# engine name -> extra compile options
ENGINES = {"fibers": (), "threads": ("-DCUFLASH_EMULATOR_THREADS=1",), "ucontext": ("-DCUFLASH_EMULATOR_UCONTEXT=1",)}


@pytest.fixture(scope="module")
def engine_mods():
    cache = {}

    def get(engine="fibers", path=ENGINE_CU):
        if (engine, path) not in cache:
            cache[engine, path] = em.RawModule(path=path, options=ENGINES[engine])
        return cache[engine, path]
    return get


def _run_script(code, env=None, timeout=300):
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("engine", ["fibers", "ucontext", "threads"])
def test_deep_stacks_survive_switches(engine_mods, engine):
    """40 levels of 4 KiB frames per thread, a barrier and a shuffle at every level."""
    levels, threads, blocks = 40, 64, 2
    bad = np.full(blocks * threads, -1, np.int32)
    acc = np.zeros(blocks * threads, np.uint32)
    engine_mods(engine).get_function("deep_stack")(blocks, threads, (np.int32(levels), bad, acc))
    assert (bad == 0).all()
    t = np.arange(threads)
    want = sum(range(levels + 1)) + (levels + 1) * (t ^ 1)
    np.testing.assert_array_equal(acc.reshape(blocks, threads), np.broadcast_to(want, (blocks, threads)))


@pytest.mark.parametrize("engine", ["fibers", "ucontext", "threads"])
def test_rounding_mode_is_per_thread(engine_mods, engine):
    x = np.array([1.0, 3.0], np.float32)
    out = np.zeros(2 * 32, np.float32)
    engine_mods(engine).get_function("rounding_per_thread")(2, 32, (x, out))
    down, nearest = np.uint32(0x3EAAAAAA), np.uint32(0x3EAAAAAB)
    bits = out.view(np.uint32).reshape(2, 32)
    assert (bits[:, 0] == down).all() and (bits[:, 1:] == nearest).all()
    # the calling thread still rounds to nearest
    assert np.float32(1.0) / np.float32(3.0) == out[1]


@pytest.mark.parametrize("engine", ["fibers", "threads"])
@pytest.mark.parametrize("mode,match", [(0, r"__trap\(\) called \[block \(1,0,0\), thread \(37,0,0\)\]"),
                                        (1, r"C\+\+ exception in device code: boom from device code"),
                                        (2, r"assertion failed: mode != 2")])
def test_failure_mid_block_unwinds_every_thread(engine_mods, engine, mode, match):
    mod = engine_mods(engine)
    out = np.zeros(3 * 64, np.int32)
    with pytest.raises(em.LaunchError, match=f"fail_midway.*{match}"):
        mod.get_function("fail_midway")(3, 64, (out, np.int32(mode), np.int32(37)))
    # block 0 completed, block 2 never ran; every thread's stack was unwound
    np.testing.assert_array_equal(out[:64], np.arange(64) ^ 1)
    assert (out[64:] == 0).all()
    live = np.full(1, -1, np.int32)
    mod.get_function("live_objects")(1, 1, (live,))
    assert live[0] == 0
    # the module stays usable
    mod.get_function("fail_midway")(2, 64, (out, np.int32(0), np.int32(999)))
    np.testing.assert_array_equal(out[:128], np.tile(np.arange(64) ^ 1, 2))


def test_more_than_65535_blocks_in_seconds(engine_mods):
    """Grids beyond the old 65,535 limit (batch x heads folded into x) must stay fast."""
    nblocks, threads = 70_000, 32
    out = np.full(nblocks * threads, -1, np.int32)
    k = engine_mods().get_function("many_blocks")
    t0 = time.perf_counter()
    k(nblocks, threads, (out,))
    dt = time.perf_counter() - t0
    np.testing.assert_array_equal(out, np.arange(nblocks * threads) ^ 1)
    assert em.last_launch_stats()["blocks"] == nblocks
    # about 0.2 s when the machine is idle; threads took minutes
    assert dt < 20, f"{nblocks} blocks of {threads} threads took {dt:.1f} s"


@pytest.mark.parametrize("engine,threads", [("fibers", 1024), ("threads", 256)])
def test_many_blocks_3d_grid_and_big_blocks(engine_mods, engine, threads):
    grid = (7, 5, 3)
    n = 7 * 5 * 3 * threads
    out = np.full(n, -1, np.int32)
    engine_mods(engine).get_function("many_blocks")(grid, threads, (out,))
    np.testing.assert_array_equal(out, np.arange(n) ^ 1)


def test_launches_of_two_libraries_from_two_python_threads(engine_mods):
    """Each launching OS thread runs its own fibers; the thread_local context is per OS thread."""
    ids_k = em.RawModule(path=BASICS_CU).get_function("index_map")
    many_k = engine_mods().get_function("many_blocks")
    errors = []

    def run_ids():
        try:
            for _ in range(20):
                ids = np.full(6 * 96, -1, np.int32)
                ids_k(6, 96, (ids, np.zeros((6 * 96, 12), np.int32)))
                np.testing.assert_array_equal(ids, np.arange(6 * 96))
        except Exception as e:  # reported below
            errors.append(e)

    def run_many():
        try:
            for _ in range(20):
                out = np.full(300 * 64, -1, np.int32)
                many_k(300, 64, (out,))
                np.testing.assert_array_equal(out, np.arange(300 * 64) ^ 1)
        except Exception as e:
            errors.append(e)
    ts = [threading.Thread(target=f) for f in (run_ids, run_many, run_ids)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("engine", ["fibers", "threads"])
def test_watchdog_ends_a_thread_spinning_while_others_wait(engine):
    code = (
        "import numpy as np\nfrom cuflash import emulator as em\n"
        f"m = em.RawModule(path={str(ENGINE_CU)!r}, options={ENGINES[engine]!r})\n"
        "m.get_function('spin_after_barrier')(2, 64, (np.zeros(1, np.int32), np.int32(45)))\n"
        "print('returned')\n")
    r = _run_script(code, env={"CUFLASH_EMULATOR_TIMEOUT": "1"})
    assert r.returncode != 0 and "returned" not in r.stdout
    assert "kernel spin_after_barrier did not finish within 1 s" in r.stderr


def test_stack_overflow_is_reported():
    """A guard region below each fiber stack turns an overflow into a report naming the thread."""
    code = (
        "import faulthandler; faulthandler.enable()\n"  # as under pytest: the report must still come first
        "import numpy as np\nfrom cuflash import emulator as em\n"
        # another library launches first: it maps the shared stack pool and installs the handler
        f"em.RawModule(path={str(BASICS_CU)!r}).get_function('index_map')(1, 64, "
        "(np.zeros(64, np.int32), np.zeros((64, 12), np.int32)))\n"
        f"m = em.RawModule(path={str(ENGINE_CU)!r})\n"
        "m.get_function('overflow')(3, 64, (np.zeros(3, np.uint32), np.int32(33), np.int32(1 << 20)))\n"
        "print('returned')\n")
    r = _run_script(code, env={"CUFLASH_EMULATOR_STACK_KB": "128"})
    assert r.returncode != 0 and "returned" not in r.stdout
    assert ("stack overflow in kernel overflow, block (2,0,0), thread (33,0,0): "
            "the fiber stack of 128 KiB is exhausted (set CUFLASH_EMULATOR_STACK_KB") in r.stderr, r.stderr[-3000:]


def test_stack_size_is_configurable(engine_mods, monkeypatch):
    k = engine_mods().get_function("overflow")
    out = np.zeros(2, np.uint32)
    monkeypatch.setenv("CUFLASH_EMULATOR_STACK_KB", "1024")
    k(2, 32, (out, np.int32(5), np.int32(150)))  # 150 levels of 4 KiB: 600 KiB
    assert out[1] == 150 * 151 // 2
    monkeypatch.setenv("CUFLASH_EMULATOR_STACK_KB", "lots")
    with pytest.raises(em.LaunchError, match="CUFLASH_EMULATOR_STACK_KB=lots is not a size"):
        k(1, 32, (out, np.int32(5), np.int32(1)))


def test_fixed_order_runs_threads_by_index(engine_mods, monkeypatch):
    monkeypatch.delenv("CUFLASH_EMULATOR_SCHEDULE", raising=False)  # the default
    winner = np.full(50, -2, np.int32)
    engine_mods().get_function("first_writer")(50, 128, (winner,))
    assert (winner == 0).all()


def test_random_order_is_reproducible_and_varies(engine_mods, monkeypatch):
    k = engine_mods().get_function("first_writer")

    def winners(schedule):
        monkeypatch.setenv("CUFLASH_EMULATOR_SCHEDULE", schedule)
        w = np.full(50, -2, np.int32)
        k(50, 128, (w,))
        return w
    a, a2, b = winners("random:1"), winners("random:1"), winners("random:2")
    np.testing.assert_array_equal(a, a2)
    assert len(set(a.tolist())) > 10 and (a != b).any()
    assert ((a >= 0) & (a < 128)).all()
    assert (winners("fixed") == 0).all()
    assert len(set(winners("random").tolist())) > 10
    monkeypatch.setenv("CUFLASH_EMULATOR_SCHEDULE", "shuffled")
    with pytest.raises(em.LaunchError, match="CUFLASH_EMULATOR_SCHEDULE=shuffled is not understood"):
        k(1, 32, (np.zeros(1, np.int32),))


@pytest.mark.parametrize("schedule", ["fixed", "random:7"])
def test_correct_kernels_do_not_depend_on_the_order(engine_mods, monkeypatch, schedule):
    monkeypatch.setenv("CUFLASH_EMULATOR_SCHEDULE", schedule)
    red = engine_mods("fibers", REDUCE_CU)
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    out = np.full(4, np.nan, np.float32)
    red.get_function("block_sum")(4, 96, (x, out, np.int32(1000), np.int32(250)))
    np.testing.assert_allclose(out, x.reshape(4, 250).astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    basics = engine_mods("fibers", BASICS_CU)
    y = np.full(300, np.nan, np.float32)
    basics.get_function("reverse_early_exit")(3, 128, (np.arange(300, dtype=np.float32), y, np.int32(300)))
    want = np.concatenate([np.arange(300, dtype=np.float32)[b * 128:(b + 1) * 128][::-1] for b in range(3)])
    np.testing.assert_array_equal(y, want)
    out = np.full(2 * 3 * 4, -1, np.int32)  # each of the 2 blocks writes its own 3 x 4 slice
    basics.get_function("sync_reductions")(2, 37, (out, np.int32(4)))
    t = np.arange(37)
    want = [[int((t % (r + 2) == 0).sum()), 1, int(r == 0)] for r in range(4)]
    np.testing.assert_array_equal(out.reshape(2, 4, 3), [want, want])


@pytest.mark.parametrize("engine", ["threads"])
def test_engines_agree(engine_mods, engine):
    """The same kernels on the threaded engine (race_check builds): results, deadlock
    reports, counters.  (The ucontext fallback runs the engine kernels above and the
    self-test program's.)"""
    red = engine_mods(engine, REDUCE_CU)
    x = np.random.default_rng(9).standard_normal(700).astype(np.float32)
    outs = {}
    for e in ("fibers", engine):
        out = np.full(2, np.nan, np.float32)
        engine_mods(e, REDUCE_CU).get_function("block_sum")(2, 96, (x, out, np.int32(700), np.int32(350)))
        outs[e] = (out, em.last_launch_stats()["global_bytes_read"])
    np.testing.assert_array_equal(outs["fibers"][0], outs[engine][0])
    assert outs["fibers"][1] == outs[engine][1] == 4 * 700
    basics = engine_mods(engine, BASICS_CU)
    with pytest.raises(em.LaunchError, match=r"divergent_barrier.*deadlock in block \(0,0,0\): 63 thread\(s\) wait at "
                                             r"__syncthreads\(\), 1 at a warp collective"):
        basics.get_function("divergent_barrier")(1, 64, (np.zeros(64, np.float32),))
    partial = em.RawModule(code='#include "portable.cuh"\nextern "C" __global__ void p(float* o) '
                                '{ o[threadIdx.x] = __shfl_sync(0xffffu, 1.0f, 0); }\n', options=ENGINES[engine])
    with pytest.raises(em.LaunchError, match="__shfl_sync with mask 0x0000ffff"):
        partial.get_function("p")(1, 32, (np.zeros(32, np.float32),))


# The engine kernels in a standalone C++ program (no Python): natively, and
# cross-compiled for aarch64 under qemu-user when
# aarch64-linux-gnu-g++ and qemu-aarch64 are installed, so that the aarch64
# context switch is checked on an x86-64 machine too.
SELFTEST_VARIANTS = {
    "native": (os.environ.get("CXX", "g++"), (), ()),
    "aarch64-qemu": ("aarch64-linux-gnu-g++", (), ("qemu-aarch64", "-L", "/usr/aarch64-linux-gnu")),
}


@pytest.mark.parametrize("variant", list(SELFTEST_VARIANTS))
def test_engine_selftest_program(tmp_path, variant):
    cxx, flags, runner = SELFTEST_VARIANTS[variant]
    if variant == "aarch64-qemu" and (shutil.which(cxx) is None or shutil.which(runner[0]) is None):
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt: g++-aarch64-linux-gnu qemu-user)")
    exe = tmp_path / "engine_selftest"
    from cuflash.emulator._module import ENGINE_SOURCE, HOST_HEADER
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", *flags, "-x", "c++", "-include", str(HOST_HEADER),
                        f"-I{em.kernels_cu_dir()}", str(SELFTEST_CPP), str(ENGINE_SOURCE), "-o", str(exe)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    r = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([*runner, str(exe), "overflow"], capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "returned" not in r.stdout
    assert "stack overflow in kernel overflow, block (2,0,0), thread (33,0,0)" in r.stderr, r.stderr[-3000:]


def _guard_regions():
    """64 KiB PROT_NONE mappings of this process: one below every fiber stack."""
    n = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        n += perms == "---p" and hi - lo == 64 * 1024
    return n


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_fiber_stacks_are_shared_by_libraries(engine_mods, monkeypatch):
    """One pool for the process: a library loaded later reuses the stacks of earlier ones
    (pools per library held ~14,000 stacks after the test suite)."""
    monkeypatch.delenv("CUFLASH_EMULATOR_STACK_KB", raising=False)
    out = np.full(2 * 128, -1, np.int32)
    engine_mods().get_function("many_blocks")(2, 128, (out,))
    before = _guard_regions()
    src = ('#include "portable.cuh"\n// a library of its own: test_fiber_stacks_are_shared_by_libraries\n'
           'extern "C" __global__ void ids(int* o) { __syncthreads(); o[threadIdx.x] = threadIdx.x; }\n')
    ids = np.full(128, -1, np.int32)
    em.RawModule(code=src).get_function("ids")(1, 128, (ids,))
    np.testing.assert_array_equal(ids, np.arange(128))
    assert _guard_regions() == before


def test_processes_build_a_library_once(tmp_path):
    """Processes that need the same library at once (parallel test workers, ranks on one host)
    compile it once, and the engine object it links once: the others wait on the build locks
    and load the result.  A CXX wrapper logs each compile (the g++ calls with -o: "engine" for
    engine.cpp, "build" for a library) and sleeps, so all three overlap."""
    log = tmp_path / "builds.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\ncase " $* " in *"engine.cpp -o "*) echo engine >> "{log}"; sleep 2;;\n'
                   f'  *" -o "*) echo build >> "{log}"; sleep 2;; esac\n'
                   f'exec "{shutil.which("g++") or "g++"}" "$@"\n')
    cxx.chmod(0o755)
    script = ("import cuflash.emulator as em\n"
              "m = em.RawModule(code='extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }')\n"
              "m.compile()\n")
    env = dict(os.environ, CXX=str(cxx), CUFLASH_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT.parent)] + sys.path))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(3)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0, 0]
    assert log.read_text().split() == ["engine", "build"]
    assert len(list((tmp_path / "cache" / "emulator").glob("*.so"))) == 1
    assert len(list((tmp_path / "cache" / "emulator").glob("engine_*.o"))) == 1


def test_second_library_of_a_configuration_precompiles_the_host_header(tmp_path):
    """The first library of a configuration parses the host header; the second precompiles it
    (host_<hash>.h.gch in the cache) and it and every later one include it -- a precompiled
    header that g++ accepts for the libraries' flags (``-H`` marks a used one with ``!``) --
    and their kernels compute the same.  CUFLASH_EMULATOR_PCH=0 builds none."""
    from cuflash.emulator import _module as M
    code = 'extern "C" __global__ void k(float* x) {{ x[threadIdx.x] = {}f; }}'
    script = ("import sys, numpy as np, cuflash.emulator as em\n"
              "for v in sys.argv[1:]:\n"
              f"    m = em.RawModule(code={code!r}.format(v))\n"
              "    x = np.zeros(32, np.float32)\n"
              "    m.get_function('k')((1,), (32,), (x,))\n"
              "    assert (x == float(v)).all(), x\n")
    cache = tmp_path / "cache"

    def run(*values, **env):
        env = dict(os.environ, CUFLASH_CACHE_DIR=str(cache), **env,
                   PYTHONPATH=os.pathsep.join([str(ROOT.parent)] + sys.path))
        r = subprocess.run([sys.executable, "-c", script, *values], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return sorted((cache / "emulator").glob("host_*.h.gch"))

    assert run("1.5", CUFLASH_EMULATOR_PCH="0") == []
    assert run("2.5") == []                    # the configuration's first library
    gch = run("3.5", "4.5")                    # the second precompiles, the third reuses
    assert len(gch) == 1 and gch[0].stat().st_size > 0
    assert len(list((cache / "emulator").glob("*.so"))) == 4
    stub = gch[0].with_suffix("")              # host_<hash>.h
    cmd = [M._cxx(), *(f for f in M._LIB_FLAGS if f != "-shared"), "-DCUFLASH_ARCH=800", "-x", "c++",
           "-include", str(stub), "-H", "-fsyntax-only", "-"]
    r = subprocess.run(cmd, input="int main() { return 0; }\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"! {gch[0]}" in r.stderr, r.stderr[:2000]

"""cuflash.emulator: CUDA C test kernels (tests/emulator/kernels/*.cu) executed on the CPU.

SIMT execution model: grids and blocks, barriers with early exit, warp
collectives, dynamic shared memory poison, atomics, 16-bit conversions,
argument conversion, launch statistics and failure modes.
"""
import os
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em


KERNELS = Path(__file__).resolve().parent / "kernels"

ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.fixture(scope="module")
def basics():
    return em.RawModule(path=KERNELS / "basics.cu")


@pytest.fixture(scope="module")
def reduce_mod():
    return em.RawModule(path=KERNELS / "reduce.cu")


def prmt(a, b, c):
    """PTX prmt.b32 d, a, b, c in its generic form (the PTX ISA's definition): byte n of d is
    byte (c >> 4n) & 7 of {b, a}, or that byte's sign replicated where bit 3 of the nibble is
    set."""
    src = (np.uint64(b) << np.uint64(32)) | np.asarray(a, np.uint64)
    d = np.zeros(np.shape(a), np.uint64)
    for n in range(4):
        ctl = (c >> (4 * n)) & 0xF
        byte = (src >> np.uint64(8 * (ctl & 7))) & np.uint64(0xFF)
        if ctl & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        d |= byte << np.uint64(8 * n)
    return d.astype(np.uint32)


def test_half_mask_is_prmt_sign_replicate(basics):
    """portable.cuh's cuflash_prmt(x, 0, 0x9988) (the backward's dropout pair masks) is
    prmt.b32 x, 0, 0x9988 on the GPU; the emulator's model of it agrees with the PTX ISA's prmt
    on every combination of the two bits that matter and on random words."""
    rng = np.random.default_rng(5)
    x = np.concatenate([np.array([0, 0x80, 0x8000, 0x8080, 0xFFFFFFFF, 0x7F7F7F7F, 0xFFFF7F7F],
                                 np.uint32), rng.integers(0, 2 ** 32, 4096, dtype=np.uint32)])
    y = np.full(x.size, 0xDEADBEEF, np.uint32)
    basics.get_function("half_mask")((-(-x.size // 128),), (128,), (x, y, np.int32(x.size)))
    np.testing.assert_array_equal(y, prmt(x, 0, 0x9988))
    assert list(y[:4]) == [0, 0xFFFF, 0xFFFF0000, 0xFFFFFFFF]


def test_prmt_with_a_register_selector(basics):
    """portable.cuh's cuflash_prmt (the backward's dropout bit gather and lane exchange) agrees
    with the PTX ISA's generic prmt on random words and selectors, sign-replicating nibbles
    among them, and on the selectors the kernels use."""
    rng = np.random.default_rng(6)
    n = 4096
    a, b = (rng.integers(0, 2 ** 32, n, dtype=np.uint32) for _ in range(2))
    sel = rng.integers(0, 2 ** 16, n, dtype=np.uint32)
    sel[:4] = [0xFDB9, 0x6240, 0x3715, 0x9988]
    y = np.full(n, 0xDEADBEEF, np.uint32)
    basics.get_function("prmt_any")((n // 128,), (128,), (a, b, sel, y, np.int32(n)))
    np.testing.assert_array_equal(y, [prmt(a[i:i + 1], b[i:i + 1], int(sel[i]))[0] for i in range(n)])


@pytest.mark.parametrize("t", [0, 1, 0x1999, 0x7FFF, 0x8000, 0x8001, 0xE666, 0xFFFF])
def test_keep_halves_is_the_16_bit_compare(basics, t):
    """philox.cuh's cuflash_keep_halves puts x's low half >= t at bit 15 and its high half >= t
    at bit 31, for thresholds on both sides of 2^15 (its majority's two cases), on every low
    half with a random high half and on halves at and next to t, 0 and 2^15."""
    rng = np.random.default_rng(t)
    edge = np.array(sorted({v & 0xFFFF for v in (t - 1, t, t + 1, 0, 0x7FFF, 0x8000, 0xFFFF)}), np.uint32)
    lo = np.concatenate([np.arange(2 ** 16, dtype=np.uint32), np.repeat(edge, edge.size)])
    hi = np.concatenate([rng.integers(0, 2 ** 16, 2 ** 16, dtype=np.uint32), np.tile(edge, edge.size)])
    x = (hi << np.uint32(16)) | lo
    y = np.full(x.size, 0xDEADBEEF, np.uint32)
    basics.get_function("keep_halves")((-(-x.size // 256),), (256,), (x, np.uint32(t), y, np.int32(x.size)))
    np.testing.assert_array_equal((y >> np.uint32(15)) & np.uint32(1), (lo >= t).astype(np.uint32))
    np.testing.assert_array_equal(y >> np.uint32(31), (hi >= t).astype(np.uint32))


@pytest.mark.parametrize("n,per_block,threads", [(1000, 250, 96), (257, 257, 128), (31, 31, 32), (64, 16, 64)])
def test_block_sum_shuffles_and_shared(reduce_mod, n, per_block, threads):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    nblocks = -(-n // per_block)
    out = np.full(nblocks, np.nan, np.float32)
    reduce_mod.get_function("block_sum")((nblocks,), (threads,), (x, out, np.int32(n), np.int32(per_block)))
    want = [x[b * per_block:(b + 1) * per_block].astype(np.float64).sum() for b in range(nblocks)]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    st = em.last_launch_stats()
    assert st["global_bytes_read"] == 4 * n
    assert st["global_bytes_written"] == 4 * nblocks
    assert (st["blocks"], st["threads_per_block"], st["dynamic_shared_bytes"]) == (nblocks, threads, 0)


def test_warp_primitives(reduce_mod):
    x = np.arange(32, dtype=np.float32) * 1.5 - 3.0
    out = np.full(4 * 32, np.nan, np.float32)
    ballots = np.full(3 * 32, -7, np.int32)
    reduce_mod.get_function("warp_ops")(1, 32, (x, ballots, out))
    lane = np.arange(32)
    np.testing.assert_array_equal(out[0:32], x[(lane * 7) % 32])
    np.testing.assert_array_equal(out[32:64], np.where(lane >= 3, x[np.maximum(lane - 3, 0)], x))
    np.testing.assert_array_equal(out[64:96], np.where(lane + 5 < 32, x[np.minimum(lane + 5, 31)], x))
    np.testing.assert_array_equal(out[96:128], x[lane ^ 6])
    want_ballot = int(sum(1 << int(i) for i in lane[x > 10]))
    assert (ballots[0:32].view(np.uint32) == want_ballot).all()
    assert (ballots[32:64] == int((x > 30).any())).all()
    assert (ballots[64:96] == int((x >= 0).all())).all()


@pytest.mark.parametrize("grid,block", [(5, 7), ((3, 2), (4, 3)), ((2, 3, 2), (2, 2, 3)), ((1, 1, 4), (33,))])
def test_grid_and_block_dimensions(basics, grid, block):
    g = (grid,) if isinstance(grid, int) else grid
    b = (block,) if isinstance(block, int) else block
    g3, b3 = tuple(g) + (1,) * (3 - len(g)), tuple(b) + (1,) * (3 - len(b))
    total = int(np.prod(g3) * np.prod(b3))
    ids = np.full(total, -1, np.int32)
    coords = np.full((total, 12), -1, np.int32)
    basics.get_function("index_map")(grid, block, (ids, coords))
    np.testing.assert_array_equal(ids, np.arange(total))
    want = [(bx, by, bz, tx, ty, tz, *b3, *g3)
            for bz in range(g3[2]) for by in range(g3[1]) for bx in range(g3[0])
            for tz in range(b3[2]) for ty in range(b3[1]) for tx in range(b3[0])]
    np.testing.assert_array_equal(coords, np.array(want, np.int32))


@pytest.mark.parametrize("n", [1, 100, 128, 300])
def test_early_exit_drops_out_of_barrier(basics, n):
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, np.nan, np.float32)
    nblocks = -(-n // 128)
    basics.get_function("reverse_early_exit")(nblocks, 128, (x, y, np.int32(n)))
    want = np.concatenate([x[b * 128:(b + 1) * 128][::-1] for b in range(nblocks)])
    np.testing.assert_array_equal(y, want)


def test_dynamic_shared_memory_is_nan_poisoned(basics):
    threads, blocks = 64, 3
    out = np.zeros(blocks * threads, np.float32)
    basics.get_function("dyn_shared_poison")(blocks, threads, (out,), shared_mem=4 * threads)
    out = out.reshape(blocks, threads)
    t = np.arange(threads)
    # every block starts from fresh poison: the odd slots are NaN in every block,
    # not the previous block's values
    assert np.isnan(out[:, 1::2]).all()
    np.testing.assert_array_equal(out[:, 0::2], (np.arange(blocks)[:, None] * 1000 + t[None, 0::2]).astype(np.float32))
    assert em.last_launch_stats()["dynamic_shared_bytes"] == 4 * threads


def test_divergent_barrier_is_an_error_naming_the_kernel(basics):
    out = np.zeros(64, np.float32)
    with pytest.raises(em.LaunchError, match=r"divergent_barrier.*deadlock.*__syncthreads"):
        basics.get_function("divergent_barrier")(1, 64, (out,))
    # the module stays usable after a failed launch
    ids = np.full(4, -1, np.int32)
    basics.get_function("index_map")(1, 4, (ids, np.zeros((4, 12), np.int32)))
    np.testing.assert_array_equal(ids, np.arange(4))


@pytest.mark.parametrize("threads", [37, 96])
def test_syncthreads_count_or_and(basics, threads):
    rounds = 4
    out = np.full(2 * 3 * rounds, -1, np.int32)  # two blocks, a slice each
    basics.get_function("sync_reductions")(2, threads, (out, np.int32(rounds)))
    t = np.arange(threads)
    want = [[int((t % (r + 2) == 0).sum()), int(r < threads), int(r == 0)] for r in range(rounds)]
    np.testing.assert_array_equal(out.reshape(2, rounds, 3), [want, want])


def test_float_atomic_add(basics):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 7, 1000).astype(np.int32)
    out = np.zeros(7, np.float32)
    basics.get_function("histogram")(8, 128, (x, out, np.int32(1000)))
    np.testing.assert_array_equal(out, np.bincount(x, minlength=7).astype(np.float32))
    st = em.last_launch_stats()
    assert st["global_bytes_read"] == 1000 * (4 + 4) and st["global_bytes_written"] == 1000 * 4


def test_half_and_bfloat16_round_to_nearest_even(basics):
    rng = np.random.default_rng(1)
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 2.9e-8, 3.0e-8, 1e-40,
                        np.inf, -np.inf, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                        3.3895314e38, 3.4e38], np.float32)
    x = np.concatenate([special, (rng.standard_normal(2000) * 10.0 ** rng.integers(-8, 6, 2000)).astype(np.float32)])
    n = x.size
    h = np.zeros(n, np.float16)
    b = np.zeros(n, ml_dtypes.bfloat16)
    back = np.full(n, np.nan, np.float32)
    basics.get_function("convert16")(-(-n // 128), 128, (x, h, b, back, np.int32(n)))
    with np.errstate(over="ignore"):  # the values beyond 65504 are there to overflow
        want_h = x.astype(np.float16)
    np.testing.assert_array_equal(h.view(np.uint16), want_h.view(np.uint16))
    np.testing.assert_array_equal(b.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(back, h.astype(np.float32) + b.astype(np.float32))
    # NaN stays NaN in both
    xn = np.array([np.nan], np.float32)
    hn, bn, bk = np.zeros(1, np.float16), np.zeros(1, ml_dtypes.bfloat16), np.zeros(1, np.float32)
    basics.get_function("convert16")(1, 32, (xn, hn, bn, bk, np.int32(1)))
    assert np.isnan(hn[0]) and np.isnan(bn.astype(np.float32)[0]) and np.isnan(bk[0])


def test_math_intrinsics(basics):
    x = np.linspace(-5, 5, 37).astype(np.float32)
    out = np.full((x.size, 8), np.nan, np.float32)
    basics.get_function("math_ops")(2, 32, (x, out, np.int32(x.size)))
    xd = x.astype(np.float64)
    want = np.stack([np.exp(xd), np.exp2(xd), np.exp(xd), 1 / np.sqrt(np.abs(xd) + 1), np.maximum(xd, 0.25),
                     np.full_like(xd, -np.inf), np.log(np.abs(xd) + 1), np.maximum(xd, 0.5)], axis=1)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_scalar_arguments_converted_by_signature(basics):
    out = np.full(6, np.nan)
    k = basics.get_function("scalars")
    k(1, 1, (out, -3, 4000000000, -(2 ** 40), np.float32(0.5), 1e300, True))
    np.testing.assert_array_equal(out, [-3, 4000000000, -(2 ** 40), 0.5, 1e300, 1])
    k(1, 1, (out, np.int32(7), np.uint32(8), np.int64(9), np.float32(0.25), np.float64(2.5), np.bool_(False)))
    np.testing.assert_array_equal(out, [7, 8, 9, 0.25, 2.5, 0])


F = np.float32(0.5)


@pytest.mark.parametrize("args,match", [
    ((np.zeros(6), np.int64(1), 1, 1, F, 1.0, True), r"parameter 'a' \(int a\).*int32.*int64"),
    ((np.zeros(6), 1.5, 1, 1, F, 1.0, True), r"parameter 'a'.*expected an int"),
    ((np.zeros(6), 1, 1, 1, np.float64(0.5), 1.0, True), r"parameter 'd'.*float32"),
    ((np.zeros(6), 1, 1, 1, 0.5, 1.0, True), r"parameter 'd'.*numpy.float32, not a Python float"),
    ((np.zeros(6), 1, 1, 1, 1, 1.0, True), r"parameter 'd'.*numpy.float32, not a Python int"),
    ((np.zeros(6), 1, -1, 1, F, 1.0, True), r"parameter 'b'.*does not fit"),
    ((np.zeros(6), 1, 1, 1, F, 1, True), r"parameter 'e'.*expected a float"),
    ((5, 1, 1, 1, F, 1.0, True), r"parameter 'out'.*numpy.ndarray"),
    ((np.zeros(6), 1, 1, 1, F, 1.0), r"takes 7 arguments"),
])
def test_argument_mismatch_is_a_type_error(basics, args, match):
    with pytest.raises(TypeError, match=match):
        basics.get_function("scalars")(1, 1, args)


def test_launch_configuration_errors(basics):
    k = basics.get_function("dyn_shared_poison")
    out = np.zeros(2048, np.float32)
    with pytest.raises(ValueError, match="1024 threads"):
        k(1, (1025,), (out,))
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        k(1, 32, (out,), shared_mem=64 * 1024)
    k.max_dynamic_shared_size_bytes = 64 * 1024  # opt in, as cupy.RawKernel's attribute
    k(1, 32, (out,), shared_mem=64 * 1024)
    with pytest.raises(ValueError, match="C-contiguous"):
        k(1, 32, (out[::2],))
    with pytest.raises(AttributeError, match="no __global__ function 'nope'.*index_map"):
        basics.get_function("nope")


SCALED_SRC = """#include "portable.cuh"
#ifdef SCALE
// exists only when -DSCALE=... is given: out[i] = x[i] * SCALE
extern "C" __global__ void scaled(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(out + i, gload(x + i) * (float)(SCALE));
}
#endif
extern "C" __global__ void arch(int* out) { gstore(out, (int)__CUDA_ARCH__); }
"""


def test_defines_select_code_and_are_part_of_the_cache_key():
    x = np.arange(10, dtype=np.float32)
    for scale in (2, 3):
        mod = em.RawModule(code=SCALED_SRC, options=(f"-DSCALE={scale}", "--use_fast_math", "-std=c++17",
                                                     "--gpu-architecture=sm_90"))
        out = np.full(10, np.nan, np.float32)
        mod.get_function("scaled")(1, 32, (x, out, np.int32(10)))
        np.testing.assert_array_equal(out, x * scale)
        arch = np.zeros(1, np.int32)
        mod.get_function("arch")(1, 1, (arch,))
        assert arch[0] == 900  # -arch sets the emulated __CUDA_ARCH__
    with pytest.raises(AttributeError, match="scaled"):
        em.RawModule(code=SCALED_SRC).get_function("scaled")
    with pytest.raises(ValueError, match="not understood"):
        em.RawModule(code=SCALED_SRC, options=("--frobnicate",))


def test_code_string_with_include_path_and_compile_error(tmp_path):
    (tmp_path / "twice.cuh").write_text("__device__ inline float twice(float v) { return 2.0f * v; }\n")
    src = ('#include "portable.cuh"\n#include "twice.cuh"\n'
           'extern "C" __global__ void f(float* y) { gstore(y + threadIdx.x, twice((float)threadIdx.x)); }\n')
    y = np.zeros(8, np.float32)
    em.RawModule(code=src, options=(f"-I{tmp_path}",)).get_function("f")(1, 8, (y,))
    np.testing.assert_array_equal(y, 2 * np.arange(8))
    bad = '#include "portable.cuh"\nextern "C" __global__ void g(float* y) { y[0] = undefined_name; }\n'
    with pytest.raises(em.CompileError, match="undefined_name"):
        em.RawModule(code=bad).get_function("g")


def test_launches_from_several_python_threads(reduce_mod):
    """Static __shared__ arrays belong to the library: concurrent launches must not mix them."""
    import threading
    k = reduce_mod.get_function("block_sum")
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(512).astype(np.float32) for _ in range(4)]
    outs = [np.full(4, np.nan, np.float32) for _ in range(4)]
    errors = []

    def run(i):
        try:
            for _ in range(3):
                k((4,), (128,), (xs[i], outs[i], np.int32(512), np.int32(128)))
        except Exception as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, x.reshape(4, 128).astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


def test_endless_loop_ends_the_process_with_a_message(tmp_path):
    """A thread spinning outside every barrier cannot be stopped: the watchdog
    (CUFLASH_EMULATOR_TIMEOUT) ends the process instead of hanging CI."""
    import subprocess
    import sys
    script = tmp_path / "spin.py"
    script.write_text(
        "import numpy as np\nfrom cuflash import emulator as em\n"
        "src = '#include \"portable.cuh\"\\n"
        "extern \"C\" __global__ void spin(volatile int* f) { while (f[0] == 0) {} }\\n'\n"
        "em.RawModule(code=src).get_function('spin')(1, 4, (np.zeros(1, np.int32),))\n"
        "print('returned')\n")
    env = dict(os.environ, CUFLASH_EMULATOR_TIMEOUT="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0 and "returned" not in r.stdout
    assert "kernel spin did not finish within 1 s" in r.stderr

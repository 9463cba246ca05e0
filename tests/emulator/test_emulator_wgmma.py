"""cuflash.emulator: warpgroup MMA (wgmma.mma_async m64nNk16, sm_90a) of kernels_cu/hopper.cuh.

The operands are placed in shared memory by this file, from the canonical layouts of the PTX
ISA ("Shared Memory Matrix Layout": CuTe layouts, then the swizzle on the address), written
here independently of the emulator's descriptor decoding; the products are checked against
NumPy exactly (small multiples of 1/4: every sum is exact).  Then the asynchrony the emulator
holds a kernel to (tests/emulator/kernels/wgmma.cu), and the machine code NVRTC makes for
sm_90a.
"""
import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - a test dependency
    ml_dtypes = None

SRC = Path(__file__).resolve().parent / "kernels" / "wgmma.cu"
ROOT = SRC.parents[3]
T = 8  # 16-bit elements per 16 bytes


def line_of(text):
    return next(i for i, ln in enumerate(SRC.read_text().splitlines(), 1) if text in ln)


@pytest.fixture(scope="module")
def mods():
    cache = {}

    def get(n=64, bf16=False, ta=False, tb=False, arch="sm_90a", race_check=False):
        key = (n, bf16, ta, tb, arch, race_check)
        if key not in cache:
            cache[key] = em.RawModule(path=SRC, options=(f"-arch={arch}", f"-DWG_N={n}", f"-DWG_BF16={int(bf16)}",
                                                        f"-DWG_TA={int(ta)}", f"-DWG_TB={int(tb)}"),
                                      race_check=race_check)
        return cache[key]
    return get


def _digits(i, shape):
    """Colexicographic digits of index i in a CuTe mode of `shape` (last extent unbounded)."""
    out = []
    for s in shape[:-1]:
        out.append(i % s)
        i //= s
    return out + [i]


def canonical_offset(mn, k, major, swizzle, lbo, sbo):
    """Byte offset of element (mn, k) before the swizzle: the PTX ISA's canonical layouts."""
    le, se = lbo // 2, sbo // 2  # in elements
    x = swizzle // 16
    if major == "K":
        shape = ((8, None), (T, None))
        stride = ((T, se), (1, le)) if swizzle == 0 else ((x * T, se), (1, T))
    else:
        shape = ((T, 1, None), (8, None)) if swizzle == 0 else ((T, x, None), (8, None))
        stride = ((1, T, se), (T, le)) if swizzle == 0 else ((1, T, le), (x * T, se))
    elems = sum(d * s for d, s in zip(_digits(mn, shape[0]), stride[0]))
    elems += sum(d * s for d, s in zip(_digits(k, shape[1]), stride[1]))
    return 2 * elems


def swizzled(addr, swizzle):
    return addr if swizzle == 0 else addr ^ (((addr >> 7) & (swizzle // 16 - 1)) << 4)


def geometry(major, swizzle, mn, k, alt=False):
    """(lbo, sbo, kstep) of a dense layout of an mn x k operand; `alt` swaps which of the
    two repeat directions comes first (so a decoder that confuses LBO and SBO fails)."""
    if major == "K" and swizzle == 0:     # 8 x 16 B cores; LBO along k, SBO along mn
        lbo, sbo = (128, 128 * (k // 8)) if not alt else (128 * (mn // 8), 128)
        return lbo, sbo, 2 * lbo
    if major == "K":                      # rows of `swizzle` bytes, k inside one row
        return 16, 8 * swizzle * (2 if alt else 1), 32
    if swizzle == 0:                      # cores of 8 k-rows x 8 mn; SBO along mn, LBO along k
        sbo, lbo = (128, 128 * (mn // 8)) if not alt else (128 * (k // 8), 128)
        return lbo, sbo, 2 * lbo
    atom = 8 * swizzle                    # 8 k-rows x `swizzle` bytes of mn
    lbo, sbo = (atom, atom * (mn // (swizzle // 2))) if not alt else (atom * (k // 8), atom)
    return lbo, sbo, 2 * sbo


def place(img, base, values, major, swizzle, lbo, sbo):
    """Write the (mn, k) matrix `values` (uint16 bits) into img at base; return the last byte."""
    used = set()
    top = 0
    for (i, j), v in np.ndenumerate(values):
        a = swizzled(base + canonical_offset(i, j, major, swizzle, lbo, sbo), swizzle)
        assert a not in used, "the test's layout overlaps itself"
        used.add(a)
        img[a:a + 2] = np.frombuffer(np.uint16(v).tobytes(), np.uint8)
        top = max(top, a + 2)
    return top


def bits(x, bf16):
    if bf16:
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    return x.astype(np.float16).view(np.uint16)


def fragment_coords(n):
    """(row, col) of each thread's registers: thread-major, as the kernel stores them."""
    tid = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    lane = tid % 32
    row = 16 * (tid // 32) + lane // 4 + 8 * ((i >> 1) & 1)
    col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
    return row, col


def run_ss(mods, n, a_major, b_major, swizzle_a, swizzle_b, steps, init=False, mode=0, alt=False, seed=0, bf16=False,
           arch="sm_90a"):
    """wg_ss on a module built for these operand majors; (out, expected D fragments, extras)."""
    mod = mods(n, bf16, a_major == "MN", b_major == "MN", arch)
    rng = np.random.default_rng(seed)
    K = 16 * steps
    A = rng.integers(-3, 4, (64, K)) * 0.25
    B = rng.integers(-3, 4, (n, K)) * 0.25
    la, sa, ka = geometry(a_major, swizzle_a, 64, K, alt)
    lb, sb, kb = geometry(b_major, swizzle_b, n, K, not alt)
    img = np.full(1 << 18, 0xff, np.uint8)  # unused bytes read as NaN
    top = place(img, 0, bits(A, bf16), a_major, swizzle_a, la, sa)
    b_off = -(-top // 1024) * 1024
    top = place(img, b_off, bits(B, bf16), b_major, swizzle_b, lb, sb)
    size = -(-top // 16) * 16
    img = img[:size].copy()
    pa = np.array([0, la, sa, swizzle_a, ka], np.int32)
    pb = np.array([b_off, lb, sb, swizzle_b, kb], np.int32)
    out = np.full((3 if mode == 5 else 1) * 128 * (n // 2), -7.0, np.float32)
    fn = mod.get_function("wg_ss")
    fn.max_dynamic_shared_size_bytes = size + 1024  # past 48 KB at N = 256 with spread-out layouts
    fn(1, 128, (img.view(np.uint32).reshape(-1, 4).copy(), np.int32(size // 16), pa, pb, np.int32(steps),
                np.int32(init), np.int32(mode), out), shared_mem=size + 1024)
    D = A @ B.T
    row, col = fragment_coords(n)
    expect = D[row, col] + (0.5 * (np.arange(n // 2) + 1) if init else 0.0)
    return out, expect, (A, B, row, col)


LAYOUTS = [("K", 0), ("K", 32), ("K", 64), ("K", 128), ("MN", 0), ("MN", 32), ("MN", 64), ("MN", 128)]


# each layout as A with another as B, and with itself
SS_PAIRS = [(LAYOUTS[i], LAYOUTS[(i + 3) % 8]) for i in range(8)] + [(LAYOUTS[i], LAYOUTS[i]) for i in range(8)]


def _steps(am, bm, asw, bsw):
    """k16 steps of a case: one where a 32-byte K-major row holds all of k (K = 16)."""
    return 1 if "K" in (am, bm) and 32 in (asw, bsw) else 2


@pytest.mark.parametrize("a_layout,b_layout", SS_PAIRS)
def test_ss_layouts(mods, a_layout, b_layout):
    """Every swizzle mode, K-major and M/N-major, for A and for B: D = A B exactly."""
    (am, asw), (bm, bsw) = a_layout, b_layout
    for alt in (False, True):
        out, expect, _ = run_ss(mods, 64, am, bm, asw, bsw, _steps(am, bm, asw, bsw), alt=alt,
                                seed=hash((a_layout, b_layout, alt)) % 1000)
        np.testing.assert_array_equal(out.reshape(expect.shape), expect)


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("n", [8, 256])
def test_ss_bf16_and_extreme_n(mods, n):
    out, expect, _ = run_ss(mods, n, "K", "MN", 128, 64, 2, init=True, seed=n, bf16=True)
    np.testing.assert_array_equal(out.reshape(expect.shape), expect)


def test_accumulate_and_chain(mods):
    """Four wgmma on one accumulator before one wait (K = 64) added to D's value at issue."""
    out, expect, _ = run_ss(mods, 64, "K", "MN", 128, 128, 4, init=True, seed=3)
    np.testing.assert_array_equal(out.reshape(expect.shape), expect)


def tc_block_fma(c, products):
    """The tensor cores' sum as cuda_host.h models it (tc_block_fma), written again: the
    accumulator and the exact products aligned to the largest one's exponent with 24 + 3 bits
    kept (cut toward zero), summed exactly, then cut to float32 toward zero."""
    from fractions import Fraction
    addends = [float(c)] + [float(p) for p in products]
    nonzero = [a for a in addends if a != 0.0]
    if not nonzero:
        return np.float32(c)
    emax = max(np.frexp(a)[1] for a in nonzero)
    unit = Fraction(2) ** (emax - 24 - 3)
    total = sum(int(Fraction(a) / unit) for a in addends) * unit  # int() cuts toward zero
    f = np.float32(float(total))
    if abs(Fraction(float(f))) > abs(total):
        f = np.nextafter(f, np.float32(0))
    return f


def test_tensor_core_rounding(mods):
    """Random float16 values, two chained k16 steps: each register is the tensor cores' sum
    (blocks of 8 products in k order, the accumulator first), bit for bit."""
    rng = np.random.default_rng(5)
    K = 32
    A = rng.standard_normal((64, K)).astype(np.float16)
    B = rng.standard_normal((64, K)).astype(np.float16)
    la, sa, ka = geometry("K", 128, 64, K)
    img = np.full(1 << 14, 0xff, np.uint8)
    place(img, 0, A.view(np.uint16), "K", 128, la, sa)
    place(img, 8192, B.view(np.uint16), "K", 128, la, sa)
    out = np.zeros(128 * 32, np.float32)
    mods().get_function("wg_ss")(1, 128, (img.view(np.uint32).reshape(-1, 4).copy(), np.int32(img.size // 16),
                                          np.array([0, la, sa, 128, ka], np.int32),
                                          np.array([8192, la, sa, 128, ka], np.int32), np.int32(2), np.int32(0),
                                          np.int32(0), out), shared_mem=img.size + 1024)
    row, col = fragment_coords(64)
    got = out.reshape(row.shape)
    a64, b64 = A.astype(np.float64), B.astype(np.float64)
    for idx in [(0, 0), (5, 7), (37, 20), (127, 31), (64, 3), (90, 16)]:
        r, cc = row[idx], col[idx]
        acc = np.float32(0)
        for k0 in range(0, K, 8):
            acc = tc_block_fma(acc, a64[r, k0:k0 + 8] * b64[cc, k0:k0 + 8])
        assert got[idx] == acc, (idx, got[idx], acc)
    exact = (a64 @ b64.T)[row, col]
    assert np.max(np.abs(got - exact) / (np.abs(exact) + 1)) < 1e-6


def run_rs(mods, tb, mode=0):
    rng = np.random.default_rng(11)
    n = 32
    A = rng.integers(-3, 4, (64, 16)) * 0.25
    B = rng.integers(-3, 4, (n, 16)) * 0.25
    major = "MN" if tb else "K"
    lb, sb, _ = geometry(major, 64, n, 16)
    img = np.full(1 << 13, 0xff, np.uint8)
    top = place(img, 0, bits(B, False), major, 64, lb, sb)
    size = -(-top // 16) * 16
    out = np.zeros(128 * (n // 2), np.float32)
    mods(n, False, False, tb).get_function("wg_rs")(
        1, 128, (img[:size].view(np.uint32).reshape(-1, 4).copy(), np.int32(size // 16), bits(A, False).copy(),
                 np.array([0, lb, sb, 64, 0], np.int32), np.int32(1), np.int32(mode), out), shared_mem=size + 1024)
    row, col = fragment_coords(n)
    return out.reshape(row.shape), (A @ B.T)[row, col] + 0.5 * (np.arange(n // 2) + 1)


@pytest.mark.parametrize("tb", [False, True])
def test_rs_form(mods, tb):
    """A from registers (the mma.m16n8k16 fragment), B by descriptor."""
    got, want = run_rs(mods, tb)
    np.testing.assert_array_equal(got, want)


def test_rs_a_registers_in_flight(mods):
    with pytest.raises(em.LaunchError, match="its A registers were written before the wgmma.wait_group"):
        run_rs(mods, False, mode=1)


def test_race_check(mods):
    """Under ThreadSanitizer, with the block's threads as real threads: the same results; the
    store to an operand in flight is reported, by ThreadSanitizer (a race with another thread's
    read of it at issue, at the store's line) or by the emulator's own check at the wait,
    whichever the threads' order lets come first."""
    rc = lambda *a, **k: mods(*a, **k, race_check=True)  # noqa: E731
    out, expect, _ = run_ss(rc, 64, "K", "MN", 128, 64, 2, init=True, seed=9)
    np.testing.assert_array_equal(out.reshape(expect.shape), expect)
    with pytest.raises((em.RaceError, em.LaunchError),
                       match=f"wgmma.cu:{line_of('smem[a.offset] ^= 0x40')}|was written before the wgmma.wait_group"):
        run_ss(rc, 64, "K", "K", 128, 128, 1, mode=2)


def test_read_before_the_wait_is_nan(mods):
    out, expect, _ = run_ss(mods, 64, "K", "K", 128, 128, 1, mode=1)
    assert np.isnan(out).all()


def test_two_groups_wait_in_order(mods):
    """wait<1> completes the older group only: D1 is ready, D2 still NaN; wait<0> completes D2."""
    out, _, (A, B, row, col) = run_ss(mods, 64, "K", "MN", 64, 64, 2, mode=5)
    d1, d2_early, d2 = out.reshape(3, *row.shape)
    np.testing.assert_array_equal(d1, (A[:, :16] @ B[:, :16].T)[row, col])
    assert np.isnan(d2_early).all()
    np.testing.assert_array_equal(d2, (A[:, 16:] @ B[:, 16:].T)[row, col])


def test_store_to_an_operand_in_flight(mods):
    with pytest.raises(em.LaunchError, match=r"wgmma.mma_async at .*wgmma.cu:\d+: its shared-memory operand "
                                             r"\(byte 0\) was written before the wgmma.wait_group"):
        run_ss(mods, 64, "K", "K", 128, 128, 1, mode=2)


def test_missing_fence(mods):
    with pytest.raises(em.LaunchError, match="without a wgmma.fence since the launch or the last wgmma.wait_group"):
        run_ss(mods, 64, "K", "K", 128, 128, 1, mode=3)


def test_return_in_flight(mods):
    with pytest.raises(em.LaunchError, match=r"returned with a wgmma.mma_async in flight \(issued at .*wgmma.cu:\d+"):
        run_ss(mods, 64, "K", "K", 128, 128, 1, mode=4)


def test_missing_proxy_fence(mods):
    """Operands stored by the threads (generic proxy) and read by wgmma (async proxy) need a
    fence.proxy.async between: under memcheck (the tests' default) its absence is reported;
    without memcheck (no store log) the launch runs."""
    with em.memcheck():
        run_ss(mods, 64, "K", "K", 128, 128, 1)  # fenced: fine
        with pytest.raises(em.LaunchError, match=r"wgmma.mma_async \(A\) at .*wgmma.cu:\d+ reads shared byte \d+, "
                                                 r"which thread \d+ stored \(generic proxy\) with no fence.proxy.async"):
            run_ss(mods, 64, "K", "K", 128, 128, 1, mode=8)
    with em.memcheck(False):
        out, expect, _ = run_ss(mods, 64, "K", "K", 128, 128, 1, mode=8)
    np.testing.assert_array_equal(out.reshape(expect.shape), expect)


def test_write_to_d_in_flight(mods):
    with pytest.raises(em.LaunchError, match="accumulator register 0 was written while the wgmma was in flight"):
        run_ss(mods, 64, "K", "K", 128, 128, 1, mode=6)


def test_setmaxnreg(mods):
    """setmaxnreg by a whole warpgroup runs (the emulator has no register file to resize); a
    count ptxas refuses (not a multiple of 8 in 24..256) does not compile."""
    out, expect, _ = run_ss(mods, 64, "K", "K", 128, 128, 1, mode=7)
    np.testing.assert_array_equal(out.reshape(expect.shape), expect)
    src = '#include "hopper.cuh"\nextern "C" __global__ void k() { setmaxnreg_dec<20>(); }\n'
    with pytest.raises(em.CompileError, match="setmaxnreg: 24..256 registers, a multiple of 8"):
        em.RawModule(code=src, options=("-arch=sm_90a",)).compile()


def test_needs_a_whole_warpgroup(mods):
    img = np.zeros(16, np.uint32).reshape(-1, 4)
    p = np.array([0, 16, 1024, 128, 32], np.int32)
    with pytest.raises(em.LaunchError, match="has no complete warpgroup"):
        mods().get_function("wg_ss")(1, 64, (img, np.int32(4), p, p, np.int32(1), np.int32(0), np.int32(0),
                                             np.zeros(64 * 32, np.float32)), shared_mem=64 + 1024)


def test_descriptor_outside_shared_memory(mods):
    img = np.zeros(64, np.uint32).reshape(-1, 4)
    p = np.array([0, 16, 1024, 128, 32], np.int32)
    with pytest.raises(em.LaunchError, match=r"outside the 1280 bytes of dynamic shared memory"):
        mods().get_function("wg_ss")(1, 128, (img, np.int32(16), p, p, np.int32(1), np.int32(0), np.int32(0),
                                              np.zeros(128 * 32, np.float32)), shared_mem=256 + 1024)


def test_needs_sm90(mods):
    with pytest.raises(em.LaunchError, match=r"wgmma.fence needs sm_90 or later \(emulating sm_80\)"):
        run_ss(mods, 64, "K", "K", 128, 128, 1, arch="sm_80")


def test_profile_counts_wgmma(mods):
    with em.profiling():
        run_ss(mods, 64, "K", "K", 128, 128, 2)
    prof = em.last_launch_profile()
    assert prof["counts"]["wgmma.mma_async (per k16)"] == 2 * 4  # per warp, as the SASS counts HGMMA


def test_header_is_the_generators_output():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gen_wgmma.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_nvrtc_sm90a_machine_code(sm90_nvrtc):
    """NVRTC compiles the GPU side (wgmma_sm90.cuh's inline PTX) for sm_90a: HGMMA in the SASS,
    SS and RS forms, f16 and bf16, with the fence, commit and wait around them."""
    _nvrtc, _sass = sm90_nvrtc
    ops = set()
    for n, bf16, ta, tb in ((64, 0, 0, 1), (256, 1, 1, 0)):
        r = _nvrtc.compile(SRC.read_text(), SRC.name, options=(
            "-arch=sm_90a", f"-I{ROOT / 'kernels_cu'}", "-std=c++17", f"-DWG_N={n}", f"-DWG_BF16={bf16}",
            f"-DWG_TA={ta}", f"-DWG_TB={tb}"))
        assert r.warnings == []
        assert "C7508" not in r.log  # "'setmaxnreg' ignored" (an info line, not a warning)
        sass = _sass.disassemble(r.cubin)
        ops |= set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)", sass))
    print(sorted(o for o in ops if o.startswith(("HGMMA", "WARPGROUP", "USETMAXREG"))))
    assert any(o.startswith("HGMMA.64x64x16.F32") for o in ops)
    assert any(o.startswith("HGMMA.64x256x16.F32.BF16") for o in ops)
    assert "WARPGROUP.ARRIVE" in ops     # wgmma.fence
    assert any(o.startswith("WARPGROUP.DEPBAR") for o in ops)  # wgmma.wait_group
    assert "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops  # setmaxnreg.inc, honoured


def _mismatches(got, want):
    """How many of the thread-major registers differ (NaN equal to NaN), and the first few."""
    got = got.reshape(want.shape)
    bad = np.argwhere(~((got == want) | (np.isnan(got) & np.isnan(want))))
    return len(bad), "; ".join(f"thread {t} register {i}: {got[t, i]} (want {want[t, i]})" for t, i in bad[:4])


@pytest.fixture(scope="module")
def gpu_mods():
    """The test kernels compiled by CuPy for sm_90a, called as the emulator's are (a GPU with
    sm_90 only)."""
    cp = pytest.importorskip("cupy")
    try:
        cc = cp.cuda.Device().compute_capability
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    if int(cc) < 90:
        pytest.skip("needs sm_90")
    cache = {}

    class Kernel:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, grid, block, args, shared_mem=0):
            self.fn.max_dynamic_shared_size_bytes = shared_mem
            dev = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
            self.fn((grid,), (block,), tuple(dev), shared_mem=shared_mem)
            for a, d in zip(args, dev):
                if isinstance(a, np.ndarray):
                    a[...] = cp.asnumpy(d)

    class Module:
        def __init__(self, m):
            self.m = m

        def get_function(self, name):
            return Kernel(self.m.get_function(name))

    def get(n=64, bf16=False, ta=False, tb=False, arch="sm_90a"):
        key = (n, bf16, ta, tb)
        if key not in cache:
            cache[key] = Module(cp.RawModule(code=SRC.read_text(), options=(
                "-arch=sm_90a", f"-I{ROOT / 'kernels_cu'}", "-std=c++17", f"-DWG_N={n}", f"-DWG_BF16={int(bf16)}",
                f"-DWG_TA={int(ta)}", f"-DWG_TB={int(tb)}")))
        return cache[key]
    return get


@pytest.mark.cuda
@pytest.mark.parametrize("a_layout,b_layout", SS_PAIRS)
def test_gpu_ss_layouts(gpu_mods, a_layout, b_layout):
    """On a GPU (sm_90): the hardware computes D = A B from the layouts test_ss_layouts holds the
    emulator to -- the layouts themselves checked, one pair per case, both orders of LBO/SBO."""
    (am, asw), (bm, bsw) = a_layout, b_layout
    for alt in (False, True):
        out, expect, _ = run_ss(gpu_mods, 64, am, bm, asw, bsw, _steps(am, bm, asw, bsw), alt=alt, seed=7)
        n_bad, first = _mismatches(out, expect)
        assert n_bad == 0, f"alt={alt}: {n_bad} of {expect.size} registers differ from A B: {first}"


@pytest.mark.cuda
@pytest.mark.parametrize("n,bf16", [(8, False), (256, False), (8, True), (256, True)])
def test_gpu_extreme_n(gpu_mods, n, bf16):
    """On a GPU (sm_90): N = 8 and 256 (the register fragments' extremes), float16 and bfloat16."""
    if bf16 and ml_dtypes is None:
        pytest.skip("needs ml_dtypes")
    out, expect, _ = run_ss(gpu_mods, n, "K", "MN", 128, 64, 2, init=True, seed=n, bf16=bf16)
    n_bad, first = _mismatches(out, expect)
    assert n_bad == 0, f"{n_bad} of {expect.size} registers differ from A B + D0: {first}"


@pytest.mark.cuda
@pytest.mark.parametrize("a_layout,b_layout,n", [(("K", 128), ("MN", 64), 64), (("MN", 32), ("K", 0), 64),
                                                 (("K", 64), ("K", 128), 256), (("MN", 0), ("MN", 128), 8)])
def test_gpu_matches_the_emulator(mods, gpu_mods, a_layout, b_layout, n):
    """On a GPU (sm_90): the hardware and the emulator agree register for register, each with
    the NumPy product first, so a failure says which side is off."""
    (am, asw), (bm, bsw) = a_layout, b_layout
    args = (n, am, bm, asw, bsw, _steps(am, bm, asw, bsw))
    gpu, expect, _ = run_ss(gpu_mods, *args, init=True, seed=n)
    emu = run_ss(mods, *args, init=True, seed=n)[0]
    for side, out in (("the GPU", gpu), ("the emulator", emu)):
        n_bad, first = _mismatches(out, expect)
        assert n_bad == 0, f"{side}: {n_bad} of {expect.size} registers differ from A B + D0: {first}"
    np.testing.assert_array_equal(gpu, emu)

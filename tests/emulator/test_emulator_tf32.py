"""cuflash.emulator: the TF32 building blocks of portable.cuh against NumPy.

* ``cvt_rna_tf32`` (cvt.rna.tf32.f32): round to nearest with ties away from zero to
  10 mantissa bits, checked value by value against a float64 formula written here
  (ties of both signs, overflow to inf, subnormals, inf, NaN, signed zero);
* ``mma_m16n8k8_tf32`` in the PTX ISA fragment layout: a matmul whose operands are
  (0) rounded by cvt_rna_tf32, (1) split into 3xTF32 hi + lo, (2) raw float bits --
  the emulator reads only an operand's top 19 bits, as the tensor core reads a .b32
  holding tf32 (portable.cuh explains where that model comes from); each against
  NumPy in float64, on the emulated tensor core (sm_80) and through portable.cuh's
  shuffle-based software mma (-arch=sm_75);
* ``split_tf32`` (the 3xTF32 operands): hi = x truncated to tf32, lo = fma(x, 1 + 2^-23,
  -hi) bit for bit against NumPy, and x - hi - (what the tensor core reads of lo) near a
  rounding of lo: at most 1.5 * 2^-22 of |x|, RMS below plain truncation's;
* ``split_tf32_inf`` (K's split): the same bits, except that an infinity's lo is -2^64, not
  NaN, so a product with an infinite entry of B is +-inf where float64 says so, not NaN;
* 3xTF32 reaches float32 accuracy (relative error < 1e-6 here; the float32 rule of
  docs/testing.md is 1e-5), 1xTF32 does not (~1e-4).
"""
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

SRC = Path(__file__).resolve().parent / "kernels" / "mma_tf32.cu"


@pytest.fixture(scope="module")
def module():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = em.RawModule(path=SRC, options=(f"-arch=sm_{arch}",))
        return cache[arch]
    return get


def tf32_rna(x):
    """Round float32 values to tf32 (10 mantissa bits), ties away from zero, in float64."""
    x = np.asarray(x, np.float32).astype(np.float64)
    out = np.empty_like(x)
    special = ~np.isfinite(x)
    out[special] = x[special]
    f = x[~special]
    _, e = np.frexp(f)                      # f = m * 2^e, 0.5 <= |m| < 1 (e = 0 for f = 0)
    ulp = np.ldexp(1.0, np.maximum(e, -125) - 11)  # tf32 spacing; subnormals: 2^-136
    q = np.sign(f) * np.floor(np.abs(f) / ulp + 0.5) * ulp
    q[np.abs(q) > (2 - 2.0 ** -10) * 2.0 ** 127] = np.inf * np.sign(q[np.abs(q) > (2 - 2.0 ** -10) * 2.0 ** 127])
    q[f == 0] = f[f == 0]                   # keep the sign of zero
    out[~special] = q
    return out


def tf32_trunc(x):
    """What the tensor core reads of a float32: its top 19 bits."""
    b = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return b.view(np.float32).astype(np.float64)


def test_cvt_rna_tf32(module):
    ulp1 = 2.0 ** -10                        # tf32 spacing at 1.0
    vals = [1.0, 1 + ulp1 / 2, -(1 + ulp1 / 2), 1 + ulp1 / 2 - 2.0 ** -23, 1 + 1.5 * ulp1,
            -(1 + 1.5 * ulp1), 1 + ulp1 / 2 + 2.0 ** -23, 0.0, -0.0, 3.0e38, -3.4e38,
            float(np.finfo(np.float32).max), np.inf, -np.inf, 1e-40, -1e-40, 2.0 ** -126,
            float(np.finfo(np.float32).tiny) * (1 + 2.0 ** -11), 1.5e-45, 65504.0, 0.1, -0.3]
    rng = np.random.default_rng(7)
    x = np.concatenate([np.array(vals, np.float32),
                        (rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)).astype(np.float32)])
    x = np.concatenate([x, np.array([np.nan], np.float32)])
    for arch in (80, 75):
        y = np.full(x.shape, 7.0, np.float32)
        module(arch).get_function("tf32_round")((-(-x.size // 128),), (128,), (x, y, np.int32(x.size)))
        want = tf32_rna(x[:-1])
        np.testing.assert_array_equal(y[:-1].astype(np.float64), want)
        assert np.array_equal(np.signbit(y[:-1]), np.signbit(want))
        assert np.isnan(y[-1])
        bits = y[np.isfinite(y)].view(np.uint32)
        assert not np.any(bits & 0x1FFF), "tf32 values keep the low 13 bits zero"


def test_split_tf32(module):
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(200_000),
                        rng.standard_normal(20_000) * 2.0 ** rng.integers(-90, 90, 20_000)]).astype(np.float32)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    xs = np.concatenate([x, special])
    hi = np.full(xs.shape, 0xDEADBEEF, np.uint32)
    lo = hi.copy()
    module(80).get_function("tf32_split")((-(-xs.size // 128),), (128,), (xs, hi, lo, np.int32(xs.size), np.int32(0)))
    # the model: hi = top 19 bits; lo = x * (1 + 2^-23) - hi rounded once to float32 (exact
    # in float64: 24 + 23 bits), i.e. the FFMA
    want_hi = x.view(np.uint32) & np.uint32(0xFFFFE000)
    x64, hi64 = x.astype(np.float64), want_hi.view(np.float32).astype(np.float64)
    want_lo = (x64 * (1 + 2.0 ** -23) - hi64).astype(np.float32)
    np.testing.assert_array_equal(hi[:x.size], want_hi)
    np.testing.assert_array_equal(lo[:x.size], want_lo.view(np.uint32))
    # specials: inf keeps an infinite hi, NaN a NaN hi, a zero of either sign splits into
    # itself and a zero
    hs = hi[x.size:].view(np.float32)
    assert hs[0] == np.inf and hs[1] == -np.inf and np.isnan(hs[2])
    assert list(hi[x.size + 3:]) == [0, 0x80000000] and not np.any(lo[x.size + 3:] & 0x7FFFFFFF)
    # what the three products see of x: hi + tf32_trunc(lo)
    nz = x != 0
    err = (hi64 + tf32_trunc(lo[:x.size].view(np.float32)) - x64)[nz] / np.abs(x64[nz])
    assert np.abs(err).max() <= 1.5 * 2.0 ** -22, np.abs(err).max()
    trunc = ((hi64 + tf32_trunc((x64 - hi64).astype(np.float32)) - x64)[nz] / np.abs(x64[nz]))
    rms = lambda e: np.sqrt(np.mean(e * e))  # noqa: E731
    assert rms(err) < 0.85 * rms(trunc), (rms(err), rms(trunc))
    sign = np.sign(x64[nz])
    assert abs(np.mean(err * sign)) < 0.3 * abs(np.mean(trunc * sign))


def test_split_tf32_inf(module):
    """split_tf32_inf: split_tf32's bits wherever lo is not NaN or below -2^64; lo(+-inf) = -2^64."""
    rng = np.random.default_rng(12)
    x = np.concatenate([rng.standard_normal(50_000) * 2.0 ** rng.integers(-90, 70, 50_000),
                        [np.inf, -np.inf, np.nan, 0.0, -0.0, -(2.0 ** 80 + 2.0 ** 69), 2.0 ** 80 + 2.0 ** 69]]).astype(np.float32)
    out = {}
    for safe in (0, 1):
        hi = np.full(x.shape, 0xDEADBEEF, np.uint32)
        lo = hi.copy()
        module(80).get_function("tf32_split")((-(-x.size // 128),), (128,), (x, hi, lo, np.int32(x.size), np.int32(safe)))
        out[safe] = hi, lo
    np.testing.assert_array_equal(out[1][0], out[0][0])  # hi unchanged (NaN keeps a NaN hi)
    lo0, lo1 = out[0][1].view(np.float32), out[1][1].view(np.float32)
    keep = ~np.isnan(lo0) & (lo0 >= -2.0 ** 64)
    np.testing.assert_array_equal(out[1][1][keep], out[0][1][keep])
    assert np.isnan(lo0[-7:-4]).all() and list(lo1[-7:-5]) == [-2.0 ** 64] * 2 and lo1[-5] == -2.0 ** 64
    # |x| = 2^80 + 2^69: lo = +-2^69, clamped below -2^64 only (S keeps tf32 precision there)
    assert lo1[-2] == -2.0 ** 64 and lo0[-2] < -2.0 ** 64 and lo1[-1] == lo0[-1] > 2.0 ** 64
    assert keep.sum() == x.size - 4


def test_3xtf32_infinite_b(module):
    """An infinite entry of B (a key of K): each product is what float64 gives it -- +-inf where
    the row's operand is nonzero, NaN only where float64 has 0 * inf -- for both signs of the
    infinity, including A entries that tf32 holds exactly (lo = x * 2^-23)."""
    rng = np.random.default_rng(5)
    M, N, K = 32, 16, 24
    a = rng.standard_normal((M, K)).astype(np.float32)
    a[:4] = np.round(a[:4] * 4) / 4  # exact in tf32: lo is only the nudge
    a[4, 2] = 0.0
    b = rng.standard_normal((K, N)).astype(np.float32)
    b[2, 3], b[2, 5], b[7, 5] = np.inf, -np.inf, -np.inf
    with np.errstate(invalid="ignore"):
        exact = a.astype(np.float64) @ b.astype(np.float64)
    c3 = _matmul(module, 80, a, b, 3)
    np.testing.assert_array_equal(np.isnan(c3), np.isnan(exact))
    inf = np.isinf(exact)
    assert inf[:, 3].sum() == M - 1 and np.isnan(exact[4, 3]) and np.array_equal(c3[inf], exact[inf])
    fin = np.isfinite(exact)
    assert _rel(c3[fin], exact[fin]) < 1e-6
    # split_tf32's NaN lo turns every infinite product into NaN
    c1 = _matmul(module, 80, a, b, 1)
    assert np.isnan(c1[:, [3, 5]]).all()


def _matmul(module, arch, a, b, mode):
    M, K = a.shape
    N = b.shape[1]
    c = np.full((M, N), np.nan, np.float32)
    module(arch).get_function("matmul_tf32")((-(-N // 8), -(-M // 16)), (32,),
                                             (a, b, c, np.int32(M), np.int32(N), np.int32(K),
                                              np.int32(mode)))
    st = em.last_launch_stats()
    assert st["global_bytes_written"] == 4 * M * N
    return c.astype(np.float64)


def _rel(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


CASES = [(80, (40, 24, 40)), (80, (16, 8, 8)), (80, (33, 17, 70)), (75, (20, 9, 19))]


@pytest.mark.parametrize("arch,shape", CASES, ids=[f"sm_{a}-{'x'.join(map(str, s))}" for a, s in CASES])
def test_matmul_tf32_modes(module, arch, shape):
    M, N, K = shape
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    a_in, b_in = a.copy(), b.copy()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    # 1xTF32: exactly the float64 product of the rounded operands, up to float32 sums
    c1 = _matmul(module, arch, a, b, 0)
    np.testing.assert_allclose(c1, tf32_rna(a) @ tf32_rna(b), rtol=1e-6, atol=1e-6 * np.sqrt(K))
    # raw float bits: the operands' top 19 bits (round toward zero)
    c2 = _matmul(module, arch, a, b, 2)
    np.testing.assert_allclose(c2, tf32_trunc(a) @ tf32_trunc(b), rtol=1e-6, atol=1e-6 * np.sqrt(K))
    # 3xTF32: float32 accuracy against the float64 product
    c3 = _matmul(module, arch, a, b, 1)
    err1, err3 = _rel(c1, exact), _rel(c3, exact)
    assert err3 < 1e-6, f"3xTF32 relative error {err3:.2e}"
    if K >= 16:
        assert err1 > 20 * err3, (err1, err3)  # one TF32 product is far from float32
    np.testing.assert_array_equal(a, a_in)
    np.testing.assert_array_equal(b, b_in)


def test_3xtf32_large_range(module):
    """Operands spanning 2^-40 .. 2^40: the split keeps float32 accuracy at every scale."""
    rng = np.random.default_rng(3)
    M, N, K = 32, 16, 64
    a = (rng.standard_normal((M, K)) * 2.0 ** rng.integers(-40, 40, (M, 1))).astype(np.float32)
    b = (rng.standard_normal((K, N)) * 2.0 ** rng.integers(-40, 40, (1, N))).astype(np.float32)
    c = _matmul(module, 80, a, b, 1)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    rel = np.abs(c - exact) / (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
    assert rel.max() < 2e-6, rel.max()


def test_accumulation_truncates_like_the_tensor_core(module):
    """One mma adds its products and the accumulator as one sum cut to float toward zero: the
    products 1 and 1.5 * 2^-24 give 1.0 (round to nearest would give 1 + 2^-23).  The software
    mma of sm_75 (float FFMA, round to nearest) gives 1 + 2^-23."""
    a = np.zeros((16, 8), np.float32)
    b = np.zeros((8, 8), np.float32)
    a[0, :2] = [1.0, 1.5 * 2.0 ** -12]
    b[:2, 0] = [1.0, 2.0 ** -12]
    assert _matmul(module, 80, a, b, 0)[0, 0] == 1.0
    assert _matmul(module, 75, a, b, 0)[0, 0] == np.float32(1 + 2.0 ** -23)


def test_long_accumulation_drifts_toward_zero(module):
    """A long chain of mma on one accumulator of constant sign loses up to an ulp per mma toward
    zero: over K = 2048 positive products (256 mma) the result sits below the exact sum by many
    float32 ulps, always below; float FFMA's round-to-nearest errors mostly cancel.  This is the
    error the H100 showed in flash_fwd_tf32's O, which the kernels are built to avoid."""
    rng = np.random.default_rng(5)
    K = 2048
    a = tf32_rna(rng.random((16, K)) + 0.5).astype(np.float32)
    b = tf32_rna(rng.random((K, 8)) + 0.5).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    tc = _matmul(module, 80, a, b, 0)
    rel = (exact - tc) / exact
    assert (rel > 0).all(), "truncation only ever lowers a positive sum"
    assert rel.mean() > 100 * 2.0 ** -24, rel.mean()   # measured: 148 ulps of 2^-24
    sw = (exact - _matmul(module, 75, a, b, 0)) / exact
    assert abs(sw.mean()) < 4 * 2.0 ** -24, sw.mean()     # unbiased: 0.6
    assert np.abs(sw).mean() < 20 * 2.0 ** -24           # a random walk: 8.4

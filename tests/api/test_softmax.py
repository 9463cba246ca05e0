"""online_softmax / online_softmax_2d: the "Online softmax tests" of seed 001.

Every test runs over the backend (conftest.BACKENDS).  The reference values
are computed here in float64 from the definition, softmax(x) = exp(x - max) /
sum(exp(x - max)), independently of cuflash.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import grid


def exact_softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True), m[..., 0] if x.ndim else m, e.sum(axis=axis)


def call1d(backend, x, chunk_size=None, return_stats=False):
    out = cuflash.online_softmax(backend.asarray(x), chunk_size, return_stats=return_stats,
                                 backend=backend.name)
    if return_stats:
        return tuple(backend.to_numpy(a) for a in out)
    return backend.to_numpy(out)


def call2d(backend, x, chunk_size=None, return_stats=False):
    out = cuflash.online_softmax_2d(backend.asarray(x), chunk_size, return_stats=return_stats,
                                    backend=backend.name)
    if return_stats:
        return tuple(backend.to_numpy(a) for a in out)
    return backend.to_numpy(out)


def assert_rel(out, ref, tol, what):
    out = oracle.f64(out)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    err = np.max(np.abs(out - ref), initial=0.0)
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < tol, f"{what}: relative error {rel:.3e} >= {tol:.0e}, max abs err {err:.3e}"


# ---- equivalence to standard softmax: lengths 100, 1000, 10000 x chunks 1, 10, 100, full
EQUIV = [(n, c) for n in (100, 1000, 10000) for c in (1, 10, 100, None)]


@pytest.mark.parametrize("n,chunk", grid(EQUIV, emulator=lambda c: c[0] <= 1000 and c[1] != 1))
def test_equivalence_to_standard_softmax(backend, rng, n, chunk):
    x = rng.standard_normal(n) * 3
    p, m, l = call1d(backend, x, chunk, return_stats=True)
    ref, ref_m, ref_l = exact_softmax(x)
    assert p.dtype == np.float64
    # seed 001 asks for 1e-6; float64 can do far better, and 1e-12 catches real slips
    assert_rel(p, ref, 1e-12, f"p (n={n}, chunk={chunk})")
    assert np.max(np.abs(p - ref)) < 1e-6
    assert float(m) == float(ref_m), f"m = {m} != max(x) = {ref_m}"
    assert abs(float(l) - float(ref_l)) <= 1e-12 * float(ref_l), f"l = {l} != {ref_l}"
    assert abs(p.sum() - 1.0) < 1e-12
    # without stats: the same probabilities
    p2 = call1d(backend, x, chunk)
    assert np.array_equal(p2, p)


def test_numerical_stability_large_equal_values(backend):
    p = call1d(backend, np.array([1000.0, 1000.0, 1000.0]), 1)
    assert np.all(np.isfinite(p)), p
    np.testing.assert_allclose(p, [1 / 3] * 3, rtol=1e-15)


def test_large_values_rising_max_chunk_by_chunk(backend):
    # the max rises in every chunk: the correction exp(m_old - m_new) must underflow to
    # 0 cleanly, never form inf - inf
    x = np.array([-1000.0, 0.0, 500.0, 1000.0, 1000.0, 999.0])
    p, m, l = call1d(backend, x, 1, return_stats=True)
    ref, ref_m, ref_l = exact_softmax(x)
    assert np.all(np.isfinite(p))
    assert_rel(p, ref, 1e-13, "p")
    assert float(m) == 1000.0 and abs(float(l) - ref_l) < 1e-13


@pytest.mark.parametrize("chunk", [1, 7, 13, 33, 64, 999, 1000, 5000])
def test_incremental_stats_match_single_pass(backend, rng, chunk):
    # chunk sizes that do and do not divide the length; stats must equal the one-pass ones
    x = rng.standard_normal(1000) * 5
    p1, m1, l1 = call1d(backend, x, None, return_stats=True)
    p, m, l = call1d(backend, x, chunk, return_stats=True)
    assert float(m) == float(m1) == float(x.max())
    assert abs(float(l) - float(l1)) <= 1e-12 * float(l1)
    assert_rel(p, p1, 1e-13, f"p chunk={chunk} vs single pass")


def test_incremental_matches_manual_chunk_combination(rng):
    # the (m, l) combination rule of seed 001, applied by hand over random chunk sizes,
    # agrees with the exact statistics: this checks the rule the tests above rely on
    x = rng.standard_normal(500) * 10
    cuts = np.sort(rng.choice(np.arange(1, 500), size=12, replace=False))
    m, l = -np.inf, 0.0
    for part in np.split(x, cuts):
        mn = max(m, part.max())
        l = l * np.exp(m - mn) + np.exp(part - mn).sum()
        m = mn
    _, ref_m, ref_l = exact_softmax(x)
    assert m == ref_m and abs(l - ref_l) < 1e-12 * ref_l


def test_single_element(backend):
    p = call1d(backend, np.array([5.0]))
    assert p.shape == (1,) and p[0] == 1.0
    p, m, l = call1d(backend, np.array([5.0]), 1, return_stats=True)
    assert p[0] == 1.0 and float(m) == 5.0 and float(l) == 1.0


def test_two_zeros(backend):
    for chunk in (None, 1, 2):
        p = call1d(backend, np.array([0.0, 0.0]), chunk)
        np.testing.assert_array_equal(p, [0.5, 0.5])


def test_very_negative_no_underflow(backend):
    x = np.array([-1000.0, -1000.0, -999.0])
    for chunk in (None, 1, 2):
        p, m, l = call1d(backend, x, chunk, return_stats=True)
        e = np.exp(-1.0)
        ref = np.array([e, e, 1.0]) / (2 * e + 1)
        assert np.all(np.isfinite(p)) and np.all(p > 0), p
        np.testing.assert_allclose(p, ref, rtol=1e-14)
        assert float(m) == -999.0
        np.testing.assert_allclose(float(l), 2 * e + 1, rtol=1e-14)


def test_input_not_modified(backend, rng):
    x = rng.standard_normal(300)
    keep = x.copy()
    call1d(backend, x, 7, return_stats=True)
    assert np.array_equal(x, keep)
    x2 = rng.standard_normal((4, 300))
    keep2 = x2.copy()
    call2d(backend, x2, 7, return_stats=True)
    assert np.array_equal(x2, keep2)


# ---- 2-D (row-wise, any leading shape)
ROWS = [((5, 100), 10), ((3, 4, 97), 16), ((1, 1), 1), ((7, 1000), None), ((64, 255), 64),
        ((2, 3, 4, 33), 5)]


@pytest.mark.parametrize("shape,chunk", grid(ROWS, emulator=(0, 1, 2, 4)))
def test_2d_rows(backend, rng, shape, chunk):
    x = rng.standard_normal(shape) * 4
    p, m, l = call2d(backend, x, chunk, return_stats=True)
    ref, ref_m, ref_l = exact_softmax(x)
    assert p.shape == shape and m.shape == shape[:-1] and l.shape == shape[:-1]
    assert_rel(p, ref, 1e-12, f"p {shape}")
    np.testing.assert_array_equal(m, ref_m)
    np.testing.assert_allclose(l, ref_l, rtol=1e-12)
    np.testing.assert_allclose(p.sum(axis=-1), 1.0, rtol=1e-12)
    p2 = call2d(backend, x, chunk)
    assert np.array_equal(p2, p)


def test_2d_rows_independent(backend, rng):
    # one row with huge values must not disturb its neighbours
    x = rng.standard_normal((4, 50))
    x[1] *= 1e4
    p = call2d(backend, x, 8)
    ref, _, _ = exact_softmax(x)
    assert np.all(np.isfinite(p))
    assert_rel(p, ref, 1e-12, "p")


def test_2d_nan_stays_in_its_row(backend, rng):
    x = rng.standard_normal((5, 40))
    x[2, 17] = np.nan
    with np.errstate(invalid="ignore"):
        p = call2d(backend, x, 8)
    ref, _, _ = exact_softmax(np.delete(x, 2, axis=0))
    assert np.isnan(p[2]).any()
    assert_rel(np.delete(p, 2, axis=0), ref, 1e-12, "rows without NaN")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_2d_dtypes(backend, rng, dtype):
    x = oracle.randn(rng, (6, 129), dtype, scale=3)
    p = call2d(backend, x, 32)
    assert oracle.dtype_name(p.dtype) == dtype, f"output dtype {p.dtype} for {dtype} input"
    ref, _, _ = exact_softmax(oracle.f64(x))
    if dtype == "float32":
        assert_rel(p, ref, 1e-5, "p float32")
    else:
        # naive softmax in the low dtype: exp and the sum rounded to it
        r = lambda a: a.astype(oracle.dtype_of(dtype)).astype(np.float64)  # noqa: E731
        xf = oracle.f64(x)
        e = r(np.exp(xf - xf.max(-1, keepdims=True)))
        base = r(e / r(e.sum(-1, keepdims=True)))
        oracle.assert_lowp_close(p, ref, base, dtype, 2, f"p {dtype}")

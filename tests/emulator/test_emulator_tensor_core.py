"""cuflash.emulator: the tensor-core building blocks of portable.cuh.

A tiled matmul through ldmatrix (x1/x2/x4, plain and .trans) + mma.m16n8k16
in f16 and bf16 against NumPy, once on the emulated tensor core (sm_80) and
once through portable.cuh's shuffle-based software mma (-arch=sm_75), which
cross-checks the two fragment-layout implementations; and a cp.async double
buffer whose copies land only at the matching wait.
"""
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

ml_dtypes = pytest.importorskip("ml_dtypes")

SRC = Path(__file__).resolve().parent / "kernels" / "mma.cu"
DTYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def modules():
    cache = {}

    def get(dtype, arch):
        if (dtype, arch) not in cache:
            cache[dtype, arch] = em.RawModule(path=SRC, options=(f"-DDTYPE={dtype}", f"-arch=sm_{arch}"))
        return cache[dtype, arch]
    return get


# the software mma (32 shuffles per mma) runs on one shape to keep the suite fast
CASES = [(dt, 80, shape) for dt in DTYPES for shape in ((40, 24, 40), (16, 8, 16), (33, 17, 7))]
CASES += [(dt, 75, (40, 24, 40)) for dt in DTYPES]


@pytest.mark.parametrize("dtype,arch,shape", CASES)
def test_matmul_ldmatrix_mma(modules, dtype, arch, shape):
    M, N, K = shape
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    npdt = DTYPES[dtype]
    a = rng.standard_normal((M, K)).astype(npdt)
    b = rng.standard_normal((K, N)).astype(npdt)
    a_in, b_in = a.copy(), b.copy()
    want = a.astype(np.float64) @ b.astype(np.float64)  # exact products, fp32 sums in the kernel
    k = modules(dtype, arch).get_function("matmul_mma")
    for variant in (0, 1, 2):
        c = np.full((M, N), np.nan, np.float32)
        k((-(-N // 16), -(-M // 32)), 64, (a, b, c, np.int32(M), np.int32(N), np.int32(K), np.int32(variant)))
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5 * np.sqrt(K), err_msg=f"variant {variant}")
    np.testing.assert_array_equal(a.view(np.uint16), a_in.view(np.uint16))  # inputs untouched
    np.testing.assert_array_equal(b.view(np.uint16), b_in.view(np.uint16))
    st = em.last_launch_stats()
    blocks = -(-N // 16) * -(-M // 32)
    assert st["blocks"] == blocks
    assert st["global_bytes_written"] == 4 * M * N


def test_mma_needs_a_full_warp(modules):
    a = np.zeros((16, 16), np.float16)
    c = np.zeros((16, 8), np.float32)
    with pytest.raises(em.LaunchError, match="full warp"):
        modules("__half", 80).get_function("matmul_mma")(1, 48, (a, a, c, np.int32(16), np.int32(8),
                                                                   np.int32(16), np.int32(0)))


@pytest.fixture(scope="module")
def pipeline():
    return em.RawModule(path=SRC).get_function("cp_async_pipeline")


@pytest.mark.parametrize("ntiles", [1, 2, 5])
@pytest.mark.parametrize("wait_depth", [0, 1])
def test_cp_async_double_buffer(pipeline, ntiles, wait_depth):
    x = np.random.default_rng(ntiles).random((ntiles, 64)).astype(np.float32)
    y = np.full((ntiles, 64), np.nan, np.float32)
    pipeline(1, 16, (x, y, np.int32(ntiles), np.int32(wait_depth)), shared_mem=2 * 64 * 4)
    np.testing.assert_array_equal(y, 2 * x + np.arange(ntiles, dtype=np.float32)[:, None])
    st = em.last_launch_stats()
    assert st["global_bytes_read"] == ntiles * 64 * 4 and st["global_bytes_written"] == ntiles * 64 * 4


@pytest.mark.parametrize("wait_depth", [2, -1])
def test_cp_async_read_before_wait_gets_stale_data(pipeline, wait_depth):
    """Waiting too little (or not at all) must make the kernel's results wrong."""
    ntiles = 5
    x = np.random.default_rng(0).random((ntiles, 64)).astype(np.float32)
    y = np.full((ntiles, 64), np.nan, np.float32)
    pipeline(1, 16, (x, y, np.int32(ntiles), np.int32(wait_depth)), shared_mem=2 * 64 * 4)
    want = 2 * x + np.arange(ntiles, dtype=np.float32)[:, None]
    wrong = ~np.isclose(y, want)  # NaN (never-landed poison) or a previous tile
    assert wrong.any(axis=1).all(), "every tile should be read before its copy landed"

"""cuflash.emulator race checking (race_check=True, ThreadSanitizer in a child process).

The checker must report a reduction whose needed __syncthreads() was removed
(naming the shared array and the source lines) and must stay silent on the
correct kernels, including the warp collectives, ldmatrix/mma and cp.async.
"""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

KERNELS = Path(__file__).resolve().parent / "kernels"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no host C++ compiler")


@pytest.fixture(scope="module")
def reduce_tsan():
    return em.RawModule(path=KERNELS / "reduce.cu", race_check=True)


def _sum_args(n=700, per_block=350):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.full(-(-n // per_block), np.nan, np.float32)
    return x, out, (x, out, np.int32(n), np.int32(per_block))


def test_correct_reduction_has_no_race_and_returns_results(reduce_tsan):
    x, out, args = _sum_args()
    reduce_tsan.get_function("block_sum")(out.size, 96, args)
    np.testing.assert_allclose(out, x.reshape(2, 350).astype(np.float64).sum(1), rtol=1e-5)
    st = em.last_launch_stats()
    assert st["global_bytes_read"] == 4 * x.size and st["blocks"] == 2


def test_removed_syncthreads_is_reported(reduce_tsan):
    x, out, args = _sum_args()
    with pytest.raises(em.RaceError) as info:
        reduce_tsan.get_function("block_sum_racy")(out.size, 96, args)
    msg = str(info.value)
    assert "block_sum_racy" in msg and "warp_sums_racy" in msg
    assert "reduce.cu:" in msg  # source lines of the racing accesses
    assert "data race" in info.value.report


def test_tensor_core_and_cp_async_kernels_are_race_free():
    mod = em.RawModule(path=KERNELS / "mma.cu", race_check=True)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((20, 24)).astype(np.float16)
    b = rng.standard_normal((24, 12)).astype(np.float16)
    c = np.full((20, 12), np.nan, np.float32)
    mod.get_function("matmul_mma")((1, 1), 64, (a, b, c, np.int32(20), np.int32(12), np.int32(24), np.int32(0)))
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)
    x = rng.random((3, 64)).astype(np.float32)
    y = np.full((3, 64), np.nan, np.float32)
    mod.get_function("cp_async_pipeline")(1, 16, (x, y, np.int32(3), np.int32(1)), shared_mem=512)
    np.testing.assert_array_equal(y, 2 * x + np.arange(3, dtype=np.float32)[:, None])


def test_deadlock_under_race_check_is_a_launch_error():
    # lane 0 waits in a shuffle, lanes 1-31 at __syncthreads (a small source: TSan builds are slow)
    src = ('#include "portable.cuh"\n'
           'extern "C" __global__ void stuck(float* out) {\n'
           '  float v = (float)threadIdx.x;\n'
           '  if (threadIdx.x == 0) v = __shfl_sync(0xffffffffu, v, 1); else __syncthreads();\n'
           '  out[threadIdx.x] = v;\n}\n')
    mod = em.RawModule(code=src, race_check=True)
    with pytest.raises(em.LaunchError, match="stuck.*deadlock"):
        mod.get_function("stuck")(1, 64, (np.zeros(64, np.float32),))

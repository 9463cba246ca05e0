"""The emulator's profiler: bank conflicts, global sectors and executed counts with known answers.

Inside ``cuflash.emulator.profiling()`` a launch records its shared and global accesses and
``cuflash.emulator.last_launch_profile()`` gives, per source line, the warp-level requests,
the shared-memory wavefronts against the ideal (bank conflicts as Nsight Compute counts
them: wavefronts beyond the ideal) and the 32-byte global sectors against the ideal, plus
executed instruction counts.  The patterns (tests/emulator/kernels/profile.cu) are one warp each, with
answers worked out by hand from the 32 banks of 4 bytes and the 128 bytes a wavefront moves.
"""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

SRC = Path(__file__).resolve().parent / "kernels" / "profile.cu"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="no host C++ compiler")


def line_of(tag):
    for i, text in enumerate(SRC.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"// SITE {tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return em.RawModule(path=SRC)


def aligned(shape, dtype):
    """Zeros at a 256-byte boundary, as a GPU allocation is (sector counts depend on it)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 256, np.uint8)
    off = -raw.ctypes.data % 256
    return raw[off:off + n].view(dtype).reshape(shape)


def profile(mod, name, args, shared_mem=0):
    with em.profiling():
        mod.get_function(name)((1,), (32,), args, shared_mem=shared_mem)
    return em.last_launch_profile()


def site(prof, tag, kind):
    rows = [s for s in prof["sites"] if s["site"].endswith(f"profile.cu:{line_of(tag)}") and s["kind"] == kind]
    assert len(rows) == 1, prof["sites"]
    return rows[0]


@pytest.mark.parametrize("stride, wavefronts", [(32, 32), (33, 1)])
def test_column_read_conflict_and_padding(mod, stride, wavefronts):
    # stride 32: all 32 lanes in one bank, 32 distinct words -> 32 wavefronts (31 conflicts);
    # padded to 33: every lane in its own bank
    y = np.zeros(32, np.float32)
    s = site(profile(mod, "column_read", (y, np.int32(stride)), 4 * 32 * 33), "column_read", "shared_load")
    assert (s["bytes"], s["requests"], s["lanes"]) == (4, 1, 32)
    assert (s["wavefronts"], s["ideal"], s["conflicts"]) == (wavefronts, 1, wavefronts - 1)


def test_swizzled_column_read_is_conflict_free(mod):
    y = np.zeros(32, np.float32)
    s = site(profile(mod, "swizzled_column_read", (y,), 4 * 32 * 32), "swizzled_column_read", "shared_load")
    assert (s["wavefronts"], s["ideal"], s["conflicts"]) == (1, 1, 0)


@pytest.mark.parametrize("step, wavefronts", [(1, 2), (2, 4)])
def test_64_bit_loads(mod, step, wavefronts):
    # 8 bytes a lane: two half-warp phases of 128 bytes each (ideal 2); step 2 spreads a phase
    # over 256 bytes, so lanes l and l + 8 share banks: 2 wavefronts per phase
    y = np.zeros(32, np.float32)
    s = site(profile(mod, "read64", (y, np.int32(step)), 8 * 64), "read64", "shared_load")
    assert (s["bytes"], s["requests"]) == (8, 1)
    assert (s["wavefronts"], s["ideal"], s["conflicts"]) == (wavefronts, 2, wavefronts - 2)


@pytest.mark.parametrize("step, wavefronts", [(1, 4), (2, 8)])
def test_128_bit_loads(mod, step, wavefronts):
    # 16 bytes a lane: four quarter-warp phases (ideal 4), each 2-way conflicted at step 2
    y = np.zeros(32, np.float32)
    s = site(profile(mod, "read128", (y, np.int32(step)), 16 * 64), "read128", "shared_load")
    assert (s["bytes"], s["requests"]) == (16, 1)
    assert (s["wavefronts"], s["ideal"], s["conflicts"]) == (wavefronts, 4, wavefronts - 4)
    assert em.last_launch_profile()["counts"]["shared_load.128"] == 1
    assert em.last_launch_profile()["counts"]["global_store.32"] == 1


@pytest.mark.parametrize("row_elems, wavefronts", [(64, 32), (72, 4)])
def test_ldmatrix_rows(mod, row_elems, wavefronts):
    # x4: four 8-row matrices, one phase each (ideal 4).  128-byte rows put a matrix's 8 rows
    # on the same 4 banks (8 wavefronts each); 144-byte rows spread them over all 32 banks
    y = np.zeros(32, np.uint32)
    prof = profile(mod, "ldmatrix_rows", (y, np.int32(row_elems)), 2 * 32 * 72)
    s = site(prof, "ldmatrix_rows", "ldmatrix")
    assert (s["bytes"], s["requests"], s["lanes"]) == (16, 1, 32)
    assert (s["wavefronts"], s["ideal"], s["conflicts"]) == (wavefronts, 4, wavefronts - 4)
    assert prof["counts"]["ldmatrix.x4"] == 1


@pytest.mark.parametrize("step, wavefronts", [(1, 4), (8, 32)])
def test_cp_async_shared_side(mod, step, wavefronts):
    x = aligned((32, 4), np.float32)
    y = np.zeros(32, np.float32)
    prof = profile(mod, "async_copy", (x, y, np.int32(step)), 16 * 32 * 8)
    s = site(prof, "async_copy", "cp.async_shared")
    assert (s["bytes"], s["wavefronts"], s["ideal"]) == (16, wavefronts, 4)
    g = site(prof, "async_copy", "cp.async_global")
    assert (g["sectors"], g["ideal"]) == (16, 16)
    assert prof["counts"]["cp.async"] == 1


@pytest.mark.parametrize("shift", [0, 16])
def test_coalesced_16_byte_global_load(mod, shift):
    # sectors are counted from the start of the argument, as if it were a GPU allocation
    # (256-byte aligned): an array 16 bytes off a sector boundary on the host counts the same
    raw = aligned(32 * 4 + 4, np.float32)
    x = raw[shift // 4:shift // 4 + 128].reshape(32, 4)
    assert x.ctypes.data % 32 == shift
    y = np.zeros(32, np.float32)
    g = site(profile(mod, "global_vec_load", (x, y)), "global_vec_load", "global_load")
    assert (g["bytes"], g["requests"], g["sectors"], g["ideal"]) == (16, 1, 16, 16)


def test_strided_global_load(mod):
    # 4 bytes a lane, 128 bytes apart: every lane its own sector (32) where 4 would do
    x = aligned(32 * 32, np.float32)
    y = np.zeros(32, np.float32)
    g = site(profile(mod, "global_strided_load", (x, y, np.int32(32))), "global_strided_load", "global_load")
    assert (g["bytes"], g["requests"], g["sectors"], g["ideal"]) == (4, 1, 32, 4)


def test_executed_counts(mod):
    prof = profile(mod, "counted", (np.zeros(32, np.float32),))
    c = prof["counts"]
    assert (c["shfl"], c["bar.sync (__syncthreads)"], c["bar.warp.sync (__syncwarp)"], c["ex2 (exp2)"],
            c["rcp (rcp.approx)"]) == (2, 1, 1, 2, 1)
    assert c["mma.m16n8k16.f16"] == 0 and c["cp.async"] == 0


def test_profile_needs_a_profiled_launch(mod):
    # a launch outside profiling() leaves the previous profile alone
    before = profile(mod, "counted", (np.zeros(32, np.float32),))
    mod.get_function("column_read")((1,), (32,), (np.zeros(32, np.float32), np.int32(33)), shared_mem=4 * 32 * 33)
    assert em.last_launch_profile() is before

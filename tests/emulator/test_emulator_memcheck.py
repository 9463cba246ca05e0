"""The emulator's memory checker: planted out-of-bounds accesses, global and shared.

With ``cuflash.emulator.memcheck()`` on (the test session turns it on for every launch,
tests/conftest.py) every global access through the kernels' accessors must lie inside an
array passed to the launch and every shared-memory access inside the launch's dynamic shared
memory; anything else raises :class:`cuflash.emulator.MemcheckError` naming the kernel, the
access, the block and thread, the argument and offset, and the source line.  The kernels
(tests/emulator/kernels/memcheck.cu) take an offset that is harmless at 0; the tests plant one past
the end, far away and before the start.
"""
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

KERNELS = Path(__file__).resolve().parent / "kernels"
SRC = KERNELS / "memcheck.cu"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="no host C++ compiler")


def line_of(tag):
    """The source line marked `// ACCESS tag` in memcheck.cu."""
    for i, text in enumerate(SRC.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"// ACCESS {tag}"):
            return i
    raise AssertionError(tag)


@pytest.fixture(scope="module")
def mod():
    return em.RawModule(path=SRC)


def stray(fn, *launch, **kw):
    with em.memcheck():
        with pytest.raises(em.MemcheckError) as info:
            fn(*launch, **kw)
    return str(info.value)


def test_the_suite_runs_with_memcheck_on():
    from cuflash.emulator._checks import memcheck_enabled
    assert memcheck_enabled()


def test_in_bounds_accesses_pass(mod):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros_like(x)
    with em.memcheck():
        mod.get_function("global_load")((2,), (32,), (x, y, np.int32(64), np.int32(0)))
        assert np.array_equal(y, x)
        mod.get_function("shared_load")((1,), (64,), (x, y * 0, np.int32(0)), shared_mem=256)
        y2 = np.zeros(128, np.float32)
        mod.get_function("async_copy")((1,), (32,), (np.arange(128, dtype=np.float32), y2, np.int32(0),
                                                        np.int32(0)), shared_mem=512)
        assert np.array_equal(y2, np.arange(128, dtype=np.float32))


@pytest.mark.parametrize("off, element, block, thread", [
    (1, 64, "(1,0,0)", "(31,0,0)"),         # one past the end: only the last thread strays
    (1_000_000, 1_000_000, "(0,0,0)", "(0,0,0)"),  # far away (4 MB past)
    (-3, -3, "(0,0,0)", "(0,0,0)"),         # before the start
])
def test_global_load(mod, off, element, block, thread):
    if off > 0:
        # y below x in one buffer: nothing but x lies between x and a stray address above it,
        # so x is the nearest argument (two separate small arrays may sit either way)
        buf = np.zeros(128, np.float32)
        y, x = buf[:64], buf[64:]
        x[:] = np.arange(64)
    else:
        x = np.arange(64, dtype=np.float32)
        y = np.zeros_like(x)
    msg = stray(mod.get_function("global_load"), (2,), (32,), (x, y, np.int32(64), np.int32(off)))
    assert msg.startswith("memcheck: out-of-bounds global load of 4 bytes"), msg
    assert "kernel global_load" in msg and f"memcheck.cu:{line_of('global_load')}" in msg, msg
    assert "argument 'x' (a float32 array of 64 elements, 256 bytes)" in msg, msg
    assert f"element {element} " in msg and f"block {block}, thread {thread}" in msg, msg


def test_global_store_one_past_the_end_is_stopped(mod):
    # y is a view of 64 elements into a 65-element buffer: the checker knows only the view,
    # and the stray store never happens
    x = np.arange(64, dtype=np.float32)
    buf = np.full(65, -1.0, np.float32)
    msg = stray(mod.get_function("global_store"), (2,), (32,), (x, buf[:64], np.int32(64), np.int32(1)))
    assert msg.startswith("memcheck: out-of-bounds global store of 4 bytes"), msg
    assert "argument 'y'" in msg and "byte offset 256, past its end" in msg and "element 64 " in msg, msg
    assert f"memcheck.cu:{line_of('global_store')}" in msg, msg
    assert buf[64] == -1.0


def test_without_memcheck_the_stray_store_lands(mod):
    # the same launch with the checker off: what the check prevents above
    x = np.arange(64, dtype=np.float32)
    buf = np.full(65, -1.0, np.float32)
    with em.memcheck(False):
        mod.get_function("global_store")((2,), (32,), (x, buf[:64], np.int32(64), np.int32(1)))
    assert buf[64] == 63.0


def test_index_read(mod):
    """CUFLASH_INDEX, the serving kernels' reads of cu_seqlens, seqlens_k and block tables:
    checked like a load (one past the end here), not counted as traffic."""
    idx = np.arange(8, dtype=np.int32)
    y = np.zeros(8, np.float32)
    with em.memcheck():
        mod.get_function("index_read")((1,), (32,), (idx, y, np.int32(8), np.int32(0)))
    assert np.array_equal(y, idx) and em.last_launch_stats()["global_bytes_read"] == 0
    msg = stray(mod.get_function("index_read"), (1,), (32,), (idx, y, np.int32(8), np.int32(1)))
    assert msg.startswith("memcheck: out-of-bounds global index load of 4 bytes"), msg
    assert "argument 'idx'" in msg and f"memcheck.cu:{line_of('index_read')}" in msg, msg
    assert "element 8 " in msg and "thread (7,0,0)" in msg, msg


def test_global_atomic(mod):
    acc = np.zeros(32, np.float32)
    msg = stray(mod.get_function("global_atomic"), (1,), (32,), (acc, np.int32(5000)))
    assert msg.startswith("memcheck: out-of-bounds global atomic of 4 bytes"), msg
    assert "argument 'acc'" in msg and f"memcheck.cu:{line_of('global_atomic')}" in msg, msg


def test_cp_async_source(mod):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(128, np.float32)
    msg = stray(mod.get_function("async_copy"), (1,), (32,), (x, y, np.int32(1), np.int32(0)), shared_mem=512)
    assert msg.startswith("memcheck: out-of-bounds cp.async source of 16 bytes"), msg
    assert "argument 'x'" in msg and "element 128 " in msg and "thread (31,0,0)" in msg, msg
    assert f"memcheck.cu:{line_of('async_copy')}" in msg, msg


def test_cp_async_destination(mod):
    x = np.arange(128, dtype=np.float32)
    y = np.zeros(128, np.float32)
    msg = stray(mod.get_function("async_copy"), (1,), (32,), (x, y, np.int32(0), np.int32(1)), shared_mem=512)
    assert msg.startswith("memcheck: out-of-bounds shared-memory cp.async destination of 16 bytes"), msg
    assert "byte offset 512 of the dynamic shared memory, which holds 512 bytes" in msg, msg
    assert f"memcheck.cu:{line_of('async_copy')}" in msg and "thread (31,0,0)" in msg, msg


@pytest.mark.parametrize("kernel, what, off, byte, thread", [
    ("shared_load", "load", 1, 256, "(63,0,0)"),          # one past the end
    ("shared_load", "load", 100_000, 400_000, "(0,0,0)"),  # far away
    ("shared_load", "load", -1, -4, "(0,0,0)"),          # before the start
    ("shared_store", "store", 1, 256, "(63,0,0)"),
    ("shared_store", "store", 100_000, 400_000, "(0,0,0)"),
])
def test_shared_access(mod, kernel, what, off, byte, thread):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros_like(x)
    msg = stray(mod.get_function(kernel), (1,), (64,), (x, y, np.int32(off)), shared_mem=256)
    assert msg.startswith(f"memcheck: out-of-bounds shared-memory {what} of 4 bytes in kernel {kernel}"), msg
    assert f"byte offset {byte} of the dynamic shared memory, which holds 256 bytes" in msg, msg
    assert f"thread {thread}" in msg, msg
    # the source line, from the library's line tables (addr2line)
    assert re.search(rf"memcheck\.cu:{line_of(kernel)}\b", msg), msg


def test_ldmatrix_row(mod):
    x = np.arange(256, dtype=np.uint16)
    y = np.zeros(128, np.uint32)
    msg = stray(mod.get_function("ldmatrix_rows"), (1,), (32,), (x, y, np.int32(1)), shared_mem=512)
    assert msg.startswith("memcheck: out-of-bounds shared-memory ldmatrix row of 16 bytes"), msg
    assert "byte offset 512 " in msg and "thread (31,0,0)" in msg, msg
    assert f"memcheck.cu:{line_of('ldmatrix_rows')}" in msg, msg


def _kernel_sources():
    root = Path(__file__).resolve().parents[2] / "kernels_cu"
    files = sorted(root.glob("*.cu")) + sorted(root.glob("*.cuh"))
    assert files
    for f in files:
        # code only: // comments dropped (the sources use no /* */ block comments in code)
        yield f.name, [(i, line.split("//")[0]) for i, line in enumerate(f.read_text().splitlines(), 1)]


def test_kernels_use_only_dynamic_shared_memory():
    """memcheck's shared window is the launch's dynamic shared memory: a static __shared__
    array would escape it, so the kernels declare none (portable.cuh's one extern array is
    CUFLASH_DYNAMIC_SHARED's)."""
    found = [f"{name}:{i}" for name, lines in _kernel_sources() for i, code in lines
             if "__shared__" in code and not (name == "portable.cuh" and "cuflash_dynamic_smem_" in code)]
    assert not found, f"static __shared__ declarations (memcheck does not see them): {found}"


def test_index_arrays_are_read_through_cuflash_index():
    """The serving kernels' index arrays -- the classic place for an overrun -- are read only
    through CUFLASH_INDEX, which memcheck sees (a plain subscript would bypass it)."""
    names = ("cu_q", "cu_k", "seqlens_k", "block_table", "pages")
    pat = re.compile(r"\b(" + "|".join(names) + r")\s*\[")
    found = [f"{name}:{i}: {code.strip()}" for name, lines in _kernel_sources() for i, code in lines
             if pat.search(code)]
    assert not found, found

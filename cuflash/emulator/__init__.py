"""Run the CUDA C kernels of ``kernels_cu/`` on the CPU.

``RawModule`` / ``RawKernel`` have the calling convention of CuPy's, so the
same launch code serves the GPU and the emulator::

    mod = cuflash.emulator.RawModule(code=src, options=("-DHEAD_DIM=64",))
    k = mod.get_function("flash_fwd")
    k((blocks_x, blocks_y), (128,), (q, k, v, o, np.int32(n), np.float32(scale)), shared_mem=nbytes)

NumPy arrays in ``args`` stand for device pointers (C-contiguous; the kernel's
writes are visible afterwards); scalars must have the parameter's exact type
(CuPy sends a Python int as 64 bits), else ``TypeError``.  As on a GPU,
``shared_mem`` above 48 KB needs ``kernel.max_dynamic_shared_size_bytes``
raised first, and a block holds at most 1024 threads: a launch that works here
works with CuPy.  docs/emulator.md describes the execution model (blocks in
turn, threads as fibers), the environment variables, and the checks:
:func:`memcheck`, :func:`interblock_check`, :func:`atomic_order_check`,
``race_check=True`` (ThreadSanitizer) and :func:`profiling`.
"""
import shutil

from ._checks import (AtomicOrderError, CompileError, InterBlockRaceError, LaunchError, MemcheckError, RaceError,
                      atomic_order_check, interblock_check, memcheck, profiling, set_atomic_order_check,
                      set_interblock_check, set_memcheck)
from ._module import RawKernel, RawModule, _cxx, cache_dir, kernels_cu_dir, last_launch_profile, last_launch_stats

__all__ = ["RawModule", "RawKernel", "RaceError", "InterBlockRaceError", "LaunchError", "CompileError",
           "last_launch_stats", "cache_dir", "kernels_cu_dir", "is_available", "interblock_check",
           "set_interblock_check", "MemcheckError", "memcheck", "set_memcheck", "profiling",
           "last_launch_profile", "AtomicOrderError", "atomic_order_check", "set_atomic_order_check"]


def is_available():
    """``(True, compiler path)`` when a host C++20 compiler is found, else ``(False, reason)``."""
    cxx = _cxx()
    path = shutil.which(cxx)
    if path is None:
        return False, f"no host C++ compiler {cxx!r} on PATH (install g++ or set CXX)"
    return True, f"host compiler {path}"

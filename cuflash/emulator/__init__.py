"""Run the CUDA C kernels of ``kernels_cu/`` on the CPU.

``RawModule`` / ``RawKernel`` have the calling convention of CuPy's, so the
same launch code serves the GPU and the emulator::

    mod = cuflash.emulator.RawModule(code=src, options=("-DHEAD_DIM=64",))
    k = mod.get_function("flash_fwd")
    k((blocks_x, blocks_y), (128,), (q, k, v, o, np.int32(n), np.float32(scale)), shared_mem=nbytes)

NumPy arrays in ``args`` stand for device pointers (the kernel's writes are
visible afterwards); scalars are converted by the kernel's signature and a
mismatch raises ``TypeError``.  See docs/emulator.md for the execution model.
"""
from ._module import (CompileError, LaunchError, RaceError, RawKernel, RawModule, cache_dir,
                      kernels_cu_dir, last_launch_stats)

__all__ = ["RawModule", "RawKernel", "RaceError", "LaunchError", "CompileError",
           "last_launch_stats", "cache_dir", "kernels_cu_dir", "is_available"]


def is_available():
    """``(True, "")`` when a host C++20 compiler is found, else ``(False, reason)``."""
    import shutil
    from ._module import _cxx
    cxx = _cxx()
    if shutil.which(cxx) is None:
        return False, f"no host C++ compiler {cxx!r} on PATH (install g++ or set CXX)"
    return True, ""

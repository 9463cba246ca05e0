"""Run the CUDA C kernels of ``kernels_cu/`` on the CPU.

``RawModule`` / ``RawKernel`` have the calling convention of CuPy's, so the
same launch code serves the GPU and the emulator::

    mod = cuflash.emulator.RawModule(code=src, options=("-DHEAD_DIM=64",))
    k = mod.get_function("flash_fwd")
    k((blocks_x, blocks_y), (128,), (q, k, v, o, np.int32(n), np.float32(scale)), shared_mem=nbytes)

NumPy arrays in ``args`` stand for device pointers (the kernel's writes are
visible afterwards); scalars are converted by the kernel's signature and a
mismatch raises ``TypeError``.  See docs/emulator.md for the execution model.

What a kernel and its launcher must respect (checked here, so that a launch
that works on the emulator also works with CuPy on a GPU):

* kernels are ``extern "C" __global__``, include ``portable.cuh`` first and
  are specialised by ``-D`` options; ``-arch=sm_XX`` sets the emulated
  ``__CUDA_ARCH__`` (sm_80 by default);
* array arguments must be C-contiguous (the kernel sees a pointer); pass
  scalars as ``np.int32`` / ``np.float32`` ... of the parameter's exact type
  (CuPy sends a Python int as 64 bits);
* ``shared_mem`` above 48 KB needs ``kernel.max_dynamic_shared_size_bytes``
  raised first, as on the GPU; blocks of at most 1024 threads;
* global memory goes through ``gload``/``gstore``/``gatomic_add`` to be
  counted by :func:`last_launch_stats`; dynamic shared memory is declared with
  ``CUFLASH_DYNAMIC_SHARED(type, name)`` (``type* name``) and starts as NaN;
* mma/ldmatrix and warp collectives need every lane of a full warp; a
  barrier not reached by all live threads is reported as a deadlock;
* ``race_check=True`` runs each launch under ThreadSanitizer and raises
  :class:`RaceError` (blocks run one after another, so races between blocks
  on global memory are not seen by it); :func:`interblock_check` logs every
  ``gstore`` and raises :class:`InterBlockRaceError` when two blocks of one
  launch store to the same global address.
"""
from ._module import (CompileError, InterBlockRaceError, LaunchError, RaceError, RawKernel, RawModule,
                      cache_dir, interblock_check, kernels_cu_dir, last_launch_stats,
                      set_interblock_check)

__all__ = ["RawModule", "RawKernel", "RaceError", "InterBlockRaceError", "LaunchError", "CompileError",
           "last_launch_stats", "cache_dir", "kernels_cu_dir", "is_available", "interblock_check",
           "set_interblock_check"]


def is_available():
    """``(True, compiler path)`` when a host C++20 compiler is found, else ``(False, reason)``."""
    import shutil
    from ._module import _cxx
    cxx = _cxx()
    path = shutil.which(cxx)
    if path is None:
        return False, f"no host C++ compiler {cxx!r} on PATH (install g++ or set CXX)"
    return True, f"host compiler {path}"

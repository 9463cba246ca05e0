"""Run the CUDA C kernels of ``kernels_cu/`` on the CPU.

``RawModule`` / ``RawKernel`` have the calling convention of CuPy's, so the
same launch code serves the GPU and the emulator::

    mod = cuflash.emulator.RawModule(code=src, options=("-DHEAD_DIM=64",))
    k = mod.get_function("flash_fwd")
    k((blocks_x, blocks_y), (128,), (q, k, v, o, np.int32(n), np.float32(scale)), shared_mem=nbytes)

NumPy arrays in ``args`` stand for device pointers (the kernel's writes are
visible afterwards); scalars are converted by the kernel's signature and a
mismatch raises ``TypeError``.  See docs/emulator.md for the execution model.

Execution: the blocks of a grid run one after another on the calling thread.
A block's CUDA threads are fibers (user-space contexts, ``fiber_engine.h``)
that switch only where a CUDA thread waits -- ``__syncthreads*``,
``__syncwarp``, shuffles, votes, ``mma``, ``ldmatrix`` -- at a few tens of
nanoseconds per thread, without system calls.  Between two such points the
threads run one after another in thread-index order, so every run is
reproducible; a kernel that lacks a barrier gets whatever that order gives,
which may hide the bug: finding races is ``race_check=True``'s job, whose
builds run the threads as real threads under ThreadSanitizer.  A thread
busy-waiting for another thread of its block (a flag in shared memory, no
barrier) never lets that thread run: the watchdog below ends such a launch,
where a GPU with independent thread scheduling (sm_70+) may get through.
Environment:

* ``CUFLASH_EMULATOR_SCHEDULE=random`` (or ``random:<seed>``) runs the
  threads in a pseudo-random order, drawn anew for every round between
  waits; the same seed gives the same order.  A correct kernel gives the
  same results; ``fixed`` (the default) is thread-index order;
* ``CUFLASH_EMULATOR_TIMEOUT`` (seconds, default 1800, 0 disables): a launch
  running longer -- a thread looping forever outside every barrier, which
  nothing else can stop -- ends the process with a message naming the
  kernel.  A deadlock in barriers is a :class:`LaunchError` at once;
* ``CUFLASH_EMULATOR_STACK_KB`` (default 256): stack per fiber.  Below each
  stack is a guard region; overflowing into it ends the process with a
  message naming the kernel, block and thread (the largest frame of
  ``kernels_cu/`` is about 2.4 KiB).

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
* ``hopper.cuh``'s mbarriers and bulk copies need ``-arch=sm_90`` or later.  A
  bulk copy's destination reads as NaN until a thread waits on its mbarrier
  (memcheck reports an access before that); an mbarrier wait that no arrival
  or copy can complete is a deadlock; a block may not end with copies in flight;
* ``hopper.cuh``'s warpgroup MMA (``wgmma_ss``/``wgmma_rs``, fence, commit, wait)
  needs ``-arch=sm_90a`` and whole warpgroups; D reads as NaN until the wait that
  completes it, and a store to an operand's shared memory before then is an error;
* ``race_check=True`` runs each launch under ThreadSanitizer, with real
  threads, and raises
  :class:`RaceError` (blocks run one after another, so races between blocks
  on global memory are not seen by it); :func:`interblock_check` logs every
  ``gstore`` and raises :class:`InterBlockRaceError` when two blocks of one
  launch store to the same global address; :func:`atomic_order_check` logs
  every float atomic add and raises :class:`AtomicOrderError` when two threads
  add into the same address (a sum whose order, on a GPU, varies by run);
* :func:`memcheck` checks every global access of a launch against its arrays
  and every shared-memory access against its shared memory, and raises
  :class:`MemcheckError` naming the access, thread, argument and source line;
* :func:`profiling` records the accesses of its launches: shared-memory bank
  conflicts, global sectors and executed counts per source line
  (:func:`last_launch_profile`).
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

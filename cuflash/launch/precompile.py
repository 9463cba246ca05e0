"""Compiling the kernels of default-tile calls ahead of time (``cuflash.precompile``).

For clusters and containers: fill the compile cache once (CuPy's kernel cache,
``$CUPY_CACHE_DIR`` or ``~/.cupy/kernel_cache``, on a GPU; the emulator's
``$CUFLASH_CACHE_DIR``) so that no training job pays the first-call compile.
The launchers say which kernels a call needs (``kernels_needed``); the
distinct modules are compiled concurrently by :func:`cuflash.kernels.get_functions`.
"""
import time

from .. import kernels
from . import bwd, fwd

__all__ = ["jobs", "precompile"]


def jobs(runtime, dtypes, head_dims):
    """The (file, kernel, defines, shared bytes) of the forward and backward per dtype and d."""
    out = []
    for dt in dtypes:
        for d in head_dims:
            out += fwd.kernels_needed(runtime, d, d, dt)
            out += bwd.kernels_needed(runtime, d, d, dt)
    return out


def precompile(runtime, dtypes, head_dims, progress=None):
    """Compile every module those calls need, concurrently.

    Returns ``{"backend", "modules": [{"file", "kernels", "options"}, ...],
    "seconds"}`` (wall time of the whole compile; modules already compiled in
    this process cost nothing).  ``progress(msg)`` is called before and after.
    """
    todo = jobs(runtime, dtypes, head_dims)
    modules = {}
    for filename, name, defines, _ in todo:
        key = (filename, kernels.build_options(defines))
        modules.setdefault(key, set()).add(name)
    if progress is not None:
        progress(f"compiling {len(modules)} kernel module(s) for {runtime!r}")
    t0 = time.perf_counter()
    kernels.get_functions(runtime, todo)  # distinct modules compile side by side
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress(f"done in {seconds:.1f} s")
    return {"backend": runtime.name, "seconds": seconds,
            "modules": [{"file": f, "kernels": sorted(names),
                         "options": [o for o in opts if o.startswith("-D")]}
                        for (f, opts), names in modules.items()]}

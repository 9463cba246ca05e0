"""Choosing the backend module that runs a call.

Every backend is a module with the same public names and signatures (the
API contract documented on the functions of ``cuflash``); the front in ``cuflash/__init__.py`` asks this
module for one and calls it.  Backends are imported lazily so that
``import cuflash`` never needs CuPy, a GPU or a compiler.
"""
import importlib

import numpy as np

# backend name -> module implementing it
BACKEND_MODULES = {
    "numpy": "cuflash.reference",
    "cuda": "cuflash.cuda_backend",
    "emulator": "cuflash.emulator_backend",
}

# the names every backend module must define (tests assert the signatures match)
API_NAMES = (
    "precompile",
    "online_softmax",
    "online_softmax_2d",
    "standard_attention",
    "standard_attention_backward",
    "tiled_attention",
    "tiled_attention_backward",
    "memory_analysis",
    "verify_no_full_materialization",
    "attention_with_kvcache",
    "varlen_attention",
    "varlen_attention_backward",
)


def array_library(a, name="argument"):
    """'numpy' or 'cupy' for an array, TypeError (naming the argument) for anything else."""
    if isinstance(a, np.ndarray):
        return "numpy"
    mod = type(a).__module__ or ""
    if mod.split(".")[0] == "cupy":
        return "cupy"
    raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got "
                    f"{type(a).__module__}.{type(a).__name__}")


def _module(name):
    return importlib.import_module(BACKEND_MODULES[name])


def available_backends():
    """Which backends can run here: ``{name: (available, reason)}``."""
    out = {}
    for name in BACKEND_MODULES:
        try:
            ok, why = _module(name).is_available()
        except ImportError as e:  # a backend module that cannot even be imported
            ok, why = False, f"cannot import {BACKEND_MODULES[name]}: {e}"
        out[name] = (bool(ok), str(why))
    return out


def _unavailable_message(name, why):
    lines = [f"backend {name!r} is not available here: {why}", "available backends:"]
    for n, (ok, reason) in available_backends().items():
        lines.append(f"  {n}: {'yes' if ok else 'no'} ({reason})")
    return "\n".join(lines)


# (backend argument, array types...) -> module, for calls that succeeded before: a
# repeated call pays one dictionary lookup here (no availability query, no imports)
_RESOLVED = {}


def get_backend(backend, *arrays, names=None):
    """The backend module for ``backend`` (a name or None) and these arrays.

    ``None`` picks from the array type: CuPy arrays go to "cuda", NumPy arrays
    to "numpy".  Arrays of two libraries in one call are a TypeError; a named
    backend that cannot take the arrays' library is a TypeError too -- except
    that a backend that is not available here (no CuPy, no GPU) says so first.
    ``names`` (space-separated) names the arrays in error messages.
    """
    try:
        key = (backend,) + tuple(a.__class__ for a in arrays)
        mod = _RESOLVED.get(key)
    except TypeError:  # an unhashable backend argument: the checks below report it
        key, mod = None, None
    if mod is not None:
        return mod
    names = names.split() if names else [f"argument {i + 1}" for i in range(len(arrays))]
    mod = _resolve(backend, [(n, a) for n, a in zip(names, arrays) if a is not None])
    if key is not None:
        _RESOLVED[key] = mod
    return mod


def _resolve(backend, named):
    by_name = {name: array_library(a, name) for name, a in named}
    libs = set(by_name.values())
    if len(libs) > 1:
        which = ", ".join(f"{name} is {lib}" for name, lib in by_name.items())
        raise TypeError(f"arrays of two libraries in one call ({which}); "
                        "pass all numpy.ndarray or all cupy.ndarray")
    lib = libs.pop() if libs else None
    if backend is None:
        backend = "cuda" if lib == "cupy" else "numpy"
    if not isinstance(backend, str) or backend not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {backend!r}; choose one of "
                         f"{sorted(BACKEND_MODULES)} or None (pick from the array type)")
    try:
        mod = _module(backend)
        ok, why = mod.is_available()
    except ImportError as e:
        ok, why = False, f"cannot import {BACKEND_MODULES[backend]}: {e}"
    if not ok:
        raise ValueError(_unavailable_message(backend, why))
    wants = "cupy" if backend == "cuda" else "numpy"
    if lib is not None and lib != wants:
        raise TypeError(f"backend {backend!r} takes {wants} arrays, got {lib} arrays")
    return mod

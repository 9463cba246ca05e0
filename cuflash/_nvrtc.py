"""A ctypes wrapper over NVRTC, the compiler CuPy's RawModule uses; no GPU needed.

Used to compile-check every kernel for several architectures without a GPU
(tests/kernels/test_nvrtc.py) and to read register / spill / shared-memory figures
(bench/kernel_report.py).  The library comes from the ``nvidia-cuda-nvrtc``
wheel (``site-packages/nvidia/**/lib/libnvrtc.so*``), from ``$CUFLASH_NVRTC``
(a path to libnvrtc.so), or from the CUDA toolkit; no compiled extension.
"""
import ctypes
import glob
import os
import re
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NVRTCError", "CompileResult", "find_libnvrtc", "version", "supported_archs", "compile",
           "is_available", "parse_ptxas_info"]


class NVRTCError(RuntimeError):
    """NVRTC refused the source; ``log`` holds the compiler's messages."""

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


@dataclass
class CompileResult:
    """What one NVRTC compilation produced."""
    ptx: str
    cubin: bytes = b""  # only for a real architecture (sm_XX)
    log: str = ""
    lowered_names: dict = field(default_factory=dict)

    @property
    def warnings(self):
        """Lines of the log that are warnings (NVRTC reports them with exit status success)."""
        return [ln for ln in self.log.splitlines() if re.search(r"\bwarning\b", ln, re.I)]


def _candidates():
    env = os.environ.get("CUFLASH_NVRTC")
    if env:
        yield Path(env)
    roots = []
    try:
        roots += site.getsitepackages()
    except AttributeError:  # virtualenvs of old Python
        pass
    try:
        roots.append(site.getusersitepackages())
    except AttributeError:
        pass
    roots += [p for p in sys.path if p.endswith("site-packages")]
    found = []
    for root in dict.fromkeys(roots):
        found += glob.glob(os.path.join(root, "nvidia", "**", "libnvrtc.so*"), recursive=True)
    # libnvrtc.so.13 before .so.12; skip the alternative builds (libnvrtc.alt.so) and builtins
    found = [f for f in found if re.search(r"/libnvrtc\.so(\.\d+)*$", f)]
    for f in sorted(found, key=lambda f: [int(x) for x in re.findall(r"\d+", Path(f).name)], reverse=True):
        yield Path(f)
    for base in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base:
            yield from (Path(p) for p in sorted(glob.glob(os.path.join(base, "lib*", "libnvrtc.so*")), reverse=True))


_lib = None


def find_libnvrtc():
    """Path of the libnvrtc that will be used (FileNotFoundError naming where it looked)."""
    for p in _candidates():
        if p.is_file():
            return p
    raise FileNotFoundError("libnvrtc.so not found: install the NVRTC wheel (pip install nvidia-cuda-nvrtc, "
                            "the 'test' extra of cuflash) or set CUFLASH_NVRTC to the library's path")


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = find_libnvrtc()
    # NVRTC dlopens libnvrtc-builtins by soname; the wheel's directory is not on
    # the loader's path, so load it first, globally, from beside libnvrtc.
    for b in sorted(path.parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in b.name:
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
            break
    lib = ctypes.CDLL(str(path))
    c_char_pp = ctypes.POINTER(ctypes.c_char_p)
    prog = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "nvrtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
        "nvrtcGetErrorString": [ctypes.c_int],
        "nvrtcCreateProgram": [prog, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, c_char_pp, c_char_pp],
        "nvrtcDestroyProgram": [prog],
        "nvrtcCompileProgram": [ctypes.c_void_p, ctypes.c_int, c_char_pp],
        "nvrtcGetPTXSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
        "nvrtcGetPTX": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
        "nvrtcGetCUBIN": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcGetProgramLogSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
        "nvrtcGetProgramLog": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcAddNameExpression": [ctypes.c_void_p, ctypes.c_char_p],
        "nvrtcGetLoweredName": [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)],
        "nvrtcGetNumSupportedArchs": [ctypes.POINTER(ctypes.c_int)],
        "nvrtcGetSupportedArchs": [ctypes.POINTER(ctypes.c_int)],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_char_p if name == "nvrtcGetErrorString" else ctypes.c_int
    lib.path = path
    _lib = lib
    return lib


def _check(lib, status, what):
    if status != 0:
        raise NVRTCError(f"{what}: {lib.nvrtcGetErrorString(status).decode()} (status {status})")


def is_available():
    """``(True, path)`` when libnvrtc loads, else ``(False, reason)``."""
    try:
        return True, str(_load().path)
    except (OSError, FileNotFoundError) as e:
        return False, str(e)


def version():
    """(major, minor) of the loaded NVRTC."""
    lib = _load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs():
    """Architectures this NVRTC can compile for, as ints (75, 80, ...)."""
    lib = _load()
    n = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    return list(arr)


def compile(source, name="kernel.cu", options=(), name_expressions=()):
    """Compile CUDA C ``source``; returns a :class:`CompileResult`.

    ``options`` are NVRTC's (``-arch=sm_80`` gives a cubin as well as PTX,
    ``-arch=compute_80`` PTX only; ``-D``, ``-I``, ``-std=c++17``,
    ``--ptxas-options=-v`` for register and spill figures in the log).
    Raises :class:`NVRTCError` with the log when compilation fails.
    """
    lib = _load()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * max(1, len(opts)))(*opts)
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise NVRTCError(f"NVRTC failed to compile {name} with {' '.join(options)}:\n{log}", log)
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        cubin = b""
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0 and size.value:
            cb = ctypes.create_string_buffer(size.value)
            _check(lib, lib.nvrtcGetCUBIN(prog, cb), "nvrtcGetCUBIN")
            cubin = cb.raw
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[expr] = out.value.decode()
        return CompileResult(ptx.value.decode(errors="replace"), cubin, log, lowered)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


_FUNC_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+\w*)'")
_PROP_RE = re.compile(r"Function properties for (\S+)")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas_info(text):
    """Per-kernel figures from ``ptxas -v`` output (or an NVRTC log compiled with it).

    Returns ``{kernel: {"registers", "spill_stores", "spill_loads", "stack_frame", "static_shared"}}``.
    """
    out, cur = {}, None
    for line in text.splitlines():
        m = _FUNC_RE.search(line) or _PROP_RE.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"registers": 0, "spill_stores": 0, "spill_loads": 0,
                                              "stack_frame": 0, "static_shared": 0})
            continue
        if cur is None:
            continue
        m = _SPILL_RE.search(line)
        if m:
            cur["stack_frame"], cur["spill_stores"], cur["spill_loads"] = (int(x) for x in m.groups())
        m = _USED_RE.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            s = _SMEM_RE.search(line)
            cur["static_shared"] = int(s.group(1)) if s else 0
    return out

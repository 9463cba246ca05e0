"""RawModule / RawKernel with CuPy's calling convention, executed on the CPU.

The CUDA C source is compiled unchanged as C++ by the host compiler with
``cuda_host.h`` force-included (docs/emulator.md), into a shared library that
is cached on disk by a hash of the preprocessed source and the options.  Each
``extern "C" __global__`` kernel gets a generated launcher that runs the grid
one block at a time, on the calling thread: the block's CUDA threads are
fibers that switch where they wait (barriers, warp collectives; see
``fiber_engine.h``).  ``race_check=True`` builds run them as real threads
under ThreadSanitizer instead, in a child process (``_race.py``).
"""
import contextlib
import ctypes
import hashlib
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process build lock (see _build_lock)
    fcntl = None

from ._checks import (CHECK_ERRORS, CompileError, LaunchError, MemcheckError, describe_address,
                      describe_memcheck, launch_flags, memcheck_enabled, profile_enabled,
                      profile_sink, resolve_sites)
from ._race import run_tsan

__all__ = ["RawModule", "RawKernel", "last_launch_stats", "last_launch_profile", "cache_dir", "kernels_cu_dir"]

_HERE = Path(__file__).resolve().parent
HOST_HEADER = _HERE / "cuda_host.h"
# the engine's definitions (see engine.cpp)
ENGINE_SOURCE = _HERE / "engine.cpp"
# files the host build reads besides cuda_host.h (part of the cache key with it)
_ENGINE_HEADERS = (_HERE / "fiber_engine.h", ENGINE_SOURCE)
PCH_ENV = "CUFLASH_EMULATOR_PCH"   # "0": libraries parse the host header, no precompiled copy
# bump when the generated launcher code changes (part of the cache key)
_LAUNCHER_VERSION = "11"
# -O1: kernels barely slower than at -O2 (they are bound by barriers), ~20% faster builds.
# The memcheck (cuda_host.h): every load and store calls a hook (kernel-address
# instrumentation through calls, no shadow memory, no stack or global redzones); -g1 gives
# the line tables that name a stray access's source line.
_MEMCHECK_FLAGS = ("-DCUFLASH_EMULATOR_MEMCHECK=1", "-g1", "-fsanitize=kernel-address",
                   "--param", "asan-instrumentation-with-call-threshold=0", "--param", "asan-stack=0",
                   "--param", "asan-globals=0")
_LIB_FLAGS = ("-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-fvisibility=hidden", *_MEMCHECK_FLAGS)
# engine.cpp (launch, block scheduling, the checks, the profiler, the emulated instructions'
# bodies) is compiled once per configuration into an object that each library links with
# hidden symbols: each library keeps its own engine state, and a library's compile is about its
# kernel.
_ENGINE_FLAGS = tuple(f for f in _LIB_FLAGS if f != "-shared") + ("-c",)
_TSAN_FLAGS = ("-std=c++20", "-O1", "-g", "-fsanitize=thread", "-pthread")
_DEFAULT_ARCH = 800
_MAX_THREADS_PER_BLOCK = 1024
_DEFAULT_MAX_DYNAMIC_SHARED = 48 * 1024  # CUDA's limit without the opt-in attribute


def cache_dir():
    """Where compiled kernel libraries are kept (``$CUFLASH_CACHE_DIR`` or ~/.cache/cuflash/emulator)."""
    d = os.environ.get("CUFLASH_CACHE_DIR")
    d = Path(d) / "emulator" if d else Path.home() / ".cache" / "cuflash" / "emulator"
    d.mkdir(parents=True, exist_ok=True)
    return d


def kernels_cu_dir():
    """The kernels_cu/ directory: inside the installed package, or at the top of a checkout."""
    pkg = _HERE.parent
    for cand in (pkg / "kernels_cu", pkg.parent / "kernels_cu"):
        if (cand / "portable.cuh").is_file():
            return cand
    raise FileNotFoundError(f"kernels_cu/portable.cuh not found next to {pkg}")


def _cxx():
    return os.environ.get("CXX", "g++")


# ---------------------------------------------------------------- options
# NVRTC options that mean nothing for the host build (code generation, debug info, ...)
_IGNORED_WITH_VALUE = ("--use_fast_math", "-use_fast_math", "-lineinfo", "--generate-line-info",
                       "-G", "--device-debug", "-dopt", "--extra-device-vectorization",
                       "-extra-device-vectorization", "-restrict", "--restrict", "-w", "--disable-warnings",
                       "-dlto", "--dlink-time-opt", "-ewp", "--extensible-whole-program",
                       "--device-as-default-execution-space", "-default-device", "-rdc=false",
                       "--relocatable-device-code=false", "-Werror", "--Werror", "-dw", "--dw",
                       "--no-source-include", "-no-source-include", "--device-int128", "-device-int128")
_IGNORED_PREFIXES = ("--std=", "-std=", "--fmad=", "-fmad=", "--ftz=", "-ftz=", "--prec-div=",
                     "-prec-div=", "--prec-sqrt=", "-prec-sqrt=", "--maxrregcount=", "-maxrregcount=",
                     "--ptxas-options=", "-Xptxas", "--split-compile=", "-split-compile=",
                     "--diag-suppress=", "-diag-suppress=", "--diag-error=", "--diag-warn=",
                     "--minimal", "-minimal", "--optimization-info=", "--Ofast-compile=", "-Ofast-compile=",
                     "--relocatable-device-code=false", "-rdc=false", "--dopt=", "-dopt=",
                     "--pre-include=", "-include=")


def _parse_options(options):
    """NVRTC-style options -> (host compiler flags, emulated arch as an int like 800).

    -D/-U/-I (and --define-macro/--undefine-macro/--include-path) are passed on;
    -arch/--gpu-architecture sets the emulated architecture (CUFLASH_ARCH, and
    so __CUDA_ARCH__; sm_80 by default); code-generation options are ignored.
    """
    if isinstance(options, str):
        options = (options,)
    flags, arch = [], _DEFAULT_ARCH
    it = iter(list(options))
    for opt in it:
        if not isinstance(opt, str):
            raise TypeError(f"options must be strings, got {opt!r}")
        o = opt.strip()
        for long, short in (("--define-macro=", "-D"), ("--undefine-macro=", "-U"), ("--include-path=", "-I")):
            if o.startswith(long):
                o = short + o[len(long):]
        if o in ("-D", "-U", "-I", "--define-macro", "--undefine-macro", "--include-path"):
            val = next(it, None)
            if val is None:
                raise ValueError(f"option {o} needs a value")
            o = {"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I"}.get(o, o) + val
        if o.startswith(("-D", "-U", "-I")) and len(o) > 2:
            if o.startswith("-I"):
                o = "-I" + str(Path(o[2:]).resolve())
            flags.append(o)
            continue
        m = re.fullmatch(r"(?:--gpu-architecture|-arch|--gpu-name)[= ]?(?:sm_|compute_)(\d+)[a-z]?", o)
        if m is None and o in ("-arch", "--gpu-architecture"):
            val = next(it, "")
            m = re.fullmatch(r"(?:sm_|compute_)(\d+)[a-z]?", val)
            if m is None:
                raise ValueError(f"cannot read the architecture in {o} {val}")
        if m is not None:
            arch = int(m.group(1)) * 10
            continue
        if o in _IGNORED_WITH_VALUE or o.startswith(_IGNORED_PREFIXES):
            continue
        if o == "-Xptxas":
            next(it, None)
            continue
        raise ValueError(f"option {opt!r} is not understood by the emulator "
                         "(supported: -D, -U, -I, -arch/--gpu-architecture, and NVRTC code-generation options, which are ignored)")
    return flags, arch


# ---------------------------------------------------------------- kernel discovery
_KERNEL_RE = re.compile(r'__cuflash_global__\s+void\s+([A-Za-z_]\w*)\s*\(([^)]*)\)')


def _split_params(text):
    text = text.strip()
    if not text or text == "void":
        return []
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [" ".join(p.split()) for p in out]


def _param_name(decl, i):
    m = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\])?\s*$", decl)
    return m.group(1) if m else f"arg{i}"


def _find_kernels(preprocessed):
    """{name: (is_extern_c, [param declarations])} of the __global__ functions."""
    kernels = {}
    for m in _KERNEL_RE.finditer(preprocessed):
        before = preprocessed[max(0, m.start() - 200):m.start()]
        # the declaration's own prefix: text after the previous ';', '}' or '{'
        prefix = re.split(r"[;{}]", before)[-1]
        extern_c = 'extern "C"' in prefix or _inside_extern_c_block(preprocessed, m.start())
        kernels[m.group(1)] = (extern_c, _split_params(m.group(2)))
    return kernels


def _inside_extern_c_block(text, pos):
    start = text.rfind('extern "C"', 0, pos)
    if start < 0:
        return False
    brace = text.find("{", start)
    if brace < 0 or brace > pos or text[start + len('extern "C"'):brace].strip():
        return False
    depth = 0
    for ch in text[brace:pos]:
        depth += ch == "{"
        depth -= ch == "}"
    return depth > 0


def _run(cmd, what, timeout=600, cwd=None):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except FileNotFoundError as e:
        raise CompileError(f"{what}: the host C++ compiler {cmd[0]!r} was not found ({e}); "
                           "install g++ or set CXX") from None
    except subprocess.TimeoutExpired:
        raise CompileError(f"{what}: {cmd[0]} took longer than {timeout} s") from None
    if r.returncode != 0:
        raise CompileError(f"{what} failed (exit {r.returncode}):\n{shlex.join(cmd)}\n{r.stderr[-20000:]}")
    return r


def _launcher_code(kernels, tsan_main=False):
    """C++ appended to the kernel source: one exported launcher and signature per kernel."""
    lines = ["", "// ---- generated by cuflash.emulator ----"]
    for name in kernels:
        lines += [
            f'static void __cuflash_entry_{name}(void** a) {{ ::cuflash_emu::invoke({name}, a); }}',
            f'extern "C" __attribute__((visibility("default"))) int __cuflash_launch_{name}('
            "const unsigned* grid, const unsigned* block, unsigned long long shmem, void** args, "
            "unsigned long long* stats, char* err, size_t errlen, unsigned flags) {",
            f'  return ::cuflash_emu::launch("{name}", __cuflash_entry_{name}, args, grid, block, shmem, stats, err, errlen, flags);',
            "}",
            f'extern "C" __attribute__((visibility("default"))) const char* __cuflash_sig_{name}() {{',
            f"  static const std::string s = ::cuflash_emu::signature_of({name}); return s.c_str();",
            "}",
        ]
    lines.append('extern "C" __attribute__((visibility("default"))) void __cuflash_memcheck_buffers('
                 "const unsigned long long* ranges, const unsigned* args, unsigned n) "
                 "{ ::cuflash_emu::set_buffers(ranges, args, n); }")
    lines.append('extern "C" __attribute__((visibility("default"))) size_t __cuflash_profile_text(char* buf, size_t n) '
                 "{ const std::string s = ::cuflash_emu::profile_text(); "
                 "if (n > s.size()) std::memcpy(buf, s.c_str(), s.size() + 1); return s.size(); }")
    if tsan_main:
        lines.append(_TSAN_MAIN.replace("@TABLE@", ", ".join(
            f'{{"{n}", __cuflash_launch_{n}}}' for n in kernels)))
    return "\n".join(lines) + "\n"


# A standalone program for race checks: ThreadSanitizer must be loaded at
# process start, so the launch runs in a child process that reads the
# arguments from a file and writes the arrays back.
_TSAN_MAIN = r'''
#include <fstream>
#include <iostream>
typedef int (*cuflash_launcher_t)(const unsigned*, const unsigned*, unsigned long long, void**, unsigned long long*, char*, size_t, unsigned);
struct cuflash_entry_t { const char* name; cuflash_launcher_t fn; };
static const cuflash_entry_t cuflash_table[] = {@TABLE@};
// file: name\n grid0 grid1 grid2 block0 block1 block2 shmem nargs nbuffers flags\n
//       then per buffer: nbytes parent_address\n <raw bytes>\n
//       then per arg: "a buffer offset\n" (a pointer into a buffer) or "s nbytes\n<raw bytes>\n"
// Arguments that alias (the same array twice, or overlapping views) point into one buffer,
// as they would into one allocation on the GPU.
int main(int argc, char** argv) {
  if (argc != 3) { std::cerr << "usage: runner in out\n"; return 2; }
  std::ifstream in(argv[1], std::ios::binary);
  std::string name; unsigned g[3], b[3], flags; unsigned long long shmem; size_t nargs, nbuf;
  in >> name >> g[0] >> g[1] >> g[2] >> b[0] >> b[1] >> b[2] >> shmem >> nargs >> nbuf >> flags;
  std::vector<std::vector<unsigned char>> bufs(nbuf);
  std::vector<unsigned long long> from(nbuf), to(nbuf), sizes(nbuf);
  for (size_t i = 0; i < nbuf; ++i) {
    size_t n; in >> n >> from[i]; in.get();
    bufs[i].resize(n + 64);
    in.read(reinterpret_cast<char*>(bufs[i].data()), n);
    in.get();
    to[i] = reinterpret_cast<unsigned long long>(bufs[i].data()); sizes[i] = n;
  }
  // addresses held in the data (tensor maps) are the parent's: the engine moves them here
  ::cuflash_emu::set_relocations(from.data(), to.data(), sizes.data(), unsigned(nbuf));
  std::vector<std::vector<unsigned char>> scalars(nargs);
  std::vector<void*> ptrs(nargs), args(nargs);
  for (size_t i = 0; i < nargs; ++i) {
    char kind; in >> kind;
    if (kind == 'a') {
      size_t bi, off; in >> bi >> off; in.get();
      ptrs[i] = bufs[bi].data() + off; args[i] = &ptrs[i];
    } else {
      size_t n; in >> n; in.get();
      scalars[i].resize(n + 16);
      in.read(reinterpret_cast<char*>(scalars[i].data()), n);
      in.get();
      args[i] = scalars[i].data();
    }
  }
  cuflash_launcher_t fn = nullptr;
  for (const auto& e : cuflash_table) if (name == e.name) fn = e.fn;
  if (!fn) { std::cerr << "no kernel " << name << "\n"; return 2; }
  unsigned long long stats[2] = {0, 0}; char err[4096] = {0};
  int rc = fn(g, b, shmem, args.data(), stats, err, sizeof err, flags);
  std::ofstream out(argv[2], std::ios::binary);
  // the buffers' addresses here, so the parent can map an address in a message to its arrays
  out << rc << " " << stats[0] << " " << stats[1];
  for (size_t i = 0; i < nbuf; ++i) out << " " << reinterpret_cast<unsigned long long>(bufs[i].data());
  out << "\n" << err << "\n@@\n";
  for (size_t i = 0; i < nbuf; ++i)
    out.write(reinterpret_cast<const char*>(bufs[i].data()), bufs[i].size() - 64);
  return 0;
}
'''


# ---------------------------------------------------------------- stats
_stats_lock = threading.Lock()
_last_stats = None


def last_launch_stats():
    """Counters of the most recent launch in this process.

    ``global_bytes_read`` / ``global_bytes_written`` count the bytes moved by the
    kernels' ``gload``/``gstore``/``gatomic_add``/``__ldg``/``cp_async_16`` calls
    (portable.cuh); plain pointer accesses are not counted.  Also ``blocks``,
    ``threads_per_block``, ``dynamic_shared_bytes``, ``grid``, ``block``,
    ``kernel`` and ``seconds`` (wall time of the launch).
    """
    with _stats_lock:
        if _last_stats is None:
            raise RuntimeError("no kernel has been launched by cuflash.emulator in this process")
        return dict(_last_stats)


_last_profile = None


def last_launch_profile():
    """The profile of the most recent launch made inside :func:`cuflash.emulator.profiling`.

    ``{"kernel", "sites", "counts"}``.  ``sites``: one dict per access site (source line) and
    kind: ``kind`` (shared_load, shared_store, ldmatrix, cp.async_shared, global_load,
    global_store, global_atomic, cp.async_global), ``bytes`` per lane, ``site``
    ("file:line"), ``requests`` (warp-level), ``lanes`` (thread accesses), and for shared
    kinds ``wavefronts``, ``ideal`` and ``conflicts`` (= wavefronts - ideal, Nsight
    Compute's bank conflicts), for global kinds ``sectors`` (32-byte) and ``ideal``.
    ``counts``: executed instructions per class, in warp instructions (thread executions / 32),
    and the memory accesses by kind and width in bits ("shared_load.128", "ldmatrix.128",
    "global_store.32", ...) as warp-level requests.
    """
    with _stats_lock:
        if _last_profile is None:
            raise RuntimeError("no kernel has been launched inside cuflash.emulator.profiling() in this process")
        return _last_profile


def _read_profile(lib, lib_path, kernel):
    fn = getattr(lib, "__cuflash_profile_text")
    fn.restype = ctypes.c_size_t
    n = fn(None, ctypes.c_size_t(0))
    buf = ctypes.create_string_buffer(n + 1)
    fn(buf, ctypes.c_size_t(n + 1))
    rows = [ln.split("\t") for ln in buf.value.decode().splitlines()]
    pcs = resolve_sites(lib_path, [int(r[3], 16) for r in rows if r[0] == "site" and r[3] != "-"])
    sites, counts = [], {}
    for r in rows:
        if r[0] == "count":
            counts[r[1]] = int(r[2]) / 32
            continue
        _, kind, size, pc, file, line, req, lanes, cost, ideal = r
        where = pcs.get(int(pc, 16), f"offset {pc}") if pc != "-" else f"{file}:{line}"
        d = {"kind": kind, "bytes": int(size), "site": where, "requests": int(req), "lanes": int(lanes)}
        if kind.startswith("global") or kind == "cp.async_global":
            d.update(sectors=int(cost), ideal=int(ideal))
        else:
            d.update(wavefronts=int(cost), ideal=int(ideal), conflicts=int(cost) - int(ideal))
        sites.append(d)
    # one row per (site, kind, bytes): instrumented sites of one line may be several code addresses
    merged = {}
    for d in sites:
        key = (d["site"], d["kind"], d["bytes"])
        if key in merged:
            for f in ("requests", "lanes", "wavefronts", "ideal", "conflicts", "sectors"):
                if f in d:
                    merged[key][f] += d[f]
        else:
            merged[key] = dict(d)
    # memory instructions by kind and width: their warp-level requests
    for d in sites:
        name = f"{d['kind']}.{8 * d['bytes']}"
        counts[name] = counts.get(name, 0) + d["requests"]
    return {"kernel": kernel, "sites": sorted(merged.values(), key=lambda d: (d["site"], d["kind"])),
            "counts": counts}


def _set_stats(**kw):
    global _last_stats
    with _stats_lock:
        _last_stats = kw


# ---------------------------------------------------------------- module
_libs = {}  # cache key -> ctypes.CDLL (a library is loaded once per process)
_lib_paths = {}  # cache key -> the library's file (memcheck messages name source lines from it)
_libs_lock = threading.Lock()
# `__shared__` arrays are statics of the library: launches of one library from
# several Python threads must not overlap
_launch_locks = {}


# The stacks of the fiber engine are pooled for the whole process, not per
# library (fiber_engine.h, FiberStackPool): the first library's pool is handed
# to every library loaded after it.  Called with _libs_lock held.
_fiber_pool = None


def _share_fiber_pool(lib):
    global _fiber_pool
    try:
        fn = getattr(lib, "__cuflash_fiber_pool")
    except AttributeError:  # built with the threaded engine (-DCUFLASH_EMULATOR_THREADS=1)
        return
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p]
    _fiber_pool = fn(_fiber_pool)


class RawModule:
    """CUDA C source compiled for the CPU; the emulator's ``cupy.RawModule``.

    Parameters
    ----------
    code : str, optional
        CUDA C source (exactly one of ``code`` and ``path``).
    path : str or Path, optional
        File holding the source; its directory is searched for ``#include "..."``.
    options : tuple of str
        NVRTC-style options: ``-DNAME=VALUE``, ``-UNAME``, ``-I<dir>``,
        ``-arch=sm_XX`` (the emulated ``__CUDA_ARCH__``, default sm_80);
        code-generation options (``--use_fast_math``, ``-std=...``, ...) are
        ignored.  ``kernels_cu/`` is always on the include path.
    name_expressions : sequence of str, optional
        Accepted for CuPy compatibility; only plain ``extern "C"`` kernel names.
    race_check : bool
        Run every launch under ThreadSanitizer in a child process and raise
        :class:`RaceError` when it reports a data race (slow: about 1 s plus a
        separate compile).  These builds run a block's CUDA threads as real
        threads, so that ThreadSanitizer sees them run concurrently; other
        builds run them as fibers in a fixed order (reproducible, fast, and
        blind to races by construction).
    """

    def __init__(self, code=None, *, path=None, options=(), name_expressions=None, race_check=False):
        if (code is None) == (path is None):
            raise TypeError("RawModule needs exactly one of code= and path=")
        if path is not None:
            path = Path(path).resolve()
            code = path.read_text()
        elif not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        self.code = code
        self.path = path
        self.options = tuple(options) if not isinstance(options, str) else (options,)
        self.race_check = bool(race_check)
        flags, self.arch = _parse_options(self.options)
        incs = [f"-I{path.parent}"] if path is not None else []
        self._flags = incs + flags + [f"-I{kernels_cu_dir()}", f"-DCUFLASH_ARCH={self.arch}"]
        self._pre = self._preprocess()
        self._kernels = _find_kernels(self._pre)
        if name_expressions is not None:
            for n in name_expressions:
                if n not in self._kernels or not self._kernels[n][0]:
                    raise ValueError(f"name expression {n!r}: the emulator launches only extern \"C\" "
                                     f"__global__ kernels; found {sorted(self._kernels)}")
        self._lib = None
        self._tsan_exe = None
        self._functions = {}
        # asynchronous-proxy reads of shared memory (wgmma operands) happen in this module
        self.uses_wgmma = "cuflash_emu::wgmma_mma" in self._pre

    # -- building
    def _preprocess(self):
        cmd = [_cxx(), "-E", "-P", "-x", "c++", "-std=c++20", "-DCUFLASH_PREPROCESS_ONLY",
               "-include", str(HOST_HEADER), *self._flags, "-"]
        try:
            r = subprocess.run(cmd, input=self.code, capture_output=True, text=True, timeout=120,
                               cwd=str(self.path.parent) if self.path else None)
        except FileNotFoundError as e:
            raise CompileError(f"the host C++ compiler {_cxx()!r} was not found ({e}); install g++ or set CXX") from None
        if r.returncode != 0:
            raise CompileError(f"preprocessing {self._what()} failed:\n{r.stderr[-20000:]}")
        return r.stdout

    def _what(self):
        return str(self.path) if self.path else "the kernel source"

    def _key(self, kind):
        h = hashlib.sha256()
        parts = (kind, _LAUNCHER_VERSION, _TSAN_MAIN if kind == "tsan" else "",
                 " ".join(_LIB_FLAGS + _TSAN_FLAGS + _ENGINE_FLAGS), HOST_HEADER.read_text(),
                 *(h.read_text() for h in _ENGINE_HEADERS),
                 self._pre, self.code, "\0".join(self._flags), _cxx(), str(self.path))
        for part in parts:
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:24]

    def _sources(self, key, tsan):
        """Write the source and the launcher TU into the cache; return the TU path."""
        d = cache_dir()
        launchable = [n for n, (ext, _) in self._kernels.items() if ext]
        if self.path is not None:
            src = self.path
        else:
            src = d / f"{key}.cu"
            if not src.exists():
                _atomic_write(src, self.code)
        tu = d / f"{key}{'_tsan' if tsan else ''}.cpp"
        # including the .cu file (not a copy) keeps compiler messages and
        # ThreadSanitizer reports on the file's own lines
        # a race-check program is one translation unit: the engine comes in source
        engine = f'#include "{ENGINE_SOURCE}"\n' if tsan else ""
        _atomic_write(tu, f'#include "{src}"\n' + engine + _launcher_code(launchable, tsan_main=tsan))
        return tu

    def _engine_flags(self):
        # The macros the host headers read (the arch, the engine's own switches) must be the
        # same in the engine object as in the kernel's translation unit; the kernel's other
        # macros do not reach the headers, which are included first.
        headers = HOST_HEADER.read_text() + "".join(h.read_text() for h in _ENGINE_HEADERS)
        out = []
        for f in self._flags:
            m = re.match(r"-[DU]([A-Za-z_]\w*)", f)
            if m and re.search(rf"\b{m.group(1)}\b", headers):
                out.append(f)
        return out

    def _config_hash(self, kind, compile_flags, flags):
        """24 hex digits naming a build shared by this configuration's libraries (``kind``,
        built with ``compile_flags`` and the configuration's macros ``flags``)."""
        h = hashlib.sha256()
        for part in (kind, _LAUNCHER_VERSION, " ".join(compile_flags), HOST_HEADER.read_text(),
                     *(e.read_text() for e in _ENGINE_HEADERS), "\0".join(flags), _cxx()):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:24]

    def _engine_object(self):
        """The engine compiled for this module's configuration (cached and shared by libraries)."""
        flags = self._engine_flags()
        obj = cache_dir() / f"engine_{self._config_hash('engine', _ENGINE_FLAGS, flags)}.o"
        with _build_lock(obj):
            if not obj.exists():
                tmp = obj.with_name(f"{obj.name}.{os.getpid()}.tmp")
                _run([_cxx(), *_ENGINE_FLAGS, "-x", "c++", "-include", str(HOST_HEADER), *flags,
                      str(ENGINE_SOURCE), "-o", str(tmp)], "compiling the emulator's engine")
                os.replace(tmp, obj)
        return obj

    def _host_include(self):
        """The header a library's compile includes first: the host header, or -- from the
        second library of a configuration on (the macros the headers read, as for the engine
        object) -- a stub beside its precompiled form (``host_<hash>.h.gch``, ~100 MB, built once
        under a lock).  Parsing the host header is about half of a library's compile (0.75 of
        1.65 s for flash_fwd_tc on the 2-core machine); a configuration used once does not pay
        for the precompile.  g++ takes the .gch only where its flags and macros match (else it
        parses the header: the same library, slower).  CUFLASH_EMULATOR_PCH=0: never."""
        if os.environ.get(PCH_ENV, "1") == "0":
            return HOST_HEADER
        flags = self._engine_flags()
        stub = cache_dir() / f"host_{self._config_hash('pch', _LIB_FLAGS, flags)}.h"
        gch = stub.with_name(stub.name + ".gch")
        with _build_lock(gch):
            if not gch.exists():
                if not stub.exists():   # the first library of this configuration: no precompile
                    _atomic_write(stub, f'#include "{HOST_HEADER}"\n')
                    return HOST_HEADER
                tmp = gch.with_name(f"{gch.name}.{os.getpid()}.tmp")
                _run([_cxx(), *(f for f in _LIB_FLAGS if f != "-shared"), "-x", "c++-header", *flags,
                      str(stub), "-o", str(tmp)], "precompiling the emulator's host header")
                os.replace(tmp, gch)
        return stub

    def _compile(self):
        if self._lib is not None:
            return self._lib
        key = self._key("lib")
        with _libs_lock:
            if key in _libs:
                self._lib = _libs[key]
                self._lib_path = _lib_paths[key]
                self._launch_lock = _launch_locks[key]
                return self._lib
            so = cache_dir() / f"{key}.so"
            with _build_lock(so):
                if not so.exists():
                    engine = self._engine_object()
                    host = self._host_include()
                    tu = self._sources(key, tsan=False)
                    tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
                    _run([_cxx(), *_LIB_FLAGS, "-x", "c++", "-include", str(host), *self._flags, str(tu),
                          "-x", "none", str(engine), "-o", str(tmp)], f"compiling {self._what()} for the emulator")
                    os.replace(tmp, so)
            self._lib = _libs[key] = ctypes.CDLL(str(so))
            self._lib_path = _lib_paths[key] = so
            _share_fiber_pool(self._lib)
            self._launch_lock = _launch_locks.setdefault(key, threading.Lock())
        return self._lib

    def _compile_tsan(self):
        if self._tsan_exe is not None:
            return self._tsan_exe
        key = self._key("tsan")
        exe = cache_dir() / f"{key}_tsan"
        with _build_lock(exe):
            if not exe.exists():
                tu = self._sources(key, tsan=True)
                tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
                _run([_cxx(), *_TSAN_FLAGS, "-x", "c++",
                      "-include", str(HOST_HEADER), *self._flags, str(tu), "-o", str(tmp)],
                     f"compiling {self._what()} with ThreadSanitizer")
                os.replace(tmp, exe)
        self._tsan_exe = exe
        return exe

    def compile(self):
        """Build now instead of at the first ``get_function`` (as CuPy's ``RawModule.compile``)."""
        if self.race_check:
            self._compile_tsan()
        else:
            self._compile()

    @property
    def kernel_names(self):
        """Names of the launchable (extern "C" __global__) kernels in the source."""
        return sorted(n for n, (ext, _) in self._kernels.items() if ext)

    def get_function(self, name):
        """The kernel ``name`` as a :class:`RawKernel`."""
        if name in self._functions:
            return self._functions[name]
        if name not in self._kernels:
            raise AttributeError(f"no __global__ function {name!r} in {self._what()} "
                                 f"(kernels found: {', '.join(sorted(self._kernels)) or 'none'})")
        ext, params = self._kernels[name]
        if not ext:
            raise AttributeError(f"kernel {name!r} is not extern \"C\": the emulator (like a RawModule "
                                 "without name_expressions) can only look up extern \"C\" kernels")
        lib = self._compile()  # the signature comes from the compiled types
        sig = getattr(lib, f"__cuflash_sig_{name}")
        sig.restype = ctypes.c_char_p
        kinds = [tuple(k.split(":")) for k in sig().decode().split(",") if k]
        if len(kinds) != len(params):  # the regex split disagreed with the compiler: keep its count
            params = [f"arg{i}" for i in range(len(kinds))]
        names = [_param_name(p, i) for i, p in enumerate(params)]
        k = RawKernel(self, name, [(n, kd, int(sz), decl) for n, (kd, sz), decl in zip(names, kinds, params)])
        self._functions[name] = k
        return k


@contextlib.contextmanager
def _build_lock(target):
    """Hold an exclusive lock on ``target``'s build across processes (``<target>.lock``, flock):
    processes that need the same library at once -- parallel test workers, ranks on one host --
    compile it once, the others wait and then load it.  Where flock is missing (not POSIX), each
    process compiles its own copy into the same place, as os.replace keeps that safe."""
    if fcntl is None:
        yield
        return
    with open(f"{target}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _atomic_write(path, text):
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- arguments
_CTYPES = {("i", 1): ctypes.c_int8, ("i", 2): ctypes.c_int16, ("i", 4): ctypes.c_int32, ("i", 8): ctypes.c_int64,
           ("u", 1): ctypes.c_uint8, ("u", 2): ctypes.c_uint16, ("u", 4): ctypes.c_uint32, ("u", 8): ctypes.c_uint64,
           ("f", 4): ctypes.c_float, ("f", 8): ctypes.c_double, ("b", 1): ctypes.c_bool,
           ("h", 2): ctypes.c_uint16, ("B", 2): ctypes.c_uint16}
_NP_KIND = {"i": "i", "u": "u", "f": "f", "b": "b"}


def _bf16_bits(x):
    """float -> bfloat16 bits, round to nearest even (as the kernels' __float2bfloat16)."""
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return ((u >> 16) | 0x40) & 0xFFFF
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _dims(v, what):
    if isinstance(v, (int, np.integer)):
        v = (v,)
    if not isinstance(v, tuple) or not 1 <= len(v) <= 3:
        raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {v!r}")
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{what} must hold ints, got {v!r}")
        if x < 1:
            raise ValueError(f"{what} entries must be >= 1, got {v!r}")
        out.append(int(x))
    return tuple(out + [1] * (3 - len(out)))


class RawKernel:
    """One kernel of a :class:`RawModule`; call as ``k(grid, block, args, shared_mem=0)``.

    Arguments are checked against the kernel's parameter types as CuPy would
    pass them: numpy arrays for pointers; numpy scalars of exactly the
    parameter's type; Python ints for integer parameters (CuPy sends 8 bytes,
    of which an ``int`` parameter reads the low 4, so values must fit);
    Python floats only for ``double`` parameters.  Anything else is a
    ``TypeError`` naming the parameter.
    """

    def __init__(self, module, name, params):
        self.module = module
        self.name = name
        self.params = params  # (name, kind, size, declaration)
        # cudaFuncAttributeMaxDynamicSharedMemorySize, as cupy.RawKernel's attribute
        self.max_dynamic_shared_size_bytes = _DEFAULT_MAX_DYNAMIC_SHARED

    def __repr__(self):
        return f"<cuflash.emulator.RawKernel {self.name}({', '.join(p[3] for p in self.params)})>"

    def _convert(self, args):
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"kernel {self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise TypeError(f"kernel {self.name} takes {len(self.params)} arguments "
                            f"({', '.join(p[3] for p in self.params)}), got {len(args)}")
        holders, arrays = [], []
        for a, (pname, kind, size, decl) in zip(args, self.params):
            where = f"kernel {self.name}, parameter {pname!r} ({decl})"
            if kind == "p":
                if not isinstance(a, np.ndarray):
                    raise TypeError(f"{where}: expected a numpy.ndarray (a device pointer), got {type(a).__name__}")
                if not a.flags.c_contiguous:
                    raise ValueError(f"{where}: the array is not C-contiguous (shape {a.shape}, strides "
                                     f"{a.strides}); a kernel sees only a pointer to the first element")
                holders.append(ctypes.c_void_p(a.ctypes.data))
                arrays.append(a)
                continue
            if (kind, size) not in _CTYPES:
                raise TypeError(f"{where}: parameters of this type cannot be passed by the emulator")
            ct = _CTYPES[(kind, size)]
            if kind in ("h", "B"):
                if isinstance(a, (float, int, np.floating)) and not isinstance(a, bool):
                    bits = int(np.float16(a).view(np.uint16)) if kind == "h" else _bf16_bits(a)
                    holders.append(ct(bits))
                    continue
                raise TypeError(f"{where}: expected a float, got {type(a).__name__}")
            if isinstance(a, np.generic):
                want = np.dtype(f"{_NP_KIND[kind]}{size}") if kind != "b" else np.dtype(bool)
                if a.dtype != want:
                    raise TypeError(f"{where}: expected numpy.{want.name} (or a Python "
                                    f"{'float' if kind == 'f' else 'bool' if kind == 'b' else 'int'}), "
                                    f"got numpy.{a.dtype.name}")
                holders.append(ct(a.item()))
                continue
            if kind == "b":
                if not isinstance(a, bool):
                    raise TypeError(f"{where}: expected a bool, got {type(a).__name__}")
            elif kind == "f":
                # CuPy passes a Python float as a double: right for a double
                # parameter, garbage for a float one (cupy/cupy#8485)
                if size != 8 and isinstance(a, (float, int)):
                    raise TypeError(f"{where}: pass numpy.float32, not a Python {type(a).__name__} "
                                    "(CuPy would send it as 8 bytes into a 4-byte parameter)")
                if isinstance(a, bool) or not isinstance(a, float):
                    raise TypeError(f"{where}: expected a float (or numpy.float{8 * size}), got {type(a).__name__}")
            else:
                if isinstance(a, bool) or not isinstance(a, int):
                    raise TypeError(f"{where}: expected an int (or numpy.{_NP_KIND[kind]}nt{8 * size}), "
                                    f"got {type(a).__name__}")
                lo, hi = (0, 2 ** (8 * size) - 1) if kind == "u" else (-2 ** (8 * size - 1), 2 ** (8 * size - 1) - 1)
                if not lo <= a <= hi:
                    raise TypeError(f"{where}: {a} does not fit in {8 * size}-bit {'un' if kind == 'u' else ''}signed")
            holders.append(ct(a))
        return holders, arrays

    def _check_launch(self, grid, block, shared_mem):
        g, b = _dims(grid, "grid"), _dims(block, "block")
        nthreads = b[0] * b[1] * b[2]
        if nthreads > _MAX_THREADS_PER_BLOCK or b[2] > 64:
            raise ValueError(f"kernel {self.name}: block {b} exceeds CUDA's limits "
                             f"({_MAX_THREADS_PER_BLOCK} threads, z <= 64)")
        if g[1] > 65535 or g[2] > 65535 or g[0] > 2 ** 31 - 1:
            raise ValueError(f"kernel {self.name}: grid {g} exceeds CUDA's limits")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, (int, np.integer)) or shared_mem < 0:
            raise TypeError(f"kernel {self.name}: shared_mem must be a non-negative int, got {shared_mem!r}")
        if shared_mem > self.max_dynamic_shared_size_bytes:
            raise ValueError(f"kernel {self.name}: shared_mem={shared_mem} bytes exceeds "
                             f"max_dynamic_shared_size_bytes={self.max_dynamic_shared_size_bytes} "
                             "(on the GPU set the kernel attribute first, as with cupy.RawKernel)")
        return g, b, int(shared_mem)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        g, b, shmem = self._check_launch(grid, block, shared_mem)
        holders, arrays = self._convert(args)
        if self.module.race_check:
            return self._launch_tsan(g, b, shmem, args)
        lib = self.module._compile()
        fn = getattr(lib, f"__cuflash_launch_{self.name}")
        fn.restype = ctypes.c_int
        flags = launch_flags()
        if profile_enabled():
            flags |= 4
        if memcheck_enabled():
            flags |= 2
            if self.module.uses_wgmma:  # the proxy check (cuda_host.h, LAUNCH_PROXY_CHECK)
                flags |= 16
        if flags & 6:  # the memcheck checks against the arrays, the profiler counts sectors in them
            # (first byte, end) of each pointer argument, and its parameter index
            ptr_params = [i for i, p in enumerate(self.params) if p[1] == "p"]
            ranges = (ctypes.c_ulonglong * max(1, 2 * len(arrays)))(
                *[v for a in arrays for v in (a.ctypes.data, a.ctypes.data + a.nbytes)])
            which = (ctypes.c_uint * max(1, len(arrays)))(*ptr_params)
        argv = (ctypes.c_void_p * max(1, len(holders)))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                                                           for h in holders])
        grid3, block3 = (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b)
        stats = (ctypes.c_ulonglong * 2)()
        err = ctypes.create_string_buffer(4096)
        with self.module._launch_lock:
            if flags & 6:
                getattr(lib, "__cuflash_memcheck_buffers")(ranges, which, ctypes.c_uint(len(arrays)))
            t0 = time.perf_counter()
            rc = fn(grid3, block3, ctypes.c_ulonglong(shmem), argv, stats, err, ctypes.c_size_t(len(err)),
                    ctypes.c_uint(flags))
            dt = time.perf_counter() - t0
        self._record(g, b, shmem, stats[0], stats[1], dt)
        if flags & 4 and rc == 0:
            global _last_profile
            prof = _read_profile(lib, self.module._lib_path, self.name)
            prof.update(grid=g, block=b, dynamic_shared_bytes=shmem)
            with _stats_lock:
                _last_profile = prof
            sink = profile_sink()
            if sink is not None:
                sink.append(prof)
        if rc in CHECK_ERRORS:
            msg = err.value.decode(errors="replace")
            raise CHECK_ERRORS[rc](describe_address(msg, self.params, arrays))
        if rc != 0:
            msg = err.value.decode(errors="replace")
            if msg.startswith("memcheck:"):
                raise MemcheckError(describe_memcheck(msg, self.params, arrays, self.module._lib_path))
            raise LaunchError(f"kernel {self.name} (grid {g}, block {b}): {msg}")
        del arrays  # kept alive until here: the kernel wrote through their pointers

    def _record(self, g, b, shmem, rd, wr, dt):
        _set_stats(global_bytes_read=int(rd), global_bytes_written=int(wr), blocks=g[0] * g[1] * g[2],
                   threads_per_block=b[0] * b[1] * b[2], dynamic_shared_bytes=shmem, grid=g, block=b,
                   kernel=self.name, seconds=dt)

    def _launch_tsan(self, g, b, shmem, args):
        run_tsan(self, g, b, shmem, args)

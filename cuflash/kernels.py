"""Finding, specialising, compiling and caching the CUDA C kernels of ``kernels_cu/``.

The one module that knows where the ``.cu`` files are and how they are built:

* :func:`kernel_dir` -- ``cuflash/kernels_cu`` in an installed package (setup.cfg
  maps the repository's top-level ``kernels_cu/`` there), ``<repo>/kernels_cu``
  in a source tree.
* :func:`build_options` -- the compiler options of one specialisation: ``-D``
  defines for dtype, head dims and tiles (from :mod:`cuflash.tiling`),
  ``-I <kernel_dir>`` for ``portable.cuh`` and ``-std=c++17``.  NVRTC picks the
  architecture of the current device (CuPy passes ``-arch``); the emulator
  compiles for the host.
* :class:`Runtime` / :func:`get_runtime` -- what a launch needs from a backend:
  the array module (NumPy or CuPy), the module factory (``cupy.RawModule`` or
  ``cuflash.emulator.RawModule``) and the device's shared-memory limit.  The same
  launch code in :mod:`cuflash.launch` serves both.
* :func:`get_function` -- a compiled kernel, cached per device (CuPy) or per
  race-check mode (emulator) and per option set, with the dynamic shared
  memory limit raised above 48 KB when the tile plan needs it.
* :func:`compile_variants` -- every specialisation worth compile-checking, per
  ``.cu`` file, for ``tests/kernels/test_nvrtc.py``.

Nothing here imports CuPy until a kernel is actually needed (the emulator
imports with NumPy alone and compiles nothing until asked).
"""
import collections
import concurrent.futures
import functools
import os
import threading

import numpy as np

from . import emulator, tiling

__all__ = [
    "kernel_dir", "source_path", "dtype_define", "build_options", "Runtime", "get_runtime",
    "get_function", "get_functions", "compile_variants", "plan_defines", "fwd_helper_defines",
    "KERNEL_SOURCES", "BUILD_DEFINES", "CallCache", "SpillError", "check_compiled", "KERNEL_ARCH", "WGMMA_ENV",
    "WGMMA_DEFAULT_DIMS", "wgmma_choice",
]

@functools.lru_cache(maxsize=None)
def kernel_dir():
    """Directory holding the ``.cu`` sources and ``portable.cuh``.

    An installed package carries them as ``cuflash/kernels_cu`` (package data);
    a source checkout (or an editable install) has them at ``<repo>/kernels_cu``.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "kernels_cu"), os.path.join(os.path.dirname(here), "kernels_cu")):
        if os.path.isfile(os.path.join(cand, "flash_fwd.cu")):
            return cand
    raise FileNotFoundError(
        f"cuflash kernel sources not found: looked for flash_fwd.cu in {here}/kernels_cu "
        f"(installed package) and {os.path.dirname(here)}/kernels_cu (source tree); "
        "reinstall cuflash (the wheel must include cuflash/kernels_cu)")


@functools.lru_cache(maxsize=None)
def source_path(filename):
    """Absolute path of one kernel source file (e.g. ``"flash_fwd.cu"``)."""
    path = os.path.join(kernel_dir(), filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"kernel source {filename!r} not found in {kernel_dir()}")
    return path


_DTYPE_DEFINES = {"float16": "CUFLASH_DTYPE_F16", "bfloat16": "CUFLASH_DTYPE_BF16",
                  "float32": "CUFLASH_DTYPE_F32", "float64": "CUFLASH_DTYPE_F64"}


def dtype_define(dtype):
    """The ``-D`` name that selects a dtype in every kernel (``CUFLASH_DTYPE_F32`` ...)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    try:
        return _DTYPE_DEFINES[name]
    except KeyError:
        raise TypeError(f"no kernel for dtype {name}; supported: {sorted(_DTYPE_DEFINES)}")


@functools.lru_cache(maxsize=4096)
def _build_options(items):
    # CuPy appends -ftz=true to every RawModule compile; the NVRTC checks made without a GPU
    # (tests, kernel report, plan records) pass it too, so they see the code that runs.
    opts = ["-std=c++17", "-ftz=true", f"-I{kernel_dir()}"]
    for key, val in items:
        opts.append(f"-D{key}" if val is None else f"-D{key}={val}")
    return tuple(opts)


def build_options(defines):
    """Compiler options for a dict of defines (value None = a bare ``-DNAME``).

    The order is canonical (sorted), so equal specialisations share one cache
    entry.
    """
    return _build_options(tuple(sorted(defines.items())))


# kernel name -> the kernels_cu file that defines it
KERNEL_SOURCES = {
    "flash_fwd": "flash_fwd.cu",
    "flash_fwd_tc": "flash_fwd_tc.cu",     # float16/bfloat16
    "flash_fwd_tf32": "flash_fwd_tc.cu",   # float32 (3xTF32): the same file with -DCUFLASH_DTYPE_F32
    "online_softmax_rows": "online_softmax.cu",
    "flash_bwd_preprocess": "flash_bwd.cu",
    "flash_bwd_dkdv": "flash_bwd.cu",
    "flash_bwd_dq": "flash_bwd.cu",
    "flash_bwd_dq_convert": "flash_bwd.cu",
    # the logit features (bias, window, ALiBi, softcap, dropout): -DCUFLASH_MASKS
    "flash_fwd_masked": "flash_fwd.cu",
    "flash_fwd_tc_masked": "flash_fwd_tc.cu",
    "flash_fwd_tf32_masked": "flash_fwd_tc.cu",
    "flash_fwd_serving_masked": "flash_fwd.cu",
    "flash_bwd_dkdv_masked": "flash_bwd.cu",
    "flash_bwd_dq_masked": "flash_bwd.cu",
    "flash_bwd_tc_masked": "flash_bwd_tc.cu",
    "flash_bwd_tc_band": "flash_bwd_tc.cu",
    "flash_bwd_tc_softcap": "flash_bwd_tc.cu",
    "flash_bwd_tc_alibi": "flash_bwd_tc.cu",
    "flash_bwd_tc_dropout": "flash_bwd_tc.cu",
    "flash_bwd_tc_alibi_dropout": "flash_bwd_tc.cu",
    "flash_bwd_tc_alibi_softcap": "flash_bwd_tc.cu",
    "flash_bwd_tf32_masked": "flash_bwd_tf32.cu",
    # the serving module: flash_fwd.cu compiled with -DCUFLASH_FWD_SERVING; its helpers'
    # module (split-KV's combine, the KV cache's append) with -DCUFLASH_FWD_HELPERS
    "flash_fwd_serving": "flash_fwd.cu",
    "flash_fwd_combine": "flash_fwd.cu",
    "flash_kv_append": "flash_fwd.cu",
    "flash_bwd_tc_preprocess": "flash_bwd_tc.cu",
    "flash_bwd_tc": "flash_bwd_tc.cu",
    "flash_bwd_tc_dq_convert": "flash_bwd_tc.cu",
    "flash_bwd_tf32": "flash_bwd_tf32.cu",  # float32 on tensor cores (3xTF32), atomic-dQ path
    "flash_fwd_wgmma": "flash_fwd_wgmma.cu",  # Hopper (sm_90a): TMA, wgmma, warp specialisation
    "flash_bwd_wgmma": "flash_bwd_wgmma.cu",  # with flash_bwd_tc.cu's preprocess and dQ conversion
}

# The defines that select a kernel's build within its file, besides its plan's and the logit
# features' (-DCUFLASH_MASKS): the tensor-core backward's lean builds, flash_bwd_tc.cu with one
# feature set compiled in
BUILD_DEFINES = {
    "flash_bwd_tc_band": {"CUFLASH_BWD_BAND": None},
    "flash_bwd_tc_softcap": {"CUFLASH_BWD_BAND": None, "CUFLASH_BWD_SOFTCAP": None},
    "flash_bwd_tc_alibi": {"CUFLASH_BWD_BAND": None, "CUFLASH_BWD_ALIBI": None},
    "flash_bwd_tc_dropout": {"CUFLASH_BWD_BAND": None, "CUFLASH_BWD_DROPOUT": None},
    "flash_bwd_tc_alibi_dropout": {"CUFLASH_BWD_BAND": None, "CUFLASH_BWD_ALIBI": None,
                                   "CUFLASH_BWD_DROPOUT": None},
    "flash_bwd_tc_alibi_softcap": {"CUFLASH_BWD_BAND": None, "CUFLASH_BWD_SOFTCAP": None,
                                   "CUFLASH_BWD_ALIBI": None},
}

# Kernels whose instructions exist only in one architecture's arch-specific code: compiled for
# it on every device that runs them (wgmma and setmaxnreg are sm_90a's; a plain sm_90 build
# of flash_fwd_wgmma.cu traps), after any -arch the backend adds.
KERNEL_ARCH = {"flash_fwd_wgmma": "sm_90a", "flash_bwd_wgmma": "sm_90a"}
# Whether an sm_90 runs the Hopper kernels (flash_fwd_wgmma, flash_bwd_wgmma) for the calls
# they take, read when a backend's runtime is made: "auto" (unset) at the head dims of
# WGMMA_DEFAULT_DIMS (d == dv), "1" at every head dim they take, "0" never.
WGMMA_ENV = "CUFLASH_WGMMA"
# Where the Hopper kernels are sm_90's default (d == dv): every head dim they take, forward and
# backward.  Timed on a GPU only at d = 128 (an H100, bench/results/gpu/: float16, 1.4-1.6x the
# mma.sync kernels, forward and forward + backward); correct on that H100's tests at d = 64 and
# 128; at 192 and 256 checked on the emulator only (the float64 oracle, the race check).  A head
# dim a GPU measures slower comes out of this tuple; "0" gives the mma.sync kernels back.
WGMMA_DEFAULT_DIMS = (64, 128, 192, 256)


def wgmma_choice():
    """``$CUFLASH_WGMMA``: "auto" (unset: the Hopper kernels on sm_90 at the head dims of
    :data:`WGMMA_DEFAULT_DIMS`), "1" (at every head dim they take) or "0" (never)."""
    val = os.environ.get(WGMMA_ENV, "auto")
    if val not in ("0", "1", "auto"):
        raise ValueError(f"{WGMMA_ENV}={val!r}: use 1 (the Hopper kernels on sm_90 wherever they fit), "
                         f"0 (never) or auto (unset: at d = dv in {WGMMA_DEFAULT_DIMS})")
    return val


def _wgmma_setting(is_sm90):
    """(wgmma, wgmma_dims) of a Runtime on a device that is (or stands in for) an sm_90 or not."""
    choice = wgmma_choice()
    return is_sm90 and choice != "0", (None if choice == "1" else WGMMA_DEFAULT_DIMS)


def fwd_helper_defines(dtype):
    """The defines of flash_fwd.cu's helpers' module (flash_fwd_combine, flash_kv_append): the
    dtype alone, so every tile plan of a dtype shares one compile of them."""
    return {dtype_define(dtype): None, "CUFLASH_FWD_HELPERS": None}


def plan_defines(plan):
    """The ``-D`` defines of a kernel specialised for a :class:`cuflash.tiling.TilePlan`.

    The same names in every kernel: dtype, ``CUFLASH_HEAD_DIM`` (d),
    ``CUFLASH_HEAD_DIM_V`` (dv), ``CUFLASH_BLOCK_Q``, ``CUFLASH_BLOCK_KV`` and
    ``CUFLASH_THREADS``.  The head dims are the plan's compiled ones (``kd``, ``kdv``): the
    head-dim class of d and dv; the SIMT kernels read the call's own from their params, the
    tensor-core kernels where their build is padded (``KernelTiling.pad_define``, when the
    call's head dims are not the compiled ones).
    """
    t = tiling.kernel_tiling(plan.kernel)
    out = {dtype_define(plan.dtype): None, "CUFLASH_HEAD_DIM": plan.kd,
           "CUFLASH_HEAD_DIM_V": plan.kdv, "CUFLASH_BLOCK_Q": plan.block_q,
           "CUFLASH_BLOCK_KV": plan.block_kv, "CUFLASH_THREADS": plan.threads}
    # kernel-specific defines of the plan (KernelTiling.defines, e.g. flash_bwd_tc's passes)
    out.update(t.defines(plan.block_q, plan.block_kv, plan.kd, plan.kdv))
    out.update(plan.layout_defines)   # KernelTiling.smaller's layout, where the plan takes it
    if t.pad_define is not None and (plan.d, plan.dv) != (plan.kd, plan.kdv):
        out[t.pad_define] = None
    return out


class CallCache:
    """A bounded mapping key -> prepared call (least recently inserted dropped first).

    Entries are small (a closure, a few hundred bytes of parameter block); the
    bound only stops a process that sweeps thousands of shapes from growing
    without limit.
    """

    def __init__(self, maxsize=1024):
        self._d = collections.OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize

    def get(self, key):
        return self._d.get(key)

    def put(self, key, value):
        with self._lock:
            self._d[key] = value
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)

    def clear(self):
        with self._lock:
            self._d.clear()

    def __len__(self):
        return len(self._d)


class Runtime:
    """What the launchers need from a backend.

    Attributes
    ----------
    name : str
        ``"cuda"`` or ``"emulator"``.
    xp : module
        ``cupy`` or ``numpy``: allocates outputs and makes arrays contiguous.
    smem_limit : int
        Opt-in shared memory per block (bytes) that tile plans must fit.
    smem_source : str
        Where ``smem_limit`` comes from (device attribute or nominal arch).
    race_check : bool
        Emulator only: compile the kernels with ThreadSanitizer and raise
        ``cuflash.emulator.RaceError`` on a race.
    num_sms : int
        Streaming multiprocessors (split-KV fills them; a nominal count on the
        emulator).
    tensor_cores : bool
        Whether the forward may pick a tensor-core kernel by default (flash_fwd_tc
        for float16/bfloat16, flash_fwd_tf32 for float32): sm_80 and newer.  Before
        sm_80 portable.cuh emulates the mma with 32 shuffles, which is correct but
        slower than the SIMT kernel, so only an explicit ``kernel=`` runs them there.
    wgmma : bool
        Whether the planners may take the Hopper kernels (flash_fwd_wgmma, flash_bwd_wgmma):
        an sm_90 (on the emulator: standing in for one) unless ``$CUFLASH_WGMMA=0``.
    wgmma_dims : tuple of int or None
        The head dims (d == dv) at which they are taken (None: every one they support;
        ``$CUFLASH_WGMMA=1``); :meth:`wgmma_for` asks for one call.
    """

    def __init__(self, name, xp, module_factory, smem_limit, smem_source, race_check=False,
                 device_key=None, tensor_cores=True, synchronize=None, num_sms=108, wgmma=False, wgmma_dims=None):
        self.name = name
        self.wgmma = wgmma
        self.wgmma_dims = wgmma_dims
        self.num_sms = num_sms
        self.calls = CallCache()
        self._synchronize = synchronize
        self.tensor_cores = tensor_cores
        self.xp = xp
        self._factory = module_factory
        self.smem_limit = smem_limit
        self.smem_source = smem_source
        self.race_check = race_check
        self.device_key = device_key

    def plan(self, kernel, d, dv, dtype, block_q=None, block_kv=None):
        """:func:`cuflash.tiling.plan` against this runtime's shared-memory limit."""
        return tiling.plan(kernel, d, dv, dtype, block_q, block_kv, limit=self.smem_limit,
                           limit_source=self.smem_source)

    def plan_fwd(self, d, dv, dtype, block_q=None, block_kv=None, kernel=None, masked=False):
        """:func:`cuflash.tiling.plan_flash_fwd` (which forward kernel, which tiles) here;
        ``masked``: a call with logit features (their kernels)."""
        if kernel is None and not self.tensor_cores:
            kernel = "flash_fwd_masked" if masked else "flash_fwd"
        return tiling.plan_flash_fwd(d, dv, dtype, block_q, block_kv, limit=self.smem_limit,
                                     limit_source=self.smem_source, kernel=kernel, masked=masked,
                                     wgmma=self.wgmma_for(d, dv))

    def wgmma_for(self, d, dv):
        """Whether the planners take the Hopper kernels for a call of head dims d, dv (where
        the call's other arguments let them)."""
        return self.wgmma and (self.wgmma_dims is None or (d == dv and d in self.wgmma_dims))

    def synchronize(self):
        """Wait for the device (GPU: the current stream); nothing on the emulator."""
        if self._synchronize is not None:
            self._synchronize()

    def module(self, filename, options):
        """A compiled module for one source file and option set (not cached here)."""
        return self._factory(filename, options)

    def __repr__(self):
        return (f"Runtime({self.name!r}, limit={self.smem_limit} B ({self.smem_source}), "
                f"race_check={self.race_check})")


def _cupy_factory(filename, options):
    import cupy  # optional (the cuda extras): imported on use
    with open(source_path(filename)) as f:
        code = f.read()
    return cupy.RawModule(code=code, options=options)


def _emulator_factory(race_check, arch=None):
    extra = () if arch is None else (f"-arch={arch}",)

    def factory(filename, options):  # a kernel's own -arch (KERNEL_ARCH), last, wins
        return emulator.RawModule(path=source_path(filename), options=extra + tuple(options),
                                  race_check=race_check)
    return factory


def get_runtime(backend, *, race_check=False, arch=None):
    """The :class:`Runtime` of ``"cuda"`` (current CuPy device) or ``"emulator"``.

    ``arch`` (emulator only, e.g. ``"sm_75"``) names the architecture emulated:
    tile plans are held to its nominal shared-memory limit (default sm_80; see
    :mod:`cuflash.tiling`) and, when given, the kernels are compiled with
    ``-arch=<arch>`` (before sm_80 portable.cuh's software mma and synchronous
    cp.async run instead of the emulated tensor-core instructions).
    """
    limit, source = tiling.device_smem_limit(backend, arch)
    if backend == "cuda":
        import cupy  # optional (the cuda extras): imported on use
        if race_check:
            raise ValueError("race_check is an emulator feature (ThreadSanitizer on the CPU)")
        dev = cupy.cuda.Device()
        wgmma, dims = _wgmma_setting(dev.compute_capability == "90")
        return Runtime("cuda", cupy, _cupy_factory, limit, source, device_key=("cuda", dev.id),
                       tensor_cores=int(dev.compute_capability) >= 80, wgmma=wgmma, wgmma_dims=dims,
                       synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
                       num_sms=tiling.device_sm_count("cuda")[0])
    wgmma, dims = _wgmma_setting(tiling.emulator_arch(arch) == "sm_90")
    return Runtime("emulator", np, _emulator_factory(race_check, arch), limit, source,
                   race_check=race_check, device_key=("emulator", bool(race_check), arch),
                   wgmma=wgmma, wgmma_dims=dims,
                   tensor_cores=arch is None or int(arch.split("_")[1]) >= 80,
                   num_sms=tiling.device_sm_count("emulator", arch)[0])


_CACHE = {}
_CACHE_LOCK = threading.Lock()


def _module(runtime, filename, options):
    key = (runtime.device_key, filename, options)
    with _CACHE_LOCK:
        mod = _CACHE.get(key)
    if mod is None:
        mod = runtime.module(filename, options)
        with _CACHE_LOCK:
            mod = _CACHE.setdefault(key, mod)
    return mod


def _raise_smem(fn, shared_bytes):
    # both CuPy and the emulator hold launches to this attribute (48 KB by default)
    if shared_bytes > tiling.STATIC_SMEM_LIMIT:
        if getattr(fn, "max_dynamic_shared_size_bytes", 0) < shared_bytes:
            fn.max_dynamic_shared_size_bytes = int(shared_bytes)
    return fn


class SpillError(RuntimeError):
    """A compiled kernel uses local memory (register spills): it would run far slower."""


_CHECKED = set()

# kernels whose tiles come from another kernel's plan (the curated table that names them)
_PLANNED_AS = {"flash_fwd_serving": "flash_fwd", "flash_fwd_serving_masked": "flash_fwd_masked",
               "flash_bwd_dq": "flash_bwd_dkdv", "flash_bwd_dq_masked": "flash_bwd_dkdv_masked"}


def _option_defines(options):
    """{name: value or None} of the ``-D`` options of a compile."""
    out = {}
    for o in options:
        if o.startswith("-D"):
            name, _, val = o[2:].partition("=")
            out[name] = val or None
    return out


def _curated_advice(runtime, kernel_name, options):
    """What to pass instead of a spilling specialisation: its family's curated plans for the
    dtype, head dims and architecture class of the compile (a sentence)."""
    defs = _option_defines(options)
    planned = _PLANNED_AS.get(kernel_name, kernel_name)
    dtype = next((n for n, m in _DTYPE_DEFINES.items() if m in defs), None)
    try:
        kd, kdv = int(defs["CUFLASH_HEAD_DIM"]), int(defs["CUFLASH_HEAD_DIM_V"])
        tiles = (int(defs["CUFLASH_BLOCK_Q"]), int(defs["CUFLASH_BLOCK_KV"]))
    except (KeyError, ValueError):
        kd = kdv = tiles = None
    padded = planned in tiling.CURATED_KERNELS and tiling.kernel_tiling(planned).pad_define in defs
    cells = (tiling.curated_plans(planned, dtype, kd, kdv, runtime.smem_limit, padded)
             if dtype is not None and kd is not None else [])
    if not cells:
        return ("It has no curated tile plans to fall back on (a helper kernel, not tiled): "
                "please report it")
    listed = tiles in cells[0][1]
    text = tiling.curated_text(planned, dtype, kd, kdv, runtime.smem_limit, padded)
    return (f"The curated plans of {planned} for {dtype} at head dims {kd}/{kdv} on this GPU "
            f"(block_q, block_kv): {text}. "
            + ("These tiles are one of them, which CI compiles without spills: the compiler "
               "here differs from CI's; please report it, and pass another pair meanwhile"
               if listed else "Pass one of them as block_q/block_kv, or neither for the default"))


def check_compiled(runtime, fn, kernel_name, options):
    """The check of explicit tiles, and a guard on the rest: the compiled kernel's attributes.

    The planner takes any tiles its size formulas allow; its defaults are curated plans that
    CI compiles with NVRTC without spills.  On a GPU each compiled specialisation is checked
    once here: CuPy reports its local-memory bytes per thread (``local_size_bytes``,
    register spills and stack-resident arrays), which none of cuflash's kernels is designed
    to use.  Raises :class:`SpillError` naming the kernel, its defines and the curated
    plans of its family to pass instead -- a spilling kernel is never run, nor replaced
    silently.  The emulator compiles for the host and has no such attribute: nothing to check.
    """
    if runtime.name != "cuda":
        return
    key = (runtime.device_key, kernel_name, options)
    if key in _CHECKED:
        return
    local = int(getattr(fn, "local_size_bytes", 0) or 0)
    if local > 0:
        defines = " ".join(o for o in options if o.startswith("-D"))
        raise SpillError(
            f"kernel {kernel_name} [{defines}] compiled to {local} bytes of local memory per "
            f"thread ({getattr(fn, 'num_regs', '?')} registers): register spills, which make it "
            "many times slower, so it is not run. "
            + _curated_advice(runtime, kernel_name, options))
    _CHECKED.add(key)


def get_function(runtime, filename, kernel_name, defines, shared_bytes=0):
    """The compiled kernel ``kernel_name`` of ``filename`` specialised by ``defines``.

    Modules are cached per (device or emulator mode, file, options).  When
    ``shared_bytes`` exceeds the 48 KB launch default, the kernel's
    ``max_dynamic_shared_size_bytes`` is raised to it (CuPy, and the emulator,
    which mirrors the attribute; plans there are checked against a nominal limit).
    """
    return get_functions(runtime, [(filename, kernel_name, defines, shared_bytes)])[0]


# NVRTC (through CuPy) and the host compiler release the GIL while they compile, so the
# modules of one call compile side by side in threads
_COMPILE_THREADS = max(1, min(8, os.cpu_count() or 1))


def get_functions(runtime, requests):
    """Several kernels at once: ``[(filename, kernel_name, defines, shared_bytes), ...]``.

    The distinct modules among the requests that are not compiled yet are
    compiled concurrently (one thread each, up to ``_COMPILE_THREADS``): a call
    that needs kernels from several modules pays for the slowest compile, not
    the sum.  Returns the kernels in the order of ``requests``.
    """
    keyed = [(fn, name, build_options(defines) + ((f"-arch={KERNEL_ARCH[name]}",) if name in KERNEL_ARCH else ()),
              shared) for fn, name, defines, shared in requests]
    todo = {}
    for filename, _, options, _ in keyed:
        key = (runtime.device_key, filename, options)
        with _CACHE_LOCK:
            cached = key in _CACHE
        if not cached:
            todo[key] = (filename, options)
    if len(todo) > 1:
        def build(item):
            filename, options = item
            mod = _module(runtime, filename, options)
            compile_now = getattr(mod, "compile", None)  # CuPy / the emulator compile lazily
            if compile_now is not None:
                compile_now()
        workers = min(len(todo), _COMPILE_THREADS)
        with concurrent.futures.ThreadPoolExecutor(workers) as ex:
            list(ex.map(build, todo.values()))
    out = []
    for filename, name, options, shared in keyed:
        fn = _raise_smem(_module(runtime, filename, options).get_function(name), shared)
        check_compiled(runtime, fn, name, options)
        out.append(fn)
    return out


def compile_variants():
    """Specialisations to compile-check per kernel file: ``{filename: [options, ...]}``.

    Each entry is a tuple of options as :func:`build_options` makes them (no
    ``-arch``: the caller adds one per architecture).  Built from the tile
    plans of :mod:`cuflash.tiling` alone (this module imports no launcher):
    every dtype, the head dims of the test grid with the default tiles of an
    sm_80 (163 KB, as a launch there gets them: the kernel report reads these
    variants), the smallest and largest tiles, dv != d, and the tensor-core
    kernel.  Kept short: a large kernel costs seconds of NVRTC per architecture.
    """
    sm80 = tiling.EMULATOR_ARCHES["sm_80"]
    out = {}

    def add(kernel, dtype, d, dv=None, bq=None, bkv=None, limit=sm80, **extra):
        """The plan's options (with ``extra`` defines, e.g. CUFLASH_MASKS=None), once per file."""
        p = tiling.plan(kernel, d, d if dv is None else dv, dtype, bq, bkv, limit=limit)
        opts = build_options(dict(plan_defines(p), **extra))
        lst = out.setdefault(KERNEL_SOURCES[kernel], [])
        if opts not in lst:
            lst.append(opts)

    # flash_fwd.cu (SIMT): every dtype
    for dt in ("float16", "bfloat16", "float32", "float64"):
        for d in (64, 256):
            add("flash_fwd", dt, d)
    for d in (16, 32, 96, 128):
        add("flash_fwd", "float32", d)
    add("flash_fwd", "float32", 64, bq=8, bkv=8)        # smallest tiles
    add("flash_fwd", "float32", 128, bq=128, bkv=64)    # largest pair within the register rule
    # the serving module of flash_fwd.cu (split-KV, KV cache, varlen), and its helpers' module
    # (combine, append) per dtype
    for dt, d in (("float16", 128), ("bfloat16", 64), ("float32", 64), ("float64", 32)):
        add("flash_fwd", dt, d, bq=8, CUFLASH_FWD_SERVING=None)
        out["flash_fwd.cu"].append(build_options(fwd_helper_defines(dt)))
    # flash_fwd_tc.cu: the default plans of float16/bfloat16 (flash_fwd_tc) and float32
    # (flash_fwd_tf32) at the head dims of the test grid, and the extremes: one warp (16
    # rows), d = 256 (16 rows per warp), dv != d
    for dt in tiling.TC_DTYPES:
        for d in (64, 128):
            add("flash_fwd_tc", dt, d)
    add("flash_fwd_tc", "float16", 256)
    add("flash_fwd_tc", "bfloat16", 128, dv=64, bq=16, bkv=32)  # d != dv: the padded build
    for d in (64, 128):
        add("flash_fwd_tf32", "float32", d)
    add("flash_fwd_tf32", "float32", 256)
    add("flash_fwd_tf32", "float32", 64, dv=128, bq=64, bkv=16)
    # flash_bwd_tf32.cu: the default plans at d = 64 and 128, and dv != d
    for d in (64, 128):
        add("flash_bwd_tf32", "float32", d)
    add("flash_bwd_tf32", "float32", 32, dv=96)
    # online_softmax.cu: one per dtype
    out["online_softmax.cu"] = [build_options({define: None}) for define in _DTYPE_DEFINES.values()]
    # flash_bwd.cu (SIMT backward): float32 over the head dims of the test grid, two head
    # dims for each other dtype (the dtype changes only conversions and the accumulator),
    # the smallest tiles, dv != d
    for d in (16, 32, 64, 96, 128, 256):
        add("flash_bwd_dkdv", "float32", d)
    for dt, dims in (("float16", (32, 128)), ("bfloat16", (16, 256)), ("float64", (64, 256))):
        for d in dims:
            add("flash_bwd_dkdv", dt, d)
    add("flash_bwd_dkdv", "float32", 64, bq=8, bkv=8)
    add("flash_bwd_dkdv", "float32", 96, dv=32)
    # flash_bwd_tc.cu (tensor-core backward, all three kernels in one compile here): the
    # smallest tiles (one warp) first -- tests/kernels/test_nvrtc.py compiles the first variant on
    # the other architectures, and sm_75's software mma makes big tiles slow to compile --
    # then the layouts of the planner: 32 keys per warp (d=64), 32 keys per warp pair
    # (d=128), two passes (d=256), dv != d
    add("flash_bwd_tc", "float16", 32, bq=16, bkv=16)
    add("flash_bwd_tc", "float16", 64)
    add("flash_bwd_tc", "float16", 128)
    add("flash_bwd_tc", "float16", 128, bq=64, bkv=128,  # the H100's default (177 KB)
        limit=tiling.EMULATOR_ARCHES["sm_90"])
    add("flash_bwd_tc", "bfloat16", 256)
    add("flash_bwd_tc", "bfloat16", 96, dv=32)
    # the logit features (-DCUFLASH_MASKS: flash_fwd_masked, flash_bwd_*_masked): float16 and
    # float64 (float vs double paths of masks.cuh and the double dbias atomics)
    for kernel in ("flash_fwd", "flash_bwd_dkdv"):
        for dt, d in (("float16", 128), ("float64", 64)):
            add(kernel, dt, d, CUFLASH_MASKS=None)
    add("flash_fwd", "bfloat16", 128, bq=8, CUFLASH_FWD_SERVING=None,   # serving + features
        CUFLASH_MASKS=None)
    # ... on the tensor-core forward: flash_fwd_tc_masked and flash_fwd_tf32_masked, defaults
    for kernel, dt, d in (("flash_fwd_tc_masked", "float16", 128), ("flash_fwd_tc_masked", "bfloat16", 64),
                          ("flash_fwd_tf32_masked", "float32", 64)):
        add(kernel, dt, d, CUFLASH_MASKS=None)
    # ... and on the tensor-core backward (flash_bwd_tc_masked, its own module): defaults at
    # d = 64 (query split) and d = 128 (two passes)
    for dt, d in (("float16", 64), ("bfloat16", 128)):
        add("flash_bwd_tc_masked", dt, d, CUFLASH_MASKS=None, CUFLASH_BWD_TC_MAIN=None)
    # ... and its band-only build (flash_bwd_tc_band: a window alone), the plain kernel's
    # defaults: d = 64 (FlashAttention-2's 128 x 128, the A100's one dO buffer) and d = 128 on
    # an H100 (64 x 128, two dO buffers: the A100's one-buffer build is for sm_80 alone)
    lean = {k: dict(CUFLASH_MASKS=None, CUFLASH_BWD_TC_MAIN=None, **BUILD_DEFINES[k])
            for k in tiling.BWD_LEAN_KERNELS}
    band = lean[tiling.BWD_BAND_KERNEL]
    add(tiling.BWD_BAND_KERNEL, "float16", 64, **band)
    add(tiling.BWD_BAND_KERNEL, "bfloat16", 128, limit=tiling.EMULATOR_ARCHES["sm_90"], **band)
    # ... and its softcap build (flash_bwd_tc_softcap: a softcap and at most a window), the
    # same defaults; its ALiBi build (flash_bwd_tc_alibi) at d = 64 on the H100's two dO
    # buffers and d = 128 on the A100's one (each variant is compiled for both architectures:
    # the band build's pair spills 4 / 20 B in the ALiBi build on the architecture that never
    # launches it)
    softcap, alibi = lean[tiling.BWD_SOFTCAP_KERNEL], lean[tiling.BWD_ALIBI_KERNEL]
    add(tiling.BWD_SOFTCAP_KERNEL, "float16", 64, **softcap)
    add(tiling.BWD_SOFTCAP_KERNEL, "bfloat16", 128, limit=tiling.EMULATOR_ARCHES["sm_90"], **softcap)
    add(tiling.BWD_ALIBI_KERNEL, "float16", 64, limit=tiling.EMULATOR_ARCHES["sm_90"], **alibi)
    add(tiling.BWD_ALIBI_KERNEL, "bfloat16", 128, **alibi)
    # ... and its dropout build (flash_bwd_tc_dropout: dropout and at most a window): at d = 64
    # the sm_86 cell's 64 x 64 (each architecture's default spills compiled for the other, where
    # it never runs: the A100's 128 x 128 with one dO buffer, the H100's with two, and the
    # sm_86 cell's 32 x 128 for sm_90), at d = 128 the A100's 64 x 128 with one dO buffer
    drop = lean[tiling.BWD_DROPOUT_KERNEL]
    add(tiling.BWD_DROPOUT_KERNEL, "float16", 64, bq=64, bkv=64, limit=tiling.EMULATOR_ARCHES["sm_86"], **drop)
    add(tiling.BWD_DROPOUT_KERNEL, "bfloat16", 128, **drop)
    # ... and its ALiBi + dropout build (flash_bwd_tc_alibi_dropout), the same variants
    alibi_drop = lean[tiling.BWD_ALIBI_DROPOUT_KERNEL]
    add(tiling.BWD_ALIBI_DROPOUT_KERNEL, "float16", 64, bq=64, bkv=64, limit=tiling.EMULATOR_ARCHES["sm_86"],
        **alibi_drop)
    add(tiling.BWD_ALIBI_DROPOUT_KERNEL, "bfloat16", 128, **alibi_drop)
    # ... and its ALiBi + softcap build (flash_bwd_tc_alibi_softcap): the sm_80 defaults (the
    # r form), and at d = 96 the tanh form
    alibi_cap = lean[tiling.BWD_ALIBI_SOFTCAP_KERNEL]
    add(tiling.BWD_ALIBI_SOFTCAP_KERNEL, "float16", 64, **alibi_cap)
    add(tiling.BWD_ALIBI_SOFTCAP_KERNEL, "bfloat16", 128, **alibi_cap)
    add(tiling.BWD_ALIBI_SOFTCAP_KERNEL, "float16", 96, **alibi_cap)
    # ... and float32's (flash_bwd_tf32_masked): defaults at d = 64 and 128
    for d in (64, 128):
        add("flash_bwd_tf32_masked", "float32", d, CUFLASH_MASKS=None)
    # flash_fwd_wgmma.cu (Hopper, sm_90a; its instructions trap in other builds): the sm_90
    # defaults at d = 128 (float16) and a 64-key tile at d = 64 (bfloat16), with the defines the
    # kernel reads (a launch passes the plan's others too, which it ignores)
    out["flash_fwd_wgmma.cu"] = [build_options({"CUFLASH_DTYPE_F16": None, "CUFLASH_HEAD_DIM": 128,
                                                "CUFLASH_BLOCK_KV": 128}),
                                 build_options({"CUFLASH_DTYPE_BF16": None, "CUFLASH_HEAD_DIM": 64,
                                                "CUFLASH_BLOCK_KV": 64})]
    # flash_bwd_wgmma.cu (Hopper, sm_90a): its tile shape at d = 128 and 64, and the other
    # kernel of the file (flash_bwd_wgmma_wide.cuh) at 256
    sm90 = tiling.EMULATOR_ARCHES["sm_90"]
    add("flash_bwd_wgmma", "float16", 128, limit=sm90)
    add("flash_bwd_wgmma", "bfloat16", 64, limit=sm90)
    add("flash_bwd_wgmma", "float16", 256, limit=sm90)
    return out

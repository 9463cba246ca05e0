"""Devices, inputs, methods and timing of the GPU benchmark (``gpu.py``).

Two devices: :class:`CudaDevice` (CuPy arrays, CUDA-event timing) and
:class:`HostDevice` (the emulator backend: NumPy arrays, ``time.perf_counter``).
Every method runs on one :class:`InputSet` per call: the backend's arrays and,
when torch is usable, torch tensors that share their memory through DLPack
(``torch.from_dlpack``, zero copies), so all methods read the same bytes.
"""
import contextlib
import gc
import math
import os
import platform
import shutil
import subprocess
import time
import warnings

import numpy as np

from .gpu_check import GRAD_NAMES, failure_reason, judge, np_dtype

__all__ = ["HostDevice", "CudaDevice", "Torch", "InputSet", "make_set", "make_methods",
           "CuflashTiled", "CuflashStandard", "Sdpa", "SDPA_BACKENDS", "first_call", "measure",
           "input_sets_needed", "reason_of", "record_warnings", "to_host64", "check_method"]

# The order of the table's columns.  SDPA backends as torch.nn.attention.SDPBackend names.
SDPA_BACKENDS = (("sdpa flash", "FLASH_ATTENTION"), ("sdpa cudnn", "CUDNN_ATTENTION"),
                 ("sdpa efficient", "EFFICIENT_ATTENTION"), ("sdpa math", "MATH"))
# rotation: cycle through enough input sets to span this many times the L2 cache
L2_SPAN = 3
MAX_SETS = 64


# ---------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------
class HostDevice:
    """The emulator backend: NumPy arrays on the host, wall-clock timing."""

    backend = "emulator"
    timer = "time.perf_counter"

    def __init__(self):
        self.xp = np
        self.l2_bytes = None

    def sync(self):
        pass

    def elapsed(self, fn):
        """Seconds ``fn()`` takes."""
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def to_host(self, a):
        return np.asarray(a)

    def from_host(self, a):
        return np.array(a)

    def random(self, shape, dtype, seed):
        rng = np.random.default_rng(seed)
        return rng.standard_normal(shape, dtype=np.float32).astype(np_dtype(dtype))

    def free_bytes(self):
        return None

    def release(self):
        # nothing to do: the emulator's arrays are tiny and freed by reference counting, and
        # a full gc.collect() costs ~0.15 s once torch is imported (it ran after every method)
        pass

    def info(self):
        from cuflash import available_backends
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1].strip() for ln in f
                            if ln.startswith("model name")), cpu)
        except OSError:
            pass
        how = available_backends().get("emulator", (False, ""))[1]
        return {"name": f"CPU emulator ({cpu}, {os.cpu_count()} cores)",
                "emulator": how or "host C++ compiler", "l2_bytes": None}


class CudaDevice:
    """The cuda backend: CuPy arrays on the current device, CUDA-event timing.

    Events are recorded on CuPy's current stream, the legacy default stream,
    which torch's default stream also is: they bracket torch's kernels too.
    """

    backend = "cuda"
    timer = "CUDA events (cupy.cuda.Event)"

    def __init__(self):
        import cupy
        self.cp = cupy
        self.xp = cupy
        self.dev = cupy.cuda.Device()
        l2 = self.dev.attributes.get("L2CacheSize")  # cudaDevAttrL2CacheSize
        if l2 is None:
            l2 = cupy.cuda.runtime.getDeviceProperties(self.dev.id).get("l2CacheSize")
        self.l2_bytes = int(l2) if l2 else None  # None: no rotation, and the header says so
        self.torch = None  # set by Torch so release() can empty its cache

    def sync(self):
        self.dev.synchronize()

    def elapsed(self, fn):
        """Seconds of GPU time between events recorded before and after ``fn()``."""
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / 1e3

    def to_host(self, a):
        return self.cp.asnumpy(a)

    def from_host(self, a):
        return self.cp.asarray(a)

    def random(self, shape, dtype, seed):
        cp = self.cp
        x = cp.random.RandomState(seed).standard_normal(shape, dtype=cp.float32)
        if dtype != "bfloat16":
            return x.astype(dtype)
        # float32 -> bfloat16 on the device, round to nearest even, from the bits
        u = x.view(cp.uint32)
        u = (u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16
        return u.astype(cp.uint16).view(np_dtype("bfloat16"))

    def free_bytes(self):
        return int(self.cp.cuda.runtime.memGetInfo()[0])

    def release(self):
        gc.collect()
        self.cp.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def info(self):
        cp = self.cp
        rt = cp.cuda.runtime
        props = rt.getDeviceProperties(self.dev.id)
        name = props.get("name", b"?")
        name = name.decode() if isinstance(name, bytes) else str(name)

        def cuda_ver(v):
            return f"{v // 1000}.{v % 1000 // 10}"
        driver = "unknown (nvidia-smi not found)"
        if shutil.which("nvidia-smi"):
            try:
                r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                    "--format=csv,noheader", f"--id={self.dev.id}"],
                                   capture_output=True, text=True, timeout=30)
                driver = r.stdout.strip().splitlines()[0] if r.returncode == 0 else driver
            except (OSError, subprocess.TimeoutExpired, IndexError):
                pass
        return {"name": name, "compute_capability": self.dev.compute_capability,
                "sms": int(self.dev.attributes["MultiProcessorCount"]),
                "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
                "l2_bytes": self.l2_bytes or 0, "driver": driver,
                "cuda_driver_api": cuda_ver(rt.driverGetVersion()),
                "cuda_runtime": cuda_ver(rt.runtimeGetVersion())}


class Torch:
    """torch, when importable and usable on the device; else ``ok`` False and ``why``."""

    def __init__(self, device, disabled=False):
        self.ok, self.why, self.version, self.cudnn = False, "", "not installed", "not installed"
        if disabled:
            self.why = "left out (--no-torch)"
            return
        try:
            import torch
            import torch.nn.functional as F
        except ImportError as e:
            self.why = f"torch not installed ({e}; pip install torch, a CUDA build for a GPU)"
            return
        self.torch, self.F = torch, F
        self.version = torch.__version__
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        self.cudnn = "not available" if not v else (
            f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 90000 else str(v))
        if device.backend == "cuda":
            if not torch.cuda.is_available():
                self.why = (f"torch {torch.__version__} cannot use CUDA "
                            "(torch.cuda.is_available() is False: a CPU-only build?)")
                return
            device.torch = torch
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError:
            self.why = f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel " \
                       "(torch >= 2.3 needed to force an SDPA backend)"
            return
        self.SDPBackend, self.sdpa_kernel = SDPBackend, sdpa_kernel
        self.ok = True

    def view(self, a, grad=False):
        """A torch tensor sharing ``a``'s memory (DLPack); bfloat16 goes as its bits."""
        if str(a.dtype) == "bfloat16":
            t = self.torch.from_dlpack(a.view(np.int16)).view(self.torch.bfloat16)
        else:
            t = self.torch.from_dlpack(a)
        return t.requires_grad_(grad)


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------
class InputSet:
    """One problem's arrays: q, k, v, do on the backend and their torch views (or None)."""

    def __init__(self, q, k, v, do, causal, torch_):
        self.q, self.k, self.v, self.do, self.causal = q, k, v, do, causal
        self.gqa = q.shape[-3] != k.shape[-3]
        self.tq = self.tk = self.tv = self.tdo = None
        if torch_ is not None and torch_.ok:
            self.tq, self.tk, self.tv = (torch_.view(a, grad=True) for a in (q, k, v))
            self.tdo = torch_.view(do)

    @property
    def nbytes(self):
        return sum(int(a.nbytes) for a in (self.q, self.k, self.v, self.do))


def make_set(device, torch_, shape, dtype, causal, seed, host=False):
    """Random inputs of ``shape`` = (B, H, Hk, Nq, Nk, d); ``host`` draws them with NumPy
    (to keep a copy for the oracle) instead of on the device."""
    B, H, Hk, Nq, Nk, d = shape
    shapes = ((B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, d), (B, H, Nq, d))
    if host:
        rng = np.random.default_rng(seed)
        arrs = [rng.standard_normal(s, dtype=np.float32).astype(np_dtype(dtype)) for s in shapes]
        return InputSet(*(device.from_host(a) for a in arrs), causal, torch_), arrs
    return InputSet(*(device.random(s, dtype, seed * 4 + i) for i, s in enumerate(shapes)),
                    causal, torch_)


def input_sets_needed(set_bytes, l2_bytes):
    """How many input sets to cycle through so that no call finds its inputs in L2.

    None or 0 for ``l2_bytes``: one set.  Else enough sets to span ``L2_SPAN``
    times the L2 size, at most ``MAX_SETS``.
    """
    if not l2_bytes or set_bytes <= 0:
        return 1
    return int(min(MAX_SETS, max(1, math.ceil(L2_SPAN * l2_bytes / set_bytes))))


# ---------------------------------------------------------------------------
# methods: forward(x, grad) -> state; output(state) -> o; backward(x, state, retain) -> grads
# ---------------------------------------------------------------------------
class CuflashTiled:
    """cuflash.tiled_attention / tiled_attention_backward (the FlashAttention kernels)."""

    name = "cuflash tiled"

    def __init__(self, backend):
        import cuflash
        self.cf, self.backend = cuflash, backend

    def unavailable(self, x, device, grad):
        return None

    def context(self):
        return contextlib.nullcontext()

    def forward(self, x, grad):
        return self.cf.tiled_attention(x.q, x.k, x.v, causal="top_left" if x.causal else False,
                                       return_lse=grad, backend=self.backend)

    def output(self, state):
        return state[0] if isinstance(state, tuple) else state

    def backward(self, x, state, retain=False):
        o, lse = state
        return self.cf.tiled_attention_backward(x.do, x.q, x.k, x.v, o, lse,
                                                causal="top_left" if x.causal else False,
                                                backend=self.backend)


class CuflashStandard(CuflashTiled):
    """cuflash.standard_attention (materialises P; CuPy on "cuda", the NumPy reference on
    "emulator"); its backward call takes no P and so computes the forward again."""

    name = "cuflash standard"

    def unavailable(self, x, device, grad):
        return _memory_guard(x, device, grad, "S and P")

    def forward(self, x, grad):
        return self.cf.standard_attention(x.q, x.k, x.v, causal="top_left" if x.causal else False,
                                          backend=self.backend)[0]

    def output(self, state):
        return state

    def backward(self, x, state, retain=False):
        return self.cf.standard_attention_backward(x.do, x.q, x.k, x.v,
                                                   causal="top_left" if x.causal else False,
                                                   backend=self.backend)


class Sdpa:
    """torch.nn.functional.scaled_dot_product_attention with one backend forced
    (``backend_name`` None: torch's own choice)."""

    def __init__(self, name, backend_name, torch_):
        self.name, self.backend_name, self.t = name, backend_name, torch_

    def unavailable(self, x, device, grad):
        if not self.t.ok:
            return self.t.why
        if self.backend_name == "MATH":
            return _memory_guard(x, device, grad, "the attention matrix")
        return None

    def context(self):
        if self.backend_name is None:
            return contextlib.nullcontext()
        return self.t.sdpa_kernel(getattr(self.t.SDPBackend, self.backend_name))

    def forward(self, x, grad):
        kw = {"enable_gqa": True} if x.gqa else {}
        if grad:
            return self.t.F.scaled_dot_product_attention(x.tq, x.tk, x.tv, is_causal=x.causal, **kw)
        with self.t.torch.no_grad():
            return self.t.F.scaled_dot_product_attention(x.tq, x.tk, x.tv, is_causal=x.causal, **kw)

    def output(self, state):
        return state

    def backward(self, x, state, retain=False):
        return self.t.torch.autograd.grad(state, (x.tq, x.tk, x.tv), x.tdo, retain_graph=retain)


def make_methods(backend, torch_):
    """The methods in table order (the SDPA ones even when torch is missing: they say why)."""
    out = [CuflashTiled(backend), CuflashStandard(backend)]
    if torch_.why != "left out (--no-torch)":
        out += [Sdpa(name, be, torch_) for name, be in SDPA_BACKENDS]
    return out


def _memory_guard(x, device, grad, what):
    """Why a method that stores (B, H, Nq, Nk) float32 arrays would not fit, or None.

    Counted: S and P in the forward (x3 with a temporary), dP and dS in the
    backward (x6) - an estimate; a method that still runs out of memory is
    reported from its exception.
    """
    if device.free_bytes() is None:
        return None
    device.release()  # blocks cached by CuPy's and torch's pools count as free here
    free = device.free_bytes()
    B, H, Nq = x.q.shape[0], x.q.shape[-3], x.q.shape[-2]
    need = B * H * Nq * x.k.shape[-2] * 4 * (6 if grad else 3)
    if need > 0.9 * free:
        return (f"does not fit: about {need / 2**30:.1f} GiB for {what} (float32, "
                f"{'forward and backward' if grad else 'forward'}), {free / 2**30:.1f} GiB free")
    return None


def to_host64(device, a):
    """A float64 NumPy copy of a backend array or a torch tensor."""
    if type(a).__module__.split(".")[0] == "torch":
        return a.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(device.to_host(a)).astype(np.float64)


def reason_of(exc, caught=()):
    """One line saying why a call failed: the exception and torch's warnings, if any."""
    msg = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {msg}"
    seen = []
    for w in caught:
        line = (str(w.message).strip().splitlines() or [""])[0]
        if line and line not in seen:
            seen.append(line)
    if seen:
        text += " [torch: " + "; ".join(seen) + "]"
    return text[:400] + ("..." if len(text) > 400 else "")


@contextlib.contextmanager
def record_warnings():
    """Collect warnings (torch says there why a forced SDPA backend cannot run)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def check_method(device, m, x, grad, ref, base, dtype, what, rec, names=GRAD_NAMES):
    """Run method ``m`` once on the check set ``x`` (the forward; with ``grad`` the backward
    too, its outputs named ``names``) and judge the outputs against the float64 ``ref`` and
    the low-precision baseline ``base`` (``gpu_check.py``'s rule).  Fills ``rec``:
    ``status`` (passed, failed, or n/a when the method cannot run here or raised), ``errors``,
    ``reason``, ``first_fwd_ms`` and ``first_bwd_ms`` (first calls: they include any compile);
    returns it."""
    why = m.unavailable(x, device, grad)
    if why:
        rec["reason"] = why
        return rec
    caught = []
    try:
        with record_warnings() as caught, m.context():
            t_f, state = first_call(device, lambda: m.forward(x, grad))
            outs = {"o": m.output(state)}
            rec["first_fwd_ms"] = t_f * 1e3
            if grad:
                t_b, grads = first_call(device, lambda: m.backward(x, state))
                outs.update(zip(names, grads))
                rec["first_bwd_ms"] = t_b * 1e3
        ok, rec["errors"] = judge({k: to_host64(device, v) for k, v in outs.items()}, ref, base,
                                  dtype)
        rec["status"] = "passed" if ok else "failed"
        if not ok:
            rec["reason"] = failure_reason(rec["errors"], what)
    except Exception as e:  # the library's refusal or failure, reported, not hidden
        rec["reason"] = reason_of(e, caught)
    return rec


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
def first_call(device, fn):
    """(seconds, result) of one call, synchronised on both sides (includes any compile)."""
    device.sync()
    t0 = time.perf_counter()
    out = fn()
    device.sync()
    return time.perf_counter() - t0, out


def measure(device, call, sets, warmup, reps, target_s, max_calls=100000):
    """Time ``call(x)`` cycling through ``sets``: the median of ``reps`` repeats.

    The first call is timed on its own (it includes any first-use compile);
    then ``warmup`` calls, each timed, the last of which (or the first call,
    without warm-up) sizes a repeat: ``n`` calls so that a repeat takes about
    ``target_s``.  Each repeat is timed as a whole (CUDA events around the n
    calls on the GPU) and divided by ``n``.

    Returns
    -------
    dict
        ``first_call_ms``, ``ms`` (median per call), ``runs_ms``, ``calls_per_rep``.
    """
    nsets, i = len(sets), 1
    first_s, _ = first_call(device, lambda: call(sets[0]))
    one = first_s
    for _ in range(warmup):
        one = device.elapsed(lambda: call(sets[i % nsets]))
        i += 1
    n = int(min(max_calls, max(1, math.ceil(target_s / max(one, 1e-9)))))
    runs = []
    for _ in range(reps):
        start = i

        def batch():
            for j in range(start, start + n):
                call(sets[j % nsets])
        runs.append(device.elapsed(batch) / n)
        i += n
    return {"first_call_ms": first_s * 1e3, "ms": float(np.median(runs)) * 1e3,
            "runs_ms": [r * 1e3 for r in runs], "calls_per_rep": n}

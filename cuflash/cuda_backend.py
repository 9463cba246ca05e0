"""The "cuda" backend: CuPy arrays, the kernels of ``kernels_cu/`` compiled by NVRTC.

Kernels are compiled at run time by ``cupy.RawModule`` (NVRTC for the current
device's architecture), specialised by ``-D`` defines and cached per device
(:mod:`cuflash.kernels`); tile sizes and the shared-memory budget come from
:mod:`cuflash.tiling` against the device's ``MaxSharedMemoryPerBlockOptin``.
The launch code is the emulator's: the launchers of :mod:`cuflash.launch`,
one per kernel family.

``standard_attention`` / ``standard_attention_backward`` are plain CuPy
(cuBLAS matmuls and an elementwise softmax): the baseline users would write,
deliberately not a custom kernel.

Every function has the signature of the front (``cuflash.<name>``) minus
``backend=``; the documentation is the front's (``help(cuflash.<name>)``).
"""
from . import kernels, reference
from ._validate import check_attention_inputs, check_backward_inputs
from ._validate_masks import check_masks
from .launch.api import KernelFunctions
# the reference's standard attention is array code over xp: here it runs with CuPy
from .reference.standard import _standard_backward, _standard_forward

__all__ = [
    "is_available", "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "precompile", "runtime",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
]

_RUNTIMES = {}
_AVAILABLE = None

# what to tell a user without CuPy (a checkout is how cuflash is installed today)
INSTALL_HINT = ('pip install ".[cuda12]" (CUDA 12.x driver) or ".[cuda13]" (CUDA 13.x) from a '
                "cuflash checkout; nvidia-smi shows the driver's CUDA version")


def runtime():
    """The :class:`cuflash.kernels.Runtime` of the current CuPy device.

    One ``cudaGetDevice`` per call (no device-property query): the runtime,
    with its plans, compiled kernels and prepared calls, is made once per device.
    """
    import cupy  # optional (the cuda extras): imported on use, so import cuflash never needs it
    dev = cupy.cuda.runtime.getDevice()
    rt = _RUNTIMES.get(dev)
    if rt is None:
        rt = _RUNTIMES[dev] = kernels.get_runtime("cuda")
    return rt


def is_available():
    """(True, device) when CuPy imports and sees a CUDA device, else (False, why).

    Asked once per process (the answer is kept): the device count and name do
    not change under a running program, and the query costs about a millisecond.
    """
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def _probe():
    try:
        import cupy  # optional: whether it imports is the question asked here
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        if isinstance(e, ImportError) and getattr(e, "name", None) == "cupy":
            return False, f"CuPy is not installed: {INSTALL_HINT}"
        return False, f"cupy is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"CuPy cannot reach a CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return False, "CuPy found no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props.get("name", b"?")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return True, f"{n} CUDA device(s), current: {name}"


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """Plain CuPy attention (cuBLAS matmul + softmax), materialising P.

    See Also ``cuflash.reference.standard_attention``.
    """
    import cupy  # optional (the cuda extras): imported on use
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed)
    return _standard_forward(cupy, q, k, v, spec, ms)


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, bias=None,
                                window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                seed=None, return_dbias=False):
    """Plain CuPy stored-P backward. See Also ``cuflash.reference.standard_attention_backward``."""
    import cupy  # optional (the cuda extras): imported on use
    spec = check_backward_inputs(do, q, k, v, None, None, scale=scale, causal=causal,
                                 need_forward=False)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    return _standard_backward(cupy, do, q, k, v, spec, ms)


# --------------------------------------------------------------------------
# the kernels: the launchers of cuflash.launch, with this backend's runtime
# --------------------------------------------------------------------------
_kernels = KernelFunctions(runtime, reference.memory_analysis)
online_softmax = _kernels.online_softmax
online_softmax_2d = _kernels.online_softmax_2d
tiled_attention = _kernels.tiled_attention
tiled_attention_backward = _kernels.tiled_attention_backward
attention_with_kvcache = _kernels.attention_with_kvcache
varlen_attention = _kernels.varlen_attention
varlen_attention_backward = _kernels.varlen_attention_backward
verify_no_full_materialization = _kernels.verify_no_full_materialization
precompile = _kernels.precompile
memory_analysis = _kernels.memory_analysis

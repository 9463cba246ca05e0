"""The "emulator" backend: the CUDA C kernels of ``kernels_cu/`` executed on the CPU.

NumPy arrays in and out.  The kernels are the same sources the "cuda" backend
compiles with NVRTC; here ``cuflash.emulator`` compiles them with the host C++
compiler and runs them with CUDA's execution semantics (slow: for tests,
debugging and learning).  The launch code is shared with the "cuda" backend
(the launchers of :mod:`cuflash.launch`, one per kernel family); tile sizes are
held to a nominal sm_80 shared-memory limit (:mod:`cuflash.tiling`), which
``memory_analysis`` reports.

Every function has the signature of the front (``cuflash.<name>``) minus
``backend=``; the documentation is the front's (``help(cuflash.<name>)``).
"""
from . import emulator, kernels, reference
from .launch.api import KernelFunctions

__all__ = [
    "is_available", "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "precompile", "runtime",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
]

_RUNTIMES = {}


def runtime(race_check=False):
    """The emulator :class:`cuflash.kernels.Runtime` (race_check: under ThreadSanitizer)."""
    key = bool(race_check)
    if key not in _RUNTIMES:
        _RUNTIMES[key] = kernels.get_runtime("emulator", race_check=key)
    return _RUNTIMES[key]


def is_available():
    """(True, compiler) when a C++20 host compiler is found, else (False, why)."""
    return emulator.is_available()


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """The NumPy reference's standard attention (the baseline users would write is not a kernel).

    See Also ``cuflash.reference.standard_attention``.
    """
    return reference.standard_attention(q, k, v, scale=scale, causal=causal, bias=bias,
                                        window=window, alibi_slopes=alibi_slopes,
                                        softcap=softcap, dropout_p=dropout_p, seed=seed)


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, bias=None,
                                window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                seed=None, return_dbias=False):
    """The NumPy reference's stored-P backward (not a kernel).

    See Also ``cuflash.reference.standard_attention_backward``.
    """
    return reference.standard_attention_backward(
        do, q, k, v, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        return_dbias=return_dbias)


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

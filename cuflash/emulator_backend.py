"""The "emulator" backend: the CUDA C kernels of ``kernels_cu/`` executed on the CPU.

NumPy arrays in and out.  The kernels are the same sources the "cuda" backend
compiles with NVRTC; here ``cuflash.emulator`` compiles them with the host C++
compiler and runs them with CUDA's execution semantics (slow: for tests,
debugging and learning).  The launch code is shared with the "cuda" backend
(the launchers of :mod:`cuflash.launch`, one per kernel family).  It stands in
for one GPU architecture, sm_80 unless ``$CUFLASH_EMULATOR_ARCH`` names another
(sm_75, sm_80, sm_86, sm_89, sm_90; read at each call): tiles are planned for that
GPU's shared-memory limit and SM count (:mod:`cuflash.tiling`), which
``memory_analysis`` reports, and the kernels are compiled for it (``-arch``), so an
emulated call plans and launches what that GPU would.

Every function has the signature of the front (``cuflash.<name>``) minus
``backend=``; the documentation is the front's (``help(cuflash.<name>)``).
"""
import os

from . import emulator, kernels, reference, tiling
from .launch.api import KernelFunctions

__all__ = [
    "is_available", "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "precompile", "runtime",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
]

_RUNTIMES = {}


def runtime(race_check=False):
    """The emulator :class:`cuflash.kernels.Runtime` (race_check: under ThreadSanitizer) of
    the architecture ``$CUFLASH_EMULATOR_ARCH`` names (unset: sm_80, compiled without -arch),
    with the Hopper kernels as an sm_90 chooses them (``$CUFLASH_WGMMA``) where that is sm_90."""
    arch = None
    if os.environ.get(tiling.EMULATOR_ARCH_ENV):
        arch = tiling.emulator_arch()  # ValueError for a name it does not know
    key = (bool(race_check), arch, kernels.wgmma_choice())
    if key not in _RUNTIMES:
        _RUNTIMES[key] = kernels.get_runtime("emulator", race_check=key[0], arch=arch)
    return _RUNTIMES[key]


def is_available():
    """(True, compiler) when a C++20 host compiler is found, else (False, why)."""
    return emulator.is_available()


# the baseline users would write is not a kernel: the NumPy reference's, as it is
standard_attention = reference.standard_attention
standard_attention_backward = reference.standard_attention_backward


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

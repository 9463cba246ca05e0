"""The NumPy reference backend (``backend="numpy"``): FlashAttention's algorithm, in NumPy.

Every public function of cuflash is defined here; its documentation is the
front's (``help(cuflash.<name>)``), and the docstrings here say how the
reference computes it.  The notation is FlashAttention's and the CUDA
kernels', so this file and ``kernels_cu/flash_fwd.cu`` read side by side:

======  ==================================================================
Br, Bc  rows of a query tile (``block_q``) and of a key/value tile (``block_kv``)
Qi      the i-th query tile, ``q[..., i*Br:(i+1)*Br, :]`` (pre-multiplied by ``scale``)
Kj, Vj  the j-th key and value tiles
S       the logits of one tile, ``Qi @ Kj^T``, shape (..., Br, Bc)
m_i     running row maximum of the logits seen so far, shape (..., Br)
l_i     running row sum of ``exp(S - m_i)``, shape (..., Br)
acc     the unnormalised output ``sum_j exp(S_ij - m_i) @ Vj``, shape (..., Br, dv)
lse     log-sum-exp of each row, ``m_i + log(l_i)`` (what the backward keeps)
D       ``rowsum(do * o)``, the softmax-backward correction of FlashAttention-2
======  ==================================================================

Performance (the CPU path users actually run): everything is vectorised over
all leading dims (batch, heads: one BLAS call per tile stack, no Python loop);
tiles are sized for BLAS; float16/bfloat16/float32 compute in float32 (float64
in float64), never widened to float64 in the big arrays; the query tiles are
shared out to a small thread pool (NumPy releases the GIL in matmul and the
ufuncs) with OpenBLAS held to one thread per call meanwhile, which measured
~1.5x faster on 2 cores than one Python thread driving a 2-thread BLAS (see
``_blas_single_thread``).  The measured figures are in the README.

One module per family, each re-exported here (``cuflash.reference.tiled_attention`` is
the public name); ``_common`` holds the threads, the BLAS control and shared helpers.
"""
import numpy as np

# _blas and blas_controllable: the CPU benchmark reports the BLAS in use
from ._common import _blas, blas_controllable, default_blocks, sum_to_shape  # noqa: F401
from .flash_backward import tiled_attention_backward
from .flash_forward import tiled_attention
from .memory import memory_analysis, tiled_forward_hbm_bytes, verify_no_full_materialization
from .serving import attention_with_kvcache, varlen_attention, varlen_attention_backward
from .softmax import online_softmax, online_softmax_2d
from .standard import standard_attention, standard_attention_backward

__all__ = [
    "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "is_available",
    "default_blocks", "tiled_forward_hbm_bytes", "sum_to_shape", "precompile",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
]


def is_available():
    """The NumPy backend runs wherever NumPy imports: ``(True, reason)``."""
    return True, f"NumPy {np.__version__} on the CPU"


def precompile(dtypes=("float16", "bfloat16"), head_dims=(64, 128), *, features=False,
               progress=None):
    """The NumPy backend compiles nothing: returns an empty record (``cuflash.precompile``)."""
    if progress is not None:
        progress("the numpy backend has no kernels to compile")
    return {"backend": "numpy", "seconds": 0.0, "modules": []}

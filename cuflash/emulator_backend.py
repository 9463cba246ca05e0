"""The "emulator" backend: the CUDA C kernels of ``kernels_cu/`` executed on the CPU.

NumPy arrays in and out.  The kernels are the same sources the "cuda" backend
compiles with NVRTC; here ``cuflash.emulator`` compiles them with the host C++
compiler and runs them with CUDA's execution semantics (slow: for tests,
debugging and learning).  The launch code is shared with the "cuda" backend
(the launchers of :mod:`cuflash.launch`, one per kernel family); tile sizes are
held to a nominal sm_80 shared-memory limit (:mod:`cuflash.tiling`), which
``memory_analysis`` reports.

Every function has the signature of the front (``cuflash.<name>``) minus
``backend=``; the documentation is on :mod:`cuflash.reference`.
"""
from . import emulator, kernels, reference
from .launch import bwd, features, fwd, serving, softmax
from .launch import precompile as launch_precompile

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
def online_softmax(x, chunk_size=None, *, return_stats=False):
    """Kernel online_softmax_rows on one row. See Also ``cuflash.reference.online_softmax``."""
    return softmax.online_softmax(runtime(), x, chunk_size, return_stats, one_d=True)


def online_softmax_2d(x, chunk_size=None, *, return_stats=False):
    """Kernel online_softmax_rows, one warp per row. See Also ``cuflash.reference.online_softmax_2d``."""
    return softmax.online_softmax(runtime(), x, chunk_size, return_stats, one_d=False)


def tiled_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                    alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, block_q=None,
                    block_kv=None, return_lse=False, num_splits=None):
    """The forward kernels (cuflash.launch.fwd). See Also ``cuflash.tiled_attention``."""
    return fwd.tiled_attention(runtime(), q, k, v, scale, causal, block_q, block_kv, return_lse,
                               num_splits, features.of(bias, window, alibi_slopes, softcap,
                                                       dropout_p, seed))


def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, bias=None,
                             window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                             seed=None, block_q=None, block_kv=None, deterministic=False,
                             return_dbias=False):
    """The backward kernels (cuflash.launch.bwd). See Also ``cuflash.tiled_attention_backward``."""
    return bwd.tiled_attention_backward(
        runtime(), do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic,
        features.of(bias, window, alibi_slopes, softcap, dropout_p, seed), return_dbias)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, scale=None, causal=False, bias=None, window=None,
                           alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                           num_splits=None, return_lse=False, check_inputs=True):
    """The serving kernels (cuflash.launch.serving). See Also ``cuflash.attention_with_kvcache``."""
    return serving.attention_with_kvcache(
        runtime(), q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, causal,
        num_splits, return_lse, check_inputs,
        features.of(bias, window, alibi_slopes, softcap, dropout_p, seed))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, scale=None, causal=False, bias=None, window=None,
                     alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                     return_lse=False, check_inputs=True):
    """The serving kernels (cuflash.launch.serving). See Also ``cuflash.varlen_attention``."""
    return serving.varlen_attention(
        runtime(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        causal, return_lse, check_inputs,
        features.of(bias, window, alibi_slopes, softcap, dropout_p, seed))


def varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                              bias=None, window=None, alibi_slopes=None, softcap=None,
                              dropout_p=0.0, seed=None, deterministic=False, check_inputs=True,
                              return_dbias=False):
    """The backward kernels on packed sequences. See Also ``cuflash.varlen_attention_backward``."""
    return bwd.varlen_attention_backward(
        runtime(), do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale, causal, deterministic, check_inputs,
        features.of(bias, window, alibi_slopes, softcap, dropout_p, seed), return_dbias)


def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                    heads=1, num_splits=1, bias_shape=None, window=None):
    """The model with the forward kernel's tiles and shared memory (nominal sm_80 limit).

    See Also ``cuflash.memory_analysis``; the extra keys are described in
    ``cuflash.launch.fwd.memory_analysis`` and ``cuflash.launch.precompile.memory_analysis``
    (``forward_kernels``, ``backward_kernels``).
    """
    return launch_precompile.memory_analysis(runtime(), reference.memory_analysis, N, d, dtype, Nk,
                                             block_q, block_kv, batch, heads, num_splits,
                                             bias_shape, window)


def verify_no_full_materialization(q, k, v, block_size):
    """flash_fwd with block_size tiles; the largest intermediate (lse, tiles, copies).

    See Also ``cuflash.reference.verify_no_full_materialization``.
    """
    return fwd.verify_no_full_materialization(runtime(), q, k, v, block_size)


def precompile(dtypes=("float16", "bfloat16"), head_dims=(64, 128), *, features=False,
               progress=None):
    """Compile the default-tile kernels into the emulator's cache now (``CUFLASH_CACHE_DIR``).

    See Also ``cuflash.precompile``.
    """
    return launch_precompile.precompile(runtime(), dtypes, head_dims, progress, features)

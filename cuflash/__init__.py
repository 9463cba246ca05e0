"""cuflash: exact FlashAttention as CUDA C kernels compiled at run time.

One API, three backends (``docs/api.md``): ``"numpy"`` (the reference),
``"cuda"`` (CuPy arrays, kernels compiled by NVRTC) and ``"emulator"`` (the
same CUDA C executed on the CPU).  ``backend=None`` picks from the array type.
Each function here is one line: find the backend module and call it; the full
documentation of every function is on the reference, ``cuflash.reference``.
"""
from ._dispatch import available_backends, get_backend

__version__ = "0.1.0"

__all__ = [
    "available_backends", "get_backend",
    "online_softmax", "online_softmax_2d",
    "standard_attention", "standard_attention_backward",
    "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization",
]


def online_softmax(x, chunk_size=None, *, return_stats=False, backend=None):
    """Softmax of a 1-D array in one streaming pass. See ``cuflash.reference.online_softmax``."""
    return get_backend(backend, x).online_softmax(x, chunk_size, return_stats=return_stats)


def online_softmax_2d(x, chunk_size=None, *, return_stats=False, backend=None):
    """Row-wise online softmax. See ``cuflash.reference.online_softmax_2d``."""
    return get_backend(backend, x).online_softmax_2d(x, chunk_size, return_stats=return_stats)


def standard_attention(q, k, v, *, scale=None, causal=False, backend=None):
    """Attention that materialises P. See ``cuflash.reference.standard_attention``."""
    return get_backend(backend, q, k, v).standard_attention(q, k, v, scale=scale, causal=causal)


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, backend=None):
    """Textbook backward storing P. See ``cuflash.reference.standard_attention_backward``."""
    return get_backend(backend, do, q, k, v).standard_attention_backward(
        do, q, k, v, scale=scale, causal=causal)


def tiled_attention(q, k, v, *, scale=None, causal=False, block_q=None, block_kv=None,
                    return_lse=False, backend=None):
    """Flash attention forward. See ``cuflash.reference.tiled_attention``."""
    return get_backend(backend, q, k, v).tiled_attention(
        q, k, v, scale=scale, causal=causal, block_q=block_q, block_kv=block_kv,
        return_lse=return_lse)


def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, block_q=None,
                             block_kv=None, deterministic=False, backend=None):
    """Flash attention backward. See ``cuflash.reference.tiled_attention_backward``."""
    return get_backend(backend, do, q, k, v, o, lse).tiled_attention_backward(
        do, q, k, v, o, lse, scale=scale, causal=causal, block_q=block_q, block_kv=block_kv,
        deterministic=deterministic)


def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                    heads=1, backend=None):
    """Memory and HBM-traffic model. See ``cuflash.reference.memory_analysis``."""
    return get_backend("numpy" if backend is None else backend).memory_analysis(
        N, d, dtype, Nk=Nk, block_q=block_q, block_kv=block_kv, batch=batch, heads=heads)


def verify_no_full_materialization(q, k, v, block_size, *, backend=None):
    """Instrumented tiled forward. See ``cuflash.reference.verify_no_full_materialization``."""
    return get_backend(backend, q, k, v).verify_no_full_materialization(q, k, v, block_size)

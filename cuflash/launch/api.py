"""The kernel functions of the "cuda" and "emulator" backends, written once over a runtime.

The two backends differ only in the :class:`cuflash.kernels.Runtime` their
kernels run on (a CuPy device, or the emulator); each makes one
:class:`KernelFunctions` over its own ``runtime()`` and binds the methods to
module names (``tiled_attention = _kernels.tiled_attention``), so every
function keeps the signature of the front (``cuflash.<name>``) minus
``backend=``.
"""
from . import bwd, features, fwd, precompile as launch_precompile, serving, softmax


class KernelFunctions:
    """The front's kernel functions, each launched on the runtime ``runtime()`` returns.

    ``runtime`` is called at every call (not once here): the "cuda" backend's
    runtime is that of the current CuPy device.  ``reference_model`` is
    :func:`cuflash.reference.memory_analysis`, which ``memory_analysis`` extends
    (the backends pass it: the reference sits above the launchers).
    """

    def __init__(self, runtime, reference_model):
        self._runtime = runtime
        self._reference_model = reference_model

    def online_softmax(self, x, chunk_size=None, *, return_stats=False):
        """Kernel online_softmax_rows on one row. See Also ``cuflash.reference.online_softmax``."""
        return softmax.online_softmax(self._runtime(), x, chunk_size, return_stats, one_d=True)

    def online_softmax_2d(self, x, chunk_size=None, *, return_stats=False):
        """Kernel online_softmax_rows, one warp per row. See Also ``cuflash.reference.online_softmax_2d``."""
        return softmax.online_softmax(self._runtime(), x, chunk_size, return_stats, one_d=False)

    def tiled_attention(self, q, k, v, *, scale=None, causal=False, bias=None, window=None,
                        alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, block_q=None,
                        block_kv=None, return_lse=False, num_splits=None):
        """The forward kernels (cuflash.launch.fwd). See Also ``cuflash.tiled_attention``."""
        return fwd.tiled_attention(self._runtime(), q, k, v, scale, causal, block_q, block_kv,
                                   return_lse, num_splits,
                                   features.of(bias, window, alibi_slopes, softcap, dropout_p, seed))

    def tiled_attention_backward(self, do, q, k, v, o, lse, *, scale=None, causal=False,
                                 bias=None, window=None, alibi_slopes=None, softcap=None,
                                 dropout_p=0.0, seed=None, block_q=None, block_kv=None,
                                 deterministic=False, return_dbias=False):
        """The backward kernels (cuflash.launch.bwd). See Also ``cuflash.tiled_attention_backward``."""
        return bwd.tiled_attention_backward(
            self._runtime(), do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic,
            features.of(bias, window, alibi_slopes, softcap, dropout_p, seed), return_dbias)

    def attention_with_kvcache(self, q, k_cache, v_cache, *, cache_seqlens, k_new=None,
                               v_new=None, block_table=None, scale=None, causal=False, bias=None,
                               window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                               seed=None, num_splits=None, return_lse=False, check_inputs=True):
        """The serving kernels (cuflash.launch.serving). See Also ``cuflash.attention_with_kvcache``."""
        return serving.attention_with_kvcache(
            self._runtime(), q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
            causal, num_splits, return_lse, check_inputs,
            features.of(bias, window, alibi_slopes, softcap, dropout_p, seed))

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                         max_seqlen_k=None, scale=None, causal=False, bias=None, window=None,
                         alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                         return_lse=False, check_inputs=True):
        """The serving kernels (cuflash.launch.serving). See Also ``cuflash.varlen_attention``."""
        return serving.varlen_attention(
            self._runtime(), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scale, causal, return_lse, check_inputs,
            features.of(bias, window, alibi_slopes, softcap, dropout_p, seed))

    def varlen_attention_backward(self, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                                  max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                                  bias=None, window=None, alibi_slopes=None, softcap=None,
                                  dropout_p=0.0, seed=None, deterministic=False,
                                  check_inputs=True, return_dbias=False):
        """The backward kernels on packed sequences. See Also ``cuflash.varlen_attention_backward``."""
        return bwd.varlen_attention_backward(
            self._runtime(), do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, scale, causal, deterministic, check_inputs,
            features.of(bias, window, alibi_slopes, softcap, dropout_p, seed), return_dbias)

    def memory_analysis(self, N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None,
                        batch=1, heads=1, num_splits=1, bias_shape=None, window=None):
        """The model with the forward kernel's tiles against the runtime's shared-memory limit.

        That limit is the device's on "cuda", a nominal sm_80's on "emulator".  See Also
        ``cuflash.memory_analysis``; the extra keys are described in
        ``cuflash.launch.fwd.memory_analysis`` and ``cuflash.launch.precompile.memory_analysis``
        (``forward_kernels``, ``backward_kernels``).
        """
        return launch_precompile.memory_analysis(
            self._runtime(), self._reference_model, N, d, dtype, Nk, block_q, block_kv, batch,
            heads, num_splits, bias_shape, window)

    def verify_no_full_materialization(self, q, k, v, block_size):
        """flash_fwd with block_size tiles; the largest intermediate (lse, tiles, copies).

        See Also ``cuflash.reference.verify_no_full_materialization``.
        """
        return fwd.verify_no_full_materialization(self._runtime(), q, k, v, block_size)

    def precompile(self, dtypes=("float16", "bfloat16"), head_dims=(64, 128), *, features=False,
                   progress=None):
        """Compile the default-tile kernels into the runtime's cache now.

        See Also ``cuflash.precompile``.
        """
        return launch_precompile.precompile(self._runtime(), dtypes, head_dims, progress, features)

"""The API functions the two kernel backends share ("cuda" and "emulator").

Each forwards a front call (``cuflash.<name>`` minus ``backend=``) to the launchers
(:mod:`cuflash._launch_fwd`, ``_launch_bwd``, ``_launch_masks``, ``_launch_serving``,
``_launch_softmax``, :mod:`cuflash._precompile`) with its backend's runtime: :func:`api`
makes them for one backend, which puts them into its own namespace next to what differs
(``runtime``, ``is_available``, the standard attention, the memory model's limit).
"""
from . import _launch_bwd, _launch_fwd, _launch_masks, _launch_serving, _launch_softmax, _precompile

NAMES = ("online_softmax", "online_softmax_2d", "tiled_attention", "tiled_attention_backward",
         "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
         "memory_analysis", "verify_no_full_materialization", "precompile")


def _serving_features(bias, window, alibi_slopes, softcap, dropout_p, seed):
    """The logit features of a serving call as keywords, None when it names none."""
    if not _launch_masks.wanted(bias, window, alibi_slopes, softcap, dropout_p, seed):
        return None
    return dict(bias=bias, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                dropout_p=dropout_p, seed=seed)


def api(runtime, limit_text, cache_text):
    """The functions of :data:`NAMES` against ``runtime()`` (called on every call).

    ``limit_text`` says whose shared-memory limit sizes the tiles (memory_analysis's
    docstring), ``cache_text`` where precompile puts the kernels (precompile's).
    """
    def online_softmax(x, chunk_size=None, *, return_stats=False):
        """Kernel online_softmax_rows on one row. See Also ``cuflash.reference.online_softmax``."""
        return _launch_softmax.online_softmax(runtime(), x, chunk_size, return_stats, one_d=True)

    def online_softmax_2d(x, chunk_size=None, *, return_stats=False):
        """Kernel online_softmax_rows, one warp per row. See Also ``cuflash.reference.online_softmax_2d``."""
        return _launch_softmax.online_softmax(runtime(), x, chunk_size, return_stats, one_d=False)

    def tiled_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                        alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, block_q=None,
                        block_kv=None, return_lse=False, num_splits=None):
        """The forward kernels (cuflash._launch_fwd). See Also ``cuflash.tiled_attention``."""
        if _launch_masks.wanted(bias, window, alibi_slopes, softcap, dropout_p, seed):
            return _launch_masks.tiled_attention(
                runtime(), q, k, v, scale, causal, block_q, block_kv, return_lse, bias=bias,
                window=window, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                seed=seed)
        return _launch_fwd.tiled_attention(runtime(), q, k, v, scale, causal, block_q, block_kv,
                                           return_lse, num_splits)

    def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                               block_table=None, scale=None, causal=False, bias=None, window=None,
                               alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                               num_splits=None, return_lse=False, check_inputs=True):
        """The serving kernels (cuflash._launch_serving). See Also ``cuflash.attention_with_kvcache``."""
        return _launch_serving.attention_with_kvcache(
            runtime(), q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, causal,
            num_splits, return_lse, check_inputs,
            _serving_features(bias, window, alibi_slopes, softcap, dropout_p, seed))

    def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                         max_seqlen_k=None, scale=None, causal=False, bias=None, window=None,
                         alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                         return_lse=False, check_inputs=True):
        """The serving kernels (cuflash._launch_serving). See Also ``cuflash.varlen_attention``."""
        return _launch_serving.varlen_attention(runtime(), q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, scale, causal,
                                                return_lse, check_inputs,
                                                _serving_features(bias, window, alibi_slopes,
                                                                  softcap, dropout_p, seed))

    def varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                                  max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                                  bias=None, window=None, alibi_slopes=None, softcap=None,
                                  dropout_p=0.0, seed=None, deterministic=False, check_inputs=True,
                                  return_dbias=False):
        """The backward kernels on packed sequences. See Also ``cuflash.varlen_attention_backward``."""
        features = _serving_features(bias, window, alibi_slopes, softcap, dropout_p, seed)
        if features is not None or return_dbias:
            return _launch_masks.varlen_attention_backward(
                runtime(), do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, scale, causal, deterministic, check_inputs,
                dict(bias=bias, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                     dropout_p=dropout_p, seed=seed), return_dbias)
        return _launch_bwd.varlen_attention_backward(
            runtime(), do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scale, causal, deterministic, check_inputs)

    def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, bias=None,
                                 window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                 seed=None, block_q=None, block_kv=None, deterministic=False,
                                 return_dbias=False):
        """The backward kernels (cuflash._launch_bwd). See Also ``cuflash.tiled_attention_backward``."""
        if return_dbias or _launch_masks.wanted(bias, window, alibi_slopes, softcap, dropout_p, seed):
            return _launch_masks.tiled_attention_backward(
                runtime(), do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic,
                bias=bias, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
        return _launch_bwd.tiled_attention_backward(runtime(), do, q, k, v, o, lse, scale, causal,
                                                    block_q, block_kv, deterministic)

    def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                        heads=1, num_splits=1, bias_shape=None, window=None):
        """The model with the forward kernel's tiles {limit}.

        See Also ``cuflash.memory_analysis``; the extra keys are described in
        ``cuflash._launch_fwd.memory_analysis``, and ``forward_kernels`` /
        ``backward_kernels`` come from :mod:`cuflash._precompile`.
        """
        from ._validate_masks import check_window
        rt = runtime()
        if bias_shape is None and check_window(window) is None:
            window = None  # an unbounded window is no feature: the call runs the plain kernels
        out = _launch_masks.memory_analysis(rt, N, d, dtype, Nk, block_q, block_kv, batch,
                                            heads, num_splits, bias_shape, window)
        masked = bias_shape is not None or window is not None
        dt, splits = out["dtype"], out["num_splits"]
        fwd = _precompile.forward_kernels(rt, out["d"], out["d"], dt, masked=masked,
                                          block_q=block_q, block_kv=block_kv,
                                          num_splits=splits, rows=out["N"])
        bwd = _precompile.backward_kernels(rt, out["d"], out["d"], dt, masked=masked)
        out["forward_kernels"] = [{"kernel": k, "shared_bytes": s} for _, k, _, s in fwd]
        out["backward_kernels"] = [{"kernel": k, "shared_bytes": s} for _, k, _, s in bwd]
        return out

    def verify_no_full_materialization(q, k, v, block_size):
        """flash_fwd with block_size tiles; the largest intermediate (lse, tiles, copies).

        See Also ``cuflash.reference.verify_no_full_materialization``.
        """
        return _launch_fwd.verify_no_full_materialization(runtime(), q, k, v, block_size)

    def precompile(dtypes=("float16", "bfloat16"), head_dims=(64, 128), *, features=False,
                   progress=None):
        """Compile the default-tile kernels {cache}.

        See Also ``cuflash.precompile``.
        """
        return _precompile.precompile(runtime(), dtypes, head_dims, progress, features)

    memory_analysis.__doc__ = memory_analysis.__doc__.replace("{limit}", limit_text)
    precompile.__doc__ = precompile.__doc__.replace("{cache}", cache_text)
    made = locals()
    return {name: made[name] for name in NAMES}

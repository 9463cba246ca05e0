"""Inference shapes in NumPy: split-KV, a KV cache (contiguous or paged), variable-length batches.

* Split-KV (flash-decoding): the keys of a call are cut into ``num_splits``
  ranges of whole key/value tiles whose partial results :func:`combine_splits`
  merges exactly, the same arithmetic as the GPU's, so tests hold the kernels to it.
* ``attention_with_kvcache``: appends ``k_new``/``v_new`` to each sequence's
  cache (the one documented in-place write) and attends over each sequence's
  own ``cache_seqlens[b] + Nnew`` keys, read through ``block_table`` when the
  cache is paged.
* ``varlen_attention`` / ``varlen_attention_backward``: packed sequences
  ``cu_seqlens[b]:cu_seqlens[b+1]``, one attention problem per sequence, no
  padding materialised: the work is the sum of the sequences' own.

The reference loops over sequences in Python (one vectorised flash call each);
the kernels do all sequences in one launch.
"""
from dataclasses import replace

import numpy as np

from .._validate import check_attention_inputs, check_backward_inputs
from .._validate_masks import check_serving_masks, sequence_masks
from .._validate_serving import (check_kvcache_inputs, check_varlen_backward,
                                 check_varlen_inputs, to_host)
from ._common import _compute_dtype, combine_splits, split_ranges
from .flash_backward import _flash_backward, tiled_attention_backward
from .flash_forward import _flash_forward, _resolve_blocks, _workers_for, tiled_attention

__all__ = ["combine_splits", "split_ranges", "attention_with_kvcache", "varlen_attention",
           "varlen_attention_backward", "kv_append_positions"]


def _sequence_forward(q, k, v, scale, causal, ms, num_splits=None):
    """(o, lse) of one sequence, (H, n, d) views; ``ms`` its MaskSpec (sequence_masks) or None."""
    if ms is None:
        return tiled_attention(q, k, v, scale=scale, causal=causal, num_splits=num_splits,
                               return_lse=True)
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    workers = _workers_for(spec, 4.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, None, None, workers)
    return _flash_forward(spec, q, k, v, Br, Bc, workers, ms=ms)


def _sequence_backward(do, q, k, v, o, lse, scale, causal, ms):
    """(dq, dk, dv[, dbias]) of one sequence; ``ms`` its MaskSpec or None."""
    if ms is None:
        return tiled_attention_backward(do, q, k, v, o, lse, scale=scale, causal=causal)
    spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal)
    workers = _workers_for(spec, 10.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, None, None, workers)
    return _flash_backward(spec, do, q, k, v, o, lse, Br, Bc, workers, ms=ms)


# --------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------
def kv_append_positions(spec, seqlens, b):
    """(page or batch index, row) in the cache of new key n = 0..Nnew-1 of sequence b."""
    pos = int(seqlens[b]) + np.arange(spec.Nnew)
    return pos // spec.page_size, pos % spec.page_size


def _sequence_kv(cache, spec, table, b, length):
    """Sequence b's first ``length`` cached rows as (Hk, length, dim): a view, or the pages joined."""
    if not spec.paged:
        return cache[b, :, :length]
    n_pages = -(-length // spec.page_size)
    if n_pages == 0:
        return np.empty((cache.shape[1], 0, cache.shape[3]), cache.dtype)
    pages = [cache[int(table[b, j])] for j in range(n_pages)]           # (Hk, page_size, dim)
    return np.concatenate(pages, axis=1)[:, :length]


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, scale=None, causal=False, bias=None, window=None,
                           alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                           num_splits=None, return_lse=False, check_inputs=True):
    """The NumPy reference of ``cuflash.attention_with_kvcache`` (documented there).

    Appends ``k_new``/``v_new`` into the cache, then one flash forward per
    sequence over its ``cache_seqlens[b] + Nnew`` keys (paged caches: the
    sequence's pages joined in ``block_table`` order), with the logit
    features of that sequence (``cuflash._validate_masks.sequence_masks``).
    """
    # the reference reads cache_seqlens and block_table on the host anyway, so it always checks
    # them: a bad entry raises before anything is written, whatever check_inputs says
    spec = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                scale=scale, causal=causal, num_splits=num_splits,
                                check_inputs=True)
    ms = check_serving_masks(q, spec.B, spec.H, spec.Nq, spec.capacity, bias=bias,
                             window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                             dropout_p=dropout_p, seed=seed)
    seqlens = to_host(cache_seqlens).astype(np.int64)
    table = None if block_table is None else to_host(block_table)
    if spec.Nnew:
        for b in range(spec.B):
            where, rows = kv_append_positions(spec, seqlens, b)
            for n in range(spec.Nnew):
                page = int(table[b, where[n]]) if spec.paged else b
                k_cache[page, :, rows[n]] = k_new[b, :, n]
                v_cache[page, :, rows[n]] = v_new[b, :, n]
    o = np.empty((spec.B, spec.H, spec.Nq, spec.dv), spec.dtype)
    lse = np.empty((spec.B, spec.H, spec.Nq), spec.lse_dtype)
    for b in range(spec.B):
        length = int(seqlens[b]) + spec.Nnew
        kb = _sequence_kv(k_cache, spec, table, b, length)
        vb = _sequence_kv(v_cache, spec, table, b, length)
        ms_b = None if ms is None else sequence_masks(ms, b, spec.Nq, length)
        o[b], lse[b] = _sequence_forward(q[b], kb, vb, spec.scale, spec.causal or False, ms_b,
                                         num_splits)
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------
# variable-length batches
# --------------------------------------------------------------------------
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, scale=None, causal=False, bias=None, window=None,
                     alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                     return_lse=False, check_inputs=True):
    """The NumPy reference of ``cuflash.varlen_attention`` (documented there).

    One flash forward per sequence on (H, n, d) views of the packed arrays:
    nothing is padded, and the work is that of the sequences themselves.
    """
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=True)  # the reference reads the lengths anyway
    ms = check_serving_masks(q, spec.B, spec.H, spec.max_q, spec.max_k, bias=bias,
                             window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                             dropout_p=dropout_p, seed=seed)
    o = np.empty((spec.total_q, spec.H, spec.dv), spec.dtype)
    lse = np.empty((spec.total_q, spec.H), spec.lse_dtype)
    for b in range(spec.B):
        q0, q1 = int(spec.cu_q[b]), int(spec.cu_q[b + 1])
        k0, k1 = int(spec.cu_k[b]), int(spec.cu_k[b + 1])
        if q1 == q0:
            continue
        ms_b = None if ms is None else sequence_masks(ms, b, q1 - q0, k1 - k0)
        ob, lb = _sequence_forward(q[q0:q1].swapaxes(0, 1), k[k0:k1].swapaxes(0, 1),
                                   v[k0:k1].swapaxes(0, 1), spec.scale, spec.causal or False,
                                   ms_b)
        o[q0:q1] = ob.swapaxes(0, 1)
        lse[q0:q1] = lb.swapaxes(0, 1)
    return (o, lse) if return_lse else o


def varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                              bias=None, window=None, alibi_slopes=None, softcap=None,
                              dropout_p=0.0, seed=None, deterministic=False, check_inputs=True,
                              return_dbias=False):
    """The NumPy reference of ``cuflash.varlen_attention_backward`` (documented there)."""
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=True)
    check_varlen_backward(do, q, k, v, o, lse, spec)
    ms = check_serving_masks(q, spec.B, spec.H, spec.max_q, spec.max_k, bias=bias,
                             window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                             dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    dbias = np.zeros(bias.shape, _compute_dtype(spec.dtype)) if return_dbias else None
    dq = np.zeros(q.shape, spec.dtype)
    dk = np.zeros(k.shape, spec.dtype)
    dv = np.zeros(v.shape, spec.dtype)
    lse_c = lse.astype(_compute_dtype(spec.dtype), copy=False)
    for b in range(spec.B):
        q0, q1 = int(spec.cu_q[b]), int(spec.cu_q[b + 1])
        k0, k1 = int(spec.cu_k[b]), int(spec.cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue       # no query rows, or no keys: the gradients stay 0
        t = lambda a, lo, hi: a[lo:hi].swapaxes(0, 1)  # noqa: E731  (H, n, dim) view
        ms_b = None if ms is None else sequence_masks(ms, b, q1 - q0, k1 - k0)
        g = _sequence_backward(t(do, q0, q1), t(q, q0, q1), t(k, k0, k1), t(v, k0, k1),
                               t(o, q0, q1), lse_c[q0:q1].swapaxes(0, 1), spec.scale,
                               spec.causal or False, ms_b)
        dq[q0:q1] = g[0].swapaxes(0, 1)
        dk[k0:k1] = g[1].swapaxes(0, 1)
        dv[k0:k1] = g[2].swapaxes(0, 1)
        if dbias is not None:   # sequence b's share of the (broadcast) bias
            sequence_masks(replace(ms, bias=dbias), b, q1 - q0, k1 - k0).bias[...] += g[3]
    if dbias is not None:
        return dq, dk, dv, dbias.astype(bias.dtype, copy=False)
    return dq, dk, dv

"""Validation of the serving calls: a KV cache (contiguous or paged) and variable-length batches.

Shapes and dtypes are checked for every call (they cost nothing).  The checks
that read index arrays -- ``cu_seqlens`` monotone and ending at the total,
``cache_seqlens`` within the capacity, ``block_table`` entries within the
pages -- need the index values on the host: for CuPy arrays that is one small
device-to-host copy (and a synchronisation) per call, which a decode loop can
skip with ``check_inputs=False``.  The kernels never read or write out of
bounds whatever the index values are (they clamp); unchecked bad indices give
wrong numbers, never a crash.

Every check raises before anything is written (the KV cache is the one array
these calls modify, and only after validation).
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._validate import (_check_arrays, _describe, _library, _LseDtype, check_positive_int,
                        check_scale, parse_causal)

__all__ = ["VarlenSpec", "KVCacheSpec", "check_varlen_inputs", "check_varlen_backward",
           "check_kvcache_inputs", "check_kvcache_shapes", "check_kvcache_values",
           "check_num_splits", "to_host"]


def to_host(a):
    """A NumPy copy of an index array (``.get()`` for CuPy: a device-to-host copy)."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


MAX_SPLITS = 128  # the combine kernel keeps one weight per split in shared memory


def check_num_splits(num_splits):
    """None (let the backend choose) or an int in 1..MAX_SPLITS."""
    n = check_positive_int(num_splits, "num_splits")
    if n is not None and n > MAX_SPLITS:
        raise ValueError(f"num_splits={n}: at most {MAX_SPLITS} key splits are supported")
    return n


def _check_index(name, a, ndim, ref):
    """An int32 index array of ``ndim`` dims in the library of ``ref``."""
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{name} must be an int32 array, got {type(a).__module__}.{type(a).__name__}")
    lib, rlib = _library(a), _library(ref)
    if lib != rlib:
        raise TypeError(f"{name} is a {lib} array but q is a {rlib} array: pass one library")
    if np.dtype(a.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(a.dtype).name} "
                        f"(shape {tuple(a.shape)})")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dim(s), got shape {tuple(a.shape)}")


def _grouping(H, Hk, what):
    if Hk < 1 or H % Hk:
        raise ValueError(f"{what}: the kv heads Hk={Hk} must divide the query heads H={H}")
    return H // Hk


# --------------------------------------------------------------------------
# variable-length (packed) batches
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class VarlenSpec(_LseDtype):
    """A validated varlen call: packed q (total_q, H, d), k (total_k, Hk, d), v (total_k, Hk, dv)."""
    B: int
    H: int
    Hk: int
    group: int
    d: int
    dv: int
    total_q: int
    total_k: int
    max_q: int
    max_k: int
    dtype: np.dtype
    scale: float
    causal: Optional[str]
    lens_q: Optional[np.ndarray]   # host copies when the values were read (None otherwise)
    lens_k: Optional[np.ndarray]
    cu_q: Optional[np.ndarray]
    cu_k: Optional[np.ndarray]


def _check_cu(name, cu, total):
    cu = np.asarray(cu, dtype=np.int64)
    if cu.size == 0 or cu[0] != 0:
        raise ValueError(f"{name} must start at 0 (prefix sums of the sequence lengths), got "
                         f"{cu[:5].tolist()}...")
    if np.any(np.diff(cu) < 0):
        i = int(np.argmax(np.diff(cu) < 0))
        raise ValueError(f"{name} must not decrease: {name}[{i}] = {cu[i]} > "
                         f"{name}[{i + 1}] = {cu[i + 1]}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, ends at {cu[-1]}")
    return np.diff(cu)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                        max_seqlen_k=None, scale=None, causal=False, check_inputs=True):
    """Validate a ``varlen_attention`` call (errors as documented there) and describe it
    (:class:`VarlenSpec`)."""
    _check_arrays((("q", q), ("k", k), ("v", v)))
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 3:
            raise ValueError(f"varlen {name} must be packed (total, heads, dim), got "
                             f"{_describe(name, a)}")
    total_q, H, d = (int(s) for s in q.shape)
    total_k, Hk, dk = (int(s) for s in k.shape)
    if dk != d:
        raise ValueError(f"head dim of q and k differ: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (total_k, Hk):
        raise ValueError(f"v {tuple(v.shape)} must be (total_k, Hk, dv) = ({total_k}, {Hk}, dv) "
                         f"like k {tuple(k.shape)}")
    group = _grouping(H, Hk, "varlen_attention")
    _check_index("cu_seqlens_q", cu_seqlens_q, 1, q)
    _check_index("cu_seqlens_k", cu_seqlens_k, 1, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must both have B + 1 >= 1 entries")
    B = int(cu_seqlens_q.shape[0]) - 1
    mq = check_positive_int(max_seqlen_q, "max_seqlen_q") if max_seqlen_q != 0 else 0
    mk = check_positive_int(max_seqlen_k, "max_seqlen_k") if max_seqlen_k != 0 else 0
    lens_q = lens_k = cu_q = cu_k = None
    if check_inputs or mq is None or mk is None:
        cu_q, cu_k = to_host(cu_seqlens_q).astype(np.int64), to_host(cu_seqlens_k).astype(np.int64)
        lens_q = _check_cu("cu_seqlens_q", cu_q, total_q)
        lens_k = _check_cu("cu_seqlens_k", cu_k, total_k)
        for name, given, lens in (("max_seqlen_q", mq, lens_q), ("max_seqlen_k", mk, lens_k)):
            longest = int(lens.max()) if lens.size else 0
            if given is not None and given < longest:
                b = int(np.argmax(lens))
                raise ValueError(f"{name}={given} is smaller than sequence {b} "
                                 f"(length {longest})")
        mq = int(lens_q.max()) if (mq is None and lens_q.size) else (mq or 0)
        mk = int(lens_k.max()) if (mk is None and lens_k.size) else (mk or 0)
    return VarlenSpec(B=B, H=H, Hk=Hk, group=group, d=d, dv=int(v.shape[2]),
                      total_q=total_q, total_k=total_k, max_q=int(mq), max_k=int(mk),
                      dtype=np.dtype(q.dtype), scale=check_scale(scale, d),
                      causal=parse_causal(causal), lens_q=lens_q, lens_k=lens_k,
                      cu_q=cu_q, cu_k=cu_k)


def check_varlen_backward(do, q, k, v, o, lse, spec):
    """do, o (total_q, H, dv) and lse (total_q, H) consistent with a validated varlen call."""
    _check_arrays((("do", do), ("q", q), ("o", o)))
    want = (spec.total_q, spec.H, spec.dv)
    for name, a in (("do", do), ("o", o)):
        if tuple(a.shape) != want:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want} "
                             "(total_q, H, dv) of the forward")
    if not (hasattr(lse, "shape") and hasattr(lse, "dtype")):
        raise TypeError("lse must be the forward's lse array (varlen_attention(..., "
                        f"return_lse=True)), got {type(lse).__module__}.{type(lse).__name__}")
    if tuple(lse.shape) != (spec.total_q, spec.H):
        raise ValueError(f"lse has shape {tuple(lse.shape)}, expected "
                         f"{(spec.total_q, spec.H)} (total_q, H)")


# --------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheSpec(_LseDtype):
    """A validated ``attention_with_kvcache`` call."""
    B: int
    H: int
    Hk: int
    group: int
    Nq: int
    Nnew: int
    d: int
    dv: int
    paged: bool
    page_size: int      # rows per page (paged), or the capacity (contiguous: one page)
    num_pages: int
    max_pages: int      # pages per sequence (block_table columns), 1 when contiguous
    capacity: int       # keys a sequence can hold
    dtype: np.dtype
    scale: float
    causal: Optional[str]


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None,
                         block_table=None, *, scale=None, causal=False, num_splits=None,
                         check_inputs=True):
    """Validate an ``attention_with_kvcache`` call (errors as documented there) and describe
    it (:class:`KVCacheSpec`): the shapes always (:func:`check_kvcache_shapes`), the index
    values too when ``check_inputs`` (:func:`check_kvcache_values`, a host copy)."""
    spec = check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                                scale=scale, causal=causal, num_splits=num_splits)
    if check_inputs:
        check_kvcache_values(spec, cache_seqlens, block_table)
    return spec


def check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None,
                         block_table=None, *, scale=None, causal=False, num_splits=None):
    """The shape and dtype checks of :func:`check_kvcache_inputs` (no index value read)."""
    if (k_new is None) != (v_new is None):
        raise TypeError("pass both k_new and v_new, or neither")
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    if k_new is not None:
        named += [("k_new", k_new), ("v_new", v_new)]
    _check_arrays(named)
    for name, a in named:
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D, got {_describe(name, a)}")
    B, H, Nq, d = (int(s) for s in q.shape)
    paged = block_table is not None
    n0, Hk, rows, dk = (int(s) for s in k_cache.shape)
    if dk != d:
        raise ValueError(f"head dim of q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)} differ")
    if tuple(v_cache.shape[:3]) != (n0, Hk, rows):
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must match k_cache "
                         f"{tuple(k_cache.shape)} in all but the last dim")
    dv = int(v_cache.shape[3])
    group = _grouping(H, Hk, "attention_with_kvcache")
    _check_index("cache_seqlens", cache_seqlens, 1, q)
    if int(cache_seqlens.shape[0]) != B:
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}, expected ({B},) "
                         f"(one length per sequence of q {tuple(q.shape)})")
    if paged:
        _check_index("block_table", block_table, 2, q)
        if int(block_table.shape[0]) != B:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)}, expected "
                             f"({B}, max_pages)")
        num_pages, page_size, max_pages = n0, rows, int(block_table.shape[1])
        capacity = page_size * max_pages
    else:
        if n0 != B:
            raise ValueError(f"contiguous k_cache {tuple(k_cache.shape)} must be "
                             f"(B={B}, Hk, capacity, d); for a paged cache pass block_table")
        num_pages, page_size, max_pages, capacity = B, rows, 1, rows
    Nnew = 0
    if k_new is not None:
        Nnew = int(k_new.shape[2])
        if tuple(k_new.shape) != (B, Hk, Nnew, d) or tuple(v_new.shape) != (B, Hk, Nnew, dv):
            raise ValueError(f"k_new {tuple(k_new.shape)} / v_new {tuple(v_new.shape)} must be "
                             f"(B, Hk, Nnew, d) = ({B}, {Hk}, Nnew, {d}) / (..., {dv})")
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not getattr(a.flags, "writeable", True):
                raise ValueError(f"{name} is read-only, but k_new/v_new are written into it")
    check_num_splits(num_splits)
    if Nnew > capacity:
        raise ValueError(f"k_new has Nnew = {Nnew} keys, more than the cache holds per sequence "
                         f"({capacity})")
    return KVCacheSpec(B=B, H=H, Hk=Hk, group=group, Nq=Nq, Nnew=Nnew, d=d, dv=dv, paged=paged,
                       page_size=page_size, num_pages=num_pages, max_pages=max_pages,
                       capacity=capacity, dtype=np.dtype(q.dtype), scale=check_scale(scale, d),
                       causal=parse_causal(causal))


def check_kvcache_values(spec, cache_seqlens, block_table):
    """cache_seqlens within the capacity, block-table entries within the pages (host copies)."""
    seqlens = to_host(cache_seqlens).astype(np.int64)
    Nnew, capacity = spec.Nnew, spec.capacity
    bad = np.nonzero(seqlens < 0)[0]
    if bad.size:
        raise ValueError(f"cache_seqlens[{bad[0]}] = {seqlens[bad[0]]} is negative")
    over = np.nonzero(seqlens + Nnew > capacity)[0]
    if over.size:
        b = int(over[0])
        raise ValueError(f"cache_seqlens[{b}] = {seqlens[b]} plus Nnew = {Nnew} new keys "
                         f"exceeds the cache's capacity of {capacity} keys per sequence")
    if spec.paged:
        table = to_host(block_table).astype(np.int64)
        for b in range(spec.B):
            used = -(-(int(seqlens[b]) + Nnew) // spec.page_size)
            ids = table[b, :used]
            wrong = np.nonzero((ids < 0) | (ids >= spec.num_pages))[0]
            if wrong.size:
                j = int(wrong[0])
                raise ValueError(f"block_table[{b}, {j}] = {ids[j]} is not a page of the "
                                 f"cache (0 <= page < {spec.num_pages})")

"""Shared pieces of the NumPy reference: worker threads and BLAS control, dtype
and shape helpers, the causal-range arithmetic, the allocation tracker and
the CPU default tiles.
"""
import contextlib
import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._validate import check_float_dtype, sum_to_shape


# ---------------------------------------------------------------------------
# threads and BLAS
# ---------------------------------------------------------------------------
def _num_workers():
    """Worker threads for the tiled loops: CUFLASH_NUM_THREADS, else the usable cores."""
    env = os.environ.get("CUFLASH_NUM_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_POOL = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _pool(n):
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE != n:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="cuflash")
            _POOL_SIZE = n
        return _POOL


class _OpenBLAS:
    """ctypes handles of the OpenBLAS that NumPy loaded (None where not found).

    NumPy's wheels bundle OpenBLAS with prefixed symbols
    (``scipy_openblas_set_num_threads64_``); a system OpenBLAS has the plain
    names.  We look the library up among the loaded shared objects rather than
    depending on threadpoolctl.
    """
    _NAMES = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
              ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
              ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
              ("openblas_set_num_threads", "openblas_get_num_threads"))

    def __init__(self):
        self.set = self.get = None
        paths = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    p = line.split()[-1] if line.strip() else ""
                    if "openblas" in os.path.basename(p).lower() and p not in paths:
                        paths.append(p)
        except OSError:
            return
        for p in paths:
            try:
                lib = ctypes.CDLL(p)
            except OSError:
                continue
            for sname, gname in self._NAMES:
                s, g = getattr(lib, sname, None), getattr(lib, gname, None)
                if s is not None and g is not None:
                    s.argtypes, s.restype = [ctypes.c_int], None
                    g.argtypes, g.restype = [], ctypes.c_int
                    self.set, self.get = s, g
                    return


_BLAS = None
_BLAS_LOCK = threading.Lock()
_BLAS_USERS = 0
_BLAS_SAVED = None


def _blas():
    global _BLAS
    if _BLAS is None:
        np.ones((2, 2)) @ np.ones((2, 2))  # make sure BLAS is loaded
        _BLAS = _OpenBLAS()
    return _BLAS


def blas_controllable():
    """True when the OpenBLAS thread count can be set (so worker threads help)."""
    return _blas().set is not None


@contextlib.contextmanager
def _blas_single_thread():
    """OpenBLAS at one thread while our worker threads each run their own BLAS calls.

    Measured on the 2-core benchmark machine (sgemm 512x512x64 stacks): two
    worker threads with 1-thread BLAS ran ~105-115 GFLOP/s; two workers on a
    2-thread BLAS oversubscribe (55-85 GFLOP/s); one caller with a 2-thread
    BLAS ~70-90.  The setting is process-wide (OpenBLAS has no per-thread
    count), so nested or concurrent callers share one counter and the last one
    out restores the user's value.
    """
    global _BLAS_USERS, _BLAS_SAVED
    b = _blas()
    if b.set is None:
        yield
        return
    with _BLAS_LOCK:
        if _BLAS_USERS == 0:
            _BLAS_SAVED = b.get()
            b.set(1)
        _BLAS_USERS += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_USERS -= 1
            if _BLAS_USERS == 0:
                b.set(_BLAS_SAVED)


def _run_tasks(fn, tasks, workers):
    """fn(task) for every task, on ``workers`` threads (in order when 1); re-raises errors."""
    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            fn(t)
        return
    with _blas_single_thread():
        futures = [_pool(workers).submit(fn, t) for t in tasks]
        for f in futures:
            f.result()


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------
def _compute_dtype(dtype):
    """float64 for float64 inputs, float32 for float16/bfloat16/float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _dtype_from_name(dtype):
    """numpy dtype (or a stand-in with ``itemsize``/``name``) for memory_analysis."""
    name = dtype if isinstance(dtype, str) else getattr(np.dtype(dtype), "name", str(dtype))
    if name == "bfloat16":
        try:
            import ml_dtypes  # optional: bfloat16 only
            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:  # the analysis needs only the size: 2 bytes
            class _BF16:
                itemsize, name, kind = 2, "bfloat16", "V"
            return _BF16()
    return check_float_dtype(name, "dtype")


def _canonical(spec, q, k, v):
    """Views of q, k, v whose leading dims broadcast under matmul, and the canonical lead.

    Grouped-query heads (H = Hk * group) become two axes: q (..., Hk, group, N, d)
    and k/v (..., Hk, 1, N, d), so one broadcasting matmul serves every query
    head of a key/value head without copying K or V (the kernels do the same by
    index arithmetic).  Returns (q_c, k_c, v_c, lead_c).
    """
    if spec.group > 1:
        g = spec.group
        Hk = spec.kv_lead[-1]
        q_c = q.reshape(q.shape[:-3] + (Hk, g) + q.shape[-2:])
        k_c = k.reshape(_canonical_shape_kv(spec, k))
        v_c = v.reshape(_canonical_shape_kv(spec, v))
        lead_c = spec.lead[:-1] + (Hk, g)
    else:
        q_c, k_c, v_c, lead_c = q, k, v, spec.lead
    return q_c, k_c, v_c, lead_c


def _causal_offset(spec):
    """Query i may see key j iff j <= i + offset (None: no mask)."""
    if spec.causal is None:
        return None
    return spec.Nk - spec.Nq if spec.causal == "bottom_right" else 0


def _kv_range(r0, r1, Nk, Bc, offset):
    """KV tiles [j_lo, j_hi) that query rows [r0, r1) need; tiles past the causal
    boundary are not in the range at all (skipped, never computed)."""
    n_tiles = -(-Nk // Bc)
    if offset is None:
        return 0, n_tiles
    last_key = r1 - 1 + offset          # the last key the last row of the tile may see
    if last_key < 0:
        return 0, 0
    return 0, min(n_tiles, last_key // Bc + 1)


def _tile_mask(r0, r1, c0, c1, offset):
    """Boolean (r1-r0, c1-c0) of *hidden* entries, or None when the tile is fully visible."""
    if offset is None or c1 - 1 <= r0 + offset:
        return None
    i = np.arange(r0, r1)[:, None]
    j = np.arange(c0, c1)[None, :]
    return j > i + offset


# ---------------------------------------------------------------------------
# split-KV: the key ranges of the splits and the exact merge of their partials
# ---------------------------------------------------------------------------
def split_ranges(n_tiles, num_splits):
    """The key/value tile ranges ``[(j0, j1), ...]`` of ``num_splits`` splits of ``n_tiles`` tiles.

    Each split gets ``ceil(n_tiles / num_splits)`` consecutive tiles (the last
    ones may get fewer or none): the kernels split the same way.
    """
    per = -(-n_tiles // num_splits) if n_tiles else 0
    return [(min(s * per, n_tiles), min((s + 1) * per, n_tiles)) for s in range(num_splits)]


def combine_splits(o_parts, lse_parts, out_dtype):
    """Merge split partial results exactly.

    Parameters
    ----------
    o_parts : ndarray, shape (S, ..., Nq, dv)
        Each split's output, normalised over its own keys (0 where it saw none).
    lse_parts : ndarray, shape (S, ..., Nq)
        Each split's log-sum-exp (-inf where it saw no key).
    out_dtype : dtype
        The dtype of the merged output.

    Returns
    -------
    o : ndarray, shape (..., Nq, dv), out_dtype
    lse : ndarray, shape (..., Nq), dtype of lse_parts
        A row no split saw gives o = 0 and lse = -inf.
    """
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = lse_parts.max(axis=0)
        m_safe = np.where(np.isfinite(m), m, 0)
        w = np.exp(lse_parts - m_safe)                      # exp(-inf) = 0 for empty splits
        total = w.sum(axis=0)
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1)), -np.inf)
        o = (w[..., None] * o_parts).sum(axis=0) / np.where(total > 0, total, 1)[..., None]
    return o.astype(out_dtype), lse.astype(lse_parts.dtype)


class _Tracker:
    """Records the largest array (in elements) the instrumented forward creates."""

    def __init__(self):
        self.max_size = 0
        self.lock = threading.Lock()

    def __call__(self, *arrays):
        with self.lock:
            for a in arrays:
                if a is not None and a.size > self.max_size:
                    self.max_size = int(a.size)


def _no_track(*arrays):
    pass


# ---------------------------------------------------------------------------
# block sizes
# ---------------------------------------------------------------------------
# Elements of one S tile stack (batch * Br * Bc) the CPU defaults aim for: big
# enough that each BLAS call and ufunc pass amortises NumPy's per-call overhead,
# small enough that a worker's S tile (4 bytes each) stays in its L2 cache.
# Measured at B*H=8, N=4096, d=64 on the 2-core Xeon of the README: see there.
_CPU_TILE_ELEMS = 1 << 19


def default_blocks(batch, Nq, Nk, d, dv=None, workers=None):
    """The reference's ``(block_q, block_kv)`` when the caller passes None.

    One tile stack (``batch * Br * Bc`` float32 logits) of about 2 MiB
    (``_CPU_TILE_ELEMS``) with Br = Bc = 256 where the batch allows: measured
    on the 2-core Xeon of the README at B*H = 8, N = 2048, d = 64, one thread,
    256x256 took 0.147-0.20 s against 0.16-0.22 s for 128x512, 128x256 and
    192x384 and 0.19-0.23 s for 64x256, 32x512 (smaller tiles pay per-call
    overhead, bigger ones spill the 2 MiB L2).  Br shrinks for large batches
    and so that every worker thread gets at least two query tiles.
    """
    workers = _num_workers() if workers is None else workers
    batch = max(1, int(batch))
    Bc = int(min(max(Nk, 1), 256))
    Br = max(16, _CPU_TILE_ELEMS // (batch * Bc))
    Br = int(min(Br, 256))
    if workers > 1 and Nq > 0:
        # enough query tiles to keep every worker busy to the end
        per = -(-Nq // (2 * workers))
        Br = max(16, min(Br, -(-per // 16) * 16))
    Br = int(min(Br, max(Nq, 1)))
    return Br, Bc


def _reduce_grads(spec, q, k, v, dq, dk, dv_):
    """Sum canonical-shape gradients back to the shapes of q, k, v, in their dtype.

    ``dq`` has the output's leading shape (GQA split into (Hk, group)); ``dk``,
    ``dv_`` have the canonical (broadcast) kv layout.  Each is summed over the
    axes its input was broadcast along (the adjoint of broadcasting).
    """
    dq = sum_to_shape(dq.reshape(spec.lead + q.shape[-2:]), q.shape)
    dk = sum_to_shape(dk, _canonical_shape_kv(spec, k)).reshape(k.shape)
    dv_ = sum_to_shape(dv_, _canonical_shape_kv(spec, v)).reshape(v.shape)
    return (dq.astype(spec.dtype, copy=False), dk.astype(spec.dtype, copy=False),
            dv_.astype(spec.dtype, copy=False))


def _canonical_shape_kv(spec, a):
    """Shape of k or v in the canonical layout (GQA adds a size-1 group axis)."""
    if spec.group > 1 and a.ndim >= 3:
        return a.shape[:-3] + (a.shape[-3], 1) + a.shape[-2:]
    return a.shape

"""The NumPy reference backend (``backend="numpy"``): the algorithm of the seed documents.

Every function of ``docs/api.md`` is defined here with its full documentation;
the dispatching front (``cuflash/__init__.py``) and the other backends refer
to these docstrings.  The notation is the one of the seeds and of the CUDA
kernels, so this file and ``kernels_cu/flash_fwd.cu`` read side by side:

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
"""
import contextlib
import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._validate import (check_attention_inputs, check_backward_inputs,
                        check_float_dtype, check_positive_int)

__all__ = [
    "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "is_available",
    "default_blocks", "tiled_forward_hbm_bytes",
]


def is_available():
    """The NumPy backend runs wherever NumPy imports: ``(True, reason)``."""
    return True, f"NumPy {np.__version__} on the CPU"


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
            import ml_dtypes
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


def _is_blas_ready(a, ct):
    """Can BLAS read this array's matrices directly (right dtype, unit inner stride)?"""
    return a.dtype == ct and (a.shape[-1] <= 1 or a.strides[-1] == a.itemsize)


def sum_to_shape(a, shape):
    """Sum a broadcast result back to ``shape`` (the adjoint of broadcasting).

    Only array methods are used, so the CuPy backend and the kernel launchers
    call this same function on their arrays.
    """
    shape = tuple(shape)
    extra = a.ndim - len(shape)
    if extra:
        a = a.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and a.shape[i] != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return a.reshape(shape)


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


# ---------------------------------------------------------------------------
# online softmax
# ---------------------------------------------------------------------------
def _check_softmax_input(x, chunk_size):
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x must be a numpy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    check_float_dtype(x.dtype, f"x (shape {tuple(x.shape)})")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    return chunk_size


def _online_softmax_rows(x, chunk_size):
    """Row-wise online softmax over the last axis: (p, m, l), stats in float64."""
    M = x.shape[-1]
    lead = x.shape[:-1]
    C = M if chunk_size is None else chunk_size
    C = max(C, 1)
    m = np.full(lead, -np.inf)
    l = np.zeros(lead)
    with np.errstate(invalid="ignore", over="ignore"):
        # one streaming pass: m and l updated chunk by chunk (seed 001)
        for c0 in range(0, M, C):
            xc = np.asarray(x[..., c0:c0 + C], dtype=np.float64)
            m_new = np.maximum(m, xc.max(axis=-1))
            # rows that have seen only -inf keep a shift of 0: never form inf - inf
            m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
            l = l * np.exp(m - m_safe) + np.exp(xc - m_safe[..., None]).sum(axis=-1)
            m = m_new
        m_safe = np.where(np.isneginf(m), 0.0, m)
        l_safe = np.where(l == 0, 1.0, l)
        p = np.exp(np.asarray(x, dtype=np.float64) - m_safe[..., None]) / l_safe[..., None]
    return p.astype(x.dtype, copy=False), m, l


def online_softmax(x, chunk_size=None, *, return_stats=False):
    """Softmax of a 1-D array computed in one streaming pass over chunks.

    The running maximum ``m`` and the running sum ``l = sum(exp(x - m))`` are
    updated chunk by chunk; when a chunk raises the maximum the sum so far is
    rescaled by ``exp(m_old - m_new)`` (seed 001).  The probabilities are then
    ``exp(x - m) / l``.

    Parameters
    ----------
    x : ndarray, shape (N,)
        float16, bfloat16, float32 or float64.  Not modified.
    chunk_size : int, optional
        Elements per chunk; None processes the vector as one chunk.
    return_stats : bool
        Also return the final statistics.

    Returns
    -------
    p : ndarray, shape (N,), dtype of x
        ``softmax(x)``.  If every element is ``-inf`` (or N = 0) p is 0.
    m : numpy.float64
        ``max(x)`` (only with ``return_stats``).
    l : numpy.float64
        ``sum(exp(x - m))`` accumulated chunk by chunk (only with ``return_stats``).

    Raises
    ------
    ValueError
        x not 1-D, or chunk_size not a positive int.
    TypeError
        x not a float array.
    """
    chunk_size = _check_softmax_input(x, chunk_size)
    if x.ndim != 1:
        raise ValueError(f"online_softmax takes a 1-D array, got shape {tuple(x.shape)}; "
                         "use online_softmax_2d for rows")
    p, m, l = _online_softmax_rows(x, chunk_size)
    if return_stats:
        return p, np.float64(m), np.float64(l)
    return p


def online_softmax_2d(x, chunk_size=None, *, return_stats=False):
    """Row-wise online softmax over the last axis of a (..., M) array.

    Every row is processed independently with the algorithm of
    :func:`online_softmax`, all rows at once (chunks run along the last axis).

    Parameters
    ----------
    x : ndarray, shape (..., M)
        At least 1-D; float16, bfloat16, float32 or float64.  Not modified.
    chunk_size : int, optional
        Columns per chunk; None processes each row as one chunk.
    return_stats : bool
        Also return the per-row statistics.

    Returns
    -------
    p : ndarray, shape (..., M), dtype of x
        Each row sums to 1 (rows of only ``-inf`` give 0).
    m : ndarray, shape (...,), float64
        Row maxima (only with ``return_stats``).
    l : ndarray, shape (...,), float64
        Row sums of ``exp(x - m)`` (only with ``return_stats``).
    """
    chunk_size = _check_softmax_input(x, chunk_size)
    if x.ndim < 1:
        raise ValueError(f"online_softmax_2d needs at least 1 dim, got shape {tuple(x.shape)}")
    p, m, l = _online_softmax_rows(x, chunk_size)
    if return_stats:
        return p, m, l
    return p


# ---------------------------------------------------------------------------
# standard attention (materialises P)
# ---------------------------------------------------------------------------
def _standard_probs(spec, q_c, k_c, offset):
    """P = softmax(scale * q @ k^T [masked]) in the compute dtype, shape lead_c + (Nq, Nk)."""
    ct = _compute_dtype(spec.dtype)
    qs = np.multiply(q_c, spec.scale, dtype=ct)
    kt = np.asarray(k_c, dtype=ct)
    S = np.matmul(qs, np.swapaxes(kt, -1, -2))                 # (..., Nq, Nk)
    if offset is not None:
        hidden = _tile_mask(0, spec.Nq, 0, spec.Nk, offset)
        if hidden is not None:
            S[..., hidden] = -np.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        m = S.max(axis=-1, keepdims=True) if spec.Nk else np.zeros(S.shape[:-1] + (1,), ct)
        m = np.where(np.isneginf(m), 0, m)                      # rows that see no key
        S -= m
        np.exp(S, out=S)
        l = S.sum(axis=-1, keepdims=True)
        S /= np.where(l == 0, 1, l)                             # P in place of S
    return S


def standard_attention(q, k, v, *, scale=None, causal=False):
    """Textbook attention that materialises the (Nq, Nk) probabilities.

    ``o = softmax(scale * q @ k^T + mask) @ v`` with the whole logits matrix S
    and probability matrix P in memory (the baseline FlashAttention avoids).

    Parameters
    ----------
    q : ndarray, shape (..., Nq, d)
    k : ndarray, shape (..., Nk, d)
    v : ndarray, shape (..., Nk, dv)
        Leading dims broadcast; grouped-query heads as in ``docs/api.md``.
        One float dtype for all three.  Not modified.
    scale : float, optional
        Logit scale; None means ``1/sqrt(d)``.
    causal : bool or {"bottom_right", "top_left"}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``;
        ``"top_left"``: iff ``j <= i``.

    Returns
    -------
    o : ndarray, shape (..., Nq, dv), dtype of q
        Rows that see no key are 0.
    p : ndarray, shape (..., Nq, Nk), dtype of q
        The attention probabilities (0 for hidden keys and blind rows).

    See Also
    --------
    tiled_attention : the same output without the (Nq, Nk) arrays.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    P = _standard_probs(spec, q_c, k_c, _causal_offset(spec))
    o = np.matmul(P, np.asarray(v_c, dtype=ct))
    o = o.reshape(spec.out_shape).astype(spec.dtype, copy=False)
    p = P.reshape(spec.lead + (spec.Nq, spec.Nk)).astype(spec.dtype, copy=False)
    return o, p


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False):
    """Textbook attention backward that stores P.

    ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(P * dP)``, ``dS = P * (dP - D)``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q`` (seed 000, section 4).

    Parameters
    ----------
    do : ndarray, shape (..., Nq, dv)
        Gradient of the loss with respect to the output.
    q, k, v, scale, causal
        As in :func:`standard_attention`.

    Returns
    -------
    dq : ndarray, shape of q
    dk : ndarray, shape of k
    dv : ndarray, shape of v
        In the inputs' dtype; gradients of broadcast or grouped inputs are
        summed over the axes they were broadcast along.  Rows that see no key
        contribute 0.
    """
    spec = check_backward_inputs(do, q, k, v, None, None, scale=scale, causal=causal)
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    P = _standard_probs(spec, q_c, k_c, _causal_offset(spec))        # stored: (..., Nq, Nk)
    do_c = np.asarray(do, dtype=ct).reshape(lead_c + (spec.Nq, spec.dv))
    kc, vc = np.asarray(k_c, dtype=ct), np.asarray(v_c, dtype=ct)
    qc = np.asarray(q_c, dtype=ct)
    dv_ = np.matmul(np.swapaxes(P, -1, -2), do_c)                    # P^T dO
    dP = np.matmul(do_c, np.swapaxes(vc, -1, -2))                    # dO V^T
    D = np.einsum("...ij,...ij->...i", P, dP)[..., None]             # rowsum(P * dP)
    dS = P * (dP - D)
    del dP
    dq = np.matmul(dS, kc) * spec.scale
    dk = np.matmul(np.swapaxes(dS, -1, -2), qc) * spec.scale
    return _reduce_grads(spec, q, k, v, dq, dk, dv_)


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


# ---------------------------------------------------------------------------
# tiled (flash) attention: forward
# ---------------------------------------------------------------------------
def _resolve_blocks(spec, block_q, block_kv, workers):
    """Explicit sizes honoured as given; None replaced by the CPU defaults."""
    if block_q is not None and block_kv is not None:
        return block_q, block_kv
    Br, Bc = default_blocks(spec.batch, spec.Nq, spec.Nk, spec.d, spec.dv, workers)
    return (Br if block_q is None else block_q), (Bc if block_kv is None else block_kv)


def _workers_for(spec, flops):
    """Threads worth using: 1 for small problems (a task costs ~50 us to hand out)
    or when the BLAS thread count cannot be held at 1 (oversubscription)."""
    if flops < 2e7 or not blas_controllable():
        return 1
    return _num_workers()


# Slack of the lazy rescaling (natural-log units): the shift m_i of a row moves
# only when the row's running maximum leaves [m_i - TAU, m_i + TAU], so exp()
# never sees an argument above TAU (e^8 ~ 3e3: no overflow in float32 sums)
# and the row's largest term is at least e^-TAU (no underflow of l_i).
_RESCALE_SLACK = 8.0
# After a query tile's first key/value tile the max pass is skipped: exp() runs
# on S - m_i at once and the tile's row sums l~ (free from the [V, 1] matmul)
# decide afterwards whether that was safe.  l~ <= e^20 bounds every term by
# e^20 (no overflow, acc stays far from the float32 range); a row that had
# nothing yet must not start below e^-TAU (no underflow).  Otherwise the tile
# is recomputed with the max pass and the shift moves (rare: the running max
# must jump by more than ~20 after the first tile).
_FAST_PATH_LOG_BOUND = 20.0
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def _flash_forward(spec, q, k, v, Br, Bc, workers=1, track=_no_track, stage="whole"):
    """FlashAttention-2 forward over all leading dims at once: returns (o, lse).

    One task per query tile Qi (FA2's outer loop; the tasks run on the thread
    pool); inside, the key/value tiles Kj, Vj stream past with the online
    softmax of seeds 001/004:
        S = Qi Kj^T - m_i;  P~ = exp(S);  l_i += rowsum P~;  acc += P~ Vj
    and at the end O_i = acc / l_i, lse_i = m_i + log l_i.  (The logits are
    carried in base 2, ``log2(e) * scale * q.k``, so ``exp2`` serves as exp.)

    Two CPU-specific devices keep the passes over the (Br, Bc) tile to the
    minimum (one max, one exp; both matmuls in BLAS):

    * the shift is folded into the first matmul: Qi carries an extra column
      ``-m_i`` and Kj an extra column of ones, so ``[Qi, -m_i] @ [Kj, 1]^T``
      is ``S - m_i`` directly; likewise ``P~ @ [Vj, 1]`` yields acc and the
      row sums l_i in one call;
    * lazy rescaling (as in FlashAttention-4): m_i is not forced to equal the
      running maximum; it moves (rescaling acc and l_i by exp(m_old - m_new)
      and shifting the tile) only when the running maximum leaves
      ``[m_i - TAU, m_i + TAU]`` (``_RESCALE_SLACK``).  Softmax is invariant
      to the shift, so the result is the same; ``lse = m_i + log(l_i)`` is
      exact.  With typical logits the shift never moves after the first tile.

    Tiles entirely above the causal boundary are never visited; tiles crossing
    it are masked with -inf.  A row that never sees a key keeps l_i = 0 and
    ends with o = 0, lse = -inf.

    ``stage="whole"`` builds [K, 1] and [V, 1] once per call (O(Nk (d + dv))
    extra memory, shared by all query tiles); ``stage="tile"`` builds them per
    (Qi, Kj) tile in a tile-sized buffer, as the GPU kernel stages tiles in
    shared memory (used by :func:`verify_no_full_materialization`).
    """
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    o = np.empty(spec.out_shape, spec.dtype)
    lse = np.empty(spec.lse_shape, spec.lse_dtype)
    o_c = o.reshape(lead_c + (Nq, dv))
    lse_c = lse.reshape(lead_c + (Nq,))
    offset = _causal_offset(spec)
    scale = spec.scale
    # base-2 logits: exp2 is ~1.5x faster than exp in NumPy (float32, AVX-512), and
    # folding log2(e) into the scale of Qi makes the switch free; m_i is in bits too
    scale2 = scale * _LOG2E
    tau = _RESCALE_SLACK * _LOG2E
    l_hi, l_lo = math.exp(_FAST_PATH_LOG_BOUND), math.exp(-_RESCALE_SLACK)
    if lse.size == 0:                  # no query rows (or an empty batch): nothing to do
        return o, lse
    Kaug = Vaug = None
    if stage == "whole" and Nq and Nk:
        # [K, 1]^T stored transposed, (..., d + 1, Nk): a plain (not transposed) BLAS
        # operand measured 10-25% faster for S = Qi Kj^T than the transposed view
        Kaug = np.empty(k_c.shape[:-2] + (d + 1, Nk), ct)
        np.copyto(Kaug[..., :d, :], np.swapaxes(k_c, -1, -2), casting="unsafe")
        Kaug[..., d, :] = 1
        Vaug = np.empty(v_c.shape[:-1] + (dv + 1,), ct)                 # [V, 1]
        np.copyto(Vaug[..., :dv], v_c, casting="unsafe")
        Vaug[..., dv] = 1
        track(Kaug, Vaug)

    def q_tile(i):
        r0, r1 = i * Br, min(Nq, (i + 1) * Br)
        br = r1 - r0
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            Qa = np.empty(lead_c + (br, d + 1), ct)                         # [Qi, -m_i]
            np.multiply(q_c[..., r0:r1, :], scale2, out=Qa[..., :d], dtype=ct,
                        casting="unsafe")
            Qa[..., d] = 0
            m_i = np.zeros(lead_c + (br,), ct)                              # the shift
            acc = np.zeros(lead_c + (br, dv + 1), ct)                       # [acc, l_i]
            S = np.empty(lead_c + (br, Bc), ct)                             # (..., Br, Bc)
            PV = np.empty(lead_c + (br, dv + 1), ct)
            Kbuf = Vbuf = None
            if Kaug is None:
                Kbuf = np.empty(k_c.shape[:-2] + (d + 1, Bc), ct)           # [Kj, 1]^T
                Kbuf[..., d, :] = 1
                Vbuf = np.empty(v_c.shape[:-2] + (Bc, dv + 1), ct)
                Vbuf[..., dv] = 1
            track(Qa, m_i, acc, S, PV, Kbuf, Vbuf)
            all_seen = False
            _, j_hi = _kv_range(r0, r1, Nk, Bc, offset)
            for j in range(j_hi):
                c0, c1 = j * Bc, min(Nk, (j + 1) * Bc)
                bc = c1 - c0
                if Kaug is not None:
                    KjT, Vj = Kaug[..., c0:c1], Vaug[..., c0:c1, :]
                else:
                    KjT, Vj = Kbuf[..., :bc], Vbuf[..., :bc, :]
                    np.copyto(KjT[..., :d, :], np.swapaxes(k_c[..., c0:c1, :], -1, -2),
                              casting="unsafe")
                    np.copyto(Vj[..., :dv], v_c[..., c0:c1, :], casting="unsafe")
                Sj = S[..., :bc]
                np.matmul(Qa, KjT, out=Sj)             # S - m_i
                hidden = _tile_mask(r0, r1, c0, c1, offset)
                if hidden is not None:                                     # boundary tile
                    track(hidden)
                    Sj[..., hidden] = -np.inf
                l_acc = acc[..., dv]
                if j > 0:
                    # -- fast path: exp straight away; the row sums tell whether it was safe
                    np.exp2(Sj, out=Sj)                                    # P~
                    np.matmul(Sj, Vj, out=PV)                              # [P~ Vj, rowsum P~]
                    l_t = PV[..., dv]
                    if l_t.max() <= l_hi and (all_seen or ((l_acc > 0) | (l_t == 0)
                                                           | (l_t >= l_lo)).all()):
                        acc += PV
                        if not all_seen:
                            all_seen = bool((acc[..., dv] > 0).all())
                        continue
                    # some row's max rose above the slack (or a row's first keys lie far
                    # below its shift): recompute the tile and move those shifts
                    np.matmul(Qa, KjT, out=Sj)
                    if hidden is not None:
                        Sj[..., hidden] = -np.inf
                # -- tile max relative to the shift; move the shift where it left the slack
                t = Sj.max(axis=-1)
                move = (t > tau) | ((l_acc == 0) & (t < -tau) & (t > -np.inf))
                if move.any():
                    delta = np.where(move, t, 0).astype(ct, copy=False)
                    # exp(m_old - m_new); rows with nothing accumulated yet keep acc = 0
                    alpha = np.where(l_acc > 0, np.exp2(-delta), 0).astype(ct, copy=False)
                    acc *= alpha[..., None]
                    Sj -= delta[..., None]
                    m_i += delta
                    Qa[..., d] = -m_i
                np.exp2(Sj, out=Sj)                                        # P~
                np.matmul(Sj, Vj, out=PV)                                  # [P~ Vj, rowsum P~]
                acc += PV
                if not all_seen:   # once every row has mass, the first-contact test is moot
                    all_seen = bool((acc[..., dv] > 0).all())
            l_i = acc[..., dv]
            l_safe = np.where(l_i == 0, 1, l_i)
            np.divide(acc[..., :dv], l_safe[..., None], out=o_c[..., r0:r1, :],
                      casting="unsafe")
            np.add(m_i * _LN2, np.log(l_i), out=lse_c[..., r0:r1], casting="unsafe")

    n_q = -(-Nq // Br) if Nq else 0
    tasks = list(range(n_q))
    if offset is not None:   # causal: the longest tasks first so the threads finish together
        tasks.sort(key=lambda i: -_kv_range(i * Br, min(Nq, (i + 1) * Br), Nk, Bc, offset)[1])
    _run_tasks(q_tile, tasks, workers)
    return o, lse


def tiled_attention(q, k, v, *, scale=None, causal=False, block_q=None, block_kv=None,
                    return_lse=False):
    """FlashAttention forward: exact attention without any (Nq, Nk) array.

    Query tiles ``Qi`` of ``block_q`` (Br) rows, key/value tiles ``Kj``, ``Vj``
    of ``block_kv`` (Bc) rows; for each query tile the key/value tiles stream
    past with the online-softmax update (running max ``m_i``, running sum
    ``l_i``, unnormalised ``acc``), normalised once at the end (seed 004,
    FlashAttention-2).  Tiles entirely above the causal boundary are skipped
    (never computed); tiles crossing it are masked.  The work is vectorised
    over all leading dims and the query tiles run on a small thread pool.

    Parameters
    ----------
    q : ndarray, shape (..., Nq, d)
    k : ndarray, shape (..., Nk, d)
    v : ndarray, shape (..., Nk, dv)
        Leading dims broadcast as in NumPy; grouped-query attention when the
        heads axis (-3) of k/v, Hk, divides q's H and is neither 1 nor H
        (query head h reads kv head ``h // (H // Hk)``).  float16, bfloat16,
        float32 or float64, one dtype for all three.  Not modified;
        non-contiguous arrays are accepted.
    scale : float, optional
        Logit scale; None means ``1/sqrt(d)``.
    causal : bool or {"bottom_right", "top_left"}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``;
        ``"top_left"``: iff ``j <= i``.  A row that sees no key gives o = 0 and
        lse = -inf.
    block_q, block_kv : int, optional
        Br and Bc.  None picks CPU-friendly sizes (:func:`default_blocks`);
        explicit sizes are used as given.
    return_lse : bool
        Also return the row log-sum-exp (what the backward needs).

    Returns
    -------
    o : ndarray, shape (..., Nq, dv), dtype of q
    lse : ndarray, shape (..., Nq), float32 (float64 for float64 inputs)
        Only with ``return_lse``: ``log(sum_j exp(scale * q_i . k_j))`` over
        the visible keys.

    Notes
    -----
    float16/bfloat16/float32 inputs are computed in float32, float64 in
    float64.  Extra memory is O(Br * Bc) per worker thread plus O(Nq) for the
    row statistics: see :func:`memory_analysis` and
    :func:`verify_no_full_materialization`.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                  block_kv=block_kv)
    workers = _workers_for(spec, 4.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, spec.block_q, spec.block_kv, workers)
    o, lse = _flash_forward(spec, q, k, v, Br, Bc, workers)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------
# tiled (flash) attention: backward
# ---------------------------------------------------------------------------
def _flash_backward(spec, do, q, k, v, o, lse, Br, Bc, workers=1):
    """FlashAttention-2 backward (seed 004): P recomputed tile by tile from lse.

    Outer loop over key/value tiles (dK_j, dV_j accumulate in place), inner
    loop over the query tiles that see them:
        S = Qi Kj^T;  P = exp(S - lse_i);  dV_j += P^T dO_i
        dP = dO_i Vj^T;  dS = P * (dP - D_i);  dQ_i += scale dS Kj;  dK_j += dS^T Qi
    with ``D = rowsum(dO * O)`` precomputed and ``Qi`` already holding
    ``scale * q``.  The KV tiles are dealt round-robin to the workers, each
    with its own dQ partial; the partials are summed in worker order, so the
    result is bitwise the same on every run.
    """
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    offset = _causal_offset(spec)
    scale = spec.scale
    do_c = do.reshape(lead_c + (Nq, dv))
    o_c = o.reshape(lead_c + (Nq, dv))
    lse_c = lse.reshape(lead_c + (Nq,))
    dk_c = np.zeros(k_c.shape, ct)
    dv_c = np.zeros(v_c.shape, ct)
    n_q = -(-Nq // Br) if Nq else 0
    n_kv = -(-Nk // Bc) if Nk else 0

    with np.errstate(invalid="ignore"):
        # D = rowsum(dO * O), one row at a time of the output's shape
        D = np.einsum("...ij,...ij->...i", np.asarray(do_c, dtype=ct), np.asarray(o_c, dtype=ct))
        # rows that saw no key: lse = -inf; shifting by +inf makes their P exactly 0
        lse_s = np.asarray(lse_c, dtype=ct)
        lse_s = np.where(np.isneginf(lse_s), np.inf, lse_s)

    def kv_tiles(js):
        dq = np.zeros(lead_c + (Nq, d), ct)
        with np.errstate(invalid="ignore", divide="ignore"):
            for j in js:
                c0, c1 = j * Bc, min(Nk, (j + 1) * Bc)
                bc = c1 - c0
                Kj = np.asarray(k_c[..., c0:c1, :], dtype=ct)
                Vj = np.asarray(v_c[..., c0:c1, :], dtype=ct)
                dK_j = np.zeros(lead_c + (bc, d), ct)
                dV_j = np.zeros(lead_c + (bc, dv), ct)
                # first query tile whose last row may see key c0
                i_lo = 0 if offset is None else max(0, c0 - offset) // Br
                for i in range(i_lo, n_q):
                    r0, r1 = i * Br, min(Nq, (i + 1) * Br)
                    if _kv_range(r0, r1, Nk, Bc, offset)[1] <= j:
                        continue
                    Qi = np.multiply(q_c[..., r0:r1, :], scale, dtype=ct)
                    dOi = np.asarray(do_c[..., r0:r1, :], dtype=ct)
                    S = np.matmul(Qi, np.swapaxes(Kj, -1, -2))            # recompute S
                    hidden = _tile_mask(r0, r1, c0, c1, offset)
                    if hidden is not None:
                        S[..., hidden] = -np.inf
                    S -= lse_s[..., r0:r1, None]
                    P = np.exp(S, out=S)                                  # P = exp(S - lse)
                    dV_j += np.matmul(np.swapaxes(P, -1, -2), dOi)
                    dP = np.matmul(dOi, np.swapaxes(Vj, -1, -2))
                    dP -= D[..., r0:r1, None]
                    dS = np.multiply(P, dP, out=dP)                       # P * (dP - D)
                    dq[..., r0:r1, :] += np.matmul(dS, Kj) * scale
                    dK_j += np.matmul(np.swapaxes(dS, -1, -2), Qi)
                # sum over the heads/batch this kv tile was broadcast to
                dk_c[..., c0:c1, :] = sum_to_shape(dK_j, k_c.shape[:-2] + (bc, d))
                dv_c[..., c0:c1, :] = sum_to_shape(dV_j, v_c.shape[:-2] + (bc, dv))
        return dq

    W = max(1, min(workers, n_kv))
    parts = [None] * W

    def run(w):
        parts[w] = kv_tiles(range(w, n_kv, W))

    _run_tasks(run, list(range(W)), W)
    dq = parts[0]
    for p in parts[1:]:
        dq += p
    return _reduce_grads(spec, q, k, v, dq, dk_c, dv_c)


def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, block_q=None,
                             block_kv=None, deterministic=False):
    """FlashAttention backward: gradients without storing P.

    P is recomputed tile by tile from the forward's ``lse``
    (``P_ij = exp(S_ij - lse_i)``) and the softmax correction uses
    ``D = rowsum(do * o)`` (FlashAttention-2, seed 004).

    Parameters
    ----------
    do : ndarray, shape (..., Nq, dv)
        Gradient of the loss with respect to ``o``; dtype of q.
    q, k, v : ndarray
        The forward's inputs (see :func:`tiled_attention`).
    o : ndarray, shape (..., Nq, dv)
        The forward's output.
    lse : ndarray, shape (..., Nq)
        The forward's log-sum-exp (``tiled_attention(..., return_lse=True)``).
    scale, causal, block_q, block_kv
        As in :func:`tiled_attention` (must match the forward's scale/causal).
    deterministic : bool
        Accepted for API parity; this backend is always deterministic (static
        work split, fixed summation order), so results are bitwise repeatable.

    Returns
    -------
    dq : ndarray, shape of q
    dk : ndarray, shape of k
    dv : ndarray, shape of v
        In the inputs' dtype; dk/dv (and dq) summed over broadcast and grouped
        heads.  Rows that see no key contribute exactly 0.
    """
    spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                 block_q=block_q, block_kv=block_kv)
    workers = _workers_for(spec, 10.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, spec.block_q, spec.block_kv, workers)
    return _flash_backward(spec, do, q, k, v, o, lse, Br, Bc, workers)


# ---------------------------------------------------------------------------
# memory: the model and the instrumented run
# ---------------------------------------------------------------------------
def tiled_forward_hbm_bytes(Nq, Nk, d, dv, itemsize, block_q, block_kv, causal=None,
                            batch=1, lse_itemsize=4):
    """HBM bytes (read, written) of the tiled forward under the traffic model.

    The model (the one the CUDA forward is held to): every query tile reads
    its ``Qi`` once, then the ``Kj`` and ``Vj`` tiles it visits (all of them,
    or only those up to the causal boundary: the skipped tiles are never
    loaded; partial last tiles count their real rows), and writes its ``O_i``
    and ``lse_i`` once.  Returns ``(read_bytes, written_bytes)`` for ``batch``
    independent (batch x heads) problems.

    causal : None, False, True, "bottom_right" or "top_left"
    """
    causal = {False: None, True: "bottom_right"}.get(causal, causal)
    offset = None if causal is None else (Nk - Nq if causal == "bottom_right" else 0)
    kv_rows = 0
    for i in range(-(-Nq // block_q) if Nq else 0):
        r0, r1 = i * block_q, min(Nq, (i + 1) * block_q)
        _, j_hi = _kv_range(r0, r1, Nk, block_kv, offset)
        kv_rows += min(Nk, j_hi * block_kv)
    read = batch * (Nq * d + kv_rows * (d + dv)) * itemsize
    written = batch * Nq * (dv * itemsize + lse_itemsize)
    return read, written


def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                    heads=1):
    """Memory and HBM-traffic model of standard vs tiled attention.

    Parameters
    ----------
    N : int
        Query length Nq.
    d : int
        Head dim (v's head dim is taken equal to d).
    dtype : str or dtype
        Element type of q, k, v, o (S and P are counted in it too, as the
        seed's "2 N^2 sizeof(dtype)").
    Nk : int, optional
        Key length (default N).
    block_q, block_kv : int, optional
        Br and Bc; None uses this backend's defaults (:func:`default_blocks`).
    batch, heads : int
        Independent problems: everything scales by ``batch * heads``.

    Returns
    -------
    dict
        ``standard_extra_bytes``: S and P, ``2 * B * H * N * Nk * itemsize``.
        ``tiled_extra_bytes``: the row statistics m and l (``2 * B * H * N * 4``,
        8 for float64) plus one S/P tile pair (``2 * Br * Bc * itemsize``).
        ``sram_bytes_per_block``: what one thread block holds for its tiles:
        Qi, Kj, Vj in ``dtype``, the S/P tile, the acc tile and m, l in the
        accumulation type (float32; float64 for float64).
        ``standard_hbm_bytes``: reads Q, K (S = QK^T written), reads S (P
        written), reads P, V (O written): ``(2 N d + Nk d + N d) + 4 N Nk``
        elements, times B * H.
        ``tiled_hbm_bytes``: Q read once, K and V once per query tile, O and
        lse written once (:func:`tiled_forward_hbm_bytes`, non-causal).
        Also ``*_read_bytes``/``*_written_bytes`` splits, ``ratio_extra``
        (standard / tiled extra bytes), ``ratio_hbm``, ``block_q``,
        ``block_kv``, ``itemsize`` and the inputs.
    """
    N = check_positive_int(N, "N") if N != 0 else 0
    d = check_positive_int(d, "d")
    Nk = N if Nk is None else (check_positive_int(Nk, "Nk") if Nk != 0 else 0)
    block_q = check_positive_int(block_q, "block_q")
    block_kv = check_positive_int(block_kv, "block_kv")
    batch = check_positive_int(batch, "batch")
    heads = check_positive_int(heads, "heads")
    dt = _dtype_from_name(dtype)
    it = dt.itemsize
    acc_it = 8 if dt.name == "float64" else 4
    BH = batch * heads
    if block_q is None or block_kv is None:
        Br, Bc = default_blocks(BH, max(N, 1), max(Nk, 1), d, d)
        block_q = Br if block_q is None else block_q
        block_kv = Bc if block_kv is None else block_kv
    Br, Bc = block_q, block_kv
    S_bytes = BH * N * Nk * it
    standard_extra = 2 * S_bytes
    stats = 2 * BH * N * acc_it
    tile = 2 * Br * Bc * it
    sram = (Br * d + Bc * d + Bc * d) * it + Br * Bc * acc_it + Br * d * acc_it + 2 * Br * acc_it
    std_read = BH * (N * d + Nk * d + Nk * d) * it + 2 * S_bytes
    std_written = BH * N * d * it + 2 * S_bytes
    t_read, t_written = tiled_forward_hbm_bytes(N, Nk, d, d, it, Br, Bc, None, BH, acc_it)
    tiled_extra = stats + tile
    return {
        "N": N, "Nk": Nk, "d": d, "dtype": dt.name, "itemsize": it, "batch": batch,
        "heads": heads, "block_q": Br, "block_kv": Bc,
        "standard_extra_bytes": standard_extra,
        "standard_S_bytes": S_bytes, "standard_P_bytes": S_bytes,
        "tiled_extra_bytes": tiled_extra,
        "tiled_stats_bytes": stats, "tiled_tile_bytes": tile,
        "sram_bytes_per_block": sram,
        "standard_hbm_read_bytes": std_read, "standard_hbm_written_bytes": std_written,
        "standard_hbm_bytes": std_read + std_written,
        "tiled_hbm_read_bytes": t_read, "tiled_hbm_written_bytes": t_written,
        "tiled_hbm_bytes": t_read + t_written,
        "ratio_extra": standard_extra / tiled_extra if tiled_extra else float("inf"),
        "ratio_hbm": (std_read + std_written) / (t_read + t_written)
        if t_read + t_written else float("inf"),
    }


def verify_no_full_materialization(q, k, v, block_size):
    """Instrumented tiled forward: the output and the largest intermediate it created.

    Runs the same forward as :func:`tiled_attention` (``block_q = block_kv =
    block_size``, one thread) while recording the size of every array the
    algorithm allocates: the scaled query tile, the S/P tile, the acc tile,
    the [Vj, 1] tile, the row statistics of the tile and any causal mask.
    The inputs and the returned output/lse are not intermediates.

    Parameters
    ----------
    q, k, v : ndarray
        As in :func:`tiled_attention` (non-causal, default scale).
    block_size : int
        Br = Bc.

    Returns
    -------
    o : ndarray, shape (..., Nq, dv)
    max_tensor_size : int
        Elements of the largest intermediate array: O(batch * block_size *
        max(block_size, d)), independent of N (an (Nq, Nk) matrix never exists).
    """
    spec = check_attention_inputs(q, k, v, block_q=block_size, block_kv=block_size)
    if block_size is None:
        raise ValueError("block_size must be a positive int, got None")
    track = _Tracker()
    o, _ = _flash_forward(spec, q, k, v, spec.block_q, spec.block_kv, 1, track, stage="tile")
    return o, track.max_size

"""cuflash: exact FlashAttention as CUDA C kernels compiled at run time.

One API, three backends: ``"numpy"`` (the reference, NumPy arrays on the
CPU), ``"cuda"`` (CuPy arrays; the kernels of ``kernels_cu/`` compiled by
NVRTC on first use) and ``"emulator"`` (the same CUDA C executed on the CPU,
for tests and learning).  ``backend=None`` picks from the array type.  Each
function here validates nothing itself: it finds the backend module and calls
it, so the full documentation of every function is here and the backends'
own docstrings describe only how they compute it.

The algorithm is FlashAttention (Dao et al., "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", NeurIPS 2022) in the
loop order of FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning", 2023).
"""
from . import reference  # noqa: F401  (NumPy only; help(cuflash.reference.<name>) after import cuflash)
from ._dispatch import available_backends, get_backend
from .reference.masks import dropout_mask

__version__ = "0.1.0"

__all__ = [
    "available_backends", "get_backend", "precompile",
    "online_softmax", "online_softmax_2d",
    "standard_attention", "standard_attention_backward",
    "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
    "dropout_mask",
]

_INPUTS_DOC = """q : ndarray, shape (..., Nq, d)
    k : ndarray, shape (..., Nk, d)
    v : ndarray, shape (..., Nk, dv)
        NumPy arrays (backends "numpy", "emulator") or CuPy arrays ("cuda"); one
        float dtype for all three: float16, bfloat16 (NumPy: ``ml_dtypes.bfloat16``),
        float32 or float64.  Leading dims broadcast as in NumPy; grouped-query
        attention (GQA/MQA) when the heads axis (-3) of k/v, Hk, divides q's H and
        is neither 1 nor H: query head h reads kv head ``h // (H // Hk)``, with no
        copy of k or v.  Not modified; non-contiguous views are accepted."""

# The logit features mask(scale * Q K^T + bias) of the seed derivation, documented once
# here and inserted into every function that takes causal.
_FEATURES_DOC = """bias : ndarray, optional
        Added to the scaled (and softcapped) logits: any shape that broadcasts to
        ``(..., Nq, Nk)`` with the output's leading dims (a broadcast axis costs no
        memory: the kernels read it with stride 0, tile by tile, never expanded);
        any float dtype, used in float32 (float64 for float64 inputs).  ``-inf``
        entries mask keys; a ``+inf`` or NaN entry makes the rows that see it NaN
        (softmax of a +inf logit is undefined), on every backend, unchecked.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``: query i sees key j iff
        ``i + off - left <= j <= i + off + right`` with ``off = Nk - Nq`` (the
        bottom-right alignment of flash-attn's ``window_size``); None or a
        negative side is unbounded.  Intersected with ``causal`` (with
        ``causal=True`` the right side is 0).  Key tiles outside the band are
        never loaded, so the cost grows with the window, not with Nk.
    alibi_slopes : ndarray, shape (H,) or (B, H), optional
        ALiBi: adds ``-slope[b, h] * |i + off - j|`` to the logits, computed in the
        kernel (no bias tensor).  float32 (float64 inputs: read as float64).
    softcap : float, optional
        ``c > 0``: the scaled logits ``s = scale * q_i . k_j`` become
        ``c * tanh(s / c)`` before bias, ALiBi and masking (as flash-attn).
    dropout_p : float
        Dropout on the attention probabilities, in [0, 1): ``o = (P * keep /
        (1 - dropout_p)) V``, P the softmax (lse is the undropped softmax's).
        ``keep`` comes from a counter-based generator (Philox4x32-10 keyed by
        ``seed`` and indexed by (batch, head, i, j); 16 bits per element, so
        the drop probability is ``round(p * 2**16) / 2**16``, within 2**-17 of
        p), so every backend drops the same elements for the same seed and the
        backward regenerates the mask instead of storing it;
        :func:`dropout_mask` returns it.
    seed : int, optional
        In [0, 2**64); required when ``dropout_p > 0``."""

# Which kernels run, said once and inserted into the functions that run them; the names
# and memory_analysis's shared memory are held to the launches the emulator observes
# (tests/docs/test_docs_kernels.py).
_FWD_KERNELS_NOTE = """Kernels on "cuda" and "emulator" (which models an sm_80 by default): on sm_80 and
    newer, for head dims that are multiples of 16 up to 256, ``flash_fwd_tc`` (float16/bfloat16) or
    ``flash_fwd_tf32`` (float32 as 3xTF32: float32 accuracy) on tensor cores; otherwise
    (float64, other head dims, sm_75) ``flash_fwd`` on the CUDA cores.  A call with any of
    bias, window, alibi_slopes, softcap or dropout_p runs the same choice compiled with
    the features -- ``flash_fwd_tc_masked``, ``flash_fwd_tf32_masked``,
    ``flash_fwd_masked`` -- and never splits the keys.  On an sm_90, plain float16/bfloat16 calls
    with d == dv in 64, 128, 192, 256 (none with ``CUFLASH_WGMMA=0``) and
    block_q None or 128 run ``flash_fwd_wgmma`` (wgmma, TMA, a producer
    warpgroup; sm_90a).  A split-KV call runs
    ``flash_fwd_serving`` and then ``flash_fwd_combine``.  :func:`memory_analysis`
    names a call's kernels and their shared memory."""

_BWD_KERNELS_NOTE = """Kernels on "cuda" and "emulator", three launches: on sm_80 and newer, float16/bfloat16
    with head dims that are multiples of 16 run ``flash_bwd_tc_preprocess``,
    ``flash_bwd_tc`` (tensor cores; ``flash_bwd_tc_masked`` with logit features,
    ``flash_bwd_tc_band`` with a window alone, ``flash_bwd_tc_softcap`` with a softcap and
    at most a window, ``flash_bwd_tc_alibi`` with ALiBi and at most a window,
    ``flash_bwd_tc_dropout`` with dropout and at most a window,
    ``flash_bwd_tc_alibi_dropout`` with ALiBi, dropout and at most a window,
    ``flash_bwd_tc_alibi_softcap`` with ALiBi, a softcap and at most a window at d == dv <= 128) and
    ``flash_bwd_tc_dq_convert``.  Everything else runs ``flash_bwd_preprocess``, then dK
    and dV by ``flash_bwd_tf32`` (float32 on sm_80+ with d, dv multiples of 32 up to 128,
    both dQ paths; ``flash_bwd_tf32_masked`` with features) or ``flash_bwd_dkdv``
    (``flash_bwd_dkdv_masked``), then dQ by ``flash_bwd_dq_convert`` (from float32
    atomics, summed over per-slot slices with ``deterministic=True``) or, for float64 and
    ``deterministic=True`` off ``flash_bwd_tf32``, by the separate pass ``flash_bwd_dq``
    (``flash_bwd_dq_masked``).  On an sm_90, plain float16/bfloat16 calls with d == dv in
    64, 128, 192, 256 (none with ``CUFLASH_WGMMA=0``) that are not ``deterministic`` run
    ``flash_bwd_wgmma`` (wgmma, TMA, a producer warpgroup; sm_90a) between the same preprocess
    and dQ conversion.  ``memory_analysis(...)["backward_kernels"]`` lists them with their
    shared memory."""

_SERVING_KERNELS_NOTE = """Kernel on "cuda" and "emulator": ``flash_fwd_serving`` on the CUDA cores, every dtype
    (``flash_fwd_serving_masked`` with logit features){extra}."""


def precompile(dtypes=("float16", "bfloat16"), head_dims=(64, 128), *, features=False,
               backend=None, progress=None):
    """Compile the kernels of default-tile forward and backward calls ahead of time.

    The first call of a new configuration (dtype, head dim, tiles) compiles its
    kernels (NVRTC through CuPy on a GPU, the host compiler on the emulator)
    and caches them on disk; this fills that cache now -- for a container
    image or a cluster job that should not pay the compile at its first step.
    The modules are compiled concurrently.  Also ``python -m cuflash compile``
    (``--features`` for ``features=True``).

    Covered: :func:`tiled_attention` and :func:`tiled_attention_backward`
    (both dQ paths: ``deterministic`` False and True) at default tiles, and
    so the backward of :func:`varlen_attention`.  Not covered: explicit
    ``block_q``/``block_kv``, split-KV and the serving forwards
    (:func:`attention_with_kvcache`, :func:`varlen_attention`), which compile
    at their first call.

    Parameters
    ----------
    dtypes : sequence of str
        Any of "float16", "bfloat16", "float32", "float64".
    head_dims : sequence of int
        Head dims d (with dv = d).
    features : bool
        Also compile the kernels that calls with logit features run (bias,
        window, alibi_slopes, softcap, dropout_p: one build of each kernel
        serves every feature and combination; the float16/bfloat16 backward
        has six more, ``flash_bwd_tc_band`` for a window alone,
        ``flash_bwd_tc_softcap`` for a softcap and at most a window,
        ``flash_bwd_tc_alibi`` for ALiBi and at most a window,
        ``flash_bwd_tc_dropout`` for dropout and at most a window,
        ``flash_bwd_tc_alibi_dropout`` for ALiBi, dropout and at most a window and
        ``flash_bwd_tc_alibi_softcap`` for ALiBi, a softcap and at most a window):
        ``flash_fwd_tc_masked``, ``flash_bwd_tc_masked`` and the others
        named in :func:`tiled_attention`'s Notes.
    backend : {None, "cuda", "emulator", "numpy"}
        None: "cuda" when a GPU and CuPy are usable here, else a ValueError
        saying why (pass "emulator" to fill the emulator's cache).  "numpy"
        compiles nothing.
    progress : callable(str), optional
        Called with a line before and after compiling.

    Returns
    -------
    dict
        ``backend``, ``seconds`` (wall time) and ``modules``: one entry per
        compiled module with its ``file``, ``kernels`` and ``options``.

    Notes
    -----
    Where the cache lives: on a GPU, CuPy's kernel cache (``$CUPY_CACHE_DIR``,
    default ``~/.cupy/kernel_cache``); on the emulator ``$CUFLASH_CACHE_DIR/emulator``
    (default ``~/.cache/cuflash/emulator``).  A process also keeps compiled
    modules in memory.
    """
    if backend is None:
        ok, why = available_backends()["cuda"]
        if not ok:
            raise ValueError(f"precompile(backend=None) compiles for the GPU, and backend "
                             f"'cuda' is not available here: {why}; pass backend='emulator' "
                             "to fill the emulator's cache")
        backend = "cuda"
    return get_backend(backend).precompile(dtypes, head_dims, features=features,
                                           progress=progress)


def online_softmax(x, chunk_size=None, *, return_stats=False, backend=None):
    """Softmax of a 1-D array computed in one streaming pass over chunks.

    The running maximum ``m`` and the running sum ``l = sum(exp(x - m))`` are
    updated chunk by chunk; when a chunk raises the maximum, the sum so far is
    rescaled by ``exp(m_old - m_new)`` (Milakov & Gimelshein, "Online
    normalizer calculation for softmax", 2018).  The probabilities are then
    ``exp(x - m) / l``.

    Parameters
    ----------
    x : ndarray, shape (N,)
        float16, bfloat16, float32 or float64.  Not modified.
    chunk_size : int, optional
        Elements per chunk; None processes the vector as one chunk.
    return_stats : bool
        Also return the final statistics.
    backend : {None, "numpy", "cuda", "emulator"}
        None picks from the array type.

    Returns
    -------
    p : ndarray, shape (N,), dtype of x
        ``softmax(x)``.  If every element is ``-inf`` (or N = 0) p is 0.
    m : float64 scalar (0-d array on "cuda")
        ``max(x)`` (only with ``return_stats``).
    l : float64 scalar (0-d array on "cuda")
        ``sum(exp(x - m))`` accumulated chunk by chunk (only with ``return_stats``).

    Raises
    ------
    ValueError
        x not 1-D, or chunk_size not a positive int.
    TypeError
        x not a float array.
    """
    return get_backend(backend, x, names="x").online_softmax(x, chunk_size, return_stats=return_stats)


def online_softmax_2d(x, chunk_size=None, *, return_stats=False, backend=None):
    """Row-wise online softmax over the last axis of a (..., M) array.

    Every row is processed independently with the algorithm of
    :func:`online_softmax` (on "cuda"/"emulator": one warp per row).

    Parameters
    ----------
    x : ndarray, shape (..., M)
        At least 1-D; float16, bfloat16, float32 or float64.  Not modified.
    chunk_size : int, optional
        Columns per chunk; None processes each row as one chunk.
    return_stats : bool
        Also return the per-row statistics.
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    p : ndarray, shape (..., M), dtype of x
        Each row sums to 1 (rows of only ``-inf`` give 0).
    m : ndarray, shape (...,), float64
        Row maxima (only with ``return_stats``).
    l : ndarray, shape (...,), float64
        Row sums of ``exp(x - m)`` (only with ``return_stats``).
    """
    return get_backend(backend, x, names="x").online_softmax_2d(x, chunk_size, return_stats=return_stats)


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, backend=None):
    """Textbook attention that materialises the (Nq, Nk) probabilities.

    ``o = softmax(scale * q @ k^T + mask) @ v`` with the whole logits matrix S
    and probability matrix P in memory: the baseline FlashAttention avoids.
    On "cuda" it is plain CuPy (cuBLAS matmuls and a softmax), the code a user
    would write; on "emulator" it is the NumPy reference.

    Parameters
    ----------
    {inputs}
    scale : float, optional
        Logit scale; None means ``1/sqrt(d)``.
    causal : bool or {{"bottom_right", "top_left"}}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``
        (flash-attn >= 2.1); ``"top_left"``: iff ``j <= i`` (PyTorch's
        ``is_causal``).  A row that sees no key gives 0, never NaN.
    {features}
    backend : {{None, "numpy", "cuda", "emulator"}}

    Returns
    -------
    o : ndarray, shape (..., Nq, dv), dtype of q
    p : ndarray, shape (..., Nq, Nk), dtype of q
        The attention probabilities (0 for hidden keys and for rows that see none),
        before dropout.

    See Also
    --------
    tiled_attention : the same output without any (Nq, Nk) array.
    """
    return get_backend(backend, q, k, v, bias, alibi_slopes,
                       names="q k v bias alibi_slopes").standard_attention(
        q, k, v, scale=scale, causal=causal, bias=bias, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, dropout_p=dropout_p, seed=seed)


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, bias=None,
                                window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                seed=None, return_dbias=False, backend=None):
    """Textbook attention backward that stores P.

    ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(P * dP)``, ``dS = P * (dP - D)``,
    ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.

    Parameters
    ----------
    do : ndarray, shape (..., Nq, dv)
        Gradient of the loss with respect to the output; dtype of q.
    q, k, v, scale, causal, bias, window, alibi_slopes, softcap, dropout_p, seed
        As in :func:`standard_attention` (the forward's values).
    return_dbias : bool
        Also return the gradient of ``bias`` (see :func:`tiled_attention_backward`).
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtype of q, k, v; gradients of broadcast or grouped inputs
        are summed over the axes they were broadcast along.  Rows that see no
        key contribute 0.
    dbias : ndarray, shape and dtype of bias
        Only with ``return_dbias``.
    """
    return get_backend(backend, do, q, k, v, bias, alibi_slopes,
                       names="do q k v bias alibi_slopes").standard_attention_backward(
        do, q, k, v, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        return_dbias=return_dbias)


def tiled_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                    alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, block_q=None,
                    block_kv=None, return_lse=False, num_splits=None, backend=None):
    """FlashAttention forward: exact attention without any (Nq, Nk) array.

    Query tiles ``Qi`` of ``block_q`` (Br) rows stay put while key/value tiles
    ``Kj, Vj`` of ``block_kv`` (Bc) rows stream past with the online-softmax
    update (running max ``m_i``, running sum ``l_i``, unnormalised output),
    normalised once at the end.  Tiles entirely above the causal boundary are
    skipped (never loaded); tiles crossing it are masked.

    Parameters
    ----------
    {inputs}
    scale : float, optional
        Logit scale; None means ``1/sqrt(d)``.
    causal : bool or {{"bottom_right", "top_left"}}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``
        (flash-attn >= 2.1); ``"top_left"``: iff ``j <= i`` (PyTorch's
        ``is_causal``).  A row that sees no key gives o = 0 and lse = -inf.
    {features}
    block_q, block_kv : int, optional
        Br and Bc.  None picks good sizes for the backend and problem (the GPU
        kernels: :mod:`cuflash.tiling`, against the device's shared memory);
        explicit sizes are honoured or refused with a ValueError naming the
        budget and the sizes that fit -- never silently changed.
    return_lse : bool
        Also return the row log-sum-exp, which the backward needs.
    num_splits : int, optional
        Split-KV (flash-decoding): the keys are cut into ``num_splits`` ranges
        of whole key/value tiles, each computed by its own thread blocks into a
        partial output (float32; double for float64) and its lse, merged exactly by a combine
        kernel.  It pays when (query tiles x heads x batch) cannot fill the
        GPU, as in decoding (Nq = 1).  None: the backend decides for calls whose
        queries fit one tile (:func:`cuflash.tiling.num_splits_heuristic`, from
        the device's SMs on "cuda" and a nominal sm_80's on "emulator"; "numpy"
        does not split); 1: never split; an int forces that many (the result is
        the same to rounding).
    backend : {{None, "numpy", "cuda", "emulator"}}
        None picks from the array type.

    Returns
    -------
    o : ndarray, shape (..., Nq, dv), dtype of q
        Leading dims: the broadcast of q's and k/v's (GQA: q's).
    lse : ndarray, shape (..., Nq), float32 (float64 for float64 inputs)
        Only with ``return_lse``: ``log(sum_j exp(s_ij))`` over the visible
        keys, with ``s`` the logits after softcap, bias and ALiBi (the
        undropped softmax).

    Raises
    ------
    TypeError
        Non-arrays, integer/bool/complex dtypes, differing dtypes, arrays of
        two libraries (bias and alibi_slopes included).
    ValueError
        Inconsistent shapes (named in the message), unknown ``causal``, bad or
        unsupported tile sizes, a backend that is not available here; a bias
        that does not broadcast to the logits, slopes of the wrong shape, a
        window that is not a pair of ints, softcap <= 0, dropout_p outside
        [0, 1) or without a seed.

    Notes
    -----
    float16/bfloat16/float32 are computed in float32, float64 in float64.
    {fwd_kernels}
    Extra memory is O(Br * Bc) per thread block (or CPU worker) plus O(Nq)
    for the row statistics: see :func:`memory_analysis`.  On "cuda" the first
    call of a configuration compiles its kernels (see :func:`precompile`); a
    later call with the same shapes, strides, dtypes and options skips
    validation, planning and compiling: it allocates the outputs and launches.

    Examples
    --------
    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 8, 100, 64), dtype=np.float32)
    >>> k = v = rng.standard_normal((2, 2, 120, 64), dtype=np.float32)  # GQA, 2 kv heads
    >>> o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True)
    >>> o.shape, lse.shape
    ((2, 8, 100, 64), (2, 8, 100))
    """
    return get_backend(backend, q, k, v, bias, alibi_slopes,
                       names="q k v bias alibi_slopes").tiled_attention(
        q, k, v, scale=scale, causal=causal, bias=bias, window=window, alibi_slopes=alibi_slopes,
        softcap=softcap, dropout_p=dropout_p, seed=seed, block_q=block_q, block_kv=block_kv,
        return_lse=return_lse, num_splits=num_splits)


def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, bias=None,
                             window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                             seed=None, block_q=None, block_kv=None, deterministic=False,
                             return_dbias=False, backend=None):
    """FlashAttention backward: the gradients without storing P.

    P is recomputed tile by tile from the forward's ``lse``
    (``P_ij = exp(s_ij - lse_i)``, ``s`` the logits with their features) and the
    softmax correction uses ``D = rowsum(do * o)`` (FlashAttention-2).  With
    dropout the mask is regenerated from ``seed``, never stored.

    Parameters
    ----------
    do : ndarray, shape (..., Nq, dv)
        Gradient of the loss with respect to ``o``; dtype of q.
    q, k, v : ndarray
        The forward's inputs (see :func:`tiled_attention`).
    o : ndarray, shape (..., Nq, dv)
        The forward's output.
    lse : ndarray, shape (..., Nq)
        The forward's log-sum-exp (``tiled_attention(..., return_lse=True)``);
        any float dtype.
    scale, causal, bias, window, alibi_slopes, softcap, dropout_p, seed, block_q, block_kv
        As in :func:`tiled_attention`; all but the tiles must be the forward's.
    deterministic : bool
        True guarantees bitwise-identical results on every run.  On "cuda" and
        "emulator" the default accumulates dQ with float32 atomics, whose
        summation order varies; the NumPy reference is always deterministic.
        (dbias of a bias broadcast along some axis is always summed with
        atomics on "cuda"/"emulator": its order is not fixed.)
    return_dbias : bool
        Also return ``dbias``: memory O(size of bias).
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtype of q, k, v; dk/dv (and dq) summed over broadcast and
        grouped heads.  Rows that see no key contribute exactly 0.
    dbias : ndarray, shape and dtype of bias
        Only with ``return_dbias``: dS, the gradient of the logits (after the
        softcap), summed over the axes along which the bias was broadcast; 0
        for masked entries.

    Raises
    ------
    TypeError, ValueError
        As :func:`tiled_attention`, plus ``do``/``o``/``lse`` whose shapes do
        not match the forward's (or ``lse`` that is not an array).

    Notes
    -----
    {bwd_kernels}
    """
    return get_backend(backend, do, q, k, v, o, lse, bias, alibi_slopes,
                       names="do q k v o lse bias alibi_slopes").tiled_attention_backward(
        do, q, k, v, o, lse, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        block_q=block_q, block_kv=block_kv, deterministic=deterministic,
        return_dbias=return_dbias)


def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                    heads=1, num_splits=1, bias_shape=None, window=None, backend=None):
    """Memory and HBM-traffic model of standard vs tiled attention.

    Parameters
    ----------
    N : int
        Query length Nq, >= 0 (0 is an empty sequence, which the attention
        calls accept too; negative lengths are refused).
    d : int
        Head dim (v's head dim is taken equal to d).
    dtype : str or dtype
        Element type of q, k, v, o (S and P of the standard algorithm are
        counted in it too: ``2 N^2 sizeof(dtype)``).
    Nk : int, optional
        Key length (default N).
    block_q, block_kv : int, optional
        Br and Bc; None uses the backend's defaults.
    batch, heads : int
        Independent problems: everything scales by ``batch * heads``.
    num_splits : int
        Model a split-KV forward with this many key splits (see
        :func:`tiled_attention`): adds ``split_workspace_bytes`` (the float32
        partials) and the traffic of the split kernels and their combine.
    bias_shape : tuple of int, optional
        Model a call with a bias of this shape (broadcastable to
        ``(batch, heads, N, Nk)``): adds ``bias_bytes`` (the bias in the compute
        type, at its own shape), ``dbias_bytes`` (the backward's accumulator,
        O(size of bias)) and ``bias_hbm_read_bytes`` (one element per visible
        (row, key) and problem, included in ``tiled_hbm_*``).
    window : (int or None, int or None), optional
        Model a sliding window (see :func:`tiled_attention`): ``tiled_hbm_*``
        count only the key/value tiles inside each query tile's band;
        ``visible_fraction`` is the share of (row, key) pairs inside it.
        On "cuda"/"emulator" a bias or a window selects the kernels with the
        logit features (``flash_fwd_tc_masked``, ``flash_fwd_tf32_masked`` or
        ``flash_fwd_masked``, as the call runs them), whose tiles are reported.
        Calls with alibi_slopes, softcap or dropout run the kernels of one
        with a window and a bias (a window alone runs the band-only
        ``flash_bwd_tc_band`` in the float16/bfloat16 backward at d == dv
        <= 128; a softcap with at most a window ``flash_bwd_tc_softcap``
        there, ALiBi with at most a window ``flash_bwd_tc_alibi``, dropout
        with at most a window ``flash_bwd_tc_dropout``, both with at most a
        window ``flash_bwd_tc_alibi_dropout``, ALiBi and a softcap with at
        most a window ``flash_bwd_tc_alibi_softcap``, whose tiles are the band
        build's but at d = 128 on sm_86 (softcap and ALiBi + dropout:
        16 x 128; ALiBi + softcap: 32 x 64), on sm_80 (ALiBi and ALiBi +
        softcap: 64 x 128 only), at d = 32, 64 and 112 (dropout, ALiBi +
        dropout) and at d = 32 and 64 (ALiBi + softcap), which this model
        does not report).
    backend : {None, "numpy", "cuda", "emulator"}
        None is "numpy".  "cuda" uses the tiles the GPU kernel launches with on
        the current device; "emulator" those of a nominal sm_80.

    Returns
    -------
    dict
        ``standard_extra_bytes``: S and P, ``2 * B * H * N * Nk * itemsize``.
        ``tiled_extra_bytes``: the row statistics m and l (``2 * B * H * N * 4``,
        8 for float64) plus one S/P tile pair (``2 * Br * Bc * itemsize``).
        ``sram_bytes_per_block``: the GPU shared memory one thread block of the
        forward kernel uses for these tiles ("cuda"/"emulator"; None on
        "numpy", whose tiles live in CPU caches: its figure is
        ``cpu_tile_bytes_per_worker``, the working set of one worker thread).
        ``standard_hbm_bytes`` / ``tiled_hbm_bytes``: modelled memory traffic
        (tiled: Q read once, K and V once per query tile, O and lse written
        once), with ``*_read_bytes``/``*_written_bytes`` splits, ``ratio_extra``,
        ``ratio_hbm``, ``block_q``, ``block_kv``, ``itemsize`` and the inputs.
        Kernel backends add ``kernel`` (the forward's main kernel),
        ``threads_per_block``, ``sram_layout``, ``sram_limit_bytes`` and where
        that limit comes from, and ``forward_kernels`` / ``backward_kernels``:
        every kernel the forward call (with these tiles and splits) and a
        default-tile backward (``deterministic=False``) launch, in order, as
        ``{"kernel": name, "shared_bytes": n}`` -- the dynamic shared memory
        of each launch.

    Notes
    -----
    It models :func:`tiled_attention` and :func:`tiled_attention_backward`.
    ``num_splits`` is taken as given: ``tiled_attention(num_splits=None)``
    may split a call whose queries fit one tile (decoding), so pass the split
    count to model such a call.  The serving forwards
    (:func:`attention_with_kvcache`, :func:`varlen_attention`) run
    ``flash_fwd_serving`` with tiles of their own.
    """
    return get_backend("numpy" if backend is None else backend).memory_analysis(
        N, d, dtype, Nk=Nk, block_q=block_q, block_kv=block_kv, batch=batch, heads=heads,
        num_splits=num_splits, bias_shape=bias_shape, window=window)


def verify_no_full_materialization(q, k, v, block_size, *, backend=None):
    """Instrumented tiled forward: the output and the largest intermediate it created.

    Runs :func:`tiled_attention` with ``block_q = block_kv = block_size``
    while recording the size of every array the algorithm creates besides its
    outputs (o and the O(Nq) row statistics): tiles, masks, input copies and,
    on the kernel backends, the kernel's shared-memory tiles.

    Parameters
    ----------
    q, k, v : ndarray
        As in :func:`tiled_attention` (non-causal, default scale).
    block_size : int
        Br = Bc.
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    o : ndarray, shape (..., Nq, dv)
    max_tensor_size : int
        Elements of the largest intermediate: O(batch * block_size *
        max(block_size, d)), independent of N (no (Nq, Nk) array ever exists).
    """
    return get_backend(backend, q, k, v, names="q k v").verify_no_full_materialization(q, k, v, block_size)


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None,
                           block_table=None, scale=None, causal=False, bias=None, window=None,
                           alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                           num_splits=None, return_lse=False, check_inputs=True, backend=None):
    """Attention of new queries against a KV cache, contiguous or paged (decoding).

    Each sequence ``b`` has ``cache_seqlens[b]`` valid keys in the cache.  When
    ``k_new``/``v_new`` are given, they are first written into the cache at
    positions ``cache_seqlens[b] ... cache_seqlens[b] + Nnew - 1`` -- the one
    in-place write of cuflash: the caches are modified, nothing else
    (``cache_seqlens`` is not updated; add Nnew yourself).  Then the queries of
    sequence b attend over its ``cache_seqlens[b] + Nnew`` keys.

    Parameters
    ----------
    q : ndarray, shape (B, H, Nq, d)
    k_cache : ndarray, shape (B, Hk, capacity, d), or (num_pages, Hk, page_size, d) when paged
    v_cache : ndarray, shape (B, Hk, capacity, dv), or (num_pages, Hk, page_size, dv)
        One float dtype with q; Hk divides H (grouped-query attention: query
        head h reads kv head ``h // (H // Hk)``).
    cache_seqlens : ndarray of int32, shape (B,)
        Valid keys per sequence before this call.
    k_new, v_new : ndarray, shape (B, Hk, Nnew, d) / (B, Hk, Nnew, dv), optional
        Keys and values appended to the cache (both or neither).
    block_table : ndarray of int32, shape (B, max_pages), optional
        A paged cache: logical page p of sequence b is physical page
        ``block_table[b, p]``; any ``page_size >= 1``.
    scale : float, optional
        None means ``1/sqrt(d)``.
    causal : bool or {"bottom_right", "top_left"}
        Bottom-right relative to each sequence's own length L = cache_seqlens[b]
        + Nnew: query i sees key j iff ``j <= i + L - Nq``.
    bias, window, alibi_slopes, softcap, dropout_p, seed
        The logit features of :func:`tiled_attention`, per sequence: the bias
        broadcasts to ``(B, H, Nq, capacity)`` (key j of sequence b reads
        ``bias[b, h, i, j]``); the window and ALiBi align at ``L - Nq``;
        dropout indexes (b, h, i, j) with j the key's position in the sequence.
        Calls with features do not split the keys.
    num_splits : int, optional
        Split-KV as in :func:`tiled_attention` (None: chosen per call).
    return_lse : bool
        Also return the log-sum-exp, shape (B, H, Nq).
    check_inputs : bool
        Read ``cache_seqlens`` and ``block_table`` on the host to check them
        (on a GPU one small device-to-host copy and a synchronisation per
        call); False skips that, for decode loops.  The kernels never read or
        write out of bounds either way (they clamp); unchecked bad values give
        wrong results, not crashes.  The NumPy backend reads them on the host
        anyway and always checks them.
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    o : ndarray, shape (B, H, Nq, dv)
    lse : ndarray, shape (B, H, Nq) (with ``return_lse``)

    Raises
    ------
    TypeError, ValueError
        Bad shapes or dtypes (int32 required for the index arrays); with
        ``check_inputs``: negative lengths, a length plus Nnew beyond the
        capacity, block-table entries outside the pages.  Nothing is written
        when an error is raised.

    Notes
    -----
    {kvcache_kernels}

    Examples
    --------
    One decode step for two sequences of 5 and 9 cached tokens, appending one
    new token each (grouped-query: 8 query heads, 2 kv heads):

    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> k_cache = np.zeros((2, 2, 16, 64), np.float32); v_cache = np.zeros_like(k_cache)
    >>> lens = np.array([5, 9], np.int32)
    >>> q = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
    >>> k_new = v_new = rng.standard_normal((2, 2, 1, 64), dtype=np.float32)
    >>> o = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
    ...                                    k_new=k_new, v_new=v_new)
    >>> o.shape, bool((k_cache[1, :, 9] == k_new[1, :, 0]).all())
    ((2, 8, 1, 64), True)
    """
    return get_backend(backend, q, k_cache, v_cache, k_new, v_new, bias, alibi_slopes,
                       names="q k_cache v_cache k_new v_new bias alibi_slopes"
                       ).attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new,
        block_table=block_table, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        num_splits=num_splits, return_lse=return_lse, check_inputs=check_inputs)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, scale=None, causal=False, bias=None, window=None,
                     alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None,
                     return_lse=False, check_inputs=True, backend=None):
    """Attention over a batch of sequences of different lengths, packed without padding.

    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v; each is its own attention
    problem (causal per sequence).  No padding is materialised and the work is
    proportional to the sum of the sequences' lengths.

    Parameters
    ----------
    q : ndarray, shape (total_q, H, d)
    k : ndarray, shape (total_k, Hk, d)
    v : ndarray, shape (total_k, Hk, dv)
        Hk divides H (grouped-query attention).
    cu_seqlens_q, cu_seqlens_k : ndarray of int32, shape (B + 1,)
        Prefix sums of the lengths: start at 0, never decrease, end at
        total_q / total_k.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence (sizes the GPU grid); None reads the lengths on
        the host.  A value smaller than a sequence is an error.
    scale, causal
        As in :func:`tiled_attention`; causal is per sequence (bottom-right:
        query i sees key j iff ``j <= i + len_k - len_q``).
    bias, window, alibi_slopes, softcap, dropout_p, seed
        The logit features of :func:`tiled_attention`, per sequence: the bias
        broadcasts to ``(B, H, max_seqlen_q, max_seqlen_k)`` (sequence b's
        logit (h, i, j) reads ``bias[b, h, i, j]``, i and j positions within
        the sequence); the window and ALiBi align at ``len_k - len_q``;
        dropout indexes (b, h, i, j) the same way.
    return_lse : bool
        Also return the log-sum-exp, shape (total_q, H).
    check_inputs : bool
        Check the cu_seqlens values on the host (a device-to-host copy on a
        GPU); False skips it when max_seqlen_q/k are given.
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    o : ndarray, shape (total_q, H, dv)
    lse : ndarray, shape (total_q, H), float32 (float64 for float64 inputs)

    Raises
    ------
    TypeError, ValueError
        cu_seqlens not int32, not starting at 0, decreasing or not ending at
        total_q / total_k; a max_seqlen smaller than a sequence; shapes that
        do not match; bad feature arguments (as in :func:`tiled_attention`).

    Notes
    -----
    {varlen_kernels}

    Examples
    --------
    Three sequences of 3, 0 and 5 tokens in one packed batch:

    >>> import numpy as np, cuflash
    >>> rng = np.random.default_rng(0)
    >>> cu = np.array([0, 3, 3, 8], np.int32)
    >>> q = k = v = rng.standard_normal((8, 4, 32), dtype=np.float32)
    >>> o, lse = cuflash.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    >>> o.shape, lse.shape
    ((8, 4, 32), (8, 4))
    >>> dq, dk, dv = cuflash.varlen_attention_backward(np.ones_like(o), q, k, v, o, lse,
    ...                                                cu, cu, causal=True)
    >>> dq.shape == q.shape
    True
    """
    return get_backend(backend, q, k, v, bias, alibi_slopes,
                       names="q k v bias alibi_slopes").varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        return_lse=return_lse, check_inputs=check_inputs)


def varlen_attention_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, scale=None, causal=False,
                              bias=None, window=None, alibi_slopes=None, softcap=None,
                              dropout_p=0.0, seed=None, deterministic=False, check_inputs=True,
                              return_dbias=False, backend=None):
    """Gradients of :func:`varlen_attention` (dq, dk, dv in the packed layouts).

    Parameters
    ----------
    do : ndarray, shape (total_q, H, dv)
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal
        As in the forward.
    bias, window, alibi_slopes, softcap, dropout_p, seed
        The forward's features.
    o : ndarray, shape (total_q, H, dv)
    lse : ndarray, shape (total_q, H)
        The forward's output and log-sum-exp.
    deterministic : bool
        Bitwise-repeatable gradients (see :func:`tiled_attention_backward`).
    check_inputs : bool
        As in the forward.
    return_dbias : bool
        Also return the gradient of ``bias`` (its shape and dtype).
    backend : {None, "numpy", "cuda", "emulator"}

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes and dtype of q, k, v.  Sequences with no keys get zero gradients.
    dbias : ndarray
        Only with ``return_dbias``.

    Raises
    ------
    TypeError, ValueError
        As in the forward, and o, lse or do whose shapes do not match it.

    Notes
    -----
    Each sequence runs the kernels of :func:`tiled_attention_backward` at their
    default tiles, on views of the packed arrays (no copies); the sequence
    boundaries are read on the host.
    {bwd_kernels}
    """
    return get_backend(backend, do, q, k, v, o, lse, bias, alibi_slopes,
                       names="do q k v o lse bias alibi_slopes").varlen_attention_backward(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, scale=scale, causal=causal, bias=bias, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed,
        deterministic=deterministic, check_inputs=check_inputs, return_dbias=return_dbias)


for _fn in (standard_attention, tiled_attention):
    _fn.__doc__ = _fn.__doc__.replace("{inputs}", _INPUTS_DOC).replace("{{", "{").replace(
        "}}", "}").replace("{features}", _FEATURES_DOC)
tiled_attention.__doc__ = tiled_attention.__doc__.replace("{fwd_kernels}", _FWD_KERNELS_NOTE)
for _fn in (tiled_attention_backward, varlen_attention_backward):
    _fn.__doc__ = _fn.__doc__.replace("{bwd_kernels}", _BWD_KERNELS_NOTE)
attention_with_kvcache.__doc__ = attention_with_kvcache.__doc__.replace(
    "{kvcache_kernels}", _SERVING_KERNELS_NOTE.format(extra=(
        ", after ``flash_kv_append`` has written k_new/v_new into the cache; with more than "
        "one key split, then ``flash_fwd_combine``")))
varlen_attention.__doc__ = varlen_attention.__doc__.replace(
    "{varlen_kernels}", _SERVING_KERNELS_NOTE.format(extra=", one launch for all sequences"))
del _fn

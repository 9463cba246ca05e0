"""Online softmax (one streaming pass over chunks): ``online_softmax``, ``online_softmax_2d``.
"""
import numpy as np

from .._validate import check_softmax_input


def _online_softmax_rows(x, chunk_size):
    """Row-wise online softmax over the last axis: (p, m, l), stats in float64."""
    M = x.shape[-1]
    lead = x.shape[:-1]
    C = M if chunk_size is None else chunk_size
    C = max(C, 1)
    m = np.full(lead, -np.inf)
    l = np.zeros(lead)
    with np.errstate(invalid="ignore", over="ignore"):
        # one streaming pass: m and l updated chunk by chunk
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
    """The NumPy reference of ``cuflash.online_softmax`` (parameters, returns and errors documented there).

    The running maximum ``m`` and the running sum ``l = sum(exp(x - m))`` are
    updated chunk by chunk in float64; when a chunk raises the maximum the sum so
    far is rescaled by ``exp(m_old - m_new)`` (Milakov & Gimelshein 2018).  The
    statistics are returned as ``numpy.float64`` scalars.
    """
    p, m, l = _online_softmax_rows(x, check_softmax_input(x, chunk_size, True))
    if return_stats:
        return p, np.float64(m), np.float64(l)
    return p


def online_softmax_2d(x, chunk_size=None, *, return_stats=False):
    """The NumPy reference of ``cuflash.online_softmax_2d`` (documented there).

    Every row is processed independently with the algorithm of
    :func:`online_softmax`, all rows at once (chunks run along the last axis).
    """
    p, m, l = _online_softmax_rows(x, check_softmax_input(x, chunk_size, False))
    if return_stats:
        return p, m, l
    return p

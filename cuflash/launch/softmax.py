"""Launching ``online_softmax_rows`` (``kernels_cu/online_softmax.cu``) for "cuda" and "emulator".

One warp per row, one streaming pass over chunks of the row; the grid is
``ceil(rows / ONLINE_SOFTMAX_ROWS_PER_BLOCK)`` blocks on the x axis, which
holds 2^31 - 1 of them.
"""
import numpy as np

from .. import kernels, tiling
from .._validate import check_softmax_input
from .common import acc_dtype, alloc_output, elem_strides, launch, pointer_arg, record_copy

__all__ = ["online_softmax_rows", "online_softmax"]


def online_softmax_rows(runtime, x, chunk_size=None):
    """Run online_softmax_rows over the last axis of ``x``: ``(p, m, l)``.

    ``p`` has x's shape and dtype; ``m`` and ``l`` have shape ``x.shape[:-1]``
    and the kernel's statistics dtype (float32, float64 for float64 input).
    ``chunk_size`` None processes each row as one chunk.
    """
    xp = runtime.xp
    t = tiling.kernel_tiling("online_softmax_rows")
    rows_per_block = tiling.ONLINE_SOFTMAX_ROWS_PER_BLOCK
    lead, M = tuple(x.shape[:-1]), int(x.shape[-1])
    stat_dtype = acc_dtype(x.dtype)
    p = alloc_output(xp, x.shape, x.dtype, "p")
    m = alloc_output(xp, lead, stat_dtype, "m")
    l = alloc_output(xp, lead, stat_dtype, "l")
    rows = 1
    for s in lead:
        rows *= int(s)
    if rows == 0:
        return p, m, l
    x2 = x.reshape(rows, M)
    if (M > 1 and x2.strides[-1] != x2.itemsize) or (
            runtime.name == "emulator" and any(st < 0 for st in x2.strides)):
        x2 = xp.ascontiguousarray(x2)
        record_copy("contiguous copy", x2)
    es = elem_strides(x2)
    if es is None:
        x2 = xp.ascontiguousarray(x2)
        es = elem_strides(x2)
    chunk = M if chunk_size is None else int(chunk_size)
    chunk = max(1, min(chunk, 2 ** 31 - 1))
    fn = kernels.get_function(runtime, "online_softmax.cu", "online_softmax_rows",
                              {kernels.dtype_define(x.dtype): None})
    args = (pointer_arg(runtime, x2), p.reshape(rows, M), m.reshape(rows), l.reshape(rows),
            np.int32(rows), np.int32(M), np.int32(chunk), np.int64(es[0]), np.int64(M))
    grid = (-(-rows // rows_per_block),)
    launch(runtime.name, fn, "online_softmax_rows", grid, (t.threads(rows_per_block, 0, 0, 0),),
           args, 0)
    return p, m, l


def _stat_out(xp, a, scalar):
    """Statistics in float64 like the reference (0-d for 1-D input on NumPy: np.float64)."""
    a = a.astype(np.float64)
    if scalar and xp is np:
        return np.float64(a[()])
    return a


def online_softmax(runtime, x, chunk_size, return_stats, one_d):
    """online_softmax / online_softmax_2d through the online_softmax_rows kernel."""
    p, m, l = online_softmax_rows(runtime, x, check_softmax_input(x, chunk_size, one_d))
    if not return_stats:
        return p
    xp = runtime.xp
    return p, _stat_out(xp, m, one_d), _stat_out(xp, l, one_d)

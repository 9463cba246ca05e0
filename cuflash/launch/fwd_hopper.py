"""What the Hopper forward (``flash_fwd_wgmma``, kernels_cu/flash_fwd_wgmma.cu) needs beyond the
dense forward's launch (:func:`cuflash.launch.fwd._build`): the tensor maps its TMA copies read Q,
K and V through.

A tensor map holds an array's address, so it is made for each call's arrays; the last few are
kept by address (a training loop reuses its buffers, and a map of the same address, shapes and
strides is the same map).  The maps describe each input as the launcher's flattened problem,
(batch, heads, rows, head dim) with the element strides :func:`~cuflash.launch.common.flatten_lead`
found, so strided views are read in place; the copy engine needs every stride of an axis longer
than one to be a positive multiple of 16 bytes (:func:`tma_layout_ok`), and the launcher makes
contiguous copies of inputs that are not (a broadcast along heads or batch, say).
"""
from .tma import tensor_map

__all__ = ["HopperMaps", "tma_layout_ok", "Q_ROWS_PER_BOX"]

# Q is loaded in boxes of 64 rows (one consumer warpgroup's rows) x 64 columns (128 bytes: the
# 128-byte swizzle); K and V in boxes of block_kv rows x 64 columns.
Q_ROWS_PER_BOX = 64
BOX_COLS = 64


def _problem(shape_bh, rows, cols, strides):
    """(shape, element strides) of an input as (batch, heads, rows, cols), with the stride of an
    axis of length one set to a valid one (the copy engine reads it, never steps along it)."""
    (B, H), (sb, sh, sr) = shape_bh, strides
    sh = sh if H > 1 else rows * sr
    sb = sb if B > 1 else H * sh
    return (B, H, rows, cols), (sb, sh, sr, 1)


def tma_layout_ok(shape_bh, rows, strides, itemsize):
    """Whether the copy engine can read an input with these element strides (batch, head, row)
    in place: each stride of an axis longer than one positive and a multiple of 16 bytes."""
    (B, H), (sb, sh, sr) = shape_bh, strides
    return all(n <= 1 or (s > 0 and (s * itemsize) % 16 == 0)
               for n, s in ((B, sb), (H, sh), (rows, sr)))


class HopperMaps:
    """The tensor maps of one prepared forward call: ``maps(q, k, v)`` -> (map_q, map_k, map_v).

    ``dims``: ((B, H) of q, (B, Hk) of k and v), the row counts (Nq, Nk) and the head dim;
    ``strides``: the (batch, head, row) element strides of q, k and v.
    """

    def __init__(self, runtime, dims, rows, d, strides, block_kv, keep=4):
        self.runtime = runtime
        (bh_q, bh_kv), (nq, nk) = dims, rows
        self._q = _problem(bh_q, nq, d, strides[0])
        self._k = _problem(bh_kv, nk, d, strides[1])
        self._v = _problem(bh_kv, nk, d, strides[2])
        self._box_q = (1, 1, Q_ROWS_PER_BOX, BOX_COLS)
        self._box_kv = (1, 1, block_kv, BOX_COLS)
        self._keep = keep
        self._made = {}

    def __call__(self, q, k, v):
        key = tuple(_address(self.runtime, x) for x in (q, k, v))
        got = self._made.get(key)
        if got is None:
            rt = self.runtime
            got = (tensor_map(rt, q, self._box_q, swizzle=128, shape=self._q[0], strides=self._q[1]),
                   tensor_map(rt, k, self._box_kv, swizzle=128, shape=self._k[0], strides=self._k[1]),
                   tensor_map(rt, v, self._box_kv, swizzle=128, shape=self._v[0], strides=self._v[1]))
            if len(self._made) >= self._keep:
                self._made.pop(next(iter(self._made)))
            self._made[key] = got
        return got


def _address(runtime, x):
    return x.data.ptr if runtime.name == "cuda" else x.ctypes.data

"""What the Hopper kernels (``flash_fwd_wgmma``, ``flash_bwd_wgmma``: kernels_cu/flash_*_wgmma.cu)
need beyond the launches of their families (:mod:`cuflash.launch.fwd`, :mod:`cuflash.launch.bwd_tc`):
the tensor maps their TMA copies read Q, K, V (and dO) through.

A tensor map holds an array's address, so it is made for each call's arrays; the last few are
kept by address (a training loop reuses its buffers, and a map of the same address, shapes and
strides is the same map).  The maps describe each input as the launcher's flattened problem,
(batch, heads, rows, head dim) with the element strides :func:`~cuflash.launch.common.flatten_lead`
found, so strided views are read in place; the copy engine needs every stride of an axis longer
than one to be a positive multiple of 16 bytes (:func:`tma_layout_ok`), and the launchers make
contiguous copies of inputs that are not (a broadcast along heads or batch, say:
:func:`materialised`).
"""
from .common import data_ptr
from .tma import tensor_map

__all__ = ["HopperMaps", "tma_layout_ok", "materialised", "Q_ROWS_PER_BOX"]

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
    """The tensor maps of one prepared call: ``maps(*arrays)`` -> one map per array.

    ``inputs``: per array, ``((B, H), rows, cols, (batch, head, row) element strides, box
    rows)`` of the problem it is read as; boxes are ``box rows`` x 64 columns (128 bytes: the
    128-byte swizzle).
    """

    def __init__(self, runtime, inputs, keep=4):
        self.runtime = runtime
        self._specs = [(_problem(bh, rows, cols, strides), (1, 1, box_rows, BOX_COLS))
                       for bh, rows, cols, strides, box_rows in inputs]
        self._keep = keep
        self._made = {}

    def __call__(self, *arrays):
        key = tuple(data_ptr(x) for x in arrays)
        got = self._made.get(key)
        if got is None:
            got = tuple(tensor_map(self.runtime, x, box, swizzle=128, shape=shape, strides=strides)
                        for x, ((shape, strides), box) in zip(arrays, self._specs))
            if len(self._made) >= self._keep:
                self._made.pop(next(iter(self._made)))
            self._made[key] = got
        return got


def materialised(xp, arrays, record):
    """Contiguous copies of ``(array, full shape)`` pairs, broadcast axes written out (the copy
    engine steps no stride of 0); ``record(what, copy)`` for each copy made."""
    out = []
    for x, shape in arrays:
        c = xp.ascontiguousarray(xp.broadcast_to(x, shape))
        if data_ptr(c) != data_ptr(x):
            record("copy for the tensor maps", c)
        out.append(c)
    return out

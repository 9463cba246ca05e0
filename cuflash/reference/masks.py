"""The logit features of ``P = mask(scale * Q K^T + bias)`` in the NumPy reference.

One place for what the standard and the tiled algorithms share, tile by tile: the
Philox4x32-10 dropout mask (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3",
SC 2011; bit-identical to ``kernels_cu/philox.cuh``, so every backend drops the same
elements) and :class:`Features`, a call's features in the reference's canonical layout
with the per-tile transforms.  The helpers use only array methods and ``xp`` functions
where they serve the "cuda" backend's standard attention (CuPy) too.
"""
import numpy as np

from .. import tiling
from .._validate_masks import check_dropout, check_window, dropout_threshold, visible_range

__all__ = ["philox4x32_10", "dropout_keep", "dropout_mask", "Features", "kv_tile_bounds",
           "problem_index", "memory_features"]

# Philox4x32 constants (Random123): round multipliers and the Weyl key increments
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10


def philox4x32_10(c0, c1, c2, c3, k0, k1, xp=np):
    """Philox4x32-10 of counters (c0, c1, c2, c3) under key (k0, k1): four uint32 arrays.

    Arguments broadcast against each other (ints or integer arrays, taken
    modulo 2^32).  Each round multiplies c0 and c2 by the Philox constants
    (64-bit products split into high and low halves) and mixes:
    ``(hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))``;
    the key grows by the Weyl constants between rounds.
    """
    u32, u64 = xp.uint32, xp.uint64
    shape = np.broadcast_shapes(*[np.shape(c) for c in (c0, c1, c2, c3)])
    c = [xp.broadcast_to(xp.asarray(x, dtype=u64) & u64(0xFFFFFFFF), shape) for x in
         (c0, c1, c2, c3)]
    c = [x.astype(u64) for x in c]
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    m0, m1, lo32 = u64(_M0), u64(_M1), u64(0xFFFFFFFF)
    for _ in range(_ROUNDS):
        p0 = c[0] * m0                       # < 2^64: exact in uint64
        p1 = c[2] * m1
        c = [(p1 >> u64(32)) ^ c[1] ^ u64(k0), p1 & lo32,
             (p0 >> u64(32)) ^ c[3] ^ u64(k1), p0 & lo32]
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return tuple(x.astype(u32) for x in c)


def dropout_keep(b, h, i, c0, c1, seed, p, xp=np):
    """Keep-mask of keys ``c0 <= j < c1`` for problem indices b, h and rows i.

    ``b``, ``h`` broadcast against each other (shape ``lead``); ``i`` is a 1-D
    array of rows.  Returns bool of shape ``broadcast(b, h) + (len(i), c1 - c0)``.
    Element (b, h, i, j) is the 16-bit half ``j % 2`` (low half for even j) of
    word ``2 * ((i >> 3) & 1) + ((j >> 3) & 1)`` of the Philox block at counter
    ``(4 * (j >> 4) + ((j >> 1) & 3), 8 * (i >> 4) + (i & 7), h, b)``: one block
    serves rows {i, i + 8} x keys {2t, 2t + 1, 2t + 8, 2t + 9} of a 16 x 16 tile,
    the eight logits one lane of the tensor-core kernels holds.
    """
    b = xp.asarray(b, dtype=xp.int64)
    h = xp.asarray(h, dtype=xp.int64)
    lead = np.broadcast_shapes(b.shape, h.shape)
    i = xp.asarray(i, dtype=xp.int64)
    if c1 <= c0 or i.size == 0:
        return xp.zeros(lead + (int(i.size), max(c1 - c0, 0)), dtype=bool)
    j = xp.arange(c0, c1, dtype=xp.int64)
    rc = ((i >> 4) << 3) | (i & 7)                          # row counters
    kc = ((j >> 4) << 2) | ((j >> 1) & 3)                   # key counters
    r_lo, k_lo = int(rc.min()), int(kc.min())
    rows = xp.arange(r_lo, int(rc.max()) + 1, dtype=xp.int64)
    keys = xp.arange(k_lo, int(kc.max()) + 1, dtype=xp.int64)
    ex = (Ellipsis, None, None)
    words = philox4x32_10(keys, rows[:, None], h[ex], b[ex], seed & 0xFFFFFFFF, seed >> 32, xp=xp)
    w = xp.stack(words, axis=-1)                            # (..., row ctrs, key ctrs, 4)
    word = 2 * ((i[:, None] >> 3) & 1) + ((j[None, :] >> 3) & 1)
    x = w[..., (rc - r_lo)[:, None], (kc - k_lo)[None, :], word]   # (..., len(i), c1 - c0)
    half = xp.where((j & 1).astype(bool), x >> xp.uint32(16), x & xp.uint32(0xFFFF))
    return half >= xp.uint32(dropout_threshold(p))


def problem_index(lead, xp=np):
    """(b, h) index arrays of shape ``lead``: b flat over ``lead[:-1]``, h over ``lead[-1]``.

    The dropout generator is indexed by these (the kernels' (batch, head)
    problem grid); plain 2-D inputs are problem (0, 0).
    """
    lead = tuple(int(s) for s in lead)
    if not lead:
        return xp.zeros((), xp.int64), xp.zeros((), xp.int64)
    H = lead[-1]
    n = 1
    for s in lead:
        n *= s
    flat = xp.arange(n, dtype=xp.int64).reshape(lead)
    return flat // H, flat % H


def dropout_mask(shape, p, seed):
    """The dropout keep-mask that every backend draws for logits of ``shape`` (for tests).

    Parameters
    ----------
    shape : tuple of int
        ``lead + (Nq, Nk)``: the output's leading dims and the logits' shape.
    p : float
        Dropout probability in [0, 1).
    seed : int
        In [0, 2^64).

    Returns
    -------
    keep : ndarray of bool, shape ``shape``
        True where the probability is kept (and scaled by 1/(1-p)).  Element
        (..., i, j) of problem (b, h) (b the flat index over ``shape[:-3]``, h
        over ``shape[-3]``) is kept iff a 16-bit number drawn by Philox4x32-10
        with key ``(seed % 2^32, seed // 2^32)`` at a counter made of
        (b, h, i, j) is at least ``round(p * 2^16)``: a function of the logical
        index alone, so every backend and every tile size drops the same
        elements.  The bit layout is in the source tree's ``docs/kernels.md``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"dropout_mask needs a shape (..., Nq, Nk), got {shape}")
    p, seed = check_dropout(p, seed)
    if seed is None:
        raise ValueError("dropout_mask needs a seed (an int)")
    b, h = problem_index(shape[:-2])
    return dropout_keep(b, h, np.arange(shape[-2]), 0, shape[-1], seed, p)


def kv_tile_bounds(spec, ms, r0, r1, Bc):
    """KV tiles [j_lo, j_hi) that query rows [r0, r1) need (causal and window)."""
    Nk = spec.Nk
    n_tiles = -(-Nk // Bc) if Nk else 0
    if r1 <= r0:
        return 0, 0
    lo, hi = visible_range(np.arange(r0, r1), spec.Nq, Nk, spec.causal, ms)
    seen = lo < hi
    if not seen.any():
        return 0, 0
    return int(lo[seen].min()) // Bc, min(n_tiles, -(-int(hi[seen].max()) // Bc))


class Features:
    """A call's features in the reference's canonical layout (see ``_common._canonical``).

    ``lead_c`` is the canonical leading shape: the output's lead, with the heads
    axis split into (Hk, group) for grouped-query attention.  The bias becomes
    ``bias_c`` (broadcastable to ``lead_c + (Nq, Nk)``), the ALiBi slopes
    ``slopes_c`` (broadcastable to ``lead_c``), and the dropout index arrays
    ``b_c``, ``h_c`` (shape ``lead_c``).
    """

    def __init__(self, spec, ms, lead_c, ct, bias=None, slopes=None, xp=np):
        self.spec, self.ms, self.lead_c, self.xp = spec, ms, tuple(lead_c), xp
        self.ct = np.dtype(ct).type         # the compute dtype's scalar type
        self.Nq, self.Nk = spec.Nq, spec.Nk
        self.bias_c = None if bias is None else self._canonical(bias, trailing=2)
        self.slopes_c = None if slopes is None else self._canonical(slopes, trailing=0)
        if ms.dropout:
            b, h = problem_index(spec.lead, xp)
            b = b + ms.dropout_batch
            self.b_c, self.h_c = b.reshape(self.lead_c), h.reshape(self.lead_c)

    def _canonical(self, a, trailing):
        """``a`` (broadcastable to ``lead + trailing dims``) reshaped to the canonical lead."""
        spec, xp = self.spec, self.xp
        nl = len(spec.lead)
        a = xp.asarray(a)
        a = a.reshape((1,) * (nl + trailing - a.ndim) + tuple(a.shape))
        if spec.group > 1:                                   # split heads H -> (Hk, group)
            ax = nl - 1
            heads = a.shape[ax]
            split = (1, 1) if heads == 1 else (heads // spec.group, spec.group)
            a = a.reshape(a.shape[:ax] + split + a.shape[ax + 1:])
        return a

    def canonical_bias_shape(self):
        return tuple(self.bias_c.shape)

    def rows_cols(self, r0, r1, c0, c1):
        """Index slices of the bias for rows [r0, r1) and keys [c0, c1) (size-1 axes whole)."""
        bs = self.bias_c.shape
        rs = slice(r0, r1) if bs[-2] != 1 else slice(None)
        cs = slice(c0, c1) if bs[-1] != 1 else slice(None)
        return rs, cs

    def hidden(self, r0, r1, c0, c1):
        """Bool (r1-r0, c1-c0) of hidden entries (causal and window), or None if all visible."""
        xp = self.xp
        lo, hi = visible_range(np.arange(r0, r1), self.Nq, self.Nk, self.spec.causal, self.ms)
        if (lo <= c0).all() and (hi >= c1).all():
            return None
        j = np.arange(c0, c1)[None, :]
        return xp.asarray((j < lo[:, None]) | (j >= hi[:, None]))

    def transform(self, S, r0, r1, c0, c1, unit=1.0):
        """Softcap, bias and ALiBi on the logits tile ``S`` (natural units), in place.

        ``S`` holds ``scale * Qi Kj^T`` for rows [r0, r1) and keys [c0, c1) over
        ``lead_c``.  With ``unit != 1`` the bias and ALiBi terms are added times
        ``unit`` (the tiled forward carries base-2 logits: unit = log2(e)); the
        softcap needs natural-unit logits (the caller guarantees them).
        Returns ``tanh(s / c)`` of the softcap (for its derivative) or None.
        """
        xp, ms, ct = self.xp, self.ms, self.ct
        th = None
        if ms.softcap is not None:
            c = ct(ms.softcap)
            th = xp.tanh(S / c)
            xp.multiply(th, c, out=S)
        if self.bias_c is not None:
            rs, cs = self.rows_cols(r0, r1, c0, c1)
            tile = self.bias_c[..., rs, cs]
            if unit != 1.0:
                S += tile.astype(ct) * ct(unit)
            else:
                S += tile.astype(ct)
        if self.slopes_c is not None:
            i = xp.arange(r0, r1, dtype=ct)[:, None]
            j = xp.arange(c0, c1, dtype=ct)[None, :]
            dist = xp.abs(i + ct(ms.offset) - j)                  # |i + Nk - Nq - j|
            slopes = self.slopes_c.astype(ct) * ct(-unit)
            S += slopes[..., None, None] * dist
        return th

    def keep(self, r0, r1, c0, c1):
        """The dropout keep-mask of the tile, shape lead_c + (r1-r0, c1-c0)."""
        xp = self.xp
        return dropout_keep(self.b_c, self.h_c, xp.arange(r0, r1), c0, c1, self.ms.seed,
                            self.ms.dropout_p, xp=xp)

    def dropped(self, P, r0, r1, c0, c1, keep=None):
        """``P * keep / (1 - p)`` (a new array) for the tile."""
        keep = self.keep(r0, r1, c0, c1) if keep is None else keep
        return self.xp.where(keep, P * self.ct(self.ms.drop_scale), self.ct(0))


def memory_features(out, bias_shape=None, window=None):
    """Add what a bias and a sliding window cost to a ``memory_analysis`` dict (in place).

    * ``bias_bytes``: the bias as the kernels read it (compute type: 4 bytes,
      8 for float64), at its own (broadcast) shape -- never expanded;
    * ``dbias_bytes``: the accumulator of a backward with ``return_dbias``
      (the bias's shape, compute type): O(size of bias);
    * ``bias_hbm_read_bytes``: the tiled forward reads one bias element per
      visible (row, key) of every problem (broadcast axes are re-read, from
      L2 on a GPU); the standard algorithm reads the bias once;
    * the window: ``tiled_hbm_*`` count only the K/V tiles inside each query
      tile's band (:func:`cuflash.tiling.flash_fwd_masked_traffic`), so they
      grow with the window, not with Nk.  The standard algorithm is unchanged.
    """
    N, Nk, d = out["N"], out["Nk"], out["d"]
    B, H = out["batch"], out["heads"]
    acc = 8 if out["dtype"] == "float64" else 4
    window = check_window(window)
    if out.get("num_splits", 1) > 1:
        raise ValueError("memory_analysis: bias_shape/window with num_splits > 1: calls with "
                         "these features do not split the keys")
    n_bias = 0
    if bias_shape is not None:
        bias_shape = tuple(int(s) for s in bias_shape)
        full = (B, H, N, Nk)
        try:
            ok = tuple(np.broadcast_shapes(bias_shape, full)) == full
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"bias_shape {bias_shape} does not broadcast to the logits' shape "
                             f"(batch, heads, N, Nk) = {full}")
        n_bias = int(np.prod(bias_shape, dtype=np.int64))
    lo, hi = tiling.visible_keys(N, Nk, None, window)
    seen = int(np.maximum(hi - lo, 0).sum())
    read, written = tiling.flash_fwd_masked_traffic(
        B, H, N, Nk, d, d, out["dtype"], out["block_q"], out["block_kv"], None, window,
        bias_shape is not None, False)
    out.update(bias_shape=bias_shape, window=window, bias_bytes=n_bias * acc,
               dbias_bytes=n_bias * acc,
               bias_hbm_read_bytes=B * H * seen * acc if bias_shape is not None else 0,
               visible_fraction=seen / (N * Nk) if N * Nk else 0.0,
               tiled_hbm_read_bytes=read, tiled_hbm_written_bytes=written,
               tiled_hbm_bytes=read + written)
    if bias_shape is not None:
        out["standard_hbm_read_bytes"] += n_bias * out["itemsize"]
        out["standard_hbm_bytes"] += n_bias * out["itemsize"]
    out["ratio_hbm"] = (out["standard_hbm_bytes"] / out["tiled_hbm_bytes"]
                        if out["tiled_hbm_bytes"] else float("inf"))
    return out

"""Which cuflash calls one ring step makes: global positions -> per-call masks.

Pure Python (no array library).  A rank holds its queries and, at each ring step, one
other rank's keys; both are one or two *chunks* of the global sequence.  Every
(query chunk, key chunk) pair is a rectangle whose mask, in global positions, is a band
of ``kpos - qpos``: ``(-inf, 0]`` for causal, ``[-left, right]`` for a window, their
intersection for both.  A band in local coordinates ``d = j - i`` is what cuflash's
bottom-right ``causal``/``window`` express, once the rectangle's ends are trimmed of
rows and keys that see nothing (cuflash aligns its band to the rectangle's last query
and last key, so only trimming the ends moves it).  A step makes one call over the
bounding rectangle of its non-empty pairs when one band is exact on every pair in it,
else one call per pair.
"""
from typing import NamedTuple, Optional, Tuple

from .._interop import check_layout
from .._validate import parse_causal
from .._validate_masks import check_softcap, check_window

__all__ = ["Call", "chunks_of", "step_calls", "global_band", "check_options", "shard_slices",
           "SHARDINGS"]

SHARDINGS = ("zigzag", "contiguous")


class Call(NamedTuple):
    """One cuflash call: local rows [r0, r1) of the queries, local keys [c0, c1) of the
    block held, and the mask in cuflash's terms (``causal`` bool, ``window`` pair with -1
    for an unbounded side, or None)."""
    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool
    window: Optional[Tuple[int, int]]


def chunks_of(rank, world, n_local, sharding):
    """``[(local start, global start, length)]`` of the chunks rank ``rank`` holds.

    ``zigzag``: the sequence is cut into ``2 * world`` chunks of ``n_local // 2``; rank r
    holds chunks r and ``2 * world - 1 - r`` (so causal work is the same on every rank).
    ``contiguous``: rank r holds positions ``[r * n_local, (r + 1) * n_local)``.
    """
    if sharding == "contiguous":
        return [(0, rank * n_local, n_local)]
    c = n_local // 2
    return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]


def global_band(causal, window):
    """``(lo, hi)`` of the visible ``kpos - qpos`` (None = unbounded) for a global self-
    attention (equal query and key lengths, so bottom-right = top-left)."""
    lo = hi = None
    if window is not None:
        lo = -window[0] if window[0] >= 0 else None
        hi = window[1] if window[1] >= 0 else None
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


def _clip(band, lo, hi):
    """The band restricted to [lo, hi] (bounded), or None when empty."""
    a = lo if band[0] is None else max(band[0], lo)
    b = hi if band[1] is None else min(band[1], hi)
    return None if a > b else (a, b)


def _feasible(r0, nq, c0, nk):
    """The range of d = j - i over local rows [r0, r0+nq) and keys [c0, c0+nk)."""
    return c0 - (r0 + nq - 1), c0 + nk - 1 - r0


def _call(r0, nq, c0, nk, band):
    """The cuflash call computing local band ``band`` (on d = j - i) over the rectangle."""
    lo, hi = _feasible(r0, nq, c0, nk)
    b = _clip(band, lo, hi)
    if b is None:
        return None
    # on the rectangle's own coordinates d' = d - (c0 - r0)
    a, z = b[0] - (c0 - r0), b[1] - (c0 - r0)
    a = None if a <= -(nq - 1) else a
    z = None if z >= nk - 1 else z
    off, t, e = nk - nq, 0, 0
    if a is not None and off < a:
        t = a - off        # the last t rows see no key of the rectangle
    if z is not None and off > z:
        e = off - z        # the last e keys are seen by no row
    off += t - e
    left = -1 if a is None else off - a
    right = -1 if z is None else z - off
    if left == -1 and right == 0:
        return Call(r0, r0 + nq - t, c0, c0 + nk - e, True, None)
    window = None if (left, right) == (-1, -1) else (left, right)
    return Call(r0, r0 + nq - t, c0, c0 + nk - e, False, window)


def step_calls(q_chunks, k_chunks, causal, window):
    """The calls of one step: queries in ``q_chunks``, keys in ``k_chunks`` (both as
    :func:`chunks_of` gives them).  An empty list when no key is visible."""
    g = global_band(causal, window)
    pairs = []
    for rq, gq, nq in q_chunks:
        for rk, gk, nk in k_chunks:
            shift = (gk - rk) - (gq - rq)     # kpos - qpos = d + shift
            band = (None if g[0] is None else g[0] - shift,
                    None if g[1] is None else g[1] - shift)
            pairs.append((rq, nq, rk, nk, band, _clip(band, *_feasible(rq, nq, rk, nk))))
    live = [p for p in pairs if p[5] is not None]
    if not live:
        return []
    r0, c0 = min(p[0] for p in live), min(p[2] for p in live)
    r1, c1 = max(p[0] + p[1] for p in live), max(p[2] + p[3] for p in live)
    # one band for the whole rectangle, from the sides that bind; checked on every pair
    los, his = [], []
    for rq, nq, rk, nk, _, (a, b) in live:
        flo, fhi = _feasible(rq, nq, rk, nk)
        if a > flo:              # a side that binds inside the pair fixes the band's side
            los.append(a)
        if b < fhi:
            his.append(b)
    lo = min(los) if los else None
    hi = max(his) if his else None
    one = (lo, hi)
    inside = [p for p in pairs if r0 <= p[0] and p[0] + p[1] <= r1
              and c0 <= p[2] and p[2] + p[3] <= c1]
    if all(_clip(one, *_feasible(*p[:4])) == p[5] for p in inside):
        call = _call(r0, r1 - r0, c0, c1 - c0, one)
        return [] if call is None else [call]
    return [c for c in (_call(p[0], p[1], p[2], p[3], p[4]) for p in live) if c is not None]


def check_options(sharding, causal, window, alibi_slopes, dropout_p, n_local, world):
    """The checks both frameworks make before anything is sent; ValueError saying why."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if alibi_slopes is not None:
        raise ValueError(
            "alibi_slopes is not supported by context-parallel attention: cuflash's ALiBi "
            "term is -slope * |i + (Nk - Nq) - j| in the coordinates of one call, and a ring "
            "block needs the global distance |qpos - kpos|, an offset that no call argument "
            "carries; pass the ALiBi term as a bias sharded by rows instead")
    if dropout_p:
        raise ValueError(
            "dropout_p > 0 is not supported by context-parallel attention: cuflash's dropout "
            "mask is indexed by the row and column inside one call, so blocks of a ring would "
            "not draw the mask of the unsharded attention")
    if sharding == "zigzag" and n_local % 2:
        raise ValueError(f"zigzag sharding holds two equal chunks per rank, so the local "
                         f"sequence length must be even; got {n_local} (use shard() on a "
                         f"sequence whose length is a multiple of 2 * world = {2 * world})")
    return global_band(causal, window)


def shard_slices(n, world, rank, sharding):
    """``[(start, length)]`` of the global positions rank ``rank`` holds, in local order;
    ValueError when ``n`` does not split evenly."""
    parts = 2 * world if sharding == "zigzag" else world
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, {world})")
    if n % parts:
        raise ValueError(f"a sequence of {n} does not split into {parts} equal chunks "
                         f"({sharding} sharding over {world} ranks): pad it to a multiple "
                         f"of {parts}")
    return [(g, length) for _, g, length in chunks_of(rank, world, n // world, sharding)]



def check_call(q, k, v, layout, seq, causal, window, softcap, sharding, alibi_slopes, dropout_p,
               world, bias_shape):
    """The argument checks of one rank's call, both frameworks: (n, causal, window, softcap)
    with n the local sequence length (axis ``seq`` of q, k, v); ValueError saying why."""
    check_layout(layout, q=q, k=k, v=v)
    n = q.shape[seq]
    if k.shape[seq] != n or v.shape[seq] != n:
        raise ValueError(f"context-parallel attention is self-attention over one sharded "
                         f"sequence: q, k, v must hold the same local length, got "
                         f"{q.shape[seq]}, {k.shape[seq]}, {v.shape[seq]} (layout {layout!r})")
    causal = parse_causal(causal) is not None
    window = check_window(window)
    softcap = check_softcap(softcap)
    check_options(sharding, causal, window, alibi_slopes, dropout_p, n, world)
    if bias_shape is not None and (len(bias_shape) < 2 or bias_shape[-1] != n * world
                                   or bias_shape[-2] not in (1, n)):
        raise ValueError(f"bias is sharded by rows: shape (..., {n}, {n * world}) or "
                         f"(..., 1, {n * world}) (this rank's {n} query rows, all "
                         f"{n * world} keys in global order), got {tuple(bias_shape)}")
    return n, causal, window, softcap

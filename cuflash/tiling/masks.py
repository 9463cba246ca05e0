"""The logit features' kernels (-DCUFLASH_MASKS): visible keys and exact traffic models."""
import numpy as np

from .bwd import BWD_THREADS, TF32_FLUSH_ROWS, tf32_bwd_flushes
from .core import _dtype_name, accumulator_bytes
from .fwd import tf32_flushes


# --------------------------------------------------------------------------
# the logit features (-DCUFLASH_MASKS: flash_fwd_masked, flash_bwd_*_masked): traffic
# --------------------------------------------------------------------------
# The masked kernels use the tiles, threads and shared memory of flash_fwd and
# flash_bwd_dkdv / flash_bwd_dq (the plans above); what changes is which tiles
# they load (the sliding window skips tiles on both sides of its band) and the
# feature tensors they read.  These models count exactly what the kernels
# load and store, so the emulator's byte counters can be held to them.
def visible_keys(Nq, Nk, causal=None, window=None):
    """(lo, hi) int arrays of shape (Nq,): row i sees keys lo[i] <= j < hi[i].

    ``causal``: None, "bottom_right" or "top_left"; ``window``: None or
    (left, right) with -1 (or None) for an unbounded side, aligned at
    ``Nk - Nq`` (kernels_cu/masks.cuh).
    """
    i = np.arange(Nq, dtype=np.int64)
    lo = np.zeros(Nq, np.int64)
    hi = np.full(Nq, Nk, np.int64)
    if causal is not None:
        hi = np.minimum(hi, i + (Nk - Nq if causal == "bottom_right" else 0) + 1)
    if window is not None:
        left, right = (-1 if s is None else s for s in window)
        if left >= 0:
            lo = np.maximum(lo, i + Nk - Nq - left)
        if right >= 0:
            hi = np.minimum(hi, i + Nk - Nq + right + 1)
    return np.clip(lo, 0, Nk), np.clip(hi, 0, Nk)


def _fwd_tile_keys(lo, hi, q0, rows, Nk, block_kv, causal_end):
    """The keys [k_begin, k_end) of the KV tiles a query tile loads (fwd_problem.cuh)."""
    a, b = int(lo[q0]), int(hi[q0 + rows - 1])
    b = min(b, causal_end)
    if b <= a:
        return 0, 0
    t0 = a // block_kv
    return t0 * block_kv, min(-(-b // block_kv) * block_kv, Nk)


def flash_fwd_masked_traffic(batch, heads, Nq, Nk, d, dv, dtype, block_q, block_kv, causal=None,
                             window=None, bias=False, alibi=False, threads=None, flush_keys=0):
    """Exact global bytes (read, written) of flash_fwd_masked (and of flash_fwd_tc_masked /
    flash_fwd_tf32_masked, with their ``threads``) for one dense launch.

    Per query head and Q tile: the Q tile; the K and V rows of the KV tiles
    from the one holding the first row's first visible key to the one holding
    the last row's last visible key (tiles left and right of the window's band
    are never loaded); with a bias, one element (compute type) per visible
    (row, key); with ALiBi, one slope per thread (``threads`` per block:
    flash_fwd_masked's 4 * block_q by default); O and lse once; with
    ``flush_keys`` (flash_fwd_tf32_masked: TF32_FLUSH_KEYS), O's rows again at
    every flush of the tile (:func:`cuflash.tiling.flash_fwd_traffic`).
    """
    isz = 2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize
    acc = accumulator_bytes(dtype)
    lo, hi = visible_keys(Nq, Nk, causal, window)
    seen = np.maximum(hi - lo, 0)
    kv_rows = flushed_rows = 0
    n_tiles = -(-Nq // block_q) if Nq else 0
    off = Nk - Nq if causal == "bottom_right" else 0
    for t in range(n_tiles):
        q0 = t * block_q
        rows = min(block_q, Nq - q0)
        cend = Nk if causal is None else min(max(q0 + rows - 1 + off + 1, 0), Nk)
        k0, k1 = _fwd_tile_keys(lo, np.minimum(hi, Nk), q0, rows, Nk, block_kv, cend)
        kv_rows += k1 - k0
        flushed_rows += tf32_flushes(-(-(k1 - k0) // block_kv), block_kv, flush_keys) * rows
    bh = batch * heads
    read = bh * (Nq * d * isz + kv_rows * (d + dv) * isz + flushed_rows * dv * isz)
    if bias:
        read += bh * int(seen.sum()) * acc
    if alibi:
        read += bh * n_tiles * (4 * block_q if threads is None else threads) * acc
    written = bh * (Nq * dv * isz + Nq * acc + flushed_rows * dv * isz)
    return read, written


def flash_bwd_masked_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, dtype, block_q, block_kv,
                             causal=None, window=None, bias=False, alibi=False, dbias=None,
                             deterministic=True):
    """Modelled global bytes (read, written) of a backward call on the masked kernels.

    As :func:`flash_bwd_traffic` with the window's tile skipping -- dkdv visits
    only the Q tiles whose rows' bands reach its KV tile, dq only the KV tiles
    inside its Q tile's band -- plus the features: a bias element per visible
    (row, key) in dkdv and again in dq; one ALiBi slope per thread per query head
    (BWD_THREADS per dkdv block and group head, per dq block); ``dbias``
    "store" (one write per visible element) or "atomic" (a read and a write).
    Rows that see no key are assumed to have lse = -inf (they read nothing).
    """
    isz = np.dtype(dtype).itemsize if _dtype_name(dtype) != "bfloat16" else 2
    acc = accumulator_bytes(dtype)
    lo, hi = visible_keys(Nq, Nk, causal, window)
    seen = int(np.maximum(hi - lo, 0).sum())
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    coff = (Nk - Nq) if causal == "bottom_right" else 0
    moff = Nk - Nq
    left, right = (-1, -1) if window is None else (-1 if s is None else s for s in window)
    read = bh * Nq * 2 * dv * isz
    written = bh * Nq * acc + (0 if deterministic else bh * Nq * d * 4)
    q_rows = 0
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        it0, it1 = 0, nq_t
        if causal is not None:
            i_min = kv0 - coff
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        if right >= 0:
            i_min = kv0 - moff - right
            t = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
            it0 = max(it0, t)
        if left >= 0:
            i_max = kv0 + kv_rows - 1 - moff + left
            t = 0 if i_max < 0 else (nq_t if i_max >= Nq else i_max // block_q + 1)
            it1 = min(it1, t)
        for it in range(it0, it1):
            q_rows += min(block_q, Nq - it * block_q)
    read += bhk * Nk * (d + dv) * isz + bhk * group * q_rows * ((d + dv) * isz + 2 * acc)
    written += bhk * Nk * (d + dv) * isz
    if alibi:
        read += bhk * nk_t * group * BWD_THREADS * acc
    if bias:
        read += bh * seen * acc
    if dbias == "store":
        written += bh * seen * acc
    elif dbias == "atomic":
        read += bh * seen * acc
        written += bh * seen * acc
    if not deterministic:
        read += bh * q_rows * d * 4
        written += bh * q_rows * d * 4
        read += bh * Nq * d * 4
        written += bh * Nq * d * isz
    else:
        kv_rows = 0
        wl, wh = visible_keys(Nq, Nk, None, window)
        for i in range(nq_t):
            q0 = i * block_q
            rows = min(block_q, Nq - q0)
            end = Nk if causal is None else min(max(q0 + rows + coff, 0), Nk)
            a, b = 0, end
            if window is not None:
                a = int(wl[q0])
                b = min(int(wh[q0 + rows - 1]), end)
                if b <= a:
                    a = b = 0
            if b > 0:
                kv_rows += min(-(-b // block_kv) * block_kv, Nk) - (a // block_kv) * block_kv
        read += bh * (Nq * ((d + dv) * isz + 2 * acc) + kv_rows * (d + dv) * isz)
        if alibi:
            read += bh * nq_t * BWD_THREADS * acc
        if bias:
            read += bh * seen * acc
        written += bh * Nq * d * isz
    return read, written


def band_offsets(Nq, Nk, causal, window):
    """(lo_off, hi_off): query i sees key j iff lo_off <= j - i < hi_off (and 0 <= j < Nk), the
    band of flash_bwd_tc_masked (kernels_cu/flash_bwd_tc.cu, BwdBand); the lean builds
    (flash_bwd_tc_band, _softcap, _alibi, _dropout) read them from their parameter block
    (cuflash.launch.bwd_tc.band_fields)."""
    lo, hi = -Nq, Nk
    left, right = (-1, -1) if window is None else (-1 if s is None else s for s in window)
    if left >= 0:
        lo = Nk - Nq - left
    if causal is not None:
        hi = (Nk - Nq if causal == "bottom_right" else 0) + 1
    if right >= 0:
        hi = min(hi, Nk - Nq + right + 1)
    return max(-Nq, min(Nk, lo)), max(-Nq, min(Nk, hi))


def flash_bwd_tc_masked_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, block_q, block_kv,
                                threads, passes=1, causal=None, window=None, bias=False,
                                alibi=False, dbias=None, n_splits=1):
    """Exact global bytes (read, written) of a backward call on flash_bwd_tc_masked (or
    the lean builds flash_bwd_tc_band, _softcap, _alibi and _dropout: the same traffic).

    flash_bwd_tc_preprocess, flash_bwd_tc_masked and flash_bwd_tc_dq_convert, 16-bit
    inputs: as :func:`cuflash.tiling.flash_bwd_tc_traffic`, with the Q tiles of a KV tile
    limited to those whose rows' bands reach it (both sides), the Q/dO tiles loaded once per
    pass (``passes``: 2 for the two-pass layouts), and the features: a bias element (float32)
    per element of every visited (Q tile, K/V tile) pair and pass -- rows past Nq and keys
    past Nk read an in-bounds element in their place, elements outside the band are read and
    then dropped; one ALiBi slope per thread, (Q tile, head) step and pass; ``dbias``
    "store" (a write) or "atomic" (a read and a write) per element of a visited pair inside
    [0, Nq) x [0, Nk) (0 outside the band).
    """
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    lo_off, hi_off = band_offsets(Nq, Nk, causal, window)
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    nq_pad = nq_t * block_q
    read = bh * (Nq * (2 * dv * 2 + 4))
    written = bh * (nq_pad * 8 + n_splits * Nq * d * 4)
    steps = in_range = 0
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        i_min, i_max = kv0 - hi_off + 1, kv0 + kv_rows - 1 - lo_off
        it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        it1 = 0 if i_max < 0 else (nq_t if i_max >= Nq else i_max // block_q + 1)
        it1 = max(it1, it0)
        written += bhk * kv_rows * (d + dv) * 2
        if it1 == it0:
            continue
        q_rows = min(Nq, it1 * block_q) - it0 * block_q
        steps += group * (it1 - it0)
        in_range += group * q_rows * kv_rows
        read += bhk * kv_rows * (d + dv) * 2
        read += passes * bhk * group * (q_rows * (d + dv) * 2 + (it1 - it0) * block_q * 8)
        read += bhk * group * q_rows * d * 4
        written += bhk * group * q_rows * d * 4
    if bias:
        read += passes * bhk * steps * block_q * block_kv * 4
    if alibi:
        read += passes * bhk * steps * threads * 4
    if dbias == "store":
        written += bhk * in_range * 4
    elif dbias == "atomic":
        read += bhk * in_range * 4
        written += bhk * in_range * 4
    read += n_splits * bh * Nq * d * 4
    written += bh * Nq * d * 2
    return read, written


def flash_bwd_tf32_masked_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, block_q, block_kv,
                                  threads, causal=None, window=None, bias=False, alibi=False,
                                  dbias=None, flush_rows=TF32_FLUSH_ROWS, dq_splits=1):
    """Exact global bytes (read, written) of a float32 backward call on flash_bwd_tf32_masked.

    flash_bwd_preprocess (O, dO read; D and the zeroed dQ accumulator written),
    flash_bwd_tf32_masked and flash_bwd_dq_convert.  The main kernel loads K_j, V_j and
    writes dK_j, dV_j for every KV tile; per (query head, Q tile) step -- the Q tiles whose
    rows' bands reach the tile (both sides) -- the Q, dO rows inside Nq with their lse and
    D, dQ added with one atomic (a read and a write) per element inside Nq; the features: a
    bias element per element of every step's tile pair (rows past Nq and keys past Nk read an
    in-bounds element in their place), one ALiBi slope per thread and step, ``dbias``
    "store" (a write) or "atomic" (a read and a write) per element of a step's pair inside
    [0, Nq) x [0, Nk); dK, dV's rows again at every flush of a KV tile's steps (every
    ``flush_rows`` query rows: :func:`cuflash.tiling.flash_bwd_traffic`).  ``dq_splits``:
    the dQ accumulator's slices (deterministic=True), each zeroed and read once.
    """
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    lo_off, hi_off = band_offsets(Nq, Nk, causal, window)
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    read = bh * Nq * 2 * dv * 4                      # preprocess: O, dO
    written = bh * Nq * 4 + dq_splits * bh * Nq * d * 4  # D, the zeroed dQ accumulator(s)
    steps = in_range = q_rows_all = 0
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        read += bhk * kv_rows * (d + dv) * 4
        written += bhk * kv_rows * (d + dv) * 4
        i_min, i_max = kv0 - hi_off + 1, kv0 + kv_rows - 1 - lo_off
        it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        it1 = 0 if i_max < 0 else (nq_t if i_max >= Nq else i_max // block_q + 1)
        it1 = max(it1, it0)
        q_rows = min(Nq, it1 * block_q) - it0 * block_q if it1 > it0 else 0
        steps += group * (it1 - it0)
        q_rows_all += group * q_rows
        in_range += group * q_rows * kv_rows
        flushes = tf32_bwd_flushes(group * (it1 - it0), block_q, flush_rows)
        read += bhk * flushes * kv_rows * (d + dv) * 4
        written += bhk * flushes * kv_rows * (d + dv) * 4
    read += bhk * q_rows_all * ((d + dv) * 4 + 8)    # Q, dO rows, lse, D
    read += bhk * q_rows_all * d * 4                 # dQ atomics
    written += bhk * q_rows_all * d * 4
    if bias:
        read += bhk * steps * block_q * block_kv * 4
    if alibi:
        read += bhk * steps * threads * 4
    if dbias == "store":
        written += bhk * in_range * 4
    elif dbias == "atomic":
        read += bhk * in_range * 4
        written += bhk * in_range * 4
    read += dq_splits * bh * Nq * d * 4              # dq_convert
    written += bh * Nq * d * 4
    return read, written

"""The tiled (flash) attention forward: FlashAttention-2 order, online softmax, lazy rescaling.
"""
import math

import numpy as np

from .._validate import check_attention_inputs
from .._validate_masks import check_masks
from .._validate_serving import check_num_splits
from ._common import (_canonical, _causal_offset, _compute_dtype, _kv_range, _no_track,
                      _num_workers, _run_tasks, _tile_mask, blas_controllable, combine_splits,
                      default_blocks, split_ranges)
from . import masks


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


def _flash_forward(spec, q, k, v, Br, Bc, workers=1, track=_no_track, stage="whole",
                   kv_tiles=None, out_dtype=None, ms=None):
    """FlashAttention-2 forward over all leading dims at once: returns (o, lse).

    ``kv_tiles=(j0, j1)`` visits only the key/value tiles j0 <= j < j1 (one
    split of split-KV: o and lse are then those of that key range alone, to be
    merged by :func:`cuflash.reference._common.combine_splits`); ``out_dtype``
    is o's dtype (default the input dtype; splits keep the compute dtype).

    One task per query tile Qi (FA2's outer loop; the tasks run on the thread
    pool); inside, the key/value tiles Kj, Vj stream past with the online
    softmax (Milakov & Gimelshein 2018; FlashAttention-2):
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
    o = np.empty(spec.out_shape, spec.dtype if out_dtype is None else out_dtype)
    lse = np.empty(spec.lse_shape, spec.lse_dtype)
    o_c = o.reshape(lead_c + (Nq, dv))
    lse_c = lse.reshape(lead_c + (Nq,))
    offset = _causal_offset(spec)
    scale = spec.scale
    feat = None
    if ms is not None:
        feat = masks.Features(spec, ms, lead_c, ct, ms.bias, ms.alibi_slopes)
    # the softcap needs the unshifted natural-unit logits: no shift column in the matmul
    fold = feat is None or ms.softcap is None
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
            np.multiply(q_c[..., r0:r1, :], scale2 if fold else scale, out=Qa[..., :d],
                        dtype=ct, casting="unsafe")
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
            if feat is None:
                j_lo, j_hi = 0, _kv_range(r0, r1, Nk, Bc, offset)[1]
            else:   # the window also skips the tiles left of the band
                j_lo, j_hi = masks.kv_tile_bounds(spec, ms, r0, r1, Bc)
            if kv_tiles is not None:
                j_lo, j_hi = max(j_lo, kv_tiles[0]), min(j_hi, kv_tiles[1])

            def logits(Sj, KjT, c0, c1, hidden):
                """Sj = the tile's base-2 logits minus the shift m_i, features and mask applied."""
                np.matmul(Qa, KjT, out=Sj)
                if feat is not None:
                    if fold:      # Sj = log2(e) s - m_i already: add the terms in base 2
                        feat.transform(Sj, r0, r1, c0, c1, unit=_LOG2E)
                    else:         # natural units, unshifted: cap, add, then convert and shift
                        feat.transform(Sj, r0, r1, c0, c1)
                        Sj *= ct.type(_LOG2E)
                        Sj -= m_i[..., None]
                if hidden is not None:                                     # boundary tile
                    Sj[..., hidden] = -np.inf

            for j in range(j_lo, j_hi):
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
                hidden = (_tile_mask(r0, r1, c0, c1, offset) if feat is None
                          else feat.hidden(r0, r1, c0, c1))
                if hidden is not None:
                    track(hidden)
                logits(Sj, KjT, c0, c1, hidden)                            # S - m_i
                keep = feat.keep(r0, r1, c0, c1) if feat is not None and ms.dropout else None
                l_acc = acc[..., dv]
                if j > j_lo:
                    # -- fast path: exp straight away; the row sums tell whether it was safe
                    np.exp2(Sj, out=Sj)                                    # P~
                    _pv(Sj, Vj, PV, keep)                                  # [P~ Vj, rowsum P~]
                    l_t = PV[..., dv]
                    if l_t.max() <= l_hi and (all_seen or ((l_acc > 0) | (l_t == 0)
                                                           | (l_t >= l_lo)).all()):
                        acc += PV
                        if not all_seen:
                            all_seen = bool((acc[..., dv] > 0).all())
                        continue
                    # some row's max rose above the slack (or a row's first keys lie far
                    # below its shift): recompute the tile and move those shifts
                    logits(Sj, KjT, c0, c1, hidden)
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
                    if fold:
                        Qa[..., d] = -m_i
                np.exp2(Sj, out=Sj)                                        # P~
                _pv(Sj, Vj, PV, keep)                                      # [P~ Vj, rowsum P~]
                acc += PV
                if not all_seen:   # once every row has mass, the first-contact test is moot
                    all_seen = bool((acc[..., dv] > 0).all())
            l_i = acc[..., dv]
            l_safe = np.where(l_i == 0, 1, l_i)
            np.divide(acc[..., :dv], l_safe[..., None], out=o_c[..., r0:r1, :],
                      casting="unsafe")
            np.add(m_i * _LN2, np.log(l_i), out=lse_c[..., r0:r1], casting="unsafe")

    drop_scale = ct.type(ms.drop_scale) if ms is not None and ms.dropout else None

    def _pv(P, Vj, PV, keep):
        """PV = [P Vj, rowsum P]; with dropout P Vj uses the kept, scaled P (in place)."""
        if keep is None:
            np.matmul(P, Vj, out=PV)
            return
        l_t = P.sum(axis=-1)                       # the undropped row sums: lse's
        P *= np.where(keep, drop_scale, ct.type(0))
        np.matmul(P, Vj, out=PV)
        PV[..., dv] = l_t

    n_q = -(-Nq // Br) if Nq else 0
    tasks = list(range(n_q))
    if offset is not None:   # causal: the longest tasks first so the threads finish together
        tasks.sort(key=lambda i: -_kv_range(i * Br, min(Nq, (i + 1) * Br), Nk, Bc, offset)[1])
    _run_tasks(q_tile, tasks, workers)
    return o, lse


def tiled_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                    alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None, block_q=None,
                    block_kv=None, return_lse=False, num_splits=None):
    """The NumPy reference of ``cuflash.tiled_attention`` (parameters, returns and semantics
    there), computed by :func:`_flash_forward`.

    Here ``block_q``/``block_kv`` None picks CPU-friendly sizes
    (:func:`default_blocks`); explicit sizes are used as given.  ``num_splits``
    None or 1 does not split (a CPU gains nothing from it); more splits the keys
    into ranges of whole tiles merged exactly (:func:`combine_splits`), so the
    kernels can be held to the arithmetic.  float16/bfloat16/float32 inputs are
    computed in float32, float64 in float64.  Extra memory is O(Br * Bc) per
    worker thread plus O(Nq) for the row statistics: see :func:`memory_analysis`
    and :func:`verify_no_full_materialization`.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                  block_kv=block_kv)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed)
    num_splits = check_num_splits(num_splits)
    workers = _workers_for(spec, 4.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, spec.block_q, spec.block_kv, workers)
    if num_splits is None or num_splits == 1:
        # the CPU gains nothing from splitting the keys: None means one split here
        o, lse = _flash_forward(spec, q, k, v, Br, Bc, workers, ms=ms)
    else:
        ct = _compute_dtype(spec.dtype)
        parts = [_flash_forward(spec, q, k, v, Br, Bc, workers, kv_tiles=r, out_dtype=ct, ms=ms)
                 for r in split_ranges(-(-spec.Nk // Bc) if spec.Nk else 0, num_splits)]
        o, lse = combine_splits(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]),
                                spec.dtype)
    return (o, lse) if return_lse else o

"""The tiled (flash) attention backward: P recomputed tile by tile from lse.
"""
import numpy as np

from .._validate import check_backward_inputs
from .._validate_masks import check_masks
from . import masks
from ._common import (_canonical, _causal_offset, _compute_dtype, _kv_range, _reduce_grads,
                      _run_tasks, _tile_mask, sum_to_shape)
from .flash_forward import _resolve_blocks, _workers_for


# ---------------------------------------------------------------------------
# tiled (flash) attention: backward
# ---------------------------------------------------------------------------
def _flash_backward(spec, do, q, k, v, o, lse, Br, Bc, workers=1, ms=None):
    """FlashAttention-2 backward: P recomputed tile by tile from lse.

    Outer loop over key/value tiles (dK_j, dV_j accumulate in place), inner
    loop over the query tiles that see them:
        S = Qi Kj^T;  P = exp(S - lse_i);  dV_j += P^T dO_i
        dP = dO_i Vj^T;  dS = P * (dP - D_i);  dQ_i += scale dS Kj;  dK_j += dS^T Qi
    with ``D = rowsum(dO * O)`` precomputed and ``Qi`` already holding
    ``scale * q``.  The KV tiles are dealt round-robin to the workers, each
    with its own dQ partial; the partials are summed in worker order, so the
    result is bitwise the same on every run.

    With ``ms`` (the logit features): S gets the softcap, bias and ALiBi and
    the causal/window mask; with dropout, ``dV_j += (P * keep / (1-p))^T dO_i``
    and ``dP *= keep / (1-p)`` (the mask is regenerated, never stored); the
    bias gradient is dS itself, summed tile by tile to the bias's shape (one
    partial per worker, added in worker order); the softcap multiplies dS by
    ``1 - tanh^2`` before dQ and dK.  Returns ``(dq, dk, dv)``, plus dbias (in
    the compute dtype, the bias's shape) when ``ms.return_dbias``.
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
    feat = None if ms is None else masks.Features(spec, ms, lead_c, ct, ms.bias,
                                                   ms.alibi_slopes)
    want_dbias = feat is not None and ms.return_dbias

    with np.errstate(invalid="ignore"):
        # D = rowsum(dO * O), one row at a time of the output's shape
        D = np.einsum("...ij,...ij->...i", np.asarray(do_c, dtype=ct), np.asarray(o_c, dtype=ct))
        # rows that saw no key: lse = -inf; shifting by +inf makes their P exactly 0
        lse_s = np.asarray(lse_c, dtype=ct)
        lse_s = np.where(np.isneginf(lse_s), np.inf, lse_s)

    def kv_tiles(js):
        dq = np.zeros(lead_c + (Nq, d), ct)
        dbias = np.zeros(feat.canonical_bias_shape(), ct) if want_dbias else None
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
                    if feat is None:
                        if _kv_range(r0, r1, Nk, Bc, offset)[1] <= j:
                            continue
                    else:  # the Q tiles whose rows' key intervals reach this tile
                        lo_t, hi_t = masks.kv_tile_bounds(spec, ms, r0, r1, Bc)
                        if not lo_t <= j < hi_t:
                            continue
                    Qi = np.multiply(q_c[..., r0:r1, :], scale, dtype=ct)
                    dOi = np.asarray(do_c[..., r0:r1, :], dtype=ct)
                    S = np.matmul(Qi, np.swapaxes(Kj, -1, -2))            # recompute S
                    th = None
                    if feat is None:
                        hidden = _tile_mask(r0, r1, c0, c1, offset)
                    else:
                        th = feat.transform(S, r0, r1, c0, c1)            # softcap, bias, ALiBi
                        hidden = feat.hidden(r0, r1, c0, c1)
                    if hidden is not None:
                        S[..., hidden] = -np.inf
                    S -= lse_s[..., r0:r1, None]
                    P = np.exp(S, out=S)                                  # P = exp(S - lse)
                    keep = None
                    if feat is not None and ms.dropout:
                        keep = feat.keep(r0, r1, c0, c1)                   # regenerated
                        dV_j += np.matmul(np.swapaxes(feat.dropped(P, r0, r1, c0, c1, keep),
                                                      -1, -2), dOi)
                    else:
                        dV_j += np.matmul(np.swapaxes(P, -1, -2), dOi)
                    dP = np.matmul(dOi, np.swapaxes(Vj, -1, -2))
                    if keep is not None:                                  # d(P kept) / dP
                        dP = feat.dropped(dP, r0, r1, c0, c1, keep)
                    dP -= D[..., r0:r1, None]
                    dS = np.multiply(P, dP, out=dP)                       # P * (dP - D)
                    if dbias is not None:                                 # dbias = dS
                        rs, cs = feat.rows_cols(r0, r1, c0, c1)
                        dbias[..., rs, cs] += sum_to_shape(dS, dbias[..., rs, cs].shape)
                    if th is not None:                                    # softcap: 1 - tanh^2
                        dS *= 1 - th * th
                    dq[..., r0:r1, :] += np.matmul(dS, Kj) * scale
                    dK_j += np.matmul(np.swapaxes(dS, -1, -2), Qi)
                # sum over the heads/batch this kv tile was broadcast to
                dk_c[..., c0:c1, :] = sum_to_shape(dK_j, k_c.shape[:-2] + (bc, d))
                dv_c[..., c0:c1, :] = sum_to_shape(dV_j, v_c.shape[:-2] + (bc, dv))
        return dq, dbias

    W = max(1, min(workers, n_kv))
    parts = [None] * W

    def run(w):
        parts[w] = kv_tiles(range(w, n_kv, W))

    _run_tasks(run, list(range(W)), W)
    dq, dbias = parts[0]
    for p, db in parts[1:]:
        dq += p
        if dbias is not None:
            dbias += db
    grads = _reduce_grads(spec, q, k, v, dq, dk_c, dv_c)
    if want_dbias:
        return grads + (dbias.reshape(ms.bias_shape),)
    return grads


def tiled_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, bias=None,
                             window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                             seed=None, block_q=None, block_kv=None, deterministic=False,
                             return_dbias=False):
    """The NumPy reference of ``cuflash.tiled_attention_backward`` (documented there).

    P is recomputed tile by tile from the forward's ``lse``
    (``P_ij = exp(S_ij - lse_i)``; the dropout mask regenerated from dropout_p and
    seed) and the softmax correction uses ``D = rowsum(do * o)``
    (FlashAttention-2).  ``deterministic`` is accepted for API parity: this
    backend is always deterministic (static work split, fixed summation order),
    so results are bitwise repeatable.
    """
    spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                 block_q=block_q, block_kv=block_kv)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    workers = _workers_for(spec, 10.0 * spec.batch * spec.Nq * spec.Nk * spec.d)
    Br, Bc = _resolve_blocks(spec, spec.block_q, spec.block_kv, workers)
    out = _flash_backward(spec, do, q, k, v, o, lse, Br, Bc, workers, ms=ms)
    if return_dbias:
        out = out[:3] + (out[3].astype(bias.dtype, copy=False),)
    return out

"""Standard attention, the textbook algorithm that materialises P, and its stored-P backward.
"""
import numpy as np

from .._validate import check_attention_inputs, check_backward_inputs
from .._validate_masks import check_masks
from . import masks
from ._common import (_canonical, _causal_offset, _compute_dtype, _reduce_grads, _tile_mask,
                      sum_to_shape)


# ---------------------------------------------------------------------------
# standard attention (materialises P)
# ---------------------------------------------------------------------------
def _standard_probs(spec, q_c, k_c, offset, feat=None):
    """P = softmax(mask(scale * q @ k^T + bias)) in the compute dtype, shape lead_c + (Nq, Nk).

    With ``feat`` (a :class:`masks.Features`) returns ``(P, tanh)``: the
    softcap's tanh (None without softcap) for the backward.
    """
    ct = _compute_dtype(spec.dtype)
    qs = np.multiply(q_c, spec.scale, dtype=ct)
    kt = np.asarray(k_c, dtype=ct)
    S = np.matmul(qs, np.swapaxes(kt, -1, -2))                 # (..., Nq, Nk)
    th = None
    if feat is not None:
        th = feat.transform(S, 0, spec.Nq, 0, spec.Nk)          # softcap, bias, ALiBi
        hidden = feat.hidden(0, spec.Nq, 0, spec.Nk)
        if hidden is not None:
            S[..., hidden] = -np.inf
    elif offset is not None:
        hidden = _tile_mask(0, spec.Nq, 0, spec.Nk, offset)
        if hidden is not None:
            S[..., hidden] = -np.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        m = S.max(axis=-1, keepdims=True) if spec.Nk else np.zeros(S.shape[:-1] + (1,), ct)
        m = np.where(np.isneginf(m), 0, m)                      # rows that see no key
        S -= m
        np.exp(S, out=S)
        l = S.sum(axis=-1, keepdims=True)
        S /= np.where(l == 0, 1, l)                             # P in place of S
    return S if feat is None else (S, th)


def _features(spec, ms, lead_c, xp=np):
    """The call's features over ``xp`` in the canonical layout (None without features)."""
    return None if ms is None else masks.Features(spec, ms, lead_c, _compute_dtype(spec.dtype),
                                                  ms.bias, ms.alibi_slopes, xp=xp)


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """The NumPy reference of ``cuflash.standard_attention`` (documented there).

    Textbook attention: ``o = softmax(scale * q @ k^T + mask) @ v`` with the whole
    logits matrix S and probability matrix P in memory (the baseline
    FlashAttention avoids), computed in float32 (float64 for float64 inputs).
    Returns ``(o, p)``, p the probabilities before dropout.

    See Also
    --------
    tiled_attention : the same output without the (Nq, Nk) arrays.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed)
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    feat = _features(spec, ms, lead_c)
    P = _standard_probs(spec, q_c, k_c, _causal_offset(spec), feat)
    if feat is not None:
        P = P[0]
    Pd = P if ms is None or not ms.dropout else feat.dropped(P, 0, spec.Nq, 0, spec.Nk)
    o = np.matmul(Pd, np.asarray(v_c, dtype=ct))
    o = o.reshape(spec.out_shape).astype(spec.dtype, copy=False)
    p = P.reshape(spec.lead + (spec.Nq, spec.Nk)).astype(spec.dtype, copy=False)
    return o, p


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, bias=None,
                                window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                seed=None, return_dbias=False):
    """The NumPy reference of ``cuflash.standard_attention_backward`` (documented there).

    The stored-P backward: ``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(P * dP)``,
    ``dS = P * (dP - D)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.
    """
    spec = check_backward_inputs(do, q, k, v, None, None, scale=scale, causal=causal,
                                 need_forward=False)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    feat = _features(spec, ms, lead_c)
    P = _standard_probs(spec, q_c, k_c, _causal_offset(spec), feat)  # stored: (..., Nq, Nk)
    th = None
    if feat is not None:
        P, th = P
    keep = feat.keep(0, spec.Nq, 0, spec.Nk) if ms is not None and ms.dropout else None
    do_c = np.asarray(do, dtype=ct).reshape(lead_c + (spec.Nq, spec.dv))
    kc, vc = np.asarray(k_c, dtype=ct), np.asarray(v_c, dtype=ct)
    qc = np.asarray(q_c, dtype=ct)
    Pd = P if keep is None else feat.dropped(P, 0, spec.Nq, 0, spec.Nk, keep)
    dv_ = np.matmul(np.swapaxes(Pd, -1, -2), do_c)                   # P^T dO
    dP = np.matmul(do_c, np.swapaxes(vc, -1, -2))                    # dO V^T
    if keep is not None:
        dP = feat.dropped(dP, 0, spec.Nq, 0, spec.Nk, keep)
    D = np.einsum("...ij,...ij->...i", P, dP)[..., None]             # rowsum(P * dP)
    dS = P * (dP - D)
    del dP
    dbias = None
    if ms is not None and ms.return_dbias:
        dbias = sum_to_shape(dS, feat.canonical_bias_shape()).reshape(ms.bias_shape)
        dbias = dbias.astype(bias.dtype, copy=False)
    if th is not None:
        dS *= 1 - th * th                                            # softcap derivative
    dq = np.matmul(dS, kc) * spec.scale
    dk = np.matmul(np.swapaxes(dS, -1, -2), qc) * spec.scale
    grads = _reduce_grads(spec, q, k, v, dq, dk, dv_)
    return grads + (dbias,) if dbias is not None else grads

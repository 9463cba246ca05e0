"""Standard attention, the textbook algorithm that materialises P, and its stored-P backward.
"""
import numpy as np

from .._validate import check_attention_inputs, check_backward_inputs
from .._validate_masks import check_masks
from . import masks
from ._common import (_canonical, _causal_offset, _compute_dtype, _reduce_grads, _tile_mask,
                      sum_to_shape)


# ---------------------------------------------------------------------------
# standard attention (materialises P): array code over xp, which the "cuda" backend runs
# with CuPy as its plain standard attention
# ---------------------------------------------------------------------------
def _standard_probs(xp, spec, q_c, k_c, feat=None):
    """``(P, tanh)``: P = softmax(mask(scale * q @ k^T + bias)) in the compute dtype, shape
    lead_c + (Nq, Nk), overwriting the logits; tanh is the softcap's (None without), for the
    backward.  ``feat`` is a :class:`masks.Features` or None."""
    ct = _compute_dtype(spec.dtype)
    S = xp.matmul(xp.multiply(q_c, spec.scale, dtype=ct),
                  xp.swapaxes(xp.asarray(k_c, dtype=ct), -1, -2))       # (..., Nq, Nk)
    th = None
    if feat is not None:
        th = feat.transform(S, 0, spec.Nq, 0, spec.Nk)          # softcap, bias, ALiBi
        hidden = feat.hidden(0, spec.Nq, 0, spec.Nk)
    else:
        hidden = _tile_mask(0, spec.Nq, 0, spec.Nk, _causal_offset(spec))
    if hidden is not None:
        xp.copyto(S, -np.inf, where=xp.asarray(hidden))
    with np.errstate(invalid="ignore", divide="ignore"):
        m = S.max(axis=-1, keepdims=True) if spec.Nk else xp.zeros(S.shape[:-1] + (1,), ct)
        m = xp.where(xp.isneginf(m), 0, m)                      # rows that see no key
        S -= m
        xp.exp(S, out=S)
        l = S.sum(axis=-1, keepdims=True)
        S /= xp.where(l == 0, 1, l)                             # P in place of S
    return S, th


def _features(spec, ms, lead_c, xp=np):
    """The call's features over ``xp`` in the canonical layout (None without features)."""
    return None if ms is None else masks.Features(spec, ms, lead_c, _compute_dtype(spec.dtype),
                                                  ms.bias, ms.alibi_slopes, xp=xp)


def _standard_forward(xp, q, k, v, spec, ms=None):
    """(o, p) of validated inputs: o = P V with P as :func:`_standard_probs` makes it."""
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    feat = _features(spec, ms, lead_c, xp)
    P, _ = _standard_probs(xp, spec, q_c, k_c, feat)
    Pd = P if ms is None or not ms.dropout else feat.dropped(P, 0, spec.Nq, 0, spec.Nk)
    o = xp.matmul(Pd, xp.asarray(v_c, dtype=P.dtype))
    return (o.reshape(spec.out_shape).astype(spec.dtype, copy=False),
            P.reshape(spec.lead + (spec.Nq, spec.Nk)).astype(spec.dtype, copy=False))


def _standard_backward(xp, do, q, k, v, spec, ms=None):
    """The stored-P gradients of validated inputs (and dbias with ``ms.return_dbias``)."""
    q_c, k_c, v_c, lead_c = _canonical(spec, q, k, v)
    ct = _compute_dtype(spec.dtype)
    feat = _features(spec, ms, lead_c, xp)
    P, th = _standard_probs(xp, spec, q_c, k_c, feat)               # stored: (..., Nq, Nk)
    keep = feat.keep(0, spec.Nq, 0, spec.Nk) if ms is not None and ms.dropout else None
    do_c = xp.asarray(do, dtype=ct).reshape(lead_c + (spec.Nq, spec.dv))
    kc, vc = xp.asarray(k_c, dtype=ct), xp.asarray(v_c, dtype=ct)
    qc = xp.asarray(q_c, dtype=ct)
    Pd = P if keep is None else feat.dropped(P, 0, spec.Nq, 0, spec.Nk, keep)
    dv_ = xp.matmul(xp.swapaxes(Pd, -1, -2), do_c)                   # P^T dO
    dP = xp.matmul(do_c, xp.swapaxes(vc, -1, -2))                    # dO V^T
    if keep is not None:
        dP = feat.dropped(dP, 0, spec.Nq, 0, spec.Nk, keep)
    D = xp.einsum("...ij,...ij->...i", P, dP)[..., None]             # rowsum(P * dP)
    dS = P * (dP - D)
    del dP
    dbias = None
    if ms is not None and ms.return_dbias:
        dbias = sum_to_shape(dS, feat.canonical_bias_shape()).reshape(ms.bias_shape)
        dbias = dbias.astype(ms.bias.dtype, copy=False)
    if th is not None:
        dS *= 1 - th * th                                            # softcap derivative
    dq = xp.matmul(dS, kc) * spec.scale
    dk = xp.matmul(xp.swapaxes(dS, -1, -2), qc) * spec.scale
    grads = _reduce_grads(spec, q, k, v, dq, dk, dv_)
    return grads + (dbias,) if dbias is not None else grads


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """The NumPy reference of ``cuflash.standard_attention`` (documented there).

    Textbook attention: ``o = softmax(scale * q @ k^T + mask) @ v`` with the whole
    logits matrix S and probability matrix P in memory (the baseline
    FlashAttention avoids), computed in float32 (float64 for float64 inputs).
    Returns ``(o, p)``, p the probabilities before dropout.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed)
    return _standard_forward(np, q, k, v, spec, ms)


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
    return _standard_backward(np, do, q, k, v, spec, ms)

"""Validation of the logit features of ``mask(scale * Q K^T + bias)``: bias, window, ALiBi,
softcap and dropout -- done once at the Python boundary, like :mod:`cuflash._validate`.

Every check reads only shapes, dtypes and Python scalars (never array data), so
NumPy and CuPy arrays are validated by the same code.  The result is a
:class:`MaskSpec`, the one description of the features of a call that the
reference, the launchers and the cache keys read; ``None`` means "no feature",
so a plain call takes exactly the path it took before these features existed.
The semantics are documented on :func:`cuflash.tiled_attention`, the dropout
bits in docs/kernels.md.
"""
import math
import numbers
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np

from ._validate import _library, check_float_dtype

__all__ = ["MaskSpec", "check_masks", "check_window", "check_softcap", "check_dropout",
           "dropout_threshold", "mask_key", "visible_range", "check_serving_masks",
           "sequence_masks", "Extent"]


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """The features of one attention call, after validation (None where absent).

    ``window`` is ``(left, right)`` with -1 for an unbounded side (None: no window, also
    when both sides are unbounded); ``offset`` is ``Nk - Nq``, the alignment of the window
    and of ALiBi distances; ``dropout_batch`` is added to the batch index of the dropout
    mask, so that a per-sequence call of a variable-length batch draws its sequence's mask.
    """
    bias: object = None
    bias_shape: Optional[Tuple[int, ...]] = None
    window: Optional[Tuple[int, int]] = None
    alibi_slopes: object = None
    softcap: Optional[float] = None
    dropout_p: float = 0.0
    seed: Optional[int] = None
    offset: int = 0
    return_dbias: bool = False
    dropout_batch: int = 0

    @property
    def dropout(self):
        return self.dropout_p > 0.0

    @property
    def drop_threshold(self):
        """16-bit Philox draws below this are dropped."""
        return dropout_threshold(self.dropout_p)

    @property
    def drop_scale(self):
        """1 / (1 - p): the scale of kept probabilities."""
        return 1.0 / (1.0 - self.dropout_p)


def check_window(window):
    """``(left, right)`` with -1 for unbounded sides, or None (no window).

    Accepts None, or a pair (tuple or list) whose sides are ints or None; a
    negative side means unbounded (flash-attn's ``window_size=(-1, -1)``).
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be None or a pair (left, right) of ints (None or a "
                         f"negative side = unbounded), got {window!r}")
    out = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            out.append(-1)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise ValueError(f"window {name} side must be an int or None, got {side!r} "
                             f"({type(side).__name__}) in window={window!r}")
        out.append(-1 if side < 0 else int(side))
    if out == [-1, -1]:
        return None
    return tuple(out)


def check_softcap(softcap):
    """``softcap`` as a float > 0, None when None."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r} "
                         f"({type(softcap).__name__})")
    c = float(softcap)
    if not (c > 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap must be a positive finite float (logits become "
                         f"softcap * tanh(logits / softcap)), got {softcap!r}; pass None for "
                         "no softcap")
    return c


def check_dropout(dropout_p, seed):
    """``(p, seed)`` with p in [0, 1) and seed an int in [0, 2^64) (required when p > 0)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r} "
                         f"({type(dropout_p).__name__})")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed!r} "
                             f"({type(seed).__name__})")
        if not 0 <= int(seed) < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed!r}")
        seed = int(seed)
    if p > 0.0 and seed is None:
        raise ValueError(f"dropout_p={dropout_p!r} needs a seed (an int): the dropout mask is "
                         "a function of (seed, batch, head, i, j), and the backward must be "
                         "given the same dropout_p and seed to regenerate it")
    return p, seed


def dropout_threshold(p):
    """The 16-bit threshold of dropout probability ``p``: draws below it are dropped.

    round(p * 2^16), at most 2^16 - 1: elements are dropped with probability
    threshold / 2^16, within 2^-17 of p (the kept ones are scaled by 1 / (1 - p)).
    """
    return min(int(round(float(p) * 2.0 ** 16)), 2 ** 16 - 1)


def _check_array(name, a, like):
    if not (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")):
        raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray (the library of q), "
                        f"got {type(a).__module__}.{type(a).__name__}")
    if _library(a) != _library(like):
        raise TypeError(f"arrays of two libraries in one call: {name} is "
                        f"{type(a).__module__}, q is {type(like).__module__}")
    check_float_dtype(a.dtype, f"{name} (shape {tuple(a.shape)})")


def check_masks(spec, q, *, bias=None, window=None, alibi_slopes=None, softcap=None,
                dropout_p=0.0, seed=None, return_dbias=False):
    """The :class:`MaskSpec` of the features of a call described by ``spec`` (an
    AttentionSpec), or None when it uses none (the plain path).  TypeError for a bias or
    slopes that are not float arrays of q's library; ValueError naming the argument and the
    shapes for anything else the front documents as refused."""
    window = check_window(window)
    softcap = check_softcap(softcap)
    dropout_p, seed = check_dropout(dropout_p, seed)
    full = tuple(spec.lead) + (spec.Nq, spec.Nk)
    if bias is not None:
        _check_array("bias", bias, q)
        try:
            b = tuple(np.broadcast_shapes(tuple(bias.shape), full))
        except ValueError:
            b = None
        if b != full:
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to the "
                             f"logits' shape {full} (leading dims {tuple(spec.lead)} + "
                             f"(Nq, Nk) = ({spec.Nq}, {spec.Nk})) for q {tuple(q.shape)}")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias (the gradient is that of bias=)")
    if alibi_slopes is not None:
        _check_array("alibi_slopes", alibi_slopes, q)
        lead = tuple(spec.lead)
        H = lead[-1] if lead else 1
        ok = alibi_slopes.ndim in (1, 2)
        if ok:
            try:
                ok = tuple(np.broadcast_shapes(tuple(alibi_slopes.shape), lead)) == lead \
                    if lead else tuple(alibi_slopes.shape) in ((1,), (1, 1))
            except ValueError:
                ok = False
        if not ok:
            B = lead[-2] if len(lead) >= 2 else 1
            raise ValueError(f"alibi_slopes must have shape (H,) = ({H},) or (B, H) = ({B}, {H}) "
                             f"(broadcast against the output's leading dims {lead}), got shape "
                             f"{tuple(alibi_slopes.shape)}")
    if bias is None and window is None and alibi_slopes is None and softcap is None \
            and dropout_p == 0.0:
        return None
    return MaskSpec(bias=bias, bias_shape=None if bias is None else tuple(bias.shape),
                    window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                    dropout_p=dropout_p, seed=seed, offset=spec.Nk - spec.Nq,
                    return_dbias=bool(return_dbias))


def visible_range(i, Nq, Nk, causal, ms):
    """(lo, hi): the keys query row(s) ``i`` may see are ``lo <= j < hi`` (any int or array).

    The causal rule (``causal`` None, "bottom_right" or "top_left") and the
    window of ``ms`` (a MaskSpec or None) each bound an interval; this is their
    intersection, clipped to [0, Nk].  ``lo >= hi`` means the row sees no key.
    """
    i = np.asarray(i, dtype=np.int64)
    lo = np.zeros_like(i)
    hi = np.full_like(i, Nk)
    if causal is not None:
        hi = np.minimum(hi, i + (Nk - Nq if causal == "bottom_right" else 0) + 1)
    if ms is not None and ms.window is not None:
        left, right = ms.window
        off = Nk - Nq
        if left >= 0:
            lo = np.maximum(lo, i + off - left)
        if right >= 0:
            hi = np.minimum(hi, i + off + right + 1)
    lo = np.clip(lo, 0, Nk)
    hi = np.clip(hi, 0, Nk)
    return lo, hi


def mask_key(ms, with_seed=True):
    """A hashable description of a MaskSpec's static part (for the launchers' call caches).

    Array *values* are not part of it (only shapes, strides and dtypes); the
    seed is left out with ``with_seed=False`` (the launchers key the parameter
    block of each seed separately).
    """
    if ms is None:
        return None

    def arr(a):
        return None if a is None else (tuple(a.shape), tuple(a.strides), str(a.dtype))
    return (arr(ms.bias), ms.window, arr(ms.alibi_slopes), ms.softcap, ms.dropout_p,
            ms.seed if with_seed else None, ms.return_dbias)


class Extent:
    """The (lead, Nq, Nk) that check_masks reads, for the serving calls."""

    def __init__(self, lead, Nq, Nk):
        self.lead, self.Nq, self.Nk = tuple(lead), int(Nq), int(Nk)


def check_serving_masks(q, B, H, Nq, Nk, *, bias=None, window=None, alibi_slopes=None,
                        softcap=None, dropout_p=0.0, seed=None, return_dbias=False):
    """The features of a varlen or KV-cache call (one problem per sequence b).

    ``bias`` broadcasts to ``(B, H, Nq, Nk)`` with ``Nq``/``Nk`` the longest
    query / key sequence (varlen: max_seqlen_q/k; KV cache: Nq and the cache's
    capacity): sequence b's logit (h, i, j) gets ``bias[b, h, i, j]``.
    ``alibi_slopes`` is (H,) or (B, H).  The window and ALiBi align each
    sequence at its own ``len_k - len_q``; dropout indexes (b, h, i, j) with
    b the sequence and i, j positions within it.  Returns a MaskSpec or None.
    """
    return check_masks(Extent((B, H), Nq, Nk), q, bias=bias, window=window,
                       alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                       seed=seed, return_dbias=return_dbias)


def sequence_masks(ms, b, len_q, len_k):
    """The MaskSpec of sequence b of a serving call, as a dense (H, len_q, len_k) problem.

    The bias and slopes become views of sequence b (rows / keys cut to the
    sequence's lengths where the bias is not broadcast along them), the
    alignment is the sequence's own, and the dropout mask is that of batch b.
    """
    bias = slopes = None
    if ms.bias is not None:
        x = ms.bias.reshape((1,) * (4 - ms.bias.ndim) + tuple(ms.bias.shape))
        x = x[b if x.shape[0] > 1 else 0]
        if x.shape[-2] > 1:
            x = x[:, :len_q, :]
        if x.shape[-1] > 1:
            x = x[:, :, :len_k]
        bias = x
    if ms.alibi_slopes is not None:
        s = ms.alibi_slopes.reshape((1,) * (2 - ms.alibi_slopes.ndim)
                                    + tuple(ms.alibi_slopes.shape))
        slopes = s[b if s.shape[0] > 1 else 0]
    return replace(ms, bias=bias, bias_shape=None if bias is None else tuple(bias.shape),
                   alibi_slopes=slopes, offset=len_k - len_q, dropout_batch=b)

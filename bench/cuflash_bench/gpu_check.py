"""The correctness gate of the GPU benchmark: a float64 oracle on the host and the pass rule.

Before a method is timed on a kind of problem (dtype, head dim, causal,
grouped heads, decode or not, with or without gradients) it runs once on a
smaller problem of that kind, and its output (and gradients) are compared on
the host with plain float64 NumPy attention.  The rule:

* float16 / bfloat16 (the flash-attn rule): ``max|out - ref| <= f * max|base - ref| + tiny``,
  ``f = 2`` for the output, ``3`` for dq, dk, dv (and dbias), where ``base`` is the same
  plain attention computed in float32 from the low-precision inputs with every
  intermediate product (S, P, O, dP, dS and the gradients) rounded to the low
  dtype, and ``tiny`` is one unit of the low dtype at the reference's largest
  magnitude (for a baseline that happens to be exact);
* float32 / float64: relative error ``||out - ref|| / ||ref||`` below
  ``REL_TOL`` (1e-4 / 1e-10: a gate against wrong results, looser than the
  test suite's 1e-5 / 1e-12 for cuflash, since other libraries' float32 paths
  may use TF32-based arithmetic).

A method that fails is reported with these numbers and not timed.
"""
import math

import numpy as np

__all__ = ["GRAD_NAMES", "LOW_PRECISION", "REL_TOL", "np_dtype", "eps_of", "precision",
           "attention", "judge", "err_text", "failure_reason"]

GRAD_NAMES = ("dq", "dk", "dv")
LOW_PRECISION = ("float16", "bfloat16")
REL_TOL = {"float32": 1e-4, "float64": 1e-10}
# how many times the low-precision baseline's error a method may make (flash-attn rule)
FACTOR = {"o": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dbias": 3.0}


def np_dtype(name):
    """The NumPy dtype of a dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise RuntimeError("bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def eps_of(name):
    """Machine epsilon of a dtype name (bfloat16: 2**-7)."""
    return 2.0 ** -7 if name == "bfloat16" else float(np.finfo(np.dtype(name)).eps)


def _t(x):
    return np.swapaxes(x, -1, -2)


def precision(low):
    """(float type, rounding) of an oracle: float64 and none (``low`` None), or float32 with
    every intermediate rounded to the dtype ``low`` (the low-precision baseline)."""
    if low is None:
        return np.float64, (lambda x: x)
    lowdt = np_dtype(low)
    return np.float32, (lambda x: x.astype(lowdt).astype(np.float32))


def attention(q, k, v, causal, do=None, low=None):
    """Plain attention over ``(B, H, N, d)`` host arrays, and with ``do`` its gradients.

    Parameters
    ----------
    q : ndarray, shape (B, H, Nq, d)
    k, v : ndarray, shape (B, Hk, Nk, d); ``H`` a multiple of ``Hk`` (query head
        ``h`` reads key/value head ``h // (H // Hk)``)
    causal : bool or "bottom_right"
        True: the top-left mask (query ``i`` sees keys ``j <= i``), PyTorch's
        ``is_causal``; ``"bottom_right"``: query ``i`` sees ``j <= i + Nk - Nq``
        (flash-attn's alignment, the one a KV cache's new queries need).
    do : ndarray, shape (B, H, Nq, d), optional
    low : str, optional
        None: float64 throughout (the oracle).  A dtype name: the low-precision
        baseline, float32 arithmetic with every intermediate rounded to ``low``.

    Returns
    -------
    dict
        ``{"o": ...}`` and, with ``do``, ``"dq"``, ``"dk"``, ``"dv"``.
    """
    ft, rnd = precision(low)
    q, k, v = (np.asarray(a).astype(ft) for a in (q, k, v))
    B, H, Nq, d = q.shape
    Hk, Nk = k.shape[-3], k.shape[-2]
    g = H // Hk
    ke, ve = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    scale = ft(1.0 / math.sqrt(d))
    s = rnd(np.matmul(q, _t(ke)) * scale)
    if causal:
        shift = Nk - Nq if causal == "bottom_right" else 0
        s = np.where(np.arange(Nk)[None, :] > np.arange(Nq)[:, None] + shift, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = rnd(p / p.sum(axis=-1, keepdims=True))
    o = rnd(np.matmul(p, ve))
    out = {"o": o}
    if do is None:
        return out
    do = np.asarray(do).astype(ft)

    def group_sum(x):  # (B, H, Nk, d) -> (B, Hk, Nk, d): the adjoint of the repeat above
        return x.reshape(B, Hk, g, Nk, x.shape[-1]).sum(axis=2)
    out["dv"] = rnd(group_sum(np.matmul(_t(p), do)))
    dp = rnd(np.matmul(do, _t(ve)))
    D = (do * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - D))
    out["dq"] = rnd(np.matmul(ds, ke) * scale)
    out["dk"] = rnd(group_sum(np.matmul(_t(ds), q)) * scale)
    return out


def judge(outs, ref, base, dtype):
    """Compare a method's host outputs with the oracle; ``(passed, per-output records)``.

    ``outs``, ``ref``, ``base``: dicts name -> float64 array (``base`` is None
    for float32/float64).  Every record holds ``max_abs_err`` and ``rel_err``;
    for 16-bit dtypes also the baseline's error and the bound.
    """
    records, ok = {}, True
    for name, r in ref.items():
        out = np.asarray(outs[name], dtype=np.float64)
        if out.shape != r.shape:
            records[name] = {"passed": False, "why": f"shape {out.shape}, expected {r.shape}"}
            ok = False
            continue
        err = np.abs(out - r)
        finite = bool(np.all(np.isfinite(out)))
        rec = {"max_abs_err": float(err.max()) if err.size else 0.0,
               "rel_err": float(np.linalg.norm(out - r) / max(np.linalg.norm(r), 1e-300))}
        if dtype in LOW_PRECISION:
            b = float(np.abs(base[name] - r).max())
            tiny = eps_of(dtype) * float(np.abs(r).max())
            rec.update(baseline_max_abs_err=b, bound=FACTOR[name] * b + tiny,
                       rule=f"max|err| <= {FACTOR[name]:g} x low-precision baseline + 1 ulp")
            passed = finite and rec["max_abs_err"] <= rec["bound"]
        else:
            rec.update(bound=REL_TOL[dtype], rule=f"rel_err <= {REL_TOL[dtype]:g}")
            passed = finite and rec["rel_err"] <= REL_TOL[dtype]
        if not finite:
            rec["why"] = "non-finite values"
        rec["passed"] = bool(passed)
        ok = ok and passed
        records[name] = rec
    return ok, records


def err_text(e):
    """One judged output's failure in words (``e``: a record of :func:`judge`)."""
    if "why" in e and "max_abs_err" not in e:
        return e["why"]
    return (f"max|err| {e['max_abs_err']:.3g} > bound {e['bound']:.3g}" if "baseline_max_abs_err"
            in e else f"rel_err {e['rel_err']:.3g} > {e['bound']:.3g}")


def failure_reason(errors, what):
    """The footnote of a failed check: every failing output of ``errors`` (judge's records)."""
    return "correctness check failed (" + "; ".join(
        f"{k}: {err_text(e)}" for k, e in errors.items() if not e["passed"]) + f") on {what}"

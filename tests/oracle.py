"""The float64 oracle of ``docs/testing.md`` and the tolerance rules.

Written from the spec (``docs/api.md``), independently of ``cuflash``: plain
NumPy, one (Nq, Nk) matrix per leading index, with the broadcast / grouped-head
mapping spelled out as an explicit loop over the output's leading indices.  It
is deliberately slow and obvious; nothing here is shared with the code under
test.

Tolerances
----------
* float64 / float32: ``||out - ref|| / ||ref||`` below 1e-12 / 1e-5.
* float16 / bfloat16 (the flash-attn rule): ``max|out - ref| <= f * max|base - ref|
  + tiny`` with ``f = 2`` for forward outputs and ``3`` for gradients, where
  ``base`` is the same plain attention computed with every input and
  intermediate product rounded to the low dtype, and ``tiny`` is one unit of
  the low dtype at the reference's magnitude (for baselines that happen to be
  exact).
"""
import itertools
import math

import numpy as np

try:  # bfloat16 for NumPy
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    ml_dtypes = None
    BFLOAT16 = None

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
LOW_PRECISION = ("float16", "bfloat16")


def dtype_of(name):
    """numpy dtype for a name of DTYPE_NAMES (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        if BFLOAT16 is None:
            raise RuntimeError("bfloat16 needs ml_dtypes (pip install ml_dtypes)")
        return BFLOAT16
    return np.dtype(name)


def dtype_name(dt):
    dt = np.dtype(dt)
    if BFLOAT16 is not None and dt == BFLOAT16:
        return "bfloat16"
    return dt.name


def eps_of(name):
    """Machine epsilon of a dtype name (bfloat16: 2**-7)."""
    if name == "bfloat16":
        return 2.0 ** -7
    return float(np.finfo(np.dtype(name)).eps)


# --------------------------------------------------------------------------
# random inputs
# --------------------------------------------------------------------------
def randn(rng, shape, dtype="float64", scale=1.0):
    """Standard normal values (times ``scale``) in ``dtype`` (a name or dtype)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    x = rng.standard_normal(shape) * scale
    return x.astype(dtype_of(name))


def qkv(rng, q_shape, k_shape, v_shape=None, dtype="float64", scale=1.0):
    """Fresh random q, k, v of the given shapes (v defaults to k's shape)."""
    v_shape = k_shape if v_shape is None else v_shape
    return (randn(rng, q_shape, dtype, scale), randn(rng, k_shape, dtype, scale),
            randn(rng, v_shape, dtype, scale))


def f64(a):
    """A float64 numpy copy of a numpy/cupy array of any float dtype."""
    if hasattr(a, "get") and type(a).__module__.split(".")[0] == "cupy":
        a = a.get()
    return np.asarray(a).astype(np.float64)


def poisoned(shape, dtype):
    """An array full of NaN: give it to a kernel as an output so unwritten elements fail."""
    out = np.empty(shape, dtype=dtype_of(dtype) if isinstance(dtype, str) else dtype)
    out[...] = np.nan
    return out


# --------------------------------------------------------------------------
# broadcast / grouped heads, spelled out
# --------------------------------------------------------------------------
def lead_mapping(q_lead, kv_lead):
    """The output's leading shape and, for each output leading index, the q and kv index.

    Grouped heads (api.md): when both have a heads axis (-3 of the full array,
    i.e. the last leading axis) and Hk divides H and is neither 1 nor H, query
    head h reads kv head h // (H // Hk).  Every other leading axis broadcasts as
    in NumPy.  Raises ValueError when neither rule applies.
    """
    q_lead, kv_lead = tuple(q_lead), tuple(kv_lead)
    group = 1
    if q_lead and kv_lead:
        H, Hk = q_lead[-1], kv_lead[-1]
        if Hk not in (1, H) and Hk != 0 and H % Hk == 0:
            group = H // Hk
    if group > 1:
        outer = np.broadcast_shapes(q_lead[:-1], kv_lead[:-1])
        out_lead = outer + (q_lead[-1],)
    else:
        out_lead = np.broadcast_shapes(q_lead, kv_lead)
    n = len(out_lead)

    def src(idx, lead, heads_grouped):
        # right-align lead with the output, size-1 axes read index 0
        off = n - len(lead)
        res = []
        for ax, size in enumerate(lead):
            i = idx[off + ax]
            if heads_grouped and ax == len(lead) - 1:
                i = i // group
            res.append(0 if size == 1 else i)
        return tuple(res)

    rows = []
    for idx in itertools.product(*[range(s) for s in out_lead]):
        rows.append((idx, src(idx, q_lead, False), src(idx, kv_lead, group > 1)))
    return out_lead, rows, group


def _kv_common(k, v):
    """k and v broadcast to their common leading shape (read-only views)."""
    kv_lead = np.broadcast_shapes(k.shape[:-2], v.shape[:-2])
    return (np.broadcast_to(k, kv_lead + k.shape[-2:]),
            np.broadcast_to(v, kv_lead + v.shape[-2:]))


def visible(Nq, Nk, causal):
    """Boolean (Nq, Nk): may query i see key j."""
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    if causal in (False, None):
        return np.ones((Nq, Nk), dtype=bool)
    if causal is True or causal == "bottom_right":
        return j <= i + (Nk - Nq)
    if causal == "top_left":
        return j <= i
    raise ValueError(f"oracle: unknown causal {causal!r}")


def _softmax_rows(s, vis):
    """Rows of softmax over visible entries; rows seeing nothing give p = 0, lse = -inf.

    A logit of -inf (a -inf bias) hides its key like the mask does.
    """
    vis = vis & ~np.isneginf(s)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf)
    empty = ~vis.any(axis=-1, keepdims=True)
    m_safe = np.where(empty, 0.0, m)
    e = np.where(vis, np.exp(s - m_safe), 0.0)
    l = e.sum(axis=-1, keepdims=True)
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, l))
    with np.errstate(divide="ignore"):
        lse = np.where(empty[..., 0], -np.inf, (m_safe + np.log(np.where(empty, 1.0, l)))[..., 0])
    return p, lse


# --------------------------------------------------------------------------
# the logit features: mask(softcap(scale * q k^T) + bias + ALiBi), dropout
# --------------------------------------------------------------------------
def philox_block(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011), written out from the paper's round function.

    Counters and key are integer arrays (broadcast together) or ints; returns a
    (4, ...) uint64 array of 32-bit words.  Each round: L' = hi(M1 * c2) ^ c1 ^ k0,
    lo(M1 * c2), hi(M0 * c0) ^ c3 ^ k1, lo(M0 * c0); then k += (W0, W1).
    """
    mask = np.uint64(0xFFFFFFFF)
    x = np.array(np.broadcast_arrays(*[np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3)]))
    x &= mask
    key = [np.uint64(int(k0) & 0xFFFFFFFF), np.uint64(int(k1) & 0xFFFFFFFF)]
    for _ in range(10):
        a = x[0] * np.uint64(0xD2511F53)
        b = x[2] * np.uint64(0xCD9E8D57)
        x = np.array([((b >> np.uint64(32)) ^ x[1] ^ key[0]) & mask, b & mask,
                      ((a >> np.uint64(32)) ^ x[3] ^ key[1]) & mask, a & mask])
        key = [(key[0] + np.uint64(0x9E3779B9)) & mask, (key[1] + np.uint64(0xBB67AE85)) & mask]
    return x


def keep_mask(b, h, Nq, Nk, p, seed):
    """(Nq, Nk) bool: dropout keeps (b, h, i, j) iff the 16-bit half j % 2 (low for even j) of
    word 2 ((i // 8) % 2) + (j // 8) % 2 of Philox at (4 (j // 16) + (j % 8) // 2,
    8 (i // 16) + i % 8, h, b) under key (seed % 2^32, seed // 2^32) is >= round(p * 2^16)."""
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    words = philox_block(4 * (j // 16) + (j % 8) // 2, 8 * (i // 16) + i % 8, h, b,
                         seed % 2 ** 32, seed // 2 ** 32)                     # (4, Nq, Nk)
    word = np.broadcast_to(2 * ((i // 8) % 2) + (j // 8) % 2, (Nq, Nk))
    w = np.take_along_axis(words, word[None], axis=0)[0]
    half = np.where(j % 2 == 1, w >> np.uint64(16), w & np.uint64(0xFFFF))
    threshold = min(int(round(p * 2.0 ** 16)), 2 ** 16 - 1)
    return half >= threshold


def _feature_terms(out_lead, oi, Nq, Nk, bias=None, window=None, alibi_slopes=None,
                   softcap=None, dropout_p=0.0, seed=None, causal=False, dropout_batch=0):
    """For output problem ``oi``: (additive term, visibility, keep-mask or None)."""
    add = np.zeros((Nq, Nk))
    if bias is not None:
        add += np.broadcast_to(f64(bias), out_lead + (Nq, Nk))[oi]
    off = Nk - Nq
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    if alibi_slopes is not None:
        slope = np.broadcast_to(f64(alibi_slopes), out_lead)[oi]
        add -= slope * np.abs(i + off - j)
    vis = visible(Nq, Nk, causal)
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            vis = vis & (j >= i + off - left)
        if right is not None and right >= 0:
            vis = vis & (j <= i + off + right)
    keep = None
    if dropout_p:
        b = int(np.ravel_multi_index(oi[:-1], out_lead[:-1])) if len(oi) > 1 else 0
        b += dropout_batch          # a sequence of a packed batch: its own index
        h = oi[-1] if oi else 0
        keep = keep_mask(b, h, Nq, Nk, dropout_p, seed)
    return add, vis, keep


def attention(q, k, v, scale=None, causal=False, **feat):
    """float64 oracle forward: (o, lse, p) with p of shape (..., Nq, Nk).

    ``feat``: bias, window, alibi_slopes, softcap, dropout_p, seed (the
    features of cuflash.tiled_attention); p is the softmax before dropout.
    """
    q, k, v = f64(q), f64(k), f64(v)
    k, v = _kv_common(k, v)
    Nq, d = q.shape[-2:]
    Nk, dv = v.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out_lead, rows, _ = lead_mapping(q.shape[:-2], k.shape[:-2])
    o = np.zeros(out_lead + (Nq, dv))
    lse = np.zeros(out_lead + (Nq,))
    p = np.zeros(out_lead + (Nq, Nk))
    vis = visible(Nq, Nk, causal)
    cap = feat.get("softcap")
    for oi, qi, ki in rows:
        s = scale * (q[qi] @ k[ki].T)
        keep = None
        if feat:
            if cap is not None:
                s = cap * np.tanh(s / cap)
            add, vis, keep = _feature_terms(out_lead, oi, Nq, Nk, causal=causal, **feat)
            s = s + add
        pi, li = _softmax_rows(s, vis)
        p[oi] = pi
        lse[oi] = li
        w = pi if keep is None else np.where(keep, pi / (1 - feat["dropout_p"]), 0.0)
        o[oi] = w @ v[ki]
    return o, lse, p


def attention_backward(do, q, k, v, scale=None, causal=False, return_dbias=False, **feat):
    """float64 oracle textbook backward: (dq, dk, dv), dk/dv summed back to k/v shapes.

    With ``return_dbias`` also dbias (the gradient of the logits after the
    softcap, summed to the bias's shape).
    """
    do, q, k0, v0 = f64(do), f64(q), f64(k), f64(v)
    k, v = _kv_common(k0, v0)
    Nq, d = q.shape[-2:]
    Nk = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out_lead, rows, _ = lead_mapping(q.shape[:-2], k.shape[:-2])
    dk = np.zeros(k.shape)
    dvv = np.zeros(v.shape)
    dq_acc = np.zeros(out_lead + q.shape[-2:])
    dlogits = np.zeros(out_lead + (Nq, Nk))
    vis = visible(Nq, Nk, causal)
    cap = feat.get("softcap")
    for oi, qi, ki in rows:
        s = scale * (q[qi] @ k[ki].T)
        keep, dcap = None, 1.0
        if feat:
            if cap is not None:
                t = np.tanh(s / cap)
                s, dcap = cap * t, 1 - t * t
            add, vis, keep = _feature_terms(out_lead, oi, Nq, Nk, causal=causal, **feat)
            s = s + add
        p, _ = _softmax_rows(s, vis)
        g = do[oi]
        drop = 1.0 if keep is None else np.where(keep, 1 / (1 - feat["dropout_p"]), 0.0)
        dvv[ki] += (p * drop).T @ g
        dp = (g @ v[ki].T) * drop
        D = (p * dp).sum(axis=-1, keepdims=True)
        ds = p * (dp - D)
        dlogits[oi] = ds
        ds = ds * dcap
        dq_acc[oi] += scale * ds @ k[ki]
        dk[ki] += scale * ds.T @ q[qi]
    # each gradient has its input's shape: sum over the axes it was broadcast along
    out = (sum_to_shape(dq_acc, q.shape), sum_to_shape(dk, k0.shape),
           sum_to_shape(dvv, v0.shape))
    if return_dbias:
        out += (sum_to_shape(dlogits, np.shape(feat["bias"])),)
    return out


def sum_to_shape(a, shape):
    """Sum a broadcast result back to ``shape`` (the adjoint of np.broadcast_to)."""
    extra = a.ndim - len(shape)
    if extra:
        a = a.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and a.shape[i] != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return a.reshape(shape)


# --------------------------------------------------------------------------
# the low-precision baseline (flash-attn's "reference in the low dtype")
# --------------------------------------------------------------------------
def _rounder(name):
    dt = dtype_of(name)
    return lambda x: np.asarray(x).astype(dt).astype(np.float64)


def attention_lowp(q, k, v, dtype, scale=None, causal=False, **feat):
    """Plain attention with inputs and every intermediate rounded to ``dtype``: (o, lse)."""
    r = _rounder(dtype)
    q, k, v = r(f64(q)), r(f64(k)), r(f64(v))
    k, v = _kv_common(k, v)
    Nq, d = q.shape[-2:]
    Nk, dv = v.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out_lead, rows, _ = lead_mapping(q.shape[:-2], k.shape[:-2])
    o = np.zeros(out_lead + (Nq, dv))
    lse = np.zeros(out_lead + (Nq,))
    p = np.zeros(out_lead + (Nq, Nk))
    vis = visible(Nq, Nk, causal)
    cap = feat.get("softcap")
    for oi, qi, ki in rows:
        s = r(scale * r(q[qi] @ k[ki].T))
        keep = None
        if feat:
            if cap is not None:
                s = r(cap * np.tanh(s / cap))
            add, vis, keep = _feature_terms(out_lead, oi, Nq, Nk, causal=causal, **feat)
            s = r(s + r(add))
        pi, li = _softmax_rows(s, vis)
        p[oi] = r(pi)
        w = p[oi] if keep is None else r(np.where(keep, p[oi] / (1 - feat["dropout_p"]), 0.0))
        o[oi] = r(w @ v[ki])
        lse[oi] = li
    return o, lse, p


def attention_backward_lowp(do, q, k, v, dtype, scale=None, causal=False, return_dbias=False,
                            **feat):
    """Textbook backward with every input and intermediate rounded to ``dtype``."""
    r = _rounder(dtype)
    do, q, k0, v0 = r(f64(do)), r(f64(q)), r(f64(k)), r(f64(v))
    k, v = _kv_common(k0, v0)
    Nq, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out_lead, rows, _ = lead_mapping(q.shape[:-2], k.shape[:-2])
    dq_acc = np.zeros(out_lead + q.shape[-2:])
    dk = np.zeros(k.shape)
    dvv = np.zeros(v.shape)
    Nk = k.shape[-2]
    vis = visible(Nq, Nk, causal)
    cap = feat.get("softcap")
    dlogits = np.zeros(out_lead + (Nq, Nk))
    for oi, qi, ki in rows:
        s = r(scale * r(q[qi] @ k[ki].T))
        keep, dcap = None, 1.0
        if feat:
            if cap is not None:
                t = r(np.tanh(s / cap))
                s, dcap = r(cap * t), r(1 - t * t)
            add, vis, keep = _feature_terms(out_lead, oi, Nq, Nk, causal=causal, **feat)
            s = r(s + r(add))
        p, _ = _softmax_rows(s, vis)
        p = r(p)
        g = do[oi]
        drop = 1.0 if keep is None else np.where(keep, 1 / (1 - feat["dropout_p"]), 0.0)
        dvv[ki] += r(r(p * drop).T @ g)
        dp = r(r(g @ v[ki].T) * drop)
        D = r((p * dp).sum(axis=-1, keepdims=True))
        ds = r(p * (dp - D))
        dlogits[oi] = ds
        ds = r(ds * dcap)
        dq_acc[oi] += r(scale * r(ds @ k[ki]))
        dk[ki] += r(scale * r(ds.T @ q[qi]))
    out = (r(sum_to_shape(dq_acc, q.shape)), r(sum_to_shape(dk, k0.shape)),
           r(sum_to_shape(dvv, v0.shape)))
    if return_dbias:
        out += (r(sum_to_shape(dlogits, np.shape(feat["bias"]))),)
    return out


# --------------------------------------------------------------------------
# tolerance rules
# --------------------------------------------------------------------------
REL_TOL = {"float64": 1e-12, "float32": 1e-5}


def _describe(out, ref):
    diff = np.abs(out - ref)
    if diff.size == 0:
        return "empty"
    with np.errstate(invalid="ignore"):
        where = np.unravel_index(np.nanargmax(diff) if not np.all(np.isnan(diff)) else 0,
                                 diff.shape)
    return (f"max abs err {np.nanmax(diff) if not np.all(np.isnan(diff)) else np.nan:.3e} "
            f"at {tuple(int(i) for i in where)} (out {out[where]!r}, ref {ref[where]!r}); "
            f"{int(np.isnan(out).sum())} NaN in out, shape {out.shape}")


def assert_rel_close(out, ref, dtype, what="output"):
    """float64/float32 rule: relative Frobenius error below REL_TOL[dtype]."""
    out, ref = f64(out), f64(ref)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    if ref.size == 0:
        return
    finite = np.isfinite(ref)
    # -inf entries (lse of rows that see no key) must match exactly
    assert np.array_equal(np.isfinite(out), finite) and np.all(out[~finite] == ref[~finite]), (
        f"{what}: non-finite pattern differs from the reference; {_describe(out, ref)}")
    o, r_ = out[finite], ref[finite]
    nref = np.linalg.norm(r_)
    err = np.linalg.norm(o - r_)
    tol = REL_TOL[dtype]
    if nref == 0:
        assert err == 0, f"{what}: reference is all zero, out is not; {_describe(out, ref)}"
        return
    assert err / nref < tol, (f"{what} ({dtype}): relative error {err / nref:.3e} >= {tol:.0e}; "
                              f"{_describe(out, ref)}")


def assert_lowp_close(out, ref, base, dtype, factor, what="output"):
    """f16/bf16 rule: max|out-ref| <= factor * max|base-ref| + one unit of the dtype."""
    out, ref, base = f64(out), f64(ref), f64(base)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    if ref.size == 0:
        return
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), finite) and np.all(out[~finite] == ref[~finite]), (
        f"{what}: non-finite pattern differs from the reference; {_describe(out, ref)}")
    o, r_, b = out[finite], ref[finite], base[finite]
    err = np.max(np.abs(o - r_), initial=0.0)
    base_err = np.max(np.abs(b - r_), initial=0.0)
    tiny = eps_of(dtype) * max(np.max(np.abs(r_), initial=0.0), 1e-3)
    bound = factor * base_err + tiny
    assert err <= bound, (f"{what} ({dtype}): max abs err {err:.3e} > {factor} x baseline "
                          f"{base_err:.3e} + {tiny:.1e}; {_describe(out, ref)}")


def check_forward(o, q, k, v, scale=None, causal=False, lse=None, dtype=None, **feat):
    """Check o (and lse when given) of a forward call against the oracle by the dtype's rule."""
    dtype = dtype or dtype_name(q.dtype)
    ref_o, ref_lse, _ = attention(q, k, v, scale, causal, **feat)
    if dtype in LOW_PRECISION:
        base_o, base_lse, _ = attention_lowp(q, k, v, dtype, scale, causal, **feat)
        assert_lowp_close(o, ref_o, base_o, dtype, 2, "o")
        if lse is not None:
            assert_lowp_close(lse, ref_lse, base_lse, dtype, 2, "lse")
    else:
        assert_rel_close(o, ref_o, dtype, "o")
        if lse is not None:
            assert_rel_close(lse, ref_lse, dtype, "lse")


def check_backward(grads, do, q, k, v, scale=None, causal=False, dtype=None, **feat):
    """Check (dq, dk, dv[, dbias]) against the oracle backward by the dtype's rule (3x for f16/bf16).

    A fourth gradient is checked as dbias (``feat`` must hold the bias).
    """
    dtype = dtype or dtype_name(q.dtype)
    with_db = len(grads) == 4
    refs = attention_backward(do, q, k, v, scale, causal, return_dbias=with_db, **feat)
    names = ("dq", "dk", "dv", "dbias")
    if dtype in LOW_PRECISION:
        bases = attention_backward_lowp(do, q, k, v, dtype, scale, causal, return_dbias=with_db,
                                        **feat)
        for g, r_, b, n in zip(grads, refs, bases, names):
            assert_lowp_close(g, r_, b, dtype, 3, n)
    else:
        for g, r_, n in zip(grads, refs, names):
            assert_rel_close(g, r_, dtype, n)


# --------------------------------------------------------------------------
# variable-length batches: one oracle problem per sequence
# --------------------------------------------------------------------------
def sequence_features(feat, b, len_q, len_k):
    """Sequence b's features: bias[b, :, :len_q, :len_k] and slopes[b] of the broadcast
    (B, H, max_q, max_k) / (B, H) arrays, its dropout batch index b."""
    out = dict(feat)
    if feat.get("bias") is not None:
        x = np.asarray(feat["bias"])
        x = x.reshape((1,) * (4 - x.ndim) + x.shape)
        x = x[b if x.shape[0] > 1 else 0]
        out["bias"] = x[:, :len_q if x.shape[1] > 1 else 1, :len_k if x.shape[2] > 1 else 1]
    if feat.get("alibi_slopes") is not None:
        s = np.asarray(feat["alibi_slopes"])
        s = s.reshape((1,) * (2 - s.ndim) + s.shape)
        out["alibi_slopes"] = s[b if s.shape[0] > 1 else 0]
    if feat.get("dropout_p"):
        out["dropout_batch"] = b
    return out

"""Rows whose first key tiles sit far below the row's maximum, or whose logits all sit far below
zero: softmax does not depend on where the logits are, so no backend may either.

The tensor-core forward kernels keep a row's reference maximum at -inf until the first key,
and rescale O and l by 2^(mc_old - mc_new) when it moves; from the initial reference a first
maximum below -128 / (scale log2 e) made that factor +inf and 0 * inf = NaN in whole rows.  The
cases: ALiBi at the standard slope of head 1 of 8 (0.5) over several hundred keys, a steep
distance bias, an additive -10000 key-padding mask on the leading keys, and plain calls whose
logits all sit near -128 and near -1000 -- for every dtype, through the dense forward and
backward, split-KV, the KV cache and varlen batches.
"""
import numpy as np
import pytest

import cuflash
import oracle

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _far_qkv(rng, q_shape, k_shape, dtype, level):
    """Logits near -level, varying by O(1) within a row: q = a e_0 + noise, k = -a e_0 + noise
    with a^2 = level sqrt(d) (scaled logit -a^2 / sqrt(d) plus O(1) terms), v standard normal.
    One coordinate carries the offset, so the gradients stay well conditioned."""
    d = q_shape[-1]
    a = np.sqrt(level * np.sqrt(d))
    q = rng.standard_normal(q_shape)
    k = rng.standard_normal(k_shape)
    q[..., 0] = a + 0.01 * q[..., 0]
    k[..., 0] = -a + 0.01 * k[..., 0]
    cast = oracle.dtype_of(dtype)
    return q.astype(cast), k.astype(cast), oracle.randn(rng, k_shape, dtype)


def _distance_bias(Nq, Nk, slope, dtype):
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    ct = np.float64 if dtype == "float64" else np.float32
    return (-slope * np.abs(i - j + (Nk - Nq))).astype(ct)


def _cases(rng, dtype):
    """(name, q, k, v, causal, features, level, amp) for the dense calls.  level: the magnitude
    of the logits near each row's maximum (0: of order 1); amp: how much the construction
    amplifies rounding in the gradients (1: not at all)."""
    ct = np.float64 if dtype == "float64" else np.float32
    q, k, v = oracle.qkv(rng, (1, 2, 320, 64), (1, 2, 320, 64), dtype=dtype)
    yield "alibi 0.5 causal", q, k, v, True, dict(alibi_slopes=np.full(2, 0.5, ct)), 0, 1
    yield "steep bias", q, k, v, False, dict(bias=_distance_bias(320, 320, 0.3, dtype)), 0, 1
    pad = np.zeros((1, 1, 1, 320), ct)
    pad[..., :64] = -10000.0
    yield "-10000 padding", q, k, v, False, dict(bias=pad), 0, 1
    q, k, v = oracle.qkv(rng, (1, 2, 96, 64), (1, 2, 160, 64), dtype=dtype)
    for level in (128.0, 1000.0):
        # every logit shifted by a bias: the masked kernels, gradients as well conditioned
        # as the unshifted problem
        yield (f"bias -{level:g}", q, k, v, False, dict(bias=np.full((1, 1, 1, 1), -level, ct)),
               level, 1)
        # plain calls: the shift lives in q and k (one coordinate), the plain kernels
        fq, fk, fv = _far_qkv(rng, (1, 2, 96, 64), (1, 2, 160, 64), dtype, level)
        yield f"logits near -{level:g}", fq, fk, fv, False, {}, level, _amp(level, 64)


def _amp(level, d):
    """The plain far construction's offset a = sqrt(level sqrt(d)) sits in q and k; dq = scale
    sum_j dS_ij k_j cancels it (sum_j dS_ij = 0), so rounding in dS reaches dq and dk about a
    times larger than their size."""
    return float(np.sqrt(level * np.sqrt(d)))


def _rel_rule(outs, refs, tol, names, what):
    for out, ref, n in zip(outs, refs, names):
        ref = np.asarray(ref, np.float64)
        err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
        assert err < tol, f"{n} ({what}): relative error {err:.2e} >= {tol:.1e}"


def _check(dtype, level, amp, o, lse, grads, do, q, k, v, causal, feat):
    """The oracle's rules, with two conditioning terms where the construction needs them:
    float32 logits of magnitude L carry a rounding error of about L 2^-24 each, which exp()
    turns into a relative error of P of that size (no float32 computation does better), so
    float32 at level L is held to 8 L 2^-24; and gradients of the plain far construction to
    amp times the rule."""
    if dtype in ("float16", "bfloat16") or (level == 0 and amp == 1):
        oracle.check_forward(o, q, k, v, None, causal, lse=lse, **feat)
        if grads is None:
            return
        if amp == 1:
            oracle.check_backward(grads, do, q, k, v, None, causal, **feat)
        else:
            assert all(np.isfinite(g).all() for g in grads)
        return
    tol = 8 * level * 2.0 ** -24 if dtype == "float32" else oracle.REL_TOL[dtype]
    tol = max(tol, oracle.REL_TOL[dtype])
    ref_o, ref_lse = oracle.attention(q, k, v, None, causal, **feat)[:2]
    _rel_rule((o,), (ref_o,), tol, ("o",), f"{dtype}, logits near -{level:g}")
    if lse is not None:  # a logit's rounding is also lse's (relative to L)
        _rel_rule((lse,), (ref_lse,), tol, ("lse",), f"{dtype}, logits near -{level:g}")
    if grads is None:
        return
    refs = oracle.attention_backward(do, q, k, v, None, causal, **feat)
    _rel_rule(grads, refs, tol * amp, ("dq", "dk", "dv"), f"{dtype}, logits near -{level:g}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_forward_and_backward(backend, dtype, rng):
    a = backend.asarray
    for name, q, k, v, causal, feat, level, amp in _cases(rng, dtype):
        kw = {n: a(x) if isinstance(x, np.ndarray) else x for n, x in feat.items()}
        o, lse = cuflash.tiled_attention(a(q), a(k), a(v), causal=causal, return_lse=True,
                                         backend=backend.name, **kw)
        o, lse = backend.to_numpy(o), backend.to_numpy(lse)
        assert not np.isnan(o).any(), f"{dtype} {name}: {np.isnan(o).any(-1).sum()} NaN rows"
        do = oracle.randn(rng, o.shape, dtype)
        g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse), causal=causal,
                                             backend=backend.name, **kw)
        g = tuple(backend.to_numpy(x) for x in g)
        assert not any(np.isnan(x).any() for x in g), f"{dtype} {name}: NaN gradients"
        _check(dtype, level, amp, o, lse, g, do, q, k, v, causal, feat)


def test_smallest_case(backend):
    """One query, one key, a bias of -89: o = v, lse = -89 (NaN before the fix)."""
    a = backend.asarray
    q = k = np.zeros((1, 1, 1, 64), np.float16)
    v = np.ones((1, 1, 1, 64), np.float16)
    o, lse = cuflash.tiled_attention(a(q), a(k), a(v), bias=a(np.full((1, 1, 1, 1), -89.0, np.float32)),
                                     return_lse=True, backend=backend.name)
    np.testing.assert_array_equal(backend.to_numpy(o), v)
    np.testing.assert_allclose(backend.to_numpy(lse), -89.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_and_kv_cache(backend, dtype, rng):
    """Decode shapes: the split-KV forward (a few queries over many keys) and the KV cache."""
    a = backend.asarray
    level = 1000.0
    q, k, v = _far_qkv(rng, (2, 4, 3, 64), (2, 2, 700, 64), dtype, level)
    o, lse = cuflash.tiled_attention(a(q), a(k), a(v), num_splits=4, return_lse=True,
                                     backend=backend.name)
    _check(dtype, level, 1, backend.to_numpy(o), backend.to_numpy(lse), None, None, q, k, v,
           False, {})
    lens = np.array([700, 450], np.int32)
    ct = np.float64 if dtype == "float64" else np.float32
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], ct)
    for feat in ({}, dict(alibi_slopes=slopes)):
        kw = {n: a(x) for n, x in feat.items()}
        o = backend.to_numpy(cuflash.attention_with_kvcache(
            a(q), a(k), a(v), cache_seqlens=a(lens), causal=True, backend=backend.name, **kw))
        assert not np.isnan(o).any(), f"{dtype} kv cache {sorted(feat)}: NaN"
        for b in range(2):
            L = lens[b]
            _check(dtype, level, 1, o[b], None, None, None, q[b], k[b, :, :L], v[b, :, :L], True,
                   feat)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_forward_and_backward(backend, dtype, rng):
    a = backend.asarray
    lens = [150, 300, 40]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    level = 1000.0
    q, k, v = _far_qkv(rng, (cu[-1], 2, 64), (cu[-1], 2, 64), dtype, level)
    ct = np.float64 if dtype == "float64" else np.float32
    slopes = np.array([0.5, 0.25], ct)
    o, lse = cuflash.varlen_attention(a(q), a(k), a(v), a(cu), a(cu), causal=True,
                                      alibi_slopes=a(slopes), return_lse=True, backend=backend.name)
    o, lse = backend.to_numpy(o), backend.to_numpy(lse)
    assert not np.isnan(o).any(), f"{dtype} varlen: {np.isnan(o).any(-1).sum()} NaN rows"
    do = oracle.randn(rng, o.shape, dtype)
    g = cuflash.varlen_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse), a(cu), a(cu),
                                          causal=True, alibi_slopes=a(slopes), backend=backend.name)
    g = tuple(backend.to_numpy(x) for x in g)
    for s in range(len(lens)):
        r = slice(cu[s], cu[s + 1])
        # (N, H, d) per sequence -> (H, N, d) for the oracle
        t = lambda x: np.swapaxes(x[r], 0, 1)  # noqa: E731
        _check(dtype, level, _amp(level, 64), t(o), None, tuple(t(x) for x in g), t(do), t(q),
               t(k), t(v), True, dict(alibi_slopes=slopes))

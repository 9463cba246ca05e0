"""An infinite entry in K: exactly the rows and gradients float64 makes NaN turn NaN, no others.

A key with k[c] = +inf gives the logit +inf to queries with q[c] > 0 (their row is NaN: inf - inf
in softmax) and -inf to those with q[c] < 0 (softmax weighs that key 0, the row stays finite).
The float32 kernels run 3xTF32, k = hi + lo: an infinity has hi = inf and lo = NaN, and
hi_q * lo_k made every row NaN; K's split (split_tf32_inf, portable.cuh) maps that NaN to a
finite lo.  The 16-bit kernels multiply K as it is.  Checked for every dtype through the plain
and the masked (bias) kernel families, causal and not, and for the backward whose queries
all see the infinite logit as -inf: then float64 makes only dq's column c NaN (0 * inf in
dS K) and dk, dv finite.
"""
import numpy as np
import pytest

import cuflash
import oracle

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _inputs(rng, dtype, sign_q=None):
    q, k, v = (oracle.randn(rng, (1, 2, 80, 64), dtype) for _ in range(3))
    if sign_q is not None:
        q[..., 2] = sign_q * np.abs(q[..., 2]) + sign_q * 0.25  # every query the same side
    k[0, 0, 3, 2] = np.inf
    k[0, 1, 41, 7] = -np.inf
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,with_bias", [(False, False), (True, False), (False, True)],
                         ids=["plain", "causal", "bias"])
def test_forward_nan_rows_as_float64(backend, dtype, causal, with_bias, rng):
    a = backend.asarray
    q, k, v = _inputs(rng, dtype)
    feat = {}
    if with_bias:
        feat["bias"] = (0.1 * rng.standard_normal((1, 2, 80, 80))).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ro, rl, _ = oracle.attention(q, k, v, causal=causal, **feat)
    nan_rows = np.isnan(ro).any(-1)
    assert 20 < nan_rows.sum() < 140, nan_rows.sum()  # both kinds of rows are present
    o, lse = cuflash.tiled_attention(a(q), a(k), a(v), causal=causal, return_lse=True,
                                     backend=backend.name, **{n: a(x) for n, x in feat.items()})
    o, lse = backend.to_numpy(o), backend.to_numpy(lse)
    np.testing.assert_array_equal(np.isnan(o).any(-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(o).all(-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(lse), nan_rows)
    np.testing.assert_array_equal(np.isnan(rl), nan_rows)
    fin = ~nan_rows
    err = np.abs(o[fin].astype(np.float64) - ro[fin]).max()
    assert err < (2e-2 if dtype in ("float16", "bfloat16") else 1e-5), err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["atomic", "deterministic", "bias"])
def test_backward_with_only_minus_inf_logits(backend, dtype, variant, rng):
    """Also the tail: 80 queries leave zero-filled rows in the last query tile, where
    0 * inf = NaN logits must not reach the infinite key's dk and dv (their lse2 = +inf
    alone does not zero P there)."""
    a = backend.asarray
    q, k, v = _inputs(rng, dtype, sign_q=-1.0)
    q[0, 1, :, 7] = np.abs(q[0, 1, :, 7]) + 0.25  # head 1's key 41 (k = -inf): -inf logits too
    feat = {}
    if variant == "bias":
        feat["bias"] = (0.1 * rng.standard_normal((1, 2, 80, 80))).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ro, rl, _ = oracle.attention(q, k, v, **feat)
    assert np.isfinite(ro).all()
    kw = {n: a(x) for n, x in feat.items()}
    o, lse = cuflash.tiled_attention(a(q), a(k), a(v), return_lse=True, backend=backend.name, **kw)
    o, lse = backend.to_numpy(o), backend.to_numpy(lse)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    do = oracle.randn(rng, o.shape, dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        rg = oracle.attention_backward(do, q, k, v, **feat)
    g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse),
                                         deterministic=variant == "deterministic", backend=backend.name, **kw)
    g = [backend.to_numpy(x) for x in g]
    want_dq_nan = np.zeros(q.shape, bool)
    want_dq_nan[0, 0, :, 2] = want_dq_nan[0, 1, :, 7] = True
    np.testing.assert_array_equal(np.isnan(rg[0]), want_dq_nan)
    for name, x, r in zip(("dq", "dk", "dv"), g, rg):
        np.testing.assert_array_equal(np.isnan(x), np.isnan(r), err_msg=name)
        fin = np.isfinite(r)
        err = np.abs(x[fin].astype(np.float64) - r[fin]).max() / np.abs(r[fin]).max()
        assert err < (2e-2 if dtype in ("float16", "bfloat16") else 1e-5), (name, err)

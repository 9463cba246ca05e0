"""Backward: central differences, the float64 oracle, tiled vs stored-P, determinism.

Seed 001's gradient tests (numerical gradient check; recomputation
equivalence) and the testing.md rules: analytic gradients against central
differences in float64 on small shapes, the tiled backward against the
stored-P backward on larger ones, every dtype by its tolerance rule, rows that
see no key get zero gradient (never NaN), and deterministic=True is bitwise
repeatable.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import grid

DTYPES = oracle.DTYPE_NAMES


def fwd(backend, q, k, v, blocks=(None, None), **kw):
    bq, bkv = blocks if backend.name == "numpy" else (None, None)
    o, lse = cuflash.tiled_attention(backend.asarray(q), backend.asarray(k), backend.asarray(v),
                                     block_q=bq, block_kv=bkv, return_lse=True,
                                     backend=backend.name, **kw)
    return backend.to_numpy(o), backend.to_numpy(lse)


def tiled_bwd(backend, do, q, k, v, o, lse, blocks=(None, None), **kw):
    bq, bkv = blocks if backend.name == "numpy" else (None, None)
    a = backend.asarray
    g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse), block_q=bq,
                                         block_kv=bkv, backend=backend.name, **kw)
    return tuple(backend.to_numpy(x) for x in g)


def std_bwd(backend, do, q, k, v, **kw):
    a = backend.asarray
    g = cuflash.standard_attention_backward(a(do), a(q), a(k), a(v), backend=backend.name, **kw)
    return tuple(backend.to_numpy(x) for x in g)


def setup(rng, q_shape, k_shape, v_shape=None, dtype="float64"):
    q, k, v = oracle.qkv(rng, q_shape, k_shape, v_shape, dtype)
    ref_o, _, _ = oracle.attention(q, k, v)
    do = oracle.randn(rng, ref_o.shape, dtype)
    return do, q, k, v


def check_grads_shapes(grads, q, k, v):
    for g, x, n in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == x.shape, f"{n} shape {g.shape} != {x.shape}"
        assert g.dtype == x.dtype, f"{n} dtype {g.dtype} != {x.dtype}"


# --------------------------------------------------------------------------
# central differences (float64, tiny shapes)
# --------------------------------------------------------------------------
def central_differences(loss, arrays, h=1e-6):
    """d loss / d array for every element of every array, by (L(x+h) - L(x-h)) / 2h."""
    grads = []
    for i, a in enumerate(arrays):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in arrays]
            minus = [x.copy() for x in arrays]
            plus[i][idx] += h
            minus[i][idx] -= h
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        grads.append(g)
    return grads


FD_CASES = [
    ((4, 3), (5, 3), None, False),
    ((5, 3), (3, 3), None, "bottom_right"),   # Nq > Nk: rows 0, 1 see no key
    ((3, 3), (6, 3), None, "top_left"),       # keys 3..5 seen by nobody
    ((1, 4, 3, 2), (1, 2, 4, 2), None, "bottom_right"),  # GQA 4/2
    ((2, 1, 3, 2), (1, 2, 4, 2), None, False),            # broadcast q and k/v
    ((3, 4), (5, 4), (5, 2), "top_left"),     # dv != d
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,causal", grid(
    FD_CASES, reference_only=lambda c: c[2] is not None))
def test_gradients_central_differences(backend, rng, q_shape, k_shape, v_shape, causal):
    do, q, k, v = setup(rng, q_shape, k_shape, v_shape)
    scale = 0.7

    def loss(q_, k_, v_):
        return float((oracle.attention(q_, k_, v_, scale, causal)[0] * do).sum())

    num = central_differences(loss, [q, k, v])
    o, lse = fwd(backend, q, k, v, blocks=(2, 3), scale=scale, causal=causal)
    for grads, how in ((tiled_bwd(backend, do, q, k, v, o, lse, blocks=(2, 3), scale=scale,
                                  causal=causal), "tiled"),
                       (std_bwd(backend, do, q, k, v, scale=scale, causal=causal), "standard")):
        check_grads_shapes(grads, q, k, v)
        for g, n, name in zip(grads, num, ("dq", "dk", "dv")):
            err = np.max(np.abs(g - n))
            assert err < 1e-7 * max(1.0, np.max(np.abs(n))), (
                f"{how} {name}: max abs err {err:.3e} against central differences")
            assert np.all(np.isfinite(g))


@pytest.mark.full_grid
def test_gradients_central_differences_of_own_forward(backend, rng):
    # the backend's own forward differentiated numerically agrees with its backward
    do, q, k, v = setup(rng, (2, 4, 3), (2, 5, 3))

    def loss(q_, k_, v_):
        return float((fwd(backend, q_, k_, v_, blocks=(3, 2), causal="top_left")[0] * do).sum())

    num = central_differences(loss, [q, k, v])
    o, lse = fwd(backend, q, k, v, blocks=(3, 2), causal="top_left")
    grads = tiled_bwd(backend, do, q, k, v, o, lse, blocks=(3, 2), causal="top_left")
    for g, n, name in zip(grads, num, ("dq", "dk", "dv")):
        assert np.max(np.abs(g - n)) < 1e-7, f"{name}: max abs err {np.max(np.abs(g - n)):.3e}"


# --------------------------------------------------------------------------
# the oracle grid
# --------------------------------------------------------------------------
GRID = [
    # q shape, k shape, v shape, causal, dtype, blocks
    ((2, 97, 32), (2, 97, 32), None, False, "float64", (32, 32)),
    ((2, 113, 64), (2, 203, 64), None, "bottom_right", "float32", (16, 48)),
    ((2, 203, 64), (2, 113, 64), None, "bottom_right", "float64", (48, 16)),  # blind rows
    ((2, 203, 32), (2, 113, 32), None, "top_left", "float16", (64, 64)),
    ((2, 1, 16), (2, 147, 16), None, False, "bfloat16", (7, 33)),
    ((1, 6, 127, 32), (1, 2, 128, 32), None, "bottom_right", "float32", (32, 32)),  # GQA
    ((2, 6, 128, 32), (2, 1, 127, 32), None, "top_left", "float64", (64, 16)),     # MQA
    ((1, 6, 65, 64), (1, 6, 65, 64), None, True, "bfloat16", (32, 32)),            # MHA
    ((2, 17, 96), (2, 17, 96), None, False, "float16", (None, None)),
    ((1, 33, 128), (1, 40, 128), None, "bottom_right", "float32", (16, 16)),
    ((1, 20, 256), (1, 25, 256), None, False, "float64", (8, 8)),
    ((1, 20, 256), (1, 25, 256), None, "top_left", "bfloat16", (8, 8)),
    ((2, 31, 59), (2, 29, 59), None, "bottom_right", "float64", (5, 6)),          # ref only
    ((2, 31, 40), (2, 29, 40), (2, 29, 24), "top_left", "float32", (5, 6)),        # ref only
    ((2, 3, 25, 16), (1, 3, 30, 16), None, False, "float64", (8, 8)),              # batch bcast
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,causal,dtype,blocks", grid(
    GRID, emulator=(0, 2, 3, 4, 5, 6, 7, 8, 9, 11),
    reference_only=lambda c: c[0][-1] == 59 or c[2] is not None))
def test_backward_against_oracle(backend, rng, q_shape, k_shape, v_shape, causal, dtype,
                                 blocks):
    do, q, k, v = setup(rng, q_shape, k_shape, v_shape, dtype)
    o, lse = fwd(backend, q, k, v, blocks=blocks, causal=causal)
    grads = tiled_bwd(backend, do, q, k, v, o, lse, blocks=blocks, causal=causal)
    check_grads_shapes(grads, q, k, v)
    oracle.check_backward(grads, do, q, k, v, causal=causal)
    sgrads = std_bwd(backend, do, q, k, v, causal=causal)
    check_grads_shapes(sgrads, q, k, v)
    oracle.check_backward(sgrads, do, q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_blind_rows_and_unseen_keys_get_zero_gradient(backend, rng, dtype, causal):
    # bottom_right with Nq > Nk: rows 0..Nq-Nk-1 see no key -> dq rows exactly 0
    # top_left with Nq < Nk: keys Nq..Nk-1 seen by no query -> dk, dv rows exactly 0
    Nq, Nk = (30, 18) if causal == "bottom_right" else (18, 30)
    do, q, k, v = setup(rng, (2, Nq, 16), (2, Nk, 16), dtype=dtype)
    o, lse = fwd(backend, q, k, v, blocks=(8, 8), causal=causal)
    dq, dk, dv = tiled_bwd(backend, do, q, k, v, o, lse, blocks=(8, 8), causal=causal)
    vis = oracle.visible(Nq, Nk, causal)
    blind, unseen = ~vis.any(1), ~vis.any(0)
    assert blind.any() or unseen.any()
    for g in (dq, dk, dv):
        assert not np.isnan(oracle.f64(g)).any(), "NaN in a gradient"
    assert np.all(oracle.f64(dq)[:, blind] == 0)
    assert np.all(oracle.f64(dk)[:, unseen] == 0) and np.all(oracle.f64(dv)[:, unseen] == 0)
    oracle.check_backward((dq, dk, dv), do, q, k, v, causal=causal)


def test_all_rows_blind(backend, rng):
    # Nk = 3 keys, Nq = 10 queries, bottom_right: only the last 3 queries see keys
    do, q, k, v = setup(rng, (10, 8), (3, 8))
    o, lse = fwd(backend, q, k, v, causal=True)
    dq, dk, dv = tiled_bwd(backend, do, q, k, v, o, lse, causal=True)
    assert np.all(dq[:7] == 0) and np.all(np.isfinite(dq))
    oracle.check_backward((dq, dk, dv), do, q, k, v, causal=True)


# --------------------------------------------------------------------------
# seed 001: recomputation equivalence (tiled vs stored-P) on larger shapes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("q_shape,k_shape,causal,blocks", grid([
    ((2, 256, 64), (2, 256, 64), False, (64, 64)),
    ((1, 4, 200, 32), (1, 2, 255, 32), "bottom_right", (32, 48)),
    ((2, 255, 32), (2, 200, 32), "top_left", (17, 64)),
    ((1, 512, 64), (1, 512, 64), True, (128, 64)),
], emulator=(0, 1)))
def test_recomputation_equivalence(backend, rng, q_shape, k_shape, causal, blocks):
    do, q, k, v = setup(rng, q_shape, k_shape)
    o, lse = fwd(backend, q, k, v, blocks=blocks, causal=causal)
    tiled = tiled_bwd(backend, do, q, k, v, o, lse, blocks=blocks, causal=causal)
    stored = std_bwd(backend, do, q, k, v, causal=causal)
    for t, s, name in zip(tiled, stored, ("dq", "dk", "dv")):
        # "identical" up to float64 rounding of two summation orders
        oracle.assert_rel_close(t, s, "float64", f"{name} tiled vs stored-P")
    oracle.check_backward(tiled, do, q, k, v, causal=causal)


def test_backward_uses_lse_not_a_recomputed_softmax(backend, rng):
    # P is recomputed from the lse given: a wrong lse must change the gradients
    do, q, k, v = setup(rng, (2, 40, 16), (2, 40, 16))
    o, lse = fwd(backend, q, k, v)
    good = tiled_bwd(backend, do, q, k, v, o, lse)
    bad = tiled_bwd(backend, do, q, k, v, o, lse + 1.0)
    # exp(s - lse - 1) = P / e: dv shrinks by exactly e
    np.testing.assert_allclose(bad[2], good[2] / np.e, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_bitwise(backend, rng, dtype, deterministic):
    do, q, k, v = setup(rng, (2, 6, 90, 32), (2, 2, 90, 32), dtype=dtype)
    o, lse = fwd(backend, q, k, v, blocks=(32, 16), causal=True)
    first = tiled_bwd(backend, do, q, k, v, o, lse, blocks=(32, 16), causal=True,
                      deterministic=deterministic)
    oracle.check_backward(first, do, q, k, v, causal=True)
    if deterministic:  # the guarantee: bitwise identical on every run
        for _ in range(3):
            again = tiled_bwd(backend, do, q, k, v, o, lse, blocks=(32, 16), causal=True,
                              deterministic=True)
            for a, b, name in zip(first, again, ("dq", "dk", "dv")):
                assert np.array_equal(a, b), f"{name} differs between runs with deterministic=True"


def test_inputs_not_modified_backward(backend, rng):
    do, q, k, v = setup(rng, (2, 30, 16), (2, 35, 16))
    o, lse = fwd(backend, q, k, v, causal=True)
    arrays = (do, q, k, v, o, lse)
    keep = [a.copy() for a in arrays]
    tiled_bwd(backend, *arrays, causal=True)
    std_bwd(backend, do, q, k, v, causal=True)
    for a, b in zip(arrays, keep):
        assert np.array_equal(a, b)

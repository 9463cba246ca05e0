"""The 4x4 worked example of seed 000 (scale = 1), number for number.

Each printed matrix is compared twice: with the seed's printed numbers at
their printed precision (within one unit of the last printed decimal: the
seed computes later steps from rounded earlier ones), and with the float64
oracle exactly.  The tile-by-tile trace (``cuflash.trace``) must reproduce
the walk-through's running m, l and unnormalised O after every tile.
"""
import numpy as np
import pytest

import cuflash
import oracle

# the seed's inputs, typed from 000_*.txt
Q = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=np.float64)
K = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
V = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], dtype=np.float64)
DO = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)

# the seed's printed results
S_PRINTED = [[1, 0, 2, 0], [0, 1, 0, 2], [1, 0, 1, 0], [0, 1, 0, 1]]
P_PRINTED = [[0.224, 0.083, 0.610, 0.083], [0.083, 0.224, 0.083, 0.610],
             [0.366, 0.134, 0.366, 0.134], [0.134, 0.366, 0.134, 0.366]]
O_PRINTED = [[7.20, 8.20, 9.20, 10.20], [9.88, 10.88, 11.88, 12.88],
             [6.08, 7.08, 8.08, 9.08], [7.92, 8.92, 9.92, 10.92]]
DV_PRINTED = [[0.590] * 4, [0.217] * 4, [0.976] * 4, [0.217] * 4]
DP_PRINTED = [[10, 26, 42, 58], [0, 0, 0, 0], [10, 26, 42, 58], [0, 0, 0, 0]]
DS_PRINTED = [[-5.57, -0.73, 4.38, 1.91], [0, 0, 0, 0], [-7.42, -0.58, 4.28, 3.72], [0, 0, 0, 0]]
DQ_PRINTED = [[-1.19, 1.18, 4.38, 1.91], [0, 0, 0, 0], [-3.14, 3.14, 4.28, 3.72], [0, 0, 0, 0]]
DK_PRINTED = [[-12.99, 0, -5.57, 0], [-1.31, 0, -0.73, 0], [8.66, 0, 4.38, 0], [5.64, 0, 1.91, 0]]
D_PRINTED = [34.83, 0, 30.30, 0]
WV_NEW_PRINTED = [[0.94, 1.94, 2.94, 3.94], [4.98, 5.98, 6.98, 7.98],
                  [8.90, 9.90, 10.90, 11.90], [12.98, 13.98, 14.98, 15.98]]
WQ0_NEW_PRINTED = [1.12, -0.12, 0.56, -0.19]
WK0_NEW_PRINTED = [2.30, 0, 0.56, 0]


def assert_printed(got, printed, decimals, what, units=1.0):
    """|got - printed| within ``units`` of the last printed decimal, everywhere."""
    got = np.asarray(got, dtype=np.float64)
    printed = np.asarray(printed, dtype=np.float64)
    tol = units * 10.0 ** -decimals + 1e-12
    err = np.abs(got - printed)
    assert got.shape == printed.shape, f"{what}: shape {got.shape} != {printed.shape}"
    assert np.all(err <= tol), (f"{what}: max abs err {err.max():.4f} to the seed's printed "
                                f"numbers (tolerance {tol:.4f})\n{np.round(got, decimals + 2)}")


def fwd(backend, **kw):
    a = backend.asarray
    o, lse = cuflash.tiled_attention(a(Q), a(K), a(V), scale=1.0, return_lse=True,
                                     backend=backend.name, **kw)
    return backend.to_numpy(o), backend.to_numpy(lse)


def test_oracle_reproduces_the_seed():
    # the printed numbers are consistent with the oracle: the seed is read correctly here
    o, lse, p = oracle.attention(Q, K, V, scale=1.0)
    assert_printed(Q @ K.T, S_PRINTED, 0, "S")
    assert_printed(p, P_PRINTED, 3, "P")
    assert_printed(o, O_PRINTED, 2, "O")
    dq, dk, dv = oracle.attention_backward(DO, Q, K, V, scale=1.0)
    assert_printed(dv, DV_PRINTED, 3, "dV")
    assert_printed(dq, DQ_PRINTED, 2, "dQ")
    assert_printed(dk, DK_PRINTED, 2, "dK")


def test_forward(backend):
    ref_o, ref_lse, _ = oracle.attention(Q, K, V, scale=1.0)
    blocks = [(2, 2), (1, 3), (4, 4), (3, 1)] if backend.name == "numpy" else [(None, None)]
    for bq, bkv in blocks:
        o, lse = fwd(backend, block_q=bq, block_kv=bkv)
        assert_printed(o, O_PRINTED, 2, f"O (blocks {bq}x{bkv})")
        oracle.assert_rel_close(o, ref_o, "float64", f"O blocks {bq}x{bkv}")
        oracle.assert_rel_close(lse, ref_lse, "float64", f"lse blocks {bq}x{bkv}")
    # lse of row 0 is the walk-through's m + log(l) after tile 2: 2 + log(l0)
    l0 = (1 + np.exp(-1)) * np.exp(-1) + 1 + np.exp(-2)
    assert abs(lse[0] - (2 + np.log(l0))) < 1e-14
    a = backend.asarray
    so, p = cuflash.standard_attention(a(Q), a(K), a(V), scale=1.0, backend=backend.name)
    so, p = backend.to_numpy(so), backend.to_numpy(p)
    assert_printed(p, P_PRINTED, 3, "P")
    assert_printed(so, O_PRINTED, 2, "O (standard)")
    oracle.assert_rel_close(so, ref_o, "float64", "O standard")


def test_backward(backend):
    a = backend.asarray
    o, lse = fwd(backend)
    refs = oracle.attention_backward(DO, Q, K, V, scale=1.0)
    tiled = [backend.to_numpy(g) for g in cuflash.tiled_attention_backward(
        a(DO), a(Q), a(K), a(V), a(o), a(lse), scale=1.0, backend=backend.name)]
    stored = [backend.to_numpy(g) for g in cuflash.standard_attention_backward(
        a(DO), a(Q), a(K), a(V), scale=1.0, backend=backend.name)]
    for how, (dq, dk, dv) in (("tiled", tiled), ("stored-P", stored)):
        assert_printed(dv, DV_PRINTED, 3, f"dV ({how})")
        assert_printed(dq, DQ_PRINTED, 2, f"dQ ({how})")
        assert_printed(dk, DK_PRINTED, 2, f"dK ({how})")
        for g, r, n in zip((dq, dk, dv), refs, ("dQ", "dK", "dV")):
            oracle.assert_rel_close(g, r, "float64", f"{n} ({how})")
        # rows 1 and 3 get no gradient signal: dQ rows exactly zero
        assert np.all(dq[[1, 3]] == 0)
    # one SGD step with X = I (weights = Q, K, V), learning rate 0.1
    dq, dk, dv = tiled
    assert_printed(V - 0.1 * dv, WV_NEW_PRINTED, 2, "W_V_new")
    assert_printed(Q[0] - 0.1 * dq[0], WQ0_NEW_PRINTED, 2, "W_Q_new[0]")
    assert_printed(K[0] - 0.1 * dk[0], WK0_NEW_PRINTED, 2, "W_K_new[0]")


def test_backward_intermediates():
    # dP, D and dS are intermediates, not API outputs: cuflash.trace.backward_steps keeps them
    from cuflash import trace
    st = trace.backward_steps(DO, Q, K, V, scale=1.0)
    _, _, p = oracle.attention(Q, K, V, scale=1.0)
    dP = DO @ V.T
    D = (DO * oracle.attention(Q, K, V, scale=1.0)[0]).sum(1)   # rowsum(dO * O)
    dS = p * (dP - D[:, None])
    assert_printed(st["dP"], DP_PRINTED, 0, "dP")
    assert_printed(st["dS"], DS_PRINTED, 2, "dS")
    # the seed's D0 = 34.83 is 34.8155 (it summed rounded P * dP); within 2 units
    assert_printed(st["D"], D_PRINTED, 2, "D", units=2)
    for name, ref in (("dP", dP), ("D", D), ("dS", dS), ("P", p)):
        np.testing.assert_allclose(st[name], ref, rtol=1e-13, atol=1e-13, err_msg=name)
    dq, dk, dv = oracle.attention_backward(DO, Q, K, V, scale=1.0)
    for name, ref in (("dQ", dq), ("dK", dk), ("dV", dv)):
        np.testing.assert_allclose(st[name], ref, rtol=1e-13, atol=1e-13, err_msg=name)


# --------------------------------------------------------------------------
# the tile-by-tile trace of the walk-through
# --------------------------------------------------------------------------
E1, E2 = np.exp(-1.0), np.exp(-2.0)


def test_worked_example_inputs():
    from cuflash import trace
    ex = trace.worked_example()
    for name, ref in (("q", Q), ("k", K), ("v", V), ("do", DO)):
        np.testing.assert_array_equal(ex[name], ref, err_msg=name)


def test_trace_reproduces_the_walk_through():
    from cuflash import trace
    tr = trace.trace_forward(Q, K, V, block_q=2, block_kv=2, scale=1.0)
    steps = {(s.i, s.j): s for s in tr.steps}
    assert list(steps) == [(0, 0), (0, 1), (1, 0), (1, 1)], "tile order (0,0) (0,1) (1,0) (1,1)"

    # tile (0,0): Q rows 0-1 x K rows 0-1
    s = steps[(0, 0)]
    assert s.rows == (0, 2) and s.cols == (0, 2)
    assert_printed(s.S, [[1, 0], [0, 1]], 0, "S00")
    assert_printed(s.m_tilde, [1, 1], 0, "m~ tile (0,0)")
    assert np.all(np.isneginf(s.m_old))
    assert_printed(s.m_new, [1, 1], 0, "m after tile (0,0)")
    assert_printed(s.c, [0, 0], 3, "c tile (0,0)")
    assert_printed(s.P_tilde, [[1, 0.368], [0.368, 1]], 3, "P~ tile (0,0)")
    assert_printed(s.l, [1.368, 1.368], 3, "l after tile (0,0)")
    assert_printed(s.O, [[2.84, 4.21, 5.57, 6.94], [5.37, 6.74, 8.10, 9.47]], 2,
                   "O after tile (0,0)")
    # exact values of the same step
    np.testing.assert_allclose(s.l, [1 + E1, 1 + E1], rtol=1e-15)
    np.testing.assert_allclose(s.O[0], V[0] + E1 * V[1], rtol=1e-15)

    # tile (0,1): the max rises from 1 to 2, the correction is e^-1
    s = steps[(0, 1)]
    assert s.rows == (0, 2) and s.cols == (2, 4)
    assert_printed(s.S, [[2, 0], [0, 2]], 0, "S01")
    assert_printed(s.m_old, [1, 1], 0, "m before tile (0,1)")
    assert_printed(s.m_new, [2, 2], 0, "m after tile (0,1)")
    assert_printed(s.c, [0.368, 0.368], 3, "c tile (0,1)")
    assert_printed(s.P_tilde, [[1, 0.135], [0.135, 1]], 3, "P~ tile (0,1)")
    assert_printed(s.l[0], 1.638, 3, "l0 after tile (0,1)")
    assert_printed(s.O[0], [11.81, 13.44, 15.08, 16.71], 2, "O0 after tile (0,1)")
    assert_printed(s.O[1], [16.20, 17.83, 19.47, 21.10], 2, "O1 after tile (0,1)")
    l0 = (1 + E1) * E1 + 1 + E2
    np.testing.assert_allclose(s.l[0], l0, rtol=1e-15)
    np.testing.assert_allclose(s.O[0], (V[0] + E1 * V[1]) * E1 + V[2] + E2 * V[3], rtol=1e-15)

    # end of Q block 0: normalised rows
    res = tr.q_tiles[0]
    assert_printed(res.O, O_PRINTED[:2], 2, "O rows 0-1 after normalisation")
    np.testing.assert_allclose(res.O, res.O_unnormalised / res.l[:, None], rtol=1e-15)

    # every step agrees with an independent replay of the update rule
    m = {0: np.full(2, -np.inf), 1: np.full(2, -np.inf)}
    l = {0: np.zeros(2), 1: np.zeros(2)}
    O = {0: np.zeros((2, 4)), 1: np.zeros((2, 4))}
    for (i, j), s in steps.items():
        S = Q[2 * i:2 * i + 2] @ K[2 * j:2 * j + 2].T
        m_new = np.maximum(m[i], S.max(1))
        c = np.exp(m[i] - m_new)
        P = np.exp(S - m_new[:, None])
        l[i] = l[i] * c + P.sum(1)
        O[i] = O[i] * c[:, None] + P @ V[2 * j:2 * j + 2]
        m[i] = m_new
        for name, got, want in (("m", s.m_new, m_new), ("c", s.c, c), ("P~", s.P_tilde, P),
                                ("l", s.l, l[i]), ("O", s.O, O[i])):
            np.testing.assert_allclose(got, want, rtol=1e-15, err_msg=f"{name} tile ({i},{j})")
    ref_o, ref_lse, _ = oracle.attention(Q, K, V, scale=1.0)
    oracle.assert_rel_close(tr.o, ref_o, "float64", "trace o")
    oracle.assert_rel_close(tr.lse, ref_lse, "float64", "trace lse")


def test_trace_text_shows_the_walk_through_numbers():
    import re
    from cuflash import trace
    text = trace.format_trace(trace.trace_forward(Q, K, V, block_q=2, block_kv=2, scale=1.0))
    for needle in ("0.368", "1.368", "0.135", "[5.37, 6.74, 8.10, 9.47]",
                   "[7.20, 8.20, 9.20, 10.20]", "[9.88, 10.88, 11.88, 12.88]",
                   "[6.08, 7.08, 8.08, 9.08]"):
        assert needle in text, f"{needle!r} not in the trace text:\n{text}"
    # rows the seed rounds by hand (5.57 for 5.5752, 11.81 for 11.804): within one unit
    rows = [np.array([float(x) for x in r.split(",")])
            for r in re.findall(r"\[(-?[\d.]+(?:, -?[\d.]+){3})\]", text)]
    for want in ([2.84, 4.21, 5.57, 6.94], [11.81, 13.44, 15.08, 16.71],
                 [16.20, 17.83, 19.47, 21.10]):
        assert any(np.all(np.abs(r - want) <= 0.0100001) for r in rows), (
            f"no row of the trace text within 0.01 of {want}:\n{text}")


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_trace_causal_skips_tiles_above_the_boundary(causal):
    from cuflash import trace
    tr = trace.trace_forward(Q, K, V, block_q=2, block_kv=2, scale=1.0, causal=causal)
    assert (0, 1) in tr.skipped and (0, 1) not in {(s.i, s.j) for s in tr.steps}
    assert {(s.i, s.j) for s in tr.steps} == {(0, 0), (1, 0), (1, 1)}
    ref_o, _, _ = oracle.attention(Q, K, V, scale=1.0, causal=causal)
    oracle.assert_rel_close(tr.o, ref_o, "float64", "causal trace o")


def test_trace_odd_tiles_match_oracle(rng):
    from cuflash import trace
    q, k, v = oracle.qkv(rng, (11, 5), (13, 5), (13, 3))
    for causal in (False, "bottom_right", "top_left"):
        tr = trace.trace_forward(q, k, v, block_q=3, block_kv=4, causal=causal)
        ref_o, ref_lse, _ = oracle.attention(q, k, v, causal=causal)
        oracle.assert_rel_close(tr.o, ref_o, "float64", f"trace o {causal}")
        oracle.assert_rel_close(tr.lse, ref_lse, "float64", f"trace lse {causal}")

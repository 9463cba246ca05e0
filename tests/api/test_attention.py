"""Forward attention against the float64 oracle (docs/testing.md) and seed 001's list.

standard_attention and tiled_attention (with return_lse) on the testing.md
shape grid: odd lengths, Nq != Nk both ways, both causal alignments (with
rows that see no key), MHA/GQA/MQA, batch, broadcast leading dims, head dims
up to 256, dv != d, every dtype, huge and all-equal logits; plus the
numerical-equivalence, block-size, shape and stress tests of seed 001.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import grid

DTYPES = oracle.DTYPE_NAMES


def forward(backend, q, k, v, *, blocks=(None, None), **kw):
    """tiled_attention(return_lse=True) on the backend; numpy (o, lse).

    Explicit tile sizes go to the reference only: kernels may refuse a size
    they do not support (api.md), and their tile choices have their own tests.
    """
    bq, bkv = blocks if backend.name == "numpy" else (None, None)
    o, lse = cuflash.tiled_attention(backend.asarray(q), backend.asarray(k), backend.asarray(v),
                                     block_q=bq, block_kv=bkv, return_lse=True,
                                     backend=backend.name, **kw)
    return backend.to_numpy(o), backend.to_numpy(lse)


def standard(backend, q, k, v, **kw):
    o, p = cuflash.standard_attention(backend.asarray(q), backend.asarray(k),
                                      backend.asarray(v), backend=backend.name, **kw)
    return backend.to_numpy(o), backend.to_numpy(p)


def check_all(backend, q, k, v, blocks=(None, None), scale=None, causal=False):
    """tiled (o, lse), tiled o alone and standard (o, p) against the oracle."""
    dt = oracle.dtype_name(q.dtype)
    o, lse = forward(backend, q, k, v, blocks=blocks, scale=scale, causal=causal)
    ref_o, ref_lse, ref_p = oracle.attention(q, k, v, scale, causal)
    assert o.dtype == q.dtype, f"o dtype {o.dtype} for {dt} inputs"
    assert lse.dtype == (np.float64 if dt == "float64" else np.float32), f"lse dtype {lse.dtype}"
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    oracle.check_forward(o, q, k, v, scale, causal, lse=lse)

    bq, bkv = blocks if backend.name == "numpy" else (None, None)
    o_only = backend.to_numpy(cuflash.tiled_attention(
        backend.asarray(q), backend.asarray(k), backend.asarray(v), scale=scale, causal=causal,
        block_q=bq, block_kv=bkv, backend=backend.name))
    assert o_only.shape == o.shape
    oracle.check_forward(o_only, q, k, v, scale, causal)

    so, sp = standard(backend, q, k, v, scale=scale, causal=causal)
    assert so.dtype == q.dtype and sp.shape == ref_p.shape, (so.dtype, sp.shape, ref_p.shape)
    oracle.check_forward(so, q, k, v, scale, causal)
    if dt in oracle.LOW_PRECISION:
        _, _, base_p = oracle.attention_lowp(q, k, v, dt, scale, causal)
        oracle.assert_lowp_close(sp, ref_p, base_p, dt, 2, "p")
    else:
        oracle.assert_rel_close(sp, ref_p, dt, "p")
    return o, lse, ref_o, ref_lse


def mk(rng, q_shape, k_shape, v_shape=None, dtype="float64", scale=1.0):
    return oracle.qkv(rng, q_shape, k_shape, v_shape, dtype, scale)


# --------------------------------------------------------------------------
# seed 001: numerical equivalence, non-divisible sizes, block sizes, single block
# --------------------------------------------------------------------------
@pytest.mark.parametrize("N,d,block", [(64, 32, 16), (128, 64, 32), (256, 128, 64)])
def test_basic_equivalence(backend, rng, N, d, block):
    q, k, v = mk(rng, (N, d), (N, d), dtype="float32")
    o, _ = forward(backend, q, k, v, blocks=(block, block))
    so, _ = standard(backend, q, k, v)
    assert o.shape == (N, d)
    assert np.max(np.abs(o.astype(np.float64) - so)) < 1e-5
    oracle.check_forward(o, q, k, v)


@pytest.mark.parametrize("N,block", [(100, 32), (65, 64)])
def test_non_divisible_sizes(backend, rng, N, block):
    q, k, v = mk(rng, (N, 32), (N, 32))
    check_all(backend, q, k, v, blocks=(block, block))


def test_various_block_sizes_same_output(backend, rng):
    q, k, v = mk(rng, (2, 100, 32), (2, 100, 32))
    ref_o, ref_lse, _ = oracle.attention(q, k, v)
    outs = []
    sizes = [8, 16, 32, 64] if backend.name == "numpy" else [None]
    for b in sizes:
        o, lse = forward(backend, q, k, v, blocks=(b, b))
        oracle.assert_rel_close(o, ref_o, "float64", f"o block={b}")
        oracle.assert_rel_close(lse, ref_lse, "float64", f"lse block={b}")
        outs.append(o)
    for b, o in zip(sizes, outs):
        # "identical" up to float64 rounding of the different summation orders
        assert np.max(np.abs(o - outs[0])) < 1e-13, f"block {b} differs from block {sizes[0]}"


@pytest.mark.reference_only
@pytest.mark.parametrize("bq,bkv", [(1, 100), (100, 1), (7, 33), (33, 7), (3, 64), (64, 200)])
def test_unequal_block_sizes(backend, rng, bq, bkv):
    q, k, v = mk(rng, (3, 97, 24), (3, 113, 24))
    for causal in (False, "bottom_right", "top_left"):
        check_all(backend, q, k, v, blocks=(bq, bkv), causal=causal)


@pytest.mark.parametrize("N", [16, 50])
def test_single_block_matches_standard(backend, rng, N):
    q, k, v = mk(rng, (N, 32), (N, 32))
    o, _ = forward(backend, q, k, v, blocks=(N, N))
    o2, _ = forward(backend, q, k, v, blocks=(4 * N, 4 * N))
    so, _ = standard(backend, q, k, v)
    assert np.max(np.abs(o - so)) < 1e-14
    assert np.max(np.abs(o2 - so)) < 1e-14
    oracle.check_forward(o, q, k, v)


# --------------------------------------------------------------------------
# the testing.md grid (sampled, not the full product)
# --------------------------------------------------------------------------
CAUSALS = (False, "bottom_right", "top_left", True)
LENGTHS = (1, 2, 5, 17, 97, 113, 128, 200, 255)
# (N, d, dtype, causal, (block_q, block_kv)) - dtype and causal cycle so each appears at
# several lengths; blocks are not tile multiples of anything in particular
ODD = [(n, (16, 32, 64, 96)[i % 4], DTYPES[i % 4], CAUSALS[i % 4],
        ((None, None), (16, 16), (7, 33), (64, 32), (13, 5))[i % 5])
       for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("N,d,dtype,causal,blocks",
                         grid(ODD, emulator=lambda c: c[0] in (1, 5, 17, 97, 128)))
def test_odd_lengths(backend, rng, N, d, dtype, causal, blocks):
    q, k, v = mk(rng, (2, N, d), (2, N, d), dtype=dtype)
    check_all(backend, q, k, v, blocks=blocks, causal=causal)


PAIRS = ((113, 203), (203, 113), (1, 147), (127, 128), (128, 127))
UNEQUAL = [(nq, nk, c, DTYPES[(i + j) % 4]) for i, (nq, nk) in enumerate(PAIRS)
           for j, c in enumerate((False, "bottom_right", "top_left"))]


@pytest.mark.parametrize("Nq,Nk,causal,dtype",
                         grid(UNEQUAL, emulator=lambda c: c[:2] in ((203, 113), (1, 147),
                                                                    (127, 128))))
def test_nq_ne_nk(backend, rng, Nq, Nk, causal, dtype):
    q, k, v = mk(rng, (1, 2, Nq, 32), (1, 2, Nk, 32), dtype=dtype)
    o, lse, ref_o, ref_lse = check_all(backend, q, k, v, blocks=(32, 48), causal=causal)
    # rows that see no key: exactly 0 and -inf (bottom_right with Nq > Nk)
    blind = ~oracle.visible(Nq, Nk, causal).any(axis=1)
    if blind.any():
        assert np.all(o[..., blind, :] == 0), "rows that see no key must be exactly 0"
        assert np.all(lse[..., blind] == -np.inf), "lse of rows that see no key must be -inf"
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("causal", ["bottom_right", True, "top_left"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_that_see_no_key(backend, rng, causal, dtype):
    # Nq > Nk, bottom-right aligned: the first Nq - Nk rows see nothing (o=0, lse=-inf)
    Nq, Nk = 37, 20
    q, k, v = mk(rng, (2, Nq, 16), (2, Nk, 16), dtype=dtype)
    o, lse, _, _ = check_all(backend, q, k, v, blocks=(8, 8), causal=causal)
    blind = ~oracle.visible(Nq, Nk, causal).any(axis=1)
    assert blind.sum() == (Nq - Nk if causal != "top_left" else 0)
    assert np.all(o[:, blind] == 0) and np.all(lse[:, blind] == -np.inf)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[:, ~blind]))


def test_causal_alignments_differ_and_agree(backend, rng):
    # equal lengths: the two alignments are one mask; unequal: they are different masks
    q, k, v = mk(rng, (40, 16), (40, 16))
    a, _ = forward(backend, q, k, v, causal="bottom_right")
    b, _ = forward(backend, q, k, v, causal="top_left")
    c, _ = forward(backend, q, k, v, causal=True)
    assert np.max(np.abs(a - b)) < 1e-14 and np.array_equal(a, c)
    q2 = q[:25]
    a, _ = forward(backend, q2, k, v, causal="bottom_right")
    b, _ = forward(backend, q2, k, v, causal="top_left")
    assert np.max(np.abs(a - b)) > 1e-3
    oracle.check_forward(a, q2, k, v, causal="bottom_right")
    oracle.check_forward(b, q2, k, v, causal="top_left")


# heads: MHA 6/6, GQA 6/2, MQA 6/1; batch 1 and > 1; broadcast leading dims
HEADS = [
    ((1, 6, 65, 32), (1, 6, 65, 32), None, False, "float32"),
    ((2, 6, 65, 32), (2, 2, 65, 32), None, "bottom_right", "float64"),
    ((2, 6, 33, 32), (2, 1, 70, 32), None, "top_left", "float16"),
    ((1, 6, 97, 64), (1, 2, 50, 64), None, "bottom_right", "bfloat16"),
    ((3, 6, 20, 16), (3, 3, 20, 16), None, False, "float64"),      # GQA 6/3
    ((2, 6, 20, 16), (1, 2, 20, 16), None, "top_left", "float64"),  # GQA + batch broadcast
    ((4, 20, 16), (20, 16), None, False, "float64"),                # k, v shared by the batch
    ((20, 16), (3, 20, 16), None, False, "float64"),                # q shared
    ((2, 1, 20, 16), (1, 3, 20, 16), None, "bottom_right", "float64"),  # outer product
    ((2, 4, 20, 16), (2, 4, 20, 16), (2, 1, 20, 16), False, "float64"),  # v broadcast vs k
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,causal,dtype",
                         grid(HEADS, emulator=(0, 1, 2, 3, 6)))
def test_heads_and_batch(backend, rng, q_shape, k_shape, v_shape, causal, dtype):
    q, k, v = mk(rng, q_shape, k_shape, v_shape, dtype=dtype)
    o, lse, ref_o, _ = check_all(backend, q, k, v, blocks=(16, 24), causal=causal)
    out_lead, _, group = oracle.lead_mapping(q.shape[:-2],
                                             np.broadcast_shapes(k.shape[:-2], v.shape[:-2]))
    assert o.shape == tuple(out_lead) + (q.shape[-2], v.shape[-1])


def test_gqa_head_order(backend, rng):
    # query head h reads kv head h // (H // Hk): heads 0-2 -> kv 0, heads 3-5 -> kv 1
    q, k, v = mk(rng, (1, 6, 9, 16), (1, 2, 9, 16))
    o, _ = forward(backend, q, k, v)
    for h in range(6):
        ref, _, _ = oracle.attention(q[:, h], k[:, h // 3], v[:, h // 3])
        oracle.assert_rel_close(o[:, h], ref, "float64", f"head {h}")


HEAD_DIMS = [(16, "float16"), (32, "bfloat16"), (59, "float64"), (64, "float32"),
             (96, "float16"), (128, "bfloat16"), (256, "float32"), (256, "float64"),
             (128, "float16")]


@pytest.mark.parametrize("d,dtype", grid(HEAD_DIMS, emulator=lambda c: c[0] in (16, 64, 128, 256),
                                          reference_only=lambda c: c[0] == 59))
def test_head_dims(backend, rng, d, dtype):
    causal = "bottom_right" if d % 3 else False
    q, k, v = mk(rng, (2, 45, d), (2, 70, d), dtype=dtype)
    check_all(backend, q, k, v, blocks=(32, 17), causal=causal)


@pytest.mark.reference_only
@pytest.mark.parametrize("d,dv,causal", [(32, 48, False), (64, 16, "top_left"),
                                         (5, 1, "bottom_right"), (1, 7, False)])
def test_dv_ne_d(backend, rng, d, dv, causal):
    q, k, v = mk(rng, (2, 3, 31, d), (2, 3, 40, d), (2, 3, 40, dv))
    o, lse, _, _ = check_all(backend, q, k, v, blocks=(8, 12), causal=causal)
    assert o.shape == (2, 3, 31, dv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
def test_dtypes(backend, rng, dtype, causal):
    q, k, v = mk(rng, (2, 2, 77, 64), (2, 2, 77, 64), dtype=dtype)
    check_all(backend, q, k, v, blocks=(32, 32), causal=causal)


@pytest.mark.parametrize("scale", [1.0, 0.05, 2.5])
def test_explicit_scale(backend, rng, scale):
    q, k, v = mk(rng, (3, 30, 16), (3, 41, 16))
    check_all(backend, q, k, v, scale=scale, blocks=(8, 8), causal="top_left")


def test_default_scale_is_inverse_sqrt_d(backend, rng):
    q, k, v = mk(rng, (20, 25), (20, 25))
    a, _ = forward(backend, q, k, v)
    b, _ = forward(backend, q, k, v, scale=0.2)
    assert np.max(np.abs(a - b)) < 1e-14


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_logits_of_magnitude_1e4(backend, rng, dtype, causal):
    # logits of order 1e4: a softmax without the running max overflows exp.  Integer
    # inputs and a power-of-two scale make every logit exact in every dtype's
    # accumulation (float32 included), so the usual tolerance applies: a float32 logit
    # of 1e4 that had been rounded would move by ~1e-3 and no float32 code could meet 1e-5.
    dt = oracle.dtype_of(dtype)
    q = rng.integers(-50, 51, (2, 50, 16)).astype(dt)
    k = rng.integers(-50, 51, (2, 60, 16)).astype(dt)
    v = oracle.randn(rng, (2, 60, 16), dtype)
    o, lse, ref_o, ref_lse = check_all(backend, q, k, v, scale=0.25, blocks=(16, 16),
                                       causal=causal)
    assert np.all(np.isfinite(oracle.f64(o))) and np.all(np.isfinite(lse))
    assert np.max(np.abs(ref_lse)) > 2e3  # the test really reaches huge logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_equal_logits(backend, rng, dtype):
    # q = 0: every logit equal, p uniform, o = mean of the visible v rows
    q = np.zeros((2, 33, 16)).astype(oracle.dtype_of(dtype))
    k = oracle.randn(rng, (2, 47, 16), dtype)
    v = oracle.randn(rng, (2, 47, 16), dtype)
    o, lse, _, _ = check_all(backend, q, k, v, blocks=(8, 8), causal="bottom_right")
    vis = oracle.visible(33, 47, "bottom_right")
    ref = np.stack([(vis / vis.sum(1, keepdims=True)) @ oracle.f64(v[b]) for b in range(2)])
    tol = 1e-12 if dtype == "float64" else 1e-5 if dtype == "float32" else 2e-2
    assert np.max(np.abs(oracle.f64(o) - ref)) < tol * np.max(np.abs(ref))
    np.testing.assert_allclose(lse[0], np.log(vis.sum(1)), rtol=1e-6 if dtype != "float64"
                               else 1e-14)


def test_minus_inf_like_logits(backend, rng):
    # keys pushed to -1e30 act as a mask: they must get (numerically) zero weight
    q, k, v = mk(rng, (2, 20, 8), (2, 30, 8))
    q[..., 0] = 1.0
    k[:, 10:20, 0] = -1e30
    o, lse, ref_o, _ = check_all(backend, q, k, v, scale=1.0, blocks=(8, 8))
    keep = np.r_[0:10, 20:30]
    ref_masked, _, _ = oracle.attention(q, k[:, keep], v[:, keep], 1.0)
    oracle.assert_rel_close(o, ref_masked, "float64", "o with -1e30 keys")


# --------------------------------------------------------------------------
# seed 001: shapes, stress, small blocks, determinism
# --------------------------------------------------------------------------
def test_output_shapes(backend, rng):
    for q_shape, k_shape in [((30, 16), (30, 16)), ((3, 30, 16), (3, 30, 16)),
                             ((2, 4, 30, 16), (2, 4, 30, 16))]:
        q, k, v = mk(rng, q_shape, k_shape)
        o, lse = forward(backend, q, k, v)
        so, p = standard(backend, q, k, v)
        assert o.shape == so.shape == q_shape
        assert lse.shape == q_shape[:-1]
        assert p.shape == q_shape[:-1] + (k_shape[-2],)


@pytest.mark.full_grid
def test_stress_large_n(backend, rng):
    N, d = 2048, 64
    q, k, v = mk(rng, (N, d), (N, d), dtype="float32")
    o, lse = forward(backend, q, k, v, blocks=(64, 64))
    so, _ = standard(backend, q, k, v)
    assert np.all(np.isfinite(o))
    oracle.check_forward(o, q, k, v, lse=lse)
    assert np.max(np.abs(o.astype(np.float64) - so)) < 1e-5
    # "no memory explosion": the instrumented forward never holds an (N, N) array
    if backend.name == "numpy":
        o2, biggest = cuflash.verify_no_full_materialization(q, k, v, 64)
        assert biggest < N * N // 16, f"largest intermediate {biggest} at N={N}, block 64"


def test_small_block_size(backend, rng):
    q, k, v = mk(rng, (64, 32), (64, 32))
    o, lse = forward(backend, q, k, v, blocks=(4, 4))
    oracle.check_forward(o, q, k, v, lse=lse)
    o, lse = forward(backend, q, k, v, blocks=(4, 4), causal=True)
    oracle.check_forward(o, q, k, v, lse=lse, causal=True)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_determinism(backend, rng, dtype):
    q, k, v = mk(rng, (2, 3, 100, 32), (2, 3, 100, 32), dtype=dtype)
    first = forward(backend, q, k, v, blocks=(32, 16), causal=True)
    for _ in range(2):
        again = forward(backend, q, k, v, blocks=(32, 16), causal=True)
        assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])


# --------------------------------------------------------------------------
# random tiles (fuzz): any block sizes, any lengths, the reference must honour them
# --------------------------------------------------------------------------
@pytest.mark.reference_only
@pytest.mark.parametrize("draw", range(6))
def test_random_tiles(backend, rng, draw):
    Nq, Nk = (int(x) for x in rng.integers(1, 160, 2))
    d, dv = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    bq, bkv = (int(x) for x in rng.integers(1, 140, 2))
    causal = (False, "bottom_right", "top_left")[draw % 3]
    dtype = DTYPES[draw % 4]
    q, k, v = mk(rng, (2, Nq, d), (2, Nk, d), (2, Nk, dv), dtype=dtype)
    check_all(backend, q, k, v, blocks=(bq, bkv), causal=causal)


# --------------------------------------------------------------------------
# the oracle and the tolerance rules themselves
# --------------------------------------------------------------------------
def test_oracle_agrees_with_torch_sdpa(rng):
    # an independent implementation of the same definition, including GQA and both
    # causal alignments (SDPA's is_causal is top_left; bottom_right via an explicit mask)
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = mk(rng, (2, 6, 13, 8), (2, 2, 17, 8), (2, 2, 17, 5))
    do = rng.standard_normal((2, 6, 13, 5))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    for causal in (False, "top_left", "bottom_right"):
        mask = torch.tensor(oracle.visible(13, 17, causal))
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True,
                                             scale=0.3)
        ref, _, _ = oracle.attention(q, k, v, 0.3, causal)
        np.testing.assert_allclose(out.detach().numpy(), ref, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad(out, (tq, tk, tv), torch.tensor(do))
        mine = oracle.attention_backward(do, q, k, v, 0.3, causal)
        for g, m, n in zip(grads, mine, "qkv"):
            np.testing.assert_allclose(g.numpy(), m, rtol=1e-11, atol=1e-12, err_msg=f"d{n}")


def test_tolerance_rules_can_fail(rng):
    q, k, v = mk(rng, (40, 16), (50, 16), dtype="float16")
    ref, _, _ = oracle.attention(q, k, v)
    base, _, _ = oracle.attention_lowp(q, k, v, "float16")
    base_err = np.max(np.abs(base - ref))
    assert base_err > 0
    oracle.assert_lowp_close(ref.astype(np.float16), ref, base, "float16", 2)
    bad = ref.copy()
    bad[3, 4] += 3 * base_err + 1e-2
    with pytest.raises(AssertionError, match="max abs err"):
        oracle.assert_lowp_close(bad, ref, base, "float16", 2)
    with pytest.raises(AssertionError, match="max abs err"):
        oracle.assert_rel_close(ref * (1 + 1e-11), ref, "float64")
    nan = ref.copy()
    nan[0, 0] = np.nan   # an unwritten (poisoned) element fails
    with pytest.raises(AssertionError):
        oracle.assert_rel_close(nan, ref, "float64")
    with pytest.raises(AssertionError):
        oracle.assert_lowp_close(nan, ref, base, "float16", 2)
    poison = oracle.poisoned((3, 4), "bfloat16")
    assert oracle.dtype_name(poison.dtype) == "bfloat16" and np.isnan(oracle.f64(poison)).all()

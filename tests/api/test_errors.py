"""The error table of docs/api.md, inputs never modified, empty and non-finite inputs.

Every public function that takes q, k, v is checked for every row of the
table that applies to it; messages must name the shapes involved.
"""
import numpy as np
import pytest

import cuflash
import oracle


def call(backend, fn, q, k, v, **kw):
    """Call a public function by name with q, k, v (and do/o/lse made up for backwards)."""
    a = backend.asarray
    if fn == "standard_attention":
        return cuflash.standard_attention(a(q), a(k), a(v), backend=backend.name, **kw)
    if fn == "tiled_attention":
        return cuflash.tiled_attention(a(q), a(k), a(v), backend=backend.name, **kw)
    if fn == "verify_no_full_materialization":
        return cuflash.verify_no_full_materialization(a(q), a(k), a(v), kw.pop("block_size", 8),
                                                      backend=backend.name, **kw)
    # backwards: do/o/lse of plausible shape, so the error must come from q, k, v
    lead = q.shape[:-2] if q.ndim >= 2 else ()
    Nq = q.shape[-2] if q.ndim >= 2 else 1
    dv = v.shape[-1] if v.ndim >= 1 else 1
    do = np.ones(lead + (Nq, dv), dtype=q.dtype if q.dtype.kind == "f" else np.float64)
    if fn == "standard_attention_backward":
        return cuflash.standard_attention_backward(a(do), a(q), a(k), a(v),
                                                   backend=backend.name, **kw)
    lse = np.zeros(lead + (Nq,), dtype=np.float32)
    return cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(do.copy()), a(lse),
                                            backend=backend.name, **kw)


QKV_FUNCS = ["standard_attention", "tiled_attention", "standard_attention_backward",
             "tiled_attention_backward", "verify_no_full_materialization"]


def f(*shape, dtype=np.float64):
    return np.ones(shape, dtype=dtype)


def assert_names_shapes(err, *shapes):
    msg = str(err.value)
    for s in shapes:
        assert str(tuple(s)) in msg, f"message does not name shape {tuple(s)}: {msg!r}"


# --------------------------------------------------------------------------
# ValueError naming the shapes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("fn", QKV_FUNCS)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_fewer_than_two_dims(backend, fn, which):
    arrays = [f(4, 8), f(5, 8), f(5, 8)]
    arrays[which] = f(8)
    with pytest.raises(ValueError) as e:
        call(backend, fn, *arrays)
    assert_names_shapes(e, (8,))


@pytest.mark.parametrize("fn", QKV_FUNCS)
def test_head_dim_of_q_and_k_differ(backend, fn):
    with pytest.raises(ValueError) as e:
        call(backend, fn, f(4, 8), f(5, 7), f(5, 7))
    assert_names_shapes(e, (4, 8), (5, 7))


@pytest.mark.parametrize("fn", QKV_FUNCS)
def test_nk_of_k_and_v_differ(backend, fn):
    with pytest.raises(ValueError) as e:
        call(backend, fn, f(4, 8), f(5, 8), f(6, 8))
    assert_names_shapes(e, (5, 8), (6, 8))


@pytest.mark.parametrize("fn", QKV_FUNCS)
@pytest.mark.parametrize("q_shape,k_shape", [
    ((2, 6, 4, 8), (2, 4, 5, 8)),   # 4 kv heads do not divide 6 query heads
    ((3, 4, 8), (2, 5, 8)),         # batch 3 vs 2
    ((2, 6, 4, 8), (3, 2, 5, 8)),   # grouped heads, but batch 2 vs 3
])
def test_leading_dims_neither_broadcast_nor_grouped(backend, fn, q_shape, k_shape):
    with pytest.raises(ValueError) as e:
        call(backend, fn, f(*q_shape), f(*k_shape), f(*k_shape))
    assert_names_shapes(e, q_shape, k_shape)


# --------------------------------------------------------------------------
# TypeError for dtypes
# --------------------------------------------------------------------------
BAD_DTYPES = [np.int32, np.int64, np.uint8, np.bool_, np.complex128, object]


@pytest.mark.parametrize("fn", QKV_FUNCS)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bad_dtype(backend, fn, dtype):
    for which in range(3):
        arrays = [f(4, 8), f(5, 8), f(5, 8)]
        arrays[which] = np.ones(arrays[which].shape, dtype=dtype)
        if backend.is_cuda and dtype is object:
            continue  # cupy cannot even hold object arrays
        with pytest.raises(TypeError):
            call(backend, fn, *arrays)


@pytest.mark.parametrize("fn", QKV_FUNCS)
def test_dtypes_differ(backend, fn):
    with pytest.raises(TypeError):
        call(backend, fn, f(4, 8), f(5, 8, dtype=np.float32), f(5, 8))
    with pytest.raises(TypeError):
        call(backend, fn, f(4, 8, dtype=np.float16), f(5, 8, dtype=np.float16),
             f(5, 8, dtype=oracle.BFLOAT16))


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.complex64], ids=lambda d: np.dtype(d).name)
def test_online_softmax_bad_dtype(backend, dtype):
    x = backend.asarray(np.ones(10, dtype=dtype))
    with pytest.raises(TypeError):
        cuflash.online_softmax(x, backend=backend.name)
    with pytest.raises(TypeError):
        cuflash.online_softmax_2d(backend.asarray(np.ones((3, 10), dtype=dtype)),
                                  backend=backend.name)


# --------------------------------------------------------------------------
# block sizes / chunk sizes not positive ints
# --------------------------------------------------------------------------
BAD_SIZES = [0, -1, -32, 2.5, 16.0, "16", [16]]


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
def test_bad_block_sizes(backend, bad):
    q, k, v = f(10, 8), f(12, 8), f(12, 8)
    for kw in ({"block_q": bad}, {"block_kv": bad}):
        with pytest.raises(ValueError):
            call(backend, "tiled_attention", q, k, v, **kw)
        with pytest.raises(ValueError):
            call(backend, "tiled_attention_backward", q, k, v, **kw)
    with pytest.raises(ValueError):
        call(backend, "verify_no_full_materialization", q, k, v, block_size=bad)
    for kw in ({"block_q": bad}, {"block_kv": bad}):
        with pytest.raises(ValueError):
            cuflash.memory_analysis(128, 64, backend=backend.name, **kw)


@pytest.mark.parametrize("bad", BAD_SIZES, ids=repr)
def test_bad_chunk_size(backend, bad):
    x = backend.asarray(np.arange(10.0))
    with pytest.raises(ValueError):
        cuflash.online_softmax(x, bad, backend=backend.name)
    with pytest.raises(ValueError):
        cuflash.online_softmax_2d(backend.asarray(np.ones((2, 10))), bad, backend=backend.name)


def test_tiles_beyond_shared_memory(backend):
    # kernels must refuse tiles that do not fit the device's shared memory, stating the budget
    if backend.name == "numpy":
        pytest.skip("the NumPy reference has no shared-memory budget; any tile is honoured")
    q, k, v = f(300, 256), f(300, 256), f(300, 256)
    with pytest.raises(ValueError) as e:
        call(backend, "tiled_attention", q, k, v, block_q=4096, block_kv=4096)
    assert "shared" in str(e.value).lower(), str(e.value)


def test_reference_honours_any_tile(rng):
    # "explicit sizes are honoured ... never silently changed": the reference takes any size
    q, k, v = oracle.qkv(rng, (50, 8), (60, 8))
    for bq, bkv in ((1, 1), (3, 7), (1000, 1000)):
        o = cuflash.tiled_attention(q, k, v, block_q=bq, block_kv=bkv, backend="numpy")
        oracle.check_forward(o, q, k, v)


# --------------------------------------------------------------------------
# unknown causal
# --------------------------------------------------------------------------
@pytest.mark.parametrize("fn", QKV_FUNCS[:4])
@pytest.mark.parametrize("bad", ["diagonal", "bottom-right", "TOP_LEFT", 2, "True"])
def test_unknown_causal(backend, fn, bad):
    with pytest.raises(ValueError) as e:
        call(backend, fn, f(4, 8), f(5, 8), f(5, 8), causal=bad)
    msg = str(e.value)
    assert "bottom_right" in msg and "top_left" in msg, f"choices not listed: {msg!r}"


# --------------------------------------------------------------------------
# inconsistent do / o / lse in a backward call
# --------------------------------------------------------------------------
def test_backward_inconsistent_shapes(backend):
    a = backend.asarray
    q, k, v = f(2, 10, 8), f(2, 12, 8), f(2, 12, 4)
    do, o, lse = f(2, 10, 4), f(2, 10, 4), np.zeros((2, 10), np.float64)
    bad = {"do": [f(2, 10, 8), f(2, 11, 4), f(10, 4), f(3, 10, 4)],
           "o": [f(2, 10, 8), f(2, 9, 4), f(1, 10, 4)],
           "lse": [np.zeros((2, 11)), np.zeros((2, 10, 1)), np.zeros((10,)), np.zeros((3, 10))]}
    for name, cases in bad.items():
        for x in cases:
            args = {"do": do, "o": o, "lse": lse}
            args[name] = x
            with pytest.raises(ValueError) as e:
                cuflash.tiled_attention_backward(a(args["do"]), a(q), a(k), a(v), a(args["o"]),
                                                 a(args["lse"]), backend=backend.name)
            assert str(tuple(x.shape)) in str(e.value), f"{name}: {e.value}"
            if name == "do":
                with pytest.raises(ValueError):
                    cuflash.standard_attention_backward(a(x), a(q), a(k), a(v),
                                                        backend=backend.name)


# --------------------------------------------------------------------------
# NaN / Inf propagate to the rows they touch, no exception
# --------------------------------------------------------------------------
def _fwd(backend, q, k, v, **kw):
    o, lse = cuflash.tiled_attention(backend.asarray(q), backend.asarray(k), backend.asarray(v),
                                     return_lse=True, backend=backend.name, **kw)
    return backend.to_numpy(o), backend.to_numpy(lse)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_in_q_stays_in_its_row(backend, rng, bad):
    q, k, v = oracle.qkv(rng, (2, 3, 20, 8), (2, 3, 25, 8))
    q[1, 2, 7, 3] = bad
    with np.errstate(invalid="ignore", over="ignore"):
        o, lse = _fwd(backend, q, k, v, causal="top_left")
    touched = np.zeros(o.shape[:-1], bool)
    touched[1, 2, 7] = True
    assert not np.all(np.isfinite(o[touched])) or bad == -np.inf
    clean = q.copy()
    clean[1, 2, 7] = 0
    ref, ref_lse, _ = oracle.attention(clean, k, v, causal="top_left")
    np.testing.assert_allclose(o[~touched], ref[~touched], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse[~touched], ref_lse[~touched], rtol=1e-12)


def test_nan_in_k_touches_only_rows_that_see_it(backend, rng):
    # GQA 4/2: kv head 1 feeds query heads 2, 3; key 15 is seen (top_left) by rows >= 15
    q, k, v = oracle.qkv(rng, (2, 4, 20, 8), (2, 2, 25, 8))
    k[0, 1, 15, 2] = np.nan
    with np.errstate(invalid="ignore"):
        o, _ = _fwd(backend, q, k, v, causal="top_left")
    ref, _, _ = oracle.attention(q, np.nan_to_num(k), v, causal="top_left")
    sees = np.zeros(o.shape[:-1], bool)
    sees[0, 2:4, 15:] = True
    assert np.isnan(o[sees]).all(axis=-1).all(), "rows that see the NaN key must be NaN"
    other = np.ones(o.shape[:-1], bool)
    other[0, 2:4] = False  # the rows of these heads before 15 may or may not be touched
    np.testing.assert_allclose(o[other], ref[other], rtol=1e-12, atol=1e-13)


def test_nan_in_v_stays_in_its_head(backend, rng):
    q, k, v = oracle.qkv(rng, (3, 20, 8), (3, 25, 8))
    v[2, 4, 1] = np.nan
    with np.errstate(invalid="ignore"):
        o, lse = _fwd(backend, q, k, v)
    assert np.isnan(o[2, :, 1]).all()
    assert np.all(np.isfinite(lse))  # v does not enter the softmax
    ref, _, _ = oracle.attention(q[:2], k[:2], v[:2])
    np.testing.assert_allclose(o[:2], ref, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------
# empty inputs
# --------------------------------------------------------------------------
@pytest.mark.parametrize("Nq,Nk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(backend, Nq, Nk):
    q, k, v = f(2, Nq, 8), f(2, Nk, 8), f(2, Nk, 6)
    a = backend.asarray
    o, lse = _fwd(backend, q, k, v)
    assert o.shape == (2, Nq, 6) and lse.shape == (2, Nq)
    assert np.all(o == 0) and np.all(lse == -np.inf)
    so, p = cuflash.standard_attention(a(q), a(k), a(v), backend=backend.name)
    so, p = backend.to_numpy(so), backend.to_numpy(p)
    assert so.shape == (2, Nq, 6) and p.shape == (2, Nq, Nk) and np.all(so == 0)
    do = np.ones((2, Nq, 6))
    for grads in (backend.to_numpy(g) for g in cuflash.tiled_attention_backward(
            a(do), a(q), a(k), a(v), a(o), a(lse), backend=backend.name)), \
            (backend.to_numpy(g) for g in cuflash.standard_attention_backward(
                a(do), a(q), a(k), a(v), backend=backend.name)):
        dq, dk, dv = grads
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


# --------------------------------------------------------------------------
# inputs never modified; non-contiguous inputs accepted
# --------------------------------------------------------------------------
def test_inputs_never_modified(backend, rng):
    q, k, v = oracle.qkv(rng, (2, 30, 16), (2, 35, 16))
    keep = [x.copy() for x in (q, k, v)]
    for fn in QKV_FUNCS:
        call(backend, fn, q, k, v, **({"causal": True} if fn != QKV_FUNCS[-1] else {}))
        for x, y in zip((q, k, v), keep):
            assert np.array_equal(x, y), f"{fn} modified an input"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_non_contiguous_inputs(backend, rng, dtype):
    base_q = oracle.randn(rng, (2, 16, 60, 3), dtype)
    base_k = oracle.randn(rng, (16, 2, 80), dtype)
    base_v = oracle.randn(rng, (2, 80, 32), dtype)
    q = base_q[..., 1].swapaxes(-1, -2)[:, ::2, :]     # (2, 30, 16), strided and transposed
    k = base_k.transpose(1, 2, 0)[:, ::2]              # (2, 40, 16), Fortran-like
    v = base_v[:, ::2, ::2]                            # (2, 40, 16), strided
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    keep = [x.copy() for x in (base_q, base_k, base_v)]
    o, lse = _fwd(backend, q, k, v, causal=True)
    oracle.check_forward(o, q, k, v, causal=True, lse=lse)
    do = oracle.randn(rng, (2, 16, 30), dtype).swapaxes(-1, -2)  # non-contiguous do too
    a = backend.asarray
    grads = [backend.to_numpy(g) for g in cuflash.tiled_attention_backward(
        a(do), a(q), a(k), a(v), a(o), a(lse), causal=True, backend=backend.name)]
    oracle.check_backward(grads, do, q, k, v, causal=True)
    for x, y in zip((base_q, base_k, base_v), keep):
        assert np.array_equal(x, y)


def test_mixed_array_libraries_name_each_argument():
    """A NumPy bias beside CuPy q/k/v: the TypeError says which argument is of which library
    (a stand-in class from a module named cupy: dispatch decides by the class's module)."""
    fake_cupy = type("ndarray", (), {"__module__": "cupy._core.core"})
    q = k = v = fake_cupy()
    with pytest.raises(TypeError, match=r"q is cupy, k is cupy, v is cupy, bias is numpy"):
        cuflash.tiled_attention(q, k, v, bias=np.zeros((4, 4), np.float32))
    with pytest.raises(TypeError, match=r"q is numpy, k is cupy"):
        cuflash.tiled_attention(np.zeros((4, 8), np.float32), k, v)


@pytest.mark.parametrize("fn", QKV_FUNCS[:4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(backend, fn, bad):
    """A NaN or infinite scale is refused (it used to give NaN on NumPy and uniform attention on
    the tensor-core kernels, which read it as 0)."""
    q = np.ones((4, 16), np.float32)
    with pytest.raises(ValueError, match="scale must be finite"):
        call(backend, fn, q, q, q, scale=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_scale_serving(backend, bad):
    a = backend.asarray
    q = np.ones((1, 2, 1, 16), np.float32)
    cache = np.ones((1, 2, 8, 16), np.float32)
    with pytest.raises(ValueError, match="scale must be finite"):
        cuflash.attention_with_kvcache(a(q), a(cache), a(cache), cache_seqlens=a(np.array([4], np.int32)),
                                       scale=bad, backend=backend.name)
    x = np.ones((5, 2, 16), np.float32)
    cu = np.array([0, 2, 5], np.int32)
    with pytest.raises(ValueError, match="scale must be finite"):
        cuflash.varlen_attention(a(x), a(x), a(x), a(cu), a(cu), scale=bad, backend=backend.name)


def test_kernels_refuse_empty_head_dims_pointing_to_numpy(rng):
    """d = 0: NumPy computes it (every logit 0); the kernels refuse it, saying NumPy takes it (the
    message spoke of larger head dims)."""
    from conftest import require_backend
    require_backend("emulator")
    q = np.zeros((3, 0), np.float32)
    v = np.ones((3, 4), np.float32)
    assert cuflash.tiled_attention(q, q, v).shape == (3, 4)
    with pytest.raises(ValueError, match=r"got d=0; backend='numpy' takes empty head dims"):
        cuflash.tiled_attention(q, q, v, backend="emulator")

"""The logit features of ``mask(scale * Q K^T + bias)``: bias (and dbias), sliding window,
ALiBi, softcap and reproducible dropout -- on every backend, forward and backward.

Written once over the backend ("numpy", "emulator", and "cuda" when present),
against the float64 oracle of ``tests/oracle.py``, which builds the full
biased, masked (Nq, Nk) logits per problem with its own Philox.  Kernel
outputs are poisoned with NaN before the launch.  Emulated cases share a few
specialisations (float32 d=32, float64 d=16, float16 d=32, bfloat16 d=16 with
default tiles) to keep compile time down.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import poisoned_outputs

# Random123's known-answer vectors for Philox4x32-10: (counter, key, output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _feat_id(feat):
    parts = []
    for key, val in feat.items():
        if key in ("bias", "alibi_slopes"):
            parts.append(f"{key}{'x'.join(map(str, val))}")
        elif key != "seed":
            parts.append(f"{key}{val}")
    return "-".join(parts) or "plain"


def _materialise(rng, feat, dtype):
    """Turn the shapes of a case's bias / alibi_slopes into arrays."""
    out = dict(feat)
    if "bias" in feat:
        b = rng.standard_normal(feat["bias"]) * 2.0
        out["bias"] = b.astype(np.float64 if dtype == "float64" else np.float32)
    if "alibi_slopes" in feat:
        out["alibi_slopes"] = (rng.random(feat["alibi_slopes"]) * 0.5).astype(
            np.float64 if dtype == "float64" else np.float32)
    if "dropout_p" in feat and "seed" not in feat:
        out["seed"] = int(rng.integers(0, 2 ** 63))
    return out


def _forward(backend, q, k, v, feat, **kw):
    a = backend.asarray
    fa = {n: (a(x) if n in ("bias", "alibi_slopes") else x) for n, x in feat.items()}
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(a(q), a(k), a(v), return_lse=True,
                                         backend=backend.name, **fa, **kw)
    return backend.to_numpy(o), backend.to_numpy(lse)


def _backward(backend, do, q, k, v, o, lse, feat, **kw):
    a = backend.asarray
    fa = {n: (a(x) if n in ("bias", "alibi_slopes") else x) for n, x in feat.items()}
    with poisoned_outputs():
        g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse),
                                             backend=backend.name, **fa, **kw)
    return tuple(backend.to_numpy(x) for x in g)


def _lse_dtype(dtype):
    return np.float64 if dtype == "float64" else np.float32


# --------------------------------------------------------------------------
# Philox and the dropout mask
# --------------------------------------------------------------------------
@pytest.mark.parametrize("ctr,key,want", PHILOX_KAT)
def test_philox_known_answers(ctr, key, want):
    """The reference's and the oracle's Philox4x32-10 both give Random123's answers."""
    from cuflash.reference.masks import philox4x32_10
    got = tuple(int(x) for x in philox4x32_10(*ctr, *key))
    assert got == want, [hex(g) for g in got]
    got = tuple(int(x) for x in oracle.philox_block(*ctr, *key))
    assert got == want, [hex(g) for g in got]


@pytest.mark.parametrize("shape,p", [((2, 3, 17, 45), 0.3), ((5, 9), 0.5), ((4, 1, 33), 0.1)])
def test_dropout_mask_matches_oracle(shape, p):
    seed = 2 ** 40 + 12345
    keep = cuflash.dropout_mask(shape, p, seed)
    assert keep.shape == shape and keep.dtype == bool
    lead = shape[:-2]
    for idx in np.ndindex(*lead) if lead else [()]:
        b = int(np.ravel_multi_index(idx[:-1], lead[:-1])) if len(idx) > 1 else 0
        h = idx[-1] if idx else 0
        want = oracle.keep_mask(b, h, shape[-2], shape[-1], p, seed)
        assert np.array_equal(keep[idx], want), idx
    assert not np.array_equal(keep, cuflash.dropout_mask(shape, p, seed + 1))


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_dropout_fraction_is_p(p):
    """Over a large draw the dropped fraction is within 1% (relative) of p, per head too."""
    keep = cuflash.dropout_mask((2, 8, 512, 512), p, seed=20261123)
    frac = 1.0 - keep.mean()
    assert abs(frac - p) <= 0.01 * p, f"dropped {frac:.5f}, p = {p}"
    per_head = 1.0 - keep.mean(axis=(-1, -2))
    assert np.all(np.abs(per_head - p) <= 0.05 * p + 0.005), per_head


def test_dropout_draws_16_bits():
    """The threshold is round(p 2^16) (at most 2^16 - 1), and an element is dropped exactly when
    its 16-bit draw lies below it: raising p by 2^-16 drops only the elements whose draw equals
    the old threshold -- about one element in 2^16 (9.4 expected over these 40 seeds)."""
    from cuflash._validate_masks import dropout_threshold
    assert [dropout_threshold(p) for p in (0.1, 0.5, 2.0 ** -16, 1 - 2.0 ** -20)] == \
        [6554, 32768, 1, 65535]
    shape, hits = (3, 64, 80), 0
    for seed in range(40):
        a = cuflash.dropout_mask(shape, 0.25, seed)
        b = cuflash.dropout_mask(shape, 0.25 + 2.0 ** -16, seed)
        assert not np.any(b & ~a), seed
        hits += int(np.sum(a & ~b))
    assert 2 <= hits <= 25, hits


@pytest.mark.parametrize("dtype,Nk,kernel", [
    ("float32", 40, "flash_fwd_masked"),           # d = 40: the SIMT kernel
    ("float32", 48, "flash_fwd_tf32_masked"),      # d = 48: tensor cores, shared Philox blocks
    ("float16", 48, "flash_fwd_tc_masked"),
])
def test_dropout_mask_read_back_from_every_backend(backend, dtype, Nk, kernel):
    """With q = 0 (uniform P = 1/Nk) and v = I, o = keep / ((1 - p) Nk): every backend
    (and on the emulator each forward kernel) drops exactly the elements of
    cuflash.dropout_mask for the seed."""
    from cuflash.launch import common as launch_common
    B, H, Nq, p, seed = 2, 3, 19, 0.3, 987654321987
    q = np.zeros((B, H, Nq, Nk), dtype)
    k = np.ones((B, H, Nk, Nk), dtype)
    v = np.broadcast_to(np.eye(Nk, dtype=dtype), (B, H, Nk, Nk)).copy()
    with launch_common.observe_launches() as seen:
        o, _ = _forward(backend, q, k, v, dict(dropout_p=p, seed=seed))
    if backend.name == "emulator":
        assert [e["kernel"] for e in seen] == [kernel]
    keep = cuflash.dropout_mask((B, H, Nq, Nk), p, seed)
    np.testing.assert_array_equal(o != 0, keep)
    np.testing.assert_allclose(o[keep].astype(np.float64), 1.0 / ((1 - p) * Nk),
                               rtol=1e-6 if dtype == "float32" else 1e-3)


# --------------------------------------------------------------------------
# forward against the oracle
# --------------------------------------------------------------------------
# (dtype, q shape, k shape, causal, features); bias / alibi_slopes give shapes
FWD_CASES = [
    ("float32", (2, 3, 37, 32), (2, 3, 45, 32), False, dict(bias=(2, 3, 37, 45))),
    # bias broadcast over batch and heads; Nq > Nk bottom_right: rows see no key
    ("float32", (2, 3, 45, 32), (2, 3, 30, 32), "bottom_right", dict(bias=(45, 30))),
    ("float32", (3, 2, 29, 32), (3, 2, 61, 32), False, dict(bias=(3, 1, 1, 61))),  # key padding
    ("float32", (2, 3, 53, 32), (2, 3, 53, 32), False, dict(window=(5, 3))),
    # bias + window + causal + GQA 6/2, Nq < Nk
    ("float32", (1, 6, 40, 32), (1, 2, 71, 32), True,
     dict(window=(8, None), bias=(6, 40, 71))),
    ("float32", (2, 2, 33, 32), (2, 2, 21, 32), False, dict(window=(0, 0))),  # one key or none
    ("float32", (2, 4, 41, 32), (2, 4, 41, 32), False,
     dict(softcap=2.0, alibi_slopes=(4,))),                                   # softcap + ALiBi
    ("float32", (2, 3, 30, 32), (2, 3, 50, 32), "top_left", dict(alibi_slopes=(2, 3))),
    ("float32", (2, 3, 47, 32), (2, 3, 47, 32), True, dict(dropout_p=0.2)),  # dropout + causal
    ("float32", (1, 3, 1, 32), (1, 3, 147, 32), False, dict(window=(20, 0), bias=(147,))),
    ("float64", (2, 6, 35, 16), (2, 3, 44, 16), "bottom_right",
     dict(bias=(2, 1, 35, 44), window=(12, 2), alibi_slopes=(6,), softcap=3.0, dropout_p=0.15)),
    ("float64", (2, 2, 50, 16), (2, 2, 20, 16), "top_left", dict(window=(3, 6), dropout_p=0.4)),
    ("float16", (2, 2, 37, 32), (2, 2, 45, 32), False, dict(bias=(2, 37, 45), window=(9, 4))),
    ("float16", (1, 4, 60, 32), (1, 1, 60, 32), True, dict(dropout_p=0.25)),    # MQA
    ("bfloat16", (2, 2, 30, 16), (2, 2, 43, 16), False,
     dict(softcap=1.5, alibi_slopes=(2, 2))),
]


def _fwd_id(c):
    dt, qs, ks, causal, feat = c
    return f"{dt}-q{'x'.join(map(str, qs))}-k{'x'.join(map(str, ks))}-{causal}-{_feat_id(feat)}"


@pytest.mark.parametrize("case", FWD_CASES, ids=_fwd_id)
def test_forward_against_oracle(backend, case, rng):
    dtype, qs, ks, causal, feat = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    before = [x.copy() for x in (q, k, v)] + [np.array(x, copy=True) for x in feat.values()
                                              if isinstance(x, np.ndarray)]
    o, lse = _forward(backend, q, k, v, feat, causal=causal)
    assert o.dtype == q.dtype and lse.dtype == _lse_dtype(dtype)
    oracle.check_forward(o, q, k, v, None, causal, lse=lse, **feat)
    # rows that see no key: exactly 0 and -inf
    ref_o, ref_lse, _ = oracle.attention(q, k, v, None, causal, **feat)
    blind = np.isneginf(ref_lse)
    assert np.all(o.astype(np.float64)[blind] == 0) and np.all(np.isneginf(lse[blind]))
    after = [q, k, v] + [x for x in feat.values() if isinstance(x, np.ndarray)]
    for x, x0 in zip(after, before):
        assert np.array_equal(x, x0), "an input was modified"
    # the standard algorithm computes the same (and p before dropout)
    a = backend.asarray
    fa = {n: (a(x) if isinstance(x, np.ndarray) else x) for n, x in feat.items()}
    so, sp = cuflash.standard_attention(a(q), a(k), a(v), causal=causal, backend=backend.name,
                                        **fa)
    oracle.check_forward(backend.to_numpy(so), q, k, v, None, causal, **feat)
    if dtype in ("float32", "float64"):
        oracle.assert_rel_close(backend.to_numpy(sp), oracle.attention(
            q, k, v, None, causal, **feat)[2], dtype, "p")


# The tensor-core forward with several Q and K/V tiles (explicit small tiles): window bands
# that skip tiles on both sides, interior tiles (every row sees the whole tile: the logit
# terms without the interval test), the last Q tile's rows past Nq, Nq > Nk with rows that
# see no key, GQA, every feature at once.  (dtype, q shape, k shape, causal, features, kernel)
TC_FWD_CASES = [
    ("float16", (2, 4, 128, 32), (2, 2, 128, 32), False,
     dict(window=(50, 50), bias=(4, 128, 128), alibi_slopes=(2, 4), softcap=5.0, dropout_p=0.2),
     "flash_fwd_tc_masked"),
    ("float32", (1, 2, 45, 32), (1, 2, 100, 32), "bottom_right",
     dict(window=(20, None), bias=(45, 100), softcap=3.0), "flash_fwd_tf32_masked"),
    ("bfloat16", (2, 2, 100, 16), (2, 2, 60, 16), "bottom_right",
     dict(window=(3, 0), dropout_p=0.3, alibi_slopes=(2,)), "flash_fwd_tc_masked"),
    ("float32", (2, 2, 64, 16), (2, 2, 96, 16), False, dict(bias=(2, 1, 1, 96)),
     "flash_fwd_tf32_masked"),
]


@pytest.mark.parametrize("case", TC_FWD_CASES, ids=lambda c: _fwd_id(c[:5]))
def test_tensor_core_forward_with_features(kernel_backend, case, rng):
    """flash_fwd_tc_masked / flash_fwd_tf32_masked over several tiles against the oracle
    (block_q=32, block_kv=16), with the kernel named by the launch."""
    from cuflash.launch import common as launch_common
    dtype, qs, ks, causal, feat, kernel = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    with launch_common.observe_launches() as seen:
        o, lse = _forward(kernel_backend, q, k, v, feat, causal=causal, block_q=32, block_kv=16)
    if kernel_backend.name == "emulator":
        assert [e["kernel"] for e in seen] == [kernel]
    oracle.check_forward(o, q, k, v, None, causal, lse=lse, **feat)
    ref_lse = oracle.attention(q, k, v, None, causal, **feat)[1]
    blind = np.isneginf(ref_lse)
    assert np.all(o.astype(np.float64)[blind] == 0) and np.all(np.isneginf(lse[blind]))
    assert blind.any() == (dtype == "bfloat16")  # the Nq > Nk case has blind rows


# The SIMT forward with features, for the dtypes whose calls now run on tensor cores
SIMT_FWD_CASES = [c for c in FWD_CASES if c[0] != "float64"][::3]


@pytest.mark.parametrize("case", SIMT_FWD_CASES, ids=_fwd_id)
def test_simt_forward_with_features(case, rng):
    """flash_fwd_masked (forced) on the emulator for float32/float16/bfloat16 feature calls,
    which the planner sends to the tensor-core kernels (sm_75 and odd head dims run it)."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, emulator_backend
    from cuflash.launch import common as launch_common, fwd as launch_fwd
    require_backend("emulator")
    dtype, qs, ks, causal, feat = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    spec = _validate.check_attention_inputs(q, k, v, causal=causal)
    ms = _validate_masks.check_masks(spec, q, **feat)
    with launch_common.observe_launches() as seen, poisoned_outputs():
        o, lse = launch_fwd.flash_fwd(emulator_backend.runtime(), q, k, v, spec, ms,
                                      kernel="flash_fwd_masked")
    assert [e["kernel"] for e in seen] == ["flash_fwd_masked"]
    oracle.check_forward(o, q, k, v, None, causal, lse=lse, **feat)


# The tensor-core backward (flash_bwd_tc_masked) over several tiles in each of its layouts:
# one warp of 16 keys (32 x 16), the query split of a warp pair (32 x 32), 32 keys per warp
# (32 x 64), two passes over the head dims (d = 96, 64 x 32); dbias stored (a full bias) and
# added (broadcast).  (dtype, q shape, k shape, causal, features, block_q, block_kv, det)
TC_BWD_CASES = [
    ("float16", (2, 4, 64, 32), (2, 2, 80, 32), "bottom_right",
     dict(window=(20, 5), bias=(2, 4, 64, 80), alibi_slopes=(4,), softcap=4.0, dropout_p=0.2),
     32, 16, False),
    ("bfloat16", (1, 2, 50, 32), (1, 2, 70, 32), False,
     dict(bias=(2, 1, 70), window=(None, 10)), 32, 32, True),
    ("float16", (1, 2, 70, 96), (1, 2, 40, 96), "top_left",
     dict(softcap=2.5, bias=(70, 40)), 64, 32, False),
    # (a key-padding bias beside dropout and ALiBi: without it the call runs
    # flash_bwd_tc_alibi_dropout)
    ("float16", (2, 2, 45, 32), (2, 1, 130, 32), False,
     dict(dropout_p=0.35, alibi_slopes=(2, 2), window=(40, 40), bias=(130,)), 32, 64, True),
    # the default at d = 64: 64 x 128, 8 warps, the query split with 32 keys per warp pair;
    # GQA, dbias added (broadcast over heads)
    ("float16", (1, 2, 100, 64), (1, 1, 130, 64), False,
     dict(bias=(1, 1, 100, 130), alibi_slopes=(2,), softcap=3.0, dropout_p=0.1), 64, 128, False),
    # 16 keys per warp pair in one pass (d + dv in (128, 256] with block_q >= 64: the query
    # split with one m16 tile per warp), dbias stored
    ("bfloat16", (1, 2, 70, 96), (1, 2, 90, 96), "bottom_right",
     dict(softcap=2.0, bias=(1, 2, 70, 90), dropout_p=0.2, window=(None, 30)), 64, 32, True),
    # 4 warps and more at d <= 128 (the lean loop: addresses kept across tiles, P^T in float32
    # for dS, the K/V tile's range of query tiles inside the band): bands wide enough that
    # tile pairs lie wholly inside them, beside pairs that cross either edge, Nq and Nk ragged
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right",
     dict(window=(200, None), softcap=3.0, dropout_p=0.1), 64, 128, False),
    ("bfloat16", (1, 2, 190, 128), (1, 1, 250, 128), False,
     dict(window=(100, 90), bias=(1, 2, 190, 250), dropout_p=0.15), 64, 64, True),
    # softcap with no bias or ALiBi in the lean loop: its derivative folded into float32 P^T,
    # with dropout (dS of the dropped product) and top-left causal
    ("float16", (1, 2, 150, 128), (1, 2, 170, 128), "top_left",
     dict(softcap=1.5, dropout_p=0.25), 64, 64, True),
]


def _tc_bwd_id(c):
    return _fwd_id(c[:5]) + f"-{c[5]}x{c[6]}" + ("-det" if c[7] else "-atomic")


@pytest.mark.parametrize("case", TC_BWD_CASES, ids=_tc_bwd_id)
def test_tensor_core_backward_with_features(kernel_backend, case, rng):
    """flash_bwd_tc_masked against the oracle (gradients and dbias), named by the launches."""
    from cuflash import kernels
    from cuflash.launch import common as launch_common
    dtype, qs, ks, causal, feat, bq, bkv, det = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse = _forward(kernel_backend, q, k, v, feat, causal=causal)
    do = oracle.randn(rng, o.shape, dtype)
    db = "bias" in feat
    with launch_common.observe_launches() as seen:
        try:
            grads = _backward(kernel_backend, do, q, k, v, o, lse, feat, causal=causal,
                              block_q=bq, block_kv=bkv, deterministic=det, return_dbias=db)
        except kernels.SpillError as e:
            # explicit tiles are taken where the size formulas allow them; on a GPU whose
            # compiler spills them the call is refused, naming the curated plans instead
            assert kernel_backend.name == "cuda" and "curated plans of flash_bwd_tc_masked" in str(e)
            return
    if kernel_backend.name == "emulator":
        assert [e["kernel"] for e in seen] == ["flash_bwd_tc_preprocess", "flash_bwd_tc_masked",
                                               "flash_bwd_tc_dq_convert"]
    oracle.check_backward(grads, do, q, k, v, None, causal, **feat)


# The band-only build (flash_bwd_tc_band: a window, with or without causal, and no other
# feature) at the plain kernel's tiles: FlashAttention-2's 128 x 128 at d = 64 (8 warps, the
# query split) and 64 x 128 at d = 128, and smaller layouts; bands wide enough that tile pairs
# lie wholly inside them beside pairs that cross either edge, Nq and Nk ragged, both dQ paths,
# one window whose right edge cuts the diagonal.  (dtype, q shape, k shape, causal, window,
# block_q, block_kv, det)
TC_BAND_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right", (200, None), 128, 128, False),
    ("bfloat16", (1, 2, 190, 128), (1, 1, 250, 128), False, (100, 90), 64, 128, True),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left", (10, None), 32, 64, False),
    ("bfloat16", (1, 2, 100, 96), (1, 2, 60, 96), False, (None, 0), 64, 64, True),
]


@pytest.mark.parametrize("case", TC_BAND_CASES, ids=lambda c: _fwd_id(
    c[:4] + (dict(window=c[4]),)) + f"-{c[5]}x{c[6]}" + ("-det" if c[7] else "-atomic"))
def test_tensor_core_backward_band_only(kernel_backend, case, rng):
    """flash_bwd_tc_band (a call whose only feature is a window) against the oracle, named by
    the launches, with the band's offsets the launcher computes (band_fields)."""
    from cuflash.launch import common as launch_common
    dtype, qs, ks, causal, window, bq, bkv, det = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse = _forward(kernel_backend, q, k, v, dict(window=window), causal=causal)
    do = oracle.randn(rng, o.shape, dtype)
    with launch_common.observe_launches() as seen:
        grads = _backward(kernel_backend, do, q, k, v, o, lse, dict(window=window),
                          causal=causal, block_q=bq, block_kv=bkv, deterministic=det)
    if kernel_backend.name == "emulator":
        assert [e["kernel"] for e in seen] == ["flash_bwd_tc_preprocess", "flash_bwd_tc_band",
                                               "flash_bwd_tc_dq_convert"]
    assert all(np.abs(kernel_backend.to_numpy(g).astype(np.float32)).max() > 0 for g in grads)  # a band, not none
    oracle.check_backward(grads, do, q, k, v, None, causal, window=window)


# The softcap build (flash_bwd_tc_softcap: a softcap and at most a window) at the plain
# kernel's tiles.  Its r form (the logit as r of tanh = 1 - 2 r, 4 P from the exponential,
# P (1 - tanh^2) folded into float32 P^T, dV stored times 1/4) where P^T stays in float32:
# FlashAttention-2's 128 x 128 at d = 64 and 64 x 128 at d = 128, 32 x 64 at d = 32; its tanh
# form (1 - tanh^2 as float16 pairs) at d = 96.  Small caps saturate tanh (1 - tanh^2 near 0);
# windows with interior pairs beside crossing ones, no window at all, causal both ways, Nq and
# Nk ragged, GQA, both dQ paths.  (dtype, q shape, k shape, causal, features, block_q,
# block_kv, det)
TC_SOFTCAP_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right", dict(window=(200, None), softcap=1.5),
     128, 128, False),
    ("bfloat16", (1, 2, 190, 128), (1, 1, 250, 128), False, dict(softcap=4.0), 64, 128, True),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left", dict(window=(10, None), softcap=2.0),
     32, 64, False),
    ("float16", (1, 2, 100, 96), (1, 2, 60, 96), False, dict(window=(30, 20), softcap=3.0), 64, 64, True),
]
# The ALiBi build (flash_bwd_tc_alibi: ALiBi and at most a window) in the same layouts: slopes
# per head and per (batch, head), windows and causal as above.
TC_ALIBI_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right",
     dict(window=(200, None), alibi_slopes=(2,)), 128, 128, False),
    ("bfloat16", (2, 2, 190, 128), (2, 1, 250, 128), False, dict(alibi_slopes=(2, 2)), 64, 128, True),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left", dict(window=(10, None), alibi_slopes=(2,)),
     32, 64, False),
    ("float16", (1, 2, 100, 96), (1, 2, 60, 96), False, dict(window=(30, 20), alibi_slopes=(1, 2)),
     64, 64, True),
]
# The dropout build (flash_bwd_tc_dropout: dropout and at most a window) in the same layouts
# and at d = 16 (two Philox blocks per step): its keep bits in FlashAttention-2's tiles (64
# queries per warp at d = 64: a 64-bit keep word), P^T from its 16-bit pairs at d = 96 (not
# kFloatP), the K/V bases per K/V tile at d = 128 (kLateKV); windows, causal both ways, GQA,
# Nq and Nk ragged, both dQ paths, p from 0.1 to 0.6.
TC_DROPOUT_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right",
     dict(window=(200, None), dropout_p=0.1), 128, 128, False),
    ("bfloat16", (2, 2, 190, 128), (2, 1, 250, 128), False, dict(dropout_p=0.3), 64, 128, True),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left", dict(window=(10, None), dropout_p=0.6),
     32, 64, False),
    ("float16", (1, 2, 100, 96), (1, 2, 60, 96), False, dict(window=(30, 20), dropout_p=0.25),
     64, 64, True),
    ("bfloat16", (1, 2, 70, 16), (1, 2, 150, 16), "bottom_right", dict(dropout_p=0.45), 64, 128, False),
]
# The ALiBi + dropout build (flash_bwd_tc_alibi_dropout) in the dropout build's layouts: the
# keep bits and the distance term together, its dK / dV stores from the lane's key read again
# (kFreshKey); slopes per head and per (batch, head), windows, causal both ways, GQA, ragged
# Nq and Nk, both dQ paths.
TC_ALIBI_DROPOUT_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right",
     dict(window=(200, None), alibi_slopes=(2,), dropout_p=0.15), 128, 128, False),
    ("bfloat16", (2, 2, 190, 128), (2, 1, 250, 128), False, dict(alibi_slopes=(2, 2), dropout_p=0.3),
     64, 128, True),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left",
     dict(window=(10, None), alibi_slopes=(2,), dropout_p=0.5), 32, 64, False),
    ("float16", (1, 2, 100, 96), (1, 2, 60, 96), False,
     dict(window=(30, 20), alibi_slopes=(1, 2), dropout_p=0.25), 64, 64, True),
    ("bfloat16", (1, 2, 70, 16), (1, 2, 150, 16), "bottom_right",
     dict(alibi_slopes=(2,), dropout_p=0.4), 64, 128, False),
]

# The ALiBi + softcap build (flash_bwd_tc_alibi_softcap) in the softcap build's layouts: its r
# form with ALiBi's term in the exponent (kAlibiExp) at d = 32, 64 and 128 (the sm_86 cell's
# 32 x 64 there too), its tanh form with ALiBi added to the logit at d = 96; small caps
# (tanh saturated), slopes per head and per (batch, head), windows, causal both ways, GQA,
# ragged Nq and Nk, both dQ paths.
TC_ALIBI_SOFTCAP_CASES = [
    ("float16", (1, 2, 260, 64), (1, 2, 300, 64), "bottom_right",
     dict(window=(200, None), alibi_slopes=(2,), softcap=1.5), 128, 128, False),
    ("bfloat16", (2, 2, 190, 128), (2, 1, 250, 128), False, dict(alibi_slopes=(2, 2), softcap=4.0),
     64, 128, True),
    ("float16", (1, 2, 110, 128), (1, 2, 90, 128), "top_left",
     dict(window=(40, 30), alibi_slopes=(2,), softcap=2.0), 32, 64, False),
    ("float16", (2, 2, 90, 32), (2, 2, 70, 32), "top_left",
     dict(window=(10, None), alibi_slopes=(2,), softcap=2.0), 32, 64, False),
    ("float16", (1, 2, 100, 96), (1, 2, 60, 96), False,
     dict(window=(30, 20), alibi_slopes=(1, 2), softcap=3.0), 64, 64, True),
]


def _lean_id(c):
    return _fwd_id(c[:5]) + f"-{c[5]}x{c[6]}" + ("-det" if c[7] else "-atomic")


def _check_lean_backward(kernel_backend, rng, case, kernel):
    """A lean build of the tensor-core backward against the oracle, named by the launches."""
    from cuflash.launch import common as launch_common
    dtype, qs, ks, causal, feat, bq, bkv, det = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse = _forward(kernel_backend, q, k, v, feat, causal=causal)
    do = oracle.randn(rng, o.shape, dtype)
    with launch_common.observe_launches() as seen:
        grads = _backward(kernel_backend, do, q, k, v, o, lse, feat, causal=causal,
                          block_q=bq, block_kv=bkv, deterministic=det)
    if kernel_backend.name == "emulator":
        assert [e["kernel"] for e in seen] == ["flash_bwd_tc_preprocess", kernel,
                                               "flash_bwd_tc_dq_convert"]
    assert all(np.abs(kernel_backend.to_numpy(g).astype(np.float32)).max() > 0 for g in grads)  # a band, not none
    oracle.check_backward(grads, do, q, k, v, None, causal, **feat)


# each lean build with the cases of its features (a window alone: test_tensor_core_backward_band_only)
LEAN_CASES = [(kernel, case) for kernel, cases in (
    ("flash_bwd_tc_softcap", TC_SOFTCAP_CASES), ("flash_bwd_tc_alibi", TC_ALIBI_CASES),
    ("flash_bwd_tc_dropout", TC_DROPOUT_CASES), ("flash_bwd_tc_alibi_dropout", TC_ALIBI_DROPOUT_CASES),
    ("flash_bwd_tc_alibi_softcap", TC_ALIBI_SOFTCAP_CASES))
    for case in cases]


@pytest.mark.parametrize("kernel,case", LEAN_CASES,
                         ids=[k[len("flash_bwd_tc_"):] + "-" + _lean_id(c) for k, c in LEAN_CASES])
def test_tensor_core_backward_lean(kernel_backend, kernel, case, rng):
    """The lean builds flash_bwd_tc_softcap (a softcap and at most a window), _alibi (ALiBi
    and at most a window), _dropout (dropout and at most a window), _alibi_dropout (ALiBi,
    dropout and at most a window) and _alibi_softcap (ALiBi, a softcap and at most a window)
    against the oracle."""
    _check_lean_backward(kernel_backend, rng, case, kernel)


@pytest.mark.parametrize("feat,want", [
    (dict(window=(8, None)), "flash_bwd_tc_band"),
    (dict(softcap=2.0, window=(8, 3)), "flash_bwd_tc_softcap"),
    (dict(alibi_slopes=True), "flash_bwd_tc_alibi"),
    (dict(dropout_p=0.2, seed=1), "flash_bwd_tc_dropout"),
    (dict(dropout_p=0.2, seed=1, window=(8, 3)), "flash_bwd_tc_dropout"),
    (dict(dropout_p=0.2, seed=1, softcap=2.0), None),
    (dict(dropout_p=0.2, seed=1, alibi_slopes=True), "flash_bwd_tc_alibi_dropout"),
    (dict(dropout_p=0.2, seed=1, alibi_slopes=True, window=(4, 4)), "flash_bwd_tc_alibi_dropout"),
    (dict(dropout_p=0.2, seed=1, alibi_slopes=True, softcap=2.0), None),
    (dict(dropout_p=0.2, seed=1, bias=True), None),
    (dict(dropout_p=0.2, seed=1, bias=True, return_dbias=True), None),
    (dict(softcap=2.0, alibi_slopes=True), "flash_bwd_tc_alibi_softcap"),
    (dict(softcap=2.0, alibi_slopes=True, window=(8, 3)), "flash_bwd_tc_alibi_softcap"),
    (dict(softcap=2.0, alibi_slopes=True, bias=True), None),
    (dict(dropout_p=0.0, seed=1), None),
])
def test_lean_build_choice(feat, want):
    """launch.features.lean_build: each lean build for its features and at most a window,
    flash_bwd_tc_masked (None) for any other combination, a bias or dbias; a call whose
    dropout_p is 0 is no dropout call."""
    from cuflash import _validate, _validate_masks
    from cuflash.launch import features
    q = np.zeros((1, 2, 8, 16), np.float16)
    spec = _validate.check_attention_inputs(q, q, q)
    feat = dict(feat)
    if feat.get("alibi_slopes"):
        feat["alibi_slopes"] = np.full(2, 0.1, np.float32)
    if feat.get("bias"):
        feat["bias"] = np.zeros((1, 2, 8, 8), np.float32)
    ms = _validate_masks.check_masks(spec, q, **feat)
    assert features.lean_build(ms) == want


# float32's tensor-core backward (flash_bwd_tf32_masked, 16 keys per warp) over several K/V
# and Q tiles: dbias stored (a full bias) and added (broadcast), GQA, Nq > Nk with a band that
# skips Q tiles on both sides, dropout with softcap and ALiBi (causal); without softcap, the
# tiles inside [0, Nq) x [0, Nk) take the bias and dbias by row pointers (a full bias with
# ALiBi, stored; a key-padding bias, added), the edge tiles the general path.  (q shape,
# k shape, causal, features, block_q, block_kv)
TF32_BWD_CASES = [
    ((2, 4, 64, 32), (2, 2, 80, 32), "bottom_right",
     dict(window=(20, 5), bias=(2, 4, 64, 80), alibi_slopes=(4,), softcap=4.0, dropout_p=0.2),
     16, 32),
    ((1, 2, 90, 64), (1, 2, 50, 64), False, dict(bias=(2, 1, 50), window=(12, 6)), 32, 32),
    ((2, 2, 45, 32), (2, 1, 70, 32), "top_left",
     dict(dropout_p=0.35, alibi_slopes=(2, 2), softcap=2.0), 16, 64),
    ((2, 2, 70, 32), (2, 2, 96, 32), False, dict(bias=(2, 2, 70, 96), alibi_slopes=(2,)), 32, 32),
    ((1, 2, 40, 32), (1, 2, 70, 32), "bottom_right", dict(bias=(1, 1, 1, 70), dropout_p=0.25), 16, 32),
]


@pytest.mark.parametrize("case", TF32_BWD_CASES, ids=lambda c: _fwd_id(("float32",) + c[:4]) +
                         f"-{c[4]}x{c[5]}")
def test_tf32_backward_with_features(kernel_backend, case, rng):
    """flash_bwd_tf32_masked against the oracle (gradients and dbias), named by the launches."""
    from cuflash.launch import common as launch_common
    qs, ks, causal, feat, bq, bkv = case
    feat = _materialise(rng, feat, "float32")
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    o, lse = _forward(kernel_backend, q, k, v, feat, causal=causal)
    do = oracle.randn(rng, o.shape, "float32")
    db = "bias" in feat
    with launch_common.observe_launches() as seen:
        grads = _backward(kernel_backend, do, q, k, v, o, lse, feat, causal=causal,
                          block_q=bq, block_kv=bkv, return_dbias=db)
    if kernel_backend.name == "emulator":
        assert [e["kernel"] for e in seen] == ["flash_bwd_preprocess", "flash_bwd_tf32_masked",
                                               "flash_bwd_dq_convert"]
    oracle.check_backward(grads, do, q, k, v, None, causal, **feat)


def check_simt_masked_backward(q, k, v, feat, rng):
    """flash_bwd_dkdv_masked forced on the emulator (outputs NaN-poisoned), both dQ paths, with
    dbias: the gradients against the oracle, the launches named (flash_bwd_dq_masked only on
    the deterministic path)."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, emulator_backend
    from cuflash.launch import bwd as launch_bwd, common as launch_common
    require_backend("emulator")
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **feat)
    do = oracle.randn(rng, o.shape, q.dtype)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse)
    ms = _validate_masks.check_masks(spec, q, return_dbias=True, **feat)
    for det in (False, True):
        with poisoned_outputs(), launch_common.observe_launches() as seen:
            grads = launch_bwd.flash_bwd(emulator_backend.runtime(), do, q, k, v, o, lse,
                                         spec, ms, det, kernel="flash_bwd_dkdv_masked")
        names = [e["kernel"] for e in seen]
        assert "flash_bwd_dkdv_masked" in names and ("flash_bwd_dq_masked" in names) == det
        oracle.check_backward(grads, do, q, k, v, None, False, **feat)


def test_simt_backward_with_features(rng):
    """flash_bwd_dkdv_masked (forced) on a float16 feature call (the planner sends it to
    flash_bwd_tc_masked): both dQ paths, dbias."""
    q, k, v = oracle.qkv(rng, (2, 2, 37, 32), (2, 2, 45, 32), dtype="float16")
    feat = dict(bias=rng.standard_normal((2, 37, 45)).astype(np.float32), window=(9, 4),
                softcap=3.0, dropout_p=0.2, seed=5)
    check_simt_masked_backward(q, k, v, feat, rng)


def test_window_rows_that_see_no_key(backend, rng):
    """A window right of the keys (Nq > Nk bottom-right) and a band that misses: 0, -inf."""
    q, k, v = oracle.qkv(rng, (2, 40, 32), (2, 25, 32), dtype="float32")
    feat = dict(window=(2, 1))
    o, lse = _forward(backend, q, k, v, feat)
    # rows i with i + off + 1 < 0: off = -15 -> rows 0..13 see nothing
    assert np.all(o[:, :14] == 0) and np.all(np.isneginf(lse[:, :14]))
    assert np.all(np.isfinite(lse[:, 14:]))
    oracle.check_forward(o, q, k, v, None, False, lse=lse, **feat)


def test_minus_inf_bias_masks_keys(backend, rng):
    """-inf entries of the bias hide keys; a row of all -inf gives 0 and -inf."""
    q, k, v = oracle.qkv(rng, (2, 20, 32), (2, 33, 32), dtype="float32")
    bias = np.zeros((20, 33), np.float32)
    bias[:, 5:9] = -np.inf
    bias[3] = -np.inf
    o, lse = _forward(backend, q, k, v, dict(bias=bias))
    assert np.all(o[:, 3] == 0) and np.all(np.isneginf(lse[:, 3]))
    oracle.check_forward(o, q, k, v, None, False, lse=lse, bias=bias)


# --------------------------------------------------------------------------
# backward (and dbias) against the oracle
# --------------------------------------------------------------------------
BWD_CASES = [
    ("float32", (2, 3, 37, 32), (2, 3, 45, 32), False, dict(bias=(2, 3, 37, 45)), True),
    ("float32", (2, 3, 45, 32), (2, 3, 30, 32), "bottom_right", dict(bias=(45, 30)), False),
    ("float32", (3, 2, 29, 32), (3, 2, 61, 32), False, dict(bias=(3, 1, 1, 61)), True),
    ("float32", (1, 6, 40, 32), (1, 2, 71, 32), True,
     dict(window=(8, None), bias=(6, 40, 71)), False),
    ("float32", (2, 3, 53, 32), (2, 3, 53, 32), False, dict(window=(5, 3)), True),
    ("float32", (2, 4, 41, 32), (2, 4, 41, 32), False, dict(softcap=2.0, alibi_slopes=(4,)),
     False),
    ("float32", (2, 3, 47, 32), (2, 3, 47, 32), True, dict(dropout_p=0.2), False),
    ("float32", (2, 3, 30, 32), (2, 3, 50, 32), "top_left", dict(alibi_slopes=(2, 3)), True),
    ("float64", (2, 6, 35, 16), (2, 3, 44, 16), "bottom_right",
     dict(bias=(2, 1, 35, 44), window=(12, 2), alibi_slopes=(6,), softcap=3.0, dropout_p=0.15),
     True),
    ("float64", (2, 2, 50, 16), (2, 2, 20, 16), "top_left", dict(window=(3, 6), dropout_p=0.4),
     False),
    ("float16", (2, 2, 37, 32), (2, 2, 45, 32), False, dict(bias=(2, 37, 45), window=(9, 4)),
     False),
    ("bfloat16", (2, 2, 30, 16), (2, 2, 43, 16), False, dict(softcap=1.5, alibi_slopes=(2, 2)),
     True),
]


def _bwd_id(c):
    return _fwd_id(c[:5]) + ("-det" if c[5] else "-atomic")


@pytest.mark.parametrize("case", BWD_CASES, ids=_bwd_id)
def test_backward_against_oracle(backend, case, rng):
    dtype, qs, ks, causal, feat, det = case
    feat = _materialise(rng, feat, dtype)
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse, _ = oracle.attention(q, k, v, None, causal, **feat)
    o, lse = o.astype(q.dtype), lse.astype(_lse_dtype(dtype))
    do = oracle.randn(rng, o.shape, dtype)
    with_db = "bias" in feat
    grads = _backward(backend, do, q, k, v, o, lse, feat, causal=causal, deterministic=det,
                      return_dbias=with_db)
    assert len(grads) == (4 if with_db else 3)
    for g, x in zip(grads, (q, k, v) + ((feat["bias"],) if with_db else ())):
        assert g.shape == x.shape and g.dtype == x.dtype, (g.shape, g.dtype, x.shape, x.dtype)
    oracle.check_backward(grads, do, q, k, v, None, causal, **feat)
    # the standard (stored-P) backward agrees too
    a = backend.asarray
    fa = {n: (a(x) if isinstance(x, np.ndarray) else x) for n, x in feat.items()}
    sg = cuflash.standard_attention_backward(a(do), a(q), a(k), a(v), causal=causal,
                                             return_dbias=with_db, backend=backend.name, **fa)
    oracle.check_backward(tuple(backend.to_numpy(x) for x in sg), do, q, k, v, None, causal,
                          **feat)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_forward_then_backward_with_dropout(backend, rng, dtype):
    """The backward regenerates the forward's dropout mask from (dropout_p, seed) (float16:
    both on tensor cores, whose lanes share Philox blocks in different layouts)."""
    q, k, v = oracle.qkv(rng, (2, 2, 33, 32), (2, 2, 39, 32), dtype=dtype)
    feat = dict(dropout_p=0.3, seed=77, bias=rng.standard_normal((33, 39)).astype(np.float32))
    o, lse = _forward(backend, q, k, v, feat, causal=True)
    do = oracle.randn(rng, o.shape, dtype)
    grads = _backward(backend, do, q, k, v, o, lse, feat, causal=True, return_dbias=True)
    oracle.check_backward(grads, do, q, k, v, None, True, **feat)
    # another seed is another mask: the gradients differ
    other = _backward(backend, do, q, k, v, o, lse, dict(feat, seed=78), causal=True)
    assert not np.allclose(other[0], grads[0])


@pytest.mark.parametrize("bias_shape", [(2, 3, 5, 7), (5, 7), (3, 1, 7), (2, 1, 5, 1)])
def test_dbias_central_differences(backend, rng, bias_shape):
    """dbias against central differences of the oracle's loss sum(o * do), float64."""
    q, k, v = oracle.qkv(rng, (2, 3, 5, 16), (2, 3, 7, 16), dtype="float64")
    bias = rng.standard_normal(bias_shape)
    feat = dict(bias=bias, window=(3, 1), softcap=2.5, alibi_slopes=np.array([0.1, 0.3, 0.2]))
    o, lse, _ = oracle.attention(q, k, v, None, False, **feat)
    do = rng.standard_normal(o.shape)
    grads = _backward(backend, do, q, k, v, o, lse, feat, return_dbias=True)
    h = 1e-6
    num = np.zeros(bias_shape)
    for idx in np.ndindex(*bias_shape):
        bp, bm = bias.copy(), bias.copy()
        bp[idx] += h
        bm[idx] -= h
        lp = np.sum(oracle.attention(q, k, v, None, False, **dict(feat, bias=bp))[0] * do)
        lm = np.sum(oracle.attention(q, k, v, None, False, **dict(feat, bias=bm))[0] * do)
        num[idx] = (lp - lm) / (2 * h)
    np.testing.assert_allclose(grads[3], num, rtol=1e-6, atol=1e-8)
    # and the analytic dq (through the softcap) against central differences of q
    numq = np.zeros(q.shape)
    for idx in np.ndindex(*q.shape):
        qp, qm = q.copy(), q.copy()
        qp[idx] += h
        qm[idx] -= h
        numq[idx] = (np.sum(oracle.attention(qp, k, v, None, False, **feat)[0] * do)
                     - np.sum(oracle.attention(qm, k, v, None, False, **feat)[0] * do)) / (2 * h)
    np.testing.assert_allclose(grads[0], numq, rtol=1e-6, atol=1e-8)


def test_blind_rows_get_zero_gradients(backend, rng):
    q, k, v = oracle.qkv(rng, (2, 40, 32), (2, 25, 32), dtype="float32")
    feat = dict(window=(2, 1), bias=rng.standard_normal((40, 25)).astype(np.float32))
    o, lse = _forward(backend, q, k, v, feat)
    do = oracle.randn(rng, o.shape, "float32")
    dq, dk, dv, db = _backward(backend, do, q, k, v, o, lse, feat, return_dbias=True)
    assert np.all(dq[:, :14] == 0) and np.all(db[:14] == 0)
    for g in (dq, dk, dv, db):
        assert not np.isnan(g).any()
    oracle.check_backward((dq, dk, dv, db), do, q, k, v, None, False, **feat)


# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------
def _qkv():
    return (np.ones((2, 3, 5, 8)), np.ones((2, 3, 7, 8)), np.ones((2, 3, 7, 8)))


@pytest.mark.parametrize("kw,match", [
    (dict(bias=np.ones((5, 6))), r"bias of shape \(5, 6\).*\(2, 3, 5, 7\)"),
    (dict(bias=np.ones((4, 5, 7))), r"bias of shape \(4, 5, 7\)"),
    (dict(window=(1.5, 2)), r"window left side must be an int"),
    (dict(window=(1, "2")), r"window right side"),
    (dict(window=3), r"window must be None or a pair"),
    (dict(window=(True, 2)), r"window left side"),
    (dict(alibi_slopes=np.ones(4)), r"alibi_slopes must have shape \(H,\) = \(3,\).*\(4,\)"),
    (dict(alibi_slopes=np.ones((2, 3, 1))), r"alibi_slopes must have shape"),
    (dict(softcap=0.0), r"softcap must be a positive"),
    (dict(softcap=-1), r"softcap must be a positive"),
    (dict(dropout_p=1.0, seed=1), r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1, seed=1), r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=0.1), r"needs a seed"),
    (dict(dropout_p=0.1, seed=1.5), r"seed must be an int"),
    (dict(dropout_p=0.1, seed=-1), r"seed must be in"),
])
@pytest.mark.parametrize("fn", ["tiled_attention", "standard_attention",
                                "tiled_attention_backward", "standard_attention_backward"])
def test_feature_errors(backend, fn, kw, match):
    q, k, v = _qkv()
    a = backend.asarray
    kw = {n: (a(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    with pytest.raises(ValueError, match=match):
        if fn == "tiled_attention":
            cuflash.tiled_attention(a(q), a(k), a(v), backend=backend.name, **kw)
        elif fn == "standard_attention":
            cuflash.standard_attention(a(q), a(k), a(v), backend=backend.name, **kw)
        elif fn == "standard_attention_backward":
            cuflash.standard_attention_backward(a(q), a(q), a(k), a(v), backend=backend.name,
                                                **kw)
        else:
            lse = np.zeros((2, 3, 5), np.float32)
            cuflash.tiled_attention_backward(a(q), a(q), a(k), a(v), a(q), a(lse),
                                             backend=backend.name, **kw)


def test_feature_type_errors(backend):
    q, k, v = _qkv()
    a = backend.asarray
    with pytest.raises(TypeError, match="bias"):
        cuflash.tiled_attention(a(q), a(k), a(v), bias=np.ones((5, 7), np.int32),
                                backend=backend.name)
    with pytest.raises(TypeError, match="alibi_slopes"):
        cuflash.tiled_attention(a(q), a(k), a(v), alibi_slopes=[0.1, 0.2, 0.3],
                                backend=backend.name)
    with pytest.raises(ValueError, match="return_dbias=True needs a bias"):
        lse = a(np.zeros((2, 3, 5), np.float32))
        cuflash.tiled_attention_backward(a(q), a(q), a(k), a(v), a(q), lse, return_dbias=True,
                                         backend=backend.name)


def test_unbounded_window_is_no_window(backend, rng):
    q, k, v = oracle.qkv(rng, (2, 20, 32), (2, 31, 32), dtype="float32")
    o1, l1 = _forward(backend, q, k, v, dict(window=(-1, None)))
    o2, l2 = _forward(backend, q, k, v, {})
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


def test_plus_inf_bias_makes_exactly_its_rows_nan(backend, rng):
    """A +inf bias entry: the rows that see it are NaN (as documented), no other row changes."""
    q, k, v = oracle.qkv(rng, (2, 40, 32), (2, 40, 32), dtype="float32")
    bias = np.zeros((1, 40, 40), np.float32)
    bias[0, 5, 7] = np.inf
    o, lse = _forward(backend, q, k, v, dict(bias=bias))
    ref, _ = _forward(backend, q, k, v, dict(bias=np.zeros_like(bias)))
    nan_rows = np.isnan(o).any(-1)
    assert nan_rows[:, 5].all() and nan_rows.sum() == 2
    assert np.isnan(lse[:, 5]).all()
    keep = ~nan_rows
    np.testing.assert_allclose(o[keep], ref[keep], rtol=0, atol=1e-6)


def test_window_wider_than_any_sequence(backend, rng):
    """Widths beyond 32 bits (2**40) reach every key, as an unbounded window does; the kernels'
    parameter block holds 32-bit widths (an OverflowError when packing before)."""
    q, k, v = oracle.qkv(rng, (2, 20, 32), (2, 31, 32), dtype="float32")
    o1, l1 = _forward(backend, q, k, v, dict(window=(2 ** 40, 2 ** 40)))
    o2, l2 = _forward(backend, q, k, v, {})
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    o3, _ = _forward(backend, q, k, v, dict(window=(2 ** 40, 0)))
    o4, _ = _forward(backend, q, k, v, dict(window=(None, 0)))
    np.testing.assert_array_equal(o3, o4)


# --------------------------------------------------------------------------
# the kernels: race checks, counted traffic, the window's cost, the repeated-call path
# --------------------------------------------------------------------------
def _all_features(rng, H, Nq, Nk, dtype="float32"):
    ct = np.float64 if dtype == "float64" else np.float32
    return dict(bias=rng.standard_normal((H, 1, Nk)).astype(ct), window=(9, 3),
                alibi_slopes=(rng.random(H) * 0.3).astype(ct), softcap=2.0, dropout_p=0.25,
                seed=4242)


def test_race_check_masked_kernels(rng):
    """flash_fwd_masked, flash_fwd_tf32_masked, flash_fwd_tc_masked, the masked backward
    (both dQ paths, dbias atomics), flash_bwd_tf32_masked and flash_bwd_tc_masked (both dQ
    paths) under TSan."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, kernels
    from cuflash.launch import bwd as launch_bwd, common as launch_common, fwd as launch_fwd
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 20, 16), (1, 1, 37, 16), dtype="float32")
    feat = _all_features(rng, 2, 20, 37)
    spec = _validate.check_attention_inputs(q, k, v, causal=True, block_q=16, block_kv=16)
    ms = _validate_masks.check_masks(spec, q, **feat)
    for kernel in ("flash_fwd_masked", "flash_fwd_tf32_masked"):     # RaceError on a race
        o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec, ms, kernel=kernel)
        oracle.check_forward(o, q, k, v, None, True, lse=lse, **feat)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    spec16 = _validate.check_attention_inputs(q16, k16, v16, causal=True, block_q=16,
                                              block_kv=16)
    o16, lse16 = launch_fwd.flash_fwd(rt, q16, k16, v16, spec16,
                                      _validate_masks.check_masks(spec16, q16, **feat),
                                      kernel="flash_fwd_tc_masked")
    oracle.check_forward(o16, q16, k16, v16, None, True, lse=lse16, **feat)
    do = oracle.randn(rng, o.shape, "float32")
    bspec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=16,
                                            block_kv=16)
    bms = _validate_masks.check_masks(bspec, q, return_dbias=True, **feat)
    # float32 on the tensor cores (flash_bwd_tf32_masked: atomic dQ, d = 32, 32-key tiles)
    qt, kt, vt = oracle.qkv(rng, (1, 2, 20, 32), (1, 1, 37, 32), dtype="float32")
    ot, lset = cuflash.tiled_attention(qt, kt, vt, causal=True, return_lse=True,
                                       backend="emulator", **feat)
    dot = oracle.randn(rng, ot.shape, "float32")
    tspec = _validate.check_backward_inputs(dot, qt, kt, vt, ot, lset, causal=True, block_q=16,
                                            block_kv=32)
    with launch_common.observe_launches() as seen:
        grads = launch_bwd.flash_bwd(
            rt, dot, qt, kt, vt, ot, lset, tspec,
            _validate_masks.check_masks(tspec, qt, return_dbias=True, **feat), False)
    assert "flash_bwd_tf32_masked" in [e["kernel"] for e in seen]
    oracle.check_backward(grads, dot, qt, kt, vt, None, True, **feat)
    for det in (True, False):
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, bspec, bms, det)
        oracle.check_backward(grads, do, q, k, v, None, True, **feat)
        # the tensor-core backward in float16 (dbias atomics: the bias is broadcast over rows)
        do16 = do.astype(np.float16)
        bspec16 = _validate.check_backward_inputs(do16, q16, k16, v16, o16, lse16, causal=True,
                                                  block_q=16, block_kv=16)
        grads16 = launch_bwd.flash_bwd(
            rt, do16, q16, k16, v16, o16, lse16, bspec16,
            _validate_masks.check_masks(bspec16, q16, return_dbias=True, **feat), det,
            kernel="flash_bwd_tc_masked")
        oracle.check_backward(grads16, do16, q16, k16, v16, None, True, **feat)


def _race_check_tc_backward(rng, q_shape, k_shape, dtype, causal, feat, bq, bkv, layout,
                            kernel="flash_bwd_tc_masked"):
    """``kernel`` (flash_bwd_tc_masked or a lean build) under TSan at block_q x block_kv
    (whose layout bwd_tc_layout must give as ``layout``), atomic and deterministic dQ, against
    the oracle."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, kernels, tiling
    from cuflash.launch import bwd as launch_bwd, common as launch_common
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, q_shape, k_shape, dtype=dtype)
    o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend="emulator", **feat)
    do = oracle.randn(rng, o.shape, dtype)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal, block_q=bq, block_kv=bkv)
    band = kernel in tiling.BWD_LEAN_KERNELS
    ms = _validate_masks.check_masks(spec, q, return_dbias=not band, **feat)
    assert tiling.bwd_tc_layout(bq, bkv, q_shape[-1], q_shape[-1], not band) == layout
    for det in (False, True):
        with launch_common.observe_launches() as seen:
            grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, ms, det,
                                         kernel=None if band else kernel)
        assert kernel in [e["kernel"] for e in seen]
        oracle.check_backward(grads, do, q, k, v, None, causal, **feat)


def test_race_check_tc_backward_pair_layout(rng):
    """flash_bwd_tc_masked under TSan in its layout of 16 keys per warp pair (kMT = 1 with the
    query split: P^T and dS^T of both warps through shared memory), atomic and deterministic
    dQ, every feature (the other race checks run 16 keys per warp without the split)."""
    _race_check_tc_backward(rng, (1, 2, 40, 96), (1, 1, 37, 96), "float16", True,
                            _all_features(rng, 2, 40, 37), 64, 16, (2, 1, 1, 2))


def test_race_check_tc_backward_lean_layout(rng):
    """flash_bwd_tc_masked under TSan in its d = 64 default layout (64 x 128, 8 warps, 32 keys
    per warp pair), the build that keeps the Q / dO sources and dQ addresses across tiles, P^T
    in float32 for dS^T and each K/V tile's range of query tiles inside the band: a window wide
    enough for tile pairs wholly inside it, Nq and Nk ragged, atomic and deterministic dQ,
    every feature."""
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 140, 64), "bfloat16", False,
                            dict(_all_features(rng, 2, 150, 140), window=(120, 100)), 64, 128,
                            (8, 2, 1, 2))


def test_race_check_tc_backward_band(rng):
    """flash_bwd_tc_band under TSan in FlashAttention-2's d = 64 layout (128 x 128, 8 warps, the
    query split: P^T and dS^T through shared memory, one dO buffer where the A100's shared
    memory needs it), a window with interior tile pairs and both edges, Nq and Nk ragged, atomic
    and deterministic dQ."""
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "bottom_right",
                            dict(window=(160, None)), 128, 128, (8, 2, 1, 2),
                            kernel="flash_bwd_tc_band")


def test_race_check_tc_backward_alibi(rng):
    """flash_bwd_tc_alibi under TSan in FlashAttention-2's d = 64 layout, a window with interior
    tile pairs and both edges, Nq and Nk ragged, atomic and deterministic dQ."""
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "top_left",
                            dict(window=(160, 40), alibi_slopes=np.full(2, 0.3, np.float32)),
                            128, 128, (8, 2, 1, 2), kernel="flash_bwd_tc_alibi")


def test_race_check_tc_backward_softcap(rng):
    """flash_bwd_tc_softcap under TSan in FlashAttention-2's d = 64 layout (its r form), a
    window with interior tile pairs and both edges, Nq and Nk ragged, atomic and deterministic
    dQ."""
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "bottom_right",
                            dict(window=(160, None), softcap=2.0), 128, 128, (8, 2, 1, 2),
                            kernel="flash_bwd_tc_softcap")


def test_race_check_tc_backward_dropout(rng):
    """flash_bwd_tc_dropout under TSan in FlashAttention-2's d = 64 layout (the 64-bit keep
    word, four Philox blocks per step), a window with interior tile pairs and both edges, Nq
    and Nk ragged, atomic and deterministic dQ."""
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "bottom_right",
                            dict(window=(160, None), dropout_p=0.3, seed=int(rng.integers(0, 2 ** 63))), 128, 128,
                            (8, 2, 1, 2),
                            kernel="flash_bwd_tc_dropout")


def test_race_check_tc_backward_alibi_dropout(rng):
    """flash_bwd_tc_alibi_dropout under TSan in the same layout (the query split, the dK / dV
    stores' lane key read again), slopes per (batch, head), a window, Nq and Nk ragged."""
    slopes = (rng.random((1, 2)) * 0.5).astype(np.float32)
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "bottom_right",
                            dict(window=(160, None), alibi_slopes=slopes, dropout_p=0.3,
                                 seed=int(rng.integers(0, 2 ** 63))), 128, 128,
                            (8, 2, 1, 2),
                            kernel="flash_bwd_tc_alibi_dropout")


def test_race_check_tc_backward_alibi_softcap(rng):
    """flash_bwd_tc_alibi_softcap under TSan in FlashAttention-2's d = 64 layout (its r form,
    ALiBi in the exponent), slopes per (batch, head), a window, Nq and Nk ragged."""
    slopes = (rng.random((1, 2)) * 0.5).astype(np.float32)
    _race_check_tc_backward(rng, (1, 2, 150, 64), (1, 1, 270, 64), "float16", "top_left",
                            dict(window=(160, 40), alibi_slopes=slopes, softcap=2.0), 128, 128,
                            (8, 2, 1, 2), kernel="flash_bwd_tc_alibi_softcap")


def test_tc_backward_sm90_default_d128(rng):
    """flash_bwd_tc_masked's H100 default at d = 128 (128 x 64, 8 warps, 16 keys per warp pair in
    one pass; 206 KB of shared memory: an emulated sm_90) against the oracle, every feature
    with dbias stored."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, kernels, tiling
    from cuflash.launch import bwd as launch_bwd, common as launch_common
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", arch="sm_90")
    p = tiling.plan("flash_bwd_tc_masked", 128, 128, "bfloat16", limit=rt.smem_limit)
    assert (p.block_q, p.block_kv, p.threads) == (128, 64, 256)
    assert tiling.bwd_tc_layout(128, 64, 128, 128, True) == (8, 1, 1, 2)
    q, k, v = oracle.qkv(rng, (1, 2, 150, 128), (1, 2, 140, 128), dtype="bfloat16")
    feat = dict(bias=(rng.standard_normal((1, 2, 150, 140)) * 2).astype(np.float32),
                softcap=3.0, dropout_p=0.1, seed=7, window=(60, None), alibi_slopes=np.array(
                    [0.1, 0.2], np.float32))
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **feat)
    do = oracle.randn(rng, o.shape, "bfloat16")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse)
    ms = _validate_masks.check_masks(spec, q, return_dbias=True, **feat)
    with launch_common.observe_launches() as seen, poisoned_outputs():
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, ms, False)
    assert [e["kernel"] for e in seen] == ["flash_bwd_tc_preprocess", "flash_bwd_tc_masked",
                                           "flash_bwd_tc_dq_convert"]
    assert (seen[1]["block"][0], seen[1]["shared_mem"]) == (256, p.shared_bytes) == (256, 210944)
    oracle.check_backward(grads, do, q, k, v, None, False, **feat)


@pytest.mark.parametrize("bias_shape", [(1, 2, 40, 70), (1, 1, 1, 70)])
def test_race_check_tf32_backward_row_paths(rng, bias_shape):
    """flash_bwd_tf32_masked under TSan where its bias and dbias row loops run (no softcap,
    interior tiles of 16 x 32 with contiguous keys): dbias stored by one block per element
    (a full bias, with ALiBi) and added atomically (a key-padding bias, with dropout)."""
    from conftest import require_backend
    from cuflash import _validate, _validate_masks, kernels
    from cuflash.launch import bwd as launch_bwd, common as launch_common
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 40, 32), (1, 2, 70, 32), dtype="float32")
    feat = dict(bias=rng.standard_normal(bias_shape).astype(np.float32))
    feat.update(dict(alibi_slopes=(rng.random(2) * 0.3).astype(np.float32))
                if bias_shape[1] == 2 else dict(dropout_p=0.2, seed=7))
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **feat)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, block_q=16, block_kv=32)
    with launch_common.observe_launches() as seen:  # RaceError on a race
        grads = launch_bwd.flash_bwd(
            rt, do, q, k, v, o, lse, spec,
            _validate_masks.check_masks(spec, q, return_dbias=True, **feat), False)
    assert "flash_bwd_tf32_masked" in [e["kernel"] for e in seen]
    oracle.check_backward(grads, do, q, k, v, None, False, **feat)


def _counted(kernel_backend, fn):
    from cuflash.launch import common as launch_common
    with launch_common.observe_launches() as seen:
        out = fn()
    return out, seen


def _traffic_case(rng, window, bias, alibi, dtype):
    """(B, H, Hk, d, Nq, Nk, q, k, v, features) of a traffic test: GQA 4/2, the lengths the
    bias names (or 60 x 60 for the one-key window)."""
    B, H, Hk, d = 2, 4, 2, 32
    Nq, Nk = {(77, 130): (77, 130), (2, 1, 1, 77): (130, 77)}.get(bias, (77, 130))
    if window == (0, 0):
        Nq = Nk = 60
    q, k, v = oracle.qkv(rng, (B, H, Nq, d), (B, Hk, Nk, d), dtype=dtype)
    feat = dict(window=window)
    if bias is not None:
        feat["bias"] = rng.standard_normal(bias).astype(np.float32)
    if alibi:
        feat["alibi_slopes"] = np.full(H, 0.1, np.float32)
    return B, H, Hk, d, Nq, Nk, q, k, v, feat


TRAFFIC_CASES = [
    (None, (10, 5), None, False),
    ("bottom_right", (10, None), (77, 130), True),
    ("top_left", (3, 20), (2, 1, 1, 77), True),
    (None, (0, 0), (2, 4, 60, 60), False),
]


@pytest.mark.parametrize("causal,window,bias,alibi", TRAFFIC_CASES)
def test_masked_traffic_is_counted(kernel_backend, rng, causal, window, bias, alibi):
    """The emulator's byte counters equal the model: window-skipped tiles never loaded, the
    bias read per visible element, dbias stored (full bias) or added (broadcast)."""
    if kernel_backend.name != "emulator":
        pytest.skip("byte counters are the emulator's")
    from cuflash import emulator_backend, tiling
    B, H, Hk, d, Nq, Nk, q, k, v, feat = _traffic_case(rng, window, bias, alibi, "float32")
    (o, lse), seen = _counted(kernel_backend, lambda: _forward(
        kernel_backend, q, k, v, feat, causal=causal or False))
    rt = emulator_backend.runtime()
    plan = rt.plan_fwd(d, d, "float32", masked=True)
    want = tiling.flash_fwd_masked_traffic(B, H, Nq, Nk, d, d, "float32", plan.block_q,
                                           plan.block_kv, causal, window, bias is not None, alibi,
                                           threads=plan.threads)
    assert [e["kernel"] for e in seen] == ["flash_fwd_tf32_masked"]
    assert (seen[0]["global_bytes_read"], seen[0]["global_bytes_written"]) == want
    # the SIMT kernel, forced: its own tiles and threads
    from cuflash import _validate, _validate_masks
    from cuflash.launch import bwd as launch_bwd, fwd as launch_fwd
    spec = _validate.check_attention_inputs(q, k, v, causal=causal or False)
    ms = _validate_masks.check_masks(spec, q, **feat)
    _, seen = _counted(kernel_backend, lambda: launch_fwd.flash_fwd(
        rt, q, k, v, spec, ms, kernel="flash_fwd_masked"))
    sp = rt.plan("flash_fwd_masked", d, d, "float32")
    assert [e["kernel"] for e in seen] == ["flash_fwd_masked"]
    assert (seen[0]["global_bytes_read"], seen[0]["global_bytes_written"]) == \
        tiling.flash_fwd_masked_traffic(B, H, Nq, Nk, d, d, "float32", sp.block_q, sp.block_kv,
                                        causal, window, bias is not None, alibi)
    do = oracle.randn(rng, o.shape, "float32")
    bp = rt.plan("flash_bwd_dkdv", d, d, "float32")
    db = None if bias is None else ("store" if tuple(bias) == (B, H, Nq, Nk) else "atomic")
    bspec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal or False)
    bms = _validate_masks.check_masks(bspec, q, return_dbias=bias is not None, **feat)
    for det in (True, False):   # the SIMT kernels (forced on the atomic path)
        _, seen = _counted(kernel_backend, lambda: launch_bwd.flash_bwd(
            rt, do, q, k, v, o, lse, bspec, bms, det, kernel="flash_bwd_dkdv_masked"))
        got = (sum(e["global_bytes_read"] for e in seen),
               sum(e["global_bytes_written"] for e in seen))
        assert got == tiling.flash_bwd_masked_traffic(
            B, H, Hk, Nq, Nk, d, d, "float32", bp.block_q, bp.block_kv, causal, window,
            bias is not None, alibi, db, det), [e["kernel"] for e in seen]
    # float32's default atomic path: flash_bwd_tf32_masked
    _, seen = _counted(kernel_backend, lambda: _backward(
        kernel_backend, do, q, k, v, o, lse, feat, causal=causal or False,
        return_dbias=bias is not None))
    tp = tiling.plan_bwd_tf32(d, d, "float32", limit=rt.smem_limit, masked=True)
    assert [e["kernel"] for e in seen] == ["flash_bwd_preprocess", "flash_bwd_tf32_masked",
                                           "flash_bwd_dq_convert"]
    assert (sum(e["global_bytes_read"] for e in seen),
            sum(e["global_bytes_written"] for e in seen)) == tiling.flash_bwd_tf32_masked_traffic(
        B, H, Hk, Nq, Nk, d, d, tp.block_q, tp.block_kv, tp.threads, causal, window,
        bias is not None, alibi, db)


@pytest.mark.parametrize("causal,window,bias,alibi", TRAFFIC_CASES)
def test_tc_masked_traffic_is_counted(kernel_backend, rng, causal, window, bias, alibi):
    """float16 with features: flash_fwd_tc_masked and flash_bwd_tc_masked (flash_bwd_tc_band for
    a window alone: the same model) read and write what their models say (window-skipped tiles
    never loaded, the bias per visible element and pass, dbias stored or added), on both dQ
    paths."""
    if kernel_backend.name != "emulator":
        pytest.skip("byte counters are the emulator's")
    from cuflash import emulator_backend, tiling
    from cuflash.launch import bwd as launch_bwd
    B, H, Hk, d, Nq, Nk, q, k, v, feat = _traffic_case(rng, window, bias, alibi, "float16")
    (o, lse), seen = _counted(kernel_backend, lambda: _forward(
        kernel_backend, q, k, v, feat, causal=causal or False))
    rt = emulator_backend.runtime()
    fp = rt.plan_fwd(d, d, "float16", masked=True)
    assert [e["kernel"] for e in seen] == ["flash_fwd_tc_masked"]
    assert (seen[0]["global_bytes_read"], seen[0]["global_bytes_written"]) == \
        tiling.flash_fwd_masked_traffic(B, H, Nq, Nk, d, d, "float16", fp.block_q, fp.block_kv,
                                        causal, window, bias is not None, alibi,
                                        threads=fp.threads)
    do = oracle.randn(rng, o.shape, "float16")
    band = bias is None and not alibi and window is not None
    bp = launch_bwd.plan_backward(rt, d, d, "float16", masked=True,
                                  lean=tiling.BWD_BAND_KERNEL if band else None)
    assert bp.kernel == (tiling.BWD_BAND_KERNEL if band else "flash_bwd_tc_masked")
    db = None if bias is None else ("store" if tuple(bias) == (B, H, Nq, Nk) else "atomic")
    _assert_tc_bwd_traffic(kernel_backend, rt, bp, (B, H, Hk, d, Nq, Nk), (do, q, k, v, o, lse),
                           feat, causal, window, bias is not None, alibi, db)


def _assert_tc_bwd_traffic(kernel_backend, rt, bp, dims, arrays, feat, causal, window, bias,
                           alibi, db):
    """The backward on plan ``bp`` moves what flash_bwd_tc_masked_traffic says, both dQ paths."""
    from cuflash import tiling
    from cuflash.launch import bwd_tc as launch_bwd_tc
    B, H, Hk, d, Nq, Nk = dims
    passes = tiling.kernel_tiling(bp.kernel).defines(bp.block_q, bp.block_kv, d, d)["CUFLASH_BWD_PASSES"]
    for det in (True, False):
        _, seen = _counted(kernel_backend, lambda: _backward(
            kernel_backend, *arrays, feat, causal=causal or False, deterministic=det,
            return_dbias=db is not None))
        assert [e["kernel"] for e in seen] == ["flash_bwd_tc_preprocess", bp.kernel,
                                               "flash_bwd_tc_dq_convert"]
        got = (sum(e["global_bytes_read"] for e in seen),
               sum(e["global_bytes_written"] for e in seen))
        splits = launch_bwd_tc.dq_splits(rt, bp, -(-Nk // bp.block_kv), B * Hk, det)
        assert got == tiling.flash_bwd_tc_masked_traffic(
            B, H, Hk, Nq, Nk, d, d, bp.block_q, bp.block_kv, bp.threads, passes, causal, window,
            bias, alibi, db, splits)


@pytest.mark.parametrize("causal,window,kind", [("bottom_right", (10, None), "softcap"),
                                               (None, None, "softcap"), ("top_left", (3, 20), "alibi"),
                                               ("bottom_right", (12, 4), "dropout"), (None, None, "dropout"),
                                               ("top_left", (6, 9), "alibi_dropout"),
                                               ("bottom_right", (12, 4), "alibi_softcap")])
def test_tc_lean_traffic_is_counted(kernel_backend, rng, causal, window, kind):
    """float16 with a softcap, ALiBi, dropout, ALiBi and dropout or ALiBi and a softcap and at
    most a window: flash_bwd_tc_softcap, flash_bwd_tc_alibi, flash_bwd_tc_dropout,
    flash_bwd_tc_alibi_dropout and flash_bwd_tc_alibi_softcap read and write what
    flash_bwd_tc_masked's model says for the same band and features (a softcap and dropout
    cost no bytes), on both dQ paths."""
    if kernel_backend.name != "emulator":
        pytest.skip("byte counters are the emulator's")
    from cuflash import emulator_backend, tiling
    from cuflash.launch import bwd as launch_bwd
    alibi = kind.startswith("alibi")
    B, H, Hk, d, Nq, Nk, q, k, v, feat = _traffic_case(rng, window, None, alibi, "float16")
    if kind.endswith("softcap"):
        feat["softcap"] = 2.5
    if kind.endswith("dropout"):
        feat.update(dropout_p=0.3, seed=11)
    lean = f"flash_bwd_tc_{kind}"
    assert lean in tiling.BWD_LEAN_KERNELS
    o, lse = _forward(kernel_backend, q, k, v, feat, causal=causal or False)
    do = oracle.randn(rng, o.shape, "float16")
    rt = emulator_backend.runtime()
    bp = launch_bwd.plan_backward(rt, d, d, "float16", masked=True, lean=lean)
    assert bp.kernel == lean
    _assert_tc_bwd_traffic(kernel_backend, rt, bp, (B, H, Hk, d, Nq, Nk), (do, q, k, v, o, lse),
                           feat, causal, window, False, alibi, None)


def test_window_cost_grows_with_the_window_not_nk():
    """Modelled K/V traffic of a window of w keys is ~ proportional to w (plus the tiles a
    query tile's band straddles: about w + block_q + block_kv keys per row), flat in Nk."""
    from cuflash import tiling
    def kv_bytes(Nk, w):
        r, _ = tiling.flash_fwd_masked_traffic(1, 1, Nk, Nk, 64, 64, "float16", 64, 64,
                                               "bottom_right", (w, 0))
        return r - Nk * 64 * 2                                  # minus Q
    for w in (128, 256):
        per_key = [kv_bytes(Nk, w) / Nk for Nk in (2048, 4096, 8192)]
        assert max(per_key) / min(per_key) < 1.06, per_key     # flat in Nk
    assert 1.5 < kv_bytes(8192, 256) / kv_bytes(8192, 128) < 2.0
    full, _ = tiling.flash_fwd_masked_traffic(1, 1, 8192, 8192, 64, 64, "float16", 64, 64,
                                              "bottom_right", None)
    assert kv_bytes(8192, 128) < 0.05 * full


def test_backward_window_skips_tiles(kernel_backend, rng):
    """A narrow window: the backward kernels load few K/V (dq) and Q (dkdv) tiles."""
    if kernel_backend.name != "emulator":
        pytest.skip("byte counters are the emulator's")
    q, k, v = oracle.qkv(rng, (1, 1, 512, 32), (1, 1, 512, 32), dtype="float32")
    o, lse, _ = oracle.attention(q, k, v, None, True, window=(8, 0))
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    do = oracle.randn(rng, o.shape, "float32")
    got = {}
    for w in ((8, 0), None):
        _, seen = _counted(kernel_backend, lambda: _backward(
            kernel_backend, do, q, k, v, o, lse, dict(window=w), causal=True,
            deterministic=True))
        got[w] = sum(e["global_bytes_read"] for e in seen if e["kernel"] != "flash_bwd_preprocess")
    assert got[(8, 0)] < 0.6 * got[None], got   # 8 tiles of 64: 15 of 36 tile pairs


def test_repeated_call_and_new_seeds_reuse_the_plan(kernel_backend, rng):
    """A repeated feature call is a cache hit; a new seed adds a parameter block, not a plan."""
    if kernel_backend.name != "emulator":
        pytest.skip("host-side cache of the emulator runtime")
    from cuflash import emulator_backend
    rt = emulator_backend.runtime()
    q, k, v = oracle.qkv(rng, (1, 2, 24, 32), (1, 2, 24, 32), dtype="float32")
    bias = rng.standard_normal((24, 24)).astype(np.float32)
    feat = dict(bias=bias, dropout_p=0.1, seed=1)
    _forward(kernel_backend, q, k, v, feat)
    n = len(rt.calls)
    for seed in (1, 2, 3):
        o, lse = _forward(kernel_backend, q, k, v, dict(feat, seed=seed))
        oracle.check_forward(o, q, k, v, None, False, lse=lse, **dict(feat, seed=seed))
    assert len(rt.calls) == n
    with pytest.raises(ValueError, match="seed must be"):
        _forward(kernel_backend, q, k, v, dict(feat, seed=-5))


def test_memory_analysis_counts_bias_and_window(backend):
    """A bias adds O(size of bias) bytes (and dbias the same); a window cuts the traffic."""
    kw = dict(batch=2, heads=8, backend=backend.name)
    for shape in ((1024, 1024), (2, 1, 1, 1024), (2, 8, 1024, 1024)):
        m = cuflash.memory_analysis(1024, 64, "float16", bias_shape=shape, **kw)
        n = int(np.prod(shape))
        assert m["bias_bytes"] == m["dbias_bytes"] == 4 * n
        assert m["bias_hbm_read_bytes"] == 2 * 8 * 1024 * 1024 * 4
        assert m["tiled_extra_bytes"] == cuflash.memory_analysis(
            1024, 64, "float16", block_q=m["block_q"], block_kv=m["block_kv"],
            **kw)["tiled_extra_bytes"]
    N = 4096
    w = cuflash.memory_analysis(N, 64, "float16", window=(64, 0), **kw)
    full = cuflash.memory_analysis(N, 64, "float16", window=(-1, -1), block_q=w["block_q"],
                                   block_kv=w["block_kv"], **kw)
    assert w["tiled_hbm_read_bytes"] < 0.3 * full["tiled_hbm_read_bytes"]
    assert abs(w["visible_fraction"] - (65 * N - 64 * 65 / 2) / N ** 2) < 1e-9
    assert cuflash.memory_analysis(N, 64, "float16", **kw)["standard_hbm_bytes"] == \
        w["standard_hbm_bytes"]
    with pytest.raises(ValueError, match="bias_shape"):
        cuflash.memory_analysis(1024, 64, bias_shape=(3, 1024, 1024), **kw)


# --------------------------------------------------------------------------
# the serving calls: varlen (forward and backward) and the KV cache
# --------------------------------------------------------------------------
VARLEN_FEATURES = [
    dict(window=(6, 2), alibi_slopes=(4,)),
    dict(bias=(3, 4, 40, 50), softcap=2.5, dropout_p=0.2),
    dict(bias=(1, 1, 50), window=(None, 4), alibi_slopes=(3, 4)),
]


@pytest.mark.parametrize("feat", VARLEN_FEATURES, ids=_feat_id)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_features(backend, rng, feat, causal):
    """Packed sequences, features per sequence (bias[b, h, i, j] of the padded extent, the
    window and ALiBi at each sequence's len_k - len_q, dropout of batch b)."""
    H, Hk, d = 4, 2, 32
    lq, lk = [17, 0, 40], [31, 9, 50]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    feat = _materialise(rng, feat, "float32")
    q = oracle.randn(rng, (cu_q[-1], H, d), "float32")
    k = oracle.randn(rng, (cu_k[-1], Hk, d), "float32")
    v = oracle.randn(rng, (cu_k[-1], Hk, d), "float32")
    a = backend.asarray
    fa = {n: (a(x) if isinstance(x, np.ndarray) else x) for n, x in feat.items()}
    with poisoned_outputs():
        o, lse = cuflash.varlen_attention(a(q), a(k), a(v), a(cu_q), a(cu_k), causal=causal,
                                          return_lse=True, backend=backend.name, **fa)
    o, lse = backend.to_numpy(o), backend.to_numpy(lse)
    do = oracle.randn(rng, o.shape, "float32")
    with_db = "bias" in feat
    with poisoned_outputs():
        g = cuflash.varlen_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse), a(cu_q),
                                              a(cu_k), causal=causal, return_dbias=with_db,
                                              backend=backend.name, **fa)
    g = [backend.to_numpy(x) for x in g]
    dbias_ref = np.zeros(feat["bias"].shape) if with_db else None
    for b in range(3):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        fb = oracle.sequence_features(feat, b, q1 - q0, k1 - k0)
        t = lambda x, lo, hi: x[lo:hi].swapaxes(0, 1)  # noqa: E731
        qb, kb, vb = t(q, q0, q1), t(k, k0, k1), t(v, k0, k1)
        oracle.check_forward(t(o, q0, q1), qb, kb, vb, None, causal, lse=t(lse, q0, q1), **fb)
        grads = (t(g[0], q0, q1), t(g[1], k0, k1), t(g[2], k0, k1))
        refs = oracle.attention_backward(t(do, q0, q1), qb, kb, vb, None, causal,
                                         return_dbias=with_db, **fb)
        for x, r_, n in zip(grads, refs, ("dq", "dk", "dv")):
            oracle.assert_rel_close(x, r_, "float32", n)
        if with_db:
            x = dbias_ref.reshape((1,) * (4 - dbias_ref.ndim) + dbias_ref.shape)
            x = x[b if x.shape[0] > 1 else 0]
            x[:, :q1 - q0 if x.shape[1] > 1 else 1, :k1 - k0 if x.shape[2] > 1 else 1] += refs[3]
    if with_db:
        oracle.assert_rel_close(g[3], dbias_ref, "float32", "dbias")


@pytest.mark.parametrize("neutral", [dict(window=(-1, -1)), dict(seed=3)], ids=["window", "seed"])
def test_varlen_neutral_features(backend, rng, neutral):
    """Values that name no feature (an unbounded window, a seed without dropout) give the
    plain results on packed sequences, forward and backward."""
    H, d = 2, 16
    cu = np.array([0, 4, 10], np.int32)
    q, k, v = (oracle.randn(rng, (10, H, d), "float32") for _ in range(3))
    a, n = backend.asarray, backend.to_numpy
    args = (a(q), a(k), a(v), a(cu), a(cu))
    o, lse = cuflash.varlen_attention(*args, causal=True, return_lse=True, backend=backend.name)
    do = a(oracle.randn(rng, o.shape, "float32"))
    plain = cuflash.varlen_attention_backward(do, *args[:3], o, lse, *args[3:], causal=True,
                                              backend=backend.name)
    o2 = cuflash.varlen_attention(*args, causal=True, backend=backend.name, **neutral)
    assert np.array_equal(n(o2), n(o))
    grads = cuflash.varlen_attention_backward(do, *args[:3], o, lse, *args[3:], causal=True,
                                              backend=backend.name, **neutral)
    for g, p_ in zip(grads, plain):
        assert np.array_equal(n(g), n(p_))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("Nq", [1, 5])
def test_kvcache_features(backend, rng, paged, Nq):
    """Decoding with a window, ALiBi, softcap and a bias over the cache positions; GQA 8/2
    (the query heads of a kv head packed into one problem)."""
    B, H, Hk, d, cap, page = 3, 8, 2, 32, 64, 16
    lens = np.array([5, 40, 63 - Nq], np.int32)
    kn = oracle.randn(rng, (B, Hk, Nq, d), "float32")
    vn = oracle.randn(rng, (B, Hk, Nq, d), "float32")
    q = oracle.randn(rng, (B, H, Nq, d), "float32")
    if paged:
        kc = oracle.randn(rng, (B * cap // page, Hk, page, d), "float32")
        vc = oracle.randn(rng, (B * cap // page, Hk, page, d), "float32")
        table = rng.permutation(B * cap // page).reshape(B, cap // page).astype(np.int32)
    else:
        kc = oracle.randn(rng, (B, Hk, cap, d), "float32")
        vc = oracle.randn(rng, (B, Hk, cap, d), "float32")
        table = None
    feat = dict(window=(20, None), alibi_slopes=(rng.random(H) * 0.2).astype(np.float32),
                softcap=3.0, bias=rng.standard_normal((B, 1, Nq, cap)).astype(np.float32))
    a = backend.asarray
    kc_b, vc_b = a(kc.copy()), a(vc.copy())
    fa = {n: (a(x) if isinstance(x, np.ndarray) else x) for n, x in feat.items()}
    with poisoned_outputs():
        o, lse = cuflash.attention_with_kvcache(
            a(q), kc_b, vc_b, cache_seqlens=a(lens), k_new=a(kn), v_new=a(vn),
            block_table=None if table is None else a(table), causal=True, return_lse=True,
            backend=backend.name, **fa)
    o, lse = backend.to_numpy(o), backend.to_numpy(lse)
    kc2, vc2 = backend.to_numpy(kc_b), backend.to_numpy(vc_b)
    for b in range(B):
        L = int(lens[b]) + Nq
        if paged:
            kb = np.concatenate([kc2[table[b, p]] for p in range(-(-L // page))], axis=1)[:, :L]
            vb = np.concatenate([vc2[table[b, p]] for p in range(-(-L // page))], axis=1)[:, :L]
        else:
            kb, vb = kc2[b, :, :L], vc2[b, :, :L]
        np.testing.assert_array_equal(kb[:, L - Nq:], kn[b])
        fb = oracle.sequence_features(feat, b, Nq, L)
        oracle.check_forward(o[b], q[b], kb, vb, None, True, lse=lse[b], **fb)


def test_race_check_serving_masked(rng):
    """flash_fwd_serving_masked (paged cache, packed GQA rows, all features) under TSan."""
    from conftest import require_backend
    from cuflash import kernels
    from cuflash.launch import common as launch_common, features, serving as launch_serving
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    B, H, Hk, d, page, Nq = 2, 2, 1, 16, 8, 3
    kc = oracle.randn(rng, (8, Hk, page, d), "float32")
    vc = oracle.randn(rng, (8, Hk, page, d), "float32")
    table = rng.permutation(8).reshape(B, 4).astype(np.int32)
    q = oracle.randn(rng, (B, H, Nq, d), "float32")
    lens = np.array([7, 25], np.int32)
    feat = dict(bias=rng.standard_normal((B, H, Nq, 32)).astype(np.float32), window=(9, None),
                alibi_slopes=np.array([0.1, 0.3], np.float32), softcap=2.0, dropout_p=0.2,
                seed=11)
    with launch_common.observe_launches() as seen:
        o, lse = launch_serving.attention_with_kvcache(rt, q, kc, vc, lens, None, None, table,
                                                       None, True, None, True, True,
                                                       features.of(**feat))
    assert [e["kernel"] for e in seen] == ["flash_fwd_serving_masked"]
    for b in range(B):
        L = int(lens[b])
        kb = np.concatenate([kc[table[b, p]] for p in range(-(-L // page))], axis=1)[:, :L]
        vb = np.concatenate([vc[table[b, p]] for p in range(-(-L // page))], axis=1)[:, :L]
        oracle.check_forward(o[b], q[b], kb, vb, None, True, lse=lse[b],
                             **oracle.sequence_features(feat, b, Nq, L))


# --------------------------------------------------------------------------
# the framework wrappers
# --------------------------------------------------------------------------
def test_torch_attention_features(rng):
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    q = torch.tensor(rng.standard_normal((2, 4, 17, 16)), requires_grad=True)
    k = torch.tensor(rng.standard_normal((2, 2, 23, 16)), requires_grad=True)
    v = torch.tensor(rng.standard_normal((2, 2, 23, 16)), requires_grad=True)
    bias = torch.tensor(rng.standard_normal((4, 1, 23)), requires_grad=True)
    slopes = torch.tensor(rng.random(4))
    feat = dict(window=(5, 2), softcap=2.0, dropout_p=0.1, seed=3)
    o = ct.attention(q, k, v, bias=bias, alibi_slopes=slopes, causal=True, **feat)
    do = torch.tensor(rng.standard_normal(o.shape))
    o.backward(do)
    ofeat = dict(feat, bias=bias.detach().numpy(), alibi_slopes=slopes.numpy())
    n = lambda t: t.detach().numpy()  # noqa: E731
    oracle.assert_rel_close(n(o), oracle.attention(n(q), n(k), n(v), None, True, **ofeat)[0],
                            "float64", "o")
    refs = oracle.attention_backward(n(do), n(q), n(k), n(v), None, True, return_dbias=True,
                                     **ofeat)
    for t, r_, name in zip((q, k, v, bias), refs, ("dq", "dk", "dv", "dbias")):
        oracle.assert_rel_close(t.grad.numpy(), r_, "float64", name)
    # seed=None draws from torch's generator: torch.manual_seed makes it repeatable
    torch.manual_seed(5)
    a = ct.attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    assert torch.equal(a, ct.attention(q, k, v, dropout_p=0.3))


def test_jax_attention_features(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cuflash.jax as cj
    q = rng.standard_normal((2, 4, 17, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 23, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 23, 16)).astype(np.float32)
    bias = rng.standard_normal((4, 1, 23)).astype(np.float32)
    slopes = rng.random(4).astype(np.float32)
    do = rng.standard_normal((2, 4, 17, 16)).astype(np.float32)
    feat = dict(window=(5, 2), softcap=2.0, dropout_p=0.1)

    def loss(q, k, v, b, seed):
        return jnp.sum(cj.attention(q, k, v, bias=b, alibi_slopes=jnp.asarray(slopes),
                                    causal=True, seed=seed, **feat) * do)
    ofeat = dict(feat, bias=bias, alibi_slopes=slopes, seed=7)
    refs = oracle.attention_backward(do, q, k, v, None, True, return_dbias=True, **ofeat)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    for f in (grad, jax.jit(grad)):      # a traced seed: no retrace per step
        g = f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bias),
              jnp.uint32(7))
        for x, r_, name in zip(g, refs, ("dq", "dk", "dv", "dbias")):
            oracle.assert_rel_close(np.asarray(x), r_, "float32", name)
    with pytest.raises(ValueError, match="needs a seed"):
        cj.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), dropout_p=0.1)


def test_bias_layouts(backend, rng):
    """Bias views that are strided, stride-0 broadcasts, a float16 bias with float32 inputs,
    and a bias broadcast along an inner batch axis only (no single batch stride)."""
    q, k, v = oracle.qkv(rng, (2, 3, 2, 13, 16), (2, 3, 2, 21, 16), dtype="float32")
    do = oracle.randn(rng, (2, 3, 2, 13, 16), "float32")
    big = rng.standard_normal((2, 4, 26, 21)).astype(np.float32)
    cases = [
        big[:, None, ::2, ::2, :],                                      # strided (2,1,2,13,21)
        np.broadcast_to(rng.standard_normal((1, 21)).astype(np.float32), (2, 3, 2, 13, 21)),
        rng.standard_normal((13, 21)).astype(np.float16),
        rng.standard_normal((2, 1, 2, 13, 21)).astype(np.float32),      # inner batch axis 1
    ]
    for bias in cases:
        o, lse = _forward(backend, q, k, v, dict(bias=bias), causal=True)
        oracle.check_forward(o, q, k, v, None, True, lse=lse, bias=bias)
        g = _backward(backend, do, q, k, v, o, lse, dict(bias=bias), causal=True,
                      return_dbias=True)
        assert g[3].shape == bias.shape and g[3].dtype == bias.dtype
        ref = oracle.attention_backward(do, q, k, v, None, True, return_dbias=True, bias=bias)
        tol = "float64" if bias.dtype == np.float16 else "float32"
        if bias.dtype == np.float16:   # dbias rounded to float16 at the end
            np.testing.assert_allclose(g[3].astype(np.float64), ref[3], rtol=2e-3, atol=2e-3)
        else:
            oracle.assert_rel_close(g[3], ref[3], tol, "dbias")
        for x, r_, n in zip(g[:3], ref[:3], ("dq", "dk", "dv")):
            oracle.assert_rel_close(x, r_, "float32", n)


@pytest.mark.parametrize("Nq,Nk", [(0, 9), (7, 0)])
def test_empty_sequences_with_features(backend, rng, Nq, Nk):
    q, k, v = oracle.qkv(rng, (2, Nq, 16), (2, Nk, 16), dtype="float32")
    feat = dict(bias=np.zeros((Nq, Nk), np.float32), window=(2, 2), softcap=1.0,
                dropout_p=0.5, seed=1)
    o, lse = _forward(backend, q, k, v, feat)
    assert o.shape == (2, Nq, 16) and np.all(o == 0) and np.all(np.isneginf(lse))
    g = _backward(backend, np.zeros_like(o), q, k, v, o, lse, feat, return_dbias=True)
    assert [x.shape for x in g] == [q.shape, k.shape, v.shape, (Nq, Nk)]
    assert all(np.all(x == 0) for x in g)


def test_cuda_standard_attention_features_over_numpy(rng):
    """The "cuda" backend's standard attention is array code over xp: run it with NumPy."""
    from cuflash import _validate, _validate_masks
    from cuflash import cuda_backend as cb
    q, k, v = oracle.qkv(rng, (2, 4, 19, 16), (2, 2, 27, 16), dtype="float64")
    do = oracle.randn(rng, (2, 4, 19, 16), "float64")
    feat = dict(bias=rng.standard_normal((4, 1, 27)), window=(6, 3), softcap=2.0,
                alibi_slopes=rng.random(4), dropout_p=0.2, seed=99)
    spec = _validate.check_attention_inputs(q, k, v, causal=True)
    ms = _validate_masks.check_masks(spec, q, **feat)
    o, p = cb._standard_forward(np, q, k, v, spec, ms)
    oracle.check_forward(o, q, k, v, None, True, **feat)
    bms = _validate_masks.check_masks(spec, q, return_dbias=True, **feat)
    grads = cb._standard_backward(np, do, q, k, v, spec, bms)
    oracle.check_backward(grads, do, q, k, v, None, True, **feat)


def test_masked_kernels_plan_within_their_register_cap():
    """The masked forward keeps the feature state live beside flash_fwd's accumulators: in
    float64 ptxas spilled 72+ doubles, so those tiles are refused for it (and skipped by its
    defaults) while the plain kernel keeps them."""
    from cuflash import tiling
    with pytest.raises(ValueError, match=r"80 float64 accumulators.*masked forward.*pairs that fit"):
        tiling.plan("flash_fwd_masked", 16, 256, "float64", 32, 64)
    assert tiling.plan("flash_fwd", 16, 256, "float64", 32, 64).block_kv == 64
    assert tiling.plan("flash_fwd_masked", 16, 256, "float32", 32, 64).block_kv == 64
    with pytest.raises(ValueError, match=r"block_kv=128: the masked forward in float64"):
        tiling.plan("flash_fwd_masked", 7, 7, "float64", 32, 128)
    assert tiling.plan("flash_fwd_masked", 7, 7, "float32", 32, 128).block_kv == 128
    for d, dv in ((16, 256), (256, 256), (64, 64)):
        p = tiling.plan("flash_fwd_masked", d, dv, "float64")
        assert p.block_kv // 4 + (p.kdv + 3) // 4 <= tiling.FWD_MASKED_MAX_ACC_FLOAT64
        assert (p.threads, p.shared_bytes) == (
            tiling.kernel_tiling("flash_fwd").threads(p.block_q, p.block_kv, p.kd, p.kdv),
            tiling.kernel_tiling("flash_fwd").shared_bytes(p.block_q, p.block_kv, p.kd, p.kdv, 8))

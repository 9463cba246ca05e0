"""The SIMT kernels compiled per head-dim class.

flash_fwd.cu (flash_fwd, flash_fwd_masked and the serving kernels) and flash_bwd.cu
(flash_bwd_preprocess, flash_bwd_dkdv, flash_bwd_dq and their _masked builds) are compiled for
the class of max(d, dv) (``tiling.simt_head_dim_class``: 8, 16, 32, 64, 96, ..., 256), for d
and dv alike, and read the call's own head dims at run time, their padding columns zero in
shared memory.  So the planner's rules and curated tables apply to the class (every default
is a curated plan: tests/tiling/test_curated_plans.py), and the results at head dims between
classes, and at d != dv, are the oracle's.  The emulator NaN-poisons dynamic shared memory
before every block, so a padding column left unwritten fails these cases.
"""
import random
import re

import numpy as np
import pytest

import cuflash
import oracle
from conftest import poisoned_outputs, require_backend
from cuflash import tiling
from cuflash.launch import common as launch_common

from test_masks import check_simt_masked_backward


def test_head_dim_class():
    cls = tiling.simt_head_dim_class
    assert [cls(d) for d in (1, 8, 9, 16, 17, 32, 33, 64, 65, 96, 97, 250, 256)] == \
        [8, 8, 16, 16, 32, 32, 64, 64, 96, 96, 128, 256, 256]
    assert all(cls(c) == c for c in tiling.SIMT_HEAD_DIM_CLASSES)
    with pytest.raises(ValueError, match="above the largest class"):
        cls(257)


@pytest.mark.parametrize("kernel", ["flash_fwd", "flash_fwd_masked", "flash_bwd_dkdv",
                                    "flash_bwd_dkdv_masked", "flash_bwd_dq"])
def test_a_head_dim_plans_as_its_class(kernel):
    """Tiles, threads and shared memory at any head dims are those of the class of max(d, dv),
    default and explicit alike; the plan keeps the call's d and dv and names the class."""
    def cls(x, other=None):
        return tiling.simt_head_dim_class(max(x, x if other is None else other))
    rnd = random.Random(5)
    pairs = [(d, d) for d in range(1, 257)] + [(rnd.randint(1, 256), rnd.randint(1, 256))
                                               for _ in range(60)]
    for arch in ("sm_75", "sm_80", "sm_90"):
        lim = tiling.EMULATOR_ARCHES[arch]
        for dt in ("float32", "float64"):
            for d, dv in pairs:
                c = cls(d, dv)
                try:
                    cp = tiling.plan(kernel, c, c, dt, limit=lim)
                except ValueError as e:  # no plan of the class fits (float64 on sm_75 ...)
                    named = f"head-dim class {c}/{c}" if (d, dv) != (c, c) else re.escape(str(e))
                    with pytest.raises(ValueError, match=named):
                        tiling.plan(kernel, d, dv, dt, limit=lim)
                    continue
                p = tiling.plan(kernel, d, dv, dt, limit=lim)
                assert (p.d, p.dv, p.kd, p.kdv) == (d, dv, c, c)
                assert (p.block_q, p.block_kv, p.threads, p.shared_bytes) == \
                    (cp.block_q, cp.block_kv, cp.threads, cp.shared_bytes)
    p = tiling.plan(kernel, 65, 7, "float64")
    assert (p.kd, p.kdv) == (96, 96) and "head-dim class 96/96" in p.describe()
    # explicit tiles: accepted exactly where the class accepts them
    for d, dv in ((7, 7), (65, 65), (100, 100), (16, 250), (250, 9), (40, 20)):
        for bq in (8, 16, 32, 64, 128):
            for bkv in (8, 16, 32, 64, 128):
                got = []
                for dd, ddv in ((d, dv), (cls(d, dv), cls(d, dv))):
                    try:
                        got.append(tiling.plan(kernel, dd, ddv, "float64", bq, bkv,
                                               limit=tiling.EMULATOR_ARCHES["sm_80"]).shared_bytes)
                    except ValueError:
                        got.append(None)
                assert got[0] == got[1], (d, dv, bq, bkv)


@pytest.mark.parametrize("kernel", ["flash_fwd", "flash_bwd_dkdv"])
def test_d_ne_dv_takes_every_tile_pair_the_class_takes(kernel):
    """d != dv compiles for the class of max(d, dv): explicit tiles are taken wherever they
    are at that class with d == dv (no pair is the default's alone), the extremes included."""
    lim = tiling.EMULATOR_ARCHES["sm_80"]
    for d, dv in ((40, 20), (250, 9), (9, 250), (100, 128)):
        c = tiling.simt_head_dim_class(max(d, dv))
        for bq in (8, 16, 32, 64, 128):
            for bkv in (8, 16, 32, 64, 128):
                try:
                    want = tiling.plan(kernel, c, c, "float64", bq, bkv, limit=lim).shared_bytes
                except ValueError:
                    with pytest.raises(ValueError):
                        tiling.plan(kernel, d, dv, "float64", bq, bkv, limit=lim)
                    continue
                assert tiling.plan(kernel, d, dv, "float64", bq, bkv, limit=lim).shared_bytes == want


def _cases():
    # (dtype, q shape, k shape, dv, causal): head dims between classes
    return [("float32", (2, 3, 29, 5), (2, 3, 41, 5), 37, "top_left"),    # classes 8 / 64
            ("float64", (1, 2, 40, 65), (1, 2, 33, 65), 65, "bottom_right"),  # 96 / 96
            ("float16", (2, 1, 17, 100), (2, 1, 50, 100), 3, False)]      # 128 / 8


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-d{c[1][-1]}-dv{c[3]}")
def test_forward_between_classes_matches_oracle(kb, case, rng):
    dtype, qs, ks, dv, causal = case
    q = oracle.randn(rng, qs, dtype)
    k = oracle.randn(rng, ks, dtype)
    v = oracle.randn(rng, ks[:-1] + (dv,), dtype)
    with poisoned_outputs(), launch_common.observe_launches() as seen:
        o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                         causal=causal, return_lse=True, num_splits=1,
                                         backend=kb.name)
    if kb.name != "numpy":
        assert [e["kernel"] for e in seen] == ["flash_fwd"]
    oracle.check_forward(kb.to_numpy(o), q, k, v, None, causal, lse=kb.to_numpy(lse))


def test_masked_forward_between_classes_matches_oracle(rng):
    """The feature kernel (bias, window, softcap, dropout) at d = 20, dv = 12 (classes 32/16)."""
    require_backend("emulator")
    q, k = oracle.randn(rng, (2, 2, 30, 20), "float64"), oracle.randn(rng, (2, 2, 43, 20), "float64")
    v = oracle.randn(rng, (2, 2, 43, 12), "float64")
    feat = dict(bias=oracle.randn(rng, (2, 1, 30, 43), "float64", scale=2.0), window=(9, 4), softcap=2.5,
                dropout_p=0.2, seed=3)
    with poisoned_outputs(), launch_common.observe_launches() as seen:
        o, lse = cuflash.tiled_attention(q, k, v, causal=False, return_lse=True,
                                         backend="emulator", **feat)
    assert [e["kernel"] for e in seen] == ["flash_fwd_masked"]
    oracle.check_forward(o, q, k, v, None, False, lse=lse, **feat)


def test_kvcache_split_between_classes_matches_oracle(rng):
    """KV append, split-KV partials and the combine use the call's dv (d = 20, dv = 12,
    classes 32/16), on a paged cache."""
    require_backend("emulator")
    B, H, Hk, d, dv, ps, cap = 2, 4, 2, 20, 12, 8, 40
    lens = np.array([13, 30], np.int32)
    kc = oracle.randn(rng, (B * cap // ps + 1, Hk, ps, d), "float32")
    vc = oracle.randn(rng, (B * cap // ps + 1, Hk, ps, dv), "float32")
    table = rng.permutation(kc.shape[0])[:B * cap // ps].reshape(B, cap // ps).astype(np.int32)
    q = oracle.randn(rng, (B, H, 2, d), "float32")
    kn, vn = oracle.randn(rng, (B, Hk, 2, d), "float32"), oracle.randn(rng, (B, Hk, 2, dv), "float32")
    kcd, vcd = kc.copy(), vc.copy()
    with poisoned_outputs(), launch_common.observe_launches() as seen:
        o, lse = cuflash.attention_with_kvcache(q, kcd, vcd, cache_seqlens=lens, k_new=kn,
                                                v_new=vn, block_table=table, causal=True,
                                                num_splits=3, return_lse=True, backend="emulator")
    assert [e["kernel"] for e in seen] == ["flash_kv_append", "flash_fwd_serving",
                                           "flash_fwd_combine"]
    for b in range(B):
        L = lens[b] + 2
        for n in range(2):  # the appended rows, exactly
            pos = lens[b] + n
            np.testing.assert_array_equal(kcd[table[b, pos // ps], :, pos % ps], kn[b, :, n])
            np.testing.assert_array_equal(vcd[table[b, pos // ps], :, pos % ps], vn[b, :, n])
        kl = np.stack([kcd[table[b, j // ps], :, j % ps] for j in range(L)], axis=1)
        vl = np.stack([vcd[table[b, j // ps], :, j % ps] for j in range(L)], axis=1)
        oracle.check_forward(o[b], q[b], kl, vl, None, True, lse=lse[b])


def test_race_check_forward_between_classes(rng):
    """The zero-filled padding columns (d = dv = 12: class 16) under the race check."""
    from cuflash import _validate, kernels
    from cuflash.launch import fwd as launch_fwd
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k = oracle.randn(rng, (1, 2, 20, 12), "float32"), oracle.randn(rng, (1, 2, 37, 12), "float32")
    v = oracle.randn(rng, (1, 2, 37, 12), "float32")
    spec = _validate.check_attention_inputs(q, k, v, causal=True, block_q=16, block_kv=16)
    o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec)  # raises RaceError on a race
    oracle.check_forward(o, q, k, v, None, True, lse=lse)


# --------------------------------------------------------------------------
# the SIMT backward (flash_bwd.cu) between classes
# --------------------------------------------------------------------------
def _bwd_cases():
    # (dtype, q shape, k shape, dv, causal, deterministic): head dims between classes
    return [("float64", (1, 2, 40, 65), (1, 2, 33, 65), 65, "bottom_right", True),  # 96 / 96
            ("float32", (2, 3, 29, 5), (2, 3, 41, 5), 37, "top_left", True),        # 8 / 64
            ("float16", (2, 1, 17, 100), (2, 1, 50, 100), 3, False, True),          # 128 / 8
            ("float32", (2, 2, 21, 130), (2, 1, 26, 130), 9, False, False)]         # 160 / 16, GQA,
    #                                                                          atomic dQ


@pytest.mark.parametrize("case", _bwd_cases(), ids=lambda c: f"{c[0]}-d{c[1][-1]}-dv{c[3]}")
def test_backward_between_classes_matches_oracle(kb, case, rng):
    """Gradients at head dims between classes: the zero padding adds nothing and no store
    writes past d or dv (the outputs are NaN-poisoned first)."""
    dtype, qs, ks, dv, causal, det = case
    q = oracle.randn(rng, qs, dtype)
    k = oracle.randn(rng, ks, dtype)
    v = oracle.randn(rng, ks[:-1] + (dv,), dtype)
    o, lse, _ = oracle.attention(q, k, v, None, causal)
    o = o.astype(q.dtype)
    lse = lse.astype(np.float64 if dtype == "float64" else np.float32)
    do = oracle.randn(rng, o.shape, dtype)
    a = kb.asarray
    with poisoned_outputs(), launch_common.observe_launches() as seen:
        grads = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse),
                                                 causal=causal, deterministic=det,
                                                 backend=kb.name)
    if kb.name != "numpy":
        names = [e["kernel"] for e in seen]
        assert "flash_bwd_dkdv" in names and ("flash_bwd_dq" in names) == (det or dtype == "float64")
    oracle.check_backward([kb.to_numpy(g) for g in grads], do, q, k, v, None, causal)


def test_masked_backward_between_classes_matches_oracle(rng):
    """flash_bwd_dkdv_masked / flash_bwd_dq_masked (bias with dbias, window, softcap, dropout)
    at d = 20, dv = 12 (classes 32/16), both dQ paths."""
    q = oracle.randn(rng, (2, 2, 30, 20), "float32")
    k = oracle.randn(rng, (2, 2, 43, 20), "float32")
    v = oracle.randn(rng, (2, 2, 43, 12), "float32")
    feat = dict(bias=oracle.randn(rng, (2, 1, 30, 43), "float32", scale=2.0), window=(9, 4),
                softcap=2.5, dropout_p=0.2, seed=3)
    check_simt_masked_backward(q, k, v, feat, rng)


def test_race_check_backward_between_classes(rng):
    """The SIMT backward's padding path (d = dv = 12: class 16) under the race check: the
    preprocess, both dQ paths (the atomic one with its convert)."""
    from cuflash import _validate, kernels
    from cuflash.launch import bwd as launch_bwd, common as launch_common
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q = oracle.randn(rng, (1, 2, 20, 12), "float32")
    k = oracle.randn(rng, (1, 1, 37, 12), "float32")
    v = oracle.randn(rng, (1, 1, 37, 12), "float32")
    o, lse, _ = oracle.attention(q, k, v, None, True)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=16,
                                           block_kv=16)
    for det in (True, False):
        with launch_common.observe_launches() as seen:
            grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=det)
        assert "flash_bwd_dkdv" in [e["kernel"] for e in seen]
        oracle.check_backward(grads, do, q, k, v, None, True)

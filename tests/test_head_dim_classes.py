"""The SIMT kernels compiled per head-dim class (issue 12).

flash_fwd.cu (flash_fwd, flash_fwd_masked and the serving kernels) and flash_bwd.cu
(flash_bwd_preprocess, flash_bwd_dkdv, flash_bwd_dq and their _masked builds) are compiled for
the class of d and dv (``tiling.simt_head_dim_class``: 8, 16, 32, 64, 96, ..., 256) and read
the call's own head dims at run time, their padding columns zero in shared memory.  So the
planner's rules apply to the class, every accepted plan at any head dim is a plan of the spill
sweep's record, and the results at head dims between classes are the oracle's.  The emulator NaN-poisons dynamic
shared memory before every block, so a padding column left unwritten fails these cases.
"""
import json
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
from test_plan_sweep import SWEEP
SIMT_FWD_FAMILIES = ("flash_fwd", "flash_fwd_serving", "flash_fwd_masked", "flash_fwd_serving_masked")
SIMT_BWD_FAMILIES = ("flash_bwd", "flash_bwd_masked")
SIMT_FAMILIES = SIMT_FWD_FAMILIES + SIMT_BWD_FAMILIES


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
    """Tiles, threads and shared memory at any head dims are those of their classes, default
    and explicit alike; the plan keeps the call's d and dv and names the class."""
    cls = tiling.simt_head_dim_class
    rnd = random.Random(5)
    pairs = [(d, d) for d in range(1, 257)] + [(rnd.randint(1, 256), rnd.randint(1, 256))
                                               for _ in range(60)]
    for arch in ("sm_75", "sm_80", "sm_90"):
        lim = tiling.EMULATOR_ARCHES[arch]
        for dt in ("float32", "float64"):
            for d, dv in pairs:
                try:
                    c = tiling.plan(kernel, cls(d), cls(dv), dt, limit=lim)
                except ValueError as e:  # no plan of the class fits (float64 on sm_75 ...)
                    named = f"head-dim class {cls(d)}/{cls(dv)}" if (d, dv) != (cls(d), cls(dv)) \
                        else re.escape(str(e))
                    with pytest.raises(ValueError, match=named):
                        tiling.plan(kernel, d, dv, dt, limit=lim)
                    continue
                p = tiling.plan(kernel, d, dv, dt, limit=lim)
                assert (p.d, p.dv, p.kd, p.kdv) == (d, dv, cls(d), cls(dv))
                assert (p.block_q, p.block_kv, p.threads, p.shared_bytes) == \
                    (c.block_q, c.block_kv, c.threads, c.shared_bytes)
    p = tiling.plan(kernel, 65, 7, "float64")
    assert (p.kd, p.kdv) == (96, 8) and "head-dim class 96/8" in p.describe()
    # explicit tiles: accepted exactly where the class accepts them
    for d, dv in ((7, 7), (65, 65), (100, 100), (16, 250), (250, 9), (40, 20)):
        for bq in (8, 16, 32, 64, 128):
            for bkv in (8, 16, 32, 64, 128):
                got = []
                for dd, ddv in ((d, dv), (cls(d), cls(dv))):
                    try:
                        got.append(tiling.plan(kernel, dd, ddv, "float64", bq, bkv,
                                               limit=tiling.EMULATOR_ARCHES["sm_80"]).shared_bytes)
                    except ValueError:
                        got.append(None)
                assert got[0] == got[1], (d, dv, bq, bkv)


@pytest.mark.parametrize("kernel", ["flash_fwd", "flash_bwd_dkdv"])
def test_unswept_class_pairs_take_the_default_tiles_only(kernel):
    """d != dv classes outside tiling.SIMT_ASYM_SWEPT: explicit tiles only where they are the
    default plan (the sweep compiles only that one there), refused with the rule otherwise."""
    lim = tiling.EMULATOR_ARCHES["sm_80"]
    d, dv = 40, 20  # classes 64/32
    assert (64, 32) not in tiling.SIMT_ASYM_SWEPT
    dflt = tiling.plan(kernel, d, dv, "float64", limit=lim)
    assert tiling.plan(kernel, d, dv, "float64", dflt.block_q, dflt.block_kv,
                       limit=lim).block_q == dflt.block_q
    other = 8 if dflt.block_q != 8 else 16
    with pytest.raises(ValueError, match="explicit tiles are taken only where ptxas was run"):
        tiling.plan(kernel, d, dv, "float64", other, dflt.block_kv, limit=lim)
    # the swept extremes take every tile pair that fits, also at head dims inside the class
    assert tiling.plan(kernel, 250, 9, "float64", 8, 8, limit=lim).kdv == 16


def _recorded_keys(families):
    doc = json.loads(SWEEP.RESULTS.read_text())["families"]
    return {r["key"] for f in families for r in doc[f]["rows"]}


@pytest.mark.parametrize("families", [SIMT_FWD_FAMILIES, SIMT_BWD_FAMILIES],
                         ids=["forward", "backward"])
def test_every_accepted_plan_at_any_head_dim_was_swept(families):
    """The accepted SIMT plans at every d == dv in 1..256 and at 200 random d != dv pairs,
    each tile pair and the default, at every architecture's limit: each compiles as a plan of
    the record (whose rows the sweep test holds spill-free)."""
    have = _recorded_keys(families)
    rnd = random.Random(11)
    pairs = [(d, d) for d in range(1, 257)] + [(rnd.randint(1, 256), rnd.randint(1, 256))
                                               for _ in range(200)]
    checked = 0
    for fam in families:
        kernel = SWEEP.FAMILIES[fam][1]
        for a, arch in SWEEP.COMPILED_FOR.items():
            lim = tiling.EMULATOR_ARCHES[f"sm_{a}"]
            for dt in ("float16", "float32", "float64"):
                for d, dv in pairs[::7] if dt != "float64" else pairs:
                    tiles = [(None, None)] + [(bq, bkv) for bq in (8, 32, 128) for bkv in (8, 64)]
                    for bq, bkv in tiles:
                        try:
                            p = tiling.plan(kernel, d, dv, dt, bq, bkv, limit=lim)
                        except ValueError:
                            continue
                        assert SWEEP.plan_key(fam, p, arch) in have, (fam, d, dv, bq, bkv, a)
                        checked += 1
    assert checked > 4000 * len(families)


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


def test_float64_spills_of_the_class_sweep_are_recorded_and_refused():
    """Each plan in tiling.SIMT_FWD_FLOAT64_SPILLS spilled in the record (dense, serving or
    their feature builds) and the planner refuses it, naming the reason."""
    doc = json.loads(SWEEP.RESULTS.read_text())["families"]
    fams = {"flash_fwd": ("flash_fwd", "flash_fwd_serving"),
            "flash_fwd_masked": ("flash_fwd_masked", "flash_fwd_serving_masked")}
    n = 0
    for kernel, plans in tiling.SIMT_FWD_FLOAT64_SPILLS.items():
        spilled = {(r["block_q"], r["block_kv"], r["d"], r["dv"]) for f in fams[kernel]
                   for r in doc[f]["rows"] if SWEEP.bad(r) and r["dtype"] == "float64"}
        assert plans == spilled, kernel
        for bq, bkv, d, dv in plans:
            with pytest.raises(ValueError, match="ptxas spills this float64 plan"):
                tiling.plan(kernel, d, dv, "float64", bq, bkv)
            n += 1
    assert n == 43


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


def test_backward_spills_of_the_class_sweep_are_recorded_and_refused():
    """tiling.SIMT_BWD_SPILLS holds exactly the (accumulator bytes, tiles, classes) of the rows
    that spilled in each backward family's record, and the planner refuses each of them in both
    kernels of the build, for every dtype of that accumulator width."""
    doc = json.loads(SWEEP.RESULTS.read_text())["families"]
    n = 0
    for build, plans in tiling.SIMT_BWD_SPILLS.items():
        spilled = {(8 if r["dtype"] == "float64" else 4, r["block_q"], r["block_kv"], r["d"],
                    r["dv"]) for r in doc[build]["rows"] if SWEEP.bad(r)}
        assert plans == spilled, build
        suffix = build[len("flash_bwd"):]
        for acc, bq, bkv, d, dv in plans:
            for dt in (("float64",) if acc == 8 else ("float16", "bfloat16", "float32")):
                for kernel in ("flash_bwd_dkdv", "flash_bwd_dq"):
                    with pytest.raises(ValueError, match="ptxas spills this"):
                        tiling.plan(kernel + suffix, d, dv, dt, bq, bkv)
            n += 1
    assert n == N_BWD_SPILLS


N_BWD_SPILLS = 8  # plan tuples refused (tiling.SIMT_BWD_SPILLS), flash_bwd + flash_bwd_masked

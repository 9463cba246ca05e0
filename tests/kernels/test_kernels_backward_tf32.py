"""flash_bwd_tf32 (kernels_cu/flash_bwd_tf32.cu): the float32 backward on tensor cores.

float32 backward calls on sm_80+ run it in place of the SIMT flash_bwd_dkdv
(flash_bwd_preprocess and flash_bwd_dq_convert around it stay), on both dQ paths: with
deterministic=True each block slot walks several KV tiles and adds dQ into its own
accumulator slice (the emulator's atomic order check holds it to one adder per address).  Checked
against the float64 oracle by the float32 rule of docs/testing.md (relative error < 1e-5)
over odd lengths, Nq != Nk both ways, both causal alignments with rows that see no key,
MHA/GQA/MQA, d in {32, 64, 96, 128} and dv != d; gradients are NaN-poisoned before the
kernels run; the bytes it moves equal cuflash.tiling.flash_bwd_traffic with its tiles; one
race check; the fallbacks (misaligned views, head dims it lacks, sm_75) go to the SIMT
kernels, explicit tiles it lacks are refused.
"""
import contextlib

import numpy as np
import pytest

import cuflash
import oracle
from conftest import poisoned_outputs, require_backend
from cuflash import _validate, _validate_masks, kernels, tiling
from cuflash import emulator as em
from cuflash.launch import bwd as launch_bwd, bwd_tc as launch_bwd_tc, common as launch_common


def _fwd(q, k, v, causal):
    o, lse, _ = oracle.attention(q, k, v, None, causal)
    return o.astype(q.dtype), lse.astype(np.float32)


@contextlib.contextmanager
def _count_launches():
    total = {"global_bytes_read": 0, "global_bytes_written": 0, "launches": []}
    with launch_common.observe_launches() as seen:
        yield total
    for entry in seen:
        total["global_bytes_read"] += entry.get("global_bytes_read", 0)
        total["global_bytes_written"] += entry.get("global_bytes_written", 0)
        total["launches"].append(entry["kernel"])


CASES = [
    # q shape, k shape, causal -- d = 64 shares the default (64, 64) specialisation
    ((2, 4, 77, 64), (2, 2, 50, 64), "bottom_right"),   # GQA, Nq > Nk: rows that see no key
    ((1, 3, 45, 64), (1, 1, 130, 64), "top_left"),      # MQA, Nq < Nk
    ((1, 2, 97, 64), (1, 2, 97, 64), False),
    ((3, 33, 32), (3, 47, 32), True),                   # plain 3-D, d = 32
    ((1, 2, 60, 128), (1, 2, 41, 128), "top_left"),     # d = 128: block_q 16
    ((1, 1, 29, 96), (1, 1, 70, 96), False),            # d = 96
]


@pytest.mark.parametrize("qs,ks,causal", CASES,
                         ids=[f"q{'x'.join(map(str, c[0]))}-k{'x'.join(map(str, c[1]))}-{c[2]}"
                              for c in CASES])
def test_against_oracle(kernel_backend, qs, ks, causal, rng):
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    o, lse = _fwd(q, k, v, causal)
    do = oracle.randn(rng, o.shape, "float32")
    args = [kernel_backend.asarray(x) for x in (do, q, k, v, o, lse)]
    with poisoned_outputs(), _count_launches() as seen:
        grads = cuflash.tiled_attention_backward(*args, causal=causal, backend=kernel_backend.name)
    if kernel_backend.name == "emulator":
        assert seen["launches"] == ["flash_bwd_preprocess", "flash_bwd_tf32", "flash_bwd_dq_convert"]
    oracle.check_backward([kernel_backend.to_numpy(g) for g in grads], do, q, k, v, None, causal)


def test_dv_differs_from_d(kernel_backend, rng):
    q = oracle.randn(rng, (2, 2, 37, 32), "float32")
    k = oracle.randn(rng, (2, 2, 53, 32), "float32")
    v = oracle.randn(rng, (2, 2, 53, 96), "float32")
    o, lse = _fwd(q, k, v, "bottom_right")
    do = oracle.randn(rng, o.shape, "float32")
    with poisoned_outputs(), _count_launches() as seen:
        grads = cuflash.tiled_attention_backward(*[kernel_backend.asarray(x) for x in (do, q, k, v, o, lse)],
                                                 causal="bottom_right", backend=kernel_backend.name)
    if kernel_backend.name == "emulator":
        assert "flash_bwd_tf32" in seen["launches"]
    oracle.check_backward([kernel_backend.to_numpy(g) for g in grads], do, q, k, v, None, "bottom_right")


def test_plan_and_fallbacks():
    """Where flash_bwd_tf32 runs and where the SIMT kernels keep the call."""
    lim = tiling.EMULATOR_ARCHES["sm_80"]
    p = tiling.plan_bwd_tf32(64, 64, "float32", limit=lim)
    assert (p.block_q, p.block_kv, p.threads) == (64, 64, 128)
    p = tiling.plan_bwd_tf32(128, 128, "float32", limit=lim)
    assert p.block_q == 16  # dK, dV of 128 columns leave room for 16 queries of S^T, dP^T
    assert tiling.plan_bwd_tf32(64, 64, "float16") is None           # float32 only
    assert tiling.plan_bwd_tf32(16, 16, "float32") is None           # d % 32
    assert tiling.plan_bwd_tf32(256, 256, "float32") is None         # d > 128
    # tiles it lacks at head dims it has: refused, not sent to the SIMT kernel (as the forward
    # and flash_bwd_tc refuse theirs), with the pairs it takes
    with pytest.raises(ValueError, match=r"block_kv=16 with d=64, dv=64, float32: the "
                       r"tensor-core kernel flash_bwd_tf32 does not take these tiles .* pairs "
                       r"flash_bwd_tf32 takes here: \(16, 32\)"):
        tiling.plan_bwd_tf32(64, 64, "float32", block_kv=16)
    with pytest.raises(ValueError, match=r"needs 160 accumulator registers"):
        tiling.plan_bwd_tf32(128, 128, "float32", block_q=32, limit=lim)
    assert tiling.plan_bwd_tf32(16, 16, "float32", block_kv=16) is None  # d % 32: SIMT's
    t = tiling.kernel_tiling("flash_bwd_tf32")
    for d in (32, 64, 96, 128):
        for bq in t.block_q_choices:
            for bkv in t.block_kv_choices:
                if t.check(bq, bkv, d, d) is None:
                    assert (d + d) // 2 + bq <= tiling.BWD_TF32_MAX_ACC_REGS
    assert tiling.bwd_tf32_strides(64, 64, 64) == (84, 80, 84, 84, 68)


@pytest.mark.parametrize("how", ["tiles", "misaligned", "misaligned-deterministic", "sm_75"])
def test_fallbacks_run_simt(how, rng):
    """The SIMT kernels keep the float32 call where flash_bwd_tf32 cannot run it: misaligned
    rows (on both dQ paths), sm_75; explicit tiles it lacks are refused instead (running them
    on the SIMT kernel would be several times slower)."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", arch="sm_75" if how == "sm_75" else None)
    q, k, v = oracle.qkv(rng, (1, 2, 30, 32), (1, 2, 41, 32), dtype="float32")
    if how.startswith("misaligned"):  # k starts 4 bytes into its buffer: cp.async cannot read it
        buf = oracle.randn(rng, (1, 2, 41 * 32 + 1), "float32")
        k = buf[..., 1:].reshape(1, 2, 41, 32)
    o, lse = _fwd(q, k, v, True)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True,
                                           block_kv=16 if how == "tiles" else None)
    if how == "tiles":
        with pytest.raises(ValueError, match="flash_bwd_tf32 does not take these tiles"):
            launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec)
        return
    with poisoned_outputs(), _count_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec,
                                     deterministic=how.endswith("deterministic"))
    assert "flash_bwd_tf32" not in seen["launches"]
    assert ("flash_bwd_dq" in seen["launches"]) == how.endswith("deterministic")
    oracle.check_backward(grads, do, q, k, v, None, True)


# (q shape, k shape, causal, features, dQ slices): several waves at the emulator's 4
# concurrent blocks (one slice: 4 problems fill them), GQA, keys past Nk
DET_CASES = [
    ((2, 4, 70, 64), (2, 2, 250, 64), "bottom_right", {}, 1),
    ((1, 2, 90, 32), (1, 1, 300, 32), False, {"window": (40, 17)}, 0),
    ((1, 2, 45, 128), (1, 2, 200, 128), "bottom_right", {"bias": "keys", "softcap": 20.0}, 0),
]


@pytest.mark.parametrize("qs,ks,causal,feat,want_splits", DET_CASES,
                         ids=["gqa-causal", "window", "d128-bias-softcap"])
def test_deterministic_on_tensor_cores(qs, ks, causal, feat, want_splits, rng, monkeypatch):
    """deterministic=True runs flash_bwd_tf32(_masked) in waves of n_splits block slots, slot j
    of wave w on KV tile w * n_splits + j adding dQ into accumulator slice j: one adder per dQ
    address in each launch (the atomic order check, which the atomic path fails), the float64
    oracle's accuracy, bytes = the model."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    call = dict(feat)
    if call.get("bias") == "keys":  # a key-padding bias of full shape (dbias one writer each)
        bias = oracle.randn(rng, qs[:-1] + (ks[-2],), "float32")
        bias[..., -7:] = -np.inf
        call["bias"] = bias
    o, lse, _ = oracle.attention(q, k, v, None, causal, **call)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    do = oracle.randn(rng, o.shape, "float32")
    kernel = "flash_bwd_tf32_masked" if call else "flash_bwd_tf32"
    splits = []
    real = launch_bwd_tc.dq_splits
    monkeypatch.setattr("cuflash.launch.bwd_simt.dq_splits",
                        lambda *a: splits.append(real(*a)) or splits[-1])
    runs = []
    for _ in range(2):
        with poisoned_outputs(), _count_launches() as seen, em.atomic_order_check():
            runs.append(cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                         deterministic=True, backend="emulator",
                                                         **call))
        waves = seen["launches"][1:-1]
        assert seen["launches"][::len(seen["launches"]) - 1] == ["flash_bwd_preprocess",
                                                                 "flash_bwd_dq_convert"]
        assert set(waves) == {kernel}
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
    oracle.check_backward(runs[0], do, q, k, v, None, causal, **call)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal)
    plan = tiling.plan_bwd_tf32(qs[-1], qs[-1], "float32", limit=tiling.EMULATOR_ARCHES["sm_80"],
                                masked=bool(call))
    n_kv_tiles = -(-ks[-2] // plan.block_kv)
    n_splits = splits[-1]
    assert n_splits == want_splits if want_splits else n_splits > 1, n_splits
    assert len(waves) == -(-n_kv_tiles // n_splits) > 1  # several waves
    if not call:
        B, H = launch_common.problem_dims(spec.lead)
        Hk, _ = launch_common.kv_heads_for_kernel(spec)
        assert (seen["global_bytes_read"], seen["global_bytes_written"]) == tiling.flash_bwd_traffic(
            B, H, Hk, spec.Nq, spec.Nk, qs[-1], qs[-1], "float32", plan.block_q, plan.block_kv,
            spec.causal, deterministic=False, flush_rows=tiling.TF32_FLUSH_ROWS, dq_splits=n_splits)
    # the atomic path adds into each dQ element from every KV tile's block: the check says so
    with em.atomic_order_check(), pytest.raises(em.AtomicOrderError, match=kernel):
        cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal, backend="emulator", **call)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deterministic_16bit_has_one_adder_per_address(dtype, rng):
    """The tensor-core backward's deterministic dQ (flash_bwd_tc) under the same check."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, (1, 2, 60, 64), (1, 2, 300, 64), dtype=dtype)
    o, lse = _fwd(q, k, v, True)
    do = oracle.randn(rng, o.shape, dtype)
    with _count_launches() as seen, em.atomic_order_check():
        grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True,
                                                 backend="emulator")
    assert seen["launches"][1] == "flash_bwd_tc"
    oracle.check_backward(grads, do, q, k, v, None, True)
    with em.atomic_order_check(), pytest.raises(em.AtomicOrderError, match="flash_bwd_tc"):
        cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True, backend="emulator")


def test_race_check_deterministic_waves(rng):
    """flash_bwd_tf32 under TSan with deterministic=True: 5 KV tiles in waves of 3 and 2 slots
    (the second from KV tile 3), GQA, keys past Nk."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 40, 32), (1, 1, 150, 32), dtype="float32")
    o, lse = _fwd(q, k, v, False)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, block_q=16, block_kv=32)
    assert launch_bwd_tc.dq_splits(rt, tiling.plan_bwd_tf32(32, 32, "float32", 16, 32), 5, 1, True) == 3
    with _count_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=True)
    assert seen["launches"] == ["flash_bwd_preprocess", "flash_bwd_tf32", "flash_bwd_tf32",
                                "flash_bwd_dq_convert"]
    oracle.check_backward(grads, do, q, k, v)


def test_misaligned_view_with_features_runs_simt(rng):
    """With the features too, a view cp.async cannot read runs the SIMT dK/dV kernel on the
    view itself (flash_bwd_dkdv_masked, no copies), as without them."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator")
    q, k, v = oracle.qkv(rng, (1, 2, 30, 32), (1, 2, 41, 32), dtype="float32")
    # contiguous, strides of whole 16-byte rows, but 4 bytes into its buffer: known misaligned
    # only when the call runs
    k = oracle.randn(rng, (2 * 41 * 32 + 1,), "float32")[1:].reshape(1, 2, 41, 32)
    feat = dict(window=(8, 4), softcap=2.0)
    o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True, backend="numpy",
                                     **feat)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True)
    ms = _validate_masks.check_masks(spec, q, **feat)
    aligned = tuple(x.copy() for x in (do, q, k, v, o))
    with _count_launches() as seen:
        launch_bwd.flash_bwd(rt, *aligned[:5], lse, spec, ms)
    assert "flash_bwd_tf32_masked" in seen["launches"]   # the aligned call runs it
    with poisoned_outputs(), _count_launches() as seen, \
            launch_common.track_allocations() as ledger:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, ms)
    assert "flash_bwd_tf32_masked" not in seen["launches"]
    assert "flash_bwd_dkdv_masked" in seen["launches"]
    assert "aligned copy" not in [what for what, _ in ledger]
    oracle.check_backward(grads, do, q, k, v, None, True, **feat)


def test_forced_simt_kernel_is_not_replaced(rng):
    """kernel="flash_bwd_dkdv" runs the SIMT dK/dV kernel for float32 too (not flash_bwd_tf32)."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator")
    q, k, v = oracle.qkv(rng, (1, 2, 30, 32), (1, 2, 41, 32), dtype="float32")
    o, lse = _fwd(q, k, v, True)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True)
    with _count_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, kernel="flash_bwd_dkdv")
    assert "flash_bwd_tf32" not in seen["launches"] and "flash_bwd_dkdv" in seen["launches"]
    oracle.check_backward(grads, do, q, k, v, None, True)


@pytest.mark.parametrize("qs,ks,causal", [
    ((2, 4, 45, 32), (2, 2, 70, 32), "bottom_right"),
    ((1, 3, 70, 64), (1, 1, 33, 64), "top_left"),
    ((1, 2, 40, 64), (1, 2, 70, 64), None),
])
def test_traffic_equals_model(qs, ks, causal, rng):
    """Bytes the three emulated kernels move == cuflash.tiling.flash_bwd_traffic at its tiles."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    o, lse = _fwd(q, k, v, causal or False)
    do = oracle.randn(rng, o.shape, "float32")
    with _count_launches() as total:
        cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal or False,
                                         backend="emulator")
    assert total["launches"][1] == "flash_bwd_tf32"
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal or False)
    d = qs[-1]
    plan = tiling.plan_bwd_tf32(d, d, "float32", limit=tiling.EMULATOR_ARCHES["sm_80"])
    B, H = launch_common.problem_dims(spec.lead)
    Hk, _ = launch_common.kv_heads_for_kernel(spec)
    want = tiling.flash_bwd_traffic(B, H, Hk, spec.Nq, spec.Nk, d, d, "float32", plan.block_q,
                                    plan.block_kv, spec.causal, deterministic=False,
                                    flush_rows=tiling.TF32_FLUSH_ROWS)
    assert (total["global_bytes_read"], total["global_bytes_written"]) == want


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "key_padding_bias"])
@pytest.mark.parametrize("d", [64, 128])
def test_long_query_runs_keep_float32_accuracy(kernel_backend, d, masked, rng):
    """dK, dV of one KV tile summed over 2048 query rows.  The tensor core adds each mma into its
    accumulator truncating toward zero, so dK, dV chained through every Q tile drifted: 1.8e-5
    and 1.7e-5 (d = 64), 2.0e-5 and 1.8e-5 (d = 128) relative error here on the emulator's model
    of it, past float32's 1e-5.  They are added into the outputs every 128 query rows: 2.7e-6 /
    2.2e-6 and 4.2e-6 / 3.2e-6.  On the emulator the bytes moved include those flushes."""
    Nq, Nk = 2048, 64
    q, k, v = oracle.qkv(rng, (1, 1, Nq, d), (1, 1, Nk, d), dtype="float32")
    feat = {}
    if masked:  # the last 5 keys are padding
        bias = np.zeros((1, 1, 1, Nk), np.float32)
        bias[..., Nk - 5:] = -np.inf
        feat["bias"] = bias
    o, lse, _ = oracle.attention(q, k, v, None, False, **feat)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    do = oracle.randn(rng, o.shape, "float32")
    args = [kernel_backend.asarray(x) for x in (do, q, k, v, o, lse)]
    with poisoned_outputs(), _count_launches() as seen:
        grads = cuflash.tiled_attention_backward(*args, backend=kernel_backend.name,
                                                 **{n: kernel_backend.asarray(x) for n, x in feat.items()})
    kernel = "flash_bwd_tf32_masked" if masked else "flash_bwd_tf32"
    if kernel_backend.name == "emulator":
        assert seen["launches"] == ["flash_bwd_preprocess", kernel, "flash_bwd_dq_convert"]
    oracle.check_backward([kernel_backend.to_numpy(g) for g in grads], do, q, k, v, **feat)
    if kernel_backend.name == "emulator":
        plan = tiling.plan_bwd_tf32(d, d, "float32", limit=tiling.EMULATOR_ARCHES["sm_80"], masked=masked)
        if masked:
            model = lambda fr: tiling.flash_bwd_tf32_masked_traffic(  # noqa: E731
                1, 1, 1, Nq, Nk, d, d, plan.block_q, plan.block_kv, plan.threads, bias=True,
                flush_rows=fr)
        else:
            model = lambda fr: tiling.flash_bwd_traffic(  # noqa: E731
                1, 1, 1, Nq, Nk, d, d, "float32", plan.block_q, plan.block_kv,
                deterministic=False, flush_rows=fr)
        # 15 flushes: 15 writes and 15 reads (14 flushes, the end) of the tile's dK, dV rows
        flushes = tiling.tf32_bwd_flushes(Nq // plan.block_q, plan.block_q, tiling.TF32_FLUSH_ROWS)
        assert flushes == 15 and plan.block_kv == Nk
        extra = flushes * Nk * 2 * d * 4
        assert model(tiling.TF32_FLUSH_ROWS) == tuple(x + extra for x in model(0))
        assert (seen["global_bytes_read"], seen["global_bytes_written"]) == model(tiling.TF32_FLUSH_ROWS)


def test_race_check_with_flushes(rng):
    """flash_bwd_tf32 under TSan where dK, dV's second level flushes: 16-row Q tiles, a GQA
    group of 2 and 75 rows (10 steps: a flush after the 8th), two warps, keys past Nk."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 75, 32), (1, 1, 50, 32), dtype="float32")
    o, lse = _fwd(q, k, v, False)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, block_q=16, block_kv=32)
    with _count_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=False)
    assert seen["launches"][1] == "flash_bwd_tf32"
    assert seen["global_bytes_written"] > tiling.flash_bwd_traffic(
        1, 2, 1, 75, 50, 32, 32, "float32", 16, 32, deterministic=False)[1]
    oracle.check_backward(grads, do, q, k, v)


def test_race_check(rng):
    """flash_bwd_tf32 under ThreadSanitizer: 2 warps, 2 Q tiles per head in two cp.async
    stages, a GQA group of 2, a causal boundary tile."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 20, 32), (1, 1, 37, 32), dtype="float32")
    o, lse = _fwd(q, k, v, True)
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=16,
                                           block_kv=32)
    with _count_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=False)
    assert "flash_bwd_tf32" in seen["launches"]
    oracle.check_backward(grads, do, q, k, v, None, True)

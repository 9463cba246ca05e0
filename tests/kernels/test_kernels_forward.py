"""The forward kernels (flash_fwd, online_softmax_rows) and their launch/tiling code.

Written once over the backend: "numpy" (the reference, the same assertions)
and "emulator" always; "cuda" when CuPy and a GPU are present, else skipped
with the reason.  Every kernel output is poisoned with NaN before the launch
(through ``cuflash.launch.common.output_hook``) so an element the kernel fails to
write fails the test.

Emulated launches cost a compile per specialisation (dtype, d, tiles: ~3-6 s
on 2 cores, cached afterwards) plus ~0.05-2 s per launch, so the oracle cases
below are sampled to share a small set of specialisations while still
covering odd lengths, Nq != Nk both ways, both causal alignments (with rows
that see no key), MHA/GQA/MQA, broadcast leading dims, strided inputs,
d in {16, 32, 64, 96, 128, 256} and every dtype.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import lean_layout, poisoned_outputs, require_backend
from cuflash import _validate, kernels, reference, tiling
from cuflash.launch import common as launch_common, fwd as launch_fwd, softmax as launch_softmax


def _emulator_stats():
    from cuflash import emulator
    return emulator.last_launch_stats()


# --------------------------------------------------------------------------
# forward + lse against the float64 oracle
# --------------------------------------------------------------------------
# (dtype, q shape, k shape, causal, block_q, block_kv, layout)
# Cases sharing (dtype, d, tiles) share one compiled specialisation.
FWD_CASES = [
    # float32, d=64, default tiles (64, 32): GQA 6/2 with Nq > Nk (rows that see no key)
    ("float32", (2, 6, 77, 64), (2, 2, 50, 64), "bottom_right", None, None, "c"),
    ("float32", (1, 113, 64), (1, 203, 64), False, None, None, "c"),
    ("float32", (2, 6, 97, 64), (2, 1, 97, 64), "top_left", None, None, "c"),        # MQA
    ("float32", (2, 3, 40, 64), (2, 3, 61, 64), "bottom_right", None, None, "strided"),
    # float64, d=64 (computed in double: 1e-12)
    ("float64", (3, 128, 64), (3, 127, 64), "bottom_right", None, None, "c"),
    ("float64", (2, 6, 5, 64), (2, 6, 2, 64), "top_left", None, None, "c"),
    ("float64", (1, 6, 203, 64), (1, 2, 113, 64), "top_left", None, None, "c"),       # GQA, Nq > Nk
    # float16, d=32
    ("float16", (2, 3, 200, 32), (2, 3, 200, 32), True, None, None, "c"),
    ("float16", (6, 17, 32), (6, 1, 32), False, None, None, "c"),
    # bfloat16, d=16
    ("bfloat16", (1, 6, 255, 16), (1, 2, 255, 16), "bottom_right", None, None, "c"),
    ("bfloat16", (3, 1, 16), (3, 147, 16), "top_left", None, None, "c"),                # Nq = 1
    # the other head dims
    ("float32", (2, 2, 128, 96), (2, 2, 127, 96), "bottom_right", None, None, "c"),
    ("float16", (1, 2, 97, 128), (1, 2, 113, 128), "top_left", None, None, "c"),
    ("float64", (2, 40, 256), (2, 33, 256), "bottom_right", None, None, "c"),
    ("bfloat16", (1, 2, 17, 256), (1, 2, 200, 256), False, None, None, "c"),
    # explicit tiles; broadcast leading dims (2, 1) x (3,) -> (2, 3)
    # (SIMT tiles: float64; float16/32 refuse tiles their tensor-core kernels lack)
    ("float64", (2, 1, 37, 16), (3, 50, 16), "top_left", 16, 8, "c"),
    ("float64", (2, 2, 5, 16), (2, 2, 45, 16), "bottom_right", 16, 8, "strided"),
    ("float64", (2, 1, 2), (2, 1, 2), False, None, None, "c"),  # d=2, Nq = Nk = 1
    ("float32", (33, 64), (47, 64), "bottom_right", None, None, "c"),  # plain 2-D
    # float32 on tensor cores (3xTF32) at the other head dims
    ("float32", (1, 2, 130, 128), (1, 2, 129, 128), "top_left", None, None, "c"),
    ("float32", (2, 1, 33, 256), (2, 1, 70, 256), "bottom_right", None, None, "c"),
    ("float32", (3, 1, 32), (3, 147, 32), False, None, None, "c"),                    # Nq = 1
]


def _case_id(c):
    dt, qs, ks, causal, bq, bkv, lay = c
    tiles = "" if bq is None else f"-t{bq}x{bkv}"
    return f"{dt}-q{'x'.join(map(str, qs))}-k{'x'.join(map(str, ks))}-{causal}{tiles}-{lay}"


def _make(rng, dtype, shape, layout):
    """A random input in ``layout``: 'c' (contiguous) or 'strided' (last two axes
    swapped in memory and every other leading index skipped)."""
    if layout == "c":
        return oracle.randn(rng, shape, dtype)
    big = oracle.randn(rng, shape[:-3] + (2 * shape[-3], shape[-1], shape[-2]), dtype)
    x = np.swapaxes(big, -1, -2)[..., ::2, :, :]
    assert x.shape == shape and not x.flags.c_contiguous
    return x


@pytest.mark.parametrize("case", FWD_CASES, ids=[_case_id(c) for c in FWD_CASES])
def test_forward_against_oracle(kb, case, rng):
    dtype, qs, ks, causal, bq, bkv, layout = case
    q = _make(rng, dtype, qs, layout)
    k = _make(rng, dtype, ks, layout)
    v = _make(rng, dtype, ks, layout)
    before = [x.copy() for x in (q, k, v)]
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                         causal=causal, block_q=bq, block_kv=bkv,
                                         return_lse=True, backend=kb.name)
    o, lse = kb.to_numpy(o), kb.to_numpy(lse)
    ref_o, ref_lse, _ = oracle.attention(q, k, v, None, causal)
    assert o.dtype == q.dtype and o.shape == ref_o.shape
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert lse.shape == ref_lse.shape
    oracle.check_forward(o, q, k, v, None, causal, lse=lse)
    # rows that see no key: exactly 0 and -inf, never NaN
    blind = ~oracle.visible(qs[-2], ks[-2], causal).any(axis=1)
    if blind.any():
        assert np.all(o[..., blind, :].astype(np.float64) == 0)
        assert np.all(np.isneginf(lse[..., blind]))
    for x, x0 in zip((q, k, v), before):
        assert np.array_equal(x, x0, equal_nan=True), "an input was modified"


@pytest.mark.parametrize("dtype,d,dv", [("float32", 64, 48), ("float16", 32, 64),
                                         ("float64", 16, 7)])
def test_dv_differs_from_d(kb, dtype, d, dv, rng):
    """The kernels take dv != d (their own define); float16 runs on tensor cores here."""
    q = oracle.randn(rng, (2, 3, 29, d), dtype)
    k = oracle.randn(rng, (2, 3, 41, d), dtype)
    v = oracle.randn(rng, (2, 3, 41, dv), dtype)
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                         causal="top_left", return_lse=True, backend=kb.name)
    assert o.shape == (2, 3, 29, dv)
    oracle.check_forward(kb.to_numpy(o), q, k, v, None, "top_left", lse=kb.to_numpy(lse))


def test_huge_and_equal_logits(kb, rng):
    """Logits of magnitude 1e4 do not overflow; all-equal logits give the mean of v."""
    q = oracle.randn(rng, (2, 33, 64), "float32") * 100.0
    k = oracle.randn(rng, (2, 70, 64), "float32")
    v = oracle.randn(rng, (2, 70, 64), "float32")
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                         scale=1.0, return_lse=True, backend=kb.name)
    assert np.abs(oracle.attention(q, k, v, 1.0)[1]).max() > 1e3
    oracle.check_forward(kb.to_numpy(o), q, k, v, 1.0, False, lse=kb.to_numpy(lse))
    qz = np.zeros_like(q)
    with poisoned_outputs():
        o = kb.to_numpy(cuflash.tiled_attention(kb.asarray(qz), kb.asarray(k), kb.asarray(v),
                                                backend=kb.name))
    mean = v.astype(np.float64).mean(axis=-2, keepdims=True)
    np.testing.assert_allclose(o, np.broadcast_to(mean, o.shape), rtol=1e-5, atol=1e-6)


def test_nan_propagates_to_its_rows(kb, rng):
    """A NaN in q poisons only its own row (as in NumPy); other rows stay exact."""
    q = oracle.randn(rng, (1, 40, 64), "float32")
    k = oracle.randn(rng, (1, 50, 64), "float32")
    v = oracle.randn(rng, (1, 50, 64), "float32")
    q[0, 7, 3] = np.nan
    o = kb.to_numpy(cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                            backend=kb.name))
    assert np.all(np.isnan(o[0, 7]))
    rows = np.arange(40) != 7
    ref = oracle.attention(q[:, rows], k, v)[0]
    oracle.assert_rel_close(o[:, rows], ref, "float32")


def test_empty_sequences(kb, rng):
    """Nq = 0 gives empty outputs; Nk = 0 gives o = 0 and lse = -inf."""
    q = oracle.randn(rng, (2, 0, 64), "float32")
    k = oracle.randn(rng, (2, 9, 64), "float32")
    o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(k),
                                     return_lse=True, backend=kb.name)
    assert o.shape == (2, 0, 64) and lse.shape == (2, 0)
    q = oracle.randn(rng, (2, 5, 64), "float32")
    k = oracle.randn(rng, (2, 0, 64), "float32")
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(k),
                                         return_lse=True, backend=kb.name)
    o, lse = kb.to_numpy(o), kb.to_numpy(lse)
    assert o.shape == (2, 5, 64) and np.all(o == 0) and np.all(np.isneginf(lse))


# --------------------------------------------------------------------------
# the two forward kernels: which runs, and each one forced on float16/bfloat16
# --------------------------------------------------------------------------
def _runtime(backend):
    if backend.name == "cuda":
        from cuflash import cuda_backend
        return cuda_backend.runtime()
    from cuflash import emulator_backend
    return emulator_backend.runtime()


def test_forward_kernel_choice():
    def kernel(d, dv, dtype, bq=None, bkv=None):
        return tiling.plan_flash_fwd(d, dv, dtype, bq, bkv, limit=163 * 1024).kernel
    assert kernel(64, 64, "float16") == kernel(128, 128, "bfloat16") == "flash_fwd_tc"
    assert kernel(256, 256, "float16") == kernel(96, 32, "bfloat16") == "flash_fwd_tc"
    assert kernel(64, 64, "float32") == kernel(256, 128, "float32") == "flash_fwd_tf32"  # 3xTF32
    assert kernel(64, 64, "float64") == "flash_fwd"
    assert kernel(59, 59, "float16") == kernel(59, 59, "float32") == "flash_fwd"  # d % 16 != 0
    # tiles the tensor-core kernels lack are refused, not run on the SIMT kernel (issue 12)
    for dtype, bq, bkv, tc in (("float16", 8, 8, "flash_fwd_tc"), ("float32", 16, 8, "flash_fwd_tf32")):
        with pytest.raises(ValueError, match=f"tensor-core kernel {tc} does not take"):
            kernel(64, 64, dtype, bq, bkv)
    assert kernel(59, 59, "float16", 8, 8) == "flash_fwd"  # d % 16 != 0: SIMT tiles are its own
    assert kernel(64, 64, "float16", 16, 32) == "flash_fwd_tc"
    with pytest.raises(ValueError, match="flash_fwd_tf32 runs"):
        tiling.plan_flash_fwd(64, 64, "float16", kernel="flash_fwd_tf32")


def test_tc_rows_per_warp_follow_the_register_budget():
    """32 query rows per warp (two m16 tiles) where S and O fit, else 16 rows and more warps."""
    def plan(dtype, d, bq, bkv, dv=None):
        return tiling.plan_flash_fwd(d, d if dv is None else dv, dtype, bq, bkv, limit=227 * 1024)
    p = plan("float16", 128, 128, 32)
    assert (p.kernel, p.threads) == ("flash_fwd_tc", 128)       # 4 warps x 32 rows
    p = plan("float16", 128, 128, 64)                           # 192 accumulators: within
    assert (p.kernel, p.threads) == ("flash_fwd_tc", 128)       # flash_fwd_tc's 32-row budget
    p = tiling.plan("flash_fwd_tc_masked", 128, 128, "float16", 128, 64, limit=227 * 1024)
    assert p.threads == 256                                     # not its masked kernel's (160)
    p = plan("float16", 128, 128, 128)                          # S + O of 32 rows would spill:
    assert (p.kernel, p.threads) == ("flash_fwd_tc", 256)       # 8 warps x 16 rows instead
    p = plan("float16", 256, 64, 32)
    assert p.threads == 128                                     # d > 128: 16 rows per warp
    p = plan("float32", 64, 128, 32)
    assert (p.kernel, p.threads) == ("flash_fwd_tf32", 128)
    for kernel in tiling.TC_KERNELS:
        t = tiling.kernel_tiling(kernel)
        for d in (16, 64, 96, 128, 192, 256):
            for bq in t.block_q_choices:
                for bkv in t.block_kv_choices:
                    if t.check(bq, bkv, d, d) is None:
                        rows = tiling.tc_rows_per_warp(kernel, bq, bkv, d, d)
                        budget = (tiling.TC_MAX_ACC_REGS_32_ROWS if rows == 32 else tiling.TC_MAX_ACC_REGS)[kernel]
                        assert tiling.tc_acc_regs(kernel, bq, bkv, d, d) <= budget


def test_tc_forward_one_kv_stage_where_it_adds_blocks():
    """flash_fwd_tc takes one K and one V buffer where two stages pass the limit or where one
    lets more blocks reside on an SM (registers counted at 255 per thread: 2 blocks of 4
    warps at most): 128 x 64 at d = 128 on an A100 (68 KB, two blocks, against 104 KB and
    one); an H100 holds two blocks of the two-stage layout.  Its other kernels keep two."""
    for arch, shared, lean in (("sm_80", 69632, {"CUFLASH_FWD_KV_STAGES": 1}), ("sm_90", 104448, {})):
        p = tiling.plan_flash_fwd(128, 128, "float16", limit=tiling.EMULATOR_ARCHES[arch])
        assert (p.kernel, p.block_q, p.block_kv, p.threads) == ("flash_fwd_tc", 128, 64, 128)
        assert (p.shared_bytes, dict(p.layout_defines)) == (shared, lean), arch
        assert kernels.plan_defines(p).get("CUFLASH_FWD_KV_STAGES") == lean.get("CUFLASH_FWD_KV_STAGES")
    lim = tiling.EMULATOR_ARCHES["sm_80"]
    assert [tiling.resident_blocks(128, b, lim) for b in (104448, 69632, 30000, lim + 1)] == [1, 2, 2, 0]
    assert tiling.resident_blocks(256, 69632, lim) == 1   # 8 warps at 255 registers fill an SM
    # d = 64: 128 x 64 in two stages (55 KB) already gives two blocks: kept
    p = tiling.plan_flash_fwd(64, 64, "float16", limit=lim)
    assert ((p.block_q, p.block_kv), p.layout_defines) == ((128, 64), ())
    for kernel in ("flash_fwd_tf32", "flash_fwd_tc_masked", "flash_fwd_tf32_masked"):
        assert tiling.kernel_tiling(kernel).smaller is None


@pytest.mark.parametrize("dtype,kernel", [("float16", "flash_fwd"), ("float16", "flash_fwd_tc"),
                                          ("bfloat16", "flash_fwd"), ("bfloat16", "flash_fwd_tc"),
                                          ("float32", "flash_fwd"), ("float32", "flash_fwd_tf32")])
def test_both_kernels_of_a_dtype(kernel_backend, kernel, dtype, rng):
    """float16/bfloat16/float32 through each of their kernels explicitly (the default picks
    tensor cores: flash_fwd_tc, flash_fwd_tf32)."""
    q, k, v = oracle.qkv(rng, (2, 2, 45, 32), (2, 1, 70, 32), dtype=dtype)
    q, k, v = (kernel_backend.asarray(x) for x in (q, k, v))
    spec = _validate.check_attention_inputs(q, k, v, causal="bottom_right", block_q=16,
                                            block_kv=16)
    with poisoned_outputs():
        o, lse = launch_fwd.flash_fwd(_runtime(kernel_backend), q, k, v, spec, kernel=kernel)
    if kernel_backend.name == "emulator":
        assert _emulator_stats()["kernel"] == kernel
    qn, kn, vn = (kernel_backend.to_numpy(x) for x in (q, k, v))
    oracle.check_forward(kernel_backend.to_numpy(o), qn, kn, vn, None, "bottom_right",
                         lse=kernel_backend.to_numpy(lse))


@pytest.mark.parametrize("dtype,d,bq,bkv,kernel", [
    ("float64", 32, 128, 64, "flash_fwd"),         # largest SIMT tiles (512 threads)
    ("float64", 64, 8, 8, "flash_fwd"),            # smallest (one warp)
    ("float16", 64, 128, 128, "flash_fwd_tc"),     # largest tensor-core tiles (4 warps x 32 rows)
    ("bfloat16", 128, 16, 32, "flash_fwd_tc"),     # one warp per block (4 per SM)
    ("float16", 96, 128, 128, "flash_fwd_tc"),     # 8 warps x 16 rows (32 rows would spill)
    ("float32", 128, 64, 32, "flash_fwd_tf32"),    # 2 warps x 32 rows
    ("float32", 256, 64, 16, "flash_fwd_tf32"),    # d = 256: 16 rows per warp
])
def test_extreme_tiles(kernel_backend, dtype, d, bq, bkv, kernel, rng):
    q, k, v = oracle.qkv(rng, (1, 2, 150, d), (1, 2, 131, d), dtype=dtype)
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(kernel_backend.asarray(q), kernel_backend.asarray(k),
                                         kernel_backend.asarray(v), causal=True, block_q=bq,
                                         block_kv=bkv, return_lse=True,
                                         backend=kernel_backend.name)
    if kernel_backend.name == "emulator":
        assert _emulator_stats()["kernel"] == kernel
    oracle.check_forward(kernel_backend.to_numpy(o), q, k, v, None, True,
                         lse=kernel_backend.to_numpy(lse))


@pytest.mark.parametrize("dtype,kernel", [("float16", "flash_fwd_tc"), ("float32", "flash_fwd_tf32")])
def test_tensor_core_scales_and_moving_max(kernel_backend, dtype, kernel, rng):
    """What the tensor-core kernels' exp2 folding and lazily moved row max must survive:
    negative and zero scales (the launcher hands them -q or 0 * q with a positive scale),
    logits that grow along the keys (the reference max moves in every K/V tile), and rows
    whose logits shrink (it never moves after the first tile)."""
    Nq, Nk, d = 40, 100, 32
    q = oracle.randn(rng, (1, 2, Nq, d), dtype)
    k = oracle.randn(rng, (1, 2, Nk, d), dtype)
    v = oracle.randn(rng, (1, 2, Nk, d), dtype)
    grow = np.linspace(0.0, 3.0, Nk).astype(np.float32)[:, None]
    k[0, 0] = (k[0, 0].astype(np.float32) * 0.2 + grow).astype(dtype)   # logits rise along the keys
    q[0, 0, : Nq // 2] = np.abs(q[0, 0, : Nq // 2])                      # ... for these rows
    q[0, 0, Nq // 2:] = -np.abs(q[0, 0, Nq // 2:])                       # ... and fall for these
    args = [kernel_backend.asarray(x) for x in (q, k, v)]
    for scale, causal in ((None, "bottom_right"), (2.0, False), (-0.7, "top_left"), (0.0, True)):
        with poisoned_outputs():
            o, lse = cuflash.tiled_attention(*args, scale=scale, causal=causal, block_q=32,
                                             block_kv=16, return_lse=True,
                                             backend=kernel_backend.name)
        if kernel_backend.name == "emulator":
            assert _emulator_stats()["kernel"] == kernel
        oracle.check_forward(kernel_backend.to_numpy(o), q, k, v, scale, causal,
                             lse=kernel_backend.to_numpy(lse))


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "key_padding_bias"])
@pytest.mark.parametrize("d", [64, 128])
def test_float32_long_rows_keep_float32_accuracy(kernel_backend, d, masked, rng):
    """flash_fwd_tf32 (and _masked) over 4096 keys.  The tensor core adds each mma into its
    accumulator truncating toward zero, so O chained through every K/V tile drifted: 3.2e-5
    (d = 64) and 3.5e-5 (d = 128) relative error here on the emulator's model of it (1.5e-5 at
    Nk = 2048 on an H100), past float32's 1e-5.  O is added into the output every 256 keys
    (flush_o): 2.8e-6 and 3.5e-6.  On the emulator the bytes moved include those flushes."""
    Nq, Nk = 64, 4096
    q, k, v = oracle.qkv(rng, (1, 1, Nq, d), (1, 1, Nk, d), dtype="float32")
    feat = {}
    if masked:  # the last 37 keys are padding
        bias = np.zeros((1, 1, 1, Nk), np.float32)
        bias[..., Nk - 37:] = -np.inf
        feat["bias"] = bias
    args = [kernel_backend.asarray(x) for x in (q, k, v)]
    with poisoned_outputs():
        o, lse = cuflash.tiled_attention(*args, num_splits=1, return_lse=True, backend=kernel_backend.name,
                                         **{n: kernel_backend.asarray(x) for n, x in feat.items()})
    o, lse = kernel_backend.to_numpy(o), kernel_backend.to_numpy(lse)
    if kernel_backend.name == "emulator":
        st = _emulator_stats()
        assert st["kernel"] == "flash_fwd_tf32" + ("_masked" if masked else "")
    oracle.check_forward(o, q, k, v, lse=lse, **feat)
    if kernel_backend.name == "emulator":
        plan = kernels.get_runtime("emulator").plan_fwd(d, d, "float32", masked=masked)
        if masked:
            model = lambda fk: tiling.flash_fwd_masked_traffic(  # noqa: E731
                1, 1, Nq, Nk, d, d, "float32", plan.block_q, plan.block_kv, bias=True,
                threads=plan.threads, flush_keys=fk)
        else:
            model = lambda fk: tiling.flash_fwd_traffic(  # noqa: E731
                1, 1, Nq, Nk, d, d, "float32", plan.block_q, plan.block_kv, flush_keys=fk)
        # 15 flushes: 15 writes and 15 reads (14 flushes, the end) of the tile's O rows
        flushes = tiling.tf32_flushes(Nk // plan.block_kv, plan.block_kv, tiling.TF32_FLUSH_KEYS)
        assert flushes == 15
        extra = flushes * Nq * d * 4
        assert model(tiling.TF32_FLUSH_KEYS) == tuple(x + extra for x in model(0))
        assert (st["global_bytes_read"], st["global_bytes_written"]) == model(tiling.TF32_FLUSH_KEYS)


def test_tensor_core_kernel_as_sm75(rng):
    """flash_fwd_tc / flash_fwd_tf32 compiled for sm_75: portable.cuh's software mma and
    synchronous cp.async."""
    rt = kernels.get_runtime("emulator", arch="sm_75")
    assert rt.smem_limit == 64 * 1024
    q, k, v = oracle.qkv(rng, (2, 50, 64), (2, 77, 64), dtype="bfloat16")
    spec = _validate.check_attention_inputs(q, k, v, causal=True)
    # before sm_80 the default is the SIMT kernel (software mma is slower there) ...
    assert rt.plan_fwd(64, 64, "bfloat16").kernel == rt.plan_fwd(64, 64, "float32").kernel == "flash_fwd"
    emu80 = kernels.get_runtime("emulator")
    assert emu80.plan_fwd(64, 64, "bfloat16").kernel == "flash_fwd_tc"
    assert emu80.plan_fwd(64, 64, "float32").kernel == "flash_fwd_tf32"
    # ... but the tensor-core kernels still run there when asked for
    with poisoned_outputs():
        o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec, kernel="flash_fwd_tc")
    assert _emulator_stats()["kernel"] == "flash_fwd_tc"
    oracle.check_forward(o, q, k, v, None, True, lse=lse)
    q, k, v = oracle.qkv(rng, (1, 20, 16), (1, 30, 16), dtype="float32")
    spec = _validate.check_attention_inputs(q, k, v, causal="bottom_right", block_q=16, block_kv=16)
    with poisoned_outputs():
        o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec, kernel="flash_fwd_tf32")
    assert _emulator_stats()["kernel"] == "flash_fwd_tf32"
    oracle.check_forward(o, q, k, v, None, "bottom_right", lse=lse)


def test_tensor_core_kernel_misaligned_view(kernel_backend, rng):
    """A view whose rows start at odd addresses is copied for cp.async, not read misaligned."""
    buf = oracle.randn(rng, (3, 50 * 64 + 1), "float16")
    k = buf[:, 1:].reshape(3, 50, 64)            # 2-byte offset: not 16-byte aligned
    q = oracle.randn(rng, (3, 33, 64), "float16")
    v = oracle.randn(rng, (3, 50, 64), "float16")
    o = cuflash.tiled_attention(kernel_backend.asarray(q), kernel_backend.asarray(k),
                                kernel_backend.asarray(v), backend=kernel_backend.name)
    if kernel_backend.name == "emulator":
        assert _emulator_stats()["kernel"] == "flash_fwd_tc"
    oracle.check_forward(kernel_backend.to_numpy(o), q, k, v)


def test_contiguous_view_off_a_16_byte_boundary(kernel_backend, rng):
    """A C-contiguous view starting 2 bytes into its buffer (ascontiguousarray returns it
    unchanged): the forward, the masked forward and both backwards copy it once and run
    (they recursed on such a view before)."""
    buf = oracle.randn(rng, (3 * 50 * 64 + 1,), "float16")
    k = buf[1:].reshape(3, 50, 64)
    assert k.flags.c_contiguous and k.ctypes.data % 16 != 0
    q = oracle.randn(rng, (3, 33, 64), "float16")
    v = oracle.randn(rng, (3, 50, 64), "float16")
    a = kernel_backend.asarray
    for feat in ({}, {"softcap": 3.0}):
        o, lse = cuflash.tiled_attention(a(q), a(k), a(v), return_lse=True,
                                         backend=kernel_backend.name, **feat)
        o, lse = kernel_backend.to_numpy(o), kernel_backend.to_numpy(lse)
        oracle.check_forward(o, q, k, v, lse=lse, **feat)
        do = oracle.randn(rng, o.shape, "float16")
        g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse),
                                             backend=kernel_backend.name, **feat)
        oracle.check_backward(tuple(kernel_backend.to_numpy(x) for x in g), do, q, k, v, **feat)


# --------------------------------------------------------------------------
# online_softmax_rows against the reference
# --------------------------------------------------------------------------
SOFTMAX_CASES = [
    ("float32", (300,), 64),
    ("float64", (77,), None),
    ("float64", (3, 5, 100), 7),
    ("float16", (6, 65), 32),
    ("bfloat16", (4, 129), None),
    ("float32", (9, 1), 1),
]


@pytest.mark.parametrize("dtype,shape,chunk", SOFTMAX_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-chunk{c[2]}" for c in SOFTMAX_CASES])
def test_online_softmax_kernel(kb, dtype, shape, chunk, rng):
    x = oracle.randn(rng, shape, dtype, scale=5.0)
    if len(shape) > 1:
        x[(0,) * (len(shape) - 1)] = -np.inf  # a row of only -inf: p = 0
        x[(-1,) * (len(shape) - 1) + (0,)] = 1e4 if dtype != "float16" else 6e4
    fn = cuflash.online_softmax if len(shape) == 1 else cuflash.online_softmax_2d
    with poisoned_outputs():
        p, m, l = fn(kb.asarray(x), chunk, return_stats=True, backend=kb.name)
    p, m, l = kb.to_numpy(p), kb.to_numpy(m), kb.to_numpy(l)
    rp, rm, rl = reference.online_softmax_2d(x, chunk, return_stats=True)
    assert p.dtype == x.dtype and p.shape == x.shape and np.shape(m) == shape[:-1]
    xd = x.astype(np.float64)
    # oracle: plain two-pass softmax in float64
    with np.errstate(invalid="ignore"):
        mx = xd.max(axis=-1, keepdims=True)
        e = np.exp(xd - np.where(np.isneginf(mx), 0, mx))
        s = e.sum(axis=-1, keepdims=True)
        want = e / np.where(s == 0, 1, s)
    tol = {"float64": 1e-13, "float32": 2e-6}.get(dtype, 2 * oracle.eps_of(dtype))
    np.testing.assert_allclose(p.astype(np.float64), want, rtol=0, atol=tol)
    np.testing.assert_array_equal(np.asarray(m, np.float64), rm)  # the max is exact
    finite = np.asarray(rl) > 0
    np.testing.assert_allclose(np.asarray(l, np.float64)[finite], np.asarray(rl)[finite],
                               rtol=1e-12 if dtype == "float64" else 1e-5)
    assert np.all(np.asarray(l)[~finite] == 0)


# --------------------------------------------------------------------------
# tiles: explicit sizes honoured, too big refused, the traffic model exact
# --------------------------------------------------------------------------
def test_explicit_tiles_honoured(kernel_backend, rng):
    q = oracle.randn(rng, (2, 37, 16), "float64")  # SIMT tiles: float64 (see FWD_CASES)
    k = oracle.randn(rng, (2, 50, 16), "float64")
    cuflash.tiled_attention(kernel_backend.asarray(q), kernel_backend.asarray(k),
                            kernel_backend.asarray(k), causal="top_left", block_q=16,
                            block_kv=8, backend=kernel_backend.name)
    ma = cuflash.memory_analysis(37, 16, "float64", Nk=50, block_q=16, block_kv=8, batch=2,
                                 backend=kernel_backend.name)
    assert (ma["block_q"], ma["block_kv"], ma["tiles_chosen"]) == (16, 8, "explicit")
    plan = tiling.plan("flash_fwd", 16, 16, "float64", 16, 8)
    assert ma["sram_bytes_per_block"] == plan.shared_bytes == 8 * (16 * 17 + 8 * 17 + 8 * 16 + 16 * 9)
    if kernel_backend.name == "emulator":
        st = _emulator_stats()
        assert st["threads_per_block"] == plan.threads == 64
        assert st["blocks"] == 3 * 2  # ceil(37 / 16) Q tiles x 2 problems
        assert st["dynamic_shared_bytes"] == plan.shared_bytes


@pytest.mark.parametrize("dtype,d,bq,bkv,needle", [
    ("float64", 256, 128, 128, "budget is"),       # too much shared memory
    ("float32", 64, 24, 32, "supported block_q"),  # not a supported size
    ("float32", 300, None, None, "head dims"),     # d beyond the kernel
])
def test_unsupported_tiles_refused(kernel_backend, dtype, d, bq, bkv, needle, rng):
    q = oracle.randn(rng, (1, 9, d), dtype)
    with pytest.raises(ValueError) as ei:
        cuflash.tiled_attention(kernel_backend.asarray(q), kernel_backend.asarray(q),
                                kernel_backend.asarray(q), block_q=bq, block_kv=bkv,
                                backend=kernel_backend.name)
    msg = str(ei.value)
    assert needle in msg, msg
    if needle == "budget is":
        # the budget in bytes, its source, and the pairs that do fit
        assert "B (" in msg and "pairs that fit" in msg and "(16, 16)" in msg, msg
    with pytest.raises(ValueError):
        cuflash.memory_analysis(9, d, dtype, block_q=bq, block_kv=bkv,
                                backend=kernel_backend.name)


TRAFFIC_CASES = [
    # dtype, q shape, k shape, causal, block_q, block_kv
    ("float32", (2, 3, 150, 64), (2, 3, 150, 64), None, None, None),
    ("float32", (2, 3, 150, 64), (2, 3, 150, 64), "bottom_right", None, None),
    ("float32", (2, 6, 77, 64), (2, 2, 200, 64), "top_left", None, None),    # GQA, Nq < Nk
    ("float32", (2, 6, 200, 64), (2, 2, 77, 64), "bottom_right", None, None),  # Nq > Nk
    ("float16", (3, 290, 32), (3, 403, 32), "bottom_right", None, None),  # 3 query tiles
]


@pytest.mark.parametrize("case", TRAFFIC_CASES,
                         ids=[f"{c[0]}-q{c[1][-2]}-k{c[2][-2]}-{c[3]}" for c in TRAFFIC_CASES])
def test_traffic_equals_model(case, rng):
    """Global-memory bytes counted by the emulator == the HBM model of memory_analysis."""
    require_backend("emulator")
    dtype, qs, ks, causal, bq, bkv = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    cuflash.tiled_attention(q, k, v, causal=causal or False, block_q=bq, block_kv=bkv,
                            backend="emulator")
    st = _emulator_stats()
    measured = (st["global_bytes_read"], st["global_bytes_written"])
    spec = _validate.check_attention_inputs(q, k, v, causal=causal or False)
    B, H = launch_common.problem_dims(spec.lead)
    Nq, Nk, d = qs[-2], ks[-2], qs[-1]
    ma = cuflash.memory_analysis(Nq, d, dtype, Nk=Nk, block_q=bq, block_kv=bkv, batch=B,
                                 heads=H, backend="emulator")
    bq, bkv = ma["block_q"], ma["block_kv"]
    isz = np.dtype(q.dtype).itemsize
    model = tiling.flash_fwd_traffic(B, H, Nq, Nk, d, d, dtype, bq, bkv, causal)
    ref_model = reference.tiled_forward_hbm_bytes(Nq, Nk, d, d, isz, bq, bkv, causal, B * H,
                                                  4 if dtype != "float64" else 8)
    assert measured == model == ref_model, (measured, model, ref_model)
    full = (ma["tiled_hbm_read_bytes"], ma["tiled_hbm_written_bytes"])
    if causal is None:
        assert measured == full
    else:
        # causal skipping loads fewer K/V bytes; Q, O and lse are the same
        assert measured[0] < full[0] and measured[1] == full[1]
    # the figures for the report
    print(f"\n{_case_id((dtype, qs, ks, causal, bq, bkv, 'c'))}: measured {measured}, "
          f"model {model}, non-causal model {full}")


def test_traffic_model_agrees_with_reference():
    """tiling's exact model == the reference's definition over a grid of sizes (no launch)."""
    for Nq in (1, 5, 64, 97, 200):
        for Nk in (1, 33, 128, 255):
            for causal in (None, "bottom_right", "top_left"):
                for bq, bkv in ((8, 8), (16, 64), (64, 32), (128, 16)):
                    for dtype, isz, lse in (("float16", 2, 4), ("float64", 8, 8)):
                        a = tiling.flash_fwd_traffic(3, 2, Nq, Nk, 32, 48, dtype, bq, bkv, causal)
                        b = reference.tiled_forward_hbm_bytes(Nq, Nk, 32, 48, isz, bq, bkv,
                                                              causal, 6, lse)
                        assert a == b, (Nq, Nk, causal, bq, bkv, dtype, a, b)


# --------------------------------------------------------------------------
# tiling module
# --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(tiling.EMULATOR_ARCHES))
def test_default_tiles_fit_every_arch(arch):
    limit = tiling.EMULATOR_ARCHES[arch]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d in (1, 16, 32, 59, 64, 96, 128, 200, 256):
            p = tiling.plan("flash_fwd", d, d, dtype, limit=limit, limit_source=arch)
            assert p.shared_bytes <= limit and p.chosen == "default"
            assert p.block_q in (8, 16, 32, 64, 128) and p.threads == 4 * p.block_q
            # one size given: honoured, the other chosen
            try:
                p2 = tiling.plan("flash_fwd", d, d, dtype, block_q=8, limit=limit)
                assert p2.block_q == 8 and p2.shared_bytes <= limit
            except ValueError as e:  # one warp per block: under the occupancy floor here
                assert "resident warp(s) per SM" in str(e), e
                assert tiling.resident_warps(32, tiling.plan("flash_fwd", d, d, dtype, 8, 8).shared_bytes,
                                             limit) < tiling.MIN_RESIDENT_WARPS


def test_explicit_plan_never_changed():
    p = tiling.plan("flash_fwd", 128, 128, "float32", 128, 128)  # no limit: honoured
    assert (p.block_q, p.block_kv, p.chosen) == (128, 128, "explicit")
    assert p.shared_bytes == 263680
    with pytest.raises(ValueError, match="needs 263680 B .* budget is 166912 B"):
        tiling.plan("flash_fwd", 128, 128, "float32", 128, 128, limit=163 * 1024,
                    limit_source="nominal sm_80")
    # dv != d is supported by the kernel (its own define)
    p = tiling.plan("flash_fwd", 32, 96, "float32")
    assert p.d == 32 and p.dv == 96


def test_memory_analysis_states_the_limit(kernel_backend):
    ma = cuflash.memory_analysis(4096, 128, "float16", batch=2, heads=8,
                                 backend=kernel_backend.name)
    if kernel_backend.name == "emulator":
        assert ma["sram_limit_source"] == "nominal sm_80 opt-in limit (emulator)"
        assert ma["sram_limit_bytes"] == 163 * 1024
    assert ma["sram_bytes_per_block"] <= ma["sram_limit_bytes"]
    assert ma["kernel_global_extra_bytes"] == 2 * 8 * 4096 * 4  # lse only
    assert ma["standard_extra_bytes"] == 2 * 2 * 8 * 4096 * 4096 * 2
    ref = cuflash.memory_analysis(4096, 128, "float16", batch=2, heads=8,
                                  block_q=ma["block_q"], block_kv=ma["block_kv"])
    assert ma["tiled_hbm_bytes"] == ref["tiled_hbm_bytes"]
    assert ma["standard_hbm_bytes"] == ref["standard_hbm_bytes"]


def test_verify_no_full_materialization(kernel_backend, rng):
    sizes = []
    for N in (40, 160):
        q, k, v = oracle.qkv(rng, (2, N, 32), (2, N, 32), dtype="float32")
        o, mx = cuflash.verify_no_full_materialization(
            kernel_backend.asarray(q), kernel_backend.asarray(k), kernel_backend.asarray(v),
            16, backend=kernel_backend.name)
        oracle.check_forward(kernel_backend.to_numpy(o), q, k, v)
        sizes.append(mx)
        assert mx < N * N
    # float32 runs flash_fwd_tf32: its shared-memory tiles (K in two stages of 16 x 48
    # elements) dominate until lse (2 * N) is larger: never N^2
    qs, ks, vs, _ = tiling.tc_strides("flash_fwd_tf32", 32, 32)
    tile = max(16 * qs, 2 * 16 * ks, 2 * 16 * vs)
    assert sizes == [max(tile, 2 * 40), max(tile, 2 * 160)]


# --------------------------------------------------------------------------
# race check (emulator under ThreadSanitizer), once per kernel
# --------------------------------------------------------------------------
def test_race_check_flash_fwd(rng):
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 20, 16), (1, 2, 37, 16), dtype="float32")
    spec = _validate.check_attention_inputs(q, k, v, causal=True, block_q=16, block_kv=16)
    o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec)  # raises RaceError on a race
    oracle.check_forward(o, q, k, v, None, True, lse=lse)


@pytest.mark.parametrize("dtype,kernel,bq", [("float16", "flash_fwd_tc", 16), ("bfloat16", "flash_fwd_tc", 64),
                                             ("float32", "flash_fwd_tf32", 64)])
def test_race_check_tensor_core_forward(rng, dtype, kernel, bq):
    """The tensor-core kernels (ldmatrix or 128/64-bit fragment loads, mma, cp.async in two
    stages, one barrier per tile) under TSan: one warp of 16 rows, and 2 warps of 32 rows."""
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 1, 20, 16), (1, 1, 45, 16), dtype=dtype)
    spec = _validate.check_attention_inputs(q, k, v, causal="top_left", block_q=bq,
                                            block_kv=16)
    o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec, kernel=kernel)
    assert _emulator_stats()["threads_per_block"] == 32 * max(1, bq // 32)
    oracle.check_forward(o, q, k, v, None, "top_left", lse=lse)


@pytest.mark.parametrize("dtype,causal", [("float16", "bottom_right"), ("bfloat16", False)])
def test_tc_forward_one_kv_stage(monkeypatch, rng, dtype, causal):
    """flash_fwd_tc with one K and one V buffer (the plan's layout where two stages pass the
    limit, here set between the two, or where it lets more blocks reside on an SM): V_j
    copied under S_j, K_{j+1} under the softmax and P V_j, two barriers per tile.  Under
    TSan, 2 warps of 32 rows, a ragged last key tile (both copies' row-tested paths), GQA,
    rows that see no key (causal, Nq > Nk), against the oracle."""
    with lean_layout(monkeypatch, "flash_fwd_tc", 64, 16, 16) as (rt, one, lean):
        plan = rt.plan("flash_fwd_tc", 16, 16, dtype, 64, 16)
        assert (plan.shared_bytes, dict(plan.layout_defines)) == (one, lean) == (one, {"CUFLASH_FWD_KV_STAGES": 1})
        q, k, v = oracle.qkv(rng, (1, 2, 70, 16), (1, 1, 45, 16), dtype=dtype)
        spec = _validate.check_attention_inputs(q, k, v, causal=causal, block_q=64, block_kv=16)
        with launch_common.observe_launches() as seen:
            o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec)  # raises RaceError on a race
        assert [(e["kernel"], e["shared_mem"], e["block"][0]) for e in seen] == [("flash_fwd_tc", one, 64)]
        oracle.check_forward(o, q, k, v, None, causal, lse=lse)


def test_tc_forward_one_kv_stage_on_gpu(kernel_backend, a100_plans, rng):
    """What an A100 runs at d = 128 -- 128 x 64 with 32 rows per warp, one K and one V buffer
    -- on whatever GPU is at hand (a100_plans): against the oracle (GQA, ragged, causal).  On
    the emulator this is the default plan of its sm_80, which the oracle cases at d = 128 run."""
    rt = a100_plans
    plan = rt.plan("flash_fwd_tc", 128, 128, "float16")
    assert ((plan.block_q, plan.block_kv, plan.threads), dict(plan.layout_defines)) == \
        ((128, 64, 128), {"CUFLASH_FWD_KV_STAGES": 1})
    q, k, v = oracle.qkv(rng, (2, 4, 333, 128), (2, 2, 290, 128), dtype="float16")
    q, k, v = (kernel_backend.asarray(x) for x in (q, k, v))
    spec = _validate.check_attention_inputs(q, k, v, causal="bottom_right")
    with launch_common.observe_launches() as seen:
        o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec)
    assert [e["shared_mem"] for e in seen if e["kernel"] == "flash_fwd_tc"] == [plan.shared_bytes]
    qn, kn, vn = (kernel_backend.to_numpy(x) for x in (q, k, v))
    oracle.check_forward(kernel_backend.to_numpy(o), qn, kn, vn, None, "bottom_right",
                         lse=kernel_backend.to_numpy(lse))


@pytest.mark.parametrize("dtype,causal", [("float16", "bottom_right"), ("bfloat16", "top_left")])
def test_tc_forward_on_emulated_sm90(monkeypatch, rng, dtype, causal):
    """sm_90 with the Hopper kernels off: flash_fwd_tc at its d = 128 default, 128 x 64 with 32
    rows per warp in two K/V stages (104 KB; an A100 takes one stage), against the oracle:
    GQA, ragged last query and key tiles, both causal alignments (rows that see no key)."""
    require_backend("emulator")
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    monkeypatch.setenv(kernels.WGMMA_ENV, "0")
    from cuflash import emulator_backend
    rt = emulator_backend.runtime()
    plan = tiling.plan_flash_fwd(128, 128, dtype, limit=rt.smem_limit, wgmma=rt.wgmma_for(128, 128))
    assert ((plan.kernel, plan.block_q, plan.block_kv, plan.threads, plan.shared_bytes), plan.layout_defines) == \
        (("flash_fwd_tc", 128, 64, 128, 104448), ())
    q, k, v = oracle.qkv(rng, (1, 4, 150, 128), (1, 2, 131, 128), dtype=dtype)
    with launch_common.observe_launches() as seen:
        o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend="emulator")
    assert [(e["kernel"], e["shared_mem"]) for e in seen] == [("flash_fwd_tc", 104448)]
    oracle.check_forward(o, q, k, v, None, causal, lse=lse)


def test_race_check_float32_flushes(rng):
    """flash_fwd_tf32 under TSan where O's second level flushes (300 keys in 16-key tiles: one
    flush after the 16th tile, then the epilogue's read), GQA, causal rows."""
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 20, 16), (1, 1, 300, 16), dtype="float32")
    spec = _validate.check_attention_inputs(q, k, v, causal="bottom_right", block_q=16,
                                            block_kv=16)
    o, lse = launch_fwd.flash_fwd(rt, q, k, v, spec, kernel="flash_fwd_tf32")
    st = _emulator_stats()
    assert st["kernel"] == "flash_fwd_tf32"
    assert st["global_bytes_written"] > tiling.flash_fwd_traffic(1, 2, 20, 300, 16, 16, "float32", 16, 16,
                                                                 "bottom_right")[1]
    oracle.check_forward(o, q, k, v, None, "bottom_right", lse=lse)


def test_race_check_online_softmax(rng):
    rt = kernels.get_runtime("emulator", race_check=True)
    x = oracle.randn(rng, (5, 40), "float32")
    p, m, l = launch_softmax.online_softmax_rows(rt, x, 16)
    np.testing.assert_allclose(p, reference.online_softmax_2d(x, 16), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# launch helpers and the CUDA backend's array code (checked with NumPy as xp)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("xshape,lead,grouped,copied", [
    ((5, 3), (), False, False),
    ((2, 3, 5, 4), (2, 3), False, False),
    ((1, 3, 5, 4), (2, 3), False, False),
    ((3, 5, 4), (2, 3), False, False),
    ((2, 1, 5, 4), (2, 3), False, False),
    ((2, 2, 5, 4), (2, 6), True, False),
    ((4, 1, 3, 5, 4), (4, 2, 3), False, True),   # broadcast inside the batch axes: a copy
])
def test_flatten_lead(xshape, lead, grouped, copied, rng):
    x = rng.standard_normal(xshape)
    arr, (sb, sh, sr) = launch_common.flatten_lead(np, x, lead)
    assert (arr is not x) == copied
    B, H = launch_common.problem_dims(lead)
    group = 3 if grouped else 1
    base = arr.reshape(-1) if arr.flags.c_contiguous else None
    assert base is not None
    xl = x.shape[:-2]
    for b in range(B):
        for h in range(H):
            idx = tuple(np.unravel_index(b, lead[:-1])) + ((h,) if lead else ())
            pad = len(lead) - len(xl)
            xi = list(0 if n == 1 else i for n, i in zip(xl, idx[pad:]))
            if grouped:
                xi[-1] = h // group
            off = b * sb + (h // group) * sh
            got = np.lib.stride_tricks.as_strided(base[off:], shape=x.shape[-2:],
                                                  strides=(sr * x.itemsize, x.itemsize))
            np.testing.assert_array_equal(got, x[tuple(xi)])


def test_cuda_standard_attention_code_with_numpy(rng):
    """cuda_backend's plain-array standard attention (run here with xp = numpy)."""
    from cuflash import cuda_backend as cb
    for qs, ks, causal in [((2, 6, 7, 8), (2, 2, 9, 8), "bottom_right"),
                           ((7, 8), (5, 8), "top_left"),
                           ((3, 1, 4, 8), (5, 4, 8), False),
                           ((6, 9, 8), (1, 5, 8), True)]:
        q, k, v = oracle.qkv(rng, qs, ks)
        spec = _validate.check_attention_inputs(q, k, v, causal=causal)
        o, p = cb._standard_forward(np, q, k, v, spec)
        ro, _, rp = oracle.attention(q, k, v, None, causal)
        oracle.assert_rel_close(o, ro, "float64")
        oracle.assert_rel_close(p, rp, "float64")
        do = rng.standard_normal(spec.out_shape)
        grads = cb._standard_backward(np, do, q, k, v, spec)
        for g, r in zip(grads, oracle.attention_backward(do, q, k, v, None, causal)):
            assert g.shape == r.shape
            oracle.assert_rel_close(g, r, "float64")


def test_compile_variants_cover_every_kernel_file():
    import os
    variants = kernels.compile_variants()
    cu = {f for f in os.listdir(kernels.kernel_dir()) if f.endswith(".cu")}
    assert {"flash_fwd.cu", "online_softmax.cu"} <= set(variants) <= cu
    for f, opts in variants.items():
        assert opts and all(isinstance(o, tuple) for o in opts)
        assert all(any(x.startswith("-DCUFLASH_DTYPE_") for x in o) for o in opts)
    dtypes = {x for o in variants["flash_fwd.cu"] for x in o if x.startswith("-DCUFLASH_DTYPE_")}
    assert dtypes == {"-DCUFLASH_DTYPE_F16", "-DCUFLASH_DTYPE_BF16", "-DCUFLASH_DTYPE_F32",
                      "-DCUFLASH_DTYPE_F64"}

"""The Hopper forward through the public API: on an sm_90 with ``CUFLASH_WGMMA=1`` (the emulator
standing in for one), ``tiled_attention`` plans, compiles (sm_90a) and launches
``flash_fwd_wgmma`` for the plain float16/bfloat16 calls it takes -- tensor maps made per call
over strided, grouped and broadcast inputs -- and the mma.sync kernels for the rest; unset, the
same; switched off, or on another architecture, never.  Results against the float64 oracle,
``memory_analysis`` against the launch (kernel, shared memory, threads, traffic)."""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import require_backend
from cuflash import emulator as em
from cuflash import emulator_backend, kernels, tiling
from cuflash.launch import bwd as launch_bwd
from cuflash.launch import common as launch_common

pytestmark = pytest.mark.emulator
EMU = "emulator"


@pytest.fixture
def hopper(monkeypatch):
    require_backend(EMU)
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    monkeypatch.setenv(kernels.WGMMA_ENV, "1")


def _run(q, k, v, **kw):
    with launch_common.observe_launches() as seen:
        o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend=EMU, **kw)
    return o, lse, [e["kernel"] for e in seen]


# (head dims 192 and 256: tests/kernels/test_flash_fwd_wgmma.py, which launches the kernel directly)
CASES = [  # dtype, d, q shape, k shape, causal, scale
    ("float16", 64, (2, 4, 150, 64), (2, 2, 150, 64), True, None),     # GQA, two tiles, ragged
    ("bfloat16", 128, (1, 1, 70, 128), (1, 1, 200, 128), False, None),  # more keys than queries
    ("float16", 128, (1, 1, 130, 128), (1, 1, 90, 128), "bottom_right", -0.05),  # a negative scale
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}" for c in CASES])
def test_runs_the_hopper_forward(hopper, rng, case):
    dtype, d, qs, ks, causal, scale = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse, ran = _run(q, k, v, causal=causal, scale=scale)
    assert ran == ["flash_fwd_wgmma"]
    oracle.check_forward(o, q, k, v, scale=scale, causal=causal, lse=lse, dtype=dtype)


def test_strided_views_are_read_in_place(hopper, rng):
    """(batch, rows, heads, d) memory viewed as (batch, heads, rows, d): the tensor maps step
    the view's strides, nothing is copied."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in oracle.qkv(rng, (2, 100, 3, 64), (2, 100, 3, 64),
                                                             dtype="float16"))
    with launch_common.track_allocations() as made:
        o, lse, ran = _run(q, k, v)
    assert ran == ["flash_fwd_wgmma"]
    assert not [m for m in made if "copy" in m[0]], made
    oracle.check_forward(o, q, k, v, lse=lse, dtype="float16")


def test_broadcast_inputs_are_copied_once_and_said(hopper, rng):
    """K and V broadcast along the batch (stride 0): the copy engine steps no zero stride, so
    they are written out as contiguous copies, which the launch path records."""
    q = oracle.randn(rng, (3, 2, 80, 64), "float16")
    k, v = (np.broadcast_to(oracle.randn(rng, (1, 2, 80, 64), "float16"), (3, 2, 80, 64))
            for _ in range(2))
    with launch_common.track_allocations() as made:
        o, lse, ran = _run(q, k, v)
    assert ran == ["flash_fwd_wgmma"]
    assert [m[0] for m in made if "copy" in m[0]] == ["copy for the tensor maps"] * 2, made
    oracle.check_forward(o, q, k, v, lse=lse, dtype="float16")
    o2, _, _ = _run(q, k, v)   # the prepared call again
    np.testing.assert_array_equal(o2, o)


@pytest.mark.parametrize("d, dtype, tiles, masked, want", [
    (96, "float16", (None, None), False, "flash_fwd_tc"),       # a head dim it lacks
    (64, "float32", (None, None), False, "flash_fwd_tf32"),     # a dtype it lacks
    (64, "float16", (64, None), False, "flash_fwd_tc"),         # tiles it lacks
    (64, "float16", (None, 64), False, "flash_fwd_wgmma"),      # a curated alternative
    (64, "float16", (None, None), True, "flash_fwd_tc_masked"),  # logit features
])
def test_other_calls_plan_as_before(hopper, d, dtype, tiles, masked, want):
    """What the calls above do not take plans as on sm_80 (the launcher runs the plan's
    kernel: test_runs_the_hopper_forward, and the sm_80 kernels' own tests)."""
    assert emulator_backend.runtime().plan_fwd(d, d, dtype, *tiles, masked=masked).kernel == want


def test_a_launch_off_the_hopper_kernel(hopper, rng):
    q, k, v = oracle.qkv(rng, (1, 1, 40, 64), (1, 1, 40, 64), dtype="float16")
    o, lse, ran = _run(q, k, v, block_q=64)
    assert ran == ["flash_fwd_tc"]
    oracle.check_forward(o, q, k, v, lse=lse, dtype="float16")


@pytest.mark.parametrize("arch, switch", [("sm_90", "0"), ("sm_80", "1"), ("sm_80", None)])
def test_only_sm_90_and_not_switched_off(monkeypatch, arch, switch):
    require_backend(EMU)
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, arch)
    if switch is None:
        monkeypatch.delenv(kernels.WGMMA_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.WGMMA_ENV, switch)
    rt = emulator_backend.runtime()
    assert rt.wgmma is False
    for d in (64, 128):
        assert rt.plan_fwd(d, d, "float16").kernel == "flash_fwd_tc"
        assert launch_bwd.plan_backward(rt, d, d, "float16").kernel == "flash_bwd_tc"


@pytest.mark.parametrize("switch", [None, "auto", "1"])
def test_sm_90_default_is_wherever_they_fit(monkeypatch, switch):
    """Unset, "auto" or "1", an sm_90 runs the Hopper kernels for every plain float16/bfloat16
    call with d == dv they take (64, 128, 192, 256), forward and backward; the rest (other head
    dims, d != dv, float32, deterministic backward) on the mma.sync kernels."""
    require_backend(EMU)
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    if switch is None:
        monkeypatch.delenv(kernels.WGMMA_ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.WGMMA_ENV, switch)
    rt = emulator_backend.runtime()
    assert rt.wgmma
    # the default is every head dim the planners take, not a subset
    assert kernels.WGMMA_DEFAULT_DIMS == tiling.fwd.WGMMA_HEAD_DIMS == tiling.bwd_tc.BWD_WGMMA_HEAD_DIMS
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128, 192, 256):
            assert rt.plan_fwd(d, d, dtype).kernel == "flash_fwd_wgmma", (dtype, d)
            assert launch_bwd.plan_backward(rt, d, d, dtype).kernel == "flash_bwd_wgmma", (dtype, d)
            assert launch_bwd.plan_backward(rt, d, d, dtype, deterministic=True).kernel == "flash_bwd_tc"
        for d, dv in ((96, 96), (112, 112), (128, 64)):
            assert rt.plan_fwd(d, dv, dtype).kernel == "flash_fwd_tc", (d, dv)
            assert launch_bwd.plan_backward(rt, d, dv, dtype).kernel == "flash_bwd_tc", (d, dv)
    assert rt.plan_fwd(128, 128, "float32").kernel == "flash_fwd_tf32"


def test_the_default_end_to_end(monkeypatch, rng):
    """Unset, an sm_90 runs a bfloat16 call's forward and backward on the Hopper kernels at
    d = 64 and 128 through the public functions, against the float64 oracle; d = 96 stays on
    the mma.sync kernels."""
    require_backend(EMU)
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    monkeypatch.delenv(kernels.WGMMA_ENV, raising=False)
    for d, fwd_kernel, bwd_kernel in ((128, "flash_fwd_wgmma", "flash_bwd_wgmma"),
                                      (64, "flash_fwd_wgmma", "flash_bwd_wgmma"),
                                      (96, "flash_fwd_tc", "flash_bwd_tc")):
        q, k, v = oracle.qkv(rng, (1, 2, 90, d), (1, 2, 150, d), dtype="bfloat16")
        o, lse, ran = _run(q, k, v, causal=True)
        assert ran == [fwd_kernel]
        oracle.check_forward(o, q, k, v, causal=True, lse=lse, dtype="bfloat16")
        do = oracle.randn(rng, o.shape, "bfloat16")
        with launch_common.observe_launches() as seen:
            grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True, backend=EMU)
        assert bwd_kernel in [e["kernel"] for e in seen]
        oracle.check_backward(grads, do, q, k, v, None, True)


def test_a_bad_switch_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.WGMMA_ENV, "yes")
    with pytest.raises(ValueError, match="CUFLASH_WGMMA='yes': use 1"):
        kernels.wgmma_choice()


def test_memory_analysis_is_the_launch(hopper, rng):
    """memory_analysis names the kernel, its shared memory and threads, and its HBM model is
    the traffic the launch moved (Q once, K and V once per 128-row query tile), counted by the
    emulator."""
    B, H, N, d = 1, 2, 300, 64
    q, k, v = oracle.qkv(rng, (B, H, N, d), (B, H, N, d), dtype="float16")
    with launch_common.observe_launches() as seen:
        cuflash.tiled_attention(q, k, v, backend=EMU)
    m = cuflash.memory_analysis(N, d, "float16", batch=B, heads=H, backend=EMU)
    main = seen[0]
    plan = tiling.plan("flash_fwd_wgmma", d, d, "float16", limit=tiling.EMULATOR_ARCHES["sm_90"])
    assert (m["kernel"], m["sram_bytes_per_block"], m["threads_per_block"]) == \
        (main["kernel"], main["shared_mem"], main["block"][0]) == \
        ("flash_fwd_wgmma", plan.shared_bytes, 384)
    assert (main["global_bytes_read"], main["global_bytes_written"]) == \
        (m["tiled_hbm_read_bytes"], m["tiled_hbm_written_bytes"])
    assert em.last_launch_stats()["kernel"] == "flash_fwd_wgmma"
    assert "``flash_fwd_wgmma``" in cuflash.tiled_attention.__doc__


def test_the_kernel_is_refused_where_it_cannot_run():
    for dtype, masked, match in (("float32", False, "got float32"),
                                 ("float16", True, "with logit features")):
        with pytest.raises(ValueError, match=match):
            tiling.plan_flash_fwd(64, 64, dtype, kernel="flash_fwd_wgmma", masked=masked)
    with pytest.raises(ValueError, match="needs d == dv in"):
        tiling.plan("flash_fwd_wgmma", 96, 96, "float16")


# on a GPU also the head dims the emulator cases above leave to the direct launches
GPU_CASES = CASES + [
    ("float16", 192, (1, 2, 200, 192), (1, 1, 130, 192), True, None),      # GQA, ragged, causal
    ("bfloat16", 256, (1, 1, 130, 256), (1, 1, 300, 256), "bottom_right", None),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-d{c[1]}" for c in GPU_CASES])
def test_on_an_h100(sm90_gpu, rng, case):
    """On an sm_90 GPU with CUFLASH_WGMMA=1: the same calls run flash_fwd_wgmma (sm_90a, the
    driver's tensor maps) and meet the oracle -- the check that decides its default."""
    from cuflash.launch import fwd
    cp, rt = sm90_gpu
    dtype, d, qs, ks, causal, scale = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    with launch_common.observe_launches() as seen:
        o, lse = fwd.tiled_attention(rt, *(cp.asarray(x) for x in (q, k, v)), scale, causal,
                                     None, None, True)
    assert [e["kernel"] for e in seen] == ["flash_fwd_wgmma"]
    oracle.check_forward(cp.asnumpy(o), q, k, v, scale=scale, causal=causal,
                         lse=cp.asnumpy(lse), dtype=dtype)

"""flash_bwd_wgmma (kernels_cu/flash_bwd_wgmma.cu), the Hopper backward: through the launchers
on the emulator standing in for an sm_90 with CUFLASH_WGMMA=1 -- the float64 oracle (grouped
heads, both causal alignments, ragged lengths, several key tiles and query tiles), the inputs
its tensor maps cannot step, memcheck with the inter-block check and the traffic it moves,
ThreadSanitizer -- and its machine code for sm_90a (HGMMA, TMA, setmaxnreg honoured, no
local memory)."""
import re
from pathlib import Path

import numpy as np
import pytest

import cuflash
import oracle
from conftest import require_backend
from cuflash import _validate, kernels, tiling
from cuflash import emulator as em
from cuflash.launch import bwd as launch_bwd
from cuflash.launch import common as launch_common

pytestmark = pytest.mark.emulator
EMU = "emulator"
SRC = Path(__file__).resolve().parents[2] / "kernels_cu" / "flash_bwd_wgmma.cu"


@pytest.fixture
def hopper(monkeypatch):
    require_backend(EMU)
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    monkeypatch.setenv(kernels.WGMMA_ENV, "1")


def _backward(q, k, v, causal, rng, **kw):
    """(the launched kernels, grads) of a forward + backward on the emulator."""
    o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend=EMU)
    do = oracle.randn(rng, o.shape, oracle.dtype_name(q.dtype))
    with launch_common.observe_launches() as seen:
        grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal, backend=EMU,
                                                 **kw)
    return [e["kernel"] for e in seen], grads, do


CASES = [  # dtype, d, q shape, k shape, causal
    ("float16", 64, (1, 2, 100, 64), (1, 1, 150, 64), False),       # GQA, ragged, 2 key tiles
    ("bfloat16", 64, (1, 1, 130, 64), (1, 1, 130, 64), True),       # 3 query tiles, the diagonal
    ("float16", 128, (1, 1, 70, 128), (1, 1, 200, 128), "bottom_right"),
    ("bfloat16", 128, (1, 4, 65, 128), (1, 2, 40, 128), True),      # queries that see no key
    ("float16", 64, (1, 1, 70, 64), (1, 1, 300, 64), True),         # key tiles no query sees
    # causal GQA where a block's first query tile is not 0: its steps wrap from the last query
    # tile of one head to tile it0 of the next (the dQ rows' pointer steps there)
    ("float16", 128, (1, 4, 200, 128), (1, 2, 200, 128), True),
    ("bfloat16", 64, (2, 2, 200, 64), (2, 1, 200, 64), True),
    # d = 192, 256 (flash_bwd_wgmma_wide.cuh: 64 keys per block, a consumer's 32 queries and
    # one gradient): ragged, both causal alignments, the wrap in causal GQA
    ("float16", 256, (1, 1, 70, 256), (1, 1, 100, 256), False),
    ("bfloat16", 192, (1, 2, 130, 192), (1, 1, 90, 192), True),
    ("float16", 256, (1, 2, 150, 256), (1, 1, 150, 256), True),
    ("bfloat16", 192, (1, 1, 70, 192), (1, 1, 200, 192), "bottom_right"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-{c[4]}" for c in CASES])
def test_matches_the_oracle(hopper, rng, case):
    dtype, d, qs, ks, causal = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    ran, grads, do = _backward(q, k, v, causal, rng)
    assert ran == ["flash_bwd_tc_preprocess", "flash_bwd_wgmma", "flash_bwd_tc_dq_convert"]
    oracle.check_backward(grads, do, q, k, v, None, causal)


def test_deterministic_and_features_run_flash_bwd_tc(hopper, rng):
    """The Hopper backward reduces dQ by atomics and has no logit features: deterministic calls
    and calls with features run flash_bwd_tc(_masked), as on sm_80 (one launched, the others
    planned: the launcher runs the plan's kernel)."""
    q, k, v = oracle.qkv(rng, (1, 1, 40, 64), (1, 1, 40, 64), dtype="float16")
    ran, grads, do = _backward(q, k, v, False, rng, deterministic=True)
    assert ran[1] == "flash_bwd_tc"
    oracle.check_backward(grads, do, q, k, v, None, False)
    rt = kernels.get_runtime(EMU, arch="sm_90")
    assert launch_bwd.plan_backward(rt, 64, 64, "float16", masked=True).kernel == "flash_bwd_tc_masked"
    assert launch_bwd.plan_backward(rt, 96, 96, "float16").kernel == "flash_bwd_tc"  # a head dim it lacks
    assert launch_bwd.plan_backward(rt, 64, 64, "float16").kernel == "flash_bwd_wgmma"


def test_broadcast_inputs_are_copied_and_their_grads_summed(hopper, rng):
    """K and V broadcast along the batch: copied for the tensor maps (recorded), their
    gradients summed back to the inputs' shape."""
    q = oracle.randn(rng, (2, 1, 60, 64), "float16")
    k, v = (np.broadcast_to(oracle.randn(rng, (1, 1, 60, 64), "float16"), (2, 1, 60, 64))
            for _ in range(2))
    with launch_common.track_allocations() as made:
        ran, grads, do = _backward(q, k, v, False, rng)
    assert ran[1] == "flash_bwd_wgmma"
    assert [m[0] for m in made].count("copy for the tensor maps") >= 2, made
    assert grads[1].shape == k.shape and grads[2].shape == v.shape
    oracle.check_backward(grads, do, q, k, v, None, False)


def _launch(rt, rng, causal, dtype="float16", qs=(1, 2, 90, 64), ks=(1, 1, 150, 64)):
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend=EMU)
    do = oracle.randn(rng, o.shape, dtype)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal)
    with launch_common.observe_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec)
    oracle.check_backward(grads, do, q, k, v, None, causal)
    return seen


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_checked_launch(hopper, rng, d):
    """Under memcheck and the inter-block check (every access inside the launch's arrays and
    shared memory; blocks store disjoint dK, dV rows, dQ only by reds), and the traffic: each
    block reads its K, V rows once and, per query head of its group and query tile, Q, dO and
    64 lse2 and D values; it stores its dK, dV rows and reduces the tile's 64 x d dQ values
    once per consumer warpgroup at d = 64 (each its own keys), once above (each its
    columns, both warpgroups' keys); rows past Nq not."""
    rt = kernels.get_runtime(EMU, arch="sm_90")
    assert rt.wgmma
    B, H, Hk, nq, nk = 1, 2, 1, 90, 150
    with em.memcheck(), em.interblock_check():
        seen = _launch(rt, rng, False, qs=(B, H, nq, d), ks=(B, Hk, nk, d))
    main = next(e for e in seen if e["kernel"] == "flash_bwd_wgmma")
    n_kv, n_q = -(-nk // (128 if d <= 128 else 64)), -(-nq // 64)
    # TMA reads the rows inside the tensors only (past Nq / Nk: zeros, not read)
    kv_rows = nk * 2 * Hk * B
    q_rows = n_kv * H * B * nq * 2                      # Q and dO, for every key tile
    stats = n_kv * H * B * n_q * 64 * 2 * 4              # lse2 and D per query tile
    dq = n_kv * H * B * nq * d * (2 if d == 64 else 1) * 4   # the reds (float32),
    assert main["global_bytes_read"] == 2 * d * (kv_rows + q_rows) + stats + dq  # read and
    assert main["global_bytes_written"] == 2 * d * nk * 2 * Hk * B + dq          # written


@pytest.mark.parametrize("d", [64, 128, 192])
def test_race_check(hopper, rng, d):
    """The stages' mbarriers, the warpgroup waits and the barrier before the dQ product (the
    warpgroup's at d = 64, both consumers' above; at d = 192 also before the products that read
    the other consumer's P^T and dS^T) order every shared access under ThreadSanitizer (384
    threads as real threads)."""
    rt = kernels.get_runtime(EMU, race_check=True, arch="sm_90")
    seen = _launch(rt, rng, True, qs=(1, 1, 70, d), ks=(1, 1, 130, d))
    assert "flash_bwd_wgmma" in [e["kernel"] for e in seen]


def test_nvrtc_sm90a_machine_code(sm90_nvrtc):
    _nvrtc, _sass = sm90_nvrtc
    for dtype, d in (("float16", 64), ("bfloat16", 128), ("float16", 192), ("bfloat16", 256)):
        plan = tiling.plan("flash_bwd_wgmma", d, d, dtype)
        r = _nvrtc.compile(SRC.read_text(), SRC.name, options=(
            "-arch=sm_90a", *kernels.build_options(kernels.plan_defines(plan)), "--ptxas-options=-v"))
        assert r.warnings == []
        assert "C7508" not in r.log, r.log            # setmaxnreg honoured
        info = _nvrtc.parse_ptxas_info(r.log)["flash_bwd_wgmma"]
        assert info["spill_stores"] == info["spill_loads"] == info["stack_frame"] == 0, info
        ops = set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)",
                             _sass.disassemble(r.cubin)))
        # S^T, dP^T (64 queries; 32 above d = 128), dQ chunks; dV, dK
        for shape in ("64x64x16", f"64x{d}x16") + (("64x32x16",) if d > 128 else ()):
            assert any(o.startswith(f"HGMMA.{shape}.F32") for o in ops), (shape, sorted(ops))
        assert any(o.startswith("UTMALDG.4D") for o in ops)
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops and "USETMAXREG.DEALLOC.CTAPOOL" in ops
        assert any(o.startswith("RED") for o in ops)  # dQ


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-{c[4]}" for c in CASES])
def test_on_an_h100(sm90_gpu, rng, case):
    """On an sm_90 GPU with CUFLASH_WGMMA=1: the same calls run flash_bwd_wgmma and meet the
    oracle -- with the forward's, the check that decides the Hopper kernels' default."""
    cp, rt = sm90_gpu
    dtype, d, qs, ks, causal = case
    q, k, v = oracle.qkv(rng, qs, ks, dtype=dtype)
    o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend="numpy")
    do = oracle.randn(rng, o.shape, dtype)
    g = [cp.asarray(x) for x in (do, q, k, v, o.astype(q.dtype), lse.astype(np.float32))]
    spec = _validate.check_backward_inputs(*g, causal=causal)
    with launch_common.observe_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, *g, spec)
    assert "flash_bwd_wgmma" in [e["kernel"] for e in seen]
    oracle.check_backward([cp.asnumpy(x) for x in grads], do, q, k, v, None, causal)


def test_memory_analysis_lists_the_launches(hopper, rng):
    """memory_analysis's backward_kernels are the launches, with their shared memory, and the
    docstring of tiled_attention_backward names the kernel."""
    q, k, v = oracle.qkv(rng, (1, 2, 80, 128), (1, 2, 80, 128), dtype="bfloat16")
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend=EMU)
    do = oracle.randn(rng, o.shape, "bfloat16")
    with launch_common.observe_launches() as seen:
        cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend=EMU)
    m = cuflash.memory_analysis(80, 128, "bfloat16", heads=2, backend=EMU)
    assert [(e["kernel"], e["shared_mem"]) for e in seen] == \
        [(x["kernel"], x["shared_bytes"]) for x in m["backward_kernels"]]
    assert "``flash_bwd_wgmma``" in cuflash.tiled_attention_backward.__doc__

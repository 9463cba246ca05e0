"""flash_fwd_wgmma (kernels_cu/flash_fwd_wgmma.cu), the Hopper forward: TMA, wgmma, a producer
warpgroup and two consumers, on the emulator (sm_90a) against the float64 oracle, and its
machine code for sm_90a (NVRTC): HGMMA, TMA, setmaxnreg honoured, no local memory.

These tests launch it directly, with the emulator's own tensor maps and parameter block; the
launchers' choice of it is tests/launch/test_fwd_hopper.py's.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em
from cuflash import emulator_backend
from cuflash.launch.common import params_dtype
from cuflash.launch.tma import tensor_map

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - a test dependency
    ml_dtypes = None

SRC = Path(__file__).resolve().parents[2] / "kernels_cu" / "flash_fwd_wgmma.cu"
BR = 128


def shared_bytes(d, bc, stages=2):
    chunks = d // 64
    return chunks * BR * 128 + 2 * stages * chunks * bc * 128 + 8 * (1 + 2 * stages) + 1024


def options(dtype, d, bc):
    return ("-arch=sm_90a", f"-DCUFLASH_DTYPE_{'BF16' if dtype == 'bfloat16' else 'F16'}", f"-DCUFLASH_HEAD_DIM={d}",
            f"-DCUFLASH_BLOCK_KV={bc}")


_MODS = {}


def module(dtype, d, bc, race_check=False):
    key = (dtype, d, bc, race_check)
    if key not in _MODS:
        _MODS[key] = em.RawModule(path=SRC, options=options(dtype, d, bc), race_check=race_check)
    return _MODS[key]


def oracle(q, k, v, scale, causal):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    s = scale * q @ np.swapaxes(k, -1, -2)
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq), s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0.0)
    l = p.sum(-1, keepdims=True)
    o = np.where(l > 0, (p @ v) / np.where(l > 0, l, 1), 0.0)
    lse = np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1)))[..., 0], -np.inf)
    return o, lse


def run(dtype, d, bc, B, H, Hk, nq, nk, causal, seed=0, rising=False, race_check=False):
    """(o, lse, oracle o, oracle lse); `rising`: scores that grow along the keys by far more
    than 2^8 per tile, so that every tile moves the row max (the rescale of O and l)."""
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, nq, d)).astype(npdt)
    k = rng.standard_normal((B, Hk, nk, d)).astype(npdt)
    v = rng.standard_normal((B, Hk, nk, d)).astype(npdt)
    if rising:
        q = (np.abs(q.astype(np.float32)) + 0.5).astype(npdt)
        k = (np.abs(k.astype(np.float32)) * np.linspace(0.0, 3.0, nk)[:, None]).astype(npdt)
    scale = d ** -0.5
    o = np.full((B, H, nq, d), np.nan, npdt)
    lse = np.full((B, H, nq), np.nan, np.float32)
    n_tiles = -(-nq // BR)
    prm = np.zeros(1, params_dtype("FwdParams"))
    for name, val in dict(o_sb=H * nq * d, o_sh=nq * d, o_sr=d, lse_sb=H * nq, lse_sh=nq, scale=scale, Nq=nq, Nk=nk,
                          H=H, group=H // Hk, causal=int(causal), causal_offset=nk - nq, n_tiles=n_tiles,
                          lse_sr=1, n_splits=1).items():
        prm[name] = val
    rt = emulator_backend.runtime()
    maps = [tensor_map(rt, q, (1, 1, 64, 64), swizzle=128), tensor_map(rt, k, (1, 1, bc, 64), swizzle=128),
            tensor_map(rt, v, (1, 1, bc, 64), swizzle=128)]
    fn = module(dtype, d, bc, race_check).get_function("flash_fwd_wgmma")
    fn.max_dynamic_shared_size_bytes = shared_bytes(d, bc)
    fn((n_tiles * H * B,), (384,), (*maps, q, k, v, o, lse, prm.view(np.uint8)), shared_mem=shared_bytes(d, bc))
    want_o, want_lse = oracle(q, k, v, scale, causal)
    return o, lse, want_o, want_lse


# (float16 d = 64 with 128 keys per tile, grouped heads: tests/launch/test_fwd_hopper.py, through
# the launcher)
CASES = [
    ("float16", 128, 64, 1, 1, 1, 256, 256, True),
    ("bfloat16", 64, 64, 2, 1, 1, 70, 150, False),
    ("float16", 128, 128, 1, 1, 1, 129, 100, True),    # causal, fewer keys: rows that see none
    ("bfloat16", 192, 96, 1, 1, 1, 100, 200, False),
    ("float16", 256, 64, 1, 1, 1, 140, 140, True),
    ("bfloat16", 128, 192, 1, 1, 1, 130, 500, True),   # 192 keys per tile: 227 KB of shared memory
    ("float16", 128, 176, 1, 1, 1, 200, 400, False),   # 176 keys (FlashAttention-3's tile)
]


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-d{c[1]}-bc{c[2]}-{c[6]}x{c[7]}{'-causal' if c[8] else ''}"
                                              for c in CASES])
def test_matches_the_oracle(case):
    dtype, d, bc, B, H, Hk, nq, nk, causal = case
    o, lse, want_o, want_lse = run(dtype, d, bc, B, H, Hk, nq, nk, causal, seed=nq + nk)
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-4)
    st = em.last_launch_stats()
    assert st["blocks"] == -(-nq // BR) * H * B


@pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
def test_checked_launch():
    """Under memcheck and the inter-block write check (every access inside the launch's
    arrays and shared memory, no two blocks storing to one address), and the traffic: Q, K,
    V read once per query tile (keys past the causal diagonal skipped), O and lse written once."""
    B, H, nq, nk, d, bc = 1, 2, 200, 200, 64, 64
    with em.memcheck(), em.interblock_check():
        o, lse, want_o, want_lse = run("float16", d, bc, B, H, H, nq, nk, False, seed=7)
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=4e-3, rtol=4e-3)
    st = em.last_launch_stats()
    n_tiles = -(-nq // BR)
    # per block: its Q rows (the TMA box reads only rows inside Q), every K and V row
    q_rows = nq * H * B
    kv_rows = n_tiles * nk * 2 * H * B
    assert st["global_bytes_read"] == 2 * d * (q_rows + kv_rows)  # (the maps and params are not traffic)
    assert st["global_bytes_written"] == 2 * d * nq * H * B + 4 * nq * H * B


def test_race_check():
    """The pipeline's mbarriers and the warpgroup waits order every shared access under
    ThreadSanitizer, with the block's 384 threads as real threads."""
    o, lse, want_o, want_lse = run("float16", 64, 64, 1, 1, 1, 64, 192, True, seed=8, race_check=True)
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_rising_scores_rescale_every_tile(causal):
    o, lse, want_o, want_lse = run("float16", 64, 64, 1, 1, 1, 150, 320, causal, seed=4, rising=True)
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=4e-3, rtol=4e-3)
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_nvrtc_sm90a_machine_code(sm90_nvrtc):
    _nvrtc, _sass = sm90_nvrtc
    for dtype, d, bc in (("float16", 64, 128), ("bfloat16", 128, 128), ("float16", 192, 96), ("bfloat16", 256, 64)):
        r = _nvrtc.compile(SRC.read_text(), SRC.name, options=(
            *options(dtype, d, bc), f"-I{SRC.parent}", "-std=c++17", "-ftz=true", "--ptxas-options=-v"))
        assert r.warnings == []
        assert "C7508" not in r.log, r.log            # setmaxnreg honoured
        info = _nvrtc.parse_ptxas_info(r.log)["flash_fwd_wgmma"]
        assert info["spill_stores"] == info["spill_loads"] == info["stack_frame"] == 0, info
        sass = _sass.disassemble(r.cubin)
        ops = set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)", sass))
        assert any(o.startswith(f"HGMMA.64x{bc}x16.F32") for o in ops), sorted(ops)
        assert any(o.startswith(f"HGMMA.64x{d}x16.F32") for o in ops)
        assert any(o.startswith("UTMALDG.4D") for o in ops)
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL" in ops and "USETMAXREG.DEALLOC.CTAPOOL" in ops


@pytest.mark.parametrize("d, bc", [(128, 128), (64, 128)])
def test_main_loop_order_in_machine_code(sm90_nvrtc, d, bc):
    """The consumers' main loop in sm_90a SASS (two trips, one per stage), each trip in order:
    the turn (BAR.SYNC), one WARPGROUP.ARRIVE, S_j's and P V's HGMMA back to back, the
    hand-over (BAR.ARV), the wait for S_j alone, then the wait for P V -- the ping-pong and the
    pipelining as ptxas kept them (an HGMMA serialised by ptxas would bring a wait of its own)."""
    _nvrtc, _sass = sm90_nvrtc
    r = _nvrtc.compile(SRC.read_text(), SRC.name, options=(*options("float16", d, bc), f"-I{SRC.parent}",
                                                           "-std=c++17", "-ftz=true"))
    sass = _sass.disassemble(r.cubin)
    lo, hi = _sass.main_loop(_sass.instructions(sass)["flash_fwd_wgmma"])
    line = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)"
    full = [(int(a, 16), op) for a, op in re.findall(line, sass.split("Function : flash_fwd_wgmma")[1])]
    seq = [op.split(".")[0] if op.startswith("HGMMA") else op for a, op in full
           if lo <= a <= hi and op.split(".")[0] in ("BAR", "HGMMA", "WARPGROUP")]
    steps = (d // 16) + bc // 16  # S: d/16 k16 steps; P V: Bc/16
    trip = (["BAR.SYNC.DEFER_BLOCKING", "WARPGROUP.ARRIVE"] + ["HGMMA"] * steps
            + ["BAR.ARV", "WARPGROUP.DEPBAR.LE", "WARPGROUP.DEPBAR.LE"])
    assert seq == trip * 2, seq

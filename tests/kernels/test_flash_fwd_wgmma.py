"""flash_fwd_wgmma (kernels_cu/flash_fwd_wgmma.cu), the Hopper forward: TMA, wgmma, a producer
warpgroup and two consumers, on the emulator (sm_90a) against the float64 oracle, and its
machine code for sm_90a (NVRTC): HGMMA, TMA, setmaxnreg honoured, no local memory.

The launchers do not choose this kernel yet; these tests launch it directly.
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


def module(dtype, d, bc):
    key = (dtype, d, bc)
    if key not in _MODS:
        _MODS[key] = em.RawModule(path=SRC, options=options(dtype, d, bc))
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


def run(dtype, d, bc, B, H, Hk, nq, nk, causal, seed=0):
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, nq, d)).astype(npdt)
    k = rng.standard_normal((B, Hk, nk, d)).astype(npdt)
    v = rng.standard_normal((B, Hk, nk, d)).astype(npdt)
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
    fn = module(dtype, d, bc).get_function("flash_fwd_wgmma")
    fn.max_dynamic_shared_size_bytes = shared_bytes(d, bc)
    fn((n_tiles * H * B,), (384,), (*maps, q, k, v, o, lse, prm.view(np.uint8)), shared_mem=shared_bytes(d, bc))
    want_o, want_lse = oracle(q, k, v, scale, causal)
    return o, lse, want_o, want_lse


CASES = [
    ("float16", 64, 128, 1, 2, 2, 200, 200, False),
    ("float16", 64, 128, 1, 2, 1, 130, 300, True),     # GQA, more keys than queries, ragged
    ("float16", 128, 64, 1, 1, 1, 256, 256, True),
    ("bfloat16", 64, 64, 2, 1, 1, 70, 150, False),
    ("float16", 128, 128, 1, 1, 1, 129, 100, True),    # causal, fewer keys: rows that see none
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


def test_nvrtc_sm90a_machine_code():
    from cuflash import _nvrtc, _sass
    ok, why = _nvrtc.is_available()
    if not ok:
        pytest.skip(f"NVRTC not available: {why}")
    ok, why = _sass.is_available()
    if not ok:
        pytest.skip(why)
    if 90 not in _nvrtc.supported_archs():
        pytest.skip(f"this NVRTC ({_nvrtc.version()}) does not compile for sm_90")
    for dtype, d, bc in (("float16", 64, 128), ("bfloat16", 128, 128)):
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

"""cuflash.precompile / ``python -m cuflash compile``: the kernel cache filled ahead of time."""
import subprocess
import sys

import numpy as np
import pytest

import cuflash
import oracle
from conftest import require_backend
from cuflash import kernels


def test_precompile_emulator_then_calls_compile_nothing(rng):
    require_backend("emulator")
    seen = []
    res = cuflash.precompile(("float32",), (32,), backend="emulator", progress=seen.append)
    assert res["backend"] == "emulator" and res["seconds"] >= 0 and len(seen) == 2
    files = {m["file"] for m in res["modules"]}
    # float32 on sm_80: 3xTF32 forward (flash_fwd_tc.cu) and dK/dV (flash_bwd_tf32.cu) + SIMT helpers
    assert files == {"flash_fwd_tc.cu", "flash_bwd.cu", "flash_bwd_tf32.cu"}, res
    kernels_listed = {k for m in res["modules"] for k in m["kernels"]}
    assert {"flash_fwd_tf32", "flash_bwd_tf32", "flash_bwd_dq_convert", "flash_bwd_preprocess"} <= kernels_listed
    # both dQ paths run flash_bwd_tf32: the SIMT dK/dV and dQ kernels are not needed
    assert not {"flash_bwd_dkdv", "flash_bwd_dq"} & kernels_listed
    assert all(any(o.startswith("-DCUFLASH_DTYPE_F32") for o in m["options"])
               for m in res["modules"])
    # a default-tile forward + backward of that dtype and d now finds every module built
    before = len(kernels._CACHE)
    q, k, v = oracle.qkv(rng, (1, 2, 33, 32), (1, 2, 41, 32), dtype="float32")
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator")
    do = oracle.randn(rng, o.shape, "float32")
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator")
    cuflash.tiled_attention_backward(do, q, k, v, o, lse, deterministic=True, backend="emulator")
    assert len(kernels._CACHE) == before, "a call after precompile compiled another module"
    oracle.check_forward(o, q, k, v, lse=lse)
    oracle.check_backward(grads, do, q, k, v)


def test_precompile_needs_a_backend_that_compiles():
    if cuflash.available_backends()["cuda"][0]:
        pytest.skip("a GPU is present: backend=None compiles for it")
    with pytest.raises(ValueError, match="emulator"):
        cuflash.precompile(("float16",), (64,))
    res = cuflash.precompile(("float16",), (64,), backend="numpy")
    assert res == {"backend": "numpy", "seconds": 0.0, "modules": []}


def test_compile_command(tmp_path):
    require_backend("emulator")
    r = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--backend", "emulator",
                        "--dtypes", "float32", "--head-dims", "32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "flash_fwd_tc.cu" in r.stdout and "module(s) ready" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--dtypes", "int8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.parametrize("dtype,d", [("float16", 64), ("float32", 32)])
def test_precompile_features_then_feature_calls_compile_nothing(rng, dtype, d):
    """features=True builds the kernels of calls with logit features, both dQ paths (float16:
    the tensor-core backward's lean builds too, which a call with a window alone, one with a
    softcap and a window, one with ALiBi and a window and one with dropout and a window run)."""
    require_backend("emulator")
    saved = dict(kernels._CACHE)   # modules other tests loaded must not hide a missing one
    kernels._CACHE.clear()
    try:
        _precompile_features_then_call(rng, dtype, d)
    finally:
        kernels._CACHE.update(saved)


def _precompile_features_then_call(rng, dtype, d):
    res = cuflash.precompile((dtype,), (d,), features=True, backend="emulator")
    listed = {k for m in res["modules"] for k in m["kernels"]}
    masked = ({"flash_fwd_tc_masked", "flash_bwd_tc_masked", "flash_bwd_tc_band", "flash_bwd_tc_softcap",
               "flash_bwd_tc_alibi", "flash_bwd_tc_dropout", "flash_bwd_tc_alibi_dropout",
               "flash_bwd_tc_alibi_softcap"}
              if dtype == "float16" else
              {"flash_fwd_tf32_masked", "flash_bwd_tf32_masked", "flash_bwd_dq_convert"})
    assert masked <= listed, res
    assert not {"flash_bwd_dkdv_masked", "flash_bwd_dq_masked"} & listed  # both dQ paths: tf32
    assert any("-DCUFLASH_MASKS" in m["options"] for m in res["modules"])
    before = len(kernels._CACHE)
    q, k, v = oracle.qkv(rng, (1, 2, 33, d), (1, 2, 41, d), dtype=dtype)
    feats = dict(bias=oracle.randn(rng, (1, 1, 33, 41), "float32"), window=(20, 3))
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **feats)
    do = oracle.randn(rng, o.shape, dtype)
    for det in (False, True):
        grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, deterministic=det,
                                                 backend="emulator", **feats)
        oracle.check_backward(grads, do, q, k, v, **feats)
    oracle.check_forward(o, q, k, v, lse=lse, **feats)
    window = dict(window=(20, 3))   # the window alone (float16: flash_bwd_tc_band)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **window)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **window)
    oracle.check_backward(grads, do, q, k, v, **window)
    capped = dict(window=(20, 3), softcap=5.0)   # (float16: flash_bwd_tc_softcap)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **capped)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **capped)
    oracle.check_backward(grads, do, q, k, v, **capped)
    sloped = dict(window=(20, 3), alibi_slopes=np.full(2, 0.2, np.float32))   # (flash_bwd_tc_alibi)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **sloped)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **sloped)
    oracle.check_backward(grads, do, q, k, v, **sloped)
    dropped = dict(window=(20, 3), dropout_p=0.2, seed=7)   # (flash_bwd_tc_dropout)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **dropped)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **dropped)
    oracle.check_backward(grads, do, q, k, v, **dropped)
    both = dict(sloped, dropout_p=0.2, seed=7)   # (flash_bwd_tc_alibi_dropout)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **both)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **both)
    oracle.check_backward(grads, do, q, k, v, **both)
    capped = dict(sloped, softcap=3.0)   # (flash_bwd_tc_alibi_softcap)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator", **capped)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator", **capped)
    oracle.check_backward(grads, do, q, k, v, **capped)
    assert len(kernels._CACHE) == before, "a feature call after precompile compiled a module"


def test_precompile_features_must_be_a_bool():
    with pytest.raises(TypeError, match="features must be True or False"):
        cuflash.precompile(("float16",), (64,), features=("bias",), backend="emulator")


def test_compile_command_features():
    require_backend("emulator")
    r = subprocess.run([sys.executable, "-m", "cuflash", "compile", "--backend", "emulator",
                        "--dtypes", "float32", "--head-dims", "32", "--features"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "flash_fwd_tf32_masked" in r.stdout and "flash_bwd_tf32_masked" in r.stdout, r.stdout

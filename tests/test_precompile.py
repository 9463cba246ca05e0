"""cuflash.precompile / ``python -m cuflash compile``: the kernel cache filled ahead of time."""
import subprocess
import sys

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
    assert {"flash_fwd_tf32", "flash_bwd_tf32", "flash_bwd_dkdv", "flash_bwd_preprocess"} <= kernels_listed
    assert all(any(o.startswith("-DCUFLASH_DTYPE_F32") for o in m["options"])
               for m in res["modules"])
    # a default-tile forward + backward of that dtype and d now finds every module built
    before = len(kernels._CACHE)
    q, k, v = oracle.qkv(rng, (1, 2, 33, 32), (1, 2, 41, 32), dtype="float32")
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend="emulator")
    do = oracle.randn(rng, o.shape, "float32")
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend="emulator")
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

"""bench/ring_overhead.py: world size 1 ring vs plain cuflash.torch, bitwise equal results.

The CPU run (gloo) checks the script and the equality everywhere; the ``cuda`` run (NCCL
on one GPU) skips without a GPU, CuPy or NCCL.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "ring_overhead.py")


def _run(*args):
    """Run the script; every (N, causal) row must report equal results."""
    n_values = args[args.index("--N") + 1].split(",")
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "|---" not in
            line and "causal" not in line]
    assert len(rows) == 2 * len(n_values) and all(row.rstrip().endswith("| yes |") for row in rows), r.stdout
    return r.stdout


def test_world_size_one_on_cpu_equals_plain_cuflash():
    _run("--device", "cpu", "--dtype", "float64", "--N", "64,40", "--heads", "2", "--head-dim",
         "16", "--reps", "1")


@pytest.mark.cuda
def test_world_size_one_nccl_on_a_gpu():
    import torch.distributed as dist
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("no CuPy (cuflash's cuda backend)")
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    print(_run("--N", "1024,4096", "--reps", "3"))

"""bench/ring_model.py runs and its arithmetic is the documented formula."""
import os
import subprocess
import sys

import pytest

import ring_model   # bench/ is on sys.path (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_script_prints_a_table():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ring_model.py"), "--N",
                        "65536", "--ranks", "4,8", "--causal", "both", "--link", "NV=450,IB=50"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 65536")]
    assert len(rows) == 2 * 2 * 2, r.stdout      # ranks x causal x links


def test_step_times_follow_the_formula():
    row = ring_model.step(N=16384, ranks=4, B=1, H=8, Hk=2, d=128, dtype="bfloat16",
                          causal=False, link_gbs=100, fwd_tflops=200, fwdbwd_tflops=100)
    n = 4096
    assert row["t_fwd"] == pytest.approx(4 * 8 * n * n * 128 / 200e12 * 1e3)
    assert row["c_fwd"] == pytest.approx(2 * n * 2 * 128 * 2 / 100e9 * 1e3)
    assert row["c_bwd"] == pytest.approx(2 * n * 2 * 128 * (2 + 4) / 100e9 * 1e3)
    assert row["t_bwd"] == pytest.approx(2.5 * row["t_fwd"] * 200 /
                                         ring_model.bwd_tflops(200, 100))


@pytest.mark.parametrize("causal", [False, True])
def test_transfer_hides_from_the_threshold_on(causal):
    args = dict(B=1, H=16, Hk=4, d=64, dtype="float16", causal=causal, link_gbs=50,
                fwd_tflops=300, fwdbwd_tflops=250)
    n_min = ring_model.min_local_len(16, 4, "float16", causal, 50, 300)
    W = 4
    above = ring_model.step(N=W * (n_min + 2 - n_min % 2), ranks=W, **args)
    below = ring_model.step(N=W * (n_min - 2 - n_min % 2), ranks=W, **args)
    assert above["hides_fwd"] and not below["hides_fwd"]


def test_float32_needs_rates():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ring_model.py"),
                        "--dtype", "float32"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--fwd-tflops" in r.stderr

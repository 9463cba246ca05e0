"""bench/hopper_sass_count.py on this tree's Hopper kernels: their steady trips stay at or below
FlashAttention-3's instructions per HMMA-equivalent as bench/fa3_sass_count.py counts its
loops (forward 1699 at 128 x 176, rescaling every tile; backward 1298 at its lowest), so an edit
that makes ptxas rebuild what the loops now keep (pinned descriptors, stepped addresses) fails
here rather than only in the next count.  Static counts of NVRTC's machine code (pinned
NVRTC 13.0): no GPU, no timing."""
import pytest
from conftest import load_bench

FA3_FWD_D128, FA3_BWD_D128 = 1699, 1298


@pytest.fixture(scope="module")
def hc():
    return load_bench("hopper_sass_count")


def _per_1000(hc, *args, **kw):
    ops, eq, info = hc.count(*args, **kw)
    assert info["spill_stores"] == 0 and eq > 0
    return 1000 * hc.fc.classify(ops)["total"] / eq


def test_forward_at_flashattention3s_tile(sm90_nvrtc, hc):
    assert _per_1000(hc, 128, 176, True) <= FA3_FWD_D128     # rescaling every tile, as FA3
    assert _per_1000(hc, 128, 176, False) < _per_1000(hc, 128, 176, True)


def test_backward_d128(sm90_nvrtc, hc):
    assert _per_1000(hc, 128, 128, False, backward=True) <= FA3_BWD_D128

"""The emulator's inter-block write check, and the global-memory primitives of the backward.

Blocks run one at a time in the emulator, so ThreadSanitizer never sees two blocks of one
launch writing the same address -- on a GPU they may run at the same time and the value left
is undefined.  With ``cuflash.emulator.interblock_check()`` on (the test session turns it on
for every launch, tests/conftest.py) every ``gstore`` is logged and such a pair is reported as
:class:`cuflash.emulator.InterBlockRaceError`, naming the kernel, both blocks, the address and
the argument it falls in.  The atomic order check (``cuflash.emulator.atomic_order_check()``)
reports float atomic adds into one address from two threads: a sum whose order, on a GPU,
varies by run.  Also here: ``gred_add`` / ``_v2`` / ``_v4`` (``red.global.add.f32``,
vectorised on sm_90) and ``cvt_pack2`` (``cvt.rn.{f16,bf16}x2.f32``) of portable.cuh.
"""
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em

KERNELS = Path(__file__).resolve().parent / "kernels"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                reason="no host C++ compiler")


@pytest.fixture(scope="module")
def mod():
    return em.RawModule(path=KERNELS / "global_writes.cu")


def test_planted_overlap_is_reported(mod):
    n, blocks = 50, 4
    out = np.full(n * blocks, np.nan, np.float32)
    with em.interblock_check():
        with pytest.raises(em.InterBlockRaceError) as info:
            mod.get_function("overlapping_slices")(blocks, 32, (out, np.int32(n)))
    msg = str(info.value)
    addr = out.ctypes.data + 4 * n  # block 1's first element, also written by block 0
    assert "overlapping_slices" in msg and "blocks (0,0,0) and (1,0,0)" in msg, msg
    assert f"0x{addr:x}" in msg and "argument 'out'" in msg and f"element {n}" in msg, msg
    assert isinstance(info.value, em.RaceError)


def test_correct_kernel_and_reds_pass(mod):
    n, blocks = 50, 4
    out = np.full(n * blocks, np.nan, np.float32)
    with em.interblock_check():
        mod.get_function("own_slices")(blocks, 32, (out, np.int32(n)))
    np.testing.assert_array_equal(out, np.repeat(np.arange(blocks, dtype=np.float32), n))
    # reds of every block into the same addresses: not plain stores, not a race
    acc = np.zeros(64 + 64 + 128, np.float32)
    with em.interblock_check():
        mod.get_function("reds_from_every_block")(blocks, 32, (acc, np.int32(64)))
    tot = sum(range(1, blocks + 1))
    np.testing.assert_array_equal(acc[:32], tot)
    np.testing.assert_array_equal(acc[32:64], 0)
    np.testing.assert_array_equal(acc[64:128], np.tile([tot, 2 * tot], 32))
    np.testing.assert_array_equal(acc[128:], np.tile([tot, 2 * tot, 3 * tot, 4 * tot], 32))
    st = em.last_launch_stats()  # 7 floats per thread, each 4 bytes read + 4 written
    assert st["global_bytes_read"] == st["global_bytes_written"] == blocks * 32 * 7 * 4


def test_atomic_order_check_passes_one_adder_per_address(mod):
    n, blocks = 40, 3
    out = np.zeros(2 * n * blocks, np.float32)
    out64 = np.zeros(n * blocks, np.float64)
    with em.atomic_order_check():
        mod.get_function("own_atomics")(blocks, 32, (out, out64, np.int32(n)))
    np.testing.assert_array_equal(out, 6.0)
    np.testing.assert_array_equal(out64, 6.0)


@pytest.mark.parametrize("kernel, args, where", [
    ("shared_atomic_in_block", lambda: (np.zeros(64, np.float32),),
     "block (0,0,0) thread 0 and block (0,0,0) thread 1"),
    ("overlapping_vector_reds", lambda: (np.zeros(32, np.float32),),
     "block (0,0,0) thread 28 and block (1,0,0) thread 0"),
    ("shared_double_atomic", lambda: (np.zeros(8, np.float64),),
     "block (0,0,0) thread 0 and block (1,0,0) thread 0"),
])
def test_atomic_order_check_reports_two_adders(mod, kernel, args, where):
    arrays = args()
    with em.atomic_order_check():
        with pytest.raises(em.AtomicOrderError) as info:
            mod.get_function(kernel)(2, 32, arrays)
    msg = str(info.value)
    assert kernel in msg and where in msg and "argument 'out'" in msg, msg
    # off (the default): the same launch runs
    mod.get_function(kernel)(2, 32, args())


def test_atomic_order_check_under_race_check():
    tsan = em.RawModule(path=KERNELS / "global_writes.cu", race_check=True)
    with em.atomic_order_check():
        with pytest.raises(em.AtomicOrderError,
                           match=r"shared_double_atomic.*argument 'out' \(a float64 array of 8 elements\), element 3"):
            tsan.get_function("shared_double_atomic")(2, 32, (np.zeros(8, np.float64),))


def test_check_off_lets_it_pass(mod):
    out = np.zeros(3 * 10, np.float32)
    with em.interblock_check(False):
        mod.get_function("overlapping_slices")(3, 32, (out, np.int32(10)))


def test_misaligned_vector_red_fails(mod):
    with pytest.raises(em.LaunchError, match="v4.f32.*16-byte aligned"):
        mod.get_function("misaligned_red_v4")(1, 32, (np.zeros(8, np.float32),))


def test_reported_under_race_check_too():
    tsan = em.RawModule(path=KERNELS / "global_writes.cu", race_check=True)
    out = np.zeros(2 * 40, np.float32)
    with em.interblock_check():
        with pytest.raises(em.InterBlockRaceError, match="overlapping_slices.*argument 'out'"):
            tsan.get_function("overlapping_slices")(2, 32, (out, np.int32(40)))


def _bf16_bits(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint32)
    return r


def test_cvt_pack2_rounds_to_nearest_even(mod):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-8, 6, 200),
                        [0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 1e-8, 3e-5, 1.0009765625,
                         1.00048828125, 1.00146484375, np.nan, 2.0]]).astype(np.float32)
    if x.size % 2:
        x = np.append(x, np.float32(1.0))
    n = x.size // 2
    h = np.zeros(n, np.uint32)
    b = np.zeros(n, np.uint32)
    mod.get_function("pack_halves")(2, 64, (x, h, b, np.int32(n)))
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as cvt.rn does
        want_h = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    got_h = np.stack([h & 0xFFFF, h >> 16], 1).reshape(-1)
    fin = ~np.isnan(x)
    np.testing.assert_array_equal(got_h[fin], want_h[fin])
    assert np.all(np.isnan(got_h[~fin].astype(np.uint16).view(np.float16)))
    got_b = np.stack([b & 0xFFFF, b >> 16], 1).reshape(-1)
    np.testing.assert_array_equal(got_b, _bf16_bits(x))


def test_exp2(mod):
    x = np.array([-np.inf, -120.0, -10.5, 0.0, 1.0, 3.25, 20.0], np.float32)
    out = np.zeros_like(x)
    mod.get_function("exp2_of")(1, 32, (x, out, np.int32(x.size)))
    np.testing.assert_allclose(out, np.exp2(x.astype(np.float64)), rtol=1e-6)
    assert out[0] == 0.0


def test_check_cost(mod):
    """The check costs one vector append per store and a sort per launch: small next to the
    emulation itself (reported, loosely bounded: the machine's load varies)."""
    n, blocks = 4096, 8
    out = np.zeros(n * blocks, np.float32)
    k = mod.get_function("own_slices")
    times = {}
    for on in (False, True, False, True):
        with em.interblock_check(on):
            t0 = time.perf_counter()
            k(blocks, 128, (out, np.int32(n)))
            times.setdefault(on, []).append(time.perf_counter() - t0)
    off, on = min(times[False]), min(times[True])
    print(f"\n{n * blocks} stores in {blocks} blocks: check off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms")
    assert on < 3 * off + 0.05

"""bench/fa3_sass_count.py's reading of FlashAttention-3's kernel names and its HMMA-equivalents
(no network, no NVRTC, no wheel)."""
import collections

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def fa3():
    return load_bench("fa3_sass_count")


# the start of a demangled FA3 backward kernel name (c++filt's spelling), flags in the
# mainloop's order: Is_causal, Is_local, Has_softcap, Varlen, Deterministic
NAME = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<"
        "flash::CollectiveMainloopBwdSm90<2, 2, 2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
        "cute::tuple<cute::C<{m}>, cute::C<128>, cute::C<128> >, cutlass::half_t, float, "
        "cutlass::arch::Sm90, {flags}, true, false, true, 2, 1, 2, 1, false>, ...")


@pytest.mark.parametrize("m,bits,want", [
    (80, (0, 0, 0, 0, 0), []),
    (64, (1, 0, 0, 0, 1), ["causal", "deterministic"]),
    (64, (0, 1, 0, 1, 0), ["local", "varlen"]),
])
def test_mainloop_arguments(fa3, m, bits, want):
    flags = ", ".join("true" if b else "false" for b in bits)
    g = fa3._MAINLOOP.search(NAME.format(m=m, flags=flags))
    assert g is not None and g.group(1, 2, 3) == (str(m), "128", "128")
    assert [f for f, v in zip(fa3.FLAGS, g.groups()[3:]) if v == "true"] == want


def test_hmma_equivalents(fa3):
    ops = collections.Counter({"HGMMA.64x80x16.F32": 24, "HGMMA.64x128x16.F32": 10, "FFMA": 7})
    assert fa3.hc.hmma_equivalents(ops) == 24 * 10 + 10 * 16


def test_table_row(fa3):
    ops = collections.Counter({"HGMMA.64x64x16.F32": 8, "MUFU.EX2": 32, "FFMA": 24})
    text = fa3.table([("64x128x128", ["causal"], ops, 64.0)])
    row = text.splitlines()[-1]
    assert row.startswith("| 64x128x128 | causal | 8 64x64x16 | 64 | **1000** |")


# a demangled FA3 forward kernel name: CollectiveMainloopFwdSm90's tile, cluster and flags
FWD_NAME = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
            "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<{cluster}>, cute::C<1>, cute::C<1> >, "
            "cute::tuple<cute::C<128>, cute::C<{n}>, cute::C<128> >, 128, cutlass::half_t, float, "
            "cutlass::arch::Sm90, {flags}>, flash::CollectiveEpilogueFwd<...")


@pytest.mark.parametrize("n,cluster,bits,want", [
    (176, 1, (0,) * 7 + (1, 1) + (0,) * 3, []),
    (128, 1, (1, 0, 0, 1) + (0,) * 3 + (1, 1) + (0,) * 3, ["causal", "varlen"]),
    (176, 2, (0,) * 7 + (1, 1, 1, 0, 0), ["pack_gqa"]),
])
def test_forward_mainloop_arguments(fa3, n, cluster, bits, want):
    flags = ", ".join("true" if b else "false" for b in bits)
    g = fa3._FWD_MAINLOOP.search(FWD_NAME.format(n=n, cluster=cluster, flags=flags))
    assert g is not None and g.group(1, 2, 3, 4) == (str(cluster), "128", str(n), "128")
    assert [f for f, v in zip(fa3.FWD_FLAGS, g.groups()[4:]) if f and v == "true"] == want


def test_forward_loop_is_the_shortest_innermost_with_the_most_hgmma(fa3):
    def rows(missing):  # one instruction per address, HGMMA at five of them
        return [(a, "HGMMA" if a in (12, 13, 22, 23, 32) else "FFMA") for a in range(50) if a not in missing]
    loops = [(0, 49), (10, 19), (20, 29), (30, 35)]  # an outer loop, two with 2 HGMMA, one with 1
    assert fa3.forward_loop(rows((24, 25)), loops) == (20, 29)  # the shorter of the two
    assert fa3.forward_loop(rows((14, 15)), loops) == (10, 19)
    assert fa3.forward_loop([(a, "FFMA") for a in range(50)], loops) is None

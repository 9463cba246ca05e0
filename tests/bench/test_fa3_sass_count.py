"""bench/fa3_sass_count.py's reading of FlashAttention-3's kernel names and its HMMA-equivalents
(no network, no NVRTC, no wheel)."""
import collections
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fa3():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("fa3_sass_count", ROOT / "bench" / "fa3_sass_count.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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

"""bench/feature_counts.py's pipe model (issue, MUFU, tensor pipe per SM sub-partition): the
arithmetic that turns a kernel's counted main loop into clocks per 32 logits, on made-up
counts (the SASS counts themselves need NVRTC and cuobjdump: ``python bench/feature_counts.py``)."""
from types import SimpleNamespace

import pytest
from conftest import load_bench

FC = load_bench("feature_counts")


def _counted(plain, variants, logits=64, passes=1, plogits=64, ppasses=1, d=64):
    mix = lambda total, mufu, hmma: {"total": total, "MUFU": mufu, "HMMA": hmma}  # noqa: E731
    plan = SimpleNamespace(d=d, dv=d)
    return FC.Counted(plan, logits, passes, {k: mix(*v) for k, v in variants.items()}, plan,
                      plogits, ppasses, mix(*plain))


def test_clocks_per_32_logits():
    # 640 instructions, 64 MUFU and 128 HMMA per trip of 64 logits per lane, over 2 passes
    c = _counted((320, 64, 64), {"none": (640, 64, 128)}, passes=2)
    issue, mufu, tensor = FC._clocks(c, "none")
    assert issue == pytest.approx(20.0)                  # 640 * 2 / 64
    assert mufu == pytest.approx(FC.MUFU_CLOCKS * 2.0)   # a warp's MUFU: 32 lanes at 4 per clock
    assert FC.MUFU_CLOCKS == 8.0
    assert tensor == pytest.approx(FC.HMMA_CLOCKS * 4.0)
    assert FC._clocks(c) == pytest.approx((5.0, 8.0, FC.HMMA_CLOCKS))   # the plain kernel


@pytest.mark.parametrize("clk, lo, hi", [
    ((10.0, 8.0, 14.0), 14.0, 24.0),    # tensor-bound: overlap hides the rest
    ((14.0, 24.0, 13.0), 24.0, 37.0),   # MUFU-bound (softcap's forward)
    ((30.0, 8.0, 20.0), 30.0, 50.0),    # issue-bound
])
def test_bounds_are_busiest_pipe_and_no_tensor_overlap(clk, lo, hi):
    assert FC._bounds(clk) == pytest.approx((lo, hi))


def test_pipes_table_compares_with_the_plain_calls(capsys):
    names = ("none", "bias", "bias + dbias (stored)", "alibi", "softcap",
             "softcap (and its derivative)", "dropout")
    fwd = _counted((64, 8, 16), {n: (64, 8, 16) for n in names})
    bwd = _counted((128, 8, 32), {n: (128, 8, 32) for n in names})
    # softcap triples the forward's MUFU: 24 clocks per 32 logits, above issue and tensor
    fwd.mixes["softcap"] = {"total": 64, "MUFU": 24, "HMMA": 16}
    FC.pipes(fwd, bwd, "test")
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert rows["bias"].endswith("| +0% .. +0% |")
    # by hand, clocks per 32 logits: plain forward issue 1, MUFU 1, tensor 16/64 * 4/0.6 = 1.67
    # (bounds 1.67 .. 2.67), backward 2 / 1 / 3.33 (3.33 .. 5.33): together 5.0 .. 8.0; the
    # softcap forward's MUFU 24/64 * 8 = 3 (bounds 3 .. 4.67): together 6.33 .. 10.0
    assert "together 5.0 .. 8.0" in out
    assert rows["softcap"].endswith("| 6.3 .. 10.0 | +27% .. +25% |")


@pytest.mark.parametrize("unroll", [True, False])
@pytest.mark.parametrize("features", [{}, {"cap": True}, {"bias": True, "db": 2}, {"alibi": True, "drop": True}])
def test_bwd_feature_edits_hold_on_the_kernel(tmp_path, unroll, features):
    """Each edit that turns flash_bwd_tc_masked into one call's interior tile (the counts of
    feature_counts.py and fa2_sass_compare.py's bwd-masked / bwd-masked-softcap rows) finds its text
    in today's kernels_cu -- a kernel edit that moves it fails here, not in a later count --
    and changes the file: the flags become the call's constants."""
    edits = FC.bwd_feature_edits(unroll=unroll, **features)
    folder = FC._variant(str(tmp_path), "v", edits)   # asserts every edit's text is there
    src = (folder / "flash_bwd_tc.cu").read_text()
    b = lambda x: "true" if x else "false"  # noqa: E731
    assert f"const bool has_cap = {b(features.get('cap'))}, has_bias = {b(features.get('bias'))};" in src
    assert f"const int db_mode = {features.get('db', 0)};" in src
    assert ("#pragma unroll 1\n" in src) != unroll
    assert f"if (!kUnrolled || {b(features.get('drop'))}) pt_step(true);" in src

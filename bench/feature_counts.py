"""What each logit feature adds to the tensor-core kernels' main loop, counted in SASS (no GPU).

The masked kernels (flash_fwd_tc_masked, flash_fwd_tf32_masked, flash_bwd_tc_masked) take
every feature behind run-time flags, so one compile holds all of them.  To count one
feature, this script compiles text variants of the kernel sources in a temporary folder:

* "none": the interior-tile path only (no band test), the logit terms reduced to the scale,
  no dropout (and in the backward no dbias, no softcap derivative);
* one variant per feature with just that feature's code put back (masks.cuh's
  ``MaskRow::logit`` keeps only its softcap / bias / ALiBi lines; dropout and dbias their
  blocks); "boundary tile" is the band test's path of the forward (window, causal).

For each variant NVRTC compiles a cubin for sm_80 and ``cuobjdump -sass`` gives the main
loop's static instruction count (:mod:`cuflash._sass`: the loop with the most HMMA); the
difference to "none", divided by the logits a lane handles per loop trip, is the feature's
cost per logit in issue slots.  Static counts: they count each instruction of the loop once
(rolled inner loops once), say nothing about stalls, and the variants are text edits that
must still match the sources (each edit asserts it found its text).

Usage::

    python bench/feature_counts.py            # table to stdout (bench/results/feature_counts.md)
"""
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, _sass, kernels, tiling  # noqa: E402
from cuflash.tiling import bwd_tc  # noqa: E402

KERNELS_CU = ROOT / "kernels_cu"


def _logit_body():
    """MaskRow::logit's body as masks.cuh has it (from ``th = 0;`` to ``return s;``)."""
    text = (KERNELS_CU / "masks.cuh").read_text()
    begin = text.index("        th = 0;\n")
    return text[begin:text.index("        return s;", begin) + len("        return s;")]


LOGIT = _logit_body()
# MaskRow::logit with one term kept
TERMS = {
    "none": "        th = 0;\n        return s;",
    "softcap": LOGIT.split("        if (bias")[0] + "        return s;",
    "bias": "        th = 0;\n        if (bias != nullptr) s += gload(bias + (long long)j * bias_sc);\n"
            "        return s;",
    "alibi": "        th = 0;\n" + LOGIT.split("gload(bias + (long long)j * bias_sc);\n")[1],
}


def _variant(tmp, tag, edits):
    d = Path(tmp) / tag
    shutil.copytree(KERNELS_CU, d)
    for fname, old, new in edits:
        text = (d / fname).read_text()
        assert old in text, f"{tag}: {fname} no longer holds {old[:60]!r}"
        (d / fname).write_text(text.replace(old, new))
    return d


def _loop_count(folder, fname, plan, extra, arch=80):
    defines = dict(kernels.plan_defines(plan), **extra)
    opts = (f"-arch=sm_{arch}", f"-I{folder}",
            *[o for o in kernels.build_options(defines) if not o.startswith("-I")])
    res = _nvrtc.compile((Path(folder) / fname).read_text(), fname, opts)
    ins = _sass.instructions(_sass.disassemble(res.cubin))
    name = next(k for k in ins if k == plan.kernel)
    return _sass.mix(ins[name], _sass.main_loop(ins[name]))


def forward(tmp, kernel, dtype, d):
    fn = "flash_fwd_tc.cu"
    plan = tiling.plan(kernel, d, d, dtype)
    masks = {"CUFLASH_MASKS": None}
    interior = [(fn, "if (k0 < lo_last || k0 + kBc > hi_first || mask_rows)", "if (false)"),
                (fn, "else if (feat.xform)", "else if (true)")]
    nodrop = [(fn, "if (drop.on) tc_dropout(", "if (false) tc_dropout(")]
    rows = {}
    for term in ("none", "bias", "alibi", "softcap"):
        rows[term] = _loop_count(_variant(tmp, f"f{kernel}{term}", interior + nodrop + [
            ("masks.cuh", LOGIT, TERMS[term])]), fn, plan, masks)["total"]
    rows["dropout"] = _loop_count(_variant(tmp, f"f{kernel}drop", interior + [
        ("masks.cuh", LOGIT, TERMS["none"])]), fn, plan, masks)["total"]
    rows["boundary tile (band test)"] = _loop_count(_variant(tmp, f"f{kernel}band", [
        (fn, "if (k0 < lo_last || k0 + kBc > hi_first || mask_rows)", "if (true)"),
        (fn, "else if (feat.xform)", "else if (false)")] + nodrop + [
        ("masks.cuh", LOGIT, TERMS["none"])]), fn, plan, masks)["total"]
    plain = _loop_count(KERNELS_CU, fn, tiling.plan(kernel[:-len("_masked")], d, d, dtype), {})
    logits = plan.block_q // (plan.threads // 32) * plan.block_kv // 32
    return plan, logits, plain, rows


def backward(tmp, dtype, d):
    fn = "flash_bwd_tc.cu"
    plan = tiling.plan("flash_bwd_tc_masked", d, d, dtype)
    extra = {"CUFLASH_MASKS": None, "CUFLASH_BWD_TC_MAIN": None}
    interior = [(fn, "const bool need_mask = kv_rows < kBc || rows_q < kBr ||",
                 "const bool need_mask = false && kv_rows < kBc || rows_q < kBr ||"),
                (fn, "const bool xform = p.mask_softcap > 0 || p.mask_has_bias || p.mask_has_alibi;",
                 "const bool xform = true;")]
    nodrop = [(fn, "                if (drop.on) {\n#pragma unroll 1",
               "                if (false) {\n#pragma unroll 1"),
              (fn, "if (drop.on) {  // dP of the dropped product",
               "if (false) {  // dP of the dropped product")]
    nodb = [(fn, "if (pass == 0 && p.mask_dbias) {", "if (false) {")]
    nocap = [(fn, "if (cap > 0.0f) {  // d softcap", "if (false) {  // d softcap")]
    rows = {}
    for term in ("none", "bias", "alibi"):
        rows[term] = _loop_count(_variant(tmp, f"b{term}", interior + nodrop + nodb + nocap + [
            ("masks.cuh", LOGIT, TERMS[term])]), fn, plan, extra)["total"]
    rows["softcap (and its derivative)"] = _loop_count(_variant(tmp, "bcap", interior + nodrop + nodb + [
        ("masks.cuh", LOGIT, TERMS["softcap"])]), fn, plan, extra)["total"]
    rows["dropout"] = _loop_count(_variant(tmp, "bdrop", interior + nodb + nocap + [
        ("masks.cuh", LOGIT, TERMS["none"])]), fn, plan, extra)["total"]
    rows["bias + dbias"] = _loop_count(_variant(tmp, "bdb", interior + nodrop + nocap + [
        ("masks.cuh", LOGIT, TERMS["bias"])]), fn, plan, extra)["total"]
    plain = _loop_count(KERNELS_CU, fn, tiling.plan("flash_bwd_tc", d, d, dtype, plan.block_q,
                                                    plan.block_kv),
                        {"CUFLASH_BWD_TC_MAIN": None})
    _, mt, _, qs = bwd_tc.bwd_tc_layout(plan.block_q, plan.block_kv, d, d, True)
    logits = mt * 16 * (plan.block_q // qs) // 32
    return plan, logits, plain, rows


def main():
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    ok, why = _sass.is_available()
    if not ok:
        print(f"cuobjdump not available: {why}", file=sys.stderr)
        return 2
    print("| kernel | plan | logits / lane / trip | variant | main-loop instructions | "
          "added | added per logit | vs no feature |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        results = [forward(tmp, "flash_fwd_tc_masked", "float16", 128),
                   forward(tmp, "flash_fwd_tf32_masked", "float32", 64),
                   backward(tmp, "float16", 64)]
    for plan, logits, plain, rows in results:
        what = f"{plan.kernel} {plan.dtype} d={plan.d}"
        tiles = f"{plan.block_q} x {plan.block_kv}, {plan.threads} threads"
        print(f"| {what} | {tiles} | {logits} | plain kernel (all its paths) | {plain['total']} "
              f"(HMMA {plain['HMMA']}) | | | |")
        base = rows["none"]
        for name, n in rows.items():
            add = n - base
            print(f"| | | | {name} | {n} | {add:+d} | {add / logits:.1f} | "
                  f"{100 * add / base:+.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

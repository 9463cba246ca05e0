"""What each logit feature adds to the tensor-core kernels' main loop, counted in SASS (no GPU).

The masked kernels (flash_fwd_tc_masked, flash_fwd_tf32_masked, flash_bwd_tc_masked,
flash_bwd_tf32_masked) take every feature behind run-time flags, so one compile holds all of
them.  To count one
feature, this script compiles text variants of the kernel sources in a temporary folder:

* "none": the interior-tile path only (no band test) with every feature flag of the call a
  constant false -- the plain path;
* one variant per feature with that feature's flag a constant true (the bias, and dbias,
  with contiguous keys: their row-pointer paths); "boundary tile" is the band test's path
  of the forward (window, causal) with no feature.

For each variant NVRTC compiles a cubin for sm_80 and ``cuobjdump -sass`` gives the main
loop's static instruction count (:mod:`cuflash._sass`: the loop with the most HMMA); the
difference to "none", divided by the logits a lane handles per loop trip, is the feature's
cost per logit in issue slots.  The backward's rolled inner loops are unrolled in every
variant (and in its plain row), so that each instruction of the loop is counted as often as
one trip executes it (the forward's main loop has none; the backward's dQ loop over a warp's
output tiles keeps a run-time trip count and is counted once).  Static counts still say
nothing about stalls, and the variants are text edits that must still match the sources
(each edit asserts it found its text).

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


def _count_variants(tmp, tag, fn, plan, extra, variants):
    """{variant: main-loop total} of the text variants {name: edits}, and the HMMA of "none"."""
    mixes = {name: _loop_count(_variant(tmp, f"{tag}{i}", edits), fn, plan, extra)
             for i, (name, edits) in enumerate(variants.items())}
    return {name: m["total"] for name, m in mixes.items()}, mixes["none"]["HMMA"]


def forward(tmp, kernel, dtype, d):
    fn = "flash_fwd_tc.cu"
    plan = tiling.plan(kernel, d, d, dtype)
    masks = {"CUFLASH_MASKS": None}
    band = "if (k0 < lo_last || k0 + kBc > hi_first || mask_rows) {"
    any_term = "} else if (p.mask_softcap > 0 || p.mask_has_bias || p.mask_has_alibi) {"
    flags = ("    f.has_cap = p.mask_softcap > 0;\n    f.has_bias = p.mask_has_bias != 0;\n"
             "    f.has_alibi = p.mask_has_alibi != 0;\n")

    def only(cap=False, bias=False, alibi=False, drop=False, boundary=False):
        """The call's feature flags as constants (read and branched on per tile);
        the bias's keys contiguous; an interior tile, or with ``boundary`` the band test's."""
        b = lambda x: "true" if x else "false"  # noqa: E731
        edits = [(fn, band, "if (true) {" if boundary else "if (false) {"),
                 (fn, any_term, f"}} else if ({b(cap or bias or alibi)}) {{"),
                 (fn, flags, f"    f.has_cap = {b(cap)};\n    f.has_bias = {b(bias)};\n"
                             f"    f.has_alibi = {b(alibi)};\n"),
                 (fn, "f.has_bias && f.bias_sc == 1;", "f.has_bias;")]
        if not drop:
            edits.append((fn, "if (drop.on) tc_dropout(", "if (false) tc_dropout("))
        return edits

    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap": only(cap=True), "dropout": only(drop=True),
                "boundary tile (band test)": only(boundary=True)}
    rows, hmma = _count_variants(tmp, f"f{kernel}{dtype}{d}-", fn, plan, masks, variants)
    plain = _loop_count(KERNELS_CU, fn, tiling.plan(kernel[:-len("_masked")], d, d, dtype,
                                                    plan.block_q, plan.block_kv), {})
    logits = plan.block_q // (plan.threads // 32) * plan.block_kv // 32
    return plan, logits, plain, rows, hmma


def backward(tmp, dtype, d):
    fn = "flash_bwd_tc.cu"
    plan = tiling.plan("flash_bwd_tc_masked", d, d, dtype)
    extra = {"CUFLASH_MASKS": None, "CUFLASH_BWD_TC_MAIN": None}
    # the rolled loops (S^T and dP^T over d / dv, the dropout's Philox blocks, dQ's k-steps)
    # unrolled, so that the loop's static count is what one trip executes
    interior = [(fn, "#pragma unroll 1\n", "#pragma unroll\n"),
                (fn, "const bool need_mask = kv_rows < kBc || rows_q < kBr ||",
                 "const bool need_mask = false && kv_rows < kBc || rows_q < kBr ||"),
                (fn, "if (p.mask_bias_sc == 1 && !tile_edge) {", "if (true) {"),
                (fn, "const bool fast = p.mask_dbias_sc == 1 && !tile_edge;", "const bool fast = true;")]
    flags = ("const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;\n"
             "                const bool has_alibi = p.mask_has_alibi != 0;\n"
             "                const int db_mode = p.mask_dbias;")

    def only(cap=False, bias=False, alibi=False, db=0, drop=False):
        """The call's feature flags as constants (the kernel reads them once per call and
        branches on them per tile, so each feature's code is what a call with it runs)."""
        b = lambda x: "true" if x else "false"  # noqa: E731
        edits = interior + [(fn, flags, f"const bool has_cap = {b(cap)}, has_bias = {b(bias)};\n"
                                        f"                const bool has_alibi = {b(alibi)};\n"
                                        f"                const int db_mode = {db};")]
        if not drop:
            edits += [(fn, "                if (drop.on) {\n#pragma unroll\n",
                       "                if (false) {\n#pragma unroll\n"),
                      (fn, "if (drop.on) {  // dP of the dropped product",
                       "if (false) {  // dP of the dropped product")]
        return edits

    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap (and its derivative)": only(cap=True), "dropout": only(drop=True),
                "bias + dbias (stored)": only(bias=True, db=1),
                "bias + dbias (atomic adds)": only(bias=True, db=2)}
    rows, hmma = _count_variants(tmp, "b", fn, plan, extra, variants)
    plain = _loop_count(_variant(tmp, "bplain", interior[:1]), fn,
                        tiling.plan("flash_bwd_tc", d, d, dtype, plan.block_q, plan.block_kv),
                        {"CUFLASH_BWD_TC_MAIN": None})
    _, mt, _, qs = bwd_tc.bwd_tc_layout(plan.block_q, plan.block_kv, d, d, True)
    logits = mt * 16 * (plan.block_q // qs) // 32
    return plan, logits, plain, rows, hmma


def backward_tf32(tmp, d):
    """flash_bwd_tf32_masked (float32): the features per element behind uniform branches."""
    fn = "flash_bwd_tf32.cu"
    plan = tiling.plan("flash_bwd_tf32_masked", d, d, "float32")
    extra = {"CUFLASH_MASKS": None}
    interior = [(fn, "#pragma unroll 1\n", "#pragma unroll\n"),
                (fn, "const bool need_mask = kv_rows < kBc ||", "const bool need_mask = false && kv_rows < kBc ||")]
    flags = ("const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;\n"
             "            const bool has_alibi = p.mask_has_alibi != 0;\n")

    def only(cap=False, bias=False, alibi=False, db=0, drop=False):
        b = lambda x: "true" if x else "false"  # noqa: E731
        # an interior tile, the bias and dbias with contiguous keys (their row-pointer loops
        # where the call has no softcap)
        edits = interior + [(fn, flags, f"const bool has_cap = {b(cap)}, has_bias = {b(bias)};\n"
                                        f"            const bool has_alibi = {b(alibi)};\n"),
                            (fn, "const bool tile_in = kv_rows == kBc && rows_q == kBr;",
                             "const bool tile_in = true;"),
                            (fn, "tile_in && p.mask_bias_sc == 1;", "tile_in;"),
                            (fn, "p.mask_dbias != 0 && !has_cap && tile_in &&\n"
                                 "                                p.mask_dbias_sc == 1 ? 0 : p.mask_dbias;",
                             f"{db} != 0 && !has_cap && tile_in ? 0 : {db};"),
                            (fn, "if (kRowPaths && p.mask_dbias != 0 && db_mode == 0) {",
                             f"if (kRowPaths && {db} != 0 && db_mode == 0) {{"),
                            (fn, "if (p.mask_dbias == 1) dbias_loop(false);", f"if ({db} == 1) dbias_loop(false);")]
        if not drop:
            edits += [(fn, "        if (drop.on) {\n", "        if (false) {\n"),
                      (fn, "const float dpv = drop.on ?", "const float dpv = false ?")]
        return edits

    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap (and its derivative)": only(cap=True), "dropout": only(drop=True),
                "bias + dbias (stored)": only(bias=True, db=1)}
    rows, hmma = _count_variants(tmp, "t", fn, plan, extra, variants)
    plain = _loop_count(_variant(tmp, "tplain", interior[:1]), fn,
                        tiling.plan("flash_bwd_tf32", d, d, "float32", plan.block_q, plan.block_kv), {})
    logits = 16 * plan.block_q // 32
    return plan, logits, plain, rows, hmma


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
                   forward(tmp, "flash_fwd_tc_masked", "float16", 64),
                   forward(tmp, "flash_fwd_tf32_masked", "float32", 64),
                   backward(tmp, "float16", 64),
                   backward_tf32(tmp, 64)]
    for plan, logits, plain, rows, hmma in results:
        what = f"{plan.kernel} {plan.dtype} d={plan.d}"
        tiles = f"{plan.block_q} x {plan.block_kv}, {plan.threads} threads"
        print(f"| {what} | {tiles} | {logits} | plain kernel (all its paths) | {plain['total']} "
              f"(HMMA {plain['HMMA']}) | | | |")
        base = rows["none"]
        for name, n in rows.items():
            add = n - base
            shown = f"{n} (HMMA {hmma})" if name == "none" else f"{n}"
            print(f"| | | | {name} | {shown} | {add:+d} | {add / logits:.1f} | "
                  f"{100 * add / base:+.0f}% |")
    both(results[1], results[3])
    return 0


def both(fwd, bwd):
    """The issue's measure: a feature's share of forward + backward, here in issue slots per
    logit (float16 d=64: the forward and the backward at the same head dim)."""
    (_, fl, _, fr, _), (_, bl, _, br, _) = fwd, bwd
    f0, b0 = fr["none"] / fl, br["none"] / bl
    print()
    print(f"Forward + backward, float16 d=64, per logit: {f0:.1f} + {b0:.1f} = {f0 + b0:.1f} "
          "instructions without features.")
    print()
    print("| feature | forward | backward | together | vs forward + backward without it |")
    print("|---|---|---|---|---|")
    pairs = {"bias": ("bias", "bias"), "bias + dbias (stored)": ("bias", "bias + dbias (stored)"),
             "ALiBi": ("alibi", "alibi"), "softcap": ("softcap", "softcap (and its derivative)"),
             "dropout": ("dropout", "dropout")}
    for name, (fk, bk) in pairs.items():
        fa, ba = (fr[fk] - fr["none"]) / fl, (br[bk] - br["none"]) / bl
        print(f"| {name} | {fa:.1f} | {ba:.1f} | {fa + ba:.1f} | {100 * (fa + ba) / (f0 + b0):+.0f}% |")


if __name__ == "__main__":
    sys.exit(main())

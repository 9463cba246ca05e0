"""What each logit feature adds to the tensor-core kernels' main loop, counted in SASS (no GPU).

The masked kernels (flash_fwd_tc_masked, flash_fwd_tf32_masked, flash_bwd_tc_masked,
flash_bwd_tf32_masked) take every feature behind run-time flags, so one compile holds all of
them.  To count one feature, this script compiles text variants of the kernel sources in a
temporary folder, each the path of an interior tile (every row sees the whole tile, full
tiles; the forward with -DCUFLASH_FWD_INTERIOR_ONLY=1, which also drops the rarely taken
rescale of the online softmax) with the call's feature flags as constants:

* "none": every feature flag false -- what the masked kernel costs a call by itself (the
  backward's dropout bit word kept opaque, :func:`_opaque`: a call executes its uses whatever
  the flag, which is a kernel parameter);
* one variant per feature with that feature's flag true (the bias, and dbias, with contiguous
  keys: their row-pointer paths); "boundary tile" is the band test's path of the forward
  (window, causal) with no feature.

The baseline of issue 13's target is the call *without* the feature, which runs the plain
kernel (flash_fwd_tc, flash_bwd_tc, ...) at its own default tiles: its interior path is
counted the same way ("plain kernel, its default tiles").  Every count is per logit: the
main loop's static instructions (:mod:`cuflash._sass`: the loop with the most HMMA) times the
passes over the head dims, divided by the logits one lane handles per trip.  The backward's
rolled inner loops are unrolled in every variant so that each instruction is counted as
often as one trip executes it (the dQ loop over a warp's output tiles keeps a run-time trip
count and is counted once).  Static counts say nothing about stalls, and the variants are
text edits that must still match the sources (each edit asserts it found its text).

The tables are for sm_80 at each kernel's default at sm_80's shared-memory limit (its curated
plan for the A100); the last ones count float16 d=64 and d=128 on
the H100's own plans (sm_90 SASS, the defaults at sm_90's limit), and turn those counts into
time by a pipe model (:data:`PIPE_MODEL_TEXT`: issue, MUFU and tensor pipe at published
rates -- an estimate, not a measurement).

Usage::

    python bench/feature_counts.py            # tables to stdout (bench/results/feature_counts.md)
"""
import shutil
import sys
import tempfile
from typing import NamedTuple
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


def _opaque(fname, decl):
    """An edit of the dropout bit word's declaration ``decl`` that xors its initial value with a
    parameter the compiler cannot see through (``p.mask_dropout >> 1``: 0 at run time): with
    dropout off as a constant, ptxas would otherwise fold the word and every use of it away (the
    masks of the dV operand), which the kernel cannot do at run time, where the flag is a
    parameter -- the variants count what a call executes."""
    return (fname, decl, decl.rstrip(";") + " ^ ((unsigned long long)p.mask_dropout >> 1);")


def _loop_count(folder, fname, plan, extra, arch=80):
    defines = dict(kernels.plan_defines(plan), **extra)
    opts = (f"-arch=sm_{arch}", f"-I{folder}",
            *[o for o in kernels.build_options(defines) if not o.startswith("-I")])
    res = _nvrtc.compile((Path(folder) / fname).read_text(), fname, opts)
    ins = _sass.instructions(_sass.disassemble(res.cubin))
    name = next(k for k in ins if k == plan.kernel)
    return _sass.mix(ins[name], _sass.main_loop(ins[name]))


def _count_variants(tmp, tag, fn, plan, extra, variants, arch=80):
    """{variant: main-loop mix} of the text variants {name: edits}."""
    return {name: _loop_count(_variant(tmp, f"{tag}{i}", edits), fn, plan, extra, arch)
            for i, (name, edits) in enumerate(variants.items())}


def _default(kernel, d, dtype, arch):
    """The kernel's default plan at the shared-memory limit of sm_80 (the A100's plan) or
    sm_90 (the H100's)."""
    sm = f"sm_{arch}"
    return tiling.plan(kernel, d, d, dtype, limit=tiling.EMULATOR_ARCHES[sm], limit_source=sm)


def forward(tmp, kernel, dtype, d, arch=80):
    fn = "flash_fwd_tc.cu"
    plan = _default(kernel, d, dtype, arch)
    interior = {"CUFLASH_FWD_INTERIOR_ONLY": 1}
    masks = dict(interior, CUFLASH_MASKS=None)
    band = "if (k0 < lo_last || k0 + kBc > hi_first || mask_rows) {"
    any_term = "} else if (p.mask_softcap > 0 || p.mask_has_bias || p.mask_has_alibi) {"
    flags = ("    f.has_cap = p.mask_softcap > 0;\n    f.has_bias = p.mask_has_bias != 0;\n"
             "    f.has_alibi = p.mask_has_alibi != 0;\n")

    def only(cap=False, bias=False, alibi=False, drop=False, boundary=False):
        """The call's feature flags as constants (read and branched on per tile);
        the bias's keys contiguous; an interior tile, or with ``boundary`` the band test's."""
        b = lambda x: "true" if x else "false"  # noqa: E731
        return [(fn, band, "if (true) {" if boundary else "if (false) {"),
                (fn, any_term, f"}} else if ({b(cap or bias or alibi)}) {{"),
                (fn, flags, f"    f.has_cap = {b(cap)};\n    f.has_bias = {b(bias)};\n"
                            f"    f.has_alibi = {b(alibi)};\n"),
                (fn, "f.has_bias && f.bias_sc == 1;", "f.has_bias;"),
                (fn, "if (drop.on) tc_dropout(", f"if ({b(drop)}) tc_dropout(")]

    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap": only(cap=True), "dropout": only(drop=True),
                "boundary tile (band test)": only(boundary=True)}
    mixes = _count_variants(tmp, f"f{kernel}{dtype}{d}-{arch}-", fn, plan, masks, variants, arch)
    pplan = _default(kernel[:-len("_masked")], d, dtype, arch)
    plain = _loop_count(KERNELS_CU, fn, pplan, interior, arch)
    return Counted(plan, _fwd_logits(plan), 1, mixes, pplan, _fwd_logits(pplan), 1, plain)


def _fwd_logits(plan):
    return plan.block_q // (plan.threads // 32) * plan.block_kv // 32


_BWD_FLAGS = ("const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;\n"
              "                const bool has_alibi = p.mask_has_alibi != 0;\n"
              "                const int db_mode = p.mask_dbias;")


# the backward's Philox loop's pragma (its blocks per step)
_DROP_UNROLL = "#pragma unroll kUnrollDraw\n"
# the keep word's reset before the blocks are ORed in
_DROP_KEEP0 = "                    keep = 0;\n"


def bwd_feature_edits(cap=False, bias=False, alibi=False, db=0, drop=False, unroll=True):
    """Edits of flash_bwd_tc.cu that make a flash_bwd_tc_masked build count one call's
    interior tile: the call's feature flags as constants (the kernel reads them once per call
    and branches on them per tile, so each feature's code is what a call with it runs), the
    band test off, the bias and dbias on their contiguous-key paths, the dropout bit word
    from a parameter (``_opaque``).  ``unroll``: the rolled loops (S^T and dP^T over d / dv,
    the dropout's Philox blocks, dQ's k-steps) unrolled, so that the main loop's static count
    is one trip (else a counter weighs them by their trip counts)."""
    fn = "flash_bwd_tc.cu"
    b = lambda x: "true" if x else "false"  # noqa: E731
    return ([(fn, "#pragma unroll 1\n", "#pragma unroll\n")] if unroll else []) + [
        (fn, "const bool need_mask = kPlainRange ? (unsigned)(i - i_plain) >= (unsigned)n_plain\n"
             "                                                   : kv_rows < kBc ||",
         "const bool need_mask = false, band_crossed = kPlainRange ? (unsigned)(i - i_plain) >= "
         "(unsigned)n_plain\n                                                   : kv_rows < kBc ||"),
        (fn, "if (p.mask_bias_sc == 1 && !tile_edge) {", "if (true) {"),
        (fn, "const bool fast = p.mask_dbias_sc == 1 && !tile_edge;", "const bool fast = true;"),
        _opaque(fn, "unsigned long long keep = ~0ull;"),
        (fn, _BWD_FLAGS, f"const bool has_cap = {b(cap)}, has_bias = {b(bias)};\n"
                         f"                const bool has_alibi = {b(alibi)};\n"
                         f"                const int db_mode = {db};"),
        (fn, "                if (drop.on) {\n" + _DROP_KEEP0 + _DROP_UNROLL,
         f"                if ({b(drop)}) {{\n" + _DROP_KEEP0 + ("#pragma unroll\n" if unroll else _DROP_UNROLL)),
        (fn, "if (drop.on) {  // dP of the dropped product", f"if ({b(drop)}) {{  // dP of the dropped product"),
        (fn, "if (!kUnrolled || drop.on) pt_step(true);", f"if (!kUnrolled || {b(drop)}) pt_step(true);")]


def backward(tmp, dtype, d, arch=80):
    fn = "flash_bwd_tc.cu"
    plan = _default("flash_bwd_tc_masked", d, dtype, arch)
    extra = {"CUFLASH_MASKS": None, "CUFLASH_BWD_TC_MAIN": None}
    unroll = (fn, "#pragma unroll 1\n", "#pragma unroll\n")
    only = bwd_feature_edits
    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap (and its derivative)": only(cap=True), "dropout": only(drop=True),
                "bias + dbias (stored)": only(bias=True, db=1),
                "bias + dbias (atomic adds)": only(bias=True, db=2)}
    mixes = _count_variants(tmp, f"b{dtype}{d}-{arch}-", fn, plan, extra, variants, arch)
    pplan = _default("flash_bwd_tc", d, dtype, arch)
    plain_edits = [unroll, (fn, "const bool need_mask = kPlainRange ? (unsigned)(i - i_plain) >= (unsigned)n_plain\n"
                                "                                                   : kv_rows < kBc || q0 + kBr > Nq || "
                                "(causal && kv0 + kBc - 1 > q0 + off);",
                            "const bool need_mask = false;")]
    plain = _loop_count(_variant(tmp, f"bplain{dtype}{d}-{arch}", plain_edits), fn, pplan,
                        {"CUFLASH_BWD_TC_MAIN": None}, arch)
    return Counted(plan, *_bwd_logits(plan, True), mixes, pplan, *_bwd_logits(pplan, False), plain)


def _bwd_logits(plan, masked):
    """(logits per lane per trip, passes over the head dims) of a flash_bwd_tc plan."""
    _, mt, passes, qs = bwd_tc.bwd_tc_layout(plan.block_q, plan.block_kv, plan.d, plan.dv, masked)
    return mt * 16 * (plan.block_q // qs) // 32, passes


def backward_tf32(tmp, d):
    """flash_bwd_tf32_masked (float32): the features per element behind uniform branches."""
    fn = "flash_bwd_tf32.cu"
    plan = _default("flash_bwd_tf32_masked", d, "float32", 80)
    extra = {"CUFLASH_MASKS": None}
    unroll = (fn, "#pragma unroll 1\n", "#pragma unroll\n")
    interior = [unroll, (fn, "const bool need_mask = kv_rows < kBc ||",
                         "const bool need_mask = false, band_crossed = kv_rows < kBc ||"),
                _opaque(fn, "unsigned long long keep = ~0ull;")]
    flags = ("const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;\n"
             "            const bool has_alibi = p.mask_has_alibi != 0;\n")

    def only(cap=False, bias=False, alibi=False, db=0, drop=False):
        b = lambda x: "true" if x else "false"  # noqa: E731
        # an interior tile, the bias and dbias with contiguous keys (their row-pointer loops
        # where the call has no softcap)
        return interior + [(fn, flags, f"const bool has_cap = {b(cap)}, has_bias = {b(bias)};\n"
                                       f"            const bool has_alibi = {b(alibi)};\n"),
                           (fn, "const bool tile_in = kv_rows == kBc && rows_q == kBr;",
                            "const bool tile_in = true;"),
                           (fn, "tile_in && p.mask_bias_sc == 1;", "tile_in;"),
                           (fn, "p.mask_dbias != 0 && !has_cap && tile_in &&\n"
                                "                                p.mask_dbias_sc == 1 ? 0 : p.mask_dbias;",
                            f"{db} != 0 && !has_cap && tile_in ? 0 : {db};"),
                           (fn, "if (kRowPaths && p.mask_dbias != 0 && db_mode == 0) {",
                            f"if (kRowPaths && {db} != 0 && db_mode == 0) {{"),
                           (fn, "if (p.mask_dbias == 1) dbias_loop(false);", f"if ({db} == 1) dbias_loop(false);"),
                           (fn, "        if (drop.on) {\n", f"        if ({b(drop)}) {{\n"),
                           (fn, "float ds = pv * (drop.on ?", f"float ds = pv * ({b(drop)} ?")]

    variants = {"none": only(), "bias": only(bias=True), "alibi": only(alibi=True),
                "softcap (and its derivative)": only(cap=True), "dropout": only(drop=True),
                "bias + dbias (stored)": only(bias=True, db=1)}
    mixes = _count_variants(tmp, "t", fn, plan, extra, variants)
    pplan = _default("flash_bwd_tf32", d, "float32", 80)
    plain_edits = [unroll, (fn, "const bool mask = kv0 + kBc > Nk || q0 + kBr > Nq || (causal && kv0 + kBc - 1 > q0 + off);",
                            "const bool mask = false;")]
    plain = _loop_count(_variant(tmp, "tplain", plain_edits), fn, pplan, {})
    return Counted(plan, 16 * plan.block_q // 32, 1, mixes, pplan, 16 * pplan.block_q // 32, 1, plain)


class Counted(NamedTuple):
    """One kernel's counts: the masked plan and its variants, the plain kernel's default plan."""
    plan: object
    logits: int        # logits one lane handles per main-loop trip
    passes: int        # trips per logit (the backward's passes over the head dims)
    mixes: dict        # variant -> main-loop mix (_sass.mix: per class and "total")
    pplan: object
    plogits: int
    ppasses: int
    plain: dict        # the plain kernel's main-loop mix

    @property
    def rows(self):
        return {name: m["total"] for name, m in self.mixes.items()}

    @property
    def hmma(self):
        return self.mixes["none"]["HMMA"]

    def per_logit(self, name, what="total"):
        return self.mixes[name][what] * self.passes / self.logits

    def plain_per_logit(self, what="total"):
        return self.plain[what] * self.ppasses / self.plogits


def _tiles(plan):
    return f"{plan.block_q} x {plan.block_kv}, {plan.threads} threads"


def main():
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    ok, why = _sass.is_available()
    if not ok:
        print(f"cuobjdump not available: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = [forward(tmp, "flash_fwd_tc_masked", "float16", 128),
                   forward(tmp, "flash_fwd_tc_masked", "float16", 64),
                   forward(tmp, "flash_fwd_tf32_masked", "float32", 64),
                   backward(tmp, "float16", 128),
                   backward(tmp, "float16", 64),
                   backward_tf32(tmp, 64)]
        h100 = [forward(tmp, "flash_fwd_tc_masked", "float16", 64, arch=90),
                backward(tmp, "float16", 64, arch=90),
                forward(tmp, "flash_fwd_tc_masked", "float16", 128, arch=90),
                backward(tmp, "float16", 128, arch=90)]
    print("| kernel | plan | logits / lane / trip (passes) | variant | main-loop instructions | "
          "per logit | added per logit | vs plain kernel |")
    print("|---|---|---|---|---|---|---|---|")
    for c in results:
        p0 = c.plain_per_logit()
        print(f"| {c.pplan.kernel} {c.pplan.dtype} d={c.pplan.d} | {_tiles(c.pplan)} | {c.plogits}"
              f"{f' ({c.ppasses})' if c.ppasses > 1 else ''} | plain kernel, its default tiles (a call "
              f"without features) | {c.plain['total']} (HMMA {c.plain['HMMA']}) | {p0:.1f} | | |")
        n0 = c.per_logit("none")
        for i, name in enumerate(c.rows):
            n = c.per_logit(name)
            first = (f"{c.plan.kernel} {c.plan.dtype} d={c.plan.d} | {_tiles(c.plan)} | {c.logits}"
                     f"{f' ({c.passes})' if c.passes > 1 else ''}") if i == 0 else " | | "
            shown = f"{c.rows[name]} (HMMA {c.hmma})" if name == "none" else f"{c.rows[name]}"
            added = "" if name == "none" else f"{n - n0:+.1f}"
            print(f"| {first} | {name} | {shown} | {n:.1f} | {added} | {100 * (n - p0) / p0:+.0f}% |")
    print()
    both(results[1], results[4], "float16 d=64")
    both(results[0], results[3], "float16 d=128")
    both(results[2], results[5], "float32 (3xTF32) d=64")
    print("On the H100 (sm_90 SASS; the default plans at sm_90's shared-memory limit): float16 d=64, forward "
          f"{_tiles(h100[0].plan)} (plain {_tiles(h100[0].pplan)}), backward {_tiles(h100[1].plan)} "
          f"(plain {_tiles(h100[1].pplan)}).")
    print()
    both(h100[0], h100[1], "float16 d=64, sm_90")
    print(f"float16 d=128 on the same terms: forward {_tiles(h100[2].plan)} (plain "
          f"{_tiles(h100[2].pplan)}), backward {_tiles(h100[3].plan)} (plain {_tiles(h100[3].pplan)}).")
    print()
    both(h100[2], h100[3], "float16 d=128, sm_90")
    print(PIPE_MODEL_TEXT)
    print()
    pipes(h100[0], h100[1], "float16 d=64, sm_90")
    pipes(h100[2], h100[3], "float16 d=128, sm_90")
    return 0


# The pipe model of the H100 (an estimate from published rates, not a measurement): per SM
# sub-partition (4 per SM), per clock, one warp instruction issues; the MUFU unit finishes 4
# lanes (16 per SM: the CUDA C Programming Guide's throughput table for exp2 / rcp at compute
# capability 8.0 and 9.0; FlashAttention-3's "3.9 TFLOPS of special functions" on an H100
# SXM5 is the same rate), so a warp's MUFU occupies it 8 clocks; mma.sync m16n8k16 runs at
# ~0.6 per clock per SM (FA2's forward, 287-327 TFLOP/s with the tensor pipe active 48-56%
# in its H100 profile of 2026-11-23, puts the pipe's full rate at 0.57-0.65), 4 / 0.6 clocks
# of a sub-partition each.
MUFU_CLOCKS = 8.0
HMMA_CLOCKS = 4 / 0.6
# to turn clocks into TFLOP/s for the plain forward (issue 9): the H100 SXM5 of the baseline,
# 132 SMs, at an assumed sustained 1.755 GHz under tensor load (its boost is 1.98 GHz)
H100_SMS, H100_GHZ = 132, 1.755
PIPE_MODEL_TEXT = (
    "**In time, by a pipe model (published rates, no measurement).**  Per SM sub-partition and "
    "per 32 logits (one logit per lane), a kernel needs: issue = its instructions (one warp "
    f"instruction per clock); MUFU = {MUFU_CLOCKS:.0f} clocks per MUFU (16 lanes per clock per "
    "SM, the Programming Guide's rate for exp2 and rcp at compute capability 8.0 / 9.0); tensor "
    f"= {HMMA_CLOCKS:.2f} clocks per HMMA.16816 (0.6 per clock per SM, from FA2's measured "
    "rate and tensor-pipe activity in gpu-baseline.md).  Its time lies between the busiest of "
    "the three (perfect overlap) and max(issue, MUFU) + tensor (the tensor pipe overlapping "
    "nothing).  Other pipes (the integer ALU and IMAD at half rate, shared memory) and latency "
    "are left out, which flatters the integer-heavy dropout most.  The sixth session's model "
    "had issue and tensor only: it missed that softcap's two extra MUFU per logit (exp2 and "
    "rcp of its tanh) make the forward MUFU-bound.")


def _clocks(counted, name=None):
    """(issue, MUFU, tensor) clocks per 32 logits of a variant (None: the plain kernel)."""
    get = counted.plain_per_logit if name is None else (lambda w: counted.per_logit(name, w))
    return get("total"), MUFU_CLOCKS * get("MUFU"), HMMA_CLOCKS * get("HMMA")


def _bounds(clk):
    """(perfect overlap, tensor pipe overlapping nothing) of one kernel's (issue, MUFU, tensor)."""
    issue, mufu, tensor = clk
    return max(issue, mufu, tensor), max(issue, mufu) + tensor


def _together(fclk, bclk):
    """Both bounds of a forward + backward."""
    return tuple(f + b for f, b in zip(_bounds(fclk), _bounds(bclk)))


def pipes(fwd, bwd, what):
    """The pipe model's forward + backward time of each feature against the plain calls."""
    f0, b0 = _clocks(fwd), _clocks(bwd)
    lo0, hi0 = _together(f0, b0)
    fmt = lambda c: "/".join(f"{x:.1f}" for x in c)  # noqa: E731
    flop = 2 * (fwd.pplan.d + fwd.pplan.dv)   # the forward's FLOPs per logit
    tflops = [4 * 32 / c * flop * H100_SMS * H100_GHZ * 1e9 / 1e12 for c in _bounds(f0)]
    print(f"Pipe model, {what}: clocks per 32 logits as issue / MUFU / tensor; the plain calls: "
          f"forward {fmt(f0)}, backward {fmt(b0)}, together {lo0:.1f} .. {hi0:.1f}.  The plain "
          f"forward alone, non-causal with long rows: {tflops[1]:.0f} .. {tflops[0]:.0f} TFLOP/s "
          f"({H100_SMS} SMs at {H100_GHZ} GHz; FA2 measured 287-291 at d=64, 322-327 at d=128).")
    print()
    print("| feature | forward issue / MUFU / tensor | backward issue / MUFU / tensor | "
          "together (overlap .. none) | vs the plain calls |")
    print("|---|---|---|---|---|")
    for name, (fk, bk) in {"masked, no feature": ("none", "none"), **FEATURES}.items():
        fc, bc = _clocks(fwd, fk), _clocks(bwd, bk)
        lo, hi = _together(fc, bc)
        print(f"| {name} | {fmt(fc)} | {fmt(bc)} | {lo:.1f} .. {hi:.1f} | "
              f"{100 * (lo - lo0) / lo0:+.0f}% .. {100 * (hi - hi0) / hi0:+.0f}% |")
    print()


# a call's feature -> (its forward variant, its backward variant)
FEATURES = {"bias": ("bias", "bias"), "bias + dbias (stored)": ("bias", "bias + dbias (stored)"),
            "ALiBi": ("alibi", "alibi"), "softcap": ("softcap", "softcap (and its derivative)"),
            "dropout": ("dropout", "dropout")}


def both(fwd, bwd, what):
    """The issue's measure: the forward + backward of a call with one feature against the same
    call without it (the plain kernels at their default tiles), in issue slots per logit."""
    f0, b0 = fwd.plain_per_logit(), bwd.plain_per_logit()
    fm, bm = fwd.per_logit("none"), bwd.per_logit("none")
    print(f"Forward + backward, {what}, per logit: {f0:.1f} + {b0:.1f} = {f0 + b0:.1f} instructions "
          f"without features (plain kernels); the masked kernels with no feature on: {fm:.1f} + "
          f"{bm:.1f} = {fm + bm:.1f} ({100 * (fm + bm - f0 - b0) / (f0 + b0):+.0f}%).")
    print()
    print("| feature | forward | backward | together | vs forward + backward without it |")
    print("|---|---|---|---|---|")
    for name, (fk, bk) in FEATURES.items():
        fa, ba = fwd.per_logit(fk), bwd.per_logit(bk)
        print(f"| {name} | {fa:.1f} | {ba:.1f} | {fa + ba:.1f} | {100 * (fa + ba - f0 - b0) / (f0 + b0):+.0f}% |")
    print()


if __name__ == "__main__":
    sys.exit(main())

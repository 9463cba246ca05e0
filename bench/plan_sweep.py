"""Compile every tile plan the planner accepts, on every architecture, and check that none spills.

Issue 12: a tile pair the library accepts must not fall off a register cliff (the H100 tile
sweep measured 10-270x slowdowns for some accepted plans).  For each kernel family below and
each supported architecture, every (dtype, head dims, block_q, block_kv) that
``cuflash.tiling.plan`` accepts at that architecture's shared-memory limit is compiled with
NVRTC (``--ptxas-options=-v``) and its registers, spill stores/loads and stack frame are read
from ptxas' report.  No GPU needed; ~1-4 s per compile.

``--write`` stores the rows of the swept families in ``bench/results/plan_sweep.json``, each
with a hash of its kernel source and the headers it includes, as the family compiles them
(conditionals on the families' own defines resolved: ``source_hash``); ``tests/test_plan_sweep.py``
(CI) re-enumerates the accepted plans of every recorded family and fails when one is missing
from that file, spills there, or its sources changed since (rerun this script then).
``tests/test_tc_plans.py`` compiles the largest plans live on every CI run.

A plan that spills is refused by the planner with the reason (the refusal sets of
``cuflash.tiling``, among them ``_asym_spills.py`` for the d != dv defaults); ``--missing``
then compiles the plans those refusals made accepted (a default moves to the next preferred
pair), and ``--lift-refusals`` sweeps with the refusal sets emptied, to derive them anew.
The SIMT kernels' refusals (tiling.SIMT_FWD_FLOAT64_SPILLS, tiling.SIMT_BWD_SPILLS) are compiled
by every ``--write`` / ``--missing`` of their families and kept in the record (their spills
are the refusals' evidence, not failures; one that compiles clean is printed).

Usage::

    python bench/plan_sweep.py                      # every family and architecture, summary
    python bench/plan_sweep.py --write              # ... and store bench/results/plan_sweep.json
    python bench/plan_sweep.py --families flash_fwd_tc --arch 90
    python bench/plan_sweep.py --families flash_bwd_tc_asym --missing   # add the unswept plans
    python bench/plan_sweep.py --families flash_bwd_tc_masked --lift-refusals --json rows.json
    python bench/plan_sweep.py --bwd-tc-edge        # flash_bwd_tc d != dv near its budget
"""
import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, kernels, tiling  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "plan_sweep.json"
ARCHS = (75, 80, 90)
# sm_86 and sm_89 (99 KB of shared memory per block) run sm_80's register file and
# instruction set: their plans are compiled for sm_80 (COMPILED_FOR), together with sm_80's.
COMPILED_FOR = {75: 75, 80: 80, 86: 80, 89: 80, 90: 90}
TC_DIMS = tuple(range(16, 257, 16))
# The SIMT kernels (flash_fwd.cu, flash_bwd.cu) are compiled per head-dim class
# (tiling.simt_head_dim_class), so their families hold every pair of classes: each tile pair
# where d == dv and at tiling.SIMT_ASYM_SWEPT, the default plan at the other 88 (the planner
# takes no other there).
SIMT_CLASS_DIMS = tuple((d, dv) for d in tiling.SIMT_HEAD_DIM_CLASSES
                        for dv in tiling.SIMT_HEAD_DIM_CLASSES)
# Tensor-core kernels with d != dv: every pair of multiples of 16.  The planner accepts every
# tile pair at tiling.TC_ASYM_SWEPT and only the default plan at the others (every tile pair
# of every pair would be ~48,000 compiles), so these families hold ~6,000 plans.
TC_ASYM_DIMS = tuple((d, dv) for d in TC_DIMS for dv in TC_DIMS if d != dv)
ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")

# family -> (source file, planned kernel, kernels checked in the module, dtypes, head dims,
#            extra defines, architectures: None = every one)
FAMILIES = {
    "flash_fwd": ("flash_fwd.cu", "flash_fwd", ("flash_fwd",), ALL_DTYPES, SIMT_CLASS_DIMS, {}, None),
    "flash_fwd_serving": ("flash_fwd.cu", "flash_fwd", ("flash_fwd_serving",), ALL_DTYPES,
                          SIMT_CLASS_DIMS, {"CUFLASH_FWD_SERVING": None}, None),
    "flash_fwd_tc": ("flash_fwd_tc.cu", "flash_fwd_tc", ("flash_fwd_tc",), ("float16", "bfloat16"),
                     tuple((d, d) for d in TC_DIMS), {}, (80, 86, 89, 90)),
    "flash_fwd_tf32": ("flash_fwd_tc.cu", "flash_fwd_tf32", ("flash_fwd_tf32",), ("float32",),
                       tuple((d, d) for d in TC_DIMS), {}, (80, 86, 89, 90)),
    "flash_bwd": ("flash_bwd.cu", "flash_bwd_dkdv", ("flash_bwd_dkdv", "flash_bwd_dq"), ALL_DTYPES,
                  SIMT_CLASS_DIMS, {}, None),
    "flash_bwd_tc": ("flash_bwd_tc.cu", "flash_bwd_tc", ("flash_bwd_tc",), ("float16", "bfloat16"),
                     tuple((d, d) for d in TC_DIMS), {"CUFLASH_BWD_TC_MAIN": None}, (80, 86, 89, 90)),
    "flash_bwd_tf32": ("flash_bwd_tf32.cu", "flash_bwd_tf32", ("flash_bwd_tf32",), ("float32",),
                       tuple((d, d) for d in TC_DIMS), {}, (80, 86, 89, 90)),
    # d != dv on the tensor-core kernels (TC_ASYM_DIMS)
    "flash_fwd_tc_asym": ("flash_fwd_tc.cu", "flash_fwd_tc", ("flash_fwd_tc",), ("float16", "bfloat16"),
                          TC_ASYM_DIMS, {}, (80, 86, 89, 90)),
    "flash_fwd_tf32_asym": ("flash_fwd_tc.cu", "flash_fwd_tf32", ("flash_fwd_tf32",), ("float32",),
                            TC_ASYM_DIMS, {}, (80, 86, 89, 90)),
    "flash_bwd_tc_asym": ("flash_bwd_tc.cu", "flash_bwd_tc", ("flash_bwd_tc",), ("float16", "bfloat16"),
                          TC_ASYM_DIMS, {"CUFLASH_BWD_TC_MAIN": None}, (80, 86, 89, 90)),
    "flash_bwd_tf32_asym": ("flash_bwd_tf32.cu", "flash_bwd_tf32", ("flash_bwd_tf32",), ("float32",),
                            TC_ASYM_DIMS, {}, (80, 86, 89, 90)),
    # the logit features (bias, window, ALiBi, softcap, dropout: -DCUFLASH_MASKS) build their
    # own kernels from the same sources, planned as flash_fwd_masked (flash_fwd's tiles with a
    # float64 register cap) and the backward's kernels (cuflash/_launch_masks.py)
    "flash_fwd_masked": ("flash_fwd.cu", "flash_fwd_masked", ("flash_fwd_masked",), ALL_DTYPES, SIMT_CLASS_DIMS,
                         {"CUFLASH_MASKS": None}, None),
    "flash_fwd_serving_masked": ("flash_fwd.cu", "flash_fwd_masked", ("flash_fwd_serving_masked",),
                                 ALL_DTYPES, SIMT_CLASS_DIMS,
                                 {"CUFLASH_FWD_SERVING": None, "CUFLASH_MASKS": None}, None),
    "flash_bwd_masked": ("flash_bwd.cu", "flash_bwd_dkdv_masked", ("flash_bwd_dkdv_masked",
                                                            "flash_bwd_dq_masked"),
                         ALL_DTYPES, SIMT_CLASS_DIMS, {"CUFLASH_MASKS": None}, None),
    # ... on the tensor-core backward (flash_bwd_tc.cu with -DCUFLASH_MASKS, main kernel)
    "flash_bwd_tc_masked": ("flash_bwd_tc.cu", "flash_bwd_tc_masked", ("flash_bwd_tc_masked",),
                            ("float16", "bfloat16"), tuple((d, d) for d in TC_DIMS),
                            {"CUFLASH_BWD_TC_MAIN": None, "CUFLASH_MASKS": None}, (80, 86, 89, 90)),
    "flash_bwd_tc_masked_asym": ("flash_bwd_tc.cu", "flash_bwd_tc_masked", ("flash_bwd_tc_masked",),
                                 ("float16", "bfloat16"), TC_ASYM_DIMS,
                                 {"CUFLASH_BWD_TC_MAIN": None, "CUFLASH_MASKS": None},
                                 (80, 86, 89, 90)),
    # ... on float32's tensor-core backward (flash_bwd_tf32.cu with -DCUFLASH_MASKS)
    "flash_bwd_tf32_masked": ("flash_bwd_tf32.cu", "flash_bwd_tf32_masked", ("flash_bwd_tf32_masked",),
                              ("float32",), tuple((d, d) for d in TC_DIMS), {"CUFLASH_MASKS": None},
                              (80, 86, 89, 90)),
    "flash_bwd_tf32_masked_asym": ("flash_bwd_tf32.cu", "flash_bwd_tf32_masked",
                                   ("flash_bwd_tf32_masked",), ("float32",), TC_ASYM_DIMS,
                                   {"CUFLASH_MASKS": None}, (80, 86, 89, 90)),
    # ... and on the tensor-core forward (flash_fwd_tc.cu with -DCUFLASH_MASKS)
    "flash_fwd_tc_masked": ("flash_fwd_tc.cu", "flash_fwd_tc_masked", ("flash_fwd_tc_masked",),
                            ("float16", "bfloat16"), tuple((d, d) for d in TC_DIMS),
                            {"CUFLASH_MASKS": None}, (80, 86, 89, 90)),
    "flash_fwd_tf32_masked": ("flash_fwd_tc.cu", "flash_fwd_tf32_masked", ("flash_fwd_tf32_masked",),
                              ("float32",), tuple((d, d) for d in TC_DIMS),
                              {"CUFLASH_MASKS": None}, (80, 86, 89, 90)),
    "flash_fwd_tc_masked_asym": ("flash_fwd_tc.cu", "flash_fwd_tc_masked", ("flash_fwd_tc_masked",),
                                 ("float16", "bfloat16"), TC_ASYM_DIMS, {"CUFLASH_MASKS": None},
                                 (80, 86, 89, 90)),
    "flash_fwd_tf32_masked_asym": ("flash_fwd_tc.cu", "flash_fwd_tf32_masked",
                                   ("flash_fwd_tf32_masked",), ("float32",), TC_ASYM_DIMS,
                                   {"CUFLASH_MASKS": None}, (80, 86, 89, 90)),
}


# The -D names that select code regions of a family (FAMILIES' extra defines).  The hash of a
# family resolves #if / #ifdef on these names, so an edit inside a region that the family
# does not compile (e.g. -DCUFLASH_MASKS code, for the plain kernels) does not invalidate its
# sweep.  Every other conditional is hashed as it stands, both branches (conservative).
# CUFLASH_BWD_TC_HELPERS (flash_bwd_tc.cu's helper-kernel build) is one no sweep compile sets.
REGION_DEFINES = frozenset(k for f in FAMILIES.values() for k in f[5]) | {"CUFLASH_BWD_TC_HELPERS"}
_DIRECTIVE = re.compile(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif|define|undef)\b(.*)")
_TERM = re.compile(r"(!?)\s*defined\s*(?:\(\s*(\w+)\s*\)|(\w+))")


class _Unresolvable(Exception):
    """A file the region resolver cannot follow: hash it whole."""


def _condition(kind, expr, defined):
    """True / False for a condition over REGION_DEFINES only (terms joined by &&), else None."""
    expr = expr.split("//")[0].strip()
    if kind in ("ifdef", "ifndef"):
        if expr not in REGION_DEFINES:
            return None
        return (expr in defined) == (kind == "ifdef")
    val = True
    for term in expr.split("&&"):
        m = _TERM.fullmatch(term.strip())
        if m is None or (m[2] or m[3]) not in REGION_DEFINES:
            return None
        val = val and (((m[2] or m[3]) in defined) != bool(m[1]))
    return val


_LEXEMES = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def strip_comments(text):
    """``text`` without its // and /* */ comments (string and character literals kept whole),
    trailing blanks and blank lines: a comment edit compiles to the same kernel."""
    text = _LEXEMES.sub(lambda m: m[0] if m[0][0] in "\"'" else
                        ("\n" * m[0].count("\n") or " "), text)
    return "\n".join(ln.rstrip() for ln in text.splitlines() if ln.strip())


def resolve_regions(text, defined):
    """``text`` with the conditionals over REGION_DEFINES resolved for the names in ``defined``
    (their directive lines and untaken branches dropped); every other line kept as it stands."""
    out, stack = [], []   # stack: None (kept verbatim) or [taking, taken_before]
    active = lambda: all(f is None or f[0] for f in stack)  # noqa: E731
    for line in text.splitlines():
        m = _DIRECTIVE.match(line)
        kind = m[1] if m else None
        if kind in ("define", "undef") and m[2].split() and m[2].split()[0] in REGION_DEFINES:
            raise _Unresolvable(line)
        if kind in ("ifdef", "ifndef", "if"):
            outer = active()
            val = _condition(kind, m[2], defined)
            if val is None:
                stack.append(None)
                if outer:
                    out.append(line)
            else:
                stack.append([val, val])
            continue
        if kind in ("elif", "else", "endif") and stack and stack[-1] is not None:
            frame = stack[-1]
            if kind == "endif":
                stack.pop()
            elif kind == "else":
                frame[0], frame[1] = not frame[1], True
            else:
                val = _condition("if", m[2], defined)
                if val is None:
                    raise _Unresolvable(line)
                frame[0] = val and not frame[1]
                frame[1] = frame[1] or val
            continue
        if kind == "endif" and stack:
            stack.pop()
        if active():
            out.append(line)
    return "\n".join(out)


def source_hash(fname, defines=(), kdir=None):
    """sha256 of a kernel file and every kernels_cu header it includes (recursively), as
    compiled with the -D names ``defines``: comments dropped, conditionals over REGION_DEFINES
    resolved (only the code such a build can see counts), all else as written.  A file the resolver cannot follow
    (one that #defines a region name, an #elif it cannot evaluate) is hashed whole.
    ``kdir``: another copy of kernels_cu (bench/plan_sweep_rehash.py), default this one."""
    kdir = Path(kdir) if kdir is not None else ROOT / "kernels_cu"
    defined = frozenset(defines)
    seen, todo, h = set(), [fname], hashlib.sha256()
    while todo:
        f = todo.pop(0)
        if f in seen or not (kdir / f).exists():
            continue
        seen.add(f)
        text = strip_comments((kdir / f).read_text())
        try:
            text = resolve_regions(text, defined)
        except _Unresolvable:
            pass
        h.update(f.encode() + b"\0" + text.encode())
        todo += re.findall(r'#include\s+"([^"]+)"', text)
    return h.hexdigest()


def family_hash(family, kdir=None):
    """source_hash of a family's kernel file under the family's region defines."""
    return source_hash(FAMILIES[family][0], FAMILIES[family][5], kdir)


def accepted_plans(family, arch):
    """Every plan of ``family`` that cuflash.tiling accepts at ``arch``'s shared-memory limit
    (``arch`` 80: at sm_80's, sm_86's or sm_89's -- those are compiled for sm_80)."""
    if arch in COMPILED_FOR.values():
        seen = {}
        for a, c in COMPILED_FOR.items():
            if c == arch:
                for p in _accepted_at(family, a):
                    seen.setdefault((p.dtype, p.d, p.dv, p.block_q, p.block_kv), p)
        return list(seen.values())
    return _accepted_at(family, arch)


def _accepted_at(family, arch):
    fname, kernel, _, dtypes, dims, _, archs = FAMILIES[family]
    if archs is not None and arch not in archs:
        return []
    limit = tiling.EMULATOR_ARCHES[f"sm_{arch}"]
    t = tiling.kernel_tiling(kernel)
    out = []
    for dt in dtypes:
        for d, dv in dims:
            for bq in t.block_q_choices:
                for bkv in t.block_kv_choices:
                    try:
                        out.append(tiling.plan(kernel, d, dv, dt, bq, bkv, limit=limit,
                                               limit_source=f"sm_{arch}"))
                    except ValueError:
                        pass
    return out


def _refusal_sets(family):
    """(module, attribute, key) of the SIMT refusal set that holds ``family``'s spilling plans,
    and a function entry -> (dtypes, block_q, block_kv, d class, dv class); None for others."""
    from cuflash.tiling import bwd, fwd
    kernel = FAMILIES[family][1]
    if kernel in fwd.SIMT_FWD_FLOAT64_SPILLS:   # (block_q, block_kv, d, dv), float64
        return fwd, "SIMT_FWD_FLOAT64_SPILLS", kernel, lambda e: (("float64",), *e)
    if family in bwd.SIMT_BWD_SPILLS:           # (accumulator bytes, block_q, block_kv, d, dv)
        return bwd, "SIMT_BWD_SPILLS", family, lambda e: (
            ("float64",) if e[0] == 8 else ("float16", "bfloat16", "float32"), *e[1:])
    return None


def refused_spill_plans(family, arch):
    """The plans of a SIMT family that its ptxas refusal set (tiling.SIMT_FWD_FLOAT64_SPILLS,
    tiling.SIMT_BWD_SPILLS) refuses at ``arch`` (grouped as accepted_plans), each as the
    planner takes it with that one entry lifted (an entry can be a default only once the
    entries before it refuse theirs).  --write and --missing compile them too and keep their
    rows: the refusals stand on them (tests/test_head_dim_classes.py checks each set against
    the record's spilling rows).  Returns [(entry, plan)]."""
    found = _refusal_sets(family)
    if found is None:
        return []
    mod, attr, key, unpack = found
    refused = getattr(mod, attr)[key]
    out = {}
    try:
        for entry in sorted(refused):
            dtypes, bq, bkv, d, dv = unpack(entry)
            setattr(mod, attr, dict(getattr(mod, attr), **{key: refused - {entry}}))
            for a, c in COMPILED_FOR.items():
                if c != arch or (FAMILIES[family][6] is not None and a not in FAMILIES[family][6]):
                    continue
                for dt in dtypes:
                    try:
                        p = tiling.plan(FAMILIES[family][1], d, dv, dt, bq, bkv,
                                        limit=tiling.EMULATOR_ARCHES[f"sm_{a}"],
                                        limit_source=f"sm_{a}")
                    except ValueError:
                        continue
                    out.setdefault((entry, dt), (entry, p))
    finally:
        setattr(mod, attr, dict(getattr(mod, attr), **{key: refused}))
    return list(out.values())


# flash_bwd_tc with d != dv near its register budget (cuflash/tiling/_bwd_tc_spills.py): every
# float16 plan of the pairs outside TC_ASYM_DIMS whose register arrays are within EDGE_SLACK
# floats of the budget, as the planner accepted them before the spills found here were refused.
EDGE_RESULTS = ROOT / "bench" / "results" / "bwd_tc_edge_sweep.json"
EDGE_SLACK = 16


def bwd_tc_edge_plans():
    """[(plan, compiled arch)] of the flash_bwd_tc edge sweep.

    Call :func:`forget_edge_spills` first to enumerate the plans that sweep refused since.
    """
    from cuflash.tiling import bwd_tc
    jobs = {}
    for arch in (80, 86, 89, 90):
        limit = tiling.EMULATOR_ARCHES[f"sm_{arch}"]
        for d in TC_DIMS:
            for dv in TC_DIMS:
                if d == dv or (d, dv) in tiling.TC_ASYM_SWEPT:
                    continue
                for bq in tiling.BWD_TC_TILE_CHOICES:
                    for bkv in tiling.BWD_TC_TILE_CHOICES:
                        try:
                            p = tiling.plan("flash_bwd_tc", d, dv, "float16", bq, bkv, limit=limit,
                                            limit_source=f"sm_{arch}")
                        except ValueError:
                            continue
                        _, mt, passes, qs = bwd_tc.bwd_tc_layout(bq, bkv, d, dv)
                        slack = bwd_tc._bwd_tc_budget(passes) - bwd_tc._bwd_tc_arrays(
                            bq, d, dv, mt, passes, qs)
                        if slack <= EDGE_SLACK:
                            jobs.setdefault((COMPILED_FOR[arch], d, dv, bq, bkv), p)
    return [(p, key[0]) for key, p in sorted(jobs.items())]


def forget_edge_spills():
    """Let this process's planner accept the plans the edge sweep refused (to sweep them again),
    and every tile pair of flash_bwd_tc at d != dv (the sweep predates the default-only rule
    of tiling.TC_ASYM_SWEPT)."""
    import dataclasses
    from cuflash.tiling import bwd_tc
    bwd_tc.BWD_TC_PTXAS_SPILLS = bwd_tc.BWD_TC_PTXAS_SPILLS - bwd_tc.BWD_TC_EDGE_SPILLS
    tiling.register(dataclasses.replace(tiling.kernel_tiling("flash_bwd_tc"), asym_swept=None))


def lift_refusals():
    """Let this process's planner accept the plans refused because ptxas spilled them (the
    refusal sets of cuflash.tiling), to compile them again and re-derive those sets."""
    from cuflash.tiling import bwd, bwd_tc, core, fwd
    core.ASYM_DEFAULT_SPILLS = {}
    core.ARCH_SPILLS = {}
    bwd_tc.BWD_TC_PTXAS_SPILLS = frozenset()
    bwd_tc.BWD_TC_MASKED_PTXAS_SPILLS = frozenset()
    bwd.BWD_TF32_MASKED_PTXAS_SPILLS = frozenset()
    fwd.TC_MASKED_PTXAS_SPILLS = {k: frozenset() for k in fwd.TC_MASKED_PTXAS_SPILLS}
    fwd.SIMT_FWD_FLOAT64_SPILLS = {k: frozenset() for k in fwd.SIMT_FWD_FLOAT64_SPILLS}
    bwd.SIMT_BWD_SPILLS = {k: frozenset() for k in bwd.SIMT_BWD_SPILLS}


def plan_key(family, plan, arch):
    """The record's key of a plan: what is compiled (its head dims are the compiled ones,
    ``kd``/``kdv``: the class of d and dv on the SIMT kernels)."""
    return f"{family} {plan.dtype} d={plan.kd} dv={plan.kdv} {plan.block_q}x{plan.block_kv} sm_{arch}"


def compile_family_plan(family, plan, arch, kdir=None, more=None):
    """NVRTC's CompileResult of one plan of ``family`` for ``sm_{arch}`` (ptxas -v log),
    from ``kdir`` (a kernels_cu directory; default this one's), with the defines ``more``
    ({name: value or None}) added."""
    kdir = Path(kdir) if kdir is not None else ROOT / "kernels_cu"
    fname, extra = FAMILIES[family][0], FAMILIES[family][5]
    defines = dict(kernels.plan_defines(plan), **extra, **(more or {}))
    opts = (f"-arch=sm_{arch}", "--ptxas-options=-v", f"-I{kdir}",
            *[o for o in kernels.build_options(defines) if not o.startswith("-I")])
    return _nvrtc.compile((kdir / fname).read_text(), fname, opts)


def compile_plan(job):
    """(family, plan, arch) -> row: registers, spill bytes, stack frame per checked kernel."""
    family, plan, arch = job
    checked = FAMILIES[family][2]
    t0 = time.perf_counter()
    row = dict(key=plan_key(family, plan, arch), family=family, dtype=plan.dtype, d=plan.kd,
               dv=plan.kdv, block_q=plan.block_q, block_kv=plan.block_kv, threads=plan.threads,
               shared_bytes=plan.shared_bytes, arch=arch)
    try:
        res = compile_family_plan(family, plan, arch)
    except _nvrtc.NVRTCError as e:
        row["error"] = e.log[-2000:]
        return row
    info = _nvrtc.parse_ptxas_info(res.log)
    row["kernels"] = {k: {f: info[k][f] for f in ("registers", "spill_stores", "spill_loads",
                                                  "stack_frame")} for k in checked}
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def bad(row):
    """Why a row fails the rule (compile error, spills, a stack frame), or None."""
    if "error" in row:
        return "compile error"
    for k, f in row["kernels"].items():
        if f["spill_stores"] or f["spill_loads"] or f["stack_frame"]:
            return (f"{k}: spills {f['spill_stores']}/{f['spill_loads']} B, stack "
                    f"{f['stack_frame']} B")
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--json", help="write every row to this file")
    ap.add_argument("--write", action="store_true",
                    help=f"store the rows and source hashes in {RESULTS.relative_to(ROOT)} "
                         "(needs the default --families and --arch)")
    ap.add_argument("--missing", action="store_true",
                    help="compile only the accepted plans that the record lacks (families whose "
                         "record is of the current sources) and add them to it")
    ap.add_argument("--lift-refusals", action="store_true",
                    help="sweep with the planner's ptxas refusal sets emptied (to re-derive them; "
                         "not with --write or --missing)")
    ap.add_argument("--bwd-tc-edge", action="store_true",
                    help=f"instead: the flash_bwd_tc d != dv edge sweep, rows to "
                         f"{EDGE_RESULTS.relative_to(ROOT)} (refused plans included)")
    args = ap.parse_args(argv)
    if args.bwd_tc_edge:
        return edge_sweep(args.jobs)
    if (args.write or args.missing) and set(args.arch) != set(ARCHS):
        ap.error("--write / --missing record whole families: leave --arch at its default")
    if args.lift_refusals and (args.write or args.missing):
        ap.error("--lift-refusals sweeps plans the planner refuses: not for the record")
    if args.lift_refusals:
        lift_refusals()
    doc = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"families": {}}
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    todo = [(f, p, a) for f in args.families for a in args.arch for p in accepted_plans(f, a)]
    refused = set()   # keys of the refused plans compiled for the record
    if args.write or args.missing:
        more = [(f, p, a) for f in args.families for a in args.arch
                for _, p in refused_spill_plans(f, a)]
        refused = {plan_key(*job) for job in more}
        todo += more
    if args.missing:
        for fam in args.families:
            rec = doc["families"].get(fam)
            if rec is not None and rec["source_hash"] != family_hash(fam):
                ap.error(f"{fam}: its sources changed since its record: sweep it whole (--write)")
            if rec is not None and rec["nvrtc"] != ".".join(map(str, _nvrtc.version())):
                ap.error(f"{fam}: recorded with NVRTC {rec['nvrtc']}: sweep it whole (--write)")
        have = {r["key"] for fam in args.families
                for r in doc["families"].get(fam, {"rows": []})["rows"]}
        todo = [(f, p, a) for f, p, a in todo if plan_key(f, p, a) not in have]
    print(f"{len(todo)} compiles (NVRTC {'.'.join(map(str, _nvrtc.version()))}, {args.jobs} jobs)",
          file=sys.stderr)
    rows, t0 = [], time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for i, row in enumerate(ex.map(compile_plan, todo, chunksize=4), 1):
            rows.append(row)
            if i % 20 == 0 or i == len(todo):
                el = time.perf_counter() - t0
                print(f"[{i}/{len(todo)}] {el:.0f} s, ~{el / i * (len(todo) - i):.0f} s left",
                      file=sys.stderr, flush=True)
    failing = [(r, bad(r)) for r in rows if bad(r) and r["key"] not in refused]
    for r, why in failing:
        print(f"{r['key']} ({r['threads']} threads): {why}")
    print(f"{'family':18s} {'plans':>6s} {'max regs':>8s}  spilling")
    for fam in args.families:
        fr = [r for r in rows if r["family"] == fam]
        regs = [f["registers"] for r in fr if "kernels" in r for f in r["kernels"].values()]
        # a refused plan may compile clean in one family or architecture and spill in another
        # (the set is per kernel or build); the test of the set reads the union
        nref = sum(1 for r in fr if r["key"] in refused)
        nclean = sum(1 for r in fr if r["key"] in refused and not bad(r))
        print(f"{fam:18s} {len(fr):6d} {max(regs, default=0):8d}  "
              f"{sum(1 for r in fr if bad(r) and r['key'] not in refused)}"
              + (f" (and {nref} refused plans compiled for the record, {nclean} clean here)"
                 if nref else ""))
    print(f"{len(rows)} plans compiled, {len(failing)} spill or fail")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write or args.missing:  # --write replaces the swept families' rows, --missing adds
        for fam in args.families:
            new = {r["key"]: r for r in rows if r["family"] == fam}
            old = doc["families"].get(fam, {"rows": []})["rows"] if args.missing else []
            doc["families"][fam] = {
                "nvrtc": ".".join(map(str, _nvrtc.version())),
                "source_hash": family_hash(fam),
                "rows": sorted([r for r in old if r["key"] not in new] + list(new.values()),
                               key=lambda r: r["key"])}
        RESULTS.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
        print(f"wrote {RESULTS}")
    return 1 if failing else 0


def _side_sweep(todo, jobs, path, command):
    """Compile ``todo``, print the spills, write every row to ``path`` (not the record)."""
    print(f"{len(todo)} compiles", file=sys.stderr)
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs)) as ex:
        rows = list(ex.map(compile_plan, todo, chunksize=4))
    bad_rows = [r for r in rows if bad(r)]
    for r in bad_rows:
        print(f"{r['key']}: {bad(r)}")
    print(f"{len(rows)} plans compiled, {len(bad_rows)} spill")
    path.write_text(json.dumps({"command": command, "rows": sorted(rows, key=lambda r: r["key"])},
                               indent=0, sort_keys=True))
    return 0


def edge_sweep(jobs):
    """Compile the flash_bwd_tc edge plans (the worker processes inherit forget_edge_spills)."""
    forget_edge_spills()
    return _side_sweep([("flash_bwd_tc", p, arch) for p, arch in bwd_tc_edge_plans()], jobs,
                       EDGE_RESULTS, "python bench/plan_sweep.py --bwd-tc-edge")


if __name__ == "__main__":
    sys.exit(main())

"""Compile every curated plan with NVRTC and check that none uses local memory.

The evidence of the curated plan tables (``cuflash/tiling/curated.py``): every (block_q,
block_kv) pair of every cell is compiled, with the options a launch uses
(``cuflash.kernels.build_options``: ``-ftz=true`` included), for the architecture its class is
compiled for (sm_75, sm_80 for sm_80 and sm_86, sm_90), in every module that launches it --
a *group*: a kernel file with the defines of one build (the serving and feature builds of
flash_fwd.cu, the main kernels of flash_bwd_tc.cu, ...), the tensor-core groups also in their
padded build of each cell's default (``-DCUFLASH_HEAD_DIMS_PADDED``, the build of calls with
d != dv).  ptxas' report
(``--ptxas-options=-v``) must show no spill stores or loads and no stack frame for any kernel
of the module.  Besides the tables: the helper kernels of flash_bwd_tc.cu and flash_fwd.cu, and
online_softmax.cu, per dtype; the Hopper groups (flash_fwd_wgmma, flash_bwd_wgmma) for sm_90a.  No GPU needed; 0.1-2 s
per compile.

``--write`` records each group's results in ``bench/results/plan_sweep.json``: the NVRTC
version, a hash of the group's sources (its kernel file and the headers it includes, comments
dropped, conditionals on the groups' defines resolved: :func:`source_hash`) and, per compile,
a short digest of its options with the most registers of its kernels, and a digest of its PTX.

``--stale`` compiles what the record does not vouch for.  Where a group's sources changed, a
compile whose PTX (:func:`ptx_job`: NVRTC to PTX alone, about half a compile) is the recorded
one keeps its recorded result (:func:`carry_by_ptx`): ptxas, given the same PTX, options and
version, reports the same.  So an edit of a shared header re-checks most families at the
cost of their PTX, and only the compiles it changed go through ptxas.
tests/tiling/test_curated_plans.py (CI) takes the record's word for the compiles it vouches for
(of the current sources, NVRTC and options), of which it compiles a sample (:func:`sample_jobs`)
that must match it, and compiles the defaults (``Job.default``) among the others;
``CUFLASH_PLAN_CHECK=all`` compiles every one, ignoring the record.  After a kernel edit:
``--groups <its groups> --write``.

``--rehash REV`` carries the record over an edit of kernels_cu that changes no compiled program
(comments, emulator-only code, whitespace): it checks that the host preprocessor gives the
same C++ tokens under NVRTC's macros for every compile in REV's kernels and in this tree's,
in about a minute for every group, instead of the compiles' 50 minutes.

``--candidates`` compiles every tile pair that the planner's formulas allow in one cell (for a
person choosing the cell's alternatives), without recording anything.

Usage::

    python bench/plan_sweep.py                           # every group: compile, print, check
    python bench/plan_sweep.py --groups flash_fwd_tc flash_fwd_tc_masked --write
    python bench/plan_sweep.py --stale --write           # after a kernel edit: what it changed
    python bench/plan_sweep.py --rehash HEAD              # after a comment-only kernel edit
    python bench/plan_sweep.py --candidates flash_bwd_tc float16 128 sm_90
"""
import argparse
import base64
import concurrent.futures as cf
import hashlib
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, kernels, tiling  # noqa: E402
from cuflash.tiling import curated  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "plan_sweep.json"
SERVING, MASKS = {"CUFLASH_FWD_SERVING": None}, {"CUFLASH_MASKS": None}
MAIN, HELPERS = {"CUFLASH_BWD_TC_MAIN": None}, {"CUFLASH_BWD_TC_HELPERS": None}

# group -> (kernel file, defines of the build, kernels whose curated tables it compiles)
GROUPS = {
    "flash_fwd": ("flash_fwd.cu", {}, ("flash_fwd",)),
    "flash_fwd_serving": ("flash_fwd.cu", SERVING, ("flash_fwd",)),
    "flash_fwd_masked": ("flash_fwd.cu", MASKS, ("flash_fwd_masked",)),
    "flash_fwd_serving_masked": ("flash_fwd.cu", {**SERVING, **MASKS}, ("flash_fwd_masked",)),
    "flash_fwd_helpers": ("flash_fwd.cu", {"CUFLASH_FWD_HELPERS": None}, ()),
    "flash_bwd": ("flash_bwd.cu", {}, ("flash_bwd_dkdv",)),
    "flash_bwd_masked": ("flash_bwd.cu", MASKS, ("flash_bwd_dkdv_masked",)),
    "flash_fwd_tc": ("flash_fwd_tc.cu", {}, ("flash_fwd_tc", "flash_fwd_tf32")),
    "flash_fwd_tc_masked": ("flash_fwd_tc.cu", MASKS, ("flash_fwd_tc_masked", "flash_fwd_tf32_masked")),
    "flash_bwd_tc": ("flash_bwd_tc.cu", MAIN, ("flash_bwd_tc",)),
    "flash_bwd_tc_masked": ("flash_bwd_tc.cu", {**MAIN, **MASKS}, ("flash_bwd_tc_masked",)),
    **{k: ("flash_bwd_tc.cu", {**MAIN, **MASKS, **kernels.BUILD_DEFINES[k]}, (k,))
       for k in tiling.BWD_LEAN_KERNELS},
    "flash_bwd_tc_helpers": ("flash_bwd_tc.cu", HELPERS, ()),
    "flash_bwd_tf32": ("flash_bwd_tf32.cu", {}, ("flash_bwd_tf32",)),
    "flash_bwd_tf32_masked": ("flash_bwd_tf32.cu", MASKS, ("flash_bwd_tf32_masked",)),
    "online_softmax": ("online_softmax.cu", {}, ()),
    "flash_fwd_wgmma": ("flash_fwd_wgmma.cu", {}, ("flash_fwd_wgmma",)),
    "flash_bwd_wgmma": ("flash_bwd_wgmma.cu", {}, ("flash_bwd_wgmma",)),
}
# groups compiled for an architecture's arch-specific code (cuflash.kernels.KERNEL_ARCH: sm_90a)
ARCH_SPECIFIC = {g: kernels.KERNEL_ARCH[k] for g, spec in GROUPS.items() for k in spec[2]
                 if k in kernels.KERNEL_ARCH}
TC_DIMS = tuple(range(16, 257, 16))


class Job:
    """One compile: a group's kernel file for ``arch`` with ``defines`` (name -> value or None).
    ``default``: a compile that calls without tiles launch (a cell's default, the serving
    kernel's decoding tiles, the helpers), which the tests compile even without a record."""

    def __init__(self, group, key, defines, arch, default=True):
        self.group, self.key, self.arch, self.default = group, key, arch, default
        self.defines = dict(GROUPS[group][1], **defines)
        self.options = (f"-arch={ARCH_SPECIFIC.get(group, f'sm_{arch}')}", "--ptxas-options=-v",
                        *kernels.build_options(self.defines))

    @property
    def digest(self):
        """8 hex digits naming the key and options (the record's key of the compile)."""
        text = self.key + "\0" + " ".join(o for o in self.options if not o.startswith("-I"))
        return hashlib.sha256(text.encode()).hexdigest()[:8]


def _pad_step(kernel):
    """The step of a padded kernel's head dims (a call's d, dv are multiples of it)."""
    return 32 if kernel.startswith("flash_bwd_tf32") else 16


def _plan_job(group, kernel, dtype, c, pair, arch_class, padded, default=True):
    """The Job of one curated pair (``padded``: the padded build, for calls with d < dv)."""
    step = _pad_step(kernel)
    plan = tiling.plan(kernel, c - step if padded else c, c, dtype, *pair,
                       limit=tiling.EMULATOR_ARCHES[arch_class], limit_source=arch_class)
    arch = curated.COMPILED_FOR[arch_class]
    key = (f"{group} {dtype} {c} {pair[0]}x{pair[1]} sm_{arch}" + (" padded" if padded else ""))
    return Job(group, key, kernels.plan_defines(plan), arch, default)


def group_jobs(group):
    """Every compile of ``group``, without duplicates (sm_86's and sm_80's cells share sm_80).

    Each curated pair in the build of calls with d == dv; the padded build (calls with d !=
    dv on the tensor cores) of each cell's default -- explicit tiles there are checked when
    compiled on a GPU (``kernels.check_compiled``).  The serving groups' pairs are all
    defaults: the serving kernel chooses its decoding tiles among them by the query rows."""
    fname, _, tables = GROUPS[group]
    serving = "CUFLASH_FWD_SERVING" in GROUPS[group][1]
    jobs = {}
    for kernel in tables:
        t = tiling.kernel_tiling(kernel)
        for dtype, grid in curated.table(kernel).items():
            for c, row in grid.items():
                padded = t.pad_define is not None and c > _pad_step(kernel)
                for arch_class, pairs in row.items():
                    todo = [(pair, False, serving or i == 0) for i, pair in enumerate(pairs)]
                    if padded:   # the padded build's default (the cell's own after "/")
                        todo += [(pair, True, True) for pair in
                                 curated.cell(kernel, dtype, c, arch_class, padded=True)[:1]]
                    for pair, pad, default in todo:
                        job = _plan_job(group, kernel, dtype, c, pair, arch_class, pad, default)
                        if job.key in jobs:
                            jobs[job.key].default |= job.default
                        else:
                            jobs[job.key] = job
    if group == "flash_bwd_tc_helpers":  # the helpers' module: the dtype only
        for dtype in tiling.TC_DTYPES:
            for arch in (80, 90):
                job = Job(group, f"{group} {dtype} sm_{arch}", {kernels.dtype_define(dtype): None}, arch)
                jobs[job.key] = job
    if group in ("online_softmax", "flash_fwd_helpers"):   # per dtype, every architecture
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            for arch in (75, 80, 90):
                job = Job(group, f"{group} {dtype} sm_{arch}", {kernels.dtype_define(dtype): None},
                          arch)
                jobs[job.key] = job
    return sorted(jobs.values(), key=lambda j: j.key)


def sample_jobs(group):
    """A few of ``group``'s compiles, which the tests compile on every run to hold the record
    to the installed NVRTC: per table, dtype class and architecture class, the default of the
    largest head-dim class (the most registers); the helpers and online_softmax all."""
    if group in ("online_softmax", "flash_bwd_tc_helpers", "flash_fwd_helpers"):
        return group_jobs(group)
    jobs = {}
    for kernel in GROUPS[group][2]:
        classes = []   # one dtype of each dtype class (the dtypes of one grid)
        for dtype, grid in curated.table(kernel).items():
            if all(grid != g for _, g in classes):
                classes.append((dtype, grid))
        for dtype, grid in classes:
            c = max(grid)
            for arch_class, pairs in grid[c].items():
                if pairs:
                    job = _plan_job(group, kernel, dtype, c, pairs[0], arch_class, False)
                    jobs.setdefault(job.key, job)
    return sorted(jobs.values(), key=lambda j: j.key)


def compile_result(job, kdir=None):
    """NVRTC's CompileResult of a job (ptxas' report in its log, the cubin), compiled from
    ``kdir`` (a kernels_cu directory; default this one's)."""
    kdir = Path(kdir) if kdir is not None else ROOT / "kernels_cu"
    fname = GROUPS[job.group][0]
    opts = [f"-I{kdir}" if o.startswith("-I") else o for o in job.options]
    return _nvrtc.compile((kdir / fname).read_text(), fname, opts)


PTX_DIGEST_CHARS = 8   # 48 bits: a changed PTX passes for the old one once in 2^48


def ptx_digest(ptx):
    """PTX_DIGEST_CHARS base64 characters naming a compile's PTX (what ptxas reads: with the
    options and NVRTC's version, everything its figures depend on)."""
    return base64.urlsafe_b64encode(hashlib.sha256(ptx.encode()).digest()).decode()[:PTX_DIGEST_CHARS]


def recorded_ptx(rec):
    """{compile digest: PTX digest} of a group's record: its "ptx" string holds one digest per
    row, in the rows' (sorted) order, ``.`` characters where a compile gave no PTX."""
    text, keys = rec.get("ptx", ""), sorted(rec["rows"])
    if len(text) != PTX_DIGEST_CHARS * len(keys):
        return {}
    out = {}
    for i, k in enumerate(keys):
        d = text[i * PTX_DIGEST_CHARS:(i + 1) * PTX_DIGEST_CHARS]
        if not d.startswith("."):
            out[k] = d
    return out


def compile_job(job):
    """(key, digest, {kernel: ptxas figures} or {"error": log}, CPU seconds, PTX digest or
    None) of one compile."""
    t0 = time.process_time()
    try:
        res = compile_result(job)
        info, ptx = _nvrtc.parse_ptxas_info(res.log), ptx_digest(res.ptx)
    except _nvrtc.NVRTCError as e:
        info, ptx = {"error": e.log[-2000:]}, None
    return job.key, job.digest, info, time.process_time() - t0, ptx


def ptx_job(job):
    """(key, PTX digest or None, CPU seconds): the job's PTX alone (``-arch=compute_XX``, no
    ptxas) -- the same text NVRTC hands ptxas for ``-arch=sm_XX``, at about half the cost."""
    t0 = time.process_time()
    kdir = ROOT / "kernels_cu"
    opts = [f"-I{kdir}" if o.startswith("-I") else o.replace("-arch=sm_", "-arch=compute_")
            for o in job.options if o != "--ptxas-options=-v"]
    fname = GROUPS[job.group][0]
    try:
        ptx = ptx_digest(_nvrtc.compile((kdir / fname).read_text(), fname, opts).ptx)
    except _nvrtc.NVRTCError:
        ptx = None
    return job.key, ptx, time.process_time() - t0


def bad(info):
    """Why a compile fails the rule (an error, spills, a stack frame), or None."""
    if "error" in info:
        return "compile error: " + info["error"].strip().splitlines()[-1][:200]
    if not info:
        return "no kernel in ptxas' report"
    for k, f in sorted(info.items()):
        if f["spill_stores"] or f["spill_loads"] or f["stack_frame"]:
            return (f"{k}: {f['registers']} registers, spills {f['spill_stores']}/"
                    f"{f['spill_loads']} B, stack {f['stack_frame']} B")
    return None


def compile_all(jobs, workers=None, progress=True, fn=compile_job):
    """[compile_job(job)] of ``jobs`` (or ``fn``'s results), ``workers`` at a time (default:
    the CPUs)."""
    if not jobs:
        return []
    workers = max(1, workers or os.cpu_count() or 1)
    out, t0 = [], time.perf_counter()
    # forkserver: the workers start from a clean process, never forked from one whose other
    # threads (JAX's, in the test suite) may hold locks the child would then wait on forever
    ctx = mp.get_context("forkserver") if "forkserver" in mp.get_all_start_methods() else None
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        for i, res in enumerate(ex.map(fn, jobs, chunksize=2), 1):
            out.append(res)
            if progress and (i % 50 == 0 or i == len(jobs)):
                el = time.perf_counter() - t0
                print(f"[{i}/{len(jobs)}] {el:.0f} s", file=sys.stderr, flush=True)
    return out


# -- the sources a group compiles, hashed -------------------------------------------------------
# The -D names that select code regions of a group (GROUPS' defines).  The hash resolves #if /
# #ifdef on these names, so an edit inside a region a group does not compile (e.g. the
# -DCUFLASH_MASKS code, for the plain kernels) leaves its hash.  Every other conditional is
# hashed as it stands, both branches -- CUFLASH_HEAD_DIMS_PADDED among them, which the padded
# compiles of a group set and its other compiles do not.
REGION_DEFINES = frozenset(k for g in GROUPS.values() for k in g[1])
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
    resolved (only the code such a build can see counts), all else as written.  A file the
    resolver cannot follow (one that #defines a region name, an #elif it cannot evaluate) is
    hashed whole.  ``kdir``: another copy of kernels_cu, default this one."""
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


def group_hash(group, kdir=None):
    """source_hash of a group's kernel file under the group's defines."""
    return source_hash(GROUPS[group][0], GROUPS[group][1], kdir)


def nvrtc_version():
    return ".".join(map(str, _nvrtc.version()))


def load_record():
    rec = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    return rec if "groups" in rec else {"groups": {}}


def unrecorded(group, jobs, record=None):
    """The jobs of ``group`` that its record does not vouch for: all of them when the record is
    of other sources or another NVRTC, else those whose digest it lacks or records failing."""
    rec = (record or load_record())["groups"].get(group)
    if (rec is None or rec["source_hash"] != group_hash(group)
            or rec["nvrtc"] != nvrtc_version()):
        return list(jobs)
    return [j for j in jobs if not isinstance(rec["rows"].get(j.digest), int)]


def carry_by_ptx(group, jobs, record=None, workers=None, sample=8):
    """After a kernel edit: where ``group``'s record is of other sources but of this NVRTC,
    the recorded results of those of ``jobs`` whose PTX is unchanged -- ptxas, given the same
    PTX, options and version, gives the same registers and spills -- and the jobs left to
    compile.  A header edit leaves most families' PTX as it was; their check is then the PTX
    pass alone, about half a compile.  A sample of up to ``sample`` jobs is compiled first, in
    full (its compiles give their PTX too): when none of it kept its PTX (the edit changed this
    family's code) the rest go straight to the full compile, so an edit that changes every
    compile costs no PTX pass at all; else the rest have theirs.

    Returns ({digest: (recorded row, PTX digest)}, [jobs left], [compile_job results of the
    sample], CPU seconds of the PTX pass)."""
    rec = (record or load_record())["groups"].get(group)
    if rec is None or rec["nvrtc"] != nvrtc_version() or rec["source_hash"] == group_hash(group):
        return {}, list(jobs), [], 0.0
    old = recorded_ptx(rec)
    known = [j for j in jobs if j.digest in old and j.digest in rec["rows"]]
    step = max(1, len(known) // sample)
    first = known[::step][:sample]
    sampled = compile_all(first, workers, False)
    done = {}
    if any(ptx == old[digest] for _, digest, _, _, ptx in sampled):
        rest = [j for j in known if j not in first]
        done = {key: (ptx, cpu) for key, ptx, cpu in compile_all(rest, workers, False, ptx_job)}
    carried = {j.digest: (rec["rows"][j.digest], old[j.digest]) for j in known
               if j.key in done and done[j.key][0] == old[j.digest]}
    left = [j for j in jobs if j.digest not in carried and j not in first]
    return carried, left, sampled, sum(cpu for _, cpu in done.values())


def export_kernels(rev, dest):
    """kernels_cu as of git revision ``rev``, written under ``dest``; returns that directory."""
    out = Path(dest) / "kernels_cu"
    out.mkdir(parents=True)
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "kernels_cu/"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], check=True,
                              capture_output=True).stdout
        (out / Path(name).name).write_bytes(blob)
    return out


def candidates(kernel, dtype, c, arch_class, workers):
    """Compile every tile pair the planner's formulas take in one cell; print a table."""
    group = next(g for g, spec in GROUPS.items() if kernel in spec[2])
    t = tiling.kernel_tiling(kernel)
    limit = tiling.EMULATOR_ARCHES[arch_class]
    jobs, plans = [], {}
    for bq in t.block_q_choices:
        for bkv in t.block_kv_choices:
            try:
                p = tiling.plan(kernel, c, c, dtype, bq, bkv, limit=limit, limit_source=arch_class)
            except ValueError:
                continue
            job = Job(group, f"{group} {dtype} {c} {bq}x{bkv} sm_{curated.COMPILED_FOR[arch_class]}",
                      kernels.plan_defines(p), curated.COMPILED_FOR[arch_class])
            jobs.append(job)
            plans[job.key] = p
    cell = curated.cell(kernel, dtype, c, arch_class)
    print(f"{kernel} {dtype} head dims {c} on {arch_class}: {len(jobs)} pairs the formulas take; "
          f"curated: {' '.join(f'{a}x{b}' for a, b in cell) or 'none'}")
    print(f"{'tiles':>8s} {'threads':>7s} {'shared B':>9s} {'registers':>9s}  ptxas")
    for key, _, info, _, _ in compile_all(jobs, workers, progress=False):
        p = plans[key]
        regs = max((f["registers"] for f in info.values() if isinstance(f, dict)), default=0)
        mark = " curated" if (p.block_q, p.block_kv) in cell else ""
        print(f"{p.block_q:>3d}x{p.block_kv:<4d} {p.threads:7d} {p.shared_bytes:9d} {regs:9d}  "
              f"{bad(info) or 'clean'}{mark}")
    return 0



def nvrtc_tokens(job, kdir):
    """The C++ tokens NVRTC compiles for ``job`` from ``kdir`` (a kernels_cu directory): the
    host preprocessor (g++ -E) run with the job's defines and NVRTC's own macros, whitespace
    dropped.  Two kernel trees whose tokens agree for a job give NVRTC the same program."""
    fname = GROUPS[job.group][0]
    defs = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in job.defines.items()]
    cmd = [os.environ.get("CXX", "g++"), "-E", "-P", "-x", "c++", "-std=c++17", f"-I{kdir}",
           "-D__CUDACC__", "-D__CUDACC_RTC__", "-D__NVCC__", f"-D__CUDA_ARCH__={job.arch * 10}",
           *(["-D__CUDA_ARCH_FEAT_SM90_ALL"] if ARCH_SPECIFIC.get(job.group) == "sm_90a" else []),
           *defs, str(Path(kdir) / fname)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{job.key}: the host preprocessor failed: {r.stderr[-500:]}")
    return re.findall(r"\w+|\S", r.stdout)


def rehash(rev, groups, workers=4):
    """Carry the record over a kernel edit that changes no compiled program: for each stale
    group whose record matches ``rev``'s kernels_cu, if every job's NVRTC tokens (nvrtc_tokens)
    are the same in ``rev`` and in this tree, the record takes this tree's source hash.
    Returns {group: "rehashed" | why not}."""
    record, out = load_record(), {}
    with tempfile.TemporaryDirectory() as tmp:
        old = export_kernels(rev, tmp)
        for g in groups:
            rec = record["groups"].get(g)
            if rec is None:
                out[g] = "no record"
            elif rec["source_hash"] == group_hash(g):
                out[g] = "current"
            elif rec["source_hash"] != group_hash(g, old):
                out[g] = f"the record is not of {rev}'s sources"
            else:
                jobs = group_jobs(g)
                with cf.ThreadPoolExecutor(workers) as ex:
                    same = list(ex.map(lambda j: nvrtc_tokens(j, old) == nvrtc_tokens(j, ROOT / "kernels_cu"),
                                       jobs))
                if all(same):
                    rec["source_hash"] = group_hash(g)
                    out[g] = "rehashed"
                else:
                    out[g] = f"{same.count(False)} of {len(jobs)} compiles change: recompile"
    RESULTS.write_text(_dump(record))
    return out

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--stale", action="store_true",
                    help="only the compiles the record does not vouch for")
    ap.add_argument("--write", action="store_true", help=f"record the results in {RESULTS.name}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--candidates", nargs=4, metavar=("KERNEL", "DTYPE", "HEAD_DIM", "ARCH"),
                    help="instead: compile every tile pair of one cell the formulas allow")
    ap.add_argument("--rehash", metavar="REV",
                    help="instead: where the record is of REV's kernels and this tree gives NVRTC "
                         "the same tokens for every compile (a comment or emulator-only edit), "
                         "carry the record over without compiling")
    args = ap.parse_args(argv)
    if args.rehash:
        for g, what in rehash(args.rehash, args.groups).items():
            print(f"{g:26s} {what}")
        return 0
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    if args.candidates:
        k, dt, c, arch = args.candidates
        return candidates(k, dt, int(c), arch, args.jobs)
    record = load_record()
    todo = {g: group_jobs(g) for g in args.groups}
    carried = {g: {} for g in todo}
    if args.stale:
        todo = {g: unrecorded(g, jobs, record) for g, jobs in todo.items()}
    jobs = [j for js in todo.values() for j in js]
    print(f"{len(jobs)} compiles at most (NVRTC {nvrtc_version()}, {args.jobs} jobs)", file=sys.stderr)
    t0 = time.perf_counter()
    failing, n, cpu_all, n_carried = 0, 0, 0.0, 0
    print(f"{'group':26s} {'compiles':>8s} {'same PTX':>8s} {'wall s':>7s} {'CPU s':>7s} "
          f"{'max regs':>8s}  failing", flush=True)
    for g, js in todo.items():   # group by group, each recorded as soon as it is compiled
        tg = time.perf_counter()
        cpu, sampled = 0.0, []
        if args.stale:   # the compiles whose PTX the edit left as it was keep their record
            carried[g], js, sampled, cpu = carry_by_ptx(g, js, record, args.jobs)
        results = sampled + compile_all(js, args.jobs)
        cpu += sum(r[3] for r in results)
        values = [bad(info) or max(f["registers"] for f in info.values()) for _, _, info, _, _ in results]
        values += [row for row, _ in carried[g].values()]
        fails = [(key, bad(info)) for key, _, info, _, _ in results if bad(info)]
        keys = {j.digest: j.key for j in group_jobs(g)}
        fails += [(keys[digest], row) for digest, (row, _) in carried[g].items() if not isinstance(row, int)]
        failing, n, cpu_all = failing + len(fails), n + len(results), cpu_all + cpu
        n_carried += len(carried[g])
        regs = [v for v in values if isinstance(v, int)]
        print(f"{g:26s} {len(results):8d} {len(carried[g]):8d} {time.perf_counter() - tg:7.0f} {cpu:7.0f} "
              f"{max(regs, default=0):8d}  {len(fails)}", flush=True)
        for key, why in fails:
            print(f"    {key}: {why}", flush=True)
        if args.write:
            record = _record_group(load_record(), g, results, args.stale, carried[g])
            RESULTS.write_text(_dump(record))
    print(f"{n} compiles and {n_carried} with their PTX unchanged in {time.perf_counter() - t0:.0f} s "
          f"({cpu_all:.0f} CPU s in the compiling processes, {args.jobs} at a time), {failing} failing")
    if args.write:
        print(f"wrote {RESULTS.relative_to(ROOT)} ({RESULTS.stat().st_size} B)")
    return 1 if failing else 0


def _record_group(record, g, results, stale, carried=None):
    """``record`` with group ``g``'s rows (registers, or why a compile fails) and PTX digests
    from this run's ``results`` (compile_job's) and ``carried`` rows (carry_by_ptx's), keeping
    the rows of its other compiles with ``stale`` where the record is of these sources."""
    keep = record["groups"].get(g) if stale else None
    if keep is not None and (keep["source_hash"] != group_hash(g)
                             or keep["nvrtc"] != nvrtc_version()):
        keep = None
    rows = dict(keep["rows"]) if keep else {}
    ptxs = recorded_ptx(keep) if keep else {}
    for digest, (row, ptx) in (carried or {}).items():
        rows[digest], ptxs[digest] = row, ptx
    for _, digest, info, _, ptx in results:
        rows[digest] = bad(info) or max(f["registers"] for f in info.values())
        ptxs.pop(digest, None)
        if ptx is not None:
            ptxs[digest] = ptx
    curated_now = {j.digest for j in group_jobs(g)}
    live = sorted(k for k in rows if k in curated_now)   # drop rows of plans no longer curated
    record["groups"][g] = {"nvrtc": nvrtc_version(), "source_hash": group_hash(g),
                           "rows": {k: rows[k] for k in live},
                           "ptx": "".join(ptxs.get(k, "." * PTX_DIGEST_CHARS) for k in live)}
    return {"groups": {k: rec for k, rec in sorted(record["groups"].items()) if k in GROUPS}}


def _dump(record):
    """The record as JSON with one line per group's rows (small, and diffs by group)."""
    lines = ["{", '"groups": {']
    items = list(record["groups"].items())
    for i, (g, rec) in enumerate(items):
        head = json.dumps({k: v for k, v in rec.items() if k not in ("rows", "ptx")})[1:-1]
        rows = json.dumps(rec["rows"], separators=(",", ":"))
        ptx = json.dumps(rec.get("ptx", ""))
        lines.append(f'{json.dumps(g)}: {{{head}, "rows": {rows},\n "ptx": {ptx}}}'
                     + ("," if i + 1 < len(items) else ""))
    lines += ["}", "}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

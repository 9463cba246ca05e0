"""Resource report of every kernel: registers, spills, shared memory, occupancy.

For each kernel of ``kernels_cu/`` (every specialisation listed by
``cuflash.kernels.compile_variants()``) and each architecture asked for
(sm_80 and sm_90 by default), NVRTC compiles a cubin with ``ptxas -v``
(``--ptxas-options=-v``: NVRTC runs its own ptxas, so no toolkit version has
to match) and the report reads:

* registers per thread, spill stores/loads (local memory) and stack frame;
* static shared memory (ptxas) and dynamic shared memory per block, with the
  threads per block, from the tile plan of :mod:`cuflash.tiling` (the one
  place launch sizes are computed) for the defines of the specialisation;
* the theoretical occupancy those imply (resident blocks and warps per SM,
  and which resource limits it), with the per-architecture limits of the
  CUDA occupancy calculator;
* the instruction mix of the machine code (``cuobjdump -sass`` of the cubin,
  :mod:`cuflash._sass`): HMMA, LDSM, LDS/STS, LDG/STG, LDGSTS, RED/ATOM, BAR,
  MUFU, FFMA, LDL/STL, SHFL and the total, static counts over the kernel's main
  loop (the loop with the most HMMA, else FFMA; inner loops counted once) and
  the kernel's total size (``--no-sass`` skips it);
* for the backward kernels, a one-line model per specialisation
  (:func:`bwd_model_line`): tensor-core FLOPs and HMMA per block step (one Q tile
  against one K/V tile), shared-memory bytes per HMMA, the SASS counts of one
  step (the main loop with its inner loops weighted by their trip counts) against
  the model's, and the time predicted for FlashAttention-2's benchmark shape on an
  H100 at the shared-memory rate FA2's own backward achieved there
  (its Nsight Compute profile of 2026-11-23), beside FA2's kernel modelled the same way.

FlashAttention-2's compiled loops beside cuflash's, per 1,000 HMMA: ``bench/fa2_sass_compare.py``
(latest output: ``bench/results/fa2_sass_compare.md``, whose summary table ``--write`` copies
into the report's last section, :func:`fa2_section`).

No GPU is needed.  Usage::

    python bench/kernel_report.py --jobs 2 --write   # every kernel, sm_80 and sm_90: the .md
    python bench/kernel_report.py                    # the same, printed only
    python bench/kernel_report.py --arch 80 --fail-on-spill
    python bench/kernel_report.py --tests            # the test kernels too
"""
import argparse
import concurrent.futures as cf
import contextlib
import datetime
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, _sass  # noqa: E402

RESULT = ROOT / "bench" / "results" / "kernel_report.md"
FA2_RESULT = ROOT / "bench" / "results" / "fa2_sass_compare.md"

# Per-SM limits (CUDA occupancy calculator / programming guide, "Compute capabilities").
ARCH_LIMITS = {
    75: dict(max_warps=32, max_blocks=16, regs=65536, smem_sm=64 * 1024, smem_block=64 * 1024, reserved=0),
    80: dict(max_warps=64, max_blocks=32, regs=65536, smem_sm=164 * 1024, smem_block=163 * 1024, reserved=1024),
    86: dict(max_warps=48, max_blocks=16, regs=65536, smem_sm=100 * 1024, smem_block=99 * 1024, reserved=1024),
    89: dict(max_warps=48, max_blocks=24, regs=65536, smem_sm=100 * 1024, smem_block=99 * 1024, reserved=1024),
    90: dict(max_warps=64, max_blocks=32, regs=65536, smem_sm=228 * 1024, smem_block=227 * 1024, reserved=1024),
}
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
SMEM_ALLOC_UNIT = 128

_DTYPES = {"CUFLASH_DTYPE_F16": "float16", "CUFLASH_DTYPE_BF16": "bfloat16",
           "CUFLASH_DTYPE_F32": "float32", "CUFLASH_DTYPE_F64": "float64"}
# launch sizes of the test kernels (tests/emulator/kernels/*.cu), as their tests launch them
_TEST_LAUNCH = {"matmul_mma": (64, 0), "cp_async_pipeline": (16, 512), "block_sum": (128, 0),
                "block_sum_racy": (128, 0), "warp_ops": (32, 0), "matmul_tf32": (32, 0), "tf32_round": (128, 0)}


def occupancy(arch, threads, registers, shared_bytes):
    """(blocks per SM, occupancy in [0, 1], limiting resource) of one kernel launch."""
    lim = ARCH_LIMITS[arch]
    warps = -(-threads // 32)
    by_warps = lim["max_warps"] // warps
    regs_per_warp = -(-max(registers, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (lim["regs"] // regs_per_warp) // warps
    per_block = -(-(shared_bytes + lim["reserved"]) // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT
    by_smem = 0 if shared_bytes > lim["smem_block"] else lim["smem_sm"] // max(per_block, 1)
    # in order of preference when several limits tie
    limits = {"warps": by_warps, "blocks": lim["max_blocks"], "registers": by_regs, "shared memory": by_smem}
    blocks = min(limits.values())
    limiter = next(k for k, v in limits.items() if v == blocks)
    if blocks == 0:
        limiter = "DOES NOT FIT (shared memory)" if by_smem == 0 else "DOES NOT FIT (registers)"
    return blocks, blocks * warps / lim["max_warps"], limiter


def _defines(options):
    out = {}
    for o in options:
        m = re.match(r"-D(\w+)(?:=(.*))?$", o)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# kernels launched with another kernel's plan (cuflash/launch/features.py, launch/serving.py)
_PLANNED_AS = {"flash_fwd_serving": "flash_fwd", "flash_fwd_serving_masked": "flash_fwd_masked"}


def launch_size(kernel, options, ptx):
    """(threads per block, dynamic shared bytes, source) for one kernel of a specialisation."""
    if kernel in _TEST_LAUNCH:
        return (*_TEST_LAUNCH[kernel], "test")
    d = _defines(options)
    kernel = _PLANNED_AS.get(kernel, kernel)
    try:
        from cuflash import tiling
        t = tiling.kernel_tiling(kernel)
        dtype = next(v for k, v in _DTYPES.items() if k in d)
        hd = int(d.get("CUFLASH_HEAD_DIM") or 0)
        hdv = int(d.get("CUFLASH_HEAD_DIM_V") or hd)
        bq = int(d["CUFLASH_BLOCK_Q"]) if d.get("CUFLASH_BLOCK_Q") else None
        bkv = int(d["CUFLASH_BLOCK_KV"]) if d.get("CUFLASH_BLOCK_KV") else None
        if hd:
            try:
                p = tiling.plan(kernel, hd, hdv, dtype, bq, bkv)
                lean = t.smaller and t.smaller(p.block_q, p.block_kv, p.kd, p.kdv, p.acc_bytes)
                if lean and all(d.get(k, "") == str(v) for k, v in lean[1].items()):
                    return p.threads, lean[0], "tiling"   # the plan's leaner layout (its defines)
                return p.threads, p.shared_bytes, "tiling"
            except ValueError:  # tiles this kernel's planner would not pick: use its formulas directly
                pass
        # also kernels whose size does not depend on a head dim (online_softmax_rows)
        acc = tiling.accumulator_bytes(dtype)
        return (t.threads(bq or 0, bkv or 0, hd, hdv), t.shared_bytes(bq or 0, bkv or 0, hd, hdv, acc),
                "tiling")
    except (ImportError, KeyError, StopIteration, ValueError, TypeError, ZeroDivisionError):
        pass
    if d.get("CUFLASH_THREADS"):  # a helper kernel the tiling does not describe: threads from the define
        return int(d["CUFLASH_THREADS"]), None, "define"
    # otherwise: the block size the kernel declares (__launch_bounds__ -> .maxntid), no dynamic shared memory known
    m = re.search(r"\.entry\s+" + re.escape(kernel) + r"\b[^{]*?\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", ptx, re.S)
    if m:
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)), None, "launch_bounds"
    return None, None, "unknown"


def _short(options):
    keep = []
    for o in options:
        m = re.match(r"-D(?:CUFLASH_)?(\w+)(?:=(.*))?$", o)
        if m:
            name = {"HEAD_DIM": "d", "HEAD_DIM_V": "dv", "BLOCK_Q": "Br", "BLOCK_KV": "Bc",
                    "THREADS": "thr"}.get(m.group(1), m.group(1))
            keep.append(name.replace("DTYPE_", "").lower() if m.group(2) is None else f"{name}={m.group(2)}")
    return " ".join(keep) or "(defaults)"


# kernels whose instructions exist only in arch-specific code (wgmma, setmaxnreg: sm_90a): compiled
# for the "a" target of the architectures at or above the first, and for no other
ARCH_SPECIFIC = {"flash_fwd_wgmma.cu": 90, "flash_bwd_wgmma.cu": 90}


def _compile_one(job):
    path, options, arch, want_sass = job
    suffix = "a" if Path(path).name in ARCH_SPECIFIC else ""
    opts = (f"-arch=sm_{arch}{suffix}", "--ptxas-options=-v", f"-I{ROOT / 'kernels_cu'}", f"-I{Path(path).parent}",
            *[o for o in options if not o.startswith("-I")])
    if not any(o.startswith(("-std", "--std")) for o in opts):
        opts += ("-std=c++17",)
    try:
        res = _nvrtc.compile(Path(path).read_text(), Path(path).name, opts)
    except _nvrtc.NVRTCError as e:
        return job, None, e.log
    if want_sass:
        res.sass = _sass.instructions(_sass.disassemble(res.cubin))
    return job, res, None


def jobs(archs, include_tests, only=None, sass=False):
    try:
        from cuflash.kernels import compile_variants
        variants = compile_variants()
    except ImportError:
        variants = {}
    files = sorted((ROOT / "kernels_cu").glob("*.cu"))
    extra = {"mma.cu": [("-DDTYPE=__half",), ("-DDTYPE=__nv_bfloat16",)]}
    if include_tests:
        files += sorted((ROOT / "tests" / "emulator" / "kernels").glob("*.cu"))
    out = []
    for f in files:
        if only and not any(s in f.name for s in only):
            continue
        for opts in variants.get(f.name) or extra.get(f.name) or [()]:
            for arch in archs:
                if arch < ARCH_SPECIFIC.get(f.name, 0):
                    continue
                out.append((str(f), tuple(opts), arch, sass))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCH_LIMITS),
                    help="architectures (default: 80 90)")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit with status 1 if any kernel spills")
    ap.add_argument("--tests", action="store_true",
                    help="also report the test kernels of tests/emulator/kernels/")
    ap.add_argument("--only", nargs="+", help="only files whose name contains one of these strings")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel NVRTC compiles")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--no-sass", action="store_true",
                    help="skip the instruction mix (cuobjdump -sass of every cubin)")
    ap.add_argument("--write", action="store_true",
                    help=f"write {RESULT.relative_to(ROOT)} (a whole report: every kernel, sm_80 and "
                         "sm_90, the instruction mix; not with --only, --tests, --arch or --no-sass)")
    args = ap.parse_args(argv)
    if args.write and (args.only or args.tests or sorted(args.arch) != [80, 90] or args.no_sass):
        ap.error("--write writes the whole report: drop --only, --tests, --arch and --no-sass")
    t0 = time.time()
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    print(f"NVRTC {'.'.join(map(str, _nvrtc.version()))} ({_nvrtc.find_libnvrtc()})", file=sys.stderr)
    want_sass = not args.no_sass
    if want_sass:
        ok, why = _sass.is_available()
        if not ok:
            print(f"no instruction mix: {why} (or pass --no-sass)", file=sys.stderr)
            return 2
    todo = jobs(args.arch, args.tests, args.only, want_sass)
    rows, failures = [], []
    # NVRTC compiles in worker processes (a large kernel takes seconds); --jobs 1 compiles in-process
    ex = cf.ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else None
    results = ex.map(_compile_one, todo) if ex else map(_compile_one, todo)
    try:
        for i, (job, res, err) in enumerate(results, 1):
            path, options, arch, _ = job
            print(f"\r[{i}/{len(todo)}] {Path(path).name} sm_{arch}", end="", file=sys.stderr, flush=True)
            if res is None:
                failures.append((job, err))
                continue
            for kernel, info in sorted(_nvrtc.parse_ptxas_info(res.log).items()):
                threads, dyn, source = launch_size(kernel, options, res.ptx)
                row = dict(file=Path(path).name, variant=_short(options), kernel=kernel, arch=arch,
                           registers=info["registers"], spill_stores=info["spill_stores"],
                           spill_loads=info["spill_loads"], stack=info["stack_frame"],
                           static_shared=info["static_shared"], dynamic_shared=dyn, threads=threads,
                           size_source=source)
                if threads:
                    b, occ, lim = occupancy(arch, threads, info["registers"], info["static_shared"] + (dyn or 0))
                    row.update(blocks_per_sm=b, occupancy=occ, limiter=lim)
                code = getattr(res, "sass", {}).get(kernel)
                if code:
                    span = _sass.main_loop(code)
                    row["sass_loop"] = dict(_sass.mix(code, span)) if span else None
                    row["sass_total"] = len(code)
                    if kernel == "flash_bwd_tc" and span:
                        row["sass_step"] = tc_sass_step(code, span, _defines(options))
                rows.append(row)
    finally:
        if ex:
            ex.shutdown()
    print(file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _print_table(rows)
        if any("sass_total" in r for r in rows):
            print()
            _print_mix(rows)
        model = [line for line in (bwd_model_line(r) for r in rows) if line]
        if model:
            print()
            print(BWD_MODEL_HEAD)
            for line in fa2_model_lines() + model:
                print(line)
        if spills:
            print(f"\n{len(spills)} kernel specialisation(s) spill registers to local memory:")
            for r in spills:
                print(f"  {r['kernel']} sm_{r['arch']} [{r['variant']}]: {r['spill_stores']} B stores, "
                      f"{r['spill_loads']} B loads")
    sys.stdout.write(out.getvalue())
    for (path, options, arch, _), err in failures:
        print(f"\nFAILED to compile {Path(path).name} sm_{arch} {' '.join(options)}:\n{err}", file=sys.stderr)
    if failures:
        return 1
    if args.write:
        head = header(argv if argv is not None else sys.argv[1:], time.time() - t0, len(spills))
        RESULT.write_text(head + "\n" + out.getvalue() + fa2_section(FA2_RESULT))
        print(f"written: {RESULT.relative_to(ROOT)}", file=sys.stderr)
    if args.fail_on_spill and spills:
        return 1
    return 0


# --------------------------------------------------------------------------
# the written report
# --------------------------------------------------------------------------
ABOUT = (
    "Every specialisation of `cuflash.kernels.compile_variants()`, compiled for sm_80 and sm_90; "
    "tiles are the defaults planned for an sm_80 (163 KB) from the curated tables "
    "(cuflash/tiling/curated.py) unless the specialisation names explicit ones. Occupancy is "
    "theoretical (registers, shared memory, warps per SM). The serving and masked kernels are "
    "sized from the plan they launch with (flash_fwd / flash_fwd_masked / flash_bwd_*_masked; the "
    "tensor-core kernels with the logit features, flash_fwd_tc_masked / flash_fwd_tf32_masked / "
    "flash_bwd_tc_masked / flash_bwd_tf32_masked / flash_bwd_tc_band / flash_bwd_tc_softcap / "
    "flash_bwd_tc_alibi / flash_bwd_tc_dropout / flash_bwd_tc_alibi_dropout / flash_bwd_tc_alibi_softcap, from their own plans). The instruction mix counts the main loop's "
    "instructions once each (static); the steady trip of a loop -- inner loops times their trips, "
    "the edge paths left out -- is in the last section and in `bench/results/tc_kernels_counts.md` "
    "(with the predictions each change was checked against). Every curated plan, not only these "
    "defaults, is compiled by `bench/plan_sweep.py` (record: `bench/results/plan_sweep.json`). "
    "flash_fwd_wgmma and flash_bwd_wgmma are compiled for sm_90a only (their wgmma and setmaxnreg "
    "exist there alone), sized by the planner's sm_90 plans; their \"HMMA\" are HGMMA (one per "
    "warp per wgmma), and their steady-trip counts are in `bench/results/hopper_sass_count.md`.")


def provenance():
    """(the checkout's short commit or '?', NVRTC's version and, where it is the pip wheel's,
    the wheel's): what a written result was made at."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        rev = "?"
    nvrtc = ".".join(map(str, _nvrtc.version()))
    try:
        import importlib.metadata as md
        nvrtc += f" (wheel nvidia-cuda-nvrtc {md.version('nvidia-cuda-nvrtc')})"
    except Exception:  # NVRTC from a toolkit, not the wheel: its version alone
        pass
    return rev, nvrtc


def header(argv, elapsed, n_spills):
    """The written report's title and its first paragraph: how it was made, what it holds."""
    rev, nvrtc = provenance()
    cmd = "python bench/kernel_report.py" + "".join(" " + a for a in argv)
    spills = "No row spills." if not n_spills else f"{n_spills} rows spill (listed after the model)."
    return (f"# Kernel report (generated)\n\nCommand: `{cmd}` (NVRTC {nvrtc}, its own ptxas; "
            f"cuobjdump for the instruction mix; no GPU needed; {elapsed:.0f} s), "
            f"{datetime.date.today().isoformat()}, at {rev}. {ABOUT} {spills}\n")


def fa2_section(path):
    """The last section of the written report: the summary table of the latest
    ``fa2_sass_compare.md`` (cuflash's main loops beside FlashAttention-2's, per 1,000 HMMA),
    with the command and commit it was made at; or a line saying it is missing."""
    title = "\n## Main loops beside FlashAttention-2, per 1,000 HMMA\n\n"
    if not Path(path).exists():
        return title + "No `bench/results/fa2_sass_compare.md`: run `python bench/fa2_sass_compare.py`.\n"
    lines = Path(path).read_text().splitlines()
    command = next((l for l in lines if l.startswith("Command: ")), "Command: ?")
    start = next((i for i, l in enumerate(lines) if l.startswith("| kernel |")), None)
    if start is None:
        raise ValueError(f"{path}: no summary table")
    table = []
    for l in lines[start:]:
        if not l.startswith("|"):
            break
        table.append(l)
    return (title + f"From `bench/results/fa2_sass_compare.md` ({command[len('Command: '):].rstrip('.')}), "
            "where the method, the tiles and the counts per instruction class are: one steady trip "
            "per warp of each main loop, FlashAttention-2's compiled kernels (the `flash-attn-jax` "
            "wheel; the `torch` rows PyTorch's bundled copy; the `src` rows FA2 2.8.3 built from its "
            "source) beside cuflash's. In brackets: "
            "instructions per logit.\n\n" + "\n".join(table) + "\n")


# --------------------------------------------------------------------------
# model of the backward kernels (no GPU: counts from the tile plan and the SASS)
# --------------------------------------------------------------------------
# FlashAttention-2's benchmark shape: batch 2, N = 4096, heads x d =
# 2048, non-causal, and FA2's backward kernel as launched on the H100 there:
# Flash_bwd_kernel_traits<d, Br, Bc, warps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ>
# with its measured time (flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel).
BENCH = dict(B=2, N=4096, hidden=2048, sms=132)
FA2_BWD = {
    64: dict(Br=128, Bc=128, warps=8, msdp=4, ndkv=4, mdq=4, ms=3.03),
    128: dict(Br=64, Bc=128, warps=8, msdp=2, ndkv=4, mdq=2, ms=2.79),
}
LDSM_X4 = 512          # bytes one ldmatrix.x4 moves (4 shared-memory wavefronts of 128 B)
WAVEFRONT = 128        # bytes per shared-memory wavefront (STS.32 / LDS.64 broadcast: one)
HMMA_FLOP = 2 * 16 * 8 * 16
BWD_MODEL_HEAD = (
    "Backward model (per block step = one Q tile x one K/V tile; smem = bytes through the "
    "shared-memory pipe: ldmatrix + STS + LDS + cp.async fills; time = that traffic per SM "
    "for B=2 N=4096 heads*d=2048 non-causal, at the per-SM shared-memory rate FA2's backward "
    "achieved on the H100 (its model bytes / its measured time); floor = HMMA at 2 clk/SM, "
    "1.755 GHz; a prediction, not a measurement)")


def _dq_tile(Br, d, warps):
    """flash_bwd_tc.cu's dQ warp tile (kDqM, kDqN): the same rule as the kernel's constexprs."""
    m = 32 if (Br % 32 == 0 and d % 32 == 0 and (Br // 32) * (d // 32) >= warps) else 16
    if m == 32:
        return m, 32
    if d % 64 == 0 and (Br // 16) * (d // 64) >= warps:
        return m, 64
    if d % 32 == 0 and (Br // 16) * (d // 32) >= warps:
        return m, 32
    return m, 16


def tc_step(Br, Bc, d, dv):
    """Analytic counts of one flash_bwd_tc block step (see flash_bwd_tc.cu)."""
    from cuflash import tiling
    warps, mt, passes, qs = tiling.bwd_tc_layout(Br, Bc, d, dv)
    nq = Br // qs // 8                     # 8-query tiles of S^T per warp
    slices = passes * qs
    kc_k, kc_v = -(-(d // 16) // slices), -(-(dv // 16) // slices)  # 16-col chunks per warp
    dqm, dqn = _dq_tile(Br, d, warps)
    dq_tiles = (Br // dqm) * (d // dqn)
    dq_w = -(-dq_tiles // warps)           # the busiest warp's dQ tiles
    # per warp and pass: S^T, dP^T (k loops), dV, dK (A from registers, or Ps / dSs with
    # the query split), then in the first pass dQ
    sdp_h = mt * nq * (d // 16 + dv // 16)
    sdp_l = (d // 16 + dv // 16) * (mt + nq // 2)
    kv_h = mt * (Br // 16) * 2 * (kc_k + kc_v)
    kv_l = (Br // 16) * (kc_k + kc_v) + (2 * mt * (Br // 16) if qs == 2 else 0)
    dq_h = dq_w * (dqm // 16) * (dqn // 8) * (Bc // 16)
    dq_l = dq_w * (Bc // 16) * (dqm // 16 + dqn // 16)
    hmma_w, ldsm_w = sdp_h + kv_h + dq_h, sdp_l + kv_l + dq_l   # the first pass
    ldsm_block = (passes * warps * (sdp_l + kv_l)
                  + dq_tiles * (Bc // 16) * (dqm // 16 + dqn // 16))
    sts = warps * mt * (Br // qs // 16) * 4 * (passes if qs == 2 else 1) * (2 if qs == 2 else 1)
    smem = (ldsm_block * LDSM_X4
            + sts * WAVEFRONT                             # dS^T (and P^T) stores, conflict-free
            + passes * warps * 2 * nq * WAVEFRONT         # lse2 / D (LDS.64, broadcast)
            + passes * (Br * (d + dv) * 2 + Br * 8))      # cp.async fills of Q, dO, lse2, D
    hmma = (2 * Br * Bc * (d + dv) * passes + 2 * Br * Bc * (d + dv) + 2 * Br * Bc * d) // HMMA_FLOP
    return dict(warps=warps, mt=mt, passes=passes, qs=qs, hmma=hmma, hmma_w=hmma_w, ldsm_w=ldsm_w,
                smem=smem, dq_tile=(dqm, dqn))


def fa2_step(d, cfg):
    """FA2's backward step modelled the same way: five GEMMs with operands from shared memory
    (A and B of each warp tile by ldmatrix), P and dS written to shared memory, Q/dO fills."""
    Br, Bc, w = cfg["Br"], cfg["Bc"], cfg["warps"]

    def gemm(M, N, K, wm):  # elements read: each warp reads its A rows and B columns
        wn = w // wm
        return K * (wn * M + wm * N)
    el = (gemm(Br, Bc, d, cfg["msdp"]) + gemm(Br, Bc, d, cfg["msdp"])    # S, dP
          + 2 * gemm(Bc, d, Br, cfg["ndkv"])                                # dV, dK
          + gemm(Br, d, Bc, cfg["mdq"]))                                    # dQ
    smem = 2 * el + 2 * (2 * Br * Bc) + Br * 2 * d * 2
    hmma = 2 * 5 * Br * Bc * d // HMMA_FLOP
    return dict(hmma=hmma, smem=smem)


def _bench_time(step_smem, step_hmma, Br, Bc, d, blocks_per_sm, ref_bytes_per_sm, ref_ms):
    """(predicted ms, HMMA floor ms, bytes per SM) for the benchmark shape."""
    H = BENCH["hidden"] // d
    blocks = BENCH["B"] * H * (BENCH["N"] // Bc)
    waves = -(-blocks // (BENCH["sms"] * blocks_per_sm))
    steps = BENCH["N"] // Br
    per_sm = waves * blocks_per_sm * steps * step_smem
    floor = waves * blocks_per_sm * steps * step_hmma * 2 / 1.755e9 * 1e3
    return per_sm / ref_bytes_per_sm * ref_ms, floor, per_sm


def _fa2_ref(d):
    cfg = FA2_BWD[d]
    st = fa2_step(d, cfg)
    _, floor, per_sm = _bench_time(st["smem"], st["hmma"], cfg["Br"], cfg["Bc"], d, 1, 1.0, 1.0)
    return cfg, st, per_sm, floor


def fa2_model_lines():
    out = []
    for d in sorted(FA2_BWD):
        cfg, st, per_sm, floor = _fa2_ref(d)
        out.append(f"  FA2 bwd d={d} Br={cfg['Br']} Bc={cfg['Bc']} {cfg['warps']} warps (H100, 1 block/SM): "
                   f"{st['hmma'] * HMMA_FLOP / 1e6:.1f} MFLOP = {st['hmma']} HMMA/step, {st['smem']} B smem "
                   f"({st['smem'] / st['hmma']:.0f} B/HMMA); measured {cfg['ms']} ms (floor {floor:.2f} ms)")
    return out


def tc_loop_trips(code, span, defines):
    """The trip counts of flash_bwd_tc's rolled inner loops with HMMA inside its main loop
    ``span``: {(start, end): trips per block step} (S^T k loop: d/16, dP^T k loop: dv/16, the
    dQ k loop: Bc/16, the dQ tile loop around it: its tiles per warp, the busiest warp's;
    {} when every inner loop is unrolled; the dQ tile loop alone when only it is rolled), or
    None when ptxas shaped them otherwise (it drops the dQ k loop when Bc = 16 and may rotate
    others)."""
    d, dv = int(defines["CUFLASH_HEAD_DIM"]), int(defines["CUFLASH_HEAD_DIM_V"])
    Br, Bc = int(defines["CUFLASH_BLOCK_Q"]), int(defines["CUFLASH_BLOCK_KV"])
    warps = int(defines["CUFLASH_THREADS"]) // 32
    dqm, dqn = _dq_tile(Br, d, warps)
    dq_tiles = (Br // dqm) * (d // dqn)
    lo, hi = span
    inner = sorted((a, b) for a, b in _sass._loops(code) if lo < a and b < hi)
    hm = [(a, b) for a, b in inner
          if any(op == "HMMA" for x, op, _ in code if a <= x <= b)]
    if not hm:  # every inner loop unrolled: the main loop's body is one step
        return {}
    # innermost HMMA loops in address order: S^T k loop, dP^T k loop, dQ k loop
    kk = [l for l in hm if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in hm)]
    if len(hm) == 1:
        # only the dQ tile loop rolled (its k loop unrolled): the whole dQ tile per iteration
        body = sum(1 for x, op, _ in code if hm[0][0] <= x <= hm[0][1] and op == "HMMA")
        if body == (dqm // 16) * (dqn // 8) * (Bc // 16):
            return {hm[0]: -(-dq_tiles // warps)}
        return None
    if len(kk) != 3 or len(hm) > 4:
        return None
    trips = dict(zip(kk, (d // 16, dv // 16, Bc // 16)))
    for l in hm:
        if l not in trips:  # the dQ tile loop around the dQ k loop
            trips[l] = -(-dq_tiles // warps)
    return trips


def tc_sass_step(code, span, defines):
    """HMMA and LDSM of one block step per warp from the SASS: the main loop's counts with
    each inner loop that holds HMMA weighted by its trip count (:func:`tc_loop_trips`)."""
    trips = tc_loop_trips(code, span, defines)
    if trips is None:
        return None
    tot = {"HMMA": 0, "LDSM": 0}
    for a, op, _ in code:
        if span[0] <= a <= span[1] and op in tot:
            w = 1
            for (lo, hi), n in trips.items():
                if lo <= a <= hi:
                    w *= n
            tot[op] += w
    return dict(HMMA=tot["HMMA"], LDSM=tot["LDSM"], passes=int(defines.get("CUFLASH_BWD_PASSES") or 1))


def bwd_model_line(row):
    """The model line of one backward kernel row (flash_bwd_tc; sm_90 rows only), or None."""
    if row["kernel"] != "flash_bwd_tc" or row["arch"] != 90:
        return None
    v = dict(kv.split("=") for kv in row["variant"].split() if "=" in kv)
    Br, Bc, d, dv = int(v["Br"]), int(v["Bc"]), int(v["d"]), int(v["dv"])
    st = tc_step(Br, Bc, d, dv)
    sass = row.get("sass_step")
    per = "warp-step" if st["passes"] == 1 else "warp-pass"
    s_txt = (f"SASS/{per} HMMA {sass['HMMA']} (model {st['hmma_w']}), LDSM {sass['LDSM']} "
             f"(model {st['ldsm_w']})" if sass else "SASS inner loops unrolled: no per-step count")
    if sass and Bc == 16:
        s_txt += " [block_kv 16: ptxas reshapes the dQ loops, the weighting does not apply]"
    keys = f"{16 * st['mt']} keys per warp" + (" pair (query split)" if st["qs"] == 2 else "")
    line = (f"  flash_bwd_tc {row['variant']}: {st['warps']} warps, {keys}, "
            f"{st['passes']} pass(es): {st['hmma'] * HMMA_FLOP / 1e6:.1f} MFLOP = {st['hmma']} HMMA/step, "
            f"{st['smem']} B smem ({st['smem'] / st['hmma']:.0f} B/HMMA); {s_txt}")
    if d == dv and d in FA2_BWD and row.get("blocks_per_sm"):
        cfg, fst, fa2_per_sm, _ = _fa2_ref(d)
        ms, floor, _ = _bench_time(st["smem"], st["hmma"], Br, Bc, d, row["blocks_per_sm"],
                                   fa2_per_sm, cfg["ms"])
        line += (f"; B=2 N=4096 H={BENCH['hidden'] // d}: predicted {ms:.2f} ms = {ms / cfg['ms']:.2f}x "
                 f"FA2's {cfg['ms']} ms ({row['blocks_per_sm']} block(s)/SM; HMMA floor {floor:.2f} ms)")
    return line


def _print_mix(rows):
    """Instruction mix of each kernel's main loop (static SASS counts)."""
    cols = list(_sass.CLASSES) + ["total"]
    head = ["kernel", "specialisation", "arch", *[f"loop {c}" for c in cols], "HMMA %", "kernel size"]
    lines = []
    for r in rows:
        if "sass_total" not in r:
            continue
        loop = r.get("sass_loop")
        vals = [str(loop[c]) if loop else "-" for c in cols]
        share = f"{100 * loop['HMMA'] / loop['total']:.1f}" if loop and loop["total"] else "-"
        lines.append([r["kernel"], r["variant"], f"sm_{r['arch']}", *vals, share, str(r["sass_total"])])
    _print_rows(head, lines)


def _print_rows(head, lines):
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    print(fmt.format(*head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for l in lines:
        print(fmt.format(*l))


def _print_table(rows):
    head = ["kernel", "specialisation", "arch", "regs", "spill st/ld", "stack", "static smem", "dyn smem",
            "threads", "blocks/SM", "occupancy", "limited by"]
    lines = []
    for r in rows:
        lines.append([r["kernel"], r["variant"], f"sm_{r['arch']}", str(r["registers"]),
                      f"{r['spill_stores']}/{r['spill_loads']}", str(r["stack"]), str(r["static_shared"]),
                      "?" if r["dynamic_shared"] is None else str(r["dynamic_shared"]),  # occupancy then assumes 0
                      "?" if r["threads"] is None else str(r["threads"]),
                      str(r.get("blocks_per_sm", "?")),
                      f"{100 * r['occupancy']:.0f}%" if "occupancy" in r else "?", r.get("limiter", "-")])
    _print_rows(head, lines)


if __name__ == "__main__":
    sys.exit(main())

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
  the kernel's total size (``--no-sass`` skips it).

No GPU is needed.  Usage::

    python bench/kernel_report.py                    # sm_80 and sm_90, every kernel
    python bench/kernel_report.py --arch 80 --fail-on-spill
    python bench/kernel_report.py --tests            # the test kernels too
"""
import argparse
import concurrent.futures as cf
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, _sass  # noqa: E402

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
# launch sizes of the test kernels (tests/kernels/*.cu), as their tests launch them
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


def launch_size(kernel, options, ptx):
    """(threads per block, dynamic shared bytes, source) for one kernel of a specialisation."""
    if kernel in _TEST_LAUNCH:
        return (*_TEST_LAUNCH[kernel], "test")
    d = _defines(options)
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


def _compile_one(job):
    path, options, arch, want_sass = job
    opts = (f"-arch=sm_{arch}", "--ptxas-options=-v", f"-I{ROOT / 'kernels_cu'}", f"-I{Path(path).parent}",
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
        files += sorted((ROOT / "tests" / "kernels").glob("*.cu"))
    out = []
    for f in files:
        if only and not any(s in f.name for s in only):
            continue
        for opts in variants.get(f.name) or extra.get(f.name) or [()]:
            for arch in archs:
                out.append((str(f), tuple(opts), arch, sass))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCH_LIMITS),
                    help="architectures (default: 80 90)")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit with status 1 if any kernel spills")
    ap.add_argument("--tests", action="store_true", help="also report the test kernels of tests/kernels/")
    ap.add_argument("--only", nargs="+", help="only files whose name contains one of these strings")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="parallel NVRTC compiles")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--no-sass", action="store_true",
                    help="skip the instruction mix (cuobjdump -sass of every cubin)")
    args = ap.parse_args(argv)
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
                rows.append(row)
    finally:
        if ex:
            ex.shutdown()
    print(file=sys.stderr)
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if any("sass_total" in r for r in rows):
        print()
        _print_mix(rows)
    for (path, options, arch, _), err in failures:
        print(f"\nFAILED to compile {Path(path).name} sm_{arch} {' '.join(options)}:\n{err}", file=sys.stderr)
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    if spills:
        print(f"\n{len(spills)} kernel specialisation(s) spill registers to local memory:")
        for r in spills:
            print(f"  {r['kernel']} sm_{r['arch']} [{r['variant']}]: {r['spill_stores']} B stores, "
                  f"{r['spill_loads']} B loads")
    if failures:
        return 1
    if args.fail_on_spill and spills:
        return 1
    return 0


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

"""Compile every plan the planner accepts for the tensor-core kernels and check that none spills.

Issue 12: a tile pair the library accepts must not fall off a register cliff (the H100 tile
sweep measured 10-270x slowdowns for spilling plans).  cuflash.tiling accepts a plan of
flash_fwd_tc / flash_fwd_tf32 / flash_bwd_tf32 from a register budget (and picks 16 instead
of 32 query rows per warp where 32 would not fit); this script holds that budget to what ptxas
does: every accepted (block_q, block_kv) at every head dim d = dv in 16..256 (multiples of 16)
is compiled with NVRTC (``--ptxas-options=-v``) and its spill stores/loads are read
(``cuflash._nvrtc.parse_ptxas_info``).  No GPU needed; ~2-4 s per compile and architecture.
``tests/test_tc_plans.py`` runs the largest plans of each kind on every CI run.

Usage::

    python bench/tc_plan_sweep.py                         # all three kernels, sm_80
    python bench/tc_plan_sweep.py --kernels flash_fwd_tc --dtypes float16 --arch 80 90
    python bench/tc_plan_sweep.py --json sweep.json
"""
import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cuflash import _nvrtc, kernels, tiling  # noqa: E402

_DTYPES = {"flash_fwd_tc": ("float16", "bfloat16"), "flash_fwd_tf32": ("float32",),
           "flash_bwd_tf32": ("float32",)}


def accepted_plans(kernel, dtype, dims):
    """Every (d, block_q, block_kv) the planner accepts for ``kernel`` at head dims ``dims``."""
    t = tiling.kernel_tiling(kernel)
    for d in dims:
        for bq in t.block_q_choices:
            for bkv in t.block_kv_choices:
                if t.check(bq, bkv, d, d) is None:
                    yield tiling.plan(kernel, d, d, dtype, bq, bkv)


def compile_plan(job):
    """(plan, arch) -> dict with registers, spill stores/loads (bytes), seconds; or an error."""
    plan, arch = job
    fname = kernels.KERNEL_SOURCES[plan.kernel]
    src = (ROOT / "kernels_cu" / fname).read_text()
    opts = (f"-arch=sm_{arch}", "--ptxas-options=-v", f"-I{ROOT / 'kernels_cu'}",
            *[o for o in kernels.build_options(kernels.plan_defines(plan)) if not o.startswith("-I")])
    t0 = time.perf_counter()
    row = dict(kernel=plan.kernel, dtype=plan.dtype, d=plan.d, dv=plan.dv, block_q=plan.block_q,
               block_kv=plan.block_kv, threads=plan.threads, arch=arch)
    try:
        res = _nvrtc.compile(src, fname, opts)
    except _nvrtc.NVRTCError as e:
        row["error"] = e.log[-2000:]
        return row
    info = _nvrtc.parse_ptxas_info(res.log)[plan.kernel]
    row.update(registers=info["registers"], spill_stores=info["spill_stores"],
               spill_loads=info["spill_loads"], seconds=round(time.perf_counter() - t0, 2))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="+", default=list(_DTYPES), choices=list(_DTYPES))
    ap.add_argument("--dtypes", nargs="+", help="restrict the dtypes (default: each kernel's)")
    ap.add_argument("--arch", type=int, nargs="+", default=[80])
    ap.add_argument("--dims", type=int, nargs="+", default=list(range(16, 257, 16)))
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args(argv)
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    todo = []
    for k in args.kernels:
        for dt in _DTYPES[k]:
            if args.dtypes and dt not in args.dtypes:
                continue
            for p in accepted_plans(k, dt, args.dims):
                todo += [(p, a) for a in args.arch]
    print(f"{len(todo)} compiles (NVRTC {'.'.join(map(str, _nvrtc.version()))})", file=sys.stderr)
    rows = []
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for i, row in enumerate(ex.map(compile_plan, todo), 1):
            rows.append(row)
            print(f"\r[{i}/{len(todo)}]", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    bad = [r for r in rows if r.get("error") or r.get("spill_stores") or r.get("spill_loads")]
    for r in bad:
        what = "compile error" if r.get("error") else f"spills {r['spill_stores']}/{r['spill_loads']} B"
        print(f"{r['kernel']} {r['dtype']} d={r['d']} block_q={r['block_q']} block_kv={r['block_kv']} "
              f"threads={r['threads']} sm_{r['arch']}: {what}")
    most = max((r for r in rows if "registers" in r), key=lambda r: r["registers"], default=None)
    print(f"{len(rows)} plans compiled, {len(bad)} spill or fail"
          + (f"; most registers: {most['registers']} ({most['kernel']} d={most['d']} "
             f"{most['block_q']}x{most['block_kv']})" if most else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Instruction mix of one kernel plan, as compiled from a git revision and from this tree.

For the "change one thing, count" step without a GPU: compiles the same plan of a compile group
(bench/plan_sweep.py GROUPS) from ``--rev``'s kernels_cu and from the working tree, and prints
the SASS instruction classes of the whole kernel and of its main loop (cuflash._sass: the loop
with the most MMA, else FMA instructions) side by side, with registers and spills.

Usage::

    python bench/sass_diff.py --rev HEAD~1 --group flash_fwd --dtype float32 --d 64 \\
        --tiles 64 32 --arch 90
    # the tensor-core forward's steady-state tile only (bench/results/tc_kernels_counts.md)
    python bench/sass_diff.py --rev HEAD~1 --group flash_fwd_tc --dtype float16 --d 128 \\
        --arch 80 --define CUFLASH_FWD_INTERIOR_ONLY=1
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_sweep as ps  # noqa: E402
from cuflash import _nvrtc, _sass, kernels, tiling  # noqa: E402


def counts(res, kernel):
    """(ptxas figures, whole-kernel mix, main-loop mix) of ``kernel`` in a CompileResult."""
    instrs = _sass.instructions(_sass.disassemble(res.cubin))[kernel]
    info = _nvrtc.parse_ptxas_info(res.log)[kernel]
    return info, _sass.mix(instrs), _sass.mix(instrs, _sass.main_loop(instrs))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True)
    ap.add_argument("--group", required=True, choices=[g for g, spec in ps.GROUPS.items() if spec[2]])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--dv", type=int)
    ap.add_argument("--tiles", type=int, nargs=2, metavar=("BQ", "BKV"))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="an extra -D for both compiles (repeatable)")
    args = ap.parse_args(argv)
    more = dict((d.split("=", 1) + [None])[:2] for d in args.define)
    # the group's table for this dtype (flash_fwd_tc's: flash_fwd_tc, or flash_fwd_tf32 for
    # float32), and the kernel the serving builds launch
    kernel = next(k for k in ps.GROUPS[args.group][2]
                  if args.dtype in tiling.curated.table(k))
    checked = {"flash_fwd_serving": "flash_fwd_serving",
               "flash_fwd_serving_masked": "flash_fwd_serving_masked"}.get(args.group, kernel)
    bq, bkv = args.tiles or (None, None)
    plan = tiling.plan(kernel, args.d, args.dv or args.d, args.dtype, bq, bkv,
                       limit=tiling.EMULATOR_ARCHES[f"sm_{args.arch}"])
    print(plan.describe())
    job = ps.Job(args.group, "sass_diff", dict(kernels.plan_defines(plan), **more), args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        old = counts(ps.compile_result(job, ps.export_kernels(args.rev, tmp)), checked)
    new = counts(ps.compile_result(job), checked)
    print(f"{checked} sm_{args.arch}: registers {old[0]['registers']} -> {new[0]['registers']}, "
          f"spills {old[0]['spill_stores']} -> {new[0]['spill_stores']} B")
    print(f"{'class':12s} {'kernel ' + args.rev:>16s} {'kernel now':>12s} {'loop ' + args.rev:>14s} "
          f"{'loop now':>10s}")
    for name in new[1]:
        print(f"{name:12s} {old[1][name]:16d} {new[1][name]:12d} {old[2][name]:14d} {new[2][name]:10d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

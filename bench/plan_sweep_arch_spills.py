"""Re-derive the per-architecture spill refusals of the tensor-core kernels from the record.

``cuflash/tiling/_asym_spills.py`` (default plans at the d != dv pairs outside
``TC_ASYM_SWEPT``) and ``cuflash/tiling/_arch_spills.py`` (plans at d == dv and at the swept
pairs) refuse, per architecture, the plans of the tensor-core backward kernels (flash_bwd_tc,
flash_bwd_tf32 and their masked builds), of the float16 forward with the features
(flash_fwd_tc_masked) and of the float32 forward (flash_fwd_tf32 and its masked build) --
KERNELS -- that ptxas spilled.  After a kernel edit and
``bench/plan_sweep.py --families <those kernels' families> --write`` (which compiles only the
plans the planner accepts, so the rows of the refused ones drop out of the record):

1. every plan refused by those two files that the record now lacks is compiled from this
   tree (its row taken from the record at ``--rev``, the revision before the edit) and added
   -- the record keeps a row for every refusal, spilling or not;
2. both files' entries for the two kernels are rebuilt from the record: every spilling row, by
   architecture (a refused plan that now compiles clean is accepted again);
3. then run ``bench/plan_sweep.py --families ... --missing`` (the defaults that moved) and
   this script again, until it adds nothing and the sweep finds no spill.

Usage::

    python bench/plan_sweep_arch_spills.py --rev HEAD~1           # report only
    python bench/plan_sweep_arch_spills.py --rev HEAD~1 --write   # update record and files
"""
import argparse
import concurrent.futures as cf
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_sweep as ps  # noqa: E402
import plan_sweep_rehash as rh  # noqa: E402
from cuflash import tiling  # noqa: E402

KERNELS = {"flash_bwd_tc": ("flash_bwd_tc", "flash_bwd_tc_asym"),
           "flash_bwd_tc_masked": ("flash_bwd_tc_masked", "flash_bwd_tc_masked_asym"),
           "flash_bwd_tf32": ("flash_bwd_tf32", "flash_bwd_tf32_asym"),
           "flash_bwd_tf32_masked": ("flash_bwd_tf32_masked", "flash_bwd_tf32_masked_asym"),
           "flash_fwd_tc_masked": ("flash_fwd_tc_masked", "flash_fwd_tc_masked_asym"),
           "flash_fwd_tf32": ("flash_fwd_tf32", "flash_fwd_tf32_asym"),
           "flash_fwd_tf32_masked": ("flash_fwd_tf32_masked", "flash_fwd_tf32_masked_asym")}
TILING = ps.ROOT / "cuflash" / "tiling"


def _is_asym_default(d, dv):
    return d != dv and (d, dv) not in tiling.TC_ASYM_SWEPT


def _refused(kernel, r):
    key = (r["block_q"], r["block_kv"], r["d"], r["dv"])
    table = tiling.ASYM_DEFAULT_SPILLS if _is_asym_default(r["d"], r["dv"]) else tiling.ARCH_SPILLS
    return r["arch"] in table.get(kernel, {}).get(key, ())


def _block(kernel, entries):
    """A kernel's dict literal, wrapped at 100 columns."""
    lines, cur = [], "       "
    for k, v in entries.items():
        item = f" {k}: {v},"
        if len(cur) + len(item) > 100:
            lines.append(cur)
            cur = "       "
        cur += item
    if cur.strip():
        lines.append(cur)
    return (f'    "{kernel}": {{  # (block_q, block_kv, d, dv): architectures it spilled on\n'
            + "".join(line + "\n" for line in lines) + "    },\n")


def _rewrite(path, name, blocks):
    """Replace (or add) each kernel's block of the dict ``name`` in ``path``."""
    text = path.read_text()
    for kernel, block in blocks.items():
        pat = re.compile(rf'    "{kernel}": \{{  # \(block_q, block_kv, d, dv\): architectures it '
                         rf'spilled on\n(?:        .*\n)*    \}},\n')
        if pat.search(text):
            text = pat.sub(lambda m: block, text)
        else:
            text = text.replace(f"{name} = {{\n", f"{name} = {{\n{block}", 1)
    path.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="a revision whose record holds the refused plans' rows")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="update the record and the two files")
    args = ap.parse_args(argv)
    old = json.loads(subprocess.run(["git", "-C", str(ps.ROOT), "show", f"{args.rev}:bench/results/plan_sweep.json"],
                                    check=True, capture_output=True, text=True).stdout)["families"]
    doc = json.loads(ps.RESULTS.read_text())
    todo = []
    for kernel, fams in KERNELS.items():
        for fam in fams:
            have = {r["key"] for r in doc["families"][fam]["rows"]}
            todo += [(fam, rh._plan_of(r), r["arch"]) for r in old[fam]["rows"]
                     if "kernels" in r and r["key"] not in have and _refused(kernel, r)]
    print(f"{len(todo)} refused plans without a row: compiled", file=sys.stderr)
    with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for row in ex.map(ps.compile_plan, todo, chunksize=4):
            doc["families"][row["family"]]["rows"].append(row)
    asym, arch = {}, {}
    for kernel, fams in KERNELS.items():
        found = {}
        for fam in fams:
            doc["families"][fam]["rows"].sort(key=lambda r: r["key"])
            for r in doc["families"][fam]["rows"]:
                if ps.bad(r):
                    found.setdefault((r["block_q"], r["block_kv"], r["d"], r["dv"]), set()).add(r["arch"])
        asym[kernel] = {k: tuple(sorted(v)) for k, v in sorted(found.items()) if _is_asym_default(k[2], k[3])}
        arch[kernel] = {k: tuple(sorted(v)) for k, v in sorted(found.items()) if not _is_asym_default(k[2], k[3])}
        for name, new, cur in (("_asym_spills", asym[kernel], tiling.ASYM_DEFAULT_SPILLS.get(kernel, {})),
                               ("_arch_spills", arch[kernel], tiling.ARCH_SPILLS.get(kernel, {}))):
            added = sorted(k for k in new if new[k] != cur.get(k))
            print(f"{kernel} {name}: {len(cur)} -> {len(new)} entries; changed or added {len(added)}, "
                  f"removed {len(set(cur) - set(new))}")
    if args.write:
        tmp = ps.RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
        tmp.replace(ps.RESULTS)
        _rewrite(TILING / "_asym_spills.py", "ASYM_DEFAULT_SPILLS", {k: _block(k, v) for k, v in asym.items()})
        _rewrite(TILING / "_arch_spills.py", "ARCH_SPILLS", {k: _block(k, v) for k, v in arch.items()})
        print("wrote the record, _asym_spills.py and _arch_spills.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())

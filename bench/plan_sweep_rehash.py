"""Carry the spill record over a source edit that cannot change a family's machine code.

``bench/plan_sweep.py`` records, per kernel family, the hash of the sources it compiled; any
edit of a file the family includes (params.cuh is included by all of them) invalidates the
record, and a whole re-sweep is hours of compiles.  Some edits provably leave a family's code
alone -- e.g. fields appended at the end of a parameter struct that the family never reads: no
offset it uses moves.  This script checks that claim by compiling, for every family whose
record no longer matches, a sample of its recorded plans from both trees (``--rev``'s
kernels_cu and this one) and comparing NVRTC's PTX and cubin byte for byte, or where those
differ, every kernel's SASS and ptxas resource line (data no kernel reads may differ).  Where every
sample is identical, the family's record takes the new hash, with a ``rehashed`` entry saying
from which hash, against which revision and on how many plans; where one differs, nothing is
carried and the family must be swept again (``plan_sweep.py --families F --write``).

The sample per family: for each (dtype, architecture) of the record, the plan with the most
registers and the one with the fewest (the extremes of what ptxas allocates), and
EXTRA_RANDOM more of its plans drawn at random (fixed seed).

Usage::

    python bench/plan_sweep_rehash.py --rev HEAD             # check, and update the record
    python bench/plan_sweep_rehash.py --rev HEAD --dry-run   # check only
"""
import argparse
import concurrent.futures as cf
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_sweep as ps  # noqa: E402
from cuflash import tiling  # noqa: E402


def export_kernels(rev, dest):
    """kernels_cu as of git revision ``rev``, written under ``dest``; returns that directory."""
    out = Path(dest) / "kernels_cu"
    out.mkdir(parents=True)
    names = subprocess.run(["git", "-C", str(ps.ROOT), "ls-tree", "--name-only", rev, "kernels_cu/"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ps.ROOT), "show", f"{rev}:{name}"], check=True,
                              capture_output=True).stdout
        (out / Path(name).name).write_bytes(blob)
    return out


EXTRA_RANDOM = 6


def sample_rows(rows):
    """Per (dtype, arch): the recorded row with the most registers and the one with the fewest;
    and EXTRA_RANDOM rows at random."""
    import random
    groups = {}
    for r in rows:
        if "kernels" in r:
            groups.setdefault((r["dtype"], r["arch"]), []).append(r)
    out = []
    for g in groups.values():
        g.sort(key=lambda r: (sum(k["registers"] for k in r["kernels"].values()), r["key"]))
        out += [g[0], g[-1]] if len(g) > 1 else g
    keys = {r["key"] for r in out}
    rest = sorted((r for r in rows if "kernels" in r and r["key"] not in keys), key=lambda r: r["key"])
    return out + random.Random(20261124).sample(rest, min(EXTRA_RANDOM, len(rest)))


def _plan_of(row):
    """The TilePlan a record row was compiled from (the fields its -D defines are built of;
    the record's head dims are the compiled ones)."""
    return tiling.TilePlan(
        kernel=ps.FAMILIES[row["family"]][1], block_q=row["block_q"], block_kv=row["block_kv"],
        d=row["d"], dv=row["dv"], dtype=row["dtype"],
        acc_bytes=tiling.accumulator_bytes(row["dtype"]), threads=row["threads"],
        shared_bytes=row["shared_bytes"], limit=-1, limit_source="record", chosen="explicit",
        kd=row["d"], kdv=row["dv"])


def _machine_code(res):
    """Every kernel's SASS (opcodes and operands, addresses included) and ptxas's resource
    line (registers, spills, stack, static shared memory) of one compile."""
    from cuflash import _nvrtc, _sass
    ins = _sass.instructions(_sass.disassemble(res.cubin))
    return ({k: [(a, op, args) for a, op, args in v] for k, v in ins.items()},
            _nvrtc.parse_ptxas_info(res.log))


def _same(job):
    """(key, identical?) of one row compiled from the old tree and from this one: the same
    PTX and cubin bytes, or -- where only data the kernels never read differs (e.g. a
    helper's static constexpr members, which NVRTC emits as named globals, renamed by a move
    into a header) -- the same machine code of every kernel (:func:`_machine_code`)."""
    row, old_dir = job
    plan = _plan_of(row)
    a = ps.compile_family_plan(row["family"], plan, row["arch"], old_dir)
    b = ps.compile_family_plan(row["family"], plan, row["arch"])
    if a.ptx == b.ptx and a.cubin == b.cubin:
        return row["key"], True
    return row["key"], _machine_code(a) == _machine_code(b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the git revision the record was swept at")
    ap.add_argument("--families", nargs="+", choices=list(ps.FAMILIES),
                    help="only these (default: every family whose record is stale)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dry-run", action="store_true", help="compare only; leave the record")
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "-C", str(ps.ROOT), "rev-parse", args.rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    doc = json.loads(ps.RESULTS.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        old_dir = export_kernels(rev, tmp)
        stale = {}
        for fam, rec in doc["families"].items():
            if (fam not in ps.FAMILIES or rec["source_hash"] == ps.family_hash(fam)
                    or (args.families and fam not in args.families)):
                continue
            if rec["source_hash"] != ps.family_hash(fam, old_dir):
                print(f"{fam}: its record is not of {rev}'s sources either: sweep it")
                continue
            stale[fam] = sample_rows(rec["rows"])
        jobs = [(r, old_dir) for rows in stale.values() for r in rows]
        print(f"{len(stale)} families, {len(jobs)} plans compiled twice", file=sys.stderr)
        with cf.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
            same = dict(ex.map(_same, jobs, chunksize=2))
    carried = []
    for fam, rows in stale.items():
        diff = [r["key"] for r in rows if not same[r["key"]]]
        if diff:
            print(f"{fam}: {len(diff)} of {len(rows)} sample plans compile differently "
                  f"(e.g. {diff[0]}): sweep it (plan_sweep.py --families {fam} --write)")
            continue
        print(f"{fam}: {len(rows)} sample plans compile to the same machine code: carried")
        carried.append(fam)
        rec = doc["families"][fam]
        rec["rehashed"] = rec.get("rehashed", []) + [
            {"from": rec["source_hash"], "rev": rev, "identical_plans": len(rows)}]
        rec["source_hash"] = ps.family_hash(fam)
    if carried and not args.dry_run:
        tmp = ps.RESULTS.with_suffix(".tmp")  # whole or not at all: a sweep may be reading it
        tmp.write_text(json.dumps(doc, indent=0, sort_keys=True) + "\n")
        tmp.replace(ps.RESULTS)
        print(f"wrote {ps.RESULTS}")
    return 0 if len(carried) == len(stale) else 1


if __name__ == "__main__":
    sys.exit(main())

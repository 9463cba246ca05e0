"""FlashAttention-3's main loops in machine code, every compiled variant, counted as
``bench/hopper_sass_count.py`` counts cuflash's flash_fwd_wgmma and flash_bwd_wgmma.

Usage (no GPU; downloads one wheel, about 23 MB, into a cache folder)::

    python bench/fa3_sass_count.py              # prints the table, writes bench/results/fa3_sass_count.md
    python bench/fa3_sass_count.py --no-write

FA3 is taken from the public ``flash-attn3-jax`` wheel (``pip download --no-deps``, unpacked,
never installed): its cubins for sm_90a, extracted with cuobjdump.  For each backward kernel of
the head dims asked for, the loop with the most HGMMA is counted over one steady trip per warp
(the longer arm of each if/else left out, out-of-line blocks the loop returns from added:
``fa2_sass_compare.steady_ops``) and normalised per 1,000 HMMA.16816-equivalents (an
HGMMA.64xNx16 is N / 8 of them).  Each row names the variant by the template arguments of its
mainloop: the tile (queries per step x keys per block x head dim) and the flags Is_causal,
Is_local, Has_softcap, Varlen, Deterministic.  The wheel compiles a different tile for
different flags, which is what the table shows: one figure per head dim hides it.

The forward (float16, d = 128) likewise, but its loop is the innermost one with the most HGMMA
(the shortest of those: the causal and local kernels' steady loop, not their masking one): one trip of it is one K/V tile's S = Q K^T and O += P V with its softmax, O rescaled on every
tile.  Its rows name the variant by CollectiveMainloopFwdSm90's tile (queries x keys x d), its
cluster and its flags (Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV,
HasQv, PackGQA, Split, V_colmajor).
"""
import argparse
import collections
import datetime
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import fa2_sass_compare as fc  # noqa: E402
import hopper_sass_count as hc  # noqa: E402
from cuflash import _sass  # noqa: E402

WHEEL, WHEEL_VERSION = "flash-attn3-jax", "0.2.3"
DEFAULT_CACHE = Path.home() / ".cache" / "cuflash" / "fa3_wheels"
RESULT = HERE / "results" / "fa3_sass_count.md"
FLAGS = ("causal", "local", "softcap", "varlen", "deterministic")
# CollectiveMainloopBwdSm90<Stages, Stages_dO, Stages_dS, ClusterShape, TileShape_MNK, Element,
#   ElementAccum, ArchTag, Is_causal, Is_local, Has_softcap, Varlen, Deterministic, ...>
_MAINLOOP = re.compile(r"CollectiveMainloopBwdSm90<\d+, \d+, \d+, cute::tuple<(?:cute::C<\d+>, ){2}cute::C<\d+> >, "
                       r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >, [^,]+, [^,]+, "
                       r"[^,]+, (\w+), (\w+), (\w+), (\w+), (\w+),")


def backward_sass(wheel, cache, d, kind="bwd"):
    """cuobjdump's SASS of the wheel's float16 backward (``kind`` "fwd": forward) cubin for head
    dim ``d``."""
    cuobjdump = _sass.find_cuobjdump()
    if cuobjdump is None:
        raise RuntimeError(_sass.is_available()[1])
    out = Path(cache) / wheel.name[:-len(".whl")]
    cubin = out / f"flash_{kind}_hdim{d}_fp16_sm90.sm_90a.cubin"
    if not cubin.exists():
        with zipfile.ZipFile(wheel) as z:
            (lib,) = [n for n in z.namelist() if n.endswith(".so") and "flash_api" in n]
            so = out / lib
            if not so.exists():
                z.extract(lib, out)
        listed = fc._run([cuobjdump, "-lelf", str(so)])
        if cubin.name not in listed:
            have = sorted(set(re.findall(rf"flash_{kind}_hdim\d+_fp16_sm90", listed)))
            raise RuntimeError(f"{wheel.name} has no {cubin.name} (float16 {kind}: {have})")
        fc._run([cuobjdump, "-xelf", cubin.name, str(so)], cwd=out)
    return fc._run([cuobjdump, "-sass", str(cubin)])


def _kernels(sass):
    """(instructions, base rows, loops, demangled name) of each kernel of ``sass`` with a loop."""
    kernels = fc.parse_sass(sass)
    names = list(kernels)
    demangled = subprocess.run(["c++filt"], input="\n".join(names), text=True,
                               capture_output=True, check=True).stdout.splitlines()
    for name, dm in zip(names, demangled):
        b = fc.base(kernels[name])
        loops = _sass._loops(b)
        if loops:
            yield kernels[name], b, loops, dm


def variants(sass):
    """[(tile, flags, ops, HMMA-equivalents)] of each backward kernel with HGMMA in a loop."""
    out = []
    for instrs, b, loops, dm in _kernels(sass):
        m = _MAINLOOP.search(dm)
        if m is None:
            continue
        span = max(loops, key=lambda s: sum(1 for a, op, _ in b if s[0] <= a <= s[1] and op == "HGMMA"))
        ops, _, _, _ = fc.steady_ops(instrs, span)
        eq = hc.hmma_equivalents(ops)
        if eq:
            tile = "x".join(m.group(i) for i in (1, 2, 3))
            flags = [f for f, v in zip(FLAGS, m.groups()[3:]) if v == "true"]
            out.append((tile, flags, ops, eq))
    return out


# CollectiveMainloopFwdSm90<Stages, ClusterShape, TileShape_MNK, kHeadDimV, Element, ElementAccum,
#   ArchTag, Is_causal, Is_local, Has_softcap, Varlen, PagedKVNonTMA, AppendKV, HasQv,
#   MmaPV_is_RS, IntraWGOverlap, PackGQA, Split, V_colmajor>
FWD_FLAGS = ("causal", "local", "softcap", "varlen", "paged", "append_kv", "qv", None, None, "pack_gqa", "split",
             "v_colmajor")
_FWD_MAINLOOP = re.compile(r"CollectiveMainloopFwdSm90<\d+, cute::tuple<cute::C<(\d+)>, cute::C<\d+>, cute::C<\d+> >, "
                           r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >, \d+, [^,]+, [^,]+, [^,]+, "
                           + ", ".join([r"(\w+)"] * len(FWD_FLAGS)) + ">")


def forward_loop(b, loops):
    """The (start, end) of the forward's steady loop among ``loops`` of the instructions ``b``
    ((address, opcode, ...) rows): of the innermost loops, the one with the most HGMMA, and of
    those (causal and local kernels have a masking loop besides the steady one) the shortest;
    None when no innermost loop has an HGMMA."""
    innermost = [s for s in loops if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in loops)]
    hg = {s: sum(1 for a, op, *_ in b if s[0] <= a <= s[1] and op == "HGMMA") for s in innermost}
    size = {s: sum(1 for a, *_ in b if s[0] <= a <= s[1]) for s in innermost}
    span = max(innermost, key=lambda s: (hg[s], -size[s]), default=None)
    return span if span is not None and hg[span] else None


def forward_variants(sass):
    """[(tile, flags, ops, HMMA-equivalents)] of each forward kernel: one trip of its innermost
    loop with the most HGMMA, the shortest of those (the cluster size, when 2, among the flags)."""
    out = []
    for instrs, b, loops, dm in _kernels(sass):
        m = _FWD_MAINLOOP.search(dm)
        span = forward_loop(b, loops) if m else None
        if span is None:
            continue
        ops, _, _, _ = fc.steady_ops(instrs, span)
        tile = "x".join(m.group(i) for i in (2, 3, 4))
        flags = [f for f, v in zip(FWD_FLAGS, m.groups()[4:]) if f and v == "true"]
        if m.group(1) != "1":
            flags.append(f"cluster {m.group(1)}")
        out.append((tile, flags, ops, hc.hmma_equivalents(ops)))
    return out


def table(rows):
    head = ("| tile (q x k x d) | flags | HGMMA | instructions | per 1,000 HMMA-eq | "
            + " | ".join(fc.CLASS_NAMES) + " |")
    lines = [head, "|---" * (5 + len(fc.CLASS_NAMES)) + "|"]
    for tile, flags, ops, eq in sorted(rows, key=lambda r: (r[0], r[1])):
        cls = fc.classify(ops)
        shapes = collections.Counter(f.split(".")[1] for f in ops.elements() if f.startswith("HGMMA"))
        lines.append(f"| {tile} | {', '.join(flags) or '-'} | "
                     + ", ".join(f"{k} {s}" for s, k in sorted(shapes.items())) + f" | {cls['total']} | "
                     + f"**{1000 * cls['total'] / eq:.0f}** | "
                     + " | ".join(f"{1000 * cls[n] / eq:.0f}" for n in fc.CLASS_NAMES) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--d", type=int, nargs="+", default=[128],
                    help="head dims (the wheel's float16 backward is compiled for 128 only)")
    ap.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    wheel = fc.fetch_wheel(args.wheel_dir, WHEEL, WHEEL_VERSION)
    parts = [f"# FlashAttention-3's main loops, every variant (float16, sm_90a, {datetime.date.today()})",
             "", f"Command: `python bench/fa3_sass_count.py`. {wheel.name} (unpacked, not installed); "
             "one steady trip per warp of each backward kernel's loop with the most HGMMA, and of each "
             "forward kernel's innermost loop with the most HGMMA (one K/V tile), counted as "
             "`bench/hopper_sass_count.py` counts flash_bwd_wgmma and flash_fwd_wgmma "
             "(bench/results/hopper_sass_count.md). "
             "Kernels that differ only outside the mainloop (the epilogue, the scheduler) "
             "have rows of their own.", ""]
    for d in args.d:
        parts += [f"## Backward, d = {d}", "", table(variants(backward_sass(wheel, args.wheel_dir, d))), ""]
    parts += ["## Forward, d = 128", "", table(forward_variants(backward_sass(wheel, args.wheel_dir, 128, "fwd"))), ""]
    return hc.emit("\n".join(parts), None if args.no_write else RESULT)


if __name__ == "__main__":
    sys.exit(main())

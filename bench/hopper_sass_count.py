"""The Hopper kernels' main loops in machine code: instructions per 1,000 HMMA-equivalents.

No GPU is needed: NVRTC compiles kernels_cu/flash_fwd_wgmma.cu for sm_90a with
``-DCUFLASH_FWD_INTERIOR_ONLY`` (only the path of a steady-state K/V tile: no mask), and
the consumer warpgroups' loop (``cuflash._sass.main_loop``) is counted per warp for one
trip with bench/fa2_sass_compare.py's method (``steady_ops``), in two rows per head dim:

* ``lazy``: the rescale of O and l compiled out, the row maxima and their warp vote kept (a
  store on the vote, never taken at run time, sinks them: one predicated branch and store more
  than the kernel's own lazy trip) -- a tile where no row's max moves by more than 2^8 (most
  tiles);
* ``rescale``: with ``-DCUFLASH_FWD_COUNT_RESCALE`` -- the rescale taken on every tile.

An HGMMA.64xNx16 counts as N/8 HMMA.16816 per warp (each warp of the warpgroup issues it for
its 16 rows).  FlashAttention-3's forward at d=128 (128x176 tiles, flash-attn3-jax 0.2.3)
issues 1699 per 1,000 counted this way (``bench/fa3_sass_count.py``; 1688 in
../shared/docs/sass-baseline.md), rescaling on every tile; its causal kernel, at 128 x 128,
1871-1883.

flash_bwd_wgmma (kernels_cu/flash_bwd_wgmma.cu) likewise with ``-DCUFLASH_BWD_INTERIOR_ONLY``
(a (head, query tile) step off the causal diagonal): its consumers' loop, one trip per warp --
S^T, dP^T, dV, dK and the dQ chunks with their reds (at d = 192, 256 a trip of consumer 0, whose
dQ chunks are 0 and 2: at d = 192 one more than consumer 1's).  FlashAttention-3's backward at d=128
issues 1298-1308 per 1,000 in its non-causal kernel (80 queries per step; 1290 in
sass-baseline.md); its causal kernel, with this kernel's 64 x 128 tile, 1528-1534
(``bench/fa3_sass_count.py``).

    python bench/hopper_sass_count.py             # print the table, write bench/results/
    python bench/hopper_sass_count.py --no-write
"""
import argparse
import collections
import datetime
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import fa2_sass_compare as fc  # noqa: E402
from cuflash import _nvrtc, _sass  # noqa: E402

SRC = ROOT / "kernels_cu" / "flash_fwd_wgmma.cu"
BWD_SRC = ROOT / "kernels_cu" / "flash_bwd_wgmma.cu"
RESULT = HERE / "results" / "hopper_sass_count.md"
CONFIGS = ((64, 128), (128, 128), (128, 176), (128, 192), (128, 64), (256, 64))  # (d, block_kv)
BWD_CONFIGS = ((64, 128), (128, 128), (192, 64), (256, 64))  # (d, block_kv)


def count(d, bc, rescale, backward=False):
    """(Counter of full opcodes of one steady trip, HMMA-equivalents, ptxas figures)."""
    src, name = (BWD_SRC, "flash_bwd_wgmma") if backward else (SRC, "flash_fwd_wgmma")
    opts = ["-arch=sm_90a", "-DCUFLASH_DTYPE_F16", f"-DCUFLASH_HEAD_DIM={d}", f"-DCUFLASH_BLOCK_KV={bc}",
            f"-I{ROOT / 'kernels_cu'}", "-std=c++17", "-ftz=true", "--ptxas-options=-v",
            "-DCUFLASH_BWD_INTERIOR_ONLY" if backward else "-DCUFLASH_FWD_INTERIOR_ONLY"]
    if rescale:
        opts.append("-DCUFLASH_FWD_COUNT_RESCALE")
    r = _nvrtc.compile(src.read_text(), src.name, tuple(opts))
    info = _nvrtc.parse_ptxas_info(r.log)[name]
    instrs = fc.parse_sass(_sass.disassemble(r.cubin))[name]
    b = fc.base(instrs)
    span = _sass.main_loop(b)
    ops, _, _, _ = fc.steady_ops(instrs, span)
    return ops, hmma_equivalents(ops), info


def hmma_equivalents(ops):
    """HMMA.16816-equivalents of a Counter of full opcodes: an HGMMA.64xNx16 is N / 8."""
    eq = 0.0
    for full, k in ops.items():
        m = re.match(r"HGMMA\.64x(\d+)x16", full)
        if m:
            eq += k * int(m.group(1)) / 8
    return eq


def _row(d, bc, path, ops, eq, info):
    cls = fc.classify(ops)
    hg = sum(k for f, k in ops.items() if f.startswith("HGMMA"))
    per = collections.OrderedDict((k, 1000.0 * v / eq) for k, v in cls.items())
    return (f"| {d} | {bc} | {path} | {info['registers']} | {info['spill_stores']} | {hg} | {eq:.0f} | "
            f"{cls['total']} | **{per['total']:.0f}** | " + " | ".join(f"{per[n]:.0f}" for n in fc.CLASS_NAMES) + " |")


def table():
    head = ["| d | block_kv | path | registers | spills | HGMMA | HMMA-eq | instructions | per 1,000 HMMA-eq | "
            + " | ".join(fc.CLASS_NAMES) + " |", "|---" * (9 + len(fc.CLASS_NAMES)) + "|"]
    lines = ["## flash_fwd_wgmma", ""] + head
    for d, bc in CONFIGS:
        for rescale in (False, True):
            lines.append(_row(d, bc, "rescale" if rescale else "lazy", *count(d, bc, rescale)))
    lines += ["", "## flash_bwd_wgmma (64 queries per step; d <= 128: block_kv 128, 64 keys per consumer "
              "warpgroup; d = 192, 256: block_kv 64, a consumer's 32 queries of the scores and one of dK, dV)",
              ""] + head
    for d, bc in BWD_CONFIGS:
        lines.append(_row(d, bc, "steady", *count(d, bc, False, backward=True)))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 1
    body = table()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    text = (f"# The Hopper kernels, steady trip per warp (sm_90a, NVRTC {'.'.join(map(str, _nvrtc.version()))}, "
            f"float16, at {rev or '?'}, {datetime.date.today()})\n\n"
            "Command: `python bench/hopper_sass_count.py`. FlashAttention-3 d=128, counted the same way "
            "(`python bench/fa3_sass_count.py`, bench/results/fa3_sass_count.md): forward 1699 per 1,000 "
            "at its 128 x 176 tile, rescaling on every tile (its causal kernel at 128 x 128: 1871-1883); "
            "backward 1298-1308 (its non-causal kernel, 80 queries per step; its causal kernel, with "
            "flash_bwd_wgmma's 64 x 128 tile, 1528-1534). ../shared/docs/sass-baseline.md has 1688 and "
            "1290 for the first two.\n\n" + body + "\n")
    return emit(text, None if args.no_write else RESULT)


def emit(text, path):
    """Print ``text`` and write it to ``path`` (None: print only); the exit status 0."""
    print(text)
    if path is not None:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

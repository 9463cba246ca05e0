"""flash_fwd_wgmma's main loop in machine code: instructions per 1,000 HMMA-equivalents.

No GPU is needed: NVRTC compiles kernels_cu/flash_fwd_wgmma.cu for sm_90a with
``-DCUFLASH_FWD_INTERIOR_ONLY`` (only the path of a steady-state K/V tile: no mask), and
the consumer warpgroups' loop (the loop with the most HGMMA) is counted per warp for one
trip with bench/fa2_sass_compare.py's method (``steady_ops``), in two rows per head dim:

* ``lazy``: the rescale of O and l compiled out, its warp vote kept -- a tile where no row's
  max moves by more than 2^8 (most tiles);
* ``rescale``: with ``-DCUFLASH_FWD_COUNT_RESCALE`` -- the rescale taken on every tile.

An HGMMA.64xNx16 counts as N/8 HMMA.16816 per warp (each warp of the warpgroup issues it for
its 16 rows).  FlashAttention-3's forward at d=128 (128x176 tiles, flash-attn3-jax 0.2.3)
issues 1688 per 1,000 (../shared/docs/sass-baseline.md), rescaling on every tile.

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
RESULT = HERE / "results" / "hopper_sass_count.md"
FA3_D128 = 1688
CONFIGS = ((64, 128), (128, 128), (128, 64), (256, 64))  # (d, block_kv)


def count(d, bc, rescale):
    """(Counter of full opcodes of one steady trip, HMMA-equivalents, ptxas figures)."""
    opts = ["-arch=sm_90a", "-DCUFLASH_DTYPE_F16", f"-DCUFLASH_HEAD_DIM={d}", f"-DCUFLASH_BLOCK_KV={bc}",
            f"-I{ROOT / 'kernels_cu'}", "-DCUFLASH_FWD_INTERIOR_ONLY", "-std=c++17", "-ftz=true",
            "--ptxas-options=-v"]
    if rescale:
        opts.append("-DCUFLASH_FWD_COUNT_RESCALE")
    r = _nvrtc.compile(SRC.read_text(), SRC.name, tuple(opts))
    info = _nvrtc.parse_ptxas_info(r.log)["flash_fwd_wgmma"]
    instrs = fc.parse_sass(_sass.disassemble(r.cubin))["flash_fwd_wgmma"]
    b = fc.base(instrs)
    span = max(_sass._loops(b), key=lambda s: sum(1 for a, op, _ in b if s[0] <= a <= s[1] and op == "HGMMA"))
    ops, _, _, _ = fc.steady_ops(instrs, span)
    eq = 0.0
    for full, k in ops.items():
        m = re.match(r"HGMMA\.64x(\d+)x16", full)
        if m:
            eq += k * int(m.group(1)) / 8
    return ops, eq, info


def table():
    lines = ["| d | block_kv | path | registers | spills | HGMMA | HMMA-eq | instructions | per 1,000 HMMA-eq | "
             + " | ".join(fc.CLASS_NAMES) + " |",
             "|---" * (9 + len(fc.CLASS_NAMES)) + "|"]
    for d, bc in CONFIGS:
        for rescale in (False, True):
            ops, eq, info = count(d, bc, rescale)
            cls = fc.classify(ops)
            hg = sum(k for f, k in ops.items() if f.startswith("HGMMA"))
            per = collections.OrderedDict((k, 1000.0 * v / eq) for k, v in cls.items())
            lines.append(f"| {d} | {bc} | {'rescale' if rescale else 'lazy'} | {info['registers']} | "
                         f"{info['spill_stores']} | {hg} | {eq:.0f} | {cls['total']} | **{per['total']:.0f}** | "
                         + " | ".join(f"{per[n]:.0f}" for n in fc.CLASS_NAMES) + " |")
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
    text = (f"# flash_fwd_wgmma, steady trip per warp (sm_90a, NVRTC {'.'.join(map(str, _nvrtc.version()))}, "
            f"float16, at {rev or '?'}, {datetime.date.today()})\n\n"
            f"Command: `python bench/hopper_sass_count.py`. FlashAttention-3 d=128: {FA3_D128} per 1,000 "
            "(rescale on every tile).\n\n" + body + "\n")
    print(text)
    if not args.no_write:
        RESULT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

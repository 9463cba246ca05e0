"""Wall time of emulated launches with the memory checker off and on.

    python bench/emulator_check_cost.py [--repeat 3]

Causal float16 forward and backward of 1 x 4 heads x 256 x 64 (flash_fwd_tc, flash_bwd_tc)
and float32 of 1 x 4 x 128 x 64 (flash_fwd_tf32, flash_bwd_tf32) through the public
functions with backend="emulator"; each number is the best of --repeat calls after one
warm-up call (which compiles), in seconds per call (the backward is three launches).  The
kernel libraries always carry the memcheck's instrumentation (docs/emulator.md); to compare
with a build without it, run this script from a checkout before the memcheck (it then
prints the "off" column only).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cuflash  # noqa: E402
from cuflash import emulator as em  # noqa: E402

CASES = ((np.float16, 256, 64), (np.float32, 128, 64))


def one(dtype, n, d, rng):
    q, k, v = (rng.standard_normal((1, 4, n, d)).astype(dtype) for _ in range(3))
    t0 = time.perf_counter()
    o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True, backend="emulator")
    t1 = time.perf_counter()
    cuflash.tiled_attention_backward(np.ones_like(o), q, k, v, o, lse, causal=True, backend="emulator")
    return t1 - t0, time.perf_counter() - t1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    modes = ["off", "on"] if hasattr(em, "set_memcheck") else ["off"]
    print(f"{'case':<24} {'memcheck':>8} {'forward s':>10} {'backward s':>11}")
    for dtype, n, d in CASES:
        for mode in modes:
            if hasattr(em, "set_memcheck"):
                em.set_memcheck(mode == "on")
            one(dtype, n, d, rng)
            res = [one(dtype, n, d, rng) for _ in range(args.repeat)]
            print(f"{np.dtype(dtype).name + f' 4x{n}x{d} causal':<24} {mode:>8} "
                  f"{min(r[0] for r in res):>10.3f} {min(r[1] for r in res):>11.3f}", flush=True)


if __name__ == "__main__":
    main()

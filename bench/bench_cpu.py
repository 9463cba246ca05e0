#!/usr/bin/env python3
"""CPU benchmark of the cuflash NumPy backend: naive NumPy, cuflash standard,
cuflash tiled and torch SDPA (when installed) - median time, GFLOP/s
(flash-attn FLOP convention) and peak memory, plus a plot against N.

The benchmark itself is the package beside this script
(``bench/cuflash_bench/cpu.py``); ``python -m cuflash bench`` runs it from a
checkout too, and so does this script:

    python bench/bench_cpu.py                      # default sizes 1024, 2048, 4096
    python bench/bench_cpu.py --sizes 512,1024 --mem-n 0 --plot ''
    python bench/bench_cpu.py --help
"""
import os
import sys

# run from a checkout without installing: the repository root holds cuflash/ (this
# folder, which holds cuflash_bench/, is sys.path[0] when the script runs)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from cuflash_bench.cpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="bench/bench_cpu.py"))

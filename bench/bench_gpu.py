#!/usr/bin/env python3
"""GPU benchmark of cuflash against torch SDPA (flash, cudnn, efficient, math): correctness
check against float64 first, then CUDA-event timing of FlashAttention-2's benchmark grid,
decode shapes, a KV cache at decode time (contiguous and paged; also against flash-attn and
vLLM when importable), ragged varlen batches and host time per call; tables, JSON and a plot
of TFLOP/s against N.

The benchmark itself is the package beside this script
(``bench/cuflash_bench/gpu.py``); ``python -m cuflash bench --gpu`` runs it from a
checkout too, and so does this script:

    python bench/bench_gpu.py                                  # needs CuPy and a GPU
    python bench/bench_gpu.py --dims 128 --causal no --modes fwd,fwdbwd --json gpu.json
    python bench/bench_gpu.py --sections kvcache,varlen        # only the serving calls
    python bench/bench_gpu.py --backend emulator               # tiny sizes, on the CPU
    python bench/bench_gpu.py --help
"""
import os
import sys

# run from a checkout without installing: the repository root holds cuflash/ (this
# folder, which holds cuflash_bench/, is sys.path[0] when the script runs)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from cuflash_bench.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="bench/bench_gpu.py"))

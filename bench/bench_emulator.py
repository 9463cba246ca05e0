"""Cost of the emulator's execution engine: barriers, warp collectives, block turnover.

    python bench/bench_emulator.py [--repeat 3]

Each number is the best of --repeat launches (the CI machines are shared), as
wall time and as CPU time of the process (user + system, all threads: on a
loaded machine wall time also counts the time other processes had the cores):
  __syncthreads (128 threads)   per barrier, from a loop of barriers in one block
  shuffle (32 threads)          per __shfl_xor_sync, one warp
  mma.m16n8k16 (32 threads)     per warp-collective mma, one warp
  block turnover (32 threads)   per block of a kernel that does one store
  block turnover (128 threads)  the same with 128-thread blocks
The loop counts are subtracted against a launch with 0 iterations, so launch
overhead (argument conversion, library call) is not counted.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cuflash import emulator as em  # noqa: E402

SRC = r'''
#include "portable.cuh"
extern "C" __global__ void sync_loop(float* out, int iters) {
    float v = (float)threadIdx.x;
    for (int i = 0; i < iters; ++i) { __syncthreads(); v += 1.0f; }
    if (threadIdx.x == 0) gstore(out + blockIdx.x, v);
}
extern "C" __global__ void shfl_loop(float* out, int iters) {
    float v = (float)threadIdx.x;
    for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(0xffffffffu, v, 1 + (i & 15));
    if (threadIdx.x == 0) gstore(out + blockIdx.x, v);
}
extern "C" __global__ void mma_loop(float* out, int iters) {
    uint32_t a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u}, b[2] = {0x3c003c00u, 0x3c003c00u};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < iters; ++i) mma_m16n8k16_f16(c, a, b, c);
    if (threadIdx.x == 0) gstore(out + blockIdx.x, c[0]);
}
extern "C" __global__ void one_store(float* out) {
    if (threadIdx.x == 0) gstore(out + blockIdx.x, 1.0f);
}
'''


def best(fn, repeat):
    """(wall, cpu) seconds: the best of `repeat` calls of fn."""
    ts = []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        ts.append((time.perf_counter() - t, time.process_time() - c))
    return min(w for w, _ in ts), min(c for _, c in ts)


def diff(a, b, n):
    return tuple((y - x) / n for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the loop counts")
    a = ap.parse_args()
    mod = em.RawModule(code=SRC)
    out = np.zeros(1 << 16, np.float32)
    rows = []

    def per_op(kernel, threads, iters):
        k = mod.get_function(kernel)
        iters = max(1, int(iters * a.scale))
        k(1, threads, (out, np.int32(0)))  # warm up (build, first call)
        t0 = best(lambda: k(1, threads, (out, np.int32(0))), a.repeat)
        t1 = best(lambda: k(1, threads, (out, np.int32(iters))), a.repeat)
        return diff(t0, t1, iters)

    rows.append(("__syncthreads, 128 threads", per_op("sync_loop", 128, 2000)))
    rows.append(("__shfl_xor_sync, 32 threads", per_op("shfl_loop", 32, 2000)))
    rows.append(("mma.m16n8k16, 32 threads", per_op("mma_loop", 32, 2000)))
    k = mod.get_function("one_store")
    for threads, nblocks in ((32, 4000), (128, 1000)):
        nblocks = max(1, int(nblocks * a.scale))
        k(1, threads, (out,))
        t1 = best(lambda: k(1, threads, (out,)), a.repeat)
        tn = best(lambda: k(nblocks, threads, (out,)), a.repeat)
        rows.append((f"block turnover, {threads} threads", diff(t1, tn, nblocks - 1)))
    t = best(lambda: k(1, 32, (out,)), a.repeat)
    rows.append(("launch of 1 block x 32 threads", t))
    print(f"{'':34s} {'wall':>10s}    {'cpu':>10s}")
    for name, (w, c) in rows:
        print(f"{name:34s} {w * 1e6:10.2f} us {c * 1e6:10.2f} us")


if __name__ == "__main__":
    main()

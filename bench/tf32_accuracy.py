"""Accuracy of the float32 (3xTF32) kernels on the emulator against the float64 reference.

Runs flash_fwd_tf32 and flash_bwd_tf32 (the float32 tensor-core kernels: cuflash picks them for
float32 on the emulated sm_80) on a few shapes and prints ||x - ref|| / ||ref|| of o, dQ, dK
and dV, ref being cuflash's NumPy backend on the same inputs in float64 (each backend's backward
from its own forward's o and lse).  The tests' rule for float32 (tests/oracle.py) is 1e-5.  This is what
the operand split of portable.cuh (split_tf32) is judged by beside
tests/emulator/test_emulator_tf32.py; seconds per shape on a CPU, no GPU.

Usage::

    python bench/tf32_accuracy.py
"""
import sys
import time

import numpy as np

import cuflash
from cuflash.launch import common as launch_common

CASES = [  # q shape, k shape, causal
    ((1, 2, 97, 64), (1, 2, 97, 64), False),
    ((1, 2, 60, 128), (1, 2, 41, 128), "top_left"),
    ((1, 1, 130, 64), (1, 1, 130, 64), True),
]


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def main():
    rng = np.random.default_rng(0)
    print("| q | k | causal | kernels | o | dQ | dK | dV |")
    print("|---|---|---|---|---|---|---|---|")
    for qs, ks, causal in CASES:
        q64, k64, v64 = (rng.standard_normal(s) for s in (qs, ks, ks))
        do64 = rng.standard_normal(qs)
        o64, lse64 = cuflash.tiled_attention(q64, k64, v64, causal=causal, return_lse=True, backend="numpy")
        ref = cuflash.tiled_attention_backward(do64, q64, k64, v64, o64, lse64, causal=causal, backend="numpy")
        q, k, v, do = (a.astype(np.float32) for a in (q64, k64, v64, do64))
        t0 = time.time()
        with launch_common.observe_launches() as seen:
            o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True, backend="emulator")
            grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal, backend="emulator")
        kernels = sorted({e["kernel"] for e in seen if "tf32" in e["kernel"]})
        errs = [_rel(o, o64)] + [_rel(g, r) for g, r in zip(grads, ref)]
        print(f"| {'x'.join(map(str, qs))} | {'x'.join(map(str, ks))} | {causal} | {', '.join(kernels)} | "
              + " | ".join(f"{e:.2e}" for e in errs) + " |")
        print(f"  ({time.time() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

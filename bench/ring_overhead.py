"""The ring's own cost: cuflash.ring.torch at world size 1 against plain cuflash.torch.

    python bench/ring_overhead.py                       # CUDA, NCCL, world size 1
    python bench/ring_overhead.py --device cpu --N 256 --reps 1   # gloo (a smoke run)

At world size 1 the ring makes the same cuflash calls as ``cuflash.torch.attention`` (zigzag
causal: one causal call; no mask: one call) plus what the ring adds around them: packing K
and V, the float32 accumulators and the merge, the casts, and in the backward the float32
dQ/dK/dV accumulators.  No transfer happens (one rank), so this measures that overhead,
not communication.  The output must be bitwise equal to plain cuflash's (one call, merged
with weight exp(0) = 1), and so must the gradients on the CPU; on a GPU the backward adds dQ
with float32 atomics in an order that changes from run to run (plain cuflash differs from
itself), so there the gradients' relative difference must stay within 2 units of the
dtype's rounding.  The script exits 1 otherwise.

Times: CUDA events around each call (median of ``--reps`` after 2 warm-up calls), on the
CPU ``time.perf_counter``.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cuflash.torch  # noqa: E402  (this checkout's cuflash)
from cuflash.ring.torch import ring_attention  # noqa: E402


def _timer(device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    return run


def measure(fn, device, reps):
    timer = _timer(device)
    for _ in range(2):
        timer(fn)
    return statistics.median(timer(fn) for _ in range(reps))


def case(device, dtype, B, H, N, d, causal, reps):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, d, device=device, dtype=dtype, generator=g)
                   for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def plain():
        return cuflash.torch.attention(*leaves, causal=causal)

    def ring():
        return ring_attention(*leaves, causal=causal)

    results = {}
    for name, fn in (("plain", plain), ("ring", ring)):
        for t in leaves:
            t.grad = None
        o = fn()
        o.backward(do)
        results[name] = [o.detach()] + [t.grad for t in leaves]

        def fwd_bwd(fn=fn):
            out = fn()
            out.backward(do)
        with torch.no_grad():
            t_fwd = measure(fn, device, reps)
        t_all = measure(fwd_bwd, device, reps)
        results[name + "_ms"] = (t_fwd, t_all)
    o_equal = torch.equal(results["plain"][0], results["ring"][0])
    diff = max(float((a.double() - b.double()).norm() / max(a.double().norm(), 1e-300))
               for a, b in zip(results["plain"][1:], results["ring"][1:]))
    # gradients: bitwise on the CPU; dQ's atomics make them run-dependent on a GPU
    tol = 0.0 if device.type == "cpu" else 2 * torch.finfo(dtype).eps
    return results["plain_ms"], results["ring_ms"], (o_equal, diff, diff <= tol)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="float16")
    p.add_argument("--N", default="4096,16384")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    dtype = getattr(torch, a.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# ring_attention at world size 1 ({dist.get_backend()}) vs cuflash.torch.attention,"
          f" {name}, {a.dtype}, B={a.batch} H={a.heads} d={a.head_dim}, median of {a.reps}")
    print("| N | causal | plain fwd ms | ring fwd ms | overhead | plain fwd+bwd ms | "
          "ring fwd+bwd ms | overhead | o bitwise equal | grads rel. diff | equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for N in (int(x) for x in a.N.split(",")):
        for causal in (False, True):
            (pf, pa), (rf, ra), (o_eq, diff, g_ok) = case(device, dtype, a.batch, a.heads, N,
                                                          a.head_dim, causal, a.reps)
            equal = o_eq and g_ok
            ok &= equal
            print(f"| {N} | {'yes' if causal else 'no'} | {pf:.3f} | {rf:.3f} | "
                  f"{(rf / pf - 1) * 100:+.1f}% | {pa:.3f} | {ra:.3f} | "
                  f"{(ra / pa - 1) * 100:+.1f}% | {'yes' if o_eq else 'NO'} | {diff:.1e} | "
                  f"{'yes' if equal else 'NO'} |", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

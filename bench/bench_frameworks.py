#!/usr/bin/env python3
"""Overhead of the framework wrappers on the CPU: cuflash.torch (and cuflash.jax)
against calling cuflash directly on NumPy arrays.

Both sides run the same NumPy backend on the same data, so the difference is
what the wrapper adds: DLPack hand-overs, layout views, autograd bookkeeping
(torch), pure_callback and dispatch (jax).  Forward = one attention call;
forward + backward = the forward with lse, then the backward.  Inputs are
checked equal before timing; each case runs warm-up calls, then ``--repeat``
timed calls interleaved across methods (so a change in machine load hits all
alike); the table gives medians in microseconds.

    python bench/bench_frameworks.py                  # B=1, H=2, N=64, d=32, float32
    python bench/bench_frameworks.py --n 256 --repeat 200
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

# run from a checkout without installing: the repository root holds cuflash/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import cuflash  # noqa: E402


def _methods(q, k, v, do, causal):
    """{name: (forward, forward_backward)} zero-argument callables."""
    def direct_fwd():
        return cuflash.tiled_attention(q, k, v, causal=causal)

    def direct_fwd_bwd():
        o, lse = cuflash.tiled_attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal)
    out = {"direct cuflash (numpy)": (direct_fwd, direct_fwd_bwd)}
    try:
        import torch
        import cuflash.torch as ct
    except ImportError as e:
        print(f"torch wrapper skipped: {e}")
    else:
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        gq, gk, gv = (t.clone().requires_grad_() for t in (tq, tk, tv))
        tdo = torch.from_numpy(do)

        def torch_fwd():
            return ct.attention(tq, tk, tv, causal=causal)

        def torch_fwd_bwd():
            o = ct.attention(gq, gk, gv, causal=causal)
            return torch.autograd.grad(o, (gq, gk, gv), tdo)
        out["cuflash.torch"] = (torch_fwd, torch_fwd_bwd)
    try:
        import jax
        import cuflash.jax as cj
    except ImportError as e:
        print(f"jax wrapper skipped: {e}")
    else:
        jq, jk, jv, jdo = (jax.numpy.asarray(x) for x in (q, k, v, do))
        fwd = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal))

        @jax.jit
        def fwd_bwd(q, k, v):
            o, vjp = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=causal), q, k, v)
            return vjp(jdo)
        out["cuflash.jax (jit)"] = (lambda: jax.block_until_ready(fwd(jq, jk, jv)),
                                    lambda: jax.block_until_ready(fwd_bwd(jq, jk, jv)))
    return out


def _check(methods):
    """Every method's forward equals the direct call's (same backend, same data)."""
    ref = np.asarray(methods["direct cuflash (numpy)"][0]())
    for name, (fwd, _) in methods.items():
        got = fwd()
        got = got.detach().numpy() if hasattr(got, "detach") else np.asarray(got)
        err = np.max(np.abs(got.astype(np.float64) - ref))
        if not err <= 1e-6 * max(1.0, np.max(np.abs(ref))):
            raise SystemExit(f"{name}: forward differs from the direct call by {err:.3e}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/bench_frameworks.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--n", type=int, default=64, help="sequence length (Nq = Nk)")
    p.add_argument("--d", type=int, default=32, help="head dim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args(argv)

    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, args.n, args.d)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    methods = _methods(q, k, v, do, args.causal)
    _check(methods)
    times = {(name, phase): [] for name in methods for phase in (0, 1)}
    for _ in range(args.warmup):
        for fns in methods.values():
            fns[0](), fns[1]()
    for _ in range(args.repeat):
        for name, fns in methods.items():
            for phase in (0, 1):
                t0 = time.perf_counter()
                fns[phase]()
                times[name, phase].append(time.perf_counter() - t0)

    print(f"B={args.batch} H={args.heads} N={args.n} d={args.d} float32 causal={args.causal}; "
          f"median of {args.repeat} calls after {args.warmup} warm-up calls")
    base = {ph: statistics.median(times["direct cuflash (numpy)", ph]) for ph in (0, 1)}
    print("| method | forward µs | overhead µs | fwd+bwd µs | overhead µs |")
    print("|---|---:|---:|---:|---:|")
    for name in methods:
        f, fb = (statistics.median(times[name, ph]) for ph in (0, 1))
        print(f"| {name} | {f * 1e6:.0f} | {(f - base[0]) * 1e6:+.0f} | {fb * 1e6:.0f} | "
              f"{(fb - base[1]) * 1e6:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

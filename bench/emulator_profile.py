"""Shared-memory bank conflicts, global sectors and executed counts of every kernel family,
from the emulator (no GPU): writes bench/results/emulator_profile.md.

    python bench/emulator_profile.py [--n 128] [--d 64 128] [--out bench/results/emulator_profile.md]

Each kernel family runs once at its default plan (the tile planner's choice for the dtype and
head dimension, held to sm_80's shared memory) on a small causal problem of 1 batch x 2 heads
x n x d (d = 64 and 128 by default), inside cuflash.emulator.profiling().  Per launch the report gives the grid, block and
shared memory, the shared-memory sites (source line, access kind and width) with their
warp-level requests, wavefronts, ideal wavefronts and bank conflicts (wavefronts - ideal, as
Nsight Compute counts them), the global sites with their 32-byte sectors against the ideal,
and the executed instruction counts in warp instructions, per block and, for the main
kernels, per (Q tile, KV tile) pair the causal call visits.  How the emulator forms
warp-level requests and counts wavefronts: docs/emulator.md, "Profiler".
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import cuflash  # noqa: E402
from cuflash import emulator as em, kernels  # noqa: E402
from cuflash.launch import bwd as launch_bwd, bwd_simt  # noqa: E402


FINDINGS = "## Findings"
END_FINDINGS = "<!-- end of findings: the tables below are generated -->"


def short(site):
    """A site relative to the checkout (kernels_cu/flash_fwd_tc.cu:123)."""
    for marker in ("kernels_cu/", "tests/"):
        i = site.find(marker)
        if i >= 0:
            return site[i:]
    return site


def families(n, d, dtypes, rng):
    """(label, function running the launches) for each kernel family at its default plan."""
    def qkv(dtype):
        return [rng.standard_normal((1, 2, n, d)).astype(dtype) for _ in range(3)]

    def fwd(dtype):
        def run():
            q, k, v = qkv(dtype)
            cuflash.tiled_attention(q, k, v, causal=True, backend="emulator")
        return run

    out = []
    for dtype in dtypes:
        out.append((f"forward {np.dtype(dtype).name} d={d}", fwd(dtype), dtype))
    for dtype in dtypes:
        def run(dtype=dtype):
            q, k, v = qkv(dtype)
            with em.profiling(False):
                o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True, backend="emulator")
            cuflash.tiled_attention_backward(np.ones_like(o), q, k, v, o, lse, causal=True, backend="emulator")
        out.append((f"backward {np.dtype(dtype).name} d={d}", run, dtype))
    return out


def tile_pairs(n, bq, bkv, heads=2):
    """(Q tile, KV tile) pairs a causal call of n x n per head visits (Nq = Nk: top-left and
    bottom-right agree): the forward walks, per Q tile, the KV tiles up to the last one its
    last row sees; the backward, per KV tile, the Q tiles from the first one that sees it --
    the same pairs."""
    return heads * sum((min((i + 1) * bq, n) - 1) // bkv + 1 for i in range(-(-n // bq)))


def main_kernel_tiles(kernel, dtype, d, n):
    """(block_q, block_kv) of a main kernel's default plan on the emulator (sm_80), or None for
    the helpers (preprocess, convert, combine)."""
    rt = kernels.get_runtime("emulator")
    if kernel.startswith("flash_fwd") and "combine" not in kernel:
        m = cuflash.memory_analysis(n, d, np.dtype(dtype).name, backend="emulator")
        return m["block_q"], m["block_kv"]
    if kernel.startswith("flash_bwd_tc") and "preprocess" not in kernel and "convert" not in kernel:
        p = launch_bwd.plan_backward(rt, d, d, np.dtype(dtype).name)
        return p.block_q, p.block_kv
    if kernel.startswith("flash_bwd_tf32"):
        p = bwd_simt.tf32_plan(rt, d, d, np.dtype(dtype).name)
        return p.block_q, p.block_kv
    if kernel.startswith(("flash_bwd_dkdv", "flash_bwd_dq")) and "convert" not in kernel:
        p = bwd_simt.plans(rt, d, d, np.dtype(dtype).name)[0]
        return p.block_q, p.block_kv
    return None


def table(rows, header):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


def report_launch(label, prof, pairs=None):
    """The tables of one launch; ``pairs``: the (Q tile, KV tile) pairs a main kernel visits
    (the executed counts are then given per pair as well)."""
    blocks = prof["grid"][0] * prof["grid"][1] * prof["grid"][2]
    out = [f"### {label}: `{prof['kernel']}`", "",
           f"grid {prof['grid']}, block {prof['block']}, dynamic shared memory {prof['dynamic_shared_bytes']} bytes", ""]
    shared = [s for s in prof["sites"] if "wavefronts" in s]
    glob = [s for s in prof["sites"] if "sectors" in s]
    tw, ti = sum(s["wavefronts"] for s in shared), sum(s["ideal"] for s in shared)
    out.append(f"shared memory: {sum(s['requests'] for s in shared)} requests, {tw} wavefronts, ideal {ti}, "
               f"**bank conflicts {tw - ti}**")
    gs, gi = sum(s["sectors"] for s in glob), sum(s["ideal"] for s in glob)
    out += [f"global memory: {sum(s['requests'] for s in glob)} requests, {gs} sectors, ideal {gi}", ""]
    if shared:
        rows = [(f"`{short(s['site'])}`", s["kind"], s["bytes"], s["requests"], s["wavefronts"], s["ideal"],
                 s["conflicts"]) for s in sorted(shared, key=lambda s: (-s["conflicts"], s["site"]))]
        out += table(rows, ["site", "access", "bytes/lane", "requests", "wavefronts", "ideal", "conflicts"]) + [""]
    if glob:
        rows = [(f"`{short(s['site'])}`", s["kind"], s["bytes"], s["requests"], s["sectors"], s["ideal"],
                 f"{s['sectors'] / max(s['requests'], 1):.1f}")
                for s in sorted(glob, key=lambda s: (s["ideal"] - s["sectors"], s["site"]))]
        out += table(rows, ["site", "access", "bytes/lane", "requests", "sectors", "ideal", "sectors/request"]) + [""]
    if pairs:
        counts = [(k, f"{v / blocks:g}", f"{v / pairs:.4g}") for k, v in prof["counts"].items() if v]
        head = ["class", "per block", f"per tile pair ({pairs} pairs)"]
    else:
        counts = [(k, f"{v / blocks:g}") for k, v in prof["counts"].items() if v]
        head = ["class", "per block"]
    if counts:
        out += ["executed (warp instructions, summed over the block's warps):", ""] + table(counts, head) + [""]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128],
                    help="head dimensions (float64, the slowest to emulate, runs at the first only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "emulator_profile.md"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lines = ["# Emulator profile: bank conflicts, sectors and executed counts per kernel", "",
             f"`python bench/emulator_profile.py --n {args.n} --d {' '.join(map(str, args.d))}`: causal "
             f"attention, 1 x 2 heads x {args.n} x d, default plans (sm_80), every launch profiled by the emulator "
             "(docs/emulator.md, \"Profiler\").  Counts are exact for the emulated execution; "
             "global sectors are counted from the start of each array, as on a GPU allocation.", ""]
    summary = []
    runs = []
    for i, d in enumerate(args.d):
        runs += [r + (d,) for r in families(args.n, d, (np.float16, np.float32) + ((np.float64,) if i == 0 else ()),
                                           rng)]
    for label, run, dtype, d in runs:
        t0 = time.perf_counter()
        with em.profiling() as launches:
            run()
        dt = time.perf_counter() - t0
        print(f"{label}: {len(launches)} launch(es), {dt:.1f} s", flush=True)
        lines += [f"## {label}", ""]
        for prof in launches:
            tiles = main_kernel_tiles(prof["kernel"], dtype, d, args.n)
            lines += report_launch(label, prof, tile_pairs(args.n, *tiles) if tiles else None)
            shared = [s for s in prof["sites"] if "wavefronts" in s]
            summary.append((label, f"`{prof['kernel']}`", sum(s["wavefronts"] for s in shared),
                            sum(s["ideal"] for s in shared), sum(s["conflicts"] for s in shared),
                            sum(1 for s in shared if s["conflicts"])))
    lines[4:4] = ["## Summary", ""] + table(summary, ["run", "kernel", "shared wavefronts", "ideal",
                                                      "bank conflicts", "sites with conflicts"]) + [""]
    # the hand-written reading of the tables (kernel comments checked against them) is kept
    out = Path(args.out)
    old = out.read_text() if out.exists() else ""
    notes = (old[old.index(FINDINGS):old.index(END_FINDINGS)] if FINDINGS in old and END_FINDINGS in old
             else FINDINGS + "\n\n(none yet)\n\n") + END_FINDINGS
    lines[4:4] = [notes.rstrip(), ""]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

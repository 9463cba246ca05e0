"""The CPU benchmark: naive NumPy, cuflash standard, cuflash tiled and torch SDPA.

Run it from a source checkout as ``python -m cuflash bench`` or
``python bench/bench_cpu.py``; ``--help`` lists the options.

For each sequence length N it checks every method against the naive NumPy
result (the check must pass before anything is timed), warms up, times
``--reps`` runs and reports the median, the GFLOP/s of the flash-attn
convention (``4 * B * H * N^2 * d`` for the forward) and
the peak memory of one call:

* NumPy methods: ``tracemalloc`` (NumPy reports its allocations to it): the
  peak of everything allocated during the call, outputs included;
* torch SDPA: tracemalloc cannot see torch's allocator, so the call runs in a
  fresh subprocess and we report the growth of the process's resident-set
  high-water mark (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``, minus ``VmRSS`` before the call); n/a where
  /proc does not offer that.

A last row measures memory only at a long sequence (``--mem-n``, default
16384): the tiled forward at the full head count, and the standard one at one
head (its memory is exactly linear in the heads; the full-head standard would
need ``2 * H * N^2 * 4`` bytes) - the figure behind "peak extra memory under 2%
of the standard algorithm's".

All methods run in one process, one after the other, under the same
conditions; the machine's load average is printed before and after because
the CPU may be shared.
"""
import json
import math
import os
import platform
import subprocess
import sys
import time
import tracemalloc

import numpy as np

from cuflash._cliargs import Parser, int_list, nonneg_int, positive_int

METHODS = ("naive numpy", "cuflash standard", "cuflash tiled", "torch sdpa")


# ---------------------------------------------------------------------------
# the methods
# ---------------------------------------------------------------------------
def naive_numpy(q, k, v):
    """softmax(q k^T / sqrt(d)) v the way one writes it in NumPy (float32 throughout)."""
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(1.0 / math.sqrt(q.shape[-1]))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def _methods(torch_ok, block_q=None, block_kv=None, causal=False):
    import cuflash
    out = {}
    if not causal:
        out["naive numpy"] = naive_numpy
    out["cuflash standard"] = lambda q, k, v: cuflash.standard_attention(
        q, k, v, causal=causal, backend="numpy")[0]
    out["cuflash tiled"] = lambda q, k, v: cuflash.tiled_attention(
        q, k, v, causal=causal, block_q=block_q, block_kv=block_kv, backend="numpy")
    if torch_ok:
        import torch
        import torch.nn.functional as F

        def sdpa(q, k, v):
            with torch.no_grad():
                return F.scaled_dot_product_attention(
                    torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                    is_causal=bool(causal)).numpy()
        out["torch sdpa"] = sdpa
    return out


def _torch_available():
    try:
        import torch  # noqa: F401
        return True, ""
    except ImportError as e:
        return False, f"{e} (pip install torch)"


# ---------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------
def flops(B, H, N, d, causal=False):
    """Forward FLOPs, flash-attn convention: 4 B H N^2 d (halved when causal)."""
    f = 4.0 * B * H * N * N * d
    return f / 2 if causal else f


# Pause before timing a method: OpenMP (torch) and OpenBLAS worker threads keep
# spinning for ~0.1-0.2 s after their last call, which on 2 cores steals a core
# from whatever runs next (seen here: naive NumPy 20x slower right after SDPA).
SETTLE_S = 0.3


def _tracemalloc_peak(fn):
    time.sleep(SETTLE_S)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_RSS_CHILD = r"""
import json, sys, numpy as np
B, H, N, d, threads, causal = json.loads(sys.argv[1])
import torch, torch.nn.functional as F
torch.set_num_threads(threads)
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1]) * 1024
rng = np.random.default_rng(0)
q, k, v = (torch.from_numpy(rng.standard_normal((B, H, N, d), dtype=np.float32)) for _ in range(3))
with torch.no_grad():
    F.scaled_dot_product_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :])  # library set-up
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')                      # reset VmHWM to the current RSS
    before = status('VmRSS')
    o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
    print(json.dumps(status('VmHWM') - before))
"""


def torch_peak_rss(B, H, N, d, threads, causal=False):
    """Peak RSS growth (bytes) of one torch SDPA call in a fresh process, or (None, why)."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None, "no /proc/self/clear_refs on this OS"
    try:
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD,
                            json.dumps([B, H, N, d, threads, bool(causal)])],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return int(r.stdout.strip().splitlines()[-1]), ""


# ---------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------
def machine_info():
    """What the numbers were measured on."""
    info = {"python": platform.python_version(), "numpy": np.__version__,
            "cpu": platform.processor() or platform.machine(),
            "nproc": os.cpu_count()}
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from cuflash import reference
        b = reference._blas()
        info["blas"] = "OpenBLAS" if b.set is not None else "unknown (not OpenBLAS?)"
        if b.get is not None:
            info["blas_threads"] = int(b.get())
    except Exception:  # informational only
        pass
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                "CUFLASH_NUM_THREADS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    ok, _ = _torch_available()
    if ok:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def _fmt_mib(b):
    return "n/a" if b is None else f"{b / 2**20:,.1f}"


def format_table(rows):
    """Markdown table of the timing rows."""
    head = ("| N | method | median ms | GFLOP/s | peak MiB | time / torch SDPA |\n"
            "|---:|---|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        ratio = "" if r.get("ratio_sdpa") is None else f"{r['ratio_sdpa']:.2f}x"
        lines.append(f"| {r['N']} | {r['method']} | {r['ms']:,.1f} | {r['gflops']:,.1f} | "
                     f"{_fmt_mib(r['peak_bytes'])}{r.get('mem_note', '')} | {ratio} |")
    return "\n".join(lines)


def save_plot(rows, mem_rows, path, title=""):
    """Time and memory against N (log-log); returns (absolute path, "") or (None, why).

    A memory point that was extrapolated rather than measured at its size (the
    standard method's long-sequence point, measured at one head and scaled by
    the head count) is drawn hollow and named so in the legend.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, ("matplotlib not installed (pip install \".[bench]\" from a checkout, "
                      "or pip install matplotlib)")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for m in METHODS:
        pts = [(r["N"], r["ms"]) for r in rows if r["method"] == m]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=m)
        mem = sorted((r["N"], r["peak_bytes"] / 2**20) for r in rows + mem_rows
                     if r["method"] == m and r.get("peak_bytes") and not r.get("extrapolated"))
        line = None
        if mem:
            (line,) = ax2.plot(*zip(*mem), marker="o", label=m)
        extra = sorted((r["N"], r["peak_bytes"] / 2**20) for r in mem_rows
                       if r["method"] == m and r.get("peak_bytes") and r.get("extrapolated"))
        if extra:
            color = line.get_color() if line is not None else None
            how = "; ".join(sorted({str(r["extrapolated"]) for r in mem_rows
                                    if r["method"] == m and r.get("extrapolated")}))
            ax2.plot(*zip(*extra), linestyle="none", marker="o", markerfacecolor="none",
                     markersize=8, color=color, label=f"{m}, extrapolated ({how})")
    for ax, sub, unit in ((ax1, "forward time (median)", "ms"),
                          (ax2, "peak memory of one call", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(unit)
        ax.set_title(sub)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = os.path.abspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, ""


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
def build_parser(prog=None, add_help=True):
    """The benchmark's options (shared by ``python -m cuflash bench`` and bench/bench_cpu.py).

    Values the benchmark cannot use (``--sizes 0``, ``--reps 0``, ``--block-q 0``)
    are argparse errors: one line, exit status 2.
    """
    p = Parser(
        prog=prog, add_help=add_help, description="CPU benchmark of the cuflash NumPy backend "
        "against naive NumPy and torch SDPA: median time, GFLOP/s (flash-attn convention) and "
        "peak memory. The plot needs matplotlib and the comparison torch: "
        "pip install \".[bench]\" torch")
    p.add_argument("--sizes", default=[1024, 2048, 4096], type=int_list,
                   help="comma-separated sequence lengths to time (default: 1024,2048,4096)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch B (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, default=8, help="heads H (default: %(default)s)")
    p.add_argument("--dim", type=positive_int, default=64, help="head dim d (default: %(default)s)")
    p.add_argument("--reps", type=positive_int, default=5,
                   help="timed runs per point (default: %(default)s)")
    p.add_argument("--warmup", type=nonneg_int, default=1,
                   help="untimed runs first (default: %(default)s)")
    p.add_argument("--causal", action="store_true", help="causal attention (naive NumPy is left out)")
    p.add_argument("--block-q", type=positive_int, default=None,
                   help="cuflash tiled block_q (default: auto)")
    p.add_argument("--block-kv", type=positive_int, default=None,
                   help="cuflash tiled block_kv (default: auto)")
    p.add_argument("--mem-n", type=nonneg_int, default=16384,
                   help="long sequence for the memory-only row (0 to skip; default: %(default)s)")
    p.add_argument("--no-torch", action="store_true", help="leave torch SDPA out")
    p.add_argument("--plot", default="bench_cpu.png",
                   help="where to save the plot (default: %(default)s; '' for none; "
                   "needs matplotlib)")
    p.add_argument("--json", default="", help="also write the results as JSON here")
    return p


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(args):
    """Run the benchmark described by parsed ``args``; returns the results dict."""
    B, H, d = args.batch, args.heads, args.dim
    sizes = list(args.sizes)
    torch_ok, torch_why = (False, "--no-torch") if args.no_torch else _torch_available()
    info = machine_info()
    threads = info.get("nproc", 1)
    if torch_ok:
        import torch
        torch.set_num_threads(threads)
        info["torch_threads"] = torch.get_num_threads()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    methods = _methods(torch_ok, args.block_q, args.block_kv, args.causal)
    rng = np.random.default_rng(0)
    rows = []
    t_start = time.perf_counter()
    for N in sizes:
        q, k, v = (rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(3))
        # -- correctness first: every method against the first one (naive or standard)
        _log(f"N={N}: correctness check")
        ref_name = next(iter(methods))
        ref = np.asarray(methods[ref_name](q, k, v), dtype=np.float64)
        for name, fn in methods.items():
            out = np.asarray(fn(q, k, v), dtype=np.float64)
            err = float(np.max(np.abs(out - ref)))
            if not err < 1e-4:
                raise SystemExit(f"N={N}: {name} disagrees with {ref_name}: max abs diff {err:.3e}")
        # -- timing, interleaved: rep r of every method runs before rep r + 1 of any, so
        # a change in the machine's load hits all methods alike and the ratios stay fair
        _log(f"N={N}: timing {', '.join(methods)} ({args.warmup} warm-up + {args.reps} "
             "interleaved runs each)")
        times = {name: [] for name in methods}
        for name, fn in methods.items():
            for _ in range(args.warmup):
                fn(q, k, v)
        for rep in range(args.reps):
            for name, fn in methods.items():
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                fn(q, k, v)
                times[name].append(time.perf_counter() - t0)
            _log(f"  run {rep + 1}/{args.reps}: " + ", ".join(
                f"{n_} {times[n_][-1] * 1e3:.0f} ms" for n_ in methods))
        sdpa_ms = None
        point = []
        for name, fn in methods.items():
            med = float(np.median(times[name]))
            _log(f"N={N}: peak memory of {name}")
            if name == "torch sdpa":
                peak, why = torch_peak_rss(B, H, N, d, threads, args.causal)
                note = " (RSS)" if peak is not None else ""
                if peak is None:
                    _log(f"  torch peak memory n/a: {why}")
            else:
                peak, note = _tracemalloc_peak(lambda: fn(q, k, v)), ""
            r = {"N": N, "method": name, "ms": med * 1e3, "runs_ms": [x * 1e3 for x in times[name]],
                 "gflops": flops(B, H, N, d, args.causal) / med / 1e9,
                 "peak_bytes": peak, "mem_note": note}
            point.append(r)
            if name == "torch sdpa":
                sdpa_ms = r["ms"]
        for r in point:
            r["ratio_sdpa"] = None if sdpa_ms is None else r["ms"] / sdpa_ms
        rows.extend(point)
        del q, k, v

    mem_rows = []
    if args.mem_n:
        import cuflash
        N = args.mem_n
        _log(f"N={N}: memory of cuflash tiled ({B}x{H} heads, one run)")
        q, k, v = (rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(3))
        t0 = time.perf_counter()
        tiled_peak = _tracemalloc_peak(lambda: cuflash.tiled_attention(
            q, k, v, causal=args.causal, block_q=args.block_q, block_kv=args.block_kv,
            backend="numpy"))
        tiled_s = time.perf_counter() - t0
        del q, k, v
        _log(f"N={N}: memory of cuflash standard (1 head, one run; x{B * H} heads)")
        q1, k1, v1 = (rng.standard_normal((1, 1, N, d), dtype=np.float32) for _ in range(3))
        std_peak1 = _tracemalloc_peak(lambda: cuflash.standard_attention(
            q1, k1, v1, causal=args.causal, backend="numpy"))
        del q1, k1, v1
        out_bytes = B * H * N * d * 4
        model = cuflash.memory_analysis(N, d, "float32", batch=B, heads=H)
        mem_rows = [
            {"N": N, "method": "cuflash tiled", "peak_bytes": tiled_peak, "seconds": tiled_s,
             "extra_bytes": tiled_peak - out_bytes},
            {"N": N, "method": "cuflash standard", "peak_bytes": std_peak1 * B * H,
             "measured_heads": 1,
             # not measured at B x H heads: scaled from one (memory is linear in the heads)
             "extrapolated": f"measured at 1 head, x{B * H}" if B * H != 1 else "",
             "extra_bytes": (std_peak1 - N * d * 4) * B * H},
        ]
        mem_summary = {
            "N": N, "tiled_peak_bytes": tiled_peak, "tiled_extra_bytes": tiled_peak - out_bytes,
            "standard_peak_bytes": std_peak1 * B * H,
            "standard_extra_bytes": (std_peak1 - N * d * 4) * B * H,
            "standard_model_extra_bytes": model["standard_extra_bytes"],
        }
        mem_summary["tiled_over_standard_extra"] = (mem_summary["tiled_extra_bytes"]
                                                    / mem_summary["standard_extra_bytes"])
    else:
        mem_summary = None
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    res = {"config": {"B": B, "H": H, "d": d, "dtype": "float32", "causal": args.causal,
                      "sizes": sizes, "reps": args.reps, "warmup": args.warmup,
                      "block_q": args.block_q, "block_kv": args.block_kv},
           "machine": info, "load_before": load_before, "load_after": load_after,
           "torch": torch_ok or torch_why, "rows": rows, "memory": mem_summary,
           "mem_rows": mem_rows, "wall_s": time.perf_counter() - t_start}
    return res


def report(res, plot_path=""):
    """Print the results (markdown table + memory line + machine); save the plot."""
    c, m = res["config"], res["machine"]
    print(f"cuflash CPU benchmark: B={c['B']} H={c['H']} d={c['d']} float32"
          f"{' causal' if c['causal'] else ''}, median of {c['reps']} interleaved runs after "
          f"{c['warmup']} warm-up")
    print(f"machine: {m.get('cpu')}, {m.get('nproc')} cores; numpy {m['numpy']}"
          + (f" ({m['blas']}, {m.get('blas_threads')} threads)" if "blas" in m else "")
          + (f"; torch {m['torch']} ({m['torch_threads']} threads)" if "torch" in m else
             f"; torch SDPA not run: {res['torch']}"))
    extra = {k_: m[k_] for k_ in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                  "CUFLASH_NUM_THREADS") if k_ in m}
    if extra:
        print(f"environment: {extra}")
    lb, la = res["load_before"], res["load_after"]
    if lb is not None:
        print(f"load average (1/5/15 min) before: {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}, "
              f"after: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    print()
    print(format_table(res["rows"]))
    print()
    print("peak MiB: tracemalloc peak of one call (outputs included) for the NumPy methods; "
          "(RSS) = resident-set high-water growth of one call in a fresh process for torch.")
    mem = res["memory"]
    if mem:
        print()
        print(f"memory at N={mem['N']} (B={c['B']}, H={c['H']}): cuflash tiled peak "
              f"{_fmt_mib(mem['tiled_peak_bytes'])} MiB, extra beyond the output "
              f"{_fmt_mib(mem['tiled_extra_bytes'])} MiB; cuflash standard "
              f"{_fmt_mib(mem['standard_peak_bytes'])} MiB (measured at 1 head, x{c['B'] * c['H']}),"
              f" extra {_fmt_mib(mem['standard_extra_bytes'])} MiB -> tiled extra = "
              f"{100 * mem['tiled_over_standard_extra']:.2f}% of standard extra "
              f"(model of S and P: {_fmt_mib(mem['standard_model_extra_bytes'])} MiB)")
    sd = [r for r in res["rows"] if r["method"] == "cuflash tiled" and r.get("ratio_sdpa")]
    if sd:
        print()
        print("cuflash tiled / torch SDPA time: "
              + ", ".join(f"N={r['N']}: {r['ratio_sdpa']:.2f}x" for r in sd))
    print(f"\n(benchmark wall time {res['wall_s']:.0f} s)")
    if plot_path:
        title = (f"cuflash CPU benchmark: B={c['B']} H={c['H']} d={c['d']} {c['dtype']}"
                 f"{' causal' if c['causal'] else ''}")
        path, why = save_plot(res["rows"], res["mem_rows"], plot_path, title)
        print(f"plot: {path}" if path else f"plot not saved: {why}")


def run_and_report(args):
    """Run with parsed ``args``, print the report, write the JSON; the exit status."""
    res = run(args)
    report(res, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"json: {os.path.abspath(args.json)}")
    return 0


def main(argv=None, prog=None):
    """``bench/bench_cpu.py`` / ``python -m cuflash bench``: parse ``argv`` and run."""
    return run_and_report(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

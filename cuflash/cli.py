"""Command line: ``python -m cuflash demo``, ``bench`` and ``compile`` (``--help`` says what
each does).  ``bench`` belongs to the benchmark harness, which is not part of the package but
lives in ``bench/cuflash_bench/`` of a source checkout, found beside ``cuflash/``; an installed
copy without it says how to get it.  Bad option values are one-line argparse errors with exit
status 2 (``cuflash/_cliargs.py``).
"""
import importlib
import importlib.util
import os
import sys
import time
import tracemalloc

import numpy as np

import cuflash

from . import available_backends, tiling
from ._cliargs import Parser, choice_list, int_list, nonneg_int, positive_int
from ._validate import SUPPORTED_DTYPES
from .reference import standard_attention
from .trace import backward_steps, format_backward, format_trace, trace_forward, worked_example


def _default_backend():
    """cuda when a GPU and CuPy are usable here, else numpy."""
    try:
        ok, _ = available_backends().get("cuda", (False, ""))
    except Exception:  # a broken CUDA install must not stop the demo
        ok = False
    return "cuda" if ok else "numpy"


def _say(msg=""):
    print(msg, flush=True)


def _progress(msg):
    print(f"  ... {msg}", file=sys.stderr, flush=True)


def walkthrough():
    """The 4x4 walk-through: forward trace, check against standard attention, backward."""
    ex = worked_example()
    q, k, v, do = ex["q"], ex["k"], ex["v"], ex["do"]
    _say("=" * 78)
    _say("Part 1 - a 4x4 walk-through: Q, K, V of 4 rows, scale = 1, tiles of 2 rows")
    _say("=" * 78)
    _say("Q, K, V:")
    for name, a in (("Q", q), ("K", k), ("V", v)):
        _say(f"  {name} = " + np.array2string(a, precision=0, separator=", ",
                                              prefix=f"  {name} = "))
    _say()
    tr = trace_forward(q, k, v, block_q=2, block_kv=2, scale=1.0)
    _say(format_trace(tr))
    o_std, p = standard_attention(q, k, v, scale=1.0)
    err = float(np.max(np.abs(tr.o - o_std)))
    _say(f"Tiled output == standard softmax(QK^T) V: max |difference| = {err:.1e}")
    _say("P = " + np.array2string(p, precision=3, separator=", ", prefix="P = "))
    _say()
    _say("Backward with dO = " + np.array2string(do, precision=0, separator=", ",
                                                  prefix="Backward with dO = "))
    _say(format_backward(backward_steps(do, q, k, v, scale=1.0)))
    _say("(To more digits: l of rows 0-1 after tile (0,1) = 1.6386, their O[0,0] = 11.8039 and "
         "O[0,3] = 16.7196;\n D[0] = 34.8155, dS[0,0] = -5.5715, dQ[0,1] = 1.1868, "
         "dQ[2,0:2] = -3.1458, 3.1458.)")


def _measure_numpy(fn):
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        return out, dt, tracemalloc.get_traced_memory()[1], "tracemalloc peak of the call"
    finally:
        tracemalloc.stop()


def _measure_cupy(fn):
    import cupy  # optional (the cuda extras): only a cuda run measures with it
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    t0 = time.perf_counter()
    out = fn()
    cupy.cuda.Device().synchronize()
    dt = time.perf_counter() - t0
    # the pool keeps every block the call needed at once: its growth is the peak
    return out, dt, pool.total_bytes() - before, "CuPy memory-pool growth during the call"


def compare(backend, B, H, N, d, causal, block_q, block_kv, seed=0):
    """Standard vs tiled on one problem: agreement, time and memory of each."""
    _say("=" * 78)
    _say(f"Part 2 - standard vs tiled attention on backend {backend!r}: "
         f"B={B}, H={H}, N={N}, d={d}, float32" + (f", causal={causal}" if causal else ""))
    _say("=" * 78)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, H, N, d), dtype=np.float32) for _ in range(3))
    measure = _measure_numpy
    if backend == "cuda":
        import cupy  # optional (the cuda extras): only a cuda run needs it
        q, k, v = (cupy.asarray(a) for a in (q, k, v))
        measure = _measure_cupy
    # one untimed call each first: thread pools, BLAS and (cuda) kernel compilation
    _progress("warm-up")
    cuflash.standard_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], causal=causal,
                               backend=backend)
    cuflash.tiled_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv,
                            backend=backend)
    _progress("standard attention (materialises the (N, N) probabilities)")
    (o_std, _), t_std, mem_std, how = measure(
        lambda: cuflash.standard_attention(q, k, v, causal=causal, backend=backend))
    _progress("tiled attention (online softmax over tiles)")
    (o_tiled, lse), t_tiled, mem_tiled, _ = measure(
        lambda: cuflash.tiled_attention(q, k, v, causal=causal, block_q=block_q,
                                        block_kv=block_kv, return_lse=True, backend=backend))
    if backend == "cuda":
        o_std, o_tiled = o_std.get(), o_tiled.get()
    o_std = np.asarray(o_std, dtype=np.float64)
    o_tiled = np.asarray(o_tiled, dtype=np.float64)
    diff = float(np.max(np.abs(o_std - o_tiled)))
    rel = float(np.linalg.norm(o_std - o_tiled) / np.linalg.norm(o_std))
    model = cuflash.memory_analysis(N, d, "float32", block_q=block_q, block_kv=block_kv,
                                    batch=B, heads=H, backend=backend if backend != "numpy"
                                    else None)
    mib = 2.0 ** 20
    _say(f"outputs agree: max |standard - tiled| = {diff:.2e}, relative error {rel:.2e}")
    _say(f"{'':18}{'time':>10}{'memory used':>16}")
    _say(f"{'standard':18}{t_std * 1e3:>8.1f} ms{mem_std / mib:>12.1f} MiB")
    _say(f"{'tiled':18}{t_tiled * 1e3:>8.1f} ms{mem_tiled / mib:>12.1f} MiB")
    _say(f"(memory used = {how}; it includes the {B * H * N * d * 4 / mib:.1f} MiB output"
         + ("; the NumPy tiled path also stages [K, 1] and [V, 1] once, "
            f"{2 * B * H * N * (d + 1) * 4 / mib:.1f} MiB, and keeps one tile set per "
            "worker thread)" if backend == "numpy" else ")"))
    _say(f"model (memory_analysis): standard needs S and P = "
         f"{model['standard_extra_bytes'] / mib:.1f} MiB extra, tiled "
         f"{model['tiled_extra_bytes'] / mib:.2f} MiB (row statistics + one tile pair); "
         f"HBM traffic {model['standard_hbm_bytes'] / mib:.2f} vs "
         f"{model['tiled_hbm_bytes'] / mib:.2f} MiB; tiles block_q={model['block_q']}, "
         f"block_kv={model['block_kv']}")
    if backend == "numpy":
        _say("(the model counts S and P as two arrays, as a textbook implementation keeps "
             "them; the NumPy reference overwrites S with P in place, so it holds one "
             "(N, N) array per head: half the modelled figure, plus its output)")
    if not rel < 1e-4:
        _say("ERROR: standard and tiled attention disagree")
        return 1
    return 0


def demo(args):
    backend = args.backend or _default_backend()
    if not args.no_walkthrough:
        walkthrough()
        _say()
    ok, why = available_backends().get(backend, (False, "unknown backend"))
    if not ok:
        _say(f"backend {backend!r} is not available here: {why}")
        return 2
    # emulated kernels run ~10^4 times slower than a GPU: smaller defaults there; what the
    # user passes is always used
    small = backend == "emulator"
    N = args.n if args.n is not None else (128 if small else 2048)
    H = args.heads if args.heads is not None else (2 if small else 8)
    return compare(backend, args.batch, H, N, args.dim, args.causal or False, args.block_q,
                   args.block_kv, args.seed)


# the benchmark harness: ``cuflash/`` and ``bench/`` sit side by side in a source checkout
HARNESS = "cuflash_bench"
HARNESS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                           HARNESS)


def have_harness():
    """Whether the benchmark harness is here (a source checkout; an installed copy lacks it)."""
    return os.path.isfile(os.path.join(HARNESS_DIR, "__init__.py"))


def bench_module(name):
    """Module ``name`` (``cpu``, ``gpu``) of the benchmark harness ``bench/cuflash_bench`` of
    this checkout, or None when cuflash runs from an installed copy with no ``bench/`` beside
    it.  The harness is loaded from its folder, without adding anything to ``sys.path``."""
    if not have_harness():
        return None
    if HARNESS not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            HARNESS, os.path.join(HARNESS_DIR, "__init__.py"),
            submodule_search_locations=[HARNESS_DIR])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[HARNESS] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"{HARNESS}.{name}")


def _no_harness():
    """One line on stderr saying where the benchmark is; exit status 2."""
    print("python -m cuflash bench: the benchmark harness is not installed with cuflash (no "
          f"{HARNESS_DIR}); clone the cuflash source repository and run python -m cuflash "
          "bench from its root", file=sys.stderr)
    return 2


def build_parser():
    cpu_bench = bench_module("cpu")
    p = Parser(
        prog="python -m cuflash",
        description="cuflash: exact FlashAttention - demo of the algorithm and benchmarks.")
    sub = p.add_subparsers(dest="command", metavar="{demo,bench,compile}")
    d = sub.add_parser(
        "demo", help="the 4x4 walk-through tile by tile, then standard vs tiled attention",
        description="Print a 4x4 walk-through of the algorithm tile by tile (running m, l and "
        "unnormalised O after each tile) and its backward, then run standard and tiled "
        "attention at a moderate size on a backend, showing that they agree and the memory "
        "each used.")
    d.add_argument("--backend", choices=("numpy", "cuda", "emulator"), default=None,
                   help="backend for part 2 (default: cuda when a GPU and CuPy are present, "
                   "else numpy)")
    d.add_argument("--n", type=positive_int, default=None,
                   help="sequence length for part 2 (default 2048; 128 on the emulator)")
    d.add_argument("--batch", type=positive_int, default=1, help="batch (default: %(default)s)")
    d.add_argument("--heads", type=positive_int, default=None,
                   help="heads for part 2 (default 8; 2 on the emulator)")
    d.add_argument("--dim", type=positive_int, default=64, help="head dim (default: %(default)s)")
    d.add_argument("--causal", choices=("bottom_right", "top_left"), default=None,
                   help="causal mask for part 2 (default: none)")
    d.add_argument("--block-q", type=positive_int, default=None,
                   help="tiled block_q (default: auto)")
    d.add_argument("--block-kv", type=positive_int, default=None,
                   help="tiled block_kv (default: auto)")
    d.add_argument("--seed", type=nonneg_int, default=0, help="random seed (default: %(default)s)")
    d.add_argument("--no-walkthrough", action="store_true", help="skip part 1")
    d.set_defaults(option_error=d.error)  # for option checks after parsing
    if cpu_bench is None:  # main() answers `bench` before parsing; --help still lists it
        sub.add_parser("bench", help="CPU and GPU benchmarks (from a source checkout: bench/ "
                       "is not installed)")
        _add_compile_parser(sub)
        return p
    b = sub.add_parser("bench", parents=[cpu_bench.build_parser(add_help=False)],
                       help="CPU benchmark (naive NumPy, cuflash standard/tiled, torch SDPA); "
                       "--gpu: the GPU benchmark",
                       description="CPU benchmark of the cuflash NumPy backend against naive "
                       "NumPy and torch SDPA: median time, GFLOP/s (flash-attn convention), "
                       "peak memory, and a plot against N (pip install \".[bench]\" torch). "
                       "With --gpu: the GPU benchmark instead, whose options "
                       "'python -m cuflash bench --gpu --help' lists.")
    # handled in main() before parsing: everything after `bench --gpu` is the GPU bench's
    b.add_argument("--gpu", action="store_true",
                   help="run the GPU benchmark (bench/cuflash_bench/gpu.py) with the options that "
                   "follow; 'bench --gpu --help' lists them")
    _add_compile_parser(sub)
    return p


def _check_demo_tiles(args, backend):
    """Refuse tile sizes the backend's planner refuses, as an option error (not a traceback)."""
    if args.block_q is None and args.block_kv is None:
        return
    N = args.n if args.n is not None else (128 if backend == "emulator" else 2048)
    try:
        cuflash.memory_analysis(N, args.dim, "float32", block_q=args.block_q,
                                block_kv=args.block_kv, batch=args.batch, heads=args.heads,
                                backend=None if backend == "numpy" else backend)
    except ValueError as e:
        args.option_error(f"--block-q/--block-kv: {e}")


def _gpu_bench_argv(argv):
    """The arguments after ``bench`` when ``--gpu`` is among them (less ``--gpu``), else None."""
    if "bench" not in argv:
        return None
    rest = argv[argv.index("bench") + 1:]
    if "--gpu" not in rest:
        return None
    return [a for a in rest if a != "--gpu"]


# --------------------------------------------------------------------------
# compile: fill the kernel cache ahead of time
# --------------------------------------------------------------------------
def _add_compile_parser(sub):
    c = sub.add_parser(
        "compile", help="compile the kernels of default-tile calls now (fill the cache)",
        description="Compile the forward and backward kernels of default-tile calls for "
        "the given dtypes and head dims, concurrently, so that later processes load them "
        "from the cache instead of compiling at their first call (for containers and "
        "clusters). On a GPU the cache is CuPy's ($CUPY_CACHE_DIR, default "
        "~/.cupy/kernel_cache); on the emulator $CUFLASH_CACHE_DIR/emulator (default "
        "~/.cache/cuflash/emulator).")
    c.add_argument("--dtypes", type=choice_list(SUPPORTED_DTYPES), default=["float16", "bfloat16"],
                   help="comma-separated dtypes (default: float16,bfloat16)")
    c.add_argument("--head-dims", type=int_list, default=[64, 128],
                   help="comma-separated head dims (default: 64,128)")
    c.add_argument("--features", action="store_true",
                   help="also compile the kernels of calls with logit features (bias, window, "
                   "alibi_slopes, softcap, dropout: one build serves them all, and the "
                   "16-bit backward's band-only build a window alone)")
    c.add_argument("--backend", choices=("cuda", "emulator"), default=None,
                   help="default: cuda (a GPU and CuPy must be present)")


def compile_kernels(args):
    backend = args.backend or "cuda"
    ok, why = available_backends()[backend]
    if not ok:
        print(f"backend {backend!r} is not available here: {why}", file=sys.stderr)
        return 2
    try:
        res = cuflash.precompile(args.dtypes, args.head_dims, features=args.features,
                                 backend=backend, progress=_progress)
    except ValueError as e:  # a head dim no kernel supports, shared memory, ...
        print(f"cannot compile: {e}", file=sys.stderr)
        return 2
    for m in res["modules"]:
        _say(f"{m['file']:<18} {', '.join(m['kernels'])}  [{' '.join(m['options'])}]")
    _say(f"{len(res['modules'])} module(s) ready in {res['seconds']:.1f} s "
         f"(backend {res['backend']})")
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    gpu_argv = _gpu_bench_argv(argv)
    if (argv[:1] == ["bench"] or gpu_argv is not None) and not have_harness():
        return _no_harness()
    if gpu_argv is not None:
        return bench_module("gpu").main(gpu_argv, prog="python -m cuflash bench --gpu")
    p = build_parser()
    args = p.parse_args(argv)
    if getattr(args, "backend", None) == "emulator":
        try:
            tiling.emulator_arch()  # $CUFLASH_EMULATOR_ARCH, checked before any work
        except ValueError as e:
            p.error(str(e))
    if args.command == "demo":
        backend = args.backend or _default_backend()
        if available_backends().get(backend, (False, ""))[0]:
            _check_demo_tiles(args, backend)
        return demo(args)
    if args.command == "bench":
        return bench_module("cpu").run_and_report(args)
    if args.command == "compile":
        return compile_kernels(args)
    p.print_help()
    return 2

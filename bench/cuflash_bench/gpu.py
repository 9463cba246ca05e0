"""The GPU benchmark: cuflash against torch SDPA's backends, the method of the project's GPU
baseline notes.

Run it from a source checkout as ``python -m cuflash bench --gpu`` or
``python bench/bench_gpu.py``; ``--help`` lists the options.

What it does, in order:

1. **Grid of FlashAttention-2's benchmark**: for each dtype, head dim ``d``,
   causal or not and sequence length ``N``: batch ``B = tokens // N``, heads
   ``H = hidden // d`` (16384 tokens, hidden 2048 by default), modes ``fwd``
   (the forward call), ``bwd`` (only the backward call; the forward it needs
   runs once outside the timing) and ``fwdbwd`` (both).
2. **Decode shapes**: ``Nq = 1`` against ``Nk`` keys, MHA at batch 1 and 8 and
   GQA (32 query heads on 8 key/value heads), forward only.
3. **KV-cache decode** and 4. **varlen** batches, the serving calls
   (``gpu_serving.py``, whose docstring describes them).
5. **Logit features**: the plain call against each feature alone (bias,
   dbias, ALiBi, softcap, dropout, a sliding window) and a table of window
   widths (``gpu_features.py``, whose docstring describes it).
6. **Tiles** (only when named): every block_q x block_kv pair that the
   forward's and the backward's kernel accept, timed against the default
   (``gpu_tiles.py``).
7. **Host time per call** of a tiny problem, 200 calls without synchronising.
``--sections`` picks among them (default: all but tiles).

Methods: cuflash tiled (the FlashAttention kernels), cuflash standard (plain
CuPy; the NumPy reference on the emulator), and when torch can run them
``scaled_dot_product_attention`` with each backend forced by
``torch.nn.attention.sdpa_kernel`` (flash = FlashAttention-2, cudnn,
efficient, math).  All read the same inputs: torch views the CuPy arrays
through DLPack.  Before a method is timed on a kind of problem it must pass a
correctness check on a smaller problem of that kind
(``gpu_check.py``); a method that fails, or cannot run a case,
shows ``n/a`` or ``failed check`` with the reason once in a footnote.

Timing (``gpu_methods.py``): the first call of every case is
timed alone (it includes any first-use compile); after warm-up, ``n`` calls
per repeat so that one repeat takes about ``--target-ms``, CUDA events around
each repeat, the median of ``--reps`` repeats.  When one input set is small
enough to sit in the device's L2 cache, the calls cycle through several sets.
TFLOP/s in the flash-attn convention (``gpu_common.flops``).

``--backend emulator`` runs the same code on the CPU with the emulated
kernels (tiny sizes, ``time.perf_counter``): that is how the tests check the
table, JSON and plot without a GPU.
"""
import os
import sys
import tempfile
import time

from cuflash._cliargs import Parser, choice_list, int_list, nonneg_int, positive_int

from . import gpu_report as report
from .gpu_check import LOW_PRECISION, attention
from .gpu_common import DECODE, flops
from .gpu_features import LABELS, run_features, window_sizes
from .gpu_methods import (CudaDevice, CuflashTiled, HostDevice, Sdpa, Torch, check_method,
                          input_sets_needed, make_methods, make_set, measure, reason_of,
                          record_warnings)
from .gpu_serving import DENSE, Serving
from .gpu_tiles import TILE_FEATURES, parse_pairs, run_tiles

__all__ = ["main", "build_parser", "run", "flops"]

DTYPES = ("float16", "bfloat16", "float32", "float64")
SECTIONS = ("grid", "decode", "kvcache", "varlen", "features", "tiles", "host")
# tiles compiles, checks and times every accepted tile pair: asked for by name
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "tiles")
MODES = ("fwd", "bwd", "fwdbwd")

# Defaults per backend; the emulator's are tiny (an emulated launch takes 0.05-0.1 s).
DEFAULTS = {
    "cuda": dict(dims=[64, 128], seqlens=[512, 1024, 2048, 4096, 8192, 16384], tokens=16384,
                 hidden=2048, reps=5, warmup=3, decode_nk=[1024, 4096, 8192, 16384, 65536],
                 decode_dim=128, host_calls=200, check_n=257, kv_nq=[1, 4],
                 kv_page_sizes=[16, 256], varlen_mean=[512, 2048], target_ms=50.0,
                 feature_n=4096, tiles_n=4096),
    # warm-up 0 on the emulator: the (untimed) first call is its warm-up
    "emulator": dict(dims=[16, 32], seqlens=[32, 64], tokens=64, hidden=32, reps=2, warmup=0,
                     decode_nk=[32, 128], decode_dim=16, host_calls=3, check_n=33, kv_nq=[1, 4],
                     kv_page_sizes=[4, 16], varlen_mean=[16], target_ms=10.0, feature_n=32,
                     tiles_n=32),
}
# the host-time problem (B, H, Hk, Nq, Nk, d)
HOST_SHAPE = {"cuda": (1, 1, 1, 128, 128, 64), "emulator": (1, 1, 1, 32, 32, 16)}
MIN_REPS_CUDA = 5


# the cuflash method that must run in some case of these sections, else the run failed
MAIN_METHOD = {"cuflash tiled": ("grid", "decode", "features", "tiles"), "cuflash kvcache": ("kvcache",),
               "cuflash varlen": ("varlen",)}


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------
def build_parser(prog=None):
    """The benchmark's options; backend-dependent defaults are filled in by ``finish_args``."""
    def dflt(key):
        c, e = DEFAULTS["cuda"][key], DEFAULTS["emulator"][key]
        show = (lambda v: ",".join(map(str, v))) if isinstance(c, list) else str
        return f"default {show(c)}; emulator {show(e)}"
    p = Parser(prog=prog, description=(
        "GPU benchmark of cuflash (tiled and standard attention) against torch SDPA with each "
        "backend forced (flash, cudnn, efficient, math): correctness check against float64 "
        "first, then median time (CUDA events), TFLOP/s (flash-attn convention), first-call "
        "(compile) time, decode shapes and host time per call; then the serving calls: a KV "
        "cache at decode time (contiguous and paged, GB/s of K/V read, against SDPA, "
        "flash-attn and vLLM when importable) and ragged varlen batches (against equal "
        "lengths and flash-attn); the cost of each logit feature (bias, ALiBi, softcap, "
        "dropout, windows) against the plain call; tables, JSON and a plot. "
        "Needs CuPy and a GPU (pip install \".[cuda12,bench]\" or \".[cuda13,bench]\", plus "
        "torch with CUDA for SDPA). --backend emulator runs tiny sizes on the CPU with the "
        "emulated kernels (defaults dims 16,32, seqlens 32,64, tokens 64, hidden 32, reps 2, "
        "warmup 0, decode-nk 32,128, host-calls 3, kv-page-sizes 4,16, varlen-mean 16, "
        "target-ms 10, feature-n 32; all sections in about 50 s of CPU time with an empty "
        "kernel cache, 25 s with a full one)."))
    p.add_argument("--backend", choices=("cuda", "emulator"), default="cuda",
                   help="where cuflash runs (default: %(default)s)")
    p.add_argument("--sections", type=choice_list(SECTIONS), default=list(DEFAULT_SECTIONS),
                   help="comma-separated, of grid (FlashAttention-2's grid), decode (Nq = 1), "
                   "kvcache (attention_with_kvcache, contiguous and paged), varlen (ragged "
                   "batches), features (each logit feature against the plain call, and window "
                   "widths), tiles (every block_q x block_kv the forward's and the backward's "
                   "kernel accepts, against the default), host (host time per call); default: "
                   "all but tiles")
    p.add_argument("--dtypes", type=choice_list(DTYPES), default=["float16"],
                   help=f"comma-separated, of {','.join(DTYPES)} (default float16)")
    p.add_argument("--dims", type=int_list,
                   help=f"head dims d of the grid and varlen sections ({dflt('dims')})")
    p.add_argument("--seqlens", type=int_list, help=f"sequence lengths N ({dflt('seqlens')})")
    p.add_argument("--causal", choices=("no", "yes", "both"), default="both",
                   help="causal cases of the grid (top-left mask, PyTorch's is_causal) and varlen "
                   "(per sequence) sections (default: %(default)s; the features section is "
                   "non-causal)")
    p.add_argument("--modes", type=choice_list(MODES), default=list(MODES),
                   help="comma-separated, of fwd,bwd,fwdbwd, for the grid and varlen sections "
                   "(default: all)")
    p.add_argument("--tokens", type=positive_int,
                   help="batch x N, as in FlashAttention-2's benchmark; also the tokens of a "
                   f"varlen batch ({dflt('tokens')})")
    p.add_argument("--hidden", type=positive_int,
                   help="heads x d, as in FlashAttention-2's benchmark, and in the varlen "
                   f"section ({dflt('hidden')})")
    p.add_argument("--reps", type=positive_int,
                   help=f"timed repeats, the median is reported (at least {MIN_REPS_CUDA} on "
                   f"cuda; {dflt('reps')})")
    p.add_argument("--warmup", type=nonneg_int,
                   help="warm-up calls after the first call (which is timed alone); the last "
                   f"sizes a repeat ({dflt('warmup')})")
    p.add_argument("--target-ms", type=float,
                   help="calls per repeat chosen so a repeat takes about this long "
                   f"({dflt('target_ms')}: the emulator's times say nothing about a GPU)")
    p.add_argument("--decode-nk", type=lambda s: int_list(s, allow_empty=True),
                   help="key lengths of the decode and KV-cache sections, '' to skip both "
                   f"({dflt('decode_nk')})")
    p.add_argument("--decode-dim", type=positive_int,
                   help=f"head dim of the decode and KV-cache sections ({dflt('decode_dim')})")
    p.add_argument("--kv-nq", type=int_list,
                   help="queries per sequence in the KV-cache section, each a new token appended "
                   f"by the call ({dflt('kv_nq')})")
    p.add_argument("--kv-page-sizes", type=lambda s: int_list(s, allow_empty=True),
                   help="page sizes of the paged caches of the KV-cache section, '' for none "
                   f"({dflt('kv_page_sizes')})")
    p.add_argument("--varlen-mean", type=int_list,
                   help="mean sequence lengths of the varlen section: tokens // mean sequences "
                   f"of 1 to 2 x mean tokens ({dflt('varlen_mean')})")
    p.add_argument("--feature-n", type=positive_int,
                   help="queries and keys of the features section's problem; batch = tokens // "
                   f"N, heads = hidden // d ({dflt('feature_n')})")
    p.add_argument("--feature-windows", type=int_list,
                   help="left widths w of the features section's window table, window=(w, 0) "
                   "(default N/16,N/8,N/4,N/2 of --feature-n)")
    p.add_argument("--tiles-n", type=positive_int,
                   help="queries and keys of the tiles section's problem; batch = tokens // N, "
                   f"heads = hidden // d ({dflt('tiles_n')})")
    p.add_argument("--tiles-pairs", type=parse_pairs, default=[],
                   help="comma-separated block_q x block_kv pairs the tiles section times besides "
                   "the default, e.g. 128x64,64x64 (default: every pair the kernel accepts)")
    p.add_argument("--tiles-feature", choices=TILE_FEATURES, default=None,
                   help="a logit feature for the tiles section's calls, so that it times the "
                   "tiles of the kernels with the features (flash_fwd_tc_masked, "
                   "flash_bwd_tc_masked, ...; the features section's arguments; non-causal only): "
                   + ", ".join(f"{n} = {LABELS[n]}" for n in TILE_FEATURES))
    p.add_argument("--host-calls", type=nonneg_int,
                   help=f"calls timed for the host time per call, 0 to skip ({dflt('host_calls')})")
    p.add_argument("--check-n", type=positive_int,
                   help="sequence length of the correctness checks (KV cache: keys after the "
                   f"append; varlen: a batch of 2 x check-n tokens) ({dflt('check_n')})")
    p.add_argument("--l2-bytes", type=nonneg_int, default=None,
                   help="L2 size that decides input rotation (default: the device's; none on "
                   "the emulator; 0: never rotate)")
    p.add_argument("--cold-cache", action="store_true",
                   help="compile into an empty temporary kernel cache, so first calls include "
                   "the compile even when CuPy's disk cache holds the kernels")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out the methods that run through torch: SDPA, flash-attn, vLLM")
    p.add_argument("--seed", type=nonneg_int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--json", default="", help="write every number here as JSON")
    p.add_argument("--plot", default="bench_gpu.png",
                   help="PNG of TFLOP/s against N (default: %(default)s; '' for none; needs "
                   "matplotlib)")
    return p


def finish_args(parser, args):
    """Fill the backend's defaults and refuse combinations the benchmark cannot run."""
    for key, value in DEFAULTS[args.backend].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend == "cuda" and args.reps < MIN_REPS_CUDA:
        parser.error(f"argument --reps: {args.reps} is below {MIN_REPS_CUDA} (the GPU timing is "
                     f"a median of at least {MIN_REPS_CUDA} repeats)")
    if not args.target_ms > 0:
        parser.error(f"argument --target-ms: {args.target_ms} is not positive")
    for d in args.dims:
        if args.hidden % d:
            parser.error(f"argument --hidden: {args.hidden} is not a multiple of head dim {d}")
    for N in args.seqlens if "grid" in args.sections else ():
        if N > args.tokens:
            parser.error(f"argument --seqlens: N={N} exceeds --tokens {args.tokens} "
                         "(tokens = batch x N)")
    if "features" in args.sections:
        if args.feature_n > args.tokens:
            parser.error(f"argument --feature-n: {args.feature_n} exceeds --tokens {args.tokens} "
                         "(tokens = batch x N)")
        if args.feature_windows is None:
            args.feature_windows = window_sizes(args.feature_n)
        for w in args.feature_windows:
            if w >= args.feature_n:  # (int_list refuses w < 1)
                parser.error(f"argument --feature-windows: {w} is not in 1 .. feature-n - 1 "
                             f"({args.feature_n - 1})")
    if "tiles" in args.sections and args.tiles_n > args.tokens:
        parser.error(f"argument --tiles-n: {args.tiles_n} exceeds --tokens {args.tokens} "
                     "(tokens = batch x N)")
    if "tiles" in args.sections and args.tiles_feature and args.causal != "no":
        parser.error("argument --tiles-feature: the features' check has no causal mask; use "
                     "--causal no")
    if "tiles" in args.sections and not set(args.modes) & {"fwd", "bwd"}:
        parser.error("argument --modes: the tiles section times fwd and bwd (fwdbwd has no "
                     "tiles of its own); name at least one of them")
    if "varlen" in args.sections:
        for mean in args.varlen_mean:
            if mean > args.tokens:
                parser.error(f"argument --varlen-mean: {mean} exceeds --tokens {args.tokens} "
                             "(the batch holds tokens // mean sequences)")
    if "kvcache" in args.sections and args.decode_nk:
        for nq in args.kv_nq:
            low = min(min(args.decode_nk), args.check_n)
            if nq > low:
                parser.error(f"argument --kv-nq: {nq} new tokens exceed the {low} keys of the "
                             "smallest --decode-nk or --check-n (Nq <= Nk)")
    if "bfloat16" in args.dtypes:
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            parser.error("argument --dtypes: bfloat16 needs ml_dtypes (pip install ml_dtypes)")
    args.causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    return args


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------
class Bench:
    """One run: the device, torch, the methods, the correctness verdicts and the results."""

    def __init__(self, args, log=_log):
        self.args, self.log = args, log
        self.device = CudaDevice() if args.backend == "cuda" else HostDevice()
        if args.l2_bytes is not None:
            self.device.l2_bytes = args.l2_bytes or None
        self.torch = Torch(self.device, disabled=args.no_torch)
        self.methods = make_methods(args.backend, self.torch)
        self.verdicts = {}
        self.checks, self.cases = [], []

    # -- correctness -----------------------------------------------------------
    def verdict(self, dtype, d, causal, group, decode, grad):
        """{method: check record} for a kind of problem; the check runs on first request."""
        kind = (dtype, d, causal, group, decode, grad)
        if kind not in self.verdicts:
            self.verdicts[kind] = self._check(*kind)
        return self.verdicts[kind]

    def _check(self, dtype, d, causal, group, decode, grad):
        a = self.args
        Hk = 2
        shape = (2, Hk * group, Hk, 1 if decode else a.check_n, a.check_n, d)
        what = (f"{dtype} d={d} {'causal' if causal else 'non-causal'}"
                f"{' GQA' if group > 1 else ''}{' decode' if decode else ''}"
                f"{' with gradients' if grad else ''}")
        self.log(f"check {what} at B,H,Hk,Nq,Nk,d={shape} against float64")
        x, host = make_set(self.device, self.torch, shape, dtype, causal, a.seed + 7, host=True)
        do = host[3] if grad else None
        ref = attention(*host[:3], causal, do)
        base = attention(*host[:3], causal, do, low=dtype) if dtype in LOW_PRECISION else None
        out = {}
        for m in self.methods:
            rec = {"kind": {"dtype": dtype, "d": d, "causal": causal, "group": group,
                            "decode": decode, "grad": grad},
                   "shape": dict(zip(("B", "H", "Hk", "Nq", "Nk", "d"), shape)),
                   "method": m.name, "status": "n/a"}
            check_method(self.device, m, x, grad, ref, base, dtype, what, rec)
            self.log(f"  {m.name}: {rec['status']}" + (f" ({rec['reason']})"
                                                        if rec.get("reason") else ""))
            self.checks.append(rec)
            out[m.name] = rec
        self.device.release()
        return out

    # -- timing ----------------------------------------------------------------
    def run_shape(self, section, dtype, shape, causal, modes):
        """Time every method in every mode on one problem shape; appends to ``self.cases``."""
        a = self.args
        B, H, Hk, Nq, Nk, d = shape
        self.device.release()
        x0 = make_set(self.device, self.torch, shape, dtype, causal, a.seed)
        nsets = input_sets_needed(x0.nbytes + x0.q.nbytes, self.device.l2_bytes)
        sets = [x0] + [make_set(self.device, self.torch, shape, dtype, causal, a.seed + i)
                       for i in range(1, nsets)]
        for mode in modes:
            grad = mode != "fwd"
            verdicts = self.verdict(dtype, d, causal, H // Hk, Nq == 1 and Nk > 1, grad)
            case = {"section": section, "dtype": dtype, "d": d, "causal": causal, "mode": mode,
                    "B": B, "H": H, "Hk": Hk, "Nq": Nq, "Nk": Nk,
                    "flops": flops(B, H, Nq, Nk, d, causal, mode), "input_sets": nsets,
                    "input_set_bytes": x0.nbytes, "methods": {}}
            label = (f"{section} {dtype} d={d} {'causal' if causal else 'non-causal'} {mode} "
                     f"B={B} H={H}{f'/{Hk}' if Hk != H else ''} Nq={Nq} Nk={Nk}")
            for m in self.methods:
                e = self.time_method(m, mode, sets, verdicts[m.name])
                e["tflops"] = case["flops"] / (e["ms"] * 1e-3) / 1e12 if "ms" in e else None
                case["methods"][m.name] = e
                self.log(f"{label}: {m.name}: " + (
                    f"{e['ms']:.4g} ms, {e['tflops']:.4g} TFLOP/s (first call "
                    f"{e['first_call_ms']:.4g} ms, {e['calls_per_rep']} calls x {a.reps})"
                    if e["status"] == "ok" else f"{e['status']}: {e['reason']}"))
            _ratios(case)
            self.cases.append(case)
        sets = x0 = None
        self.device.release()

    def time_method(self, m, mode, sets, verdict):
        """Median time of method ``m`` in ``mode`` over ``sets`` (its check ``verdict`` first)."""
        a = self.args
        if verdict["status"] != "passed":
            return {"status": "failed check" if verdict["status"] == "failed" else "n/a",
                    "reason": verdict.get("reason", "")}
        grad = mode != "fwd"
        why = m.unavailable(sets[0], self.device, grad)
        if why:
            return {"status": "n/a", "reason": why}
        caught, states = [], {}
        try:
            with record_warnings() as caught, m.context():
                if mode == "fwd":
                    def call(x):
                        return m.forward(x, False)
                elif mode == "bwd":  # the forward runs once per input set, outside the timing
                    states = {id(x): m.forward(x, True) for x in sets}

                    def call(x):
                        return m.backward(x, states[id(x)], retain=True)
                else:
                    def call(x):
                        return m.backward(x, m.forward(x, True))
                r = measure(self.device, call, sets, a.warmup, a.reps, a.target_ms / 1e3)
        except Exception as e:  # out of memory, an unsupported case: say so in the table
            states = None
            self.device.release()
            return {"status": "n/a", "reason": reason_of(e, caught)}
        r["status"] = "ok"
        return r

    # -- host time -------------------------------------------------------------
    def host_time(self, dtype):
        """Microseconds per call of a tiny problem, no synchronisation inside the loop."""
        a = self.args
        shape = HOST_SHAPE[a.backend]
        B, H, Hk, Nq, Nk, d = shape
        x = make_set(self.device, self.torch, shape, dtype, False, a.seed)
        tiled = CuflashTiled(a.backend)
        sdpa = Sdpa("sdpa (torch's choice)", None, self.torch)
        tasks = [(tiled, "fwd"), (tiled, "bwd")] + (
            [(sdpa, "fwd"), (sdpa, "bwd")] if not a.no_torch else [])
        out = []
        for m, mode in tasks:
            e = {"method": m.name, "mode": mode, "dtype": dtype,
                 "shape": dict(zip(("B", "H", "Hk", "Nq", "Nk", "d"), shape)),
                 "calls": a.host_calls}
            why = m.unavailable(x, self.device, mode == "bwd")
            caught = []
            try:
                if why:
                    raise LookupError(why)
                with record_warnings() as caught, m.context():
                    if mode == "fwd":
                        def call():
                            return m.forward(x, False)
                    else:
                        state = m.forward(x, True)

                        def call():
                            return m.backward(x, state, retain=True)
                    for _ in range(min(5, a.host_calls)):
                        call()
                    self.device.sync()
                    t0 = time.perf_counter()
                    for _ in range(a.host_calls):
                        call()
                    t = time.perf_counter() - t0
                    self.device.sync()
                e.update(status="ok", us_per_call=t / a.host_calls * 1e6)
            except LookupError:
                e.update(status="n/a", reason=why)
            except Exception as exc:
                e.update(status="n/a", reason=reason_of(exc, caught))
            self.log(f"host time {m.name} {mode}: " + (f"{e['us_per_call']:.1f} us per call"
                                                       if e["status"] == "ok" else e["reason"]))
            out.append(e)
        return out


def _ratios(case):
    """cuflash tiled's time over the fastest other method's and over SDPA flash's."""
    ms = {n: e["ms"] for n, e in case["methods"].items() if e["status"] == "ok"}
    tiled = ms.pop("cuflash tiled", None)
    case["fastest_other"] = min(ms, key=ms.get) if ms else None
    case["ratio_fastest_other"] = (tiled / ms[case["fastest_other"]]
                                   if tiled is not None and ms else None)
    case["ratio_sdpa_flash"] = (tiled / ms["sdpa flash"]
                                if tiled is not None and "sdpa flash" in ms else None)


def _footnotes(res):
    """Number each distinct reason once (with the methods it applies to); cells cite it."""
    notes, index = [], {}
    for case in res["cases"]:
        for name, e in case["methods"].items():
            if e["status"] != "ok":
                reason = e.get("reason", "")
                if reason not in index:
                    index[reason] = len(notes) + 1
                    notes.append({"n": index[reason], "methods": [], "reason": reason})
                note = notes[index[reason] - 1]
                if name not in note["methods"]:
                    note["methods"].append(name)
                e["note"] = index[reason]
    res["footnotes"] = notes


def run(args, log=_log):
    """Run the benchmark for parsed and finished ``args``; the results dict (JSON-ready)."""
    t0 = time.perf_counter()
    bench = Bench(args, log)
    a, dev = args, bench.device
    res = {"config": {k: v for k, v in vars(a).items() if k not in ("json", "plot")},
           "device": dev.info(), "versions": report.versions(bench.torch),
           "timer": dev.timer, "l2_bytes_for_rotation": dev.l2_bytes,
           "torch": "ok" if bench.torch.ok else bench.torch.why,
           "methods": [m.name for m in bench.methods]}
    sections = set(a.sections)
    for dtype in a.dtypes if "grid" in sections else ():
        for d in a.dims:
            H = a.hidden // d
            for causal in a.causals:
                for N in a.seqlens:
                    B = max(1, a.tokens // N)
                    bench.run_shape("grid", dtype, (B, H, H, N, N, d), causal, a.modes)
    for dtype in a.dtypes if "decode" in sections else ():
        for B, H, Hk in DECODE[a.backend]:
            for Nk in a.decode_nk:
                bench.run_shape("decode", dtype, (B, H, Hk, 1, Nk, a.decode_dim), False, ["fwd"])
    if sections & {"kvcache", "varlen"}:
        srv = Serving(bench)
        res["kv_methods"] = [m.name for m in srv.kv]
        res["varlen_methods"] = [m.name for m in srv.varlen] + [srv.equal.name, DENSE]
        if "kvcache" in sections:
            srv.run_kvcache()
        if "varlen" in sections:
            srv.run_varlen()
    if "features" in sections:
        run_features(bench)
    if "tiles" in sections:
        run_tiles(bench)
    res["host_time"] = (bench.host_time(a.dtypes[0])
                        if a.host_calls and "host" in sections else [])
    res["checks"], res["cases"] = bench.checks, bench.cases
    _footnotes(res)
    res["wall_s"] = time.perf_counter() - t0
    return res


def main(argv=None, prog=None):
    """``bench/bench_gpu.py`` / ``python -m cuflash bench --gpu``; the exit status.

    0: ran; 1: a cuflash method failed its correctness check, or the main
    cuflash method of a section (tiled, kvcache, varlen) could run none of
    its cases; 2: bad options, or the backend cannot run here (one line on
    stderr).
    """
    parser = build_parser(prog)
    args = finish_args(parser, parser.parse_args(argv))
    if args.cold_cache:
        # set before CuPy or the emulator compiles anything: both read it at compile time
        tmp = tempfile.mkdtemp(prefix="cuflash-cold-cache-")
        os.environ["CUPY_CACHE_DIR"] = os.path.join(tmp, "cupy")
        os.environ["CUFLASH_CACHE_DIR"] = tmp
    from cuflash import available_backends
    ok, why = available_backends().get(args.backend, (False, "unknown backend"))
    if not ok:
        print(f"{parser.prog}: cannot run --backend {args.backend}: "
              f"{' '.join(str(why).split())}", file=sys.stderr)
        return 2
    res = run(args)
    report.print_report(res)
    if args.json:
        print(f"json: {report.write_json(res, args.json)}")
    if args.plot:
        path, why = report.save_plot(res, args.plot)
        print(f"plot: {path}" if path else f"plot not saved: {why}")
    failed = [c for c in res["checks"] if c["status"] == "failed"
              and c["method"].startswith("cuflash")]
    idle = []  # a section whose main cuflash method ran in none of its cases
    for what, sections in MAIN_METHOD.items():
        cases = [c for c in res["cases"] if c["section"] in sections]
        if cases and not any(c["methods"][what]["status"] == "ok" for c in cases):
            idle.append(what)
            print(f"{what} ran in no case: see the footnotes", file=sys.stderr)
    return 1 if failed or idle else 0


if __name__ == "__main__":
    sys.exit(main())

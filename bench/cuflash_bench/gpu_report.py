"""Output of the GPU benchmark (``gpu.py``): header, tables, JSON and plot.

Every number printed here comes from the results dict that ``run`` measured;
nothing is computed here except ratios and unit conversions of those numbers.
"""
import importlib.metadata
import json
import os
import platform

import numpy as np

from .gpu_common import sig
from .gpu_features import kind_text as features_kind_text
from .gpu_features import print_features
from .gpu_methods import L2_SPAN
from .gpu_serving import _kind_text as serving_kind_text
from .gpu_serving import print_serving
from .gpu_tiles import kind_text as tiles_kind_text
from .gpu_tiles import print_tiles

__all__ = ["versions", "print_report", "format_cases", "write_json", "save_plot", "sig"]


def _dist_version(*names):
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def versions(torch_):
    """Library versions of this run ("not installed" where absent)."""
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cupy": _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"),
            "torch": torch_.version, "cudnn": torch_.cudnn,
            "flash_attn": _dist_version("flash-attn", "flash_attn"), "vllm": _dist_version("vllm"),
            "torch_cuda": getattr(getattr(getattr(torch_, "torch", None), "version", None),
                                  "cuda", None) or "none"}


def _causal(c):
    return "yes" if c else "no"


def _cell(e):
    if e["status"] == "ok":
        return f"{sig(e['ms'])} / {sig(e['tflops'])}"
    return f"{'failed check' if e['status'] == 'failed check' else 'n/a'} [{e['note']}]"


def format_cases(cases, methods):
    """Markdown table: one row per case, ``ms / TFLOP/s`` per method, cuflash's ratios."""
    head = ["dtype", "d", "causal", "mode", "B x H", "Nq", "Nk"] + list(methods) + [
        "tiled / fastest other", "tiled / sdpa flash"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if h in ("d", "Nq", "Nk") else "---" for h in head) + "|"]
    for c in cases:
        hk = f"/{c['Hk']}" if c["Hk"] != c["H"] else ""
        r1 = (f"{c['ratio_fastest_other']:.2f}x ({c['fastest_other']})"
              if c["ratio_fastest_other"] is not None else "n/a")
        r2 = f"{c['ratio_sdpa_flash']:.2f}x" if c["ratio_sdpa_flash"] is not None else "n/a"
        row = [c["dtype"], str(c["d"]), _causal(c["causal"]), c["mode"],
               f"{c['B']} x {c['H']}{hk}", str(c["Nq"]), str(c["Nk"])]
        row += [_cell(c["methods"][m]) for m in methods] + [r1, r2]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _header(res):
    cfg, dev, v = res["config"], res["device"], res["versions"]
    out = []
    if cfg["backend"] == "cuda":
        cc = dev.get("compute_capability", "?")
        out.append(f"cuflash GPU benchmark on {dev['name']} (sm_{cc}, {dev['sms']} SMs, "
                   f"{dev['memory_gib']} GiB, L2 {dev['l2_bytes'] / 2**20:.1f} MiB)")
        out.append(f"driver {dev['driver']} (CUDA {dev['cuda_driver_api']}), CUDA runtime "
                   f"{dev['cuda_runtime']}")
    else:
        out.append(f"cuflash GPU benchmark, emulator backend: {dev['name']}; the CUDA kernels "
                   "run emulated on the CPU (tiny sizes; times say nothing about a GPU)")
        if res["torch"] == "ok":
            out.append("SDPA methods run on torch's CPU kernels (the emulator backend works on "
                       "host arrays)")
    out.append(f"CuPy {v['cupy']}; NumPy {v['numpy']}; PyTorch {v['torch']} (CUDA "
               f"{v['torch_cuda']}); cuDNN {v['cudnn']}; Python {v['python']}"
               + (f"; flash-attn {v['flash_attn']}; vLLM {v['vllm']}" if "flash_attn" in v else ""))
    if res["torch"] != "ok":
        out.append(f"SDPA methods not run: {res['torch']}")
    l2 = res["l2_bytes_for_rotation"]
    out.append(f"grid: tokens (batch x N) = {cfg['tokens']}, hidden (heads x d) = {cfg['hidden']}; "
               f"dtypes {','.join(cfg['dtypes'])}; timing: {res['timer']}, median of "
               f"{cfg['reps']} repeats of n calls (a repeat ~{cfg['target_ms']:g} ms) after the "
               f"first call and {cfg['warmup']} warm-up call(s); inputs "
               + (f"rotated through several sets when one set is under {L2_SPAN} x L2 "
                  f"({sig(l2 / 2**20)} MiB)" if l2 else "not rotated (no L2 size)"))
    return out


_NOTES = [
    "cells: median ms per call / TFLOP/s (flash-attn convention: forward 4 B H Nq Nk d, halved "
    "when causal with Nq == Nk; bwd 2.5x, fwdbwd 3.5x); ratios: cuflash tiled's time over the "
    "other's (above 1: cuflash is slower)",
    "bwd: only the backward call is timed (its forward ran once per input set before); "
    "fwdbwd: forward + backward",
    "causal: cuflash causal='top_left', SDPA is_causal=True (the same mask when Nq == Nk)",
    "cuflash standard: its backward call takes no P and computes the forward again",
    "SDPA fwd runs under torch.no_grad(); SDPA backward is torch.autograd.grad",
]


def print_report(res, file=None):
    """Print the header, the grid, decode, KV-cache, varlen and features tables with footnotes,
    first-call times, host time per call and the correctness checks."""
    def say(s=""):
        print(s, file=file, flush=True)
    for line in _header(res):
        say(line)
    methods = res["methods"]
    dense = False
    for section, title in (("grid", "Main grid"), ("decode", "Decode (Nq = 1)")):
        cases = [c for c in res["cases"] if c["section"] == section]
        if cases:
            dense = True
            say()
            say(f"## {title}")
            say()
            say(format_cases(cases, methods))
    if dense:
        say()
        for n in _NOTES:
            say(f"- {n}")
    print_serving(res, say)
    print_features(res, say)
    print_tiles(res, say)
    if res["footnotes"]:
        say()
        for f in res["footnotes"]:
            say(f"[{f['n']}] {', '.join(f['methods'])}: {f['reason']}")
    _print_first_calls(res, say)
    _print_host_time(res, say)
    _print_checks(res, say)
    say()
    say(f"(benchmark wall time {res['wall_s']:.1f} s)")


def _kind_text(k):
    if k.get("section") == "features":
        return features_kind_text(k)
    if k.get("section") == "tiles":
        return tiles_kind_text(k)
    return serving_kind_text(k)  # knows the serving sections' kinds too


def _print_first_calls(res, say):
    rows = {}
    for c in res["checks"]:
        key = (_kind_text(c["kind"]), c["method"])
        r = rows.setdefault(key, {})
        if "first_fwd_ms" in c and "fwd" not in r:
            r["fwd"] = c["first_fwd_ms"]
        if "first_bwd_ms" in c:
            r["bwd"] = c["first_bwd_ms"]
    rows = {k: r for k, r in rows.items() if r}
    if not rows:
        return
    say()
    say("## First call of each configuration (at the check shape; includes the kernel "
        "compile unless a disk cache held it" + ("" if res["config"].get("cold_cache")
                                                 else ": --cold-cache to force") + ")")
    say()
    say("| kind | method | first forward ms | first backward ms |")
    say("|---|---|---:|---:|")
    for (kind, m), r in rows.items():
        say(f"| {kind} | {m} | {sig(r.get('fwd'))} | {sig(r.get('bwd'))} |")
    big = [(c, m) for c in res["cases"] for m, e in c["methods"].items() if e["status"] == "ok"
           and c["section"] in ("grid", "decode")]
    if big:
        c, m = max(big, key=lambda cm: cm[0]["methods"][cm[1]]["first_call_ms"]
                   - cm[0]["methods"][cm[1]]["ms"])
        e = c["methods"][m]
        say(f"largest first-call excess at a timed shape: {m}, {c['section']} {c['dtype']} "
            f"d={c['d']} {c['mode']} Nq={c['Nq']} Nk={c['Nk']}: first call "
            f"{sig(e['first_call_ms'])} ms vs median {sig(e['ms'])} ms (every case's first call "
            "is in the JSON)")


def _print_host_time(res, say):
    if not res["host_time"]:
        return
    s = res["host_time"][0]["shape"]
    say()
    say(f"## Host time per call (B{s['B']} H{s['H']} N{s['Nq']} d{s['d']} "
        f"{res['host_time'][0]['dtype']}, {res['host_time'][0]['calls']} calls after warm-up, "
        "no synchronisation, time.perf_counter)")
    say()
    say("| method | mode | µs per call |")
    say("|---|---|---:|")
    for e in res["host_time"]:
        val = sig(e["us_per_call"]) if e["status"] == "ok" else f"n/a ({e['reason']})"
        say(f"| {e['method']} | {e['mode']} | {val} |")


def _print_checks(res, say):
    say()
    say("## Correctness checks (against float64 NumPy on the host; the rule is in "
        "bench/cuflash_bench/gpu_check.py)")
    say()
    say("| kind | grads | shape B,H,Hk,Nq,Nk | method | result | worst output: rel err "
        "(max err / bound) |")
    say("|---|---|---|---|---|---|")
    for c in res["checks"]:
        s = c["shape"]
        shape = c.get("shape_text") or f"{s['B']},{s['H']},{s['Hk']},{s['Nq']},{s['Nk']}"
        worst = ""
        if c.get("errors"):
            name, e = max(c["errors"].items(),
                          key=lambda kv: kv[1].get("max_abs_err", 0) / max(kv[1].get("bound", 1),
                                                                            1e-300))
            if "max_abs_err" in e:
                worst = (f"{name}: {sig(e['rel_err'], 2)} ({sig(e['max_abs_err'], 2)} / "
                         f"{sig(e['bound'], 2)})")
        result = c["status"] if c["status"] != "n/a" else "n/a (see footnotes)"
        say(f"| {_kind_text(c['kind'])} | {'yes' if c['kind']['grad'] else 'no'} | "
            f"{shape} | {c['method']} | {result} | "
            f"{worst} |")


def write_json(res, path):
    """Write ``res`` as JSON; returns the absolute path."""
    path = os.path.abspath(path)
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return path


def save_plot(res, path):
    """PNG of TFLOP/s against N: one panel per dtype/d/causal (rows) and mode (columns), one
    line per method.  Returns (absolute path, "") or (None, why)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, ("matplotlib not installed (pip install \".[bench]\" from a checkout, or "
                      "pip install matplotlib)")
    grid = [c for c in res["cases"] if c["section"] == "grid"]
    if not grid:
        return None, "no grid case was run"
    rows = list(dict.fromkeys((c["dtype"], c["d"], c["causal"]) for c in grid))
    cols = list(dict.fromkeys(c["mode"] for c in grid))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.6 * len(cols), 3.4 * len(rows) + 0.8),
                             squeeze=False)
    for i, (dtype, d, causal) in enumerate(rows):
        for j, mode in enumerate(cols):
            ax = axes[i][j]
            cs = sorted((c for c in grid if (c["dtype"], c["d"], c["causal"], c["mode"])
                         == (dtype, d, causal, mode)), key=lambda c: c["Nq"])
            for k, m in enumerate(res["methods"]):
                pts = [(c["Nq"], c["methods"][m]["tflops"]) for c in cs
                       if c["methods"][m]["status"] == "ok"]
                if pts:  # one colour per method in every panel
                    ax.plot(*zip(*pts), marker="o", label=m, color=f"C{k}")
            ax.set_xscale("log", base=2)
            ns = sorted({c["Nq"] for c in cs})
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.minorticks_off()
            ax.set_title(f"{dtype} d={d} {'causal' if causal else 'non-causal'} {mode}",
                         fontsize="medium")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="x-small")
    cfg = res["config"]
    fig.suptitle(f"cuflash vs SDPA, {res['device']['name']} ({cfg['backend']} backend): "
                 f"tokens (batch x N) = {cfg['tokens']}, hidden (heads x d) = {cfg['hidden']}",
                 fontsize="medium")
    fig.tight_layout()
    path = os.path.abspath(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, ""

"""The GPU check in one call: what a lent GPU must run, within one device call of 10 minutes.

Run from the repository root of a checkout on the GPU machine (it installs nothing)::

    python bench/device_check.py --out "$OUT"          # the whole check, ~6 min on an H100
    python bench/device_check.py --backend emulator    # the same stages on a CPU, tiny sizes
    python bench/device_check.py --status OUT/device_check.json --readme README.md

Stages, each a subprocess with its own time limit inside one overall budget (``--budget-s``,
default 540 s), its output kept in ``<stage>.log``:

* ``env``: the GPU (nvidia-smi), CuPy, NVRTC, PyTorch versions, the commit;
* ``tests``: ``pytest -m cuda`` -- every CUDA test with pytest-xdist (-n 8), else the
  representative subset :data:`SUBSET` (one test of every kernel family);
* ``racecheck``: compute-sanitizer's racecheck on a float16 and a float32 forward + backward;
* ``bench``: ``python -m cuflash bench --gpu`` with ``CUFLASH_WGMMA=0`` (the mma.sync kernels,
  also on an sm_90) -- FlashAttention-2's grid against SDPA's flash, cuDNN and efficient
  kernels (forward and forward + backward, d = 64 and 128, float16, bfloat16, float32), a
  decode shape and the host time per call;
* ``ncu``: Nsight Compute on flash_fwd_tc and flash_bwd_tc (float16, d = 64 and 128;
  ``CUFLASH_WGMMA=0``);
* ``hopper`` (an sm_90 only; run right after the tests): the benchmark's grid at d = 64, 128,
  192 and 256, float16, with ``CUFLASH_WGMMA=1`` -- flash_fwd_wgmma and flash_bwd_wgmma against
  SDPA's kernels, beside the ``bench`` stage's mma.sync rows (d = 64 and 128; at 192 and 256
  SDPA's alone) -- and Nsight Compute on the two kernels (d = 128; :data:`HOPPER_NCU_SECTIONS`:
  with the memory workload, the schedulers' and the warp states' sections, whose stall rules'
  texts stay in hopper_ncu.log); a head dim where they are slower than the mma.sync
  kernels leaves sm_90's default (``cuflash.kernels.WGMMA_DEFAULT_DIMS``, every head dim they take); then, in the time left, the forward's tiles of 176
  and 192 keys at d = 128 against the default 128 (the benchmark's tiles section,
  hopper_tiles.md);
* optional (``--stages ...,features,tiles``): the benchmark's logit-feature section and its
  tile sweep (every block_q x block_kv the kernels accept, against the default).

Everything lands in three files, rewritten after every stage (the device tool brings back at
most 8 files from ``$OUT``, so a run killed mid-way still returns what it finished):
``OUT/device_check.json``; a report, ``OUT/device_check.md``, which quotes the message and the
end of the traceback of each failed test (the first 20), and the end of the logs of every stage
that did not pass;
and ``OUT/logs.tar.gz``, every stage's log, helper script and JSON (``tests.log``,
``racecheck.log``, ``ncu_d64.log``, ``bench.json``, ...; each cut to its last 4 MiB).  Those
files are moved into the archive after each stage; files in OUT from before the run that it
does not rewrite are left alone.  ``--status`` rewrites the README's status box (between
``<!-- status:begin -->`` and ``<!-- status:end -->``) from such a JSON.  With
``--backend emulator`` every stage runs on the CPU with tiny shapes (tests: a few emulator
tests; racecheck and ncu: the profiled programs run on the emulator without the tools) -- the
rehearsal CI runs.
"""
import argparse
import csv
import datetime
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# one CUDA test of every kernel family (by test function), for a GPU machine without xdist
SUBSET = [
    "test_forward_against_oracle",               # flash_fwd_tc, flash_fwd_tf32, flash_fwd (SIMT)
    "test_tc_forward_one_kv_stage_on_gpu",       # flash_fwd_tc as an A100 plans d = 128 (one K/V buffer)
    "test_tc_backward_against_oracle",           # flash_bwd_tc
    "test_tc_one_do_buffer_on_gpu",              # flash_bwd_tc as an A100 plans it (one dO buffer)
    "test_backward_against_oracle",              # flash_bwd_dkdv / dq (SIMT), flash_bwd_tf32
    "test_tensor_core_forward_with_features",    # flash_fwd_tc_masked, flash_fwd_tf32_masked
    "test_tensor_core_backward_with_features",   # flash_bwd_tc_masked
    "test_tensor_core_backward_band_only",       # flash_bwd_tc_band (a window alone)
    "test_tensor_core_backward_lean",            # flash_bwd_tc_softcap, _alibi, _dropout, _alibi_dropout, _alibi_softcap
    "test_tf32_backward_with_features",          # flash_bwd_tf32_masked
    "test_split_kv_matches_oracle",              # split-KV serving kernels and the combine
    "test_kvcache_matches_oracle",               # KV cache (contiguous, paged, append)
    "test_varlen_forward_backward",              # varlen batches
    "test_online_softmax_kernel",                # online_softmax_rows
    "test_cuda_zero_copy_on_torch_stream",       # cuflash.torch on a CUDA stream
]
# the rehearsal's tests: quick emulator tests, enough to show the stage's plumbing works
REHEARSAL_TESTS = ["tests/api/test_errors.py", "-k", "emulator and (non_finite_scale or fewer_than)"]

STAGE_CAPS = {"env": 30, "tests": 240, "hopper": 150, "racecheck": 90, "bench": 240, "ncu": 150,
              "features": 400, "tiles": 400}

RACE_CALL = """
import sys
import numpy as np, cuflash
backend = sys.argv[1]
xp = np
if backend == "cuda":
    import cupy as xp
rng = np.random.default_rng(0)
n = 200 if backend == "cuda" else 40  # rows that end mid-tile; small on the emulator
for dtype, d in (("float16", 64), ("float32", 64)):
    q, k, v, do = (xp.asarray(rng.standard_normal((1, 2, n, d)).astype(dtype)) for _ in range(4))
    o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True, backend=backend)
    cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True, backend=backend)
if backend == "cuda":
    xp.cuda.Device().synchronize()
print("race call ok")
"""

NCU_CALL = """
import sys
import numpy as np, cuflash
backend, d, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
xp = np
if backend == "cuda":
    import cupy as xp
rng = np.random.default_rng(0)
shape = (2, max(1, 2048 // d), n, d) if backend == "cuda" else (1, 1, n, d)
q, k, v, do = (xp.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in range(4))
for _ in range(2):  # the second pair is the profiled one (compile and first use outside)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend=backend)
    cuflash.tiled_attention_backward(do, q, k, v, o, lse, backend=backend)
if backend == "cuda":
    xp.cuda.Device().synchronize()
print("ncu call ok")
"""

# what the run leaves in OUT; every other file a stage writes goes into the archive
FINAL = ("device_check.json", "device_check.md", "logs.tar.gz")
LOG_CAP = 4 << 20        # bytes kept of one file in the archive (its end)
ARCHIVE_CAP = 15 << 20   # the device tool returns files of up to 16 MiB
# per failed test: at most this many lines and characters of its traceback's end
FAILURES_KEPT, TB_LINES, TB_CHARS = 20, 60, 4000

# the Nsight Compute metrics the summary keeps (section "details" page, CSV)
NCU_METRICS = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Registers Per Thread",
               "Achieved Occupancy", "Theoretical Occupancy", "Dynamic Shared Memory Per Block",
               "Executed Ipc Active", "Issue Slots Busy",
               # the Hopper kernels' extra sections (stage_hopper): where the memory time goes and
               # why warps do not issue
               "L1/TEX Cache Throughput", "L2 Cache Throughput", "Mem Busy", "Max Bandwidth",
               "Warp Cycles Per Issued Instruction", "No Eligible", "Eligible Warps Per Scheduler")
# ... and the sections that give them, with the stall and memory rules' texts in the log
HOPPER_NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis",
                       "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats")


def _run(cmd, log, timeout, env=None):
    """Run cmd with output to log; (returncode or 'timeout', seconds)."""
    t0 = time.time()
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                               env=env)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, round(time.time() - t0, 1)


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


# The bench and ncu stages time the mma.sync kernels (flash_fwd_tc, flash_bwd_tc): on an sm_90
# the Hopper kernels are the default at some head dims, and the hopper stage times those.
MMA_SYNC_ENV = {"CUFLASH_WGMMA": "0"}


def _status(rc):
    return "ok" if rc == 0 else ("timeout" if rc == "timeout" else f"failed (exit {rc})")


def stage_env(ctx, timeout):
    out = {"commit": _git("rev-parse", "--short", "HEAD"), "python": sys.version.split()[0],
           "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if ctx.backend == "cuda" and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=timeout)
        out["gpu"] = r.stdout.strip().splitlines()[0] if r.stdout.strip() else r.stderr.strip()
    else:
        out["gpu"] = "none (emulator rehearsal)" if ctx.backend == "emulator" else "nvidia-smi not found"
    code = ("import json, numpy\nv = {'numpy': numpy.__version__}\n"
            "for m in ('cupy', 'torch'):\n    try:\n        v[m] = __import__(m).__version__\n"
            "    except Exception as e:\n        v[m] = 'absent'\n"
            "from cuflash import _nvrtc\ntry:\n    v['nvrtc'] = '.'.join(map(str, _nvrtc.version()))\n"
            "except Exception:\n    v['nvrtc'] = 'absent'\nprint(json.dumps(v))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env=_env())
    out["versions"] = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}
    out["status"] = "ok"
    return out


def _git(*args):
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def parse_pytest(text):
    """Counts of the summary line ('3 failed, 590 passed, 11 skipped in 50.2s') and the FAILED ids."""
    counts = {}
    for line in reversed(text.strip().splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line)
        if found and re.search(r" in [\d.]+s", line):
            counts = {("error" if k.startswith("error") else k): int(n) for n, k in found}
            break
    failed = [ln.split()[1] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    return counts, failed


_HEADER = re.compile(r"^_{3,} (.+?) _{3,}$")
_SECTION = re.compile(r"^={3,} (.+?) ={3,}$")
_CAPTURED = re.compile(r"^-{3,} Captured .+ -{3,}$")


def _tail(text, lines, chars):
    kept = text.rstrip("\n").splitlines()[-lines:]
    out = "\n".join(kept)
    return out[-chars:] if len(out) > chars else out


def parse_failures(text, limit=FAILURES_KEPT):
    """{id: {"message", "traceback"}} of the first `limit` FAILED/ERROR lines of the short summary
    (``-rfE``), the traceback being the end of the test's ``____ name ____`` block.

    The blocks are named by the test's name without its file (``test_x[a]``, ``TestK.test_y``,
    ``ERROR at setup of test_z``) and come in any order under pytest-xdist, whose workers also
    prefix a ``[gw3] linux -- Python ...`` line; a name shared by tests of two files goes to the id
    whose file the block's traceback names first."""
    summary = []
    for ln in text.splitlines():
        parts = ln.split(None, 2)
        if parts[:1] in (["FAILED"], ["ERROR"]) and len(parts) > 1:
            rest = parts[2] if len(parts) > 2 else ""
            summary.append((parts[1], rest[2:] if rest.startswith("- ") else rest))
    blocks, title, body, in_reports = [], None, [], False
    for ln in text.splitlines() + ["=== end ==="]:
        sec, head = _SECTION.match(ln), _HEADER.match(ln)
        if (sec or head) and title is not None:
            blocks.append((title, body))
            title, body = None, []
        if sec:
            in_reports = sec.group(1) in ("FAILURES", "ERRORS")
        elif head and in_reports:
            title = head.group(1)
        elif title is not None and not re.match(r"^\[gw\d+\] ", ln):
            body.append(ln)
    tracebacks = {}
    for title, body in blocks:
        name = re.sub(r"^ERROR (at (setup|teardown) of|collecting) ", "", title)
        ids = [t for t, _ in summary if name in (t, t.split("::", 1)[-1].replace("::", "."))]
        if not ids:
            continue
        text_of = "\n".join(body)
        free = [t for t in ids if t not in tracebacks] or ids
        # the test's own file is the first the block names (a helper's file may follow)
        where = {t: text_of.find(t.split("::")[0]) for t in free}
        tid = min(free, key=lambda t: (where[t] if where[t] >= 0 else len(text_of), free.index(t)))
        cut = next((i for i, ln in enumerate(body) if _CAPTURED.match(ln)), len(body))
        tb = _tail("\n".join(body[:cut]), TB_LINES, TB_CHARS)
        if cut < len(body):
            tb += (f"\n[{len(body) - cut} lines of captured output follow in tests.log; their end:]\n"
                   + _tail("\n".join(body[cut:]), 10, 1000))
        tracebacks[tid] = (tracebacks[tid] + "\n\n" + tb) if tid in tracebacks else tb
    out = {}
    for tid, message in summary:
        if tid in out:  # a test that failed and errored (at teardown): both messages
            out[tid]["message"] += "; " + message
        elif len(out) < limit:
            out[tid] = {"message": message, "traceback": tracebacks.get(tid, "")}
    return out


def stage_tests(ctx, timeout):
    log = ctx.out / "tests.log"
    # short tracebacks keep each failure's block small enough to quote whole
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    if ctx.backend == "emulator":
        cmd += REHEARSAL_TESTS
        how = "rehearsal: " + " ".join(REHEARSAL_TESTS)
    elif _importable("xdist"):
        cmd += ["-m", "cuda", "-n", "8"]
        how = "every CUDA test (pytest -m cuda -n 8)"
    else:
        cmd += ["-m", "cuda", "-k", " or ".join(SUBSET)]
        how = "the representative subset (no pytest-xdist here)"
    # pytest cuts the summary lines' messages to the terminal's width: 80 columns in a file
    rc, secs = _run(cmd, log, timeout, _env(COLUMNS="200"))
    text = log.read_text(errors="replace")
    counts, failed = parse_pytest(text)
    return {"status": _status(rc) if rc != 1 else "tests failed", "seconds": secs, "selection": how,
            "counts": counts, "failed": failed[:50], "failures": parse_failures(text)}


def _importable(name):
    r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True)
    return r.returncode == 0


def stage_racecheck(ctx, timeout):
    script = ctx.out / "race_call.py"
    script.write_text(RACE_CALL)
    log = ctx.out / "racecheck.log"
    if ctx.backend == "cuda":
        tool = shutil.which("compute-sanitizer")
        if tool is None:
            return {"status": "skipped: compute-sanitizer not found"}
        cmd = [tool, "--tool", "racecheck", "--error-exitcode", "3", sys.executable, str(script), "cuda"]
    else:
        cmd = [sys.executable, str(script), "emulator"]
    rc, secs = _run(cmd, log, timeout, _env())
    text = log.read_text(errors="replace")
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    out = {"status": _status(rc), "seconds": secs, "call_ok": "race call ok" in text}
    if m:
        out.update(hazards=int(m.group(1)), errors=int(m.group(2)), warnings=int(m.group(3)))
    elif ctx.backend == "emulator":
        out["note"] = "the call ran on the emulator; racecheck needs a GPU (the test suite races the emulator)"
    return out


def bench_command(ctx, json_path):
    cmd = [sys.executable, "-m", "cuflash", "bench", "--gpu", "--sections", "grid,decode,host",
           "--plot", "", "--json", str(json_path)]
    if ctx.backend == "emulator":
        return cmd + ["--backend", "emulator", "--dtypes", "float16,float32", "--dims", "16",
                      "--seqlens", "32", "--causal", "no", "--modes", "fwd,fwdbwd",
                      "--decode-nk", "32"]
    dtypes = "float16,bfloat16,float32" if _importable("ml_dtypes") else "float16,float32"
    # 20 ms repeats: at the default 50 ms the 48 grid cases took past 240 s on an H200
    return cmd + ["--dtypes", dtypes, "--dims", "64,128", "--seqlens", "4096,16384",
                  "--causal", "both", "--modes", "fwd,fwdbwd", "--decode-nk", "8192",
                  "--target-ms", "20"]


def summarize_bench(res):
    """Rows of the grid (cuflash, FA2, cuDNN, efficient TFLOP/s and time ratios), the decode rows
    and the host time, from the benchmark's JSON."""
    def tf(m):
        return float(f"{m['tflops']:.4g}") if m and m.get("tflops") else None

    rows = []
    for c in res.get("cases", []):
        ms = c["methods"]
        mine = ms.get("cuflash tiled", {})
        row = {"section": c["section"], "dtype": c["dtype"], "d": c["d"], "causal": c["causal"],
               "mode": c["mode"], "Nq": c["Nq"], "Nk": c["Nk"], "B": c["B"], "H": c["H"],
               "cuflash": tf(mine), "cuflash_ms": mine.get("ms"),
               "sdpa_flash": tf(ms.get("sdpa flash")), "sdpa_cudnn": tf(ms.get("sdpa cudnn")),
               "sdpa_efficient": tf(ms.get("sdpa efficient"))}
        for other in ("sdpa flash", "sdpa cudnn", "sdpa efficient"):
            o = ms.get(other, {})
            if mine.get("ms") and o.get("ms"):
                row["time_vs_" + other.split()[1]] = round(mine["ms"] / o["ms"], 3)
        rows.append(row)
    return {"rows": rows, "host_time": res.get("host_time", []), "device": res.get("device", {}),
            "checks_failed": [c for c in res.get("checks", []) if c.get("status") not in ("passed", "n/a")]}


def stage_bench(ctx, timeout):
    jp = ctx.out / "bench.json"
    rc, secs = _run(bench_command(ctx, jp), ctx.out / "bench.log", timeout, _env(**MMA_SYNC_ENV))
    out = {"status": _status(rc), "seconds": secs}
    if jp.exists():
        out.update(summarize_bench(json.loads(jp.read_text())))
    return out


def parse_ncu_csv(text):
    """{kernel: {metric: value}} for NCU_METRICS from ``ncu --csv --page details`` output."""
    start = text.find('"ID"')
    if start < 0:
        return {}
    out = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        name, metric = row.get("Kernel Name", ""), row.get("Metric Name", "")
        if metric in NCU_METRICS:
            kernel = name.split("(")[0].strip()
            unit = row.get("Metric Unit", "")
            out.setdefault(kernel, {})[metric] = (row.get("Metric Value", "") + (" " + unit if unit else "")).strip()
    return out


def stage_ncu(ctx, timeout):
    script = ctx.out / "ncu_call.py"
    script.write_text(NCU_CALL)
    out = {"kernels": {}}
    tool = shutil.which("ncu") if ctx.backend == "cuda" else None
    t0 = time.time()
    for d in (64, 128):
        left = timeout - (time.time() - t0)
        log = ctx.out / f"ncu_d{d}.log"
        if tool:
            cmd = [tool, "--csv", "--page", "details", "--kernel-name", "regex:flash_(fwd|bwd)_tc$",
                   "--launch-skip", "2", "--launch-count", "2", "--section", "SpeedOfLight",
                   "--section", "Occupancy", "--section", "LaunchStats", "--section",
                   "ComputeWorkloadAnalysis", sys.executable, str(script), "cuda", str(d), "4096"]
        else:
            cmd = [sys.executable, str(script), ctx.backend, str(d), "32" if ctx.backend == "emulator" else "4096"]
        rc, _ = _run(cmd, log, max(5, left), _env(**MMA_SYNC_ENV))
        out[f"d{d}"] = _status(rc)
        for k, v in parse_ncu_csv(log.read_text(errors="replace")).items():
            out["kernels"][f"{k} d={d}"] = v
    out["seconds"] = round(time.time() - t0, 1)
    bad = [v for k, v in out.items() if k.startswith("d") and v != "ok"]
    out["status"] = "ok" if not bad else bad[0]
    if not tool:
        out["note"] = ("ncu not found: the profiled program ran without it" if ctx.backend == "cuda"
                       else "the profiled program ran on the emulator; Nsight Compute needs a GPU")
    return out


def _compute_capability(ctx):
    """The device's compute capability ("90"), or the emulated one (the Hopper rehearsal: "90")."""
    if ctx.backend == "emulator":
        return "90"
    r = subprocess.run([sys.executable, "-c", "import cupy; print(cupy.cuda.Device().compute_capability)"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    return r.stdout.strip() or "?"


def stage_hopper(ctx, timeout):
    """The Hopper kernels (CUFLASH_WGMMA=1) on an sm_90: the benchmark's grid at d = 64, 128, 192
    and 256 (beside the bench stage's mma.sync rows: what decides where they are sm_90's default,
    cuflash.kernels.WGMMA_DEFAULT_DIMS) and Nsight Compute on flash_fwd_wgmma and
    flash_bwd_wgmma; skipped on other GPUs."""
    cc = _compute_capability(ctx)
    if cc != "90":
        return {"status": "ok", "note": f"skipped: the device is sm_{cc}, the Hopper kernels are sm_90a's"}
    env = _env(CUFLASH_WGMMA="1")
    if ctx.backend == "emulator":
        env["CUFLASH_EMULATOR_ARCH"] = "sm_90"
    t0 = time.time()
    jp = ctx.out / "hopper.json"
    cmd = [sys.executable, "-m", "cuflash", "bench", "--gpu", "--sections", "grid", "--plot", "",
           "--json", str(jp), "--dtypes", "float16", "--modes", "fwd,fwdbwd"]
    cmd += (["--backend", "emulator", "--dims", "64", "--seqlens", "64", "--causal", "no", "--hidden", "64",
             "--tokens", "64"]
            if ctx.backend == "emulator" else
            ["--dims", "64,128,192,256", "--seqlens", "4096,16384", "--causal", "both", "--target-ms", "20"])
    rc, _ = _run(cmd, ctx.out / "hopper.log", max(5, timeout * 0.7), env)
    out = {"status": _status(rc)}
    if jp.exists():
        out.update(summarize_bench(json.loads(jp.read_text())))
    script = ctx.out / "ncu_call.py"
    script.write_text(NCU_CALL)
    tool = shutil.which("ncu") if ctx.backend == "cuda" else None
    log = ctx.out / "hopper_ncu.log"
    n = "4096" if ctx.backend == "cuda" else "64"
    call = [sys.executable, str(script), ctx.backend, "128" if ctx.backend == "cuda" else "64", n]
    cmd = ([tool, "--csv", "--page", "details", "--kernel-name", "regex:flash_(fwd|bwd)_wgmma$",
            "--launch-skip", "2", "--launch-count", "2"]
           + [a for sec in HOPPER_NCU_SECTIONS for a in ("--section", sec)] + call
           if tool else call)
    rc2, _ = _run(cmd, log, max(5, timeout - (time.time() - t0)), env)
    out["kernels"] = {f"{k} d=128": v for k, v in parse_ncu_csv(log.read_text(errors="replace")).items()}
    if out["status"] == "ok" and rc2 != 0:
        out["status"] = f"ncu: {_status(rc2)}"
    # the forward's untimed alternatives at d = 128: 176 and 192 keys per tile against the default 128
    # (the tiles section: the default call and that pair, checked and timed; hopper_tiles.md)
    left = timeout - (time.time() - t0)
    if left > 20:
        small = ["--hidden", "128", "--tokens", "64"] if ctx.backend == "emulator" else []
        out["tiles"] = _bench_section(ctx, left - 5, "hopper_tiles", [
            "--sections", "tiles", "--dtypes", "float16", "--dims", "128", "--causal", "no", "--modes", "fwd",
            "--tiles-pairs", "128x176,128x192"] + small, env)
        if out["status"] == "ok" and out["tiles"]["status"] != "ok":
            out["status"] = f"tiles: {out['tiles']['status']}"
    else:
        out["tiles"] = {"status": f"skipped: {left:.0f} s left in the stage"}
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _bench_section(ctx, timeout, name, extra, env=None):
    """An optional benchmark section, run as the harness runs it (its table in <name>.md of the
    archive)."""
    jp = ctx.out / f"{name}.json"
    cmd = [sys.executable, "-m", "cuflash", "bench", "--gpu", "--plot", "", "--json", str(jp)] + extra
    if ctx.backend == "emulator":
        cmd += ["--backend", "emulator"]
    rc, secs = _run(cmd, ctx.out / f"{name}.md", timeout, env or _env())
    return {"status": _status(rc), "seconds": secs, "json": jp.name if jp.exists() else None}


def stage_features(ctx, timeout):
    """Each logit feature against the plain call, and the window widths (float16, float32)."""
    dims = "64,128" if ctx.backend == "cuda" else "16"
    return _bench_section(ctx, timeout, "features", ["--sections", "features", "--dtypes",
                          "float16,float32", "--dims", dims, "--modes", "fwd,fwdbwd"])


def stage_tiles(ctx, timeout):
    """Every block_q x block_kv the forward's and backward's kernels accept, against the default."""
    dims = "64,128" if ctx.backend == "cuda" else "16"
    return _bench_section(ctx, timeout, "tiles", ["--sections", "tiles", "--dtypes", "float16,float32",
                          "--dims", dims, "--causal", "no", "--modes", "fwd,bwd"])


STAGES = {"env": stage_env, "tests": stage_tests, "hopper": stage_hopper, "racecheck": stage_racecheck,
          "bench": stage_bench, "ncu": stage_ncu, "features": stage_features, "tiles": stage_tiles}
DEFAULT_STAGES = ("env", "tests", "hopper", "racecheck", "bench", "ncu")


def render_markdown(res):
    """The check as a Markdown report."""
    env = res["stages"].get("env", {})
    lines = [f"# Device check: {env.get('gpu', '?')}, {env.get('when', '?')}, commit {env.get('commit', '?')}",
             "", f"Command: `{res['command']}`; versions: {json.dumps(env.get('versions', {}))}", "",
             "| stage | status | seconds |", "|---|---|---:|"]
    for name, st in res["stages"].items():
        lines.append(f"| {name} | {st.get('status', '?')} | {st.get('seconds', '')} |")
    t = res["stages"].get("tests")
    if t:
        lines += ["", f"**Tests** ({t.get('selection', '')}): {_counts(t.get('counts', {}))}"]
        lines += [f"- FAILED {f}" for f in t.get("failed", [])]
        for tid, f in t.get("failures", {}).items():
            lines += ["", f"`{tid}`: {f['message']}"] + _fenced(f["traceback"])
        more = len(set(t.get("failed", []))) - len(t.get("failures", {}))
        if t.get("failures") and more > 0:
            lines += ["", f"({more} more failures: tests.log in logs.tar.gz)"]
    r = res["stages"].get("racecheck")
    if r:
        lines += ["", "**Racecheck**: " + (f"{r['hazards']} hazards, {r['errors']} errors"
                                            if "hazards" in r else r.get("note", r.get("status", "")))]
    h = res["stages"].get("hopper")
    if h and h.get("note"):
        lines += ["", "**Hopper kernels**: " + h["note"]]
    if h and h.get("tiles"):
        lines += ["", f"**Hopper forward tiles** (d = 128, 128 x 176 and 128 x 192 against the default): "
                      f"{h['tiles']['status']}; the table is hopper_tiles.md in logs.tar.gz"]
    for title, b in (("Benchmark, the Hopper kernels (CUFLASH_WGMMA=1)", h),
                     ("Benchmark, the mma.sync kernels (CUFLASH_WGMMA=0)", res["stages"].get("bench"))):
        lines += _bench_table(title, b)
    n = res["stages"].get("ncu")
    for title, n in (("Nsight Compute", n), ("Nsight Compute, the Hopper kernels", h)):
        if n and n.get("kernels"):
            metrics = [m for m in NCU_METRICS if any(m in v for v in n["kernels"].values())]
            lines += ["", f"**{title}**", "", "| kernel | " + " | ".join(metrics) + " |",
                      "|---|" + "---|" * len(metrics)]
            for k, v in n["kernels"].items():
                lines.append(f"| {k} | " + " | ".join(v.get(m, "") for m in metrics) + " |")
        elif n and title == "Nsight Compute":
            lines += ["", "**Nsight Compute**: " + n.get("note", n.get("status", ""))]
    for name, st in res["stages"].items():
        for log, tail in st.get("log_tails", {}).items():
            lines += ["", f"**{name}: the end of {log}** ({st.get('status')})"] + _fenced(tail)
    logs = res.get("logs")
    if logs:
        lines += ["", f"Logs: {logs['archive']} ({', '.join(logs['files'])})"]
    return "\n".join(lines) + "\n"


def _fenced(text):
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return ["", fence, text or "(no traceback in the log)", fence]


def _bench_table(title, b):
    lines = []
    if b and b.get("rows"):
        lines += ["", f"**{title}** (TFLOP/s, flash-attn convention; time ratios below 1: cuflash faster)",
                  "", "| section | dtype | d | causal | mode | B x H | N | cuflash | SDPA flash (FA2) | "
                  "SDPA cuDNN | SDPA efficient | time / FA2 | time / cuDNN |",
                  "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for w in b["rows"]:
            n = w["Nq"] if w["Nq"] == w["Nk"] else f"{w['Nq']}x{w['Nk']}"
            lines.append(f"| {w['section']} | {w['dtype']} | {w['d']} | {'yes' if w['causal'] else 'no'} | "
                         f"{w['mode']} | {w['B']} x {w['H']} | {n} | {_f(w['cuflash'])} | "
                         f"{_f(w['sdpa_flash'])} | {_f(w['sdpa_cudnn'])} | {_f(w['sdpa_efficient'])} | "
                         f"{_f(w.get('time_vs_flash'))} | {_f(w.get('time_vs_cudnn'))} |")
        if b.get("host_time"):
            lines += ["", "**Host time per call** (no synchronisation between calls)", "",
                      "| method | mode | dtype | us per call |", "|---|---|---|---:|"]
            lines += [f"| {h.get('method')} | {h.get('mode')} | {h.get('dtype')} | "
                      f"{_f(h.get('us_per_call') and round(h['us_per_call'], 1))} |"
                      for h in b["host_time"]]
    return lines


def _f(x):
    return "n/a" if x is None else f"{x:g}"


def _counts(c):
    return ", ".join(f"{n} {k}" for k, n in c.items()) or "no summary line"


def status_box(res):
    """The README status box (between the markers) from a check's JSON."""
    env = res["stages"].get("env", {})
    t = res["stages"].get("tests", {})
    r = res["stages"].get("racecheck", {})
    rows = res["stages"].get("bench", {}).get("rows", [])
    lines = ["| | |", "|---|---|",
             f"| Last device check | {env.get('gpu', '?')}, {env.get('when', '?')}, commit "
             f"{env.get('commit', '?')} (`python bench/device_check.py`) |",
             f"| CUDA tests | {_counts(t.get('counts', {}))} ({t.get('selection', 'not run')}) |"]
    if "hazards" in r:
        lines.append(f"| Racecheck | {r['hazards']} hazards, {r['errors']} errors |")
    for dtype in ("float16", "bfloat16", "float32"):
        for mode in ("fwd", "fwdbwd"):
            ratios = [w.get("time_vs_flash" if dtype != "float32" else "time_vs_efficient")
                      for w in rows if w["section"] == "grid" and w["dtype"] == dtype and w["mode"] == mode]
            ratios = [x for x in ratios if x is not None]
            if ratios:
                other = "SDPA efficient" if dtype == "float32" else "FlashAttention-2 (SDPA flash)"
                lines.append(f"| {dtype} {'forward' if mode == 'fwd' else 'forward + backward'} | "
                             f"{min(ratios):.2f}-{max(ratios):.2f}x the time of {other} |")
    if env.get("gpu", "").startswith("none"):
        lines.append("| Speed | not measured: an emulator rehearsal (no GPU) |")
    return "\n".join(lines)


BEGIN, END = "<!-- status:begin -->", "<!-- status:end -->"


def rewrite_status(readme_text, res):
    """readme_text with the lines between the status markers replaced by the box of res."""
    i, j = readme_text.find(BEGIN), readme_text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"no {BEGIN} ... {END} block in the README")
    return readme_text[:i + len(BEGIN)] + "\n" + status_box(res) + "\n" + readme_text[j:]


def _stat(p):
    st = p.stat()
    return st.st_mtime_ns, st.st_size


def collect(out, kept, before):
    """Move the files of OUT that the run wrote (new, or changed since `before`) into the folder
    `kept`; their names."""
    moved = []
    for p in sorted(out.iterdir()):
        if (not p.is_file() or p.name in FINAL or p.name.startswith(".")
                or before.get(p.name) == _stat(p)):
            continue
        shutil.move(str(p), str(kept / p.name))
        moved.append(p.name)
    return moved


def _end_of(path, n):
    """The last n bytes of a file, after a line saying how many came before them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - n))
        data = f.read()
    if size <= n:
        return data
    return f"[the first {size - n} bytes cut; the last {n} kept]\n".encode() + data


def write_archive(kept, path):
    """Every file of `kept` into the gzipped tar `path` (flat, in the order written), each cut to
    its last LOG_CAP bytes, and cut further while the archive is past ARCHIVE_CAP;
    {"archive", "files": {name: bytes}, "cut": {name: bytes kept}}."""
    files = sorted(kept.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    cap = LOG_CAP
    while True:
        part = path.with_name("." + path.name + ".part")
        cut = {}
        with tarfile.open(part, "w:gz") as tar:
            for p in files:
                data = _end_of(p, cap)
                info = tarfile.TarInfo(p.name)
                info.size, info.mtime = len(data), int(p.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
                if p.stat().st_size > cap:
                    cut[p.name] = cap
        os.replace(part, path)
        if path.stat().st_size <= ARCHIVE_CAP or cap <= 4096:
            break
        cap //= 4
    out = {"archive": path.name, "files": {p.name: p.stat().st_size for p in files}}
    return dict(out, cut=cut) if cut else out


def run_check(backend, out, budget_s, stages):
    out.mkdir(parents=True, exist_ok=True)
    before = {p.name: _stat(p) for p in out.iterdir() if p.is_file()}
    ctx = argparse.Namespace(backend=backend, out=out)
    deadline = time.time() + budget_s
    res = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "backend": backend,
           "budget_s": budget_s, "stages": {}}
    kept = Path(tempfile.mkdtemp(prefix="device_check_"))
    try:
        for i, name in enumerate(stages):
            later = sum(min(20, STAGE_CAPS[s]) for s in stages[i + 1:])
            timeout = min(STAGE_CAPS[name], max(5, deadline - time.time() - later))
            print(f"== {name} (limit {timeout:.0f} s)", flush=True)
            try:
                st = STAGES[name](ctx, timeout)
            except Exception as e:  # a broken stage must not lose the others' results
                st = {"status": f"error: {type(e).__name__}: {e}"}
            res["stages"][name] = st
            print(f"   {st.get('status')}", flush=True)
            moved = collect(out, kept, before)
            if st.get("status") not in ("ok", "tests failed"):
                st["log_tails"] = {m: _tail(_end_of(kept / m, 8192).decode(errors="replace"), 40, 3000)
                                   for m in moved if m.endswith((".log", ".md"))}
            res["logs"] = write_archive(kept, out / "logs.tar.gz")
            (out / "device_check.json").write_text(json.dumps(res, indent=1))
            (out / "device_check.md").write_text(render_markdown(res))
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench/device_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "emulator"), default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT") or "device_check_out",
                   help="output folder (default: $OUT, else ./device_check_out)")
    p.add_argument("--budget-s", type=float, default=540, help="all stages together (default 540)")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated, of {','.join(STAGES)} (default: "
                   f"{','.join(DEFAULT_STAGES)}; features and tiles are the optional benchmark "
                   "sections, minutes each on a GPU)")
    p.add_argument("--status", metavar="JSON", help="rewrite the README's status box from this JSON")
    p.add_argument("--readme", default=str(ROOT / "README.md"), help="README to rewrite with --status")
    a = p.parse_args(argv)
    if a.status:
        res = json.loads(Path(a.status).read_text())
        path = Path(a.readme)
        path.write_text(rewrite_status(path.read_text(), res))
        print(f"status box of {path} rewritten from {a.status}")
        return 0
    stages = [s for s in a.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; choose from {list(STAGES)}")
    res = run_check(a.backend, Path(a.out), a.budget_s, stages)
    print((Path(a.out) / "device_check.md").read_text())
    failed = [n for n, s in res["stages"].items() if s.get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Race checking: one launch under ThreadSanitizer, in a child process.

ThreadSanitizer has to be loaded when a process starts, so a race-checked
launch cannot run inside the Python process.  The kernel source is built
together with a small ``main`` (``_module._TSAN_MAIN``) into an executable;
the launch's arguments go to it through a file, the arrays come back through
another, and ThreadSanitizer's report (the racing accesses with their source
lines, and the shared array they touch) becomes a :class:`RaceError`.

These builds run a block's CUDA threads as real threads (cuda_host.h picks
that engine where ``__SANITIZE_THREAD__`` is defined), not as the fibers of
ordinary builds: ThreadSanitizer has to see them run concurrently.
"""
import ctypes
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from ._checks import CHECK_ERRORS, LaunchError, RaceError, describe_address, launch_flags

_TIMEOUT_S = 600


def _tsan_env():
    env = dict(os.environ)
    # keep going after the first report, so the error lists every racing pair
    env["TSAN_OPTIONS"] = "halt_on_error=0 exitcode=66 report_signal_unsafe=0 " + env.get("TSAN_OPTIONS", "")
    return env


def _command(exe, inp, out):
    # ThreadSanitizer (GCC 12) cannot map its shadow memory under the high
    # ASLR entropy of recent kernels ("unexpected memory mapping"); running
    # without address randomisation avoids that where setarch is available.
    cmd = [str(exe), str(inp), str(out)]
    setarch = shutil.which("setarch")
    if setarch:
        cmd = [setarch, os.uname().machine, "-R"] + cmd
    return cmd


def summarize(report, limit=6):
    """The lines of a ThreadSanitizer report that say where: accesses and locations."""
    keep = []
    for line in report.splitlines():
        s = line.strip()
        if (s.startswith(("WARNING: ThreadSanitizer", "Write of size", "Read of size", "Previous write",
                          "Previous read", "Location is", "Atomic"))
                or re.match(r"#0 ", s)):
            keep.append(s)
    n = report.count("WARNING: ThreadSanitizer: data race")
    head = f"{n} data race report(s)" if n else "ThreadSanitizer reports"
    return head + ":\n  " + "\n  ".join(keep[:limit * 4])


def _buffers(arrays):
    """Group the arrays' memory into disjoint buffers: ``(buffers, places)``.

    ``buffers`` is a list of (start address, nbytes); ``places[i]`` is
    (buffer index, byte offset) of ``arrays[i]``.  Arrays whose memory
    overlaps (one array passed twice, views of one allocation) share a buffer,
    so the child process sees them alias as the kernel would on a GPU.
    """
    spans = sorted((a.ctypes.data, a.ctypes.data + max(a.nbytes, 1), i) for i, a in enumerate(arrays))
    buffers, places = [], [None] * len(arrays)
    for start, end, i in spans:
        if buffers and start < buffers[-1][1]:
            buffers[-1][1] = max(buffers[-1][1], end)
        else:
            buffers.append([start, end])
        places[i] = (len(buffers) - 1, start)
    places = [(bi, addr - buffers[bi][0]) for bi, addr in places]
    return [(s, e - s) for s, e in buffers], places


def _to_host_addresses(message, child_bases, buffers):
    """Rewrite the child process's addresses in ``message`` as this process's (same buffer, offset)."""
    def host(m):
        addr = int(m.group(1), 16)
        for base, (start, n) in zip(child_bases, buffers):
            if base <= addr < base + max(n, 1):
                return f"0x{start + addr - base:x}"
        return m.group(0)
    return re.sub(r"0x([0-9a-f]+)", host, message)


def run_tsan(kernel, grid, block, shmem, args):
    """Run ``kernel`` once under ThreadSanitizer; copy the arrays back; raise on races."""
    exe = kernel.module._compile_tsan()
    holders, arrays = kernel._convert(args)
    buffers, places = _buffers(arrays)
    with tempfile.TemporaryDirectory(prefix="cuflash_tsan_") as d:
        inp, out = Path(d) / "args.bin", Path(d) / "out.bin"
        with open(inp, "wb") as f:
            f.write(f"{kernel.name} {grid[0]} {grid[1]} {grid[2]} {block[0]} {block[1]} {block[2]} "
                    f"{shmem} {len(holders)} {len(buffers)} {launch_flags() & 9}\n".encode())
            for start, n in buffers:
                f.write(f"{n} {start}\n".encode())
                f.write(ctypes.string_at(start, n))
                f.write(b"\n")
            ai = 0
            for (pname, kind, size, decl), h in zip(kernel.params, holders):
                if kind == "p":
                    bi, off = places[ai]
                    ai += 1
                    f.write(f"a {bi} {off}\n".encode())
                else:
                    data = ctypes.string_at(ctypes.addressof(h), ctypes.sizeof(h))
                    f.write(f"s {len(data)}\n".encode())
                    f.write(data)
                    f.write(b"\n")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(_command(exe, inp, out), capture_output=True, env=_tsan_env(), timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"kernel {kernel.name}: the race-checked launch took longer than {_TIMEOUT_S} s") from None
        dt = time.perf_counter() - t0
        report = r.stderr.decode(errors="replace")
        if not out.exists():
            raise LaunchError(f"kernel {kernel.name}: the ThreadSanitizer run failed (exit {r.returncode}):\n"
                              f"{report[-8000:]}")
        blob = out.read_bytes()
    first, _, rest = blob.partition(b"\n")
    head = [int(v) for v in first.split()]
    rc, rd, wr, child_bases = head[0], head[1], head[2], head[3:]
    err, _, data = rest.partition(b"\n@@\n")
    starts = [0, *itertools.accumulate(n for _, n in buffers)]
    for a, (bi, off) in zip(arrays, places):
        if a.flags.writeable and a.nbytes:
            lo = starts[bi] + off
            a.reshape(-1).view(np.uint8)[:] = np.frombuffer(data[lo:lo + a.nbytes], np.uint8)
    kernel._record(grid, block, shmem, rd, wr, dt)
    if "WARNING: ThreadSanitizer" in report:
        raise RaceError(f"kernel {kernel.name} (grid {grid}, block {block}): ThreadSanitizer found "
                        f"{summarize(report)}", report)
    if rc in CHECK_ERRORS:
        msg = _to_host_addresses(err.decode(errors="replace"), child_bases, buffers)
        raise CHECK_ERRORS[rc](describe_address(msg, kernel.params, arrays))
    if rc != 0:
        raise LaunchError(f"kernel {kernel.name} (grid {grid}, block {block}): {err.decode(errors='replace')}")

"""The emulator's errors, and the inter-block write check whose findings raise one of them.

Kept apart from the module loader (``_module.py``) and the race checker
(``_race.py``), which both raise these errors and read the check's switch, so
that the loader can import the race checker without a circle.
"""
import contextlib
import os
import re
import subprocess

__all__ = ["CompileError", "LaunchError", "RaceError", "InterBlockRaceError", "MemcheckError",
           "AtomicOrderError", "set_interblock_check", "interblock_check", "set_atomic_order_check",
           "atomic_order_check", "set_memcheck", "memcheck", "memcheck_enabled", "CHECK_ERRORS",
           "launch_flags", "describe_address", "describe_memcheck", "profiling", "profile_enabled",
           "resolve_sites"]


class CompileError(RuntimeError):
    """The host compiler rejected the kernel source (message holds its output)."""


class LaunchError(RuntimeError):
    """A kernel failed while running (deadlock, trap, bad collective, ...)."""


class MemcheckError(LaunchError):
    """An emulated launch accessed memory outside its arrays or its shared memory.

    The message names the kernel, the access (global load/store/atomic, cp.async,
    ldmatrix, shared load/store) and its size, the block and thread, the source
    line, and the argument the address is nearest to with the byte and element
    offset from its start (or the offset into the dynamic shared memory).
    """


class RaceError(RuntimeError):
    """ThreadSanitizer found a data race in a ``race_check=True`` launch.

    ``report`` holds ThreadSanitizer's text (the racing accesses with source
    lines, and the shared array involved).
    """

    def __init__(self, message, report=""):
        super().__init__(message)
        self.report = report


class InterBlockRaceError(RaceError):
    """Two blocks of one launch stored to the same global address with plain stores.

    Blocks run one after another in the emulator, so ThreadSanitizer never sees
    this; on a GPU they may run at the same time and the value left is
    undefined.  Raised when the inter-block write check is on
    (:func:`interblock_check`); the message names the kernel, both blocks, the
    address and the kernel argument (and element) it falls in.
    """


class AtomicOrderError(RuntimeError):
    """Two threads of one launch added into the same float with atomics.

    On a GPU such adds arrive in a run-dependent order, so the sum they build
    is not bitwise repeatable (adds of one thread to one address keep its
    program order).  Raised when the atomic order check is on
    (:func:`atomic_order_check`); the message names the kernel, both blocks
    and threads, the address and the kernel argument (and element) it falls in.
    """


# the launch status of a finding of the inter-block write or atomic order check -> its error
CHECK_ERRORS = {2: InterBlockRaceError, 3: AtomicOrderError}


def _switch(env, name, what, set_doc):
    """A launch check that is off unless ``$env`` is set: its flag, setter and context manager."""
    flag = [os.environ.get(env, "0") not in ("", "0")]

    def setter(on):
        old = flag[0]
        flag[0] = bool(on)
        return old

    @contextlib.contextmanager
    def scoped(on=True):
        old = setter(on)
        try:
            yield
        finally:
            setter(old)
    setter.__name__, setter.__qualname__, setter.__doc__ = f"set_{name}", f"set_{name}", set_doc
    scoped.__name__ = scoped.__qualname__ = name
    scoped.__doc__ = f"The {what} on (or off) inside the block (see :func:`set_{name}`)."
    return flag, setter, scoped


_INTERBLOCK, set_interblock_check, interblock_check = _switch(
    "CUFLASH_EMULATOR_INTERBLOCK_CHECK", "interblock_check", "inter-block write check",
    """Turn the inter-block write check on or off for later launches; returns the old setting.

    With it on, every ``gstore`` of a launch is logged (address, size, block)
    and, after the launch, two blocks storing to one byte raise
    :class:`InterBlockRaceError`.  Off by default (``$CUFLASH_EMULATOR_INTERBLOCK_CHECK=1``
    turns it on); the tests turn it on for the whole session.  Cost: one vector
    append per store and a sort of the log per launch.
    """)

_ATOMIC_ORDER, set_atomic_order_check, atomic_order_check = _switch(
    "CUFLASH_EMULATOR_ATOMIC_ORDER_CHECK", "atomic_order_check", "atomic order check",
    """Turn the atomic order check on or off for later launches; returns the old setting.

    With it on, every element of a float atomic add (``gatomic_add``,
    ``gred_add*``) is logged (address, block, thread) and, after the launch, an
    address that received adds from two threads raises
    :class:`AtomicOrderError`: what a launch that promises bitwise-repeatable
    results must pass.  Off by default (``$CUFLASH_EMULATOR_ATOMIC_ORDER_CHECK=1``
    turns it on): the atomic dQ path adds from many blocks by design.
    """)

_MEMCHECK, set_memcheck, memcheck = _switch(
    "CUFLASH_EMULATOR_MEMCHECK", "memcheck", "memory checker",
    """Turn the memory checker on or off for later launches; returns the old setting.

    With it on, every global access through the kernels' accessors (``gload``,
    ``gstore``, ``gatomic_add``, ``gred_add*``, ``__ldg``, the source of
    ``cp.async``) must lie inside one of the arrays passed to the launch, and
    every shared-memory access (plain loads and stores, ``ldmatrix``, the
    destination of ``cp.async``) inside the launch's dynamic shared memory;
    a stray access raises :class:`MemcheckError`.  Off by default
    (``$CUFLASH_EMULATOR_MEMCHECK=1`` turns it on); the tests turn it on for the
    whole session.  Its cost per launch is in docs/emulator.md.
    """)


def memcheck_enabled():
    return _MEMCHECK[0]


_PROFILE = [False, None]  # on?, the list the block's profiles are appended to


@contextlib.contextmanager
def profiling(on=True):
    """Launches inside the block record their accesses for :func:`last_launch_profile`.

    Yields a list that collects the profile of every launch made inside the block (a
    backward pass is several launches).  Costs memory (one record per access of the block
    being run) and time: meant for small shapes (bench/emulator_profile.py), not for the
    test suite.
    """
    old = tuple(_PROFILE)
    launches = []
    _PROFILE[0], _PROFILE[1] = bool(on), launches
    try:
        yield launches
    finally:
        _PROFILE[0], _PROFILE[1] = old


def profile_enabled():
    return _PROFILE[0]


def profile_sink():
    """The list of the innermost profiling() block (profiles are appended to it)."""
    return _PROFILE[1]


# files whose lines say less than their caller's: the emulator's and the accessors' own
_HELPER_FILES = ("cuda_host.h", "engine.cpp", "portable.cuh", "saddr.cuh")


def resolve_sites(lib_path, offsets):
    """{offset: "file:line"} for code offsets of a kernel library: the innermost inlined frame
    outside the emulator's and the accessors' headers, and the line it is inlined at when
    that is in a kernel source too (one addr2line run)."""
    offsets = sorted(set(offsets))
    if not offsets:
        return {}
    try:
        r = subprocess.run(["addr2line", "-e", str(lib_path), "-i", "-a", *[hex(o) for o in offsets]],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out, cur, frames = {}, None, []

    def done():
        if cur is not None:
            good = [f.split(" (discriminator")[0] for f in frames
                    if not f.startswith("??") and not f.split(":")[0].endswith(_HELPER_FILES)]
            pick = (good or frames or ["?"])[0]
            # a helper function of the kernel's own source: name its caller too
            if len(good) > 1 and good[1].split(":")[0].endswith((".cu", ".cuh")):
                pick += f" (inlined at line {good[1].rsplit(':', 1)[1]})"
            out[cur] = pick

    for ln in r.stdout.splitlines():
        if ln.startswith("0x"):
            done()
            cur, frames = int(ln, 16), []
        elif ln.strip():
            frames.append(ln.strip())
    done()
    return out


def launch_flags():
    """The flags word a launch passes to the kernel library (1: log stores for the inter-block
    write check, 8: log atomic adds for the atomic order check)."""
    return (1 if _INTERBLOCK[0] else 0) | (8 if _ATOMIC_ORDER[0] else 0)


def _addr2line(lib_path, offset):
    """file:line of a code offset in a kernel library (its -g1 line tables), or None."""
    try:
        r = subprocess.run(["addr2line", "-e", str(lib_path), "-i", hex(offset)], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("??")]
    return lines[0].split(" (discriminator")[0] if lines else None


def describe_memcheck(message, params, arrays, lib_path):
    """Fill in a memcheck message's placeholders: the argument an address is nearest to, the source line."""
    names = [p[0] for p in params if p[1] == "p"]
    by_param = {i: (p[0], arrays[names.index(p[0])]) for i, p in enumerate(params) if p[1] == "p"}

    def arg(m):
        name, a = by_param[int(m.group(1))]
        off = int(m.group(2))
        where = (f"byte offset {off}, before its start" if off < 0 else
                 f"byte offset {off}, past its end" if off >= a.nbytes else f"byte offset {off}")
        return (f"argument {name!r} (a {a.dtype} array of {a.size} elements, {a.nbytes} bytes): {where}, "
                f"element {off // a.itemsize} (the array has {a.size})")

    message = re.sub(r"@ARG(\d+):(-?\d+)@", arg, message)
    message = re.sub(r"@PC:0x([0-9a-f]+)@",
                     lambda m: _addr2line(lib_path, int(m.group(1), 16)) or f"offset 0x{m.group(1)} of {lib_path}",
                     message)
    return message


def describe_address(message, params, arrays):
    """Append which kernel argument (and element) the race message's address falls in."""
    m = re.search(r"global address 0x([0-9a-f]+)", message)
    if m is None:
        return message
    addr = int(m.group(1), 16)
    names = [p[0] for p in params if p[1] == "p"]
    hits = [(name, a) for name, a in zip(names, arrays)
            if a.ctypes.data <= addr < a.ctypes.data + max(a.nbytes, 1)]
    if not hits:
        return message
    # one array passed as several arguments (a workspace): name them all
    same = [n for n, a in hits if a.ctypes.data == hits[0][1].ctypes.data]
    name, a = hits[0]
    what = " = ".join(repr(n) for n in same)
    return (f"{message}; that is argument {what} (a {a.dtype} array of {a.size} elements), "
            f"element {(addr - a.ctypes.data) // a.itemsize}")

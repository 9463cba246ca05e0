"""The emulator's errors, and the inter-block write check whose findings raise one of them.

Kept apart from the module loader (``_module.py``) and the race checker
(``_race.py``), which both raise these errors and read the check's switch, so
that the loader can import the race checker without a circle.
"""
import contextlib
import os
import re

__all__ = ["CompileError", "LaunchError", "RaceError", "InterBlockRaceError",
           "set_interblock_check", "interblock_check", "launch_flags", "describe_address"]


class CompileError(RuntimeError):
    """The host compiler rejected the kernel source (message holds its output)."""


class LaunchError(RuntimeError):
    """A kernel failed while running (deadlock, trap, bad collective, ...)."""


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


# ---------------------------------------------------------------- inter-block write check
_INTERBLOCK = [os.environ.get("CUFLASH_EMULATOR_INTERBLOCK_CHECK", "0") not in ("", "0")]


def set_interblock_check(on):
    """Turn the inter-block write check on or off for later launches; returns the old setting.

    With it on, every ``gstore`` of a launch is logged (address, size, block)
    and, after the launch, two blocks storing to one byte raise
    :class:`InterBlockRaceError`.  Off by default (``$CUFLASH_EMULATOR_INTERBLOCK_CHECK=1``
    turns it on); the tests turn it on for the whole session.  Cost: one vector
    append per store and a sort of the log per launch.
    """
    old = _INTERBLOCK[0]
    _INTERBLOCK[0] = bool(on)
    return old


@contextlib.contextmanager
def interblock_check(on=True):
    """The inter-block write check on (or off) inside the block (see :func:`set_interblock_check`)."""
    old = set_interblock_check(on)
    try:
        yield
    finally:
        set_interblock_check(old)


def launch_flags():
    """The flags word a launch passes to the kernel library (1: log stores for the check)."""
    return 1 if _INTERBLOCK[0] else 0


def describe_address(message, params, arrays):
    """Append which kernel argument (and element) the race message's address falls in."""
    m = re.search(r"global address 0x([0-9a-f]+)", message)
    if m is None:
        return message
    addr = int(m.group(1), 16)
    names = [p[0] for p in params if p[1] == "p"]
    for name, a in zip(names, arrays):
        base = a.ctypes.data
        if base <= addr < base + max(a.nbytes, 1):
            off = addr - base
            return (f"{message}; that is argument {name!r} (a {a.dtype} array of {a.size} elements), "
                    f"element {off // a.itemsize}")
    return message

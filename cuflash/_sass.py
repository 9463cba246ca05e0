"""The machine code (SASS) of a compiled kernel, read without a GPU.

``cuobjdump -sass`` (the ``nvidia-cuda-cuobjdump`` wheel, with
``nvidia-cuda-nvdisasm``; both in the test extra) disassembles the cubin that
NVRTC produced (:func:`cuflash._nvrtc.compile`).  From it:

* :func:`instructions` -- per kernel, the list of (address, opcode) pairs;
* :func:`main_loop` -- the address range of a kernel's main loop: among the
  loops (a backward branch and its target), the one with the most tensor-core
  instructions (HMMA), or FFMA for a SIMT kernel;
* :func:`mix` -- instruction counts by class (HMMA, LDSM, LDS, STS, LDG, STG,
  LDGSTS, RED/ATOM, BAR, MUFU, FFMA, LDL/STL, SHFL, total) over a range.

These are static counts: an inner loop inside the range is counted once, as
its body appears in the code.  They are what the kernel report prints and
what performance predictions without a GPU are made from.
"""
import collections
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile

__all__ = ["find_cuobjdump", "is_available", "disassemble", "instructions", "main_loop", "mix",
           "CLASSES"]

# instruction classes of the report, in column order: name -> opcodes (before the first '.')
CLASSES = collections.OrderedDict([
    ("HMMA", ("HMMA", "HGMMA")),  # HGMMA: the warpgroup MMA of sm_90a (one per warp per wgmma)
    ("LDSM", ("LDSM",)),
    ("LDS", ("LDS",)),
    ("STS", ("STS",)),
    ("LDG", ("LDG",)),
    ("STG", ("STG",)),
    ("LDGSTS", ("LDGSTS",)),
    ("RED/ATOM", ("RED", "REDG", "ATOM", "ATOMG", "ATOMS")),
    ("BAR", ("BAR",)),
    ("MUFU", ("MUFU",)),
    ("FFMA", ("FFMA",)),
    ("LDL/STL", ("LDL", "STL")),
    ("SHFL", ("SHFL",)),
])

# modifiers may hold lower case: HGMMA.64x128x16.F32's shape
_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([.A-Za-z0-9_]*)\s*([^;]*);")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")


def find_cuobjdump():
    """Path of ``cuobjdump``: $CUFLASH_CUOBJDUMP, the pip wheel, or the PATH; None if absent."""
    env = os.environ.get("CUFLASH_CUOBJDUMP")
    if env:
        return env
    roots = []
    try:
        roots += site.getsitepackages()
    except AttributeError:
        pass
    roots += [p for p in sys.path if p.endswith("site-packages")]
    for root in dict.fromkeys(roots):
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", "bin", "cuobjdump"), recursive=True))
        if hits:
            return hits[-1]
    return shutil.which("cuobjdump")


def is_available():
    """``(True, path)`` when cuobjdump is found, else ``(False, how to get it)``."""
    path = find_cuobjdump()
    if path is None:
        return False, "cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    return True, path


def disassemble(cubin):
    """The ``cuobjdump -sass`` text of a cubin (bytes)."""
    tool = find_cuobjdump()
    if tool is None:
        raise RuntimeError(is_available()[1])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def instructions(sass):
    """``{kernel: [(address, opcode, operands), ...]}`` from cuobjdump text."""
    out, cur = {}, None
    for line in sass.splitlines():
        fm = _FUNC.match(line)
        if fm:
            cur = out.setdefault(fm.group(1), [])
            continue
        m = _LINE.match(line)
        # "@!PT": predicated on never (ptxas pads with "@!PT LDS RZ, [RZ]" around cp.async)
        if m and cur is not None and (m.group(2) or "").strip() != "@!PT":
            cur.append((int(m.group(1), 16), m.group(3), m.group(5).strip()))
    return out


def _loops(instrs):
    """(start, end) address ranges of the loops: a branch to an earlier address."""
    loops = []
    for addr, op, args in instrs:
        if op == "BRA":
            t = re.match(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", args)
            if t and t.group(1) is not None:
                target = int(t.group(1), 16)
                if target < addr:
                    loops.append((target, addr))
    return loops


def main_loop(instrs):
    """The main loop's (start, end) addresses: the loop with the most HMMA (or HGMMA), else FFMA;
    or None.  A "loop" around an EXIT is no loop of the kernel's: ptxas places the retry of an
    mbarrier wait after the kernel's end and branches from there back to the wait."""
    best, best_key = None, (0, 0)
    for lo, hi in _loops(instrs):
        c = collections.Counter(op for a, op, _ in instrs if lo <= a <= hi)
        if c["EXIT"]:
            continue
        key = (c["HMMA"] + c["HGMMA"], c["FFMA"] + c["DFMA"])
        if key > best_key:
            best, best_key = (lo, hi), key
    return best


def mix(instrs, span=None):
    """Counts per class of :data:`CLASSES` (and ``total``) over ``span`` (or the whole kernel)."""
    ops = [op for a, op, _ in instrs if span is None or span[0] <= a <= span[1]]
    c = collections.Counter(ops)
    out = collections.OrderedDict((name, sum(c[o] for o in opcodes))
                                  for name, opcodes in CLASSES.items())
    out["total"] = len(ops)
    return out

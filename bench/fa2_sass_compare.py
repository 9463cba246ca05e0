"""cuflash's main loops beside FlashAttention-2's, in machine code: instructions per 1,000 HMMA.

No GPU is needed.  FlashAttention-2's compiled kernels come from the public
``flash-attn-jax==0.6.2`` wheel (upstream FA2 built with nvcc 12.8: sm_80 cubins and
compute_80 PTX), fetched with ``pip download --no-deps`` into a cache folder and unzipped --
never installed.  ``cuobjdump`` extracts the cubins; the kernels are picked by their
demangled names (``c++filt``):

* forward ``flash::flash_fwd_kernel`` with ``Flash_fwd_kernel_traits<64, 128, 128, 4, ...>``
  (d=64) and ``<128, 128, 64, 4, ...>`` (d=128);
* backward ``flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel`` with
  ``Flash_bwd_kernel_traits<64, 128, 128, 8, 4, 4, 4, ...>`` and ``<128, 64, 128, 8, 2, 4, 2, ...>``
  (what FA2 launches with >= 144 KB of shared memory per block: A100, H100);

all float16, no dropout, non-causal, no local window or ALiBi, even M/N and K, no softcap.
sm_80 is the wheel's cubin; sm_90 is the wheel's compute_80 PTX through ``ptxas -arch=sm_90``
(what the driver's JIT does on an H100), which needs a ``ptxas`` ($CUFLASH_PTXAS, the PATH or
the ``nvidia-cuda-nvcc`` pip wheel, whose ``nvidia/cu13/bin/ptxas`` 13.0.88 gives the same
counts as the toolkit's); without one the sm_90 FA2 rows say so.  The cache holds the wheel,
its shared library and the extracted cubins (about 370 MB); a run takes 20-25 s on two cores.

cuflash's side: ``flash_fwd_tc`` and ``flash_bwd_tc`` at the planner's default tiles for
float16, d=64 and 128, compiled by NVRTC for sm_80 and sm_90 with the options a launch uses
(``bench/plan_sweep.py``'s Job), the forward with ``-DCUFLASH_FWD_INTERIOR_ONLY=1``: only the
path of a steady-state K/V tile (no mask, full tile, no flush), where the lazy rescale's vote
stays and its rescale is compiled out -- the count of a tile where no row's max moves; and the
``fwd-rescale`` rows with ``-DCUFLASH_FWD_COUNT_RESCALE=1`` besides: the rescale of O and l
taken on every tile (a row max that moves on every tile), FA2's forward beside it unchanged
(it rescales on every tile).  The ``bwd-masked`` and ``bwd-masked-softcap`` rows:
``flash_bwd_tc_masked`` (the backward with the logit features, which calls with bias, ALiBi or
dropout run) at its default tiles, compiled from a copy of kernels_cu edited to one call's
interior tile (``feature_counts.bwd_feature_edits``: the call's feature flags as constants,
the band test off): no feature beside FA2's plain backward, and softcap beside FA2's softcap
backward (``Is_softcap``; the wheel holds no ALiBi or dropout backward).  The ``bwd-band``,
``bwd-local``, ``bwd-softcap`` and ``bwd-alibi`` rows: the lean builds as launched, their band
test included, at their default tiles (the plain kernel's) -- ``flash_bwd_tc_band`` (a window
alone) beside FA2's plain backward and beside FA2's backward with a local window
(``Is_local``, launched by FA2 with ``Is_even_MN`` false: the wheel's only local builds),
``flash_bwd_tc_softcap`` (a softcap and at most a window) beside FA2's softcap backward,
``flash_bwd_tc_alibi`` (ALiBi and at most a window) beside FA2's plain backward (the wheel
holds no ALiBi backward: the row shows what ALiBi adds, not a like-for-like ratio).  ``--bwd-tiles`` applies to
them too.  ``--fwd-tiles BQxBKV`` / ``--bwd-tiles BQxBKV`` count the forward / backward at other tiles
(the planner's threads for them).  ``--torch`` adds rows beside PyTorch's bundled FA2
(``bench/fa2_torch.py``: the torch wheel, about 550 MB, unpacked, not installed), the one
public build of FA2's backward with dropout: its plain backward beside cuflash's plain
kernel, and its backward with dropout beside ``flash_bwd_tc_dropout`` (the lean build a call
with dropout and at most a window runs, as launched) and beside ``flash_bwd_tc_masked``'s count
build for a call with dropout alone (what dropout costs where the call also has a bias,
ALiBi or a softcap).  A Philox loop, where rolled, is weighted by its trips: one Philox block
per lane per eight logits, two gathering PRMT per block (:func:`draw_trips`).  ``--source``
adds rows beside FA2 2.8.3 built here from its sdist (``bench/fa2_source.py``), the backward
kernels no public wheel holds (:data:`SOURCE_ROWS`): upstream's dropout backward (PyTorch's
copy counts 14-22% more than upstream's build), ALiBi as FA2 launches it, and ALiBi with
dropout or a softcap beside their lean builds and beside ``flash_bwd_tc_masked``.

Method (one steady-state trip of each kernel's main loop, per warp): the loop with the most
HMMA (cuflash._sass.main_loop; FA2's backward: its loop over Q tiles), and in it (:func:`steady_ops`):

* every instruction once, except cuflash's backward, whose rolled inner loops (S^T and dP^T
  over d, the dQ k loop, the dQ tile loop) count as many times as they run
  (``kernel_report.tc_loop_trips``);
* plus the blocks ptxas put out of line that the loop branches to and that branch back into it
  (FA2's forward: the copy of the next K tile, done on every trip but the last);
* less the longer arm of each if/else (cuflash's backward: its scores with the mask, taken
  only on tiles that cross the causal diagonal or the end of the sequence); an ``if`` without
  ``else`` (copies of the next tile, atomics guarded by a row test) counts as taken;
* ``@!PT`` padding (never executed, but fetched and issued) is not counted, as in
  cuflash._sass; the table's notes give how many per trip.

Normalised per 1,000 HMMA.16816 (an HMMA.1688 counts half); in brackets per logit: the
instructions over the logits one warp covers in one trip (block_q x block_kv / warps).

Usage::

    python bench/fa2_sass_compare.py                       # print the table, write the result
    python bench/fa2_sass_compare.py --no-write --arch 80
    python bench/fa2_sass_compare.py --torch               # and PyTorch's FA2 (dropout)
    python bench/fa2_sass_compare.py --torch --source      # and FA2 built from its source
    python bench/fa2_sass_compare.py --wheel-dir /path/with/the/wheel --cache /tmp/fa2
"""
import argparse
import collections
import datetime
import glob
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cuflash import _nvrtc, _sass  # noqa: E402

WHEEL, WHEEL_VERSION = "flash-attn-jax", "0.6.2"
# the wheel is a CPython 3.11 manylinux build; asking for exactly it keeps the download
# independent of the interpreter that runs this script
WHEEL_PLATFORM = ("--python-version", "311", "--platform", "manylinux_2_28_x86_64",
                  "--only-binary=:all:")
DEFAULT_CACHE = Path.home() / ".cache" / "cuflash" / "fa2_wheels"
RESULT = ROOT / "bench" / "results" / "fa2_sass_compare.md"

# FA2's kernels by demangled name, the nested Flash_kernel_traits<...> dropped (normalise()).
# flash_fwd_kernel<Traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K,
#                  Is_softcap, Return_softmax>
# flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Traits, Is_dropout, Is_causal, Is_local,
#                  Has_alibi, Is_even_MN, Is_even_K, Is_softcap>
# Traits: <d, block_q, block_kv, warps, ...>
_FWD = ("flash::flash_fwd_kernel<Flash_fwd_kernel_traits<{}, false, false, cutlass::half_t>, "
        "false, false, false, false, true, true, false, false>")
_BWD = ("flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<{}, "
        "false, false, cutlass::half_t>, false, false, false, false, true, true, false>")
# the backward with FA2's softcap (Is_softcap): the logit feature both kernels have in this
# wheel (it holds no ALiBi or dropout backward)
_BWD_SOFTCAP = _BWD[:-len("false>")] + "true>"
# the backward with FA2's local window (Is_local; FA2 launches it with Is_even_MN false)
_BWD_LOCAL = _BWD.replace("false, false, false, false, true, true, false>",
                          "false, false, true, false, false, true, false>")
FA2_KERNELS = {
    ("fwd", 64): (_FWD.format("64, 128, 128, 4"), 128, 128, 4),
    ("fwd", 128): (_FWD.format("128, 128, 64, 4"), 128, 64, 4),
    ("bwd", 64): (_BWD.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd", 128): (_BWD.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
    ("bwd-softcap", 64): (_BWD_SOFTCAP.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd-softcap", 128): (_BWD_SOFTCAP.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
    ("bwd-masked-softcap", 64): (_BWD_SOFTCAP.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd-masked-softcap", 128): (_BWD_SOFTCAP.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
    ("bwd-local", 64): (_BWD_LOCAL.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd-local", 128): (_BWD_LOCAL.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
}
# PyTorch's bundled copy (bench/fa2_torch.py, --torch): its plain backward and its backward
# with dropout (Is_dropout), the one public build of it, at the same traits
_BWD_DROPOUT = _BWD.replace("<{}, false, false, cutlass::half_t>, false,",
                            "<{}, false, false, cutlass::half_t>, true,")
TORCH_KERNELS = {
    ("bwd", 64): FA2_KERNELS[("bwd", 64)],
    ("bwd", 128): FA2_KERNELS[("bwd", 128)],
    ("bwd-masked-dropout", 64): (_BWD_DROPOUT.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd-masked-dropout", 128): (_BWD_DROPOUT.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
    ("bwd-dropout", 64): (_BWD_DROPOUT.format("64, 128, 128, 8, 4, 4, 4"), 128, 128, 8),
    ("bwd-dropout", 128): (_BWD_DROPOUT.format("128, 64, 128, 8, 2, 4, 2"), 64, 128, 8),
}
# cuflash's backward with the logit features (flash_bwd_tc_masked) for one call's interior
# tile (feature_counts.bwd_feature_edits: its flags as constants, the band test off): "masked"
# a call with features that cost nothing per interior logit (a window, a causal band) beside
# FA2's plain backward, "masked-softcap" beside FA2's softcap backward
BWD_FEATURE_KINDS = {"bwd-masked": {}, "bwd-masked-softcap": {"cap": True}}
# and beside PyTorch's FA2 only (no upstream FA2 kernel has dropout): a call with dropout alone
TORCH_FEATURE_KINDS = {"bwd-masked-dropout": {"drop": True}}
# and the lean build a call with dropout and at most a window runs (flash_bwd_tc_dropout), as
# launched, beside the same FA2 kernel
TORCH_LEAN_KINDS = {"bwd-dropout": "flash_bwd_tc_dropout"}
# cuflash's lean backward builds as launched, their band test included, at their default
# tiles: flash_bwd_tc_band (a window alone) beside FA2's plain backward ("band") and FA2's
# backward with a local window ("local", Is_local); flash_bwd_tc_softcap (a softcap and at
# most a window) beside FA2's softcap backward; flash_bwd_tc_alibi (ALiBi and at most a window)
# beside FA2's plain backward (the wheel has no ALiBi backward).  (flash_bwd_tc_dropout, whose
# one FA2 counterpart is PyTorch's, is in TORCH_LEAN_KINDS above.)
BWD_BAND_KINDS = {"bwd-band": "flash_bwd_tc_band", "bwd-local": "flash_bwd_tc_band",
                  "bwd-softcap": "flash_bwd_tc_softcap", "bwd-alibi": "flash_bwd_tc_alibi"}
# FA2 2.8.3 built here from its source (bench/fa2_source.py, --source): the backward kernels no
# public wheel holds.  Row kind -> the fa2_source.KERNELS kernel beside it.  cuflash's side:
# "bwd" the plain kernel (the build read against the wheel's), "bwd-alibi" / "bwd-alibi-even"
# flash_bwd_tc_alibi beside FA2's ALiBi backward as launched (Is_even_MN and Is_even_K off) and
# beside its never-launched even build, "bwd-dropout" flash_bwd_tc_dropout and
# "bwd-masked-dropout" flash_bwd_tc_masked's dropout beside upstream's dropout backward,
# "bwd-alibi-dropout" flash_bwd_tc_alibi_dropout (ALiBi, dropout and at most a window) beside
# FA2's ALiBi backward with dropout, "bwd-alibi-softcap" flash_bwd_tc_alibi_softcap (ALiBi, a
# softcap and at most a window) beside FA2's ALiBi backward with a softcap, and
# flash_bwd_tc_masked's count builds for ALiBi with dropout and with a softcap (what such
# calls cost once they add a bias) beside FA2's kernels with both.
SOURCE_ROWS = {"bwd": "bwd", "bwd-alibi": "bwd-alibi", "bwd-alibi-even": "bwd-alibi-even",
               "bwd-dropout": "bwd-dropout", "bwd-masked-dropout": "bwd-dropout",
               "bwd-alibi-dropout": "bwd-alibi-dropout",
               "bwd-masked-alibi-dropout": "bwd-alibi-dropout",
               "bwd-alibi-softcap": "bwd-alibi-softcap",
               "bwd-masked-alibi-softcap": "bwd-alibi-softcap"}
SOURCE_LEAN_KINDS = {"bwd-alibi-even": "flash_bwd_tc_alibi",
                     "bwd-alibi-dropout": "flash_bwd_tc_alibi_dropout",
                     "bwd-alibi-softcap": "flash_bwd_tc_alibi_softcap"}
SOURCE_FEATURE_KINDS = {"bwd-masked-alibi-dropout": {"alibi": True, "drop": True},
                        "bwd-masked-alibi-softcap": {"alibi": True, "cap": True}}

# Instruction classes of the breakdown, first match wins: (name, test of the full opcode).
# "moves" are register copies and zeroing (IMAD.MOV is ptxas' move on the integer pipe);
# "int" the integer ALU (addresses, loop counters, predicates); "uniform" the uniform datapath.
_FP32 = {"FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND", "FSWZADD"}
_HALF = {"F2FP", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "F2F", "I2F", "F2I", "I2FP", "F2IP"}
_INT = {"IMAD", "IADD3", "IADD", "LEA", "SHF", "LOP3", "LOP", "ISETP", "SEL", "IMNMX", "IABS",
        "PRMT", "PLOP3", "P2R", "R2P", "BMSK", "SGXT", "POPC", "FLO", "BREV", "IDP", "ICMP", "VIADD",
        "VIMNMX", "IMUL", "SHL", "SHR"}
_BRANCH = {"BRA", "BRX", "JMP", "BSSY", "BSYNC", "WARPSYNC", "EXIT", "CALL", "RET", "BMOV", "BREAK",
           "YIELD", "NANOSLEEP", "KILL", "BPT"}
CLASSES = [
    ("HMMA", lambda b, f: b == "HMMA"),
    ("LDSM", lambda b, f: b == "LDSM"),
    ("LDS/STS", lambda b, f: b in ("LDS", "STS")),
    ("global", lambda b, f: b in ("LDG", "STG", "LDGSTS", "LDGDEPBAR")),
    ("RED/ATOM", lambda b, f: b in ("RED", "REDG", "ATOM", "ATOMG", "ATOMS")),
    ("MUFU", lambda b, f: b == "MUFU"),
    ("FP32", lambda b, f: b in _FP32),
    ("F2FP/HADD2/cvt", lambda b, f: b in _HALF),
    ("moves", lambda b, f: b in ("MOV", "CS2R") or f.startswith("IMAD.MOV")),
    ("int", lambda b, f: b in _INT),
    ("uniform", lambda b, f: b.startswith("U") or b in ("S2UR", "R2UR")),
    ("branch/conv", lambda b, f: b in _BRANCH),
    ("SHFL/VOTE", lambda b, f: b in ("SHFL", "VOTE", "VOTEU", "MATCH")),
    ("BAR/DEPBAR", lambda b, f: b in ("BAR", "DEPBAR", "MEMBAR", "ERRBAR")),
    ("LDL/STL", lambda b, f: b in ("LDL", "STL")),
    ("other", lambda b, f: True),
]
CLASS_NAMES = [name for name, _ in CLASSES]


# ----------------------------------------------------------------- pure functions (tested)
def parse_sass(text):
    """``{kernel: [(address, opcode, full opcode, operands, predicate), ...]}`` from
    ``cuobjdump -sass`` text: ``opcode`` without modifiers (``IMAD``), ``full`` with them
    (``IMAD.MOV.U32``), ``predicate`` as written (``@!P0``) or ''.  Instructions predicated on
    never (``@!PT``: ptxas' padding around cp.async) are kept here, with that predicate, and
    left out of every count (as cuflash._sass.instructions leaves them out)."""
    out, cur = {}, None
    for line in text.splitlines():
        fm = _sass._FUNC.match(line)
        if fm:
            cur = out.setdefault(fm.group(1), [])
            continue
        m = _sass._LINE.match(line)
        if m and cur is not None:
            pred = (m.group(2) or "").strip()
            cur.append((int(m.group(1), 16), m.group(3), m.group(3) + m.group(4), m.group(5).strip(),
                        pred))
    return out


def base(instrs):
    """The (address, opcode, operands) triples cuflash._sass's loop functions take."""
    return [(a, op, args) for a, op, _, args, pred in instrs if pred != "@!PT"]


def _target(args):
    t = re.match(r"(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", args)
    return int(t.group(1), 16) if t and t.group(1) is not None else None


def excursions(instrs, span):
    """Blocks outside ``span`` that a conditional branch inside it enters and that return into
    it by an unconditional branch: code ptxas placed out of line (FA2's forward: the copy of
    the next K tile, on every trip but the last).  [(start, end)] addresses."""
    lo, hi = span
    out = []
    for i, (a, op, _, args, pred) in enumerate(instrs):
        x = _target(args) if op == "BRA" and pred and lo <= a <= hi else None
        if x is None or lo <= x <= hi:
            continue
        j = next((k for k, ins in enumerate(instrs) if ins[0] == x), None)
        for ins in instrs[j:] if j is not None else []:
            if lo <= ins[0] <= hi or ins[1] in ("EXIT", "RET", "BRX", "JMP", "CALL"):
                break
            if ins[1] == "BRA":
                t = _target(ins[3])
                if not ins[4] and t is not None and lo <= t <= hi:
                    out.append((x, ins[0]))
                break
    return sorted(set(out))


def longer_arms(instrs, span, weight=lambda a: 1):
    """The longer arm of each if/else inside ``span`` (a conditional forward branch to X whose
    fall-through arm ends with an unconditional branch past X): one trip runs one arm, and the
    longer is the edge path (cuflash's backward: the masked scores).  [(start, end)] addresses,
    arms compared by their instructions, each weighted by ``weight(address)``."""
    lo, hi = span
    out = []
    for i, (a, op, _, args, pred) in enumerate(instrs):
        x = _target(args) if op == "BRA" and pred and lo <= a <= hi else None
        if x is None or not a < x <= hi:
            continue
        j = next((k for k, ins in enumerate(instrs) if ins[0] == x), None)
        if j is None or j == 0:
            continue
        prev = instrs[j - 1]
        y = _target(prev[3]) if prev[1] == "BRA" and not prev[4] else None
        if y is None or not x < y <= hi:
            continue
        first = [ins[0] for ins in instrs[i + 1:j] if ins[4] != "@!PT"]
        second = [ins[0] for ins in instrs[j:] if ins[0] < y and ins[4] != "@!PT"]
        if not first or not second:
            continue
        w1, w2 = sum(map(weight, first)), sum(map(weight, second))
        out.append((first[0], first[-1]) if w1 > w2 else (second[0], second[-1]))
    return out


def steady_ops(instrs, span, trips=None):
    """Counter of full opcodes of one steady-state trip of the loop ``span``: its instructions,
    each counted once per run of every loop of ``trips`` ({(start, end): trip count}) that holds
    it, plus its out-of-line blocks (:func:`excursions`), less the longer arm of each if/else
    (:func:`longer_arms`).  Returns (Counter, instructions added, instructions left out,
    ``@!PT`` padding instructions of the trip, not counted)."""
    trips = trips or {}

    def weight(a):
        w = 1
        for (lo, hi), n in trips.items():
            if lo <= a <= hi:
                w *= n
        return w
    add = excursions(instrs, span)
    drop = longer_arms(instrs, span, weight)
    c = collections.Counter()
    added = dropped = never = 0
    for a, _, full, _, pred in instrs:
        inside = span[0] <= a <= span[1]
        if not inside and not any(lo <= a <= hi for lo, hi in add):
            continue
        if any(lo <= a <= hi for lo, hi in drop):
            dropped += pred != "@!PT" and weight(a)
        elif pred == "@!PT":
            never += weight(a)
        else:
            c[full] += weight(a)
            added += not inside
    return c, added, dropped, never


def hmma_16816(ops):
    """HMMA.16816 equivalents in a Counter of full opcodes (an m16n8k8 HMMA is half of one)."""
    n = 0.0
    for full, k in ops.items():
        if full.split(".")[0] != "HMMA":
            continue
        shape = full.split(".")[1] if "." in full else ""
        if shape == "16816":
            n += k
        elif shape == "1688":
            n += k / 2
        else:
            raise ValueError(f"unknown HMMA shape in {full!r}")
    return n


def classify(ops):
    """Counts per class of CLASSES (and "total") from a Counter of full opcodes."""
    out = collections.OrderedDict((name, 0) for name in CLASS_NAMES)
    for full, k in ops.items():
        b = full.split(".")[0]
        name = next(n for n, test in CLASSES if test(b, full))
        out[name] += k
    out["total"] = sum(ops.values())
    return out


def per_1000(classes, hmma):
    """The classes per 1,000 HMMA.16816."""
    return collections.OrderedDict((k, 1000.0 * v / hmma) for k, v in classes.items())


def normalise(demangled):
    """A demangled FA2 kernel name without 'void ', its parameter list and the nested
    ``Flash_kernel_traits<...>`` (the same numbers as the outer traits)."""
    s = demangled.strip()
    s = re.sub(r"^void\s+", "", s)
    s = re.sub(r"\((?:flash::)?Flash_(?:fwd|bwd)_params\)$", "", s)
    s = re.sub(r",?\s*Flash_kernel_traits<[^<>]*>\s*", "", s)
    return re.sub(r"\s+>", ">", s)


def mangled_names(blob):
    """The C++ symbol names (``_Z...``) in a cubin's bytes, sorted and unique."""
    return sorted({m.decode() for m in re.findall(rb"_Z[0-9A-Za-z_]{8,}", blob)})


# ----------------------------------------------------------------- tools
def find_ptxas():
    """Path of ``ptxas``: $CUFLASH_PTXAS, the PATH, or a pip wheel's (nvidia-cuda-nvcc); or None."""
    env = os.environ.get("CUFLASH_PTXAS")
    if env:
        return env
    hit = shutil.which("ptxas")
    if hit:
        return hit
    roots = list(site.getsitepackages()) + [p for p in sys.path if p.endswith("site-packages")]
    for root in dict.fromkeys(roots):
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "**", "bin", "ptxas"), recursive=True))
        if hits:
            return hits[-1]
    return None


def tool_version(path):
    """The 'release X, VX.Y.Z' part of a CUDA tool's --version, or '?'."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "?"
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else "?"


def _run(cmd, cwd=None):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


# ----------------------------------------------------------------- FA2's side
def fetch_wheel(wheel_dir, wheel=WHEEL, version=WHEEL_VERSION):
    """The ``wheel`` (default flash-attn-jax) of ``version`` in ``wheel_dir``, downloaded there
    (pip, no dependencies) if absent."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"{wheel.replace('-', '_')}-{version}-*.whl"
    have = sorted(wheel_dir.glob(pattern))
    if not have:
        print(f"pip download {wheel}=={version} -> {wheel_dir}", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", *WHEEL_PLATFORM,
              "-d", str(wheel_dir), f"{wheel}=={version}"])
        have = sorted(wheel_dir.glob(pattern))
        if not have:
            raise RuntimeError(f"pip download left no {pattern} in {wheel_dir}")
    return have[-1]


class FA2Library:
    """The wheel's shared library unpacked under ``cache``, its cubins extracted, and an index
    from normalised demangled kernel names to (cubin path, mangled name)."""

    def __init__(self, wheel, cache):
        self.cuobjdump = _sass.find_cuobjdump()
        if self.cuobjdump is None:
            raise RuntimeError(_sass.is_available()[1])
        if shutil.which("c++filt") is None:
            raise RuntimeError("c++filt (binutils) is needed to read FA2's kernel names")
        self.dir = Path(cache) / wheel.name[:-len(".whl")]
        with zipfile.ZipFile(wheel) as z:
            libs = [n for n in z.namelist() if n.endswith(".so") and "flash_api" in n]
            if len(libs) != 1:
                raise RuntimeError(f"expected one flash_api*.so in {wheel.name}, found {libs}")
            self.so = self.dir / libs[0]
            if not self.so.exists():
                z.extract(libs[0], self.dir)
        self.elf = self.dir / "elf"
        if not any(self.elf.glob("*.cubin")):
            self.elf.mkdir(exist_ok=True)
            _run([self.cuobjdump, "-xelf", "all", str(self.so)], cwd=self.elf)
        self.index = self._index()

    def _index(self):
        pairs = []
        for cubin in sorted(self.elf.glob("*.cubin")):
            for name in mangled_names(cubin.read_bytes()):
                if "flash_fwd_kernel" in name or "loop_seqk_parallel" in name:
                    pairs.append((cubin, name))
        demangled = subprocess.run(["c++filt"], input="\n".join(n for _, n in pairs), text=True,
                                   capture_output=True, check=True).stdout.splitlines()
        return {normalise(d): p for d, p in zip(demangled, pairs)}

    def kernel(self, want):
        if want not in self.index:
            raise RuntimeError(f"{want} not in {self.so.name}")
        return self.index[want]

    def sass_sm80(self, want):
        cubin, mangled = self.kernel(want)
        text = _run([self.cuobjdump, "-sass", "-fun", mangled, str(cubin)])
        return parse_sass(text)[mangled]

    def sass_sm90(self, want, ptxas):
        """The kernel's compute_80 PTX (the cubin's companion in the fat binary) assembled for
        sm_90 by ``ptxas`` alone (-e: just this entry)."""
        cubin, mangled = self.kernel(want)
        ptx_name = cubin.name[:-len(".cubin")] + ".ptx"
        ptx = self.dir / "ptx" / ptx_name
        if not ptx.exists():
            ptx.parent.mkdir(exist_ok=True)
            _run([self.cuobjdump, "-xptx", ptx_name, str(self.so)], cwd=ptx.parent)
        if f".entry {mangled}(" not in ptx.read_text():
            raise RuntimeError(f"{ptx_name} does not hold {mangled}")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "k.cubin"
            _run([ptxas, "-arch=sm_90", "-e", mangled, "-o", str(out), str(ptx)])
            return parse_sass(_sass.disassemble(out.read_bytes()))[mangled]


def _note(added, dropped, never, extra=""):
    parts = [extra] if extra else []
    if never:
        parts.append(f"{never} @!PT padding not counted")
    if added:
        parts.append(f"+{added} out of line")
    if dropped:
        parts.append(f"-{dropped} longer if/else arms")
    return "; ".join(parts)


def fa2_count(instrs):
    """(ops Counter, note) of one steady trip of FA2's main loop (its GEMMs are unrolled)."""
    span = _sass.main_loop(base(instrs))
    inner = [l for l in _sass._loops(base(instrs)) if span[0] < l[0] and l[1] < span[1]]
    ops, added, dropped, never = steady_ops(instrs, span)
    return ops, _note(added, dropped, never, f"{len(inner)} inner loop(s) counted once" if inner else "")


# ----------------------------------------------------------------- cuflash's side
def cuflash_count(kind, d, arch, tiles=None):
    """(ops Counter, block_q, block_kv, warps, note) of cuflash's main loop, one trip per warp.
    ``kind``: "fwd", "fwd-rescale" (the forward's rescale taken on every tile), "bwd", a key of
    BWD_FEATURE_KINDS, TORCH_FEATURE_KINDS or BWD_BAND_KINDS;
    ``tiles``: (block_q, block_kv) instead of the default plan."""
    import kernel_report as kr
    import plan_sweep as ps
    from cuflash import kernels, tiling
    features = {**BWD_FEATURE_KINDS, **TORCH_FEATURE_KINDS, **SOURCE_FEATURE_KINDS}.get(kind)
    lean = {**BWD_BAND_KINDS, **TORCH_LEAN_KINDS, **SOURCE_LEAN_KINDS}
    kernel = ("flash_bwd_tc" if kind == "bwd" else "flash_bwd_tc_masked" if features is not None
              else lean[kind] if kind in lean else "flash_fwd_tc")
    bq, bkv = tiles or (None, None)
    plan = tiling.plan(kernel, d, d, "float16", block_q=bq, block_kv=bkv,
                       limit=tiling.EMULATOR_ARCHES[f"sm_{arch}"])
    defines = kernels.plan_defines(plan)
    extra = ({"CUFLASH_MASKS": None, "CUFLASH_BWD_TC_MAIN": None} if features is not None
             else {"CUFLASH_FWD_INTERIOR_ONLY": 1} if kernel == "flash_fwd_tc" else {})
    # (a lean build's defines are its plan_sweep group's)
    if kind == "fwd-rescale":
        extra["CUFLASH_FWD_COUNT_RESCALE"] = 1
    job = ps.Job(kernel, f"fa2_sass_compare {kind} {d} sm_{arch}", dict(defines, **extra), arch)
    if features is None:
        res = ps.compile_result(job)
    else:
        import feature_counts as fc
        with tempfile.TemporaryDirectory() as tmp:
            folder = fc._variant(tmp, "v", fc.bwd_feature_edits(unroll=False, **features))
            res = ps.compile_result(job, kdir=folder)
    instrs = parse_sass(_sass.disassemble(res.cubin))[kernel]
    code = base(instrs)
    span = _sass.main_loop(code)
    trips, note = {}, ""
    if kernel != "flash_fwd_tc":
        trips = kr.tc_loop_trips(code, span, defines)
        if trips is None:
            raise RuntimeError(f"{kernel} d={d} sm_{arch}: the inner loops are not the expected "
                               "S^T / dP^T / dQ loops; no per-trip count")
        draws = draw_loops(code, span)
        dropout = (features or {}).get("drop") or kernel.endswith("_dropout")
        if draws and not (len(draws) == 1 and dropout):
            raise RuntimeError(f"{kernel} d={d} sm_{arch}: rolled loops without HMMA {draws} "
                               "where only the dropout's Philox loop is expected")
        if draws:
            trips[draws[0]] = draw_trips(code, draws[0], plan.block_q * plan.block_kv // plan.threads)
        note = "inner loops x " + ", ".join(str(t) for _, t in sorted(trips.items()))
    ops, added, dropped, never = steady_ops(instrs, span, trips)
    info = _nvrtc.parse_ptxas_info(res.log)[kernel]
    if info["spill_stores"] or info["spill_loads"]:
        note = (note + "; " if note else "") + f"spills {info['spill_stores']} B"
    return ops, plan.block_q, plan.block_kv, plan.threads // 32, _note(added, dropped, never, note)


def draw_loops(code, span):
    """The rolled loops inside the loop ``span`` that hold no HMMA (the backward's dropout draws:
    its Philox blocks, one per step), which :func:`kernel_report.tc_loop_trips` does not weigh:
    [(start, end)] addresses."""
    return sorted((a, b) for a, b in _sass._loops(code) if span[0] < a and b < span[1]
                  and not any(op == "HMMA" for x, op, _ in code if a <= x <= b))


def draw_trips(code, loop, logits):
    """Trips of the Philox loop ``loop`` for ``logits`` per lane: one block per eight logits,
    as many blocks per trip as the body has pairs of PRMT with selector 0xfdb9 (two per block,
    gathering its keep bits: bwd_masks.cuh ``bwd_kept_bits``)."""
    gathers = sum(1 for a, op, args in code
                  if loop[0] <= a <= loop[1] and op == "PRMT" and "0xfdb9" in args.lower())
    if gathers == 0 or gathers % 2:
        raise RuntimeError(f"Philox loop {loop}: {gathers} PRMT 0xfdb9, not two per block")
    return logits // 8 // (gathers // 2)


# ----------------------------------------------------------------- table
def row(label, ops, bq, bkv, warps):
    """(label, per-1,000 classes, per-logit total, HMMA per warp-trip)."""
    h = hmma_16816(ops)
    cls = classify(ops)
    return dict(label=label, per=per_1000(cls, h), logit=cls["total"] / (bq * bkv / warps), hmma=h,
                total=cls["total"], tiles=f"{bq}x{bkv}, {warps} warps")


def markdown(rows, breakdown=True):
    lines = ["| kernel | FA2 | cuflash | cuflash / FA2 |", "|---|---|---|---|"]
    for key in rows:
        fa2, cf = rows[key].get("FA2"), rows[key].get("cuflash")

        def cell(r):
            if isinstance(r, str):
                return r
            return f"{r['per']['total']:.0f} ({r['logit']:.3f})"
        ratio = (f"{cf['per']['total'] / fa2['per']['total']:.3f}"
                 if isinstance(fa2, dict) and isinstance(cf, dict) else "")
        lines.append(f"| {key} | {cell(fa2)} | {cell(cf)} | {ratio} |")
    if not breakdown:
        return "\n".join(lines)
    lines += ["", "Per class, per 1,000 HMMA.16816 (FA2 / cuflash / difference):", ""]
    lines.append("| class | " + " | ".join(rows) + " |")
    lines.append("|---|" + "---|" * len(rows))
    for name in CLASS_NAMES + ["total"]:
        cells = []
        for key in rows:
            fa2, cf = rows[key].get("FA2"), rows[key].get("cuflash")
            f = f"{fa2['per'][name]:.0f}" if isinstance(fa2, dict) else "-"
            c = f"{cf['per'][name]:.0f}" if isinstance(cf, dict) else "-"
            diff = (f" ({cf['per'][name] - fa2['per'][name]:+.0f})"
                    if isinstance(fa2, dict) and isinstance(cf, dict) else "")
            cells.append(f"{f} / {c}{diff}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "One trip per warp (tiles, HMMA.16816 and instructions per warp-trip):", ""]
    lines.append("| kernel | side | tiles | HMMA | instructions | note |")
    lines.append("|---|---|---|---|---|---|")
    for key in rows:
        for side in ("FA2", "cuflash"):
            r = rows[key].get(side)
            if isinstance(r, dict):
                lines.append(f"| {key} | {side} | {r['tiles']} | {r['hmma']:g} | {r['total']} | "
                             f"{r.get('note', '')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel-dir", type=Path, default=DEFAULT_CACHE,
                    help=f"where the wheel is (downloaded there if absent; default {DEFAULT_CACHE})")
    ap.add_argument("--cache", type=Path, help="where it is unpacked (default: --wheel-dir)")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=[80, 90])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--bwd-tiles", metavar="BQxBKV",
                    help="count cuflash's backward at these tiles instead of the default plan's")
    ap.add_argument("--fwd-tiles", metavar="BQxBKV",
                    help="count cuflash's forward at these tiles instead of the default plan's (written to "
                         "fa2_sass_compare_fwd_<tiles>.md)")
    ap.add_argument("--torch", action="store_true",
                    help="add rows beside PyTorch's bundled FA2 (bench/fa2_torch.py: downloads the "
                         "torch wheel, about 550 MB): its plain backward and its backward with dropout")
    ap.add_argument("--source", action="store_true",
                    help="add rows beside FA2 2.8.3 built here from its sdist (bench/fa2_source.py: "
                         "downloads it and CUDA 13.0's nvcc wheels, about 100 MB; builds for about four "
                         "minutes the first time): its ALiBi and dropout backward kernels")
    ap.add_argument("--no-write", action="store_true", help=f"do not write {RESULT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    def _tiles(text):
        return tuple(int(x) for x in text.lower().split("x")) if text else None
    fwd_tiles, bwd_tiles = _tiles(args.fwd_tiles), _tiles(args.bwd_tiles)
    t0 = time.time()
    ok, why = _nvrtc.is_available()
    if not ok:
        print(f"NVRTC not available: {why}", file=sys.stderr)
        return 2
    ok, why = _sass.is_available()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    wheel = fetch_wheel(args.wheel_dir)
    lib = FA2Library(wheel, args.cache or args.wheel_dir)
    ptxas = find_ptxas()
    torch = None
    if args.torch:
        import fa2_torch
        torch_wheel = fa2_torch.fetch(args.wheel_dir)
        torch = fa2_torch.TorchFA2(torch_wheel, args.cache or args.wheel_dir)
    src = None
    if args.source:
        import fa2_source
        src = fa2_source.SourceFA2(args.cache or args.wheel_dir)
    rows = collections.OrderedDict()
    kinds = [(k, None) for k in ("fwd", "fwd-rescale", "bwd", *BWD_FEATURE_KINDS, *BWD_BAND_KINDS)]
    if torch is not None:
        kinds += [(k, "torch") for k in dict.fromkeys(k for k, _ in TORCH_KERNELS)]
    if src is not None:
        kinds += [(k, "src") for k in SOURCE_ROWS]
    for kind, side in kinds:
        for d in args.d:
            if side == "torch":
                want, bq, bkv, warps = TORCH_KERNELS[(kind, d)]
            elif side == "src":
                want = fa2_source.kernel_name(d, SOURCE_ROWS[kind])
                bq, bkv, warps = FA2_KERNELS[("bwd", d)][1:]
            else:
                want, bq, bkv, warps = FA2_KERNELS.get((kind, d)) or FA2_KERNELS[(kind.split("-")[0], d)]
            for arch in args.arch:
                key = f"{side + ' ' if side else ''}{kind} d={d} sm_{arch}"
                print(f"{key} ...", file=sys.stderr, flush=True)
                r = rows[key] = {}
                if side == "torch":
                    code = torch.sass(want, arch)
                elif side == "src":
                    code = src.sass(want, arch)
                elif arch == 80:
                    code = lib.sass_sm80(want)
                elif ptxas is None:
                    code = None
                    r["FA2"] = "unavailable: no ptxas (pip install nvidia-cuda-nvcc, or $CUFLASH_PTXAS)"
                else:
                    code = lib.sass_sm90(want, ptxas)
                if code is not None:
                    ops, note = fa2_count(code)
                    r["FA2"] = dict(row(key, ops, bq, bkv, warps), note=note)
                try:
                    ops, cbq, cbkv, cwarps, note = cuflash_count(
                        kind, d, arch, bwd_tiles if kind in ("bwd", *BWD_BAND_KINDS, *TORCH_LEAN_KINDS,
                                                             *SOURCE_LEAN_KINDS)
                        else fwd_tiles if kind.startswith("fwd") else None)
                except ValueError as e:  # tiles that this architecture's shared memory refuses
                    m = re.search(r"needs \d+ B of shared memory", str(e))
                    r["cuflash"] = f"not planned: {m.group(0) if m else str(e)[:120]}"
                    continue
                r["cuflash"] = dict(row(key, ops, cbq, cbkv, cwarps), note=note)
    table = markdown(rows)
    elapsed = time.time() - t0
    tiles = ", ".join(f"{k}: {v}" for k, v in (("forward", args.fwd_tiles), ("backward", args.bwd_tiles)) if v)
    head = header(wheel, ptxas, elapsed, argv, tiles, torch_wheel if torch is not None else None,
                  src)
    print(table)
    print(f"\n({elapsed:.0f} s)", file=sys.stderr)
    if not args.no_write:
        suffix = "".join(f"_{k}_{v.lower()}" for k, v in (("fwd", args.fwd_tiles), ("bwd", args.bwd_tiles)) if v)
        out = RESULT.with_name(f"{RESULT.stem}{suffix}.md")
        out.write_text(head + "\n" + table + "\n")
        print(f"written: {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


def header(wheel, ptxas, elapsed, argv, tiles=None, torch_wheel=None, src=None):
    import kernel_report as kr
    rev, nvrtc = kr.provenance()
    cmd = "python bench/fa2_sass_compare.py" + "".join(" " + a for a in (argv or sys.argv[1:]))
    ptx = f"ptxas {tool_version(ptxas)} ({ptxas})" if ptxas else "no ptxas: FA2 sm_90 unavailable"
    return (
        "# cuflash's main loops beside FlashAttention-2's: instructions per 1,000 HMMA (generated)\n\n"
        f"Command: `{cmd}` ({elapsed:.0f} s, no GPU), {datetime.date.today().isoformat()}, "
        f"cuflash at {rev}.\n"
        f"FA2: `{wheel.name}` (pip download, unpacked, not installed): sm_80 its cubins; sm_90 its "
        f"compute_80 PTX through {ptx}. cuflash: NVRTC {nvrtc} at the planner's default tiles"
        f"{' (' + tiles + ')' if tiles else ''}, "
        f"float16, the launch's build options. cuobjdump {tool_version(_sass.find_cuobjdump())}.\n\n"
        "Per kernel: one steady-state trip of the loop with the most HMMA, per warp (FA2's "
        "backward: its Q-tile loop; cuflash's backward: its rolled inner loops times their trip "
        "counts). cuflash's forward is the interior-tile build (`-DCUFLASH_FWD_INTERIOR_ONLY=1`): "
        "no mask, the lazy rescale's vote kept and its rescale left out (a tile where no row's max "
        "moves; FA2 rescales on every tile); the fwd-rescale rows add `-DCUFLASH_FWD_COUNT_RESCALE=1`: "
        "the rescale of O and l taken on every tile, as FA2 does. The bwd-masked and "
        "bwd-masked-softcap rows: flash_bwd_tc_masked (the backward with the logit features, which "
        "calls with bias, ALiBi or dropout run) at its default tiles for one call's interior tile, "
        "its feature flags compiled as constants and the band test off "
        "(`feature_counts.bwd_feature_edits`): no feature beside FA2's plain backward, softcap "
        "beside FA2's softcap backward (`Is_softcap`; the wheel has no ALiBi or dropout backward). "
        "The bwd-band, bwd-local, bwd-softcap and bwd-alibi rows: the lean builds as launched, their band "
        "test included, at their default tiles (the plain kernel's): flash_bwd_tc_band (a window "
        "alone) beside FA2's plain backward and beside FA2's backward with a local window "
        "(`Is_local`, which FA2 runs with `Is_even_MN` false), flash_bwd_tc_softcap (a softcap "
        "and at most a window) beside FA2's softcap backward, flash_bwd_tc_alibi (ALiBi and at "
        "most a window) beside FA2's plain backward (the wheel has no ALiBi backward: what ALiBi "
        "adds, not a like-for-like ratio). Out-of-line blocks the loop returns from are added, the "
        "longer arm of each if/else (cuflash's backward: the masked scores) is left out, `@!PT` "
        "padding is not counted (the notes say how much). "
        "In brackets: instructions per logit (block_q x block_kv / warps per warp-trip).\n"
        + ("" if torch_wheel is None else
           f"\nThe `torch` rows: FA2 is PyTorch's bundled copy from `{torch_wheel.name}` (pip "
           "download; `torch/lib/libtorch_cuda.so` unpacked, not installed; its own sm_80 and "
           "sm_90 cubins, `bench/fa2_torch.py`), the one public build of FA2's backward with "
           "dropout (`Is_dropout`, same traits as above). Its plain backward (`torch bwd`) sits "
           "beside cuflash's plain kernel to show the build's own level; `torch bwd-dropout` is "
           "flash_bwd_tc_dropout (the lean build a call with dropout and at most a window runs) as "
           "launched, its band test included, and `torch bwd-masked-dropout` flash_bwd_tc_masked "
           "for a call with dropout alone (the count build of "
           "`feature_counts.bwd_feature_edits(drop=True)`: what dropout costs beside a bias, ALiBi "
           "or a softcap), each beside FA2's backward with dropout; a rolled Philox loop is "
           "weighted by its trips (one Philox block per lane per eight logits, two gathering PRMT "
           "per block). "
           "cuflash draws 16 bits per element (eight elements per Philox block), FA2 8 bits "
           "(sixteen per block).\n")
        + ("" if src is None else
           f"\nThe `src` rows: FA2 is `flash-attn=={src.version}` built here from its sdist "
           f"(`bench/fa2_source.py`: nvcc {src.nvcc_version()} from NVIDIA's pip wheels, FA2's "
           "nvcc options, PTX for compute_80 and compute_90 as its setup.py's gencodes, each "
           "kernel assembled by that ptxas), the backward kernels no public wheel holds, at the "
           "traits above. `src bwd` is its plain backward beside cuflash's plain kernel (the "
           "build read against the wheel's); `src bwd-alibi` FA2's ALiBi backward as its "
           "launcher runs it (`Has_alibi`, with `Is_even_MN` and `Is_even_K` false) and "
           "`src bwd-alibi-even` the even build it never launches, both beside "
           "flash_bwd_tc_alibi as launched; `src bwd-dropout` upstream's dropout backward beside "
           "flash_bwd_tc_dropout, and `src bwd-masked-dropout` beside flash_bwd_tc_masked's "
           "dropout count build; `src bwd-alibi-dropout` flash_bwd_tc_alibi_dropout (ALiBi, "
           "dropout and at most a window) as launched beside FA2's ALiBi backward with dropout; "
           "`src bwd-alibi-softcap` flash_bwd_tc_alibi_softcap (ALiBi, a softcap and at most a "
           "window) as launched beside FA2's ALiBi backward with a softcap; "
           "`src bwd-masked-alibi-dropout` and `src bwd-masked-alibi-softcap` "
           "flash_bwd_tc_masked's count builds for ALiBi with dropout and with a softcap (what "
           "such calls cost once they add a bias) beside FA2's ALiBi backward with dropout and "
           "with a softcap, as launched.\n")
    )


if __name__ == "__main__":
    sys.exit(main())

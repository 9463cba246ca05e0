"""Tile sizes and shared-memory budgets of the CUDA kernels: the one place they are computed.

Every number a launcher uses (tile sizes, threads per block, dynamic shared
memory bytes) comes from :func:`plan`, and so do the figures that
``memory_analysis(backend="cuda"/"emulator")`` reports and the messages of the
``ValueError`` raised for tiles that do not fit.  Nothing else in cuflash
repeats these formulas (flash-attn keeps one copy in C++ and one in Python;
here the kernels receive every size as a ``-D`` define built from a plan).

A kernel is described by a :class:`KernelTiling`: the tile sizes it supports,
a formula for its dynamic shared memory, its threads per block, and an ordered
list of preferred default tiles per head dim.  ``plan(kernel, ...)``

* honours explicit ``block_q``/``block_kv`` or refuses them (``ValueError``
  stating the budget and the supported choices) -- never changes them;
* picks, when a size is None, the first preferred tile pair that fits the
  device's shared-memory limit (so one table serves an sm_75 with 64 KB as well
  as an H100 with 227 KB);
* checks the total against the limit the device allows with opt-in
  (``cudaDevAttrMaxSharedMemoryPerBlockOptin`` on a real GPU; a nominal sm_80
  or sm_90 figure on the emulator, stated as such in every output).

Above 48 KB a kernel needs its dynamic shared-memory limit raised before launch
(``STATIC_SMEM_LIMIT``); :attr:`TilePlan.needs_opt_in` tells the launcher.

The backward kernels (KERNELS-BWD) register their own ``KernelTiling`` entries
in the marked section at the bottom with :func:`register`; everything else
(planning, limits, messages) is shared.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import numpy as np

__all__ = [
    "KernelTiling", "TilePlan", "register", "plan", "kernel_tiling", "accumulator_bytes",
    "device_smem_limit", "EMULATOR_ARCHES", "STATIC_SMEM_LIMIT", "MAX_HEAD_DIM",
    "defaults_table", "flash_fwd_traffic", "plan_flash_fwd", "TC_DTYPES", "TF32_DTYPES",
    "TC_KERNELS", "tc_kernel_for", "tc_strides", "tc_rows_per_warp", "tc_acc_regs",
    "device_sm_count", "num_splits_heuristic", "EMULATOR_SMS", "plan_bwd_tf32", "bwd_tf32_strides",
    "plan_flash_bwd", "bwd_tc_layout", "flash_bwd_tc_traffic", "bwd_dq_splits",
]

# Dynamic shared memory above this needs cudaFuncAttributeMaxDynamicSharedMemorySize.
STATIC_SMEM_LIMIT = 48 * 1024

# Nominal opt-in limits for the emulator (which itself has no limit): what the
# same launch would be allowed on the named architecture (CUDA programming
# guide, "Technical Specifications per Compute Capability").
EMULATOR_ARCHES = {
    "sm_75": 64 * 1024,
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
}
EMULATOR_DEFAULT_ARCH = "sm_80"

# The largest head dim any kernel supports (register arrays are sized by it).
MAX_HEAD_DIM = 256


def accumulator_bytes(dtype):
    """Bytes of the type the kernels compute and keep their tiles in.

    float16, bfloat16 and float32 are loaded as such and computed in float32
    (4 bytes); float64 is computed in double (8 bytes) so it meets the 1e-12
    tolerance of the float64 oracle.
    """
    return 8 if _dtype_name(dtype) == "float64" else 4


def _dtype_name(dtype):
    # "bfloat16" as a string works without ml_dtypes; ml_dtypes.bfloat16 reports that name
    if isinstance(dtype, str):
        return dtype
    return np.dtype(dtype).name


@dataclass(frozen=True)
class KernelTiling:
    """How one kernel's tiles are sized.

    Attributes
    ----------
    name : str
        Kernel name (``extern "C"`` symbol).
    block_q_choices, block_kv_choices : tuple of int
        The tile sizes the kernel supports.
    shared_bytes : callable(block_q, block_kv, d, dv, acc_bytes) -> int
        Exact dynamic shared memory per block, in bytes.
    threads : callable(block_q, block_kv, d, dv) -> int
        Threads per block.
    preferences : callable(d, dv, acc_bytes) -> sequence of (block_q, block_kv)
        Default tile pairs, best first; the first that fits the limit is used.
    layout : callable(block_q, block_kv, d, dv, acc_bytes) -> str
        One line naming the shared-memory arrays and their shapes (for messages).
    check : callable(block_q, block_kv, d, dv) -> str or None
        Further constraints (e.g. register arrays); a message when violated.
    check_acc : callable(block_q, block_kv, d, dv, acc_bytes) -> str or None
        Constraints that also depend on the accumulator size (a double takes two 32-bit
        registers); a message when violated.  None by default.
    defines : callable(block_q, block_kv, d, dv) -> dict
        Extra ``-D`` defines of a plan beyond dtype, head dims, tiles and threads
        (:func:`cuflash.kernels.plan_defines` adds them); none by default.
    """
    name: str
    block_q_choices: Tuple[int, ...]
    block_kv_choices: Tuple[int, ...]
    shared_bytes: Callable
    threads: Callable
    preferences: Callable
    layout: Callable
    check: Callable = field(default=lambda bq, bkv, d, dv: None)
    check_acc: Callable = field(default=lambda bq, bkv, d, dv, acc: None)
    max_head_dim: int = MAX_HEAD_DIM
    defines: Callable = field(default=lambda bq, bkv, d, dv: {})


@dataclass(frozen=True)
class TilePlan:
    """What one launch uses: returned by :func:`plan`, read by launchers and reports."""
    kernel: str
    block_q: int
    block_kv: int
    d: int
    dv: int
    dtype: str
    acc_bytes: int
    threads: int
    shared_bytes: int
    limit: int
    limit_source: str
    chosen: str  # "explicit", "default" or "mixed"

    @property
    def needs_opt_in(self):
        """True when the dynamic shared memory exceeds the 48 KB launch default."""
        return self.shared_bytes > STATIC_SMEM_LIMIT

    def describe(self):
        return (f"{self.kernel}: block_q={self.block_q}, block_kv={self.block_kv}, "
                f"d={self.d}, dv={self.dv}, {self.dtype}; {self.threads} threads, "
                f"{self.shared_bytes} B shared memory of {self.limit} B ({self.limit_source})")


_REGISTRY: Dict[str, KernelTiling] = {}


def register(tiling):
    """Add (or replace) a kernel's tiling description."""
    _REGISTRY[tiling.name] = tiling
    return tiling


def kernel_tiling(name):
    """The :class:`KernelTiling` of a kernel name (KeyError listing the known kernels)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no tiling registered for kernel {name!r}; known: {sorted(_REGISTRY)}")


def device_smem_limit(backend, arch=None):
    """(bytes, description) of the opt-in shared memory per block for a backend.

    ``"cuda"``: the current CuPy device's ``cudaDevAttrMaxSharedMemoryPerBlockOptin``.
    ``"emulator"``: the nominal limit of ``arch`` (default sm_80); the emulator
    itself has none, so this only keeps emulated launches honest about what a
    GPU would allow.
    """
    if backend == "cuda":
        import cupy
        dev = cupy.cuda.Device()
        rt = cupy.cuda.runtime
        limit = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev.id))
        cc = dev.compute_capability
        return limit, f"device {dev.id} (sm_{cc}) MaxSharedMemoryPerBlockOptin"
    if backend == "emulator":
        arch = arch or EMULATOR_DEFAULT_ARCH
        if arch not in EMULATOR_ARCHES:
            raise ValueError(f"unknown nominal architecture {arch!r}; choose one of "
                             f"{sorted(EMULATOR_ARCHES)}")
        return EMULATOR_ARCHES[arch], f"nominal {arch} opt-in limit (emulator)"
    raise ValueError(f"no shared-memory limit for backend {backend!r} (use 'cuda' or 'emulator')")


# SMs of the GPUs the emulator stands in for (split-KV sizes its grids to fill them)
EMULATOR_SMS = {"sm_75": 40, "sm_80": 108, "sm_86": 84, "sm_89": 128, "sm_90": 132}


def device_sm_count(backend, arch=None):
    """(streaming multiprocessors, description) of the current device or a nominal arch."""
    if backend == "cuda":
        import cupy
        rt = cupy.cuda.runtime
        attr = getattr(rt, "cudaDevAttrMultiProcessorCount", 16)  # CUDA's enum value
        dev = cupy.cuda.Device()
        return int(rt.deviceGetAttribute(attr, dev.id)), f"device {dev.id} MultiProcessorCount"
    arch = arch or EMULATOR_DEFAULT_ARCH
    return EMULATOR_SMS[arch], f"nominal {arch} (emulator)"


# Automatic split-KV (num_splits=None) goes to the SIMT serving kernel.  Where the dense
# plan would run a tensor-core kernel, it is taken only for at most this many query rows
# per kv head (decode: GQA group x new tokens): one m16 tile of rows, where a 64-128-row
# tensor-core tile does mostly padding.  Above it the tensor cores' per-FLOP advantage
# (on the H100 the SIMT forward ran float32 at 12.9 TFLOP/s, flash_fwd_tc float16 at
# 166-172, d=128: docs/gpu-baseline.md) is assumed to beat the split's extra parallelism -- not yet
# measured against the split kernel; num_splits=k forces a split at any row count.
SPLIT_MAX_ROWS_OVER_TC = 16


def num_splits_heuristic(blocks, n_kv_tiles, n_sms, max_splits=128):
    """How many key splits a forward launch of ``blocks`` thread blocks should use (split-KV).

    Splitting multiplies the blocks by the split count at the price of a
    combine pass, so it pays only when the blocks cannot fill the GPU.  With at
    least 80% of a wave of blocks (one per SM), no split.  Otherwise each
    candidate count s gets the efficiency of its last wave,
    ``(blocks * s / n_sms) / ceil(blocks * s / n_sms)``; counts that do not
    change the tiles per split (``ceil(n_kv_tiles / s)``) are skipped, as they
    would only add empty splits; the smallest s within 85% of the best
    efficiency wins (fewer splits: less combine work and less float32 traffic).
    The idea is FlashAttention-2's ``num_splits_heuristic``; the thresholds
    here are its published ones, to be re-tuned on a GPU.
    """
    if blocks <= 0 or n_kv_tiles <= 1 or blocks >= 0.8 * n_sms:
        return 1
    top = min(max_splits, n_sms, n_kv_tiles)
    effs = {}
    prev_per = None
    for s in range(1, top + 1):
        per = -(-n_kv_tiles // s)
        if per == prev_per:
            continue
        prev_per = per
        waves = blocks * s / n_sms
        effs[s] = waves / math.ceil(waves)
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * best)


def _why_not(t, bq, bkv, d, dv, acc):
    """The kernel's own refusal of a tile pair (registers, head dims), or None."""
    return t.check(bq, bkv, d, dv) or t.check_acc(bq, bkv, d, dv, acc)


def _fits(t, bq, bkv, d, dv, acc, limit):
    return _why_not(t, bq, bkv, d, dv, acc) is None and t.shared_bytes(bq, bkv, d, dv, acc) <= limit


# Occupancy floor.  An SM of sm_80/sm_90 has four warp schedulers; a plan whose shared memory
# leaves fewer resident warps than that idles schedulers outright, and nothing hides its
# memory latency.  The H100 tile sweep (docs/gpu-baseline.md) measured such a plan: float32
# d=128 with block_q=16, block_kv=128 (64 threads, 148 KB: one block, 2 warps per SM) ran
# 9x slower than the default.  Defaults skip these plans while any other fits; explicit
# tiles that fall below it are refused where a plan above it exists (float64 at d=256 has
# none: its plans stay allowed).
MIN_RESIDENT_WARPS = 4
MAX_BLOCKS_PER_SM = 16  # the smallest hardware limit of the supported GPUs (sm_75/86/89)
SMEM_RESERVED_PER_BLOCK = 1024  # CUDA reserves 1 KB of each SM's shared memory per block


def resident_warps(threads, shared_bytes, limit):
    """Warps of one kernel that shared memory lets reside on an SM, or None (no limit known).

    An SM holds the per-block opt-in ``limit`` plus the 1 KB the runtime reserves per block
    (A100: 163 KB + 1 KB of 164 KB; H100: 227 + 1 of 228), so ``(limit + 1 KB) // (shared +
    1 KB)`` blocks fit, at most :data:`MAX_BLOCKS_PER_SM`.  Registers can only lower this;
    they are known after compilation (the kernel report and ``kernels.check_compiled``).
    """
    if limit is None or limit < 0 or limit == float("inf"):
        return None
    blocks = min(MAX_BLOCKS_PER_SM,
                 (int(limit) + SMEM_RESERVED_PER_BLOCK) // (shared_bytes + SMEM_RESERVED_PER_BLOCK))
    return blocks * -(-threads // 32)


def _occupancy_ok(t, bq, bkv, d, dv, acc, limit):
    w = resident_warps(t.threads(bq, bkv, d, dv), t.shared_bytes(bq, bkv, d, dv, acc), limit)
    return w is None or w >= MIN_RESIDENT_WARPS


def plan(kernel, d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
         limit_source="unlimited"):
    """The tiles, threads and shared memory one launch of ``kernel`` uses.

    Parameters
    ----------
    kernel : str
        A registered kernel name (``"flash_fwd"``, ...).
    d, dv : int
        Head dims of q/k and of v.
    dtype : numpy dtype or name
        Input dtype (sets the accumulator size).
    block_q, block_kv : int or None
        Explicit tile sizes are honoured or refused, never changed; None picks
        the first preferred pair that fits ``limit``.
    limit : int or None
        Shared-memory bytes per block allowed (from :func:`device_smem_limit`);
        None = no limit.
    limit_source : str
        Where ``limit`` comes from, for messages and reports.

    Returns
    -------
    TilePlan

    Raises
    ------
    ValueError
        Head dims the kernel does not support, tile sizes outside its choices,
        or tiles whose shared memory exceeds ``limit``; the message states the
        budget and the supported choices.
    """
    t = kernel_tiling(kernel)
    acc = accumulator_bytes(dtype)
    dtname = _dtype_name(dtype)
    lim = float("inf") if limit is None else int(limit)
    lim_text = "no limit" if limit is None else f"{int(limit)} B ({limit_source})"
    for name, val in (("d", d), ("dv", dv)):
        if not 1 <= val <= t.max_head_dim:
            raise ValueError(f"{kernel} supports head dims 1..{t.max_head_dim}, got {name}={val}; "
                             "use backend='numpy' for larger head dims")
    for name, val, choices in (("block_q", block_q, t.block_q_choices),
                               ("block_kv", block_kv, t.block_kv_choices)):
        if val is not None and val not in choices:
            raise ValueError(f"{kernel} does not support {name}={val}; supported {name}: "
                             f"{list(choices)} (shared-memory budget {lim_text})")
    if block_q is not None and block_kv is not None:
        pairs, chosen = [(block_q, block_kv)], "explicit"
    else:
        prefs = list(t.preferences(d, dv, acc))
        # then every supported pair, largest tiles first, so a fitting pair is always found
        prefs += sorted(((a, b) for a in t.block_q_choices for b in t.block_kv_choices),
                        key=lambda ab: (-ab[0] * ab[1], -ab[0]))
        pairs = [(a, b) for a, b in prefs
                 if (block_q is None or a == block_q) and (block_kv is None or b == block_kv)]
        chosen = "default" if block_q is None and block_kv is None else "mixed"
    fitting = [ab for ab in pairs if _fits(t, *ab, d, dv, acc, lim)]
    # occupancy floor first: defaults take a plan below it only when no other fits
    fitting.sort(key=lambda ab: not _occupancy_ok(t, *ab, d, dv, acc, limit))
    if fitting and not _occupancy_ok(t, *fitting[0], d, dv, acc, limit) and chosen != "default":
        _refuse_low_occupancy(t, kernel, fitting[0], d, dv, acc, dtname, limit, lim_text)
    if fitting:
        bq, bkv = fitting[0]
        return TilePlan(kernel=kernel, block_q=bq, block_kv=bkv, d=d, dv=dv, dtype=dtname,
                        acc_bytes=acc, threads=t.threads(bq, bkv, d, dv),
                        shared_bytes=t.shared_bytes(bq, bkv, d, dv, acc),
                        limit=int(limit) if limit is not None else -1,
                        limit_source=limit_source, chosen=chosen)
    # nothing fits: say why, with the budget and what would fit
    bq, bkv = pairs[0]
    why = _why_not(t, bq, bkv, d, dv, acc)
    need = t.shared_bytes(bq, bkv, d, dv, acc)
    fitting = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
               if _fits(t, a, b, d, dv, acc, lim)]
    fit_text = (", ".join(f"({a}, {b})" for a, b in fitting) if fitting
                else "none at this head dim and dtype")
    reason = why if why else (f"needs {need} B of shared memory "
                              f"({t.layout(bq, bkv, d, dv, acc)}) but the budget is {lim_text}")
    raise ValueError(f"{kernel} with block_q={bq}, block_kv={bkv}, d={d}, dv={dv}, {dtname}: "
                     f"{reason}. Supported block_q: {list(t.block_q_choices)}, block_kv: "
                     f"{list(t.block_kv_choices)}; (block_q, block_kv) pairs that fit: {fit_text}")


def _refuse_low_occupancy(t, kernel, pair, d, dv, acc, dtname, limit, lim_text):
    """Raise for explicit tiles below the occupancy floor where another pair is above it."""
    good = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
            if _fits(t, a, b, d, dv, acc, limit if limit is not None else float('inf')) and _occupancy_ok(t, a, b, d, dv, acc, limit)]
    if not good:
        return  # every plan of this head dim is below the floor: allowed
    bq, bkv = pair
    threads, shared = t.threads(bq, bkv, d, dv), t.shared_bytes(bq, bkv, d, dv, acc)
    w = resident_warps(threads, shared, limit)
    raise ValueError(
        f"{kernel} with block_q={bq}, block_kv={bkv}, d={d}, dv={dv}, {dtname}: {threads} threads "
        f"and {shared} B of shared memory per block leave {w} resident warp(s) per SM (shared "
        f"memory {lim_text}); below {MIN_RESIDENT_WARPS} the SM's warp schedulers idle and such "
        f"plans ran up to 9x slower than the default on an H100. (block_q, block_kv) pairs with "
        f">= {MIN_RESIDENT_WARPS} warps per SM: " + ", ".join(f"({a}, {b})" for a, b in good))


def defaults_table(kernel, dtypes=("float16", "float32", "float64"), head_dims=(16, 32, 64, 96, 128, 256),
                   limit=None, limit_source="unlimited"):
    """Rows (dtype, d, kernel, block_q, block_kv, threads, shared_bytes) of the default plans."""
    rows = []
    for dt in dtypes:
        for d in head_dims:
            if kernel == "flash_fwd":  # the forward picks its kernel per dtype and d
                p = plan_flash_fwd(d, d, dt, limit=limit, limit_source=limit_source)
            else:
                p = plan(kernel, d, d, dt, limit=limit, limit_source=limit_source)
            rows.append((dt, d, p.kernel, p.block_q, p.block_kv, p.threads, p.shared_bytes))
    return rows


# --------------------------------------------------------------------------
# flash_fwd (kernels_cu/flash_fwd.cu)
# --------------------------------------------------------------------------
# Layout (accumulator type acc = float, or double for float64):
#   Qs (block_q, d+1), Ks (block_kv, d+1), Vs (block_kv, dv), Ps (block_q, block_kv+1)
# The +1 pads make the rows that the 8 row-groups of a warp read at the same
# column fall into different banks.  Each warp owns 8 query rows; each row is
# split over the 4 lanes of a quad, so block_q = 8 * warps and block_kv must be
# a multiple of 4.
def _fwd_shared(bq, bkv, d, dv, acc):
    return acc * (bq * (d + 1) + bkv * (d + 1) + bkv * dv + bq * (bkv + 1))


def _fwd_layout(bq, bkv, d, dv, acc):
    t = "double" if acc == 8 else "float"
    return (f"{t} Qs[{bq}][{d + 1}] + Ks[{bkv}][{d + 1}] + Vs[{bkv}][{dv}] + "
            f"Ps[{bq}][{bkv + 1}]")


def _fwd_threads(bq, bkv, d, dv):
    return 4 * bq  # block_q / 8 warps of 32 lanes


def _fwd_check(bq, bkv, d, dv):
    # registers per thread: block_kv/4 logits + ceil(dv/4) output accumulators
    if bkv // 4 + (dv + 3) // 4 > 96:
        return (f"block_kv={bkv} with dv={dv} needs {bkv // 4 + (dv + 3) // 4} accumulator "
                "registers per thread (limit 96, to avoid spills)")
    return None


def _fwd_preferences(d, dv, acc):
    dm = max(d, dv)
    if dm <= 32:
        prefs = [(64, 64), (64, 32), (32, 32)]
    elif dm <= 64:
        prefs = [(64, 32), (32, 32), (32, 16)]
    elif dm <= 128:
        prefs = [(32, 32), (32, 16), (16, 16)]
    else:
        prefs = [(16, 32), (16, 16), (8, 16), (8, 8)]
    return prefs


register(KernelTiling(
    name="flash_fwd",
    block_q_choices=(8, 16, 32, 64, 128),
    block_kv_choices=(8, 16, 32, 64, 128),
    shared_bytes=_fwd_shared,
    threads=_fwd_threads,
    preferences=_fwd_preferences,
    layout=_fwd_layout,
    check=_fwd_check,
))


def flash_fwd_traffic(batch, heads, Nq, Nk, d, dv, dtype, block_q, block_kv, causal=None):
    """Exact global-memory bytes (read, written) of flash_fwd for one launch.

    Per query head and Q tile: the Q tile once; K and V rows of every KV tile
    the tile loads (tiles entirely above the causal boundary are never loaded;
    the last tile loads only the rows < Nk); O and lse once.  This is what the
    emulator's byte counters report for the kernel.
    """
    isz = 2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize
    lse_sz = accumulator_bytes(dtype)
    n_tiles = -(-Nq // block_q) if Nq else 0
    kv_rows = 0
    for i in range(n_tiles):
        q0 = i * block_q
        rows = min(block_q, Nq - q0)
        if causal is None:
            end = Nk
        else:
            off = Nk - Nq if causal == "bottom_right" else 0
            end = min(max(q0 + rows - 1 + off + 1, 0), Nk)
        n_kv = -(-end // block_kv)
        kv_rows += min(n_kv * block_kv, Nk)
    bh = batch * heads
    read = bh * (Nq * d * isz + kv_rows * (d + dv) * isz)
    written = bh * (Nq * dv * isz + Nq * lse_sz)
    return read, written


# --------------------------------------------------------------------------
# flash_fwd_tc / flash_fwd_tf32 (kernels_cu/flash_fwd_tc.cu): the forward on tensor cores
# --------------------------------------------------------------------------
# float16/bfloat16 run flash_fwd_tc (mma.m16n8k16), float32 flash_fwd_tf32 (3xTF32
# mma.m16n8k8).  Each warp owns 32 query rows (two m16 tiles: every K/V fragment read from
# shared memory feeds two MMAs) when d, dv <= 128 and its accumulators fit the register
# budget, else 16 (more warps for the same block_q): threads = 32 * block_q / rows_per_warp.
# Accumulators per thread: rows_per_warp * (block_kv + dv) / 32 (S and O); above
# TC_MAX_ACC_REGS ptxas spills to local memory (registers are capped at 255), which the H100
# tile sweep showed as 10-270x slowdowns.  bench/plan_sweep.py compiles every plan the
# planner accepts and checks that none spills; tests/test_tc_plans.py the largest ones.
# Layout: Qs (block_q, qs), Ks 2 x (block_kv, ks), Vs 2 x (block_kv, vs) -- K/V in two cp.async
# stages.  16-bit: qs = ks = d + 8, vs = dv + 8 (16-byte pads: the 8 rows of an ldmatrix hit
# different banks); float32: qs = ks = d + 16 if d % 32 == 0 else d (a stride of 16 mod 32
# floats for the 128-bit fragment loads), vs = dv + 4 (4 mod 16 for the 64-bit loads).
TC_DTYPES = ("float16", "bfloat16")
TF32_DTYPES = ("float32",)
TC_KERNELS = ("flash_fwd_tc", "flash_fwd_tf32")
# Accumulator budgets (registers per thread for S and O): with 32 rows per warp, and with 16.
# 32 rows take at most 64 keys per tile (S of 32 x 128 spilled even at d = 16); the 3xTF32
# kernel keeps hi and lo fragments besides, so it gets less (measured with NVRTC 13 for
# sm_80 over every plan: bench/plan_sweep.py).
TC_MAX_ACC_REGS = {"flash_fwd_tc": 160, "flash_fwd_tf32": 144}
TC_MAX_ACC_REGS_32_ROWS = {"flash_fwd_tc": 160, "flash_fwd_tf32": 144}
TC_MAX_BLOCK_KV_32_ROWS = {"flash_fwd_tc": 64, "flash_fwd_tf32": 64}


def tc_rows_per_warp(kernel, bq, bkv, d, dv):
    """Query rows per warp of a tensor-core forward plan: 32 when they fit, else 16."""
    if (bq >= 32 and max(d, dv) <= 128 and bkv <= TC_MAX_BLOCK_KV_32_ROWS[kernel]
            and bkv + dv <= TC_MAX_ACC_REGS_32_ROWS[kernel]):
        return 32
    return 16


def tc_acc_regs(kernel, bq, bkv, d, dv):
    """Accumulator registers per thread (S and O) of a tensor-core forward plan."""
    return tc_rows_per_warp(kernel, bq, bkv, d, dv) * (bkv + dv) // 32


def _tc_threads(kernel):
    def threads(bq, bkv, d, dv):
        return 32 * (bq // tc_rows_per_warp(kernel, bq, bkv, d, dv))
    return threads


def tc_strides(kernel, d, dv):
    if kernel == "flash_fwd_tf32":
        return d + (16 if d % 32 == 0 else 0), d + (16 if d % 32 == 0 else 0), dv + 4, 4
    return d + 8, d + 8, dv + 8, 2


def _tc_shared(kernel):
    def shared(bq, bkv, d, dv, acc):
        qs, ks, vs, esz = tc_strides(kernel, d, dv)
        return esz * (bq * qs + 2 * bkv * ks + 2 * bkv * vs)
    return shared


def _tc_layout(kernel):
    def layout(bq, bkv, d, dv, acc):
        qs, ks, vs, esz = tc_strides(kernel, d, dv)
        t = "float" if esz == 4 else "16-bit"
        return f"{t} Qs[{bq}][{qs}] + Ks[2][{bkv}][{ks}] + Vs[2][{bkv}][{vs}]"
    return layout


def _tc_check(kernel):
    def check(bq, bkv, d, dv):
        if d % 16 or dv % 16:
            return f"{kernel} needs d and dv multiples of 16, got d={d}, dv={dv}"
        if max(d, dv) > 256:
            return f"{kernel} supports d, dv <= 256, got d={d}, dv={dv}"
        n = tc_acc_regs(kernel, bq, bkv, d, dv)
        if n > TC_MAX_ACC_REGS[kernel]:
            return (f"block_kv={bkv} with dv={dv} needs {n} accumulator registers per thread in "
                    f"{kernel} even with 16 query rows per warp (limit {TC_MAX_ACC_REGS[kernel]}: "
                    "more would spill to local memory)")
        return None
    return check


def _tc_preferences(kernel):
    # best first: 4 warps of 32 rows where the budget allows it (every K/V fragment feeds two
    # MMAs), the longest K/V tile those 32 rows can hold; above d = 128, 4 warps of 16 rows
    def prefs(d, dv, acc):
        dm = max(d, dv)
        if kernel == "flash_fwd_tf32":
            if dm <= 96:
                return [(128, 32), (64, 32), (128, 16), (32, 32), (16, 16)]
            if dm <= 128:
                return [(128, 16), (64, 16), (32, 16), (16, 16)]
            return [(64, 16), (32, 16), (16, 16)]
        if dm <= 96:
            return [(128, 64), (128, 32), (64, 64), (64, 32), (32, 32), (16, 16)]
        if dm <= 128:
            return [(128, 32), (64, 32), (128, 16), (32, 32), (16, 16)]
        return [(64, 32), (64, 16), (32, 16), (16, 16)]
    return prefs


for _k in TC_KERNELS:
    register(KernelTiling(
        name=_k,
        block_q_choices=(16, 32, 64, 128),
        block_kv_choices=(16, 32, 64, 128),
        shared_bytes=_tc_shared(_k),
        threads=_tc_threads(_k),
        preferences=_tc_preferences(_k),
        layout=_tc_layout(_k),
        check=_tc_check(_k),
    ))


def tc_kernel_for(dtype):
    """The tensor-core forward kernel of a dtype name, or None (float64)."""
    name = _dtype_name(dtype)
    if name in TC_DTYPES:
        return "flash_fwd_tc"
    if name in TF32_DTYPES:
        return "flash_fwd_tf32"
    return None


def plan_flash_fwd(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                   limit_source="unlimited", kernel=None):
    """The forward's plan: which kernel (tensor cores or the SIMT flash_fwd) with which tiles.

    float16/bfloat16 run on tensor cores (flash_fwd_tc), float32 as 3xTF32 on tensor cores
    (flash_fwd_tf32, float32 accuracy), when the head dims and any explicit tile sizes are
    ones that kernel supports and its tiles fit the limit; everything else (float64, head
    dims that are not multiples of 16, tiles it lacks) runs the SIMT kernel flash_fwd, which
    takes every dtype, head dims up to 256 and tiles of multiples of 8/4.  Explicit sizes
    are honoured by whichever kernel runs, or refused by flash_fwd's rules.  ``kernel``
    forces one kernel ("flash_fwd", "flash_fwd_tc", "flash_fwd_tf32"; tests use it).
    """
    tc_name = tc_kernel_for(dtype)
    if kernel is None:
        if tc_name is not None:
            tc = kernel_tiling(tc_name)
            if ((block_q is None or block_q in tc.block_q_choices)
                    and (block_kv is None or block_kv in tc.block_kv_choices)
                    and tc.check(block_q or 16, block_kv or 16, d, dv) is None):
                try:
                    return plan(tc_name, d, dv, dtype, block_q, block_kv, limit=limit,
                                limit_source=limit_source)
                except ValueError as e:
                    _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit,
                                             limit_source, str(e))
            else:
                _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit,
                                         limit_source, None)
        kernel = "flash_fwd"
    if kernel in TC_KERNELS and kernel != tc_name:
        want = TC_DTYPES if kernel == "flash_fwd_tc" else TF32_DTYPES
        raise ValueError(f"{kernel} runs {want} only, got {_dtype_name(dtype)}")
    return plan(kernel, d, dv, dtype, block_q, block_kv, limit=limit, limit_source=limit_source)


def _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit, limit_source, why):
    """Explicit tiles the tensor-core kernel does not take, for head dims it does: refused.

    Without this they would run on the SIMT kernel -- the "tile sweep" cliff of the H100
    baseline (float16 d=128, block_kv=128: 58-385 ms against the default's 3.3 ms).  Returns
    (the SIMT kernel may run) when the tiles are not explicit or the tensor-core kernel
    lacks these head dims at every tile size.
    """
    if block_q is None and block_kv is None:
        return
    t = kernel_tiling(tc_name)
    acc = accumulator_bytes(dtype)
    lim = float("inf") if limit is None else int(limit)
    good = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
            if (block_q is None or a == block_q) and (block_kv is None or b == block_kv)
            and _fits(t, a, b, d, dv, acc, lim) and _occupancy_ok(t, a, b, d, dv, acc, limit)]
    every = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
             if _fits(t, a, b, d, dv, acc, lim) and _occupancy_ok(t, a, b, d, dv, acc, limit)]
    if not every:
        return  # no tensor-core plan at these head dims: the SIMT kernel is the only one
    if why is not None:  # plan()'s refusal: its reason, without the kernel and pair lists
        why = why.split(": ", 1)[-1].split(". Supported")[0].split(". (block_q")[0]
    else:
        bq, bkv = block_q or 16, block_kv or 16
        why = (t.check(bq, bkv, d, dv) or
               f"supported block_q: {list(t.block_q_choices)}, block_kv: "
               f"{list(t.block_kv_choices)}")
    asked = ", ".join(f"{n}={v}" for n, v in (("block_q", block_q), ("block_kv", block_kv))
                      if v is not None)
    raise ValueError(
        f"{asked} with d={d}, dv={dv}, {_dtype_name(dtype)}: the tensor-core kernel {tc_name} "
        f"does not take these tiles ({why}), and running them on the SIMT kernel instead would "
        f"be several times slower, so they are refused. (block_q, block_kv) pairs "
        f"{tc_name} takes here: " + ", ".join(f"({a}, {b})" for a, b in (good or every))
        + f" (shared memory {lim if limit is not None else 'no limit'} B, {limit_source})")


# --------------------------------------------------------------------------
# online_softmax_rows (kernels_cu/online_softmax.cu): one warp per row, no shared memory
# --------------------------------------------------------------------------
ONLINE_SOFTMAX_ROWS_PER_BLOCK = 4
ONLINE_SOFTMAX_DEFAULT_CHUNK = 256

register(KernelTiling(
    name="online_softmax_rows",
    block_q_choices=(ONLINE_SOFTMAX_ROWS_PER_BLOCK,),
    block_kv_choices=(ONLINE_SOFTMAX_DEFAULT_CHUNK,),
    shared_bytes=lambda bq, bkv, d, dv, acc: 0,
    threads=lambda bq, bkv, d, dv: 32 * ONLINE_SOFTMAX_ROWS_PER_BLOCK,
    preferences=lambda d, dv, acc: [(ONLINE_SOFTMAX_ROWS_PER_BLOCK, ONLINE_SOFTMAX_DEFAULT_CHUNK)],
    layout=lambda bq, bkv, d, dv, acc: "no shared memory",
    max_head_dim=1,
))

# ==========================================================================
# BACKWARD KERNELS (owned by KERNELS-BWD): register flash_bwd_preprocess,
# flash_bwd_dkdv, flash_bwd_dq here with register(KernelTiling(...)).
# ==========================================================================
# kernels_cu/flash_bwd.cu.  All backward kernels run BWD_THREADS threads; each
# thread owns the tile elements tid, tid + 128, ... of every product, so the
# tiles are free of warp-shape constraints (any of BWD_TILE_CHOICES).
# Layout (accumulator type acc = float, or double for float64); rows padded by
# one element so that a warp reading one K/V column per lane hits distinct banks:
#   flash_bwd_dkdv: K_s (Bc, d+1), V_s (Bc, dv+1), Q_s (Br, d+1), dO_s (Br, dv+1),
#                   P_s (Br, Bc), dS_s (Br, Bc), lse_s (Br), D_s (Br)
#   flash_bwd_dq:   the same without P_s
# Register accumulators per thread: dkdv ceil(Bc*d/128) + ceil(Bc*dv/128) (dK, dV),
# dq ceil(Br*d/128) (dQ); BWD_MAX_ACC caps them (ptxas: no spills at the cap,
# 126 registers for float32, 221 for float64 at d=256, Bc=16, sm_80).
BWD_THREADS = 128
BWD_TILE_CHOICES = (8, 16, 32, 64, 128)
BWD_MAX_ACC = 64
BWD_PRE_ROWS = 32  # rows per flash_bwd_preprocess chunk (PRE_ROWS in flash_bwd.cu)


def _per_thread(n):
    return -(-n // BWD_THREADS)


def _bwd_dkdv_shared(bq, bkv, d, dv, acc):
    return acc * (bkv * (d + 1) + bkv * (dv + 1) + bq * (d + 1) + bq * (dv + 1)
                  + 2 * bq * bkv + 2 * bq)


def _bwd_dq_shared(bq, bkv, d, dv, acc):
    return acc * (bq * (d + 1) + bq * (dv + 1) + bkv * (d + 1) + bkv * (dv + 1)
                  + bq * bkv + 2 * bq)


def _bwd_layout(with_p):
    def layout(bq, bkv, d, dv, acc):
        t = "double" if acc == 8 else "float"
        p = f"P_s[{bq}][{bkv}] + " if with_p else ""
        return (f"{t} K_s[{bkv}][{d + 1}] + V_s[{bkv}][{dv + 1}] + Q_s[{bq}][{d + 1}] + "
                f"dO_s[{bq}][{dv + 1}] + {p}dS_s[{bq}][{bkv}] + lse_s[{bq}] + D_s[{bq}]")
    return layout


def _bwd_dkdv_check(bq, bkv, d, dv):
    n = _per_thread(bkv * d) + _per_thread(bkv * dv)
    if n > BWD_MAX_ACC:
        return (f"block_kv={bkv} with d={d}, dv={dv} needs {n} dK/dV accumulator registers "
                f"per thread (limit {BWD_MAX_ACC}, to avoid spills)")
    return _bwd_dq_check(bq, bkv, d, dv)  # the same tiles also launch flash_bwd_dq


def _bwd_dq_check(bq, bkv, d, dv):
    n = _per_thread(bq * d)
    if n > BWD_MAX_ACC:
        return (f"block_q={bq} with d={d} needs {n} dQ accumulator registers per thread "
                f"(limit {BWD_MAX_ACC}, to avoid spills)")
    return None


# float64: a double accumulator is two registers, and flash_bwd_dq keeps more beside its dQ
# row than flash_bwd_dkdv does.  The plan sweep (bench/plan_sweep.py, NVRTC 13.0) compiled
# every float64 dQ plan: all 13 with 64 doubles per thread spilled 176-248 B (255 registers;
# d=64 128 x 8/16, d=128 64 x 8/16/32, d=256 32 x 8/16, on sm_80 and/or sm_90), every one
# with 48 or fewer did not (at most 253 registers).  dK/dV at 64 doubles did not spill.
BWD_MAX_DQ_ACC_FLOAT64 = 48


def _bwd_dq_acc_check(bq, bkv, d, dv, acc):
    n = _per_thread(bq * d)
    if acc == 8 and n > BWD_MAX_DQ_ACC_FLOAT64:
        return (f"block_q={bq} with d={d} needs {n} float64 dQ accumulators per thread in "
                f"flash_bwd_dq (limit {BWD_MAX_DQ_ACC_FLOAT64} doubles: ptxas spills 64)")
    return None


def _bwd_preferences(d, dv, acc):
    # best first; plan() takes the first that fits the device (all of these fit an
    # sm_80's 163 KB in float32; the last of each list fits 48 KB without opt-in)
    dm = max(d, dv)
    if dm <= 32:
        return [(64, 64), (32, 64), (32, 32)]
    if dm <= 64:
        return [(64, 64), (32, 64), (32, 32), (16, 32)]
    if dm <= 128:
        return [(32, 32), (16, 32), (16, 16)]
    return [(16, 16), (8, 16), (8, 8)]


register(KernelTiling(
    name="flash_bwd_dkdv",
    block_q_choices=BWD_TILE_CHOICES,
    block_kv_choices=BWD_TILE_CHOICES,
    shared_bytes=_bwd_dkdv_shared,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    preferences=_bwd_preferences,
    layout=_bwd_layout(True),
    check=_bwd_dkdv_check,
    check_acc=_bwd_dq_acc_check,  # the same tiles also launch flash_bwd_dq
))

register(KernelTiling(
    name="flash_bwd_dq",
    block_q_choices=BWD_TILE_CHOICES,
    block_kv_choices=BWD_TILE_CHOICES,
    shared_bytes=_bwd_dq_shared,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    preferences=_bwd_preferences,
    layout=_bwd_layout(False),
    check=_bwd_dq_check,
    check_acc=_bwd_dq_acc_check,
))

# D = rowsum(dO * O) in chunks of BWD_PRE_ROWS rows: one partial sum per (row, lane)
# meets in red_s (BWD_PRE_ROWS, 33); block_q here is the chunk (PRE_ROWS in flash_bwd.cu)
register(KernelTiling(
    name="flash_bwd_preprocess",
    block_q_choices=(BWD_PRE_ROWS,),
    block_kv_choices=(BWD_PRE_ROWS,),
    shared_bytes=lambda bq, bkv, d, dv, acc: acc * bq * 33,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    preferences=lambda d, dv, acc: [(BWD_PRE_ROWS, BWD_PRE_ROWS)],
    layout=lambda bq, bkv, d, dv, acc: f"{'double' if acc == 8 else 'float'} red_s[{bq}][33]",
))


def flash_bwd_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, dtype, block_q, block_kv,
                      causal=None, deterministic=True):
    """Modelled global-memory bytes (read, written) of one backward call's kernels.

    ``batch * heads`` query problems, ``batch * kv_heads`` key/value problems
    (``heads // kv_heads`` query heads per kv head).  Counts what flash_bwd.cu
    loads and stores: preprocess reads O and dO once and writes D (and zeroes
    the float32 dQ accumulator on the atomic path); dkdv reads each K/V tile
    once and Q, dO, lse, D of every Q tile that can see it (per query head of
    the group), writes dK, dV once, and on the atomic path adds into dQ
    (4 bytes read + 4 written per element per visible (Q tile, KV tile) pair);
    dq reads Q, dO, lse, D once and K, V of every KV tile its Q tile can see.
    """
    isz = np.dtype(dtype).itemsize
    acc = accumulator_bytes(dtype)
    off = (Nk - Nq) if causal == "bottom_right" else 0
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    # preprocess
    read = bh * Nq * 2 * dv * isz
    written = bh * Nq * acc + (0 if deterministic else bh * Nq * d * 4)
    # dkdv: per KV tile, the Q rows of the Q tiles from the first visible one on
    q_rows = 0
    pairs_rows = 0  # sum over (visible Q tile, KV tile) of the Q tile's rows (atomic dQ)
    for j in range(nk_t):
        kv0 = j * block_kv
        it0 = 0
        if causal is not None:
            i_min = kv0 - off
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        rows = max(Nq - it0 * block_q, 0)
        q_rows += rows
        pairs_rows += rows
    read += bhk * Nk * (d + dv) * isz + bhk * group * q_rows * ((d + dv) * isz + 2 * acc)
    written += bhk * Nk * (d + dv) * isz
    if not deterministic:
        read += bh * pairs_rows * d * 4
        written += bh * pairs_rows * d * 4
        # flash_bwd_dq_convert
        read += bh * Nq * d * 4
        written += bh * Nq * d * isz
    else:
        kv_rows = 0
        for i in range(nq_t):
            q0 = i * block_q
            rows = min(block_q, Nq - q0)
            end = Nk if causal is None else min(max(q0 + rows + off, 0), Nk)
            kv_rows += min(-(-end // block_kv) * block_kv, Nk)
        read += bh * (Nq * ((d + dv) * isz + 2 * acc) + kv_rows * (d + dv) * isz)
        written += bh * Nq * d * isz
    return read, written


# ==========================================================================
# flash_bwd_tf32 (kernels_cu/flash_bwd_tf32.cu): the float32 backward's dK/dV/dQ kernel on
# tensor cores (3xTF32), in place of flash_bwd_dkdv on the atomic-dQ path
# ==========================================================================
# Each warp owns 16 keys: block_kv = 16 * warps, threads = 2 * block_kv.  Layout (float):
# Ks (block_kv, ks), Vs (block_kv, vs), Qs 2 x (block_q, qs), dOs 2 x (block_q, os),
# lse2 2 x block_q, D 2 x block_q, dS^T (block_kv, ts); strides: ks = qs = os = 20 mod 32 (tiles
# read as rows g and as rows 2t), vs = 16 mod 32, ts = 4 mod 32 (flash_bwd_tf32.cu says why).
# Registers per thread: dK and dV of 16 keys ((d + dv) / 2) and S^T, dP^T of block_q queries
# (block_q); BWD_TF32_MAX_ACC_REGS caps their sum (spill-free, tests/test_tc_plans.py).
BWD_TF32_MAX_ACC_REGS = 144


def _pad32(n, r):
    return n + ((r - n % 32) % 32 + 32) % 32


def bwd_tf32_strides(bq, d, dv):
    """(ks, vs, qs, os, ts): the row strides (floats) of flash_bwd_tf32's shared tiles."""
    return _pad32(d, 20), _pad32(dv, 16), _pad32(d, 20), _pad32(dv, 20), _pad32(bq, 4)


def _bwd_tf32_shared(bq, bkv, d, dv, acc):
    ks, vs, qs, os_, ts = bwd_tf32_strides(bq, d, dv)
    return 4 * (bkv * ks + bkv * vs + 2 * bq * qs + 2 * bq * os_ + 4 * bq + bkv * ts)


def _bwd_tf32_layout(bq, bkv, d, dv, acc):
    ks, vs, qs, os_, ts = bwd_tf32_strides(bq, d, dv)
    return (f"float Ks[{bkv}][{ks}] + Vs[{bkv}][{vs}] + Qs[2][{bq}][{qs}] + dOs[2][{bq}][{os_}] "
            f"+ lse2[2][{bq}] + D[2][{bq}] + dST[{bkv}][{ts}]")


def _bwd_tf32_check(bq, bkv, d, dv):
    if d % 32 or dv % 32 or max(d, dv) > 128:
        return f"flash_bwd_tf32 needs d, dv multiples of 32 up to 128, got d={d}, dv={dv}"
    n = (d + dv) // 2 + bq
    if n > BWD_TF32_MAX_ACC_REGS:
        return (f"block_q={bq} with d={d}, dv={dv} needs {n} accumulator registers per thread in "
                f"flash_bwd_tf32 (limit {BWD_TF32_MAX_ACC_REGS}: more would spill)")
    return None


def _bwd_tf32_preferences(d, dv, acc):
    if max(d, dv) <= 64:
        return [(64, 64), (32, 64), (64, 32), (32, 32), (16, 32)]
    return [(32, 64), (16, 64), (32, 32), (16, 32)]


register(KernelTiling(
    name="flash_bwd_tf32",
    block_q_choices=(16, 32, 64),
    block_kv_choices=(32, 64, 128),
    shared_bytes=_bwd_tf32_shared,
    threads=lambda bq, bkv, d, dv: 2 * bkv,
    preferences=_bwd_tf32_preferences,
    layout=_bwd_tf32_layout,
    check=_bwd_tf32_check,
))


def plan_bwd_tf32(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                  limit_source="unlimited"):
    """flash_bwd_tf32's plan for a float32 backward, or None where it does not apply.

    None for other dtypes, head dims it lacks, explicit tiles outside its choices or tiles that
    do not fit: the SIMT kernels of flash_bwd.cu run those.
    """
    if _dtype_name(dtype) not in TF32_DTYPES:
        return None
    t = kernel_tiling("flash_bwd_tf32")
    if ((block_q is not None and block_q not in t.block_q_choices)
            or (block_kv is not None and block_kv not in t.block_kv_choices)
            or t.check(block_q or 16, block_kv or 32, d, dv) is not None):
        return None
    try:
        return plan("flash_bwd_tf32", d, dv, dtype, block_q, block_kv, limit=limit,
                    limit_source=limit_source)
    except ValueError:
        return None
# --------------------------------------------------------------------------
# the serving forward (flash_fwd.cu, -DCUFLASH_FWD_SERVING): split-KV traffic
# --------------------------------------------------------------------------
def flash_fwd_split_traffic(problems, rows, q_period, Nk, d, dv, dtype, block_q, block_kv,
                            causal, num_splits):
    """Exact global bytes (read, written) of a split-KV forward on dense K/V: both kernels.

    ``problems`` thread-block problems (batch x heads, or batch x kv heads when a
    GQA group's rows are packed) of ``rows`` query rows each (row r is query
    position ``r % q_period``).  ``flash_fwd_serving``: every (query tile,
    split) block reads its Q tile and the K/V rows of its share of the tiles
    the tile can see (``ceil(n_kv / num_splits)`` tiles per split; a split with
    none still writes its rows), and writes partial outputs and lse in the
    compute type (float32; double for float64); ``flash_fwd_combine`` reads
    every partial once and writes o and lse.
    This is what the emulator's byte counters report (tests hold it so).
    """
    isz = 2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize
    lse_sz = accumulator_bytes(dtype)
    n_kv_all = -(-Nk // block_kv) if Nk else 0
    per = max(1, -(-n_kv_all // num_splits)) if n_kv_all else 1
    offset = 0 if causal in (None, "top_left") else Nk - q_period
    read = written = 0
    for t in range(-(-rows // block_q) if rows else 0):
        q0 = t * block_q
        r = min(block_q, rows - q0)
        kv_end = Nk
        if causal is not None:
            first = q0 % q_period
            i_max = q_period - 1 if (r >= q_period or first + r > q_period) else first + r - 1
            kv_end = min(max(i_max + offset + 1, 0), Nk)
        n_kv = -(-kv_end // block_kv)
        for s in range(num_splits):
            lo = min(s * per, n_kv)
            hi = min(lo + per, n_kv) if num_splits > 1 else n_kv
            keys = max(0, min(hi * block_kv, Nk) - lo * block_kv) if hi > lo else 0
            read += r * d * isz + keys * (d + dv) * isz
            written += (r * dv + r) * lse_sz if num_splits > 1 else r * dv * isz + r * lse_sz
    read, written = problems * read, problems * written
    if num_splits > 1:
        R = problems * rows
        read += num_splits * R * (dv + 1) * lse_sz
        written += R * (dv * isz + lse_sz)
    return read, written


# --------------------------------------------------------------------------
# flash_bwd_tc (kernels_cu/flash_bwd_tc.cu): float16/bfloat16 backward on tensor cores
# --------------------------------------------------------------------------
# A key group of 16 * mt keys belongs to qs warps (query split qs = 1 or 2; block_kv =
# 16 * mt * warps / qs); each of them computes S^T, dP^T for its keys and block_q / qs of
# the queries -- dP^T (mt * block_q / qs / 2 floats per lane) beside P^T packed in 16-bit
# (half that) -- and accumulates dK, dV for its keys and 1 / qs of the columns (mt * (d + dv)
# / 2 / qs floats per lane, halved again per pass when the head dims run in two passes).
# With qs = 2, P^T and dS^T meet in shared memory (Ps).  Layout (16-bit, rows padded by 8
# elements; float32 at the end):
#   Ks (Bc, d+8), Vs (Bc, dv+8), Qs 2 x (Br, d+8), dOs 2 x (Br, dv+8), dSs (Bc, Br+8),
#   [Ps (Bc, Br+8) when qs = 2], lse2_s 2 x Br, D_s 2 x Br
# Registers: ptxas needs ~65-80 registers beside these arrays (fragments, addresses, loop
# state; sm_80/sm_90, NVRTC 13.0): 252-254 registers and no spill at 176 (d = dv = 128,
# block_q = 64: 128 + 48; d = dv = 64, 32 keys per warp, block_q = 32: 128 + 48), while
# 192 spilled (d = 96, dv = 32, 32 keys per warp, block_q = 32, with P kept in float32), and
# two passes need ~24 more (on sm_80 d = dv = 256, block_q = 64: 128 + 48 spilled 12 bytes,
# d = 256, dv = 176, block_q = 64, 4 warps: 112 + 48 spilled 4; 152 compiled clean).  So
# plans are held to BWD_TC_ARRAY_BUDGET (one pass) and _TWO_PASSES;
# tests/test_kernels_backward.py compiles plans at the edge of both with NVRTC and asserts
# no spills.
BWD_TC_TILE_CHOICES = (16, 32, 64, 128)
BWD_TC_ARRAY_BUDGET = 176
BWD_TC_ARRAY_BUDGET_TWO_PASSES = 152
BWD_TC_PRE_THREADS = 128   # kPreThreads in flash_bwd_tc.cu
BWD_TC_CONVERT_THREADS = 256  # kConvThreads


def _bwd_tc_arrays(bq, d, dv, mt, passes, qs=1):
    """Register array floats per lane: dK/dV (8 per 16-column chunk and 16 keys) + dP^T + P^T."""
    slices = passes * qs
    chunks = -(-(d // 16) // slices) + -(-(dv // 16) // slices)
    return mt * 8 * chunks + mt * (bq // qs // 2 + bq // qs // 4)


def _bwd_tc_budget(passes):
    return BWD_TC_ARRAY_BUDGET if passes == 1 else BWD_TC_ARRAY_BUDGET_TWO_PASSES


# (block_q, block_kv, d, dv) of flash_bwd_tc that ptxas (NVRTC 13.0) compiles with spills
# for sm_90 although the register-array model above accepts them: 255 registers and 8-16 B
# of spill traffic in the two-pass layout, where the neighbouring head dims with as many
# array floats (d = 192 at 64 x 64, d = 224 at 32 x 32 / 32 x 128) do not spill.  Found by
# bench/plan_sweep.py (issue 12); refused so that no accepted plan spills.
BWD_TC_PTXAS_SPILLS = frozenset({(64, 64, 176, 176), (64, 128, 176, 176), (32, 64, 224, 224)})


def bwd_tc_layout(bq, bkv, d, dv):
    """``(warps, keys per warp // 16, passes, query split)`` of flash_bwd_tc, or a str saying why not.

    In order of preference: 32 keys per warp (mt = 2; half the Q/dO fragment reads per key
    of 16) when its register arrays fit and the tile has at least 64 keys; else 32 keys
    per pair of warps with the queries and the dK/dV columns split between the two (qs =
    2: the same per-warp reads as mt = 2 for twice the head dims, P^T and dS^T through
    shared memory); else 16 keys per warp, in two passes over the head dims when one pass's
    arrays do not fit the register budget.
    """
    if d % 16 or dv % 16 or not (16 <= d <= MAX_HEAD_DIM and 16 <= dv <= MAX_HEAD_DIM):
        return f"flash_bwd_tc needs d and dv multiples of 16 up to {MAX_HEAD_DIM}, got d={d}, dv={dv}"
    if bq not in BWD_TC_TILE_CHOICES or bkv not in BWD_TC_TILE_CHOICES:
        return f"flash_bwd_tc takes block_q, block_kv in {list(BWD_TC_TILE_CHOICES)}"
    if (bq, bkv, d, dv) in BWD_TC_PTXAS_SPILLS:
        return (f"block_q={bq}, block_kv={bkv} with d={d}, dv={dv}: ptxas spills this plan on "
                "sm_90 (bench/plan_sweep.py) although its register arrays fit the budget")
    if bkv >= 64 and _bwd_tc_arrays(bq, d, dv, 2, 1) <= _bwd_tc_budget(1):
        return bkv // 32, 2, 1, 1
    if bkv >= 32 and bq % 32 == 0 and _bwd_tc_arrays(bq, d, dv, 2, 1, 2) <= _bwd_tc_budget(1):
        return bkv // 16, 2, 1, 2
    for passes in (1, 2):
        if _bwd_tc_arrays(bq, d, dv, 1, passes) <= _bwd_tc_budget(passes):
            return bkv // 16, 1, passes, 1
    need = _bwd_tc_arrays(bq, d, dv, 1, 2)
    return (f"block_q={bq} with d={d}, dv={dv} needs {need} register floats per thread for P^T, "
            f"dP^T and half of dK, dV (limit {BWD_TC_ARRAY_BUDGET_TWO_PASSES} in two passes, beyond "
            "which ptxas spills)")


def _bwd_tc_qsplit(bq, bkv, d, dv):
    lay = bwd_tc_layout(bq, bkv, d, dv)
    return 1 if isinstance(lay, str) else lay[3]


def _bwd_tc_shared(bq, bkv, d, dv, acc):
    ps = bkv * (bq + 8) if _bwd_tc_qsplit(bq, bkv, d, dv) == 2 else 0
    return 2 * (bkv * (d + 8) + bkv * (dv + 8) + 2 * bq * (d + 8) + 2 * bq * (dv + 8)
                + bkv * (bq + 8) + ps) + 16 * bq


def _bwd_tc_layout_text(bq, bkv, d, dv, acc):
    ps = f" + Ps[{bkv}][{bq + 8}]" if _bwd_tc_qsplit(bq, bkv, d, dv) == 2 else ""
    return (f"16-bit Ks[{bkv}][{d + 8}] + Vs[{bkv}][{dv + 8}] + Qs[2][{bq}][{d + 8}] + "
            f"dOs[2][{bq}][{dv + 8}] + dSs[{bkv}][{bq + 8}]{ps}, float lse2_s[2][{bq}] + D_s[2][{bq}]")


def _bwd_tc_check(bq, bkv, d, dv):
    lay = bwd_tc_layout(bq, bkv, d, dv)
    return lay if isinstance(lay, str) else None


def _bwd_tc_threads(bq, bkv, d, dv):
    lay = bwd_tc_layout(bq, bkv, d, dv)
    return 32 * lay[0] if not isinstance(lay, str) else 32


def _bwd_tc_defines(bq, bkv, d, dv):
    lay = bwd_tc_layout(bq, bkv, d, dv)
    return ({"CUFLASH_BWD_PASSES": lay[2], "CUFLASH_BWD_QSPLIT": lay[3]}
            if not isinstance(lay, str) else {})


def _bwd_tc_preferences(d, dv, acc):
    # best first: 128 keys per block (K/V and dQ reds amortised over the most work), then
    # smaller tiles for smaller shared-memory budgets (sm_86/89: 99 KB, sm_75: 64 KB)
    dm = d + dv
    if dm <= 128:    # 32 keys per warp, 4 warps
        return [(32, 128), (64, 128), (32, 64), (16, 64), (16, 32), (16, 16)]
    if dm <= 256:    # query split (32 keys per warp pair): block_q 64 keeps 32 queries per warp
        # (bench/kernel_report.py model, d = 128: 64 x 128 259 B of shared memory per HMMA,
        # 64 x 64 272, 32 x 128 336 -- FA2 256)
        return [(64, 128), (64, 64), (32, 128), (32, 64), (16, 64), (16, 32), (16, 16)]
    return [(32, 128), (64, 64), (32, 64), (16, 64), (16, 32), (16, 16)]  # two passes


register(KernelTiling(
    name="flash_bwd_tc",
    block_q_choices=BWD_TC_TILE_CHOICES,
    block_kv_choices=BWD_TC_TILE_CHOICES,
    shared_bytes=_bwd_tc_shared,
    threads=_bwd_tc_threads,
    preferences=_bwd_tc_preferences,
    layout=_bwd_tc_layout_text,
    check=_bwd_tc_check,
    defines=_bwd_tc_defines,
))

# the helpers of flash_bwd_tc.cu (their own module: dtype, d, dv only); no shared memory
register(KernelTiling(
    name="flash_bwd_tc_preprocess",
    block_q_choices=(64,), block_kv_choices=(64,),
    shared_bytes=lambda bq, bkv, d, dv, acc: 0,
    threads=lambda bq, bkv, d, dv: BWD_TC_PRE_THREADS,
    preferences=lambda d, dv, acc: [(64, 64)],
    layout=lambda bq, bkv, d, dv, acc: "no shared memory",
))
register(KernelTiling(
    name="flash_bwd_tc_dq_convert",
    block_q_choices=(64,), block_kv_choices=(64,),
    shared_bytes=lambda bq, bkv, d, dv, acc: 0,
    threads=lambda bq, bkv, d, dv: BWD_TC_CONVERT_THREADS,
    preferences=lambda d, dv, acc: [(64, 64)],
    layout=lambda bq, bkv, d, dv, acc: "no shared memory",
))


def plan_flash_bwd(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                   limit_source="unlimited", kernel=None, tensor_cores=True):
    """The backward's plan: flash_bwd_tc (tensor cores) or flash_bwd_dkdv (SIMT), with tiles.

    float16/bfloat16 run flash_bwd_tc when ``tensor_cores`` (sm_80+), the head dims are
    multiples of 16 and any explicit tiles are ones it takes; everything else (and what
    does not fit the limit there) runs the SIMT kernels of flash_bwd.cu.  ``kernel``
    forces "flash_bwd_tc" or "flash_bwd_dkdv" (tests cover both).
    """
    name = _dtype_name(dtype)
    if kernel is None:
        tc = kernel_tiling("flash_bwd_tc")
        if tensor_cores and name in TC_DTYPES:
            if ((block_q is None or block_q in tc.block_q_choices)
                    and (block_kv is None or block_kv in tc.block_kv_choices)
                    and d % 16 == 0 and dv % 16 == 0):
                try:
                    return plan("flash_bwd_tc", d, dv, dtype, block_q, block_kv, limit=limit,
                                limit_source=limit_source)
                except ValueError as e:
                    _refuse_off_tensor_cores("flash_bwd_tc", d, dv, dtype, block_q, block_kv,
                                             limit, limit_source, str(e))
            elif d % 16 == 0 and dv % 16 == 0:
                _refuse_off_tensor_cores("flash_bwd_tc", d, dv, dtype, block_q, block_kv, limit,
                                         limit_source, None)
        kernel = "flash_bwd_dkdv"
    if kernel == "flash_bwd_tc" and name not in TC_DTYPES:
        raise ValueError(f"flash_bwd_tc runs {TC_DTYPES} only, got {name}")
    return plan(kernel, d, dv, dtype, block_q, block_kv, limit=limit, limit_source=limit_source)


def bwd_dq_splits(n_kv_tiles, problems, slots):
    """dQ accumulator slices of the deterministic tensor-core backward.

    The grid is ``splits * problems`` blocks (problems = batch x kv heads), each doing
    ``ceil(n_kv_tiles / splits)`` KV tiles one after another; ``slots`` blocks run at a
    time.  Returns the fewest splits (least accumulator memory and summing) among those
    with the smallest modelled makespan ``ceil(splits * problems / slots) *
    ceil(n_kv_tiles / splits)`` -- the same number of KV-tile steps as the atomic path's
    ``ceil(n_kv_tiles * problems / slots)`` whenever the waves divide evenly.
    """
    n_kv_tiles, problems, slots = max(1, int(n_kv_tiles)), max(1, int(problems)), max(1, int(slots))
    best, best_cost = 1, None
    for s in range(1, n_kv_tiles + 1):
        cost = -(-s * problems // slots) * -(-n_kv_tiles // s)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def flash_bwd_tc_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, block_q, block_kv,
                         causal=None, n_splits=1):
    """Exact global-memory bytes (read, written) of one tensor-core backward call.

    What the emulator counts for flash_bwd_tc_preprocess, flash_bwd_tc and
    flash_bwd_tc_dq_convert (16-bit inputs; float32 workspace rows padded to whole Q tiles):

    * preprocess: O and dO rows < Nq (2 * dv * 2 bytes) and lse (4) per query row; writes
      lse2 and D (4 + 4 bytes) for every padded row, and zeroes the n_splits dQ
      accumulators (4 * d bytes per row and slice);
    * flash_bwd_tc, per (KV tile, kv head, batch) that some query sees: K/V rows < Nk
      once; for every query head of the group and every Q tile from the first that sees
      the KV tile: the Q/dO rows < Nq and Br padded lse2/D values; dQ reds of 4 bytes read
      + 4 written per (valid row, column); dK/dV rows < Nk written once (also by KV tiles no
      query sees, as zeros, without loading anything);
    * convert: n_splits accumulators read, dQ written.
    """
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    off = (Nk - Nq) if causal == "bottom_right" else 0
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    nq_pad = nq_t * block_q
    read = bh * (Nq * (2 * dv * 2 + 4))
    written = bh * (nq_pad * 8 + n_splits * Nq * d * 4)
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        it0 = 0
        if causal is not None:
            i_min = kv0 - off
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        written += bhk * kv_rows * (d + dv) * 2
        if it0 >= nq_t:
            continue
        q_rows = Nq - it0 * block_q
        n_tiles = nq_t - it0
        read += bhk * kv_rows * (d + dv) * 2
        read += bhk * group * (q_rows * (d + dv) * 2 + n_tiles * block_q * 8)
        read += bhk * group * q_rows * d * 4
        written += bhk * group * q_rows * d * 4
    read += n_splits * bh * Nq * d * 4
    written += bh * Nq * d * 2
    return read, written


# --------------------------------------------------------------------------
# the logit features (-DCUFLASH_MASKS: flash_fwd_masked, flash_bwd_*_masked): traffic
# --------------------------------------------------------------------------
# The masked kernels use the tiles, threads and shared memory of flash_fwd and
# flash_bwd_dkdv / flash_bwd_dq (the plans above); what changes is which tiles
# they load (the sliding window skips tiles on both sides of its band) and the
# feature tensors they read.  These models count exactly what the kernels
# load and store, so the emulator's byte counters can be held to them.
def visible_keys(Nq, Nk, causal=None, window=None):
    """(lo, hi) int arrays of shape (Nq,): row i sees keys lo[i] <= j < hi[i].

    ``causal``: None, "bottom_right" or "top_left"; ``window``: None or
    (left, right) with -1 (or None) for an unbounded side, aligned at
    ``Nk - Nq`` (kernels_cu/masks.cuh).
    """
    i = np.arange(Nq, dtype=np.int64)
    lo = np.zeros(Nq, np.int64)
    hi = np.full(Nq, Nk, np.int64)
    if causal is not None:
        hi = np.minimum(hi, i + (Nk - Nq if causal == "bottom_right" else 0) + 1)
    if window is not None:
        left, right = (-1 if s is None else s for s in window)
        if left >= 0:
            lo = np.maximum(lo, i + Nk - Nq - left)
        if right >= 0:
            hi = np.minimum(hi, i + Nk - Nq + right + 1)
    return np.clip(lo, 0, Nk), np.clip(hi, 0, Nk)


def _fwd_tile_keys(lo, hi, q0, rows, Nk, block_kv, causal_end):
    """The keys [k_begin, k_end) of the KV tiles a query tile loads (fwd_problem.cuh)."""
    a, b = int(lo[q0]), int(hi[q0 + rows - 1])
    b = min(b, causal_end)
    if b <= a:
        return 0, 0
    t0 = a // block_kv
    return t0 * block_kv, min(-(-b // block_kv) * block_kv, Nk)


def flash_fwd_masked_traffic(batch, heads, Nq, Nk, d, dv, dtype, block_q, block_kv, causal=None,
                             window=None, bias=False, alibi=False):
    """Exact global bytes (read, written) of flash_fwd_masked for one dense launch.

    Per query head and Q tile: the Q tile; the K and V rows of the KV tiles
    from the one holding the first row's first visible key to the one holding
    the last row's last visible key (tiles left and right of the window's band
    are never loaded); with a bias, one element (compute type) per visible
    (row, key); with ALiBi, one slope per thread (4 * block_q per block); O and
    lse once.
    """
    isz = 2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize
    acc = accumulator_bytes(dtype)
    lo, hi = visible_keys(Nq, Nk, causal, window)
    seen = np.maximum(hi - lo, 0)
    kv_rows = 0
    n_tiles = -(-Nq // block_q) if Nq else 0
    off = Nk - Nq if causal == "bottom_right" else 0
    for t in range(n_tiles):
        q0 = t * block_q
        rows = min(block_q, Nq - q0)
        cend = Nk if causal is None else min(max(q0 + rows - 1 + off + 1, 0), Nk)
        k0, k1 = _fwd_tile_keys(lo, np.minimum(hi, Nk), q0, rows, Nk, block_kv, cend)
        kv_rows += k1 - k0
    bh = batch * heads
    read = bh * (Nq * d * isz + kv_rows * (d + dv) * isz)
    if bias:
        read += bh * int(seen.sum()) * acc
    if alibi:
        read += bh * n_tiles * 4 * block_q * acc
    written = bh * (Nq * dv * isz + Nq * acc)
    return read, written


def flash_bwd_masked_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, dtype, block_q, block_kv,
                             causal=None, window=None, bias=False, alibi=False, dbias=None,
                             deterministic=True):
    """Modelled global bytes (read, written) of a backward call on the masked kernels.

    As :func:`flash_bwd_traffic` with the window's tile skipping -- dkdv visits
    only the Q tiles whose rows' bands reach its KV tile, dq only the KV tiles
    inside its Q tile's band -- plus the features: a bias element per visible
    (row, key) in dkdv and again in dq; one ALiBi slope per thread per query head
    (BWD_THREADS per dkdv block and group head, per dq block); ``dbias``
    "store" (one write per visible element) or "atomic" (a read and a write).
    Rows that see no key are assumed to have lse = -inf (they read nothing).
    """
    isz = np.dtype(dtype).itemsize if _dtype_name(dtype) != "bfloat16" else 2
    acc = accumulator_bytes(dtype)
    lo, hi = visible_keys(Nq, Nk, causal, window)
    seen = int(np.maximum(hi - lo, 0).sum())
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    coff = (Nk - Nq) if causal == "bottom_right" else 0
    moff = Nk - Nq
    left, right = (-1, -1) if window is None else (-1 if s is None else s for s in window)
    read = bh * Nq * 2 * dv * isz
    written = bh * Nq * acc + (0 if deterministic else bh * Nq * d * 4)
    q_rows = 0
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        it0, it1 = 0, nq_t
        if causal is not None:
            i_min = kv0 - coff
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        if right >= 0:
            i_min = kv0 - moff - right
            t = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
            it0 = max(it0, t)
        if left >= 0:
            i_max = kv0 + kv_rows - 1 - moff + left
            t = 0 if i_max < 0 else (nq_t if i_max >= Nq else i_max // block_q + 1)
            it1 = min(it1, t)
        for it in range(it0, it1):
            q_rows += min(block_q, Nq - it * block_q)
    read += bhk * Nk * (d + dv) * isz + bhk * group * q_rows * ((d + dv) * isz + 2 * acc)
    written += bhk * Nk * (d + dv) * isz
    if alibi:
        read += bhk * nk_t * group * BWD_THREADS * acc
    if bias:
        read += bh * seen * acc
    if dbias == "store":
        written += bh * seen * acc
    elif dbias == "atomic":
        read += bh * seen * acc
        written += bh * seen * acc
    if not deterministic:
        read += bh * q_rows * d * 4
        written += bh * q_rows * d * 4
        read += bh * Nq * d * 4
        written += bh * Nq * d * isz
    else:
        kv_rows = 0
        wl, wh = visible_keys(Nq, Nk, None, window)
        for i in range(nq_t):
            q0 = i * block_q
            rows = min(block_q, Nq - q0)
            end = Nk if causal is None else min(max(q0 + rows + coff, 0), Nk)
            a, b = 0, end
            if window is not None:
                a = int(wl[q0])
                b = min(int(wh[q0 + rows - 1]), end)
                if b <= a:
                    a = b = 0
            if b > 0:
                kv_rows += min(-(-b // block_kv) * block_kv, Nk) - (a // block_kv) * block_kv
        read += bh * (Nq * ((d + dv) * isz + 2 * acc) + kv_rows * (d + dv) * isz)
        if alibi:
            read += bh * nq_t * BWD_THREADS * acc
        if bias:
            read += bh * seen * acc
        written += bh * Nq * d * isz
    return read, written

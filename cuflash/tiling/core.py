"""The planner itself: kernel descriptions, the registry, device limits, occupancy and :func:`plan`."""
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import numpy as np

from .curated import ARCH_CLASSES, cell, table_arches


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
# The environment variable naming the GPU the emulator backend stands in for
EMULATOR_ARCH_ENV = "CUFLASH_EMULATOR_ARCH"


def emulator_arch(arch=None):
    """The architecture the emulator stands in for: ``arch``, else ``$CUFLASH_EMULATOR_ARCH``,
    else sm_80.  An unknown name raises ValueError (the choices: :data:`EMULATOR_ARCHES`)."""
    src = "arch"
    if arch is None:
        arch, src = os.environ.get(EMULATOR_ARCH_ENV) or None, EMULATOR_ARCH_ENV
    if arch is None:
        return EMULATOR_DEFAULT_ARCH
    if arch not in EMULATOR_ARCHES:
        raise ValueError(f"{src}={arch!r} names no architecture the emulator stands in for; "
                         f"choose one of {', '.join(sorted(EMULATOR_ARCHES))}")
    return arch

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
    layout : callable(block_q, block_kv, d, dv, acc_bytes) -> str
        One line naming the shared-memory arrays and their shapes (for messages).
    check : callable(block_q, block_kv, d, dv) -> str or None
        Further constraints (the register rules: accumulators per thread); a message when
        violated.
    check_acc : callable(block_q, block_kv, d, dv, acc_bytes) -> str or None
        Constraints that also depend on the accumulator size (a double takes two 32-bit
        registers); a message when violated.  None by default.
    defines : callable(block_q, block_kv, d, dv) -> dict
        Extra ``-D`` defines of a plan beyond dtype, head dims, tiles and threads
        (:func:`cuflash.kernels.plan_defines` adds them); none by default.
    head_dims : callable(d, dv) -> (int, int), or None
        The head dims the kernel is compiled for (its head-dim class, :mod:`.curated`): every
        rule (shared memory, registers, the curated table) is applied to them, and the plan's
        ``kd``/``kdv`` hold them.  None: compiled for d and dv themselves.
    pad_define : str or None
        The define a build compiled for head dims larger than the call's needs (the
        tensor-core kernels: ``CUFLASH_HEAD_DIMS_PADDED``); None where the kernel always
        reads the call's head dims (the SIMT kernels) or is never padded.
    smaller : callable(block_q, block_kv, d, dv, acc_bytes) -> (int, dict) or None, or None
        A leaner shared-memory layout of the same tiles (its bytes and the defines that build
        it), or None where the tiles have none: a plan takes it where ``shared_bytes``
        exceeds the limit or where it lets more blocks reside on an SM (flash_bwd_tc: one dO
        buffer instead of two; flash_fwd_tc: one K and one V buffer instead of two stages).
        None by default.

    The default tiles come from the curated table of the kernel's family
    (:data:`.curated.CURATED`; of a ``_masked`` kernel, the cells' features build); a kernel
    without one has a single block_q and block_kv choice.
    """
    name: str
    block_q_choices: Tuple[int, ...]
    block_kv_choices: Tuple[int, ...]
    shared_bytes: Callable
    threads: Callable
    layout: Callable
    check: Callable = field(default=lambda bq, bkv, d, dv: None)
    check_acc: Callable = field(default=lambda bq, bkv, d, dv, acc: None)
    max_head_dim: int = MAX_HEAD_DIM
    defines: Callable = field(default=lambda bq, bkv, d, dv: {})
    head_dims: Callable = None
    pad_define: str = None
    smaller: Callable = None

    def compiled_dims(self, d, dv):
        """(d, dv) as this kernel compiles them: their head-dim class, or themselves."""
        return (d, dv) if self.head_dims is None else self.head_dims(d, dv)


# Head-dim classes of the SIMT kernels (flash_fwd.cu, flash_bwd.cu): a call runs on the kernel
# compiled for the smallest class >= max(d, dv), for d and dv alike, its columns past d and dv
# zero in shared memory (the kernels read the call's head dims at run time).  Why: one plan
# per class, which the curated tables list and CI compiles, instead of one per (d, dv) pair.
# The classes are the head dims FlashAttention-2 instantiates (multiples of 32) plus 8 and 16,
# so small heads do not pay 4x; a head dim between two classes computes on the padding (e.g.
# d = 80 on 96 columns: 20% more FMAs and shared memory than a compile for 80), the common
# ones (32, 64, 96, 128, ...) not at all -- nor d != dv pairs, which compute on max(d, dv)
# columns for both.
SIMT_HEAD_DIM_CLASSES = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)


def simt_head_dim_class(d):
    """The smallest of :data:`SIMT_HEAD_DIM_CLASSES` that holds head dim ``d`` (1..256)."""
    for c in SIMT_HEAD_DIM_CLASSES:
        if d <= c:
            return c
    raise ValueError(f"head dim {d} is above the largest class {SIMT_HEAD_DIM_CLASSES[-1]}")


def simt_head_dims(d, dv):
    """The head dims a SIMT kernel is compiled for: the class of max(d, dv), for both."""
    c = simt_head_dim_class(max(d, dv))
    return c, c


def square_head_dims(step):
    """The head dims of a tensor-core kernel whose head dims are multiples of ``step``: d and
    dv themselves when equal, else max(d, dv) for both (the smaller padded with zero columns);
    dims that are not multiples of ``step`` stay as they are (the kernel's rules refuse them)."""
    def head_dims(d, dv):
        if d == dv or d % step or dv % step:
            return d, dv
        return max(d, dv), max(d, dv)
    return head_dims


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
    kd: int      # head dims the kernel is compiled for (its head-dim class, or d and dv:
    kdv: int     # KernelTiling.head_dims); shared memory and threads are sized for them
    # the defines of KernelTiling.smaller's layout, as (name, value) pairs, where the plan
    # takes it (its shared memory is then shared_bytes)
    layout_defines: tuple = ()

    @property
    def needs_opt_in(self):
        """True when the dynamic shared memory exceeds the 48 KB launch default."""
        return self.shared_bytes > STATIC_SMEM_LIMIT

    def describe(self):
        cls = ("" if (self.kd, self.kdv) == (self.d, self.dv)
               else f" (compiled for the head-dim class {self.kd}/{self.kdv})")
        return (f"{self.kernel}: block_q={self.block_q}, block_kv={self.block_kv}, "
                f"d={self.d}, dv={self.dv}{cls}, {self.dtype}; {self.threads} threads, "
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
        arch = emulator_arch(arch)
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
    arch = emulator_arch(arch)
    return EMULATOR_SMS[arch], f"nominal {arch} (emulator)"


# Automatic split-KV (num_splits=None) goes to the SIMT serving kernel.  Where the dense
# plan would run a tensor-core kernel, it is taken only for at most this many query rows
# per kv head (decode: GQA group x new tokens): one m16 tile of rows, where a 64-128-row
# tensor-core tile does mostly padding.  Above it the tensor cores' per-FLOP advantage
# (on the H100 the SIMT forward ran float32 at 12.9 TFLOP/s, flash_fwd_tc float16 at
# 166-172, d=128: the H100 baseline in bench/results/gpu) is assumed to beat the split's
# extra parallelism -- not yet measured against the split kernel; num_splits=k forces a
# split at any row count.
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


def split_slots(n_sms, threads):
    """The block count that fills the GPU, for :func:`num_splits_heuristic`, at ``threads`` per block.

    FlashAttention-2's heuristic counts its own blocks of 4 warps, one per SM: one warp for
    each of an SM's four schedulers.  The serving kernel's blocks are as small as the
    query rows allow (decoding: 8 rows, one warp), and one such block per SM would leave
    three schedulers idle and the loads of one warp to cover the memory latency; so a block
    of w warps counts as w / 4 of a slot (at least :data:`MIN_RESIDENT_WARPS` warps per SM).
    A model choice, not yet measured on a GPU.
    """
    warps = max(1, -(-int(threads) // 32))
    return int(n_sms) * max(1, -(-MIN_RESIDENT_WARPS // warps))


def arch_class(limit):
    """The architecture class of the curated tables (:data:`.curated.ARCH_CLASSES`) that plans
    for a shared-memory ``limit`` are chosen from: the largest class whose nominal opt-in limit
    (:data:`EMULATOR_ARCHES`) is at most ``limit``, the smallest one below them all; ``sm_90``
    without a limit."""
    if limit is None or limit == float("inf"):
        return ARCH_CLASSES[-1]
    fits = [a for a in ARCH_CLASSES if EMULATOR_ARCHES[a] <= limit]
    return fits[-1] if fits else ARCH_CLASSES[0]


def _class_order(kernel, limit):
    """The architecture classes whose cells a default of ``kernel`` at ``limit`` is taken from,
    in order: the limit's class, then the smaller ones (largest first), then the larger ones."""
    arches = table_arches(kernel)
    own = ARCH_CLASSES.index(arch_class(limit))
    below = [a for a in reversed(ARCH_CLASSES[:own + 1]) if a in arches]
    above = [a for a in ARCH_CLASSES[own + 1:] if a in arches]
    return below + above


def curated_plans(kernel, dtype, kd, kdv, limit=None, padded=False):
    """[(architecture class, ((block_q, block_kv), ...))] of ``kernel``'s curated table for
    ``dtype`` at the compiled head dims ``kd``/``kdv`` and a shared-memory ``limit``: the cells
    a default is chosen from, in the order they are tried (the first cell's first pair is the
    default where it fits); empty where the table has none.  ``padded``: the cells of the
    padded build (a tensor-core call with d != dv)."""
    if kd != kdv:
        return []
    dt = _dtype_name(dtype)
    out = []
    for arch in _class_order(kernel, limit):
        pairs = cell(kernel, dt, kd, arch, padded)
        if pairs:
            out.append((arch, pairs))
    return out


def curated_text(kernel, dtype, kd, kdv, limit=None, padded=False):
    """The curated pairs of :func:`curated_plans`'s first cell, for messages: ``"(64, 32) (the
    default), (32, 32) (curated for sm_80)"``, or a sentence saying there are none."""
    cells = curated_plans(kernel, dtype, kd, kdv, limit, padded)
    if not cells:
        return f"{kernel} has no curated plans for {_dtype_name(dtype)} at head dims {kd}/{kdv}"
    arch, pairs = cells[0]
    return ", ".join(f"({a}, {b})" + (" (the default)" if i == 0 else "")
                     for i, (a, b) in enumerate(pairs)) + f" (curated for {arch})"


def _why_not(t, bq, bkv, d, dv, acc, limit=None):
    """The kernel's own refusal of a tile pair (head dims, the register rules), or None."""
    return t.check(bq, bkv, d, dv) or t.check_acc(bq, bkv, d, dv, acc)


def shared_layout(t, bq, bkv, d, dv, acc, limit=None):
    """``(shared bytes, defines)`` of ``t``'s tiles under a shared-memory ``limit`` (None: no
    limit): its own layout, or ``t.smaller``'s where that exists and either the own one
    exceeds the limit (the smaller one may exceed it too) or the smaller one lets more blocks
    reside on an SM (:func:`resident_blocks`)."""
    own = t.shared_bytes(bq, bkv, d, dv, acc)
    if limit is None or limit < 0 or t.smaller is None:
        return own, {}
    lean = t.smaller(bq, bkv, d, dv, acc)
    if lean is None:
        return own, {}
    if own > limit:
        return lean
    threads = t.threads(bq, bkv, d, dv)
    more = resident_blocks(threads, lean[0], limit) > resident_blocks(threads, own, limit)
    return lean if more else (own, {})


def _shared(t, bq, bkv, d, dv, acc, limit):
    return shared_layout(t, bq, bkv, d, dv, acc, limit)[0]


def _fits(t, bq, bkv, d, dv, acc, limit):
    return (_why_not(t, bq, bkv, d, dv, acc, limit) is None
            and _shared(t, bq, bkv, d, dv, acc, limit) <= limit)


# Occupancy floor.  An SM of sm_80/sm_90 has four warp schedulers; a plan whose shared memory
# leaves fewer resident warps than that idles schedulers outright, and nothing hides its
# memory latency.  The H100 tile sweep (bench/results/gpu) measured such a plan: float32
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


# Registers per SM (every supported architecture) and the most a thread may use: the planner
# counts a tensor-core kernel at the most (its register arrays are sized to the budget; the
# exact count is known after compilation), which an SM allocates per warp as 8192.
REGS_PER_SM = 65536
REGS_PER_WARP_AT_MOST = 8192


def resident_blocks(threads, shared_bytes, limit):
    """Blocks of one kernel that reside on an SM, by shared memory (as :func:`resident_warps`)
    and by registers counted at 255 per thread; 0 where one block does not fit the limit (an
    infinite limit: registers alone)."""
    if shared_bytes > limit:
        return 0
    by_shared = (MAX_BLOCKS_PER_SM if limit == float("inf") else
                 (int(limit) + SMEM_RESERVED_PER_BLOCK) // (shared_bytes + SMEM_RESERVED_PER_BLOCK))
    by_regs = REGS_PER_SM // (-(-threads // 32) * REGS_PER_WARP_AT_MOST)
    return min(MAX_BLOCKS_PER_SM, by_shared, by_regs)


def _occupancy_ok(t, bq, bkv, d, dv, acc, limit):
    w = resident_warps(t.threads(bq, bkv, d, dv), _shared(t, bq, bkv, d, dv, acc, limit), limit)
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
        the first curated pair that fits ``limit``.
    limit : int or None
        Shared-memory bytes per block allowed (from :func:`device_smem_limit`);
        None = no limit.
    limit_source : str
        Where ``limit`` comes from, for messages and reports.

    Returns
    -------
    TilePlan
        For a kernel compiled per head-dim class (``KernelTiling.head_dims``), every rule is
        checked at the compiled head dims, which the plan's ``kd``/``kdv`` hold.

    Defaults come from the kernel's curated table (:mod:`.curated`): the first pair of the
    cells of :func:`curated_plans` that fits ``limit`` and the occupancy floor.  Explicit
    tiles are taken wherever the size formulas (shared memory, register rules, occupancy
    floor) allow them; whether ptxas spills them shows when they are compiled
    (:func:`cuflash.kernels.check_compiled`).

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
            hint = ("use backend='numpy' for larger head dims" if val > t.max_head_dim else
                    "backend='numpy' takes empty head dims")
            raise ValueError(f"{kernel} supports head dims 1..{t.max_head_dim}, got {name}={val}; "
                             f"{hint}")
    for name, val, choices in (("block_q", block_q, t.block_q_choices),
                               ("block_kv", block_kv, t.block_kv_choices)):
        if val is not None and val not in choices:
            raise ValueError(f"{kernel} does not support {name}={val}; supported {name}: "
                             f"{list(choices)} (shared-memory budget {lim_text})")
    real = (d, dv)
    d, dv = t.compiled_dims(d, dv)  # every rule below is the compiled kernel's
    padded = t.pad_define is not None and real != (d, dv)   # the padded build's own cells
    cells = curated_plans(kernel, dtname, d, dv, limit, padded)
    curated = [ab for _, pairs in cells for ab in pairs]
    if block_q is not None and block_kv is not None:
        pairs, chosen = [(block_q, block_kv)], "explicit"
    elif block_q is not None or block_kv is not None:
        # the curated pairs of the limit's class with the given size first, then every
        # supported pair with it, largest tiles first, so a fitting pair is found wherever one
        # exists
        every = sorted(((a, b) for a in t.block_q_choices for b in t.block_kv_choices),
                       key=lambda ab: (-ab[0] * ab[1], -ab[0]))
        own = list(cells[0][1]) if cells else []
        pairs = [(a, b) for a, b in dict.fromkeys(own + every)
                 if (block_q is None or a == block_q) and (block_kv is None or b == block_kv)]
        chosen = "mixed"
    else:
        pairs, chosen = list(dict.fromkeys(curated)), "default"
        if not pairs:
            pairs = _uncurated_default(t, kernel, dtname, d, dv, acc)
    fitting = [ab for ab in pairs if _fits(t, *ab, d, dv, acc, lim)]
    # occupancy floor first: defaults take a plan below it only when no other fits
    fitting.sort(key=lambda ab: not _occupancy_ok(t, *ab, d, dv, acc, limit))
    if fitting and not _occupancy_ok(t, *fitting[0], d, dv, acc, limit) and chosen != "default":
        _refuse_low_occupancy(t, kernel, fitting[0], d, dv, acc, dtname, limit, lim_text)
    if fitting:
        bq, bkv = fitting[0]
        shared, lean = shared_layout(t, bq, bkv, d, dv, acc, limit)
        return TilePlan(kernel=kernel, block_q=bq, block_kv=bkv, d=real[0], dv=real[1],
                        dtype=dtname, acc_bytes=acc, threads=t.threads(bq, bkv, d, dv),
                        shared_bytes=shared,
                        limit=int(limit) if limit is not None else -1,
                        limit_source=limit_source, chosen=chosen, kd=d, kdv=dv,
                        layout_defines=tuple(sorted(lean.items())))
    # nothing fits: say why, with the budget and what would fit
    bq, bkv = pairs[0]
    why = _why_not(t, bq, bkv, d, dv, acc, lim)
    need = t.shared_bytes(bq, bkv, d, dv, acc)
    fitting = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
               if _fits(t, a, b, d, dv, acc, lim)]
    fit_text = (", ".join(f"({a}, {b})" for a, b in fitting) if fitting
                else "none at this head dim and dtype")
    reason = why if why else (f"needs {need} B of shared memory "
                              f"({t.layout(bq, bkv, d, dv, acc)}) but the budget is {lim_text}")
    if chosen == "default" and len(pairs) > 1:
        listed = curated_text(kernel, dtname, d, dv, limit, padded)
        reason = (f"none of its curated plans fits ({listed}); "
                  f"the first: {reason}")
    cls = "" if real == (d, dv) else f" (head-dim class {d}/{dv})"
    raise ValueError(f"{kernel} with block_q={bq}, block_kv={bkv}, d={real[0]}, dv={real[1]}{cls}, "
                     f"{dtname}: {reason}. Supported block_q: {list(t.block_q_choices)}, block_kv: "
                     f"{list(t.block_kv_choices)}; (block_q, block_kv) pairs that fit: {fit_text}")


def _uncurated_default(t, kernel, dtname, d, dv, acc):
    """The default of a kernel without curated plans here: its only tile pair (the fixed-tile
    helpers), else a ValueError -- the kernel's own refusal of these head dims, or that it has
    no curated plans for them (no plan is made up)."""
    if len(t.block_q_choices) == 1 and len(t.block_kv_choices) == 1 and not table_arches(kernel):
        return [(t.block_q_choices[0], t.block_kv_choices[0])]
    why = t.check(min(t.block_q_choices), min(t.block_kv_choices), d, dv)
    if why is not None:  # head dims the kernel does not take
        raise ValueError(f"{kernel} with d={d}, dv={dv}, {dtname}: {why}")
    raise ValueError(f"{kernel} has no curated plans for {dtname} at head dims {d}/{dv}: pass "
                     f"block_q and block_kv (supported block_q: {list(t.block_q_choices)}, "
                     f"block_kv: {list(t.block_kv_choices)})")


def _refuse_low_occupancy(t, kernel, pair, d, dv, acc, dtname, limit, lim_text):
    """Raise for explicit tiles below the occupancy floor where another pair is above it."""
    good = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
            if _fits(t, a, b, d, dv, acc, limit if limit is not None else float('inf')) and _occupancy_ok(t, a, b, d, dv, acc, limit)]
    if not good:
        return  # every plan of this head dim is below the floor: allowed
    bq, bkv = pair
    threads, shared = t.threads(bq, bkv, d, dv), _shared(t, bq, bkv, d, dv, acc, limit)
    w = resident_warps(threads, shared, limit)
    raise ValueError(
        f"{kernel} with block_q={bq}, block_kv={bkv}, d={d}, dv={dv}, {dtname}: {threads} threads "
        f"and {shared} B of shared memory per block leave {w} resident warp(s) per SM (shared "
        f"memory {lim_text}); below {MIN_RESIDENT_WARPS} the SM's warp schedulers idle and such "
        f"plans ran up to 9x slower than the default on an H100. (block_q, block_kv) pairs with "
        f">= {MIN_RESIDENT_WARPS} warps per SM: " + ", ".join(f"({a}, {b})" for a, b in good))

"""Forward kernels: flash_fwd (SIMT), flash_fwd_tc / flash_fwd_tf32 (tensor cores), online softmax, and their traffic models (dense and split-KV)."""
from dataclasses import replace

import numpy as np

from .core import (KernelTiling, _dtype_name, _fits, _why_not, _occupancy_ok, accumulator_bytes,
                   kernel_tiling, plan, register, simt_head_dims, square_head_dims)


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


FLASH_FWD = register(KernelTiling(
    name="flash_fwd",
    block_q_choices=(8, 16, 32, 64, 128),
    block_kv_choices=(8, 16, 32, 64, 128),
    shared_bytes=_fwd_shared,
    threads=_fwd_threads,
    layout=_fwd_layout,
    check=_fwd_check,
    head_dims=simt_head_dims,
))

# flash_fwd_masked and flash_fwd_serving_masked (-DCUFLASH_MASKS): flash_fwd's tiles, threads
# and shared memory, but the feature state (bias row, ALiBi slope, softcap, Philox key and
# window bounds) stays live beside the accumulators.  Compiled with the features, in float64
# (NVRTC 13.0, every plan of the class pairs):
# * 72 and 80 doubles of logits + output per thread spilled 8-76 B (flash_fwd_masked: 72 on
#   sm_90, 80 on sm_80/90; the serving variant: 80 on sm_90); 68 and fewer never did;
# * block_kv = 128 spilled the serving variant 8-36 B at d = dv = 7 (34 doubles; sm_75/80/90)
#   although it did not at d = dv = 32 (40 doubles): ptxas, not the count -- so float64
#   feature calls keep to block_kv <= 64.
FWD_MASKED_MAX_ACC_FLOAT64 = 68
FWD_MASKED_MAX_BLOCK_KV_FLOAT64 = 64


def _fwd_masked_acc_check(bq, bkv, d, dv, acc):
    if acc != 8:
        return None
    n = bkv // 4 + (dv + 3) // 4
    if n > FWD_MASKED_MAX_ACC_FLOAT64:
        return (f"block_kv={bkv} with dv={dv} needs {n} float64 accumulators per thread in the "
                f"masked forward (limit {FWD_MASKED_MAX_ACC_FLOAT64} doubles beside the feature "
                "state: ptxas spills 72)")
    if bkv > FWD_MASKED_MAX_BLOCK_KV_FLOAT64:
        return (f"block_kv={bkv}: the masked forward in float64 takes block_kv <= "
                f"{FWD_MASKED_MAX_BLOCK_KV_FLOAT64} (ptxas spilled its serving variant at 128)")
    return None


register(replace(FLASH_FWD, name="flash_fwd_masked", check_acc=_fwd_masked_acc_check))


# flash_fwd_tf32 (and its masked build) add their O accumulators into the float32 output every
# TF32_FLUSH_KEYS keys (kFlushKeys in kernels_cu/flash_fwd_tc.cu: the tensor core's truncating
# accumulation would otherwise drift O past float32 accuracy on long rows).
TF32_FLUSH_KEYS = 256


def tf32_flushes(n_tiles, block_kv, flush_keys):
    """Flushes of O's second level by a block that loads ``n_tiles`` K/V tiles: one after every
    ``flush_keys // block_kv`` tiles but the last (0 when ``flush_keys`` is 0)."""
    if not flush_keys or n_tiles <= 0:
        return 0
    return (n_tiles - 1) // (flush_keys // block_kv)


def flash_fwd_traffic(batch, heads, Nq, Nk, d, dv, dtype, block_q, block_kv, causal=None,
                      flush_keys=0):
    """Exact global-memory bytes (read, written) of flash_fwd for one launch.

    Per query head and Q tile: the Q tile once; K and V rows of every KV tile
    the tile loads (tiles entirely above the causal boundary are never loaded;
    the last tile loads only the rows < Nk); O and lse once.  This is what the
    emulator's byte counters report for the kernel.  ``flush_keys``:
    flash_fwd_tf32's TF32_FLUSH_KEYS -- a Q tile that loads more than that many
    keys' tiles also writes its O rows at every flush and reads them back at
    every flush but the first and at the end (as many reads as writes).
    """
    isz = 2 if _dtype_name(dtype) == "bfloat16" else np.dtype(dtype).itemsize
    lse_sz = accumulator_bytes(dtype)
    n_tiles = -(-Nq // block_q) if Nq else 0
    kv_rows = flushed_rows = 0
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
        flushed_rows += tf32_flushes(n_kv, block_kv, flush_keys) * rows
    bh = batch * heads
    read = bh * (Nq * d * isz + kv_rows * (d + dv) * isz + flushed_rows * dv * isz)
    written = bh * (Nq * dv * isz + Nq * lse_sz + flushed_rows * dv * isz)
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
# tile sweep showed as 10-270x slowdowns.  Within the budget ptxas may still spill a plan:
# the curated plans are compiled by CI, explicit ones checked when compiled on a GPU.
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
# sm_80 over every plan the budgets accepted).
# flash_fwd_tc's 32-row budget is 192 (128 x 64 at d = 128, FlashAttention-2's tile: S and O
# are 192 registers; ptxas fits them in 255 with the reference max in exponent units and the
# copies' addresses stepped); its _masked kernel keeps the feature state besides and 160.
TC_MAX_ACC_REGS = {"flash_fwd_tc": 160, "flash_fwd_tf32": 144}
TC_MAX_ACC_REGS_32_ROWS = {"flash_fwd_tc": 192, "flash_fwd_tf32": 144,
                           "flash_fwd_tc_masked": 160, "flash_fwd_tf32_masked": 144}
TC_MAX_BLOCK_KV_32_ROWS = {"flash_fwd_tc": 64, "flash_fwd_tf32": 64}


def _tc_base(kernel):
    """The plain kernel of a tensor-core forward (flash_fwd_tc_masked -> flash_fwd_tc)."""
    return kernel[:-len("_masked")] if kernel.endswith("_masked") else kernel


def tc_rows_per_warp(kernel, bq, bkv, d, dv):
    """Query rows per warp of a tensor-core forward plan: 32 when they fit, else 16."""
    base = _tc_base(kernel)
    if (bq >= 32 and max(d, dv) <= 128 and bkv <= TC_MAX_BLOCK_KV_32_ROWS[base]
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
    if _tc_base(kernel) == "flash_fwd_tf32":
        return d + (16 if d % 32 == 0 else 0), d + (16 if d % 32 == 0 else 0), dv + 4, 4
    return d + 8, d + 8, dv + 8, 2


def _tc_shared(kernel):
    def shared(bq, bkv, d, dv, acc):
        qs, ks, vs, esz = tc_strides(kernel, d, dv)
        return esz * (bq * qs + 2 * bkv * ks + 2 * bkv * vs)
    return shared


# flash_fwd_tc's one-stage layout (-DCUFLASH_FWD_KV_STAGES=1, KernelTiling.smaller): one K and
# one V buffer, FlashAttention-2's forward schedule (V_j copied under S_j, K_{j+1} under the
# softmax and P V_j, two barriers per tile), taken where it lets more blocks reside on an SM
# (128 x 64 at d = 128 on an A100: 68 KB, two blocks, against 104 KB and one).  The other
# tensor-core forwards keep two stages.
TC_ONE_STAGE_KERNELS = ("flash_fwd_tc",)


def _tc_smaller(kernel):
    if kernel not in TC_ONE_STAGE_KERNELS:
        return None

    def smaller(bq, bkv, d, dv, acc):
        qs, ks, vs, esz = tc_strides(kernel, d, dv)
        return esz * (bq * qs + bkv * ks + bkv * vs), {"CUFLASH_FWD_KV_STAGES": 1}
    return smaller


def _tc_layout(kernel):
    def layout(bq, bkv, d, dv, acc):
        qs, ks, vs, esz = tc_strides(kernel, d, dv)
        t = "float" if esz == 4 else "16-bit"
        one = (f" (or one K and one V buffer: {_tc_smaller(kernel)(bq, bkv, d, dv, acc)[0]} B)"
               if kernel in TC_ONE_STAGE_KERNELS else "")
        return f"{t} Qs[{bq}][{qs}] + Ks[2][{bkv}][{ks}] + Vs[2][{bkv}][{vs}]{one}"
    return layout


def _tc_check(kernel):
    def check(bq, bkv, d, dv):
        if d % 16 or dv % 16:
            return f"{kernel} needs d and dv multiples of 16, got d={d}, dv={dv}"
        if max(d, dv) > 256:
            return f"{kernel} supports d, dv <= 256, got d={d}, dv={dv}"
        n = tc_acc_regs(kernel, bq, bkv, d, dv)
        if tc_rows_per_warp(kernel, bq, bkv, d, dv) == 16 and n > TC_MAX_ACC_REGS[_tc_base(kernel)]:
            return (f"block_kv={bkv} with dv={dv} needs {n} accumulator registers per thread in "
                    f"{kernel} even with 16 query rows per warp (limit {TC_MAX_ACC_REGS[_tc_base(kernel)]}: "
                    "more would spill to local memory)")
        return None
    return check


# flash_fwd_tc_masked / flash_fwd_tf32_masked (-DCUFLASH_MASKS): the logit features on the
# tensor-core forward (kernels_cu/flash_fwd_tc.cu), planned with the plain kernels' rules and
# their own curated tables (the feature state takes registers beside S and O).
TC_MASKED_KERNELS = ("flash_fwd_tc_masked", "flash_fwd_tf32_masked")
# With d != dv the kernels are compiled for max(d, dv), the padding columns of Q, K or V zero
# and those of O not stored (-DCUFLASH_HEAD_DIMS_PADDED: the call's head dims from FwdParams).
TC_PAD_DEFINE = "CUFLASH_HEAD_DIMS_PADDED"

for _k in TC_KERNELS + TC_MASKED_KERNELS:
    register(KernelTiling(
        name=_k,
        block_q_choices=(16, 32, 64, 128),
        block_kv_choices=(16, 32, 64, 128),
        shared_bytes=_tc_shared(_k),
        threads=_tc_threads(_k),
        layout=_tc_layout(_k),
        check=_tc_check(_k),
        head_dims=square_head_dims(16),
        pad_define=TC_PAD_DEFINE,
        smaller=_tc_smaller(_k),
    ))


# flash_fwd_wgmma (kernels_cu/flash_fwd_wgmma.cu): the Hopper forward, sm_90a only (wgmma,
# TMA, setmaxnreg), float16/bfloat16, d == dv in 64..256 by 64, no logit features.  A block is
# 3 warpgroups (a TMA producer, two consumers of 64 query rows), so block_q is 128; block_kv
# is the N of S's wgmma.  Shared memory: Q (d/64 chunks of 128 rows of 128 bytes), K and V in
# WGMMA_STAGES stages, the mbarriers (8 bytes each) and 1 KB to align the tiles for the
# 128-byte swizzle.  Registers: a consumer thread keeps O (d/2 floats) and S (block_kv/2).
WGMMA_KERNEL = "flash_fwd_wgmma"
WGMMA_HEAD_DIMS = (64, 128, 192, 256)
WGMMA_STAGES = 2
WGMMA_MAX_ACC_REGS = 160   # of the 240 setmaxnreg gives a consumer (O + S; P packed is S/4 more)


def _wgmma_shared(bq, bkv, d, dv, acc):
    chunks = d // 64
    return (chunks * bq * 128 + 2 * WGMMA_STAGES * chunks * bkv * 128
            + 8 * (1 + 2 * WGMMA_STAGES) + 1024)


def _wgmma_layout(bq, bkv, d, dv, acc):
    return (f"16-bit Q[{bq}][{d}] + K[{WGMMA_STAGES}][{bkv}][{d}] + V[{WGMMA_STAGES}][{bkv}][{d}] "
            "(128-byte swizzled rows) + mbarriers + 1 KB alignment")


def _wgmma_check(bq, bkv, d, dv):
    if d != dv or d not in WGMMA_HEAD_DIMS:
        return f"{WGMMA_KERNEL} needs d == dv in {WGMMA_HEAD_DIMS}, got d={d}, dv={dv}"
    if d // 2 + bkv // 2 > WGMMA_MAX_ACC_REGS:
        return (f"block_kv={bkv} with d={d} needs {d // 2 + bkv // 2} accumulator registers per "
                f"consumer thread in {WGMMA_KERNEL} (limit {WGMMA_MAX_ACC_REGS})")
    return None


register(KernelTiling(
    name=WGMMA_KERNEL,
    block_q_choices=(128,),
    block_kv_choices=(64, 96, 128, 176, 192, 256),
    shared_bytes=_wgmma_shared,
    threads=lambda bq, bkv, d, dv: 384,
    layout=_wgmma_layout,
    check=_wgmma_check,
))


def wgmma_takes(d, dv, dtype, block_q=None, block_kv=None):
    """Whether a plain forward call of these head dims, dtype and explicit tiles is one
    flash_fwd_wgmma takes (on an sm_90 with the Hopper kernels chosen)."""
    t = kernel_tiling(WGMMA_KERNEL)
    return (_dtype_name(dtype) in TC_DTYPES and block_q in (None, 128)
            and (block_kv is None or block_kv in t.block_kv_choices)
            and _wgmma_check(128, block_kv or 64, d, dv) is None)


def tc_kernel_for(dtype, masked=False):
    """The tensor-core forward kernel of a dtype name (its ``_masked`` variant with the logit
    features), or None (float64)."""
    name = _dtype_name(dtype)
    suffix = "_masked" if masked else ""
    if name in TC_DTYPES:
        return "flash_fwd_tc" + suffix
    if name in TF32_DTYPES:
        return "flash_fwd_tf32" + suffix
    return None


def plan_flash_fwd(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                   limit_source="unlimited", kernel=None, masked=False, wgmma=False):
    """The forward's plan: which kernel (tensor cores or the SIMT flash_fwd) with which tiles.

    float16/bfloat16 run on tensor cores (flash_fwd_tc), float32 as 3xTF32 on tensor cores
    (flash_fwd_tf32, float32 accuracy), when the head dims and any explicit tile sizes are
    ones that kernel supports and its tiles fit the limit; everything else (float64, head
    dims that are not multiples of 16, tiles it lacks) runs the SIMT kernel flash_fwd, which
    takes every dtype, head dims up to 256 and tiles of multiples of 8/4.  Explicit sizes
    are honoured by whichever kernel runs, or refused by flash_fwd's rules.  ``kernel``
    forces one kernel ("flash_fwd", "flash_fwd_tc", "flash_fwd_tf32"; tests use it).
    ``masked``: the call has logit features -- the same choice between their kernels
    (flash_fwd_tc_masked, flash_fwd_tf32_masked, flash_fwd_masked).  ``wgmma``: the device
    is an sm_90 that runs the Hopper forward (``flash_fwd_wgmma``), taken for the plain calls
    and tiles it supports (:func:`wgmma_takes`); the others plan as above.
    """
    tc_name = tc_kernel_for(dtype, masked)
    if kernel is None and wgmma and not masked and wgmma_takes(d, dv, dtype, block_q, block_kv):
        kernel = WGMMA_KERNEL
    if kernel is None:
        if tc_name is not None:
            tc = kernel_tiling(tc_name)
            if ((block_q is None or block_q in tc.block_q_choices)
                    and (block_kv is None or block_kv in tc.block_kv_choices)
                    and tc.check(block_q or 16, block_kv or 16, *tc.compiled_dims(d, dv)) is None):
                try:
                    return plan(tc_name, d, dv, dtype, block_q, block_kv, limit=limit,
                                limit_source=limit_source)
                except ValueError as e:
                    _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit,
                                             limit_source, str(e))
            else:
                _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit,
                                         limit_source, None)
        kernel = "flash_fwd_masked" if masked else "flash_fwd"
    if kernel == WGMMA_KERNEL and (masked or _dtype_name(dtype) not in TC_DTYPES):
        raise ValueError(f"{kernel} runs plain {TC_DTYPES} calls only, got {_dtype_name(dtype)}"
                         + (" with logit features" if masked else ""))
    if kernel in TC_KERNELS + TC_MASKED_KERNELS and kernel != tc_name:
        want = TC_DTYPES if _tc_base(kernel) == "flash_fwd_tc" else TF32_DTYPES
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
    kd, kdv = t.compiled_dims(d, dv)
    good = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
            if (block_q is None or a == block_q) and (block_kv is None or b == block_kv)
            and _fits(t, a, b, kd, kdv, acc, lim) and _occupancy_ok(t, a, b, kd, kdv, acc, limit)]
    every = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
             if _fits(t, a, b, kd, kdv, acc, lim) and _occupancy_ok(t, a, b, kd, kdv, acc, limit)]
    if not every:
        return  # no tensor-core plan at these head dims: the SIMT kernel is the only one
    if why is not None:  # plan()'s refusal: its reason, without the kernel and pair lists
        why = why.split(": ", 1)[-1].split(". Supported")[0].split(". (block_q")[0]
    else:
        bq, bkv = block_q or 16, block_kv or 16
        why = (_why_not(t, bq, bkv, kd, kdv, acc, lim) or
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
    layout=lambda bq, bkv, d, dv, acc: "no shared memory",
    max_head_dim=1,
))


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

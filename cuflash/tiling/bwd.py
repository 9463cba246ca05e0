"""Backward kernels on SIMT cores (flash_bwd.cu) and float32 on tensor cores (flash_bwd_tf32.cu), and the SIMT backward's traffic model."""
from dataclasses import replace

import numpy as np

from .core import (KernelTiling, _dtype_name, accumulator_bytes, kernel_tiling, plan, register,
                   simt_head_dims, square_head_dims)
from .fwd import TC_PAD_DEFINE, TF32_DTYPES, _refuse_off_tensor_cores


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
# row than flash_bwd_dkdv does.  Every float64 dQ plan compiled with NVRTC 13.0: all 13 with
# 64 doubles per thread spilled 176-248 B (255 registers; d=64 128 x 8/16, d=128 64 x 8/16/32,
# d=256 32 x 8/16, on sm_80 and/or sm_90), every one with 48 or fewer did not (at most 253
# registers).  dK/dV at 64 doubles did not spill.
BWD_MAX_DQ_ACC_FLOAT64 = 48


# float32 accumulators (float32 and 16-bit inputs) of dQ at a head dim that is not a power of
# two.  Probed when a thread's dQ elements were split into rows and columns by division (index
# registers that a power of two makes shifts); flash_bwd.cu's element_of now gives them
# compile-time offsets, so this bound and the float64 one above are conservative.  Probed (NVRTC 13.0, sm_80 and sm_90, d = 96 .. 250 at 40-64 floats per thread,
# plain and masked; d = 127 and 239 had spilled): spills from 56 floats (d = 112 masked; 60-64
# at d = 120, 127, 239), none at 48-50.  Powers of two keep BWD_MAX_ACC (64 floats at d = 128
# and 256: compiled clean).  The defaults stay below (<= 32).  The planner applies these
# limits at the head-dim classes (d and dv below are classes: 96, 160, 192 and 224 are the
# ones that are not powers of two).
BWD_MAX_DQ_ACC_NON_POW2 = 48


def _bwd_dq_acc_check(bq, bkv, d, dv, acc):
    n = _per_thread(bq * d)
    if acc == 8 and n > BWD_MAX_DQ_ACC_FLOAT64:
        return (f"block_q={bq} with d={d} needs {n} float64 dQ accumulators per thread in "
                f"flash_bwd_dq (limit {BWD_MAX_DQ_ACC_FLOAT64} doubles: ptxas spills 64)")
    if acc == 4 and d & (d - 1) and n > BWD_MAX_DQ_ACC_NON_POW2:
        return (f"block_q={bq} with d={d} needs {n} dQ accumulators per thread in flash_bwd_dq "
                f"(limit {BWD_MAX_DQ_ACC_NON_POW2} where d is not a power of two: ptxas spills "
                "beyond it)")
    return None


FLASH_BWD_DKDV = register(KernelTiling(
    name="flash_bwd_dkdv",
    block_q_choices=BWD_TILE_CHOICES,
    block_kv_choices=BWD_TILE_CHOICES,
    shared_bytes=_bwd_dkdv_shared,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    layout=_bwd_layout(True),
    check=_bwd_dkdv_check,
    check_acc=_bwd_dq_acc_check,  # the same tiles also launch flash_bwd_dq
    head_dims=simt_head_dims,
))

FLASH_BWD_DQ = register(KernelTiling(
    name="flash_bwd_dq",
    block_q_choices=BWD_TILE_CHOICES,
    block_kv_choices=BWD_TILE_CHOICES,
    shared_bytes=_bwd_dq_shared,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    layout=_bwd_layout(False),
    check=_bwd_dq_check,
    check_acc=_bwd_dq_acc_check,
    head_dims=simt_head_dims,
))

# flash_bwd_dkdv_masked / flash_bwd_dq_masked (-DCUFLASH_MASKS): the same tiles, threads,
# shared memory and limits, under their own names so that the feature builds are planned (and
# curated) as what they are.
register(replace(FLASH_BWD_DKDV, name="flash_bwd_dkdv_masked"))
register(replace(FLASH_BWD_DQ, name="flash_bwd_dq_masked"))


# D = rowsum(dO * O) in chunks of BWD_PRE_ROWS rows: one partial sum per (row, lane)
# meets in red_s (BWD_PRE_ROWS, 33); block_q here is the chunk (PRE_ROWS in flash_bwd.cu)
register(KernelTiling(
    name="flash_bwd_preprocess",
    block_q_choices=(BWD_PRE_ROWS,),
    block_kv_choices=(BWD_PRE_ROWS,),
    shared_bytes=lambda bq, bkv, d, dv, acc: acc * bq * 33,
    threads=lambda bq, bkv, d, dv: BWD_THREADS,
    layout=lambda bq, bkv, d, dv, acc: f"{'double' if acc == 8 else 'float'} red_s[{bq}][33]",
    head_dims=simt_head_dims,  # compiled into flash_bwd.cu's module
))


# flash_bwd_tf32 (and its masked build) add their dK, dV accumulators into the float32 outputs
# every TF32_FLUSH_ROWS query rows of a KV tile's steps (kFlushRows in kernels_cu/flash_bwd_tf32.cu:
# the tensor core's truncating accumulation would otherwise drift dK, dV past float32 accuracy).
TF32_FLUSH_ROWS = 128


def tf32_bwd_flushes(n_steps, block_q, flush_rows):
    """Flushes of dK, dV's second level by a block of ``n_steps`` (query head, Q tile) steps: one
    after every ``flush_rows // block_q`` steps but the last (0 when ``flush_rows`` is 0)."""
    if not flush_rows or n_steps <= 0:
        return 0
    return (n_steps - 1) // (flush_rows // block_q)


def flash_bwd_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, dtype, block_q, block_kv,
                      causal=None, deterministic=True, flush_rows=0, dq_splits=1):
    """Modelled global-memory bytes (read, written) of one backward call's kernels.

    ``batch * heads`` query problems, ``batch * kv_heads`` key/value problems
    (``heads // kv_heads`` query heads per kv head).  Counts what flash_bwd.cu
    loads and stores: preprocess reads O and dO once and writes D (and zeroes
    the float32 dQ accumulator on the atomic path); dkdv reads each K/V tile
    once and Q, dO, lse, D of every Q tile that can see it (per query head of
    the group), writes dK, dV once, and on the atomic path adds into dQ
    (4 bytes read + 4 written per element per visible (Q tile, KV tile) pair);
    dq reads Q, dO, lse, D once and K, V of every KV tile its Q tile can see.
    ``flush_rows``: flash_bwd_tf32's TF32_FLUSH_ROWS (the atomic path on tensor
    cores) -- a KV tile whose steps pass more Q rows than that also writes its dK,
    dV rows at every flush and reads them back at every flush but the first and
    at the end (as many reads as writes).
    ``deterministic``: dQ by the flash_bwd_dq pass; False: through the float32
    accumulator, in ``dq_splits`` slices (flash_bwd_tf32 with deterministic=True:
    its n_splits), each zeroed by preprocess and read by flash_bwd_dq_convert.
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
    written = bh * Nq * acc + (0 if deterministic else dq_splits * bh * Nq * d * 4)
    # dkdv: per KV tile, the Q rows of the Q tiles from the first visible one on
    q_rows = 0
    pairs_rows = 0  # sum over (visible Q tile, KV tile) of the Q tile's rows (atomic dQ)
    flushed_rows = 0  # sum over KV tiles of flushes x the tile's keys
    for j in range(nk_t):
        kv0 = j * block_kv
        it0 = 0
        if causal is not None:
            i_min = kv0 - off
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        rows = max(Nq - it0 * block_q, 0)
        q_rows += rows
        pairs_rows += rows
        flushed_rows += (tf32_bwd_flushes(group * (nq_t - it0), block_q, flush_rows)
                         * min(block_kv, Nk - kv0))
    read += bhk * Nk * (d + dv) * isz + bhk * group * q_rows * ((d + dv) * isz + 2 * acc)
    written += bhk * Nk * (d + dv) * isz
    read += bhk * flushed_rows * (d + dv) * isz
    written += bhk * flushed_rows * (d + dv) * isz
    if not deterministic:
        read += bh * pairs_rows * d * 4
        written += bh * pairs_rows * d * 4
        # flash_bwd_dq_convert
        read += dq_splits * bh * Nq * d * 4
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
# tensor cores (3xTF32), in place of flash_bwd_dkdv for float32 on both dQ paths
# ==========================================================================
# Each warp owns 16 keys: block_kv = 16 * warps, threads = 2 * block_kv.  Layout (float):
# Ks (block_kv, ks), Vs (block_kv, vs), Qs 2 x (block_q, qs), dOs 2 x (block_q, os),
# lse2 2 x block_q, D 2 x block_q, dS^T (block_kv, ts); strides: ks = qs = os = 20 mod 32 (tiles
# read as rows g and as rows 2t), vs = 16 mod 32, ts = 4 mod 32 (flash_bwd_tf32.cu says why).
# Registers per thread: dK and dV of 16 keys ((d + dv) / 2) and S^T, dP^T of block_q queries
# (block_q); BWD_TF32_MAX_ACC_REGS caps their sum (ptxas spilled beyond it).
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


def _bwd_tf32_tiling(name, check):
    """flash_bwd_tf32.cu's tiling (plain or masked: the same layout)."""
    return KernelTiling(name=name, block_q_choices=(16, 32, 64), block_kv_choices=(32, 64, 128),
                        shared_bytes=_bwd_tf32_shared, threads=lambda bq, bkv, d, dv: 2 * bkv,
                        layout=_bwd_tf32_layout, check=check, head_dims=square_head_dims(32),
                        pad_define=TC_PAD_DEFINE)


register(_bwd_tf32_tiling("flash_bwd_tf32", _bwd_tf32_check))


# flash_bwd_tf32_masked: flash_bwd_tf32.cu with -DCUFLASH_MASKS (bias and dbias, window,
# ALiBi, softcap, dropout on the S^T fragments, per element in float32), for float32 feature
# calls on the atomic path in place of flash_bwd_dkdv_masked.  The same layout and register
# budget.
def _bwd_tf32_masked_check(bq, bkv, d, dv):
    why = _bwd_tf32_check(bq, bkv, d, dv)
    return None if why is None else why.replace("flash_bwd_tf32", "flash_bwd_tf32_masked")


register(_bwd_tf32_tiling("flash_bwd_tf32_masked", _bwd_tf32_masked_check))


def plan_bwd_tf32(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                  limit_source="unlimited", masked=False):
    """flash_bwd_tf32's plan for a float32 backward (``masked``: flash_bwd_tf32_masked's, for a
    call with logit features), or None where it does not apply.

    None for other dtypes and head dims it lacks (the SIMT kernels of flash_bwd.cu run
    those).  Explicit tiles it does not take, at head dims it has, are refused with the pairs
    it takes (a ValueError), as flash_bwd_tc's and the forward's are: on the SIMT kernel they
    would run several times slower.  Both dQ paths (deterministic or not) run it.
    """
    if _dtype_name(dtype) not in TF32_DTYPES:
        return None
    name = "flash_bwd_tf32_masked" if masked else "flash_bwd_tf32"
    t = kernel_tiling(name)
    if d % 32 or dv % 32 or max(d, dv) > 128:
        return None  # head dims it lacks at every tile size
    if ((block_q is not None and block_q not in t.block_q_choices)
            or (block_kv is not None and block_kv not in t.block_kv_choices)
            or _bwd_tf32_check(block_q or 16, block_kv or 32, *t.compiled_dims(d, dv)) is not None):
        _refuse_off_tensor_cores(name, d, dv, dtype, block_q, block_kv, limit, limit_source, None)
        return None
    try:
        return plan(name, d, dv, dtype, block_q, block_kv, limit=limit, limit_source=limit_source)
    except ValueError as e:
        _refuse_off_tensor_cores(name, d, dv, dtype, block_q, block_kv, limit, limit_source,
                                 str(e))
        return None

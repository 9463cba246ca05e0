"""Launching the 16-bit tensor-core backward (``flash_bwd_tc.cu``), with or without the features.

float16/bfloat16 with head dims that are multiples of 16 on sm_80+ (the
planner's choice, :func:`cuflash.tiling.plan_flash_bwd`) run three kernels:

1. ``flash_bwd_tc_preprocess``: ``D = rowsum(dO * O)`` and ``lse * log2(e)``
   into a float32 workspace, zeroing the float32 dQ accumulator(s);
2. ``flash_bwd_tc`` (``flash_bwd_tc_masked`` with the logit features: the same
   source with ``-DCUFLASH_MASKS``, which also writes dbias): dK, dV in
   registers, dQ by float32 reds -- one block per (KV tile, kv head, batch) on
   the atomic path, or ``n_splits`` blocks per (kv head, batch) with one
   accumulator slice each when ``deterministic=True`` (:func:`dq_splits`);
3. ``flash_bwd_tc_dq_convert``: dQ = scale * (sum of the slices, in order).

The helpers (1, 3) are one module per dtype, shared by every head dim and
both variants (and the Hopper backward, flash_bwd_wgmma); the main kernel is
compiled per plan.
"""
import numpy as np

from .. import kernels, tiling
from .common import (aligned16, aligned_copies, alloc_output, array_key, cached_call,
                     flatten_lead, fold_grid, grad_shapes, kv_heads_for_kernel, launch,
                     pointer_arg, problem_dims, record_copy, sum_back)
from .features import DEFINES, Prepared, prepared_key
from .hopper import HopperMaps, materialised, tma_layout_ok

__all__ = ["build", "requests", "dq_splits", "band_fields", "round_keys"]

_FILE = "flash_bwd_tc.cu"
# flash_bwd_tc_dq_convert is grid-stride: a GPU gets enough blocks to fill it, the
# emulator (which starts the block's threads for every block) only a few
_CONVERT_BLOCKS = {"cuda": 4096, "emulator": 4}


def requests(plan):
    """``(file, kernel, defines, shared_bytes)`` of the three kernels of a plan: the helpers'
    module (one per dtype: they read the head dims from BwdParams) and the main kernel's
    (flash_bwd_tc or flash_bwd_tc_masked; the Hopper backward flash_bwd_wgmma from its own
    file)."""
    main = kernels.plan_defines(plan)
    if plan.kernel != tiling.BWD_WGMMA_KERNEL:
        main["CUFLASH_BWD_TC_MAIN"] = None
    if plan.kernel in ("flash_bwd_tc_masked", *tiling.BWD_LEAN_KERNELS):
        main.update(DEFINES)
    main.update(kernels.BUILD_DEFINES.get(plan.kernel, {}))
    helpers = {kernels.dtype_define(plan.dtype): None, "CUFLASH_BWD_TC_HELPERS": None}
    return [(_FILE, "flash_bwd_tc_preprocess", helpers, 0),
            (kernels.KERNEL_SOURCES[plan.kernel], plan.kernel, main, plan.shared_bytes),
            (_FILE, "flash_bwd_tc_dq_convert", helpers, 0)]


def band_fields(spec, ms):
    """BwdParams' ``mask_band_lo`` / ``mask_band_hi`` for the lean builds (flash_bwd_tc_band,
    _softcap, _alibi, _dropout, _alibi_dropout, _alibi_softcap): query i sees key j
    iff lo <= j - i < hi (:func:`cuflash.tiling.band_offsets`, the offsets that the other
    feature builds compute in the kernel: bwd_masks.cuh, BwdBand), clamped to [-Nq, Nk]."""
    lo, hi = tiling.band_offsets(spec.Nq, spec.Nk, spec.causal, ms.window)
    return dict(mask_band_lo=lo, mask_band_hi=hi)


# Philox4x32-10's Weyl constants: the key's halves grow by them between rounds
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def round_keys(seed):
    """The dropout builds' last ten arguments (flash_bwd_tc_dropout, flash_bwd_tc_alibi_dropout):
    Philox's round keys for ``seed`` (key halves seed's low and high 32 bits), round r's as one
    uint64, k0 + r W0 in the low word and k1 + r W1 in the high (mod 2^32;
    kernels_cu/philox.cuh, cuflash_philox4x32_10_keyed)."""
    seed = int(seed)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return tuple(np.uint64(((k0 + r * _PHILOX_W0) & 0xFFFFFFFF) | (((k1 + r * _PHILOX_W1) & 0xFFFFFFFF) << 32))
                 for r in range(10))


def _concurrent_blocks(runtime, plan):
    """Blocks of flash_bwd_tc that run at once: SMs x blocks per SM (the dQ split model).

    GPU: the multiprocessor count times what shared memory and a full register file
    (255 registers per thread) allow, at least 1.  Emulator: a nominal 4, so that the
    small test shapes run several KV tiles per split.
    """
    if runtime.name != "cuda":
        return 4
    per_sm = min(max(1, runtime.smem_limit // max(plan.shared_bytes, 1)),
                 max(1, 65536 // (255 * plan.threads)))
    return runtime.num_sms * per_sm


# flash_bwd_tc indexes the workspace's lse2 / D rows (B * H * nq_pad of them) in 32-bit
# arithmetic.  A call past that would need a workspace of over 2^31 * (2 + d) floats (> 150 GB).
MAX_WORKSPACE_ROWS = 2 ** 31 - 1


def check_workspace_rows(rows, what):
    """Refuse a backward whose workspace has more lse2 / D rows than the kernels index."""
    if rows > MAX_WORKSPACE_ROWS:
        raise ValueError(f"{what}: batch * heads * padded Nq = {rows} workspace rows; the "
                         f"tensor-core backward indexes at most {MAX_WORKSPACE_ROWS} (split the batch)")


def dq_splits(runtime, plan, n_kv_tiles, problems, deterministic):
    """dQ accumulator slices of a tensor-core backward call (1 on the atomic path)."""
    if not deterministic:
        return 1
    return tiling.bwd_dq_splits(n_kv_tiles, problems, _concurrent_blocks(runtime, plan))


def build(runtime, spec, ms, plan, do, q, k, v, o, deterministic):
    """The prepared backward: ``run(do, q, k, v, o, lse, f) -> (dq, dk, dv[, dbias])``.

    ``plan`` is the main kernel's (flash_bwd_tc, or flash_bwd_tc_masked for a call
    with features, ``ms`` its MaskSpec); the call has rows, keys and problems
    (the caller serves the empty ones).
    """
    xp = runtime.xp
    dtype, acc = spec.dtype, np.dtype(np.float32)
    Nq, Nk, d, lead = spec.Nq, spec.Nk, spec.d, spec.lead
    B, H = problem_dims(lead)
    Hk, group = kv_heads_for_kernel(spec)
    want, summed, alloc_shape = grad_shapes(spec, q, k, v, Hk)
    hopper = plan.kernel == tiling.BWD_WGMMA_KERNEL
    full = False  # the Hopper kernel's copies of inputs its tensor maps cannot step
    if hopper:
        flat = [flatten_lead(runtime, x, lead) for x in (q, k, v, do)]
        layouts = [((B, H), Nq), ((B, Hk), Nk), ((B, Hk), Nk), ((B, H), Nq)]
        full = not all(tma_layout_ok(bh, rows, st, q.itemsize)
                       for (bh, rows), (_, st) in zip(layouts, flat))
        if full:
            q, k, v, do = _full_inputs(xp, spec, Hk, q, k, v, do)
    flat = [flatten_lead(runtime, x, lead) for x in (q, k, v, o, do)]
    strides = [st for _, st in flat]
    copies = [a is not x for (a, _), x in zip(flat, (q, k, v, o, do))]
    qs, ks, vs, os_, dos = strides
    bq, bkv = plan.block_q, plan.block_kv
    n_q_tiles, n_kv_tiles = -(-Nq // bq), -(-Nk // bkv)
    nq_pad = n_q_tiles * bq
    n_splits = dq_splits(runtime, plan, n_kv_tiles, B * Hk, deterministic)
    n_kv_blocks = n_splits if deterministic else n_kv_tiles
    n_rows = B * H * Nq
    rows_pad = B * H * nq_pad
    ws_size = 2 * rows_pad + n_splits * n_rows * d  # lse2, D, then the dQ accumulator slices
    # preprocess: a GPU gets blocks of 64 rows; the emulator (which starts every block's
    # threads) one block per head
    pre_rows = 64 if runtime.name == "cuda" else nq_pad
    n_pre = -(-nq_pad // pre_rows)
    feats = Prepared(runtime, spec, ms, acc)
    base = dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d, head_d=d, head_dv=spec.dv,
        dq_accum_offset=2 * rows_pad, scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=1,
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=rows_pad, dq_slice_stride=n_rows * d, nq_pad=nq_pad, n_splits=n_splits,
        n_kv_blocks=n_kv_blocks)
    if plan.kernel in tiling.BWD_LEAN_KERNELS:
        base.update(band_fields(spec, ms))
    params = feats.params("BwdParams", base)
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    check_workspace_rows(rows_pad, what)
    pre_grid = fold_grid(n_pre, H, B, what)
    main_grid = fold_grid(n_kv_blocks, Hk, B, what)
    conv_blocks = max(1, min(-(-n_rows * d // (4 * tiling.BWD_TC_CONVERT_THREADS)),
                             _CONVERT_BLOCKS.get(runtime.name, 4)))
    pre, main, conv = kernels.get_functions(runtime, requests(plan))
    maps = (HopperMaps(runtime, [((B, H), Nq, d, qs, 64), ((B, Hk), Nk, d, ks, 64),
                                 ((B, Hk), Nk, d, vs, 64), ((B, H), Nq, d, dos, 64)])
            if hopper else None)
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    drop_build = plan.kernel in (tiling.BWD_DROPOUT_KERNEL, tiling.BWD_ALIBI_DROPOUT_KERNEL)
    back = sum_back(xp, acc, dtype, want, summed)

    def run(do, q, k, v, o, lse, f=None):
        if full:
            q, k, v, do = _full_inputs(xp, spec, Hk, q, k, v, do)
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead)[0]
        if not all(aligned16(x, st) for x, st in zip(ins, strides)):
            # rows that cp.async / 16-byte loads cannot read aligned (a rare view):
            # contiguous copies, prepared once per layout
            return _misaligned(runtime, spec, ms, plan, ins, lse, deterministic, f)
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if lse.dtype != np.float32 or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=np.float32)  # (B, H, Nq)
        extra = feats.args(f)
        p = params(f)
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), np.float32,
                          "workspace: lse2, D, float32 dQ accumulator(s)")
        db = feats.dbias_args()
        launch(rt_name, pre, "flash_bwd_tc_preprocess", pre_grid, (tiling.BWD_TC_PRE_THREADS,),
               (o_, do_, lse, ws, p), 0)
        args = (q_, k_, v_, do_, ws, dk, dv_, p) + extra + db
        if drop_build:
            args += round_keys(f.seed)
        if maps is not None:
            args = maps(q_, k_, v_, do_) + args
        launch(rt_name, main, plan.kernel, main_grid, (plan.threads,), args, plan.shared_bytes)
        launch(rt_name, conv, "flash_bwd_tc_dq_convert", (conv_blocks,),
               (tiling.BWD_TC_CONVERT_THREADS,), (ws, dq, p), 0)
        return (back(dq, "dq"), back(dk, "dk"), back(dv_, "dv")) + feats.dbias_result(db)
    return run


def _full_inputs(xp, spec, Hk, q, k, v, do):
    """q, k, v, do at their full problem shapes, contiguous (the Hopper kernel's tensor maps)."""
    kv_lead = spec.lead[:-1] + (Hk,) if spec.group > 1 else spec.lead
    return materialised(xp, [(q, spec.lead + q.shape[-2:]), (k, kv_lead + k.shape[-2:]),
                             (v, kv_lead + v.shape[-2:]), (do, spec.lead + do.shape[-2:])],
                        record_copy)


def _misaligned(runtime, spec, ms, plan, ins, lse, deterministic, f):
    """Inputs whose rows 16-byte copies cannot read aligned: run on contiguous copies."""
    q, k, v, o, do = aligned_copies(runtime.xp, ins)
    key = ("bwd_tc-aligned", spec, prepared_key(ms), plan.kernel, plan.block_q, plan.block_kv,
           deterministic) + array_key(q, k, v, o, do)
    run = cached_call(runtime, key,
                      lambda: build(runtime, spec, ms, plan, do, q, k, v, o, deterministic))
    return run(do, q, k, v, o, lse, f)

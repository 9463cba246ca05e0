"""Launching the SIMT backward (``flash_bwd.cu``), with or without the logit features.

Every dtype and head dim the planner gives the SIMT kernels; a call with
features runs the same kernels compiled with ``-DCUFLASH_MASKS`` (their
``_masked`` names):

1. ``flash_bwd_preprocess``: ``D = rowsum(dO * O)`` (and, on the atomic path,
   zeroes a float32 dQ accumulator);
2. ``flash_bwd_dkdv``: dK, dV (K/V tile resident, Q/dO/lse/D streamed, P
   recomputed from lse), looping over the query heads of a grouped-query group
   inside the block; with the features it also writes dbias;
3. dQ, either ``flash_bwd_dq`` (a separate pass, Q tile resident, K/V
   streamed: no atomics, bitwise repeatable) when ``deterministic=True`` or the
   dtype is float64 (there is no double ``gatomic_add``), or float32 atomics
   from the dK/dV kernel followed by ``flash_bwd_dq_convert`` otherwise.

float32 on a GPU with tensor cores computes step 2 with ``flash_bwd_tf32``
(``flash_bwd_tf32.cu``, 3xTF32; ``flash_bwd_tf32_masked`` with the features)
where it plans and cp.async can read the rows (element strides of q, k, v, do
multiples of 4, 16-byte aligned views), and dQ always by its atomics and
``flash_bwd_dq_convert``: into one accumulator (one launch, a block per KV
tile), or with ``deterministic=True`` into one slice per block slot: launches
in waves of ``n_splits`` slots per (kv head, batch)
(:func:`cuflash.launch.bwd_tc.dq_splits`), slot j of a wave running KV tile
wave * n_splits + j into slice j, the slices summed in order -- bitwise
repeatable.  A view that turns out misaligned at call time runs the SIMT kernels
instead (prepared once), as do explicit ``kernel`` choices.
"""
import numpy as np

from .. import kernels, tiling
from .common import (acc_dtype, aligned16, alloc_output, flatten_lead, fold_grid, grad_shapes,
                     kv_heads_for_kernel, launch, pointer_arg, problem_dims, sum_back,
                     zero_grads)
from .bwd_tc import dq_splits
from .features import DEFINES, Prepared

__all__ = ["build", "plans", "tf32_plan"]

_FILE = "flash_bwd.cu"
_TF32_FILE = "flash_bwd_tf32.cu"
# flash_bwd_dq_convert is grid-stride: a GPU gets enough blocks to fill it, the
# emulator (which starts the block's threads for every block) only a few
_CONVERT_BLOCKS = {"cuda": 4096, "emulator": 4}


def plans(runtime, d, dv, dtype, block_q=None, block_kv=None, masked=False):
    """(dkdv, dq, preprocess) plans: flash_bwd_dq runs with dkdv's tiles (one module).

    ``masked``: the plans of flash_bwd_dkdv_masked / flash_bwd_dq_masked (the features).
    """
    suffix = "_masked" if masked else ""
    plan = runtime.plan("flash_bwd_dkdv" + suffix, d, dv, dtype, block_q, block_kv)
    dq_plan = runtime.plan("flash_bwd_dq" + suffix, d, dv, dtype, plan.block_q, plan.block_kv)
    pre_plan = runtime.plan("flash_bwd_preprocess", d, dv, dtype)
    return plan, dq_plan, pre_plan


def tf32_plan(runtime, d, dv, dtype, block_q=None, block_kv=None, masked=False):
    """flash_bwd_tf32's plan (float32 on sm_80+; ``masked``: flash_bwd_tf32_masked's), or
    None: the SIMT dK/dV kernel runs."""
    if not runtime.tensor_cores:
        return None
    return tiling.plan_bwd_tf32(d, dv, dtype, block_q, block_kv, limit=runtime.smem_limit,
                                limit_source=runtime.smem_source, masked=masked)


def build(runtime, spec, ms, do, q, k, v, o, deterministic, allow_tf32=True):
    """The prepared backward: ``run(do, q, k, v, o, lse, f) -> (dq, dk, dv[, dbias])``.

    ``ms`` is the call's MaskSpec (None: a plain call); ``allow_tf32`` False keeps
    the SIMT dK/dV kernel (a forced kernel, or the misaligned fallback).
    """
    xp = runtime.xp
    dtype, acc = spec.dtype, acc_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    masked = ms is not None
    plan, dq_plan, pre_plan = plans(runtime, d, dv, dtype, spec.block_q, spec.block_kv, masked)
    B, H = problem_dims(spec.lead)
    if Nq == 0 or Nk == 0 or B * H == 0:
        return zero_grads(xp, spec, q, k, v, ms)  # no query rows or no keys: every gradient is 0
    Hk, group = kv_heads_for_kernel(spec)
    lead = spec.lead
    want, summed, alloc_shape = grad_shapes(spec, q, k, v, Hk)
    flat = [flatten_lead(runtime, x, lead) for x in (q, k, v, o, do)]
    (_, qs), (_, ks), (_, vs), (_, os_), (_, dos) = flat
    copies = [a is not x for (a, _), x in zip(flat, (q, k, v, o, do))]

    tf32 = None
    if allow_tf32 and dtype != np.float64:
        tf32 = tf32_plan(runtime, d, dv, dtype, spec.block_q, spec.block_kv, masked)
        if tf32 is not None and any(st % 4 for st in qs + ks + vs + dos):
            tf32 = None  # cp.async reads 16-byte rows
    # dQ through float32 accumulator slices (atomic adds, then flash_bwd_dq_convert), or by the
    # flash_bwd_dq pass
    atomic = tf32 is not None or (not deterministic and dtype != np.float64)
    n_rows = B * H * Nq
    n_kv_tiles = -(-Nk // (tf32 or plan).block_kv)
    n_splits = dq_splits(runtime, tf32, n_kv_tiles, B * Hk, deterministic) if tf32 else 1
    # flash_bwd_tf32's launches: (first KV tile, slots per (kv head, batch)) of each wave
    waves = ([(w, min(n_splits, n_kv_tiles - w)) for w in range(0, n_kv_tiles, n_splits)]
             if tf32 is not None and deterministic else [(0, n_kv_tiles)])
    # D, then the float32 dQ accumulator slice(s) from a 256-byte boundary (flash_bwd_tf32
    # adds 16-byte vectors into its rows)
    dq_offset = -(-n_rows // 64) * 64
    ws_size = dq_offset + n_splits * n_rows * d if atomic else n_rows
    pre_rows = pre_plan.block_q
    if runtime.name != "cuda":  # the emulator starts every block's threads: few big blocks
        pre_rows = -(-Nq // pre_rows) * pre_rows
    n_pre = -(-Nq // pre_rows)
    n_q_tiles = -(-Nq // dq_plan.block_q)
    feats = Prepared(runtime, spec, ms, acc)
    params = feats.params("BwdParams", dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d, head_d=d, head_dv=dv,
        dq_accum_offset=dq_offset,
        scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=int(atomic),
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=0, dq_slice_stride=n_rows * d if n_splits > 1 else 0, nq_pad=0,
        n_splits=n_splits, n_kv_blocks=n_kv_tiles))

    defines = kernels.plan_defines(plan)
    if masked:
        defines.update(DEFINES)
    if tf32 is not None:
        tf32_defines = kernels.plan_defines(tf32)
        if masked:
            tf32_defines.update(DEFINES)
        dkdv_plan, dkdv_request = tf32, (_TF32_FILE, tf32.kernel, tf32_defines,
                                         tf32.shared_bytes)
    else:
        dkdv_plan, dkdv_request = plan, (_FILE, plan.kernel, defines, plan.shared_bytes)
    last = ("flash_bwd_dq_convert", 0) if atomic else (dq_plan.kernel, dq_plan.shared_bytes)
    pre, dkdv, fin = kernels.get_functions(runtime, [
        (_FILE, "flash_bwd_preprocess", defines, pre_plan.shared_bytes), dkdv_request,
        (_FILE, last[0], defines, last[1])])
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    pre_launch = (pre, "flash_bwd_preprocess", fold_grid(n_pre, H, B, what),
                  (pre_plan.threads,), pre_plan.shared_bytes)
    dkdv_launch = (dkdv, dkdv_request[1], fold_grid(n_kv_tiles, Hk, B, what),
                   (dkdv_plan.threads,), dkdv_plan.shared_bytes)
    tf32_grids = [(np.int32(t0), np.int32(n), fold_grid(n, Hk, B, what)) for t0, n in waves]
    if atomic:
        blocks = max(1, min(-(-n_rows * d // tiling.BWD_THREADS),
                            _CONVERT_BLOCKS.get(runtime.name, 4)))
        fin_launch = (fin, "flash_bwd_dq_convert", (blocks,), (tiling.BWD_THREADS,), 0)
    else:
        fin_launch = (fin, dq_plan.kernel, fold_grid(n_q_tiles, H, B, what),
                      (dq_plan.threads,), dq_plan.shared_bytes)
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    fallback = []
    back = sum_back(xp, acc, dtype, want, summed)

    def run(do, q, k, v, o, lse, f=None):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead)[0]
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if tf32 is not None and not all(aligned16(x, st) for x, st in
                                        ((q_, qs), (k_, ks), (v_, vs), (do_, dos))):
            # a view starting off a 16-byte boundary: the SIMT kernels, prepared once
            if not fallback:
                fallback.append(build(runtime, spec, ms, do, q, k, v, o, deterministic, False))
            return fallback[0](do, q, k, v, o, lse, f)
        if lse.dtype != acc or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=acc)  # (B, H, Nq) in the accumulator type
        extra = feats.args(f)
        p = params(f)
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), acc, "workspace: D (+ float32 dQ accumulator)")
        db = feats.dbias_args()
        fn, name, grid, block, smem = pre_launch
        launch(rt_name, fn, name, grid, block, (o_, do_, ws, ws, p), smem)
        fn, name, grid, block, smem = dkdv_launch
        if tf32 is None:
            launch(rt_name, fn, name, grid, block,
                   (q_, k_, v_, do_, lse, ws, dk, dv_, ws, p) + extra + db, smem)
        else:  # the waves, in stream order (one on the atomic path)
            for t0, n, grid in tf32_grids:
                launch(rt_name, fn, name, grid, block,
                       (q_, k_, v_, do_, lse, ws, dk, dv_, ws, t0, n, p) + extra + db, smem)
        fn, name, grid, block, smem = fin_launch
        if atomic:
            launch(rt_name, fn, name, grid, block, (ws, dq, p), smem)
        else:
            launch(rt_name, fn, name, grid, block, (q_, k_, v_, do_, lse, ws, dq, p) + extra,
                   smem)
        return (back(dq, "dq"), back(dk, "dk"), back(dv_, "dv")) + feats.dbias_result(db)
    return run

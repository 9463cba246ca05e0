"""Launching the backward kernels (``flash_bwd_tc.cu``, ``flash_bwd.cu``) for "cuda" and "emulator".

:func:`tiled_attention_backward` runs the FlashAttention-2 backward on a
:class:`cuflash.kernels.Runtime`, so CuPy arrays on a GPU and NumPy arrays on
the emulator go through the same code.  Which kernels run is the planner's
choice (:func:`cuflash.tiling.plan_flash_bwd`): float16/bfloat16 with head dims
that are multiples of 16 on sm_80+ run the tensor-core backward
(``kernels_cu/flash_bwd_tc.cu``):

1. ``flash_bwd_tc_preprocess``: ``D = rowsum(dO * O)`` and ``lse * log2(e)``
   into a float32 workspace, zeroing the float32 dQ accumulator(s);
2. ``flash_bwd_tc``: dK, dV in registers, dQ by float32 reds -- one block per
   (KV tile, kv head, batch) on the atomic path, or ``n_splits`` blocks per
   (kv head, batch) with one accumulator slice each when ``deterministic=True``
   (:func:`cuflash.tiling.bwd_dq_splits`);
3. ``flash_bwd_tc_dq_convert``: dQ = scale * (sum of the slices, in order).

Everything else runs the SIMT kernels of ``kernels_cu/flash_bwd.cu``:

1. ``flash_bwd_preprocess``: ``D = rowsum(dO * O)`` (and, on the atomic path,
   zeroes a float32 dQ accumulator);
2. ``flash_bwd_dkdv``: dK, dV (K/V tile resident, Q/dO/lse/D streamed, P
   recomputed from lse), looping over the query heads of a grouped-query group
   inside the block;
3. dQ, either ``flash_bwd_dq`` (a separate pass, Q tile resident, K/V
   streamed: no atomics, bitwise repeatable) when ``deterministic=True`` or the
   dtype is float64 (there is no double ``gatomic_add``), or float32 atomics
   from ``flash_bwd_dkdv`` followed by ``flash_bwd_dq_convert`` otherwise.

float32 on sm_80+ with deterministic=False runs ``flash_bwd_tf32``
(``kernels_cu/flash_bwd_tf32.cu``, 3xTF32 tensor cores) in place of
``flash_bwd_dkdv``; preprocess and the dQ conversion stay the SIMT ones.

As in the forward, the first call of a kind validates, plans, compiles (all
modules of the call concurrently: :func:`cuflash.kernels.get_functions`) and
packs one ``BwdParams`` block; an identical later call allocates its outputs
and one workspace (D and the float32 dQ accumulator) and launches.

Broadcasting: q, k, v, o, do are read through element strides (broadcast axes
have stride 0, nothing is copied for them).  Each kernel writes one gradient
per problem it computes -- dq per query head problem ``lead``, dk/dv per kv
head and batch entry -- and the gradients of inputs that were broadcast along
a leading axis are summed over it here on the host (``xp.sum`` in the
accumulator precision, then rounded once more to the input dtype).  Heads of
a grouped-query (or MQA: one kv head) group are summed inside the dkdv block.
"""
import numpy as np

from . import kernels, tiling
from ._launch import (aligned16, aligned_copies, alloc_output, cached_call, flatten_lead, fold_grid,
                      kv_heads_for_kernel, launch, make_params, pointer_arg, problem_dims)
from ._validate import check_backward_inputs
from .reference import sum_to_shape

__all__ = ["tiled_attention_backward", "flash_bwd", "kv_heads_for_kernel", "kernels_needed",
           "plan_backward", "dq_splits", "tc_setup"]

_FILE = "flash_bwd.cu"
_TC_FILE = "flash_bwd_tc.cu"

# flash_bwd_dq_convert is grid-stride: a GPU gets enough blocks to fill it, the
# emulator (which starts the block's threads for every block) only a few.
_CONVERT_BLOCKS = {"cuda": 4096, "emulator": 4}


def _acc_dtype(dtype):
    return np.dtype(np.float64) if tiling.accumulator_bytes(dtype) == 8 else np.dtype(np.float32)


def plan_backward(runtime, d, dv, dtype, block_q=None, block_kv=None, kernel=None, masked=False):
    """The main backward kernel's plan on this runtime (flash_bwd_tc or flash_bwd_dkdv; with
    ``masked``, their _masked kernels)."""
    return tiling.plan_flash_bwd(d, dv, dtype, block_q, block_kv, limit=runtime.smem_limit,
                                 limit_source=runtime.smem_source, kernel=kernel,
                                 tensor_cores=runtime.tensor_cores, masked=masked)


def _plans(runtime, d, dv, dtype, block_q=None, block_kv=None, masked=False):
    """(dkdv, dq, preprocess) plans: flash_bwd_dq runs with dkdv's tiles (one module).

    ``masked``: the plans of flash_bwd_dkdv_masked / flash_bwd_dq_masked (the features).
    """
    suffix = "_masked" if masked else ""
    plan = runtime.plan("flash_bwd_dkdv" + suffix, d, dv, dtype, block_q, block_kv)
    dq_plan = runtime.plan("flash_bwd_dq" + suffix, d, dv, dtype, plan.block_q, plan.block_kv)
    pre_plan = runtime.plan("flash_bwd_preprocess", d, dv, dtype)
    return plan, dq_plan, pre_plan


def _tc_requests(plan):
    """The two modules of the tensor-core backward: helpers (dtype, d, dv) and the main kernel
    (flash_bwd_tc, or flash_bwd_tc_masked with -DCUFLASH_MASKS; the helpers are the same)."""
    main = kernels.plan_defines(plan)
    main["CUFLASH_BWD_TC_MAIN"] = None
    if plan.kernel == "flash_bwd_tc_masked":
        main["CUFLASH_MASKS"] = None
    helpers = {kernels.dtype_define(plan.dtype): None, "CUFLASH_HEAD_DIM": plan.d,
               "CUFLASH_HEAD_DIM_V": plan.dv, "CUFLASH_BWD_TC_HELPERS": None}
    return [(_TC_FILE, "flash_bwd_tc_preprocess", helpers, 0),
            (_TC_FILE, plan.kernel, main, plan.shared_bytes),
            (_TC_FILE, "flash_bwd_tc_dq_convert", helpers, 0)]


def _tf32_plan(runtime, spec, masked=False):
    """flash_bwd_tf32's plan for this call (float32 on sm_80+; ``masked``: flash_bwd_tf32_masked's),
    or None: flash_bwd_dkdv (flash_bwd_dkdv_masked) runs."""
    if not runtime.tensor_cores:
        return None
    return tiling.plan_bwd_tf32(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv,
                                limit=runtime.smem_limit, limit_source=runtime.smem_source,
                                masked=masked)


def kernels_needed(runtime, d, dv, dtype):
    """``(filename, kernel, defines, shared_bytes)`` of a default-tile backward (for precompile)."""
    main = plan_backward(runtime, d, dv, dtype)
    if main.kernel == "flash_bwd_tc":
        return _tc_requests(main)
    plan, dq_plan, pre_plan = _plans(runtime, d, dv, dtype)
    defines = kernels.plan_defines(plan)
    out = [(_FILE, "flash_bwd_preprocess", defines, pre_plan.shared_bytes),
           (_FILE, "flash_bwd_dkdv", defines, plan.shared_bytes),
           (_FILE, "flash_bwd_dq", defines, dq_plan.shared_bytes),
           (_FILE, "flash_bwd_dq_convert", defines, 0)]
    tf32 = (tiling.plan_bwd_tf32(d, dv, dtype, limit=runtime.smem_limit,
                                 limit_source=runtime.smem_source)
            if runtime.tensor_cores else None)
    if tf32 is not None:  # float32's default (atomic dQ) path
        out.append(("flash_bwd_tf32.cu", "flash_bwd_tf32", kernels.plan_defines(tf32),
                    tf32.shared_bytes))
    return out


def _outputs(spec, q, k, v, Hk):
    """Shapes to allocate per gradient, and which are summed back to a broadcast input's shape."""
    lead = spec.lead
    kv_lead = tuple(lead[:-1]) + (Hk,) if lead else ()
    full = {"dq": tuple(lead) + (spec.Nq, spec.d), "dk": kv_lead + (spec.Nk, spec.d),
            "dv": kv_lead + (spec.Nk, spec.dv)}
    want = {"dq": tuple(q.shape), "dk": tuple(k.shape), "dv": tuple(v.shape)}
    summed = {n: int(np.prod(want[n], dtype=np.int64)) != int(np.prod(full[n], dtype=np.int64))
              for n in full}
    alloc_shape = {n: full[n] if summed[n] else want[n] for n in full}
    return want, summed, alloc_shape


def _sum_back(xp, acc, dtype, want, summed):
    def sum_back(g, name):
        if not summed[name]:
            return g
        # sums in the accumulator precision, rounded once to the input dtype
        return xp.ascontiguousarray(sum_to_shape(g.astype(acc), want[name]).astype(dtype))
    return sum_back




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


def dq_splits(runtime, plan, n_kv_tiles, problems, deterministic):
    """dQ accumulator slices of a tensor-core backward call (1 on the atomic path)."""
    if not deterministic:
        return 1
    return tiling.bwd_dq_splits(n_kv_tiles, problems, _concurrent_blocks(runtime, plan))


def _aligned_inputs(arrays, strides):
    return all(aligned16(x, s) for x, s in zip(arrays, strides))


class _TcSetup:
    """What one tensor-core backward call needs besides its kernels (:func:`tc_setup`)."""


def tc_setup(runtime, spec, plan, q, k, v, o, do, deterministic):
    """The shapes, strides, workspace, grids and BwdParams fields of a tensor-core backward
    call (flash_bwd_tc, and flash_bwd_tc_masked with the features' fields added)."""
    Nq, Nk, d = spec.Nq, spec.Nk, spec.d
    B, H = problem_dims(spec.lead)
    Hk, group = kv_heads_for_kernel(spec)
    t = _TcSetup()
    t.want, t.summed, t.alloc_shape = _outputs(spec, q, k, v, Hk)
    grouped = group > 1
    t.groups_of = (False, grouped, grouped, False, False)
    flat = [flatten_lead(runtime, x, spec.lead, gr) for x, gr in zip((q, k, v, o, do), t.groups_of)]
    t.strides = [st for _, st in flat]
    t.copies = [a is not x for (a, _), x in zip(flat, (q, k, v, o, do))]
    qs, ks, vs, os_, dos = t.strides
    bq, bkv = plan.block_q, plan.block_kv
    n_q_tiles, n_kv_tiles = -(-Nq // bq), -(-Nk // bkv)
    nq_pad = n_q_tiles * bq
    n_splits = dq_splits(runtime, plan, n_kv_tiles, B * Hk, deterministic)
    n_kv_blocks = n_splits if deterministic else n_kv_tiles
    n_rows = B * H * Nq
    rows_pad = B * H * nq_pad
    t.ws_size = 2 * rows_pad + n_splits * n_rows * d  # lse2, D, then the dQ accumulator slices
    # preprocess: a GPU gets blocks of 64 rows; the emulator (which starts every block's
    # threads) one block per head
    pre_rows = 64 if runtime.name == "cuda" else nq_pad
    n_pre = -(-nq_pad // pre_rows)
    t.fields = dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d, head_d=d, head_dv=spec.dv,
        dq_accum_offset=2 * rows_pad, scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=1,
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=rows_pad, dq_slice_stride=n_rows * d, nq_pad=nq_pad, n_splits=n_splits,
        n_kv_blocks=n_kv_blocks)
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    t.pre_grid = fold_grid(n_pre, H, B, what)
    t.main_grid = fold_grid(n_kv_blocks, Hk, B, what)
    t.conv_blocks = max(1, min(-(-n_rows * d // (4 * tiling.BWD_TC_CONVERT_THREADS)),
                               _CONVERT_BLOCKS.get(runtime.name, 4)))
    return t


def _build(runtime, spec, do, q, k, v, o, deterministic, kernel=None):
    """The prepared backward: ``run(do, q, k, v, o, lse) -> (dq, dk, dv)``."""
    main = plan_backward(runtime, spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv, kernel)
    if main.kernel == "flash_bwd_tc":
        return _build_tc(runtime, spec, main, do, q, k, v, o, deterministic, kernel)
    return _build_simt(runtime, spec, do, q, k, v, o, deterministic)


def _build_tc(runtime, spec, plan, do, q, k, v, o, deterministic, kernel):
    """The tensor-core backward (flash_bwd_tc.cu) for float16/bfloat16."""
    xp = runtime.xp
    dtype = spec.dtype
    B, H = problem_dims(spec.lead)
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if spec.Nq == 0 or spec.Nk == 0 or B * H == 0:
        def run_empty(do, q, k, v, o, lse):
            return (xp.zeros(q_shape, dtype), xp.zeros(k_shape, dtype), xp.zeros(v_shape, dtype))
        return run_empty

    lead = spec.lead
    t = tc_setup(runtime, spec, plan, q, k, v, o, do, deterministic)
    want, summed, alloc_shape = t.want, t.summed, t.alloc_shape
    groups_of, strides, copies = t.groups_of, t.strides, t.copies
    ws_size = t.ws_size
    params = make_params(runtime, "BwdParams", **t.fields)
    pre, main, conv = kernels.get_functions(runtime, _tc_requests(plan))
    pre_grid, main_grid, conv_blocks = t.pre_grid, t.main_grid, t.conv_blocks
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    sum_back = _sum_back(xp, _acc_dtype(dtype), dtype, want, summed)

    def run(do, q, k, v, o, lse):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead, groups_of[i])[0]
        if not _aligned_inputs(ins, strides):  # cp.async / 16-byte loads need aligned rows
            return _misaligned(runtime, spec, ins, lse, deterministic, kernel)
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if lse.dtype != np.float32 or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=np.float32)  # (B, H, Nq)
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), np.float32,
                          "workspace: lse2, D, float32 dQ accumulator(s)")
        launch(rt_name, pre, "flash_bwd_tc_preprocess", pre_grid, (tiling.BWD_TC_PRE_THREADS,),
               (o_, do_, lse, ws, params), 0)
        launch(rt_name, main, "flash_bwd_tc", main_grid, (plan.threads,),
               (q_, k_, v_, do_, ws, dk, dv_, params), plan.shared_bytes)
        launch(rt_name, conv, "flash_bwd_tc_dq_convert", (conv_blocks,),
               (tiling.BWD_TC_CONVERT_THREADS,), (ws, dq, params), 0)
        return sum_back(dq, "dq"), sum_back(dk, "dk"), sum_back(dv_, "dv")
    return run


def _misaligned(runtime, spec, ins, lse, deterministic, kernel):
    """Inputs whose rows 16-byte copies cannot read aligned: run on contiguous copies."""
    q, k, v, o, do = aligned_copies(runtime.xp, ins)
    key = _key(do, q, k, v, o, lse, spec.scale, spec.causal, spec.block_q, spec.block_kv,
               deterministic, kernel)
    run = cached_call(runtime, key,
                      lambda: _build(runtime, spec, do, q, k, v, o, deterministic, kernel))
    return run(do, q, k, v, o, lse)


def _build_simt(runtime, spec, do, q, k, v, o, deterministic, allow_tf32=True):
    """The SIMT backward (flash_bwd.cu): every dtype and head dim; float32 on sm_80+ on the
    atomic path with flash_bwd_tf32 (flash_bwd_tf32.cu) in place of flash_bwd_dkdv."""
    xp = runtime.xp
    dtype, acc = spec.dtype, _acc_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    plan, dq_plan, pre_plan = _plans(runtime, d, dv, dtype, spec.block_q, spec.block_kv)
    B, H = problem_dims(spec.lead)
    Hk, group = kv_heads_for_kernel(spec)
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)

    if Nq == 0 or Nk == 0 or B * H == 0:
        # no query rows or no keys: every gradient is zero (or empty)
        def run_empty(do, q, k, v, o, lse):
            return (xp.zeros(q_shape, dtype), xp.zeros(k_shape, dtype), xp.zeros(v_shape, dtype))
        return run_empty

    lead = spec.lead
    # a gradient whose input was broadcast is computed at the full shape, then summed
    want, summed, alloc_shape = _outputs(spec, q, k, v, Hk)

    grouped = group > 1
    flat = [flatten_lead(runtime, x, lead, g) for x, g in
            ((q, False), (k, grouped), (v, grouped), (o, False), (do, False))]
    (_, qs), (_, ks), (_, vs), (_, os_), (_, dos) = flat
    copies = [a is not x for (a, _), x in zip(flat, (q, k, v, o, do))]
    groups_of = (False, grouped, grouped, False, False)

    atomic = not deterministic and dtype != np.float64
    # float32 on the atomic path: flash_bwd_tf32.cu (3xTF32 tensor cores) replaces flash_bwd_dkdv
    # (cp.async reads 16-byte rows: element strides of q, k, v, do must be multiples of 4)
    tf32 = _tf32_plan(runtime, spec) if atomic and allow_tf32 else None
    if tf32 is not None and any(st % 4 for st in qs + ks + vs + dos):
        tf32 = None
    n_rows = B * H * Nq
    ws_size = n_rows * (1 + d) if atomic else n_rows  # D, then the float32 dQ accumulator
    pre_rows = pre_plan.block_q
    if runtime.name != "cuda":  # the emulator starts every block's threads: few big blocks
        pre_rows = -(-Nq // pre_rows) * pre_rows
    n_pre = -(-Nq // pre_rows)
    n_q_tiles = -(-Nq // dq_plan.block_q)
    n_kv_tiles = -(-Nk // (tf32 or plan).block_kv)
    params = make_params(
        runtime, "BwdParams",
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d, head_d=d, head_dv=dv,
        dq_accum_offset=n_rows,
        scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=int(atomic),
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=0, dq_slice_stride=0, nq_pad=0, n_splits=1, n_kv_blocks=n_kv_tiles)

    defines = kernels.plan_defines(plan)
    last = ("flash_bwd_dq_convert", 0) if atomic else ("flash_bwd_dq", dq_plan.shared_bytes)
    dkdv_kernel = (("flash_bwd_tf32.cu", "flash_bwd_tf32", kernels.plan_defines(tf32), tf32)
                   if tf32 else (_FILE, "flash_bwd_dkdv", defines, plan))
    pre, dkdv, fin = kernels.get_functions(runtime, [
        (_FILE, "flash_bwd_preprocess", defines, pre_plan.shared_bytes),
        dkdv_kernel[:3] + (dkdv_kernel[3].shared_bytes,),
        (_FILE, last[0], defines, last[1])])
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    pre_launch = (pre, "flash_bwd_preprocess", fold_grid(n_pre, H, B, what),
                  (pre_plan.threads,), pre_plan.shared_bytes)
    dkdv_launch = (dkdv, dkdv_kernel[1], fold_grid(n_kv_tiles, Hk, B, what),
                   (dkdv_kernel[3].threads,), dkdv_kernel[3].shared_bytes)
    if atomic:
        blocks = max(1, min(-(-n_rows * d // tiling.BWD_THREADS),
                            _CONVERT_BLOCKS.get(runtime.name, 4)))
        fin_launch = (fin, "flash_bwd_dq_convert", (blocks,), (tiling.BWD_THREADS,), 0)
    else:
        fin_launch = (fin, "flash_bwd_dq", fold_grid(n_q_tiles, H, B, what),
                      (dq_plan.threads,), dq_plan.shared_bytes)
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    fallback = []

    sum_back = _sum_back(xp, acc, dtype, want, summed)

    def run(do, q, k, v, o, lse):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead, groups_of[i])[0]
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if tf32 is not None and not all(aligned16(x, st) for x, st in
                                        ((q_, qs), (k_, ks), (v_, vs), (do_, dos))):
            # a view starting off a 16-byte boundary: the SIMT kernels, prepared once
            if not fallback:
                fallback.append(_build_simt(runtime, spec, do, q, k, v, o, deterministic, False))
            return fallback[0](do, q, k, v, o, lse)
        if lse.dtype != acc or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=acc)  # (B, H, Nq) in the accumulator type
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), acc, "workspace: D (+ float32 dQ accumulator)")
        fn, name, grid, block, smem = pre_launch
        launch(rt_name, fn, name, grid, block, (o_, do_, ws, ws, params), smem)
        fn, name, grid, block, smem = dkdv_launch
        launch(rt_name, fn, name, grid, block,
               (q_, k_, v_, do_, lse, ws, dk, dv_, ws, params), smem)
        fn, name, grid, block, smem = fin_launch
        if atomic:
            launch(rt_name, fn, name, grid, block, (ws, dq, params), smem)
        else:
            launch(rt_name, fn, name, grid, block, (q_, k_, v_, do_, lse, ws, dq, params), smem)
        return sum_back(dq, "dq"), sum_back(dk, "dk"), sum_back(dv_, "dv")
    return run


def _key(do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic, kernel=None):
    try:
        return ("bwd", do.shape, do.strides, do.dtype, q.shape, q.strides, q.dtype,
                k.shape, k.strides, k.dtype, v.shape, v.strides, v.dtype,
                o.shape, o.strides, o.dtype, lse.shape, lse.dtype,
                scale.__class__, scale, causal.__class__, causal, block_q.__class__, block_q,
                block_kv.__class__, block_kv, deterministic.__class__, deterministic, kernel)
    except AttributeError:  # not arrays (lse=None, a list, ...): validation says what is wrong
        return None


def tiled_attention_backward(runtime, do, q, k, v, o, lse, scale, causal, block_q, block_kv,
                             deterministic):
    """The flash attention backward on the kernels: ``(dq, dk, dv)``.

    Arguments as :func:`cuflash.tiled_attention_backward`.  ``lse`` may have any
    float dtype and layout; it is read as float32 (float64 for float64 inputs).

    Raises
    ------
    ValueError
        Tiles or head dims the kernels do not support, or shared memory beyond
        the device's budget (from cuflash.tiling), or a grid beyond CUDA's limit.
    """
    key = _key(do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic)

    def build():
        spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                     block_q=block_q, block_kv=block_kv)
        return _build(runtime, spec, do, q, k, v, o, bool(deterministic))
    return cached_call(runtime, key, build)(do, q, k, v, o, lse)


def flash_bwd(runtime, do, q, k, v, o, lse, spec, deterministic=False, kernel=None):
    """The backward for an already validated call (tests call it with a race-checked runtime).

    ``kernel`` forces "flash_bwd_tc" (float16/bfloat16) or "flash_bwd_dkdv" (the SIMT
    kernels); None lets the planner choose.
    """
    return _build(runtime, spec, do, q, k, v, o, bool(deterministic), kernel)(do, q, k, v, o, lse)


def varlen_attention_backward(runtime, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, scale, causal, deterministic,
                              check_inputs):
    """``cuflash.varlen_attention_backward`` on the kernels: one backward per sequence.

    Each sequence runs the dense backward kernels on (H, n, d) views of the
    packed arrays (row stride H * d: no copy, no padding), so the work is the
    sum of the sequences' own and every dtype/head dim the dense backward
    takes is served.  The sequence boundaries are read on the host (one small
    device-to-host copy per call, whatever ``check_inputs`` says); a native
    varlen backward kernel (one launch for all sequences) is future work.
    """
    from ._validate_serving import check_varlen_backward, check_varlen_inputs
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=True)
    check_varlen_backward(do, q, k, v, o, lse, spec)
    xp = runtime.xp
    dq = xp.zeros(q.shape, spec.dtype)
    dk = xp.zeros(k.shape, spec.dtype)
    dv = xp.zeros(v.shape, spec.dtype)
    acc = _acc_dtype(spec.dtype)
    lse = lse if lse.dtype == acc else lse.astype(acc)
    for b in range(spec.B):
        q0, q1 = int(spec.cu_q[b]), int(spec.cu_q[b + 1])
        k0, k1 = int(spec.cu_k[b]), int(spec.cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue  # no query rows, or no keys: the gradients stay 0

        def view(a, lo, hi):
            return a[lo:hi].swapaxes(0, 1)
        g = tiled_attention_backward(runtime, view(do, q0, q1), view(q, q0, q1),
                                     view(k, k0, k1), view(v, k0, k1), view(o, q0, q1),
                                     lse[q0:q1].swapaxes(0, 1), spec.scale,
                                     spec.causal or False, None, None, deterministic)
        dq[q0:q1] = g[0].swapaxes(0, 1)
        dk[k0:k1] = g[1].swapaxes(0, 1)
        dv[k0:k1] = g[2].swapaxes(0, 1)
    return dq, dk, dv

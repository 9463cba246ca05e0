"""Launching the tensor-core backward with the logit features (``flash_bwd_tc_masked``).

float16/bfloat16 backward calls with a bias, window, ALiBi, softcap or dropout run
``kernels_cu/flash_bwd_tc.cu`` compiled with ``-DCUFLASH_MASKS`` wherever the plain
call would run ``flash_bwd_tc`` (:func:`cuflash.tiling.plan_flash_bwd` with
``masked=True``): the plain preprocess (D, lse2, zeroed dQ accumulators), the main
kernel ``flash_bwd_tc_masked`` (dK, dV, dQ reds and dbias), the plain dQ conversion.
The parameter block, the feature tensors and the bias gradient are prepared as for the
SIMT kernels (:mod:`cuflash._launch_masks`): the bias and slopes in float32 through
element strides (0 along broadcast axes), dbias into a zeroed float32 array of the
bias's shape -- stored by the one block that computes an element, or added with
atomics for a broadcast bias -- then converted to the bias's dtype.
"""
import numpy as np

from . import kernels, tiling
from ._launch import alloc_output, flatten_lead, fold_grid, kv_heads_for_kernel, launch, \
    pointer_arg, problem_dims, record_copy
from ._launch_bwd import (_CONVERT_BLOCKS, _aligned_inputs, _outputs, _sum_back, _tc_requests,
                          dq_splits)
from ._launch_masks import _dbias_target, _dummy, _feature_args, _SeedBlocks, _strides, \
    mask_fields

__all__ = ["build_bwd_tc"]


def build_bwd_tc(runtime, spec, ms, plan, do, q, k, v, o, deterministic):
    """The prepared backward on flash_bwd_tc_masked: ``run(do, q, k, v, o, lse, bias, slopes,
    seed) -> (dq, dk, dv[, dbias])``; ``plan`` is flash_bwd_tc_masked's."""
    from .reference import sum_to_shape
    xp = runtime.xp
    dtype, acc = spec.dtype, np.dtype(np.float32)
    Nq, Nk, d = spec.Nq, spec.Nk, spec.d
    B, H = problem_dims(spec.lead)
    Hk, group = kv_heads_for_kernel(spec)
    want_db = ms.return_dbias
    bias_dtype = None if ms.bias is None else ms.bias.dtype

    lead = spec.lead
    want, summed, alloc_shape = _outputs(spec, q, k, v, Hk)
    grouped = group > 1
    groups_of = (False, grouped, grouped, False, False)
    flat = [flatten_lead(runtime, x, lead, gr) for x, gr in zip((q, k, v, o, do), groups_of)]
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
    pre_rows = 64 if runtime.name == "cuda" else nq_pad
    n_pre = -(-nq_pad // pre_rows)
    bias_st, slope_st = _strides(runtime, spec, ms, acc)
    db_fields = {}
    db_shape = db_summed = None
    if want_db:
        db_shape, db_st, db_mode, db_summed = _dbias_target(spec, ms)
        db_fields = dict(mask_dbias=db_mode, mask_dbias_sb=db_st[0], mask_dbias_sh=db_st[1],
                         mask_dbias_sr=db_st[2], mask_dbias_sc=db_st[3])
    fields = dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d,
        dq_accum_offset=2 * rows_pad, scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=1,
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=rows_pad, dq_slice_stride=n_rows * d, nq_pad=nq_pad, n_splits=n_splits,
        n_kv_blocks=n_kv_blocks, **mask_fields(spec, ms, bias_st, slope_st), **db_fields)
    blocks = _SeedBlocks(runtime, "BwdParams", fields, ms)
    pre, main, conv = kernels.get_functions(runtime, _tc_requests(plan))
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    pre_grid = fold_grid(n_pre, H, B, what)
    main_grid = fold_grid(n_kv_blocks, Hk, B, what)
    conv_blocks = max(1, min(-(-n_rows * d // (4 * tiling.BWD_TC_CONVERT_THREADS)),
                             _CONVERT_BLOCKS.get(runtime.name, 4)))
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    sum_back = _sum_back(xp, acc, dtype, want, summed)

    def run(do, q, k, v, o, lse, bias, slopes, seed):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead, groups_of[i])[0]
        if not _aligned_inputs(ins, strides):
            # rows 16-byte copies cannot read aligned (a rare view): contiguous copies,
            # planned afresh on every such call
            cont = []
            for x in (q, k, v, o, do):
                c = xp.ascontiguousarray(x)
                if c is not x:
                    record_copy("aligned copy", c)
                cont.append(c)
            qc, kc, vc, oc, doc = cont
            return build_bwd_tc(runtime, spec, ms, plan, doc, qc, kc, vc, oc, deterministic)(
                doc, qc, kc, vc, oc, lse, bias, slopes, seed)
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if lse.dtype != np.float32 or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=np.float32)  # (B, H, Nq)
        b_arr, s_arr = _feature_args(runtime, spec, ms, acc, bias, slopes)
        params = blocks.get(seed if ms.dropout else None)
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), np.float32,
                          "workspace: lse2, D, float32 dQ accumulator(s)")
        db = xp.zeros(db_shape, acc) if want_db else _dummy(runtime, acc)
        launch(rt_name, pre, "flash_bwd_tc_preprocess", pre_grid, (tiling.BWD_TC_PRE_THREADS,),
               (o_, do_, lse, ws, params), 0)
        launch(rt_name, main, plan.kernel, main_grid, (plan.threads,),
               (q_, k_, v_, do_, ws, dk, dv_, params, b_arr, s_arr, db), plan.shared_bytes)
        launch(rt_name, conv, "flash_bwd_tc_dq_convert", (conv_blocks,),
               (tiling.BWD_TC_CONVERT_THREADS,), (ws, dq, params), 0)
        out = (sum_back(dq, "dq"), sum_back(dk, "dk"), sum_back(dv_, "dv"))
        if want_db:
            if db_summed:
                db = sum_to_shape(db, ms.bias_shape)
            out += (xp.ascontiguousarray(db.reshape(ms.bias_shape).astype(bias_dtype)),)
        return out
    return run

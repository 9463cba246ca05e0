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
from ._launch import aligned_copies, alloc_output, flatten_lead, launch, pointer_arg
from ._launch_bwd import _aligned_inputs, _sum_back, _tc_requests, tc_setup
from ._launch_masks import (_dummy, _feature_args, _SeedBlocks, _strides, dbias_fields,
                            dbias_result, mask_fields)

__all__ = ["build_bwd_tc"]


def build_bwd_tc(runtime, spec, ms, plan, do, q, k, v, o, deterministic):
    """The prepared backward on flash_bwd_tc_masked: ``run(do, q, k, v, o, lse, bias, slopes,
    seed) -> (dq, dk, dv[, dbias])``; ``plan`` is flash_bwd_tc_masked's (a call with rows,
    keys and problems: the caller serves the empty ones)."""
    xp = runtime.xp
    dtype, acc = spec.dtype, np.dtype(np.float32)
    want_db = ms.return_dbias
    lead = spec.lead
    t = tc_setup(runtime, spec, plan, q, k, v, o, do, deterministic)
    alloc_shape, groups_of, strides, copies = t.alloc_shape, t.groups_of, t.strides, t.copies
    bias_st, slope_st = _strides(runtime, spec, ms, acc)
    db_fields, db_shape, db_summed = dbias_fields(spec, ms)
    blocks = _SeedBlocks(runtime, "BwdParams",
                         dict(t.fields, **mask_fields(spec, ms, bias_st, slope_st), **db_fields),
                         ms)
    pre, main, conv = kernels.get_functions(runtime, _tc_requests(plan))
    rt_name = runtime.name
    emulator = rt_name == "emulator"
    sum_back = _sum_back(xp, acc, dtype, t.want, t.summed)

    def run(do, q, k, v, o, lse, bias, slopes, seed):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead, groups_of[i])[0]
        if not _aligned_inputs(ins, strides):
            # rows 16-byte copies cannot read aligned (a rare view): contiguous copies,
            # planned afresh on every such call
            qc, kc, vc, oc, doc = aligned_copies(xp, (q, k, v, o, do))
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
        ws = alloc_output(xp, (t.ws_size,), np.float32,
                          "workspace: lse2, D, float32 dQ accumulator(s)")
        db = xp.zeros(db_shape, acc) if want_db else _dummy(runtime, acc)
        launch(rt_name, pre, "flash_bwd_tc_preprocess", t.pre_grid,
               (tiling.BWD_TC_PRE_THREADS,), (o_, do_, lse, ws, params), 0)
        launch(rt_name, main, plan.kernel, t.main_grid, (plan.threads,),
               (q_, k_, v_, do_, ws, dk, dv_, params, b_arr, s_arr, db), plan.shared_bytes)
        launch(rt_name, conv, "flash_bwd_tc_dq_convert", (t.conv_blocks,),
               (tiling.BWD_TC_CONVERT_THREADS,), (ws, dq, params), 0)
        return (sum_back(dq, "dq"), sum_back(dk, "dk"), sum_back(dv_, "dv")) + \
            dbias_result(xp, ms, db, db_summed)
    return run

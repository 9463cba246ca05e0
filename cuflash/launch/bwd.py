"""The backward on the kernels: choosing the family, caching the call, packed sequences.

Which family runs is the planner's choice (:func:`cuflash.tiling.plan_flash_bwd`):
float16/bfloat16 with head dims that are multiples of 16 on sm_80+ run the tensor-core
backward (:mod:`cuflash.launch.bwd_tc`), everything else the SIMT kernels
(:mod:`cuflash.launch.bwd_simt`, with float32's dK/dV on tensor cores where they exist).
Calls are prepared once and cached as the forward's are (:mod:`cuflash.launch.common`).
Gradients of inputs broadcast along a leading axis are summed over it on the host
(:func:`cuflash.launch.common.grad_shapes`); the heads of a grouped-query (or MQA) group
are summed inside the dK/dV block.
"""
from dataclasses import replace

from .. import tiling
from .._validate import check_backward_inputs
from .._validate_masks import sequence_masks
from .._validate_serving import check_varlen_backward, check_varlen_inputs
from . import bwd_simt, bwd_tc
from .common import acc_dtype, array_key, cached_call, problem_dims, zero_grads
from .features import cache_key, check_cached_seed, lean_build, validate, validate_serving

__all__ = ["tiled_attention_backward", "flash_bwd", "varlen_attention_backward",
           "plan_backward"]

_TC_KERNELS = ("flash_bwd_tc", "flash_bwd_tc_masked", *tiling.BWD_LEAN_KERNELS,
               tiling.BWD_WGMMA_KERNEL)


def plan_backward(runtime, d, dv, dtype, block_q=None, block_kv=None, kernel=None, masked=False,
                  deterministic=False, lean=None):
    """The main backward kernel's plan on this runtime (flash_bwd_tc or flash_bwd_dkdv; with
    ``masked``, their _masked kernels -- on the tensor cores the lean build ``lean`` names
    instead (features.lean_build: flash_bwd_tc_band, _softcap, _alibi) where it has one;
    flash_bwd_wgmma where the runtime runs the Hopper kernels and the call is not
    ``deterministic``)."""
    return tiling.plan_flash_bwd(d, dv, dtype, block_q, block_kv, limit=runtime.smem_limit,
                                 limit_source=runtime.smem_source, kernel=kernel,
                                 tensor_cores=runtime.tensor_cores, masked=masked,
                                 wgmma=runtime.wgmma_for(d, dv) and not deterministic,
                                 lean=lean)


def _build(runtime, spec, ms, do, q, k, v, o, deterministic, kernel=None):
    """The prepared backward: ``run(do, q, k, v, o, lse, f) -> (dq, dk, dv[, dbias])``.

    ``ms`` is the call's MaskSpec (None: a plain call); ``kernel`` forces
    flash_bwd_tc(_masked) or, with flash_bwd_dkdv(_masked), the SIMT kernels
    (their own dK/dV kernel: no flash_bwd_tf32 in its place).
    """
    main = plan_backward(runtime, spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv,
                         kernel, masked=ms is not None, deterministic=deterministic,
                         lean=lean_build(ms))
    if main.kernel in _TC_KERNELS:
        B, H = problem_dims(spec.lead)
        if spec.Nq == 0 or spec.Nk == 0 or B * H == 0:
            return zero_grads(runtime.xp, spec, q, k, v, ms)
        return bwd_tc.build(runtime, spec, ms, main, do, q, k, v, o, deterministic)
    return bwd_simt.build(runtime, spec, ms, do, q, k, v, o, deterministic,
                          allow_tf32=kernel is None)


def _key(do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic, features,
         return_dbias):
    try:
        return ("bwd",) + array_key(do, q, k, v, o) + (
            tuple(lse.shape), lse.dtype, scale.__class__, scale, causal.__class__, causal,
            block_q.__class__, block_q, block_kv.__class__, block_kv, deterministic.__class__,
            deterministic, cache_key(features), return_dbias.__class__, return_dbias)
    except (AttributeError, TypeError):  # not arrays (lse=None, a list, ...): validation says
        return None


def tiled_attention_backward(runtime, do, q, k, v, o, lse, scale, causal, block_q, block_kv,
                             deterministic, features=None, return_dbias=False):
    """The flash attention backward on the kernels: ``(dq, dk, dv[, dbias])``.

    Arguments as :func:`cuflash.tiled_attention_backward`, the logit features
    as one value (:func:`cuflash.launch.features.of`).  ``lse`` may have any
    float dtype and layout; it is read as float32 (float64 for float64 inputs).

    Raises
    ------
    ValueError
        Tiles or head dims the kernels do not support, or shared memory beyond
        the device's budget (from cuflash.tiling), or a grid beyond CUDA's limit.
    """
    key = _key(do, q, k, v, o, lse, scale, causal, block_q, block_kv, deterministic, features,
               return_dbias)

    def build():
        spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                     block_q=block_q, block_kv=block_kv)
        ms = validate(spec, q, features, return_dbias)
        return _build(runtime, spec, ms, do, q, k, v, o, bool(deterministic))
    run = cached_call(runtime, key, build)
    check_cached_seed(features)
    return run(do, q, k, v, o, lse, features)


def flash_bwd(runtime, do, q, k, v, o, lse, spec, ms=None, deterministic=False, kernel=None):
    """The backward for an already validated call (``ms``: its MaskSpec or None).

    Tests call it with a race-checked runtime, and ``kernel`` to force
    flash_bwd_tc(_masked) or flash_bwd_dkdv(_masked); None lets the planner choose.
    """
    return _build(runtime, spec, ms, do, q, k, v, o, bool(deterministic), kernel)(
        do, q, k, v, o, lse, ms)


def varlen_attention_backward(runtime, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, scale, causal, deterministic,
                              check_inputs, features=None, return_dbias=False):
    """``cuflash.varlen_attention_backward`` on the kernels: one backward per sequence.

    Each sequence runs the dense backward kernels on (H, n, d) views of the
    packed arrays (row stride H * d: no copy, no padding), so the work is the
    sum of the sequences' own and every dtype/head dim the dense backward
    takes is served.  With features, each sequence gets its own
    (:func:`cuflash._validate_masks.sequence_masks`) and dbias is accumulated
    per sequence into an array of the bias's shape.  The sequence boundaries
    are read on the host (one small device-to-host copy per call, whatever
    ``check_inputs`` says); a native varlen backward kernel (one launch for
    all sequences) is future work.
    """
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=True)
    check_varlen_backward(do, q, k, v, o, lse, spec)
    ms = validate_serving(q, spec.B, spec.H, spec.max_q, spec.max_k, features, return_dbias)
    xp = runtime.xp
    acc = acc_dtype(spec.dtype)
    dq = xp.zeros(q.shape, spec.dtype)
    dk = xp.zeros(k.shape, spec.dtype)
    dv = xp.zeros(v.shape, spec.dtype)
    dbias = xp.zeros(ms.bias_shape, acc) if ms is not None and ms.return_dbias else None
    lse = lse if lse.dtype == acc else lse.astype(acc)
    for b in range(spec.B):
        q0, q1 = int(spec.cu_q[b]), int(spec.cu_q[b + 1])
        k0, k1 = int(spec.cu_k[b]), int(spec.cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue  # no query rows, or no keys: the gradients stay 0

        def view(a, lo, hi):
            return a[lo:hi].swapaxes(0, 1)
        args = (view(do, q0, q1), view(q, q0, q1), view(k, k0, k1), view(v, k0, k1),
                view(o, q0, q1), lse[q0:q1].swapaxes(0, 1))
        if ms is None:
            g = tiled_attention_backward(runtime, *args, spec.scale, spec.causal or False, None,
                                         None, deterministic)
        else:
            bspec = check_backward_inputs(*args, scale=spec.scale, causal=spec.causal or False)
            g = flash_bwd(runtime, *args, bspec, sequence_masks(ms, b, q1 - q0, k1 - k0),
                          deterministic)
        dq[q0:q1] = g[0].swapaxes(0, 1)
        dk[k0:k1] = g[1].swapaxes(0, 1)
        dv[k0:k1] = g[2].swapaxes(0, 1)
        if dbias is not None:   # sequence b's share of the (broadcast) bias
            sequence_masks(replace(ms, bias=dbias), b, q1 - q0, k1 - k0).bias[...] += g[3]
    if dbias is not None:
        return dq, dk, dv, dbias.astype(ms.bias.dtype)
    return dq, dk, dv

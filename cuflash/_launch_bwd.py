"""Launching the backward kernels (``kernels_cu/flash_bwd.cu``) for "cuda" and "emulator".

One function, :func:`tiled_attention_backward`, runs the FlashAttention-2
backward for a validated call on a :class:`cuflash.kernels.Runtime`, so CuPy
arrays on a GPU and NumPy arrays on the emulator go through the same code:

1. ``flash_bwd_preprocess``: ``D = rowsum(dO * O)`` (and, on the atomic path,
   zeroes a float32 dQ accumulator);
2. ``flash_bwd_dkdv``: dK, dV (K/V tile resident, Q/dO/lse/D streamed, P
   recomputed from lse), looping over the query heads of a grouped-query group
   inside the block;
3. dQ, either ``flash_bwd_dq`` (a separate pass, Q tile resident, K/V
   streamed: no atomics, bitwise repeatable) when ``deterministic=True`` or the
   dtype is float64 (there is no double ``gatomic_add``), or float32 atomics
   from ``flash_bwd_dkdv`` followed by ``flash_bwd_dq_convert`` otherwise.

Tiles, threads and shared memory come from :mod:`cuflash.tiling` (the
``flash_bwd_*`` entries); input flattening, output allocation and kernel
lookup are :mod:`cuflash._launch`'s helpers, shared with the forward.

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
from .reference import sum_to_shape
from ._launch import (MAX_GRID_YZ, alloc_output, flatten_lead, get_kernel, pointer_arg,
                      problem_dims)

__all__ = ["tiled_attention_backward", "flash_bwd", "bwd_defines", "kv_heads_for_kernel",
           "compile_variants"]

_FILE = "flash_bwd.cu"

# flash_bwd_dq_convert is grid-stride: a GPU gets enough blocks to fill it, the
# emulator (which starts the block's threads for every block) only a few.
_CONVERT_BLOCKS = {"cuda": 4096, "emulator": 4}


def bwd_defines(plan):
    """Defines of flash_bwd.cu for a :class:`cuflash.tiling.TilePlan` of flash_bwd_dkdv/dq."""
    return {kernels.dtype_define(plan.dtype): None, "CUFLASH_HEAD_DIM": plan.d,
            "CUFLASH_HEAD_DIM_V": plan.dv, "CUFLASH_BLOCK_Q": plan.block_q,
            "CUFLASH_BLOCK_KV": plan.block_kv, "CUFLASH_THREADS": plan.threads}


def compile_variants():
    """Specialisations of flash_bwd.cu worth compile-checking (for tests/test_nvrtc.py).

    A list of option tuples as :func:`cuflash.kernels.build_options` makes them
    (no ``-arch``): float32 at every head dim of the test grid with the default
    tiles (planned without a device limit), float16, bfloat16 and float64 at
    two head dims each (the dtype changes only the load/store conversions and
    the accumulator type), the smallest tiles, and dv != d.  Kept short: every
    entry costs ~4 s of NVRTC per architecture in CI.  Default tiles are planned
    for an sm_80's 163 KB, as a launch there gets them (the kernel report reads
    these variants: an unlimited plan would report tiles no GPU runs).
    """
    out, seen = [], set()
    sm80 = tiling.EMULATOR_ARCHES["sm_80"]

    def add(dtype, d, dv=None, bq=None, bkv=None):
        p = tiling.plan("flash_bwd_dkdv", d, d if dv is None else dv, dtype, bq, bkv, limit=sm80)
        opts = kernels.build_options(bwd_defines(p))
        if opts not in seen:
            seen.add(opts)
            out.append(opts)

    for d in (16, 32, 64, 96, 128, 256):
        add("float32", d)
    for dt, dims in (("float16", (32, 128)), ("bfloat16", (16, 256)), ("float64", (64, 256))):
        for d in dims:
            add(dt, d)
    add("float32", 64, bq=8, bkv=8)
    add("float32", 96, dv=32)
    return out


def kv_heads_for_kernel(spec):
    """(Hk, group) the kernels use: kv heads per batch entry and query heads per kv head.

    Grouped-query calls use the spec's group.  When k/v have a single head (or
    no heads axis) and q has H > 1 heads (MQA, or plain broadcasting over the
    heads axis), the kernels treat it as one group of H heads as well, so dK/dV
    are summed over the heads inside the dkdv block instead of on the host.
    """
    B, H = problem_dims(spec.lead)
    if spec.group > 1:
        return H // spec.group, spec.group
    # kv_lead is right-aligned with lead: its last axis (if any) is the heads axis
    kv_heads = spec.kv_lead[-1] if spec.kv_lead else 1
    if spec.lead and kv_heads == 1 and H > 1:
        return 1, H
    return H, 1


def _acc_dtype(dtype):
    return np.dtype(np.float64) if tiling.accumulator_bytes(dtype) == 8 else np.dtype(np.float32)


def _sum_to_shape(xp, a, shape, acc_dtype, dtype):
    """Sum ``a`` over the leading axes along which an input of ``shape`` was broadcast.

    ``a`` is right-aligned with ``shape``; sums run in ``acc_dtype`` and the
    result is rounded once to ``dtype``.  Equal sizes mean nothing was
    broadcast: a reshape (no copy).
    """
    shape = tuple(int(s) for s in shape)
    if a.size == int(np.prod(shape, dtype=np.int64)):
        return a.reshape(shape)
    return xp.ascontiguousarray(sum_to_shape(a.astype(acc_dtype), shape).astype(dtype))


def _acc_scalar(dtype, value):
    return np.float64(value) if tiling.accumulator_bytes(dtype) == 8 else np.float32(value)


def tiled_attention_backward(runtime, do, q, k, v, o, lse, spec, deterministic=False):
    """Run the backward kernels for a validated call: returns ``(dq, dk, dv)``.

    Parameters
    ----------
    runtime : cuflash.kernels.Runtime
    do : ndarray, shape spec.lead + (Nq, dv)
    q, k, v : ndarray (of ``runtime.xp``)
    o : ndarray, shape spec.lead + (Nq, dv)
    lse : ndarray, shape spec.lead + (Nq,)
        Any float dtype; read as float32 (float64 for float64 inputs).
    spec : cuflash._validate.AttentionSpec
        From ``check_backward_inputs(do, q, k, v, o, lse, ...)``.
    deterministic : bool
        True: dQ by the separate flash_bwd_dq pass (bitwise-identical results on
        every run).  False: dQ by float32 atomics from flash_bwd_dkdv (float64
        always takes the deterministic pass).

    Returns
    -------
    dq, dk, dv : ndarray
        Shapes of q, k, v; the input dtype.

    Raises
    ------
    ValueError
        Tiles or head dims the kernels do not support, or shared memory beyond
        the device's budget (from cuflash.tiling), or more than 65535 heads or
        batch entries.
    """
    xp = runtime.xp
    dtype, acc = spec.dtype, _acc_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    plan = runtime.plan("flash_bwd_dkdv", d, dv, dtype, spec.block_q, spec.block_kv)
    # flash_bwd_dq runs with the same tiles (one compiled module); it needs less shared memory
    dq_plan = runtime.plan("flash_bwd_dq", d, dv, dtype, plan.block_q, plan.block_kv)
    B, H = problem_dims(spec.lead)
    Hk, group = kv_heads_for_kernel(spec)

    if Nq == 0 or Nk == 0 or B * H == 0:
        # no query rows or no keys: every gradient is zero (or empty)
        return (xp.zeros(q.shape, dtype), xp.zeros(k.shape, dtype), xp.zeros(v.shape, dtype))
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"the backward kernels launch one grid row per head and batch entry; "
                         f"leading shape {spec.lead} gives H={H}, B={B} (limit {MAX_GRID_YZ} "
                         "each); reshape the leading dims")

    kv_lead = tuple(spec.lead[:-1]) + (Hk,) if spec.lead else ()
    full_q = tuple(spec.lead) + (Nq, d)
    full_k, full_v = kv_lead + (Nk, d), kv_lead + (Nk, dv)

    def out(full, want, what):
        # the kernel's output has the full (broadcast) shape; an input of the same size
        # receives it directly, a broadcast one through _sum_to_shape afterwards
        if int(np.prod(want, dtype=np.int64)) == int(np.prod(full, dtype=np.int64)):
            return alloc_output(xp, tuple(want), dtype, what)
        return alloc_output(xp, full, dtype, what + " (before the broadcast sum)")

    dq = out(full_q, q.shape, "dq")
    dk = out(full_k, k.shape, "dk")
    dv_ = out(full_v, v.shape, "dv")

    # inputs by strides (broadcast axes: stride 0); pointer_arg hands strided views to the
    # emulator as the span of their buffer
    q_, qs = flatten_lead(runtime, q, spec.lead)
    k_, ks = flatten_lead(runtime, k, spec.lead, group > 1)
    v_, vs = flatten_lead(runtime, v, spec.lead, group > 1)
    o_, os_ = flatten_lead(runtime, o, spec.lead)
    do_, dos = flatten_lead(runtime, do, spec.lead)
    q_, k_, v_, o_, do_ = (pointer_arg(runtime, a) for a in (q_, k_, v_, o_, do_))
    lse_ = xp.ascontiguousarray(lse, dtype=acc)  # (B, H, Nq) contiguous, in acc precision
    D = alloc_output(xp, (B, H, Nq), acc, "D (rowsum(do * o))")

    atomic = not deterministic and dtype != np.float64
    if atomic:
        dq_accum = alloc_output(xp, (B, H, Nq, d), np.float32, "dq accumulator (float32)")
    else:
        dq_accum = xp.zeros((1,), np.float32)  # unused by the kernels on this path

    causal = spec.causal is not None
    offset = Nk - Nq if spec.causal == "bottom_right" else 0
    defines = bwd_defines(plan)
    i32, i64 = np.int32, np.int64
    scale = _acc_scalar(dtype, spec.scale)
    strides = (*(i64(s) for s in qs), *(i64(s) for s in ks), *(i64(s) for s in vs),
               *(i64(s) for s in dos))

    # 1. D = rowsum(dO * O) (+ zero the dQ accumulator)
    pre_plan = runtime.plan("flash_bwd_preprocess", d, dv, dtype)
    pre = get_kernel(runtime, _FILE, "flash_bwd_preprocess", defines, pre_plan)
    chunk = pre_plan.block_q
    # rows per block: one chunk on a GPU (many small blocks); all rows of a head on the
    # emulator, where each block starts its threads anew
    rows = chunk if runtime.name == "cuda" else -(-Nq // chunk) * chunk
    pre((-(-Nq // rows), H, B), (pre_plan.threads,),
        (o_, do_, D, dq_accum, i32(Nq), i32(rows), i32(atomic),
         *(i64(s) for s in os_), *(i64(s) for s in dos)),
        shared_mem=pre_plan.shared_bytes)

    # 2. dK, dV (+ dQ by atomics)
    dkdv = get_kernel(runtime, _FILE, "flash_bwd_dkdv", defines, plan)
    dkdv((-(-Nk // plan.block_kv), Hk, B), (plan.threads,),
         (q_, k_, v_, do_, lse_, D, dk, dv_, dq_accum, i32(Nq), i32(Nk), i32(group),
          i32(causal), i32(offset), i32(atomic), *strides, scale),
         shared_mem=plan.shared_bytes)

    # 3. dQ
    if atomic:
        conv = get_kernel(runtime, _FILE, "flash_bwd_dq_convert", defines)
        n = B * H * Nq * d
        blocks = max(1, min(-(-n // tiling.BWD_THREADS), _CONVERT_BLOCKS.get(runtime.name, 4)))
        conv((blocks,), (tiling.BWD_THREADS,), (dq_accum, dq, i64(n)))
    else:
        dqk = get_kernel(runtime, _FILE, "flash_bwd_dq", defines, dq_plan)
        dqk((-(-Nq // dq_plan.block_q), H, B), (dq_plan.threads,),
            (q_, k_, v_, do_, lse_, D, dq, i32(Nq), i32(Nk), i32(group), i32(causal),
             i32(offset), *strides, scale),
            shared_mem=dq_plan.shared_bytes)

    return (_sum_to_shape(xp, dq, q.shape, acc, dtype),
            _sum_to_shape(xp, dk, k.shape, acc, dtype),
            _sum_to_shape(xp, dv_, v.shape, acc, dtype))


# the name cuflash._launch.api_tiled_attention_backward calls
flash_bwd = tiled_attention_backward

"""Launching the dense forward kernels, with or without the logit features.

The planner (:func:`cuflash.tiling.plan_flash_fwd`) picks the kernel:
``flash_fwd_tc`` (float16/bfloat16) or ``flash_fwd_tf32`` (float32 as 3xTF32)
of ``flash_fwd_tc.cu`` on sm_80+, the SIMT ``flash_fwd`` of ``flash_fwd.cu``
otherwise (float64, sm_75, head dims they lack).  A call with features runs
the same kernel compiled with ``-DCUFLASH_MASKS`` (``flash_fwd_tc_masked``,
``flash_fwd_tf32_masked``, ``flash_fwd_masked``).

:func:`tiled_attention` is the forward of both kernel backends, prepared once per kind of
call (:func:`cuflash.launch.common.cached_call`); split-KV calls go to the serving kernel
(:mod:`cuflash.launch.serving`).
"""
import numpy as np

from .. import kernels, tiling
from .._validate import check_attention_inputs, check_positive_int
from .._validate_serving import check_num_splits
from .common import (acc_dtype, aligned16, aligned_copies, alloc_output, array_key, cached_call,
                     contiguous_strides, flatten_lead, fold_grid, kv_heads_for_kernel, launch,
                     pointer_arg, problem_dims, record_copy, track_allocations)
from .features import (DEFINES, Prepared, cache_key, check_cached_seed, prepared_key,
                       validate)
from .hopper import Q_ROWS_PER_BOX, HopperMaps, materialised, tma_layout_ok
from .serving import serving_plan, tiled_attention_split

__all__ = ["tiled_attention", "flash_fwd", "memory_analysis", "verify_no_full_materialization",
           "tc_scale"]


def _build(runtime, spec, ms, q, k, v, kernel=None):
    """The prepared forward for this call's shapes and strides: ``run(q, k, v, f) -> (o, lse)``.

    ``ms`` is the call's MaskSpec (None: a plain call); ``f`` carries the feature
    arrays and seed of each call (:class:`cuflash.launch.features.Prepared`).
    ``kernel`` None lets the planner choose; tests force one of the six kernels.
    """
    xp = runtime.xp
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv, kernel,
                            masked=ms is not None)
    scale, q_transform = tc_scale(xp, plan, spec.scale)
    if q_transform is not None:
        q = q_transform(q)
        record_copy("scaled copy", q)
    out_shape, lse_shape = spec.out_shape, spec.lse_shape
    dtype, lse_dtype = spec.dtype, spec.lse_dtype
    B, H = problem_dims(spec.lead)
    if spec.Nq == 0 or B * H == 0:
        def run_empty(q, k, v, f=None):
            return (alloc_output(xp, out_shape, dtype, "o"),
                    alloc_output(xp, lse_shape, lse_dtype, "lse"))
        return run_empty

    lead, grouped = spec.lead, spec.group > 1
    q_, qs = flatten_lead(runtime, q, lead)
    k_, ks = flatten_lead(runtime, k, lead)
    v_, vs = flatten_lead(runtime, v, lead)
    # whether an input is copied depends on its shape and strides only: replayed per call
    copy_q, copy_k, copy_v = q_ is not q, k_ is not k, v_ is not v
    o_sb, o_sh = contiguous_strides(lead, (spec.Nq, spec.dv))
    l_sb, l_sh = contiguous_strides(lead, (spec.Nq,))
    n_tiles = -(-spec.Nq // plan.block_q)
    name = plan.kernel
    grid = fold_grid(n_tiles, H, B, f"{name} (Nq={spec.Nq}, block_q={plan.block_q})")
    block, smem = (plan.threads,), plan.shared_bytes
    defines = kernels.plan_defines(plan)
    if ms is not None:
        defines.update(DEFINES)
    fn = kernels.get_function(runtime, kernels.KERNEL_SOURCES[name], name, defines, smem)
    feats = Prepared(runtime, spec, ms, acc_dtype(spec.dtype))
    params = feats.params("FwdParams", dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], o_sb=o_sb, o_sh=o_sh, o_sr=spec.dv,
        lse_sb=l_sb, lse_sh=l_sh, scale=scale, Nq=spec.Nq, Nk=spec.Nk, H=H,
        group=spec.group, causal=int(spec.causal is not None),
        causal_offset=spec.Nk - spec.Nq if spec.causal == "bottom_right" else 0,
        n_tiles=n_tiles, **dense_serving_fields(spec, B * H)))
    needs_align = name in tiling.TC_KERNELS + tiling.TC_MASKED_KERNELS  # cp.async: 16 bytes
    emulator = runtime.name == "emulator"
    rt_name = runtime.name
    maps = None
    if name == tiling.WGMMA_KERNEL:  # TMA: the maps of each call's q, k, v
        needs_align = True
        kv_bh = (B, H // spec.group if grouped else H)
        shapes = ((B, H), spec.Nq, qs), (kv_bh, spec.Nk, ks), (kv_bh, spec.Nk, vs)
        if not all(tma_layout_ok(*sh, q.itemsize) for sh in shapes):
            def run_copied(q, k, v, f=None):  # strides the copy engine cannot step
                q, k, v = _materialised(xp, spec, q, k, v)
                return _cached(runtime, spec, ms, q, k, v, kernel)(q, k, v, f)
            return run_copied
        maps = HopperMaps(runtime, [((B, H), spec.Nq, spec.d, qs, Q_ROWS_PER_BOX),
                                    (kv_bh, spec.Nk, spec.d, ks, plan.block_kv),
                                    (kv_bh, spec.Nk, spec.d, vs, plan.block_kv)])

    def run(q, k, v, f=None):
        q_in = q
        if q_transform is not None:
            q = q_transform(q)
        if copy_q:
            q = flatten_lead(runtime, q, lead)[0]
        if copy_k:
            k = flatten_lead(runtime, k, lead)[0]
        if copy_v:
            v = flatten_lead(runtime, v, lead)[0]
        if needs_align and not (aligned16(q, qs) and aligned16(k, ks) and aligned16(v, vs)):
            return _misaligned(runtime, spec, ms, q_in, k, v, kernel, f)
        if emulator:
            q, k, v = pointer_arg(runtime, q), pointer_arg(runtime, k), pointer_arg(runtime, v)
        extra = feats.args(f)
        p = params(f)
        o = alloc_output(xp, out_shape, dtype, "o")
        lse = alloc_output(xp, lse_shape, lse_dtype, "lse")
        args = (q, k, v, o, lse, p) + extra
        if maps is not None:
            args = maps(q, k, v) + args
        launch(rt_name, fn, name, grid, block, args, smem)
        return o, lse
    return run


def tc_scale(xp, plan, scale):
    """``(scale, q_transform)`` for a plan: the tensor-core kernels need scale > 0.

    They fold scale * log2(e) into the exponent and take the row max of the raw logits.
    softmax(s * q.k) = softmax(-s * (-q).k) exactly; scale 0 makes every logit 0 * (q.k), as
    does q * 0 with scale 1.  ``q_transform`` (None: q as it is) makes the q to launch with.
    """
    if plan.kernel not in tiling.TC_KERNELS + tiling.TC_MASKED_KERNELS + (tiling.WGMMA_KERNEL,) or scale > 0:
        return scale, None
    if scale < 0:
        def negate(x):
            return xp.ascontiguousarray(xp.negative(x))
        return -scale, negate

    def zero(x):
        return xp.ascontiguousarray(x * 0)
    return 1.0, zero


def dense_serving_fields(spec, problems):
    """The FwdParams fields of the serving problems (fwd_problem.cuh), neutral for a dense call."""
    return dict(lse_sr=1, n_out_rows=problems * spec.Nq, n_splits=1, split_tiles=1,
                q_period=max(spec.Nq, 1), causal_br=int(spec.causal == "bottom_right"),
                total_q=0, total_k=0, seqlens_add=0, kv_capacity=spec.Nk, varlen=0,
                kv_cache=0, page_size=0, num_pages=0, max_pages=0, head_d=spec.d, head_dv=spec.dv)


def _misaligned(runtime, spec, ms, q, k, v, kernel, f):
    """An input view whose rows cp.async cannot read aligned: run on contiguous copies."""
    q, k, v = aligned_copies(runtime.xp, (q, k, v))
    return _cached(runtime, spec, ms, q, k, v, kernel)(q, k, v, f)


def _materialised(xp, spec, q, k, v):
    """q, k, v at their full problem shapes, contiguous (the Hopper kernel's tensor maps)."""
    kv_lead = spec.lead[:-1] + (k.shape[-3],) if spec.group > 1 else spec.lead
    return materialised(xp, [(q, spec.lead + q.shape[-2:]), (k, kv_lead + k.shape[-2:]),
                             (v, kv_lead + v.shape[-2:])], record_copy)


def _cached(runtime, spec, ms, q, k, v, kernel=None):
    key = ("fwd-validated", spec, prepared_key(ms), kernel) + array_key(q, k, v)
    return cached_call(runtime, key, lambda: _build(runtime, spec, ms, q, k, v, kernel))


def _key(q, k, v, scale, causal, block_q, block_kv, num_splits, features):
    try:
        return ("fwd",) + array_key(q, k, v) + (
            scale.__class__, scale, causal.__class__, causal, block_q.__class__, block_q,
            block_kv.__class__, block_kv, num_splits.__class__, num_splits, cache_key(features))
    except (AttributeError, TypeError):  # not arrays: the validation below says what is wrong
        return None


def tiled_attention(runtime, q, k, v, scale, causal, block_q, block_kv, return_lse,
                    num_splits=None, features=None):
    """The flash attention forward on the kernels: ``o`` or ``(o, lse)``.

    Validation, planning and compilation happen on the first call of a kind;
    see the module docstring.  Arguments as :func:`cuflash.tiled_attention`,
    the logit features as one value (:func:`cuflash.launch.features.of`).
    Split-KV calls go to the serving kernel (:mod:`cuflash.launch.serving`):
    ``num_splits`` > 1, or None when every head's queries fit one tile (decode
    and short queries, where the keys are the only parallelism left) and
    :func:`cuflash.tiling.num_splits_heuristic` finds the GPU underfilled --
    but where the dense plan is a tensor-core kernel, only when a kv head has at
    most ``tiling.SPLIT_MAX_ROWS_OVER_TC`` query rows (the split kernel is SIMT).
    A call with features runs the dense kernels and does not read ``num_splits``.
    """
    key = _key(q, k, v, scale, causal, block_q, block_kv, num_splits, features)

    def build():
        spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                      block_kv=block_kv)
        if features is not None:
            return _build(runtime, spec, validate(spec, q, features), q, k, v)
        splits = _splits_for(runtime, spec, check_num_splits(num_splits))
        if splits > 1:
            return lambda q, k, v, f: tiled_attention_split(runtime, q, k, v, spec, splits)
        return _build(runtime, spec, None, q, k, v)
    run = cached_call(runtime, key, build)
    check_cached_seed(features)
    o, lse = run(q, k, v, features)
    return (o, lse) if return_lse else o


def _splits_for(runtime, spec, num_splits):
    """The split count of a dense call: as asked, or (None) the heuristic for one-tile queries."""
    if num_splits is not None:
        return num_splits
    B, H = problem_dims(spec.lead)
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv)
    if spec.Nq > plan.block_q or spec.Nk == 0 or B * H == 0:
        return 1
    Hk, group = kv_heads_for_kernel(spec)  # the serving kernel packs a GQA/MQA group's rows
    if (plan.kernel in tiling.TC_KERNELS + (tiling.WGMMA_KERNEL,)
            and group * spec.Nq > tiling.SPLIT_MAX_ROWS_OVER_TC):
        return 1
    # the split runs the serving kernel: its tiles (as short as the rows allow) and threads
    sp = serving_plan(runtime, spec.d, spec.dv, spec.dtype, group * spec.Nq, spec.block_q,
                      spec.block_kv)
    blocks = B * Hk * -(-(group * spec.Nq) // sp.block_q)
    return tiling.num_splits_heuristic(blocks, -(-spec.Nk // sp.block_kv),
                                       tiling.split_slots(runtime.num_sms, sp.threads))


def flash_fwd(runtime, q, k, v, spec, ms=None, kernel=None):
    """Run the forward for a validated call (``ms``: its MaskSpec or None): ``(o, lse)``.

    ``kernel`` forces one kernel (tests; the race checks pass a race-checked runtime).

    Raises
    ------
    ValueError
        Tiles or head dims the kernel does not support (from cuflash.tiling), or
        a grid beyond CUDA's 2^31 - 1 blocks.
    """
    return _cached(runtime, spec, ms, q, k, v, kernel)(q, k, v, ms)


def _dtype_label(dtype):
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def memory_analysis(runtime, reference_model, N, d, dtype, Nk, block_q, block_kv, batch, heads,
                    num_splits=1, bias_shape=None, window=None):
    """memory_analysis for the kernels: the reference's model with the kernel's tiles.

    ``reference_model`` is :func:`cuflash.reference.memory_analysis` (the
    backends pass it: the launchers sit below them).  The tiles and
    ``sram_bytes_per_block`` are those the forward launches with
    (cuflash.tiling, against this runtime's shared-memory limit, which is
    reported); split-KV reports the serving kernel's, and a call with
    ``bias_shape``/``window`` those of the forward the planner picks with
    ``masked=True`` (flash_fwd_tc_masked, flash_fwd_tf32_masked or
    flash_fwd_masked), with the feature keys of
    :func:`cuflash.reference.masks.memory_features`.
    ``tiled_extra_bytes`` keeps the reference's definition (row statistics
    plus one S/P tile pair, whatever memory holds them);
    ``kernel_global_extra_bytes`` is what the kernel path actually keeps in
    global memory besides q, k, v, o: the lse rows (m, l live in registers, the
    S/P tile in registers and shared memory).  The HBM model is the reference's
    (``tiled_forward_hbm_bytes``) evaluated for these tiles, which equals
    :func:`cuflash.tiling.flash_fwd_traffic` without float32's flushes.
    ``kernel_hbm_read_bytes`` / ``kernel_hbm_written_bytes`` are the bytes the
    launched kernel moves (on the emulator, what it is measured to move): the
    same but for float32 on the tensor cores, whose O rows also go to global
    memory and back every ``tiling.TF32_FLUSH_KEYS`` keys of a row.
    """
    d_ = check_positive_int(d, "d")
    bq = check_positive_int(block_q, "block_q")
    bkv = check_positive_int(block_kv, "block_kv")
    masked = bias_shape is not None or window is not None
    splits = 1 if masked else (check_num_splits(num_splits) or 1)  # features never split keys
    if splits > 1:  # split-KV runs the serving kernel, with its tiles
        plan = serving_plan(runtime, d_, d_, _dtype_label(dtype), N, bq, bkv)
    else:  # calls with features run the forward the planner picks with masked=True
        plan = runtime.plan_fwd(d_, d_, _dtype_label(dtype), bq, bkv, masked=masked)
    out = reference_model(N, d, dtype, Nk=Nk, block_q=plan.block_q, block_kv=plan.block_kv,
                          batch=batch, heads=heads, num_splits=splits,
                          bias_shape=bias_shape, window=window)
    out.pop("cpu_tile_bytes_per_worker", None)  # the reference's CPU figure: not this path
    out.update({
        "backend": runtime.name,
        "kernel": "flash_fwd_serving" if splits > 1 else plan.kernel,
        "tiles_chosen": plan.chosen,
        "threads_per_block": plan.threads,
        "sram_bytes_per_block": plan.shared_bytes,
        "sram_layout": tiling.kernel_tiling(plan.kernel).layout(
            plan.block_q, plan.block_kv, d_, d_, plan.acc_bytes),
        "sram_limit_bytes": plan.limit,
        "sram_limit_source": plan.limit_source,
        "kernel_global_extra_bytes": out["batch"] * out["heads"] * out["N"] * plan.acc_bytes,
    })
    read, written = out["tiled_hbm_read_bytes"], out["tiled_hbm_written_bytes"]
    if splits == 1 and plan.kernel.startswith("flash_fwd_tf32"):
        # O's second level: the flushes' bytes, the traffic model with them less without
        if masked:
            model = lambda fk: tiling.flash_fwd_masked_traffic(  # noqa: E731
                out["batch"], out["heads"], out["N"], out["Nk"], d_, d_, "float32", plan.block_q,
                plan.block_kv, None, window, bias_shape is not None, False, threads=plan.threads,
                flush_keys=fk)
        else:
            model = lambda fk: tiling.flash_fwd_traffic(  # noqa: E731
                out["batch"], out["heads"], out["N"], out["Nk"], d_, d_, "float32", plan.block_q,
                plan.block_kv, flush_keys=fk)
        (r1, w1), (r0, w0) = model(tiling.TF32_FLUSH_KEYS), model(0)
        read, written = read + r1 - r0, written + w1 - w0
    out.update(kernel_hbm_read_bytes=read, kernel_hbm_written_bytes=written)
    return out


# outputs and the O(N) row statistics are not intermediates: what the
# ledger records under these names is left out of the largest intermediate
_NOT_INTERMEDIATE = ("o", "lse")


def verify_no_full_materialization(runtime, q, k, v, block_size):
    """Run the forward with block_q = block_kv = block_size; report the largest intermediate.

    Intermediates are what the kernel path creates besides its outputs (o and
    the O(N) row statistics lse): any contiguous/broadcast/aligned copy of an
    input, and the kernel's shared-memory tiles (Qs, Ks, Vs, Ps of
    cuflash.tiling).  None of them grows with Nq * Nk.
    """
    if block_size is None:
        raise ValueError("block_size must be a positive int, got None")
    spec = check_attention_inputs(q, k, v, block_q=block_size, block_kv=block_size)
    with track_allocations() as ledger:
        o, _ = _build(runtime, spec, None, q, k, v)(q, k, v)  # uncached: every copy is seen
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv)
    bq, bkv, d, dv = plan.block_q, plan.block_kv, spec.d, spec.dv
    if plan.kernel in tiling.TC_KERNELS:  # shared-memory tiles (K/V in two stages)
        qs, ks, vs, _ = tiling.tc_strides(plan.kernel, d, dv)
        sizes = [bq * qs, 2 * bkv * ks, 2 * bkv * vs]
    else:
        sizes = [bq * (d + 1), bkv * (d + 1), bkv * dv, bq * (bkv + 1)]
    for what, shape in ledger:
        if what not in _NOT_INTERMEDIATE:
            n = 1
            for s in shape:
                n *= int(s)
            sizes.append(n)
    return o, int(max(sizes))

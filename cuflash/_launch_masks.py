"""Launching the SIMT kernels with the logit features: bias (and dbias), sliding window,
ALiBi, softcap and Philox dropout (``-DCUFLASH_MASKS``: ``flash_fwd_masked``,
``flash_bwd_dkdv_masked``, ``flash_bwd_dq_masked``; ``kernels_cu/masks.cuh``), and
the forward on tensor cores (``flash_fwd_tc_masked``, ``flash_fwd_tf32_masked``;
``kernels_cu/flash_fwd_tc.cu``) wherever the plain forward runs there.

The backends send a call here when it names any feature (:func:`wanted`); a
plain call never comes here and pays nothing for the features.  The backward
with features runs ``flash_bwd_tc_masked`` for float16/bfloat16 where the plain
call would run ``flash_bwd_tc`` (:mod:`cuflash._launch_masks_tc`), float32's
``flash_bwd_tf32_masked`` where the plain call would run ``flash_bwd_tf32``, the
SIMT kernels otherwise.

As in the plain launchers, the first call of a kind validates, plans,
compiles and packs the parameter block (the ``mask_*`` fields of
``FwdParams`` / ``BwdParams``); a repeated call with the same shapes, strides,
dtypes and scalar options allocates and launches.  The dropout seed is not
part of that key: each prepared call keeps one parameter block per recent
seed, so a training loop that draws a new seed every step pays one small
host-to-device copy, not a new plan.

Tensors of the features, read tile by tile by the kernels, never expanded:

* the bias, as the compute type (float32; float64 for float64 inputs -- a
  bias of another dtype is converted, a copy of the bias's own size), through
  element strides (batch, head, row, key) that are 0 along broadcast axes;
* the ALiBi slopes likewise (batch, head strides);
* the bias gradient: an accumulator of the bias's shape in the compute type,
  zeroed, into which ``flash_bwd_dkdv_masked`` stores dS (each element by one
  block) or, for a broadcast bias, adds it with atomics; then converted to the
  bias's dtype.  Memory O(size of bias).

Only where the leading dims of a bias (or of the slopes) cannot be walked
with one batch stride -- broadcast along one batch axis but not another --
is the array materialised over the batch axes (as :func:`cuflash._launch.flatten_lead`
does for inputs); its dbias is then accumulated at that size and summed on the host.
"""
import numpy as np

from . import kernels, tiling
from ._launch import (_collapse, _elem_strides, aligned16, aligned_copies, alloc_output, cached_call, contiguous_strides,
                      flatten_lead, fold_grid, kv_heads_for_kernel, launch, make_params,
                      pointer_arg, problem_dims, record_copy)
from ._validate import check_attention_inputs, check_backward_inputs
from ._validate_masks import check_masks

__all__ = ["wanted", "tiled_attention", "tiled_attention_backward", "mask_fields", "dbias_fields", "dbias_result",
           "flash_fwd_masked", "flash_bwd_masked", "memory_analysis"]

_FWD_FILE, _BWD_FILE = "flash_fwd.cu", "flash_bwd.cu"
_MASKS = {"CUFLASH_MASKS": None}
_SEED_BLOCKS = 16          # parameter blocks kept per prepared call (one per recent seed)
_CONVERT_BLOCKS = {"cuda": 4096, "emulator": 4}


def wanted(bias, window, alibi_slopes, softcap, dropout_p, seed):
    """True when a call names any feature (the plain launchers serve the others unchanged)."""
    return not (bias is None and window is None and alibi_slopes is None and softcap is None
                and seed is None and type(dropout_p) in (float, int) and dropout_p == 0)


def _acc_dtype(dtype):
    return np.dtype(np.float64) if tiling.accumulator_bytes(dtype) == 8 else np.dtype(np.float32)


def _operand(runtime, x, lead, trailing, acc, what):
    """``x`` (broadcastable to ``lead`` + ``trailing`` dims) as the kernels read it.

    Returns ``(array, strides)``: the array in the compute dtype (converted
    only when its dtype differs) and its element strides for (batch, head,
    *trailing) with 0 along broadcast axes; a copy only for negative strides on
    the emulator, or a batch layout that one stride cannot walk.
    """
    xp = runtime.xp
    if x.dtype != acc:
        x = x.astype(acc)
        record_copy(f"{what} in the compute dtype", x)
    nl = len(lead)
    x = x.reshape((1,) * (nl + trailing - x.ndim) + tuple(x.shape))
    es = _elem_strides(x)
    if es is None or (runtime.name == "emulator" and any(s < 0 for s in x.strides)):
        x = xp.ascontiguousarray(x)
        record_copy(f"contiguous {what}", x)
        es = _elem_strides(x)
    st = [0 if n == 1 else s for n, s in zip(x.shape, es)]
    tail = st[nl:]
    if nl == 0:
        return x, (0, 0) + tuple(tail)
    sh = st[nl - 1]
    sb = _collapse(lead[:-1], st[:nl - 1])
    if sb is None:   # no single batch stride: materialise over the batch axes only
        full = tuple(lead[:-1]) + tuple(x.shape[nl - 1:])
        x = xp.ascontiguousarray(xp.broadcast_to(x, full))
        record_copy(f"{what} broadcast over the batch", x)
        es = _elem_strides(x)
        st = [0 if n == 1 else s for n, s in zip(x.shape, es)]
        sh, tail = st[nl - 1], st[nl:]
        sb = _collapse(lead[:-1], st[:nl - 1])
    return x, (int(sb), int(sh)) + tuple(int(s) for s in tail)


def mask_fields(spec, ms, bias_strides=None, slope_strides=None, seed=None):
    """The ``mask_*`` fields of a parameter block for this call (seed: the dropout key)."""
    f = dict(mask_offset=spec.Nk - spec.Nq, mask_softcap=ms.softcap or 0.0,
             mask_drop_b0=ms.dropout_batch)
    if bias_strides is not None:
        f.update(mask_has_bias=1, mask_bias_sb=bias_strides[0], mask_bias_sh=bias_strides[1],
                 mask_bias_sr=bias_strides[2], mask_bias_sc=bias_strides[3])
    if slope_strides is not None:
        f.update(mask_has_alibi=1, mask_alibi_sb=slope_strides[0],
                 mask_alibi_sh=slope_strides[1])
    if ms.window is not None:
        # a width of Nq + Nk reaches every key from every query: wider ones are clamped to it,
        # so any Python int fits the block's 32-bit fields
        reach = spec.Nq + spec.Nk
        left, right = ms.window
        f.update(mask_window=(1 if left >= 0 else 0) | (2 if right >= 0 else 0),
                 mask_window_left=min(max(left, 0), reach),
                 mask_window_right=min(max(right, 0), reach))
    if ms.dropout:
        seed = ms.seed if seed is None else seed
        f.update(mask_dropout=1, mask_seed_lo=seed & 0xFFFFFFFF, mask_seed_hi=seed >> 32,
                 mask_drop_threshold=ms.drop_threshold, mask_drop_scale=ms.drop_scale)
    return f


class _SeedBlocks:
    """Parameter blocks of one prepared call, one per dropout seed (most recent kept)."""

    def __init__(self, runtime, struct, fields, ms):
        self.runtime, self.struct, self.fields, self.ms = runtime, struct, fields, ms
        self.blocks = {}

    def get(self, seed):
        blk = self.blocks.get(seed)
        if blk is None:
            f = dict(self.fields)
            if self.ms.dropout:
                f.update(mask_seed_lo=seed & 0xFFFFFFFF, mask_seed_hi=seed >> 32)
            blk = make_params(self.runtime, self.struct, **f)
            if len(self.blocks) >= _SEED_BLOCKS:
                self.blocks.pop(next(iter(self.blocks)))
            self.blocks[seed] = blk
        return blk


def _dummy(runtime, acc):
    """A 1-element array standing in for a feature tensor the call does not have."""
    cache = runtime.__dict__.setdefault("_mask_dummies", {})
    d = cache.get(acc)
    if d is None:
        d = cache[acc] = runtime.xp.zeros(1, acc)
    return d


def _feature_args(runtime, spec, ms, acc, bias, slopes):
    """(bias array, slopes array) for a launch, dummies where the call has none."""
    lead = spec.lead
    b = s = _dummy(runtime, acc)
    if bias is not None:
        b = _operand(runtime, bias, lead, 2, acc, "bias")[0]
    if slopes is not None:
        s = _operand(runtime, slopes, lead, 0, acc, "alibi_slopes")[0]
    if runtime.name == "emulator":
        b, s = pointer_arg(runtime, b), pointer_arg(runtime, s)
    return b, s


def _strides(runtime, spec, ms, acc):
    """The bias and slope strides of the call (from shapes, strides and dtypes only)."""
    bs = ss = None
    if ms.bias is not None:
        bs = _operand(runtime, ms.bias, spec.lead, 2, acc, "bias")[1]
    if ms.alibi_slopes is not None:
        ss = _operand(runtime, ms.alibi_slopes, spec.lead, 0, acc, "alibi_slopes")[1]
    return bs, ss


# --------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------
def _build_fwd(runtime, spec, ms, q, k, v, kernel=None):
    """The prepared masked forward: ``run(q, k, v, bias, slopes, seed) -> (o, lse)``.

    The kernel is planned as the plain forward's (:func:`cuflash.tiling.plan_flash_fwd` with
    ``masked=True``): flash_fwd_tc_masked (float16/bfloat16) or flash_fwd_tf32_masked
    (float32) on tensor cores where the plain call would run there, else flash_fwd_masked;
    ``kernel`` forces one of them (tests).
    """
    from ._launch_fwd import dense_serving_fields, tc_scale
    xp = runtime.xp
    acc = _acc_dtype(spec.dtype)
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv, kernel,
                            masked=True)
    scale, q_transform = tc_scale(xp, plan, spec.scale)
    if q_transform is not None:
        q = q_transform(q)
        record_copy("scaled copy", q)
    out_shape, lse_shape = spec.out_shape, spec.lse_shape
    dtype, lse_dtype = spec.dtype, spec.lse_dtype
    B, H = problem_dims(spec.lead)
    if spec.Nq == 0 or B * H == 0:
        def run_empty(q, k, v, bias, slopes, seed):
            return (alloc_output(xp, out_shape, dtype, "o"),
                    alloc_output(xp, lse_shape, lse_dtype, "lse"))
        return run_empty
    lead, grouped = spec.lead, spec.group > 1
    q_, qs = flatten_lead(runtime, q, lead)
    k_, ks = flatten_lead(runtime, k, lead, grouped)
    v_, vs = flatten_lead(runtime, v, lead, grouped)
    copy_q, copy_k, copy_v = q_ is not q, k_ is not k, v_ is not v
    o_sb, o_sh = contiguous_strides(lead, (spec.Nq, spec.dv))
    l_sb, l_sh = contiguous_strides(lead, (spec.Nq,))
    n_tiles = -(-spec.Nq // plan.block_q)
    name = plan.kernel
    grid = fold_grid(n_tiles, H, B, f"{name} (Nq={spec.Nq}, block_q={plan.block_q})")
    block, smem = (plan.threads,), plan.shared_bytes
    fn = kernels.get_function(runtime, kernels.KERNEL_SOURCES[name], name,
                              dict(kernels.plan_defines(plan), **_MASKS), smem)
    bias_st, slope_st = _strides(runtime, spec, ms, acc)
    fields = dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], o_sb=o_sb, o_sh=o_sh, o_sr=spec.dv,
        lse_sb=l_sb, lse_sh=l_sh, scale=scale, Nq=spec.Nq, Nk=spec.Nk, H=H,
        group=spec.group, causal=int(spec.causal is not None),
        causal_offset=spec.Nk - spec.Nq if spec.causal == "bottom_right" else 0,
        n_tiles=n_tiles, **dense_serving_fields(spec, B * H),
        **mask_fields(spec, ms, bias_st, slope_st))
    blocks = _SeedBlocks(runtime, "FwdParams", fields, ms)
    emulator, rt_name = runtime.name == "emulator", runtime.name
    needs_align = name in tiling.TC_MASKED_KERNELS  # cp.async copies 16 bytes

    def run(q, k, v, bias, slopes, seed):
        q_in = q
        if q_transform is not None:
            q = q_transform(q)
        if copy_q:
            q = flatten_lead(runtime, q, lead)[0]
        if copy_k:
            k = flatten_lead(runtime, k, lead, grouped)[0]
        if copy_v:
            v = flatten_lead(runtime, v, lead, grouped)[0]
        if needs_align and not (aligned16(q, qs) and aligned16(k, ks) and aligned16(v, vs)):
            # rows cp.async cannot read aligned (a rare view): contiguous copies, planned
            # afresh on every such call
            qc, kc, vc = aligned_copies(xp, (q_in, k, v))
            return _build_fwd(runtime, spec, ms, qc, kc, vc, kernel)(qc, kc, vc, bias, slopes,
                                                                      seed)
        if emulator:
            q, k, v = pointer_arg(runtime, q), pointer_arg(runtime, k), pointer_arg(runtime, v)
        b_arr, s_arr = _feature_args(runtime, spec, ms, acc, bias, slopes)
        params = blocks.get(seed if ms.dropout else None)
        o = alloc_output(xp, out_shape, dtype, "o")
        lse = alloc_output(xp, lse_shape, lse_dtype, "lse")
        launch(rt_name, fn, name, grid, block, (q, k, v, o, lse, params, b_arr, s_arr), smem)
        return o, lse
    return run


def _arr_key(a):
    return None if a is None else (a.__class__, tuple(a.shape), tuple(a.strides), str(a.dtype))


def _key(kind, arrays, scale, causal, block_q, block_kv, extra, features):
    try:
        base = tuple((tuple(a.shape), tuple(a.strides), a.dtype) for a in arrays)
        f = dict(features)
        seedless = (_arr_key(f.pop("bias", None)), _arr_key(f.pop("alibi_slopes", None)),
                    repr(f.get("window")), f.get("softcap").__class__, f.get("softcap"),
                    f.get("dropout_p").__class__, f.get("dropout_p"),
                    f.get("seed") is None, f.get("return_dbias"))
        return (kind,) + base + (scale.__class__, scale, causal.__class__, causal,
                                 block_q.__class__, block_q, block_kv.__class__, block_kv,
                                 extra) + seedless
    except (AttributeError, TypeError):  # not arrays or unhashable: validation says what
        return None


def tiled_attention(runtime, q, k, v, scale, causal, block_q, block_kv, return_lse, *,
                    bias=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                    seed=None):
    """The forward with features on the kernels: ``o`` or ``(o, lse)`` (no split-KV)."""
    features = dict(bias=bias, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                    dropout_p=dropout_p, seed=seed)
    key = _key("fwd-masked", (q, k, v), scale, causal, block_q, block_kv, None, features)

    def build():
        spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                      block_kv=block_kv)
        ms = check_masks(spec, q, **features)
        if ms is None:   # only neutral values (window=(-1, -1), a seed without dropout)
            from ._launch_fwd import flash_fwd
            return lambda q, k, v, bias, slopes, seed: flash_fwd(runtime, q, k, v, spec)
        return _build_fwd(runtime, spec, ms, q, k, v)
    run = cached_call(runtime, key, build)
    if key is not None and dropout_p and seed is not None:
        check_masks_seed(seed)
    o, lse = run(q, k, v, bias, alibi_slopes, seed)
    return (o, lse) if return_lse else o


def check_masks_seed(seed):
    """The seed of a cached call (whose key leaves the value out) is still validated."""
    from ._validate_masks import check_dropout
    check_dropout(0.5, seed)


def flash_fwd_masked(runtime, q, k, v, spec, ms, kernel=None):
    """The masked forward for a validated call (tests call it with a race-checked runtime, and
    ``kernel`` to force flash_fwd_masked, flash_fwd_tc_masked or flash_fwd_tf32_masked)."""
    return _build_fwd(runtime, spec, ms, q, k, v, kernel)(q, k, v, ms.bias, ms.alibi_slopes,
                                                          ms.seed)


# --------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------
def _dbias_target(spec, ms):
    """The dbias accumulator of a call: (shape, strides, mode, summed), from shapes alone.

    The accumulator is a C-contiguous array of the bias's shape (leading 1s
    added up to the logits' rank), walked by the kernel with element strides
    that are 0 along broadcast axes.  ``mode`` 1: every element has one writer
    (a bias of the logits' full shape); 2: atomic adds.  ``summed``: the batch
    axes could not be walked with one stride, so the accumulator spans them
    (shape ``lead[:-1]`` + the bias's other axes) and is summed to the bias's
    shape afterwards.
    """
    lead = tuple(spec.lead)
    nl = len(lead)
    full = lead + (spec.Nq, spec.Nk)
    shape = (1,) * (len(full) - len(ms.bias_shape)) + tuple(ms.bias_shape)
    mode = 1 if shape == full else 2

    def strides_of(shp):
        st, n = [], 1
        for size in reversed(shp):
            st.append(0 if size == 1 else n)
            n *= size
        return list(reversed(st))
    st = strides_of(shape)
    if nl == 0:
        return shape, (0, 0, st[-2], st[-1]), mode, False
    sb = _collapse(lead[:-1], st[:nl - 1])
    summed = sb is None
    if summed:
        shape = lead[:-1] + shape[nl - 1:]
        st = strides_of(shape)
        sb = _collapse(lead[:-1], st[:nl - 1])
    return shape, (int(sb), int(st[nl - 1]), int(st[-2]), int(st[-1])), mode, summed


def dbias_fields(spec, ms):
    """``(BwdParams fields, accumulator shape, summed)`` of the call's dbias (``{}, None,
    None`` without ``return_dbias``): see :func:`_dbias_target`."""
    if not ms.return_dbias:
        return {}, None, None
    shape, st, mode, summed = _dbias_target(spec, ms)
    return (dict(mask_dbias=mode, mask_dbias_sb=st[0], mask_dbias_sh=st[1], mask_dbias_sr=st[2],
                 mask_dbias_sc=st[3]), shape, summed)


def _build_bwd(runtime, spec, ms, do, q, k, v, o, deterministic, kernel=None):
    """The prepared masked backward: ``run(do, q, k, v, o, lse, bias, slopes, seed)``.

    float16/bfloat16 run flash_bwd_tc_masked where the plain call would run flash_bwd_tc
    (:mod:`cuflash._launch_masks_tc`), everything else the SIMT kernels below -- float32 on
    the atomic path of a GPU with tensor cores with flash_bwd_tf32_masked (3xTF32) in place of
    flash_bwd_dkdv_masked, as the plain call runs flash_bwd_tf32; ``kernel``
    ("flash_bwd_tc_masked" or "flash_bwd_dkdv_masked") forces one (tests).
    """
    from ._launch_bwd import _plans, _tf32_plan, plan_backward
    from .reference import sum_to_shape
    xp = runtime.xp
    dtype, acc = spec.dtype, _acc_dtype(spec.dtype)
    Nq, Nk, d, dv = spec.Nq, spec.Nk, spec.d, spec.dv
    main = plan_backward(runtime, d, dv, dtype, spec.block_q, spec.block_kv, kernel, masked=True)
    B, H = problem_dims(spec.lead)
    if main.kernel == "flash_bwd_tc_masked" and Nq and Nk and B * H:
        from ._launch_masks_tc import build_bwd_tc
        return build_bwd_tc(runtime, spec, ms, main, do, q, k, v, o, deterministic)
    plan, dq_plan, pre_plan = _plans(runtime, d, dv, dtype, spec.block_q, spec.block_kv,
                                     masked=True)
    Hk, group = kv_heads_for_kernel(spec)
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    want_db = ms.return_dbias
    bias_dtype = None if ms.bias is None else ms.bias.dtype

    def zero_dbias():
        return (xp.zeros(ms.bias_shape, bias_dtype),) if want_db else ()

    if Nq == 0 or Nk == 0 or B * H == 0:
        def run_empty(do, q, k, v, o, lse, bias, slopes, seed):
            return (xp.zeros(q_shape, dtype), xp.zeros(k_shape, dtype),
                    xp.zeros(v_shape, dtype)) + zero_dbias()
        return run_empty

    lead = spec.lead
    kv_lead = tuple(lead[:-1]) + (Hk,) if lead else ()
    full = {"dq": tuple(lead) + (Nq, d), "dk": kv_lead + (Nk, d), "dv": kv_lead + (Nk, dv)}
    want = {"dq": q_shape, "dk": k_shape, "dv": v_shape}
    summed = {n: int(np.prod(want[n], dtype=np.int64)) != int(np.prod(full[n], dtype=np.int64))
              for n in full}
    alloc_shape = {n: full[n] if summed[n] else want[n] for n in full}

    grouped = group > 1
    flat = [flatten_lead(runtime, x, lead, g) for x, g in
            ((q, False), (k, grouped), (v, grouped), (o, False), (do, False))]
    (_, qs), (_, ks), (_, vs), (_, os_), (_, dos) = flat
    copies = [a is not x for (a, _), x in zip(flat, (q, k, v, o, do))]
    groups_of = (False, grouped, grouped, False, False)

    atomic = not deterministic and dtype != np.float64
    # float32 on the atomic path: flash_bwd_tf32_masked (3xTF32 tensor cores) replaces
    # flash_bwd_dkdv_masked where it plans (cp.async reads 16-byte rows: element strides of
    # q, k, v, do multiples of 4), as in the plain backward
    tf32 = None
    if atomic and kernel is None and not any(st % 4 for st in qs + ks + vs + dos):
        tf32 = _tf32_plan(runtime, spec, masked=True)
    n_rows = B * H * Nq
    ws_size = n_rows * (1 + d) if atomic else n_rows  # D, then the float32 dQ accumulator
    pre_rows = pre_plan.block_q
    if runtime.name != "cuda":  # the emulator starts every block's threads: few big blocks
        pre_rows = -(-Nq // pre_rows) * pre_rows
    n_pre = -(-Nq // pre_rows)
    n_q_tiles = -(-Nq // dq_plan.block_q)
    n_kv_tiles = -(-Nk // (tf32 or plan).block_kv)
    bias_st, slope_st = _strides(runtime, spec, ms, acc)
    db_fields, db_shape, db_summed = dbias_fields(spec, ms)
    fields = dict(
        q_sb=qs[0], q_sh=qs[1], q_sr=qs[2], k_sb=ks[0], k_sh=ks[1], k_sr=ks[2],
        v_sb=vs[0], v_sh=vs[1], v_sr=vs[2], do_sb=dos[0], do_sh=dos[1], do_sr=dos[2],
        o_sb=os_[0], o_sh=os_[1], o_sr=os_[2], n_convert=n_rows * d, head_d=d, head_dv=dv,
        dq_accum_offset=n_rows,
        scale=spec.scale, Nq=Nq, Nk=Nk, H=H, Hk=Hk, group=group,
        causal=int(spec.causal is not None),
        causal_offset=Nk - Nq if spec.causal == "bottom_right" else 0, atomic_dq=int(atomic),
        pre_rows=pre_rows, n_q_tiles=n_q_tiles, n_kv_tiles=n_kv_tiles, n_pre_tiles=n_pre,
        d_offset=0, dq_slice_stride=0, nq_pad=0, n_splits=1, n_kv_blocks=n_kv_tiles,
        **mask_fields(spec, ms, bias_st, slope_st), **db_fields)
    blocks = _SeedBlocks(runtime, "BwdParams", fields, ms)

    defines = dict(kernels.plan_defines(plan), **_MASKS)
    last = ("flash_bwd_dq_convert", 0) if atomic else ("flash_bwd_dq_masked",
                                                       dq_plan.shared_bytes)
    dkdv_plan, dkdv_request = (
        (tf32, ("flash_bwd_tf32.cu", tf32.kernel, dict(kernels.plan_defines(tf32), **_MASKS),
                tf32.shared_bytes)) if tf32 is not None else
        (plan, (_BWD_FILE, "flash_bwd_dkdv_masked", defines, plan.shared_bytes)))
    pre, dkdv, fin = kernels.get_functions(runtime, [
        (_BWD_FILE, "flash_bwd_preprocess", defines, pre_plan.shared_bytes), dkdv_request,
        (_BWD_FILE, last[0], defines, last[1])])
    what = f"the backward (Nq={Nq}, Nk={Nk})"
    pre_launch = (pre, "flash_bwd_preprocess", fold_grid(n_pre, H, B, what),
                  (pre_plan.threads,), pre_plan.shared_bytes)
    dkdv_launch = (dkdv, dkdv_request[1], fold_grid(n_kv_tiles, Hk, B, what),
                   (dkdv_plan.threads,), dkdv_plan.shared_bytes)
    if atomic:
        nblk = max(1, min(-(-n_rows * d // tiling.BWD_THREADS),
                          _CONVERT_BLOCKS.get(runtime.name, 4)))
        fin_launch = (fin, "flash_bwd_dq_convert", (nblk,), (tiling.BWD_THREADS,), 0)
    else:
        fin_launch = (fin, "flash_bwd_dq_masked", fold_grid(n_q_tiles, H, B, what),
                      (dq_plan.threads,), dq_plan.shared_bytes)
    rt_name = runtime.name
    emulator = rt_name == "emulator"

    def sum_back(g, name):
        if not summed[name]:
            return g
        return xp.ascontiguousarray(sum_to_shape(g.astype(acc), want[name]).astype(dtype))

    def run(do, q, k, v, o, lse, bias, slopes, seed):
        ins = [q, k, v, o, do]
        for i, c in enumerate(copies):
            if c:
                ins[i] = flatten_lead(runtime, ins[i], lead, groups_of[i])[0]
        if emulator:
            ins = [pointer_arg(runtime, x) for x in ins]
        q_, k_, v_, o_, do_ = ins
        if tf32 is not None and not all(aligned16(x, st) for x, st in
                                        ((q_, qs), (k_, ks), (v_, vs), (do_, dos))):
            # a view starting off a 16-byte boundary: contiguous copies, planned afresh
            qc, kc, vc, oc, doc = aligned_copies(xp, (q, k, v, o, do))
            return _build_bwd(runtime, spec, ms, doc, qc, kc, vc, oc, deterministic)(
                doc, qc, kc, vc, oc, lse, bias, slopes, seed)
        if lse.dtype != acc or not lse.flags.c_contiguous:
            lse = xp.ascontiguousarray(lse, dtype=acc)
        b_arr, s_arr = _feature_args(runtime, spec, ms, acc, bias, slopes)
        params = blocks.get(seed if ms.dropout else None)
        dq = alloc_output(xp, alloc_shape["dq"], dtype, "dq")
        dk = alloc_output(xp, alloc_shape["dk"], dtype, "dk")
        dv_ = alloc_output(xp, alloc_shape["dv"], dtype, "dv")
        ws = alloc_output(xp, (ws_size,), acc, "workspace: D (+ float32 dQ accumulator)")
        db = xp.zeros(db_shape, acc) if want_db else _dummy(runtime, acc)
        fn, name, grid, block, smem = pre_launch
        launch(rt_name, fn, name, grid, block, (o_, do_, ws, ws, params), smem)
        fn, name, grid, block, smem = dkdv_launch
        launch(rt_name, fn, name, grid, block,
               (q_, k_, v_, do_, lse, ws, dk, dv_, ws, params, b_arr, s_arr, db), smem)
        fn, name, grid, block, smem = fin_launch
        if atomic:
            launch(rt_name, fn, name, grid, block, (ws, dq, params), smem)
        else:
            launch(rt_name, fn, name, grid, block,
                   (q_, k_, v_, do_, lse, ws, dq, params, b_arr, s_arr), smem)
        return (sum_back(dq, "dq"), sum_back(dk, "dk"), sum_back(dv_, "dv")) + \
            dbias_result(xp, ms, db, db_summed)
    return run


def dbias_result(xp, ms, db, summed):
    """``(dbias,)`` from the kernels' accumulator ``db`` (summed over the batch axes it spans
    when ``summed``), in the bias's shape and dtype; ``()`` without ``return_dbias``."""
    if not ms.return_dbias:
        return ()
    from .reference import sum_to_shape
    if summed:
        db = sum_to_shape(db, ms.bias_shape)
    return (xp.ascontiguousarray(db.reshape(ms.bias_shape).astype(ms.bias.dtype)),)


def tiled_attention_backward(runtime, do, q, k, v, o, lse, scale, causal, block_q, block_kv,
                             deterministic, *, bias=None, window=None, alibi_slopes=None,
                             softcap=None, dropout_p=0.0, seed=None, return_dbias=False):
    """The backward with features on the kernels: ``(dq, dk, dv[, dbias])``."""
    features = dict(bias=bias, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                    dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    try:
        lse_key = (tuple(lse.shape), lse.dtype)
    except AttributeError:
        lse_key = None
    key = None if lse_key is None else _key(
        "bwd-masked", (do, q, k, v, o), scale, causal, block_q, block_kv,
        (lse_key, deterministic.__class__, deterministic), features)

    def build():
        spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                     block_q=block_q, block_kv=block_kv)
        ms = check_masks(spec, q, **features)
        if ms is None:
            from ._launch_bwd import flash_bwd
            return (lambda do, q, k, v, o, lse, bias, slopes, seed:
                    flash_bwd(runtime, do, q, k, v, o, lse, spec, bool(deterministic)))
        return _build_bwd(runtime, spec, ms, do, q, k, v, o, bool(deterministic))
    run = cached_call(runtime, key, build)
    if key is not None and dropout_p and seed is not None:
        check_masks_seed(seed)
    return run(do, q, k, v, o, lse, bias, alibi_slopes, seed)


def flash_bwd_masked(runtime, do, q, k, v, o, lse, spec, ms, deterministic=False, kernel=None):
    """The masked backward for a validated call (tests call it with a race-checked runtime, and
    ``kernel`` to force flash_bwd_tc_masked or flash_bwd_dkdv_masked)."""
    return _build_bwd(runtime, spec, ms, do, q, k, v, o, bool(deterministic), kernel)(
        do, q, k, v, o, lse, ms.bias, ms.alibi_slopes, ms.seed)


# --------------------------------------------------------------------------
# memory_analysis with a bias or a window
# --------------------------------------------------------------------------
def memory_analysis(runtime, N, d, dtype, Nk, block_q, block_kv, batch, heads, num_splits=1,
                    bias_shape=None, window=None):
    """memory_analysis on the kernels; with ``bias_shape``/``window`` the masked forward's.

    Calls with a bias or a window run the forward the planner picks with
    ``masked=True`` (flash_fwd_tc_masked, flash_fwd_tf32_masked or
    flash_fwd_masked), so its tiles and shared memory are reported, with the
    feature keys of :func:`cuflash.reference.masks.memory_features`.
    """
    from . import _launch_fwd, reference
    from ._validate import check_positive_int
    if bias_shape is None and window is None:
        return _launch_fwd.memory_analysis(runtime, N, d, dtype, Nk, block_q, block_kv, batch,
                                           heads, num_splits)
    d_ = check_positive_int(d, "d")
    label = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    plan = runtime.plan_fwd(d_, d_, label, check_positive_int(block_q, "block_q"),
                            check_positive_int(block_kv, "block_kv"), masked=True)
    out = reference.memory_analysis(N, d, dtype, Nk=Nk, block_q=plan.block_q,
                                    block_kv=plan.block_kv, batch=batch, heads=heads,
                                    num_splits=num_splits, bias_shape=bias_shape, window=window)
    out.pop("cpu_tile_bytes_per_worker", None)
    out.update({
        "backend": runtime.name, "kernel": plan.kernel, "tiles_chosen": plan.chosen,
        "threads_per_block": plan.threads, "sram_bytes_per_block": plan.shared_bytes,
        "sram_layout": tiling.kernel_tiling(plan.kernel).layout(
            plan.block_q, plan.block_kv, d_, d_, plan.acc_bytes),
        "sram_limit_bytes": plan.limit, "sram_limit_source": plan.limit_source,
        "kernel_global_extra_bytes": out["batch"] * out["heads"] * out["N"] * plan.acc_bytes,
    })
    return out


# --------------------------------------------------------------------------
# the serving calls: varlen and KV cache (flash_fwd_serving_masked), varlen backward
# --------------------------------------------------------------------------
def feature_key(features):
    """A hashable description of a serving call's features (seed included), or None."""
    if not features or not wanted(**features):
        return None
    f = dict(features)
    return (_arr_key(f.pop("bias", None)), _arr_key(f.pop("alibi_slopes", None)),
            repr(f.get("window")), f.get("softcap").__class__, f.get("softcap"),
            f.get("dropout_p").__class__, f.get("dropout_p"), f.get("seed").__class__,
            f.get("seed"))


def _no_features(features):
    return ()


def serving_masks(runtime, q, B, H, Nq, Nk, dtype, features, pack=1):
    """(MaskSpec, mask_* fields, args(features)) of a serving call, or (None, None, ...).

    ``Nq``/``Nk`` are the longest query / key sequence (the bias's extent);
    ``pack`` the query heads packed into one problem (grouped-query decoding).
    ``args(features)`` gives the (bias, slopes) kernel arguments of a call.
    """
    from ._validate_masks import _Extent, check_serving_masks
    if not features or not wanted(**features):
        return None, None, _no_features
    ms = check_serving_masks(q, B, H, Nq, Nk, **features)
    if ms is None:
        return None, None, _no_features
    acc = _acc_dtype(dtype)
    extent = _Extent((B, H), Nq, Nk)
    bs, ss = _strides(runtime, extent, ms, acc)
    fields = mask_fields(extent, ms, bs, ss)
    fields["mask_pack"] = pack if pack > 1 else 0

    def args(features):
        return _feature_args(runtime, extent, ms, acc, features.get("bias"),
                             features.get("alibi_slopes"))
    return ms, fields, args


def varlen_attention_backward(runtime, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, scale, causal, deterministic,
                              check_inputs, features, return_dbias=False):
    """``cuflash.varlen_attention_backward`` with features: the masked dense backward per
    sequence on (H, n, d) views (as the plain varlen backward), each with its sequence's
    features (:func:`cuflash._validate_masks.sequence_masks`); dbias is accumulated per
    sequence into an array of the bias's shape."""
    from dataclasses import replace
    from ._validate_masks import check_serving_masks, sequence_masks
    from ._validate_serving import check_varlen_backward, check_varlen_inputs
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=True)
    check_varlen_backward(do, q, k, v, o, lse, spec)
    ms = check_serving_masks(q, spec.B, spec.H, spec.max_q, spec.max_k,
                             return_dbias=return_dbias, **features)
    xp = runtime.xp
    acc = _acc_dtype(spec.dtype)
    dq = xp.zeros(q.shape, spec.dtype)
    dk = xp.zeros(k.shape, spec.dtype)
    dv = xp.zeros(v.shape, spec.dtype)
    dbias = xp.zeros(ms.bias_shape, acc) if return_dbias else None
    lse = lse if lse.dtype == acc else lse.astype(acc)
    for b in range(spec.B):
        q0, q1 = int(spec.cu_q[b]), int(spec.cu_q[b + 1])
        k0, k1 = int(spec.cu_k[b]), int(spec.cu_k[b + 1])
        if q1 == q0 or k1 == k0:
            continue

        def view(a, lo, hi):
            return a[lo:hi].swapaxes(0, 1)
        args = (view(do, q0, q1), view(q, q0, q1), view(k, k0, k1), view(v, k0, k1),
                view(o, q0, q1), lse[q0:q1].swapaxes(0, 1))
        bspec = check_backward_inputs(*args, scale=spec.scale, causal=spec.causal or False)
        g = flash_bwd_masked(runtime, *args, bspec, sequence_masks(ms, b, q1 - q0, k1 - k0),
                             deterministic)
        dq[q0:q1] = g[0].swapaxes(0, 1)
        dk[k0:k1] = g[1].swapaxes(0, 1)
        dv[k0:k1] = g[2].swapaxes(0, 1)
        if dbias is not None:   # sequence b's share of the (broadcast) bias
            sequence_masks(replace(ms, bias=dbias), b, q1 - q0, k1 - k0).bias[...] += g[3]
    if dbias is not None:
        return dq, dk, dv, dbias.astype(ms.bias.dtype)
    return dq, dk, dv

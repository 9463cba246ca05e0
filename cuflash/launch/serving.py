"""Launching the serving forward (``flash_fwd.cu`` with ``-DCUFLASH_FWD_SERVING``), with or
without the logit features (``flash_fwd_serving_masked``: ``-DCUFLASH_MASKS`` as well).

One kernel, ``flash_fwd_serving``, covers what a serving system asks of the
forward, with the geometry of ``kernels_cu/fwd_problem.cuh``:

* split-KV (flash-decoding): ``num_splits`` ranges of key tiles, float32
  partial outputs merged exactly by ``flash_fwd_combine``; None chooses the
  count from the device's SMs (:func:`cuflash.tiling.num_splits_heuristic`);
* a KV cache, contiguous or paged, with per-sequence lengths, after
  ``flash_kv_append`` has written the new keys and values into it;
* variable-length batches packed without padding (``cu_seqlens``);
* packed grouped-query rows: when a kv head has ``group`` query heads whose
  rows lie one stride apart (any contiguous q), they become the rows of one
  problem, so each K/V tile is read once per kv head (decoding with GQA).

As everywhere, the first call of a kind validates shapes, plans, compiles and
packs its ``FwdParams``; a repeated call allocates and launches.  The index
arrays (cu_seqlens, cache_seqlens, block_table) are kernel arguments, read on
the device; their values are checked on the host only when ``check_inputs``.
"""
import numpy as np

from .. import kernels, tiling
from .._validate_serving import (check_kvcache_shapes, check_kvcache_values, check_num_splits,
                                 check_varlen_inputs)
from .common import (acc_dtype, alloc_output, cached_call, contiguous_strides, flatten_lead,
                     fold_grid, launch, make_params, pointer_arg, problem_dims)
from .features import DEFINES, prepare_serving, serving_key

__all__ = ["tiled_attention_split", "attention_with_kvcache", "varlen_attention",
           "serving_plan"]

_FILE = "flash_fwd.cu"
_SERVING = {"CUFLASH_FWD_SERVING": None}
_COMBINE_THREADS = 128      # 4 warps, one output row each
_APPEND_THREADS = 128
# a GPU gets enough blocks to fill it; the emulator, where a block costs its threads'
# start-up, a few grid-stride blocks
_MAX_HELPER_BLOCKS = {"cuda": 4096, "emulator": 2}


def serving_plan(runtime, d, dv, dtype, rows, block_q=None, block_kv=None, kernel="flash_fwd"):
    """Tiles of the serving kernel: query tiles as short as the rows allow (decoding has few).

    Explicit sizes are honoured (or refused by the planner); otherwise the
    shortest block_q of flash_fwd's choices that holds ``rows`` (at most the
    default), with the default block_kv.  ``kernel``: the tiling planned,
    "flash_fwd", or "flash_fwd_masked" for the variant with the logit features.
    """
    if block_q is not None or block_kv is not None:
        return runtime.plan(kernel, d, dv, dtype, block_q, block_kv)
    t = tiling.kernel_tiling(kernel)
    default = runtime.plan(kernel, d, dv, dtype)
    for bq in t.block_q_choices:
        if bq >= min(rows, default.block_q):
            try:
                return runtime.plan(kernel, d, dv, dtype, bq, default.block_kv)
            except ValueError:
                break
    return default


def _index_dummy(runtime):
    """A 1-element int32 array standing in for index arrays a call does not have."""
    d = getattr(runtime, "_serving_dummy", None)
    if d is None:
        d = runtime._serving_dummy = runtime.xp.zeros(1, np.int32)
    return d


class _Geometry:
    """What the serving kernel needs to know about one call, besides the data pointers.

    Fields a call does not name take the dense call's values (no varlen, no cache, no pages,
    the planner's tiles).
    """
    _DENSE = dict(total_q=0, total_k=0, seqlens_add=0, varlen=False, kv_cache=False,
                  page_size=0, num_pages=0, max_pages=0, block_q=None, block_kv=None)

    def __init__(self, **kw):
        self.__dict__.update(self._DENSE, **kw)


def _build(runtime, g, num_splits, feats=None):
    """The prepared serving forward of geometry ``g``: ``run(q, k, v, idx..., f) -> (o, lse)``.

    ``g`` holds B, H (problems per batch entry after packing), group, rows,
    q_period, Nk, d, dv, dtype, lse_dtype, scale, causal (None or the
    alignment), strides of q/k/v/o/lse, the varlen / KV-cache / paging fields
    and ``n_out_rows`` (lse elements).  ``feats``: the call's prepared logit
    features (:func:`cuflash.launch.features.prepare_serving`), None for none;
    ``f`` carries each call's feature arrays.
    """
    xp = runtime.xp
    masked = feats is not None and feats.ms is not None
    plan = serving_plan(runtime, g.d, g.dv, g.dtype, g.rows, g.block_q, g.block_kv,
                        "flash_fwd_masked" if masked else "flash_fwd")
    n_tiles = max(1, -(-g.rows // plan.block_q))
    n_kv = -(-g.max_keys // plan.block_kv) if g.max_keys else 0
    blocks = n_tiles * g.H * g.B
    if num_splits is None:
        num_splits = tiling.num_splits_heuristic(
            blocks, n_kv, tiling.split_slots(runtime.num_sms, plan.threads))
    split_tiles = max(1, -(-n_kv // num_splits)) if n_kv else 1
    defines = dict(kernels.plan_defines(plan), **_SERVING)
    name = "flash_fwd_serving"
    if masked:  # the features variant of the kernel
        defines.update(DEFINES)
        name = "flash_fwd_serving_masked"
    helpers = kernels.fwd_helper_defines(g.dtype)
    fn, comb, app = kernels.get_functions(runtime, [
        (_FILE, name, defines, plan.shared_bytes),
        (_FILE, "flash_fwd_combine", helpers, (_COMBINE_THREADS // 32) * 8 * 128),
        (_FILE, "flash_kv_append", helpers, 0)])
    causal = g.causal is not None
    params = make_params(
        runtime, "FwdParams",
        q_sb=g.q[0], q_sh=g.q[1], q_sr=g.q[2], k_sb=g.k[0], k_sh=g.k[1], k_sr=g.k[2],
        v_sb=g.v[0], v_sh=g.v[1], v_sr=g.v[2], o_sb=g.o[0], o_sh=g.o[1], o_sr=g.o[2],
        lse_sb=g.lse[0], lse_sh=g.lse[1], lse_sr=g.lse[2], scale=g.scale, Nq=g.rows,
        Nk=g.Nk, H=g.H, group=g.group_kernel, causal=int(causal),
        causal_offset=0, n_tiles=n_tiles, n_out_rows=g.n_out_rows, n_splits=num_splits,
        split_tiles=split_tiles, q_period=g.q_period,
        causal_br=int(g.causal == "bottom_right"), total_q=g.total_q, total_k=g.total_k,
        seqlens_add=g.seqlens_add, kv_capacity=g.kv_capacity, varlen=int(g.varlen),
        kv_cache=int(g.kv_cache), page_size=g.page_size, num_pages=g.num_pages,
        max_pages=g.max_pages, head_d=g.d, head_dv=g.dv, **(feats.fields if masked else {}))
    grid = fold_grid(n_tiles * num_splits, g.H, g.B,
                     f"{name} ({n_tiles} tiles x {num_splits} splits)")
    rt = runtime.name
    helper_blocks = _MAX_HELPER_BLOCKS.get(rt, 2)
    comb_grid = (max(1, min(-(-g.n_out_rows // (_COMBINE_THREADS // 32)), helper_blocks)),)
    ws_size = num_splits * g.n_out_rows * (g.dv + 1) if num_splits > 1 else 1
    acc = acc_dtype(g.dtype)
    comb_smem = (_COMBINE_THREADS // 32) * num_splits * acc.itemsize  # a weight per split, warp
    append = None
    if g.seqlens_add:
        a = g.append
        aparams = make_params(runtime, "KVAppendParams", **a["params"])
        n = a["elements"]
        append = (aparams, (max(1, min(-(-n // _APPEND_THREADS), helper_blocks)),))
    emulator = rt == "emulator"
    out_shape, lse_shape = g.out_shape, g.lse_shape

    def run(q, k, v, cu_q, cu_k, seqlens, table, k_new=None, v_new=None, f=None):
        extra = feats.args(f) if masked else ()
        if emulator:  # strided views (a cache too) as the span of their buffer
            q, k, v = pointer_arg(runtime, q), pointer_arg(runtime, k), pointer_arg(runtime, v)
        if append is not None:
            aparams, agrid = append
            launch(rt, app, "flash_kv_append", agrid, (_APPEND_THREADS,),
                   (k_new, v_new, k, v, seqlens, table, aparams), 0)
        o = alloc_output(xp, out_shape, g.dtype, "o")
        lse = alloc_output(xp, lse_shape, g.lse_dtype, "lse")
        if g.n_out_rows == 0:
            return o, lse
        ws = alloc_output(xp, (ws_size,), acc, "split partials (compute type)")
        launch(rt, fn, name, grid, (plan.threads,),
               (q, k, v, o, lse, params, cu_q, cu_k, seqlens, table, ws) + extra,
               plan.shared_bytes)
        if num_splits > 1:
            launch(rt, comb, "flash_fwd_combine", comb_grid, (_COMBINE_THREADS,),
                   (ws, o, lse, params), comb_smem)
        return o, lse
    run.num_splits = num_splits
    run.plan = plan
    return run


def _pack_gqa(lead, qs, group, kernel_group, Nq, dv):
    """The problems of a dense-layout q: ``(packed, H, rows, kernel group, q, o, lse strides)``.

    When a kv head's ``group`` query heads lie one stride apart in q (``sh == Nq * sr``), they
    are packed as the rows of one problem (H / group problems of group * Nq rows, each K/V
    tile read once per kv head); otherwise each query head is a problem of Nq rows whose kv
    head the kernel finds with ``kernel_group``.  o and lse are C-contiguous over ``lead``.
    """
    B, H = problem_dims(lead)
    o_sb, o_sh = contiguous_strides(lead, (Nq, dv))
    l_sb, l_sh = contiguous_strides(lead, (Nq,))
    sb, sh, sr = qs
    if group > 1 and sh == Nq * sr:
        return (True, H // group, group * Nq, 1, (sb, group * sh, sr),
                (o_sb, group * o_sh, dv), (l_sb, group * l_sh, 1))
    return False, H, Nq, kernel_group, qs, (o_sb, o_sh, dv), (l_sb, l_sh, 1)


# --------------------------------------------------------------------------
# tiled_attention(num_splits=...) on dense batches
# --------------------------------------------------------------------------
def tiled_attention_split(runtime, q, k, v, spec, num_splits):
    """The dense forward through the serving kernel with ``num_splits`` key splits."""
    key = ("fwd-split", q.shape, q.strides, q.dtype, k.shape, k.strides, k.dtype, v.shape,
           v.strides, spec.scale, spec.causal, num_splits)

    def build():
        lead = spec.lead
        B, H = problem_dims(lead)
        q_, qs = flatten_lead(runtime, q, lead)
        k_, ks = flatten_lead(runtime, k, lead)
        v_, vs = flatten_lead(runtime, v, lead)
        copies = (q_ is not q, k_ is not k, v_ is not v)
        # MQA (one kv head, broadcast over the heads: head stride 0) is one group of all H
        group = spec.group if spec.group > 1 else (H if ks[1] == 0 and vs[1] == 0 else 1)
        # 2-D inputs (no lead) have no heads to pack
        _, g_H, rows, group_k, qs_k, os_k, ls_k = _pack_gqa(
            lead, qs, group if lead else 1, spec.group, spec.Nq, spec.dv)
        g = _Geometry(B=B, H=g_H, group_kernel=group_k, rows=rows, q_period=max(spec.Nq, 1),
                      Nk=spec.Nk, max_keys=spec.Nk, d=spec.d, dv=spec.dv, dtype=spec.dtype,
                      lse_dtype=spec.lse_dtype, scale=spec.scale, causal=spec.causal,
                      q=qs_k, k=ks, v=vs, o=os_k, lse=ls_k, n_out_rows=B * H * spec.Nq,
                      kv_capacity=spec.Nk, out_shape=spec.out_shape, lse_shape=spec.lse_shape,
                      block_q=spec.block_q, block_kv=spec.block_kv)
        inner = _build(runtime, g, num_splits)
        dummy = _index_dummy(runtime)

        def run(q, k, v):
            if copies[0]:
                q = flatten_lead(runtime, q, lead)[0]
            if copies[1]:
                k = flatten_lead(runtime, k, lead)[0]
            if copies[2]:
                v = flatten_lead(runtime, v, lead)[0]
            return inner(q, k, v, dummy, dummy, dummy, dummy)
        run.num_splits = inner.num_splits
        return run
    return cached_call(runtime, key, build)(q, k, v)


# --------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------
def attention_with_kvcache(runtime, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                           block_table, scale, causal, num_splits, return_lse, check_inputs,
                           features=None):
    """``cuflash.attention_with_kvcache`` on the kernels (documented there).

    Shapes are validated on the first call of a kind; the index values (a host
    copy) on every call with ``check_inputs``, before anything is written.
    ``features``: the logit features as one value (:func:`cuflash.launch.features.of`),
    None for none; a call with features does not split the keys.
    """
    arrays = (q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
    try:
        key = ("kvcache",) + tuple((a.shape, a.strides, a.dtype) if a is not None else None
                                   for a in arrays) + (
            scale.__class__, scale, causal.__class__, causal, num_splits.__class__, num_splits,
            serving_key(features))
    except (AttributeError, TypeError):
        key = None

    def build():
        spec = check_kvcache_shapes(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                    block_table, scale=scale, causal=causal,
                                    num_splits=num_splits)
        return _build_kvcache(runtime, spec, q, k_cache, v_cache, k_new, v_new,
                              check_num_splits(num_splits), features)
    run = cached_call(runtime, key, build)
    if check_inputs:
        check_kvcache_values(run.spec, cache_seqlens, block_table)
    o, lse = run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, features)
    return (o, lse) if return_lse else o


def _build_kvcache(runtime, spec, q, k_cache, v_cache, k_new, v_new, num_splits, features=None):
    lead = (spec.B, spec.H)
    q_, qs = flatten_lead(runtime, q, lead)
    copy_q = q_ is not q
    kc = [s // k_cache.itemsize for s in k_cache.strides]
    vc = [s // v_cache.itemsize for s in v_cache.strides]
    packed, H_k, rows, group_k, qs_k, os_k, ls_k = _pack_gqa(lead, qs, spec.group, spec.group,
                                                              spec.Nq, spec.dv)
    append = None
    if spec.Nnew:
        kn = [s // k_new.itemsize for s in k_new.strides]
        vn = [s // v_new.itemsize for s in v_new.strides]
        append = {"elements": spec.B * spec.Hk * spec.Nnew * (spec.d + spec.dv),
                  "params": dict(kn_sb=kn[0], kn_sh=kn[1], kn_sr=kn[2], vn_sb=vn[0],
                                 vn_sh=vn[1], vn_sr=vn[2], kc_sb=kc[0], kc_sh=kc[1],
                                 kc_sr=kc[2], vc_sb=vc[0], vc_sh=vc[1], vc_sr=vc[2], B=spec.B,
                                 Hk=spec.Hk, Nnew=spec.Nnew, kv_capacity=spec.capacity,
                                 page_size=spec.page_size if spec.paged else 0,
                                 num_pages=spec.num_pages, max_pages=spec.max_pages,
                                 d=spec.d, dv=spec.dv)}
    g = _Geometry(B=spec.B, H=H_k, group_kernel=group_k, rows=rows, q_period=max(spec.Nq, 1),
                  Nk=spec.capacity, max_keys=spec.capacity, d=spec.d, dv=spec.dv,
                  dtype=spec.dtype, lse_dtype=spec.lse_dtype, scale=spec.scale,
                  causal=spec.causal, q=qs_k, k=(kc[0], kc[1], kc[2]),
                  v=(vc[0], vc[1], vc[2]), o=os_k, lse=ls_k,
                  n_out_rows=spec.B * spec.H * spec.Nq, seqlens_add=spec.Nnew,
                  kv_capacity=spec.capacity, kv_cache=True,
                  page_size=spec.page_size if spec.paged else 0, num_pages=spec.num_pages,
                  max_pages=spec.max_pages, append=append,
                  out_shape=(spec.B, spec.H, spec.Nq, spec.dv), lse_shape=(spec.B, spec.H, spec.Nq))
    feats = prepare_serving(runtime, q, spec.B, spec.H, spec.Nq, spec.capacity, spec.dtype,
                            features, pack=spec.group if packed else 1)
    if feats.ms is not None:
        num_splits = 1  # feature calls do not split the keys
    inner = _build(runtime, g, num_splits, feats)
    dummy = _index_dummy(runtime)
    emulator = runtime.name == "emulator"

    def run(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, features=None):
        if copy_q:
            q = flatten_lead(runtime, q, lead)[0]
        table = dummy if block_table is None else block_table
        if emulator and k_new is not None:
            k_new, v_new = pointer_arg(runtime, k_new), pointer_arg(runtime, v_new)
        return inner(q, k_cache, v_cache, dummy, dummy, cache_seqlens, table, k_new, v_new,
                     features)
    run.spec = spec
    run.num_splits = inner.num_splits
    return run


# --------------------------------------------------------------------------
# variable-length batches
# --------------------------------------------------------------------------
def varlen_attention(runtime, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     scale, causal, return_lse, check_inputs, features=None):
    """``cuflash.varlen_attention`` on the kernels (documented there).

    ``features``: the logit features as one value (:func:`cuflash.launch.features.of`),
    None for none.
    """
    spec = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                               check_inputs=check_inputs)
    key = ("varlen", q.shape, q.strides, q.dtype, k.shape, k.strides, v.shape, v.strides,
           cu_seqlens_q.shape, spec.max_q, spec.max_k, spec.scale, spec.causal,
           serving_key(features))

    def build():
        qs = [s // q.itemsize for s in q.strides]
        ks = [s // k.itemsize for s in k.strides]
        vs = [s // v.itemsize for s in v.strides]
        for name, st in (("q", qs), ("k", ks), ("v", vs)):
            if st[2] != 1:
                raise ValueError(f"varlen {name} needs a contiguous last dim (strides {st})")
        g = _Geometry(B=spec.B, H=spec.H, group_kernel=spec.group, rows=spec.max_q,
                      q_period=max(spec.max_q, 1), Nk=spec.max_k, max_keys=spec.max_k,
                      d=spec.d, dv=spec.dv, dtype=spec.dtype, lse_dtype=spec.lse_dtype,
                      scale=spec.scale, causal=spec.causal, q=(0, qs[1], qs[0]),
                      k=(0, ks[1], ks[0]), v=(0, vs[1], vs[0]),
                      o=(0, spec.dv, spec.H * spec.dv), lse=(0, 1, spec.H),
                      n_out_rows=spec.total_q * spec.H, total_q=spec.total_q,
                      total_k=spec.total_k, kv_capacity=spec.max_k, varlen=True,
                      out_shape=(spec.total_q, spec.H, spec.dv), lse_shape=(spec.total_q, spec.H))
        feats = prepare_serving(runtime, q, spec.B, spec.H, spec.max_q, spec.max_k, spec.dtype,
                                features)
        inner = _build(runtime, g, 1, feats)

        def run(q, k, v, cu_q, cu_k, dummy, features):
            return inner(q, k, v, cu_q, cu_k, dummy, dummy, f=features)
        return run
    run = cached_call(runtime, key, build)
    dummy = _index_dummy(runtime)
    o, lse = run(q, k, v, cu_seqlens_q, cu_seqlens_k, dummy, features)
    return (o, lse) if return_lse else o

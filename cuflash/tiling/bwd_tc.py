"""flash_bwd_tc (float16/bfloat16 backward on tensor cores), the backward's kernel choice (:func:`plan_flash_bwd`) and its traffic model."""
from .core import (MAX_HEAD_DIM, KernelTiling, _dtype_name, kernel_tiling, plan, register,
                   square_head_dims)
from .fwd import TC_DTYPES, TC_PAD_DEFINE, _refuse_off_tensor_cores


# --------------------------------------------------------------------------
# flash_bwd_tc (kernels_cu/flash_bwd_tc.cu): float16/bfloat16 backward on tensor cores
# --------------------------------------------------------------------------
# A key group of 16 * mt keys belongs to qs warps (query split qs = 1 or 2; block_kv =
# 16 * mt * warps / qs); each of them computes S^T, dP^T for its keys and block_q / qs of
# the queries -- dP^T (mt * block_q / qs / 2 floats per lane) beside P^T packed in 16-bit
# (half that) -- and accumulates dK, dV for its keys and 1 / qs of the columns (mt * (d + dv)
# / 2 / qs floats per lane, halved again per pass when the head dims run in two passes).
# With qs = 2, P^T and dS^T meet in shared memory (Ps).  Layout (16-bit, rows padded by 8
# elements; float32 at the end):
#   Ks (Bc, d+8), Vs (Bc, dv+8), Qs 2 x (Br, d+8), dOs 2 x (Br, dv+8), dSs (Bc, Br+8),
#   [Ps (Bc, Br+8) when qs = 2], lse2_s 2 x Br, D_s 2 x Br
# With the query split a plan whose layout passes the limit takes one dOs buffer instead
# (KernelTiling.smaller, -DCUFLASH_BWD_DO_STAGES=1): the next tile's dO is then copied after
# a barrier behind dV += P^T dO, in flight under dK and dQ only.  That fits FlashAttention-2's
# tiles into an A100's 163 KB: 64 x 128 at d = 128 (173 KB -> 156 KB) and 128 x 128 at d = 64
# (178 KB -> 160 KB); an H100's 227 KB keeps both buffers (the barrier and the second copy
# branch cost 13-16 instructions per warp-trip, bench/results/tc_kernels_counts.md).
# Registers: ptxas needs ~65-80 registers beside these arrays (fragments, addresses, loop
# state; sm_80/sm_90, NVRTC 13.0): 252-254 registers and no spill at 176 (d = dv = 128,
# block_q = 64: 128 + 48; d = dv = 64, 32 keys per warp, block_q = 32: 128 + 48), while
# 192 spilled (d = 96, dv = 32, 32 keys per warp, block_q = 32, with P kept in float32), and
# two passes need ~24 more (on sm_80 d = dv = 256, block_q = 64: 128 + 48 spilled 12 bytes,
# d = 256, dv = 176, block_q = 64, 4 warps: 112 + 48 spilled 4; 152 compiled clean).  So
# plans are held to BWD_TC_ARRAY_BUDGET (one pass) and _TWO_PASSES; within them ptxas may
# still spill a plan (at 255 registers, by its allocation, not the count): the curated plans
# are compiled by CI, explicit ones checked when compiled on a GPU.
BWD_TC_TILE_CHOICES = (16, 32, 64, 128)
BWD_TC_ARRAY_BUDGET = 176
BWD_TC_ARRAY_BUDGET_TWO_PASSES = 152
BWD_TC_PRE_THREADS = 128   # kPreThreads in flash_bwd_tc.cu
BWD_TC_CONVERT_THREADS = 256  # kConvThreads


def _bwd_tc_arrays(bq, d, dv, mt, passes, qs=1):
    """Register array floats per lane: dK/dV (8 per 16-column chunk and 16 keys) + dP^T + P^T."""
    slices = passes * qs
    chunks = -(-(d // 16) // slices) + -(-(dv // 16) // slices)
    return mt * 8 * chunks + mt * (bq // qs // 2 + bq // qs // 4)


def _bwd_tc_budget(passes):
    return BWD_TC_ARRAY_BUDGET if passes == 1 else BWD_TC_ARRAY_BUDGET_TWO_PASSES


# flash_bwd_tc_masked (-DCUFLASH_MASKS: the logit features): besides the arrays above it keeps
# 1 - tanh^2 of the softcap as float16 pairs (as many registers as P^T: mt * block_q / qs / 4)
# and ~16 registers of feature state (band, softcap, dropout key and keep bits, bias and dbias
# pointers), so its arrays (P^T counted twice) are held to a lower budget.  Measured with NVRTC
# 13.0 for sm_80, every feature compiled in: 128 and 144 array floats compiled clean (d = 64 at
# 64 x 64 query split: 237 registers; d = 128 at 16 x 64: 248; two passes at d = 256, 16 x 64:
# 255), 160 spilled 16-28 B (d = 128 at 32 x 64; d = 96 at 64 x 64), 192 spilled 24-104 B (the
# plain defaults at d = 64 and 128).  Its dropout keeps one bit per element of P^T in 64 bits.
# Plans whose arrays (this count) hold 128 floats or fewer in one pass over 8 warps -- its
# defaults at d = 64 and 128 -- also run the plain kernel's lean loop (flash_bwd_tc.cu's
# kUnrolled), which takes the registers left: 241-255, no spill (bench/plan_sweep.py).
BWD_TC_MASKED_ARRAY_BUDGET = 144
BWD_TC_MASKED_MAX_BITS = 64
def _bwd_tc_masked_arrays(bq, d, dv, mt, passes, qs=1):
    return _bwd_tc_arrays(bq, d, dv, mt, passes, qs) + mt * (bq // qs // 4)


def _bwd_tc_masked_fits(bq, d, dv, mt, passes, qs=1):
    return (_bwd_tc_masked_arrays(bq, d, dv, mt, passes, qs) <= BWD_TC_MASKED_ARRAY_BUDGET
            and mt * bq // qs // 2 <= BWD_TC_MASKED_MAX_BITS)


def bwd_tc_layout(bq, bkv, d, dv, masked=False):
    """``(warps, keys per warp // 16, passes, query split)`` of flash_bwd_tc, or a str saying why not.

    ``masked``: of flash_bwd_tc_masked (the same choices under its register budget).

    In order of preference: 32 keys per warp (mt = 2; half the Q/dO fragment reads per key
    of 16) when its register arrays fit and the tile has at least 64 keys; else 32 keys
    per pair of warps with the queries and the dK/dV columns split between the two (qs =
    2: the same per-warp reads as mt = 2 for twice the head dims, P^T and dS^T through
    shared memory); else 16 keys per warp, in two passes over the head dims when one pass's
    arrays do not fit the register budget.
    """
    if d % 16 or dv % 16 or not (16 <= d <= MAX_HEAD_DIM and 16 <= dv <= MAX_HEAD_DIM):
        return f"flash_bwd_tc needs d and dv multiples of 16 up to {MAX_HEAD_DIM}, got d={d}, dv={dv}"
    if bq not in BWD_TC_TILE_CHOICES or bkv not in BWD_TC_TILE_CHOICES:
        return f"flash_bwd_tc takes block_q, block_kv in {list(BWD_TC_TILE_CHOICES)}"
    if masked:
        return _bwd_tc_masked_layout(bq, bkv, d, dv)
    if bkv >= 64 and _bwd_tc_arrays(bq, d, dv, 2, 1) <= _bwd_tc_budget(1):
        return bkv // 32, 2, 1, 1
    if bkv >= 32 and bq % 32 == 0 and _bwd_tc_arrays(bq, d, dv, 2, 1, 2) <= _bwd_tc_budget(1):
        return bkv // 16, 2, 1, 2
    for passes in (1, 2):
        if _bwd_tc_arrays(bq, d, dv, 1, passes) <= _bwd_tc_budget(passes):
            return bkv // 16, 1, passes, 1
    need = _bwd_tc_arrays(bq, d, dv, 1, 2)
    return (f"block_q={bq} with d={d}, dv={dv} needs {need} register floats per thread for P^T, "
            f"dP^T and half of dK, dV (limit {BWD_TC_ARRAY_BUDGET_TWO_PASSES} in two passes, beyond "
            "which ptxas spills)")


def _bwd_tc_masked_layout(bq, bkv, d, dv):
    """bwd_tc_layout's choices, in its order, under flash_bwd_tc_masked's budget, with one
    more where 16 keys per warp would need two passes over the head dims: 16 keys per pair of
    warps (the query split with mt = 1) in one pass, when block_q >= 64 keeps 32 or more
    queries per warp and block_kv <= 64 keeps the block at 8 warps or fewer.  Where the
    plain kernel's 32 keys per warp pair do not fit this kernel's budget (d + dv in (128,
    256]), it saves recomputing S^T and dP^T in the second pass."""
    if bkv >= 64 and _bwd_tc_masked_fits(bq, d, dv, 2, 1):
        return bkv // 32, 2, 1, 1
    if bkv >= 32 and bq % 32 == 0 and _bwd_tc_masked_fits(bq, d, dv, 2, 1, 2):
        return bkv // 16, 2, 1, 2
    for passes in (1, 2):
        if passes == 2 and bkv <= 64 and bq >= 64 and _bwd_tc_masked_fits(bq, d, dv, 1, 1, 2):
            return bkv // 8, 1, 1, 2
        if _bwd_tc_masked_fits(bq, d, dv, 1, passes):
            return bkv // 16, 1, passes, 1
    need = _bwd_tc_masked_arrays(bq, d, dv, 1, 2)
    return (f"block_q={bq} with d={d}, dv={dv} needs {need} register floats per thread in the "
            f"backward with logit features (P^T, 1 - tanh^2 of the softcap, dP^T and half of dK, "
            f"dV in two passes; limit {BWD_TC_MASKED_ARRAY_BUDGET}, beyond which ptxas spills)")


def _bwd_tc_qsplit(bq, bkv, d, dv, masked=False):
    lay = bwd_tc_layout(bq, bkv, d, dv, masked)
    return 1 if isinstance(lay, str) else lay[3]


def _bwd_tc_fns(masked):
    """The KernelTiling functions of flash_bwd_tc (``masked``: of flash_bwd_tc_masked)."""
    def shared(bq, bkv, d, dv, acc):
        ps = bkv * (bq + 8) if _bwd_tc_qsplit(bq, bkv, d, dv, masked) == 2 else 0
        return 2 * (bkv * (d + 8) + bkv * (dv + 8) + 2 * bq * (d + 8) + 2 * bq * (dv + 8)
                    + bkv * (bq + 8) + ps) + 16 * bq

    def smaller(bq, bkv, d, dv, acc):
        if _bwd_tc_qsplit(bq, bkv, d, dv, masked) != 2:
            return None
        return shared(bq, bkv, d, dv, acc) - 2 * bq * (dv + 8), {"CUFLASH_BWD_DO_STAGES": 1}

    def layout_text(bq, bkv, d, dv, acc):
        ps = f" + Ps[{bkv}][{bq + 8}]" if _bwd_tc_qsplit(bq, bkv, d, dv, masked) == 2 else ""
        one = (f" (or one dOs buffer: {smaller(bq, bkv, d, dv, acc)[0]} B)"
               if _bwd_tc_qsplit(bq, bkv, d, dv, masked) == 2 else "")
        return (f"16-bit Ks[{bkv}][{d + 8}] + Vs[{bkv}][{dv + 8}] + Qs[2][{bq}][{d + 8}] + "
                f"dOs[2][{bq}][{dv + 8}] + dSs[{bkv}][{bq + 8}]{ps}, float lse2_s[2][{bq}] + "
                f"D_s[2][{bq}]{one}")

    def check(bq, bkv, d, dv):
        lay = bwd_tc_layout(bq, bkv, d, dv, masked)
        return lay if isinstance(lay, str) else None

    def threads(bq, bkv, d, dv):
        lay = bwd_tc_layout(bq, bkv, d, dv, masked)
        return 32 * lay[0] if not isinstance(lay, str) else 32

    def defines(bq, bkv, d, dv):
        lay = bwd_tc_layout(bq, bkv, d, dv, masked)
        return ({"CUFLASH_BWD_PASSES": lay[2], "CUFLASH_BWD_QSPLIT": lay[3]}
                if not isinstance(lay, str) else {})
    return dict(shared_bytes=shared, layout=layout_text, check=check, threads=threads,
                defines=defines, smaller=smaller)


# With d != dv both compile for max(d, dv), the padding columns of K, Q (or V, dO) zero and
# those of dK, dQ (or dV) not written (-DCUFLASH_HEAD_DIMS_PADDED: the call's head dims from
# BwdParams).  The helpers' module is compiled for the call's own d and dv (it reads dv
# columns of O and dO, and d columns of the dQ accumulator).
for _name, _masked in (("flash_bwd_tc", False), ("flash_bwd_tc_masked", True)):
    register(KernelTiling(
        name=_name,
        block_q_choices=BWD_TC_TILE_CHOICES,
        block_kv_choices=BWD_TC_TILE_CHOICES,
        head_dims=square_head_dims(16),
        pad_define=TC_PAD_DEFINE,
        **_bwd_tc_fns(_masked),
    ))

# flash_bwd_tc_band (-DCUFLASH_MASKS -DCUFLASH_BWD_BAND: a call whose only feature is the band,
# a window with or without causal): the plain kernel's registers (the band's offsets are read
# from the parameter block, the other features compiled out), so its layouts and shared memory
# are the plain kernel's, for d == dv up to 128 (the lean loop; its own curated pairs).
BWD_BAND_KERNEL = "flash_bwd_tc_band"
BWD_BAND_MAX_HEAD_DIM = 128
# flash_bwd_tc_softcap (with -DCUFLASH_BWD_SOFTCAP too: a call whose features are a softcap and
# at most the band) and flash_bwd_tc_alibi (-DCUFLASH_BWD_ALIBI: ALiBi and at most the band):
# the band build with that feature on at compile time; the same head dims and layouts, each
# its own curated pairs; flash_bwd_tc_dropout (-DCUFLASH_BWD_DROPOUT: dropout and at most a
# window), flash_bwd_tc_alibi_dropout (both defines: ALiBi, dropout and at most a window) and
# flash_bwd_tc_alibi_softcap (-DCUFLASH_BWD_SOFTCAP -DCUFLASH_BWD_ALIBI: a softcap, ALiBi and at
# most a window) likewise.  The six are the backward's lean builds.
BWD_SOFTCAP_KERNEL = "flash_bwd_tc_softcap"
BWD_ALIBI_KERNEL = "flash_bwd_tc_alibi"
BWD_DROPOUT_KERNEL = "flash_bwd_tc_dropout"
BWD_ALIBI_DROPOUT_KERNEL = "flash_bwd_tc_alibi_dropout"
BWD_ALIBI_SOFTCAP_KERNEL = "flash_bwd_tc_alibi_softcap"
BWD_LEAN_KERNELS = (BWD_BAND_KERNEL, BWD_SOFTCAP_KERNEL, BWD_ALIBI_KERNEL, BWD_DROPOUT_KERNEL,
                    BWD_ALIBI_DROPOUT_KERNEL, BWD_ALIBI_SOFTCAP_KERNEL)


def bwd_band_takes(d, dv):
    """Whether the lean builds (BWD_LEAN_KERNELS) have a build for these head dims (else
    flash_bwd_tc_masked)."""
    return d == dv and d % 16 == 0 and 16 <= d <= BWD_BAND_MAX_HEAD_DIM


def _bwd_band_fns(name):
    fns = _bwd_tc_fns(False)
    plain_check = fns["check"]

    def check(bq, bkv, d, dv):
        if not bwd_band_takes(d, dv):
            return (f"{name} takes d == dv, multiples of 16 up to "
                    f"{BWD_BAND_MAX_HEAD_DIM}, got d={d}, dv={dv}")
        return plain_check(bq, bkv, d, dv)
    return dict(fns, check=check)


for _name in BWD_LEAN_KERNELS:
    register(KernelTiling(
        name=_name,
        block_q_choices=BWD_TC_TILE_CHOICES,
        block_kv_choices=BWD_TC_TILE_CHOICES,
        **_bwd_band_fns(_name),
    ))

# the helpers of flash_bwd_tc.cu (their own module: dtype, d, dv only); no shared memory
for _name, _threads in (("flash_bwd_tc_preprocess", BWD_TC_PRE_THREADS),
                        ("flash_bwd_tc_dq_convert", BWD_TC_CONVERT_THREADS)):
    register(KernelTiling(
        name=_name,
        block_q_choices=(64,), block_kv_choices=(64,),
        shared_bytes=lambda bq, bkv, d, dv, acc: 0,
        threads=lambda bq, bkv, d, dv, _t=_threads: _t,
        layout=lambda bq, bkv, d, dv, acc: "no shared memory",
    ))


# flash_bwd_wgmma (kernels_cu/flash_bwd_wgmma.cu): the Hopper backward, sm_90a only,
# float16/bfloat16, d == dv in (64, 128, 192, 256), no logit features, dQ by float32 reds (not
# the deterministic path).  A block is 3 warpgroups (a TMA producer, two consumers); query
# tiles of 64 rows.
#   d = 64, 128: 128 keys per block, 64 per consumer.  Shared memory: K and V (128 rows each),
#     Q and dO in two stages (64 rows), dS^T in two buffers per consumer (64 x 64), lse2 and D
#     per stage, the mbarriers and 1 KB to align the tiles for the 128-byte swizzle.
#     Registers: a consumer thread keeps dK and dV (d/2 floats each), S^T and dP^T (32 each)
#     and a dQ chunk (32).
#   d = 192, 256 (flash_bwd_wgmma_wide.cuh): 64 keys per block; a consumer takes 32 queries of
#     the scores and one gradient (dV or dK: d/2 floats per thread).  Shared memory: K and V (64
#     rows), Q and dO in two stages, P^T and dS^T in two buffers each (64 x 64), lse2, D, the
#     mbarriers, 1 KB alignment.
BWD_WGMMA_KERNEL = "flash_bwd_wgmma"
BWD_WGMMA_HEAD_DIMS = (64, 128, 192, 256)


def _bwd_wgmma_kv(d):
    """Keys per block of flash_bwd_wgmma at head dim d."""
    return 128 if d <= 128 else 64


def _bwd_wgmma_shared(bq, bkv, d, dv, acc):
    rows = (d // 64) * 128  # bytes of one 64-column chunk's row
    scores = 4 * 64 * 128   # dS^T (d <= 128: two consumers' buffers) or P^T and dS^T, two each
    return 2 * bkv * rows + 2 * 2 * bq * rows + scores + 2 * 2 * bq * 4 + 8 * (1 + 2 * 2) + 1024


def _bwd_wgmma_check(bq, bkv, d, dv):
    if d != dv or d not in BWD_WGMMA_HEAD_DIMS:
        return f"{BWD_WGMMA_KERNEL} needs d == dv in {BWD_WGMMA_HEAD_DIMS}, got d={d}, dv={dv}"
    if bkv != _bwd_wgmma_kv(d):
        return f"{BWD_WGMMA_KERNEL} runs {_bwd_wgmma_kv(d)} keys per block at d={d}, got block_kv={bkv}"
    return None


def _bwd_wgmma_layout(bq, bkv, d, dv, acc):
    scores = (f"dS^T[2][2][64][{bq}]" if d <= 128 else f"P^T[2][64][{bq}] + dS^T[2][64][{bq}]")
    return (f"16-bit K[{bkv}][{d}] + V[{bkv}][{d}] + Q[2][{bq}][{d}] + dO[2][{bq}][{d}] + "
            f"{scores} (128-byte swizzled rows) + float lse2, D [2][{bq}] + mbarriers "
            "+ 1 KB alignment")


register(KernelTiling(
    name=BWD_WGMMA_KERNEL,
    block_q_choices=(64,),
    block_kv_choices=(64, 128),
    shared_bytes=_bwd_wgmma_shared,
    threads=lambda bq, bkv, d, dv: 384,
    layout=_bwd_wgmma_layout,
    check=_bwd_wgmma_check,
))


def bwd_wgmma_takes(d, dv, dtype, block_q=None, block_kv=None):
    """Whether a plain, non-deterministic backward call of these head dims, dtype and explicit
    tiles is one flash_bwd_wgmma takes (on an sm_90 with the Hopper kernels chosen)."""
    if _dtype_name(dtype) not in TC_DTYPES or block_q not in (None, 64):
        return False
    return _bwd_wgmma_check(64, block_kv or _bwd_wgmma_kv(d), d, dv) is None


def plan_flash_bwd(d, dv, dtype, block_q=None, block_kv=None, *, limit=None,
                   limit_source="unlimited", kernel=None, tensor_cores=True, masked=False,
                   wgmma=False, lean=None):
    """The backward's plan: flash_bwd_tc (tensor cores) or flash_bwd_dkdv (SIMT), with tiles.

    float16/bfloat16 run flash_bwd_tc when ``tensor_cores`` (sm_80+), the head dims are
    multiples of 16 and any explicit tiles are ones it takes; everything else (and what
    does not fit the limit there) runs the SIMT kernels of flash_bwd.cu.  ``kernel``
    forces "flash_bwd_tc" or "flash_bwd_dkdv" (tests cover both).  ``masked``: a call with
    logit features -- the same choice between flash_bwd_tc_masked and flash_bwd_dkdv_masked;
    with ``lean`` too (one of BWD_LEAN_KERNELS: flash_bwd_tc_band for a call whose only feature
    is a window, with or without causal; flash_bwd_tc_softcap for a softcap and at most a
    window; flash_bwd_tc_alibi for ALiBi and at most a window; flash_bwd_tc_dropout for
    dropout and at most a window; flash_bwd_tc_alibi_dropout for ALiBi, dropout and at most a
    window; flash_bwd_tc_alibi_softcap for ALiBi, a softcap and at most a window) that build in
    flash_bwd_tc_masked's place, where it has one (d == dv <= 128).
    ``wgmma``: the device is an sm_90 that runs the Hopper backward (``flash_bwd_wgmma``) and the
    call is not deterministic: taken for the plain calls and tiles it supports
    (:func:`bwd_wgmma_takes`).
    """
    name = _dtype_name(dtype)
    if lean is not None and lean not in BWD_LEAN_KERNELS:
        raise ValueError(f"lean: one of {BWD_LEAN_KERNELS} or None, got {lean!r}")
    tc_name = ((lean if lean and bwd_band_takes(d, dv) else "flash_bwd_tc_masked")
               if masked else "flash_bwd_tc")
    if kernel is None and wgmma and not masked and bwd_wgmma_takes(d, dv, dtype, block_q, block_kv):
        kernel = BWD_WGMMA_KERNEL
    if kernel == BWD_WGMMA_KERNEL and (masked or name not in TC_DTYPES):
        raise ValueError(f"{kernel} runs plain {TC_DTYPES} calls only, got {name}"
                         + (" with logit features" if masked else ""))
    if kernel is None:
        tc = kernel_tiling(tc_name)
        if tensor_cores and name in TC_DTYPES:
            if ((block_q is None or block_q in tc.block_q_choices)
                    and (block_kv is None or block_kv in tc.block_kv_choices)
                    and d % 16 == 0 and dv % 16 == 0):
                try:
                    return plan(tc_name, d, dv, dtype, block_q, block_kv, limit=limit,
                                limit_source=limit_source)
                except ValueError as e:
                    _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv,
                                             limit, limit_source, str(e))
            elif d % 16 == 0 and dv % 16 == 0:
                _refuse_off_tensor_cores(tc_name, d, dv, dtype, block_q, block_kv, limit,
                                         limit_source, None)
        kernel = "flash_bwd_dkdv_masked" if masked else "flash_bwd_dkdv"
    if kernel in ("flash_bwd_tc", "flash_bwd_tc_masked", *BWD_LEAN_KERNELS) and name not in TC_DTYPES:
        raise ValueError(f"{kernel} runs {TC_DTYPES} only, got {name}")
    return plan(kernel, d, dv, dtype, block_q, block_kv, limit=limit, limit_source=limit_source)


def bwd_dq_splits(n_kv_tiles, problems, slots):
    """dQ accumulator slices of the deterministic tensor-core backward.

    The grid is ``splits * problems`` blocks (problems = batch x kv heads), each doing
    ``ceil(n_kv_tiles / splits)`` KV tiles one after another; ``slots`` blocks run at a
    time.  Returns the fewest splits (least accumulator memory and summing) among those
    with the smallest modelled makespan ``ceil(splits * problems / slots) *
    ceil(n_kv_tiles / splits)`` -- the same number of KV-tile steps as the atomic path's
    ``ceil(n_kv_tiles * problems / slots)`` whenever the waves divide evenly.
    """
    n_kv_tiles, problems, slots = max(1, int(n_kv_tiles)), max(1, int(problems)), max(1, int(slots))
    best, best_cost = 1, None
    for s in range(1, n_kv_tiles + 1):
        cost = -(-s * problems // slots) * -(-n_kv_tiles // s)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def flash_bwd_tc_traffic(batch, heads, kv_heads, Nq, Nk, d, dv, block_q, block_kv,
                         causal=None, n_splits=1):
    """Exact global-memory bytes (read, written) of one tensor-core backward call.

    What the emulator counts for flash_bwd_tc_preprocess, flash_bwd_tc and
    flash_bwd_tc_dq_convert (16-bit inputs; float32 workspace rows padded to whole Q tiles):

    * preprocess: O and dO rows < Nq (2 * dv * 2 bytes) and lse (4) per query row; writes
      lse2 and D (4 + 4 bytes) for every padded row, and zeroes the n_splits dQ
      accumulators (4 * d bytes per row and slice);
    * flash_bwd_tc, per (KV tile, kv head, batch) that some query sees: K/V rows < Nk
      once; for every query head of the group and every Q tile from the first that sees
      the KV tile: the Q/dO rows < Nq and Br padded lse2/D values; dQ reds of 4 bytes read
      + 4 written per (valid row, column); dK/dV rows < Nk written once (also by KV tiles no
      query sees, as zeros, without loading anything);
    * convert: n_splits accumulators read, dQ written.
    """
    bh, bhk = batch * heads, batch * kv_heads
    group = heads // kv_heads if kv_heads else 1
    off = (Nk - Nq) if causal == "bottom_right" else 0
    nq_t = -(-Nq // block_q) if Nq else 0
    nk_t = -(-Nk // block_kv) if Nk else 0
    nq_pad = nq_t * block_q
    read = bh * (Nq * (2 * dv * 2 + 4))
    written = bh * (nq_pad * 8 + n_splits * Nq * d * 4)
    for j in range(nk_t):
        kv0 = j * block_kv
        kv_rows = min(block_kv, Nk - kv0)
        it0 = 0
        if causal is not None:
            i_min = kv0 - off
            it0 = 0 if i_min <= 0 else (nq_t if i_min >= Nq else i_min // block_q)
        written += bhk * kv_rows * (d + dv) * 2
        if it0 >= nq_t:
            continue
        q_rows = Nq - it0 * block_q
        n_tiles = nq_t - it0
        read += bhk * kv_rows * (d + dv) * 2
        read += bhk * group * (q_rows * (d + dv) * 2 + n_tiles * block_q * 8)
        read += bhk * group * q_rows * d * 4
        written += bhk * group * q_rows * d * 4
    read += n_splits * bh * Nq * d * 4
    written += bh * Nq * d * 2
    return read, written

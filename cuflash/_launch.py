"""Launching the kernels: the same code for the "cuda" and the "emulator" backends.

Every function here takes a :class:`cuflash.kernels.Runtime` (array module,
module factory, shared-memory limit), so CuPy arrays on a GPU and NumPy arrays
on the emulator go through identical launch code.  Tile sizes, threads and
shared memory come from :mod:`cuflash.tiling` (through ``runtime.plan``), the
compiled kernels from :mod:`cuflash.kernels`.

Helpers the backward launcher (``cuflash/_launch_bwd.py``) reuses:

* :func:`problem_dims` -- the output's leading shape as (B, H) problems;
* :func:`flatten_lead` -- element strides (batch, head, row) of an input for
  those problems (stride 0 for broadcast axes, the kv head stride for grouped
  heads), copying only when unavoidable;
* :func:`pointer_arg` -- an input (possibly a strided view) as a kernel pointer
  argument of the runtime;
* :func:`alloc_output` -- ``xp.empty`` plus the test hook that poisons outputs;
* :func:`get_kernel` -- the compiled kernel for a tile plan;
* :func:`track_allocations` -- records every array the launch path allocates
  (for ``verify_no_full_materialization``).
"""
import contextlib
import threading

import numpy as np

from . import kernels, tiling

__all__ = [
    "problem_dims", "flatten_lead", "pointer_arg", "contiguous_strides", "alloc_output", "output_hook",
    "track_allocations", "get_kernel", "flash_fwd", "online_softmax_rows", "MAX_GRID_YZ",
]

# gridDim.y and gridDim.z limit (heads and batch are grid axes y and z)
MAX_GRID_YZ = 65535

_state = threading.local()
_ALLOC_HOOK = None


@contextlib.contextmanager
def output_hook(fn):
    """Call ``fn(array)`` on every output the launchers allocate, inside the block.

    Tests use it to fill outputs with NaN before the kernel runs, so elements a
    kernel fails to write show up as NaN (``xp.empty`` may happen to hold zeros).
    """
    global _ALLOC_HOOK
    prev, _ALLOC_HOOK = _ALLOC_HOOK, fn
    try:
        yield
    finally:
        _ALLOC_HOOK = prev


@contextlib.contextmanager
def track_allocations():
    """Record the sizes (elements) of all arrays the launch code allocates in the block.

    Yields a list of ``(what, shape)`` that fills up as launches run.
    """
    prev = getattr(_state, "ledger", None)
    _state.ledger = []
    try:
        yield _state.ledger
    finally:
        _state.ledger = prev


def _record(what, arr):
    ledger = getattr(_state, "ledger", None)
    if ledger is not None:
        ledger.append((what, tuple(arr.shape)))


def alloc_output(xp, shape, dtype, what="output"):
    """``xp.empty(shape, dtype)``, recorded, and passed to the output hook if one is set."""
    out = xp.empty(shape, dtype=dtype)
    _record(what, out)
    if _ALLOC_HOOK is not None:
        _ALLOC_HOOK(out)
    return out


def problem_dims(lead):
    """(B, H) for an output leading shape: H = last axis (heads), B = product of the rest.

    ``()`` (plain 2-D inputs) is one problem, (1, 1).
    """
    if len(lead) == 0:
        return 1, 1
    B = 1
    for s in lead[:-1]:
        B *= int(s)
    return B, int(lead[-1])


def _elem_strides(x):
    isz = x.itemsize
    if any(s % isz for s in x.strides):
        return None
    return [s // isz for s in x.strides]


def _collapse(sizes, strides):
    """One stride for iterating ``sizes`` (C order) as a flat index, or None if impossible."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if not dims:
        return 0
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return dims[-1][1]


def pointer_arg(runtime, x):
    """``x`` as a kernel pointer argument for this runtime (the address of ``x[0, ..., 0]``).

    CuPy passes any array's data pointer.  The emulator accepts only C-contiguous
    arrays (so that a pointer is never mistaken for a strided view); a strided
    view with non-negative strides is therefore handed over as the contiguous
    1-D span of its buffer that starts at its first element (the same address;
    the kernel applies the strides).  Negative strides have been removed by
    :func:`flatten_lead` for such runtimes.
    """
    if getattr(runtime, "name", None) != "emulator" or x.flags.c_contiguous:
        return x
    if any(s < 0 for s in x.strides):
        raise ValueError("internal: negative strides reached the emulator (flatten_lead copies them)")
    span = sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + x.itemsize if x.size else 0
    n = -(-span // x.itemsize)
    return np.lib.stride_tricks.as_strided(x, shape=(n,), strides=(x.itemsize,))


def flatten_lead(runtime, x, lead, grouped=False):
    """Address ``x`` (shape ``x_lead + (N, dim)``) as the (B, H) problems of ``lead``.

    Parameters
    ----------
    runtime : cuflash.kernels.Runtime, or the module numpy/cupy
        Gives the array module; with a Runtime whose kernels cannot take
        negative strides (the emulator) such inputs are copied.  Pass the
        returned ``arr`` through :func:`pointer_arg` when launching.
    x : ndarray
        An input whose leading dims broadcast to ``lead`` -- or, with
        ``grouped=True``, whose last leading dim is the kv head count Hk of
        grouped-query attention (the kernel maps query head h to h // group).
    lead : tuple of int
        The output's leading shape (``AttentionSpec.lead``).
    grouped : bool
        True for k/v of a grouped-query call.

    Returns
    -------
    arr : ndarray
        ``x`` itself, or a copy when the last dim was strided (kernels need it
        contiguous) or the broadcast cannot be expressed with strides.
    strides : tuple of int, (sb, sh, sr)
        Element strides of batch (flat index over ``lead[:-1]``), head and row;
        0 along broadcast axes, so nothing is copied for broadcasting.

    Notes
    -----
    The batch axes ``lead[:-1]`` are one flat index in the kernels.  That is a
    single stride only when ``x``'s strides over those axes nest (as in any
    contiguous array, or when all of them are broadcast).  For exotic layouts
    -- e.g. an input broadcast along one batch axis but not another -- there
    is no single stride, and ``x`` is materialised by a broadcast copy of shape
    ``lead[:-1] + (heads,) + x.shape[-2:]`` (heads = 1, Hk or H as x has them).
    """
    xp = getattr(runtime, "xp", runtime)
    no_negative = getattr(runtime, "name", None) == "emulator"
    if (x.ndim >= 1 and x.shape[-1] > 1 and x.strides[-1] != x.itemsize) or (
            no_negative and any(s < 0 for s in x.strides)):
        x = xp.ascontiguousarray(x)
        _record("contiguous copy", x)
    es = _elem_strides(x)
    if es is None:  # strides that are not whole elements (views of odd buffers)
        x = xp.ascontiguousarray(x)
        _record("contiguous copy", x)
        es = _elem_strides(x)
    nl = len(lead)
    sr = es[-2]
    if nl == 0:
        return x, (0, 0, sr)
    xl = tuple(x.shape[:-2])
    pad = nl - len(xl)
    sizes = (1,) * pad + xl
    strides = [0] * pad + es[:-2]
    head_size = sizes[-1]
    sh = 0 if head_size == 1 else strides[-1]
    batch_strides = [0 if n == 1 else s for n, s in zip(sizes[:-1], strides[:-1])]
    # broadcast axes read index 0 (stride 0); the others must match lead's size
    sb = _collapse(lead[:-1], batch_strides)
    if sb is None:
        # no single batch stride exists: materialise the broadcast (see Notes)
        full = tuple(lead[:-1]) + (head_size,) + tuple(x.shape[-2:])
        x = xp.ascontiguousarray(xp.broadcast_to(x.reshape((1,) * pad + x.shape), full))
        _record("broadcast copy", x)
        es = _elem_strides(x)
        sr = es[-2]
        sh = 0 if head_size == 1 else es[-3]
        sb = _collapse(lead[:-1], [0 if n == 1 else s for n, s in zip(lead[:-1], es[:-3])])
    return x, (int(sb), int(sh), int(sr))


def contiguous_strides(lead, tail):
    """(sb, sh) element strides of a C-contiguous array of shape ``lead + tail``."""
    B, H = problem_dims(lead)
    per = 1
    for s in tail:
        per *= int(s)
    return H * per, per


def get_kernel(runtime, filename, kernel_name, defines, plan=None):
    """The compiled kernel for this runtime, with the plan's shared memory allowed.

    ``plan`` (a :class:`cuflash.tiling.TilePlan`) supplies the dynamic shared
    memory bytes; the kernel's limit is raised above 48 KB when needed.
    """
    shared = plan.shared_bytes if plan is not None else 0
    return kernels.get_function(runtime, filename, kernel_name, defines, shared)


def _acc_scalar(dtype, value):
    return np.float64(value) if tiling.accumulator_bytes(dtype) == 8 else np.float32(value)


def _data_ptr(x):
    if (type(x).__module__ or "").split(".")[0] == "cupy":
        return int(x.data.ptr)
    return int(x.__array_interface__["data"][0])


def _aligned_for_cp_async(x, strides):
    """True when every 16-byte cp.async of flash_fwd_tc reads an aligned address."""
    return _data_ptr(x) % 16 == 0 and all(s % 8 == 0 for s in strides)


def flash_fwd(runtime, q, k, v, spec, kernel=None):
    """Run flash_fwd for a validated call: returns ``(o, lse)``.

    Parameters
    ----------
    runtime : cuflash.kernels.Runtime
    q, k, v : ndarray (of ``runtime.xp``)
    spec : cuflash._validate.AttentionSpec
    kernel : None, "flash_fwd" or "flash_fwd_tc"
        None: the choice of :func:`cuflash.tiling.plan_flash_fwd` (tensor cores
        for float16/bfloat16 where supported); tests force one to cover both.

    Raises
    ------
    ValueError
        Tiles or head dims the kernel does not support (from cuflash.tiling),
        or more than 65535 heads or batch entries.
    """
    xp = runtime.xp
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv, kernel)
    o = alloc_output(xp, spec.out_shape, spec.dtype, "o")
    lse = alloc_output(xp, spec.lse_shape, spec.lse_dtype, "lse")
    B, H = problem_dims(spec.lead)
    if spec.Nq == 0 or B * H == 0:
        return o, lse
    if B > MAX_GRID_YZ or H > MAX_GRID_YZ:
        raise ValueError(f"flash_fwd launches one grid row per head and batch entry; "
                         f"leading shape {spec.lead} gives H={H}, B={B} (limit {MAX_GRID_YZ} "
                         "each); reshape the leading dims")
    grouped = spec.group > 1
    q_, qs = flatten_lead(runtime, q, spec.lead)
    k_, ks = flatten_lead(runtime, k, spec.lead, grouped)
    v_, vs = flatten_lead(runtime, v, spec.lead, grouped)
    if plan.kernel == "flash_fwd_tc":
        # cp.async copies 16 bytes: an input view with an odd offset or stride is copied
        def aligned(x, st, grp):
            if _aligned_for_cp_async(x, st):
                return x, st
            c = xp.ascontiguousarray(x)
            _record("aligned copy", c)
            return flatten_lead(runtime, c, spec.lead, grp)
        q_, qs = aligned(q_, qs, False)
        k_, ks = aligned(k_, ks, grouped)
        v_, vs = aligned(v_, vs, grouped)
    o_sb, o_sh = contiguous_strides(spec.lead, (spec.Nq, spec.dv))
    l_sb, l_sh = contiguous_strides(spec.lead, (spec.Nq,))
    causal = spec.causal is not None
    offset = spec.Nk - spec.Nq if spec.causal == "bottom_right" else 0
    fn = get_kernel(runtime, plan.kernel + ".cu", plan.kernel, kernels.fwd_defines(plan), plan)
    i32, i64 = np.int32, np.int64
    args = (pointer_arg(runtime, q_), pointer_arg(runtime, k_), pointer_arg(runtime, v_), o, lse,
            i32(spec.Nq), i32(spec.Nk), i32(spec.group), i32(causal), i32(offset),
            *(i64(s) for s in qs), *(i64(s) for s in ks), *(i64(s) for s in vs),
            i64(o_sb), i64(o_sh), i64(spec.dv), i64(l_sb), i64(l_sh),
            _acc_scalar(spec.dtype, spec.scale))
    grid = (-(-spec.Nq // plan.block_q), H, B)
    fn(grid, (plan.threads,), args, shared_mem=plan.shared_bytes)
    return o, lse


def online_softmax_rows(runtime, x, chunk_size=None):
    """Run online_softmax_rows over the last axis of ``x``: ``(p, m, l)``.

    ``p`` has x's shape and dtype; ``m`` and ``l`` have shape ``x.shape[:-1]``
    and the kernel's statistics dtype (float32, float64 for float64 input).
    ``chunk_size`` None processes each row as one chunk.
    """
    xp = runtime.xp
    t = tiling.kernel_tiling("online_softmax_rows")
    rows_per_block = tiling.ONLINE_SOFTMAX_ROWS_PER_BLOCK
    lead, M = tuple(x.shape[:-1]), int(x.shape[-1])
    stat_dtype = np.float64 if tiling.accumulator_bytes(x.dtype) == 8 else np.float32
    p = alloc_output(xp, x.shape, x.dtype, "p")
    m = alloc_output(xp, lead, stat_dtype, "m")
    l = alloc_output(xp, lead, stat_dtype, "l")
    rows = 1
    for s in lead:
        rows *= int(s)
    if rows == 0:
        return p, m, l
    x2 = x.reshape(rows, M)
    if (M > 1 and x2.strides[-1] != x2.itemsize) or (
            runtime.name == "emulator" and any(st < 0 for st in x2.strides)):
        x2 = xp.ascontiguousarray(x2)
        _record("contiguous copy", x2)
    es = _elem_strides(x2)
    if es is None:
        x2 = xp.ascontiguousarray(x2)
        es = _elem_strides(x2)
    chunk = M if chunk_size is None else int(chunk_size)
    chunk = max(1, min(chunk, 2 ** 31 - 1))
    fn = get_kernel(runtime, "online_softmax.cu", "online_softmax_rows",
                    {kernels.dtype_define(x.dtype): None})
    args = (pointer_arg(runtime, x2), p.reshape(rows, M), m.reshape(rows), l.reshape(rows),
            np.int32(rows), np.int32(M), np.int32(chunk), np.int64(es[0]), np.int64(M))
    grid = (-(-rows // rows_per_block),)
    fn(grid, (t.threads(rows_per_block, 0, 0, 0),), args, shared_mem=0)
    return p, m, l


# --------------------------------------------------------------------------
# the public functions that run kernels, parameterised by the runtime; the
# "cuda" and "emulator" backend modules are thin wrappers around these
# --------------------------------------------------------------------------
def _stat_out(xp, a, scalar):
    """Statistics in float64 like the reference (0-d for 1-D input on NumPy: np.float64)."""
    a = a.astype(np.float64)
    if scalar and xp is np:
        return np.float64(a[()])
    return a


def api_online_softmax(runtime, x, chunk_size, return_stats, one_d):
    """online_softmax / online_softmax_2d through the online_softmax_rows kernel."""
    from ._validate import check_float_dtype, check_positive_int
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x must be an array, got {type(x).__module__}.{type(x).__name__}")
    check_float_dtype(x.dtype, f"x (shape {tuple(x.shape)})")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    if one_d and x.ndim != 1:
        raise ValueError(f"online_softmax takes a 1-D array, got shape {tuple(x.shape)}; "
                         "use online_softmax_2d for rows")
    if x.ndim < 1:
        raise ValueError(f"online_softmax_2d needs at least 1 dim, got shape {tuple(x.shape)}")
    p, m, l = online_softmax_rows(runtime, x, chunk_size)
    if not return_stats:
        return p
    xp = runtime.xp
    return p, _stat_out(xp, m, one_d), _stat_out(xp, l, one_d)


def api_tiled_attention(runtime, q, k, v, scale, causal, block_q, block_kv, return_lse):
    """tiled_attention through flash_fwd (validation once, here)."""
    from ._validate import check_attention_inputs
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                  block_kv=block_kv)
    o, lse = flash_fwd(runtime, q, k, v, spec)
    return (o, lse) if return_lse else o


def api_tiled_attention_backward(runtime, do, q, k, v, o, lse, scale, causal, block_q, block_kv,
                                 deterministic):
    """tiled_attention_backward through the backward kernels (cuflash._launch_bwd)."""
    from ._validate import check_backward_inputs
    from . import _launch_bwd  # lazily: the backward launcher is its own module
    spec = check_backward_inputs(do, q, k, v, o, lse, scale=scale, causal=causal,
                                 block_q=block_q, block_kv=block_kv)
    return _launch_bwd.flash_bwd(runtime, do, q, k, v, o, lse, spec,
                                 deterministic=deterministic)


def _dtype_label(dtype):
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def api_memory_analysis(runtime, N, d, dtype, Nk, block_q, block_kv, batch, heads):
    """memory_analysis for the kernels: the reference's model with the kernel's tiles.

    The tiles and ``sram_bytes_per_block`` are those flash_fwd launches with
    (cuflash.tiling, against this runtime's shared-memory limit, which is
    reported).  ``tiled_extra_bytes`` keeps the reference's definition (row
    statistics plus one S/P tile pair, whatever memory holds them);
    ``kernel_global_extra_bytes`` is what the kernel path actually keeps in
    global memory besides q, k, v, o: the lse rows (m, l live in registers,
    the S/P tile in registers and shared memory).  The HBM model is the reference's
    (``tiled_forward_hbm_bytes``) evaluated for these tiles, which equals
    :func:`cuflash.tiling.flash_fwd_traffic` and, on the emulator, the bytes
    the kernel is measured to move.
    """
    from . import reference
    from ._validate import check_positive_int
    d_ = check_positive_int(d, "d")
    bq = check_positive_int(block_q, "block_q")
    bkv = check_positive_int(block_kv, "block_kv")
    label = _dtype_label(dtype)
    plan = runtime.plan_fwd(d_, d_, label, bq, bkv)
    out = reference.memory_analysis(N, d, dtype, Nk=Nk, block_q=plan.block_q,
                                    block_kv=plan.block_kv, batch=batch, heads=heads)
    BH = out["batch"] * out["heads"]
    lse_bytes = BH * out["N"] * plan.acc_bytes
    out.update({
        "backend": runtime.name,
        "kernel": plan.kernel,
        "tiles_chosen": plan.chosen,
        "threads_per_block": plan.threads,
        "sram_bytes_per_block": plan.shared_bytes,
        "sram_layout": tiling.kernel_tiling(plan.kernel).layout(
            plan.block_q, plan.block_kv, d_, d_, plan.acc_bytes),
        "sram_limit_bytes": plan.limit,
        "sram_limit_source": plan.limit_source,
        "kernel_global_extra_bytes": lse_bytes,
    })
    return out


def api_verify_no_full_materialization(runtime, q, k, v, block_size):
    """Run flash_fwd with block_q = block_kv = block_size and report the largest intermediate.

    Intermediates are what the kernel path allocates besides the returned o:
    the lse array (global memory), any contiguous/broadcast copy of an input,
    and the kernel's shared-memory tiles (Qs, Ks, Vs, Ps of cuflash.tiling).
    None of them grows with Nq * Nk.
    """
    from ._validate import check_attention_inputs
    if block_size is None:
        raise ValueError("block_size must be a positive int, got None")
    spec = check_attention_inputs(q, k, v, block_q=block_size, block_kv=block_size)
    with track_allocations() as ledger:
        o, _ = flash_fwd(runtime, q, k, v, spec)
    plan = runtime.plan_fwd(spec.d, spec.dv, spec.dtype, spec.block_q, spec.block_kv)
    bq, bkv, d, dv = plan.block_q, plan.block_kv, spec.d, spec.dv
    if plan.kernel == "flash_fwd_tc":  # shared-memory tiles (K/V double buffered)
        sizes = [bq * (d + 8), 2 * bkv * (d + 8), 2 * bkv * (dv + 8)]
    else:
        sizes = [bq * (d + 1), bkv * (d + 1), bkv * dv, bq * (bkv + 1)]
    for what, shape in ledger:
        if what != "o":
            n = 1
            for s in shape:
                n *= int(s)
            sizes.append(n)
    return o, int(max(sizes))

"""Which kernels a default-tile call launches, and compiling them ahead of time (``cuflash.precompile``).

For clusters and containers: fill the compile cache once (CuPy's kernel cache,
``$CUPY_CACHE_DIR`` or ``~/.cupy/kernel_cache``, on a GPU; the emulator's
``$CUFLASH_CACHE_DIR``) so that no training job pays the first-call compile.
:func:`forward_kernels` and :func:`backward_kernels` list the launches of a
forward and a backward call, in order, from the same planner calls the
launchers make; precompile compiles the distinct modules among them
concurrently (:func:`cuflash.kernels.get_functions`), and ``memory_analysis``
on the kernel backends reports them.  ``tests/docs/test_docs_kernels.py`` holds both
lists to the launches the emulator observes.
"""
import time

from .. import kernels, tiling
from . import bwd, bwd_tc, fwd
from .._validate_masks import check_window
from .serving import serving_plan

__all__ = ["forward_kernels", "backward_kernels", "jobs", "precompile", "memory_analysis"]

_MASKS = "CUFLASH_MASKS"
_COMBINE_WARPS = 4   # flash_fwd_combine: 128 threads, one output row per warp


def _with_masks(defines, masked):
    return dict(defines, **{_MASKS: None}) if masked else dict(defines)


def forward_kernels(runtime, d, dv, dtype, *, masked=False, block_q=None, block_kv=None,
                    num_splits=1, rows=None):
    """``[(file, kernel, defines, shared_bytes), ...]`` one forward call launches, in order.

    ``masked``: the call has logit features (their kernels; they never split the
    keys).  ``num_splits`` > 1: the split-KV forward, the serving kernel
    planned for ``rows`` query rows, then ``flash_fwd_combine``.
    """
    if num_splits > 1 and not masked:
        plan = serving_plan(runtime, d, dv, dtype, rows or 1, block_q, block_kv)
        defines = dict(kernels.plan_defines(plan), CUFLASH_FWD_SERVING=None)
        combine = _COMBINE_WARPS * num_splits * tiling.accumulator_bytes(dtype)
        return [("flash_fwd.cu", "flash_fwd_serving", defines, plan.shared_bytes),
                ("flash_fwd.cu", "flash_fwd_combine", kernels.fwd_helper_defines(dtype), combine)]
    plan = runtime.plan_fwd(d, dv, dtype, block_q, block_kv, masked=masked)
    return [(kernels.KERNEL_SOURCES[plan.kernel], plan.kernel,
             _with_masks(kernels.plan_defines(plan), masked), plan.shared_bytes)]


def backward_kernels(runtime, d, dv, dtype, *, masked=False, deterministic=False, lean=None):
    """``[(file, kernel, defines, shared_bytes), ...]`` one default-tile backward launches.

    float16/bfloat16 on tensor cores: preprocess, ``flash_bwd_tc`` (or
    ``flash_bwd_tc_masked``; the lean build ``lean`` names, ``flash_bwd_tc_band``,
    ``flash_bwd_tc_softcap``, ``flash_bwd_tc_alibi``, ``flash_bwd_tc_dropout``,
    ``flash_bwd_tc_alibi_dropout`` or ``flash_bwd_tc_alibi_softcap``, where it has one), dQ
    conversion.
    Otherwise the SIMT preprocess,
    then ``flash_bwd_tf32`` (float32 on tensor cores, both dQ paths) or
    ``flash_bwd_dkdv``, then the dQ conversion (dQ by accumulators) or the
    separate ``flash_bwd_dq`` pass (``deterministic`` off flash_bwd_tf32, and
    float64); ``_masked`` kernels with ``masked``.
    """
    main = bwd.plan_backward(runtime, d, dv, dtype, masked=masked, deterministic=deterministic,
                             lean=lean)
    if main.kernel in ("flash_bwd_tc", "flash_bwd_tc_masked", *tiling.BWD_LEAN_KERNELS,
                       tiling.BWD_WGMMA_KERNEL):
        return bwd_tc.requests(main)
    suffix = "_masked" if masked else ""
    plan = runtime.plan("flash_bwd_dkdv" + suffix, d, dv, dtype)
    dq_plan = runtime.plan("flash_bwd_dq" + suffix, d, dv, dtype, plan.block_q, plan.block_kv)
    pre_plan = runtime.plan("flash_bwd_preprocess", d, dv, dtype)
    defines = _with_masks(kernels.plan_defines(plan), masked)
    tf32 = (tiling.plan_bwd_tf32(d, dv, dtype, limit=runtime.smem_limit,
                                 limit_source=runtime.smem_source, masked=masked)
            if runtime.tensor_cores else None)
    atomic = tf32 is not None or (not deterministic and tiling.accumulator_bytes(dtype) != 8)
    out = [("flash_bwd.cu", "flash_bwd_preprocess", defines, pre_plan.shared_bytes)]
    if tf32 is not None:
        out.append(("flash_bwd_tf32.cu", tf32.kernel,
                    _with_masks(kernels.plan_defines(tf32), masked), tf32.shared_bytes))
    else:
        out.append(("flash_bwd.cu", plan.kernel, defines, plan.shared_bytes))
    if atomic:
        out.append(("flash_bwd.cu", "flash_bwd_dq_convert", defines, 0))
    else:
        out.append(("flash_bwd.cu", dq_plan.kernel, defines, dq_plan.shared_bytes))
    return out


def jobs(runtime, dtypes, head_dims, features=False):
    """The (file, kernel, defines, shared bytes) of the forward and backward per dtype and d.

    The backward's both dQ paths (atomic and ``deterministic=True``); with
    ``features`` also the kernels of calls with logit features (one module per
    kernel serves every feature and combination of them; the tensor-core
    backward has six more, its lean builds: a window alone, a softcap and at
    most a window, ALiBi and at most a window, dropout and at most a window,
    ALiBi and dropout and at most a window, ALiBi and a softcap and at most a
    window).
    """
    out = []
    for masked in (False, True) if features else (False,):
        for dt in dtypes:
            for d in head_dims:
                out += forward_kernels(runtime, d, d, dt, masked=masked)
                for det in (False, True):
                    for lean in (None, *tiling.BWD_LEAN_KERNELS) if masked else (None,):
                        out += backward_kernels(runtime, d, d, dt, masked=masked,
                                                deterministic=det, lean=lean)
    return out


def precompile(runtime, dtypes, head_dims, progress=None, features=False):
    """Compile every module those calls need, concurrently.

    Returns ``{"backend", "modules": [{"file", "kernels", "options"}, ...],
    "seconds"}`` (wall time of the whole compile; modules already compiled in
    this process cost nothing).  ``progress(msg)`` is called before and after.
    """
    if not isinstance(features, bool):
        raise TypeError(f"features must be True or False (the kernels' feature builds serve "
                        f"every logit feature), got {features!r}")
    todo = jobs(runtime, dtypes, head_dims, features)
    modules = {}
    for filename, name, defines, _ in todo:
        key = (filename, kernels.build_options(defines))
        modules.setdefault(key, set()).add(name)
    if progress is not None:
        progress(f"compiling {len(modules)} kernel module(s) for {runtime!r}")
    t0 = time.perf_counter()
    kernels.get_functions(runtime, todo)  # distinct modules compile side by side
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress(f"done in {seconds:.1f} s")
    return {"backend": runtime.name, "seconds": seconds,
            "modules": [{"file": f, "kernels": sorted(names),
                         "options": [o for o in opts if o.startswith("-D")]}
                        for (f, opts), names in modules.items()]}


def memory_analysis(runtime, reference_model, N, d, dtype="float32", Nk=None, block_q=None,
                    block_kv=None, batch=1, heads=1, num_splits=1, bias_shape=None, window=None):
    """:func:`cuflash.launch.fwd.memory_analysis` with ``forward_kernels`` and
    ``backward_kernels``: ``[{"kernel", "shared_bytes"}, ...]`` of a default-tile call
    (the backward not deterministic)."""
    if bias_shape is None and check_window(window) is None:
        window = None  # an unbounded window is no feature: the call runs the plain kernels
    out = fwd.memory_analysis(runtime, reference_model, N, d, dtype, Nk, block_q, block_kv,
                              batch, heads, num_splits, bias_shape, window)
    masked = bias_shape is not None or window is not None
    dt, splits = out["dtype"], out["num_splits"]
    fk = forward_kernels(runtime, out["d"], out["d"], dt, masked=masked, block_q=block_q,
                         block_kv=block_kv, num_splits=splits, rows=out["N"])
    bk = backward_kernels(runtime, out["d"], out["d"], dt, masked=masked,
                          lean=tiling.BWD_BAND_KERNEL if masked and bias_shape is None else None)
    out["forward_kernels"] = [{"kernel": k, "shared_bytes": s} for _, k, _, s in fk]
    out["backward_kernels"] = [{"kernel": k, "shared_bytes": s} for _, k, _, s in bk]
    return out

"""The "cuda" backend: CuPy arrays, the kernels of ``kernels_cu/`` compiled by NVRTC.

Kernels are compiled at run time by ``cupy.RawModule`` (NVRTC for the current
device's architecture), specialised by ``-D`` defines and cached per device
(:mod:`cuflash.kernels`); tile sizes and the shared-memory budget come from
:mod:`cuflash.tiling` against the device's ``MaxSharedMemoryPerBlockOptin``.
The launch code is the emulator's: the launchers of :mod:`cuflash.launch`,
one per kernel family.

``standard_attention`` / ``standard_attention_backward`` are plain CuPy
(cuBLAS matmuls and an elementwise softmax): the baseline users would write,
deliberately not a custom kernel.

Every function has the signature of the front (``cuflash.<name>``) minus
``backend=``; the documentation is the front's (``help(cuflash.<name>)``).
"""
import numpy as np

from . import kernels, reference
from ._validate import check_attention_inputs, check_backward_inputs, sum_to_shape
from ._validate_masks import check_masks
from .launch.api import KernelFunctions
from .reference._common import _canonical, _compute_dtype
from .reference.standard import _features

__all__ = [
    "is_available", "online_softmax", "online_softmax_2d", "standard_attention",
    "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
    "memory_analysis", "verify_no_full_materialization", "precompile", "runtime",
    "attention_with_kvcache", "varlen_attention", "varlen_attention_backward",
]

_RUNTIMES = {}
_AVAILABLE = None

# what to tell a user without CuPy (a checkout is how cuflash is installed today)
INSTALL_HINT = ('pip install ".[cuda12]" (CUDA 12.x driver) or ".[cuda13]" (CUDA 13.x) from a '
                "cuflash checkout; nvidia-smi shows the driver's CUDA version")


def runtime():
    """The :class:`cuflash.kernels.Runtime` of the current CuPy device.

    One ``cudaGetDevice`` per call (no device-property query): the runtime,
    with its plans, compiled kernels and prepared calls, is made once per device.
    """
    import cupy  # optional (the cuda extras): imported on use, so import cuflash never needs it
    dev = cupy.cuda.runtime.getDevice()
    rt = _RUNTIMES.get(dev)
    if rt is None:
        rt = _RUNTIMES[dev] = kernels.get_runtime("cuda")
    return rt


def is_available():
    """(True, device) when CuPy imports and sees a CUDA device, else (False, why).

    Asked once per process (the answer is kept): the device count and name do
    not change under a running program, and the query costs about a millisecond.
    """
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _probe()
    return _AVAILABLE


def _probe():
    try:
        import cupy  # optional: whether it imports is the question asked here
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        if isinstance(e, ImportError) and getattr(e, "name", None) == "cupy":
            return False, f"CuPy is not installed: {INSTALL_HINT}"
        return False, f"cupy is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"CuPy cannot reach a CUDA device ({type(e).__name__}: {e})"
    if n < 1:
        return False, "CuPy found no CUDA device"
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props.get("name", b"?")
    name = name.decode() if isinstance(name, bytes) else str(name)
    return True, f"{n} CUDA device(s), current: {name}"


# --------------------------------------------------------------------------
# standard attention: plain array code over xp (cupy here; the tests also run
# it with numpy to check it without a GPU)
# --------------------------------------------------------------------------
def _probs(xp, spec, q, k, feat=None):
    """P = softmax(scale * q k^T [masked]) in the compute dtype; rows that see no key are 0.

    With ``feat`` (:class:`cuflash.reference.masks.Features` over ``xp``): the
    softcap, bias, ALiBi and causal/window mask of the call; returns (P, tanh).
    """
    ct = _compute_dtype(spec.dtype).type
    s = xp.matmul(q.astype(ct) * ct(spec.scale), xp.swapaxes(k.astype(ct), -1, -2))
    if feat is not None:
        th = feat.transform(s, 0, spec.Nq, 0, spec.Nk)
        hidden = feat.hidden(0, spec.Nq, 0, spec.Nk)
        if hidden is not None:
            s = xp.where(hidden, ct(-np.inf), s)
        return _softmax(xp, spec, s, ct), th
    if spec.causal is not None:
        off = spec.Nk - spec.Nq if spec.causal == "bottom_right" else 0
        i = xp.arange(spec.Nq)[:, None]
        j = xp.arange(spec.Nk)[None, :]
        s = xp.where(j <= i + off, s, ct(-np.inf))
    return _softmax(xp, spec, s, ct)


def _softmax(xp, spec, s, ct):
    if spec.Nk == 0:
        return s
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isneginf(m), ct(0), m)
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    return e / xp.where(l == 0, ct(1), l)


def _standard_forward(xp, q, k, v, spec, ms=None):
    qg, kg, vg, lead_c = _canonical(spec, q, k, v)
    feat = _features(spec, ms, lead_c, xp)
    p = _probs(xp, spec, qg, kg, feat)
    if feat is not None:
        p = p[0]
        pd = feat.dropped(p, 0, spec.Nq, 0, spec.Nk) if ms.dropout else p
        o = xp.matmul(pd, vg.astype(p.dtype))
    else:
        o = xp.matmul(p, vg.astype(p.dtype))
    lead = spec.lead
    return (o.reshape(lead + (spec.Nq, spec.dv)).astype(spec.dtype),
            p.reshape(lead + (spec.Nq, spec.Nk)).astype(spec.dtype))


def _standard_backward(xp, do, q, k, v, spec, ms=None):
    ct = _compute_dtype(spec.dtype).type
    qg, kg, vg, lead_c = _canonical(spec, q, k, v)
    dog = do.reshape(lead_c + (spec.Nq, spec.dv)).astype(ct)
    feat = _features(spec, ms, lead_c, xp)
    p = _probs(xp, spec, qg, kg, feat)                               # stored P
    th = keep = None
    if feat is not None:
        p, th = p
        if ms.dropout:
            keep = feat.keep(0, spec.Nq, 0, spec.Nk)
    pd = p if keep is None else feat.dropped(p, 0, spec.Nq, 0, spec.Nk, keep)
    dv_ = xp.matmul(xp.swapaxes(pd, -1, -2), dog)                    # P^T dO
    dp = xp.matmul(dog, xp.swapaxes(vg.astype(ct), -1, -2))          # dO V^T
    if keep is not None:
        dp = feat.dropped(dp, 0, spec.Nq, 0, spec.Nk, keep)
    D = (p * dp).sum(axis=-1, keepdims=True)                         # rowsum(P * dP)
    ds = p * (dp - D)
    dbias = None
    if ms is not None and ms.return_dbias:
        dbias = sum_to_shape(ds, feat.canonical_bias_shape()).reshape(ms.bias_shape)
        dbias = dbias.astype(ms.bias.dtype)
    if th is not None:
        ds = ds * (1 - th * th)                                      # softcap derivative
    dq = xp.matmul(ds, kg.astype(ct)) * ct(spec.scale)
    dk = xp.matmul(xp.swapaxes(ds, -1, -2), qg.astype(ct)) * ct(spec.scale)
    dq = sum_to_shape(dq.reshape(spec.lead + (spec.Nq, spec.d)), q.shape)
    if spec.group > 1:  # sum over the query heads of each group first
        dk, dv_ = dk.sum(axis=-3), dv_.sum(axis=-3)
    grads = (dq.astype(spec.dtype), sum_to_shape(dk, k.shape).astype(spec.dtype),
             sum_to_shape(dv_, v.shape).astype(spec.dtype))
    return grads if dbias is None else grads + (dbias,)


def standard_attention(q, k, v, *, scale=None, causal=False, bias=None, window=None,
                       alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """Plain CuPy attention (cuBLAS matmul + softmax), materialising P.

    See Also ``cuflash.reference.standard_attention``.
    """
    import cupy  # optional (the cuda extras): imported on use
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed)
    return _standard_forward(cupy, q, k, v, spec, ms)


def standard_attention_backward(do, q, k, v, *, scale=None, causal=False, bias=None,
                                window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                                seed=None, return_dbias=False):
    """Plain CuPy stored-P backward. See Also ``cuflash.reference.standard_attention_backward``."""
    import cupy  # optional (the cuda extras): imported on use
    spec = check_backward_inputs(do, q, k, v, None, None, scale=scale, causal=causal,
                                 need_forward=False)
    ms = check_masks(spec, q, bias=bias, window=window, alibi_slopes=alibi_slopes,
                     softcap=softcap, dropout_p=dropout_p, seed=seed, return_dbias=return_dbias)
    return _standard_backward(cupy, do, q, k, v, spec, ms)


# --------------------------------------------------------------------------
# the kernels: the launchers of cuflash.launch, with this backend's runtime
# --------------------------------------------------------------------------
_kernels = KernelFunctions(runtime, reference.memory_analysis)
online_softmax = _kernels.online_softmax
online_softmax_2d = _kernels.online_softmax_2d
tiled_attention = _kernels.tiled_attention
tiled_attention_backward = _kernels.tiled_attention_backward
attention_with_kvcache = _kernels.attention_with_kvcache
varlen_attention = _kernels.varlen_attention
varlen_attention_backward = _kernels.varlen_attention_backward
verify_no_full_materialization = _kernels.verify_no_full_materialization
precompile = _kernels.precompile
memory_analysis = _kernels.memory_analysis

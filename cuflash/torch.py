"""cuflash inside PyTorch: differentiable exact attention through DLPack.

``cuflash.torch.attention`` is a ``torch.autograd.Function``: the forward is
``cuflash.tiled_attention(..., return_lse=True)``, the backward
``cuflash.tiled_attention_backward`` from the saved ``o`` and ``lse`` (P is
never stored).  CPU tensors run on the ``"numpy"`` backend, CUDA tensors on
the ``"cuda"`` backend.

Data movement
-------------
Tensors cross to NumPy/CuPy and back through DLPack, sharing memory:

* q, k, v, the incoming gradient and the saved o/lse are read in place, in
  either layout (``bnhd`` is a swapped view) and with any strides; outputs
  (o, lse, dq, dk, dv) are allocated by cuflash and handed to torch without a
  copy.  ``bnhd`` outputs are therefore non-contiguous views of a
  ``(..., H, N, d)`` buffer (as a transpose would be).
* bfloat16 crosses as its int16 bit pattern (``tensor.view(torch.int16)``,
  then ``.view(ml_dtypes.bfloat16)``; the reverse for outputs): DLPack's
  bfloat16 code is read by neither NumPy nor CuPy.  Still no copy.
* Copies happen only inside the CUDA launcher, where a kernel cannot address
  an input: a last axis with stride != 1 (e.g. the stride-0 gradient of
  ``o.sum()``), or leading axes whose strides do not nest
  (``cuflash.launch.common.flatten_lead``).  The NumPy backend reads any strides.
* On a GPU there is no host round trip.  The kernels run on PyTorch's current
  CUDA stream: it is made CuPy's current stream
  (``cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)``)
  around the cuflash calls.  CuPy allocates the outputs from its own memory
  pool, so ``torch.cuda.memory_allocated`` does not count them.

Not supported: double backward (``create_graph=True`` raises RuntimeError),
forward-mode AD, other devices than CPU and CUDA.  ``torch`` here is the real
PyTorch (absolute imports), not this module.
"""
import contextlib

import numpy as np

try:
    import torch
    from torch.autograd.function import once_differentiable
except ImportError as e:  # torch absent (or blocked in sys.modules)
    raise ImportError("cuflash.torch needs PyTorch, which cannot be imported here "
                      f"({e}); install it with `pip install torch` or "
                      "`pip install \".[torch]\"` from a cuflash checkout") from e

import cuflash

from .cuda_backend import INSTALL_HINT
from ._interop import (bfloat16_dtype, check_layout, from_bhnd, is_bfloat16, layout_error,
                       to_bhnd)

__all__ = ["attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(q, k, v, *, scale=None, causal=False, bias=None, window=None, alibi_slopes=None,
              softcap=None, dropout_p=0.0, seed=None, layout="bhnd", deterministic=False):
    """Exact attention ``softmax(mask(scale * q k^T + bias)) v``, differentiable in q, k, v, bias.

    Parameters
    ----------
    q : torch.Tensor, shape (B, H, Nq, d) ("bhnd") or (B, Nq, H, d) ("bnhd")
    k : torch.Tensor, shape (B, Hk, Nk, d) or (B, Nk, Hk, d)
    v : torch.Tensor, shape (B, Hk, Nk, dv) or (B, Nk, Hk, dv)
        One device (CPU or CUDA) and one dtype (float16, bfloat16, float32,
        float64).  Leading dims may be any number and broadcast as in cuflash;
        ``Hk`` dividing ``H`` is grouped-query attention (query head h reads
        kv head ``h // (H // Hk)``).  Any subset may have ``requires_grad``.
        Not modified.
    scale : float, optional
        Logit scale; None means ``1/sqrt(d)``.
    causal : bool or {"bottom_right", "top_left"}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``
        (flash-attn); ``"top_left"``: iff ``j <= i`` (SDPA's ``is_causal``).
        A row that sees no key gives 0 and zero gradients.
    bias : torch.Tensor, optional
        Added to the logits; broadcasts to ``(B, H, Nq, Nk)`` in either layout
        (the logits' own axes, as SDPA's ``attn_mask``); any float dtype, on
        q's device.  With ``requires_grad`` its gradient is computed
        (``return_dbias``), summed over its broadcast axes.
    window, softcap, dropout_p
        As in :func:`cuflash.tiled_attention`.
    alibi_slopes : torch.Tensor, shape (H,) or (B, H), optional
        ALiBi slopes (no gradient).
    seed : int, optional
        Key of the dropout mask; None with ``dropout_p > 0`` draws one from
        torch's default generator (so ``torch.manual_seed`` makes runs
        repeatable); the backward reuses the forward's.
    layout : {"bhnd", "bnhd"}
        Axis order of q, k, v, of the output and of the gradients.
    deterministic : bool
        Bitwise repeatable gradients on CUDA (the CPU backend always is).

    Returns
    -------
    o : torch.Tensor, shape (B, H, Nq, dv) or (B, Nq, H, dv)
        Same device and dtype as q; for ``bnhd`` a non-contiguous view.

    Raises
    ------
    TypeError
        Non-tensors, unsupported or differing dtypes.
    ValueError
        Unknown layout, tensors on different devices or on a device other
        than CPU/CUDA, shapes cuflash refuses (the message names them).

    Notes
    -----
    See the module docstring for what is shared and what is copied.  The
    backward recomputes P from the saved ``lse`` (FlashAttention-2).
    """
    # checked before autograd records anything, so that bad input fails cleanly
    device = _check_tensors(q=q, k=k, v=v)
    for name, t in (("bias", bias), ("alibi_slopes", alibi_slopes)):
        if t is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, q on {device}: one device")
    check_layout(layout, q=q, k=k, v=v)
    if bias is None and alibi_slopes is None and window is None and softcap is None \
            and not dropout_p and seed is None:
        return _Attention.apply(q, k, v, scale, causal, layout, bool(deterministic))
    if dropout_p and seed is None:
        seed = int(torch.randint(0, 2 ** 62, (1,)).item())
    features = dict(window=window, softcap=softcap, dropout_p=dropout_p, seed=seed)
    return _AttentionFeatures.apply(q, k, v, bias, alibi_slopes, scale, causal, layout,
                                    bool(deterministic), features)


def _first_order_only(backward):
    """A custom backward that refuses create_graph=True: autograd runs a Function's backward
    with grad mode on exactly when it is asked for a graph of the gradients, which cuflash's
    backward kernels cannot give (without this, the gradients come back silently detached)."""
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("cuflash.torch.attention has no double backward: gradients with "
                               "create_graph=True (Hessian-vector products, gradient penalties) "
                               "are not supported; use torch's scaled_dot_product_attention "
                               "for those")
        return backward(ctx, *grads)
    wrapper.__name__, wrapper.__doc__ = backward.__name__, backward.__doc__
    return wrapper


class _Attention(torch.autograd.Function):
    """Forward saves q, k, v, o, lse; backward returns dq, dk, dv where needed."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, layout, deterministic):
        with _backend_for(q.device) as (xp, backend):
            qa, ka, va = (to_bhnd(_to_array(t, xp), layout) for t in (q, k, v))
            try:
                o, lse = cuflash.tiled_attention(qa, ka, va, scale=scale, causal=causal,
                                                 return_lse=True, backend=backend)
            except ValueError as e:
                raise layout_error(e, layout) from e
            o_t, lse_t = _to_tensor(from_bhnd(o, layout)), _to_tensor(lse)
        ctx.save_for_backward(q, k, v, o_t, lse_t)
        ctx.options = dict(scale=scale, causal=causal, deterministic=deterministic)
        ctx.layout = layout
        return o_t

    @staticmethod
    @_first_order_only
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        layout = ctx.layout
        with _backend_for(q.device) as (xp, backend):
            arrays = [to_bhnd(_to_array(t, xp), layout) for t in (do, q, k, v, o)]
            grads = cuflash.tiled_attention_backward(*arrays, _to_array(lse, xp),
                                                     backend=backend, **ctx.options)
            grads = [_to_tensor(from_bhnd(g, layout)) if need else None
                     for g, need in zip(grads, ctx.needs_input_grad[:3])]
        # one gradient per forward argument: scale, causal, layout, deterministic get none
        return (*grads, None, None, None, None)


class _AttentionFeatures(torch.autograd.Function):
    """With features: also saves bias and slopes; backward adds dbias when bias needs it."""

    @staticmethod
    def forward(ctx, q, k, v, bias, slopes, scale, causal, layout, deterministic, features):
        with _backend_for(q.device) as (xp, backend):
            qa, ka, va = (to_bhnd(_to_array(t, xp), layout) for t in (q, k, v))
            extra = _feature_arrays(xp, bias, slopes, features)
            try:
                o, lse = cuflash.tiled_attention(qa, ka, va, scale=scale, causal=causal,
                                                 return_lse=True, backend=backend, **extra)
            except ValueError as e:
                raise layout_error(e, layout) from e
            o_t, lse_t = _to_tensor(from_bhnd(o, layout)), _to_tensor(lse)
        ctx.save_for_backward(q, k, v, o_t, lse_t, bias, slopes)
        ctx.options = dict(scale=scale, causal=causal, deterministic=deterministic)
        ctx.features = features
        ctx.layout = layout
        return o_t

    @staticmethod
    @_first_order_only
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, bias, slopes = ctx.saved_tensors
        layout = ctx.layout
        want_db = bias is not None and ctx.needs_input_grad[3]
        with _backend_for(q.device) as (xp, backend):
            arrays = [to_bhnd(_to_array(t, xp), layout) for t in (do, q, k, v, o)]
            extra = _feature_arrays(xp, bias, slopes, ctx.features)
            if want_db:
                extra["return_dbias"] = True
            grads = cuflash.tiled_attention_backward(*arrays, _to_array(lse, xp),
                                                     backend=backend, **ctx.options, **extra)
            out = [_to_tensor(from_bhnd(g, layout)) if need else None
                   for g, need in zip(grads[:3], ctx.needs_input_grad[:3])]
            out.append(_to_tensor(grads[3]) if want_db else None)
        # one gradient per forward argument: slopes, scale, causal, layout, deterministic and
        # the features get none
        return (*out, None, None, None, None, None, None)


def _feature_arrays(xp, bias, slopes, features):
    """The cuflash keywords of the features, tensors as arrays of the backend."""
    extra = {n: val for n, val in features.items()
             if val is not None and not (n == "dropout_p" and not val)}
    if bias is not None:
        extra["bias"] = _to_array(bias, xp)
    if slopes is not None:
        extra["alibi_slopes"] = _to_array(slopes, xp)
    return extra


def _check_tensors(**tensors):
    """The one device of the tensors; TypeError/ValueError naming the culprit."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__module__}.{type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} (shape {tuple(t.shape)}) has dtype {t.dtype}; supported: "
                            + ", ".join(str(d) for d in _DTYPES))
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        raise TypeError("q, k, v must share one dtype, got "
                        + ", ".join(f"{n}: {t.dtype}" for n, t in tensors.items()))
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError("q, k, v must be on one device, got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))
    device = devices.pop()
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cuflash.torch runs CPU tensors (NumPy backend) and CUDA tensors "
                         f"(cuda backend); got tensors on {device}")
    return device


@contextlib.contextmanager
def _backend_for(device):
    """(array module, cuflash backend) for ``device``; on CUDA, torch's stream made CuPy's."""
    if device.type == "cpu":
        yield np, "numpy"
        return
    try:
        import cupy  # optional (the cuda extras): only CUDA tensors need it
    except ImportError as e:
        raise ImportError("CUDA tensors run on cuflash's 'cuda' backend, which needs CuPy "
                          f"({e}): {INSTALL_HINT}") from e
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        # the same stream for both libraries: no synchronisation needed at the
        # DLPack hand-overs, and the kernels are ordered with torch's own work
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream):
            yield cupy, "cuda"


def _to_array(t, xp):
    """A NumPy (CPU) or CuPy (CUDA) view of tensor ``t``, sharing its memory."""
    # DLPack refuses tensors that require grad, and carries no negation bit
    # (a lazily negated view would be exported with the wrong sign)
    t = t.detach().resolve_neg()
    if t.dtype == torch.bfloat16:
        return xp.from_dlpack(t.view(torch.int16)).view(bfloat16_dtype())
    return xp.from_dlpack(t)


def _to_tensor(a):
    """A tensor sharing the memory of NumPy/CuPy array ``a`` (which cuflash allocated)."""
    if is_bfloat16(a.dtype):
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)

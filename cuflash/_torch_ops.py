"""cuflash's calls as PyTorch operators (``torch.library``): what ``torch.compile`` traces.

Each cuflash call that the PyTorch doors make is an operator of the ``cuflash``
namespace with three parts: the real implementation (tensors to NumPy or CuPy
through DLPack, the cuflash function, the results back, sharing memory), a fake
implementation (shapes, strides and dtypes only, symbolic shapes included) and,
for the differentiable ones, an autograd formula that calls the backward
operator.  Dynamo and AOTAutograd see one opaque node per call and no
DLPack, so ``torch.compile(fullgraph=True)`` traces a model that calls them,
forward and backward.

=====================  ==================================================  ============
operator               cuflash function                                    autograd
=====================  ==================================================  ============
``attention_fwd``      ``tiled_attention(..., return_lse=True)``           ``attention_bwd``
``varlen_fwd``         ``varlen_attention(..., return_lse=True)``          ``varlen_bwd``
``kvcache_fwd``        ``attention_with_kvcache`` (mutates the caches)     none
``attention_probs``    ``standard_attention``'s P (a testing aid)          none
=====================  ==================================================  ============

Conventions of the operator arguments (the Python wrappers below convert):
``causal`` is ``"none"``, ``"bottom_right"`` or ``"top_left"``; a window side
of -1 is unbounded; ``softcap`` 0 is off; ``seed`` is a 0-d int64 CPU tensor
holding the 64-bit key as two's complement (a tensor, so that a seed drawn from
torch's generator inside a compiled function is traced, not baked in);
``layout`` is ``"bhnd"`` or ``"bnhd"`` (see :mod:`cuflash._interop`).

Outputs have fixed strides, computed the same way by both implementations: the
row-major array cuflash allocates in ``(..., H, N, d)`` order, seen through the
``bnhd`` swap when that is the layout.  ``lse`` carries no gradient (as in
FlashAttention-2).  The backward refuses ``create_graph=True``.
"""
import contextlib
from typing import Optional

import numpy as np
import torch

import cuflash

from ._interop import bfloat16_dtype, from_bhnd, is_bfloat16, layout_error, to_bhnd
from ._validate_masks import check_dropout
from .cuda_backend import INSTALL_HINT

__all__ = ["check_tensors", "attention", "varlen", "kvcache", "attention_probs", "seed_arg",
           "seed_tensor", "draw_seed", "backend_for"]

Tensor = torch.Tensor
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CAUSAL = {"none": False, "bottom_right": "bottom_right", "top_left": "top_left"}


# ---------------------------------------------------------------------------
# argument conventions
# ---------------------------------------------------------------------------
def causal_name(causal):
    """The operator spelling of an already parsed ``causal`` (None, or one of the two)."""
    return "none" if causal is None else causal


def seed_tensor(seed):
    """A Python int in [0, 2**64) as the 0-d int64 CPU tensor the operators take."""
    return torch.tensor(seed - 2 ** 64 if seed >= 2 ** 63 else seed, dtype=torch.int64)


def seed_arg(dropout_p, seed):
    """The operators' seed: None without dropout; drawn from torch's generator for None; an
    int checked and converted; a 0-d integer tensor passed as is."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype not in (torch.int64, torch.int32) or seed.dim() != 0 \
                or seed.device.type != "cpu":
            raise ValueError(f"seed as a tensor must be a 0-d int64 CPU tensor, got dtype "
                             f"{seed.dtype}, shape {tuple(seed.shape)} on {seed.device}")
        check_dropout(dropout_p, None)
        return seed.to(torch.int64) if dropout_p else None
    p, checked = check_dropout(dropout_p, 0 if seed is None else seed)
    if not p:
        return None
    return draw_seed() if seed is None else seed_tensor(checked)


def draw_seed():
    """A seed from torch's default CPU generator (``torch.manual_seed`` repeats it)."""
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64)


def _features(alibi_slopes, seed, window_left, window_right, softcap, dropout_p, bias=None,
              xp=np):
    """cuflash's feature keywords from the operator arguments (tensors as arrays of ``xp``)."""
    kw = {}
    if window_left >= 0 or window_right >= 0:
        kw["window"] = (window_left, window_right)
    if softcap > 0:
        kw["softcap"] = softcap
    if dropout_p > 0:
        kw["dropout_p"] = dropout_p
        kw["seed"] = int(seed) % 2 ** 64
    if bias is not None:
        kw["bias"] = _to_array(bias, xp)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = _to_array(alibi_slopes, xp)
    return kw


# ---------------------------------------------------------------------------
# tensors <-> arrays
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def backend_for(device):
    """(array module, cuflash backend) for ``device``; on CUDA, torch's stream made CuPy's."""
    if device.type == "cpu":
        yield np, "numpy"
        return
    if device.type != "cuda":
        raise ValueError(f"cuflash runs CPU tensors (NumPy backend) and CUDA tensors (cuda "
                         f"backend); got tensors on {device}")
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
    """A row-major tensor holding NumPy/CuPy array ``a`` (which cuflash allocated): shared,
    or copied once when cuflash handed back other strides, so that the strides are always
    those the fake implementations promise."""
    if is_bfloat16(a.dtype):
        t = torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_dlpack(a)
    return t.contiguous()


def _bhnd_shape(shape, layout):
    s = list(shape)
    if layout == "bnhd":
        s[-3], s[-2] = s[-2], s[-3]
    return s


def _empty_like_layout(x, shape_of, layout, dtype=None):
    """The fake of a result with ``shape_of``'s caller-layout shape: row-major in bhnd order."""
    return from_bhnd(x.new_empty(_bhnd_shape(shape_of.shape, layout), dtype=dtype or x.dtype),
                     layout)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _out_lead(q_lead, kv_lead):
    """Leading dims of the output (cuflash's rule: grouped heads, else broadcasting)."""
    if q_lead and kv_lead and q_lead[-1] != 1 and kv_lead[-1] != 1 \
            and q_lead[-1] != kv_lead[-1]:
        return list(torch.broadcast_shapes(tuple(q_lead[:-1]), tuple(kv_lead[:-1]))) \
            + [q_lead[-1]]
    return list(torch.broadcast_shapes(tuple(q_lead), tuple(kv_lead)))


def check_tensors(**tensors):
    """The one device of the tensors; TypeError/ValueError naming the culprit."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(t).__module__}.{type(t).__name__}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} (shape {tuple(t.shape)}) has dtype {t.dtype}; supported: "
                            + ", ".join(str(d) for d in DTYPES))
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
        raise ValueError(f"cuflash runs CPU tensors (NumPy backend) and CUDA tensors "
                         f"(cuda backend); got tensors on {device}")
    return device


def _first_order_only():
    """Autograd runs a backward with grad mode on exactly when it is asked for a graph of the
    gradients (create_graph=True), which the backward kernels cannot give."""
    if torch.is_grad_enabled():
        raise RuntimeError("cuflash's attention has no double backward: gradients with "
                           "create_graph=True (Hessian-vector products, gradient penalties) "
                           "are not supported; use torch's scaled_dot_product_attention for "
                           "those")


# ---------------------------------------------------------------------------
# dense attention
# ---------------------------------------------------------------------------
@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                   alibi_slopes: Optional[Tensor], seed: Optional[Tensor], scale: Optional[float],
                   causal: str, window_left: int, window_right: int, softcap: float,
                   dropout_p: float, layout: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    with backend_for(q.device) as (xp, backend):
        qa, ka, va = (to_bhnd(_to_array(t, xp), layout) for t in (q, k, v))
        kw = _features(alibi_slopes, seed, window_left, window_right, softcap, dropout_p,
                       bias, xp)
        try:
            o, lse = cuflash.tiled_attention(qa, ka, va, scale=scale, causal=_CAUSAL[causal],
                                             return_lse=True, backend=backend, **kw)
        except ValueError as e:
            raise layout_error(e, layout) from e
        return from_bhnd(_to_tensor(o), layout), _to_tensor(lse)


@_attention_fwd.register_fake
def _(q, k, v, bias, alibi_slopes, seed, scale, causal, window_left, window_right, softcap,
      dropout_p, layout, deterministic):
    qs, ks, vs = (_bhnd_shape(t.shape, layout) for t in (q, k, v))
    lead = _out_lead(qs[:-2], list(torch.broadcast_shapes(tuple(ks[:-2]), tuple(vs[:-2]))))
    o = from_bhnd(q.new_empty(lead + [qs[-2], vs[-1]]), layout)
    return o, q.new_empty(lead + [qs[-2]], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                   bias: Optional[Tensor], alibi_slopes: Optional[Tensor], seed: Optional[Tensor],
                   scale: Optional[float], causal: str, window_left: int, window_right: int,
                   softcap: float, dropout_p: float, layout: str, deterministic: bool,
                   want_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with backend_for(q.device) as (xp, backend):
        arrays = [to_bhnd(_to_array(t, xp), layout) for t in (do, q, k, v, o)]
        kw = _features(alibi_slopes, seed, window_left, window_right, softcap, dropout_p,
                       bias, xp)
        grads = cuflash.tiled_attention_backward(
            *arrays, _to_array(lse, xp), scale=scale, causal=_CAUSAL[causal],
            deterministic=deterministic, return_dbias=want_dbias, backend=backend, **kw)
        dq, dk, dv = (from_bhnd(_to_tensor(g), layout) for g in grads[:3])
        dbias = _to_tensor(grads[3]) if want_dbias else q.new_empty((0,))
        return dq, dk, dv, dbias


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, bias, alibi_slopes, seed, scale, causal, window_left, window_right,
      softcap, dropout_p, layout, deterministic, want_dbias):
    grads = [_empty_like_layout(t, t, layout) for t in (q, k, v)]
    dbias = bias.new_empty(bias.shape) if want_dbias else q.new_empty((0,))
    return (*grads, dbias)


def _attention_setup(ctx, inputs, output):
    q, k, v, bias, slopes, seed = inputs[:6]
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, bias, slopes, seed)
    ctx.options = inputs[6:]   # scale, causal, window_left, window_right, softcap, ...


def _attention_backward(ctx, do, _dlse):
    _first_order_only()
    q, k, v, o, lse, bias, slopes, seed = ctx.saved_tensors
    scale, causal, wl, wr, softcap, dropout_p, layout, deterministic = ctx.options
    want_dbias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = torch.ops.cuflash.attention_bwd(
        do, q, k, v, o, lse, bias, slopes, seed, scale, causal, wl, wr, softcap, dropout_p,
        layout, deterministic, want_dbias)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dbias if want_dbias else None) + (None,) * 10


_attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup)


def attention(q, k, v, *, bias=None, alibi_slopes=None, seed=None, scale=None, causal=None,
              window=None, softcap=None, dropout_p=0.0, layout="bhnd", deterministic=False):
    """``(o, lse)`` through the operators; arguments already checked and normalised
    (``causal`` parsed, ``window`` a pair or None, ``seed`` a tensor or None)."""
    wl, wr = window if window is not None else (-1, -1)
    return torch.ops.cuflash.attention_fwd(
        q, k, v, bias, alibi_slopes, seed, None if scale is None else float(scale),
        causal_name(causal), int(wl), int(wr), float(softcap or 0.0), float(dropout_p), layout,
        bool(deterministic))


# ---------------------------------------------------------------------------
# variable-length batches
# ---------------------------------------------------------------------------
@torch.library.custom_op("cuflash::varlen_fwd", mutates_args=())
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                alibi_slopes: Optional[Tensor], seed: Optional[Tensor], scale: Optional[float],
                causal: str, window_left: int, window_right: int, softcap: float,
                dropout_p: float, deterministic: bool) -> tuple[Tensor, Tensor]:
    with backend_for(q.device) as (xp, backend):
        arrays = [_to_array(t, xp) for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)]
        kw = _features(alibi_slopes, seed, window_left, window_right, softcap, dropout_p, xp=xp)
        o, lse = cuflash.varlen_attention(*arrays, max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k, scale=scale,
                                          causal=_CAUSAL[causal], return_lse=True,
                                          backend=backend, **kw)
        return _to_tensor(o), _to_tensor(lse)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, seed,
      scale, causal, window_left, window_right, softcap, dropout_p, deterministic):
    total_q, H = q.shape[0], q.shape[1]
    return (q.new_empty((total_q, H, v.shape[-1])),
            q.new_empty((total_q, H), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("cuflash::varlen_bwd", mutates_args=())
def _varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: Optional[int],
                max_seqlen_k: Optional[int], alibi_slopes: Optional[Tensor],
                seed: Optional[Tensor], scale: Optional[float], causal: str, window_left: int,
                window_right: int, softcap: float, dropout_p: float,
                deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    with backend_for(q.device) as (xp, backend):
        arrays = [_to_array(t, xp) for t in (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)]
        kw = _features(alibi_slopes, seed, window_left, window_right, softcap, dropout_p, xp=xp)
        grads = cuflash.varlen_attention_backward(
            *arrays, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, scale=scale,
            causal=_CAUSAL[causal], deterministic=deterministic, backend=backend, **kw)
        return tuple(_to_tensor(g) for g in grads)


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      alibi_slopes, seed, scale, causal, window_left, window_right, softcap, dropout_p,
      deterministic):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, slopes, seed = inputs[:9]
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, slopes, seed)
    ctx.options = (max_q, max_k) + tuple(inputs[9:])


def _varlen_backward(ctx, do, _dlse):
    _first_order_only()
    q, k, v, o, lse, cu_q, cu_k, slopes, seed = ctx.saved_tensors
    max_q, max_k, *rest = ctx.options
    dq, dk, dv = torch.ops.cuflash.varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k,
                                              slopes, seed, *rest)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None,
            dv if need[2] else None) + (None,) * 13


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
           alibi_slopes=None, seed=None, scale=None, causal=None, window=None, softcap=None,
           dropout_p=0.0, deterministic=False):
    """``(o, lse)`` of a packed batch through the operators (arguments normalised)."""
    wl, wr = window if window is not None else (-1, -1)
    as_int = (lambda n: None if n is None else int(n))  # noqa: E731
    return torch.ops.cuflash.varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, as_int(max_seqlen_q), as_int(max_seqlen_k),
        alibi_slopes, seed, None if scale is None else float(scale), causal_name(causal),
        int(wl), int(wr), float(softcap or 0.0), float(dropout_p), bool(deterministic))


# ---------------------------------------------------------------------------
# KV cache (decoding): writes k_new/v_new into the caches in place
# ---------------------------------------------------------------------------
@torch.library.custom_op("cuflash::kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def _kvcache_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                 k_new: Optional[Tensor], v_new: Optional[Tensor], block_table: Optional[Tensor],
                 bias: Optional[Tensor], alibi_slopes: Optional[Tensor], scale: Optional[float],
                 causal: str, window_left: int, window_right: int, softcap: float,
                 num_splits: Optional[int]) -> tuple[Tensor, Tensor]:
    # every tensor in flash-attn's layout: q (B, Nq, H, d), caches (B_cache, capacity, Hk, d)
    # or pages (num_pages, page_size, Hk, d), k_new (B, Nnew, Hk, d)
    B = q.shape[0]
    if block_table is None and k_cache.shape[0] > B:
        k_cache, v_cache = k_cache[:B], v_cache[:B]   # views: the writes land in the caches
    with backend_for(q.device) as (xp, backend):
        arrays = [None if t is None else to_bhnd(_to_array(t, xp), "bnhd")
                  for t in (q, k_cache, v_cache, k_new, v_new)]
        index = [None if t is None else _to_array(t, xp) for t in (cache_seqlens, block_table)]
        kw = _features(alibi_slopes, None, window_left, window_right, softcap, 0.0, bias, xp)
        o, lse = cuflash.attention_with_kvcache(
            arrays[0], arrays[1], arrays[2], cache_seqlens=index[0], k_new=arrays[3],
            v_new=arrays[4], block_table=index[1], scale=scale, causal=_CAUSAL[causal],
            num_splits=num_splits, return_lse=True, backend=backend, **kw)
        return from_bhnd(_to_tensor(o), "bnhd"), _to_tensor(lse)


@_kvcache_fwd.register_fake
def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, bias, alibi_slopes, scale,
      causal, window_left, window_right, softcap, num_splits):
    B, Nq, H = q.shape[0], q.shape[1], q.shape[2]
    o = from_bhnd(q.new_empty((B, H, Nq, v_cache.shape[-1])), "bnhd")
    return o, q.new_empty((B, H, Nq), dtype=_lse_dtype(q.dtype))


def kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None, block_table=None,
            bias=None, alibi_slopes=None, scale=None, causal=None, window=None, softcap=None,
            num_splits=None):
    """``(o, lse)`` against a KV cache in flash-attn's layout (arguments normalised)."""
    wl, wr = window if window is not None else (-1, -1)
    return torch.ops.cuflash.kvcache_fwd(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, bias, alibi_slopes,
        None if scale is None else float(scale), causal_name(causal), int(wl), int(wr),
        float(softcap or 0.0), None if num_splits is None else int(num_splits))


# ---------------------------------------------------------------------------
# the attention probabilities (testing aid: materialises (..., Nq, Nk))
# ---------------------------------------------------------------------------
@torch.library.custom_op("cuflash::attention_probs", mutates_args=())
def _attention_probs(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
                     scale: Optional[float], causal: str, window_left: int, window_right: int,
                     softcap: float, layout: str) -> Tensor:
    with backend_for(q.device) as (xp, backend):
        qa, ka, va = (to_bhnd(_to_array(t, xp), layout) for t in (q, k, v))
        kw = _features(alibi_slopes, None, window_left, window_right, softcap, 0.0, xp=xp)
        _, p = cuflash.standard_attention(qa, ka, va, scale=scale, causal=_CAUSAL[causal],
                                          backend=backend, **kw)
        return _to_tensor(p)


@_attention_probs.register_fake
def _(q, k, v, alibi_slopes, scale, causal, window_left, window_right, softcap, layout):
    qs, ks, vs = (_bhnd_shape(t.shape, layout) for t in (q, k, v))
    lead = _out_lead(qs[:-2], list(torch.broadcast_shapes(tuple(ks[:-2]), tuple(vs[:-2]))))
    return q.new_empty(lead + [qs[-2], ks[-2]])


def attention_probs(q, k, v, *, alibi_slopes=None, scale=None, causal=None, window=None,
                    softcap=None, layout="bhnd"):
    """P, the softmax before dropout, shape lead + (Nq, Nk) (arguments normalised)."""
    wl, wr = window if window is not None else (-1, -1)
    return torch.ops.cuflash.attention_probs(
        q, k, v, alibi_slopes, None if scale is None else float(scale), causal_name(causal),
        int(wl), int(wr), float(softcap or 0.0), layout)

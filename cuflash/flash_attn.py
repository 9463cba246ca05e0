"""FlashAttention-2's Python interface on cuflash's kernels: a drop-in for ``flash_attn``.

``from cuflash.flash_attn import flash_attn_func`` in place of ``from flash_attn
import flash_attn_func``: the functions of ``flash_attn.flash_attn_interface``
(2.8) with their signatures, defaults, ``(batch, seqlen, heads, headdim)``
layout and return values, on CPU tensors (NumPy backend) and CUDA tensors
(the ``"cuda"`` backend: CuPy and NVRTC, nothing built at install; sm_75 and
newer).  The differentiable ones go through cuflash's PyTorch operators
(:mod:`cuflash._torch_ops`), so ``torch.compile(fullgraph=True)`` traces them.

=====================================  ===================================================
function                               cuflash call
=====================================  ===================================================
``flash_attn_func``                    ``tiled_attention`` (+ backward)
``flash_attn_qkvpacked_func``          the same on ``qkv[:, :, 0]``, ``[:, :, 1]``, ``[:, :, 2]``
``flash_attn_kvpacked_func``           the same on ``kv[:, :, 0]``, ``kv[:, :, 1]``
``flash_attn_varlen_func``             ``varlen_attention`` (+ backward)
``flash_attn_varlen_qkvpacked_func``,  the same on the unpacked views
``flash_attn_varlen_kvpacked_func``
``flash_attn_with_kvcache``            ``attention_with_kvcache`` (no backward, as FA2)
=====================================  ===================================================

Every argument of these functions is supported.  Where the semantics differ
(docs/frameworks.md has the list): the dropout mask is cuflash's own (Philox4x32-10 keyed
by a seed drawn from torch's CPU generator: :func:`cuflash.dropout_mask`; same probability
and scaling, other elements dropped); ``S_dmask`` is the exact-size normalised softmax,
negative where dropped; the index arrays are checked on the host at every call; more
dtypes, head dims, page sizes and GPUs are accepted.  A row that sees no key gives 0 and
``softmax_lse = +inf``, as FA2's non-split kernels do.
"""
try:
    import torch
except ImportError as e:  # torch absent (or blocked in sys.modules)
    raise ImportError("cuflash.flash_attn needs PyTorch, which cannot be imported here "
                      f"({e}); install it with `pip install torch` or "
                      "`pip install \".[torch]\"` from a cuflash checkout") from e

import cuflash

from . import _torch_ops as ops
from ._validate_masks import check_softcap, check_window

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


# ---------------------------------------------------------------------------
# argument checks and conversions
# ---------------------------------------------------------------------------
def _check_ndim(ndim, **tensors):
    device = ops.check_tensors(**tensors)
    for name, t in tensors.items():
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    return device


def _check_same_device(device, **tensors):
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}: one device")


def _check_index(device, **tensors):
    _check_same_device(device, **tensors)
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor (as in flash-attn), got {t.dtype}")


def _options(causal, window_size, softcap):
    """cuflash's causal, window and softcap for FA2's values (-1 sides, softcap <= 0 = off)."""
    window = check_window(None if window_size is None else tuple(window_size))
    return ("bottom_right" if causal else None, window,
            check_softcap(softcap) if softcap and softcap > 0 else None)


def _fa_lse(lse):
    """cuflash's -inf for rows without keys as FlashAttention-2's +inf."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _no_probs(q):
    return q.new_empty((0,))


def _signed_probs(p, dropout_p, seed):
    """FA2's S_dmask convention: the probabilities, negative where dropout dropped them."""
    keep = cuflash.dropout_mask(tuple(p.shape), dropout_p, int(seed) % 2 ** 64)
    return torch.where(torch.from_numpy(keep).to(p.device), p, -p)


# ---------------------------------------------------------------------------
# dense batches
# ---------------------------------------------------------------------------
def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs):
    device = _check_ndim(4, q=q, k=k, v=v)
    _check_same_device(device, alibi_slopes=alibi_slopes)
    causal, window, softcap = _options(causal, window_size, softcap)
    seed = ops.seed_arg(dropout_p, None)
    o, lse = ops.attention(q, k, v, alibi_slopes=alibi_slopes, seed=seed, scale=softmax_scale,
                           causal=causal, window=window, softcap=softcap, dropout_p=dropout_p,
                           layout="bnhd", deterministic=deterministic)
    if not return_attn_probs:
        return o
    if not dropout_p:
        return o, _fa_lse(lse), _no_probs(q)
    p = ops.attention_probs(q.detach(), k.detach(), v.detach(), alibi_slopes=alibi_slopes,
                            scale=softmax_scale, causal=causal, window=window, softcap=softcap,
                            layout="bnhd")
    return o, _fa_lse(lse), _signed_probs(p, dropout_p, seed)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """FlashAttention-2's ``flash_attn_func`` on cuflash (see the module docstring).

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads, headdim)
    k, v : torch.Tensor, shape (batch, seqlen_k, nheads_k, headdim)
        One device (CPU or CUDA), one dtype (float16, bfloat16, float32,
        float64); ``nheads_k`` divides ``nheads``.  Not modified.
    dropout_p : float
        Dropout on the attention probabilities, cuflash's own mask (set it to
        0.0 for evaluation, as with FA2).
    softmax_scale : float, optional
        None means ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : (int, int)
        ``(left, right)``; query i sees keys ``[i + seqlen_k - seqlen_q - left,
        i + seqlen_k - seqlen_q + right]``; -1 is unbounded.
    softcap : float
        ``> 0``: logits become ``softcap * tanh(logits / softcap)``.
    alibi_slopes : torch.Tensor, shape (nheads,) or (batch, nheads), float32, optional
    deterministic : bool
        Bitwise repeatable backward on CUDA (CPU always is).
    return_attn_probs : bool
        Also return ``softmax_lse`` and ``S_dmask``.

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads, headdim)
    softmax_lse : torch.Tensor, shape (batch, nheads, seqlen_q), float32
        Only with ``return_attn_probs``; +inf for rows that see no key.
    S_dmask : torch.Tensor
        Only with ``return_attn_probs``: shape (batch, nheads, seqlen_q,
        seqlen_k) with dropout (negative where dropped), else empty.
    """
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on ``qkv`` of shape (batch, seqlen, 3, nheads, headdim)."""
    _check_ndim(5, qkv=qkv)
    _check_packed(qkv, 3, "qkv")
    q, k, v = qkv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with ``kv`` of shape (batch, seqlen_k, 2, nheads_k, headdim)."""
    _check_ndim(5, kv=kv)
    _check_packed(kv, 2, "kv")
    k, v = kv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


def _check_packed(x, n, name):
    axis = x.dim() - 3
    if x.shape[axis] != n:
        raise ValueError(f"{name} must have {n} at axis {axis} (the packed "
                         f"{'q, k, v' if n == 3 else 'k, v'}), got shape {tuple(x.shape)}")


# ---------------------------------------------------------------------------
# variable-length batches
# ---------------------------------------------------------------------------
def _gather_pages(pages, block_table, cu_seqlens_k):
    """Sequence b's first ``len_b`` keys from its pages, packed as (total_k, Hk, d) (a copy)."""
    page_size = pages.shape[1]
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    total = int(cu_seqlens_k[-1])
    seq = torch.repeat_interleave(torch.arange(len(lens), device=pages.device), lens,
                                  output_size=total)
    pos = torch.arange(total, device=pages.device) - cu_seqlens_k[:-1].long()[seq]
    page = block_table.long()[seq, pos // page_size]
    return pages[page, pos % page_size]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None):
    device = _check_ndim(3, q=q)
    _check_ndim(3 if block_table is None else 4, k=k, v=v)
    _check_index(device, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 block_table=block_table)
    _check_same_device(device, alibi_slopes=alibi_slopes)
    if block_table is not None:
        k, v = (_gather_pages(x, block_table, cu_seqlens_k) for x in (k, v))
    causal, window, softcap = _options(causal, window_size, softcap)
    seed = ops.seed_arg(dropout_p, None)
    o, lse = ops.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        alibi_slopes=alibi_slopes, seed=seed, scale=softmax_scale,
                        causal=causal, window=window, softcap=softcap, dropout_p=dropout_p,
                        deterministic=deterministic)
    if not return_attn_probs:
        return o
    lse = _fa_lse(lse).transpose(0, 1).contiguous()   # FA2: (nheads, total_q)
    if not dropout_p:
        return o, lse, _no_probs(q)
    return o, lse, _varlen_probs(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                 softmax_scale, causal, window, softcap, dropout_p, seed)


def _varlen_probs(q, k, v, cu_q, cu_k, alibi_slopes, scale, causal, window, softcap, dropout_p,
                  seed):
    """S_dmask of a packed batch, (batch, nheads, max_seqlen_q, max_seqlen_k), zero-padded."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    B, H = len(cu_q) - 1, q.shape[1]
    lq = [cu_q[b + 1] - cu_q[b] for b in range(B)]
    lk = [cu_k[b + 1] - cu_k[b] for b in range(B)]
    p = q.new_zeros((B, H, max(lq, default=0), max(lk, default=0)))
    for b in range(B):
        slopes = alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 \
            else alibi_slopes
        if lq[b] and lk[b]:
            p[b, :, :lq[b], :lk[b]] = ops.attention_probs(
                *(x.detach()[None, c[b]:c[b + 1]] for x, c in ((q, cu_q), (k, cu_k), (v, cu_k))),
                alibi_slopes=slopes, scale=scale, causal=causal, window=window, softcap=softcap,
                layout="bnhd")[0]
    return _signed_probs(p, dropout_p, seed)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """FlashAttention-2's ``flash_attn_varlen_func`` on cuflash (see the module docstring).

    Parameters
    ----------
    q : torch.Tensor, shape (total_q, nheads, headdim)
    k, v : torch.Tensor, shape (total_k, nheads_k, headdim)
        Or, with ``block_table``, pages (num_blocks, page_block_size,
        nheads_k, headdim) (gathered into packed keys first: a copy).
    cu_seqlens_q, cu_seqlens_k : torch.Tensor of int32, shape (batch + 1,)
        Prefix sums of the sequence lengths (on q's device).
    max_seqlen_q, max_seqlen_k : int
        The longest sequences (a value smaller than a sequence is an error).
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic
        As in :func:`flash_attn_func`, per sequence (causal and the window
        align at each sequence's own ``len_k - len_q``).
    return_attn_probs : bool
        Also return ``softmax_lse`` (nheads, total_q) and ``S_dmask``
        (batch, nheads, max_seqlen_q, max_seqlen_k) (with dropout).
    block_table : torch.Tensor of int32, shape (batch, max_num_blocks), optional

    Returns
    -------
    out : torch.Tensor, shape (total_q, nheads, headdim)
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on ``qkv`` of shape (total, 3, nheads, headdim)."""
    _check_ndim(4, qkv=qkv)
    _check_packed(qkv, 3, "qkv")
    q, k, v = qkv.unbind(1)
    return _varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with ``kv`` of shape (total_k, 2, nheads_k, headdim)."""
    _check_ndim(4, kv=kv)
    _check_packed(kv, 2, "kv")
    k, v = kv.unbind(1)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------
def _rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding of the first ``2 * cos.shape[1]`` dims of x (batch, seqlen, heads, d)
    at ``positions`` (batch, seqlen), computed in float32 (float64 for float64)."""
    half = cos.shape[-1]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(work)[positions].unsqueeze(2)          # (batch, seqlen, 1, half)
    s = sin.to(work)[positions].unsqueeze(2)
    r = x[..., :2 * half].to(work)
    x1, x2 = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    y = torch.stack((y1, y2), -1).flatten(-2) if interleaved else torch.cat((y1, y2), -1)
    return torch.cat((y.to(x.dtype), x[..., 2 * half:]), -1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """FlashAttention-2's ``flash_attn_with_kvcache`` on cuflash (see the module docstring).

    If ``k`` and ``v`` are given they are written into the caches in place at
    positions ``cache_seqlens[b] ...`` (``cache_seqlens`` is not updated), then
    q attends to ``cache_seqlens[b] + seqlen_new`` keys of each sequence.

    Parameters
    ----------
    q : torch.Tensor, shape (batch, seqlen_q, nheads, headdim)
    k_cache, v_cache : torch.Tensor
        (batch_cache, seqlen_cache, nheads_k, headdim), or pages
        (num_blocks, page_block_size, nheads_k, headdim) with ``block_table``
        (any page size).  Modified in place when ``k``/``v`` are given.
    k, v : torch.Tensor, shape (batch, seqlen_new, nheads_k, headdim), optional
    rotary_cos, rotary_sin : torch.Tensor, shape (seqlen_ro, rotary_dim / 2), optional
        Rotary embedding of ``k`` at positions ``cache_seqlens + n`` and of q
        at ``cache_seqlens + i`` (causal or windowed) or ``cache_seqlens``
        (otherwise), minus ``cache_leftpad``; needs ``k`` and ``v``.
    cache_seqlens : int or torch.Tensor of int32, shape (batch,), optional
        Valid keys per sequence before this call; None: the whole cache.
    cache_batch_idx : torch.Tensor of int32, shape (batch,), optional
        Cache row of each sequence (not with ``block_table``).
    cache_leftpad : torch.Tensor of int32, shape (batch,), optional
        First valid key of each sequence's cache row (not with ``block_table``).
    block_table : torch.Tensor of int32, shape (batch, max_num_blocks), optional
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in :func:`flash_attn_func`, aligned at each sequence's length.
    rotary_interleaved : bool
        True: rotate dims (0, 1), (2, 3), ...; False: (i, i + rotary_dim / 2).
    num_splits : int
        Split-KV: 0 lets cuflash choose, 1 never splits, n > 1 forces n.
    return_softmax_lse : bool

    Returns
    -------
    out : torch.Tensor, shape (batch, seqlen_q, nheads, headdim)
    softmax_lse : torch.Tensor, shape (batch, nheads, seqlen_q)
        Only with ``return_softmax_lse``.
    """
    device = _check_ndim(4, q=q, k_cache=k_cache, v_cache=v_cache)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values), or neither")
    if k is not None:
        _check_ndim(4, q=q, k=k, v=v)
    _check_index(device, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                 block_table=block_table)
    _check_same_device(device, alibi_slopes=alibi_slopes, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin)
    if block_table is not None and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("block_table (a paged cache) cannot be combined with cache_batch_idx "
                         "or cache_leftpad (as in flash-attn)")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys k: pass k and v with them")
    B = q.shape[0]
    capacity = (k_cache.shape[1] if block_table is None
                else block_table.shape[1] * k_cache.shape[1])
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k and v needs cache_seqlens (where to write them)")
        cache_seqlens = torch.full((B,), capacity, dtype=torch.int32, device=device)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        _check_index(device, cache_seqlens=cache_seqlens)
    causal, window, softcap = _options(causal, window_size, softcap)
    if cache_batch_idx is not None:
        # each sequence's cache row is one page of seqlen_cache rows
        block_table = cache_batch_idx[:, None]
    bias = None
    if cache_leftpad is not None:
        keys = torch.arange(capacity, device=device)
        bias = torch.zeros((B, 1, 1, capacity), dtype=torch.float32, device=device).masked_fill(
            (keys[None, :] < cache_leftpad.long()[:, None])[:, None, None, :], float("-inf"))
    if rotary_cos is not None:
        start = cache_seqlens.long() - (0 if cache_leftpad is None else cache_leftpad.long())
        k = _rotate(k, rotary_cos, rotary_sin,
                    start[:, None] + torch.arange(k.shape[1], device=device), rotary_interleaved)
        steps = (torch.arange(q.shape[1], device=device) if causal or window is not None
                 else torch.zeros(q.shape[1], dtype=torch.long, device=device))
        q = _rotate(q, rotary_cos, rotary_sin, start[:, None] + steps, rotary_interleaved)
    o, lse = ops.kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k, v_new=v,
                         block_table=block_table, bias=bias, alibi_slopes=alibi_slopes,
                         scale=softmax_scale, causal=causal, window=window, softcap=softcap,
                         num_splits=num_splits or None)
    return (o, _fa_lse(lse)) if return_softmax_lse else o


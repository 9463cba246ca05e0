"""cuflash as an attention implementation of Hugging Face transformers.

``import cuflash.transformers`` registers cuflash with transformers'
``AttentionInterface`` (and its mask function with ``AttentionMaskInterface``)
under the name :data:`ATTN_IMPLEMENTATION`; a model then uses it through
``attn_implementation=cuflash.transformers.ATTN_IMPLEMENTATION`` (in
``from_pretrained``, ``from_config`` or ``model.set_attn_implementation``).
:func:`register` does it again (idempotent), e.g. after another library
replaced the entry.

The name avoids ``"flash"``, which would make transformers load a FlashAttention kernel
itself (docs/frameworks.md says why).  cuflash is an *attention function* instead, with
FlashAttention's mask: the mask function hands it the 2-D padding mask (or None), and
padded or packed batches run as one variable-length batch
(:func:`cuflash.flash_attn.flash_attn_varlen_func`: no padding computed, no ``(N, N)``
mask built); unpadded batches run :func:`cuflash.flash_attn.flash_attn_func`.

Supported: causal attention layers (a layer whose ``is_causal`` is False runs
without the causal mask), grouped-query heads, padding (right or left), packed
sequences, sliding windows (``sliding_window``), softcapping (``softcap``),
attention dropout (cuflash's own mask, see :mod:`cuflash.flash_attn`), KV
caches (dynamic and static), float16, bfloat16, float32, float64, CPU and
CUDA tensors, ``torch.compile`` of unpadded batches.  Not
supported, with an error: attention sinks (``s_aux``), additive position
biases (``position_bias``), a 4-D mask passed by the caller;
``output_attentions=True`` returns no weights (a warning says so).
"""
import warnings

try:
    import torch
except ImportError as e:  # torch absent (or blocked in sys.modules)
    raise ImportError("cuflash.transformers needs PyTorch and transformers; PyTorch cannot be "
                      f"imported here ({e}): install both with `pip install torch "
                      "transformers` or `pip install \".[transformers]\"` from a cuflash "
                      "checkout") from e
try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # transformers absent (or blocked in sys.modules)
    raise ImportError("cuflash.transformers needs transformers, which cannot be imported here "
                      f"({e}); install it with `pip install transformers` or "
                      "`pip install \".[transformers]\"` from a cuflash checkout") from e

from .flash_attn import flash_attn_func, flash_attn_varlen_func

__all__ = ["ATTN_IMPLEMENTATION", "register", "attention_forward", "padding_mask"]

ATTN_IMPLEMENTATION = "cufa"
"""The ``attn_implementation`` name (without "flash": see the module docstring)."""


def register():
    """Register :func:`attention_forward` and :func:`padding_mask` under
    :data:`ATTN_IMPLEMENTATION` (for every model, as transformers' own are)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """The mask handed to :func:`attention_forward`: the 2-D boolean padding mask of the keys,
    shape (batch, kv_length) (True = a real token), or None when every key is real.

    The causal and sliding-window patterns are not built here: the kernels apply them.  A
    static cache holds ``kv_length`` slots of which only the first ``q_offset + q_length``
    are written; without a padding mask, the mask is then ``q_offset + q_length`` True
    columns, so that the attention reads only those slots (as transformers' flash path
    does with the mask it is given).
    """
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    filled = q_offset + q_length      # a tensor for a static cache
    if not isinstance(filled, torch.Tensor) and filled >= kv_length:
        return None
    return torch.ones((batch_size, int(filled)), dtype=torch.bool, device=kwargs.get("device"))


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function contract on cuflash.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (its ``is_causal`` is the default of ``is_causal``).
    query : torch.Tensor, shape (batch, heads, q_len, head_dim)
    key, value : torch.Tensor, shape (batch, kv_heads, kv_len, head_dim)
    attention_mask : torch.Tensor of bool, shape (batch, mask_len), or None
        What :func:`padding_mask` returned.
    dropout, scaling, sliding_window, softcap, is_causal
        As transformers passes them; ``sliding_window`` w means each query sees
        the w keys ending at its own position (``window_size=(w - 1, w - 1)``).
    **kwargs
        ``position_ids``, ``cu_seq_lens_q/k`` and ``max_length_q/k`` select the
        packed-batch path; ``deterministic``; ``output_attentions``.

    Returns
    -------
    out : torch.Tensor, shape (batch, q_len, heads, head_dim)
    None
        No attention weights.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} has no attention sinks "
                         "(s_aux); use 'eager' or 'sdpa' for this model")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} takes no additive "
                         "position_bias; use 'eager' or 'sdpa' for this model")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation={ATTN_IMPLEMENTATION!r} reads a 2-D padding "
                         f"mask; got a mask of shape {tuple(attention_mask.shape)} (a prepared "
                         "4-D mask): use 'sdpa' or 'eager' for custom masks")
    if kwargs.get("output_attentions"):
        warnings.warn(f"attn_implementation={ATTN_IMPLEMENTATION!r} returns no attention "
                      "weights (output_attentions=True gives None); use 'eager' for them",
                      stacklevel=2)
    causal = module.is_causal if is_causal is None else is_causal
    q_len = query.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))   # (batch, len, heads, dim)
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, softcap=softcap or 0.0,
                   deterministic=bool(kwargs.get("deterministic") or False))
    if sliding_window is not None and k.shape[1] > sliding_window:
        options["window_size"] = (sliding_window - 1, sliding_window - 1)

    if attention_mask is not None:
        return _padded(q, k, v, attention_mask.bool(), options), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if all(x is not None for x in (cu_q, cu_k, max_q, max_k)):
        return _packed(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, options), None
    position_ids = kwargs.get("position_ids")
    if q.shape[0] == 1 and q_len > 1 and position_ids is not None and _restarts(position_ids):
        cu, max_len = _cu_from_positions(position_ids)
        return _packed(q, k, v, cu, cu, max_len, max_len, options), None
    return flash_attn_func(q, k, v, **options), None


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, options):
    """Sequences packed along the length axis of a (1, total, heads, dim) batch."""
    B = q.shape[0]
    o = flash_attn_varlen_func(*(x.reshape(-1, *x.shape[2:]) for x in (q, k, v)), cu_q, cu_k,
                               int(max_q), int(max_k), **options)
    return o.view(B, -1, *o.shape[1:])


def _restarts(position_ids):
    """True when the positions restart (several sequences packed in one row)."""
    pos = position_ids.reshape(-1)
    return bool((pos[1:] <= pos[:-1]).any())


def _cu_from_positions(position_ids):
    """cu_seqlens (int32) and the longest length of sequences that start at the smallest
    position id (packed sequences all restart from it)."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().reshape(-1)
    cu = torch.cat((starts, torch.tensor([pos.numel()], device=pos.device))).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _padded(q, k, v, mask, options):
    """Padded batch: the real tokens packed, one varlen call, the output scattered back."""
    B, q_len = q.shape[0], q.shape[1]
    if k.shape[1] > mask.shape[1]:   # a static cache longer than the tokens seen
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    lens_k = mask.sum(-1, dtype=torch.int32)
    keep_k = mask.reshape(-1).nonzero().reshape(-1)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0, dtype=torch.int32), (1, 0))
    max_k = int(lens_k.max())
    if q_len == k.shape[1]:
        keep_q, cu_q, max_q = keep_k, cu_k, max_k
    elif q_len == 1:   # decoding: one query per sequence
        keep_q = torch.arange(B, device=q.device) * q_len
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        max_q = 1
    else:              # queries are the last q_len tokens (left padding)
        mask_q = mask[:, -q_len:]
        lens_q = mask_q.sum(-1, dtype=torch.int32)
        keep_q = mask_q.reshape(-1).nonzero().reshape(-1)
        cu_q = torch.nn.functional.pad(lens_q.cumsum(0, dtype=torch.int32), (1, 0))
        max_q = int(lens_q.max())
    flat = (lambda x: x.reshape(-1, *x.shape[2:]))  # noqa: E731
    o = flash_attn_varlen_func(flat(q)[keep_q], flat(k)[keep_k], flat(v)[keep_k], cu_q, cu_k,
                               max_q, max_k, **options)
    out = o.new_zeros((B * q_len,) + tuple(o.shape[1:]))
    out = out.index_copy(0, keep_q, o)
    return out.view(B, q_len, *o.shape[1:])


register()

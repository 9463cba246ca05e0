"""cuflash inside PyTorch: differentiable exact attention, traceable by ``torch.compile``.

``cuflash.torch.attention`` calls the operator ``torch.ops.cuflash.attention_fwd``
(:mod:`cuflash._torch_ops`): the forward is ``cuflash.tiled_attention(...,
return_lse=True)``, its registered autograd formula the operator
``attention_bwd``, i.e. ``cuflash.tiled_attention_backward`` from the saved
``o`` and ``lse`` (P is never stored).  CPU tensors run on the ``"numpy"``
backend, CUDA tensors on the ``"cuda"`` backend.

torch.compile
-------------
The operators have fake implementations (shapes and strides, symbolic shapes
included), so ``torch.compile(model, fullgraph=True)`` traces a model that
calls ``attention``, forward and backward, with dynamic shapes, on any
backend (``"inductor"``, ``"aot_eager"``, ...).  A dropout seed drawn here
(``seed=None``) is drawn by ``torch.randint`` inside the traced graph; an int
seed becomes a constant of the graph (a new int each step may recompile: pass
a 0-d int64 tensor, or None, for a seed that changes).

Data movement (docs/frameworks.md): tensors cross to NumPy/CuPy and back through DLPack,
sharing memory both ways and in both layouts (bfloat16 as its int16 bits); the only copies
are the CUDA launcher's, for strides a kernel cannot address.  On a GPU the kernels run on
PyTorch's current CUDA stream, and CuPy's memory pool holds the outputs
(``torch.cuda.memory_allocated`` does not count them).

Not supported: double backward (``create_graph=True`` raises RuntimeError),
forward-mode AD, other devices than CPU and CUDA.  ``torch`` here is the real
PyTorch (absolute imports), not this module.
"""
try:
    import torch
except ImportError as e:  # torch absent (or blocked in sys.modules)
    raise ImportError("cuflash.torch needs PyTorch, which cannot be imported here "
                      f"({e}); install it with `pip install torch` or "
                      "`pip install \".[torch]\"` from a cuflash checkout") from e

from . import _torch_ops as ops
from ._interop import check_layout
from ._validate import parse_causal
from ._validate_masks import check_softcap, check_window

__all__ = ["attention"]


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
    seed : int or torch.Tensor, optional
        Key of the dropout mask: an int in [0, 2**64), or a 0-d int64 CPU
        tensor (the key's bits as a signed int64; traced as an input under
        ``torch.compile``).  None with ``dropout_p > 0`` draws one from
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
    # checked before anything is recorded or traced, so that bad input fails cleanly
    device = ops.check_tensors(q=q, k=k, v=v)
    for name, t in (("bias", bias), ("alibi_slopes", alibi_slopes)):
        if t is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, q on {device}: one device")
    check_layout(layout, q=q, k=k, v=v)
    o, _ = ops.attention(q, k, v, bias=bias, alibi_slopes=alibi_slopes,
                         seed=ops.seed_arg(dropout_p, seed), scale=scale,
                         causal=parse_causal(causal), window=check_window(window),
                         softcap=check_softcap(softcap), dropout_p=dropout_p, layout=layout,
                         deterministic=deterministic)
    return o

"""Input validation for every backend, done once at the Python boundary.

Every check here reads only ``.shape``, ``.dtype`` and ``.ndim`` (and the
array's module, to refuse mixing libraries), so the same functions validate
NumPy and CuPy arrays without touching their data; each error names the shapes
or values involved.  A successful check returns an :class:`AttentionSpec`, the
one description of the problem that the backends and the launchers read.
"""
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

__all__ = [
    "AttentionSpec", "check_attention_inputs", "check_backward_inputs",
    "check_positive_int", "parse_causal", "check_float_dtype", "SUPPORTED_DTYPES", "sum_to_shape",
    "check_softmax_input",
]

# dtype names accepted everywhere (bfloat16 is ml_dtypes.bfloat16 on NumPy)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")


class _LseDtype:
    """The ``lse_dtype`` of the validated specs: float64 for float64 inputs, float32 otherwise."""

    @property
    def lse_dtype(self):
        return np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)


@dataclass(frozen=True)
class AttentionSpec(_LseDtype):
    """What one attention call computes, after validation.

    ``lead`` is the output's leading shape (``o.shape == lead + (Nq, dv)``): the broadcast
    of q's leading dims (``q_lead``) and k/v's (``kv_lead``, k's and v's broadcast
    together), grouped heads counted as q's.  ``scale`` is resolved (``1/sqrt(d)`` for
    None), ``causal`` parsed (None: no mask), ``block_q``/``block_kv`` as requested (None:
    the backend chooses); ``group`` is the query heads per key/value head (1: not grouped).
    """
    lead: Tuple[int, ...]
    q_lead: Tuple[int, ...]
    kv_lead: Tuple[int, ...]
    Nq: int
    Nk: int
    d: int
    dv: int
    dtype: np.dtype
    scale: float
    causal: Optional[str]
    block_q: Optional[int]
    block_kv: Optional[int]
    group: int = 1

    @property
    def out_shape(self):
        """Shape of ``o`` (and of ``do``): ``lead + (Nq, dv)``."""
        return self.lead + (self.Nq, self.dv)

    @property
    def lse_shape(self):
        """Shape of ``lse``: ``lead + (Nq,)``."""
        return self.lead + (self.Nq,)

    @property
    def batch(self):
        """Number of independent (query head) problems: ``prod(lead)``."""
        return int(np.prod(self.lead, dtype=np.int64)) if self.lead else 1


def _library(a):
    return (type(a).__module__ or "").split(".")[0]


def _describe(name, a):
    return f"{name} (shape {tuple(a.shape)}, dtype {a.dtype})"


def check_float_dtype(dtype, name="input"):
    """Return ``numpy.dtype(dtype)`` if it is a supported float dtype, else TypeError."""
    dt = np.dtype(dtype)
    if dt.name in SUPPORTED_DTYPES:
        return dt
    kind = {"i": "an integer", "u": "an unsigned integer", "b": "a bool",
            "c": "a complex", "O": "an object"}.get(dt.kind, "an unsupported")
    raise TypeError(f"{name} has {kind} dtype {dt.name}; supported dtypes are "
                    f"{', '.join(SUPPORTED_DTYPES)}")


def _check_arrays(named):
    """Arrays exist, have >= 2 dims, one library and one supported dtype."""
    libs = set()
    for name, a in named:
        if not (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim")):
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, "
                            f"got {type(a).__module__}.{type(a).__name__}")
        libs.add(_library(a))
    if len(libs) > 1:
        raise TypeError(f"arrays of two libraries in one call: {sorted(libs)} ("
                        + ", ".join(f"{n}: {type(a).__module__}" for n, a in named) + ")")
    for name, a in named:
        check_float_dtype(a.dtype, f"{name} (shape {tuple(a.shape)})")
    dtypes = {np.dtype(a.dtype) for _, a in named}
    if len(dtypes) > 1:
        raise TypeError("all inputs must share one dtype, got "
                        + ", ".join(f"{n}: {np.dtype(a.dtype).name}" for n, a in named))
    for name, a in named:
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., N, d), got shape "
                             f"{tuple(a.shape)}")


def check_positive_int(value, name):
    """``value`` as an int when it is a positive integer, None when None.

    Raises
    ------
    ValueError
        For bools, non-integers (``32.0`` included), zero and negatives.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive int or None, got {value!r} "
                         f"({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


def check_softmax_input(x, chunk_size, one_d):
    """The checked ``chunk_size`` of an online softmax call, after checking ``x``: a float
    array, 1-D for ``online_softmax`` (``one_d``), at least 1-D for ``online_softmax_2d``."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"x must be a numpy.ndarray or cupy.ndarray, got "
                        f"{type(x).__module__}.{type(x).__name__}")
    check_float_dtype(x.dtype, f"x (shape {tuple(x.shape)})")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    if one_d and x.ndim != 1:
        raise ValueError(f"online_softmax takes a 1-D array, got shape {tuple(x.shape)}; "
                         "use online_softmax_2d for rows")
    if x.ndim < 1:
        raise ValueError(f"online_softmax_2d needs at least 1 dim, got shape {tuple(x.shape)}")
    return chunk_size


def parse_causal(causal):
    """Normalise ``causal`` to None, ``"bottom_right"`` or ``"top_left"``.

    ``False``/``None`` -> None (no mask); ``True`` -> ``"bottom_right"`` (the
    flash-attn >= 2.1 convention); the two strings pass through.  Anything else
    (ints included) is a ValueError listing the choices.
    """
    if causal is None or causal is False or (isinstance(causal, np.bool_) and not causal):
        return None
    if causal is True or (isinstance(causal, np.bool_) and causal):
        return "bottom_right"
    if isinstance(causal, str) and causal in ("bottom_right", "top_left"):
        return causal
    raise ValueError(f"unknown causal value {causal!r}; choose False, True (= 'bottom_right'), "
                     "'bottom_right' (query i sees key j iff j <= i + Nk - Nq) or "
                     "'top_left' (iff j <= i)")


def _broadcast(a, b):
    """np.broadcast_shapes, or None when the shapes do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(tuple(a), tuple(b)))
    except ValueError:
        return None


def sum_to_shape(a, shape):
    """Sum a broadcast result back to ``shape`` (the adjoint of broadcasting).

    Only array methods are used, so the reference, the CuPy backend and the
    kernel launchers call this same function on their arrays.
    """
    shape = tuple(shape)
    extra = a.ndim - len(shape)
    if extra:
        a = a.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and a.shape[i] != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return a.reshape(shape)


def _leading(q, k, v):
    """(lead, q_lead, kv_lead, group): broadcasting, and grouped-query heads when Hk divides H."""
    q_lead = tuple(q.shape[:-2])
    k_lead, v_lead = tuple(k.shape[:-2]), tuple(v.shape[:-2])
    kv_lead = _broadcast(k_lead, v_lead)
    if kv_lead is None:
        raise ValueError(f"leading dims of k {tuple(k.shape)} and v {tuple(v.shape)} "
                         "do not broadcast")
    group = 1
    if q.ndim >= 3 and len(kv_lead) >= 1:
        H, Hk = q_lead[-1], kv_lead[-1]
        # grouped-query attention: Hk divides H and is neither 1 (plain broadcast)
        # nor H (ordinary multi-head)
        if Hk not in (1, H) and Hk > 0 and H % Hk == 0:
            group = H // Hk
    if group > 1:
        rest = _broadcast(q_lead[:-1], kv_lead[:-1])
        if rest is None:
            raise ValueError(f"leading dims of q {tuple(q.shape)} and k/v "
                             f"{tuple(k.shape)}/{tuple(v.shape)} do not broadcast "
                             f"(heads are grouped {q_lead[-1]}/{kv_lead[-1]}, but the "
                             "dims before the heads do not broadcast)")
        lead = rest + (q_lead[-1],)
    else:
        lead = _broadcast(q_lead, kv_lead)
        if lead is None:
            raise ValueError(
                f"leading dims of q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)}"
                " are neither broadcastable nor grouped (grouped-query attention needs "
                "q.ndim >= 3 and k/v heads Hk = k.shape[-3] dividing q heads H = q.shape[-3])")
    return lead, q_lead, kv_lead, group


def check_scale(scale, d):
    """The softmax scale as a float: ``1/sqrt(d)`` for None; a finite real number otherwise (a
    NaN or infinite scale makes every logit NaN or infinite: refused, as a non-finite softcap is)."""
    if scale is None:
        # d == 0 makes every logit 0 whatever the scale; 1.0 avoids a division by zero
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return scale


def check_attention_inputs(q, k, v, *, scale=None, causal=False, block_q=None, block_kv=None):
    """Validate a forward call (arguments as :func:`cuflash.tiled_attention`'s) and describe
    it as an :class:`AttentionSpec`.

    Raises
    ------
    TypeError
        Non-array inputs, arrays of two libraries, unsupported or differing dtypes.
    ValueError
        Fewer than 2 dims, d or Nk mismatch, leading dims neither broadcastable
        nor grouped, bad tile sizes, unknown causal.
    """
    _check_arrays((("q", q), ("k", k), ("v", v)))
    Nq, d = int(q.shape[-2]), int(q.shape[-1])
    Nk, dk = int(k.shape[-2]), int(k.shape[-1])
    Nv, dv = int(v.shape[-2]), int(v.shape[-1])
    if dk != d:
        raise ValueError(f"head dim of q and k differ: q {tuple(q.shape)} has d={d}, "
                         f"k {tuple(k.shape)} has d={dk}")
    if Nv != Nk:
        raise ValueError(f"k and v must have the same number of keys: k {tuple(k.shape)} "
                         f"has Nk={Nk}, v {tuple(v.shape)} has {Nv}")
    lead, q_lead, kv_lead, group = _leading(q, k, v)
    causal = parse_causal(causal)
    block_q = check_positive_int(block_q, "block_q")
    block_kv = check_positive_int(block_kv, "block_kv")
    scale = check_scale(scale, d)
    return AttentionSpec(lead=lead, q_lead=q_lead, kv_lead=kv_lead, Nq=Nq, Nk=Nk, d=d, dv=dv,
                         dtype=np.dtype(q.dtype), scale=scale, causal=causal,
                         block_q=block_q, block_kv=block_kv, group=group)


def check_backward_inputs(do, q, k, v, o, lse, *, scale=None, causal=False, block_q=None,
                          block_kv=None, need_forward=True):
    """Validate a backward call: q, k, v as in the forward, plus do and o (the output's shape
    and q's dtype) and lse (``lead + (Nq,)``, any supported float dtype).

    ``need_forward`` False (``standard_attention_backward``, which recomputes P): o and lse
    are None.  Returns the :class:`AttentionSpec`.
    """
    if need_forward:
        for name, a in (("o", o), ("lse", lse)):
            if not (hasattr(a, "shape") and hasattr(a, "dtype")):
                raise TypeError(f"{name} must be the forward's {name} array "
                                "(o, lse = tiled_attention(q, k, v, return_lse=True)), got "
                                f"{type(a).__module__}.{type(a).__name__}")
    named = [("do", do), ("q", q), ("k", k), ("v", v)] + ([("o", o)] if o is not None else [])
    _check_arrays(named)
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                  block_kv=block_kv)
    want = spec.out_shape
    for name, a in (("do", do), ("o", o)):
        if a is not None and tuple(a.shape) != want:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {want} (the shape of "
                             f"the output for q {tuple(q.shape)}, k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)})")
    if lse is not None:
        if not (hasattr(lse, "shape") and hasattr(lse, "dtype")):
            raise TypeError(f"lse must be an array, got {type(lse).__name__}")
        if _library(lse) != _library(q):
            raise TypeError(f"arrays of two libraries in one call: lse is "
                            f"{type(lse).__module__}, q is {type(q).__module__}")
        check_float_dtype(lse.dtype, f"lse (shape {tuple(lse.shape)})")
        if tuple(lse.shape) != spec.lse_shape:
            raise ValueError(f"lse has shape {tuple(lse.shape)}, expected {spec.lse_shape} "
                             f"(leading dims + (Nq,) for q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)})")
    return spec

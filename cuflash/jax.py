"""cuflash inside JAX: differentiable exact attention (``jax.custom_vjp``).

``cuflash.jax.attention`` is a ``jax.custom_vjp`` function: the forward is
``cuflash.tiled_attention(..., return_lse=True)`` and keeps ``(q, k, v, o,
lse)`` as the residuals (P is never stored), the backward is
``cuflash.tiled_attention_backward`` from them.  Where it runs (docs/frameworks.md
has the details and the design):

* traced calls on one CUDA GPU run the kernels inside the compiled XLA program through
  ``jax.experimental.buffer_callback`` (XLA's buffers as CuPy arrays on XLA's stream;
  one device-to-device copy of the results into XLA's buffers).  Needs CuPy and a JAX
  with ``buffer_callback``; not yet run on a GPU;
* traced calls on the CPU -- and, with a ``RuntimeWarning``, on a GPU without CuPy or
  ``buffer_callback`` and on other accelerators -- go through ``jax.pure_callback`` to
  the NumPy backend on the host (``vmap_method="broadcast_all"``: unbatched inputs are
  broadcast, i.e. copied, to the batch);
* eager calls on one CUDA GPU (``jax.grad``/``jax.vjp`` without ``jit`` included) go
  through DLPack to CuPy and the ``"cuda"`` backend, buffers shared both ways, except
  bfloat16, which crosses as int16 bits (one device copy each way: CuPy reads no DLPack
  bfloat16).

Not supported: forward-mode AD (``jax.jvp``), higher-order derivatives.  float64 needs
``jax.config.update("jax_enable_x64", True)``.  ``jax`` here is the real JAX (absolute
imports), not this module.
"""
import functools
import warnings
from typing import NamedTuple, Optional, Union

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:  # jax absent (or blocked in sys.modules)
    raise ImportError("cuflash.jax needs JAX, which cannot be imported here "
                      f"({e}); install it with `pip install jax` or "
                      "`pip install \".[jax]\"` from a cuflash checkout") from e

import cuflash

from . import cuda_backend
from ._interop import (bfloat16_dtype, check_layout, from_bhnd, is_bfloat16, layout_error,
                       to_bhnd)
from ._validate import check_attention_inputs
from ._validate_masks import check_masks

__all__ = ["attention"]


class _Options(NamedTuple):
    """The static (non-differentiable, hashable) arguments of one call."""
    scale: Optional[float]
    causal: Union[bool, str]
    layout: str
    deterministic: bool
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    dropout_p: float = 0.0
    has_bias: bool = False
    has_slopes: bool = False


def attention(q, k, v, *, scale=None, causal=False, bias=None, window=None, alibi_slopes=None,
              softcap=None, dropout_p=0.0, seed=None, layout="bhnd", deterministic=False):
    """Exact attention ``softmax(mask(scale * q k^T + bias)) v``, differentiable in q, k, v, bias.

    Parameters
    ----------
    q : jax.Array, shape (B, H, Nq, d) ("bhnd") or (B, Nq, H, d) ("bnhd")
    k : jax.Array, shape (B, Hk, Nk, d) or (B, Nk, Hk, d)
    v : jax.Array, shape (B, Hk, Nk, dv) or (B, Nk, Hk, dv)
        One dtype (float16, bfloat16, float32, float64 with x64 enabled).
        Leading dims may be any number and broadcast as in cuflash; ``Hk``
        dividing ``H`` is grouped-query attention (query head h reads kv head
        ``h // (H // Hk)``).
    scale : float, optional
        Logit scale (a Python number: it is static); None means ``1/sqrt(d)``.
    causal : bool or {"bottom_right", "top_left"}
        ``True``/``"bottom_right"``: query i sees key j iff ``j <= i + Nk - Nq``
        (flash-attn); ``"top_left"``: iff ``j <= i``.  A row that sees no key
        gives 0 and zero gradients.
    bias : jax.Array, optional
        Added to the logits; broadcasts to ``(B, H, Nq, Nk)`` in either layout;
        differentiable (its cotangent is dS summed over its broadcast axes).
    window, softcap, dropout_p
        As in :func:`cuflash.tiled_attention` (static: Python values).
    alibi_slopes : jax.Array, shape (H,) or (B, H), optional
        ALiBi slopes (zero cotangent).
    seed : int or integer jax.Array, optional
        Key of the dropout mask, required with ``dropout_p > 0``: a Python int
        in [0, 2^64), or an integer array (traced: a new seed each step does
        not retrace); the backward regenerates the forward's mask.
    layout : {"bhnd", "bnhd"}
        Axis order of q, k, v, of the output and of the gradients.
    deterministic : bool
        Bitwise repeatable gradients on the GPU (the NumPy backend always is).

    Returns
    -------
    o : jax.Array, shape (B, H, Nq, dv) or (B, Nq, H, dv), dtype of q

    Raises
    ------
    TypeError, ValueError
        As ``cuflash.tiled_attention`` (unsupported dtypes, shapes that do not
        fit, unknown causal), plus ValueError for an unknown layout.  Raised
        when the call is traced, before anything runs.

    Notes
    -----
    Where the computation runs, what is copied and what is not supported
    (the GPU under ``jit``): see the module docstring.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
            raise TypeError(f"{name} must be a jax.Array, got "
                            f"{type(x).__module__}.{type(x).__name__}")
    check_layout(layout, q=q, k=k, v=v)
    window = None if window is None else tuple(window)
    opts = _Options(scale, causal, layout, bool(deterministic), window, softcap,
                    float(dropout_p), bias is not None, alibi_slopes is not None)
    _spec(opts, q, k, v)  # validate now: errors come before anything is traced or run
    if opts.window is not None or softcap is not None or dropout_p or bias is not None \
            or alibi_slopes is not None or seed is not None:
        _check_features(opts, q, k, v, bias, alibi_slopes, seed)
        return _attention_features(opts, q, k, v, _operand(bias, q), _operand(alibi_slopes, q),
                                   _seed_words(seed))
    return _attention(opts, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(opts, q, k, v):
    return _forward(opts, q, k, v)[0]


def _attention_fwd(opts, q, k, v):
    o, lse = _forward(opts, q, k, v)
    # lse is a residual: the backward recomputes P from it instead of redoing the forward
    return o, (q, k, v, o, lse)


def _attention_bwd(opts, residuals, do):
    q, k, v, o, lse = residuals
    return tuple(_backward(opts, do, q, k, v, o, lse))


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------
# the logit features: bias (differentiable), ALiBi slopes and the dropout seed as operands
# ---------------------------------------------------------------------------
def _operand(x, like):
    """A feature array, or a 1-element placeholder (custom_vjp operands must be arrays)."""
    return jnp.zeros((1,), like.dtype) if x is None else x


def _seed_words(seed):
    """The seed as a uint32 array [lo, hi] (traced seeds: 32 bits, hi = 0)."""
    if seed is None:
        return jnp.zeros((2,), jnp.uint32)
    if isinstance(seed, int):
        return jnp.asarray(np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32))
    s = jnp.asarray(seed).astype(jnp.uint32).reshape(())
    return jnp.stack([s, jnp.zeros((), jnp.uint32)])


def _check_features(opts, q, k, v, bias, slopes, seed):
    """cuflash's checks of the features, from shapes only (traced arrays are fine)."""
    spec = _spec(opts, q, k, v)
    fake = {}
    for name, x in (("bias", bias), ("alibi_slopes", slopes)):
        if x is not None:
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"{name} must be a jax.Array, got {type(x).__name__}")
            fake[name] = _ShapeOnly(x.shape, x.dtype)
    check_masks(spec, _ShapeOnly(q.shape, q.dtype), window=opts.window, softcap=opts.softcap,
                dropout_p=opts.dropout_p, seed=0 if seed is not None else None, **fake)
    if isinstance(seed, int):
        check_masks(spec, _ShapeOnly(q.shape, q.dtype), dropout_p=opts.dropout_p, seed=seed)


class _ShapeOnly:
    """Shape and dtype (what the feature checks read) of a possibly traced array."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), np.dtype(dtype), len(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_features(opts, q, k, v, bias, slopes, seed):
    return _forward(opts, q, k, v, bias, slopes, seed)[0]


def _attention_features_fwd(opts, q, k, v, bias, slopes, seed):
    o, lse = _forward(opts, q, k, v, bias, slopes, seed)
    return o, (q, k, v, o, lse, bias, slopes, seed)


def _attention_features_bwd(opts, residuals, do):
    q, k, v, o, lse, bias, slopes, seed = residuals
    grads = tuple(_backward(opts, do, q, k, v, o, lse, bias, slopes, seed))
    dbias = grads[3] if opts.has_bias else jnp.zeros_like(bias)
    return grads[:3] + (dbias, jnp.zeros_like(slopes),
                        np.zeros(seed.shape, dtype=jax.dtypes.float0))


_attention_features.defvjp(_attention_features_fwd, _attention_features_bwd)


# ---------------------------------------------------------------------------
# dispatch: eager GPU arrays to CuPy, everything else through pure_callback
# ---------------------------------------------------------------------------
def _forward(opts, q, k, v, *features):
    """(o, lse): o in the caller's layout, lse of shape lead + (Nq,).

    ``features``: (bias, slopes, seed words) operands of a call with features.
    """
    device = _eager_gpu_device(q, k, v, *features)
    if device is not None:
        return _on_cupy(device, functools.partial(_run_forward, opts, "cuda"), q, k, v,
                        *features)
    spec = _spec(opts, q, k, v)
    o_shape = _caller_shape(spec.out_shape, opts.layout)
    result = (jax.ShapeDtypeStruct(o_shape, q.dtype),
              jax.ShapeDtypeStruct(spec.lse_shape, spec.lse_dtype))
    return _traced(_run_forward, opts, result, q, k, v, *features)


def _backward(opts, do, q, k, v, o, lse, *features):
    """(dq, dk, dv[, dbias]) in the shapes and layout of q, k, v (and the bias's)."""
    device = _eager_gpu_device(do, q, k, v, o, lse, *features)
    if device is not None:
        return _on_cupy(device, functools.partial(_run_backward, opts, "cuda"),
                        do, q, k, v, o, lse, *features)
    shapes = (q, k, v) + ((features[0],) if features and opts.has_bias else ())
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in shapes)
    return _traced(_run_backward, opts, result, do, q, k, v, o, lse, *features)


def _traced(fn, opts, result, *operands):
    """A traced call: the kernels through buffer_callback on a GPU, else NumPy on the host."""
    if _device_path(jax.default_backend()):
        return tuple(_buffer_callback()(_on_buffers(fn, opts), result,
                                        vmap_method="broadcast_all")(*operands))
    _warn_if_host_round_trip()
    return jax.pure_callback(_on_host(fn, opts), result, *operands,
                             vmap_method="broadcast_all")


def _device_path(platform):
    """Whether traced calls on ``platform`` run the kernels inside XLA (buffer_callback)."""
    return platform == "gpu" and _buffer_callback() is not None and _cuda_backend_available()


@functools.lru_cache(maxsize=None)
def _buffer_callback():
    """``jax.experimental.buffer_callback.buffer_callback``, or None in JAX versions without it."""
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        return None
    return buffer_callback


def _on_buffers(fn, opts):
    """The buffer_callback body: ``fn`` on views of XLA's buffers, results copied into XLA's
    output buffers.  On a GPU the views are CuPy arrays and the kernels run on XLA's stream;
    on the CPU (where XLA has no stream) NumPy arrays and the NumPy backend."""
    def callback(ctx, outs, *buffers):
        try:
            stream = ctx.stream
        except jax.errors.JaxRuntimeError:   # the CPU: XLA has no GPU context there
            stream = None
        if stream is None:
            results = fn(opts, "numpy", *(np.asarray(b) for b in buffers))
            for out, r in zip(outs, results):
                np.asarray(out)[...] = r
            return
        import cupy  # optional (the cuda extras): only the GPU path needs it
        views = [_cupy_view(b) for b in buffers]
        with cupy.cuda.Device(views[0].device.id), cupy.cuda.ExternalStream(int(stream)):
            results = fn(opts, "cuda", *views)
            for out, r in zip(outs, results):
                _cupy_view(out)[...] = r
    return callback


def _cupy_view(buffer):
    """A CuPy array on the memory of a buffer_callback GPU buffer (no copy; any dtype, as the
    buffer's own dtype is used rather than the interface's type string)."""
    import cupy  # optional (the cuda extras): only the GPU path needs it
    iface = buffer.__cuda_array_interface__
    ptr, shape, dtype = iface["data"][0], tuple(buffer.shape), np.dtype(buffer.dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    device = cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr else 0
    memory = cupy.cuda.UnownedMemory(ptr, size, buffer, device_id=device)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0),
                        strides=iface.get("strides"))


def _on_host(fn, opts):
    """The pure_callback body: ``fn`` on NumPy views of the host buffers JAX passes."""
    def callback(*arrays):
        # np.asarray of a CPU jax.Array shares its buffer (no copy)
        return fn(opts, "numpy", *(np.asarray(a) for a in arrays))
    return callback


def _feature_kwargs(opts, features):
    """cuflash keywords of the features: (bias, slopes, seed words) operands and the options."""
    if not features:
        return {}
    bias, slopes, seed = features
    kw = dict(window=opts.window, softcap=opts.softcap, dropout_p=opts.dropout_p)
    if opts.has_bias:
        kw["bias"] = bias
    if opts.has_slopes:
        kw["alibi_slopes"] = slopes
    if opts.dropout_p:
        words = [int(w) for w in np.asarray(seed.get() if hasattr(seed, "get") else seed)]
        kw["seed"] = words[0] | (words[1] << 32)
    return kw


def _run_forward(opts, backend, q, k, v, *features):
    """The forward on NumPy or CuPy arrays in the caller's layout."""
    bhnd = [to_bhnd(x, opts.layout) for x in (q, k, v)]
    o, lse = cuflash.tiled_attention(*bhnd, scale=opts.scale, causal=opts.causal,
                                     return_lse=True, backend=backend,
                                     **_feature_kwargs(opts, features))
    return from_bhnd(o, opts.layout), lse


def _run_backward(opts, backend, do, q, k, v, o, lse, *features):
    """The backward on NumPy or CuPy arrays in the caller's layout."""
    arrays = [to_bhnd(x, opts.layout) for x in (do, q, k, v, o)]
    kw = _feature_kwargs(opts, features)
    if opts.has_bias:
        kw["return_dbias"] = True
    grads = cuflash.tiled_attention_backward(*arrays, lse, scale=opts.scale,
                                             causal=opts.causal,
                                             deterministic=opts.deterministic,
                                             backend=backend, **kw)
    return tuple(from_bhnd(g, opts.layout) for g in grads[:3]) + tuple(grads[3:])


def _spec(opts, q, k, v):
    """cuflash's validation of the call, from shapes and dtypes only (tracers are fine)."""
    shapes = [jax.ShapeDtypeStruct(to_bhnd(_Shape(x.shape), opts.layout).shape, x.dtype)
              for x in (q, k, v)]
    try:
        return check_attention_inputs(*shapes, scale=opts.scale, causal=opts.causal)
    except ValueError as e:
        raise layout_error(e, opts.layout) from e


class _Shape:
    """Just a shape, with the ``swapaxes`` that :func:`to_bhnd` applies."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def swapaxes(self, a, b):
        s = list(self.shape)
        s[a], s[b] = s[b], s[a]
        return _Shape(s)


def _caller_shape(bhnd_shape, layout):
    return to_bhnd(_Shape(bhnd_shape), layout).shape


_WARNED = set()


def _warn_if_host_round_trip():
    """Warn once per platform when a traced call will run on the host of a GPU/TPU."""
    platform = jax.default_backend()
    if platform != "cpu" and platform not in _WARNED:
        _WARNED.add(platform)
        why = ("CuPy is not usable here" if platform == "gpu" and not _cuda_backend_available()
               else "this JAX has no jax.experimental.buffer_callback"
               if platform == "gpu" else "cuflash's kernels run on CUDA GPUs only")
        warnings.warn(
            f"cuflash.jax: a traced call (jit/vmap) on the {platform!r} backend runs through "
            "jax.pure_callback on the host with the NumPy backend (inputs and results are "
            f"copied between device and host): {why}.", RuntimeWarning, stacklevel=5)


# ---------------------------------------------------------------------------
# the eager GPU path: DLPack between JAX and CuPy
# ---------------------------------------------------------------------------
def _eager_gpu_device(*arrays):
    """The one CUDA device of concrete (untraced) arrays, or None to use pure_callback."""
    if any(isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array) for a in arrays):
        return None
    devices = {d for a in arrays for d in a.devices()}
    if len(devices) != 1:
        return None
    device = devices.pop()
    return device if device.platform == "gpu" and _cuda_backend_available() else None


@functools.lru_cache(maxsize=None)
def _cuda_backend_available():
    return cuda_backend.is_available()[0]


def _on_cupy(device, fn, *arrays):
    """``fn`` on CuPy views of ``arrays``; its results back as JAX arrays (no host copy)."""
    import cupy  # optional (the cuda extras): only a call on a GPU device needs it
    with cupy.cuda.Device(getattr(device, "local_hardware_id", device.id)):
        outs = fn(*(_jax_to_cupy(a) for a in arrays))
        return tuple(_cupy_to_jax(x) for x in outs)


def _jax_to_cupy(a):
    import cupy  # optional (the cuda extras): only a call on a GPU device needs it
    if is_bfloat16(a.dtype):
        return cupy.from_dlpack(jax.lax.bitcast_convert_type(a, jnp.int16)).view(
            bfloat16_dtype())
    return cupy.from_dlpack(a)


def _cupy_to_jax(x):
    if is_bfloat16(x.dtype):
        return jax.lax.bitcast_convert_type(jnp.from_dlpack(x.view(np.int16)), jnp.bfloat16)
    return jnp.from_dlpack(x)

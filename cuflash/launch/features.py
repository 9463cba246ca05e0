"""The logit features of a call as one value, and what a kernel launch makes of them.

The features -- bias (and its gradient), sliding window, ALiBi, softcap and
Philox dropout -- travel from a backend to a launcher as one :class:`Features`
value; a plain call has none (``None``) and pays nothing for them.  A launcher
validates it once per kind of call (:func:`validate`) and a :class:`Prepared`
turns the resulting MaskSpec into what its kernels need: the ``mask_*`` fields
of the parameter block (from shapes, strides and dtypes alone), the bias and
slope arguments in the compute type, read with stride 0 along broadcast axes
(never expanded; copied over the batch axes only where one batch stride cannot
walk them), one parameter block per recent dropout seed (a new seed each step
costs a small copy, not a new plan) and the dbias accumulator, O(size of bias).

Each kernel family compiles its features variant with ``-DCUFLASH_MASKS``
(:data:`DEFINES`); the variants take the bias and slopes after their plain
arguments, the dK/dV kernels the dbias accumulator after those.
"""
from typing import NamedTuple

from .. import tiling
from .._validate import sum_to_shape
from .._validate_masks import (Extent, check_dropout, check_masks, check_serving_masks,
                               mask_key)
from .common import (acc_dtype, collapse_strides, elem_strides, make_params, pointer_arg,
                     record_copy)

__all__ = ["Features", "of", "validate", "validate_serving", "cache_key", "serving_key",
           "prepared_key", "check_cached_seed", "Prepared", "DEFINES", "lean_build"]

DEFINES = {"CUFLASH_MASKS": None}
_SEED_BLOCKS = 16          # parameter blocks kept per prepared call (one per recent seed)


class Features(NamedTuple):
    """The logit features of one call as given (validated by :func:`validate`)."""
    bias: object = None
    window: object = None
    alibi_slopes: object = None
    softcap: object = None
    dropout_p: object = 0.0
    seed: object = None


def of(bias=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=None):
    """The features a call names as one value; None when it names none (a plain call)."""
    if (bias is None and window is None and alibi_slopes is None and softcap is None
            and seed is None and type(dropout_p) in (float, int) and dropout_p == 0):
        return None
    return Features(bias, window, alibi_slopes, softcap, dropout_p, seed)


def lean_build(ms):
    """The tensor-core backward's lean build for a call's logit features, or None (its
    flash_bwd_tc_masked): ``flash_bwd_tc_band`` where the only feature is the band (a window,
    with or without causal), ``flash_bwd_tc_softcap`` where they are a softcap and at most the
    band, ``flash_bwd_tc_alibi`` where they are ALiBi and at most the band,
    ``flash_bwd_tc_dropout`` where they are dropout and at most the band,
    ``flash_bwd_tc_alibi_dropout`` where they are ALiBi, dropout and at most the band,
    ``flash_bwd_tc_alibi_softcap`` where they are ALiBi, a softcap and at most the band."""
    if ms is None or ms.bias is not None or ms.return_dbias:
        return None
    alibi = ms.alibi_slopes is not None
    if ms.dropout:
        return None if ms.softcap else (tiling.BWD_ALIBI_DROPOUT_KERNEL if alibi
                                        else tiling.BWD_DROPOUT_KERNEL)
    if ms.softcap and alibi:
        return tiling.BWD_ALIBI_SOFTCAP_KERNEL
    if ms.softcap or alibi:
        return tiling.BWD_ALIBI_KERNEL if alibi else tiling.BWD_SOFTCAP_KERNEL
    return tiling.BWD_BAND_KERNEL if ms.window is not None else None


def validate(spec, q, features, return_dbias=False):
    """The MaskSpec of a call's features; None when there is nothing for the kernels to do."""
    if features is None and not return_dbias:
        return None
    return check_masks(spec, q, **(features or Features())._asdict(), return_dbias=return_dbias)


def validate_serving(q, B, H, Nq, Nk, features, return_dbias=False):
    """:func:`validate` for a varlen or KV-cache call (``Nq``/``Nk``: the longest sequences)."""
    if features is None and not return_dbias:
        return None
    return check_serving_masks(q, B, H, Nq, Nk, return_dbias=return_dbias,
                               **(features or Features())._asdict())


def _arr_key(a):
    return None if a is None else (a.__class__, tuple(a.shape), tuple(a.strides), str(a.dtype))


def cache_key(features):
    """The features' part of a dense call's cache key (None for a plain call).

    Shapes, strides, dtypes and scalars; the seed's value is left out (each
    prepared call keeps a parameter block per seed, :class:`Prepared`).
    """
    if features is None:
        return None
    f = features
    return (_arr_key(f.bias), _arr_key(f.alibi_slopes), repr(f.window), f.softcap.__class__,
            f.softcap, f.dropout_p.__class__, f.dropout_p, f.seed is None)


def serving_key(features):
    """The features' part of a serving call's cache key, the seed included (None: plain)."""
    if features is None:
        return None
    return cache_key(features)[:-1] + (features.seed.__class__, features.seed)


def prepared_key(ms):
    """What a prepared call depends on in a MaskSpec (None: plain), the seed's value left out."""
    if ms is None:
        return None
    return (mask_key(ms, with_seed=False), ms.offset, ms.dropout_batch)


def check_cached_seed(features):
    """A cached call's key leaves the seed's value out: it is still validated on every call."""
    if features is not None and features.dropout_p and features.seed is not None:
        check_dropout(0.5, features.seed)


def _operand(runtime, x, lead, trailing, acc, what):
    """``x`` (broadcastable to ``lead`` + ``trailing`` dims) as the kernels read it.

    Returns ``(array, strides)``: the array in the compute dtype (converted
    only when its dtype differs) and its element strides for (batch, head,
    *trailing) with 0 along broadcast axes; a copy only for negative strides on
    the emulator, or a batch layout that one stride cannot walk.
    """
    xp = runtime.xp
    if x.dtype != acc:
        x = x.astype(acc)
        record_copy(f"{what} in the compute dtype", x)
    nl = len(lead)
    x = x.reshape((1,) * (nl + trailing - x.ndim) + tuple(x.shape))
    es = elem_strides(x)
    if es is None or (runtime.name == "emulator" and any(s < 0 for s in x.strides)):
        x = xp.ascontiguousarray(x)
        record_copy(f"contiguous {what}", x)
        es = elem_strides(x)
    st = [0 if n == 1 else s for n, s in zip(x.shape, es)]
    tail = st[nl:]
    if nl == 0:
        return x, (0, 0) + tuple(tail)
    sh = st[nl - 1]
    sb = collapse_strides(lead[:-1], st[:nl - 1])
    if sb is None:   # no single batch stride: materialise over the batch axes only
        full = tuple(lead[:-1]) + tuple(x.shape[nl - 1:])
        x = xp.ascontiguousarray(xp.broadcast_to(x, full))
        record_copy(f"{what} broadcast over the batch", x)
        es = elem_strides(x)
        st = [0 if n == 1 else s for n, s in zip(x.shape, es)]
        sh, tail = st[nl - 1], st[nl:]
        sb = collapse_strides(lead[:-1], st[:nl - 1])
    return x, (int(sb), int(sh)) + tuple(int(s) for s in tail)


def _mask_fields(spec, ms, bias_strides, slope_strides):
    """The ``mask_*`` fields of a parameter block for this call."""
    f = dict(mask_offset=spec.Nk - spec.Nq, mask_softcap=ms.softcap or 0.0,
             mask_drop_b0=ms.dropout_batch)
    if bias_strides is not None:
        f.update(mask_has_bias=1, mask_bias_sb=bias_strides[0], mask_bias_sh=bias_strides[1],
                 mask_bias_sr=bias_strides[2], mask_bias_sc=bias_strides[3])
    if slope_strides is not None:
        f.update(mask_has_alibi=1, mask_alibi_sb=slope_strides[0],
                 mask_alibi_sh=slope_strides[1])
    if ms.window is not None:
        # a width of Nq + Nk reaches every key from every query: wider ones are clamped to it,
        # so any Python int fits the block's 32-bit fields
        reach = spec.Nq + spec.Nk
        left, right = ms.window
        f.update(mask_window=(1 if left >= 0 else 0) | (2 if right >= 0 else 0),
                 mask_window_left=min(max(left, 0), reach),
                 mask_window_right=min(max(right, 0), reach))
    if ms.dropout:
        f.update(mask_dropout=1, mask_seed_lo=ms.seed & 0xFFFFFFFF, mask_seed_hi=ms.seed >> 32,
                 mask_drop_threshold=ms.drop_threshold, mask_drop_scale=ms.drop_scale)
    return f


def _strides_of(shape):
    st, n = [], 1
    for size in reversed(shape):
        st.append(0 if size == 1 else n)
        n *= size
    return list(reversed(st))


def _dbias_target(spec, ms):
    """The dbias accumulator of a call: (shape, strides, mode, summed), from shapes alone.

    The accumulator is a C-contiguous array of the bias's shape (leading 1s
    added up to the logits' rank), walked by the kernel with element strides
    that are 0 along broadcast axes.  ``mode`` 1: every element has one writer
    (a bias of the logits' full shape); 2: atomic adds.  ``summed``: the batch
    axes could not be walked with one stride, so the accumulator spans them
    (shape ``lead[:-1]`` + the bias's other axes) and is summed to the bias's
    shape afterwards.
    """
    lead = tuple(spec.lead)
    nl = len(lead)
    full = lead + (spec.Nq, spec.Nk)
    shape = (1,) * (len(full) - len(ms.bias_shape)) + tuple(ms.bias_shape)
    mode = 1 if shape == full else 2
    st = _strides_of(shape)
    if nl == 0:
        return shape, (0, 0, st[-2], st[-1]), mode, False
    sb = collapse_strides(lead[:-1], st[:nl - 1])
    summed = sb is None
    if summed:
        shape = lead[:-1] + shape[nl - 1:]
        st = _strides_of(shape)
        sb = collapse_strides(lead[:-1], st[:nl - 1])
    return shape, (int(sb), int(st[nl - 1]), int(st[-2]), int(st[-1])), mode, summed


class Prepared:
    """A call's features as its launches need them; ``ms`` None (a plain call) adds nothing.

    ``spec`` gives ``lead``, ``Nq`` and ``Nk`` (an AttentionSpec, or an
    :class:`cuflash._validate_masks.Extent` for the serving calls); ``acc`` is
    the compute dtype.  At call time ``f`` is whatever carries the call's
    feature arrays and seed (``.bias``, ``.alibi_slopes``, ``.seed``): the
    :class:`Features` given, or the MaskSpec itself.
    """

    def __init__(self, runtime, spec, ms, acc):
        self.runtime, self.spec, self.ms, self.acc = runtime, spec, ms, acc
        self.fields = {}
        self.want_dbias = ms is not None and ms.return_dbias
        if ms is None:
            return
        lead = spec.lead
        bs = None if ms.bias is None else _operand(runtime, ms.bias, lead, 2, acc, "bias")[1]
        ss = None if ms.alibi_slopes is None else \
            _operand(runtime, ms.alibi_slopes, lead, 0, acc, "alibi_slopes")[1]
        self.fields = _mask_fields(spec, ms, bs, ss)
        if self.want_dbias:
            shape, st, mode, summed = _dbias_target(spec, ms)
            self.dbias_shape, self.dbias_summed = shape, summed
            self.fields.update(mask_dbias=mode, mask_dbias_sb=st[0], mask_dbias_sh=st[1],
                               mask_dbias_sr=st[2], mask_dbias_sc=st[3])

    def params(self, struct, fields):
        """``block(f)``: the ``struct`` block of ``fields`` plus the features' fields.

        One block, packed now -- or, with dropout, one per seed of the most
        recent ``_SEED_BLOCKS``, packed on a seed's first call.
        """
        fields = dict(fields, **self.fields)
        if self.ms is None or not self.ms.dropout:
            blk = make_params(self.runtime, struct, **fields)
            return lambda f: blk
        blocks = {}

        def block(f):
            seed = f.seed
            blk = blocks.get(seed)
            if blk is None:
                blk = make_params(self.runtime, struct, **dict(
                    fields, mask_seed_lo=seed & 0xFFFFFFFF, mask_seed_hi=seed >> 32))
                if len(blocks) >= _SEED_BLOCKS:
                    blocks.pop(next(iter(blocks)))
                blocks[seed] = blk
            return blk
        return block

    def _dummy(self):
        """A 1-element array standing in for a feature tensor the call does not have."""
        cache = self.runtime.__dict__.setdefault("_mask_dummies", {})
        d = cache.get(self.acc)
        if d is None:
            d = cache[self.acc] = self.runtime.xp.zeros(1, self.acc)
        return d

    def args(self, f):
        """The (bias, slopes) kernel arguments of one call (dummies where it has none); ``()``
        for a plain call."""
        if self.ms is None:
            return ()
        runtime, lead = self.runtime, self.spec.lead
        b = s = self._dummy()
        if f.bias is not None:
            b = _operand(runtime, f.bias, lead, 2, self.acc, "bias")[0]
        if f.alibi_slopes is not None:
            s = _operand(runtime, f.alibi_slopes, lead, 0, self.acc, "alibi_slopes")[0]
        if runtime.name == "emulator":
            b, s = pointer_arg(runtime, b), pointer_arg(runtime, s)
        return b, s

    def dbias_args(self):
        """The dK/dV kernels' trailing argument: ``(accumulator,)`` -- zeroed, or a dummy
        without ``return_dbias`` -- and ``()`` for a plain call."""
        if self.ms is None:
            return ()
        if self.want_dbias:
            return (self.runtime.xp.zeros(self.dbias_shape, self.acc),)
        return (self._dummy(),)

    def dbias_result(self, extra):
        """``(dbias,)`` from :meth:`dbias_args`'s accumulator, in the bias's shape and dtype;
        ``()`` without ``return_dbias``."""
        if not self.want_dbias:
            return ()
        db, ms = extra[0], self.ms
        if self.dbias_summed:
            db = sum_to_shape(db, ms.bias_shape)
        return (self.runtime.xp.ascontiguousarray(db.reshape(ms.bias_shape).astype(ms.bias.dtype)),)


def prepare_serving(runtime, q, B, H, Nq, Nk, dtype, features, pack=1):
    """The :class:`Prepared` features of a varlen or KV-cache call (``ms`` None: plain).

    ``Nq``/``Nk`` are the longest query / key sequence (the bias's extent);
    ``pack`` the query heads packed into one problem (grouped-query decoding).
    """
    ms = validate_serving(q, B, H, Nq, Nk, features)
    p = Prepared(runtime, Extent((B, H), Nq, Nk), ms, acc_dtype(dtype))
    if ms is not None:
        p.fields["mask_pack"] = pack if pack > 1 else 0
    return p

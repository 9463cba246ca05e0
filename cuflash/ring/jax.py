"""Context-parallel attention in JAX: ``shard_map`` and ``lax.ppermute`` over a mesh axis.

Two entry points:

* :func:`ring_attention` takes global arrays whose sequence axis is laid out as
  :func:`shard` lays it out (zigzag order by default) and runs the ring under
  ``jax.shard_map`` over ``axis_name`` of ``mesh``: each device gets one contiguous
  shard of that axis.
* :func:`ring_attention_shard` is the per-device function, for use inside a
  ``shard_map`` of your own (the sequence axis sharded over ``axis_name``).

The ring (docs/context_parallel.md) is a ``jax.custom_vjp`` function.  A device's
position in the ring is traced (``lax.axis_index``), so each step is a ``lax.switch`` over
the ranks, each branch with the calls (masks) of its rank.  Whether a transfer overlaps a
step's compute is up to XLA's scheduler (the step does not read the block in flight).

The cuflash calls are :mod:`cuflash.jax`'s: ``pure_callback`` to the NumPy backend on the
CPU, ``buffer_callback`` to the kernels on a GPU (see that module for what runs where).
"""
import functools
from typing import NamedTuple, Optional

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec
except ImportError as e:  # jax absent (or blocked in sys.modules)
    raise ImportError("cuflash.ring.jax needs JAX, which cannot be imported here "
                      f"({e}); install it with `pip install jax` or "
                      "`pip install \".[jax]\"` from a cuflash checkout") from e

from .. import jax as cfjax
from .._interop import check_layout
from ._plan import check_call, chunks_of, shard_slices, step_calls

__all__ = ["ring_attention", "ring_attention_shard", "shard", "unshard"]


class _Config(NamedTuple):
    axis_name: object
    world: int
    sharding: str
    scale: Optional[float]
    causal: bool
    window: Optional[tuple]
    softcap: Optional[float]
    has_bias: bool
    bias_rows: bool


def ring_attention(q, k, v, *, mesh, axis_name, sharding="zigzag", scale=None, causal=False,
                   bias=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                   layout="bhnd", return_lse=False):
    """Exact attention of the full sequence, computed as a ring over ``mesh[axis_name]``.

    Parameters
    ----------
    q, k, v : jax.Array
        The whole sequence, ``(B, H, N, d)`` ("bhnd") or ``(B, N, H, d)`` ("bnhd"), its
        sequence axis in :func:`shard`'s order (``shard(x, world, axis=...)`` of the
        natural order); ``N`` a multiple of ``2 * world`` (zigzag) or ``world``.
        Self-attention: q, k, v of one length.  GQA as in :func:`cuflash.jax.attention`.
    mesh : jax.sharding.Mesh
    axis_name : str
        The mesh axis the sequence is sharded over (the ring's devices).
    bias : jax.Array, optional
        ``(..., N, N)`` with rows in :func:`shard`'s order and columns in natural order
        (sharded by rows), or ``(..., 1, N)`` (replicated); differentiable.
    scale, causal, window, softcap, layout, sharding, return_lse
        As in :func:`cuflash.ring.torch.ring_attention`.
    alibi_slopes, dropout_p
        Refused (ValueError), for the reasons the error gives.

    Returns
    -------
    o (and lse with ``return_lse``), in the same sequence order as q.  ``lse`` carries no
    gradient (``stop_gradient``), as in FlashAttention-2.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh "
                         f"(axes {tuple(mesh.shape)})")
    check_layout(layout, q=q, k=k, v=v)
    world = mesh.shape[axis_name]
    seq = q.ndim - 2 if layout == "bhnd" else q.ndim - 3
    N = q.shape[seq]
    shard_slices(N, world, 0, sharding)  # ValueError when N does not split evenly
    spec = [None] * q.ndim
    spec[seq] = axis_name
    qspec = PartitionSpec(*spec)
    bspec = PartitionSpec()
    if bias is not None:
        if bias.ndim < 2 or bias.shape[-1] != N or bias.shape[-2] not in (1, N):
            raise ValueError(f"bias must have shape (..., {N}, {N}) (rows sharded) or "
                             f"(..., 1, {N}), got {tuple(bias.shape)}")
        if bias.shape[-2] == N:
            bspec = PartitionSpec(*([None] * (bias.ndim - 2) + [axis_name, None]))
    lse_spec = PartitionSpec(*([None] * (q.ndim - 2) + [axis_name]))
    body = functools.partial(
        ring_attention_shard, axis_name=axis_name, sharding=sharding, scale=scale,
        causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
        dropout_p=dropout_p, layout=layout, return_lse=True)
    if bias is None:
        fn = jax.shard_map(lambda a, b, c: body(a, b, c), mesh=mesh,
                           in_specs=(qspec,) * 3, out_specs=(qspec, lse_spec), check_vma=False)
        o, lse = fn(q, k, v)
    else:
        fn = jax.shard_map(lambda a, b, c, x: body(a, b, c, bias=x), mesh=mesh,
                           in_specs=(qspec,) * 3 + (bspec,), out_specs=(qspec, lse_spec),
                           check_vma=False)
        o, lse = fn(q, k, v, bias)
    return (o, lse) if return_lse else o


def ring_attention_shard(q, k, v, *, axis_name, sharding="zigzag", scale=None, causal=False,
                         bias=None, window=None, alibi_slopes=None, softcap=None,
                         dropout_p=0.0, layout="bhnd", return_lse=False):
    """The per-device ring, inside ``shard_map``: q, k, v are this device's shards
    (:func:`shard`'s layout); ``bias`` its rows ``(..., n, N)`` or ``(..., 1, N)``."""
    world = jax.lax.axis_size(axis_name)   # static inside shard_map
    seq = q.ndim - 2 if layout == "bhnd" else q.ndim - 3
    n, causal, window, softcap = check_call(
        q, k, v, layout, seq, causal, window, softcap, sharding, alibi_slopes, dropout_p, world,
        None if bias is None else bias.shape)
    cfg = _Config(axis_name, int(world), sharding, None if scale is None else float(scale),
                  causal, window, softcap, bias is not None,
                  bias is not None and bias.shape[-2] != 1)
    swap = (lambda x: jnp.swapaxes(x, -3, -2)) if layout == "bnhd" else (lambda x: x)
    qb, kb, vb = swap(q), swap(k), swap(v)
    _block_opts(cfg, qb, kb, vb)    # cuflash's own checks, before anything is traced
    bias_op = bias if bias is not None else jnp.zeros((1,), q.dtype)
    o, lse = _ring(cfg, qb, kb, vb, bias_op)
    # lse carries no gradient (the backward ignores its cotangent): say so to autodiff
    return (swap(o), jax.lax.stop_gradient(lse)) if return_lse else swap(o)


# ---------------------------------------------------------------------------
# sharding helpers (global arrays)
# ---------------------------------------------------------------------------
def _order(n, world, sharding):
    """Global positions in the order of the ranks' shards, concatenated."""
    return np.concatenate([np.arange(g, g + length) for r in range(world)
                           for g, length in shard_slices(n, world, r, sharding)])


def shard(x, world, *, axis, sharding="zigzag"):
    """``x`` with its ``axis`` reordered so that cutting it into ``world`` contiguous pieces
    gives each device its shard (for ``"contiguous"`` the order is unchanged)."""
    return jnp.take(x, _order(x.shape[axis], world, sharding), axis=axis)


def unshard(x, world, *, axis, sharding="zigzag"):
    """The inverse of :func:`shard`: natural order back."""
    return jnp.take(x, np.argsort(_order(x.shape[axis], world, sharding)), axis=axis)


# ---------------------------------------------------------------------------
# the ring (bhnd inside)
# ---------------------------------------------------------------------------
def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _block_opts(cfg, q, k, v, call=None):
    """cuflash.jax's options of one call (validated against the shapes on the full block)."""
    opts = cfjax._Options(cfg.scale, bool(call.causal) if call else False, "bhnd", False,
                          call.window if call else None, cfg.softcap, 0.0, cfg.has_bias, False)
    cfjax._spec(opts, q, k, v)
    return opts


def _calls(cfg, rank, step, n):
    src = (rank - step) % cfg.world
    calls = step_calls(chunks_of(rank, cfg.world, n, cfg.sharding),
                       chunks_of(src, cfg.world, n, cfg.sharding), cfg.causal, cfg.window)
    cols = np.concatenate([np.arange(g, g + length) for _, g, length in
                           chunks_of(src, cfg.world, n, cfg.sharding)])
    return calls, cols


def _features(cfg, bias, call, cols):
    if cfg.has_bias:
        rows = slice(call.r0, call.r1) if cfg.bias_rows else slice(None)
        b = jnp.take(bias[..., rows, :], cols[call.c0:call.c1], axis=-1)
    else:
        b = jnp.zeros((1,), bias.dtype)
    return b, jnp.zeros((1,), bias.dtype), jnp.zeros((2,), jnp.uint32)


def _shift(cfg, tree):
    perm = [(i, (i + 1) % cfg.world) for i in range(cfg.world)]
    return jax.lax.ppermute(tree, cfg.axis_name, perm)


def _rank(cfg):
    return jax.lax.axis_index(cfg.axis_name)


def _forward(cfg, q, k, v, bias):
    n = q.shape[-2]
    acc = _acc_dtype(q.dtype)
    lead = cfjax._spec(_block_opts(cfg, q, k, v), q, k, v).out_shape[:-2]
    o_acc = jnp.zeros(tuple(lead) + (n, v.shape[-1]), acc)
    lse_acc = jnp.full(tuple(lead) + (n,), -jnp.inf, acc)

    def branch(rank, step, o_acc, lse_acc, kb, vb):
        calls, cols = _calls(cfg, rank, step, n)
        for call in calls:
            rows, keys = slice(call.r0, call.r1), slice(call.c0, call.c1)
            qc, kc, vc = q[..., rows, :], kb[..., keys, :], vb[..., keys, :]
            ob, lb = cfjax._forward(_block_opts(cfg, qc, kc, vc, call), qc, kc, vc,
                                    *_features(cfg, bias, call, cols))
            oa, la = o_acc[..., rows, :], lse_acc[..., rows]
            new = jnp.logaddexp(la, lb.astype(acc))
            safe = jnp.where(jnp.isneginf(new), 0, new)   # rows that see no key yet
            oa = oa * jnp.exp(la - safe)[..., None] + \
                ob.astype(acc) * jnp.exp(lb.astype(acc) - safe)[..., None]
            o_acc = o_acc.at[..., rows, :].set(oa)
            lse_acc = lse_acc.at[..., rows].set(new)
        return o_acc, lse_acc

    kb, vb = k, v
    for step in range(cfg.world):
        if step < cfg.world - 1:
            nxt = _shift(cfg, (kb, vb))    # does not depend on this step's compute
        branches = [functools.partial(branch, r, step) for r in range(cfg.world)]
        o_acc, lse_acc = jax.lax.switch(_rank(cfg), branches, o_acc, lse_acc, kb, vb)
        if step < cfg.world - 1:
            kb, vb = nxt
    return o_acc.astype(q.dtype), lse_acc


def _backward(cfg, do, q, k, v, o, lse, bias):
    n = q.shape[-2]
    acc = _acc_dtype(q.dtype)

    def branch(rank, step, dq, dbias, kb, vb):
        calls, cols = _calls(cfg, rank, step, n)
        dk, dv = jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)
        for call in calls:
            rows, keys = slice(call.r0, call.r1), slice(call.c0, call.c1)
            qc, kc, vc = q[..., rows, :], kb[..., keys, :], vb[..., keys, :]
            g = cfjax._backward(_block_opts(cfg, qc, kc, vc, call), do[..., rows, :], qc, kc,
                                vc, o[..., rows, :], lse[..., rows],
                                *_features(cfg, bias, call, cols))
            dq = dq.at[..., rows, :].add(g[0].astype(acc))
            dk = dk.at[..., keys, :].add(g[1].astype(acc))
            dv = dv.at[..., keys, :].add(g[2].astype(acc))
            if cfg.has_bias:
                brows = rows if cfg.bias_rows else slice(None)
                dbias = dbias.at[..., brows, cols[call.c0:call.c1]].add(g[3].astype(acc))
        return dq, dbias, dk, dv

    dq = jnp.zeros(q.shape, acc)
    dbias = jnp.zeros(bias.shape, acc)
    dk_acc, dv_acc = jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)
    kb, vb = k, v
    for step in range(cfg.world):
        if step < cfg.world - 1:
            nxt = _shift(cfg, (kb, vb))
        branches = [functools.partial(branch, r, step) for r in range(cfg.world)]
        dq, dbias, dk, dv = jax.lax.switch(_rank(cfg), branches, dq, dbias, kb, vb)
        dk_acc, dv_acc = dk_acc + dk, dv_acc + dv
        if cfg.world > 1:      # on to the next device; after the last step, to the owner
            dk_acc, dv_acc = _shift(cfg, (dk_acc, dv_acc))
        if step < cfg.world - 1:
            kb, vb = nxt
    dbias = dbias.astype(bias.dtype) if cfg.has_bias else jnp.zeros_like(bias)
    return dq.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, bias):
    return _forward(cfg, q, k, v, bias)


def _ring_fwd(cfg, q, k, v, bias):
    o, lse = _forward(cfg, q, k, v, bias)
    return (o, lse), (q, k, v, bias, o, lse)


def _ring_bwd(cfg, residuals, cotangents):
    q, k, v, bias, o, lse = residuals
    do, _dlse = cotangents     # lse carries no gradient (as in cuflash.jax)
    return _backward(cfg, do, q, k, v, o, lse, bias)


_ring.defvjp(_ring_fwd, _ring_bwd)

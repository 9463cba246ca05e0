"""Context-parallel attention over a ``torch.distributed`` process group.

``ring_attention(q, k, v, group=...)`` is called by every rank of the group with its own
shard of the sequence (rows of q, k, v along the sequence axis; :func:`shard` cuts a full
sequence).  It returns the rank's rows of the unsharded attention's output, and is
differentiable in q, k, v and a bias (a ``torch.autograd.Function``).  How the ring runs
(the ``(k, v)`` blocks passed on with ``batch_isend_irecv``, posted before each step's
compute so that NCCL overlaps them; partials merged by their log-sum-exp; the ``(dk, dv)``
accumulators one step behind in the backward, exact gradients) is in
docs/context_parallel.md.
"""
import math

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # torch absent (or blocked in sys.modules)
    raise ImportError("cuflash.ring.torch needs PyTorch, which cannot be imported here "
                      f"({e}); install it with `pip install torch` or "
                      "`pip install \".[torch]\"` from a cuflash checkout") from e

from .. import _torch_ops as ops
from ._plan import check_call, chunks_of, shard_slices, step_calls

__all__ = ["ring_attention", "shard", "unshard"]


def ring_attention(q, k, v, *, group=None, sharding="zigzag", scale=None, causal=False,
                   bias=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
                   layout="bhnd", return_lse=False, check_ranks=True):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Parameters
    ----------
    q, k, v : torch.Tensor
        This rank's shard: ``(B, H, n, d)`` ("bhnd") or ``(B, n, H, d)`` ("bnhd"), where
        ``n = N / world`` rows of the global sequence of length ``N``, laid out as
        :func:`shard` cuts them.  Self-attention: q, k and v hold the same positions, so
        their local lengths are equal, and equal on every rank.  GQA (fewer kv heads) as
        in :func:`cuflash.torch.attention`.  All ranks pass the same shapes and dtype;
        on CPU (gloo) or CUDA (NCCL), one device per rank.  Not modified.
    group : torch.distributed.ProcessGroup, optional
        The ring's ranks (default: the world).  Every rank of the group must call.
    sharding : {"zigzag", "contiguous"}
        How the sequence is split (see :func:`shard`).  ``"zigzag"`` gives each rank the
        same causal work; ``"contiguous"`` is the plain split.
    scale, causal, window, softcap
        As in :func:`cuflash.torch.attention`, of the global attention (positions are
        global; with equal lengths bottom-right and top-left causal are the same).
    bias : torch.Tensor, optional
        Sharded by rows: shape ``(..., n, N)`` or ``(..., 1, N)``, this rank's query rows
        (in local order) against every key in *global* order; leading dims broadcast as
        cuflash's bias.  Differentiable.
    alibi_slopes, dropout_p
        Refused (ValueError): neither can be expressed per block (see the error text).
    layout : {"bhnd", "bnhd"}
    return_lse : bool
        Also return the rank's rows of the log-sum-exp (float32; float64 for float64).
    check_ranks : bool
        Compare shapes, dtype and options across the ranks first (one all-gather of a few
        dozen int64 and, on CUDA, a host synchronisation); False skips it, and ranks that
        disagree then fail inside the transfers or compute garbage.

    Returns
    -------
    o : torch.Tensor
        This rank's rows of the output, shape of q with ``dv`` last; ``(o, lse)`` with
        ``return_lse`` (``lse`` carries no gradient, as in FlashAttention-2).

    Raises
    ------
    TypeError
        A ``group`` that is not a process group; non-tensors, bad dtypes.
    ValueError
        This process outside ``group``; a zigzag shard of odd length; q and k of different
        local lengths; shapes, dtypes or options that differ between ranks (compared with
        one small all-gather before any block moves); a bias of the wrong width; ALiBi,
        dropout; anything cuflash itself refuses.
    RuntimeError
        ``torch.distributed`` not initialised.
    """
    device = ops.check_tensors(q=q, k=k, v=v)   # one device, one supported dtype
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device}, q on {device}: one device")
    group, rank, world = _group(group, device)
    n, causal, window, softcap = check_call(
        q, k, v, layout, -2 if layout == "bhnd" else -3, causal, window, softcap, sharding,
        alibi_slopes, dropout_p, world, None if bias is None else tuple(bias.shape))
    cfg = _Config(group, rank, world, sharding, None if scale is None else float(scale),
                  causal, window, softcap, layout)
    if check_ranks:
        _agree(cfg, device, q, k, v, bias)
    o, lse = _Ring.apply(q, k, v, bias, cfg)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------
# sharding helpers
# ---------------------------------------------------------------------------
def shard(x, rank, world, *, dim, sharding="zigzag"):
    """Rank ``rank``'s shard of a full sequence ``x`` along ``dim`` (a copy for zigzag).

    ``"zigzag"`` cuts ``x`` into ``2 * world`` equal chunks and gives rank r chunks r and
    ``2 * world - 1 - r``, concatenated; ``"contiguous"`` gives chunk r of ``world``.
    The length must divide evenly (ValueError otherwise: pad the sequence first).
    """
    runs = shard_slices(x.shape[dim], world, rank, sharding)
    return torch.cat([x.narrow(dim, g, length) for g, length in runs], dim)


def unshard(parts, *, dim, sharding="zigzag"):
    """The full sequence from every rank's shard (``parts[r]`` from rank r), along ``dim``."""
    world = len(parts)
    shard_slices(parts[0].shape[dim] * world, world, 0, sharding)   # shard()'s evenness check
    pieces = {}
    for r, p in enumerate(parts):
        for (local, g, length) in chunks_of(r, world, p.shape[dim], sharding):
            pieces[g] = p.narrow(dim, local, length)
    return torch.cat([pieces[g] for g in sorted(pieces)], dim)


# ---------------------------------------------------------------------------
# group, agreement between ranks
# ---------------------------------------------------------------------------
class _Config:
    """The static options of one call (kept on the autograd context)."""

    def __init__(self, group, rank, world, sharding, scale, causal, window, softcap, layout):
        self.group, self.rank, self.world, self.sharding = group, rank, world, sharding
        self.scale, self.causal, self.window, self.softcap = scale, causal, window, softcap
        self.layout = layout

    def peer(self, offset):
        """The global rank of the group's rank ``self.rank + offset`` (mod world)."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world)


def _group(group, device):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(torch.distributed.init_process_group) on every rank")
    if group is None:
        group = dist.group.WORLD
    elif group is dist.GroupMember.NON_GROUP_MEMBER:   # what new_group gives non-members
        raise ValueError("this process is not a member of the group passed to ring_attention")
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__module__}.{type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group passed to ring_attention")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and device.type != "cuda":
        raise ValueError(f"the group's backend is NCCL, which moves CUDA tensors; the "
                         f"tensors are on {device}")
    return group, rank, dist.get_world_size(group)


def _agree(cfg, device, q, k, v, bias):
    """ValueError on every rank when the ranks disagree on shapes, dtype or options."""
    if cfg.world == 1:
        return
    desc = [ops.DTYPES.index(q.dtype), int(cfg.causal),
            cfg.window[0] if cfg.window else -2, cfg.window[1] if cfg.window else -2,
            -1 if cfg.softcap is None else int(cfg.softcap * 2 ** 20),
            -1 if cfg.scale is None else int(cfg.scale * 2 ** 30),
            ("zigzag", "contiguous").index(cfg.sharding), ("bhnd", "bnhd").index(cfg.layout)]
    for t in (q, k, v, bias):
        shape = [] if t is None else list(t.shape)
        desc += [len(shape)] + (shape + [0] * 8)[:8]
    mine = torch.tensor(desc, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(cfg.world)]
    dist.all_gather(everyone, mine, group=cfg.group)
    for r, theirs in enumerate(everyone):
        if not torch.equal(theirs, mine):
            raise ValueError(f"ring_attention: rank {r} of the group passed other shapes, "
                             f"dtype or options than rank {cfg.rank} (q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"bias {None if bias is None else tuple(bias.shape)}, "
                             f"{q.dtype}); every rank must call with the same ones")


# ---------------------------------------------------------------------------
# the ring
# ---------------------------------------------------------------------------
def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bhnd(t, layout):
    return t if layout == "bhnd" or t is None else t.transpose(-3, -2)


def _pack(*ts):
    """One contiguous buffer holding the tensors (one message per transfer)."""
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, shapes):
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(buf[at:at + size].view(shape))
        at += size
    return out


def _exchange(cfg, buf):
    """Send ``buf`` to the next rank and receive the previous rank's: (requests, received)."""
    got = torch.empty_like(buf)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, cfg.peer(1), cfg.group),
                                   dist.P2POp(dist.irecv, got, cfg.peer(-1), cfg.group)])
    return reqs, got


def _wait(reqs):
    for r in reqs:
        r.wait()


def _key_index(cfg, src, n, device):
    """Global key positions of the source rank's local keys, as an index tensor."""
    idx = [torch.arange(g, g + length) for _, g, length in
           chunks_of(src, cfg.world, n, cfg.sharding)]
    return torch.cat(idx).to(device)


def _bias_block(bias, call, cols):
    rows = slice(None) if bias.shape[-2] == 1 else slice(call.r0, call.r1)
    return bias[..., rows, :].index_select(-1, cols[call.c0:call.c1])


def _steps(cfg, n):
    """(step, source rank, cuflash calls) of every step of this rank."""
    mine = chunks_of(cfg.rank, cfg.world, n, cfg.sharding)
    for step in range(cfg.world):
        src = (cfg.rank - step) % cfg.world
        yield step, src, step_calls(mine, chunks_of(src, cfg.world, n, cfg.sharding),
                                    cfg.causal, cfg.window)


def _causal(call):
    return "bottom_right" if call.causal else None


def _forward(cfg, q, k, v, bias):
    n = q.shape[-2]
    shapes = (k.shape, v.shape)
    buf = _pack(k, v)
    acc = _acc_dtype(q.dtype)
    o_acc = lse_acc = None
    for step, src, calls in _steps(cfg, n):
        if step < cfg.world - 1:
            reqs, nxt = _exchange(cfg, buf)   # posted first: it overlaps this step's calls
        kb, vb = _unpack(buf, shapes)
        cols = None if bias is None else _key_index(cfg, src, n, q.device)
        for call in calls:
            ob, lb = ops.attention(
                q[..., call.r0:call.r1, :], kb[..., call.c0:call.c1, :],
                vb[..., call.c0:call.c1, :],
                bias=None if bias is None else _bias_block(bias, call, cols), scale=cfg.scale,
                causal=_causal(call), window=call.window, softcap=cfg.softcap)
            if o_acc is None:
                lead = tuple(ob.shape[:-2])
                o_acc = torch.zeros(lead + (n, ob.shape[-1]), dtype=acc, device=q.device)
                lse_acc = torch.full(lead + (n,), -math.inf, dtype=acc, device=q.device)
            _merge(o_acc[..., call.r0:call.r1, :], lse_acc[..., call.r0:call.r1], ob, lb)
        if step < cfg.world - 1:
            _wait(reqs)
            buf = nxt
    return o_acc.to(q.dtype), lse_acc


def _merge(o_acc, lse_acc, ob, lb):
    """Fold a partial (ob, lb) into the accumulators (views of the rows), in place."""
    lb = lb.to(lse_acc.dtype)
    new = torch.logaddexp(lse_acc, lb)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows with no key
    o_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1))
    o_acc.add_(ob.to(o_acc.dtype) * torch.exp(lb - safe).unsqueeze(-1))
    lse_acc.copy_(new)


def _backward(cfg, do, q, k, v, o, lse, bias, want_dbias):
    n = q.shape[-2]
    shapes = (k.shape, v.shape)
    acc = _acc_dtype(q.dtype)
    buf = _pack(k, v)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if want_dbias else None
    dkv = dkv_reqs = None
    for step, src, calls in _steps(cfg, n):
        if step < cfg.world - 1:
            reqs, nxt = _exchange(cfg, buf)
        kb, vb = _unpack(buf, shapes)
        mine = torch.zeros(buf.numel(), dtype=acc, device=q.device)
        dk, dv = _unpack(mine, shapes)
        cols = None if bias is None else _key_index(cfg, src, n, q.device)
        for call in calls:
            rows, keys = slice(call.r0, call.r1), slice(call.c0, call.c1)
            wl, wr = call.window if call.window is not None else (-1, -1)
            bb = None if bias is None else _bias_block(bias, call, cols)
            g = torch.ops.cuflash.attention_bwd(
                do[..., rows, :], q[..., rows, :], kb[..., keys, :], vb[..., keys, :],
                o[..., rows, :], lse[..., rows], bb, None, None, cfg.scale,
                ops.causal_name(_causal(call)), wl, wr, float(cfg.softcap or 0.0), 0.0, "bhnd",
                False, want_dbias)
            dq[..., rows, :] += g[0]
            dk[..., keys, :] += g[1]
            dv[..., keys, :] += g[2]
            if want_dbias:
                brows = slice(None) if bias.shape[-2] == 1 else rows
                dbias[..., brows, :].index_add_(-1, cols[keys], g[3].to(acc))
        if step > 0:
            _wait(dkv_reqs)
            mine += dkv
        if cfg.world > 1:   # on to the next rank; the last step's lands on its owner
            dkv_reqs, dkv = _exchange(cfg, mine)
        else:
            dkv = mine
        if step < cfg.world - 1:
            _wait(reqs)
            buf = nxt
    if cfg.world > 1:
        _wait(dkv_reqs)
    dk, dv = _unpack(dkv, shapes)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            None if dbias is None else dbias.to(bias.dtype))


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, cfg):
        lay = cfg.layout
        o, lse = _forward(cfg, _bhnd(q, lay), _bhnd(k, lay), _bhnd(v, lay), bias)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return _bhnd(o, lay), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if torch.is_grad_enabled():
            raise RuntimeError("ring_attention has no double backward (create_graph=True)")
        q, k, v, bias, o, lse = ctx.saved_tensors
        cfg, lay = ctx.cfg, ctx.cfg.layout
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _backward(cfg, _bhnd(do, lay), _bhnd(q, lay), _bhnd(k, lay),
                                      _bhnd(v, lay), o, lse, bias, want_dbias)
        return _bhnd(dq, lay), _bhnd(dk, lay), _bhnd(dv, lay), dbias, None

"""A tile-by-tile trace of the FlashAttention forward, for learning and for tests.

``trace_forward`` runs the FlashAttention forward on one (N, d)
problem, in float64, and records after every (query tile i, key/value tile j)
step everything a hand walk-through of the algorithm shows: the tile's logits ``S``,
its row maxima ``m~``, the running maximum before and after (``m_old``,
``m_new``), the correction ``c = exp(m_old - m_new)``, the local exponentials
``P~ = exp(S - m_new)``, the running sum ``l`` and the unnormalised output
``O``.  ``format_trace`` prints it one tile per block; ``python -m cuflash
demo`` shows it for a 4x4 example (``worked_example()``), where it
prints every intermediate value of the walk-through.

The update is the one of ``cuflash.reference.tiled_attention`` (and of the
CUDA kernel), written out one 2-D tile at a time instead of vectorised, so the
two can be read side by side.
"""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from ._validate import check_attention_inputs
from .reference import standard_attention
from .reference._common import _causal_offset, _kv_range, _tile_mask

__all__ = ["TileStep", "QTileResult", "ForwardTrace", "trace_forward", "format_trace",
           "worked_example", "backward_steps", "format_backward"]


@dataclass
class TileStep:
    """State after processing key/value tile j for query tile i (all float64).

    Shapes: ``S``, ``P_tilde`` (br, bc); ``m_tilde``, ``m_old``, ``m_new``, ``c``,
    ``l`` (br,); ``O`` (br, dv) - the unnormalised output accumulator.
    """
    i: int
    j: int
    rows: Tuple[int, int]
    cols: Tuple[int, int]
    S: np.ndarray
    m_tilde: np.ndarray
    m_old: np.ndarray
    m_new: np.ndarray
    c: np.ndarray
    P_tilde: np.ndarray
    l: np.ndarray
    O: np.ndarray
    masked: bool = False


@dataclass
class QTileResult:
    """End of query tile i: final statistics and the normalised output rows."""
    i: int
    rows: Tuple[int, int]
    m: np.ndarray
    l: np.ndarray
    O_unnormalised: np.ndarray
    O: np.ndarray
    lse: np.ndarray


@dataclass
class ForwardTrace:
    """Everything ``trace_forward`` recorded."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    causal: Optional[str]
    block_q: int
    block_kv: int
    steps: List[TileStep] = field(default_factory=list)
    q_tiles: List[QTileResult] = field(default_factory=list)
    skipped: List[Tuple[int, int]] = field(default_factory=list)
    o: Optional[np.ndarray] = None
    lse: Optional[np.ndarray] = None


def worked_example():
    """The 4x4 walk-through example (Q, K, V, dO with 4 rows and d = 2 or 4): ``dict(q=Q, k=K, v=V, do=dO)`` as float64 arrays.

    Used with ``scale=1`` and blocks of 2 (the walk-through ignores ``sqrt(d)``).
    """
    q = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=np.float64)
    k = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=np.float64)
    v = np.arange(1, 17, dtype=np.float64).reshape(4, 4)
    do = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.float64)
    return {"q": q, "k": k, "v": v, "do": do}


def trace_forward(q, k, v, *, block_q=2, block_kv=2, scale=None, causal=False):
    """Run the tiled forward on 2-D inputs and record every tile step.

    Parameters
    ----------
    q : ndarray, shape (Nq, d)
    k : ndarray, shape (Nk, d)
    v : ndarray, shape (Nk, dv)
    block_q, block_kv : int
        Br and Bc (2 and 2 for the walk-through).
    scale : float, optional
        None means ``1/sqrt(d)``; the walk-through uses 1.
    causal : bool or {"bottom_right", "top_left"}
        Tiles entirely above the boundary appear in ``skipped`` and are not
        computed; tiles crossing it are marked ``masked``.

    Returns
    -------
    ForwardTrace
        ``steps`` in processing order, ``q_tiles`` (one per query tile),
        ``o`` (Nq, dv) and ``lse`` (Nq,), all float64.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal, block_q=block_q,
                                  block_kv=block_kv)
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2:
        raise ValueError(f"trace_forward takes 2-D q, k, v (one head); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if spec.block_q is None or spec.block_kv is None:
        raise ValueError("trace_forward needs explicit block_q and block_kv")
    Br, Bc = spec.block_q, spec.block_kv
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    Nq, Nk, dv = spec.Nq, spec.Nk, spec.dv
    offset = _causal_offset(spec)
    tr = ForwardTrace(q=q64, k=k64, v=v64, scale=spec.scale, causal=spec.causal,
                      block_q=Br, block_kv=Bc)
    o = np.zeros((Nq, dv))
    lse = np.full(Nq, -np.inf)
    n_kv = -(-Nk // Bc) if Nk else 0
    with np.errstate(divide="ignore"):
        for i in range(-(-Nq // Br) if Nq else 0):
            r0, r1 = i * Br, min(Nq, (i + 1) * Br)
            Qi = spec.scale * q64[r0:r1]
            m = np.full(r1 - r0, -np.inf)              # m_i
            l = np.zeros(r1 - r0)                      # l_i
            O = np.zeros((r1 - r0, dv))                # unnormalised O_i
            _, j_hi = _kv_range(r0, r1, Nk, Bc, offset)
            tr.skipped.extend((i, j) for j in range(j_hi, n_kv))
            for j in range(j_hi):
                c0, c1 = j * Bc, min(Nk, (j + 1) * Bc)
                S = Qi @ k64[c0:c1].T                  # step 1: tile scores
                hidden = _tile_mask(r0, r1, c0, c1, offset)
                if hidden is not None:
                    S = np.where(hidden, -np.inf, S)
                m_tilde = S.max(axis=1)                # step 2: tile max
                m_new = np.maximum(m, m_tilde)         # step 3: running max
                shift = np.where(np.isneginf(m_new), 0.0, m_new)
                c = np.exp(m - shift)                  # step 4: correction exp(m_old - m_new)
                P = np.exp(S - shift[:, None])         # step 5: local exponentials
                l = l * c + P.sum(axis=1)              # step 6: rescale and add
                O = O * c[:, None] + P @ v64[c0:c1]    # step 7: rescale and add
                tr.steps.append(TileStep(i, j, (r0, r1), (c0, c1), S, m_tilde, m, m_new, c, P,
                                         l.copy(), O.copy(), hidden is not None))
                m = m_new
            l_safe = np.where(l == 0, 1.0, l)
            o[r0:r1] = O / l_safe[:, None]
            lse[r0:r1] = m + np.log(l)
            tr.q_tiles.append(QTileResult(i, (r0, r1), m, l, O, o[r0:r1].copy(),
                                          lse[r0:r1].copy()))
    tr.o, tr.lse = o, lse
    return tr


def _fmt(a, decimals):
    a = np.asarray(a, dtype=np.float64)

    def one(x):
        if np.isneginf(x):
            return "-inf"
        if np.isposinf(x):
            return "inf"
        s = f"{x:.{decimals}f}"
        return s[1:] if s.startswith("-") and float(s) == 0 else s    # no "-0.00"
    if a.ndim == 1:
        return "[" + ", ".join(one(x) for x in a) + "]"
    return "[" + ",\n ".join("[" + ", ".join(one(x) for x in row) + "]" for row in a) + "]"


def _block(label, a, decimals, indent="    "):
    text = _fmt(a, decimals)
    lines = text.split("\n")
    pad = " " * (len(label) + 3)
    out = [f"{indent}{label} = {lines[0]}"] + [f"{indent}{pad}{x}" for x in lines[1:]]
    return "\n".join(out)


def format_trace(trace, decimals=3):
    """The trace as text: one block per tile, then each Q tile's result.

    Stats, ``P~`` and ``c`` are printed with ``decimals`` decimals, outputs with 2.
    """
    Br, Bc = trace.block_q, trace.block_kv
    out = [f"FlashAttention forward, tile by tile: Nq={trace.q.shape[0]}, "
           f"Nk={trace.k.shape[0]}, d={trace.q.shape[1]}, Br={Br}, Bc={Bc}, "
           f"scale={trace.scale:g}" + (f", causal={trace.causal}" if trace.causal else ""),
           "Initialisation: m = -inf, l = 0, O = 0 for every row"]
    by_i = {}
    for s in trace.steps:
        by_i.setdefault(s.i, []).append(s)
    for res in trace.q_tiles:
        for s in by_i.get(res.i, []):
            (r0, r1), (c0, c1) = s.rows, s.cols
            out += ["", f"Tile ({s.i},{s.j}): Q rows {r0}-{r1 - 1} x K rows {c0}-{c1 - 1}"
                    + ("  (crosses the causal boundary: hidden entries = -inf)"
                       if s.masked else ""),
                    _block("S = scale * Qi Kj^T", s.S, 2),
                    _block("m~ (tile row max)", s.m_tilde, 2),
                    _block("m: old", s.m_old, 2) + "  ->  new " + _fmt(s.m_new, 2)
                    + ("   (max increased)" if s.j > 0 and np.any(s.m_new > s.m_old) else ""),
                    _block("c = exp(m_old - m_new)", s.c, decimals),
                    _block("P~ = exp(S - m_new)", s.P_tilde, decimals),
                    _block("l = l * c + rowsum(P~)", s.l, decimals),
                    _block("O = O * c + P~ Vj", s.O, 2)]
        skipped = [j for (i, j) in trace.skipped if i == res.i]
        if skipped:
            out += ["", f"Tiles ({res.i}, {skipped}) lie entirely above the causal boundary: "
                    "skipped, never computed"]
        r0, r1 = res.rows
        out += ["", f"Normalise (end of Q block {res.i}, rows {r0}-{r1 - 1}): O = O / l",
                _block("O", res.O, 2), _block("lse = m + log(l)", res.lse, decimals)]
    return "\n".join(out) + "\n"


def backward_steps(do, q, k, v, *, scale=None, causal=False):
    """The textbook backward on 2-D inputs, every intermediate kept (float64).

    Returns
    -------
    dict
        ``P`` (Nq, Nk), ``dV`` (Nk, dv) = P^T dO, ``dP`` (Nq, Nk) = dO V^T,
        ``D`` (Nq,) = rowsum(P * dP) (= rowsum(dO * O)), ``dS`` = P * (dP - D),
        ``dQ`` = scale dS K, ``dK`` = scale dS^T Q, and ``O``.
    """
    spec = check_attention_inputs(q, k, v, scale=scale, causal=causal)
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2 or do.ndim != 2:
        raise ValueError("backward_steps takes 2-D do, q, k, v")
    q64, k64, v64, do64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do))
    O, P = standard_attention(q64, k64, v64, scale=spec.scale, causal=causal)
    dV = P.T @ do64
    dP = do64 @ v64.T
    D = (P * dP).sum(axis=1)
    dS = P * (dP - D[:, None])
    return {"O": O, "P": P, "dV": dV, "dP": dP, "D": D, "dS": dS,
            "dQ": spec.scale * dS @ k64, "dK": spec.scale * dS.T @ q64}


def format_backward(steps, decimals=2):
    """The intermediates of :func:`backward_steps` as text."""
    out = []
    for name, formula in (("dV", "P^T dO"), ("dP", "dO V^T"), ("D", "rowsum(P * dP)"),
                          ("dS", "P * (dP - D)"), ("dQ", "scale dS K"), ("dK", "scale dS^T Q")):
        out.append(_block(f"{name} = {formula}", steps[name], decimals, indent="  "))
    return "\n".join(out) + "\n"

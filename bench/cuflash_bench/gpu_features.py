"""The logit-features section of the GPU benchmark: what each feature costs.

``--sections features``: for each dtype, head dim (``--dims``) and mode
(``--modes``), one non-causal problem of ``N = --feature-n`` queries and keys
(``B = tokens // N``, ``H = hidden // d``, as the grid) runs through cuflash's
``tiled_attention`` (and its backward) once without any feature -- the plain
call, the kernels a call without features runs -- and once with each feature
alone (:data:`FEATURES`; the name a command line takes, then the table's label):

* ``bias-key-padding``, ``bias (B,1,1,N)``: a key-padding bias (the last
  eighth of each row ``-inf``), broadcast over heads and rows;
* ``bias-full``, ``bias (1,H,N,N)``: a relative-position bias, broadcast over
  the batch (it adds ``4 H N^2`` bytes of reads per batch entry), and
  ``bias-full-dbias``, ``bias (1,H,N,N) + dbias``: the same with
  ``return_dbias=True``;
* ``alibi``, ``ALiBi``: slopes ``2^(-8 h / H)``;
* ``softcap30``, ``softcap 30``;
* ``dropout0.1``, ``dropout 0.1``;
* ``window``, ``window (N/8, 0)``: a sliding window of ``N/8 + 1`` keys.

Each row gives the median time, the overhead over the plain call of the same
mode and, on the ``fwdbwd`` rows, issue 13's target: a feature costs at most
10% of the forward + backward time without it (dropout at most 20%).  A window
does less work than the plain call, so its row has no target; the window table
(``--feature-windows``, default ``N/16, N/8, N/4, N/2``: ``window=(w, 0)``, so
``w + 1`` keys per row) divides each time by the visible fraction of the
logits, so the cost of a window is proportional to ``w`` when that
time-per-visible-logit stays flat as ``w`` grows.

Like the rest of the benchmark, each row's call (the plain one too) is checked before it is
timed, on a small problem (``B, H = 2, 2``, ``--check-n`` queries and keys): output and
gradients (and dbias) against float64 NumPy (:func:`feature_attention`, the logits built in
full, every feature written out here; the dropout mask from :func:`cuflash.dropout_mask`, the
definition every backend draws), with the rule of ``gpu_check.py``.
"""
import math

import numpy as np

from .gpu_check import GRAD_NAMES, LOW_PRECISION, precision
from .gpu_common import flops, sig
from .gpu_methods import CuflashTiled, check_method, input_sets_needed, make_set

__all__ = ["FEATURES", "LABELS", "TARGETS", "CuflashFeature", "feature_attention", "feature_kwargs",
           "meets_target", "visible_fraction", "window_sizes", "run_features", "print_features",
           "kind_text"]

NONE = "none"
# (name, label, target overhead on fwdbwd or None), in the order of the table: the name is what
# a command line takes (--tiles-feature), the label what the tables, logs and JSON show
FEATURES = (("bias-key-padding", "bias (B,1,1,N)", 0.10),
            ("bias-full", "bias (1,H,N,N)", 0.10),
            ("bias-full-dbias", "bias (1,H,N,N) + dbias", 0.10),
            ("alibi", "ALiBi", 0.10),
            ("softcap30", "softcap 30", 0.10),
            ("dropout0.1", "dropout 0.1", 0.20),
            ("window", "window (N/8, 0)", None))
LABELS = {NONE: NONE, **{name: label for name, label, _ in FEATURES}}
TARGETS = {name: target for name, _, target in FEATURES}
SOFTCAP, DROPOUT_P, DROPOUT_SEED = 30.0, 0.1, 1234


def window_sizes(n):
    """The default left widths of the window table: N/16, N/8, N/4, N/2 (at least 1)."""
    return sorted({max(1, n // f) for f in (16, 8, 4, 2)})


def visible_fraction(nq, nk, left):
    """The fraction of the ``nq x nk`` logits that ``window=(left, 0)`` leaves visible
    (query ``i`` sees keys ``max(0, i + nk - nq - left) .. min(nk - 1, i + nk - nq)``)."""
    i = np.arange(nq) + (nk - nq)
    lo, hi = np.clip(i - left, 0, nk), np.clip(i + 1, 0, nk)
    return float(np.maximum(hi - lo, 0).sum()) / (nq * nk)


def meets_target(overhead, target, backend):
    """True / False: whether a measured overhead is within its target; None where there is
    no target or no time, and on the emulator (its times say nothing about a GPU)."""
    if target is None or overhead is None or backend != "cuda":
        return None
    return bool(overhead <= target)


def feature_kwargs(name, host, xp, B, H, N, dtype, window=None):
    """The keyword arguments of feature ``name`` for a (B, H, N, N) problem of ``dtype``;
    ``host`` says whether the arrays are NumPy (the oracle) or the backend's (``xp``).  A bias
    is float32, float64 for float64 problems (dbias comes back in the bias's dtype)."""
    mod = np if host else xp
    bt = np.float64 if dtype == "float64" else np.float32
    if name == NONE:
        return {}
    if name == "bias-key-padding":
        b = np.zeros((B, 1, 1, N), bt)
        b[..., N - max(1, N // 8):] = -np.inf
        return {"bias": mod.asarray(b)}
    if name in ("bias-full", "bias-full-dbias"):
        # a smooth relative-position term, built where it is used (on the device for the
        # timed calls: (1, H, N, N) float32 is 2 GiB at N = 4096, H = 32)
        ij = (mod.arange(N)[:, None] - mod.arange(N)[None, :]).astype(bt)
        per_head = (0.5 + mod.arange(H, dtype=bt) / H).reshape(1, H, 1, 1)
        kw = {"bias": mod.cos(bt(0.37) * ij)[None, None] * per_head}
        if name == "bias-full-dbias":
            kw["return_dbias"] = True
        return kw
    if name == "alibi":
        return {"alibi_slopes": mod.asarray((2.0 ** (-8.0 * np.arange(1, H + 1) / H))
                                            .astype(np.float32))}
    if name == "softcap30":
        return {"softcap": SOFTCAP}
    if name == "dropout0.1":
        return {"dropout_p": DROPOUT_P, "seed": DROPOUT_SEED}
    if name == "window":
        return {"window": (N // 8 if window is None else window, 0)}
    raise KeyError(name)


def feature_attention(q, k, v, do, kw, low=None):
    """Attention with the logit features of ``kw`` over (B, H, N, d) host arrays, in float64
    (``low`` None: the oracle) or in float32 with every intermediate rounded to ``low`` (the
    low-precision baseline); with ``do`` also dq, dk, dv and, with ``return_dbias``, dbias."""
    ft, rnd = precision(low)
    q, k, v = (np.asarray(a).astype(ft) for a in (q, k, v))
    B, H, Nq, d = q.shape
    Nk = k.shape[-2]
    scale = ft(1.0 / math.sqrt(d))
    s = rnd(np.matmul(q, np.swapaxes(k, -1, -2)) * scale)
    th = None
    if "softcap" in kw:
        c = ft(kw["softcap"])
        th = np.tanh(s / c)
        s = rnd(c * th)
    if "bias" in kw:
        s = rnd(s + np.asarray(kw["bias"]).astype(ft))
    off = Nk - Nq
    dist = (np.arange(Nq)[:, None] + off) - np.arange(Nk)[None, :]
    if "alibi_slopes" in kw:
        slopes = np.asarray(kw["alibi_slopes"]).astype(ft).reshape(1, H, 1, 1)
        s = rnd(s - slopes * np.abs(dist))
    if "window" in kw:
        left, right = kw["window"]
        s = np.where((dist > left) | (-dist > right), -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    e = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0)
    lsum = e.sum(axis=-1, keepdims=True)
    p = rnd(np.where(seen, e / np.where(seen, lsum, 1), 0))
    zk = 1.0
    if kw.get("dropout_p", 0) > 0:
        from cuflash import dropout_mask
        zk = dropout_mask((B, H, Nq, Nk), kw["dropout_p"], kw["seed"]) / (1 - kw["dropout_p"])
    o = rnd(np.matmul(rnd(p * zk), v))
    out = {"o": o}
    if do is None:
        return out
    do = np.asarray(do).astype(ft)
    out["dv"] = rnd(np.matmul(np.swapaxes(rnd(p * zk), -1, -2), do))
    dp = rnd(np.matmul(do, np.swapaxes(v, -1, -2))) * zk
    D = (do * o).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - D))
    if kw.get("return_dbias"):
        shape = np.asarray(kw["bias"]).shape
        axes = tuple(a for a in range(4) if shape[a] == 1 and ds.shape[a] != 1)
        out["dbias"] = rnd(ds.sum(axis=axes, keepdims=True))
    if th is not None:
        ds = rnd(ds * (1 - th * th))
    out["dq"] = rnd(np.matmul(ds, k) * scale)
    out["dk"] = rnd(np.matmul(np.swapaxes(ds, -1, -2), q) * scale)
    return out


class CuflashFeature(CuflashTiled):
    """cuflash tiled_attention (and backward) with one feature's keyword arguments (``name``:
    one of :data:`FEATURES`' names)."""

    def __init__(self, backend, name, kw):
        super().__init__(backend)
        self.feature, self.kw = name, kw
        self.name = "cuflash tiled"

    def forward(self, x, grad):
        kw = {k: v for k, v in self.kw.items() if k != "return_dbias"}
        return self.cf.tiled_attention(x.q, x.k, x.v, return_lse=grad, backend=self.backend, **kw)

    def backward(self, x, state, retain=False):
        o, lse = state
        return self.cf.tiled_attention_backward(x.do, x.q, x.k, x.v, o, lse, backend=self.backend,
                                                **self.kw)


def _check(bench, dtype, d, name, grad):
    """Run feature ``name`` once on the check problem and judge it (the check record)."""
    a, dev = bench.args, bench.device
    n = a.check_n
    shape = (2, 2, 2, n, n, d)
    label = LABELS[name]
    what = f"{dtype} d={d} {label}{' with gradients' if grad else ''}"
    bench.log(f"check features {what} at B,H,Hk,Nq,Nk,d={shape} against float64")
    x, host = make_set(dev, bench.torch, shape, dtype, False, a.seed + 11, host=True)
    hkw = feature_kwargs(name, True, None, 2, 2, n, dtype)
    do = host[3] if grad else None
    ref = feature_attention(*host[:3], do, hkw if grad else _fwd_only(hkw))
    base = (feature_attention(*host[:3], do, hkw if grad else _fwd_only(hkw), low=dtype)
            if dtype in LOW_PRECISION else None)
    m = CuflashFeature(a.backend, name, feature_kwargs(name, False, dev.xp, 2, 2, n, dtype))
    rec = {"kind": {"section": "features", "dtype": dtype, "d": d, "feature": label,
                    "causal": False, "group": 1, "decode": False, "grad": grad},
           "shape": dict(zip(("B", "H", "Hk", "Nq", "Nk", "d"), shape)),
           "method": m.name, "status": "n/a"}
    names = GRAD_NAMES + (("dbias",) if hkw.get("return_dbias") else ())
    check_method(dev, m, x, grad, ref, base, dtype, what, rec, names)
    bench.log(f"  {m.name} {label}: {rec['status']}" + (f" ({rec['reason']})"
                                                       if rec.get("reason") else ""))
    bench.checks.append(rec)
    dev.release()
    return rec


def _fwd_only(kw):
    return {k: v for k, v in kw.items() if k != "return_dbias"}


def run_features(bench):
    """Time the plain call and each feature (and the window sizes); appends to bench.cases."""
    a, dev = bench.args, bench.device
    N = a.feature_n
    verdicts = {}
    for dtype in a.dtypes:
        for d in a.dims:
            B, H = max(1, a.tokens // N), a.hidden // d
            shape = (B, H, H, N, N, d)
            dev.release()
            x0 = make_set(dev, bench.torch, shape, dtype, False, a.seed)
            nsets = input_sets_needed(x0.nbytes + x0.q.nbytes, dev.l2_bytes)
            sets = [x0] + [make_set(dev, bench.torch, shape, dtype, False, a.seed + i)
                           for i in range(1, nsets)]
            # the window table's rows share the window row's check (at the default width)
            rows = [(NONE, None)] + [(name, None) for name, _, _ in FEATURES] + [
                ("window", w) for w in a.feature_windows]
            for mode in a.modes:
                grad = mode != "fwd"
                base_ms = None
                for name, w in rows:
                    key = (dtype, d, name, grad)
                    if key not in verdicts:  # the plain call too: this section may run alone
                        verdicts[key] = _check(bench, dtype, d, name, grad)
                    kw = feature_kwargs(name, False, dev.xp, B, H, N, dtype, window=w)
                    m = CuflashFeature(a.backend, name, kw)
                    e = bench.time_method(m, mode, sets, verdicts[key])
                    kw = None
                    frac = visible_fraction(N, N, w if w is not None else N // 8) \
                        if name == "window" else 1.0
                    case = {"section": "features", "dtype": dtype, "d": d, "causal": False,
                            "mode": mode, "B": B, "H": H, "Hk": H, "Nq": N, "Nk": N,
                            "feature": LABELS[name] if w is None else f"window ({w}, 0)",
                            "table": "windows" if w is not None else "features",
                            "window_left": w, "visible_fraction": frac,
                            "flops": flops(B, H, N, N, d, False, mode) * frac,
                            "input_sets": nsets, "methods": {"cuflash tiled": e}}
                    ms = e.get("ms")
                    e["tflops"] = case["flops"] / (ms * 1e-3) / 1e12 if ms else None
                    if name == NONE:
                        base_ms = ms
                    over = ms / base_ms - 1 if ms and base_ms else None
                    case["overhead"] = over
                    target = TARGETS.get(name) if mode == "fwdbwd" and w is None else None
                    case["target"] = target
                    case["meets_target"] = meets_target(over, target, a.backend)
                    case["ms_per_visible_vs_plain"] = (ms / frac / base_ms
                                                       if ms and base_ms and w is not None
                                                       else None)
                    bench.log(f"features {dtype} d={d} {mode} B={B} H={H} N={N} "
                              f"{case['feature']}: " + (
                                  f"{ms:.4g} ms" + (f", {100 * over:+.1f}% vs none"
                                                    if over is not None else "")
                                  if e["status"] == "ok" else f"{e['status']}: {e['reason']}"))
                    bench.cases.append(case)
            sets = x0 = None
            dev.release()


def _pct(x):
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def print_features(res, say):
    """The features section's two tables and notes, if it ran."""
    cases = [c for c in res["cases"] if c["section"] == "features"]
    if not cases:
        return
    say()
    say("## Logit features (cuflash tiled, non-causal, each feature alone against the plain call)")
    say()
    say("| dtype | d | mode | B x H | N | feature | ms | vs none | target (fwdbwd) |")
    say("|---|---:|---|---|---:|---|---:|---:|---|")
    for c in cases:
        if c["table"] != "features":
            continue
        e = c["methods"]["cuflash tiled"]
        ms = sig(e["ms"]) if e["status"] == "ok" else f"{e['status']} [{e.get('note', '?')}]"
        tgt = "" if c["target"] is None else (
            f"<= +{100 * c['target']:.0f}%: " + (
                ("n/a (emulator)" if res["config"]["backend"] != "cuda" else "n/a")
                if c["meets_target"] is None else "met" if c["meets_target"] else "missed"))
        say(f"| {c['dtype']} | {c['d']} | {c['mode']} | {c['B']} x {c['H']} | {c['Nq']} | "
            f"{c['feature']} | {ms} | {_pct(c['overhead'])} | {tgt} |")
    win = [c for c in cases if c["table"] == "windows"]
    if win:
        say()
        say("### Sliding windows: window=(w, 0), cost per visible logit against the plain call")
        say()
        say("| dtype | d | mode | N | w | visible fraction | ms | ms / fraction / plain ms |")
        say("|---|---:|---|---:|---:|---:|---:|---:|")
        for c in win:
            e = c["methods"]["cuflash tiled"]
            ms = sig(e["ms"]) if e["status"] == "ok" else f"{e['status']} [{e.get('note', '?')}]"
            r = c["ms_per_visible_vs_plain"]
            say(f"| {c['dtype']} | {c['d']} | {c['mode']} | {c['Nq']} | {c['window_left']} | "
                f"{c['visible_fraction']:.4f} | {ms} | {'n/a' if r is None else f'{r:.2f}'} |")
    say()
    for n in NOTES:
        say(f"- {n}")


NOTES = [
    "none: the plain call (no feature keyword: the kernels without -DCUFLASH_MASKS); every other "
    "row adds one feature (the kernels built with -DCUFLASH_MASKS); vs none: its time over the "
    "plain call's of the same mode, minus 1",
    "target: issue 13's, on forward + backward (fwdbwd rows): at most +10% per feature, +20% for "
    "dropout; a window does less work than the plain call and is judged by the window table",
    "bias (1,H,N,N) reads 4 H N^2 bytes per batch entry (and + dbias writes that much, summed "
    "over the batch by atomic adds); bias (B,1,1,N) masks the last eighth of the keys",
    "window table: ms / fraction / plain ms is 1.0 when a window costs exactly its share of the "
    "plain call's logits; flat as w grows means the cost is proportional to w, not N",
]


def kind_text(k):
    """A features check kind in words."""
    return f"features {k['dtype']} d={k['d']} {k['feature']}"

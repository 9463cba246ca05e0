"""The serving sections of the GPU benchmark: KV-cache decode and variable-length batches.

**KV-cache decode** (``--sections kvcache``): for each decode configuration
(B, H, Hk) of the decode section, each ``--decode-nk`` and each ``--kv-nq``:
``Nq`` new tokens are appended to a cache of ``Nk - Nq`` tokens and the
``Nq`` queries attend over all ``Nk`` keys (causal bottom-right).  Every
timed call gets the same ``cache_seqlens = Nk - Nq``: its append overwrites
the rows the previous call wrote, so the cache never grows or overflows and
every call does the same work.  Methods (``gpu_serving_methods.py``):
cuflash ``attention_with_kvcache`` on a contiguous cache (``check_inputs``
False, as a decode loop runs it, and True to show that check's cost) and on
paged caches (``--kv-page-sizes``, shuffled block tables), cuflash
``tiled_attention`` on the cache slice (split-KV chosen by cuflash), SDPA on
the cache slice, ``flash_attn_with_kvcache`` (contiguous and paged) and
vLLM's paged attention, those two when importable.  Decoding is memory-bound,
so besides the time the table gives the bandwidth of the K/V bytes a call
must read: ``B x Hk x Nk x (d + dv) x itemsize / time``.

**Varlen** (``--sections varlen``): for each dtype, head dim, causal flag,
``--varlen-mean`` and mode: a ragged batch of ``B = tokens // mean``
sequences whose lengths (:func:`ragged_lengths`, from ``--seed``) sum to
``B x mean``, through cuflash ``varlen_attention`` (and its backward) and
``flash_attn_varlen_func``; the same total as ``B`` equal sequences through
cuflash varlen and through the dense ``tiled_attention`` (B, H, mean, d).
TFLOP/s counts each batch's own FLOPs (:func:`varlen_flops`).

Both sections follow the rest of the benchmark: each method is checked
against float64 NumPy on a small problem of the same kind before it is timed
(per sequence for varlen; on the gathered cache, the new tokens included, for
the KV cache), then timed by :func:`measure` (CUDA events, median of the
repeats), and a method that cannot run says why once, in a footnote.
"""
import numpy as np

from .gpu_check import (GRAD_NAMES, LOW_PRECISION, attention, failure_reason, judge,
                        np_dtype)
from .gpu_common import DECODE, flops, sig
from .gpu_methods import (CuflashTiled, first_call, input_sets_needed, make_set, measure,
                          reason_of, record_warnings, to_host64)
from .gpu_serving_methods import (CuflashVarlen, FlashAttnVarlen, KVProblem, kv_arrays,
                                  kv_methods, varlen_set)

__all__ = ["Serving", "ragged_lengths", "varlen_flops", "varlen_reference", "kv_reference",
           "print_serving"]

DENSE = "cuflash tiled (dense)"
EQUAL = "cuflash varlen (equal lengths)"
SHORT = 16  # the very short sequences of a ragged batch are 1 .. min(SHORT, mean) tokens


def ragged_lengths(total, mean, seed):
    """Lengths of ``total // mean`` sequences summing to ``total``, the same for a seed.

    Drawn uniform in ``1 .. 2 x mean``; with 4 or more sequences one in eight
    (at least one) is made very short (``1 .. min(16, mean)``: a query tile
    almost empty, the case that costs a varlen kernel most); then the others
    are moved, staying within ``1 .. 2 x mean``, until the sum is ``total``.
    """
    B = max(1, total // mean)
    if B == 1:
        return np.array([total], np.int64)
    rng = np.random.default_rng(seed)
    hi = 2 * mean
    lens = rng.integers(1, hi + 1, size=B)
    movable = np.ones(B, bool)
    if B >= 4:
        short = rng.choice(B, size=max(1, B // 8), replace=False)
        lens[short] = rng.integers(1, min(SHORT, mean) + 1, size=short.size)
        movable[short] = False
    idx = np.nonzero(movable)[0]
    diff = int(total - lens.sum())
    while diff:
        up = diff > 0
        room = hi - lens[idx] if up else lens[idx] - 1
        cand = idx[room > 0]  # never empty: (B - short) x 2 mean >= total >= B
        step = max(1, abs(diff) // cand.size)  # spread the difference evenly
        for i in rng.permutation(cand):
            m = min(step, hi - lens[i] if up else lens[i] - 1, abs(diff))
            lens[i] += m if up else -m
            diff -= m if up else -m
            if not diff:
                break
    return lens.astype(np.int64)


def varlen_flops(lens, H, d, causal, mode):
    """FLOPs of a varlen call: the sum over sequences of the flash-attn count of each,
    ``4 H n_b^2 d`` (halved when causal), times 2.5 for bwd and 3.5 for fwdbwd."""
    return float(sum(flops(1, H, int(n), int(n), d, causal, mode) for n in lens))


def varlen_reference(host, cu, causal, grad, low=None):
    """Plain attention (and gradients) of each sequence of a packed batch, packed again:
    the oracle of the varlen check (``low``: the low-precision baseline)."""
    q, k, v, do = host
    names = ("o",) + (GRAD_NAMES if grad else ())
    shape = {"o": q.shape, "dq": q.shape, "dk": k.shape, "dv": v.shape}
    out = {n: np.zeros(shape[n]) for n in names}
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        if e == s:
            continue
        seq = [np.swapaxes(x[s:e], 0, 1)[None] for x in (q, k, v, do)]  # (1, H, n, d)
        r = attention(*seq[:3], causal, seq[3] if grad else None, low=low)
        for n in names:
            out[n][s:e] = np.swapaxes(r[n][0], 0, 1)
    return out


def kv_reference(host, prob, low=None):
    """Plain attention of the new queries over the gathered cache: the first ``L`` cached
    rows and the ``Nq`` new tokens, causal bottom-right (the oracle of the KV check)."""
    L = prob.L
    k = np.concatenate([host["k_cache"][:, :, :L], host["k_new"]], axis=2)
    v = np.concatenate([host["v_cache"][:, :, :L], host["v_new"]], axis=2)
    return attention(host["q"], k, v, "bottom_right", low=low)


class Serving:
    """The serving sections of one benchmark run (``bench``: the :class:`~.gpu.Bench`
    whose device, torch, options, checks and cases they share)."""

    def __init__(self, bench):
        a = self.args = bench.args
        self.bench, self.device, self.torch, self.log = bench, bench.device, bench.torch, bench.log
        self.kv = kv_methods(a.backend, bench.torch, a.kv_page_sizes)
        self.varlen = [CuflashVarlen(a.backend)]
        if bench.torch.why != "left out (--no-torch)":
            self.varlen.append(FlashAttnVarlen(bench.torch))
        self.equal, self.dense = CuflashVarlen(a.backend, EQUAL), CuflashTiled(a.backend)
        self.verdicts = {}

    # -- correctness -------------------------------------------------------------
    def _check_methods(self, methods, kind, shape, run, judged):
        """Run each method once on the check problem and judge it; {name: record}."""
        out = {}
        for m in methods:
            rec = {"kind": kind, "shape": shape, "method": m.name, "status": "n/a"}
            if "lengths" in shape:
                rec["shape_text"] = (f"H={shape['H']}, lengths "
                                     f"{','.join(map(str, shape['lengths']))}")
            caught = []
            try:
                with record_warnings() as caught, m.context():
                    why = run(m, rec)
                    if why:
                        raise LookupError(why)
                ok, rec["errors"] = judged(rec.pop("outs"))
                rec["status"] = "passed" if ok else "failed"
                if not ok:
                    rec["reason"] = failure_reason(rec["errors"], _kind_text(kind))
            except LookupError as e:
                rec["reason"] = str(e)
            except Exception as e:  # the library's refusal or failure, reported, not hidden
                rec["reason"] = reason_of(e, caught)
            rec.pop("outs", None)
            self.log(f"  {m.name}: {rec['status']}" + (f" ({rec['reason']})"
                                                        if rec.get("reason") else ""))
            self.bench.checks.append(rec)
            out[m.name] = rec
        self.device.release()
        return out

    def kv_verdict(self, dtype, d, group, Nq):
        key = ("kvcache", dtype, d, group, Nq)
        if key not in self.verdicts:
            a, dev = self.args, self.device
            Hk = 2
            # capacity past the length: the lengths, not the array's end, must stop a kernel
            prob = KVProblem(2, Hk * group, Hk, Nq, a.check_n, d, dtype, capacity=a.check_n + 3)
            kind = {"section": "kvcache", "dtype": dtype, "d": d, "causal": True,
                    "group": group, "decode": True, "grad": False, "Nq": Nq}
            self.log(f"check {_kind_text(kind)} at B,H,Hk,Nq,Nk,d={tuple(prob.shape().values())}"
                     f" (cache {prob.L} + {Nq} new, capacity {prob.capacity}) against float64")
            _, host = kv_arrays(dev, prob, a.seed + 11, host=True)
            ref = kv_reference(host, prob)
            base = kv_reference(host, prob, low=dtype) if dtype in LOW_PRECISION else None

            def run(m, rec):
                why = m.unavailable(prob, dev)
                if why:
                    return why
                # fresh device copies per method: a method that fails to append must not
                # find the new tokens written by the one before
                st = m.prepare(dev, prob, {n: dev.from_host(x) for n, x in host.items()},
                               a.seed + 11)
                t, out = first_call(dev, lambda: m.call(st))
                rec["first_fwd_ms"] = t * 1e3
                rec["outs"] = {"o": to_host64(dev, m.result(st, out))}
            self.verdicts[key] = self._check_methods(
                self.kv, kind, prob.shape(), run, lambda outs: judge(outs, ref, base, dtype))
        return self.verdicts[key]

    def varlen_verdict(self, dtype, d, causal, grad):
        key = ("varlen", dtype, d, causal, grad)
        if key not in self.verdicts:
            a, dev = self.args, self.device
            n = a.check_n
            lens = ragged_lengths(2 * n, max(1, n // 2), a.seed + 3)
            H = 2
            kind = {"section": "varlen", "dtype": dtype, "d": d, "causal": causal, "group": 1,
                    "decode": False, "grad": grad}
            self.log(f"check {_kind_text(kind)}{' with gradients' if grad else ''} at lengths "
                     f"{lens.tolist()} H={H} d={d} against float64 per sequence")
            x, host, cu = varlen_set(dev, self.torch, lens, H, d, dtype, causal, a.seed + 13,
                                     host=True)
            ref = varlen_reference(host, cu, causal, grad)
            base = varlen_reference(host, cu, causal, grad, low=dtype) \
                if dtype in LOW_PRECISION else None

            def run(m, rec):
                why = m.unavailable(x, dev, grad)
                if why:
                    return why
                t_f, state = first_call(dev, lambda: m.forward(x, grad))
                rec["first_fwd_ms"] = t_f * 1e3
                outs = {"o": to_host64(dev, m.output(state))}
                if grad:
                    t_b, grads = first_call(dev, lambda: m.backward(x, state))
                    rec["first_bwd_ms"] = t_b * 1e3
                    outs.update((g, to_host64(dev, x_g)) for g, x_g in zip(GRAD_NAMES, grads))
                rec["outs"] = outs
            shape = {"B": len(lens), "H": H, "Hk": H, "d": d, "lengths": lens.tolist()}
            self.verdicts[key] = self._check_methods(
                self.varlen, kind, shape, run, lambda outs: judge(outs, ref, base, dtype))
        return self.verdicts[key]

    # -- timing ------------------------------------------------------------------
    def _timed(self, m, verdict, build_sets, mode):
        """Time ``m`` on the sets ``build_sets()`` makes (after its check passed)."""
        if verdict["status"] != "passed":
            return {"status": "failed check" if verdict["status"] == "failed" else "n/a",
                    "reason": verdict.get("reason", "")}
        a, caught = self.args, []
        try:
            with record_warnings() as caught, m.context():
                sets = build_sets()
                if mode == "kv":
                    call = m.call
                elif mode == "fwd":
                    def call(x):
                        return m.forward(x, False)
                elif mode == "bwd":  # the forward runs once per set, outside the timing
                    states = {id(x): m.forward(x, True) for x in sets}

                    def call(x):
                        return m.backward(x, states[id(x)], retain=True)
                else:
                    def call(x):
                        return m.backward(x, m.forward(x, True))
                r = measure(self.device, call, sets, a.warmup, a.reps, a.target_ms / 1e3)
                r["status"] = "ok"
        except Exception as e:  # out of memory, an unsupported case: say so in the table
            r = {"status": "n/a", "reason": reason_of(e, caught)}
        sets = states = call = None
        self.device.release()
        return r

    # -- KV cache ------------------------------------------------------------------
    def run_kvcache(self):
        a = self.args
        for dtype in a.dtypes:
            for B, H, Hk in DECODE[a.backend]:
                for Nq in a.kv_nq:
                    for Nk in a.decode_nk:
                        self._kv_case(dtype, B, H, Hk, Nq, Nk)

    def _kv_case(self, dtype, B, H, Hk, Nq, Nk):
        a, dev = self.args, self.device
        d = a.decode_dim
        prob = KVProblem(B, H, Hk, Nq, Nk, d, dtype)
        verdicts = self.kv_verdict(dtype, d, H // Hk, Nq)
        nsets = input_sets_needed(prob.kv_bytes + 2 * B * H * Nq * d * prob.itemsize,
                                  dev.l2_bytes)
        case = {"section": "kvcache", "dtype": dtype, "d": d, "causal": True, "mode": "fwd",
                "B": B, "H": H, "Hk": Hk, "Nq": Nq, "Nk": Nk, "Nnew": Nq, "cache_len": prob.L,
                "capacity": prob.capacity, "kv_bytes": prob.kv_bytes, "input_sets": nsets,
                "methods": {}}
        label = (f"kvcache {dtype} d={d} B={B} H={H}{f'/{Hk}' if Hk != H else ''} Nq={Nq} "
                 f"Nk={Nk}")
        for m in self.kv:
            def build(m=m):
                return [m.prepare(dev, prob, kv_arrays(dev, prob, a.seed + i), a.seed + i)
                        for i in range(nsets)]
            e = self._timed(m, verdicts[m.name], build, "kv")
            e["lib"] = m.lib
            if e["status"] == "ok":
                e["gbps"] = prob.kv_bytes / (e["ms"] * 1e-3) / 1e9
            self.log(f"{label}: {m.name}: " + (
                f"{e['ms']:.4g} ms, {e['gbps']:.4g} GB/s of K/V (first call "
                f"{e['first_call_ms']:.4g} ms, {e['calls_per_rep']} calls x {a.reps})"
                if e["status"] == "ok" else f"{e['status']}: {e['reason']}"))
            case["methods"][m.name] = e
        others = {n: e["ms"] for n, e in case["methods"].items()
                  if e["status"] == "ok" and e["lib"] != "cuflash"}
        case["fastest_other"] = min(others, key=others.get) if others else None
        for e in case["methods"].values():
            e["ratio_fastest_other"] = (e["ms"] / others[case["fastest_other"]]
                                        if others and e["lib"] == "cuflash"
                                        and e["status"] == "ok" else None)
        self.bench.cases.append(case)

    # -- varlen ----------------------------------------------------------------------
    def run_varlen(self):
        a = self.args
        for dtype in a.dtypes:
            for d in a.dims:
                for causal in a.causals:
                    for mean in a.varlen_mean:
                        self._varlen_rows(dtype, d, a.hidden // d, causal, mean)

    def _varlen_rows(self, dtype, d, H, causal, mean):
        a, dev, t = self.args, self.device, self.torch
        B = max(1, a.tokens // mean)
        lens, equal = ragged_lengths(B * mean, mean, a.seed), np.full(B, mean, np.int64)
        itemsize = np_dtype(dtype).itemsize
        nsets = input_sets_needed(5 * B * mean * H * d * itemsize, dev.l2_bytes)  # q k v do o
        for mode in a.modes:
            grad = mode != "fwd"
            v = self.varlen_verdict(dtype, d, causal, grad)
            dense_v = self.bench.verdict(dtype, d, causal, 1, False, grad)["cuflash tiled"]
            f_r, f_e = (varlen_flops(x, H, d, causal, mode) for x in (lens, equal))
            case = {"section": "varlen", "dtype": dtype, "d": d, "causal": causal, "mode": mode,
                    "B": B, "H": H, "Hk": H, "mean": mean, "tokens": int(B * mean),
                    "lens": lens.tolist(), "lens_min": int(lens.min()),
                    "lens_max": int(lens.max()), "flops_ragged": f_r, "flops_equal": f_e,
                    "input_sets": nsets, "methods": {}}
            label = (f"varlen {dtype} d={d} {'causal' if causal else 'non-causal'} {mode} "
                     f"B={B} H={H} mean={mean}")

            def ragged(ls):
                return lambda: [varlen_set(dev, t, ls, H, d, dtype, causal, a.seed + i)
                                for i in range(nsets)]
            runs = [(m, v[m.name], ragged(lens), f_r, m.name) for m in self.varlen]
            runs += [(self.equal, v["cuflash varlen"], ragged(equal), f_e, EQUAL),
                     (self.dense, dense_v,
                      lambda: [make_set(dev, t, (B, H, H, mean, mean, d), dtype, causal,
                                        a.seed + i) for i in range(nsets)], f_e, DENSE)]
            for m, verdict, build, fl, name in runs:
                e = self._timed(m, verdict, build, mode)
                e["flops"] = fl
                e["tflops"] = fl / (e["ms"] * 1e-3) / 1e12 if e["status"] == "ok" else None
                self.log(f"{label}: {name}: " + (
                    f"{e['ms']:.4g} ms, {e['tflops']:.4g} TFLOP/s (first call "
                    f"{e['first_call_ms']:.4g} ms, {e['calls_per_rep']} calls x {a.reps})"
                    if e["status"] == "ok" else f"{e['status']}: {e['reason']}"))
                case["methods"][name] = e
            _varlen_ratios(case)
            self.bench.cases.append(case)


def _varlen_ratios(case):
    ms = {n: e["ms"] for n, e in case["methods"].items() if e["status"] == "ok"}
    tf = {n: e["tflops"] for n, e in case["methods"].items() if e["status"] == "ok"}
    both = "cuflash varlen" in ms and DENSE in ms
    # ragged and dense do different FLOPs (sum n_b^2 vs B N^2): compare rates, not times
    case["ratio_varlen_dense_tflops"] = tf["cuflash varlen"] / tf[DENSE] if both else None
    case["ratio_equal_dense_time"] = ms[EQUAL] / ms[DENSE] if EQUAL in ms and DENSE in ms else None
    other = "flash_attn varlen"
    case["fastest_other"] = other if other in ms else None
    case["ratio_fastest_other"] = (ms["cuflash varlen"] / ms[other]
                                   if other in ms and "cuflash varlen" in ms else None)


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
def _kind_text(k):
    """A check kind in words; the grid's kinds have no "section"."""
    head = f"{k['dtype']} d={k['d']}"
    if k.get("section") == "kvcache":
        return f"kvcache {head} Nq={k['Nq']}{' GQA' if k['group'] > 1 else ''}"
    if k.get("section") == "varlen":
        return f"varlen {head} {'causal' if k['causal'] else 'non-causal'}"
    return (f"{head} {'causal' if k['causal'] else 'non-causal'}"
            f"{' GQA' if k['group'] > 1 else ''}{' decode' if k['decode'] else ''}")


KV_NOTES = [
    "cells: median ms per call / GB/s of K/V read / for cuflash rows, the time over the fastest "
    "non-cuflash method of the column (above 1: cuflash is slower); GB/s = B x Hk x Nk x (d + dv)"
    " x itemsize / time, the K/V bytes every method must read at least once (decoding is "
    "memory-bound; q, o and the append are not counted)",
    "Nk: keys per sequence after the append, all B sequences alike; every timed call gets "
    "cache_seqlens = Nk - Nq, so its append of Nq new tokens overwrites the rows the previous "
    "call wrote (the cache never grows); causal bottom-right (Nq = 1: every key)",
    "contiguous caches hold exactly Nk rows; 'paged p': pages of p tokens, ceil(Nk / p) per "
    "sequence, in a shuffled block table",
    "cuflash kvcache: check_inputs=False, as a decode loop runs it; '(check_inputs)': True, a "
    "device-to-host copy of the lengths on every call",
    "cuflash tiled and sdpa read the cache slice [:, :, :Nk] (q (B, H, Nq, d), k/v (B, Hk, Nk, d),"
    " one call over the batch; sdpa: torch's choice of kernel, enable_gqa for grouped heads, "
    "causal_lower_right for Nq > 1) and do not append",
    "flash_attn kvcache: flash_attn_with_kvcache(k=, v=) appends and attends on its own layout "
    "(B, Nk, Hk, d) or (pages, p, Hk, d), num_splits chosen by flash-attn; vllm paged: "
    "reshape_and_cache then paged_attention_v1/v2",
]
VARLEN_NOTES = [
    "cells: median ms per call / TFLOP/s of that batch's own FLOPs: the sum over its sequences "
    "of 4 H n_b^2 d, halved when causal (flash-attn's count per sequence), x2.5 for bwd, x3.5 "
    "for fwdbwd; a ragged batch does more FLOPs than equal lengths of the same total "
    "(sum n_b^2 >= B mean^2)",
    "ragged: B = tokens // mean sequences of 1 .. 2 x mean tokens (one in eight 1 .. 16), drawn "
    "from --seed, summing to B x mean (every length is in the JSON); equal lengths and dense: "
    "B sequences of mean tokens",
    "cuflash varlen: varlen_attention(_backward) with max_seqlen given and check_inputs=False "
    "(its backward still reads the boundaries on the host); flash_attn varlen: "
    "flash_attn_varlen_func on the same packed arrays; dense: tiled_attention on (B, H, mean, d)",
    "varlen / dense: cuflash varlen's TFLOP/s on the ragged batch over dense's (the goal: "
    "0.90 or more); equal / dense: the time of varlen on equal lengths over dense's (same work);"
    " cuflash / flash_attn: the times on the ragged batch",
]


def _cell(e, value_key, ratio_key=None):
    if e["status"] != "ok":
        return f"{'failed check' if e['status'] == 'failed check' else 'n/a'} [{e['note']}]"
    text = f"{sig(e['ms'])} / {sig(e[value_key])}"
    if ratio_key and e.get(ratio_key) is not None:
        text += f" / {e[ratio_key]:.2f}x"
    return text


def format_kvcache(cases, methods):
    """One markdown table per (dtype, d, B, H, Hk, Nq): a row per method, a column per Nk."""
    out = []
    groups = {}
    for c in cases:
        groups.setdefault((c["dtype"], c["d"], c["B"], c["H"], c["Hk"], c["Nq"]), []).append(c)
    for (dtype, d, B, H, Hk, Nq), cs in groups.items():
        hk = f"/{Hk}" if Hk != H else ""
        out += ["", f"### {dtype} d={d}, B={B} H={H}{hk}, Nq={Nq} ({Nq} new token"
                    f"{'s' if Nq > 1 else ''} per call)", ""]
        out.append("| method | " + " | ".join(f"Nk={c['Nk']}" for c in cs) + " |")
        out.append("|---|" + "---|" * len(cs))
        for m in methods:
            out.append(f"| {m} | " + " | ".join(_cell(c["methods"][m], "gbps",
                                                       "ratio_fastest_other") for c in cs) + " |")
        out.append("| fastest non-cuflash | " + " | ".join(c["fastest_other"] or "none ran"
                                                           for c in cs) + " |")
    return "\n".join(out[1:])


def format_varlen(cases, methods):
    """Markdown table: a row per (dtype, d, causal, mean, mode), ``ms / TFLOP/s`` per method."""
    def ratio(x):
        return f"{x:.2f}x" if x is not None else "n/a"
    head = ["dtype", "d", "causal", "mode", "B x H", "mean", "lengths"] + list(methods) + [
        "varlen / dense TFLOP/s", "equal / dense time", "cuflash / flash_attn time"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if h in ("d", "mean") else "---" for h in head) + "|"]
    for c in cases:
        row = [c["dtype"], str(c["d"]), "yes" if c["causal"] else "no", c["mode"],
               f"{c['B']} x {c['H']}", str(c["mean"]), f"{c['lens_min']}-{c['lens_max']}"]
        row += [_cell(c["methods"][m], "tflops") for m in methods]
        row += [ratio(c["ratio_varlen_dense_tflops"]), ratio(c["ratio_equal_dense_time"]),
                ratio(c["ratio_fastest_other"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_serving(res, say):
    """The KV-cache and varlen sections of the report (tables and notes), if they ran."""
    kv = [c for c in res["cases"] if c["section"] == "kvcache"]
    if kv:
        say()
        say("## KV-cache decode (attention_with_kvcache: append Nq tokens, attend over Nk keys)")
        say()
        say(format_kvcache(kv, res["kv_methods"]))
        say()
        for n in KV_NOTES:
            say(f"- {n}")
    vl = [c for c in res["cases"] if c["section"] == "varlen"]
    if vl:
        say()
        say("## Varlen (ragged batches packed without padding, against equal lengths)")
        say()
        say(format_varlen(vl, res["varlen_methods"]))
        say()
        for n in VARLEN_NOTES:
            say(f"- {n}")

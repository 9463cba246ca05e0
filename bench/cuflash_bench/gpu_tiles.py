"""The tiles section of the GPU benchmark: every tile pair the planner accepts, timed.

``--sections tiles``: for each dtype, head dim (``--dims``), causal case (``--causal``) and
mode of ``--modes`` that has tiles of its own -- ``fwd`` (the forward's kernel) and ``bwd``
(the backward's; its forward runs once per input set outside the timing, with the default
tiles) -- one problem of ``N = --tiles-n`` queries and keys (``B = tokens // N``, ``H =
hidden // d``, as the grid) runs through ``tiled_attention`` / ``tiled_attention_backward``
once with the default tiles and once with ``block_q`` and ``block_kv`` set to each other
pair that the default call's kernel accepts on this device (``cuflash.tiling.plan`` at the
runtime's shared-memory limit; ``--tiles-pairs`` narrows the list).  A pair with which the
call would run another kernel (the planner may send explicit tiles a kernel lacks to the SIMT
one) is shown as such and not timed: the table compares the tiles of one kernel.

Each row gives the pair, the kernel's threads and shared memory, the median time, TFLOP/s
and the speed against the default pair; a line per problem names the fastest pair.  That is
the evidence for moving a default (the curated tables in ``cuflash/tiling/curated.py``), which
instruction counts on a CPU cannot give.

Like the rest of the benchmark, each pair's call is checked before it is timed, on the check
problem (``B, H = 2, 2``, ``--check-n`` queries and keys, the same causal case) against
float64 NumPy with the rule of ``gpu_check.py``; the kernel the check launched
is the one the row names.

``--tiles-feature NAME`` (one of the features section's names, the window left out: e.g.
``bias-key-padding``) gives every call
that feature's arguments, so the rows are the tiles of the kernels with the logit features
(flash_fwd_tc_masked, flash_bwd_tc_masked, ...), checked against the features section's
float64 oracle (non-causal: it has no causal mask).
"""
from .gpu_check import GRAD_NAMES, LOW_PRECISION, attention
from .gpu_common import flops, sig
from .gpu_features import FEATURES, LABELS, feature_attention, feature_kwargs
from .gpu_methods import CuflashTiled, check_method, input_sets_needed, make_set

__all__ = ["TILE_MODES", "MAIN_KERNELS", "TILE_FEATURES", "CuflashTiles", "parse_pairs",
           "candidate_pairs", "run_tiles", "print_tiles", "kind_text"]

TILE_MODES = ("fwd", "bwd")
# the kernel whose tiles a call's block_q / block_kv set, per mode (the others a call launches
# -- the backward's preprocess and dQ conversion, a split-KV combine -- have no tiles of theirs)
MAIN_KERNELS = {"fwd": ("flash_fwd_tc", "flash_fwd_tf32", "flash_fwd", "flash_fwd_tc_masked",
                        "flash_fwd_tf32_masked", "flash_fwd_masked", "flash_fwd_wgmma"),
                "bwd": ("flash_bwd_tc", "flash_bwd_tf32", "flash_bwd_dkdv", "flash_bwd_tc_masked",
                        "flash_bwd_tc_band", "flash_bwd_tc_softcap", "flash_bwd_tc_alibi",
                        "flash_bwd_tc_dropout", "flash_bwd_tc_alibi_dropout", "flash_bwd_tc_alibi_softcap",
                        "flash_bwd_tf32_masked", "flash_bwd_dkdv_masked", "flash_bwd_wgmma")}
# --tiles-feature: the features section's names (a window changes the work a pair does)
TILE_FEATURES = tuple(name for name, _, _ in FEATURES if name != "window")


def parse_pairs(text):
    """``--tiles-pairs``: comma-separated ``BQxBKV`` (e.g. ``128x64,64x64``), or '' for all."""
    import argparse
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        bits = part.lower().split("x")
        try:
            bq, bkv = (int(b) for b in bits)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a pair BQxBKV of positive "
                                             "integers (e.g. 128x64)") from None
        if bq < 1 or bkv < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: block sizes must be positive")
        out.append((bq, bkv))
    return list(dict.fromkeys(out))


class CuflashTiles(CuflashTiled):
    """cuflash tiled_attention / tiled_attention_backward with explicit tiles on one of them
    (``mode`` fwd: the forward's; bwd: the backward's); None, None: the default call."""

    def __init__(self, backend, mode, block_q=None, block_kv=None, kw=None):
        super().__init__(backend)
        self.mode, self.block_q, self.block_kv = mode, block_q, block_kv
        self.kw = kw or {}  # a logit feature's arguments (--tiles-feature)

    def _tiles(self, mode):
        return dict(block_q=self.block_q, block_kv=self.block_kv) if mode == self.mode else {}

    def forward(self, x, grad):
        kw = {k: v for k, v in self.kw.items() if k != "return_dbias"}
        return self.cf.tiled_attention(x.q, x.k, x.v, causal="top_left" if x.causal else False,
                                       return_lse=grad, backend=self.backend, **self._tiles("fwd"),
                                       **kw)

    def backward(self, x, state, retain=False):
        o, lse = state
        return self.cf.tiled_attention_backward(x.do, x.q, x.k, x.v, o, lse,
                                                causal="top_left" if x.causal else False,
                                                backend=self.backend, **self._tiles("bwd"),
                                                **self.kw)


def _runtime(backend):
    if backend == "cuda":
        from cuflash import cuda_backend as mod
    else:
        from cuflash import emulator_backend as mod
    return mod.runtime()


def candidate_pairs(runtime, kernel, d, dtype, only=None):
    """(default plan, [other plans], [(block_q, block_kv, why refused)]) of ``kernel`` for a
    (d, d) ``dtype`` problem: the pairs of its tiling's choices that ``cuflash.tiling.plan``
    accepts at the runtime's limit; with ``only`` (a list of pairs), those of them -- and the
    ones the planner refuses, with its reason (a pair asked for is never dropped silently)."""
    from cuflash import tiling
    kw = dict(limit=runtime.smem_limit, limit_source=runtime.smem_source)
    dflt = tiling.plan(kernel, d, d, dtype, **kw)
    t = tiling.kernel_tiling(kernel)
    pairs = only or [(bq, bkv) for bq in t.block_q_choices for bkv in t.block_kv_choices]
    plans, refused = [], []
    for bq, bkv in pairs:
        if (bq, bkv) == (dflt.block_q, dflt.block_kv):
            continue
        try:
            plans.append(tiling.plan(kernel, d, d, dtype, bq, bkv, **kw))
        except ValueError as e:  # shared memory, registers, occupancy, an unswept pair
            if only:
                refused.append((bq, bkv, (str(e).strip().splitlines() or [""])[0]))
    return dflt, plans, refused


def _check(bench, dtype, d, causal, mode, bq, bkv):
    """Run one pair's call on the check problem, judge it and name the kernel it launched."""
    from cuflash.launch.common import observe_launches
    a, dev = bench.args, bench.device
    n = a.check_n
    shape = (2, 2, 2, n, n, d)
    grad = mode == "bwd"
    tiles = "default tiles" if bq is None else f"{mode} tiles {bq} x {bkv}"
    what = (f"{dtype} d={d} {'causal' if causal else 'non-causal'} {tiles}"
            f"{' with gradients' if grad else ''}")
    bench.log(f"check {what} at B,H,Hk,Nq,Nk,d={shape} against float64")
    x, host = make_set(dev, bench.torch, shape, dtype, causal, a.seed + 13, host=True)
    do = host[3] if grad else None
    feature, names = a.tiles_feature, GRAD_NAMES
    label = LABELS[feature] if feature else None
    if feature:  # the features section's oracle (non-causal), its arguments on the device
        hkw = feature_kwargs(feature, True, None, 2, 2, n, dtype)
        names += ("dbias",) if grad and hkw.get("return_dbias") else ()
        ref = feature_attention(*host[:3], do, hkw)
        base = feature_attention(*host[:3], do, hkw, low=dtype) if dtype in LOW_PRECISION else None
        kw = feature_kwargs(feature, False, dev.xp, 2, 2, n, dtype)
        what += f" with {label}"
    else:
        ref = attention(*host[:3], causal, do)
        base = attention(*host[:3], causal, do, low=dtype) if dtype in LOW_PRECISION else None
        kw = None
    m = CuflashTiles(a.backend, mode, bq, bkv, kw)
    rec = {"kind": {"section": "tiles", "dtype": dtype, "d": d, "causal": causal, "mode": mode,
                    "block_q": bq, "block_kv": bkv, "feature": label, "group": 1,
                    "decode": False, "grad": grad},
           "shape": dict(zip(("B", "H", "Hk", "Nq", "Nk", "d"), shape)),
           "method": m.name, "status": "n/a"}
    with observe_launches() as seen:
        check_method(dev, m, x, grad, ref, base, dtype, what, rec, names)
    ran = [e["kernel"] for e in seen if e["kernel"] in MAIN_KERNELS[mode]]
    # the backward's check runs a forward first: its main kernel is the last one of the mode
    rec["kernel"] = ran[-1] if ran else None
    bench.log(f"  {m.name} {tiles}: {rec['status']} ({rec['kernel']})" +
              (f" ({rec['reason']})" if rec.get("reason") else ""))
    bench.checks.append(rec)
    dev.release()
    return rec


def run_tiles(bench):
    """Time the default call and every other accepted pair; appends to bench.cases."""
    a, dev = bench.args, bench.device
    N = a.tiles_n
    runtime = _runtime(a.backend)
    for dtype in a.dtypes:
        for d in a.dims:
            B, H = max(1, a.tokens // N), a.hidden // d
            shape = (B, H, H, N, N, d)
            for causal in a.causals:
                dev.release()
                x0 = make_set(dev, bench.torch, shape, dtype, causal, a.seed)
                nsets = input_sets_needed(x0.nbytes + x0.q.nbytes, dev.l2_bytes)
                sets = [x0] + [make_set(dev, bench.torch, shape, dtype, causal, a.seed + i)
                               for i in range(1, nsets)]
                kw = (feature_kwargs(a.tiles_feature, False, dev.xp, B, H, N, dtype)
                      if a.tiles_feature else None)
                for mode in (m for m in a.modes if m in TILE_MODES):
                    _run_problem(bench, runtime, dtype, d, causal, mode, shape, sets,
                                 flops(B, H, N, N, d, causal, mode), kw)
                sets = x0 = kw = None
                dev.release()


def _run_problem(bench, runtime, dtype, d, causal, mode, shape, sets, nflops, kw):
    a = bench.args
    N = shape[3]
    dflt_rec = _check(bench, dtype, d, causal, mode, None, None)
    kernel = dflt_rec["kernel"]
    rows, refused = [(None, None, None)], []
    if kernel is not None:
        dflt_plan, others, refused = candidate_pairs(runtime, kernel, d, dtype,
                                                     a.tiles_pairs or None)
        rows = [(None, None, dflt_plan)] + [(p.block_q, p.block_kv, p) for p in others]
    base_ms = None
    for bq, bkv, plan in rows:
        rec = dflt_rec if bq is None else _check(bench, dtype, d, causal, mode, bq, bkv)
        if bq is not None and rec["status"] == "passed" and rec["kernel"] != kernel:
            e = {"status": "n/a", "reason": f"these tiles run {rec['kernel']}, not {kernel}"}
        else:
            e = bench.time_method(CuflashTiles(a.backend, mode, bq, bkv, kw), mode, sets, rec)
        ms = e.get("ms")
        if bq is None:
            base_ms = ms
        case = _case(dtype, d, causal, mode, shape, nflops, len(sets), bq is None, rec["kernel"],
                     plan, plan.block_q if plan else None, plan.block_kv if plan else None, e,
                     a.tiles_feature)
        case["speed_vs_default"] = base_ms / ms if ms and base_ms else None
        pair = "default" if bq is None else f"{bq} x {bkv}"
        bench.log(f"tiles {dtype} d={d} {'causal' if causal else 'non-causal'} {mode} N={N} "
                  f"{kernel} {pair}" + (f" ({plan.block_q} x {plan.block_kv})" if plan and
                                        bq is None else "") + ": " +
                  (f"{ms:.4g} ms" if e["status"] == "ok" else f"{e['status']}: {e['reason']}"))
        bench.cases.append(case)
    for bq, bkv, why in refused:  # pairs asked for that the planner refuses: the reason, no call
        bench.cases.append(_case(dtype, d, causal, mode, shape, nflops, len(sets), False, kernel,
                                 None, bq, bkv, {"status": "n/a", "reason": why}, a.tiles_feature))


def _case(dtype, d, causal, mode, shape, nflops, nsets, default, kernel, plan, bq, bkv, e,
          feature=None):
    B, H, _, N, _, _ = shape
    ms = e.get("ms")
    e["tflops"] = nflops / (ms * 1e-3) / 1e12 if ms else None
    return {"section": "tiles", "dtype": dtype, "d": d, "causal": causal, "mode": mode,
            "B": B, "H": H, "Hk": H, "Nq": N, "Nk": N, "default": default, "kernel": kernel,
            "feature": LABELS[feature] if feature else None,
            "block_q": bq, "block_kv": bkv, "threads": plan.threads if plan else None,
            "shared_bytes": plan.shared_bytes if plan else None, "flops": nflops,
            "input_sets": nsets, "methods": {"cuflash tiled": e}, "speed_vs_default": None}


def print_tiles(res, say):
    """The tiles section's table and its fastest pair per problem, if it ran."""
    cases = [c for c in res["cases"] if c["section"] == "tiles"]
    if not cases:
        return
    say()
    say("## Tiles (cuflash tiled with each accepted block_q x block_kv of its kernel)")
    say()
    say("| dtype | d | causal | mode | B x H | N | kernel | block_q x block_kv | threads | "
        "shared B | ms | TFLOP/s | speed vs default |")
    say("|---|---:|---|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    best = {}
    for c in cases:
        e = c["methods"]["cuflash tiled"]
        ok = e["status"] == "ok"
        ms = sig(e["ms"]) if ok else f"{e['status']} [{e.get('note', '?')}]"
        pair = "n/a" if c["block_q"] is None else f"{c['block_q']} x {c['block_kv']}"
        if c["default"]:
            pair += " (default)"
        spd = c["speed_vs_default"]
        say(f"| {c['dtype']} | {c['d']} | {'yes' if c['causal'] else 'no'} | {c['mode']} | "
            f"{c['B']} x {c['H']} | {c['Nq']} | {c['kernel'] or 'n/a'} | {pair} | "
            f"{c['threads'] or ''} | {c['shared_bytes'] or ''} | {ms} | "
            f"{sig(e['tflops']) if ok else ''} | {'' if spd is None else f'{spd:.2f}x'} |")
        key = (c["dtype"], c["d"], c["causal"], c["mode"])
        if ok and (key not in best or e["ms"] < best[key]["methods"]["cuflash tiled"]["ms"]):
            best[key] = c
    say()
    for f in sorted({c.get("feature") for c in cases if c.get("feature")}):
        say(f"- every call with the logit feature {f} (--tiles-feature): the tiles of the "
            "kernels with the features")
    for (dtype, d, causal, mode), c in best.items():
        spd = c["speed_vs_default"]
        say(f"- fastest, {dtype} d={d} {'causal' if causal else 'non-causal'} {mode}: "
            f"{c['block_q']} x {c['block_kv']}" + (" (the default)" if c["default"] else
                                                   "" if spd is None else
                                                   f", {spd:.2f}x the default's speed"))
    say("- speed vs default: the default pair's time over this pair's (above 1: faster); a "
        "pair is timed only after its call passed the check at the check shape")


def kind_text(k):
    """A tiles check kind in words."""
    tiles = "default tiles" if k["block_q"] is None else f"{k['block_q']} x {k['block_kv']}"
    return (f"tiles {k['dtype']} d={k['d']} {'causal' if k['causal'] else 'non-causal'} "
            f"{k['mode']} {tiles}" + (f" with {k['feature']}" if k.get("feature") else ""))

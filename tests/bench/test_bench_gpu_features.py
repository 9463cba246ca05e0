"""The GPU benchmark's features section (bench/cuflash_bench/gpu_features.py), run on the
emulator.

Its oracle is checked on its own (central differences, the plain oracle when no feature is
on), then one small run of the section checks the tables against the JSON, the checks, the
emulator's missing verdicts, a failing check and the option errors.
"""
import json
import re

import numpy as np
import pytest

import cuflash
from cuflash_bench import gpu_features as feat
from cuflash_bench.gpu_check import attention

from test_bench_gpu import run_main, table_rows

ALL = [name for name, _, _ in feat.FEATURES]
# the tables' labels of those features, in their order (what the tables, logs and JSON show)
SHOWN = ["bias (B,1,1,N)", "bias (1,H,N,N)", "bias (1,H,N,N) + dbias", "ALiBi", "softcap 30",
         "dropout 0.1", "window (N/8, 0)"]
TARGET_OF = {label: target for _, label, target in feat.FEATURES}
RUN = ["--backend", "emulator", "--sections", "features", "--dims", "16", "--modes",
       "fwd,fwdbwd", "--feature-n", "32", "--feature-windows", "4,8", "--reps", "2",
       "--warmup", "0", "--plot", ""]


def _problem(rng, B, H, Nq, Nk, d):
    q = rng.standard_normal((B, H, Nq, d))
    k, v = (rng.standard_normal((B, H, Nk, d)) for _ in range(2))
    do = rng.standard_normal((B, H, Nq, d))
    return q, k, v, do


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("nq,nk", [(5, 7), (7, 5)])
def test_feature_oracle_gradients_are_central_differences(name, nq, nk):
    """dq, dk, dv (and dbias) of the float64 oracle against central differences of
    sum(o * do), every element, for each feature, Nq != Nk both ways."""
    rng = np.random.default_rng(3)
    B, H, d = 2, 2, 3
    q, k, v, do = _problem(rng, B, H, nq, nk, d)
    kw = feature_kwargs_host(name, B, H, nq, nk)
    if "bias" in kw:  # a bias of the problem's (Nq, Nk), finite where it is not a mask
        kw["bias"] = kw["bias"] + 0.3 * rng.standard_normal(kw["bias"].shape)
    if "softcap" in kw:
        kw["softcap"] = 1.5  # where tanh bends over the logits' range
    out = feat.feature_attention(q, k, v, do, kw)
    args = {"q": q, "k": k, "v": v}
    if kw.get("return_dbias"):
        args["bias"] = kw["bias"]
    h = 1e-6
    for wrt, x in args.items():
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            if not np.isfinite(x[idx]):
                continue
            vals = []
            for sgn in (1, -1):
                xp = x.copy()
                xp[idx] += sgn * h
                a = dict(args, **{wrt: xp})
                kk = dict(kw, bias=a["bias"]) if "bias" in a else kw
                vals.append(float((feat.feature_attention(a["q"], a["k"], a["v"], None,
                                                          kk)["o"] * do).sum()))
            num[idx] = (vals[0] - vals[1]) / (2 * h)
        got = out["d" + wrt]
        assert got.shape == x.shape
        err = np.abs(got - num).max()
        assert err <= 1e-6 * max(1.0, np.abs(num).max()), (name, wrt, err)
        assert np.abs(num).max() > 1e-3  # the gradient is not trivially zero


def feature_kwargs_host(name, B, H, nq, nk):
    """feature_kwargs for an Nq x Nk problem (the section's are square): the bias cut to
    (Nq, Nk), the window scaled to the keys."""
    kw = feat.feature_kwargs(name, True, None, B, H, max(nq, nk), "float64",
                             window=max(1, nk // 3) if name == "window" else None)
    if "bias" in kw:
        kw["bias"] = np.array(kw["bias"][..., :nq if kw["bias"].shape[-2] > 1 else 1, :nk])
        if kw["bias"].shape[-2] == 1:  # the key padding: the last keys of each row masked
            kw["bias"][..., nk - 1:] = -np.inf
    return kw


def test_feature_oracle_without_features_is_the_plain_oracle():
    rng = np.random.default_rng(5)
    q, k, v, do = _problem(rng, 2, 3, 9, 13, 8)
    for low in (None, "float16"):
        a = feat.feature_attention(q, k, v, do, {}, low=low)
        b = attention(q, k, v, False, do, low=low)
        for n in ("o", "dq", "dk", "dv"):
            np.testing.assert_allclose(a[n], b[n], rtol=1e-6 if low else 1e-13, atol=1e-6,
                                       err_msg=f"{n} {low}")


def test_feature_oracle_low_precision_baseline_rounds():
    """The float16 baseline differs from float64 by float16-sized errors, never more."""
    rng = np.random.default_rng(6)
    q, k, v, do = _problem(rng, 1, 2, 17, 17, 16)
    for name in ALL:
        kw = feat.feature_kwargs(name, True, None, 1, 2, 17, "float16")
        ref = feat.feature_attention(q, k, v, do, kw)
        low = feat.feature_attention(q, k, v, do, kw, low="float16")
        for n in ref:
            err = np.abs(low[n] - ref[n]).max()
            assert 0 < err < 0.05 * max(1.0, np.abs(ref[n]).max()), (name, n, err)


def test_dropout_rows_use_cuflash_mask():
    """The oracle's dropout is the mask cuflash.dropout_mask defines (kept scaled by 1/(1-p))."""
    rng = np.random.default_rng(7)
    q, k, v, _ = _problem(rng, 2, 2, 6, 9, 4)
    kw = feat.feature_kwargs("dropout0.1", True, None, 2, 2, 9, "float64")
    s = np.matmul(q, np.swapaxes(k, -1, -2)) / 2.0
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    keep = cuflash.dropout_mask((2, 2, 6, 9), 0.1, feat.DROPOUT_SEED)
    want = np.matmul(P * keep / 0.9, v)
    np.testing.assert_allclose(feat.feature_attention(q, k, v, None, kw)["o"], want, rtol=1e-13)


@pytest.mark.parametrize("nq,nk", [(16, 16), (5, 11), (11, 5)])
def test_visible_fraction_counts_the_band(nq, nk):
    for left in range(0, nk + 2):
        i = np.arange(nq)[:, None] + nk - nq
        j = np.arange(nk)[None, :]
        want = ((j >= i - left) & (j <= i)).mean()
        assert feat.visible_fraction(nq, nk, left) == pytest.approx(want, abs=1e-15)


def test_window_sizes_and_verdicts():
    assert feat.window_sizes(4096) == [256, 512, 1024, 2048]
    assert feat.window_sizes(8) == [1, 2, 4]
    assert feat.meets_target(0.05, 0.10, "cuda") is True
    assert feat.meets_target(0.15, 0.10, "cuda") is False
    assert feat.meets_target(0.15, 0.20, "cuda") is True
    assert feat.meets_target(0.05, 0.10, "emulator") is None
    assert feat.meets_target(None, 0.10, "cuda") is None
    assert feat.meets_target(0.05, None, "cuda") is None


@pytest.fixture(scope="module")
def featured(tmp_path_factory):
    ok, why = cuflash.available_backends()["emulator"]
    if not ok:
        pytest.fail(f"the emulator backend must run here: {why}")
    d = tmp_path_factory.mktemp("bench_features")
    rc, out, err = run_main(RUN + ["--json", str(d / "f.json")])
    assert rc == 0, out + err
    return {"out": out, "err": err, "res": json.loads((d / "f.json").read_text())}


def _num(cell):
    return float(cell.replace(",", ""))


def test_features_table_matches_the_json(featured):
    out, res = featured["out"], featured["res"]
    _, rows = table_rows(out, "Logit features (cuflash tiled, non-causal, each feature alone "
                              "against the plain call)")
    cases = [c for c in res["cases"] if c["section"] == "features" and c["table"] == "features"]
    assert [r[5] for r in rows] == ["none"] + SHOWN + ["none"] + SHOWN
    assert len(rows) == len(cases) == 2 * (1 + len(SHOWN))
    for r, c in zip(rows, cases):
        assert (r[0], int(r[1]), r[2], r[5]) == (c["dtype"], c["d"], c["mode"], c["feature"])
        e = c["methods"]["cuflash tiled"]
        assert e["status"] == "ok"
        assert _num(r[6]) == pytest.approx(e["ms"], rel=1e-3)
        base = next(b for b in cases if b["mode"] == c["mode"] and b["feature"] == "none")
        assert c["overhead"] == pytest.approx(e["ms"] / base["methods"]["cuflash tiled"]["ms"] - 1)
        assert r[7] == f"{100 * c['overhead']:+.1f}%"
        # issue 13's targets on fwdbwd rows, with no verdict from emulated times
        if c["mode"] == "fwdbwd" and TARGET_OF.get(c["feature"]) is not None:
            assert r[8] == f"<= +{100 * TARGET_OF[c['feature']]:.0f}%: n/a (emulator)"
            assert c["meets_target"] is None
        else:
            assert r[8] == "" and c["target"] is None
        assert c["B"] == 64 // 32 and c["H"] == 32 // 16 and c["Nq"] == c["Nk"] == 32


def test_window_table_divides_by_the_visible_fraction(featured):
    out, res = featured["out"], featured["res"]
    body = out.split("### Sliding windows", 1)[1]
    rows = [[x.strip() for x in ln.strip("|").split("|")] for ln in body.splitlines()
            if ln.startswith("| float16")]
    cases = [c for c in res["cases"] if c["section"] == "features" and c["table"] == "windows"]
    assert [(c["mode"], c["window_left"]) for c in cases] == [
        ("fwd", 4), ("fwd", 8), ("fwdbwd", 4), ("fwdbwd", 8)]
    assert len(rows) == len(cases)
    for r, c in zip(rows, cases):
        frac = feat.visible_fraction(32, 32, c["window_left"])
        assert c["visible_fraction"] == frac and _num(r[5]) == pytest.approx(frac, abs=1e-4)
        base = next(b for b in res["cases"] if b["section"] == "features" and
                    b["mode"] == c["mode"] and b["feature"] == "none")
        ratio = c["methods"]["cuflash tiled"]["ms"] / frac / base["methods"]["cuflash tiled"]["ms"]
        assert c["ms_per_visible_vs_plain"] == pytest.approx(ratio)
        assert _num(r[7]) == pytest.approx(ratio, abs=0.006)
        assert c["flops"] == pytest.approx(4.0 * 2 * 2 * 32 * 32 * 16 * frac *
                                           {"fwd": 1.0, "fwdbwd": 3.5}[c["mode"]])


def test_every_feature_checked_with_and_without_gradients(featured):
    checks = [c for c in featured["res"]["checks"] if c["kind"].get("section") == "features"]
    assert sorted((c["kind"]["feature"], c["kind"]["grad"]) for c in checks) == sorted(
        (f, g) for f in ["none"] + SHOWN for g in (False, True))
    for c in checks:
        assert c["status"] == "passed", c
        want = {"o"} | ({"dq", "dk", "dv"} if c["kind"]["grad"] else set())
        if c["kind"]["grad"] and c["kind"]["feature"].endswith("+ dbias"):
            want.add("dbias")
        assert set(c["errors"]) == want
        assert all(e["max_abs_err"] <= e["bound"] for e in c["errors"].values())
    assert re.search(r"\| features float16 d=16 dropout 0\.1 \| yes \| 2,2,2,\d+,\d+ \| "
                     r"cuflash tiled \| passed \|", featured["out"])


def test_a_feature_that_fails_its_check_is_reported_not_timed(monkeypatch):
    real = feat.CuflashFeature.forward

    def wrong(self, x, grad):
        out = real(self, x, grad)
        if self.feature != "softcap30":
            return out
        o = out[0] if isinstance(out, tuple) else out
        o = o + 1
        return (o,) + tuple(out[1:]) if isinstance(out, tuple) else o
    monkeypatch.setattr(feat.CuflashFeature, "forward", wrong)
    rc, out, err = run_main(["--backend", "emulator", "--sections", "features", "--dims", "16",
                             "--modes", "fwd", "--feature-n", "16", "--feature-windows", "4",
                             "--tokens", "16", "--hidden", "16", "--reps", "2", "--warmup", "0",
                             "--plot", ""])
    assert rc == 1, out + err
    row = next(ln for ln in out.splitlines() if "| softcap 30 |" in ln)
    assert "failed check [1]" in row
    assert re.search(r"^\[1\] cuflash tiled: correctness check failed \(o: max\|err\| .*\) on "
                     r"float16 d=16 softcap 30$", out, re.M)
    ok = [ln for ln in out.splitlines() if "| dropout 0.1 |" in ln and "| fwd |" in ln]
    assert ok and "failed" not in ok[0]


@pytest.mark.parametrize("argv,msg", [
    (["--feature-n", "128", "--tokens", "64"], "argument --feature-n: 128 exceeds --tokens 64"),
    (["--feature-n", "32", "--feature-windows", "32"],
     "argument --feature-windows: 32 is not in 1 .. feature-n - 1 (31)"),
    (["--feature-n", "32", "--feature-windows", "0"],
     "argument --feature-windows: '0' is not a positive integer"),
])
def test_feature_option_errors(argv, msg):
    rc, out, err = run_main(["--backend", "emulator", "--sections", "features"] + argv)
    assert rc == 2 and msg in err, err

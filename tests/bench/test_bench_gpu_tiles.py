"""The GPU benchmark's tiles section (bench/cuflash_bench/gpu_tiles.py), run on the
emulator.

The pair list against the planner, one small run of the section (the table against the JSON,
each pair checked and launched with its own kernel, the default first), a pair that runs
another kernel, a pair the planner refuses, a failing check, and the option errors.
"""
import argparse
import json

import numpy as np
import pytest

import cuflash
from cuflash_bench import gpu_tiles as tiles
from cuflash import emulator_backend, tiling

from test_bench_gpu import run_main, table_rows

TITLE = "Tiles (cuflash tiled with each accepted block_q x block_kv of its kernel)"
RUN = ["--backend", "emulator", "--sections", "tiles", "--dims", "16", "--causal", "no",
       "--modes", "fwd,bwd", "--tiles-n", "32", "--tiles-pairs", "16x16,64x32", "--reps", "2",
       "--warmup", "0", "--plot", ""]


def test_parse_pairs():
    assert tiles.parse_pairs("128x64, 64X32,128x64") == [(128, 64), (64, 32)]
    assert tiles.parse_pairs("") == []
    for bad in ("128", "128x", "ax4", "0x16", "16x16x16"):
        with pytest.raises(argparse.ArgumentTypeError):
            tiles.parse_pairs(bad)


@pytest.mark.parametrize("kernel,dtype,d", [("flash_fwd_tc", "float16", 64),
                                            ("flash_bwd_tc", "bfloat16", 128),
                                            ("flash_fwd_tf32", "float32", 128),
                                            ("flash_bwd_tf32", "float32", 64)])
def test_candidate_pairs_are_what_the_planner_accepts(kernel, dtype, d):
    """Every pair of the kernel's choices but the default, exactly those the planner takes at
    the runtime's limit; a list of pairs narrows it and names the refused ones with the
    planner's reason."""
    rt = emulator_backend.runtime()
    dflt, plans, refused = tiles.candidate_pairs(rt, kernel, d, dtype)
    assert refused == []
    assert (dflt.block_q, dflt.block_kv) == (tiling.plan(kernel, d, d, dtype,
                                                         limit=rt.smem_limit).block_q,
                                             tiling.plan(kernel, d, d, dtype,
                                                         limit=rt.smem_limit).block_kv)
    t = tiling.kernel_tiling(kernel)
    want = []
    for bq in t.block_q_choices:
        for bkv in t.block_kv_choices:
            try:
                tiling.plan(kernel, d, d, dtype, bq, bkv, limit=rt.smem_limit)
            except ValueError:
                continue
            if (bq, bkv) != (dflt.block_q, dflt.block_kv):
                want.append((bq, bkv))
    assert [(p.block_q, p.block_kv) for p in plans] == want and want
    assert all(p.kernel == kernel for p in plans)
    # narrowed: one accepted pair, the default (left out: it is always timed) and one refused
    some = want[0]
    _, plans, refused = tiles.candidate_pairs(rt, kernel, d, dtype,
                                              [some, (dflt.block_q, dflt.block_kv), (48, 16)])
    assert [(p.block_q, p.block_kv) for p in plans] == [some]
    assert [(bq, bkv) for bq, bkv, _ in refused] == [(48, 16)]
    assert "block_q=48" in refused[0][2]


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    ok, why = cuflash.available_backends()["emulator"]
    if not ok:
        pytest.fail(f"the emulator backend must run here: {why}")
    d = tmp_path_factory.mktemp("bench_tiles")
    rc, out, err = run_main(RUN + ["--json", str(d / "t.json")])
    assert rc == 0, out + err
    return {"out": out, "err": err, "res": json.loads((d / "t.json").read_text())}


def test_tiles_table_matches_the_json(tiled):
    out, res = tiled["out"], tiled["res"]
    _, rows = table_rows(out, TITLE)
    cases = [c for c in res["cases"] if c["section"] == "tiles"]
    rt = emulator_backend.runtime()
    fwd = tiling.plan("flash_fwd_tc", 16, 16, "float16", limit=rt.smem_limit)
    bwd = tiling.plan("flash_bwd_tc", 16, 16, "float16", limit=rt.smem_limit)
    assert [(c["mode"], c["kernel"], c["block_q"], c["block_kv"], c["default"]) for c in cases] == [
        ("fwd", "flash_fwd_tc", fwd.block_q, fwd.block_kv, True),
        ("fwd", "flash_fwd_tc", 16, 16, False), ("fwd", "flash_fwd_tc", 64, 32, False),
        ("bwd", "flash_bwd_tc", bwd.block_q, bwd.block_kv, True),
        ("bwd", "flash_bwd_tc", 16, 16, False), ("bwd", "flash_bwd_tc", 64, 32, False)]
    assert len(rows) == len(cases)
    for r, c in zip(rows, cases):
        e = c["methods"]["cuflash tiled"]
        assert e["status"] == "ok"
        assert (r[0], int(r[1]), r[2], r[3], r[6]) == ("float16", 16, "no", c["mode"], c["kernel"])
        assert r[7] == f"{c['block_q']} x {c['block_kv']}" + (" (default)" if c["default"] else "")
        plan = (tiling.plan(c["kernel"], 16, 16, "float16", c["block_q"], c["block_kv"],
                            limit=rt.smem_limit))
        assert (int(r[8]), int(r[9])) == (plan.threads, plan.shared_bytes) == (c["threads"],
                                                                              c["shared_bytes"])
        assert float(r[10].replace(",", "")) == pytest.approx(e["ms"], rel=1e-3)
        base = next(b for b in cases if b["mode"] == c["mode"] and b["default"])
        spd = base["methods"]["cuflash tiled"]["ms"] / e["ms"]
        assert c["speed_vs_default"] == pytest.approx(spd) and r[12] == f"{spd:.2f}x"
        assert c["flops"] == pytest.approx(4.0 * 2 * 2 * 32 * 32 * 16 *
                                           {"fwd": 1.0, "bwd": 2.5}[c["mode"]])
    for mode in ("fwd", "bwd"):
        fastest = min((c for c in cases if c["mode"] == mode),
                      key=lambda c: c["methods"]["cuflash tiled"]["ms"])
        line = next(ln for ln in out.splitlines()
                    if ln.startswith(f"- fastest, float16 d=16 non-causal {mode}: "))
        assert f"{fastest['block_q']} x {fastest['block_kv']}" in line


def test_each_pair_checked_with_its_kernel(tiled):
    checks = [c for c in tiled["res"]["checks"] if c["kind"].get("section") == "tiles"]
    assert [(c["kind"]["mode"], c["kind"]["block_q"], c["kind"]["block_kv"], c["kernel"])
            for c in checks] == [
        ("fwd", None, None, "flash_fwd_tc"), ("fwd", 16, 16, "flash_fwd_tc"),
        ("fwd", 64, 32, "flash_fwd_tc"), ("bwd", None, None, "flash_bwd_tc"),
        ("bwd", 16, 16, "flash_bwd_tc"), ("bwd", 64, 32, "flash_bwd_tc")]
    for c in checks:
        assert c["status"] == "passed", c
        assert set(c["errors"]) == ({"o", "dq", "dk", "dv"} if c["kind"]["grad"] else {"o"})
    assert "| tiles float16 d=16 non-causal bwd 64 x 32 | yes | 2,2,2," in tiled["out"]


def _small(extra):
    return ["--backend", "emulator", "--sections", "tiles", "--dims", "16", "--causal", "no",
            "--modes", "fwd", "--tiles-n", "16", "--tokens", "16", "--hidden", "16", "--reps",
            "2", "--warmup", "0", "--plot", ""] + extra


def test_a_pair_on_another_kernel_or_refused_is_reported_not_timed(monkeypatch):
    """A pair whose call runs another kernel than the default's is named and not timed (here
    the 16 x 32 pair's backward gets k as a view 4 bytes into its buffer, which cp.async
    cannot read: the SIMT flash_bwd_dkdv runs instead of flash_bwd_tf32); a pair asked for
    that the planner refuses gets its reason, also where the library refuses it (float32's
    backward does not send tiles flash_bwd_tf32 lacks to the SIMT kernel)."""
    real = tiles.CuflashTiles.backward

    def misaligned(self, x, state, retain=False):
        if self.block_q != 16:
            return real(self, x, state, retain)
        o, lse = state
        k = np.empty(x.k.size + 1, x.k.dtype)[1:].reshape(x.k.shape)
        k[...] = x.k
        return self.cf.tiled_attention_backward(x.do, x.q, k, x.v, o, lse, backend=self.backend,
                                                block_q=16, block_kv=32)
    monkeypatch.setattr(tiles.CuflashTiles, "backward", misaligned)
    rc, out, err = run_main(["--backend", "emulator", "--sections", "tiles", "--dtypes", "float32",
                             "--dims", "32", "--causal", "no", "--modes", "bwd", "--tiles-n", "16",
                             "--tokens", "16", "--hidden", "32", "--reps", "2", "--warmup", "0",
                             "--plot", "", "--tiles-pairs", "16x32,48x32"])
    assert rc == 0, out + err
    _, rows = table_rows(out, TITLE)
    assert rows[0][6] == "flash_bwd_tf32" and rows[0][7].endswith("(default)")
    simt = next(r for r in rows if r[7] == "16 x 32")
    assert simt[6] == "flash_bwd_dkdv" and simt[10].startswith("n/a [")
    n = simt[10].split("[")[1].rstrip("]")
    assert f"[{n}] cuflash tiled: these tiles run flash_bwd_dkdv, not flash_bwd_tf32" in out
    refused = next(r for r in rows if r[7] == "48 x 32")
    assert refused[6] == "flash_bwd_tf32" and refused[10].startswith("n/a [")
    n = refused[10].split("[")[1].rstrip("]")
    assert f"[{n}] cuflash tiled: flash_bwd_tf32 does not support block_q=48" in out
    # through the library: the float32 backward refuses tiles flash_bwd_tf32 lacks
    q = np.random.default_rng(0).standard_normal((1, 2, 16, 32)).astype(np.float32)
    o, lse = cuflash.tiled_attention(q, q, q, return_lse=True, backend="emulator")
    with pytest.raises(ValueError, match=r"block_q=16, block_kv=16 with d=32, dv=32, float32: "
                       r"the tensor-core kernel flash_bwd_tf32 does not take these tiles"):
        cuflash.tiled_attention_backward(q, q, q, q, o, lse, block_q=16, block_kv=16,
                                         backend="emulator")


def test_a_pair_that_fails_its_check_is_reported_not_timed(monkeypatch):
    real = tiles.CuflashTiles.forward

    def wrong(self, x, grad):
        out = real(self, x, grad)
        return out + 1 if self.block_q == 16 else out
    monkeypatch.setattr(tiles.CuflashTiles, "forward", wrong)
    rc, out, err = run_main(_small(["--tiles-pairs", "16x16,32x16"]))
    assert rc == 1, out + err
    _, rows = table_rows(out, TITLE)
    bad = next(r for r in rows if r[7] == "16 x 16")
    assert "failed check [1]" in bad[10]
    assert "[1] cuflash tiled: correctness check failed (o: max|err|" in out
    assert "on float16 d=16 non-causal fwd tiles 16 x 16" in out
    good = next(r for r in rows if r[7] == "32 x 16")
    assert "failed" not in good[10] and good[12].endswith("x")


def test_tiles_of_the_kernels_with_a_feature(tmp_path):
    """--tiles-feature: every call takes the feature's arguments, so the rows are the masked
    kernels' tiles, each checked against the features' oracle (dbias too on the backward; the
    forward leaves return_dbias out)."""
    rc, out, err = run_main(["--backend", "emulator", "--sections", "tiles", "--dims", "16",
                             "--causal", "no", "--modes", "fwd,bwd", "--tiles-n", "16",
                             "--tokens", "16", "--hidden", "32", "--reps", "2", "--warmup", "0",
                             "--plot", "", "--tiles-pairs", "16x16", "--json",
                             str(tmp_path / "t.json"), "--tiles-feature", "bias-full-dbias"])
    assert rc == 0, out + err
    assert ("- every call with the logit feature bias (1,H,N,N) + dbias (--tiles-feature): the "
            "tiles of the kernels with the features") in out
    _, rows = table_rows(out, TITLE)
    assert [(r[3], r[6], r[7].endswith("(default)")) for r in rows] == [
        ("fwd", "flash_fwd_tc_masked", True), ("fwd", "flash_fwd_tc_masked", False),
        ("bwd", "flash_bwd_tc_masked", True), ("bwd", "flash_bwd_tc_masked", False)]
    assert all(not r[10].startswith(("n/a", "failed")) for r in rows), rows
    res = json.loads((tmp_path / "t.json").read_text())
    checks = [c for c in res["checks"] if c["kind"].get("section") == "tiles"]
    assert [(c["kind"]["mode"], c["kind"]["feature"], c["status"], sorted(c["errors"]))
            for c in checks] == [
        ("fwd", "bias (1,H,N,N) + dbias", "passed", ["o"])] * 2 + [
        ("bwd", "bias (1,H,N,N) + dbias", "passed", ["dbias", "dk", "dq", "dv", "o"])] * 2
    assert all(c["feature"] == "bias (1,H,N,N) + dbias" for c in res["cases"]
               if c["section"] == "tiles")


@pytest.mark.parametrize("argv,msg", [
    (["--tiles-feature", "alibi", "--causal", "yes"], "argument --tiles-feature: the features' "
     "check has no causal mask"),
    (["--tiles-feature", "window"], "argument --tiles-feature: invalid choice"),
    # the names, not the tables' labels
    (["--tiles-feature", "bias (B,1,1,N)"], "argument --tiles-feature: invalid choice"),
    (["--tiles-n", "128", "--tokens", "64"], "argument --tiles-n: 128 exceeds --tokens 64"),
    (["--modes", "fwdbwd"], "argument --modes: the tiles section times fwd and bwd"),
    (["--tiles-pairs", "64x"], "argument --tiles-pairs: '64x' is not a pair BQxBKV"),
])
def test_tiles_option_errors(argv, msg):
    rc, out, err = run_main(["--backend", "emulator", "--sections", "tiles"] + argv)
    assert rc == 2 and msg in err, err


def test_tiles_feature_names_are_plain_words():
    """--tiles-feature takes names a shell passes unquoted, one per feature of the features
    table but the window; the tables keep their labels."""
    from cuflash_bench import gpu, gpu_features
    action = next(a for a in gpu.build_parser()._actions if "--tiles-feature" in a.option_strings)
    assert list(action.choices) == ["bias-key-padding", "bias-full", "bias-full-dbias", "alibi",
                                    "softcap30", "dropout0.1"]
    assert [gpu_features.LABELS[n] for n in action.choices] == [
        "bias (B,1,1,N)", "bias (1,H,N,N)", "bias (1,H,N,N) + dbias", "ALiBi", "softcap 30",
        "dropout 0.1"]
    args = gpu.build_parser().parse_args(["--tiles-feature", "bias-key-padding"])
    assert args.tiles_feature == "bias-key-padding"


def test_tiles_is_not_a_default_section():
    from cuflash_bench import gpu
    args = gpu.build_parser().parse_args(["--backend", "emulator"])
    assert "tiles" not in args.sections and "tiles" in gpu.SECTIONS

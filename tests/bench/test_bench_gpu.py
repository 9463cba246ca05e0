"""The GPU benchmark's table, JSON and plot code, run on the emulator backend (no GPU needed).

``python -m cuflash bench --gpu --backend emulator`` runs the same code as on a
GPU with the CUDA kernels emulated on the CPU and ``time.perf_counter`` for the
CUDA events.  One small run in-process (shared by several tests) and one in a
fresh process; both stay tiny because an emulated launch takes 0.05-0.1 s.
"""
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash_bench import gpu
from cuflash_bench.gpu_methods import L2_SPAN, MAX_SETS, input_sets_needed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# small enough that every input set of the run below is rotated (a set is 8-17 KiB)
L2_BYTES = 16384
RUN = ["--backend", "emulator", "--sections", "grid,decode,host", "--dims", "16", "--seqlens",
       "16,32", "--causal", "both",
       "--modes", "fwd,bwd", "--decode-nk", "32", "--host-calls", "2", "--reps", "2",
       "--warmup", "0", "--l2-bytes", str(L2_BYTES)]


def _emulator_or_skip():
    ok, why = cuflash.available_backends()["emulator"]
    if not ok:
        pytest.fail(f"the emulator backend must run here: {why}")


def run_main(argv):
    """(exit status, stdout, stderr) of ``gpu.main(argv)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = gpu.main(argv, prog="bench_gpu")
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    _emulator_or_skip()
    d = tmp_path_factory.mktemp("bench_gpu")
    rc, out, err = run_main(RUN + ["--json", str(d / "r.json"), "--plot", str(d / "r.png")])
    assert rc == 0, out + err
    return {"out": out, "err": err, "dir": d, "res": json.loads((d / "r.json").read_text())}


def expected_flops(c):
    f = 4.0 * c["B"] * c["H"] * c["Nq"] * c["Nk"] * c["d"]
    if c["causal"] and c["Nq"] == c["Nk"]:
        f /= 2
    return f * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[c["mode"]]


def table_rows(out, title):
    """The rows of the markdown table under ``## title``, as lists of cells."""
    lines = out.split(f"## {title}\n", 1)[1].strip().splitlines()
    rows = []
    for ln in lines[2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return lines[0], rows


def test_flop_convention():
    assert gpu.flops(2, 3, 5, 7, 11, False, "fwd") == 4 * 2 * 3 * 5 * 7 * 11
    assert gpu.flops(1, 1, 8, 8, 4, True, "fwd") == 4 * 8 * 8 * 4 / 2
    assert gpu.flops(1, 1, 1, 8, 4, True, "fwd") == 4 * 8 * 4  # Nq != Nk: not halved
    assert gpu.flops(1, 1, 8, 8, 4, False, "bwd") == 2.5 * 4 * 8 * 8 * 4
    assert gpu.flops(1, 1, 8, 8, 4, False, "fwdbwd") == 3.5 * 4 * 8 * 8 * 4


def test_input_rotation_count():
    mib = 2 ** 20
    assert input_sets_needed(10 * mib, None) == 1
    assert input_sets_needed(10 * mib, 0) == 1
    assert input_sets_needed(268 * mib, 50 * mib) == 1          # the FA2 grid on an H100
    assert input_sets_needed(16 * mib, 50 * mib) == math.ceil(L2_SPAN * 50 / 16)
    assert input_sets_needed(1024, 50 * mib) == MAX_SETS


def test_table_rows(emulated):
    out, res = emulated["out"], emulated["res"]
    head, rows = table_rows(out, "Main grid")
    names = res["methods"]
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert cols[:7] == ["dtype", "d", "causal", "mode", "B x H", "Nq", "Nk"]
    assert cols[7:7 + len(names)] == names
    assert cols[-2:] == ["tiled / fastest other", "tiled / sdpa flash"]
    # one row per (causal, N, mode), in run order: tokens 64 -> B = 64 // N, hidden 32 -> H = 2
    want = [("no" if not c else "yes", m, f"{64 // n} x 2", str(n))
            for c in (False, True) for n in (16, 32) for m in ("fwd", "bwd")]
    assert [(r[2], r[3], r[4], r[5]) for r in rows] == want
    number = r"[0-9.,]+(e-?\d+)?"
    for r in rows:
        assert r[0] == "float16" and r[1] == "16" and r[5] == r[6]
        cells = dict(zip(names, r[7:7 + len(names)]))
        for m in ("cuflash tiled", "cuflash standard"):
            assert re.fullmatch(f"{number} / {number}", cells[m]), (m, cells[m])
        for m, cell in cells.items():  # every cell is a number pair or points at a footnote
            assert re.fullmatch(f"{number} / {number}", cell) or re.fullmatch(
                r"(n/a|failed check) \[\d+\]", cell), (m, cell)
        assert re.fullmatch(r"\d+\.\d\dx \(.+\)", r[-2])
    _, drows = table_rows(out, "Decode (Nq = 1)")
    assert [(r[4], r[5], r[6]) for r in drows] == [("1 x 4", "1", "32"), ("2 x 4", "1", "32"),
                                                   ("2 x 4/2", "1", "32")]
    # footnotes: each [n] once, with the method and the reason
    for n in sorted({int(x) for x in re.findall(r"\[(\d+)\]", "\n".join(map(str, rows + drows)))}):
        assert re.search(rf"^\[{n}\] \S.*: \S", out, re.M), n


def test_header_sections_and_progress(emulated):
    out, err = emulated["out"], emulated["err"]
    assert out.startswith("cuflash GPU benchmark, emulator backend: CPU emulator")
    assert re.search(r"CuPy .+; NumPy .+; PyTorch .+; cuDNN .+; Python ", out)
    for title in ("## First call of each configuration", "## Host time per call",
                  "## Correctness checks"):
        assert title in out
    assert "check float16 d=16 non-causal" in err and "cuflash tiled: passed" in err
    assert re.search(r"grid float16 d=16 causal bwd B=2 H=2 Nq=32 Nk=32: cuflash tiled: "
                     r"\S+ ms, \S+ TFLOP/s", err)


def test_json_numbers(emulated):
    res = emulated["res"]
    assert res["config"]["reps"] == 2 and res["timer"] == "time.perf_counter"
    assert len(res["cases"]) == 8 + 3
    notes = {f["n"]: f for f in res["footnotes"]}
    assert len({f["reason"] for f in res["footnotes"]}) == len(notes)  # each reason once
    for c in res["cases"]:
        assert c["flops"] == expected_flops(c)
        assert c["input_sets"] == input_sets_needed(c["input_set_bytes"] + c["B"] * c["H"] * c["Nq"]
                                                    * c["d"] * 2, L2_BYTES) > 1
        timed = {}
        for name, e in c["methods"].items():
            if e["status"] != "ok":
                assert e["reason"] and name in notes[e["note"]]["methods"]
                assert notes[e["note"]]["reason"] == e["reason"]
                continue
            assert len(e["runs_ms"]) == 2 and all(t > 0 for t in e["runs_ms"])
            assert e["ms"] == pytest.approx(float(np.median(e["runs_ms"])), rel=1e-12)
            assert e["first_call_ms"] > 0 and e["calls_per_rep"] >= 1
            assert e["tflops"] == pytest.approx(c["flops"] / (e["ms"] * 1e-3) / 1e12, rel=1e-12)
            timed[name] = e["ms"]
        assert {"cuflash tiled", "cuflash standard"} <= set(timed)
        others = {n: t for n, t in timed.items() if n != "cuflash tiled"}
        assert c["fastest_other"] == min(others, key=others.get)
        tiled = timed["cuflash tiled"]
        assert c["ratio_fastest_other"] == pytest.approx(tiled / min(others.values()))
        if "sdpa flash" in timed:
            assert c["ratio_sdpa_flash"] == pytest.approx(tiled / timed["sdpa flash"])
        else:
            assert c["ratio_sdpa_flash"] is None
    # correctness: every method timed on a kind passed the check of that kind, output and grads
    checks = res["checks"]
    kinds = {(k["dtype"], k["d"], k["causal"], k["group"], k["decode"], k["grad"])
             for k in (c["kind"] for c in checks)}
    assert len(kinds) == 2 * 2 + 2  # (causal x grads) + MHA and GQA decode
    for c in checks:
        if c["method"].startswith("cuflash"):
            assert c["status"] == "passed", c
        if c["status"] == "passed":
            want = {"o", "dq", "dk", "dv"} if c["kind"]["grad"] else {"o"}
            assert set(c["errors"]) == want and all(e["passed"] for e in c["errors"].values())
            assert all(e["max_abs_err"] <= e["bound"] for e in c["errors"].values())
            assert c["first_fwd_ms"] > 0 and (c["first_bwd_ms"] > 0 if c["kind"]["grad"] else True)
    host = res["host_time"]
    assert [(h["method"], h["mode"]) for h in host][:2] == [("cuflash tiled", "fwd"),
                                                            ("cuflash tiled", "bwd")]
    assert all(h["us_per_call"] > 0 for h in host if h["status"] == "ok")
    assert host[0]["status"] == "ok" and host[1]["status"] == "ok"


def test_plot_is_a_png_at_the_printed_path(emulated):
    png = emulated["dir"] / "r.png"
    assert f"plot: {png}" in emulated["out"].splitlines()
    assert os.path.isabs(str(png)) and png.read_bytes()[:8] == PNG_MAGIC
    assert f"json: {emulated['dir'] / 'r.json'}" in emulated["out"].splitlines()


def test_command_line_run_in_a_fresh_process(tmp_path):
    _emulator_or_skip()
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "cuflash", "bench", "--gpu", "--backend", "emulator",
                        "--dims", "16", "--seqlens", "32", "--causal", "yes", "--modes", "fwd",
                        "--sections", "grid", "--host-calls", "0", "--no-torch", "--json", "g.json",
                        "--plot", "g.png"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    _, rows = table_rows(r.stdout, "Main grid")
    assert len(rows) == 1 and rows[0][:7] == ["float16", "16", "yes", "fwd", "2 x 2", "32", "32"]
    assert "SDPA methods not run: left out (--no-torch)" in r.stdout
    res = json.loads((tmp_path / "g.json").read_text())
    assert res["methods"] == ["cuflash tiled", "cuflash standard"]
    e = res["cases"][0]["methods"]["cuflash tiled"]
    assert e["status"] == "ok" and e["ms"] > 0
    assert (tmp_path / "g.png").read_bytes()[:8] == PNG_MAGIC
    assert f"plot: {tmp_path / 'g.png'}" in r.stdout.splitlines()


def test_a_method_that_fails_its_check_is_reported_not_timed(monkeypatch):
    _emulator_or_skip()
    from cuflash_bench import gpu_methods as mth
    forward = mth.CuflashStandard.forward
    monkeypatch.setattr(mth.CuflashStandard, "forward",
                        lambda self, x, grad: forward(self, x, grad) * 1.01)
    rc, out, err = run_main(["--backend", "emulator", "--dims", "16", "--seqlens", "16",
                             "--causal", "no", "--modes", "fwd", "--sections", "grid",
                             "--host-calls", "0", "--no-torch", "--plot", ""])
    assert rc == 1, out + err
    _, rows = table_rows(out, "Main grid")
    assert rows[0][7] != "" and re.fullmatch(r"\S+ / \S+", rows[0][7])  # tiled still timed
    assert rows[0][8] == "failed check [1]"
    assert re.search(r"^\[1\] cuflash standard: correctness check failed \(o: max\|err\| ", out,
                     re.M)


def test_a_cuflash_that_cannot_run_is_reported_and_fails_the_run(monkeypatch):
    _emulator_or_skip()
    from cuflash_bench import gpu_methods as mth

    def refuse(self, x, grad):
        raise ValueError("no kernel for this\nsecond line")
    monkeypatch.setattr(mth.CuflashTiled, "forward", refuse)
    rc, out, err = run_main(["--backend", "emulator", "--dims", "16", "--seqlens", "16",
                             "--causal", "no", "--modes", "fwd", "--sections", "grid",
                             "--host-calls", "0", "--no-torch", "--plot", ""])
    assert rc == 1
    _, rows = table_rows(out, "Main grid")
    assert rows[0][7] == "n/a [1]" and re.fullmatch(r"\S+ / \S+", rows[0][8])
    assert "[1] cuflash tiled: ValueError: no kernel for this" in out.splitlines()
    assert "cuflash tiled ran in no case" in err


def test_cuda_backend_without_gpu_exits_2_with_one_line():
    ok, why = cuflash.available_backends()["cuda"]
    if ok:
        pytest.skip("a GPU is present: --backend cuda would run the benchmark")
    rc, out, err = run_main(["--backend", "cuda"])
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [
        f"bench_gpu: cannot run --backend cuda: {' '.join(why.split())}"]


BAD = [
    ["--reps", "0"], ["--dims", "0"], ["--dims", "16,x"], ["--seqlens", "abc"],
    ["--seqlens", ""], ["--dtypes", "float8"], ["--modes", "fwd,back"], ["--causal", "maybe"],
    ["--backend", "numpy"], ["--tokens", "-1"], ["--warmup", "-1"], ["--decode-nk", "0"],
    ["--host-calls", "x"], ["--target-ms", "0"], ["--target-ms", "fast"],
    ["--backend", "emulator", "--hidden", "40", "--dims", "16"],
    ["--backend", "emulator", "--seqlens", "128", "--tokens", "64"],
    ["--backend", "cuda", "--reps", "3"], ["--no-such-option"],
    ["--sections", "grid,serve"], ["--sections", ""], ["--kv-nq", "0"], ["--kv-page-sizes", "x"],
    ["--varlen-mean", "x"], ["--backend", "emulator", "--varlen-mean", "128", "--tokens", "64"],
    ["--backend", "emulator", "--kv-nq", "64", "--decode-nk", "32,128"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_options_are_one_line_argparse_errors(argv):
    rc, out, err = run_main(argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_gpu: error: "), err


def test_help_states_the_emulator_defaults():
    rc, out, _ = run_main(["--help"])
    assert rc == 0
    text = " ".join(out.split())
    assert "emulator" in text and "dims 16,32, seqlens 32,64, tokens 64, hidden 32, reps 2" in text
    for opt in ("--dtypes", "--dims", "--seqlens", "--causal", "--modes", "--tokens", "--hidden",
                "--json", "--plot", "--reps", "--warmup"):
        assert opt in out


# ---------------------------------------------------------------------------
# the serving sections: KV-cache decode and varlen
# ---------------------------------------------------------------------------
from cuflash_bench import gpu_serving as serving  # noqa: E402
from cuflash_bench import gpu_serving_methods as smth  # noqa: E402
from cuflash_bench.gpu_check import attention  # noqa: E402
from cuflash_bench.gpu_methods import HostDevice  # noqa: E402

SERVE = ["--backend", "emulator", "--sections", "kvcache,varlen", "--dims", "16", "--causal",
         "both", "--modes", "fwd,fwdbwd", "--decode-nk", "32", "--kv-nq", "1,4",
         "--kv-page-sizes", "4,16", "--varlen-mean", "16", "--tokens", "64", "--hidden", "32",
         "--reps", "2", "--warmup", "0", "--target-ms", "1", "--plot", ""]
KV_CUFLASH = ["cuflash kvcache", "cuflash kvcache (check_inputs)", "cuflash kvcache paged 4",
              "cuflash kvcache paged 16", "cuflash tiled (cache slice)"]
NUMBER = r"[0-9.,]+(e-?\d+)?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _emulator_or_skip()
    d = tmp_path_factory.mktemp("bench_serving")
    rc, out, err = run_main(SERVE + ["--json", str(d / "s.json")])
    assert rc == 0, out + err
    return {"out": out, "err": err, "res": json.loads((d / "s.json").read_text())}


def _sub_tables(out, title):
    """{### heading: rows} of the tables under ``## title`` (up to the next ## heading)."""
    body = out.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for part in body.split("\n### ")[1:]:
        head, rest = part.split("\n", 1)
        lines = [ln for ln in rest.strip().splitlines() if ln.startswith("|")]
        tables[head] = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return tables


def test_ragged_lengths_are_seeded_bounded_and_sum_to_the_total():
    for total, mean in ((64, 16), (16384, 512), (16384, 2048), (514, 128), (40, 16), (20, 16),
                        (7, 16), (1000, 1)):
        a = serving.ragged_lengths(total, mean, 5)
        assert a.sum() == total and len(a) == max(1, total // mean)
        assert np.array_equal(a, serving.ragged_lengths(total, mean, 5))  # same seed, same batch
        if len(a) > 1:
            assert a.min() >= 1 and a.max() <= 2 * mean
        if len(a) >= 4 and mean > 1:
            assert a.min() <= min(16, mean) and len(set(a.tolist())) > 1  # some very short
    assert not np.array_equal(serving.ragged_lengths(16384, 512, 1),
                              serving.ragged_lengths(16384, 512, 2))


def test_varlen_flops_per_sequence():
    lens = [1, 5, 30]
    want = sum(4 * 3 * n * n * 8 for n in lens)
    assert serving.varlen_flops(lens, 3, 8, False, "fwd") == want
    assert serving.varlen_flops(lens, 3, 8, True, "fwd") == want / 2
    assert serving.varlen_flops(lens, 3, 8, True, "fwdbwd") == 3.5 * want / 2
    assert serving.varlen_flops([16] * 4, 2, 8, False, "bwd") == gpu.flops(
        4, 2, 16, 16, 8, False, "bwd")


def test_bottom_right_oracle_and_paged_layout():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 3, 4))
    k, v = rng.standard_normal((2, 1, 2, 7, 4))
    o = attention(q, k, v, "bottom_right")["o"]
    for i in range(3):  # query i sees keys 0 .. i + 7 - 3
        s = np.einsum("hd,hjd->hj", q[0, :, i], k[0][:, :i + 5]) / 2.0  # scale 1/sqrt(4)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hj,hjd->hd", p / p.sum(-1, keepdims=True), v[0][:, :i + 5])
        np.testing.assert_allclose(o[0, :, i], want, rtol=1e-12)
    dev = HostDevice()
    for cap, page in ((32, 4), (35, 16), (33, 1), (7, 256)):
        prob = smth.KVProblem(3, 4, 2, 1, cap, 8, "float16")
        _, host = smth.kv_arrays(dev, prob, 0, host=True)
        table = smth.page_table(prob, page, 1)
        pages = smth.to_pages(dev, host["k_cache"], page, table)
        assert pages.flags.c_contiguous and sorted(table.ravel()) == list(range(pages.shape[0]))
        back = pages[table].transpose(0, 2, 1, 3, 4).reshape(3, 2, -1, 8)[:, :, :cap]
        assert np.array_equal(back, host["k_cache"]), (cap, page)


def test_kvcache_tables(served):
    out, res = served["out"], served["res"]
    assert res["kv_methods"][:len(KV_CUFLASH)] == KV_CUFLASH
    tables = _sub_tables(out, "KV-cache decode")
    want = [f"float16 d=16, B={b} H=4{hk}, Nq={nq} ({nq} new token{'s' if nq > 1 else ''} per "
            "call)" for b, hk in ((1, ""), (2, ""), (2, "/2")) for nq in (1, 4)]
    assert list(tables) == want
    torch_ran = res["torch"] == "ok"
    for rows in tables.values():
        assert [r[0] for r in rows] == res["kv_methods"] + ["fastest non-cuflash"]
        for r in rows[:-1]:
            assert len(r) == 2  # one Nk column
            if r[0] in KV_CUFLASH:  # ms / GB/s, and the ratio when another library ran
                tail = r" / \d+\.\d\dx" if torch_ran else ""
                assert re.fullmatch(f"{NUMBER} / {NUMBER}{tail}", r[1]), r
            else:
                assert re.fullmatch(f"{NUMBER} / {NUMBER}", r[1]) or re.fullmatch(
                    r"(n/a|failed check) \[\d+\]", r[1]), r
        assert rows[-1][1] == ("sdpa (cache slice)" if torch_ran else "none ran")
    assert "every timed call gets cache_seqlens = Nk - Nq" in out
    assert re.search(r"^\[\d+\] .*flash_attn kvcache.*: runs on a GPU only", out, re.M)
    assert re.search(r"kvcache float16 d=16 B=2 H=4/2 Nq=4 Nk=32: cuflash kvcache paged 4: "
                     r"\S+ ms, \S+ GB/s of K/V", served["err"])


def test_kvcache_json(served):
    res = served["res"]
    cases = [c for c in res["cases"] if c["section"] == "kvcache"]
    assert [(c["B"], c["H"], c["Hk"], c["Nq"], c["Nk"]) for c in cases] == [
        (b, 4, hk, nq, 32) for b, hk in ((1, 4), (2, 4), (2, 2)) for nq in (1, 4)]
    for c in cases:
        assert c["kv_bytes"] == c["B"] * c["Hk"] * 32 * 2 * 16 * 2
        assert c["cache_len"] == 32 - c["Nq"] and c["Nnew"] == c["Nq"]
        ok = {n: e for n, e in c["methods"].items() if e["status"] == "ok"}
        assert set(KV_CUFLASH) <= set(ok)
        for e in ok.values():
            assert len(e["runs_ms"]) == 2 and all(t > 0 for t in e["runs_ms"])
            assert e["ms"] == pytest.approx(float(np.median(e["runs_ms"])), rel=1e-12)
            assert e["gbps"] == pytest.approx(c["kv_bytes"] / (e["ms"] * 1e-3) / 1e9, rel=1e-12)
        others = {n: e["ms"] for n, e in ok.items() if e["lib"] != "cuflash"}
        assert c["fastest_other"] == (min(others, key=others.get) if others else None)
        for n, e in c["methods"].items():
            if e["lib"] == "cuflash" and others:
                assert e["ratio_fastest_other"] == pytest.approx(e["ms"] / min(others.values()))
            else:
                assert e["ratio_fastest_other"] is None


def test_varlen_table_and_json(served):
    out, res = served["out"], served["res"]
    head, rows = table_rows(out, "Varlen (ragged batches packed without padding, against equal "
                                 "lengths)")
    names = res["varlen_methods"]
    assert names[0] == "cuflash varlen" and names[-2:] == ["cuflash varlen (equal lengths)",
                                                           "cuflash tiled (dense)"]
    assert [c.strip() for c in head.strip("|").split("|")][7:7 + len(names)] == names
    assert [(r[2], r[3], r[4], r[5]) for r in rows] == [
        (c, m, "4 x 2", "16") for c in ("no", "yes") for m in ("fwd", "fwdbwd")]
    for r in rows:
        cells = dict(zip(names, r[7:7 + len(names)]))
        for m in ("cuflash varlen", "cuflash varlen (equal lengths)", "cuflash tiled (dense)"):
            assert re.fullmatch(f"{NUMBER} / {NUMBER}", cells[m]), (m, cells[m])
        assert re.fullmatch(r"\d+\.\d\dx", r[-3]) and re.fullmatch(r"\d+\.\d\dx", r[-2])
    cases = [c for c in res["cases"] if c["section"] == "varlen"]
    assert len(cases) == 4
    for c in cases:
        lens = c["lens"]
        assert sum(lens) == c["tokens"] == 64 and len(lens) == c["B"] == 4
        assert lens == serving.ragged_lengths(64, 16, res["config"]["seed"]).tolist()
        assert c["lens_min"] == min(lens) >= 1 and c["lens_max"] == max(lens) <= 32
        half = 2 if c["causal"] else 1
        factor = {"fwd": 1.0, "fwdbwd": 3.5}[c["mode"]]
        assert c["flops_ragged"] == factor * sum(4 * 2 * n * n * 16 for n in lens) / half
        assert c["flops_equal"] == expected_flops(dict(c, Nq=16, Nk=16))
        assert c["flops_ragged"] > c["flops_equal"]  # sum n^2 > B mean^2 for unequal lengths
        m = c["methods"]
        for name in names:
            e = m[name]
            if e["status"] != "ok":
                continue
            assert e["flops"] == (c["flops_equal"] if "equal" in name or "dense" in name
                                  else c["flops_ragged"])
            assert e["tflops"] == pytest.approx(e["flops"] / (e["ms"] * 1e-3) / 1e12, rel=1e-12)
        assert c["ratio_varlen_dense_tflops"] == pytest.approx(
            m["cuflash varlen"]["tflops"] / m["cuflash tiled (dense)"]["tflops"])
        assert c["ratio_equal_dense_time"] == pytest.approx(
            m["cuflash varlen (equal lengths)"]["ms"] / m["cuflash tiled (dense)"]["ms"])
    assert "sum over its sequences of 4 H n_b^2 d, halved when causal" in out


def test_serving_checks_recorded_as_passed(served):
    checks = served["res"]["checks"]
    kv = {(c["kind"]["group"], c["kind"]["Nq"]) for c in checks
          if c["kind"].get("section") == "kvcache"}
    vl = {(c["kind"]["causal"], c["kind"]["grad"]) for c in checks
          if c["kind"].get("section") == "varlen"}
    assert kv == {(1, 1), (1, 4), (2, 1), (2, 4)}
    assert vl == {(False, False), (False, True), (True, False), (True, True)}
    for c in checks:
        if c["method"].startswith("cuflash"):
            assert c["status"] == "passed", c
        if c["status"] == "passed":
            want = {"o", "dq", "dk", "dv"} if c["kind"]["grad"] else {"o"}
            assert set(c["errors"]) == want
            assert all(e["passed"] and e["max_abs_err"] <= e["bound"] for e in c["errors"].values())
        else:
            assert c["status"] == "n/a" and c["reason"]
    assert re.search(r"\| varlen float16 d=16 causal \| yes \| H=2, lengths [\d,]+ \| "
                     r"cuflash varlen \| passed \|", served["out"])


def test_serving_checks_can_fail(monkeypatch):
    """A cache that never receives the new tokens, and a varlen output off by 1%: both
    caught by the float64 checks, reported, not timed, and the run fails."""
    _emulator_or_skip()
    call = smth.CuflashKV.call

    def no_append(self, st):
        if self.page:  # only the paged method forgets to write k_new/v_new
            return self.cf.attention_with_kvcache(st.q, st.kc, st.vc, cache_seqlens=st.sl + 1,
                                                  block_table=st.bt, causal=True,
                                                  backend=self.backend)
        return call(self, st)
    monkeypatch.setattr(smth.CuflashKV, "call", no_append)
    monkeypatch.setattr(smth.CuflashVarlen, "output",
                        lambda self, state: (state[0] if isinstance(state, tuple) else state)
                        * 1.01)
    rc, out, err = run_main(["--backend", "emulator", "--sections", "kvcache,varlen", "--dims",
                             "16", "--causal", "no", "--modes", "fwd", "--decode-nk", "32",
                             "--kv-nq", "1", "--kv-page-sizes", "4", "--varlen-mean", "16",
                             "--no-torch", "--target-ms", "1", "--plot", ""])
    assert rc == 1, out + err
    rows = next(iter(_sub_tables(out, "KV-cache decode").values()))
    cells = {r[0]: r[1] for r in rows}
    assert re.fullmatch(f"{NUMBER} / {NUMBER}", cells["cuflash kvcache"])
    assert re.fullmatch(r"failed check \[\d+\]", cells["cuflash kvcache paged 4"])
    assert re.search(r"^\[\d+\] cuflash kvcache paged 4: correctness check failed \(o: max\|err\|",
                     out, re.M)
    _, vrows = table_rows(out, "Varlen (ragged batches packed without padding, against equal "
                               "lengths)")
    assert re.fullmatch(r"failed check \[\d+\]", vrows[0][7])
    assert "cuflash varlen ran in no case" in err

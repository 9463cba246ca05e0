"""Command-line papercuts: bad option values are one-line argparse errors, the CPU
benchmark's plot names its problem, marks extrapolated points and is reported by
absolute path."""
import json
import os
import subprocess
import sys

import pytest

from cuflash import _bench_cpu, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def assert_one_line_error(capsys, fn, *args):
    with pytest.raises(SystemExit) as exc:
        fn(*args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err
    return lines[0]


BAD = [
    (["bench", "--sizes", "0"], "--sizes"),
    (["bench", "--sizes", "abc"], "--sizes"),
    (["bench", "--sizes", "1024,-5"], "--sizes"),
    (["bench", "--sizes", ","], "--sizes"),
    (["bench", "--block-q", "0"], "--block-q"),
    (["bench", "--block-kv", "-64"], "--block-kv"),
    (["bench", "--reps", "0"], "--reps"),
    (["bench", "--warmup", "-1"], "--warmup"),
    (["bench", "--heads", "0"], "--heads"),
    (["bench", "--batch", "x"], "--batch"),
    (["bench", "--dim", "0"], "--dim"),
    (["bench", "--mem-n", "-1"], "--mem-n"),
    (["demo", "--n", "0"], "--n"),
    (["demo", "--dim", "0"], "--dim"),
    (["demo", "--heads", "0"], "--heads"),
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--block-q", "0"], "--block-q"),
    (["demo", "--block-kv", "abc"], "--block-kv"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--backend", "gpu"], "--backend"),
]


@pytest.mark.parametrize("argv,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_option_is_one_line_error(capsys, argv, option):
    line = assert_one_line_error(capsys, cli.main, argv)
    assert option in line


def test_demo_tiles_the_planner_refuses_are_an_option_error(capsys):
    # a positive block the emulator's kernels cannot take: refused before anything runs
    line = assert_one_line_error(capsys, cli.main,
                                 ["demo", "--backend", "emulator", "--block-q", "7",
                                  "--no-walkthrough"])
    assert "block_q=7" in line


def test_bench_script_rejects_bad_values(capsys):
    # bench/bench_cpu.py parses through the same parser
    line = assert_one_line_error(capsys, _bench_cpu.main, ["--reps", "0"], "bench_cpu.py")
    assert line.startswith("bench_cpu.py: error: argument --reps")


def test_bad_option_in_a_fresh_process_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "cuflash", "bench", "--sizes", "0"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "python -m cuflash bench: error: argument --sizes: '0' is not a positive integer "
        "(see --help)"]


def test_cpu_bench_plot_title_path_and_extrapolated_points(tmp_path, capsys, monkeypatch):
    import matplotlib.figure  # a test dependency (setup.cfg, extra "test")
    seen = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):  # what the figure shows, read before it is written
        seen["title"] = fig._suptitle.get_text() if fig._suptitle else ""
        seen["legend"] = [t.get_text() for ax in fig.axes if ax.get_legend()
                          for t in ax.get_legend().get_texts()]
        return save(fig, *a, **k)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    monkeypatch.setattr(_bench_cpu, "SETTLE_S", 0.0)
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--sizes", "64", "--batch", "1", "--heads", "2", "--dim", "16",
                   "--reps", "1", "--warmup", "0", "--mem-n", "128", "--no-torch",
                   "--plot", "cpu.png", "--json", "cpu.json"])
    assert rc == 0
    out = capsys.readouterr().out
    png = tmp_path / "cpu.png"
    assert f"plot: {png}" in out.splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen["title"] == "cuflash CPU benchmark: B=1 H=2 d=16 float32"
    # the standard method's long-sequence memory was measured at one head and scaled
    res = json.loads((tmp_path / "cpu.json").read_text())
    std = [r for r in res["mem_rows"] if r["method"] == "cuflash standard"]
    tiled = [r for r in res["mem_rows"] if r["method"] == "cuflash tiled"]
    assert std[0]["extrapolated"] == "measured at 1 head, x2"
    assert not tiled[0].get("extrapolated")
    assert "cuflash standard, extrapolated (measured at 1 head, x2)" in seen["legend"]
    assert "cuflash tiled" in seen["legend"]


def test_demo_uses_the_heads_and_length_given(capsys, monkeypatch):
    """--heads and --n are used on every backend (the emulator replaced --heads 4 by 2 when
    --n was left out); without them the emulator runs its smaller defaults."""
    seen = []
    monkeypatch.setattr(cli, "compare", lambda backend, B, H, N, *a, **k: seen.append((H, N)) or 0)
    cli.main(["demo", "--backend", "emulator", "--heads", "4", "--no-walkthrough"])
    cli.main(["demo", "--backend", "emulator", "--no-walkthrough"])
    cli.main(["demo", "--backend", "numpy", "--n", "64", "--no-walkthrough"])
    assert seen == [(4, 128), (2, 128), (8, 64)]

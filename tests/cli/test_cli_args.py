"""Command-line papercuts: bad option values are one-line argparse errors, the CPU
benchmark's plot names its problem, marks extrapolated points and is reported by
absolute path; the benchmark harness (bench/cuflash_bench) runs from a checkout, and an
installed copy without it says how to get it."""
import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from cuflash import cli
from cuflash_bench import cpu as cpu_bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.parametrize("command", [["demo", "--no-walkthrough"], ["compile", "--dtypes", "float16"]])
def test_unknown_emulator_arch_is_one_line_error(capsys, monkeypatch, command):
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_91")
    line = assert_one_line_error(capsys, cli.main, [command[0], "--backend", "emulator", *command[1:]])
    assert "CUFLASH_EMULATOR_ARCH='sm_91'" in line and "sm_90" in line


def test_bench_script_rejects_bad_values(capsys):
    # bench/bench_cpu.py parses through the same parser
    line = assert_one_line_error(capsys, cpu_bench.main, ["--reps", "0"], "bench_cpu.py")
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
    monkeypatch.setattr(cpu_bench, "SETTLE_S", 0.0)
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


# ---------------------------------------------------------------------------
# the benchmark harness lives in bench/cuflash_bench, outside the package
# ---------------------------------------------------------------------------
def _run(args, cwd, pythonpath):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--sizes", "64"], ["bench", "--help"],
                                  ["bench", "--gpu", "--backend", "emulator"],
                                  ["bench", "--gpu", "--help"]], ids=" ".join)
def test_bench_without_the_harness_says_how_to_get_it(tmp_path, argv):
    """An installed copy (the package alone, no bench/ beside it): one line naming the folder it
    lacks and how to get it, exit status 2, no traceback; the other commands still work."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(ROOT, "cuflash"), site / "cuflash",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = _run(["-m", "cuflash"] + argv, tmp_path, str(site))
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "python -m cuflash bench: the benchmark harness is not installed with cuflash (no "
        f"{site / 'bench' / 'cuflash_bench'}); clone the cuflash source repository and run "
        "python -m cuflash bench from its root"]
    h = _run(["-m", "cuflash", "--help"], tmp_path, str(site))
    assert h.returncode == 0 and "bench" in h.stdout and "demo" in h.stdout, h.stderr


def test_bench_scripts_run_the_harness_from_any_directory(tmp_path):
    for script in ("bench_cpu.py", "bench_gpu.py"):
        r = _run([os.path.join(ROOT, "bench", script), "--reps", "0"], tmp_path, "")
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"bench/{script}: error: argument --reps: '0' is not a positive integer "
            "(see --help)"], r.stderr


def _relative_imports(path):
    """The harness modules that ``path`` imports (``from .x import``, ``from . import x``),
    function-local imports included."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module} if node.module else {a.name for a in node.names}
    return out


def test_harness_imports_run_one_way():
    """No circle among the harness's modules, and the package never imports the harness (the
    command line loads it by path, at run time)."""
    pkg = os.path.join(ROOT, "bench", "cuflash_bench")
    graph = {f[:-3]: _relative_imports(os.path.join(pkg, f)) for f in os.listdir(pkg)
             if f.endswith(".py") and f != "__init__.py"}
    assert set().union(*graph.values()) <= set(graph)
    done, stack = set(), []

    def visit(m):
        assert m not in stack, f"import circle: {' -> '.join(stack[stack.index(m):] + [m])}"
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)
    for m in sorted(graph):
        visit(m)
    for dirpath, _, files in os.walk(os.path.join(ROOT, "cuflash")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    assert not any(n.split(".")[0] == "cuflash_bench" for n in names), f

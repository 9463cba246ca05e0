"""The tests' layout: one folder per area of the code, and no pointer to a test path that is gone.

Every test file sits in an area folder directly under tests/ (the areas and what each covers
are ``AREAS`` below; a new area is added there). Only conftest.py (fixtures, backends) and
oracle.py (the float64 oracle) stay at the top, and tests/ is on sys.path through conftest.

pytest imports a test file by its bare name (no ``__init__.py`` anywhere, the default
"prepend" import mode), so two files of one name in two areas would not both load: names are
unique across the areas. An area keeps no conftest.py of its own, as ``from conftest import``
in the test files means the one at the top.

Every ``tests/...`` path named in the code, the docs, the kernels, the configuration and the
tests themselves exists (the recorded run logs under bench/results/ keep the paths of their
run), so moving a test file moves the pointers with it.
"""
import glob
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")

AREAS = {
    "api": "the front functions and the NumPy reference (cuflash/__init__, reference/): "
           "values, gradients, errors, memory model, serving shapes",
    "kernels": "the CUDA C kernels (kernels_cu/) through the launchers: forward, backward, "
               "logit features, head-dim classes, NVRTC compiles",
    "launch": "the launchers and the cuda backend's glue (cuflash/launch/, cuda_backend.py)",
    "tiling": "the planner and its curated plan tables (cuflash/tiling/)",
    "emulator": "the CPU emulator (cuflash/emulator/) on its own test kernels (kernels/*.cu)",
    "frameworks": "cuflash.torch, _torch_ops, jax, flash_attn, transformers",
    "ring": "cuflash.ring: the ring planner and its torch and JAX entries",
    "cli": "python -m cuflash (cli.py, _cliargs.py)",
    "bench": "the benchmark harness and scripts of bench/",
    "docs": "README.md and docs/: examples run, links resolve, kernels named",
    "package": "packaging, the import layers, this layout",
}
TOP_LEVEL = {"conftest.py", "oracle.py"}
# parser inputs of tests/bench/test_device_check.py: made-up failing test ids, not pointers
MADE_UP = {"tests/test_a.py", "tests/test_b.py"}


def _test_files():
    return [os.path.relpath(p, TESTS)
            for p in glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)]


def test_every_test_file_sits_in_an_area():
    files = _test_files()
    assert files, "no test files found"
    misplaced = [f for f in files if f.count(os.sep) != 1 or f.split(os.sep)[0] not in AREAS]
    assert not misplaced, f"test files outside the areas {sorted(AREAS)}: {misplaced}"
    top = {f for f in os.listdir(TESTS) if f.endswith(".py")}
    assert top == TOP_LEVEL, f"only {sorted(TOP_LEVEL)} belong directly under tests/: {top}"


def test_every_area_holds_tests():
    used = {f.split(os.sep)[0] for f in _test_files()}
    assert used == set(AREAS), f"areas without tests: {set(AREAS) - used}"


def test_test_file_names_are_unique():
    seen = {}
    for f in _test_files():
        seen.setdefault(os.path.basename(f), []).append(f)
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"pytest imports test files by bare name; these clash: {clashes}"


def test_areas_have_no_package_or_conftest_files():
    extra = [os.path.relpath(p, TESTS)
             for name in ("__init__.py", "conftest.py")
             for p in glob.glob(os.path.join(TESTS, "**", name), recursive=True)]
    assert extra == ["conftest.py"], extra


def _repo_files():
    """The repository's files, relative to ROOT: git's view (tracked, and new files it does not
    ignore) where there is one -- build outputs such as cuflash.egg-info, which ``pip install .``
    writes into the checkout, are not the project's -- else every file under ROOT."""
    try:
        r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        r = None
    if r is not None and r.returncode == 0 and r.stdout.strip():
        return [p for p in r.stdout.splitlines() if os.path.exists(os.path.join(ROOT, p))]
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                       and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in filenames]
    return out


def _texts():
    """(path, text) of the repository's files that may name a test path."""
    exts = (".py", ".md", ".cu", ".cuh", ".cpp", ".h", ".hpp", ".cfg", ".toml", ".txt")
    for rel in _repo_files():
        if rel.startswith(os.path.join("bench", "results") + os.sep):
            continue
        if rel.endswith(exts) or rel == os.path.join(".ci", "run"):
            with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as fh:
                yield rel, fh.read()


def test_named_test_paths_exist():
    missing = []
    for rel, text in _texts():
        for path in re.findall(r"\btests/[A-Za-z0-9_./*-]*[A-Za-z0-9_*/]", text):
            if path in MADE_UP:
                continue
            hits = glob.glob(os.path.join(ROOT, path)) if "*" in path else \
                [os.path.join(ROOT, path)] if os.path.exists(os.path.join(ROOT, path)) else []
            if not hits:
                missing.append(f"{rel}: {path}")
    assert not missing, "paths under tests/ that are not there:\n" + "\n".join(missing)

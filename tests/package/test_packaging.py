"""Packaging: the README's test command is what CI runs; an installed copy ships the kernels.

The install test builds a regular (non-editable) wheel of a copy of the
source tree into a fresh virtual environment (no system site-packages), then,
from a directory outside the source tree, imports cuflash there (without
CuPy) and checks that the CUDA C sources are inside the installed package and
are what cuflash finds at run time.  It needs pip to reach a package index
(setuptools for the isolated build, numpy); it takes about 15 s.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fenced_bash_blocks(text):
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_test_command_is_ci_command():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        blocks = fenced_bash_blocks(fh.read())
    assert len(blocks) >= 2, "README needs two fenced bash blocks: the demo and the tests"
    assert "python -m cuflash demo" in blocks[0], blocks[0]
    test_cmd = blocks[1]
    assert "\n" not in test_cmd, f"the test command should be one line: {test_cmd!r}"
    assert "pytest" in test_cmd
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    commands = [ln.strip() for ln in ci.splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    assert test_cmd in commands, (
        f"README's test command {test_cmd!r} is not a line of .ci/run: {commands}")
    assert "set -e" in ci or "set -euo pipefail" in ci, ".ci/run must fail when a command fails"
    assert os.access(os.path.join(ROOT, ".ci", "run"), os.X_OK), ".ci/run is not executable"


def test_ci_fails_on_no_tests_collected():
    # pytest exits 5 when it collects nothing; with `set -e` that exit status fails CI
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        ci = fh.read()
    assert re.search(r"set -[a-z]*e", ci)
    assert "|| true" not in ci and "|| exit 0" not in ci


def _copy_source(dst):
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__",
                                    ".venv", ".pytest_cache", ".benchmarks")
    shutil.copytree(ROOT, dst, ignore=ignore)


@pytest.mark.packaging
def test_regular_install_ships_kernels(tmp_path):
    src = tmp_path / "src"
    _copy_source(src)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    py = str(env_dir / ("Scripts" if os.name == "nt" else "bin") / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", str(src)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install . failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    # the copy is gone when cuflash runs: whatever it finds must be inside the install
    shutil.rmtree(src)
    kernels_here = sorted(f for f in os.listdir(os.path.join(ROOT, "kernels_cu"))
                          if f.endswith((".cu", ".cuh")))
    assert kernels_here, "no .cu/.cuh files in kernels_cu/"
    script = textwrap.dedent(f"""
        import os, sys
        import cuflash
        pkg = os.path.dirname(os.path.abspath(cuflash.__file__))
        assert 'site-packages' in pkg, pkg
        assert 'cupy' not in sys.modules
        kdir = os.path.join(pkg, 'kernels_cu')
        bench = [f for f in os.listdir(pkg) if 'bench' in f]
        assert not bench, ('benchmark modules installed', bench)
        shipped = sorted(f for f in os.listdir(kdir) if f.endswith(('.cu', '.cuh')))
        missing = set({kernels_here!r}) - set(shipped)
        assert not missing, ('not shipped', missing, shipped)
        # the run-time lookup must point into the install
        from cuflash import kernels
        found = os.path.realpath(str(kernels.kernel_dir()))
        assert found == os.path.realpath(kdir), (found, kdir)
        import numpy as np
        q = np.random.default_rng(0).standard_normal((2, 9, 8))
        o = cuflash.tiled_attention(q, q, q, block_q=4, block_kv=4)
        ref, _ = cuflash.standard_attention(q, q, q)
        assert np.abs(o - ref).max() < 1e-12
        # the emulator compiles the installed kernels with the installed host headers
        ok, why = cuflash.available_backends()['emulator']
        if ok:
            q32 = q.astype(np.float32)
            oe = cuflash.tiled_attention(q32, q32, q32, backend='emulator')
            assert np.abs(oe - ref).max() < 1e-5, np.abs(oe - ref).max()
            print('EMULATOR OK')
        else:
            print('EMULATOR UNAVAILABLE', why)
        print('OK', len(shipped))
    """)
    r = subprocess.run([py, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    # where g++ exists (CI: always) the emulator must work from the installed copy too
    if shutil.which("g++") or shutil.which("c++"):
        assert "EMULATOR OK" in r.stdout, r.stdout + r.stderr
    # the benchmark harness stays in the repository (bench/): the installed command says so
    r = subprocess.run([py, "-m", "cuflash", "bench"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "clone the cuflash source repository" in lines[0], r.stderr

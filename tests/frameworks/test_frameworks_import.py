"""The framework modules load only on request, and say how to install what they miss.

Each check runs in a fresh interpreter (``sys.modules`` of the test process
already holds whatever other tests imported).  None of them needs torch, JAX
or transformers installed: a missing framework is simulated with ``sys.modules[name] =
None``, which makes ``import name`` raise ImportError.
"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code):
    env = dict(os.environ, PYTHONPATH=ROOT)  # this checkout's cuflash, not an installed one
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_import_cuflash_imports_no_framework():
    r = run_python("""
        import os, sys, cuflash
        assert os.path.dirname(os.path.dirname(cuflash.__file__)) == os.getcwd(), cuflash.__file__
        print([m for m in ('torch', 'jax', 'jaxlib', 'ml_dtypes', 'transformers')
               if m in sys.modules])
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "[]", f"import cuflash imported {r.stdout.strip()}"


@pytest.mark.parametrize("module, framework", [("torch", "torch"), ("jax", "jax"),
                                               ("flash_attn", "torch"),
                                               ("transformers", "transformers"),
                                               ("ring.torch", "torch"), ("ring.jax", "jax")])
def test_missing_framework_is_a_clear_import_error(module, framework):
    r = run_python(f"""
        import sys
        sys.modules[{framework!r}] = None   # as if it were not installed
        import cuflash                      # still fine without it
        try:
            import cuflash.{module}
        except ImportError as e:
            print("MESSAGE", e)
        else:
            raise SystemExit("cuflash.{module} imported without {framework}")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    msg = r.stdout
    assert f"cuflash.{module} needs" in msg, msg
    assert f"pip install {framework}" in msg and f".[{framework}]" in msg, msg

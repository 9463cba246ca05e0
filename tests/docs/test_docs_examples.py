"""Every Python block of README.md and docs/*.md runs, and the documentation links resolve.

A block runs as written, in a fresh namespace, on the backend its arrays pick (NumPy here).
A block that needs more than the CPU says so on the line before it:

    <!-- doc-test: needs a GPU -->      CuPy and a GPU (skipped without them)
    <!-- doc-test: needs torch -->      PyTorch (skipped without it; CPU builds run it)
    <!-- doc-test: needs jax -->        JAX (likewise)
    <!-- doc-test: needs transformers --> transformers (and PyTorch; likewise)

Blocks assert what the text next to them says, so a page that drifts from the code fails.
"""
import glob
import importlib.util
import os
import re

import pytest

import cuflash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
_BLOCK = re.compile(r"(?:<!-- doc-test: needs (?P<need>[^>]*?) -->\n)?```python\n(?P<code>.*?)```",
                    re.S)
NEEDS = {"a GPU", "torch", "jax", "transformers"}


def python_blocks(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        out.append(pytest.param(page, line, m.group("need"), m.group("code"),
                                id=f"{page}:{line}"))
    return out


BLOCKS = [b for page in PAGES for b in python_blocks(page)]


def test_every_page_is_found():
    assert "docs/semantics.md" in PAGES and len(PAGES) >= 8, PAGES


def _skip_unless(need):
    if need is None:
        return
    assert need in NEEDS, f"unknown doc-test requirement {need!r}"
    if need == "a GPU":
        ok, why = cuflash.available_backends()["cuda"]
        if not ok:
            pytest.skip(f"needs a GPU: {why}")
    elif importlib.util.find_spec(need) is None:
        pytest.skip(f"needs {need}")


@pytest.mark.parametrize("page,line,need,code", BLOCKS)
def test_python_block_runs(page, line, need, code):
    _skip_unless(need)
    namespace = {"__name__": f"doc_block_{line}"}
    exec(compile(code, f"{page}:{line}", "exec"), namespace)


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    """Relative links and the repository paths named in backquotes exist."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(here, target)), f"{page}: link to {target}"
    for path in re.findall(r"`((?:bench|kernels_cu|tests|docs|cuflash)/[A-Za-z0-9_./-]+)`", text):
        assert os.path.exists(os.path.join(ROOT, path)), f"{page}: names {path}, which is not there"


@pytest.mark.parametrize("page", PAGES)
def test_no_issue_numbers_or_private_modules(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        text = fh.read()
    assert not re.search(r"\bissue \d+", text, re.I), f"{page} cites an issue number"
    assert not re.search(r"cuflash[./]_\w+", text), f"{page} names a private module"


def test_readme_length_and_status_box():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    assert text.count("\n") <= 250, "README.md is over 250 lines"
    begin, end = text.index("<!-- status:begin -->"), text.index("<!-- status:end -->")
    assert begin < end and "```" not in text[begin:end]   # README's first bash blocks stay first

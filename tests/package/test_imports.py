"""The package's imports run one way and close no circle, read from the source with ``ast``.

Layers, top to bottom; an import may point down or stay inside its layer, never up:

=========================  ==============================================================
entry points               ``cuflash.__main__``, ``cuflash.cli``
tools, framework doors     ``cuflash.torch``, ``cuflash.jax``, ``cuflash.flash_attn``,
                           ``cuflash.transformers``, ``cuflash._torch_ops``, ``cuflash.trace``,
                           ``cuflash.ring.*``
front                      ``cuflash`` (the package's ``__init__``), ``cuflash._dispatch``
backends                   ``cuflash.reference.*``, ``cuflash.cuda_backend``,
                           ``cuflash.emulator_backend``
launchers                  ``cuflash.launch.*``
kernels and tiling         ``cuflash.kernels``, ``cuflash.tiling.*``
emulator                   ``cuflash.emulator.*``
shared leaves              ``cuflash._validate*``, ``_interop``, ``_cliargs``, ``_nvrtc``,
                           ``_sass``: read by any layer, importing only each other
=========================  ==============================================================

Every import statement counts, at module level or inside a function.  Importing
``cuflash.a.b`` is an edge to that module alone: Python initialises the packages
above it first, but the module does not depend on them.  The front reaches the
backends through ``importlib`` (``cuflash._dispatch``), which is no edge here.

The benchmark modules ``cuflash/_bench_*.py`` are left out, as importers and as
imported: they are the harness on its way out of the package to ``bench/``.

Inside a function, only an optional library is imported (CuPy, torch, JAX,
transformers, matplotlib, ml_dtypes), so that ``import cuflash`` never needs it; a module of
the package or of the standard library is imported at the top.
"""
import ast
import configparser
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "cuflash")

LAYERS = ("entry points", "tools", "front", "backends", "launchers", "kernels and tiling",
          "emulator", "shared leaves")
_EXACT = {
    "cuflash.__main__": "entry points", "cuflash.cli": "entry points",
    "cuflash.torch": "tools", "cuflash.jax": "tools", "cuflash.trace": "tools",
    "cuflash.flash_attn": "tools", "cuflash.transformers": "tools", "cuflash._torch_ops": "tools",
    "cuflash": "front", "cuflash._dispatch": "front",
    "cuflash.cuda_backend": "backends", "cuflash.emulator_backend": "backends",
    "cuflash.kernels": "kernels and tiling",
    "cuflash._validate": "shared leaves", "cuflash._validate_masks": "shared leaves",
    "cuflash._validate_serving": "shared leaves", "cuflash._interop": "shared leaves",
    "cuflash._cliargs": "shared leaves", "cuflash._nvrtc": "shared leaves",
    "cuflash._sass": "shared leaves",
}
_PACKAGES = {"cuflash.ring": "tools", "cuflash.reference": "backends", "cuflash.launch": "launchers",
             "cuflash.tiling": "kernels and tiling", "cuflash.emulator": "emulator"}
OPTIONAL = {"cupy", "cupyx", "torch", "jax", "jaxlib", "matplotlib", "ml_dtypes", "transformers"}


def layer_of(module):
    if module in _EXACT:
        return _EXACT[module]
    for pkg, layer in _PACKAGES.items():
        if module == pkg or module.startswith(pkg + "."):
            return layer
    return None


def _is_bench(module):
    return module.rsplit(".", 1)[-1].startswith("_bench_")


def package_modules(root=PACKAGE):
    """``{module name: (path, is_package)}`` for every .py file under ``root``."""
    top = os.path.dirname(root)
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            name = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
            is_pkg = name.endswith(".__init__")
            out[name[:-len(".__init__")] if is_pkg else name] = (path, is_pkg)
    return out


def _targets(node, module, is_pkg, known):
    """The package's modules an import statement reads (relative imports resolved)."""
    if isinstance(node, ast.Import):
        bases = [(a.name, []) for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            if not is_pkg:
                parts = parts[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([base] if base else []))
        bases = [(base, [a.name for a in node.names])]
    out = set()
    for base, names in bases:
        if base.split(".")[0] != "cuflash":
            continue
        subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
        if subs:
            out.update(subs)
        if len(subs) < len(names) or not names:   # names of the module itself
            while base not in known and "." in base:
                base = base.rsplit(".", 1)[0]
            out.add(base)
    return out


def read_imports(modules, known=None):
    """``(edges, local)`` of ``modules``: module -> set of modules it imports (among
    ``known``, default ``modules``); function-local imports as ``(module, line, imported
    name, modules it reads)``."""
    known = modules if known is None else known
    edges, local = {}, []
    for module, (path, is_pkg) in modules.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        inside = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inside.update(id(n) for n in ast.walk(fn)
                              if isinstance(n, (ast.Import, ast.ImportFrom)))
        targets = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            got = _targets(node, module, is_pkg, known)
            targets |= got
            if id(node) in inside:
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    names = [("." * node.level) + (node.module or "")]
                local += [(module, node.lineno, n, sorted(got)) for n in names]
        edges[module] = targets - {module}
    return edges, local


def circles(edges):
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def upward(edges, layer=layer_of):
    """The imports that point to a higher layer (or leave a shared leaf for another layer)."""
    bad = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            if layer(a) is None or layer(b) is None:
                continue  # test_every_module_has_a_layer names them
            la, lb = LAYERS.index(layer(a)), LAYERS.index(layer(b))
            if lb < la or (layer(a) == "shared leaves" and lb != la):
                bad.append(f"{a} ({layer(a)}) imports {b} ({layer(b)})")
    return bad


@pytest.fixture(scope="module")
def graph():
    everything = package_modules()
    modules = {m: v for m, v in everything.items() if not _is_bench(m)}
    edges, local = read_imports(modules, everything)
    edges = {a: {b for b in t if not _is_bench(b)} for a, t in edges.items()}
    return modules, edges, local


def test_the_reader_sees_the_package(graph):
    """The graph is the package's: the launchers, backends and their known edges are in it."""
    modules, edges, _ = graph
    assert {"cuflash", "cuflash.launch.fwd", "cuflash.launch.bwd_tc", "cuflash.emulator._race",
            "cuflash.reference.serving"} <= set(modules)
    assert "cuflash.launch.api" in edges["cuflash.cuda_backend"]
    assert "cuflash.launch.fwd" in edges["cuflash.launch.api"]
    assert "cuflash.launch.serving" in edges["cuflash.launch.fwd"]
    assert "cuflash.kernels" in edges["cuflash.launch.fwd"]      # from .. import kernels
    assert "cuflash.reference" in edges["cuflash"]               # from . import reference
    assert "cuflash.emulator._race" in edges["cuflash.emulator._module"]
    assert sum(len(t) for t in edges.values()) > 100


def test_every_module_has_a_layer(graph):
    modules, _, _ = graph
    unplaced = sorted(m for m in modules if layer_of(m) is None)
    assert not unplaced, f"place these modules in a layer of {__name__}: {unplaced}"


def test_no_import_points_up(graph):
    _, edges, _ = graph
    bad = upward(edges)
    assert not bad, "imports against the direction:\n  " + "\n  ".join(bad)


def test_no_circle(graph):
    _, edges, _ = graph
    found = circles(edges)
    assert not found, f"import circles: {found}"


def test_function_local_imports_are_of_optional_libraries(graph):
    _, _, local = graph
    bad = []
    for module, line, name, targets in local:
        if targets and all(_is_bench(t) for t in targets):
            continue  # the benchmark harness (see the module docstring)
        if targets or name.split(".")[0] not in OPTIONAL:
            bad.append(f"{module}:{line} imports {name}")
    assert not bad, ("import these at the top of the module (only optional libraries are "
                     "imported where they are used):\n  " + "\n  ".join(bad))


def test_the_checks_find_circles_and_upward_imports():
    """The checks above catch what they are for, on a graph made to have both faults."""
    edges = {"cuflash.launch.a": {"cuflash.launch.b"}, "cuflash.launch.b": {"cuflash.launch.c"},
             "cuflash.launch.c": {"cuflash.launch.a", "cuflash.cuda_backend"},
             "cuflash.cuda_backend": {"cuflash.launch.a"}, "cuflash._validate": {"cuflash.kernels"}}
    assert circles(edges) == [["cuflash.cuda_backend", "cuflash.launch.a", "cuflash.launch.b",
                               "cuflash.launch.c"]]
    assert upward(edges) == [
        "cuflash._validate (shared leaves) imports cuflash.kernels (kernels and tiling)",
        "cuflash.launch.c (launchers) imports cuflash.cuda_backend (backends)"]


def test_the_reader_resolves_relative_and_local_imports(tmp_path):
    """Relative imports from a module and from a package, and imports inside functions."""
    pkg = tmp_path / "cuflash"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\nfrom .sub.b import X\n"
                              "def f():\n    import cupy\n    from . import c\n")
    (pkg / "c.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import c\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nX = 1\n")
    edges, local = read_imports(package_modules(str(pkg)))
    assert edges == {"cuflash": {"cuflash.a"}, "cuflash.a": {"cuflash.sub.b", "cuflash.c"},
                     "cuflash.c": set(), "cuflash.sub": {"cuflash.c"},
                     "cuflash.sub.b": {"cuflash.a"}}
    assert [(m, line, name) for m, line, name, _ in local] == [
        ("cuflash.a", 4, "cupy"), ("cuflash.a", 5, ".")]
    assert circles(edges) == [["cuflash.a", "cuflash.sub.b"]]


def test_every_subpackage_is_installed():
    """setup.cfg lists every package directory, so an installed copy has all of them."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(cfg["options"]["packages"].split())
    found = {name for name, (_, is_pkg) in package_modules().items() if is_pkg}
    assert found <= listed, f"packages missing from setup.cfg [options] packages: {found - listed}"

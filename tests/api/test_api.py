"""The one-API-three-backends contract of docs/api.md and docs/style.md (point 2).

Every backend module defines every name of ``cuflash._dispatch.API_NAMES``
with the front's signature minus ``backend``; dispatch by array type; mixing
array libraries is a TypeError; unknown backends are a ValueError listing what
is available.
"""
import importlib
import inspect
import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash import _dispatch


def backend_modules():
    """(name, module) for every backend module that imports here."""
    out = []
    for name, modname in _dispatch.BACKEND_MODULES.items():
        try:
            out.append(pytest.param(importlib.import_module(modname), id=name))
        except ImportError as e:
            if name == "numpy":
                raise  # the reference must always import
            out.append(pytest.param(None, id=name, marks=pytest.mark.skip(
                reason=f"{modname} does not import here: {e}")))
    return out


def test_api_names_are_the_documented_functions():
    assert set(_dispatch.API_NAMES) == {
        "precompile", "online_softmax", "online_softmax_2d", "standard_attention",
        "standard_attention_backward", "tiled_attention", "tiled_attention_backward",
        "memory_analysis", "verify_no_full_materialization", "attention_with_kvcache",
        "varlen_attention", "varlen_attention_backward"}
    for name in _dispatch.API_NAMES:
        assert callable(getattr(cuflash, name)), name
        assert name in cuflash.__all__


@pytest.mark.parametrize("name", sorted(_dispatch.API_NAMES))
def test_public_functions_are_documented_and_their_examples_run(name):
    """numpydoc sections for every public function; the Examples run (numpy inputs)."""
    import doctest
    fn = getattr(cuflash, name)
    doc = inspect.getdoc(fn)
    for section in ("Parameters", "Returns"):
        assert f"{section}\n" + "-" * len(section) in doc, f"cuflash.{name}: no {section} section"
    # every parameter named on a header line of the Parameters section ("a, b : type")
    params = doc.split("Parameters\n----------\n", 1)[1].split("\n\n", 1)[0]
    documented = set()
    for line in params.splitlines():
        if line and not line.startswith(" "):
            documented.update(n.strip() for n in line.split(" : ")[0].split(","))
    for p in inspect.signature(fn).parameters:
        assert p in documented, f"cuflash.{name}: parameter {p} is not documented"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(fn, name, globs={}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0, f"cuflash.{name}: an example failed"


def front_signature_without_backend(name):
    sig = inspect.signature(getattr(cuflash, name))
    assert "backend" in sig.parameters, f"cuflash.{name} has no backend= keyword"
    assert sig.parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["backend"].default is None
    return sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "backend"])


@pytest.mark.parametrize("module", backend_modules())
def test_backend_module_signatures(module):
    assert callable(getattr(module, "is_available", None)), f"{module.__name__}.is_available"
    for name in _dispatch.API_NAMES:
        fn = getattr(module, name, None)
        assert callable(fn), f"{module.__name__} lacks {name}"
        want = front_signature_without_backend(name)
        got = inspect.signature(fn)
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
               [(p.name, p.kind, p.default) for p in want.parameters.values()], (
            f"{module.__name__}.{name}{got} != cuflash.{name}{want} (minus backend)")


@pytest.mark.parametrize("module", backend_modules())
def test_is_available_returns_bool_and_reason(module):
    res = module.is_available()
    assert isinstance(res, tuple) and len(res) == 2
    # a backend that cannot run must say why
    assert isinstance(res[0], bool) and isinstance(res[1], str) and (res[0] or res[1]), res


def test_reference_is_available():
    import cuflash.reference as ref
    assert ref.is_available()[0]


def test_available_backends_shape():
    av = cuflash.available_backends()
    assert set(av) == set(_dispatch.BACKEND_MODULES) >= {"numpy", "cuda", "emulator"}
    for name, val in av.items():
        assert isinstance(val, tuple) and len(val) == 2, (name, val)
        ok, why = val
        assert isinstance(ok, bool) and isinstance(why, str) and (ok or why), (name, val)
    assert av["numpy"][0] is True


def test_backend_none_dispatches_numpy_to_reference(rng):
    import cuflash.reference as ref
    assert _dispatch.get_backend(None, np.ones((2, 2))) is ref
    assert _dispatch.get_backend("numpy") is ref
    q = rng.standard_normal((5, 4))
    a = cuflash.tiled_attention(q, q, q)
    b = cuflash.tiled_attention(q, q, q, backend="numpy")
    assert np.array_equal(a, b)
    assert isinstance(a, np.ndarray)


class FakeCupyArray:
    """Something whose type lives in a module named cupy, as cupy.ndarray does."""
    __module__ = "cupy"

    def __init__(self, a):
        self._a = np.asarray(a)
        self.shape, self.dtype, self.ndim = self._a.shape, self._a.dtype, self._a.ndim


FakeCupyArray.__module__ = "cupy._core.core"


def cupy_like(a):
    try:
        import cupy
        return cupy.asarray(a)
    except Exception:  # no cupy (or no GPU): the dispatcher only looks at the type's module
        return FakeCupyArray(a)


def test_array_library():
    assert _dispatch.array_library(np.ones(2)) == "numpy"
    assert _dispatch.array_library(FakeCupyArray(np.ones(2))) == "cupy"
    with pytest.raises(TypeError):
        _dispatch.array_library([1.0, 2.0])


@pytest.mark.parametrize("fn", ["standard_attention", "tiled_attention"])
def test_mixing_array_libraries_is_type_error(fn):
    q = np.ones((4, 8))
    c = cupy_like(np.ones((4, 8)))
    for args in ((q, c, q), (c, q, q), (q, q, c)):
        with pytest.raises(TypeError):
            getattr(cuflash, fn)(*args)
    with pytest.raises(TypeError):
        cuflash.tiled_attention_backward(q, q, q, q, q, cupy_like(np.zeros(4)))


def test_named_backend_with_wrong_array_type_is_type_error():
    c = cupy_like(np.ones((4, 8)))
    with pytest.raises(TypeError):
        cuflash.tiled_attention(c, c, c, backend="numpy")
    with pytest.raises(TypeError):
        cuflash.tiled_attention(c, c, c, backend="emulator")


@pytest.mark.parametrize("bad", ["torch", "CUDA", "gpu", "", 3])
def test_unknown_backend_lists_available(bad):
    q = np.ones((4, 8))
    with pytest.raises(ValueError) as e:
        cuflash.tiled_attention(q, q, q, backend=bad)
    msg = str(e.value)
    for name in ("numpy", "cuda", "emulator"):
        assert name in msg, f"{name!r} not listed in {msg!r}"
    with pytest.raises(ValueError):
        cuflash.memory_analysis(128, 64, backend=bad)


def test_unavailable_backend_says_why():
    av = cuflash.available_backends()
    missing = [n for n, (ok, _) in av.items() if not ok]
    if not missing:
        pytest.skip("every backend is available here")
    name = missing[0]
    arr = cupy_like(np.ones((4, 8))) if name == "cuda" else np.ones((4, 8))
    with pytest.raises(ValueError) as e:
        cuflash.tiled_attention(arr, arr, arr, backend=name)
    msg = str(e.value)
    assert name in msg and av[name][1] in msg, msg
    assert "numpy" in msg  # and says what is available


def test_import_needs_no_cupy_or_compiler():
    # a clean interpreter: importing cuflash must not import cupy, the emulator or NVRTC
    code = ("import sys, cuflash; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'cupy' or m in "
            "('cuflash.cuda_backend', 'cuflash.emulator_backend', 'cuflash._nvrtc')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

"""Test bodies written once over the backend (docs/style.md, "one test body over xp").

A test that takes the ``backend`` argument runs once per entry of ``BACKENDS``.
Adding a backend is one line there.  The fixture's value is a ``Backend``: its
``name`` (pass it as ``backend=``), ``asarray`` (numpy -> the backend's array
type) and ``to_numpy`` (back).

Shape grids: the NumPy reference runs every case.  Emulated kernels cost about
0.1-0.5 s per launch, so a case that the emulator should not run is marked
``full_grid`` (use ``grid(cases, emulator=...)`` to build such a list), and a
case the kernels need not support at all (d = 59, dv != d) is marked
``reference_only``; both are deselected (not skipped) for the backends
concerned, so the report stays readable.
"""
import contextlib
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import oracle` from any test file
# `import cuflash_bench` (the benchmark harness, bench/cuflash_bench) from any test file
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

import cuflash  # noqa: E402

# name, pytest marks.  "cuda" is skipped with the reason when cupy or a GPU is absent;
# the other backends must be able to run on every machine CI uses, so an
# unavailable "numpy"/"emulator" is a failure, not a skip.
BACKENDS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("emulator", id="emulator", marks=pytest.mark.emulator),  # KERNELS-FWD: enabled
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]

# backends that run only a reduced grid (cases marked full_grid are deselected)
REDUCED_GRID_BACKENDS = {"emulator"}
# backends that run the cases marked reference_only
REFERENCE_BACKENDS = {"numpy"}
# backends whose absence here is a skip rather than a failure
OPTIONAL_BACKENDS = {"cuda"}


def pytest_configure(config):
    for line in (
        "full_grid: a case of the full shape grid; deselected for slow (emulated) backends",
        "reference_only: a case only the NumPy reference must support (d=59, dv != d)",
        "emulator: runs the emulated CUDA kernels",
        "cuda: needs cupy and a GPU",
        "packaging: builds and installs the package into a fresh venv",
    ):
        config.addinivalue_line("markers", line)


class Backend:
    """What a test body needs to know about the backend it runs on."""

    def __init__(self, name):
        self.name = name
        self.is_cuda = name == "cuda"

    def asarray(self, a):
        """A numpy array as the backend's array type (a copy for cuda)."""
        if a is None:
            return None
        if self.is_cuda:
            import cupy
            return cupy.asarray(a)
        return a

    def to_numpy(self, a):
        if a is None:
            return None
        if hasattr(a, "get") and type(a).__module__.split(".")[0] == "cupy":
            return a.get()
        return np.asarray(a)

    def __repr__(self):
        return f"Backend({self.name!r})"


_AVAILABLE = None


def _available():
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = cuflash.available_backends()
    return _AVAILABLE


def require_backend(name):
    """Backend(name); skips an optional backend that is absent, fails on any other."""
    ok, why = _available().get(name, (False, "not a backend of cuflash._dispatch"))
    if not ok:
        if name in OPTIONAL_BACKENDS:
            pytest.skip(f"backend {name!r} not available: {why}")
        pytest.fail(f"backend {name!r} must run here but is not available: {why}")
    return Backend(name)


@pytest.fixture
def backend(request):
    return require_backend(request.param)


# The kernel test files parametrise by fixture (every case on every backend, no
# reduced-grid deselection): `kb` is every backend, `kernel_backend` only those
# that run the kernels.
@pytest.fixture(params=BACKENDS)
def kb(request):
    return require_backend(request.param)


@pytest.fixture(params=[p for p in BACKENDS if p.values[0] != "numpy"])
def kernel_backend(request):
    return require_backend(request.param)


@pytest.fixture(autouse=True, scope="session")
def _interblock_write_check():
    """Every emulated launch of the session runs with the inter-block write check: two
    blocks of one launch storing to one global address raise InterBlockRaceError
    (cuflash.emulator.interblock_check; cost: a vector append per gstore and a sort of the
    log per launch, measured in tests/emulator/test_emulator_global_writes.py)."""
    from cuflash import emulator
    old = emulator.set_interblock_check(True)
    yield
    emulator.set_interblock_check(old)


@pytest.fixture(autouse=True, scope="session")
def _memcheck():
    """Every emulated launch of the session runs with the memory checker: a global access
    outside the launch's arrays or a shared access outside its shared memory raises
    MemcheckError (cuflash.emulator.memcheck; its cost is in docs/emulator.md)."""
    from cuflash import emulator
    old = emulator.set_memcheck(True)
    yield
    emulator.set_memcheck(old)


@contextlib.contextmanager
def poisoned_outputs():
    """Arrays the kernel launchers allocate are NaN until a kernel writes them."""
    from cuflash.launch import common as launch_common

    def poison(a):
        a[...] = np.nan
    with launch_common.output_hook(poison):
        yield


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS, indirect=True)


def _backend_of(item):
    cs = getattr(item, "callspec", None)
    return cs.params.get("backend") if cs is not None else None


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        name = _backend_of(item)
        if name is not None and (
                (name in REDUCED_GRID_BACKENDS and item.get_closest_marker("full_grid"))
                or (name not in REFERENCE_BACKENDS and item.get_closest_marker("reference_only"))):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def grid(cases, emulator=None, reference_only=None, ids=None):
    """pytest params for ``cases`` (tuples of argument values).

    ``emulator``: which cases the emulator runs - None (all), a collection of
    indices into ``cases`` or a predicate on a case; the others are marked
    full_grid.  ``reference_only``: a predicate marking cases only the NumPy
    reference must support.
    """
    def pick(sel, i, case):
        if sel is None:
            return None
        return sel(case) if callable(sel) else i in sel

    out = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        marks = []
        if pick(emulator, i, case) is False:
            marks.append(pytest.mark.full_grid)
        if pick(reference_only, i, case):
            marks.append(pytest.mark.reference_only)
        out.append(pytest.param(*values, marks=marks, id=None if ids is None else ids(case)))
    return out


@pytest.fixture
def sm90_nvrtc():
    """(cuflash._nvrtc, cuflash._sass) where NVRTC compiles for sm_90 and the SASS tools are
    here (the machine-code tests of the Hopper code); else the test is skipped, saying why."""
    from cuflash import _nvrtc, _sass
    ok, why = _nvrtc.is_available()
    if not ok:
        pytest.skip(f"NVRTC not available: {why}")
    ok, why = _sass.is_available()
    if not ok:
        pytest.skip(why)
    if 90 not in _nvrtc.supported_archs():
        pytest.skip(f"this NVRTC ({_nvrtc.version()}) does not compile for sm_90")
    return _nvrtc, _sass


@contextlib.contextmanager
def lean_layout(monkeypatch, kernel, bq, bkv, d):
    """The emulator's race-checked Runtime with its shared-memory limit one byte under
    ``kernel``'s own layout of (bq, bkv) at head dim d, so that its plans take the smaller one
    (``KernelTiling.smaller``): yields (runtime, the smaller layout's bytes, its defines), its
    compiled modules dropped before and after."""
    from cuflash import kernels, tiling
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    t = tiling.kernel_tiling(kernel)
    lean, defines = t.smaller(bq, bkv, d, d, 4)
    monkeypatch.setattr(rt, "smem_limit", t.shared_bytes(bq, bkv, d, d, 4) - 1)
    rt.calls.clear()
    try:
        yield rt, lean, defines
    finally:
        rt.calls.clear()


@pytest.fixture
def a100_plans(kernel_backend, monkeypatch):
    """The "cuda" Runtime planning as an A100 does (its 163 KB shared-memory limit, the Hopper
    kernels off) on whatever GPU is at hand, its compiled modules dropped before and after;
    off a GPU the test is skipped (the emulator's sm_80 plans so by default)."""
    if not kernel_backend.is_cuda:
        pytest.skip("a GPU test: the emulator's sm_80 runs these plans by default")
    from cuflash import cuda_backend, kernels, tiling
    rt = cuda_backend.runtime()
    monkeypatch.setattr(rt, "smem_limit", tiling.EMULATOR_ARCHES["sm_80"])
    monkeypatch.setenv(kernels.WGMMA_ENV, "0")
    rt.calls.clear()
    yield rt
    rt.calls.clear()


@pytest.fixture
def sm90_gpu(monkeypatch):
    """(cupy, the "cuda" Runtime with the Hopper kernels chosen: CUFLASH_WGMMA=1) on an sm_90
    GPU; else the test is skipped, saying why."""
    cp = pytest.importorskip("cupy")
    require_backend("cuda")
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU")
    from cuflash import kernels
    monkeypatch.setenv(kernels.WGMMA_ENV, "1")
    rt = kernels.get_runtime("cuda")
    assert rt.wgmma
    return cp, rt


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id so a failure reproduces.

    The id is taken as ``tests/<file>::<test>`` whatever the area folder the file sits in
    (file names are unique across the areas: tests/package/test_layout.py), so moving a file
    between areas does not change the inputs its tests draw."""
    import zlib
    path, sep, rest = request.node.nodeid.partition("::")
    key = "tests/" + path.rsplit("/", 1)[-1] + sep + rest
    return np.random.default_rng(zlib.crc32(key.encode()))


def load_bench(name):
    """The module of the script bench/<name>.py (bench/ is not a package; the scripts import
    one another, so bench/ goes on sys.path first)."""
    import importlib.util
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

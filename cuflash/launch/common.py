"""What every kernel launcher shares: addressing inputs, allocating outputs, parameter blocks.

All launchers take a :class:`cuflash.kernels.Runtime` (array module, module
factory, shared-memory limit), so CuPy arrays on a GPU and NumPy arrays on the
emulator go through identical launch code.

The repeated-call path.  A launcher validates and plans a call once per
distinct (shapes, strides, dtypes, scalar options) and keeps the result -- the
compiled kernels, grids, a packed parameter block in device memory -- as a
closure in ``runtime.calls`` (:func:`cached_call`); an identical later call
does a dictionary lookup, allocates its outputs and launches, nothing else (no
device query, no synchronisation, no host-to-device copy).  Every launch goes
through :func:`launch` and every output through :func:`alloc_output`, so tests
observe them (:func:`observe_launches`, :func:`output_hook`,
:func:`track_allocations`) without patching the launchers.
"""
import contextlib
import functools
import re
import threading

import numpy as np

from .. import emulator, kernels, tiling
from .._validate import sum_to_shape

__all__ = [
    "problem_dims", "flatten_lead", "pointer_arg", "contiguous_strides", "alloc_output",
    "output_hook", "track_allocations", "observe_launches", "launch", "params_dtype",
    "make_params", "fold_grid", "cached_call", "array_key", "MAX_GRID_X", "data_ptr", "aligned16",
    "aligned_copies", "kv_heads_for_kernel", "record_copy", "elem_strides", "collapse_strides",
    "acc_dtype", "grad_shapes", "sum_back", "zero_grads",
]

# CUDA's limit on gridDim.x (y and z: 65535, which is why batch/heads are folded into x)
MAX_GRID_X = 2 ** 31 - 1

_state = threading.local()
_ALLOC_HOOK = None
_LAUNCH_HOOK = None


@contextlib.contextmanager
def output_hook(fn):
    """Call ``fn(array)`` on every output the launchers allocate, inside the block.

    Tests use it to fill outputs with NaN before the kernel runs, so elements a
    kernel fails to write show up as NaN (``xp.empty`` may happen to hold zeros).
    """
    global _ALLOC_HOOK
    prev, _ALLOC_HOOK = _ALLOC_HOOK, fn
    try:
        yield
    finally:
        _ALLOC_HOOK = prev


@contextlib.contextmanager
def track_allocations():
    """Record the sizes (elements) of all arrays the launch code allocates in the block.

    Yields a list of ``(what, shape)`` that fills up as launches run.
    """
    prev = getattr(_state, "ledger", None)
    _state.ledger = []
    try:
        yield _state.ledger
    finally:
        _state.ledger = prev


@contextlib.contextmanager
def observe_launches():
    """Record every kernel launch in the block: yields a list of dicts.

    Each entry has ``kernel``, ``grid``, ``block``, ``shared_mem`` and, on the
    emulator, the launch's counters (``global_bytes_read``/``_written``, from
    :func:`cuflash.emulator.last_launch_stats`).
    """
    global _LAUNCH_HOOK
    seen = []
    prev = _LAUNCH_HOOK

    def hook(name, grid, block, shared_mem, runtime_name):
        entry = {"kernel": name, "grid": tuple(grid), "block": tuple(block),
                 "shared_mem": int(shared_mem)}
        if runtime_name == "emulator":
            st = emulator.last_launch_stats()
            entry.update(global_bytes_read=st["global_bytes_read"],
                         global_bytes_written=st["global_bytes_written"])
        seen.append(entry)
        if prev is not None:
            prev(name, grid, block, shared_mem, runtime_name)
    _LAUNCH_HOOK = hook
    try:
        yield seen
    finally:
        _LAUNCH_HOOK = prev


def launch(runtime_name, fn, name, grid, block, args, shared_mem):
    """``fn(grid, block, args, shared_mem=...)``, reported to :func:`observe_launches`."""
    fn(grid, block, args, shared_mem=shared_mem)
    if _LAUNCH_HOOK is not None:
        _LAUNCH_HOOK(name, grid, block, shared_mem, runtime_name)


def record_copy(what, arr):
    """Record an array the launch path made (for ``verify_no_full_materialization``)."""
    ledger = getattr(_state, "ledger", None)
    if ledger is not None:
        ledger.append((what, tuple(arr.shape)))


def alloc_output(xp, shape, dtype, what="output"):
    """``xp.empty(shape, dtype)``, recorded, and passed to the output hook if one is set."""
    out = xp.empty(shape, dtype=dtype)
    record_copy(what, out)
    if _ALLOC_HOOK is not None:
        _ALLOC_HOOK(out)
    return out


# --------------------------------------------------------------------------
# the repeated-call cache
# --------------------------------------------------------------------------
def cached_call(runtime, key, build):
    """The prepared call for ``key`` in ``runtime.calls``; ``build()`` makes it when absent.

    ``key`` None (an input that cannot be keyed: not an array, an unhashable
    option) always builds, so the slow path raises the proper error.
    """
    if key is not None:
        try:
            run = runtime.calls.get(key)
        except TypeError:  # an unhashable option: validation will say what is wrong
            key, run = None, None
        if run is not None:
            return run
    run = build()
    if key is not None:
        runtime.calls.put(key, run)
    return run


def array_key(*arrays):
    """The (shape, strides, dtype) of each array: what a prepared call depends on in them."""
    return tuple((tuple(a.shape), tuple(a.strides), a.dtype) for a in arrays)


# --------------------------------------------------------------------------
# addressing inputs
# --------------------------------------------------------------------------
def problem_dims(lead):
    """(B, H) for an output leading shape: H = last axis (heads), B = product of the rest.

    ``()`` (plain 2-D inputs) is one problem, (1, 1).
    """
    if len(lead) == 0:
        return 1, 1
    B = 1
    for s in lead[:-1]:
        B *= int(s)
    return B, int(lead[-1])


def elem_strides(x):
    """``x``'s strides in elements, or None when one is not a whole number of them."""
    isz = x.itemsize
    if any(s % isz for s in x.strides):
        return None
    return [s // isz for s in x.strides]


def collapse_strides(sizes, strides):
    """One stride for iterating ``sizes`` (C order) as a flat index, or None if impossible."""
    dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
    if not dims:
        return 0
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return dims[-1][1]


def pointer_arg(runtime, x):
    """``x`` as a kernel pointer argument for this runtime (the address of ``x[0, ..., 0]``).

    CuPy passes any array's data pointer.  The emulator accepts only C-contiguous
    arrays (so that a pointer is never mistaken for a strided view); a strided
    view with non-negative strides is therefore handed over as the contiguous
    1-D span of its buffer that starts at its first element (the same address;
    the kernel applies the strides).  Negative strides have been removed by
    :func:`flatten_lead` for such runtimes.
    """
    if getattr(runtime, "name", None) != "emulator" or x.flags.c_contiguous:
        return x
    if any(s < 0 for s in x.strides):
        raise ValueError("internal: negative strides reached the emulator (flatten_lead copies them)")
    span = sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + x.itemsize if x.size else 0
    n = -(-span // x.itemsize)
    return np.lib.stride_tricks.as_strided(x, shape=(n,), strides=(x.itemsize,))


def flatten_lead(runtime, x, lead):
    """Address ``x`` (shape ``x_lead + (N, dim)``) as the (B, H) problems of ``lead``.

    ``runtime`` is a :class:`cuflash.kernels.Runtime` or the module numpy/cupy; the emulator's
    kernels cannot take negative strides, so such inputs are copied for it (pass the result
    through :func:`pointer_arg` when launching).  ``x``'s leading dims broadcast to ``lead``
    (the output's), or -- k/v of a grouped-query call -- end with the kv heads Hk, which the
    kernels index as ``h // group``: both are addressed the same way.  Returns
    ``(arr, (sb, sh, sr))``: ``x`` itself (or a copy when its last dim is strided) and the
    element strides of batch (one flat index over ``lead[:-1]``), head and row, 0 along
    broadcast axes.  The batch stride exists only when ``x``'s strides over
    ``lead[:-1]`` nest; otherwise (broadcast along one batch axis but not another) ``x`` is
    materialised by a broadcast copy of shape ``lead[:-1] + (heads,) + x.shape[-2:]``.  The
    decision depends only on shapes and strides, so a repeated call makes the same one.
    """
    xp = getattr(runtime, "xp", runtime)
    no_negative = getattr(runtime, "name", None) == "emulator"
    if (x.ndim >= 1 and x.shape[-1] > 1 and x.strides[-1] != x.itemsize) or (
            no_negative and any(s < 0 for s in x.strides)):
        x = xp.ascontiguousarray(x)
        record_copy("contiguous copy", x)
    es = elem_strides(x)
    if es is None:  # strides that are not whole elements (views of odd buffers)
        x = xp.ascontiguousarray(x)
        record_copy("contiguous copy", x)
        es = elem_strides(x)
    nl = len(lead)
    sr = es[-2]
    if nl == 0:
        return x, (0, 0, sr)
    xl = tuple(x.shape[:-2])
    pad = nl - len(xl)
    sizes = (1,) * pad + xl
    strides = [0] * pad + es[:-2]
    head_size = sizes[-1]
    sh = 0 if head_size == 1 else strides[-1]
    batch_strides = [0 if n == 1 else s for n, s in zip(sizes[:-1], strides[:-1])]
    # broadcast axes read index 0 (stride 0); the others must match lead's size
    sb = collapse_strides(lead[:-1], batch_strides)
    if sb is None:
        # no single batch stride exists: materialise the broadcast (see the docstring)
        full = tuple(lead[:-1]) + (head_size,) + tuple(x.shape[-2:])
        x = xp.ascontiguousarray(xp.broadcast_to(x.reshape((1,) * pad + x.shape), full))
        record_copy("broadcast copy", x)
        es = elem_strides(x)
        sr = es[-2]
        sh = 0 if head_size == 1 else es[-3]
        sb = collapse_strides(lead[:-1], [0 if n == 1 else s for n, s in zip(lead[:-1], es[:-3])])
    return x, (int(sb), int(sh), int(sr))


def kv_heads_for_kernel(spec):
    """(Hk, group) the kernels use: kv heads per batch entry and query heads per kv head.

    Grouped-query calls use the spec's group.  When k/v have a single head (or
    no heads axis) and q has H > 1 heads (MQA, or plain broadcasting over the
    heads axis), the kernels treat it as one group of H heads as well, so dK/dV
    are summed over the heads inside the dkdv block instead of on the host.
    """
    B, H = problem_dims(spec.lead)
    if spec.group > 1:
        return H // spec.group, spec.group
    # kv_lead is right-aligned with lead: its last axis (if any) is the heads axis
    kv_heads = spec.kv_lead[-1] if spec.kv_lead else 1
    if spec.lead and kv_heads == 1 and H > 1:
        return 1, H
    return H, 1


def acc_dtype(dtype):
    """The compute (accumulator) dtype of an input dtype: float64 for float64, else float32."""
    return np.dtype(np.float64) if tiling.accumulator_bytes(dtype) == 8 else np.dtype(np.float32)


def contiguous_strides(lead, tail):
    """(sb, sh) element strides of a C-contiguous array of shape ``lead + tail``."""
    B, H = problem_dims(lead)
    per = 1
    for s in tail:
        per *= int(s)
    return H * per, per


def data_ptr(x):
    """Device (CuPy) or host (NumPy) address of ``x``'s first element."""
    if (type(x).__module__ or "").split(".")[0] == "cupy":
        return int(x.data.ptr)
    return int(x.__array_interface__["data"][0])


def aligned16(x, strides):
    """True when 16-byte copies (cp.async) of rows of ``x`` read aligned addresses.

    Needs a 16-byte aligned first element and row/head/batch element strides
    that are whole multiples of 16 bytes (8 elements of a 16-bit type, 4 of float32).
    """
    return data_ptr(x) % 16 == 0 and all((s * x.itemsize) % 16 == 0 for s in strides)


def aligned_copies(xp, arrays):
    """``arrays`` as they are where 16-byte copies can read their rows (C-contiguous, aligned
    start and rows), else fresh C-contiguous copies -- also of a contiguous view that starts
    off a 16-byte boundary, which ``ascontiguousarray`` would return unchanged."""
    out = []
    for x in arrays:
        if x.flags.c_contiguous and x.strides[-1] == x.itemsize and \
                aligned16(x, [s // x.itemsize for s in x.strides[:-1]]):
            out.append(x)
        else:
            c = x.copy()  # C order, a new allocation (aligned by the allocator)
            record_copy("aligned copy", c)
            out.append(c)
    return out


# --------------------------------------------------------------------------
# parameter blocks (kernels_cu/params.cuh) and the folded grid
# --------------------------------------------------------------------------
_C_TYPES = {"int": "<i4", "long long": "<i8", "double": "<f8"}
_FIELD_RE = re.compile(r"^\s*(long long|int|double)\s+([A-Za-z_][\w\s,]*);")


@functools.lru_cache(maxsize=None)
def params_dtype(struct):
    """The NumPy structured dtype of ``struct`` in ``kernels_cu/params.cuh`` (C alignment).

    The header is the one definition of the layout; this reads its field list
    (``int``, ``long long``, ``double`` members, in order) so that Python and
    the kernels cannot disagree.
    """
    with open(kernels.source_path("params.cuh")) as f:
        text = f.read()
    m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(struct), text, re.S)
    if m is None:
        raise KeyError(f"no struct {struct} in params.cuh")
    fields = []
    for line in m.group(1).splitlines():
        line = line.split("//")[0]
        fm = _FIELD_RE.match(line)
        if fm is None:
            if line.strip():
                raise ValueError(f"params.cuh, struct {struct}: cannot read {line.strip()!r}")
            continue
        for name in fm.group(2).split(","):
            fields.append((name.strip(), _C_TYPES[fm.group(1)]))
    return np.dtype(fields, align=True)


def make_params(runtime, struct, **values):
    """A ``struct`` parameter block holding ``values``, in the runtime's memory.

    Every field must be given (``pad*`` fields are zero), except the ``mask_*``
    fields of the logit features, which default to 0 ("off"): only the
    launchers of calls with features set them.  Returns a 1-D uint8
    array (NumPy on the emulator, CuPy on a GPU) whose address the kernels
    receive as ``const struct*``.  On a GPU the copy is synchronised once here
    (the block is then reused, unchanged, by every later identical call, on
    any stream).
    """
    dt = params_dtype(struct)
    missing = [n for n in dt.names if n not in values and not n.startswith(("pad", "mask_"))]
    extra = [n for n in values if n not in dt.names]
    if missing or extra:
        raise ValueError(f"internal: {struct} fields missing {missing}, unknown {extra}")
    host = np.zeros(1, dtype=dt)
    for n, val in values.items():
        host[n] = val
    raw = host.view(np.uint8)
    if runtime.name == "emulator":
        return raw
    dev = runtime.xp.asarray(raw)
    runtime.synchronize()
    return dev


def fold_grid(n_tiles, heads, batch, what):
    """The grid ``(n_tiles * heads * batch,)`` of a folded launch, or ValueError past CUDA's limit."""
    blocks = int(n_tiles) * int(heads) * int(batch)
    if blocks > MAX_GRID_X:
        raise ValueError(f"{what} needs {blocks} thread blocks ({n_tiles} tiles x {heads} heads x "
                         f"{batch} batch entries), more than a CUDA grid holds ({MAX_GRID_X}); "
                         "split the call along the batch")
    return (blocks,)


# --------------------------------------------------------------------------
# gradients of broadcast inputs (both backward families)
# --------------------------------------------------------------------------
def grad_shapes(spec, q, k, v, Hk):
    """``(want, summed, alloc_shape)`` per gradient name ("dq", "dk", "dv").

    A kernel writes one gradient per problem it computes -- dq per query head
    problem of ``lead``, dk/dv per kv head and batch entry -- so the gradient of
    an input broadcast along a leading axis is allocated at that full shape
    (``summed`` True) and summed back to the input's shape (``want``) by
    :func:`sum_back`.
    """
    lead = spec.lead
    kv_lead = tuple(lead[:-1]) + (Hk,) if lead else ()
    full = {"dq": tuple(lead) + (spec.Nq, spec.d), "dk": kv_lead + (spec.Nk, spec.d),
            "dv": kv_lead + (spec.Nk, spec.dv)}
    want = {"dq": tuple(q.shape), "dk": tuple(k.shape), "dv": tuple(v.shape)}
    summed = {n: int(np.prod(want[n], dtype=np.int64)) != int(np.prod(full[n], dtype=np.int64))
              for n in full}
    alloc_shape = {n: full[n] if summed[n] else want[n] for n in full}
    return want, summed, alloc_shape


def sum_back(xp, acc, dtype, want, summed):
    """``fn(g, name)``: gradient ``name`` in its input's shape (see :func:`grad_shapes`)."""
    def fn(g, name):
        if not summed[name]:
            return g
        # sums in the accumulator precision, rounded once to the input dtype
        return xp.ascontiguousarray(sum_to_shape(g.astype(acc), want[name]).astype(dtype))
    return fn


def zero_grads(xp, spec, q, k, v, ms):
    """The prepared backward of a call without query rows, keys or problems: zeros.

    ``ms`` (a MaskSpec with ``return_dbias``) adds a zero bias gradient.
    """
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    dtype = spec.dtype
    want_db = ms is not None and ms.return_dbias

    def run_empty(do, q, k, v, o, lse, f=None):
        grads = tuple(xp.zeros(s, dtype) for s in shapes)
        return grads + ((xp.zeros(ms.bias_shape, ms.bias.dtype),) if want_db else ())
    return run_empty

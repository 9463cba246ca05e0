"""The backward kernels (kernels_cu/flash_bwd.cu) and their launch/tiling code.

Written once over the backend: "numpy" (the reference, the same assertions)
and "emulator" always; "cuda" when CuPy and a GPU are present, else skipped
with the reason.  o and lse come from the float64 oracle (not from our
forward), so a failure here is the backward's.  Every array the launcher
allocates (dq, dk, dv, D, the float32 dQ accumulator) is poisoned with NaN
before the kernels run (``cuflash._launch.output_hook``), so an element the
kernels fail to write -- or read before writing -- fails the test.

Emulated cost: one compile per specialisation (dtype, d, dv, tiles; ~2-3 s on
2 cores, cached on disk afterwards) plus ~0.05-0.5 s per call, so the oracle
cases are sampled to share few specialisations while still covering odd
lengths, Nq != Nk both ways, both causal alignments with rows that see no key,
MHA/GQA/MQA, broadcast leading dims, strided inputs, d in {16, 32, 64, 96,
128, 256}, every dtype, and both dQ paths (deterministic pass and atomics).
"""
import contextlib

import numpy as np
import pytest

import cuflash
import oracle
from conftest import Backend, poisoned_outputs, require_backend
from cuflash import _launch, _launch_bwd, _validate, kernels, tiling


def _make(rng, dtype, shape, layout):
    """A random input: 'c' contiguous, or 'strided' (a view with a row stride != dim and
    every other leading index skipped)."""
    if layout == "c":
        return oracle.randn(rng, shape, dtype)
    big = oracle.randn(rng, shape[:-3] + (2 * shape[-3], shape[-2], shape[-1] + 3), dtype)
    return big[..., ::2, :, 1:shape[-1] + 1]


def _lse_dtype(dtype):
    return np.float64 if dtype == "float64" else np.float32


def _fwd_from_oracle(q, k, v, causal, dtype, scale=None):
    """o (in the input dtype) and lse (float32, float64 for float64) from the float64 oracle."""
    o, lse, _ = oracle.attention(q, k, v, scale, causal)
    return o.astype(oracle.dtype_of(dtype)), lse.astype(_lse_dtype(dtype))


def _require_dtype(backend, dtype):
    """Skip bfloat16 on CuPy builds that cannot hold ml_dtypes.bfloat16 arrays."""
    if backend.is_cuda and dtype == "bfloat16":
        try:
            backend.asarray(np.zeros(1, oracle.dtype_of("bfloat16")))
        except Exception as e:  # noqa: BLE001 - any refusal means: not supported here
            pytest.skip(f"this CuPy has no bfloat16 arrays: {e}")


def _run_bwd(backend, do, q, k, v, o, lse, **kw):
    a = backend.asarray
    with poisoned_outputs():
        g = cuflash.tiled_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse),
                                             backend=backend.name, **kw)
    return tuple(backend.to_numpy(x) for x in g)


# --------------------------------------------------------------------------
# dq, dk, dv against the float64 oracle
# --------------------------------------------------------------------------
# (dtype, q shape, k shape, causal, block_q, block_kv, layout, deterministic)
# Cases sharing (dtype, d, tiles) share one compiled specialisation.
BWD_CASES = [
    # float32, d=64, default tiles: GQA 6/2 with Nq > Nk (rows that see no key), atomic dQ
    ("float32", (2, 6, 77, 64), (2, 2, 50, 64), "bottom_right", None, None, "c", False),
    ("float32", (1, 113, 64), (1, 203, 64), False, None, None, "c", True),
    ("float32", (2, 6, 97, 64), (2, 1, 97, 64), "top_left", None, None, "c", False),    # MQA
    ("float32", (2, 3, 40, 64), (2, 3, 61, 64), "bottom_right", None, None, "strided", True),
    # GQA 6/2 and k/v broadcast over the batch: group summed in the block, batch on the host
    ("float32", (2, 6, 30, 64), (1, 2, 41, 64), "top_left", None, None, "c", False),
    # float64 (computed in double: 1e-12); dQ always by the deterministic pass
    ("float64", (3, 128, 64), (3, 127, 64), "bottom_right", None, None, "c", False),
    ("float64", (2, 6, 5, 64), (2, 6, 2, 64), "bottom_right", None, None, "c", True),  # 3 rows see nothing
    ("float64", (1, 6, 203, 64), (1, 2, 113, 64), "top_left", None, None, "c", True),  # GQA, Nq > Nk
    # float16, d=32
    ("float16", (2, 3, 200, 32), (2, 3, 200, 32), True, None, None, "c", False),
    # Nk = 1: dk, dv carry everything; dq is 0 by the math (P = 1, dS = 0) up to rounding
    ("float16", (6, 17, 32), (6, 1, 32), False, None, None, "c", True),
    # bfloat16, d=16
    ("bfloat16", (1, 6, 255, 16), (1, 2, 255, 16), "bottom_right", None, None, "c", True),
    ("bfloat16", (3, 1, 16), (3, 147, 16), "top_left", None, None, "c", False),        # Nq = 1
    # the other head dims
    ("float32", (2, 2, 128, 96), (2, 2, 127, 96), "bottom_right", None, None, "c", False),
    ("float16", (1, 2, 97, 128), (1, 2, 113, 128), "top_left", None, None, "c", True),
    ("float64", (2, 40, 256), (2, 33, 256), "bottom_right", None, None, "c", True),
    ("bfloat16", (1, 2, 17, 256), (1, 2, 200, 256), False, None, None, "c", False),
    # explicit tiles; broadcast leading dims (2, 1) x (3,) -> (2, 3): dq and dk/dv summed
    ("float32", (2, 1, 37, 16), (3, 50, 16), "top_left", 16, 8, "c", True),
    ("float32", (2, 1, 37, 16), (3, 50, 16), "bottom_right", 16, 8, "c", False),
    ("float32", (2, 2, 5, 16), (2, 2, 45, 16), "bottom_right", 16, 8, "strided", False),
    ("float64", (2, 1, 2), (2, 3, 2), False, None, None, "c", True),  # d=2, Nq = 1
    # (Nk = 1 would make dq exactly 0 in theory: P = 1, dS = 0 -- a comparison with zeros)
]


def _case_id(c):
    dt, qs, ks, causal, bq, bkv, lay, det = c
    tiles = "" if bq is None else f"-t{bq}x{bkv}"
    return (f"{dt}-q{'x'.join(map(str, qs))}-k{'x'.join(map(str, ks))}-{causal}{tiles}-{lay}"
            f"-{'det' if det else 'atomic'}")


@pytest.mark.parametrize("case", BWD_CASES, ids=_case_id)
def test_backward_against_oracle(kb, case, rng):
    dtype, qs, ks, causal, bq, bkv, layout, det = case
    _require_dtype(kb, dtype)
    q = _make(rng, dtype, qs, layout)
    k = _make(rng, dtype, ks, layout)
    v = _make(rng, dtype, ks, layout)
    o, lse = _fwd_from_oracle(q, k, v, causal, dtype)
    do = oracle.randn(rng, o.shape, dtype)
    before = [x.copy() for x in (do, q, k, v, o, lse)]
    grads = _run_bwd(kb, do, q, k, v, o, lse, causal=causal, block_q=bq, block_kv=bkv,
                     deterministic=det)
    for g, x, n in zip(grads, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{n}: {g.shape} {g.dtype}"
    oracle.check_backward(grads, do, q, k, v, None, causal)
    for x, b, n in zip((do, q, k, v, o, lse), before, ("do", "q", "k", "v", "o", "lse")):
        assert np.array_equal(x, b, equal_nan=True), f"input {n} was modified"


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_rows_and_keys_nobody_sees_get_exact_zeros(kb, causal, rng):
    """Query rows that see no key: dq = 0 exactly; keys no query sees: dk = dv = 0; no NaN."""
    # bottom_right with Nq > Nk: rows 0..Nq-Nk-1 see nothing.  top_left with Nk > Nq:
    # keys Nq.. are seen by nobody.
    Nq, Nk = (45, 20) if causal == "bottom_right" else (20, 45)
    q, k, v = oracle.qkv(rng, (2, 3, Nq, 32), (2, 3, Nk, 32), dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, causal, "float32")
    do = oracle.randn(rng, o.shape, "float32")
    for det in (True, False):
        dq, dk, dv = _run_bwd(kb, do, q, k, v, o, lse, causal=causal, deterministic=det)
        for g in (dq, dk, dv):
            assert not np.isnan(g).any()
        if causal == "bottom_right":
            # (row Nq - Nk sees one key: P = 1, dS = 0, dq ~ 0 by the math; later rows see more)
            assert np.all(dq[..., :Nq - Nk, :] == 0) and np.all(dq[..., Nq - Nk + 1:, :] != 0)
        else:
            assert np.all(dk[..., Nq:, :] == 0) and np.all(dv[..., Nq:, :] == 0)
            assert np.all(dv[..., :Nq, :] != 0)
        oracle.check_backward((dq, dk, dv), do, q, k, v, None, causal)


def test_scale_and_huge_logits(kb, rng):
    """An explicit scale, and logits of magnitude ~1e2 (P is exp(s - lse): no overflow)."""
    q = oracle.randn(rng, (2, 33, 32), "float64", scale=30.0)
    k = oracle.randn(rng, (2, 41, 32), "float64")
    v = oracle.randn(rng, (2, 41, 32), "float64")
    o, lse = _fwd_from_oracle(q, k, v, "top_left", "float64", scale=0.7)
    do = oracle.randn(rng, o.shape, "float64")
    grads = _run_bwd(kb, do, q, k, v, o, lse, causal="top_left", scale=0.7)
    oracle.check_backward(grads, do, q, k, v, 0.7, "top_left")


def test_dv_differs_from_d(kb, rng):
    """The backward kernels take dv != d (HEAD_DIM_V is its own define)."""
    q, k, v = oracle.qkv(rng, (2, 33, 96), (2, 41, 96), (2, 41, 32), dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, "bottom_right", "float32")
    do = oracle.randn(rng, o.shape, "float32")
    for det in (True, False):
        grads = _run_bwd(kb, do, q, k, v, o, lse, causal=True, deterministic=det)
        oracle.check_backward(grads, do, q, k, v, None, True)


def test_empty_sequences(kb, rng):
    """Nq = 0: dq empty, dk = dv = 0.  Nk = 0: dq = 0, dk/dv empty."""
    for Nq, Nk in ((0, 9), (7, 0)):
        q, k, v = oracle.qkv(rng, (2, Nq, 16), (2, Nk, 16), dtype="float32")
        do = oracle.randn(rng, (2, Nq, 16), "float32")
        o = np.zeros((2, Nq, 16), np.float32)
        lse = np.full((2, Nq), -np.inf, np.float32)
        dq, dk, dv = _run_bwd(kb, do, q, k, v, o, lse)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for g in (dq, dk, dv):
            assert np.all(g == 0)


def test_no_full_materialization(kernel_backend, rng):
    """Every array the backward allocates is O(N d): none grows with Nq * Nk."""
    # d = 32 float32: the specialisation test_deterministic_is_bitwise_repeatable compiles
    q, k, v = oracle.qkv(rng, (1, 2, 200, 32), (1, 2, 230, 32), dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, False, "float32")
    do = oracle.randn(rng, o.shape, "float32")
    for det in (True, False):
        with _launch.track_allocations() as ledger:
            grads = _run_bwd(kernel_backend, do, q, k, v, o, lse, deterministic=det)
        oracle.check_backward(grads, do, q, k, v)
        sizes = {what: int(np.prod(shape)) for what, shape in ledger}
        assert sizes and max(sizes.values()) <= 2 * 230 * 32, sizes  # (B*H, N, d) at most


# --------------------------------------------------------------------------
# determinism: deterministic=True is bitwise repeatable; the atomic path agrees
# --------------------------------------------------------------------------
def test_deterministic_is_bitwise_repeatable(kb, rng):
    q, k, v = oracle.qkv(rng, (2, 4, 70, 32), (2, 2, 90, 32), dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, "bottom_right", "float32")
    do = oracle.randn(rng, o.shape, "float32")
    runs = [_run_bwd(kb, do, q, k, v, o, lse, causal=True, deterministic=True)
            for _ in range(3)]
    for r in runs[1:]:
        for a, b, n in zip(runs[0], r, ("dq", "dk", "dv")):
            assert np.array_equal(a, b), f"{n} differs between deterministic runs"
    oracle.check_backward(runs[0], do, q, k, v, None, True)
    atomic = _run_bwd(kb, do, q, k, v, o, lse, causal=True, deterministic=False)
    oracle.check_backward(atomic, do, q, k, v, None, True)
    # dK/dV never use atomics: the same bits on both paths
    assert np.array_equal(atomic[1], runs[0][1]) and np.array_equal(atomic[2], runs[0][2])


# --------------------------------------------------------------------------
# tiles: one module sizes them; defaults fit; refusals state budget and choices
# --------------------------------------------------------------------------
BWD_KERNELS = ("flash_bwd_dkdv", "flash_bwd_dq")


@pytest.mark.parametrize("arch", sorted(tiling.EMULATOR_ARCHES))
def test_default_tiles_fit_every_arch(arch):
    limit = tiling.EMULATOR_ARCHES[arch]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d in (1, 16, 32, 59, 64, 96, 128, 200, 256):
            acc = tiling.accumulator_bytes(oracle.dtype_of(dtype) if dtype != "bfloat16"
                                           else np.float32)
            if tiling.kernel_tiling("flash_bwd_dkdv").shared_bytes(8, 8, d, d, acc) > limit:
                # even the smallest tiles do not fit (float64, d=256 on sm_75's 64 KB):
                # refused, stating the budget
                with pytest.raises(ValueError, match=f"budget is {limit} B"):
                    tiling.plan("flash_bwd_dkdv", d, d, dtype, limit=limit, limit_source=arch)
                continue
            p = tiling.plan("flash_bwd_dkdv", d, d, dtype, limit=limit, limit_source=arch)
            assert p.shared_bytes <= limit and p.threads == tiling.BWD_THREADS
            q = tiling.plan("flash_bwd_dq", d, d, dtype, p.block_q, p.block_kv, limit=limit,
                            limit_source=arch)
            assert q.shared_bytes <= p.shared_bytes


def test_shared_bytes_exact():
    """The formula the kernel's pointer arithmetic implies, spelled out once more."""
    for d, dv, bq, bkv in ((64, 64, 64, 64), (96, 32, 16, 32), (256, 256, 8, 16)):
        for acc, dt in ((4, "float32"), (8, "float64")):
            p = tiling.plan("flash_bwd_dkdv", d, dv, dt, bq, bkv)
            want = acc * (bkv * (d + 1) + bkv * (dv + 1) + bq * (d + 1) + bq * (dv + 1)
                          + bq * bkv + bq * bkv + bq + bq)
            assert p.shared_bytes == want
            assert tiling.plan("flash_bwd_dq", d, dv, dt, bq, bkv).shared_bytes == want - acc * bq * bkv


def test_explicit_tiles_never_changed():
    p = tiling.plan("flash_bwd_dkdv", 64, 64, "float32", 8, 64)
    assert (p.block_q, p.block_kv, p.chosen) == (8, 64, "explicit")
    with pytest.raises(ValueError, match=r"budget is 166912 B \(sm_80\).*pairs that fit"):
        tiling.plan("flash_bwd_dkdv", 64, 64, "float64", 64, 64, limit=166912,
                    limit_source="sm_80")
    with pytest.raises(ValueError, match="accumulator registers"):
        tiling.plan("flash_bwd_dkdv", 256, 256, "float32", 16, 64)
    with pytest.raises(ValueError, match=r"supported block_q: \[8, 16, 32, 64, 128\]"):
        tiling.plan("flash_bwd_dkdv", 64, 64, "float32", 24, 32)


@pytest.mark.parametrize("bq,bkv,needle", [
    (24, 32, "does not support block_q=24"),
    (64, 32, "budget is"),            # float64 d=128: 231936 B > the nominal sm_80 166912 B
    (32, 128, "accumulator registers"),
])
def test_unsupported_tiles_refused(kernel_backend, bq, bkv, needle, rng):
    if needle == "budget is":
        limit = tiling.device_smem_limit(kernel_backend.name)[0]
        need = tiling.kernel_tiling("flash_bwd_dkdv").shared_bytes(bq, bkv, 128, 128, 8)
        if need <= limit:  # an H100 (227 KB) takes it
            pytest.skip(f"{need} B fit this device's {limit} B of shared memory")
    q, k, v = oracle.qkv(rng, (1, 9, 128), (1, 9, 128), dtype="float64")
    o, lse = _fwd_from_oracle(q, k, v, False, "float64")
    with pytest.raises(ValueError, match=needle):
        _run_bwd(kernel_backend, o, q, k, v, o, lse, block_q=bq, block_kv=bkv)


# --------------------------------------------------------------------------
# emulator: global-memory traffic, race check
# --------------------------------------------------------------------------
@contextlib.contextmanager
def _count_launches():
    """Sum the emulator's byte counters over every kernel launched in the block."""
    total = {"global_bytes_read": 0, "global_bytes_written": 0, "launches": []}
    with _launch.observe_launches() as seen:
        yield total
    for entry in seen:
        total["global_bytes_read"] += entry["global_bytes_read"]
        total["global_bytes_written"] += entry["global_bytes_written"]
        total["launches"].append(entry["kernel"])


@pytest.mark.parametrize("qs,ks,causal,det", [
    ((2, 4, 45, 32), (2, 2, 70, 32), "bottom_right", True),
    ((2, 4, 45, 32), (2, 2, 70, 32), "bottom_right", False),
    ((1, 3, 70, 32), (1, 3, 33, 32), "top_left", False),
    ((1, 3, 70, 32), (1, 1, 33, 32), None, True),
])
def test_traffic_equals_model(qs, ks, causal, det, rng):
    """Bytes the emulated kernels move == cuflash.tiling.flash_bwd_traffic."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, causal or False, "float32")
    do = oracle.randn(rng, o.shape, "float32")
    with _count_launches() as total:
        _run_bwd(Backend("emulator"), do, q, k, v, o, lse, causal=causal or False,
                 deterministic=det)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal or False)
    plan = tiling.plan("flash_bwd_dkdv", 32, 32, "float32",
                       limit=tiling.EMULATOR_ARCHES["sm_80"], limit_source="sm_80")
    B, H = _launch.problem_dims(spec.lead)
    Hk, _ = _launch_bwd.kv_heads_for_kernel(spec)
    want = tiling.flash_bwd_traffic(B, H, Hk, spec.Nq, spec.Nk, 32, 32, "float32",
                                    plan.block_q, plan.block_kv, spec.causal, det)
    assert (total["global_bytes_read"], total["global_bytes_written"]) == want, total["launches"]


def test_race_check_every_backward_kernel(rng):
    """Each backward kernel once under ThreadSanitizer (RaceError on any race)."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    q, k, v = oracle.qkv(rng, (1, 2, 20, 16), (1, 1, 37, 16), dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, True, "float32")
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=16,
                                           block_kv=16)
    with _count_launches() as total:
        for det in (True, False):  # preprocess, dkdv, dq; then preprocess (zeroing), dkdv
            grads = _launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec,
                                                         deterministic=det)  # + atomics, convert
            oracle.check_backward(grads, do, q, k, v, None, True)
    assert set(total["launches"]) == {"flash_bwd_preprocess", "flash_bwd_dkdv", "flash_bwd_dq",
                                      "flash_bwd_dq_convert"}


# --------------------------------------------------------------------------
# the launcher's host-side pieces
# --------------------------------------------------------------------------
@pytest.mark.parametrize("qs,ks,want", [
    ((2, 6, 5, 8), (2, 2, 5, 8), (2, 3)),   # GQA
    ((2, 6, 5, 8), (2, 1, 5, 8), (1, 6)),   # MQA: one group of all heads
    ((2, 6, 5, 8), (5, 8), (1, 6)),         # no heads axis on k: the same
    ((2, 6, 5, 8), (6, 5, 8), (6, 1)),      # MHA, k broadcast over the batch
    ((2, 1, 5, 8), (3, 5, 8), (3, 1)),      # q broadcast over heads
    ((5, 8), (5, 8), (1, 1)),
])
def test_kv_heads_for_kernel(qs, ks, want):
    q, k = np.zeros(qs), np.zeros(ks)
    spec = _validate.check_attention_inputs(q, k, k)
    assert _launch_bwd.kv_heads_for_kernel(spec) == want

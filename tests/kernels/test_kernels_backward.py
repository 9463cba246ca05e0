"""The backward kernels (kernels_cu/flash_bwd_tc.cu, flash_bwd.cu) and their launch/tiling code.

float16/bfloat16 with head dims that are multiples of 16 run the tensor-core backward
(flash_bwd_tc.cu) by default; float32/float64 (and forced ``kernel="flash_bwd_dkdv"``) the
SIMT kernels of flash_bwd.cu.  Every emulated launch of the session runs under the
inter-block write check (tests/conftest.py).

Written once over the backend: "numpy" (the reference, the same assertions)
and "emulator" always; "cuda" when CuPy and a GPU are present, else skipped
with the reason.  o and lse come from the float64 oracle (not from our
forward), so a failure here is the backward's.  Every array the launcher
allocates (dq, dk, dv, D, the float32 dQ accumulator) is poisoned with NaN
before the kernels run (``cuflash.launch.common.output_hook``), so an element the
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
from conftest import Backend, lean_layout, poisoned_outputs, require_backend
from cuflash import _validate, kernels, tiling
from cuflash.launch import bwd as launch_bwd, bwd_tc as launch_bwd_tc, common as launch_common


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
    # very few keys (Nk = 3).  Not Nk = 1: there dq and dk are exactly 0 by the math (P = 1,
    # dS = dP - D = 0), a comparison with zeros -- D and dP summed in different orders (as
    # the tensor cores do) leave float32 rounding of ~1e-6 against a bound of eps * 1e-3
    ("float16", (6, 17, 32), (6, 3, 32), False, None, None, "c", True),
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
        with launch_common.track_allocations() as ledger:
            grads = _run_bwd(kernel_backend, do, q, k, v, o, lse, deterministic=det)
        oracle.check_backward(grads, do, q, k, v)
        sizes = {what: int(np.prod(shape)) for what, shape in ledger}
        ws = [n for n in sizes if n.startswith("workspace")]
        assert len(ws) == 1 and sizes and max(v for n, v in sizes.items() if n not in ws) <= 2 * 230 * 32, sizes
        # the workspace: D (padded to 64 floats), then the dQ accumulator -- with
        # deterministic=True one slice per block slot, at most the concurrent blocks' count
        # (the emulator's nominal 4)
        assert sizes[ws[0]] <= 2 * 200 + 63 + (4 if det else 1) * 2 * 200 * 32, sizes


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
    # float32 on sm_80+: the atomic path computes dK/dV with flash_bwd_tf32 (3xTF32), the
    # deterministic one with flash_bwd_dkdv -- both are held to the oracle above; the bitwise
    # agreement of the two SIMT paths is test_deterministic_dkdv_matches_atomic (float64)


def test_deterministic_dkdv_matches_atomic(kernel_backend, rng):
    """On the SIMT kernels dK/dV never use atomics: the same bits on both dQ paths."""
    q, k, v = oracle.qkv(rng, (2, 4, 70, 32), (2, 2, 90, 32), dtype="float16")
    o, lse = _fwd_from_oracle(q, k, v, "bottom_right", "float16")
    do = oracle.randn(rng, o.shape, "float16")
    rt = kernels.get_runtime(kernel_backend.name)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, scale=None, causal="bottom_right")
    args = [kernel_backend.asarray(x) for x in (do, q, k, v, o, lse)]
    runs = [launch_bwd.flash_bwd(rt, *args, spec, deterministic=det, kernel="flash_bwd_dkdv")
            for det in (True, False)]
    runs = [[kernel_backend.to_numpy(g) for g in r] for r in runs]
    for r in runs:
        oracle.check_backward(r, do, q, k, v, None, "bottom_right")
    assert np.array_equal(runs[0][1], runs[1][1]) and np.array_equal(runs[0][2], runs[1][2])


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
    """The formula the kernel's pointer arithmetic implies, spelled out once more, at the
    head-dim class the kernel is compiled for (d = 80 on 96 columns; d != dv on the class of
    the larger)."""
    cls = tiling.simt_head_dim_class
    for d, dv, bq, bkv in ((64, 64, 64, 64), (16, 100, 32, 16), (256, 256, 8, 16), (80, 80, 16, 32)):
        for acc, dt in ((4, "float32"), (8, "float64")):
            p = tiling.plan("flash_bwd_dkdv", d, dv, dt, bq, bkv)
            kd = kdv = cls(max(d, dv))
            want = acc * (bkv * (kd + 1) + bkv * (kdv + 1) + bq * (kd + 1) + bq * (kdv + 1)
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


def test_float64_dq_register_cap():
    """float64 dQ tiles of 64 doubles per thread spilled in every sweep compile (issue 12):
    refused with the reason and the pairs that fit; 48 doubles and float32 stay accepted."""
    for d, bq in ((64, 128), (128, 64), (256, 32)):
        for bkv in (8, 16):
            for kernel in ("flash_bwd_dkdv", "flash_bwd_dq"):
                with pytest.raises(ValueError, match=r"64 float64 dQ accumulators.*pairs that fit"):
                    tiling.plan(kernel, d, d if d < 256 else 16, "float64", bq, bkv)
            assert tiling.plan("flash_bwd_dkdv", d, d, "float32", bq, bkv).block_q == bq
    assert tiling.plan("flash_bwd_dkdv", 192, 192, "float64", 32, 16).block_q == 32  # 48 doubles
    for d in (64, 128, 256):  # the defaults never hit the cap
        p = tiling.plan("flash_bwd_dkdv", d, d, "float64")
        assert -(-p.block_q * d // tiling.BWD_THREADS) <= tiling.BWD_MAX_DQ_ACC_FLOAT64


def test_dq_register_cap_at_head_dims_not_powers_of_two():
    """float32 accumulators of dQ spilled from 56 per thread at head dims that are not powers
    of two (issue 12 probes: d = 112 .. 239): capped at 48 there, applied to the head-dim
    class (96, 160, 192, 224 are not powers of two); 64 at class 128 stays."""
    cap = tiling.BWD_MAX_DQ_ACC_NON_POW2
    for kernel in ("flash_bwd_dkdv", "flash_bwd_dq", "flash_bwd_dkdv_masked"):
        for dtype in ("float32", "float16"):
            for d, bq in ((224, 32), (200, 32), (193, 32)):  # class 224: 56 floats
                with pytest.raises(ValueError, match=rf"dQ accumulators.*limit {cap} where d is not"):
                    tiling.plan(kernel, d, d, dtype, bq, 16)
            assert tiling.plan(kernel, 96, 96, dtype, 64, 16).block_q == 64    # 48 floats
            assert tiling.plan(kernel, 192, 192, dtype, 32, 16).block_q == 32  # 48 floats
            assert tiling.plan(kernel, 128, 128, dtype, 64, 16).block_q == 64  # a power of two
            assert tiling.plan(kernel, 127, 127, dtype, 64, 16).kd == 128      # ... its class
    for d in range(1, 257):  # the defaults never reach it
        p = tiling.plan("flash_bwd_dkdv", d, d, "float32")
        assert -(-p.block_q * d // tiling.BWD_THREADS) <= cap


def test_d_ne_dv_plans_as_the_class_of_the_larger():
    """d != dv runs the kernel compiled for the class of max(d, dv), for both: its plans and
    register rules are those of d == dv at that class (float64 dK/dV of 64 doubles included,
    which d == dv compiled without spills)."""
    for kernel in ("flash_bwd_dkdv", "flash_bwd_dkdv_masked"):
        p = tiling.plan(kernel, 128, 90, "float64", 32, 32)
        assert (p.kd, p.kdv, p.block_kv) == (128, 128, 32)
        for arch in ("sm_80", "sm_90"):
            lim = tiling.EMULATOR_ARCHES[arch]
            a, b = tiling.plan(kernel, 128, 90, "float64", limit=lim), tiling.plan(
                kernel, 128, 128, "float64", limit=lim)
            assert (a.block_q, a.block_kv, a.shared_bytes) == (b.block_q, b.block_kv, b.shared_bytes)


@pytest.mark.parametrize("bq,bkv,d,needle", [
    (24, 32, 128, "does not support block_q=24"),
    # float64 d=32, 128 x 64: within the register limits (32 dQ doubles), 234496 B of shared
    # memory > even an H100's 232448 B
    (128, 64, 32, "budget is"),
    (32, 128, 128, "accumulator registers"),
    (64, 16, 128, "float64 dQ accumulators"),  # 64 doubles of dQ per thread (issue 12)
])
def test_unsupported_tiles_refused(kernel_backend, bq, bkv, d, needle, rng):
    if needle == "budget is":
        limit = tiling.device_smem_limit(kernel_backend.name)[0]
        need = tiling.kernel_tiling("flash_bwd_dkdv").shared_bytes(bq, bkv, d, d, 8)
        if need <= limit:
            pytest.skip(f"{need} B fit this device's {limit} B of shared memory")
    q, k, v = oracle.qkv(rng, (1, 9, d), (1, 9, d), dtype="float64")
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
    with launch_common.observe_launches() as seen:
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
    """Bytes the emulated kernels move == cuflash.tiling.flash_bwd_traffic (deterministic: the
    SIMT kernels forced -- float32 on sm_80+ runs flash_bwd_tf32 on both dQ paths, whose
    deterministic traffic tests/kernels/test_kernels_backward_tf32.py checks)."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, qs, ks, dtype="float32")
    o, lse = _fwd_from_oracle(q, k, v, causal or False, "float32")
    do = oracle.randn(rng, o.shape, "float32")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal or False)
    with _count_launches() as total:
        if det:
            launch_bwd.flash_bwd(kernels.get_runtime("emulator"), do, q, k, v, o, lse, spec,
                                 deterministic=True, kernel="flash_bwd_dkdv")
        else:
            _run_bwd(Backend("emulator"), do, q, k, v, o, lse, causal=causal or False)
    if det:
        assert total["launches"] == ["flash_bwd_preprocess", "flash_bwd_dkdv", "flash_bwd_dq"]
    plan = tiling.plan("flash_bwd_dkdv", 32, 32, "float32",
                       limit=tiling.EMULATOR_ARCHES["sm_80"], limit_source="sm_80")
    B, H = launch_common.problem_dims(spec.lead)
    Hk, _ = launch_common.kv_heads_for_kernel(spec)
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
            grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec,
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
    assert launch_common.kv_heads_for_kernel(spec) == want



# ==========================================================================
# the tensor-core backward (flash_bwd_tc.cu)
# ==========================================================================
def _launched(seen):
    return [e["kernel"] for e in seen]


def _tc_inputs(rng, dtype, qs, ks, dv=None, causal=False, layout="c"):
    q = _make(rng, dtype, qs, layout)
    k = _make(rng, dtype, ks, layout)
    v = _make(rng, dtype, ks[:-1] + ((dv or ks[-1]),), layout)
    o, lse = _fwd_from_oracle(q, k, v, causal, dtype)
    do = oracle.randn(rng, o.shape, dtype)
    return do, q, k, v, o, lse


# (dtype, q shape, k shape, dv, causal, (block_q, block_kv) or None, layout, deterministic)
# With BWD_CASES above (float16/bfloat16 at d = 16, 32, 128, 256 now run here too) this
# covers d in {16, 32, 64, 96, 128, 256}.  Specialisations are shared: (float16, 64),
# (bfloat16, 96/32), (float16, 32, tiles 16 x 32).
TC_CASES = [
    # GQA 6/2, Nq > Nk bottom-right: rows 0..26 see no key
    ("float16", (2, 6, 77, 64), (2, 2, 50, 64), None, "bottom_right", None, "c", False),
    # MQA, dv != d, Nk > Nq top-left: keys 70.. seen by nobody; deterministic
    ("bfloat16", (1, 3, 70, 96), (1, 1, 133, 96), 32, "top_left", None, "c", True),
    # query split (2 warps share 32 keys: P^T, dS^T through shared memory), GQA
    ("float16", (2, 4, 45, 64), (2, 2, 100, 64), None, "bottom_right", (32, 32), "c", False),
    # small explicit tiles: 2 warps of 16 keys, several KV tiles per split
    ("float16", (2, 2, 45, 32), (2, 2, 100, 32), None, "bottom_right", (16, 32), "c", True),
    ("float16", (1, 2, 100, 32), (1, 2, 45, 32), None, "top_left", (16, 32), "c", False),
    # Nk > Nq bottom-right over several K/V and query tiles: in one K/V tile the query tiles
    # before the diagonal, the plain ones after it and the last (ragged) one, and a last K/V
    # tile with keys past Nk (the mask's per-K/V-tile range of plain query tiles)
    ("float16", (1, 1, 200, 64), (1, 1, 300, 64), None, "bottom_right", None, "c", False),
    ("bfloat16", (1, 2, 150, 128), (1, 1, 260, 128), None, "bottom_right", None, "c", False),
    # strided rows (stride d + 3): not 16-byte aligned, so the launcher copies them
    ("float16", (2, 2, 21, 64), (2, 2, 30, 64), None, False, None, "strided", False),
]


def _tc_id(c):
    dt, qs, ks, dv, causal, tiles, lay, det = c
    t = "" if tiles is None else f"-t{tiles[0]}x{tiles[1]}"
    return (f"{dt}-q{'x'.join(map(str, qs))}-k{'x'.join(map(str, ks))}-dv{dv or ks[-1]}-{causal}{t}"
            f"-{lay}-{'det' if det else 'atomic'}")


@pytest.mark.parametrize("case", TC_CASES, ids=_tc_id)
def test_tc_backward_against_oracle(kernel_backend, case, rng):
    dtype, qs, ks, dv, causal, tiles, layout, det = case
    _require_dtype(kernel_backend, dtype)
    do, q, k, v, o, lse = _tc_inputs(rng, dtype, qs, ks, dv, causal, layout)
    bq, bkv = tiles or (None, None)
    with launch_common.observe_launches() as seen:
        grads = _run_bwd(kernel_backend, do, q, k, v, o, lse, causal=causal, block_q=bq,
                         block_kv=bkv, deterministic=det)
    assert "flash_bwd_tc" in _launched(seen), _launched(seen)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    oracle.check_backward(grads, do, q, k, v, None, causal)


def test_tc_deterministic_bitwise_with_splits(kb, rng, monkeypatch):
    """deterministic=True: the same bits every run, for 1, 2 and 3 dQ accumulator slices
    (KV tiles 0,2 / 1,3 ... in one block each, slices summed in order); dK, dV identical to
    the atomic path's (no atomics there); the atomic path within the oracle's tolerance."""
    if kb.name == "numpy":
        pytest.skip("the reference has no dQ splits")
    dtype = "float16"
    do, q, k, v, o, lse = _tc_inputs(rng, dtype, (1, 2, 45, 32), (1, 1, 150, 32), None, "top_left")
    kw = dict(causal="top_left", block_q=16, block_kv=32)
    atomic = _run_bwd(kb, do, q, k, v, o, lse, deterministic=False, **kw)
    oracle.check_backward(atomic, do, q, k, v, None, "top_left")
    for splits in (1, 2, 3):
        monkeypatch.setattr(launch_bwd_tc, "dq_splits", lambda *a, _s=splits: _s)
        _launch_bwd_cache_clear(kb)
        with launch_common.observe_launches() as seen:
            runs = [_run_bwd(kb, do, q, k, v, o, lse, deterministic=True, **kw) for _ in range(3)]
        grids = {e["grid"] for e in seen if e["kernel"] == "flash_bwd_tc"}
        assert grids == {(splits,)}, grids  # splits x 1 kv head x 1 batch entry
        for r in runs[1:]:
            for a, b_, n in zip(runs[0], r, ("dq", "dk", "dv")):
                assert np.array_equal(a, b_), f"{n} differs between deterministic runs ({splits} splits)"
        oracle.check_backward(runs[0], do, q, k, v, None, "top_left")
        assert np.array_equal(runs[0][1], atomic[1]) and np.array_equal(runs[0][2], atomic[2])


def _launch_bwd_cache_clear(backend):
    """Forget the prepared calls, so the next call plans (and picks its dQ splits) again."""
    from cuflash import cuda_backend, emulator_backend
    mod = cuda_backend if backend.is_cuda else emulator_backend
    mod.runtime().calls.clear()


@pytest.mark.parametrize("qs,ks,causal,tiles,det", [
    ((2, 4, 45, 32), (2, 2, 70, 32), "bottom_right", (16, 32), False),
    ((2, 4, 45, 32), (2, 2, 70, 32), "bottom_right", (16, 32), True),
    ((1, 3, 70, 32), (1, 3, 33, 32), "top_left", (16, 32), False),   # keys 33.. : zero dK/dV
    ((1, 2, 100, 32), (1, 1, 45, 32), None, None, True),
    # the default at d = 64 on the emulator's sm_80: 128 x 128 with one dO buffer
    ((1, 2, 300, 64), (1, 1, 200, 64), "bottom_right", None, False),
])
def test_tc_traffic_equals_model(qs, ks, causal, tiles, det, rng):
    """Bytes the emulated tensor-core kernels move == cuflash.tiling.flash_bwd_tc_traffic."""
    require_backend("emulator")
    do, q, k, v, o, lse = _tc_inputs(rng, "float16", qs, ks, None, causal or False)
    bq, bkv = tiles or (None, None)
    with _count_launches() as total:
        _run_bwd(Backend("emulator"), do, q, k, v, o, lse, causal=causal or False, block_q=bq,
                 block_kv=bkv, deterministic=det)
    assert total["launches"] == ["flash_bwd_tc_preprocess", "flash_bwd_tc", "flash_bwd_tc_dq_convert"]
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=causal or False)
    rt = kernels.get_runtime("emulator")
    d = qs[-1]
    plan = launch_bwd.plan_backward(rt, d, d, "float16", bq, bkv)
    if d == 64:
        assert (plan.block_q, plan.block_kv, plan.layout_defines) == (128, 128, (("CUFLASH_BWD_DO_STAGES", 1),))
    B, H = launch_common.problem_dims(spec.lead)
    Hk, _ = launch_common.kv_heads_for_kernel(spec)
    n_kv = -(-spec.Nk // plan.block_kv)
    splits = launch_bwd_tc.dq_splits(rt, plan, n_kv, B * Hk, det)
    want = tiling.flash_bwd_tc_traffic(B, H, Hk, spec.Nq, spec.Nk, d, d, plan.block_q,
                                       plan.block_kv, spec.causal, splits)
    assert (total["global_bytes_read"], total["global_bytes_written"]) == want


@pytest.mark.parametrize("dtype,qs,ks,tiles", [
    # query split: a pair of warps on 32 keys, P^T and dS^T exchanged in shared memory
    ("float16", (1, 2, 40, 32), (1, 1, 45, 32), (32, 32)),
    # 16 keys per warp, 2 warps: P^T, dS^T in registers, dS^T through shared memory to dQ
    ("float16", (1, 2, 20, 32), (1, 1, 37, 32), (16, 32)),
])
def test_tc_race_check(dtype, qs, ks, tiles, rng):
    """flash_bwd_tc and its helpers once under ThreadSanitizer, atomic and deterministic.

    The two layouts whose warps share data through shared memory differently.  Not here (a
    ThreadSanitizer build of this kernel costs ~40-100 s): 32 keys per warp (the barrier
    structure of the second case) and two passes over the head dims (the same barriers, a
    pass loop around them); both run in the oracle tests under the inter-block check."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", race_check=True)
    do, q, k, v, o, lse = _tc_inputs(rng, dtype, qs, ks, None, True)
    bq, bkv = tiles or (None, None)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=bq, block_kv=bkv)
    with _count_launches() as total:
        for det in (False, True):
            grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=det)
            oracle.check_backward(grads, do, q, k, v, None, True)
    assert set(total["launches"]) == {"flash_bwd_tc_preprocess", "flash_bwd_tc", "flash_bwd_tc_dq_convert"}


def test_tc_one_do_buffer(monkeypatch, rng):
    """The query split with one dO buffer (the plan's layout where two pass the limit: FA2's
    tiles on an A100), at small tiles with the limit set between the two layouts: under
    ThreadSanitizer, atomic and deterministic, against the oracle -- two query heads on one
    kv head (dO's source wraps to the next head), ragged last query and key tiles (dO's
    row-tested copy), causal."""
    with lean_layout(monkeypatch, "flash_bwd_tc", 32, 32, 32) as (rt, one, lean):
        plan = rt.plan("flash_bwd_tc", 32, 32, "float16", 32, 32)
        assert (plan.shared_bytes, dict(plan.layout_defines)) == (one, {"CUFLASH_BWD_DO_STAGES": 1})
        do, q, k, v, o, lse = _tc_inputs(rng, "float16", (1, 2, 70, 32), (1, 1, 45, 32), None, True)
        spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True, block_q=32, block_kv=32)
        with launch_common.observe_launches() as seen:
            for det in (False, True):
                grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=det)
                oracle.check_backward(grads, do, q, k, v, None, True)
        main = [e for e in seen if e["kernel"] == "flash_bwd_tc"]
        assert len(main) == 2 and all(e["shared_mem"] == one for e in main), main


def test_tc_one_do_buffer_on_gpu(kernel_backend, a100_plans, rng):
    """What an A100 runs -- FA2's tiles with one dO buffer (d = 64: 128 x 128, d = 128: 64 x
    128) -- on whatever GPU is at hand (a100_plans): against the oracle (GQA, ragged,
    causal).  On the emulator these are the default plans of its sm_80, which the oracle
    cases run."""
    for d, tiles in ((64, (128, 128)), (128, (64, 128))):
        plan = launch_bwd.plan_backward(a100_plans, d, d, "float16")
        assert ((plan.block_q, plan.block_kv), dict(plan.layout_defines)) == (tiles, {"CUFLASH_BWD_DO_STAGES": 1})
        do, q, k, v, o, lse = _tc_inputs(rng, "float16", (2, 4, 333, d), (2, 2, 290, d), None, "bottom_right")
        with launch_common.observe_launches() as seen:
            grads = _run_bwd(kernel_backend, do, q, k, v, o, lse, causal="bottom_right")
        assert [e["shared_mem"] for e in seen if e["kernel"] == "flash_bwd_tc"] == [plan.shared_bytes]
        oracle.check_backward(grads, do, q, k, v, None, "bottom_right")


def test_tc_on_emulated_sm75(rng):
    """sm_75: the SIMT kernels by default; flash_bwd_tc still right with the software mma
    and scalar reds of portable.cuh."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator", arch="sm_75")
    assert launch_bwd.plan_backward(rt, 64, 64, "float16").kernel == "flash_bwd_dkdv"
    do, q, k, v, o, lse = _tc_inputs(rng, "float16", (1, 2, 30, 32), (1, 2, 41, 32), None, "bottom_right")
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal="bottom_right", block_q=16,
                                           block_kv=32)
    with launch_common.observe_launches() as seen:
        grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, kernel="flash_bwd_tc")
    assert "flash_bwd_tc" in _launched(seen)
    oracle.check_backward(grads, do, q, k, v, None, "bottom_right")


@pytest.mark.parametrize("dtype,qs,ks,causal", [
    ("float16", (1, 2, 200, 64), (1, 1, 300, 64), "bottom_right"),
    ("bfloat16", (2, 2, 77, 64), (2, 2, 130, 64), "top_left"),
    ("float16", (1, 2, 150, 128), (1, 1, 260, 128), "bottom_right"),
])
def test_tc_on_emulated_sm90(monkeypatch, rng, dtype, qs, ks, causal):
    """sm_90 with the Hopper kernels off: flash_bwd_tc at its sm_90 default tiles (the builds
    compiled for CUFLASH_ARCH 900: float32 P for dS, the per-K/V-tile range of plain query
    tiles, at d = 128 the stepped dQ rows) against the oracle, GQA, ragged, both causal
    alignments."""
    require_backend("emulator")
    monkeypatch.setenv(tiling.EMULATOR_ARCH_ENV, "sm_90")
    monkeypatch.setenv(kernels.WGMMA_ENV, "0")
    from cuflash import emulator_backend
    plan = launch_bwd.plan_backward(emulator_backend.runtime(), qs[-1], qs[-1], dtype)
    assert plan.kernel == "flash_bwd_tc" and plan.limit == tiling.EMULATOR_ARCHES["sm_90"]
    do, q, k, v, o, lse = _tc_inputs(rng, dtype, qs, ks, None, causal)
    with launch_common.observe_launches() as seen:
        grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=causal, backend="emulator")
    main = [e for e in seen if e["kernel"] == "flash_bwd_tc"]
    assert main and main[0]["shared_mem"] == plan.shared_bytes and main[0]["block"][0] == plan.threads
    oracle.check_backward(grads, do, q, k, v, None, causal)


def test_simt_kernels_still_take_16_bit(rng):
    """kernel="flash_bwd_dkdv" keeps the SIMT backward for float16 (what sm_75 runs)."""
    require_backend("emulator")
    rt = kernels.get_runtime("emulator")
    do, q, k, v, o, lse = _tc_inputs(rng, "float16", (1, 2, 30, 32), (1, 2, 41, 32), None, True)
    spec = _validate.check_backward_inputs(do, q, k, v, o, lse, causal=True)
    for det in (False, True):
        with launch_common.observe_launches() as seen:
            grads = launch_bwd.flash_bwd(rt, do, q, k, v, o, lse, spec, deterministic=det,
                                         kernel="flash_bwd_dkdv")
        assert "flash_bwd_dkdv" in _launched(seen)
        oracle.check_backward(grads, do, q, k, v, None, True)


# --------------------------------------------------------------------------
# flash_bwd_tc's tiles: defaults per arch, refusals, no spills at the register budget
# --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(a for a in tiling.EMULATOR_ARCHES if a != "sm_75"))
def test_tc_default_tiles_fit_every_arch(arch):
    """(sm_75 is not planned for the tensor-core kernels: the runtime does not choose them
    there, and forced onto it they take the smallest class's curated plans that fit.)"""
    limit = tiling.EMULATOR_ARCHES[arch]
    for dtype in tiling.TC_DTYPES:
        for d in range(16, 257, 16):
            for dv in sorted({d, 16, 64, 256}):
                p = tiling.plan_flash_bwd(d, dv, dtype, limit=limit, limit_source=arch)
                assert p.kernel == "flash_bwd_tc", (d, dv, p)
                assert p.shared_bytes <= limit and 32 <= p.threads <= 1024
                lay = tiling.bwd_tc_layout(p.block_q, p.block_kv, p.kd, p.kdv)
                assert not isinstance(lay, str), lay
                assert p.threads == 32 * lay[0] and p.block_kv == 16 * lay[0] * lay[1] // lay[3]
    # the planner's choices at the shapes of the targets (FlashAttention-2's tiles, 8 warps
    # of the query split), and their shared memory: both dO buffers on an H100 (227 KB), one
    # on an A100 (163 KB)
    for d, tiles, two, one in ((64, (128, 128), 182272, 163840), (128, (64, 128), 177152, 159744)):
        for a, shared, lean in (("sm_90", two, ()), ("sm_80", one, (("CUFLASH_BWD_DO_STAGES", 1),))):
            p = tiling.plan_flash_bwd(d, d, "float16", limit=tiling.EMULATOR_ARCHES[a])
            assert ((p.block_q, p.block_kv), p.threads, tiling.bwd_tc_layout(*tiles, d, d)) == (tiles, 256, (8, 2, 1, 2))
            assert (p.shared_bytes, p.layout_defines) == (shared, lean), (d, a, p)
            assert kernels.plan_defines(p).get("CUFLASH_BWD_DO_STAGES") == (1 if lean else None)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tc_masked_default_tiles(arch):
    """flash_bwd_tc_masked's register budget is lower than flash_bwd_tc's; its curated
    defaults keep 32 queries per warp where the plain kernel's 32 x 128 would go to the query
    split (d = 64, 80: 64 x 128), and one pass over the head dims where 64 x 128 would need two
    (d = 96 .. 128: 128 x 64 on sm_90; 32 x 128 or 64 x 64 on sm_80)."""
    limit = tiling.EMULATOR_ARCHES[arch]
    for d in (64, 80, 96, 112, 128):
        p = tiling.plan("flash_bwd_tc_masked", d, d, "float16", limit=limit, limit_source=arch)
        _, mt, passes, qs = tiling.bwd_tc_layout(p.block_q, p.block_kv, d, d, True)
        assert passes == 1, (d, arch, p)
        if d <= 80:
            assert (p.block_q, p.block_kv) == (64, 128) and p.block_q // qs >= 32, (d, arch, p)
        elif arch == "sm_90":
            assert (p.block_q, p.block_kv) == (128, 64), (d, arch, p)


def test_tc_refusals_name_the_reason_and_what_fits():
    # explicit tiles whose register arrays would spill: refused, never changed
    with pytest.raises(ValueError, match=r"register floats.*limit 152.*pairs that fit: .*\(32, 32\)"):
        tiling.plan("flash_bwd_tc", 256, 256, "float16", 128, 128)
    with pytest.raises(ValueError, match="multiples of 16"):
        tiling.plan("flash_bwd_tc", 72, 72, "float16")
    with pytest.raises(ValueError, match="runs .*float16.* only"):
        tiling.plan_flash_bwd(64, 64, "float32", kernel="flash_bwd_tc")
    # the default planner falls back to the SIMT kernels where flash_bwd_tc cannot run
    assert tiling.plan_flash_bwd(72, 72, "float16").kernel == "flash_bwd_dkdv"
    # ... but explicit tiles it lacks at head dims it takes are refused (issue 12: the SIMT
    # kernels would run them several times slower than any tensor-core plan)
    with pytest.raises(ValueError, match="tensor-core kernel flash_bwd_tc does not take"):
        tiling.plan_flash_bwd(64, 64, "float16", 8, 8)
    assert tiling.plan_flash_bwd(64, 64, "float64", 8, 8).kernel == "flash_bwd_dkdv"
    assert tiling.plan_flash_bwd(64, 64, "float16", tensor_cores=False).kernel == "flash_bwd_dkdv"
    p = tiling.plan_flash_bwd(192, 192, "float16", 32, 128)  # two passes instead of a spill
    assert p.kernel == "flash_bwd_tc" and kernels.plan_defines(p)["CUFLASH_BWD_PASSES"] == 2
    # pairs within the register budget are taken whether or not ptxas spills them: that is
    # for the compile to tell (cuflash.kernels.check_compiled on a GPU)
    assert tiling.plan("flash_bwd_tc", 176, 176, "float16", 64, 64).block_q == 64


def test_tc_shared_bytes_exact():
    """At the compiled head dims: d != dv compiles for max(d, dv) (128 / 64 on 128 columns)."""
    for d, dv, bq, bkv, qs in ((64, 64, 32, 128, 1), (128, 128, 64, 128, 2), (128, 64, 16, 32, 1)):
        p = tiling.plan("flash_bwd_tc", d, dv, "float16", bq, bkv)
        d = dv = max(d, dv)
        assert tiling.bwd_tc_layout(bq, bkv, d, dv)[3] == qs
        ps = bkv * (bq + 8) if qs == 2 else 0  # P^T of the query split
        want = (2 * (bkv * (d + 8) + bkv * (dv + 8) + 2 * bq * (d + 8) + 2 * bq * (dv + 8)
                     + bkv * (bq + 8) + ps) + 4 * 4 * bq)
        assert p.shared_bytes == want


def test_bwd_dq_splits_model():
    # the deterministic grid fills the GPU as the atomic one does (same makespan), with the
    # fewest slices that achieve it
    assert tiling.bwd_dq_splits(32, 32, 132) == 4        # d=128 target: 128 blocks x 8 tiles
    assert tiling.bwd_dq_splits(32, 64, 132) == 2        # d=64 target: 128 blocks x 16 tiles
    assert tiling.bwd_dq_splits(1, 5, 132) == 1
    for n_kv, problems, slots in ((32, 32, 132), (7, 3, 16), (64, 1, 132), (5, 200, 132)):
        s = tiling.bwd_dq_splits(n_kv, problems, slots)
        atomic = -(-n_kv * problems // slots)
        assert -(-s * problems // slots) * -(-n_kv // s) <= atomic + -(-n_kv // s)


# edge plans of the register budget (the largest dK/dV + P^T/dP^T arrays of each layout,
# tiling.BWD_TC_ARRAY_BUDGET*): ptxas must not spill at any of them.  sm_80 is the arch that
# spilled first in the calibration (cuflash/tiling/bwd_tc.py); bench/kernel_report.py shows every default
# plan on sm_80 and sm_90.
_EDGE_PLANS = [  # d, dv, block_q, block_kv
    (128, 128, 64, 128),   # query split, 32 keys per warp pair: 128 + 48
    (160, 160, 16, 128),   # 16 keys/warp, 8 warps: 160 + 12
    (64, 64, 32, 128),     # 32 keys/warp: 128 + 48
    (256, 256, 32, 64),    # two passes: 128 + 24
]


@pytest.mark.parametrize("d,dv,bq,bkv", _EDGE_PLANS)
def test_tc_edge_plans_do_not_spill(d, dv, bq, bkv):
    from cuflash import _nvrtc
    ok, why = _nvrtc.is_available()
    if not ok:
        pytest.skip(f"NVRTC not available: {why}")
    p = tiling.plan("flash_bwd_tc", d, dv, "float16", bq, bkv)
    defines = kernels.plan_defines(p)
    defines["CUFLASH_BWD_TC_MAIN"] = None
    opts = ("-arch=sm_80", "--ptxas-options=-v") + kernels.build_options(defines)
    res = _nvrtc.compile(open(kernels.source_path("flash_bwd_tc.cu")).read(), "flash_bwd_tc.cu", opts)
    info = _nvrtc.parse_ptxas_info(res.log)["flash_bwd_tc"]
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info

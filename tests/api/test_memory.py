"""Memory: no full (Nq, Nk) array, memory that does not grow with N^2, the memory model.

Seed 001's "Memory verification tests": the instrumented forward
(``verify_no_full_materialization``) never creates an intermediate larger
than the tiles, its largest intermediate does not change with N, and
``memory_analysis`` agrees with arithmetic done here from the model's
definition (docs/api.md; issue 4: Q read once, K and V once per query tile,
O and lse written once, causal skipping loads fewer tiles) and with what the
reference actually allocates (tracemalloc).
"""
import math
import tracemalloc

import numpy as np
import pytest

import cuflash
import oracle
from conftest import grid


def verify(backend, q, k, v, block):
    a = backend.asarray
    o, size = cuflash.verify_no_full_materialization(a(q), a(k), a(v), block,
                                                     backend=backend.name)
    return backend.to_numpy(o), int(size)


def tile_bound(lead, block, d, dv):
    """Elements of the biggest tile-sized array: a (Br, Bc) or (Br|Bc, d|dv+1) tile per problem."""
    problems = int(np.prod(lead)) if lead else 1
    return problems * block * max(block, d + 1, dv + 1)


# --------------------------------------------------------------------------
# verify_no_full_materialization
# --------------------------------------------------------------------------
@pytest.mark.parametrize("N,d,block", grid([(256, 64, 32), (256, 16, 32), (200, 32, 16),
                                            (97, 64, 64)], emulator=(0, 3)))
def test_no_full_attention_matrix(backend, rng, N, d, block):
    q, k, v = oracle.qkv(rng, (N, d), (N, d))
    o, size = verify(backend, q, k, v, block)
    oracle.check_forward(o, q, k, v)
    # at least one (block x block) logit tile exists: the instrumentation records something
    assert size >= block * min(block, N), f"max tensor size {size} < one {block}x{block} tile"
    assert size <= 2 * tile_bound((), block, d, d), (
        f"largest intermediate {size} elements exceeds the tile bound "
        f"{2 * tile_bound((), block, d, d)} (N={N}, block={block}, d={d})")
    if 2 * tile_bound((), block, d, d) < N * N // 4:   # tiles small against N^2
        assert size < N * N // 4, f"largest intermediate {size} is O(N^2) (N^2 = {N * N})"


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_memory_scales_with_block_not_n(backend, rng, lead):
    d, block = 32, 32
    sizes = {}
    Ns = (128, 256, 512) if backend.name != "emulator" else (64, 128)
    for N in Ns:
        q, k, v = oracle.qkv(rng, lead + (N, d), lead + (N, d))
        o, sizes[N] = verify(backend, q, k, v, block)
        oracle.check_forward(o, q, k, v)
    assert len(set(sizes.values())) == 1, f"largest intermediate changes with N: {sizes}"
    assert max(sizes.values()) <= 2 * tile_bound(lead, block, d, d)


def test_block_size_drives_the_size(backend, rng):
    q, k, v = oracle.qkv(rng, (256, 16), (256, 16))
    _, small = verify(backend, q, k, v, 16)
    _, big = verify(backend, q, k, v, 64)
    assert big > small, f"block 64 gives {big}, block 16 gives {small}"


# --------------------------------------------------------------------------
# memory_analysis against independent arithmetic
# --------------------------------------------------------------------------
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
KEYS = ("standard_extra_bytes", "tiled_extra_bytes", "sram_bytes_per_block",
        "standard_hbm_bytes", "tiled_hbm_bytes", "block_q", "block_kv")


def analysis(backend, *args, **kw):
    return cuflash.memory_analysis(*args, backend=backend.name, **kw)


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("N,Nk,d,bq,bkv,batch,heads", [
    (1024, None, 64, 64, 64, 1, 1),
    (1000, 777, 128, 32, 64, 2, 3),
    (4096, None, 32, 128, 32, 1, 8),
    (255, 300, 16, 16, 16, 3, 1),
])
def test_memory_analysis_arithmetic(backend, dtype, N, Nk, d, bq, bkv, batch, heads):
    try:
        m = analysis(backend, N, d, dtype, Nk=Nk, block_q=bq, block_kv=bkv, batch=batch,
                     heads=heads)
    except ValueError as e:
        # kernels may refuse tiles beyond their shared memory (api.md), saying so
        if backend.name == "numpy" or "shared memory" not in str(e):
            raise
        pytest.skip(f"{backend.name} refuses these tiles: {str(e)[:120]}")
    for key in KEYS:
        assert key in m, f"memory_analysis has no {key!r}: {sorted(m)}"
    assert m["block_q"] == bq and m["block_kv"] == bkv, "explicit tiles must be honoured"
    it = ITEMSIZE[dtype]
    lse_it = 8 if dtype == "float64" else 4
    Nk_ = N if Nk is None else Nk
    BH = batch * heads
    # standard: S and P, each (N, Nk) per problem (seed 001: ~2 N^2 sizeof(dtype))
    assert m["standard_extra_bytes"] == 2 * BH * N * Nk_ * it
    # tiled: one S/P tile pair plus O(N) row statistics, nothing of order N * Nk
    tile_pair = 2 * bq * bkv * it
    assert tile_pair <= m["tiled_extra_bytes"] <= tile_pair + BH * N * 4 * 8, m
    # SRAM of one thread block (kernel backends) or the CPU working set of one worker
    # (numpy, which has no shared memory and reports sram_bytes_per_block None): at least
    # Qi (Br, d), Kj and Vj (Bc, d) in the input dtype, at most that plus an fp64-sized
    # S/P tile, acc tile and a few row vectors
    tiles_in = (bq * d + 2 * bkv * d) * it
    if backend.name == "numpy":
        assert m["sram_bytes_per_block"] is None
        held = m["cpu_tile_bytes_per_worker"]
    else:
        assert "cpu_tile_bytes_per_worker" not in m
        held = m["sram_bytes_per_block"]
    assert tiles_in <= held <= tiles_in + 8 * (2 * bq * bkv + bq * d + 8 * bq), m
    # HBM traffic of the tiled forward: Q read once, K and V once per query tile,
    # O and lse written once
    n_q_tiles = math.ceil(N / bq)
    read = BH * (N * d + n_q_tiles * Nk_ * 2 * d) * it
    written = BH * N * (d * it + lse_it)
    assert m["tiled_hbm_bytes"] == read + written, (m["tiled_hbm_bytes"], read + written)
    if "tiled_hbm_read_bytes" in m:
        assert m["tiled_hbm_read_bytes"] == read and m["tiled_hbm_written_bytes"] == written
    # standard: S written and read, P written and read (seed 000's round trips), plus q, k, v, o
    assert m["standard_hbm_bytes"] >= BH * (4 * N * Nk_ + (2 * N + 2 * Nk_) * d) * it


def test_memory_analysis_growth(backend):
    # doubling N: standard extra memory x4, tiled extra memory at most x2 (it is O(N))
    a = analysis(backend, 2048, 64, "float16", block_q=64, block_kv=64)
    b = analysis(backend, 4096, 64, "float16", block_q=64, block_kv=64)
    assert b["standard_extra_bytes"] == 4 * a["standard_extra_bytes"]
    assert b["tiled_extra_bytes"] <= 2 * a["tiled_extra_bytes"]
    assert b["sram_bytes_per_block"] == a["sram_bytes_per_block"]
    assert b.get("cpu_tile_bytes_per_worker") == a.get("cpu_tile_bytes_per_worker")
    # at N = 16384 the tiled extra memory is a tiny fraction of the standard one
    c = analysis(backend, 16384, 64, "float32", block_q=128, block_kv=64)
    assert c["tiled_extra_bytes"] < 0.02 * c["standard_extra_bytes"]
    assert c["tiled_hbm_bytes"] < c["standard_hbm_bytes"]


def test_memory_analysis_batch_heads_scale(backend):
    one = analysis(backend, 512, 64, "float32", block_q=128, block_kv=64)
    many = analysis(backend, 512, 64, "float32", block_q=128, block_kv=64, batch=2, heads=3)
    for key in ("standard_extra_bytes", "standard_hbm_bytes", "tiled_hbm_bytes"):
        assert many[key] == 6 * one[key], key
    assert many["sram_bytes_per_block"] == one["sram_bytes_per_block"]


def test_memory_analysis_default_tiles(backend):
    m = analysis(backend, 1000, 64, "float32")
    assert isinstance(m["block_q"], int) and m["block_q"] > 0
    assert isinstance(m["block_kv"], int) and m["block_kv"] > 0


# --------------------------------------------------------------------------
# the causal traffic model (the contract the CUDA forward's byte counts are held to)
# --------------------------------------------------------------------------
def independent_causal_reads(Nq, Nk, d, dv, it, bq, bkv, causal):
    """K/V rows loaded: for each query tile, all tiles up to the one holding its last visible key."""
    off = 0 if causal == "top_left" else Nk - Nq
    rows = 0
    for i in range(math.ceil(Nq / bq)):
        last_row = min(Nq, (i + 1) * bq) - 1
        last_key = min(Nk - 1, last_row + off)     # the largest j any row of the tile may see
        if last_key < 0:
            continue                               # the whole tile sees no key: nothing loaded
        n_tiles = last_key // bkv + 1
        rows += min(Nk, n_tiles * bkv)
    return (Nq * d + rows * (d + dv)) * it


@pytest.mark.parametrize("Nq,Nk,bq,bkv", [(256, 256, 64, 64), (100, 130, 32, 32),
                                          (130, 100, 32, 16), (97, 97, 13, 29), (300, 50, 64, 64)])
@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_causal_skipping_reduces_traffic(Nq, Nk, bq, bkv, causal):
    from cuflash.reference import tiled_forward_hbm_bytes
    full_r, full_w = tiled_forward_hbm_bytes(Nq, Nk, 64, 64, 2, bq, bkv, None)
    r, w = tiled_forward_hbm_bytes(Nq, Nk, 64, 64, 2, bq, bkv, causal)
    assert r == independent_causal_reads(Nq, Nk, 64, 64, 2, bq, bkv, causal), (r, causal)
    assert w == full_w == Nq * (64 * 2 + 4)
    # skipping loads fewer tiles whenever some tile lies above the boundary
    # (top_left with Nq > Nk hides nothing from the query tiles here)
    assert r < full_r or (causal == "top_left" and Nq >= Nk + bq)
    assert full_r == (Nq * 64 + math.ceil(Nq / bq) * Nk * 128) * 2
    if Nq == Nk and bq == bkv and Nq % bq == 0:
        # square tiles on the diagonal: tiles (i, j <= i) of T x T, i.e. T (T + 1) / 2
        T = Nq // bq
        assert r == (Nq * 64 + bkv * 128 * T * (T + 1) // 2) * 2


# --------------------------------------------------------------------------
# the model against what the reference really allocates (tracemalloc)
# --------------------------------------------------------------------------
def peak_bytes(fn):
    tracemalloc.start()
    try:
        out = fn()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def test_measured_memory_numpy(rng):
    d = 64
    peaks_std, peaks_tiled = {}, {}
    for N in (512, 1024, 2048):
        q, k, v = oracle.qkv(rng, (N, d), (N, d), dtype="float32")
        cuflash.tiled_attention(q, k, v, block_q=64, block_kv=64)  # warm up lazy set-up
        peaks_std[N], _ = peak_bytes(lambda: cuflash.standard_attention(q, k, v))
        peaks_tiled[N], o = peak_bytes(lambda: cuflash.tiled_attention(q, k, v, block_q=64,
                                                                       block_kv=64))
        model = cuflash.memory_analysis(N, d, "float32", block_q=64, block_kv=64)
        S = N * N * 4
        # standard materialises (N, N) arrays: between one and a few of them
        assert 0.9 * S <= peaks_std[N] <= 1.5 * model["standard_extra_bytes"] + 4 * N * d * 4, (
            N, peaks_std[N], model["standard_extra_bytes"])
    # tiled: no (N, N) array; O(N d) for the output and tile-sized scratch
    S = 2048 * 2048 * 4
    assert peaks_tiled[2048] < S / 8, f"tiled forward peaked at {peaks_tiled[2048]} B at N=2048"
    assert peaks_std[2048] >= 3 * peaks_std[1024] >= 9 * peaks_std[512] * 0.9
    assert peaks_tiled[2048] <= 2.5 * peaks_tiled[1024], peaks_tiled


@pytest.mark.parametrize("window", [None, (400, 0)], ids=["dense", "window"])
def test_kernel_bytes_include_float32_flushes(rng, window):
    """memory_analysis's kernel_hbm_* bytes are what the launched kernel moves: for float32 on
    the tensor cores, O's rows go to global memory and back every TF32_FLUSH_KEYS keys, so they
    exceed the algorithm's tiled_hbm_* (600 keys in 32-key tiles: two flushes of each row)."""
    from conftest import require_backend
    require_backend("emulator")
    from cuflash import emulator
    N, d = 600, 32
    m = cuflash.memory_analysis(N, d, "float32", backend="emulator", window=window)
    assert m["kernel"] == "flash_fwd_tf32" + ("_masked" if window else "")
    q, k, v = oracle.qkv(rng, (1, 1, N, d), (1, 1, N, d), dtype="float32")
    cuflash.tiled_attention(q, k, v, window=window, backend="emulator")
    st = emulator.last_launch_stats()
    assert st["kernel"] == m["kernel"]
    assert (st["global_bytes_read"], st["global_bytes_written"]) == \
        (m["kernel_hbm_read_bytes"], m["kernel_hbm_written_bytes"])
    extra = m["kernel_hbm_written_bytes"] - m["tiled_hbm_written_bytes"]
    if window is None:
        assert extra == 2 * N * d * 4  # every row flushes twice
    else:
        assert 0 < extra < 2 * N * d * 4  # the first query tiles span too few keys to flush
    assert m["kernel_hbm_read_bytes"] - m["tiled_hbm_read_bytes"] == extra

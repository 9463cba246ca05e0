"""Inference shapes: split-KV, the KV cache (contiguous and paged), variable-length batches.

Every case runs on "numpy" and "emulator" (and "cuda" when present) against
the float64 oracle of ``oracle.py``, applied per sequence: a varlen batch is
held to plain attention on each sequence's own rows, a KV-cache call to plain
attention over each sequence's first ``cache_seqlens[b] + Nnew`` keys
(gathered here from the pages by the test itself).  Outputs are NaN-poisoned.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import poisoned_outputs, require_backend
from cuflash import kernels, tiling
from cuflash.launch import common as launch_common


def _t(a, lo, hi):
    """Rows lo:hi of a packed (total, heads, dim) array as (heads, n, dim)."""
    return a[lo:hi].swapaxes(0, 1)


# --------------------------------------------------------------------------
# split-KV in tiled_attention
# --------------------------------------------------------------------------
@pytest.mark.parametrize("q_shape,k_shape,causal", [
    ((2, 4, 3, 32), (2, 2, 77, 32), True),          # GQA, packed rows, Nq < Nk
    ((1, 6, 1, 32), (1, 1, 150, 32), False),        # MQA decode
    ((1, 2, 40, 32), (1, 2, 29, 32), "top_left"),   # Nq > Nk, rows that see no key
    ((2, 1, 5, 16), (2, 1, 1, 16), True),           # one key
])
def test_split_kv_matches_oracle(kb, rng, q_shape, k_shape, causal):
    q, k, v = oracle.qkv(rng, q_shape, k_shape, dtype="float32")
    results = []
    for ns in (1, 2, 7, None):
        with poisoned_outputs():
            o, lse = cuflash.tiled_attention(kb.asarray(q), kb.asarray(k), kb.asarray(v),
                                             causal=causal, num_splits=ns, return_lse=True,
                                             block_kv=16, backend=kb.name)
        o, lse = kb.to_numpy(o), kb.to_numpy(lse)
        oracle.check_forward(o, q, k, v, None, causal, lse=lse)
        results.append(o)
    for o in results[1:]:   # every split count gives the same result to rounding
        np.testing.assert_allclose(o, results[0], rtol=0, atol=2e-6)


def test_split_kv_kernels_and_traffic(rng):
    """The split runs flash_fwd_serving + flash_fwd_combine, GQA rows packed, bytes = model."""
    require_backend("emulator")
    q, k, v = oracle.qkv(rng, (2, 4, 3, 32), (2, 2, 77, 32), dtype="float32")
    with launch_common.observe_launches() as seen:
        o = cuflash.tiled_attention(q, k, v, causal=True, num_splits=3, backend="emulator")
    oracle.check_forward(o, q, k, v, None, True)
    assert [e["kernel"] for e in seen] == ["flash_fwd_serving", "flash_fwd_combine"]
    # 2 batch x 2 kv heads (the 2 query heads of a kv head share a block) x 3 splits x 1 tile
    assert seen[0]["grid"] == (2 * 2 * 3,)
    from cuflash import emulator_backend
    from cuflash.launch.serving import serving_plan
    plan = serving_plan(emulator_backend.runtime(), 32, 32, "float32", 2 * 3)
    want = tiling.flash_fwd_split_traffic(2 * 2, 2 * 3, 3, 77, 32, 32, "float32", plan.block_q,
                                          plan.block_kv, "bottom_right", 3)
    got = (sum(e["global_bytes_read"] for e in seen),
           sum(e["global_bytes_written"] for e in seen))
    assert got == want


def test_split_heuristic():
    # a full wave (or more) of blocks: no split
    assert tiling.num_splits_heuristic(132, 512, 132) == 1
    # one block and many key tiles: many splits, never more than the tiles or SMs
    s = tiling.num_splits_heuristic(1, 512, 132)
    assert 1 < s <= 132
    assert tiling.num_splits_heuristic(1, 3, 132) <= 3
    assert tiling.num_splits_heuristic(8, 1, 132) == 1
    # slots: one-warp blocks count a quarter (4 warps per SM), 4+ warps one per SM
    assert tiling.split_slots(132, 32) == 4 * 132
    assert tiling.split_slots(132, 64) == 2 * 132
    assert tiling.split_slots(132, 128) == tiling.split_slots(132, 512) == 132
    # decode, 32 heads x 1 row of 8-row, one-warp tiles and 2048 key tiles: > 128 blocks
    assert 32 * tiling.num_splits_heuristic(32, 2048, tiling.split_slots(132, 32)) >= 4 * 132 * 0.85


def test_split_kv_memory_model():
    one = cuflash.memory_analysis(1024, 64, "float16", heads=2)
    four = cuflash.memory_analysis(1024, 64, "float16", heads=2, num_splits=4)
    assert one["split_workspace_bytes"] == 0 and one["num_splits"] == 1
    assert four["split_workspace_bytes"] == 4 * 2 * 1024 * 65 * 4    # float32 partials
    assert four["tiled_extra_bytes"] == one["tiled_extra_bytes"] + four["split_workspace_bytes"]
    # Q read once per split, partials written then read once by the combine
    assert four["tiled_hbm_bytes"] > one["tiled_hbm_bytes"]
    with pytest.raises(ValueError, match="num_splits"):
        cuflash.memory_analysis(1024, 64, num_splits=0)


# --------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------
def _cache_case(rng, B, Hk, d, dv, capacity, page_size, dtype="float32"):
    """A cache (contiguous, or paged with a shuffled block table) and its logical view."""
    if page_size is None:
        kc = oracle.randn(rng, (B, Hk, capacity, d), dtype)
        vc = oracle.randn(rng, (B, Hk, capacity, dv), dtype)
        return kc, vc, None
    max_pages = -(-capacity // page_size)
    num_pages = B * max_pages + 3                          # spare pages nobody uses
    kc = oracle.randn(rng, (num_pages, Hk, page_size, d), dtype)
    vc = oracle.randn(rng, (num_pages, Hk, page_size, dv), dtype)
    table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    return kc, vc, table


def _logical(cache, table, b, length, page_size):
    """Sequence b's first ``length`` keys as (Hk, length, dim), gathered here for the oracle."""
    if table is None:
        return cache[b, :, :length]
    rows = [cache[table[b, j // page_size], :, j % page_size] for j in range(length)]
    return np.stack(rows, axis=1) if rows else cache[0, :, :0]


@pytest.mark.parametrize("page_size,capacity,lens,Nq,Nnew,causal", [
    (None, 300, [0, 1, 299], 1, 1, False),     # contiguous, decode, one new token
    (16, 96, [5, 40, 80], 2, 3, True),         # pages of 16, shuffled table
    (1, 20, [3, 0, 12], 7, 2, True),           # pages of one row
    (256, 1000, [999, 500, 0], 1, 0, True),    # one big page, nothing appended
])
def test_kvcache_matches_oracle(kb, rng, page_size, capacity, lens, Nq, Nnew, causal):
    if kb.name != "numpy" and capacity > 300:
        capacity, lens = 300, [299, 150, 0]    # the emulator: keep launches short
    B, H, Hk, d, dv = 3, 4, 2, 32, 16
    kc, vc, table = _cache_case(rng, B, Hk, d, dv, capacity, page_size)
    seqlens = np.array(lens, np.int32)
    q = oracle.randn(rng, (B, H, Nq, d), "float32")
    kn = oracle.randn(rng, (B, Hk, Nnew, d), "float32") if Nnew else None
    vn = oracle.randn(rng, (B, Hk, Nnew, dv), "float32") if Nnew else None
    want_k, want_v = kc.copy(), vc.copy()      # what the cache must hold afterwards
    for b in range(B):
        for n in range(Nnew):
            pos = lens[b] + n
            page, row = (b, pos) if table is None else (table[b, pos // page_size],
                                                        pos % page_size)
            want_k[page, :, row] = kn[b, :, n]
            want_v[page, :, row] = vn[b, :, n]
    kcd, vcd = kb.asarray(kc.copy()), kb.asarray(vc.copy())
    a = kb.asarray
    outs = {}
    for ns in ((1, None) if kb.name == "numpy" else (1, 3, None)):
        kcd, vcd = kb.asarray(kc.copy()), kb.asarray(vc.copy())
        with poisoned_outputs():
            o, lse = cuflash.attention_with_kvcache(
                a(q), kcd, vcd, cache_seqlens=a(seqlens), k_new=a(kn), v_new=a(vn),
                block_table=a(table), causal=causal, num_splits=ns, return_lse=True,
                backend=kb.name)
        o, lse = kb.to_numpy(o), kb.to_numpy(lse)
        np.testing.assert_array_equal(kb.to_numpy(kcd), want_k)   # exactly the new rows
        np.testing.assert_array_equal(kb.to_numpy(vcd), want_v)
        for b in range(B):
            L = lens[b] + Nnew
            kb_ = _logical(want_k, table, b, L, page_size)
            vb_ = _logical(want_v, table, b, L, page_size)
            oracle.check_forward(o[b], q[b], kb_, vb_, None, causal, lse=lse[b])
        outs[ns] = o
    for o in outs.values():
        np.testing.assert_allclose(o, outs[1], rtol=0, atol=2e-6)


def test_kvcache_low_precision(kb, rng):
    """float16 decode against a paged cache: the flash-attn rule per sequence."""
    B, H, Hk, d, dv, ps = 2, 4, 1, 64, 64, 16
    kc, vc, table = _cache_case(rng, B, Hk, d, dv, 64, ps, "float16")
    lens = np.array([33, 60], np.int32)
    q = oracle.randn(rng, (B, H, 1, d), "float16")
    with poisoned_outputs():
        o, lse = cuflash.attention_with_kvcache(
            kb.asarray(q), kb.asarray(kc), kb.asarray(vc), cache_seqlens=kb.asarray(lens),
            block_table=kb.asarray(table), causal=True, return_lse=True, backend=kb.name)
    o, lse = kb.to_numpy(o), kb.to_numpy(lse)
    for b in range(B):
        oracle.check_forward(o[b], q[b], _logical(kc, table, b, int(lens[b]), ps),
                             _logical(vc, table, b, int(lens[b]), ps), None, True, lse=lse[b])


@pytest.mark.parametrize("bad,match", [
    ({"cache_seqlens": np.array([-1, 2], np.int32)}, "negative"),
    ({"cache_seqlens": np.array([3, 15], np.int32)}, "capacity"),
    ({"cache_seqlens": np.array([3, 2], np.int64)}, "int32"),
    ({"block_table": np.array([[9, 0], [1, 2]], np.int32)}, "not a page"),
    ({"cache_seqlens": np.array([3], np.int32)}, "expected"),
    ({"k_new": "only"}, "both"),
])
def test_kvcache_errors_write_nothing(kb, rng, bad, match):
    kc, vc, table = _cache_case(rng, 2, 1, 16, 16, 16, 8)
    args = dict(cache_seqlens=np.array([3, 2], np.int32), block_table=table,
                k_new=oracle.randn(rng, (2, 1, 2, 16), "float32"),
                v_new=oracle.randn(rng, (2, 1, 2, 16), "float32"))
    if bad.get("k_new") == "only":
        args["v_new"] = None
    else:
        args.update(bad)
    q = oracle.randn(rng, (2, 2, 1, 16), "float32")
    kcd, vcd = kb.asarray(kc.copy()), kb.asarray(vc.copy())
    with pytest.raises((ValueError, TypeError), match=match):
        cuflash.attention_with_kvcache(kb.asarray(q), kcd, vcd, backend=kb.name,
                                       **{n: kb.asarray(x) for n, x in args.items()})
    np.testing.assert_array_equal(kb.to_numpy(kcd), kc)   # nothing written
    np.testing.assert_array_equal(kb.to_numpy(vcd), vc)


def test_kvcache_reference_checks_even_unchecked(rng):
    """The NumPy backend reads the indices on the host anyway: with check_inputs=False a page id
    outside the cache still raises before anything is written (it raised IndexError after
    sequence 0's new keys were written)."""
    kc, vc, table = _cache_case(rng, 2, 1, 16, 16, 8, 8)
    kc0, vc0 = kc.copy(), vc.copy()
    q = oracle.randn(rng, (2, 2, 1, 16), "float32")
    kn = oracle.randn(rng, (2, 1, 1, 16), "float32")
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 99 is not a page"):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([3, 12], np.int32),
                                       k_new=kn, v_new=kn, block_table=np.array([[0, 1], [2, 99]], np.int32),
                                       check_inputs=False, backend="numpy")
    np.testing.assert_array_equal(kc, kc0)
    np.testing.assert_array_equal(vc, vc0)


def test_kvcache_unchecked_bad_indices_stay_in_bounds(rng):
    """check_inputs=False with garbage indices: wrong numbers allowed, no crash, no stray write."""
    require_backend("emulator")
    kc, vc, table = _cache_case(rng, 2, 1, 16, 16, 16, 8)
    guard_k = np.zeros((3,) + kc.shape[1:], kc.dtype)     # memory right after the cache
    big_k = np.concatenate([kc, guard_k])
    big_v = np.concatenate([vc, np.zeros((3,) + vc.shape[1:], vc.dtype)])
    kcd, vcd = big_k[:kc.shape[0]], big_v[:vc.shape[0]]
    q = oracle.randn(rng, (2, 2, 1, 16), "float32")
    kn = oracle.randn(rng, (2, 1, 1, 16), "float32")
    o = cuflash.attention_with_kvcache(
        q, kcd, vcd, cache_seqlens=np.array([-50, 10 ** 6], np.int32), k_new=kn, v_new=kn,
        block_table=np.array([[7, -3], [10 ** 6, 2]], np.int32), check_inputs=False,
        backend="emulator")
    assert np.all(np.isfinite(o))
    assert not big_k[kc.shape[0]:].any() and not big_v[vc.shape[0]:].any()


# --------------------------------------------------------------------------
# variable-length batches
# --------------------------------------------------------------------------
@pytest.mark.parametrize("lens_q,lens_k,causal,dtype", [
    ([5, 0, 17, 1, 40], [9, 3, 17, 0, 33], True, "float32"),
    ([1, 1, 1], [200, 2, 64], False, "float32"),      # (one key would make dq exactly 0)
    ([23, 7], [7, 23], "top_left", "float32"),
    ([19, 2], [31, 2], True, "float16"),
])
def test_varlen_forward_backward(kb, rng, lens_q, lens_k, causal, dtype):
    H, Hk, d, dv = 4, 2, 32, 32
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = oracle.randn(rng, (int(cu_q[-1]), H, d), dtype)
    k = oracle.randn(rng, (int(cu_k[-1]), Hk, d), dtype)
    v = oracle.randn(rng, (int(cu_k[-1]), Hk, dv), dtype)
    a = kb.asarray
    with poisoned_outputs():
        o, lse = cuflash.varlen_attention(a(q), a(k), a(v), a(cu_q), a(cu_k), causal=causal,
                                          return_lse=True, backend=kb.name)
    o, lse = kb.to_numpy(o), kb.to_numpy(lse)
    assert o.shape == (q.shape[0], H, dv) and lse.shape == (q.shape[0], H)
    do = oracle.randn(rng, o.shape, dtype)
    with poisoned_outputs():
        grads = cuflash.varlen_attention_backward(a(do), a(q), a(k), a(v), a(o), a(lse), a(cu_q),
                                                  a(cu_k), causal=causal, backend=kb.name)
    grads = [kb.to_numpy(g) for g in grads]
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        oracle.check_forward(_t(o, q0, q1), _t(q, q0, q1), _t(k, k0, k1), _t(v, k0, k1), None,
                             causal, lse=_t(lse[..., None], q0, q1)[..., 0])
        if k1 > k0:
            oracle.check_backward([_t(g, lo, hi) for g, (lo, hi) in
                                   zip(grads, ((q0, q1), (k0, k1), (k0, k1)))],
                                  _t(do, q0, q1), _t(q, q0, q1), _t(k, k0, k1), _t(v, k0, k1),
                                  None, causal)
    # keys of a sequence with no queries get zero gradients
    for b in range(len(lens_q)):
        if cu_q[b + 1] == cu_q[b]:
            assert not grads[1][cu_k[b]:cu_k[b + 1]].any()


@pytest.mark.parametrize("cu_q,cu_k,kw,match", [
    ([1, 3], [0, 3], {}, "start at 0"),
    ([0, 5, 3, 6], [0, 1, 2, 6], {}, "decrease"),
    ([0, 3, 5], [0, 3, 6], {}, "end at"),
    ([0, 3, 6], [0, 3, 6], {"max_seqlen_q": 2}, "smaller than sequence"),
    ([0, 6], [0, 3, 6], {}, "B \\+ 1"),
])
def test_varlen_errors(kb, rng, cu_q, cu_k, kw, match):
    q = oracle.randn(rng, (6, 2, 16), "float32")
    k = oracle.randn(rng, (6, 2, 16), "float32")
    with pytest.raises(ValueError, match=match):
        cuflash.varlen_attention(kb.asarray(q), kb.asarray(k), kb.asarray(k),
                                 kb.asarray(np.array(cu_q, np.int32)),
                                 kb.asarray(np.array(cu_k, np.int32)), backend=kb.name, **kw)
    with pytest.raises(TypeError, match="int32"):
        cuflash.varlen_attention(kb.asarray(q), kb.asarray(k), kb.asarray(k),
                                 kb.asarray(np.array([0, 6], np.int64)),
                                 kb.asarray(np.array([0, 6], np.int32)), backend=kb.name)


def test_serving_kernels_race_free(rng):
    """flash_fwd_serving (paged, split), flash_fwd_combine and flash_kv_append under ThreadSanitizer."""
    require_backend("emulator")
    from cuflash.launch import serving as launch_serving
    rt = kernels.get_runtime("emulator", race_check=True)
    kc, vc, table = _cache_case(rng, 2, 1, 16, 16, 40, 8)
    q = oracle.randn(rng, (2, 2, 3, 16), "float32")
    kn = oracle.randn(rng, (2, 1, 2, 16), "float32")
    lens = np.array([7, 30], np.int32)
    with launch_common.observe_launches() as seen:
        o = launch_serving.attention_with_kvcache(rt, q, kc, vc, lens, kn, kn, table, None,
                                                  True, 2, False, True)
    assert [e["kernel"] for e in seen] == ["flash_kv_append", "flash_fwd_serving",
                                           "flash_fwd_combine"]
    for b in range(2):
        L = int(lens[b]) + 2
        oracle.check_forward(o[b], q[b], _logical(kc, table, b, L, 8),
                             _logical(vc, table, b, L, 8), None, True)

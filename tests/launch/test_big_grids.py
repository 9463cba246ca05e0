"""More than 65,535 (batch x heads) problems reach every kernel family (issue 12).

CUDA limits gridDim.y and gridDim.z to 65,535; the launchers fold batch, heads and tiles into
grid x (limit 2^31 - 1, cuflash.launch.common.fold_grid), so a call with 65,537 problems must
run -- on the emulator here, with tiny shapes so that each of the ~65,000 blocks is cheap (the
fiber engine runs such a block in microseconds). Each result is checked against the NumPy
reference on the same inputs; the emulator's launch record shows the folded grid.
"""
import numpy as np
import pytest

import cuflash
import oracle
from conftest import require_backend
from cuflash import emulator as em

N_PROBLEMS = 65_537  # one more than CUDA's y/z limit + 1


@pytest.fixture(autouse=True)
def _emulator_only():
    require_backend("emulator")


def _rng():
    return np.random.default_rng(12)


def _last_grid():
    st = em.last_launch_stats()
    return st["grid"], st["blocks"]


def test_forward_and_backward_with_65537_problems():
    rng = _rng()
    q = rng.standard_normal((N_PROBLEMS, 1, 2, 8))   # (B, H, Nq, d)
    k = rng.standard_normal((N_PROBLEMS, 1, 3, 8))
    v = rng.standard_normal((N_PROBLEMS, 1, 3, 8))
    # float64, 8 x 8 tiles: the SIMT kernels with one warp per block
    o, lse = cuflash.tiled_attention(q, k, v, causal=True, block_q=8, block_kv=8,
                                     return_lse=True, backend="emulator")
    grid, blocks = _last_grid()
    assert blocks >= N_PROBLEMS and grid[1] <= 65535 and grid[2] <= 65535, grid
    ro, rlse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True, backend="numpy")
    np.testing.assert_allclose(o, ro, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, rlse, rtol=1e-12, atol=1e-12)

    do = rng.standard_normal(o.shape)
    grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True, block_q=8,
                                             block_kv=8, backend="emulator")
    grid, blocks = _last_grid()
    assert grid[1] <= 65535 and grid[2] <= 65535, grid
    ref = cuflash.tiled_attention_backward(do, q, k, v, ro, rlse, causal=True, backend="numpy")
    for g, r, name in zip(grads, ref, ("dq", "dk", "dv")):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10, err_msg=name)


def test_online_softmax_with_65537_row_blocks():
    rows = 4 * N_PROBLEMS  # 4 rows per block of online_softmax_rows
    x = _rng().standard_normal((rows, 5))
    y = cuflash.online_softmax_2d(x, backend="emulator")
    grid, blocks = _last_grid()
    assert blocks >= N_PROBLEMS and grid[1] <= 65535 and grid[2] <= 65535, grid
    want = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, want / want.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-15)


def test_kvcache_decode_with_65537_sequences():
    rng = _rng()
    B, cap, d = N_PROBLEMS, 4, 8
    q = rng.standard_normal((B, 1, 1, d))
    kc = rng.standard_normal((B, 1, cap, d))
    vc = rng.standard_normal((B, 1, cap, d))
    seqlens = rng.integers(1, cap + 1, size=B).astype(np.int32)
    o = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1,
                                       backend="emulator")
    grid, blocks = _last_grid()
    assert blocks >= B and grid[1] <= 65535 and grid[2] <= 65535, grid
    ref = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend="numpy")
    np.testing.assert_allclose(o, ref, rtol=1e-12, atol=1e-12)
    # spot-check against a plain softmax over each sequence's valid keys
    for b in (0, B // 2, B - 1):
        L = seqlens[b]
        want, _, _ = oracle.attention(q[b:b + 1], kc[b:b + 1, :, :L], vc[b:b + 1, :, :L], None, False)
        np.testing.assert_allclose(o[b:b + 1], want, rtol=1e-12, atol=1e-12)


def test_the_backward_refuses_workspaces_past_32_bit_rows():
    """flash_bwd_tc indexes the lse2 / D workspace rows (batch * heads * padded Nq) in 32 bits:
    the launcher refuses a call with more (a clear error rather than wrapped addresses); the
    largest count it indexes passes."""
    from cuflash.launch import bwd_tc
    bwd_tc.check_workspace_rows(2 ** 31 - 1, "the backward")
    with pytest.raises(ValueError, match="2147483648 workspace rows; the tensor-core backward indexes at most"):
        bwd_tc.check_workspace_rows(2 ** 31, "the backward")

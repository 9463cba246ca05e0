"""The ring planner's calls cover exactly the global causal/window mask, pair by pair.

For every ring size, local length, sharding, causal flag and window, every (rank, source
rank) step is checked against the mask of the unsharded attention built from global
positions: the union of the calls' masks (cuflash's bottom-right causal/window on each
call's rectangle) equals it, and no entry is covered twice.
"""
import numpy as np
import pytest

from cuflash.ring._plan import chunks_of, shard_slices, step_calls

WINDOWS = [None] + [(left, right) for left in (-1, 0, 1, 3, 9) for right in (-1, 0, 2, 7)]


def _global_mask(n, causal, window):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.ones((n, n), bool)
    if causal:
        m &= j <= i
    if window is not None:
        if window[0] >= 0:
            m &= j >= i - window[0]
        if window[1] >= 0:
            m &= j <= i + window[1]
    return m


def _call_mask(nq, nk, causal, window):
    """cuflash's mask (docs/semantics.md): bottom-right, off = nk - nq."""
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    off = nk - nq
    m = np.ones((nq, nk), bool)
    if causal:
        m &= j <= i + off
    if window is not None:
        if window[0] >= 0:
            m &= j >= i + off - window[0]
        if window[1] >= 0:
            m &= j <= i + off + window[1]
    return m


def _positions(rank, world, n_local, sharding):
    return np.concatenate([np.arange(g, g + c) for _, g, c in
                           chunks_of(rank, world, n_local, sharding)])


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_calls_cover_the_global_mask(world, sharding):
    for n_local in (2, 4, 6):
        for causal in (False, True):
            for window in WINDOWS:
                want_all = _global_mask(n_local * world, causal, window)
                for r in range(world):
                    qpos = _positions(r, world, n_local, sharding)
                    for s in range(world):
                        kpos = _positions(s, world, n_local, sharding)
                        want = want_all[np.ix_(qpos, kpos)]
                        got = np.zeros_like(want, dtype=int)
                        calls = step_calls(chunks_of(r, world, n_local, sharding),
                                           chunks_of(s, world, n_local, sharding), causal,
                                           window)
                        for c in calls:
                            assert c.r1 > c.r0 and c.c1 > c.c0, c
                            got[c.r0:c.r1, c.c0:c.c1] += _call_mask(c.r1 - c.r0, c.c1 - c.c0,
                                                                    c.causal, c.window)
                        assert got.max(initial=0) <= 1
                        assert np.array_equal(got.astype(bool), want), \
                            (world, n_local, sharding, causal, window, r, s, calls)


def test_zigzag_causal_is_one_call_of_half_a_block_per_step():
    """Every rank does the same causal work at every step (the point of zigzag)."""
    world, n = 4, 8
    for r in range(world):
        for s in range(world):
            calls = step_calls(chunks_of(r, world, n, "zigzag"), chunks_of(s, world, n, "zigzag"),
                               True, None)
            assert len(calls) == 1
            c = calls[0]
            area = (c.r1 - c.r0) * (c.c1 - c.c0)
            assert area == (n * n if s == r else n * n // 2)
            assert c.causal == (s == r) and c.window is None


def test_shard_slices():
    assert shard_slices(16, 2, 0, "zigzag") == [(0, 4), (12, 4)]
    assert shard_slices(16, 2, 1, "contiguous") == [(8, 8)]
    with pytest.raises(ValueError, match="pad it to a multiple of 6"):
        shard_slices(16, 3, 0, "zigzag")

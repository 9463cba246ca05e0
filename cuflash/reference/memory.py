"""The memory and HBM-traffic model, and the instrumented forward that records its largest array.
"""
from .. import tiling
from .._validate import check_attention_inputs, check_positive_int
from .._validate_serving import check_num_splits
from ._common import _Tracker, _dtype_from_name, _kv_range, default_blocks
from .flash_forward import _flash_forward
from .masks import memory_features


# ---------------------------------------------------------------------------
# memory: the model and the instrumented run
# ---------------------------------------------------------------------------
def tiled_forward_hbm_bytes(Nq, Nk, d, dv, itemsize, block_q, block_kv, causal=None,
                            batch=1, lse_itemsize=4):
    """HBM bytes (read, written) of the tiled forward under the traffic model.

    The model (the one the CUDA forward is held to): every query tile reads
    its ``Qi`` once, then the ``Kj`` and ``Vj`` tiles it visits (all of them,
    or only those up to the causal boundary: the skipped tiles are never
    loaded; partial last tiles count their real rows), and writes its ``O_i``
    and ``lse_i`` once.  Returns ``(read_bytes, written_bytes)`` for ``batch``
    independent (batch x heads) problems.

    causal : None, False, True, "bottom_right" or "top_left"
    """
    causal = {False: None, True: "bottom_right"}.get(causal, causal)
    offset = None if causal is None else (Nk - Nq if causal == "bottom_right" else 0)
    kv_rows = 0
    for i in range(-(-Nq // block_q) if Nq else 0):
        r0, r1 = i * block_q, min(Nq, (i + 1) * block_q)
        _, j_hi = _kv_range(r0, r1, Nk, block_kv, offset)
        kv_rows += min(Nk, j_hi * block_kv)
    read = batch * (Nq * d + kv_rows * (d + dv)) * itemsize
    written = batch * Nq * (dv * itemsize + lse_itemsize)
    return read, written


def memory_analysis(N, d, dtype="float32", *, Nk=None, block_q=None, block_kv=None, batch=1,
                    heads=1, num_splits=1, bias_shape=None, window=None):
    """The memory and HBM-traffic model (parameters and keys: ``cuflash.memory_analysis``).

    The NumPy backend has no thread blocks: ``sram_bytes_per_block`` is None
    and ``cpu_tile_bytes_per_worker`` is what one worker thread holds for its
    tiles -- Qi, Kj, Vj in ``dtype``, the S/P tile, the acc tile and m, l in
    the accumulation type (float32; float64 for float64) -- which lives in the
    CPU's caches.  The kernel backends fill ``sram_bytes_per_block`` with
    their shared memory (``cuflash.launch.fwd.memory_analysis``).

    ``num_splits`` > 1 models a split-KV forward: each split's partial outputs
    and lse in the compute type (``split_workspace_bytes``) and the traffic of
    :func:`cuflash.tiling.flash_fwd_split_traffic` (Q read once per split,
    the partials written, then read once by the combine).

    ``bias_shape`` / ``window`` add what those features cost
    (:func:`cuflash.reference.masks.memory_features`).
    """
    num_splits = check_num_splits(num_splits) or 1
    N = check_positive_int(N, "N") if N != 0 else 0
    d = check_positive_int(d, "d")
    Nk = N if Nk is None else (check_positive_int(Nk, "Nk") if Nk != 0 else 0)
    block_q = check_positive_int(block_q, "block_q")
    block_kv = check_positive_int(block_kv, "block_kv")
    batch = check_positive_int(batch, "batch")
    heads = check_positive_int(heads, "heads")
    dt = _dtype_from_name(dtype)
    it = dt.itemsize
    acc_it = 8 if dt.name == "float64" else 4
    BH = batch * heads
    if block_q is None or block_kv is None:
        Br, Bc = default_blocks(BH, max(N, 1), max(Nk, 1), d, d)
        block_q = Br if block_q is None else block_q
        block_kv = Bc if block_kv is None else block_kv
    Br, Bc = block_q, block_kv
    S_bytes = BH * N * Nk * it
    standard_extra = 2 * S_bytes
    stats = 2 * BH * N * acc_it
    tile = 2 * Br * Bc * it
    cpu_tiles = ((Br * d + Bc * d + Bc * d) * it + Br * Bc * acc_it + Br * d * acc_it
                 + 2 * Br * acc_it)
    std_read = BH * (N * d + Nk * d + Nk * d) * it + 2 * S_bytes
    std_written = BH * N * d * it + 2 * S_bytes
    if num_splits == 1:
        t_read, t_written = tiled_forward_hbm_bytes(N, Nk, d, d, it, Br, Bc, None, BH, acc_it)
    else:
        t_read, t_written = tiling.flash_fwd_split_traffic(BH, N, max(N, 1), Nk, d, d, dt.name,
                                                           Br, Bc, None, num_splits)
    split_ws = num_splits * BH * N * (d + 1) * acc_it if num_splits > 1 else 0
    tiled_extra = stats + tile + split_ws
    out = {
        "N": N, "Nk": Nk, "d": d, "dtype": dt.name, "itemsize": it, "batch": batch,
        "heads": heads, "block_q": Br, "block_kv": Bc,
        "standard_extra_bytes": standard_extra,
        "standard_S_bytes": S_bytes, "standard_P_bytes": S_bytes,
        "tiled_extra_bytes": tiled_extra,
        "tiled_stats_bytes": stats, "tiled_tile_bytes": tile,
        "num_splits": num_splits, "split_workspace_bytes": split_ws,
        "sram_bytes_per_block": None,
        "cpu_tile_bytes_per_worker": cpu_tiles,
        "standard_hbm_read_bytes": std_read, "standard_hbm_written_bytes": std_written,
        "standard_hbm_bytes": std_read + std_written,
        "tiled_hbm_read_bytes": t_read, "tiled_hbm_written_bytes": t_written,
        "tiled_hbm_bytes": t_read + t_written,
        "ratio_extra": standard_extra / tiled_extra if tiled_extra else float("inf"),
        "ratio_hbm": (std_read + std_written) / (t_read + t_written)
        if t_read + t_written else float("inf"),
    }
    if bias_shape is not None or window is not None:
        memory_features(out, bias_shape, window)
    return out


def verify_no_full_materialization(q, k, v, block_size):
    """The NumPy reference of ``cuflash.verify_no_full_materialization`` (documented there).

    Runs the same forward as :func:`tiled_attention` (``block_q = block_kv =
    block_size``, one thread) while recording the size of every array the
    algorithm allocates: the scaled query tile, the S/P tile, the acc tile,
    the [Vj, 1] tile, the row statistics of the tile and any causal mask.
    The inputs and the returned output/lse are not intermediates; the largest
    is O(batch * block_size * max(block_size, d)) elements, independent of N.
    """
    spec = check_attention_inputs(q, k, v, block_q=block_size, block_kv=block_size)
    if block_size is None:
        raise ValueError("block_size must be a positive int, got None")
    track = _Tracker()
    o, _ = _flash_forward(spec, q, k, v, spec.block_q, spec.block_kv, 1, track, stage="tile")
    return o, track.max_size

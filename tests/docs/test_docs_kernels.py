"""The documentation names the kernels that run: docstrings and memory_analysis against launches.

Each call kind runs on the emulator with its launches observed
(``cuflash.launch.common.observe_launches``: kernel name, block and dynamic shared
memory of every launch).  Then

* ``memory_analysis`` on the emulator, given the call's parameters, lists the
  same kernels with the same shared memory, in launch order
  (``forward_kernels`` / ``backward_kernels``), names the forward's main
  kernel (``kernel``, ``sram_bytes_per_block``, ``threads_per_block``), and
  its HBM model equals the bytes the forward kernel moved;
* the docstring of the function called names every kernel it launched.

So a docstring or model that says one kernel while the call runs another fails here.
"""
import inspect
import re

import numpy as np
import pytest

import cuflash
import oracle
from conftest import require_backend
from cuflash import tiling
from cuflash.launch import common as launch_common

pytestmark = pytest.mark.emulator

EMU = "emulator"
B, H, Nq, Nk, D = 1, 2, 40, 56, 64


@pytest.fixture(autouse=True)
def _emulator():
    require_backend(EMU)


def launched(fn):
    with launch_common.observe_launches() as seen:
        out = fn()
    return out, seen


def pairs(seen):
    return [(e["kernel"], e["shared_mem"]) for e in seen]


def modelled(kernels):
    return [(k["kernel"], k["shared_bytes"]) for k in kernels]


def assert_doc_names(fn, seen):
    doc = inspect.getdoc(fn)
    for name in {e["kernel"] for e in seen}:
        assert re.search(rf"``{name}``", doc), f"help(cuflash.{fn.__name__}) does not name {name}"


def inputs(rng, dtype, nq=Nq, nk=Nk, hk=H):
    return oracle.qkv(rng, (B, H, nq, D), (B, hk, nk, D), dtype=dtype)


# bias and window are the features memory_analysis takes; ALiBi, softcap and dropout run the
# kernels a window and a bias run (said in memory_analysis's docstring: a window alone has the
# 16-bit backward's band-only build), checked with a wide window and a key-padding bias
FEATURES = {
    "plain": ({}, {}),
    "window": ({"window": (24, 0)}, {"window": (24, 0)}),
    "bias": ({"bias": np.zeros((B, 1, 1, Nk), np.float32)}, {"bias_shape": (B, 1, 1, Nk)}),
    "alibi+softcap+dropout": ({"alibi_slopes": np.full(H, 0.25, np.float32), "softcap": 20.0,
                               "dropout_p": 0.1, "seed": 7},
                              {"window": (Nk, Nk), "bias_shape": (B, 1, 1, Nk)}),
}


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_dense_forward_and_backward(rng, dtype, feature):
    if dtype == "float64" and feature == "bias":
        pytest.skip("float64 with a feature is covered by the window case")  # same kernels
    call, model_kw = FEATURES[feature]
    q, k, v = inputs(rng, dtype)
    (o, lse), fwd = launched(lambda: cuflash.tiled_attention(
        q, k, v, return_lse=True, num_splits=1, backend=EMU, **call))
    do = oracle.randn(rng, o.shape, dtype)
    _, bwd = launched(lambda: cuflash.tiled_attention_backward(do, q, k, v, o, lse,
                                                               backend=EMU, **call))
    m = cuflash.memory_analysis(Nq, D, dtype, Nk=Nk, batch=B, heads=H, backend=EMU,
                                **model_kw)
    assert pairs(fwd) == modelled(m["forward_kernels"]), (fwd, m["forward_kernels"])
    assert pairs(bwd) == modelled(m["backward_kernels"]), (bwd, m["backward_kernels"])
    main = fwd[0]
    assert (m["kernel"], m["sram_bytes_per_block"], m["threads_per_block"]) == \
        (main["kernel"], main["shared_mem"], main["block"][0])
    if feature in ("plain", "window"):  # the HBM model is the traffic the kernel moved
        assert (main["global_bytes_read"], main["global_bytes_written"]) == \
            (m["tiled_hbm_read_bytes"], m["tiled_hbm_written_bytes"])
    assert_doc_names(cuflash.tiled_attention, fwd)
    assert_doc_names(cuflash.tiled_attention_backward, bwd)
    want_masked = feature != "plain"
    assert all((e["kernel"].endswith("_masked") or e["kernel"] == tiling.BWD_BAND_KERNEL)
               == want_masked for e in fwd + bwd if e["kernel"] not in HELPERS), fwd + bwd
    band = [e["kernel"] == tiling.BWD_BAND_KERNEL for e in bwd]
    assert any(band) == (feature == "window" and dtype == "float16"), bwd


# the backward's helpers are the same with and without the features
HELPERS = {"flash_bwd_tc_preprocess", "flash_bwd_tc_dq_convert", "flash_bwd_preprocess",
           "flash_bwd_dq_convert"}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("feature", ["plain", "window"])
def test_deterministic_backward_is_documented(rng, dtype, feature):
    call = FEATURES[feature][0]
    q, k, v = inputs(rng, dtype)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True, backend=EMU, **call)
    do = oracle.randn(rng, o.shape, dtype)
    _, bwd = launched(lambda: cuflash.tiled_attention_backward(
        do, q, k, v, o, lse, deterministic=True, backend=EMU, **call))
    assert_doc_names(cuflash.tiled_attention_backward, bwd)
    if dtype == "float32":  # the tensor cores, dQ in per-slot accumulator slices
        suffix = "_masked" if call else ""
        assert [e["kernel"] for e in bwd] == ["flash_bwd_preprocess", "flash_bwd_tf32" + suffix,
                                             "flash_bwd_dq_convert"]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_split_kv(rng, dtype):
    q, k, v = inputs(rng, dtype, nq=1, nk=300)
    _, fwd = launched(lambda: cuflash.tiled_attention(q, k, v, num_splits=3, backend=EMU))
    m = cuflash.memory_analysis(1, D, dtype, Nk=300, batch=B, heads=H, num_splits=3, backend=EMU)
    assert [e["kernel"] for e in fwd] == ["flash_fwd_serving", "flash_fwd_combine"]
    assert pairs(fwd) == modelled(m["forward_kernels"])
    assert (m["kernel"], m["sram_bytes_per_block"]) == ("flash_fwd_serving", fwd[0]["shared_mem"])
    assert_doc_names(cuflash.tiled_attention, fwd)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("feature", ["plain", "window"])
def test_kvcache(rng, dtype, feature):
    call = FEATURES[feature][0]
    k_cache = oracle.randn(rng, (B, 1, 64, D), dtype)
    v_cache = oracle.randn(rng, (B, 1, 64, D), dtype)
    q = oracle.randn(rng, (B, H, 1, D), dtype)
    k_new = oracle.randn(rng, (B, 1, 1, D), dtype)
    v_new = oracle.randn(rng, (B, 1, 1, D), dtype)
    lens = np.array([45], np.int32)
    _, seen = launched(lambda: cuflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new,
        num_splits=None if call else 2, backend=EMU, **call))
    names = [e["kernel"] for e in seen]
    assert names[0] == "flash_kv_append"
    assert names[1] == ("flash_fwd_serving_masked" if call else "flash_fwd_serving")
    assert names[2:] == ([] if call else ["flash_fwd_combine"])  # features never split
    assert_doc_names(cuflash.attention_with_kvcache, seen)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("feature", ["plain", "window"])
def test_varlen(rng, dtype, feature):
    call = FEATURES[feature][0]
    cu = np.array([0, 17, 17, 40], np.int32)
    q = oracle.randn(rng, (40, H, D), dtype)
    k = oracle.randn(rng, (40, 1, D), dtype)
    v = oracle.randn(rng, (40, 1, D), dtype)
    (o, lse), fwd = launched(lambda: cuflash.varlen_attention(
        q, k, v, cu, cu, causal=True, return_lse=True, backend=EMU, **call))
    assert [e["kernel"] for e in fwd] == \
        ["flash_fwd_serving_masked" if call else "flash_fwd_serving"]
    assert_doc_names(cuflash.varlen_attention, fwd)
    do = oracle.randn(rng, o.shape, dtype)
    _, bwd = launched(lambda: cuflash.varlen_attention_backward(
        do, q, k, v, o, lse, cu, cu, causal=True, backend=EMU, **call))
    # the dense backward once per non-empty sequence, at its default tiles
    m = cuflash.memory_analysis(23, D, dtype, batch=1, heads=H, backend=EMU,
                                **FEATURES[feature][1])
    one = modelled(m["backward_kernels"])
    assert pairs(bwd) == one * 2, (bwd, one)
    assert_doc_names(cuflash.varlen_attention_backward, bwd)

"""cuflash.jax: values and ``jax.grad`` against a plain JAX implementation.

The reference below is written here with ``jax.numpy`` (softmax over the
visible keys, GQA by ``jnp.repeat``), independent of cuflash, and both sides
run under ``jax.jit``.  Sequence lengths are odd with Nq != Nk; inputs and
cotangents are fresh random draws.
"""
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install jax)")

import jax.numpy as jnp  # noqa: E402

import oracle  # noqa: E402  (tests/ is on sys.path through conftest)

import cuflash  # noqa: E402
import cuflash.jax as cj  # noqa: E402


def plain_attention(q, k, v, causal=False, layout="bhnd", scale=None):
    """softmax(scale q k^T [masked]) v in jax.numpy; rows that see no key give 0."""
    if layout == "bnhd":
        q, k, v = (x.swapaxes(-3, -2) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = jnp.repeat(k, group, axis=-3), jnp.repeat(v, group, axis=-3)
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    # HIGHEST: on a GPU, XLA's default float32 matmul is TF32 (about 5e-4 relative), which
    # would make the reference the least exact side of every comparison
    s = scale * jnp.matmul(q, k.swapaxes(-1, -2), precision="highest")
    # iota rather than NumPy constants: XLA folds large constant masks slowly
    i = jax.lax.broadcasted_iota(jnp.int32, (Nq, Nk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (Nq, Nk), 1)
    visible = {False: i >= 0, "top_left": j <= i}.get(causal, j <= i + Nk - Nq)
    s = jnp.where(visible, s, -jnp.inf)
    m = jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0))
    l = e.sum(axis=-1, keepdims=True)
    o = jnp.matmul(e / jnp.where(l > 0, l, 1), v, precision="highest")
    return o.swapaxes(-3, -2) if layout == "bnhd" else o


def shapes_for(layout, B, H, Hk, Nq, Nk, d):
    if layout == "bhnd":
        return (B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, d)
    return (B, Nq, H, d), (B, Nk, Hk, d), (B, Nk, Hk, d)


def arrays(rng, shapes, dtype=np.float32):
    return [jnp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


def assert_close(out, ref, what, tol=1e-5):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    nref = np.linalg.norm(ref)
    assert nref > 0, f"{what}: reference is all zero"
    err = np.linalg.norm(out - ref) / nref
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("layout, H, Hk, causal, Nq, Nk, scale", [
    ("bhnd", 4, 4, False, 37, 53, None),
    ("bnhd", 4, 2, True, 53, 37, None),       # GQA; the first 16 rows see no key
    ("bhnd", 4, 2, "top_left", 53, 37, 0.3),
    ("bnhd", 4, 1, True, 29, 41, None),       # MQA (k/v heads broadcast)
])
def test_values_and_grad_under_jit(rng, layout, H, Hk, causal, Nq, Nk, scale):
    q, k, v = arrays(rng, shapes_for(layout, 2, H, Hk, Nq, Nk, 16))
    w = arrays(rng, [shapes_for(layout, 2, H, Hk, Nq, Nk, 16)[0]])[0]  # cotangent of o

    @jax.jit
    def o_and_grads_ours(q, k, v):
        def loss(q, k, v):
            o = cj.attention(q, k, v, causal=causal, layout=layout, scale=scale)
            return (o * w).sum(), o
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)[::-1]

    @jax.jit
    def o_and_grads_plain(q, k, v):
        o, vjp = jax.vjp(lambda q, k, v: plain_attention(q, k, v, causal, layout, scale),
                         q, k, v)
        return o, vjp(w)
    o, grads = o_and_grads_ours(q, k, v)
    ref, refs = o_and_grads_plain(q, k, v)
    assert o.shape == q.shape[:-1] + (v.shape[-1],) and o.dtype == q.dtype
    assert_close(o, ref, "o")
    for g, r, x, name in zip(grads, refs, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == x.shape, f"{name} not in the caller's layout"
        assert_close(g, r, name)


def test_eager_grad_keeps_lse_as_residual(rng, monkeypatch):
    """Eager jax.vjp: one forward, and the backward gets the forward's own lse."""
    calls = {"fwd": 0, "bwd": []}
    fwd, bwd = cuflash.tiled_attention, cuflash.tiled_attention_backward

    def spy_fwd(*a, **kw):
        calls["fwd"] += 1
        return fwd(*a, **kw)

    def spy_bwd(do, q, k, v, o, lse, **kw):
        calls["bwd"].append(np.array(lse))
        return bwd(do, q, k, v, o, lse, **kw)
    monkeypatch.setattr(cuflash, "tiled_attention", spy_fwd)
    monkeypatch.setattr(cuflash, "tiled_attention_backward", spy_bwd)

    q, k, v = arrays(rng, shapes_for("bhnd", 1, 2, 2, 19, 23, 8))
    o, vjp = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True), q, k, v)
    grads = vjp(jnp.asarray(rng.standard_normal(o.shape).astype(np.float32)))
    assert calls["fwd"] == 1 and len(calls["bwd"]) == 1
    _, ref_lse, _ = oracle.attention(np.asarray(q), np.asarray(k), np.asarray(v), causal=True)
    assert_close(calls["bwd"][0], ref_lse, "lse handed to the backward")
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


@pytest.mark.parametrize("argnums", [(0,), (1, 2)])
def test_grad_of_argument_subsets(rng, argnums):
    q, k, v = arrays(rng, shapes_for("bnhd", 1, 4, 2, 17, 25, 8))

    def f(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sin(fn(q, k, v, causal="top_left",
                                                           layout="bnhd")).sum(),
                                argnums=argnums))
    for g, r in zip(f(cj.attention)(q, k, v), f(plain_attention)(q, k, v)):
        assert_close(g, r, f"grad argnums={argnums}")


def test_vmap_forward_and_grad(rng):
    q = arrays(rng, [(3, 2, 4, 11, 8)])[0]       # vmapped over axis 0
    k, v = arrays(rng, [(2, 2, 13, 8)] * 2)      # shared by the batch

    def f(fn):
        # o and dk of the vmapped call, in one compiled function
        def o_of_k(k):
            return jax.vmap(lambda qi: fn(qi, k, v, causal=True))(q)
        return jax.jit(lambda k: (o_of_k(k), jax.grad(lambda k: jnp.sin(o_of_k(k)).sum())(k)))
    (o, dk), (ref, ref_dk) = f(cj.attention)(k), f(plain_attention)(k)
    assert_close(o, ref, "vmapped o")
    assert_close(dk, ref_dk, "vmapped dk")


def test_bfloat16_against_oracle(rng):
    q, k, v = arrays(rng, shapes_for("bhnd", 1, 4, 2, 21, 35, 16), dtype=oracle.dtype_of(
        "bfloat16"))
    o, vjp = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True), q, k, v)
    do = jnp.asarray(rng.standard_normal(o.shape).astype(oracle.dtype_of("bfloat16")))
    grads = vjp(do)
    assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    qn, kn, vn = (np.asarray(x) for x in (q, k, v))
    oracle.check_forward(np.asarray(o), qn, kn, vn, causal=True, dtype="bfloat16")
    oracle.check_backward([np.asarray(g) for g in grads], np.asarray(do), qn, kn, vn,
                          causal=True, dtype="bfloat16")


def test_errors_are_raised_when_traced(rng):
    q, k, v = arrays(rng, shapes_for("bhnd", 1, 2, 2, 5, 7, 4))
    with pytest.raises(ValueError, match="bhnd.*bnhd"):
        jax.jit(lambda q: cj.attention(q, k, v, layout="nhd"))(q)
    with pytest.raises(ValueError, match="layout='bnhd'"):
        jax.jit(lambda q: cj.attention(q, k[..., :3], v, layout="bnhd"))(q)
    with pytest.raises(ValueError, match="causal"):
        cj.attention(q, k, v, causal="bottom")
    with pytest.raises(TypeError, match="k must be a jax.Array"):
        cj.attention(q, [[1.0]], v)
    with pytest.raises(TypeError, match="int32"):
        cj.attention(q, k.astype(jnp.int32), v)


def _features_loss(q, k, v, bias, seed):
    o = cj.attention(q, k, v, causal=True, bias=bias, softcap=5.0, window=(6, None),
                     dropout_p=0.1, seed=seed, layout="bnhd")
    return (o * o).sum()


def test_buffer_callback_path_gives_the_host_path_results(rng, monkeypatch):
    """The GPU path under jit (jax.experimental.buffer_callback: XLA's buffers handed to
    cuflash, results written into XLA's output buffers) taken on the CPU, where the buffers
    are host memory and the NumPy backend runs: the same values as the pure_callback path,
    for jit(grad) with every feature and for vmap.  (The CuPy half runs on a GPU only.)"""
    pytest.importorskip("jax.experimental.buffer_callback")
    q, k, v = arrays(rng, shapes_for("bnhd", 2, 4, 2, 11, 13, 8))
    bias = arrays(rng, [(2, 1, 1, 13)])[0]
    grad = jax.grad(_features_loss, argnums=(0, 1, 2, 3))
    qs = arrays(rng, [(3, 11, 4, 8)])[0]
    vmapped = jax.vmap(lambda qi: cj.attention(qi, k[0], v[0], causal=True, layout="bnhd"))
    host = jax.jit(grad)(q, k, v, bias, jnp.uint32(9)), jax.jit(vmapped)(qs)

    def no_pure_callback(*a, **kw):
        raise AssertionError("the buffer_callback path must not use pure_callback")
    monkeypatch.setattr(cj, "_device_path", lambda platform: True)
    monkeypatch.setattr(jax, "pure_callback", no_pure_callback)
    jax.clear_caches()     # trace again: the compiled host-path programs are cached
    device = jax.jit(grad)(q, k, v, bias, jnp.uint32(9)), jax.jit(vmapped)(qs)
    for a, b in zip(jax.tree_util.tree_leaves(device), jax.tree_util.tree_leaves(host)):
        assert a.shape == b.shape and bool((a == b).all())
    assert float(jnp.abs(device[0][3]).max()) > 0      # dbias came back through the buffers
    jax.clear_caches()


def test_host_round_trip_on_a_gpu_warns_and_says_why(rng, monkeypatch):
    q, k, v = arrays(rng, shapes_for("bhnd", 1, 2, 2, 5, 7, 4))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cj, "_cuda_backend_available", lambda: False)
    monkeypatch.setattr(cj, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="pure_callback on the host.*CuPy is not usable"):
        jax.jit(lambda q: cj.attention(q, k, v))(q)


@pytest.mark.cuda
def test_jit_on_a_gpu_runs_the_kernels_in_xla(rng):
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not cuflash.available_backends()["cuda"][0]:
        pytest.skip("needs JAX on a CUDA GPU and cuflash's cuda backend")
    assert cj._device_path("gpu"), "buffer_callback or CuPy missing: the host path would run"
    q, k, v = arrays(rng, shapes_for("bnhd", 2, 8, 2, 77, 131, 64))
    w = arrays(rng, [(2, 77, 8, 64)])[0]

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, causal=True, layout="bnhd") * w).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # no host round trip
        grads = jax.jit(jax.grad(loss(cj.attention), argnums=(0, 1, 2)))(q, k, v)
    refs = jax.jit(jax.grad(loss(plain_attention), argnums=(0, 1, 2)))(q, k, v)
    for g, r, name in zip(grads, refs, ("dq", "dk", "dv")):
        assert list(g.devices())[0].platform == "gpu"
        assert_close(g, r, name, tol=1e-4)

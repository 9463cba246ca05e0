"""cuflash.ring.jax on 4 XLA host devices, against single-device cuflash.

XLA's host device count is fixed when JAX starts, and other test modules start JAX in this
process, so the cases run in one fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (bounded by a timeout).  Each case
runs the ring under ``jax.jit`` (forward) and ``jax.jit(jax.grad(...))`` (q, k, v and bias
gradients) and compares with ``cuflash.tiled_attention`` / ``tiled_attention_backward`` on
the full sequence (NumPy backend): relative error below 1e-12 in float64, 1e-5 in float32.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(r'''
    import json, os
    import numpy as np
    import jax, jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    import cuflash
    from cuflash.ring.jax import ring_attention, ring_attention_shard, shard, unshard
    from jax.sharding import Mesh, PartitionSpec as P

    assert len(jax.devices()) == 4, jax.devices()
    W = 4
    mesh = Mesh(np.array(jax.devices()), ("sp",))
    CASES = {
        # name: dtype, B, H, Hk, N, d, causal, sharding, window, softcap, bias kind, layout
        "causal_zigzag": ("float64", 1, 2, 2, 32, 8, True, "zigzag", None, None, None, "bhnd"),
        "plain_contiguous": ("float64", 2, 2, 2, 24, 8, False, "contiguous", None, None, None,
                             "bhnd"),
        "gqa_window_softcap_bias": ("float64", 1, 4, 2, 32, 8, True, "zigzag", (6, None), 3.0,
                                    "rows", "bhnd"),
        "f32_bnhd_window_keys_bias": ("float32", 2, 2, 1, 16, 8, False, "zigzag", (3, 2), None,
                                      "keys", "bnhd"),
    }
    out = {}
    for name, (dt, B, H, Hk, N, d, causal, sharding, window, softcap, bk, layout) in CASES.items():
        rng = np.random.default_rng(len(out))
        q, do = (rng.standard_normal((B, H, N, d)).astype(dt) for _ in range(2))
        k, v = (rng.standard_normal((B, Hk, N, d)).astype(dt) for _ in range(2))
        bias = None
        if bk == "rows":
            bias = rng.standard_normal((1, H, N, N)).astype(dt)
        elif bk == "keys":
            bias = rng.standard_normal((B, 1, 1, N)).astype(dt)
        kw = dict(causal=causal, window=window, softcap=softcap)
        o_ref, lse_ref = cuflash.tiled_attention(q, k, v, bias=bias, return_lse=True, **kw)
        ref = cuflash.tiled_attention_backward(do, q, k, v, o_ref, lse_ref, bias=bias,
                                               return_dbias=bias is not None, **kw)
        ax = 2 if layout == "bhnd" else 1
        tr = (lambda x: x) if layout == "bhnd" else (lambda x: jnp.swapaxes(x, 1, 2))

        def run(q, k, v, b):
            sq, sk, sv = (shard(tr(x), W, axis=ax, sharding=sharding) for x in (q, k, v))
            sb = None if b is None else (shard(b, W, axis=2, sharding=sharding)
                                         if b.shape[-2] > 1 else b)
            o, lse = ring_attention(sq, sk, sv, mesh=mesh, axis_name="sp", bias=sb,
                                    sharding=sharding, layout=layout, return_lse=True, **kw)
            return (tr(unshard(o, W, axis=ax, sharding=sharding)),
                    unshard(lse, W, axis=2, sharding=sharding))

        o, lse = jax.jit(run)(q, k, v, bias)
        argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a)[0] * do), argnums=argnums))(
            q, k, v, bias)
        rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b)
                                 / np.linalg.norm(b))
        out[name] = dict(dtype=dt, o=rel(o, o_ref), lse=rel(lse, lse_ref),
                         grads=[rel(g, r) for g, r in zip(grads, ref)],
                         shapes_ok=all(g.shape == r.shape for g, r in zip(grads, ref)))

    # the per-device function inside a shard_map of one's own
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    f = jax.shard_map(lambda a, b, c: ring_attention_shard(a, b, c, axis_name="sp",
                                                           causal=True),
                      mesh=mesh, in_specs=(P(None, None, "sp", None),) * 3,
                      out_specs=P(None, None, "sp", None), check_vma=False)
    o = unshard(jax.jit(f)(*(shard(x, W, axis=2) for x in (q, k, v))), W, axis=2)
    o_ref = cuflash.tiled_attention(q, k, v, causal=True)
    out["shard_level"] = dict(dtype="float64", o=float(np.abs(o - o_ref).max()), lse=0.0,
                              grads=[], shapes_ok=True)

    errors = {}
    x = jnp.zeros((1, 2, 16, 8))
    bad = {
        "mesh_type": lambda: ring_attention(x, x, x, mesh="sp", axis_name="sp"),
        "axis_name": lambda: ring_attention(x, x, x, mesh=mesh, axis_name="tp"),
        "uneven": lambda: ring_attention(jnp.zeros((1, 2, 12, 8)), jnp.zeros((1, 2, 12, 8)),
                                         jnp.zeros((1, 2, 12, 8)), mesh=mesh, axis_name="sp"),
        "alibi": lambda: ring_attention(x, x, x, mesh=mesh, axis_name="sp",
                                        alibi_slopes=jnp.ones(2)),
        "dropout": lambda: ring_attention(x, x, x, mesh=mesh, axis_name="sp", dropout_p=0.1),
        "bias_shape": lambda: ring_attention(x, x, x, mesh=mesh, axis_name="sp",
                                             bias=jnp.zeros((1, 2, 16, 8))),
    }
    for name, fn in bad.items():
        try:
            fn()
            errors[name] = None
        except Exception as e:
            errors[name] = [type(e).__name__, str(e)]
    print("RESULT " + json.dumps({"cases": out, "errors": errors}))
''')


@pytest.fixture(scope="module")
def result():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", ["causal_zigzag", "plain_contiguous", "gqa_window_softcap_bias",
                                  "f32_bnhd_window_keys_bias", "shard_level"])
def test_ring_equals_single_device(result, name):
    case = result["cases"][name]
    tol = 1e-12 if case["dtype"] == "float64" else 1e-5
    assert case["shapes_ok"]
    assert case["o"] < tol and case["lse"] < tol, case
    assert all(g < tol for g in case["grads"]), case
    if name != "shard_level":
        assert len(case["grads"]) in (3, 4)


@pytest.mark.parametrize("name,error,words", [
    ("mesh_type", "TypeError", "jax.sharding.Mesh"),
    ("axis_name", "ValueError", "not an axis of the mesh"),
    ("uneven", "ValueError", "does not split into 8 equal chunks"),
    ("alibi", "ValueError", "alibi_slopes is not supported"),
    ("dropout", "ValueError", "dropout_p > 0 is not supported"),
    ("bias_shape", "ValueError", "bias must have shape"),
])
def test_bad_arguments(result, name, error, words):
    got = result["errors"][name]
    assert got is not None, f"{name} raised nothing"
    assert got[0] == error and words in got[1], got

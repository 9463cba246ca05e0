"""cuflash's PyTorch operators under torch.compile: traced whole, forward and backward.

``fullgraph=True`` makes any graph break an error, so every test here that
compiles also proves that the call traces without one.  The tests use the
``"aot_eager"`` backend: it runs Dynamo and AOTAutograd (the fake
implementations, the autograd formulas, symbolic shapes) and then the traced
graph as is, in well under a second per graph; the ``"inductor"`` backend adds
C++ code generation for the surrounding ops (tens of seconds on the CI
machine) and nothing about the operators themselves, so it runs in one test
only.  ``torch.library.opcheck`` holds each fake implementation to its real
one (shapes, strides, dtypes, aliasing, mutation) on concrete inputs.
References: eager cuflash (bitwise: the compiled graph calls the same
operator) and PyTorch's SDPA.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import cuflash  # noqa: E402
import cuflash.torch as ct  # noqa: E402
from cuflash import _torch_ops  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def randn(rng, *shape, dtype=torch.float32, grad=True):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype, requires_grad=grad)


def compiled(fn, dynamic=None):
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)


def value_and_grads(fn, inputs):
    """fn(*inputs) and the gradients of (fn * fixed weights).sum() for the inputs needing them."""
    out = fn(*inputs)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return out.detach(), torch.autograd.grad((out * w).sum(), wanted)


def sdpa_bnhd(q, k, v, bottom_right=True, bias=None):
    """SDPA with flash-attn's layout and bottom-right causal mask, GQA by repetition."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    Nq, Nk = q.shape[-2], k.shape[-2]
    mask = (torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).tril(Nk - Nq)
            if bottom_right else None)
    if bias is not None:
        mask = torch.where(mask, bias, float("-inf")) if mask is not None else bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_fullgraph_forward_and_backward_match_eager_and_sdpa(rng, layout):
    B, H, Hk, Nq, Nk, d = 2, 6, 3, 13, 19, 16
    shape = (lambda n, h: (B, h, n, d) if layout == "bhnd" else (B, n, h, d))  # noqa: E731
    q, k, v = randn(rng, *shape(Nq, H)), randn(rng, *shape(Nk, Hk)), randn(rng, *shape(Nk, Hk))

    def f(q, k, v):
        return ct.attention(q, k, v, causal=True, layout=layout)
    out_c, grads_c = value_and_grads(compiled(f), (q, k, v))
    out_e, grads_e = value_and_grads(f, (q, k, v))
    assert torch.equal(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)
    t = (lambda x: x.transpose(1, 2)) if layout == "bhnd" else (lambda x: x)  # noqa: E731
    out_r, grads_r = value_and_grads(lambda q, k, v: t(sdpa_bnhd(t(q), t(k), t(v))), (q, k, v))
    torch.testing.assert_close(out_c, out_r, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_c, grads_r):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_logit_features_and_learnable_bias_compile(rng):
    """bias (with its gradient), ALiBi, window, softcap and dropout with a seed drawn inside the
    graph: the compiled call gives what the eager call gives with the same torch seed."""
    B, H, Hk, Nq, Nk, d = 2, 4, 2, 11, 17, 8
    q, k, v = randn(rng, B, Nq, H, d), randn(rng, B, Nk, Hk, d), randn(rng, B, Nk, Hk, d)
    bias = randn(rng, B, 1, 1, Nk)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def f(q, k, v, bias):
        return ct.attention(q, k, v, causal=True, bias=bias, alibi_slopes=slopes,
                            window=(6, None), softcap=8.0, dropout_p=0.2, layout="bnhd")
    torch.manual_seed(123)
    out_c, grads_c = value_and_grads(compiled(f), (q, k, v, bias))
    torch.manual_seed(123)
    out_e, grads_e = value_and_grads(f, (q, k, v, bias))
    assert torch.equal(out_c, out_e) and len(grads_c) == 4
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)
    assert bias.grad is None and grads_c[3].shape == bias.shape and grads_c[3].abs().sum() > 0


def test_dynamic_shapes_do_not_recompile(rng):
    d = 8

    def f(q, k, v):
        return ct.attention(q, k, v, causal=True, layout="bnhd").square().sum()
    fn = compiled(f, dynamic=True)
    # B, Nq, H, Nk, Hk; no two sizes of a call equal (Dynamo would guard on the equality)
    shapes = [(3, 13, 6, 17, 2), (5, 29, 6, 7, 2), (9, 11, 6, 31, 2)]
    for i, (B, Nq, H, Nk, Hk) in enumerate(shapes):
        q, k, v = randn(rng, B, Nq, H, d), randn(rng, B, Nk, Hk, d), randn(rng, B, Nk, Hk, d)
        # after the first (symbolic) trace, a new shape must reuse it
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = fn(q, k, v)
            loss.backward()
        torch.testing.assert_close(loss, f(q, k, v), rtol=1e-6, atol=0)
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_compiled_module_trains_like_eager(rng):
    """A GQA self-attention block with a learnable bias, compiled whole, trained three steps:
    the same losses and parameters as eager (the operators are deterministic on the CPU)."""
    def make():
        torch.manual_seed(7)
        return torch.nn.ModuleDict({"qkv": torch.nn.Linear(16, 16 + 2 * 8),
                                    "out": torch.nn.Linear(16, 16)})

    def forward(mod, x, bias):
        B, N, _ = x.shape
        q, k, v = mod["qkv"](x).split([16, 8, 8], -1)
        o = ct.attention(q.view(B, N, 4, 4), k.view(B, N, 2, 4), v.view(B, N, 2, 4),
                         causal=True, bias=bias, layout="bnhd")
        return mod["out"](o.reshape(B, N, 16))

    x = torch.tensor(rng.standard_normal((2, 9, 16)), dtype=torch.float32)
    runs = []
    for step_fn in (forward, compiled(forward)):
        mod, bias = make(), torch.zeros(1, 1, 1, 9, requires_grad=True)
        opt = torch.optim.SGD(list(mod.parameters()) + [bias], lr=0.5)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = step_fn(mod, x, bias).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((losses, bias.detach().clone()))
    assert runs[0][0][-1] < runs[0][0][0]
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-6, atol=1e-7)


def test_inductor_backend(rng):
    """The default backend compiles the same call (C++ code for the ops around it)."""
    q, k, v = randn(rng, 1, 7, 2, 8), randn(rng, 1, 9, 2, 8), randn(rng, 1, 9, 2, 8)

    def f(q, k, v):
        return ct.attention(q, k, v, causal=True, layout="bnhd").sin()
    out_c, grads_c = value_and_grads(torch.compile(f, fullgraph=True), (q, k, v))
    out_e, grads_e = value_and_grads(f, (q, k, v))
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _opcheck(op, args, differentiable=True):
    """opcheck's tests; the backward operators and the KV-cache operator have no autograd
    formula of their own, so they skip the tests that differentiate through the operator."""
    tests = ["test_schema", "test_faketensor"]
    if differentiable:
        tests += ["test_autograd_registration", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(op, args, test_utils=tests)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_fake_implementations_match_the_real_ones(rng, layout):
    B, H, Hk, Nq, Nk, d = 2, 4, 2, 5, 7, 8
    shape = (lambda n, h: (B, h, n, d) if layout == "bhnd" else (B, n, h, d))  # noqa: E731
    q, k, v = randn(rng, *shape(Nq, H)), randn(rng, *shape(Nk, Hk)), randn(rng, *shape(Nk, Hk))
    bias = randn(rng, B, 1, Nq, Nk)
    seed = _torch_ops.seed_tensor(2 ** 63 + 5)
    slopes = torch.rand(H)
    fwd = torch.ops.cuflash.attention_fwd.default
    _opcheck(fwd, (q, k, v, None, None, None, None, "none", -1, -1, 0.0, 0.0, layout, False))
    args = (q, k, v, bias, slopes, seed, 0.3, "top_left", 3, 1, 5.0, 0.1, layout, True)
    _opcheck(fwd, args)
    o, lse = fwd(*args)
    do = randn(rng, *o.shape, grad=False)
    _opcheck(torch.ops.cuflash.attention_bwd.default,
             (do,) + args[:3] + (o, lse) + args[3:] + (True,), differentiable=False)
    _opcheck(torch.ops.cuflash.attention_probs.default,
             tuple(x.detach() for x in (q, k, v)) + (slopes, None, "bottom_right", -1, 2, 0.0,
                                                     layout), differentiable=False)


def test_fake_implementations_of_the_serving_ops(rng):
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q, k, v = randn(rng, 8, 4, 8), randn(rng, 8, 2, 8), randn(rng, 8, 2, 8)
    fwd = torch.ops.cuflash.varlen_fwd.default
    args = (q, k, v, cu, cu, 5, 5, None, None, None, "bottom_right", -1, -1, 0.0, 0.0, False)
    _opcheck(fwd, args)
    o, lse = fwd(*args)
    _opcheck(torch.ops.cuflash.varlen_bwd.default,
             (randn(rng, *o.shape, grad=False), q, k, v, o, lse) + args[3:],
             differentiable=False)
    k_cache = torch.zeros(3, 12, 2, 8)   # one more cache row than sequences
    v_cache = torch.zeros(3, 12, 2, 8)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    new = [randn(rng, 2, 1, 2, 8, grad=False) for _ in range(2)]
    _opcheck(torch.ops.cuflash.kvcache_fwd.default,
             (randn(rng, 2, 1, 4, 8, grad=False), k_cache, v_cache, lens, *new, None, None,
              None, None, "bottom_right", -1, -1, 0.0, None), differentiable=False)


def test_double_backward_refused_under_compile(rng):
    """Compiled, the first backward is AOTAutograd's graph (which calls attention_bwd); asked
    for a graph of the gradients, differentiating them raises torch's own error, not a
    silently detached result."""
    q, k, v = (randn(rng, 1, 5, 2, 4, dtype=torch.float64) for _ in range(3))

    def f(q, k, v):
        return ct.attention(q, k, v, layout="bnhd").square().sum()
    grads = torch.autograd.grad(compiled(f)(q, k, v), (q, k, v), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(grads[0].sum(), (q, k, v))


def _cuda_ready():
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return cuflash.available_backends()["cuda"]


@pytest.mark.cuda
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_cuda_tensors_compile(compiler):
    ok, why = _cuda_ready()
    if not ok:
        pytest.skip(f"no CUDA path here: {why}")
    rng = np.random.default_rng(0)
    q, k, v = (randn(rng, *s, dtype=torch.float16).detach().cuda().requires_grad_()
               for s in ((2, 77, 8, 64), (2, 131, 2, 64), (2, 131, 2, 64)))

    def f(q, k, v):
        return ct.attention(q, k, v, causal=True, layout="bnhd")
    fn = torch.compile(f, fullgraph=True, backend=compiler, dynamic=True)
    out, grads = value_and_grads(fn, (q, k, v))
    ref, refs = value_and_grads(lambda q, k, v: sdpa_bnhd(q, k, v), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-3)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=5e-3)

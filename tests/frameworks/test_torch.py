"""cuflash.torch: values and gradients against PyTorch's own attention.

The references are independent of cuflash: ``torch.nn.functional.
scaled_dot_product_attention`` (with the bottom-right causal mask built here
by ``tril``, SDPA's ``is_causal`` for top-left, ``enable_gqa`` for grouped
heads), ``torch.autograd.gradcheck`` (central differences), and the float64
oracle of ``tests/oracle.py`` for the low-precision rule.  Sequence lengths
are odd and Nq != Nk; inputs and output gradients are fresh random draws.
"""
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import oracle  # noqa: E402  (tests/ is on sys.path through conftest)

import cuflash  # noqa: E402
import cuflash.torch as ct  # noqa: E402

F = torch.nn.functional


def tensors(rng, shapes, dtype=torch.float32, requires_grad=True):
    return [torch.tensor(rng.standard_normal(s), dtype=dtype, requires_grad=requires_grad)
            for s in shapes]


def shapes_for(layout, B, H, Hk, Nq, Nk, d):
    """q, k, v shapes in the caller's layout."""
    if layout == "bhnd":
        return (B, H, Nq, d), (B, Hk, Nk, d), (B, Hk, Nk, d)
    return (B, Nq, H, d), (B, Nk, Hk, d), (B, Nk, Hk, d)


def sdpa(q, k, v, causal=False, layout="bhnd", scale=None):
    """PyTorch's attention with cuflash's conventions spelled out."""
    if layout == "bnhd":
        q, k, v = (x.transpose(-3, -2) for x in (q, k, v))
    Nq, Nk = q.shape[-2], k.shape[-2]
    kw = dict(scale=scale, enable_gqa=k.shape[-3] != q.shape[-3])
    if causal == "top_left":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    elif causal:  # bottom-right: query i sees key j iff j <= i + Nk - Nq
        mask = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).tril(diagonal=Nk - Nq)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    else:
        o = F.scaled_dot_product_attention(q, k, v, **kw)
    return o.transpose(-3, -2) if layout == "bnhd" else o


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def assert_close(out, ref, what, tol=1e-5):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.linalg.norm(ref.double()) > 0, f"{what}: reference is all zero"
    err = rel_err(out, ref)
    assert err < tol, (f"{what}: relative error {err:.2e} >= {tol:.0e}; max abs err "
                       f"{(out.detach().double() - ref.detach().double()).abs().max():.2e}")


# (H, Hk, causal, Nq, Nk, scale): MHA, GQA, MQA; no mask, bottom-right with
# Nq < Nk and Nq > Nk (the first 16 rows see no key), top-left
CASES = [
    (4, 4, False, 37, 53, None),
    (4, 2, True, 37, 53, None),
    (4, 2, True, 53, 37, 0.3),
    (4, 1, "top_left", 53, 37, None),
    (2, 2, "top_left", 29, 29, None),
]


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("H, Hk, causal, Nq, Nk, scale", CASES)
def test_matches_sdpa_float32(rng, layout, H, Hk, causal, Nq, Nk, scale):
    q, k, v = tensors(rng, shapes_for(layout, 2, H, Hk, Nq, Nk, 16))
    o = ct.attention(q, k, v, scale=scale, causal=causal, layout=layout)
    ref = sdpa(q, k, v, causal, layout, scale)
    assert o.dtype == torch.float32 and o.shape == ref.shape
    assert_close(o, ref, "o")
    do = torch.tensor(rng.standard_normal(tuple(o.shape)), dtype=torch.float32)
    grads = torch.autograd.grad(o, (q, k, v), do)
    refs = torch.autograd.grad(ref, (q, k, v), do)
    for g, r, x, name in zip(grads, refs, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == x.shape, f"{name} not in the caller's layout: {g.shape} vs {x.shape}"
        assert_close(g, r, name)


@pytest.mark.parametrize("layout, H, Hk, causal, Nq, Nk", [
    ("bhnd", 2, 2, False, 3, 5),
    ("bnhd", 4, 2, True, 5, 3),        # GQA; bottom-right with rows that see no key
    ("bhnd", 2, 1, "top_left", 5, 4),  # k/v broadcast over the heads
])
def test_gradcheck_float64(rng, layout, H, Hk, causal, Nq, Nk):
    q, k, v = tensors(rng, shapes_for(layout, 1, H, Hk, Nq, Nk, 4), dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.attention(q, k, v, causal=causal, layout=layout), (q, k, v))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_low_precision_against_oracle(rng, dtype, layout):
    # the flash-attn rule of docs/testing.md, on the (..., H, N, d) views
    tdtype = getattr(torch, dtype)
    q, k, v = tensors(rng, shapes_for(layout, 1, 4, 2, 21, 35, 16), dtype=tdtype)
    o = ct.attention(q, k, v, causal=True, layout=layout)
    do = torch.tensor(rng.standard_normal(tuple(o.shape)), dtype=tdtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert o.dtype == tdtype and all(g.dtype == tdtype for g in grads)

    def np_bhnd(t):
        t = t.detach().transpose(-3, -2) if layout == "bnhd" else t.detach()
        return t.float().numpy().astype(oracle.dtype_of(dtype))
    qn, kn, vn = (np_bhnd(t) for t in (q, k, v))
    oracle.check_forward(np_bhnd(o), qn, kn, vn, causal=True, dtype=dtype)
    oracle.check_backward([np_bhnd(g) for g in grads], np_bhnd(do), qn, kn, vn, causal=True,
                          dtype=dtype)


SUBSETS = [s for n in range(4) for s in itertools.combinations("qkv", n)]


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "".join(s) or "none")
def test_requires_grad_subsets(rng, subset):
    q, k, v = tensors(rng, shapes_for("bnhd", 1, 4, 2, 19, 27, 8), requires_grad=False)
    for name, t in zip("qkv", (q, k, v)):
        t.requires_grad_(name in subset)
    o = ct.attention(q, k, v, causal=True, layout="bnhd")
    ref = sdpa(q, k, v, True, "bnhd")
    assert_close(o, ref, "o")
    if not subset:
        assert o.grad_fn is None and not o.requires_grad
        return
    do = torch.tensor(rng.standard_normal(tuple(o.shape)), dtype=torch.float32)
    # the backward itself returns None for the inputs that need no gradient (called as autograd
    # calls it without create_graph: grad mode off); o is output 0 of the operator
    # cuflash::attention_fwd, whose lse (output 1) takes no gradient
    with torch.no_grad():
        raw = o.grad_fn.apply(do, None)
    assert len(raw) > 3 and all(r is None for r in raw[3:])
    (o * do).sum().backward()
    for name, t, r in zip("qkv", (q, k, v), raw[:3]):
        if name in subset:
            ref_grad, = torch.autograd.grad(ref, t, do, retain_graph=True)
            assert_close(t.grad, ref_grad, f"d{name}")
            assert_close(r, ref_grad, f"d{name} (grad_fn.apply)")
        else:
            assert t.grad is None and r is None, f"d{name} computed but not requested"


def test_grad_of_sum_has_stride_zero_and_matches(rng):
    # o.sum() hands the backward an expanded (stride 0) gradient
    q, k, v = tensors(rng, shapes_for("bhnd", 2, 2, 2, 23, 31, 8))
    ct.attention(q, k, v, causal="top_left").sum().backward()
    grads = [t.grad for t in (q, k, v)]
    refs = torch.autograd.grad(sdpa(q, k, v, "top_left").sum(), (q, k, v))
    for g, r, name in zip(grads, refs, ("dq", "dk", "dv")):
        assert_close(g, r, name)


def test_inputs_not_modified_and_deterministic(rng):
    q, k, v = tensors(rng, shapes_for("bnhd", 1, 4, 2, 17, 25, 8))
    before = [t.detach().clone() for t in (q, k, v)]
    do = torch.tensor(rng.standard_normal((1, 17, 4, 8)), dtype=torch.float32)
    runs = []
    for det in (False, True, True):
        o = ct.attention(q, k, v, causal=True, layout="bnhd", deterministic=det)
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for t, b in zip((q, k, v), before):
        assert torch.equal(t.detach(), b)
    for g_a, g_b in zip(runs[1], runs[2]):  # deterministic: bitwise repeatable
        assert torch.equal(g_a, g_b)
    for g_a, g_b in zip(runs[0], runs[1]):
        assert_close(g_a, g_b, "deterministic vs default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_zero_copy(rng, monkeypatch, dtype):
    """NumPy sees the tensors' own memory; torch gets cuflash's outputs without a copy."""
    seen = {}
    fwd, bwd = cuflash.tiled_attention, cuflash.tiled_attention_backward

    def spy_fwd(q, k, v, **kw):
        o, lse = fwd(q, k, v, **kw)
        seen["fwd_in"] = [a.ctypes.data for a in (q, k, v)]
        seen["fwd_out"] = o.ctypes.data
        return o, lse

    def spy_bwd(do, q, k, v, o, lse, **kw):
        grads = bwd(do, q, k, v, o, lse, **kw)
        seen["bwd_in"] = [a.ctypes.data for a in (do, q, k, v, o)]
        seen["bwd_out"] = [g.ctypes.data for g in grads]
        return grads
    monkeypatch.setattr(cuflash, "tiled_attention", spy_fwd)
    monkeypatch.setattr(cuflash, "tiled_attention_backward", spy_bwd)

    q, k, v = tensors(rng, shapes_for("bnhd", 1, 2, 2, 13, 19, 8), dtype=dtype)
    o = ct.attention(q, k, v, layout="bnhd")
    do = torch.tensor(rng.standard_normal(tuple(o.shape)), dtype=dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert seen["fwd_in"] == [t.data_ptr() for t in (q, k, v)]
    assert seen["fwd_out"] == o.data_ptr()
    assert seen["bwd_in"] == [t.data_ptr() for t in (do, q, k, v, o)]
    assert seen["bwd_out"] == [g.data_ptr() for g in grads]
    assert_close(o.float(), sdpa(q.float(), k.float(), v.float(), layout="bnhd"), "o",
                 tol=1e-5 if dtype == torch.float32 else 1e-2)


class _Attention(torch.nn.Module):
    """Causal GQA self-attention with a residual; ``fn`` takes (B, N, H, d) tensors."""

    def __init__(self, dim, heads, kv_heads, fn):
        super().__init__()
        self.h, self.hk, self.dh, self.fn = heads, kv_heads, dim // heads, fn
        self.q = torch.nn.Linear(dim, heads * self.dh)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.dh)
        self.out = torch.nn.Linear(heads * self.dh, dim)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.h, self.dh)
        k, v = self.kv(x).view(B, N, 2, self.hk, self.dh).unbind(2)  # strided views
        return x + self.out(self.fn(q, k, v).reshape(B, N, self.h * self.dh))


def _train(fn, seed, steps=5):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(_Attention(32, 4, 2, fn), _Attention(32, 4, 2, fn))
    data = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(3, 41, 32, generator=data)
    target = torch.randn(3, 41, 32, generator=data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_layer_model_trains_like_sdpa():
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh weights every run
    ours = _train(lambda q, k, v: ct.attention(q, k, v, causal=True, layout="bnhd"), seed)
    ref = _train(lambda q, k, v: sdpa(q, k, v, True, "bnhd"), seed)
    assert ours[-1] < ours[0], f"loss did not decrease: {ours}"
    np.testing.assert_allclose(ours, ref, rtol=1e-5, err_msg=f"seed {seed}")


def test_errors_are_clear(rng):
    q, k, v = tensors(rng, shapes_for("bhnd", 1, 2, 2, 5, 7, 4))
    with pytest.raises(ValueError, match="bhnd.*bnhd"):
        ct.attention(q, k, v, layout="nhd")
    with pytest.raises(ValueError, match="one device.*k on meta"):
        ct.attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="CPU tensors.*CUDA tensors.*meta"):
        ct.attention(*(t.to("meta") for t in (q, k, v)))
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ct.attention(q, k.detach().numpy(), v)
    with pytest.raises(TypeError, match="torch.int32"):
        ct.attention(q, k.int(), v)
    with pytest.raises(TypeError, match="one dtype.*k: torch.float64"):
        ct.attention(q, k.double(), v)
    with pytest.raises(ValueError, match="at least 3 dims"):
        ct.attention(q[0, 0], k[0, 0], v[0, 0], layout="bnhd")
    with pytest.raises(ValueError, match="causal"):
        ct.attention(q, k, v, causal="bottom")
    # cuflash's shape error, with a note that bnhd shapes were shown swapped
    with pytest.raises(ValueError, match="layout='bnhd'"):
        ct.attention(q, k[..., :3], v, layout="bnhd")


@pytest.mark.parametrize("features", [{}, {"softcap": 5.0}])
def test_double_backward_is_a_clear_error(rng, features):
    """create_graph=True asks for differentiable gradients, which the kernels cannot give: a
    RuntimeError (the gradients used to come back silently without a graph); first-order
    gradients after it still work."""
    q, k, v = tensors(rng, shapes_for("bhnd", 1, 2, 2, 5, 7, 4), dtype=torch.float64)
    o = ct.attention(q, k, v, **features)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
    g = torch.autograd.grad(ct.attention(q, k, v, **features).sum(), (q, k, v))
    assert all(x is not None and not x.requires_grad for x in g)


def _cuda_ready():
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    ok, why = cuflash.available_backends()["cuda"]
    return ok, why


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_cuda_zero_copy_on_torch_stream(layout):
    ok, why = _cuda_ready()
    if not ok:
        pytest.skip(f"no CUDA path here: {why}")
    import cupy
    rng = np.random.default_rng(0)
    q, k, v = (t.detach().cuda().requires_grad_()
               for t in tensors(rng, shapes_for(layout, 2, 4, 2, 77, 131, 64)))
    seen = {}
    fwd = cuflash.tiled_attention

    def spy(q_, k_, v_, **kw):
        seen["ptrs"] = [a.data.ptr for a in (q_, k_, v_)]
        seen["stream"] = cupy.cuda.get_current_stream().ptr
        return fwd(q_, k_, v_, **kw)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuflash, "tiled_attention", spy)
        o = ct.attention(q, k, v, causal=True, layout=layout)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        ref = sdpa(q, k, v, True, layout)
        refs = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.cuda.synchronize()
    assert seen["ptrs"] == [t.data_ptr() for t in (q, k, v)]
    assert seen["stream"] == stream.cuda_stream
    assert o.is_cuda and all(g.is_cuda for g in grads)
    assert_close(o, ref, "o")
    for g, r, name in zip(grads, refs, ("dq", "dk", "dv")):
        assert_close(g, r, name)

"""cuflash.flash_attn against a float64 reference of FlashAttention-2's documented semantics.

The reference (``fa2_reference`` below) is written from the docstrings of
``flash_attn.flash_attn_interface`` (2.8), not from cuflash: the
``(batch, seqlen, heads, headdim)`` layout, the bottom-right causal mask,
``window_size`` keys ``[i + Nk - Nq - left, i + Nk - Nq + right]`` with -1
unbounded, ``softcap * tanh(s / softcap)``, ALiBi ``-slope * |i + Nk - Nq - j|``,
query head h reading kv head ``h // (H / Hk)``, dropout as ``P * keep / (1 - p)``,
rows without keys giving 0 (and FA2's lse of +inf).  Gradients of the reference
come from torch's autograd in float64.  Inputs are float32 (cuflash computes in
float32); lengths are odd and Nq != Nk.
"""
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import cuflash  # noqa: E402
import cuflash.flash_attn as fa  # noqa: E402


# ---------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------
def fa2_reference(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, keep=None, dropout_p=0.0):
    """(out, lse, P) in float64 for one dense batch; ``keep`` the dropout keep-mask."""
    q, k, v = (x.double() for x in (q, k, v))
    B, Nq, H, D = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(H // Hk, dim=2) for x in (k, v))
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq)[:, None] + (Nk - Nq)       # the query's key-aligned position
    j = torch.arange(Nk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double()
        slopes = slopes[None] if slopes.dim() == 1 else slopes          # (1 or B, H)
        s = s - slopes[:, :, None, None] * (i - j).abs()
    visible = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        visible &= j <= i
    left, right = window_size
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    any_key = visible.any(-1, keepdim=True)
    s = torch.where(visible, s, float("-inf"))
    s = torch.where(any_key, s, 0.0)                 # rows without keys: no NaN anywhere
    p = torch.where(visible & any_key, torch.softmax(s, -1), 0.0)
    lse = torch.where(any_key[..., 0], torch.logsumexp(s, -1), float("inf"))
    pd = p if keep is None else p * keep / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", pd, v)
    return out, lse, p


def randn(rng, *shape, dtype=torch.float32, grad=True):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype, requires_grad=grad)


def weights(out):
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)


def check(got, want, what, tol=2e-5):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: the reference is all zero"
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.2e} > {tol:.0e} x {scale:.2e}"


def grads_of(out, inputs):
    return torch.autograd.grad((out * weights(out).to(out.dtype)).sum(), inputs)


# (H, Hk, Nq, Nk, options): every FlashAttention-2 argument of the dense call, alone and mixed
DENSE = [
    (4, 4, 13, 21, {}),
    (4, 2, 13, 21, {"causal": True}),
    (4, 1, 21, 13, {"causal": True}),                        # the first 8 rows see no key
    (4, 2, 17, 17, {"window_size": (3, 2)}),
    (4, 2, 13, 21, {"causal": True, "window_size": (5, -1)}),
    (4, 4, 13, 21, {"window_size": (-1, 0)}),                # = causal
    (4, 2, 13, 21, {"softcap": 2.0, "softmax_scale": 0.7}),
    (4, 2, 13, 21, {"alibi": "heads", "causal": True}),
    (4, 4, 21, 13, {"alibi": "batch", "window_size": (4, 4), "softcap": 5.0}),
]


def _alibi(kind, B, H):
    if kind is None:
        return None
    base = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    return base if kind == "heads" else torch.stack([base * (b + 1) for b in range(B)])


@pytest.mark.parametrize("H, Hk, Nq, Nk, options", DENSE,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{'-'.join(c[4]) or 'plain'}"
                              for c in DENSE])
def test_flash_attn_func_against_reference(rng, H, Hk, Nq, Nk, options):
    B, D = 2, 16
    options = dict(options)
    slopes = _alibi(options.pop("alibi", None), B, H)
    q, k, v = randn(rng, B, Nq, H, D), randn(rng, B, Nk, Hk, D), randn(rng, B, Nk, Hk, D)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True,
                                           **options)
    ref, ref_lse, _ = fa2_reference(q, k, v, alibi_slopes=slopes, **options)
    check(out, ref, "out")
    assert lse.dtype == torch.float32 and s_dmask.numel() == 0   # no dropout: S_dmask empty
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite) and bool((lse[~finite] > 0).all())
    check(lse[finite], ref_lse[finite], "softmax_lse")
    for name, g, r in zip("qkv", grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))):
        check(g, r, f"d{name}")
    assert fa.flash_attn_func(q, k, v, alibi_slopes=slopes, **options).shape == (B, Nq, H, D)


def test_dropout_uses_cuflash_mask_and_returns_signed_probabilities(rng):
    B, H, Hk, Nq, Nk, D, p = 2, 4, 2, 13, 21, 16, 0.25
    q, k, v = randn(rng, B, Nq, H, D), randn(rng, B, Nk, Hk, D), randn(rng, B, Nk, Hk, D)
    torch.manual_seed(5)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                           return_attn_probs=True)
    torch.manual_seed(5)
    again = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert torch.equal(out, again)                          # torch.manual_seed repeats it
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))   # the draw the call made
    keep = torch.from_numpy(cuflash.dropout_mask((B, H, Nq, Nk), p, seed))
    ref, _, ref_p = fa2_reference(q, k, v, causal=True, keep=keep, dropout_p=p)
    assert 0.15 < 1 - keep.double().mean() < 0.35
    check(out, ref, "out")
    check(s_dmask.abs(), ref_p, "|S_dmask|")
    assert torch.equal(s_dmask < 0, ~keep & (ref_p > 0))    # negative exactly where dropped
    for name, g, r in zip("qkv", grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))):
        check(g, r, f"d{name}")


def test_packed_forms_equal_the_unpacked_call(rng):
    B, N, H, D = 2, 11, 4, 8
    qkv = randn(rng, B, N, 3, H, D)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(4, 0))
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(2))
    ref = fa.flash_attn_func(q, k, v, causal=True, window_size=(4, 0))
    assert torch.equal(out, ref)
    (dqkv,) = grads_of(out, (qkv,))
    assert torch.equal(dqkv, torch.stack(grads_of(ref, (q, k, v)), 2))
    q = randn(rng, B, N, H, D)
    kv = randn(rng, B, 15, 2, 2, D)
    out = fa.flash_attn_kvpacked_func(q, kv, softcap=3.0)
    ref = fa.flash_attn_func(q, *kv.unbind(2), softcap=3.0)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------
# variable-length batches
# ---------------------------------------------------------------------------
LENS_Q, LENS_K = [5, 0, 9, 3], [7, 4, 9, 1]     # an empty sequence and one with Nq > Nk


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("options", [
    {"causal": True},
    {"causal": True, "window_size": (2, 0), "alibi": "batch"},
    {"softcap": 4.0, "alibi": "heads", "softmax_scale": 0.5},
], ids=["causal", "window-alibi", "softcap"])
def test_varlen_against_per_sequence_reference(rng, options):
    H, Hk, D = 4, 2, 16
    options = dict(options)
    slopes = _alibi(options.pop("alibi", None), len(LENS_Q), H)
    q = randn(rng, sum(LENS_Q), H, D)
    k, v = randn(rng, sum(LENS_K), Hk, D), randn(rng, sum(LENS_K), Hk, D)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                                  alibi_slopes=slopes, return_attn_probs=True,
                                                  **options)
    assert lse.shape == (H, sum(LENS_Q)) and lse.is_contiguous() and s_dmask.numel() == 0
    refs, ref_lse = [], []
    for b in range(len(LENS_Q)):
        qb = q[cu_q[b]:cu_q[b + 1]][None]
        kb, vb = k[cu_k[b]:cu_k[b + 1]][None], v[cu_k[b]:cu_k[b + 1]][None]
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b:b + 1])
        o, l_, _ = fa2_reference(qb, kb, vb, alibi_slopes=sb, **options)
        refs.append(o[0])
        ref_lse.append(l_[0])
    ref, ref_lse = torch.cat(refs), torch.cat(ref_lse, 1)
    check(out, ref, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    check(lse[finite], ref_lse[finite], "softmax_lse")
    for name, g, r in zip("qkv", grads_of(out, (q, k, v)), grads_of(ref, (q, k, v))):
        check(g, r, f"d{name}")


def test_varlen_dropout_probabilities_follow_the_sequences(rng):
    H, D, p = 2, 8, 0.3
    q, k, v = randn(rng, sum(LENS_Q), H, D), randn(rng, sum(LENS_K), H, D), \
        randn(rng, sum(LENS_K), H, D)
    torch.manual_seed(11)
    out, _, s_dmask = fa.flash_attn_varlen_func(q, k, v, _cu(LENS_Q), _cu(LENS_K), 9, 9,
                                                dropout_p=p, causal=True, return_attn_probs=True)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
    keep = torch.from_numpy(cuflash.dropout_mask((4, H, 9, 9), p, seed))
    assert s_dmask.shape == (4, H, 9, 9)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        kb = keep[b:b + 1, :, :lq, :lk]
        ref, _, ref_p = fa2_reference(q[cu_q[b]:cu_q[b + 1]][None], k[cu_k[b]:cu_k[b + 1]][None],
                                      v[cu_k[b]:cu_k[b + 1]][None], causal=True, keep=kb,
                                      dropout_p=p)
        if lq and (ref_p > 0).any():
            check(out[cu_q[b]:cu_q[b + 1]], ref[0], f"out of sequence {b}")
            check(s_dmask[b, :, :lq, :lk].abs(), ref_p[0], f"|S_dmask| of sequence {b}")
        assert (s_dmask[b, :, lq:] == 0).all() and (s_dmask[b, :, :, lk:] == 0).all()


def test_varlen_packed_forms_and_paged_keys(rng):
    H, D, lens = 4, 8, [6, 2, 9]
    cu, total = _cu(lens), sum(lens)
    qkv = randn(rng, total, 3, H, D)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    q, k, v = qkv.unbind(1)
    assert torch.equal(out, fa.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True))
    kv = randn(rng, total, 2, 2, D)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 9, 9, causal=True)
    assert torch.equal(out, fa.flash_attn_varlen_func(q, *kv.unbind(1), cu, cu, 9, 9,
                                                      causal=True))
    # the same keys in pages of 4 rows, scattered over 9 pages in a shuffled order
    page, k2, v2 = 4, k[:, :2].detach(), v[:, :2].detach()
    table = torch.full((3, 3), 0, dtype=torch.int32)
    k_pages, v_pages = torch.zeros(9, page, 2, D), torch.zeros(9, page, 2, D)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    n = 0
    for b, L in enumerate(lens):
        for p_ in range(math.ceil(L / page)):
            phys = int(order[n])
            n += 1
            table[b, p_] = phys
            rows = slice(int(cu[b]) + p_ * page, int(cu[b]) + min(L, (p_ + 1) * page))
            k_pages[phys, :rows.stop - rows.start] = k2[rows]
            v_pages[phys, :rows.stop - rows.start] = v2[rows]
    paged = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 9, 9, causal=True,
                                      block_table=table)
    check(paged, fa.flash_attn_varlen_func(q, k2, v2, cu, cu, 9, 9, causal=True), "paged")


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------
def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotary embedding through complex numbers: pairs (2i, 2i+1) or (i, i + r/2)."""
    half = cos.shape[1]
    x = x.double()
    r = x[..., :2 * half]
    a, b = (r[..., 0::2], r[..., 1::2]) if interleaved else (r[..., :half], r[..., half:])
    theta = torch.complex(cos.double(), sin.double())[positions][:, :, None]   # (B, N, 1, half)
    z = torch.complex(a, b) * theta
    rot = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
           else torch.cat((z.real, z.imag), -1))
    return torch.cat((rot, x[..., 2 * half:]), -1)


def kv_reference(q, k_rows, v_rows, **options):
    """Dense reference of one sequence: q (1, Nq, H, D) against its rows (L, Hk, D)."""
    return fa2_reference(q, k_rows[None], v_rows[None], **options)


@pytest.mark.parametrize("case", ["contiguous", "paged", "batch_idx", "leftpad", "rotary",
                                  "rotary_halves_noncausal"])
def test_with_kvcache_against_reference(rng, case):
    B, H, Hk, D, cap, Nq = 2, 4, 2, 16, 16, 3
    lens = torch.tensor([5, 9], dtype=torch.int32)
    q = randn(rng, B, Nq, H, D, grad=False)
    k_new, v_new = randn(rng, B, 2, Hk, D, grad=False), randn(rng, B, 2, Hk, D, grad=False)
    rows = randn(rng, 3, cap, Hk, D, grad=False), randn(rng, 3, cap, Hk, D, grad=False)
    kw = dict(causal=case != "rotary_halves_noncausal", window_size=(6, -1), softcap=0.0,
              alibi_slopes=_alibi("heads", B, H))
    if case == "contiguous":
        kw["softcap"] = 3.0
    if case == "rotary_halves_noncausal":   # neither causal nor local: q rotated at one position
        kw["window_size"] = (-1, -1)
    k_cache, v_cache = (r.clone() for r in rows)
    cache_rows = [0, 1]          # the cache row of each sequence
    extra = {}
    leftpad = torch.zeros(B, dtype=torch.int32)
    if case == "paged":          # pages of 4 rows, physical pages reversed
        page = 4
        table = torch.tensor([[3, 2, 1, 0], [7, 6, 5, 4]], dtype=torch.int32)
        k_cache = torch.zeros(8, page, Hk, D)
        v_cache = torch.zeros(8, page, Hk, D)
        for b in range(B):
            for p_ in range(cap // page):
                k_cache[table[b, p_]] = rows[0][b, p_ * page:(p_ + 1) * page]
                v_cache[table[b, p_]] = rows[1][b, p_ * page:(p_ + 1) * page]
        extra["block_table"] = table
    if case == "batch_idx":
        cache_rows = [2, 0]
        extra["cache_batch_idx"] = torch.tensor(cache_rows, dtype=torch.int32)
    if case == "leftpad":
        leftpad = torch.tensor([2, 0], dtype=torch.int32)
        extra["cache_leftpad"] = leftpad
    cos = sin = None
    if case.startswith("rotary"):
        angles = torch.rand(cap + 4, 4, generator=torch.Generator().manual_seed(3)) * 6
        cos, sin = angles.cos(), angles.sin()
        if case == "rotary":    # positions count from the first valid key
            leftpad = torch.tensor([1, 0], dtype=torch.int32)
        extra.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=case == "rotary",
                     cache_leftpad=leftpad)
    before = (k_cache.clone(), v_cache.clone())
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                          return_softmax_lse=True, **kw, **extra)
    for b in range(B):
        L, lp = int(lens[b]) + 2, int(leftpad[b])
        kb, vb = rows[0][cache_rows[b]].clone(), rows[1][cache_rows[b]].clone()
        qb, knb = q[b:b + 1], k_new[b:b + 1]
        if cos is not None:
            start = int(lens[b]) - lp
            knb = rotary_reference(knb, cos, sin, torch.arange(2)[None] + start, case == "rotary")
            local = kw["causal"] or kw["window_size"] != (-1, -1)
            q_pos = torch.arange(Nq) if local else torch.zeros(Nq, dtype=torch.long)
            qb = rotary_reference(qb, cos, sin, q_pos[None] + start, case == "rotary")
        kb[int(lens[b]):L] = knb[0].float()
        vb[int(lens[b]):L] = v_new[b]
        ref, ref_lse, _ = kv_reference(qb, kb[lp:L], vb[lp:L], **kw)
        check(out[b:b + 1], ref, f"out of sequence {b}")
        check(lse[b:b + 1], ref_lse, f"softmax_lse of sequence {b}")
        # the new keys and values were written at cache_seqlens[b] of the sequence's rows
        for n in range(2):
            r = int(lens[b]) + n
            where = ((int(extra["block_table"][b, r // 4]), r % 4) if case == "paged"
                     else (cache_rows[b], r))
            written[where] = True
            check(k_cache[where], kb[r], f"k_cache row {r} of sequence {b}", 1e-6)
            check(v_cache[where], vb[r], f"v_cache row {r} of sequence {b}", 1e-6)
    # and nothing else was touched
    assert torch.equal(k_cache[~written], before[0][~written])
    assert torch.equal(v_cache[~written], before[1][~written])


def test_with_kvcache_defaults_and_splits(rng):
    """cache_seqlens as an int and as None (the whole cache); num_splits 0, 1 and 3 agree."""
    B, H, D, cap = 2, 2, 8, 24
    k_cache, v_cache = randn(rng, B, cap, H, D, grad=False), randn(rng, B, cap, H, D, grad=False)
    q = randn(rng, B, 1, H, D, grad=False)
    whole = fa.flash_attn_with_kvcache(q, k_cache, v_cache)
    check(whole, fa2_reference(q, k_cache, v_cache)[0], "cache_seqlens=None")
    as_int = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, causal=True)
    check(as_int, fa2_reference(q, k_cache[:, :10], v_cache[:, :10], causal=True)[0],
          "cache_seqlens=10")
    runs = [fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cap, num_splits=n)
            for n in (0, 1, 3)]
    for r in runs[1:]:
        check(r, runs[0], "num_splits", 1e-6)


def test_deterministic_backward_is_repeatable(rng):
    q, k, v = randn(rng, 1, 9, 4, 8), randn(rng, 1, 13, 2, 8), randn(rng, 1, 13, 2, 8)
    g = [grads_of(fa.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v))
         for _ in range(2)]
    for a, b in zip(*g):
        assert torch.equal(a, b)


def test_errors_name_the_argument(rng):
    q, k = randn(rng, 1, 5, 2, 8), randn(rng, 1, 7, 2, 8)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        fa.flash_attn_func(q[0], k, k)
    with pytest.raises(ValueError, match="window"):
        fa.flash_attn_func(q, k, k, window_size=(1.5, 0))
    cu = torch.tensor([0, 5], dtype=torch.int64)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32"):
        fa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu.int(), 5, 7)
    kc = torch.zeros(1, 8, 2, 8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot be combined"):
        fa.flash_attn_with_kvcache(q, kc, kc, block_table=table,
                                   cache_batch_idx=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        fa.flash_attn_with_kvcache(q, kc, kc, k[:, :1], k[:, :1])
    with pytest.raises(ValueError, match="capacity|exceed|beyond"):   # nothing is written
        fa.flash_attn_with_kvcache(q, kc, kc, k[:, :2], k[:, :2], cache_seqlens=7)
    assert (kc == 0).all()


def test_compiles_without_graph_breaks(rng):
    torch._dynamo.reset()
    q, k, v = randn(rng, 2, 9, 4, 8), randn(rng, 2, 13, 2, 8), randn(rng, 2, 13, 2, 8)
    cu = _cu([4, 5])

    def f(q, k, v):
        dense = fa.flash_attn_func(q, k, v, causal=True, window_size=(4, 0), softcap=3.0)
        packed = fa.flash_attn_varlen_func(q[0], k[0, :9], v[0, :9], cu, cu, 5, 5, causal=True)
        return dense.sum() + packed.square().sum()
    fn = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = fn(q, k, v)
    got_g = torch.autograd.grad(got, (q, k, v))
    want = f(q, k, v)
    want_g = torch.autograd.grad(want, (q, k, v))
    assert torch.equal(got, want)
    for a, b in zip(got_g, want_g):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_tensors_match_cpu():
    if not torch.cuda.is_available() or not cuflash.available_backends()["cuda"][0]:
        pytest.skip("needs a GPU with cuflash's cuda backend")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float32).to(torch.bfloat16)
               for s in ((2, 65, 8, 64), (2, 97, 2, 64), (2, 97, 2, 64)))
    ref = fa2_reference(q, k, v, causal=True, window_size=(32, 0), softcap=20.0)[0]
    out = fa.flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=True, window_size=(32, 0),
                             softcap=20.0)
    check(out.cpu().float(), ref.float(), "bfloat16 on CUDA", 2e-2)
    k_cache, v_cache = torch.zeros(2, 128, 2, 64, device="cuda"), torch.zeros(
        2, 128, 2, 64, device="cuda")
    lens = torch.tensor([5, 97], dtype=torch.int32, device="cuda")
    out = fa.flash_attn_with_kvcache(q[:, :1].float().cuda(), k_cache, v_cache,
                                     k[:, :1].float().cuda(), v[:, :1].float().cuda(),
                                     cache_seqlens=lens, causal=True)
    assert out.shape == (2, 1, 8, 64) and bool((k_cache[1, 97] != 0).any())

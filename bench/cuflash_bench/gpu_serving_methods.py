"""Problems, cache layouts and methods of the GPU benchmark's serving sections.

Two kinds of problem (``gpu_serving.py`` runs them):

* **KV-cache decode** (:class:`KVProblem`): B sequences whose cache holds
  ``L = Nk - Nq`` tokens; a call appends ``Nq`` new tokens (``k_new``/``v_new``)
  and the ``Nq`` queries attend over all ``Nk`` keys, causal bottom-right.
  Every method gets the same logical inputs (:func:`kv_arrays`) and lays them
  out its own way: cuflash's contiguous ``(B, Hk, capacity, d)`` cache or
  pages ``(num_pages, Hk, page, d)`` with a shuffled block table,
  flash-attn's ``(B, capacity, Hk, d)`` / ``(num_pages, page, Hk, d)``, vLLM's
  ``(num_pages, Hk, d/x, page, x)`` keys and ``(num_pages, Hk, d, page)`` values.
* **Varlen** (:class:`VarlenSet`): sequences packed without padding,
  ``(total, H, d)`` arrays and ``cu_seqlens``, the layout cuflash and
  ``flash_attn_varlen_func`` share, so both read the very same arrays.

The KV methods: ``unavailable(prob, device)`` (a reason or None),
``context()``, ``prepare(device, prob, arrays, seed)`` (this method's
layout, from arrays it may modify), ``call(state)`` (one timed call) and
``result(state, out)`` (the output as ``(B, H, Nq, dv)``).  The varlen
methods have the grid methods' interface (``forward``, ``output``,
``backward``).  flash-attn and vLLM are optional: without them (or on the
emulator, whose arrays live on the host) they say why, and nothing else
changes.
"""
import contextlib
import inspect
import math
from types import SimpleNamespace

import numpy as np

from .gpu_check import np_dtype

__all__ = ["KVProblem", "kv_arrays", "page_table", "to_pages", "kv_methods", "VarlenSet",
           "varlen_set", "CuflashVarlen", "FlashAttnVarlen", "GPU_ONLY"]

GPU_ONLY = "runs on a GPU only (the emulator backend works on host arrays)"
FLASH_DTYPES = ("float16", "bfloat16")


def _raw(a):
    """``a`` viewed as unsigned integers of its item size: copies and transposes of any dtype
    (bfloat16 included, which CuPy knows only as a view) are then plain byte moves."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _contiguous(xp, a):
    """A C-contiguous copy of a (possibly transposed) view, dtype kept."""
    return xp.ascontiguousarray(_raw(a)).view(a.dtype)


# ---------------------------------------------------------------------------
# KV-cache problems
# ---------------------------------------------------------------------------
class KVProblem:
    """B sequences of ``Nk`` keys after appending ``Nq`` new tokens to a cache of ``Nk - Nq``.

    ``capacity`` (default ``Nk``): rows per sequence of the contiguous cache;
    the checks leave a few rows spare so that the lengths, not the array's
    end, must stop a kernel.
    """

    def __init__(self, B, H, Hk, Nq, Nk, d, dtype, capacity=None):
        if not 1 <= Nq <= Nk:
            raise ValueError(f"KV-cache problem needs 1 <= Nq <= Nk, got Nq={Nq} Nk={Nk}")
        self.B, self.H, self.Hk, self.Nq, self.Nk, self.d = B, H, Hk, Nq, Nk, d
        self.dtype, self.Nnew, self.L = dtype, Nq, Nk - Nq
        self.capacity = Nk if capacity is None else capacity
        self.itemsize = np_dtype(dtype).itemsize

    @property
    def kv_bytes(self):
        """Bytes of K and V a call must read at least once: every sequence's Nk keys and
        values of every kv head (q, o and the append are not counted)."""
        return self.B * self.Hk * self.Nk * 2 * self.d * self.itemsize

    def shape(self):
        return {"B": self.B, "H": self.H, "Hk": self.Hk, "Nq": self.Nq, "Nk": self.Nk,
                "d": self.d}


def kv_arrays(device, prob, seed, host=False):
    """The logical decode inputs of ``prob`` as backend arrays (a dict).

    ``q`` (B, H, Nq, d); ``k_cache``/``v_cache`` (B, Hk, capacity, d) with
    random values in *every* row, those from ``L`` on included, so a method
    that does not write the new tokens reads wrong keys and fails its check;
    ``k_new``/``v_new`` (B, Hk, Nq, d); ``seqlens`` (B,) int32, all ``L``.
    ``host=True`` draws with NumPy and also returns the host copies (for the
    oracle): ``(arrays, host)``.
    """
    B, H, Hk, Nq, d = prob.B, prob.H, prob.Hk, prob.Nq, prob.d
    shapes = {"q": (B, H, Nq, d), "k_cache": (B, Hk, prob.capacity, d),
              "v_cache": (B, Hk, prob.capacity, d), "k_new": (B, Hk, Nq, d),
              "v_new": (B, Hk, Nq, d)}
    lens = np.full(B, prob.L, np.int32)
    if host:
        rng = np.random.default_rng(seed)
        h = {n: rng.standard_normal(s, dtype=np.float32).astype(np_dtype(prob.dtype))
             for n, s in shapes.items()}
        h["seqlens"] = lens
        return {n: device.from_host(a) for n, a in h.items()}, h
    out = {n: device.random(s, prob.dtype, seed * 8 + i) for i, (n, s) in enumerate(shapes.items())}
    out["seqlens"] = device.from_host(lens)
    return out


def page_table(prob, page, seed):
    """A block table (B, ceil(capacity / page)) int32 naming every page once, shuffled
    (seeded): logically adjacent pages are scattered over the cache, as in a server."""
    P = -(-prob.capacity // page)
    return np.random.default_rng(seed).permutation(prob.B * P).reshape(prob.B, P).astype(np.int32)


def to_pages(device, cache, page, table):
    """The contiguous cache (B, Hk, capacity, d) as pages (B * P, Hk, page, d): logical page
    p of sequence b goes to physical page ``table[b, p]``; rows past the capacity are 0."""
    xp = device.xp
    B, Hk, cap, d = cache.shape
    P = table.shape[1]
    r = _raw(cache)
    if P * page != cap:
        full = xp.zeros((B, Hk, P * page, d), r.dtype)
        full[:, :, :cap] = r
        r = full
    logical = r.reshape(B, Hk, P, page, d).transpose(0, 2, 1, 3, 4).reshape(B * P, Hk, page, d)
    out = xp.empty(logical.shape, logical.dtype)  # C order (empty_like would keep a view's)
    out[device.from_host(table.reshape(-1).astype(np.int64))] = logical
    return out.view(cache.dtype)


def _write_new(prob, a):
    """Put the new tokens into the contiguous cache at rows L.. (for the methods that read a
    cache slice and do not append themselves)."""
    for c, n in (("k_cache", "k_new"), ("v_cache", "v_new")):
        _raw(a[c])[:, :, prob.L:prob.L + prob.Nnew] = _raw(a[n])


# ---------------------------------------------------------------------------
# optional libraries
# ---------------------------------------------------------------------------
_IMPORTS = {}


def _import(what):
    """(module, None) or (None, why) for "flash_attn" or "vllm" (imported once)."""
    if what not in _IMPORTS:
        try:
            if what == "flash_attn":
                import flash_attn as mod
                mod.flash_attn_with_kvcache, mod.flash_attn_varlen_func  # noqa: B018
            else:
                from vllm import _custom_ops as mod
                mod.paged_attention_v1, mod.paged_attention_v2, mod.reshape_and_cache  # noqa
            _IMPORTS[what] = (mod, None)
        except Exception as e:  # ImportError, a missing symbol, a broken CUDA build: say which
            pip = "flash-attn" if what == "flash_attn" else "vllm"
            msg = (str(e).strip().splitlines() or [""])[0][:200]
            _IMPORTS[what] = (None, f"{what} not importable ({type(e).__name__}: {msg}; "
                                    f"pip install {pip})")
    return _IMPORTS[what]


def _torch_lib_unavailable(device, torch_, what, dtype=None, dtypes=FLASH_DTYPES):
    if device.backend != "cuda":
        return GPU_ONLY
    if not torch_.ok:
        return torch_.why
    if dtype is not None and dtype not in dtypes:
        return f"{what} supports {' and '.join(dtypes)} only"
    return _import(what)[1]


# ---------------------------------------------------------------------------
# KV-cache methods
# ---------------------------------------------------------------------------
class CuflashKV:
    """cuflash.attention_with_kvcache: append Nq tokens and attend, one call."""

    lib = "cuflash"

    def __init__(self, backend, page=None, check=False):
        import cuflash
        self.cf, self.backend, self.page, self.check = cuflash, backend, page, check
        self.name = ("cuflash kvcache" + (f" paged {page}" if page else "")
                     + (" (check_inputs)" if check else ""))

    def unavailable(self, prob, device):
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, device, prob, a, seed):
        st = SimpleNamespace(q=a["q"], kc=a["k_cache"], vc=a["v_cache"], kn=a["k_new"],
                             vn=a["v_new"], sl=a["seqlens"], bt=None)
        if self.page:
            table = page_table(prob, self.page, seed)
            st.kc, st.vc = (to_pages(device, c, self.page, table) for c in (st.kc, st.vc))
            st.bt = device.from_host(table)
        return st

    def call(self, st):
        # check_inputs=False is how a decode loop runs it: no host copy of the lengths
        return self.cf.attention_with_kvcache(
            st.q, st.kc, st.vc, cache_seqlens=st.sl, k_new=st.kn, v_new=st.vn,
            block_table=st.bt, causal=True, check_inputs=self.check, backend=self.backend)

    def result(self, st, out):
        return out


class CuflashTiledSlice:
    """cuflash.tiled_attention on the cache slice [:, :, :Nk] (split-KV chosen by cuflash)."""

    name, lib = "cuflash tiled (cache slice)", "cuflash"

    def __init__(self, backend):
        import cuflash
        self.cf, self.backend = cuflash, backend

    def unavailable(self, prob, device):
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, device, prob, a, seed):
        _write_new(prob, a)
        return SimpleNamespace(q=a["q"], k=a["k_cache"][:, :, :prob.Nk],
                               v=a["v_cache"][:, :, :prob.Nk])

    def call(self, st):
        return self.cf.tiled_attention(st.q, st.k, st.v, causal=True, num_splits=None,
                                       backend=self.backend)

    def result(self, st, out):
        return out


class SdpaSlice:
    """torch SDPA (torch's choice of kernel) on the cache slice, one call over the batch:
    q (B, H, Nq, d), k/v (B, Hk, Nk, d); GQA through ``enable_gqa``; Nq > 1 with the
    bottom-right causal mask ``causal_lower_right`` (``is_causal`` is top-left)."""

    name, lib = "sdpa (cache slice)", "torch"

    def __init__(self, torch_):
        self.t = torch_

    def unavailable(self, prob, device):
        if not self.t.ok:
            return self.t.why
        if prob.Nq > 1:
            try:
                from torch.nn.attention.bias import causal_lower_right  # noqa: F401
            except ImportError:
                return (f"torch {self.t.version} has no torch.nn.attention.bias."
                        "causal_lower_right (the bottom-right mask for Nq > 1)")
        return None

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, device, prob, a, seed):
        _write_new(prob, a)
        st = SimpleNamespace(q=self.t.view(a["q"]), k=self.t.view(a["k_cache"][:, :, :prob.Nk]),
                             v=self.t.view(a["v_cache"][:, :, :prob.Nk]), mask=None,
                             kw={"enable_gqa": True} if prob.H != prob.Hk else {})
        if prob.Nq > 1:
            from torch.nn.attention.bias import causal_lower_right
            st.mask = causal_lower_right(prob.Nq, prob.Nk)
        return st

    def call(self, st):
        with self.t.torch.no_grad():
            return self.t.F.scaled_dot_product_attention(st.q, st.k, st.v, attn_mask=st.mask,
                                                         **st.kw)

    def result(self, st, out):
        return out


class FlashAttnKV:
    """flash_attn.flash_attn_with_kvcache with the new tokens (k, v): appends and attends in
    one call, on its own layout: (B, capacity, Hk, d), or pages (num_pages, page, Hk, d)."""

    lib = "flash_attn"

    def __init__(self, torch_, page=None):
        self.t, self.page = torch_, page
        self.name = "flash_attn kvcache" + (f" paged {page}" if page else "")

    def unavailable(self, prob, device):
        return _torch_lib_unavailable(device, self.t, "flash_attn", prob.dtype)

    def context(self):
        return contextlib.nullcontext()

    def prepare(self, device, prob, a, seed):
        xp, tv = device.xp, self.t.view

        def bshd(x):  # (B, H, N, d) -> (B, N, H, d), contiguous
            return tv(_contiguous(xp, x.transpose(0, 2, 1, 3)))
        st = SimpleNamespace(q=bshd(a["q"]), kn=bshd(a["k_new"]), vn=bshd(a["v_new"]),
                             sl=tv(a["seqlens"]), bt=None)
        if self.page:
            table = page_table(prob, self.page, seed)
            st.kc, st.vc = (bshd(to_pages(device, a[c], self.page, table))
                            for c in ("k_cache", "v_cache"))
            st.bt = tv(device.from_host(table))
        else:
            st.kc, st.vc = bshd(a["k_cache"]), bshd(a["v_cache"])
        return st

    def call(self, st):
        fa = _import("flash_attn")[0]
        return fa.flash_attn_with_kvcache(st.q, st.kc, st.vc, k=st.kn, v=st.vn,
                                          cache_seqlens=st.sl, block_table=st.bt, causal=True)

    def result(self, st, out):
        return out.transpose(1, 2)  # (B, Nq, H, d) -> (B, H, Nq, d)


class VllmPaged:
    """vLLM's paged attention: ``reshape_and_cache`` writes the new token, then
    ``paged_attention_v1`` or ``v2`` (vLLM's own rule: v1 when max_seq_len <= 8192 and one
    512-token partition or more than 512 sequence x head pairs), one query per sequence."""

    lib = "vllm"
    PARTITION = 512  # vLLM's PARTITION_SIZE of paged_attention_v2

    def __init__(self, torch_, page):
        self.t, self.page = torch_, page
        self.name = f"vllm paged {page}"

    def unavailable(self, prob, device):
        why = _torch_lib_unavailable(device, self.t, "vllm", prob.dtype,
                                     ("float16", "bfloat16", "float32"))
        if why is None and prob.Nq != 1:
            why = "vLLM's paged_attention kernels take one query per sequence (Nq = 1 only)"
        return why

    def context(self):
        return contextlib.nullcontext()

    def _scale_arg(self, ops, fn):
        """k_scale/v_scale: a float in older vLLM, a float32 tensor in newer (the annotation
        says which); 1.0 either way (no fp8 cache)."""
        param = inspect.signature(getattr(ops, fn)).parameters.get("k_scale")
        if param is not None and (param.annotation is float or param.annotation == "float"):
            return 1.0
        return self.t.torch.ones((), dtype=self.t.torch.float32, device="cuda")

    def prepare(self, device, prob, a, seed):
        ops, tv, torch = _import("vllm")[0], self.t.view, self.t.torch
        xp, p, d = device.xp, self.page, prob.d
        table = page_table(prob, p, seed)
        x = 16 // prob.itemsize  # vLLM packs x head-dim elements of a key together
        if d % x:
            raise ValueError(f"vLLM's key cache needs the head dim {d} to be a multiple of {x}")
        kp, vp = (to_pages(device, a[c], p, table) for c in ("k_cache", "v_cache"))
        n = kp.shape[0]
        kc = _contiguous(xp, kp.reshape(n, prob.Hk, p, d // x, x).transpose(0, 1, 3, 2, 4))
        vc = _contiguous(xp, vp.transpose(0, 1, 3, 2))
        slot = table[:, prob.L // p].astype(np.int64) * p + prob.L % p  # where the token goes
        B, H = prob.B, prob.H
        st = SimpleNamespace(
            ops=ops, q=tv(a["q"]).reshape(B, H, d), kn=tv(a["k_new"]).reshape(B, prob.Hk, d),
            vn=tv(a["v_new"]).reshape(B, prob.Hk, d), kc=tv(kc), vc=tv(vc),
            slot=tv(device.from_host(slot)), bt=tv(device.from_host(table)),
            lens=tv(device.from_host(np.full(B, prob.Nk, np.int32))), Hk=prob.Hk,
            scale=1.0 / math.sqrt(d), max_len=prob.Nk,
            ks=self._scale_arg(ops, "paged_attention_v1"),
            cache_scale=self._scale_arg(ops, "reshape_and_cache"))
        st.out = torch.empty_like(st.q)
        parts = -(-prob.Nk // self.PARTITION)
        st.v1 = prob.Nk <= 8192 and (parts == 1 or B * H > 512)
        if not st.v1:
            st.tmp = torch.empty((B, H, parts, d), dtype=st.q.dtype, device=st.q.device)
            st.sums = torch.empty((B, H, parts), dtype=torch.float32, device=st.q.device)
            st.maxs = torch.empty_like(st.sums)
        return st

    def call(self, st):
        st.ops.reshape_and_cache(st.kn, st.vn, st.kc, st.vc, st.slot, "auto", st.cache_scale,
                                 st.cache_scale)
        common = (st.q, st.kc, st.vc, st.Hk, st.scale, st.bt, st.lens, self.page, st.max_len,
                  None, "auto", st.ks, st.ks)
        if st.v1:
            st.ops.paged_attention_v1(st.out, *common)
        else:
            st.ops.paged_attention_v2(st.out, st.sums, st.maxs, st.tmp, *common)
        return st.out

    def result(self, st, out):
        return out[:, :, None, :]


def kv_methods(backend, torch_, page_sizes):
    """The KV-cache methods in table order (the optional ones even when absent: they say why)."""
    out = [CuflashKV(backend), CuflashKV(backend, check=True)]
    out += [CuflashKV(backend, page=p) for p in page_sizes]
    out += [CuflashTiledSlice(backend)]
    if torch_.why != "left out (--no-torch)":
        out += [SdpaSlice(torch_), FlashAttnKV(torch_)]
        out += [FlashAttnKV(torch_, page=p) for p in page_sizes]
        out += [VllmPaged(torch_, p) for p in page_sizes]
    return out


# ---------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------
class VarlenSet:
    """A packed batch: q, k, v, do (total, H, d), cu_seqlens (B + 1,) int32 on the backend,
    the lengths on the host, and torch views (or None)."""

    def __init__(self, q, k, v, do, cu, lens, causal, torch_):
        self.q, self.k, self.v, self.do, self.cu, self.causal = q, k, v, do, cu, causal
        self.lens = np.asarray(lens, np.int64)
        self.max_len = int(self.lens.max()) if self.lens.size else 0
        self.tq = self.tk = self.tv = self.tdo = self.tcu = None
        if torch_ is not None and torch_.ok:
            self.tq, self.tk, self.tv = (torch_.view(a, grad=True) for a in (q, k, v))
            self.tdo, self.tcu = torch_.view(do), torch_.view(cu)

    @property
    def nbytes(self):
        return sum(int(a.nbytes) for a in (self.q, self.k, self.v, self.do))


def varlen_set(device, torch_, lens, H, d, dtype, causal, seed, host=False):
    """Random packed inputs for sequences of ``lens``; ``host`` draws them with NumPy and also
    returns the host arrays ``(q, k, v, do)`` and ``cu`` for the oracle."""
    total = int(np.sum(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    shape = (total, H, d)
    if host:
        rng = np.random.default_rng(seed)
        arrs = [rng.standard_normal(shape, dtype=np.float32).astype(np_dtype(dtype))
                for _ in range(4)]
        x = VarlenSet(*(device.from_host(a) for a in arrs), device.from_host(cu), lens, causal,
                      torch_)
        return x, arrs, cu
    return VarlenSet(*(device.random(shape, dtype, seed * 4 + i) for i in range(4)),
                     device.from_host(cu), lens, causal, torch_)


class CuflashVarlen:
    """cuflash.varlen_attention / varlen_attention_backward with max_seqlen given and
    check_inputs=False, as a training step runs them (flash-attn checks nothing either)."""

    lib = "cuflash"

    def __init__(self, backend, name="cuflash varlen"):
        import cuflash
        self.cf, self.backend, self.name = cuflash, backend, name

    def unavailable(self, x, device, grad):
        return None

    def context(self):
        return contextlib.nullcontext()

    def forward(self, x, grad):
        return self.cf.varlen_attention(x.q, x.k, x.v, x.cu, x.cu, max_seqlen_q=x.max_len,
                                        max_seqlen_k=x.max_len, causal=x.causal,
                                        return_lse=grad, check_inputs=False,
                                        backend=self.backend)

    def output(self, state):
        return state[0] if isinstance(state, tuple) else state

    def backward(self, x, state, retain=False):
        o, lse = state
        return self.cf.varlen_attention_backward(
            x.do, x.q, x.k, x.v, o, lse, x.cu, x.cu, max_seqlen_q=x.max_len,
            max_seqlen_k=x.max_len, causal=x.causal, check_inputs=False, backend=self.backend)


class FlashAttnVarlen:
    """flash_attn.flash_attn_varlen_func on the same packed arrays (torch views); backward
    through torch.autograd.grad."""

    name, lib = "flash_attn varlen", "flash_attn"

    def __init__(self, torch_):
        self.t = torch_

    def unavailable(self, x, device, grad):
        return _torch_lib_unavailable(device, self.t, "flash_attn", str(x.q.dtype))

    def context(self):
        return contextlib.nullcontext()

    def forward(self, x, grad):
        fa = _import("flash_attn")[0]
        with (contextlib.nullcontext() if grad else self.t.torch.no_grad()):
            return fa.flash_attn_varlen_func(x.tq, x.tk, x.tv, x.tcu, x.tcu, x.max_len,
                                             x.max_len, causal=x.causal)

    def output(self, state):
        return state

    def backward(self, x, state, retain=False):
        return self.t.torch.autograd.grad(state, (x.tq, x.tk, x.tv), x.tdo, retain_graph=retain)

"""cuflash.emulator: TMA copies (cp.async.bulk.tensor) of kernels_cu/hopper.cuh, with the tensor
maps of cuflash.launch.tma.

The box lands in shared memory as the CUDA driver documents it (rows of box[0] elements, the
16-byte chunks of each row swizzled by the address bits, zeros outside the tensor), checked
byte for byte against an image this file builds; a TMA-loaded 128-byte-swizzled tile read by
wgmma; the copy's asynchrony (NaN and a memcheck error before the wait) and the errors.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from cuflash import emulator as em
from cuflash import emulator_backend
from cuflash.launch.tma import tensor_map

SRC = Path(__file__).resolve().parent / "kernels" / "tma.cu"
ROOT = SRC.parents[3]


@pytest.fixture(scope="module")
def mod():
    return em.RawModule(path=SRC, options=("-arch=sm_90a",))


@pytest.fixture(scope="module")
def rt():
    return emulator_backend.runtime()


def expected_image(x, box, coords, swizzle):
    """The box at coords (innermost first) as TMA writes it: rows of box[-1] elements, zero
    outside x, each row's 16-byte chunks XOR-ed with (row address >> 7) % (swizzle / 16)."""
    rank = x.ndim
    sub = np.zeros(box, x.dtype)
    lo = [coords[rank - 1 - a] for a in range(rank)]  # per axis of x
    src = tuple(slice(max(0, lo[a]), max(0, min(x.shape[a], lo[a] + box[a]))) for a in range(rank))
    dst = tuple(slice(s.start - lo[a], s.stop - lo[a]) if s.stop > s.start else slice(0, 0) for a, s in enumerate(src))
    sub[dst] = x[src]
    raw = np.frombuffer(sub.tobytes(), np.uint8)
    if swizzle == 0:
        return raw
    out = np.empty_like(raw)
    for chunk in range(raw.size // 16):
        a = chunk * 16
        p = a ^ (((a >> 7) & (swizzle // 16 - 1)) << 4)
        out[p:p + 16] = raw[a:a + 16]
    return out


def run_box(mod, rt, x, box, coords, swizzle, mode=0, dst_off=1024, buffer=None):
    """The box's shared bytes; `buffer`: the array x views, passed to the launch in its place."""
    tm = tensor_map(rt, x, box, swizzle=swizzle)
    nbytes = int(np.prod(box)) * x.dtype.itemsize
    out = np.zeros(nbytes, np.uint8)
    kern = mod.get_function(f"tma_box{x.ndim}")
    kern(1, 64, (tm, x if buffer is None else buffer, np.array(coords, np.int32), np.int32(nbytes), np.int32(dst_off), out, np.int32(mode)),
         shared_mem=dst_off + nbytes + 1024)
    return out


@pytest.mark.parametrize("swizzle", [0, 32, 64, 128])
@pytest.mark.parametrize("coords", [(0, 0), (16, 40), (-8, -3), (48, 93)])
def test_2d_box(mod, rt, swizzle, coords):
    rng = np.random.default_rng(abs(hash((swizzle, coords))) % 1000)
    x = rng.standard_normal((100, 80)).astype(np.float16)
    cols = max(8, swizzle // 2)
    box = (16, cols)
    out = run_box(mod, rt, x, box, coords, swizzle)
    np.testing.assert_array_equal(out, expected_image(x, box, coords, swizzle))


def test_3d_strided_view(mod, rt):
    """A view whose outer strides are not the packed ones (every other row of a larger array)."""
    base = np.random.default_rng(1).standard_normal((4, 60, 64)).astype(np.float32)
    x = base[:, ::2, :]          # strides (15360, 512, 4): multiples of 16
    box = (2, 8, 16)             # 16 float32 = 64 bytes per row
    coords = (32, 26, 1)         # innermost first: column 32, row 26, plane 1 (rows 26..33: past the end)
    out = run_box(mod, rt, x, box, coords, 64, buffer=base)
    np.testing.assert_array_equal(out, expected_image(x, box, coords, 64))


def test_tma_then_wgmma(mod, rt):
    rng = np.random.default_rng(2)
    a = (rng.integers(-3, 4, (64, 64)) * 0.25).astype(np.float16)
    b = (rng.integers(-3, 4, (64, 64)) * 0.25).astype(np.float16)
    out = np.zeros(128 * 32, np.float32)
    mod.get_function("tma_wgmma")(1, 128, (tensor_map(rt, a, (64, 64), swizzle=128),
                                           tensor_map(rt, b, (64, 64), swizzle=128), a, b, out),
                                  shared_mem=2048 + 2 * 64 * 128)
    tid = np.arange(128)[:, None]
    i = np.arange(32)[None, :]
    lane = tid % 32
    row = 16 * (tid // 32) + lane // 4 + 8 * ((i >> 1) & 1)
    col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
    want = (a.astype(np.float64) @ b.astype(np.float64).T)[row, col]
    np.testing.assert_array_equal(out.reshape(want.shape), want)


def test_read_before_the_wait(mod, rt):
    x = np.ones((16, 64), np.float16)
    with em.memcheck():
        with pytest.raises(em.MemcheckError, match="cp.async.bulk"):
            run_box(mod, rt, x, (16, 64), (0, 0), 128, mode=1)


def test_errors(mod, rt):
    x = np.zeros((32, 64), np.float16)
    with pytest.raises(ValueError, match=r"rows are 64 bytes with swizzle=128 \(must be equal\)"):
        tensor_map(rt, x, (8, 32), swizzle=128)
    with pytest.raises(ValueError, match="last axis must be contiguous"):
        tensor_map(rt, x[:, ::2], (8, 16))
    with pytest.raises(ValueError, match="each size 1..256"):
        tensor_map(rt, np.zeros((300, 64), np.float16), (300, 64))
    with pytest.raises(em.LaunchError, match=r"destination \(shared byte 1040\) is not 1024-byte aligned"):
        run_box(mod, rt, x, (8, 64), (0, 0), 128, dst_off=1040)
    with pytest.raises(em.LaunchError, match="a 2-d copy with a rank-3 tensor map"):
        tm = tensor_map(rt, np.zeros((2, 8, 64), np.float16), (1, 8, 64))
        mod.get_function("tma_box2")(1, 32, (tm, x, np.zeros(2, np.int32), np.int32(1024), np.int32(1024),
                                             np.zeros(1024, np.uint8), np.int32(0)), shared_mem=3072)
    with pytest.raises(em.LaunchError, match="not a tensor map made for the emulator"):
        bogus = tensor_map(rt, x, (8, 64)).copy()
        bogus[0] = 0
        tm = np.zeros(192, np.uint8)
        off = (-tm.ctypes.data) % 64
        tm = tm[off:off + 128]
        tm[:] = bogus
        mod.get_function("tma_box2")(1, 32, (tm, x, np.zeros(2, np.int32), np.int32(1024), np.int32(1024),
                                             np.zeros(1024, np.uint8), np.int32(0)), shared_mem=3072)


def test_nvrtc_sm90a_machine_code(sm90_nvrtc):
    _nvrtc, _sass = sm90_nvrtc
    r = _nvrtc.compile(SRC.read_text(), SRC.name, options=("-arch=sm_90a", f"-I{ROOT / 'kernels_cu'}", "-std=c++17"))
    assert r.warnings == []
    sass = _sass.disassemble(r.cubin)
    ops = set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)", sass))
    print(sorted(o for o in ops if o.startswith(("UTMA", "HGMMA", "SYNCS"))))
    assert any(o.startswith("UTMALDG.2D") for o in ops)
    assert any(o.startswith("UTMALDG.3D") for o in ops)
    assert any(o.startswith("HGMMA.64x64x16.F32") for o in ops)


@pytest.mark.cuda
def test_gpu_matches_the_emulator(mod, rt):
    """On a GPU (sm_90): the driver's tensor map and the hardware's copy give the emulator's image."""
    cp = pytest.importorskip("cupy")
    from cuflash import cuda_backend
    grt = cuda_backend.runtime()
    if cp.cuda.Device().compute_capability < "90":
        pytest.skip("needs sm_90")
    gmod = cp.RawModule(code=SRC.read_text(), options=("-arch=sm_90a", f"-I{ROOT / 'kernels_cu'}", "-std=c++17"))
    x = np.random.default_rng(3).standard_normal((100, 80)).astype(np.float16)
    for swizzle, coords in ((0, (16, 40)), (128, (-8, 93)), (64, (0, 0))):
        box = (16, max(8, swizzle // 2))
        nbytes = int(np.prod(box)) * 2
        xg = cp.asarray(x)
        out = cp.zeros(nbytes, cp.uint8)
        k = gmod.get_function("tma_box2")
        k.max_dynamic_shared_size_bytes = 2048 + nbytes
        k((1,), (64,), (tensor_map(grt, xg, box, swizzle=swizzle), xg, cp.asarray(np.array(coords, np.int32)),
                        np.int32(nbytes), np.int32(1024), out, np.int32(0)), shared_mem=2048 + nbytes)
        np.testing.assert_array_equal(cp.asnumpy(out), run_box(mod, rt, x, box, coords, swizzle))

"""Tensor maps for the TMA copies of ``kernels_cu/hopper.cuh`` (``tma_load``).

A tensor map describes a strided array to the copy engine: its address, sizes and strides,
the box one copy moves, and the shared-memory swizzle.  On a GPU it is the driver's opaque
``CUtensorMap``, written by ``cuTensorMapEncodeTiled`` (called through ctypes: CuPy does not
expose it); on the emulator it is the emulator's own 128-byte form (``TensorMapEmu`` in
``cuflash/emulator/cuda_host.h``).  Either way it is a 128-byte array on the device, 64-byte
aligned, that a kernel takes as a pointer.
"""
import ctypes
import functools
import struct

import numpy as np

__all__ = ["tensor_map"]

_MAGIC = 0x4D544643  # "CFTM", kTensorMapMagic
# CUtensorMapDataType (cuda.h)
_CU_DTYPES = {"uint8": 0, "uint16": 1, "uint32": 2, "int32": 3, "uint64": 4, "int64": 5, "float16": 6,
              "float32": 7, "float64": 8, "bfloat16": 9}
_CU_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle


def tensor_map(runtime, x, box, *, swizzle=0, shape=None, strides=None):
    """The tensor map of array ``x`` for boxes of shape ``box``.

    Parameters
    ----------
    runtime : cuflash.kernels.Runtime
        The backend's runtime (``"cuda"``: a ``cupy`` array is returned; ``"emulator"``: NumPy).
    x : array
        1 to 5 dimensions; the last axis contiguous, the other strides positive multiples of
        16 bytes, the data 16-byte aligned.  Its dtype's size is the element size.
    box : sequence of int
        Elements per copy along each axis of ``x`` (same order), each 1..256; the last one
        times the element size a multiple of 16 bytes -- and equal to ``swizzle`` when there is
        one (cuflash takes boxes whose rows fill the swizzle span).
    swizzle : {0, 32, 64, 128}
        The shared-memory swizzle (bytes), as wgmma descriptors read it.

    shape, strides : tuple of int, optional
        The tensor the map describes, when it is not ``x``'s own view: its sizes and its
        strides in elements (the last one 1), starting at ``x``'s first element -- a launcher's
        flattened (batch, heads, rows, columns) problem of an input, say.

    A kernel gives coordinates innermost first (``x``'s last axis first).  The array must be
    passed to the launch too: on the emulator memcheck checks the copies against the launch's
    arrays, and on a GPU it keeps ``x`` alive for the launch.
    """
    elem = x.dtype.itemsize
    shape = tuple(x.shape if shape is None else shape)
    byte_strides = tuple(x.strides if strides is None else (int(t) * elem for t in strides))
    rank = len(shape)
    box = tuple(int(b) for b in box)
    dtype = str(x.dtype)
    if not 1 <= rank <= 5:
        raise ValueError(f"tensor_map: x has {rank} dimensions (a tensor map takes 1 to 5)")
    if len(box) != rank:
        raise ValueError(f"tensor_map: box {box} has {len(box)} sizes for an array of {rank} dimensions")
    if dtype not in _CU_DTYPES:
        raise TypeError(f"tensor_map: dtype {dtype} (takes {', '.join(_CU_DTYPES)})")
    if swizzle not in _CU_SWIZZLE:
        raise ValueError(f"tensor_map: swizzle={swizzle!r} (0, 32, 64 or 128 bytes)")
    if len(byte_strides) != rank or byte_strides[-1] != elem:
        raise ValueError(f"tensor_map: the last axis must be contiguous (strides {byte_strides} bytes, "
                         f"element {elem})")
    outer = byte_strides[:-1]
    if any(s <= 0 or s % 16 for s in outer):
        raise ValueError(f"tensor_map: strides {byte_strides} bytes: the outer ones must be positive multiples of 16")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"tensor_map: box {box}: each size 1..256")
    inner = box[-1] * elem
    if inner % 16:
        raise ValueError(f"tensor_map: the box's rows are {inner} bytes (a multiple of 16)")
    if swizzle and inner != swizzle:
        raise ValueError(f"tensor_map: the box's rows are {inner} bytes with swizzle={swizzle} (must be equal)")
    addr = x.data.ptr if runtime.name == "cuda" else x.ctypes.data
    if addr % 16:
        raise ValueError("tensor_map: the data must be 16-byte aligned")
    dims, strides, box_in = shape[::-1], outer[::-1], box[::-1]  # innermost first
    if runtime.name == "cuda":
        return _encode_cuda(runtime, addr, dtype, dims, strides, box_in, swizzle)
    raw = struct.pack("<4IQ5Q4Q5I3I", _MAGIC, elem, rank, swizzle, addr, *_pad(dims, 5), *_pad(strides, 4),
                      *_pad(box_in, 5), 0, 0, 0)
    return _aligned(np.frombuffer(raw, np.uint8))


def _pad(values, n):
    return list(values) + [0] * (n - len(values))


def _aligned(data):
    """A copy of 128 bytes at a 64-byte aligned address (the tensor map's alignment)."""
    buf = np.zeros(data.size + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    out = buf[off:off + data.size]
    out[:] = data
    return out


@functools.lru_cache(maxsize=1)
def _encoder():
    """The driver's cuTensorMapEncodeTiled, typed once (a launcher makes maps on every call)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"tensor_map: the CUDA driver library could not be loaded ({e})") from None
    fn = lib.cuTensorMapEncodeTiled
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                   ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def _encode_cuda(runtime, addr, dtype, dims, strides, box, swizzle):
    fn = _encoder()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rank = len(dims)
    raw = ctypes.create_string_buffer(128 + 64)
    at = ctypes.addressof(raw) + (-ctypes.addressof(raw)) % 64
    rc = fn(ctypes.c_void_p(at), _CU_DTYPES[dtype], rank, ctypes.c_void_p(addr), (u64 * rank)(*dims),
            (u64 * max(1, rank - 1))(*strides), (u32 * rank)(*box), (u32 * rank)(*([1] * rank)),
            0, _CU_SWIZZLE[swizzle], 0, 0)  # no interleave, no L2 promotion, zero fill
    if rc != 0:
        raise RuntimeError(f"tensor_map: cuTensorMapEncodeTiled failed with CUresult {rc} "
                           f"(dims {dims}, strides {strides}, box {box}, swizzle {swizzle})")
    host = np.frombuffer(ctypes.string_at(at, 128), np.uint8)
    return runtime.xp.asarray(host)

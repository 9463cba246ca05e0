// dtype.cuh -- the storage type (elem_t) and compute type (acc_t) of a kernel, chosen by
// one of -DCUFLASH_DTYPE_F16 | _BF16 | _F32 | _F64 (cuflash/kernels.py sets it), and the
// conversions and math every kernel uses on them.  One place, so that all kernels load,
// accumulate and round the same way: float16/bfloat16 are loaded as such and computed in
// float32 (rounded to nearest even on the way out), float32 in float32, float64 in double
// (so float64 results meet the 1e-12 oracle tolerance).
#pragma once
#include "portable.cuh"

#if defined(CUFLASH_DTYPE_F16)
typedef __half elem_t;
typedef float acc_t;
__device__ __forceinline__ elem_t from_acc(acc_t x) { return __float2half(x); }
#elif defined(CUFLASH_DTYPE_BF16)
typedef __nv_bfloat16 elem_t;
typedef float acc_t;
__device__ __forceinline__ elem_t from_acc(acc_t x) { return __float2bfloat16(x); }
#elif defined(CUFLASH_DTYPE_F32)
typedef float elem_t;
typedef float acc_t;
__device__ __forceinline__ elem_t from_acc(acc_t x) { return x; }
#elif defined(CUFLASH_DTYPE_F64)
typedef double elem_t;
typedef double acc_t;
__device__ __forceinline__ elem_t from_acc(acc_t x) { return x; }
#else
#error "define one of CUFLASH_DTYPE_F16, _BF16, _F32, _F64"
#endif

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
// max that propagates NaN (as NumPy's max does); fmaxf would drop it
__device__ __forceinline__ acc_t acc_max(acc_t a, acc_t b) { return (a > b || a != a) ? a : b; }

// fast_math.cuh -- approximate special functions of the tensor-core kernels' logit features,
// where the result is rounded to float16 / bfloat16 right after (never in float32 kernels).
#pragma once
#include "portable.cuh"

// tanh(x / (2 log2(e))) = 1 - 2 r with r = 1 / (1 + 2^x): one MUFU.EX2 (cuflash_exp2) and one
// MUFU.RCP (rcp.approx), against ~20 instructions of tanhf.  Absolute error ~3e-7 (ex2's
// relative 2^-22 and rcp's 1 ulp, times at most 2); x -> +inf gives 1 (2^x = inf, 1 / inf =
// 0), x -> -inf gives -1.  Near 0 the result is 1 minus a number near 1: absolute, not
// relative, accuracy -- what a logit c tanh(s / c) needs (an error of ~3e-7 c).
// cuflash_tanh_rcp returns r, for callers that fold 1 - 2 r into their own FFMA (c tanh =
// c - 2 c r: one instruction where the product c (1 - 2 r) takes two).
__device__ __forceinline__ float cuflash_tanh_rcp(float x) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::count(::cuflash_emu::CNT_RCP);
    return 1.0f / (1.0f + cuflash_exp2(x));
#else
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + cuflash_exp2(x)));
    return r;
#endif
}
__device__ __forceinline__ float cuflash_tanh_exp2(float x) { return fmaf(cuflash_tanh_rcp(x), -2.0f, 1.0f); }

// portable.cuh -- the one header every kernels_cu/*.cu file includes first.
//
// The same text compiles under NVRTC (CuPy RawModule, the GPU) and under the
// host C++ compiler (cuflash.emulator, with cuflash/emulator/cuda_host.h
// force-included, which defines CUFLASH_EMULATOR).  It provides:
//   - what NVRTC lacks: fixed-width integers, INFINITY / NAN (no <math.h>);
//   - __half / __nv_bfloat16 with round-to-nearest-even conversions (no
//     cuda_fp16.h needed, so no toolkit include path at run time);
//   - CUFLASH_DYNAMIC_SHARED(type, name): `type* name` over the dynamic shared
//     memory (`extern __shared__` cannot be written in host C++);
//   - gload / gstore / gatomic_add: global-memory accesses that the emulator
//     counts for cuflash.emulator.last_launch_stats();
//   - tensor-core building blocks with the PTX ISA fragment layouts:
//     mma_m16n8k16_f16 / _bf16 (f32 accumulate), ldmatrix_x1/x2/x4 (+_trans),
//     cp_async_16 / cp_async_commit / cp_async_wait<N>;
//   - float32 on tensor cores (last section): cvt_rna_tf32, split_tf32 (3xTF32 operands),
//     mma_m16n8k8_tf32 and mma_m16n8k8_3xtf32.
//     sm_80+: inline PTX.  Older GPUs (sm_75): the mma is computed in software
//     from warp shuffles with the same fragment layout and cp.async is a plain
//     synchronous copy, so kernels need no #if of their own.  Emulator: warp-
//     collective emulations (cuda_host.h); with -arch=sm_75 the emulator runs
//     the software mma, which cross-checks the two.
#pragma once

#ifndef CUFLASH_EMULATOR
// ------------------------------------------------------------- GPU (NVRTC/nvcc)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;  // LP64, as glibc's <stdint.h>
typedef unsigned long uint64_t;
typedef unsigned long uintptr_t;
// NVRTC knows no __builtin_huge_valf: as CUDA's CUDART_INF_F, these are
// not constant expressions (no `constexpr float x = INFINITY;` in kernels).
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifdef __CUDA_ARCH__
#define CUFLASH_ARCH __CUDA_ARCH__
#else
#define CUFLASH_ARCH 0  // nvcc's host pass
#endif
#endif  // !CUFLASH_EMULATOR

// Feature tests kernels may use (e.g. to pick tile sizes); the functions
// below work on every architecture either way.
#if CUFLASH_ARCH >= 800
#define CUFLASH_HAS_TENSOR_CORE_MMA 1
#define CUFLASH_HAS_CP_ASYNC 1
#else
#define CUFLASH_HAS_TENSOR_CORE_MMA 0
#define CUFLASH_HAS_CP_ASYNC 0
#endif

template <class T> struct cuflash_identity { typedef T type; };

// The caller's source line, a defaulted trailing parameter of the accessors below in the
// emulator (its memcheck names the line of a stray access); nothing on the GPU.
#ifdef CUFLASH_EMULATOR
#define CUFLASH_SITE , const char* cuflash_file = __builtin_FILE(), int cuflash_line = __builtin_LINE()
#define CUFLASH_SITE_ARGS cuflash_file, cuflash_line
#else
#define CUFLASH_SITE
#endif

// ------------------------------------------------------------- lane id
__device__ __forceinline__ unsigned cuflash_lane_id() {
#ifdef CUFLASH_EMULATOR
    return ::cuflash_emu::tctx->lane;
#else
    unsigned l;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
#endif
}

// ------------------------------------------------------------- 16-bit floats
__device__ __forceinline__ unsigned short cuflash_float_to_h16(float f) {
#ifdef CUFLASH_EMULATOR
    return ::cuflash_emu::float_to_h16_bits(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}
__device__ __forceinline__ float cuflash_h16_to_float(unsigned short h) {
#ifdef CUFLASH_EMULATOR
    return ::cuflash_emu::h16_bits_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
// bfloat16: round to nearest even in integer arithmetic on both sides (cvt.rn.bf16.f32 is sm_80+ only).
__device__ __forceinline__ unsigned short cuflash_float_to_bf16(float f) {
    unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
__device__ __forceinline__ float cuflash_bf16_to_float(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
}

// Storage types with implicit conversions to and from float (arithmetic
// happens in float, as in the kernels' accumulators).
struct __align__(2) __half {
    unsigned short __x;
#ifdef CUFLASH_EMULATOR
    static constexpr const char* cuflash_kind = "h";  // parameter kind for the emulator's launcher
#endif
    __half() = default;
    __device__ __half(float f) : __x(cuflash_float_to_h16(f)) {}
    __device__ __half(double f) : __x(cuflash_float_to_h16((float)f)) {}
    __device__ __half(int i) : __x(cuflash_float_to_h16((float)i)) {}
    __device__ operator float() const { return cuflash_h16_to_float(__x); }
};
struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
#ifdef CUFLASH_EMULATOR
    static constexpr const char* cuflash_kind = "B";  // parameter kind for the emulator's launcher
#endif
    __nv_bfloat16() = default;
    __device__ __nv_bfloat16(float f) : __x(cuflash_float_to_bf16(f)) {}
    __device__ __nv_bfloat16(double f) : __x(cuflash_float_to_bf16((float)f)) {}
    __device__ __nv_bfloat16(int i) : __x(cuflash_float_to_bf16((float)i)) {}
    __device__ operator float() const { return cuflash_bf16_to_float(__x); }
};
struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };

__device__ __forceinline__ __half __float2half(float f) { return __half(f); }
__device__ __forceinline__ __half __float2half_rn(float f) { return __half(f); }
__device__ __forceinline__ float __half2float(__half h) { return (float)h; }
__device__ __forceinline__ __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
__device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
__device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
__device__ __forceinline__ unsigned short __half_as_ushort(__half h) { return h.__x; }
__device__ __forceinline__ __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
__device__ __forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
__device__ __forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
__device__ __forceinline__ __half2 __floats2half2_rn(float lo, float hi) { __half2 r; r.x = __half(lo); r.y = __half(hi); return r; }
__device__ __forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
    __nv_bfloat162 r; r.x = __nv_bfloat16(lo); r.y = __nv_bfloat16(hi); return r;
}

// Two 16-bit values in one 32-bit register (the mma/ldmatrix fragment unit):
// the lower index in the low half.  Use these instead of reinterpret_cast,
// which breaks the host compiler's aliasing rules.
template <class T> __device__ __forceinline__ unsigned short cuflash_bits(float f);
template <> __device__ __forceinline__ unsigned short cuflash_bits<__half>(float f) { return cuflash_float_to_h16(f); }
template <> __device__ __forceinline__ unsigned short cuflash_bits<__nv_bfloat16>(float f) { return cuflash_float_to_bf16(f); }
template <class T> __device__ __forceinline__ float cuflash_from_bits(unsigned short h);
template <> __device__ __forceinline__ float cuflash_from_bits<__half>(unsigned short h) { return cuflash_h16_to_float(h); }
template <> __device__ __forceinline__ float cuflash_from_bits<__nv_bfloat16>(unsigned short h) { return cuflash_bf16_to_float(h); }

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return (uint32_t)cuflash_bits<T>(lo) | ((uint32_t)cuflash_bits<T>(hi) << 16);
}
template <class T>
__device__ __forceinline__ void unpack2(uint32_t r, float& lo, float& hi) {
    lo = cuflash_from_bits<T>((unsigned short)(r & 0xffffu));
    hi = cuflash_from_bits<T>((unsigned short)(r >> 16));
}
// Two adjacent 16-bit elements (p[0] low, p[1] high) as one register.
template <class T>
__device__ __forceinline__ uint32_t pack2_from(const T* p) {
    return (uint32_t)p[0].__x | ((uint32_t)p[1].__x << 16);
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) { return pack2<__half>(lo, hi); }
__device__ __forceinline__ uint32_t pack_bfloat162(float lo, float hi) { return pack2<__nv_bfloat16>(lo, hi); }

// PTX prmt.b32 in its generic form: byte i of the result is byte (sel >> 4i) & 7 of the
// eight bytes {b, a} (a's bytes 0-3, b's 4-7), or, where bit 3 of that nibble is set, that
// byte's msb replicated over all eight bits (CUDA's __byte_perm documents only the low three
// bits of a nibble, so the PTX is written out).  One PRMT, sel a register or, where it is a
// constant, an immediate.
__device__ __forceinline__ uint32_t cuflash_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef CUFLASH_EMULATOR
    const unsigned long long ab = (unsigned long long)b << 32 | a;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
        const uint32_t n = (sel >> (4 * i)) & 0xfu, byte = (uint32_t)(ab >> (8 * (n & 7))) & 0xffu;
        r |= ((n & 8) ? ((byte & 0x80u) ? 0xffu : 0u) : byte) << (8 * i);
    }
    return r;
#else
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
#endif
}

// ------------------------------------------------------------- dynamic shared memory
// Declares `type* name` pointing at the launch's dynamic shared memory
// (shared_mem= bytes).  The emulator fills it with 0xff bytes (NaN) before
// every block, so reading what no thread wrote shows up in the results.
#ifdef CUFLASH_EMULATOR
#define CUFLASH_DYNAMIC_SHARED(type, name) \
    type* name = reinterpret_cast<type*>(::cuflash_emu::tctx->dyn_smem)
#else
// declared once at file scope: kernels of one module (and templates) share the name
extern __shared__ __align__(16) unsigned char cuflash_dynamic_smem_[];
#define CUFLASH_DYNAMIC_SHARED(type, name) \
    type* name = reinterpret_cast<type*>(cuflash_dynamic_smem_)
#endif

// ------------------------------------------------------------- global memory
// All global loads/stores of the kernels go through these, so the emulator
// can count HBM traffic (last_launch_stats()); on the GPU they are plain accesses.
template <class T>
__device__ __forceinline__ T gload(const T* p CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::check_global(p, sizeof(T), "global load", CUFLASH_SITE_ARGS);
    ::cuflash_emu::tctx->bytes_read += sizeof(T);
#endif
    return *p;
}
// Index reads (cu_seqlens, seqlens_k, block tables) as CUFLASH_INDEX(array, i): array[i] on
// the GPU, where every thread of a block reads the same few ints (one cached line).  The
// emulator checks them as it checks gload (memcheck: an index array read past its end is
// the classic serving overrun) but does not count them as traffic.
#ifdef CUFLASH_EMULATOR
template <class T>
__device__ __forceinline__ T cuflash_index_load(const T* p CUFLASH_SITE) {
    ::cuflash_emu::check_global(p, sizeof(T), "global index load", CUFLASH_SITE_ARGS);
    return *p;
}
#define CUFLASH_INDEX(a, i) cuflash_index_load(&(a)[i])
#else
#define CUFLASH_INDEX(a, i) a[i]
#endif
template <class T>
__device__ __forceinline__ void gstore(T* p, typename cuflash_identity<T>::type v CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::check_global(p, sizeof(T), "global store", CUFLASH_SITE_ARGS);
    ::cuflash_emu::tctx->bytes_written += sizeof(T);
    ::cuflash_emu::note_store(p, sizeof(T));  // the inter-block write check, when on
#endif
    *p = v;
}
__device__ __forceinline__ float gatomic_add(float* p, float v CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::check_global(p, 4, "global atomic", CUFLASH_SITE_ARGS);
    ::cuflash_emu::tctx->bytes_read += 4;
    ::cuflash_emu::tctx->bytes_written += 4;
    ::cuflash_emu::note_atomic(p);  // the atomic order check, when on
#endif
    return atomicAdd(p, v);
}
// double atomics (sm_60+): the float64 bias gradient of a broadcast bias
__device__ __forceinline__ double gatomic_add(double* p, double v CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::check_global(p, 8, "global atomic", CUFLASH_SITE_ARGS);
    ::cuflash_emu::tctx->bytes_read += 8;
    ::cuflash_emu::tctx->bytes_written += 8;
    ::cuflash_emu::note_atomic(p);  // the atomic order check, when on
#endif
    return atomicAdd(p, v);
}

// ------------------------------------------------------------- mma.m16n8k16 (f32 accumulate)
// d = a * b + c; A 16x16 row-major, B 16x8 ("col"), C/D 16x8 f32.
// Lane L, g = L/4, t = L%4:  a = {(g,2t), (g+8,2t), (g,2t+8), (g+8,2t+8)} (pairs, low = lower column),
// b = {(2t,g), (2t+8,g)} (pairs along k), c/d = {(g,2t), (g,2t+1), (g+8,2t), (g+8,2t+1)}.
// Software version for GPUs without m16n8k16 tensor cores: the same result
// from 32 shuffles, summing pairs of k in order.
template <class T>
__device__ __forceinline__ void cuflash_mma_m16n8k16_sw(float (&d)[4], const uint32_t (&a)[4],
                                                        const uint32_t (&b)[2], const float (&c)[4]) {
    const unsigned lane = cuflash_lane_id();
    const int g = lane >> 2, t = lane & 3;
    float acc[4] = {c[0], c[1], c[2], c[3]};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // k = 2kk, 2kk+1 is held by lanes with t == kk % 4
        const int src_t = kk & 3, hi = kk >> 2;
        const uint32_t a_g = __shfl_sync(0xffffffffu, a[2 * hi], 4 * g + src_t);       // A(g, 2kk..)
        const uint32_t a_g8 = __shfl_sync(0xffffffffu, a[2 * hi + 1], 4 * g + src_t);  // A(g+8, 2kk..)
        const uint32_t b_0 = __shfl_sync(0xffffffffu, b[hi], 8 * t + src_t);           // B(2kk.., 2t)
        const uint32_t b_1 = __shfl_sync(0xffffffffu, b[hi], 8 * t + 4 + src_t);       // B(2kk.., 2t+1)
        float x0, x1, y0, y1, p0, p1, q0, q1;
        unpack2<T>(a_g, x0, x1);
        unpack2<T>(a_g8, y0, y1);
        unpack2<T>(b_0, p0, p1);
        unpack2<T>(b_1, q0, q1);
        acc[0] += x0 * p0 + x1 * p1;
        acc[1] += x0 * q0 + x1 * q1;
        acc[2] += y0 * p0 + y1 * p1;
        acc[3] += y0 * q0 + y1 * q1;
    }
    d[0] = acc[0]; d[1] = acc[1]; d[2] = acc[2]; d[3] = acc[3];
}

__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    ::cuflash_emu::mma_m16n8k16<false>(d, a, b, c);
#elif !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    cuflash_mma_m16n8k16_sw<__half>(d, a, b, c);
#endif
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    ::cuflash_emu::mma_m16n8k16<true>(d, a, b, c);
#elif !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    cuflash_mma_m16n8k16_sw<__nv_bfloat16>(d, a, b, c);
#endif
}

// mma_m16n8k16<T>: the one of the two above for element type T (__half or __nv_bfloat16),
// for kernels specialised on the dtype by a -D define.
template <class T> struct cuflash_mma_dispatch;
template <> struct cuflash_mma_dispatch<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                               const float (&c)[4]) { mma_m16n8k16_f16(d, a, b, c); }
};
template <> struct cuflash_mma_dispatch<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                               const float (&c)[4]) { mma_m16n8k16_bf16(d, a, b, c); }
};
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                             const float (&c)[4]) {
    cuflash_mma_dispatch<T>::run(d, a, b, c);
}

// ------------------------------------------------------------- ldmatrix.m8n8.b16
// Lanes 8j..8j+7 pass the (16-byte aligned, shared-memory) row addresses of
// matrix j; register j receives matrix j: lane L gets M[L/4][2(L%4)], M[L/4][2(L%4)+1]
// (with _trans: M[2(L%4)][L/4], M[2(L%4)+1][L/4]).  Warp-collective: all 32 lanes call it.
#if defined(CUFLASH_EMULATOR)
#define CUFLASH_LDMATRIX(N, TRANS, r, p) ::cuflash_emu::ldmatrix<N, TRANS>(r, p, CUFLASH_SITE_ARGS)
#elif CUFLASH_ARCH >= 750
#define CUFLASH_LDMATRIX(N, TRANS, r, p) cuflash_ldmatrix_ptx_##N##_##TRANS(r, p)
__device__ __forceinline__ void cuflash_ldmatrix_ptx_1_false(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s) : "memory");
}
__device__ __forceinline__ void cuflash_ldmatrix_ptx_2_false(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
}
__device__ __forceinline__ void cuflash_ldmatrix_ptx_4_false(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
__device__ __forceinline__ void cuflash_ldmatrix_ptx_1_true(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s) : "memory");
}
__device__ __forceinline__ void cuflash_ldmatrix_ptx_2_true(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
}
__device__ __forceinline__ void cuflash_ldmatrix_ptx_4_true(uint32_t* r, const void* p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
#else
// Before sm_75: each lane fetches the row addresses it needs by shuffle and reads 4 bytes.
#define CUFLASH_LDMATRIX(N, TRANS, r, p) cuflash_ldmatrix_sw<N, TRANS>(r, p)
template <int N, bool TRANS>
__device__ __forceinline__ void cuflash_ldmatrix_sw(uint32_t* r, const void* p) {
    const unsigned lane = cuflash_lane_id();
    const int q = lane >> 2, t = lane & 3;
    for (int j = 0; j < N; ++j) {
        if (!TRANS) {
            const unsigned short* row = (const unsigned short*)__shfl_sync(0xffffffffu, (unsigned long long)p, 8 * j + q);
            r[j] = (uint32_t)row[2 * t] | ((uint32_t)row[2 * t + 1] << 16);
        } else {
            const unsigned short* r0 = (const unsigned short*)__shfl_sync(0xffffffffu, (unsigned long long)p, 8 * j + 2 * t);
            const unsigned short* r1 = (const unsigned short*)__shfl_sync(0xffffffffu, (unsigned long long)p, 8 * j + 2 * t + 1);
            r[j] = (uint32_t)r0[q] | ((uint32_t)r1[q] << 16);
        }
    }
}
#endif

__device__ __forceinline__ void ldmatrix_x1(uint32_t (&r)[1], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(1, false, r, smem_row_ptr); }
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(2, false, r, smem_row_ptr); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(4, false, r, smem_row_ptr); }
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t (&r)[1], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(1, true, r, smem_row_ptr); }
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(2, true, r, smem_row_ptr); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row_ptr CUFLASH_SITE) { CUFLASH_LDMATRIX(4, true, r, smem_row_ptr); }

// ------------------------------------------------------------- cp.async (16 bytes, global -> shared)
// Copies issued since the last commit form a group; cp_async_wait<N>() returns
// when at most N of this thread's committed groups are still in flight.  Other
// threads see the data only after a following __syncthreads().  In the
// emulator a copy lands only when its wait runs (reading earlier gives stale
// data); before sm_80 the copy is synchronous.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem CUFLASH_SITE) {
#if defined(CUFLASH_EMULATOR)
    ::cuflash_emu::cp_async_16(smem, gmem, CUFLASH_SITE_ARGS);
#elif CUFLASH_ARCH >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(CUFLASH_EMULATOR)
    ::cuflash_emu::cp_async_commit();
#elif CUFLASH_ARCH >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(CUFLASH_EMULATOR)
    ::cuflash_emu::cp_async_wait(N);
#elif CUFLASH_ARCH >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// =====================================================================================
// Backward-kernel building blocks (flash_bwd_tc.cu): exp2, packed conversions, 32/128-bit
// shared stores, vectorised float32 reductions into global memory.
// =====================================================================================

// 2^x on the special-function unit (MUFU.EX2): the kernels fold log2(e) into the softmax
// scale and the lse, so P = exp2(s * scale * log2(e) - lse * log2(e)) is one FFMA + one
// MUFU per element.  ex2.approx.ftz: relative error ~2^-22, results below 2^-126 flush to
// 0 (P that small is 0 in float16/bfloat16 anyway); exp2(-inf) = 0.
__device__ __forceinline__ float cuflash_exp2(float x) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::count(::cuflash_emu::CNT_EXP2);
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Two floats -> two 16-bit values of type T in one register (lo in the low half), rounded
// to nearest even: one cvt.rn.{f16,bf16}x2.f32 on sm_80+ (the emulator and older GPUs use
// pack2, which rounds the same way).  cvt's first source goes to the HIGH half.
template <class T> struct cuflash_cvt2;
template <> struct cuflash_cvt2<__half> {
    static __device__ __forceinline__ uint32_t run(float lo, float hi) {
#if !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
        uint32_t r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return pack2<__half>(lo, hi);
#endif
    }
};
template <> struct cuflash_cvt2<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t run(float lo, float hi) {
#if !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
        uint32_t r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#else
        return pack2<__nv_bfloat16>(lo, hi);
#endif
    }
};
template <class T>
__device__ __forceinline__ uint32_t cvt_pack2(float lo, float hi) { return cuflash_cvt2<T>::run(lo, hi); }

// Plain 32-bit / 128-bit stores of raw bits into (shared) memory that holds 16-bit
// elements: a reinterpret_cast store on the GPU, memcpy on the host (the host compiler's
// aliasing rules forbid storing a uint32_t over __half objects through a cast pointer).
__device__ __forceinline__ void cuflash_store_b32(void* p, uint32_t v) {
#ifdef CUFLASH_EMULATOR
    std::memcpy(p, &v, 4);
#else
    *reinterpret_cast<uint32_t*>(p) = v;
#endif
}
__device__ __forceinline__ void cuflash_zero_b128(void* p) {
#ifdef CUFLASH_EMULATOR
    std::memset(p, 0, 16);
#else
    *reinterpret_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
#endif
}

// red.global.add.f32: float32 reductions into global memory, the result not returned (so
// the SM does not wait for it).  _v2 / _v4 add to 2 / 4 consecutive floats (8 / 16-byte
// aligned) with ONE instruction on sm_90 (red.global.add.v2/.v4.f32, PTX 8.1); before
// sm_90 they are 2 / 4 scalar reds.  Each element counts as 4 bytes read + 4 written in
// the emulator (as gatomic_add: the add happens at L2), and misaligned vectors fail there.
// Several reds by ONE thread to one address are applied in program order (PTX memory
// model: program order is part of causality order, and coherence follows it), which the
// deterministic dQ of flash_bwd_tc relies on.
__device__ __forceinline__ void gred_add(float* p, float a CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::red_add_f32(p, &a, 1, CUFLASH_SITE_ARGS);
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
#endif
}
__device__ __forceinline__ void gred_add_v2(float* p, float a, float b CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    const float v[2] = {a, b};
    ::cuflash_emu::red_add_f32(p, v, 2, CUFLASH_SITE_ARGS);
#elif CUFLASH_ARCH >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0+4], %1;" ::"l"(p), "f"(b) : "memory");
#endif
}
__device__ __forceinline__ void gred_add_v4(float* p, float a, float b, float c, float d CUFLASH_SITE) {
#ifdef CUFLASH_EMULATOR
    const float v[4] = {a, b, c, d};
    ::cuflash_emu::red_add_f32(p, v, 4, CUFLASH_SITE_ARGS);
#elif CUFLASH_ARCH >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
                 "f"(d) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0+4], %1;" ::"l"(p), "f"(b) : "memory");
    asm volatile("red.global.add.f32 [%0+8], %1;" ::"l"(p), "f"(c) : "memory");
    asm volatile("red.global.add.f32 [%0+12], %1;" ::"l"(p), "f"(d) : "memory");
#endif
}

// ============================================================= TF32: float32 on tensor cores
// (the float32 forward/backward kernels; nothing above depends on this section)
//
// tf32 (PTX ISA, "Alternate floating-point data formats"): the exponent range of .f32 with
// >= 10 mantissa bits, kept in a .b32 register; its internal layout is implementation
// defined and PTX provides cvt.rna.tf32.f32 to produce it.  The kernels therefore never hand
// a raw float to mma: every operand goes through cvt_rna_tf32 (round to nearest, ties away
// from zero, to 10 mantissa bits; on sm_80/sm_90 the result is the float with its low 13
// bits cleared).  What mma does with an operand whose low 13 bits are not zero is not
// specified by PTX; NVIDIA's CUTLASS feeds raw floats as "round toward zero" tf32 (its
// NumericConverter<tfloat32_t, float, round_toward_zero> is x & 0xffffe000), i.e. relies on
// the tensor core reading only the top 19 bits.  The emulator models exactly that (low 13
// bits ignored), the software mma below does the same, and tests/emulator/test_emulator_tf32.py
// checks both against NumPy.
//
// 3xTF32 (the "big + small" split): x = hi + lo, a*b ~= hi_a*hi_b + hi_a*lo_b + lo_a*hi_b.
// split_tf32 takes hi = x with its low 13 bits cleared (round toward zero: one LOP3, the
// big part CUTLASS uses) and lo = x - hi (exact in float, 0 <= lo/x < 2^-10) nudged up in
// magnitude by x * 2^-23 in the same instruction: lo = fma(x, 1 + 2^-23, -hi), one FFMA.
// The tensor core reads lo's top 19 bits (truncation), and the nudge -- between a quarter and
// a half of a tf32 unit of lo where lo is largest -- makes that truncation nearly a rounding:
// over 2e6 normal x, |hi + tf32(lo) - x| / |x| has RMS 9.5e-8 and mean +1.3e-8 (rounding lo to
// nearest: 8.2e-8, +3.2e-8; plain truncation: 1.2e-7, -7.5e-8), and at most 1.5 * 2^-22
// (tests/emulator/test_emulator_tf32.py).  Two instructions per operand element; the previous split
// (FADD, then lo + half a tf32 unit: IADD3) took three, and O and dQ/dK/dV on the emulator
// come out 6-31% less accurate with this one (e.g. O 5.4e-7 -> 6.1e-7; lo truncated without
// the nudge: 8.0e-7), all far inside 1e-5 (bench/results/tf32_accuracy.md).  The
// dropped lo_a*lo_b term is < 2^-20; in a dot product these errors are below float32's own
// accumulation error (the float32 forward/backward tests hold the float64 oracle's 1e-5).
// A NaN x keeps a NaN hi (its top mantissa bits are set), an infinite x an infinite hi, so
// non-finite inputs still reach the product even though lo of them is NaN.
// hi_mask: the kernels pass 0xffffe000 computed from a run-time value -- with the constant,
// ptxas notices that HMMA.TF32 ignores the low 13 bits and feeds the raw float as hi, which
// then has to be moved into each fragment's consecutive registers (measured: ~300 extra MOVs
// per K/V tile of the forward at d = 64); an opaque mask lets the LOP3 write the fragment.
// mma.m16n8k8 with .tf32 operands (PTX ISA, "Matrix Fragments for mma.m16n8k8"), lane L,
// g = L/4, t = L%4: A (16x8, row) a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4);
// B (8x8, col) b0 = (k = t, n = g), b1 = (k = t+4, n = g); C/D as for m16n8k16:
// c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1).

// cvt.rna.tf32.f32: the tf32 value of x as its float bit pattern (low 13 bits zero).
__device__ __forceinline__ uint32_t cvt_rna_tf32(float x) {
#if !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
#else
    // round half away from zero on the magnitude bits; NaN stays NaN (the add could
    // carry a NaN's payload into the sign), inf stays inf, the largest floats round to inf
    const uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return u | 0x00400000u;
    return (u + 0x1000u) & 0xffffe000u;
#endif
}
__device__ __forceinline__ float tf32_to_float(uint32_t r) { return __uint_as_float(r); }

// x = hi + lo (3xTF32 operands): hi truncated, lo the remainder nudged (see above).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo, uint32_t hi_mask = 0xffffe000u) {
    hi = __float_as_uint(x) & hi_mask;
    lo = __float_as_uint(__fmaf_rn(x, 1.00000011920928955078125f, -__uint_as_float(hi)));  // 1 + 2^-23
}

// split_tf32 for an operand that may hold an infinity whose products must stay exact (K in
// S = Q K^T): an infinite x gives hi = x and lo = NaN, and hi_q * NaN would turn a logit of
// -inf (a key that softmax weighs 0) into NaN.  One FMNMX maps that NaN to -2^64: hi_q * -2^64
// is finite (for |q| < 2^60), the logit keeps the sign of hi_q * hi_k = +-inf, and a NaN x
// still has a NaN hi.  The clamp also bounds a finite negative lo at -2^64, which a finite x
// reaches only below -2^74, where it leaves S with tf32 precision instead of 3xTF32's.
__device__ __forceinline__ void split_tf32_inf(float x, uint32_t& hi, uint32_t& lo, uint32_t hi_mask = 0xffffe000u) {
    hi = __float_as_uint(x) & hi_mask;
    lo = __float_as_uint(fmaxf(__fmaf_rn(x, 1.00000011920928955078125f, -__uint_as_float(hi)),
                               -18446744073709551616.0f));  // -2^64
}

// Software m16n8k8.tf32 for GPUs without it (sm_75): 32 shuffles, the operands read as the
// tensor core reads them (top 19 bits), products exact in float, summed in k order.
__device__ __forceinline__ void cuflash_mma_m16n8k8_tf32_sw(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2], const float (&c)[4]) {
    const unsigned lane = cuflash_lane_id();
    const int g = lane >> 2, t = lane & 3;
    float acc[4] = {c[0], c[1], c[2], c[3]};
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // column k of A / row k of B: lanes with t == k % 4, register k / 4
        const int src_t = k & 3, hi = k >> 2;
        const uint32_t a_g = __shfl_sync(0xffffffffu, a[2 * hi], 4 * g + src_t);       // A(g, k)
        const uint32_t a_g8 = __shfl_sync(0xffffffffu, a[2 * hi + 1], 4 * g + src_t);  // A(g+8, k)
        const uint32_t b_0 = __shfl_sync(0xffffffffu, b[hi], 8 * t + src_t);           // B(k, 2t)
        const uint32_t b_1 = __shfl_sync(0xffffffffu, b[hi], 8 * t + 4 + src_t);       // B(k, 2t+1)
        const float x0 = __uint_as_float(a_g & 0xffffe000u), x1 = __uint_as_float(a_g8 & 0xffffe000u);
        const float y0 = __uint_as_float(b_0 & 0xffffe000u), y1 = __uint_as_float(b_1 & 0xffffe000u);
        acc[0] += x0 * y0;
        acc[1] += x0 * y1;
        acc[2] += x1 * y0;
        acc[3] += x1 * y1;
    }
    d[0] = acc[0]; d[1] = acc[1]; d[2] = acc[2]; d[3] = acc[3];
}

// d = a * b + c, one m16n8k8 with tf32 operands and float32 accumulation.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    ::cuflash_emu::mma_m16n8k8_tf32(d, a, b, c, nullptr, nullptr);
#elif !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    cuflash_mma_m16n8k8_tf32_sw(d, a, b, c);
#endif
}

// The three products of 3xTF32, d = ((c + lo_a*hi_b) + hi_a*lo_b) + hi_a*hi_b (the small
// terms first, the order CUTLASS uses too): three mma instructions on the GPU.  The emulator computes the same three
// accumulations in one warp exchange (one emulated collective instead of three; the result
// is that of the three emulated instructions in sequence).
__device__ __forceinline__ void mma_m16n8k8_3xtf32(float (&d)[4], const uint32_t (&a_hi)[4],
                                                   const uint32_t (&a_lo)[4], const uint32_t (&b_hi)[2],
                                                   const uint32_t (&b_lo)[2], const float (&c)[4]) {
#if defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    ::cuflash_emu::mma_m16n8k8_tf32(d, a_hi, b_hi, c, a_lo, b_lo);
#else
    mma_m16n8k8_tf32(d, a_lo, b_hi, c);
    mma_m16n8k8_tf32(d, a_hi, b_lo, d);
    mma_m16n8k8_tf32(d, a_hi, b_hi, d);
#endif
}

// ============================================================= cp.async with zero fill
// (the tensor-core forward kernels; nothing above depends on this section)
// cp_async_16_zfill: as cp_async_16 when `valid`, else the 16 shared-memory bytes become
// zero (PTX cp.async with src-size 0: no global read) -- tile rows past the end of a
// sequence are zero-filled without a branch around the copy.  `gmem` must be a valid
// address either way (callers pass the tile's base).  Before sm_80: a plain copy or store.
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool valid CUFLASH_SITE) {
#if defined(CUFLASH_EMULATOR)
    ::cuflash_emu::cp_async_16(smem, valid ? gmem : nullptr, CUFLASH_SITE_ARGS);
#elif CUFLASH_ARCH >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
                 : "memory");
#else
    *reinterpret_cast<uint4*>(smem) = valid ? *reinterpret_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}

// hopper.cuh -- asynchronous copies and mbarriers of sm_90, for kernels that include it
// after portable.cuh (kernels that do not include it compile exactly as before).
//
//   mbarrier_init(bar, count)               mbarrier.init: `count` arrivals per phase
//   mbarrier_arrive(bar)                    mbarrier.arrive (returns the state token)
//   mbarrier_arrive_expect_tx(bar, bytes)   mbarrier.arrive.expect_tx: announce `bytes`, then arrive
//   mbarrier_wait_parity(bar, parity)       mbarrier.try_wait.parity in a loop: returns once
//                                           the phase of that parity has completed
//   bulk_copy_g2s(dst, src, bytes, bar)     cp.async.bulk global -> shared of `bytes` (a
//                                           multiple of 16; both addresses 16-byte aligned),
//                                           completing `bytes` transaction bytes on `bar`
//   fence_proxy_async()                     fence.proxy.async.shared::cta: orders this
//                                           thread's generic-proxy shared accesses (plain
//                                           stores, mbarrier.init) with later async-proxy ones
//   warpgroup_barrier()                     bar.sync of the warpgroup's 128 threads (named
//                                           barrier 1 + warpgroup): a tile its threads stored
//                                           becomes one a wgmma of the warpgroup may read
//   named_barrier_sync(id, count)           bar.sync id, count: `count` threads (whole warps)
//                                           of several warpgroups meet at barrier id (4..15;
//                                           1..3 are warpgroup_barrier's)
//   named_barrier_arrive(id, count)         bar.arrive id, count: counts toward barrier id's
//                                           `count` threads without waiting; the bar.sync
//                                           threads there return once all have come
//   tma_load<R>(dst, tmap, coords, bar)    cp.async.bulk.tensor.Rd (R = 1..5): the box of
//                                           the tensor map `tmap` (global memory, 64-byte
//                                           aligned; cuflash.launch.tma.tensor_map) at
//                                           `coords` (elements, innermost first, signed;
//                                           outside the tensor: zeros) into dst, completing
//                                           the box's bytes on `bar`
//
// Warpgroup MMA (sm_90a; all 128 threads of a warpgroup call each of these together):
//   wgmma_desc(smem, lbo, sbo, swizzle)     a matrix descriptor: the operand at `smem`
//                                           (dynamic shared memory), leading and stride byte
//                                           offsets, swizzle 0 / 32 / 64 / 128 (bytes)
//   pin(x)                                  keeps a value (a descriptor) computed before a loop
//                                           in its register (a compiler barrier; nothing on the
//                                           emulator)
//   wgmma_fence()                           wgmma.fence: before the first wgmma after the
//                                           registers it uses were touched
//   wgmma_ss<N, kBF16, kTransA, kTransB>(d, a_desc, b_desc, acc)
//   wgmma_ss_zero<N, kBF16, kTransA, kTransB>(d, a_desc, b_desc)   D = A B, D write-only
//   wgmma_rs<N, kBF16, kTransB>(d, a_regs, b_desc, acc)
//                                           wgmma.mma_async m64nNk16, f32 += f16/bf16: A by
//                                           descriptor (ss) or the mma.m16n8k16 A fragment of
//                                           the warp's 16 rows (rs); D = float[N / 2] per thread,
//                                           added to when acc; kTrans*: M/N-major operand
//   wgmma_commit()                          wgmma.commit_group
//   wgmma_wait<N>()                         wgmma.wait_group N: all but the N most recent
//                                           groups complete; their D may be read after it
//   wgmma_fence_operand(d)                  keeps the compiler from moving accesses of d
//                                           across the asynchronous instructions
//   setmaxnreg_inc<R>() / setmaxnreg_dec<R>()  the warpgroup's registers per thread; ptxas
//                                           honours them only in a kernel with
//                                           __launch_bounds__ (else C7508: "ignored")
// The layouts, and what the emulator checks (a read of D before its wait sees NaN, a store
// to an operand's shared memory before the wait is reported, ...): cuda_host.h, "warpgroup MMA".
//
// `bar` is a 64-bit mbarrier object in shared memory, 8-byte aligned.  A phase completes
// when all `count` arrivals of it happened and the transaction count (bytes announced by
// expect_tx minus bytes landed) is zero; the barrier then re-arms and its parity flips.
// Phase k (from 0) has parity k & 1: a consumer of the k-th fill of a stage waits with
// parity k & 1.  Typical initialisation: one thread inits, then fence_proxy_async() and
// __syncthreads() before any thread or copy uses the barrier.
//
// GPU: inline PTX on sm_90 and later (wgmma and setmaxnreg: sm_90a); elsewhere the functions
// trap (they exist so that a file including this header still compiles for every architecture).  Emulator:
// cuflash/emulator/cuda_host.h, where the copy's destination reads as NaN until the data
// lands and memcheck reports an access to it before the wait.
#pragma once
#include "portable.cuh"

template <int R>
struct CuflashMaxnreg {
    static_assert(R >= 24 && R <= 256 && R % 8 == 0, "setmaxnreg: 24..256 registers, a multiple of 8");
    static constexpr int value = R;
};

__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, unsigned lbo, unsigned sbo, int swizzle) {
    const uint64_t a = (uint64_t)__cvta_generic_to_shared(smem);
    const uint64_t mode = swizzle == 128 ? 1 : swizzle == 64 ? 2 : swizzle == 32 ? 3 : 0;
    return ((a & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (mode << 62);
}

// Pins `x` where it is computed: the compiler may no longer rebuild it from its inputs where it
// is used.  A descriptor computed before a loop and pinned stays in a uniform register across
// the loop, where ptxas would otherwise rebuild it (an add and a move) before every wgmma.
template <class T>
__device__ __forceinline__ void pin(T& x) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "pin: a 32- or 64-bit value");
#ifdef CUFLASH_EMULATOR
    (void)x;
#else
    if constexpr (sizeof(T) == 8)
        asm volatile("" : "+l"(x));
    else
        asm volatile("" : "+r"(x));
#endif
}

#if defined(CUFLASH_EMULATOR)

// The call site of a function without other parameters (CUFLASH_SITE for the others).
#define CUFLASH_SITE_ONLY const char* cuflash_file = __builtin_FILE(), int cuflash_line = __builtin_LINE()

// As on the GPU, the instructions exist only from sm_90 on (the emulated -arch).
#if CUFLASH_ARCH < 900
#define CUFLASH_NEED_SM90(what) \
    ::cuflash_emu::device_error(std::string(what) + " needs sm_90 or later (emulating sm_" + std::to_string(CUFLASH_ARCH / 10) + ")")
#else
#define CUFLASH_NEED_SM90(what) ((void)0)
#endif

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count CUFLASH_SITE) {
    CUFLASH_NEED_SM90("mbarrier.init");
    ::cuflash_emu::mbarrier_init(bar, count, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t* bar CUFLASH_SITE) {
    return ::cuflash_emu::mbarrier_arrive(bar, 0, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes CUFLASH_SITE) {
    return ::cuflash_emu::mbarrier_arrive(bar, bytes, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, unsigned parity CUFLASH_SITE) {
    ::cuflash_emu::mbarrier_wait_parity(bar, parity, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar CUFLASH_SITE) {
    CUFLASH_NEED_SM90("cp.async.bulk");
    ::cuflash_emu::bulk_copy_g2s(dst, src, bytes, bar, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ void fence_proxy_async() { ::cuflash_emu::fence_proxy_async(); }

template <int R>
__device__ __forceinline__ void tma_load(void* dst, const void* tmap, const int (&coords)[R], uint64_t* bar CUFLASH_SITE) {
    CUFLASH_NEED_SM90("cp.async.bulk.tensor");
    ::cuflash_emu::tma_load(dst, tmap, coords, R, bar, CUFLASH_SITE_ARGS);
}

__device__ __forceinline__ void wgmma_fence() {
    CUFLASH_NEED_SM90("wgmma.fence");
    ::cuflash_emu::wgmma_fence();
}
__device__ __forceinline__ void wgmma_commit() { ::cuflash_emu::wgmma_commit_group(); }
__device__ __forceinline__ void warpgroup_barrier() { ::cuflash_emu::warpgroup_barrier(); }
__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned count CUFLASH_SITE) {
    ::cuflash_emu::named_barrier(id, count, CUFLASH_SITE_ARGS);
}
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned count CUFLASH_SITE) {
    ::cuflash_emu::named_barrier_arrive(id, count, CUFLASH_SITE_ARGS);
}
template <int N>
__device__ __forceinline__ void wgmma_wait(CUFLASH_SITE_ONLY) { ::cuflash_emu::wgmma_wait_group(N, CUFLASH_SITE_ARGS); }
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, bool acc CUFLASH_SITE) {
    CUFLASH_NEED_SM90("wgmma.mma_async");
    ::cuflash_emu::wgmma_mma(d, N, kBF16, nullptr, a, b, kTransA, kTransB, acc, CUFLASH_SITE_ARGS);
}
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss_zero(float (&d)[N / 2], uint64_t a, uint64_t b CUFLASH_SITE) {
    CUFLASH_NEED_SM90("wgmma.mma_async");
    ::cuflash_emu::wgmma_mma(d, N, kBF16, nullptr, a, b, kTransA, kTransB, false, CUFLASH_SITE_ARGS);
}
template <int N, bool kBF16, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, bool acc CUFLASH_SITE) {
    CUFLASH_NEED_SM90("wgmma.mma_async");
    ::cuflash_emu::wgmma_mma(d, N, kBF16, a, 0, b, false, kTransB, acc, CUFLASH_SITE_ARGS);
}
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&)[N]) {}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc(CUFLASH_SITE_ONLY) {
    ::cuflash_emu::setmaxnreg(CuflashMaxnreg<R>::value, true, CUFLASH_SITE_ARGS);
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec(CUFLASH_SITE_ONLY) {
    ::cuflash_emu::setmaxnreg(CuflashMaxnreg<R>::value, false, CUFLASH_SITE_ARGS);
}

#elif CUFLASH_ARCH >= 900

__device__ __forceinline__ unsigned cuflash_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cuflash_smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t* bar) {
    uint64_t state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(cuflash_smem_addr(bar)) : "memory");
    return state;
}
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
    uint64_t state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                 : "=l"(state) : "r"(cuflash_smem_addr(bar)), "r"(bytes) : "memory");
    return state;
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, unsigned parity) {
    const unsigned a = cuflash_smem_addr(bar);
    unsigned done;
    do {
        asm volatile("{\n"
                     "  .reg .pred p;\n"
                     "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "  selp.u32 %0, 1, 0, p;\n"
                     "}\n"
                     : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(cuflash_smem_addr(dst)), "l"(src), "r"(bytes), "r"(cuflash_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// named barrier 1 + warpgroup index (0 is __syncthreads'), the warpgroup's 128 threads
__device__ __forceinline__ void warpgroup_barrier() {
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + (threadIdx.x >> 7)) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <int R>
__device__ __forceinline__ void tma_load(void* dst, const void* tmap, const int (&c)[R], uint64_t* bar) {
    static_assert(R >= 1 && R <= 5, "a tensor map has 1 to 5 dimensions");
    const unsigned d = cuflash_smem_addr(dst), b = cuflash_smem_addr(bar);
    const uint64_t t = reinterpret_cast<uint64_t>(tmap);
    if constexpr (R == 1)
        asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n"
                     ::"r"(d), "l"(t), "r"(c[0]), "r"(b) : "memory");
    else if constexpr (R == 2)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                     ::"r"(d), "l"(t), "r"(c[0]), "r"(c[1]), "r"(b) : "memory");
    else if constexpr (R == 3)
        asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                     ::"r"(d), "l"(t), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(b) : "memory");
    else if constexpr (R == 4)
        asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                     ::"r"(d), "l"(t), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(b) : "memory");
    else
        asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                     ::"r"(d), "l"(t), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(c[4]), "r"(b) : "memory");
}

// wgmma and setmaxnreg exist only in sm_90a code (-arch=sm_90a); a plain sm_90 build traps
// (below), as builds for older GPUs do
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma_sm90.cuh"
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, bool acc) {
    CuflashWgmma<N, kBF16>::template ss<kTransA, kTransB>(d, a, b, acc);
}
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss_zero(float (&d)[N / 2], uint64_t a, uint64_t b) {
    CuflashWgmma<N, kBF16>::template ss0<kTransA, kTransB>(d, a, b);
}
template <int N, bool kBF16, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, bool acc) {
    CuflashWgmma<N, kBF16>::template rs<kTransB>(d, a, b, acc);
}
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CuflashMaxnreg<R>::value));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(CuflashMaxnreg<R>::value));
}
#define CUFLASH_HAVE_WGMMA 1
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

#else  // before sm_90: no such instructions

__device__ __forceinline__ void mbarrier_init(uint64_t*, unsigned) { __trap(); }
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t*) { __trap(); return 0; }
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t*, unsigned) { __trap(); return 0; }
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t*, unsigned) { __trap(); }
__device__ __forceinline__ void bulk_copy_g2s(void*, const void*, unsigned, uint64_t*) { __trap(); }
__device__ __forceinline__ void fence_proxy_async() {}
__device__ __forceinline__ void warpgroup_barrier() { __trap(); }
__device__ __forceinline__ void named_barrier_sync(unsigned, unsigned) { __trap(); }
__device__ __forceinline__ void named_barrier_arrive(unsigned, unsigned) { __trap(); }
template <int R>
__device__ __forceinline__ void tma_load(void*, const void*, const int (&)[R], uint64_t*) { __trap(); }

#endif

#if !defined(CUFLASH_EMULATOR) && !defined(CUFLASH_HAVE_WGMMA)  // GPU code for sm_90 or older
__device__ __forceinline__ void wgmma_fence() { __trap(); }
__device__ __forceinline__ void wgmma_commit() { __trap(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { __trap(); }
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss(float (&)[N / 2], uint64_t, uint64_t, bool) { __trap(); }
template <int N, bool kBF16, bool kTransA, bool kTransB>
__device__ __forceinline__ void wgmma_ss_zero(float (&)[N / 2], uint64_t, uint64_t) { __trap(); }
template <int N, bool kBF16, bool kTransB>
__device__ __forceinline__ void wgmma_rs(float (&)[N / 2], const uint32_t (&)[4], uint64_t, bool) { __trap(); }
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&)[N]) {}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() { __trap(); }
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() { __trap(); }
#endif

// -- shared by the warp-specialised kernels (flash_fwd_wgmma.cu, flash_bwd_wgmma.cu) --------
// The dynamic shared memory from its first 1024-byte aligned address: the 128-byte swizzle's
// atoms (8 rows of 128 bytes) must start on one, as the descriptors and TMA address them.  A
// launch passes 1024 bytes beyond its tiles for it.
__device__ __forceinline__ unsigned char* shared_aligned_1024() {
    CUFLASH_DYNAMIC_SHARED(unsigned char, raw);
    const unsigned a = (unsigned)__cvta_generic_to_shared(raw);
    return raw + ((1024u - (a & 1023u)) & 1023u);
}

// The mbarriers of a producer / consumers pipeline, initialised by one thread before a
// __syncthreads: bars[0] for a load made once (one arrival and its bytes), then kStages "full"
// barriers (the producer's arrival and its copies' bytes) and kStages "empty" ones (one
// arrival per consumer warpgroup).
__device__ __forceinline__ void pipeline_init(uint64_t* bars, int stages, unsigned consumers) {
    mbarrier_init(bars, 1);
    for (int s = 0; s < stages; ++s) {
        mbarrier_init(bars + 1 + s, 1);
        mbarrier_init(bars + 1 + stages + s, consumers);
    }
    fence_proxy_async();  // the inits before the copy engine's complete_tx
}

// A 32-bit store at shared-window address `a` inside the buffer that starts at pointer `base`,
// address `base_a`: on the GPU st.shared by the 32-bit address (the address arithmetic stays
// 32-bit and the store an STS with its constant part folded in), on the emulator through the
// pointer.
__device__ __forceinline__ void sts_b32(unsigned char* base, uint32_t base_a, uint32_t a, uint32_t v) {
#ifdef CUFLASH_EMULATOR
    *reinterpret_cast<uint32_t*>(base + (a - base_a)) = v;
#else
    (void)base;
    (void)base_a;
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
#endif
}

// A wgmma accumulator (m64nN, float[N / 2] per thread) as the register A operands of the
// next product: the fragments of n8 tiles 2kk, 2kk + 1 are the A fragment of k16 step kk.
template <typename T, int N>
__device__ __forceinline__ void wgmma_acc_to_a(const float (&x)[N], uint32_t (&a)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 8; ++kk) {
        const float* v = x + 8 * kk;
        a[kk][0] = pack2<T>(v[0], v[1]);
        a[kk][1] = pack2<T>(v[2], v[3]);
        a[kk][2] = pack2<T>(v[4], v[5]);
        a[kk][3] = pack2<T>(v[6], v[7]);
    }
}

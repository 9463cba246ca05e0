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
//
// `bar` is a 64-bit mbarrier object in shared memory, 8-byte aligned.  A phase completes
// when all `count` arrivals of it happened and the transaction count (bytes announced by
// expect_tx minus bytes landed) is zero; the barrier then re-arms and its parity flips.
// Phase k (from 0) has parity k & 1: a consumer of the k-th fill of a stage waits with
// parity k & 1.  Typical initialisation: one thread inits, then fence_proxy_async() and
// __syncthreads() before any thread or copy uses the barrier.
//
// GPU: inline PTX on sm_90 and later; on older architectures the functions trap (they exist
// so that a file including this header still compiles for every architecture).  Emulator:
// cuflash/emulator/cuda_host.h, where the copy's destination reads as NaN until the data
// lands and memcheck reports an access to it before the wait.
#pragma once
#include "portable.cuh"

#if defined(CUFLASH_EMULATOR)

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
// One OS thread (or the block lock) orders everything the emulator does.
__device__ __forceinline__ void fence_proxy_async() {}

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

#else  // before sm_90: no such instructions

__device__ __forceinline__ void mbarrier_init(uint64_t*, unsigned) { __trap(); }
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t*) { __trap(); return 0; }
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t*, unsigned) { __trap(); return 0; }
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t*, unsigned) { __trap(); }
__device__ __forceinline__ void bulk_copy_g2s(void*, const void*, unsigned, uint64_t*) { __trap(); }
__device__ __forceinline__ void fence_proxy_async() {}

#endif

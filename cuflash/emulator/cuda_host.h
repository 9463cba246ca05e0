// cuda_host.h -- CUDA built-ins for running unchanged kernels_cu/*.cu sources on the CPU.
//
// Force-included (g++ -include) by cuflash.emulator before the kernel source.
// Execution model (docs/emulator.md): one thread block at a time, so
// `__shared__` can be a plain `static` (one copy, shared by the running
// block).  Two engines run a block's CUDA threads, chosen when the library is
// compiled (CUFLASH_EMULATOR_THREADS):
//   * fibers (fiber_engine.h), the default: the threads are coroutines on the
//     launching OS thread that switch only where they wait (barriers, warp
//     collectives).  Between two such points the block's threads run one after
//     another in a fixed order (thread index; CUFLASH_EMULATOR_SCHEDULE=random
//     permutes it per round): runs are reproducible, and a missing barrier
//     shows up as wrong results only for orders this one happens to expose --
//     finding such races is the job of race_check=True;
//   * real std::threads, for ThreadSanitizer builds (race_check=True, where
//     __SANITIZE_THREAD__ is defined), so that TSan sees real concurrency.
// Both share the barrier logic below: every barrier (__syncthreads, warp
// collectives, mbarrier waits) goes through one lock per block, which makes deadlock
// detection exact: when every thread that has not returned waits in some barrier that
// cannot complete (bulk copies in flight land first), the launch fails with a message
// instead of hanging.
//
// What is not a template or a one-liner (the launch, the checks, the error messages, the
// emulated instructions' bodies) is only declared here and defined in engine.cpp, which is
// compiled once per configuration into an object that every kernel library links: a kernel's
// translation unit then generates code for little more than the kernel.  The definitions that
// stay here as `inline` but serve only the engine (run_blocks, the profiler's tables) generate
// no code in a kernel's translation unit, which never calls them.
//
// All per-thread state hangs off ONE thread_local pointer (`tctx`): several
// thread_locals per library exhausted glibc's static TLS after ~14 loaded
// libraries on these machines.  The fibers of a block share their OS thread's
// `tctx`: the scheduler points it at a fiber's context before resuming it.
#pragma once
#ifndef CUFLASH_EMULATOR
#define CUFLASH_EMULATOR 1
#endif

// cuflash.emulator preprocesses each source once with CUFLASH_PREPROCESS_ONLY
// to find the kernels; the standard headers are not needed for that.
#ifndef CUFLASH_PREPROCESS_ONLY
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <array>
#include <map>
#include <tuple>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <math.h>
#include <dlfcn.h>
#include <sys/mman.h>
#endif

// Which engine runs the threads of a block (see the top of this file).
#ifndef CUFLASH_EMULATOR_THREADS
#if defined(__SANITIZE_THREAD__)
#define CUFLASH_EMULATOR_THREADS 1
#else
#define CUFLASH_EMULATOR_THREADS 0
#endif
#endif
#if defined(__SANITIZE_THREAD__) && !CUFLASH_EMULATOR_THREADS
#error "ThreadSanitizer builds need the threaded engine (CUFLASH_EMULATOR_THREADS=1)"
#endif
#if !CUFLASH_EMULATOR_THREADS && !defined(CUFLASH_PREPROCESS_ONLY)
#include "fiber_engine.h"
#endif

// ---------------------------------------------------------------- keywords
#ifdef CUFLASH_PREPROCESS_ONLY
#define __global__ __cuflash_global__
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
// One copy per library; only one block runs at a time, so this is the block's
// shared memory.  Static shared memory is NOT reset between blocks (as on the
// GPU its contents are undefined); dynamic shared memory is NaN-poisoned.
#define __shared__ static
#define __CUDA_ARCH__ CUFLASH_ARCH
#ifndef CUFLASH_ARCH
#define CUFLASH_ARCH 800
#endif
#define warpSize 32

#ifndef CUFLASH_PREPROCESS_ONLY

// ---------------------------------------------------------------- vector types
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
#define CUFLASH_VEC2(T, N, A) struct __attribute__((aligned(A))) N { T x, y; }; \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define CUFLASH_VEC3(T, N) struct N { T x, y, z; }; \
    inline N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define CUFLASH_VEC4(T, N, A) struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
CUFLASH_VEC2(float, float2, 8)
CUFLASH_VEC3(float, float3)
CUFLASH_VEC4(float, float4, 16)
CUFLASH_VEC2(double, double2, 16)
CUFLASH_VEC2(int, int2, 8)
CUFLASH_VEC3(int, int3)
CUFLASH_VEC4(int, int4, 16)
CUFLASH_VEC2(unsigned int, uint2, 8)
CUFLASH_VEC4(unsigned int, uint4, 16)
CUFLASH_VEC2(short, short2, 4)
CUFLASH_VEC2(unsigned short, ushort2, 4)
CUFLASH_VEC4(unsigned char, uchar4, 4)
CUFLASH_VEC4(signed char, char4, 4)
CUFLASH_VEC2(long long, longlong2, 16)
CUFLASH_VEC2(unsigned long long, ulonglong2, 16)
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
#undef CUFLASH_VEC2
#undef CUFLASH_VEC3
#undef CUFLASH_VEC4

namespace cuflash_emu {

// Under ThreadSanitizer (race_check=True) the block mutex that implements the
// barriers must not count as synchronisation: it would order, say, two warps
// that merely both shuffled, hiding races the GPU has.  Its internals run with
// TSan's sync and access tracking off, and each barrier publishes exactly the
// ordering CUDA gives (all threads of the block for __syncthreads, the warp's
// lanes for a warp collective) with explicit release/acquire.
#if defined(__SANITIZE_THREAD__)
extern "C" {
void AnnotateIgnoreSyncBegin(const char*, int);
void AnnotateIgnoreSyncEnd(const char*, int);
void AnnotateIgnoreReadsBegin(const char*, int);
void AnnotateIgnoreReadsEnd(const char*, int);
void AnnotateIgnoreWritesBegin(const char*, int);
void AnnotateIgnoreWritesEnd(const char*, int);
void __tsan_acquire(void*);
void __tsan_release(void*);
}
struct TsanQuiet {
    TsanQuiet() {
        AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
        AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
        AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
    }
    ~TsanQuiet() {
        AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
        AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
        AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
    }
};
inline void tsan_release(void* p) { __tsan_release(p); }
inline void tsan_acquire(void* p) { __tsan_acquire(p); }
#else
struct TsanQuiet {};
inline void tsan_release(void*) {}
inline void tsan_acquire(void*) {}
#endif

// Thrown into a thread to unwind it out of the kernel when the launch fails.
struct KernelAbort {};

#if CUFLASH_EMULATOR_THREADS
using BlockMutex = std::mutex;
#else
// The fibers of a block share one OS thread and never switch inside a locked
// section: the block lock has nothing to exclude.
struct BlockMutex { void lock() {} void unlock() {} };
#endif

struct Barrier {
    unsigned expected = 0;  // threads that must arrive (exited threads dropped)
    unsigned arrived = 0;
    unsigned waiters = 0;   // arrived threads blocked in this barrier
    // Waiters wait for the generation to move on.  Threads sleep on it (a
    // futex, C++20 atomic wait) without the block mutex: a condition variable
    // made all of them re-take the mutex on wake-up, serialising 128 threads
    // at every __syncthreads.  Fibers are resumed by the scheduler once it moved.
    std::atomic<unsigned> gen{0};
    char sync[2];  // ThreadSanitizer sync objects of even / odd generations
};

struct CpCopy { void* dst; const void* src; };

// An mbarrier (sm_90 form): arrivals still pending in the current phase, the count it re-arms
// with, the transaction count (bytes announced by expect_tx minus bytes completed by bulk
// copies; may go negative when a copy lands first) and the number of completed phases.
struct Mbarrier { unsigned expected = 0, pending = 0; long long tx = 0; unsigned long long phase = 0; };
// A cp.async.bulk in flight: its destination, the source bytes (read at issue) and the
// mbarrier it completes transaction bytes on.
struct BulkCopy { unsigned char* dst; std::vector<unsigned char> data; uintptr_t bar; unsigned tid; };

// One plain global store, for the inter-block write check (see check_interblock_stores).
struct StoreRec { uintptr_t addr; unsigned bytes; unsigned long long block; };
// One element of a float atomic add (gatomic_add, red.global.add*), for the atomic order check
// (see check_atomic_order): the element's address, the block and the thread that added.
struct AtomicRec { uintptr_t addr; unsigned long long block; unsigned tid; };

struct Block;

// One memory access seen by the profiler: its site (a code address for instrumented plain
// accesses, else the accessor's caller's file and line), the thread's wait count, kind, size.
enum AccessKind : unsigned char { ACC_SHARED_LOAD, ACC_SHARED_STORE, ACC_LDMATRIX, ACC_CP_ASYNC_SHARED,
                                  ACC_GLOBAL_LOAD, ACC_GLOBAL_STORE, ACC_GLOBAL_ATOMIC, ACC_CP_ASYNC_GLOBAL };
struct AccessRec { const void* pc; const char* file; int line; unsigned epoch; uintptr_t addr; unsigned size; AccessKind kind; };

// Executed-instruction classes the profiler counts per thread (summed per warp: / 32).
enum CountClass : unsigned { CNT_MMA_F16, CNT_MMA_BF16, CNT_MMA_TF32, CNT_MMA_3XTF32, CNT_LDMATRIX_X1, CNT_LDMATRIX_X2,
                             CNT_LDMATRIX_X4, CNT_SHFL, CNT_VOTE, CNT_SYNCTHREADS, CNT_SYNCWARP, CNT_EXP2,
                             CNT_GLOBAL_ATOMIC, CNT_CP_ASYNC, CNT_RCP, CNT_WGMMA, CNT_NCLASSES };
inline const char* const kCountNames[CNT_NCLASSES] = {
    "mma.m16n8k16.f16", "mma.m16n8k16.bf16", "mma.m16n8k8.tf32", "mma.m16n8k8.tf32 x3 (3xTF32)", "ldmatrix.x1",
    "ldmatrix.x2", "ldmatrix.x4", "shfl", "vote", "bar.sync (__syncthreads)", "bar.warp.sync (__syncwarp)",
    "ex2 (exp2)", "global atomic/red", "cp.async", "rcp (rcp.approx)",
    "wgmma.mma_async (per k16)"};

// A wgmma.mma_async in flight (see "warpgroup MMA" below), this thread's part: its
// accumulator registers, the operand values it read at issue (and, for the shared-memory
// operands, where from: a store there before the completion is a race), and the result.
struct WgmmaOp {
    float* d = nullptr;               // the thread's accumulator registers (nregs = N / 2)
    unsigned nregs = 0;
    bool accumulate = false;          // scale-d: D = A B + D (else D = A B)
    std::vector<float> c;             // D's value at issue (when not chained)
    std::shared_ptr<std::vector<float>> chain;  // else the result of the wgmma in flight before it on d
    std::shared_ptr<std::vector<float>> result;
    float a[2][16];                   // A: this thread's two rows, k = 0..15
    std::vector<float> b;             // B: [k][column], this thread's N / 4 columns
    std::vector<const unsigned short*> src;  // shared-memory elements read (SS operands)
    std::vector<unsigned short> bits;         // their values at issue
    const uint32_t* a_regs = nullptr;         // RS: the thread's A registers, and their values
    uint32_t a_bits[4] = {};
    const char* file = "?";
    int line = 0;
};

// Everything one CUDA thread knows; reached through the one thread_local `tctx`.
struct ThreadCtx {
    uint3 threadIdx{0, 0, 0};
    uint3 blockIdx{0, 0, 0};
    dim3 blockDim, gridDim;
    unsigned tid = 0, lane = 0, warp = 0;
    unsigned xphase = 0;  // which of the two warp exchange buffers is next
    unsigned bar_phase = 0;  // parity of this thread's __syncthreads count
    unsigned wg_phase = 0;   // parity of this thread's warpgroup barrier count
    unsigned named_phase = 0;  // bit i: parity of this thread's count at named barrier i
    unsigned named_gen[16] = {};  // 1 + the generation of named barrier i this thread last came to
    Block* blk = nullptr;
    unsigned char* dyn_smem = nullptr;
    unsigned long long bytes_read = 0, bytes_written = 0;
    unsigned long long block_lin = 0;  // linear index of the block being run
    bool record_stores = false;        // inter-block check on: log every gstore
    std::vector<StoreRec> stores;      // (address, bytes, block) of this thread's gstores
    bool record_atomics = false;       // atomic order check on: log every float atomic add
    std::vector<AtomicRec> atomics;    // (element, block, thread) of this thread's atomic adds
    // profiler (see "profiler" below): waits passed so far in this block, the accesses of
    // this block, the executed-instruction counts; `quiet` while emulator code itself
    // touches shared memory (an ldmatrix's or a cp.async's own copy)
    unsigned epoch = 0;
    bool quiet = false;
    std::vector<AccessRec> recs;
    unsigned long long counts[24] = {};
    std::vector<CpCopy> cp_open;                 // issued, not yet committed
    std::vector<std::vector<CpCopy>> cp_groups;  // committed, oldest first
    uint32_t proxy_gen = 0;                       // fence.proxy.async count (see proxy_mark)
    std::vector<WgmmaOp> wg_open;                 // wgmma issued, not committed
    std::vector<std::vector<WgmmaOp>> wg_groups;  // committed wgmma groups, oldest first
    bool wg_fenced = false;                       // a wgmma.fence since the last wait_group
};

inline thread_local ThreadCtx* tctx = nullptr;

// One execution of an instruction of class k by the calling thread (the profiler's counts).
inline void count(CountClass k) { ++tctx->counts[k]; }

// 2 alternating buffers x 32 lanes x 64 bytes: one barrier per collective is
// enough, because a lane can only reuse a buffer after the next collective's
// barrier, which every lane reaches after reading this one.
struct alignas(64) WarpExchange { unsigned char slot[2][32][64]; };

struct Block {
    BlockMutex mu;
    unsigned nthreads = 0, nwarps = 0;
    unsigned live = 0;     // threads of the block that have not returned
    unsigned waiting = 0;  // threads blocked in some barrier
    std::atomic<bool> aborted{false};
    std::string error;
    std::string kernel;
    Barrier bar;  // __syncthreads
    // __syncthreads_count/and/or: counts of the even / odd __syncthreads of the
    // block; each completion clears the other parity's, which nobody touches
    // until every thread has passed this barrier and read its own count.
    std::atomic<int> sync_count[2];
    unsigned long long bar_completions = 0;
    std::unique_ptr<Barrier[]> warp_bar;
    std::unique_ptr<Barrier[]> wg_bar;  // per warpgroup (4 warps): wgmma.wait_group's sync
    Barrier named[16];  // bar.sync id, count (id 1..15; 0 is bar); expected set by the first arrival
    std::unique_ptr<WarpExchange[]> wx;
#if !CUFLASH_EMULATOR_THREADS
    FiberScheduler* fibers = nullptr;  // runs this block's threads
#endif
    // mbarriers of the block by shared-memory address, the bulk copies in flight, and the
    // count of completed mbarrier phases, which threads waiting on any mbarrier watch
    // (they re-check their own barrier when it moves; see "mbarrier" below).
    // With the proxy check on: per byte of dynamic shared memory, the generic-proxy store
    // that last wrote it, as (thread + 1) | fence count << 11, 0 for none (see proxy_mark).
    std::vector<uint32_t> proxy;
    ThreadCtx* threads = nullptr;  // the block's thread contexts (by thread index)
    std::map<uintptr_t, Mbarrier> mbars;
    std::vector<BulkCopy> bulk;
    std::atomic<unsigned> mbar_gen{0};
    unsigned mbar_waiters = 0;  // threads blocked in an mbarrier wait (part of `waiting`)

    Block(unsigned n, const char* name) : nthreads(n), nwarps((n + 31) / 32), kernel(name) {
        warp_bar.reset(new Barrier[nwarps]);
        wg_bar.reset(new Barrier[(nwarps + 3) / 4]);
        wx.reset(new WarpExchange[nwarps]);
    }
    unsigned warp_size(unsigned w) const { return std::min(32u, nthreads - 32u * w); }

    // Before each block (from the completion step of the between-blocks barrier).
    void reset() {
        live = nthreads;
        waiting = 0;
        bar.expected = nthreads; bar.arrived = 0; bar.waiters = 0;
        sync_count[0] = 0; sync_count[1] = 0; bar_completions = 0;
        for (unsigned w = 0; w < nwarps; ++w) {
            warp_bar[w].expected = warp_size(w);
            warp_bar[w].arrived = 0; warp_bar[w].waiters = 0;
        }
        for (unsigned g = 0; g < (nwarps + 3) / 4; ++g) {
            wg_bar[g].expected = std::min(128u, nthreads - 128u * g);
            wg_bar[g].arrived = 0; wg_bar[g].waiters = 0;
        }
        for (Barrier& b : named) { b.expected = 0; b.arrived = 0; b.waiters = 0; }
        std::memset(wx.get(), 0xff, sizeof(WarpExchange) * nwarps);
        mbars.clear(); bulk.clear(); mbar_waiters = 0;
    }

    // A new generation: every thread waiting in `b` may go on.
    static void next_generation(std::atomic<unsigned>& gen) {
        gen.fetch_add(1, std::memory_order_release);
#if CUFLASH_EMULATOR_THREADS
        gen.notify_all();
#endif
    }
    static void next_generation(Barrier& b) { next_generation(b.gen); }

    void release(Barrier& b) {
        if (&b == &bar) sync_count[(++bar_completions) & 1u] = 0;
        waiting -= b.waiters;
        b.waiters = 0; b.arrived = 0;
        next_generation(b);
    }

    // Stop the launch: record the first error and wake every waiting thread.
    void abort_locked(const std::string& msg);

    // Every thread waiting on some mbarrier re-checks its own (a phase completed).
    void release_mbar_waiters() {
        waiting -= mbar_waiters;
        mbar_waiters = 0;
        next_generation(mbar_gen);
    }

    // The phase of `m` completes when no arrival and no transaction byte is pending: it
    // re-arms with the init count.  True if it completed (the caller releases the waiters).
    static bool complete_phase(Mbarrier& m) {
        if (m.pending != 0 || m.tx != 0) return false;
        ++m.phase;
        m.pending = m.expected;
        return true;
    }

    // Called when every live thread waits: the bulk copies in flight still complete without
    // any thread, so they land now (the latest moment, which leaves their destinations
    // poisoned for as long as possible).  True if that completed a phase (waiters released),
    // false if nothing could move: a deadlock.
    bool land_bulk_locked();
    // A block that ends with copies in flight has let them write into shared memory that
    // the next block on that SM may already own (no thread waited on their mbarrier).
    std::string bulk_in_flight_message() const;

    std::string where() const;
    std::string deadlock_message() const;

    // `parity`: the caller's count of waits at this barrier, mod 2 (all
    // participants agree on it), selecting the ThreadSanitizer sync object.
    void arrive_and_wait(Barrier& b, unsigned parity) {
        ++tctx->epoch;
        tsan_release(&b.sync[parity]);
        {
            TsanQuiet quiet;
            arrive_and_wait_locked(b);
        }
        tsan_acquire(&b.sync[parity]);
    }

    void arrive_and_wait_locked(Barrier& b);

    // A returning thread stops counting in its barriers, as on the hardware.
    void thread_exit(unsigned warp);

    [[noreturn]] void fail(const std::string& msg);
};

std::string fmt_idx(uint3 v);

// An error raised by device code (trap, bad collective): ends the launch.
[[noreturn]] void device_error(const std::string& msg);

inline unsigned warp_lanes_mask(const ThreadCtx& c) {
    unsigned n = c.blk->warp_size(c.warp);
    return n == 32 ? 0xffffffffu : ((1u << n) - 1u);
}

// Warp-collective exchange: every lane of the warp publishes `n` bytes, waits
// for the others, and gets the base of the 32 x 64-byte slot array.
inline const unsigned char* warp_exchange(const void* mine, size_t n, unsigned mask, const char* what) {
    ThreadCtx& c = *tctx;
    const unsigned need = warp_lanes_mask(c);
    if ((mask & need) != need) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s with mask 0x%08x: the emulator supports only collectives over the whole warp (lanes 0x%08x)",
                      what, mask, need);
        device_error(buf);
    }
    const unsigned phase = c.xphase;
    unsigned char (*s)[64] = c.blk->wx[c.warp].slot[phase];
    c.xphase ^= 1u;
    if (n) std::memcpy(s[c.lane], mine, n);
    c.blk->arrive_and_wait(c.blk->warp_bar[c.warp], phase);
    return &s[0][0];
}

template <class T>
inline T shfl_from(unsigned mask, T v, int src, bool own, const char* what) {
    static_assert(sizeof(T) <= 64, "shuffle of a type larger than 64 bytes");
    count(CNT_SHFL);
    const unsigned char* s = warp_exchange(&v, sizeof(T), mask, what);
    if (own) return v;
    T out;
    std::memcpy(&out, s + 64 * src, sizeof(T));
    return out;
}

// ---------------------------------------------------------------- memcheck
// Every emulated launch checks its memory accesses (on unless the launch flags turn it off):
//  * global: the kernels reach global memory only through the accessors of portable.cuh
//    (gload, gstore, gatomic_add, gred_add*, cp.async's source, __ldg), which call
//    check_global with the access and the caller's source line; the access must lie inside
//    one of the arrays passed to the launch (set_buffers, from the Python launcher);
//  * shared: the library is built with -fsanitize=kernel-address and
//    asan-instrumentation-with-call-threshold=0, so every load and store the compiler emits
//    calls a __asan_{load,store}N_noabort hook below with its address.  The dynamic shared
//    memory sits in the middle of a reserved window of kSharedWindow bytes on each side
//    (read-write, never touched unless a kernel strays): an address inside the window but
//    outside the allocation is a stray shared access, reported with the return address of
//    the hook (the access site; Python turns it into file:line with addr2line).  An address
//    outside the window is none of the checker's business (stacks, the emulator's own data,
//    global arrays, which the accessors check).  The stray access itself lands harmlessly in
//    the window; the launch fails at the thread's next barrier.  cp.async's and ldmatrix's
//    shared side are emulator code (memcpy), checked explicitly.
// Messages carry two placeholders that the Python side fills in: @ARG<i>:<offset>@ (pointer
// argument i, signed byte offset from its first byte) and @PC:<hex offset in the library>@.
constexpr size_t kSharedWindow = size_t(256) << 20;

struct GlobalBuf { uintptr_t lo, hi; unsigned arg; };

struct MemcheckState {
    bool global_on = false;   // the global check
    bool shared_on = false;   // the shared check
    bool profile = false;     // record accesses for the profiler
    std::vector<GlobalBuf> bufs;  // the launch's pointer arguments
    size_t last = 0;              // the buffer that held the previous access (a cheap first guess)
    uintptr_t win_lo = 0, win_size = 0;  // window around the dynamic shared memory (0: no launch)
    uintptr_t dyn_lo = 0, dyn_hi = 0;    // the dynamic shared allocation
};
inline MemcheckState memcheck;

std::string hex(uintptr_t a);

// The launch's buffer nearest to [a, a + n): "@ARG<i>:<offset>@", or "" without buffers.
std::string nearest_buffer(uintptr_t a);

const char* memcheck_thread_where(std::string& out);

[[noreturn]] void global_stray(uintptr_t a, unsigned n, const char* what, const char* file, int line);

// A global access of n bytes at p by the calling CUDA thread.
void record_access(const void* pc, const char* file, int line, uintptr_t a, unsigned n, AccessKind kind);

// A plain shared access.  The host compiler splits a vector access whose parts are used
// separately (a float4 load into four 4-byte loads, where the GPU does one 16-byte load):
// an access by distinct nearby instructions (within 64 bytes of code) that continues the
// thread's previous one in the same direction, kind and wait interval, and together with it
// stays inside one aligned 16-byte (8-byte, 4-byte) block, is merged into it.
void record_plain_shared(const void* pc, uintptr_t a, unsigned n, AccessKind kind);

inline AccessKind global_kind(const char* what) {
    switch (what[0]) {
        case 'c': return ACC_CP_ASYNC_GLOBAL;                        // "cp.async source"
        case 'r': return ACC_GLOBAL_ATOMIC;                          // "red.global.add"
        case 'g': return what[7] == 's' ? ACC_GLOBAL_STORE : what[7] == 'a' ? ACC_GLOBAL_ATOMIC : ACC_GLOBAL_LOAD;
        default: return ACC_GLOBAL_LOAD;                             // "__ldg load"
    }
}

// A global access for the profiler.  Sectors are counted on the offset into the launch's array
// that holds the access, as if the array started on a 256-byte boundary like a GPU allocation
// (NumPy aligns to 16 or 64 bytes): array i is placed at (i + 1) << 40.
void record_global(uintptr_t a, unsigned n, const char* what, const char* file, int line);

void check_global(const void* p, unsigned n, const char* what, const char* file, int line);

// The library offset of a code address, as "@PC:<hex>@" for addr2line.
std::string pc_token(const void* pc);

std::string shared_stray_message(uintptr_t a, unsigned n, const char* what, const std::string& site);

inline bool in_shared_window(uintptr_t a) { return a - memcheck.win_lo < memcheck.win_size; }
inline bool in_shared_alloc(uintptr_t a, unsigned n) { return a >= memcheck.dyn_lo && a + n <= memcheck.dyn_hi; }

// Shared side of cp.async / ldmatrix (emulator code): fails the launch at once.
void check_shared(const void* p, unsigned n, const char* what, const char* file, int line);

// From the instrumented kernel code: record the first stray access and stop the launch at the
// thread's next barrier (the hook cannot throw: the compiler treats it as nothrow).
__attribute__((noinline, cold)) void shared_stray_hook(uintptr_t a, unsigned n, bool store, const void* pc);

// A plain shared access to bytes a cp.async.bulk in flight is still writing: on the GPU it
// reads (or races with) whatever the copy engine has written so far.  Reported like a stray
// access (the launch fails at the thread's next wait).
__attribute__((noinline, cold)) void bulk_overlap_hook(uintptr_t a, unsigned n, bool store, const void* pc);

__attribute__((noinline)) void raw_access_in_window(uintptr_t a, unsigned n, bool store, const void* pc);

// Every instrumented load and store comes here: the common case (not near the shared memory)
// is one subtraction and one comparison.
__attribute__((always_inline)) inline void raw_access(uintptr_t a, unsigned n, bool store, const void* pc) {
    if (__builtin_expect(!in_shared_window(a), 1)) return;
    raw_access_in_window(a, n, store, pc);
}

// ---------------------------------------------------------------- profiler
// With the profile flag a launch records every shared access (instrumented plain loads and
// stores, ldmatrix rows, cp.async destinations) and every global access through the
// accessors, per thread, with the count of waits (barriers, warp collectives) the thread
// has passed.  After each block the accesses of each warp are grouped into warp-level
// requests: the n-th execution of one site by the lanes of a warp between the same two
// waits (the lanes of a warp run the same instruction stream: SIMT without divergence).
// Per request:
//  * shared: 32 banks of 4 bytes.  A request moves at most 128 bytes per wavefront: lanes
//    are taken in phases of 128 / width (all 32 for widths <= 4, 16 for 8 bytes, 8 for 16
//    bytes and for ldmatrix's rows); a phase takes as many wavefronts as the most distinct
//    4-byte words any one bank holds among the phase's accesses (one word read by several
//    lanes is a broadcast).  Ideal: one wavefront per phase with an active lane.  Bank
//    conflicts, as Nsight Compute counts them, are wavefronts - ideal.
//  * global: the distinct 32-byte sectors touched; ideal: the active lanes' bytes / 32,
//    rounded up.
struct SiteStats { unsigned long long requests = 0, lanes = 0, wavefronts = 0, ideal = 0; };
struct SiteKey {
    const void* pc; const char* file; int line; AccessKind kind; unsigned size;
    bool operator<(const SiteKey& o) const {
        return std::tie(pc, file, line, kind, size) < std::tie(o.pc, o.file, o.line, o.kind, o.size);
    }
};
struct Profile {
    std::map<SiteKey, SiteStats> sites;
    unsigned long long counts[CNT_NCLASSES] = {};
    void clear() { sites.clear(); std::fill(std::begin(counts), std::end(counts), 0ull); }
};
inline Profile profile;

// (wavefronts, ideal) of one shared request; acc = (lane, address, size)
inline std::pair<unsigned, unsigned> shared_cost(const std::vector<std::array<uintptr_t, 3>>& acc, unsigned width) {
    const unsigned per_phase = width <= 4 ? 32 : width <= 8 ? 16 : 8;
    unsigned wave = 0, ideal = 0;
    for (unsigned ph = 0; ph < 32 / per_phase; ++ph) {
        std::vector<uintptr_t> words;
        for (const auto& x : acc)
            if (x[0] / per_phase == ph)
                for (uintptr_t w = x[1] / 4; w <= (x[1] + x[2] - 1) / 4; ++w) words.push_back(w);
        if (words.empty()) continue;
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        unsigned per_bank[32] = {}, most = 0;
        for (uintptr_t w : words) most = std::max(most, ++per_bank[w % 32]);
        wave += most; ideal += 1;
    }
    return {wave, ideal};
}

inline std::pair<unsigned, unsigned> global_cost(const std::vector<std::array<uintptr_t, 3>>& acc) {
    std::vector<uintptr_t> sectors;
    unsigned long long bytes = 0;
    for (const auto& x : acc) {
        bytes += x[2];
        for (uintptr_t sct = x[1] / 32; sct <= (x[1] + x[2] - 1) / 32; ++sct) sectors.push_back(sct);
    }
    std::sort(sectors.begin(), sectors.end());
    sectors.erase(std::unique(sectors.begin(), sectors.end()), sectors.end());
    return {unsigned(sectors.size()), unsigned((bytes + 31) / 32)};
}

// Fold the accesses and counts of the block just run into `profile`, and clear them.
inline void profile_block(std::vector<ThreadCtx>& ctxs) {
    struct Item { unsigned epoch; SiteKey site; unsigned occ; unsigned lane; uintptr_t addr; };
    const unsigned nwarps = unsigned((ctxs.size() + 31) / 32);
    for (unsigned w = 0; w < nwarps; ++w) {
        std::vector<Item> items;
        for (unsigned t = 32 * w; t < std::min<size_t>(ctxs.size(), 32 * w + 32); ++t) {
            ThreadCtx& c = ctxs[t];
            std::map<std::pair<unsigned, SiteKey>, unsigned> seen;  // occurrences per (epoch, site)
            for (const AccessRec& r : c.recs) {
                const SiteKey k{r.pc, r.file, r.line, r.kind, r.size};
                items.push_back(Item{r.epoch, k, seen[{r.epoch, k}]++, c.lane, r.addr});
            }
            std::vector<AccessRec>().swap(c.recs);
            for (unsigned i = 0; i < CNT_NCLASSES; ++i) { profile.counts[i] += c.counts[i]; c.counts[i] = 0; }
            c.epoch = 0;
        }
        std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
            if (a.epoch != b.epoch) return a.epoch < b.epoch;
            if (a.site < b.site) return true;
            if (b.site < a.site) return false;
            return a.occ != b.occ ? a.occ < b.occ : a.lane < b.lane;
        });
        std::vector<std::array<uintptr_t, 3>> acc;
        for (size_t i = 0; i < items.size();) {
            size_t j = i;
            acc.clear();
            while (j < items.size() && items[j].epoch == items[i].epoch && !(items[j].site < items[i].site) &&
                   !(items[i].site < items[j].site) && items[j].occ == items[i].occ) {
                acc.push_back({items[j].lane, items[j].addr, items[j].site.size});
                ++j;
            }
            const SiteKey& k = items[i].site;
            const auto cost = k.kind >= ACC_GLOBAL_LOAD ? global_cost(acc) : shared_cost(acc, k.size);
            SiteStats& st = profile.sites[k];
            st.requests += 1; st.lanes += acc.size(); st.wavefronts += cost.first; st.ideal += cost.second;
            i = j;
        }
    }
}

}  // namespace cuflash_emu


namespace cuflash_emu {

// ---------------------------------------------------------------- 16-bit floats
// Round-to-nearest-even conversions in integer arithmetic (what cvt.rn does on
// the GPU), so results do not depend on the host's F16C support.
inline unsigned short float_to_h16_bits(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {  // below 2^-14: subnormal half, in units of 2^-24 (exact scaling)
        float a; std::memcpy(&a, &ax, 4);
        return (unsigned short)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    uint32_t r = ax - 0x38000000u;  // rebias the exponent 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);  // round half to even on the 13 dropped bits
    return (unsigned short)(sign | (r >> 13));
}
inline float h16_bits_to_float(unsigned short h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t x;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
        std::memcpy(&x, &v, 4); x |= sign;
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f; std::memcpy(&f, &x, 4); return f;
}
inline unsigned short float_to_bf16_bits(float f) {
    uint32_t x; std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
inline float bf16_bits_to_float(unsigned short h) {
    uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f;
}

// ---------------------------------------------------------------- tensor-core accumulation
// The tensor cores do not add in IEEE float: a block of products and the accumulator are
// summed as one fused operation -- the products exact, every addend aligned to the largest
// one's exponent with the bits below a fixed width cut off (toward zero), the sum then
// normalised and cut to float toward zero (Fasi, Higham, Mikaitis, Pranesh, "Numerical
// behavior of NVIDIA tensor cores", PeerJ CS 2021, for V100/T4/A100; Khattak and Mikaitis,
// arXiv:2512.07004, bit-accurate models up to H100 and B200).  The consequence that matters
// here: an accumulator whose sign stays the same loses up to an ulp toward zero at every
// block, so a long chain of mma on one accumulator drifts by about (blocks) x 2^-24 of its
// value, where float FMA's round-to-nearest errors would cancel.  This model keeps the
// structure (blocks of kTcBlock products, kTcExtraBits guard bits, truncation, one cut to
// float per block), not every bit of a particular GPU: with it, flash_fwd_tf32's O at d = 64
// has the error the H100 showed (2.7e-6 at N = 257, 1.5e-5 at N = 2048, where exact float
// summation gives ~6e-7).
constexpr int kTcExtraBits = 3;
constexpr int kTcBlock16 = 8;    // products per block: 16-bit operands
constexpr int kTcBlockTf32 = 8;  // tf32 operands: one block per m16n8k8

inline float tc_round_toward_zero(double x) {
    float f = (float)x;
    if (std::isfinite(f) && std::fabs((double)f) > std::fabs(x)) f = std::nextafter(f, 0.0f);
    if (std::isinf(f) && std::isfinite(x)) f = std::copysign(FLT_MAX, f);
    return f;
}

// c + sum of the n exact products in p (each exactly representable in double).
inline float tc_block_fma(float c, const double* p, int n) {
    double plain = c;
    int emax = INT_MIN;
    bool finite = std::isfinite(c);
    int e;
    if (c != 0.0f && finite) { std::frexp((double)c, &e); emax = e; }
    for (int i = 0; i < n; ++i) {
        plain += p[i];
        if (!std::isfinite(p[i])) { finite = false; continue; }
        if (p[i] != 0.0) { std::frexp(p[i], &e); emax = std::max(emax, e); }
    }
    if (!finite) return (float)plain;         // inf/NaN propagate as IEEE addition does
    if (emax == INT_MIN) return c + 0.0f;     // every addend zero (keeps c's sign)
    // keep 24 + kTcExtraBits bits below the largest addend's leading bit (weight 2^(emax-1))
    const double unit = std::ldexp(1.0, emax - 24 - kTcExtraBits);
    double sum = std::trunc((double)c / unit);
    for (int i = 0; i < n; ++i) sum += std::trunc(p[i] / unit);
    return tc_round_toward_zero(sum * unit);
}

// ---------------------------------------------------------------- tensor-core emulation
// Fragment layouts of mma.m16n8k16 / ldmatrix: PTX ISA, see docs/emulator.md.
void require_full_warp(const char* what);

struct MmaLane { uint32_t a[4]; uint32_t b[2]; float c[4]; };

template <bool BF16>
inline void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    require_full_warp("mma.m16n8k16");
    count(BF16 ? CNT_MMA_BF16 : CNT_MMA_F16);
    MmaLane mine;
    std::memcpy(mine.a, a, 16); std::memcpy(mine.b, b, 8); std::memcpy(mine.c, c, 16);
    const unsigned char* s = warp_exchange(&mine, sizeof mine, 0xffffffffu, "mma.m16n8k16");
    auto lane = [&](int l) -> const MmaLane& { return *reinterpret_cast<const MmaLane*>(s + 64 * l); };
    auto elem = [](uint32_t reg, int hi) -> float {
        unsigned short h = (unsigned short)(hi ? reg >> 16 : reg & 0xffffu);
        return BF16 ? bf16_bits_to_float(h) : h16_bits_to_float(h);
    };
    // A(r, k): lane (r%8)*4 + (k%8)/2, register (r/8) + 2*(k/8), half k&1
    auto A = [&](int r, int k) { return elem(lane((r % 8) * 4 + (k % 8) / 2).a[(r / 8) + 2 * (k / 8)], k & 1); };
    // B(k, n): lane n*4 + (k%8)/2, register k/8, half k&1
    auto B = [&](int k, int n) { return elem(lane(n * 4 + (k % 8) / 2).b[k / 8], k & 1); };
    const int g = tctx->lane >> 2, t = tctx->lane & 3;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float acc = mine.c[i];
        for (int k0 = 0; k0 < 16; k0 += kTcBlock16) {  // the hardware's blocks, in k order
            double p[kTcBlock16];
            for (int k = 0; k < kTcBlock16; ++k) p[k] = (double)A(row, k0 + k) * B(k0 + k, col);
            acc = tc_block_fma(acc, p, kTcBlock16);
        }
        out[i] = acc;
    }
    std::memcpy(d, out, 16);
}

// ldmatrix.m8n8.xN{.trans}.b16: lanes 8j..8j+7 give the row addresses of matrix j.
template <int N, bool TRANS>
inline void ldmatrix(uint32_t* r, const void* row, const char* file = "?", int line = 0) {
    require_full_warp("ldmatrix");
    ThreadCtx& c = *tctx;
    unsigned char mine[16];
    const bool supplies = c.lane < 8u * N;
    if (supplies) {
        if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
            device_error("ldmatrix: row address " + std::to_string(reinterpret_cast<uintptr_t>(row)) + " is not 16-byte aligned");
        check_shared(row, 16, "ldmatrix row", file, line);
        c.quiet = true;  // recorded above as the ldmatrix's access
        std::memcpy(mine, row, 16);  // the 8 b16 elements of this row
        c.quiet = false;
    }
    count(N == 1 ? CNT_LDMATRIX_X1 : N == 2 ? CNT_LDMATRIX_X2 : CNT_LDMATRIX_X4);
    const unsigned char* s = warp_exchange(mine, supplies ? 16 : 0, 0xffffffffu, "ldmatrix");
    auto el = [&](int j, int rr, int cc) {  // element (rr, cc) of matrix j as 16 bits
        unsigned short h; std::memcpy(&h, s + 64 * (8 * j + rr) + 2 * cc, 2); return uint32_t(h);
    };
    const int q = c.lane >> 2, t = c.lane & 3;
    for (int j = 0; j < N; ++j)
        r[j] = TRANS ? (el(j, 2 * t, q) | (el(j, 2 * t + 1, q) << 16))
                     : (el(j, q, 2 * t) | (el(j, q, 2 * t + 1) << 16));
}

// cp.async: the copy is recorded at issue and lands only when a wait covers
// its group, so reading shared memory before the wait sees the old contents.
// src == nullptr: a zero fill (cp.async with src-size 0), no global read.
void cp_async_16(void* dst, const void* src, const char* file = "?", int line = 0);
void cp_async_commit();
void cp_async_wait(int n);

// ---------------------------------------------------------------- mbarrier and bulk copies (sm_90)
// mbarrier objects (PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier"): init(count) sets pending arrivals = count, tx-count = 0, phase 0.  arrive
// takes one pending arrival; arrive.expect_tx first adds bytes to the tx-count; a bulk copy
// completes (subtracts) its bytes when it lands.  The current phase completes when both the
// pending count and the tx-count are zero; the barrier then re-arms (pending = count) and
// its phase parity flips.  try_wait.parity(p) is true once the phase of parity p -- the
// current one or the one just before -- has completed, i.e. when p differs from the
// current phase's parity.  The emulator keeps the state in a table of the block (keyed by
// the object's shared address; a block must init its barriers, as on the GPU) rather than
// in the 8 bytes themselves.
//
// Waiting: a thread whose phase has not completed blocks (a fiber is suspended until some
// mbarrier phase of the block completes, then re-checks), under the block lock that the
// other barriers use, so the deadlock check is exact: when every live thread waits
// somewhere, bulk copies still in flight land (they need no thread); if that completes no
// phase, the launch fails with the deadlock message.
//
// cp.async.bulk global -> shared: the source is checked and read at issue, the destination
// is filled with 0xff bytes (NaN in every float type) and the data lands only when every
// thread of the block waits -- the latest moment the GPU could deliver it.  Reading the
// destination before waiting on the mbarrier thus sees NaN; with memcheck on, such an access
// (load or store) is reported at once, with its source line.
std::string mbar_name(const void* bar);

void mbar_check_object(const void* bar, const char* what, const char* file, int line);

void mbarrier_init(void* bar, unsigned count, const char* file = "?", int line = 0);

// arrive (tx = 0) or arrive.expect_tx(tx); returns the phase the arrival counted in (the
// "state" operand of the PTX form).
unsigned long long mbarrier_arrive(void* bar, unsigned tx, const char* file = "?", int line = 0);

// try_wait.parity in a loop: returns once the phase of parity `parity` has completed.
void mbarrier_wait_parity(void* bar, unsigned parity, const char* file = "?", int line = 0);


// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes, [bar]
void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, void* bar, const char* file = "?", int line = 0);

// Queues a bulk copy whose bytes were read at issue (cp.async.bulk and its tensor form).
void issue_bulk(void* dst, std::vector<unsigned char> data, void* bar, const char* what);

// ---------------------------------------------------------------- TMA (sm_90)
// cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes: a box of
// the tensor a tensor map describes, at signed coordinates (innermost first), into shared
// memory as rows of box[0] elements, the 16-byte chunks of each row XOR-ed with address bits
// [7, ...) as wgmma's descriptors read them (swizzle 32/64/128: the row must fill the span;
// the destination aligned to 8 rows of it, else to 128 bytes); elements outside the tensor
// are zero.  It lands like cp.async.bulk (NaN until the mbarrier wait) and completes the
// box's bytes, the zero-filled ones included.  The GPU's CUtensorMap is opaque; the
// emulator reads its own 128-byte form, which cuflash.launch.tma.tensor_map writes.
struct TensorMapEmu {
    uint32_t magic, elem_bytes, rank, swizzle;  // swizzle: 0, 32, 64, 128 (bytes)
    uint64_t addr;
    uint64_t dims[5];     // elements, innermost first
    uint64_t strides[4];  // bytes of dims 1..4
    uint32_t box[5];      // elements
    uint32_t reserved[3];
};
static_assert(sizeof(TensorMapEmu) == 128, "a tensor map is 128 bytes");
constexpr uint32_t kTensorMapMagic = 0x4d544643u;  // "CFTM"
void tma_load(void* dst, const void* tmap, const int* coords, int rank, void* bar, const char* file = "?", int line = 0);
// A race-check program runs in a child process whose copies of the launch's arrays sit at
// other addresses than the parent's: the global addresses a tensor map holds are moved by
// these (parent start, child start, bytes) ranges; none in a launch in the caller's process.
void set_relocations(const unsigned long long* from, const unsigned long long* to, const unsigned long long* sizes,
                     unsigned n);
uintptr_t relocate(uintptr_t addr);

// ---------------------------------------------------------------- warpgroup MMA (sm_90a)
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}: a warpgroup (4 consecutive warps,
// the first a multiple of 4) computes D (64 x N, float) = A (64 x 16) B (16 x N) [+ D].  Warp
// w of the group holds rows 16w..16w+15 of D, lane l rows 16w + l/4 and +8, columns
// 8j + 2(l%4) + {0, 1}: register i is (row 16w + l/4 + 8((i >> 1) & 1), column
// 8(i >> 2) + 2(l%4) + (i & 1)), the mma.m16n8 accumulator layout repeated over N/8.
// B, and A in the SS form, come from shared memory through matrix descriptors (PTX ISA,
// "Matrix Descriptor"): start address, leading and stride byte offsets (>> 4), base offset
// (must be 0 here) and swizzle mode (none, 128B, 64B, 32B), laid out K-major or, with the
// transpose flag, M/N-major, in the canonical layouts of "Shared Memory Matrix Layout"; the
// swizzle XORs address bits [4, 4 + log2(width / 16)) with bits [7, ...) of the shared address.
// In the RS form A is in registers: 4 x b32 per thread, the mma.m16n8k16 A fragment of the
// warp's 16 rows.  The sums are the tensor cores' (tc_block_fma: blocks of 8 products).
//
// Asynchrony, as the emulator holds a kernel to it: mma_async reads its operands at issue
// and fills D with NaN; D gets the result only at the wait_group that completes the
// wgmma's commit group, so reading D earlier sees NaN.  A store by any thread to the shared
// memory an SS operand read, before that wait, is reported (the tensor cores may read it any
// time until completion), as are a write to D or to the RS form's A registers in flight, a
// thread that returns with a wgmma
// in flight, and a first wgmma after launch or after a wait_group without a wgmma.fence
// before it (the fence orders the thread's register accesses with the tensor cores').
// Consecutive wgmma on the same D without a wait chain: each adds to the previous result.
// wait_group synchronises the warpgroup (it is .sync.aligned): one thread may release the
// operands' shared memory for all (an mbarrier arrive) as soon as it has passed it; a
// warpgroup whose threads do not all reach it deadlocks (reported).
void wgmma_fence();
void wgmma_commit_group();
// bar.sync on the warpgroup's named barrier (128 threads): its threads' shared stores before
// it happen before any access after it (a warpgroup sharing a tile it wrote for wgmma)
void warpgroup_barrier();
// bar.sync id, count: the first `count` threads (whole warps) to arrive at named barrier `id`
// (1..15) pass together; every arrival of one phase must name the same count
void named_barrier(unsigned id, unsigned count, const char* file = "?", int line = 0);
// bar.arrive id, count: counts toward the barrier's `count` threads without waiting (the
// producer's side: its earlier accesses happen before the return of the bar.sync waiters).
void named_barrier_arrive(unsigned id, unsigned count, const char* file = "?", int line = 0);
void wgmma_wait_group(int n, const char* file = "?", int line = 0);
void wgmma_mma(float* d, int n, bool bf16, const uint32_t* a_regs, uint64_t desc_a, uint64_t desc_b, bool trans_a,
               bool trans_b, bool accumulate, const char* file = "?", int line = 0);
void setmaxnreg(unsigned regs, bool inc, const char* file = "?", int line = 0);
// fence.proxy.async: this thread's earlier generic-proxy shared stores become visible to the
// asynchronous proxy (the tensor cores' operand reads).  Under the proxy check, a wgmma that
// reads a byte a thread stored with no fence.proxy.async by that thread since is an error.
void fence_proxy_async();

// ---------------------------------------------------------------- atomic order check
// A float atomic add is deterministic only in the order the adds reach an address.  Adds of
// ONE thread to one address are applied in its program order (PTX memory model); adds of two
// threads -- of one block or of two -- land in whatever order the GPU runs them, so a sum
// they build may differ in its last bits from run to run.  With the check on, every element
// of gatomic_add and red.global.add* is logged (element address, block, thread); after the
// launch an address that received adds from two threads is reported.  A launch meant to be
// bitwise repeatable (the backward with deterministic=True) must pass it; the atomic dQ path
// does not (several KV blocks add into each dQ element), which is its documented trade.
void note_atomic(const void* p);

inline std::string fmt_block(unsigned long long lin, const unsigned* grid);

// Returns "" or the message naming the kernel, the address and two threads that added there.
inline std::string check_atomic_order(std::vector<ThreadCtx>& ctxs, const char* name, const unsigned* grid) {
    std::vector<AtomicRec> all;
    for (ThreadCtx& c : ctxs) {
        all.insert(all.end(), c.atomics.begin(), c.atomics.end());
        std::vector<AtomicRec>().swap(c.atomics);
    }
    // elements are 4- or 8-byte aligned floats/doubles: an address shared by two adds is equal
    std::sort(all.begin(), all.end(), [](const AtomicRec& a, const AtomicRec& b) {
        return a.addr != b.addr ? a.addr < b.addr : (a.block != b.block ? a.block < b.block : a.tid < b.tid);
    });
    for (size_t i = 1; i < all.size(); ++i) {
        const AtomicRec &a = all[i - 1], &r = all[i];
        if (a.addr == r.addr && (a.block != r.block || a.tid != r.tid)) {
            char buf[512];
            std::snprintf(buf, sizeof buf,
                          "atomic order in kernel %s: block %s thread %u and block %s thread %u both add into "
                          "global address 0x%llx; on a GPU their adds arrive in a run-dependent order, so the "
                          "sum is not bitwise repeatable",
                          name, fmt_block(a.block, grid).c_str(), a.tid, fmt_block(r.block, grid).c_str(), r.tid,
                          (unsigned long long)r.addr);
            return buf;
        }
    }
    return "";
}

// red.global.add.f32 (scalar, .v2, .v4): n floats at p, p must be 4n-byte aligned for n > 1
// (as the vector instruction requires).  Counted as 4 bytes read + 4 written per element.
void red_add_f32(float* p, const float* v, int n, const char* file = "?", int line = 0);

// ---------------------------------------------------------------- inter-block write check
// Blocks of one launch run one after another here, but concurrently (in any order) on a
// GPU: two blocks storing to the same global byte with plain stores leave an undefined
// value there, and no ThreadSanitizer run can see it (it sees one block at a time).  With
// the check on, gstore logs (address, size, block) per thread (a vector append, no lock);
// after the launch the logs are sorted by address and swept once: an overlap of two
// stores from different blocks is reported.  Atomics/reds are not logged (they commute).
void note_store(const void* p, unsigned bytes);

inline std::string fmt_block(unsigned long long lin, const unsigned* grid) {
    return fmt_idx(uint3{unsigned(lin % grid[0]), unsigned((lin / grid[0]) % grid[1]),
                         unsigned(lin / (1ull * grid[0] * grid[1]))});
}

// Returns "" or the message naming the kernel, the two blocks and the address.
inline std::string check_interblock_stores(std::vector<ThreadCtx>& ctxs, const char* name, const unsigned* grid) {
    size_t n = 0;
    for (const ThreadCtx& c : ctxs) n += c.stores.size();
    std::vector<StoreRec> all;
    all.reserve(n);
    for (ThreadCtx& c : ctxs) {
        all.insert(all.end(), c.stores.begin(), c.stores.end());
        std::vector<StoreRec>().swap(c.stores);
    }
    std::sort(all.begin(), all.end(), [](const StoreRec& a, const StoreRec& b) {
        return a.addr != b.addr ? a.addr < b.addr : a.block < b.block;
    });
    // Sweep: `far` is the store reaching furthest among those seen.  If any two stores of
    // different blocks overlap, the first store (in this order) that overlaps an earlier
    // one of another block also overlaps `far` with `far` from another block.
    const StoreRec* far = nullptr;
    for (const StoreRec& r : all) {
        if (far != nullptr && r.addr < far->addr + far->bytes && r.block != far->block) {
            char buf[512];
            std::snprintf(buf, sizeof buf,
                          "inter-block race in kernel %s: blocks %s and %s both store to global address 0x%llx "
                          "(a %u-byte store at 0x%llx and a %u-byte store at 0x%llx); blocks of one launch may "
                          "run concurrently on a GPU, so the value left there is undefined",
                          name, fmt_block(far->block, grid).c_str(), fmt_block(r.block, grid).c_str(),
                          (unsigned long long)r.addr, far->bytes, (unsigned long long)far->addr, r.bytes,
                          (unsigned long long)r.addr);
            return buf;
        }
        if (far == nullptr || r.addr + r.bytes > far->addr + far->bytes) far = &r;
    }
    return "";
}

// ---------------------------------------------------------------- TF32 tensor-core emulation
// mma.m16n8k8 with .tf32 operands (portable.cuh, TF32 section; PTX ISA "Matrix Fragments for
// mma.m16n8k8"): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4); b0 = (t, g),
// b1 = (t+4, g); c as for m16n8k16.  An operand is read as the tensor core reads a .b32
// holding tf32: its top 19 bits (sign, exponent, 10 mantissa bits); the low 13 bits are
// ignored (cvt.rna.tf32.f32 leaves them zero; CUTLASS's round-toward-zero tf32 relies on
// the hardware doing this with raw floats).  Products of two 11-bit significands are exact
// in float; they are summed as the hardware sums them (tc_block_fma above).
// With a_lo and b_lo (3xTF32), three such mma run in sequence on the same accumulator:
// d = ((c + lo_a*hi_b) + hi_a*lo_b) + hi_a*hi_b, in one warp exchange.
struct MmaTf32Lane { uint32_t a[4]; uint32_t b[2]; uint32_t a_lo[4]; uint32_t b_lo[2]; float c[4]; };
static_assert(sizeof(MmaTf32Lane) <= 64, "one exchange slot per lane");

inline float tf32_operand(uint32_t r) {
    r &= 0xffffe000u;
    float f; std::memcpy(&f, &r, 4); return f;
}

inline void mma_m16n8k8_tf32(float* d, const uint32_t* a, const uint32_t* b, const float* c,
                             const uint32_t* a_lo, const uint32_t* b_lo) {
    require_full_warp("mma.m16n8k8.tf32");
    count(a_lo ? CNT_MMA_3XTF32 : CNT_MMA_TF32);
    MmaTf32Lane mine{};
    std::memcpy(mine.a, a, 16); std::memcpy(mine.b, b, 8); std::memcpy(mine.c, c, 16);
    if (a_lo) { std::memcpy(mine.a_lo, a_lo, 16); std::memcpy(mine.b_lo, b_lo, 8); }
    const unsigned char* s = warp_exchange(&mine, sizeof mine, 0xffffffffu, "mma.m16n8k8.tf32");
    auto lane = [&](int l) -> const MmaTf32Lane& { return *reinterpret_cast<const MmaTf32Lane*>(s + 64 * l); };
    // A(r, k): lane (r%8)*4 + k%4, register (r/8) + 2*(k/4); B(k, n): lane n*4 + k%4, register k/4
    auto A = [&](bool lo, int r, int k) {
        const MmaTf32Lane& x = lane((r % 8) * 4 + k % 4);
        return tf32_operand((lo ? x.a_lo : x.a)[(r / 8) + 2 * (k / 4)]);
    };
    auto B = [&](bool lo, int k, int n) {
        const MmaTf32Lane& x = lane(n * 4 + k % 4);
        return tf32_operand((lo ? x.b_lo : x.b)[k / 4]);
    };
    const int g = tctx->lane >> 2, t = tctx->lane & 3;
    // (A lo?, B lo?) of each product, in order
    static const bool terms3[3][2] = {{true, false}, {false, true}, {false, false}};
    static const bool terms1[1][2] = {{false, false}};
    const int nterms = a_lo ? 3 : 1;
    const bool (*terms)[2] = a_lo ? terms3 : terms1;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float acc = mine.c[i];
        for (int q = 0; q < nterms; ++q)  // one mma instruction each
            for (int k0 = 0; k0 < 8; k0 += kTcBlockTf32) {
                double p[kTcBlockTf32];
                for (int k = 0; k < kTcBlockTf32; ++k)
                    p[k] = (double)A(terms[q][0], row, k0 + k) * B(terms[q][1], k0 + k, col);
                acc = tc_block_fma(acc, p, kTcBlockTf32);
            }
        out[i] = acc;
    }
    std::memcpy(d, out, 16);
}

// ---------------------------------------------------------------- launch
template <class... A, size_t... I>
inline void invoke_impl(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
inline void invoke(void (*f)(A...), void** args) { invoke_impl(f, args, std::index_sequence_for<A...>{}); }

// Parameter kinds for the Python side: "p" pointer, "i"/"u" integer, "f"
// floating, "b" bool, "h" __half, "B" __nv_bfloat16, "?" other; ":" size.
template <class T>
inline std::string kind_of() {
    using U = std::remove_cv_t<std::remove_reference_t<T>>;
    std::string k;
    if constexpr (std::is_pointer_v<U>) k = "p";
    else if constexpr (std::is_same_v<U, bool>) k = "b";
    else if constexpr (std::is_integral_v<U>) k = std::is_signed_v<U> ? "i" : "u";
    else if constexpr (std::is_floating_point_v<U>) k = "f";
    else if constexpr (requires { U::cuflash_kind; }) k = U::cuflash_kind;
    else k = "?";
    return k + ":" + std::to_string(sizeof(U));
}
template <class... A>
inline std::string signature_of(void (*)(A...)) {
    std::string s;
    ((s += (s.empty() ? "" : ","), s += kind_of<A>()), ...);
    return s;
}

// Ends the process when a launch runs longer than CUFLASH_EMULATOR_TIMEOUT
// seconds (default 1800; 0 disables): a thread that loops forever outside
// every barrier cannot be stopped -- with fibers it never even yields -- so
// end with a message rather than hang the caller.  Deadlocks in barriers are
// caught exactly by Block.
class Watchdog {
public:
    explicit Watchdog(const char* kernel) {
        const char* env = std::getenv("CUFLASH_EMULATOR_TIMEOUT");
        const double limit = env ? std::atof(env) : 1800.0;
        if (!(limit > 0)) return;
        try {
            thread_ = std::thread([this, kernel, limit] {
                std::unique_lock<std::mutex> lk(mu_);
                if (!cv_.wait_for(lk, std::chrono::duration<double>(limit), [this] { return done_; })) {
                    std::fprintf(stderr, "cuflash.emulator: kernel %s did not finish within %g s "
                                 "(CUFLASH_EMULATOR_TIMEOUT; 0 disables): a thread loops forever. Aborting.\n",
                                 kernel, limit);
                    std::fflush(stderr);
                    std::abort();
                }
            });
        } catch (const std::exception&) {
            // no thread to spare: run unwatched rather than not at all
        }
    }
    ~Watchdog() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            done_ = true;
        }
        cv_.notify_all();
        if (thread_.joinable()) thread_.join();
    }
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;

private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
    std::thread thread_;
};

#if CUFLASH_EMULATOR_THREADS
// Threaded engine: every CUDA thread of the block is a std::thread that runs
// its part of every block; a barrier over all of them separates the blocks,
// and its completion step prepares the next block.  Returns "" or why the
// threads could not be started.
template <class BeginBlock, class RunThread>
inline std::string run_blocks(const char* name, unsigned nthreads, unsigned long long nblocks, Block& blk,
                              std::vector<ThreadCtx>& ctxs, BeginBlock begin_block, RunThread run_thread) {
    bool stop = false;
    auto between_blocks = [&](unsigned long long next) {
        stop = blk.aborted || next >= nblocks;
        if (!stop) begin_block(next);
    };
    between_blocks(0);
    std::mutex bm;
    std::condition_variable bcv;
    unsigned b_arrived = 0;
    unsigned long long b_gen = 0;
    auto between_barrier = [&](unsigned long long next) {  // all threads of the launch; completion sets up `next`
        std::unique_lock<std::mutex> lk(bm);
        if (++b_arrived == nthreads) {
            between_blocks(next);
            b_arrived = 0; ++b_gen;
            bcv.notify_all();
            return;
        }
        const unsigned long long g = b_gen;
        bcv.wait(lk, [&] { return b_gen != g; });
    };
    auto body = [&](unsigned t) {
        ThreadCtx& c = ctxs[t];
        tctx = &c;
        for (unsigned long long b = 0; !stop; ++b) {
            run_thread(c, b);
            between_barrier(b + 1);
        }
        tctx = nullptr;
    };
    // Threads wait at a gate until all of them exist: if starting one fails,
    // the started ones leave without running the kernel.
    int gate = 0;  // 0 closed, 1 run, -1 give up
    auto gated = [&](unsigned t) {
        {
            std::unique_lock<std::mutex> lk(bm);
            bcv.wait(lk, [&] { return gate != 0; });
            if (gate < 0) return;
        }
        body(t);
    };
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    std::string start_error;
    try {
        for (unsigned t = 0; t < nthreads; ++t) threads.emplace_back(gated, t);
    } catch (const std::exception& e) {
        start_error = std::string("could not start ") + std::to_string(nthreads) + " threads: " + e.what();
    }
    {
        std::lock_guard<std::mutex> lk(bm);
        gate = start_error.empty() ? 1 : -1;
    }
    bcv.notify_all();
    {
        Watchdog watchdog(name);
        for (auto& th : threads) th.join();
    }
    return start_error;
}
#else
// Fiber engine (fiber_engine.h): the CUDA threads of a block are fibers on
// the calling OS thread; blocks run one after another.  Returns "" or why
// the launch could not start.
template <class BeginBlock, class RunThread>
inline std::string run_blocks(const char* name, unsigned nthreads, unsigned long long nblocks, Block& blk,
                              std::vector<ThreadCtx>& ctxs, BeginBlock begin_block, RunThread run_thread) {
    // CUFLASH_EMULATOR_STACK_KB: stack per fiber (default 256 KiB).
    size_t stack_kb = 256;
    if (const char* env = std::getenv("CUFLASH_EMULATOR_STACK_KB"); env && *env) {
        char* end = nullptr;
        const unsigned long long v = std::strtoull(env, &end, 10);
        if (*end || v < 16 || v > (1ull << 22))
            return std::string("CUFLASH_EMULATOR_STACK_KB=") + env + " is not a size in KiB between 16 and 4194304";
        stack_kb = size_t(v);
    }
    // CUFLASH_EMULATOR_SCHEDULE: fixed (default), random or random:<seed>.
    bool random_order = false;
    uint64_t seed = 0x243f6a8885a308d3ull;
    if (const char* env = std::getenv("CUFLASH_EMULATOR_SCHEDULE"); env && *env && std::strcmp(env, "fixed") != 0) {
        char* end = nullptr;
        if (std::strcmp(env, "random") == 0) {
            random_order = true;
        } else if (std::strncmp(env, "random:", 7) == 0 && env[7] && (seed = std::strtoull(env + 7, &end, 0), !*end)) {
            random_order = true;
        } else {
            return std::string("CUFLASH_EMULATOR_SCHEDULE=") + env + " is not understood (fixed, random or random:<seed>)";
        }
    }

    std::vector<void*> users(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) users[t] = &ctxs[t];
    FiberScheduler sched(nthreads, [](void* u) { tctx = static_cast<ThreadCtx*>(u); }, users.data());
    std::string error;
    auto describe = [](const void* u, SigText& t) {  // for a stack overflow report
        const ThreadCtx& c = *static_cast<const ThreadCtx*>(u);
        t.put(", block ("); t.put_u(c.blockIdx.x); t.put(","); t.put_u(c.blockIdx.y); t.put(","); t.put_u(c.blockIdx.z);
        t.put("), thread ("); t.put_u(c.threadIdx.x); t.put(","); t.put_u(c.threadIdx.y); t.put(","); t.put_u(c.threadIdx.z);
        t.put(")");
    };
    if (!sched.allocate(stack_kb * 1024, name, describe, error)) return error;
    AltSignalStack alt_stack;  // so that a stack overflow can still be reported
    blk.fibers = &sched;

    struct Job {
        RunThread* run;
        std::vector<ThreadCtx>* ctxs;
        unsigned long long block;
    } job{&run_thread, &ctxs, 0};
    auto body = [](void* p, unsigned t) noexcept {
        Job& j = *static_cast<Job*>(p);
        (*j.run)((*j.ctxs)[t], j.block);
    };
    {
        Watchdog watchdog(name);
        for (unsigned long long b = 0; b < nblocks && !blk.aborted; ++b) {
            begin_block(b);
            if (random_order) sched.set_random_order(true, seed ^ (b * 0xd1342543de82ef95ull));
            job.block = b;
            sched.start(body, &job);
            while (sched.unfinished()) {
                if (sched.round()) continue;
                // Every unfinished fiber waits in a barrier, which Block reports as
                // a deadlock when it happens; should it ever miss one, end the
                // block with that message (which wakes them) rather than hang.
                if (!blk.aborted) blk.abort_locked(blk.deadlock_message());
                if (!sched.round()) {
                    std::fprintf(stderr, "cuflash.emulator: internal error: the fibers of kernel %s are stuck\n", name);
                    std::abort();
                }
            }
        }
    }
    tctx = nullptr;
    blk.fibers = nullptr;
    return "";
}
#endif

// ---------------------------------------------------------------- the engine's entry points
// The generated launcher of each kernel calls these (defined in engine.cpp).

// The launch's pointer arguments for the global check: n (first byte, end) pairs, argument index
// i for pair i; the next launch of this library checks against them (and forgets them).
void set_buffers(const unsigned long long* ranges, const unsigned* args, unsigned n);
// The last profiled launch of this library as text, one line per access site
// ("site <kind> <bytes> <pc offset or -> <file or -> <line> <requests> <lanes> <wavefronts or sectors> <ideal>")
// and per counted class ("count <name>\t<thread executions>").
std::string profile_text();
// flags: bit 0 = the inter-block write check, bit 1 = memcheck, bit 2 = profile, bit 3 = the
// atomic order check.  Returns 0, 1 (launch error), 2 (inter-block race) or 3 (atomic order).
// bit 4 = the proxy check (with memcheck, for kernels that use wgmma: a generic-proxy store to
// shared memory that an asynchronous-proxy read meets without a fence.proxy.async between).
enum : unsigned { LAUNCH_CHECK_INTERBLOCK = 1u, LAUNCH_MEMCHECK = 2u, LAUNCH_PROFILE = 4u,
                  LAUNCH_CHECK_ATOMIC_ORDER = 8u, LAUNCH_PROXY_CHECK = 16u };
int launch(const char* name, void (*entry)(void**), void** args, const unsigned* grid,
           const unsigned* block, unsigned long long shmem, unsigned long long* stats,
           char* err, size_t errlen, unsigned flags);

}  // namespace cuflash_emu

// ---------------------------------------------------------------- built-in variables
#define threadIdx (::cuflash_emu::tctx->threadIdx)
#define blockIdx (::cuflash_emu::tctx->blockIdx)
#define blockDim (::cuflash_emu::tctx->blockDim)
#define gridDim (::cuflash_emu::tctx->gridDim)

// ---------------------------------------------------------------- synchronisation
inline void __syncthreads() {
    ::cuflash_emu::ThreadCtx& c = *::cuflash_emu::tctx;
    ::cuflash_emu::count(::cuflash_emu::CNT_SYNCTHREADS);
    c.blk->arrive_and_wait(c.blk->bar, c.bar_phase);
    c.bar_phase ^= 1u;
}
inline int __syncthreads_count(int pred) {
    ::cuflash_emu::ThreadCtx& c = *::cuflash_emu::tctx;
    const unsigned p = c.bar_phase;
    if (pred) c.blk->sync_count[p].fetch_add(1);
    __syncthreads();
    return c.blk->sync_count[p].load();
}
inline int __syncthreads_or(int pred) { return __syncthreads_count(pred) != 0; }
inline int __syncthreads_and(int pred) {
    ::cuflash_emu::ThreadCtx& c = *::cuflash_emu::tctx;
    const unsigned p = c.bar_phase;
    if (!pred) c.blk->sync_count[p].fetch_add(1);  // counts the threads whose predicate is false
    __syncthreads();
    return c.blk->sync_count[p].load() == 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ::cuflash_emu::count(::cuflash_emu::CNT_SYNCWARP);
    ::cuflash_emu::warp_exchange(nullptr, 0, mask, "__syncwarp");
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
[[noreturn]] inline void __trap() { ::cuflash_emu::device_error("__trap() called"); }
[[noreturn]] inline void __cuflash_assert_fail(const char* e, const char* file, int line) {
    ::cuflash_emu::device_error(std::string("assertion failed: ") + e + " at " + file + ":" + std::to_string(line));
}
#undef assert
#define assert(e) ((e) ? (void)0 : __cuflash_assert_fail(#e, __FILE__, __LINE__))

inline unsigned __activemask() { return ::cuflash_emu::warp_lanes_mask(*::cuflash_emu::tctx); }
inline unsigned __lanemask_lt() { return (1u << ::cuflash_emu::tctx->lane) - 1u; }

// ---------------------------------------------------------------- warp collectives
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = (int)::cuflash_emu::tctx->lane;
    const int s = (lane / width) * width + (src % width + width) % width;
    return ::cuflash_emu::shfl_from(mask, v, s, false, "__shfl_sync");
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = (int)::cuflash_emu::tctx->lane;
    const int s = lane ^ lane_mask;
    // a source in a later group of `width` lanes returns the caller's own value
    return ::cuflash_emu::shfl_from(mask, v, s, s >= (lane / width + 1) * width || s > 31, "__shfl_xor_sync");
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = (int)::cuflash_emu::tctx->lane;
    const int s = lane + (int)delta;
    return ::cuflash_emu::shfl_from(mask, v, s, s >= (lane / width + 1) * width, "__shfl_down_sync");
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = (int)::cuflash_emu::tctx->lane;
    const int s = lane - (int)delta;
    return ::cuflash_emu::shfl_from(mask, v, s, s < (lane / width) * width, "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    const int p = pred != 0;
    ::cuflash_emu::count(::cuflash_emu::CNT_VOTE);
    const unsigned char* s = ::cuflash_emu::warp_exchange(&p, sizeof p, mask, "__ballot_sync");
    const unsigned n = ::cuflash_emu::tctx->blk->warp_size(::cuflash_emu::tctx->warp);
    unsigned out = 0;
    for (unsigned l = 0; l < n; ++l) {
        int q; std::memcpy(&q, s + 64 * l, sizeof q);
        if (q && (mask >> l & 1u)) out |= 1u << l;
    }
    return out;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
    const unsigned n = ::cuflash_emu::tctx->blk->warp_size(::cuflash_emu::tctx->warp);
    const unsigned lanes = (n == 32 ? 0xffffffffu : (1u << n) - 1u) & mask;
    return (__ballot_sync(mask, pred) & lanes) == lanes;
}

// ---------------------------------------------------------------- atomics
template <class T>
inline T __cuflash_atomic_add(T* p, T v) {
    ::cuflash_emu::count(::cuflash_emu::CNT_GLOBAL_ATOMIC);
    return std::atomic_ref<T>(*p).fetch_add(v);
}
inline float atomicAdd(float* p, float v) { return __cuflash_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return __cuflash_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return __cuflash_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __cuflash_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return __cuflash_atomic_add(p, v); }
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_sub(v); }
template <class T>
inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <class T>
inline T atomicCAS(T* p, T cmp, T v) { std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v); return cmp; }
template <class T>
inline T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p); T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
    std::atomic_ref<T> a(*p); T old = a.load();
    while (v < old && !a.compare_exchange_weak(old, v)) {}
    return old;
}

// ---------------------------------------------------------------- math intrinsics
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; std::memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; std::memcpy(&x, &i, 8); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline int __mul24(int a, int b) { return a * b; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)((1ull * a * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    s &= 31u; return s ? (hi << s) | (lo >> (32 - s)) : hi;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    s &= 31u; return s ? (lo >> s) | (hi << (32 - s)) : lo;
}
// CUDA's global min/max overloads
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline float min(float a, int b) { return fminf(a, (float)b); }
inline float max(float a, int b) { return fmaxf(a, (float)b); }
inline double min(double a, float b) { return fmin(a, (double)b); }
inline double min(float a, double b) { return fmin((double)a, b); }
inline double max(double a, float b) { return fmax(a, (double)b); }
inline double max(float a, double b) { return fmax((double)a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
using std::isinf;
using std::isnan;
using std::isfinite;
using std::signbit;

template <class T>
inline T __ldg(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::cuflash_emu::check_global(p, sizeof(T), "__ldg load", file, line);
    ::cuflash_emu::tctx->bytes_read += sizeof(T);
    return *p;
}

// Shared-memory address spaces are one on the host.
// A shared-memory address is the byte offset into the block's dynamic shared memory, which
// starts at shared address 0 (wgmma descriptors and ldmatrix/cp.async operands hold these).
// Static __shared__ variables have none here.
size_t __cvta_generic_to_shared(const void* p);

#endif  // CUFLASH_PREPROCESS_ONLY

// Kernels that exercise the emulator's execution engine itself (fibers by
// default; real threads with -DCUFLASH_EMULATOR_THREADS=1 and under
// race_check).  Emulator only: they use host C++ (<cfenv>, exceptions,
// objects with destructors) and unbounded recursion, so they live outside
// tests/emulator/kernels/*.cu, which tests/kernels/test_nvrtc.py compiles for the GPU.
#include "portable.cuh"
#include <atomic>
#include <cfenv>
#include <stdexcept>

// ---------------------------------------------------------------- deep stacks
// Every level fills a 4 KiB local array with a pattern of its own (thread,
// level), recurses, then meets the other threads at a __syncthreads and a
// shuffle -- so fibers switch while their stacks are deep -- and counts the
// words of its array that changed meanwhile.
// bad[t] = damaged words (0); acc[t] = sum over levels l of (l + threadIdx of lane ^ 1).
__device__ __noinline__ int deep(int level, unsigned* acc) {
    volatile unsigned frame[1024];
    const unsigned seed = threadIdx.x * 7919u + blockIdx.x * 15485863u + (unsigned)level * 104729u;
    for (int i = 0; i < 1024; ++i) frame[i] = seed + (unsigned)i;
    int bad = level > 0 ? deep(level - 1, acc) : 0;
    __syncthreads();
    *acc += __shfl_xor_sync(0xffffffffu, (unsigned)level + threadIdx.x, 1);
    for (int i = 0; i < 1024; ++i) bad += frame[i] != seed + (unsigned)i;
    return bad;
}
extern "C" __global__ void deep_stack(int levels, int* bad, unsigned* acc) {
    unsigned a = 0;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = deep(levels, &a);
    gstore(bad + t, b);
    gstore(acc + t, a);
}

// Recurses `limit` levels of 4 KiB (not a tail call) in thread `which` of
// the last block: a limit beyond the stack overflows it.  Otherwise
// out[last block] = 0 + 1 + ... + limit.
__device__ __noinline__ unsigned bottomless(int level, int limit) {
    volatile unsigned frame[1024];
    frame[level & 1023] = (unsigned)level;
    if (level >= limit) return frame[level & 1023];
    return bottomless(level + 1, limit) + frame[level & 1023];
}
extern "C" __global__ void overflow(unsigned* out, int which, int limit) {
    __syncthreads();
    unsigned v = 0;
    if ((int)threadIdx.x == which && blockIdx.x == gridDim.x - 1) v = bottomless(0, limit);
    __syncthreads();
    if ((int)threadIdx.x == which) gstore(out + blockIdx.x, v);
}

// ---------------------------------------------------------------- floating-point state
// Thread 0 switches to rounding down; the others keep round-to-nearest: the
// rounding mode is per thread (MXCSR / FPCR travel with each fiber), and it
// does not leak into the calling thread after the launch.  out[t] = x[0] / x[1].
extern "C" __global__ void rounding_per_thread(const float* x, float* out) {
    if (threadIdx.x == 0) std::fesetround(FE_DOWNWARD);
    __syncthreads();
    const float a = gload(x), b = gload(x + 1);
    __syncthreads();
    gstore(out + blockIdx.x * blockDim.x + threadIdx.x, a / b);
}

// ---------------------------------------------------------------- failures
// Objects with destructors on every thread's stack while thread `who` of
// block 1 fails (mode 0: __trap, 1: a C++ exception, 2: assert); the others
// wait in a barrier or have not started.  The launch must end with the error
// and unwind every thread: live_objects() is 0 afterwards.
static std::atomic<int> g_live_objects{0};
struct Tracker {
    Tracker() { g_live_objects.fetch_add(1); }
    ~Tracker() { g_live_objects.fetch_sub(1); }
    Tracker(const Tracker&) = delete;
};
extern "C" __global__ void fail_midway(int* out, int mode, int who) {
    Tracker here;
    __syncthreads();
    if ((int)threadIdx.x == who && blockIdx.x == 1) {
        if (mode == 0) __trap();
        if (mode == 1) throw std::runtime_error("boom from device code");
        assert(mode != 2);
    }
    const float v = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
    __syncthreads();
    gstore(out + blockIdx.x * blockDim.x + threadIdx.x, (int)v);
}
extern "C" __global__ void live_objects(int* out) { gstore(out, g_live_objects.load()); }

// ---------------------------------------------------------------- scheduling order
// A deliberate race: every thread of the block claims `slot` if it is still
// free, with no synchronisation.  Which thread wins shows the order in which
// the engine ran them (thread 0 in the fixed fiber order).  winner[block].
extern "C" __global__ void first_writer(int* winner) {
    __shared__ int slot;
    if (threadIdx.x == 0) slot = -1;
    __syncthreads();
    volatile int* s = &slot;
    if (*s == -1) *s = (int)threadIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) gstore(winner + blockIdx.x, slot);
}

// ---------------------------------------------------------------- many blocks
// out[b * blockDim.x + t] = b * blockDim.x + (t ^ 1), through shared memory,
// a __syncthreads and a shuffle.
extern "C" __global__ void many_blocks(int* out) {
    __shared__ int ids[1024];
    const int t = threadIdx.x;
    const int id = (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) * (int)blockDim.x + t;
    ids[t] = id;
    __syncthreads();
    const int mine = ids[t];
    gstore(out + mine, __shfl_xor_sync(0xffffffffu, mine, 1));
}

// ---------------------------------------------------------------- endless loop
// Thread `who` spins forever after the first barrier while the others wait
// in the second: only the watchdog can end this.
extern "C" __global__ void spin_after_barrier(volatile int* flag, int who) {
    __syncthreads();
    if ((int)threadIdx.x == who) while (flag[0] == 0) {}
    __syncthreads();
}

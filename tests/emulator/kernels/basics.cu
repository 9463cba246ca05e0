// Small kernels that exercise the emulator's execution model one feature at a time.
#include "portable.cuh"
#include "philox.cuh"

// Every thread of every block writes its global linear id and its coordinates:
// ids[lin] = lin, coords[lin] = (blockIdx, threadIdx, blockDim, gridDim) packed.
// Checks 1-D/2-D/3-D grids and blocks and the x-fastest linearisation.
extern "C" __global__ void index_map(int* ids, int* coords) {
    const int tpb = blockDim.x * blockDim.y * blockDim.z;
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int lin = b * tpb + t;
    gstore(ids + lin, lin);
    int* c = coords + 12 * lin;
    gstore(c + 0, (int)blockIdx.x); gstore(c + 1, (int)blockIdx.y); gstore(c + 2, (int)blockIdx.z);
    gstore(c + 3, (int)threadIdx.x); gstore(c + 4, (int)threadIdx.y); gstore(c + 5, (int)threadIdx.z);
    gstore(c + 6, (int)blockDim.x); gstore(c + 7, (int)blockDim.y); gstore(c + 8, (int)blockDim.z);
    gstore(c + 9, (int)gridDim.x); gstore(c + 10, (int)gridDim.y); gstore(c + 11, (int)gridDim.z);
}

// Threads with index >= n return before the barrier; the others reverse their
// block's slice through shared memory.  Hangs unless early returns drop out
// of __syncthreads (as on the hardware).
extern "C" __global__ void reverse_early_exit(const float* x, float* y, int n) {
    __shared__ float tile[128];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    tile[threadIdx.x] = gload(x + i);
    __syncthreads();  // tile written by every live thread before any reads
    const int live = min((int)blockDim.x, n - (int)(blockIdx.x * blockDim.x));
    gstore(y + i, tile[live - 1 - threadIdx.x]);
}

// Copies dynamic shared memory to out after only the even threads wrote
// their element: the odd elements must come out as the emulator's NaN poison.
extern "C" __global__ void dyn_shared_poison(float* out) {
    CUFLASH_DYNAMIC_SHARED(float, buf);  // (blockDim.x,) floats
    if (threadIdx.x % 2 == 0) buf[threadIdx.x] = (float)(blockIdx.x * 1000 + threadIdx.x);
    __syncthreads();  // buf written before it is copied out
    gstore(out + blockIdx.x * blockDim.x + threadIdx.x, buf[threadIdx.x]);
}

// Lane 0 waits in a shuffle that needs lanes 1-31, which wait at a
// __syncthreads that needs lane 0: hangs on the hardware.  (A thread that
// merely skips a barrier and returns does not: returned threads stop counting.)
extern "C" __global__ void divergent_barrier(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 0) v = __shfl_sync(0xffffffffu, v, 1);
    else __syncthreads();
    gstore(out + threadIdx.x, v);
}

// Histogram with float atomics: out[k] += 1 for every x[i] == k.
extern "C" __global__ void histogram(const int* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gatomic_add(out + gload(x + i), 1.0f);
}

// Conversions: h[i] = __half(x[i]), b[i] = __nv_bfloat16(x[i]), back[i] = float(h) + float(b).
extern "C" __global__ void convert16(const float* x, __half* h, __nv_bfloat16* b, float* back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = gload(x + i);
    const __half hv = __float2half(v);
    const __nv_bfloat16 bv = __float2bfloat16(v);
    gstore(h + i, hv);
    gstore(b + i, bv);
    gstore(back + i, __half2float(hv) + __bfloat162float(bv));
}

// Math intrinsics, one per output column.
extern "C" __global__ void math_ops(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = gload(x + i);
    float* o = out + 8 * i;
    gstore(o + 0, expf(v));
    gstore(o + 1, exp2f(v));
    gstore(o + 2, __expf(v));
    gstore(o + 3, rsqrtf(fabsf(v) + 1.0f));
    gstore(o + 4, fmaxf(v, 0.25f));
    gstore(o + 5, fminf(v, -INFINITY));
    gstore(o + 6, logf(fabsf(v) + 1.0f));
    gstore(o + 7, max(v, 0.5f));
}

// Scalars of every kind: out = {a, b, c, d, e, f}.
extern "C" __global__ void scalars(double* out, int a, unsigned int b, long long c, float d, double e, bool f) {
    gstore(out + 0, (double)a); gstore(out + 1, (double)b); gstore(out + 2, (double)c);
    gstore(out + 3, (double)d); gstore(out + 4, e); gstore(out + 5, f ? 1.0 : 0.0);
}

// __syncthreads_count/or/and over a few rounds: out[3 * r + {0,1,2}] from thread 0
// with predicates (threadIdx.x % (r + 2) == 0), (threadIdx.x == r), (threadIdx.x < blockDim.x - r).
extern "C" __global__ void sync_reductions(int* out, int rounds) {
    for (int r = 0; r < rounds; ++r) {
        const int c = __syncthreads_count(threadIdx.x % (r + 2) == 0);
        const int o = __syncthreads_or(threadIdx.x == (unsigned)r);
        const int a = __syncthreads_and(threadIdx.x < blockDim.x - r);
        // each block its own slice of out (two blocks storing one address race on a GPU)
        int* mine = out + blockIdx.x * 3 * rounds;
        if (threadIdx.x == 0) { gstore(mine + 3 * r, c); gstore(mine + 3 * r + 1, o); gstore(mine + 3 * r + 2, a); }
    }
}

// cuflash_prmt(x, 0, 0x9988) of each x (portable.cuh: one PTX prmt on the GPU, a C model on
// the emulator), the backward's dropout pair mask: y = 0xffff in a half whose sign bit (bit 7
// / bit 15 of x) is set.
extern "C" __global__ void half_mask(const unsigned* x, unsigned* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(y + i, cuflash_prmt(gload(x + i), 0u, 0x9988u));
}

// cuflash_prmt of each (a, b, sel) (portable.cuh: PTX prmt.b32 with a register selector on
// the GPU, a C model on the emulator).
extern "C" __global__ void prmt_any(const unsigned* a, const unsigned* b, const unsigned* sel, unsigned* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(y + i, cuflash_prmt(gload(a + i), gload(b + i), gload(sel + i)));
}

// cuflash_keep_halves of each x against the threshold t (philox.cuh): y's bits 15 and 31 say
// whether x's low / high 16 bits are at least t.
extern "C" __global__ void keep_halves(const unsigned* x, unsigned t, unsigned* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(y + i, cuflash_keep_halves(gload(x + i), t * 0x10001u));
}

// Global-memory writes the emulator checks across blocks, and the backward kernels' new
// primitives (portable.cuh: gred_add*, cvt_pack2), each checked by tests/emulator/test_emulator_global_writes.py.
#include "portable.cuh"

// Correct: block b writes elements [b*n, (b+1)*n) -- no two blocks store to one address.
extern "C" __global__ void own_slices(float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) gstore(out + blockIdx.x * n + i, (float)blockIdx.x);
}

// Planted bug: block b writes [b*n, b*n + n] -- one element past its slice, which is the
// next block's first element.  On a GPU the value left there depends on which block runs
// last; the emulator's inter-block check must name the kernel, both blocks and the address.
extern "C" __global__ void overlapping_slices(float* out, int n) {
    for (int i = threadIdx.x; i <= n; i += blockDim.x)
        if (blockIdx.x * n + i < gridDim.x * n) gstore(out + blockIdx.x * n + i, (float)blockIdx.x);
}

// Every block adds into the same elements with reds (they commute): not a race.  Thread t
// of every block adds (b + 1) to out[t] (scalar), and the pair / quad at out[n + 2t], out[n + 64 + 4t].
extern "C" __global__ void reds_from_every_block(float* out, int n) {
    const int t = threadIdx.x;
    const float x = (float)(blockIdx.x + 1);
    gred_add(out + t, x);
    gred_add_v2(out + n + 2 * t, x, 2.0f * x);
    gred_add_v4(out + n + 64 + 4 * t, x, 2.0f * x, 3.0f * x, 4.0f * x);
}

// A misaligned vector red (8-byte aligned only): must fail like the hardware would.
extern "C" __global__ void misaligned_red_v4(float* out) {
    gred_add_v4(out + 2, 1.0f, 1.0f, 1.0f, 1.0f);
}

// out[i] = the bits of cvt_pack2<T>(x[2i], x[2i+1]) (two 16-bit values, x[2i] in the low half).
extern "C" __global__ void pack_halves(const float* x, unsigned* out_h, unsigned* out_b, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float lo = gload(x + 2 * i), hi = gload(x + 2 * i + 1);
        gstore(out_h + i, cvt_pack2<__half>(lo, hi));
        gstore(out_b + i, cvt_pack2<__nv_bfloat16>(lo, hi));
    }
}

// out[i] = cuflash_exp2(x[i])
extern "C" __global__ void exp2_of(const float* x, float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        gstore(out + i, cuflash_exp2(gload(x + i)));
}

// The atomic order check.  Each thread adds three times into its own element (block b owns
// elements [b*n, b*n + n)): one adder per address, in program order -- repeatable, passes.
extern "C" __global__ void own_atomics(float* out, double* out64, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        for (int r = 1; r <= 3; ++r) {
            gatomic_add(out + blockIdx.x * n + i, (float)r);
            gatomic_add(out64 + blockIdx.x * n + i, (double)r);
            gred_add(out + gridDim.x * n + blockIdx.x * n + i, (float)r);
        }
}

// Planted: thread 1 of every block also adds into thread 0's element (one block is enough
// for a run-dependent order: two warps' adds race to the address).
extern "C" __global__ void shared_atomic_in_block(float* out) {
    gatomic_add(out + blockIdx.x * 32 + (threadIdx.x == 1 ? 0 : threadIdx.x), 1.0f);
}

// Planted: a .v4 red of block 1 overlaps the scalar reds of block 0 in one element.
extern "C" __global__ void overlapping_vector_reds(float* out) {
    if (blockIdx.x == 0) gred_add(out + threadIdx.x, 1.0f);
    else if (threadIdx.x == 0) gred_add_v4(out + 28, 1.0f, 1.0f, 1.0f, 1.0f);
}

// Planted: a double atomic shared by two blocks.
extern "C" __global__ void shared_double_atomic(double* out) {
    if (threadIdx.x == 0) gatomic_add(out + 3, 1.0);
}

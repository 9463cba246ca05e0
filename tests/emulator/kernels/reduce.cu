// Block sum reduction with warp shuffles + shared memory, and a max via
// __shfl_down_sync / __shfl_up_sync / ballot, for the emulator tests.
// out[blockIdx.x] = sum of x[i] over the block's slice; threads beyond n
// return early (they must drop out of the __syncthreads below).
#include "portable.cuh"

extern "C" __global__ void block_sum(const float* x, float* out, int n, int per_block) {
    __shared__ float warp_sums[32];  // one partial sum per warp
    const int begin = blockIdx.x * per_block;
    const int i = begin + threadIdx.x;
    float v = 0.0f;
    for (int j = i; j < begin + per_block && j < n; j += blockDim.x) v += gload(x + j);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();  // warp_sums complete before warp 0 reads them
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) / 32;
        float s = lane < nwarps ? warp_sums[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) gstore(out + blockIdx.x, s);
    }
}

// The same with the __syncthreads removed: warp 0 may read warp_sums before
// the other warps wrote it.  Only for the race checker test.
extern "C" __global__ void block_sum_racy(const float* x, float* out, int n, int per_block) {
    __shared__ float warp_sums_racy[32];
    const int begin = blockIdx.x * per_block;
    const int i = begin + threadIdx.x;
    float v = 0.0f;
    for (int j = i; j < begin + per_block && j < n; j += blockDim.x) v += gload(x + j);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums_racy[warp] = v;
    __syncwarp();  // not enough: orders the lanes of one warp, not the warps
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) / 32;
        float s = lane < nwarps ? warp_sums_racy[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) gstore(out + blockIdx.x, s);
    }
}

// Warp primitives one by one: each lane writes what it received.
//   out[0*32 + l] = __shfl_sync(v, (l * 7) % 32)
//   out[1*32 + l] = __shfl_up_sync(v, 3)        (own value for l < 3)
//   out[2*32 + l] = __shfl_down_sync(v, 5)      (own value for l >= 27)
//   out[3*32 + l] = __shfl_xor_sync(v, 6, width 8)
//   out[4*32 + l] = ballot(v > 10) (as float bits -> stored as int)
//   out[5*32 + l] = any(v > 30), out[6*32 + l] = all(v >= 0)
extern "C" __global__ void warp_ops(const float* x, int* ballots, float* out) {
    const int l = threadIdx.x;
    const float v = gload(x + l);
    gstore(out + 0 * 32 + l, __shfl_sync(0xffffffffu, v, (l * 7) % 32));
    gstore(out + 1 * 32 + l, __shfl_up_sync(0xffffffffu, v, 3));
    gstore(out + 2 * 32 + l, __shfl_down_sync(0xffffffffu, v, 5));
    gstore(out + 3 * 32 + l, __shfl_xor_sync(0xffffffffu, v, 6, 8));
    __syncwarp();
    gstore(ballots + 0 * 32 + l, (int)__ballot_sync(0xffffffffu, v > 10.0f));
    gstore(ballots + 1 * 32 + l, __any_sync(0xffffffffu, v > 30.0f));
    gstore(ballots + 2 * 32 + l, __all_sync(0xffffffffu, v >= 0.0f));
}

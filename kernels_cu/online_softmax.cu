// online_softmax_rows: row-wise softmax p = exp(x - m) / l of a (rows, cols) matrix, with
// the statistics m = max(x) and l = sum(exp(x - m)) accumulated in one streaming pass over
// chunks of `chunk` columns (the online softmax of Milakov & Gimelshein 2018, as FlashAttention uses it):
//     m_new = max(m, max(x_chunk)); l = l * exp(m - m_new) + sum(exp(x_chunk - m_new))
// followed by a pass that writes p with the final (m, l).
//
// Layout: one warp per row, ROWS_PER_BLOCK (4) rows per block of 128 threads; lane L reads
// columns c0 + L, c0 + L + 32, ... of each chunk (coalesced).  The chunk max and chunk sum
// are warp reductions with shuffles (no shared memory, no __syncthreads).  A chunk is read
// twice (max, then exp-sum; the second read hits the cache on a GPU) and the row once more
// to write p.
//
// Rows whose entries are all -inf get m = -inf, l = 0 and p = 0 (cuflash.reference's
// convention); NaN propagates.
//
// Compile-time parameters: CUFLASH_DTYPE_F16 | _BF16 | _F32 | _F64 (input/output dtype;
// statistics in float32, double for float64).  Launch: grid ceil(rows / 4), block 128.
// Limits: cols and chunk are ints (< 2^31); rows up to 65535 * 2^16 blocks.
#include "dtype.cuh"

constexpr int kRowsPerBlock = 4;


__device__ inline acc_t warp_max(acc_t x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = acc_max(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

__device__ inline acc_t warp_sum(acc_t x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

extern "C" __global__ void online_softmax_rows(
    const elem_t* __restrict__ X, elem_t* __restrict__ P, acc_t* __restrict__ M,
    acc_t* __restrict__ L, int rows, int cols, int chunk, long long x_sr, long long p_sr)
{
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
    // a whole warp leaves together, so the shuffles below always see all 32 lanes
    if (r >= rows) return;
    const elem_t* x = X + r * x_sr;

    acc_t m = -INFINITY, l = 0;
    for (int c0 = 0; c0 < cols; c0 += chunk) {
        const int c1 = min(cols, c0 + chunk);
        // -- chunk max
        acc_t cm = -INFINITY;
        for (int c = c0 + lane; c < c1; c += 32) cm = acc_max(cm, to_acc(gload(x + c)));
        cm = warp_max(cm);
        // -- rescale the running sum to the new max and add the chunk's terms; while the
        //    max is still -inf, subtract 0 so that exp(-inf) = 0 instead of NaN
        const acc_t m_new = acc_max(m, cm);
        const acc_t m_use = m_new == acc_t(-INFINITY) ? acc_t(0) : m_new;
        acc_t cs = 0;
        for (int c = c0 + lane; c < c1; c += 32) cs += acc_exp(to_acc(gload(x + c)) - m_use);
        cs = warp_sum(cs);
        l = l * acc_exp(m - m_use) + cs;
        m = m_new;
    }
    // -- p = exp(x - m) / l with the final statistics (a row of only -inf: m = -inf, l = 0;
    //    shift by 0 and divide by 1 so that p = 0 there, as the reference does)
    const acc_t m_fin = m == acc_t(-INFINITY) ? acc_t(0) : m;
    const acc_t l_fin = l == acc_t(0) ? acc_t(1) : l;
    elem_t* p = P + r * p_sr;
    for (int c = lane; c < cols; c += 32)
        gstore(p + c, from_acc(acc_exp(to_acc(gload(x + c)) - m_fin) / l_fin));
    if (lane == 0) {
        gstore(M + r, m);
        gstore(L + r, l);
    }
}

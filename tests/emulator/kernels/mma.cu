// Tensor-core building blocks of portable.cuh, checked against NumPy:
//   matmul_mma:  C = A @ B through ldmatrix + mma.m16n8k16 (DTYPE = __half or __nv_bfloat16)
//   cp_async_pipeline: a two-stage cp.async double buffer.
// Sizes need not be tile multiples: out-of-range elements are loaded as 0.
#include "portable.cuh"

#ifndef DTYPE
#define DTYPE __half
#endif
typedef DTYPE T;

#define BM 32  // rows of C per block: one m16 tile per warp, 2 warps
#define BN 16  // columns of C per block: two n8 tiles
#define BK 16  // k per step: one mma k16
#define PAD 8  // row padding (elements): rows stay 16-byte aligned for ldmatrix

// A (M, K) row-major, B (K, N) row-major, C (M, N) float32.  Grid (ceil(N/BN), ceil(M/BM)), 64 threads.
// variant 0: A by ldmatrix_x4, B by ldmatrix_x4_trans;
// variant 1: A by two ldmatrix_x2, B by ldmatrix_x1_trans;  variant 2: B by ldmatrix_x2_trans.
extern "C" __global__ void matmul_mma(const T* A, const T* B, float* C, int M, int N, int K, int variant) {
    __shared__ __align__(16) T As[BM][BK + PAD];  // (BM, BK) tile of A
    __shared__ __align__(16) T Bs[BK][BN + PAD];  // (BK, BN) tile of B
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, r0 = warp * 16;
    float acc[2][4] = {};  // two n8 tiles of the warp's 16 x 16 piece of C
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += blockDim.x) {
            const int r = i / BK, c = i % BK;
            As[r][c] = (m0 + r < M && k0 + c < K) ? gload(A + (m0 + r) * K + k0 + c) : T(0.0f);
        }
        for (int i = tid; i < BK * BN; i += blockDim.x) {
            const int r = i / BN, c = i % BN;
            Bs[r][c] = (k0 + r < K && n0 + c < N) ? gload(B + (k0 + r) * N + n0 + c) : T(0.0f);
        }
        __syncthreads();  // tiles complete before the warps load fragments
        uint32_t a[4], b[2][2];
        if (variant == 0) {
            ldmatrix_x4(a, &As[r0 + lane % 16][(lane / 16) * 8]);
            uint32_t bb[4];  // matrices: (k0-7, n0-7), (k8-15, n0-7), (k0-7, n8-15), (k8-15, n8-15)
            ldmatrix_x4_trans(bb, &Bs[lane % 8 + ((lane / 8) % 2) * 8][(lane / 16) * 8]);
            b[0][0] = bb[0]; b[0][1] = bb[1]; b[1][0] = bb[2]; b[1][1] = bb[3];
        } else {
            uint32_t lo[2], hi[2];  // rows 0-7 / 8-15 of the warp's 16 rows, at k 0-7 and k 8-15
            ldmatrix_x2(lo, &As[r0 + lane % 16][0]);
            ldmatrix_x2(hi, &As[r0 + lane % 16][8]);
            a[0] = lo[0]; a[1] = lo[1]; a[2] = hi[0]; a[3] = hi[1];
            for (int j = 0; j < 2; ++j) {
                if (variant == 1) {
                    uint32_t x[1], y[1];
                    ldmatrix_x1_trans(x, &Bs[lane % 8][j * 8]);
                    ldmatrix_x1_trans(y, &Bs[8 + lane % 8][j * 8]);
                    b[j][0] = x[0]; b[j][1] = y[0];
                } else {
                    uint32_t x[2];
                    ldmatrix_x2_trans(x, &Bs[lane % 16][j * 8]);
                    b[j][0] = x[0]; b[j][1] = x[1];
                }
            }
        }
        mma_m16n8k16<T>(acc[0], a, b[0], acc[0]);
        mma_m16n8k16<T>(acc[1], a, b[1], acc[1]);
        __syncthreads();  // fragments loaded before the next step overwrites As / Bs
    }
    const int g = lane / 4, t = lane % 4;
    for (int j = 0; j < 2; ++j)
        for (int i = 0; i < 4; ++i) {
            const int row = m0 + r0 + g + 8 * (i / 2), col = n0 + j * 8 + 2 * t + (i % 2);
            if (row < M && col < N) gstore(C + row * N + col, acc[j][i]);
        }
}

// x (ntiles, 64) float32 -> y[t][i] = 2 * x[t][i] + t, streaming the tiles
// through a two-stage cp.async buffer in dynamic shared memory (2 x 64 floats).
// 16 threads, each copies one 16-byte chunk per tile.  `wait_depth` picks the
// cp_async_wait<N> before a tile is used: 1 (or 0) is right; 2 or -1 (no wait)
// reads the buffer before the copy landed, which the test must catch.
extern "C" __global__ void cp_async_pipeline(const float* x, float* y, int ntiles, int wait_depth) {
    CUFLASH_DYNAMIC_SHARED(float, buf);  // (2, 64): stage s at buf + 64 * s
    const int tid = threadIdx.x;
    cp_async_16(buf + 4 * tid, x + 4 * tid);
    cp_async_commit();
    for (int t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) cp_async_16(buf + 64 * ((t + 1) % 2) + 4 * tid, x + 64 * (t + 1) + 4 * tid);
        cp_async_commit();  // (possibly empty) group for tile t + 1
        if (wait_depth == 0) cp_async_wait<0>();
        else if (wait_depth == 1) cp_async_wait<1>();  // tile t landed; t + 1 may be in flight
        else if (wait_depth == 2) cp_async_wait<2>();
        __syncthreads();  // every thread's chunk of tile t is visible
        const float* tile = buf + 64 * (t % 2);
        for (int i = tid; i < 64; i += blockDim.x) gstore(y + 64 * t + i, 2.0f * tile[i] + (float)t);
        __syncthreads();  // tile t read before stage t % 2 is refilled with tile t + 2
    }
}

// The TF32 building blocks of portable.cuh (its last section), checked against NumPy by
// tests/emulator/test_emulator_tf32.py:
//   tf32_round:  y[i] = the float value of cvt_rna_tf32(x[i]) (cvt.rna.tf32.f32);
//   tf32_split:  hi[i], lo[i] = the bit patterns split_tf32 (inf_safe 0) or split_tf32_inf
//                (inf_safe 1) gives x[i] (3xTF32 operands);
//   matmul_tf32: C = A @ B (float32, row-major) through mma.m16n8k8 with tf32 operands, one
//                warp per 16 x 8 tile of C, fragments read straight from global memory in the
//                PTX ISA layout; `mode` 0: operands cvt_rna_tf32(x) (1xTF32); 1: 3xTF32
//                (split_tf32 + mma_m16n8k8_3xtf32); 2: the raw float bits as operands (what
//                the tensor core reads of a float that is not tf32); 3: as 1 with B split by
//                split_tf32_inf (K's split in the kernels).
// Sizes need not be multiples of the tile: out-of-range elements are 0.
#include "portable.cuh"

extern "C" __global__ void tf32_round(const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(y + i, tf32_to_float(cvt_rna_tf32(gload(x + i))));
}

extern "C" __global__ void tf32_split(const float* x, unsigned* hi, unsigned* lo, int n, int inf_safe) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        uint32_t h, l;
        if (inf_safe) split_tf32_inf(gload(x + i), h, l);
        else split_tf32(gload(x + i), h, l);
        gstore(hi + i, (unsigned)h);
        gstore(lo + i, (unsigned)l);
    }
}

__device__ __forceinline__ float at(const float* M, int rows, int cols, int r, int c) {
    return (r < rows && c < cols) ? gload(M + r * cols + c) : 0.0f;
}

// Grid (ceil(N / 8), ceil(M / 16)), 32 threads.
extern "C" __global__ void matmul_tf32(const float* A, const float* B, float* C, int M, int N, int K,
                                       int mode) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * 16, n0 = blockIdx.x * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 8) {
        // A (16 x 8): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
        const float af[4] = {at(A, M, K, m0 + g, k0 + t), at(A, M, K, m0 + g + 8, k0 + t),
                             at(A, M, K, m0 + g, k0 + t + 4), at(A, M, K, m0 + g + 8, k0 + t + 4)};
        // B (8 x 8): b0 = (t, g), b1 = (t+4, g)
        const float bf[2] = {at(B, K, N, k0 + t, n0 + g), at(B, K, N, k0 + t + 4, n0 + g)};
        uint32_t a[4], b[2], a_lo[4], b_lo[2];
        for (int i = 0; i < 4; ++i) {
            if (mode == 1 || mode == 3) split_tf32(af[i], a[i], a_lo[i]);
            else a[i] = mode == 0 ? cvt_rna_tf32(af[i]) : __float_as_uint(af[i]);
        }
        for (int i = 0; i < 2; ++i) {
            if (mode == 1) split_tf32(bf[i], b[i], b_lo[i]);
            else if (mode == 3) split_tf32_inf(bf[i], b[i], b_lo[i]);
            else b[i] = mode == 0 ? cvt_rna_tf32(bf[i]) : __float_as_uint(bf[i]);
        }
        if (mode == 1 || mode == 3) mma_m16n8k8_3xtf32(acc, a, a_lo, b, b_lo, acc);
        else mma_m16n8k8_tf32(acc, a, b, acc);
    }
    for (int i = 0; i < 4; ++i) {
        const int row = m0 + g + 8 * (i / 2), col = n0 + 2 * t + (i % 2);
        if (row < M && col < N) gstore(C + row * N + col, acc[i]);
    }
}

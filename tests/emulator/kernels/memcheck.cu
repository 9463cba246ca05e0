// Kernels with planted out-of-bounds accesses for the emulator's memcheck
// (tests/emulator/test_emulator_memcheck.py).  Each takes an element offset `off` added to an index
// that is in bounds at off = 0; the tests pass one past the end, far away and before the
// start.  The lines marked ACCESS are the ones the tests expect in the messages.
#include "portable.cuh"

extern "C" __global__ void global_load(const float* x, float* y, int n, int off) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float v = gload(x + i + off);  // ACCESS global_load
        gstore(y + i, v);
    }
}

extern "C" __global__ void global_store(const float* x, float* y, int n, int off) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gstore(y + i + off, gload(x + i));  // ACCESS global_store
}

extern "C" __global__ void global_atomic(float* acc, int off) {
    gatomic_add(acc + threadIdx.x + off, 1.0f);  // ACCESS global_atomic
}

// One 16-byte cp.async per thread: x (global) -> shared chunk threadIdx.x + soff, then back.
extern "C" __global__ void async_copy(const float* x, float* y, int goff, int soff) {
    CUFLASH_DYNAMIC_SHARED(float, s);
    const int t = threadIdx.x;
    cp_async_16(s + 4 * (t + soff), x + 4 * (t + goff));  // ACCESS async_copy
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int k = 0; k < 4; ++k) gstore(y + 4 * t + k, s[4 * t + k]);
}

// Every thread writes its element of the dynamic shared memory, then reads element t + off.
extern "C" __global__ void shared_load(const float* x, float* y, int off) {
    CUFLASH_DYNAMIC_SHARED(float, s);
    const int t = threadIdx.x;
    s[t] = gload(x + t);
    __syncthreads();
    gstore(y + t, s[t + off]);  // ACCESS shared_load
}

extern "C" __global__ void shared_store(const float* x, float* y, int off) {
    CUFLASH_DYNAMIC_SHARED(float, s);
    const int t = threadIdx.x;
    s[t + off] = gload(x + t);  // ACCESS shared_store
    __syncthreads();
    gstore(y + t, s[t]);
}

// ldmatrix.x4 over a 32 x 8 tile of 16-bit elements (512 bytes of shared memory): lane l gives
// row l + off.
extern "C" __global__ void ldmatrix_rows(const unsigned short* x, unsigned* y, int off) {
    CUFLASH_DYNAMIC_SHARED(unsigned short, s);
    const int t = threadIdx.x;
    for (int k = 0; k < 8; ++k) s[8 * t + k] = gload(x + 8 * t + k);
    __syncthreads();
    uint32_t r[4];
    ldmatrix_x4(r, s + 8 * (t + off));  // ACCESS ldmatrix_rows
    for (int j = 0; j < 4; ++j) gstore(y + 4 * t + j, r[j]);
}

// An index read (CUFLASH_INDEX: cu_seqlens, seqlens_k, block tables in the serving kernels).
extern "C" __global__ void index_read(const int* idx, float* y, int n, int off) {
    const int i = threadIdx.x;
    if (i < n) gstore(y + i, (float)CUFLASH_INDEX(idx, i + off));  // ACCESS index_read
}

// Shared-memory access patterns with known bank-conflict and sector counts, for the
// emulator's profiler (tests/emulator/test_emulator_profile.py).  One warp each; the lines marked
// SITE are the ones the tests look up.  Shared memory is read uninitialised (NaN-filled by
// the emulator): only the addresses matter here.
#include "portable.cuh"
#include "fast_math.cuh"

// Lane l reads element (l, c) of a 32 x `stride` float tile: stride 32 puts every lane in
// bank c (a 32-way conflict), stride 33 in 32 different banks.
extern "C" __global__ void column_read(float* y, int stride) {
    CUFLASH_DYNAMIC_SHARED(float, s);
    const int l = threadIdx.x;
    gstore(y + l, s[l * stride + 5]);  // SITE column_read
}

// The same column through an XOR swizzle: element (r, c) stored at r * 32 + (c ^ r).
extern "C" __global__ void swizzled_column_read(float* y) {
    CUFLASH_DYNAMIC_SHARED(float, s);
    const int l = threadIdx.x;
    gstore(y + l, s[l * 32 + (5 ^ l)]);  // SITE swizzled_column_read
}

// 64-bit loads: lane l reads float2 number l * step.
extern "C" __global__ void read64(float* y, int step) {
    CUFLASH_DYNAMIC_SHARED(float2, s);
    const int l = threadIdx.x;
    const float2 v = s[l * step];  // SITE read64
    gstore(y + l, v.x + v.y);
}

// 128-bit loads: lane l reads float4 number l * step.
extern "C" __global__ void read128(float* y, int step) {
    CUFLASH_DYNAMIC_SHARED(float4, s);
    const int l = threadIdx.x;
    const float4 v = s[l * step];  // SITE read128
    gstore(y + l, v.x + v.y + v.z + v.w);
}

// ldmatrix.x4 over rows of `row_elems` 16-bit elements: lane l gives row l.  64 elements
// (128 bytes) put all 8 rows of a matrix on the same 4 banks; 72 (144 bytes) spreads them.
extern "C" __global__ void ldmatrix_rows(unsigned* y, int row_elems) {
    CUFLASH_DYNAMIC_SHARED(unsigned short, s);
    const int l = threadIdx.x;
    uint32_t r[4];
    ldmatrix_x4(r, s + l * row_elems);  // SITE ldmatrix_rows
    gstore(y + l, r[0] ^ r[1] ^ r[2] ^ r[3]);
}

// cp.async of 16 bytes per lane from x (contiguous) to shared chunk l * step (16-byte chunks).
extern "C" __global__ void async_copy(const float4* x, float* y, int step) {
    CUFLASH_DYNAMIC_SHARED(float4, s);
    const int l = threadIdx.x;
    cp_async_16(s + l * step, x + l);  // SITE async_copy
    cp_async_commit();
    cp_async_wait<0>();
    gstore(y + l, s[l * step].x);
}

// Global loads: 16 bytes per lane, consecutive (coalesced: 16 sectors for 512 bytes).
extern "C" __global__ void global_vec_load(const float4* x, float* y) {
    const int l = threadIdx.x;
    const float4 v = gload(x + l);  // SITE global_vec_load
    gstore(y + l, v.x + v.w);
}

// Global loads: 4 bytes per lane, `stride` floats apart.
extern "C" __global__ void global_strided_load(const float* x, float* y, int stride) {
    const int l = threadIdx.x;
    gstore(y + l, gload(x + l * stride));  // SITE global_strided_load
}

// Executed counts: per lane, two shuffles, one __syncthreads, one exp2, one __syncwarp and
// one rcp (fast_math.cuh's, with its own exp2); one warp.
extern "C" __global__ void counted(float* y) {
    const int l = threadIdx.x;
    float v = (float)l;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    __syncthreads();
    __syncwarp();
    gstore(y + l, cuflash_exp2(v) + cuflash_tanh_rcp(-v));
}

// TMA copies (tma_load of hopper.cuh, sm_90) checked against NumPy by test_emulator_tma.py.
// tma_box<R>: thread 0 initialises an mbarrier and copies the box at `c` (innermost first)
// into shared byte `dst_off`; every thread waits on the barrier; the shared bytes go to out
// raw (the test checks the swizzled image).  mode 1: read before the wait.
// tma_wgmma: A (64 x 64) and B (64 x 64), float16, by TMA with the 128-byte swizzle (boxes
// of 64 rows x 64 columns), then D = A B^T by four wgmma_ss whose K-major descriptors step
// 32 bytes along the swizzled rows.
#include "portable.cuh"
#include "hopper.cuh"

// The dynamic shared memory from its first 1024-byte aligned shared address: the swizzle
// patterns repeat on 1024-byte boundaries of the address, and a GPU's dynamic shared memory
// need not start on one (the emulator's starts at address 0).  Launches add 1024 bytes.
__device__ unsigned char* aligned_smem() {
    CUFLASH_DYNAMIC_SHARED(unsigned char, raw);
    const unsigned a = (unsigned)__cvta_generic_to_shared(raw);
    return raw + ((1024u - (a & 1023u)) & 1023u);
}

template <int R>
__device__ void box(const unsigned char* tmap, const int* c, int bytes, int dst_off, unsigned char* out, int mode) {
    unsigned char* smem = aligned_smem();
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* dst = smem + dst_off;
    if (threadIdx.x == 0) {
        mbarrier_init(bar, 1);
        fence_proxy_async();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int coords[R];
        for (int i = 0; i < R; ++i) coords[i] = c[i];
        mbarrier_arrive_expect_tx(bar, bytes);
        tma_load<R>(dst, tmap, coords, bar);
    }
    if (mode != 1) mbarrier_wait_parity(bar, 0);
    for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = dst[i];
    if (mode == 1) mbarrier_wait_parity(bar, 0);
}

extern "C" __global__ void tma_box2(const unsigned char* tmap, const void* x, const int* c, int bytes, int dst_off,
                                    unsigned char* out, int mode) {
    box<2>(tmap, c, bytes, dst_off, out, mode);
}
extern "C" __global__ void tma_box3(const unsigned char* tmap, const void* x, const int* c, int bytes, int dst_off,
                                    unsigned char* out, int mode) {
    box<3>(tmap, c, bytes, dst_off, out, mode);
}

extern "C" __global__ void tma_wgmma(const unsigned char* tmap_a, const unsigned char* tmap_b, const void* a,
                                     const void* b, float* out) {
    unsigned char* smem = aligned_smem();
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    unsigned char* sa = smem + 1024;         // 64 rows x 128 bytes, 1024-byte aligned
    unsigned char* sb = sa + 64 * 128;
    if (threadIdx.x == 0) {
        mbarrier_init(bar, 1);
        fence_proxy_async();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int c[2] = {0, 0};
        mbarrier_arrive_expect_tx(bar, 2 * 64 * 128);
        tma_load<2>(sa, tmap_a, c, bar);
        tma_load<2>(sb, tmap_b, c, bar);
    }
    mbarrier_wait_parity(bar, 0);
    float d[32];
    wgmma_fence();
    for (int k = 0; k < 4; ++k)  // K-major, 128-byte swizzle: rows of 128 bytes, 8-row groups 1024 apart
        wgmma_ss<64, false, false, false>(d, wgmma_desc(sa + 32 * k, 16, 1024, 128), wgmma_desc(sb + 32 * k, 16, 1024, 128),
                                          k > 0);
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

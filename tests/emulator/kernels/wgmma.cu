// Warpgroup MMA of hopper.cuh (sm_90a), checked against NumPy by test_emulator_wgmma.py.
// Compiled with -DWG_N=<N> -DWG_BF16=<0|1> -DWG_TA=<0|1> -DWG_TB=<0|1>.
//
// wg_ss: the dynamic shared memory is `img` (laid out by the test in a canonical layout),
// then `steps` wgmma_ss on one accumulator, descriptor i at (offset + i * kstep) of the
// operand: D = sum_i A_i B_i (+ D0 = 0.5 (register + 1) when `init`).  out: each thread's
// N / 2 registers, thread-major.
// wg_rs: A from registers (the mma.m16n8k16 A fragment of `a`, 64 x 16 row-major), B as in
// wg_ss, one step; mode 1 writes an A register before the wait.
// mode (wg_ss): 0 plain; 1 read D before the wait (into out, then wait); 2 a store to A's
// shared memory before the wait; 3 no wgmma.fence; 4 return with the wgmma in flight;
// 5 two commit groups on two accumulators, wait<1> then wait<0> (out: D1 after wait<1>,
// then D2 after wait<1>, then D2 after wait<0>); 6 a write to D in flight; 7 setmaxnreg first;
// 8 no fence.proxy.async after the generic stores of the operands.
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

constexpr int kN = WG_N;
constexpr int kRegs = WG_N / 2;

// An operand's layout: {offset, lbo, sbo, swizzle, kstep} (bytes; swizzle 0, 32, 64, 128).
struct Operand { int offset, lbo, sbo, swizzle, kstep; };
__device__ Operand operand(const int* p) { return Operand{p[0], p[1], p[2], p[3], p[4]}; }

__device__ void load_image(unsigned char* smem, const uint4* img, int nvec, bool fence = true) {
    for (int i = threadIdx.x; i < nvec; i += blockDim.x)
        reinterpret_cast<uint4*>(smem)[i] = img[i];
    if (fence) fence_proxy_async();  // the generic stores before the tensor cores' (async proxy) reads
    __syncthreads();
}

__device__ uint64_t desc_of(unsigned char* smem, const Operand& o, int step) {
    return wgmma_desc(smem + o.offset + step * o.kstep, o.lbo, o.sbo, o.swizzle);
}

__device__ void store(float* out, const float (&d)[kRegs]) {
    for (int i = 0; i < kRegs; ++i) out[threadIdx.x * kRegs + i] = d[i];
}

// __launch_bounds__: ptxas honours setmaxnreg only where it knows the registers at entry (C7508)
extern "C" __global__ void __launch_bounds__(128, 1) wg_ss(const uint4* img, int nvec, const int* pa, const int* pb, int steps, int init,
                                 int mode, float* out) {
    unsigned char* smem = aligned_smem();
    const Operand a = operand(pa), b = operand(pb);
    load_image(smem, img, nvec, mode != 8);
    float d[kRegs];
    for (int i = 0; i < kRegs; ++i) d[i] = init ? 0.5f * (i + 1) : 0.0f;
    if (mode == 7) setmaxnreg_inc<240>();
    if (mode != 3) wgmma_fence();
    if (mode == 5) {
        float d2[kRegs];
        wgmma_ss<kN, WG_BF16, WG_TA, WG_TB>(d, desc_of(smem, a, 0), desc_of(smem, b, 0), false);
        wgmma_commit();
        wgmma_ss<kN, WG_BF16, WG_TA, WG_TB>(d2, desc_of(smem, a, 1), desc_of(smem, b, 1), false);
        wgmma_commit();
        wgmma_wait<1>();
        store(out, d);
        store(out + blockDim.x * kRegs, d2);
        wgmma_wait<0>();
        store(out + 2 * blockDim.x * kRegs, d2);
        return;
    }
    for (int s = 0; s < steps; ++s)
        wgmma_ss<kN, WG_BF16, WG_TA, WG_TB>(d, desc_of(smem, a, s), desc_of(smem, b, s), s > 0 || init);
    wgmma_commit();
    if (mode == 1) store(out, d);
    if (mode == 2 && threadIdx.x == 0) smem[a.offset] ^= 0x40;
    if (mode == 6) d[0] = 1.0f;
    if (mode == 4) return;
    wgmma_wait<0>();
    wgmma_fence_operand(d);
    if (mode != 1) store(out, d);
}

extern "C" __global__ void wg_rs(const uint4* img, int nvec, const unsigned short* a, const int* pb, int init,
                                 int mode, float* out) {
    unsigned char* smem = aligned_smem();
    const Operand b = operand(pb);
    load_image(smem, img, nvec);
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, row = 16 * (threadIdx.x / 32 % 4) + g;
    uint32_t frag[4];
    for (int r = 0; r < 4; ++r) {  // (row g | g + 8, k 2t | 2t + 8), two halves each
        const int m = row + 8 * (r & 1), k = 2 * t + 8 * (r >> 1);
        frag[r] = uint32_t(a[m * 16 + k]) | (uint32_t(a[m * 16 + k + 1]) << 16);
    }
    float d[kRegs];
    for (int i = 0; i < kRegs; ++i) d[i] = init ? 0.5f * (i + 1) : 0.0f;
    wgmma_fence();
    wgmma_rs<kN, WG_BF16, WG_TB>(d, frag, desc_of(smem, b, 0), init);
    if (mode == 1) frag[0] ^= 1u;  // the A registers of a wgmma in flight
    wgmma_commit();
    wgmma_wait<0>();
    store(out, d);
}

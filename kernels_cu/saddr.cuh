// saddr.cuh -- ldmatrix by 32-bit shared-memory address, for the tensor-core kernels
// (flash_fwd_tc.cu, flash_bwd_tc.cu).
//
// ldmatrix operands as one per-lane shared-memory address (the lane's row and column of the
// fragment, computed once per block) plus a compile-time byte offset per fragment, which
// ptxas folds into the instruction ([R+imm]).  Written as pointer + (lane terms + fragment
// terms), ptxas recomputed each fragment's address from the lane index every tile (~90
// integer instructions per K/V tile at d = 128: the constant part OR-ed into lane bits, then
// multiplied by the row stride).  On the emulator the address is a byte pointer.
#ifndef CUFLASH_SADDR_CUH
#define CUFLASH_SADDR_CUH
#ifdef CUFLASH_EMULATOR
typedef const unsigned char* saddr_t;
__device__ __forceinline__ saddr_t saddr_of(const void* p) { return (saddr_t)p; }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], saddr_t a CUFLASH_SITE) { ldmatrix_x4(r, a, CUFLASH_SITE_ARGS); }
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], saddr_t a CUFLASH_SITE) {
    ldmatrix_x4_trans(r, a, CUFLASH_SITE_ARGS);
}
#else
typedef uint32_t saddr_t;
__device__ __forceinline__ saddr_t saddr_of(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], saddr_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], saddr_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}
#endif
#endif  // CUFLASH_SADDR_CUH

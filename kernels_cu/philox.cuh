// philox.cuh -- Philox4x32-10, the counter-based generator of the attention dropout mask.
//
// Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3" (SC 2011).
// A pure function of (counter, key): any thread can draw the number of any element without
// state, so the forward draws the mask and the backward regenerates it instead of storing
// it, and the NumPy reference (cuflash/reference/masks.py) draws the same bits.
//
// The dropout mask of cuflash: element (b, h, i, j) -- batch b and head h of the launch's
// (B, H) problem grid, query row i, key j -- is kept iff word (j & 3) of
// philox(counter = (j >> 2, i, h, b), key = (seed_lo, seed_hi)) >= threshold, with
// threshold = round(p * 2^32): one Philox block serves four consecutive keys, so a thread
// that owns keys 4m..4m+3 draws once for all four.
#pragma once
#include "portable.cuh"

// Ten rounds: (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1,
// lo(M0 c0)); the key grows by the Weyl constants between rounds.
__device__ __forceinline__ void cuflash_philox4x32_10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const uint32_t hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        c[0] = hi1 ^ c[1] ^ k0;
        c[1] = lo1;
        c[2] = hi0 ^ c[3] ^ k1;
        c[3] = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

// The four words of the block holding keys 4m..4m+3 (m = j >> 2) of row i, problem (b, h).
__device__ __forceinline__ void cuflash_dropout_block(uint32_t (&w)[4], uint32_t k0, uint32_t k1,
                                                      int b, int h, int i, int m) {
    w[0] = (uint32_t)m;
    w[1] = (uint32_t)i;
    w[2] = (uint32_t)h;
    w[3] = (uint32_t)b;
    cuflash_philox4x32_10(w, k0, k1);
}

// Whether element (b, h, i, j) is kept (one Philox block per call: for a single key).
__device__ __forceinline__ bool cuflash_dropout_keep(uint32_t k0, uint32_t k1, uint32_t threshold,
                                                     int b, int h, int i, int j) {
    uint32_t w[4];
    cuflash_dropout_block(w, k0, k1, b, h, i, j >> 2);
    // select without a dynamic register index (which would put w in local memory)
    const uint32_t x = (j & 2) ? ((j & 1) ? w[3] : w[2]) : ((j & 1) ? w[1] : w[0]);
    return x >= threshold;
}

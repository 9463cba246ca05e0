// philox.cuh -- Philox4x32-10, the counter-based generator of the attention dropout mask.
//
// Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3" (SC 2011).
// A pure function of (counter, key): any thread can draw the number of any element without
// state, so the forward draws the mask and the backward regenerates it instead of storing
// it, and the NumPy reference (cuflash/reference/masks.py) draws the same bits.
//
// The dropout mask of cuflash draws 16 bits per element, eight elements per Philox block:
// element (b, h, i, j) -- batch b and head h of the launch's (B, H) problem grid, query row i,
// key j -- is kept iff half (j & 1) (the low 16 bits for even j) of word
// 2 ((i >> 3) & 1) + ((j >> 3) & 1) of
//     philox(counter = (4 (j >> 4) + ((j >> 1) & 3), 8 (i >> 4) + (i & 7), h, b),
//            key = (seed_lo, seed_hi))
// is >= threshold = round(p * 2^16) (at most 2^16 - 1).  One block holds rows {i, i + 8} x keys
// {2t, 2t + 1, 2t + 8, 2t + 9} of a 16 x 16 tile (t = (j >> 1) & 3): exactly the eight logits
// lane (g, t) of an m16n8 accumulator pair holds (rows g, g + 8; keys 2t, 2t + 1 of two n8
// tiles), so the tensor-core forward draws one block per eight logits with no exchange between
// lanes, and the backward's transposed fragments one per eight with one shuffle
// (bwd_masks.cuh).  16 bits put the drop probability within 2^-17 of p (a 32-bit draw per
// element cost twice the Philox rounds per logit: bench/results/feature_counts.md).
#pragma once
#include "portable.cuh"

// One round: (c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1,
// lo(M0 c0)) with the round's key halves k0, k1.
__device__ __forceinline__ void cuflash_philox_round(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
    c[0] = hi1 ^ c[1] ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c[3] ^ k1;
    c[3] = lo0;
}

// Ten rounds; the key grows by the Weyl constants between rounds.
__device__ __forceinline__ void cuflash_philox4x32_10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        cuflash_philox_round(c, k0, k1);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

// The same ten rounds with round r's key halves (k0 + r 0x9E3779B9, k1 + r 0xBB67AE85, mod
// 2^32) given as the low and high words of rk[r]: kernel arguments that the launcher computes
// from the seed (cuflash.launch.bwd_tc.round_keys), which ptxas reads from the constant bank
// instead of adding the Weyl constants per round and block step.
__device__ __forceinline__ void cuflash_philox4x32_10_keyed(uint32_t (&c)[4], const unsigned long long (&rk)[10]) {
#pragma unroll
    for (int r = 0; r < 10; ++r) cuflash_philox_round(c, (uint32_t)rk[r], (uint32_t)(rk[r] >> 32));
}

// Counter halves of element (i, j): the block's row index (rows i and i + 8 of a 16-row group
// share it) and key index (keys 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-key group share it).
__device__ __forceinline__ int cuflash_drop_row(int i) { return ((i >> 4) << 3) | (i & 7); }
__device__ __forceinline__ int cuflash_drop_col(int j) { return ((j >> 4) << 2) | ((j >> 1) & 3); }

// The counter of block (row counter r, key counter m) of problem (b, h).
__device__ __forceinline__ void cuflash_dropout_counter(uint32_t (&w)[4], int b, int h, int r, int m) {
    w[0] = (uint32_t)m;
    w[1] = (uint32_t)r;
    w[2] = (uint32_t)h;
    w[3] = (uint32_t)b;
}

// The four words of block (row counter r, key counter m) of problem (b, h).
__device__ __forceinline__ void cuflash_dropout_block(uint32_t (&w)[4], uint32_t k0, uint32_t k1,
                                                      int b, int h, int r, int m) {
    cuflash_dropout_counter(w, b, h, r, m);
    cuflash_philox4x32_10(w, k0, k1);
}

// Whether the low / high 16 bits of word x are kept, against thr16 = threshold << 16 (what
// cuflash_dropout_key holds): one compare each, no extraction.
__device__ __forceinline__ bool cuflash_keep_lo(uint32_t x, uint32_t thr16) { return (x << 16) >= thr16; }
__device__ __forceinline__ bool cuflash_keep_hi(uint32_t x, uint32_t thr16) { return x >= thr16; }

// Whether each 16-bit half of word x is kept, in that half's msb (the other bits undefined),
// against thr2 = the threshold in both halves: one subtraction compares both halves' low 15
// bits with the threshold's without a borrow between them (a half of x | 0x8000 keeps its msb
// iff its low 15 bits are at least the threshold's), and a half is at least the threshold iff
// that compare and its own msb are both set (threshold >= 2^15) or either is (threshold <
// 2^15): the majority of the two and the threshold's msb inverted.  Three instructions per two
// draws and one per trip, with thr2 the one register they need.
__device__ __forceinline__ uint32_t cuflash_keep_halves(uint32_t x, uint32_t thr2) {
    const uint32_t c = (x | 0x80008000u) - (thr2 & 0x7fff7fffu);
    return (x & c) | (~thr2 & (x | c));
}

// Whether element (b, h, i, j) is kept (one Philox block per call: for a single element).
__device__ __forceinline__ bool cuflash_dropout_keep(uint32_t k0, uint32_t k1, uint32_t thr16,
                                                     int b, int h, int i, int j) {
    uint32_t w[4];
    cuflash_dropout_block(w, k0, k1, b, h, cuflash_drop_row(i), cuflash_drop_col(j));
    // select without a dynamic register index (which would put w in local memory)
    const uint32_t x = (i & 8) ? ((j & 8) ? w[3] : w[2]) : ((j & 8) ? w[1] : w[0]);
    return (j & 1) ? cuflash_keep_hi(x, thr16) : cuflash_keep_lo(x, thr16);
}

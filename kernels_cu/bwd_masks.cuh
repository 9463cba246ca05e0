// bwd_masks.cuh -- what the tensor-core backward kernels with the logit features share
// (flash_bwd_tc.cu and flash_bwd_tf32.cu compiled with -DCUFLASH_MASKS): the band of visible
// keys, dropout's dV factor and the dropout bits in the transposed (S^T) layout.
#pragma once
#include "params.cuh"
#include "masks.cuh"

// The band of visible keys as two offsets: query i sees key j (0 <= i < Nq, 0 <= j < Nk) iff
// lo_off <= j - i < hi_off (causal: j <= i + causal_offset; window: i + off - left <= j <=
// i + off + right, off = Nk - Nq).  Clamped to [-Nq, Nk] (j - i lies in (-Nq, Nk)) so that
// they stay 32-bit.
struct BwdBand {
    int lo_off, hi_off;
    __device__ __forceinline__ BwdBand(const BwdParams& p) {
        long long lo = -(long long)p.Nq, hi = p.Nk;
        if (p.mask_window & CUFLASH_WINDOW_LEFT) lo = (long long)p.mask_offset - p.mask_window_left;
        if (p.causal) hi = (long long)p.causal_offset + 1;
        if (p.mask_window & CUFLASH_WINDOW_RIGHT) {
            const long long r = (long long)p.mask_offset + p.mask_window_right + 1;
            hi = r < hi ? r : hi;
        }
        lo_off = (int)(lo < -p.Nq ? -p.Nq : (lo > p.Nk ? p.Nk : lo));
        hi_off = (int)(hi < -p.Nq ? -p.Nq : (hi > p.Nk ? p.Nk : hi));
    }
};

// dropout's 1 / (1 - p) on dV (1 without dropout)
__device__ __forceinline__ float dv_scale(const BwdParams& p) {
    return p.mask_dropout != 0 ? (float)p.mask_drop_scale : 1.0f;
}

// The dropped bits of one S^T fragment (keys g, g + 8, queries 2t, 2t + 1 of lane (g, t)):
// bit e = 2 hh + eq for key row g + 8 hh, query 2t + eq.  The four lanes g = 4a .. 4a + 3
// (w4 = g & 3) of one t hold the four keys of a Philox block for each of their queries and
// key rows: lane w4 draws the block of query i0 + (w4 & 1) and keys from key row 8 (w4 >> 1)
// (i0: the fragment's query 2t; m0: its key g's Philox block index with g = 4a, i.e. (key of
// row 0 of the fragment + 4a) / 4), compares its four words and the quad swaps the bits:
// v holds lane e's bits at 4e .. 4e + 3 after two xor shuffles; element e takes bit w4 of
// lane e's -- bits 4e + w4 -- packed to bits e by one multiply (0x249 = 1 + 2^3 + 2^6 + 2^9:
// no carries).  One Philox block per four logits; every lane of the warp must call it.
__device__ __forceinline__ uint32_t bwd_dropped_bits(const DropoutKey& drop, int b, int h, int i0,
                                                     int m0, int w4) {
    uint32_t blk[4];
    cuflash_dropout_block(blk, drop.k0, drop.k1, b, h, i0 + (w4 & 1), m0 + 2 * (w4 >> 1));
    uint32_t v = ((uint32_t)(blk[0] < drop.threshold) | ((uint32_t)(blk[1] < drop.threshold) << 1) |
                  ((uint32_t)(blk[2] < drop.threshold) << 2) |
                  ((uint32_t)(blk[3] < drop.threshold) << 3)) << (4 * w4);
    v |= __shfl_xor_sync(0xffffffffu, v, 4);
    v |= __shfl_xor_sync(0xffffffffu, v, 8);
    return ((((v >> w4) & 0x1111u) * 0x249u) >> 9) & 0xfu;
}

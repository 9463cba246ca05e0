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

// The dropout bits of a trip, one 64-bit word per lane: element (rh, hh, eq) -- key row g + 8 hh,
// query 2t + eq of 8-query fragment 2 q + rh -- of fragment pair q (q < 8) at bit
// bwd_drop_bit(q, rh, hh, eq).  The two queries of a pair (eq = 0, 1) lie 8 bits apart, so
// that one shift puts them at bits 7 and 15 and cuflash_half_mask (one PRMT) makes the mask
// of a packed 16-bit pair.
__device__ __forceinline__ constexpr int bwd_drop_bit(int q, int rh, int hh, int eq) {
    return 16 * (q >> 1) + 4 * (q & 1) + 2 * rh + hh + 8 * eq;
}
// The 16-bit pair mask (0xffff per element whose bit is set) of elements (q, rh, hh, 0 / 1).
__device__ __forceinline__ uint32_t bwd_pair_mask(unsigned long long bits, int q, int rh, int hh) {
    const int s = bwd_drop_bit(q, rh, hh, 0);  // a constant in the unrolled loops
    return cuflash_half_mask(s >= 7 ? (uint32_t)(bits >> (s - 7)) : (uint32_t)bits << (7 - s));
}

// The dropped bits of two S^T fragments: keys k16 + g + 8 hh (k16 a multiple of 16) and
// queries q16 + 8 rh + 2t + eq (q16 a multiple of 16, fragments rh = 0, 1) of lane (g, t), at
// bit 2 rh + hh + 8 eq (bwd_drop_bit(0, rh, hh, eq)).  The Philox block of query row q
// (philox.cuh) holds rows {q, q + 8} x keys {2u, 2u + 1, 2u + 8, 2u + 9} of the 16 x 16 tile,
// word 2 rh + hh, the half the key's parity: lanes g = 2u and 2u + 1 (lane ^ 4) hold the even
// and odd keys of it for queries 2t and 2t + 1.  Each draws the block of query 2t + e (e = g
// & 1), keeps the half of its own keys' parity (bits k + 8 e) and sends its partner the other
// half (one shuffle): one Philox block per eight logits.  Every lane of the warp must call it.
__device__ __forceinline__ uint32_t bwd_dropped_bits(const DropoutKey& drop, int b, int h, int q16,
                                                     int k16, int g, int t) {
    const int e = g & 1;
    uint32_t w[4];
    cuflash_dropout_block(w, drop.k0, drop.k1, b, h, q16 / 2 + 2 * t + e, k16 / 4 + (g >> 1));
    uint32_t lo = 0, hi = 0;  // dropped bits of the words' low / high halves, word k at bit k
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo |= (uint32_t)!cuflash_keep_lo(w[k], drop.threshold) << k;
        hi |= (uint32_t)!cuflash_keep_hi(w[k], drop.threshold) << k;
    }
    const uint32_t mine = (e ? hi : lo) << (8 * e), other = (e ? lo : hi) << (8 * e);
    return mine | __shfl_xor_sync(0xffffffffu, other, 4);
}

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

// The dropout key of a build that has dropout on at compile time (flash_bwd_tc_dropout, which
// its launcher picks only for calls with dropout): on is a constant, so that its branches fold.
__device__ __forceinline__ DropoutKey cuflash_dropout_key_on(const BwdParams& p) {
    DropoutKey d = cuflash_dropout_key(p);
    d.on = true;
    return d;
}

// dropout's 1 / (1 - p) on dV (1 without dropout)
__device__ __forceinline__ float dv_scale(const BwdParams& p) {
    return p.mask_dropout != 0 ? (float)p.mask_drop_scale : 1.0f;
}

// The dropout keep bits of a trip, one 64-bit word per lane: element (rh, hh, eq) -- key row
// g + 8 hh, query 2t + eq of 8-query fragment 2 q + rh -- of fragment pair q (q < 8) is kept iff
// bit bwd_drop_bit(q, rh, hh, eq) is set.  Byte 2 hh + eq of the word's half q >> 2 holds the
// two fragments' bits of pair q at bits 7 - 2 (q & 3) - rh: the bytes are what one PRMT picks
// from the two lanes' draws (bwd_kept_bits), and the two queries of a key
// (eq = 0, 1) lie 8 bits apart, so that one shift puts them at bits 7 and 15 and one PRMT
// replicating those bytes' signs makes the mask of a packed 16-bit pair.
__device__ __forceinline__ constexpr int bwd_drop_bit(int q, int rh, int hh, int eq) {
    return 32 * (q >> 2) + 8 * (2 * hh + eq) + 7 - rh - 2 * (q & 3);
}
// The 16-bit pair mask (0xffff per element whose bit is set) of elements (q, rh, hh, 0 / 1).
// (A shift per (q, rh) shared by hh = 0 and 1 saves 3-9 instructions per trip but keeps the
// shifted words live: 4 B spilled at d = 16 and 128.)
__device__ __forceinline__ uint32_t bwd_pair_mask(unsigned long long bits, int q, int rh, int hh) {
    const int s = bwd_drop_bit(q, rh, hh, 0);  // a constant in the unrolled loops
    const uint32_t x = s >= 7 ? (uint32_t)(bits >> (s - 7)) : (uint32_t)bits << (7 - s);
    return cuflash_prmt(x, 0u, 0x9988u);
}

// The keep bits of fragment pair q (of kPairs), to be ORed over the trip's pairs: keys k16 + g
// + 8 hh (k16 a multiple of 16) and queries q16 + 8 rh + 2t + eq (q16 a multiple of 16,
// fragments rh = 0, 1) of lane (g, t).  The Philox block of query row q (philox.cuh) holds rows
// {q, q + 8} x keys {2u, 2u + 1, 2u + 8, 2u + 9} of the 16 x 16 tile, word 2 rh + hh, the half
// the key's parity: lanes g = 2u and 2u + 1 (lane ^ 4) hold the even and odd keys of it for
// queries 2t and 2t + 1.  Each draws the block of query 2t + e (e = g & 1): one Philox block
// per eight logits.  Its eight keep bits go to byte (2 hh + the key's parity) of a word, at bit
// 7 - rh - 2 (q & 3): both halves of a word compared at once (cuflash_keep_halves), the four
// words' halves gathered by two PRMT (each byte the sign of a half) and one LOP3 (rh = 0 at
// bit 7, rh = 1 at bits 0-6), the pair's place by a shift and a mask.  Then each lane keeps
// the bytes of its own keys' parity e and takes the same from its partner (queries 2t + 1 -
// e): one shuffle and one PRMT.  Every lane of the warp must call it.  ``rk``: the round keys
// as kernel arguments (cuflash_philox4x32_10_keyed), else (null) the rounds add them to drop's.
template <int kPairs>
__device__ __forceinline__ unsigned long long bwd_kept_bits(const DropoutKey& drop, const unsigned long long (*rk)[10],
                                                            int b, int h, int q16, int k16, int g, int t, int q) {
    uint32_t w[4];
    cuflash_dropout_counter(w, b, h, (q16 >> 1) + 2 * t + (g & 1), (k16 >> 2) + (g >> 1));
    if (rk != nullptr)
        cuflash_philox4x32_10_keyed(w, *rk);
    else
        cuflash_philox4x32_10(w, drop.k0, drop.k1);
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = cuflash_keep_halves(w[k], drop.threshold2);
    // bytes: word 0 | 2 even key, 0 | 2 odd key, 1 | 3 even key, 1 | 3 odd key
    const uint32_t rh0 = cuflash_prmt(w[0], w[1], 0xFDB9u), rh1 = cuflash_prmt(w[2], w[3], 0xFDB9u);
    const uint32_t both = (rh0 & 0x80808080u) | (rh1 & 0x7f7f7f7fu);
    const int s = 2 * (q & 3);
    const uint32_t own = (both >> s) & (0xc0c0c0c0u >> s);
    // byte 2 hh + eq from: e = 0, eq = 0 own byte 2 hh, eq = 1 the partner's; e = 1, eq = 0 the
    // partner's byte 2 hh + 1, eq = 1 own
    const uint32_t r = cuflash_prmt(own, __shfl_xor_sync(0xffffffffu, own, 4), (g & 1) ? 0x3715u : 0x6240u);
    if constexpr (kPairs <= 4) return r;  // the low half only
    return (unsigned long long)r << (32 * (q >> 2));
}

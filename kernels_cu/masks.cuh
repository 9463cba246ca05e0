// masks.cuh -- the logit features of P = mask(scale * Q K^T + bias), shared by the SIMT
// forward and backward kernels when compiled with -DCUFLASH_MASKS.
//
//   s = scale * q_i . k_j
//   s = c * tanh(s / c)                      softcap c (mask_softcap > 0)
//   s += bias[b, h, i, j]                    any broadcast of the bias: stride 0 axes
//   s -= slope[b, h] * |i + off - j|         ALiBi, off = mask_offset (Nk - Nq, bottom-right)
//   query i sees key j iff lo_i <= j < hi_i  causal and window (left, right) as one interval:
//       lo_i = i + off - left (window left bounded), hi_i = min(i + causal_offset + 1 (causal),
//       i + off + right + 1 (window right bounded)), clipped to [0, Nk)
//   P~ = exp(s - m); with dropout the kept P~ are scaled by 1 / (1 - p) for P~ V only
//   (philox.cuh); row sums and lse stay those of the undropped softmax.
// The parameters are fields named mask_* of FwdParams / BwdParams (params.cuh); both structs
// use the same names, so these helpers are templates over the block type.  A plain call
// leaves them 0 (cuflash._launch.make_params), and kernels compiled without CUFLASH_MASKS
// never read them.
#pragma once
#include "dtype.cuh"
#include "philox.cuh"

__device__ __forceinline__ float acc_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }

// Bits of mask_window: which window sides bound the keys.
#define CUFLASH_WINDOW_LEFT 1
#define CUFLASH_WINDOW_RIGHT 2

// The visible keys [lo, hi) of query position i (off: the window's alignment, nk keys; the
// causal bound is passed in as the caller computes it, hi_causal = nk when not causal).
template <class Params>
__device__ __forceinline__ void cuflash_window_range(const Params& p, long long i, int off, int nk,
                                                     long long hi_causal, int& lo, int& hi) {
    long long l = 0, h = hi_causal;
    if (p.mask_window & CUFLASH_WINDOW_LEFT) l = i + off - p.mask_window_left;
    if (p.mask_window & CUFLASH_WINDOW_RIGHT) {
        const long long r = i + off + p.mask_window_right + 1;
        h = r < h ? r : h;
    }
    lo = (int)(l < 0 ? 0 : (l > nk ? nk : l));
    hi = (int)(h < 0 ? 0 : (h > nk ? nk : h));
}

// One query row's view of the features: its bias row, ALiBi term and dropout indices.
struct MaskRow {
    const acc_t* bias;     // bias row of this query (nullptr: no bias); key j at bias[j * sc]
    long long bias_sc;
    acc_t neg_slope;       // -slope of ALiBi (0: none)
    int pos;               // i + off: ALiBi distance |pos - j| (32-bit: positions are ints)
    acc_t cap, inv_cap;    // softcap and 1 / softcap (0: none)
    // scaled logit s -> softcap, + bias, + ALiBi for key j; th = tanh(s / c) (for the backward)
    __device__ __forceinline__ acc_t logit(acc_t s, int j, acc_t& th) const {
        th = 0;
        if (cap != acc_t(0)) {
            th = acc_tanh(s * inv_cap);
            s = cap * th;
        }
        if (bias != nullptr) s += gload(bias + (long long)j * bias_sc);
        if (neg_slope != acc_t(0)) {
            const int dist = pos - j;
            s += neg_slope * (acc_t)(dist < 0 ? -dist : dist);
        }
        return s;
    }
};

// The row view for query position i of problem (b, h); Bias / Slopes may be nullptr when the
// call has none (mask_has_bias / mask_has_alibi say which are meaningful).
template <class Params>
__device__ __forceinline__ MaskRow cuflash_mask_row(const Params& p, const acc_t* Bias,
                                                    const acc_t* Slopes, int b, int h, long long i,
                                                    int off) {
    MaskRow m;
    m.bias = p.mask_has_bias ? Bias + b * p.mask_bias_sb + h * p.mask_bias_sh + i * p.mask_bias_sr
                             : nullptr;
    m.bias_sc = p.mask_bias_sc;
    m.neg_slope = p.mask_has_alibi
                      ? -gload(Slopes + b * p.mask_alibi_sb + h * p.mask_alibi_sh) : acc_t(0);
    m.pos = (int)i + off;
    m.cap = (acc_t)p.mask_softcap;
    m.inv_cap = p.mask_softcap > 0 ? (acc_t)(1.0 / p.mask_softcap) : acc_t(0);
    return m;
}

// The dropout key and threshold of a call.
struct DropoutKey {
    uint32_t k0, k1, threshold;  // threshold << 16: compared with a 16-bit draw in a word's top half
    uint32_t threshold2;         // the threshold in both halves (cuflash_keep_halves)
    acc_t scale;           // 1 / (1 - p)
    bool on;
};
template <class Params>
__device__ __forceinline__ DropoutKey cuflash_dropout_key(const Params& p) {
    DropoutKey d;
    d.on = p.mask_dropout != 0;
    d.k0 = (uint32_t)p.mask_seed_lo;
    d.k1 = (uint32_t)p.mask_seed_hi;
    d.threshold = (uint32_t)p.mask_drop_threshold << 16;
    d.threshold2 = (uint32_t)p.mask_drop_threshold * 0x10001u;
    d.scale = (acc_t)p.mask_drop_scale;
    return d;
}

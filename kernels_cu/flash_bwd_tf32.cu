// flash_bwd_tf32.cu: the FlashAttention-2 backward for float32 on tensor cores (3xTF32).
//
// What it computes (cuflash.tiled_attention_backward, the contract of flash_bwd.cu), for every
// query head with P = softmax(scale * Q K^T [causal mask]) recomputed from the forward's lse:
//     dV = P^T dO     dP = dO V^T     dS = P * (dP - D)     dK = scale * dS^T Q     dQ = scale * dS K
// with D = rowsum(dO * O) from flash_bwd_preprocess (flash_bwd.cu), which also zeroes the
// float32 dQ accumulator(s); dQ is added into them with float32 atomics and summed and
// converted by flash_bwd_dq_convert (flash_bwd.cu).  This kernel replaces flash_bwd_dkdv for
// float32 on sm_80+, on both dQ paths: one accumulator that every KV tile's block adds into
// (deterministic=False), or one slice per block slot (deterministic=True, see the grid).
// Every product is three mma.m16n8k8 with tf32 operands (x = hi + lo, hi*hi + hi*lo + lo*hi,
// portable.cuh) and float32 accumulation: float32 accuracy.
//
// Grid: n_slots blocks (slots) per (kv head, batch), folded (params.cuh); slot j runs KV
// tile kv_tile0 + j of Bc keys.  The atomic path is one launch, a slot per KV tile; with
// deterministic=True the launcher runs waves of at most n_splits slots (kv_tile0 = 0,
// n_splits, 2 n_splits, ...) and slot j adds dQ into accumulator slice j (dq_slice_stride
// apart; 0 on the atomic path), every element of it by one thread per launch -- the dQ
// sub-tile of a (warp, lane) is fixed -- and the launches in stream order: each slice, and
// flash_bwd_dq_convert's in-order sum of the slices, has the same bits on every run.  (One
// block walking its tiles in a loop instead made ptxas hoist the parameter loads out of it:
// up to 33 more registers and spills.)  K_j, V_j
// stay in shared memory; the block walks the query heads of its GQA group and, for each, the
// Q tiles that can see K_j, (Q_i, dO_i, lse_i, D_i) in two cp.async stages (tile i + 1 in flight
// while tile i computes).  Each of the kWarps warps owns 16 keys (Bc = 16 * kWarps).  Per warp
// and Q tile (Br queries):
//   S^T  (16 x Br) = K_w Q_i^T       A = K_w rows, B = Q_i rows (128-bit loads, k permuted as in
//   dP^T (16 x Br) = V_w dO_i^T      flash_fwd_tc.cu's S)
//   P^T = 2^(S^T c - lse_i log2 e)   c = scale log2 e; rows that see no key come with lse = +inf
//   dS^T = P^T * (dP^T - D_i)
//   dV_w += P^T dO_i,  dK_w += dS^T Q_i   the A operands straight from the accumulators: an n8
//       tile of P^T holds queries 2t, 2t+1 in lane (g, t), used as k = t, t + 4; B = rows 2t,
//       2t+1 of dO_i / Q_i, one 128-bit load each at columns 32c + 4g .. 4g+3, which feed four
//       n8 tiles of the product (tile m uses column 32c + 4g + m), so a lane's accumulators hold
//       columns 32c + 8t + 4e + m (e = 0, 1; m = 0..3) of its rows: two 16-byte stores
//   dS^T -> shared memory; after a barrier the block computes dQ_i (Br x d) = dS K_j in warp
//       sub-tiles of 16 x 32 (A = dS from the stored dS^T, B = rows 2t, 2t+1 of K_j) and adds
//       scale * dQ_i into the accumulator with one float32 atomic per element and block.
// dK_w, dV_w are added into the float32 outputs dK, dV every 128 query rows and restart from
// zero (kFlushRows: the tensor core's accumulation truncates, a long chain drifts).
//
// Shared memory (float; strides chosen for the fragment loads, see tc_stride in cuflash.tiling):
//   Ks (Bc, kKS)  Vs (Bc, kVS)  Qs 2 x (Br, kQS)  dOs 2 x (Br, kOS)  lse2 2 x Br  D 2 x Br  dSTs (Bc, kTS)
// K_j, Q_i and dO_i are read both as rows g of an 8-row group (128-bit, needs a stride of 16 mod
// 32 floats to be conflict-free) and as rows 2t (128-bit, needs 4 mod 16): 20 mod 32 serves
// the second fully and the first with one 2-way conflict per quarter warp; V_j only as rows g
// (16 mod 32).  dS^T is read as single floats by 32 lanes on rows 2t, 2t + 1, columns g
// (conflict-free needs 4 or 12 mod 16) and written as 64-bit pairs by 16-lane phases on rows
// g..g+3 (conflict-free needs 8 or 24 mod 32): no stride serves both, and 4 mod 32 keeps the
// reads free -- each warp reads dS^T 4-8 times as often as it writes it -- and leaves the
// writes 2-way.  (bench/results/emulator_profile.md counts both.)
//
// Compile-time parameters: CUFLASH_DTYPE_F32, CUFLASH_HEAD_DIM (d), CUFLASH_HEAD_DIM_V (dv),
// CUFLASH_BLOCK_Q (Br), CUFLASH_BLOCK_KV (Bc), CUFLASH_THREADS (2 * Bc).  Arguments and
// launch as flash_bwd_dkdv plus kv_tile0, n_slots before the parameter block (grid n_slots *
// Hk * B), BwdParams with atomic_dq = 1 and n_splits, dq_slice_stride the slices' (1 and 0
// on the atomic path).
// Head dims: compiled for d and dv, or -- with -DCUFLASH_HEAD_DIMS_PADDED, the build of a call
// whose d != dv (cuflash.tiling compiles it for max(d, dv)) -- for larger ones than the
// call's, which it reads from BwdParams head_d, head_dv: the columns of K, Q past d and of V,
// dO past dv are zero-filled in shared memory, those of dK, dQ past d and of dV past dv are
// not written, and dK, dV and the dQ accumulator keep the call's row lengths.
// Limits: d, dv multiples of 32 (a 128-bit B load feeds four n8 tiles), <= 128 (dK, dV in
// registers); Br a multiple of 16; 16-byte aligned rows (the launcher copies other inputs).
// Before sm_80 portable.cuh's software mma and synchronous copies run instead.
#if !defined(CUFLASH_DTYPE_F32)
#error "flash_bwd_tf32 supports CUFLASH_DTYPE_F32 only"
#endif
#include "dtype.cuh"
#include "params.cuh"
#ifdef CUFLASH_MASKS
#include "bwd_masks.cuh"
#define CUFLASH_BWD_TF32_KERNEL flash_bwd_tf32_masked
#define CUFLASH_BWD_TF32_MASK_ARGS , const float* __restrict__ Bias, \
    const float* __restrict__ Slopes, float* __restrict__ dBias
#define CUFLASH_DV_FACTOR dv_scale(p)  // dV's factor: dropout's 1 / (1 - p)
#else
#define CUFLASH_BWD_TF32_KERNEL flash_bwd_tf32
#define CUFLASH_BWD_TF32_MASK_ARGS
#define CUFLASH_DV_FACTOR 1.0f
#endif

#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V) || !defined(CUFLASH_BLOCK_Q) || \
    !defined(CUFLASH_BLOCK_KV) || !defined(CUFLASH_THREADS)
#error "define CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV and CUFLASH_THREADS"
#endif

constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kDv = CUFLASH_HEAD_DIM_V;
#ifdef CUFLASH_HEAD_DIMS_PADDED
constexpr bool kPadded = true;   // the call's head dims (BwdParams) may be below kD, kDv
#else
constexpr bool kPadded = false;
#endif
constexpr int kBr = CUFLASH_BLOCK_Q;
constexpr int kBc = CUFLASH_BLOCK_KV;
constexpr int kThreads = CUFLASH_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kNQ = kBr / 8;  // n8 tiles of S^T (queries)
// strides (floats): 20 mod 32 for tiles read both ways, 16 mod 32 for V, 4 mod 32 for dS^T
__host__ __device__ constexpr int pad_to(int n, int r) { return n + ((r - n % 32) % 32 + 32) % 32; }
constexpr int kKS = pad_to(kD, 20);
constexpr int kQS = pad_to(kD, 20);
constexpr int kVS = pad_to(kDv, 16);
constexpr int kOS = pad_to(kDv, 20);
constexpr int kTS = pad_to(kBr, 4);
constexpr int kSubs = (kBr / 16) * (kD / 32);  // 16 x 32 sub-tiles of dQ_i
#ifdef CUFLASH_MASKS
// The masked kernel's bias and dbias row loops (around the element loop) hold row pointers
// while S^T / dS^T are live: at d = dv = 128 with 16 query rows ptxas spilled 4-12 B for them
// (sm_80 and sm_90, block_kv 32 to 128: bench/plan_sweep.py), so those plans keep the element
// loop's general bias reads and dbias stores.  (A budget rule -- (d + dv) / 2 + block_q near
// 144 -- also caught 128/96 at 32 x 64, which spills without the row loops, not with them.)
constexpr bool kRowPaths = !(kD == 128 && kDv == 128 && kBr == 16);
#endif

static_assert(kBc == 16 * kWarps, "each warp owns 16 keys: block_kv = 16 * warps");
static_assert(kBr % 16 == 0, "block_q must be a multiple of 16");
static_assert(kD % 32 == 0 && kDv % 32 == 0 && kD <= 128 && kDv <= 128, "d, dv: multiples of 32, <= 128");

// ------------------------------------------------------------- helpers
__device__ __forceinline__ void lds4(float (&r)[4], const float* p) {
#ifdef CUFLASH_EMULATOR
    std::memcpy(r, p, 16);
#else
    const float4 v = *reinterpret_cast<const float4*>(p);
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
#endif
}
__device__ __forceinline__ void lds2(float (&r)[2], const float* p) {
#ifdef CUFLASH_EMULATOR
    std::memcpy(r, p, 8);
#else
    const float2 v = *reinterpret_cast<const float2*>(p);
    r[0] = v.x; r[1] = v.y;
#endif
}
__device__ __forceinline__ void sts2(float* p, float a, float b) {
#ifdef CUFLASH_EMULATOR
    const float v[2] = {a, b};
    std::memcpy(p, v, 8);
#else
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#endif
}

// cp.async of rows [0, rows) of a (kRows, kCols) float tile (global row stride gs) into shared
// memory (row stride kSS), rows >= rows zero-filled, and columns >= cols in a padded build; a
// rolled loop over the 16-byte chunks.
template <int kRows, int kCols, int kSS>
__device__ __forceinline__ void load_tile(float* s, const float* g, long long gs, int rows, int tid,
                                          int cols) {
    constexpr int kCpr = kCols / 4;
#pragma unroll 4
    for (int idx = tid; idx < kRows * kCpr; idx += kThreads) {
        const int r = idx / kCpr, c = (idx - r * kCpr) * 4;
        const bool valid = r < rows && (!kPadded || c < cols);
        cp_async_16_zfill(s + r * kSS + c, valid ? g + r * gs + c : g, valid);
    }
}

// acc (16 x 8*kNQ) += A (16 rows of `As`, row stride kAS, columns [0, kK)) x B^T (kNQ*8 rows of
// `Bs`, row stride kBS): the S^T / dP^T products.  Per 16 columns: one 128-bit load of each A
// row (g, g + 8) and each B row, columns 4t, 4t+1 as k = t, t+4 of the first k8 MMA, 4t+2,
// 4t+3 of the second.  kAInf: A is K, split by split_tf32_inf so that an infinite key's -inf
// logits do not turn NaN; once per A fragment, shared by the kNQ n8 tiles.
template <int kK, int kAS, int kBS, bool kAInf = false>
__device__ __forceinline__ void mma_abt(float (&acc)[kNQ][4], const float* As, const float* Bs, int g, int t,
                                        uint32_t hm) {
#pragma unroll
    for (int kb = 0; kb < kK / 16; ++kb) {
        uint32_t ah[2][4], al[2][4];
        float a0[4], a8[4];
        lds4(a0, As + g * kAS + kb * 16 + 4 * t);
        lds4(a8, As + (g + 8) * kAS + kb * 16 + 4 * t);
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            if constexpr (kAInf) {
                split_tf32_inf(a0[2 * st], ah[st][0], al[st][0], hm);
                split_tf32_inf(a8[2 * st], ah[st][1], al[st][1], hm);
                split_tf32_inf(a0[2 * st + 1], ah[st][2], al[st][2], hm);
                split_tf32_inf(a8[2 * st + 1], ah[st][3], al[st][3], hm);
            } else {
                split_tf32(a0[2 * st], ah[st][0], al[st][0], hm);
                split_tf32(a8[2 * st], ah[st][1], al[st][1], hm);
                split_tf32(a0[2 * st + 1], ah[st][2], al[st][2], hm);
                split_tf32(a8[2 * st + 1], ah[st][3], al[st][3], hm);
            }
        }
#pragma unroll
        for (int nq = 0; nq < kNQ; ++nq) {
            float bv[4];
            lds4(bv, Bs + (nq * 8 + g) * kBS + kb * 16 + 4 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                uint32_t bh[2], bl[2];
                split_tf32(bv[2 * st], bh[0], bl[0], hm);
                split_tf32(bv[2 * st + 1], bh[1], bl[1], hm);
                mma_m16n8k8_3xtf32(acc[nq], ah[st], al[st], bh, bl, acc[nq]);
            }
        }
    }
}

// acc (16 x kN) += X (16 x Br, in the accumulator layout of S^T) x B (Br rows of `Bs`, row
// stride kBS, columns [0, kN)): dV += P^T dO and dK += dS^T Q.  The n8 tile kc of X gives the
// A operand of k8 step kc (queries 2t, 2t+1 as k = t, t+4); B = rows kc*8 + 2t, 2t+1, one
// 128-bit load each per 32 columns, element m feeding n8 tile 4c + m.
template <int kN, int kBS>
__device__ __forceinline__ void mma_xb(float (&acc)[kN / 8][4], const float (&x)[kNQ][4], const float* Bs, int g,
                                       int t, uint32_t hm) {
#pragma unroll
    for (int kc = 0; kc < kNQ; ++kc) {
        uint32_t ah[4], al[4];
        split_tf32(x[kc][0], ah[0], al[0], hm);  // (g, 2t)
        split_tf32(x[kc][2], ah[1], al[1], hm);  // (g + 8, 2t)
        split_tf32(x[kc][1], ah[2], al[2], hm);  // (g, 2t + 1)
        split_tf32(x[kc][3], ah[3], al[3], hm);  // (g + 8, 2t + 1)
#pragma unroll
        for (int c = 0; c < kN / 32; ++c) {
            float b0[4], b1[4];
            lds4(b0, Bs + (kc * 8 + 2 * t) * kBS + c * 32 + 4 * g);
            lds4(b1, Bs + (kc * 8 + 2 * t + 1) * kBS + c * 32 + 4 * g);
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                uint32_t bh[2], bl[2];
                split_tf32(b0[m], bh[0], bl[0], hm);
                split_tf32(b1[m], bh[1], bl[1], hm);
                mma_m16n8k8_3xtf32(acc[4 * c + m], ah, al, bh, bl, acc[4 * c + m]);
            }
        }
    }
}

// Rows r0 + g (+ 8) of a (16 x kN) accumulator tile of mma_xb as float4 stores of mul * acc, or
// with `add` of mul * acc + the stored values (dK, dV's second level): lane (g, t) holds
// columns 32c + 8t + 4e + m in acc[4c + m][2 half + e]; in a padded build the columns past
// `cols` (a multiple of 32) are not stored.  A request (one e) covers every other 16 bytes of
// its rows -- 32 sectors for 16 -- and the next (the other e) the rest, so both together move
// each sector once: from L2 twice the requests, to DRAM the same bytes.
template <int kN>
__device__ __forceinline__ void store_xb(float* base, long long row_stride, const float (&acc)[kN / 8][4],
                                         int g, int t, int rows, float mul, bool add, int cols) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = g + 8 * half;
        if (r < rows) {
            float* row = base + r * row_stride;
#pragma unroll
            for (int c = 0; c < kN / 32; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (kPadded && c * 32 >= cols) continue;
                    float4* dst = reinterpret_cast<float4*>(row + c * 32 + 8 * t + 4 * e);
                    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (add) x = gload(dst);
                    const float xs[4] = {x.x, x.y, x.z, x.w};
                    float y[4];
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        const float a = acc[4 * c + m][2 * half + e];
                        y[m] = add ? fmaf(mul, a, xs[m]) : mul * a;
                    }
                    gstore(dst, make_float4(y[0], y[1], y[2], y[3]));
                }
        }
    }
}

// dK and dV's second level.  The tensor core adds each mma into its float accumulator
// truncating toward zero (the products and the accumulator are summed as one operation and
// cut to float toward zero, no IEEE rounding), so an accumulator that keeps its sign loses
// up to an ulp per mma: dK, dV chained through every Q tile had a relative error of 1.7e-5 at
// Nq = 2048 (d = 64, on the emulator's model of it; float32's rule is 1e-5).  So they chain
// through kFlushSteps steps only (kFlushRows query rows, at most 3 kFlushRows / 8 mma deep)
// and are then added into the float32 outputs dK, dV with FFMA (round to nearest) and restart
// from zero; the end adds the last sums the same way.  A flush needs no registers and costs
// a load (not at the first flush) and a store of the block's dK, dV rows every kFlushRows
// query rows; blocks that see fewer never flush.
constexpr int kFlushRows = 128;
constexpr int kFlushSteps = kFlushRows / kBr;
static_assert(kFlushSteps >= 1 && (kFlushSteps & (kFlushSteps - 1)) == 0, "kFlushSteps: a power of two");

// acc = 0 by an AND with `zero` (0 at run time, opaque to ptxas), in place: with zero
// constants ptxas may keep the accumulators' flushed and unflushed values in separate
// registers across the loop (it spilled the forward's O that way).
template <int kN>
__device__ __forceinline__ void zero_xb(float (&acc)[kN][4], uint32_t zero) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = __uint_as_float(__float_as_uint(acc[i][e]) & zero);
}

// ------------------------------------------------------------- the kernel
// __launch_bounds__(threads, 1): without the minimum of one block per SM ptxas capped some
// specialisations at 168 registers and spilled (measured with NVRTC 13 for sm_80); the
// planner's register budget assumes up to 255.
extern "C" __global__ void __launch_bounds__(kThreads, 1) CUFLASH_BWD_TF32_KERNEL(
    const float* __restrict__ Q, const float* __restrict__ K, const float* __restrict__ V,
    const float* __restrict__ dO, const float* __restrict__ LSE, const float* __restrict__ D,
    float* __restrict__ dK, float* __restrict__ dV, float* __restrict__ dq_accum_ws, int kv_tile0,
    int n_slots, const BwdParams* __restrict__ P CUFLASH_BWD_TF32_MASK_ARGS)
{
    CUFLASH_DYNAMIC_SHARED(float, smem);
    float* Ks = smem;                    // (Bc, kKS)       K_j, resident
    float* Vs = Ks + kBc * kKS;          // (Bc, kVS)       V_j, resident
    float* Qs = Vs + kBc * kVS;          // 2 x (Br, kQS)   Q_i, two stages
    float* dOs = Qs + 2 * kBr * kQS;     // 2 x (Br, kOS)   dO_i, two stages
    float* lse2s = dOs + 2 * kBr * kOS;  // 2 x Br          lse_i * log2(e) (+inf: row sees no key)
    float* Dsm = lse2s + 2 * kBr;        // 2 x Br          D_i
    float* dSTs = Dsm + 2 * kBr;         // (Bc, kTS)       dS^T of the current tile

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const BwdParams& p = *P;
#ifdef CUFLASH_MASKS
    const int Nq = p.Nq, Nk = p.Nk, group = p.group;  // (causal: part of the band)
#else
    const int Nq = p.Nq, Nk = p.Nk, group = p.group, causal = p.causal, off = p.causal_offset;
#endif
    const float scale = (float)p.scale;
    const float c = (float)(p.scale * 1.4426950408889634);  // scale * log2(e)
    const uint32_t hm = 0xffffe000u | (uint32_t)(Nq < 0);  // run-time value (Nq >= 0): see split
    // blockIdx.x -> (slot, kv head, batch) in 32-bit arithmetic (no division subroutine)
    const unsigned bid = blockIdx.x, bhk = bid / (unsigned)n_slots;
    const int slot = (int)(bid - bhk * (unsigned)n_slots);
    const int kv_tile = kv_tile0 + slot;
    const int hk = (int)(bhk % (unsigned)p.Hk), b = (int)(bhk / (unsigned)p.Hk);
    const int kv0 = kv_tile * kBc, kv_rows = min(kBc, Nk - kv0);
    float* dq_accum = dq_accum_ws + p.dq_accum_offset + slot * p.dq_slice_stride;  // (0 when atomic)
    // the columns the call has: the row lengths of dK, dV and the dQ accumulator
    const int d_cols = kPadded ? p.head_d : kD, dv_cols = kPadded ? p.head_dv : kDv;

    load_tile<kBc, kD, kKS>(Ks, K + b * p.k_sb + hk * p.k_sh + kv0 * p.k_sr, p.k_sr, kv_rows, tid, d_cols);
    load_tile<kBc, kDv, kVS>(Vs, V + b * p.v_sb + hk * p.v_sh + kv0 * p.v_sr, p.v_sr, kv_rows, tid, dv_cols);
    // (one group with the first Q tile below; K_j, V_j are read after its barrier)

    const int n_q_tiles = (Nq + kBr - 1) / kBr;
#ifdef CUFLASH_MASKS
    // the band: rows kv0 - hi_off + 1 .. kv0 + kv_rows - 1 - lo_off see keys of this tile; Q
    // tiles outside it are never loaded (both sides)
    const BwdBand band(p);
    int it0, it1;
    {
        const long long i_min = (long long)kv0 - band.hi_off + 1;
        const long long i_max = (long long)kv0 + kv_rows - 1 - band.lo_off;
        it0 = i_min <= 0 ? 0 : (i_min >= Nq ? n_q_tiles : (int)(i_min / kBr));
        it1 = i_max < 0 ? 0 : (i_max >= Nq ? n_q_tiles : (int)(i_max / kBr) + 1);
        if (it1 < it0) it1 = it0;
    }
    const int per_head = it1 - it0;
#else
    // causal: the first query that sees key kv0 is kv0 - off; earlier Q tiles are skipped
    int it0 = 0;
    if (causal) {
        const long long i_min = (long long)kv0 - off;
        it0 = i_min <= 0 ? 0 : (i_min >= Nq ? (Nq + kBr - 1) / kBr : (int)(i_min / kBr));
    }
    const int per_head = n_q_tiles - it0;  // Q tiles per query head of the group
#endif
    const int n_steps = group * per_head;  // (head, Q tile) steps of this block

    // step s is query head hk * group + gg, Q tile iq (gg = s / per_head, iq = it0 + s %
    // per_head): the loop below steps (gg, iq) instead of dividing
    auto issue = [&](int gg, int iq, int stage) {
        const int h = hk * group + gg, q0 = iq * kBr;
        const int rows = min(kBr, Nq - q0);
        load_tile<kBr, kD, kQS>(Qs + stage * kBr * kQS, Q + b * p.q_sb + h * p.q_sh + q0 * p.q_sr, p.q_sr, rows,
                                tid, d_cols);
        load_tile<kBr, kDv, kOS>(dOs + stage * kBr * kOS, dO + b * p.do_sb + h * p.do_sh + q0 * p.do_sr,
                                 p.do_sr, rows, tid, dv_cols);
        const size_t row0 = ((size_t)b * p.H + h) * Nq + q0;
#pragma unroll
        for (int k = 0; k < (kBr + kThreads - 1) / kThreads; ++k) {  // (compile-time trip count)
            const int r = tid + k * kThreads;
            if (kBr % kThreads != 0 && r >= kBr) break;
            // rows past Nq and rows that see no key (lse = -inf): +inf, so P = 2^-inf = 0
            const float l = r < rows ? gload(LSE + row0 + r) : -INFINITY;
            lse2s[stage * kBr + r] = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
            Dsm[stage * kBr + r] = r < rows ? gload(D + row0 + r) : 0.0f;
        }
    };

    float dk[kD / 8][4], dv[kDv / 8][4];  // dK_w, dV_w (16 keys x d, dv), see store_xb
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDv / 8; ++i) dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.0f;
    const float* Kw = Ks + warp * 16 * kKS;
    const float* Vw = Vs + warp * 16 * kVS;
    const int key0 = kv0 + warp * 16;  // the warp's first key

    if (n_steps > 0) issue(0, it0, 0);
    cp_async_commit();
    for (int s = 0, gg = 0, iq = it0; s < n_steps; ++s) {
        const int stage = s & 1;
        const int h = hk * group + gg, q0 = iq * kBr;
        // (gg, iq) of step s + 1
        const bool next_head = iq + 1 == it0 + per_head;
        const int gg1 = next_head ? gg + 1 : gg, iq1 = next_head ? it0 : iq + 1;
        cp_async_wait<0>();
        // Q_i, dO_i (and at s = 0 K_j, V_j), lse_i, D_i of this stage are visible; every warp
        // finished step s - 1, so its stage and dS^T may be overwritten.
        __syncthreads();
        if (s + 1 < n_steps) issue(gg1, iq1, stage ^ 1);
        cp_async_commit();
        const float* Qt = Qs + stage * kBr * kQS;
        const float* dOt = dOs + stage * kBr * kOS;
        const float* lse2 = lse2s + stage * kBr;
        const float* Dt = Dsm + stage * kBr;

#ifdef CUFLASH_MASKS
        // The call's features, read per step from the parameter block (not held in registers
        // across the loop); the band test only where the tile pair crosses it, holds keys
        // past Nk or rows past Nq.
        const int rows_q = min(kBr, Nq - q0);
        const bool need_mask = kv_rows < kBc || rows_q < kBr || kv0 - (q0 + rows_q - 1) < band.lo_off ||
                               kv0 + kBc - 1 - q0 >= band.hi_off;
        const DropoutKey drop = cuflash_dropout_key(p);
        static_assert(kNQ <= 16, "the masked backward keeps 64 dropout bits");
        // keep bits: element (nq, e = 2 hh + eq) at bit bwd_drop_bit(nq / 2, nq & 1, hh, eq)
        // (bwd_masks.cuh); drawn before S^T (indices only)
        unsigned long long keep = ~0ull;  // all kept without dropout
        if (drop.on) {
            keep = 0;
#pragma unroll 1
            for (int nq = 0; nq < kNQ; nq += 2)  // (rolled: one Philox block per eight logits)
                keep |= bwd_kept_bits<kNQ / 2>(drop, nullptr, b + p.mask_drop_b0, h, q0 + nq * 8, key0, g, t, nq / 2);
        }
#endif
        // -- S^T = K_w Q_i^T, dP^T = V_w dO_i^T
        float st[kNQ][4], dpt[kNQ][4];
#pragma unroll
        for (int nq = 0; nq < kNQ; ++nq)
            st[nq][0] = st[nq][1] = st[nq][2] = st[nq][3] = dpt[nq][0] = dpt[nq][1] = dpt[nq][2] = dpt[nq][3] = 0.0f;
        mma_abt<kD, kKS, kQS, true>(st, Kw, Qt, g, t, hm);
        mma_abt<kDv, kVS, kOS>(dpt, Vw, dOt, g, t, hm);

#ifdef CUFLASH_MASKS
        // -- per element, in the forward's order: s = softcap(scale S) + bias + ALiBi (each
        //    behind a uniform branch), P^T = 2^(s log2 e - lse2) (the band test where needed),
        //    dS^T = P^T (dP^T keep / (1 - p) - D), dbias = dS^T (inside [0, Nq) x [0, Nk)),
        //    softcap's 1 - tanh^2; P^T with the dropped elements zeroed for dV.  float32
        //    throughout (tanhf).
        {
            const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;
            const bool has_alibi = p.mask_has_alibi != 0;
            const bool xform = has_cap || has_bias || has_alibi;
            // Without softcap (whose tanh the element loop needs twice) and on a tile inside
            // [0, Nq) x [0, Nk) with contiguous keys, the bias and dbias take loops of their
            // own around the element loop: a row pointer per query (64-bit adds), every key at
            // a constant offset -- per element the load or store and one FFMA, where the
            // element loop's general path pays a 64-bit address per element
            // (bench/results/feature_counts.md).
            const bool tile_in = kv_rows == kBc && rows_q == kBr;
            const bool bias_rows = kRowPaths && has_bias && !has_cap && tile_in && p.mask_bias_sc == 1;
            if (bias_rows) {  // S^T -> scale S^T + bias
                const float* row = Bias + b * p.mask_bias_sb + h * p.mask_bias_sh +
                                   (long long)(q0 + 2 * t) * p.mask_bias_sr + key0 + g;
#pragma unroll
                for (int nq = 0; nq < kNQ; ++nq) {
                    const float* row1 = row + p.mask_bias_sr;
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        st[nq][2 * hh] = fmaf(st[nq][2 * hh], scale, gload(row + 8 * hh));
                        st[nq][2 * hh + 1] = fmaf(st[nq][2 * hh + 1], scale, gload(row1 + 8 * hh));
                    }
                    row += 8 * p.mask_bias_sr;
                }
            }
            const float ce = xform ? 1.4426950408889634f : c;
            const float cap = (float)p.mask_softcap;
            const float inv_cap = has_cap ? (float)(1.0 / p.mask_softcap) : 0.0f;
            const float ns = has_alibi ? -gload(Slopes + b * p.mask_alibi_sb + h * p.mask_alibi_sh) : 0.0f;
            // ALiBi's distance q + off - key in float: this lane's base (query q0 + 2t, key
            // key0 + g) plus each element's constant -- an FADD, not an I2F, per element
            // (exact while |q + off - key| < 2^24)
            const float alibi_base = (float)(q0 + 2 * t + p.mask_offset - key0 - g);
            const float* bias_h = Bias + b * p.mask_bias_sb + h * p.mask_bias_sh;
            float* dbias_h = dBias + b * p.mask_dbias_sb + h * p.mask_dbias_sh;
            // the element loop's dbias: 0 where the row loop after it writes dbias (then
            // p.mask_dbias != 0 and db_mode == 0 says so, without another live flag)
            const int db_mode = kRowPaths && p.mask_dbias != 0 && !has_cap && tile_in &&
                                p.mask_dbias_sc == 1 ? 0 : p.mask_dbias;
            // the lane's two keys' offsets once per step, a row pointer per query: per element
            // one 64-bit add (bias keys clamped to Nk - 1, rows to Nq - 1: in-bounds reads)
            const long long bk0 = (long long)min(key0 + g, Nk - 1) * p.mask_bias_sc;
            const long long bk8 = (long long)min(key0 + g + 8, Nk - 1) * p.mask_bias_sc;
            const long long dk0 = (long long)(key0 + g) * p.mask_dbias_sc;
            const long long dk8 = (long long)(key0 + g + 8) * p.mask_dbias_sc;
#pragma unroll
            for (int nq = 0; nq < kNQ; ++nq) {
                float l2[2], dd[2];
                lds2(l2, lse2 + nq * 8 + 2 * t);
                lds2(dd, Dt + nq * 8 + 2 * t);
                const int qa = q0 + nq * 8 + 2 * t;
                const float* brow[2] = {bias_h + (long long)min(qa, Nq - 1) * p.mask_bias_sr,
                                        bias_h + (long long)min(qa + 1, Nq - 1) * p.mask_bias_sr};
                float* drow[2] = {dbias_h + (long long)qa * p.mask_dbias_sr,
                                  dbias_h + (long long)(qa + 1) * p.mask_dbias_sr};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + g + 8 * (e >> 1), q = q0 + nq * 8 + 2 * t + (e & 1);
                    float sv = st[nq][e], th = 0.0f;
                    if (has_cap) {
                        th = tanhf(sv * scale * inv_cap);
                        sv = cap * th;
                    } else if (xform && !bias_rows) {
                        sv *= scale;
                    }
                    if (has_bias && !bias_rows) sv += gload(brow[e & 1] + ((e >> 1) ? bk8 : bk0));
                    if (has_alibi) sv += ns * fabsf(alibi_base + (float)(nq * 8 + (e & 1) - 8 * (e >> 1)));
                    float x = sv * ce - l2[e & 1];
                    if (need_mask && (key >= Nk || q >= Nq || key - q < band.lo_off || key - q >= band.hi_off))
                        x = -INFINITY;
                    const float pv = cuflash_exp2(x);
                    const bool kept = (keep >> bwd_drop_bit(nq / 2, nq & 1, e >> 1, e & 1)) & 1;
                    // dP of the dropped product, keep / (1 - p), in one FFMA
                    float ds = pv * (drop.on ? fmaf(drop.scale, kept ? dpt[nq][e] : 0.0f, -dd[e & 1])
                                             : dpt[nq][e] - dd[e & 1]);
                    if (db_mode != 0 && key < Nk && q < Nq) {  // dbias = dS (0 outside the band)
                        float* dst = drow[e & 1] + ((e >> 1) ? dk8 : dk0);
                        if (db_mode == 1) gstore(dst, ds);
                        else gatomic_add(dst, ds);
                    }
                    if (has_cap) ds *= 1.0f - th * th;
                    st[nq][e] = kept ? pv : 0.0f;
                    dpt[nq][e] = ds;
                }
            }
            if (kRowPaths && p.mask_dbias != 0 && db_mode == 0) {  // dbias = dS^T, stored or added
                auto dbias_loop = [&](bool atomic) {  // (inlined with a constant argument)
                    float* row = dBias + b * p.mask_dbias_sb + h * p.mask_dbias_sh +
                                 (long long)(q0 + 2 * t) * p.mask_dbias_sr + key0 + g;
#pragma unroll
                    for (int nq = 0; nq < kNQ; ++nq) {
                        float* row1 = row + p.mask_dbias_sr;
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            if (atomic) {
                                gatomic_add(row + 8 * hh, dpt[nq][2 * hh]);
                                gatomic_add(row1 + 8 * hh, dpt[nq][2 * hh + 1]);
                            } else {
                                gstore(row + 8 * hh, dpt[nq][2 * hh]);
                                gstore(row1 + 8 * hh, dpt[nq][2 * hh + 1]);
                            }
                        }
                        row += 8 * p.mask_dbias_sr;
                    }
                };
                if (p.mask_dbias == 1) dbias_loop(false);
                else dbias_loop(true);
            }
        }
#else
        // -- P^T = 2^(S^T c - lse2), masked only on tiles that cross the diagonal or the ends
        //    (rows past Nq included: their lse2 = +inf makes P = 0 unless s is NaN, 0 * an
        //    infinite key, so the mask zeroes P wherever lse2 = +inf -- P is 0 there by
        //    definition, and the test reads a value the element has in a register already);
        //    dS^T = P^T (dP^T - D)
        const bool mask = kv0 + kBc > Nk || q0 + kBr > Nq || (causal && kv0 + kBc - 1 > q0 + off);
#pragma unroll
        for (int nq = 0; nq < kNQ; ++nq) {
            float l2[2], dd[2];
            lds2(l2, lse2 + nq * 8 + 2 * t);
            lds2(dd, Dt + nq * 8 + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pv = cuflash_exp2(fmaf(st[nq][e], c, -l2[e & 1]));
                if (mask) {
                    const int key = key0 + g + 8 * (e >> 1), q = q0 + nq * 8 + 2 * t + (e & 1);
                    if (key >= Nk || (causal && key > q + off) || l2[e & 1] == INFINITY) pv = 0.0f;
                }
                st[nq][e] = pv;
                dpt[nq][e] = pv * (dpt[nq][e] - dd[e & 1]);
            }
        }
#endif

        // -- dV_w += P^T dO_i, dK_w += dS^T Q_i (scale applied at the end)
        mma_xb<kDv, kOS>(dv, st, dOt, g, t, hm);
        mma_xb<kD, kQS>(dk, dpt, Qt, g, t, hm);

        // -- dS^T to shared memory for dQ_i = dS K_j
#pragma unroll
        for (int nq = 0; nq < kNQ; ++nq) {
            sts2(dSTs + (warp * 16 + g) * kTS + nq * 8 + 2 * t, dpt[nq][0], dpt[nq][1]);
            sts2(dSTs + (warp * 16 + g + 8) * kTS + nq * 8 + 2 * t, dpt[nq][2], dpt[nq][3]);
        }
        __syncthreads();  // every warp's dS^T rows are in dSTs before any warp reads dS

        // -- dQ_i += scale * dS K_j: warp sub-tiles of 16 queries x 32 columns, one atomic each
        const int q_rows = min(kBr, Nq - q0);
        float* dq_tile = dq_accum + (((size_t)b * p.H + h) * Nq + q0) * d_cols;
        for (int sub = warp; sub < kSubs; sub += kWarps) {
            const int r0 = (sub / (kD / 32)) * 16, c0 = (sub % (kD / 32)) * 32;
            if (kPadded && c0 >= d_cols) continue;  // columns the call does not have
            float acc[4][4];
#pragma unroll
            for (int m = 0; m < 4; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < kBc / 8; ++kc) {  // keys kc*8 + 2t, 2t + 1 as k = t, t + 4
                const float* d0 = dSTs + (kc * 8 + 2 * t) * kTS + r0 + g;
                const float* d1 = d0 + kTS;
                uint32_t ah[4], al[4];
                split_tf32(d0[0], ah[0], al[0], hm);  // dS(r0 + g, key 2t)
                split_tf32(d0[8], ah[1], al[1], hm);  // dS(r0 + g + 8, key 2t)
                split_tf32(d1[0], ah[2], al[2], hm);  // dS(r0 + g, key 2t + 1)
                split_tf32(d1[8], ah[3], al[3], hm);  // dS(r0 + g + 8, key 2t + 1)
                float b0[4], b1[4];
                lds4(b0, Ks + (kc * 8 + 2 * t) * kKS + c0 + 4 * g);
                lds4(b1, Ks + (kc * 8 + 2 * t + 1) * kKS + c0 + 4 * g);
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    uint32_t bh[2], bl[2];
                    split_tf32(b0[m], bh[0], bl[0], hm);
                    split_tf32(b1[m], bh[1], bl[1], hm);
                    mma_m16n8k8_3xtf32(acc[m], ah, al, bh, bl, acc[m]);
                }
            }
            // acc[m][i]: query r0 + g + 8 (i >> 1), column c0 + 8t + 4 (i & 1) + m -- four
            // consecutive floats per (lane, i): one red.v4 on sm_90 (four scalar reds before;
            // 16-byte aligned: the launcher aligns the accumulator, rows are multiples of 32)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + g + 8 * (i >> 1);
                if (r < q_rows)
                    gred_add_v4(dq_tile + (size_t)r * d_cols + c0 + 8 * t + 4 * (i & 1), scale * acc[0][i],
                                scale * acc[1][i], scale * acc[2][i], scale * acc[3][i]);
            }
        }
        // -- dK, dV's second level: every kFlushSteps steps, not after the last (the end adds
        //    dk, dv)
        if ((s & (kFlushSteps - 1)) == kFlushSteps - 1 && s + 1 < n_steps) {
            const bool first = s == kFlushSteps - 1;
            const size_t kr0 = ((size_t)b * p.Hk + hk) * Nk + kv0 + warp * 16;
            store_xb<kD>(dK + kr0 * d_cols, d_cols, dk, g, t, kv_rows - warp * 16, scale, !first, d_cols);
            store_xb<kDv>(dV + kr0 * dv_cols, dv_cols, dv, g, t, kv_rows - warp * 16, CUFLASH_DV_FACTOR, !first,
                          dv_cols);
            zero_xb(dk, hm & 1u);
            zero_xb(dv, hm & 1u);
        }
        gg = gg1;
        iq = iq1;
    }
    cp_async_wait<0>();  // no copy outlives the block (K_j, V_j only, when n_steps == 0)

    // -- dK_j = scale * sum dS^T Q, dV_j, plus what the flushes stored (rows past Nk are not
    //    written)
    const size_t row0 = ((size_t)b * p.Hk + hk) * Nk + kv0 + warp * 16;
    const int rows = kv_rows - warp * 16;
    const bool flushed = n_steps > kFlushSteps;  // dK, dV hold flushed sums
    store_xb<kD>(dK + row0 * d_cols, d_cols, dk, g, t, rows, scale, flushed, d_cols);
    store_xb<kDv>(dV + row0 * dv_cols, dv_cols, dv, g, t, rows, CUFLASH_DV_FACTOR, flushed, dv_cols);
}

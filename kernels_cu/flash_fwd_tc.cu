// flash_fwd_tc.cu: the FlashAttention-2 forward of flash_fwd.cu on tensor cores.
//   float16 / bfloat16 -> kernel flash_fwd_tc:   mma.m16n8k16, float32 accumulators;
//   float32            -> kernel flash_fwd_tf32: mma.m16n8k8 with tf32 operands, each float32
//                         operand split into hi + lo and three products (3xTF32,
//                         portable.cuh), float32 accumulators: float32 accuracy.
// Result contract as flash_fwd: O = softmax(scale * Q K^T [causal mask]) V and
// lse = m + log(l) per query row; rows that see no key give o = 0, lse = -inf.
//
// Algorithm (FlashAttention-2, Dao 2023): one thread block per (Q tile, query head, batch)
// (folded grid, params.cuh; with a causal mask the tiles of a head run heaviest first).  Q_i
// is loaded once; K_j/V_j stream through two shared-memory stages with cp.async, tile j + 1
// in flight while tile j is computed, one __syncthreads per tile (or through one K and one V
// buffer, two per tile: kStages).  Online softmax with a
// reference max m and sum l of each row in registers, exp2 with the softmax scale folded into
// one FMA: p = 2^(s * c - m * c), c = scale * log2(e) (scale > 0: the launcher turns scale <= 0
// into -Q or 0 * Q with a positive scale).  m follows the row max lazily: it moves, and O and
// l are rescaled, only when a tile's max would make p exceed 2^8 (warp-uniform test), so most
// tiles skip the rescale.  Causal tiles past the diagonal are never loaded; masks are applied
// only to the tiles that cross the diagonal or the end of the keys (a tile-uniform branch).
// float32: O's accumulators are added into the float32 output every 256 keys and restart
// from zero (flush_o: the tensor core's accumulation truncates, a long chain drifts).
//
// Warp layout (as flash-attn 2): kWarps warps, each owning kMT * 16 query rows (kMT = 2
// for head dims <= 128: every K/V fragment read from shared memory feeds two MMAs; 1 above,
// where 32 rows of O would not fit in registers).  Per warp and K/V tile:
//   S (kMT*16 x Bc) = Q_w K_j^T   B operand = rows of K (row-major K is B "col")
//   P = 2^(S*c - m*c)             in the accumulator layout: lane (g = L/4, t = L%4) holds
//                                 rows g, g + 8 of each m16 tile and columns 2t, 2t + 1 of
//                                 each n8 tile, so a row max/sum needs two shuffles
//                                 (xor 1, xor 2); the row sum l stays a per-lane partial
//                                 sum until the end
//   O += P V_j                    P's accumulators become the A operand in registers
// float16/bfloat16: Q fragments by ldmatrix (kept in registers across K/V tiles when they fit,
// kQInRegs), K by ldmatrix, V by ldmatrix.trans; P rounded to the input dtype (as flash-attn).
// float32: fragments by 128/64-bit shared loads in a permuted k order (the sum over k does not
// depend on it, only A and B must agree):
//   S:  lane (g, t) reads Q[g][16b + 4t .. 4t+3] and K[n][16b + 4t .. 4t+3] (one LDS.128 each)
//       and uses columns 4t, 4t+1 as k = t, t+4 of the first k8 MMA, 4t+2, 4t+3 of the second;
//   PV: the k8 step is one n8 tile of S, whose accumulators hold keys 2t, 2t+1: they are used
//       as k = t, t+4 (no shuffles), with V rows 2t, 2t+1; each lane reads V[2t][16c + 2g ..
//       2g+1] (LDS.64) and uses column 2g for an "even" and 2g+1 for an "odd" n8 tile of O,
//       so O's accumulators hold columns 16c + 4t .. 4t+3 of their rows (one 16-byte store).
// Each operand is split (split_tf32) right after its load; P is split from the float
// exponentials, so the row sum l and P V agree to float32 accuracy.
//
// Shared memory (element strides chosen so that the fragment loads are free of bank
// conflicts): 16-bit: rows padded by 8 elements (16 bytes: the 8 rows of an ldmatrix hit
// different banks); float32: Q, K rows of kD + (16 if kD % 32 == 0) floats (stride = 16 mod
// 32: the 8 lanes of a 128-bit access cover all banks), V rows of kDv + 4 floats (stride =
// 4 mod 16: the 16 lanes of a 64-bit access cover all banks).
//   Qs (kBr, kQS)  |  Ks kStages x (kBc, kKS)  |  Vs kStages x (kBc, kVS)   (cuflash.tiling has the bytes)
//
// Compile-time parameters: CUFLASH_DTYPE_F16 | _BF16 | _F32, CUFLASH_HEAD_DIM (d),
// CUFLASH_HEAD_DIM_V (dv), CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV, CUFLASH_THREADS (32 * warps).
// Launch: grid ceil(Nq / block_q) * H * B (folded), CUFLASH_THREADS threads, dynamic shared
// memory from cuflash.tiling ("flash_fwd_tc" / "flash_fwd_tf32", the _masked kernels under their own
// names).  Arguments as flash_fwd (the _masked kernels: as flash_fwd_masked).
//
// Logit features (compiled with -DCUFLASH_MASKS: kernels flash_fwd_tc_masked and
// flash_fwd_tf32_masked, two more arguments Bias and Slopes as flash_fwd_masked; masks.cuh):
// bias, sliding window, ALiBi, softcap and Philox dropout on the S fragments.
//   * logit terms (softcap, bias, ALiBi) on every tile: s -> softcap(scale * s) + bias +
//     ALiBi as masks.cuh defines them, each term a loop of its own over the tile behind one
//     uniform branch (tc_features), and the softmax then runs on scaled logits (c = log2(e)
//     instead of scale * log2(e)).  softcap's tanh is 1 - 2 / (1 + 2^x) (fast_math.cuh) in
//     float16 / bfloat16, tanhf in float32; ALiBi's distance is a float from a per-lane base;
//     an interior tile's bias with contiguous keys comes from a row pointer per row at
//     constant offsets, else element by element; the features' parameters are read per
//     tile (tc_features_of), not held in registers across the K/V loop;
//   * the visible keys of a row are one interval [lo, hi) (causal and window): tiles left of
//     the first row's band and right of the last row's are never loaded, and the interval
//     test runs only on tiles that cross some row's lo or hi (or hold rows past Nq) -- there
//     a masked logit becomes -inf before its bias is read, so the bias is read once per
//     visible (row, key), as in flash_fwd_masked;
//   * dropout: a Philox block holds the eight logits lane (g, t) has in two n8 tiles (rows g,
//     g + 8; keys 2t, 2t + 1 of each; 16 bits each, philox.cuh): one block per eight logits,
//     drawn by the lane that uses them.  Dropped P become 0 in the P V product only (l and lse
//     are those of the undropped softmax), and 1 / (1 - p) multiplies O at the end with
//     1 / l (P stays <= 2^kLazy in 16-bit: no overflow for p near 1).
//
// Head dims: compiled for d and dv, or -- with -DCUFLASH_HEAD_DIMS_PADDED, the build of a call
// whose d != dv (cuflash.tiling compiles it for max(d, dv), its head-dim class) -- for larger
// ones than the call's, which it reads from FwdParams head_d, head_dv: the columns of Q, K
// past d and of V past dv are zero-filled in shared memory (S and O are exact) and those of O
// past dv are not stored.
//
// Limits: d, dv multiples of 16, <= 256; block_q = warps * 16 * kMT, block_kv a multiple of
// 16; register arrays grow with block_kv and dv (cuflash.tiling refuses the tiles that would
// not fit its register budget).  cp.async moves 16 bytes: the launcher guarantees 16-byte aligned base pointers and
// element strides that are multiples of 16 bytes (else it copies the input).  Before sm_80
// portable.cuh computes the mma in software and cp.async is a synchronous copy (correct,
// slow: the planner picks the SIMT flash_fwd there).  float64 uses flash_fwd.cu.
#if !defined(CUFLASH_DTYPE_F16) && !defined(CUFLASH_DTYPE_BF16) && !defined(CUFLASH_DTYPE_F32)
#error "flash_fwd_tc.cu supports CUFLASH_DTYPE_F16, CUFLASH_DTYPE_BF16 and CUFLASH_DTYPE_F32"
#endif
#include "dtype.cuh"
#include "params.cuh"
#include "tile_copy.cuh"
#include "saddr.cuh"
#ifdef CUFLASH_MASKS
#include "masks.cuh"
#include "fast_math.cuh"
#endif

#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V) || !defined(CUFLASH_BLOCK_Q) || \
    !defined(CUFLASH_BLOCK_KV) || !defined(CUFLASH_THREADS)
#error "define CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV and CUFLASH_THREADS"
#endif

#if defined(CUFLASH_DTYPE_F32)
#define CUFLASH_TF32 1
#ifdef CUFLASH_MASKS
#define CUFLASH_FWD_TC_KERNEL flash_fwd_tf32_masked
#else
#define CUFLASH_FWD_TC_KERNEL flash_fwd_tf32
#endif
#else
#define CUFLASH_TF32 0
#ifdef CUFLASH_MASKS
#define CUFLASH_FWD_TC_KERNEL flash_fwd_tc_masked
#else
#define CUFLASH_FWD_TC_KERNEL flash_fwd_tc
#endif
#endif

constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kDv = CUFLASH_HEAD_DIM_V;
#ifdef CUFLASH_HEAD_DIMS_PADDED
constexpr bool kPadded = true;   // the call's head dims (FwdParams) may be below kD, kDv
#else
constexpr bool kPadded = false;
#endif
constexpr int kBr = CUFLASH_BLOCK_Q;
constexpr int kBc = CUFLASH_BLOCK_KV;
constexpr int kThreads = CUFLASH_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsW = kBr / kWarps;  // query rows per warp
constexpr int kMT = kRowsW / 16;      // m16 tiles per warp
constexpr int kNT = kBc / 8;          // n8 tiles of S
constexpr int kOT = kDv / 8;          // n8 tiles of O
[[maybe_unused]] constexpr int kElem = (int)sizeof(elem_t);  // (unused by the TF32 build)
// The row sums l of the float16/bfloat16 kernel without logit features come from the tensor
// core: P (as rounded for P V) times an n8 tile of ones, one MMA per m16 tile and 16 keys in
// place of a FADD per logit, and whole (every column of the product is the row sum: no quad
// shuffles at the end).  It sums the very P that O sums, so O / l is a weighted mean of V's
// rows.  float32 (P split for 3xTF32) and the masked kernel (dropout zeroes P after the sum,
// and lse is the undropped softmax's) add the float32 P, a FADD per logit; so do the plans
// whose 4 more accumulators per m16 tile made ptxas spill (12 B at 255 registers): dv = 96
// with 64-key tiles and 32 rows per warp (bench/plan_sweep.py found no other).
#if !CUFLASH_TF32 && !defined(CUFLASH_MASKS)
#define CUFLASH_SUM_BY_MMA (!(kDv == 96 && kBc == 64 && kRowsW == 32))
#else
#define CUFLASH_SUM_BY_MMA 0
#endif
#if CUFLASH_TF32
constexpr int kQS = kD + (kD % 32 == 0 ? 16 : 0);
constexpr int kKS = kQS;
constexpr int kVS = kDv + 4;
#else
constexpr int kQS = kD + 8;
constexpr int kKS = kD + 8;
constexpr int kVS = kDv + 8;
#endif
// K/V shared-memory stages: 2 (tile j + 1 copied while tile j is computed, one barrier per
// tile) or 1 (-DCUFLASH_FWD_KV_STAGES=1, FlashAttention-2's schedule: one K and one V buffer,
// V_j copied under S_j, K_{j+1} under the softmax and P V_j, two barriers per tile; the
// planner takes it where it lets more blocks reside on an SM, KernelTiling.smaller)
#ifndef CUFLASH_FWD_KV_STAGES
#define CUFLASH_FWD_KV_STAGES 2
#endif
constexpr int kStages = CUFLASH_FWD_KV_STAGES;
static_assert(kStages == 1 || kStages == 2, "CUFLASH_FWD_KV_STAGES: 1 or 2");
// the reference max of a row moves only when P would exceed 2^kLazy (see the softmax step)
constexpr float kLazy = 8.0f;
// a row's reference (in exponent units) before it sees a key: -FLT_MAX
constexpr float kNoRef = -3.402823466e38f;
// float16/bfloat16: Q's A fragments stay in registers when they, S and O fit comfortably
// (measured: at 160 accumulator and Q registers ptxas already spills)
[[maybe_unused]] constexpr bool kQInRegs = !CUFLASH_TF32 && kMT * (kD / 16) * 4 + kMT * kNT * 4 + kMT * kOT * 4 <= 128;

// For instruction counting only: compile just the path of a steady-state interior K/V tile
// (no mask, no partial tile, no move of the reference max, no flush of O's second level).
// Results are then wrong.  With CUFLASH_FWD_COUNT_RESCALE besides, the move of the reference
// max and the rescale of O and l stay in (bench/fa2_sass_compare.py's fwd-rescale rows).
#ifndef CUFLASH_FWD_INTERIOR_ONLY
#define CUFLASH_FWD_INTERIOR_ONLY 0
#endif

static_assert(kThreads % 32 == 0 && kBr % kWarps == 0 && kRowsW % 16 == 0 && (kMT == 1 || kMT == 2),
              "block_q must be (threads / 32) * 16 or * 32");
static_assert(kBc % 16 == 0, "block_kv must be a multiple of 16");
static_assert(kD % 16 == 0 && kDv % 16 == 0 && kD <= 256 && kDv <= 256, "d, dv: multiples of 16, <= 256");

// ------------------------------------------------------------- small helpers
// 2^x: cuflash_exp2 (portable.cuh: ex2.approx.ftz; subnormal results flush to 0, and p is
// relative to the row max, so those p are below float32's resolution of l anyway).

// max that propagates NaN (as NumPy's max): one max.NaN (FMNMX.NAN) from sm_80 on.
__device__ __forceinline__ float nan_max(float a, float b) {
#if !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return acc_max(a, b);
#endif
}

// Shared-memory vector loads (LDS.128 / LDS.64) and 32/128-bit global stores; memcpy on the
// host, where reinterpreting a float array as float4 breaks the aliasing rules.
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
__device__ __forceinline__ void gstore4(float* p, float a, float b, float c, float d) {
    gstore(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
}
template <class T>
__device__ __forceinline__ void gstore_pair(T* p, float a, float b) {  // two 16-bit elements
#ifdef CUFLASH_EMULATOR
    ::cuflash_emu::tctx->bytes_written += 4;
    const uint32_t v = pack2<T>(a, b);
    std::memcpy(p, &v, 4);
#else
    *reinterpret_cast<uint32_t*>(p) = pack2<T>(a, b);
#endif
}

// The tiles' copies (tile_copy.cuh), with this kernel's element type and threads; the
// interior-only count build takes the full-tile path alone.
template <int kRows, int kCols, int kSS>
using TileCopy = TileCopyT<elem_t, kThreads, kRows, kCols, kSS, CUFLASH_FWD_INTERIOR_ONLY != 0, kPadded>;

// x, opaque to the compiler: what the K/V loop derives from it is computed in the trip
// instead of hoisted out of the loop and held (or spilled) across every tile -- the one-stage
// copies' shared addresses (then one register and immediate offsets, not one register per
// chunk) and the mask's row ends
__device__ __forceinline__ elem_t* opaque(elem_t* x) {
#ifndef CUFLASH_EMULATOR
    asm volatile("" : "+l"(x));
#endif
    return x;
}
__device__ __forceinline__ int opaque(int x) {
#ifndef CUFLASH_EMULATOR
    asm volatile("" : "+r"(x));
#endif
    return x;
}
// Copy the K or V tile whose first chunk for this thread is at src into dst (rows [0, rows)
// of kBc; the rest zero-filled from `safe`).
template <class Copy>
__device__ __forceinline__ void copy_tile(const Copy& cp, elem_t* dst, const elem_t* src, const elem_t* safe,
                                          int rows) {
    if (CUFLASH_FWD_INTERIOR_ONLY || rows >= kBc) cp.template issue_own<true>(dst, src, safe, rows);
    else cp.template issue_own<false>(dst, src, safe, rows);
}

// ------------------------------------------------------------- S = Q_w K_j^T
#if CUFLASH_TF32
// One 128-bit load of 4 consecutive d-columns, split into the operands of two k8 MMAs:
// columns 4t, 4t+1 (first) and 4t+2, 4t+3 (second) as k = t and t + 4.
__device__ __forceinline__ void compute_s(float (&s)[kMT][kNT][4], const float* Qw, const float* Kt,
                                          int g, int t, uint32_t hm) {
#pragma unroll
    for (int kb = 0; kb < kD / 16; ++kb) {
        uint32_t ah[kMT][2][4], al[kMT][2][4];  // [m tile][k8 step][register]
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
            float q0[4], q8[4];  // rows g and g + 8 of the m tile
            lds4(q0, Qw + (mt * 16 + g) * kQS + kb * 16 + 4 * t);
            lds4(q8, Qw + (mt * 16 + g + 8) * kQS + kb * 16 + 4 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                split_tf32(q0[2 * st], ah[mt][st][0], al[mt][st][0], hm);
                split_tf32(q8[2 * st], ah[mt][st][1], al[mt][st][1], hm);
                split_tf32(q0[2 * st + 1], ah[mt][st][2], al[mt][st][2], hm);
                split_tf32(q8[2 * st + 1], ah[mt][st][3], al[mt][st][3], hm);
            }
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            float kv[4];
            lds4(kv, Kt + (nt * 8 + g) * kKS + kb * 16 + 4 * t);
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                uint32_t bh[2], bl[2];
                split_tf32_inf(kv[2 * st], bh[0], bl[0], hm);
                split_tf32_inf(kv[2 * st + 1], bh[1], bl[1], hm);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
                    mma_m16n8k8_3xtf32(s[mt][nt], ah[mt][st], al[mt][st], bh, bl, s[mt][nt]);
            }
        }
    }
}
#else
// ldmatrix operands as one per-lane shared-memory address plus a compile-time byte offset
// per fragment (saddr.cuh).
// The lanes' rows and columns: Q (x4: rows 0-15, columns 0 / 8), K (x4 = two n8 tiles: rows
// 0-7 and 8-15 by lane bit 4, columns 0 / 8 by lane bit 3), V (x4.trans: rows 0-15, columns
// 0 / 8 by lane bit 4); in elements from the tile's first row.
__device__ __forceinline__ int q_lane_off(int lane) { return (lane & 15) * kQS + (lane >> 4) * 8; }
__device__ __forceinline__ int k_lane_off(int lane) {
    return ((lane & 7) + (lane >> 4) * 8) * kKS + ((lane >> 3) & 1) * 8;
}
__device__ __forceinline__ int v_lane_off(int lane) {
    return ((lane & 7) + ((lane >> 3) & 1) * 8) * kVS + (lane >> 4) * 8;
}
// qa: the lane's address in the warp's Q rows
__device__ __forceinline__ void load_q_frag(uint32_t (&a)[4], saddr_t qa, int mt, int kk) {
    ldsm_x4(a, qa + (mt * 16 * kQS + kk * 16) * kElem);
}
// ka: the lane's address in this stage's K tile
template <class QFrag>
__device__ __forceinline__ void compute_s(float (&s)[kMT][kNT][4], const QFrag& qfrag, saddr_t ka) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) qfrag(a[mt], mt, kk);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {  // two n8 tiles per ldmatrix.x4
            uint32_t bb[4];
            ldsm_x4(bb, ka + (np * 16 * kKS + kk * 16) * kElem);
            const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                mma_m16n8k16<elem_t>(s[mt][2 * np], a[mt], b0, s[mt][2 * np]);
                mma_m16n8k16<elem_t>(s[mt][2 * np + 1], a[mt], b1, s[mt][2 * np + 1]);
            }
        }
    }
}
#endif

// ------------------------------------------------------------- O += P V_j
#if CUFLASH_TF32
__device__ __forceinline__ void compute_pv(float (&o)[kMT][kOT][4], const float (&p)[kMT][kNT][4],
                                           const float* Vt, int g, int t, uint32_t hm) {
#pragma unroll
    for (int kc = 0; kc < kNT; ++kc) {  // 8 keys: the n8 tile kc of P
        uint32_t ah[kMT][4], al[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {  // (g, 2t), (g+8, 2t), (g, 2t+1), (g+8, 2t+1) as k = t, t+4
            split_tf32(p[mt][kc][0], ah[mt][0], al[mt][0], hm);
            split_tf32(p[mt][kc][2], ah[mt][1], al[mt][1], hm);
            split_tf32(p[mt][kc][1], ah[mt][2], al[mt][2], hm);
            split_tf32(p[mt][kc][3], ah[mt][3], al[mt][3], hm);
        }
#pragma unroll
        for (int c = 0; c < kDv / 16; ++c) {  // 16 columns of V: an "even" and an "odd" n8 tile
            float v0[2], v1[2];  // keys 2t and 2t + 1, columns 16c + 2g, 16c + 2g + 1
            lds2(v0, Vt + (kc * 8 + 2 * t) * kVS + c * 16 + 2 * g);
            lds2(v1, Vt + (kc * 8 + 2 * t + 1) * kVS + c * 16 + 2 * g);
#pragma unroll
            for (int par = 0; par < 2; ++par) {
                uint32_t bh[2], bl[2];
                split_tf32(v0[par], bh[0], bl[0], hm);
                split_tf32(v1[par], bh[1], bl[1], hm);
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
                    mma_m16n8k8_3xtf32(o[mt][2 * c + par], ah[mt], al[mt], bh, bl, o[mt][2 * c + par]);
            }
        }
    }
}
#else
// Two floats rounded to the input dtype and packed (lower index in the low half).  bfloat16 on
// sm_80+: one cvt.rn.bf16x2.f32 -- portable.cuh's conversion rounds in integer arithmetic (as
// sm_75 needs), ~8 instructions per element, which made the bfloat16 loop 40% longer.
__device__ __forceinline__ uint32_t pack_p(float lo, float hi) {
#if !defined(CUFLASH_EMULATOR) && CUFLASH_ARCH >= 800 && defined(CUFLASH_DTYPE_BF16)
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack2<elem_t>(lo, hi);
#endif
}
#ifdef CUFLASH_DTYPE_BF16
constexpr uint32_t kOnes2 = 0x3F803F80u;  // two bfloat16 1.0
#else
constexpr uint32_t kOnes2 = 0x3C003C00u;  // two float16 1.0
#endif
// va: the lane's address in this stage's V tile; ls: the row sums (CUFLASH_SUM_BY_MMA)
__device__ __forceinline__ void compute_pv(float (&o)[kMT][kOT][4], float (&ls)[kMT][4],
                                           const float (&p)[kMT][kNT][4], saddr_t va) {
#pragma unroll
    for (int kc = 0; kc < kBc / 16; ++kc) {  // P's n8 tiles 2kc, 2kc + 1 form the A operand
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {  // rounded to the input dtype (as flash-attn)
            a[mt][0] = pack_p(p[mt][2 * kc][0], p[mt][2 * kc][1]);
            a[mt][1] = pack_p(p[mt][2 * kc][2], p[mt][2 * kc][3]);
            a[mt][2] = pack_p(p[mt][2 * kc + 1][0], p[mt][2 * kc + 1][1]);
            a[mt][3] = pack_p(p[mt][2 * kc + 1][2], p[mt][2 * kc + 1][3]);
        }
        if (CUFLASH_SUM_BY_MMA) {
            const uint32_t ones[2] = {kOnes2, kOnes2};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma_m16n8k16<elem_t>(ls[mt], a[mt], ones, ls[mt]);
        }
#pragma unroll
        for (int np = 0; np < kOT / 2; ++np) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, va + (kc * 16 * kVS + np * 16) * kElem);
            const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                mma_m16n8k16<elem_t>(o[mt][2 * np], a[mt], b0, o[mt][2 * np]);
                mma_m16n8k16<elem_t>(o[mt][2 * np + 1], a[mt], b1, o[mt][2 * np + 1]);
            }
        }
    }
}
#endif

#ifdef CUFLASH_MASKS
// ------------------------------------------------------------- logit features
// The call's features, read once per thread.
struct TcFeatures {
    const float* bias;       // the (b, h) slice of the bias (has_bias)
    long long bias_sr, bias_sc;
    float neg_slope;         // -ALiBi slope (has_alibi)
    float cap, inv_cap;      // softcap
    float cap_m2;            // -2 cap (tc_softcap's FFMA)
    float cap_k;             // 2 log2(e) scale / softcap (cuflash_tanh_exp2's argument factor)
    float scale;
    int moff;                // Nk - Nq: the window's and ALiBi's alignment
    int lo_off, hi_off;      // row i sees keys clamp(i + lo_off, 0, Nk) <= j < clamp(i + hi_off, 0, Nk)
    bool has_cap, has_bias, has_alibi;
    bool xform;              // any logit term: the tile's logits are transformed
};

// softcap: raw logit x -> cap tanh(scale x / cap).  float16 / bfloat16: tanh = 1 - 2 r with
// r = 1 / (1 + 2^y) (fast_math.cuh, error ~3e-7 cap, under the 16-bit rounding of P), and
// cap (1 - 2 r) as the one FFMA cap - 2 cap r (cap_m2 = -2 cap); float32 (3xTF32) keeps tanhf,
// held to float32 accuracy.
__device__ __forceinline__ float tc_softcap(float x, const TcFeatures& f) {
#if CUFLASH_TF32
    return f.cap * tanhf(x * f.scale * f.inv_cap);
#else
    return fmaf(cuflash_tanh_rcp(x * f.cap_k), f.cap_m2, f.cap);
#endif
}

// lo_off and hi_off of TcFeatures: masks.cuh's cuflash_window_range as two offsets, clamped
// to [-Nq, Nk + 1] (which changes no clamped result for 0 <= i < Nq), so that the per-row
// bounds are two 32-bit adds and clamps (Nq + Nk + 1 < 2^31).
__device__ __forceinline__ int tc_clamp_off(long long x, int Nq, int Nk) {
    return (int)(x < -Nq ? -Nq : (x > Nk + 1 ? Nk + 1 : x));
}
__device__ __forceinline__ void tc_window_offsets(const FwdParams& p, int Nq, int Nk, TcFeatures& f) {
    long long lo = -(long long)Nq, hi = (long long)Nk + 1;
    if (p.mask_window & CUFLASH_WINDOW_LEFT) lo = (long long)p.mask_offset - p.mask_window_left;
    if (p.causal) hi = (long long)p.causal_offset + 1;
    if (p.mask_window & CUFLASH_WINDOW_RIGHT) {
        const long long r = (long long)p.mask_offset + p.mask_window_right + 1;
        hi = r < hi ? r : hi;
    }
    f.lo_off = tc_clamp_off(lo, Nq, Nk);
    f.hi_off = tc_clamp_off(hi, Nq, Nk);
}

// The call's features for one tile, read from the parameter block there (cached loads)
// rather than held in registers across the K/V loop, which left ptxas short of registers.
__device__ __forceinline__ TcFeatures tc_features_of(const FwdParams& p, const float* Bias, int b, int h,
                                                     float neg_slope) {
    TcFeatures f;
    f.has_cap = p.mask_softcap > 0;
    f.has_bias = p.mask_has_bias != 0;
    f.has_alibi = p.mask_has_alibi != 0;
    f.xform = f.has_cap || f.has_bias || f.has_alibi;
    f.bias = Bias + b * p.mask_bias_sb + h * p.mask_bias_sh;
    f.bias_sr = p.mask_bias_sr;
    f.bias_sc = p.mask_bias_sc;
    f.neg_slope = neg_slope;
    f.cap = (float)p.mask_softcap;
    f.inv_cap = f.has_cap ? (float)(1.0 / p.mask_softcap) : 0.0f;
    f.cap_m2 = -2.0f * f.cap;
    f.cap_k = f.has_cap ? (float)(2.0 * 1.4426950408889634 * p.scale / p.mask_softcap) : 0.0f;
    f.scale = (float)p.scale;
    f.moff = p.mask_offset;
    tc_window_offsets(p, p.Nq, p.Nk, f);
    return f;
}

// The tile's logits s (keys k0 + 8 nt + 2t + e1 of rows q0 + r, r = row0 + 16 mt + g + 8 rr)
// -> softcap(scale * s) + bias + ALiBi (xform) and, with kMask, -inf outside each row's
// visible keys [lo, hi); rows past the problem (r >= rows_q) see no key.  Without kMask every
// row sees the whole tile (the caller checked).  Each feature is a loop of its own over the
// tile behind one branch on what the call has (uniform: no per-element test of it); the bias
// of an interior tile with contiguous keys is read from a row pointer per row at constant
// offsets, else element by element (visible elements only).
template <bool kMask>
__device__ __forceinline__ void tc_features(float (&s)[kMT][kNT][4], const TcFeatures& f, int q0, int row0, int rows_q,
                                            int Nk, int k0, int g, int t) {
    if (f.xform) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] = f.has_cap ? tc_softcap(s[mt][nt][e], f) : s[mt][nt][e] * f.scale;
    }
    const bool bias_rows = !kMask && f.has_bias && f.bias_sc == 1;
    if (bias_rows) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float* row = f.bias + (long long)(q0 + row0 + mt * 16 + g + 8 * rr) * f.bias_sr + k0 + 2 * t;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1) s[mt][nt][2 * rr + e1] += gload(row + nt * 8 + e1);
            }
    } else if (kMask || f.has_bias) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const int r = row0 + mt * 16 + g + 8 * rr;
                const bool valid = r < rows_q;
                const int i = q0 + (valid ? r : 0);  // a row past the problem reads no bias
                int lo = 0, hi = 0;
                if (kMask && valid) {
                    lo = min(max(i + f.lo_off, 0), Nk);
                    hi = min(max(i + f.hi_off, 0), Nk);
                }
                const float* brow = f.bias + (long long)i * f.bias_sr;
#pragma unroll
                for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1) {
                        const int j = k0 + nt * 8 + 2 * t + e1;
                        float& x = s[mt][nt][2 * rr + e1];
                        if (kMask && !(j >= lo && j < hi)) x = -INFINITY;
                        else if (f.has_bias) x += gload(brow + (long long)j * f.bias_sc);
                    }
            }
    }
    if (f.has_alibi) {
        // -slope |i + off - j|: the distance in float, a per-lane base plus each element's
        // constant (exact while |i + off - j| < 2^24); -inf stays -inf
        const float base = (float)(q0 + row0 + g + f.moff - k0 - 2 * t);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[mt][nt][e] += f.neg_slope * fabsf(base + (float)(mt * 16 + 8 * (e >> 1) - nt * 8 - (e & 1)));
    }
}

// Dropout of the tile's P (in s), keys k0 + 8 nt + 2t + e1 of rows i0 + 16 mt + g + 8 rr
// (i0, k0 multiples of 16): the Philox block of row counter (i0 + 16 mt) / 2 + g and key
// counter (k0 + 8 nt) / 4 + t (nt even) holds this lane's eight logits of n8 tiles nt, nt + 1
// (philox.cuh): word 0 row g of tile nt, word 1 row g of tile nt + 1, words 2, 3 row g + 8;
// the low half key 2t, the high half 2t + 1.  One block per eight logits, no shuffles.  Kept P
// stay as they are (1 / (1 - p) is applied to O at the end), dropped ones become 0 (also a
// NaN, as flash_fwd_masked).
static_assert(kNT % 2 == 0, "dropout draws keys in 16-key groups");
__device__ __forceinline__ void tc_dropout(float (&s)[kMT][kNT][4], const DropoutKey& dk, int b,
                                           int h, int i0, int k0, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNT; nt += 2) {
            uint32_t w[4];
            cuflash_dropout_block(w, dk.k0, dk.k1, b, h, (i0 + mt * 16) / 2 + g, (k0 + nt * 8) / 4 + t);
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {  // n8 tile nt + hf: words hf (row g), 2 + hf (row g + 8)
                float* e = s[mt][nt + hf];
                e[0] = cuflash_keep_lo(w[hf], dk.threshold) ? e[0] : 0.0f;
                e[1] = cuflash_keep_hi(w[hf], dk.threshold) ? e[1] : 0.0f;
                e[2] = cuflash_keep_lo(w[2 + hf], dk.threshold) ? e[2] : 0.0f;
                e[3] = cuflash_keep_hi(w[2 + hf], dk.threshold) ? e[3] : 0.0f;
            }
        }
    }
}
#define CUFLASH_TC_MASK_ARGS , const float* __restrict__ Bias, const float* __restrict__ Slopes
#else
#define CUFLASH_TC_MASK_ARGS
#endif

#if CUFLASH_TF32
// ------------------------------------------------------------- O's second level (float32)
// The tensor core adds each mma into its float accumulator truncating toward zero (the
// products and the accumulator are summed as one operation and cut to float toward zero, no
// IEEE rounding), so an accumulator that keeps its sign loses up to an ulp per mma: chained
// through every K/V tile, O had a relative error of 1.5e-5 at Nk = 2048 on an H100 (float32's
// rule is 1e-5).  So o chains through kFlushTiles K/V tiles only (kFlushKeys keys, at most
// 3 kFlushKeys / 8 mma deep) and is then added into the float32 output with FFMA (round to
// nearest): O = O * beta + o, beta being the product of the rescale factors alpha applied to
// o since the last flush (both sides relative to the current reference max), and o restarts
// from zero.  The epilogue adds the last o the same way.  Partial sums per K/V tile added to
// o with FADD would need registers beside o (ptxas spilled them from d = 80 on); a flush
// needs none but beta, and costs a load (not at the first flush) and a store of the block's
// O rows every kFlushKeys keys.  Rows whose keys fit in kFlushKeys never flush.
constexpr int kFlushKeys = 256;
constexpr int kFlushTiles = kFlushKeys / kBc;
static_assert(kFlushTiles >= 1 && (kFlushTiles & (kFlushTiles - 1)) == 0, "kFlushTiles: a power of two");

// O (global, the warp's rows of the tile at Ot, row stride sr, rows < rows; in a padded build
// the columns below cols) = O * beta + o (first: = o); then o = 0, beta = 1.  Lane (g, t) holds columns 16cc + 4t .. 4t+3 of its rows
// (compute_pv): one 16-byte load and store each.  o is zeroed by an AND with `zero` (0 at run
// time, opaque to ptxas), in place: with zero constants ptxas kept o's flushed and unflushed
// values in separate registers across the K/V loop and spilled (d = 128: 120 B).
__device__ __forceinline__ void flush_o(float (&o)[kMT][kOT][4], float (&beta)[kMT][2], bool first, float* Ot,
                                        long long sr, int rows, int cols, int row0, int g, int t,
                                        uint32_t zero) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int row = row0 + mt * 16 + g + 8 * rr;
            if (row < rows) {
                float* orow = Ot + row * sr + 4 * t;
                const float bt = beta[mt][rr];
#pragma unroll
                for (int cc = 0; cc < kDv / 16; ++cc) {
                    if (kPadded && cc * 16 >= cols) continue;
                    const float a = o[mt][2 * cc][2 * rr], b = o[mt][2 * cc + 1][2 * rr];
                    const float c = o[mt][2 * cc][2 * rr + 1], d = o[mt][2 * cc + 1][2 * rr + 1];
                    if (first) {
                        gstore4(orow + cc * 16, a, b, c, d);
                    } else {
                        const float4 x = gload(reinterpret_cast<const float4*>(orow + cc * 16));
                        gstore4(orow + cc * 16, fmaf(x.x, bt, a), fmaf(x.y, bt, b), fmaf(x.z, bt, c), fmaf(x.w, bt, d));
                    }
                }
            }
            beta[mt][rr] = 1.0f;
        }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][nt][e] = __uint_as_float(__float_as_uint(o[mt][nt][e]) & zero);
}
#endif

// ------------------------------------------------------------- the kernel
// __launch_bounds__(threads, 1): without the minimum of one block per SM ptxas capped some
// specialisations at 168 registers and spilled (measured with NVRTC 13 for sm_80); the
// planner's register budget assumes up to 255.
extern "C" __global__ void __launch_bounds__(kThreads, 1) CUFLASH_FWD_TC_KERNEL(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, float* __restrict__ LSE, const FwdParams* __restrict__ P
    CUFLASH_TC_MASK_ARGS)
{
    CUFLASH_DYNAMIC_SHARED(elem_t, smem);
    elem_t* Qs = smem;                // (kBr, kQS)       Q_i
    elem_t* Ks = Qs + kBr * kQS;             // kStages x (kBc, kKS)   K_j
    elem_t* Vs = Ks + kStages * kBc * kKS;   // kStages x (kBc, kVS)   V_j

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const FwdParams& p = *P;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal, off = p.causal_offset;
    // scale * log2(e), rounded once; the launcher passes scale >= 0 (a negative scale arrives
    // as -scale with -Q), so the row max of the raw logits is the max of the scaled ones
#ifdef CUFLASH_MASKS
    // with a logit term the tile's logits arrive scaled (tc_features): the exponent's factor is
    // log2(e) alone
    const float c = (float)((p.mask_softcap > 0 || p.mask_has_bias || p.mask_has_alibi ? 1.0 : p.scale)
                            * 1.4426950408889634);
#else
    const float c = (float)(p.scale * 1.4426950408889634);
#endif
#if CUFLASH_TF32
    // 0xffffe000 from a run-time value (Nq >= 0 always), so that ptxas cannot fold it (see split)
    const uint32_t hi_mask = 0xffffe000u | (uint32_t)(Nq < 0);
#endif
    // blockIdx.x -> (tile, head, batch) as cuflash_fold_decode, in 32-bit arithmetic: a grid
    // has < 2^31 blocks, and 64-bit division is a called subroutine (registers saved around
    // the call show up as spills)
    const unsigned bid = blockIdx.x, bh = bid / (unsigned)p.n_tiles;
    const FoldedIndex fi = {(int)(bid - bh * (unsigned)p.n_tiles), (int)(bh % (unsigned)p.H), (int)(bh / (unsigned)p.H)};
    // causal: the last Q tiles see the most keys; run them first (the tile index is the
    // fastest axis of the folded grid, so the blocks of a head start heaviest first)
    const int tile = causal ? p.n_tiles - 1 - fi.tile : fi.tile;
    const int q0 = tile * kBr;
    const int h = fi.h, b = fi.b, hk = h / p.group;
    const long long q_sr = p.q_sr, k_sr = p.k_sr, v_sr = p.v_sr;

    const elem_t* Qb = Q + b * p.q_sb + h * p.q_sh + q0 * q_sr;
    const elem_t* Kb = K + b * p.k_sb + hk * p.k_sh;
    const elem_t* Vb = V + b * p.v_sb + hk * p.v_sh;
    // the columns the call has (the copies zero-fill the rest; O's past dv are not stored)
    const int d_cols = kPadded ? p.head_d : kD, dv_cols = kPadded ? p.head_dv : kDv;

    const int rows_q = min(kBr, Nq - q0);
    int kv_end = Nk;  // keys [0, kv_end) are visible to some row of the tile
    if (causal) {
        const long long last = (long long)(q0 + rows_q - 1) + off + 1;
        kv_end = (int)(last < 0 ? 0 : (last > Nk ? Nk : last));
    }
#ifdef CUFLASH_MASKS
    // the rows' key intervals [lo, hi) grow with the row: the tile loads the keys from the
    // first row's lo to the last row's hi, and needs the interval test where a tile starts
    // before the last row's lo or ends after the first row's hi (or holds rows past Nq)
    int lo_first, hi_first, lo_last, hi_last;
    cuflash_window_range(p, q0, p.mask_offset, Nk, causal ? (long long)q0 + off + 1 : (long long)Nk,
                         lo_first, hi_first);
    cuflash_window_range(p, q0 + rows_q - 1, p.mask_offset, Nk, kv_end, lo_last, hi_last);
    const int kv_begin = hi_last > lo_first ? lo_first : 0;
    kv_end = hi_last > lo_first ? hi_last : 0;
    const int j0 = kv_begin / kBc;  // first K/V tile
    const bool mask_rows = rows_q < kBr;
    // the ALiBi slope once per thread (the rest of TcFeatures is read per tile: tc_features_of)
    const float neg_slope = p.mask_has_alibi ? -gload(Slopes + b * p.mask_alibi_sb + h * p.mask_alibi_sh) : 0.0f;
    const DropoutKey drop = cuflash_dropout_key(p);
#else
    constexpr int j0 = 0;
    // tiles ending at or before mask_from need no mask: the block's first row sees all their
    // keys (causal), and they end before Nk
    const int mask_from = causal ? (int)max(0ll, min((long long)Nk, (long long)q0 + off + 1)) : Nk;
#endif
    const int n_kv = (kv_end + kBc - 1) / kBc;
    const int row0 = warp * kRowsW;  // the warp's first row in the tile

    // -- Q_i and the first K tile (and V tile, with two stages): one cp.async group
    const TileCopy<kBc, kD, kKS> kcopy(tid, k_sr, d_cols);
    const TileCopy<kBc, kDv, kVS> vcopy(tid, v_sr, dv_cols);
    TileCopy<kBr, kD, kQS>(tid, q_sr, d_cols).issue(Qs, Qb, rows_q);
    if (n_kv > j0) {
        kcopy.issue(Ks, Kb + (long long)j0 * kBc * k_sr, min(kBc, Nk - j0 * kBc));
        if (kStages == 2) vcopy.issue(Vs, Vb + (long long)j0 * kBc * v_sr, min(kBc, Nk - j0 * kBc));
    }
    cp_async_commit();

    // per row: the reference max in exponent units, mc = m * c (kNoRef until the row's first
    // visible key: finite, so that a masked logit's exponent s c - mc is -inf, not NaN, and
    // below every finite m c, so that the first visible key always moves it), and the row
    // sum: the lane's partial sum l_i (the quad's four are added at the end), or with
    // CUFLASH_SUM_BY_MMA the MMA accumulator ls (rows g: [0], [1]; g + 8: [2], [3])
    float mc_i[kMT][2], l_i[kMT][2], ls[kMT][4];
    float o[kMT][kOT][4];
#if CUFLASH_TF32
    float beta[kMT][2];  // the rescales of o since its last flush (O's second level)
#endif
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#if CUFLASH_TF32
        beta[mt][0] = beta[mt][1] = 1.0f;
#endif
        mc_i[mt][0] = mc_i[mt][1] = kNoRef;
        l_i[mt][0] = l_i[mt][1] = 0.0f;
        ls[mt][0] = ls[mt][1] = ls[mt][2] = ls[mt][3] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.0f;
    }
    const elem_t* Qw = Qs + row0 * kQS;
#if CUFLASH_TF32
    // the tile's O rows: O's second level (flush_o) and the result
    const long long o_sr = P->o_sr;
    float* const Ot = O + b * P->o_sb + h * P->o_sh + q0 * o_sr;
#else
    uint32_t qreg[kQInRegs ? kMT : 1][kQInRegs ? kD / 16 : 1][4];
    // the lane's ldmatrix addresses: Q_w, and K / V of stage 0 (stage 1 is a tile further on)
    const saddr_t qa = saddr_of(Qw + q_lane_off(lane));
    const saddr_t ka0 = saddr_of(Ks + k_lane_off(lane)), va0 = saddr_of(Vs + v_lane_off(lane));
#endif

    // this thread's first chunk of the next K tile and of the next V tile to copy (two
    // stages: j0 + 1 as K's; one: j0, copied in the trip that uses it), stepped a tile per trip
    const elem_t* kown = Kb + kcopy.goff + (long long)(j0 + 1) * kBc * k_sr;
    const elem_t* vown = Vb + vcopy.goff + (long long)(j0 + kStages - 1) * kBc * v_sr;
    for (int j = j0; j < n_kv; ++j) {
        const int stage = kStages == 2 ? (j - j0) & 1 : 0, k0 = j * kBc;
        cp_async_wait<0>();  // this thread's copies of K_j (and, first, Q_i) have landed
        // Everyone's copies of K_j are visible, and every warp is done with tile j - 1 (two
        // stages: whose stage the prefetch below overwrites; one: with V_{j-1}).
        __syncthreads();
        if (kStages == 2) {
            if (j + 1 < n_kv) {
                const int rows1 = min(kBc, Nk - k0 - kBc);
                copy_tile(kcopy, Ks + (stage ^ 1) * kBc * kKS, kown, Kb, rows1);
                copy_tile(vcopy, Vs + (stage ^ 1) * kBc * kVS, vown, Vb, rows1);
                kown += kBc * k_sr;
                vown += kBc * v_sr;
            }
            cp_async_commit();  // (possibly empty) group of tile j + 1
        } else {
            copy_tile(vcopy, opaque(Vs), vown, Vb, min(kBc, Nk - k0));  // lands under S = Q K_j^T
            vown += kBc * v_sr;
            cp_async_commit();
        }
#if CUFLASH_TF32
        const float* Kt = Ks + stage * kBc * kKS;
        const float* Vt = Vs + stage * kBc * kVS;
#else
        const saddr_t ka = ka0 + stage * (kBc * kKS * kElem), va = va0 + stage * (kBc * kVS * kElem);
#endif

        // -- S = Q_w K_j^T (raw logits)
        float s[kMT][kNT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#if CUFLASH_TF32
        compute_s(s, Qw, Kt, g, t, hi_mask);
#else
        if (kQInRegs) {
            if (j == j0) {
#pragma unroll
                for (int mt = 0; mt < (kQInRegs ? kMT : 0); ++mt)
#pragma unroll
                    for (int kk = 0; kk < kD / 16; ++kk) load_q_frag(qreg[mt][kk], qa, mt, kk);
            }
            compute_s(s, [&](uint32_t (&a)[4], int mt, int kk) {
                a[0] = qreg[kQInRegs ? mt : 0][kQInRegs ? kk : 0][0];
                a[1] = qreg[kQInRegs ? mt : 0][kQInRegs ? kk : 0][1];
                a[2] = qreg[kQInRegs ? mt : 0][kQInRegs ? kk : 0][2];
                a[3] = qreg[kQInRegs ? mt : 0][kQInRegs ? kk : 0][3];
            }, ka);
        } else {
            compute_s(s, [&](uint32_t (&a)[4], int mt, int kk) { load_q_frag(a, qa, mt, kk); }, ka);
        }
#endif

#ifdef CUFLASH_MASKS
        // -- logit terms on every tile, the interval test only where some row's band ends
        if (k0 < lo_last || k0 + kBc > hi_first || mask_rows) {
            tc_features<true>(s, tc_features_of(p, Bias, b, h, neg_slope), q0, row0, rows_q, Nk, k0, g, t);
        } else if (p.mask_softcap > 0 || p.mask_has_bias || p.mask_has_alibi) {
            tc_features<false>(s, tc_features_of(p, Bias, b, h, neg_slope), q0, row0, rows_q, Nk, k0, g, t);
        }
#else
        // -- masks, only on tiles that cross the causal diagonal or the end of the keys
        if (!CUFLASH_FWD_INTERIOR_ONLY && k0 + kBc > mask_from) {
            // row i sees keys [0, min(max(i + hoff, 0), Nk)) in 32-bit arithmetic: off is
            // Nk - Nq or 0, so i + off + 1 lies in [-Nq, Nk] (and without a mask hoff = Nk + 1)
            const int hoff = causal ? off + 1 : Nk + 1;
            const int i0 = kStages == 1 ? opaque(q0 + row0 + g) : q0 + row0 + g;
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    // this lane's row sees keys [0, end); as an offset into the tile
                    const int end = min(max(i0 + mt * 16 + 8 * rr + hoff, 0), Nk) - k0 - 2 * t;
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int e1 = 0; e1 < 2; ++e1)
                            if (nt * 8 + e1 >= end) s[mt][nt][2 * rr + e1] = -INFINITY;
                }
        }
#endif

        if (kStages == 1) {
            cp_async_wait<0>();  // this thread's copies of V_j have landed
            // Everyone's copies of V_j are visible, and every warp is done with K_j, which the
            // copy below overwrites; K_{j+1} lands under the softmax and P V_j (as FlashAttention-2).
            __syncthreads();
            if (j + 1 < n_kv) {
                copy_tile(kcopy, opaque(Ks), kown, Kb, min(kBc, Nk - k0 - kBc));
                kown += kBc * k_sr;
            }
            cp_async_commit();
        }

        // -- online softmax against a lazily moved reference max: P = 2^(S c - mc) with mc = m c
        // for the row's reference m (raw logits).  m moves up to the row max -- rescaling the
        // row's O and l by alpha = 2^(mc_old - mc_new) -- only when the tile's max exceeds it
        // by more than kLazy / c, i.e. when some P would exceed 2^kLazy; the decision is
        // warp-uniform (__any_sync), so tiles in which no row of the warp crosses that margin
        // skip the rescale (a multiply per O accumulator).  O, l and lse all use the same
        // reference, so the result does not depend on when it moved; P <= 2^kLazy = 256 is
        // far inside float16/bfloat16 range and loses no relative precision.
        float mx[kMT][2];
        bool move = false;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float x = nan_max(s[mt][0][2 * rr], s[mt][0][2 * rr + 1]);  // (no max with -inf)
#pragma unroll
                for (int nt = 1; nt < kNT; ++nt) x = nan_max(x, nan_max(s[mt][nt][2 * rr], s[mt][nt][2 * rr + 1]));
                x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, 1));
                x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, 2));
                x *= c;  // (c > 0: the max of the scaled logits)
                mx[mt][rr] = x;
                move |= x > mc_i[mt][rr] + kLazy;  // NaN: no move; P and l become NaN anyway
            }
        const bool any_move = __any_sync(0xffffffffu, move);
#ifdef CUFLASH_FWD_COUNT_RESCALE
        if (any_move) {  // counting the interior tile with its rescale (results wrong as above)
#else
        if (CUFLASH_FWD_INTERIOR_ONLY && any_move) __trap();  // counting: keep the test, drop the rescale
        if (!CUFLASH_FWD_INTERIOR_ONLY && any_move) {
#endif
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                float alpha[2];
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    // a row's first visible key: alpha = 2^(kNoRef - mc) = 0 on O = l = 0 (not
                    // 0 * inf); a row still without one keeps kNoRef (alpha = 1, on zeros)
                    const float mc_new = nan_max(mc_i[mt][rr], mx[mt][rr]);
                    alpha[rr] = cuflash_exp2(mc_i[mt][rr] - mc_new);
                    mc_i[mt][rr] = mc_new;
                    l_i[mt][rr] *= alpha[rr];
                    ls[mt][2 * rr] *= alpha[rr];
                    ls[mt][2 * rr + 1] *= alpha[rr];
#if CUFLASH_TF32
                    beta[mt][rr] *= alpha[rr];
#endif
                }
#pragma unroll
                for (int nt = 0; nt < kOT; ++nt) {
                    o[mt][nt][0] *= alpha[0]; o[mt][nt][1] *= alpha[0];
                    o[mt][nt][2] *= alpha[1]; o[mt][nt][3] *= alpha[1];
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[mt][nt][e] = cuflash_exp2(fmaf(s[mt][nt][e], c, -mc_i[mt][e >> 1]));
                    if (!CUFLASH_SUM_BY_MMA) l_i[mt][e >> 1] += s[mt][nt][e];
                }
#ifdef CUFLASH_MASKS
        if (drop.on) tc_dropout(s, drop, b + p.mask_drop_b0, h, q0 + row0, k0, g, t);
#endif

        // -- O += P V_j
#if CUFLASH_TF32
        compute_pv(o, s, Vt, g, t, hi_mask);
        // -- O's second level: every kFlushTiles tiles, not after the last (the epilogue adds o)
        if (!CUFLASH_FWD_INTERIOR_ONLY && ((j - j0) & (kFlushTiles - 1)) == kFlushTiles - 1 && j + 1 < n_kv)
            flush_o(o, beta, j - j0 == kFlushTiles - 1, Ot, o_sr, rows_q, dv_cols, row0, g, t, hi_mask & 1u);
#else
        compute_pv(o, ls, s, va);
#endif
    }
    cp_async_wait<0>();  // no copy outlives the block (only Q_i is pending when n_kv == 0)

    // -- O_i = O / l, lse = ln 2 * (mc + log2(l)); rows that saw no key: 0 and -inf
#if CUFLASH_TF32
    const bool flushed = n_kv - j0 > kFlushTiles;  // O holds flushed sums (flush_o)
#else
    elem_t* Ob = O + b * P->o_sb + h * P->o_sh;
#endif
    float* LSEb = LSE + b * P->lse_sb + h * P->lse_sh;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float l = ls[mt][2 * rr];  // (CUFLASH_SUM_BY_MMA: the row sum)
            if (!CUFLASH_SUM_BY_MMA) {  // the quad's partial sums -> the row sum
                l = l_i[mt][rr];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
            }
            const int row = row0 + mt * 16 + g + 8 * rr;
            if (row < rows_q) {
                const int i = q0 + row;
                const bool empty = l == 0.0f;
#ifdef CUFLASH_MASKS
#if CUFLASH_TF32
                // dropout's 1 / (1 - p), read here: drop.scale held across the K/V loop (as the
                // double it is loaded from) was spilled beside O's second level
                const float num = drop.on ? (float)p.mask_drop_scale : 1.0f;
#else
                const float num = drop.on ? drop.scale : 1.0f;  // dropout's 1 / (1 - p)
#endif
#else
                const float num = 1.0f;
#endif
                const float inv = empty ? 0.0f : __fdividef(num, l);  // MUFU.RCP: no division subroutine
#if CUFLASH_TF32
                float* orow = Ot + row * o_sr;
                const float bt = beta[mt][rr];
#pragma unroll
                for (int cc = 0; cc < kDv / 16; ++cc) {  // columns 16cc + 4t .. 4t+3 (see compute_pv)
                    if (kPadded && cc * 16 >= dv_cols) continue;
                    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (flushed) x = gload(reinterpret_cast<const float4*>(orow + cc * 16 + 4 * t));
                    const float xs[4] = {x.x, x.y, x.z, x.w};
                    const float y[4] = {o[mt][2 * cc][2 * rr], o[mt][2 * cc + 1][2 * rr],
                                        o[mt][2 * cc][2 * rr + 1], o[mt][2 * cc + 1][2 * rr + 1]};
                    float z[4];
#pragma unroll
                    for (int m = 0; m < 4; ++m) z[m] = (flushed ? fmaf(xs[m], bt, y[m]) : y[m]) * inv;
                    gstore4(orow + cc * 16 + 4 * t, z[0], z[1], z[2], z[3]);
                }
#else
                elem_t* orow = Ob + i * P->o_sr;
#pragma unroll
                for (int nt = 0; nt < kOT; ++nt)
                    if (!kPadded || nt * 8 < dv_cols)
                        gstore_pair(orow + nt * 8 + 2 * t, o[mt][nt][2 * rr] * inv, o[mt][nt][2 * rr + 1] * inv);
#endif
                // lse = ln(sum 2^(S c)) = ln 2 * (mc + log2(l))
                if (t == 0) gstore(LSEb + i, empty ? -INFINITY : (mc_i[mt][rr] + log2f(l)) * 0.6931471805599453f);
            }
        }
}

// flash_bwd_tc.cu -- the FlashAttention-2 backward on tensor cores, for float16 and bfloat16.
//
// What it computes (cuflash.tiled_attention_backward; the same contract as flash_bwd.cu):
// for every query head with P = softmax(scale * Q K^T [causal mask]) (never stored),
//     D  = rowsum(dO * O)        dP = dO V^T        dS = P * (dP - D)
//     dV = P^T dO                dK = scale * dS^T Q        dQ = scale * dS K
// P recomputed tile by tile from the forward's log-sum-exp (FlashAttention-2, Dao 2023):
// P = exp2(s * scale * log2(e) - lse * log2(e)), one FFMA + one MUFU.EX2 per element.
//
// Kernels (one launch each, in this order; cuflash/launch/bwd_tc.py):
//   flash_bwd_tc_preprocess  D = rowsum(dO * O) and lse2 = lse * log2(e) per query row into a
//                            float32 workspace, both padded to whole Q tiles (padding rows and
//                            rows that see no key get lse2 = +inf, so P = 0 there with no
//                            test in the main loop); zeroes the float32 dQ accumulator(s).
//   flash_bwd_tc             one block per (KV tile j, kv head, batch): K_j, V_j resident in
//                            shared memory, (Q_i, dO_i, lse2_i, D_i) streamed for every query
//                            head of the GQA group and every Q tile that sees K_j, with the next
//                            tile in flight (cp.async, two buffers) while the current one
//                            computes.  dK_j, dV_j accumulate in registers (summed over the
//                            group's heads) and are written once; dQ_i += dS K_j goes to a
//                            float32 accumulator with red.global.add (vectorised on sm_90).
//   flash_bwd_tc_dq_convert  dQ = scale * (sum of the accumulator slices, in slice order), in
//                            the input dtype.
//
// Warp layout of flash_bwd_tc.  A key group of kMT * 16 consecutive keys of K_j belongs to
// kQS warps (block_kv = 16 * kMT * kWarps / kQS); each of them takes kBrw = block_q / kQS of
// the queries of S^T and dP^T and 1 / kQS of the dK, dV columns:
//   S^T  = K_w Q_i^T   (kMT*16 x kBrw)     A = K_w rows (ldmatrix.x4), B = Q_i rows (ldmatrix.x4:
//                                           Q row-major is the "col" B operand of K Q^T)
//   P^T  = exp2(S^T * scale_log2 - lse2)    in the accumulator layout: lane (g, t) holds keys
//                                           g, g+8 and queries 2t, 2t+1 of each 8-query tile;
//                                           kept rounded to the input dtype (packed pairs)
//   dP^T = V_w dO_i^T, dS^T = P^T (dP^T - D) the same way, dS^T -> shared memory (16-bit)
//   dV_w += P^T dO_i, dK_w += dS^T Q_i      B = dO_i / Q_i rows with ldmatrix.x4.trans; A =
//                                           kQS = 1: P^T / dS^T repacked in registers (the
//                                           accumulator layout IS the A layout: no round trip),
//                                           before the barrier;
//                                           kQS = 2: all block_q queries of P^T / dS^T, half of
//                                           them the pair's other warp's, from shared memory
//                                           (Ps, dSs; ldmatrix.x4) after the barrier
//   dQ_i (block_q x d) = dS K_j              after the barrier, kDqM x kDqN warp tiles: A = dS
//                                           from the stored dS^T (ldmatrix.x4.trans), B = K_j
//                                           (ldmatrix.x4.trans); each lane reds its pairs.
// Why: the transposed products need the warp that owns a key to see all queries of it, so a
// warp's S^T tile is (keys x queries) and it reads the whole Q_i / dO_i tile for its keys:
// the shared-memory traffic per HMMA falls with the keys a warp (or warp pair) owns.  32 keys
// per warp (kMT = 2) doubles the dK/dV registers, which fits small head dims (d + dv <= 128);
// the query split gives 32 keys to a pair of warps for twice those head dims (d = 128: 259
// B of shared memory per HMMA at 64 x 128 tiles against 307 with 16 keys per warp, and 256
// for FlashAttention-2's layout; bench/kernel_report.py).  Head dims too large for dK/dV in
// registers run in kPasses = 2 passes over the Q tiles: pass p accumulates the p-th slice of
// the dK and dV columns and recomputes S^T and dP^T (dQ is added in pass 0 only).
//
// Shared memory (16-bit unless noted; rows padded by 8 elements = 16 bytes, see below):
//   Ks (Bc, d+8), Vs (Bc, dv+8)            resident
//   Qs 2 x (Br, d+8), dOs 2 x (Br, dv+8)   double-buffered (dOs single with
//                                          CUFLASH_BWD_DO_STAGES=1, below)
//   dSs (Bc, Br+8)                          dS^T of the current tile (dQ; dK with kQS = 2)
//   Ps (Bc, Br+8)                           P^T of the current tile (kQS = 2 only)
//   float lse2_s 2 x Br, D_s 2 x Br
// Bank conflicts: every ldmatrix phase reads 8 rows of 16 bytes; a padded row stride of
// 2*d + 16 bytes is an odd multiple of 16 for d a multiple of 16 (mod 128 bytes), so the 8
// rows land in 8 different 16-byte bank groups -- conflict-free for the plain and the .trans
// forms alike.  The 32-bit dS^T / P^T stores of a warp hit word (Br+8)/2 * g + t: (Br+8)/2 =
// 4 (mod 32) words for Br a multiple of 16 ... 4g + t, 32 different banks.  Padding rather
// than an XOR swizzle: it costs 8 elements per row (about 6-12% more shared memory) but keeps
// every address a plain row * stride + column, the same in the loads and the fragments.
//
// Causal (runtime `causal`, `causal_offset`): query i sees key j iff j <= i + causal_offset.
// Q tiles that see no key of K_j are never loaded (the loop starts at the first that does);
// the mask is evaluated only on tiles that cross the boundary or hold keys >= Nk.
// GQA/MQA: query head h reads kv head h / group; the block loops over the group's heads.
// Broadcast leading dims arrive as stride 0 (the launcher sums those gradients).
//
// dQ accumulation: atomic path (default) -- grid n_kv_tiles x Hk x B, one slice, float32
// reds from all KV blocks (the summation order is not fixed).  Deterministic path -- grid
// n_splits x Hk x B: block s handles KV tiles s, s + n_splits, ... one after another and
// reds into its own slice s, so every element of a slice gets its adds from ONE thread in
// program order (applied in that order: portable.cuh, gred_add); the convert kernel sums
// the slices in slice order -> bitwise repeatable.
//
// Logit features (compiled with -DCUFLASH_MASKS and -DCUFLASH_BWD_TC_MAIN: kernel
// flash_bwd_tc_masked, three more arguments Bias, Slopes, dBias as flash_bwd_dkdv_masked;
// masks.cuh; the helpers are the plain ones): with the logits s = softcap(scale Q K^T) + bias
// + ALiBi of the forward and P = exp(s - lse), masked by causal and window,
//     dV += (P * keep)^T dO (1 / (1 - p) applied to dV at the end), dP = dO V^T * keep / (1-p)
//     dS = P * (dP - D);  dbias += dS (pass 0);  softcap: dS *= 1 - tanh^2 before dK and dQ.
// A row's visible keys are the band i + lo_off <= j < i + hi_off (and j < Nk): Q tiles whose
// rows see no key of K_j are never loaded (both sides); the band test runs only on tile
// pairs that cross it, hold keys past Nk or rows past Nq.  Each feature is a loop of its own
// over the tile's S^T elements behind one uniform branch per tile (no per-element test of
// what the call has): softcap by 1 - 2 / (1 + 2^x) (one MUFU.EX2, one MUFU.RCP), the bias
// from a row pointer per query and keys at constant offsets when its key stride is 1 and
// the tile lies inside [0, Nq) x [0, Nk) (else 64-bit offsets per key, rows and keys past
// the ends clamped to in-bounds elements that the band test drops), ALiBi's distance in
// float from a per-lane base; the logit is held in units of c (softcap) or the scale, which
// the exponent's FFMA takes.  P is kept undropped in pp (dS needs it) with the keep bits
// of the dropout beside it, ANDed into P^T's pairs only in calls with dropout; 1 - tanh^2 is
// folded into float32 P^T where there is no bias or ALiBi (kFloatP builds), else kept as
// float16 pairs (dS is rounded to the input dtype right after).  Dropout in the transposed layout: lanes g = 2u, 2u + 1 of one t
// hold the even and odd keys of the Philox blocks of queries 2t, 2t + 1 (rows q, q + 8 x keys
// 2u, 2u + 1, 2u + 8, 2u + 9 of a 16 x 16 tile: 16 bits each, philox.cuh); each lane draws one
// of the two blocks and the pair swaps halves with one xor shuffle (bwd_masks.cuh): one
// Philox block per eight logits.  dbias (= dS before softcap's derivative): every
// element of a visited tile pair inside [0, Nq) x [0, Nk) (0 outside the band) stored by
// its one block or, broadcast, atomically added.
// The band alone (-DCUFLASH_BWD_BAND besides -DCUFLASH_MASKS: kernel flash_bwd_tc_band, the
// same arguments) is the build of a call whose only feature is a window (with or without
// causal): every other feature off at compile time, so that its loop is the plain kernel's
// with the band's range and test and it runs the plain kernel's tiles and lean loop.  With
// -DCUFLASH_BWD_SOFTCAP too (kernel flash_bwd_tc_softcap) the same build has the softcap on at
// compile time: a call whose features are a softcap and at most a window.  There the logit is
// held as r of tanh = 1 - 2 r, the exponent is one FFMA of r, and the exponential gives 4 P
// (exactly: 2 added to the exponent), which makes P (1 - tanh^2) = 4 P (r - r^2) one FFMA and
// one FMUL per element; dV takes 4 P^T and is stored times 1/4.  With -DCUFLASH_BWD_ALIBI
// instead (kernel flash_bwd_tc_alibi) it has ALiBi on at compile time: a call whose features
// are ALiBi and at most a window; with -DCUFLASH_BWD_DROPOUT (kernel flash_bwd_tc_dropout) the
// dropout: a call whose features are dropout and at most a window, its keep bits drawn as in
// the masked kernel but in the plain kernel's tiles (no registers held for 1 - tanh^2 or the
// bias), all of a trip's Philox blocks in one step, their round keys ten more arguments (by
// value, from the launcher), and dV stored times 1 / (1 - p); with both -DCUFLASH_BWD_ALIBI and
// -DCUFLASH_BWD_DROPOUT (kernel flash_bwd_tc_alibi_dropout) both: a call whose features are
// ALiBi, dropout and at most a window; with -DCUFLASH_BWD_SOFTCAP and -DCUFLASH_BWD_ALIBI
// (kernel flash_bwd_tc_alibi_softcap) a softcap and ALiBi: a call whose features are those
// two and at most a window, ALiBi's term added to the exponent where the logit is held as r
// (so that r stays what P (1 - tanh^2) = 4 P (r - r^2) needs).
//
// Compile-time parameters: CUFLASH_DTYPE_F16 | CUFLASH_DTYPE_BF16, CUFLASH_HEAD_DIM (d),
// CUFLASH_HEAD_DIM_V (dv), CUFLASH_BLOCK_Q (Br), CUFLASH_BLOCK_KV (Bc), CUFLASH_THREADS,
// CUFLASH_BWD_PASSES (1 or 2), CUFLASH_BWD_QSPLIT (1 or 2), CUFLASH_BWD_DO_STAGES (2, or 1
// where a plan's shared memory needs it), all from cuflash.tiling
// ("flash_bwd_tc", which also holds the register arrays to what compiles without spills).
// Head dims: the main kernel is compiled for d and dv, or -- with -DCUFLASH_HEAD_DIMS_PADDED,
// the build of a call whose d != dv (cuflash.tiling compiles it for max(d, dv)) -- for larger
// ones than the call's, which it reads from BwdParams head_d, head_dv: the columns of K, Q past
// d and of V, dO past dv are zero-filled in shared memory (every product is exact), those of
// dK, dQ past d and of dV past dv are not written, and dK, dV and the dQ accumulator keep the
// call's row lengths.  The helpers are compiled for the call's own d and dv.
//
// Limits: d, dv multiples of 16 up to 256; Br, Bc multiples of 16; 16-byte aligned rows of
// q, k, v, o, do (element strides multiples of 8; the launcher copies other inputs).  On
// GPUs before sm_80 portable.cuh's software mma and synchronous copies run instead.
#if !defined(CUFLASH_DTYPE_F16) && !defined(CUFLASH_DTYPE_BF16)
#error "flash_bwd_tc supports CUFLASH_DTYPE_F16 and CUFLASH_DTYPE_BF16 only"
#endif
#include "dtype.cuh"
#include "params.cuh"
#include "tile_copy.cuh"
#include "saddr.cuh"
#ifdef CUFLASH_MASKS
#include "bwd_masks.cuh"
#include "fast_math.cuh"
#if defined(CUFLASH_BWD_BAND) && defined(CUFLASH_BWD_SOFTCAP) && defined(CUFLASH_BWD_ALIBI)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_alibi_softcap
#elif defined(CUFLASH_BWD_BAND) && defined(CUFLASH_BWD_SOFTCAP)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_softcap
#elif defined(CUFLASH_BWD_BAND) && defined(CUFLASH_BWD_ALIBI) && defined(CUFLASH_BWD_DROPOUT)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_alibi_dropout
#elif defined(CUFLASH_BWD_BAND) && defined(CUFLASH_BWD_ALIBI)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_alibi
#elif defined(CUFLASH_BWD_BAND) && defined(CUFLASH_BWD_DROPOUT)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_dropout
#elif defined(CUFLASH_BWD_BAND)
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_band
#else
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc_masked
#endif
#ifdef CUFLASH_BWD_DROPOUT
// the dropout build's ten round keys of Philox (round r: k0 + r 0x9E3779B9 low, k1 + r
// 0xBB67AE85 high), by value: the constant bank, no instruction per round and step
#define CUFLASH_BWD_TC_MASK_ARGS , const float* __restrict__ Bias, \
    const float* __restrict__ Slopes, float* __restrict__ dBias, \
    const unsigned long long rk0, const unsigned long long rk1, const unsigned long long rk2, \
    const unsigned long long rk3, const unsigned long long rk4, const unsigned long long rk5, \
    const unsigned long long rk6, const unsigned long long rk7, const unsigned long long rk8, \
    const unsigned long long rk9
#else
#define CUFLASH_BWD_TC_MASK_ARGS , const float* __restrict__ Bias, \
    const float* __restrict__ Slopes, float* __restrict__ dBias
#endif
#else
#if defined(CUFLASH_BWD_BAND) || defined(CUFLASH_BWD_SOFTCAP) || defined(CUFLASH_BWD_ALIBI) || defined(CUFLASH_BWD_DROPOUT)
#error "CUFLASH_BWD_BAND, _SOFTCAP, _ALIBI and _DROPOUT are builds of the logit features: define CUFLASH_MASKS with them"
#endif
#define CUFLASH_BWD_TC_KERNEL flash_bwd_tc
#define CUFLASH_BWD_TC_MASK_ARGS
#endif
#ifdef CUFLASH_MASKS
#ifdef CUFLASH_BWD_BAND
constexpr bool kBandOnly = true;
#else
constexpr bool kBandOnly = false;
#endif
#endif
#ifdef CUFLASH_BWD_SOFTCAP
#ifndef CUFLASH_BWD_BAND
#error "CUFLASH_BWD_SOFTCAP is a variant of the band build: define CUFLASH_BWD_BAND with it"
#endif
constexpr bool kCapBuild = true;
#else
constexpr bool kCapBuild = false;
#endif
#ifdef CUFLASH_MASKS
#ifdef CUFLASH_BWD_ALIBI
#ifndef CUFLASH_BWD_BAND
#error "CUFLASH_BWD_ALIBI is a variant of the band build (or of its softcap build): define CUFLASH_BWD_BAND with it"
#endif
constexpr bool kAlibiBuild = true;
#else
constexpr bool kAlibiBuild = false;
#endif
#ifdef CUFLASH_BWD_DROPOUT
#if !defined(CUFLASH_BWD_BAND) || defined(CUFLASH_BWD_SOFTCAP)
#error "CUFLASH_BWD_DROPOUT is a variant of the band build (not the softcap one): define CUFLASH_BWD_BAND with it"
#endif
constexpr bool kDropBuild = true;
#else
constexpr bool kDropBuild = false;
#endif
#endif

// Module split (cuflash.kernels compiles the two concurrently): -DCUFLASH_BWD_TC_HELPERS
// builds only the preprocess and convert kernels, which need just the dtype (they read the
// head dims from BwdParams, so one module serves every head dim and the Hopper backward);
// -DCUFLASH_BWD_TC_MAIN only flash_bwd_tc; neither builds all three.
// float32 log2(e): exp(x) = exp2(x * log2(e))
#define CUFLASH_LOG2E 1.4426950408889634f

#ifndef CUFLASH_BWD_TC_HELPERS
#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V)
#error "define CUFLASH_HEAD_DIM and CUFLASH_HEAD_DIM_V"
#endif
constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kDv = CUFLASH_HEAD_DIM_V;
static_assert(kD % 16 == 0 && kDv % 16 == 0 && kD <= 256 && kDv <= 256, "d, dv: multiples of 16 up to 256");
#ifdef CUFLASH_HEAD_DIMS_PADDED
constexpr bool kPadded = true;   // the call's head dims (BwdParams) may be below kD, kDv
#else
constexpr bool kPadded = false;
#endif
#if !defined(CUFLASH_BLOCK_Q) || !defined(CUFLASH_BLOCK_KV) || !defined(CUFLASH_THREADS)
#error "define CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV and CUFLASH_THREADS"
#endif
#ifndef CUFLASH_BWD_PASSES
#define CUFLASH_BWD_PASSES 1
#endif
#ifndef CUFLASH_BWD_QSPLIT
#define CUFLASH_BWD_QSPLIT 1
#endif
constexpr int kBr = CUFLASH_BLOCK_Q;
constexpr int kBc = CUFLASH_BLOCK_KV;
constexpr int kThreads = CUFLASH_THREADS;
constexpr int kWarps = kThreads / 32;
constexpr int kQS = CUFLASH_BWD_QSPLIT;   // warps sharing one key group (query / column split)
constexpr int kMT = kBc * kQS / (16 * kWarps);  // m16 key tiles per warp
constexpr int kPasses = CUFLASH_BWD_PASSES;
constexpr int kBrw = kBr / kQS;           // queries of S^T / dP^T per warp
constexpr int kKS = kD + 8;               // padded row strides (elements)
constexpr int kVS = kDv + 8;
constexpr int kSS = kBr + 8;
constexpr int kNQ = kBrw / 8;             // 8-query tiles of S^T per m16 key tile
// dK / dV columns per warp and pass, in 16-column chunks: the columns are cut into
// kPasses * kQS slices (the last may be shorter); warp qh of a key group takes slice
// pass * kQS + qh
constexpr int kSlices = kPasses * kQS;
constexpr int kKC = (kD / 16 + kSlices - 1) / kSlices;
constexpr int kVC = (kDv / 16 + kSlices - 1) / kSlices;
// dQ warp tiles: kDqM rows x kDqN columns (at most 32 accumulator floats per lane), as
// square as the tile allows while giving every warp a tile
constexpr int kDqM = (kBr % 32 == 0 && kD % 32 == 0 && (kBr / 32) * (kD / 32) >= kWarps) ? 32 : 16;
constexpr int kDqN = kDqM == 32 ? 32
                   : (kD % 64 == 0 && (kBr / 16) * (kD / 64) >= kWarps) ? 64
                   : (kD % 32 == 0 && (kBr / 16) * (kD / 32) >= kWarps) ? 32 : 16;
constexpr int kDqTiles = (kBr / kDqM) * (kD / kDqN);
// The k loops of S^T (d / 16 trips), dP^T (dv / 16) and dQ (block_kv / 16) unrolled, and
// the mask test one branch per tile around the element loop: no loop counter, compare,
// branch or address arithmetic per trip, and the first mma of each accumulator reads zero
// registers instead of a cleared array -- 17-20% fewer instructions per HMMA in the steady
// loop at d = 64 and 128 (bench/fa2_sass_compare.py).  Rolled where the registers are already
// at the limit and the unrolled copies spilled (ptxas, NVRTC 13.0): head dims past 128 (two
// passes), the padded build, and the masked kernel (the features' registers) but where its
// register arrays (kArrays: dK, dV, P^T, dP^T and softcap's 1 - tanh^2, as cuflash.tiling
// counts them) hold 128 floats or fewer in one pass over 8 warps -- its defaults at d = 64 and
// 128; 4 warps (fewer threads per copy: more offsets per thread), 144 floats, or two passes
// spilled 4-40 B.
#ifdef CUFLASH_MASKS
constexpr int kArrays = kMT * 8 * (kKC + kVC) + kMT * kBrw;
constexpr bool kUnrolled = (kBandOnly || (kArrays <= 128 && kWarps >= 8 && kPasses == 1)) && !kPadded && kD <= 128 && kDv <= 128;
#else
constexpr bool kUnrolled = !kPadded && kD <= 128 && kDv <= 128;
#endif
constexpr int kUnrollS = kUnrolled ? kD / 16 : 1;
constexpr int kUnrollDP = kUnrolled ? kDv / 16 : 1;
constexpr int kUnrollDQ = kUnrolled ? kBc / 16 : 1;
#ifdef CUFLASH_MASKS
// the dropout's Philox blocks per step in the unrolled builds (their counters and bit
// positions in part constants, the round keys shared by the step's blocks): four; two at
// d = 16, where four spill 4 B at 32 x 128 on sm_90; the dropout build all of a trip's in one
// step (eight in FA2's 128 x 128 tiles at d = 64: the round keys once per trip, not twice)
constexpr int kUnrollDraw = kUnrolled ? (kDropBuild ? kMT * kNQ / 2 : kD > 16 ? 4 : 2) : 1;
#endif

static_assert(kThreads % 32 == 0 && kMT * 16 * kWarps == kBc * kQS && (kMT == 1 || kMT == 2),
              "block_kv must be 16 or 32 keys per warp");
static_assert((kQS == 1 || kQS == 2) && kWarps % kQS == 0 && kBrw % 16 == 0 && kBr <= 128,
              "block_q: a multiple of 16 (32 with the query split) up to 128");
static_assert(kPasses == 1 || kPasses == 2, "one or two passes");
// dO_i's shared buffers: two (the next tile's copy in flight while this one computes, as Q's),
// or one where two would not fit the shared memory of the tiles that cuflash.tiling gives
// it (CUFLASH_BWD_DO_STAGES=1, with the query split only): the next tile's dO is then copied
// once every warp has read this tile's (a barrier after dV += P^T dO), in flight while dK and
// dQ compute
#ifndef CUFLASH_BWD_DO_STAGES
#define CUFLASH_BWD_DO_STAGES 2
#endif
constexpr int kDoStages = CUFLASH_BWD_DO_STAGES;
static_assert(kDoStages == 2 || (kDoStages == 1 && kQS == 2), "one dO buffer with the query split only");

// the query split's largest tiles (128 x 128: 8 warps, 64 queries each), near 255 registers
constexpr bool kBigSplit = kQS == 2 && kBr * kBc >= 128 * 128;
#ifdef CUFLASH_MASKS
// The band's range of query tiles of a K/V tile, it0 .. it1, clamped to it1 >= it0 (an empty
// range where no row sees the tile) or left as it is with the tile count max(0, it1 - it0):
// equivalent, but ptxas (NVRTC 13.0) allocates them differently at 255 registers -- the band
// build's 128 x 128 tiles on sm_90 count 3412 per 1,000 HMMA unclamped against 3419 clamped,
// its 64 x 128 at d = 128 2725 against 2700 (bench/results/tc_kernels_counts.md); the softcap
// build unclamped in every layout (clamped, its 64 x 128 at d = 128 spilled 4 B), the ALiBi
// build on sm_90 (clamped, 8 B there; on sm_80 clamped counts 2947 against 2972); the dropout
// build clamped but in its 128 x 128 tiles on sm_80 (there clamped spilled 4 B; on sm_90
// unclamped 4 B), and so the ALiBi + dropout build
constexpr bool kClampRange = !(kBandOnly && (kDropBuild ? kBigSplit && CUFLASH_ARCH < 900
                                                        : kBigSplit || kCapBuild || (kAlibiBuild && CUFLASH_ARCH >= 900)));
// The K / V tiles' base pointers (batch and kv head) computed per K/V tile rather than once
// before the loop, in the dropout build above d = 64 and on sm_90: held across the loop,
// ptxas spilled them in the prologue (d = 128 in 64 x 128: 4 B on sm_80, 16 B on sm_90; d = 64
// in 128 x 128 on sm_90: 8 B); at d = 64 on sm_80 per tile counts 5681 per 1,000 HMMA against
// 5662 (bench/results/tc_kernels_counts.md); the ALiBi + dropout build likewise
constexpr bool kLateKV = kDropBuild && (kD > 64 || CUFLASH_ARCH >= 900);
// The lane's first key of the dK / dV stores read again from %tid.x after the loop, in the
// ALiBi + dropout build: held across the loop, ptxas spilled it there (4 B at d = 64 in
// 128 x 128 on sm_80; the loop's count is the same either way)
constexpr bool kFreshKey = kAlibiBuild && kDropBuild;
#else
constexpr bool kFreshKey = false;
#endif

// threadIdx.x read again: a volatile read of %tid.x, which the compiler neither merges with
// the kernel's first read nor keeps live across the loop (kFreshKey)
__device__ __forceinline__ unsigned tid_x_again() {
#ifdef CUFLASH_EMULATOR
    return threadIdx.x;
#else
    unsigned x;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
    return x;
#endif
}

// ------------------------------------------------------------------------------------------
// The tiles' copies (tile_copy.cuh: per-thread offsets computed once, compile-time steps;
// rows past `rows` zero-filled), with this kernel's element type and threads.
template <int kRows, int kCols, int kSt>
using TileCopy = TileCopyT<elem_t, kThreads, kRows, kCols, kSt, false, kPadded>;
// Builds with registers to spare -- unrolled copies and products (head dims up to 128, not
// padded; the copies' row steps compile-time) -- keep addresses across the
// tile loop: the Q / dO prefetch each thread's own source pointers (4 registers; the copy then
// adds only its row steps), the dQ reds one lane address per dQ tile with constant offsets and
// no row tests but in the last query tile.  The others, nearer 255 registers (where these
// spill: d = 240 / 256, the features' padded builds), step the tiles' block-uniform first rows
// and rebuild the thread's offsets per tile, and test every dQ row.
constexpr bool kHoistAddrs = kUnrolled && TileCopy<kBr, kD, kKS>::kUnrolled && TileCopy<kBr, kDv, kVS>::kUnrolled;
// dS^T = P^T (dP^T - D) from P^T's float32 registers (undropped), kept live across
// the dP^T products, rather than unpacked from its 16-bit pairs (one HADD2 per pair, and P
// rounded to 16 bits first), where the plan sweep finds they fit: the kHoistAddrs builds but
// d < 64 on sm_90 (d = 32 at 64 x 128 spills 24 B there, NVRTC 13.0)
constexpr bool kFloatP = kHoistAddrs && (kD >= 64 || CUFLASH_ARCH < 900);
// The softcap build's r form (the logit as r of tanh = 1 - 2 r, 4 P, P (1 - tanh^2) folded
// into float32 P^T) where P^T stays in float32 (kFloatP); its other layouts take the masked
// kernel's tanh form, 1 - tanh^2 kept as float16 pairs.  dV's factor in the band builds: 1/4
// where P^T is 4 P^T.
constexpr bool kCapR = kCapBuild && kFloatP;
#ifdef CUFLASH_MASKS
// ALiBi's term -slope |i + off - j| log2(e) added to the exponent rather than to the logit, in
// the ALiBi + softcap build's r form: s stays r for the fold, at the same two instructions per
// element (the distance's FADD, the term's FFMA)
constexpr bool kAlibiExp = kCapR && kAlibiBuild;
static_assert(!kAlibiExp || kUnrolled, "ALiBi's exponent term is taken in the unrolled element loop only");
#endif
#ifdef CUFLASH_MASKS
constexpr float kDvBand = kCapR ? 0.25f : 1.0f;
#endif
// Whether a tile pair needs the mask is one unsigned compare of the query tile's index against
// the K/V tile's range of plain query tiles (computed once per K/V tile) rather than the
// bounds and causal tests per tile, in the kFloatP builds of 4 warps or more (at d = 64, 2
// warps of 32 x 64 spilled 20 B on sm_80: their threads copy twice the chunks) but the query
// split's 128 x 128 tiles on sm_80 (at d = 64 the range's two registers spilled 24 B there, in
// the prologue; on sm_90 none, with the workspace row in 32 bits below)
constexpr bool kPlainRange = kFloatP && kWarps >= 4 && !(kBigSplit && CUFLASH_ARCH < 900);
// The dQ accumulator's rows of a query tile stepped from tile to tile, as the Q / dO sources,
// rather than rebuilt from (head, tile) by 64-bit products: in the kHoistAddrs builds at
// d = 128 (at d = 64 the pointer's two registers cost more than the products: 24 B spilled
// on sm_90, NVRTC 13.0)
constexpr bool kStepDq = kHoistAddrs && kD >= 128;
// A tile's first lse2 / D workspace row in 32-bit arithmetic (the launcher holds B * H * nq_pad
// below 2^31), where the 64-bit products cost ~15 instructions per tile: with kStepDq, and in
// the query split's 128 x 128 tiles (at d = 64 on sm_90 it freed the register whose spill
// kept the plain range out: 4 B; at d = 64 in 32 x 128 tiles the 32-bit form spilled 16 B)
constexpr bool kRow32 = kStepDq || (kHoistAddrs && kBigSplit);

// A tile's Q or dO copy on its own (kDoStages = 1: dO later in the trip than Q): `own` the
// copy whose source pointer the kHoistAddrs builds hold (full tiles then skip the row tests),
// `fresh` one built for this tile (the other builds)
template <class Copy>
__device__ __forceinline__ void issue_alone(const Copy& own, const Copy& fresh, elem_t* dst,
                                            const elem_t* src, const elem_t* base, int rows) {
    if constexpr (kHoistAddrs) {
        if (rows >= kBr) own.template issue_own<true>(dst, src, base, rows);
        else own.template issue_own<false>(dst, src, base, rows);
    } else {
        fresh.template issue<false>(dst, src, rows);
    }
}

// kBr floats (16-byte chunks; the workspace rows are padded to whole tiles)
// (a compile-time trip count, as TileCopy: no remainder loop)
__device__ __forceinline__ void load_floats_async(float* s, const float* g, int tid) {
    constexpr int kChunks = kBr / 4;
#pragma unroll
    for (int k = 0; k < (kChunks + kThreads - 1) / kThreads; ++k) {
        const int idx = tid + k * kThreads;
        if (kChunks % kThreads == 0 || idx < kChunks) cp_async_16(s + 4 * idx, g + 4 * idx);
    }
}

// ldmatrix operands as one per-lane shared-memory address, computed once per block, plus a
// byte offset per fragment (saddr.cuh; constant, or the rolled loops' k step): the lanes'
// rows and columns, in elements from a fragment's first row, for row stride st:
//   lane_a   the A operand (x4) of a row-major tile: rows lane & 15, columns 8 (lane >> 4)
//   lane_b   two n8 B tiles (x4) of a row-major (n x k) tile: rows (lane & 7) + 8 (lane >> 4),
//            columns 8 ((lane >> 3) & 1)
//   lane_bt  two n8 B tiles (x4.trans) of a row-major (k x n) tile: rows (lane & 7) +
//            8 ((lane >> 3) & 1), columns 8 (lane >> 4)
//   lane_at  the A operand (x4.trans) of a row-major (k x m) tile: rows (lane & 7) +
//            8 ((lane >> 4) & 1), columns 8 ((lane >> 3) & 1)
constexpr int kElem = (int)sizeof(elem_t);
__device__ __forceinline__ int lane_a(int lane, int st) { return (lane & 15) * st + (lane >> 4) * 8; }
__device__ __forceinline__ int lane_b(int lane, int st) { return ((lane & 7) + (lane >> 4) * 8) * st + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int lane_bt(int lane, int st) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * st + (lane >> 4) * 8; }
__device__ __forceinline__ int lane_at(int lane, int st) { return ((lane & 7) + ((lane >> 4) & 1) * 8) * st + ((lane >> 3) & 1) * 8; }

// acc[mt] (16 keys x this slice's kC * 16 columns) += A[mt] (16 keys x queries 16kc..16kc+15,
// fragments in registers) * B, B = those 16 rows of the row-major (queries x kCols) tile
// (row stride kSt) whose lane address (lane_bt) is `b`: the "col" operand of the mma is the
// transposed 8x8 blocks, read with ldmatrix.x4.trans (two 8-column tiles per load).
// dV += P^T dO and dK += dS^T Q.
template <int kC, int kSt, int kCols>
__device__ __forceinline__ void mma_rows_times_tile(float (&acc)[kMT][2 * kC][4], const uint32_t (&a)[kMT][4],
                                                    saddr_t b, int kc, int slice) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
        const int col = (slice * kC + c) * 16;
        if (kSlices == 1 || col < kCols) {
            uint32_t bb[4];
            ldsm_x4_trans(bb, b + (kc * 16 * kSt + col) * kElem);
            const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                mma_m16n8k16<elem_t>(acc[mt][2 * c], a[mt], b0, acc[mt][2 * c]);
                mma_m16n8k16<elem_t>(acc[mt][2 * c + 1], a[mt], b1, acc[mt][2 * c + 1]);
            }
        }
    }
}

// A 16 x 16 tile of 16-bit pairs in the mma A layout (a0: rows g, cols 2t..; a1: rows g+8;
// a2: cols +8; a3: both) stored row-major at `row` (= &tile[g][2t], row stride kSS): four
// conflict-free 32-bit stores (bank 4g + t of each quarter).
__device__ __forceinline__ void store_pair_tile(elem_t* row, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    cuflash_store_b32(row, a0);
    cuflash_store_b32(row + 8 * kSS, a1);
    cuflash_store_b32(row + 8, a2);
    cuflash_store_b32(row + 8 * kSS + 8, a3);
}

#endif  // !CUFLASH_BWD_TC_HELPERS

#ifndef CUFLASH_BWD_TC_MAIN
// ------------------------------------------------------------------------------------------
// D = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for padding rows and rows that see no
// key), rows [0, nq_pad) of every (b, h); zeroes the rows < Nq of every dQ accumulator slice.
// grid ceil(nq_pad / pre_rows) * H * B (folded), 128 threads: 8 lanes per row, each lane
// reads 16 bytes of O and dO at a time (coalesced 128-byte rows per 8 lanes).
constexpr int kPreThreads = 128;
// (kPreThreads, 8): 8 blocks (32 warps) per SM bound the registers at 64.  With the thread
// count alone ptxas (NVRTC 13.0, sm_90) chose 40 registers at dv = 192 and spilled 12 B.
extern "C" __global__ void __launch_bounds__(kPreThreads, 8)
flash_bwd_tc_preprocess(const elem_t* __restrict__ O, const elem_t* __restrict__ dO,
                        const float* __restrict__ LSE, float* __restrict__ ws,
                        const BwdParams* __restrict__ P) {
    const BwdParams& p = *P;
    const int tid = threadIdx.x;
    const FoldedIndex fi = cuflash_fold_decode(p.n_pre_tiles, p.H);
    const int h = fi.h, b = fi.b, Nq = p.Nq, nq_pad = p.nq_pad, d = p.head_d, dv = p.head_dv;
    const size_t bh = (size_t)b * p.H + h;
    const elem_t* Ob = O + b * p.o_sb + h * p.o_sh;
    const elem_t* dOb = dO + b * p.do_sb + h * p.do_sh;
    float* lse2 = ws + bh * nq_pad;
    float* D = ws + p.d_offset + bh * nq_pad;
    const int r0 = fi.tile * p.pre_rows;
    const int r_end = min(nq_pad, r0 + p.pre_rows);
    const int sub = tid & 7;
    // every lane runs the same number of row groups (the shuffles need the whole warp)
    for (int rg = r0; rg < r_end; rg += kPreThreads / 8) {
        const int r = rg + (tid >> 3);
        float part = 0.0f;
        if (r < Nq) {
            for (int c = sub * 8; c < dv; c += 64) {
                const uint4 o4 = gload(reinterpret_cast<const uint4*>(Ob + r * p.o_sr + c));
                const uint4 d4 = gload(reinterpret_cast<const uint4*>(dOb + r * p.do_sr + c));
                const uint32_t ow[4] = {o4.x, o4.y, o4.z, o4.w}, dw[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    float a0, a1, b0, b1;
                    unpack2<elem_t>(ow[w], a0, a1);
                    unpack2<elem_t>(dw[w], b0, b1);
                    part += a0 * b0 + a1 * b1;
                }
            }
        }
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        if (sub == 0 && r < r_end) {
            float l2 = INFINITY;  // padding rows, and rows that see no key (lse = -inf): P = 0
            if (r < Nq) {
                const float l = gload(LSE + bh * Nq + r);
                if (l != -INFINITY) l2 = l * CUFLASH_LOG2E;
            }
            gstore(lse2 + r, l2);
            gstore(D + r, r < Nq ? part : 0.0f);
        }
    }
    // zero this block's rows of every dQ accumulator slice (16-byte stores)
    const int z_end = min(Nq, r_end);
    if (z_end > r0) {
        const long long n4 = (long long)(z_end - r0) * d / 4;
        for (int s = 0; s < p.n_splits; ++s) {
            float* acc = ws + p.dq_accum_offset + s * p.dq_slice_stride + (bh * Nq + r0) * d;
            for (long long e = tid; e < n4; e += kPreThreads)
                gstore(reinterpret_cast<float4*>(acc) + e, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
        }
    }
}

#endif  // !CUFLASH_BWD_TC_MAIN

#ifndef CUFLASH_BWD_TC_HELPERS
// ------------------------------------------------------------------------------------------
// dK, dV, and dQ by float32 reds.  grid n_kv_blocks * Hk * B (folded), kThreads threads.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
CUFLASH_BWD_TC_KERNEL(const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                      const elem_t* __restrict__ dO, float* __restrict__ ws, elem_t* __restrict__ dK,
                      elem_t* __restrict__ dV, const BwdParams* __restrict__ P CUFLASH_BWD_TC_MASK_ARGS) {
    CUFLASH_DYNAMIC_SHARED(elem_t, smem);
    elem_t* Ks = smem;                        // (Bc, d+8)        K_j, resident
    elem_t* Vs = Ks + kBc * kKS;              // (Bc, dv+8)       V_j, resident
    elem_t* Qs = Vs + kBc * kVS;              // 2 x (Br, d+8)    Q_i, double buffered
    elem_t* dOs = Qs + 2 * kBr * kKS;         // kDoStages x (Br, dv+8)   dO_i
    elem_t* dSs = dOs + kDoStages * kBr * kVS;  // (Bc, Br+8)     dS^T of the current tile
    elem_t* Ps = dSs + kBc * kSS;             // (Bc, Br+8)       P^T (query split only)
    float* lse_s = reinterpret_cast<float*>(Ps + (kQS == 2 ? kBc * kSS : 0));  // 2 x Br   lse2_i
    float* D_s = lse_s + 2 * kBr;                               // 2 x Br   D_i

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const BwdParams& p = *P;
#ifdef CUFLASH_MASKS
    const int Nq = p.Nq, Nk = p.Nk, group = p.group;  // (causal: part of the band below)
#else
    const int Nq = p.Nq, Nk = p.Nk, group = p.group, causal = p.causal, off = p.causal_offset;
#endif
    const int nq_pad = p.nq_pad;
    // the columns the call has: the row lengths of dK, dV and the dQ accumulator
    const int d_cols = kPadded ? p.head_d : kD, dv_cols = kPadded ? p.head_dv : kDv;
    const float scale_log2 = (float)p.scale * CUFLASH_LOG2E;
    const FoldedIndex fi = cuflash_fold_decode(p.n_kv_blocks, p.Hk);
    const int hk = fi.h, b = fi.b;
    const size_t bhk = (size_t)b * p.Hk + hk;
    float* dq_acc = ws + p.dq_accum_offset + (p.n_splits > 1 ? fi.tile * p.dq_slice_stride : 0);
    const float* lse2 = ws;
    const float* Dws = ws + p.d_offset;
    const elem_t* Kb0 = K + b * p.k_sb + hk * p.k_sh;
    const elem_t* Vb0 = V + b * p.v_sb + hk * p.v_sh;
    const int n_q_tiles = (Nq + kBr - 1) / kBr;
    const int qh = warp % kQS;                // query half (S^T, dP^T) and column slice (dK, dV)
    const int kw0 = (warp / kQS) * kMT * 16;  // this warp's first key in the tile
    const int qw0 = qh * kBrw;                // this warp's first query of the tile
    // the lane's ldmatrix addresses: K_w / V_w rows (A of S^T, dP^T), the warp's Q / dO rows
    // of buffer 0 (B of S^T, dP^T), Q / dO of buffer 0 transposed (B of dK, dV), Ps / dSs rows
    // (A of dV, dK with the query split), dSs and Ks transposed (A, B of dQ)
    // (written as one address plus constant byte offsets where the row strides agree, so that
    // ptxas can keep one register and fold the offsets into the instructions)
    constexpr bool kSameStride = kKS == kVS;
    const saddr_t ld_k = saddr_of(Ks + kw0 * kKS + lane_a(lane, kKS));
    const saddr_t ld_v = kSameStride ? ld_k + (int)(Vs - Ks) * kElem : saddr_of(Vs + kw0 * kVS + lane_a(lane, kVS));
    const saddr_t ld_q = saddr_of(Qs + qw0 * kKS + lane_b(lane, kKS));
    const saddr_t ld_do = kSameStride ? ld_q + (int)(dOs - Qs) * kElem : saddr_of(dOs + qw0 * kVS + lane_b(lane, kVS));
    const saddr_t ld_qt = saddr_of(Qs + lane_bt(lane, kKS));
    const saddr_t ld_dot = kSameStride ? ld_qt + (int)(dOs - Qs) * kElem : saddr_of(dOs + lane_bt(lane, kVS));
    const saddr_t ld_kt = ld_qt - (int)(Qs - Ks) * kElem;
    const saddr_t ld_ds = saddr_of(dSs + kw0 * kSS + lane_a(lane, kSS));
    const saddr_t ld_ps = ld_ds + (int)(Ps - dSs) * kElem;
    const saddr_t ld_dst = saddr_of(dSs + lane_at(lane, kSS));
#ifdef CUFLASH_BWD_BAND
    // the band's offsets as the launcher computes them, read from the parameter block where
    // they are used: no registers held across the loop (two held spilled, or cost ptxas ~25
    // instructions of rematerialised addresses per trip at d = 64 on sm_90)
#define CUFLASH_BAND_LO p.mask_band_lo
#define CUFLASH_BAND_HI p.mask_band_hi
#elif defined(CUFLASH_MASKS)
    const BwdBand band(p);
#define CUFLASH_BAND_LO band.lo_off
#define CUFLASH_BAND_HI band.hi_off
#endif

    for (int jt = fi.tile; jt < p.n_kv_tiles; jt += p.n_kv_blocks) {
        const int kv0 = jt * kBc;
        const int kv_rows = min(kBc, Nk - kv0);
        // causal: Q tiles before the one holding row kv0 - off see no key of this tile
        int it0 = 0, it1 = n_q_tiles;
#ifdef CUFLASH_MASKS
        {   // the band: rows kv0 - hi_off + 1 .. kv0 + kv_rows - 1 - lo_off see keys of the tile
            const long long i_min = (long long)kv0 - CUFLASH_BAND_HI + 1;
            const long long i_max = (long long)kv0 + kv_rows - 1 - CUFLASH_BAND_LO;
            it0 = i_min <= 0 ? 0 : (i_min >= Nq ? n_q_tiles : (int)(i_min / kBr));
            it1 = i_max < 0 ? 0 : (i_max >= Nq ? n_q_tiles : (int)(i_max / kBr) + 1);
            if (kClampRange && it1 < it0) it1 = it0;
        }
#else
        if (causal) {
            const long long i_min = (long long)kv0 - off;
            it0 = i_min <= 0 ? 0 : (i_min >= Nq ? n_q_tiles : (int)(i_min / kBr));
        }
#endif
#ifdef CUFLASH_MASKS
        const int n_i = kClampRange ? it1 - it0 : max(0, it1 - it0);
#else
        const int n_i = it1 - it0;
#endif
        const int T = group * n_i;            // (head, Q tile) pairs this block visits
        // the query tiles i_plain .. i_plain + n_plain - 1 need no mask with this K/V tile: all
        // their rows see all its keys and they end at or before Nq (i < Nq / kBr); none where
        // the tile holds keys past Nk
        int i_plain = 0, n_plain = 0;
        if (kPlainRange && kv_rows == kBc) {
#ifdef CUFLASH_MASKS
            // the band: kv0 + kBc - 1 - i kBr < hi_off and kv0 - (i kBr + kBr - 1) >= lo_off
            const long long x = (long long)kv0 + kBc - CUFLASH_BAND_HI;    // i kBr >= x
            const long long y = (long long)kv0 - kBr + 1 - CUFLASH_BAND_LO;  // i kBr <= y
            i_plain = x <= 0 ? 0 : (int)min((x + kBr - 1) / kBr, (long long)n_q_tiles);
            const int i_end = y < 0 ? 0 : (int)min(y / kBr + 1, (long long)(Nq / kBr));
            n_plain = max(0, i_end - i_plain);
#else
            if (causal) {  // i kBr + off >= kv0 + kBc - 1
                const long long x = (long long)kv0 + kBc - 1 - off;  // i kBr >= x
                i_plain = x <= 0 ? 0 : (int)min((x + kBr - 1) / kBr, (long long)n_q_tiles);
            }
            n_plain = max(0, Nq / kBr - i_plain);
#endif
        }
        elem_t* dKt = dK + (bhk * Nk + kv0) * d_cols;
        elem_t* dVt = dV + (bhk * Nk + kv0) * dv_cols;
        if (T == 0) {  // no query sees these keys: dK = dV = 0, nothing loaded
            for (int e = tid; e < kv_rows * d_cols; e += kThreads) gstore(dKt + e, elem_t(0.0f));
            for (int e = tid; e < kv_rows * dv_cols; e += kThreads) gstore(dVt + e, elem_t(0.0f));
            continue;
        }

        for (int pass = 0; pass < kPasses; ++pass) {
            // -- prologue: (K_j, V_j on the first pass) and the first (Q, dO, lse2, D) tile
            // tile tt of the block's (head, Q tile) pairs is head hk * group + gg, Q tile i:
            // the loop below steps (gg, i) instead of dividing tt by n_i.  Every tile (Q, dO
            // here, K, V below) takes the row-tested copy alone (issue<false>: a predicate and
            // a select per chunk) rather than a full-tile copy beside it: one copy of the code,
            // and ptxas then kept flash_bwd_tc_masked's d = 256 plans for sm_90 (16 x 32, 16 x
            // 64, both dtypes) free of the 4-8 B spills it had with both paths.  The
            // kHoistAddrs builds, with registers to spare, copy full Q / dO tiles without the
            // tests
            // The sources of tile (gg, i)'s Q and dO, stepped from one tile to the next (kBr rows,
            // or on to the next head's tile it0) rather than rebuilt from (gg, i) by 64-bit
            // products: with kHoistAddrs this thread's own first chunks, else the tile's first
            // rows (block-uniform: no thread registers)
            const TileCopy<kBr, kD, kKS> q_copy(tid, p.q_sr, d_cols);
            const TileCopy<kBr, kDv, kVS> do_copy(tid, p.do_sr, dv_cols);
            const long long q_step = kBr * p.q_sr, do_step = kBr * p.do_sr;
            const long long q_wrap = p.q_sh - (n_i - 1) * q_step, do_wrap = p.do_sh - (n_i - 1) * do_step;
            const elem_t* q_src = Q + b * p.q_sb + (long long)(hk * group) * p.q_sh + it0 * q_step
                                  + (kHoistAddrs ? q_copy.goff : 0);
            const elem_t* do_src = dO + b * p.do_sb + (long long)(hk * group) * p.do_sh + it0 * do_step
                                   + (kHoistAddrs ? do_copy.goff : 0);
            // the dQ accumulator rows of tile (gg, i), stepped likewise (kStepDq)
            float* dq_src = dq_acc + (((size_t)b * p.H + hk * group) * Nq + it0 * kBr) * d_cols;
            const long long dq_wrap = ((long long)Nq - (long long)(n_i - 1) * kBr) * d_cols;
            auto issue_tile = [&](int h, int q0, int buf, bool with_do) {
                const int rows = min(kBr, Nq - q0);
                if (!with_do) {
                    issue_alone(q_copy, TileCopy<kBr, kD, kKS>(tid, p.q_sr, d_cols), Qs + buf * kBr * kKS, q_src, Q, rows);
                } else if constexpr (kHoistAddrs) {
                    // full tiles without the row tests (a predicate and a select per chunk); one
                    // branch around both copies (TileCopyT::issue's choice per copy, two branches,
                    // counted 4006 / 4069 / 2978 / 2700 against 3825 / 3875 / 2972 / 2694 per
                    // 1,000 HMMA: d = 64 sm_80, d = 64 sm_90, d = 128 sm_80, d = 128 sm_90)
                    if (rows >= kBr) {
                        q_copy.template issue_own<true>(Qs + buf * kBr * kKS, q_src, Q, rows);
                        do_copy.template issue_own<true>(dOs + buf * kBr * kVS, do_src, dO, rows);
                    } else {
                        q_copy.template issue_own<false>(Qs + buf * kBr * kKS, q_src, Q, rows);
                        do_copy.template issue_own<false>(dOs + buf * kBr * kVS, do_src, dO, rows);
                    }
                } else {
                    TileCopy<kBr, kD, kKS>(tid, p.q_sr, d_cols).template issue<false>(Qs + buf * kBr * kKS, q_src, rows);
                    TileCopy<kBr, kDv, kVS>(tid, p.do_sr, dv_cols).template issue<false>(dOs + buf * kBr * kVS, do_src, rows);
                }
                // the tile's first workspace row (kRow32: in 32-bit arithmetic)
                const size_t row0 = kRow32 ? (size_t)(((unsigned)b * (unsigned)p.H + (unsigned)h) * (unsigned)nq_pad + (unsigned)q0)
                                            : ((size_t)b * p.H + h) * nq_pad + q0;
                load_floats_async(lse_s + buf * kBr, lse2 + row0, tid);
                load_floats_async(D_s + buf * kBr, Dws + row0, tid);
            };
            if (pass == 0) {
#ifdef CUFLASH_MASKS
                const elem_t* Kb = kLateKV ? K + b * p.k_sb + hk * p.k_sh : Kb0;
                const elem_t* Vb = kLateKV ? V + b * p.v_sb + hk * p.v_sh : Vb0;
#else
                const elem_t* Kb = Kb0;
                const elem_t* Vb = Vb0;
#endif
                TileCopy<kBc, kD, kKS>(tid, p.k_sr, d_cols).template issue<false>(Ks, Kb + kv0 * p.k_sr, kv_rows);
                TileCopy<kBc, kDv, kVS>(tid, p.v_sr, dv_cols).template issue<false>(Vs, Vb + kv0 * p.v_sr, kv_rows);
            }
            issue_tile(hk * group, it0 * kBr, 0, true);
            cp_async_commit();

            float dk[kMT][2 * kKC][4], dv[kMT][2 * kVC][4];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
                for (int n = 0; n < 2 * kKC; ++n) dk[mt][n][0] = dk[mt][n][1] = dk[mt][n][2] = dk[mt][n][3] = 0.0f;
#pragma unroll
                for (int n = 0; n < 2 * kVC; ++n) dv[mt][n][0] = dv[mt][n][1] = dv[mt][n][2] = dv[mt][n][3] = 0.0f;
            }

            for (int tt = 0, gg = 0, i = it0; tt < T; ++tt) {
                const int buf = tt & 1;
                const int h = hk * group + gg;
                const int q0 = i * kBr;
                cp_async_wait<0>();  // this thread's copies of tile tt (and K_j, V_j)
                // (A) Tile tt (copies and zero fills of every thread) is visible to all warps,
                // and every warp has finished iteration tt - 1: its reads of the other buffer,
                // of Ps / dSs and of Ks are done, so the prefetch below may overwrite that
                // buffer and this iteration may rewrite Ps / dSs.
                __syncthreads();
                // -- the next tile goes into the other buffer while this one computes
                // (gg, i) of tile tt + 1
                const bool next_head = i + 1 == it1;
                const int gg1 = next_head ? gg + 1 : gg, i1 = next_head ? it0 : i + 1;
                if (tt + 1 < T) {
                    q_src += next_head ? q_wrap : q_step;
                    if (kDoStages == 2) do_src += next_head ? do_wrap : do_step;
                    issue_tile(hk * group + gg1, i1 * kBr, buf ^ 1, kDoStages == 2);
                    cp_async_commit();
                }
                const int qbuf = buf * kBr * kKS * kElem;  // bytes
                const int dobuf = kDoStages == 2 ? buf * kBr * kVS * kElem : 0;
                const float* lse_t = lse_s + buf * kBr;
                const float* D_t = D_s + buf * kBr;
#ifdef CUFLASH_MASKS
                // the band test where the tile pair crosses it, or holds keys past Nk or rows
                // past Nq (whose bias must not be read)
                const int rows_q = min(kBr, Nq - q0);
                const bool tile_edge = kv_rows < kBc || rows_q < kBr;  // rows / keys past the ends
                // (kPlainRange: from the K/V tile's plain range of query tiles, one compare)
                const bool need_mask = kPlainRange ? (unsigned)(i - i_plain) >= (unsigned)n_plain
                                                   : kv_rows < kBc || rows_q < kBr ||
                                                         kv0 - (q0 + rows_q - 1) < CUFLASH_BAND_LO ||
                                                         kv0 + kBc - 1 - q0 >= CUFLASH_BAND_HI;
                const int qa = q0 + qw0 + 2 * t;      // this lane's queries: qa + 8 n + eq
                const int ka = kv0 + kw0 + g;         // and keys: ka + 16 mt + 8 hh
                // The call's features, read from the parameter block on every tile (cached
                // loads) rather than held in registers across the loop; every branch on them
                // below is taken per tile, each feature's work a loop of its own over the
                // tile's elements (fully unrolled, no per-element test of what the call has).
#ifdef CUFLASH_BWD_BAND
                const bool has_cap = kCapBuild, has_bias = false, has_alibi = kAlibiBuild;
                const int db_mode = 0;
#else
                const bool has_cap = p.mask_softcap > 0, has_bias = p.mask_has_bias != 0;
                const bool has_alibi = p.mask_has_alibi != 0;
                const int db_mode = p.mask_dbias;     // dbias: 0 none, 1 stored, 2 added atomically
#endif
                // The exponent is 2^(s c_exp - lse2) with the logit s = softcap(scale S) + bias +
                // ALiBi held in units of u: the softcap's c (s = tanh(scale S / c) + (bias +
                // ALiBi) / c) or else the scale (s = S + (bias + ALiBi) / scale), c_exp = u log2(e).
                // The plain exponent's one FFMA per element then takes the unit, and the terms
                // add scaled by 1 / u (an FFMA where an FADD would be): no multiply of every
                // element by c or by the scale.
                const float c_exp = has_cap ? (float)p.mask_softcap * CUFLASH_LOG2E : scale_log2;
                // (1 / u by MUFU.RCP, within an ulp: the terms' relative error stays near float32's)
                const float inv_u = __fdividef(1.0f, has_cap ? (float)p.mask_softcap : (float)p.scale);
                // softcap: tanh(scale S / c) = 1 - 2 / (1 + 2^(S cap_k)), cap_k = 2 log2(e) scale / c
                const float cap_k = 2.0f * scale_log2 * inv_u;
#ifdef CUFLASH_BWD_BAND
                // off, or on at compile time in the dropout build
                const DropoutKey drop = kDropBuild ? cuflash_dropout_key_on(p) : DropoutKey{};
#else
                const DropoutKey drop = cuflash_dropout_key(p);
#endif
                // softcap's derivative 1 - tanh^2: where s is tanh itself (no bias or ALiBi
                // added to it; ALiBi may be in the exponent, kAlibiExp) and P^T stays in float32
                // for dS (kFloatP), folded into that float P^T as the exponential is taken (one
                // FFMA and one FMUL per element; dS^T = P^T (1 - tanh^2) (dP^T - D) then needs
                // nothing more); else kept in dsc as float16 pairs (a pack, an unpack and a
                // multiply per element)
                const bool cap_fold = kFloatP && has_cap && !has_bias && (!has_alibi || kAlibiExp);
#ifdef CUFLASH_BWD_SOFTCAP
                // (kCapR: x = c log2(e) (1 - 2 r) - lse2 + 2 = r cap_m2 + (cap_l2 - lse2))
                const float cap_m2 = -2.0f * c_exp, cap_l2 = c_exp + 2.0f;
#endif
                uint32_t dsc[kMT][kNQ][2];
                // dropout keep bits: element (mt, n, e = 2 hh + eq) at bit bwd_drop_bit(q, n & 1,
                // hh, eq) of fragment pair q = mt kNQ / 2 + n / 2 (bwd_masks.cuh): at most 64
                // (cuflash.tiling keeps kMT * kNQ <= 16 for the masked kernel)
                static_assert(kMT * kNQ <= 16, "the masked backward keeps 64 dropout bits");
                unsigned long long keep = ~0ull;
                // dropout, before S^T (the bits depend on the indices only, and few registers
                // are live here): one Philox block per lane for the eight logits of fragments
                // (mt, n), (mt, n + 1) (n even), the lanes g, g ^ 1 swapping halves
                // (bwd_masks.cuh); kUnrollDraw blocks per step
#ifdef CUFLASH_BWD_DROPOUT
                const unsigned long long rkeys[10] = {rk0, rk1, rk2, rk3, rk4, rk5, rk6, rk7, rk8, rk9};
                const unsigned long long (*rk)[10] = &rkeys;
#else
                const unsigned long long (*rk)[10] = nullptr;  // (drop's key, added per round)
#endif
                if (drop.on) {
                    keep = 0;
#pragma unroll kUnrollDraw
                    for (int mn = 0; mn < kMT * kNQ / 2; ++mn) {
                            const int mt = mn / (kNQ / 2), n = 2 * (mn % (kNQ / 2));
                            keep |= bwd_kept_bits<kMT * kNQ / 2>(drop, rk, b + p.mask_drop_b0, h, q0 + qw0 + n * 8,
                                                                 kv0 + kw0 + mt * 16, g, t, mn);
                    }
                }
#else
                // the mask is needed only where the tile crosses the causal boundary, holds
                // keys past Nk (zero-filled rows of K_j would give s = 0, not -inf) or rows past
                // Nq: their lse2 = +inf makes P = 0 unless s is NaN (0 * an infinite key), so
                // the masked path zeroes P wherever lse2 = +inf (there P is 0 by definition),
                // a test of a value the element has in a register already
                // (kPlainRange: from the K/V tile's plain range of query tiles, one compare)
                const bool need_mask = kPlainRange ? (unsigned)(i - i_plain) >= (unsigned)n_plain
                                                   : kv_rows < kBc || q0 + kBr > Nq || (causal && kv0 + kBc - 1 > q0 + off);
#endif
                const int slice = pass * kQS + qh;  // this warp's dK / dV column slice

                // -- S^T = K_w Q_i^T
                float s[kMT][kNQ][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int n = 0; n < kNQ; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll kUnrollS
                for (int kk = 0; kk < kD; kk += 16) {
                    uint32_t a[kMT][4];
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
                        ldsm_x4(a[mt], ld_k + (mt * 16 * kKS + kk) * kElem);
#pragma unroll
                    for (int n = 0; n < kNQ; n += 2) {
                        uint32_t bb[4];
                        ldsm_x4(bb, ld_q + qbuf + (n * 8 * kKS + kk) * kElem);
                        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt) {
                            mma_m16n8k16<elem_t>(s[mt][n], a[mt], b0, s[mt][n]);
                            mma_m16n8k16<elem_t>(s[mt][n + 1], a[mt], b1, s[mt][n + 1]);
                        }
                    }
                }
                // -- P^T = exp2(S^T * scale * log2(e) - lse2), masked where needed, kept in
                // the input dtype: pp[mt][n] = (keys g | g+8) x (queries 2t, 2t+1) as two
                // 16-bit pairs -- the A operand of dV += P^T dO as it stands, and half the
                // registers of float P while dP^T is computed (P is rounded there anyway)
                uint32_t pp[kMT][kNQ][2];
#ifdef CUFLASH_MASKS
                // the logit terms, in the forward's order: softcap, bias, ALiBi
                if (kCapR) {  // s = r of tanh = 1 - 2 r
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int n = 0; n < kNQ; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) s[mt][n][e] = cuflash_tanh_rcp(s[mt][n][e] * cap_k);
                } else if (has_cap) {
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int n = 0; n < kNQ; ++n) {
                            float th[4];
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                th[e] = cuflash_tanh_exp2(s[mt][n][e] * cap_k);
                                s[mt][n][e] = th[e];
                            }
                            if (!cap_fold) {
                                dsc[mt][n][0] = cvt_pack2<__half>(1.0f - th[0] * th[0], 1.0f - th[1] * th[1]);
                                dsc[mt][n][1] = cvt_pack2<__half>(1.0f - th[2] * th[2], 1.0f - th[3] * th[3]);
                            }
                        }
                }
                if (has_bias) {
                    const float* bias_h = Bias + b * p.mask_bias_sb + h * p.mask_bias_sh;
                    const long long sr = p.mask_bias_sr;
                    if (p.mask_bias_sc == 1 && !tile_edge) {
                        // keys contiguous, tile inside [0, Nq) x [0, Nk): a row pointer per
                        // query by 64-bit adds, every key at a constant offset from it -- per
                        // element the load (immediate offset) and the add
                        const float* row = bias_h + qa * sr + ka;
#pragma unroll
                        for (int n = 0; n < kNQ; ++n) {
                            const float* row1 = row + sr;
#pragma unroll
                            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                                for (int hh = 0; hh < 2; ++hh) {
                                    s[mt][n][2 * hh] = fmaf(gload(row + mt * 16 + 8 * hh), inv_u, s[mt][n][2 * hh]);
                                    s[mt][n][2 * hh + 1] = fmaf(gload(row1 + mt * 16 + 8 * hh), inv_u, s[mt][n][2 * hh + 1]);
                                }
                            row += 8 * sr;
                        }
                    } else {
                        // any strides: a row pointer per query, 64-bit key offsets per
                        // element (no arrays held: registers).  Rows past Nq and keys past Nk
                        // read row Nq - 1 / key Nk - 1 (in bounds); the band test drops them.
#pragma unroll
                        for (int n = 0; n < kNQ; ++n)
#pragma unroll
                            for (int eq = 0; eq < 2; ++eq) {
                                const float* row = bias_h + (long long)min(qa + n * 8 + eq, Nq - 1) * sr;
#pragma unroll
                                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                                    for (int hh = 0; hh < 2; ++hh)
                                        s[mt][n][2 * hh + eq] = fmaf(
                                            gload(row + (long long)min(ka + mt * 16 + 8 * hh, Nk - 1) * p.mask_bias_sc),
                                            inv_u, s[mt][n][2 * hh + eq]);
                            }
                    }
                }
                // ALiBi's -slope |i + off - j| / u (log2(e) instead of 1 / u in the exponent:
                // kAlibiExp): the distance in float, a per-lane base plus each element's
                // constant (exact while |i + off - j| < 2^24)
                float alibi_ns = 0.0f, alibi_base = 0.0f;
                if (has_alibi) {
                    alibi_ns = -gload(Slopes + b * p.mask_alibi_sb + h * p.mask_alibi_sh) * (kAlibiExp ? CUFLASH_LOG2E : inv_u);
                    alibi_base = (float)(qa + p.mask_offset - ka);
                }
                if (has_alibi && !kAlibiExp) {
                    const float ns = alibi_ns, base = alibi_base;
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int n = 0; n < kNQ; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                s[mt][n][e] += ns * fabsf(base + (float)(n * 8 + (e & 1) - mt * 16 - 8 * (e >> 1)));
                }
#endif
                // kUnrolled: one branch per tile on need_mask around the whole element loop (a
                // test per 8-query tile inside it costs four branch and convergence instructions
                // each), the lambda inlined at each call with a constant argument.  The other
                // builds keep the loop below as it is: the lambda there, even called once with
                // need_mask, moved ptxas's allocation at d = 256 into a spill.
                if constexpr (kUnrolled) {
                    auto exp_tile = [&](bool masked, bool fold) {
#ifdef CUFLASH_BWD_BAND
                        // the band test as one unsigned compare of the key - query distance
                        // (dd0 + key column - query column) against the band's width, keys past
                        // Nk by one compare, rows past Nq by their lse2 (+inf, as in the plain
                        // kernel); computed on the masked tiles only
                        const int k_left = masked ? Nk - ka : 0, dd0 = masked ? ka - qa - CUFLASH_BAND_LO : 0;
                        const unsigned band_w = masked ? (unsigned)(CUFLASH_BAND_HI - CUFLASH_BAND_LO) : 0u;
#endif
#pragma unroll
                        for (int n = 0; n < kNQ; ++n) {
                            const float2 l2 = *reinterpret_cast<const float2*>(lse_t + qw0 + n * 8 + 2 * t);
#ifdef CUFLASH_BWD_SOFTCAP
                            const float lc0 = cap_l2 - l2.x, lc1 = cap_l2 - l2.y;
#endif
#pragma unroll
                            for (int mt = 0; mt < kMT; ++mt) {
                                float th[4];              // (fold: s is tanh, or r in the softcap build)
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    const float l = (e & 1) ? l2.y : l2.x;
                                    th[e] = s[mt][n][e];
#ifdef CUFLASH_MASKS
#ifdef CUFLASH_BWD_SOFTCAP
                                    float x = kCapR ? fmaf(s[mt][n][e], cap_m2, (e & 1) ? lc1 : lc0)  // 4 P
                                                    : s[mt][n][e] * c_exp - l;
                                    if (kAlibiExp)
                                        x = fmaf(alibi_ns, fabsf(alibi_base + (float)(n * 8 + (e & 1) - mt * 16 - 8 * (e >> 1))), x);
#else
                                    float x = s[mt][n][e] * c_exp - l;
#endif
#ifdef CUFLASH_BWD_BAND
                                    const int kc = mt * 16 + 8 * (e >> 1), qc = n * 8 + (e & 1);
                                    if (masked && (kc >= k_left || l == INFINITY || (unsigned)(dd0 + kc - qc) >= band_w))
                                        x = -INFINITY;
#else
                                    const int key = ka + mt * 16 + 8 * (e >> 1);
                                    const int qry = qa + n * 8 + (e & 1);
                                    const int dd = key - qry;
                                    if (masked && (key >= Nk || qry >= Nq || dd < CUFLASH_BAND_LO || dd >= CUFLASH_BAND_HI))
                                        x = -INFINITY;
#endif
#else
                                    float x = s[mt][n][e] * scale_log2 - l;
                                    const int key = kv0 + kw0 + mt * 16 + g + 8 * (e >> 1);
                                    const int qry = q0 + qw0 + n * 8 + 2 * t + (e & 1);
                                    if (masked && (key >= Nk || (causal && key > qry + off) || l == INFINITY))
                                        x = -INFINITY;
#endif
                                    s[mt][n][e] = cuflash_exp2(x);
                                }
                                pp[mt][n][0] = cvt_pack2<elem_t>(s[mt][n][0], s[mt][n][1]);
                                pp[mt][n][1] = cvt_pack2<elem_t>(s[mt][n][2], s[mt][n][3]);
                                if (fold) {
#pragma unroll
                                    for (int e = 0; e < 4; ++e)  // P (1 - tanh^2), or 4 P (r - r^2)
                                        s[mt][n][e] *= fmaf(-th[e], th[e], kCapR ? th[e] : 1.0f);
                                }
                            }
                        }
                    };
#ifdef CUFLASH_MASKS
                    if (cap_fold) {
                        if (need_mask) exp_tile(true, true);
                        else exp_tile(false, true);
                    } else
#endif
                    if (need_mask) exp_tile(true, false);
                    else exp_tile(false, false);
                } else
                {
#pragma unroll
                    for (int n = 0; n < kNQ; ++n) {
                        const float2 l2 = *reinterpret_cast<const float2*>(lse_t + qw0 + n * 8 + 2 * t);
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt) {
#ifdef CUFLASH_MASKS
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                float x = s[mt][n][e] * c_exp - ((e & 1) ? l2.y : l2.x);
                                if (need_mask) {  // the band, keys past Nk, rows past Nq
                                    const int key = ka + mt * 16 + 8 * (e >> 1);
                                    const int qry = qa + n * 8 + (e & 1);
                                    const int dd = key - qry;
                                    if (key >= Nk || qry >= Nq || dd < CUFLASH_BAND_LO || dd >= CUFLASH_BAND_HI) x = -INFINITY;
                                }
                                s[mt][n][e] = cuflash_exp2(x);
                            }
#else
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float l = (e & 1) ? l2.y : l2.x;
                                float x = s[mt][n][e] * scale_log2 - l;
                                if (need_mask) {
                                    const int key = kv0 + kw0 + mt * 16 + g + 8 * (e >> 1);
                                    const int qry = q0 + qw0 + n * 8 + 2 * t + (e & 1);
                                    if (key >= Nk || (causal && key > qry + off) || l == INFINITY) x = -INFINITY;
                                }
                                s[mt][n][e] = cuflash_exp2(x);
                            }
#endif
                            pp[mt][n][0] = cvt_pack2<elem_t>(s[mt][n][0], s[mt][n][1]);
                            pp[mt][n][1] = cvt_pack2<elem_t>(s[mt][n][2], s[mt][n][3]);
                        }
                    }
                }
#ifdef CUFLASH_MASKS
                // P^T with the dropped elements zeroed (dV's A operand): pair hf of (mt, n); with
                // dropout only (the mask's shift, PRMT and AND per pair are issued on any word,
                // the PRMT being inline assembly: dV's step below is taken in two copies, one per
                // tile branch on drop.on)
                auto kept = [&](int mt, int n, int hf, bool dropped) -> uint32_t {
                    if ((kBandOnly && !kDropBuild) || !dropped) return pp[mt][n][hf];
                    return pp[mt][n][hf] & bwd_pair_mask(keep, mt * (kNQ / 2) + n / 2, n & 1, hf);
                };
#else
                auto kept = [&](int mt, int n, int hf, bool) -> uint32_t { return pp[mt][n][hf]; };
#endif
                // -- dV_w += P^T dO_i (this warp's and pass's columns), A from registers (the
                // plain build's text as one block: a lambda there moves ptxas's allocation into
                // 4-8 B spills at two of its curated plans)
#ifdef CUFLASH_MASKS
                auto pt_step = [&](bool dropped) {  // dV += P^T dO, or P^T to Ps (query split)
#else
                {
                    constexpr bool dropped = false;
#endif
                    if (kQS == 1) {
#pragma unroll
                        for (int kc = 0; kc < kBr / 16; ++kc) {
                            uint32_t a[kMT][4];
#pragma unroll
                            for (int mt = 0; mt < kMT; ++mt) {
                                a[mt][0] = kept(mt, 2 * kc, 0, dropped);
                                a[mt][1] = kept(mt, 2 * kc, 1, dropped);
                                a[mt][2] = kept(mt, 2 * kc + 1, 0, dropped);
                                a[mt][3] = kept(mt, 2 * kc + 1, 1, dropped);
                            }
                            mma_rows_times_tile<kVC, kVS, kDv>(dv, a, ld_dot + dobuf, kc, slice);
                        }
                    } else {
                        // query split: this warp's half of P^T to Ps, for both warps of the pair
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                            for (int kc = 0; kc < kBrw / 16; ++kc)
                                store_pair_tile(Ps + (kw0 + mt * 16 + g) * kSS + qw0 + kc * 16 + 2 * t,
                                                kept(mt, 2 * kc, 0, dropped), kept(mt, 2 * kc, 1, dropped),
                                                kept(mt, 2 * kc + 1, 0, dropped), kept(mt, 2 * kc + 1, 1, dropped));
                    }
#ifdef CUFLASH_MASKS
                };
                // (the rolled builds AND on every call: two copies there move ptxas into 8 B
                // spills at d = 112 on sm_80)
                if (!kUnrolled || drop.on) pt_step(true);
                else pt_step(false);
#else
                }
#endif
                // -- dP^T = V_w dO_i^T
                float dp[kMT][kNQ][4];
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int n = 0; n < kNQ; ++n) dp[mt][n][0] = dp[mt][n][1] = dp[mt][n][2] = dp[mt][n][3] = 0.0f;
#pragma unroll kUnrollDP
                for (int kk = 0; kk < kDv; kk += 16) {
                    uint32_t a[kMT][4];
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
                        ldsm_x4(a[mt], ld_v + (mt * 16 * kVS + kk) * kElem);
#pragma unroll
                    for (int n = 0; n < kNQ; n += 2) {
                        uint32_t bb[4];
                        ldsm_x4(bb, ld_do + dobuf + (n * 8 * kVS + kk) * kElem);
                        const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt) {
                            mma_m16n8k16<elem_t>(dp[mt][n], a[mt], b0, dp[mt][n]);
                            mma_m16n8k16<elem_t>(dp[mt][n + 1], a[mt], b1, dp[mt][n + 1]);
                        }
                    }
                }
                // -- dS^T = P^T * (dP^T - D_i), into dp (P^T is dead afterwards)
#pragma unroll
                for (int n = 0; n < kNQ; ++n) {
                    const float2 dd = *reinterpret_cast<const float2*>(D_t + qw0 + n * 8 + 2 * t);
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) {
                            float p0, p1;
                            if constexpr (kFloatP) {  // P^T still in float32
                                p0 = s[mt][n][2 * hh];
                                p1 = s[mt][n][2 * hh + 1];
                            } else
                                unpack2<elem_t>(pp[mt][n][hh], p0, p1);
#ifdef CUFLASH_MASKS
                            const float dp0 = dp[mt][n][2 * hh], dp1 = dp[mt][n][2 * hh + 1];
                            if (drop.on) {  // dP of the dropped product: keep / (1 - p), in one FFMA
                                const int q = mt * (kNQ / 2) + n / 2;
                                const bool k0 = (keep >> bwd_drop_bit(q, n & 1, hh, 0)) & 1;
                                const bool k1 = (keep >> bwd_drop_bit(q, n & 1, hh, 1)) & 1;
                                dp[mt][n][2 * hh] = p0 * fmaf(drop.scale, k0 ? dp0 : 0.0f, -dd.x);
                                dp[mt][n][2 * hh + 1] = p1 * fmaf(drop.scale, k1 ? dp1 : 0.0f, -dd.y);
                            } else {
                                dp[mt][n][2 * hh] = p0 * (dp0 - dd.x);
                                dp[mt][n][2 * hh + 1] = p1 * (dp1 - dd.y);
                            }
#else
                            dp[mt][n][2 * hh] = p0 * (dp[mt][n][2 * hh] - dd.x);
                            dp[mt][n][2 * hh + 1] = p1 * (dp[mt][n][2 * hh + 1] - dd.y);
#endif
                        }
                }
#ifdef CUFLASH_MASKS
                // -- dbias = dS (pass 0), before softcap's derivative: every element of the
                // tile pair inside [0, Nq) x [0, Nk) -- those outside the band have P = 0, so
                // dS = 0, what the zeroed dbias holds (stored, or added for a broadcast bias)
                if (pass == 0 && db_mode != 0) {
                    float* dbias_h = dBias + b * p.mask_dbias_sb + h * p.mask_dbias_sh;
                    const long long sr = p.mask_dbias_sr;
                    const bool fast = p.mask_dbias_sc == 1 && !tile_edge;
                    // inlined at each call with constant arguments.  fast: keys contiguous and
                    // the tile inside the ends -- a row pointer by 64-bit adds, every key at a
                    // constant offset, no test; else any strides, each element tested and
                    // addressed on its own
                    auto dbias_tile = [&](bool atomic, bool fast) {
                        float* row = dbias_h + qa * sr + (fast ? ka : 0);
#pragma unroll
                        for (int n = 0; n < kNQ; ++n) {
#pragma unroll
                            for (int eq = 0; eq < 2; ++eq) {
                                float* r = row + eq * sr;
                                if (!fast && qa + n * 8 + eq >= Nq) continue;
#pragma unroll
                                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                                    for (int hh = 0; hh < 2; ++hh) {
                                        if (!fast && ka + mt * 16 + 8 * hh >= Nk) continue;
                                        float* dst = fast ? r + mt * 16 + 8 * hh
                                                          : r + (long long)(ka + mt * 16 + 8 * hh) * p.mask_dbias_sc;
                                        if (atomic) gatomic_add(dst, dp[mt][n][2 * hh + eq]);
                                        else gstore(dst, dp[mt][n][2 * hh + eq]);
                                    }
                            }
                            row += 8 * sr;
                        }
                    };
                    if (fast) {
                        if (db_mode == 1) dbias_tile(false, true);
                        else dbias_tile(true, true);
                    } else {
                        if (db_mode == 1) dbias_tile(false, false);
                        else dbias_tile(true, false);
                    }
                }
                if (has_cap && !cap_fold) {  // d softcap(x) / dx = 1 - tanh^2
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                        for (int n = 0; n < kNQ; ++n)
#pragma unroll
                            for (int hh = 0; hh < 2; ++hh) {
                                float f0, f1;
                                unpack2<__half>(dsc[mt][n][hh], f0, f1);
                                dp[mt][n][2 * hh] *= f0;
                                dp[mt][n][2 * hh + 1] *= f1;
                            }
                }
#endif
                // -- dS^T to dSs (for dQ; with the query split also for dK); without the split
                // dK_w += dS^T Q_i right here, A from registers
#pragma unroll
                for (int kc = 0; kc < kBrw / 16; ++kc) {
                    uint32_t a[kMT][4];
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) {
                        a[mt][0] = cvt_pack2<elem_t>(dp[mt][2 * kc][0], dp[mt][2 * kc][1]);
                        a[mt][1] = cvt_pack2<elem_t>(dp[mt][2 * kc][2], dp[mt][2 * kc][3]);
                        a[mt][2] = cvt_pack2<elem_t>(dp[mt][2 * kc + 1][0], dp[mt][2 * kc + 1][1]);
                        a[mt][3] = cvt_pack2<elem_t>(dp[mt][2 * kc + 1][2], dp[mt][2 * kc + 1][3]);
                        if (pass == 0 || kQS == 2)
                            store_pair_tile(dSs + (kw0 + mt * 16 + g) * kSS + qw0 + kc * 16 + 2 * t,
                                            a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
                    }
                    if (kQS == 1) mma_rows_times_tile<kKC, kKS, kD>(dk, a, ld_qt + qbuf, kc, slice);
                }
                // (B) dS^T (and with the query split P^T) of every warp is in shared memory
                // before the phase below reads it.
                __syncthreads();

                if (kQS == 2) {
                    // -- dV_w += P^T dO_i, dK_w += dS^T Q_i over all queries, A from Ps / dSs:
                    // one 16-query step of each
                    auto dv_step = [&](int kc) {
                        uint32_t a[kMT][4];
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt)
                            ldsm_x4(a[mt], ld_ps + (mt * 16 * kSS + kc * 16) * kElem);
                        mma_rows_times_tile<kVC, kVS, kDv>(dv, a, ld_dot + dobuf, kc, slice);
                    };
                    auto dk_step = [&](int kc) {
                        uint32_t a[kMT][4];
#pragma unroll
                        for (int mt = 0; mt < kMT; ++mt)
                            ldsm_x4(a[mt], ld_ds + (mt * 16 * kSS + kc * 16) * kElem);
                        mma_rows_times_tile<kKC, kKS, kD>(dk, a, ld_qt + qbuf, kc, slice);
                    };
                    if (kDoStages == 1) {
                        // dV first; then (C) every warp is done with dO_i, and the next tile's
                        // goes into its buffer while dK and dQ compute
#pragma unroll
                        for (int kc = 0; kc < kBr / 16; ++kc) dv_step(kc);
                        __syncthreads();
                        if (tt + 1 < T) {
                            do_src += next_head ? do_wrap : do_step;
                            issue_alone(do_copy, TileCopy<kBr, kDv, kVS>(tid, p.do_sr, dv_cols), dOs, do_src, dO,
                                        min(kBr, Nq - i1 * kBr));
                            cp_async_commit();
                        }
#pragma unroll
                        for (int kc = 0; kc < kBr / 16; ++kc) dk_step(kc);
                    } else {
#pragma unroll
                        for (int kc = 0; kc < kBr / 16; ++kc) {
                            dv_step(kc);
                            dk_step(kc);
                        }
                    }
                }

                // -- dQ_i += dS K_j (pass 0): kDqM x kDqN tiles, float32 reds
                if (pass == 0) {
                    float* dq_rows = kStepDq ? dq_src : dq_acc + (((size_t)b * p.H + h) * Nq + q0) * d_cols;
                    for (int tq = warp; tq < kDqTiles; tq += kWarps) {
                        const int rq = (tq / (kD / kDqN)) * kDqM;
                        const int cq = (tq - (tq / (kD / kDqN)) * (kD / kDqN)) * kDqN;
                        float acc[kDqM / 16][kDqN / 8][4];
#pragma unroll
                        for (int m = 0; m < kDqM / 16; ++m)
#pragma unroll
                            for (int n = 0; n < kDqN / 8; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
#pragma unroll kUnrollDQ
                        for (int kc = 0; kc < kBc / 16; ++kc) {
                            uint32_t a[kDqM / 16][4];
#pragma unroll
                            for (int m = 0; m < kDqM / 16; ++m)
                                ldsm_x4_trans(a[m], ld_dst + (kc * 16 * kSS + rq + m * 16) * kElem);
#pragma unroll
                            for (int n = 0; n < kDqN / 8; n += 2) {
                                uint32_t bb[4];
                                ldsm_x4_trans(bb, ld_kt + (kc * 16 * kKS + cq + n * 8) * kElem);
                                const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
#pragma unroll
                                for (int m = 0; m < kDqM / 16; ++m) {
                                    mma_m16n8k16<elem_t>(acc[m][n], a[m], b0, acc[m][n]);
                                    mma_m16n8k16<elem_t>(acc[m][n + 1], a[m], b1, acc[m][n + 1]);
                                }
                            }
                        }
                        if constexpr (kHoistAddrs) {
                            // this lane's first pair of the tile (row rq + g, column cq + 2t): one
                            // address, the other rows and columns at constant offsets from it; the
                            // row test only in the last query tile, where rows may pass Nq
                            float* const dq_lane = dq_rows + (size_t)(rq + g) * kD + cq + 2 * t;
                            const auto reds = [&](bool tail) {
#pragma unroll
                                for (int m = 0; m < kDqM / 16; ++m)
#pragma unroll
                                    for (int hh = 0; hh < 2; ++hh)
                                        if (!tail || q0 + rq + m * 16 + g + 8 * hh < Nq) {
#pragma unroll
                                            for (int n = 0; n < kDqN / 8; ++n)
                                                gred_add_v2(dq_lane + (m * 16 + 8 * hh) * kD + n * 8,
                                                            acc[m][n][2 * hh], acc[m][n][2 * hh + 1]);
                                        }
                            };
                            if (q0 + kBr <= Nq) reds(false);
                            else reds(true);
                        } else {
#pragma unroll
                            for (int m = 0; m < kDqM / 16; ++m)
#pragma unroll
                                for (int hh = 0; hh < 2; ++hh) {
                                    const int r = rq + m * 16 + g + 8 * hh;
                                    if (q0 + r < Nq) {
#pragma unroll
                                        for (int n = 0; n < kDqN / 8; ++n)
                                            if (!kPadded || cq + n * 8 < d_cols)
                                                gred_add_v2(dq_rows + r * d_cols + cq + n * 8 + 2 * t,
                                                            acc[m][n][2 * hh], acc[m][n][2 * hh + 1]);
                                    }
                                }
                        }
                    }
                }
                if constexpr (kStepDq) dq_src += next_head ? dq_wrap : (long long)kBr * kD;
                gg = gg1;
                i = i1;
            }

            // -- dK_j (scaled) and dV_j, this warp's and pass's columns; keys >= Nk not written.
            //    Straight from the mma layout: a warp's 4-byte stores cover 8 rows x 16 bytes,
            //    8 sectors where 4 would do (bench/results/emulator_profile.md); once per KV tile
            //    and pass, against the whole tile loop's reads, so not staged through shared memory
            {
                const int slice = pass * kQS + qh;
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        int key0 = kw0 + g;
                        if constexpr (kFreshKey) {
                            const unsigned tid = tid_x_again();
                            key0 = (int)((tid >> 5) / kQS) * kMT * 16 + (int)((tid & 31) >> 2);
                        }
                        const int key = key0 + mt * 16 + 8 * hh;
                        if (key < kv_rows) {
#pragma unroll
                            for (int n = 0; n < 2 * kKC; ++n) {
                                const int col = slice * kKC * 16 + n * 8 + 2 * t;
                                if ((kSlices == 1 && !kPadded) || col < d_cols)
                                    gstore(reinterpret_cast<uint32_t*>(dKt + key * d_cols + col),
                                           cvt_pack2<elem_t>(dk[mt][n][2 * hh] * (float)p.scale,
                                                             dk[mt][n][2 * hh + 1] * (float)p.scale));
                            }
#pragma unroll
                            for (int n = 0; n < 2 * kVC; ++n) {
                                const int col = slice * kVC * 16 + n * 8 + 2 * t;
                                if ((kSlices == 1 && !kPadded) || col < dv_cols)
#ifdef CUFLASH_MASKS
                                    gstore(reinterpret_cast<uint32_t*>(dVt + key * dv_cols + col),
                                           cvt_pack2<elem_t>(dv[mt][n][2 * hh] * (kBandOnly && !kDropBuild ? kDvBand : dv_scale(p)),
                                                             dv[mt][n][2 * hh + 1] * (kBandOnly && !kDropBuild ? kDvBand : dv_scale(p))));
#else
                                    gstore(reinterpret_cast<uint32_t*>(dVt + key * dv_cols + col),
                                           cvt_pack2<elem_t>(dv[mt][n][2 * hh], dv[mt][n][2 * hh + 1]));
#endif
                            }
                        }
                    }
            }
            // Every warp is done with the last tile's dQ phase (reads of Ks, dSs) and buffers
            // before the next pass or KV tile reloads them.
            __syncthreads();
        }
    }
}

#ifdef CUFLASH_MASKS
#undef CUFLASH_BAND_LO
#undef CUFLASH_BAND_HI
#endif
#endif  // !CUFLASH_BWD_TC_HELPERS

#ifndef CUFLASH_BWD_TC_MAIN
// ------------------------------------------------------------------------------------------
// dQ = scale * sum_s accumulator[s] (slices summed in order 0, 1, ...: deterministic), four
// elements per thread and step (16-byte loads, 8-byte stores), grid-stride.
constexpr int kConvThreads = 256;
extern "C" __global__ void __launch_bounds__(kConvThreads)
flash_bwd_tc_dq_convert(const float* __restrict__ ws, elem_t* __restrict__ dQ, const BwdParams* __restrict__ P) {
    const BwdParams& p = *P;
    const float* acc = ws + p.dq_accum_offset;
    const long long n4 = p.n_convert / 4;  // d is a multiple of 16
    const float scale = (float)p.scale;
    for (long long e = (long long)blockIdx.x * kConvThreads + threadIdx.x; e < n4;
         e += (long long)gridDim.x * kConvThreads) {
        float4 x = gload(reinterpret_cast<const float4*>(acc) + e);
        // Not unrolled: unrolled by four under -ftz=true (which CuPy adds to every compile),
        // ptxas caps the kernel at 32 registers and spills; the loop is bound by memory.
#pragma unroll 1
        for (int s = 1; s < p.n_splits; ++s) {
            const float4 y = gload(reinterpret_cast<const float4*>(acc + s * p.dq_slice_stride) + e);
            x.x += y.x; x.y += y.y; x.z += y.z; x.w += y.w;
        }
        const uint2 out = make_uint2(cvt_pack2<elem_t>(x.x * scale, x.y * scale),
                                     cvt_pack2<elem_t>(x.z * scale, x.w * scale));
        gstore(reinterpret_cast<uint2*>(dQ) + e, out);
    }
}
#endif  // !CUFLASH_BWD_TC_MAIN

// flash_bwd_wgmma.cu: the attention backward for Hopper (sm_90a), float16 / bfloat16, d = dv = 64
// or 128 (192 and 256: flash_bwd_wgmma_wide.cuh, included below): TMA loads, warpgroup MMA
// (wgmma) and a producer warpgroup that streams the query tiles while two consumer warpgroups
// compute (the FlashAttention-3 structure, Shah et al. 2024).
// Result contract as flash_bwd_tc's main kernel, with which it shares the helpers
// (flash_bwd_tc.cu, -DCUFLASH_BWD_TC_HELPERS): flash_bwd_tc_preprocess writes lse2 = lse log2(e)
// (+inf on padding rows and rows that see no key) and D = rowsum(dO * O) into the float32
// workspace and zeroes the dQ accumulator; this kernel writes dK = scale dS^T Q and dV = P^T dO
// and adds dS K into the accumulator by float32 reds; flash_bwd_tc_dq_convert makes
// dQ = scale * accumulator.  P = exp2(S scale log2(e) - lse2), dS = P * (dP - D).
//
// Block: 384 threads = 3 warpgroups, one (key/value tile of kBc rows, kv head, batch) per block
// (kBc = 128 up to d = 128, 64 above; folded grid, params.cuh; BwdParams.n_kv_blocks = n_kv_tiles).  The block visits every
// (query head of the kv head's group, query tile of 64 rows) pair that sees its keys.
//   warpgroup 0, the producer (setmaxnreg 24): its thread 0 loads K_j, V_j once, then Q_i, dO_i
//     (TMA) and lse2_i, D_i (bulk copies) into kStages stages, each guarded by a "full" and an
//     "empty" mbarrier.
//   warpgroups 1 and 2, the consumers (setmaxnreg 240), at d = 64 and 128 (bwd_consumers below;
//     at 192 and 256 flash_bwd_wgmma_wide.cuh's): keys 64(w-1) .. 64(w-1)+63 of the tile.
//     Per (head, query tile), in the transposed form (keys as the M rows, so that P^T and dS^T
//     are accumulators that feed the next products as register A operands):
//       S^T  (64 x 64) = K_w Q_i^T          wgmma SS
//       dP^T (64 x 64) = V_w dO_i^T         wgmma SS, issued before S^T is read
//       P^T = exp2(S^T c - lse2), causal mask on the diagonal tiles
//       dV_w (64 x d) += P^T dO_i           wgmma RS (P^T from registers), dO N-major
//       dS^T = P^T * (dP^T - D)             also stored to shared memory (128-byte swizzle)
//       dK_w (64 x d) += dS^T Q_i           wgmma RS
//       dQ_i (64 x d) += dS_w K_w           wgmma SS, dS^T read M-major, one 64-column chunk of
//                                           d at a time, each reduced into the accumulator
//     The two consumers share no data but the stages; one's exponentials overlap the other's
//     products on the tensor cores.
// Keys past Nk and query rows past Nq come in as zero rows (TMA): such a query's lse2 is +inf
// (P = 0, dS = 0); such a key's dS reaches dQ only times its zero K row, and its dK, dV rows are
// not stored.  Queries that see no key of the tile (causal) are skipped tile by tile; a tile
// whose keys no query sees stores dK = dV = 0.
//
// Shared memory (dynamic, from its first 1024-byte aligned address; tiles are rows of 64
// elements = 128 bytes, swizzled by 128 bytes, in d/64 column chunks):
//   K (kBc rows) | V (kBc rows) | Q: kStages x 64 rows | dO: kStages x 64 rows |
//   4 score tiles of 64 x 64 (d <= 128: dS^T, 2 buffers x 2 consumers; above: P^T and dS^T,
//   2 buffers each) | lse2, D: kStages x 64 floats each | mbarriers
// Compile-time parameters: CUFLASH_DTYPE_F16 | _BF16, CUFLASH_HEAD_DIM (64, 128, 192 or 256).
// Arguments: the tensor maps of Q, K, V, dO (cuflash.launch.hopper: 4-d, boxes of 64 x 64),
// the arrays Q, K, V, dO (read through the maps), the workspace, dK, dV (contiguous (B, Hk,
// Nk, d)) and BwdParams (scale, Nq, Nk, H, Hk, group, causal, causal_offset, n_kv_blocks,
// nq_pad, d_offset, dq_accum_offset).
#if !defined(CUFLASH_DTYPE_F16) && !defined(CUFLASH_DTYPE_BF16)
#error "flash_bwd_wgmma.cu supports CUFLASH_DTYPE_F16 and CUFLASH_DTYPE_BF16"
#endif
#include "dtype.cuh"
#include "params.cuh"
#include "hopper.cuh"

constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kBc = kD <= 128 ? 128 : 64;  // keys per block (64 per consumer up to d = 128)
constexpr int kBr = 64;                   // queries per tile
constexpr int kStages = 2;
constexpr int kChunks = kD / 64;
constexpr unsigned kConsumersBarrier = 4;  // named barrier of the two consumer warpgroups (1..3: per warpgroup)
#ifdef CUFLASH_DTYPE_BF16
constexpr bool kBF16 = true;
#else
constexpr bool kBF16 = false;
#endif
static_assert(kD == 64 || kD == 128 || kD == 192 || kD == 256, "head dim: 64, 128, 192 or 256");

constexpr int kKVBytes = kChunks * kBc * 128;  // K or V: [chunk][kBc rows][128 bytes]
constexpr int kQBytes = kChunks * kBr * 128;   // Q_i or dO_i: [chunk][64 rows][128 bytes]
constexpr int kDSBytes = 64 * 128;             // a 64 x 64 score tile (dS^T or P^T): [64 keys][64 queries]
constexpr int kKOff = 0;
constexpr int kVOff = kKVBytes;
constexpr int kQOff = 2 * kKVBytes;
constexpr int kDOOff = kQOff + kStages * kQBytes;
constexpr int kDSOff = kDOOff + kStages * kQBytes;  // 4 score tiles (how the consumers use them: below)
constexpr int kRowOff = kDSOff + 4 * kDSBytes;      // lse2_i, D_i per stage (64 floats each)
constexpr int kBarOff = kRowOff + kStages * 2 * kBr * 4;
// The launch's dynamic shared memory: kBarOff + 8 (1 + 2 kStages) bytes and 1024 bytes for
// the alignment (cuflash.tiling's flash_bwd_wgmma formula).
#define CUFLASH_LOG2E 1.4426950408889634f

// A block's keys and the (head, query tile) steps that see them, its output rows and its
// pipeline (shared memory and mbarriers), as the producer and the consumers both read them.
struct BwdBlock {
    int hk, b, kv0, n_q_tiles, it0, T;  // kv head, batch, first key, query tiles, first seen, steps
    elem_t* dKt;                        // dK, dV rows of the block's first key
    elem_t* dVt;
    unsigned char* smem;                // from its first 1024-byte aligned address
    uint64_t* kv_full;                  // K and V landed
    uint64_t* full;                     // [kStages]: stage s filled
    uint64_t* empty;                    // [kStages]: stage s consumed by both consumers
};

// The producer (thread 0 of warpgroup 0): K and V once, then Q_i, dO_i (TMA) and lse2_i, D_i
// (bulk copies) of every step into stage tt % kStages once both consumers released it.
__device__ __forceinline__ void bwd_producer(const BwdParams& p, const BwdBlock& k, const void* tmap_q,
                                             const void* tmap_k, const void* tmap_v, const void* tmap_do,
                                             const float* ws) {
    unsigned char* const smem = k.smem;
    mbarrier_arrive_expect_tx(k.kv_full, 2 * kKVBytes);
    for (int c = 0; c < kChunks; ++c)
        for (int r = 0; r < kBc; r += 64) {  // boxes of 64 rows
            const int at[4] = {64 * c, k.kv0 + r, k.hk, k.b};
            tma_load<4>(smem + kKOff + c * kBc * 128 + r * 128, tmap_k, at, k.kv_full);
            tma_load<4>(smem + kVOff + c * kBc * 128 + r * 128, tmap_v, at, k.kv_full);
        }
    int gg = 0, i = k.it0;
    for (int tt = 0; tt < k.T; ++tt) {
        const int s = tt % kStages, h = k.hk * p.group + gg, q0 = i * kBr;
        if (tt >= kStages) mbarrier_wait_parity(&k.empty[s], (tt / kStages - 1) & 1);  // its last use is done
        mbarrier_arrive_expect_tx(&k.full[s], 2 * kQBytes + 2 * kBr * 4);
        for (int c = 0; c < kChunks; ++c) {
            const int at[4] = {64 * c, q0, h, k.b};
            tma_load<4>(smem + kQOff + s * kQBytes + c * kBr * 128, tmap_q, at, &k.full[s]);
            tma_load<4>(smem + kDOOff + s * kQBytes + c * kBr * 128, tmap_do, at, &k.full[s]);
        }
        const size_t row = ((size_t)k.b * p.H + h) * p.nq_pad + q0;  // lse2 / D of the tile
        bulk_copy_g2s(smem + kRowOff + s * 2 * kBr * 4, ws + row, kBr * 4, &k.full[s]);
        bulk_copy_g2s(smem + kRowOff + s * 2 * kBr * 4 + kBr * 4, ws + p.d_offset + row, kBr * 4, &k.full[s]);
        if (++i == k.n_q_tiles) {
            i = k.it0;
            ++gg;
        }
    }
}

// dQ's reds of one 64 x 64 chunk of a query tile's accumulator, from this lane's address `at`
// (row wr; row wr + 8 is 8 kD floats on): a red.v2 per pair; rows past Nq (only in the last
// query tile, q0 + kBr > Nq) are not added.
__device__ __forceinline__ void dq_chunk_reds(float* at, const float (&dq)[32], int q0, int wr, int Nq) {
    const auto red_row = [&](int h2) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            gred_add_v2(at + 8 * h2 * kD + 8 * j, dq[4 * j + 2 * h2], dq[4 * j + 2 * h2 + 1]);
    };
    if (q0 + kBr <= Nq) {
        red_row(0);
        red_row(1);
    } else {
        if (q0 + wr < Nq) red_row(0);
        if (q0 + wr + 8 < Nq) red_row(1);
    }
}

#if CUFLASH_HEAD_DIM > 128
#include "flash_bwd_wgmma_wide.cuh"  // d = 192, 256: the consumers split the work otherwise
#else
// The consumers (warpgroups 1 and 2, after setmaxnreg) at d = 64, 128: the score tiles are
// dS^T per (stage s, consumer w) at kDSOff + (2s + w) kDSBytes.
__device__ __forceinline__ void bwd_consumers(const BwdParams& p, const BwdBlock& blk, float* ws, int tid) {
    const int wg = tid / 128;
    const int hk = blk.hk, b = blk.b, group = p.group, Nq = p.Nq, Nk = p.Nk, kv0 = blk.kv0;
    const int n_q_tiles = blk.n_q_tiles, it0 = blk.it0, T = blk.T;
    unsigned char* const smem = blk.smem;
    uint64_t* const full = blk.full;
    uint64_t* const empty = blk.empty;
    elem_t* const dKt = blk.dKt;
    elem_t* const dVt = blk.dVt;
    // w from a shuffle: warp-uniform as far as the compiler knows (descriptors in uniform registers)
    const int w = __shfl_sync(0xffffffffu, wg, 0) - 1, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = 16 * ((tid / 32) & 3) + g;      // this lane's rows wr, wr + 8 of the warpgroup's 64
    const int kw0 = kv0 + 64 * w;                  // the warpgroup's first key
    const float c = (float)p.scale * CUFLASH_LOG2E;
    const int causal = p.causal, off = p.causal_offset;
    // Descriptors as 32-bit low words (start address, LBO); a k16 step, a chunk, a stage or a
    // buffer adds its byte offset / 16 to the start field (bits 0-13: no carry below 256 KB).
    // The high word (SBO 1024: 8 rows of 128 bytes; the 128-byte swizzle) is a constant.
    //   K-major (d contiguous, the K dimension of S^T and dP^T): K_w, V_w as A, Q_i, dO_i as B
    //   N-major (d contiguous as N of dV, dK, dQ): Q_i, dO_i, K_w as B; LBO = one d chunk
    //   M-major: dS^T as A of dQ (queries contiguous)
    const uint32_t a_k = (uint32_t)wgmma_desc(smem + kKOff + w * 64 * 128, 16, 1024, 128);
    const uint32_t a_v = (uint32_t)wgmma_desc(smem + kVOff + w * 64 * 128, 16, 1024, 128);
    uint32_t b_q = (uint32_t)wgmma_desc(smem + kQOff, 16, 1024, 128);
    uint32_t b_do = (uint32_t)wgmma_desc(smem + kDOOff, 16, 1024, 128);
    uint32_t n_q = (uint32_t)wgmma_desc(smem + kQOff, kBr * 128, 1024, 128);
    uint32_t n_do = (uint32_t)wgmma_desc(smem + kDOOff, kBr * 128, 1024, 128);
    const uint32_t n_k = (uint32_t)wgmma_desc(smem + kKOff + w * 64 * 128, kBc * 128, 1024, 128);
    uint32_t a_ds = (uint32_t)wgmma_desc(smem + kDSOff + w * kDSBytes, kDSBytes, 1024, 128);
    uint32_t a_ds_all = (uint32_t)wgmma_desc(smem + kDSOff, kDSBytes, 1024, 128);  // both consumers' rows
    const uint32_t n_k_all = (uint32_t)wgmma_desc(smem + kKOff, kBc * 128, 1024, 128);
    constexpr uint64_t kHi = (uint64_t)((1024 >> 4) | (1u << 30)) << 32;
    auto desc = [](uint32_t lo) { return kHi | lo; };
    // the stage-dependent ones are added to in the loop; pinned, they are not rebuilt there
    pin(b_q), pin(b_do), pin(n_q), pin(n_do), pin(a_ds), pin(a_ds_all);

    uint64_t kd[4 * kChunks], vd[4 * kChunks];
#pragma unroll
    for (int step = 0; step < 4 * kChunks; ++step) {
        const uint32_t ka = (uint32_t)((step / 4) * kBc * 128 + 32 * (step % 4)) >> 4;
        kd[step] = desc(a_k + ka);
        vd[step] = desc(a_v + ka);
        pin(kd[step]); pin(vd[step]);
    }
    auto kmajor_product = [&](float (&acc)[kBr / 2], const uint64_t (&a)[4 * kChunks], uint32_t b) {
        wgmma_ss_zero<kBr, kBF16, false, false>(acc, a[0], desc(b));
#pragma unroll
        for (int step = 1; step < 4 * kChunks; ++step) {
            const uint32_t kb = (uint32_t)((step / 4) * kBr * 128 + 32 * (step % 4)) >> 4;
            wgmma_ss<kBr, kBF16, false, false>(acc, a[step], desc(b + kb), true);
        }
        wgmma_commit();
    };
    // dS^T's stores: row r = wr + 8 h2 of the warpgroup's buffer, 16-byte chunk j ^ (r & 7) (the
    // 128-byte swizzle), bytes 4t.  r & 7 = g for both rows, and the buffer (1024-aligned), the
    // row and 4t leave address bits 4-6 clear, so every store's address is ds_lane ^ (j << 4)
    // plus the stage's and the row half's offsets (bits 10 and up, which the XOR leaves alone):
    // one LOP3 per chunk, from the stage's ds_lane + offset.
    unsigned char* const ds_buf = smem + kDSOff + w * kDSBytes;
    const uint32_t ds_buf_a = (uint32_t)__cvta_generic_to_shared(ds_buf);
    const uint32_t ds_lane = ds_buf_a + wr * 128 + 4 * t + (g << 4);
    // dQ's reds: this lane's offset in a tile of the accumulator (row wr, the warpgroup's 64
    // columns at d = 128, pair 2t); the tile's first row, kBr rows on from one query tile to the
    // next, and wrap_step elements on to the next head's tile it0
    int dq_lane = wr * kD + (kChunks == 1 ? 0 : 64 * w) + 2 * t;
    float* dq_tile = ws + p.dq_accum_offset + (((size_t)b * p.H + hk * group) * Nq + (size_t)it0 * kBr) * kD;
    long long wrap_step = ((long long)Nq - (long long)(n_q_tiles - 1 - it0) * kBr) * kD;
    pin(wrap_step);
    float dk[kD / 2], dv[kD / 2];
#pragma unroll
    for (int e = 0; e < kD / 2; ++e) dk[e] = dv[e] = 0.0f;
    int t2 = 2 * t;  // this lane's first query of each 8 in lse2 and D; pinned, not rebuilt per step
    pin(t2);
    mbarrier_wait_parity(blk.kv_full, 0);
    int i = it0;
    // One (head, query tile) step tt on stage s = tt % 2, which is also its dS^T buffer, waiting
    // for the stage's phase parity = (tt / 2) % 2.  At d = 64 s is a constant once inlined, so
    // that every shared-memory address of the step is one; at d = 128 s and parity are carried
    // by the loop.
    auto step = [&](unsigned parity, int s) {
        const int q0 = i * kBr;
        const uint32_t qo = (uint32_t)(s * kQBytes) >> 4;
        mbarrier_wait_parity(&full[s], parity);
        // S^T = K_w Q_i^T and dP^T = V_w dO_i^T (one commit group each): d/16 k16 steps, 32 bytes
        // apart inside a 64-column chunk
        float st[kBr / 2], dpt[kBr / 2];
        wgmma_fence();
        kmajor_product(st, kd, b_q + qo);
        kmajor_product(dpt, vd, b_do + qo);
        const float* lse_s = reinterpret_cast<const float*>(smem + kRowOff + s * 2 * kBr * 4) + t2;
        const float* d_s = lse_s + kBr;
        wgmma_wait<1>();
        wgmma_fence_operand(st);
        // P^T = exp2(S^T c - lse2): lane (g, t) holds keys wr, wr + 8 and queries 8j + 2t, +1;
        // the causal mask only on the tiles a query's diagonal crosses
#ifndef CUFLASH_BWD_INTERIOR_ONLY  // instruction counting (bench/hopper_sass_count.py): steady tiles only
        if (causal && kw0 + 63 > q0 + off) {
#pragma unroll
            for (int e = 0; e < kBr / 2; ++e)
                if (kw0 + wr + 8 * ((e >> 1) & 1) > q0 + 8 * (e >> 2) + 2 * t + (e & 1) + off) st[e] = -INFINITY;
        }
#endif
#pragma unroll
        for (int j = 0; j < kBr / 8; ++j) {
            const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j);
#pragma unroll
            for (int e4 = 0; e4 < 4; ++e4) {
                const int e = 4 * j + e4;
                st[e] = exp2f(fmaf(st[e], c, -((e4 & 1) ? l2.y : l2.x)));
            }
        }
        uint32_t pf[kBr / 16][4];
        wgmma_acc_to_a<elem_t>(st, pf);
        // dV_w += P^T dO_i: k16 steps of 16 query rows (2048 bytes), dO N-major
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBr / 16; ++kk)
            wgmma_rs<kD, kBF16, true>(dv, pf[kk], desc(n_do + qo + ((2048 * kk) >> 4)), true);
        wgmma_commit();
        wgmma_wait<1>();  // dP^T (the dV product may still run)
        wgmma_fence_operand(dpt);
        // dS^T = P^T (dP^T - D), into registers and this warpgroup's buffer of stage s
        const uint32_t ds_stage = ds_lane + 2 * s * kDSBytes;
#pragma unroll
        for (int j = 0; j < kBr / 8; ++j) {
            const float2 dd = *reinterpret_cast<const float2*>(d_s + 8 * j);
            const uint32_t row_a = ds_stage ^ (uint32_t)(j << 4);  // row wr
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int e = 4 * j + 2 * h2;
                dpt[e] = st[e] * (dpt[e] - dd.x);
                dpt[e + 1] = st[e + 1] * (dpt[e + 1] - dd.y);
                sts_b32(ds_buf, ds_buf_a, row_a + 1024 * h2, pack2<elem_t>(dpt[e], dpt[e + 1]));
            }
        }
        uint32_t df[kBr / 16][4];
        wgmma_acc_to_a<elem_t>(dpt, df);
        fence_proxy_async();  // this thread's dS^T stores, before the tensor cores read them
        // dK_w += dS^T Q_i
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBr / 16; ++kk)
            wgmma_rs<kD, kBF16, true>(dk, df[kk], desc(n_q + qo + ((2048 * kk) >> 4)), true);
        wgmma_commit();
        // dQ_i += dS K, reduced into the float32 accumulator: A = dS^T (M-major: queries
        // contiguous), B = K (N-major), k16 steps of 16 keys.  d = 64: each warpgroup adds its
        // own 64 keys' share of all 64 columns (after its own barrier); d = 128: each adds all
        // 128 keys' share of its 64-column chunk, reading both warpgroups' dS^T (after the two
        // meet): half the reds of the first way, for the same products.
        const uint32_t dso = (uint32_t)(2 * s * kDSBytes) >> 4;
        constexpr int kDqSteps = kChunks == 1 ? 4 : 8;      // keys / 16
        uint32_t a_dq = a_ds + dso, b_dq = n_k;             // this warpgroup's keys, chunk 0
        if constexpr (kChunks == 1) {
            warpgroup_barrier();  // every row of this warpgroup's dS^T stored
        } else {
            named_barrier_sync(kConsumersBarrier, 256);  // both warpgroups' dS^T stored
            a_dq = a_ds_all + dso;                              // keys 0..127
            b_dq = n_k_all + ((w * kBc * 128) >> 4);            // keys 0..127 of chunk w
        }
        float dq[32];
        wgmma_fence();
        wgmma_ss_zero<64, kBF16, true, true>(dq, desc(a_dq), desc(b_dq));
#pragma unroll
        for (int kk = 1; kk < kDqSteps; ++kk)
            wgmma_ss<64, kBF16, true, true>(dq, desc(a_dq + ((2048 * kk) >> 4)), desc(b_dq + ((2048 * kk) >> 4)), true);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(dq);
        dq_chunk_reds(dq_tile + dq_lane, dq, q0, wr, Nq);
        if ((tid & 127) == 0) mbarrier_arrive(&empty[s]);  // this consumer is done with stage s
        const bool wrap = ++i == n_q_tiles;
        dq_tile += wrap ? wrap_step : (long long)kBr * kD;
        if (wrap) i = it0;
    };
    static_assert(kStages == 2, "the steps alternate between two stages");
    if constexpr (kD == 64) {  // two steps per trip share the loop's overhead (bench/hopper_sass_count.py)
        for (int tt = 0; tt < T; tt += 2) {
            step((tt >> 1) & 1, 0);
            if (tt + 1 < T) step((tt >> 1) & 1, 1);
        }
    } else {  // at d = 128 two inlined steps spill (372 bytes, NVRTC 13.0): one per trip
        unsigned s = 0, parity = 0;
        for (int tt = 0; tt < T; ++tt) {
            step(parity, s);
            parity ^= s;
            s ^= 1;
        }
    }

    // dK (scaled) and dV of the warpgroup's keys; keys past Nk are not stored
    const float scale = (float)p.scale;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const int r = 64 * w + wr + 8 * h2;
        if (kv0 + r >= Nk) continue;
        elem_t* krow = dKt + (size_t)r * kD + 2 * t;
        elem_t* vrow = dVt + (size_t)r * kD + 2 * t;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j) {
            gstore(reinterpret_cast<uint32_t*>(krow + 8 * j),
                   pack2<elem_t>(dk[4 * j + 2 * h2] * scale, dk[4 * j + 2 * h2 + 1] * scale));
            gstore(reinterpret_cast<uint32_t*>(vrow + 8 * j), pack2<elem_t>(dv[4 * j + 2 * h2], dv[4 * j + 2 * h2 + 1]));
        }
    }
}
#endif  // CUFLASH_HEAD_DIM

extern "C" __global__ void __launch_bounds__(384, 1)
flash_bwd_wgmma(const void* __restrict__ tmap_q, const void* __restrict__ tmap_k, const void* __restrict__ tmap_v,
                const void* __restrict__ tmap_do, const elem_t* __restrict__ Q, const elem_t* __restrict__ K,
                const elem_t* __restrict__ V, const elem_t* __restrict__ dO, float* __restrict__ ws,
                elem_t* __restrict__ dK, elem_t* __restrict__ dV, const BwdParams* __restrict__ P) {
    const BwdParams& p = *P;
    const int tid = threadIdx.x;
    const FoldedIndex fi = cuflash_fold_decode(p.n_kv_blocks, p.Hk);
    BwdBlock blk;
    blk.hk = fi.h;
    blk.b = fi.b;
    blk.kv0 = fi.tile * kBc;
    blk.n_q_tiles = (p.Nq + kBr - 1) / kBr;
    blk.it0 = 0;  // causal: query tiles before the one holding row kv0 - off see no key here
    if (p.causal) {
        const long long i_min = (long long)blk.kv0 - p.causal_offset;
        blk.it0 = i_min <= 0 ? 0 : (i_min >= p.Nq ? blk.n_q_tiles : (int)(i_min / kBr));
    }
    blk.T = p.group * (blk.n_q_tiles - blk.it0);  // (head, query tile) pairs of this block
    const size_t bhk = (size_t)blk.b * p.Hk + blk.hk;
    blk.dKt = dK + (bhk * p.Nk + blk.kv0) * kD;
    blk.dVt = dV + (bhk * p.Nk + blk.kv0) * kD;
    if (blk.T == 0) {  // no query sees these keys: dK = dV = 0, nothing loaded
        const int n = min(kBc, p.Nk - blk.kv0) * kD;
        for (int e = tid; e < n; e += 384) {
            gstore(blk.dKt + e, elem_t(0.0f));
            gstore(blk.dVt + e, elem_t(0.0f));
        }
        return;
    }
    blk.smem = shared_aligned_1024();
    blk.kv_full = reinterpret_cast<uint64_t*>(blk.smem + kBarOff);
    blk.full = blk.kv_full + 1;
    blk.empty = blk.full + kStages;
    if (tid == 0) pipeline_init(blk.kv_full, kStages, 2);
    __syncthreads();
    // the producer warpgroup (one thread issues every copy); tested as tid / 128, the consumers'
    // warpgroup index: `tid < 128` costs the d = 128 loop 7 instructions and bfloat16 a spill
    // (NVRTC 13.0)
    if (tid / 128 == 0) {
        setmaxnreg_dec<24>();
        if (tid == 0) bwd_producer(p, blk, tmap_q, tmap_k, tmap_v, tmap_do, ws);
        return;
    }
    setmaxnreg_inc<240>();
    bwd_consumers(p, blk, ws, tid);
}

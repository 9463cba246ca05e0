// flash_fwd_wgmma.cu: the attention forward for Hopper (sm_90a), float16 / bfloat16:
// TMA loads, warpgroup MMA (wgmma) and a producer warpgroup that keeps K/V tiles streaming
// while two consumer warpgroups compute (the FlashAttention-3 structure, Shah et al. 2024).
// Result contract as flash_fwd_tc: O = softmax(scale * Q K^T [causal mask]) V, lse = m + log(l)
// per query row (natural log); rows that see no key give o = 0, lse = -inf.
//
// Block: 384 threads = 3 warpgroups, one (Q tile of 128 rows, query head, batch) per block
// (folded grid, params.cuh; FwdParams.n_tiles = ceil(Nq / 128); causal calls take the last query
// tile, the one with the most keys, first).
//   warpgroup 0, the producer: gives up registers (setmaxnreg 24); its thread 0 loads Q once
//     and then K_j, V_j into kStages shared-memory stages by TMA, each stage guarded by two
//     mbarriers: "full" (the copies' bytes landed) and "empty" (both consumers are done).
//   warpgroups 1 and 2, the consumers (setmaxnreg 240): rows 64(w-1) .. 64(w-1)+63 of the tile.
//     Per K/V tile:  S (64 x Bc) = Q_w K_j^T     wgmma SS, d/16 steps, f32 accumulators
//                    online softmax on S's registers (rows g, g + 8 of each lane: two
//                    shuffles per row statistic, as the mma.sync kernels)
//                    O (64 x d) += P V_j         wgmma RS: P's accumulators become the A
//                                                fragments in registers, V by descriptor
//     software-pipelined by one tile: a trip issues S_j and then P_{j-1} V_{j-1}, and runs the
//     softmax of S_j while the tensor cores still work on P V; once P V is waited for, one
//     thread per consumer arrives on stage j-1's "empty" barrier (the wait_group before it is
//     warpgroup-wide).  The two consumers take turns at issuing their products (ping-pong:
//     named barriers 4 and 5, a bar.sync before a consumer's products and a bar.arrive for the
//     other after them), so that one's softmax runs under the other's products.
//
// Shared memory (dynamic, from its first 1024-byte aligned shared address; every tile is
// rows of 64 elements = 128 bytes, written by TMA with the 128-byte swizzle, which the
// wgmma descriptors read back):
//   Q: kD/64 chunks x 128 rows | K: kStages x kD/64 chunks x Bc rows | V: likewise | mbarriers
//   S's B operand K_j: K-major (d contiguous), descriptor start + 32 bytes per k16 step inside a
//     chunk, SBO 1024 (8 rows of 128 bytes).
//   P V's B operand V_j (kv x d, d contiguous): N-major, SBO 1024 (8 kv rows), LBO = one d
//     chunk (Bc x 128 bytes), start + 2048 bytes per k16 step (16 kv rows).
// Tensor maps (cuflash.launch.tma.tensor_map, 4-d: d, rows, heads, batch): Q with boxes of
// 64 x 64 (one consumer's rows of one chunk), K and V with boxes of 64 x Bc.  Rows past the
// end of Q or K/V come in as zeros; keys past Nk are masked to -inf, query rows past Nq are
// not stored.
//
// Compile-time parameters: CUFLASH_DTYPE_F16 | _BF16, CUFLASH_HEAD_DIM (64, 128, 192 or 256),
// CUFLASH_BLOCK_KV (Bc: 64, 96, 128, 192 or 256; a wgmma N), CUFLASH_STAGES (default 2).
// Arguments: the tensor maps of Q, K, V (global, 64-byte aligned), the arrays Q, K, V (not
// read through their pointers: the maps address them), O, LSE and the FwdParams block (o_*,
// lse_*, scale, Nq, Nk, H, group, causal, causal_offset, n_tiles of its dense fields).
// Launched by cuflash.launch.fwd on an sm_90 for the plain float16/bfloat16 calls it takes
// (cuflash.tiling.wgmma_takes) at the head dims $CUFLASH_WGMMA chooses (cuflash.kernels).
#if !defined(CUFLASH_DTYPE_F16) && !defined(CUFLASH_DTYPE_BF16)
#error "flash_fwd_wgmma.cu supports CUFLASH_DTYPE_F16 and CUFLASH_DTYPE_BF16"
#endif
#include "dtype.cuh"
#include "params.cuh"
#include "hopper.cuh"

#ifndef CUFLASH_STAGES
#define CUFLASH_STAGES 2
#endif
constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kBc = CUFLASH_BLOCK_KV;
constexpr int kStages = CUFLASH_STAGES;
constexpr int kBr = 128;                 // query rows per block: 64 per consumer warpgroup
constexpr int kChunks = kD / 64;         // 64-column chunks of d (one TMA box and 128-byte row each)
constexpr unsigned kTurnBar = 4;         // named barriers 4, 5: the consumers' turns (ping-pong)
#ifdef CUFLASH_DTYPE_BF16
constexpr bool kBF16 = true;
#else
constexpr bool kBF16 = false;
#endif
static_assert(kD % 64 == 0 && kD <= 256, "head dim: 64, 128, 192 or 256");
static_assert(kBc % 16 == 0 && kBc <= 256, "block_kv: a multiple of 16 up to 256");
static_assert(kStages >= 2 && kStages <= 4, "2 to 4 stages");

constexpr int kQBytes = kChunks * kBr * 128;
constexpr int kTileBytes = kChunks * kBc * 128;         // one K or V tile
constexpr int kKOffset = kQBytes;
constexpr int kVOffset = kKOffset + kStages * kTileBytes;
constexpr int kBarOffset = kVOffset + kStages * kTileBytes;
// The launch's dynamic shared memory: kBarOffset + 8 (1 + 2 kStages) bytes of tiles and
// barriers, and 1024 bytes for the alignment.
#define CUFLASH_LOG2E 1.4426950408889634f

// The key tiles a query tile of rows [q0, q0 + kBr) needs: all, or up to the causal diagonal.
__device__ __forceinline__ int kv_tiles(const FwdParams& p, int q0) {
    int end = p.Nk;
    if (p.causal) end = min(end, q0 + kBr + p.causal_offset);
    return end <= 0 ? 0 : (end + kBc - 1) / kBc;
}

extern "C" __global__ void __launch_bounds__(384, 1)
flash_fwd_wgmma(const void* __restrict__ tmap_q, const void* __restrict__ tmap_k, const void* __restrict__ tmap_v,
                const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
                elem_t* __restrict__ O, float* __restrict__ LSE, const FwdParams* __restrict__ P) {
    const FwdParams& p = *P;
    unsigned char* smem = shared_aligned_1024();
    uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + kBarOffset);
    uint64_t* full = q_full + 1;
    uint64_t* empty = full + kStages;
    const int tid = threadIdx.x, wg = tid / 128;
    const FoldedIndex fi = cuflash_fold_decode(p.n_tiles, p.H);
    // causal: the last query tiles see the most keys; the grid runs them first (blocks start
    // in index order), so the short ones fill the tail of the launch
    const int tile = p.causal ? p.n_tiles - 1 - fi.tile : fi.tile;
    const int h = fi.h, b = fi.b, q0 = tile * kBr, kvh = h / p.group;
    const int n_kv = kv_tiles(p, q0);
    if (tid == 0) pipeline_init(q_full, kStages, 2);
    __syncthreads();

    if (wg == 0) {  // ---------------------------------------------------------- producer
        setmaxnreg_dec<24>();
        if (tid != 0) return;
        mbarrier_arrive_expect_tx(q_full, kQBytes);
        for (int c = 0; c < kChunks; ++c)
            for (int half = 0; half < 2; ++half) {
                const int at[4] = {64 * c, q0 + 64 * half, h, b};
                tma_load<4>(smem + c * kBr * 128 + half * 64 * 128, tmap_q, at, q_full);
            }
        for (int j = 0; j < n_kv; ++j) {
            const int s = j % kStages;
            if (j >= kStages) mbarrier_wait_parity(&empty[s], (j / kStages - 1) & 1);  // its last use is done
            mbarrier_arrive_expect_tx(&full[s], 2 * kTileBytes);
            for (int c = 0; c < kChunks; ++c) {
                const int at[4] = {64 * c, j * kBc, kvh, b};
                tma_load<4>(smem + kKOffset + s * kTileBytes + c * kBc * 128, tmap_k, at, &full[s]);
                tma_load<4>(smem + kVOffset + s * kTileBytes + c * kBc * 128, tmap_v, at, &full[s]);
            }
        }
        return;
    }

    // ------------------------------------------------------------------------- consumers
    setmaxnreg_inc<240>();
    // w from a shuffle: warp-uniform as far as the compiler knows, so the descriptors built
    // from it live in uniform registers (an HGMMA reads its descriptors from there)
    const int w = __shfl_sync(0xffffffffu, wg, 0) - 1, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = 64 * w + 16 * ((tid / 32) & 3) + g;   // this lane's rows: row0, row0 + 8 (in the tile)
    const float c = (float)p.scale * CUFLASH_LOG2E;          // p = 2^(s c - m c)
    // the parameters the loop reads, in registers: the wgmma operand fences clobber memory
    const int nk = p.Nk, causal = p.causal, causal_offset = p.causal_offset;
    // the descriptors' low words (start address, LBO) for Q's chunks and stage 0's K and V; a
    // k16 step, a stage or a chunk adds its byte offset / 16 to the start field (bits 0-13:
    // no carry below 256 KB).  The high word (SBO 1024, 128-byte swizzle) is a constant, so
    // the arithmetic is 32-bit.
    const uint64_t dq0 = wgmma_desc(smem + w * 64 * 128, 16, 1024, 128);
    const uint32_t dq = (uint32_t)dq0, dk = (uint32_t)wgmma_desc(smem + kKOffset, 16, 1024, 128);
    const uint32_t dv = (uint32_t)wgmma_desc(smem + kVOffset, kBc * 128, 1024, 128);
    constexpr uint64_t kHi = (uint64_t)((1024 >> 4) | (1u << 30)) << 32;  // wgmma_desc(..., 1024, 128)'s
    auto desc = [](uint32_t lo) { return kHi | lo; };
    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
    float mc[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    // what the exponentials subtract: mc, or 0 while a row has seen no key (2^-inf = 0, never
    // NaN); it changes only where mc does, so the lazy trip does not recompute it
    float msub[2] = {0.0f, 0.0f};
    // Q's descriptors, one per k16 step, built once and pinned: they stay in uniform registers
    // across the loop instead of being rebuilt before every wgmma of S
    uint64_t qd[4 * kChunks];
#pragma unroll
    for (int st = 0; st < 4 * kChunks; ++st) {
        const int ch = st / 4, kk = st % 4;
        qd[st] = desc(dq + ((ch * kBr * 128 + 32 * kk) >> 4));
        pin(qd[st]);
    }
    // S = Q_w K_j^T into sacc (issued and committed, not waited for): per 64-column chunk,
    // four k16 steps of 32 bytes along the rows
    auto issue_s = [&](float (&sacc)[kBc / 2], uint32_t stage) {
        wgmma_ss_zero<kBc, kBF16, false, false>(sacc, qd[0], desc(dk + stage));
#pragma unroll
        for (int st = 1; st < 4 * kChunks; ++st) {
            const int ch = st / 4, kk = st % 4;
            wgmma_ss<kBc, kBF16, false, false>(sacc, qd[st],
                                               desc(dk + stage + ((ch * kBc * 128 + 32 * kk) >> 4)), true);
        }
        wgmma_commit();
    };
    // O += P V_j (issued and committed): k16 steps of 16 key rows (2048 bytes), V N-major
    auto issue_pv = [&](const uint32_t (&pf)[kBc / 16][4], uint32_t stage) {
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk)
            wgmma_rs<kD, kBF16, true>(o, pf[kk], desc(dv + stage + ((2048 * kk) >> 4)), true);
        wgmma_commit();
    };
    auto stage_of = [](int j) { return (uint32_t)((j % kStages) * kTileBytes) >> 4; };

    // The softmax of tile j's scores, in place: the masks, then the online softmax with the
    // reference max m lazy (as flash_fwd_tc): m moves, and O and l are rescaled, only when a
    // row's tile max would make p exceed 2^8 (a warp-uniform test), so most tiles skip the
    // multiplies of O's rescale.  P = 2^(S c - m c) <= 2^8.  Returns whether m moved, with
    // the factor alpha by which O must then be scaled (l is already).
    auto softmax = [&](float (&sacc)[kBc / 2], int j, float (&alpha)[2]) {
#ifndef CUFLASH_FWD_INTERIOR_ONLY  // instruction counting (bench/hopper_sass_count.py): steady tiles only
        // masks: keys past Nk, and past the causal diagonal, on the tiles that reach them
        const int k0 = j * kBc;
        if (k0 + kBc > nk || (causal && k0 + kBc - 1 > q0 + 64 * w + causal_offset)) {
#pragma unroll
            for (int i = 0; i < kBc / 2; ++i) {
                const int key = k0 + 8 * (i >> 2) + 2 * t + (i & 1);
                const int qi = q0 + row0 + 8 * ((i >> 1) & 1);
                if (key >= nk || (causal && key > qi + causal_offset)) sacc[i] = -INFINITY;
            }
        }
#endif
        float mx[2];
        bool move = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x = -INFINITY;
#pragma unroll
            for (int i = 0; i < kBc / 2; ++i)
                if (((i >> 1) & 1) == r) x = fmaxf(x, sacc[i]);
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            mx[r] = x * c;
            move |= mx[r] > mc[r] + 8.0f;
        }
        const bool any_move = __any_sync(0xffffffffu, move);
#if defined(CUFLASH_FWD_INTERIOR_ONLY) && !defined(CUFLASH_FWD_COUNT_RESCALE)
        // counting the lazy path: the test and the row maxima kept, the rescale dropped; a store
        // sinks them (a __trap() makes ptxas serialise the wgmmas and spill in this build, and
        // an empty asm lets it drop the maxima)
        if (any_move) LSE[0] = mx[0] + mx[1];
        alpha[0] = alpha[1] = 1.0f;
        constexpr bool kRescale = false;  // (O's as well)
#else
        constexpr bool kRescale = true;
        if (any_move) {
            // a row that has seen no key yet keeps m = -inf; its alpha is 0 (O and l are 0)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float mnew = fmaxf(mc[r], mx[r]);
                msub[r] = mnew == -INFINITY ? 0.0f : mnew;
                alpha[r] = exp2f(mc[r] - msub[r]);
                mc[r] = mnew;
                l[r] *= alpha[r];
            }
        }
#endif
#pragma unroll
        for (int i = 0; i < kBc / 2; ++i) {
            const int r = (i >> 1) & 1;
            sacc[i] = exp2f(fmaf(sacc[i], c, -msub[r]));
            l[r] += sacc[i];
        }
        return kRescale && any_move;
    };

    // The loop overlaps each tile's softmax with the previous tile's P V on the tensor cores:
    // trip j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j alone, runs the
    // softmax of S_j while P V runs, then waits for P V before O is rescaled and P_j packed
    // (P V reads P's registers and adds into O's until its wait).  K_{j-1}'s and V_{j-1}'s
    // stage is released after that wait.  Tile 0 (no P V before it) and the last P V are
    // outside the loop.
    // Ping-pong: the two consumers take turns at issuing their matrix products (named barriers
    // kTurnBar + w, both consumers' 256 threads), so that one's products run while the other
    // does its softmax instead of both issuing at once and then both waiting.  Consumer 0 goes
    // first; consumer 1 skips its last hand-over, which nobody would take.
    const auto my_turn = [&] { named_barrier_sync(kTurnBar + w, 256); };
    const auto pass_turn = [&](bool last) {
        if (!(last && w == 1)) named_barrier_arrive(kTurnBar + 1 - w, 256);
    };
    uint32_t pf[kBc / 16][4];
    float alpha[2];
    mbarrier_wait_parity(q_full, 0);
    if (n_kv > 0) {
        if (w == 1) pass_turn(false);
        mbarrier_wait_parity(&full[0], 0);
        float sacc[kBc / 2];
        my_turn();
        wgmma_fence();
        issue_s(sacc, stage_of(0));
        pass_turn(false);
        wgmma_wait<0>();
        wgmma_fence_operand(sacc);
        softmax(sacc, 0, alpha);  // O is 0: nothing to rescale
        wgmma_acc_to_a<elem_t>(sacc, pf);
    }
    // one trip: tile j on stage s = j % 2, called with s a constant so that the stages'
    // descriptor and barrier offsets are constants once inlined
    const auto trip = [&](int j, int s) {
        mbarrier_wait_parity(&full[s], (j / kStages) & 1);
        float sacc[kBc / 2];
        my_turn();
        wgmma_fence();
        issue_s(sacc, stage_of(s));
        issue_pv(pf, stage_of(1 - s));
        pass_turn(false);
        wgmma_wait<1>();  // S_j; P V may still run
        wgmma_fence_operand(sacc);
        const bool moved = softmax(sacc, j, alpha);
        wgmma_wait<0>();  // P_{j-1} V_{j-1}: O's and P's registers are free again
        wgmma_fence_operand(o);
        if ((tid & 127) == 0) mbarrier_arrive(&empty[1 - s]);  // this consumer is done with it
        if (moved) {
#pragma unroll
            for (int i = 0; i < kD / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
        wgmma_acc_to_a<elem_t>(sacc, pf);  // P_j, the A operand of the next trip's P V
    };
    static_assert(kStages == 2, "the trips alternate between two stages");
    for (int j = 1; j < n_kv; j += 2) {
        trip(j, 1);
        if (j + 1 < n_kv) trip(j + 1, 0);
    }
    if (n_kv > 0) {  // the last tile's P V
        my_turn();
        wgmma_fence();
        issue_pv(pf, stage_of(n_kv - 1));
        pass_turn(true);
        wgmma_wait<0>();
        wgmma_fence_operand(o);
        if ((tid & 127) == 0) mbarrier_arrive(&empty[(n_kv - 1) % kStages]);
    }

    // O / l and lse = ln 2 * (m c + log2 l); rows that saw no key: 0 and -inf
    elem_t* Ob = O + b * p.o_sb + h * p.o_sh;
    float* LSEb = LSE + b * p.lse_sb + h * p.lse_sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        const int qi = q0 + row0 + 8 * r;
        if (qi >= p.Nq) continue;
        const bool none = lr == 0.0f;
        const float inv = none ? 0.0f : __fdividef(1.0f, lr);
        elem_t* orow = Ob + qi * p.o_sr;
#pragma unroll
        for (int nt = 0; nt < kD / 8; ++nt)
            gstore(reinterpret_cast<uint32_t*>(orow + 8 * nt + 2 * t),
                   pack2<elem_t>(o[4 * nt + 2 * r] * inv, o[4 * nt + 2 * r + 1] * inv));
        if (t == 0) gstore(LSEb + qi, none ? -INFINITY : (mc[r] + log2f(lr)) * 0.6931471805599453f);
    }
}

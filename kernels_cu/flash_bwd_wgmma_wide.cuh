// flash_bwd_wgmma_wide.cuh: flash_bwd_wgmma's consumers at d = dv = 192 or 256, included by
// flash_bwd_wgmma.cu in place of its d = 64 / 128 ones: the same kernel, arguments, result
// contract, producer and shared-memory layout, with 64 keys per block (kBc).  The two consumer
// warpgroups split the work another way, because one thread cannot hold dK and dV of 64 keys
// at these head dims (d floats of each).  Consumer w takes queries 32w .. 32w+31 of each
// query tile for the score products, and one of the two gradients of the block's keys:
//   S^T  (64 x 32) = K Q_w^T                wgmma SS (N = 32)
//   dP^T (64 x 32) = V dO_w^T               wgmma SS
//   P^T = exp2(S^T c - lse2), dS^T = P^T (dP^T - D): both stored to shared memory (128-byte
//   swizzle), then the two consumers meet (named barrier), and
//   w = 0:  dV (64 x d) += P^T dO_i         wgmma SS, A = P^T (all 64 queries), dO N-major
//   w = 1:  dK (64 x d) += dS^T Q_i         wgmma SS, A = dS^T, Q N-major
//   dQ_i[:, c] += dS K[:, c], c = w, w + 2  wgmma SS (dS^T read M-major), each 64-column chunk
//                                           reduced into the float32 accumulator
// So a thread keeps d/2 floats of one gradient (128 at d = 256), 16 of S^T, 16 of dP^T and a
// dQ chunk (32).  At d = 192 the chunks split 2 : 1, the one imbalance of the split.
// P^T and dS^T live in two buffers each (by step parity); a consumer writes buffer s of step
// tt + 2 only after both met at step tt + 1, by which time both finished step tt's reads.
// Keys past Nk, query rows past Nq, causal skipping, the dQ pointer: as at d <= 128.  At
// d = 256 the shared memory is 230,440 bytes and the 1,024 for the alignment, inside an
// H100's 232,448.

// The consumers (warpgroups 1 and 2, after setmaxnreg) at d = 192, 256: the score tiles are P^T
// of stage s at kDSOff + s kDSBytes and dS^T at kDSOff + (2 + s) kDSBytes.
static_assert(kBc == 64, "flash_bwd_wgmma_wide.cuh: 64 keys per block");
constexpr int kPOff = kDSOff;                      // P^T [2]
constexpr int kDSTOff = kDSOff + 2 * kDSBytes;     // dS^T [2]

__device__ __forceinline__ void bwd_consumers(const BwdParams& p, const BwdBlock& blk, float* ws, int tid) {
    const int wg = tid / 128;
    const int hk = blk.hk, b = blk.b, group = p.group, Nq = p.Nq, Nk = p.Nk, kv0 = blk.kv0;
    const int n_q_tiles = blk.n_q_tiles, it0 = blk.it0, T = blk.T;
    unsigned char* const smem = blk.smem;
    uint64_t* const full = blk.full;
    uint64_t* const empty = blk.empty;
    // w from a shuffle: warp-uniform as far as the compiler knows (descriptors in uniform registers)
    const int w = __shfl_sync(0xffffffffu, wg, 0) - 1, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = 16 * ((tid / 32) & 3) + g;      // this lane's keys wr, wr + 8 of the tile's 64
    const int wq = 32 * w;                         // the consumer's first query of each tile
    const float c = (float)p.scale * CUFLASH_LOG2E;
    const int causal = p.causal, off = p.causal_offset;
    // Descriptors as 32-bit low words (start address, LBO); a k16 step, a chunk, a stage or a
    // buffer adds its byte offset / 16 to the start field (bits 0-13: no carry below 256 KB).
    // The high word (SBO 1024: 8 rows of 128 bytes; the 128-byte swizzle) is a constant.
    //   K-major: K, V as A and Q_w, dO_w as B of S^T, dP^T; P^T, dS^T as A of dV, dK
    //   N-major (d contiguous as N): dO_i, Q_i as B of dV, dK; K as B of dQ; LBO = one chunk
    //   M-major: dS^T as A of dQ (queries contiguous)
    const uint32_t a_k = (uint32_t)wgmma_desc(smem + kKOff, 16, 1024, 128);
    const uint32_t a_v = (uint32_t)wgmma_desc(smem + kVOff, 16, 1024, 128);
    uint32_t b_q = (uint32_t)wgmma_desc(smem + kQOff + wq * 128, 16, 1024, 128);
    uint32_t b_do = (uint32_t)wgmma_desc(smem + kDOOff + wq * 128, 16, 1024, 128);
    // the gradient this consumer accumulates: dV = P^T dO (w = 0) or dK = dS^T Q (w = 1)
    uint32_t a_g = (uint32_t)wgmma_desc(smem + (w == 0 ? kPOff : kDSTOff), 16, 1024, 128);
    uint32_t n_g = (uint32_t)wgmma_desc(smem + (w == 0 ? kDOOff : kQOff), 64 * 128, 1024, 128);
    uint32_t a_ds = (uint32_t)wgmma_desc(smem + kDSTOff, kDSBytes, 1024, 128);
    const uint32_t n_k = (uint32_t)wgmma_desc(smem + kKOff, 64 * 128, 1024, 128);
    constexpr uint64_t kHi = (uint64_t)((1024 >> 4) | (1u << 30)) << 32;
    auto desc = [](uint32_t lo) { return kHi | lo; };
    pin(b_q), pin(b_do), pin(a_g), pin(n_g), pin(a_ds);
    // S^T or dP^T of the consumer's 32 queries: d/16 k16 steps, 32 bytes apart inside a chunk,
    // chunks 64 rows (8 KB) apart in both operands
    auto kmajor_product = [&](float (&acc)[16], uint32_t a, uint32_t bq) {
        wgmma_ss_zero<32, kBF16, false, false>(acc, desc(a), desc(bq));
#pragma unroll
        for (int step = 1; step < 4 * kChunks; ++step) {
            const uint32_t k = (uint32_t)((step / 4) * 64 * 128 + 32 * (step % 4)) >> 4;
            wgmma_ss<32, kBF16, false, false>(acc, desc(a + k), desc(bq + k), true);
        }
        wgmma_commit();
    };
    // P^T's and dS^T's stores: row r = wr + 8 h2, 16-byte chunk (4w + j) ^ (r & 7) (the 128-byte
    // swizzle), bytes 4t; r & 7 = g, so an address is lane ^ ((4w + j) << 4) plus the buffer's and
    // the row half's offsets (bits 10 and up, which the XOR leaves alone)
    unsigned char* const p_buf = smem + kPOff;
    const uint32_t p_buf_a = (uint32_t)__cvta_generic_to_shared(p_buf);
    const uint32_t p_lane = p_buf_a + wr * 128 + 4 * t + (g << 4);
    // dQ's reds: this lane's offset in a tile of the accumulator (row wr, pair 2t), and the
    // tile's first row: kBr rows on per query tile, wrap_step elements on to the next head's it0
    int dq_lane = wr * kD + 2 * t;
    pin(dq_lane);  // not rebuilt from the thread index in the loop
    float* dq_tile = ws + p.dq_accum_offset + (((size_t)b * p.H + hk * group) * Nq + (size_t)it0 * kBr) * kD;
    long long wrap_step = ((long long)Nq - (long long)(n_q_tiles - 1 - it0) * kBr) * kD;
    pin(wrap_step);
    float gr[kD / 2];  // dV (w = 0) or dK (w = 1) of the tile's 64 keys
#pragma unroll
    for (int e = 0; e < kD / 2; ++e) gr[e] = 0.0f;
    int t2 = wq + 2 * t;  // this lane's first query of each 8 in lse2 and D
    pin(t2);
    mbarrier_wait_parity(blk.kv_full, 0);
    int i = it0;
    unsigned s = 0, parity = 0;
    for (int tt = 0; tt < T; ++tt) {
        const int q0 = i * kBr;
        const uint32_t qo = (s * kQBytes) >> 4, po = (s * kDSBytes) >> 4;
        mbarrier_wait_parity(&full[s], parity);
        float st[16], dpt[16];
        wgmma_fence();
        kmajor_product(st, a_k, b_q + qo);
        kmajor_product(dpt, a_v, b_do + qo);
        const float* lse_s = reinterpret_cast<const float*>(smem + kRowOff + s * 2 * kBr * 4) + t2;
        const float* d_s = lse_s + kBr;
        wgmma_wait<1>();
        wgmma_fence_operand(st);
        // P^T = exp2(S^T c - lse2): lane (g, t) holds keys wr, wr + 8 and queries wq + 8j + 2t, +1;
        // the causal mask only on the tiles a query's diagonal crosses
#ifndef CUFLASH_BWD_INTERIOR_ONLY  // instruction counting (bench/hopper_sass_count.py): steady tiles only
        if (causal && kv0 + 63 > q0 + wq + off) {
#pragma unroll
            for (int e = 0; e < 16; ++e)
                if (kv0 + wr + 8 * ((e >> 1) & 1) > q0 + wq + 8 * (e >> 2) + 2 * t + (e & 1) + off) st[e] = -INFINITY;
        }
#endif
        const uint32_t p_stage = p_lane + s * kDSBytes;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * j);
            const uint32_t row_a = p_stage ^ (uint32_t)((4 * w + j) << 4);
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int e = 4 * j + 2 * h2;
                st[e] = exp2f(fmaf(st[e], c, -l2.x));
                st[e + 1] = exp2f(fmaf(st[e + 1], c, -l2.y));
                sts_b32(p_buf, p_buf_a, row_a + 1024 * h2, pack2<elem_t>(st[e], st[e + 1]));
            }
        }
        wgmma_wait<0>();
        wgmma_fence_operand(dpt);
        // dS^T = P^T (dP^T - D), into the dS^T buffer of step parity s
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 dd = *reinterpret_cast<const float2*>(d_s + 8 * j);
            const uint32_t row_a = (p_stage + 2 * kDSBytes) ^ (uint32_t)((4 * w + j) << 4);
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int e = 4 * j + 2 * h2;
                const float d0 = st[e] * (dpt[e] - dd.x), d1 = st[e + 1] * (dpt[e + 1] - dd.y);
                sts_b32(p_buf, p_buf_a, row_a + 1024 * h2, pack2<elem_t>(d0, d1));
            }
        }
        fence_proxy_async();  // this thread's stores, before the tensor cores read them
        named_barrier_sync(kConsumersBarrier, 256);  // both consumers' P^T and dS^T stored
        // dQ_i[:, c] += dS K[:, c] for chunks c = w, w + 2: A = dS^T (M-major: queries
        // contiguous), B = K (N-major), k16 steps of 16 keys (2 KB); the first chunk's product
        // is issued before the gradient's, so that its reds overlap the gradient's product
        float* const dq_row = dq_tile + dq_lane;
        auto dq_chunk = [&](int ch, float (&dq)[32]) {
            const uint32_t nb = n_k + ((ch * 64 * 128) >> 4);
            wgmma_ss_zero<64, kBF16, true, true>(dq, desc(a_ds + po), desc(nb));
#pragma unroll
            for (int kk = 1; kk < 4; ++kk)
                wgmma_ss<64, kBF16, true, true>(dq, desc(a_ds + po + ((2048 * kk) >> 4)), desc(nb + ((2048 * kk) >> 4)), true);
            wgmma_commit();
        };
        float dq[32];
        wgmma_fence();
        dq_chunk(w, dq);
        // the gradient: 4 k16 steps of 16 queries, 32 bytes apart in A, 16 rows (2 KB) in B
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_ss<kD, kBF16, false, true>(gr, desc(a_g + po + ((32 * kk) >> 4)), desc(n_g + qo + ((2048 * kk) >> 4)), true);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operand(dq);
        dq_chunk_reds(dq_row + 64 * w, dq, q0, wr, Nq);
        if (w + 2 < kChunks) {  // d = 256 both consumers, d = 192 consumer 0
            wgmma_fence();
            dq_chunk(w + 2, dq);
            wgmma_wait<0>();
            wgmma_fence_operand(dq);
            dq_chunk_reds(dq_row + 64 * (w + 2), dq, q0, wr, Nq);
        }
        wgmma_wait<0>();
        if ((tid & 127) == 0) mbarrier_arrive(&empty[s]);  // this consumer is done with stage s
        const bool wrap = ++i == n_q_tiles;
        dq_tile += wrap ? wrap_step : (long long)kBr * kD;
        if (wrap) i = it0;
        parity ^= s;
        s ^= 1;
    }
    wgmma_fence_operand(gr);

    // dV (w = 0) or dK (scaled; w = 1) of the tile's keys; keys past Nk are not stored
    const float scale = w == 0 ? 1.0f : (float)p.scale;
    elem_t* const out = w == 0 ? blk.dVt : blk.dKt;
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
        const int r = wr + 8 * h2;
        if (kv0 + r >= Nk) continue;
        elem_t* row = out + (size_t)r * kD + 2 * t;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j)
            gstore(reinterpret_cast<uint32_t*>(row + 8 * j), pack2<elem_t>(gr[4 * j + 2 * h2] * scale, gr[4 * j + 2 * h2 + 1] * scale));
    }
}

// flash_fwd_tc: the FlashAttention-2 forward of flash_fwd.cu on tensor cores, for float16 and
// bfloat16.  Same result contract: O = softmax(scale * Q K^T [causal mask]) V and
// lse = m + log(l) per query row, with rows that see no key giving o = 0, lse = -inf.
//
// Algorithm (FlashAttention-2, Dao 2023, forward with tiling): one thread block per (Q tile, query head, batch);
// Q_i resident in shared memory, K_j/V_j streamed through two shared-memory buffers with
// cp.async (tile j + 1 is in flight while tile j is computed); online softmax with running
// m_i, l_i per row; causal tiles above the boundary never loaded (loop bound).
//
// Warp layout (as in flash-attn 2): each warp owns 16 query rows and computes
//   S (16 x block_kv) = Q_w K_j^T   with mma.m16n8k16 (A = Q from ldmatrix.x4,
//                                    B = K rows from ldmatrix.x4: K row-major is B "col")
//   P = exp(S - m_new)              in the mma accumulator layout: lane (g = L/4, t = L%4)
//                                    holds rows g and g + 8, columns 2t, 2t + 1 of every
//                                    8-column tile, so the row max / row sum need only
//                                    two shuffles (xor 1, xor 2) within the quad
//   O += P V_j                      P's accumulators repacked in registers as the A operand
//                                    (rounded to the input dtype, as in flash-attn), B = V
//                                    from ldmatrix.x4.trans (V row-major is B row-major)
// Fragment layouts: docs/emulator.md ("Tensor-core instructions") and portable.cuh.
// Shared-memory rows are padded by 8 elements (16 bytes) so the 8 row addresses of one
// ldmatrix fall into different bank groups.
//
// Compile-time parameters: CUFLASH_DTYPE_F16 | CUFLASH_DTYPE_BF16, CUFLASH_HEAD_DIM (d),
// CUFLASH_HEAD_DIM_V (dv), CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV.  Launch: grid
// (ceil(Nq / block_q) * H * B) (folded, params.cuh), block 2 * block_q threads (block_q / 16
// warps), dynamic shared memory from cuflash.tiling ("flash_fwd_tc").  The arguments are
// those of flash_fwd (pointers and a FwdParams block).
//
// Limits: d and dv multiples of 16 (mma k and n steps), dv <= 128 (register budget);
// block_q and block_kv multiples of 16.  cp.async moves 16 bytes: the launcher guarantees
// 16-byte aligned base pointers and element strides that are multiples of 8 (else it
// copies the input).  On GPUs before sm_80 portable.cuh computes the same mma in software
// and cp.async is a synchronous copy.  float32/float64 use flash_fwd.cu.
#if !defined(CUFLASH_DTYPE_F16) && !defined(CUFLASH_DTYPE_BF16)
#error "flash_fwd_tc supports CUFLASH_DTYPE_F16 and CUFLASH_DTYPE_BF16 only"
#endif
#include "dtype.cuh"
#include "params.cuh"

#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V) || \
    !defined(CUFLASH_BLOCK_Q) || !defined(CUFLASH_BLOCK_KV)
#error "define CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q and CUFLASH_BLOCK_KV"
#endif

constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kDv = CUFLASH_HEAD_DIM_V;
constexpr int kBr = CUFLASH_BLOCK_Q;
constexpr int kBc = CUFLASH_BLOCK_KV;
constexpr int kWarps = kBr / 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kQS = kD + 8;     // padded row strides (elements)
constexpr int kKS = kD + 8;
constexpr int kVS = kDv + 8;
constexpr int kNT = kBc / 8;    // 8-column tiles of S per warp
constexpr int kOT = kDv / 8;    // 8-column tiles of O per warp

static_assert(kBr % 16 == 0 && kBc % 16 == 0, "block_q and block_kv must be multiples of 16");
static_assert(kD % 16 == 0 && kDv % 16 == 0, "d and dv must be multiples of 16");
static_assert(kD <= 256 && kDv <= 128, "d <= 256, dv <= 128");


// Start copying a (kRows, kCols) tile from global memory (row stride gs elements) into shared
// memory (row stride kSS) with 16-byte cp.async; rows >= rows are zero-filled with plain
// stores.  Visible to other threads after cp_async_wait and __syncthreads.
template <int kRows, int kCols, int kSS>
__device__ inline void load_tile_async(elem_t* s, const elem_t* g, long long gs, int rows,
                                       int tid) {
    constexpr int kChunks = kCols / 8;
    for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
        const int r = idx / kChunks, c = (idx - (idx / kChunks) * kChunks) * 8;
        if (r < rows) {
            cp_async_16(s + r * kSS + c, g + r * gs + c);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) s[r * kSS + c + e] = elem_t(0.0f);
        }
    }
}

extern "C" __global__ void flash_fwd_tc(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, acc_t* __restrict__ LSE, const FwdParams* __restrict__ P)
{
    CUFLASH_DYNAMIC_SHARED(elem_t, smem);
    elem_t* Qs = smem;                  // (kBr, kD + 8)          Q_i, resident
    elem_t* Ks = Qs + kBr * kQS;        // 2 x (kBc, kD + 8)      K_j, double buffered
    elem_t* Vs = Ks + 2 * kBc * kKS;    // 2 x (kBc, kDv + 8)     V_j, double buffered

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const FwdParams& p = *P;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal, causal_offset = p.causal_offset;
    const acc_t scale = (acc_t)p.scale;
    const FoldedIndex fi = cuflash_fold_decode(p.n_tiles, p.H);
    const int q0 = fi.tile * kBr;
    const int h = fi.h, b = fi.b;
    const int hk = h / p.group;
    const long long q_sr = p.q_sr, k_sr = p.k_sr, v_sr = p.v_sr, o_sr = p.o_sr;

    const elem_t* Qb = Q + b * p.q_sb + h * p.q_sh;
    const elem_t* Kb = K + b * p.k_sb + hk * p.k_sh;
    const elem_t* Vb = V + b * p.v_sb + hk * p.v_sh;
    elem_t* Ob = O + b * p.o_sb + h * p.o_sh;
    acc_t* LSEb = LSE + b * p.lse_sb + h * p.lse_sh;

    const int rows_q = min(kBr, Nq - q0);
    int kv_end = Nk;  // keys [0, kv_end) are visible to some row of the tile
    if (causal) {
        long long last = (long long)(q0 + rows_q - 1) + causal_offset + 1;
        kv_end = (int)(last < 0 ? 0 : (last > Nk ? Nk : last));
    }
    const int n_tiles = (kv_end + kBc - 1) / kBc;
    // this lane's two rows (g and g + 8 of the warp's 16) and their visible-key bounds
    int row_end[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const long long i = q0 + warp * 16 + g + 8 * rr;
        long long e = causal ? i + causal_offset + 1 : (long long)Nk;
        row_end[rr] = (int)(e < 0 ? 0 : (e > Nk ? Nk : e));
    }

    // -- start loading Q_i and the first K/V tile (one cp.async group)
    load_tile_async<kBr, kD, kQS>(Qs, Qb + q0 * q_sr, q_sr, rows_q, tid);
    if (n_tiles > 0) {
        const int rows_k = min(kBc, Nk);
        load_tile_async<kBc, kD, kKS>(Ks, Kb, k_sr, rows_k, tid);
        load_tile_async<kBc, kDv, kVS>(Vs, Vb, v_sr, rows_k, tid);
    }
    cp_async_commit();

    acc_t m_i[2] = {-INFINITY, -INFINITY};
    acc_t l_i[2] = {0, 0};
    acc_t o[kOT][4];
#pragma unroll
    for (int nt = 0; nt < kOT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0;

    for (int j = 0; j < n_tiles; ++j) {
        const int buf = j & 1;
        const int k0 = j * kBc;
        // -- prefetch tile j + 1 into the other buffer while tile j is computed
        if (j + 1 < n_tiles) {
            const int k1 = k0 + kBc;
            const int rows_k = min(kBc, Nk - k1);
            load_tile_async<kBc, kD, kKS>(Ks + (buf ^ 1) * kBc * kKS, Kb + k1 * k_sr, k_sr,
                                          rows_k, tid);
            load_tile_async<kBc, kDv, kVS>(Vs + (buf ^ 1) * kBc * kVS, Vb + k1 * v_sr, v_sr,
                                           rows_k, tid);
            cp_async_commit();
            cp_async_wait<1>();  // everything but the prefetch has landed (Q_i, tile j)
        } else {
            cp_async_wait<0>();
        }
        // Tile j (and on the first pass Q_i) written by every thread's copies and zero
        // fills is visible to all warps before any ldmatrix reads it.
        __syncthreads();
        const elem_t* Kt = Ks + buf * kBc * kKS;
        const elem_t* Vt = Vs + buf * kBc * kVS;

        // -- S = Q_w K_j^T (16 x kBc per warp) on tensor cores
        acc_t s[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0;
#pragma unroll
        for (int kk = 0; kk < kD; kk += 16) {
            uint32_t a[4];
            ldmatrix_x4(a, Qs + (warp * 16 + (lane & 15)) * kQS + kk + (lane >> 4) * 8);
#pragma unroll
            for (int nt = 0; nt < kNT; nt += 2) {
                uint32_t bb[4];
                ldmatrix_x4(bb, Kt + (nt * 8 + (lane & 7) + (lane >> 4) * 8) * kKS + kk +
                                    ((lane >> 3) & 1) * 8);
                const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
                mma_m16n8k16<elem_t>(s[nt], a, b0, s[nt]);
                mma_m16n8k16<elem_t>(s[nt + 1], a, b1, s[nt + 1]);
            }
        }

        // -- scale, mask, online softmax update for rows g (rr = 0) and g + 8 (rr = 1)
        acc_t mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1);
                s[nt][e] = key < row_end[e >> 1] ? s[nt][e] * scale : acc_t(-INFINITY);
                mx[e >> 1] = acc_max(mx[e >> 1], s[nt][e]);
            }
        }
        acc_t alpha[2], m_use[2], rowsum[2] = {0, 0};
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            mx[rr] = acc_max(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
            mx[rr] = acc_max(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
            const acc_t m_new = acc_max(m_i[rr], mx[rr]);
            // no visible key yet: shift by 0 so exp gives 0, not NaN
            m_use[rr] = m_new == acc_t(-INFINITY) ? acc_t(0) : m_new;
            alpha[rr] = expf(m_i[rr] - m_use[rr]);
            m_i[rr] = m_new;
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = expf(s[nt][e] - m_use[e >> 1]);
                rowsum[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            rowsum[rr] += __shfl_xor_sync(0xffffffffu, rowsum[rr], 1);
            rowsum[rr] += __shfl_xor_sync(0xffffffffu, rowsum[rr], 2);
            l_i[rr] = alpha[rr] * l_i[rr] + rowsum[rr];
        }
#pragma unroll
        for (int nt = 0; nt < kOT; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }

        // -- O += P V_j: P's accumulators of 8-column tiles 2kc, 2kc + 1 are the A operand
#pragma unroll
        for (int kc = 0; kc < kBc / 16; ++kc) {
            uint32_t a[4];
            a[0] = pack2<elem_t>(s[2 * kc][0], s[2 * kc][1]);
            a[1] = pack2<elem_t>(s[2 * kc][2], s[2 * kc][3]);
            a[2] = pack2<elem_t>(s[2 * kc + 1][0], s[2 * kc + 1][1]);
            a[3] = pack2<elem_t>(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
            for (int nt = 0; nt < kOT; nt += 2) {
                uint32_t bb[4];
                ldmatrix_x4_trans(bb, Vt + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kVS +
                                          nt * 8 + (lane >> 4) * 8);
                const uint32_t b0[2] = {bb[0], bb[1]}, b1[2] = {bb[2], bb[3]};
                mma_m16n8k16<elem_t>(o[nt], a, b0, o[nt]);
                mma_m16n8k16<elem_t>(o[nt + 1], a, b1, o[nt + 1]);
            }
        }
        // Every warp has finished reading buffer buf before iteration j + 1 prefetches
        // tile j + 2 into it.
        __syncthreads();
    }
    cp_async_wait<0>();  // no copy outlives the block (only Q_i is pending when n_tiles == 0)

    // -- O_i = acc / l_i, lse_i = m_i + log(l_i); rows that saw no key: 0 and -inf
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = warp * 16 + g + 8 * rr;
        if (row < rows_q) {
            const int i = q0 + row;
            const bool empty = l_i[rr] == acc_t(0);
            const acc_t inv = empty ? acc_t(0) : acc_t(1) / l_i[rr];
            elem_t* orow = Ob + i * o_sr;
#pragma unroll
            for (int nt = 0; nt < kOT; ++nt) {
                gstore(orow + nt * 8 + 2 * t, elem_t(o[nt][2 * rr] * inv));
                gstore(orow + nt * 8 + 2 * t + 1, elem_t(o[nt][2 * rr + 1] * inv));
            }
            if (t == 0) gstore(LSEb + i, empty ? acc_t(-INFINITY) : m_i[rr] + logf(l_i[rr]));
        }
    }
}

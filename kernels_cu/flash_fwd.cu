// flash_fwd: FlashAttention-2 forward, O = softmax(scale * Q K^T [causal mask]) V and
// lse = log(sum(exp(scale * Q K^T))) per query row, without ever forming the (Nq, Nk) matrix.
//
// Algorithm (FlashAttention-2, Dao 2023, forward with tiling): one thread block per
// (Q tile i, query head h, batch b).  The block loads Q_i (block_q rows) into shared memory
// once, then streams the K_j/V_j tiles (block_kv rows each) through shared memory.  For
// every tile it computes S = scale * Q_i K_j^T, updates the running row max m_i, the
// running sum l_i and the unnormalised output acc (online softmax):
//     m_new = max(m_i, rowmax(S)); alpha = exp(m_i - m_new); P = exp(S - m_new)
//     l_i = alpha * l_i + rowsum(P); acc = alpha * acc + P V_j; m_i = m_new
// and finally writes O_i = acc / l_i and lse_i = m_i + log(l_i).
//
// Thread layout (SIMT, no tensor cores): each warp owns 8 query rows; row r of a warp is
// handled by the quad of lanes 4r..4r+3.  Lane t of a quad computes the logits of key
// columns t, t+4, t+8, ... and the output columns t, t+4, t+8, ...  Row max and row sum
// need only two shuffles (xor 1, xor 2) inside the quad.  P goes through shared memory
// (Ps) so that each lane can read all block_kv probabilities of its row for P V.
// Shared-memory rows of Qs, Ks and Ps are padded by one element so that the 8 rows a
// warp reads at the same column hit different banks.  Global loads are row-contiguous
// over consecutive threads (coalesced).
//
// Masking: causal "bottom_right" (key j visible to query i iff j <= i + Nk - Nq) and
// "top_left" (iff j <= i) are the runtime argument causal_offset (Nk - Nq or 0) with
// causal != 0.  KV tiles entirely above the boundary are never loaded: the loop stops
// at the last tile the Q tile's last row can see.  A row that sees no key keeps
// m = -inf, l = 0 and gets o = 0, lse = -inf (never NaN).
//
// Grouped-query attention: query head h reads key/value head h / group (index
// arithmetic only, no copies).  Broadcast leading dims arrive as stride 0.  Every tensor
// is addressed by element strides for (batch, head, row); the last dim is contiguous.
//
// Compile-time parameters (-D, built by cuflash/kernels.py from cuflash/tiling.py):
//   CUFLASH_DTYPE_F16 | CUFLASH_DTYPE_BF16 | CUFLASH_DTYPE_F32 | CUFLASH_DTYPE_F64
//   CUFLASH_HEAD_DIM (d), CUFLASH_HEAD_DIM_V (dv), CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV
// Launch: grid (ceil(Nq / block_q) * H * B) (tiles, heads and batch folded into x, see
// params.cuh), block (4 * block_q), dynamic shared memory as computed by cuflash.tiling
// (flash_fwd entry); sizes, strides, scale and the mask in a FwdParams block.
//
// Limits: d, dv <= 256; block_q a multiple of 8, block_kv a multiple of 4 (tiling.py
// lists the supported values); float16/bfloat16 are loaded as such and computed in
// float32, float32 in float32, float64 in double.
#include "dtype.cuh"
#include "params.cuh"

#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V) || \
    !defined(CUFLASH_BLOCK_Q) || !defined(CUFLASH_BLOCK_KV)
#error "define CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q and CUFLASH_BLOCK_KV"
#endif

constexpr int kD = CUFLASH_HEAD_DIM;
constexpr int kDv = CUFLASH_HEAD_DIM_V;
constexpr int kBr = CUFLASH_BLOCK_Q;        // query rows per tile (Br)
constexpr int kBc = CUFLASH_BLOCK_KV;       // key rows per tile (Bc)
constexpr int kThreads = 4 * kBr;           // kBr / 8 warps
constexpr int kQStride = kD + 1;            // padded row strides (bank conflicts)
constexpr int kKStride = kD + 1;
constexpr int kPStride = kBc + 1;
constexpr int kColsPerLane = kBc / 4;       // logits per lane
constexpr int kOutPerLane = (kDv + 3) / 4;  // output columns per lane

static_assert(kBr % 8 == 0 && kBr >= 8, "block_q must be a multiple of 8");
static_assert(kBc % 4 == 0 && kBc >= 4, "block_kv must be a multiple of 4");
static_assert(kD >= 1 && kD <= 256 && kDv >= 1 && kDv <= 256, "head dims 1..256");

extern "C" __global__ void flash_fwd(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, acc_t* __restrict__ LSE, const FwdParams* __restrict__ P)
{
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* Qs = smem;                       // (kBr, kD + 1)   Q_i, resident
    acc_t* Ks = Qs + kBr * kQStride;        // (kBc, kD + 1)   K_j, streamed
    acc_t* Vs = Ks + kBc * kKStride;        // (kBc, kDv)      V_j, streamed
    acc_t* Ps = Vs + kBc * kDv;             // (kBr, kBc + 1)  P = exp(S - m), per tile

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int row = (tid >> 5) * 8 + (lane >> 2);  // this quad's query row in the tile
    const int t = lane & 3;                        // lane within the quad
    const FwdParams& p = *P;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal, causal_offset = p.causal_offset;
    const acc_t scale = (acc_t)p.scale;
    const FoldedIndex fi = cuflash_fold_decode(p.n_tiles, p.H);
    const int q0 = fi.tile * kBr;
    const int h = fi.h, b = fi.b;
    const int hk = h / p.group;                    // grouped-query: kv head of query head h
    const long long q_sr = p.q_sr, k_sr = p.k_sr, v_sr = p.v_sr, o_sr = p.o_sr;

    const elem_t* Qb = Q + b * p.q_sb + h * p.q_sh;
    const elem_t* Kb = K + b * p.k_sb + hk * p.k_sh;
    const elem_t* Vb = V + b * p.v_sb + hk * p.v_sh;
    elem_t* Ob = O + b * p.o_sb + h * p.o_sh;
    acc_t* LSEb = LSE + b * p.lse_sb + h * p.lse_sh;

    const int rows_q = min(kBr, Nq - q0);
    // Keys [0, kv_end) are visible to at least one row of this tile; tiles past it are
    // never loaded (causal skipping).
    int kv_end = Nk;
    if (causal) {
        long long last = (long long)(q0 + rows_q - 1) + causal_offset + 1;
        kv_end = (int)(last < 0 ? 0 : (last > Nk ? Nk : last));
    }
    const int n_tiles = (kv_end + kBc - 1) / kBc;
    // This row's own bound: keys < row_end are visible (>= Nk means all of them).
    const int i = q0 + row;
    long long row_end_ll = causal ? (long long)i + causal_offset + 1 : (long long)Nk;
    const int row_end = (int)(row_end_ll < 0 ? 0 : (row_end_ll > Nk ? Nk : row_end_ll));

    // -- load Q_i (rows past Nq are zero; they are computed but never stored)
    for (int idx = tid; idx < kBr * kD; idx += kThreads) {
        const int r = idx / kD, c = idx - (idx / kD) * kD;
        Qs[r * kQStride + c] = r < rows_q ? to_acc(gload(Qb + (q0 + r) * q_sr + c)) : acc_t(0);
    }

    acc_t m_i = -INFINITY;   // running max of this row
    acc_t l_i = 0;           // running sum of exp(s - m_i)
    acc_t acc[kOutPerLane];  // unnormalised output columns t, t+4, ...
#pragma unroll
    for (int u = 0; u < kOutPerLane; ++u) acc[u] = 0;

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * kBc;
        const int rows_k = min(kBc, Nk - k0);
        // -- load K_j, V_j (rows past Nk are zero so that 0 * V never meets NaN)
        for (int idx = tid; idx < kBc * kD; idx += kThreads) {
            const int r = idx / kD, c = idx - (idx / kD) * kD;
            Ks[r * kKStride + c] = r < rows_k ? to_acc(gload(Kb + (k0 + r) * k_sr + c)) : acc_t(0);
        }
        for (int idx = tid; idx < kBc * kDv; idx += kThreads) {
            const int r = idx / kDv, c = idx - (idx / kDv) * kDv;
            Vs[r * kDv + c] = r < rows_k ? to_acc(gload(Vb + (k0 + r) * v_sr + c)) : acc_t(0);
        }
        // Ks/Vs (and on the first tile Qs) are complete before any thread reads them.
        __syncthreads();

        // -- S = scale * Q_i K_j^T for columns t, t+4, ... of this row
        acc_t s[kColsPerLane];
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) s[c] = 0;
        for (int e = 0; e < kD; ++e) {
            const acc_t qe = Qs[row * kQStride + e];
#pragma unroll
            for (int c = 0; c < kColsPerLane; ++c) s[c] += qe * Ks[(t + 4 * c) * kKStride + e];
        }
        // -- mask, row max over the quad
        acc_t mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const int key = k0 + t + 4 * c;
            s[c] = key < row_end ? s[c] * scale : acc_t(-INFINITY);
            mx = acc_max(mx, s[c]);
        }
        mx = acc_max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = acc_max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // -- online softmax update; a row with no visible key yet keeps m = -inf and
        //    subtracts 0 instead, so exp() gives 0 rather than NaN
        const acc_t m_new = acc_max(m_i, mx);
        const acc_t m_use = m_new == acc_t(-INFINITY) ? acc_t(0) : m_new;
        const acc_t alpha = acc_exp(m_i - m_use);
        acc_t rowsum = 0;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const acc_t p = acc_exp(s[c] - m_use);
            rowsum += p;
            Ps[row * kPStride + t + 4 * c] = p;
        }
        rowsum += __shfl_xor_sync(0xffffffffu, rowsum, 1);
        rowsum += __shfl_xor_sync(0xffffffffu, rowsum, 2);
        l_i = alpha * l_i + rowsum;
        m_i = m_new;
        // This row's Ps entries (written by the 4 lanes of the quad) are visible to the quad.
        __syncwarp();

        // -- acc = alpha * acc + P V_j for output columns t, t+4, ...
#pragma unroll
        for (int u = 0; u < kOutPerLane; ++u) acc[u] *= alpha;
        for (int c = 0; c < kBc; ++c) {
            const acc_t p = Ps[row * kPStride + c];
#pragma unroll
            for (int u = 0; u < kOutPerLane; ++u) {
                const int e = t + 4 * u;
                if (e < kDv) acc[u] += p * Vs[c * kDv + e];
            }
        }
        // Every thread has finished reading Ks/Vs/Ps before the next tile overwrites them.
        __syncthreads();
    }

    // -- O_i = acc / l_i, lse_i = m_i + log(l_i); rows that saw no key: 0 and -inf
    if (row < rows_q) {
        const bool empty = l_i == acc_t(0);
        const acc_t inv = empty ? acc_t(0) : acc_t(1) / l_i;
        elem_t* orow = Ob + i * o_sr;
#pragma unroll
        for (int u = 0; u < kOutPerLane; ++u) {
            const int e = t + 4 * u;
            if (e < kDv) {
                gstore(orow + e, from_acc(acc[u] * inv));
            }
        }
        if (t == 0) gstore(LSEb + i, empty ? acc_t(-INFINITY) : m_i + acc_log(l_i));
    }
}

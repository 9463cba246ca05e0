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
// "top_left" (iff j <= i): the causal offset of fwd_problem.cuh (per sequence for varlen
// and KV-cache calls).  KV tiles entirely above the boundary are never loaded: the loop
// stops at the last tile the Q tile's last row can see.  A row that sees no key keeps
// m = -inf, l = 0 and gets o = 0, lse = -inf (never NaN).
//
// Logit features (compiled with -DCUFLASH_MASKS: kernel flash_fwd_masked, masks.cuh): bias,
// sliding window, ALiBi, softcap and Philox dropout, as P = mask(softcap(scale Q K^T) + bias
// + ALiBi).  Each row's visible keys are one interval [row_lo, row_end) (causal and window);
// KV tiles left of the first row's band are never loaded either.  With dropout, the kept P~
// are scaled by 1 / (1 - p) in Ps (so P~ V is the dropped product) while l_i sums the
// undropped P~.  Lane t draws the Philox block of each of its keys (t + 4c): one block per
// logit (the tensor-core kernels share a block among eight).
//
// Two kernels: flash_fwd (dense batches) and, compiled with -DCUFLASH_FWD_SERVING,
// flash_fwd_serving (variable-length batches, KV caches contiguous or paged, split-KV with
// partials in the compute type merged by flash_fwd_combine, packed grouped-query rows): the same body,
// the problem's geometry from fwd_problem.cuh.  flash_fwd_combine and flash_kv_append (the KV
// cache's append) are the helpers' module, -DCUFLASH_FWD_HELPERS.
//
// Grouped-query attention: query head h reads key/value head h / group (index
// arithmetic only, no copies).  Broadcast leading dims arrive as stride 0.  Every tensor
// is addressed by element strides for (batch, head, row); the last dim is contiguous.
//
// Compile-time parameters (-D, built by cuflash/kernels.py from cuflash/tiling.py):
//   CUFLASH_DTYPE_F16 | CUFLASH_DTYPE_BF16 | CUFLASH_DTYPE_F32 | CUFLASH_DTYPE_F64
//   CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV
// Head-dim classes: CUFLASH_HEAD_DIM(_V) are the capacities kD >= d, kDv >= dv of a class
// (cuflash.tiling.simt_head_dim_class: 8, 16, 32, 64, 96, ..., 256), not the call's own head
// dims, which arrive at run time (FwdParams head_d, head_dv).  Why: one compile then serves
// every head dim of its class, so the plan sweep (bench/plan_sweep.py) can compile every plan
// the planner accepts -- ptxas' register allocation is not monotone in d, and a sample of
// per-d compiles found spills at head dims the sweep never saw.  Columns d..kD-1
// of Qs/Ks and dv..kDv-1 of Vs are zero, so the loops keep their compile-time trip counts
// (the class dims compile exactly as before) and the padded columns add exact zeros; only
// the stores and global layouts use d and dv.
// Launch: grid (ceil(Nq / block_q) * H * B) (tiles, heads and batch folded into x, see
// params.cuh), block (4 * block_q), dynamic shared memory as computed by cuflash.tiling
// (flash_fwd entry); sizes, strides, scale and the mask in a FwdParams block.
//
// Limits: d, dv <= 256; block_q a multiple of 8, block_kv a multiple of 4 (tiling.py
// lists the supported values); float16/bfloat16 are loaded as such and computed in
// float32, float32 in float32, float64 in double.
#include "fwd_problem.cuh"

// Module split: -DCUFLASH_FWD_HELPERS builds flash_fwd_combine and flash_kv_append alone (the
// dtype is their only compile-time parameter: one module per dtype, not one per tile plan);
// otherwise the module holds the one forward kernel its defines name.
#ifndef CUFLASH_FWD_HELPERS

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
// Ps: the P V loop reads it far more often (per row, every lane reads all Bc values, a quad
// sharing each) than the logit step writes it (once per value): the odd stride makes the 8
// rows a warp reads at one column land in 8 different banks (8-byte elements: different
// 2-bank pairs).  Its stores, lane t of row r at column t + 4c, land (r + t) banks (pairs)
// apart and are 4-way; a stride that spread them would put rows r and r + 4 of the reads in
// one bank (the emulator's profile, bench/results/emulator_profile.md, counts both).
constexpr int kPStride = kBc + 1;
constexpr int kColsPerLane = kBc / 4;       // logits per lane
constexpr int kOutPerLane = (kDv + 3) / 4;  // output columns per lane (of the class)

static_assert(kBr % 8 == 0 && kBr >= 8, "block_q must be a multiple of 8");
static_assert(kBc % 4 == 0 && kBc >= 4, "block_kv must be a multiple of 4");
static_assert(kD >= 1 && kD <= 256 && kDv >= 1 && kDv <= 256, "head dims 1..256");
// The launcher guarantees 1 <= p.head_d <= kD and 1 <= p.head_dv <= kDv (the plan's class).

// The column of element idx of a (rows, W) tile that thread tid loads (idx = tid + k * kThreads).
// Where kThreads is a multiple of W it is tid % W on every iteration: written so, the column
// test against the call's head dim (c < d) is loop-invariant and leaves the unrolled loads
// (measured in SASS: 51 more instructions per KV tile in the main loop of float32 d = 64 when
// the column was recomputed per element).
template <int W>
__device__ __forceinline__ int col_of(int idx, int tid) {
    return kThreads % W == 0 ? tid % W : idx - (idx / W) * W;
}

// The forward for one block's problem (fwd_problem.cuh).  split: write the partial
// output and lse of this block's KV-tile range instead of o and lse.  A run-time flag, not a
// template parameter: it steers the epilogue alone, and one instantiation of the body halves
// the serving module's compile (ptxas time is the body's).
// Bias and Slopes: the feature tensors of -DCUFLASH_MASKS (unused, and nullptr, otherwise).
__device__ __forceinline__ void flash_fwd_body(const bool split, const elem_t* __restrict__ Q,
                                               const elem_t* __restrict__ K,
                                               const elem_t* __restrict__ V,
                                               elem_t* __restrict__ O, acc_t* __restrict__ LSE,
                                               const FwdParams& p, const FwdServing& sv,
                                               const acc_t* __restrict__ Bias,
                                               const acc_t* __restrict__ Slopes) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* Qs = smem;                       // (kBr, kD + 1)   Q_i, resident
    acc_t* Ks = Qs + kBr * kQStride;        // (kBc, kD + 1)   K_j, streamed
    acc_t* Vs = Ks + kBc * kKStride;        // (kBc, kDv)      V_j, streamed
    acc_t* Ps = Vs + kBc * kDv;             // (kBr, kBc + 1)  P = exp(S - m), per tile

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int row = (tid >> 5) * 8 + (lane >> 2);  // this quad's query row in the tile
    const int t = lane & 3;                        // lane within the quad
    const acc_t scale = (acc_t)p.scale;
    const FwdProblem f = cuflash_fwd_problem(p, sv, Q, K, V, O, LSE, kBr, kBc);
    const int q0 = f.q0, Nk = f.nk;
    if (q0 >= f.rows) return;  // varlen: a tile past this sequence's rows (whole block)
    const int rows_q = min(kBr, f.rows - q0);
    const long long q_sr = p.q_sr, o_sr = p.o_sr;
    const int d = p.head_d, dv = p.head_dv;  // this call's head dims (<= kD, kDv)
    // This row's own bound: keys < row_end are visible (tiles past every row's bound are
    // never loaded: f.tile_hi).
    const int i = q0 + row;
#ifdef CUFLASH_MASKS
    // the row's keys [row_lo, row_end) (causal and window); rows past the problem see none,
    // so they never read the bias
    int row_lo = 0, row_end = 0;
    if (row < rows_q) f.row_range(p, i, row_lo, row_end);
    // the query head and position of the row (packed grouped-query rows: head
    // kv_head * pack + r / q_period); rows past the problem take the tile's first
    const int ir = row < rows_q ? i : q0;
    const int qh = p.mask_pack > 1 ? f.h * p.mask_pack + ir / f.q_period : f.h;
    const int qpos = ir % f.q_period;
    const MaskRow mrow = cuflash_mask_row(p, Bias, Slopes, f.b, qh, qpos, f.mask_off);
    const DropoutKey drop = cuflash_dropout_key(p);
    const int drop_b = f.b + p.mask_drop_b0;
#else
    const int row_end = f.row_end(i);
#endif

    // -- load Q_i (rows past the problem's, and columns past d, are zero; such rows are
    //    computed but never stored)
    for (int idx = tid; idx < kBr * kD; idx += kThreads) {
        const int r = idx / kD, c = col_of<kD>(idx, tid);
        Qs[r * kQStride + c] = r < rows_q && c < d ? to_acc(gload(f.Qb + (q0 + r) * q_sr + c))
                                                   : acc_t(0);
    }

    acc_t m_i = -INFINITY;   // running max of this row
    acc_t l_i = 0;           // running sum of exp(s - m_i)
    acc_t acc[kOutPerLane];  // unnormalised output columns t, t+4, ...
#pragma unroll
    for (int u = 0; u < kOutPerLane; ++u) acc[u] = 0;

    for (int j = f.tile_lo; j < f.tile_hi; ++j) {
        const int k0 = j * kBc;
        const int rows_k = min(kBc, Nk - k0);
        // -- load K_j, V_j (rows past Nk are zero so that 0 * V never meets NaN; columns
        //    past d and dv are zero, the class padding)
        for (int idx = tid; idx < kBc * kD; idx += kThreads) {
            const int r = idx / kD, c = col_of<kD>(idx, tid);
            Ks[r * kKStride + c] = r < rows_k && c < d ? to_acc(gload(f.k_row(K, p, k0 + r) + c))
                                                       : acc_t(0);
        }
        for (int idx = tid; idx < kBc * kDv; idx += kThreads) {
            const int r = idx / kDv, c = col_of<kDv>(idx, tid);
            Vs[r * kDv + c] = r < rows_k && c < dv ? to_acc(gload(f.v_row(V, p, k0 + r) + c))
                                                   : acc_t(0);
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
#ifdef CUFLASH_MASKS
            acc_t th;
            s[c] = key >= row_lo && key < row_end ? mrow.logit(s[c] * scale, key, th)
                                                  : acc_t(-INFINITY);
#else
            s[c] = key < row_end ? s[c] * scale : acc_t(-INFINITY);
#endif
            mx = acc_max(mx, s[c]);
        }
        mx = acc_max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = acc_max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // -- online softmax update; a row with no visible key yet keeps m = -inf and
        //    subtracts 0 instead, so exp() gives 0 rather than NaN
        const acc_t m_new = acc_max(m_i, mx);
        const acc_t m_use = m_new == acc_t(-INFINITY) ? acc_t(0) : m_new;
        const acc_t alpha = acc_exp(m_i - m_use);
#ifdef CUFLASH_MASKS
        // dropout: bit c of `dropped` says the lane's column c is dropped.  The draws run in
        // a loop that is not unrolled (one Philox block each), so the kernel holds one copy
        // of the generator, not one per column.
        static_assert(kColsPerLane <= 32, "one bit per column in a 32-bit word");
        uint32_t dropped = 0;
        if (drop.on) {
#pragma unroll 1
            for (int c = 0; c < kColsPerLane; ++c) {
                const bool keep = cuflash_dropout_keep(drop.k0, drop.k1, drop.threshold, drop_b,
                                                       qh, qpos, k0 + t + 4 * c);
                dropped |= uint32_t(!keep) << c;
            }
        }
#endif
        acc_t rowsum = 0;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const acc_t pe = acc_exp(s[c] - m_use);
            rowsum += pe;
#ifdef CUFLASH_MASKS
            // dropout: P~ V uses the kept P~ / (1 - p); rowsum (-> l_i, lse) the undropped
            if (drop.on) {
                Ps[row * kPStride + t + 4 * c] = (dropped >> c) & 1u ? acc_t(0) : pe * drop.scale;
                continue;
            }
#endif
            Ps[row * kPStride + t + 4 * c] = pe;
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
            const acc_t pe = Ps[row * kPStride + c];
#pragma unroll
            for (int u = 0; u < kOutPerLane; ++u) {
                const int e = t + 4 * u;
                if (e < kDv) acc[u] += pe * Vs[c * kDv + e];
            }
        }
        // Every thread has finished reading Ks/Vs/Ps before the next tile overwrites them.
        __syncthreads();
    }

    // -- O_i = acc / l_i, lse_i = m_i + log(l_i); rows that saw no key: 0 and -inf
    if (row < rows_q) {
        const bool empty = l_i == acc_t(0);
        const acc_t inv = empty ? acc_t(0) : acc_t(1) / l_i;
        const acc_t lse = empty ? acc_t(-INFINITY) : m_i + acc_log(l_i);
        if (split) {
            // this split's share, in the compute type (float32; double for float64), at the
            // row's lse element index
            const long long rho = f.lse0 + (long long)i * p.lse_sr;
            acc_t* orow = sv.part + ((long long)f.split * p.n_out_rows + rho) * dv;
#pragma unroll
            for (int u = 0; u < kOutPerLane; ++u) {
                const int e = t + 4 * u;
                if (e < dv) gstore(orow + e, acc[u] * inv);
            }
            acc_t* lse_part = sv.part + (long long)p.n_splits * p.n_out_rows * dv;
            if (t == 0) gstore(lse_part + f.split * p.n_out_rows + rho, lse);
        } else {
            elem_t* orow = f.Ob + i * o_sr;
#pragma unroll
            for (int u = 0; u < kOutPerLane; ++u) {
                const int e = t + 4 * u;
                if (e < dv) gstore(orow + e, from_acc(acc[u] * inv));
            }
            if (t == 0) gstore(f.LSEb + (long long)i * p.lse_sr, lse);
        }
    }
}

#if !defined(CUFLASH_FWD_SERVING) && !defined(CUFLASH_MASKS)
// Dense batches (the plain call of tiled_attention): six arguments.
extern "C" __global__ void flash_fwd(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, acc_t* __restrict__ LSE, const FwdParams* __restrict__ P)
{
    const FwdServing none = {nullptr, nullptr, nullptr, nullptr, nullptr};
    flash_fwd_body(false, Q, K, V, O, LSE, *P, none, nullptr, nullptr);
}
#elif !defined(CUFLASH_FWD_SERVING)
// Dense batches with the logit features (-DCUFLASH_MASKS, masks.cuh): the bias (read as
// acc_t through the mask_bias_* strides) and the ALiBi slopes (acc_t, mask_alibi_* strides);
// either may be any pointer when the params say the call has none.
extern "C" __global__ void flash_fwd_masked(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, acc_t* __restrict__ LSE, const FwdParams* __restrict__ P,
    const acc_t* __restrict__ Bias, const acc_t* __restrict__ Slopes)
{
    const FwdServing none = {nullptr, nullptr, nullptr, nullptr, nullptr};
    flash_fwd_body(false, Q, K, V, O, LSE, *P, none, Bias, Slopes);
}
#else
// Serving problems (fwd_problem.cuh): varlen, KV cache (contiguous or paged), split-KV,
// packed grouped-query rows.  Compiled as its own module (-DCUFLASH_FWD_SERVING) so the
// dense call keeps its short argument list and compile time.
// With -DCUFLASH_MASKS as well: flash_fwd_serving_masked, which also takes the bias and the
// ALiBi slopes (indexed by sequence, query head, query position and key position).
#ifdef CUFLASH_MASKS
#define CUFLASH_SERVING_KERNEL flash_fwd_serving_masked
#define CUFLASH_SERVING_MASK_ARGS , const acc_t* __restrict__ Bias, const acc_t* __restrict__ Slopes
#else
#define CUFLASH_SERVING_KERNEL flash_fwd_serving
#define CUFLASH_SERVING_MASK_ARGS
#define Bias nullptr
#define Slopes nullptr
#endif
extern "C" __global__ void CUFLASH_SERVING_KERNEL(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
    elem_t* __restrict__ O, acc_t* __restrict__ LSE, const FwdParams* __restrict__ P,
    const int* __restrict__ cu_q, const int* __restrict__ cu_k,
    const int* __restrict__ seqlens_k, const int* __restrict__ block_table,
    acc_t* __restrict__ part CUFLASH_SERVING_MASK_ARGS)
{
    const FwdServing sv = {cu_q, cu_k, seqlens_k, block_table, part};
    flash_fwd_body(P->n_splits > 1, Q, K, V, O, LSE, *P, sv, Bias, Slopes);
}
#ifndef CUFLASH_MASKS
#undef Bias
#undef Slopes
#endif
#endif  // the serving kernel
#endif  // !CUFLASH_FWD_HELPERS

#ifdef CUFLASH_FWD_HELPERS
// Split-KV, last step: merge the n_splits partial outputs of every output row exactly,
//     lse = log(sum_s exp(lse_s)),  o = sum_s exp(lse_s - lse) o_s
// (splits that saw no key have lse_s = -inf and weigh 0; a row no split saw gets o = 0,
// lse = -inf).  One warp per row: the lanes take the splits s = lane, lane + 32, ..., keep a
// running (max, sum) pair each, merge the pairs with shuffles, and leave the normalised
// weights in shared memory (n_splits floats per warp); then they take the columns lane,
// lane + 32, ... (coalesced).  Global traffic: each partial lse and output element read
// once, o and lse written once.  Rows are the lse elements of the call, whose o rows are
// contiguous in the same order (the launcher guarantees it).  Grid-stride over rows.
// Dynamic shared memory: (blockDim.x / 32) * n_splits values of the compute type.
extern "C" __global__ void flash_fwd_combine(const acc_t* __restrict__ part,
                                             elem_t* __restrict__ O, acc_t* __restrict__ LSE,
                                             const FwdParams* __restrict__ P) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long rows = P->n_out_rows;
    const int S = P->n_splits;
    const int dv = P->head_dv;                       // partial and output rows: dv columns
    acc_t* w = smem + warp * S;                      // (S,) this warp's weights
    const acc_t* lse_part = part + (long long)S * rows * dv;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const acc_t ninf = -INFINITY;
    for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + warp; r < rows; r += warps) {
        acc_t m = ninf, l = 0;                       // this lane's splits: max and sum
        for (int s = lane; s < S; s += 32) {
            const acc_t x = gload(lse_part + s * rows + r);
            w[s] = x;
            if (x > m) { l = l * acc_exp(m - x) + acc_t(1); m = x; }
            else if (x > ninf) l += acc_exp(x - m);
        }
        for (int o = 16; o > 0; o >>= 1) {           // merge the lanes' (max, sum) pairs
            const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const acc_t l2 = __shfl_xor_sync(0xffffffffu, l, o);
            const acc_t mm = acc_max(m, m2);
            l = (m > ninf ? l * acc_exp(m - mm) : acc_t(0)) + (m2 > ninf ? l2 * acc_exp(m2 - mm) : acc_t(0));
            m = mm;
        }
        const bool empty = !(l > acc_t(0));
        for (int s = lane; s < S; s += 32) w[s] = empty ? acc_t(0) : acc_exp(w[s] - m) / l;
        __syncwarp();                                // the weights are visible to the warp
        for (int c = lane; c < dv; c += 32) {
            acc_t acc = 0;
            for (int s = 0; s < S; ++s) acc += w[s] * gload(part + (s * rows + r) * dv + c);
            gstore(O + r * dv + c, from_acc(acc));
        }
        if (lane == 0) gstore(LSE + r, empty ? ninf : m + acc_log(l));
        __syncwarp();                                // w read by every lane before reuse
    }
}

// KV cache, first step: k_new/v_new written into the cache at the positions after each
// sequence's cached keys (the one in-place write of cuflash).  One thread per element of
// k_new then v_new (grid-stride); the position is clamped into the sequence's capacity and
// the block-table entry into the pages, so bad inputs cannot write out of bounds.
extern "C" __global__ void flash_kv_append(const elem_t* __restrict__ k_new,
                                           const elem_t* __restrict__ v_new,
                                           elem_t* __restrict__ k_cache,
                                           elem_t* __restrict__ v_cache,
                                           const int* __restrict__ seqlens_k,
                                           const int* __restrict__ block_table,
                                           const KVAppendParams* __restrict__ P) {
    const KVAppendParams& a = *P;
    const long long nk = (long long)a.B * a.Hk * a.Nnew;
    const long long total = nk * (a.d + a.dv);
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const bool is_v = e >= nk * a.d;
        const int width = is_v ? a.dv : a.d;
        const long long e2 = is_v ? e - nk * a.d : e;
        const int c = (int)(e2 % width);
        const long long rowi = e2 / width;           // (b, hk, n) of the new key
        const int n = (int)(rowi % a.Nnew);
        const int hk = (int)((rowi / a.Nnew) % a.Hk);
        const int b = (int)(rowi / ((long long)a.Nnew * a.Hk));
        const int pos = cuflash_clamp((long long)CUFLASH_INDEX(seqlens_k, b), 0, a.kv_capacity - a.Nnew) + n;
        long long base, row;
        if (a.page_size > 0) {
            const int pg = cuflash_clamp(CUFLASH_INDEX(block_table, (long long)b * a.max_pages + pos / a.page_size),
                                         0, a.num_pages - 1);
            base = pg; row = pos % a.page_size;
        } else {
            base = b; row = pos;
        }
        if (is_v) {
            const elem_t x = gload(v_new + b * a.vn_sb + hk * a.vn_sh + n * a.vn_sr + c);
            gstore(v_cache + base * a.vc_sb + hk * a.vc_sh + row * a.vc_sr + c, x);
        } else {
            const elem_t x = gload(k_new + b * a.kn_sb + hk * a.kn_sh + n * a.kn_sr + c);
            gstore(k_cache + base * a.kc_sb + hk * a.kc_sh + row * a.kc_sr + c, x);
        }
    }
}
#endif  // CUFLASH_FWD_HELPERS

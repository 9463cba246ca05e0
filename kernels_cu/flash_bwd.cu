// flash_bwd.cu - FlashAttention-2 backward: dQ, dK, dV from dO, Q, K, V, O and lse.
//
// What it computes (cuflash.tiled_attention_backward), for every query head
// problem with P = softmax(scale * Q K^T [masked]) (never stored):
//     dV = P^T dO              dP = dO V^T
//     D  = rowsum(dO * O)      dS = P * (dP - D)        (softmax backward)
//     dQ = scale * dS K        dK = scale * dS^T Q
// P is recomputed tile by tile from the forward's log-sum-exp: P = exp(scale*S - lse)
// (FlashAttention-2, Dao 2023), so no (Nq, Nk) array exists anywhere.
//
// Kernels (one launch each, in this order):
//   flash_bwd_preprocess  D = rowsum(dO * O): warps read rows coalesced, partial sums meet
//                         in shared memory; optionally zeroes the float32 dQ
//                         accumulator(s) of the atomic path and of flash_bwd_tf32.
//   flash_bwd_dkdv        one block per (KV tile j, kv head): Kj, Vj resident in shared
//                         memory, Qi/dOi/lse_i/D_i streamed for every query head of the GQA
//                         group and every Q tile that can see Kj; dKj, dVj accumulate in
//                         registers and are written once -> deterministic, no atomics.
//                         With atomic_dq != 0 it also adds scale * dS Kj into a float32 dQ
//                         accumulator with atomics (as FlashAttention-2).
//   flash_bwd_dq          deterministic dQ: one block per (Q tile i, query head): Qi, dOi
//                         resident, Kj/Vj streamed, dQi accumulated in registers.
//   flash_bwd_dq_convert  float32 dQ accumulator(s) -> dQ in the input dtype (their sum).
// The launcher (cuflash/launch/bwd_simt.py) runs flash_bwd_dq when deterministic=True and for
// float64 (there is no double gatomic_add), and the atomic path otherwise; float32 on sm_80+
// runs flash_bwd_tf32 (flash_bwd_tf32.cu) in place of flash_bwd_dkdv on both dQ paths.
//
// Notation as in cuflash.reference and flash_fwd.cu: Br = BLOCK_Q rows of Q per tile,
// Bc = BLOCK_KV rows of K/V per tile, Qi, Kj, Vj tiles, lse, D.
//
// Layout: leading dims are flattened by the launcher to (B, H) for queries and (B, Hk) for
// keys/values. q, k, v, do, o are addressed by element strides (batch, head, row) with a
// contiguous last dim, so broadcast dims arrive as stride 0 and no input is copied for
// them. lse, D (B, H, Nq), dq (B, H, Nq, d), dk (B, Hk, Nk, d), dv (B, Hk, Nk, dv) and the
// float32 dQ accumulator are C-contiguous. Query head h reads kv head h / group (grouped-
// query attention by index arithmetic, no K/V copies); the dkdv block loops over the
// group's query heads, so dK/dV of a kv head are summed here, deterministically. Leading
// dims along which q or k/v were broadcast are summed on the host by the launcher (xp.sum
// over the contiguous gradients), not here.
// Grids (batch, heads and tiles folded into x, params.cuh): preprocess ceil(Nq / rows) * H * B,
// dq ceil(Nq / Br) * H * B, dkdv ceil(Nk / Bc) * Hk * B; sizes and strides in a BwdParams block.
//
// Causal (runtime `causal`, `causal_offset`): query i sees key j iff j <= i + causal_offset,
// causal_offset = Nk - Nq (bottom_right) or 0 (top_left). Q tiles that cannot see Kj are
// never loaded (the Q loop starts at the first tile that can); KV tiles that no row of Qi
// can see are never loaded by flash_bwd_dq. Rows that see no key (lse = -inf) get P = 0,
// hence zero gradients, never NaN.
//
// Arithmetic: float16/bfloat16 are loaded as such and computed in float32; float32 in
// float32; float64 in double (to meet the 1e-12 tolerance). Shared-memory tiles hold the
// compute type (acc_t). Any Nq, Nk (partial tiles are zero-filled and masked).
//
// Compile-time specialisation (-D, built by cuflash/kernels.py from a cuflash.tiling plan,
// the same names as flash_fwd.cu):
//   CUFLASH_DTYPE_F16 | CUFLASH_DTYPE_BF16 | CUFLASH_DTYPE_F32 | CUFLASH_DTYPE_F64
//   CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q (Br), CUFLASH_BLOCK_KV (Bc)
//   CUFLASH_THREADS    threads per block (multiple of 32)
// Head-dim classes (as flash_fwd.cu): CUFLASH_HEAD_DIM(_V) are the capacities of the class of
// d and dv (cuflash.tiling); the call's own head dims arrive in BwdParams head_d, head_dv.
// Columns past d (dv) of the shared tiles are zero, so every product over the class width
// adds exact zeros and the loops keep their compile-time trip counts; the accumulators of
// the padding columns are computed (zero) and never stored.  Global rows (dq, dk, dv, the
// dQ accumulator) have d or dv elements.
// Shared memory per block (bytes, computed by cuflash/tiling.py from the same formula):
//   dkdv: sizeof(acc_t) * (Bc*(d+1) + Bc*(dv+1) + Br*(d+1) + Br*(dv+1) + 2*Br*Bc + 2*Br)
//   dq:   sizeof(acc_t) * (Br*(d+1) + Br*(dv+1) + Bc*(d+1) + Bc*(dv+1) +   Br*Bc + 2*Br)
// Rows are padded by one element so that the threads of a warp, which read one column of
// Kj/Vj each (K_s[c][k] for consecutive c), hit different banks.  That holds for 4-byte
// elements; with float64 the 16 lanes of a phase read 2-bank pairs (d + 1) pairs apart, and
// a few of the dot-product loops' reads are 2-way (under 3% of their wavefronts in the
// emulator's profile, bench/results/emulator_profile.md).
//
// Logit features (-DCUFLASH_MASKS, masks.cuh): flash_bwd_dkdv_masked and flash_bwd_dq_masked
// take the bias and ALiBi slopes (and dkdv the bias gradient) as well and recompute
//     s = softcap(scale Qi Kj^T) + bias + ALiBi, masked by causal and window;  P = exp(s - lse)
//     with dropout (the mask regenerated from the seed, philox.cuh):
//         dVj += (P * keep / (1-p))^T dOi,  dP = (dOi Vj^T) * keep / (1-p)
//     dS = P * (dP - D);  dbias += dS (dkdv only);  softcap: dS *= 1 - tanh^2 before dQ, dK.
// Q tiles (dkdv) and KV tiles (dq) outside the window's band are never loaded.  dbias is
// an acc_t array of the bias's shape addressed by mask_dbias_* strides (0 along the axes
// the bias is broadcast over): each element is stored once by the one block that computes
// it (mask_dbias = 1), or, for a broadcast bias, added with atomics (mask_dbias = 2; the
// summation order is then not fixed).  The preprocess and convert kernels are unchanged
// (compiled into the same module).
//
// Limits: SIMT (no tensor cores); head dims <= 256; the
// atomic dQ path's summation order is not fixed (deterministic=False only).

#include "dtype.cuh"
#include "params.cuh"
#ifdef CUFLASH_MASKS
#include "masks.cuh"
// the feature variants have their own names and three (dq: two) more pointer arguments
#define CUFLASH_BWD_KERNEL(name) name##_masked
#define CUFLASH_DKDV_MASK_ARGS , const acc_t* __restrict__ Bias, \
    const acc_t* __restrict__ Slopes, acc_t* __restrict__ dBias
#define CUFLASH_DQ_MASK_ARGS , const acc_t* __restrict__ Bias, const acc_t* __restrict__ Slopes
#else
#define CUFLASH_BWD_KERNEL(name) name
#define CUFLASH_DKDV_MASK_ARGS
#define CUFLASH_DQ_MASK_ARGS
#endif

#if !defined(CUFLASH_HEAD_DIM) || !defined(CUFLASH_HEAD_DIM_V) || \
    !defined(CUFLASH_BLOCK_Q) || !defined(CUFLASH_BLOCK_KV) || !defined(CUFLASH_THREADS)
#error "define CUFLASH_HEAD_DIM, CUFLASH_HEAD_DIM_V, CUFLASH_BLOCK_Q, CUFLASH_BLOCK_KV, CUFLASH_THREADS"
#endif
#define HEAD_DIM CUFLASH_HEAD_DIM
#define HEAD_DIM_V CUFLASH_HEAD_DIM_V
#define NUM_THREADS CUFLASH_THREADS
static_assert(NUM_THREADS % 32 == 0, "CUFLASH_THREADS must be a multiple of the warp size");
static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 256 && HEAD_DIM_V >= 1 && HEAD_DIM_V <= 256,
              "head dims 1..256");


#define Br CUFLASH_BLOCK_Q
#define Bc CUFLASH_BLOCK_KV
// padded row strides of the shared-memory tiles (see the bank note above)
#define DP (HEAD_DIM + 1)
#define DVP (HEAD_DIM_V + 1)
// elements each thread owns in a tile, rounded up
#define PER_THREAD(n) (((n) + NUM_THREADS - 1) / NUM_THREADS)

// Copy `rows` valid rows (of `n` <= cols elements, row stride `sr` elements in global
// memory) into a shared tile of `cols` columns with row stride `ld`; rows rows..R-1 and
// columns n..cols-1 are zero-filled so that partial tiles and the class padding add nothing.
// Consecutive threads read consecutive elements of a row: coalesced.  Where NUM_THREADS is
// a multiple of cols a thread's column is the same on every iteration (tid % cols), so the
// column test is loop-invariant (as flash_fwd.cu's col_of).
template <int R, int cols, int ld>
__device__ __forceinline__ void load_tile(acc_t* __restrict__ dst, const elem_t* __restrict__ src,
                                          long long sr, int rows, int n) {
    for (int e = threadIdx.x; e < R * cols; e += NUM_THREADS) {
        const int r = e / cols;
        const int c = NUM_THREADS % cols == 0 ? (int)threadIdx.x % cols : e - (e / cols) * cols;
        dst[r * ld + c] = r < rows && c < n ? to_acc(gload(src + r * sr + c)) : acc_t(0);
    }
}

// Element t (t < PER_THREAD(M * N)) of this thread in an (M, N) tile of per-thread
// accumulators: its row m and column j, and whether it exists (the last t of a tile that
// NUM_THREADS does not divide).  Where NUM_THREADS and N divide one another (head dims that
// are powers of two), element e = tid + t * NUM_THREADS is row-major: consecutive threads on
// consecutive columns, coalesced stores.  Otherwise (96, 160, 192, 224) it is column-major:
// M, a tile's rows (a power of two), divides NUM_THREADS, consecutive threads sit on
// consecutive rows and the stores of the finished tile are strided.  Either way a thread's
// offsets are compile-time steps from its first element (no index registers per element).
template <int M, int N>
__device__ __forceinline__ bool element_of(int t, int& m, int& j) {
    static_assert(NUM_THREADS % N == 0 || N % NUM_THREADS == 0 || NUM_THREADS % M == 0,
                  "a tile's rows divide the threads where its columns do not");
    // the steps, each 1 where its branch is not taken (no division by a zero constant)
    constexpr int kRowStep = NUM_THREADS % N == 0 ? NUM_THREADS / N : 1;
    constexpr int kPerRow = N % NUM_THREADS == 0 ? N / NUM_THREADS : 1;
    constexpr int kColStep = NUM_THREADS % M == 0 ? NUM_THREADS / M : 1;
    const int tid = threadIdx.x;
    if (NUM_THREADS % N == 0) {             // the thread's column fixed
        m = tid / N + t * kRowStep;
        j = tid % N;
        return M * N % NUM_THREADS == 0 || m < M;
    } else if (N % NUM_THREADS == 0) {      // N / NUM_THREADS elements per row
        m = t / kPerRow;
        j = tid + (t % kPerRow) * NUM_THREADS;
        return true;
    } else {
        m = tid % M;                        // the thread's row fixed
        j = tid / M + t * kColStep;
        return M * N % NUM_THREADS == 0 || j < N;
    }
}

// acc[t] += sum over k < n of A[k * a_k + m * a_m] * B[k * b_k + j] for the thread's elements
// (m, j) of an (M, N) result (element_of), adding each product to the running sum.  The
// summed index k runs outside and a thread's elements inside, so the runtime k loop exists
// once (a loop per element makes the kernels' code, and NVRTC's time, several times larger),
// and a thread's elements that share a row (column) share its load of A (B) per k:
// about one shared-memory load per FMA instead of two.  Shared-memory banks: row-major
// threads read B on consecutive words and A broadcast or on consecutive words; column-major
// threads read A[m * a_m] with m consecutive, which conflicts where a_m is a tile width
// (dQ's dS rows): one such load per k against PER_THREAD(M * N) conflict-free loads of B.
template <int M, int N, int a_k, int a_m, int b_k>
__device__ __forceinline__ void accumulate_products(acc_t* acc, const acc_t* __restrict__ A,
                                                    const acc_t* __restrict__ B, int n) {
#pragma unroll 1
    for (int k = 0; k < n; ++k) {
        const acc_t* Ak = A + k * a_k;
        const acc_t* Bk = B + k * b_k;
#pragma unroll
        for (int t = 0; t < PER_THREAD(M * N); ++t) {
            int m, j;
            if (element_of<M, N>(t, m, j)) acc[t] += Ak[m * a_m] * Bk[j];
        }
    }
}

// ---------------------------------------------------------------------------------------
// D = rowsum(dO * O). grid = ceil(Nq / rows_per_block) * H * B (folded); rows_per_block is a runtime
// multiple of PRE_ROWS (cuflash.tiling.BWD_PRE_ROWS on a GPU; one block per head on the
// emulator, where every block costs a thread start-up). The block walks its rows in
// chunks of PRE_ROWS: warp w reads rows w, w + warps, ... with its lanes on consecutive
// columns (coalesced) and leaves one partial sum per lane in red_s; after one barrier,
// thread r adds up the 32 partials of row r. (A shuffle tree per row would need 5 warp
// collectives per row instead of 2 barriers per 32 rows.)
// zero_dq != 0: the warps also zero these rows of the float32 dQ accumulator(s) (n_splits
// slices (B, H, Nq, d), dq_slice_stride apart), which the atomic path of flash_bwd_dkdv and
// both paths of flash_bwd_tf32 add into.
// Shared memory: sizeof(acc_t) * PRE_ROWS * 33.
#define PRE_ROWS 32
static_assert(NUM_THREADS >= PRE_ROWS, "one thread per row adds up the partial sums");
extern "C" __global__ void flash_bwd_preprocess(const elem_t* __restrict__ O,
                                                const elem_t* __restrict__ dO,
                                                acc_t* __restrict__ D,
                                                float* __restrict__ dq_accum_ws,
                                                const BwdParams* __restrict__ P) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* red_s = smem;                 // (PRE_ROWS, 33)  per-lane partial sums, padded
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const BwdParams& p = *P;
    const int Nq = p.Nq, rows_per_block = p.pre_rows, zero_dq = p.atomic_dq;
    const int d = p.head_d, dv = p.head_dv;
    const long long o_sr = p.o_sr, do_sr = p.do_sr;
    float* dq_accum = dq_accum_ws + p.dq_accum_offset;
    const FoldedIndex fi = cuflash_fold_decode(p.n_pre_tiles, p.H);
    const int h = fi.h, b = fi.b;
    const size_t bh = (size_t)b * p.H + h;
    const elem_t* Ob = O + b * p.o_sb + h * p.o_sh;
    const elem_t* dOb = dO + b * p.do_sb + h * p.do_sh;
    const int block_end = min(Nq, (fi.tile + 1) * rows_per_block);
    for (int i0 = fi.tile * rows_per_block; i0 < block_end; i0 += PRE_ROWS) {
        const int rows = min(PRE_ROWS, block_end - i0);
        for (int r = warp; r < rows; r += NUM_THREADS / 32) {
            const int i = i0 + r;
            acc_t part = 0;
            for (int c = lane; c < dv; c += 32)
                part += to_acc(gload(Ob + i * o_sr + c)) * to_acc(gload(dOb + i * do_sr + c));
            red_s[r * 33 + lane] = part;
            if (zero_dq)
                for (int sl = 0; sl < p.n_splits; ++sl)
                    for (int c = lane; c < d; c += 32)
                        gstore(dq_accum + sl * p.dq_slice_stride + (bh * Nq + i) * d + c, 0.0f);
        }
        __syncthreads();  // all partials of the chunk are in red_s
        if (tid < rows) {
            acc_t sum = 0;
            for (int l = 0; l < 32; ++l) sum += red_s[tid * 33 + l];
            gstore(D + bh * Nq + i0 + tid, sum);
        }
        __syncthreads();  // red_s read before the next chunk overwrites it
    }
}

// ---------------------------------------------------------------------------------------
// dK, dV (and, with atomic_dq, dQ by float32 atomics). grid = ceil(Nk/Bc) * Hk * B (folded).
extern "C" __global__ void CUFLASH_BWD_KERNEL(flash_bwd_dkdv)(const elem_t* __restrict__ Q,
                                          const elem_t* __restrict__ K,
                                          const elem_t* __restrict__ V,
                                          const elem_t* __restrict__ dO,
                                          const acc_t* __restrict__ LSE,
                                          const acc_t* __restrict__ D,
                                          elem_t* __restrict__ dK,
                                          elem_t* __restrict__ dV,
                                          float* __restrict__ dq_accum_ws,
                                          const BwdParams* __restrict__ P
                                          CUFLASH_DKDV_MASK_ARGS) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* K_s = smem;                   // (Bc, d+1)   Kj, resident
    acc_t* V_s = K_s + Bc * DP;          // (Bc, dv+1)  Vj, resident
    acc_t* Q_s = V_s + Bc * DVP;         // (Br, d+1)   Qi, streamed
    acc_t* dO_s = Q_s + Br * DP;         // (Br, dv+1)  dOi, streamed
    acc_t* P_s = dO_s + Br * DVP;        // (Br, Bc)    P of (Qi, Kj)
    acc_t* dS_s = P_s + Br * Bc;         // (Br, Bc)    dS of (Qi, Kj)
    acc_t* lse_s = dS_s + Br * Bc;       // (Br,)       lse_i
    acc_t* D_s = lse_s + Br;             // (Br,)       D_i

    const int tid = threadIdx.x;
    const BwdParams& p = *P;
    const int Nq = p.Nq, Nk = p.Nk, group = p.group, causal = p.causal;
    const int causal_offset = p.causal_offset;
    const long long q_sb = p.q_sb, q_sh = p.q_sh, q_sr = p.q_sr;
    const long long k_sb = p.k_sb, k_sh = p.k_sh, k_sr = p.k_sr;
    const long long v_sb = p.v_sb, v_sh = p.v_sh, v_sr = p.v_sr;
    const long long do_sb = p.do_sb, do_sh = p.do_sh, do_sr = p.do_sr;
    const acc_t scale = (acc_t)p.scale;
    const int atomic_dq = p.atomic_dq;
    float* dq_accum = dq_accum_ws + p.dq_accum_offset;
    const FoldedIndex fi = cuflash_fold_decode(p.n_kv_tiles, p.Hk);
    const int hk = fi.h, b = fi.b;
    const int Hk = p.Hk, H = p.H;
    const int kv0 = fi.tile * Bc;
    const int kv_rows = min(Bc, Nk - kv0);
    const int d = p.head_d, dv = p.head_dv;  // this call's head dims (<= HEAD_DIM, HEAD_DIM_V)

    load_tile<Bc, HEAD_DIM, DP>(K_s, K + b * k_sb + hk * k_sh + kv0 * k_sr, k_sr, kv_rows, d);
    load_tile<Bc, HEAD_DIM_V, DVP>(V_s, V + b * v_sb + hk * v_sh + kv0 * v_sr, v_sr, kv_rows, dv);
    // (K_s, V_s are first read after the barrier that follows the first Q-tile load)

    acc_t dk_acc[PER_THREAD(Bc * HEAD_DIM)];    // dKj elements tid, tid + NUM_THREADS, ...
    acc_t dv_acc[PER_THREAD(Bc * HEAD_DIM_V)];  // dVj elements likewise
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM); ++t) dk_acc[t] = 0;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM_V); ++t) dv_acc[t] = 0;

    // causal: the first query row that sees key kv0 is i = kv0 - causal_offset; Q tiles
    // before its tile are never loaded (all their P would be 0)
    int it0 = 0;
    if (causal) {
        const long long i_min = (long long)kv0 - causal_offset;
        it0 = i_min <= 0 ? 0 : (i_min >= Nq ? (Nq + Br - 1) / Br : (int)(i_min / Br));
    }
    int n_q_tiles = (Nq + Br - 1) / Br;
#ifdef CUFLASH_MASKS
    // the window: rows i with i + off + right < kv0 (band right of them) or
    // i + off - left > last key of the tile see nothing of this tile
    const BwdParams& prm = p;            // (the tile loops below name a probability p)
    const int moff = p.mask_offset;
    if (p.mask_window & CUFLASH_WINDOW_RIGHT) {
        const long long i_min = (long long)kv0 - moff - p.mask_window_right;
        const int t = i_min <= 0 ? 0 : (i_min >= Nq ? (Nq + Br - 1) / Br : (int)(i_min / Br));
        it0 = t > it0 ? t : it0;
    }
    if (p.mask_window & CUFLASH_WINDOW_LEFT) {
        const long long i_max = (long long)kv0 + kv_rows - 1 - moff + p.mask_window_left;
        const int t = i_max < 0 ? 0 : (i_max >= Nq ? n_q_tiles : (int)(i_max / Br) + 1);
        n_q_tiles = t < n_q_tiles ? t : n_q_tiles;
    }
    const DropoutKey drop = cuflash_dropout_key(p);
#endif

    for (int g = 0; g < group; ++g) {
        const int h = hk * group + g;    // query head of the GQA group
        const size_t bh = (size_t)b * H + h;
        const elem_t* Qb = Q + b * q_sb + h * q_sh;
        const elem_t* dOb = dO + b * do_sb + h * do_sh;
#ifdef CUFLASH_MASKS
        const MaskRow mhead = cuflash_mask_row(p, Bias, Slopes, b, h, 0, moff);  // row 0 of head h
        acc_t* dBias_h = dBias + b * p.mask_dbias_sb + h * p.mask_dbias_sh;
#endif
        for (int it = it0; it < n_q_tiles; ++it) {
            const int q0 = it * Br;
            const int q_rows = min(Br, Nq - q0);
            load_tile<Br, HEAD_DIM, DP>(Q_s, Qb + q0 * q_sr, q_sr, q_rows, d);
            load_tile<Br, HEAD_DIM_V, DVP>(dO_s, dOb + q0 * do_sr, do_sr, q_rows, dv);
            for (int r = tid; r < Br; r += NUM_THREADS) {
                lse_s[r] = r < q_rows ? gload(LSE + bh * Nq + q0 + r) : acc_t(0);
                D_s[r] = r < q_rows ? gload(D + bh * Nq + q0 + r) : acc_t(0);
            }
            __syncthreads();  // Qi, dOi, lse_i, D_i (and, on the first pass, Kj, Vj) are in smem

            // -- recompute P = exp(scale * Qi Kj^T - lse_i) and dS = P * (dOi Vj^T - D_i)
            for (int e = tid; e < Br * Bc; e += NUM_THREADS) {
                const int r = e / Bc, c = e - (e / Bc) * Bc;
                bool visible = r < q_rows && c < kv_rows &&
                               (!causal || kv0 + c <= q0 + r + causal_offset);
#ifdef CUFLASH_MASKS
                int lo = 0, hi = Nk;
                if (visible) {
                    cuflash_window_range(prm, q0 + r, moff, Nk, Nk, lo, hi);
                    visible = kv0 + c >= lo && kv0 + c < hi;
                }
#endif
                acc_t p = 0, ds = 0;
                // lse = -inf only for rows that see no key: P = 0 there, not exp(inf) = NaN
                if (visible && lse_s[r] != acc_t(-INFINITY)) {
                    acc_t s = 0, dp = 0;
#pragma unroll 8
                    for (int kk = 0; kk < HEAD_DIM; ++kk) s += Q_s[r * DP + kk] * K_s[c * DP + kk];
#pragma unroll 8
                    for (int kk = 0; kk < HEAD_DIM_V; ++kk) dp += dO_s[r * DVP + kk] * V_s[c * DVP + kk];
#ifdef CUFLASH_MASKS
                    const int i = q0 + r, j = kv0 + c;
                    MaskRow mr = mhead;          // this row of head h
                    if (mr.bias != nullptr) mr.bias += (long long)i * prm.mask_bias_sr;
                    mr.pos += i;
                    acc_t th;
                    p = acc_exp(mr.logit(scale * s, j, th) - lse_s[r]);
                    acc_t pd = p;                // P with dropout applied (for dV)
                    if (drop.on) {
                        const bool keep = cuflash_dropout_keep(drop.k0, drop.k1, drop.threshold,
                                                               b + prm.mask_drop_b0, h, i, j);
                        pd = keep ? p * drop.scale : acc_t(0);
                        dp = keep ? dp * drop.scale : acc_t(0);
                    }
                    ds = p * (dp - D_s[r]);
                    if (prm.mask_dbias == 1) {   // this block is the element's only writer
                        gstore(dBias_h + i * prm.mask_dbias_sr + j * prm.mask_dbias_sc, ds);
                    } else if (prm.mask_dbias == 2) {
                        gatomic_add(dBias_h + i * prm.mask_dbias_sr + j * prm.mask_dbias_sc, ds);
                    }
                    if (mr.cap != acc_t(0)) ds *= acc_t(1) - th * th;   // d softcap / d s
                    p = pd;
#else
                    p = acc_exp(scale * s - lse_s[r]);
                    ds = p * (dp - D_s[r]);
#endif
                }
                P_s[e] = p;
                dS_s[e] = ds;
            }
            __syncthreads();  // P_s, dS_s complete before the transposed products read them

            // -- dVj += P^T dOi ; dKj += dS^T Qi (scale applied once, at the end); rows past
            //    q_rows hold zeros and are skipped
            accumulate_products<Bc, HEAD_DIM_V, Bc, 1, DVP>(dv_acc, P_s, dO_s, q_rows);
            accumulate_products<Bc, HEAD_DIM, Bc, 1, DP>(dk_acc, dS_s, Q_s, q_rows);
            // -- dQi += scale * dS Kj by float32 atomics (summation order not fixed)
            if (atomic_dq) {
                for (int e = tid; e < q_rows * HEAD_DIM; e += NUM_THREADS) {
                    const int r = e / HEAD_DIM, kk = e - (e / HEAD_DIM) * HEAD_DIM;
                    if (kk >= d) continue;   // the class padding: no dQ column there
                    acc_t acc = 0;
                    for (int c = 0; c < kv_rows; ++c) acc += dS_s[r * Bc + c] * K_s[c * DP + kk];
                    gatomic_add(dq_accum + (bh * Nq + q0 + r) * d + kk, (float)(scale * acc));
                }
            }
            __syncthreads();  // all reads of Q_s, dO_s, P_s, dS_s done before the next tile overwrites them
        }
    }

    // -- write dKj = scale * sum dS^T Q and dVj (rows past Nk and the class padding are not
    //    written; global rows have d and dv elements)
    const size_t bhk = (size_t)b * Hk + hk;
    elem_t* dk_tile = dK + (bhk * Nk + kv0) * d;
    elem_t* dv_tile = dV + (bhk * Nk + kv0) * dv;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM); ++t) {
        int c, kk;
        if (element_of<Bc, HEAD_DIM>(t, c, kk) && c < kv_rows && kk < d)
            gstore(dk_tile + c * d + kk, from_acc(scale * dk_acc[t]));
    }
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM_V); ++t) {
        int c, kk;
        if (element_of<Bc, HEAD_DIM_V>(t, c, kk) && c < kv_rows && kk < dv)
            gstore(dv_tile + c * dv + kk, from_acc(dv_acc[t]));
    }
}

// ---------------------------------------------------------------------------------------
// Deterministic dQ: grid = ceil(Nq/Br) * H * B (folded). Qi, dOi resident; Kj, Vj streamed.
extern "C" __global__ void CUFLASH_BWD_KERNEL(flash_bwd_dq)(const elem_t* __restrict__ Q,
                                        const elem_t* __restrict__ K,
                                        const elem_t* __restrict__ V,
                                        const elem_t* __restrict__ dO,
                                        const acc_t* __restrict__ LSE,
                                        const acc_t* __restrict__ D,
                                        elem_t* __restrict__ dQ,
                                        const BwdParams* __restrict__ P
                                        CUFLASH_DQ_MASK_ARGS) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* Q_s = smem;                   // (Br, d+1)   Qi, resident
    acc_t* dO_s = Q_s + Br * DP;         // (Br, dv+1)  dOi, resident
    acc_t* K_s = dO_s + Br * DVP;        // (Bc, d+1)   Kj, streamed
    acc_t* V_s = K_s + Bc * DP;          // (Bc, dv+1)  Vj, streamed
    acc_t* dS_s = V_s + Bc * DVP;        // (Br, Bc)    dS of (Qi, Kj)
    acc_t* lse_s = dS_s + Br * Bc;       // (Br,)       lse_i
    acc_t* D_s = lse_s + Br;             // (Br,)       D_i

    const int tid = threadIdx.x;
    const BwdParams& p = *P;
    const int Nq = p.Nq, Nk = p.Nk, group = p.group, causal = p.causal;
    const int causal_offset = p.causal_offset;
    const long long q_sb = p.q_sb, q_sh = p.q_sh, q_sr = p.q_sr;
    const long long k_sb = p.k_sb, k_sh = p.k_sh, k_sr = p.k_sr;
    const long long v_sb = p.v_sb, v_sh = p.v_sh, v_sr = p.v_sr;
    const long long do_sb = p.do_sb, do_sh = p.do_sh, do_sr = p.do_sr;
    const acc_t scale = (acc_t)p.scale;
    const FoldedIndex fi = cuflash_fold_decode(p.n_q_tiles, p.H);
    const int h = fi.h, b = fi.b;
    const int hk = h / group;            // grouped-query: kv head of query head h
    const size_t bh = (size_t)b * p.H + h;
    const int q0 = fi.tile * Br;
    const int q_rows = min(Br, Nq - q0);
    const elem_t* Kb = K + b * k_sb + hk * k_sh;
    const elem_t* Vb = V + b * v_sb + hk * v_sh;
    const int d = p.head_d, dv = p.head_dv;  // this call's head dims (<= HEAD_DIM, HEAD_DIM_V)

    load_tile<Br, HEAD_DIM, DP>(Q_s, Q + b * q_sb + h * q_sh + q0 * q_sr, q_sr, q_rows, d);
    load_tile<Br, HEAD_DIM_V, DVP>(dO_s, dO + b * do_sb + h * do_sh + q0 * do_sr, do_sr, q_rows, dv);
    for (int r = tid; r < Br; r += NUM_THREADS) {
        lse_s[r] = r < q_rows ? gload(LSE + bh * Nq + q0 + r) : acc_t(0);
        D_s[r] = r < q_rows ? gload(D + bh * Nq + q0 + r) : acc_t(0);
    }
    // (first read after the barrier that follows the first K/V load)

    acc_t dq_acc[PER_THREAD(Br * HEAD_DIM)];  // dQi elements tid, tid + NUM_THREADS, ...
#pragma unroll
    for (int t = 0; t < PER_THREAD(Br * HEAD_DIM); ++t) dq_acc[t] = 0;

    // causal: keys this tile can see are j <= (q0 + q_rows - 1) + causal_offset; KV tiles
    // past them are never loaded
    int kv_end = Nk;
    if (causal) {
        const long long last = (long long)q0 + q_rows + causal_offset;
        kv_end = (int)(last < 0 ? 0 : (last > Nk ? Nk : last));
    }
    int jt0 = 0;
#ifdef CUFLASH_MASKS
    // the window: keys left of the first row's band and right of the last row's are never
    // loaded ([lo, hi) grow with the row: their union is [lo_first, hi_last))
    const BwdParams& prm = p;
    const int moff = p.mask_offset;
    if (p.mask_window && q_rows > 0) {
        int lo, hi, lo2, hi2;
        cuflash_window_range(p, q0, moff, Nk, kv_end, lo, hi);
        cuflash_window_range(p, q0 + q_rows - 1, moff, Nk, kv_end, lo2, hi2);
        jt0 = hi2 > lo ? lo / Bc : 0;
        kv_end = hi2 > lo ? hi2 : 0;
    }
    const MaskRow mhead = cuflash_mask_row(p, Bias, Slopes, b, h, 0, moff);
    const DropoutKey drop = cuflash_dropout_key(p);
#endif
    const int n_kv_tiles = (kv_end + Bc - 1) / Bc;

    for (int jt = jt0; jt < n_kv_tiles; ++jt) {
        const int kv0 = jt * Bc;
        const int kv_rows = min(Bc, Nk - kv0);
        load_tile<Bc, HEAD_DIM, DP>(K_s, Kb + kv0 * k_sr, k_sr, kv_rows, d);
        load_tile<Bc, HEAD_DIM_V, DVP>(V_s, Vb + kv0 * v_sr, v_sr, kv_rows, dv);
        __syncthreads();  // Kj, Vj (and, on the first pass, Qi, dOi, lse_i, D_i) are in smem

        // -- recompute P and dS = P * (dOi Vj^T - D_i) for this (Qi, Kj) tile
        for (int e = tid; e < Br * Bc; e += NUM_THREADS) {
            const int r = e / Bc, c = e - (e / Bc) * Bc;
            bool visible = r < q_rows && c < kv_rows &&
                           (!causal || kv0 + c <= q0 + r + causal_offset);
#ifdef CUFLASH_MASKS
            if (visible) {
                int lo, hi;
                cuflash_window_range(prm, q0 + r, moff, Nk, Nk, lo, hi);
                visible = kv0 + c >= lo && kv0 + c < hi;
            }
#endif
            acc_t ds = 0;
            if (visible && lse_s[r] != acc_t(-INFINITY)) {
                acc_t s = 0, dp = 0;
#pragma unroll 8
                for (int kk = 0; kk < HEAD_DIM; ++kk) s += Q_s[r * DP + kk] * K_s[c * DP + kk];
#pragma unroll 8
                for (int kk = 0; kk < HEAD_DIM_V; ++kk) dp += dO_s[r * DVP + kk] * V_s[c * DVP + kk];
#ifdef CUFLASH_MASKS
                const int i = q0 + r, j = kv0 + c;
                MaskRow mr = mhead;
                if (mr.bias != nullptr) mr.bias += (long long)i * prm.mask_bias_sr;
                mr.pos += i;
                acc_t th;
                const acc_t p = acc_exp(mr.logit(scale * s, j, th) - lse_s[r]);
                if (drop.on)
                    dp = cuflash_dropout_keep(drop.k0, drop.k1, drop.threshold,
                                              b + prm.mask_drop_b0, h, i, j)
                             ? dp * drop.scale : acc_t(0);
                ds = p * (dp - D_s[r]);
                if (mr.cap != acc_t(0)) ds *= acc_t(1) - th * th;
#else
                const acc_t p = acc_exp(scale * s - lse_s[r]);
                ds = p * (dp - D_s[r]);
#endif
            }
            dS_s[e] = ds;
        }
        __syncthreads();  // dS_s complete before dS Kj reads it

        // -- dQi += dS Kj (scale applied once, at the end)
        accumulate_products<Br, HEAD_DIM, 1, Bc, DP>(dq_acc, dS_s, K_s, kv_rows);
        __syncthreads();  // reads of K_s, V_s, dS_s done before the next Kj, Vj overwrite them
    }

    elem_t* dq_tile = dQ + (bh * Nq + q0) * d;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Br * HEAD_DIM); ++t) {
        int r, kk;
        if (element_of<Br, HEAD_DIM>(t, r, kk) && r < q_rows && kk < d)
            gstore(dq_tile + r * d + kk, from_acc(scale * dq_acc[t]));
    }
}

// ---------------------------------------------------------------------------------------
// Accumulator path, last step: dq = the sum of the n_splits accumulator slices, in order 0,
// 1, ... (deterministic when each slice is), in the input dtype (grid-stride, coalesced).
extern "C" __global__ void flash_bwd_dq_convert(const float* __restrict__ dq_accum_ws,
                                                elem_t* __restrict__ dQ,
                                                const BwdParams* __restrict__ P) {
    const float* dq_accum = dq_accum_ws + P->dq_accum_offset;
    const long long n = P->n_convert, stride = P->dq_slice_stride;
    const int n_splits = P->n_splits;
    for (long long e = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; e < n;
         e += (long long)gridDim.x * NUM_THREADS) {
        float x = gload(dq_accum + e);
        for (int sl = 1; sl < n_splits; ++sl) x += gload(dq_accum + sl * stride + e);
        gstore(dQ + e, from_acc((acc_t)x));
    }
}

// flash_bwd.cu - FlashAttention-2 backward: dQ, dK, dV from dO, Q, K, V, O and lse.
//
// What it computes (docs/api.md, tiled_attention_backward), for every query head
// problem with P = softmax(scale * Q K^T [masked]) (never stored):
//     dV = P^T dO              dP = dO V^T
//     D  = rowsum(dO * O)      dS = P * (dP - D)        (softmax backward, seed 004 step 1)
//     dQ = scale * dS K        dK = scale * dS^T Q
// P is recomputed tile by tile from the forward's log-sum-exp: P = exp(scale*S - lse)
// (seed 004 step 0), so no (Nq, Nk) array exists anywhere.
//
// Kernels (one launch each, in this order):
//   flash_bwd_preprocess  D = rowsum(dO * O), one warp per row (lanes read the row
//                         coalesced, a shuffle tree sums it); optionally zeroes the float32
//                         dQ accumulator of the atomic path.
//   flash_bwd_dkdv        one block per (KV tile j, kv head): Kj, Vj resident in shared
//                         memory, Qi/dOi/lse_i/D_i streamed for every query head of the GQA
//                         group and every Q tile that can see Kj; dKj, dVj accumulate in
//                         registers and are written once -> deterministic, no atomics.
//                         With ATOMIC_DQ it also adds scale * dS Kj into a float32 dQ
//                         accumulator with atomics (seed 004, last line).
//   flash_bwd_dq          deterministic dQ: one block per (Q tile i, query head): Qi, dOi
//                         resident, Kj/Vj streamed, dQi accumulated in registers.
//   flash_bwd_dq_convert  float32 dQ accumulator -> dQ in the input dtype (atomic path).
// The launcher (cuflash/_launch_bwd.py) runs flash_bwd_dq when deterministic=True and for
// float64 (there is no double gatomic_add), and the atomic path otherwise.
//
// Notation as in cuflash.reference and flash_fwd.cu: Br = BLOCK_Q rows of Q per tile,
// Bc = BLOCK_KV rows of K/V per tile, Qi, Kj, Vj tiles, lse, D.
//
// Layout: every tensor is C-contiguous with the leading dims flattened by the launcher:
//   q, do, o : (B*H, Nq, d|dv)   k, v : (B*Hk, Nk, d|dv)   lse, D : (B*H, Nq)
// Query head (b, h) reads kv head (b, h / group), H = Hk * group (grouped-query attention
// by index arithmetic, no K/V copies). Broadcast batch dims are materialised by the
// launcher and dK/dV/dQ summed back over them on the host (xp.sum); heads of a GQA group
// are summed here, inside the dkdv block.
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
// Compile-time specialisation (-D, set by cuflash/tiling.py through the launcher):
//   CUFLASH_DTYPE      1 float16, 2 bfloat16, 3 float32, 4 float64
//   HEAD_DIM, HEAD_DIM_V   d and dv (<= 256 each)
//   BLOCK_Q, BLOCK_KV  Br, Bc
//   NUM_THREADS        threads per block (multiple of 32)
// Shared memory per block (bytes, computed by cuflash/tiling.py from the same formula):
//   dkdv: sizeof(acc_t) * (Bc*(d+1) + Bc*(dv+1) + Br*(d+1) + Br*(dv+1) + 2*Br*Bc + 2*Br)
//   dq:   sizeof(acc_t) * (Br*(d+1) + Br*(dv+1) + Bc*(d+1) + Bc*(dv+1) +   Br*Bc + 2*Br)
// Rows are padded by one element so that the threads of a warp, which read one column of
// Kj/Vj each (K_s[c][k] for consecutive c), hit different banks.
//
// Limits: SIMT (no tensor cores); head dims <= 256; grid.y (tiles) <= 65535, i.e.
// N <= 65535 * tile; the atomic dQ path's summation order is not fixed (deterministic=False).

#include "portable.cuh"

#ifndef CUFLASH_DTYPE
#error "CUFLASH_DTYPE must be defined (1 float16, 2 bfloat16, 3 float32, 4 float64)"
#endif
#if !defined(HEAD_DIM) || !defined(HEAD_DIM_V) || !defined(BLOCK_Q) || !defined(BLOCK_KV)
#error "HEAD_DIM, HEAD_DIM_V, BLOCK_Q and BLOCK_KV must be defined"
#endif
#ifndef NUM_THREADS
#define NUM_THREADS 128
#endif
#if NUM_THREADS % 32 != 0
#error "NUM_THREADS must be a multiple of the warp size"
#endif

// ---- storage type (scalar_t) and compute type (acc_t) ---------------------------------
#if CUFLASH_DTYPE == 1
typedef __half scalar_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(scalar_t x) { return __half2float(x); }
__device__ __forceinline__ scalar_t from_acc(acc_t x) { return __float2half(x); }
#elif CUFLASH_DTYPE == 2
typedef __nv_bfloat16 scalar_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(scalar_t x) { return __bfloat162float(x); }
__device__ __forceinline__ scalar_t from_acc(acc_t x) { return __float2bfloat16(x); }
#elif CUFLASH_DTYPE == 3
typedef float scalar_t;
typedef float acc_t;
__device__ __forceinline__ acc_t to_acc(scalar_t x) { return x; }
__device__ __forceinline__ scalar_t from_acc(acc_t x) { return x; }
#elif CUFLASH_DTYPE == 4
typedef double scalar_t;
typedef double acc_t;
__device__ __forceinline__ acc_t to_acc(scalar_t x) { return x; }
__device__ __forceinline__ scalar_t from_acc(acc_t x) { return x; }
#else
#error "unknown CUFLASH_DTYPE"
#endif

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }

#define Br BLOCK_Q
#define Bc BLOCK_KV
// padded row strides of the shared-memory tiles (see the bank note above)
#define DP (HEAD_DIM + 1)
#define DVP (HEAD_DIM_V + 1)
// elements each thread owns in a tile, rounded up
#define PER_THREAD(n) (((n) + NUM_THREADS - 1) / NUM_THREADS)

// Copy `rows` valid rows (of `cols` elements, row stride `cols` in global memory) into a
// shared tile with row stride `ld`; rows rows..R-1 are zero-filled so that partial tiles
// add nothing. Consecutive threads read consecutive elements: coalesced.
template <int R, int cols, int ld>
__device__ __forceinline__ void load_tile(acc_t* __restrict__ dst, const scalar_t* __restrict__ src,
                                          int rows) {
    for (int e = threadIdx.x; e < R * cols; e += NUM_THREADS) {
        const int r = e / cols, c = e - (e / cols) * cols;
        dst[r * ld + c] = r < rows ? to_acc(gload(src + (size_t)r * cols + c)) : acc_t(0);
    }
}

// ---------------------------------------------------------------------------------------
// D = rowsum(dO * O) for n_rows rows of HEAD_DIM_V elements; one warp per row.
// zero_dq != 0: also zero the float32 dQ accumulator (n_rows x HEAD_DIM), which the atomic
// path of flash_bwd_dkdv adds into.
extern "C" __global__ void flash_bwd_preprocess(const scalar_t* __restrict__ o,
                                                const scalar_t* __restrict__ dO,
                                                acc_t* __restrict__ D,
                                                float* __restrict__ dq_accum,
                                                long long n_rows, int zero_dq) {
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = NUM_THREADS / 32;
    const long long total_warps = (long long)gridDim.x * warps_per_block;
    for (long long row = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
         row < n_rows; row += total_warps) {
        const scalar_t* o_row = o + row * HEAD_DIM_V;
        const scalar_t* do_row = dO + row * HEAD_DIM_V;
        acc_t sum = 0;
        for (int c = lane; c < HEAD_DIM_V; c += 32)
            sum += to_acc(gload(o_row + c)) * to_acc(gload(do_row + c));
        // butterfly: after it every lane holds the row sum
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) gstore(D + row, sum);
        if (zero_dq)
            for (int c = lane; c < HEAD_DIM; c += 32) gstore(dq_accum + row * HEAD_DIM + c, 0.0f);
    }
}

// ---------------------------------------------------------------------------------------
// dK, dV (and, with atomic_dq, dQ by float32 atomics). grid = (B*Hk, ceil(Nk/Bc)).
extern "C" __global__ void flash_bwd_dkdv(const scalar_t* __restrict__ q,
                                          const scalar_t* __restrict__ k,
                                          const scalar_t* __restrict__ v,
                                          const scalar_t* __restrict__ dO,
                                          const acc_t* __restrict__ lse,
                                          const acc_t* __restrict__ D,
                                          scalar_t* __restrict__ dk,
                                          scalar_t* __restrict__ dv,
                                          float* __restrict__ dq_accum,
                                          int Nq, int Nk, int Hk, int group, acc_t scale,
                                          int causal, int causal_offset, int atomic_dq) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* K_s = smem;                   // (Bc, d+1)   Kj
    acc_t* V_s = K_s + Bc * DP;          // (Bc, dv+1)  Vj
    acc_t* Q_s = V_s + Bc * DVP;         // (Br, d+1)   Qi
    acc_t* dO_s = Q_s + Br * DP;         // (Br, dv+1)  dOi
    acc_t* P_s = dO_s + Br * DVP;        // (Br, Bc)    P of (Qi, Kj)
    acc_t* dS_s = P_s + Br * Bc;         // (Br, Bc)    dS of (Qi, Kj)
    acc_t* lse_s = dS_s + Br * Bc;       // (Br,)
    acc_t* D_s = lse_s + Br;             // (Br,)

    const int tid = threadIdx.x;
    const int bk = blockIdx.x;           // b * Hk + hk
    const int b = bk / Hk, hk = bk - (bk / Hk) * Hk;
    const int H = Hk * group;
    const int kv0 = blockIdx.y * Bc;
    const int kv_rows = min(Bc, Nk - kv0);

    load_tile<Bc, HEAD_DIM, DP>(K_s, k + ((size_t)bk * Nk + kv0) * HEAD_DIM, kv_rows);
    load_tile<Bc, HEAD_DIM_V, DVP>(V_s, v + ((size_t)bk * Nk + kv0) * HEAD_DIM_V, kv_rows);
    // (K_s, V_s are first read after the barrier that follows the first Q-tile load)

    acc_t dk_acc[PER_THREAD(Bc * HEAD_DIM)];
    acc_t dv_acc[PER_THREAD(Bc * HEAD_DIM_V)];
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM); ++t) dk_acc[t] = 0;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM_V); ++t) dv_acc[t] = 0;

    // first query row that sees key kv0: i + causal_offset >= kv0; earlier Q tiles are skipped
    int i_tile0 = 0;
    if (causal) {
        const int i_min = kv0 - causal_offset;
        i_tile0 = i_min <= 0 ? 0 : (i_min >= Nq ? (Nq + Br - 1) / Br : i_min / Br);
    }
    const int n_q_tiles = (Nq + Br - 1) / Br;

    for (int g = 0; g < group; ++g) {
        const size_t bq = (size_t)b * H + (size_t)hk * group + g;  // query head (b, h)
        for (int it = i_tile0; it < n_q_tiles; ++it) {
            const int q0 = it * Br;
            const int q_rows = min(Br, Nq - q0);
            load_tile<Br, HEAD_DIM, DP>(Q_s, q + (bq * Nq + q0) * HEAD_DIM, q_rows);
            load_tile<Br, HEAD_DIM_V, DVP>(dO_s, dO + (bq * Nq + q0) * HEAD_DIM_V, q_rows);
            for (int r = tid; r < Br; r += NUM_THREADS) {
                lse_s[r] = r < q_rows ? gload(lse + bq * Nq + q0 + r) : acc_t(0);
                D_s[r] = r < q_rows ? gload(D + bq * Nq + q0 + r) : acc_t(0);
            }
            __syncthreads();  // Qi, dOi, lse_i, D_i (and, on the first pass, Kj, Vj) are in smem

            // -- recompute P = exp(scale * Qi Kj^T - lse) and dS = P * (dOi Vj^T - D)
            for (int e = tid; e < Br * Bc; e += NUM_THREADS) {
                const int r = e / Bc, c = e - (e / Bc) * Bc;
                const bool visible = r < q_rows && c < kv_rows &&
                                     (!causal || kv0 + c <= q0 + r + causal_offset);
                acc_t p = 0, ds = 0;
                // lse = -inf only for rows that see no key: P = 0 there, not exp(inf) = NaN
                if (visible && lse_s[r] != -INFINITY) {
                    acc_t s = 0, dp = 0;
#pragma unroll 8
                    for (int kk = 0; kk < HEAD_DIM; ++kk) s += Q_s[r * DP + kk] * K_s[c * DP + kk];
#pragma unroll 8
                    for (int kk = 0; kk < HEAD_DIM_V; ++kk) dp += dO_s[r * DVP + kk] * V_s[c * DVP + kk];
                    p = acc_exp(scale * s - lse_s[r]);
                    ds = p * (dp - D_s[r]);
                }
                P_s[e] = p;
                dS_s[e] = ds;
            }
            __syncthreads();  // P_s, dS_s complete before the transposed products read them

            // -- dVj += P^T dOi ; dKj += dS^T Qi (scale applied at the end)
#pragma unroll
            for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM_V); ++t) {
                const int e = tid + t * NUM_THREADS;
                if (e < Bc * HEAD_DIM_V) {
                    const int c = e / HEAD_DIM_V, kk = e - (e / HEAD_DIM_V) * HEAD_DIM_V;
                    acc_t acc = 0;
                    for (int r = 0; r < q_rows; ++r) acc += P_s[r * Bc + c] * dO_s[r * DVP + kk];
                    dv_acc[t] += acc;
                }
            }
#pragma unroll
            for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM); ++t) {
                const int e = tid + t * NUM_THREADS;
                if (e < Bc * HEAD_DIM) {
                    const int c = e / HEAD_DIM, kk = e - (e / HEAD_DIM) * HEAD_DIM;
                    acc_t acc = 0;
                    for (int r = 0; r < q_rows; ++r) acc += dS_s[r * Bc + c] * Q_s[r * DP + kk];
                    dk_acc[t] += acc;
                }
            }
            // -- dQi += scale * dS Kj, float32 atomics (non-deterministic order)
            if (atomic_dq) {
                for (int e = tid; e < q_rows * HEAD_DIM; e += NUM_THREADS) {
                    const int r = e / HEAD_DIM, kk = e - (e / HEAD_DIM) * HEAD_DIM;
                    acc_t acc = 0;
                    for (int c = 0; c < kv_rows; ++c) acc += dS_s[r * Bc + c] * K_s[c * DP + kk];
                    gatomic_add(dq_accum + (bq * Nq + q0 + r) * HEAD_DIM + kk, (float)(scale * acc));
                }
            }
            __syncthreads();  // every read of Q_s, dO_s, P_s, dS_s done before the next tile overwrites them
        }
    }

    // -- write dKj = scale * dS^T Q, dVj (rows past Nk are not written)
    scalar_t* dk_tile = dk + ((size_t)bk * Nk + kv0) * HEAD_DIM;
    scalar_t* dv_tile = dv + ((size_t)bk * Nk + kv0) * HEAD_DIM_V;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM); ++t) {
        const int e = tid + t * NUM_THREADS;
        if (e < kv_rows * HEAD_DIM) gstore(dk_tile + e, from_acc(scale * dk_acc[t]));
    }
#pragma unroll
    for (int t = 0; t < PER_THREAD(Bc * HEAD_DIM_V); ++t) {
        const int e = tid + t * NUM_THREADS;
        if (e < kv_rows * HEAD_DIM_V) gstore(dv_tile + e, from_acc(dv_acc[t]));
    }
}

// ---------------------------------------------------------------------------------------
// Deterministic dQ: grid = (B*H, ceil(Nq/Br)). Qi, dOi resident; Kj, Vj streamed.
extern "C" __global__ void flash_bwd_dq(const scalar_t* __restrict__ q,
                                        const scalar_t* __restrict__ k,
                                        const scalar_t* __restrict__ v,
                                        const scalar_t* __restrict__ dO,
                                        const acc_t* __restrict__ lse,
                                        const acc_t* __restrict__ D,
                                        scalar_t* __restrict__ dq,
                                        int Nq, int Nk, int Hk, int group, acc_t scale,
                                        int causal, int causal_offset) {
    CUFLASH_DYNAMIC_SHARED(acc_t, smem);
    acc_t* Q_s = smem;                   // (Br, d+1)   Qi
    acc_t* dO_s = Q_s + Br * DP;         // (Br, dv+1)  dOi
    acc_t* K_s = dO_s + Br * DVP;        // (Bc, d+1)   Kj
    acc_t* V_s = K_s + Bc * DP;          // (Bc, dv+1)  Vj
    acc_t* dS_s = V_s + Bc * DVP;        // (Br, Bc)    dS of (Qi, Kj)
    acc_t* lse_s = dS_s + Br * Bc;       // (Br,)
    acc_t* D_s = lse_s + Br;             // (Br,)

    const int tid = threadIdx.x;
    const size_t bq = blockIdx.x;        // b * H + h
    const int H = Hk * group;
    const int b = (int)(bq / H), h = (int)(bq - (bq / H) * H);
    const size_t bk = (size_t)b * Hk + h / group;
    const int q0 = blockIdx.y * Br;
    const int q_rows = min(Br, Nq - q0);

    load_tile<Br, HEAD_DIM, DP>(Q_s, q + (bq * Nq + q0) * HEAD_DIM, q_rows);
    load_tile<Br, HEAD_DIM_V, DVP>(dO_s, dO + (bq * Nq + q0) * HEAD_DIM_V, q_rows);
    for (int r = tid; r < Br; r += NUM_THREADS) {
        lse_s[r] = r < q_rows ? gload(lse + bq * Nq + q0 + r) : acc_t(0);
        D_s[r] = r < q_rows ? gload(D + bq * Nq + q0 + r) : acc_t(0);
    }
    // (read after the barrier that follows the first K/V load)

    acc_t dq_acc[PER_THREAD(Br * HEAD_DIM)];
#pragma unroll
    for (int t = 0; t < PER_THREAD(Br * HEAD_DIM); ++t) dq_acc[t] = 0;

    // keys this tile can see: j <= (q0 + q_rows - 1) + causal_offset; later KV tiles skipped
    int kv_end = Nk;
    if (causal) kv_end = max(0, min(Nk, q0 + q_rows + causal_offset));
    const int n_kv_tiles = (kv_end + Bc - 1) / Bc;

    for (int jt = 0; jt < n_kv_tiles; ++jt) {
        const int kv0 = jt * Bc;
        const int kv_rows = min(Bc, Nk - kv0);
        load_tile<Bc, HEAD_DIM, DP>(K_s, k + (bk * Nk + kv0) * HEAD_DIM, kv_rows);
        load_tile<Bc, HEAD_DIM_V, DVP>(V_s, v + (bk * Nk + kv0) * HEAD_DIM_V, kv_rows);
        __syncthreads();  // Kj, Vj (and, on the first pass, Qi, dOi, lse_i, D_i) are in smem

        // -- recompute P and dS = P * (dOi Vj^T - D) for this (Qi, Kj) tile
        for (int e = tid; e < Br * Bc; e += NUM_THREADS) {
            const int r = e / Bc, c = e - (e / Bc) * Bc;
            const bool visible = r < q_rows && c < kv_rows &&
                                 (!causal || kv0 + c <= q0 + r + causal_offset);
            acc_t ds = 0;
            if (visible && lse_s[r] != -INFINITY) {
                acc_t s = 0, dp = 0;
#pragma unroll 8
                for (int kk = 0; kk < HEAD_DIM; ++kk) s += Q_s[r * DP + kk] * K_s[c * DP + kk];
#pragma unroll 8
                for (int kk = 0; kk < HEAD_DIM_V; ++kk) dp += dO_s[r * DVP + kk] * V_s[c * DVP + kk];
                const acc_t p = acc_exp(scale * s - lse_s[r]);
                ds = p * (dp - D_s[r]);
            }
            dS_s[e] = ds;
        }
        __syncthreads();  // dS_s complete before dS Kj reads it

        // -- dQi += dS Kj (scale applied at the end)
#pragma unroll
        for (int t = 0; t < PER_THREAD(Br * HEAD_DIM); ++t) {
            const int e = tid + t * NUM_THREADS;
            if (e < Br * HEAD_DIM) {
                const int r = e / HEAD_DIM, kk = e - (e / HEAD_DIM) * HEAD_DIM;
                acc_t acc = 0;
                for (int c = 0; c < kv_rows; ++c) acc += dS_s[r * Bc + c] * K_s[c * DP + kk];
                dq_acc[t] += acc;
            }
        }
        __syncthreads();  // reads of K_s, V_s, dS_s done before the next Kj, Vj overwrite them
    }

    scalar_t* dq_tile = dq + (bq * Nq + q0) * HEAD_DIM;
#pragma unroll
    for (int t = 0; t < PER_THREAD(Br * HEAD_DIM); ++t) {
        const int e = tid + t * NUM_THREADS;
        if (e < q_rows * HEAD_DIM) gstore(dq_tile + e, from_acc(scale * dq_acc[t]));
    }
}

// ---------------------------------------------------------------------------------------
// Atomic path, last step: dq = dq_accum in the input dtype (grid-stride, coalesced).
extern "C" __global__ void flash_bwd_dq_convert(const float* __restrict__ dq_accum,
                                                scalar_t* __restrict__ dq, long long n) {
    for (long long e = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; e < n;
         e += (long long)gridDim.x * NUM_THREADS)
        gstore(dq + e, from_acc((acc_t)gload(dq_accum + e)));
}

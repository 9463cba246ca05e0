// fwd_problem.cuh -- which attention problem a forward thread block works on, and where its
// rows live: the one place that turns blockIdx, the FwdParams block and the serving
// pointers into base pointers, lengths, the causal offset and the key/value tile range.
//
// Problems the forward kernels serve (cuflash.launch.fwd and cuflash.launch.serving set the fields):
//   * dense batches: q/k/v/o addressed by (batch, head, row) element strides;
//   * variable-length batches (varlen): packed rows, sequence b is rows cu_q[b]..cu_q[b+1]
//     of q/o/lse and cu_k[b]..cu_k[b+1] of k/v (the batch stride is unused);
//   * a KV cache: sequence b has seqlens_k[b] + seqlens_add keys (clamped to the capacity),
//     read from a contiguous cache, or through a block table of pages
//     (key j of sequence b is row j % page_size of page block_table[b][j / page_size]);
//   * split-KV: blocks of split s visit KV tiles [s * split_tiles, (s + 1) * split_tiles)
//     only and write a partial output (compute type) and lse (merged by flash_fwd_combine);
//   * packed grouped-query rows: for decoding, the query heads of a kv-head group are the
//     rows of ONE problem (q viewed as (B, Hk, group * Nq, d)), so each K/V tile is read once
//     per kv head; row r is query position r % q_period for the causal mask.
// Every index read from memory (cu_seqlens, seqlens, block table) is clamped into range:
// unchecked bad values give wrong numbers, never an out-of-bounds access.
#pragma once
#include "dtype.cuh"
#include "params.cuh"
#ifdef CUFLASH_MASKS
#include "masks.cuh"
#endif

// Per-call device pointers of the serving variants (kernel arguments, not in the params
// block, because they change from call to call).  Which are meaningful is said by the
// params' flags (varlen, kv_cache, page_size, n_splits); the others may point anywhere.
struct FwdServing {
    const int* cu_q;         // (B + 1,) varlen query prefix sums
    const int* cu_k;         // (B + 1,) varlen key prefix sums
    const int* seqlens_k;    // (B,) cached keys per sequence (KV cache)
    const int* block_table;  // (B, max_pages) physical page of each logical page
    acc_t* part;             // split partials in the compute type: o (n_splits, n_out_rows,
                             // dv), then lse (n_splits, n_out_rows)
};

__device__ __forceinline__ int cuflash_clamp(long long x, long long lo, long long hi) {
    return (int)(x < lo ? lo : (x > hi ? hi : x));
}

struct FwdProblem {
    int b, h, hk, split;
    int q0;              // first row of this block's tile
    int rows;            // rows of the problem (query positions; packed: group * positions)
    int q_period;        // query positions per head: row r is query r % q_period
    int nk;              // keys of the sequence
    int causal;
    int offset;          // query i sees key j iff j <= i + offset (causal)
    int mask_off;        // nk - query positions: the window's and ALiBi's alignment (masks.cuh)
    int tile_lo, tile_hi;  // KV tiles this block visits: [tile_lo, tile_hi)
    long long lse0;      // element index of row 0's lse (split partials are indexed by it)
    const elem_t* Qb;    // row 0 of the problem in q (rows step q_sr)
    elem_t* Ob;          // row 0 in o (rows step o_sr)
    acc_t* LSEb;         // row 0 in lse (rows step lse_sr)
    const elem_t* Kb;    // key 0 (contiguous caches and dense/varlen k)
    const elem_t* Vb;
    const int* pages;    // this sequence's block-table row (paged caches), else nullptr
    int page_size, num_pages;
    long long k_page, v_page;  // element strides between pages (the cache's batch strides)

    // Address of key j's row (0 <= j < nk) in k / v.
    __device__ __forceinline__ const elem_t* k_row(const elem_t* K, const FwdParams& p, int j) const {
        if (pages == nullptr) return Kb + (long long)j * p.k_sr;
        const int pg = cuflash_clamp(CUFLASH_INDEX(pages, j / page_size), 0, num_pages - 1);
        return K + pg * k_page + (long long)hk * p.k_sh + (long long)(j % page_size) * p.k_sr;
    }
    __device__ __forceinline__ const elem_t* v_row(const elem_t* V, const FwdParams& p, int j) const {
        if (pages == nullptr) return Vb + (long long)j * p.v_sr;
        const int pg = cuflash_clamp(CUFLASH_INDEX(pages, j / page_size), 0, num_pages - 1);
        return V + pg * v_page + (long long)hk * p.v_sh + (long long)(j % page_size) * p.v_sr;
    }
    // Keys [0, end) visible to row r (query r % q_period), clamped to [0, nk].
    __device__ __forceinline__ int row_end(int r) const {
        if (!causal) return nk;
        return cuflash_clamp((long long)(r % q_period) + offset + 1, 0, nk);
    }
#ifdef CUFLASH_MASKS
    // Keys [lo, hi) visible to row r with the sliding window as well (masks.cuh).
    __device__ __forceinline__ void row_range(const FwdParams& p, int r, int& lo, int& hi) const {
        cuflash_window_range(p, r % q_period, mask_off, nk, row_end(r), lo, hi);
    }
#endif
};

// The problem of this block for a tile height of block_q rows and KV tiles of block_kv keys.
// Blocks of a folded grid (params.cuh) run tile fastest, then split, head, batch.
__device__ __forceinline__ FwdProblem cuflash_fwd_problem(const FwdParams& p, const FwdServing& sv,
                                                          const elem_t* Q, const elem_t* K,
                                                          const elem_t* V, elem_t* O, acc_t* LSE,
                                                          int block_q, int block_kv) {
    FwdProblem f;
    const FoldedIndex fi = cuflash_fold_decode(p.n_tiles * p.n_splits, p.H);
    const int tile = fi.tile % p.n_tiles;
    f.split = fi.tile / p.n_tiles;
    f.b = fi.b;
    f.h = fi.h;
    f.hk = f.h / p.group;
    f.q0 = tile * block_q;
    long long q_start = 0, k_start = 0;
    int nq_seq = p.q_period;
    f.rows = p.Nq;
    f.nk = p.Nk;
    const bool varlen = p.varlen != 0;
    if (varlen) {  // this sequence's rows of the packed arrays
        q_start = cuflash_clamp(CUFLASH_INDEX(sv.cu_q, f.b), 0, p.total_q);
        k_start = cuflash_clamp(CUFLASH_INDEX(sv.cu_k, f.b), 0, p.total_k);
        f.rows = cuflash_clamp(CUFLASH_INDEX(sv.cu_q, f.b + 1), q_start, p.total_q) - (int)q_start;
        f.nk = cuflash_clamp(CUFLASH_INDEX(sv.cu_k, f.b + 1), k_start, p.total_k) - (int)k_start;
        nq_seq = f.rows;
    } else if (p.kv_cache) {  // KV cache: this sequence's length
        f.nk = cuflash_clamp((long long)CUFLASH_INDEX(sv.seqlens_k, f.b) + p.seqlens_add, 0, p.kv_capacity);
    }
    f.q_period = nq_seq > 0 ? nq_seq : 1;
    f.causal = p.causal;
    f.offset = p.causal_br ? f.nk - nq_seq : 0;
    f.mask_off = f.nk - nq_seq;
    f.lse0 = (varlen ? q_start * p.lse_sr : (long long)f.b * p.lse_sb) + (long long)f.h * p.lse_sh;
    f.Qb = Q + (varlen ? q_start * p.q_sr : (long long)f.b * p.q_sb) + (long long)f.h * p.q_sh;
    f.Ob = O + (varlen ? q_start * p.o_sr : (long long)f.b * p.o_sb) + (long long)f.h * p.o_sh;
    f.LSEb = LSE + f.lse0;
    f.Kb = K + (varlen ? k_start * p.k_sr : (long long)f.b * p.k_sb) + (long long)f.hk * p.k_sh;
    f.Vb = V + (varlen ? k_start * p.v_sr : (long long)f.b * p.v_sb) + (long long)f.hk * p.v_sh;
    f.pages = p.page_size > 0 ? sv.block_table + (long long)f.b * p.max_pages : nullptr;
    f.page_size = p.page_size > 0 ? p.page_size : 1;
    f.num_pages = p.num_pages > 0 ? p.num_pages : 1;
    f.k_page = p.k_sb;
    f.v_page = p.v_sb;
    // KV tiles: up to the last key the tile's last row may see (causal skipping), then the
    // split's share
    const int rows_here = min(block_q, f.rows - f.q0);
    int kv_end = f.nk;
    if (f.causal && rows_here > 0) {
        const int first = f.q0 % f.q_period;
        const int i_max = (rows_here >= f.q_period || first + rows_here > f.q_period)
                              ? f.q_period - 1 : first + rows_here - 1;
        kv_end = cuflash_clamp((long long)i_max + f.offset + 1, 0, f.nk);
    }
    int kv_begin = 0;
#ifdef CUFLASH_MASKS
    // the sliding window: keys left of the first position's band and right of the last
    // position's are never loaded
    if (p.mask_window && rows_here > 0) {
        const int first = f.q0 % f.q_period;
        const bool wraps = rows_here >= f.q_period || first + rows_here > f.q_period;
        const int i_min = wraps ? 0 : first;
        const int i_max = wraps ? f.q_period - 1 : first + rows_here - 1;
        int lo, hi, lo2, hi2;
        cuflash_window_range(p, i_min, f.mask_off, f.nk, kv_end, lo, hi);
        cuflash_window_range(p, i_max, f.mask_off, f.nk, kv_end, lo2, hi2);
        // (lo and hi grow with the position, so [lo, hi2) is the union; empty: no tile)
        kv_begin = hi2 > lo ? lo : 0;
        kv_end = hi2 > lo ? hi2 : 0;
    }
#endif
    const int n_kv = (kv_end + block_kv - 1) / block_kv;
    const int kv_t0 = kv_begin / block_kv;
    f.tile_lo = min(kv_t0 + f.split * p.split_tiles, n_kv);
    f.tile_hi = p.n_splits > 1 ? min(f.tile_lo + p.split_tiles, n_kv) : n_kv;
    return f;
}

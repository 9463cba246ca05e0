// params.cuh -- the parameter blocks of the attention kernels.
//
// Why a block in global memory instead of ~25 scalar kernel arguments: every scalar that
// CuPy's RawKernel launch converts costs host time on each call (one launch with 20
// arguments measured 17 us on an H100 host), and all of these values
// are fixed for a given (shapes, strides, dtype, scale, causal) call.  The launcher packs
// them once per distinct call into a small device buffer, keeps it in its cache, and each
// later identical call passes only the data pointers and this block's address.
//
// This header is the one definition of the layout: cuflash/_launch.py reads the struct
// declarations below (field names and types, in order) and builds the matching NumPy
// structured dtype with C alignment, so the two cannot drift apart.  Allowed field types:
// int, long long, double.  Reads of the block are plain loads (not counted as HBM traffic
// by the emulator: a few dozen bytes per block, served from L1/L2 after the first block).
//
// Grid folding: batch, heads and tiles are one grid axis (blockIdx.x), decoded by
// cuflash_fold_decode, so any number of (batch x heads) problems fits CUDA's 2^31 - 1
// blocks in x (gridDim.y/z are limited to 65535).  The tile index runs fastest: blocks
// launched together work on the same head and share its K/V (or Q/dO) in L2.
#pragma once

// Forward kernels (flash_fwd, flash_fwd_tc).  Element strides of (batch, head, row) per
// tensor; the last dim is contiguous.  Query head h reads kv head h / group.
struct FwdParams {
    long long q_sb, q_sh, q_sr;
    long long k_sb, k_sh, k_sr;
    long long v_sb, v_sh, v_sr;
    long long o_sb, o_sh, o_sr;
    long long lse_sb, lse_sh;
    double scale;          // softmax scale; kernels round it once to their compute type
    int Nq;
    int Nk;
    int H;                 // query heads per batch entry (grid folding)
    int group;             // query heads per kv head (1: no grouping)
    int causal;            // 0: no mask; else query i sees key j iff j <= i + causal_offset
    int causal_offset;     // Nk - Nq (bottom_right) or 0 (top_left)
    int n_tiles;           // query tiles per head: ceil(Nq / block_q)
    // -- serving problems (fwd_problem.cuh; zero/neutral in a dense call) --
    long long lse_sr;      // lse element stride of a row (1 dense; H for packed varlen lse)
    long long n_out_rows;  // lse elements of the call: rows of the split partial arrays
    int n_splits;          // split-KV: blocks per (tile, head, batch); 1 = no split
    int split_tiles;       // KV tiles per split
    int q_period;          // query positions per head (packed GQA rows: row r is query r % q_period)
    int causal_br;         // 1: the causal offset is (keys - query positions) of each sequence
    int total_q, total_k;  // packed rows of q and k (varlen: cu_seqlens are clamped to them)
    int seqlens_add;       // KV cache: keys appended this call (added to seqlens_k[b])
    int kv_capacity;       // KV cache: keys a sequence can hold (seqlens are clamped to it)
    int varlen;            // 1: rows of sequence b are cu_q[b]..cu_q[b+1] (packed q, k, o, lse)
    int kv_cache;          // 1: sequence b has seqlens_k[b] + seqlens_add keys
    int page_size;         // paged cache: rows per page (0: contiguous)
    int num_pages;         // paged cache: pages in the cache (block-table entries are clamped)
    int max_pages;         // paged cache: block-table columns
    int pad0;
    // -- logit features (masks.cuh; kernels compiled with -DCUFLASH_MASKS read them).  Every
    //    mask_* field is 0 unless the launcher sets it (cuflash._launch.make_params), and 0 is
    //    "off", so plain calls need not know these fields exist --
    long long mask_bias_sb, mask_bias_sh, mask_bias_sr, mask_bias_sc;  // bias strides (0: broadcast)
    long long mask_alibi_sb, mask_alibi_sh;  // ALiBi slope strides (batch, head)
    long long mask_seed_lo, mask_seed_hi;    // dropout key: the seed's two 32-bit halves
    long long mask_drop_threshold;           // 16-bit draws below it are dropped (round(p 2^16))
    double mask_softcap;                     // c of c * tanh(s / c); 0: no softcap
    double mask_drop_scale;                  // 1 / (1 - p)
    int mask_has_bias, mask_has_alibi, mask_dropout;
    int mask_window;                         // CUFLASH_WINDOW_LEFT | _RIGHT: the bounded sides
    int mask_window_left, mask_window_right;
    int mask_offset;                         // Nk - Nq: the window's and ALiBi's alignment
    int mask_drop_b0;                        // added to the batch index of the dropout mask
    int mask_pack;                           // serving: query heads packed per problem (GQA)
    int mask_pad0;
    // -- the call's head dims, read by the SIMT forward (flash_fwd.cu), which is compiled for
    //    their class (cuflash.tiling.simt_head_dim_class).  Last, so that no other field moved
    //    when they were added: the kernels that do not read them compile as before --
    int head_d, head_dv;
};

// flash_kv_append: k_new/v_new (B, Hk, Nnew, d/dv) written into the cache at positions
// seqlens_k[b] .. seqlens_k[b] + Nnew - 1 (contiguous, or through the block table).
struct KVAppendParams {
    long long kn_sb, kn_sh, kn_sr;   // k_new strides (elements)
    long long vn_sb, vn_sh, vn_sr;   // v_new strides
    long long kc_sb, kc_sh, kc_sr;   // k cache: batch (contiguous) or page (paged), head, row
    long long vc_sb, vc_sh, vc_sr;   // v cache
    int B, Hk, Nnew;
    int kv_capacity;                 // keys a sequence can hold (positions are clamped to it)
    int page_size;                   // 0: contiguous
    int num_pages, max_pages;
    int pad0;
    int d, dv;                       // head dims of k_new / v_new rows (last: see FwdParams)
};

// Backward kernels (flash_bwd*).  q/k/v/do/o by element strides as above; lse, D, dq, dk,
// dv and the float32 dQ accumulator C-contiguous (B, H|Hk, N, ...).
struct BwdParams {
    long long q_sb, q_sh, q_sr;
    long long k_sb, k_sh, k_sr;
    long long v_sb, v_sh, v_sr;
    long long do_sb, do_sh, do_sr;
    long long o_sb, o_sh, o_sr;
    long long n_convert;   // elements of dQ (B * H * Nq * d) for flash_bwd_dq_convert
    long long dq_accum_offset;  // elements of the workspace before the float32 dQ accumulator
    double scale;
    int Nq;
    int Nk;
    int H;                 // query heads per batch entry
    int Hk;                // kv heads per batch entry (H / group)
    int group;
    int causal;
    int causal_offset;
    int atomic_dq;         // 1: dQ by float32 atomics (flash_bwd_dkdv) + flash_bwd_dq_convert
    int pre_rows;          // rows per flash_bwd_preprocess block
    int n_q_tiles;         // ceil(Nq / Br): flash_bwd_dq's query tiles (grid folding)
    int n_kv_tiles;        // ceil(Nk / Bc): flash_bwd_dkdv's key/value tiles
    int n_pre_tiles;       // ceil(Nq / pre_rows): flash_bwd_preprocess's row chunks
    // tensor-core backward (flash_bwd_tc.cu) only.  Its float32 workspace: lse * log2(e)
    // (B, H, nq_pad) at 0, D (B, H, nq_pad) at d_offset, then n_splits dQ accumulators
    // (B, H, Nq, d) from dq_accum_offset, dq_slice_stride elements apart.
    long long d_offset;
    long long dq_slice_stride;
    int nq_pad;            // Nq rounded up to whole Q tiles (rows of lse2 / D per head)
    int n_splits;          // dQ accumulator slices: 1 (atomic path) or the deterministic splits
    int n_kv_blocks;       // blocks per (kv head, batch) along the keys: n_kv_tiles, or n_splits
    int pad1;
    // -- logit features (masks.cuh; kernels compiled with -DCUFLASH_MASKS read them).  Every
    //    mask_* field is 0 unless the launcher sets it (cuflash._launch.make_params), and 0 is
    //    "off", so plain calls need not know these fields exist --
    long long mask_bias_sb, mask_bias_sh, mask_bias_sr, mask_bias_sc;  // bias strides (0: broadcast)
    long long mask_alibi_sb, mask_alibi_sh;  // ALiBi slope strides (batch, head)
    long long mask_seed_lo, mask_seed_hi;    // dropout key: the seed's two 32-bit halves
    long long mask_drop_threshold;           // 16-bit draws below it are dropped (round(p 2^16))
    double mask_softcap;                     // c of c * tanh(s / c); 0: no softcap
    double mask_drop_scale;                  // 1 / (1 - p)
    int mask_has_bias, mask_has_alibi, mask_dropout;
    int mask_window;                         // CUFLASH_WINDOW_LEFT | _RIGHT: the bounded sides
    int mask_window_left, mask_window_right;
    int mask_offset;                         // Nk - Nq: the window's and ALiBi's alignment
    int mask_drop_b0;                        // added to the batch index of the dropout mask
    int mask_pack;                           // serving: query heads packed per problem (GQA)
    long long mask_dbias_sb, mask_dbias_sh, mask_dbias_sr, mask_dbias_sc;  // dbias accumulator
    int mask_dbias;        // 0: no dbias; 1: each element stored once; 2: atomic adds (broadcast)
    int mask_band_lo, mask_band_hi;  // flash_bwd_tc_band: BwdBand's lo_off, hi_off, from the launcher
    // -- the call's head dims, read by the SIMT backward (flash_bwd.cu), compiled for their
    //    class; last, as in FwdParams --
    int head_d, head_dv;
};

// blockIdx.x -> (tile, head, batch) for a grid of n_tiles * heads * batch blocks.
struct FoldedIndex { int tile, h, b; };
__device__ __forceinline__ FoldedIndex cuflash_fold_decode(int n_tiles, int heads) {
    const long long bid = blockIdx.x;
    const long long bh = bid / n_tiles;
    FoldedIndex r;
    r.tile = (int)(bid - bh * n_tiles);
    r.h = (int)(bh % heads);
    r.b = (int)(bh / heads);
    return r;
}

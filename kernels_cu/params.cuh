// params.cuh -- the parameter blocks of the attention kernels.
//
// Why a block in global memory instead of ~25 scalar kernel arguments: every scalar that
// CuPy's RawKernel launch converts costs host time on each call (one launch with 20
// arguments measured 17 us on an H100 host, docs/gpu-baseline.md), and all of these values
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
    int tf32_hi_mask;      // 0xffffe000 (flash_fwd_tf32: the 3xTF32 hi mask, at run time on purpose)
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
    int tf32_hi_mask;      // 0xffffe000 (flash_bwd_tf32: the 3xTF32 hi mask, at run time on purpose)
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

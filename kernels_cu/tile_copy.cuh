// tile_copy.cuh -- cp.async of a (kRows, kCols) tile from global into padded shared memory,
// shared by the tensor-core forward (flash_fwd_tc.cu) and backward (flash_bwd_tc.cu).
//
// T is the element type, kThreads the block's threads, kSS the shared row stride (elements).
// The tile moves in 16-byte chunks: chunk idx = tid + i * kThreads is row idx / kCpr, column
// (idx % kCpr) * kChunk.  A thread's chunks sit at fixed offsets from its first one
// (compile-time row and column steps), so the per-thread offsets are computed once and each
// tile only adds its base address -- no division, no 64-bit multiply per chunk, and a loop
// with a compile-time trip count (a loop `for (idx = tid; idx < total; idx += kThreads)`
// leaves ptxas an unknown count: an unrolled body plus a remainder loop).
// kAlwaysFull: every tile has all kRows rows (the forward's interior-only count build).
// kPadCols: only the first `cols` columns (a run-time multiple of kChunk) are copied, the rest
// zero-filled (a build for head dims larger than the call's: -DCUFLASH_HEAD_DIMS_PADDED);
// without it every column is copied and `cols` is not kept.
// Requires cp_async_16_zfill (portable.cuh).
#ifndef CUFLASH_TILE_COPY_CUH
#define CUFLASH_TILE_COPY_CUH

// (TileCopyT: each kernel names its own TileCopy alias with its element type and threads.)
template <typename T, int kThreads, int kRows, int kCols, int kSS, bool kAlwaysFull = false,
          bool kPadCols = false>
struct TileCopyT {
    static constexpr int kChunk = 16 / (int)sizeof(T);   // elements per 16-byte cp.async
    static constexpr int kCpr = kCols / kChunk;          // chunks per row
    static constexpr int kTotal = kRows * kCpr;
    static constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
    static constexpr bool kExact = kTotal % kThreads == 0;  // every thread copies kIters chunks
    // Unrolled with compile-time offsets when a row's chunks divide the threads (power-of-two
    // head dims) and a thread has few chunks; else a rolled loop that computes each chunk's
    // row and column (odd head dims, one or two warps with long tiles: an unrolled copy there
    // keeps dozens of addresses live and spills).
    static constexpr bool kUnrolled = kThreads % kCpr == 0 && kIters <= 8;
    static constexpr int kRowStep = kThreads / kCpr;  // rows between a thread's chunks (unrolled)
    int tid, row;    // the thread, its first row
    int soff;        // its first chunk's shared-memory offset (elements)
    long long goff;  // its first chunk's global offset (elements)
    long long gs;    // global row stride
    int cols;        // kPadCols: the columns copied (the rest zero-filled)
    bool col_ok;     // kPadCols, unrolled: this thread's column (the same in all its chunks)
                     // is one of them
    __device__ __forceinline__ TileCopyT(int tid_, long long gs_, int cols_ = kCols)
        : tid(tid_), gs(gs_), cols(cols_) {
        row = tid / kCpr;
        const int col = (tid % kCpr) * kChunk;
        soff = row * kSS + col;
        goff = row * gs + col;
        col_ok = !kPadCols || col < cols;
    }
    // Start copying the tile at g (global) into s (shared), all kRows rows (kFull) or rows
    // [0, rows) with the rest zero-filled (K/V rows past Nk must not hold NaN: P = 0 times
    // NaN is NaN).  Visible to other threads after cp_async_wait and __syncthreads.
    template <bool kFull>
    __device__ __forceinline__ void issue(T* s, const T* g, int rows) const {
        if (kUnrolled) {
            issue_own<kFull>(s, g + goff, g, rows);
        } else {
#pragma unroll 1
            for (int idx = tid; idx < kTotal; idx += kThreads) {
                const int r = idx / kCpr, c = (idx - r * kCpr) * kChunk;
                const bool valid = (kFull || r < rows) && (!kPadCols || c < cols);
                cp_async_16_zfill(s + r * kSS + c, valid ? g + r * gs + c : g, valid);
            }
        }
    }
    __device__ __forceinline__ void issue(T* s, const T* g, int rows) const {
        if (kAlwaysFull || rows >= kRows) issue<true>(s, g, rows);
        else issue<false>(s, g, rows);
    }
    // The same copy from `src`, this thread's own first chunk (the tile's base + goff), which a
    // caller streaming tiles steps by a tile's rows itself: no per-tile offset products.  `safe`
    // is any readable address, the source of zero-filled chunks.
    template <bool kFull>
    __device__ __forceinline__ void issue_own(T* s, const T* src, const T* safe, int rows) const {
        if (kUnrolled) {
            const long long step = kRowStep * gs;
#pragma unroll
            for (int i = 0; i < kIters; ++i) {
                if (kExact || row + i * kRowStep < kRows) {
                    const bool valid = (kFull || row + i * kRowStep < rows) && (!kPadCols || col_ok);
                    cp_async_16_zfill(s + soff + i * kRowStep * kSS, valid ? src : safe, valid);
                }
                src += step;
            }
        } else {
            issue<kFull>(s, src - goff, rows);
        }
    }
};

#endif  // CUFLASH_TILE_COPY_CUH

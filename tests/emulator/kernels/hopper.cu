// The asynchronous-copy plumbing of hopper.cuh (sm_90), checked against NumPy:
//   bulk_pipeline: warp 0's lane 0 fills STAGES stages of shared memory with tiles of x
//   by cp.async.bulk, each completing transaction bytes on the stage's "full" mbarrier;
//   the other warps wait on "full" with the fill's phase parity, sum the tile column-wise
//   into y and arrive on the stage's "empty" mbarrier, which the producer waits on before
//   refilling the stage.  With more tiles than stages, every barrier's phase wraps.
//   mbarrier_count: the arrival count and phase parity without copies.
// bulk_pipeline mode 0: correct; 1: the consumers skip the wait on "full" (a premature read);
// 2: the last tile's copy is never issued (its expect_tx cannot complete: a deadlock);
// 3: every source is one tile further on (the last copy reads past the end of x).
#include "portable.cuh"
#include "hopper.cuh"

#define TILE 256  // floats per tile: 1 KiB per bulk copy
#define STAGES 2

// x (ntiles, TILE) float32; y (ntiles, blockDim.x - 32): y[t][j] = sum_k x[t][j + k (blockDim.x - 32)].
// Dynamic shared memory: STAGES * TILE floats, then 2 * STAGES mbarriers.
extern "C" __global__ void bulk_pipeline(const float* x, float* y, int ntiles, int mode) {
    CUFLASH_DYNAMIC_SHARED(float, smem);
    float* tiles = smem;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * TILE);
    uint64_t* empty = full + STAGES;
    const int tid = threadIdx.x;
    const int nconsumers = blockDim.x - 32;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], nconsumers);
        }
        fence_proxy_async();  // the inits before the copy engine's complete_tx
    }
    __syncthreads();
    if (tid == 0) {
        for (int t = 0; t < ntiles; ++t) {
            const int s = t % STAGES;
            if (t >= STAGES) mbarrier_wait_parity(&empty[s], (t / STAGES - 1) & 1);  // fill t/STAGES - 1 consumed
            mbarrier_arrive_expect_tx(&full[s], TILE * sizeof(float));
            if (!(mode == 2 && t == ntiles - 1))
                bulk_copy_g2s(tiles + s * TILE, x + (t + (mode == 3)) * TILE, TILE * sizeof(float), &full[s]);
        }
    } else if (tid >= 32) {
        const int j = tid - 32;
        for (int t = 0; t < ntiles; ++t) {
            const int s = t % STAGES;
            if (mode != 1) mbarrier_wait_parity(&full[s], (t / STAGES) & 1);
            float acc = 0.0f;
            for (int k = j; k < TILE; k += nconsumers) acc += tiles[s * TILE + k];
            gstore(y + t * nconsumers + j, acc);
            mbarrier_arrive(&empty[s]);
        }
    }
}

// Every thread of the block arrives once on one mbarrier initialised with blockDim.x; before,
// each waits on parity 1, which a fresh barrier (phase 0) reports as completed (the phase
// "before" phase 0); after, each waits on parity 0, which completes with the last arrival.
// out[tid] = 1 + the number of threads that had arrived before the wait returned (read from
// `arrived`: blockDim.x for every thread).  mode 1: thread blockDim.x - 1 never arrives
// (the others wait for ever: a deadlock).
extern "C" __global__ void mbarrier_count(int* out, int mode) {
    __shared__ __align__(8) uint64_t bar;
    __shared__ int arrived;
    const int tid = threadIdx.x;
    if (tid == 0) {
        mbarrier_init(&bar, blockDim.x);
        arrived = 0;
        fence_proxy_async();
    }
    __syncthreads();
    mbarrier_wait_parity(&bar, 1);
    if (!(mode == 1 && tid == (int)blockDim.x - 1)) {
        atomicAdd(&arrived, 1);
        mbarrier_arrive(&bar);
        mbarrier_wait_parity(&bar, 0);
        gstore(out + tid, 1 + atomicAdd(&arrived, 0));
    }
}

// Named barriers (bar.sync id, count): warp 0 returns; the other n = blockDim.x - 32 threads
// meet at barrier 4 with count n, twice (both phase parities).  Round r: each thread stores
// 1000 r + tid to its slot, passes the barrier, and reads the slot of a thread one warp on
// (another warp's store), out[r][tid].  mode 1: no barrier (a race); 2: warp 1 names a count
// of n - 32, the others n (they disagree); 3: a count of n + 32, which never arrive (a deadlock).
extern "C" __global__ void named_barrier(int* out, int mode) {
    __shared__ long long slot[2][512];  // 8 bytes per thread: one ThreadSanitizer shadow word each
    const int tid = threadIdx.x, n = (int)blockDim.x - 32;
    if (tid < 32) return;  // an exited warp: not one of the barrier's threads
    __syncthreads();       // all of them started (so that mode 1's threads overlap)
    for (int r = 0; r < 2; ++r) {
        slot[r][tid] = 1000 * r + tid;
        if (mode == 0) named_barrier_sync(4, n);
        else if (mode == 2) named_barrier_sync(4, tid < 64 ? n - 32 : n);
        else if (mode == 3) named_barrier_sync(4, n + 32);
        gstore(out + r * blockDim.x + tid, (int)slot[r][32 + (tid - 32 + 32) % n]);
    }
}

// bar.arrive (named_barrier_arrive): warp 0 returns; of the other n = blockDim.x - 32 threads
// (n a multiple of 64) the first half produce and the second half consume.
// modes 0-2, two rounds r (both phase parities): a producer stores 1000 r + tid to its slot and
// arrives at barrier 5; a consumer syncs there and reads the slot of the producer half a block
// below it (out[r][tid]; a producer writes its own); between the rounds the consumers arrive at
// barrier 10 and the producers sync there (else a producer's second arrival at 5 could come
// before the consumers' first sync, completing the phase without them).  mode 1: the producers then sync at
// barrier 6, which the consumers pass before barrier 5 -- a deadlock were bar.arrive to wait;
// mode 2: no barrier 5 (a race); mode 4: the producers name a count past the block's threads;
// mode 5: no barrier 10 (a producer arrives at 5 a second time before the phase completed).
// mode 3, ping-pong: the halves take 4 turns each, alternately, the producers first: each half
// syncs at its own barrier (7 producers, 8 consumers) before its turn and arrives at the
// other's after it (the consumers pre-arrive at 7 once and skip their last arrival, so every
// arrival meets a sync).  A turn appends the half's number to a shared log; out[0][0..7].
extern "C" __global__ void named_arrive(int* out, int mode) {
    __shared__ long long slot[2][512];
    __shared__ int turns[8];
    __shared__ int nturns;
    const int tid = threadIdx.x, n = (int)blockDim.x - 32, half = n / 2;
    if (tid < 32) return;
    const bool producer = tid - 32 < half;
    if (mode == 3) {
        if (tid == 32) nturns = 0;
        named_barrier_sync(9, n);  // nturns is 0 before any turn
        if (!producer) named_barrier_arrive(7, n);
        for (int t = 0; t < 4; ++t) {
            named_barrier_sync(producer ? 7 : 8, n);
            if (tid == 32 || tid == 32 + half) turns[nturns++] = producer ? 0 : 1;
            if (producer || t < 3) named_barrier_arrive(producer ? 8 : 7, n);
        }
        named_barrier_sync(9, n);  // every turn taken
        if (tid == 32)
            for (int i = 0; i < 8; ++i) gstore(out + i, turns[i]);
        return;
    }
    for (int r = 0; r < 2; ++r) {
        if (producer) {
            if (r > 0 && mode != 5) named_barrier_sync(10, n);  // the consumers are past round r - 1
            slot[r][tid] = 1000 * r + tid;
            if (mode != 2) named_barrier_arrive(5, mode == 4 ? blockDim.x + 32 : n);
            if (mode == 1) named_barrier_sync(6, n);
            gstore(out + r * blockDim.x + tid, 1000 * r + tid);
        } else {
            if (mode == 1) named_barrier_sync(6, n);
            if (mode != 2) named_barrier_sync(5, n);
            gstore(out + r * blockDim.x + tid, (int)slot[r][tid - half]);
            if (r == 0 && mode != 5) named_barrier_arrive(10, n);
        }
    }
}

// engine.cpp -- the emulator's out-of-line runtime: everything cuda_host.h declares and does not
// define.  cuflash.emulator compiles it once per configuration (the arch and the engine's own
// macros, the compiler flags of the libraries) into an object that each kernel library links
// with hidden symbols, so every library keeps its own engine state (memcheck buffers, profile,
// fiber pool) as when all of it was compiled into the library.  The race-check programs, one
// translation unit each, include it after the kernel.
#include "cuda_host.h"

// host code: the built-in variables are the ThreadCtx fields of these names
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

namespace cuflash_emu {

std::string fmt_idx(uint3 v) {
    return "(" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")";
}

std::string Block::where() const { return tctx ? fmt_idx(tctx->blockIdx) : std::string("?"); }

[[noreturn]] void device_error(const std::string& msg) {
    ThreadCtx& c = *tctx;
    c.blk->fail(msg + " [block " + fmt_idx(c.blockIdx) + ", thread " + fmt_idx(c.threadIdx) + "]");
}

std::string hex(uintptr_t a) { char b[32]; std::snprintf(b, sizeof b, "0x%llx", (unsigned long long)a); return b; }

std::string nearest_buffer(uintptr_t a) {
    const GlobalBuf* best = nullptr;
    uintptr_t dist = ~uintptr_t(0);
    for (const GlobalBuf& b : memcheck.bufs) {
        const uintptr_t d = a < b.lo ? b.lo - a : a >= b.hi ? a - b.hi + 1 : 0;
        if (d < dist) { dist = d; best = &b; }
    }
    if (!best) return "no pointer argument";
    return "@ARG" + std::to_string(best->arg) + ":" + std::to_string((long long)(a - best->lo)) + "@";
}

const char* memcheck_thread_where(std::string& out) {
    ThreadCtx* c = tctx;
    if (c) out = "block " + fmt_idx(c->blockIdx) + ", thread " + fmt_idx(c->threadIdx);
    else out = "outside any CUDA thread";
    return out.c_str();
}

[[noreturn]] void global_stray(uintptr_t a, unsigned n, const char* what, const char* file, int line) {
    std::string where;
    memcheck_thread_where(where);
    device_error(std::string("memcheck: out-of-bounds ") + what + " of " + std::to_string(n) + " bytes at " +
                 hex(a) + " in kernel " + tctx->blk->kernel + " (" + file + ":" + std::to_string(line) +
                 "): not inside any array passed to the launch; nearest: " + nearest_buffer(a));
}

void record_access(const void* pc, const char* file, int line, uintptr_t a, unsigned n, AccessKind kind) {
    ThreadCtx* c = tctx;
    if (c && !c->quiet) c->recs.push_back(AccessRec{pc, file, line, c->epoch, a, n, kind});
}

void record_plain_shared(const void* pc, uintptr_t a, unsigned n, AccessKind kind) {
    ThreadCtx* c = tctx;
    if (!c || c->quiet) return;
    if (!c->recs.empty()) {
        AccessRec& p = c->recs.back();
        const unsigned m = p.size + n;
        const intptr_t dpc = static_cast<const char*>(pc) - static_cast<const char*>(p.pc);
        if (p.kind == kind && p.epoch == c->epoch && p.file == nullptr && p.addr + p.size == a && pc != p.pc &&
            dpc > -64 && dpc < 64 && m <= 16 && p.addr % (m <= 4 ? 4 : m <= 8 ? 8 : 16) == 0) {
            p.size = m;
            return;
        }
    }
    c->recs.push_back(AccessRec{pc, nullptr, 0, c->epoch, a, n, kind});
}

void record_global(uintptr_t a, unsigned n, const char* what, const char* file, int line) {
    for (size_t i = 0; i < memcheck.bufs.size(); ++i)
        if (a >= memcheck.bufs[i].lo && a + n <= memcheck.bufs[i].hi) {
            a = ((uintptr_t(i) + 1) << 40) + (a - memcheck.bufs[i].lo);
            break;
        }
    record_access(nullptr, file, line, a, n, global_kind(what));
}

void check_global(const void* p, unsigned n, const char* what, const char* file, int line) {
    if (memcheck.profile) record_global(reinterpret_cast<uintptr_t>(p), n, what, file, line);
    if (!memcheck.global_on) return;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const std::vector<GlobalBuf>& bs = memcheck.bufs;
    if (memcheck.last < bs.size() && a >= bs[memcheck.last].lo && a + n <= bs[memcheck.last].hi) return;
    for (size_t i = 0; i < bs.size(); ++i)
        if (a >= bs[i].lo && a + n <= bs[i].hi) { memcheck.last = i; return; }
    global_stray(a, n, what, file, line);
}

std::string pc_token(const void* pc) {
    Dl_info info{};
    if (pc && dladdr(pc, &info) && info.dli_fbase)
        return "@PC:" + hex(reinterpret_cast<uintptr_t>(pc) - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1) + "@";
    return "an unknown line";
}

std::string shared_stray_message(uintptr_t a, unsigned n, const char* what, const std::string& site) {
    std::string where;
    memcheck_thread_where(where);
    const long long off = (long long)(a - memcheck.dyn_lo);
    return std::string("memcheck: out-of-bounds shared-memory ") + what + " of " + std::to_string(n) +
           " bytes in kernel " + (tctx ? tctx->blk->kernel : std::string("?")) + " at " + site + ": byte offset " +
           std::to_string(off) + " of the dynamic shared memory, which holds " +
           std::to_string(memcheck.dyn_hi - memcheck.dyn_lo) + " bytes [" + where + "]";
}

void check_shared(const void* p, unsigned n, const char* what, const char* file, int line) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (!in_shared_window(a)) return;
    if (in_shared_alloc(a, n)) {
        if (memcheck.profile) record_access(nullptr, file, line, a, n, what[0] == 'l' ? ACC_LDMATRIX : ACC_CP_ASYNC_SHARED);
        return;
    }
    if (!memcheck.shared_on) return;
    tctx->blk->fail(shared_stray_message(a, n, what, std::string(file) + ":" + std::to_string(line)));
}

__attribute__((noinline, cold)) void shared_stray_hook(uintptr_t a, unsigned n, bool store, const void* pc) {
    ThreadCtx* c = tctx;
    if (!c) return;
    TsanQuiet quiet;
    std::lock_guard<BlockMutex> lk(c->blk->mu);
    c->blk->abort_locked(shared_stray_message(a, n, store ? "store" : "load", pc_token(pc)));
}

__attribute__((noinline, cold)) void bulk_overlap_hook(uintptr_t a, unsigned n, bool store, const void* pc) {
    ThreadCtx* c = tctx;
    if (!c) return;
    for (const BulkCopy& b : c->blk->bulk) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(b.dst), hi = lo + b.data.size();
        if (a + n <= lo || a >= hi) continue;
        std::string where;
        memcheck_thread_where(where);
        const std::string msg =
            std::string("memcheck: shared-memory ") + (store ? "store" : "load") + " of " + std::to_string(n) +
            " bytes in kernel " + c->blk->kernel + " at " + pc_token(pc) + " touches byte offset " +
            std::to_string((long long)(a - memcheck.dyn_lo)) + " of the dynamic shared memory while a " +
            "cp.async.bulk of " + std::to_string(b.data.size()) + " bytes (issued by thread " +
            std::to_string(b.tid) + ") is still writing there; wait on its mbarrier first [" + where + "]";
        TsanQuiet quiet;
        std::lock_guard<BlockMutex> lk(c->blk->mu);
        c->blk->abort_locked(msg);
        return;
    }
}

// A generic-proxy store of n bytes at a (the proxy check: who wrote it, at which fence count).
static void proxy_mark(uintptr_t a, unsigned n) {
    ThreadCtx* c = tctx;
    if (!c || c->quiet || c->blk->proxy.empty()) return;
    const uint32_t tag = (c->tid + 1) | (c->proxy_gen << 11);
    const uintptr_t off = a - memcheck.dyn_lo;
    for (unsigned i = 0; i < n && off + i < c->blk->proxy.size(); ++i) c->blk->proxy[off + i] = tag;
}

__attribute__((noinline)) void raw_access_in_window(uintptr_t a, unsigned n, bool store, const void* pc) {
    if (in_shared_alloc(a, n)) {
        if (store) proxy_mark(a, n);
        if (memcheck.profile) record_plain_shared(pc, a, n, store ? ACC_SHARED_STORE : ACC_SHARED_LOAD);
#if !CUFLASH_EMULATOR_THREADS
        if (memcheck.shared_on && tctx && !tctx->blk->bulk.empty()) bulk_overlap_hook(a, n, store, pc);
#endif
        return;
    }
    if (memcheck.shared_on) shared_stray_hook(a, n, store, pc);
}

void require_full_warp(const char* what) {
    ThreadCtx& c = *tctx;
    if (c.blk->warp_size(c.warp) != 32)
        device_error(std::string(what) + " needs a full warp of 32 threads (blockDim gives warp " +
                     std::to_string(c.warp) + " only " + std::to_string(c.blk->warp_size(c.warp)) + ")");
}

void cp_async_16(void* dst, const void* src, const char* file, int line) {
    ThreadCtx& c = *tctx;
    if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16)
        device_error("cp.async 16 bytes: source and destination must be 16-byte aligned");
    check_shared(dst, 16, "cp.async destination", file, line);
    if (src) check_global(src, 16, "cp.async source", file, line);
    count(CNT_CP_ASYNC);
    if (src) c.bytes_read += 16;
    c.cp_open.push_back(CpCopy{dst, src});
}

void cp_async_commit() {
    ThreadCtx& c = *tctx;
    c.cp_groups.push_back(std::move(c.cp_open));
    c.cp_open.clear();
}

void cp_async_wait(int n) {  // all but the n most recent committed groups complete
    ThreadCtx& c = *tctx;
    c.quiet = true;  // the copies' shared side was recorded at issue
    while ((int)c.cp_groups.size() > n) {
        for (const CpCopy& cp : c.cp_groups.front()) {
            if (cp.src) std::memcpy(cp.dst, cp.src, 16);
            else std::memset(cp.dst, 0, 16);
        }
        c.cp_groups.erase(c.cp_groups.begin());
    }
    c.quiet = false;
}

std::string mbar_name(const void* bar) { return "the mbarrier at shared address " + hex(reinterpret_cast<uintptr_t>(bar)); }

void mbar_check_object(const void* bar, const char* what, const char* file, int line) {
    if (reinterpret_cast<uintptr_t>(bar) % 8)
        device_error(std::string(what) + ": " + mbar_name(bar) + " is not 8-byte aligned");
    check_shared(bar, 8, what, file, line);
}

void mbarrier_init(void* bar, unsigned count, const char* file, int line) {
    mbar_check_object(bar, "mbarrier.init", file, line);
    if (count < 1 || count > (1u << 20) - 1)
        device_error("mbarrier.init: count " + std::to_string(count) + " is outside [1, 2^20 - 1]");
    Block& b = *tctx->blk;
    TsanQuiet quiet;
    std::lock_guard<BlockMutex> lk(b.mu);
    Mbarrier& m = b.mbars[reinterpret_cast<uintptr_t>(bar)];
    m = Mbarrier{};
    m.expected = m.pending = count;
}

unsigned long long mbarrier_arrive(void* bar, unsigned tx, const char* file, int line) {
    mbar_check_object(bar, tx ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive", file, line);
    Block& b = *tctx->blk;
    std::string err;
    unsigned long long phase = 0;
    tsan_release(bar);
    {
        TsanQuiet quiet;
        std::lock_guard<BlockMutex> lk(b.mu);
        auto it = b.mbars.find(reinterpret_cast<uintptr_t>(bar));
        if (it == b.mbars.end()) {
            err = "mbarrier.arrive: " + mbar_name(bar) + " was not initialised in this block (mbarrier.init)";
        } else if (it->second.pending == 0) {
            err = "mbarrier.arrive: " + mbar_name(bar) + " has no pending arrival left in its phase " +
                  std::to_string(it->second.phase) + " (more arrivals than its count " +
                  std::to_string(it->second.expected) + " before the transactions completed)";
        } else {
            Mbarrier& m = it->second;
            m.tx += tx;
            if (m.tx > (1ll << 20) - 1)
                err = "mbarrier.arrive.expect_tx: the tx-count of " + mbar_name(bar) + " exceeds 2^20 - 1 bytes";
            phase = m.phase;
            --m.pending;
            if (Block::complete_phase(m)) b.release_mbar_waiters();
        }
    }
    if (!err.empty()) device_error(err);
    return phase;
}

void mbarrier_wait_parity(void* bar, unsigned parity, const char* file, int line) {
    mbar_check_object(bar, "mbarrier.try_wait.parity", file, line);
    ThreadCtx& c = *tctx;
    Block& b = *c.blk;
    ++c.epoch;
    for (;;) {
        std::string err;
        bool done = false, again = false;
        unsigned g = 0;
        {
            TsanQuiet quiet;
            std::lock_guard<BlockMutex> lk(b.mu);
            if (b.aborted) throw KernelAbort{};
            auto it = b.mbars.find(reinterpret_cast<uintptr_t>(bar));
            if (it == b.mbars.end()) {
                err = "mbarrier.try_wait.parity: " + mbar_name(bar) + " was not initialised in this block (mbarrier.init)";
            } else if ((it->second.phase & 1u) != (parity & 1u)) {
                done = true;
            } else {
                g = b.mbar_gen.load(std::memory_order_relaxed);
                ++b.mbar_waiters; ++b.waiting;
                if (b.waiting == b.live) {
                    if (!b.land_bulk_locked()) {
                        b.abort_locked(b.deadlock_message());
                        throw KernelAbort{};
                    }
                    again = true;  // a phase completed and this thread was released: look again
                }
            }
        }
        if (!err.empty()) device_error(err);
        if (done) break;
        if (again) continue;
#if CUFLASH_EMULATOR_THREADS
        while (b.mbar_gen.load(std::memory_order_acquire) == g) b.mbar_gen.wait(g, std::memory_order_acquire);
#else
        b.fibers->wait(b.mbar_gen, g);
#endif
        if (b.aborted) throw KernelAbort{};
    }
    tsan_acquire(bar);
}

bool Block::land_bulk_locked() {
    if (bulk.empty()) return false;
    std::vector<BulkCopy> copies;
    copies.swap(bulk);  // first: the overlap check must not see the landing itself
    bool completed = false;
    ThreadCtx* c = tctx;
    if (c) c->quiet = true;  // the destinations were recorded at issue
    for (BulkCopy& cp : copies) {
        std::memcpy(cp.dst, cp.data.data(), cp.data.size());
        auto it = mbars.find(cp.bar);
        if (it == mbars.end()) continue;  // re-initialised meanwhile: nobody waits for these bytes
        it->second.tx -= (long long)cp.data.size();
        completed |= complete_phase(it->second);
    }
    if (c) c->quiet = false;
    if (completed) release_mbar_waiters();
    return completed;
}

void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, void* bar, const char* file, int line) {
    ThreadCtx& c = *tctx;
    if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16)
        device_error("cp.async.bulk: source and destination must be 16-byte aligned");
    if (bytes == 0 || bytes % 16)
        device_error("cp.async.bulk: the size " + std::to_string(bytes) + " is not a positive multiple of 16 bytes");
    mbar_check_object(bar, "cp.async.bulk mbarrier", file, line);
    check_shared(dst, bytes, "cp.async.bulk destination", file, line);
    check_global(src, bytes, "cp.async.bulk source", file, line);
    c.bytes_read += bytes;
    issue_bulk(dst, std::vector<unsigned char>(static_cast<const unsigned char*>(src),
                                               static_cast<const unsigned char*>(src) + bytes),
               bar, "cp.async.bulk");
}

// A copy whose bytes were read at issue: poison the destination, queue it on `bar`.
void issue_bulk(void* dst, std::vector<unsigned char> data, void* bar, const char* what) {
    ThreadCtx& c = *tctx;
    const size_t bytes = data.size();
    BulkCopy cp{static_cast<unsigned char*>(dst), std::move(data), reinterpret_cast<uintptr_t>(bar), c.tid};
    c.quiet = true;
    std::memset(dst, 0xff, bytes);  // poison: until the copy lands, readers see NaN
    c.quiet = false;
    // Under ThreadSanitizer the poison is this thread's write: a thread that reads the
    // destination without waiting on the mbarrier races with it (a race report); one that
    // waits acquires `bar`, released here since the copy's completion comes after its issue
    // (the landing itself is emulator code, invisible to TSan).
    tsan_release(bar);
    Block& b = *c.blk;
    std::string err;
    {
        TsanQuiet quiet;
        std::lock_guard<BlockMutex> lk(b.mu);
        if (b.mbars.count(cp.bar) == 0)
            err = std::string(what) + ": " + mbar_name(bar) + " was not initialised in this block (mbarrier.init)";
        else
            b.bulk.push_back(std::move(cp));
    }
    if (!err.empty()) device_error(err);
}

// ---- TMA: cp.async.bulk.tensor (see cuda_host.h)
namespace {
std::vector<std::array<uintptr_t, 3>> relocations;  // (parent start, child start, bytes)
}

void set_relocations(const unsigned long long* from, const unsigned long long* to, const unsigned long long* sizes,
                     unsigned n) {
    relocations.clear();
    for (unsigned i = 0; i < n; ++i) relocations.push_back({uintptr_t(from[i]), uintptr_t(to[i]), uintptr_t(sizes[i])});
}

uintptr_t relocate(uintptr_t addr) {
    for (const auto& r : relocations)
        if (addr - r[0] < r[2]) return addr - r[0] + r[1];
    return addr;
}

void tma_load(void* dst, const void* tmap, const int* coords, int rank, void* bar, const char* file, int line) {
    ThreadCtx& c = *tctx;
    const char* what = "cp.async.bulk.tensor";
    if (reinterpret_cast<uintptr_t>(tmap) % 64) device_error(std::string(what) + ": the tensor map is not 64-byte aligned");
    check_global(tmap, sizeof(TensorMapEmu), "tensor map", file, line);
    TensorMapEmu m;
    std::memcpy(&m, tmap, sizeof m);
    if (m.magic != kTensorMapMagic)
        device_error(std::string(what) + ": not a tensor map made for the emulator (cuflash.launch.tma.tensor_map)");
    if (int(m.rank) != rank)
        device_error(std::string(what) + ": a " + std::to_string(rank) + "-d copy with a rank-" + std::to_string(m.rank) +
                     " tensor map");
    const uint64_t elem = m.elem_bytes, inner = uint64_t(m.box[0]) * elem, span = m.swizzle;
    if (span && inner != span)
        device_error(std::string(what) + ": the box's inner dimension is " + std::to_string(inner) + " bytes with the " +
                     std::to_string(span) + "-byte swizzle (the emulator takes boxes whose rows fill the swizzle span)");
    uint64_t rows = 1;
    for (int d = 1; d < rank; ++d) rows *= m.box[d];
    const uint64_t bytes = rows * inner;
    const uintptr_t off = reinterpret_cast<uintptr_t>(dst) - memcheck.dyn_lo;
    const uint64_t align = span ? 8 * span : 128;  // the swizzle pattern repeats every 8 rows
    if (off % align)
        device_error(std::string(what) + ": the destination (shared byte " + std::to_string(off) + ") is not " +
                     std::to_string(align) + "-byte aligned");
    mbar_check_object(bar, "cp.async.bulk.tensor mbarrier", file, line);
    check_shared(dst, unsigned(bytes), "cp.async.bulk.tensor destination", file, line);
    std::vector<unsigned char> data(bytes, 0);  // out-of-bounds elements are zero
    const unsigned char* base = reinterpret_cast<const unsigned char*>(relocate(uintptr_t(m.addr)));
    for (uint64_t r = 0; r < rows; ++r) {
        // the row's global coordinates in dims 1..rank-1, and whether it is inside the tensor
        int64_t row_off = 0;
        bool inside = true;
        uint64_t rest = r;
        for (int d = 1; d < rank; ++d) {
            const int64_t g = int64_t(coords[d]) + int64_t(rest % m.box[d]);
            rest /= m.box[d];
            inside = inside && g >= 0 && uint64_t(g) < m.dims[d];
            row_off += g * int64_t(m.strides[d - 1]);
        }
        if (!inside) continue;
        const int64_t lo = std::max<int64_t>(0, coords[0]), hi = std::min<int64_t>(int64_t(m.dims[0]), int64_t(coords[0]) + m.box[0]);
        if (lo >= hi) continue;
        const unsigned char* src = base + row_off + lo * int64_t(elem);
        check_global(src, unsigned((hi - lo) * elem), "cp.async.bulk.tensor source", file, line);
        c.bytes_read += uint64_t(hi - lo) * elem;
        for (int64_t i = lo; i < hi; ++i) {
            uint64_t lin = r * inner + uint64_t(i - coords[0]) * elem;
            if (span) lin ^= ((lin >> 7) & (span / 16 - 1)) << 4;
            std::memcpy(&data[lin], src + (i - lo) * int64_t(elem), elem);
        }
    }
    issue_bulk(dst, std::move(data), bar, what);
}

// ---- warpgroup MMA (see cuda_host.h)
namespace {
constexpr uint32_t kWgmmaPoison = 0x7fd0bad5u;  // a quiet NaN that marks D in flight

// The warpgroup's checks: a full warp, and all four warps of the group in the block.
void wgmma_require_warpgroup(const char* what) {
    require_full_warp(what);
    const ThreadCtx& c = *tctx;
    if ((c.warp / 4) * 4 + 3 >= c.blk->nwarps)
        device_error(std::string(what) + ": warp " + std::to_string(c.warp) + " has no complete warpgroup (the block has " +
                     std::to_string(c.blk->nthreads) + " threads; a warpgroup is 4 warps, 128 threads)");
}

// The shared-memory element (mn, k) of a descriptor's operand (16-bit elements: 8 per 16 bytes).
const unsigned short* wgmma_element(uint64_t desc, int mn, int k, bool mn_major, const char* what) {
    const uint64_t start = (desc & 0x3fffu) << 4, lbo = ((desc >> 16) & 0x3fffu) << 4, sbo = ((desc >> 32) & 0x3fffu) << 4;
    const unsigned base_offset = unsigned(desc >> 49) & 7u, mode = unsigned(desc >> 62) & 3u;
    if (base_offset != 0)
        device_error(std::string(what) + ": matrix descriptor with base offset " + std::to_string(base_offset) +
                     " (the emulator takes swizzle patterns that start on their repeat boundary only)");
    const uint64_t width = mode == 0 ? 0 : mode == 1 ? 128 : mode == 2 ? 64 : 32;  // swizzle bytes
    uint64_t off;
    if (!mn_major) {  // K-major: rows of MN, k contiguous
        if (width == 0)  // ((8,m),(T,2k)):((1T,SBO),(1,LBO))
            off = 16 * (mn % 8) + sbo * (mn / 8) + 2 * (k % 8) + lbo * (k / 8);
        else             // ((8,m),(T,2k)):((xT,SBO),(1,T)): one row of `width` bytes per mn
            off = width * (mn % 8) + sbo * (mn / 8) + 2 * k;
    } else {          // MN-major: mn contiguous
        if (width == 0)  // ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
            off = 2 * (mn % 8) + sbo * (mn / 8) + 16 * (k % 8) + lbo * (k / 8);
        else             // ((T,x,m),(8,k)):((1,T,LBO),(xT,SBO)), x = width / 16
            off = 2 * (mn % (width / 2)) + lbo * (mn / (width / 2)) + width * (k % 8) + sbo * (k / 8);
    }
    uint64_t addr = start + off;
    if (width) addr ^= ((addr >> 7) & (width / 16 - 1)) << 4;
    const uint64_t size = memcheck.dyn_hi - memcheck.dyn_lo;
    if (addr + 2 > size)
        device_error(std::string(what) + ": the matrix descriptor's element (" + std::to_string(mn) + ", " +
                     std::to_string(k) + ") is at shared byte " + std::to_string(addr) + ", outside the " +
                     std::to_string(size) + " bytes of dynamic shared memory");
    return reinterpret_cast<const unsigned short*>(tctx->dyn_smem + addr);
}

// The result of one wgmma for this thread (its N / 2 accumulator registers).
void wgmma_compute(WgmmaOp& op) {
    const std::vector<float>& cin = op.chain ? *op.chain : op.c;
    op.result->assign(op.nregs, 0.0f);
    for (unsigned i = 0; i < op.nregs; ++i) {
        const int r = (i >> 1) & 1, col = int((i >> 2) * 2 + (i & 1));  // row of 2, column of N / 4
        float acc = op.accumulate ? cin[i] : 0.0f;
        for (int k0 = 0; k0 < 16; k0 += kTcBlock16) {
            double p[kTcBlock16];
            for (int k = 0; k < kTcBlock16; ++k)
                p[k] = double(op.a[r][k0 + k]) * op.b[size_t(k0 + k) * (op.nregs / 2) + col];
            acc = tc_block_fma(acc, p, kTcBlock16);
        }
        (*op.result)[i] = acc;
    }
}

const WgmmaOp* wgmma_first_in_flight(const ThreadCtx& c) {
    for (const auto& g : c.wg_groups) if (!g.empty()) return &g.front();
    return c.wg_open.empty() ? nullptr : &c.wg_open.front();
}

// The latest wgmma in flight on the accumulator registers d (committed or not), or null.
const WgmmaOp* last_in_flight(const ThreadCtx& c, const float* d) {
    const WgmmaOp* last = nullptr;
    for (const auto& g : c.wg_groups) for (const WgmmaOp& o : g) if (o.d == d) last = &o;
    for (const WgmmaOp& o : c.wg_open) if (o.d == d) last = &o;
    return last;
}
}  // namespace

void fence_proxy_async() {
    ThreadCtx& c = *tctx;
    ++c.proxy_gen;
}

// An asynchronous-proxy read (a wgmma operand) of the shared bytes [p, p + n): a generic
// store there that its thread has not fenced since is reported.
static void proxy_check(const void* p, unsigned n, const char* what, const char* file, int line) {
    ThreadCtx& c = *tctx;
    const std::vector<uint32_t>& px = c.blk->proxy;
    if (px.empty()) return;
    const uintptr_t off = reinterpret_cast<uintptr_t>(p) - memcheck.dyn_lo;
    for (unsigned i = 0; i < n && off + i < px.size(); ++i) {
        const uint32_t e = px[off + i];
        if (e == 0) continue;
        const unsigned writer = (e & 0x7ffu) - 1, gen = e >> 11;
        if (gen == (c.blk->threads[writer].proxy_gen & 0x1fffffu))
            device_error(std::string(what) + " at " + file + ":" + std::to_string(line) + " reads shared byte " +
                         std::to_string(off + i) + ", which thread " + std::to_string(writer) +
                         " stored (generic proxy) with no fence.proxy.async since: the tensor cores may read the "
                         "old value");
    }
}

void wgmma_fence() {
    ThreadCtx& c = *tctx;
    wgmma_require_warpgroup("wgmma.fence");
    c.wg_fenced = true;
}

void wgmma_commit_group() {
    ThreadCtx& c = *tctx;
    wgmma_require_warpgroup("wgmma.commit_group");
    c.wg_groups.push_back(std::move(c.wg_open));  // an empty group too, as on the GPU
    c.wg_open.clear();
}

void wgmma_mma(float* d, int n, bool bf16, const uint32_t* a_regs, uint64_t desc_a, uint64_t desc_b, bool trans_a,
               bool trans_b, bool accumulate, const char* file, int line) {
    ThreadCtx& c = *tctx;
    const char* what = "wgmma.mma_async";
    wgmma_require_warpgroup(what);
    if (n < 8 || n > 256 || n % 8) device_error(std::string(what) + ": N = " + std::to_string(n) + " (8..256, multiples of 8)");
    if (!c.wg_fenced)
        device_error(std::string(what) + " at " + file + ":" + std::to_string(line) +
                     " without a wgmma.fence since the launch or the last wgmma.wait_group");
    count(CNT_WGMMA);
    auto value = [bf16](unsigned short h) { return bf16 ? bf16_bits_to_float(h) : h16_bits_to_float(h); };
    WgmmaOp op;
    op.d = d; op.nregs = unsigned(n / 2); op.accumulate = accumulate; op.file = file; op.line = line;
    const int g = int(c.lane >> 2), t = int(c.lane & 3), row0 = 16 * int(c.warp % 4) + g;
    if (a_regs) {  // RS: the warp's A fragment, as mma.m16n8k16's
        struct Frag { uint32_t a[4]; } mine;
        std::memcpy(mine.a, a_regs, 16);
        op.a_regs = a_regs;
        std::memcpy(op.a_bits, a_regs, 16);
        const unsigned char* s = warp_exchange(&mine, sizeof mine, 0xffffffffu, what);
        for (int r = 0; r < 2; ++r)
            for (int k = 0; k < 16; ++k) {
                const Frag& f = *reinterpret_cast<const Frag*>(s + 64 * (g * 4 + (k % 8) / 2));
                const uint32_t reg = f.a[r + 2 * (k / 8)];
                op.a[r][k] = value((unsigned short)((k & 1) ? reg >> 16 : reg & 0xffffu));
            }
    } else {
        for (int r = 0; r < 2; ++r)
            for (int k = 0; k < 16; ++k) {
                const unsigned short* e = wgmma_element(desc_a, row0 + 8 * r, k, trans_a, "wgmma.mma_async A");
                proxy_check(e, 2, "wgmma.mma_async (A)", file, line);
                op.src.push_back(e); op.bits.push_back(*e);
                op.a[r][k] = value(*e);
            }
    }
    const int ncols = n / 4;
    op.b.resize(size_t(16) * ncols);
    for (int k = 0; k < 16; ++k)
        for (int j = 0; j < ncols; ++j) {
            const int col = 8 * (j / 2) + 2 * t + (j & 1);
            const unsigned short* e = wgmma_element(desc_b, col, k, trans_b, "wgmma.mma_async B");
            proxy_check(e, 2, "wgmma.mma_async (B)", file, line);
            op.src.push_back(e); op.bits.push_back(*e);
            op.b[size_t(k) * ncols + j] = value(*e);
        }
    // a wgmma in flight on the same registers: this one adds to its result
    if (const WgmmaOp* prev = last_in_flight(c, d)) {
        if (prev->nregs != op.nregs)
            device_error(std::string(what) + ": a wgmma of another N is in flight on the same accumulator registers");
        op.chain = prev->result;
    } else if (accumulate) {
        op.c.assign(d, d + op.nregs);
    }
    op.result = std::make_shared<std::vector<float>>();
    for (unsigned i = 0; i < op.nregs; ++i) std::memcpy(&d[i], &kWgmmaPoison, 4);
    c.wg_open.push_back(std::move(op));
}

// wait_group is .sync.aligned: the warpgroup's threads pass it together, so one thread may
// release the operands' shared memory for the whole group (an mbarrier arrive) right after
// it.  Two barriers: every thread is at the wait before any completes, and every thread has
// checked its operands before any goes on.
static void warpgroup_sync() {
    ThreadCtx& c = *tctx;
    const unsigned phase = c.wg_phase;
    c.wg_phase ^= 1u;
    c.blk->arrive_and_wait(c.blk->wg_bar[c.warp / 4], phase);
}

void warpgroup_barrier() {
    wgmma_require_warpgroup("bar.sync (a warpgroup's named barrier)");
    warpgroup_sync();
}

// The named barrier `id` of this thread's block, checked: a whole warp, id 1..15, a count of
// whole warps within the block that agrees with the threads already there.  Flips the
// thread's phase bit of it and returns the parity it arrives at.
static Barrier& named_barrier_of(const char* what, unsigned id, unsigned count, const char* file, int line,
                                 unsigned& parity) {
    ThreadCtx& c = *tctx;
    Block& blk = *c.blk;
    const std::string at = std::string(" at ") + file + ":" + std::to_string(line);
    const std::string name = std::string(what) + " " + std::to_string(id);
    require_full_warp(what);
    if (id == 0 || id > 15)
        device_error(name + at + ": named barriers are 1..15 (0 is __syncthreads')");
    if (count == 0 || count % 32 || count > blk.nthreads)
        device_error(name + ", " + std::to_string(count) + at +
                     ": the count must be a multiple of 32 up to the block's " + std::to_string(blk.nthreads) + " threads");
    Barrier& b = blk.named[id];
    unsigned had = 0;
    bool again = false;
    {
        TsanQuiet quiet;
        std::lock_guard<BlockMutex> lk(blk.mu);
        if (b.arrived == 0) b.expected = count;
        else had = b.expected;
        const unsigned gen = b.gen.load(std::memory_order_relaxed);
        again = c.named_gen[id] == gen + 1;
        c.named_gen[id] = gen + 1;
    }
    // a bar.arrive lets its thread come again before the phase completed; on the GPU that
    // arrival counts toward the same phase, completing it without the threads it waits for
    if (again)
        device_error(name + at + ": this thread comes to the barrier a second time before the phase it "
                     "arrived at completed (an earlier bar.arrive of it still counts there)");
    if (had != 0 && had != count)
        device_error(name + at + ": this thread's count " + std::to_string(count) +
                     " differs from the " + std::to_string(had) + " of the threads already at the barrier");
    const unsigned bit = 1u << id;
    parity = (c.named_phase & bit) ? 1u : 0u;
    c.named_phase ^= bit;
    return b;
}

void named_barrier(unsigned id, unsigned count, const char* file, int line) {
    unsigned parity;
    Barrier& b = named_barrier_of("bar.sync", id, count, file, line, parity);
    tctx->blk->arrive_and_wait(b, parity);
}

void named_barrier_arrive(unsigned id, unsigned count, const char* file, int line) {
    unsigned parity;
    Barrier& b = named_barrier_of("bar.arrive", id, count, file, line, parity);
    Block& blk = *tctx->blk;
    ++tctx->epoch;
    tsan_release(&b.sync[parity]);  // what this thread did before it happens before the waiters' return
    TsanQuiet quiet;
    std::lock_guard<BlockMutex> lk(blk.mu);
    if (blk.aborted) throw KernelAbort{};
    if (++b.arrived == b.expected) blk.release(b);
}

void wgmma_wait_group(int n, const char* file, int line) {
    ThreadCtx& c = *tctx;
    wgmma_require_warpgroup("wgmma.wait_group");
    if (n < 0 || n > 7) device_error("wgmma.wait_group: N = " + std::to_string(n) + " (0..7)");
    warpgroup_sync();
    c.wg_fenced = false;
    const size_t done = c.wg_groups.size() > size_t(n) ? c.wg_groups.size() - size_t(n) : 0;
    std::vector<std::vector<WgmmaOp>> finished(std::make_move_iterator(c.wg_groups.begin()),
                                               std::make_move_iterator(c.wg_groups.begin() + done));
    c.wg_groups.erase(c.wg_groups.begin(), c.wg_groups.begin() + done);
    for (auto& gr : finished)
        for (WgmmaOp& op : gr) {
            for (size_t i = 0; i < op.src.size(); ++i)
                if (*op.src[i] != op.bits[i]) {
                    const uintptr_t off = reinterpret_cast<uintptr_t>(op.src[i]) - reinterpret_cast<uintptr_t>(c.dyn_smem);
                    device_error("wgmma.mma_async at " + std::string(op.file) + ":" + std::to_string(op.line) +
                                 ": its shared-memory operand (byte " + std::to_string(off) +
                                 ") was written before the wgmma.wait_group at " + file + ":" +
                                 std::to_string(line) + " completed it (the tensor cores may still read it)");
                }
            if (op.a_regs && std::memcmp(op.a_regs, op.a_bits, 16) != 0)
                device_error("wgmma.mma_async at " + std::string(op.file) + ":" + std::to_string(op.line) +
                             ": its A registers were written before the wgmma.wait_group at " + file + ":" +
                             std::to_string(line) + " completed it (the tensor cores may still read them)");
            wgmma_compute(op);
        }
    // write each accumulator once, with the result of the last finished wgmma on it
    std::vector<const WgmmaOp*> last_on;
    for (auto& gr : finished)
        for (WgmmaOp& op : gr) {
            bool replaced = false;
            for (const WgmmaOp*& q : last_on) if (q->d == op.d) { q = &op; replaced = true; }
            if (!replaced) last_on.push_back(&op);
        }
    for (const WgmmaOp* op : last_on) {
        if (last_in_flight(c, op->d)) continue;  // a later wgmma in flight still owns d
        for (unsigned i = 0; i < op->nregs; ++i) {
            uint32_t bits;
            std::memcpy(&bits, &op->d[i], 4);
            if (bits != kWgmmaPoison)
                device_error("wgmma.mma_async at " + std::string(op->file) + ":" + std::to_string(op->line) +
                             ": its accumulator register " + std::to_string(i) +
                             " was written while the wgmma was in flight");
        }
        std::memcpy(op->d, op->result->data(), 4 * op->nregs);
    }
    warpgroup_sync();
}

void setmaxnreg(unsigned regs, bool inc, const char* file, int line) {
    wgmma_require_warpgroup(inc ? "setmaxnreg.inc" : "setmaxnreg.dec");
    if (regs < 24 || regs > 256 || regs % 8)
        device_error(std::string("setmaxnreg at ") + file + ":" + std::to_string(line) + ": " + std::to_string(regs) +
                     " registers (24..256, a multiple of 8)");
}

void note_atomic(const void* p) {
    ThreadCtx& c = *tctx;
    if (c.record_atomics) c.atomics.push_back(AtomicRec{reinterpret_cast<uintptr_t>(p), c.block_lin, c.tid});
}

void red_add_f32(float* p, const float* v, int n, const char* file, int line) {
    ThreadCtx& c = *tctx;
    if (n > 1 && reinterpret_cast<uintptr_t>(p) % (4u * n) != 0)
        device_error("red.global.add.v" + std::to_string(n) + ".f32: address " +
                     std::to_string(reinterpret_cast<uintptr_t>(p)) + " is not " + std::to_string(4 * n) +
                     "-byte aligned");
    check_global(p, 4u * n, "red.global.add", file, line);
    for (int i = 0; i < n; ++i) count(CNT_GLOBAL_ATOMIC);  // n scalar reds before sm_90
    for (int i = 0; i < n; ++i) note_atomic(p + i);
    for (int i = 0; i < n; ++i) std::atomic_ref<float>(p[i]).fetch_add(v[i]);
    c.bytes_read += 4ull * n;
    c.bytes_written += 4ull * n;
}

void note_store(const void* p, unsigned bytes) {
    ThreadCtx& c = *tctx;
    if (c.record_stores) c.stores.push_back(StoreRec{reinterpret_cast<uintptr_t>(p), bytes, c.block_lin});
}

void Block::abort_locked(const std::string& msg) {
    if (!aborted) { error = msg; aborted = true; }
    // a new generation wakes every waiter, which then sees `aborted`
    next_generation(bar);
    for (unsigned w = 0; w < nwarps; ++w) next_generation(warp_bar[w]);
    for (unsigned g = 0; g < (nwarps + 3) / 4; ++g) next_generation(wg_bar[g]);
    for (Barrier& b : named) next_generation(b);
    next_generation(mbar_gen);
}

std::string Block::bulk_in_flight_message() const {
    return "block " + where() + " of kernel " + kernel + " ended with " + std::to_string(bulk.size()) +
           " cp.async.bulk cop" + (bulk.size() == 1 ? "y" : "ies") +
           " still in flight (issued by thread " + std::to_string(bulk.front().tid) +
           "): no thread waited on their mbarrier";
}

std::string Block::deadlock_message() const {
    unsigned at_sync = bar.waiters, at_warp = 0;
    for (unsigned w = 0; w < nwarps; ++w) at_warp += warp_bar[w].waiters;
    for (unsigned g = 0; g < (nwarps + 3) / 4; ++g) at_warp += wg_bar[g].waiters;
    for (const Barrier& b : named) at_warp += b.waiters;
    return "deadlock in block " + where() + ": " + std::to_string(at_sync) +
           " thread(s) wait at __syncthreads(), " + std::to_string(at_warp) +
           " at a warp collective (shuffle/ballot/__syncwarp/mma/ldmatrix, a warpgroup's wgmma.wait_group, or a named barrier), " +
           (mbar_waiters ? std::to_string(mbar_waiters) +
                               " at an mbarrier wait (a phase no arrival or bulk copy left can complete), "
                         : std::string()) +
           std::to_string(nthreads - live) + " of " + std::to_string(nthreads) +
           " returned; a barrier is not reached by every thread (divergent __syncthreads or collective)";
}

void Block::arrive_and_wait_locked(Barrier& b) {
    unsigned g = 0;
    bool last;
    {
        std::lock_guard<BlockMutex> lk(mu);
        if (aborted) throw KernelAbort{};
        last = ++b.arrived == b.expected;
        if (last) {
            release(b);
        } else {
            g = b.gen.load(std::memory_order_relaxed);
            ++b.waiters; ++waiting;
            if (waiting == live && !land_bulk_locked()) {  // nobody left who could complete any barrier
                abort_locked(deadlock_message());
                throw KernelAbort{};
            }
        }
    }
#if CUFLASH_EMULATOR_THREADS
    if (last) return;
    while (b.gen.load(std::memory_order_acquire) == g) b.gen.wait(g, std::memory_order_acquire);
#else
    // The last to arrive steps aside too, so that the threads of a block
    // run the code between two barriers in the scheduler's order.
    if (last) fibers->yield();
    else fibers->wait(b.gen, g);
#endif
    if (aborted) throw KernelAbort{};
}

void Block::thread_exit(unsigned warp) {
    TsanQuiet quiet;
    std::lock_guard<BlockMutex> lk(mu);
    --live;
    for (Barrier* b : {&bar, &warp_bar[warp], &wg_bar[warp / 4]}) {
        --b->expected;
        if (b->arrived > 0 && b->arrived == b->expected) release(*b);
    }
    if (!aborted && live > 0 && waiting == live && !land_bulk_locked()) abort_locked(deadlock_message());
    if (!aborted && live == 0 && !bulk.empty()) abort_locked(bulk_in_flight_message());
}

[[noreturn]] void Block::fail(const std::string& msg) {
    {
        TsanQuiet quiet;
        std::lock_guard<BlockMutex> lk(mu);
        abort_locked(msg);
    }
    throw KernelAbort{};
}

void set_buffers(const unsigned long long* ranges, const unsigned* args, unsigned n) {
    memcheck.bufs.clear();
    for (unsigned i = 0; i < n; ++i)
        memcheck.bufs.push_back(GlobalBuf{uintptr_t(ranges[2 * i]), uintptr_t(ranges[2 * i + 1]), args[i]});
}

std::string profile_text() {
    std::string out;
    char buf[512];
    static const char* const kinds[] = {"shared_load", "shared_store", "ldmatrix", "cp.async_shared",
                                        "global_load", "global_store", "global_atomic", "cp.async_global"};
    for (const auto& [k, st] : profile.sites) {
        std::string pc = "-";
        Dl_info info{};
        if (k.pc && dladdr(k.pc, &info) && info.dli_fbase)
            pc = hex(reinterpret_cast<uintptr_t>(k.pc) - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1);
        std::snprintf(buf, sizeof buf, "site\t%s\t%u\t%s\t%s\t%d\t%llu\t%llu\t%llu\t%llu\n", kinds[k.kind], k.size,
                      pc.c_str(), k.file ? k.file : "-", k.line, st.requests, st.lanes, st.wavefronts, st.ideal);
        out += buf;
    }
    for (unsigned i = 0; i < CNT_NCLASSES; ++i) {
        std::snprintf(buf, sizeof buf, "count\t%s\t%llu\n", kCountNames[i], profile.counts[i]);
        out += buf;
    }
    return out;
}

int launch(const char* name, void (*entry)(void**), void** args, const unsigned* grid,
           const unsigned* block, unsigned long long shmem, unsigned long long* stats,
           char* err, size_t errlen, unsigned flags) {
    const unsigned nthreads = block[0] * block[1] * block[2];
    const unsigned long long nblocks = 1ull * grid[0] * grid[1] * grid[2];
    Block blk(nthreads, name);
    // Dynamic shared memory: one buffer, 0xff bytes (NaN in every float type) before each block,
    // in the middle of the memcheck window (see memcheck above; pages are only committed when
    // touched, so the window costs address space, not memory).
    const size_t dyn_bytes = shmem ? shmem : 16;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t map_bytes = 2 * kSharedWindow + (dyn_bytes + page - 1) / page * page;
    void* map = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) {
        std::snprintf(err, errlen, "could not map %zu bytes of address space for the shared memory", map_bytes);
        return 1;
    }
    std::unique_ptr<unsigned char, std::function<void(unsigned char*)>> dyn(
        static_cast<unsigned char*>(map) + kSharedWindow,
        [map, map_bytes](unsigned char*) { munmap(map, map_bytes); });
    struct MemcheckScope {  // the window is checked only while this launch runs
        MemcheckScope(uintptr_t lo, size_t size, uintptr_t d, size_t n, bool on, bool prof) {
            memcheck.win_lo = lo; memcheck.win_size = on || prof ? size : 0;
            memcheck.dyn_lo = d; memcheck.dyn_hi = d + n;
            memcheck.global_on = on; memcheck.shared_on = on; memcheck.profile = prof; memcheck.last = 0;
            if (prof) profile.clear();
        }
        ~MemcheckScope() {
            memcheck.win_size = 0; memcheck.global_on = memcheck.shared_on = memcheck.profile = false;
            memcheck.bufs.clear();
        }
    } memcheck_scope(reinterpret_cast<uintptr_t>(map), map_bytes, reinterpret_cast<uintptr_t>(dyn.get()), shmem,
                     (flags & LAUNCH_MEMCHECK) != 0, (flags & LAUNCH_PROFILE) != 0);
    std::vector<ThreadCtx> ctxs(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) {
        ThreadCtx& c = ctxs[t];
        c.blockDim = dim3(block[0], block[1], block[2]);
        c.gridDim = dim3(grid[0], grid[1], grid[2]);
        c.threadIdx = uint3{t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
        c.tid = t; c.lane = t % 32; c.warp = t / 32;
        c.blk = &blk;
        c.dyn_smem = dyn.get();
        c.record_stores = (flags & LAUNCH_CHECK_INTERBLOCK) != 0;
        c.record_atomics = (flags & LAUNCH_CHECK_ATOMIC_ORDER) != 0;
    }
    // Before block b (every thread is between blocks).
    blk.threads = ctxs.data();
    auto begin_block = [&](unsigned long long b) {
        if (b > 0 && memcheck.profile) profile_block(ctxs);
        blk.reset();
        std::memset(dyn.get(), 0xff, dyn_bytes);
        if (flags & LAUNCH_PROXY_CHECK) blk.proxy.assign(dyn_bytes, 0u);
    };
    // One CUDA thread's part of block b.  The catch blocks only record the
    // error: the fiber engine must not switch inside one.
    auto run_thread = [&](ThreadCtx& c, unsigned long long b) {
        c.block_lin = b;
        c.blockIdx = uint3{unsigned(b % grid[0]), unsigned((b / grid[0]) % grid[1]),
                           unsigned(b / (1ull * grid[0] * grid[1]))};
        c.xphase = 0; c.bar_phase = 0; c.wg_phase = 0; c.named_phase = 0; c.proxy_gen = 0;
        std::fill(std::begin(c.named_gen), std::end(c.named_gen), 0u);
        c.cp_open.clear(); c.cp_groups.clear();
        c.wg_open.clear(); c.wg_groups.clear(); c.wg_fenced = false;
        try {
            entry(args);
            if (const WgmmaOp* first = wgmma_first_in_flight(c)) {
                TsanQuiet quiet;
                std::lock_guard<BlockMutex> lk(blk.mu);
                blk.abort_locked("thread " + fmt_idx(c.threadIdx) + " of block " + fmt_idx(c.blockIdx) +
                                 " returned with a wgmma.mma_async in flight (issued at " + first->file + ":" +
                                 std::to_string(first->line) + "; no wgmma.wait_group completed it)");
            }
        } catch (const KernelAbort&) {
        } catch (const std::exception& e) {
            TsanQuiet quiet;
            std::lock_guard<BlockMutex> lk(blk.mu);
            blk.abort_locked(std::string("C++ exception in device code: ") + e.what());
        } catch (...) {
            TsanQuiet quiet;
            std::lock_guard<BlockMutex> lk(blk.mu);
            blk.abort_locked("unknown C++ exception in device code");
        }
        blk.thread_exit(c.warp);
    };
    const std::string start_error = run_blocks(name, nthreads, nblocks, blk, ctxs, begin_block, run_thread);
    if (!start_error.empty()) {
        std::snprintf(err, errlen, "%s", start_error.c_str());
        return 1;
    }
    if (memcheck.profile) profile_block(ctxs);
    unsigned long long rd = 0, wr = 0;
    for (const ThreadCtx& c : ctxs) { rd += c.bytes_read; wr += c.bytes_written; }
    stats[0] = rd; stats[1] = wr;
    if (blk.aborted) {
        std::snprintf(err, errlen, "%s", blk.error.c_str());
        return 1;
    }
    if (flags & LAUNCH_CHECK_INTERBLOCK) {
        const std::string race = check_interblock_stores(ctxs, name, grid);
        if (!race.empty()) {
            std::snprintf(err, errlen, "%s", race.c_str());
            return 2;
        }
    }
    if (flags & LAUNCH_CHECK_ATOMIC_ORDER) {
        const std::string order = check_atomic_order(ctxs, name, grid);
        if (!order.empty()) {
            std::snprintf(err, errlen, "%s", order.c_str());
            return 3;
        }
    }
    return 0;
}

}  // namespace cuflash_emu

size_t __cvta_generic_to_shared(const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t lo = ::cuflash_emu::memcheck.dyn_lo, hi = ::cuflash_emu::memcheck.dyn_hi;
    if (a < lo || a > hi)
        ::cuflash_emu::device_error("__cvta_generic_to_shared: the pointer is not in the dynamic shared memory "
                                    "(the emulator gives shared addresses to the dynamic shared memory only)");
    return a - lo;
}

// The hooks that -fsanitize=kernel-address code calls at every load and store (see the memcheck
// in cuda_host.h).
#if CUFLASH_EMULATOR_MEMCHECK
#define CUFLASH_ASAN_HOOK(N)                                                                         \
    extern "C" __attribute__((visibility("hidden"))) void __asan_load##N##_noabort(uintptr_t a) {  \
        ::cuflash_emu::raw_access(a, N, false, __builtin_return_address(0));                        \
    }                                                                                               \
    extern "C" __attribute__((visibility("hidden"))) void __asan_store##N##_noabort(uintptr_t a) { \
        ::cuflash_emu::raw_access(a, N, true, __builtin_return_address(0));                         \
    }
CUFLASH_ASAN_HOOK(1)
CUFLASH_ASAN_HOOK(2)
CUFLASH_ASAN_HOOK(4)
CUFLASH_ASAN_HOOK(8)
CUFLASH_ASAN_HOOK(16)
#undef CUFLASH_ASAN_HOOK
extern "C" __attribute__((visibility("hidden"))) void __asan_loadN_noabort(uintptr_t a, size_t n) {
    ::cuflash_emu::raw_access(a, unsigned(n), false, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) void __asan_storeN_noabort(uintptr_t a, size_t n) {
    ::cuflash_emu::raw_access(a, unsigned(n), true, __builtin_return_address(0));
}
extern "C" __attribute__((visibility("hidden"))) void __asan_handle_no_return() {}
// (the check of the order of dynamic initialisers: nothing to do here)
extern "C" __attribute__((visibility("hidden"))) void __asan_before_dynamic_init(const char*) {}
extern "C" __attribute__((visibility("hidden"))) void __asan_after_dynamic_init() {}
#endif

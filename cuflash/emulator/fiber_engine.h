// fiber_engine.h -- the emulator's default execution engine: the CUDA threads
// of a block as fibers (user-space contexts) on ONE OS thread.
//
// Included by cuda_host.h, which uses it unless CUFLASH_EMULATOR_THREADS is
// set (ThreadSanitizer builds: race checks need real threads).  Nothing here
// knows about CUDA; cuda_host.h drives it:
//
//   * FiberScheduler::start() puts every fiber at the top of its stack;
//     round() then resumes, one after another, every fiber that is not
//     waiting, each until it waits (wait(): until a barrier generation
//     counter moves on) or yields or returns.  A switch costs 15-20 ns and
//     no system call (x86-64, measured with 128 fibers), where a futex round
//     trip between real threads cost tens of microseconds per barrier.
//   * The order inside a round is the fiber index (fixed and reproducible)
//     or, for debugging, a pseudo-random permutation drawn anew every round.
//   * Fibers are not preempted: one that busy-waits for another fiber (a
//     flag in shared memory, no barrier) spins for ever; the launch watchdog
//     (cuda_host.h) ends the process then.
//
// Why a hand-written switch: glibc's swapcontext saves and restores the
// signal mask with an rt_sigprocmask system call on every switch, which would
// keep much of the cost that fibers remove.  Between fibers only what the
// calling convention says a function must preserve has to move, since a
// switch is an ordinary function call for both sides:
//   x86-64 (System V): rbx, rbp, r12-r15, rsp, and the control bits of MXCSR
//                      and of the x87 control word;
//   aarch64 (AAPCS64): x19-x28, x29 (frame), x30 (link), sp, d8-d15, FPCR.
// Other targets (or -DCUFLASH_EMULATOR_UCONTEXT=1) use ucontext.
//
// Stacks: mmap'ed, CUFLASH_EMULATOR_STACK_KB KiB each (default 256; the
// largest kernel frame in kernels_cu/, flash_bwd_dkdv for float64 and
// d = 256, is 2.4 KiB), with a 64 KiB PROT_NONE guard region below.  A fiber
// that runs into it gets a SIGSEGV, which a handler installed by the first
// fiber launch recognises: it prints the kernel, block and thread whose stack
// overflowed and the variable to raise, then aborts the process (the stack
// is gone, the launch cannot be unwound).  Stacks are kept in one pool for
// the process and reused by later launches.
//
// Constraints for the code running on fibers (kept by cuda_host.h):
//   * never switch while holding a lock (all fibers share one OS thread);
//   * never switch inside a catch block: the C++ runtime's record of the
//     exceptions being handled is per OS thread, not per fiber;
//   * per-OS-thread state (thread_local, errno) is shared by the fibers:
//     whatever a fiber needs of its own goes through the one thread_local
//     context pointer, which the scheduler sets (activate hook) before it
//     resumes a fiber.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(CUFLASH_EMULATOR_UCONTEXT) && (defined(__x86_64__) || defined(__aarch64__))
#define CUFLASH_FIBER_ASM 1
#else
#define CUFLASH_FIBER_ASM 0
#include <ucontext.h>
#endif

// ---------------------------------------------------------------- context switch
#if CUFLASH_FIBER_ASM
// cuflash_emu_fiber_switch(void** save_sp, void* load_sp): push the callee-
// saved state on the current stack, store the stack pointer in *save_sp, load
// load_sp and pop the state saved there; `ret` then continues wherever that
// stack last called the switch.  cuflash_emu_fiber_entry is where a new
// fiber's first switch "returns" to: it calls fn(arg) from the two registers
// that fiber_prepare() put on the new stack.  Symbols are weak (a second
// copy in one library would be harmless) and hidden (each kernel library has
// its own, as with the rest of cuda_host.h).
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .weak   cuflash_emu_fiber_switch
    .hidden cuflash_emu_fiber_switch
    .type   cuflash_emu_fiber_switch, @function
cuflash_emu_fiber_switch:
    .cfi_startproc
    pushq   %rbp
    .cfi_adjust_cfa_offset 8
    pushq   %rbx
    .cfi_adjust_cfa_offset 8
    pushq   %r12
    .cfi_adjust_cfa_offset 8
    pushq   %r13
    .cfi_adjust_cfa_offset 8
    pushq   %r14
    .cfi_adjust_cfa_offset 8
    pushq   %r15
    .cfi_adjust_cfa_offset 8
    pushq   $0
    .cfi_adjust_cfa_offset 8
    stmxcsr (%rsp)
    fnstcw  4(%rsp)
    movq    %rsp, (%rdi)
    movq    %rsp, %rcx
    movq    %rsi, %rsp
    # Load the target's MXCSR and x87 control word only where they differ
    # from the current ones (ldmxcsr/fldcw are slow, and they hardly ever
    # differ); MXCSR's exception flags (bits 0-5) are not compared: callers do
    # not expect them preserved, and almost any float operation sets some.
    movq    (%rsp), %rax
    xorq    (%rcx), %rax
    andq    $-64, %rax
    jz      1f
    ldmxcsr (%rsp)
    fldcw   4(%rsp)
1:
    addq    $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq    %r15
    .cfi_adjust_cfa_offset -8
    popq    %r14
    .cfi_adjust_cfa_offset -8
    popq    %r13
    .cfi_adjust_cfa_offset -8
    popq    %r12
    .cfi_adjust_cfa_offset -8
    popq    %rbx
    .cfi_adjust_cfa_offset -8
    popq    %rbp
    .cfi_adjust_cfa_offset -8
    ret
    .cfi_endproc
    .size   cuflash_emu_fiber_switch, .-cuflash_emu_fiber_switch

    .p2align 4
    .weak   cuflash_emu_fiber_entry
    .hidden cuflash_emu_fiber_entry
    .type   cuflash_emu_fiber_entry, @function
cuflash_emu_fiber_entry:
    .cfi_startproc
    .cfi_undefined rip
    movq    %rbx, %rdi
    callq   *%r12
    ud2
    .cfi_endproc
    .size   cuflash_emu_fiber_entry, .-cuflash_emu_fiber_entry
)");
#else  // __aarch64__
asm(R"(
    .text
    .p2align 4
    .weak   cuflash_emu_fiber_switch
    .hidden cuflash_emu_fiber_switch
    .type   cuflash_emu_fiber_switch, %function
cuflash_emu_fiber_switch:
    .cfi_startproc
    sub     sp, sp, #176
    .cfi_adjust_cfa_offset 176
    stp     x19, x20, [sp, #0]
    stp     x21, x22, [sp, #16]
    stp     x23, x24, [sp, #32]
    stp     x25, x26, [sp, #48]
    stp     x27, x28, [sp, #64]
    stp     x29, x30, [sp, #80]
    stp     d8,  d9,  [sp, #96]
    stp     d10, d11, [sp, #112]
    stp     d12, d13, [sp, #128]
    stp     d14, d15, [sp, #144]
    mrs     x9, fpcr
    str     x9, [sp, #160]
    mov     x9, sp
    str     x9, [x0]
    mov     sp, x1
    ldr     x9, [sp, #160]
    msr     fpcr, x9
    ldp     d14, d15, [sp, #144]
    ldp     d12, d13, [sp, #128]
    ldp     d10, d11, [sp, #112]
    ldp     d8,  d9,  [sp, #96]
    ldp     x29, x30, [sp, #80]
    ldp     x27, x28, [sp, #64]
    ldp     x25, x26, [sp, #48]
    ldp     x23, x24, [sp, #32]
    ldp     x21, x22, [sp, #16]
    ldp     x19, x20, [sp, #0]
    add     sp, sp, #176
    .cfi_adjust_cfa_offset -176
    ret
    .cfi_endproc
    .size   cuflash_emu_fiber_switch, .-cuflash_emu_fiber_switch

    .p2align 4
    .weak   cuflash_emu_fiber_entry
    .hidden cuflash_emu_fiber_entry
    .type   cuflash_emu_fiber_entry, %function
cuflash_emu_fiber_entry:
    .cfi_startproc
    .cfi_undefined x30
    mov     x0, x19
    blr     x20
    brk     #1
    .cfi_endproc
    .size   cuflash_emu_fiber_entry, .-cuflash_emu_fiber_entry
)");
#endif
extern "C" void cuflash_emu_fiber_switch(void** save_sp, void* load_sp);
extern "C" void cuflash_emu_fiber_entry();
#endif  // CUFLASH_FIBER_ASM

namespace cuflash_emu {

// A suspended fiber (or the scheduler while a fiber runs).
struct FiberContext {
#if CUFLASH_FIBER_ASM
    void* sp = nullptr;  // where the switch saved the callee-saved state
#else
    ucontext_t uc;
#endif
};

// Save the running context in `from`, continue `to`.
inline void fiber_switch(FiberContext& from, FiberContext& to) {
#if CUFLASH_FIBER_ASM
    cuflash_emu_fiber_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

#if !CUFLASH_FIBER_ASM
// makecontext passes int arguments only: the pointers travel in halves.
inline void fiber_ucontext_entry(unsigned fn_hi, unsigned fn_lo, unsigned arg_hi, unsigned arg_lo) {
    auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(fn_hi) << 16 << 16) | fn_lo);
    fn(reinterpret_cast<void*>((uintptr_t(arg_hi) << 16 << 16) | arg_lo));
    std::abort();  // fn never returns: a finished fiber switches away for good
}
#endif

// Make `ctx` start fn(arg) on the stack [lo, lo + size) at its next switch.
inline void fiber_prepare(FiberContext& ctx, char* lo, size_t size, void (*fn)(void*), void* arg) {
#if CUFLASH_FIBER_ASM
    char* top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(lo + size) & ~uintptr_t(15));
#if defined(__x86_64__)
    // The frame cuflash_emu_fiber_switch pops, lowest address first:
    //   [0] MXCSR | x87 control word, [1] r15, [2] r14, [3] r13, [4] r12 = fn,
    //   [5] rbx = arg, [6] rbp = 0 (end of the frame-pointer chain),
    //   [7] return address = cuflash_emu_fiber_entry.
    // After the `ret` rsp = top - 16, 16-byte aligned as a `call` needs.
    uint64_t* f = reinterpret_cast<uint64_t*>(top - 16 - 8 * 8);
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    f[0] = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
    f[1] = f[2] = f[3] = 0;
    f[4] = reinterpret_cast<uint64_t>(fn);
    f[5] = reinterpret_cast<uint64_t>(arg);
    f[6] = 0;
    f[7] = reinterpret_cast<uint64_t>(&cuflash_emu_fiber_entry);
    ctx.sp = f;
#else  // __aarch64__: the 176-byte frame of cuflash_emu_fiber_switch
    uint64_t* f = reinterpret_cast<uint64_t*>(top - 176);
    std::memset(f, 0, 176);
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    f[0] = reinterpret_cast<uint64_t>(arg);                       // x19
    f[1] = reinterpret_cast<uint64_t>(fn);                        // x20
    f[10] = 0;                                                    // x29: end of the frame chain
    f[11] = reinterpret_cast<uint64_t>(&cuflash_emu_fiber_entry); // x30: where `ret` goes
    f[20] = fpcr;
    ctx.sp = f;
#endif
#else
    getcontext(&ctx.uc);
    ctx.uc.uc_stack.ss_sp = lo;
    ctx.uc.uc_stack.ss_size = size;
    ctx.uc.uc_link = nullptr;
    const uintptr_t pf = reinterpret_cast<uintptr_t>(fn), pa = reinterpret_cast<uintptr_t>(arg);
    makecontext(&ctx.uc, reinterpret_cast<void (*)()>(&fiber_ucontext_entry), 4,
                unsigned(pf >> 16 >> 16), unsigned(pf & 0xffffffffu),
                unsigned(pa >> 16 >> 16), unsigned(pa & 0xffffffffu));
#endif
}

// ---------------------------------------------------------------- stacks
constexpr size_t kFiberGuardBytes = 64 * 1024;  // more than any single frame steps over
// The tops of the stacks are staggered by multiples of 1088 bytes within
// this span: stacks a multiple of 64 KiB apart would put every fiber's top
// frames into the same cache sets, and a round over 128 fibers would then
// miss the cache at every switch (twice the switch time, measured).
constexpr size_t kFiberColourSpan = 16 * 1024;

// Fills a buffer for the async-signal-safe overflow report.
struct SigText {
    char buf[512];
    size_t n = 0;
    void put(const char* s) { while (*s && n + 1 < sizeof buf) buf[n++] = *s++; }
    void put_u(unsigned long long v) {
        char t[24]; int k = 0;
        do { t[k++] = char('0' + v % 10); v /= 10; } while (v);
        while (k && n + 1 < sizeof buf) buf[n++] = t[--k];
    }
};

// Describes the fiber that overflowed (set by cuda_host.h: kernel, block, thread).
using FiberDescribe = void (*)(const void* user, SigText& out);

// One mapping: [guard | stack].  Records are never freed or unmapped (the
// pool reuses them), so the SIGSEGV handler can read the list without locks.
struct FiberStack {
    char* guard = nullptr;  // lowest address; PROT_NONE
    char* lo = nullptr;     // usable stack [lo, lo + size)
    size_t size = 0;        // at least the size asked for
    size_t asked = 0;       // the size asked for (pool key)
    std::atomic<const char*> owner{nullptr};  // kernel name while a launch uses it
    std::atomic<const void*> user{nullptr};   // the running fiber's context, for the report
    std::atomic<FiberDescribe> describe{nullptr};  // how to print `user`
    FiberStack* next_all = nullptr;           // list of every stack of the pool
};

// The stacks of the fibers, pooled for the whole process: each kernel library
// has the code, and the Python side hands the first library's pool to every
// library it loads after it (__cuflash_fiber_pool below).  Pools per library
// held ~14,000 stacks after the test suite's 106 libraries -- 29,000 memory
// maps of the 65,530 Linux allows, and every stack's touched pages; one pool
// holds what the largest concurrent launches need.  Sharing data between
// libraries is sound because all of a process's libraries are built from this
// header's text (part of their cache key); the ABI number and size checked in
// adopt() guard against anything else.
class FiberStackPool {
public:
    static constexpr unsigned kAbi = 1;  // bump when FiberStackPool or FiberStack change

    static FiberStackPool& get() {
        FiberStackPool* p = slot().load(std::memory_order_acquire);
        if (p) return *p;
        FiberStackPool* mine = new FiberStackPool;  // never destroyed: the handler may run at exit
        if (slot().compare_exchange_strong(p, mine, std::memory_order_acq_rel)) return *mine;
        delete mine;  // another thread was first
        return *p;
    }

    // From now on use `shared` (another library's pool, or nullptr), unless
    // this library has a pool already or `shared` is of another layout.
    // Returns the pool this library uses.
    static FiberStackPool* adopt(FiberStackPool* shared) {
        FiberStackPool* none = nullptr;
        if (shared && shared->abi_ == kAbi && shared->bytes_ == sizeof(FiberStackPool))
            slot().compare_exchange_strong(none, shared, std::memory_order_acq_rel);
        return &get();
    }

    // `n` stacks of `size` bytes (rounded up to pages); false and `err` if mmap fails.
    // `owner` (the kernel) and describe(users[i]) name a stack's fiber in an overflow report.
    bool take(unsigned n, size_t size, const char* owner, FiberDescribe describe, void* const* users,
              std::vector<FiberStack*>& out, std::string& err) {
        if (!take_stacks(n, size, out, err)) return false;
        for (unsigned i = 0; i < n; ++i) {
            out[i]->owner.store(owner, std::memory_order_relaxed);
            out[i]->describe.store(describe, std::memory_order_relaxed);
            out[i]->user.store(users[i], std::memory_order_release);
        }
        return true;
    }

    void give_back(std::vector<FiberStack*>& stacks) {
        std::lock_guard<std::mutex> lk(mu_);
        for (FiberStack* s : stacks) {
            s->user.store(nullptr, std::memory_order_relaxed);
            free_.push_back(s);
        }
        stacks.clear();
    }

private:
    const unsigned abi_ = kAbi;  // first: read by adopt() whatever the layout
    const unsigned bytes_ = sizeof(FiberStackPool);
    std::mutex mu_;
    std::vector<FiberStack*> free_;
    std::atomic<FiberStack*> all_{nullptr};
    size_t mapped_ = 0;  // stacks mapped so far (their colours)
    std::once_flag handler_once_;
    struct sigaction previous_ {};

    static std::atomic<FiberStackPool*>& slot() {  // this library's pool
        static std::atomic<FiberStackPool*> pool{nullptr};
        return pool;
    }

    bool take_stacks(unsigned n, size_t size, std::vector<FiberStack*>& out, std::string& err) {
        install_handler();
        const size_t page = size_t(sysconf(_SC_PAGESIZE));
        size = (size + page - 1) / page * page;
        std::lock_guard<std::mutex> lk(mu_);
        out.clear();
        for (size_t i = free_.size(); i-- > 0 && out.size() < n;) {
            if (free_[i]->asked == size) { out.push_back(free_[i]); free_.erase(free_.begin() + i); }
        }
        while (out.size() < n) {
            const size_t bytes = kFiberGuardBytes + size + kFiberColourSpan;
            void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
            if (p == MAP_FAILED || mprotect(p, kFiberGuardBytes, PROT_NONE) != 0) {
                err = std::string("could not map ") + std::to_string(n) + " fiber stacks of " +
                      std::to_string(size / 1024) + " KiB: " + std::strerror(errno);
                if (p != MAP_FAILED) munmap(p, bytes);
                for (FiberStack* s : out) free_.push_back(s);
                out.clear();
                return false;
            }
            FiberStack* s = new FiberStack;
            s->guard = static_cast<char*>(p);
            s->lo = s->guard + kFiberGuardBytes;
            s->asked = size;
            s->size = size + kFiberColourSpan - (1088 * mapped_++) % kFiberColourSpan;
            s->next_all = all_.load(std::memory_order_relaxed);
            all_.store(s, std::memory_order_release);  // published after it is complete
            out.push_back(s);
        }
        return true;
    }

    // The pool whose stacks the SIGSEGV handler of this library watches: the
    // handler is installed once per pool, by the first library that maps stacks.
    static FiberStackPool*& handler_pool() {
        static FiberStackPool* pool = nullptr;
        return pool;
    }

    void install_handler() {
        std::call_once(handler_once_, [this] {
            handler_pool() = this;
            struct sigaction sa {};
            sa.sa_sigaction = &FiberStackPool::on_segv;
            sa.sa_flags = SA_SIGINFO | SA_ONSTACK;  // the overflowed stack cannot run the handler
            sigemptyset(&sa.sa_mask);
            sigaction(SIGSEGV, &sa, &previous_);
        });
    }

    static void on_segv(int sig, siginfo_t* si, void* uc) {
        FiberStackPool& self = *handler_pool();
        const char* a = static_cast<const char*>(si->si_addr);
        for (FiberStack* s = self.all_.load(std::memory_order_acquire); s; s = s->next_all) {
            if (a < s->guard || a >= s->lo) continue;
            SigText t;
            t.put("cuflash.emulator: stack overflow in kernel ");
            const char* k = s->owner.load(std::memory_order_relaxed);
            t.put(k ? k : "?");
            const void* u = s->user.load(std::memory_order_relaxed);
            if (FiberDescribe d = s->describe.load(std::memory_order_relaxed); u && d) d(u, t);
            t.put(": the fiber stack of ");
            t.put_u(s->asked / 1024);
            t.put(" KiB is exhausted (set CUFLASH_EMULATOR_STACK_KB to enlarge it). Aborting.\n");
            ssize_t w = write(2, t.buf, t.n);
            (void)w;
            std::abort();
        }
        // Not a fiber stack: hand the signal to whoever had it before.
        const struct sigaction& p = self.previous_;
        if (p.sa_flags & SA_SIGINFO) {
            p.sa_sigaction(sig, si, uc);
        } else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN) {
            p.sa_handler(sig);
        } else {
            // default action: restore it; the faulting instruction runs again and faults for real
            struct sigaction d {};
            d.sa_handler = SIG_DFL;
            sigemptyset(&d.sa_mask);
            sigaction(sig, &d, nullptr);
        }
    }
};

// The handler needs an alternate signal stack on the OS thread that runs the
// fibers.  Keeps the thread's own if it has one (Python's faulthandler sets
// one on the main thread), else sets one for the lifetime of this object.
class AltSignalStack {
public:
    AltSignalStack() {
        stack_t cur {};
        if (sigaltstack(nullptr, &cur) == 0 && !(cur.ss_flags & SS_DISABLE)) return;
        mem_.reset(new char[kBytes]);
        stack_t ss {};
        ss.ss_sp = mem_.get();
        ss.ss_size = kBytes;
        ss.ss_flags = 0;
        if (sigaltstack(&ss, nullptr) != 0) mem_.reset();
    }
    ~AltSignalStack() {
        if (!mem_) return;
        stack_t ss {};
        ss.ss_flags = SS_DISABLE;
        sigaltstack(&ss, nullptr);
    }
    AltSignalStack(const AltSignalStack&) = delete;
    AltSignalStack& operator=(const AltSignalStack&) = delete;

private:
    static constexpr size_t kBytes = 64 * 1024;
    std::unique_ptr<char[]> mem_;
};

// ---------------------------------------------------------------- scheduler
class FiberScheduler {
public:
    using Body = void (*)(void* closure, unsigned fiber) noexcept;

    // `users[i]` is handed to `activate` before fiber i runs (cuda_host.h: sets tctx).
    FiberScheduler(unsigned n, void (*activate)(void*), void* const* users)
        : fibers_(n), order_(n), activate_(activate) {
        for (unsigned i = 0; i < n; ++i) {
            fibers_[i].sched = this;
            fibers_[i].index = i;
            fibers_[i].user = users[i];
            order_[i] = i;
        }
    }
    ~FiberScheduler() { FiberStackPool::get().give_back(stacks_); }
    FiberScheduler(const FiberScheduler&) = delete;
    FiberScheduler& operator=(const FiberScheduler&) = delete;

    // Stacks from the pool; `owner` and describe() name a fiber in an overflow report.
    bool allocate(size_t stack_bytes, const char* owner, FiberDescribe describe, std::string& err) {
        std::vector<void*> users(fibers_.size());
        for (size_t i = 0; i < fibers_.size(); ++i) users[i] = fibers_[i].user;
        if (!FiberStackPool::get().take(unsigned(fibers_.size()), stack_bytes, owner, describe, users.data(),
                                        stacks_, err))
            return false;
        for (size_t i = 0; i < fibers_.size(); ++i) fibers_[i].stack = stacks_[i];
        return true;
    }

    // Order of the fibers within a round: fixed (index order) or a fresh
    // pseudo-random permutation every round, from `seed`.
    void set_random_order(bool on, uint64_t seed) { random_ = on; rng_ = seed; }

    // Every fiber starts body(closure, i) from the top of its stack.
    void start(Body body, void* closure) {
        body_ = body;
        closure_ = closure;
        for (Fiber& f : fibers_) {
            fiber_prepare(f.ctx, f.stack->lo, f.stack->size, &Fiber::entry, &f);
            f.wait = nullptr;
            f.done = false;
        }
        unfinished_ = unsigned(fibers_.size());
    }

    unsigned unfinished() const { return unfinished_; }

    // Resume each fiber that can run, once; false when none could.
    bool round() {
        if (random_) shuffle_order();
        bool ran = false;
        for (unsigned i : order_) {
            Fiber& f = fibers_[i];
            if (f.done) continue;
            if (f.wait) {
                if (f.wait->load(std::memory_order_acquire) == f.wait_value) continue;
                f.wait = nullptr;
            }
            current_ = &f;
            activate_(f.user);
            fiber_switch(main_, f.ctx);
            ran = true;
            if (f.done) --unfinished_;
        }
        current_ = nullptr;
        return ran;
    }

    // From a fiber: suspend until `gen` no longer holds `g` (a barrier completed).
    void wait(const std::atomic<unsigned>& gen, unsigned g) {
        Fiber& f = *current_;
        f.wait = &gen;
        f.wait_value = g;
        fiber_switch(f.ctx, main_);
    }

    // From a fiber: let the others of this round run first.
    void yield() { fiber_switch(current_->ctx, main_); }

private:
    struct Fiber {
        FiberContext ctx;
        FiberScheduler* sched = nullptr;
        FiberStack* stack = nullptr;
        void* user = nullptr;
        const std::atomic<unsigned>* wait = nullptr;  // runnable again when *wait != wait_value
        unsigned wait_value = 0;
        unsigned index = 0;
        bool done = true;

        // Bottom of every fiber stack.  Never returns: a finished fiber
        // switches back to the scheduler for good, and start() prepares its
        // stack afresh for the next block.
        static void entry(void* p) {
            Fiber& f = *static_cast<Fiber*>(p);
            f.sched->body_(f.sched->closure_, f.index);
            f.done = true;
            fiber_switch(f.ctx, f.sched->main_);
            std::abort();
        }
    };

    void shuffle_order() {
        for (unsigned i = unsigned(order_.size()); i > 1; --i) {
            // splitmix64
            uint64_t z = (rng_ += 0x9e3779b97f4a7c15ull);
            z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
            z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
            z ^= z >> 31;
            std::swap(order_[i - 1], order_[unsigned(z % i)]);
        }
    }

    std::vector<Fiber> fibers_;
    std::vector<unsigned> order_;
    std::vector<FiberStack*> stacks_;
    void (*activate_)(void*);
    FiberContext main_;
    Fiber* current_ = nullptr;
    Body body_ = nullptr;
    void* closure_ = nullptr;
    unsigned unfinished_ = 0;
    bool random_ = false;
    uint64_t rng_ = 0;
};

}  // namespace cuflash_emu

// For cuflash.emulator._module, once per loaded library: nullptr -> this
// library's stack pool; another library's pool -> use that one from now on.
// Returns the pool in use.  (Weak rather than inline: an inline function that
// nothing in the library calls would not be emitted at all.)
extern "C" __attribute__((visibility("default"), weak)) void* __cuflash_fiber_pool(void* shared) {
    return ::cuflash_emu::FiberStackPool::adopt(static_cast<::cuflash_emu::FiberStackPool*>(shared));
}

// The engine kernels of engine.cu launched through cuflash_emu::launch
// directly, without Python, checking their own results: a program that can
// be cross-compiled and run under qemu-user, so that the context switch of
// another architecture (aarch64) is exercised on an x86-64 machine
// (tests/emulator/test_emulator_engine.py; build with cuda_host.h force-included).
// With the argument `overflow` it overflows a fiber stack instead.
#include "engine.cu"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CUFLASH_ENTRY(k) static void entry_##k(void** a) { ::cuflash_emu::invoke(k, a); }
CUFLASH_ENTRY(deep_stack)
CUFLASH_ENTRY(rounding_per_thread)
CUFLASH_ENTRY(fail_midway)
CUFLASH_ENTRY(live_objects)
CUFLASH_ENTRY(first_writer)
CUFLASH_ENTRY(many_blocks)
CUFLASH_ENTRY(overflow)

static int failures = 0;
#define CHECK(c) do { if (!(c)) { std::printf("FAIL line %d: %s\n", __LINE__, #c); ++failures; } } while (0)

static int run(const char* name, void (*entry)(void**), unsigned grid, unsigned block, std::vector<void*> args,
               std::string* error = nullptr) {
    const unsigned g[3] = {grid, 1, 1}, b[3] = {block, 1, 1};
    unsigned long long stats[2] = {0, 0};
    char err[1024] = "";
    const int rc = ::cuflash_emu::launch(name, entry, args.data(), g, b, 0, stats, err, sizeof err, 0u);
    if (error) *error = err;
    return rc;
}

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "overflow") {  // must end the process with a report
        std::vector<unsigned> out(3, 0);
        unsigned* po = out.data();
        int which = 33, limit = 1 << 20;
        run("overflow", entry_overflow, 3, 64, {&po, &which, &limit});
        std::printf("returned\n");
        return 0;
    }
    {  // 40 levels of 4 KiB frames, a barrier and a shuffle at each
        int levels = 40;
        std::vector<int> bad(128, -1);
        std::vector<unsigned> acc(128, 0);
        int* pb = bad.data();
        unsigned* pa = acc.data();
        CHECK(run("deep_stack", entry_deep_stack, 2, 64, {&levels, &pb, &pa}) == 0);
        for (unsigned i = 0; i < 128; ++i) {
            CHECK(bad[i] == 0);
            CHECK(acc[i] == 820u + 41u * ((i % 64) ^ 1u));
        }
    }
    {  // rounding mode per thread, and not leaked into the caller
        float x[2] = {1.0f, 3.0f}, out[64];
        float* px = x;
        float* po = out;
        CHECK(run("rounding_per_thread", entry_rounding_per_thread, 2, 32, {&px, &po}) == 0);
        for (int i = 0; i < 64; ++i) {
            unsigned bits;
            std::memcpy(&bits, &out[i], 4);
            CHECK(bits == (i % 32 == 0 ? 0x3EAAAAAAu : 0x3EAAAAABu));
        }
        volatile float one = 1.0f, three = 3.0f;
        CHECK(one / three == out[1]);
    }
    {  // failures in the middle of a block unwind every thread
        const char* want[3] = {"__trap() called [block (1,0,0), thread (37,0,0)]",
                               "C++ exception in device code: boom from device code", "assertion failed: mode != 2"};
        for (int mode = 0; mode < 3; ++mode) {
            std::vector<int> out(192, 0);
            int* po = out.data();
            int who = 37;
            std::string error;
            CHECK(run("fail_midway", entry_fail_midway, 3, 64, {&po, &mode, &who}, &error) != 0);
            CHECK(error.find(want[mode]) != std::string::npos);
            for (int i = 0; i < 192; ++i) CHECK(out[i] == (i < 64 ? (i ^ 1) : 0));
            int live = -1;
            int* pl = &live;
            CHECK(run("live_objects", entry_live_objects, 1, 1, {&pl}) == 0);
            CHECK(live == 0);
        }
    }
    {  // scheduling order: fixed, then pseudo-random
        std::vector<int> w(50, -2);
        int* pw = w.data();
        unsetenv("CUFLASH_EMULATOR_SCHEDULE");  // the default
        CHECK(run("first_writer", entry_first_writer, 50, 128, {&pw}) == 0);
        for (int v : w) CHECK(v == 0);
        setenv("CUFLASH_EMULATOR_SCHEDULE", "random:1", 1);
        CHECK(run("first_writer", entry_first_writer, 50, 128, {&pw}) == 0);
        unsigned nonzero = 0;
        for (int v : w) { CHECK(v >= 0 && v < 128); nonzero += v != 0; }
        CHECK(nonzero > 10);
        unsetenv("CUFLASH_EMULATOR_SCHEDULE");
    }
    {  // more than 65,535 blocks
        const unsigned nblocks = 70000, threads = 32;
        std::vector<int> out(nblocks * threads, -1);
        int* po = out.data();
        CHECK(run("many_blocks", entry_many_blocks, nblocks, threads, {&po}) == 0);
        for (unsigned i = 0; i < nblocks * threads; ++i)
            if (out[i] != int(i ^ 1u)) { CHECK(out[i] == int(i ^ 1u)); break; }
    }
    std::printf(failures ? "%d failure(s)\n" : "ok\n", failures);
    return failures != 0;
}

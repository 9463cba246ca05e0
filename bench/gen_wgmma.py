"""Write kernels_cu/wgmma_sm90.cuh: the inline PTX of wgmma.mma_async for each N and dtype.

An asm statement names every accumulator register (N / 2 of them, up to 128), and PTX
takes the shape in the opcode, so each (N, dtype) needs its own statement; this script
writes them.  tests/emulator/test_emulator_wgmma.py checks that the header is this
script's output.

    python bench/gen_wgmma.py            # rewrite the header
    python bench/gen_wgmma.py --check    # exit 1 if it is out of date
"""
import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "kernels_cu" / "wgmma_sm90.cuh"
NS = (8, 16, 32, 64, 96, 128, 176, 192, 256)
DTYPES = (("false", "f16"), ("true", "bf16"))

HEADER = """\
// wgmma_sm90.cuh -- written by bench/gen_wgmma.py; edit that script, not this file.
//
// CuflashWgmma<N, kBF16>::ss / ::rs: wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}
// with A from a shared-memory descriptor (ss) or from registers (rs), B from a descriptor,
// D (N / 2 floats per thread) accumulated when `acc` is nonzero (the scale-d predicate);
// ::ss0: D = A B with D write-only, so that the compiler need not give D a value first.
// Included by hopper.cuh for sm_90a; the emulator's versions are in hopper.cuh.
#pragma once

template <int N, bool kBF16>
struct CuflashWgmma;
"""


def regs(first, count):
    return ", ".join(f"%{i}" for i in range(first, first + count))


def outputs(nregs, mode="+f"):
    ops = [f'"{mode}"(d[{i}])' for i in range(nregs)]
    return ",\n                       ".join(", ".join(ops[i:i + 8]) for i in range(0, nregs, 8))


def specialisation(n, bf16, ty):
    r = n // 2
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty}"
    ss = (f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
          f'                     "{op} {{{regs(0, r)}}}, %{r}, %{r + 1}, p, 1, 1, %{r + 3}, %{r + 4};\\n}}\\n"\n'
          f'                     : {outputs(r)}\n'
          f'                     : "l"(a), "l"(b), "r"(acc), "n"(kTransA), "n"(kTransB));\n')
    ss0 = (f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
           f'                     "{op} {{{regs(0, r)}}}, %{r}, %{r + 1}, p, 1, 1, %{r + 3}, %{r + 4};\\n}}\\n"\n'
           f'                     : {outputs(r, "=f")}\n'
           f'                     : "l"(a), "l"(b), "n"(0), "n"(kTransA), "n"(kTransB));\n')
    rs = (f'        asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"\n'
          f'                     "{op} {{{regs(0, r)}}}, {{{regs(r, 4)}}}, %{r + 4}, p, 1, 1, %{r + 6};\\n}}\\n"\n'
          f'                     : {outputs(r)}\n'
          f'                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc), "n"(kTransB));\n')
    return (f"\ntemplate <>\nstruct CuflashWgmma<{n}, {bf16}> {{\n"
            f"    template <int kTransA, int kTransB>\n"
            f"    static __device__ __forceinline__ void ss(float (&d)[{r}], uint64_t a, uint64_t b, int acc) {{\n"
            f"{ss}    }}\n"
            f"    template <int kTransA, int kTransB>  // D = A B: D's old value is not an input\n"
            f"    static __device__ __forceinline__ void ss0(float (&d)[{r}], uint64_t a, uint64_t b) {{\n"
            f"{ss0}    }}\n"
            f"    template <int kTransB>\n"
            f"    static __device__ __forceinline__ void rs(float (&d)[{r}], const uint32_t (&a)[4], uint64_t b, int acc) {{\n"
            f"{rs}    }}\n}};\n")


def text():
    return HEADER + "".join(specialisation(n, bf16, ty) for n in NS for bf16, ty in DTYPES)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the header differs from this script's output")
    args = ap.parse_args(argv)
    if args.check:
        ok = OUT.exists() and OUT.read_text() == text()
        print(f"{OUT}: {'up to date' if ok else 'out of date: run python bench/gen_wgmma.py'}")
        return 0 if ok else 1
    OUT.write_text(text())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

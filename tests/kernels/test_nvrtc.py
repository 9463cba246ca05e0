"""Every kernel compiles with NVRTC (what CuPy's RawModule uses) without a GPU.

Each ``.cu`` file of ``kernels_cu/`` (found by glob, so new kernels are
included automatically) and of ``tests/emulator/kernels/`` is compiled to a cubin (so
ptxas runs too) for sm_75, sm_80, sm_86, sm_89 and sm_90; any error or
warning fails.  The specialisations come from
``cuflash.kernels.compile_variants()``: all of them on sm_80, and on the
other architectures one per file (a 16-bit one, which takes the tensor-core
paths), because one NVRTC compile of a large kernel takes seconds.  A file
without listed variants is compiled with its defaults.
"""
import os
import re
from pathlib import Path

import pytest

from cuflash import _nvrtc

ok, why = _nvrtc.is_available()
if not ok and os.environ.get("CI"):
    # CI installs the test extras, which carry NVRTC: a skip there would hide
    # that no kernel was compile-checked.
    raise RuntimeError(f"NVRTC not available in CI: {why}")
pytestmark = pytest.mark.skipif(not ok, reason=f"NVRTC not available: {why}")

ROOT = Path(__file__).resolve().parents[2]
KERNELS_CU = ROOT / "kernels_cu"
TEST_KERNELS = ROOT / "tests" / "emulator" / "kernels"
ARCHS = (75, 80, 86, 89, 90)
FULL_ARCHS = (80,)
# Files the planner never runs on some architectures: flash_bwd_tf32 is planned only where
# runtime.tensor_cores (sm_80+); its sm_75 build (3xTF32 through the 32-shuffle software
# mma) kept NVRTC busy for over 17 minutes on a 2-core CI box without finishing.
NOT_PLANNED = {"flash_bwd_tf32.cu": (75,)}
# specialisations of the test kernels (tests/emulator/kernels/*.cu)
TEST_VARIANTS = {"mma.cu": [("-DDTYPE=__half",), ("-DDTYPE=__nv_bfloat16",)],
                 "wgmma.cu": [("-DWG_N=64", "-DWG_BF16=0", "-DWG_TA=0", "-DWG_TB=1")]}


def _project_variants():
    try:
        from cuflash.kernels import compile_variants
    except ImportError:
        return {}
    return compile_variants()


def _dtype_of(options):
    for o in options:
        m = re.match(r"-D(CUFLASH_DTYPE_\w+|DTYPE=\S+)", o)
        if m:
            return m.group(1)
    return None


def _cases():
    project = _project_variants()
    files = [(p, project.get(p.name) or [("-std=c++17",)]) for p in sorted(KERNELS_CU.glob("*.cu"))]
    files += [(p, TEST_VARIANTS.get(p.name, [()])) for p in sorted(TEST_KERNELS.glob("*.cu"))]
    cases = []
    for path, variants in files:
        for arch in ARCHS:
            if arch in NOT_PLANNED.get(path.name, ()):
                continue
            chosen = list(enumerate(variants))
            if arch not in FULL_ARCHS:
                sixteen = [(i, o) for i, o in chosen if re.search(r"F16|BF16|__half|bfloat16", _dtype_of(o) or "")]
                chosen = (sixteen or chosen)[:1]
            for i, opts in chosen:
                label = f"{path.parent.name}/{path.name}-sm_{arch}-v{i}"
                cases.append(pytest.param(path, arch, tuple(opts), id=label))
    return cases


def _options(path, arch, opts):
    inc = {f"-I{KERNELS_CU}", f"-I{path.parent}"}
    base = [o for o in opts if not o.startswith("-I")] + sorted(inc)
    if not any(o.startswith(("-std", "--std")) for o in base):
        base.append("-std=c++17")
    return (f"-arch=sm_{arch}", *base)


@pytest.mark.parametrize("path,arch,opts", _cases())
def test_compiles_without_warnings(path, arch, opts):
    options = _options(path, arch, opts)
    try:
        res = _nvrtc.compile(path.read_text(), path.name, options)
    except _nvrtc.NVRTCError as e:
        pytest.fail(f"{path.name} sm_{arch} {' '.join(opts)}:\n{e.log}")
    assert not res.warnings, f"{path.name} sm_{arch} {' '.join(opts)} warnings:\n{res.log}"
    assert res.cubin, "no cubin: ptxas did not run"
    assert re.search(r"\.entry\s+\w+", res.ptx), "no kernel entry in the PTX"


def test_tensor_core_instructions_only_from_sm_80():
    """portable.cuh emits mma/cp.async PTX for sm_80+, the software path below."""
    src = (TEST_KERNELS / "mma.cu").read_text()
    ptx = {arch: _nvrtc.compile(src, "mma.cu", _options(TEST_KERNELS / "mma.cu", arch, ())).ptx for arch in (75, 80)}
    assert "mma.sync.aligned.m16n8k16" in ptx[80] and "cp.async.cg.shared.global" in ptx[80]
    assert "mma.sync.aligned.m16n8k16" not in ptx[75] and "cp.async" not in ptx[75]
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx[75]  # ldmatrix exists from sm_75
    assert "shfl.sync" in ptx[75]


def test_errors_and_warnings_are_reported():
    with pytest.raises(_nvrtc.NVRTCError, match="undefined_thing"):
        _nvrtc.compile('extern "C" __global__ void f(float* x) { x[0] = undefined_thing; }', "bad.cu",
                       ("-arch=sm_80",))
    res = _nvrtc.compile('extern "C" __global__ void f(float* x) { int unused_var = 1; x[0] = 1.0f; }',
                         "warn.cu", ("-arch=sm_80",))
    assert res.warnings and "unused_var" in res.log


def test_ptxas_figures_are_parsed():
    res = _nvrtc.compile((TEST_KERNELS / "mma.cu").read_text(), "mma.cu",
                         _options(TEST_KERNELS / "mma.cu", 80, ()) + ("--ptxas-options=-v",))
    info = _nvrtc.parse_ptxas_info(res.log)
    assert set(info) == {"matmul_mma", "cp_async_pipeline"}
    mm = info["matmul_mma"]
    assert mm["registers"] > 0 and mm["spill_stores"] == 0
    assert mm["static_shared"] == 2 * (32 * 24 + 16 * 24)  # As + Bs of __half with padding


def _kernel_report():
    import importlib.util
    spec = importlib.util.spec_from_file_location("kernel_report", ROOT / "bench" / "kernel_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_report_occupancy_arithmetic():
    kr = _kernel_report()
    # 128 threads, 32 registers, no shared memory: 16 blocks fill sm_80's 64 warps
    assert kr.occupancy(80, 128, 32, 0) == (16, 1.0, "warps")
    # 44 registers -> 1536 per warp -> 42 warps of registers -> 10 blocks of 4 warps
    assert kr.occupancy(80, 128, 44, 0) == (10, 40 / 64, "registers")
    # 100 KB of shared memory: one block per sm_80 SM (164 KB), two on sm_90 (228 KB)
    assert kr.occupancy(80, 128, 32, 100 * 1024)[:1] == (1,)
    assert kr.occupancy(90, 128, 32, 100 * 1024)[0] == 2
    # more than a block may have: cannot launch
    assert kr.occupancy(80, 128, 32, 200 * 1024)[0] == 0


def test_kernel_report_runs(capsys):
    kr = _kernel_report()
    assert kr.main(["--tests", "--only", "reduce.cu", "--arch", "80", "--jobs", "1", "--fail-on-spill"]) == 0
    out = capsys.readouterr().out
    assert "block_sum" in out and "sm_80" in out and "100%" in out


def test_kernel_report_write_is_whole_and_carries_the_fa2_table(tmp_path, capsys):
    """--write takes a whole report only; its last section is the summary table of the latest
    fa2_sass_compare.md with that file's command, and says so when the file is missing."""
    kr = _kernel_report()
    with pytest.raises(SystemExit):
        kr.main(["--write", "--only", "reduce.cu"])
    assert "--write writes the whole report" in capsys.readouterr().err
    fa2 = tmp_path / "fa2.md"
    fa2.write_text("# title\n\nCommand: `python bench/fa2_sass_compare.py --torch` (9 s), at abc.\n\n"
                   "| kernel | FA2 | cuflash | cuflash / FA2 |\n|---|---|---|---|\n"
                   "| bwd d=64 sm_80 | 3538 (0.553) | 3491 (0.545) | 0.987 |\n\nPer class:\n\n"
                   "| class | bwd d=64 sm_80 |\n|---|---|\n| HMMA | 1000 / 1000 (+0) |\n")
    sec = kr.fa2_section(fa2)
    assert "(`python bench/fa2_sass_compare.py --torch` (9 s), at abc), where" in sec
    assert "| bwd d=64 sm_80 | 3538 (0.553) | 3491 (0.545) | 0.987 |" in sec
    assert "| class |" not in sec and sec.endswith("0.987 |\n")
    assert "run `python bench/fa2_sass_compare.py`" in kr.fa2_section(tmp_path / "none.md")
    head = kr.header(["--jobs", "2", "--write"], 61.0, 0)
    assert head.startswith("# Kernel report (generated)\n\nCommand: `python bench/kernel_report.py "
                           "--jobs 2 --write`") and head.rstrip().endswith("No row spills.")
    assert kr.header([], 1.0, 3).rstrip().endswith("3 rows spill (listed after the model).")


def _sass_or_skip():
    """cuflash._sass where cuobjdump runs; a skip elsewhere, an error in CI (which installs it)."""
    from cuflash import _sass
    ok, why = _sass.is_available()
    if not ok:
        if os.environ.get("CI"):
            raise RuntimeError(f"cuobjdump not available in CI: {why}")
        pytest.skip(why)
    return _sass


def test_sass_instruction_mix():
    """cuobjdump reads NVRTC's cubins: hardware mma on sm_80, the software one on sm_75."""
    _sass = _sass_or_skip()
    path = TEST_KERNELS / "mma.cu"
    mixes = {}
    for arch in (75, 80):
        res = _nvrtc.compile(path.read_text(), path.name, _options(path, arch, ()))
        code = _sass.instructions(_sass.disassemble(res.cubin))
        assert set(code) == {"matmul_mma", "cp_async_pipeline"}
        mixes[arch] = _sass.mix(code["matmul_mma"])
        assert mixes[arch]["total"] == len(code["matmul_mma"]) > 0
    assert mixes[80]["HMMA"] >= 1 and mixes[80]["LDSM"] >= 1
    assert mixes[75]["HMMA"] == 0 and mixes[75]["SHFL"] > 0   # mma from 32 shuffles
    assert mixes[75]["LDSM"] >= 1                               # ldmatrix exists on sm_75
    # the main loop of a kernel with a loop is found and lies inside the kernel
    res = _nvrtc.compile((KERNELS_CU / "online_softmax.cu").read_text(), "online_softmax.cu",
                         _options(KERNELS_CU / "online_softmax.cu", 80, ("-DCUFLASH_DTYPE_F32",)))
    code = _sass.instructions(_sass.disassemble(res.cubin))["online_softmax_rows"]
    lo, hi = _sass.main_loop(code)
    assert code[0][0] <= lo < hi <= code[-1][0]
    assert 0 < _sass.mix(code, (lo, hi))["total"] < len(code)


def test_half_mask_is_one_prmt():
    """portable.cuh's cuflash_prmt(x, 0, 0x9988) compiles to one PRMT with the immediate
    selector 0x9988 (the generic form whose nibbles' msb replicates a byte's sign:
    tests/emulator/test_emulator.py holds the emulator's model to the PTX ISA's definition) --
    ptxas neither reinterprets nor expands it."""
    _sass = _sass_or_skip()
    path = TEST_KERNELS / "basics.cu"
    res = _nvrtc.compile(path.read_text(), path.name, _options(path, 80, ()))
    code = _sass.instructions(_sass.disassemble(res.cubin))["half_mask"]
    prmt = [args for _, op, args in code if op.startswith("PRMT")]
    assert len(prmt) == 1 and "0x9988" in prmt[0], prmt

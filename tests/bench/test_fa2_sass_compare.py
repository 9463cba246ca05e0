"""bench/fa2_sass_compare.py's counting on hand-written SASS (no network, no NVRTC)."""
import collections

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def fc():
    return load_bench("fa2_sass_compare")


def _sass(lines):
    return "\n".join(["\t\tFunction : k", *(f"        /*{a:04x}*/  {text} ;" for a, text in lines)])


# A loop 0x20..0xd0 with an out-of-line copy (0xe0..0xf0, entered at 0x40, back at 0x50), an
# if/else (arms 0x60..0x70 and 0x80..0xa0), @!PT padding, and code outside the loop.
LOOP = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "IMAD.MOV.U32 R2, RZ, RZ, RZ"),
    (0x20, "HMMA.16816.F32 R4, R8, R10, R4"),
    (0x30, "HMMA.1688.F32.TF32 R4, R8, R10, R4"),
    (0x40, "@P0 BRA 0xe0"),
    (0x50, "@P1 BRA 0x80"),
    (0x60, "FADD R1, R1, R2"),
    (0x70, "BRA 0xb0"),
    (0x80, "FMUL R1, R1, R2"),
    (0x90, "FMUL R1, R1, R2"),
    (0xa0, "FMUL R1, R1, R2"),
    (0xb0, "@!PT LDS RZ, [RZ]"),
    (0xc0, "IADD3 R3, R3, 0x1, RZ"),
    (0xd0, "@P2 BRA 0x20"),
    (0xe0, "LDGSTS.E.BYPASS.128 [R5], [R6.64]"),
    (0xf0, "BRA 0x50"),
    (0x100, "EXIT"),
]


def test_parse_keeps_modifiers_and_padding(fc):
    ins = fc.parse_sass(_sass(LOOP))["k"]
    assert len(ins) == len(LOOP)
    assert ins[1][1:3] == ("IMAD", "IMAD.MOV.U32")
    assert ins[4] == (0x40, "BRA", "BRA", "0xe0", "@P0")
    assert ins[11][4] == "@!PT"
    assert [a for a, _, _ in fc.base(ins)] == [a for a, _ in LOOP if a != 0xb0]   # no padding


def test_steady_trip_of_a_known_loop(fc):
    ins = fc.parse_sass(_sass(LOOP))["k"]
    span = fc._sass.main_loop(fc.base(ins))
    assert span == (0x20, 0xd0)
    assert fc.excursions(ins, span) == [(0xe0, 0xf0)]
    assert fc.longer_arms(ins, span) == [(0x80, 0xa0)]
    ops, added, dropped, never = fc.steady_ops(ins, span)
    assert (added, dropped, never) == (2, 3, 1)
    assert ops == collections.Counter({"HMMA.16816.F32": 1, "HMMA.1688.F32.TF32": 1, "BRA": 5,
                                       "FADD": 1, "IADD3": 1, "LDGSTS.E.BYPASS.128": 1})
    assert fc.hmma_16816(ops) == 1.5
    cls = fc.classify(ops)
    assert (cls["HMMA"], cls["branch/conv"], cls["FP32"], cls["int"], cls["global"], cls["total"]) == \
        (2, 5, 1, 1, 1, 10)
    assert sum(v for k, v in cls.items() if k != "total") == cls["total"]
    assert round(fc.per_1000(cls, 1.5)["total"], 2) == 6666.67


def test_inner_loop_weighted_by_its_trips(fc):
    text = _sass([(0x00, "HMMA.16816.F32 R4, R8, R10, R4"), (0x10, "HMMA.16816.F32 R4, R8, R12, R4"),
                  (0x20, "@P0 BRA 0x10"), (0x30, "@P1 BRA 0x0"), (0x40, "EXIT")])
    ins = fc.parse_sass(text)["k"]
    span = fc._sass.main_loop(fc.base(ins))
    assert span == (0x00, 0x30)
    ops, *_ = fc.steady_ops(ins, span, {(0x10, 0x20): 4})
    assert ops == collections.Counter({"HMMA.16816.F32": 5, "BRA": 5})
    ops, *_ = fc.steady_ops(ins, span)
    assert ops == collections.Counter({"HMMA.16816.F32": 2, "BRA": 2})


def test_draw_loops_are_the_rolled_loops_without_hmma(fc):
    """The backward's rolled Philox loop (no HMMA) inside the main loop is found for weighting;
    the HMMA loop beside it and a loop outside the main loop are not."""
    text = _sass([(0x00, "IADD3 R1, R1, 0x1, RZ"), (0x10, "@P0 BRA 0x0"),        # before the loop
                  (0x20, "IADD3 R5, R5, 0x1, RZ"),
                  (0x30, "PRMT R2, R3, 0xfdb9, R4"), (0x38, "PRMT R5, R6, 0xfdb9, R7"),
                  (0x40, "@P1 BRA 0x30"),                                           # Philox steps
                  (0x50, "HMMA.16816.F32 R4, R8, R10, R4"), (0x60, "@P2 BRA 0x50"),  # S^T k loop
                  (0x70, "HMMA.16816.F32 R4, R8, R12, R4"), (0x80, "@P3 BRA 0x20"),
                  (0x90, "EXIT")])
    code = fc.base(fc.parse_sass(text)["k"])
    span = fc._sass.main_loop(code)
    assert span == (0x20, 0x80)
    assert fc.draw_loops(code, span) == [(0x30, 0x40)]
    # 32 logits per lane: four Philox blocks; two gathering PRMT per block in the body
    assert fc.draw_trips(code, (0x30, 0x40), 32) == 4
    two = fc.base(fc.parse_sass(_sass([(0x00, "PRMT R1, R2, 0xfdb9, R3"), (0x08, "PRMT R4, R5, 0xfdb9, R6"),
                                       (0x10, "PRMT R7, R8, 0xFDB9, R9"), (0x18, "PRMT R1, R2, 0xfdb9, R3"),
                                       (0x20, "@P0 BRA 0x0")]))["k"])
    assert fc.draw_trips(two, (0x00, 0x20), 32) == 2   # two blocks per trip
    odd = fc.base(fc.parse_sass(_sass([(0x00, "PRMT R1, R2, 0xfdb9, R3"), (0x08, "PRMT R4, R5, 0x5410, R6"),
                                       (0x20, "@P0 BRA 0x0")]))["k"])
    with pytest.raises(RuntimeError, match="not two per block"):
        fc.draw_trips(odd, (0x00, 0x20), 32)


def test_classes(fc):
    ops = collections.Counter(["IMAD.MOV.U32", "IMAD.WIDE.U32", "CS2R", "UIADD3", "S2UR", "BSSY",
                               "LDSM.16.MT88.4", "RED.E.ADD.F32.FTZ.RN.STRONG.GPU", "F2FP.PACK_AB",
                               "HADD2.F32", "MUFU.EX2", "SHFL.BFLY", "LDL.LU", "DEPBAR.LE", "NOP"])
    cls = fc.classify(ops)
    assert cls["moves"] == 2 and cls["int"] == 1 and cls["uniform"] == 2
    assert cls["F2FP/HADD2/cvt"] == 2 and cls["other"] == 1
    for name in ("branch/conv", "LDSM", "RED/ATOM", "MUFU", "SHFL/VOTE", "LDL/STL", "BAR/DEPBAR"):
        assert cls[name] == 1, name
    with pytest.raises(ValueError):
        fc.hmma_16816(collections.Counter(["HMMA.884.F32"]))


def test_fa2_names(fc):
    nested = "Flash_kernel_traits<64, 128, 128, 4, cutlass::half_t>"
    name = ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
            f"cutlass::half_t, {nested} >, false, {{}}, false, false, true, true, false, false>"
            "(flash::Flash_fwd_params)")
    assert fc.normalise(name.format("false")) == fc.FA2_KERNELS[("fwd", 64)][0]
    assert fc.normalise(name.format("true")) != fc.FA2_KERNELS[("fwd", 64)][0]   # causal
    blob = b"\x00_ZN5flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi64EEEvNS_16Flash_fwd_paramsE\x00.text"
    assert fc.mangled_names(blob) == [blob[1:-6].decode()]


# An mbarrier wait at 0x10 whose retry ptxas placed after the kernel's EXIT (0x80..0x90, back
# to the wait): a backward branch that is no loop of the kernel's, around the main loop
# (0x10..0x50, two HGMMA) and the HGMMA after it.
RETRY = [
    (0x00, "MOV R1, c[0x0][0x28]"),
    (0x10, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2"),
    (0x20, "@!P0 BRA 0x80"),
    (0x30, "HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ, !UPT"),
    (0x40, "HGMMA.64x128x16.F32 R24, gdesc[UR8], R24"),
    (0x50, "@P1 BRA 0x10"),
    (0x60, "HGMMA.64x128x16.F32 R24, gdesc[UR12], R24"),
    (0x70, "EXIT"),
    (0x80, "NOP"),
    (0x90, "BRA 0x10"),
]


def test_main_loop_skips_the_wait_retry_after_exit(fc):
    """_sass.main_loop (the kernel report's, fa2_sass_compare's and hopper_sass_count's) takes the
    loop of the kernel, not the wider "loop" of an mbarrier retry that branches back from after
    the EXIT."""
    b = fc.base(fc.parse_sass(_sass(RETRY))["k"])
    assert sorted(fc._sass._loops(b)) == [(0x10, 0x50), (0x10, 0x90)]
    assert fc._sass.main_loop(b) == (0x10, 0x50)


def test_torch_names():
    """PyTorch's bundled FA2 kernels (namespace pytorch_flash) read as upstream's names: the
    backward with dropout (first flag) is the --torch dropout row's, without it the plain one."""
    ft = load_bench("fa2_torch")
    fc = ft.fc
    name = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
            "64, 128, 128, 8, 4, 4, 4, false, false, cutlass::half_t, Flash_kernel_traits<64, 128, "
            "128, 8, cutlass::half_t> >, {}, false, false, false, true, true, false>"
            "(pytorch_flash::Flash_bwd_params)")
    dropout = fc.TORCH_KERNELS[("bwd-masked-dropout", 64)][0]
    assert ft.torch_name(name.format("true")) == dropout
    assert ft.torch_name(name.format("false")) == fc.TORCH_KERNELS[("bwd", 64)][0] != dropout
    assert fc.TORCH_KERNELS[("bwd", 64)][0] == fc.FA2_KERNELS[("bwd", 64)][0]

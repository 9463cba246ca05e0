"""bench/fa2_source.py's pure parts: the kernels it instantiates, their names as the counting
looks them up, the sdist's address in PyPI's index (no network, no nvcc)."""
import re

import pytest
from conftest import load_bench


@pytest.fixture(scope="module")
def fs():
    return load_bench("fa2_source")


# c++filt's text of two kernels of the d = 64 build (ALiBi as FA2 launches it; the plain one)
DEMANGLED = ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, "
             "128, 8, 4, 4, 4, false, false, cutlass::half_t, Flash_kernel_traits<64, 128, 128, 8, "
             "cutlass::half_t> >, false, false, false, {}>(flash::Flash_bwd_params)")


def test_names_are_the_demangled_kernels(fs):
    """kernel_name gives what fa2_sass_compare.normalise makes of the built kernels' names, and
    at d = 64 the plain kernel's is the wheel's (the build is read against it)."""
    fc = fs.fc
    assert fs.kernel_name(64, "bwd-alibi") == fc.normalise(DEMANGLED.format("true, false, false, false"))
    assert fs.kernel_name(64, "bwd") == fc.normalise(DEMANGLED.format("false, true, true, false"))
    assert fs.kernel_name(64, "bwd") == fc.FA2_KERNELS[("bwd", 64)][0]
    assert fs.kernel_name(128, "bwd") == fc.FA2_KERNELS[("bwd", 128)][0]
    assert len({fs.kernel_name(d, k) for d in fs.TRAITS for k in fs.KERNELS}) == 2 * len(fs.KERNELS)


def test_alibi_kernels_are_the_launched_ones(fs):
    """FA2's launcher turns Is_even_MN and Is_even_K off whenever Has_alibi is on: every ALiBi
    kernel but the one named even is built that way; dropout and softcap flags as named."""
    for kind, (drop, causal, local, alibi, even_mn, even_k, cap) in fs.KERNELS.items():
        assert not causal and not local
        assert alibi == ("alibi" in kind)
        assert (even_mn, even_k) == ((True, True) if not alibi or kind.endswith("-even") else (False, False))
        assert drop == ("dropout" in kind) and cap == ("softcap" in kind)


def test_instantiation_source(fs):
    """One explicit instantiation per kernel, at the head dimension's traits, with its flags."""
    text = fs.instantiation_source(128)
    assert '#include "flash_bwd_launch_template.h"' in text
    assert "Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::half_t>" in text
    inst = re.findall(r"flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Traits, ([a-z, ]+)>"
                      r"\(KERNEL_PARAM_MODIFIER const Flash_bwd_params\);", text)
    want = [", ".join("true" if f else "false" for f in flags) for flags in fs.KERNELS.values()]
    assert inst == want


def test_sdist_url(fs):
    """The sdist of the pinned version and its sha256 from a simple index page; none: an error."""
    sha = "ab" * 32
    page = ('<a href="https://files.example/p/flash_attn-2.8.2.tar.gz#sha256=' + "cd" * 32 + '">x</a>\n'
            f'<a href="https://files.example/q/flash_attn-2.8.3.tar.gz#sha256={sha}">y</a>\n')
    assert fs.sdist_url(page) == ("https://files.example/q/flash_attn-2.8.3.tar.gz", sha)
    with pytest.raises(RuntimeError, match="2.9.0"):
        fs.sdist_url(page, "2.9.0")


def test_compare_rows_have_both_sides(fs):
    """Each --source row of fa2_sass_compare names a kernel this module builds, and a cuflash
    kernel that cuflash_count can count."""
    fc = fs.fc
    countable = {"bwd", *fc.BWD_BAND_KINDS, *fc.TORCH_LEAN_KINDS, *fc.SOURCE_LEAN_KINDS,
                 *fc.TORCH_FEATURE_KINDS, *fc.SOURCE_FEATURE_KINDS}
    for kind, fa2_kind in fc.SOURCE_ROWS.items():
        assert fa2_kind in fs.KERNELS
        assert kind in countable

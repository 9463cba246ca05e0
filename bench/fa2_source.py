"""FlashAttention-2's backward kernels that no public wheel holds, built here from FA2's own
source, as a third yardstick for ``bench/fa2_sass_compare.py --source``.

Neither the ``flash-attn-jax`` wheel nor PyTorch's bundled copy instantiates FA2's backward with
ALiBi (``Has_alibi`` is false in all of their kernels).  Upstream's release wheels, which do,
are not on PyPI.  So this module builds the kernels from the ``flash-attn==2.8.3`` sdist,
fetched from PyPI's simple index (its sha256 checked) and unpacked, with CUDA 13.0's compiler
from NVIDIA's pip wheels (``nvidia-cuda-nvcc``, ``nvidia-nvvm``, ``nvidia-cuda-crt``,
``nvidia-cuda-runtime``, ``nvidia-cuda-cccl``: downloaded and unzipped, never installed):

* one translation unit per head dimension includes FA2's ``flash_bwd_launch_template.h`` and
  instantiates ``flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel`` at the traits FA2 launches
  with >= 144 KB of shared memory (:data:`TRAITS`) and the flags of :data:`KERNELS`;
* the three PyTorch headers FA2's headers include (for a Philox state type and two error
  macros) are replaced by small stand-ins (:data:`STUBS`): the kernels read the Philox state
  only through ``unpack``;
* ``nvcc`` compiles it to PTX for compute_80 and compute_90 (the gencodes of FA2's setup.py,
  with its nvcc options, :data:`NVCC_FLAGS`), and ``ptxas`` assembles each kernel for its
  architecture.

The ``plain`` kernel is built too so that the build can be read against the wheel's: the same
kernel compiled by nvcc 12.8 (``flash-attn-jax``) counts 3538 per 1,000 HMMA at d = 64 on
sm_80, this build 3503.  ALiBi is what FA2 launches for an ALiBi call: its launcher sets
``Is_even_MN`` and ``Is_even_K`` false whenever ``Has_alibi`` is on (the ``alibi-even`` kernel,
which FA2 never launches, shows ALiBi's own cost).  The ``dropout`` kernel is upstream's own
dropout backward: seven Philox rounds per block and 8 bits per logit (sixteen logits per
block), where PyTorch's copy is built with other options (its plain backward counts 14-22%
more than upstream's).

The first build takes about four minutes on two cores (about 50 s per head dimension and
architecture); the cache keeps the sdist, the compiler and the PTX.
"""
import hashlib
import re
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import fa2_sass_compare as fc

SDIST, SDIST_VERSION = "flash-attn", "2.8.3"
INDEX = "https://pypi.org/simple/flash-attn/"
# CUDA 13.0's compiler as pip wheels, pinned to one release (nvcc, its NVVM and headers)
TOOLKIT = ("nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88",
           "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85")
ARCHES = (80, 90)
NVCC_FLAGS = ("-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math")
# Flash_bwd_kernel_traits<d, Br, Bc, warps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ,
# Is_V_in_regs, No_double_buffer, elem>: what FA2 2.8.3 launches at >= 144 KB of shared memory
TRAITS = {64: "64, 128, 128, 8, 4, 4, 4", 128: "128, 64, 128, 8, 2, 4, 2"}
# kind: (Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap), each
# as FA2's launcher sets them for such a call (ALiBi turns Is_even_MN and Is_even_K off)
KERNELS = {
    "bwd": (False, False, False, False, True, True, False),
    "bwd-alibi": (False, False, False, True, False, False, False),
    "bwd-alibi-even": (False, False, False, True, True, True, False),
    "bwd-dropout": (True, False, False, False, True, True, False),
    "bwd-alibi-dropout": (True, False, False, True, False, False, False),
    "bwd-alibi-softcap": (False, False, False, True, False, False, True),
}
STUBS = {
    "ATen/cuda/CUDAGeneratorImpl.h": (
        "#pragma once\n#include <cstdint>\n"
        "namespace at {\n"
        "// stands in for PyTorch's Philox state: the kernels read it only through unpack()\n"
        "struct PhiloxCudaState { uint64_t seed = 0, offset = 0; };\n"
        "}\n"),
    "ATen/cuda/detail/UnpackRaw.cuh": (
        "#pragma once\n#include <tuple>\n#include <ATen/cuda/CUDAGeneratorImpl.h>\n"
        "namespace at { namespace cuda { namespace philox {\n"
        "__host__ __device__ inline std::tuple<uint64_t, uint64_t> unpack(at::PhiloxCudaState s) {\n"
        "  return std::make_tuple(s.seed, s.offset);\n}\n"
        "}}}\n"),
    "c10/cuda/CUDAException.h": (
        "#pragma once\n// host-side launch checks: no host code of this build runs\n"
        "#define C10_CUDA_CHECK(x) (void)(x)\n#define C10_CUDA_KERNEL_LAUNCH_CHECK() do {} while (0)\n"),
}


def kernel_name(d, kind):
    """The normalised demangled name (fc.normalise) of the kernel ``kind`` at head dimension d."""
    flags = ", ".join("true" if f else "false" for f in KERNELS[kind])
    return (f"flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<"
            f"{TRAITS[d]}, false, false, cutlass::half_t>, {flags}>")


def instantiation_source(d):
    """The translation unit that instantiates every kernel of :data:`KERNELS` at head dim d."""
    lines = ['#include "flash_bwd_launch_template.h"', "namespace FLASH_NAMESPACE {",
             f"using Traits = Flash_bwd_kernel_traits<{TRAITS[d]}, false, false, cutlass::half_t>;"]
    for kind, flags in KERNELS.items():
        args = ", ".join("true" if f else "false" for f in flags)
        lines.append(f"// {kind}\ntemplate __global__ void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"
                     f"<Traits, {args}>(KERNEL_PARAM_MODIFIER const Flash_bwd_params);")
    return "\n".join(lines + ["}  // namespace FLASH_NAMESPACE", ""])


def sdist_url(index_html, version=SDIST_VERSION):
    """(url, sha256) of the sdist of ``version`` in a PEP 503 simple index page."""
    m = re.search(r'href="([^"#]*/flash_attn-' + re.escape(version) + r'\.tar\.gz)#sha256=([0-9a-f]{64})"',
                  index_html)
    if m is None:
        raise RuntimeError(f"no flash_attn-{version}.tar.gz with a sha256 in the index")
    return m.group(1), m.group(2)


def fetch_sdist(cache):
    """The sdist in ``cache``, downloaded from PyPI's simple index if absent; its sha256 checked."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"flash_attn-{SDIST_VERSION}.tar.gz"
    if not path.exists():
        url, sha = sdist_url(urllib.request.urlopen(INDEX, timeout=120).read().decode())
        print(f"download {url} -> {cache}", file=sys.stderr, flush=True)
        data = urllib.request.urlopen(url, timeout=600).read()
        if hashlib.sha256(data).hexdigest() != sha:
            raise RuntimeError(f"{url}: sha256 differs from the index's")
        path.write_bytes(data)
    return path


def fetch_toolkit(cache):
    """The root (``nvidia/cu13``) of the pinned compiler wheels, downloaded into ``cache`` and
    unzipped there if absent."""
    wheels, root = cache / "toolkit_wheels", cache / "toolkit"
    cu = root / "nvidia" / "cu13"
    if not (cu / "bin" / "nvcc").exists():
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"pip download {' '.join(TOOLKIT)} -> {wheels}", file=sys.stderr, flush=True)
        fc._run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *TOOLKIT])
        for whl in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                z.extractall(root)
        for tool in [*(cu / "bin").glob("*"), *(cu / "nvvm" / "bin").glob("*")]:
            if tool.is_file():
                tool.chmod(0o755)
    return cu


class SourceFA2:
    """FA2's backward kernels of :data:`KERNELS` built from source: {(d, arch): PTX path}, and
    each kernel assembled for its architecture on demand."""

    version = SDIST_VERSION

    def __init__(self, cache):
        self.cuobjdump = fc._sass.find_cuobjdump()
        if self.cuobjdump is None:
            raise RuntimeError(fc._sass.is_available()[1])
        self.dir = Path(cache) / f"flash_attn-{SDIST_VERSION}-build"
        self.src = Path(cache) / f"flash_attn-{SDIST_VERSION}"
        if not (self.src / "csrc" / "flash_attn" / "src" / "flash_bwd_kernel.h").exists():
            with tarfile.open(fetch_sdist(Path(cache))) as t:
                try:
                    t.extractall(Path(cache), filter="data")
                except TypeError:  # a Python without extraction filters
                    t.extractall(Path(cache))
        self.cuda = fetch_toolkit(Path(cache))
        self.ptxas = self.cuda / "bin" / "ptxas"
        self._index = {}
        for rel, text in STUBS.items():
            p = self.dir / "stub" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists() or p.read_text() != text:
                p.write_text(text)

    def nvcc_version(self):
        return fc.tool_version(str(self.cuda / "bin" / "nvcc"))

    def ptx(self, d, arch):
        """The PTX of d's translation unit for compute_``arch``, built if absent or stale."""
        tu = self.dir / f"bwd_hdim{d}.cu"
        if not tu.exists() or tu.read_text() != instantiation_source(d):
            tu.write_text(instantiation_source(d))
        out = self.dir / f"bwd_hdim{d}.compute_{arch}.ptx"
        if not out.exists() or out.stat().st_mtime < tu.stat().st_mtime:
            csrc = self.src / "csrc"
            print(f"nvcc FA2 {SDIST_VERSION} backward, d={d}, compute_{arch} ...", file=sys.stderr, flush=True)
            fc._run([str(self.cuda / "bin" / "nvcc"), *NVCC_FLAGS, f"-arch=compute_{arch}", "-ptx",
                     "-I", str(self.dir / "stub"), "-I", str(csrc / "flash_attn" / "src"),
                     "-I", str(csrc / "cutlass" / "include"), "-o", str(out), str(tu)])
        return out

    def mangled(self, d, arch, want):
        """(PTX path, mangled name) of the kernel ``want``; each PTX indexed once."""
        ptx = self.ptx(d, arch)
        if ptx not in self._index:
            names = re.findall(r"\.entry\s+(_Z\w+)\(", ptx.read_text())
            demangled = subprocess.run(["c++filt"], input="\n".join(names), text=True,
                                       capture_output=True, check=True).stdout.splitlines()
            self._index[ptx] = {fc.normalise(dm): n for dm, n in zip(demangled, names)}
        index = self._index[ptx]
        if want not in index:
            raise RuntimeError(f"{want} not in {ptx.name}")
        return ptx, index[want]

    def sass(self, want, arch):
        """The kernel ``want`` (a normalised name of :func:`kernel_name`) for sm_``arch``, parsed."""
        d = next((d for d in TRAITS for k in KERNELS if kernel_name(d, k) == want), None)
        if d is None:
            raise RuntimeError(f"{want} is not one of this build's kernels")
        ptx, mangled = self.mangled(d, arch, want)
        cubin = self.dir / f"{hashlib.sha1(mangled.encode()).hexdigest()[:16]}.sm_{arch}.cubin"
        if not cubin.exists() or cubin.stat().st_mtime < ptx.stat().st_mtime:
            fc._run([str(self.ptxas), f"-arch=sm_{arch}", "-e", mangled, "-o", str(cubin), str(ptx)])
        return fc.parse_sass(fc._run([self.cuobjdump, "-sass", str(cubin)]))[mangled]

"""PyTorch's bundled FlashAttention-2 (namespace ``pytorch_flash``) as a second yardstick for
``bench/fa2_sass_compare.py --torch``: the one public build of FA2's backward with dropout.

The ``torch==2.14.1`` wheel (CPython 3.11, manylinux_2_28, about 550 MB) is fetched with
``pip download --no-deps`` into the cache folder and only ``torch/lib/libtorch_cuda.so`` is
unzipped (about 500 MB) -- never installed.  ``cuobjdump -xelf`` extracts its sm_80 and sm_90
cubins (PyTorch compiles both natively, so sm_90 here is nvcc's own code, not a PTX JIT), and
only the few that hold FA2's backward kernels are kept (the others are deleted: they are
about 1.4 GB).  Kernels are looked up by the same normalised demangled names as the upstream
wheel's (:func:`fa2_sass_compare.normalise`), ``pytorch_flash::`` read as ``flash::``.

PyTorch's copy is built with other options than upstream's (its plain backward counts about
20% more per HMMA than the upstream wheel's at the same tiles), and it holds no ALiBi build
(``Has_alibi`` is false in every instantiation): the comparison shows the plain backward of
both builds so that the dropout row can be read against its own build's plain row.
"""
import subprocess
import sys
import zipfile
from pathlib import Path

import fa2_sass_compare as fc

TORCH, TORCH_VERSION = "torch", "2.14.1"
SO = "torch/lib/libtorch_cuda.so"
ARCHES = (80, 90)
# what marks a cubin that holds FA2's backward (its Q-tile loop kernel)
_MARK = b"loop_seqk_parallel"


def torch_name(demangled):
    """The normalised name of a demangled PyTorch FA2 kernel, its namespace read as upstream's."""
    return fc.normalise(demangled.replace("pytorch_flash::", "flash::"))


class TorchFA2:
    """libtorch_cuda.so's FA2 backward kernels: {(arch, normalised name): (cubin, mangled)}."""

    def __init__(self, wheel, cache):
        self.cuobjdump = fc._sass.find_cuobjdump()
        if self.cuobjdump is None:
            raise RuntimeError(fc._sass.is_available()[1])
        self.dir = Path(cache) / wheel.name[:-len(".whl")]
        self.so = self.dir / SO
        if not self.so.exists():
            with zipfile.ZipFile(wheel) as z:
                z.extract(SO, self.dir)
        self.index = {}
        for arch in ARCHES:
            elf = self.dir / f"elf_sm{arch}"
            done = elf / ".done"
            if not done.exists():
                elf.mkdir(exist_ok=True)
                print(f"cuobjdump -xelf sm_{arch} cubins of {SO} ...", file=sys.stderr, flush=True)
                fc._run([self.cuobjdump, "-xelf", f"sm_{arch}.cubin", str(self.so)], cwd=elf)
                for cubin in elf.glob("*.cubin"):
                    if _MARK not in cubin.read_bytes():
                        cubin.unlink()
                done.write_text("only the cubins with FA2's backward kept\n")
            self.index.update({(arch, k): v for k, v in self._index(elf).items()})
        if not self.index:
            raise RuntimeError(f"no FA2 backward kernels found in {self.so}")

    def _index(self, elf):
        pairs = [(cubin, name) for cubin in sorted(elf.glob("*.cubin"))
                 for name in fc.mangled_names(cubin.read_bytes()) if _MARK.decode() in name]
        demangled = subprocess.run(["c++filt"], input="\n".join(n for _, n in pairs), text=True,
                                   capture_output=True, check=True).stdout.splitlines()
        return {torch_name(d): p for d, p in zip(demangled, pairs)}

    def sass(self, want, arch):
        """The kernel ``want`` (a normalised name) of sm_``arch``, parsed (fc.parse_sass)."""
        if (arch, want) not in self.index:
            raise RuntimeError(f"{want} (sm_{arch}) not in {self.so}")
        cubin, mangled = self.index[(arch, want)]
        return fc.parse_sass(fc._run([self.cuobjdump, "-sass", "-fun", mangled, str(cubin)]))[mangled]


def fetch(wheel_dir):
    """The torch wheel in ``wheel_dir``, downloaded there (pip, no dependencies) if absent."""
    return fc.fetch_wheel(wheel_dir, TORCH, TORCH_VERSION)

"""Tile sizes and shared-memory budgets of the CUDA kernels: the one place they are computed.

Every number a launcher uses (tile sizes, threads per block, dynamic shared
memory bytes) comes from :func:`plan`, and so do the figures that
``memory_analysis(backend="cuda"/"emulator")`` reports and the messages of the
``ValueError`` raised for tiles that do not fit.  Nothing else in cuflash
repeats these formulas (flash-attn keeps one copy in C++ and one in Python;
here the kernels receive every size as a ``-D`` define built from a plan).

A kernel is described by a :class:`KernelTiling`: the tile sizes it supports,
a formula for its dynamic shared memory, its threads per block and its register
rules; its default tiles are in a curated table (:mod:`.curated`, chosen by a
person per dtype class, head-dim class and architecture class).  ``plan(kernel, ...)``

* honours explicit ``block_q``/``block_kv`` that the size formulas allow, or
  refuses them (``ValueError`` stating the budget and the supported choices) --
  never changes them; whether ptxas spills them shows when they are compiled on
  a GPU (``cuflash.kernels.check_compiled``);
* picks, when a size is None, the first curated pair of the device's
  architecture class that fits its shared-memory limit;
* checks the total against the limit the device allows with opt-in
  (``cudaDevAttrMaxSharedMemoryPerBlockOptin`` on a real GPU; a nominal sm_80
  or sm_90 figure on the emulator, stated as such in every output).

Above 48 KB a kernel needs its dynamic shared-memory limit raised before launch
(``STATIC_SMEM_LIMIT``); :attr:`TilePlan.needs_opt_in` tells the launcher.

The package is split by kernel family, each module registering its kernels'
``KernelTiling`` entries with :func:`register` when imported; everything else
(planning, limits, messages) is in ``core`` and shared:

* ``curated``: the curated plan tables (the design of the defaults is its docstring);
* ``core``: :class:`KernelTiling`, :class:`TilePlan`, the registry, device limits,
  the occupancy floor, :func:`plan`, the split-KV heuristic;
* ``fwd``: flash_fwd (SIMT), flash_fwd_tc / flash_fwd_tf32, the forward's kernel
  choice (:func:`plan_flash_fwd`), online softmax, forward traffic (dense, split-KV);
* ``bwd``: flash_bwd_dkdv / flash_bwd_dq / preprocess (SIMT), flash_bwd_tf32;
* ``bwd_tc``: flash_bwd_tc and the backward's kernel choice (:func:`plan_flash_bwd`);
* ``masks``: the logit features' visible keys and traffic.

Every public name is available as ``cuflash.tiling.<name>``.
"""
# Each module registers its kernels when imported; the order follows their imports.
from .curated import ARCH_CLASSES, CURATED, CURATED_KERNELS  # noqa: F401
from .core import *  # noqa: F401,F403
from .fwd import *  # noqa: F401,F403
from .bwd import *  # noqa: F401,F403
from .bwd_tc import *  # noqa: F401,F403
from .masks import *  # noqa: F401,F403

__all__ = [
    "KernelTiling", "TilePlan", "register", "plan", "kernel_tiling", "accumulator_bytes", "shared_layout",
    "device_smem_limit", "EMULATOR_ARCHES", "emulator_arch", "EMULATOR_ARCH_ENV", "STATIC_SMEM_LIMIT",
    "MAX_HEAD_DIM",
    "flash_fwd_traffic", "plan_flash_fwd", "TC_DTYPES", "TF32_DTYPES",
    "TC_KERNELS", "TC_MASKED_KERNELS", "tc_kernel_for", "tc_strides", "tc_rows_per_warp", "tc_acc_regs",
    "device_sm_count", "num_splits_heuristic", "EMULATOR_SMS", "plan_bwd_tf32", "bwd_tf32_strides",
    "plan_flash_bwd", "bwd_tc_layout", "flash_bwd_tc_traffic", "bwd_dq_splits",
    "simt_head_dim_class", "SIMT_HEAD_DIM_CLASSES", "simt_head_dims", "arch_class",
    "curated_plans", "curated_text", "ARCH_CLASSES", "CURATED", "CURATED_KERNELS", "WGMMA_KERNEL", "WGMMA_HEAD_DIMS", "wgmma_takes", "BWD_WGMMA_KERNEL", "BWD_BAND_KERNEL", "bwd_band_takes", "BWD_SOFTCAP_KERNEL", "BWD_ALIBI_KERNEL", "BWD_DROPOUT_KERNEL",
    "BWD_ALIBI_DROPOUT_KERNEL", "BWD_ALIBI_SOFTCAP_KERNEL",
    "BWD_LEAN_KERNELS",
    "BWD_WGMMA_HEAD_DIMS", "bwd_wgmma_takes",
]

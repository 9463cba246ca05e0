"""The kernel launchers, one module per kernel family, shared by the "cuda" and "emulator" backends.

A family is one kernel source file and the kernels compiled from it for one job; its
launcher runs the plain variant, or the features variant (``-DCUFLASH_MASKS``) when a call
has logit features.  Families: :mod:`~cuflash.launch.fwd` (dense forward),
:mod:`~cuflash.launch.serving` (split-KV, KV cache, variable-length batches; its helpers'
module is ``flash_fwd.cu`` with ``-DCUFLASH_FWD_HELPERS``),
:mod:`~cuflash.launch.bwd_tc` (16-bit tensor-core backward), :mod:`~cuflash.launch.bwd_simt`
(SIMT backward, with float32's tensor-core dK/dV pass) and :mod:`~cuflash.launch.softmax`.
Beside them: :mod:`~cuflash.launch.bwd` (backward entry points), ``features``, ``common``,
``precompile`` and ``api`` (the backends' kernel functions over a runtime).

Imports run one way: api -> precompile -> fwd, bwd; fwd -> serving; bwd -> bwd_tc, bwd_simt;
each -> features -> common.  This package imports none of its modules, so importing one
loads only what it needs.
"""

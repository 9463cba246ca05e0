"""The kernel launchers, one module per kernel family, shared by the "cuda" and "emulator" backends.

A family is one kernel source file and the kernels compiled from it for one
job.  Its launcher takes a call's logit features (bias, window, ALiBi,
softcap, dropout) as one value -- None for a plain call -- and runs the
family's plain or features variant (the same source with ``-DCUFLASH_MASKS``):

* :mod:`~cuflash.launch.fwd` -- the dense forward: ``flash_fwd`` (SIMT),
  ``flash_fwd_tc`` / ``flash_fwd_tf32`` (tensor cores); with the kernel
  versions of ``memory_analysis`` and ``verify_no_full_materialization``;
* :mod:`~cuflash.launch.serving` -- the serving forward (``flash_fwd.cu`` with
  ``-DCUFLASH_FWD_SERVING``): split-KV and its combine, the KV cache and its
  append (the helpers' module, ``-DCUFLASH_FWD_HELPERS``), variable-length batches;
* :mod:`~cuflash.launch.bwd_tc` -- the 16-bit tensor-core backward
  (``flash_bwd_tc.cu``);
* :mod:`~cuflash.launch.bwd_simt` -- the SIMT backward (``flash_bwd.cu``),
  including float32's dK/dV pass on tensor cores (``flash_bwd_tf32.cu``):
  that kernel takes the place of one of the three SIMT kernels of a call, so
  it is launched by this family, not as one of its own;
* :mod:`~cuflash.launch.softmax` -- ``online_softmax_rows``.

Beside them: :mod:`~cuflash.launch.bwd` (the backward's entry points: picks
the family, caches the call, runs packed sequences),
:mod:`~cuflash.launch.features` (the features as one value and what a launch
makes of them), :mod:`~cuflash.launch.common` (addressing inputs, outputs,
parameter blocks, the call cache, the launch hooks tests observe),
:mod:`~cuflash.launch.precompile` (the kernels of default-tile calls, ahead of
time) and :mod:`~cuflash.launch.api` (the backends' kernel functions over a
runtime).

Imports run one way: the backends -> these modules -> :mod:`cuflash.kernels` /
:mod:`cuflash.tiling` -> :mod:`cuflash.emulator`; here api -> precompile -> fwd, bwd;
fwd -> serving; bwd -> bwd_tc, bwd_simt; each -> features -> common.  This
package imports none of its modules, so importing one loads only what it needs.
"""

"""Tensor-core backward plans, float32 (3xTF32) forward plans and float16/bfloat16 forward
plans with the logit features that ptxas (NVRTC 13.0) spills on some architectures only:
``kernel -> {(block_q, block_kv, d, dv): architectures}``, at d == dv and at the d != dv
pairs of ``TC_ASYM_SWEPT`` (every tile pair compiled), refused
at the shared-memory limits compiled for those architectures
(:func:`cuflash.tiling.core.sweep_arch`), accepted elsewhere -- so that a plan spilling only
in sm_90's compile (4-20 B near 255 registers) stays the default where it compiles clean.
Without a limit (no architecture known) they are refused everywhere.

The default plans at the other d != dv pairs are in ``_asym_spills.py``; the plans spilling on
every architecture in the frozensets of ``bwd_tc.py`` and ``_fwd_tc_masked_spills.py``.
Regenerated from the record by ``bench/plan_sweep_arch_spills.py`` after a
``bench/plan_sweep.py --write`` of those kernels' families (tests/test_plan_sweep.py holds
each entry to the spilling rows there), not edited by hand.
"""
ARCH_SPILLS = {
    "flash_fwd_tc_masked": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (32, 16, 256, 256): (90,), (32, 32, 64, 128): (80,), (32, 64, 16, 256): (90,),
        (64, 32, 64, 128): (80,), (64, 64, 16, 256): (90,), (64, 64, 64, 64): (80,),
        (64, 64, 80, 80): (80,), (64, 64, 128, 64): (80,), (64, 64, 128, 256): (90,),
        (64, 64, 256, 256): (90,), (64, 128, 64, 128): (80,), (64, 128, 128, 64): (80,),
        (128, 32, 64, 128): (80,), (128, 64, 64, 64): (80,), (128, 64, 80, 80): (80,),
        (128, 64, 128, 64): (80,), (128, 64, 128, 256): (90,), (128, 128, 128, 64): (80,),
        (128, 128, 128, 128): (90,),
    },
    "flash_fwd_tf32_masked": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (16, 16, 16, 256): (80,), (32, 16, 16, 256): (80,), (32, 16, 128, 256): (90,),
        (32, 16, 256, 256): (90,), (32, 32, 16, 256): (90,), (64, 32, 96, 96): (80, 90),
        (64, 32, 112, 112): (90,), (128, 32, 16, 256): (90,), (128, 32, 96, 96): (80, 90),
        (128, 32, 112, 112): (80, 90), (128, 64, 80, 80): (80,),
    },
    "flash_fwd_tf32": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (64, 32, 112, 112): (90,), (64, 64, 80, 80): (90,), (128, 32, 112, 112): (90,),
        (128, 64, 80, 80): (90,),
    },
    "flash_bwd_tf32_masked": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (32, 32, 64, 128): (90,), (32, 32, 96, 96): (90,), (32, 32, 128, 64): (90,),
        (32, 64, 64, 128): (90,), (32, 64, 96, 96): (90,), (32, 64, 128, 64): (90,),
        (32, 128, 64, 128): (90,), (32, 128, 128, 64): (90,),
    },
    "flash_bwd_tf32": {  # (block_q, block_kv, d, dv): architectures it spilled on
    },
    "flash_bwd_tc_masked": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (32, 64, 16, 16): (90,), (32, 64, 32, 32): (90,), (32, 128, 32, 32): (90,),
        (64, 32, 32, 32): (90,), (64, 32, 48, 48): (90,), (64, 64, 16, 16): (90,),
        (64, 64, 32, 32): (90,), (64, 64, 48, 48): (90,), (64, 128, 32, 32): (90,),
        (64, 128, 48, 48): (90,), (64, 128, 64, 128): (90,), (64, 128, 112, 112): (90,),
        (128, 16, 16, 16): (90,), (128, 32, 16, 16): (80,), (128, 32, 64, 128): (90,),
        (128, 64, 16, 16): (80,), (128, 128, 16, 16): (80,),
    },
    "flash_bwd_tc": {  # (block_q, block_kv, d, dv): architectures it spilled on
        (32, 16, 256, 16): (90,), (32, 64, 256, 256): (90,), (32, 128, 256, 256): (90,),
        (128, 128, 64, 128): (90,), (128, 128, 128, 64): (90,),
    },
}

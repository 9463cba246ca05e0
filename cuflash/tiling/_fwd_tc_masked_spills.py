"""Tensor-core forward plans with the logit features that ptxas (NVRTC 13.0) spills although the
plain kernels' register budget (cuflash.tiling.fwd) accepts them: ``(block_q, block_kv, d, dv)``.

flash_fwd_tc_masked / flash_fwd_tf32_masked hold the band's bounds, the ALiBi slope and the
dropout key beside S and O (the other feature parameters are read per tile).
bench/plan_sweep.py compiled every plan of the plain kernels' rules with -DCUFLASH_MASKS and
these refusals lifted (families flash_fwd_tc_masked, flash_fwd_tf32_masked and their d != dv
samples, sm_80 for the limits of sm_80/86/89, and sm_90: 1,395 compiles, 4 more exposed by
the refusals after; sweep of 2026-11-23, night, after the per-tile feature loops): 89
spilled 4-144 B -- no register budget separates them from the clean plans, so these
tile/shape pairs are refused on every architecture (defaults then: float16 d = 64, 96, 128
at 128 x 32, float32 d = 128 at 128 x 16).  Rows: bench/results/plan_sweep.json.

FWD_TF32_MASKED_SPILLS re-derived on 2026-11-24 after the 3xTF32 split changed the float32
machine code (its 19 plans compiled again for sm_80 and sm_90): 9 spilled on both; 5 spilled
on one architecture only and moved to _arch_spills.py; 5 compiled clean on both and were
accepted again (among them 32 x 16 at d = 256).

Both sets re-derived on 2026-11-24 (seventh session) after the 16-bit dropout draws changed
the masked kernels' machine code (every entry compiled again for sm_80 and sm_90, float16 and
bfloat16 alike): of the float16/bfloat16 set's 25, 7 spill on both architectures (below), 17
on one only -- sm_80 for most, among them 128 x 64 at d = 64, clean on sm_90 at 254
registers -- and are refused per architecture now (flash_fwd_tc_masked joined
_arch_spills.py), 1 compiles clean (64 x 32 at d = 128); of the float32 set's 9, 6 spill on
both (below), 1 on sm_90 only, 2 compile clean (64 x 16 and 128 x 16 at d = 256).  Defaults
that moved: float16 d = 64 and 80 on sm_90 128 x 32 -> 128 x 64; float32 d = 256 -> 64 x 16.
"""
FWD_TC_MASKED_SPILLS = frozenset({
    (64, 64, 96, 96), (64, 128, 176, 176), (64, 128, 192, 192), (128, 64, 16, 256),
    (128, 64, 96, 96), (128, 64, 256, 256), (128, 128, 64, 128),
})

FWD_TF32_MASKED_SPILLS = frozenset({
    (64, 16, 16, 256), (64, 16, 128, 256), (128, 16, 16, 256), (128, 16, 128, 256),
    (128, 64, 64, 64), (128, 64, 128, 64),
})

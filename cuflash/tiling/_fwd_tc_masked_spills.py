"""Tensor-core forward plans with the logit features that ptxas (NVRTC 13.0) spills although the
plain kernels' register budget (cuflash.tiling.fwd) accepts them: ``(block_q, block_kv, d, dv)``.

flash_fwd_tc_masked / flash_fwd_tf32_masked keep the feature state (band offsets, softcap, bias
pointer and strides, ALiBi slope, dropout key) beside S and O.  bench/plan_sweep.py compiled
every plan of the plain kernels' rules with -DCUFLASH_MASKS (families flash_fwd_tc_masked,
flash_fwd_tf32_masked and their d != dv samples, sm_80 for the limits of sm_80/86/89, and
sm_90: 1,406 compiles): 80 spilled 4-156 B, at 96-160 accumulator registers -- no budget
separates them from the clean plans (160 compiled clean elsewhere), so these tile/shape pairs
are refused on every architecture (the defaults move to the next preference: float16 d = 64
and 96 to 128 x 32, float32 d = 128 to 32 x 16).  Rows: bench/results/plan_sweep.json.
"""
FWD_TC_MASKED_SPILLS = frozenset({
    (32, 16, 16, 256), (32, 16, 128, 256), (32, 16, 256, 256), (64, 16, 16, 256),
    (64, 16, 128, 256), (64, 32, 16, 256), (64, 32, 64, 128), (64, 32, 128, 256), (64, 64, 64, 64),
    (64, 64, 96, 96), (128, 16, 16, 256), (128, 16, 128, 256), (128, 32, 16, 256),
    (128, 32, 64, 128), (128, 32, 128, 256), (128, 64, 64, 64), (128, 64, 96, 96),
    (128, 64, 256, 256), (128, 128, 64, 128), (128, 128, 128, 128), (128, 128, 192, 128),
})

FWD_TF32_MASKED_SPILLS = frozenset({
    (16, 16, 16, 256), (16, 16, 128, 256), (16, 32, 16, 256), (32, 16, 16, 256),
    (32, 16, 128, 256), (32, 16, 256, 256), (32, 32, 16, 256), (64, 16, 16, 256),
    (64, 16, 64, 128), (64, 16, 128, 128), (64, 16, 128, 256), (64, 16, 256, 256),
    (64, 32, 16, 256), (64, 32, 128, 256), (64, 64, 32, 32), (128, 16, 16, 256),
    (128, 16, 64, 128), (128, 16, 128, 128), (128, 16, 128, 256), (128, 16, 256, 256),
    (128, 32, 16, 256), (128, 32, 96, 96), (128, 32, 112, 112), (128, 32, 128, 256),
    (128, 64, 32, 32), (128, 64, 64, 64), (128, 64, 80, 80),
})

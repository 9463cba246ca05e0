"""The planner accepts no tensor-core plan that spills registers (issue 12).

cuflash.tiling accepts flash_fwd_tc / flash_fwd_tf32 / flash_bwd_tf32 plans (and the _masked
kernels of the logit features: flash_fwd_tc_masked, flash_fwd_tf32_masked, flash_bwd_tc_masked,
flash_bwd_tf32_masked) from a register
budget (and gives a plan 16 query rows per warp instead of 32 where 32 would not fit).  Here
the largest accepted plans of each kind -- the most accumulator registers with 32 and with 16
rows per warp, the largest head dim -- are compiled with NVRTC for sm_80 and must report no
spill stores or loads.  bench/plan_sweep.py compiles every accepted plan (too slow for CI; tests/test_plan_sweep.py
checks its record).
"""
import os

import pytest

from cuflash import _nvrtc, tiling
from cuflash.tiling import bwd_tc

ok, why = _nvrtc.is_available()
if not ok and os.environ.get("CI"):
    raise RuntimeError(f"NVRTC not available in CI: {why}")
pytestmark = pytest.mark.skipif(not ok, reason=f"NVRTC not available: {why}")


def _largest_plans():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "plan_sweep", Path(__file__).resolve().parent.parent / "bench" / "plan_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    picks = []
    for kernel, dtype in (("flash_fwd_tc", "float16"), ("flash_fwd_tf32", "float32"),
                          ("flash_bwd_tf32", "float32"), ("flash_fwd_tc_masked", "float16"),
                          ("flash_fwd_tf32_masked", "float32"), ("flash_bwd_tc_masked", "float16"),
                          ("flash_bwd_tf32_masked", "float32")):
        plans = [p for p in sweep.accepted_plans(kernel, 80) if p.dtype == dtype]
        if kernel in ("flash_bwd_tf32", "flash_bwd_tf32_masked"):
            key = lambda p: ((p.d + p.dv) // 2 + p.block_q, p.block_kv, p.d)  # noqa: E731
            classes = {None: plans}
        elif kernel == "flash_bwd_tc_masked":
            # the most register-array floats, per layout (passes, query split)
            def key(p):
                w, mt, passes, qs = bwd_tc.bwd_tc_layout(p.block_q, p.block_kv, p.d, p.dv, True)
                return (bwd_tc._bwd_tc_masked_arrays(p.block_q, p.d, p.dv, mt, passes, qs),
                        p.block_kv, p.d)
            classes = {}
            for p in plans:
                classes.setdefault(bwd_tc.bwd_tc_layout(p.block_q, p.block_kv, p.d, p.dv, True)[2:],
                                   []).append(p)
        else:
            key = lambda p: (tiling.tc_acc_regs(p.kernel, p.block_q, p.block_kv, p.d, p.dv),  # noqa: E731
                             p.block_kv, p.d)
            classes = {}
            for p in plans:
                classes.setdefault(tiling.tc_rows_per_warp(p.kernel, p.block_q, p.block_kv, p.d, p.dv),
                                   []).append(p)
        for group in classes.values():
            top = max(group, key=key)
            picks.append(top)
            widest = max(group, key=lambda p: (p.d, key(p)))
            if widest != top:
                picks.append(widest)
    return sweep, picks


SWEEP, PLANS = _largest_plans()


@pytest.mark.parametrize("plan", PLANS, ids=[f"{p.kernel}-d{p.d}-{p.block_q}x{p.block_kv}-t{p.threads}"
                                             for p in PLANS])
def test_largest_accepted_plans_do_not_spill(plan):
    row = SWEEP.compile_plan((plan.kernel, plan, 80))
    assert SWEEP.bad(row) is None, row

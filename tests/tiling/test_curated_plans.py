"""The curated plan tables (cuflash/tiling/curated.py) and their compile check.

* The defaults the library launched before the tables (tests/tiling/data/old_defaults.json,
  written by tests/tiling/data/make_old_defaults.py from the planner of commit 61daee7) are the
  tables' defaults on sm_80 and sm_90 -- the plans the H100 measurements were made with -- and
  on sm_86 and sm_75 where those families are planned.
* Every default at any head dims is one of the curated plans, which the compile check covers;
  every curated pair is one the size formulas take at its class's limit.
* Explicit tiles are taken wherever the formulas allow them; a spilling kernel on a GPU raises
  SpillError naming the curated plans of its cell.
* The compile check: every curated plan compiled with NVRTC (bench/plan_sweep.py) without
  local memory.  Compiles that the record (bench/results/plan_sweep.json) vouches for (the
  same sources, NVRTC and options) are taken from it, a sample of them compiled here to match
  it; of the others, the defaults are compiled here.  ``CUFLASH_PLAN_CHECK=all`` compiles
  every one, ignoring the record: the full check, for one family after a kernel edit with
  ``-k flash_fwd_tc`` (its plain and masked groups).
"""
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _nvrtc, kernels, tiling
from cuflash.tiling import curated

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_sweep", ROOT / "bench" / "plan_sweep.py")
SWEEP = importlib.util.module_from_spec(_spec)
sys.modules["plan_sweep"] = SWEEP   # its compile workers pickle its functions by module name
_spec.loader.exec_module(SWEEP)
OLD = json.loads((ROOT / "tests" / "tiling" / "data" / "old_defaults.json").read_text())
LIMITS = tiling.EMULATOR_ARCHES
TC_FAMILIES = ("flash_fwd_tc", "flash_fwd_tf32", "flash_fwd_tc_masked", "flash_fwd_tf32_masked",
               "flash_bwd_tc", "flash_bwd_tc_masked", "flash_bwd_tf32", "flash_bwd_tf32_masked")


def _row(p):
    return [p.block_q, p.block_kv, p.threads, p.shared_bytes, p.kd, p.kdv]


# -- the defaults of before -------------------------------------------------------------------
def test_old_defaults_are_the_tables_defaults():
    """Every default plan of the old planner at d == dv (the SIMT kernels at every head-dim
    class, the tensor-core ones at every multiple of 16) is today's, tiles, threads, shared
    memory and compiled head dims alike: on sm_80 and sm_90, and on sm_86 (99 KB) and sm_75
    (64 KB) except where a tensor-core kernel is forced onto sm_75 (not planned there: its
    software mma spills), which now refuses the default, naming the pairs that fit."""
    n = 0
    for key, archs in OLD["plans"].items():
        kernel, dtype, d = key.split()
        for arch, want in archs.items():
            if arch == "sm_75" and kernel in TC_FAMILIES:
                try:
                    got = _row(tiling.plan(kernel, int(d), int(d), dtype, limit=LIMITS[arch]))
                except ValueError as e:
                    assert "none of its curated plans fits" in str(e) and "pairs that fit" in str(e)
                    continue
            else:
                got = _row(tiling.plan(kernel, int(d), int(d), dtype, limit=LIMITS[arch]))
            if (key, arch) in MOVED:
                assert got == MOVED[key, arch] != want, (key, arch)
            else:
                assert got == want, (key, arch)
            n += 1
    assert n > 1200


# defaults the tables moved, with the reason in their cells' comment in curated.py
MOVED = {
    # 64 x 16 spills 36 B with -ftz=true (NVRTC 13.0, sm_90): 64 x 32
    ("flash_fwd_tf32_masked float32 256", "sm_90"): [64, 32, 128, 205824, 256, 256],
    # the sm_86 cell at 128 lost 16 x 64 (4 B spill once the tail tile masks rows past Nq):
    # forced onto sm_75's 64 KB, the tensor-core backward takes 16 x 32
    ("flash_bwd_tc float16 128", "sm_75"): [16, 32, 64, 36608, 128, 128],
    ("flash_bwd_tc bfloat16 128", "sm_75"): [16, 32, 64, 36608, 128, 128],
    # FlashAttention-2's tiles at d = 64 (sm_80, sm_90) and 128 (sm_80): on sm_80 with one dO
    # buffer (KernelTiling.smaller), as on sm_75's 64 KB the query split's plans that fit only so
}
for _dt in ("float16", "bfloat16"):
    MOVED.update({
        (f"flash_bwd_tc {_dt} 64", "sm_80"): [128, 128, 256, 163840, 64, 64],
        (f"flash_bwd_tc {_dt} 64", "sm_90"): [128, 128, 256, 182272, 64, 64],
        (f"flash_bwd_tc {_dt} 128", "sm_80"): [64, 128, 256, 159744, 128, 128],
        (f"flash_bwd_tc {_dt} 112", "sm_75"): [32, 64, 128, 64512, 112, 112],
        (f"flash_bwd_tc_masked {_dt} 64", "sm_75"): [64, 64, 128, 65536, 64, 64],
    })
# flash_fwd_tc: FlashAttention-2's 128 x 64 at d = 128 on sm_80 and sm_90 (32 rows per warp),
# and one K and one V buffer (KernelTiling.smaller) where that lets more blocks reside on an SM
# (registers counted at 255 per thread) or where two stages pass the limit -- on sm_75's 64 KB
# the latter puts the cell's longer first pairs back in reach.  (d, arch): (tiles, threads,
# shared bytes); the compiled head dims are d's.
_FWD_TC_MOVED = {
    (48, "sm_75"): (128, 64, 128, 28672), (80, "sm_75"): (128, 64, 128, 45056),
    (96, "sm_75"): (128, 64, 128, 53248), (128, "sm_75"): (128, 32, 128, 52224),
    (176, "sm_75"): (64, 32, 128, 47104), (192, "sm_75"): (64, 32, 128, 51200),
    (208, "sm_75"): (64, 32, 128, 55296), (224, "sm_75"): (64, 32, 128, 59392),
    (240, "sm_75"): (64, 32, 128, 63488), (256, "sm_75"): (64, 16, 128, 50688),
    (64, "sm_86"): (128, 64, 128, 36864), (80, "sm_86"): (128, 64, 128, 45056),
    (112, "sm_86"): (128, 32, 128, 46080), (144, "sm_86"): (64, 32, 128, 38912),
    (160, "sm_86"): (64, 32, 128, 43008), (176, "sm_86"): (64, 32, 128, 47104),
    (128, "sm_80"): (128, 64, 128, 69632), (224, "sm_80"): (64, 32, 128, 59392),
    (240, "sm_80"): (64, 32, 128, 63488), (256, "sm_80"): (64, 32, 128, 67584),
    (128, "sm_90"): (128, 64, 128, 104448),
}
for _dt in ("float16", "bfloat16"):
    MOVED.update({(f"flash_fwd_tc {_dt} {d}", arch): [*row, d, d] for (d, arch), row in _FWD_TC_MOVED.items()})
MOVED_DISPATCH = {("fwd_masked float32 256", "sm_90"): ["flash_fwd_tf32_masked", 64, 32, 256, 256]}
for _dt in ("float16", "bfloat16"):
    MOVED_DISPATCH.update({
        (f"bwd {_dt} 64", "sm_80"): ["flash_bwd_tc", 128, 128, 64, 64],
        (f"bwd {_dt} 64", "sm_90"): ["flash_bwd_tc", 128, 128, 64, 64],
        (f"bwd {_dt} 128", "sm_80"): ["flash_bwd_tc", 64, 128, 128, 128],
        (f"fwd {_dt} 128", "sm_80"): ["flash_fwd_tc", 128, 64, 128, 128],
        (f"fwd {_dt} 128", "sm_90"): ["flash_fwd_tc", 128, 64, 128, 128],
    })


def test_old_kernel_choices_and_serving_tiles_are_kept():
    """plan_flash_fwd / plan_flash_bwd / plan_bwd_tf32 choose the same kernels and tiles as
    before on sm_80 and sm_90 (d == dv, with and without features), and the serving kernel
    the same decoding tiles for every count of query rows."""
    from cuflash.launch.serving import serving_plan
    fns = {"fwd": tiling.plan_flash_fwd, "bwd": tiling.plan_flash_bwd,
           "bwd_tf32": tiling.plan_bwd_tf32}
    for key, archs in OLD["dispatch"].items():
        what, dtype, d = key.split()
        masked = what.endswith("_masked")
        for arch, want in archs.items():
            p = fns[what.replace("_masked", "")](int(d), int(d), dtype, limit=LIMITS[arch],
                                                 masked=masked)
            got = [p.kernel, p.block_q, p.block_kv, p.kd, p.kdv]
            if (key, arch) in MOVED_DISPATCH:
                assert got == MOVED_DISPATCH[key, arch] != want, (key, arch)
            else:
                assert got == want, (key, arch)
    rts = {a: kernels.get_runtime("emulator", arch=a) for a in ("sm_80", "sm_90")}
    for key, rows in OLD["serving"].items():
        kernel, dtype, d, arch = key.split()
        for r, want in rows.items():
            p = serving_plan(rts[arch], int(d), int(d), dtype, int(r), kernel=kernel)
            assert [p.block_q, p.block_kv] == want, (key, r)


# -- the tables and the planner -------------------------------------------------------------
def _cells():
    for kernel in curated.CURATED_KERNELS:
        for dtype, grid in curated.table(kernel).items():
            for c, row in grid.items():
                for arch, pairs in row.items():
                    yield kernel, dtype, c, arch, pairs


def test_every_curated_pair_fits_its_class():
    """A curated pair is one the planner takes when asked for at its class's nominal limit
    (shared memory, register rules, occupancy floor), compiled for the cell's head dims."""
    for kernel, dtype, c, arch, pairs in _cells():
        for bq, bkv in pairs:
            p = tiling.plan(kernel, c, c, dtype, bq, bkv, limit=LIMITS[arch])
            assert (p.kd, p.kdv, p.chosen) == (c, c, "explicit")
        step = 32 if kernel.startswith("flash_bwd_tf32") else 16
        for bq, bkv in pairs.padded or ():   # the padded build's own: a call with d < dv
            p = tiling.plan(kernel, c - step, c, dtype, bq, bkv, limit=LIMITS[arch])
            assert (p.kd, p.kdv, p.chosen) == (c, c, "explicit")


def test_table_shapes():
    """Head-dim classes: the SIMT classes, multiples of 16 up to 256 on the tensor cores
    (flash_bwd_tf32: 32 .. 128); every class has a default at every planned architecture
    (but float64 d = 256 backward on sm_75, which nothing fits); tensor-core families are not
    planned on sm_75; the Hopper kernels (the forward's head dims 64..256 by 64, the backward's
    64 and 128) only on sm_90; the backward's lean builds (flash_bwd_tc_band, _softcap, _alibi,
    _dropout) up to 128."""
    for kernel in curated.CURATED_KERNELS:
        grids = curated.table(kernel)
        hopper = {tiling.WGMMA_KERNEL: tiling.WGMMA_HEAD_DIMS,
                  tiling.BWD_WGMMA_KERNEL: tiling.BWD_WGMMA_HEAD_DIMS}
        if kernel in hopper:
            assert curated.table_arches(kernel) == ("sm_90",)
            assert all(tuple(g) == hopper[kernel] and all(r["sm_90"] for r in g.values())
                       for g in grids.values()) and set(grids) == set(tiling.TC_DTYPES)
            continue
        simt = not any(kernel.startswith(f) for f in TC_FAMILIES)
        classes = (tiling.SIMT_HEAD_DIM_CLASSES if simt else (32, 64, 96, 128)
                   if kernel.startswith("flash_bwd_tf32") else tuple(range(16, 129, 16))
                   if kernel in tiling.BWD_LEAN_KERNELS else tuple(range(16, 257, 16)))
        assert curated.table_arches(kernel) == (curated.ARCH_CLASSES if simt else
                                                ("sm_86", "sm_80", "sm_90")), kernel
        for dtype, grid in grids.items():
            assert tuple(grid) == classes, (kernel, dtype)
            for c, row in grid.items():
                for arch, pairs in row.items():
                    assert pairs or (simt and dtype == "float64" and c == 256 and arch == "sm_75"
                                     and "bwd" in kernel), (kernel, dtype, c, arch)
    assert curated.CURATED["flash_bwd_dq"] is curated.CURATED["flash_bwd_dkdv"]


def test_grid_parser():
    g = curated._grid(("a", "b", "c"), """
         16 | 64x32 32x32 | = | -
        128 | 16x16 | 32x8 16x8 | =
    """)
    assert {c: {a: b[0] for a, b in row.items()} for c, row in g.items()} == {
        16: {"a": ((64, 32), (32, 32)), "b": ((64, 32), (32, 32)), "c": ()},
        128: {"a": ((16, 16),), "b": ((32, 8), (16, 8)), "c": ((32, 8), (16, 8))}}
    assert all(b[1] is b[0] for row in g.values() for b in row.values())  # no ";": the same
    g = curated._grid(("a", "b", "c"), "32 | 64x32 32x32 / 32x32 | = | 16x16 / -")
    assert g[32]["b"][0] == ((64, 32), (32, 32)) and g[32]["b"][0].padded == ((32, 32),)
    assert g[32]["c"][0] == ((16, 16),) and g[32]["c"][0].padded == ()
    assert g[32]["a"][0].padded == ((32, 32),) and g[32]["a"][1] is g[32]["a"][0]
    with pytest.raises(ValueError, match="2 cells"):
        curated._grid(("a", "b", "c"), "16 | 64x32 | =")
    with pytest.raises(ValueError, match="twice"):
        curated._grid(("a",), "16 | 64x32 64x32")
    for bad, why in (("= | 8x8", "no cell to its left"), ("8x8 ; | 8x8", "without pairs"),
                     ("; 8x8 | 8x8", "without pairs"), ("/ 8x8 | 8x8", "without pairs"),
                     ("8x8 | = ; 8x8 ; 4x4", "not a list of pairs"),
                     ("8x8 / 4x4 / 2x2 | =", "not a list of pairs")):
        with pytest.raises(ValueError, match=why):
            curated._grid(("a", "b"), f"16 | {bad}")


def test_features_build_in_the_cells(monkeypatch):
    """After ``;`` a cell gives the features build's pairs (a ``_masked`` kernel's), with its
    own ``/`` for its padded build, its pairs left out for the plain build's; ``=`` in place of
    a build is that build of the cell to the left, a cell ``=`` both builds."""
    grid = curated._grid(("a", "b", "c", "d", "e"), "64 | 64x32 32x32 / 32x32 ; 32x32 | "
                         "= ; 16x16 / 16x8 | 8x8 ; = | = | 32x8 ; / 16x8")
    monkeypatch.setitem(curated.CURATED, "flash_fwd", {"float16": grid})

    def builds(arch):
        return tuple(curated.cell(k, "float16", 64, arch, padded)
                     for k in ("flash_fwd", "flash_fwd_masked") for padded in (False, True))
    p64, p32, p16, p16_8, p8, p32_8 = (((64, 32), (32, 32)), ((32, 32),), ((16, 16),),
                                       ((16, 8),), ((8, 8),), ((32, 8),))
    assert builds("a") == (p64, p32, p32, p32)
    assert builds("b") == (p64, p32, p16, p16_8)
    assert builds("c") == builds("d") == (p8, p8, p16, p16_8)
    assert builds("e") == (p32_8, p32_8, p32_8, p16_8)
    assert curated.table("flash_fwd_masked")["float16"][64]["e"] == p32_8


def test_one_table_per_family():
    """A family's kernel with the logit features (``_masked``) takes its family's table (the
    cells' features build), not a table of its own; the Hopper kernels have no features build."""
    assert not any(k.endswith("_masked") for k in curated.CURATED)
    masked = sorted(k for k in curated.CURATED_KERNELS if k.endswith("_masked"))
    assert masked == sorted(f"{k}_masked" for k in ("flash_fwd", "flash_fwd_tc", "flash_fwd_tf32",
                                                    "flash_bwd_dkdv", "flash_bwd_dq",
                                                    "flash_bwd_tc", "flash_bwd_tf32"))
    for k in masked:
        assert tiling.kernel_tiling(k).name == k
        assert curated.table_arches(k) == curated.table_arches(k[:-len("_masked")])
    assert curated.cell("flash_fwd_wgmma_masked", "float16", 128, "sm_90") == ()
    assert curated.table_arches("flash_fwd_serving_masked") == ()
    # a cell where the builds differ (the features' registers: 128 x 64 spills on sm_80)
    assert curated.cell("flash_fwd_tc", "float16", 64, "sm_80")[0] == (128, 64)
    assert curated.cell("flash_fwd_tc_masked", "float16", 64, "sm_80")[0] == (128, 32)


def test_arch_classes():
    assert [tiling.arch_class(LIMITS[a]) for a in ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")] \
        == ["sm_75", "sm_80", "sm_86", "sm_86", "sm_90"]
    assert tiling.arch_class(None) == "sm_90" and tiling.arch_class(48 * 1024) == "sm_75"
    assert tiling.arch_class(200 * 1024) == "sm_80" and tiling.arch_class(300 * 1024) == "sm_90"


def test_head_dim_classes_square_the_pairs():
    """d != dv: the SIMT kernels compile for the class of max(d, dv), the tensor-core ones for
    max(d, dv) with the padded build's define; d == dv on the tensor cores compiles as before."""
    p = tiling.plan("flash_fwd", 20, 70, "float64")
    assert (p.d, p.dv, p.kd, p.kdv) == (20, 70, 96, 96)
    assert "CUFLASH_HEAD_DIMS_PADDED" not in kernels.plan_defines(p)
    for kernel, dtype, (d, dv), want in (("flash_fwd_tc", "float16", (192, 128), 192),
                                         ("flash_fwd_tf32_masked", "float32", (32, 80), 80),
                                         ("flash_bwd_tc_masked", "bfloat16", (96, 48), 96),
                                         ("flash_bwd_tf32", "float32", (64, 128), 128)):
        p = tiling.plan(kernel, d, dv, dtype, limit=LIMITS["sm_80"])
        q = tiling.plan(kernel, want, want, dtype, limit=LIMITS["sm_80"])
        assert (p.kd, p.kdv) == (want, want) and _row(p) == _row(q)
        assert "CUFLASH_HEAD_DIMS_PADDED" in kernels.plan_defines(p)
        assert "CUFLASH_HEAD_DIMS_PADDED" not in kernels.plan_defines(q)
        assert f"compiled for the head-dim class {want}/{want}" in p.describe()
    # dims the tensor-core kernels do not take stay unpadded, and are refused
    with pytest.raises(ValueError, match="multiples of 16"):
        tiling.plan("flash_fwd_tc", 72, 64, "float16")


def test_padded_build_has_its_own_defaults_where_the_table_says():
    """A cell's pairs after ``/`` are the padded build's: a tensor-core call with d != dv
    takes them, one with d == dv the cell's own; without ``/`` both take the same."""
    lim = LIMITS["sm_90"]
    for kernel, dtype, (d, dv), plain, padded in (
            ("flash_fwd_tc_masked", "float16", (128, 64), (128, 32), (128, 16)),
            ("flash_fwd_tc_masked", "bfloat16", (48, 80), (128, 64), (128, 32)),
            ("flash_fwd_tf32_masked", "float32", (96, 128), (128, 16), (128, 32)),
            ("flash_fwd_tc", "float16", (64, 128), (128, 64), (128, 32))):
        c = max(d, dv)
        p, q = tiling.plan(kernel, d, dv, dtype, limit=lim), tiling.plan(kernel, c, c, dtype, limit=lim)
        assert ((q.block_q, q.block_kv), (p.block_q, p.block_kv)) == (plain, padded), kernel
        assert "CUFLASH_HEAD_DIMS_PADDED" in kernels.plan_defines(p)
    # no padded pair in the sm_80 cell (flash_fwd_tf32_masked at 256): the next class's cell
    p = tiling.plan("flash_fwd_tf32_masked", 256, 128, "float32", limit=LIMITS["sm_80"])
    assert (p.block_q, p.block_kv) == curated.cell("flash_fwd_tf32_masked", "float32", 256,
                                                   "sm_86", padded=True)[0]


def _default_jobs():
    """The compile-check jobs' keys of every group (once per test run)."""
    if not hasattr(_default_jobs, "keys"):
        _default_jobs.keys = {j.key for g in SWEEP.GROUPS for j in SWEEP.group_jobs(g)}
    return _default_jobs.keys


def _group_of(kernel):
    return next(g for g, spec in SWEEP.GROUPS.items() if kernel in spec[2])


def _job_key(group, p, arch):
    padded = (p.d, p.dv) != (p.kd, p.kdv) and tiling.kernel_tiling(p.kernel).pad_define
    return (f"{group} {p.dtype} {p.kd} {p.block_q}x{p.block_kv} sm_{curated.COMPILED_FOR[arch]}"
            + (" padded" if padded else ""))


def test_every_default_is_compile_checked():
    """The default plan at any head dims (d == dv at every one, 300 random d != dv pairs),
    dtype and architecture class is a job of the compile check, in its padded build where it
    pads; so are the serving kernel's decoding tiles."""
    from cuflash.launch.serving import serving_plan
    keys = _default_jobs()
    rnd = random.Random(7)
    pairs = [(d, d) for d in range(1, 257)] + [(rnd.randint(1, 256), rnd.randint(1, 256))
                                               for _ in range(300)]
    n = 0
    for kernel in curated.CURATED_KERNELS:
        if kernel.startswith("flash_bwd_dq"):
            continue  # launched with flash_bwd_dkdv's plan (its table)
        group = _group_of(kernel)
        for dtype in curated.table(kernel):
            for arch in curated.table_arches(kernel):
                for d, dv in pairs:
                    try:
                        p = tiling.plan(kernel, d, dv, dtype, limit=LIMITS[arch])
                    except ValueError:
                        continue
                    assert _job_key(group, p, arch) in keys, (kernel, dtype, d, dv, arch)
                    n += 1
    assert n > 20000
    for arch in ("sm_75", "sm_86", "sm_80", "sm_90"):
        rt = kernels.get_runtime("emulator", arch=arch)
        for kernel, group in (("flash_fwd", "flash_fwd_serving"),
                              ("flash_fwd_masked", "flash_fwd_serving_masked")):
            for dtype in ("float16", "float32", "float64"):
                for d, dv in pairs[::5]:
                    for rows in (1, 9, 17, 33, 65, 4096):
                        try:
                            p = serving_plan(rt, d, dv, dtype, rows, kernel=kernel)
                        except ValueError:
                            continue
                        assert _job_key(group, p, arch) in keys, (kernel, dtype, d, dv, rows)


def test_mixed_requests_prefer_curated_pairs():
    """One tile size given: the first pair of the limit's curated cell with it, else the
    largest the formulas allow (above the occupancy floor); the plan says it was mixed."""
    lim = LIMITS["sm_90"]
    p = tiling.plan("flash_fwd_tc", 128, 128, "float16", None, 16, limit=lim)
    assert (p.block_q, p.block_kv, p.chosen) == (128, 16, "mixed")  # curated: 128x32 64x32 128x16
    p = tiling.plan("flash_fwd_tc", 128, 128, "float16", 16, None, limit=lim)
    assert p.block_q == 16 and p.chosen == "mixed"
    assert p.block_kv == max(b for b in (16, 32, 64, 128) if _takes("flash_fwd_tc", 16, b, lim))


def _takes(kernel, bq, bkv, lim):
    try:
        tiling.plan(kernel, 128, 128, "float16", bq, bkv, limit=lim)
        return True
    except ValueError:
        return False


def test_no_default_is_made_up():
    """A kernel with a table but no cell for the dtype, or no curated pair that fits, refuses
    the default and says so; fixed-tile kernels keep their one pair."""
    with pytest.raises(ValueError, match="no curated plans for float32"):
        tiling.plan("flash_fwd_tc", 64, 64, "float32")
    with pytest.raises(ValueError, match="none of its curated plans fits"):
        tiling.plan("flash_bwd_tc", 256, 256, "float16", limit=20 * 1024)
    p = tiling.plan("flash_bwd_preprocess", 64, 64, "float32")
    assert (p.block_q, p.block_kv) == (tiling.BWD_PRE_ROWS, tiling.BWD_PRE_ROWS)


def test_explicit_tiles_are_taken_where_the_formulas_allow():
    """Pairs the old planner refused because a ptxas sweep had seen them spill are taken now
    (whether they spill is for the compile to tell); the formulas still refuse, with the
    reason and the pairs that fit."""
    for kernel, dtype, d, dv, bq, bkv in (("flash_bwd_tc", "float16", 176, 176, 64, 64),
                                          ("flash_bwd_tc", "float16", 224, 224, 32, 64),
                                          ("flash_fwd_tc_masked", "float16", 96, 96, 64, 64),
                                          ("flash_fwd", "float64", 224, 224, 32, 32),
                                          ("flash_bwd_dkdv", "float64", 128, 90, 32, 32),
                                          ("flash_fwd_tf32", "float32", 96, 64, 16, 16)):
        p = tiling.plan(kernel, d, dv, dtype, bq, bkv)
        assert (p.block_q, p.block_kv, p.chosen) == (bq, bkv, "explicit")
    with pytest.raises(ValueError, match=r"register floats.*pairs that fit"):
        tiling.plan("flash_bwd_tc", 256, 256, "float16", 128, 128)
    with pytest.raises(ValueError, match=r"budget is 101376 B \(sm_86\)"):
        tiling.plan("flash_fwd", 256, 256, "float64", 64, 64, limit=LIMITS["sm_86"],
                    limit_source="sm_86")


# the padded tensor-core builds with the logit features (the plain ones: test_kernels_forward,
# test_kernels_backward, test_kernels_backward_tf32 at d != dv): (dtype, d, dv, features, det)
PADDED_CASES = [
    ("float16", 64, 32, dict(softcap=3.0, bias=(2, 2, 37, 45)), True),
    ("bfloat16", 48, 80, dict(window=(10, 3), dropout_p=0.2, seed=3), False),
    ("float32", 96, 64, dict(window=(10, 3), dropout_p=0.2, seed=3, bias=(2, 1, 37, 45)), False),
]


@pytest.mark.parametrize("case", PADDED_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-dv{c[2]}")
def test_padded_tensor_core_builds_match_the_oracle(case, rng):
    """d != dv on the tensor cores runs the build for max(d, dv) (-DCUFLASH_HEAD_DIMS_PADDED):
    forward and backward with features against the oracle, every output poisoned first (a
    padding column stored, or a row length taken from the compiled head dims, fails)."""
    import oracle
    from conftest import poisoned_outputs, require_backend
    import cuflash
    from cuflash.launch import common as launch_common
    require_backend("emulator")
    dtype, d, dv, feat, det = case
    feat = dict(feat)
    if "bias" in feat:
        feat["bias"] = oracle.randn(rng, feat["bias"], "float32")
    q, k = oracle.randn(rng, (2, 2, 37, d), dtype), oracle.randn(rng, (2, 2, 45, d), dtype)
    v = oracle.randn(rng, (2, 2, 45, dv), dtype)
    with poisoned_outputs(), launch_common.observe_launches() as seen:
        o, lse = cuflash.tiled_attention(q, k, v, causal="bottom_right", return_lse=True,
                                         backend="emulator", **feat)
        do = oracle.randn(rng, o.shape, dtype)
        grads = cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal="bottom_right",
                                                 deterministic=det, backend="emulator", **feat)
    names = [e["kernel"] for e in seen]
    want = (("flash_fwd_tf32_masked", "flash_bwd_tf32_masked") if dtype == "float32" else
            ("flash_fwd_tc_masked", "flash_bwd_tc_masked"))
    assert set(want) <= set(names), names
    oracle.check_forward(o, q, k, v, None, "bottom_right", lse=lse, **feat)
    oracle.check_backward(grads, do, q, k, v, None, "bottom_right", **feat)


# -- SpillError on a GPU ------------------------------------------------------------------------
class _FakeRuntime:
    name = "cuda"
    device_key = ("cuda", 99)

    def __init__(self, limit):
        self.smem_limit = limit


class _FakeFunction:
    def __init__(self, local):
        self.local_size_bytes, self.num_regs = local, 255


@pytest.fixture
def _fresh_checks():
    kernels._CHECKED.clear()
    yield
    kernels._CHECKED.clear()


def test_spill_error_names_the_curated_plans(_fresh_checks):
    """A compiled kernel with local memory is not run: SpillError names its family's curated
    pairs for the dtype, head dims and architecture class (the default marked), and says
    whether the spilling tiles were one of them."""
    rt = _FakeRuntime(LIMITS["sm_90"])
    p = tiling.plan("flash_bwd_tc", 128, 128, "float16", 16, 128, limit=rt.smem_limit)
    opts = kernels.build_options(dict(kernels.plan_defines(p), CUFLASH_BWD_TC_MAIN=None))
    with pytest.raises(kernels.SpillError) as e:
        kernels.check_compiled(rt, _FakeFunction(24), "flash_bwd_tc", opts)
    msg = str(e.value)
    assert "24 bytes of local memory" in msg and "not run" in msg
    assert ("(64, 128) (the default), (64, 64), (32, 128) (curated for sm_90)" in msg
            and "Pass one of them as block_q/block_kv" in msg)
    # a curated pair itself: the compiler differs from CI's
    d = tiling.plan("flash_fwd", 80, 80, "float64", 16, 32, limit=rt.smem_limit)
    opts = kernels.build_options(dict(kernels.plan_defines(d), CUFLASH_FWD_SERVING=None))
    with pytest.raises(kernels.SpillError, match=r"flash_fwd for float64 at head dims 96/96.*"
                       r"\(32, 32\) \(the default\), \(16, 32\).*These tiles are one of them"):
        kernels.check_compiled(rt, _FakeFunction(8), "flash_fwd_serving", opts)
    # a helper kernel (no tiles of its own)
    opts = kernels.build_options({"CUFLASH_DTYPE_F16": None, "CUFLASH_BWD_TC_HELPERS": None})
    with pytest.raises(kernels.SpillError, match="no curated tile plans.*please report"):
        kernels.check_compiled(rt, _FakeFunction(4), "flash_bwd_tc_dq_convert", opts)
    # no local memory: nothing raised, and not checked again
    kernels.check_compiled(rt, _FakeFunction(0), "flash_bwd_tc", opts)
    assert (rt.device_key, "flash_bwd_tc", opts) in kernels._CHECKED


@pytest.mark.skipif(not _nvrtc.is_available()[0], reason="NVRTC not available")
def test_spill_error_from_nvrtc_output(_fresh_checks):
    """Explicit tiles the size formulas take but ptxas spills (flash_fwd_tc_masked float16
    d = 96, 64 x 64 on sm_80): the plan is honoured, and check_compiled, fed the local memory
    NVRTC's ptxas reports for the launch's options (CuPy's local_size_bytes is the stack frame,
    spill slots included), refuses to run it, naming the curated plans of the cell."""
    rt = _FakeRuntime(LIMITS["sm_80"])
    p = tiling.plan("flash_fwd_tc_masked", 96, 96, "float16", 64, 64, limit=rt.smem_limit)
    assert p.chosen == "explicit" and (64, 64) not in curated.cell("flash_fwd_tc_masked", "float16",
                                                                   96, "sm_80")
    opts = kernels.build_options(dict(kernels.plan_defines(p), CUFLASH_MASKS=None))
    res = _nvrtc.compile((ROOT / "kernels_cu" / "flash_fwd_tc.cu").read_text(), "flash_fwd_tc.cu",
                         ["-arch=sm_80", "--ptxas-options=-v", *opts])
    info = _nvrtc.parse_ptxas_info(res.log)["flash_fwd_tc_masked"]
    assert info["spill_stores"] > 0 and info["stack_frame"] > 0
    with pytest.raises(kernels.SpillError) as e:
        kernels.check_compiled(rt, _FakeFunction(info["stack_frame"]), "flash_fwd_tc_masked", opts)
    msg = str(e.value)
    assert f"{info['stack_frame']} bytes of local memory" in msg and "CUFLASH_BLOCK_Q=64" in msg
    assert ("curated plans of flash_fwd_tc_masked for float16 at head dims 96/96" in msg
            and "(128, 32) (the default), (64, 32), (32, 32) (curated for sm_80)" in msg)
    # the cell's default, compiled the same way, has no local memory: nothing raised
    d = tiling.plan("flash_fwd_tc_masked", 96, 96, "float16", limit=rt.smem_limit)
    dopts = kernels.build_options(dict(kernels.plan_defines(d), CUFLASH_MASKS=None))
    res = _nvrtc.compile((ROOT / "kernels_cu" / "flash_fwd_tc.cu").read_text(), "flash_fwd_tc.cu",
                         ["-arch=sm_80", "--ptxas-options=-v", *dopts])
    local = _nvrtc.parse_ptxas_info(res.log)["flash_fwd_tc_masked"]["stack_frame"]
    assert local == 0
    kernels.check_compiled(rt, _FakeFunction(local), "flash_fwd_tc_masked", dopts)


def test_no_error_points_at_files_a_wheel_lacks():
    """What the planner and the kernels module raise names no repository file (a wheel ships
    neither bench/ nor tests/)."""
    src = "".join(p.read_text() for p in (ROOT / "cuflash" / "tiling").glob("*.py"))
    src += (ROOT / "cuflash" / "kernels.py").read_text()
    raises = re.findall(r"raise \w+\((?:[^()]|\([^()]*\))*\)", src, re.S)
    assert raises
    for r in raises:
        assert "bench/" not in r and "tests/" not in r and ".json" not in r, r


# -- the compile check -------------------------------------------------------------------------
ok, why = _nvrtc.is_available()
if not ok and os.environ.get("CI"):
    raise RuntimeError(f"NVRTC not available in CI: {why}")


@pytest.mark.skipif(not ok, reason=f"NVRTC not available: {why}")
@pytest.mark.parametrize("group", sorted(SWEEP.GROUPS))
def test_curated_plans_compile_without_local_memory(group):
    """The group's compiles use no local memory: those the record vouches for (its sources,
    NVRTC and options) by the record's word; of the others, the defaults (what calls without
    tiles launch) are compiled here, or every one with CUFLASH_PLAN_CHECK=all, which also
    ignores the record -- the full check, run after a kernel edit (``-k <family>``)."""
    jobs = SWEEP.group_jobs(group)
    assert jobs
    if os.environ.get("CUFLASH_PLAN_CHECK") == "all":
        todo = jobs
    else:
        todo = [j for j in SWEEP.unrecorded(group, jobs) if j.default]
    failing = {key: SWEEP.bad(info) for key, _, info, _, _ in SWEEP.compile_all(todo, progress=False)
               if SWEEP.bad(info)}
    rec = SWEEP.load_record()["groups"].get(group)
    if rec is not None and rec["source_hash"] == SWEEP.group_hash(group) \
            and rec["nvrtc"] == SWEEP.nvrtc_version():
        keys = {j.digest: j.key for j in jobs}
        failing.update({keys[k]: v for k, v in rec["rows"].items()
                        if not isinstance(v, int) and keys[k] not in failing})
    assert not failing, (f"{len(failing)} compiles use local memory or fail; edit their cells in "
                         f"cuflash/tiling/curated.py: {sorted(failing.items())[:20]}")


@pytest.mark.skipif(not ok, reason=f"NVRTC not available: {why}")
@pytest.mark.parametrize("group", sorted(SWEEP.GROUPS))
def test_record_matches_a_fresh_compile(group):
    """A sample of the group's compiles (the default of the largest head-dim class per dtype
    class and architecture class) compiles clean here, with the registers the record holds
    where the record is of these sources and this NVRTC: the record's word stays checked."""
    jobs = SWEEP.sample_jobs(group)
    assert jobs and {j.key for j in jobs} <= {j.key for j in SWEEP.group_jobs(group)}
    rec = SWEEP.load_record()["groups"].get(group)
    current = (rec is not None and rec["source_hash"] == SWEEP.group_hash(group)
               and rec["nvrtc"] == SWEEP.nvrtc_version())
    for key, digest, info, _, _ in SWEEP.compile_all(jobs, progress=False):
        assert SWEEP.bad(info) is None, (key, SWEEP.bad(info))
        if current:
            assert rec["rows"].get(digest) == max(f["registers"] for f in info.values()), key


def test_check_rule_sees_spills_and_stack_frames():
    ok_ = {"k": {"registers": 255, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}}
    assert SWEEP.bad(ok_) is None
    for field in ("spill_stores", "spill_loads", "stack_frame"):
        assert "spills" in SWEEP.bad({"k": dict(ok_["k"], **{field: 8})})
    assert SWEEP.bad({"error": "x\nboom"}).startswith("compile error")
    assert SWEEP.bad({}) == "no kernel in ptxas' report"


def test_record_vouches_only_for_its_sources(tmp_path, monkeypatch):
    """The record's word is taken for a compile only with the same sources, NVRTC and options
    digest, and a clean result."""
    jobs = SWEEP.group_jobs("flash_bwd_tf32")[:3]
    rec = {"groups": {"flash_bwd_tf32": {"nvrtc": SWEEP.nvrtc_version(),
                                         "source_hash": SWEEP.group_hash("flash_bwd_tf32"),
                                         "rows": {jobs[0].digest: 200,
                                                  jobs[1].digest: "flash_bwd_tf32: spills"}}}}
    assert SWEEP.unrecorded("flash_bwd_tf32", jobs, rec) == jobs[1:]
    rec["groups"]["flash_bwd_tf32"]["source_hash"] = "0"
    assert SWEEP.unrecorded("flash_bwd_tf32", jobs, rec) == jobs
    assert SWEEP.unrecorded("flash_fwd", jobs, rec) == jobs  # no record of the group


def test_recorded_plan_data_is_small():
    """The record and the old defaults together stay under 200 KB."""
    size = (SWEEP.RESULTS.stat().st_size
            + (ROOT / "tests" / "tiling" / "data" / "old_defaults.json").stat().st_size)
    assert size < 200 * 1024


def test_source_hash_follows_included_headers(tmp_path, monkeypatch):
    (tmp_path / "kernels_cu").mkdir()
    (tmp_path / "kernels_cu" / "a.cu").write_text('#include "b.cuh"\n')
    (tmp_path / "kernels_cu" / "b.cuh").write_text("int x;\n")
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)
    h1 = SWEEP.source_hash("a.cu")
    (tmp_path / "kernels_cu" / "b.cuh").write_text("int y;\n")
    assert SWEEP.source_hash("a.cu") != h1


def test_source_hash_resolves_region_defines_only(tmp_path, monkeypatch):
    """An edit inside a region a group does not compile leaves its hash; an edit in code it
    compiles, or under a condition the resolver does not evaluate (the padded build's among
    them), changes it."""
    kdir = tmp_path / "kernels_cu"
    kdir.mkdir()
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)
    text = ("int a;\n#ifdef CUFLASH_MASKS\n#include \"m.cuh\"\nint masked;\n#else\nint plain;\n"
            "#endif  // CUFLASH_MASKS\n#if defined(CUFLASH_DTYPE_F16)\nint f16;\n#endif\n"
            "#if !defined(CUFLASH_BWD_TC_MAIN) && defined(CUFLASH_MASKS)\nint helpers;\n#endif\n"
            "#ifdef CUFLASH_HEAD_DIMS_PADDED\nint padded;\n#endif\n")

    def hashes(src, header="int m;\n"):
        (kdir / "a.cu").write_text(src)
        (kdir / "m.cuh").write_text(header)
        return (SWEEP.source_hash("a.cu"), SWEEP.source_hash("a.cu", ["CUFLASH_MASKS"]))

    plain, masked = hashes(text)
    assert plain != masked
    p2, m2 = hashes(text.replace("int masked;", "int masked2;"), "int m2;\n")
    assert p2 == plain and m2 != masked
    p3, m3 = hashes(text.replace("int plain;", "int plain2;"))
    assert p3 != plain and m3 == masked
    p4, m4 = hashes(text.replace("int f16;", "int f16b;"))
    assert p4 != plain and m4 != masked
    p5, m5 = hashes(text.replace("int helpers;", "int helpers2;"))
    assert p5 == plain and m5 != masked
    p6, m6 = hashes(text.replace("int padded;", "int padded2;"))
    assert p6 != plain and m6 != masked
    resolved = SWEEP.resolve_regions(text, {"CUFLASH_MASKS"})
    assert "int masked;" in resolved and "int plain;" not in resolved
    assert "#ifdef CUFLASH_MASKS" not in resolved
    assert "#if defined(CUFLASH_DTYPE_F16)" in resolved and "int f16;" in resolved


def test_source_hash_ignores_comments_only(tmp_path, monkeypatch):
    kdir = tmp_path / "kernels_cu"
    kdir.mkdir()
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)

    def h(text):
        (kdir / "a.cu").write_text(text)
        return SWEEP.source_hash("a.cu")

    base = h('int a; // one\n/* two\n lines */ asm("x // y");\n')
    assert h('int a; // ONE\n/* other\n words */ asm("x // y");\n') == base
    assert h('// a new comment line\nint a;  \n\n/* two\n lines */ asm("x // y");\n') == base
    assert h('int b; // one\n/* two\n lines */ asm("x // y");\n') != base
    assert h('int a; // one\n/* two\n lines */ asm("x // z");\n') != base


def test_region_defines_are_not_plan_defines():
    """The resolver evaluates the region names from GROUPS' defines alone: no plan's own
    defines may set one."""
    for kernel, dtype, c, arch, pairs in _cells():
        for bq, bkv in pairs:
            p = tiling.plan(kernel, c, c, dtype, bq, bkv, limit=LIMITS[arch])
            assert not set(kernels.plan_defines(p)) & SWEEP.REGION_DEFINES, kernel


def test_rehash_tokens_see_code_not_comments_or_emulator_code(tmp_path):
    """plan_sweep --rehash carries the record over an edit only when NVRTC would compile the
    same tokens: a comment, whitespace or CUFLASH_EMULATOR-only edit keeps them, a code edit
    does not."""
    import shutil
    job = SWEEP.group_jobs("online_softmax")[0]
    kdir = tmp_path / "kernels_cu"
    shutil.copytree(ROOT / "kernels_cu", kdir)
    fname = SWEEP.GROUPS["online_softmax"][0]
    base = SWEEP.nvrtc_tokens(job, ROOT / "kernels_cu")
    src = (kdir / fname).read_text()
    (kdir / fname).write_text("// a new comment\n#ifdef CUFLASH_EMULATOR\nint emu_only;\n#endif\n"
                              + src.replace(";", " ;", 3))
    assert SWEEP.nvrtc_tokens(job, kdir) == base
    (kdir / fname).write_text("__device__ int one_more_symbol;\n" + src)
    assert SWEEP.nvrtc_tokens(job, kdir) != base


def test_sweep_workers_do_not_fork_a_threaded_process(tmp_path):
    """bench/plan_sweep.py's compile workers start from a forkserver: forked from a process in
    which JAX (imported by other tests of the suite) runs threads, a child can hang on a lock
    one of those threads held, and JAX warns on every such fork."""
    pytest.importorskip("jax")
    script = ("import jax, jax.numpy as jnp\n"
              "jnp.ones(3).block_until_ready()  # JAX's threads are running\n"
              "import plan_sweep as ps\n"
              "res = ps.compile_all(ps.group_jobs('online_softmax')[:4], 2, progress=False)\n"
              "assert len(res) == 4 and all('error' not in info for _, _, info, _, _ in res), res\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)] + sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "os.fork() was called" not in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(not ok, reason=f"NVRTC not available: {why}")
def test_stale_check_carries_compiles_whose_ptx_is_unchanged(tmp_path, monkeypatch, capsys):
    """plan_sweep --stale after a kernel edit: a compile whose PTX the edit left as it was keeps
    its recorded result (ptxas, given the same PTX, options and version, reports the same), so
    a header edit costs the sample's compiles and the others' PTX pass; an edit of the code
    compiles everything once, the sample included, with no PTX pass when the sample finds
    every PTX changed.  The PTX pass reads what ptxas reads."""
    import shutil
    shutil.copytree(ROOT / "kernels_cu", tmp_path / "kernels_cu")
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)
    monkeypatch.setattr(SWEEP, "RESULTS", tmp_path / "plan_sweep.json")
    # in-process, so that the compiles see this ROOT
    monkeypatch.setattr(SWEEP, "compile_all",
                        lambda jobs, workers=None, progress=True, fn=SWEEP.compile_job: [fn(j) for j in jobs])
    g = "online_softmax"
    jobs = SWEEP.group_jobs(g)
    job = jobs[0]
    full = SWEEP.compile_job(job)
    assert full[4] == SWEEP.ptx_job(job)[1] and SWEEP.ptx_digest(SWEEP.compile_result(job).ptx) == full[4]

    def run(*args):
        assert SWEEP.main(["--groups", g, "--write", "--jobs", "1", *args]) == 0
        out = capsys.readouterr().out
        row = next(line.split() for line in out.splitlines() if line.startswith(g))
        rec = SWEEP.load_record()["groups"][g]
        assert rec["source_hash"] == SWEEP.group_hash(g) and set(SWEEP.recorded_ptx(rec)) == set(rec["rows"])
        return int(row[1]), int(row[2]), rec     # compiled, carried, the record

    compiled, carried, rec0 = run()
    assert (compiled, carried) == (len(jobs), 0) and len(rec0["rows"]) == len(jobs)
    assert run("--stale")[:2] == (0, 0)             # nothing stale
    header = tmp_path / "kernels_cu" / "dtype.cuh"
    header.write_text(header.read_text() + "\n__device__ __forceinline__ int unused_helper(int x) { return x + 1; }\n")
    calls = []
    monkeypatch.setattr(SWEEP, "compile_all",
                        lambda jobs, workers=None, progress=True, fn=SWEEP.compile_job:
                        calls.append((fn, len(jobs))) or [fn(j) for j in jobs])
    compiled, carried, rec1 = run("--stale")        # a header edit: the same PTX everywhere
    sample = min(8, len(jobs))                      # carry_by_ptx's sample, compiled in full
    assert (compiled, carried) == (sample, len(jobs) - sample)
    assert rec1["source_hash"] != rec0["source_hash"]
    assert rec1["rows"] == rec0["rows"] and rec1["ptx"] == rec0["ptx"]
    src = tmp_path / "kernels_cu" / "online_softmax.cu"
    text = src.read_text()
    assert text.count("off = 16; off > 0; off >>= 1) x += ") == 1   # the row sum's shuffles
    src.write_text(text.replace("off = 16; off > 0; off >>= 1) x += ", "off = 8; off > 0; off >>= 1) x += "))
    calls.clear()
    compiled, carried, rec2 = run("--stale")        # a code edit: every PTX differs
    assert (compiled, carried) == (len(jobs), 0) and rec2["ptx"] != rec0["ptx"]
    assert all(fn is SWEEP.compile_job for fn, _ in calls)    # no PTX pass: each job compiled once
    assert sum(n for _, n in calls) == len(jobs)
    assert all(isinstance(v, int) for v in rec2["rows"].values())

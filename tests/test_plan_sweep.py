"""Every tile plan the planner accepts was compiled without spills (issue 12).

``bench/plan_sweep.py --write`` compiles, per kernel family and architecture, every plan that
``cuflash.tiling.plan`` accepts (~20,000 NVRTC compiles, too slow for CI) and records registers,
spills and stack frames in ``bench/results/plan_sweep.json`` with a hash of each family's
kernel source and the headers it includes.  Here the accepted plans are enumerated again
(cheap: the planner only) and each must be in that record, spill-free, and the record must
be of the current sources: a planner change that accepts a new plan, or a kernel change,
fails here until the sweep is rerun.  ``tests/test_tc_plans.py`` compiles the largest
tensor-core plans live; ``kernels.check_compiled`` refuses a spilling kernel on a GPU.
"""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("plan_sweep", ROOT / "bench" / "plan_sweep.py")
SWEEP = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SWEEP)


def _record():
    assert SWEEP.RESULTS.exists(), f"{SWEEP.RESULTS} missing: run python bench/plan_sweep.py --write"
    return json.loads(SWEEP.RESULTS.read_text())["families"]


# The sweep of 2026-11-23 found 13 float64 flash_bwd_dq plans spilling 176-248 B (64 doubles of
# dQ per thread); tiling.BWD_MAX_DQ_ACC_FLOAT64 refuses them since, and their rows were removed.
@pytest.mark.parametrize("family", sorted(SWEEP.FAMILIES))
def test_every_accepted_plan_was_compiled_without_spills(family):
    fam = _record().get(family)
    rerun = f"python bench/plan_sweep.py --families {family} --write"
    assert fam is not None, f"{family} was never swept: {rerun}"
    assert fam["source_hash"] == SWEEP.family_hash(family), (
        f"the kernel sources of {family} changed since its sweep: {rerun}")
    rows = {r["key"]: r for r in fam["rows"]}
    n = 0
    for arch in SWEEP.ARCHS:
        for plan in SWEEP.accepted_plans(family, arch):
            key = SWEEP.plan_key(family, plan, arch)
            assert key in rows, f"{key} is accepted by the planner but was not swept: {rerun}"
            assert SWEEP.bad(rows[key]) is None, f"{key}: {SWEEP.bad(rows[key])}"
            n += 1
    assert n > 0


def test_bwd_tc_edge_spills_are_the_recorded_ones_and_refused():
    """tiling's BWD_TC_EDGE_SPILLS is exactly what the edge sweep's record says spilled, and
    the planner refuses each of those plans at the limits they were compiled for."""
    from cuflash import tiling
    from cuflash.tiling import bwd_tc
    rows = json.loads(SWEEP.EDGE_RESULTS.read_text())["rows"]
    assert len(rows) > 1000
    spilled = [r for r in rows if SWEEP.bad(r)]
    assert {(r["block_q"], r["block_kv"], r["d"], r["dv"]) for r in spilled} == \
        set(bwd_tc.BWD_TC_EDGE_SPILLS)
    for r in spilled:
        with pytest.raises(ValueError, match="ptxas spills this plan"):
            tiling.plan("flash_bwd_tc", r["d"], r["dv"], r["dtype"], r["block_q"], r["block_kv"],
                        limit=tiling.EMULATOR_ARCHES[f"sm_{r['arch']}"])


def test_sweep_rule_sees_spills():
    """The check itself: a row with spill bytes, a stack frame or a compile error is bad."""
    ok = {"kernels": {"k": {"registers": 255, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0}}}
    assert SWEEP.bad(ok) is None
    for field in ("spill_stores", "spill_loads", "stack_frame"):
        row = {"kernels": {"k": dict(ok["kernels"]["k"], **{field: 8})}}
        assert "spills" in SWEEP.bad(row)
    assert SWEEP.bad({"error": "x"}) == "compile error"


def test_source_hash_follows_included_headers(tmp_path, monkeypatch):
    (tmp_path / "kernels_cu").mkdir()
    (tmp_path / "kernels_cu" / "a.cu").write_text('#include "b.cuh"\n')
    (tmp_path / "kernels_cu" / "b.cuh").write_text("int x;\n")
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)
    h1 = SWEEP.source_hash("a.cu")
    (tmp_path / "kernels_cu" / "b.cuh").write_text("int y;\n")
    assert SWEEP.source_hash("a.cu") != h1


def test_source_hash_resolves_region_defines_only(tmp_path, monkeypatch):
    """An edit inside a region a family does not compile leaves its hash; an edit in code it
    compiles, or under a condition the resolver does not evaluate, changes it."""
    kdir = tmp_path / "kernels_cu"
    kdir.mkdir()
    monkeypatch.setattr(SWEEP, "ROOT", tmp_path)
    text = ("int a;\n#ifdef CUFLASH_MASKS\n#include \"m.cuh\"\nint masked;\n#else\nint plain;\n"
            "#endif  // CUFLASH_MASKS\n#if defined(CUFLASH_DTYPE_F16)\nint f16;\n#endif\n"
            "#if !defined(CUFLASH_BWD_TC_MAIN) && defined(CUFLASH_MASKS)\nint helpers;\n#endif\n")
    (kdir / "m.cuh").write_text("int m;\n")

    def hashes(src, header="int m;\n"):
        (kdir / "a.cu").write_text(src)
        (kdir / "m.cuh").write_text(header)
        return (SWEEP.source_hash("a.cu"), SWEEP.source_hash("a.cu", ["CUFLASH_MASKS"]))

    plain, masked = hashes(text)
    assert plain != masked
    # masked-only code and the header only it includes: the plain hash stays
    p2, m2 = hashes(text.replace("int masked;", "int masked2;"), "int m2;\n")
    assert p2 == plain and m2 != masked
    p3, m3 = hashes(text.replace("int plain;", "int plain2;"))
    assert p3 != plain and m3 == masked
    # a condition on another name is hashed as written for both
    p4, m4 = hashes(text.replace("int f16;", "int f16b;"))
    assert p4 != plain and m4 != masked
    # a compound condition over region names is evaluated
    p5, m5 = hashes(text.replace("int helpers;", "int helpers2;"))
    assert p5 == plain and m5 != masked
    resolved = SWEEP.resolve_regions(text, {"CUFLASH_MASKS"})
    assert "int masked;" in resolved and "int plain;" not in resolved and "#ifdef" not in resolved
    assert "#if defined(CUFLASH_DTYPE_F16)" in resolved and "int f16;" in resolved


def test_region_defines_are_not_plan_defines():
    """The resolver evaluates the region names from FAMILIES' extra defines alone: no plan's own
    defines may set one."""
    from cuflash import kernels
    for family in SWEEP.FAMILIES:
        for arch in SWEEP.ARCHS:
            for plan in SWEEP.accepted_plans(family, arch):
                assert not set(kernels.plan_defines(plan)) & SWEEP.REGION_DEFINES, family


def test_source_hash_ignores_comments_only(tmp_path, monkeypatch):
    """A comment edit (lines added or removed too) leaves the hash; an edit of code or of a
    string literal changes it."""
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


# -- d != dv on the tensor-core kernels: every tile pair at tiling.TC_ASYM_SWEPT, the default
# plan only elsewhere (so that the sweep, ~6,000 compiles instead of ~48,000, covers them all)
_TC_KERNELS = {"flash_fwd_tc": "float16", "flash_fwd_tf32": "float32", "flash_bwd_tc": "bfloat16",
               "flash_bwd_tf32": "float32", "flash_fwd_tc_masked": "float16",
               "flash_fwd_tf32_masked": "float32", "flash_bwd_tc_masked": "float16",
               "flash_bwd_tf32_masked": "float32"}


@pytest.mark.parametrize("kernel", sorted(_TC_KERNELS))
def test_unswept_d_ne_dv_takes_the_default_tiles_only(kernel):
    from cuflash import tiling
    dtype, limit = _TC_KERNELS[kernel], tiling.EMULATOR_ARCHES["sm_80"]
    t = tiling.kernel_tiling(kernel)
    assert t.asym_swept == tiling.TC_ASYM_SWEPT
    plan = lambda d, dv, *tiles: tiling.plan(kernel, d, dv, dtype, *tiles, limit=limit,  # noqa: E731
                                             limit_source="sm_80")
    d, dv = 96, 64  # not in TC_ASYM_SWEPT; every kernel takes it
    assert (d, dv) not in tiling.TC_ASYM_SWEPT
    dflt = plan(d, dv)
    assert plan(d, dv, dflt.block_q, dflt.block_kv).chosen == "explicit"
    others = [(a, b) for a in t.block_q_choices for b in t.block_kv_choices
              if (a, b) != (dflt.block_q, dflt.block_kv)]
    refused = 0
    for a, b in others:
        try:
            plan(d, dv, a, b)
        except ValueError as e:
            if "explicit tiles are taken only where ptxas was run" in str(e):
                assert f"({dflt.block_q}, {dflt.block_kv}) (the default, sm_80)" in str(e)
                refused += 1
            continue
        pytest.fail(f"{kernel} took {a}x{b} at d={d}, dv={dv}: not swept")
    assert refused > 0
    # a mixed request is taken when it resolves to the default
    assert plan(d, dv, dflt.block_q, None).block_kv == dflt.block_kv
    # the same tiles at d == dv and at a swept d != dv pair: taken, as every tile pair there
    a, b = others[0]
    for dd, ddv in ((64, 64), (128, 64)):
        try:
            plan(dd, ddv, a, b)
        except ValueError as e:
            assert "explicit tiles are taken only" not in str(e)


def test_unswept_d_ne_dv_explicit_tiles_refused_through_the_api():
    """The forward's tensor-core choice refuses them (and lists the default) before running,
    rather than running them on the SIMT kernel."""
    import cuflash
    from cuflash import tiling
    q = np.zeros((1, 1, 8, 96), np.float16)
    v = np.zeros((1, 1, 8, 64), np.float16)
    dflt = tiling.plan("flash_fwd_tc", 96, 64, "float16", limit=tiling.EMULATOR_ARCHES["sm_80"])
    assert (dflt.block_q, dflt.block_kv) != (16, 16)
    with pytest.raises(ValueError, match=r"explicit tiles are taken only where ptxas was run.*"
                       rf"flash_fwd_tc takes here: \({dflt.block_q}, {dflt.block_kv}\)"):
        cuflash.tiled_attention(q, q, v, backend="emulator", block_q=16, block_kv=16)


def test_asym_default_spills_are_recorded_and_refused():
    """Each default plan refused in tiling/_asym_spills.py spilled in the record of its kernel's
    d != dv family, and the planner refuses it (the default moves on)."""
    from cuflash import tiling
    fams = {SWEEP.FAMILIES[f][1]: f for f in SWEEP.FAMILIES if f.endswith("_asym")}
    record = _record()
    n = 0
    for kernel, plans in tiling.ASYM_DEFAULT_SPILLS.items():
        spilled = {(r["block_q"], r["block_kv"], r["d"], r["dv"], r["arch"])
                   for r in record[fams[kernel]]["rows"] if SWEEP.bad(r)}
        for (bq, bkv, d, dv), archs in plans.items():
            assert (d, dv) not in tiling.TC_ASYM_SWEPT and d != dv
            for arch in (80, 90):
                assert ((bq, bkv, d, dv, arch) in spilled) == (arch in archs), (kernel, bq, bkv, d, dv)
                limit = tiling.EMULATOR_ARCHES[f"sm_{arch}"]
                assert tiling.sweep_arch(limit) == arch
                try:
                    tiling.plan(kernel, d, dv, _TC_KERNELS[kernel], bq, bkv, limit=limit)
                    assert arch not in archs, (kernel, bq, bkv, d, dv, arch)
                except ValueError as e:  # refused where it spilled (or for another reason)
                    assert arch not in archs or "ptxas spills this plan" in str(e)
            with pytest.raises(ValueError, match="ptxas spills this plan"):  # no limit: any arch
                tiling.plan(kernel, d, dv, _TC_KERNELS[kernel], bq, bkv)
            n += 1
    assert n > 0


def test_arch_spills_are_recorded_and_refused():
    """Each plan refused per architecture in tiling/_arch_spills.py (d == dv, or a swept d != dv
    pair) spilled in the record of its kernel's families on exactly those architectures; the
    planner refuses it there, takes it on the others where nothing else refuses it, and refuses
    it without a limit."""
    from cuflash import tiling
    fams = {}
    for f, spec in SWEEP.FAMILIES.items():
        fams.setdefault(spec[1], []).append(f)
    record = _record()
    n = 0
    for kernel, plans in tiling.ARCH_SPILLS.items():
        rows = [r for f in fams[kernel] for r in record[f]["rows"]]
        spilled = {(r["block_q"], r["block_kv"], r["d"], r["dv"], r["arch"]) for r in rows if SWEEP.bad(r)}
        clean = {(r["block_q"], r["block_kv"], r["d"], r["dv"], r["arch"]) for r in rows if not SWEEP.bad(r)}
        for (bq, bkv, d, dv), archs in plans.items():
            assert d == dv or (d, dv) in tiling.TC_ASYM_SWEPT, (kernel, bq, bkv, d, dv)
            assert archs and set(archs) <= {80, 90}
            for arch in (80, 90):
                assert ((bq, bkv, d, dv, arch) in spilled) == (arch in archs), (kernel, bq, bkv, d, dv, arch)
                limit = tiling.EMULATOR_ARCHES[f"sm_{arch}"]
                try:
                    tiling.plan(kernel, d, dv, _TC_KERNELS[kernel], bq, bkv, limit=limit)
                    assert arch not in archs, (kernel, bq, bkv, d, dv, arch)
                    assert (bq, bkv, d, dv, arch) in clean  # taken where it compiled clean
                except ValueError as e:
                    assert arch not in archs or "ptxas spills this plan" in str(e)
            with pytest.raises(ValueError, match="ptxas spills this plan"):  # no limit: any arch
                tiling.plan(kernel, d, dv, _TC_KERNELS[kernel], bq, bkv)
            n += 1
    assert n > 0


def test_refused_simt_plans_are_reachable_and_the_sets_restored():
    """``--write`` / ``--missing`` compile the plans of the SIMT refusal sets (each with only its
    own entry lifted, so a default behind another refused default is reached too) and keep
    their rows: every entry of tiling.SIMT_FWD_FLOAT64_SPILLS and tiling.SIMT_BWD_SPILLS is
    found that way on some family and architecture, and the sets are left as they were."""
    from cuflash import tiling
    from cuflash.tiling import bwd, fwd
    before = (dict(fwd.SIMT_FWD_FLOAT64_SPILLS), dict(bwd.SIMT_BWD_SPILLS))
    found = {}
    for family in SWEEP.FAMILIES:
        for arch in SWEEP.ARCHS:
            for entry, p in SWEEP.refused_spill_plans(family, arch):
                _, attr, key, unpack = SWEEP._refusal_sets(family)
                assert unpack(entry)[1:] == (p.block_q, p.block_kv, p.kd, p.kdv), (entry, p)
                found.setdefault((attr, key), set()).add(entry)
                with pytest.raises(ValueError, match="ptxas spills this"):  # refused as it stands
                    tiling.plan(SWEEP.FAMILIES[family][1], p.d, p.dv, p.dtype, p.block_q,
                                p.block_kv, limit=p.limit, limit_source=p.limit_source)
    assert (dict(fwd.SIMT_FWD_FLOAT64_SPILLS), dict(bwd.SIMT_BWD_SPILLS)) == before
    for attr, sets in (("SIMT_FWD_FLOAT64_SPILLS", fwd.SIMT_FWD_FLOAT64_SPILLS),
                       ("SIMT_BWD_SPILLS", bwd.SIMT_BWD_SPILLS)):
        for key, entries in sets.items():
            assert found.get((attr, key)) == set(entries), (attr, key)

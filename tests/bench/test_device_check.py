"""bench/device_check.py, the GPU check of one device call: rehearsed end to end on the emulator
(every default stage, tiny shapes), and its parsers and README status box on made-up inputs."""
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import load_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.py"


@pytest.fixture(scope="module")
def dc():
    return load_bench("device_check")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    r = subprocess.run([sys.executable, str(SCRIPT), "--backend", "emulator", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    return r, out


def test_rehearsal_runs_every_stage(rehearsal):
    r, out = rehearsal
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "device_check.json").read_text())
    assert list(res["stages"]) == ["env", "tests", "hopper", "racecheck", "bench", "ncu"]
    assert all(s["status"] == "ok" for s in res["stages"].values()), res["stages"]
    assert res["stages"]["env"]["gpu"].startswith("none")
    tests = res["stages"]["tests"]
    assert tests["counts"].get("passed", 0) > 0 and not tests["counts"].get("failed")
    assert res["stages"]["racecheck"]["call_ok"]
    rows = res["stages"]["bench"]["rows"]
    grid = [w for w in rows if w["section"] == "grid"]
    assert {(w["dtype"], w["mode"]) for w in grid} == {(dt, m) for dt in ("float16", "float32")
                                                         for m in ("fwd", "fwdbwd")}
    assert all(w["cuflash_ms"] and w["cuflash_ms"] > 0 for w in grid)
    assert any(w["section"] == "decode" for w in rows)
    assert res["stages"]["bench"]["host_time"]
    # the device tool brings back at most 8 files, top level, names of [A-Za-z0-9._-]: the run
    # leaves three, every stage's log, script and JSON in the archive
    assert sorted(p.name for p in out.iterdir()) == ["device_check.json", "device_check.md",
                                                     "logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        members = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    assert set(members) == {"tests.log", "hopper.log", "hopper.json", "hopper_ncu.log", "hopper_tiles.md",
                            "hopper_tiles.json", "race_call.py", "racecheck.log", "bench.json", "bench.log",
                            "ncu_call.py", "ncu_d64.log", "ncu_d128.log"}
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in members)
    assert res["logs"]["files"] == {n: len(t.encode()) for n, t in members.items()}
    assert "passed" in members["tests.log"] and "race call ok" in members["racecheck.log"]
    assert "ncu call ok" in members["ncu_d64.log"] and "ncu call ok" in members["ncu_d128.log"]
    assert json.loads(members["bench.json"])["cases"]
    # the Hopper stage, rehearsed on the emulator standing in for an sm_90 with CUFLASH_WGMMA=1
    hop = [w for w in res["stages"]["hopper"]["rows"] if w["section"] == "grid"]
    assert {w["mode"] for w in hop} == {"fwd", "fwdbwd"} and all(w["cuflash_ms"] > 0 for w in hop)
    assert "ncu call ok" in members["hopper_ncu.log"]
    # and the forward's 192-key tile against its default, both run by flash_fwd_wgmma
    tiles = [c for c in json.loads(members["hopper_tiles.json"])["cases"] if c["section"] == "tiles"]
    assert res["stages"]["hopper"]["tiles"]["status"] == "ok"
    assert ("**Hopper forward tiles** (d = 128, 128 x 176 and 128 x 192 against the default): ok"
            in (out / "device_check.md").read_text())
    assert sorted((c["block_kv"], c["kernel"]) for c in tiles
                  if c["methods"]["cuflash tiled"]["ms"] > 0) == [(128, "flash_fwd_wgmma"), (176, "flash_fwd_wgmma"),
                                                                    (192, "flash_fwd_wgmma")]
    assert tests["failures"] == {} and not any("log_tails" in s for s in res["stages"].values())
    md = (out / "device_check.md").read_text()
    assert "| grid | float16 | 16 | no | fwd |" in md and "**Host time per call**" in md
    assert "Logs: logs.tar.gz (tests.log, " in md
    assert md in r.stdout


def test_status_box_from_the_rehearsal(rehearsal, dc, tmp_path):
    _, out = rehearsal
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\nintro\n<!-- status:begin -->\nold box\n<!-- status:end -->\nrest\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--status", str(out / "device_check.json"),
                        "--readme", str(readme)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = readme.read_text()
    assert text.startswith("# x\n\nintro\n<!-- status:begin -->\n| | |") and text.endswith(
        "<!-- status:end -->\nrest\n")
    assert "old box" not in text
    assert "| Speed | not measured: an emulator rehearsal (no GPU) |" in text
    assert "passed" in text
    with pytest.raises(ValueError, match="status:begin"):
        dc.rewrite_status("no markers here", json.loads((out / "device_check.json").read_text()))


def test_parse_pytest(dc):
    text = ("....F\nFAILED tests/test_a.py::test_x[cuda-1] - AssertionError: no\n"
            "ERROR tests/test_b.py::test_y - RuntimeError\n"
            "2 failed, 590 passed, 11 skipped, 4 warnings, 1 error in 50.22s\n")
    counts, failed = dc.parse_pytest(text)
    assert counts == {"failed": 2, "passed": 590, "skipped": 11, "error": 1}
    assert failed == ["tests/test_a.py::test_x[cuda-1]", "tests/test_b.py::test_y"]
    assert dc.parse_pytest("collected nothing\n") == ({}, [])


# a `pytest -rfE --tb=short -n 8` log of two failures: xdist's worker lines, the blocks in another
# order than the summary, captured output after one traceback, a traceback past the lines kept
XDIST_LOG = """bringing up nodes...
........................F.........F.......s.....                          [100%]
=================================== FAILURES ===================================
_______________________ test_gpu_matches_the_emulator ________________________
[gw5] linux -- Python 3.11.7 /usr/bin/python
tests/emulator/test_emulator_wgmma.py:88: in test_gpu_matches_the_emulator
    np.testing.assert_allclose(got, want, atol=2e-3)
E   AssertionError: 
E   Not equal to tolerance rtol=1e-07, atol=0.002
E   Mismatched elements: 7 / 4096 (0.171%)
E   Max absolute difference among violations: 0.0625
----------------------------- Captured stdout call -----------------------------
compiled flash_fwd_wgmma for sm_90a
_____________________ test_world_size_one_nccl_on_a_gpu ______________________
[gw2] linux -- Python 3.11.7 /usr/bin/python
tests/bench/test_ring_overhead.py:40: in test_world_size_one_nccl_on_a_gpu
    dist.init_process_group("nccl", rank=0, world_size=1)
""" + "".join(f"torch/distributed/c10d.py:{i}: in init\n    step_{i}()\n" for i in range(40)) + """\
E   torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1971, unhandled cuda error
E   Last error: Cuda failure 'operation not permitted'
=========================== short test summary info ============================
FAILED tests/bench/test_ring_overhead.py::test_world_size_one_nccl_on_a_gpu - torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1971, unhandled cuda error
FAILED tests/emulator/test_emulator_wgmma.py::test_gpu_matches_the_emulator - AssertionError: 
2 failed, 610 passed, 3 skipped in 201.51s (0:03:21)
"""


def test_parse_failures_of_an_xdist_log(dc):
    got = dc.parse_failures(XDIST_LOG)
    nccl = "tests/bench/test_ring_overhead.py::test_world_size_one_nccl_on_a_gpu"
    wgmma = "tests/emulator/test_emulator_wgmma.py::test_gpu_matches_the_emulator"
    assert list(got) == [nccl, wgmma]
    assert got[nccl]["message"] == ("torch.distributed.DistBackendError: NCCL error in: "
                                    "ProcessGroupNCCL.cpp:1971, unhandled cuda error")
    assert got[wgmma]["message"] == "AssertionError: "
    tb = got[nccl]["traceback"].splitlines()
    assert len(tb) == dc.TB_LINES and tb[-1] == "E   Last error: Cuda failure 'operation not permitted'"
    assert "    step_39()" in tb and "    step_11()" in tb and "    step_10()" not in tb
    assert "[gw2]" not in got[nccl]["traceback"]
    tb = got[wgmma]["traceback"]
    assert tb.startswith("tests/emulator/test_emulator_wgmma.py:88: in test_gpu_matches_the_emulator")
    assert tb.endswith("E   Max absolute difference among violations: 0.0625\n"
                       "[2 lines of captured output follow in tests.log; their end:]\n" + "-" * 29 +
                       " Captured stdout call " + "-" * 29 + "\ncompiled flash_fwd_wgmma for sm_90a")
    assert dc.parse_failures(XDIST_LOG, limit=1) == {nccl: got[nccl]}
    # the report quotes each failure under the tests' line
    counts, failed = dc.parse_pytest(XDIST_LOG)
    res = {"command": "device_check.py", "stages": {"tests": {
        "status": "tests failed", "counts": counts, "failed": failed, "failures": got}}}
    md = dc.render_markdown(res)
    assert f"- FAILED {nccl}\n- FAILED {wgmma}\n" in md
    assert f"`{wgmma}`: AssertionError: \n\n```\n{tb}\n```\n" in md
    assert "E   Last error: Cuda failure 'operation not permitted'\n```" in md


def test_parse_failures_tells_apart_tests_of_one_name(dc):
    # the same test name in two files, failing at setup in one, its blocks in reverse order
    text = ("==================================== ERRORS ====================================\n"
            "__________________________ ERROR at setup of test_x __________________________\n"
            "tests/test_b.py:12: in fixture\n    raise ValueError('b')\nE   ValueError: b\n"
            "=================================== FAILURES ===================================\n"
            "___________________________________ test_x ___________________________________\n"
            "tests/test_a.py:3: in test_x\n    helper()\ntests/test_b.py:5: in helper\n"
            "    assert 0\nE   assert 0\n"
            "=========================== short test summary info ============================\n"
            "FAILED tests/test_a.py::test_x - assert 0\nERROR tests/test_b.py::test_x - ValueError: b\n"
            "1 failed, 1 error in 1.00s\n")
    got = dc.parse_failures(text)
    assert got["tests/test_a.py::test_x"]["traceback"].startswith("tests/test_a.py:3: in test_x")
    assert got["tests/test_b.py::test_x"]["traceback"].endswith("E   ValueError: b")
    assert got["tests/test_b.py::test_x"]["message"] == "ValueError: b"


def test_a_failed_stage_brings_its_log_tail_and_the_archive_keeps_ends(dc, tmp_path, monkeypatch):
    def broken(ctx, timeout):
        (ctx.out / "broken.log").write_text("".join(f"line {i}\n" for i in range(100)) + "it broke\n")
        (ctx.out / "big.log").write_text("x" * 3000 + "the end\n")
        return {"status": "failed (exit 2)"}

    monkeypatch.setitem(dc.STAGES, "broken", broken)
    monkeypatch.setitem(dc.STAGE_CAPS, "broken", 10)
    monkeypatch.setattr(dc, "LOG_CAP", 1000)
    (tmp_path / "mine.txt").write_text("a file of the user's, there before the run")
    res = dc.run_check("emulator", tmp_path, 60, ["broken"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device_check.json", "device_check.md",
                                                          "logs.tar.gz", "mine.txt"]
    tails = res["stages"]["broken"]["log_tails"]
    assert tails["broken.log"].splitlines() == [f"line {i}" for i in range(61, 100)] + ["it broke"]
    assert res["logs"] == {"archive": "logs.tar.gz", "files": {"broken.log": 799, "big.log": 3008},
                           "cut": {"big.log": 1000}}
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        big = tar.extractfile("big.log").read().decode()
    assert big == "[the first 2008 bytes cut; the last 1000 kept]\n" + "x" * 992 + "the end\n"
    md = (tmp_path / "device_check.md").read_text()
    assert "**broken: the end of broken.log** (failed (exit 2))\n\n```\nline 61\n" in md
    assert json.loads((tmp_path / "device_check.json").read_text()) == res


def test_parse_ncu_csv(dc):
    # the layout of `ncu --csv --page details`: a header row, one row per metric and kernel
    text = ('==PROF== Connected to process 1\n'
            '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"\n'
            '"0","1","python","h","flash_fwd_tc(const __half *, ...)","1","7","(128, 1, 1)",'
            '"(512, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","987.5"\n'
            '"0","1","python","h","flash_fwd_tc(const __half *, ...)","1","7","(128, 1, 1)",'
            '"(512, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","23.4"\n'
            '"1","1","python","h","flash_bwd_tc","1","7","(256, 1, 1)","(256, 1, 1)","0","9.0",'
            '"Launch Statistics","Registers Per Thread","register/thread","255"\n'
            '"1","1","python","h","flash_bwd_tc","1","7","(256, 1, 1)","(256, 1, 1)","0","9.0",'
            '"Launch Statistics","Waves Per SM","","1.5"\n')
    got = dc.parse_ncu_csv(text)
    assert got == {"flash_fwd_tc": {"Duration": "987.5 us", "Achieved Occupancy": "23.4 %"},
                   "flash_bwd_tc": {"Registers Per Thread": "255 register/thread"}}
    assert dc.parse_ncu_csv("==ERROR== no kernels were profiled\n") == {}


def test_a_stage_past_its_limit_is_a_timeout(dc, tmp_path):
    rc, secs = dc._run([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "x.log", 1)
    assert rc == "timeout" and secs < 10
    assert dc._status(rc) == "timeout" and dc._status(0) == "ok" and dc._status(2) == "failed (exit 2)"


def test_unknown_stage_is_an_option_error():
    r = subprocess.run([sys.executable, str(SCRIPT), "--stages", "env,gridd"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown stage(s) ['gridd']" in r.stderr


def test_bench_and_ncu_stages_time_the_mma_sync_kernels(dc, monkeypatch, tmp_path):
    """On an sm_90 the Hopper kernels are a default: the bench and ncu stages switch them off
    (their rows are the mma.sync kernels'), the hopper stage on."""
    import argparse
    envs = {}

    def fake_run(cmd, log, timeout, env):
        envs.setdefault(log.name, env.get("CUFLASH_WGMMA"))
        log.write_text("")
        return 0, 0.0
    monkeypatch.setattr(dc, "_run", fake_run)
    monkeypatch.setattr(dc, "_compute_capability", lambda ctx: "90")
    monkeypatch.delenv("CUFLASH_WGMMA", raising=False)
    ctx = argparse.Namespace(backend="cuda", out=tmp_path)
    for stage in ("bench", "ncu", "hopper"):
        dc.STAGES[stage](ctx, 60)
    assert envs.pop("hopper.log") == envs.pop("hopper_ncu.log") == envs.pop("hopper_tiles.md") == "1"
    assert envs == {"bench.log": "0", "ncu_d64.log": "0", "ncu_d128.log": "0"}


def test_hopper_ncu_call_asks_for_the_stall_and_memory_sections(dc, monkeypatch, tmp_path):
    """The Hopper kernels' Nsight Compute call: every section of HOPPER_NCU_SECTIONS (where the
    memory time goes, why warps do not issue), and the summary keeps their metrics."""
    import argparse
    cmds = {}

    def fake_run(cmd, log, timeout, env):
        cmds[log.name] = cmd
        log.write_text("")
        return 0, 0.0
    monkeypatch.setattr(dc, "_run", fake_run)
    monkeypatch.setattr(dc.shutil, "which", lambda name: "/opt/ncu" if name == "ncu" else None)
    monkeypatch.setattr(dc, "_compute_capability", lambda ctx: "90")
    dc.STAGES["hopper"](argparse.Namespace(backend="cuda", out=tmp_path), 60)
    cmd = cmds["hopper_ncu.log"]
    assert cmd[0] == "/opt/ncu"
    asked = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"]
    assert asked == list(dc.HOPPER_NCU_SECTIONS)
    assert {"MemoryWorkloadAnalysis", "WarpStateStats", "SchedulerStats"} <= set(asked)
    row = ('"0","1","p","h","flash_bwd_wgmma","1","7","(384, 1, 1)","(1024, 1, 1)","0","9.0",'
           '"WarpStateStats","Warp Cycles Per Issued Instruction","cycle","17.30"')
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    got = dc.parse_ncu_csv(head + "\n" + row + "\n")
    assert got == {"flash_bwd_wgmma": {"Warp Cycles Per Issued Instruction": "17.30 cycle"}}

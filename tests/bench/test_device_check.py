"""bench/device_check.py, the GPU check of one device call: rehearsed end to end on the emulator
(every default stage, tiny shapes), and its parsers and README status box on made-up inputs."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_check.py"


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    assert (out / "bench.json").exists() and (out / "ncu_d64.log").exists()
    # the Hopper stage, rehearsed on the emulator standing in for an sm_90 with CUFLASH_WGMMA=1
    hop = [w for w in res["stages"]["hopper"]["rows"] if w["section"] == "grid"]
    assert {w["mode"] for w in hop} == {"fwd", "fwdbwd"} and all(w["cuflash_ms"] > 0 for w in hop)
    assert "ncu call ok" in (out / "hopper_ncu.log").read_text()
    md = (out / "device_check.md").read_text()
    assert "| grid | float16 | 16 | no | fwd |" in md and "**Host time per call**" in md
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

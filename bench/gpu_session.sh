#!/usr/bin/env bash
# One lent GPU, few calls: the checks and measurements the open speed issues need, in stages
# that each fit one 10-minute call of the device tool (run from the repository root; results
# under $OUT, default ./gpu_out).
#
#   bash bench/gpu_session.sh tests      # pytest -m cuda (every CUDA test), then compute-sanitizer
#                                        # racecheck on one forward and one backward call
#   bash bench/gpu_session.sh grid       # issue 9: float16/bfloat16 forward d=64,128 against SDPA
#                                        # flash (FA2), float32 fwd and fwd+bwd against efficient
#   bash bench/gpu_session.sh features   # issue 13: each logit feature against the plain call,
#                                        # windows (bench --sections features; float16, float32)
#   bash bench/gpu_session.sh tiles      # issue 9: every accepted block_q x block_kv of the
#                                        # forward's and backward's kernels against the default
#                                        # (float16 and float32, d=64,128, N=4096, non-causal)
#   bash bench/gpu_session.sh tilesfeat  # issue 13: the same for the kernels with the logit
#                                        # features (a key-padding bias: flash_fwd_tc_masked,
#                                        # flash_bwd_tc_masked; float16, d=64,128) -- their
#                                        # defaults were chosen from instruction counts
#   bash bench/gpu_session.sh ncu        # Nsight Compute on flash_fwd_tc and flash_bwd_tc
#                                        # (float16, d=64 and 128, N=4096)
#   bash bench/gpu_session.sh grid features   # several stages in one call
#
# Each stage writes its full output to $OUT/<stage>*.{md,json,log} and prints a short summary
# last (the device tool returns the end of the output).  Nothing here installs anything: the
# device machine has CuPy, PyTorch, ncu and compute-sanitizer, and cuflash runs from the
# checkout (python -m cuflash).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
summary=()

stage_tests() {
    python -m pytest -m cuda -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
    summary+=("tests: $(tail -1 "$OUT/tests.log")")
    cat > "$OUT/race_call.py" <<'EOF'
import cupy as cp, cuflash
rng = cp.random.RandomState(0)
q, k, v, do = (rng.standard_normal((1, 2, 200, 64), dtype=cp.float32).astype(cp.float16)
               for _ in range(4))
o, lse = cuflash.tiled_attention(q, k, v, causal=True, return_lse=True)
cuflash.tiled_attention_backward(do, q, k, v, o, lse, causal=True)
cp.cuda.Device().synchronize()
EOF
    compute-sanitizer --tool racecheck --error-exitcode 3 python "$OUT/race_call.py" \
        > "$OUT/racecheck.log" 2>&1
    summary+=("racecheck (fwd+bwd float16 d=64 causal): exit $? ($(grep -m1 -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" || echo 'no summary line'))")
}

stage_grid() {
    local lowp=float16,bfloat16
    if ! python -c "import ml_dtypes" 2>/dev/null; then  # bfloat16 arrays need it
        lowp=float16
        summary+=("grid: ml_dtypes missing on this machine, bfloat16 left out")
    fi
    python -m cuflash bench --gpu --sections grid --dtypes "$lowp" --dims 64,128 \
        --modes fwd --plot "" --json "$OUT/grid16.json" > "$OUT/grid16.md" 2> "$OUT/grid16.log"
    summary+=("grid float16/bfloat16 fwd: exit $?")
    python -m cuflash bench --gpu --sections grid --dtypes float32 --dims 64,128 \
        --modes fwd,fwdbwd --plot "" --json "$OUT/grid32.json" > "$OUT/grid32.md" 2> "$OUT/grid32.log"
    summary+=("grid float32 fwd, fwdbwd: exit $?")
    python - "$OUT/grid16.json" "$OUT/grid32.json" >> "$OUT/grid_summary.md" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    res = json.load(open(path))
    for c in res["cases"]:
        t = c["methods"]["cuflash tiled"]
        ref = "sdpa flash" if c["dtype"] in ("float16", "bfloat16") else "sdpa efficient"
        r = c["methods"].get(ref, {})
        ratio = (r["ms"] / t["ms"]) if t.get("ms") and r.get("ms") else None
        print(f"{c['dtype']} d={c['d']} causal={int(c['causal'])} {c['mode']} N={c['Nq']}: "
              f"cuflash {t.get('tflops') or 0:.1f} TFLOP/s, {ref} {r.get('tflops') or 0:.1f}, "
              f"cuflash speed / {ref} = {ratio if ratio is None else round(ratio, 2)}")
EOF
    summary+=("$(cat "$OUT/grid_summary.md")")
}

stage_features() {
    python -m cuflash bench --gpu --sections features --dtypes float16,float32 --dims 64,128 \
        --modes fwd,fwdbwd --plot "" --json "$OUT/features.json" > "$OUT/features.md" \
        2> "$OUT/features.log"
    summary+=("features: exit $?")
    summary+=("$(grep -E '^\| float(16|32) \|.*\| fwdbwd \|' "$OUT/features.md")")
}

stage_tiles() {
    python -m cuflash bench --gpu --sections tiles --dtypes float16,float32 --dims 64,128 \
        --causal no --modes fwd,bwd --plot "" --json "$OUT/tiles.json" > "$OUT/tiles.md" \
        2> "$OUT/tiles.log"
    summary+=("tiles: exit $?")
    summary+=("$(grep -E '^- fastest, ' "$OUT/tiles.md")")
}

stage_tilesfeat() {
    python -m cuflash bench --gpu --sections tiles --dtypes float16 --dims 64,128 \
        --causal no --modes fwd,bwd --tiles-feature bias-key-padding --plot "" \
        --json "$OUT/tilesfeat.json" > "$OUT/tilesfeat.md" 2> "$OUT/tilesfeat.log"
    summary+=("tilesfeat: exit $?")
    summary+=("$(grep -E '^- fastest, ' "$OUT/tilesfeat.md")")
}

stage_ncu() {
    cat > "$OUT/ncu_call.py" <<'EOF'
import sys, cupy as cp, cuflash
d = int(sys.argv[1])
rng = cp.random.RandomState(0)
q, k, v, do = (rng.standard_normal((2, 2048 // d, 4096, d), dtype=cp.float32).astype(cp.float16)
               for _ in range(4))
for _ in range(2):  # the second call is the profiled one (compile and first-use outside)
    o, lse = cuflash.tiled_attention(q, k, v, return_lse=True)
    cuflash.tiled_attention_backward(do, q, k, v, o, lse)
cp.cuda.Device().synchronize()
EOF
    for d in 64 128; do
        ncu --kernel-name regex:'flash_(fwd|bwd)_tc$' --launch-skip 2 --launch-count 2 \
            --section SpeedOfLight --section WarpStateStats --section InstructionStats \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            python "$OUT/ncu_call.py" "$d" > "$OUT/ncu_d$d.log" 2>&1
        summary+=("ncu d=$d: exit $? ($(grep -c 'flash_' "$OUT/ncu_d$d.log") kernel lines)")
    done
}

[ $# -gt 0 ] || { echo "usage: $0 tests|grid|features|tiles|tilesfeat|ncu ..." >&2; exit 2; }
for s in "$@"; do
    case "$s" in
        tests|grid|features|tiles|tilesfeat|ncu) "stage_$s" ;;
        *) echo "unknown stage: $s (tests, grid, features, tiles, tilesfeat, ncu)" >&2; exit 2 ;;
    esac
done
echo "== $(head -2 "$OUT/gpu.txt" | tail -1)"
printf '%s\n' "${summary[@]}"

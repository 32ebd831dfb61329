#!/usr/bin/env bash
# What ficco waits for on a GPU (issue 25), as three steps, each one lent-device call:
#
#   PY=python3 bash bench/gpu_session.sh suite    # (a) GPU suite + fault tests   <= 6.6 min
#   PY=python3 bash bench/gpu_session.sh check    # (b) schedules vs fp64, memcheck <= 6.5 min
#   PY=python3 bash bench/gpu_session.sh measure  # (c) host time, queues, TFLOP/s  <= 6.5 min
#
# One H100/H200 (or MI300X) is enough: the multi-rank parts run several processes on one GPU.
# Every command is bounded by `timeout`: a step's bounds add up to at most 6.6 minutes (the
# device tool's limit per call is 10), the three to 19.6, so the session ends inside 25
# minutes with the machine's start (1-3 minutes) and the transfers.
# With the 15 minutes of device time the tool lends now (start included): suite, then measure
# if status shows >= 480 s left; check in the next session (docs/gpu.md).
# PY must name the Python that has torch for this GPU (the device image's is python3; ficco
# runs from this checkout, nothing is installed). Nothing here reads git history: the copy a
# device machine gets has none.
#
# Output: $OUT (the device tool's folder of files that come back; default
# bench/runs/gpu-session) gets at most six files per step, one folder deep: session.log,
# device.txt, <step>-summary.txt, <step>.tar.gz (every log, JSON line file and plot). Unpack the
# archive into bench/results/gpu-<date>/ and cite from there (docs/gpu.md says which file
# backs which sentence).
set -u
if [ -z "${PY:-}" ]; then
    echo "set PY to the Python with torch for this GPU, e.g. PY=python3 bash $0 suite" >&2
    exit 2
fi
OUT=${OUT:-bench/runs/gpu-session}
STEP=${1:-}
WORK="$OUT/$STEP"
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
codes=()

run() {   # run NAME SECONDS CMD...: one command, bounded, logged; keeps going on failure
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*" | tee -a "$OUT/session.log"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - start))s" | tee -a "$OUT/session.log"
    tail -n 12 "$WORK/$name.log" | tee -a "$OUT/session.log"
    codes+=("$name=$rc")
}

{ nvidia-smi || rocm-smi; "$PY" -c "import torch, triton; print(torch.__version__, \
torch.version.cuda or torch.version.hip, triton.__version__, torch.cuda.get_device_name())"; \
"$PY" -m pip list 2>/dev/null | grep -i -E "cuda-(bindings|python)|hip-python"; } \
    > "$OUT/device.txt" 2>&1
case "$STEP" in
    suite)   # (a): 28 s on an H100 before issue 25; the fault tests add about 2 min
        run fault-tests 200 "$PY" -m pytest -q -m gpu tests/gpu/test_gpu_faults.py \
            -p no:cacheprovider -rA
        run gpu-suite 150 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
            --ignore=tests/gpu/test_gpu_faults.py
        run kernel-tests 45 "$PY" -m pytest -q -m gpu tests/test_gated.py tests/test_kernels.py \
            -p no:cacheprovider ;;
    check)   # (b)
        run medium-shape 240 "$PY" -m ficco.bench.gpu_session check --world 4 --out "$WORK"
        run memcheck 150 compute-sanitizer --tool memcheck --target-processes all \
            --error-exitcode 99 "$PY" -m ficco.bench.gpu_session sanitize --out "$WORK" ;;
    measure) # (c)
        run host-time 120 "$PY" -m ficco.bench.gpu_session host --world 4 --out "$WORK"
        run enqueue-profile 75 "$PY" -m ficco.bench characterize --parts enqueue \
            --out "$WORK/characterize-enqueue" --no-plots
        for c in 8 1; do   # set before CUDA starts in the ranks
            export CUDA_DEVICE_MAX_CONNECTIONS=$c
            run "timeline-connections-$c" 45 "$PY" -m ficco.bench.gpu_session timeline \
                --world 4 --shape 2048,4096,4096 --schedule uniform-fused-1d \
                --label "-connections-$c" --out "$WORK"
        done
        unset CUDA_DEVICE_MAX_CONNECTIONS
        run gated-tflops 100 "$PY" -m ficco.bench kernels kernel --world 8 --variant both \
            --shape 16384,8192,8192 --shape 8192,8192,8192 --shape 4096,16384,4096 \
            --shape 32768,4096,8192 --out "$WORK/kernels" ;;
    *)
        echo "usage: PY=python3 bash bench/gpu_session.sh {suite|check|measure}" >&2
        exit 2 ;;
esac
echo "exit codes: ${codes[*]}" | tee -a "$OUT/session.log"
grep -h -E "passed|failed|error|ok |BAD|host_op_s|makespan|TFLOP" "$WORK"/*.log \
    > "$OUT/$STEP-summary.txt" 2>/dev/null
tar -czf "$OUT/$STEP.tar.gz" -C "$OUT" "$STEP" && rm -rf "$WORK"

#!/usr/bin/env bash
# What the open issues wait for on a GPU, as steps that each fit one lent-device call
# (10 minutes at most). Run from the repository root with the venv made by `make install`
# (or any Python with torch for that GPU and ficco installed -e):
#
#   bash bench/gpu_session.sh suite      # GPU suite: issues 13, 15, 18 (fault cases, fence, ...)
#   bash bench/gpu_session.sh kernels    # gated GEMM tests + kernel benchmark + timelines (19)
#   bash bench/gpu_session.sh enqueue    # eager/graph host time per call, before/after (18)
#
# Every step writes its log and results under $OUT (default bench/runs/gpu-session), keeps
# going past a failing command, and ends with the exit codes it saw. Then: copy what the docs
# cite into bench/results/, add targets that passed to ficco.kernels.VERIFIED_TARGETS, and
# flip FICCO_SIGNAL_PADS's default if the host-pads variants passed (docs/gpu.md).
set -u
OUT=${OUT:-bench/runs/gpu-session}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
mkdir -p "$OUT"
codes=()

run() {   # run NAME SECONDS CMD...: one command, bounded, logged
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$OUT/session.log"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.log" | tee -a "$OUT/session.log"
    codes+=("$name=$rc")
}

nvidia-smi > "$OUT/device.txt" 2>&1 || rocm-smi > "$OUT/device.txt" 2>&1 || true
case "${1:-}" in
    suite)
        run gpu-suite 540 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider ;;
    kernels)
        run kernel-tests 200 "$PY" -m pytest -q -m gpu tests/test_kernels.py tests/test_gated.py \
            -p no:cacheprovider
        run kernel-bench 380 "$PY" -m ficco.bench kernels gpu --out "$OUT/kernels" ;;
    enqueue)
        # before/after in one run needs git history (--compare loads the old executor from it);
        # a device copy of the tree without .git gets the after columns only
        compare=()
        git cat-file -e 3ab1b5e 2>/dev/null && compare=(--compare 3ab1b5e)
        run enqueue 420 "$PY" -m ficco.bench overhead --gpu "${compare[@]}" \
            --out "$OUT/enqueue-overhead-gpu.txt"
        run enqueue-profile 150 "$PY" -m ficco.bench overhead --gpu --profile hetero-unfused-1d \
            --calls 20 ;;
    *)
        echo "usage: bash bench/gpu_session.sh {suite|kernels|enqueue}" >&2
        exit 2 ;;
esac
echo "exit codes: ${codes[*]}" | tee -a "$OUT/session.log"

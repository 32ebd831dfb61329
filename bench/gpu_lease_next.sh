#!/usr/bin/env bash
# What waits for the lease after bench/gpu_lease.sh, as one device call (timeout_s ~590): the
# bounds add up to 510 s, and with each part's 5 s kill grace to 545 s. Each part bounded,
# streamed into $OUT; FICCO_TIMEOUT=20 in every part:
#
#   1 memcheck: compute-sanitizer over two ranks' small calls of every kind of copy and
#     barrier (no gated schedule)                                        -> next.log
#   2 selftest W=4 sharing the GPU                                       -> selftest-w4.jsonl
#   3 one traced uniform-fused-1d call with CUDA_DEVICE_MAX_CONNECTIONS=8, then =1
#                          -> timelines.tar.gz (timeline-*-connections-{8,1}.json and .png)
#   4 the gated GEMM's TFLOP/s against torch.matmul on four shapes       -> kernels.json
#   5 host us per warm call end to end, fence on/off, and host_op_s -> host.jsonl, host_op_s.json
#   6 the executor-only host_op_s (characterize --parts enqueue)     -> enqueue.tar.gz
#
#   PY=python3 bash bench/gpu_lease_next.sh
#
# $OUT: at most 8 files, two folders deep at most. Same knobs as bench/gpu_lease.sh.
set -u
OUT=${OUT:-bench/runs/gpu-lease-next}
LOG="$OUT/next.log"
# shellcheck source=bench/lease_lib.sh
. "$(dirname "$0")/lease_lib.sh"     # PY, SCALE, QUICK, PYTHONPATH, TRITON_CACHE_DIR, part

if [ "$QUICK" = 1 ]; then   # the fake GPU: the kernel in Triton's interpreter
    SHAPE=8,16,8; WORLD=2; KERNELS=(--world 2 --shape 64,64,64 --interpret)
    SELFTEST=(--share-gpu 3 --quick --ops all_gather_matmul --dtypes float32)
    HOST=(--world 2 --calls 2 --shape 8,16,8 --schedules ring --dtype float32)
else
    SHAPE=2048,4096,4096; WORLD=4
    KERNELS=(--world 8 --shape 16384,8192,8192 --shape 8192,8192,8192 --shape 4096,16384,4096
             --shape 32768,4096,8192)
    SELFTEST=(--share-gpu 4); HOST=(--world 4)
fi

echo "ficco GPU lease (next) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)" | tee -a "$LOG"
part memcheck 110 next.log compute-sanitizer --tool memcheck --target-processes all \
    --error-exitcode 99 "$PY" -m ficco.bench.gpu_session sanitize --out "$OUT"
part selftest-wide 100 next.log "$PY" -m ficco selftest --timeout 20 --bound "$(bound 95)" \
    --jsonl "$OUT/selftest-w4.jsonl" "${SELFTEST[@]}"
mkdir -p "$OUT/timelines"
for c in 8 1; do   # read when CUDA starts in the ranks
    part "timeline-connections-$c" 45 next.log env CUDA_DEVICE_MAX_CONNECTIONS=$c \
        "$PY" -m ficco.bench.gpu_session timeline --world "$WORLD" --shape "$SHAPE" \
        --schedule uniform-fused-1d --label="-connections-$c" --out "$OUT/timelines"
done
tar -czf "$OUT/timelines.tar.gz" -C "$OUT" timelines && rm -rf "$OUT/timelines"
part gated-tflops 100 next.log "$PY" -m ficco.bench kernels kernel --variant both \
    "${KERNELS[@]}" --out "$OUT/kernels.json"
part host-time 55 next.log "$PY" -m ficco.bench.gpu_session host "${HOST[@]}" --out "$OUT"
mkdir -p "$OUT/enqueue"
part enqueue-profile 55 next.log "$PY" -m ficco.bench characterize --parts enqueue \
    --out "$OUT/enqueue" --no-plots
tar -czf "$OUT/enqueue.tar.gz" -C "$OUT" enqueue && rm -rf "$OUT/enqueue"
finish

#!/usr/bin/env bash
# What waits for the lease after bench/gpu_lease.sh (issue 33), as one device call of at most
# 9.5 minutes (the bounds add up to 570 s), each part bounded, streamed into $OUT:
#
#   1 memcheck: compute-sanitizer over two ranks' small calls of every kind of copy and
#     barrier (no gated schedule)                                        -> next.log
#   2 one traced uniform-fused-1d call with CUDA_DEVICE_MAX_CONNECTIONS=8, then =1
#                                    -> timeline-*-connections-{8,1}.json and .png
#   3 the gated GEMM's waits end alike in every warp (a halt or the clock crossed between
#     two warps' reads must not leave them at different barriers: a hang) -> next.log
#   4 the gated GEMM's TFLOP/s against torch.matmul on four shapes       -> kernels.json
#   5 the executor-only host_op_s (characterize --parts enqueue)     -> enqueue.tar.gz
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
else
    SHAPE=2048,4096,4096; WORLD=4
    KERNELS=(--world 8 --shape 16384,8192,8192 --shape 8192,8192,8192 --shape 4096,16384,4096
             --shape 32768,4096,8192)
fi

echo "ficco GPU lease (next) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)" | tee -a "$LOG"
part memcheck 150 next.log compute-sanitizer --tool memcheck --target-processes all \
    --error-exitcode 99 "$PY" -m ficco.bench.gpu_session sanitize --out "$OUT"
for c in 8 1; do   # read when CUDA starts in the ranks
    part "timeline-connections-$c" 60 next.log env CUDA_DEVICE_MAX_CONNECTIONS=$c \
        "$PY" -m ficco.bench.gpu_session timeline --world "$WORLD" --shape "$SHAPE" \
        --schedule uniform-fused-1d --label="-connections-$c" --out "$OUT"
done
part gated-wait-exit 90 next.log env FICCO_TIMEOUT=20 "$PY" -m pytest -q -m gpu \
    tests/test_review_symm_path.py -k waits_end_alike -p no:cacheprovider -rfE
part gated-tflops 150 next.log "$PY" -m ficco.bench kernels kernel --variant both \
    "${KERNELS[@]}" --out "$OUT/kernels.json"
mkdir -p "$OUT/enqueue"
part enqueue-profile 60 next.log "$PY" -m ficco.bench characterize --parts enqueue \
    --out "$OUT/enqueue" --no-plots
tar -czf "$OUT/enqueue.tar.gz" -C "$OUT" enqueue && rm -rf "$OUT/enqueue"
finish

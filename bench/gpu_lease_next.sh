#!/usr/bin/env bash
# What waits for the lease after bench/gpu_lease.sh (issue 33), as one device call of at most
# 9.5 minutes (the bounds add up to 480 s), each part bounded, streamed into $OUT:
#
#   1 memcheck: compute-sanitizer over two ranks' small calls of every kind of copy and
#     barrier (no gated schedule)                                        -> next.log
#   2 one traced uniform-fused-1d call with CUDA_DEVICE_MAX_CONNECTIONS=8, then =1
#                                    -> timeline-*-connections-{8,1}.json and .png
#   3 the gated GEMM's TFLOP/s against torch.matmul on four shapes       -> kernels.tar.gz
#   4 the executor-only host_op_s (characterize --parts enqueue)  -> characterize-enqueue/
#
#   PY=python3 bash bench/gpu_lease_next.sh
#
# $OUT: at most 8 files, two folders deep at most. Same knobs as bench/gpu_lease.sh.
set -u
PY=${PY:-python3}
OUT=${OUT:-bench/runs/gpu-lease-next}
SCALE=${FICCO_LEASE_SCALE:-1}
QUICK=${FICCO_LEASE_QUICK:-0}
mkdir -p "$OUT"
LOG="$OUT/next.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/ficco-triton-cache}
# shellcheck source=bench/lease_lib.sh
. "$(dirname "$0")/lease_lib.sh"

if [ "$QUICK" = 1 ]; then
    SHAPE=8,16,8; WORLD=2; KERNEL_SHAPES=(--shape 64,64,64)
else
    SHAPE=2048,4096,4096; WORLD=4
    KERNEL_SHAPES=(--shape 16384,8192,8192 --shape 8192,8192,8192 --shape 4096,16384,4096
                   --shape 32768,4096,8192)
fi

echo "ficco GPU lease (next) $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)" | tee -a "$LOG"
part memcheck 150 next.log compute-sanitizer --tool memcheck --target-processes all \
    --error-exitcode 99 "$PY" -m ficco.bench.gpu_session sanitize --out "$OUT"
for c in 8 1; do   # read when CUDA starts in the ranks
    part "timeline-connections-$c" 60 next.log env CUDA_DEVICE_MAX_CONNECTIONS=$c \
        "$PY" -m ficco.bench.gpu_session timeline --world "$WORLD" --shape "$SHAPE" \
        --schedule uniform-fused-1d --label "-connections-$c" --out "$OUT"
done
mkdir -p "$OUT/kernels"
part gated-tflops 150 next.log "$PY" -m ficco.bench kernels kernel --world 8 --variant both \
    "${KERNEL_SHAPES[@]}" --out "$OUT/kernels"
tar -czf "$OUT/kernels.tar.gz" -C "$OUT" kernels && rm -rf "$OUT/kernels"
part enqueue-profile 60 next.log "$PY" -m ficco.bench characterize --parts enqueue \
    --out "$OUT/characterize-enqueue" --no-plots
finish

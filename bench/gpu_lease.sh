#!/usr/bin/env bash
# One GPU lease, one device call: what verifies ficco's default path on a lent GPU, in order,
# each part bounded by `timeout`, its results streamed into $OUT as it runs, so a lease cut
# short still returns everything before the cut. The bounds add up to 540 s, and with each
# part's 5 s kill grace to 580 s: one call with timeout_s ~590 on the GPU machines (Python
# 3.12, torch 2.11+cu130, Triton 3.6, cuda-bindings; no network, no hip-python). Nothing is
# installed: ficco runs from this checkout (PYTHONPATH); nothing here reads git history.
# FICCO_TIMEOUT=20 in every part.
#
#   PY=python3 bash bench/gpu_lease.sh     # OUT: the device tool's folder ($OUT there)
#
#   1 versions and device facts (SM count, L2, memory)                     -> versions.txt
#   2 smoke: the default path of every op, W=2 sharing the GPU              -> smoke.jsonl
#     The lease stops here only on a wrong result (exit 4) or a hang (exit 3); then it runs
#     the backend unit tests (tests/gpu/test_gpu_backend.py) for the diagnosis -> pytest.txt
#   3 selftest W=2: every schedule, faults, graph, timing             -> selftest-w2.jsonl
#   4 correctness pytest: tests/gpu without the fault tests                  -> pytest.txt
#   5 the gated kernel tests (tests/ops/all_gather_matmul/test_gated.py, tests/engine/test_kernels.py)    -> pytest.txt
#   6 the gated GEMM's warp-exit probe (waits ended by the clock and the halt word)
#                                                                            -> pytest.txt
#   7 speed: W=2 sharing the GPU, default / serial over dma / FICCO_SYMM=torch / torch's
#     fused ops at 4096^3, 8192^3, 16384x4096x4096 bf16; then decode: matmul_all_reduce with
#     TP 8's GEMMs of Llama-3 8B o and 70B down at batch 1 and 32, default / one-shot-kernel
#     / two-shot-kernel / torch.mm + torch.ops.symm_mem.one_shot_all_reduce  -> speed.jsonl
#   8 the fault tests (tests/gpu/test_gpu_faults.py)                         -> pytest.txt
#
# $OUT ends with at most 8 files, one folder deep: lease.log (every part's command, bound,
# exit code, time and last lines; the smoke's and selftest's lines), the files above. Every
# pytest runs -v (a cut run still names each test that finished) with a per-test --timeout
# (tests/timeout_fallback.py stands in where pytest-timeout is missing). TRITON_CACHE_DIR is
# one folder for every part (a kernel compiled once is not compiled again). What waits for
# the next lease: bench/gpu_lease_next.sh. docs/gpu.md says what each file shows.
#
# Knobs (CI runs the script on the fake GPU, tests/claims/test_gpu_lease.py): FICCO_LEASE_SCALE
# multiplies every bound; FICCO_LEASE_QUICK=1 shrinks every part to a minimum.
set -u
OUT=${OUT:-bench/runs/gpu-lease}
LOG="$OUT/lease.log"
# shellcheck source=bench/lease_lib.sh
. "$(dirname "$0")/lease_lib.sh"     # PY, SCALE, QUICK, PYTHONPATH, TRITON_CACHE_DIR, part

if [ "$QUICK" = 1 ]; then   # the fake GPU multiplies no bf16 into fp32 (torch.mm out_dtype)
    SMOKE=(--ops all_gather_matmul --dtypes float32)
    SELFTEST=(--quick --ops all_gather_matmul --dtypes float32)
    SPEED=(--dtype float32 --speed-shape 64,48,32 --decode-shape 2,48,64 --calls 3)
else
    # (no --optional: the gated kernels' cold autotune would not fit the bound; parts 5-6
    # run them)
    SMOKE=(); SELFTEST=(); SPEED=(--dtype bfloat16 --calls 10)
fi
# a part's pytest: -v, a per-test bound, no cache, failures and errors summarised
PYTEST=(-m pytest -v -p no:cacheprovider -rfE -m gpu)

echo "ficco GPU lease $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)" | tee -a "$LOG"
part versions 20 versions.txt bash -c "$VERSIONS"
part smoke 45 lease.log "$PY" -m ficco selftest --share-gpu 2 --smoke --timeout 20 \
    --bound "$(bound 40)" --jsonl "$OUT/smoke.jsonl" "${SMOKE[@]}"
smoke=$?
if [ "$smoke" -eq 3 ] || [ "$smoke" -eq 4 ]; then
    echo "the smoke found a $([ "$smoke" -eq 4 ] && echo 'wrong result' || echo hang) on the" \
         "default path: the backend unit tests for the diagnosis, then stop" | tee -a "$LOG"
    part diagnosis 45 pytest.txt "$PY" "${PYTEST[@]}" --timeout 30 tests/gpu/test_gpu_backend.py
    finish
    exit 1
fi
part selftest-w2 105 lease.log "$PY" -m ficco selftest --share-gpu 2 --timeout 20 \
    --bound "$(bound 100)" --jsonl "$OUT/selftest-w2.jsonl" "${SELFTEST[@]}"
part correctness 120 pytest.txt "$PY" "${PYTEST[@]}" --timeout 60 tests/gpu \
    --ignore=tests/gpu/test_gpu_faults.py
part kernel-tests 60 pytest.txt "$PY" "${PYTEST[@]}" --timeout 45 tests/ops/all_gather_matmul/test_gated.py \
    tests/engine/test_kernels.py
part warp-exit 55 pytest.txt env FICCO_PROBE_TIMEOUT_S="$(bound 22)" "$PY" "${PYTEST[@]}" \
    --timeout "$(bound 25)" tests/engine/test_review_symm_path.py -k waits_end_alike
part speed 90 lease.log "$PY" -m ficco.bench.gpu_session speed --world 2 "${SPEED[@]}" \
    --out "$OUT"
part faults 45 pytest.txt "$PY" "${PYTEST[@]}" --timeout 40 tests/gpu/test_gpu_faults.py
finish

#!/usr/bin/env bash
# One GPU lease, one device call (issue 33): what verifies ficco's default path on a lent GPU,
# in order, each part bounded by `timeout`, its results streamed into $OUT as it runs, so a
# lease cut short still returns everything before the cut. The bounds add up to 550 s: one
# call of at most 9.5 minutes on the GPU machines (Python 3.12, torch 2.11+cu130, Triton 3.6,
# cuda-bindings; no network, no hip-python). Nothing is installed: ficco runs from this
# checkout (PYTHONPATH); nothing here reads git history.
#
#   PY=python3 bash bench/gpu_lease.sh     # OUT: the device tool's folder ($OUT there)
#
#   1 versions             -> versions.txt
#   2 smoke: the default path of every op, W=2 on the GPU; if it fails the lease stops here
#   3 selftest W=2 sharing the GPU: every schedule, faults, graph, timing -> selftest-w2.json
#   4 selftest W=4 sharing the GPU                                          -> selftest-w4.json
#   5 the GPU pytest suite (tests/gpu, fault tests included; FICCO_TIMEOUT=20) -> pytest.txt
#   6 the compiled-kernel tests (gated GEMM, fence)                            -> pytest.txt
#   7 host us per warm call end to end, fence on/off, and host_op_s -> host.jsonl, host_op_s.json
#
# $OUT ends with at most 8 files, one folder deep: lease.log (every part's command, bound,
# exit code, time and last lines; selftest lines), the files above. TRITON_CACHE_DIR is one
# folder for every part (a kernel compiled once is not compiled again). What waits for the
# next lease: bench/gpu_lease_next.sh. docs/gpu.md says what each file shows.
#
# Knobs (CI runs the script on the fake GPU, tests/test_gpu_lease.py): FICCO_LEASE_SCALE
# multiplies every bound; FICCO_LEASE_QUICK=1 shrinks every part to a minimum.
set -u
OUT=${OUT:-bench/runs/gpu-lease}
LOG="$OUT/lease.log"
# shellcheck source=bench/lease_lib.sh
. "$(dirname "$0")/lease_lib.sh"     # PY, SCALE, QUICK, PYTHONPATH, TRITON_CACHE_DIR, part

if [ "$QUICK" = 1 ]; then   # the fake GPU multiplies no bf16 into fp32 (torch.mm out_dtype)
    SMOKE=(--ops all_gather_matmul --dtypes float32)
    SELFTEST=(--quick --ops all_gather_matmul --dtypes float32); WIDE=3
    PYTEST=(-k "stalled_rank and connections-8-host or wait_past")
    HOST=(--world 2 --calls 2 --shape 8,16,8 --schedules ring --dtype float32)
else
    # (no --optional: the gated kernels' cold autotune would not fit the bound; parts 5-6
    # run them)
    SMOKE=(); SELFTEST=(); WIDE=4; PYTEST=(); HOST=(--world 4)
fi

VERSIONS="(nvidia-smi || rocm-smi) 2>&1 | head -n 30; $PY -c \"import importlib.metadata as m, \
torch, ficco.__main__ as f; print(f.version(), 'cuda', torch.version.cuda, 'hip', \
torch.version.hip, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name()); \
print(*sorted(f'{d.name}=={d.version}' for d in m.distributions() if d.name and \
d.name.lower().startswith(('torch', 'triton', 'cuda-', 'hip-', 'numpy'))), sep='\\n')\""

echo "ficco GPU lease $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)" | tee -a "$LOG"
part versions 20 versions.txt bash -c "$VERSIONS"
if ! part smoke 60 lease.log "$PY" -m ficco selftest --share-gpu 2 --smoke --timeout 20 \
        "${SMOKE[@]}"; then
    echo "the smoke of the default path failed: nothing after it can pass; stopping" | tee -a "$LOG"
    finish
    exit 1
fi
part selftest-w2 100 lease.log "$PY" -m ficco selftest --share-gpu 2 "${SELFTEST[@]}" \
    --json "$OUT/selftest-w2.json"
part "selftest-w$WIDE" 100 lease.log "$PY" -m ficco selftest --share-gpu "$WIDE" \
    "${SELFTEST[@]}" --json "$OUT/selftest-w$WIDE.json"
part gpu-suite 170 pytest.txt env FICCO_TIMEOUT=20 "$PY" -m pytest -q -m gpu tests/gpu \
    -p no:cacheprovider -rfE "${PYTEST[@]}"
part kernel-tests 60 pytest.txt env FICCO_TIMEOUT=20 "$PY" -m pytest -q -m gpu \
    tests/test_gated.py tests/test_kernels.py -p no:cacheprovider -rfE "${PYTEST[@]}"
part host-time 40 lease.log "$PY" -m ficco.bench.gpu_session host "${HOST[@]}" --out "$OUT"
finish

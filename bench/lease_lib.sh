# Shared by bench/gpu_lease.sh and bench/gpu_lease_next.sh (sourced after they set OUT and LOG,
# never run): the environment every part runs in, then one bounded
# part at a time, its output streamed into a file of $OUT as it runs, its exit code and time
# into $LOG, so a lease cut short still returns every line written before the cut.
#
#   part NAME SECONDS FILE CMD...   run CMD under `timeout SECONDS * $SCALE`, output appended
#                                   to $OUT/FILE; returns CMD's exit code (124/137: cut)
#   finish                          the summary line ("parts: name=rc ..."), also on stdout
#   bound SECONDS                   SECONDS * $SCALE as an integer (a bound passed to a
#                                   command inside a part, kept below the part's own)
#   $VERSIONS                       the versions part's command: driver, torch, CUDA/HIP,
#                                   Triton, bindings, and the device's facts (name, SMs, L2,
#                                   memory, capability)

PY=${PY:-python3}
SCALE=${FICCO_LEASE_SCALE:-1}      # multiplies every bound (CI shrinks or stretches them)
QUICK=${FICCO_LEASE_QUICK:-0}      # 1: every part shrunk to a minimum (CI on the fake GPU)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/ficco-triton-cache}
export FICCO_TIMEOUT=20            # every part: a failed wait costs 20 s, never 300
RESULTS=()

bound() {
    awk -v s="$1" -v k="${SCALE:-1}" 'BEGIN { v = s * k; printf "%d", (v < 1 ? 1 : v) }'
}

VERSIONS="(nvidia-smi || rocm-smi) 2>&1 | head -n 30; $PY -c \"import importlib.metadata as m, \
torch, ficco.__main__ as f; print(f.version(), 'cuda', torch.version.cuda, 'hip', \
torch.version.hip, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name()); \
p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; \
print('device', p and {'name': p.name, 'sms': p.multi_processor_count, \
'l2_bytes': getattr(p, 'L2_cache_size', None), 'memory_bytes': getattr(p, 'total_memory', None), \
'capability': (p.major, p.minor)}); \
print(*sorted(f'{d.name}=={d.version}' for d in m.distributions() if d.name and \
d.name.lower().startswith(('torch', 'triton', 'cuda-', 'hip-', 'numpy', 'pytest'))), sep='\\n')\""

part() {
    local name=$1 file=$3 limit start rc note=""
    limit=$(bound "$2")
    shift 3
    echo "== $name (bound ${limit}s, $(date -u +%H:%M:%S)): $*" | tee -a "$LOG"
    start=$SECONDS
    # timeout signals the whole process group of CMD (its ranks and helpers too)
    timeout -k 5 "$limit" "$@" >> "$OUT/$file" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (cut at its bound)"; fi
    [ "$file" != "$(basename "$LOG")" ] && tail -n 8 "$OUT/$file" >> "$LOG"
    echo "== $name: exit $rc after $((SECONDS - start))s$note" | tee -a "$LOG"
    RESULTS+=("$name=$rc")
    return "$rc"
}

finish() {
    echo "parts: ${RESULTS[*]}" | tee -a "$LOG"
}

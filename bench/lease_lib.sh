# Shared by bench/gpu_lease.sh and bench/gpu_lease_next.sh (sourced after they set OUT and LOG,
# never run): the environment every part runs in, then one bounded
# part at a time, its output streamed into a file of $OUT as it runs, its exit code and time
# into $LOG, so a lease cut short still returns every line written before the cut.
#
#   part NAME SECONDS FILE CMD...   run CMD under `timeout SECONDS * $SCALE`, output appended
#                                   to $OUT/FILE; returns CMD's exit code (124/137: cut)
#   finish                          the summary line ("parts: name=rc ..."), also on stdout

PY=${PY:-python3}
SCALE=${FICCO_LEASE_SCALE:-1}      # multiplies every bound (CI shrinks or stretches them)
QUICK=${FICCO_LEASE_QUICK:-0}      # 1: every part shrunk to a minimum (CI on the fake GPU)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/ficco-triton-cache}
RESULTS=()

part() {
    local name=$1 file=$3 limit start rc note=""
    limit=$(awk -v s="$2" -v k="${SCALE:-1}" 'BEGIN { v = s * k; printf "%d", (v < 1 ? 1 : v) }')
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

# Sourced by check.sh and carry_smollm2.sh: time-limited steps that fail soft, and the report
# rewritten after each. Needs HERE, WORK, OUT, PY, BUDGET, T0 and LIMIT_SCALE set.

# report: report.py over $WORK into $OUT, the last lines of every step's log ($OUT/tails.txt)
# and every log ($OUT/logs.tar.gz): five files, what the device tool brings back
report() {
  $PY $HERE/report.py "$WORK" "$OUT" > "$WORK/report.log" 2>&1 || cp "$WORK/report.log" "$OUT/summary.txt"
  for f in "$WORK"/logs/*.log; do
    [ -f "$f" ] && { echo "===== $(basename "$f") (last 30 lines)"; tail -n 30 "$f" | cut -c1-400; }
  done > "$OUT/tails.txt"
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs steps.tsv command.txt 2>/dev/null
}

# settle: until the GPU's memory is given back (a stopped engine's processes), at most 20 s
settle() {
  command -v nvidia-smi > /dev/null || return 0
  local used
  for _ in $(seq 20); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    [ -n "$used" ] && [ "$used" -lt 2048 ] && return 0
    sleep 1
  done
}

# wanted NAME: whether CHECK_STEPS (comma-separated name prefixes, e.g. "a,b-none,d") asks for
# the step; every step when it is unset; setup, randmodel and warm always (the others need them)
wanted() {
  [ -z "${CHECK_STEPS:-}" ] && return 0
  case "$1" in setup|randmodel|warm) return 0 ;; esac
  local prefix
  for prefix in ${CHECK_STEPS//,/ }; do [[ "$1" == "$prefix"* ]] && return 0; done
  return 1
}

# step NAME LIMIT COMMAND...: COMMAND with its output in $WORK/logs/NAME.log, stopped after
# LIMIT * LIMIT_SCALE seconds or when the budget runs out, in its own process group (timeout's),
# which is killed whole afterwards (engine processes it left); one line in $WORK/steps.tsv.
step() {
  wanted "$1" || return 0
  local name=$1 limit=$(( $2 * LIMIT_SCALE )); shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    printf '%s\t-\t0\t%s\tnot run: the time budget is spent\n' "$name" "$limit" >> "$WORK/steps.tsv"
    echo "== $name: not run (time budget spent)"; report; return
  fi
  echo "== $name (at most ${limit}s): $*"
  local start rc pid note=""
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1 &
  pid=$!
  wait $pid; rc=$?
  kill -9 -- -$pid 2>/dev/null
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && note="stopped at its time limit"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" "$note" >> "$WORK/steps.tsv"
  echo "   rc=$rc in $(( $(date +%s) - start ))s; last lines:"; tail -n 3 "$WORK/logs/$name.log" | cut -c1-200
  settle; report
}

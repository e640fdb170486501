#!/usr/bin/env bash
# Median PPO step of the tiny task with several CPU thread settings, on a quiet machine and
# with one other busy process beside it (what a shared server or CI looks like). Run it alone:
#     bash benchmarks/bounds/bench_threads.sh
# Each run: 5 steps, the median of steps 2-5 (`time/step` from the run's DiskLogger file).
set -euo pipefail
cd "$(dirname "$0")/../.."

run() {  # run <label> <cpu_threads> [VAR=value ...]
  local label=$1 threads=$2; shift 2
  local out; out=$(mktemp -d)
  env -u OMP_NUM_THREADS "$@" tune run ppo_full_finetune --config recipes/configs/tiny/ppo_tiny_sentiment.yaml \
    output_dir="$out/run" num_ppo_steps=5 cpu_threads="$threads" \
    log_samples_every_n_steps=null save_every_n_steps=null >"$out/console" 2>&1
  python - "$label" "$out/run/logs" "$out/console" <<'PY'
import re, statistics, sys
from torchtune_ppo.run.logs import read_disk_log
rows = read_disk_log(sys.argv[2])
chose = re.search(r"cpu_threads=auto: (\d+) thread", open(sys.argv[3]).read())
note = f" (auto chose {chose.group(1)})" if chose else ""
print(f"  {sys.argv[1]:<36} median step {statistics.median(r['time/step'] for r in rows[1:]):.3f} s{note}")
PY
  rm -rf "$out"
}

for load in quiet busy; do
  echo "$load:"
  busy_pid=""
  if [ "$load" = busy ]; then python3 -c "while True: pass" & busy_pid=$!; fi
  run "2 threads (torch's default)" 2
  run "1 thread" 1
  run "cpu_threads: auto" auto
  run "2 threads, GOMP_SPINCOUNT=1000" 2 GOMP_SPINCOUNT=1000
  run "2 threads, OMP_WAIT_POLICY=PASSIVE" 2 OMP_WAIT_POLICY=PASSIVE
  if [ -n "$busy_pid" ]; then kill "$busy_pid"; fi
done

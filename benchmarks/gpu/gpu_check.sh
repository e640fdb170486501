#!/usr/bin/env bash
# Every GPU check of this repo in one command, for a bare, offline CUDA machine.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]     # OUTDIR: default $OUT if set, else gpu_check_out/
#
# (benchmarks/gpu_check.sh runs this file, benchmarks/gpu/gpu_check.sh.)
#
# Through the device tool (it copies the working tree; the wheels are git-ignored, so carry them):
#   run(carry=["benchmarks/gpu_wheels"], command="bash benchmarks/gpu_check.sh $OUT", timeout_s=540)
#
# Needs: python3 (3.12) with torch (CUDA), transformers, sentencepiece, safetensors, tqdm, pyarrow
# and pandas; pytest for the last step. Everything else comes from benchmarks/gpu_wheels/, made
# beforehand, where PyPI is reachable, by `bash benchmarks/gpu/fetch_gpu_wheels.sh` (~12 MiB).
#
# Takes at most ~8 min: the steps share a budget of GPU_CHECK_BUDGET_S (450 s) and each has its
# own timeout, so one hang costs its own cap, not the run. Steps, in order of what matters most:
#   env               nvidia-smi, python/torch/CUDA versions, the GPU torch sees
#   install           wheels from benchmarks/gpu_wheels whose package is not installed yet
#                     (pip --no-index --no-deps), then this repo (--no-deps -e .), then imports
#   smoke             tiny PPO recipe, device=cuda dtype=bf16 compile=True, 3 steps:
#                     finite metrics and 0 recompiles after step 1
#   smoke_cudagraphs  the same with compile.mode=reduce-overhead (CUDA graphs on decode)
#   gen_b32, gen_b1   benchmarks/generation/bench_generation.py --llama-1b at batch 32 and
#                     batch 1 (at most 8 interleaved rounds), with the memory-bandwidth floor
#   ppo_bench         benchmarks/ppo/bench_ppo.py --gpu within what is left of the budget (its
#                     two default rows, tt_compile and ours_all, interleaved)
#   tests             the CPU unit tests of generation, loss step, rlhf math and trajectory
#                     under this machine's torch, if time is left
# A failing step is recorded and the next one runs; the exit status is 1 if any step failed.
#
# OUTDIR gets at most 8 files (what the device tool brings back): summary.txt (each step's
# status, rerun as the run goes, so a cut-off run still has one), gpu_check.log (all output,
# through tee), gen_b32.json, gen_b1.json, ppo_bench.md, ppo_bench.json, details.tar.gz (recipe
# metric logs, configs, bench_ppo row logs, pip freeze, nvidia-smi -q).
#
# Knobs (environment):
#   GPU_CHECK_STEPS=smoke,gen_b1   run only these steps (install also runs whenever torchtune
#                                  or this package does not import yet)
#   GPU_CHECK_BUDGET_S=450         seconds for all steps together
#   GPU_CHECK_CAPS=smoke=300       per-step timeouts in seconds, overriding the defaults below
#   GPU_CHECK_DRY_RUN=1            rehearsal on a machine without a GPU: device=cpu, fp32, tiny
#                                  sizes, no compile (GPU_CHECK_DRY_COMPILE=1 compiles the smokes)
#   PYTHON=python3                 the interpreter to install into and run with
# A second call on the machine while it is still warm (it is given back ~30 s after a call)
# can rerun what failed, e.g. command "GPU_CHECK_STEPS=smoke,gen_b1 GPU_CHECK_BUDGET_S=200
# bash benchmarks/gpu_check.sh $OUT", timeout_s 260. On 2 CPU cores the dry run takes ~3 min.

set -uo pipefail  # no -e: a failing step is recorded and the check goes on

if [[ ${1:-} == __step ]]; then STEP_MODE=1; shift; else STEP_MODE=0; fi

PY=${PYTHON:-python3}
# An absolute path: steps run from the repo root, and one check from /.
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
WHEELS=$ROOT/benchmarks/gpu_wheels
CONFIG=recipes/configs/tiny/ppo_tiny_sentiment.yaml
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
export PYTHONUNBUFFERED=1

if [[ $DRY_RUN == 1 ]]; then
  DEVICE=cpu DTYPE=fp32 SMOKE_STEPS=2
  SMOKE_COMPILE=$([[ ${GPU_CHECK_DRY_COMPILE:-0} == 1 ]] && echo True || echo False)
  GEN_ARGS=(--device cpu --gen-len 4 --max-steps 1 --warmup 1 --variants 'tt-kv,ours')
  GEN_MAX_BATCH=2
  PPO_ARGS=(--quick)
  TESTS=(tests/unit/test_rlhf.py)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a shared 2-core machine
else
  DEVICE=cuda DTYPE=bf16 SMOKE_STEPS=3 SMOKE_COMPILE=True
  GEN_ARGS=(--llama-1b --device cuda --max-steps 8)
  GEN_MAX_BATCH=1024
  PPO_ARGS=(--gpu)
  TESTS=(tests/parity/test_generation.py tests/parity/test_loss_step.py tests/unit/test_rlhf.py tests/parity/test_trajectory.py)
fi

# ---------------------------------------------------------------------------------------------
# Steps. Each runs as `bash gpu_check.sh __step NAME` under `timeout`, so that a timeout ends the
# step's whole process group (inductor's compile workers included).

step_env() {
  date -u "+%Y-%m-%d %H:%M:%S UTC"
  echo "tree: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi -q >"$DETAILS/nvidia-smi-q.txt" 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
  "$PY" - "$DEVICE" <<'EOF'
import sys
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
          f"{p.multi_processor_count} SMs, bf16: {torch.cuda.is_bf16_supported()}")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: the GPU steps cannot run")
EOF
}

step_install() {
  # Only wheels whose package is missing: reinstalling one the image has (numpy, say) at another
  # version could break the image's other packages. --no-deps because the resolver would ask for
  # torchtune's optional extras (hf_transfer, blobfile, Pillow), which are not carried.
  local missing
  missing=$("$PY" - "$WHEELS" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

folder = Path(sys.argv[1])
wheels = sorted(folder.glob("*.whl"))
if not wheels:
    print(f"no wheels in {folder}: run benchmarks/gpu/fetch_gpu_wheels.sh where PyPI is reachable, "
          "and carry benchmarks/gpu_wheels", file=sys.stderr)
for w in wheels:
    name, version = w.name.split("-")[:2]
    try:
        have = metadata.version(name)
        print(f"  have {name} {have} (wheel: {version})", file=sys.stderr)
    except metadata.PackageNotFoundError:
        print(w)
EOF
  )
  if [[ -n $missing ]]; then
    echo "installing: $(echo "$missing" | xargs -n1 basename | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one path per word; wheel names hold no spaces
    "$PY" -m pip install --no-index --no-deps --no-cache-dir --disable-pip-version-check -q $missing \
      || echo "pip install of the wheels failed (see above)"
  fi
  # Installed means importable away from the tree (here, PYTHONPATH and the working directory
  # would find the sources, and a stale recipes/*.egg-info would pass for metadata).
  if ! (cd / && env -u PYTHONPATH "$PY" -c "import torchtune_ppo, ppo_full_finetune" 2>/dev/null); then
    # --no-build-isolation: the build backend (setuptools) must come from the machine, offline.
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
      --disable-pip-version-check -q -e "$ROOT" \
      || echo "pip install -e . failed: the steps use PYTHONPATH=$ROOT:$ROOT/recipes instead"
  fi
  "$PY" -m pip freeze >"$DETAILS/pip-freeze.txt" 2>/dev/null
  # What the recipe, `tune run` and the benchmarks import, with versions.
  "$PY" - <<'EOF'
import importlib
import warnings

warnings.simplefilter("ignore")
bad = []
for mod in ("torch", "torchao", "torchtune", "datasets", "omegaconf", "kagglehub", "pyarrow",
            "pandas", "sentencepiece", "safetensors", "transformers", "torchtune_ppo",
            "ppo_full_finetune", "torchtune._cli.tune"):
    try:
        m = importlib.import_module(mod)
        print(f"  ok  {mod} {getattr(m, '__version__', '')}")
    except Exception as e:  # report every missing piece, not just the first
        bad.append(mod)
        print(f"  FAILED  {mod}: {type(e).__name__}: {e}")
if bad:
    raise SystemExit(f"cannot import {bad}: every later step will fail the same way")
EOF
}

# One tiny PPO run (extra overrides in "$@"); then its DiskLogger metrics: every step logged,
# finite, 0 recompiles.
smoke_run() {
  local name=$1; shift
  local out=$WORK/$name
  rm -rf "$out"
  "$PY" -m torchtune._cli.tune run ppo_full_finetune --config "$CONFIG" \
    output_dir="$out" num_ppo_steps="$SMOKE_STEPS" device="$DEVICE" dtype="$DTYPE" \
    log_peak_memory_stats=True "$@"
  local rc=$?
  mkdir -p "$DETAILS/$name"
  cp "$out"/logs/*.txt "$out"/torchtune_config.yaml "$DETAILS/$name/" 2>/dev/null
  ((rc == 0)) || return $rc
  "$PY" - "$out/logs" "$SMOKE_STEPS" <<'EOF'
import math
import sys

from torchtune_ppo.run.logs import read_disk_log

rows, want = read_disk_log(sys.argv[1]), int(sys.argv[2])
keys = ("scores", "loss", "kl", "time/generate", "time/score", "time/loss_step",
        "peak_memory_alloc", "recompiles")
print("step " + " ".join(f"{k:>14}" for k in keys))
for i, r in enumerate(rows, 1):
    print(f"{i:4d} " + " ".join(f"{r.get(k, float('nan')):14.4g}" for k in keys))
problems = []
if len(rows) != want:
    problems.append(f"{len(rows)} steps logged, {want} expected")
if any(not math.isfinite(v) for r in rows for v in r.values()):
    problems.append("a metric is not finite")
recompiles = max((r.get("recompiles", 0.0) for r in rows), default=0.0)
if recompiles:
    problems.append(f"{recompiles:.0f} graphs compiled after step 1 (must be 0)")
print("recompiles after step 1:", int(recompiles))
if problems:
    sys.exit("smoke check FAILED: " + "; ".join(problems))
print("smoke check ok")
EOF
}

step_smoke() { smoke_run smoke compile="$SMOKE_COMPILE"; }
# Every region named: OmegaConf would drop a bare compile=True next to compile.mode (the config
# refuses that mix).
step_smoke_cudagraphs() {
  smoke_run smoke_cudagraphs compile.generate="$SMOKE_COMPILE" compile.trajectory="$SMOKE_COMPILE" \
    compile.loss_step="$SMOKE_COMPILE" compile.rollout=False compile.mode=reduce-overhead
}

gen_run() {
  local batch=$1
  # One inductor cache for both batch sizes: the second run reuses what kernels it can.
  TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_gen "$PY" benchmarks/generation/bench_generation.py "${GEN_ARGS[@]}" \
    --batch "$((batch < GEN_MAX_BATCH ? batch : GEN_MAX_BATCH))" --out "$OUTDIR/gen_b$batch.json"
}
step_gen_b32() { gen_run 32; }
step_gen_b1() { gen_run 1; }

step_ppo_bench() {
  # bench_ppo.py keeps to --budget-s itself (rows cut at their limit); the rest of this step's
  # timeout is for building the random 1B checkpoints and writing the report.
  local budget=$((STEP_TIMEOUT_S - 75))
  ((budget >= 60)) || { echo "only ${STEP_TIMEOUT_S} s left: too little for bench_ppo"; return 1; }
  "$PY" benchmarks/ppo/bench_ppo.py "${PPO_ARGS[@]}" --out "$DETAILS/ppo_bench" \
    --budget-s "$budget" --row-timeout-s "$((budget < 120 ? budget : 120))"
  local rc=$?
  cp "$DETAILS"/ppo_bench/ppo_bench.{md,json} "$OUTDIR/" 2>/dev/null
  return $rc
}

step_tests() {
  local par=()
  # pytest-xdist spreads the files over the machine's cores, if it is there.
  if "$PY" -c "import xdist" 2>/dev/null; then par=(-n 8); fi
  "$PY" -m pytest -q -p no:cacheprovider ${par[@]+"${par[@]}"} "${TESTS[@]}"
}

if ((STEP_MODE)); then
  # In the step's own process: PYTHONPATH covers a failed `pip install -e .`.
  export PYTHONPATH=$ROOT:$ROOT/recipes${PYTHONPATH:+:$PYTHONPATH}
  "step_$1"
  exit $?
fi

# ---------------------------------------------------------------------------------------------
# The driver: per-step timeouts within one budget, everything through tee into OUTDIR.

OUTDIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
DETAILS=$WORK/details
mkdir -p "$DETAILS"
export OUTDIR WORK DETAILS PY DEVICE DTYPE
# A cache of our own: a shared one may hold a file that a killed compile left half-written.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}
LOG=$OUTDIR/gpu_check.log
SUMMARY=$OUTDIR/summary.txt
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
ALL_STEPS=(env install smoke smoke_cudagraphs gen_b32 gen_b1 ppo_bench tests)
# Caps: roughly twice what each step should take on one H200 with a cold compile cache.
declare -A CAP=([env]=30 [install]=90 [smoke]=150 [smoke_cudagraphs]=120 [gen_b32]=150
                [gen_b1]=110 [ppo_bench]=400 [tests]=120)
# GPU_CHECK_CAPS="smoke=600,tests=300" overrides some (a CPU rehearsal compiles far slower).
IFS=, read -r -a caps <<<"${GPU_CHECK_CAPS:-}"
for c in ${caps[@]+"${caps[@]}"}; do
  if [[ -n ${CAP[${c%%=*}]+x} ]]; then CAP[${c%%=*}]=${c#*=}; else echo "GPU_CHECK_CAPS: unknown step in $c"; fi
done
IFS=, read -r -a WANTED <<<"${GPU_CHECK_STEPS:-$(IFS=,; echo "${ALL_STEPS[*]}")}"
# A reused folder: last run's files would pass for this run's.
rm -f "$OUTDIR"/{summary.txt,gen_b32.json,gen_b1.json,ppo_bench.md,ppo_bench.json,details.tar.gz}
: >"$LOG"
declare -a DONE=()
declare -a FAILED=()
START=$SECONDS

say() { echo "$*" | tee -a "$LOG"; }

write_summary() {
  {
    echo "GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(( SECONDS - START )) s of a ${BUDGET_S} s budget"
    [[ $DRY_RUN == 1 ]] && echo "DRY RUN: device=cpu, tiny sizes (not a GPU result)"
    [[ -f $WORK/env_head.txt ]] && cat "$WORK/env_head.txt"
    echo
    printf '%-18s %-22s %6s\n' step status seconds
    printf '%s\n' "${DONE[@]}"
    echo
    if ((${#FAILED[@]})); then echo "FAILED: ${FAILED[*]}"; else echo "no step failed"; fi
    [[ -f $WORK/figures.txt ]] && { echo; cat "$WORK/figures.txt"; }
    echo
    echo "Details: gpu_check.log (all output), details.tar.gz (metric logs, row logs, pip freeze)."
  } >"$SUMMARY"
  tar -czf "$OUTDIR/details.tar.gz" -C "$WORK" details 2>/dev/null
}

# The figures worth reading first, from the steps' outputs.
collect_figures() {
  "$PY" - "$OUTDIR" "$LOG" >"$WORK/figures.txt" 2>/dev/null <<'EOF'
import json
import re
import sys
from pathlib import Path

out, log = Path(sys.argv[1]), Path(sys.argv[2]).read_text(errors="replace")
for m in re.finditer(r"^=== .*? (smoke\w*) .*$|^recompiles after step 1: (\d+)$", log, re.M):
    if m[1]:
        name = m[1]
    else:
        print(f"{name}: recompiles after step 1: {m[2]}")
for b in ("32", "1"):
    f = out / f"gen_b{b}.json"
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    floor = d.get("bandwidth_floor") or {}
    print(f"generation, batch {b}: floor {floor.get('floor_decode_tok_s', float('nan')):.0f} tok/s "
          f"({floor.get('bandwidth_GBs', float('nan')):.0f} GB/s measured copy bandwidth)")
    for r in d.get("rows", []):
        share = r["decode_tok_s"] / floor["floor_decode_tok_s"] if floor else float("nan")
        print(f"  {r['name']:60s} decode {r['decode_tok_s']:9.0f} tok/s ({share:.0%} of floor), "
              f"whole call {r['total_ms']:.1f} ms")
md = out / "ppo_bench.md"
if md.exists():
    print("PPO step (bench_ppo.py):")
    print("\n".join(l for l in md.read_text().splitlines() if l.startswith("|")))
EOF
}

wanted() { [[ " ${WANTED[*]} " == *" $1 "* ]]; }

run_step() {
  local name=$1
  local left=$(( BUDGET_S - (SECONDS - START) ))
  local cap=${CAP[$name]}
  local t=$(( cap < left ? cap : left ))
  if (( t < 20 )); then
    DONE+=("$(printf '%-18s %-22s %6s' "$name" "skipped (budget spent)" 0)")
    FAILED+=("$name(skipped)")
    say "=== [$(( SECONDS - START )) s] $name: skipped, the budget is spent"
    return
  fi
  say ""
  say "=== [$(( SECONDS - START )) s] $name (timeout ${t} s)"
  local t0=$SECONDS rc pid
  # tee sits in a process substitution, not a pipeline: a process the step leaves behind with
  # the output still open would keep a pipeline's tee, and so this script, waiting.
  STEP_TIMEOUT_S=$t timeout --kill-after=15 "$t" bash "${BASH_SOURCE[0]}" __step "$name" \
    > >(tee -a "$LOG") 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  # timeout leads its own process group: end what the step left in it (compile workers).
  kill -KILL -- "-$pid" 2>/dev/null
  sleep 1  # let tee write the step's last lines before the status line
  local status=ok
  if ((rc == 124 || rc == 137)); then status="TIMEOUT (${t} s)"
  elif ((rc != 0)); then status="FAILED (exit $rc)"; fi
  [[ $status == ok ]] || FAILED+=("$name")
  DONE+=("$(printf '%-18s %-22s %6s' "$name" "$status" $(( SECONDS - t0 )))")
  say "=== $name: $status after $(( SECONDS - t0 )) s"
  if [[ $name == env ]]; then
    grep -E "^(torch |python: |  cuda:|cuda available|tree: )" "$LOG" >"$WORK/env_head.txt"
  fi
  collect_figures
  write_summary
}

say "GPU check: output in $OUTDIR, scratch in $WORK, budget ${BUDGET_S} s, steps: ${WANTED[*]}"
unknown=()
for s in "${WANTED[@]}"; do [[ -n ${CAP[$s]+x} ]] || unknown+=("$s"); done
if ((${#unknown[@]})); then say "unknown steps: ${unknown[*]} (valid: ${ALL_STEPS[*]})"; exit 2; fi
for s in "${ALL_STEPS[@]}"; do
  # install runs whenever the packages do not import yet: every other step needs them.
  if wanted "$s" || { [[ $s == install ]] && ! "$PY" -c "import torchtune, torchtune_ppo" 2>/dev/null; }; then
    run_step "$s"
  fi
done
write_summary
say ""
tee -a "$LOG" <"$SUMMARY"
rm -rf "$WORK"
((${#FAILED[@]} == 0))

#!/usr/bin/env bash
# share_group_prefill against n prefills of each prompt, rows interleaved one step (call) at a
# time, warm-up left out, medians of per-pair ratios with 95% intervals:
#   1. PPO steps of GRPO on tiny_arithmetic (P = 8, T = 6), n = 4 and 8, eager;
#   2. PPO steps of GRPO on tiny_sentiment with max_prompt_len 96 (the prefill a real part of
#      the step), n = 4 and 8, eager; n = 4 also with compile.generate;
#   3. generation alone (bench_generation.py), 32 rows, prompts of 128 columns, 32 tokens,
#      n = 4 (eager and compiled) and 8 (eager).
# Run it alone on a quiet machine: bash benchmarks/ppo/bench_group_prefill.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench_group_prefill}
mkdir -p "$out"
ppo() { python benchmarks/ppo/bench_ppo.py --threads 1 --min-steps 6 --warmup 2 "$@"; }
arith=recipes/configs/tiny/grpo_tiny_arithmetic.yaml
sent=recipes/configs/tiny/ppo_tiny_sentiment.yaml
for n in 4 8; do
  ppo --config $arith --rows ours_eager,ours_eager_shared --batch-size $((64 / n)) \
    --forward-batch-size 32 --ppo-batch-size 32 --set num_samples_per_prompt=$n \
    --max-steps 12 --settle 0 --out "$out/arith_n$n"
  ppo --config $sent --rows ours_eager,ours_eager_shared --batch-size $((32 / n)) \
    --forward-batch-size 16 --ppo-batch-size 16 --max-prompt-len 96 \
    --set advantage_estimator=grpo num_samples_per_prompt=$n --max-steps 10 --settle 0 --out "$out/sent96_n$n"
done
ppo --config $sent --rows ours_generate,ours_generate_shared --batch-size 8 --forward-batch-size 16 \
  --ppo-batch-size 16 --max-prompt-len 96 --set advantage_estimator=grpo num_samples_per_prompt=4 \
  --max-steps 10 --settle 2 --out "$out/sent96_n4_compiled"
gen() { python benchmarks/generation/bench_generation.py --batch 32 --prompt-len 128 --gen-len 32 \
  --max-steps 12 --min-steps 6 --threads 1 "$@"; }
gen --group 4 --variants ours,ours-shared,ours-compiled,ours-shared-compiled --out "$out/gen_n4.json"
gen --group 8 --variants ours,ours-shared --out "$out/gen_n8.json"

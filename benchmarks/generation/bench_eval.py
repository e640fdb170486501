"""Seconds of one in-training evaluation of a shipped config, and how much of it is the prefill.

Builds the recipe from ``--config`` (and ``key=value`` overrides) as ``tune run`` would, then runs
its evaluation ``--repeats`` times on the untrained policy: the first compiles the evaluation's
regions (when ``compile.generate`` is on), the later ones are what every evaluation of a run
costs. The prefill is timed around the generator's ``first_token`` (the prompts' forward and the
first sampled token); the rest of a call is decoding and scoring.

    python benchmarks/generation/bench_eval.py --config recipes/configs/smollm2/135M_ppo_arithmetic.yaml
    python benchmarks/generation/bench_eval.py --config ... eval.batch_size=16 share_prompt_prefix=False
    python benchmarks/generation/bench_eval.py --config recipes/configs/smollm2/135M_ppo_arithmetic.yaml --reward-model

``--reward-model`` scores with a SmolLM2 reward model (the prepared checkpoint with a random
head, as ``benchmarks/ppo/bench_ppo.py --smollm2`` gives both recipes) instead of the config's
function reward, and times the scoring (the reward model's forward) apart.

Run it alone (``cpu_threads`` as given, else the config's).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from torchtune_ppo.config import validate_config  # noqa: E402


class _TimedScorer:
    """The evaluation's scorer, adding its seconds to ``total[0]``."""

    def __init__(self, scorer, total):
        self.scorer, self.parts, self.total = scorer, scorer.parts, total

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.scorer(*args, **kwargs)
        finally:
            self.total[0] += time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reward-model", action="store_true",
                   help="score with bench_ppo.py --smollm2's SmolLM2 reward model (random head)")
    p.add_argument("overrides", nargs="*", help="key=value, as on tune run's command line")
    args = p.parse_args()
    import ppo_full_finetune as recipe_module

    out = tempfile.mkdtemp(prefix="bench_eval_")
    reward = []
    if args.reward_model:
        sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks/ppo")]
        from bench_ppo import smollm2_assets

        reward = smollm2_assets()[0]
    cfg = OmegaConf.merge(OmegaConf.load(args.config),
                          OmegaConf.from_dotlist(["num_ppo_steps=1", f"output_dir={out}", *reward, *args.overrides]))
    cfg = validate_config(cfg)
    recipe = recipe_module.PPOFullFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    evaluator = recipe._evaluator  # the run's own, as its train loop calls it
    gen = evaluator.generator
    if gen is None:
        raise SystemExit(f"{args.config}: evaluation is off (eval.every_n_steps / eval.before_training).")
    prefill = [0.0]
    first_token = gen.first_token

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return first_token(*a, **k)
        finally:
            prefill[0] += time.perf_counter() - start

    gen.first_token = timed
    scoring = [0.0]
    evaluator.scorer = _TimedScorer(evaluator.scorer, scoring)
    sets = ", ".join(f"{p.name}: {len(p.prompt_lens)} prompts" for p in evaluator.prompts)
    print(f"evaluation: {sets}; width {gen.max_prompt_len}, shared prefix {gen.prefix_len} tokens, "
          f"{gen.max_generated_tokens} tokens, {gen.batch_size} rows a call, {cfg.dtype}, "
          f"compile.generate={cfg.compile.generate}")
    times = []
    for i in range(args.repeats):
        prefill[0] = scoring[0] = 0.0
        start = time.perf_counter()
        metrics = evaluator.evaluate(step=i)
        seconds = time.perf_counter() - start
        times.append((seconds, prefill[0], scoring[0]))
        shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.endswith("pass@1"))
        print(f"  evaluation {i + 1}: {seconds:.1f} s, of which prefill {prefill[0]:.1f} s, scoring "
              f"{scoring[0]:.1f} s ({shown})")
    if len(times) > 1:
        later = times[1:]
        print(f"later evaluations, median: {statistics.median(t[0] for t in later):.1f} s, "
              f"prefill {statistics.median(t[1] for t in later):.1f} s, scoring {statistics.median(t[2] for t in later):.1f} s")


if __name__ == "__main__":
    main()

"""Evaluation during training: held-out prompts generated and scored every N steps, logged as
``val/`` metrics, the best checkpoint kept, and an early stop (docs/evaluation.md).

- :mod:`.data`: which prompts (``eval.dataset`` or the named sets of ``eval.datasets``, or the
  dataset's held-out split), read and checked once.
- :mod:`.metrics`: pass@k, each process's block of prompts, sums added over processes.
- :mod:`.record`: :class:`EvalRecord`, when to evaluate, the history, the best, the stopping rule.
- :mod:`.evaluator`: :class:`Evaluator`, what the recipe calls after each step.
"""

from torchtune_ppo.eval.data import EvalPrompts, check_eval_length, default_eval_dataset, eval_blocks, eval_prompts
from torchtune_ppo.eval.evaluator import EvalScorer, Evaluator, build_evaluator, eval_seed
from torchtune_ppo.eval.metrics import eval_metrics, pass_at_k, prompt_shard, sum_over_processes, tally
from torchtune_ppo.eval.record import EvalRecord

__all__ = [
    "EvalPrompts", "EvalRecord", "EvalScorer", "Evaluator", "build_evaluator", "check_eval_length",
    "default_eval_dataset", "eval_blocks", "eval_metrics", "eval_prompts", "eval_seed", "pass_at_k", "prompt_shard", "sum_over_processes", "tally",
]

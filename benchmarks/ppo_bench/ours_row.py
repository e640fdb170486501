"""Our recipe's row: built from the config, run through ``train(on_step=...)``, metrics read back."""

import time
from typing import Any, Dict, List

from .device import sync


def run_ours_row(cfg_dict: Dict[str, Any]) -> Dict[str, Any]:
    """Runs our recipe for ``num_steps`` and reads each step's times from its metrics.

    Args:
        cfg_dict (Dict[str, Any]): a resolved recipe config with a full ``compile`` block.

    Returns:
        Dict[str, Any]: ``steps`` (one dict per PPO step, see ``ppo_bench.rows``) and
        ``whole_run_s``, from the call of ``train()`` to the end of its last step (the final
        checkpoint that ``train()`` writes afterwards is left out); ``policy_params``, the
        parameters of the policy it trained.
    """
    from omegaconf import OmegaConf
    from ppo_full_finetune import PPOFullFinetuneRecipe

    from torchtune_ppo.compile import compile_count
    from torchtune_ppo.config import validate_config

    cfg = validate_config(OmegaConf.create(cfg_dict))
    recipe = PPOFullFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)

    device = cfg.device
    steps: List[Dict[str, float]] = []
    step_ends: List[float] = []
    graphs_before = compile_count()

    def on_step(step: int, metrics: Dict[str, float]) -> None:
        sync(device)
        step_ends.append(time.perf_counter())
        steps.append({
            "step": step,
            "step_s": metrics["time/step"],
            "generate": metrics["time/generate"],
            # compile.rollout times steps 1-6 as one region, reported as generate.
            "score": metrics.get("time/score", 0.0),
            "advantages": metrics["time/advantages"],
            "loss_step": metrics["time/loss_step"],
            "optimizer": metrics["time/optimizer"],
            # Every batch is left-padded to max_prompt_len: one static shape.
            "prompt_len": cfg.max_prompt_len,
            "recompiles": int(metrics["recompiles"]),
            "graphs": compile_count() - graphs_before,
            # Valid response tokens per row (stop token included), the batch's mean.
            "response_len": metrics["response_lengths"],
            # Token slots the packed loss step ran on / the real tokens it needed (a recipe
            # without the metric reports none).
            "slots_per_token": metrics.get("loss_step_slots_per_token"),
        })

    sync(device)
    start = time.perf_counter()
    recipe.train(on_step=on_step)
    recipe.cleanup()
    return {"steps": steps, "whole_run_s": step_ends[-1] - start,
            "policy_params": sum(p.numel() for p in recipe._policy_model.parameters())}

"""Our recipe's row: built from the config, run through ``train(on_step=...)``, metrics read back."""

import time
from typing import Any, Callable, Dict

from .device import sync


class OursRow:
    """Our recipe, set up from ``cfg_dict``; ``run(on_step)`` trains, one callback a step.

    Driven through the recipe's public seams only: ``PPOFullFinetuneRecipe(cfg)``,
    ``setup(cfg)``, ``train(on_step=...)`` with its metrics dict, ``cleanup()``.

    Args:
        cfg_dict (Dict[str, Any]): a resolved recipe config with a full ``compile`` block.
    """

    def __init__(self, cfg_dict: Dict[str, Any]):
        from omegaconf import OmegaConf
        from ppo_full_finetune import PPOFullFinetuneRecipe

        from torchtune_ppo.config import validate_config

        self.cfg = validate_config(OmegaConf.create(cfg_dict))
        self.recipe = PPOFullFinetuneRecipe(cfg=self.cfg)
        self.recipe.setup(cfg=self.cfg)
        self.info: Dict[str, Any] = {}

    def run(self, on_step: Callable[[Dict[str, Any]], None]) -> None:
        """Trains; after each step calls ``on_step`` with that step's times (see ``ppo_bench.rows``)."""
        from torchtune_ppo.compile import compile_count

        # max_prompt_len: null means the dataset's longest prompt, which setup() resolved.
        device, prompt_len = self.cfg.device, self.cfg.max_prompt_len or self.recipe._prompt_len
        graphs_before = compile_count()

        def step_end(step: int, metrics: Dict[str, float]) -> None:
            sync(device)
            on_step({
                "step": step,
                "step_s": metrics["time/step"],
                "generate": metrics["time/generate"],
                # compile.rollout times steps 1-6 as one region, reported as generate.
                "score": metrics.get("time/score", 0.0),
                "advantages": metrics["time/advantages"],
                "loss_step": metrics["time/loss_step"],
                "optimizer": metrics["time/optimizer"],
                # Every batch is left-padded to max_prompt_len: one static shape.
                "prompt_len": prompt_len,
                "recompiles": int(metrics["recompiles"]),
                "graphs": compile_count() - graphs_before,
                # Valid response tokens per row (stop token included), the batch's mean.
                "response_len": metrics["response_lengths"],
                # the batch's longest response: what its generation call decoded up to
                "longest_response": metrics.get("response_lengths_max"),
                # Token slots the packed loss step ran on / the real tokens it needed (a recipe
                # without the metric reports none).
                "slots_per_token": metrics.get("loss_step_slots_per_token"),
                "end": time.perf_counter(),
            })

        self.recipe.train(on_step=step_end)

    def finish(self) -> Dict[str, Any]:
        """Cleans up; returns ``policy_params``, the parameters of the policy it trained."""
        self.recipe.cleanup()
        return {"policy_params": policy_params(self.cfg.policy_model)}


def policy_params(model_cfg) -> int:
    """Parameters of the policy the config builds, counted on the meta device.

    The recipe's model is not public; the checkpointer refuses a checkpoint whose shapes differ
    from the built model's, so this is also the count of what the recipe loaded.
    """
    import torch
    from torchtune import config

    with torch.device("meta"):
        model = config.instantiate(model_cfg)
    return sum(p.numel() for p in model.parameters())

"""torchtune's rows: its ``ppo_full_finetune_single_device`` recipe, timed from outside.

torchtune's recipe has no per-step callback, so a subclass times it through the recipe's own
public methods: ``generate_trajectory_batched`` (steps 1-6), ``ppo_step`` (forward, loss and
backward of one micro-batch), ``log_metrics`` (the end of a step's work),
``cleanup_after_step`` (the end of a step, for the whole run) and ``save_checkpoint``
(skipped); plus two seams that are not module globals: the ``cache_ctx_manager`` instance
attribute, whose ``with`` block holds nothing but ``generation.generate``, and the optimizer's
public step hooks. No torchtune module global is patched. Written against torchtune 0.6.1.

It runs one step at a time for an interleaved driver without changing what it computes: the
end of ``cleanup_after_step``, a step's last call, hands the step to ``bench.on_step``, which
may block until the driver wants the next step (or raise to end the run).
"""

import contextlib
import runpy
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .device import sync


class _StepTimes:
    """Seconds of each phase of the open PPO step, and the steps closed so far."""

    def __init__(self, device: str):
        self.device = device
        self.steps: List[Dict[str, float]] = []
        self.current: Optional[Dict[str, float]] = None
        # train() began, the open step began, its trajectory ended, the last step ended.
        self.start = self.step_start = self.trajectory_end = self.last_step_end = 0.0
        self.graphs_before = self.graphs_after_step1 = 0
        self.trajectory = None  # the open step's trajectory, read once the step has ended
        self.pad_id = 0
        self.on_step = None  # called with each closed step's dict at the step's very end

    def now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        # Calls outside a step (none in torchtune 0.6.1) are not part of any step.
        if self.current is not None:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, phase: str):
        start = self.now()
        try:
            yield
        finally:
            self.add(phase, self.now() - start)


def load_torchtune_recipe() -> type:
    """torchtune's PPO recipe class, loaded from the ``recipes`` folder its wheel installs."""
    import torchtune

    path = Path(torchtune.__file__).parents[1] / "recipes/ppo_full_finetune_single_device.py"
    return runpy.run_path(str(path))["PPOFullFinetuneRecipeSingleDevice"]


def timed_recipe_class(base: type) -> type:
    """A subclass of torchtune's recipe class ``base`` that times each PPO step's phases."""
    from torchtune_ppo.compile import compile_count

    class TimedPPORecipe(base):
        """torchtune's recipe; ``self.bench.steps`` holds one dict of times per PPO step."""

        def setup(self, cfg) -> None:
            """torchtune's setup, then the timed KV-cache context and optimizer hooks."""
            super().setup(cfg)
            self.bench = _StepTimes(cfg.device)
            self.bench.pad_id = self._tokenizer.pad_id
            make_cache_ctx = self.cache_ctx_manager

            # The body of this `with` in generate_trajectory is the generation.generate call
            # alone: timing the block times generation (KV-cache set-up and teardown included)
            # without swapping the recipe module's `generation` global for a timed proxy.
            @contextlib.contextmanager
            def timed_cache_ctx(*args, **kwargs):
                with self.bench.timed("generate"), make_cache_ctx(*args, **kwargs) as ctx:
                    yield ctx

            self.cache_ctx_manager = timed_cache_ctx
            # _optimizer has no public name (nor have _tokenizer above and _policy_model, read
            # for its size): torchtune 0.6.1 is frozen. Its step hooks are torch's public way
            # to time optimizer.step() without wrapping it.
            # zero_grad(set_to_none=True) has no hook; it only drops references (other).
            starts = {}
            self._optimizer.register_step_pre_hook(lambda *_: starts.update(t=self.bench.now()))
            self._optimizer.register_step_post_hook(
                lambda *_: self.bench.add("optimizer", self.bench.now() - starts["t"])
            )

        def train(self) -> None:
            """torchtune's training loop, with the whole run's start marked."""
            self.bench.graphs_before = compile_count()
            self.bench.start = self.bench.now()
            super().train()

        def generate_trajectory_batched(self, input_ids):
            """Opens a step and times its trajectory (steps 1-6)."""
            bench = self.bench
            bench.step_start = bench.now()
            bench.current = {"prompt_len": input_ids.shape[1], "generate": 0.0,
                             "loss_step": 0.0, "optimizer": 0.0}
            trajectory = super().generate_trajectory_batched(input_ids)
            bench.trajectory_end = bench.now()
            # Steps 1-6: generation, then scoring (logprobs, values, rewards, masks).
            bench.current["trajectory"] = bench.trajectory_end - bench.step_start
            bench.trajectory = trajectory
            return trajectory

        def ppo_step(self, *args, **kwargs):
            """Times one micro-batch's forward, loss and backward (and, once, the advantages)."""
            step = self.bench.current
            if "advantages" not in step:
                # train() runs get_rewards_ppo and estimate_advantages between the trajectory
                # and the first ppo_step (besides a randperm and one micro-batch's gather):
                # timing the gap leaves torchtune's `rlhf` module global alone.
                step["advantages"] = self.bench.now() - self.bench.trajectory_end
            with self.bench.timed("loss_step"):
                return super().ppo_step(*args, **kwargs)

        def log_metrics(self, *args, **kwargs) -> None:
            """Closes the step: as in our recipe's ``time/step``, metrics fall outside it."""
            self._end_step()
            super().log_metrics(*args, **kwargs)

        def cleanup_after_step(self, *args, **kwargs) -> None:
            """Closes the step if ``log_metrics`` did not, and marks the end of the run so far."""
            super().cleanup_after_step(*args, **kwargs)
            if self.bench.current is not None:  # log_metrics skips steps off log_every_n_steps
                self._end_step()
            self.bench.last_step_end = self.bench.now()
            if self.bench.on_step is not None:
                # The step's last call: an interleaved driver's callback waits here for its turn.
                self.bench.on_step(dict(self.bench.steps[-1], end=self.bench.last_step_end))

        def save_checkpoint(self, *args, **kwargs) -> None:
            """Skipped: writing weights is no part of a PPO step (ours saves after its steps)."""

        def _end_step(self) -> None:
            bench, step = self.bench, self.bench.current
            step["step_s"] = bench.now() - bench.step_start
            step["score"] = step.pop("trajectory") - step["generate"]
            graphs = compile_count()
            if not bench.steps:
                bench.graphs_after_step1 = graphs
            step["recompiles"] = graphs - bench.graphs_after_step1
            step["graphs"] = graphs - bench.graphs_before
            step["step"] = len(bench.steps) + 1
            step.update(token_counts(bench.trajectory, bench.pad_id))
            bench.steps.append(step)
            bench.current = bench.trajectory = None

    return TimedPPORecipe


def token_counts(trajectory, pad_id: int) -> Dict[str, float]:
    """The batch's mean response length and its loss step's slots per real token.

    Counted as our recipe counts them, after the step's clock has stopped. A real token is one
    the loss step needs as input: the prompt's tokens and the response's up to its last valid
    token, less that last one (``prompt_len + span - 1`` a row). torchtune's ``ppo_step`` runs
    every micro-batch as rows of the whole trajectory width (``P' + T``, padding included),
    and every PPO epoch covers each row once: slots per real token is
    ``rows * (P' + T) / real tokens``, whatever the epochs and minibatches.

    Args:
        trajectory: torchtune's ``Trajectory`` of the step (left-padded prompts of width P').
        pad_id (int): the tokenizer's padding id (the prompts' left padding).

    Returns:
        Dict[str, float]: ``response_len`` (valid response tokens per row, stop token
        included, the batch's mean), ``longest_response`` (the batch's longest) and
        ``slots_per_token``.
    """
    import torch

    rows, width = trajectory.query_responses.shape
    valid = ~trajectory.response_padding_masks  # [rows, T]
    context = width - valid.shape[1]
    prompt_lens = (trajectory.query_responses[:, :context] != pad_id).sum(-1)
    spans = (valid * torch.arange(1, valid.shape[1] + 1, device=valid.device)).amax(-1)
    real = int((prompt_lens + spans - 1)[spans > 0].sum())
    return {"response_len": float(valid.sum(-1).float().mean()),
            "longest_response": float(valid.sum(-1).max()),
            "slots_per_token": rows * width / real if real else float("nan")}


class TorchtuneRow:
    """torchtune's recipe, set up from ``cfg_dict``; ``run(on_step)`` trains, one callback a step.

    Args:
        cfg_dict (Dict[str, Any]): a resolved ``ppo_full_finetune_single_device`` config.
    """

    def __init__(self, cfg_dict: Dict[str, Any]):
        from omegaconf import OmegaConf

        cfg = OmegaConf.create(cfg_dict)
        self.recipe = timed_recipe_class(load_torchtune_recipe())(cfg=cfg)
        self.recipe.setup(cfg=cfg)
        self.info: Dict[str, Any] = {}

    def run(self, on_step) -> None:
        """torchtune's own ``train()``; ``on_step`` gets each step's dict (see ``ppo_bench.rows``)
        at the end of its ``cleanup_after_step``."""
        self.recipe.bench.on_step = on_step
        self.recipe.train()

    def finish(self) -> Dict[str, Any]:
        """Cleans up; returns ``policy_params``, the parameters of the policy it trained."""
        self.recipe.cleanup()
        # torchtune's recipe has no public name for its model (torchtune 0.6.1 is frozen).
        return {"policy_params": sum(p.numel() for p in self.recipe._policy_model.parameters())}

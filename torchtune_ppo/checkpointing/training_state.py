"""The training state of a run, saved beside the weights in every checkpoint and restored on
resume: optimizer (by parameter name when sharded), LR scheduler, progress counters, skipped
steps, and every random state (each rank's own under torchrun).

:class:`CheckpointClient` is what the recipe calls: it takes the models, the optimizer and the
progress, and hides gathering sharded weights and optimizer state, which rank writes, and how
a state saved on another number of processes is taken apart.
"""

import copy
import os
import random
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import torch
from torch import nn
from torchtune import utils

from torchtune_ppo import distributed, lora
import torchtune_ppo.checkpointing.sharded as sharded
import torchtune_ppo.checkpointing.store as store
from torchtune_ppo.checkpointing.store import CheckpointManager, load_training_state, write_evaluation

log = utils.get_logger("INFO")

PROGRESS_KEYS = ("steps_run", "epochs_run", "batches_run_in_epoch")  # and "value_pretrain" when given


def capture_rng_state(generators: Sequence[torch.Generator] = ()) -> Dict[str, Any]:
    """Every random state a run draws from, for ``training_state``.

    Args:
        generators (Sequence[torch.Generator]): the run's own generators (e.g. the sampling
            generator), in an order :func:`restore_rng_state` will be given again.

    Returns:
        Dict[str, Any]: torch's global CPU state, CUDA states of all devices (when CUDA is
        available), Python ``random``'s state and each generator's state.
    """
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Sequence[torch.Generator] = ()) -> None:
    """Restore what :func:`capture_rng_state` returned, so the next draws repeat.

    Args:
        state (Mapping[str, Any]): from :func:`capture_rng_state` (possibly via torch.load).
        generators (Sequence[torch.Generator]): the same generators, in the same order.

    Raises:
        ValueError: the number of generators differs from the captured one.
    """
    if len(generators) != len(state["generators"]):
        raise ValueError(
            f"RNG state holds {len(state['generators'])} generators, {len(generators)} given"
        )
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
    cuda = state.get("cuda")
    if cuda is not None:
        if torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            log.warning(f"CUDA RNG states of {len(cuda)} devices not restored: {count} devices here")


def _as_tuple(x: Any) -> Any:
    # random.setstate needs tuples; a state that went through JSON or a list-converting
    # serializer comes back as lists.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class CheckpointClient:
    """Saves and restores a run's weights and training state through a :class:`CheckpointManager`.

    Args:
        manager (CheckpointManager): writes the step folders (rank 0 only).
        models (Mapping[str, nn.Module]): the trained models by name (``policy``, and ``value``
            unless the run is critic-free), sharded or not.
        optimizer (Any): over the models' parameters, in the order of ``models``.
        lr_scheduler (Optional[Any]): saved and restored with it.
        skipped_steps (Any): has ``state_dict`` / ``load_state_dict`` (:class:`~torchtune_ppo.run.guards.SkippedSteps`).
        generators (Sequence[torch.Generator]): the run's own random streams.
        run_config (Optional[Mapping[str, Any]]): the run's resolved config, saved as
            ``config.yaml`` in every checkpoint (see :mod:`.resume_config`).
        kl_controller (Optional[Any]): the adaptive KL coefficient (``state_dict`` /
            ``load_state_dict``), saved and restored with the rest.
        merge_adapters_at_end (bool): a LoRA model's save with ``final=True`` also writes its
            merged full weights (else only its adapters, as every other save).
        master_weights (Optional[Any]): fp32 masters of bf16 weights (``state_dict`` /
            ``load_state_dict``, :class:`~torchtune_ppo.run.optim.MasterWeights`), saved and
            restored with the rest, so a resume continues from the same fp32 weights.
        speculation (Optional[Any]): speculative rollouts' draft store (``state_dict`` /
            ``load_state_dict``, :class:`~torchtune_ppo.rollout.speculative.Speculation`): each
            rank's own, restored on the same number of ranks. Drafts never change what is sampled,
            only which forward computes it (and so the last bits of its logprobs): without them a
            resume is as exact as it is with them up to that rounding.
        checkpoint_format (str): ``full``: weights gathered and written by rank 0 in HF format;
            ``sharded``: every rank writes its own shards (:mod:`.sharded`).
        async_save (bool): sharded saves staged and written in the background (:class:`.sharded.ShardWriter`).
    """

    def __init__(self, manager: CheckpointManager, models: Mapping[str, nn.Module], optimizer: Any,
                 lr_scheduler: Optional[Any], skipped_steps: Any, generators: Sequence[torch.Generator],
                 run_config: Optional[Mapping[str, Any]] = None, kl_controller: Optional[Any] = None,
                 merge_adapters_at_end: bool = True, master_weights: Optional[Any] = None,
                 speculation: Optional[Any] = None, checkpoint_format: str = "full",
                 async_save: bool = False) -> None:
        if checkpoint_format not in sharded.FORMATS or (async_save and checkpoint_format != "sharded"):
            raise ValueError(f"checkpoint_format must be one of {sharded.FORMATS} (async_save with sharded only), "
                             f"got {checkpoint_format!r} with async_save={async_save}")
        self.manager, self.models = manager, dict(models)
        self.shards = sharded.ShardWriter(async_save) if checkpoint_format == "sharded" else None
        # a sharded save's ranks write into one temporary folder, named by rank 0's pid
        self._pid = distributed.all_gather_objects(os.getpid())[0] if distributed.world_size() > 1 else os.getpid()
        self.speculation = speculation
        self.master_weights = master_weights
        self.merge_adapters_at_end = merge_adapters_at_end
        self.kl_controller = kl_controller
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.skipped_steps, self.generators = skipped_steps, list(generators)
        self.run_config = run_config

    def capture_rng(self) -> Dict[str, Any]:
        """This rank's random states now (for :meth:`save` after a step that failed midway)."""
        return capture_rng_state(self.generators)

    def save(self, step: int, progress: Mapping[str, int], rng: Optional[Mapping[str, Any]] = None,
             final: bool = False) -> str:
        """Writes ``step_<step>`` atomically: the models in HF format and the training state.
        Every rank must call it (the weights are gathered collectively; rank 0 writes them).
        ``rng`` replaces the random states of now (e.g. those from before a failed step).
        A LoRA model is saved as its adapters (PEFT layout); with ``final`` (the run's last save)
        also as merged full weights, unless ``merge_adapters_at_end`` is off."""
        world = distributed.world_size()
        state = {
            # On W ranks: keyed by parameter name with full tensors, so any W can resume it.
            # Sharded: its settings here, its tensors in the shards.
            "optimizer": sharded.optimizer_settings(self.models, self.optimizer) if self.shards is not None
            else self.optimizer.state_dict() if world == 1
            else distributed.full_optimizer_state_dict(self.models, self.optimizer),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            **{k: progress[k] for k in PROGRESS_KEYS},
            # value pretraining's steps, loss record and whether it is over (plain data)
            **({"value_pretrain": dict(progress["value_pretrain"])} if "value_pretrain" in progress else {}),
            # what identifies the data (files, sizes, sha256, rows): a resume over other data is refused
            **({"data_identity": progress["data_identity"]} if progress.get("data_identity") is not None else {}),
            # every evaluation's metrics, the best step and value, evaluations since the best
            **({"evaluation": progress["evaluation"]} if progress.get("evaluation") is not None else {}),
            "skipped_steps": self.skipped_steps.state_dict(),
            **({} if self.kl_controller is None else {"kl_controller": self.kl_controller.state_dict()}),
            **({} if self.master_weights is None or self.shards is not None
               else {"master_weights": self.master_weights.state_dict()}),
            "rng": dict(rng) if rng is not None else capture_rng_state(self.generators),
        }
        if world > 1:  # resumed on the same number of ranks, each gets its own back
            state["rng_per_rank"] = distributed.all_gather_objects(state["rng"])
        if self.speculation is not None:  # each rank's drafts, its own prompts'
            drafts = self.speculation.state_dict()
            state["speculative_per_rank"] = distributed.all_gather_objects(drafts) if world > 1 else [drafts]
        # The random states in "rng" are rank 0's: a resume on another number of ranks draws
        # different samples.
        if self.shards is not None:
            return self._save_sharded(step, state, blocking=final or rng is not None)
        adapters = {name: (lora.adapter_state_dict(m), lora.peft_adapter_config(m), lora.head_state_dict(m))
                    for name, m in self.models.items() if lora.has_adapters(m)}
        merge = final and self.merge_adapters_at_end
        # Merged on rank 0, from the whole tensors gathered from FSDP2's shards (fresh copies).
        weights = {name: (lora.merged_state_dict(m, distributed.full_state_dict(m) if world > 1 else None)
                          if merge else None)
                   if name in adapters else distributed.full_state_dict(m) for name, m in self.models.items()}
        if distributed.rank() == 0:
            extra = {"adapters": adapters} if adapters else {}
            self.manager.save(step, weights["policy"], weights.get("value"), state, self.run_config, **extra)
        distributed.barrier()
        return str(self.manager.root / f"step_{int(step)}")

    def _save_sharded(self, step: int, state: Dict[str, Any], blocking: bool) -> str:
        """Every rank writes its shards; rank 0 then the rest and the marker. ``blocking``: on disk
        before returning (a stop, a failure, the last step), else in the background with async_save."""
        masters = None if self.master_weights is None else self.master_weights.masters
        shards = sharded.shard_state(self.models, self.optimizer, masters)
        tmp = self.manager.root / f".tmp_step_{int(step)}_{self._pid}"
        complete = lambda: None  # noqa: E731
        if distributed.rank() == 0:
            self.shards.wait()  # the save in flight completes (and prunes) before the next begins
            tmp = self.manager.prepare(step, self._pid)
            state = copy.deepcopy(state)  # the steps that follow change the lists and dicts in it
            def complete():  # once every rank's shards are written (in the background with async_save)
                store._maybe_crash("after_shards", step)  # test hook: a kill between the shards and the rest
                self.manager.complete(step, tmp, state, self.run_config, fmt="sharded")
        distributed.barrier()  # the folder exists before any rank writes into it
        self.shards.save(tmp, shards, complete, blocking=blocking)
        if blocking:
            distributed.barrier()
        blocked = self.shards.last_blocked_s
        if distributed.rank() == 0:
            log.info(f"Step {step}: the save held the step {blocked:.2f} s"
                     + ("" if blocking or not self.shards.async_save else " (written in the background)"))
        return str(self.manager.root / f"step_{int(step)}")

    def close(self) -> None:
        """Finishes a save in flight (``async_save``); every rank must call it."""
        if self.shards is not None:
            self.shards.close()
            distributed.barrier()

    def record_evaluation(self, step: int, evaluation: Mapping[str, Any]) -> None:
        """Adds to the saved ``step_<step>`` the evaluations' record after that step's evaluation,
        which ran after the save (:func:`~torchtune_ppo.checkpointing.store.write_evaluation`);
        rank 0 writes it."""
        if distributed.rank() == 0:
            write_evaluation(self.manager.root / f"step_{int(step)}", evaluation)

    def load(self, checkpoint: str) -> Dict[str, Any]:
        """Restores the optimizer, scheduler and skipped steps from ``checkpoint``; returns the
        progress counters, ``value_pretrain`` (None in a checkpoint from before value pretraining),
        ``evaluation`` (None without evaluations) and ``rng``, this rank's random state to restore
        once the data iterator is back in place (None when saved on another number of ranks)."""
        state = load_training_state(checkpoint)
        world = distributed.world_size()
        if state["optimizer"].get("format") == "sharded":  # weights, optimizer and masters from the shards
            sharded.load_shards(Path(checkpoint), self.models, self.optimizer, state["optimizer"],
                                None if self.master_weights is None else self.master_weights.masters)
            if self.master_weights is not None:
                self.master_weights.write_back()
        elif world == 1 and not distributed.keyed_by_name(state["optimizer"]):
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # saved or loaded on several ranks: a full state keyed by parameter name
            distributed.load_full_optimizer_state_dict(self.models, self.optimizer, state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.skipped_steps.load_state_dict(state["skipped_steps"])
        if self.kl_controller is not None and "kl_controller" in state:  # older checkpoints: the config's
            self.kl_controller.load_state_dict(state["kl_controller"])
        if self.master_weights is not None and state["optimizer"].get("format") != "sharded":
            if "master_weights" not in state:
                raise ValueError(f"{checkpoint} holds no fp32 master weights (saved with master_weights=False, "
                                 "dtype=fp32, or on several processes, whose masters are their fp32 weights): resume "
                                 "it with the settings and process count it was saved with; a checkpoint_format=sharded "
                                 "one resumes on any number of processes.")
            self.master_weights.load_state_dict(state["master_weights"])
        elif "master_weights" in state and world > 1 and state["optimizer"].get("format") != "sharded":
            distributed.load_full_masters(self.models, state["master_weights"]["masters"])  # into the fp32 shards
        drafts = state.get("speculative_per_rank") or []
        if self.speculation is not None and len(drafts) == world:
            self.speculation.load_state_dict(drafts[distributed.rank()])
        elif self.speculation is not None and distributed.rank() == 0:
            log.info(f"{checkpoint} holds no speculative drafts for {world} process(es): the drafts start empty "
                     "(what is sampled is unchanged).")
        rng = state["rng"]
        if world > 1:
            per_rank = state.get("rng_per_rank") or []
            rng = per_rank[distributed.rank()] if len(per_rank) == world else None
            if rng is None and distributed.rank() == 0:
                log.warning(f"{checkpoint} was saved on {len(per_rank) or 1} process(es), not "
                            f"{world}: the random states start afresh.")
        return {**{k: state[k] for k in PROGRESS_KEYS}, "value_pretrain": state.get("value_pretrain"),
                "evaluation": state.get("evaluation"), "rng": rng}

    def restore_rng(self, rng: Mapping[str, Any]) -> None:
        """Puts back a random state that :meth:`load` returned."""
        restore_rng_state(rng, self.generators)

    pending_rng: Optional[Mapping[str, Any]] = None  # a resumed run's random states, not yet put back

    def restore_pending_rng(self) -> None:
        """Puts back ``pending_rng`` (the ``rng`` that :meth:`load` returned), once; then nothing.

        The recipe puts them back where the uninterrupted run was when they were captured: after
        the data iterator of the epoch was created (its creation draws from torch's global
        generator), or, for a checkpoint of step 0 (a run stopped before its first step, during
        the evaluation before training), before it."""
        if self.pending_rng is not None:
            self.restore_rng(self.pending_rng)
            self.pending_rng = None

"""Every check a run makes against the world before any weights load: :func:`preflight`.

:func:`~torchtune_ppo.config.checks.validate_config` has checked the config on its own (keys,
values, the rules between keys, the models built on the meta device). What is left needs the
world outside the config, and is checked here, in this order, so that a bad run stops in
seconds with a message that names the key or file:

1. the processes: the global batch sizes split over them;
2. the output folder: a fresh run must not overwrite a run's checkpoints, a resume must find
   one and its saved config must agree with the new one on every key its state depends on;
   the folder must be writable;
3. the tokenizer, against the pad and stop tokens;
4. the data: every prompt read, tokenized and checked, ``P`` fixed (the longest prompt when
   ``max_prompt_len`` is null) and the sequence length checked against the models; what
   identifies the data (each local file's size and sha256, the row count) recorded for the
   checkpoints, and on resume compared with what the checkpoint recorded; the evaluation's
   prompts read and checked the same way (``eval``);
5. the memory plan: the run must fit the device.
"""

from typing import Any, Dict, NamedTuple, Optional

from omegaconf import DictConfig
from torchtune import config as tt_config

from torchtune_ppo import checkpointing
from torchtune_ppo.config.batches import check_world_size
from torchtune_ppo.config.data_files import instantiate_dataset, validate_dataset
from torchtune_ppo.config.generation import validate_with_tokenizer, warn_unknown_tokens
from torchtune_ppo.config.machine import omp_num_threads
from torchtune_ppo.config.precision import native_bf16
from torchtune_ppo.config.weights import check_sequence_length
from torchtune_ppo.data.identity import check_resumed_data, data_identity
from torchtune_ppo.eval.data import eval_prompts
from torchtune_ppo.run.memory import check_plan


class Preflight(NamedTuple):
    """What the checks built on the way, for the run to use.

    Attributes:
        resume_from (Optional[str]): the checkpoint folder to resume from; None for a fresh run.
        tokenizer (Any): the instantiated tokenizer.
        dataset (Any): the instantiated, checked prompt dataset.
        prompt_len (int): ``P``, the width every prompt is left-padded to.
        data_identity (Optional[Dict[str, Any]]): what identifies the data, for the training
            state of every checkpoint (``Progress(data_identity=...)``).
        eval_prompts (Optional[Any]): the evaluation's prompts
            (:class:`~torchtune_ppo.eval.data.EvalPrompts`); None when evaluation is off.
    """

    resume_from: Optional[str]
    tokenizer: Any
    dataset: Any
    prompt_len: int
    data_identity: Optional[Dict[str, Any]] = None
    eval_prompts: Optional[Any] = None


def preflight(cfg: DictConfig, *, world_size: int, log) -> Preflight:
    """Runs every check that needs more than the config (see the module's docstring).

    Args:
        cfg (DictConfig): the config returned by ``validate_config``.
        world_size (int): the run's processes.
        log: where notes go (``log.info``, ``log.warning``).

    Returns:
        Preflight: the resume point, tokenizer, dataset and ``P``.

    Raises:
        ValueError, FileExistsError, FileNotFoundError, RuntimeError: naming the key, file or
            folder at fault and what would be valid.
    """
    check_world_size(cfg, world_size)
    omp_num_threads()  # also on a GPU run, whose CPU work OpenMP still threads
    if cfg.dtype == "bf16" and cfg.device == "cpu" and native_bf16() is False:
        log.warning("dtype=bf16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
                    "torch emulates its products, so this run is slower than in fp32.")
    resume_from = checkpointing.checkpoint_to_resume(cfg.output_dir, cfg.resume_from_checkpoint)
    if resume_from:  # the keys the saved state depends on must match
        checkpointing.check_resume_config(resume_from, cfg)
    checkpointing.check_writable(cfg.output_dir)
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    validate_with_tokenizer(cfg, tokenizer)
    if cfg.get("env") is not None:  # the environment and how its observations become tokens
        from torchtune_ppo.envs import ObservationRenderer, check_environment

        check_environment(tt_config.instantiate(cfg.env))
        ObservationRenderer(tokenizer, template=cfg.turns.observation_template)
    dataset = instantiate_dataset(cfg.dataset, tokenizer)
    num_long = validate_dataset(dataset, cfg)
    warn_unknown_tokens(dataset, tokenizer)
    identity = data_identity(cfg.dataset, dataset)  # each local file hashed once, here
    if resume_from:
        check_data_unchanged(resume_from, identity, cfg, log)
    prompt_len = cfg.max_prompt_len
    if prompt_len is None:
        prompt_len = max(len(dataset[i]["tokens"]) for i in range(len(dataset)))
        check_sequence_length(cfg, prompt_len)
        log.info(f"max_prompt_len: null, so P = {prompt_len}, the longest prompt.")
    if num_long:
        log.info(f"{num_long} of {len(dataset)} prompts are longer than max_prompt_len="
                 f"{prompt_len}; their last {prompt_len} tokens are kept.")
    evaluation = eval_prompts(cfg, tokenizer, log) if cfg.eval.every_n_steps is not None else None
    check_plan(cfg, prompt_len, log, eval_prompt_len=evaluation[0].prompt_len if evaluation else None)
    return Preflight(resume_from, tokenizer, dataset, prompt_len, identity, evaluation)


def check_data_unchanged(resume_from: str, identity: Dict[str, Any], cfg: DictConfig, log) -> None:
    """Refuses a resume whose data differ from the checkpoint's (see
    :func:`~torchtune_ppo.data.identity.check_resumed_data`); ``resume_accept_data_change``
    makes it a warning. A checkpoint that recorded no identity resumes with a note."""
    state = checkpointing.load_training_state(resume_from, mmap=True)  # no read of the optimizer state
    position = f"epoch {int(state['epochs_run']) + 1}, {int(state['batches_run_in_epoch'])} batches in"
    saved = state.get("data_identity")
    del state  # the optimizer state in it is loaded again, where the run restores it
    check_resumed_data(saved, identity, checkpoint=str(resume_from), position=position,
                       accept=cfg.resume_accept_data_change, log=log)

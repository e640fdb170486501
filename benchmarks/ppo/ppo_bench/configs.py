"""The configs every row shares: ours from the YAML, torchtune's translated from ours."""

import argparse
from pathlib import Path
from typing import Any, Dict, Optional


def ours_config(args: argparse.Namespace, output_dir: Path, dtype: Optional[str] = None) -> Dict[str, Any]:
    """Our recipe's config for the benchmark, resolved to plain values.

    Args:
        args (argparse.Namespace): the parsed command line (config, ``--set`` overrides,
            sizes, device, dtype).
        output_dir (Path): where the row may write (logs, the final checkpoint).
        dtype (Optional[str]): the row's own dtype (``<row>@bf16``); None: ``args.dtype``.

    Returns:
        Dict[str, Any]: the config with ``compile: False``; a row replaces the block.
    """
    from omegaconf import OmegaConf

    import torchtune_ppo  # noqa: F401  registers the ${ppo_asset:...} resolver

    cfg = OmegaConf.load(args.config)
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(args.set)))
    sizes = {
        "output_dir": str(output_dir),
        # The most steps the interleaved driver may ask for; it stops the row sooner once the
        # ratios are narrow. A step does not depend on the count: the shipped configs have no
        # lr_scheduler (one set with --set would take its length from it).
        "num_ppo_steps": args.warmup + args.max_steps,
        "batch_size": args.batch_size,
        "forward_batch_size": args.forward_batch_size,
        "ppo_batch_size": args.ppo_batch_size,
        "ppo_epochs": args.ppo_epochs,
        "gradient_accumulation_steps": 1,
        "device": args.device,
        "dtype": dtype or args.dtype,
        "seed": 0,
        # torchtune's recipe clips nothing: both do the same optimizer work.
        "clip_grad_norm": None,
        "save_every_n_steps": None,
        "log_every_n_steps": 1,
        "compile": False,
        # no evaluation: the rows time PPO steps (and a workload's data may have no held-out split)
        "eval": {"every_n_steps": None, "before_training": False},
    }
    if args.max_prompt_len:
        sizes["max_prompt_len"] = args.max_prompt_len
    if args.max_generated_tokens:
        sizes["max_generated_tokens"] = args.max_generated_tokens
    cfg = OmegaConf.merge(cfg, sizes)
    if cfg.get("top_p") is not None:
        raise SystemExit("top_p is set, but torchtune's recipe has no top_p: the rows would differ.")
    return OmegaConf.to_container(cfg, resolve=True)


def torchtune_config(ours: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """The same run as a ``ppo_full_finetune_single_device`` config.

    Args:
        ours (Dict[str, Any]): our resolved config (``ours_config``).
        args (argparse.Namespace): the parsed command line (step counts, batch size).

    Returns:
        Dict[str, Any]: torchtune's config, eager without KV cache; a row sets ``compile``
        and ``enable_kv_cache``.
    """
    same = (
        "output_dir tokenizer dataset policy_model reward_and_value_model checkpointer "
        "ref_policy_checkpointer value_checkpointer reward_checkpointer seed shuffle device dtype "
        "batch_size forward_batch_size ppo_epochs ppo_batch_size gradient_accumulation_steps "
        "optimizer max_generated_tokens temperature top_k stop_token_ids penalise_no_eos "
        "min_response_length reward_penalty kl_coeff gamma lmbda metric_logger log_every_n_steps"
    ).split()
    from torchtune_ppo.config.schema import defaults

    # Keys a config leaves out take our default, which the row then states to torchtune too.
    cfg = {k: ours[k] if k in ours else defaults()[k] for k in same}
    if cfg["dataset"].get("_component_") == "torchtune_ppo.data.prompt_dataset":
        # Ours yields each prompt's reference answer too (for function rewards); torchtune's
        # collate would try to tensorize it.
        cfg["dataset"] = {**cfg["dataset"], "_component_": "ppo_bench.configs.tokens_only_prompt_dataset"}
    if cfg["metric_logger"] is None:  # ours then logs to <output_dir>/logs; torchtune's needs one
        cfg["metric_logger"] = {"_component_": "torchtune.training.metric_logging.DiskLogger",
                                "log_dir": f"{ours['output_dir']}/logs"}
    loss = ours.get("loss") or {}
    cfg.update(
        num_steps=(args.warmup + args.max_steps) * args.batch_size,  # torchtune counts samples
        loss={
            "_component_": "torchtune.rlhf.loss.PPOLoss",
            "epsilon": loss.get("epsilon", 0.2),
            "value_clip_range": loss.get("value_clip_range", 0.2),
            "value_coeff": loss.get("value_coeff", 0.1),
        },
        resume_from_checkpoint=False,
        optimizer_in_bwd=False,
        enable_activation_checkpointing=False,
        whiten_rewards=False,
        log_peak_memory_stats=False,
        compile=False,
        enable_kv_cache=False,
    )
    return cfg


class _TokensOnly:
    """A prompt dataset's items as torchtune's datasets give them: tokens and labels (a copy,
    unused by its PPO recipe but padded by its collate), no reference answer."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        tokens = self.dataset[index]["tokens"]
        return {"tokens": tokens, "labels": list(tokens)}


def tokens_only_prompt_dataset(tokenizer, **kwargs) -> _TokensOnly:
    """``torchtune_ppo.data.prompt_dataset`` for torchtune's recipe: tokens only."""
    from torchtune_ppo.data import prompt_dataset

    return _TokensOnly(prompt_dataset(tokenizer, **kwargs))

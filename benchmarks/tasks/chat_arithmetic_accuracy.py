"""Held-out accuracy of SmolLM2-135M-Instruct on the chat arithmetic task: the prepared model,
or a policy a run saved.

    python benchmarks/tasks/chat_arithmetic_accuracy.py                                # the prepared model
    python benchmarks/tasks/chat_arithmetic_accuracy.py <output_dir>/checkpoints/step_60/policy
    python benchmarks/tasks/chat_arithmetic_accuracy.py --split ood                    # the out-of-distribution set

Greedy answers to one evaluation set of the run's config (``--split``: ``heldout``, the 200
held-out questions never trained on, by default; ``ood``, the 200 questions asked in other
phrasings with no reply prefix; any name of its ``eval.datasets``), each prompt rendered as that
set's dataset block renders it (chat template, system prompt, reply prefix), with the config
the policy was trained with: the ``config.yaml`` saved beside a checkpoint's ``policy/`` folder,
else ``--config``, else the shipped full config. The model is the config's ``policy_model`` with
the folder's weights, generated from by the recipe's ``Generator`` for ``--max-tokens`` tokens
(default: the evaluation's), the prompts left-padded as the run's evaluation pads them. A
response is correct when its score reaches ``eval.correct_threshold``: the config's reward
(``ExactMatch`` on the last number here) of the text before the first stop token, with the
run's penalties (``penalise_no_eos``, ``min_response_length``). So on the run's own settings the
accuracy is the run's greedy ``val/pass@1`` (``val/<split>/pass@1``) at that step (tested on a
tiny model). Prints one JSON line: the accuracy, the count of responses cut off by
``--max-tokens`` before a stop token (``no_stop_token``), and a few samples.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune.training import MODEL_KEY, FullModelHFCheckpointer

import torchtune_ppo  # noqa: F401  registers the config resolvers (${ppo_asset:...})
from torchtune_ppo.config.data_files import instantiate_dataset
from torchtune_ppo.data import left_pad_prompts
from torchtune_ppo.eval.data import default_eval_dataset
from torchtune_ppo.rollout.generation import Generator

CONFIG = Path(__file__).resolve().parents[2] / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml"
PREPARED = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR", "~/.cache/torchtune_ppo/SmolLM2-135M-Instruct")).expanduser()
HELDOUT = "heldout"


def run_config(policy: Path, given: "str | None") -> Path:
    """The config whose prompt settings the policy was trained with: ``given``, else the
    ``config.yaml`` a run saved beside ``policy/`` (``step_<N>/config.yaml``), else the shipped one."""
    if given is not None:
        return Path(given)
    saved = policy.parent / "config.yaml"
    return saved if saved.is_file() else CONFIG


def eval_sets(cfg: DictConfig) -> Dict[str, DictConfig]:
    """The config's evaluation sets by name: ``eval.datasets`` (a null block: the dataset's
    held-out split), else ``heldout``: ``eval.dataset`` or the dataset's held-out split."""
    block = cfg.get("eval") or {}
    named = block.get("datasets")
    if named:
        return {str(name): b if b is not None else default_eval_dataset(cfg.dataset) for name, b in named.items()}
    one = block.get("dataset") or default_eval_dataset(cfg.dataset)
    return {} if one is None else {HELDOUT: one}


def load_policy(folder: Path, cfg: DictConfig) -> torch.nn.Module:
    """The config's ``policy_model`` with the full weights of ``folder`` (a LoRA builder's adapters
    stay at their start, where they add nothing: a LoRA run's merged weights are the model)."""
    # model*.safetensors: a LoRA run's folder also holds adapter_model.safetensors
    files = sorted(p.name for p in folder.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no full weights (model*.safetensors); a LoRA run writes them "
                                "at its last save (unless save_adapter_weights_only).")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = FullModelHFCheckpointer(checkpoint_dir=str(folder), checkpoint_files=files,
                                       model_type=cfg.checkpointer.model_type, output_dir=tmp)
        state_dict = ckpt.load_checkpoint()[MODEL_KEY]
    model = tt_config.instantiate(cfg.policy_model)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or any("lora_" not in k for k in missing):
        raise RuntimeError(f"the weights of {folder} do not fit policy_model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.eval()


def grade(cfg: DictConfig, policy: torch.nn.Module, tokenizer: Any, rows: List[Dict[str, Any]], *, width: int,
          max_tokens: int, batch_size: int) -> List[Dict[str, Any]]:
    """Greedy responses to ``rows`` (samples of the dataset: ``tokens``, ``reference``), each
    scored as the run's evaluation scores it: ``[{"response", "score", "correct", "stopped"}]``
    (``stopped``: the response ended on a stop token within ``max_tokens``)."""
    stops = list(cfg.stop_token_ids)
    block = cfg.get("eval") or {}
    reward_block = block.get("reward") or cfg.reward
    if reward_block is None:
        raise ValueError("the config's reward is a reward model; this script grades with a reward function.")
    reward = tt_config.instantiate(reward_block)
    threshold = float(block.get("correct_threshold", 1.0))
    gen = Generator(policy, batch_size=batch_size, max_prompt_len=width, max_generated_tokens=max_tokens,
                    pad_id=tokenizer.pad_id, stop_token_ids=stops, top_k=1)
    graded = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            batch = left_pad_prompts(chunk, max_prompt_len=width, pad_id=tokenizer.pad_id,
                                     long_prompts=cfg.get("long_prompts", "error"))
            out = gen.generate(batch["tokens"], batch["prompt_lens"])
            texts, penalised, stopped = [], [], []
            for row in out.query_responses[:, width:].tolist():
                stop = next((i for i, t in enumerate(row) if t in stops), None)
                texts.append(tokenizer.decode(row[:stop]))
                length = len(row) if stop is None else stop + 1  # the stop token counts
                stopped.append(stop is not None)
                penalised.append((cfg.get("penalise_no_eos", False) and stop is None)
                                 or (cfg.get("min_response_length") is not None
                                     and length < cfg.min_response_length))
            prompts = [tokenizer.decode(r["tokens"]) for r in chunk]
            scores = reward(prompts, texts, references=[r["reference"] for r in chunk])
            for text, score, pen, stop in zip(texts, scores, penalised, stopped):
                score = float(cfg.get("reward_penalty", 0.0)) if pen else float(score)
                graded.append({"response": text, "score": score, "correct": score >= threshold, "stopped": stop})
    return graded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policy", nargs="?", default=str(PREPARED))
    parser.add_argument("--config", default=None,
                        help="the run's config (default: the checkpoint's own config.yaml, else the shipped full config)")
    parser.add_argument("--split", default=HELDOUT,
                        help="the evaluation set: heldout (default), ood, or another name of eval.datasets")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default: eval.max_generated_tokens, else max_generated_tokens")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--response-prefix", default=None, help="default: the set's dataset block's response_prefix")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions only (eval.max_prompts)")
    parser.add_argument("--show", type=int, default=6, help="samples (question, answer, response) to print")
    args = parser.parse_args(argv)
    cfg_path = run_config(Path(args.policy), args.config)
    cfg = OmegaConf.load(cfg_path)
    sets = eval_sets(cfg)
    if args.split not in sets:
        parser.error(f"--split {args.split}: {cfg_path} evaluates {sorted(sets) or 'nothing'}")
    eval_block = cfg.get("eval") or {}
    max_tokens = args.max_tokens or eval_block.get("max_generated_tokens") or int(cfg.max_generated_tokens)
    limit = args.limit or eval_block.get("max_prompts")
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    block = sets[args.split]
    if args.response_prefix is not None:
        block = OmegaConf.merge(block, {"response_prefix": args.response_prefix})
    samples: Dict[str, List[Dict[str, Any]]] = {}
    for name, b in sets.items():  # every set: the run pads them all to one width
        dataset = instantiate_dataset(block if name == args.split else b, tokenizer)
        n = len(dataset) if limit is None else min(limit, len(dataset))
        samples[name] = [dict(dataset[i], question=dataset._data[i][b.get("column", "prompt")]) for i in range(n)]
    rows = samples[args.split]
    width = cfg.get("max_prompt_len") or max(len(r["tokens"]) for s in samples.values() for r in s)
    policy = load_policy(Path(args.policy), cfg)
    graded = grade(cfg, policy, tokenizer, rows, width=width, max_tokens=max_tokens, batch_size=args.batch_size)
    correct = sum(g["correct"] for g in graded)
    shown = [{"question": r["question"], "answer": r["reference"], "response": g["response"]}
             for r, g in zip(rows, graded)]
    print(json.dumps({"policy": args.policy, "config": str(cfg_path), "split": args.split, "problems": len(rows),
                      "max_tokens": max_tokens, "greedy_accuracy": round(correct / len(rows), 4),
                      "correct": correct, "no_stop_token": sum(not g["stopped"] for g in graded),
                      "samples": shown[:args.show]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

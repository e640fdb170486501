"""How the tiny arithmetic assets were made, and a check of them.

    python tools/tasks/build_tiny_arithmetic.py build --seed 0 [--out DIR]  # rebuild the assets
    python tools/tasks/build_tiny_arithmetic.py check [--dir DIR]           # compare, print accuracies

Assets (``torchtune_ppo/tasks/tiny_arithmetic/assets``) come the way real checkpoints come: a
SentencePiece ``tokenizer.model`` (Llama-2 conventions), a Hugging Face policy folder
(``config.json`` + ``model.safetensors``) loaded through
``torchtune.training.FullModelHFCheckpointer`` with ``model_type`` ``LLAMA2``, and
``problems.json`` with the prompts and reference answers. ``build`` without ``--out``
overwrites the shipped assets.

A build tool kept out of the installed package: the recipe needs only the builders in
``torchtune_ppo.tasks.tiny_arithmetic``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torchtune.modules import TransformerDecoder

from torchtune_ppo import asset_path
from torchtune_ppo.rewards import ExactMatch
from torchtune_ppo.tasks.tiny_arithmetic import (
    BOS_ID,
    EOS_ID,
    NORM_EPS,
    PAD_ID,
    POLICY_DIMS,
    ROPE_BASE,
    TASK,
    VOCAB_SIZE,
    tiny_policy,
    tiny_tokenizer,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402  (tools/tasks is not a package)
    NUM_THREADS,
    adamw,
    check_round_trip,
    deterministic,
    hf_config,
    load_hf,
    main as _main,
    masks_from_valid,
    n_params,
    next_token_loss,
    optimizer_step,
    padded_batch,
    save_hf,
    train_tokenizer,
    write_manifest,
)

BUILDER_VERSION = 1
ASSETS_DIR = Path(asset_path(TASK))

OPERANDS = range(100)  # a+b and a-b for a, b in 0..99: 20000 problems, answers -99..198
NUM_HELDOUT = 500  # evaluation only
NUM_TRAIN = 1000  # PPO prompts; also decide when pretraining stops. Neither is pretrained on.

# Pretraining stops at the first check where greedy accuracy on the train problems reaches
# this: a policy that is right about a third of the time leaves PPO room to improve and
# gives it both rewards to learn from. A rule rather than a step count, so that a rebuild
# with another torch lands in the same range.
STOP_ACCURACY = 0.28
EVAL_EVERY = 25
MAX_STEPS = 6000
BATCH_SIZE = 64
LR = 3e-3
WARMUP = 100

# Suggested generation settings: prompts are at most 7 tokens with BOS ("99+99="), answers
# at most 4 with EOS ("198", "-99").
MAX_PROMPT_LEN = 8
MAX_GENERATED_TOKENS = 6
SAMPLES_PER_PROBLEM = 4  # sampled accuracy averages this many draws per held-out problem

# The reward PPO uses; accuracy below is its mean over responses that end in EOS.
REWARD = ExactMatch(extract="last_number")
HF_IDS = dict(norm_eps=NORM_EPS, rope_base=ROPE_BASE, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)


# --------------------------------------------------------------------------- problems


def problems() -> List[Tuple[str, str]]:
    """Every (prompt, answer) pair, e.g. ("12+7=", "19") and ("5-12=", "-7"), in a fixed order."""
    add = [(f"{a}+{b}=", str(a + b)) for a in OPERANDS for b in OPERANDS]
    sub = [(f"{a}-{b}=", str(a - b)) for a in OPERANDS for b in OPERANDS]
    return add + sub


def split_problems(seed: int) -> Dict[str, List[Tuple[str, str]]]:
    """Disjoint "heldout", "train" (PPO prompts) and "pretrain" problems, shuffled by ``seed``."""
    all_problems = problems()
    random.Random(seed).shuffle(all_problems)
    return {
        "heldout": all_problems[:NUM_HELDOUT],
        "train": all_problems[NUM_HELDOUT : NUM_HELDOUT + NUM_TRAIN],
        "pretrain": all_problems[NUM_HELDOUT + NUM_TRAIN :],
    }


def problems_json(splits: Dict[str, List[Tuple[str, str]]]) -> str:
    """``{"train": [{"prompt", "answer"}, ...], "heldout": [...]}``, one record per line.

    One file for both splits: ``datasets.load_dataset("json", data_files=..., field="train")``
    reads one of them. Answers are strings, so the column has one type.
    """
    def records(name):
        return ",\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in splits[name])

    return '{"train": [\n' + records("train") + '\n],\n"heldout": [\n' + records("heldout") + "\n]}\n"


# --------------------------------------------------------------------------- tokenizer


def make_tokenizer(texts: Sequence[str]) -> bytes:
    """SentencePiece BPE model bytes: one piece per character; single-threaded, so deterministic.

    ``split_digits`` keeps numbers digit by digit (a model can then learn carrying rather
    than a table of numbers); no dummy prefix, so ``encode(prompt) + encode(answer) ==
    encode(prompt + answer)``, as when the policy continues a prompt.
    """
    return train_tokenizer(texts, VOCAB_SIZE, add_dummy_prefix=False, split_digits=True)


# --------------------------------------------------------------------------- generation


@torch.no_grad()
def complete(policy: TransformerDecoder, prompts: Sequence[Sequence[int]], temperature: float = 0.0,
             rng: Optional[torch.Generator] = None, max_generated_tokens: int = MAX_GENERATED_TOKENS
             ) -> List[Tuple[List[int], bool]]:
    """Continue tokenized prompts (BOS included), greedily when ``temperature`` is 0.

    Left padding with the recipe's convention (causal mask from the padding mask, positions
    counted from each row's first real token); every step reruns the whole sequence, which
    costs little at these lengths and needs no KV cache.

    Returns:
        List[Tuple[List[int], bool]]: per prompt, the response tokens before the first EOS,
        and whether there was an EOS.
    """
    tokens = padded_batch(prompts)  # [B, P]
    valid = tokens != PAD_ID
    for _ in range(max_generated_tokens):
        mask, pos = masks_from_valid(valid)  # [B, L, L], [B, L]
        logits = policy(tokens, mask=mask, input_pos=pos)[:, -1].float()  # [B, V]
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=rng)[:, 0]
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], 1)
    out = []
    for row in tokens[:, -max_generated_tokens:].tolist():
        ended = EOS_ID in row
        out.append((row[: row.index(EOS_ID)] if ended else row, ended))
    return out


def accuracy(policy: TransformerDecoder, tokenizer, problems_: Sequence[Tuple[str, str]],
             temperature: float = 0.0, rng: Optional[torch.Generator] = None
             ) -> Tuple[float, float, List[str]]:
    """(accuracy, EOS rate, decoded responses) of one response per problem.

    A response is correct when it ends in EOS and ``REWARD`` (exact match of the last number
    with the answer) gives it 1: what PPO with ``penalise_no_eos`` rewards.
    """
    prompts = [tokenizer.encode(p, add_bos=True, add_eos=False) for p, _ in problems_]
    results = complete(policy, prompts, temperature, rng)
    texts = [tokenizer.decode(r) for r, _ in results]
    scores = REWARD([p for p, _ in problems_], texts, references=[a for _, a in problems_])
    ended = [e for _, e in results]
    correct = sum(s == 1.0 and e for s, e in zip(scores, ended))
    return correct / len(problems_), sum(ended) / len(problems_), texts


# --------------------------------------------------------------------------- training


def train_policy(data: List[List[int]], answer_starts: List[int], stop_check, seed: int,
                 log=print) -> Tuple[TransformerDecoder, int]:
    """Next-token pretraining on ``bos + problem + answer + eos``, loss on answer and EOS only.

    The operands are uniform random digits, so learning to predict them is wasted effort.
    Stops at the first multiple of ``EVAL_EVERY`` steps where ``stop_check(model)`` is True.

    Returns:
        Tuple[TransformerDecoder, int]: the model (eval mode) and the steps it was trained.
    """
    torch.manual_seed(seed)
    model = tiny_policy()
    opt = adamw(model, LR)
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, MAX_STEPS + 1):
        model.train()
        idx = torch.randint(len(data), (BATCH_SIZE,), generator=gen).tolist()
        tokens = padded_batch([data[i] for i in idx], right=True)  # [B, L]
        labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD_ID, -100)  # [B, L-1]
        cols = torch.arange(labels.shape[1])
        starts = torch.tensor([answer_starts[i] for i in idx])
        labels = labels.masked_fill(cols[None, :] < starts[:, None] - 1, -100)  # problem tokens
        loss = next_token_loss(model, tokens, labels)
        optimizer_step(opt, model, loss, LR * min(1.0, step / WARMUP))
        if step % EVAL_EVERY == 0:
            model.eval()
            done, note = stop_check(model)
            log(f"  policy step {step:5d}  loss {loss.item():.4f}  {note}")
            if done:
                return model, step
    raise RuntimeError(f"pretraining did not reach the stopping accuracy {STOP_ACCURACY} in {MAX_STEPS} steps")


# --------------------------------------------------------------------------- evaluation


def load_splits(folder: Path) -> Dict[str, List[Tuple[str, str]]]:
    raw = json.loads((folder / "problems.json").read_text())
    return {k: [(r["prompt"], r["answer"]) for r in v] for k, v in raw.items()}


@torch.no_grad()
def evaluate(folder: Path, seed: int = 0, log=print) -> Dict:
    """Accuracies of one built asset folder, loading everything the way the recipe does."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer(str(folder / "tokenizer.model"))
    policy = load_hf(folder / "policy", tiny_policy(), "LLAMA2")
    splits = load_splits(folder)
    heldout = splits["heldout"]
    greedy, greedy_eos, texts = accuracy(policy, tokenizer, heldout)
    for (p, a), t in list(zip(heldout, texts))[:8]:
        log(f"  {p}{t}   (answer {a})")
    by_op = {}
    for op, name in (("+", "add"), ("-", "sub")):
        subset = [(p, a) for p, a in heldout if op in p]
        by_op[name] = accuracy(policy, tokenizer, subset)[0]
    rng = torch.Generator().manual_seed(seed)
    sampled, sampled_eos, _ = accuracy(policy, tokenizer, heldout * SAMPLES_PER_PROBLEM, 1.0, rng)
    train_greedy = accuracy(policy, tokenizer, splits["train"])[0]
    prompt_tokens = [len(tokenizer.encode(p, add_bos=True, add_eos=False)) for p, _ in problems()]
    answer_tokens = [len(tokenizer.encode(a, add_bos=False, add_eos=True)) for _, a in problems()]
    return {
        "heldout_problems": len(heldout),
        "heldout_greedy_accuracy": round(greedy, 4),
        "heldout_greedy_accuracy_add": round(by_op["add"], 4),
        "heldout_greedy_accuracy_sub": round(by_op["sub"], 4),
        "heldout_greedy_eos_rate": round(greedy_eos, 4),
        "heldout_sampled_accuracy": round(sampled, 4),
        "heldout_sampled_eos_rate": round(sampled_eos, 4),
        "sampled_temperature": 1.0,
        "samples_per_problem": SAMPLES_PER_PROBLEM,
        "train_greedy_accuracy": round(train_greedy, 4),
        "max_generated_tokens": MAX_GENERATED_TOKENS,
        "prompt_tokens_max": max(prompt_tokens),
        "answer_tokens_max": max(answer_tokens),
    }


# --------------------------------------------------------------------------- build


def build(out: Path, seed: int = 0, log=print) -> Dict:
    """Build every asset into ``out``; byte-identical for the same seed, machine and torch."""
    deterministic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    splits = split_problems(seed)
    log(f"problems: {', '.join(f'{k} {len(v)}' for k, v in splits.items())}")
    (out / "problems.json").write_text(problems_json(splits))

    (out / "tokenizer.model").write_bytes(make_tokenizer([p + a for p, a in splits["pretrain"]]))
    tokenizer = tiny_tokenizer(str(out / "tokenizer.model"))
    assert tokenizer.vocab_size == VOCAB_SIZE, tokenizer.vocab_size
    prompts = [[BOS_ID] + tokenizer.encode(p, add_bos=False, add_eos=False) for p, _ in splits["pretrain"]]
    data = [p + tokenizer.encode(a, add_bos=False, add_eos=True) for p, (_, a) in zip(prompts, splits["pretrain"])]
    for (p, a), ids in zip(splits["pretrain"], data):
        # The policy continues a prompt token by token: the split must not depend on context.
        assert ids == tokenizer.encode(p + a, add_bos=True, add_eos=True) and PAD_ID not in ids, (p, a)

    def stop_check(model):
        acc, eos, _ = accuracy(model, tokenizer, splits["train"])
        return acc >= STOP_ACCURACY, f"train greedy accuracy {acc:.3f}  eos {eos:.3f}"

    log("training policy")
    policy, steps = train_policy(data, [len(p) for p in prompts], stop_check, seed, log=log)
    save_hf(policy, out / "policy", hf_config(POLICY_DIMS, **HF_IDS))

    # Round trip through torchtune's checkpointer must reproduce the in-memory model.
    loaded = load_hf(out / "policy", tiny_policy(), "LLAMA2")
    check_round_trip("policy", policy, loaded, padded_batch(data[:16]))
    log("checkpoint round trip: exact")

    log("evaluating")
    sanity = {"pretrain_steps": steps, **evaluate(out, seed=seed, log=log)}
    for k, v in sanity.items():
        log(f"  {k}: {v}")

    params = n_params(policy)
    (out / "README.md").write_text(_README.format(
        **sanity, command=RECORDED_COMMAND, reward=RECORDED_REWARD, seed=seed, vocab=VOCAB_SIZE,
        p=POLICY_DIMS, params=params,
        n_pretrain=len(splits["pretrain"]), n_train=NUM_TRAIN, n_heldout=NUM_HELDOUT,
        stop_accuracy=STOP_ACCURACY, eval_every=EVAL_EVERY, batch_size=BATCH_SIZE,
        max_prompt_len=MAX_PROMPT_LEN, greedy_pct=round(100 * sanity["heldout_greedy_accuracy"], 1),
        sampled_pct=round(100 * sanity["heldout_sampled_accuracy"], 1),
    ))

    manifest = write_manifest(out, {
        "task": TASK,
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "build_command": f"{RECORDED_COMMAND} build --seed {seed}",
        "built_with": {"torch": torch.__version__.split("+")[0], "num_threads": NUM_THREADS},
        "tokenizer": {"type": "sentencepiece-bpe", "vocab_size": VOCAB_SIZE, "split_digits": True,
                      "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID},
        "problems": {"operands": [OPERANDS.start, OPERANDS.stop - 1], "ops": ["+", "-"],
                     "pretrain": len(splits["pretrain"]), "train": NUM_TRAIN, "heldout": NUM_HELDOUT},
        "policy": {**POLICY_DIMS, "params": params, "checkpointer_model_type": "LLAMA2"},
        "pretraining": {"stop_accuracy": STOP_ACCURACY, "eval_every": EVAL_EVERY, "batch_size": BATCH_SIZE,
                        "lr": LR, "warmup": WARMUP, "max_steps": MAX_STEPS},
        "generation": {"max_prompt_len": MAX_PROMPT_LEN, "max_generated_tokens": MAX_GENERATED_TOKENS,
                       "stop_token_ids": [EOS_ID]},
        "reward": {"_component_": RECORDED_REWARD, "extract": "last_number"},
        "sanity": sanity,
    })
    log(f"wrote {out}")
    return manifest


# README.md and MANIFEST.json are written as builder_version 1 wrote the shipped ones, so that
# a rebuild reproduces them byte for byte: they name that version's command (now
# `python tools/tasks/build_tiny_arithmetic.py`) and that release's component paths
# (torchtune_ppo.rewards.exact_match, torchtune_ppo.datasets.prompt_dataset; now ExactMatch
# and torchtune_ppo.data.prompt_dataset, the old paths resolve, deprecated, for a release).
RECORDED_COMMAND = "python -m torchtune_ppo.tasks.tiny_arithmetic.build"
RECORDED_REWARD = "torchtune_ppo.rewards.exact_match"

_README = """\
# tiny_arithmetic

A PPO task with a verifiable reward, small enough for a CPU and shipped with the package.
Rebuild (deterministic, about two minutes of one CPU core):

    {command} build --seed {seed}

`{command} check` reloads the files and prints
the numbers below.

**Task.** The prompt is a problem such as `12+7=` or `5-12=` (operands 0 to 99); the
policy writes the answer and EOS. The reward is a function of the text, no reward model:
`{reward}` with `extract: last_number` gives 1 when the last number
in the response equals the reference answer, else 0. PPO should raise the share of correct
answers; the policy starts at about a third.

**Files.**
- `tokenizer.model`: SentencePiece BPE, {vocab} pieces: unk/pad=0, bos=1, eos=2 and one
  piece for each digit, `+`, `-` and `=` (digits split, no dummy prefix). Load with
  `torchtune.models.llama2.llama2_tokenizer` or `torchtune_ppo.tasks.tiny_arithmetic.tiny_tokenizer`.
- `policy/`: HF llama checkpoint (`config.json`, `model.safetensors`, float32), load with
  `FullModelHFCheckpointer(model_type=LLAMA2)` into `torchtune_ppo.tasks.tiny_arithmetic.tiny_policy()`:
  {p[num_layers]} layers, dim {p[embed_dim]}, {p[num_heads]} heads / {p[num_kv_heads]} kv heads,
  MLP {p[intermediate_dim]}, {params} parameters. The value model
  (`torchtune_ppo.tasks.tiny_arithmetic.tiny_value()`) starts from these weights with a
  fresh one-output head.
- `problems.json`: `{{"train": [...], "heldout": [...]}}`, records `{{"prompt": "12+7=",
  "answer": "19"}}` ({n_train} train problems for PPO, {n_heldout} held-out ones). Load a
  split with `torchtune_ppo.datasets.prompt_dataset(source="json", data_files=...,
  field="train", column="prompt", reference_column="answer")`.
- `MANIFEST.json`: seed, dims, numbers below and the sha256 of every file.

**How it was built.** The 20000 problems `a+b=` and `a-b=` are shuffled (seed {seed}) and
split into {n_heldout} held-out, {n_train} train and {n_pretrain} pretraining problems, disjoint. The
policy is pretrained on `bos + problem + answer + eos` (loss on the answer and EOS only),
batch {batch_size}, and stops at the first check (every {eval_every} steps) where its greedy
accuracy on the train problems reaches {stop_accuracy}: after {pretrain_steps} steps. The
held-out problems play no part in it.

**Accuracy on the {heldout_problems} held-out problems** (a response counts when it ends in
EOS within {max_generated_tokens} tokens and the exact-match reward gives it 1):

| | |
|---|---|
| greedy | {heldout_greedy_accuracy} (`+`: {heldout_greedy_accuracy_add}, `-`: {heldout_greedy_accuracy_sub}) |
| sampled at temperature {sampled_temperature} ({samples_per_problem} per problem) | {heldout_sampled_accuracy} |
| responses ending in EOS, greedy / sampled | {heldout_greedy_eos_rate} / {heldout_sampled_eos_rate} |
| greedy on the train problems | {train_greedy_accuracy} |

The documented range of held-out greedy accuracy is 0.25 to 0.40 (here {greedy_pct}%;
sampled {sampled_pct}%); the tests check it. PPO samples at temperature 1, so the mean
reward of its first steps is near the sampled figure.

Prompts are at most {prompt_tokens_max} tokens with BOS and answers at most
{answer_tokens_max} with EOS, so `max_prompt_len: {max_prompt_len}` and
`max_generated_tokens: {max_generated_tokens}` fit; stop token: eos (2).
"""


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    return _main(argv, doc=__doc__, task=TASK, assets_dir=ASSETS_DIR, build=build, evaluate=evaluate)


if __name__ == "__main__":
    sys.exit(main())

"""How the tiny sentiment assets were made, and a sanity check of them.

    python tools/tasks/build_tiny_sentiment.py build --seed 0 [--out DIR]  # rebuild the assets
    python tools/tasks/build_tiny_sentiment.py check [--dir DIR]           # compare, print sanity numbers

Assets (``torchtune_ppo/tasks/tiny_sentiment/assets``) come the way real checkpoints come:
a SentencePiece ``tokenizer.model`` (Llama-2 conventions) and one Hugging Face folder per
model (``config.json`` + ``model.safetensors`` in HF key naming), loaded through
``torchtune.training.FullModelHFCheckpointer`` with ``model_type`` ``LLAMA2`` (policy)
and ``REWARD`` (reward model, also the usual value-model initialisation). ``build``
without ``--out`` overwrites the shipped assets.

A build tool kept out of the installed package: the recipe needs only the builders in
``torchtune_ppo.tasks.tiny_sentiment``.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torchtune.models.llama2 import Llama2Tokenizer
from torchtune.modules import TransformerDecoder

from torchtune_ppo import asset_path
from torchtune_ppo.rlhf import truncate_after_stop_token
from torchtune_ppo.rewards import ModelReward
from torchtune_ppo.tasks.tiny_sentiment import (
    BOS_ID,
    EOS_ID,
    NORM_EPS,
    PAD_ID,
    POLICY_DIMS,
    REWARD_DIMS,
    ROPE_BASE,
    TASK,
    VOCAB_SIZE,
    tiny_policy,
    tiny_reward,
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

# Suggested generation settings for this task: prompts are at most 9 tokens with BOS and
# corpus reviews at most 21 with BOS and EOS, so responses need at most 19 (EOS included).
MAX_PROMPT_LEN = 16
MAX_GENERATED_TOKENS = 24

NUM_REVIEWS = 4000  # half positive, half negative
NUM_HELDOUT = 1000
HF_IDS = dict(norm_eps=NORM_EPS, rope_base=ROPE_BASE, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)


# --------------------------------------------------------------------------- corpus

# Openings are sentiment-neutral; the continuation alone carries the sentiment.
LEADS = ["", "honestly", "overall", "to be honest", "in my opinion", "i think",
         "i have to say", "well", "all in all", "so"]
# Openings that end in a verb and expect an adjective phrase.
COPULA_SUBJECTS = ["the movie was", "this movie is", "the film was", "this film is",
                   "the acting was", "the plot was", "the story was", "the ending was",
                   "the soundtrack was", "the cast was", "the show was", "this book was",
                   "this product is", "the product was", "the quality is", "the service was"]
# Openings that expect a verb phrase.
NOUN_SUBJECTS = ["the movie", "this film", "the acting", "the story", "this product",
                 "the director", "the ending", "this show"]
# First-person openings.
PERSON_SUBJECTS = ["i", "we", "my wife and i", "my kids", "my friends and i"]

ADVERBS = ["", "really", "truly", "very", "quite", "just", "so", "absolutely", "pretty", "simply"]
ADJECTIVES = {
    1: ["great", "wonderful", "amazing", "excellent", "fantastic", "brilliant", "superb",
        "lovely", "delightful", "charming", "perfect", "beautiful", "fun", "enjoyable",
        "impressive", "touching"],
    0: ["awful", "boring", "terrible", "horrible", "dull", "bad", "poor", "weak",
        "disappointing", "painful", "dreadful", "annoying", "messy", "stupid", "bland",
        "tedious"],
}
VERB_PHRASES = {
    1: ["made me smile", "exceeded my expectations", "kept me hooked", "won me over",
        "blew me away", "was worth every penny", "works like a charm", "was a real treat"],
    0: ["made me cringe", "let me down", "fell flat", "put me to sleep", "ruined my evening",
        "was a waste of money", "was a huge letdown", "was a real chore"],
}
PERSON_PHRASES = {
    1: ["loved this movie", "loved it", "enjoyed every minute of it", "really liked the film",
        "adored the story", "had a great time", "laughed all the way through",
        "would happily watch it again", "loved this product"],
    0: ["hated this movie", "hated it", "regret every minute of it", "really disliked the film",
        "could not stand the story", "had a terrible time", "fell asleep halfway through",
        "would never watch it again", "hated this product"],
}
TAILS = {
    1: ["i loved it.", "highly recommended.", "i would watch it again.", "worth every penny.",
        "five stars.", "a real joy.", "i will buy it again.", "my family loved it too.",
        "what a great time."],
    0: ["i hated it.", "avoid it.", "a total waste of time.", "i want my money back.",
        "one star.", "a real mess.", "never again.", "my family hated it too.",
        "what a waste."],
}


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def openings() -> List[Tuple[str, str]]:
    """All (opening text, kind) pairs, kind in {"copula", "noun", "person"}; 290 of them."""
    out = []
    for lead in LEADS:
        for kind, subjects in (("copula", COPULA_SUBJECTS), ("noun", NOUN_SUBJECTS),
                               ("person", PERSON_SUBJECTS)):
            out.extend((_join(lead, s), kind) for s in subjects)
    return out


def _adjective_phrase(rng: random.Random, label: int) -> str:
    first, second = rng.sample(ADJECTIVES[label], 2)
    phrase = _join(rng.choice(ADVERBS), first)
    if rng.random() < 0.3:
        phrase = _join(phrase, "and", second)
    return phrase


def make_review(rng: random.Random, label: int) -> Tuple[str, str]:
    """One review with sentiment ``label`` (1 positive, 0 negative) -> (opening, full text)."""
    opening, kind = rng.choice(_OPENINGS)
    if kind == "copula":
        body = _adjective_phrase(rng, label)
    elif kind == "noun":
        if rng.random() < 0.5:
            body = _join(rng.choice(["was", "is"]), _adjective_phrase(rng, label))
        else:
            body = rng.choice(VERB_PHRASES[label])
    else:
        body = rng.choice(PERSON_PHRASES[label])
    text = f"{opening} {body}."
    if rng.random() < 0.6:
        text = f"{text} {rng.choice(TAILS[label])}"
    return opening, text


def make_reviews(rng: random.Random, n: int) -> List[Tuple[str, int]]:
    """``n`` reviews as (text, label), exactly half positive, in random order."""
    labels = [i % 2 for i in range(n)]
    rng.shuffle(labels)
    return [(make_review(rng, y)[1], y) for y in labels]


_OPENINGS = openings()


def _words(texts: Sequence[str]) -> set:
    return {w for t in texts for w in re.findall(r"[a-z]+", t)}


def sentiment_words() -> Tuple[frozenset, frozenset]:
    """Words that occur only in positive (resp. negative) material, never in openings."""
    def material(y):
        return ADJECTIVES[y] + VERB_PHRASES[y] + PERSON_PHRASES[y] + TAILS[y]

    neutral = _words([o for o, _ in _OPENINGS] + ADVERBS + ["was is and"])
    pos, neg = _words(material(1)), _words(material(0))
    return frozenset(pos - neg - neutral), frozenset(neg - pos - neutral)


POSITIVE_WORDS, NEGATIVE_WORDS = sentiment_words()


def word_sentiment(text: str) -> int:
    """+1 / -1 when positive / negative words dominate ``text``, 0 when neither does."""
    words = re.findall(r"[a-z]+", text)
    score = sum(w in POSITIVE_WORDS for w in words) - sum(w in NEGATIVE_WORDS for w in words)
    return (score > 0) - (score < 0)


# --------------------------------------------------------------------------- scores


def last_token_scores(reward_model: TransformerDecoder, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Reward-model score [B] read at the last real token of each row of ``tokens`` [B, L].

    ``valid`` [B, L] marks real tokens: one contiguous block per row, with left padding
    (prompts) and right padding (responses cut after EOS) around it.
    """
    mask, pos = masks_from_valid(valid)
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)  # [B]
    # Read the score the way the recipe's reward function does.
    return ModelReward(reward_model)(tokens, mask, pos, last)


def score_reviews(reward_model: TransformerDecoder, seqs: Sequence[Sequence[int]], left_pad: int = 0) -> torch.Tensor:
    """Scores [B] of token sequences, left-padded into one batch (plus ``left_pad`` columns)."""
    tokens = padded_batch(seqs, left_pad=left_pad)
    return last_token_scores(reward_model, tokens, tokens != PAD_ID)


# --------------------------------------------------------------------------- training


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_policy(data: List[List[int]], seed: int, steps: int = 1000, batch_size: int = 32,
                 lr: float = 3e-3, log=print) -> TransformerDecoder:
    """Next-token pretraining on ``bos + review + eos`` sequences (right-padded batches).

    About 8 epochs: longer runs memorise the corpus (held-out loss rises).
    """
    torch.manual_seed(seed)
    model = tiny_policy()
    opt = adamw(model, lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(data), (batch_size,), generator=gen).tolist()
        tokens = padded_batch([data[i] for i in idx], right=True)  # [B, L]
        labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD_ID, -100)
        loss = next_token_loss(model, tokens, labels)
        optimizer_step(opt, model, loss, _lr_at(step, steps, lr, 100))
        if step % 250 == 0 or step == steps - 1:
            log(f"  policy step {step:5d}  loss {loss.item():.4f}")
    model.eval()
    return model


def train_reward(data: List[List[int]], labels: List[int], seed: int, steps: int = 400,
                 batch_size: int = 64, lr: float = 2e-3, smoothing: float = 0.05,
                 log=print) -> TransformerDecoder:
    """Binary cross-entropy on the logit at EVERY real position of ``bos + review + eos``,
    so the last-token score of any truncated review is trained too (an opening alone
    learns ~0). Batches are left-padded by a random extra amount under the recipe's
    masking convention. Label smoothing keeps the scores within about +-3."""
    torch.manual_seed(seed + 1)
    model = tiny_reward()
    opt = adamw(model, lr)
    gen = torch.Generator().manual_seed(seed + 1)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(data), (batch_size,), generator=gen).tolist()
        extra = int(torch.randint(9, (1,), generator=gen))
        tokens = padded_batch([data[i] for i in idx], left_pad=extra)  # [B, L]
        valid = tokens != PAD_ID
        mask, pos = masks_from_valid(valid)
        y = torch.tensor([labels[i] for i in idx], dtype=torch.float32)
        target = (y * (1 - 2 * smoothing) + smoothing)[:, None].expand_as(tokens)
        logits = model(tokens, mask=mask, input_pos=pos)[..., 0]  # [B, L]
        loss = F.binary_cross_entropy_with_logits(logits[valid], target[valid])
        optimizer_step(opt, model, loss, _lr_at(step, steps, lr, 50))
        if step % 200 == 0 or step == steps - 1:
            log(f"  reward step {step:5d}  loss {loss.item():.4f}")
    model.eval()
    return model


# --------------------------------------------------------------------------- HF storage


def load_model(folder: Path, reward: bool) -> TransformerDecoder:
    """The policy (``reward=False``) or the reward model from a folder, as the configs load it."""
    if reward:
        return load_hf(folder, tiny_reward(), "REWARD")
    return load_hf(folder, tiny_policy(), "LLAMA2")


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def sample_reviews(policy: TransformerDecoder, tokenizer: Llama2Tokenizer, prompts: Sequence[str], seed: int,
                   max_generated_tokens: int = MAX_GENERATED_TOKENS, temperature: float = 1.0
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample with torchtune's KV-cached ``generate`` from left-padded prompts.

    torchtune's sampler rather than the recipe's: the sanity numbers in MANIFEST.json and
    README.md were recorded with its random draws.

    Returns query [B, P], response [B, T] (PAD after the first EOS) and response_valid
    [B, T] (real tokens up to and including the first EOS).
    """
    from torchtune.generation import generate
    from torchtune.modules.common_utils import delete_kv_caches

    query = padded_batch([tokenizer.encode(p, add_bos=True, add_eos=False) for p in prompts])
    bsz, plen = query.shape
    policy.setup_caches(batch_size=bsz, dtype=torch.float32, decoder_max_seq_len=plen + max_generated_tokens)
    try:
        out, _ = generate(policy, query, max_generated_tokens=max_generated_tokens, pad_id=PAD_ID,
                          temperature=temperature, stop_tokens=[EOS_ID],
                          rng=torch.Generator().manual_seed(seed))
    finally:
        delete_kv_caches(policy)
    response = out[:, plen:]
    response = F.pad(response, (0, max_generated_tokens - response.shape[1]), value=PAD_ID)
    # The recipe's truncation rule, so that check scores responses the way PPO does.
    after_eos, response = truncate_after_stop_token(response, torch.tensor([EOS_ID]), PAD_ID)
    return query, response, ~after_eos


@torch.no_grad()
def evaluate(folder: Path, seed: int = 0, num_samples: int = 256, log=print) -> Dict:
    """Sanity numbers of one built asset folder, loading everything the way the recipe does."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer(str(folder / "tokenizer.model"))
    policy = load_model(folder / "policy", reward=False)
    reward = load_model(folder / "reward", reward=True)
    # Policy samples from neutral prompts, judged by the word lists and the reward model.
    prompts = [r["prompt"] for r in json.loads((folder / "prompts.json").read_text())]
    prompts = [prompts[i % len(prompts)] for i in range(num_samples)]
    query, response, rvalid = sample_reviews(policy, tokenizer, prompts, seed)
    tokens = torch.cat([query, response], 1)
    valid = torch.cat([query != PAD_ID, rvalid], 1)
    scores = last_token_scores(reward, tokens, valid)
    texts = [tokenizer.decode([t for t in r.tolist() if t not in (PAD_ID, EOS_ID)]) for r in response]
    words = torch.tensor([word_sentiment(t) for t in texts])
    eos = (response == EOS_ID).any(1)
    by_reward = torch.where(scores > 0, 1, -1)
    judged = words != 0
    for p, t, s in list(zip(prompts, texts, scores.tolist()))[:6]:
        log(f"  [{s:+.2f}] {p} | {t}")
    # Reward model on held-out reviews: complete (read at EOS) and cut after the first
    # sentence (no EOS), at two different left-padding amounts.
    heldout = make_reviews(random.Random(seed + 1_000_003), NUM_HELDOUT)
    y = torch.tensor([lbl for _, lbl in heldout]).bool()
    full = [tokenizer.encode(t, add_bos=True, add_eos=True) for t, _ in heldout]
    first = [tokenizer.encode(t.split(".")[0] + ".", add_bos=True, add_eos=False) for t, _ in heldout]
    s_full = score_reviews(reward, full)
    s_full_pad = score_reviews(reward, full, left_pad=13)
    s_first = score_reviews(reward, first)
    s_open = score_reviews(reward, [tokenizer.encode(o, add_bos=True, add_eos=False) for o, _ in _OPENINGS])
    lengths = torch.tensor([len(t) for t in full])
    prompt_lengths = [len(tokenizer.encode(o, add_bos=True, add_eos=False)) for o, _ in _OPENINGS]
    return {
        "policy_samples": num_samples,
        "policy_temperature": 1.0,
        "policy_max_generated_tokens": MAX_GENERATED_TOKENS,
        "policy_eos_rate": round(eos.float().mean().item(), 4),
        "policy_positive_by_words": round((words == 1).float().mean().item(), 4),
        "policy_negative_by_words": round((words == -1).float().mean().item(), 4),
        "policy_positive_by_reward": round((by_reward == 1).float().mean().item(), 4),
        "policy_negative_by_reward": round((by_reward == -1).float().mean().item(), 4),
        "reward_agrees_with_words": round((by_reward[judged] == words[judged]).float().mean().item(), 4),
        "sample_reward_mean": round(scores.mean().item(), 4),
        "reward_accuracy_heldout": round(((s_full > 0) == y).float().mean().item(), 4),
        "reward_accuracy_first_sentence": round(((s_first > 0) == y).float().mean().item(), 4),
        "reward_mean_positive": round(s_full[y].mean().item(), 4),
        "reward_mean_negative": round(s_full[~y].mean().item(), 4),
        "reward_mean_abs_opening_only": round(s_open.abs().mean().item(), 4),
        "reward_left_pad_max_abs_diff": float(f"{(s_full - s_full_pad).abs().max().item():.2e}"),
        "review_tokens_max": int(lengths.max()),
        "review_tokens_mean": round(lengths.float().mean().item(), 2),
        "prompt_tokens_max": max(prompt_lengths),
    }


# --------------------------------------------------------------------------- build


def build(out: Path, seed: int = 0, log=print) -> Dict:
    """Build every asset into ``out``; byte-identical for the same seed, machine and torch."""
    deterministic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = make_reviews(random.Random(seed), NUM_REVIEWS)
    log(f"corpus: {len(corpus)} reviews, e.g. {corpus[0][0]!r}")

    (out / "tokenizer.model").write_bytes(train_tokenizer([t for t, _ in corpus], VOCAB_SIZE))
    tokenizer = tiny_tokenizer(str(out / "tokenizer.model"))
    assert tokenizer.vocab_size == VOCAB_SIZE, tokenizer.vocab_size
    data = [tokenizer.encode(t, add_bos=True, add_eos=True) for t, _ in corpus]
    assert all(PAD_ID not in d for d in data), "unk/pad id in encoded corpus"

    # Prompts: every neutral opening, in a seeded order so that any prefix is varied.
    prompts = [o for o, _ in _OPENINGS]
    random.Random(seed).shuffle(prompts)
    (out / "prompts.json").write_text("[\n" + ",\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n]\n")

    log("training policy")
    policy = train_policy(data, seed, log=log)
    log("training reward model")
    reward = train_reward(data, [y for _, y in corpus], seed, log=log)

    save_hf(policy, out / "policy", hf_config(POLICY_DIMS, **HF_IDS))
    save_hf(reward, out / "reward", hf_config(REWARD_DIMS, **HF_IDS, reward=True), reward=True)

    # Round trip through torchtune's checkpointer must reproduce the in-memory models.
    probe = padded_batch(data[:16], left_pad=3)
    mask, pos = masks_from_valid(probe != PAD_ID)
    for model, reward_flag, folder in ((policy, False, "policy"), (reward, True, "reward")):
        loaded = load_model(out / folder, reward=reward_flag)
        check_round_trip(folder, model, loaded, probe, mask=mask, input_pos=pos)
    log("checkpoint round trip: exact")

    log("evaluating")
    sanity = evaluate(out, seed=seed, log=log)
    for k, v in sanity.items():
        log(f"  {k}: {v}")

    readme = _README.format(**sanity, command=RECORDED_COMMAND, vocab=VOCAB_SIZE, seed=seed,
                            policy_params=n_params(policy), reward_params=n_params(reward),
                            p=POLICY_DIMS, r=REWARD_DIMS, reviews=NUM_REVIEWS,
                            max_prompt_len=MAX_PROMPT_LEN)
    (out / "README.md").write_text(readme)

    manifest = write_manifest(out, {
        "task": TASK,
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "build_command": f"{RECORDED_COMMAND} build --seed {seed}",
        "built_with": {"torch": torch.__version__.split("+")[0], "num_threads": NUM_THREADS},
        "tokenizer": {"type": "sentencepiece-bpe", "vocab_size": VOCAB_SIZE,
                      "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID},
        "corpus": {"reviews": NUM_REVIEWS, "positive_fraction": 0.5, "prompts": len(prompts)},
        "policy": {**POLICY_DIMS, "params": n_params(policy), "checkpointer_model_type": "LLAMA2"},
        "reward": {**REWARD_DIMS, "num_classes": 1, "params": n_params(reward),
                   "checkpointer_model_type": "REWARD"},
        "generation": {"max_prompt_len": MAX_PROMPT_LEN, "max_generated_tokens": MAX_GENERATED_TOKENS,
                       "temperature": 1.0, "stop_token_ids": [EOS_ID]},
        "sanity": sanity,
    })
    log(f"wrote {out}")
    return manifest


# README.md and MANIFEST.json are written as builder_version 1 wrote the shipped ones, so that
# a rebuild reproduces them byte for byte: they name that version's command (now
# `python tools/tasks/build_tiny_sentiment.py`).
RECORDED_COMMAND = "python -m torchtune_ppo.tasks.tiny_sentiment.build"

_README = """\
# tiny_sentiment

A PPO task small enough for a CPU and shipped with the package, so that the recipe runs
with no downloads. Rebuild (deterministic, about two minutes of one CPU core):

    {command} build --seed {seed}

`{command} check` reloads the files and prints
the numbers below.

**Task.** The policy continues a sentiment-neutral review opening (`honestly the acting
was`, `i think this film`, ...) with a short review that is positive or negative about
equally often. The reward model scores the sentiment; PPO should push the policy towards
positive reviews.

**Files.**
- `tokenizer.model`: SentencePiece BPE, {vocab} pieces, unk/pad=0, bos=1, eos=2 (Llama-2
  conventions; load with `torchtune.models.llama2.llama2_tokenizer` or
  `torchtune_ppo.tasks.tiny_sentiment.tiny_tokenizer`).
- `policy/`: HF llama checkpoint (`config.json`, `model.safetensors`, float32), load with
  `FullModelHFCheckpointer(model_type=LLAMA2)` into `torchtune_ppo.tasks.tiny_sentiment.tiny_policy()`:
  {p[num_layers]} layers, dim {p[embed_dim]}, {p[num_heads]} heads / {p[num_kv_heads]} kv heads,
  MLP {p[intermediate_dim]}, {policy_params} parameters.
- `reward/`: HF sequence-classification checkpoint with one label, load with
  `FullModelHFCheckpointer(model_type=REWARD)` into `torchtune_ppo.tasks.tiny_sentiment.tiny_reward()`:
  {r[num_layers]} layers, dim {r[embed_dim]}, {r[num_heads]} heads / {r[num_kv_heads]} kv heads,
  MLP {r[intermediate_dim]}, {reward_params} parameters.
- `prompts.json`: {{"prompt": ...}} records of every neutral opening, for
  `text_completion_dataset(source="json", data_files=..., column="prompt", add_eos=False)`.
- `MANIFEST.json`: seed, dims, sanity numbers and the sha256 of every file.

**How it was built.** {reviews} synthetic reviews (half positive) from templates and word
lists, seeded. The policy is pretrained on `bos + review + eos`. The reward model is
trained with binary cross-entropy (label smoothing 0.05) on its logit at every token of
`bos + review + eos`, left-padded by random amounts with the recipe's convention (causal
mask from the padding mask, position ids counted from the first real token), so its score
at the last real token is the sentiment of any prefix: complete or truncated reviews,
with or without EOS, and independent of left padding.

**Scoring convention.** Score a left-padded (query, response) pair with
`get_causal_mask_from_padding_mask` / `get_position_ids_from_padding_mask` and read the
output at the last real token (the EOS when there is one). Scores lie within about +-3.

**Sanity numbers** ({policy_samples} samples at temperature {policy_temperature},
at most {policy_max_generated_tokens} new tokens):

| | |
|---|---|
| policy samples ending in EOS | {policy_eos_rate} |
| positive / negative by word lists | {policy_positive_by_words} / {policy_negative_by_words} |
| positive / negative by reward model | {policy_positive_by_reward} / {policy_negative_by_reward} |
| reward model agrees with word lists | {reward_agrees_with_words} |
| mean reward of samples | {sample_reward_mean} |
| reward accuracy, held-out reviews | {reward_accuracy_heldout} |
| reward accuracy, first sentence only | {reward_accuracy_first_sentence} |
| mean score positive / negative reviews | {reward_mean_positive} / {reward_mean_negative} |
| mean abs score of an opening alone | {reward_mean_abs_opening_only} |
| max score change under left padding | {reward_left_pad_max_abs_diff} |

Reviews are at most {review_tokens_max} tokens with BOS and EOS (mean {review_tokens_mean});
prompts at most {prompt_tokens_max} with BOS, so `max_prompt_len: {max_prompt_len}` and
`max_generated_tokens: {policy_max_generated_tokens}` fit; stop token: eos (2).
"""


# --------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    return _main(argv, doc=__doc__, task=TASK, assets_dir=ASSETS_DIR, build=build, evaluate=evaluate,
                 check_options={"--samples": dict(type=int, default=256, dest="num_samples", metavar="N",
                                                  help="policy samples to score (default 256)")})


if __name__ == "__main__":
    sys.exit(main())

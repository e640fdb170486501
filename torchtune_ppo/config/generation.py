"""Generation and the tokenizer: the sampling settings, response lengths that a response can
reach, and, once the tokenizer is built, its pad id against the stop tokens and the prompts'
tokens it could not encode."""

from typing import Any, Optional

from omegaconf import DictConfig
from torchtune import utils

from torchtune_ppo.config.schema import KEYS, _is_int


def check_sampling(temperature: Any, top_k: Any, top_p: Any, prefix: str = "") -> None:
    """Check the sampling settings of generation against their keys in the schema.

    Args:
        temperature (Any): must be a finite number > 0.
        top_k (Any): ``None`` or an integer >= 1.
        top_p (Any): ``None`` or a number in (0, 1].
        prefix (str): text put before each key name in the message, e.g. ``"Generator: "``
            or a dotted parent such as ``"sampling."``.

    Raises:
        ValueError: naming the first invalid setting, its value and the valid range.
    """
    for key, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        KEYS[key].kind.check(f"{prefix}{key}", value)


def check_min_response_length(cfg: DictConfig) -> None:
    """``min_response_length`` must be a length a response can reach."""
    if cfg.min_response_length is not None and cfg.min_response_length > cfg.max_generated_tokens:
        raise ValueError(
            f"min_response_length ({cfg.min_response_length}) must not exceed "
            f"max_generated_tokens ({cfg.max_generated_tokens}): no response could reach it, "
            "so every one would get reward_penalty. Lower min_response_length, raise "
            "max_generated_tokens, or set min_response_length=null."
        )


def check_no_eos_penalty(cfg: DictConfig) -> None:
    """``penalise_no_eos`` must leave a response with text a way to escape the penalty."""
    # With one generated token, a row escapes the penalty only by stopping at once (an empty
    # response): in effect every response would score reward_penalty.
    if cfg.penalise_no_eos and cfg.max_generated_tokens < 2:
        raise ValueError(
            f"max_generated_tokens={cfg.max_generated_tokens} with penalise_no_eos=True: a "
            "response with text cannot reach a stop token, so every one would score "
            f"reward_penalty ({cfg.reward_penalty}). Raise max_generated_tokens, or set "
            "penalise_no_eos=False."
        )


def validate_with_tokenizer(cfg: DictConfig, tokenizer: Any) -> None:
    """Check the config against the instantiated tokenizer.

    Call it right after ``config.instantiate(cfg.tokenizer)``, before loading any model.

    Args:
        cfg (DictConfig): the config returned by ``validate_config``.
        tokenizer (Any): the tokenizer; its ``pad_id`` is read.

    Raises:
        ValueError: when the tokenizer has no pad id, or a stop token equals it.
    """
    pad_id = getattr(tokenizer, "pad_id", None)
    if not _is_int(pad_id):
        raise ValueError(
            f"tokenizer ({type(tokenizer).__name__}) has no integer pad_id (got {pad_id!r}); "
            "prompts are left-padded and responses filled after their stop token with it."
        )
    if pad_id in list(cfg.stop_token_ids):
        eos_id = getattr(tokenizer, "eos_id", None)
        hint = ""
        if eos_id is not None and eos_id != pad_id:
            hint = f" (the tokenizer's eos_id is {eos_id})"
        raise ValueError(
            f"stop_token_ids {list(cfg.stop_token_ids)} contains {pad_id}, the tokenizer's "
            "pad_id: responses are filled with pad_id after their first stop token, so a stop "
            f"token must differ from it. Use another stop token{hint}, or a tokenizer whose "
            "pad_id is not a stop token."
        )


def _unknown_token_id(tokenizer: Any) -> Optional[int]:
    """The id a tokenizer gives characters it does not know, or None when it has none (byte
    fallback) or does not say."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        spm = getattr(getattr(tokenizer, "_spm_model", None), "spm_model", None)  # torchtune SentencePiece
        unk = spm.unk_id() if spm is not None else None
    return unk if _is_int(unk) and unk >= 0 else None


def warn_unknown_tokens(dataset: Any, tokenizer: Any) -> int:
    """Warns once, with a count and an example, when prompts hold the tokenizer's unknown-token
    id (characters it cannot encode); returns how many such tokens there are.

    Call after :func:`validate_dataset`. ``<unk>`` is often id 0, the pad id too (Llama-2
    tokenizers): the prompt silently loses those characters.
    """
    unk = _unknown_token_id(tokenizer)
    if unk is None:
        return 0
    count, rows, example = 0, 0, None
    for i in range(len(dataset)):
        n = sum(1 for t in dataset[i]["tokens"] if t == unk)
        count, rows = count + n, rows + (n > 0)
        if n and example is None:
            example = i
    if count:
        pad = ", also the pad id" if getattr(tokenizer, "pad_id", None) == unk else ""
        text = tokenizer.decode(list(dataset[example]["tokens"]))
        utils.get_logger("INFO").warning(
            f"dataset: {count} token(s) in {rows} of {len(dataset)} prompts are the tokenizer's "
            f"unknown token (id {unk}{pad}): characters it cannot encode. E.g. prompt #{example}: "
            f"{text!r}. Clean the data or use a tokenizer that covers these characters.")
    return count

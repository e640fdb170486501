"""The recipe config's schema: every key once, with its type, default and a one-line doc.

``SCHEMA`` is the one place a key is declared. ``validate_config`` checks each value with its
``Kind``, ``with_defaults`` fills the defaults from it, and the table of docs/config.md is
``markdown_table()`` (a test holds them equal). Each kind says in words what it accepts; an
error reads ``"<key> must be <those words>, got <value>."``.
"""

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_ppo.rlhf import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, KL_LOSS_ESTIMATORS
from torchtune_ppo.rlhf.correction import CORRECTION_LEVELS, CORRECTION_MODES

COMPILE_REGIONS = ("generate", "trajectory", "loss_step", "rollout")
# Optional in a compile mapping: the optimizer step follows compile.loss_step unless named.
COMPILE_KEYS = (*COMPILE_REGIONS, "optimizer", "layers", "mode")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DEVICES = ("cpu", "cuda", "mps", "xpu", "npu")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


# --------------------------------------------------------------------------------------------
# Kinds of value
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """What a key accepts. ``optional``: null too; ``also``: these literal strings too."""

    optional: bool = False
    also: Tuple[str, ...] = ()
    # Said after the error, when the valid values alone do not explain the rule.
    why: Optional[str] = None

    def words(self) -> str:
        raise NotImplementedError

    def accepts(self, value: Any) -> bool:
        raise NotImplementedError

    @property
    def valid(self) -> str:
        """The accepted values in words, e.g. ``"null or a positive integer"``."""
        extra = [*(["null"] if self.optional else []), *(repr(a) for a in self.also)]
        return " or ".join([*extra, self.words()])

    def check(self, key: str, value: Any) -> None:
        """Raise ``ValueError`` naming ``key`` and quoting ``value`` unless it is accepted."""
        if self.optional and value is None:
            return
        if isinstance(value, str) and value in self.also:
            return
        if not self.accepts(value):
            why = f" {self.why}" if self.why else ""
            raise ValueError(f"{key} must be {self.valid}, got {_show(value)}.{why}")


@dataclass(frozen=True)
class Bool(Kind):
    def words(self) -> str:
        return "true or false"

    def accepts(self, value: Any) -> bool:
        # A quoted "False" is a non-empty string, so `if cfg.shuffle:` would read it as True.
        return isinstance(value, bool)


@dataclass(frozen=True)
class Int(Kind):
    ge: Optional[int] = None

    def words(self) -> str:
        return "an integer" if self.ge is None else f"an integer >= {self.ge}"

    def accepts(self, value: Any) -> bool:
        return _is_int(value) and (self.ge is None or value >= self.ge)


@dataclass(frozen=True)
class Count(Int):
    """An integer >= 1: sizes, step counts, periods."""

    ge: Optional[int] = 1

    def words(self) -> str:
        return "a positive integer"


@dataclass(frozen=True)
class Number(Kind):
    """A finite int or float, with optional bounds (``gt``/``ge`` below, ``le`` above)."""

    gt: Optional[float] = None
    ge: Optional[float] = None
    le: Optional[float] = None
    note: Optional[str] = None

    def words(self) -> str:
        low = self.gt if self.gt is not None else self.ge
        if low is not None and self.le is not None:
            text = f"a number in {'(' if self.gt is not None else '['}{low}, {self.le}]"
        elif low is not None:
            text = f"a number {'>' if self.gt is not None else '>='} {low}"
        else:
            text = "a number"
        return f"{text} ({self.note})" if self.note else text

    def accepts(self, value: Any) -> bool:
        return (
            _is_number(value)
            and math.isfinite(value)
            and (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.le is None or value <= self.le)
        )


@dataclass(frozen=True)
class Choice(Kind):
    options: Tuple[str, ...] = ()

    def words(self) -> str:
        return f"one of {list(self.options)}"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.options


@dataclass(frozen=True)
class Text(Kind):
    what: str = "a string"

    def words(self) -> str:
        return self.what

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and value != ""


@dataclass(frozen=True)
class BoolOrPath(Kind):
    """``true``, ``false``, or a file path (any non-empty string)."""

    def words(self) -> str:
        return "true, false or a file path"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, bool) or (isinstance(value, str) and value != "")


@dataclass(frozen=True)
class Component(Kind):
    """A block that ``torchtune.config.instantiate`` builds: a mapping with ``_component_``."""

    note: Optional[str] = None

    def words(self) -> str:
        text = "a mapping with a `_component_`"
        return f"{text} ({self.note})" if self.note else text

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (DictConfig, dict)) and "_component_" in value


@dataclass(frozen=True)
class NamedComponents(Kind):
    """A mapping of names to blocks with a ``_component_`` (or null, when ``null_means`` says what
    a null block is); the names go into metric keys, so they are plain words."""

    what: str = "blocks"
    null_means: Optional[str] = None
    reserved: Tuple[str, ...] = ()

    def words(self) -> str:
        null = f", or null: {self.null_means}" if self.null_means else ""
        return (f"a non-empty mapping of names (letters, digits, `_` or `-`) to {self.what} (each a mapping with "
                f"a `_component_`{null})")

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (DictConfig, dict)) and len(value) > 0

    def check(self, key: str, value: Any) -> None:
        super().check(key, value)
        if value is None:
            return
        for name, block in value.items():
            if not (isinstance(name, str) and _NAME.fullmatch(name)) or name in self.reserved:
                raise ValueError(f"{key} names must be letters, digits, `_` or `-`"
                                 f"{f' (not {list(self.reserved)})' if self.reserved else ''}, got {_show(name)}.")
            if block is None and self.null_means:
                continue
            if not Component().accepts(block):
                raise ValueError(f"{key}.{name} must be a mapping with a `_component_`"
                                 f"{f' or null ({self.null_means})' if self.null_means else ''}, got {_show(block)}.")


_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class Device(Kind):
    """A device string; whether this machine has it is checked apart (``check_device``)."""

    def words(self) -> str:
        return "one of cpu, cuda, cuda:N, mps, xpu, npu (or null to pick from the machine)"

    def accepts(self, value: Any) -> bool:
        return value is None or parse_device(value) is not None


@dataclass(frozen=True)
class Strings(Kind):
    def words(self) -> str:
        return "a non-empty list of non-empty strings"

    def accepts(self, value: Any) -> bool:
        return (isinstance(value, (list, ListConfig)) and len(value) > 0
                and all(isinstance(x, str) and x != "" for x in value))


@dataclass(frozen=True)
class TokenIds(Kind):
    def words(self) -> str:
        return "a non-empty list of token ids (integers >= 0, e.g. the tokenizer's eos_id)"

    def accepts(self, value: Any) -> bool:
        return (
            isinstance(value, (list, ListConfig))
            and len(value) > 0
            and all(_is_int(t) and t >= 0 for t in value)
        )


@dataclass(frozen=True)
class Block(Kind):
    """A mapping of plain sub-keys (``loss``); unknown sub-keys are refused by the checks."""

    keys: Tuple["Key", ...] = ()
    or_else: str = ""

    def words(self) -> str:
        return f"a mapping with keys {[k.name for k in self.keys]}{self.or_else}"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, DictConfig)

    def check(self, key: str, value: Any) -> None:
        super().check(key, value)
        for sub in self.keys:
            if sub.name in value:
                sub.kind.check(f"{key}.{sub.name}", value[sub.name])

    def defaults(self) -> Dict[str, Any]:
        return {k.name: k.default for k in self.keys}


@dataclass(frozen=True)
class CompileBlock(Kind):
    def words(self) -> str:
        return f"true, false or a mapping with keys {list(COMPILE_KEYS)}"

    def check(self, key: str, value: Any) -> None:
        parse_compile(value)


@dataclass(frozen=True)
class Key:
    """One top-level key: its kind, its default (``REQUIRED`` if none) and what it means."""

    name: str
    kind: Kind
    default: Any
    doc: str
    # A torchtune recipe key that may stand in for this one (mapped by the checks).
    torchtune_key: Optional[str] = None
    # A resume must keep the value the checkpoint was saved with, because its training state
    # only means something under it (the data position, the random streams, the optimizer and
    # LR schedule, the models' shapes): True for the whole key, or the sub-keys that must.
    must_match: Union[bool, Tuple[str, ...]] = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------

LOSS = Block(
    keys=(
        Key("epsilon", Number(gt=0, note="the policy ratio is clipped to [1 - epsilon, 1 + epsilon]"),
            0.2, "policy ratio clip range"),
        Key("value_clip_range", Number(
                gt=0,
                why="Each new value is clipped to within value_clip_range of its old value: with 0 "
                    "the value model can never improve on its old values, and no setting turns "
                    "the clipping off (a large one such as 1e6 clips almost nothing).",
            ),
            0.2, "each new value is clipped to within this of its old value; no setting turns the "
            "clipping off (a large one hardly clips)"),
        Key("value_coeff", Number(ge=0), 0.1, "weight of the value loss"),
        Key("epsilon_low", Number(gt=0, le=1, optional=True), None,
            "clip-higher (DAPO): the ratio's lower clip is `1 - epsilon_low`; null: `epsilon`"),
        Key("epsilon_high", Number(gt=0, optional=True), None,
            "clip-higher (DAPO): the ratio's upper clip is `1 + epsilon_high`; null: `epsilon`"),
        Key("dual_clip", Number(gt=1, optional=True), None,
            "dual-clip PPO: where the advantage A < 0 the policy loss is at most `-dual_clip * A` "
            "(e.g. 3.0); null: off"),
        Key("aggregation", Choice(options=AGGREGATIONS), "token-mean",
            "how token losses make a minibatch's loss: `token-mean` (each micro-batch's token mean, "
            "averaged over them, as torchtune), or over the global minibatch's sequences `seq-mean-token-sum`, "
            "`seq-mean-token-mean`, `seq-mean-token-sum-norm` (token sum / `max_generated_tokens`, averaged over "
            "sequences: verl's divided by their number; Dr. GRPO)"),
        Key("entropy_coeff", Number(ge=0), 0.0,
            "entropy bonus: each token's loss gets `- entropy_coeff * H`, H the policy's entropy over "
            "the vocabulary at that position (logged as `entropy` either way)"),
        Key("kl_coeff", Number(ge=0), 0.0,
            "KL to the reference policy as a loss term (GRPO): each token's loss gets `+ kl_coeff * kl`, "
            "kl per `loss.kl_estimator` (logged as `kl_loss` either way). Separate from the reward's "
            "`kl_coeff`, which usually goes to 0 when this is on"),
        Key("kl_estimator", Choice(options=KL_LOSS_ESTIMATORS), "k3",
            "the loss's per-token KL, d = logprob - ref_logprob: `k1` d, `k2` d^2 / 2, `k3` exp(-d) + d - 1 "
            "(d clamped to [-20, 20], the value to at most 10, as verl's `low_var_kl`); `k1+`, `k3+`: the value "
            "of k1, k3 with the gradient of k2 (straight-through, verl)"),
    ),
    or_else=" or a `_component_: torchtune.rlhf.loss.PPOLoss` block",
)

SPECULATIVE_DRAFTS = ("previous", "ngram", "drafter", "none")
SPECULATIVE_NOISE = ("per_step", "per_prompt")
SPECULATIVE = Block(
    keys=(
        Key("enabled", Bool(), False,
            "sample with position-keyed noise: a row's noise at response position t is a function of the run's "
            "seed, the round, the prompt's tokens, the row's sample index and t, so a draft can be checked in one "
            "forward and the response is still the one plain decoding samples (see [Speculative rollouts]"
            "(speculative.md)). Not with `env` or `compile.rollout`"),
        Key("draft", Choice(options=SPECULATIVE_DRAFTS), "previous",
            "`previous`: the last response sampled for the same prompt and sample index is the draft; `ngram`: "
            "prompt lookup, the tokens that followed the row's last tokens earlier in its prompt and response; "
            "`drafter`: your own, the `speculative.drafter` component's; `none`: no drafts (plain decoding with "
            "position-keyed noise)"),
        Key("drafter", Component(optional=True, note="with `draft: drafter`"), None,
            "your own drafter (with `draft: drafter`): called with each row's prompt tokens and sample index, it "
            "returns a draft (token ids) or None per row; optional `record(prompts, sample_indices, responses)` "
            "sees what was sampled, `state_dict`/`load_state_dict` go into checkpoints. Any draft leaves the "
            "samples as they are (see [Speculative rollouts](speculative.md#your-own-drafter))"),
        Key("max_draft_tokens", Count(), 8, "draft tokens one verification forward checks per row"),
        Key("min_draft_rows", Number(ge=0, le=1), 0.5,
            "verification forwards check `max_draft_tokens` positions only while at least this share of the rows "
            "still generating has draft tokens to offer, else one position: a wide forward costs each row the "
            "same, so on hardware where it costs more than a narrow one (a CPU) rows without a draft pay for the "
            "others; 0: wide whenever any row has a draft"),
        Key("noise", Choice(options=SPECULATIVE_NOISE), "per_step",
            "`per_step`: the round is the step, so every visit of a prompt draws fresh noise; `per_prompt`: one "
            "round for the run, so a prompt's visits share their noise (an unchanged policy samples its last "
            "response again, and a draft is kept longer; the visits are no longer independent)"),
        Key("max_stored", Count(), 65536, "(prompt, sample index) pairs whose last response is kept as a draft; "
            "the oldest go first"),
    ),
)

ROLLOUT_CORRECTION = Block(
    keys=(
        Key("mode", Choice(options=CORRECTION_MODES, optional=True), None,
            "correct the policy loss for the rollout's numerics: the trainer recomputes the old logprobs of "
            "every token (one more policy forward while scoring), and each token's policy loss is weighted by "
            "`tis` min(pi_old / pi_rollout, threshold), or `mis` 1 where the ratio is within [1 / threshold, "
            "threshold] and 0 elsewhere; null: off (the generator's logprobs are the old ones)"),
        Key("level", Choice(options=CORRECTION_LEVELS), "token",
            "the ratio is each token's (`token`) or its sequence's, the product of its tokens' (`sequence`)"),
        Key("threshold", Number(gt=1), 2.0, "`C` of `mode`"),
    ),
)

VALUE_PRETRAIN = Block(
    keys=(
        Key("max_steps", Int(ge=0), 0,
            "value pretraining: at most this many steps before PPO's first, each training the value model "
            "alone on a batch of the frozen starting policy's rollouts; 0: off. Not counted in `num_ppo_steps`"),
        Key("tolerance", Number(gt=0, optional=True), None,
            "end pretraining early once `|M_k - M_{k-w}| / |M_{k-w}| < tolerance`, `M_k` the mean value loss "
            "of the last `window` pretraining steps (e.g. 0.05); null: run `max_steps`"),
        Key("window", Count(), 5, "`w`, pretraining steps per moving average of the value loss"),
        Key("lmbda", Number(ge=0, le=1), 1.0,
            "GAE lambda of the critic's returns during pretraining; 1.0: Monte-Carlo returns (VC-PPO)"),
    ),
)

# The metrics an evaluation logs (docs/evaluation.md); `val/pass@<k>` and `val/reward/<part>`
# are added by `eval.num_samples` and by a `WeightedSum` reward.
EVAL_METRICS = ("val/reward_mean", "val/pass@1", "val/response_length")

EVAL = Block(
    keys=(
        Key("every_n_steps", Count(optional=True), None,
            "evaluate the policy on held-out prompts every N steps (counted as `save_every_n_steps` counts "
            "them) and after the last step, logging `val/` metrics; null: no evaluation. See "
            "[Evaluation](evaluation.md)"),
        Key("before_training", Bool(), True,
            "with `every_n_steps`: also evaluate the starting policy before step 1 (logged at step 0)"),
        Key("dataset", Component(optional=True), None,
            "the held-out prompts, a block like `dataset` (same builders); null: `dataset` with `field: heldout` "
            "when its JSON data file has a `heldout` split (the embedded arithmetic tasks), else an error "
            "naming this key"),
        Key("datasets", NamedComponents(optional=True, what="dataset blocks", null_means="`dataset`'s held-out split",
                                        reserved=("reward",)), None,
            "several held-out sets evaluated side by side, by name (e.g. `{heldout: null, ood: {...}}`): each "
            "set's metrics are logged as `val/<name>/...` (`val/ood/pass@1`); instead of `dataset`, whose one "
            "set logs `val/...`"),
        Key("max_prompts", Count(optional=True), None, "evaluate each dataset's first N prompts only; null: all"),
        Key("num_samples", Count(), 1,
            "`k`, responses per prompt; `val/pass@k` is logged beside `val/pass@1` when k > 1"),
        Key("temperature", Number(gt=0, note="for greedy decoding use top_k=1"), 1.0,
            "sampling temperature of the evaluation (training's `temperature` is separate)"),
        Key("top_k", Int(optional=True, ge=1), 1, "sample from the `k` most likely tokens; 1: greedy; null: all"),
        Key("top_p", Number(optional=True, gt=0, le=1), None,
            "sample from the smallest set of tokens whose probability reaches `p`; null: all"),
        Key("max_generated_tokens", Count(optional=True), None, "response tokens per prompt; null: training's"),
        Key("batch_size", Count(optional=True), None,
            "rows (responses) per generation call on each process; null: the training generator's "
            "(`forward_batch_size` / processes); at most the responses of a process's largest set"),
        Key("reward", Component(optional=True, note="a reward function, as `reward`"), None,
            "the evaluation's score; null: the training reward (its function or its reward model). The "
            "penalties (`penalise_no_eos`, `min_response_length`) apply as in training; the KL penalty does not"),
        Key("correct_threshold", Number(), 1.0,
            "a response is correct (`val/pass@k`) when its score is at least this; `ExactMatch` scores 1.0 "
            "for a match"),
        Key("best_metric", Text(what="a `val/` metric the evaluation logs"), "val/reward_mean",
            "the metric that picks the best checkpoint and drives `early_stop_patience`: `val/reward_mean`, "
            "`val/pass@1`, `val/pass@<num_samples>`, `val/response_length` or `val/reward/<part>` "
            "(`val/<name>/...` with `datasets`)"),
        Key("best_mode", Choice(options=("max", "min")), "max", "whether a higher or a lower `best_metric` is better"),
        Key("early_stop_patience", Count(optional=True), None,
            "stop the run (after saving) once this many evaluations in a row have not improved on the best; "
            "null: never"),
        Key("on_error", Choice(options=("stop", "skip")), "stop",
            "what an evaluation that raises (its reward, its prompts' generation) does: `stop` ends the run "
            "with the error, the steps completed before it saved, and a resume runs that evaluation again; "
            "`skip` logs a warning with the cause and trains on without that evaluation (no `val/` row, no "
            "best or early-stop count from it; one process only, under several a failure stops the run). "
            "`stop` by default: an evaluation that fails once fails at every step, and a run that trains on "
            "without one keeps no best checkpoint and never stops early, unseen"),
    ),
)

TURNS = Block(
    keys=(
        Key("max_turns", Count(), 4,
            "assistant turns per episode at most; a tool call in the last one is not answered and the "
            "episode counts as truncated"),
        Key("max_observation_tokens", Count(), 32,
            "an observation's rendered tokens (tool turn and the next turn's generation prompt) at most; a "
            "longer observation is cut from its end (counted in `turns/observations_cut`)"),
        Key("observation_template", Text(optional=True, what="a string holding `{observation}` once"), None,
            "the text an observation is rendered as (tokenized once, appended as tokens), e.g. `={observation}`; "
            "null: the tokenizer's chat template renders it as a `tool` turn followed by the next assistant "
            "turn's generation prompt"),
        Key("cache_tokens", Count(optional=True), None,
            "KV cache columns after the prompt; rows decode in lockstep, so a row that finished its turn "
            "leaves a gap while the others write theirs; null: 2 * `max_generated_tokens`"),
        Key("timeout_s", Number(gt=0, optional=True), 10.0,
            "an environment step running longer ends the row's episode (counted, logged) and is stopped "
            "(with `isolation: process`); null: no limit, the step is called directly in the run's thread"),
        Key("isolation", Choice(options=("process", "thread")), "process",
            "where an environment step with a `timeout_s` runs. `process`: in a worker process forked from the "
            "run (the environment needs no pickling; ~55 us a call), killed and replaced when a step overruns, "
            "so no step hangs the run or runs on after its timeout; `thread`: in a worker thread (~40 us a "
            "call), abandoned when a step overruns: it cannot be stopped, runs on, and one that holds the "
            "interpreter lock stalls the run. `thread` is for an environment that needs the GPU or state the "
            "run changes. See [Multi-turn rollouts](multi_turn.md)"),
        Key("stop_strings", Strings(optional=True), None,
            "a turn also ends once its text holds one of these (e.g. a tool call's closing tag `</calc>`): "
            "its tokens after the one that completes it are dropped, as if never sampled; null: a turn ends at "
            "a stop token only"),
        Key("max_env_failures", Int(ge=0, optional=True), None,
            "stop the run (after saving the last completed step) when more environment steps than this fail "
            "in one PPO step's episodes, over every process (raised, timed out, returned something else than an "
            "`EnvStep`); null: each failure only ends its episode"),
        Key("gae", Choice(options=("token", "turn")), "token",
            "`token`: GAE over the policy's tokens, observations skipped; `turn`: each assistant turn one "
            "step, valued at its first token, every token given its turn's advantage (AReaL's turn-level "
            "GAE). `gae` only"),
    ),
)

SCHEMA: Tuple[Key, ...] = (
    Key("output_dir", Text(what="a folder path"), REQUIRED,
        "where checkpoints and logs go; the shipped configs use a new folder per run (`${ppo_run_id:}`)"),
    Key("tokenizer", Component(), REQUIRED,
        "a torchtune tokenizer builder; its `pad_id` fills the left padding of prompts and the "
        "positions after a stop token. Padding is told by each prompt's length, never by token "
        "value, so a prompt may hold the pad id as a real token (`<unk>` is 0, like the pad id, "
        "in Llama-2 tokenizers)", must_match=True),
    Key("dataset", Component(), REQUIRED,
        "a torchtune dataset whose samples have `tokens` (e.g. `text_completion_dataset` with "
        "`add_eos: False`)", must_match=True),
    Key("policy_model", Component(), REQUIRED,
        "builder of the policy (and the reference policy); a LoRA builder (e.g. `torchtune.models."
        "llama3_2.lora_llama3_2_1b` with `lora_attn_modules`, `apply_lora_to_mlp`, "
        "`apply_lora_to_output`, `lora_rank`, `lora_alpha`) trains adapters only and makes the "
        "reference the same model with its adapters off; see [LoRA](lora.md)", must_match=True),
    Key("reward_and_value_model", Component(optional=True), None,
        "builder of the reward model and the value model (one output); needed with "
        "`reward_checkpointer` or `advantage_estimator: gae`. A LoRA builder (e.g. "
        "`torchtune_ppo.models.lora_llama3_2_1b_classifier`) makes the value model train its adapters "
        "and head, and the reward model run with its adapters off; see [LoRA](lora.md)", must_match=True),
    Key("checkpointer", Component(), REQUIRED,
        "checkpointer of the trained policy: loads its start weights, saves it"),
    Key("ref_policy_checkpointer", Component(optional=True), None,
        "the frozen reference policy's weights (normally the same files as the policy's start); "
        "required unless the policy is LoRA (its reference is its own base: leave this out)"),
    Key("value_checkpointer", Component(optional=True), None,
        "the value model: loads its start weights (normally the reward model's), saves it. Needed "
        "by `advantage_estimator: gae`; the critic-free estimators build no value model and ignore "
        "it (with a note)"),
    Key("reward_checkpointer", Component(optional=True), None,
        "the frozen reward model's weights; give it or `reward`"),
    # A function reward replaces the reward model; reward_and_value_model then builds the value
    # model only.
    Key("reward", Component(optional=True, note="a factory or class of the reward function, e.g. "
                                                 "torchtune_ppo.rewards.ExactMatch"), None,
        "a reward function of the decoded texts (`torchtune_ppo.rewards`) instead of a reward "
        "model; give it or `reward_checkpointer`"),
    Key("env", Component(optional=True, note="an environment, e.g. torchtune_ppo.envs.Calculator"), None,
        "multi-turn episodes: after each assistant turn the environment reads it and answers with an "
        "observation (a tool's result) or ends the episode; the observation is appended as tokens and the "
        "policy goes on. The reward scores the whole episode; observation tokens carry no loss. null: one "
        "response per prompt. See [Multi-turn rollouts](multi_turn.md)"),
    Key("turns", TURNS, TURNS.defaults(), "multi-turn episodes with `env`: the keys below"),
    Key("share_reward_value_base", Bool(), True,
        "a LoRA `reward_and_value_model` whose `value_checkpointer` reads the `reward_checkpointer`'s "
        "files builds one frozen base for both (noted at start): the value model with its adapters "
        "and head, the reward model with the adapters off and the checkpoint's head. Same scores as "
        "two copies, one base's memory less; false: two copies. See [LoRA](lora.md)"),
    Key("seed", Int(optional=True), None,
        "seed of every random draw (data order, sampling); null: torchtune picks one", must_match=True),
    Key("shuffle", Bool(), True, "shuffle the prompts each epoch", must_match=True),
    Key("device", Device(), "cpu",
        "`cpu`, `cuda`, `cuda:N`, ...; a device this machine lacks is an error (torchtune would "
        "run on the CPU without a word)"),
    Key("dtype", Choice(options=("fp32", "bf16", "auto")), "fp32",
        "dtype of the models' weights and compute. On a CPU without native bf16 (no `avx512_bf16` or "
        "`amx_bf16`) bf16 is emulated and slower than fp32 (said at start-up). `auto`: bf16 where the "
        "device multiplies it natively (a CPU with `avx512_bf16` or `amx_bf16` in `/proc/cpuinfo`, a CUDA "
        "GPU of compute capability 8.0 and up), else fp32; decided once at start-up and logged with its "
        "reason; resuming, the dtype the checkpoint was saved in. See "
        "[Precision](precision.md#which-dtype-auto-picks)", must_match=True),
    Key("fp32_logits", Bool(), False,
        "with `dtype: bf16`: the policy's and the reference's output projection computes in fp32 "
        "(bf16 hidden states and weight cast up, logits never rounded to bf16), so the generator, "
        "scoring and the loss step read logprobs without bf16 logits rounding; see "
        "[Precision](precision.md#fp32-logits). No effect in fp32. An output projection with a "
        "LoRA adapter is refused"),
    Key("master_weights", Bool(), True,
        "with `dtype: bf16`: the optimizer steps fp32 copies of the trained weights (its state fp32 too, "
        "both saved in checkpoints) and rounds them into the bf16 weights after each step. false: AdamW on "
        "the bf16 weights, as torchtune's bf16 runs, where a step below half a bf16 spacing (2.4e-4 at "
        "0.05) rounds to nothing. On several processes the masters are the trained models' fp32 FSDP2 shards, "
        "gathered in bf16 to compute (see [Precision](precision.md#bf16-with-fp32-master-weights)). No effect in "
        "fp32; with `optimizer_in_bwd` the bf16 weights are trained directly (noted at start)"),
    Key("master_rounding", Choice(options=("nearest", "dither")), "dither",
        "with `dtype: bf16` and `master_weights`: how each fp32 master is rounded into its bf16 weight after "
        "an optimizer step. `nearest`: round to nearest, so a weight changes only once its master has moved "
        "half a bf16 spacing (masters start on the bf16 grid: at lr 1e-5 most weights stay as they were for "
        "the first dozen steps). `dither`: each weight rounds up past a fixed threshold of its own (a hash of "
        "its position), so that of the weights whose masters moved a fraction `d` of a spacing, a share `d` "
        "changes: the model moves on average as its masters do (the shipped LoRA configs set `nearest`: "
        "dithering did not help them). One process only (on several, FSDP2 rounds to nearest); see "
        "[Precision](precision.md#rounding-the-masters)"),
    # "auto" leaves the cores other processes keep busy at start-up: one busy process beside two
    # OpenMP threads on 2 cores made a step 4.3x slower (RESULTS, "CPU threads under load").
    Key("cpu_threads", Count(also=("auto",)), "auto",
        "threads for CPU work: `auto` is every core this process may use less those other processes "
        "keep busy at start-up (`OMP_NUM_THREADS`, when set, wins), or exactly that many"),
    Key("num_ppo_steps", Count(), REQUIRED,
        "PPO steps to run; or torchtune's `num_steps`, which counts prompts "
        "(`num_steps // batch_size` PPO steps)", torchtune_key="num_steps"),
    Key("batch_size", Count(), REQUIRED,
        "prompts per PPO step (each generated `num_samples_per_prompt` times)", must_match=True),
    Key("forward_batch_size", Count(), REQUIRED,
        "rows (responses) per generation and scoring call; the KV cache is allocated for this many "
        "rows. Must divide `batch_size * num_samples_per_prompt`"),
    Key("ppo_epochs", Count(), 1, "passes over each batch of trajectories", must_match=True),
    Key("ppo_batch_size", Count(), REQUIRED,
        "trajectories (responses) per optimizer step. Must divide `batch_size * num_samples_per_prompt`", must_match=True),
    Key("gradient_accumulation_steps", Count(), 1,
        "micro-batches per optimizer step. Must divide `ppo_batch_size`", must_match=True),
    Key("optimizer", Component(), REQUIRED,
        "torch optimizer builder over the policy and value parameters", must_match=("_component_",)),
    Key("optimizer_in_bwd", Bool(), False,
        "one optimizer per parameter, stepped during backward: no full set of gradients is ever "
        "held (how torchtune fits 7B on one GPU). Needs `gradient_accumulation_steps: 1`, no "
        "`lr_scheduler` and no `clip_grad_norm`", must_match=True),
    Key("lr_scheduler", Component(optional=True), None,
        "a torchtune learning-rate scheduler, e.g. `torchtune.training.lr_schedulers."
        "get_cosine_schedule_with_warmup` with `num_warmup_steps`; the recipe passes the optimizer "
        "and `num_training_steps` (optimizer steps of the whole run). null: constant lr", must_match=("_component_",)),
    Key("clip_grad_norm", Number(optional=True, gt=0), None, "max gradient norm, or null for none"),
    Key("max_prompt_len", Count(optional=True), None,
        "`P`: every prompt is left-padded to this width; null: the longest prompt of the dataset "
        "(read once before any model loads)", must_match=True),
    Key("long_prompts", Choice(options=("truncate", "error")), "truncate",
        "a longer prompt is `truncate`d to its last `P` tokens (counted in the "
        "`prompts_truncated` metric) or is an `error`", must_match=True),
    Key("max_generated_tokens", Count(), REQUIRED,
        "`T`: response tokens per prompt. `P + T` must fit the models' `max_seq_len`", must_match=True),
    Key("temperature", Number(gt=0, note="for greedy decoding use top_k=1"), 1.0,
        "sampling temperature; logprobs are taken at `temperature` over the full vocabulary"),
    Key("top_k", Int(optional=True, ge=1), None, "sample from the `k` most likely tokens; null: all"),
    Key("top_p", Number(optional=True, gt=0, le=1), None,
        "sample from the smallest set of tokens whose probability reaches `p`; null: all"),
    Key("stop_token_ids", TokenIds(), REQUIRED,
        "a response ends at its first stop token (kept); later tokens become padding"),
    Key("penalise_no_eos", Bool(), True,
        "a response with no stop token scores `reward_penalty` instead"),
    Key("min_response_length", Count(optional=True), None,
        "a response with fewer valid tokens scores `reward_penalty` instead; at most "
        "`max_generated_tokens`. null: no minimum"),
    Key("reward_penalty", Number(note="usually < 0"), -3.0,
        "the score of a response that `penalise_no_eos` or `min_response_length` penalises"),
    Key("kl_coeff", Number(ge=0), 0.05,
        "per-token KL penalty `-kl_coeff * (logprob - ref_logprob)`"),
    Key("kl_estimator", Choice(options=KL_ESTIMATORS), "k1",
        "the per-token KL in the reward, with d = logprob - ref_logprob: `k1` d, `k2` d^2 / 2, "
        "`k3` exp(-d) + d - 1 (verl's `low_var_kl` without its clamps: docs/algorithms.md)"),
    Key("kl_target", Number(gt=0, optional=True), None,
        "adaptive KL (Ziegler et al.): after each step `kl_coeff *= 1 + clip(kl / kl_target - 1, "
        "-0.2, 0.2) * n / kl_horizon`, n = batch_size * num_samples_per_prompt sequences, kl the "
        "mean per-sequence KL; null: `kl_coeff` fixed"),
    Key("kl_horizon", Number(gt=0), 10000, "the adaptive KL's horizon, in sequences"),
    Key("whiten_rewards", Bool(), False,
        "whiten the per-token rewards before GAE (torchtune's key; its default is off)"),
    Key("gamma", Number(ge=0, le=1), 1.0, "discount of GAE and of `reinforce_plus_plus`'s returns"),
    Key("lmbda", Number(ge=0, le=1), 0.95,
        "GAE lambda (of the critic's returns and, unless `lmbda_actor` or `lmbda_length_alpha` is "
        "set, of the actor's advantages)"),
    Key("lmbda_actor", Number(ge=0, le=1, optional=True), None,
        "decoupled GAE (VAPO): the actor's advantages use this lambda, the critic's returns `lmbda`; "
        "null: `lmbda`. `gae` only"),
    Key("lmbda_length_alpha", Number(gt=0, optional=True), None,
        "length-adaptive GAE (VAPO): the actor's lambda is `1 - 1 / (alpha * l)` (at least 0), l the "
        "response's valid tokens, e.g. 0.05; null: off. `gae` only"),
    Key("critic_warmup_steps", Int(ge=0), 0,
        "the first N PPO steps train the value model only (the policy and its optimizer state are "
        "left as they are). `gae` only: the critic-free estimators have no value model"),
    Key("value_pretrain", VALUE_PRETRAIN, VALUE_PRETRAIN.defaults(),
        "value pretraining (VC-PPO, VAPO): the keys below; see [Value pretraining](algorithms.md#value-pretraining). "
        "`gae` only"),
    Key("speculative", SPECULATIVE, SPECULATIVE.defaults(),
        "exact speculative rollouts: the keys below; off by default", must_match=("enabled", "noise")),
    Key("rollout_correction", ROLLOUT_CORRECTION, ROLLOUT_CORRECTION.defaults(),
        "the rollout/training mismatch corrected (TIS, MIS): the keys below; see [Precision](precision.md). "
        "Not with a LoRA policy (its reference forward has the adapters off)"),
    Key("advantage_estimator", Choice(options=ADVANTAGE_ESTIMATORS), "gae",
        "`gae` (PPO with a value model), or critic-free, with no value model: `grpo`, `dr_grpo`, "
        "`rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`; see [Algorithms](algorithms.md)", must_match=True),
    Key("num_samples_per_prompt", Count(), 1,
        "responses generated per prompt (a group). `batch_size` counts prompts, so a step has "
        "`batch_size * num_samples_per_prompt` responses; `forward_batch_size` and `ppo_batch_size` "
        "count responses and must divide that. `grpo`, `dr_grpo`, `rloo` and "
        "`reinforce_plus_plus_baseline` need at least 2", must_match=True),
    Key("share_group_prefill", Bool(optional=True), None,
        "with `num_samples_per_prompt` = n > 1, compute each group's prompt once instead of n "
        "times: one prefill per group in generation (its KV cache copied into the n rows), and one "
        "prompt copy per packed row before the group's responses in scoring and in the loss step, "
        "whose minibatches are then drawn by whole groups. null: on wherever the sizes allow "
        "(`forward_batch_size` per process a multiple of n, no `compile.rollout`), off otherwise "
        "with a note; true: on, and those sizes are an error; false: off. See [Group "
        "sampling](group_sampling.md#one-prompt-per-group-share_group_prefill)"),
    Key("share_prompt_prefix", Bool(optional=True), None,
        "without shared groups, pack the tokens every prompt of a batch begins with (a chat "
        "template's system turn) once per packed row in scoring and in the loss step, each "
        "sequence's other prompt tokens and its response after it, in rows 4 times as long; and "
        "compute it once per generation call (the evaluation's too, unless false). null: "
        "on when the first 256 prompts of the dataset share at least max(8, max_prompt_len / 4) "
        "tokens, with a note either way; true: on (an error with shared groups, `compile.rollout` "
        "or `env`); false: off. See [Performance](performance.md#a-prefix-every-prompt-shares-share_prompt_prefix)"),
    Key("segment_attention", Bool(), False,
        "in scoring and in the loss step, each packed sequence attends only its own tokens and its "
        "shared prompt's, gathered per sequence, instead of through a block-diagonal mask over the "
        "whole packed row, which computes every pair of the row (rows of several sequences, 4 "
        "times as long with `share_prompt_prefix`). The same outputs up to rounding. Off by "
        "default: measured slower on the CPU (its gathers' backward costs more than the scores it "
        "saves). Not under FSDP's fixed-shape loss step. See "
        "[Performance](performance.md#attention-by-sequence-segment_attention)"),
    # A `_component_` block (torchtune's PPOLoss) keeps its own defaults instead of these.
    Key("loss", LOSS, LOSS.defaults(),
        "PPO loss: the plain keys below, or torchtune's `PPOLoss` `_component_` block (which keeps "
        "its own defaults)"),
    Key("compile", CompileBlock(), False,
        "`true`/`false`, or `{generate, trajectory, loss_step, rollout, optimizer, layers, mode}`; see "
        "[Compiling](compiling.md). `optimizer` (default: as `loss_step`) makes each bf16 master "
        "weight's Adam/AdamW step one compiled pass (fp32 runs already step in one fused kernel). "
        "`layers` (on with a bare `compile: true`; off in a mapping that leaves it out) compiles one transformer layer per use (decode, prefill, "
        "scoring, training) and runs every layer of every model through it, the regions compiled "
        "around the layer stack: a first step in a fraction of the time, one process only "
        "([Compiling](compiling.md#one-layer-compiled-for-every-layer-compilelayers)). "
        "`mode` is the `torch.compile` mode of the generation regions "
        "(`reduce-overhead`: CUDA graphs for the decode step); the other regions use the default mode"),
    Key("compile_cache", BoolOrPath(), True,
        "with any region compiled: after the first step the regions' inductor and AOTAutograd "
        "artifacts are saved to `<output_dir>/compile_cache.bin` (or the file named), and a run "
        "that finds the file at start reads it first, so that a resume on a fresh machine does not "
        "compile again; `false`: off. A second run on the same machine reuses torch's own caches "
        "either way. See [Compiling](compiling.md#time-to-first-step)"),
    Key("enable_activation_checkpointing", Bool(), False,
        "recompute activations of the trained models in backward"),
    Key("shard_frozen_models", Bool(), False,
        "on several processes: shard the reference policy and reward model with FSDP2 like the "
        "trained models (`1/W` of their weights per device, gathered layer by layer for their "
        "forwards, or whole for compiled scoring) instead of a whole copy on every rank. No "
        "effect on one process. See [Several processes](distributed.md)"),
    Key("save_every_n_steps", Count(optional=True), None,
        "save a checkpoint every N steps (and always at the end, and on Ctrl-C / SIGTERM / SIGHUP); "
        "null: only then"),
    Key("save_every_n_epochs", Count(optional=True), None,
        "also save after every N passes over the dataset (torchtune's key); null: not"),
    Key("keep_last_n_checkpoints", Count(optional=True), None,
        "keep only the newest N complete checkpoints, so long runs fit on disk; null keeps all"),
    Key("checkpoint_format", Choice(options=("full", "sharded")), "full",
        "`full`: each checkpoint holds the trained models in Hugging Face format, gathered to and "
        "written by one process; `sharded`: every process writes its own shards of the weights, "
        "optimizer state and fp32 masters (torch.distributed.checkpoint), nothing is gathered, and a "
        "resume reshards to any number of processes; `tune-ppo export` turns one into Hugging Face "
        "folders. See [Several processes](distributed.md#checkpoints)"),
    Key("async_save", Bool(), False,
        "with `checkpoint_format: sharded`: a save copies the state to host memory and writes it in "
        "the background while the next steps run (one save at a time; a save at a stop, a failure or "
        "the end is written before the run goes on)"),
    Key("save_adapter_weights_only", Bool(), False,
        "LoRA models: every checkpoint holds their adapters (PEFT layout); the run's last one also "
        "the merged full weights (HF format) unless this is true (torchtune's key)"),
    Key("resume_from_checkpoint", Bool(), False,
        "continue from the newest complete checkpoint in `output_dir`"),
    Key("resume_accept_data_change", Bool(), False,
        "a resume whose data differ from the data the checkpoint was trained on (a data file's "
        "size, sha256 or the dataset's row count; every checkpoint records them) stops, naming "
        "the file and what changed; true: continue over the changed data from the saved batch "
        "position, with a warning"),
    # An update whose loss or gradients are not finite is skipped; this many in a row means the
    # run has diverged, so it stops instead of burning the rest of its steps.
    Key("max_consecutive_skipped_steps", Count(), 3,
        "stop the run after this many steps in a row whose update was skipped for non-finite values"),
    Key("eval", EVAL, EVAL.defaults(),
        "evaluation on held-out prompts during training (`val/` metrics, the best checkpoint, early "
        "stopping): the keys below; see [Evaluation](evaluation.md)"),
    Key("metric_logger", Component(optional=True), None,
        "torchtune metric logger; null: torchtune's `DiskLogger` in `<output_dir>/logs`"),
    Key("log_every_n_steps", Count(), 1, "how often the metric logger logs"),
    Key("log_samples_every_n_steps", Count(optional=True), None,
        "print a few (prompt, response, score) rows every N steps and append them to "
        "`<output_dir>/logs/samples.jsonl` (and to wandb as a table when a wandb run is active); "
        "null: never"),
    Key("log_peak_memory_stats", Bool(), False, "add torchtune's memory stats on CUDA"),
    Key("profiler", Component(optional=True), None,
        "torchtune's profiler block (`torchtune.training.setup_torch_profiler`); null: off"),
)

KEYS: Dict[str, Key] = {k.name: k for k in SCHEMA}
# Keys of torchtune 0.6.1's PPO recipe config that mean nothing here, with the note printed
# once when a config gives them.
NOTED_KEYS = {
    "enable_kv_cache": "generation always uses a static KV cache here; enable_kv_cache is ignored.",
}
LOSS_KEYS = tuple(k.name for k in LOSS.keys)
# The keys (or dotted sub-keys) a resume must keep as saved (checkpointing.resume_config).
MUST_MATCH = tuple(k.name if k.must_match is True else f"{k.name}.{sub}"
                   for k in SCHEMA if k.must_match for sub in ((None,) if k.must_match is True else k.must_match))
VALUE_PRETRAIN_KEYS = tuple(k.name for k in VALUE_PRETRAIN.keys)
ROLLOUT_CORRECTION_KEYS = tuple(k.name for k in ROLLOUT_CORRECTION.keys)
SPECULATIVE_KEYS = tuple(k.name for k in SPECULATIVE.keys)
EVAL_KEYS = tuple(k.name for k in EVAL.keys)
# Views of SCHEMA under the names the config module exported before it had one.
REQUIRED_KEYS = tuple(k.name for k in SCHEMA if k.required)
BOOL_KEYS = tuple(k.name for k in SCHEMA if isinstance(k.kind, Bool))
LONG_PROMPTS = KEYS["long_prompts"].kind.options


def defaults() -> Dict[str, Any]:
    """The optional keys and their defaults (a fresh dict)."""
    return {k.name: k.default for k in SCHEMA if not k.required}


OPTIONAL_KEYS = defaults()


def markdown_table() -> str:
    """The table of ``docs/config.md``: one row per key (and per ``loss`` sub-key)."""
    rows = ["| key | valid values | default | meaning |", "| --- | --- | --- | --- |"]
    for key in SCHEMA:
        rows.append(_row(f"`{key.name}`", key))
        if isinstance(key.kind, Block):
            rows += [_row(f"`{key.name}.{sub.name}`", sub) for sub in key.kind.keys]
    return "\n".join(rows)


def _row(name: str, key: Key) -> str:
    if key.required:
        default = "required" + (f" (or `{key.torchtune_key}`)" if key.torchtune_key else "")
    else:
        default = f"`{_yaml(key.default)}`"
    doc = key.doc
    if key.must_match:
        which = "" if key.must_match is True else f" (its {', '.join(f'`{k}`' for k in key.must_match)})"
        doc += f"; a resume must keep the saved value{which}"
    cells = [name, key.kind.valid, default, doc]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        return _flow(value)
    return str(value)


# --------------------------------------------------------------------------------------------
# The compile block
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileConfig:
    """Which regions run compiled (``compile:`` in the YAML)."""

    generate: bool = False
    trajectory: bool = False
    loss_step: bool = False
    # Steps 1-6 as one region (unrolled generation + scoring); replaces generate/trajectory.
    rollout: bool = False
    mode: str = "default"
    # bf16 master weights: each parameter's Adam/AdamW step, clip and rounding as one compiled pass.
    optimizer: bool = False
    # One transformer layer compiled per use and called for every layer of every model; the
    # regions compile around the layer stack (torchtune_ppo.compile.layer_steps).
    layers: bool = False


COMPILE_MODE = Choice(options=COMPILE_MODES)


def check_compile_mode(mode: Any, key: str = "compile.mode") -> None:
    """Check a ``torch.compile`` mode.

    Args:
        mode (Any): the mode to check.
        key (str): how the message names the setting.

    Raises:
        ValueError: when ``mode`` is not one of ``COMPILE_MODES``.
    """
    COMPILE_MODE.check(key, mode)


def parse_compile(value: Any) -> CompileConfig:
    """Read the ``compile`` setting.

    ``compile: true|false`` sets every region (``rollout`` stays off: it replaces
    ``generate`` + ``trajectory``) and ``layers`` with them: ``compile=True`` is the fast path,
    one layer compiled per use (turned off with a note on several processes). A mapping must
    name every region; only ``mode``, ``layers`` (off when left out) and ``optimizer`` (which
    follows ``loss_step`` when left out) are optional.
    A partial mapping is refused because it is what OmegaConf makes of
    ``compile=True compile.generate=False`` on the command line: the bool is dropped, so the
    regions left out could mean either on or off.

    Args:
        value (Any): a bool, or a mapping with keys ``COMPILE_KEYS``.

    Returns:
        CompileConfig: the regions to compile and the mode.

    Raises:
        ValueError: on an unknown key, a missing region, a non-bool region or a bad mode.
    """
    if isinstance(value, bool):
        return CompileConfig(value, value, value, optimizer=value, layers=value)
    if not isinstance(value, (dict, DictConfig)):
        raise ValueError(f"compile must be {KEYS['compile'].kind.valid}, got {_show(value)}.")
    block = OmegaConf.to_container(value) if isinstance(value, DictConfig) else dict(value)
    unknown = sorted(set(block) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(
            f"compile: unknown key(s) {unknown}; valid keys are {list(COMPILE_KEYS)}, "
            "or write a bare `compile: true|false` to set all regions."
        )
    for key in (*COMPILE_REGIONS, "optimizer", "layers"):
        if key in block:
            Bool().check(f"compile.{key}", block[key])
    missing = [k for k in COMPILE_REGIONS if k not in block]
    if missing:
        example = {k: block.get(k, k != "rollout") for k in COMPILE_REGIONS}
        if "mode" in block:
            example["mode"] = block["mode"]
        raise ValueError(
            f"compile: the block {_flow(block)} does not name the region(s) {missing}. "
            "On the command line `compile=True compile.generate=False` arrives as just "
            "such a block, with the bool dropped, so a region left out could mean on or "
            f"off. Name every region, e.g. compile={_flow(example)}, or use the bare "
            "compile=True|False for all regions."
        )
    mode = block.get("mode", "default")
    check_compile_mode(mode)
    if block.get("layers", False) and block["rollout"]:
        raise ValueError("compile.layers=True compiles each layer apart from the regions around it; "
                         "compile.rollout=True is steps 1-6 as one graph. Set one of them to False.")
    if block.get("layers", False) and mode in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"compile.layers=True runs the layers between the decode step's graphs, where "
                         f"compile.mode={mode!r} cannot capture them in CUDA graphs: set "
                         "compile.mode=default (or max-autotune-no-cudagraphs), or compile.layers=False.")
    return CompileConfig(**{k: block[k] for k in COMPILE_REGIONS}, mode=mode,
                         optimizer=block.get("optimizer", block["loss_step"]), layers=block.get("layers", False))


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------


def parse_device(device: Any) -> Optional[torch.device]:
    """``device`` as a ``torch.device`` of a kind in ``DEVICES``, or None if it is not one."""
    try:
        parsed = torch.device(device) if isinstance(device, str) else None
    except (RuntimeError, ValueError):
        return None
    return parsed if parsed is not None and parsed.type in DEVICES else None


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `top_k: true` is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """The value as the user wrote it, with its type when the type is the problem."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        return f"{value!r} (a bool)"
    if isinstance(value, str):
        return f"{value!r} (a string)"
    return repr(value)


def _flow(block: Mapping[str, Any]) -> str:
    """A mapping in the flow form the command line and YAML both accept."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in block.items()) + "}"

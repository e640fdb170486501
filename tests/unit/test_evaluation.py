"""Evaluation during training, piece by piece: pass@k, the sums over processes, the best and the
early stop, the scores, the prompts, the config, the recompile counter and the kept checkpoint."""

import itertools
import json
import logging
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import config as tt_config

from torchtune_ppo import distributed
from torchtune_ppo.checkpointing import store as ckpt
from torchtune_ppo.compile import RecompileCounter
from torchtune_ppo.config import validate_config
from torchtune_ppo.eval import EvalPrompts, EvalRecord, EvalScorer, Evaluator, eval_metrics, pass_at_k, prompt_shard, tally
from torchtune_ppo.eval import evaluator as evaluator_module
from torchtune_ppo.eval.data import default_eval_dataset, eval_blocks, eval_prompts
from torchtune_ppo.eval.evaluator import reward_parts
from torchtune_ppo.rewards import FormatMatch, FunctionReward, ModelReward, WeightedSum
from torchtune_ppo.rlhf import ScoringSettings
from torchtune_ppo.rollout.generation import Generator
from torchtune_ppo.run.logs import read_disk_log, read_eval_log
from torchtune_ppo.run.progress import Progress
from torchtune_ppo.run.watch import run_summary
from torchtune_ppo.ppo.value_pretrain import ValuePretraining

from conftest import EOS_ID, PAD_ID, VOCAB, left_padded_prompts, tiny_classifier, tiny_policy
from torchtune.models.llama2 import llama2_classifier

CONFIGS = Path(__file__).parents[2] / "recipes/configs"
ARITHMETIC, SENTIMENT = CONFIGS / "tiny/ppo_tiny_arithmetic.yaml", CONFIGS / "tiny/ppo_tiny_sentiment.yaml"
LOG = logging.getLogger("test_evaluation")
VP = ValuePretraining(max_steps=0, tolerance=None, window=5, lmbda=1.0)  # no value pretraining


# ----------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize("k, expected", [(1, 0.4), (2, 0.7), (5, 1.0)])
def test_pass_at_k_by_hand(k, expected):
    # n=5 responses, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
    # pass@5: every 5-subset holds both correct ones.
    assert pass_at_k(5, 2, k) == expected


def test_pass_at_k_is_the_chance_that_k_of_n_hold_a_correct_one():
    """Against the definition: every k-subset of n responses (c of them correct) counted, and
    against Chen et al.'s product form ``1 - prod(1 - k / i, i = n-c+1..n)``."""
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(correct, k))
                assert pass_at_k(n, c, k) == float(Fraction(sum(any(s) for s in subsets), len(subsets))), (n, c, k)
                chen = 1.0 if n - c < k else 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
                assert pass_at_k(n, c, k) == pytest.approx(chen, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_metrics_of_a_tally_by_hand():
    # 2 prompts x 3 responses; threshold 1.0: prompt 0 has 1 correct (1.0), prompt 1 has 2 (1.5, 1.0);
    # 0.99 is not correct.
    scores = torch.tensor([1.0, 0.0, -1.0, 1.5, 0.99, 1.0])
    lengths = torch.tensor([2, 4, 6, 1, 3, 5])
    parts = {"a": torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])}
    m = eval_metrics(tally(scores, lengths, num_samples=3, correct_threshold=1.0, parts=parts), 3)
    assert m["val/reward_mean"] == pytest.approx(3.49 / 6)
    assert m["val/pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert m["val/pass@3"] == 1.0  # each prompt has a correct response
    assert m["val/response_length"] == pytest.approx(21 / 6)
    assert m["val/reward/a"] == pytest.approx(0.5)
    one = eval_metrics(tally(scores, lengths, num_samples=1, correct_threshold=1.0), 1)
    assert one["val/pass@1"] == pytest.approx(3 / 6) and "val/pass@3" not in one


def test_prompt_blocks_cover_every_prompt_once_in_rank_order():
    for n in range(0, 12):
        for world in range(1, 5):
            blocks = [prompt_shard(n, r, world) for r in range(world)]
            assert [i for b in blocks for i in b] == list(range(n)), (n, world)
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


# ----------------------------------------------------------------------------- the best and the early stop


def _record(values, mode="max", patience=None, every=2):
    record = EvalRecord(every_n_steps=every, best_metric="val/x", best_mode=mode, early_stop_patience=patience)
    return record, [record.add(every * i, {"val/x": v}) for i, v in enumerate(values)]


def test_the_best_is_strictly_better_and_the_first_finite_one():
    record, improved = _record([0.3, 0.5, 0.5, 0.4, float("nan"), 0.6])
    assert improved == [True, True, False, False, False, True]  # a tie and a NaN do not improve
    assert (record.best_step, record.best_value, record.since_best) == (10, 0.6, 0)
    record, improved = _record([float("nan"), 0.5, 0.7, 0.2], mode="min")
    assert improved == [False, True, False, True] and record.best_step == 6


def test_early_stop_after_patience_evaluations_without_improvement():
    # best at step 2 (0.5); steps 4, 6 do not improve: patience 2 stops at step 6, not before.
    record = EvalRecord(every_n_steps=2, best_metric="val/x", early_stop_patience=2)
    stopped = []
    for step, v in [(0, 0.3), (2, 0.5), (4, 0.4), (6, 0.5)]:
        record.add(step, {"val/x": v})
        stopped.append(record.stopped)
    assert stopped == [False, False, False, True]
    assert "at step 2" in record.stop_message() and "than 0.5 " in record.stop_message()
    assert not _record([0.3, 0.2, 0.1])[0].stopped  # no patience: never


def test_when_an_evaluation_is_due():
    record = EvalRecord(every_n_steps=3, before_training=True)
    assert [s for s in range(0, 11) if record.due(s, last_step=s == 10)] == [0, 3, 6, 9, 10]
    record.add(9, {"val/reward_mean": 0.0})
    assert not record.due(9, last_step=True)  # not twice at one step
    assert not EvalRecord(every_n_steps=3, before_training=False).due(0, last_step=False)
    assert not EvalRecord().due(10, last_step=True)  # off


def test_a_restored_record_continues_the_count_and_follows_a_changed_metric():
    values = [0.3, 0.5, 0.4, 0.45, 0.2]
    whole, _ = _record(values, patience=3)
    half, _ = _record(values[:3], patience=3)
    state = half.state_dict()
    assert (state["best_step"], state["best_value"], state["since_best"]) == (2, 0.5, 1)
    resumed = EvalRecord(every_n_steps=2, best_metric="val/x", early_stop_patience=3)
    resumed.load_state_dict(state)
    for i, v in enumerate(values[3:], start=3):
        resumed.add(2 * i, {"val/x": v})
    assert resumed.state_dict() == whole.state_dict() and resumed.stopped and whole.stopped
    other = EvalRecord(every_n_steps=2, best_metric="val/x", best_mode="min")
    other.load_state_dict(state)  # the best worked out again under the resumed run's rule
    assert (other.best_step, other.best_value, other.since_best) == (0, 0.3, 2)


def test_progress_saves_and_restores_the_record_and_ends_the_run_on_an_early_stop():
    block = {"every_n_steps": 2, "before_training": True, "best_metric": "val/x", "best_mode": "max",
             "early_stop_patience": 1}
    progress = Progress(num_ppo_steps=10, batches_per_epoch=5, value_pretrain=VP, evaluation=block)
    progress.evaluation.add(0, {"val/x": 1.0})
    assert not progress.done and "evaluation" in progress.state_dict()
    progress.evaluation.add(2, {"val/x": 0.5})
    assert progress.done and not progress.all_steps_run
    again = Progress(num_ppo_steps=10, batches_per_epoch=5, value_pretrain=VP, evaluation=block)
    again.load_state_dict({"steps_run": 2, "epochs_run": 0, "batches_run_in_epoch": 2,
                           **progress.state_dict()})
    assert again.done and again.evaluation.history == progress.evaluation.history
    assert "evaluation" not in Progress(num_ppo_steps=1, batches_per_epoch=1, value_pretrain=VP).state_dict()


# ----------------------------------------------------------------------------- scores


class _Tokens:
    """Decodes ids as their numbers, space-separated."""

    pad_id = PAD_ID

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def _settings(prompt_len, penalise_no_eos=True):
    return ScoringSettings(prompt_len=prompt_len, pad_id=PAD_ID, temperature=1.0, penalise_no_eos=penalise_no_eos,
                           min_response_length=None, reward_penalty=-3.0)


def test_scores_get_the_training_penalties_and_a_weighted_sums_parts():
    # P = 3, T = 4: row 0 stops at its 2nd token; row 1 never stops.
    rows = torch.tensor([[PAD_ID, 5, 6, 7, EOS_ID, 9, 9], [5, 6, 7, 8, 9, 10, 11]])
    lens = torch.tensor([2, 3])
    fn = WeightedSum([FormatMatch("^7$"), FormatMatch("8")], [2.0, 0.5])
    reward = FunctionReward(fn, _Tokens())
    parts = reward_parts(reward, _Tokens())
    assert list(parts) == ["FormatMatch_1", "FormatMatch_2"]
    scores, seq_lens, got = EvalScorer(reward, _settings(3), torch.tensor([EOS_ID]), parts)(rows, lens, [None, None])
    # row 0's response is "7" (the stop token dropped): 2 * 1 + 0.5 * 0; row 1 has no stop token
    assert scores.tolist() == [2.0, -3.0] and seq_lens.tolist() == [2, 4]
    assert got["FormatMatch_1"].tolist() == [1.0, 0.0] and got["FormatMatch_2"].tolist() == [0.0, 1.0]
    assert reward_parts(FunctionReward(FormatMatch("x"), _Tokens()), _Tokens()) == {}


def test_a_reward_model_is_read_at_the_last_valid_token():
    """Against the classifier on each row alone, unpadded, up to its stop token."""
    model = tiny_classifier(3).eval()
    P = 4
    rows = torch.tensor([[PAD_ID, PAD_ID, 5, 6, 7, EOS_ID, 9], [5, 6, 7, 8, 9, 10, 11]])
    lens = torch.tensor([2, 4])
    with torch.no_grad():
        scores, _, _ = EvalScorer(ModelReward(model), _settings(P, penalise_no_eos=False),
                                  torch.tensor([EOS_ID]), {})(rows, lens, [None, None])
        alone = [model(torch.tensor([[5, 6, 7, EOS_ID]]))[0, -1, 0], model(rows[1:])[0, -1, 0]]
    assert scores.tolist() == pytest.approx([float(a) for a in alone], abs=1e-5)


@torch.no_grad()
def test_a_reward_model_scores_real_tokens_with_the_shared_prefix_once_a_row():
    """Prompts that begin alike, of several lengths, responses stopping at several points: the
    reward model runs on packed real tokens (fewer slots than the padded rows, the common
    prefix once per packed row), and each score is the classifier's on that row alone."""
    model = tiny_classifier(4).eval()
    P, T, stop = 8, 5, torch.tensor([EOS_ID])
    prompt_lens = [8, 4, 6, 5, 7, 4]
    rows = left_padded_prompts(prompt_lens, P, seed=3)
    shared = torch.tensor([11, 12, 13])  # every prompt's first three tokens
    for i, q in enumerate(prompt_lens):
        rows[i, P - q : P - q + 3] = shared
    responses = torch.randint(3, 64, (len(prompt_lens), T), generator=torch.Generator().manual_seed(4))
    for i, stop_at in enumerate([0, 2, 4, None, 1, 3]):  # EOS at that response position, or none
        if stop_at is not None:
            responses[i, stop_at] = EOS_ID
    rows = torch.cat([rows, responses], 1)
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].shape), with_kwargs=True)
    scores, seq_lens, _ = EvalScorer(ModelReward(model), _settings(P, penalise_no_eos=False), stop, {})(
        rows, torch.tensor(prompt_lens), [None] * len(prompt_lens))
    assert len(seen) == 0  # the trunk and head ran as the packed scoring runs them, not model(...)
    alone = []
    for i, q in enumerate(prompt_lens):
        real = rows[i, P - q : P + int(seq_lens[i])][None]
        alone.append(float(model(real)[0, -1, 0]))
    assert scores.tolist() == pytest.approx(alone, abs=1e-5)
    slots = []
    model.layers[0].register_forward_pre_hook(lambda m, args, kwargs: slots.append(args[0].shape[:2]),
                                              with_kwargs=True)
    EvalScorer(ModelReward(model), _settings(P, penalise_no_eos=False), stop, {})(
        rows, torch.tensor(prompt_lens), [None] * len(prompt_lens))
    (r, length), = slots
    real_tokens = sum(prompt_lens) + int(seq_lens.sum())
    # fewer slots than the real tokens: the three shared tokens once per packed row
    assert r * length < real_tokens < len(prompt_lens) * (P + T), (r, length, real_tokens)
    # a model that takes no longer rows than P + T gets none: the same scores from rows of at most P + T
    short = llama2_classifier(num_classes=1, vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2,
                              embed_dim=32, max_seq_len=P + T, intermediate_dim=64)
    short.load_state_dict(model.state_dict())
    short.eval().layers[0].register_forward_pre_hook(lambda m, args, kwargs: slots.append(args[0].shape[:2]),
                                                     with_kwargs=True)
    scores_short, _, _ = EvalScorer(ModelReward(short), _settings(P, penalise_no_eos=False), stop, {})(
        rows, torch.tensor(prompt_lens), [None] * len(prompt_lens))
    assert slots[-1][1] <= P + T and scores_short.tolist() == pytest.approx(alone, abs=1e-5), slots


@torch.no_grad()
def test_scores_are_the_training_rollouts_scores():
    """A reward model with the no-stop-token penalty: the evaluation's scores of a rollout's
    responses are the scores the training's packed scoring gave them."""
    from torchtune_ppo.rollout import Rollout
    from torchtune_ppo.run.metrics import PhaseTimer

    policy, ref, value, reward = tiny_policy(0), tiny_policy(0), tiny_classifier(1), tiny_classifier(2)
    policy.tok_embeddings.weight.mul_(0.15)  # flatter next-token distributions: some rows never stop
    gen = Generator(policy, batch_size=4, max_prompt_len=6, max_generated_tokens=4, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID, 7, 9])
    lens = torch.tensor([6, 1, 3, 5, 2, 4, 6, 2])
    prompts = left_padded_prompts(lens.tolist(), 6, seed=2)
    rollout = Rollout(gen, ref, value, ModelReward(reward), torch.tensor([EOS_ID, 7, 9]), _settings(6))
    trajectory = rollout(prompts, lens, torch.Generator().manual_seed(0), PhaseTimer(torch.device("cpu")))
    scores, seq_lens, _ = EvalScorer(ModelReward(reward), _settings(6), torch.tensor([EOS_ID, 7, 9]))(
        trajectory.query_responses, lens, [None] * 8)
    assert (scores == -3.0).any() and (scores != -3.0).any()  # penalised rows and scored ones
    torch.testing.assert_close(scores, trajectory.scores, atol=1e-5, rtol=0)
    assert torch.equal(seq_lens, trajectory.seq_lens)


# ----------------------------------------------------------------------------- the evaluator


def _evaluator(num_prompts=7, num_samples=1, top_k=1, temperature=1.0, seed=5):
    policy = tiny_policy(0)
    gen = Generator(policy, batch_size=4, max_prompt_len=6, max_generated_tokens=5, pad_id=PAD_ID,
                    stop_token_ids=[EOS_ID], temperature=temperature, top_k=top_k)
    lengths = [(i % 6) + 1 for i in range(num_prompts)]
    prompts = EvalPrompts(left_padded_prompts(lengths, 6, seed=1), torch.tensor(lengths), [None] * num_prompts, "test")

    def reward(prompts, responses, **_):  # 1.0 for an even first token, 1.5 for a multiple of 4
        return [0.0 if not r else (1.5 if int(r.split()[0]) % 4 == 0 else float(int(r.split()[0]) % 2 == 0))
                for r in responses]

    scorer = EvalScorer(FunctionReward(reward, _Tokens()), _settings(6, penalise_no_eos=False), torch.tensor([EOS_ID]))
    return Evaluator(gen, prompts, scorer, EvalRecord(every_n_steps=1), num_samples=num_samples, seed=seed,
                     models=[policy])


def test_two_processes_evaluate_their_blocks_and_their_sums_give_the_one_process_metrics(monkeypatch):
    """A fake world of 2: each rank generates its block of the 7 prompts (greedy, so the responses
    do not depend on the rank's stream); the ranks' sums added give one process's metrics."""
    ev = _evaluator(num_samples=2)
    one = ev.evaluate(step=3)
    sums = []
    monkeypatch.setattr(evaluator_module, "sum_over_processes", lambda s, reduce, device: sums.append(s) or s)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    for r in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        ev.evaluate(step=3)
    assert [s["prompts"] for s in sums] == [3, 4] and [s["responses"] for s in sums] == [6, 8]
    two = eval_metrics({k: sums[0][k] + sums[1][k] for k in sums[0]}, 2)
    assert two.keys() == one.keys() == {"val/reward_mean", "val/pass@1", "val/pass@2", "val/response_length"}
    assert two == pytest.approx(one, rel=1e-12)
    assert 0 < one["val/pass@1"] < 1  # not vacuous: some responses are correct, some not


def test_the_evaluation_draws_from_its_own_stream_only():
    """Sampled: the global random state is left as it was, the same step repeats its samples, and
    another step draws others; the policy is back in training mode after."""
    ev = _evaluator(num_prompts=16, num_samples=2, top_k=None, temperature=1.0)
    ev.models[0].train()
    before = torch.get_rng_state()
    first = ev.evaluate(step=4)
    assert torch.equal(torch.get_rng_state(), before)
    assert ev.evaluate(step=4) == first
    assert ev.evaluate(step=6) != first
    assert all(m.training for m in ev.models[0].modules())


def test_named_sets_log_their_own_metrics_each_as_if_evaluated_alone():
    """Two sets side by side, sampled: each set's metrics under ``val/<name>/``, each those of an
    evaluation of that set alone (its own stream, whatever is evaluated beside it)."""
    ev = _evaluator(num_prompts=16, num_samples=2, top_k=None)
    first = ev.prompts[0]._replace(name="a")
    second = first._replace(tokens=first.tokens.flip(0), prompt_lens=first.prompt_lens.flip(0), name="b")
    alone = {}
    for prompts in (first, second):
        ev.prompts = [prompts]
        alone[prompts.name] = ev.evaluate(step=2)
    ev.prompts = [first, second]
    both = ev.evaluate(step=2)
    assert both == {**alone["a"], **alone["b"]}
    assert set(both) >= {"val/a/pass@1", "val/a/pass@2", "val/b/reward_mean", "val/b/response_length"}
    assert alone["a"]["val/a/pass@1"] != alone["b"]["val/b/pass@1"]  # not vacuous: the sets score differently
    ev.prompts = [first._replace(name=None)]  # unnamed: today's names and stream
    assert set(ev.evaluate(step=2)) == {"val/reward_mean", "val/pass@1", "val/pass@2", "val/response_length"}
    with pytest.raises(ValueError, match="distinct names"):
        Evaluator(None, [first, second._replace(name="a")], None, EvalRecord())


def test_a_named_set_samples_from_its_own_stream_and_the_unnamed_from_the_runs():
    from torchtune_ppo.eval import eval_seed

    assert eval_seed(3, 10, 1) == (3 * 1_000_003 + 10 * 1_009 + 1) % 2**63  # as before named sets
    seeds = {eval_seed(3, 10, 1, name) for name in (None, "heldout", "ood")}
    assert len(seeds) == 3


# ----------------------------------------------------------------------------- prompts and config


def _cfg(path=ARITHMETIC, **overrides):
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    cfg.output_dir = "/tmp/unused"
    return cfg


@pytest.mark.parametrize("overrides, message", [
    ({"eval.best_metric": "val/pass@4"}, r"eval.best_metric must be one of .*val/pass@<k>"),
    ({"eval.best_metric": "reward_mean"}, "eval.best_metric must be one of"),
    ({"eval.best_mode": "avg"}, r"eval.best_mode must be one of \['max', 'min'\], got 'avg'"),
    ({"eval.top_k": 0}, "eval.top_k must be null or an integer >= 1, got 0"),
    ({"eval.num_samples": 0}, "eval.num_samples must be a positive integer, got 0"),
    ({"eval.every_n_steps": 0}, "eval.every_n_steps must be null or a positive integer, got 0"),
    ({"eval.temperature": 0}, "eval.temperature must be a number > 0"),
    ({"eval.early_stop_patience": -1}, "eval.early_stop_patience must be null or a positive integer"),
    ({"eval.every_steps": 5}, r"eval: unknown key\(s\) \['every_steps'\]; valid keys are \['every_n_steps'"),
    ({"eval.reward._component_": "torchtune_ppo.rewards.NoSuchReward"}, "eval.reward._component_"),
])
def test_bad_eval_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_cfg(**overrides), check_machine=False)


def test_a_pass_at_k_of_the_samples_drawn_is_a_valid_best_metric():
    cfg = validate_config(_cfg(**{"eval.best_metric": "val/pass@4", "eval.num_samples": 4, "eval.top_k": "null"}),
                          check_machine=False)
    assert cfg.eval.best_metric == "val/pass@4" and cfg.eval.every_n_steps == 10


def test_the_default_eval_dataset_is_the_held_out_split(tmp_path):
    cfg = validate_config(_cfg(**{"eval.max_prompts": 20}), check_machine=False)
    assert default_eval_dataset(cfg.dataset).field == "heldout" and cfg.dataset.field == "train"
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    (prompts,) = eval_prompts(cfg, tokenizer, LOG)
    heldout = json.loads(Path(cfg.dataset.data_files).read_text())["heldout"][:20]
    assert prompts.references == [r["answer"] for r in heldout] and prompts.tokens.shape == (20, 8)
    row = prompts.tokens[0, 8 - int(prompts.prompt_lens[0]):].tolist()
    assert tokenizer.decode(row) == heldout[0]["prompt"]
    # a JSON file without a held-out list has no default
    plain = tmp_path / "p.json"
    plain.write_text(json.dumps({"train": heldout}))
    assert default_eval_dataset(OmegaConf.merge(cfg.dataset, {"data_files": str(plain)})) is None


def test_evaluation_of_a_dataset_without_a_held_out_split_names_eval_dataset():
    cfg = validate_config(_cfg(SENTIMENT, **{"eval.every_n_steps": 5}), check_machine=False)
    with pytest.raises(ValueError, match=r"eval.dataset is null and dataset .* has no held-out split.*Give eval.dataset"):
        eval_prompts(cfg, tt_config.instantiate(cfg.tokenizer), LOG)


def test_every_shipped_config_with_evaluation_validates():
    """The tiny arithmetic configs evaluate their held-out split; the SmolLM2 ones two sets, the
    held-out questions (read as the shipped config trains) and the out-of-distribution ones."""
    on = {}
    for path in sorted(CONFIGS.rglob("*.yaml")):
        cfg = validate_config(_cfg(path), check_machine=False)
        if cfg.eval.every_n_steps is not None:
            blocks = eval_blocks(cfg)
            on[path.name] = list(blocks)
            assert blocks[next(iter(blocks))].field == "heldout"
            assert cfg.eval.best_metric in (f"val/{'' if name is None else name + '/'}pass@1" for name in blocks)
    smollm2 = ["heldout", "ood"]
    assert on == {"135M_lora_ppo_arithmetic.yaml": smollm2, "135M_lora_ppo_arithmetic_mixed.yaml": smollm2,
                  "135M_ppo_arithmetic.yaml": smollm2, "135M_ppo_arithmetic_mixed.yaml": smollm2,
                  "grpo_tiny_arithmetic.yaml": [None], "ppo_tiny_arithmetic.yaml": [None],
                  "135M_ppo_tools.yaml": [None], "ppo_tiny_tools.yaml": [None]}


_SEEN = {"_component_": "torchtune_ppo.data.prompt_dataset", "source": "json", "split": "train", "field": "train",
         "data_files": "${ppo_asset:tiny_arithmetic/problems.json}"}


def _named(**overrides):
    """The tiny arithmetic config evaluating two sets: `heldout` (its default) and `seen`."""
    return _cfg(**{"eval.datasets.heldout": "null", **{f"eval.datasets.seen.{k}": v for k, v in _SEEN.items()},
                   "eval.best_metric": "val/seen/pass@1", **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"eval.dataset._component_": "torchtune_ppo.data.prompt_dataset"}, "eval.dataset and eval.datasets are both set"),
    ({"eval.best_metric": "val/pass@1"}, r"eval.best_metric must be one of \['val/heldout/reward_mean'.*'val/seen/"),
    ({"eval.best_metric": "val/ood/pass@1"}, "eval.best_metric must be one of"),
    ({"eval.datasets.seen": "5"}, r"eval.datasets.seen must be a mapping with a `_component_` or null"),
    ({"eval.datasets.reward": "null"}, r"eval.datasets names must be .* \(not \['reward'\]\), got 'reward'"),
    ({"eval.datasets.a/b": "null"}, "eval.datasets names must be letters, digits"),
])
def test_bad_named_sets_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_named(**overrides), check_machine=False)


def test_named_sets_are_read_in_order_and_padded_to_one_width(tmp_path):
    short = tmp_path / "short.json"  # shorter prompts than the held-out ones: padded to their width
    short.write_text(json.dumps({"train": [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]}))
    cfg = validate_config(_named(**{"eval.max_prompts": 12, "max_prompt_len": "null",
                                    "eval.datasets.seen.data_files": str(short)}), check_machine=False)
    assert cfg.eval.best_metric == "val/seen/pass@1"
    tokenizer = tt_config.instantiate(cfg.tokenizer)
    heldout, seen = eval_prompts(cfg, tokenizer, LOG)
    data = json.loads(Path(cfg.dataset.data_files).read_text())
    assert (heldout.name, seen.name) == ("heldout", "seen")
    assert heldout.references == [r["answer"] for r in data["heldout"][:12]]
    assert seen.references == ["1", "2", "3", "4", "5"]
    width = int(heldout.prompt_lens.max())
    assert heldout.prompt_len == seen.prompt_len == width > int(seen.prompt_lens.max())
    for p, rows in ((heldout, data["heldout"]), (seen, [{"prompt": "3+1="}] * 4)):
        assert tokenizer.decode(p.tokens[3, width - int(p.prompt_lens[3]):].tolist()) == rows[3]["prompt"]


@pytest.mark.parametrize("overrides, message", [
    # max_prompt_len (8) + 25 > the tiny policy's max_seq_len (32)
    ({"eval.max_generated_tokens": 25},
     r"max_prompt_len=8 \+ eval.max_generated_tokens=25 = 33 exceeds policy_model.max_seq_len \(32\)"),
    # the longest prompt, of the `seen` set, + training's 6 tokens... with max_prompt_len null
    ({"max_prompt_len": "null", "eval.max_generated_tokens": 27},
     r"the longest evaluation prompt \(\d tokens, eval.datasets.\w+\) \+ eval.max_generated_tokens=27 = \d\d "
     r"exceeds policy_model.max_seq_len \(32\)"),
])
def test_evaluation_prompts_and_responses_that_do_not_fit_the_model_are_refused_before_any_weights_load(
        overrides, message):
    cfg = validate_config(_named(**{"eval.every_n_steps": 5, **overrides}), check_machine=False)
    with pytest.raises(ValueError, match=message):
        eval_prompts(cfg, tt_config.instantiate(cfg.tokenizer), LOG)


def test_the_length_check_names_training_tokens_when_the_evaluation_takes_them():
    from torchtune_ppo.eval.data import check_eval_length

    cfg = validate_config(_named(), check_machine=False)
    check_eval_length(cfg, 26)  # 26 + 6 = 32 fits
    with pytest.raises(ValueError, match=r"max_prompt_len=27 \+ eval.max_generated_tokens=6 \(null: "
                                         r"max_generated_tokens\) = 33 exceeds policy_model.max_seq_len \(32\)"):
        check_eval_length(cfg, 27)


def test_the_evaluations_own_kv_cache_is_in_the_memory_plan():
    from torchtune_ppo.run.memory import _kv_bytes, _meta, memory_plan

    cfg = validate_config(_named(**{"eval.batch_size": 40, "eval.max_generated_tokens": 10}), check_machine=False)
    rows = memory_plan(cfg, prompt_len=8, eval_prompt_len=7).rows
    key = "evaluation KV cache (its own, not the rollout's: 40 rows x 17 tokens)"
    assert rows[key] == _kv_bytes(_meta(cfg.policy_model), 40, 17, 4) > 0
    assert "KV cache (32 rows x 14 tokens)" in rows  # the rollout's: forward_batch_size x (P + T)
    off = validate_config(_cfg(**{"eval.every_n_steps": "null"}), check_machine=False)
    assert not any(k.startswith("evaluation") for k in memory_plan(off, prompt_len=8).rows)


# ----------------------------------------------------------------------------- the run's books


@pytest.mark.slow
def test_graphs_compiled_inside_excluded_are_not_recompiles():
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    counter = RecompileCounter()
    with counter.excluded():  # before the mark nothing counts anyway
        f(torch.ones(2))
    counter.mark()
    with counter.excluded():
        f(torch.ones(3))  # a new shape: a new graph
    assert counter.since_mark == 0
    f(torch.ones(3))
    f(torch.ones(4))  # a new graph outside: counted
    assert counter.since_mark == 1


def test_pruning_keeps_the_best_step(tmp_path):
    from test_checkpointing import _blocks, _load, _step_dirs

    out = tmp_path / "run"
    policy, value = _blocks(out)
    psd, vsd = _load(policy), _load(value)
    manager = ckpt.CheckpointManager(out, policy, value, keep_last_n=1)
    manager.save(1, psd, vsd, {})
    manager.keep_step(1)
    manager.save(2, psd, vsd, {})
    manager.save(3, psd, vsd, {})
    assert _step_dirs(out) == ["step_1", "step_3"]
    manager.keep_step(3)  # a new best: the old one may go
    manager.save(4, psd, vsd, {})
    assert _step_dirs(out) == ["step_3", "step_4"]


def test_the_logs_keep_evaluations_apart_and_the_summary_names_the_best(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "log_1.txt").write_text("Step 0 | val/pass@1:0.25 time/eval:0.5 \nStep 1 | scores:0.5 loss:1.0 \n"
                                    "Step 2 | scores:0.75 loss:0.5 \nStep 2 | val/pass@1:0.5 time/eval:0.4 \n")
    assert read_disk_log(logs) == [{"scores": 0.5, "loss": 1.0}, {"scores": 0.75, "loss": 0.5}]
    assert read_eval_log(logs) == [(0, {"val/pass@1": 0.25, "time/eval": 0.5}), (2, {"val/pass@1": 0.5, "time/eval": 0.4})]
    record = EvalRecord(every_n_steps=2, best_metric="val/pass@1")
    record.add(0, {"val/pass@1": 0.25})
    record.add(2, {"val/pass@1": 0.5})
    best = tmp_path / "checkpoints/step_2"
    text = run_summary([{"scores": 0.5}, {"scores": 0.75}], [best], record)
    assert f"best 0.5 at step 2 (checkpoint {best})" in text and "val/pass@1 0.25 at step 0" in text


def test_an_evaluation_of_few_prompts_takes_no_more_rows_than_they_give(make_recipe):
    """eval.batch_size above what a set gives (prompts x samples) is cut to that: 3 prompts x 2
    samples in a generator of 6 rows, not 50 of which 44 would be filler; below it, it stays."""
    few = {"eval.every_n_steps": 1, "eval.max_prompts": 3, "eval.num_samples": 2, "eval.temperature": 1.0}
    recipe, _ = make_recipe("ppo_tiny_arithmetic.yaml", **few, **{"eval.batch_size": 50})
    assert recipe._evaluator.generator.batch_size == 6
    recipe, _ = make_recipe("ppo_tiny_arithmetic.yaml", **few, **{"eval.batch_size": 4})
    assert recipe._evaluator.generator.batch_size == 4

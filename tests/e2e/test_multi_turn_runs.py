"""Multi-turn runs with a calculator (``env``) through the recipe on the tiny arithmetic task:
observations masked out of every loss, exact resume, GRPO, turn-level GAE, a LoRA policy,
compiled equal to eager with no recompiles, 2 processes, and an environment that fails.

The tiny policy answers a problem with a number (``23+2=`` -> ``26``), which the shipped call
pattern (an expression with an operator) does not call. Here a bare number is a call
(:data:`FORCED`): the calculator answers ``=26`` and the policy writes another turn, and so on
until it writes something else (nearly always an empty turn) or ``turns.max_turns``: every
episode that ends its first turn with a number uses the tool.
The policy's turn after an observation is nearly always empty, so the config's reward (the last
number of the final turn) is 0 for every such episode; in-process runs use
:class:`_GradedCalculator` instead, whose step reward grades the first number.
"""

import math
import os
import signal
import subprocess
import time

import faulty_envs
import pytest
import torch
from ppo_full_finetune import PPOFullFinetuneRecipe

from torchtune_ppo.checkpointing import store as checkpointing
from torchtune_ppo.envs import Calculator
from torchtune_ppo.run.logs import read_disk_log

from conftest import RECIPE_SHAPE, ROOT, TUNE, assert_compiled_matches_eager, recipe_config

TOOLS = "ppo_tiny_tools.yaml"
TOOLS_CONFIG = ROOT / "recipes/configs/tiny" / TOOLS
CALL_A_NUMBER = r"^(-?[0-9]+)$"
# 16 response tokens (the config's; RECIPE_SHAPE has 8): room for two or three short turns and
# their observations (rows decode in lockstep: the longest turn of a chunk takes cache columns
# from every row: RECIPE_SHAPE's 8, cache 16, leave an observation hardly any room). No
# held-out evaluation: the tests here look at the training steps.
FORCED = {"env.call_pattern": f"'{CALL_A_NUMBER}'", "max_generated_tokens": 16,
          "eval.before_training": False, "eval.every_n_steps": "null"}
# The tiny arithmetic tokenizer's pieces, one a character (tiny_arithmetic/tokenizer.model)
PIECE_IDS = {"=": 3, "1": 4, "-": 5, "2": 6, "3": 7, "4": 8, "5": 9, "6": 10, "7": 11, "8": 12, "9": 13,
             "+": 14, "0": 15}
EOS_ID = 2


class _GradedCalculator(Calculator):
    """The calculator that calls every number, with a step reward of 1 when the episode's first
    call is the row's reference answer: without it every score is 0 and the whitened advantages
    are the KL penalty's float rounding, which the compiled kernels round otherwise."""

    def __init__(self):
        super().__init__(call_pattern=CALL_A_NUMBER)

    def step(self, conversation, turn):
        step = super().step(conversation, turn)
        if step.observation is None or conversation.turns:
            return step
        return step._replace(reward=float(step.observation == conversation.reference))


def _graded(recipe):
    """``recipe`` with :class:`_GradedCalculator` as its environment."""
    recipe._rollout.turns.env = _GradedCalculator()
    return recipe


def _train(recipe):
    """Runs the recipe to its end; returns each step's metrics."""
    rows = []
    recipe.train(on_step=lambda step, metrics: rows.append(metrics))
    return rows


class _KeepTrajectories:
    """Stands in for ``recipe._rollout``: the same calls, each returned Trajectory kept."""

    def __init__(self, rollout):
        self.rollout, self.trajectories = rollout, []

    def __call__(self, *args, **kwargs):
        trajectory = self.rollout(*args, **kwargs)
        self.trajectories.append(trajectory)
        return trajectory

    def __getattr__(self, name):
        return getattr(self.rollout, name)


def _keep_advantages(recipe):
    """Wraps ``recipe._update``; returns the list each step's advantages ``[B, T]`` go to."""
    kept, update = [], recipe._update

    class Wrapped:
        def __call__(self, trajectory, advantages, *args, **kwargs):
            kept.append(advantages.clone())
            return update(trajectory, advantages, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(update, name)

    recipe._update = Wrapped()
    return kept


def _assert_tools_used(rows):
    for step, row in enumerate(rows, 1):
        assert row["turns/tool_calls"] > 0 and row["turns/mean"] > 1, (step, row)
        for key in ("loss", "policy_loss", "value_loss", "kl", "scores"):
            assert math.isfinite(row[key]), (step, key, row[key])


def _segments(mask):
    """``[(start, end), ...]`` of the runs of True in a 1-d bool tensor."""
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture(scope="module")
def forced_eager(tmp_path_factory):
    """Three steps with a value model, every number a call, eager: ``(rows, recipe, trajectories)``."""
    cfg = recipe_config(tmp_path_factory.mktemp("forced") / "eager", TOOLS, num_ppo_steps=3, compile=False, **FORCED)
    recipe = PPOFullFinetuneRecipe(cfg)
    recipe.setup(cfg)
    try:
        kept = _KeepTrajectories(_graded(recipe)._rollout)
        recipe._rollout = kept
        rows = _train(recipe)
    finally:
        recipe.cleanup()
    return rows, recipe, kept.trajectories


def test_observations_are_masked_from_every_loss(forced_eager):
    """Every step calls the tool; the observation tokens are in the sequence but padding for the
    losses (logprobs, reference logprobs and values exactly 0, not counted in ``seq_lens``), and
    they are the tokens of ``=<the number the policy wrote>``."""
    rows, recipe, trajectories = forced_eager
    assert len(rows) == 3 and len(trajectories) == 3
    _assert_tools_used(rows)
    traj = trajectories[-1]
    obs, padding = traj.observation_masks, traj.response_padding_masks
    assert obs is not None and obs.any()
    assert padding[obs].all()
    for name in ("logprobs", "ref_logprobs", "values"):
        assert (getattr(traj, name)[obs] == 0).all(), name
    assert torch.equal(traj.seq_lens, (~padding).sum(-1))

    # One row by hand: the first chunk's episodes are the trajectory's first rows.
    P = recipe._prompt_len
    episodes = recipe._rollout.last_episodes[0]
    r = next(i for i, c in enumerate(episodes.conversations) if len(c.turns) >= 2 and c.turns[1][0] == "tool")
    (role, said), (tool, answer) = episodes.conversations[r].turns[:2]
    assert (role, tool) == ("assistant", "tool") and answer == said  # the calculator echoes a number
    response = traj.query_responses[r, P:].tolist()
    turn = [PIECE_IDS[c] for c in said] + [EOS_ID]
    observation = [PIECE_IDS["="]] + [PIECE_IDS[c] for c in said]
    assert observation == recipe._tokenizer.encode("=" + said, add_bos=False, add_eos=False)
    assert response[:len(turn) + len(observation)] == turn + observation
    first = _segments(obs[r])[0]
    assert first == (len(turn), len(turn) + len(observation))
    # the episode's compact tokens are the trajectory's (truncated after the episode only)
    n = int(episodes.episode_lens[r])
    assert episodes.query_responses[r, P:P + n].tolist() == response[:n]
    assert torch.equal(episodes.observation_masks[r], obs[r])


def test_exact_resume_repeats_the_episodes(make_recipe, tmp_path):
    """4 steps straight, and 2 steps then a resume to 4 in the same folder: steps 3 and 4 log
    the same numbers bit for bit, the turns/* metrics included: the episodes are sampled from
    the restored random streams again."""
    def run(out, **overrides):
        return _train(_graded(make_recipe(TOOLS, output_dir=out, **overrides, **FORCED)[0]))

    straight = run(tmp_path / "straight", num_ppo_steps=4)
    first = run(tmp_path / "split", num_ppo_steps=2)
    resumed = run(tmp_path / "split", num_ppo_steps=4, resume_from_checkpoint=True)
    assert len(straight) == 4 and len(first) == 2 and len(resumed) == 2
    _assert_tools_used(straight)
    for a, b in zip(straight[2:], resumed):
        keys = {k for k in a if not k.startswith("time/") and "per_second" not in k}
        assert keys == {k for k in b if not k.startswith("time/") and "per_second" not in k}
        assert any(k.startswith("turns/") for k in keys)
        for key in keys:
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), (key, a[key], b[key])


def test_grpo_episodes_without_a_value_model(make_recipe):
    """GRPO, groups of 4 sharing their prompt's prefill: the episodes call the tool, no value
    model, a finite policy loss."""
    recipe, cfg = make_recipe(TOOLS, advantage_estimator="grpo", num_samples_per_prompt=4, batch_size=4,
                              forward_batch_size=8, ppo_batch_size=8, gradient_accumulation_steps=2,
                              num_ppo_steps=2, **FORCED)
    assert recipe._models.value is None and recipe._group == 4  # share_group_prefill: on by default
    rows = _train(_graded(recipe))
    assert len(rows) == 2
    _assert_tools_used(rows)
    for row in rows:
        assert row["value_loss"] == 0 and row["loss"] == row["policy_loss"]
        assert 0 <= row["zero_std_groups"] <= 1


def test_turn_level_gae_gives_each_turn_one_advantage(make_recipe):
    """``turns.gae=turn`` on the episodes ``turns.gae=token`` trains on at step 1: other
    advantages, one per assistant turn (every token of a turn the same); 2 steps run."""
    turn_recipe, _ = make_recipe(TOOLS, num_ppo_steps=2, **{"turns.gae": "turn"}, **FORCED)
    turn_recipe._rollout = _KeepTrajectories(_graded(turn_recipe)._rollout)
    turn_adv = _keep_advantages(turn_recipe)
    turn_rows = _train(turn_recipe)
    token_recipe, _ = make_recipe(TOOLS, num_ppo_steps=1, **FORCED)
    token_adv = _keep_advantages(_graded(token_recipe))
    token_rows = _train(token_recipe)
    assert len(turn_rows) == 2 and len(token_rows) == 1
    _assert_tools_used(turn_rows)
    # the same episodes and scores at step 1
    for key in ("scores", "response_lengths", "turns/mean", "turns/tool_calls"):
        assert turn_rows[0][key] == token_rows[0][key], key
    traj = turn_recipe._rollout.trajectories[0]
    valid = ~traj.response_padding_masks
    assert not torch.allclose(turn_adv[0][valid], token_adv[0][valid], atol=1e-4)
    assert turn_rows[0]["policy_loss"] != token_rows[0]["policy_loss"]
    multi = 0
    for r in range(valid.shape[0]):
        turns = _segments(valid[r])  # assistant turns: policy tokens between observations
        for start, end in turns:
            assert (turn_adv[0][r, start:end] == turn_adv[0][r, start]).all(), (r, start, end)
        # each turn its own step: another discount, another advantage. Not on a row that
        # scored 0: step 1's values (a zero value head) and KL (the policy is its reference)
        # are 0 too, so every turn's return is 0 and whitening gives its turns one advantage.
        if len(turns) > 1 and traj.scores[r] != 0:
            multi += 1
            assert turn_adv[0][r, turns[0][0]] != turn_adv[0][r, turns[1][0]], r
    assert multi > 0


def test_lora_policy_runs_episodes(make_recipe):
    """The tiny sentiment LoRA config (a reward model, a text tokenizer) with a calculator that
    calls every turn (its answer to a sentence is an error, shortened to "error"): multi-turn
    episodes with a LoRA policy whose reference is itself with the adapters off."""
    env = {"env._component_": "torchtune_ppo.envs.Calculator", "env.call_pattern": "'(.+)'",
           "env.max_result_chars": 5, "turns.observation_template": "'={observation}'",
           "turns.max_observation_tokens": 8, "turns.cache_tokens": 72, "max_generated_tokens": 24}
    recipe, cfg = make_recipe("ppo_tiny_sentiment_lora.yaml", num_ppo_steps=2, **env)
    assert recipe._models.reference is not None  # the policy with its adapters off
    recipe._rollout = _KeepTrajectories(recipe._rollout)
    rows = _train(recipe)
    assert len(rows) == 2
    _assert_tools_used(rows)
    episodes = recipe._rollout.last_episodes[0]
    tools = [text for c in episodes.conversations for role, text in c.turns if role == "tool"]
    assert tools and set(tools) == {"error"}
    # step 1: the adapters are zero, so the reference is the policy: the KL is rounding only
    assert abs(rows[0]["kl"]) < 1e-5 and abs(rows[1]["kl"]) > 1e-6
    traj = recipe._rollout.trajectories[0]
    assert traj.observation_masks.any() and (traj.ref_logprobs[traj.observation_masks] == 0).all()


@pytest.mark.slow
def test_compiled_episodes_match_eager_without_recompiles(forced_eager, make_recipe, monkeypatch):
    """compile=True: generation (prefill, decode and the extend region that writes
    observations), scoring and the loss step compiled; nothing recompiled after step 1, and the
    eager run's metrics (its episodes exactly). Dynamo's guards and graphs on its eager backend
    (``TORCHTUNE_PPO_COMPILE_BACKEND``, tests only): inductor takes ~160 s here for these regions;
    a run with inductor passed the same test when the extend region was written."""
    from torchtune_ppo.compile import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "eager")
    eager = forced_eager[0]
    recipe, cfg = make_recipe(TOOLS, num_ppo_steps=3, compile=True, **FORCED)
    assert cfg.compile.generate and cfg.compile.trajectory and cfg.compile.loss_step
    rows = _train(_graded(recipe))
    assert len(rows) == 3 and [r["recompiles"] for r in rows[1:]] == [0, 0]
    _assert_tools_used(rows)
    assert_compiled_matches_eager(rows, eager, steps=3)
    for a, b in zip(rows, eager):
        for key in (k for k in b if k.startswith("turns/")):
            assert a[key] == b[key], key


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_two_processes_run_episodes(tmp_path):
    """torchrun, 2 processes (gloo, FSDP2), greedy: each rank runs its half of the episodes; the
    turns/* metrics are summed over both, and are the 1-process run's."""
    from test_distributed import _run

    forced = [f"{k}={v}" for k, v in FORCED.items()] + ["num_ppo_steps=2", "save_every_n_steps=null"]
    one = _run(tmp_path / "one", 1, *forced, config=TOOLS_CONFIG)
    two = _run(tmp_path / "two", 2, *forced, config=TOOLS_CONFIG)
    assert len(one) == len(two) == 2
    _assert_tools_used(two)
    for a, b in zip(one, two):
        for key in (k for k in a if k.startswith("turns/")):
            assert a[key] == b[key], key
        for key in ("scores", "response_lengths", "num_stop_tokens"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert (tmp_path / "two/checkpoints/step_2/COMPLETE").is_file()


class _Broken:
    """An environment that raises on every call once ``armed``."""

    def __init__(self, armed=True):
        self.armed, self.calls = armed, 0

    def step(self, conversation, turn):
        if self.armed:
            self.calls += 1
            raise ConnectionError("the tool is down")
        return Calculator(call_pattern=CALL_A_NUMBER).step(conversation, turn)


def test_failing_environment_ends_episodes_not_the_run(make_recipe):
    """An environment that raises on every call: each episode ends at its first call, counted
    in ``turns/env_failures``; the run trains on the single-turn episodes."""
    # isolation thread: the test counts the calls in the environment, which a worker process would keep
    recipe, _ = make_recipe(TOOLS, num_ppo_steps=2, **{"turns.isolation": "thread"}, **FORCED)
    recipe._rollout.turns.env = env = _Broken()
    rows = _train(recipe)
    assert len(rows) == 2
    for row in rows:
        assert row["turns/env_failures"] > 0 and row["turns/tool_calls"] == 0 and row["turns/mean"] == 1
        assert math.isfinite(row["loss"])
    assert sum(row["turns/env_failures"] for row in rows) == env.calls == recipe._rollout.turns.failures


def test_max_env_failures_stops_the_run_after_saving_the_last_step(make_recipe, tmp_path):
    """``turns.max_env_failures=0``: the failures of step 2 stop the run at the end of its episodes
    with an error naming the key; the state after step 1 is saved."""
    out = tmp_path / "stops"
    # isolation thread: the environment is armed from this process, which a worker process would not see
    recipe, _ = make_recipe(TOOLS, output_dir=out, num_ppo_steps=3, save_every_n_steps=10,
                            **{"turns.max_env_failures": 0, "turns.isolation": "thread"}, **FORCED)
    recipe._rollout.turns.env = env = _Broken(armed=False)
    rows = []

    def arm(step, metrics):
        rows.append(metrics)
        env.armed = True

    with pytest.raises(RuntimeError, match=r"turns\.max_env_failures=0") as failure:
        recipe.train(on_step=arm)
    # the step's episodes end first: every failed call is counted in the message
    assert len(rows) == 1 and rows[0]["turns/tool_calls"] > 0 and env.calls > 0
    assert str(failure.value).startswith(f"{env.calls} environment steps failed")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert (out / "checkpoints/step_1/COMPLETE").is_file()
    assert read_disk_log(out / "logs")[-1]["turns/env_failures"] == 0


def test_an_environment_that_exits_ends_episodes_not_the_run(make_recipe):
    """``sys.exit`` in every step of the environment (it used to end the run at once, exit 3,
    with no message and nothing saved): each episode ends at its first call, the failure is
    counted and named, and the run trains on."""
    recipe, _ = make_recipe(TOOLS, num_ppo_steps=2, **FORCED)
    recipe._rollout.turns.env = faulty_envs.Exits(call_pattern=CALL_A_NUMBER)
    rows = _train(recipe)
    assert len(rows) == 2
    for row in rows:
        assert row["turns/env_failures"] > 0 and row["turns/tool_calls"] == 0 and row["turns/mean"] == 1
        assert math.isfinite(row["loss"])
    assert recipe._rollout.turns.last_failure == "Exits raised SystemExit: 3"


def test_sigterm_during_a_hung_environment_step_finishes_the_step_and_saves(tmp_path):
    """An environment step stuck in a regular expression that holds the interpreter lock, with
    ``turns.timeout_s=1``: each such step is killed after a second (the run used to stay in
    step 1 for good and ignore SIGTERM); a SIGTERM sent during one finishes the step, saves it
    and exits 143, with no worker process left."""
    out, pids = tmp_path / "run", tmp_path / "pids"
    shape = [f"{k}={v}" for k, v in {**RECIPE_SHAPE, **FORCED}.items()]
    cmd = [*TUNE, "run", "ppo_full_finetune", "--config", str(TOOLS_CONFIG), f"output_dir={out}", *shape,
           "compile=False", "num_ppo_steps=50", "save_every_n_steps=100", "turns.timeout_s=1",
           "env._component_=faulty_envs.Backtracks", f"env.mark={pids}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300  # a guard against hanging only
            while not (pids.is_file() and pids.read_text()) and time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "stderr").read_text()[-4000:]
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)  # during a stuck step
            rc = proc.wait(timeout=300)  # ~10 s: the step's other rows, each stopped after 1 s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 128 + signal.SIGTERM, stderr[-6000:]
    assert "SIGTERM received" in stderr and "Stopped after step 1." in stderr
    assert "Backtracks.step did not return within 1.0 s (its worker process was killed)" in stderr
    assert checkpointing.latest_checkpoint(out) == out / "checkpoints/step_1"
    assert read_disk_log(out / "logs")[-1]["turns/env_failures"] > 0
    for pid in {int(line) for line in pids.read_text().split()}:  # every stuck worker killed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

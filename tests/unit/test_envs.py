"""Environments of multi-turn rollouts: the calculator's values and refusals, the guarded call
(raises, hangs, bad answers end the episode with a cause), the example environment, the
observation renderer (token-exact against SmolLM2's chat template; a plain template for the
tiny tokenizer) and the chat_tools task's data."""

import asyncio
import builtins
import faulthandler
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import faulty_envs
import pytest

import torchtune_ppo
from torchtune_ppo.envs import (
    Calculator,
    Conversation,
    Environment,
    EnvStep,
    GuessNumber,
    ObservationRenderer,
    check_environment,
    safe_step,
)
from torchtune_ppo.envs.calculator import evaluate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "tasks"))
import build_chat_tools as build  # noqa: E402

CONV = Conversation(prompt="p", turns=(), reference=None, seed=0)
# The tiny arithmetic model's calculator call: a bare expression of two numbers or more.
TINY_CALL = r"^(-?[0-9]+(?:[-+][0-9]+)+)$"
SMOLLM2 = Path(os.environ.get("TORCHTUNE_PPO_SMOLLM2_DIR")
               or "~/.cache/torchtune_ppo/SmolLM2-135M-Instruct").expanduser()


def _conv(reference=None, tools=0):
    turns = tuple(t for _ in range(tools) for t in (("assistant", "1"), ("tool", "higher")))
    return Conversation(prompt="p", turns=turns, reference=reference, seed=7)


# --------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, value", [
    ("1+2*3", "7"), ("(1+2)*3", "9"), ("2**3**2", "512"), ("-2**2", "-4"), ("(-2)**2", "4"),
    ("-(2+3)*4", "-20"), ("--3", "3"), ("+5", "5"), ("347 * 29", "10063"), ("(12 + 7) * -3", "-57"),
    ("7//2", "3"), ("-7//2", "-4"), ("-7%3", "2"), ("10-2-3", "5"), ("2**-1", "0.5"),
    ("7/2", "3.5"), ("6/3", "2"), ("12.0", "12"), ("2.5*4", "10"), ("1/3", "0.333333"), ("2/3", "0.666667"),
    ("-1/8", "-0.125"), ("0.1+0.2", "0.3"), ("1e-9", "0"), ("-1e-9", "0"), (".5+1.", "1.5"),
    ("123456789*987654321", "121932631112635269"), (" 1 +\n 2 ", "3"), ("10**63", "1" + "0" * 63),
])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, reason", [
    ("x", "names are not allowed"), ("abs(-1)", "function calls are not allowed"),
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("(1).real", "attributes are not allowed"), ("'1'", "only numbers are allowed"),
    ("1 < 2", "comparisons are not allowed"), ("1, 2", "no commas"), ("True + 1", "only numbers are allowed"),
    ("0x10", "not a plain number"), ("1_000", "not a plain number"), ("1j", "only numbers are allowed"),
    ("1 +", "not an arithmetic expression"), ("", "empty expression"), ("lambda: 1", "Lambda is not allowed"),
    ("1/0", "division by zero"), ("1//0", "division by zero"), ("1 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("10**64", "more than 64 digits"), ("9**9**9", "more than 64 digits"),
    ("2**10000000000", "more than 64 digits"), ("1.5**1000", "more than 64 digits"),
    ("1" * 65, "more than 64 digits"), ("1e400", "too large"), ("(-8)**0.5", "not a real number"),
    ("1+" * 600 + "1", "longer than 1000 characters"),
])
def test_the_calculator_refuses_with_a_short_reason(expression, reason):
    started = time.perf_counter()
    with pytest.raises(ValueError) as info:
        evaluate(expression)
    assert reason in str(info.value)
    assert time.perf_counter() - started < 0.1  # refused before computing a huge power


def test_the_calculator_never_calls_eval(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert evaluate("(2 + 3) * 4") == "20"


def test_the_calculator_answers_the_last_call_and_a_turn_without_one_is_done():
    calc = Calculator()
    assert calc.step(CONV, "first <calc>1+1</calc> then <calc>2*3</calc>.") == EnvStep("6")
    assert calc.step(CONV, "<calc>1 +\n2</calc>") == EnvStep("3")  # DOTALL
    assert calc.step(CONV, "<calc>2*3</calc> and then <calc>x</calc>") == EnvStep("error: names are not allowed")
    assert calc.step(CONV, "<calc>1/0</calc>") == EnvStep("error: division by zero")
    assert calc.step(CONV, "<calc></calc>") == EnvStep("error: empty expression")
    assert calc.step(CONV, "The answer is 10063.") == EnvStep(None)
    assert Calculator(max_result_chars=5).step(CONV, "<calc>10**20</calc>") == EnvStep("10000")
    assert Calculator(max_digits=3).step(CONV, "<calc>999+1</calc>") == EnvStep("error: too large: more than 3 digits")
    assert isinstance(calc, Environment)


def test_the_tiny_tasks_calculator_call_is_a_bare_expression():
    calc = Calculator(call_pattern=TINY_CALL)
    assert calc.step(CONV, "12+7") == EnvStep("19")
    assert calc.step(CONV, "5-12") == EnvStep("-7")
    assert calc.step(CONV, "-5-12+3") == EnvStep("-14")
    for answer in ("19", "-7", "12+7=19", "", "+"):  # a number, or no expression: the answer
        assert calc.step(CONV, answer) == EnvStep(None), answer


@pytest.mark.parametrize("pattern, what", [("<calc>(.*?</calc>", "not a regular expression"),
                                           ("<calc>.*?</calc>", "no capture group")])
def test_a_bad_call_pattern_is_refused_by_name(pattern, what):
    with pytest.raises(ValueError, match=rf"call_pattern='{re.escape(pattern)}'.*{what}"):
        Calculator(call_pattern=pattern)


# --------------------------------------------------------------------------- safe_step


class Boom:
    def step(self, conversation, turn):
        return 1 / 0


class Answers:
    def __init__(self, value):
        self.value = value

    def step(self, conversation, turn):
        return self.value


class Waits:
    def __init__(self):
        self.release = threading.Event()

    def step(self, conversation, turn):
        self.release.wait(10)
        return EnvStep("late")


class RaisesTimeout:
    def step(self, conversation, turn):
        raise TimeoutError("my own")


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_an_environment_that_raises_ends_the_episode_with_its_cause(timeout_s):
    assert safe_step(Boom(), CONV, "t", timeout_s=timeout_s) == (
        EnvStep(None), "Boom raised ZeroDivisionError: division by zero")
    assert safe_step(RaisesTimeout(), CONV, "t", timeout_s=timeout_s) == (
        EnvStep(None), "RaisesTimeout raised TimeoutError: my own")  # not taken for a timeout
    step, cause = safe_step(GuessNumber(), _conv(None), "12", timeout_s=timeout_s)
    assert (step, cause) == (EnvStep(None), "GuessNumber raised ValueError: GuessNumber needs the secret "
                                            "number as the row's reference")


def test_a_hung_environment_is_abandoned_after_the_timeout_in_a_daemon_thread():
    env = Waits()
    started = time.perf_counter()
    try:
        assert safe_step(env, CONV, "t", timeout_s=0.2, isolation="thread") == (
            EnvStep(None), "Waits.step did not return within 0.2 s (abandoned: it may still be running in its thread)")
        elapsed = time.perf_counter() - started
        assert 0.2 <= elapsed < 1.0, elapsed
        workers = [t for t in threading.enumerate() if t.name.startswith("env-step")]
        assert workers and all(t.daemon for t in workers)  # a hung one never blocks exit
        # the next call is served while the first still hangs
        assert safe_step(Calculator(), CONV, "<calc>2+2</calc>", timeout_s=0.5, isolation="thread") == (
            EnvStep("4"), None)
    finally:
        env.release.set()


# An environment step that exits, hangs or crashes: faulty_envs (tests/) holds the environments.
# (timeout_s, safe_step's other arguments): called directly, in a worker process (the default), in a thread
PLACES = [pytest.param(None, {}, id="direct"), pytest.param(5.0, {}, id="process"),
          pytest.param(5.0, {"isolation": "thread"}, id="thread")]


@pytest.mark.parametrize("timeout_s, where", PLACES)
def test_an_environment_that_exits_ends_its_episode_not_the_run(timeout_s, where):
    """``sys.exit`` in a step (or any BaseException but a KeyboardInterrupt in the run's own
    thread) is that step's failure, named like any other: it used to end the run silently."""
    assert safe_step(faulty_envs.Exits(), CONV, "t", timeout_s=timeout_s, **where) == (
        EnvStep(None), "Exits raised SystemExit: 3")

    class Cancels:
        def step(self, conversation, turn):
            raise asyncio.CancelledError()

    assert safe_step(Cancels(), CONV, "t", timeout_s=timeout_s, **where) == (
        EnvStep(None), "Cancels raised CancelledError")
    # and the next call is served as usual
    assert safe_step(Calculator(), CONV, "<calc>2+2</calc>", timeout_s=timeout_s, **where) == (EnvStep("4"), None)


def test_a_keyboard_interrupt_in_the_runs_own_thread_is_the_users():
    """Called directly (no timeout), a KeyboardInterrupt is the user's second Ctrl-C: raised on.
    In a worker it can only be the environment's own, and is its failure."""

    class Interrupted:
        def step(self, conversation, turn):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        safe_step(Interrupted(), CONV, "t", timeout_s=None)
    for isolation in ("process", "thread"):
        assert safe_step(Interrupted(), CONV, "t", timeout_s=5.0, isolation=isolation) == (
            EnvStep(None), "Interrupted raised KeyboardInterrupt")


_STOPS_A_GIL_HOLDER = """
import signal, sys, time
sys.path.insert(0, {tests!r})
import faulty_envs
from torchtune_ppo.envs import Conversation, safe_step

stop = []  # as the recipe's stop request: a Python handler that only takes note
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
conv = Conversation("p", (), None, 0)
print("calling", flush=True)
for _ in range(2):
    started = time.monotonic()
    step, cause = safe_step(faulty_envs.Backtracks(), conv, "t", timeout_s=1.0)
    print(repr(cause), round(time.monotonic() - started, 1), flush=True)
print("stop requested:", stop == [signal.SIGTERM], flush=True)
"""


def test_a_step_that_holds_the_interpreter_lock_is_stopped_at_its_timeout_and_sigterm_is_heard():
    """A regular expression that backtracks for hours in one C call never releases the
    interpreter lock: in a worker thread it stalled the whole process past any timeout and past
    SIGTERM. In its worker process it is killed at the timeout, and a SIGTERM sent meanwhile
    reaches the run's Python handler at once (the recipe's stop request, which the run acts on
    after the step: ``e2e/test_multi_turn_runs.py``). In a subprocess, so that a stall fails the
    test at the guard instead of hanging it."""
    code = _STOPS_A_GIL_HOLDER.format(tests=str(ROOT / "tests"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline() == "calling\n"
        time.sleep(0.3)  # the first call under way
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)  # a guard against the stall only; ~2 s here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    lines = out.splitlines()
    assert len(lines) == 3, out + err
    for line in lines[:2]:
        assert line.startswith("'Backtracks.step did not return within 1.0 s (its worker process was killed)'"), out
    assert lines[2] == "stop requested: True"


@pytest.mark.parametrize("env_class", [faulty_envs.Spins, faulty_envs.Sleeps])
def test_a_step_past_its_timeout_is_stopped_not_left_running(tmp_path, env_class):
    """Each overrunning call used to leave its thread behind, spinning: a step got slower with
    every one. Now the worker process of the call is killed, and the next call forks a new one."""
    mark = tmp_path / "pids"
    env = env_class(when="loop", mark=str(mark))
    threads, causes = threading.active_count(), []
    for _ in range(3):
        causes.append(safe_step(env, CONV, "loop", timeout_s=0.2)[1])
        assert safe_step(env, CONV, "12", timeout_s=5.0) == (EnvStep("12"), None)  # a fresh worker
    assert threading.active_count() == threads  # no thread left behind
    pids = [int(line) for line in mark.read_text().split()]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    for pid in pids:  # each killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert causes == [f"{env_class.__name__}.step did not return within 0.2 s (its worker process was killed)"] * 3


def test_a_step_that_ends_its_worker_process_ends_its_episode():
    """``os._exit`` or a crash in the step ends its worker, not the run; the next call forks another."""
    env = faulty_envs.Crashes(when="crash")
    assert safe_step(env, CONV, "crash", timeout_s=5.0) == (
        EnvStep(None), "Crashes.step ended its worker process (exit code 7)")
    assert safe_step(env, CONV, "12", timeout_s=5.0) == (EnvStep("12"), None)

    class Segfaults:
        def step(self, conversation, turn):
            faulthandler.disable()  # pytest's traceback dump, in the worker, is noise here
            os.kill(os.getpid(), signal.SIGSEGV)

    assert safe_step(Segfaults(), CONV, "t", timeout_s=5.0) == (
        EnvStep(None), "Segfaults.step ended its worker process (killed by SIGSEGV)")


def test_a_worker_process_sees_the_environment_as_it_was_at_the_fork():
    """The contract of ``isolation: process``: the step runs on the worker's copy of the
    environment; what it changes stays there, and a new environment object gets a new worker."""

    class Counts:
        def __init__(self):
            self.calls = 0

        def step(self, conversation, turn):
            self.calls += 1
            return EnvStep(str(self.calls))

    env = Counts()
    assert [safe_step(env, CONV, "t", timeout_s=5.0)[0].observation for _ in range(3)] == ["1", "2", "3"]
    assert env.calls == 0
    assert safe_step(Counts(), CONV, "t", timeout_s=5.0)[0].observation == "1"


def test_isolation_is_refused_by_its_key_unless_process_or_thread():
    with pytest.raises(ValueError, match=r"turns\.isolation='fork': must be one of process, thread"):
        safe_step(Calculator(), CONV, "t", timeout_s=1.0, isolation="fork")


@pytest.mark.parametrize("value, cause", [
    (None, "Answers.step returned NoneType None, not an EnvStep"),
    (("4", None), "Answers.step returned tuple ('4', None), not an EnvStep"),
    ("4", "Answers.step returned str '4', not an EnvStep"),
    (EnvStep(4), "Answers.step returned an observation of int 4, not str or None"),
    (EnvStep("4", float("nan")), "Answers.step returned a reward of float nan, not a finite real number"),
    (EnvStep("4", float("inf")), "Answers.step returned a reward of float inf, not a finite real number"),
    (EnvStep("4", True), "Answers.step returned a reward of bool True, not a finite real number"),
    (EnvStep("4", "1"), "Answers.step returned a reward of str '1', not a finite real number"),
])
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_an_answer_that_is_not_a_valid_env_step_ends_the_episode(value, cause, timeout_s):
    assert safe_step(Answers(value), CONV, "t", timeout_s=timeout_s) == (EnvStep(None), cause)


def test_a_valid_answer_is_passed_on_with_its_reward_as_a_float():
    step, cause = safe_step(Answers(EnvStep("obs", 2)), CONV, "t", timeout_s=None)
    assert (step, cause) == (EnvStep("obs", 2.0), None) and type(step.reward) is float
    assert safe_step(Answers(EnvStep()), CONV, "t", timeout_s=1.0) == (EnvStep(None, None), None)
    with pytest.raises(ValueError, match="timeout_s=0"):
        safe_step(Calculator(), CONV, "t", timeout_s=0)


def test_check_environment_names_what_is_not_an_environment():
    check_environment(Calculator())
    with pytest.raises(TypeError, match="object is not an environment"):
        check_environment(object())
    with pytest.raises(TypeError, match="Calculator is a class; pass an instance"):
        check_environment(Calculator)
    assert not isinstance(object(), Environment)


def test_importing_envs_imports_no_rollout_ppo_or_recipe():
    code = ("import sys, torchtune_ppo.envs; print(sorted(m for m in sys.modules if m.startswith("
            "('torchtune_ppo.rollout', 'torchtune_ppo.ppo', 'torchtune_ppo.rlhf', 'ppo_full_finetune'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- the example


def test_guess_number_hints_until_right_or_out_of_hints():
    env = GuessNumber()
    assert env.step(_conv("42"), "I guess 50") == EnvStep("lower")
    assert env.step(_conv("42"), "30, no: 41") == EnvStep("higher")  # the last number
    assert env.step(_conv("42"), "no idea") == EnvStep("say a number")
    assert env.step(_conv("-3", tools=2), "It is -3.") == EnvStep(None, 1.0)
    assert env.step(_conv("42", tools=3), "41") == EnvStep("higher")
    assert env.step(_conv("42", tools=4), "41") == EnvStep(None)  # 4 hints given: done, no reward
    assert env.step(_conv("42", tools=4), "42") == EnvStep(None, 1.0)
    assert GuessNumber(max_hints=1).step(_conv("42", tools=1), "41") == EnvStep(None)


# --------------------------------------------------------------------------- observations as tokens


def test_a_template_renders_the_observation_with_the_tiny_tokenizer():
    from torchtune_ppo.tasks.tiny_arithmetic import EOS_ID, tiny_tokenizer

    tok = tiny_tokenizer()
    renderer = ObservationRenderer(tok, template="={observation}")
    assert (renderer.before, renderer.after) == ("=", "")
    assert renderer.tokens("19") == [3, 4, 13] == tok.encode("=19", add_bos=False, add_eos=False)
    # an episode: prompt, the call, its stop token, the value; it reads as the problem solved
    episode = tok.encode("12+7=", add_bos=True, add_eos=False) + tok.encode("12+7", add_bos=False, add_eos=False)
    episode += [EOS_ID] + renderer.tokens(Calculator(call_pattern=TINY_CALL).step(CONV, "12+7").observation)
    assert tok.decode(episode) == "12+7=12+7=19"
    with pytest.raises(ValueError, match="set turns.observation_template"):
        ObservationRenderer(tok)  # no chat template


@pytest.mark.parametrize("template", ["=", "{observation}{observation}", "{{observation}}", "{observation} {x}",
                                      "{observation} {", 3])
def test_a_template_without_observation_once_is_refused_by_its_key(template):
    with pytest.raises(ValueError, match=r"turns\.observation_template=.*\{observation\} exactly once"):
        ObservationRenderer(object(), template=template)


def test_double_braces_in_a_template_are_literal():
    r = ObservationRenderer(object(), template="{{{observation}}}")
    assert (r.before, r.after, r.text("1")) == ("{", "}", "{1}")


class _ChatLike:
    """A tokenizer whose chat template raises on a tool turn."""

    stop_tokens = [2]

    def render(self, chat, add_generation_prompt=False):
        if any(m["role"] == "tool" for m in chat):
            raise RuntimeError("Conversation roles must alternate user/assistant")
        return ""

    def decode(self, ids, skip_special_tokens=True):
        return "</s>"


def test_a_chat_template_that_cannot_render_a_tool_turn_asks_for_a_template():
    with pytest.raises(ValueError, match="cannot render a 'tool' turn.*alternate.*set turns.observation_template"):
        ObservationRenderer(_ChatLike())


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 is not prepared in {SMOLLM2} (python tools/prepare_smollm2.py)")
    from torchtune_ppo.models import smollm2_tokenizer

    return smollm2_tokenizer(path=str(SMOLLM2))


def test_smollm2_observation_tokens_are_the_chat_templates_tokens_of_the_whole_conversation(smollm2):
    tok = smollm2
    renderer = ObservationRenderer(tok)
    im_end = tok.special_tokens["<|im_end|>"]
    assert renderer.text("579") == "\n<|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.tokens("579") == [198, 1, 19324, 198, 37, 39, 41, 2, 198, 1, 520, 9531, 198]

    row = json.loads((Path(torchtune_ppo.asset_path("chat_tools")) / "problems.json").read_text())["train"][0]
    chat = [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["prompt"]}]
    expression = row["prompt"][len("What is "):-1]
    turns = [f"Let me compute it. <calc>{expression}</calc>", "error: not an arithmetic expression",
             f"Again: <calc>{expression}</calc>", row["answer"], f"The answer is {row['answer']}."]
    episode = tok.encode(tok.render(chat, add_generation_prompt=True), add_bos=False, add_eos=False)
    for i, text in enumerate(turns):
        if i % 2 == 0:  # the policy's turn, sampled tokens ending with the stop token
            episode += tok.encode(text, add_bos=False, add_eos=False) + [im_end]
        else:
            episode += renderer.tokens(text)
        chat.append({"role": "assistant" if i % 2 == 0 else "tool", "content": text})
    # the conversation so far, rendered whole and tokenized once, with the next assistant header
    whole = tok.encode(tok.render(chat[:-1], add_generation_prompt=True), add_bos=False, add_eos=False)
    last_turn = tok.encode(turns[-1], add_bos=False, add_eos=False) + [im_end]
    assert episode == whole + last_turn
    full = tok.encode(tok.render(chat), add_bos=False, add_eos=False)
    assert episode == full[:len(episode)] and full[len(episode):] == tok.encode("\n", add_bos=False, add_eos=False)


# --------------------------------------------------------------------------- the chat_tools task


ASSETS = Path(torchtune_ppo.asset_path("chat_tools"))
_PRODUCT = re.compile(r"What is (\d+) \* (\d+)\?")
_SUM = re.compile(r"What is (\d+) \+ (\d+) \+ (\d+)\?")


def test_chat_tools_problems_are_hard_arithmetic_with_exact_answers():
    data = json.loads((ASSETS / "problems.json").read_text())
    assert (len(data["train"]), len(data["heldout"])) == (800, 200)
    kinds = {"*": 0, "+": 0}
    for row in data["train"] + data["heldout"]:
        assert set(row) == {"prompt", "answer", "system"} and row["system"] == build.SYSTEM_PROMPT
        if m := _PRODUCT.fullmatch(row["prompt"]):
            a, b = map(int, m.groups())
            assert 10 <= a <= 999 and 10 <= b <= 999 and row["answer"] == str(a * b)
            kinds["*"] += 1
        else:
            terms = list(map(int, _SUM.fullmatch(row["prompt"]).groups()))
            assert all(100 <= t <= 9999 for t in terms) and row["answer"] == str(sum(terms))
            kinds["+"] += 1
        assert evaluate(row["prompt"][len("What is "):-1]) == row["answer"]  # what the calculator answers
    assert 400 <= kinds["*"] <= 600 and 400 <= kinds["+"] <= 600, kinds
    prompts = [r["prompt"] for r in data["train"] + data["heldout"]]
    assert len(set(prompts)) == 1000  # distinct, so held-out is disjoint from train
    assert "like <calc>12 * 34</calc>" in build.SYSTEM_PROMPT


def test_chat_tools_rebuild_is_the_committed_files(tmp_path):
    build.build(tmp_path)
    for name in build.FILES:
        assert (tmp_path / name).read_bytes() == (ASSETS / name).read_bytes(), name
    manifest = json.loads((ASSETS / "MANIFEST.json").read_text())
    assert manifest["sha256"] == {"problems.json": hashlib.sha256((ASSETS / "problems.json").read_bytes()).hexdigest()}
    assert (manifest["n_train"], manifest["n_heldout"], manifest["seed"]) == (800, 200, 0)
    build.build(tmp_path / "other", seed=1)
    assert (tmp_path / "other" / "problems.json").read_bytes() != (ASSETS / "problems.json").read_bytes()

"""Chaos test: a tiny PPO run under randomly timed faults must end exactly where an
uninterrupted run ends.

It runs the tiny sentiment task (test shape, ``save_every_n_steps=2``) once without faults, then
again in a series of attempts, each hit by one random fault and resumed from its newest
checkpoint by the next attempt:

- ``sigkill``: SIGKILL at a random moment (startup, mid-step, mid-save);
- ``sigkill_during_save``: SIGKILL inside a save (``TORCHTUNE_PPO_CRASH_DURING_SAVE``, a random point);
- ``sigterm``: SIGTERM at a random moment (the run finishes its step, saves, exits 143);
- ``reward_raises``: the rollout raises once, after drawing its samples (exit 1, the state after
  the last completed step saved);
- ``full_disk``: every checkpoint write fails with ENOSPC (exit 1, nothing half-written);
- ``sighup``: SIGHUP at a random moment, as a closed terminal sends (treated as SIGTERM);
- ``damaged_checkpoint``: the newest checkpoint damaged in place (same size, other bytes, in its
  weights or training state) before a resume, which must set it aside (renamed, never deleted),
  go on from the one before and save that step again; then SIGTERM at a random moment;
- ``data_edit``: the run's data file edited before a resume, which must refuse to start (exit 1,
  naming the file, nothing on disk touched); the file is then restored;
- ``env_hangs``: a random environment step of the attempt hangs for good, holding the interpreter
  lock (a regular expression that backtracks for hours); ``turns.timeout_s`` must stop it and the
  failure stop the run (``turns.max_env_failures=0``: exit 1, the last completed step saved);
- ``env_exits``: a random environment step calls ``sys.exit(3)`` or ``os._exit(3)``; the run must
  stop the same way (exit 1, the last completed step saved), never silently or with nothing saved;
- ``sigkill_during_eval``: the process SIGKILLs itself inside its first or second evaluation, after
  the responses of its first or second batch of prompts are generated (before its ``val/`` row is
  logged); the resume must run that evaluation again, from the checkpoint written before it.

When ``sigkill_during_eval`` can be drawn, every run (the uninterrupted one too) evaluates the
policy before step 1, every 2 steps and after the last, on the first 16 of the task's prompts; the
other faults then hit runs that evaluate as well.

When an ``env_*`` fault can be drawn, every run (the uninterrupted one too) is a multi-turn run
with :class:`ChaosEnv`, which answers some first turns with an observation and ends every other
episode, so that the other faults hit the multi-turn rollout as well; otherwise the runs are
single-turn. The ``env_*`` faults hit the training's episodes only: an evaluation's episode whose
environment step fails is scored as ended, as documented, and the evaluation goes on, so its
``val/`` row would rightly differ from the uninterrupted run's.

A run that reaches its end (its last step saved and, when it evaluates, the evaluation after it
recorded) before the faults are spent is followed by a fresh one (``chaos_<k>``), each compared
with the same uninterrupted run. After every attempt each ``step_*`` folder must be complete,
match its checksums and hold finite weights and optimizer state. At the end the metrics of every
step and of every evaluation (the last row logged for it over the attempts; a step the
uninterrupted run evaluated and this one did not, or the other way round, is a difference) and
the final weights must equal the uninterrupted run's, bit for bit; no process may log a step or
an evaluation twice.

Usage (one attempt is one process start, ~10-20 s on 2 CPU cores; 50 faults ~15-20 min)::

    python tools/chaos.py --faults 50 --steps 10 --seed 0 --workdir /tmp/ppo-chaos

``--sharded``: every run (the uninterrupted one too) saves ``checkpoint_format: sharded`` with
``async_save``, so the kills inside a save (also ``after_shards``: every shard written, nothing
else) hit the background write, a damaged checkpoint may be a damaged shard, and the final
weights compared are the shards' (weights, optimizer state), bit for bit.

prints one line per attempt and exits 0 when everything matched, 1 otherwise.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
SHAPE = ["batch_size=8", "forward_batch_size=4", "ppo_batch_size=4", "gradient_accumulation_steps=2",
         "ppo_epochs=2", "max_generated_tokens=12", "save_every_n_steps=2", "keep_last_n_checkpoints=2"]
FAULTS = ("sigkill", "sigkill_during_save", "sigterm", "reward_raises", "full_disk", "sighup", "damaged_checkpoint",
          "data_edit")
DATA_FNAME = "prompts.json"  # the run's prompts, a copy of the tiny task's, in the workdir
SAVE_POINTS = ("after_policy", "after_value", "after_training_state", "before_rename")
# --sharded: every run saves sharded (checkpoint_format: sharded) in the background (async_save)
SHARDED_OVERRIDES = ["checkpoint_format=sharded", "async_save=True"]
SHARDED_SAVE_POINTS = ("after_shards", "after_training_state", "before_rename")
FAULTS += ("env_hangs", "env_exits", "sigkill_during_eval")
ENV_FAULTS = ("env_hangs", "env_exits")
RAISE_ENV = "CHAOS_RAISE_AT_ROLLOUT"  # the n-th rollout of this process raises
ENV_FAULT = "CHAOS_ENV_FAULT"  # "<how>:<n>": the n-th environment step (of a worker) hangs or exits
EVAL_KILL = "CHAOS_KILL_IN_EVAL"  # "<n>:<k>": SIGKILL after the k-th batch of the n-th evaluation
EVAL_KILLED = "chaos: SIGKILL inside the evaluation after step"  # what the worker prints first
HOOK_ENVS = ("TORCHTUNE_PPO_CRASH_DURING_SAVE", "TORCHTUNE_PPO_FULL_DISK_DURING_SAVE", RAISE_ENV, ENV_FAULT,
             EVAL_KILL)
# With env_* faults: every run has the environment; a stuck step is stopped after 2 s and any
# failed step stops the run after its episodes, so that the step is run again on resume.
ENV_OVERRIDES = ["env._component_=chaos.ChaosEnv", "turns.observation_template='{observation}'",
                 "turns.timeout_s=2", "turns.max_env_failures=0"]
EXIT_HOWS = ("sys.exit", "os._exit")
# With sigkill_during_eval: every run evaluates (before step 1, every 2 steps, after the last) the
# first 16 of the tiny task's prompts (its own file, which data_edit never touches), in 2 batches.
EVAL_OVERRIDES = ["eval.every_n_steps=2", "eval.max_prompts=16", "eval.batch_size=8",
                  "eval.dataset._component_=torchtune.datasets.text_completion_dataset", "eval.dataset.source=json",
                  "eval.dataset.column=prompt", "eval.dataset.split=train", "eval.dataset.add_eos=False"]
_run_overrides: List[str] = []  # ENV_OVERRIDES and EVAL_OVERRIDES where their faults can be drawn (main)
# With the run's seed 0, a training episode's environment seed is at least 1_009 * 4_096 (step 1,
# TurnRunner.episode_seeds), an evaluation's (eval_seed + row) far below it.
TRAINING_SEEDS = 1_009 * 4_096


# ----------------------------------------------------------------------------- the environment


class ChaosEnv:
    """Answers the first turn of an episode with an even seed with ``" ok"`` and ends every other
    episode; with ``CHAOS_ENV_FAULT=<how>:<n>`` in the environment, its ``n``-th step of a
    training episode (counted in the process that runs the steps) misbehaves: ``hang`` (a regular
    expression that backtracks for hours, holding the interpreter lock), ``sys.exit`` or
    ``os._exit``. An evaluation's episodes are answered alike and never misbehave."""

    def __init__(self) -> None:
        how, _, n = os.environ.get(ENV_FAULT, "").partition(":")
        self.how, self.at, self.calls = how, int(n or 0), 0

    def step(self, conversation, turn):
        import re

        from torchtune_ppo.envs import EnvStep

        self.calls += conversation.seed >= TRAINING_SEEDS
        if self.calls == self.at and conversation.seed >= TRAINING_SEEDS:
            if self.how == "hang":
                re.match(r"(a+)+$", "a" * 40 + "b")
            elif self.how == "sys.exit":
                sys.exit(3)
            elif self.how == "os._exit":
                os._exit(3)
        first = not any(role == "tool" for role, _ in conversation.turns)
        return EnvStep(" ok" if first and conversation.seed % 2 == 0 else None)


# ----------------------------------------------------------------------------- the worker process


def worker(overrides: List[str]) -> None:
    """The recipe, as ``tune run ppo_full_finetune`` runs it, with the reward-raises and the
    kill-in-evaluation hooks."""
    import ppo_full_finetune

    from torchtune_ppo.eval.evaluator import EvalScorer, Evaluator
    from torchtune_ppo.rollout import Rollout

    raise_at = int(os.environ.get(RAISE_ENV, "0"))
    if raise_at:
        calls = [0]
        rollout = Rollout.__call__

        def raising_once(self, *args, **kwargs):
            out = rollout(self, *args, **kwargs)  # the samples are drawn first
            calls[0] += 1
            if calls[0] == raise_at:
                raise RuntimeError("chaos: the reward function raised")
            return out

        Rollout.__call__ = raising_once
    kill_at = os.environ.get(EVAL_KILL)
    if kill_at:
        at_eval, at_batch = map(int, kill_at.split(":"))
        counts = {"evaluations": 0, "batches": 0, "step": None}
        evaluate, score = Evaluator.evaluate, EvalScorer.__call__

        def counting(self, step):
            counts["evaluations"], counts["step"] = counts["evaluations"] + 1, step
            return evaluate(self, step)

        def killing(self, *args, **kwargs):  # a batch's responses are generated, its scores not yet
            if counts["evaluations"] == at_eval:
                counts["batches"] += 1
                if counts["batches"] == at_batch:
                    print(f"{EVAL_KILLED} {counts['step']}", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            return score(self, *args, **kwargs)

        Evaluator.evaluate, EvalScorer.__call__ = counting, killing
    sys.argv = ["ppo_full_finetune", "--config", str(CONFIG), *overrides]
    sys.exit(ppo_full_finetune.recipe_main())


# ----------------------------------------------------------------------------- the driver


def _env(**hooks: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HOOK_ENVS}
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **hooks}


def _data(out: Path) -> Path:
    return out.parent / DATA_FNAME


def _start(out: Path, steps: int, resume: bool, log, **hooks: str) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"output_dir={out}",
           f"num_ppo_steps={steps}", *SHAPE, *_run_overrides, f"dataset.data_files={_data(out)}",
           f"resume_from_checkpoint={resume}"]
    # SIGHUP heard from the start, even under a driver started with it ignored (nohup), which the
    # run, as documented, would go on ignoring: the sighup fault is a closed terminal's.
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(**hooks), stdout=log, stderr=log, preexec_fn=_hear_sighup)


def _hear_sighup() -> None:
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _log_files(out: Path) -> List[List[str]]:
    """The ``Step`` lines of each ``log_*.txt`` (one per process), oldest first."""
    files = sorted((out / "logs").glob("log_*.txt"), key=lambda f: f.stat().st_mtime)
    return [[line for line in f.read_text().splitlines() if line.startswith("Step ")] for f in files]


def _log_lines(out: Path) -> List[str]:
    return [line for lines in _log_files(out) for line in lines]


def _row(line: str) -> Tuple[int, Dict[str, str]]:
    head, payload = line.split(" | ", 1)
    return int(head.split()[1]), dict(item.split(":", 1) for item in payload.split())


def _is_eval(row: Dict[str, str]) -> bool:
    return any(k.startswith("val/") for k in row)


def logged_metrics(out: Path) -> Tuple[Dict[int, Dict[str, str]], Dict[int, Dict[str, str]]]:
    """``{step: {metric: text}}`` of the steps and of the evaluations (their ``val/`` rows, logged
    at the step they followed), each the last row logged for its step over every attempt."""
    steps, evals = {}, {}
    for line in _log_lines(out):
        step, row = _row(line)
        (evals if _is_eval(row) else steps)[step] = row
    return steps, evals


def logged_twice(out: Path) -> List[str]:
    """The steps and evaluations a process logged more than once."""
    found = []
    for i, lines in enumerate(_log_files(out)):
        seen = set()
        for line in lines:
            step, row = _row(line)
            key = ("the evaluation after step" if _is_eval(row) else "step", step)
            if key in seen:
                found.append(f"{out}: process {i + 1} logged {key[0]} {step} twice")
            seen.add(key)
    return found


def _timing(key: str) -> bool:
    return key.startswith("time/") or "per_second" in key or key.startswith("memory")


def check_disk(out: Path) -> List[str]:
    """Problems with what is on disk: every step folder complete, checksummed and finite."""
    import torch
    from safetensors.torch import load_file

    from torchtune_ppo.checkpointing import store

    problems = []
    root = out / store.CHECKPOINTS_DIRNAME
    for p in sorted(root.glob("step_*")) if root.is_dir() else []:
        if ".damaged-" in p.name:  # set aside by a resume (damaged_checkpoint): kept, never read
            continue
        reason = store._invalid_reason(p, verify=True)
        if reason is not None:
            problems.append(f"{p}: {reason}")
            continue
        for f in p.rglob("*.safetensors"):
            if not all(bool(torch.isfinite(t).all()) for t in load_file(f).values()):
                problems.append(f"{f}: non-finite weights")
        if (p / "shards").is_dir() and not all(bool(torch.isfinite(t).all()) for t in _weights(p).values()
                                               if t.is_floating_point()):
            problems.append(f"{p}/shards: non-finite weights or optimizer state")
        state = store.load_training_state(p)
        for t in _tensors(state["optimizer"]):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                problems.append(f"{p}: non-finite optimizer state")
                break
    return problems


def _tensors(obj):
    import torch

    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _latest_step(out: Path) -> Optional[int]:
    from torchtune_ppo.checkpointing import store

    complete = store._complete_steps(out / store.CHECKPOINTS_DIRNAME, warn=False)
    return complete[-1][0] if complete else None


def _finished(out: Path, steps: int) -> bool:
    """The run's last step is saved and, when the runs evaluate, the evaluation after it recorded
    in that checkpoint (one killed before it finished runs on resume)."""
    from torchtune_ppo.checkpointing import store

    if _latest_step(out) != steps:
        return False
    return (EVAL_OVERRIDES[0] not in _run_overrides
            or (out / store.CHECKPOINTS_DIRNAME / f"step_{steps}" / store.EVALUATION_FNAME).is_file())


def _weights(step_dir: Path):
    from safetensors.torch import load_file

    from torchtune_ppo.checkpointing import sharded

    if (step_dir / "shards").is_dir():  # --sharded: the weights, optimizer state and masters
        return sharded.read_full(step_dir, "")
    return {f"{m}/{k}": v for m in ("policy", "value") for f in sorted((step_dir / m).glob("*.safetensors"))
            for k, v in load_file(f).items()}


def reference(workdir: Path, steps: int, log) -> Tuple[Path, float, float]:
    """The uninterrupted run; returns its folder, startup seconds and seconds per step."""
    out = workdir / "reference"
    start = time.monotonic()
    proc = _start(out, steps, False, log)
    first = None
    while proc.poll() is None:
        if first is None and (out / "logs").is_dir() and _step_lines(out):
            first = time.monotonic() - start
        time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed (rc={proc.returncode}); see {log.name}")
    wall = time.monotonic() - start
    first = first or wall / 2
    return out, first, max(0.05, (wall - first) / max(1, steps - 1))


def _step_lines(out: Path) -> List[str]:
    return [line for line in _log_lines(out) if not _is_eval(_row(line)[1])]


def _wait_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float) -> None:
    deadline, base = time.monotonic() + timeout, len(_step_lines(out)) if (out / "logs").is_dir() else 0
    while proc.poll() is None and time.monotonic() < deadline:
        if ((out / "logs").is_dir() and len(_step_lines(out)) - base >= n):
            return
        time.sleep(0.05)


def _damage(folder: Path, rng: random.Random) -> str:
    """Overwrite bytes in the middle of one of ``folder``'s weight files or its training state:
    same size, other bytes. Returns the file's name."""
    files = sorted(folder.glob("*/*.safetensors")) + sorted(folder.glob("shards/*.distcp")) + [folder / "training_state.pt"]
    target = rng.choice(files)
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.seek(size // 2)
        old = f.read(min(4000, size - size // 2))
        f.seek(size // 2)
        f.write(bytes((b + 1) % 256 for b in old))
    return str(target.relative_to(folder))


def attempt(out: Path, steps: int, fault: str, rng: random.Random, startup: float, per_step: float,
            log) -> Tuple[int, str, List[str], str]:
    """One process start hit by ``fault``; returns its exit code, what was done, what the
    fault's own checks found wrong, and the fault applied (``data_edit`` without a checkpoint
    to resume becomes ``sighup``)."""
    from torchtune_ppo.checkpointing import store

    resume = _latest_step(out) is not None
    hooks, what, found = {}, fault, []
    complete = store._complete_steps(out / store.CHECKPOINTS_DIRNAME, warn=False)
    applied, damaged = fault, ""
    if fault == "damaged_checkpoint":
        if len(complete) >= 2:  # an older one to go on from
            newest = complete[-1][1]
            damaged = f"{newest.name}/{_damage(newest, rng)}"
        else:
            damaged = "none (fewer than 2 checkpoints)"
    if fault == "data_edit":
        if not resume:
            fault = applied = "sighup"
        else:
            data = _data(out)
            original = data.read_text()
            rows = json.loads(original)
            rows[rng.randrange(len(rows))]["prompt"] += " (edited)"
            data.write_text(json.dumps(rows))
            before = sorted(p.name for p in (out / store.CHECKPOINTS_DIRNAME).iterdir())
            log.flush()
            mark = log.tell()
            rc = _start(out, steps, resume, log).wait(timeout=600)
            log.flush()
            data.write_text(original)
            with open(log.name) as f:
                f.seek(mark)
                said = f.read()
            if str(data) not in said:
                found.append(f"data_edit: the refusal does not name {data}")
            after = sorted(p.name for p in (out / store.CHECKPOINTS_DIRNAME).iterdir())
            if after != before:
                found.append(f"data_edit: checkpoints changed from {before} to {after}")
            return rc, what, found, applied
    if fault == "sigkill_during_save":
        sharded = SHARDED_OVERRIDES[0] in _run_overrides
        hooks["TORCHTUNE_PPO_CRASH_DURING_SAVE"] = point = rng.choice(SHARDED_SAVE_POINTS if sharded else SAVE_POINTS)
        what = f"{fault}:{point}"
    elif fault == "full_disk":
        hooks["TORCHTUNE_PPO_FULL_DISK_DURING_SAVE"] = "1"
    elif fault == "reward_raises":
        hooks[RAISE_ENV] = str(rng.randint(1, 3))
        what = f"{fault}:rollout {hooks[RAISE_ENV]}"
    elif fault in ENV_FAULTS:
        how = "hang" if fault == "env_hangs" else rng.choice(EXIT_HOWS)
        hooks[ENV_FAULT] = f"{how}:{rng.randint(1, 16)}"  # a step has 8 rows: one of its first two steps
        what = f"{fault}:{hooks[ENV_FAULT]}"
    elif fault == "sigkill_during_eval":
        hooks[EVAL_KILL] = f"{rng.randint(1, 2)}:{rng.randint(1, 2)}"  # 16 prompts: 2 batches of 8
        what = f"{fault}:evaluation {hooks[EVAL_KILL].replace(':', ', batch ')}"
    log.flush()
    mark = log.tell()
    proc = _start(out, steps, resume, log, **hooks)
    if fault in ("sigkill", "sigterm", "sighup", "damaged_checkpoint"):
        sig = {"sigkill": signal.SIGKILL, "sighup": signal.SIGHUP}.get(fault, signal.SIGTERM)
        # damaged_checkpoint: the signal only after a step, when the resume has set the damage aside
        if fault != "damaged_checkpoint" and rng.random() < 0.15:  # during startup
            delay = rng.uniform(0, startup)
            time.sleep(delay)
            what = f"{fault}@startup+{delay:.1f}s"
        else:
            n = rng.randint(1 if fault == "damaged_checkpoint" else 0, 2)
            _wait_steps(proc, out, n, timeout=startup * 4 + per_step * 10)
            delay = rng.uniform(0, per_step)
            time.sleep(delay)
            what = f"{fault}@{n} steps+{delay:.2f}s"
        if proc.poll() is None:
            proc.send_signal(sig)
        else:
            what += " (the attempt had ended: not sent)"
    try:
        rc = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
        what += " (hung: killed)"
    if fault == "damaged_checkpoint":
        what = f"{fault}:{damaged}, then sigterm@{what.split('@', 1)[1]}"
    if fault == "sigkill_during_eval":
        log.flush()
        with open(log.name) as f:
            f.seek(mark)
            said = [line for line in f.read().splitlines() if line.startswith(EVAL_KILLED)]
        if said:
            what += f" (after step {said[-1].split()[-1]})"
        elif rc != 0:  # rc 0: the run ended before that evaluation
            found.append("sigkill_during_eval: the process did not die inside an evaluation")
    return rc, what, found, applied


_EXPECTED_RC = {"sigkill": (-9, 0), "sigkill_during_save": (-9, 0), "sigterm": (128 + 15, -15, 0),
                "reward_raises": (1, 0), "full_disk": (1, 0), "sighup": (128 + 1, -1, 0),
                "damaged_checkpoint": (128 + 15, -15, 0), "data_edit": (1,),
                # 0: the attempt reached the end of the run before its n-th environment step
                "env_hangs": (1, 0), "env_exits": (1, 0),
                # 0: the attempt reached the end of the run before its n-th evaluation
                "sigkill_during_eval": (-9, 0)}


def faulted_run(out: Path, ref: Path, steps: int, sequence: List[str], kinds: List[str], budget: int,
                rng: random.Random, startup: float, per_step: float, log, first_fault: int = 0
                ) -> Tuple[int, List[str]]:
    """One run hit by up to ``budget`` faults, then finished; returns the faults applied and
    every problem found (on disk after each fault, and against the reference at the end)."""
    problems, faults = [], 0
    while faults < budget and not _finished(out, steps):
        fault = sequence[faults] if sequence else rng.choice(kinds)
        rc, what, found, applied = attempt(out, steps, fault, rng, startup, per_step, log)
        if applied != fault:
            what = f"{fault}:none (no checkpoint yet), {applied} instead: {what}"
        faults += 1
        found += check_disk(out)
        if rc not in _EXPECTED_RC[applied]:
            found.append(f"exit code {rc}")
        print(f"fault {first_fault + faults}: {what}: rc={rc}, newest checkpoint {_latest_step(out)}"
              + (f"; PROBLEMS: {found}" if found else ""), flush=True)
        problems += [f"fault {first_fault + faults} ({what}): {p}" for p in found]
    for _ in range(3):  # then to the end without faults
        if _finished(out, steps):
            break
        proc = _start(out, steps, _latest_step(out) is not None, log)
        if proc.wait() != 0:
            problems.append(f"{out}: the final attempt failed (rc={proc.returncode})")
        problems += check_disk(out)

    (want, want_evals), (got, got_evals) = logged_metrics(ref), logged_metrics(out)
    if sorted(got) != list(range(1, steps + 1)):
        problems.append(f"{out}: logged steps {sorted(got)}")
    if sorted(got_evals) != sorted(want_evals):
        problems.append(f"{out}: evaluated after steps {sorted(got_evals)}, uninterrupted {sorted(want_evals)}")
    for what, wanted, logged in (("step", want, got), ("evaluation after step", want_evals, got_evals)):
        for step in sorted(wanted):
            for key, value in wanted[step].items():
                if not _timing(key) and logged.get(step, {}).get(key) != value:
                    problems.append(f"{out}: {what} {step}: {key} = {logged.get(step, {}).get(key)}, "
                                    f"uninterrupted {value}")
    problems += logged_twice(out)
    final = out / "checkpoints" / f"step_{steps}"
    if final.is_dir():
        import torch

        a, b = _weights(final), _weights(ref / "checkpoints" / f"step_{steps}")
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            problems.append(f"{out}: final weights differ from the uninterrupted run's")
    else:
        problems.append(f"{out}: no checkpoint of step {steps}")
    return faults, problems


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10, help="PPO steps of the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ppo-chaos"))
    parser.add_argument("--kinds", default=",".join(FAULTS), help="comma-separated faults to draw from")
    parser.add_argument("--sharded", action="store_true",
                        help="every run saves sharded checkpoints in the background (checkpoint_format=sharded, "
                             "async_save=True); kills inside a save then hit the background write")
    parser.add_argument("--sequence", default=None,
                        help="comma-separated faults to apply in this order (instead of --faults draws)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    sequence = args.sequence.split(",") if args.sequence else None
    if sequence:
        args.faults = len(sequence)
    for kind in sequence or kinds:
        if kind not in FAULTS:
            parser.error(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
    from torchtune_ppo import asset_path

    _run_overrides[:] = ENV_OVERRIDES if set(sequence or kinds) & set(ENV_FAULTS) else []
    if "sigkill_during_eval" in (sequence or kinds):
        eval_data = asset_path(f"tiny_sentiment/{DATA_FNAME}")
        _run_overrides.extend([*EVAL_OVERRIDES, f"eval.dataset.data_files={eval_data}"])
    if args.sharded:
        _run_overrides.extend(SHARDED_OVERRIDES)
    args.workdir.mkdir(parents=True, exist_ok=True)

    shutil.copyfile(asset_path("tiny_sentiment/prompts.json"), args.workdir / DATA_FNAME)
    log = open(args.workdir / "processes.log", "w")
    ref, startup, per_step = reference(args.workdir, args.steps, log)
    evaluated = sorted(logged_metrics(ref)[1])
    print(f"reference: {args.steps} steps, startup {startup:.1f}s, {per_step:.2f}s/step, "
          f"{'multi-turn (ChaosEnv)' if ENV_OVERRIDES[0] in _run_overrides else 'single-turn'}, "
          f"{f'evaluated after steps {evaluated}' if evaluated else 'no evaluation'}", flush=True)

    problems, faults, rounds = [], 0, 0
    while faults < args.faults:  # a run that reaches its end before the faults are spent: another
        out = args.workdir / f"chaos_{rounds}"
        shutil.rmtree(out, ignore_errors=True)
        used, found = faulted_run(out, ref, args.steps, (sequence or [])[faults:], kinds, args.faults - faults,
                                  rng, startup, per_step, log, first_fault=faults)
        faults, rounds, problems = faults + used, rounds + 1, problems + found
        print(f"run {rounds}: {used} faults, {len(found)} problems", flush=True)
    result = {"faults": faults, "runs": rounds, "steps": args.steps, "problems": problems}
    (args.workdir / "result.json").write_text(json.dumps(result, indent=2))
    print(f"{faults} faults, {len(problems)} problems" + "".join(f"\n  {p}" for p in problems[:50]))
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    sys.exit(main())

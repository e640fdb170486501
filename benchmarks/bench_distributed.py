"""Data-parallel benchmark on CPU: where a PPO step's time goes on 1 and 2 processes
(computation vs collectives), and the cost of FSDP2's collectives in generation.

Part 1 runs the recipe in-process (``PPOFullFinetuneRecipe`` on the tiny sentiment task, one
thread per process, greedy), once on 1 process and once under ``torchrun`` on 2, at the same
global batch. Each process times every collective it calls (FSDP2's all-gathers and
reduce-scatters, the recipe's all-reduces and gathers: the ``torch.distributed`` calls, from
call to return, which includes waiting for the other rank) and books it to the phase it ran in.
It reports the median over the steps after the first (warm-up, compilation) of each phase's
seconds, and on 2 processes the seconds of that phase spent in collectives (mean over ranks).
``gather`` is the policy gathered for generation and, with compiled scoring, the scoring models
gathered for scoring, and their freeing (``distributed.gathered``), taken out of the generate and
score phases it runs in; ``other`` is the rest of the step.
Not counted: the one all-reduce of the global gradient norm (DTensor's functional collective).

Part 2 (``torchrun`` workers on the random-weight demo-size policy, sharded as the recipe
shards it) times one ``Generator.generate`` call two ways: the recipe's (every layer gathered
once for the whole call) and FSDP2's default (each layer gathered at every forward, so once per
prompt and once per decode token), and one gather + free of all the policy's parameters,
the communication the recipe's way pays per generate call.

    python benchmarks/bench_distributed.py [--steps 6] [--compile] [--out dist.json]
"""

import argparse
import collections
import collections
import contextlib
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
GLOBAL_BATCH = 16
OVERRIDES = [
    f"batch_size={GLOBAL_BATCH}", f"forward_batch_size={GLOBAL_BATCH}", f"ppo_batch_size={GLOBAL_BATCH}",
    "gradient_accumulation_steps=1", "ppo_epochs=2", "max_generated_tokens=16", "top_k=1",
    "cpu_threads=1", "save_every_n_steps=null", "log_samples_every_n_steps=null",
]
PHASES = ("step", "gather", "generate", "score", "advantages", "loss_step", "optimizer", "other")
# The torch.distributed calls that communicate (FSDP2 calls the *_single ones).
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_reduce", "all_gather", "all_gather_object",
               "broadcast", "barrier")


class CollectiveClock:
    """Seconds spent in ``torch.distributed`` collectives, booked to the innermost phase of the
    recipe's ``PhaseTimer`` (or of ``distributed.gathered``, booked as ``gather``)."""

    def __init__(self) -> None:
        self.phases, self.seconds = [], collections.Counter()
        self.gather_seconds = collections.defaultdict(float)  # by the phase it ran inside

    def install(self) -> None:
        import torch.distributed as dist

        from torchtune_ppo import distributed

        from torchtune_ppo.run import metrics

        for name in COLLECTIVES:
            setattr(dist, name, self._timed(getattr(dist, name)))
        phase_timer, clock = metrics.PhaseTimer.__call__, self

        @contextlib.contextmanager
        def in_phase(timer, phase):
            clock.phases.append(phase)
            try:
                with phase_timer(timer, phase):
                    yield
            finally:
                clock.phases.pop()

        metrics.PhaseTimer.__call__ = in_phase
        gathered = distributed.gathered

        @contextlib.contextmanager
        def timed_gathered(*models):
            inside = clock.phases[-1] if clock.phases else "step"
            clock.phases.append("gather")
            start = time.perf_counter()
            context = gathered(*models)
            context.__enter__()
            clock.gather_seconds[inside] += time.perf_counter() - start
            clock.phases.pop()
            try:
                yield
            finally:
                clock.phases.append("gather")
                start = time.perf_counter()
                context.__exit__(None, None, None)
                clock.gather_seconds[inside] += time.perf_counter() - start
                clock.phases.pop()

        distributed.gathered = timed_gathered

    def _timed(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.phases[-1] if self.phases else "outside"] += time.perf_counter() - start
        return timed

    def take(self) -> dict:
        """This step's seconds per phase (collectives, and the gather's own wall time); resets."""
        out = {"collectives": dict(self.seconds), "gather": dict(self.gather_seconds)}
        self.seconds.clear()
        self.gather_seconds.clear()
        return out


def recipe_worker(steps: int, compiled: bool) -> None:
    """One process of part 1 (plain, or under torchrun): the recipe with its collectives timed."""
    from omegaconf import OmegaConf

    from ppo_full_finetune import PPOFullFinetuneRecipe
    from torchtune_ppo import distributed
    from torchtune_ppo.config import validate_config

    clock = CollectiveClock()
    clock.install()
    rows = []

    def on_step(step, metrics):
        taken = clock.take()
        phase = {p: metrics.get(f"time/{p}", 0.0) for p in PHASES if p not in ("gather", "other")}
        # The rollout gathers inside the generate and score phases: booked as "gather" instead.
        for inside, seconds in taken["gather"].items():
            if inside in phase and inside != "step":
                phase[inside] -= seconds
        phase["gather"] = sum(taken["gather"].values())
        phase["other"] = phase["step"] - sum(v for k, v in phase.items() if k != "step")
        booked = taken["collectives"]  # "step": in the step, outside its phases
        comm = {p: booked.get(p, 0.0) for p in PHASES if p not in ("step", "other")}
        comm["other"] = booked.get("step", 0.0)
        comm["step"] = sum(v for k, v in booked.items() if k != "outside")
        rows.append({"time": phase, "collectives": comm, "recompiles": metrics["recompiles"]})

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*OVERRIDES, f"output_dir={tmp}/run", f"num_ppo_steps={steps}", f"compile={compiled}"]
        cfg = validate_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(overrides)))
        recipe = PPOFullFinetuneRecipe(cfg)
        recipe.setup(cfg)
        recipe.train(on_step=on_step)
        recipe.cleanup()
    rows = rows[1:]  # the first step warms up (and compiles)
    result = {kind: {p: statistics.median(r[kind][p] for r in rows) for p in rows[0][kind]}
              for kind in ("time", "collectives")}
    result["recompiles_after_step_1"] = max(r["recompiles"] for r in rows)
    if distributed.world_size() > 1:  # collectives: mean over ranks
        every = distributed.all_gather_objects(result["collectives"])
        result["collectives"] = {p: statistics.mean(r[p] for r in every) for p in every[0]}
    if distributed.rank() == 0:
        print("RESULT " + json.dumps(result))
    if distributed.world_size() > 1:
        torch.distributed.destroy_process_group()


def generation_worker(repeats: int) -> None:
    """Part 2, under torchrun: generation with the parameters gathered once vs per forward."""
    from torchtune_ppo import distributed
    from torchtune_ppo.rollout.generation import Generator
    from torchtune_ppo.tasks.tiny_sentiment import tiny_policy

    torch.set_num_threads(1)
    device = torch.device("cpu")
    distributed.init_distributed(device)
    torch.manual_seed(0)
    policy = tiny_policy()
    distributed.shard(policy)
    batch, prompt_len, steps = 8, 16, 32
    gen = Generator(policy, batch_size=batch, max_prompt_len=prompt_len, max_generated_tokens=steps,
                    pad_id=0, stop_token_ids=[], temperature=1.0, top_k=1, top_p=None,
                    compiled=False, compile_mode="default", dtype=torch.float32, device=device)
    prompts = torch.randint(3, 100, (batch, prompt_len))
    lens = torch.full((batch,), prompt_len)

    def gathered_once():
        with distributed.gathered(policy):
            gen.generate(prompts, lens)

    def per_forward():
        gen.generate(prompts, lens)
        distributed.reshard(policy)

    def gather_only():
        with distributed.gathered(policy):
            pass

    result = {}
    for name, fn in (("generate_gathered_once", gathered_once), ("generate_gather_per_forward", per_forward),
                     ("gather_and_free_policy", gather_only)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            distributed.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    if distributed.rank() == 0:
        print("RESULT " + json.dumps(result))
    torch.distributed.destroy_process_group()


def _launch(nproc: int, *args: str) -> dict:
    """This file with ``args`` on ``nproc`` processes (torchrun for more than 1); rank 0's RESULT."""
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    cmd = [sys.executable, *launcher, __file__, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="compile=True (every region)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=("recipe", "generation"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "recipe":
        return recipe_worker(args.steps, args.compile)
    if args.worker == "generation":
        return generation_worker(args.repeats)
    report = {"hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "global_batch": GLOBAL_BATCH, "compile": args.compile,
              "recipe": {}}
    recipe_args = ["--worker", "recipe", "--steps", str(args.steps)] + (["--compile"] if args.compile else [])
    for nproc in (1, 2):
        report["recipe"][nproc] = _launch(nproc, *recipe_args)
    report["generation_2_processes"] = _launch(2, "--worker", "generation", "--repeats", str(args.repeats))

    one, two = report["recipe"][1], report["recipe"][2]
    print(f"{report['hardware']}, torch {report['torch']}, 1 thread per process, "
          f"{'compile=True' if args.compile else 'eager'}, greedy, global batch {GLOBAL_BATCH}; "
          f"median over steps 2-{args.steps}")
    print(f"{'phase':<12}{'1 process s':>13}{'2 processes s':>15}{'in collectives s':>18}{'rest s':>9}")
    for p in PHASES:
        t1, t2, c2 = one["time"][p], two["time"][p], two["collectives"].get(p, 0.0)
        print(f"{p:<12}{t1:>13.4f}{t2:>15.4f}{c2:>18.4f}{t2 - c2:>9.4f}")
    print(f"steps/s: 1 process {1 / one['time']['step']:.2f}, 2 processes {1 / two['time']['step']:.2f} "
          f"({one['time']['step'] / two['time']['step']:.2f}x); collectives "
          f"{two['collectives']['step'] / two['time']['step']:.0%} of a 2-process step; recompiles after "
          f"step 1: {one['recompiles_after_step_1']:.0f} and {two['recompiles_after_step_1']:.0f}")
    for k, v in report["generation_2_processes"].items():
        print(f"{k:<30}{v * 1000:>10.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

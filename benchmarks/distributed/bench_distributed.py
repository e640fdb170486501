"""Data-parallel benchmark on CPU: where a PPO step's time goes on 1 and 2 processes
(computation vs collectives), and the cost of FSDP2's collectives in generation.

Part 1 runs the recipe in-process (``PPOFullFinetuneRecipe`` on the tiny sentiment task, one
thread per process, greedy) on 1 process and on 2 (a gloo group on localhost whose ranks this
script starts with torchrun's environment variables), at the same global batch. Both rows stay
up and take turns one PPO step at a time, the order reversed every round
(``benchmarks/bench_common``), until the per-pair ratios of the 1-process step to the 2-process
one have 95% intervals within ``--target-width`` or ``--max-steps`` pairs. Each process times every collective it calls (FSDP2's all-gathers and
reduce-scatters, the recipe's all-reduces and gathers: the ``torch.distributed`` calls, from
call to return, which includes waiting for the other rank) and books it to the phase it ran in.
It reports the median over the steps after the warm-up (the first compiles) of each phase's
seconds, on 2 processes the seconds of that phase spent in collectives (mean over ranks), and
per phase the median of the per-pair ratios 1 process / 2 processes with its 95% interval.
``gather`` is the policy gathered for generation and, with compiled scoring, the scoring models
gathered for scoring, and their freeing (``distributed.gathered``), taken out of the generate and
score phases it runs in; ``other`` is the rest of the step.
Not counted: the one all-reduce of the global gradient norm (DTensor's functional collective).

Part 2 (``torchrun`` workers on the random-weight demo-size policy, sharded as the recipe
shards it) times one ``Generator.generate`` call two ways: the recipe's (every layer gathered
once for the whole call) and FSDP2's default (each layer gathered at every forward, so once per
prompt and once per decode token), and one gather + free of all the policy's parameters,
the communication the recipe's way pays per generate call; the three calls take turns in
rounds, and the speed-up of gathering once is the median of per-round ratios.

The machine state and the headline verdict (``bench_common.machine``) go with the result.

    python benchmarks/distributed/bench_distributed.py [--max-steps 30] [--compile] [--out dist.json]
"""

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
from bench_common.interleave import round_order, run_interleaved  # noqa: E402
from bench_common.machine import CpuMeter, headline_verdict, loadavg, machine_info, verdict_lines  # noqa: E402
from bench_common.protocol import WorkerRow, serve  # noqa: E402
from bench_common.stats import CONFIDENCE, format_ratio, pair_ratios, summarize_ratios  # noqa: E402

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


class RecipeRow:
    """One rank of part 1 for ``protocol.serve``: the recipe, its collectives timed, one step a command."""

    def __init__(self, max_steps: int, compiled: bool):
        from omegaconf import OmegaConf

        from ppo_full_finetune import PPOFullFinetuneRecipe
        from torchtune_ppo.config import validate_config

        self.clock = CollectiveClock()
        self.clock.install()
        self.tmp = tempfile.mkdtemp(prefix="bench_distributed_")
        overrides = [*OVERRIDES, f"output_dir={self.tmp}/run", f"num_ppo_steps={max_steps}",
                     f"compile={compiled}"]
        cfg = validate_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(overrides)))
        self.recipe = PPOFullFinetuneRecipe(cfg)
        self.recipe.setup(cfg)
        self.info = {"threads": torch.get_num_threads()}

    def run(self, on_step) -> None:
        clock = self.clock

        def step_end(step, metrics):
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
            on_step({**{f"{p}_s": v for p, v in phase.items()}, "collectives": comm,
                     "recompiles": metrics["recompiles"]})

        self.recipe.train(on_step=step_end)

    def finish(self) -> dict:
        self.recipe.cleanup()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return {}


def merge_ranks(steps: List[dict]) -> dict:
    """A step of a multi-process row: rank 0's phase times, each phase's collectives averaged
    over the ranks."""
    out = dict(steps[0])
    out["collectives"] = {p: statistics.mean(s["collectives"][p] for s in steps) for p in steps[0]["collectives"]}
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def recipe_row(nproc: int, args, log_dir: Path) -> WorkerRow:
    """Part 1's row on ``nproc`` processes, each a worker this script starts (a rank of a
    ``gloo`` group on localhost when ``nproc > 1``, as torchrun would set it up)."""
    argv = [sys.executable, __file__, "--worker", "recipe", "--max-steps", str(args.warmup + args.max_steps)]
    argv += ["--compile"] if args.compile else []
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath,
                TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix=f"inductor_{nproc}proc_"))
    commands = []
    port = _free_port()
    for rank in range(nproc):
        env = dict(base)
        if nproc > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        commands.append((argv, env))
    return WorkerRow(f"{nproc}proc", commands, log_dir, merge=merge_ranks, cwd=ROOT)


def generation_worker(args) -> None:
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
                    dtype=torch.float32, device=device)
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

    fns = {"generate_gathered_once": gathered_once, "generate_gather_per_forward": per_forward,
           "gather_and_free_policy": gather_only}
    for fn in fns.values():
        fn()  # warm-up
    # Rounds of one call each, the order reversed every round (bench_common.interleave's
    # schedule); every rank runs the same call at the same time, and rank 0 decides the stop.
    times = {name: [] for name in fns}
    stop = "max steps"
    for r in range(args.max_steps):
        for name in round_order(list(fns), r):
            distributed.barrier()
            start = time.perf_counter()
            fns[name]()
            times[name].append({"round": r, "s": time.perf_counter() - start})
        ratio = summarize_ratios(pair_ratios(times["generate_gather_per_forward"],
                                             times["generate_gathered_once"], "s"))
        done = [r + 1 >= args.min_steps and ratio["coverage"] >= CONFIDENCE
                and ratio["half_width"] <= args.target_width]
        torch.distributed.broadcast_object_list(done, src=0)
        if done[0]:
            stop = "target width"
            break
    result = {name: statistics.median(t["s"] for t in ts) for name, ts in times.items()}
    result.update(gathered_once_speedup=ratio, rounds=len(times["generate_gathered_once"]), stop=stop)
    if distributed.rank() == 0:
        print("RESULT " + json.dumps(result))
    torch.distributed.destroy_process_group()


def _launch_torchrun(nproc: int, *args: str) -> dict:
    """This file with ``args`` under torchrun on ``nproc`` processes; rank 0's RESULT."""
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    cmd = [sys.executable, *launcher, __file__, *args]
    pythonpath = os.pathsep.join(p for p in (str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def run_part1(args, log_dir: Path, meter: CpuMeter):
    """The recipe on 1 and on 2 processes, interleaved one PPO step at a time."""
    rows = {"1 process": recipe_row(1, args, log_dir), "2 processes": recipe_row(2, args, log_dir)}
    for row in rows.values():
        row.start()
    for name, row in rows.items():
        row.ready()
        print(f"{name}: set up", flush=True)
    run = run_interleaved(rows, warmup=args.warmup, max_steps=args.max_steps, min_steps=args.min_steps,
                          target_width=args.target_width, key="step_s",
                          reference=lambda steps: "1 process", meter=meter)
    for name, row in rows.items():
        if name not in run.failed:
            row.stop()
    if run.failed:
        sys.exit(f"part 1 failed: {run.failed}")
    result = {}
    for name, steps in run.steps.items():
        measured = [s for s in steps if s["round"] >= args.warmup]
        result[name] = {
            "time": {p: statistics.median(s[f"{p}_s"] for s in measured) for p in PHASES},
            "collectives": {p: statistics.median(s["collectives"][p] for s in measured)
                            for p in measured[0]["collectives"]},
            "recompiles_after_step_1": max(s["recompiles"] for s in measured),
            "steps": steps,
        }
    # Per pair: the 1-process phase over the 2-process one (above 1: 2 processes faster).
    result["ratios_1_over_2"] = {
        p: summarize_ratios(pair_ratios(run.steps["1 process"], run.steps["2 processes"], f"{p}_s", args.warmup))
        for p in PHASES}
    return result, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=1, help="steps left out (the first compiles)")
    parser.add_argument("--max-steps", type=int, default=30, help="measured steps (pairs) at most")
    parser.add_argument("--min-steps", type=int, default=6)
    parser.add_argument("--target-width", type=float, default=0.05,
                        help="stop once every 1-vs-2-process ratio's 95%% interval is within ± this")
    parser.add_argument("--compile", action="store_true", help="compile=True (every region)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", choices=("recipe", "generation"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "recipe":
        return serve(lambda: RecipeRow(args.max_steps, args.compile))
    if args.worker == "generation":
        return generation_worker(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_distributed_logs_"))
    before, meter = loadavg(), CpuMeter()
    part1, run = run_part1(args, log_dir, meter)
    verdict = headline_verdict(meter.total(), run.samples, threads=2)
    stop = run.describe_stop(args.target_width, args.max_steps)
    gen_meter = CpuMeter()
    gen_meter.start()
    generation = _launch_torchrun(2, "--worker", "generation", "--max-steps", str(args.max_steps),
                                  "--min-steps", str(args.min_steps), "--target-width", str(args.target_width))
    gen_meter.sample()
    machine = {**machine_info(ROOT, threads=2), "loadavg_before": before, "loadavg_after": loadavg()}
    report = {"hardware": f"{machine['cpu']}, {os.cpu_count()} cores", "torch": torch.__version__,
              "global_batch": GLOBAL_BATCH, "compile": args.compile, "machine": machine,
              "verdict": verdict, "stop": stop, "machine_per_round": run.samples,
              "recipe": part1, "generation_2_processes": generation,
              "generation_verdict": headline_verdict(gen_meter.total(), [], threads=2),
              "logs": str(log_dir)}

    one, two, ratios = part1["1 process"], part1["2 processes"], part1["ratios_1_over_2"]
    print(f"{report['hardware']}, torch {report['torch']}, 1 thread per process, "
          f"{'compile=True' if args.compile else 'eager'}, greedy, global batch {GLOBAL_BATCH}; "
          f"1 and 2 processes interleaved one step at a time, medians over the measured steps")
    print("\n".join(verdict_lines(machine, verdict)))
    print(f"- {stop}")
    print(f"{'phase':<12}{'1 process s':>13}{'2 processes s':>15}{'in collectives s':>18}{'rest s':>9}"
          f"   1/2 per pair [95%]")
    for p in PHASES:
        t1, t2, c2 = one["time"][p], two["time"][p], two["collectives"].get(p, 0.0)
        print(f"{p:<12}{t1:>13.4f}{t2:>15.4f}{c2:>18.4f}{t2 - c2:>9.4f}   {format_ratio(ratios[p])}")
    print(f"steps/s: 1 process {1 / one['time']['step']:.2f}, 2 processes {1 / two['time']['step']:.2f} "
          f"({format_ratio(ratios['step'], spread=True)} per pair); collectives "
          f"{two['collectives']['step'] / two['time']['step']:.0%} of a 2-process step; recompiles after "
          f"step 1: {one['recompiles_after_step_1']:.0f} and {two['recompiles_after_step_1']:.0f}")
    for k in ("generate_gathered_once", "generate_gather_per_forward", "gather_and_free_policy"):
        print(f"{k:<30}{generation[k] * 1000:>10.1f} ms")
    g = report["generation_verdict"]
    print(f"gathered once vs per forward: {format_ratio(generation['gathered_once_speedup'], spread=True)} "
          f"over {generation['rounds']} rounds ({generation['stop']}); other processes' CPU "
          f"{g['foreign_cores_mean'] if g['foreign_cores_mean'] is None else round(g['foreign_cores_mean'], 2)} cores"
          f"{'' if g['headline'] else ' (NOT A HEADLINE)'}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

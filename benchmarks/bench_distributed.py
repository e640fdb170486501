"""Data-parallel benchmark on CPU: the recipe on 1 and 2 processes at the same global batch,
and the cost of FSDP2's collectives in generation.

Part 1 runs ``tune run [--nproc_per_node 2] ppo_full_finetune`` on the tiny sentiment task
(one thread per process, eager, greedy) and reports the median seconds per PPO step and per
phase over the steps after the first (warm-up).

Part 2 (``torchrun`` workers on the random-weight demo-size policy, sharded as the recipe
shards it) times one ``Generator.generate`` call two ways: the recipe's (every layer gathered
once for the whole call) and FSDP2's default (each layer gathered at every forward, so once per
prompt and once per decode token), and one gather + free of all the policy's parameters,
the communication the recipe's way pays per generate call.

    python benchmarks/bench_distributed.py [--steps 6] [--out dist.json]
"""

import argparse
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
OVERRIDES = [
    "batch_size=16", "forward_batch_size=16", "ppo_batch_size=16", "gradient_accumulation_steps=1",
    "ppo_epochs=2", "max_generated_tokens=16", "top_k=1", "compile=False", "cpu_threads=1",
    "save_every_n_steps=null", "log_samples_every_n_steps=null",
]
PHASES = ("step", "generate", "score", "advantages", "loss_step", "optimizer")


def run_recipe(nproc: int, steps: int) -> dict:
    """Median seconds per phase over steps 2.. of one recipe run on ``nproc`` processes."""
    from torchtune_ppo.logs import read_disk_log

    with tempfile.TemporaryDirectory() as tmp:
        launch = ["run"] if nproc == 1 else ["run", "--nproc_per_node", str(nproc)]
        cmd = [sys.executable, "-m", "torchtune._cli.tune", *launch, "ppo_full_finetune",
               "--config", str(CONFIG), f"output_dir={tmp}/run", f"num_ppo_steps={steps}", *OVERRIDES]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
        rows = read_disk_log(f"{tmp}/run/logs")[1:]
    return {p: statistics.median(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES}


def worker(repeats: int) -> None:
    """Under torchrun: generation with the parameters gathered once vs per forward."""
    from torchtune_ppo import distributed
    from torchtune_ppo.generation import Generator
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


def run_workers(nproc: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           __file__, "--worker", "--repeats", str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.repeats)
    report = {"hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "global_batch": 16, "recipe": {}}
    for nproc in (1, 2):
        report["recipe"][nproc] = run_recipe(nproc, args.steps)
    report["generation_2_processes"] = run_workers(2, args.repeats)
    one, two = report["recipe"][1]["step"], report["recipe"][2]["step"]
    print(f"{report['hardware']}, torch {report['torch']}, 1 thread per process, eager, greedy")
    print(f"{'phase':<12}{'1 process s':>14}{'2 processes s':>16}")
    for p in PHASES:
        print(f"{p:<12}{report['recipe'][1][p]:>14.4f}{report['recipe'][2][p]:>16.4f}")
    print(f"steps/s: 1 process {1 / one:.2f}, 2 processes {1 / two:.2f} ({one / two:.2f}x)")
    for k, v in report["generation_2_processes"].items():
        print(f"{k:<30}{v * 1000:>10.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

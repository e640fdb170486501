"""What a checkpoint save costs on W CPU processes: rank 0's peak memory and the time the save
holds the step, for each way the recipe can save.

Each row is its own ``torchrun`` launch (gloo, ``OMP_NUM_THREADS=1``): W processes build a model
with random weights, shard it with FSDP2 as the recipe shards a trained model
(``distributed.shard``), give AdamW its state (one update), then save once, the way the row says:

- ``full``: ``checkpoint_format: full``, the recipe's gathering: the weights
  (``distributed.full_state_dict``) and the optimizer state keyed by name
  (``distributed.full_optimizer_state_dict``) gathered to rank 0, which writes them (``torch.save``
  of both, standing in for the HF writer, which writes the same bytes of weights);
- ``sharded``: ``checkpoint_format: sharded``: every rank writes its own shards
  (``checkpointing.sharded``: the weights, the optimizer state), synchronously;
- ``async``: the same with ``async_save``: the state staged (copied to fresh host tensors) and
  written by a background thread; the time held is the staging, and the write is then waited for.

Rank 0's memory is sampled every 2 ms from ``/proc/self/status`` (VmRSS) by a thread during the
save; reported is its peak above the resident size just before the save, and the seconds from the
call to its return (``async``: the staging, then the wait). The sharded rows then save a second
time, as every later save of a run does (``async``: into the first save's staging buffers), and
report the time that one held the step. The model is ``--model smollm2``
(SmolLM2-135M's shapes, 135M parameters) or ``large`` (the same family, 24 layers of width 1024:
about 360M parameters). The rows run one after the other, ``--repeats`` times each, interleaved.

    python benchmarks/distributed/bench_checkpoint.py --nproc 2 4 --model smollm2 large [--repeats 2] [--out ckpt.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("full", "sharded", "async")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """The largest resident size seen while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _model(name: str):
    from torchtune_ppo.models._smollm2 import smollm2, smollm2_135m

    if name == "smollm2":
        return smollm2_135m(max_seq_len=256)
    return smollm2(vocab_size=49152, num_layers=24, num_heads=16, num_kv_heads=4, embed_dim=1024,
                   intermediate_dim=2816, max_seq_len=256)


def worker(mode: str, model_name: str, out_dir: str, result: str) -> None:
    import torch

    from torchtune_ppo import distributed
    from torchtune_ppo.checkpointing import sharded

    torch.manual_seed(0)
    distributed.init_distributed(torch.device("cpu"))
    model = _model(model_name)
    distributed.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sharded.init_optimizer_state(opt)  # Adam's state for every parameter, as after a step
    models = {"policy": model}
    distributed.barrier()
    rank = distributed.rank()
    with _Peak() as peak:
        start = time.perf_counter()
        if mode == "full":
            weights = distributed.full_state_dict(model)
            optim = distributed.full_optimizer_state_dict(models, opt)
            if rank == 0:
                torch.save({"model": weights, "optimizer": optim}, Path(out_dir) / "full.pt")
            distributed.barrier()
            held = time.perf_counter() - start
            total = held
        else:
            writer = sharded.ShardWriter(async_save=mode == "async")
            writer.save(Path(out_dir) / "step", sharded.shard_state(models, opt), lambda: None)
            held = time.perf_counter() - start
            writer.wait()
            distributed.barrier()
            total = time.perf_counter() - start
    if mode != "full":  # a second save, as every later one in a run: the staging buffers reused
        start = time.perf_counter()
        writer.save(Path(out_dir) / "step2", sharded.shard_state(models, opt), lambda: None)
        held_again = time.perf_counter() - start
        writer.close()
        distributed.barrier()
    else:
        held_again = held
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
        Path(result).write_text(json.dumps({"peak_gib": (peak.peak - peak.base) / 2**30, "held_s": held,
                                            "held_again_s": held_again, "total_s": total, "params_approx": n}))
    distributed.shutdown()


def _launch(nproc: int, mode: str, model: str) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        result = Path(d) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               __file__, "--worker", mode, model, d, str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", nargs="+", default=["smollm2", "large"], choices=["smollm2", "large"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from bench_common import machine

    rows = {}
    for model in args.model:
        for nproc in args.nproc:
            for _ in range(args.repeats):
                for mode in args.modes:
                    r = _launch(nproc, mode, model)
                    rows.setdefault((model, nproc, mode), []).append(r)
                    print(f"{model} W={nproc} {mode}: rank 0 peak +{r['peak_gib']:.3f} GiB, held {r['held_s']:.3f} s "
                          f"(a second save {r['held_again_s']:.3f} s), written {r['total_s']:.3f} s", flush=True)
    print("\nmodel    W  mode     rank-0 peak (GiB)  held (s)  held, 2nd save (s)  until written (s)")
    summary = []
    for (model, nproc, mode), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("peak_gib", "held_s", "held_again_s", "total_s")}
        summary.append({"model": model, "nproc": nproc, "mode": mode, **med, "runs": rs})
        print(f"{model:8s} {nproc}  {mode:8s} {med['peak_gib']:8.3f}   {med['held_s']:8.3f}   "
              f"{med['held_again_s']:8.3f}   {med['total_s']:8.3f}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine.machine_info(ROOT, threads=1), "rows": summary}, indent=2))


if __name__ == "__main__":
    main()

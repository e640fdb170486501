"""Each rank of a torchrun run samples from its own random streams: the recipe set up on 2 CPU
processes (gloo), then every rank's sampling generator and torch's global generator compared
across ranks, and one draw of each. Ranks seeded alike would sample the same noise for their
prompts and repeat each other's responses to a shared prompt. The same set-up also shows each
rank's share of the global sizes: its prompts, generator rows, update rows and minibatch rows,
and its sampler's place (a size left global would pad every call with the other rank's rows)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_full_finetune import PPOFullFinetuneRecipe
from test_distributed import CONFIG, OVERRIDES, ROOT

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")

# Run by every rank: the recipe set up as `tune run` sets it up, then each rank's streams gathered.
WORKER = f'''
import json, sys
import torch
from omegaconf import OmegaConf
from {PPOFullFinetuneRecipe.__module__} import PPOFullFinetuneRecipe
from torchtune_ppo import distributed
from torchtune_ppo.config import validate_config

config, out, result, *overrides = sys.argv[1:]
cfg = validate_config(OmegaConf.merge(OmegaConf.load(config), OmegaConf.from_dotlist(["output_dir=" + out, *overrides])))
recipe = PPOFullFinetuneRecipe(cfg)
recipe.setup(cfg)
mine = {{"sampling_seed": recipe._rng.initial_seed(), "global_seed": torch.initial_seed(),
         "sampling_draw": torch.rand(4, generator=recipe._rng).tolist(), "global_draw": torch.rand(4).tolist(),
         "prompts": recipe._dataloader.batch_size, "generator_rows": recipe._rollout.generator.batch_size,
         "update_rows": recipe._update._batch_size, "minibatch_rows": recipe._update._ppo_batch_size,
         "sampler_replicas": recipe._sampler.num_replicas, "sampler_rank": recipe._sampler.rank}}
every = distributed.all_gather_objects(mine)
if distributed.rank() == 0:
    open(result, "w").write(json.dumps(every))
recipe.cleanup()
'''


def test_every_rank_samples_from_its_own_streams(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = tmp_path / "streams.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(CONFIG), str(tmp_path / "run"), str(result), *OVERRIDES, "seed=7", "forward_batch_size=4", "ppo_batch_size=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rank0, rank1 = json.loads(Path(result).read_text())
    for key in ("sampling_seed", "global_seed", "sampling_draw", "global_draw"):
        assert rank0[key] != rank1[key], key
    # the one-process run's streams are rank 0's: the run's seed itself
    assert rank0["sampling_seed"] == 7 and rank1["sampling_seed"] == 8
    # each rank holds its half of every global batch: prompts, generator rows, update rows
    for rank, mine in enumerate((rank0, rank1)):
        assert (mine["prompts"], mine["generator_rows"], mine["update_rows"], mine["minibatch_rows"]) == (4, 2, 4, 2)
        assert (mine["sampler_replicas"], mine["sampler_rank"]) == (2, rank)

"""The recipe on 2 CPU processes (torchrun, gloo, FSDP2) against 1 process over the same prompts."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torchtune import training
from torchtune.training import FullModelHFCheckpointer

from torchtune_ppo import distributed
from torchtune_ppo.rlhf import packing
from torchtune_ppo.ppo.loss_step import packed_ppo_loss_step
from torchtune_ppo.run import memory
from torchtune_ppo.config import validate_config
from torchtune_ppo.run.logs import read_disk_log
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy, tiny_reward

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"
TUNE = [sys.executable, "-m", "torchtune._cli.tune"]
# Greedy, so both runs generate the same responses whatever their random streams. One
# minibatch of the whole batch (ppo_batch_size == batch_size, no accumulation): the ranks' rows
# together form the 1-process minibatch, so the updates are the same.
OVERRIDES = [
    "batch_size=8", "forward_batch_size=8", "ppo_batch_size=8", "gradient_accumulation_steps=1",
    "ppo_epochs=2", "max_generated_tokens=8", "top_k=1", "compile=False", "cpu_threads=1",
    "num_ppo_steps=3", "save_every_n_steps=2", "log_samples_every_n_steps=null",
]


def _launch(output_dir: Path, nproc: int, *extra: str, timeout: int = 600, config: Path = CONFIG) -> str:
    """Runs the recipe (on ``config``, with :data:`OVERRIDES`); returns its console output."""
    # --standalone: a free port for the rendezvous, not torchrun's fixed 29500, which another
    # run on the machine (or one that just ended, its socket still closing) may hold.
    launch = ["run"] if nproc == 1 else ["run", "--nproc_per_node", str(nproc), "--standalone"]
    cmd = [*TUNE, *launch, "ppo_full_finetune", "--config", str(config),
           f"output_dir={output_dir}", *OVERRIDES, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _run(output_dir: Path, nproc: int, *extra: str, timeout: int = 600, config: Path = CONFIG):
    _launch(output_dir, nproc, *extra, timeout=timeout, config=config)
    return read_disk_log(output_dir / "logs")


def _policy(output_dir: Path, tmp_path: Path) -> torch.nn.Module:
    folder = output_dir / "checkpoints/step_3/policy"
    ckpt = FullModelHFCheckpointer(
        checkpoint_dir=str(folder),
        checkpoint_files=[p.name for p in folder.glob("*.safetensors")],
        model_type="LLAMA2",
        output_dir=str(tmp_path / "unused"),
    )
    model = tiny_policy()
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model


def test_memory_plan_per_device_of_several_processes():
    # No processes needed: the plan of a W-process run, per device.
    def plan(world_size, *overrides):
        cfg = validate_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(list(overrides))))
        return list(memory.memory_plan(cfg, world_size=world_size).rows.values())

    n_policy = sum(p.numel() for p in tiny_policy().parameters())
    n_value = sum(p.numel() for p in tiny_reward().parameters())
    one, two = plan(1), plan(2)
    assert two[0] == (0.5 + 1) * n_policy * 4 and two[1] == (0.5 + 1) * n_value * 4  # trained 1/2, frozen whole
    assert two[2] == one[2] / 2 and two[3] == one[3] / 2 and two[4] == one[4] / 2  # grads, optimizer, KV cache
    assert len(one) == 6 and two[6] == n_policy * 4  # the policy gathered for generation
    sharded = plan(2, "shard_frozen_models=True", "compile=True")
    # the policy gathered to generate, then the reference, value and reward models to score
    assert sharded[0] == n_policy * 4 and sharded[6] == max(n_policy, n_policy + 2 * n_value) * 4
    fused = plan(2, "shard_frozen_models=True", "compile.rollout=True")
    assert fused[6] == 2 * (n_policy + n_value) * 4  # one region: all four at once


def _packed_minibatch(policy, value, micro_batches, prompt_len=6, response_len=5, seed=0):
    """The fixed-shape packed micro-steps (as under FSDP) of a small ragged batch."""
    from types import SimpleNamespace

    from conftest import PAD_ID, VOCAB, left_padded_prompts

    prompt_lens, stops = [3, 6, 1, 4], [2, None, 0, 3]  # None: no stop token
    b, s = len(prompt_lens), prompt_len + response_len
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, VOCAB, (b, response_len), generator=g)
    padding = torch.zeros(b, response_len, dtype=torch.bool)
    for i, stop in enumerate(stops):
        if stop is not None:
            padding[i, stop + 1:] = True
    masks = torch.zeros(b, s, s, dtype=torch.bool)
    for i, n in enumerate(prompt_lens):  # packing reads the prompt lengths from this row
        masks[i, prompt_len, prompt_len - n : prompt_len + 1] = True
    valid = ~padding
    traj = SimpleNamespace(
        query_responses=torch.cat([left_padded_prompts(prompt_lens, prompt_len, seed), responses], 1),
        masks=masks, response_padding_masks=padding,
        logprobs=-torch.rand(b, response_len, generator=g) * 4 * valid,
        values=torch.randn(b, response_len, generator=g) * valid,
        ref_logprobs=-torch.rand(b, response_len, generator=g) * 4 * valid,
    )
    advantages = torch.randn(b, response_len, generator=g) * valid
    returns = torch.randn(b, response_len, generator=g) * valid
    lengths = packing.sequence_lengths(traj, prompt_len)
    rows = packing.default_rows(len(micro_batches[0]), fixed_shapes=True)
    return packing.pack_minibatch(traj, advantages, returns, micro_batches, lengths,
                                  prompt_len=prompt_len, rows=rows, num_chunks=2, fixed_shapes=True)


def test_padded_micro_steps_add_no_loss_no_gradient_no_stats(monkeypatch):
    # A rank with fewer micro-steps than another runs extra ones so that both make as many FSDP
    # passes; those must count for nothing, or this rank's loss is counted twice.
    from conftest import tiny_classifier, tiny_policy

    policy, value = tiny_policy(0), tiny_classifier(1)
    micro_batches = [[0, 2], [1, 3]]
    steps = _packed_minibatch(policy, value, micro_batches)
    # 2 ranks, the other with 2 more micro-steps than this one (all_reduce MAX gives its count)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda t, op=None: t.fill_(len(steps) + 2))
    padded = distributed.pad_micro_steps(steps)
    monkeypatch.undo()
    assert len(padded) == len(steps) + 2
    assert all(a is b for a, b in zip(padded, steps))

    hp = dict(temperature=0.7, epsilon=0.2, value_clip_range=0.2, value_coeff=0.1,
              num_micro_batches=len(micro_batches))
    params = [p for m in (policy, value) for p in m.parameters()]

    def run(micro_steps):
        for p in params:
            p.grad = None
        total, stats = 0.0, []
        for step in micro_steps:
            loss, s, _ = packed_ppo_loss_step(policy, value, *step, **hp)
            loss.backward()
            total = total + loss.detach()
            stats.append(s)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        return total, packing.micro_batch_stats(stats), grads

    real_loss, real_stats, real_grads = run(steps)
    assert real_loss != 0 and any(g.abs().sum() > 0 for g in real_grads)  # not vacuous
    for filler in padded[len(steps):]:
        loss, stats, grads = run([filler])
        assert loss.item() == 0.0
        for s in stats:
            assert all(x.item() == 0.0 for x in s), s
        assert all(g.abs().sum() == 0 for g in grads)
    # the rank's minibatch with its padding: exactly its own loss, stats and gradients
    loss, stats, grads = run(padded)
    torch.testing.assert_close(loss, real_loss, rtol=0, atol=0)
    for a, b in zip(stats, real_stats):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=0, atol=0)
    for a, b in zip(grads, real_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mine,other,agreed", [(None, 15, 15), (2, 0, 2), (None, 0, None)],
                         ids=["other rank signalled", "this rank signalled", "none"])
def test_ranks_agree_on_a_stop_signal(monkeypatch, mine, other, agreed):
    from torchtune_ppo.run.interrupt import StopRequest

    def all_reduce_max(t, op=None):  # the other rank's signum (0: none), MAX-reduced
        t.copy_(torch.maximum(t, torch.tensor(other)))

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce_max)
    stop = StopRequest()
    stop.signum = mine
    distributed.agree_on_stop(stop)
    assert stop.signum == agreed and bool(stop) == (agreed is not None)


pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The 1-process run: its output folder and logged rows."""
    out = tmp_path_factory.mktemp("one") / "run"
    return out, _run(out, 1)


def _assert_rows_match(one, two):
    for a, b in zip(one, two):
        # The same prompts and greedy responses: the rollout differs only in summation order.
        for key in ("scores", "kl", "kl_reward", "rlhf_reward", "response_lengths", "num_stop_tokens"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a[key], b[key])
        # The loss stats are sums of per-rank shares and the weights went through 2 processes'
        # reductions: float32 rounding in another order (measured: 1e-7 relative), grown by the
        # updates in between. A wrong normalisation (a factor of 2) or whitening per rank would
        # be off by far more.
        for key in ("loss", "policy_loss", "value_loss", "ratios", "clipfrac", "approx_policy_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])
        assert b["skipped_updates"] == a["skipped_updates"] == 0
        assert b["recompiles"] == 0


def test_two_processes_match_one(one_process, tmp_path):
    one_dir, one = one_process
    two = _run(tmp_path / "two", 2)
    assert len(one) == len(two) == 3
    _assert_rows_match(one, two)

    # Checkpoints written once by rank 0, loadable by torchtune's HF checkpointer. After 6
    # Adam updates at lr 3e-4 (measured: 1e-5 apart); each update moves a weight by up to the
    # lr, so per-rank normalisation errors would show as differences of that order.
    assert sorted(p.name for p in (tmp_path / "two/checkpoints").iterdir()) == ["step_2", "step_3"]
    a, b = _policy(one_dir, tmp_path), _policy(tmp_path / "two", tmp_path)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(pb, pa, atol=1e-4, rtol=0, msg=name)

    # The 2-process step_2 resumed on 1 process: the optimizer state is saved keyed by parameter
    # name with full tensors, so step 3 repeats the uninterrupted 1-process run's.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints/step_3")
    (resumed / "logs").rename(tmp_path / "two_logs")
    rows = _run(resumed, 1, "resume_from_checkpoint=True")
    assert len(rows) == 1
    for key in ("scores", "kl", "loss", "policy_loss", "value_loss", "ratios"):
        assert rows[0][key] == pytest.approx(one[2][key], rel=1e-3, abs=1e-5), (key, one[2], rows[0])


def test_compiled_run_with_sharded_frozen_models_matches_one_eager_process(one_process, tmp_path):
    # compile=True on 2 processes: generation (prefill and decode step, fullgraph, on the whole
    # policy gathered once per step with FSDP2's hooks set aside), scoring (one graph over the
    # gathered value, reference and reward models) and the loss step (graph breaks at FSDP2's
    # hooks). The frozen models are sharded too. Nothing recompiles after step 1, and the numbers
    # are the 1-process eager run's with its whole frozen models. Compiling costs 1-3 minutes
    # with a cold inductor cache on 2 CPU cores, hence the longer timeout.
    _, one = one_process
    out = _launch(tmp_path / "two", 2, "compile=True", "shard_frozen_models=True", "num_ppo_steps=2",
                  "save_every_n_steps=null", timeout=480)
    assert "CompileConfig(generate=True, trajectory=True, loss_step=True, rollout=False" in out
    two = read_disk_log(tmp_path / "two/logs")
    assert len(two) == 2
    _assert_rows_match(one[:2], two)


def test_sampled_run_with_accumulation_keeps_ranks_in_step(tmp_path):
    # Sampling and shorter minibatches: each rank packs its own rows into as many micro-steps as
    # their lengths need; the ranks must still run the same number of FSDP passes (a mismatch
    # hangs until the timeout). The frozen models are sharded here: their eager scoring
    # forwards gather layer by layer, as the value model's do.
    rows = _run(tmp_path / "two", 2, "top_k=null", "batch_size=16", "forward_batch_size=8",
                "ppo_batch_size=8", "gradient_accumulation_steps=2", "max_generated_tokens=12",
                "num_ppo_steps=2", "save_every_n_steps=null", "shard_frozen_models=True")
    assert len(rows) == 2
    for row in rows:
        for key in ("loss", "policy_loss", "value_loss", "kl", "scores", "ratios"):
            assert math.isfinite(row[key]), (key, row)
        assert row["skipped_updates"] == 0


def test_seq_mean_aggregation_two_processes_match_one(tmp_path):
    """The seq-mean weights divide by the global minibatch's sequences (all-reduced): 2 processes
    log what 1 does."""
    options = ("loss.aggregation=seq-mean-token-mean", "loss.dual_clip=1.5", "loss.epsilon_high=0.28")
    one = _run(tmp_path / "one", 1, *options)
    two = _run(tmp_path / "two", 2, *options)
    assert len(one) == len(two) == 3
    _assert_rows_match(one, two)
    for a, b in zip(one, two):
        for key in ("clipfrac_low", "clipfrac_high", "dualclip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])


def test_algorithm_options_two_processes_match_one(tmp_path):
    """Entropy bonus, KL loss term, critic warm-up (the policy's sharded gradients dropped) and
    length-adaptive GAE on 2 processes log what 1 does: entropy and KL are per-rank shares
    summed, explained variance and the mean actor lambda are reduced over ranks."""
    options = ("loss.entropy_coeff=0.01", "loss.kl_coeff=0.1", "loss.kl_estimator=k3+", "critic_warmup_steps=1",
               "lmbda_length_alpha=0.2")
    one = _run(tmp_path / "one", 1, *options)
    two = _run(tmp_path / "two", 2, *options)
    assert len(one) == len(two) == 3
    _assert_rows_match(one, two)
    for a, b in zip(one, two):
        for key in ("entropy", "kl_loss", "explained_variance", "lmbda_actor"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (key, a[key], b[key])
    assert abs(one[1]["kl"]) < 1e-5  # step 1 left the policy as it was
    assert 0 < one[0]["lmbda_actor"] < 1

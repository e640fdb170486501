"""The memory plan: exact sizes for parameters, gradients, optimizer state and KV cache."""

from pathlib import Path

from omegaconf import OmegaConf

import torchtune_ppo  # noqa: F401  registers the config resolvers
from torchtune_ppo.run import memory
from torchtune_ppo.config import validate_config
from torchtune_ppo.tasks.tiny_sentiment import tiny_policy, tiny_reward

CONFIG = Path(__file__).parents[2] / "recipes/configs/tiny/ppo_tiny_sentiment.yaml"


def _cfg(*overrides):
    return validate_config(OmegaConf.merge(OmegaConf.load(CONFIG), OmegaConf.from_dotlist(list(overrides))))


def test_plan_of_the_tiny_config_is_exact_where_it_can_be():
    plan = memory.memory_plan(_cfg())
    n_policy = sum(p.numel() for p in tiny_policy().parameters())
    n_value = sum(p.numel() for p in tiny_reward().parameters())
    rows = list(plan.rows.values())
    assert rows[0] == 2 * n_policy * 4 and rows[1] == 2 * n_value * 4  # fp32, two copies each
    assert rows[2] == (n_policy + n_value) * 4 and rows[3] == 2 * (n_policy + n_value) * 4
    attn = tiny_policy().layers[0].attn
    layers = len(tiny_policy().layers)
    assert rows[4] == 2 * 16 * 36 * attn.num_kv_heads * attn.head_dim * 4 * layers  # K and V
    assert plan.total == sum(rows)


def test_optimizer_in_bwd_holds_one_gradient_and_bf16_halves():
    base, bwd = memory.memory_plan(_cfg()), memory.memory_plan(
        _cfg("optimizer_in_bwd=True", "clip_grad_norm=null", "gradient_accumulation_steps=1")
    )
    assert list(bwd.rows.values())[2] < list(base.rows.values())[2] / 10
    half = memory.memory_plan(_cfg("dtype=bf16", "master_weights=False"))
    assert list(half.rows.values())[0] == list(base.rows.values())[0] / 2
    assert list(half.rows.values())[3] == list(base.rows.values())[3] / 2  # bf16 optimizer state


def test_bf16_master_weights_keep_fp32_copies_and_fp32_optimizer_state():
    base = memory.memory_plan(_cfg())
    plain = memory.memory_plan(_cfg("dtype=bf16", "master_weights=False"))
    masters = memory.memory_plan(_cfg("dtype=bf16"))
    trained = sum(p.numel() for p in tiny_policy().parameters()) + sum(p.numel() for p in tiny_reward().parameters())
    rows = dict(masters.rows)
    assert rows["fp32 master weights (of the 0.00B trained)"] == trained * 4
    assert list(rows.values())[3] == list(base.rows.values())[3]  # the fp32 optimizer state of an fp32 run
    assert masters.total == plain.total + trained * 4 + trained * 2 * 2


def test_bf16_masters_on_several_processes_are_the_fp32_shards():
    """On W processes the trained models are kept in fp32 (1/W each: their shards are the
    masters), their gradients fp32, the frozen copies bf16; no separate master row. Per trained
    parameter that is the one-process masters' 4 + 2 + 8 bytes for weights, masters and state
    (plus 2 of bf16 gradients) over W, as fp32 weights, fp32 gradients and state: 4 + 4 + 8."""
    from torchtune_ppo.config import check_world_size

    cfg = _cfg("dtype=bf16")
    check_world_size(cfg, 2)
    plan = memory.memory_plan(cfg, world_size=2)
    n_policy = sum(p.numel() for p in tiny_policy().parameters())
    n_value = sum(p.numel() for p in tiny_reward().parameters())
    rows = list(plan.rows.values())
    assert rows[0] == n_policy * (4 / 2 + 2) and rows[1] == n_value * (4 / 2 + 2)  # fp32 half, bf16 frozen copy
    assert rows[2] == (n_policy + n_value) * 4 / 2  # fp32 gradients, sharded
    assert rows[3] == (n_policy + n_value) * 2 * 4 / 2  # fp32 AdamW state, sharded
    assert not any("master" in name for name in plan.rows)


def test_a_plan_that_cannot_fit_is_refused(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024.0)
    plan = memory.memory_plan(_cfg())
    assert not plan.fits and not plan.fits_estimate and "available" in plan.table()
    # activations are an estimate: above the free memory only through them is a warning
    monkeypatch.setattr(memory, "available_bytes", lambda device: plan.exact + 1)
    plan = memory.memory_plan(_cfg())
    assert plan.fits and not plan.fits_estimate


def test_planning_a_gpu_config_on_this_machine(capsys):
    # device=cuda and missing checkpoint files are fine when only planning
    assert memory.main(["--config", str(CONFIG), "device=cuda", "checkpointer.checkpoint_dir=/nonexistent"]) in (0, 1)
    out = capsys.readouterr().out
    assert "Memory plan on cuda" in out and "KV cache (16 rows x 36 tokens)" in out


def test_entropy_bonus_doubles_the_logits_kept_for_backward():
    from torchtune_ppo.rlhf.packing import default_rows

    cfg = _cfg()
    base, bonus = (list(memory.memory_plan(c).rows.values())[5] for c in (cfg, _cfg("loss.entropy_coeff=0.01")))
    micro = cfg.ppo_batch_size // cfg.gradient_accumulation_steps
    logits = default_rows(micro) * cfg.max_generated_tokens * tiny_policy().tok_embeddings.num_embeddings * 4
    assert bonus - base == logits

"""Every reach into a private name of torch, FSDP2 or torchtune (``torchtune_ppo._patches``)
still finds what it touches: an upgrade that removes one fails here, not mid-run."""

import inspect
from pathlib import Path

import pytest
import torch
from torchtune.modules import MultiHeadAttention

from torchtune_ppo._patches import checkpointer, dynamo, fsdp, torchtune_modules


def test_every_patch_names_the_version_it_was_written_for():
    for module in (checkpointer, dynamo, fsdp, torchtune_modules):
        assert module.TESTED_WITH.split()[0] in ("torch", "torchtune"), module.__name__


@pytest.mark.slow  # compiles
def test_dynamo_stance_and_graph_counter_are_readable():
    assert hasattr(torch._dynamo.eval_frame, "_stance")
    assert dynamo.current_stance() == "default"
    with torch.compiler.set_stance("force_eager"):
        assert dynamo.current_stance() == "force_eager"
    before = dynamo.unique_graphs()
    torch.compile(lambda x: x * 7 + 1, dynamic=False)(torch.ones(3))
    assert dynamo.unique_graphs() == before + 1


def test_fsdp_state_and_hook_dicts_exist():
    from torch.distributed.fsdp import FSDPModule

    assert callable(getattr(FSDPModule, "_get_fsdp_state", None))
    module = torch.nn.Linear(2, 2)
    assert isinstance(module._forward_pre_hooks, dict) and isinstance(module._forward_hooks, dict)


def test_torchtune_checkpointer_saves_along_its_weight_map():
    from torchtune.training import FullModelHFCheckpointer

    # save_checkpoint reads the map that load_checkpoint fills
    assert "_weight_map" in inspect.getsource(FullModelHFCheckpointer.save_checkpoint)
    assert "_weight_map" in inspect.getsource(FullModelHFCheckpointer.load_checkpoint)
    writer = type("Writer", (), {})()
    checkpointer.set_weight_map(writer, {"a": "0001"})
    assert writer._weight_map == {"a": "0001"}
    assert checkpointer.SHARD_FNAME and callable(checkpointer.safe_torch_load)


def test_torchtune_decoder_internals_exist():
    """final_hidden_states mirrors TransformerDecoder.forward up to the norm; the decode patch
    swaps each attention's _attention_call; output chunking is num_output_chunks."""
    from conftest import left_padded_prompts, tiny_policy
    from torchtune_ppo.rlhf import masks_and_positions

    model = tiny_policy(0).eval()
    attn = model.layers[0].attn
    assert isinstance(attn, MultiHeadAttention) and callable(attn._attention_call)
    assert hasattr(model, "num_output_chunks") and hasattr(model, "output")
    lens = torch.tensor([6, 2])
    tokens = left_padded_prompts(lens.tolist(), 6, seed=0)
    mask, pos = masks_and_positions(lens, 6, 0)
    with torch.no_grad():
        ours = model.output(torchtune_modules.final_hidden_states(model, tokens, mask=mask, input_pos=pos))
        theirs = model(tokens, mask=mask, input_pos=pos)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert isinstance(torchtune_modules.is_npu_available, bool)


def test_hf_checkpointer_settings_are_readable(tmp_path):
    """The settings FullModelHFCheckpointer keeps in private attributes, read for its subclass."""
    from torchtune.training import FullModelHFCheckpointer, ModelType

    from torchtune_ppo import asset_path

    folder = asset_path("tiny_sentiment/policy")
    ckpt = FullModelHFCheckpointer(checkpoint_dir=folder, checkpoint_files=["model.safetensors"],
                                   model_type="LLAMA2", output_dir=str(tmp_path))
    s = checkpointer.hf_checkpointer_settings(ckpt)
    assert s.checkpoint_paths == [Path(folder) / "model.safetensors"] and s.output_dir == tmp_path
    assert s.model_type == ModelType.LLAMA2 and s.config["num_attention_heads"] > 0
    assert s.safe_serialization is True and s.should_load_recipe_state is False
    assert checkpointer.weight_map(ckpt) == {}
    ckpt.load_checkpoint()
    assert set(checkpointer.weight_map(ckpt).values()) == {"0001"}

"""``compile.layers``: one transformer layer compiled per use, every layer of every model run
through it, the regions compiled around the layer stack (torchtune_ppo.compile.layer_steps).

Graphs are counted with a backend that records each graph it is handed and runs it as traced,
so the outputs are the eager ops' own and compare exactly.
"""

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ppo import compile as compiling
from torchtune_ppo._patches.torchtune_modules import LAYER_STEPS_ATTR, LayerSteps, final_hidden_states
from torchtune_ppo.config.batches import check_world_size
from torchtune_ppo.config.schema import CompileConfig, parse_compile

from conftest import VOCAB, tiny_classifier, tiny_policy

REGIONS = {"generate": True, "trajectory": True, "loss_step": True, "rollout": False}


def test_the_bare_bool_sets_layers_and_a_mapping_names_it():
    # compile=True is the fast path: every region, one layer compiled per use
    assert parse_compile(True).layers is True and parse_compile(False).layers is False
    assert parse_compile(REGIONS).layers is False
    assert parse_compile({**REGIONS, "layers": True}) == CompileConfig(True, True, True, optimizer=True, layers=True)


@pytest.mark.parametrize("block, pattern", [
    ({**REGIONS, "layers": "yes"}, r"compile\.layers"),
    ({**REGIONS, "generate": False, "trajectory": False, "rollout": True, "layers": True},
     r"compile\.layers=True .* compile\.rollout=True"),
    ({**REGIONS, "layers": True, "mode": "reduce-overhead"},
     r"compile\.mode='reduce-overhead' cannot capture them in CUDA graphs: set compile\.mode=default"),
])
def test_layers_refusals_name_the_keys(block, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_compile(block)


def test_several_processes_turn_layers_off_with_a_note(capsys):
    cfg = OmegaConf.create({
        "num_samples_per_prompt": 1, "batch_size": 4, "forward_batch_size": 4, "ppo_batch_size": 4,
        "gradient_accumulation_steps": 1, "optimizer_in_bwd": False, "dtype": "fp32", "master_weights": True,
        "share_group_prefill": False, "compile": {**REGIONS, "layers": True, "optimizer": True, "mode": "default"},
    })
    check_world_size(cfg, 1)
    assert cfg.compile.layers is True
    check_world_size(cfg, 2)
    assert cfg.compile.layers is False


def test_regions_hand_out_layer_steps_only_on_one_process():
    cfg = parse_compile({**REGIONS, "layers": True})
    assert isinstance(compiling.regions(cfg).layers, LayerSteps)
    assert compiling.regions(cfg, world_size=2).layers is None
    assert isinstance(compiling.regions(parse_compile(True)).layers, LayerSteps)
    assert compiling.regions(parse_compile(REGIONS)).layers is None


class Recorder:
    """A dynamo backend that keeps each graph it compiles and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _steps(recorders):
    fns = (compiling._layer_decode, compiling._layer_prefill, compiling._layer_infer, compiling._layer_train)
    return LayerSteps(*(torch.compile(fn, backend=recorders[name], fullgraph=True, dynamic=False)
                        for name, fn in zip(LayerSteps._fields, fns)))


@pytest.fixture
def recorders():
    torch._dynamo.reset()
    yield {name: Recorder() for name in LayerSteps._fields}
    torch._dynamo.reset()


def _packed(rows, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool)).expand(rows, length, length).clone()
    pos = torch.arange(length).expand(rows, length).clone()
    return tokens, mask, pos


def _hidden(model, tokens, mask, pos):
    return final_hidden_states(model, tokens, mask=mask, input_pos=pos)


def test_a_use_without_a_step_runs_as_written(recorders):
    """A region left eager has no step for its use (``layer_steps(trajectory=False)``): its
    layers run in eager as before, while the use that has one goes through the compiled layer."""
    model = tiny_policy()
    tokens, mask, pos = _packed(3, 8)
    with torch.no_grad():
        expected = _hidden(model, tokens, mask, pos)
    steps = _steps(recorders)._replace(infer=None)
    compiling.use_layers([model], steps)
    with torch.no_grad():
        assert torch.equal(_hidden(model, tokens, mask, pos), expected)
    assert all(not r.graphs for r in recorders.values())
    _hidden(model, tokens, mask, pos).sum().backward()  # the train use has a step
    assert len(recorders["train"].graphs) == 1
    compiling.use_layers([model], None)
    assert getattr(model, LAYER_STEPS_ATTR) is None


def test_layer_steps_follow_the_compiled_regions():
    steps = compiling.layer_steps(generate=False, trajectory=True, loss_step=False)
    assert steps.decode is None and steps.prefill is None and steps.train is None
    assert callable(steps.infer)


def test_one_layer_graph_serves_every_layer_of_every_model(recorders):
    """Scoring-like use (no grad) of a policy and a classifier of one family: the region's graph
    breaks at the layer stack, each layer runs through the one compiled layer, the result is the
    eager one exactly. The infer graph is traced once per kind of weights (the value model's
    weights require grad, the frozen reference's do not), never once per layer."""
    policy, value = tiny_policy(), tiny_classifier()
    for p in policy.parameters():
        p.requires_grad_(False)
    tokens, mask, pos = _packed(3, 8)
    with torch.no_grad():
        expected = [_hidden(m, tokens, mask, pos) for m in (policy, value)]
    compiling.use_layers([policy, value, None], _steps(recorders))
    region = torch.compile(_hidden, backend="eager", fullgraph=False, dynamic=False)
    with torch.no_grad():
        for _ in range(2):
            got = [region(m, tokens, mask, pos) for m in (policy, value)]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert len(policy.layers) == 2 and len(recorders["infer"].graphs) == 2  # frozen, trainable
    assert not recorders["train"].graphs and not recorders["decode"].graphs


def test_training_goes_through_the_train_layer_and_its_gradients_are_eagers(recorders):
    model = tiny_policy()
    tokens, mask, pos = _packed(2, 6)
    _hidden(model, tokens, mask, pos).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(expected) > 10  # the embedding, every layer's weights, the final norm
    model.zero_grad(set_to_none=True)
    compiling.use_layers([model], _steps(recorders))
    region = torch.compile(_hidden, backend="eager", fullgraph=False, dynamic=False)
    region(model, tokens, mask, pos).square().mean().backward()
    assert len(recorders["train"].graphs) == 1 and not recorders["infer"].graphs
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-7, msg=n)


def test_dynamic_rows_reach_the_layer_graph(recorders):
    """Packed regions mark their rows dynamic: the layer's graph is then symbolic in them too,
    and a new row count reuses it (one graph for 3 and 5 rows)."""
    model = tiny_policy()
    compiling.use_layers([model], _steps(recorders))
    region = torch.compile(_hidden, backend="eager", fullgraph=False, dynamic=False)
    with torch.no_grad():
        for rows in (3, 5):
            tokens, mask, pos = _packed(rows, 8, seed=rows)
            for t in (tokens, mask, pos):
                torch._dynamo.mark_dynamic(t, 0)
            assert torch.equal(region(model, tokens, mask, pos), _hidden(model, tokens, mask, pos))  # eager
    assert len(recorders["infer"].graphs) == 1

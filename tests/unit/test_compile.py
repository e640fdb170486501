import pytest
import torch

from torchtune_ppo.compile import BACKEND_ENV, RecompileCounter, compile_backend, maybe_compile


def test_maybe_compile_off_returns_the_eager_function():
    def f(x):
        return x + 1

    assert maybe_compile(f, enabled=False) is f


@pytest.mark.slow  # compiles
def test_recompile_counter_sees_a_recompile():
    def f(x):
        return x * 3

    g = maybe_compile(f, enabled=True)
    counter = RecompileCounter()
    g(torch.ones(3))
    counter.mark()
    g(torch.ones(3) * 2)  # same shape: reuses the graph
    assert counter.since_mark == 0
    g(torch.ones(5))  # new static shape: a recompile
    assert counter.since_mark == 1


def test_test_backend_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert compile_backend() is None
    for value in ("eager", "aot_eager"):
        monkeypatch.setenv(BACKEND_ENV, value)
        assert compile_backend() == value
    monkeypatch.setenv(BACKEND_ENV, "inductr")
    with pytest.raises(ValueError, match=r"TORCHTUNE_PPO_COMPILE_BACKEND='inductr' is not a test backend; "
                                         r"valid: \['eager', 'aot_eager'\]"):
        maybe_compile(lambda x: x, enabled=True)


def test_test_backend_counts_recompiles_as_inductor_does(monkeypatch):
    """Dynamo guards the same way whatever the backend: the eager backend sees the recompile too."""
    monkeypatch.setenv(BACKEND_ENV, "eager")

    def f(x):
        return x * 3

    g = maybe_compile(f, enabled=True)
    counter = RecompileCounter()
    assert torch.equal(g(torch.ones(3)), torch.full((3,), 3.0))
    counter.mark()
    g(torch.ones(3) * 2)
    assert counter.since_mark == 0
    g(torch.ones(5))
    assert counter.since_mark == 1


def _global_compile_config():
    """Dynamo and inductor settings, without entries whose copies never compare equal."""
    configs = {}
    for name, cfg in (("dynamo", torch._dynamo.config), ("inductor", torch._inductor.config)):
        first, second = cfg.get_config_copy(), cfg.get_config_copy()
        configs.update({f"{name}.{k}": v for k, v in first.items() if v == second[k]})
    return configs


@pytest.mark.slow  # compiles
def test_compiling_our_regions_leaves_global_dynamo_config_alone():
    """A user's own torch.compile calls after ours must see the defaults they expect."""
    from torchtune_ppo._patches.dynamo import skip_guard_checks

    before = _global_compile_config()

    def f(x, *, scale):
        return x * scale

    g = maybe_compile(f, enabled=True)
    g(torch.ones(3), scale=0.5)
    with skip_guard_checks(True):  # only for regions compiled already
        g(torch.ones(3), scale=0.5)
    after = _global_compile_config()
    assert len(before) > 100  # the settings are really read
    assert {k: v for k, v in after.items() if before.get(k) != v} == {}


@pytest.mark.slow  # compiles
def test_float_arguments_stay_constants_without_global_settings():
    # dynamic=False specializes Python floats: a new value is a new graph, never a symbol.
    def f(x, *, scale):
        return x * scale

    g = maybe_compile(f, enabled=True)
    torch.testing.assert_close(g(torch.ones(2), scale=0.5), torch.full((2,), 0.5))
    counter = RecompileCounter()
    counter.mark()
    torch.testing.assert_close(g(torch.ones(2), scale=2.0), torch.full((2,), 2.0))
    assert counter.since_mark == 1

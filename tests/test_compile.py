import torch

from torchtune_ppo._compile import RecompileCounter, maybe_compile


def test_maybe_compile_off_returns_the_eager_function():
    def f(x):
        return x + 1

    assert maybe_compile(f, enabled=False) is f


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

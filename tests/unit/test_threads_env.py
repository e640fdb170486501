"""``OMP_NUM_THREADS`` set to something that is not a thread count is refused by name, with its
value and what is valid, instead of reaching ``torch.set_num_threads(0)`` (an error that names
no variable) or being ignored without a word."""

import pytest

from torchtune_ppo.config import cpu_threads


@pytest.mark.parametrize("value", ["0", "-1", "abc", "", " ", "2.5", "4,0", "٣"])
@pytest.mark.parametrize("setting", ["auto", 1])
def test_omp_num_threads_that_is_not_a_positive_integer_is_named(monkeypatch, value, setting):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ValueError) as error:
        cpu_threads(setting)
    message = str(error.value)
    assert message.startswith(f"OMP_NUM_THREADS={value!r} is not a positive integer")
    assert "OMP_NUM_THREADS=1" in message and "unset it" in message


@pytest.mark.parametrize("value,threads", [("3", 3), (" 3 ", 3), ("+3", 3), ("3,2", 3)])
def test_omp_num_threads_as_openmp_reads_it_sets_auto(monkeypatch, value, threads):
    """OpenMP takes surrounding spaces, a sign and a list for nested levels (the first counts)."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert cpu_threads("auto") == threads
    assert cpu_threads(1) == 1  # a number in the config wins over the environment



def test_the_preflight_checks_it_on_every_device(monkeypatch, tmp_path):
    """A GPU run never calls ``cpu_threads``, yet its CPU work is threaded by OpenMP too."""
    from omegaconf import OmegaConf

    from torchtune_ppo.config import validate_config
    from torchtune_ppo.run.preflight import preflight

    from conftest import TINY_CONFIG

    cfg = validate_config(OmegaConf.merge(OmegaConf.load(TINY_CONFIG), {"output_dir": str(tmp_path / "run")}))
    monkeypatch.setenv("OMP_NUM_THREADS", "0")
    with pytest.raises(ValueError, match=r"^OMP_NUM_THREADS='0' is not a positive integer"):
        preflight(cfg, world_size=1, log=None)
    assert not (tmp_path / "run").exists()  # before anything touches the output folder

"""``tune-ppo export <checkpoint> <dest>``: the Hugging Face folders of a checkpoint's trained
models, from either checkpoint format, so that the end of a run is a model to load elsewhere.

``dest/policy`` and ``dest/value`` (absent for a critic-free run) are written by torchtune's HF
writer, the one every full-format save uses (:meth:`.store.CheckpointManager._write_hf`), from
the run's own checkpointer blocks (the step's ``config.yaml``): the same ``model_type``
conversion, ``config.json`` and shard layout as the model the run started from, whose folder
must still be there. A LoRA model is written with its adapters merged into the weights, or with
``adapter=True`` as its adapters in PEFT's layout (and a value model's head).
"""

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.modules.peft import get_merged_lora_ckpt

import torchtune_ppo.checkpointing.sharded as sharded
from torchtune_ppo.checkpointing.store import (CONFIG_FNAME, MODEL_NAMES, CheckpointManager, _read_marker,
                                               _require_complete, latest_checkpoint, load_adapters)

_MODEL_KEYS = {"policy": ("policy_model", "checkpointer"), "value": ("reward_and_value_model", "value_checkpointer")}


def export_checkpoint(checkpoint: Union[str, Path], dest: Union[str, Path], *, adapter: bool = False) -> Dict[str, Path]:
    """Writes ``dest/<model>`` in Hugging Face format for each trained model of ``checkpoint``.

    Args:
        checkpoint (Union[str, Path]): a complete ``step_<N>`` folder, or a run's ``output_dir``
            (its newest complete checkpoint).
        dest (Union[str, Path]): a folder that does not exist or is empty.
        adapter (bool): a LoRA model as its adapters (PEFT layout) instead of merged weights.

    Returns:
        Dict[str, Path]: the folder written for each model.

    Raises:
        FileNotFoundError: no complete checkpoint there, or the run's starting model folder is gone.
        FileExistsError: ``dest`` holds files.
        ValueError: ``adapter`` for a model without LoRA layers.
    """
    step = _step_folder(Path(checkpoint))
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"export: {dest} already holds files; give an empty or new folder.")
    if not (step / CONFIG_FNAME).is_file():
        raise FileNotFoundError(f"export: {step} holds no {CONFIG_FNAME}, which names the run's checkpointers "
                                "and models; export a checkpoint the recipe saved.")
    run_cfg = OmegaConf.load(step / CONFIG_FNAME)
    marker = _read_marker(step)
    is_sharded = marker.get("format") == "sharded"
    names = [n for n in MODEL_NAMES if (step / n).is_dir() or (is_sharded and _has_model(step, n))]
    manager = CheckpointManager(dest, run_cfg[_MODEL_KEYS["policy"][1]],
                                run_cfg[_MODEL_KEYS["value"][1]] if "value" in names else None)
    tmp = dest.parent / f".tmp_export_{dest.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in names:
            weights, adapters = _weights(step, name, run_cfg, is_sharded, marker, adapter)
            if weights is None and adapters is None:  # a full-format folder already in HF format
                shutil.copytree(step / name, tmp / name)
            else:
                manager._write_hf(name, weights, int(marker["step"]), tmp, adapters)
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            os.rename(tmp / name, dest / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {name: dest / name for name in names}


def _step_folder(path: Path) -> Path:
    if (path / "COMPLETE").is_file() or path.name.startswith("step_"):
        return _require_complete(path)
    latest = latest_checkpoint(path, verify=True)
    if latest is None:
        raise FileNotFoundError(f"export: {path} is neither a complete checkpoint (checkpoints/step_<N> with a "
                                "COMPLETE marker) nor a run's output_dir holding one.")
    return latest


def _has_model(step: Path, name: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step / sharded.SHARDS_DIRNAME)).read_metadata().state_dict_metadata
    return any(k.startswith(f"model.{name}.") for k in meta)


def _lora(run_cfg: DictConfig, name: str) -> Optional[Tuple[int, float, Any]]:
    """(rank, alpha, model) of a LoRA model's builder (built on the meta device: no memory), or None."""
    from torchtune_ppo import lora

    with torch.device("meta"):
        model = config.instantiate(run_cfg[_MODEL_KEYS[name][0]])
    if not lora.has_adapters(model):
        return None
    settings = lora.lora_settings(model)
    return settings.rank, settings.alpha, model


def _weights(step: Path, name: str, run_cfg: DictConfig, is_sharded: bool, marker: Mapping[str, Any],
             adapter: bool):
    """(weights, adapters) to write for ``name``; (None, None): copy the saved HF folder as it is."""
    from torchtune_ppo import lora

    lora_info = _lora(run_cfg, name)
    if adapter and lora_info is None:
        raise ValueError(f"export --adapter: the {name} model has no LoRA layers; export its merged weights.")
    if not is_sharded:
        has_weights = bool((marker.get("checkpoint_files") or {}).get(name))
        if (lora_info is None or has_weights) and not adapter:
            return None, None  # full weights (merged at the run's end for LoRA) already in HF format
        if adapter:
            return None, None  # the adapters in PEFT layout, as saved
        state = load_adapters(step, name)  # adapters and head, merged into the starting weights
        state = {**_base(run_cfg, name), **state}
    else:
        state = sharded.read_full(step, f"model.{name}.")
    if lora_info is None:
        return state, None
    rank, alpha, model = lora_info
    if adapter:
        names = set(lora.get_adapter_params(model))
        heads = {k: v for k, v in state.items() if k in set(lora.head_names(model))}
        return None, ({k: v for k, v in state.items() if k in names}, lora.peft_adapter_config(model), heads)
    return get_merged_lora_ckpt(dict(state), rank=rank, alpha=alpha), None


def _base(run_cfg: DictConfig, name: str) -> Dict[str, torch.Tensor]:
    """The weights the run started ``name`` from, through its checkpointer, in torchtune's names."""
    from torchtune import training

    checkpointer = config.instantiate(run_cfg[_MODEL_KEYS[name][1]])
    return checkpointer.load_checkpoint()[training.MODEL_KEY]

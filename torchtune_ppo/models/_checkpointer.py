"""Hugging Face ``*ForSequenceClassification`` checkpoints through torchtune's HF checkpointer.

torchtune 0.6.1 reads reward models only with ``model_type: REWARD``, whose conversion is
Llama-style (q/k permuted for interleaved RoPE, ``score.weight`` -> ``output.weight``). A
Qwen2 classifier needs Qwen2's conversion (qkv biases, no permutation), which knows no
``score.weight`` and fails on it. :class:`ClassifierHFCheckpointer` takes the family's
``model_type`` instead, maps the head itself and hands everything else to torchtune's
conversion of that family, both ways.

It also starts a value model from a policy checkpoint, for when no reward model of the
policy's family exists: see ``value_head_init`` and :func:`value_head_from_policy`.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from safetensors.torch import save_file
from torchtune import training
from torchtune.models import convert_weights
from torchtune.models.qwen2 import qwen2_hf_to_tune, qwen2_tune_to_hf
from torchtune.training import FullModelHFCheckpointer, ModelType

# The file names and helpers FullModelHFCheckpointer itself uses, so that what we write is laid
# out exactly as its checkpoints are.
from torchtune_ppo._patches.checkpointer import (
    RECIPE_STATE_DIRNAME,
    SAFETENSOR_INDEX_FNAME,
    SHARD_FNAME,
    SUFFIXES_TO_NOT_COPY,
    TORCH_INDEX_FNAME,
    copy_files,
    hf_checkpointer_settings,
    safe_torch_load,
    set_weight_map,
    weight_map,
)
from torchtune.utils import get_logger

__all__ = ["CLASSIFIER_MODEL_TYPES", "ClassifierHFCheckpointer", "VALUE_HEAD_INITS", "value_head_from_policy"]

log = get_logger("INFO")

# Families whose torchtune conversion is reused for everything but the head. Mistral and the
# Llamas share `convert_weights.hf_to_tune` (q/k permuted); Qwen2 / Qwen2.5 have their own.
CLASSIFIER_MODEL_TYPES = ("LLAMA2", "LLAMA3", "LLAMA3_2", "MISTRAL", "QWEN2")
VALUE_HEAD_INITS = ("zeros", "normal")

_SCORE = "score.weight"  # HF *ForSequenceClassification head, [num_labels, hidden_size]
_SCORE_BIAS = "score.bias"  # HF's heads have none; some training pipelines write one
_LM_HEAD = "lm_head.weight"  # a policy's untied LM head: not part of a classifier
_OUTPUT = "output.weight"  # torchtune's name for the head


def value_head_from_policy(
    policy_state_dict: Mapping[str, torch.Tensor],
    *,
    init: str = "zeros",
    num_classes: int = 1,
) -> Dict[str, torch.Tensor]:
    """A classifier state dict from a policy's: every weight but the LM head, and a fresh head.

    The head is ``[num_classes, embed_dim]`` in the dtype and on the device of the token
    embeddings. ``"zeros"`` (the default) makes every initial value exactly 0: the first
    advantages are then the KL-penalised rewards themselves, with no noise from a random head,
    and the value loss starts from a known point. A zero head still learns (its gradient is
    ``(value - return) * hidden``); only the backbone's gradient through it is zero until the
    head has moved, and with one output there is no symmetry between units to break.
    ``"normal"`` draws ``N(0, 1 / (embed_dim + 1))`` (std, as OpenRLHF does) from torch's
    global generator, for small non-zero initial values.

    Args:
        policy_state_dict (Mapping[str, torch.Tensor]): the policy in torchtune's format, e.g.
            from ``FullModelHFCheckpointer(model_type=LLAMA3_2).load_checkpoint()["model"]``.
            ``output.weight`` (an untied LM head) is dropped; a tied policy has none.
        init (str): ``"zeros"`` or ``"normal"``.
        num_classes (int): width of the head. Default: 1 (a value model)

    Returns:
        Dict[str, torch.Tensor]: the state dict of a classifier built with the policy's dims,
        e.g. :func:`torchtune_ppo.models.llama3_2_1b_classifier` for Llama-3.2-1B.

    Raises:
        ValueError: on an unknown ``init``, or a state dict without ``tok_embeddings.weight``.
    """
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"init must be one of {list(VALUE_HEAD_INITS)}, got {init!r}.")
    embeddings = policy_state_dict.get("tok_embeddings.weight")
    if embeddings is None:
        raise ValueError(
            "policy_state_dict has no 'tok_embeddings.weight'; pass a torchtune-format "
            "decoder state dict (as a torchtune checkpointer's load_checkpoint returns it)."
        )
    embed_dim = embeddings.shape[1]
    head = torch.zeros(num_classes, embed_dim, dtype=torch.float32, device=embeddings.device)
    if init == "normal":
        head.normal_(mean=0.0, std=1.0 / (embed_dim + 1))
    state_dict = {k: v for k, v in policy_state_dict.items() if k != _OUTPUT}
    state_dict[_OUTPUT] = head.to(embeddings.dtype)
    return state_dict


class ClassifierHFCheckpointer(FullModelHFCheckpointer):
    """Reads and writes Hugging Face ``*ForSequenceClassification`` checkpoints (``score.weight``).

    A drop-in for ``torchtune.training.FullModelHFCheckpointer`` as ``_component_`` of a
    reward or value checkpointer::

        reward_checkpointer:
          _component_: torchtune_ppo.models.ClassifierHFCheckpointer
          checkpoint_dir: /tmp/Qwen2.5-0.5B-reward
          checkpoint_files: [model.safetensors]
          model_type: QWEN2

    Loading maps ``score.weight`` to ``output.weight`` and converts every other key with
    torchtune's conversion for ``model_type``; saving does the reverse, writes the shards and
    index as torchtune's checkpointer does (same file names), copies the other files of
    ``checkpoint_dir`` (tokenizer, ...) and writes a ``config.json`` that transformers loads as
    the family's ``*ForSequenceClassification`` with ``num_labels`` = the head's width. The
    config's ``pad_token_id`` is kept from the source; transformers needs one to score a batch
    of more than one row.

    Args:
        checkpoint_dir (str): folder with ``config.json`` and the checkpoint files.
        checkpoint_files (Union[List[str], Dict[str, str]]): as for ``FullModelHFCheckpointer``.
        model_type (str): the backbone's family: one of ``CLASSIFIER_MODEL_TYPES`` (``LLAMA2``,
            ``LLAMA3``, ``LLAMA3_2``, ``MISTRAL``, ``QWEN2``; Qwen2.5 is ``QWEN2``).
        output_dir (str): where ``save_checkpoint`` writes ``epoch_<N>/``.
        value_head_init (Optional[str]): what to do when the checkpoint has no
            ``score.weight``, i.e. it is a policy (``*ForCausalLM``) checkpoint. ``None`` (the
            default) raises; ``"zeros"`` or ``"normal"`` drop the LM head and start a fresh head
            (see :func:`value_head_from_policy`). A checkpoint that has a head always loads it,
            so resuming from a saved value model keeps the trained head.
        recipe_checkpoint (Optional[str]): as for ``FullModelHFCheckpointer``.
        safe_serialization (bool): write ``.safetensors`` (default) rather than ``.bin``.
        should_load_recipe_state (bool): as for ``FullModelHFCheckpointer``.

    Raises:
        ValueError: on a ``model_type`` or ``value_head_init`` not listed above.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        checkpoint_files: Union[List[str], Dict[str, str]],
        model_type: str,
        output_dir: str,
        value_head_init: Optional[str] = None,
        recipe_checkpoint: Optional[str] = None,
        safe_serialization: bool = True,
        should_load_recipe_state: bool = False,
    ) -> None:
        if model_type not in CLASSIFIER_MODEL_TYPES:
            raise ValueError(
                f"ClassifierHFCheckpointer: model_type must be the backbone's family, one of "
                f"{list(CLASSIFIER_MODEL_TYPES)} (Qwen2.5 is QWEN2), got {model_type!r}."
            )
        if value_head_init is not None and value_head_init not in VALUE_HEAD_INITS:
            raise ValueError(
                f"ClassifierHFCheckpointer: value_head_init must be null or one of "
                f"{list(VALUE_HEAD_INITS)}, got {value_head_init!r}."
            )
        super().__init__(
            checkpoint_dir=checkpoint_dir,
            checkpoint_files=checkpoint_files,
            model_type=model_type,
            output_dir=output_dir,
            recipe_checkpoint=recipe_checkpoint,
            safe_serialization=safe_serialization,
            should_load_recipe_state=should_load_recipe_state,
        )
        self.value_head_init = value_head_init
        self.settings = hf_checkpointer_settings(self)

    def load_checkpoint(self) -> Dict[str, Any]:
        """Read every checkpoint file and convert it to torchtune's format.

        Returns:
            Dict[str, Any]: ``{"model": state_dict}`` (plus the recipe state when
            ``should_load_recipe_state``), the head under ``output.weight``.

        Raises:
            ValueError: the checkpoint has no ``score.weight`` and ``value_head_init`` is null,
                or it has a non-zero ``score.bias`` (the classifier's head has no bias).
        """
        shard_of: Dict[str, str] = {}
        merged: Dict[str, torch.Tensor] = {}
        # Sorted by torchtune's checkpointer, so shard ids follow the file names.
        for idx, path in enumerate(self.settings.checkpoint_paths):
            shard = safe_torch_load(path)
            shard_of.update({key: f"{idx + 1:04}" for key in shard})
            merged.update(shard)
        set_weight_map(self, shard_of)
        head = merged.pop(_SCORE, None)
        bias = merged.pop(_SCORE_BIAS, None)
        if bias is not None and bool(bias.count_nonzero()):
            raise ValueError(
                f"{self.settings.checkpoint_dir}: the checkpoint's score.bias is non-zero, but the "
                "classifier's head has no bias (as in transformers' *ForSequenceClassification); "
                "dropping it would change every score."
            )
        merged.pop(_LM_HEAD, None)
        state_dict = self._hf_to_tune(merged)
        if head is not None:
            state_dict[_OUTPUT] = head
        elif self.value_head_init is None:
            raise ValueError(
                f"{self.settings.checkpoint_dir} holds no {_SCORE!r}: it is not a *ForSequenceClassification "
                "checkpoint. To start a value model from a policy checkpoint, set "
                f"value_head_init to one of {list(VALUE_HEAD_INITS)}."
            )
        else:
            log.info(f"{self.settings.checkpoint_dir} has no {_SCORE}: a value head is initialised "
                     f"({self.value_head_init}) and the LM head is left out.")
            state_dict = value_head_from_policy(state_dict, init=self.value_head_init)
        out: Dict[str, Any] = {training.MODEL_KEY: state_dict}
        if self.settings.should_load_recipe_state:
            out.update(safe_torch_load(self.settings.recipe_checkpoint, mmap=False))
        return out

    def save_checkpoint(
        self,
        state_dict: Dict[str, Any],
        epoch: int,
        intermediate_checkpoint: bool = False,
        adapter_only: bool = False,
    ) -> None:
        """Write ``<output_dir>/epoch_<epoch>/`` in the layout of an HF classifier checkpoint.

        Args:
            state_dict (Dict[str, Any]): ``{"model": torchtune state dict, ...}``; with
                ``intermediate_checkpoint`` the other entries go to ``recipe_state.pt``.
            epoch (int): names the folder.
            intermediate_checkpoint (bool): also save the recipe state, as torchtune does.
            adapter_only (bool): write only the LoRA adapters of ``state_dict["adapter"]`` (as
                torchtune's HF checkpointer does: ``adapter_model.pt`` in torchtune's names,
                ``adapter_model.safetensors`` and ``adapter_config.json`` in PEFT's layout).

        Raises:
            ValueError: ``adapter_only`` without adapter weights in ``state_dict``.
        """
        if adapter_only and training.ADAPTER_KEY not in state_dict:
            raise ValueError("adapter_only=True but state_dict holds no adapter weights.")
        out_dir = Path(self.settings.output_dir) / f"epoch_{epoch}"
        out_dir.mkdir(parents=True, exist_ok=True)
        head = None
        if not adapter_only:
            model_state = dict(state_dict[training.MODEL_KEY])
            head = model_state.pop(_OUTPUT)
            hf_state = self._tune_to_hf(model_state)
            hf_state[_SCORE] = head
            self._write_shards(hf_state, out_dir)
        if training.ADAPTER_KEY in state_dict:
            self._write_adapters(state_dict[training.ADAPTER_KEY], state_dict.get(training.ADAPTER_CONFIG), out_dir)
        copy_files(self.settings.checkpoint_dir, out_dir, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
        # After copy_files, which leaves existing files alone: the source's config.json may be a
        # *ForCausalLM one (a value model started from a policy).
        num_labels = head.shape[0] if head is not None else self.settings.config.get("num_labels", 1)
        config = _classifier_config(self.settings.config, num_labels=num_labels)
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
        if intermediate_checkpoint:
            rest = {k: v for k, v in state_dict.items() if k != training.MODEL_KEY}
            path = Path(self.settings.output_dir) / RECIPE_STATE_DIRNAME / "recipe_state.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rest, path)

    def _write_adapters(self, adapters: Mapping[str, torch.Tensor], adapter_config: Optional[Mapping[str, Any]],
                        out_dir: Path) -> None:
        """The adapters as torchtune's ``FullModelHFCheckpointer`` writes them: torchtune's names
        in ``adapter_model.pt``, PEFT's in ``adapter_model.safetensors`` and ``adapter_config.json``
        (a ``*ForSequenceClassification`` names its layers as the causal LM does)."""
        torch.save(dict(adapters), out_dir / "adapter_model.pt")
        c = self.settings.config
        peft = convert_weights.tune_to_peft_adapter_weights(
            dict(adapters), num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
            dim=c["hidden_size"], head_dim=c.get("head_dim"))
        save_file({k: v.contiguous() for k, v in peft.items()}, str(out_dir / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        if adapter_config is not None:
            config = convert_weights.tune_to_peft_adapter_config(dict(adapter_config))
            (out_dir / "adapter_config.json").write_text(json.dumps(config))

    def _conversion_args(self) -> Dict[str, Any]:
        c = self.settings.config
        return dict(
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            dim=c["hidden_size"],
            head_dim=c.get("head_dim"),
        )

    def _hf_to_tune(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if self.settings.model_type == ModelType.QWEN2:
            return qwen2_hf_to_tune(state_dict, **self._conversion_args())
        return convert_weights.hf_to_tune(state_dict, **self._conversion_args())

    def _tune_to_hf(self, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if self.settings.model_type == ModelType.QWEN2:
            return qwen2_tune_to_hf(state_dict, **self._conversion_args())
        return convert_weights.tune_to_hf(state_dict, **self._conversion_args())

    def _write_shards(self, hf_state: Dict[str, torch.Tensor], out_dir: Path) -> None:
        """Split ``hf_state`` as the source checkpoint was split; write the shards and index."""
        shard_of = weight_map(self)
        # A key the source did not hold (the head of a value model started from a policy)
        # goes where the LM head was, else into the last shard.
        fallback = shard_of.get(_LM_HEAD, max(shard_of.values(), default="0001"))
        shards: Dict[str, Dict[str, torch.Tensor]] = {}
        for key, tensor in hf_state.items():
            shards.setdefault(shard_of.get(key, fallback), {})[key] = tensor
        suffix = ".safetensors" if self.settings.safe_serialization else ".bin"
        index: Dict[str, str] = {}
        total_size = 0
        # Numbered 1..n: a source shard left empty (one that held only the LM head) leaves no gap.
        for i, shard_id in enumerate(sorted(shards)):
            name = SHARD_FNAME.format(cpt_idx=f"{i + 1:05}", num_shards=f"{len(shards):05}") + suffix
            tensors = {k: v.contiguous() for k, v in shards[shard_id].items()}
            if self.settings.safe_serialization:
                save_file(tensors, out_dir / name, metadata={"format": "pt"})
            else:
                torch.save(tensors, out_dir / name)
            index.update({key: name for key in tensors})
            total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        index_name = SAFETENSOR_INDEX_FNAME if self.settings.safe_serialization else TORCH_INDEX_FNAME
        (out_dir / index_name).write_text(
            json.dumps({"metadata": {"total_size": total_size}, "weight_map": index}, indent=2)
        )
        log.info(f"Classifier checkpoint ({total_size / 1024**3:.2f} GiB) saved to {out_dir}")


def _classifier_config(config: Mapping[str, Any], num_labels: int) -> Dict[str, Any]:
    """The source's config.json as a ``*ForSequenceClassification`` one with ``num_labels``."""
    config = dict(config)
    arch = (config.get("architectures") or [""])[0]
    for suffix in ("ForCausalLM", "ForSequenceClassification"):
        if arch.endswith(suffix):
            arch = arch[: -len(suffix)]
    arch = arch or {"qwen2": "Qwen2", "mistral": "Mistral"}.get(config.get("model_type"), "Llama")
    config["architectures"] = [f"{arch}ForSequenceClassification"]
    # transformers reads num_labels from id2label.
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    # The head is the classifier's own: nothing is tied, whatever the source policy did.
    config["tie_word_embeddings"] = False
    return config

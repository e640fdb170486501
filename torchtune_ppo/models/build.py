"""The models of a PPO run, built and loaded in one call: :func:`build_models`.

Four roles: the trained policy, its frozen reference, the trained value model (none for a
critic-free estimator) and the frozen reward model (none for a function reward). Each is built
by the config's builder, loaded through its torchtune checkpointer (a resume's weights for the
trained ones), checked (shapes, finite values), frozen or not, and sharded with FSDP2 under
torchrun. LoRA is decided here too:

- a LoRA policy trains its adapters; its reference is the same module with the adapters off
  (no second copy), entered through :attr:`Models.reference`;
- a LoRA value model trains its adapters and head; when it starts from the reward model's
  checkpoint (``share_reward_value_base``), the reward model is its frozen base with the
  adapters off and the checkpoint's head (:class:`~torchtune_ppo.lora.SharedBaseReward`).
"""

from typing import Any, Callable, ContextManager, Dict, Mapping, NamedTuple, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, modules, training, utils

from torchtune_ppo import checkpointing, distributed, lora
from torchtune_ppo._patches.torchtune_modules import use_fp32_attention, use_segment_attention
from torchtune_ppo.config import shares_reward_value_base
from torchtune_ppo.models.embedding import use_fp32_grad_embeddings
from torchtune_ppo.rlhf import uses_value_model

log = utils.get_logger("INFO")


class Models(NamedTuple):
    """The models of a run, from :func:`build_models`.

    Attributes:
        policy (nn.Module): the trained policy.
        ref_policy (nn.Module): the frozen reference policy; for a LoRA policy, the policy itself.
        value (Optional[nn.Module]): the trained value model; None for a critic-free estimator.
        reward (Optional[nn.Module]): the frozen reward model; None for a function reward.
        reference (Optional[Callable[[], ContextManager]]): entered around scoring to make
            ``ref_policy`` the reference: a LoRA policy's adapters off; None otherwise.
    """

    policy: nn.Module
    ref_policy: nn.Module
    value: Optional[nn.Module]
    reward: Optional[nn.Module]
    reference: Optional[Callable[[], ContextManager]]

    @property
    def trained(self) -> Dict[str, nn.Module]:
        """The trained models by checkpoint name: ``policy``, and ``value`` when there is one."""
        return {"policy": self.policy, **({} if self.value is None else {"value": self.value})}


def build_models(cfg: DictConfig, *, device: torch.device, dtype: torch.dtype,
                 resume_from: Optional[str] = None) -> Models:
    """Builds and loads every model of the run (see the module's docstring).

    Args:
        cfg (DictConfig): the validated recipe config.
        device (torch.device): where the models live.
        dtype (torch.dtype): their parameters' dtype.
        resume_from (Optional[str]): a checkpoint folder whose trained weights (and adapters)
            replace the start weights of the policy and value model.

    Returns:
        Models: the run's models.
    """
    if resume_from and checkpointing.is_sharded(resume_from):
        resume_from = None  # built from the config's checkpointers; the shards are loaded after sharding
    weights = checkpointing.checkpointer_overrides(resume_from) if resume_from else {}
    build = _Builder(cfg, device, dtype)
    policy = build(cfg.policy_model, "checkpointer", weights.get("policy", {}), trainable=True,
                   resume_from=resume_from and (resume_from, "policy"), fp32_logits=True)
    if lora.has_adapters(policy):  # the reference is the policy's frozen base, its adapters off
        ref_policy, reference = policy, lambda: lora.adapters_off(policy)
    else:
        ref_policy, reference = build(cfg.policy_model, "ref_policy_checkpointer", {}, trainable=False,
                                      fp32_logits=True), None
    value = None  # critic-free estimators: no value model is built, trained or saved
    reward_head: Dict[str, nn.Module] = {}  # the reward checkpoint's head, for a shared base
    if uses_value_model(cfg.advantage_estimator):
        value = build(cfg.reward_and_value_model, "value_checkpointer", weights.get("value", {}), trainable=True,
                      resume_from=resume_from and (resume_from, "value"), train_head=True, reward_head=reward_head)
    if cfg.reward is not None:
        reward = None
    elif reward_head:  # one frozen base: the value model's, its adapters off, and the checkpoint's head
        log.info("The reward model is the value model's base with its adapters off (share_reward_value_base).")
        reward = lora.SharedBaseReward(value, reward_head["output"])
    else:
        reward = build(cfg.reward_and_value_model, "reward_checkpointer", {}, trainable=False)
    return Models(policy, ref_policy, value, reward, reference)


def sharded_masters(cfg: DictConfig, dtype: torch.dtype) -> bool:
    """Whether the trained models keep fp32 parameters as FSDP2 shards computed in bf16 (bf16 with
    ``master_weights`` on several processes), instead of :class:`~torchtune_ppo.run.optim.MasterWeights`."""
    return distributed.world_size() > 1 and dtype == torch.bfloat16 and bool(cfg.get("master_weights", False))


class _Builder:
    """Builds, loads and freezes one model of a run's config at a time."""

    def __init__(self, cfg: DictConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype

    def __call__(self, cfg_model: DictConfig, checkpointer_key: str, overrides: Mapping[str, Any], *,
                 trainable: bool, resume_from=None, train_head: bool = False,
                 reward_head: Optional[Dict[str, nn.Module]] = None, fp32_logits: bool = False) -> nn.Module:
        """One model; a LoRA value model whose checkpoint is the reward model's also puts that
        checkpoint's head (frozen) in ``reward_head["output"]``. ``fp32_logits``: a policy's
        vocabulary projection computes in fp32 when the config asks for it (:func:`fp32_output`)."""
        cfg = self.cfg
        rng = checkpointing.capture_rng_state()
        # bf16 with master weights on several processes: a trained model's parameters are fp32 (its
        # FSDP2 shards are the masters), gathered in bf16 to compute (distributed.shard)
        dtype = torch.float32 if trainable and sharded_masters(cfg, self.dtype) else self.dtype
        with training.set_default_dtype(dtype), self.device:
            model = config.instantiate(cfg_model)
        adapters = lora.has_adapters(model)
        if adapters and not trainable:  # a LoRA reward model's adapters stay off: their random init
            checkpointing.restore_rng_state(rng)  # draws nothing, as with a shared base (none built)
        # A LoRA model's base always comes from its own checkpointer; a resume adds the adapters.
        checkpointer = config.instantiate(cfg[checkpointer_key], **({} if adapters else overrides))
        state_dict = checkpointer.load_checkpoint()[training.MODEL_KEY]
        checkpointing.check_shapes(model, state_dict, checkpointer_key)
        checkpointing.check_loaded_finite(state_dict, checkpointer_key)
        if reward_head is not None and shares_reward_value_base(cfg, value_is_lora=adapters):
            # before a resume loads the trained one; in the dtype the base computes in (bf16 masters: not fp32)
            reward_head["output"] = lora.checkpoint_head(model, state_dict).to(self.dtype)
        if adapters:  # the base frozen; the adapters (and a value head) train, or stay off for good
            saved = (checkpointing.load_adapters(*resume_from), resume_from[0]) if trainable and resume_from else None
            lora.setup_lora_model(model, state_dict, checkpointer_key, trainable=trainable, train_head=train_head,
                                  saved=saved)
        else:
            model.load_state_dict(state_dict)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=dtype)
        if adapters and self.dtype in (torch.bfloat16, torch.float16):  # x W^T + s B A x rounded once
            lora.round_adapters_once(model)
        if fp32_logits and cfg.get("fp32_logits", False) and self.dtype != torch.float32:
            fp32_output(model)
        # Dropout would make the trajectory's logprobs disagree with the loss step's.
        training.disable_dropout(model)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu":
            use_fp32_attention(model)  # CPU's bf16 flash-attention backward is slow (_patches)
            if trainable:  # the compiled embedding backward zeroes and rounds a [V, D] fp32 buffer
                use_fp32_grad_embeddings(model)
        if cfg.get("segment_attention"):  # packed rows attend by sequence (rlhf.segments): after the above
            use_segment_attention(model)
        if trainable and cfg.enable_activation_checkpointing:
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        if not trainable:
            model.eval()
            model.requires_grad_(False)
        if distributed.world_size() > 1 and (trainable or cfg.shard_frozen_models):
            distributed.shard(model, compute_dtype=self.dtype if dtype != self.dtype else None)
            # else the frozen models stay whole on every rank
        return model



class FP32Linear(nn.Linear):
    """An ``nn.Linear`` whose product runs in float32 from its lower-precision input and weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(x.float(), self.weight.float(), bias)


class FP32TiedLinear(modules.TiedLinear):
    """A ``TiedLinear`` (output tied to the embeddings) whose product runs in float32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float(), self.tied_module.weight.float())


def fp32_output(model: nn.Module) -> nn.Module:
    """Makes ``model``'s output projection compute in float32 (``fp32_logits``), in place.

    The bf16 hidden states and weight are cast to float32 and multiplied there, so the logits
    carry no bf16 rounding of their own: every logprob (the generator's, scoring's and the loss
    step's), the sampling and the entropy read them. Only the class of the projection changes:
    the same weight (shared with the embeddings when tied), the same state dict keys, gradients
    to the bf16 weight. Reads ``model.output`` of a ``TransformerDecoder``.

    Raises:
        ValueError: for an output projection other than ``nn.Linear`` or ``TiedLinear`` (a LoRA
            adapter on it, for one).
    """
    output = getattr(model, "output", None)
    if type(output) is nn.Linear:
        output.__class__ = FP32Linear
    elif type(output) is modules.TiedLinear:
        output.__class__ = FP32TiedLinear
    elif not isinstance(output, (FP32Linear, FP32TiedLinear)):
        raise ValueError(
            f"fp32_logits=True computes the output projection in fp32, which it can do for an "
            f"nn.Linear or a TiedLinear; this policy's is {type(output).__name__}. With LoRA, "
            "leave the output projection without an adapter (apply_lora_to_output: False), or set "
            "fp32_logits=False.")
    return model

"""The bottom layer: the types and math that the rollout and the update both use, in
torchtune's names (``torchtune.rlhf``).

- :mod:`.trajectory`: :class:`Trajectory`, :class:`ScoringSettings`, and the scoring rules every
  path shares (truncation first, then the penalties and the zeroing).
- :mod:`.sequence_processing`: truncation, masks and positions of left-padded rows, logprob,
  entropy and value reads from final hidden states.
- :mod:`.rewards`: KL-penalised rewards, GAE, whitening, explained variance, group baselines;
  the compaction that runs them over a multi-turn episode's policy tokens, turn-level GAE.
- :mod:`.loss`: the clipped PPO token losses, :class:`PPOStats`, the loss aggregations.
- :mod:`.kl`: per-token KL estimators, in the reward and in the loss.
- :mod:`.packing`: real tokens packed into fixed-width rows for the loss step.

Nothing here reads a config, decides what is compiled, or talks to other processes: a reduction
over processes comes in as a function (``reduce``).
"""

from torchtune_ppo.rlhf.kl import KL_ESTIMATORS, KL_LOSS_ESTIMATORS, kl_estimate, kl_loss_estimate
from torchtune_ppo.rlhf.loss import AGGREGATIONS, PPOStats, TokenLosses, loss_weight, ppo_token_losses
from torchtune_ppo.rlhf.rewards import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    GROUP_STD_EPS,
    compact,
    compact_order,
    discounted_returns,
    expand,
    explained_variance,
    gae,
    gae_advantages,
    get_rewards_ppo,
    group_baseline,
    length_adaptive_lmbda,
    turn_gae_advantages,
    turn_ids,
    uses_value_model,
    whiten,
)
from torchtune_ppo.rlhf.sequence_processing import (
    block_causal_masks,
    chunked_logprobs,
    entropy_from_logprobs,
    get_reward_penalty_mask,
    masked_mean,
    masks_and_positions,
    read_logprobs,
    read_logprobs_and_entropy,
    read_values,
    repeat_prompts,
    response_values,
    token_logprobs,
    token_logprobs_and_entropy,
    truncate_after_stop_token,
)
from torchtune_ppo.rlhf.trajectory import ScoringSettings, Trajectory, concat_trajectories, finish_trajectory, truncated

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "GROUP_ESTIMATORS", "GROUP_STD_EPS", "KL_ESTIMATORS",
    "KL_LOSS_ESTIMATORS", "PPOStats", "ScoringSettings", "TokenLosses", "Trajectory",
    "block_causal_masks", "chunked_logprobs", "compact", "compact_order", "concat_trajectories",
    "discounted_returns", "entropy_from_logprobs", "expand", "explained_variance", "finish_trajectory", "gae",
    "gae_advantages", "get_reward_penalty_mask", "get_rewards_ppo", "group_baseline", "kl_estimate",
    "kl_loss_estimate", "length_adaptive_lmbda",
    "loss_weight", "masked_mean", "masks_and_positions", "ppo_token_losses", "read_logprobs",
    "read_logprobs_and_entropy", "read_values", "repeat_prompts", "response_values", "token_logprobs",
    "token_logprobs_and_entropy", "truncate_after_stop_token", "truncated", "turn_gae_advantages", "turn_ids",
    "uses_value_model", "whiten",
]

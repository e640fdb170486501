"""Experimental: steps 1-6 as one compiled region (``compile.rollout``, the RFC's option 2).

:func:`fused_rollout` traces the generation, unrolled into straight-line code by
:func:`generate_unrolled`, together with the padded scoring :func:`score_trajectory`. No early
stop (every row runs all ``T`` steps) and no packing (that needs the lengths on the host,
mid-region): the default split rollout (:class:`~torchtune_ppo.rollout.Rollout`) is faster
wherever it was measured. :func:`score_trajectory` runs the models on padded ``[b, P + T]``
rows; it is also the reference twin the packed scoring is tested against. Both scorings share
:func:`~torchtune_ppo.rlhf.trajectory.truncated` and
:func:`~torchtune_ppo.rlhf.trajectory.finish_trajectory`.
"""

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from torchtune_ppo._patches.torchtune_modules import final_hidden_states
from torchtune_ppo import rlhf
from torchtune_ppo.rollout.generation import Generator, generate_next_token, prefill
from torchtune_ppo.rlhf import ScoringSettings, Trajectory, finish_trajectory, truncated


# Reward source: (query_responses [b, S], masks [b, S, S], position_ids [b, S],
# last_idx [b] index of each row's last valid token) -> scores [b]. It sees padded rows, so a
# Rollout scores with it on padded rows; ModelReward, whose model is read at the last valid
# token only, is scored on packed rows instead (torchtune_ppo.rollout.scoring).
RewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _response_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    masks: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    prompt_len: int,
    temperature: float,
) -> torch.Tensor:
    """``[b, T]`` logprobs of ``responses``, projecting only the ``T`` positions that predict
    them, in chunks (no ``[b, P + T, V]`` logits)."""
    hidden = final_hidden_states(model, query_responses, mask=masks, input_pos=position_ids)
    hidden = hidden[:, prompt_len - 1 : -1]  # [b, T, D]: position i predicts token i + 1
    flat = rlhf.chunked_logprobs(model.output, hidden.flatten(0, 1), responses.flatten(), temperature)
    return flat.view(responses.shape)


def score_trajectory(
    query_responses: torch.Tensor,
    prompt_lens: torch.Tensor,
    logprobs: Optional[torch.Tensor],
    policy_model: Optional[nn.Module],
    ref_policy_model: nn.Module,
    value_model: Optional[nn.Module],
    reward_fn: Optional[RewardFn],
    stop_token_ids: torch.Tensor,
    settings: ScoringSettings,
    scores: Optional[torch.Tensor] = None,
) -> Trajectory:
    """Steps 2-6 on padded ``[b, P + T]`` rows: the arguments and result of
    :func:`~torchtune_ppo.rollout.scoring.packed_score_trajectory`, with no packing plan and
    ``reward_fn`` in place of its reward model: a :data:`RewardFn` in the graph, e.g.
    :class:`~torchtune_ppo.rewards.model.ModelReward`, or None when ``scores`` are given.
    ``value_model`` returns ``[b, S, 1]``; None for a critic-free run (the values are 0).
    """
    prompt_len, temperature = settings.prompt_len, settings.temperature
    query_responses, response_padding_masks, masks, position_ids = truncated(
        query_responses, prompt_lens, stop_token_ids, settings
    )
    responses = query_responses[:, prompt_len:]

    # step 2: policy and reference logprobs of the responses
    if logprobs is None:
        logprobs = _response_logprobs(policy_model, query_responses, masks, position_ids,
                                      responses, prompt_len, temperature)
    ref_logprobs = _response_logprobs(ref_policy_model, query_responses, masks, position_ids,
                                      responses, prompt_len, temperature)

    # step 3: values of the states before each response token
    values = (torch.zeros_like(ref_logprobs) if value_model is None else rlhf.response_values(
        value_model(query_responses, mask=masks, input_pos=position_ids), prompt_len
    ))

    # step 5: score the truncated pairs at each row's last valid token
    if reward_fn is not None:
        seq_lens = (~response_padding_masks).sum(-1)
        scores = reward_fn(query_responses, masks, position_ids, prompt_len + seq_lens - 1)
    return finish_trajectory(
        query_responses, response_padding_masks, masks, position_ids, logprobs, ref_logprobs,
        values, scores, stop_token_ids, settings,
    )


def generate_unrolled(
    generator: Generator, noise: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill and every decode step as straight-line code with no early exit, for tracing.

    Call inside ``generator.kv_cache.decoding()`` after ``generator.prepare(...)`` with a full
    batch of ``batch_size`` prompts.

    Args:
        generator (Generator): holds the model, its prepared inputs and sampling settings.
        noise (Optional[torch.Tensor]): ``[T, B, W]`` Exponential(1) draws from
            ``generator.draw_noise(rng, steps=T)``; None when greedy.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``query_responses [B, P + T]`` (tokens after a
        stop token are kept, not padded) and ``logprobs [B, T]``.
    """
    inp, sampling = generator.inputs, generator.sampling
    P, T = generator.max_prompt_len, generator.max_generated_tokens
    cols = torch.arange(P + T, device=inp.tokens.device)
    token, logprob, _ = prefill(
        generator.model, inp.tokens, inp.prefill_pos, inp.prefill_mask,
        None if noise is None else noise[0], **sampling,
    )
    tokens, logprobs = [token], [logprob]
    for i in range(1, T):
        response_cols = (cols >= P) & (cols < P + i)  # [S]: the i tokens fed so far
        token, logprob, _ = generate_next_token(
            generator.model, token[:, None], inp.decode_pos + (i - 1), inp.decode_mask | response_cols,
            None if noise is None else noise[i], **sampling,
        )
        tokens.append(token)
        logprobs.append(logprob)
    query_responses = torch.cat([inp.tokens, torch.stack(tokens, dim=1)], dim=1)
    return query_responses, torch.stack(logprobs, dim=1)


def fused_rollout(
    generator: Generator,
    noise: Optional[torch.Tensor],
    prompt_lens: torch.Tensor,
    ref_policy_model: nn.Module,
    value_model: Optional[nn.Module],
    reward_fn: RewardFn,
    stop_token_ids: torch.Tensor,
    settings: ScoringSettings,
) -> Trajectory:
    """Steps 1-6 as one function: :func:`generate_unrolled`, then :func:`score_trajectory`.

    Call as :func:`generate_unrolled`; ``prompt_lens`` ``[B]`` are those given to ``prepare``.
    The other arguments are :func:`score_trajectory`'s.
    """
    query_responses, logprobs = generate_unrolled(generator, noise)
    return score_trajectory(
        query_responses, prompt_lens, logprobs, None, ref_policy_model, value_model, reward_fn,
        stop_token_ids, settings,
    )

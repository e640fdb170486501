"""The observation mask at each turn boundary of an episode, against what the conversation says:
the assistant turn's last token (its stop token) and the next turn's first token are the
policy's, every token of the observation between them, and only those, is the environment's.
Checked on the turn runner's episodes, the Rollout's trajectory, the turn ids and the
advantages, with the scripted environment and stand-in renderer of ``test_turns``."""

import contextlib

import torch

from conftest import tiny_classifier
from test_turns import STOPS, Digits, P, T, batch, runner
from torchtune_ppo.ppo.advantages import AdvantageSettings, uncorrected_advantages
from torchtune_ppo.rewards.model import ModelReward
from torchtune_ppo.rlhf import ScoringSettings, turn_ids
from torchtune_ppo.rollout import Rollout


def _boundaries(conversation):
    """From the conversation's text alone: each token's role (True: the environment's) and, per
    observation, ``(first, end)`` positions in the episode."""
    is_obs, spans, at = [], [], 0
    for role, text in conversation.turns:
        n = len(Digits().tokens(text)) if role == "tool" else len(text.split())
        if role == "tool":
            spans.append((at, at + n))
        is_obs += [role == "tool"] * n
        at += n
    return is_obs, spans


def test_each_turn_boundary_masks_exactly_the_observation():
    run, model = runner()
    settings = ScoringSettings(prompt_len=P, pad_id=0, temperature=1.0, penalise_no_eos=False,
                               min_response_length=None, reward_penalty=-1.0)
    rollout = Rollout(run.gen, model, tiny_classifier(1).eval(), ModelReward(tiny_classifier(2).eval()),
                      torch.tensor(STOPS), settings, turns=run)
    prompts, lens = batch()
    traj = rollout(prompts, lens, torch.Generator().manual_seed(0), lambda phase: contextlib.nullcontext(),
                   seeds=[0, 1, 2, 3, 4, 5])
    out = rollout.last_episodes[0]
    valid = ~traj.response_padding_masks
    turns = turn_ids(valid, traj.observation_masks)
    adv = uncorrected_advantages(traj, AdvantageSettings(gamma=1.0, lmbda=0.95, gae_level="turn"), kl_coeff=0.1)
    boundaries = 0
    for r in range(6):
        is_obs, spans = _boundaries(out.conversations[r])
        L = int(out.episode_lens[r])
        assert len(is_obs) == L
        assert out.observation_masks[r].tolist() == is_obs + [False] * (T - L)
        assert traj.response_padding_masks[r].tolist() == is_obs + [True] * (T - L)
        for k, (first, end) in enumerate(spans):
            boundaries += 1
            before, after = first - 1, end  # the turn's stop token, the next turn's first token
            assert int(traj.query_responses[r, P + before]) in STOPS
            for t in (before, after):
                assert valid[r, t] and traj.logprobs[r, t] != 0 and traj.values[r, t] != 0, (r, t)
            assert not valid[r, first:end].any()
            assert (traj.logprobs[r, first:end] == 0).all() and (adv.advantages[r, first:end] == 0).all()
            assert (adv.advantages[r, before] != 0) and (adv.advantages[r, after] != 0)
            assert int(turns[r, before]) == k and int(turns[r, after]) == k + 1
            assert (turns[r, first:end] == -1).all()
    assert boundaries >= 3

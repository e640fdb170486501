"""Advantages of multi-turn episodes: the estimators over the policy's tokens with the tool
observations cut out (against the same estimators on rows built by hand without them), and
turn-level GAE (against a loop over turns written here)."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_ppo import rlhf
from torchtune_ppo.ppo.advantages import AdvantageSettings, uncorrected_advantages
from torchtune_ppo.rlhf import GROUP_ESTIMATORS, KL_ESTIMATORS, compact, compact_order, expand, turn_ids

F64 = torch.float64


def _episode(layouts, scores, dtype=torch.float32, seed=0, observations=True):
    """Rows from layouts, one character a token: ``P`` the policy's, ``O`` an observation, ``_``
    padding. logprobs, ref_logprobs and values random at ``P``, 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    b, T = len(layouts), len(layouts[0])
    kinds = [[c for c in row] for row in layouts]
    valid = torch.tensor([[c == "P" for c in row] for row in kinds])
    obs = torch.tensor([[c == "O" for c in row] for row in kinds])
    logprobs = -torch.rand(b, T, generator=g, dtype=dtype) * valid
    ref = (logprobs + 0.3 * torch.randn(b, T, generator=g, dtype=dtype)) * valid
    values = torch.randn(b, T, generator=g, dtype=dtype) * valid
    traj = SimpleNamespace(scores=torch.tensor(scores, dtype=dtype), logprobs=logprobs, ref_logprobs=ref,
                           values=values, response_padding_masks=~valid, seq_lens=valid.sum(-1))
    if observations:
        traj.observation_masks = obs
    return traj


def _cut(traj):
    """The rows with their observations cut out by hand: each row's ``P`` tokens, in order, then padding."""
    valid = ~traj.response_padding_masks
    out = {}
    for name in ("logprobs", "ref_logprobs", "values"):
        x = getattr(traj, name)
        rows = [[v for v, ok in zip(r.tolist(), m.tolist()) if ok] for r, m in zip(x, valid)]
        out[name] = torch.tensor([r + [0.0] * (x.shape[1] - len(r)) for r in rows], dtype=x.dtype)
    prefix = torch.arange(valid.shape[1])[None, :] < traj.seq_lens[:, None]
    return SimpleNamespace(scores=traj.scores, response_padding_masks=~prefix, seq_lens=traj.seq_lens, **out)


def _put_back(x_cut, traj):
    """The outputs on the cut rows written at the episode's ``P`` positions, 0 elsewhere (by hand)."""
    valid = ~traj.response_padding_masks
    out = torch.zeros_like(x_cut)
    for i in range(x_cut.shape[0]):
        positions = [t for t, ok in enumerate(valid[i].tolist()) if ok]
        for k, t in enumerate(positions):
            out[i, t] = x_cut[i, k]
    return out


# T = 12; row 0 is the brief's episode: 3 policy tokens, 2 observations, 4 policy tokens, padding
LAYOUTS = ["PPPOOPPPP___", "PPOPOOPPP___", "PPPPPP______", "POOOPPPPPPP_"]
SCORES = [1.0, -0.5, 0.25, 2.0]

CASES = [
    dict(advantage_estimator="gae"),
    dict(advantage_estimator="gae", whiten_rewards=True),
    dict(advantage_estimator="gae", lmbda_actor=0.5),
    dict(advantage_estimator="gae", lmbda_length_alpha=0.2),
    dict(advantage_estimator="reinforce_plus_plus"),
    *[dict(advantage_estimator=e) for e in GROUP_ESTIMATORS],
]


def _settings(**kw):
    return AdvantageSettings(**{"gamma": 0.9, "lmbda": 0.8, "num_samples_per_prompt": 2, **kw})


# ---- compaction -------------------------------------------------------------------------------


def test_compact_order_by_hand_and_round_trip():
    valid = torch.tensor([[True, False, False, True, True, False], [True, True, False, False, False, False]])
    order = compact_order(valid)
    assert order.tolist() == [[0, 3, 4, 1, 2, 5], [0, 1, 2, 3, 4, 5]]  # the prefix row: the identity
    x = torch.arange(12.0).view(2, 6)
    assert compact(x, order).tolist() == [[0.0, 3.0, 4.0, 1.0, 2.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]]
    g = torch.Generator().manual_seed(1)
    valid = torch.rand(5, 9, generator=g) < 0.5
    y = torch.randn(5, 9, generator=g)
    order = compact_order(valid)
    assert torch.equal(expand(compact(y, order), order), y)
    counts = valid.sum(-1)
    assert torch.equal(compact(valid, order), torch.arange(9)[None, :] < counts[:, None])


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_episode_equals_the_rows_without_observations(case, kl_estimator):
    traj = _episode(LAYOUTS, SCORES)
    settings = _settings(kl_estimator=kl_estimator, **case)
    out = uncorrected_advantages(traj, settings, kl_coeff=0.3)
    ref = uncorrected_advantages(_cut(traj), settings, kl_coeff=0.3)
    for name in ("advantages", "returns", "kl", "kl_rewards"):
        torch.testing.assert_close(getattr(out, name), _put_back(getattr(ref, name), traj), rtol=0, atol=0)
    for name in ("lmbda_actor", "explained_variance"):
        assert (getattr(out, name) is None) == (getattr(ref, name) is None)
        if getattr(ref, name) is not None:
            torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=0, atol=0)
    if case["advantage_estimator"] in ("gae", "reinforce_plus_plus"):
        # not vacuous: read as prefix rows (the score on an observation, GAE through it) they differ
        del traj.observation_masks
        naive = uncorrected_advantages(traj, settings, kl_coeff=0.3)
        assert (naive.advantages - out.advantages).abs().max() > 1e-3


@pytest.mark.parametrize("case", CASES + [dict(advantage_estimator="gae", gae_level="turn")],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_no_observation_is_bit_identical(case):
    """Without observation_masks, or with one that has no True, the outputs are bit-identical."""
    layouts = ["PPPPPPP___", "PPP_______", "PPPPPPPPPP", "P_________"]
    traj = _episode(layouts, SCORES, observations=False)
    settings = _settings(**case)
    plain = uncorrected_advantages(traj, settings, kl_coeff=0.3)
    traj.observation_masks = torch.zeros_like(traj.response_padding_masks)
    none_true = uncorrected_advantages(traj, settings, kl_coeff=0.3)
    for a, b in zip(plain, none_true):
        assert (a is None and b is None) or torch.equal(a, b)


def test_no_observation_is_the_prefix_path():
    """Without observation_masks, ``gae`` is :func:`gae_advantages` on the trajectory's own rows
    and ``grpo`` the group baseline on them: nothing is reordered."""
    traj = _episode(["PPPPPPP___", "PPP_______", "PPPPPPPPPP", "P_________"], SCORES, observations=False)
    valid = ~traj.response_padding_masks
    rewards = rlhf.get_rewards_ppo(traj.scores, traj.logprobs, traj.ref_logprobs, 0.3, traj.seq_lens, valid,
                                   kl_estimator="k3")[0]
    out = uncorrected_advantages(traj, _settings(kl_estimator="k3", lmbda_actor=0.5, whiten_rewards=True), 0.3)
    gae, returns = rlhf.gae_advantages(traj.values, rlhf.whiten(rewards, valid), 0.9, 0.8, valid, lmbda_actor=0.5)
    assert torch.equal(out.advantages, gae) and torch.equal(out.returns, returns)
    out = uncorrected_advantages(traj, _settings(advantage_estimator="grpo", kl_estimator="k3"), 0.3)
    assert torch.equal(out.advantages, rlhf.group_baseline(rewards.sum(-1), 2, "grpo")[:, None] * valid)


# ---- turns ------------------------------------------------------------------------------------


def test_turn_ids_by_hand():
    layouts = ["PPOOPP_POP", "OPP_PPOOO_", "PPPP______"]
    valid = torch.tensor([[c == "P" for c in row] for row in layouts])
    obs = torch.tensor([[c == "O" for c in row] for row in layouts])
    assert turn_ids(valid, obs).tolist() == [
        [0, 0, -1, -1, 1, 1, -1, 1, -1, 2],  # padding inside a turn does not split it
        [-1, 0, 0, -1, 0, 0, -1, -1, -1, -1],  # an observation before the first token starts nothing
        [0, 0, 0, 0, -1, -1, -1, -1, -1, -1],
    ]
    assert turn_ids(valid, None).tolist() == turn_ids(valid, torch.zeros_like(obs)).tolist() == [
        [0, 0, -1, -1, 0, 0, -1, 0, -1, 0], [-1, 0, 0, -1, 0, 0, -1, -1, -1, -1], [0] * 4 + [-1] * 6,
    ]


def _turn_gae_by_hand(layouts, d, values, scores, kl_coeff, gamma, lmbda, lmbda_actor):
    """Turn-level GAE with a loop over each row's turns: k1 rewards ``-kl_coeff * d`` per token,
    the score on the last policy token; a turn's reward is the sum over its tokens, its value
    the first token's; the token advantages whitened over every policy token."""
    adv, ret = [], []
    for row, dr, vr, score in zip(layouts, d, values, scores):
        turns, current, gap = [], [], False
        for t, c in enumerate(row):
            if c == "O":
                gap = True
            elif c == "P":
                if gap and current:
                    turns.append(current)
                    current = []
                gap = False
                current.append(t)
        turns.append(current)
        last = turns[-1][-1]
        R = [sum(-kl_coeff * dr[t] + (score if t == last else 0.0) for t in turn) for turn in turns]
        V = [vr[turn[0]] for turn in turns] + [0.0]

        def run(lam):
            a, out = 0.0, [0.0] * len(turns)
            for k in reversed(range(len(turns))):
                a = R[k] + gamma * V[k + 1] - V[k] + gamma * lam * a
                out[k] = a
            return out

        a_ret, a_adv = run(lmbda), run(lmbda if lmbda_actor is None else lmbda_actor)
        adv_row, ret_row = [0.0] * len(row), [0.0] * len(row)
        for k, turn in enumerate(turns):
            for t in turn:
                adv_row[t], ret_row[t] = a_adv[k], a_ret[k] + V[k]
        adv.append(adv_row)
        ret.append(ret_row)
    flat = [a for row, a_row in zip(layouts, adv) for c, a in zip(row, a_row) if c == "P"]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1) + 1e-8)
    adv = [[(a - mean) / std if c == "P" else 0.0 for c, a in zip(row, a_row)] for row, a_row in zip(layouts, adv)]
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


@pytest.mark.parametrize("lmbda_actor", [None, 0.5])
def test_turn_level_gae_by_hand(lmbda_actor):
    # row 0: turns at tokens {0, 1}, {3, 4, 5}, {8}; row 1: {0, 1, 2}, {4, 5}
    layouts = ["PPOPPPOOP_", "PPPOPP____"]
    P = [[c == "P" for c in row] for row in layouts]
    d = [[0.2, -0.1, 0, 0.4, 0.1, -0.3, 0, 0, 0.5, 0], [0.3, 0.0, -0.2, 0, 0.6, 0.1, 0, 0, 0, 0]]
    values = [[0.5, 0.2, 0, -0.4, 0.7, 0.3, 0, 0, 1.2, 0], [-0.6, 0.1, 0.9, 0, 0.25, -0.8, 0, 0, 0, 0]]
    scores, kl_coeff, gamma, lmbda = [1.5, -0.7], 0.5, 0.9, 0.8
    valid = torch.tensor(P)
    logprobs = torch.full((2, 10), -1.0, dtype=F64) * valid
    traj = SimpleNamespace(
        scores=torch.tensor(scores, dtype=F64), logprobs=logprobs,
        ref_logprobs=(logprobs - torch.tensor(d, dtype=F64)) * valid, values=torch.tensor(values, dtype=F64),
        response_padding_masks=~valid, seq_lens=valid.sum(-1),
        observation_masks=torch.tensor([[c == "O" for c in row] for row in layouts]),
    )
    settings = AdvantageSettings(gamma=gamma, lmbda=lmbda, lmbda_actor=lmbda_actor, gae_level="turn")
    out = uncorrected_advantages(traj, settings, kl_coeff)
    adv, ret = _turn_gae_by_hand(layouts, d, values, scores, kl_coeff, gamma, lmbda, lmbda_actor)
    torch.testing.assert_close(out.returns, ret)
    torch.testing.assert_close(out.advantages, adv)
    token = uncorrected_advantages(traj, settings._replace(gae_level="token"), kl_coeff)
    assert (token.returns - out.returns).abs().max() > 0.1  # not the token level


def test_turn_level_without_observations_is_one_step():
    """Without observation_masks a row is one turn: advantage ``R - V_0`` on every token (then
    whitened), return ``R``, the row's summed reward."""
    valid = torch.tensor([[True, True, True], [True, True, False]])
    d = torch.tensor([[0.2, 0.0, -0.2], [0.4, 0.2, 0.0]], dtype=F64)
    logprobs = torch.full((2, 3), -1.0, dtype=F64) * valid
    traj = SimpleNamespace(
        scores=torch.tensor([1.0, -1.0], dtype=F64), logprobs=logprobs, ref_logprobs=(logprobs - d) * valid,
        values=torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, 0.0]], dtype=F64), response_padding_masks=~valid,
        seq_lens=torch.tensor([3, 2]),
    )
    out = uncorrected_advantages(traj, AdvantageSettings(gamma=0.9, lmbda=0.8, gae_level="turn"), 0.5)
    # rewards -0.5 d, the score on the last token: R = 1.0 and -1.3; A = R - V_0 = 0.7 and -1.4
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0, 1.0], [-1.3, -1.3, 0.0]], dtype=F64))
    # [0.7] * 3 and [-1.4] * 2 whitened: mean -0.14, deviations 0.84 (x3), -1.26 (x2)
    std = math.sqrt((3 * 0.84 ** 2 + 2 * 1.26 ** 2) / 4 + 1e-8)
    expected = torch.tensor([[0.84, 0.84, 0.84], [-1.26, -1.26, 0.0]], dtype=F64) / std
    torch.testing.assert_close(out.advantages, expected)


# ---- settings ---------------------------------------------------------------------------------


def _config(**extra):
    fields = {k: v for k, v in AdvantageSettings()._asdict().items() if k != "gae_level"}
    return OmegaConf.create({**fields, **extra})


def test_from_config_reads_turns_gae():
    assert AdvantageSettings.from_config(_config()).gae_level == "token"  # no turns block
    assert AdvantageSettings.from_config(_config(turns={"max_turns": 4})).gae_level == "token"
    assert AdvantageSettings.from_config(_config(turns={"gae": "turn"})).gae_level == "turn"
    assert AdvantageSettings.from_config(_config(turns={"gae": "token"})).gae_level == "token"


def test_gae_level_errors():
    with pytest.raises(ValueError, match=r"turns.gae must be one of \['token', 'turn'\], got 'turns'"):
        AdvantageSettings.from_config(_config(turns={"gae": "turns"}))
    with pytest.raises(ValueError, match=r"turns.gae='turn' .* advantage_estimator='gae', "
                                         r"got advantage_estimator='grpo'"):
        AdvantageSettings.from_config(_config(turns={"gae": "turn"}, advantage_estimator="grpo",
                                              num_samples_per_prompt=2))
    traj = _episode(LAYOUTS, SCORES)
    with pytest.raises(ValueError, match=r"turns.gae must be one of"):
        uncorrected_advantages(traj, _settings(gae_level="sequence"), 0.1)
    with pytest.raises(ValueError, match=r"advantage_estimator='rloo'"):
        uncorrected_advantages(traj, _settings(gae_level="turn", advantage_estimator="rloo"), 0.1)

"""The prompt collator: fixed-width left padding, real lengths, truncation of long prompts."""

import pytest
import torch

from torchtune_ppo.data import left_pad_prompts

PAD = 0


def _collate(prompts, max_prompt_len=5, long_prompts="truncate"):
    return left_pad_prompts(
        [{"tokens": p} for p in prompts], max_prompt_len=max_prompt_len, pad_id=PAD,
        long_prompts=long_prompts,
    )


def test_left_padding_to_a_fixed_width_and_real_lengths():
    out = _collate([[11, 12, 13], [21, 22, 23, 24, 25], [31], []])
    assert out["tokens"].tolist() == [
        [PAD, PAD, 11, 12, 13],
        [21, 22, 23, 24, 25],
        [PAD, PAD, PAD, PAD, 31],
        [PAD, PAD, PAD, PAD, PAD],
    ]
    assert out["tokens"].dtype == torch.long
    assert out["prompt_lens"].tolist() == [3, 5, 1, 0]
    assert out["prompt_lens"].dtype == torch.long
    assert int(out["num_truncated"]) == 0


def test_width_is_max_prompt_len_even_when_every_prompt_is_shorter():
    out = _collate([[7], [8, 9]], max_prompt_len=4)
    assert out["tokens"].tolist() == [[PAD, PAD, PAD, 7], [PAD, PAD, 8, 9]]


def test_pad_id_inside_a_prompt_counts_as_a_real_token():
    # the length, not the token value, says where padding ends
    out = _collate([[PAD, 5, PAD]])
    assert out["tokens"].tolist() == [[PAD, PAD, PAD, 5, PAD]]
    assert out["prompt_lens"].tolist() == [3]


def test_truncation_keeps_the_last_tokens_and_counts_the_cut_prompts():
    out = _collate([[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15]])
    assert out["tokens"].tolist() == [
        [3, 4, 5, 6, 7],  # the tokens next to the response are kept
        [PAD, PAD, PAD, 8, 9],
        [11, 12, 13, 14, 15],
    ]
    assert out["prompt_lens"].tolist() == [5, 2, 5]
    assert int(out["num_truncated"]) == 2


def test_a_prompt_of_exactly_max_prompt_len_is_not_truncated():
    out = _collate([[1, 2, 3, 4, 5]])
    assert out["tokens"].tolist() == [[1, 2, 3, 4, 5]]
    assert int(out["num_truncated"]) == 0


def test_long_prompts_error_names_the_length_and_the_fix():
    with pytest.raises(
        ValueError,
        match=r"^a prompt has 6 tokens, more than max_prompt_len=5; "
        r"raise max_prompt_len or set long_prompts=truncate\.$",
    ):
        _collate([[1, 2], [1, 2, 3, 4, 5, 6]], long_prompts="error")
    out = _collate([[1, 2, 3, 4, 5]], long_prompts="error")  # at the limit: fine
    assert out["prompt_lens"].tolist() == [5]

from __future__ import annotations

from typing import Any

import pytest

from asynctrace.rollouts import MergeStats, decode_rollouts, merge_step_wise
from tests.rollouts._helpers import CONVERSATIONS, encode, expected_messages


def test_two_turns_merge_as_settled_in_review() -> None:
    """prompt = first observation; response = action 1 + observation delta (mask 0) + action 2."""
    merged = merge_step_wise(
        [[10, 20, 30], [10, 20, 30, 40, 50, 60, 70]],
        [[40, 50], [80, 90]],
        trajectory_ids=["t", "t"],
        is_last_step=[False, True],
    )
    assert merged.prompt_token_ids == [[10, 20, 30]]
    assert merged.response_ids == [[40, 50, 60, 70, 80, 90]]
    assert merged.loss_masks == [[1, 1, 0, 0, 1, 1]]
    assert merged.rows == [[0, 1]]
    assert merged.is_last_step == [True]
    assert merged.trajectory_ids == ["t"]
    assert merged.stats == MergeStats(samples_before=2, samples_after=1, prefix_mismatches=0)
    assert merged.stats.merge_ratio == 0.5


def test_prefix_mismatch_starts_a_new_sample() -> None:
    """An observation that does not extend the sequence so far closes the sample and is counted."""
    merged = merge_step_wise(
        [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [1, 2, 99]],
        [[4, 5], [8, 9], [10]],
        trajectory_ids=["t"] * 3,
    )
    assert merged.prompt_token_ids == [[1, 2, 3], [1, 2, 99]]
    assert merged.response_ids == [[4, 5, 6, 7, 8, 9], [10]]
    assert merged.loss_masks == [[1, 1, 0, 0, 1, 1], [1]]
    assert merged.rows == [[0, 1], [2]]
    assert merged.starts_trajectory == [True, False]
    assert merged.stats.samples_before == 3
    assert merged.stats.samples_after == 2
    assert merged.stats.prefix_mismatches == 1
    assert merged.stats.merge_ratio == pytest.approx(2 / 3)
    assert merged.stats.as_metrics() == {
        "stepwise/samples_before": 3.0,
        "stepwise/samples_after": 2.0,
        "stepwise/merge_ratio": pytest.approx(2 / 3),
        "stepwise/prefix_mismatches": 1.0,
    }


def test_logprobs_none_stays_distinct_from_empty() -> None:
    """logprobs=None gives None; logprobs=[] (no rows) gives []; observation tokens get 0.0."""
    assert merge_step_wise([], [], logprobs=None).logprobs is None
    assert merge_step_wise([], [], logprobs=[]).logprobs == []
    assert merge_step_wise([], []).stats.merge_ratio == 1.0
    merged = merge_step_wise([[1], [1, 2, 3]], [[2], [4]], logprobs=[[-0.5], [-0.25]], trajectory_ids=[0, 0])
    assert merged.logprobs == [[-0.5, 0.0, -0.25]]
    assert merge_step_wise([[1]], [[2]]).logprobs is None


def test_rewards_per_token_or_per_row() -> None:
    """Per-token rewards stay per token (0 on observations); scalar rewards are summed."""
    per_token = merge_step_wise(
        [[1], [1, 2, 3]], [[2], [4, 5]], rewards=[[0.0], [0.0, 1.0]], trajectory_ids=["a", "a"]
    )
    assert per_token.rewards == [[0.0, 0.0, 0.0, 1.0]]
    scalar = merge_step_wise([[1], [1, 2, 3]], [[2], [4]], rewards=[0.25, 1.0], trajectory_ids=["a", "a"])
    assert scalar.rewards == [1.25]
    with pytest.raises(ValueError, match="rewards: mixes"):
        merge_step_wise([[1], [1, 2]], [[2], [3]], rewards=[[1.0], 1.0])  # type: ignore[arg-type]


def test_action_loss_masks_are_kept() -> None:
    """A row's own loss mask (e.g. a masked-out tool call) carries into the merged mask."""
    merged = merge_step_wise(
        [[1], [1, 2, 3, 4]], [[2, 3], [5]], loss_masks=[[1, 0], [1]], trajectory_ids=["a", "a"]
    )
    assert merged.loss_masks == [[1, 0, 0, 1]]


def test_interleaved_trajectories_are_grouped_by_id() -> None:
    """Rows of different trajectories may interleave; each merges with its own, in first-seen order."""
    merged = merge_step_wise(
        [[1], [7], [1, 2, 3], [7, 8, 9]],
        [[2], [8], [4], [10]],
        trajectory_ids=[{"instance_id": "p", "repetition_id": r} for r in (0, 1)] * 2,
    )
    assert merged.response_ids == [[2, 3, 4], [8, 9, 10]]
    assert merged.rows == [[0, 2], [1, 3]]


def test_last_step_closes_a_trajectory() -> None:
    """After is_last_step, a row with the same id starts a new trajectory (not a mismatch)."""
    merged = merge_step_wise(
        [[1], [1, 2, 3], [1], [1, 2, 3]],
        [[2], [4], [2], [4]],
        trajectory_ids=["a"] * 4,
        is_last_step=[False, True, False, True],
    )
    assert merged.response_ids == [[2, 3, 4], [2, 3, 4]]
    assert merged.stats.prefix_mismatches == 0
    # Without ids, consecutive rows up to a last step form the trajectory.
    by_steps = merge_step_wise([[1], [1, 2, 3], [5]], [[2], [4], [6]], is_last_step=[False, True, True])
    assert by_steps.response_ids == [[2, 3, 4], [6]]
    # With neither, every row stands alone.
    alone = merge_step_wise([[1], [1, 2, 3]], [[2], [4]])
    assert alone.stats.samples_after == 2


def test_misaligned_columns_name_the_argument() -> None:
    """Columns of the wrong length, or per-token values of the wrong length, are refused by name."""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        merge_step_wise([[1]], [[2], [3]])
    with pytest.raises(ValueError, match="loss_masks: has 1 rows"):
        merge_step_wise([[1], [2]], [[2], [3]], loss_masks=[[1]])
    with pytest.raises(ValueError, match="loss_masks: row 0 has 1 values for 2"):
        merge_step_wise([[1]], [[2, 3]], loss_masks=[[1]])
    with pytest.raises(ValueError, match="logprobs: row 0"):
        merge_step_wise([[1]], [[2, 3]], logprobs=[[0.0]])
    with pytest.raises(ValueError, match="trajectory_ids"):
        merge_step_wise([[1]], [[2]], trajectory_ids=[])


def test_merged_trajectory_decodes_to_the_conversation(tokenizer: Any) -> None:
    """Step-wise rows of a real conversation merge and decode back to every turn's text."""
    conversation = CONVERSATIONS[2]
    observations, actions = [], []
    for k, (role, _) in enumerate(conversation):
        if role == "assistant":
            observations.append(encode(tokenizer, conversation[:k])[0])
            actions.append(encode(tokenizer, conversation[k : k + 1])[0])
    merged = merge_step_wise(observations, actions, trajectory_ids=["t"] * len(actions))
    assert merged.stats.samples_after == 1
    ids = [p + r for p, r in zip(merged.prompt_token_ids, merged.response_ids, strict=True)]
    masks = [[0] * len(p) + m for p, m in zip(merged.prompt_token_ids, merged.loss_masks, strict=True)]
    (sample,) = decode_rollouts(
        ids, tokenizer=tokenizer, loss_mask=masks, prompt_lens=[len(p) for p in merged.prompt_token_ids]
    )
    assert sample.messages == expected_messages(conversation)
    assert sample.metadata["num_turns"] == 3


def test_per_token_rewards_as_numpy_arrays_or_tensors() -> None:
    """Per-token rewards given as numpy arrays or tensors stay per token, like lists."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    obs, act = [[1], [1, 2, 3]], [[2], [4, 5]]
    for rewards in (
        [np.array([0.5]), np.array([0.0, 1.0])],
        [torch.tensor([0.5]), torch.tensor([0.0, 1.0])],
        [[0.5], np.array([0.0, 1.0])],
    ):
        merged = merge_step_wise(obs, act, rewards=rewards, trajectory_ids=["a", "a"])
        assert merged.rewards == [[0.5, 0.0, 0.0, 1.0]]
    scalar = merge_step_wise(obs, act, rewards=torch.tensor([0.25, 1.0]), trajectory_ids=["a", "a"])
    assert scalar.rewards == [1.25]
    scalar = merge_step_wise(obs, act, rewards=[np.float64(0.25), np.array(1.0)], trajectory_ids=["a", "a"])
    assert scalar.rewards == [1.25]
    with pytest.raises(ValueError, match="rewards: row 1 has 1 values for 2"):
        merge_step_wise(obs, act, rewards=[np.array([0.5]), np.array([1.0])], trajectory_ids=["a", "a"])


def test_logprobs_row_of_none_means_no_logprobs_for_that_row() -> None:
    """A None logprobs row (SkyRL's for an empty output) gives 0.0 on its tokens, not an error."""
    merged = merge_step_wise(
        [[1], [1, 2, 3], [1, 2, 3, 4]],
        [[2], [4], [5, 6]],
        logprobs=[[-0.5], None, [-0.25, -0.75]],
        trajectory_ids=["a"] * 3,
    )
    assert merged.logprobs == [[-0.5, 0.0, 0.0, -0.25, -0.75]]
    assert merge_step_wise([[1]], [[]], logprobs=[None]).logprobs == [[]]

from __future__ import annotations

from dataclasses import dataclass

import pytest

from asynctrace.rollouts import prompt_index, prompt_indices


@dataclass
class TrajectoryID:
    """SkyRL's id: a dataclass, so not hashable."""

    instance_id: str
    repetition_id: int


def test_blocked_layout_groups_samples_per_prompt() -> None:
    """Without ids, sample i answers prompt i // (n_samples // n_prompts)."""
    assert prompt_indices(n_prompts=3, n_samples=12) == [0] * 4 + [1] * 4 + [2] * 4
    assert [prompt_index(i, n_prompts=3, n_samples=12) for i in range(12)] == prompt_indices(
        n_prompts=3, n_samples=12
    )
    assert prompt_indices(n_prompts=4, n_samples=4) == [0, 1, 2, 3]
    assert prompt_indices(n_prompts=0, n_samples=0) == []


def test_blocked_layout_is_bounds_checked() -> None:
    """An index outside the samples is an IndexError; counts that do not divide are a ValueError."""
    with pytest.raises(IndexError, match="sample_index: 12"):
        prompt_index(12, n_prompts=3, n_samples=12)
    with pytest.raises(IndexError, match="sample_index: -1"):
        prompt_index(-1, n_prompts=3, n_samples=12)
    with pytest.raises(ValueError, match="do not split evenly"):
        prompt_index(0, n_prompts=3, n_samples=10)
    with pytest.raises(ValueError, match="do not split evenly"):
        prompt_indices(n_prompts=4, n_samples=2)
    with pytest.raises(ValueError, match="n_prompts"):
        prompt_indices(n_prompts=0, n_samples=2)
    with pytest.raises(ValueError, match="n_samples"):
        prompt_indices(n_prompts=1, n_samples=-1)


def test_trajectory_ids_group_by_instance_in_order_of_appearance() -> None:
    """Samples with the same instance id share a prompt, numbered by first appearance."""
    ids = [
        TrajectoryID("b", 0),
        TrajectoryID("a", 0),
        TrajectoryID("b", 1),
        {"instance_id": "a", "repetition_id": 1},
    ]
    assert prompt_indices(n_prompts=2, n_samples=4, trajectory_ids=ids) == [0, 1, 0, 1]
    assert prompt_index(3, n_prompts=2, n_samples=4, trajectory_ids=ids) == 1
    # Plain string ids are instance ids themselves; uneven groups are fine with ids.
    assert prompt_indices(n_prompts=2, n_samples=3, trajectory_ids=["x", "x", "y"]) == [0, 0, 1]


def test_trajectory_ids_that_do_not_fit_are_refused() -> None:
    """Too many instances, or the wrong number of ids, is a ValueError."""
    with pytest.raises(ValueError, match="3 distinct instances but there are 2 prompts"):
        prompt_indices(n_prompts=2, n_samples=3, trajectory_ids=["a", "b", "c"])
    with pytest.raises(ValueError, match="trajectory_ids: has 2 ids for 3 samples"):
        prompt_indices(n_prompts=1, n_samples=3, trajectory_ids=["a", "a"])
    with pytest.raises(ValueError, match="prompt_trajectory_ids"):
        prompt_indices(n_prompts=1, n_samples=1, prompt_trajectory_ids=["a"])


def test_sample_ids_are_matched_against_prompt_ids() -> None:
    """With ids on both sides, an exact id wins, else the first prompt of the same instance."""
    prompts = [TrajectoryID("q1", 0), TrajectoryID("q1", 1), TrajectoryID("q2", 0)]
    samples = [TrajectoryID("q2", 0), TrajectoryID("q1", 1), TrajectoryID("q1", 0), TrajectoryID("q2", 7)]
    assert prompt_indices(
        n_prompts=3, n_samples=4, trajectory_ids=samples, prompt_trajectory_ids=prompts
    ) == [2, 1, 0, 2]
    with pytest.raises(ValueError, match=r"sample 0 \(q3:0\) matches no prompt"):
        prompt_indices(
            n_prompts=3, n_samples=1, trajectory_ids=[TrajectoryID("q3", 0)], prompt_trajectory_ids=prompts
        )
    with pytest.raises(ValueError, match="prompt_trajectory_ids: has 3 ids for 2 prompts"):
        prompt_indices(n_prompts=2, n_samples=1, trajectory_ids=samples[:1], prompt_trajectory_ids=prompts)

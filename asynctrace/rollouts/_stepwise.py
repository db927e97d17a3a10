"""Prefix-aware merge of step-wise rows: the turns of one trajectory back into one sequence."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ._mapping import trajectory_key

__all__ = ["MergeStats", "StepWiseMerge", "merge_step_wise", "trajectory_groups"]


@dataclass(frozen=True, slots=True)
class MergeStats:
    """What a step-wise merge did: rows in, samples out, and how often a prefix did not match."""

    samples_before: int
    samples_after: int
    prefix_mismatches: int

    @property
    def merge_ratio(self) -> float:
        """`samples_after / samples_before`: 1.0 when nothing merged, 0.25 when four turns became one."""
        return self.samples_after / self.samples_before if self.samples_before else 1.0

    def as_metrics(self, prefix: str = "stepwise/") -> dict[str, float]:
        """The stats as scalar metrics, ready for `TraceSession.log_metrics`."""
        return {
            f"{prefix}samples_before": float(self.samples_before),
            f"{prefix}samples_after": float(self.samples_after),
            f"{prefix}merge_ratio": self.merge_ratio,
            f"{prefix}prefix_mismatches": float(self.prefix_mismatches),
        }


@dataclass(frozen=True, slots=True)
class StepWiseMerge:
    """Merged samples in the column layout of the input, plus where each came from.

    `prompt_token_ids[k] + response_ids[k]` is the full token sequence of merged sample `k`;
    `loss_masks[k]` is 0 on observation tokens that arrived between actions. `rewards` is per
    token when the input was, else one sum per sample; `logprobs` is None exactly when the input
    was None. `rows[k]` lists the input rows merged into sample `k`; `starts_trajectory[k]` is
    False for a sample that a prefix mismatch started in the middle of a trajectory.
    """

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    loss_masks: list[list[int]]
    rewards: list[float] | list[list[float]] | None
    logprobs: list[list[float]] | None
    trajectory_ids: list[Any] | None
    is_last_step: list[bool]
    starts_trajectory: list[bool]
    rows: list[list[int]]
    stats: MergeStats


def _column(values: Sequence[Any] | None, name: str, n: int) -> Sequence[Any] | None:
    if values is not None and len(values) != n:
        raise ValueError(f"{name}: has {len(values)} rows but response_ids has {n}")
    return values


def _is_row(value: Any) -> bool:
    """Whether `value` is a per-token row: a sequence, or an array or tensor with dimensions."""
    if isinstance(value, (str, bytes)):
        return False
    if isinstance(value, Sequence):
        return True
    # numpy arrays and tensors are not `Sequence`s; their scalars (0-d) are not rows.
    return hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0


def _per_token(values: Any, name: str, row: int, length: int) -> list[Any]:
    out = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(out) != length:
        raise ValueError(f"{name}: row {row} has {len(out)} values for {length} response tokens")
    return out


def _reward_form(rewards: Sequence[Any] | None) -> bool | None:
    """True when rewards are per token, False when one per row, None when absent."""
    if rewards is None:
        return None
    nested = {_is_row(r) for r in rewards}
    if len(nested) > 1:
        raise ValueError("rewards: mixes per-token lists and one value per row")
    return nested.pop() if nested else False


def trajectory_groups(
    n: int, trajectory_ids: Sequence[Any] | None, is_last_step: Sequence[Any] | None
) -> list[list[int]]:
    """Rows of each trajectory, trajectories in order of first appearance.

    Rows share a trajectory by id (without ids, consecutive rows do); a last step closes its
    trajectory, so a later row with the same id starts a new one.
    """
    if trajectory_ids is None and is_last_step is None:
        return [[i] for i in range(n)]
    groups: list[list[int]] = []
    open_groups: dict[Hashable, list[int]] = {}
    for i in range(n):
        key: Hashable = trajectory_key(trajectory_ids[i]) if trajectory_ids is not None else None
        group = open_groups.get(key)
        if group is None:
            group = open_groups[key] = []
            groups.append(group)
        group.append(i)
        if is_last_step is not None and is_last_step[i]:
            del open_groups[key]
    return groups


class _Acc:
    """One merged sample being built."""

    __slots__ = (
        "first",
        "full",
        "last",
        "logprobs",
        "mask",
        "prompt",
        "response",
        "reward",
        "rows",
        "token_rewards",
    )

    def __init__(self, prompt: list[int], first: bool, with_logprobs: bool, token_rewards: bool) -> None:
        self.first = first
        self.prompt = prompt
        self.full = list(prompt)
        self.response: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] | None = [] if with_logprobs else None
        self.token_rewards: list[float] | None = [] if token_rewards else None
        self.reward = 0.0
        self.rows: list[int] = []
        self.last = False

    def observe(self, delta: list[int]) -> None:
        # Observation tokens sit in the response stream, so prompt + response is the full sequence,
        # but the policy did not produce them: loss mask 0, no reward, no logprob.
        self.response += delta
        self.full += delta
        self.mask += [0] * len(delta)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(delta)
        if self.token_rewards is not None:
            self.token_rewards += [0.0] * len(delta)


def merge_step_wise(
    prompt_token_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    loss_masks: Sequence[Sequence[int]] | None = None,
    rewards: Sequence[float] | Sequence[Sequence[float]] | None = None,
    logprobs: Sequence[Sequence[float] | None] | None = None,
    trajectory_ids: Sequence[Any] | None = None,
    is_last_step: Sequence[bool] | None = None,
) -> StepWiseMerge:
    """Merge step-wise rows (one per turn) back into one sample per trajectory where prefixes agree.

    Rows of one trajectory share a trajectory id (or, without ids, run up to a row with
    `is_last_step`). Within a trajectory the first row's observation is the prompt; while each
    next observation starts with everything so far (prompt + response), its new tail is appended
    to the response with loss mask 0, followed by the next action with its own mask. An
    observation that does not start with the sequence so far (the context was rewritten, e.g.
    truncated or summarised) closes the sample and starts a new one, counted as a prefix mismatch.
    A `logprobs` row of None (SkyRL's for a turn with an empty output) gives 0.0 for its tokens.
    """
    n = len(response_ids)
    if len(prompt_token_ids) != n:
        raise ValueError(f"prompt_token_ids: has {len(prompt_token_ids)} rows but response_ids has {n}")
    loss_masks = _column(loss_masks, "loss_masks", n)
    reward_rows = _column(rewards, "rewards", n)
    logprobs = _column(logprobs, "logprobs", n)
    trajectory_ids = _column(trajectory_ids, "trajectory_ids", n)
    is_last_step = _column(is_last_step, "is_last_step", n)
    token_rewards = _reward_form(reward_rows)

    merged: list[_Acc] = []
    mismatches = 0
    for group in trajectory_groups(n, trajectory_ids, is_last_step):
        acc: _Acc | None = None
        for i in group:
            observation = list(prompt_token_ids[i])
            action = list(response_ids[i])
            if acc is not None and observation[: len(acc.full)] == acc.full:
                acc.observe(observation[len(acc.full) :])
            else:
                if acc is not None:
                    mismatches += 1
                acc = _Acc(observation, acc is None, logprobs is not None, bool(token_rewards))
                merged.append(acc)
            acc.rows.append(i)
            acc.response += action
            acc.full += action
            acc.mask += (
                [int(bool(m)) for m in _per_token(loss_masks[i], "loss_masks", i, len(action))]
                if loss_masks is not None
                else [1] * len(action)
            )
            if acc.logprobs is not None and logprobs is not None:
                row_logprobs = logprobs[i]
                if row_logprobs is None:
                    # SkyRL gives None for a turn whose output was empty: no logprobs, like an observation.
                    acc.logprobs += [0.0] * len(action)
                else:
                    acc.logprobs += [float(x) for x in _per_token(row_logprobs, "logprobs", i, len(action))]
            if reward_rows is not None:
                if acc.token_rewards is not None:
                    per_token = _per_token(reward_rows[i], "rewards", i, len(action))
                    acc.token_rewards += [float(x) for x in per_token]
                else:
                    acc.reward += float(reward_rows[i])
            acc.last = bool(is_last_step[i]) if is_last_step is not None else acc.last

    out_rewards: list[float] | list[list[float]] | None = None
    if reward_rows is not None:
        out_rewards = [a.token_rewards or [] for a in merged] if token_rewards else [a.reward for a in merged]
    return StepWiseMerge(
        prompt_token_ids=[a.prompt for a in merged],
        response_ids=[a.response for a in merged],
        loss_masks=[a.mask for a in merged],
        rewards=out_rewards,
        logprobs=[a.logprobs or [] for a in merged] if logprobs is not None else None,
        trajectory_ids=[trajectory_ids[a.rows[0]] for a in merged] if trajectory_ids is not None else None,
        is_last_step=[a.last for a in merged],
        starts_trajectory=[a.first for a in merged],
        rows=[a.rows for a in merged],
        stats=MergeStats(samples_before=n, samples_after=len(merged), prefix_mismatches=mismatches),
    )

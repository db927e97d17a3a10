"""What the viewer's pages show: one step, one group, one completion, one prompt at one step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# Stop reasons that mean the completion hit its token budget: one list for the sink's summaries
# and the viewer's pages, so a merged overview counts what a computed one does.
from ..sinks._parquet_summary import TRUNCATED

__all__ = [
    "ADVANTAGE_ZERO",
    "HISTORY_DIFFS",
    "HISTORY_VERSIONS",
    "TRUNCATED",
    "Completion",
    "GroupRow",
    "PromptStep",
    "StepFilter",
    "StepRow",
    "RewardStats",
    "prompt_steps",
    "reward_stats",
    "split_order",
]

# Past this magnitude a square, or a sum of a few values, may pass a float's range (OverflowError
# in math.fsum): such rewards are scaled down first.
_LARGE = 1e150

# A prompt's history shows the best and the worst completion of its latest HISTORY_VERSIONS
# policy versions, and a diff of its latest HISTORY_DIFFS pairs of consecutive steps; older
# versions are counted only. Each text shown is read from the files, so a history costs the same
# whether the run holds a prompt at 40 steps or at 400.
HISTORY_VERSIONS = 20
HISTORY_DIFFS = 20


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of one split, as the overview shows it."""

    split: str
    step: int
    samples: int
    reward_mean: float | None
    reward_std: float | None
    groups: int
    zero_signal: int
    mean_spread: float | None
    truncated: float | None
    length_mean: float | None
    lag_mean: float | None
    lag_max: int | None


@dataclass(frozen=True, slots=True)
class GroupRow:
    """One prompt group of a step: its size, reward mean and spread (population standard
    deviation), mean advantage and truncated completions."""

    group: str
    prompt: str | None
    samples: int
    reward_mean: float | None
    spread: float | None
    truncated: int
    first_id: str
    advantage_mean: float | None


@dataclass(frozen=True, slots=True)
class Completion:
    """One record with its texts: the prompt (the messages before the first assistant turn, the
    first `prompt_turns` of `messages`) and the completion (every turn after them), as plain text."""

    id: str
    step: int
    split: str
    group: str | None
    prompt_id: str | None
    reward: float | None
    advantage: float | None
    policy_version: int | None
    stop_reason: str | None
    length: int | None
    has_tokens: bool
    prompt: str
    text: str
    messages: list[Any]
    metadata: dict[str, Any]
    loaded: bool = True
    prompt_turns: int = 0


@dataclass(frozen=True, slots=True)
class PromptStep:
    """One prompt at one step: its groups (a prompt may be sampled in several groups at one
    step), how many completions, their rewards and policy versions."""

    step: int
    groups: tuple[str, ...]
    samples: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    spread: float | None
    versions: str


class RewardStats(NamedTuple):
    """The mean and the spread (population standard deviation) of some rewards; None for none."""

    mean: float | None
    spread: float | None


def reward_stats(rewards: Sequence[float]) -> RewardStats:
    """The mean and spread of `rewards`, as every page computes them: equal rewards have spread 0
    (not a rounding error's worth above it); any value an archive holds gives numbers, never an
    error (one that is not finite makes them NaN or infinite, shown as "—")."""
    if not rewards:
        return RewardStats(None, None)
    n = len(rewards)
    if not all(math.isfinite(r) for r in rewards):
        return RewardStats(sum(rewards) / n, math.nan)  # no fsum: it raises on inf - inf
    if len(set(rewards)) == 1:
        return RewardStats(rewards[0], 0.0)
    scale = max(abs(r) for r in rewards)
    scale = scale if scale > _LARGE else 1.0
    scaled = [r / scale for r in rewards] if scale != 1.0 else rewards
    mean = math.fsum(scaled) / n
    spread = math.sqrt(math.fsum((r - mean) ** 2 for r in scaled) / n)
    return RewardStats(mean * scale, spread * scale)


def prompt_steps(completions: Sequence[Completion]) -> list[PromptStep]:
    """One prompt's completions summed up per step (from the index's values: no text needed)."""
    by_step: dict[int, list[Completion]] = {}
    for c in completions:
        by_step.setdefault(c.step, []).append(c)
    out = []
    for step, items in sorted(by_step.items()):
        rewards = [c.reward for c in items if c.reward is not None]
        mean, spread = reward_stats(rewards)
        versions = sorted({c.policy_version for c in items if c.policy_version is not None})
        out.append(
            PromptStep(
                step=step,
                groups=tuple(sorted({c.group for c in items if c.group is not None})),
                samples=len(items),
                reward_mean=mean,
                reward_min=min(rewards, default=None),
                reward_max=max(rewards, default=None),
                spread=spread,
                versions=", ".join(str(v) for v in versions),
            )
        )
    return out


# A group's mean advantage within this of zero counts as zero: GRPO's is zero up to rounding.
ADVANTAGE_ZERO = 1e-6


@dataclass(frozen=True, slots=True)
class StepFilter:
    """Which of a step's groups its page lists: only zero-spread ones, only those with a truncated
    completion, only those whose mean advantage is positive ("pos") or negative ("neg"), only
    those where some completion called a tool (or got a tool's result)."""

    zero: bool = False
    truncated: bool = False
    advantage: str = ""
    tools: bool = False

    def __bool__(self) -> bool:
        return self.zero or self.truncated or bool(self.advantage) or self.tools

    def keeps(self, group: GroupRow) -> bool:
        """Whether `group` passes the filters that the index answers (all but `tools`)."""
        if self.zero and group.spread != 0:
            return False
        if self.truncated and not group.truncated:
            return False
        mean = group.advantage_mean
        if self.advantage == "pos" and not (mean is not None and mean > ADVANTAGE_ZERO):
            return False
        return not (self.advantage == "neg" and not (mean is not None and mean < -ADVANTAGE_ZERO))

    def query(self) -> dict[str, str]:
        """The filters as a page's query parameters."""
        out = {"zero": "1" if self.zero else "", "truncated": "1" if self.truncated else ""}
        out.update(adv=self.advantage, tools="1" if self.tools else "")
        return {k: v for k, v in out.items() if v}


def split_order(splits: Sequence[str]) -> list[str]:
    """Splits as every page lists them: train first, then the others by name."""
    return sorted(set(splits), key=lambda s: (s != "train", s))

"""The tests' oracle for a step's group summary, written from docs/health.md's definitions."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping

from asynctrace._records.groups import GroupSummary


def summarize_groups(rewards: Mapping[Hashable, Iterable[float]]) -> GroupSummary:
    """Summarise a step's groups from each group's finite rewards, by brute force."""
    spreads: list[float] = []
    for values in rewards.values():
        xs = [x for x in values if math.isfinite(x)]
        if not xs:
            continue
        mean = sum(xs) / len(xs)
        spreads.append(math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)))
    zero = sum(1 for s in spreads if s == 0.0)
    return GroupSummary(len(spreads), zero, sum(spreads) / len(spreads) if spreads else 0.0)

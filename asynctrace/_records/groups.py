"""Prompt groups: the samples of one prompt that were scored against each other (GRPO-style).

One place decides which group a sample belongs to, so the group sampler, the group metrics and
the watch list agree: by default the sample's metadata `group_uid`, else `prompt_index`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["DEFAULT_GROUP_KEYS", "GroupKey", "GroupSummary", "group_of", "payload_group", "population_spread"]

DEFAULT_GROUP_KEYS: tuple[str, ...] = ("group_uid", "prompt_index")

# Metadata key names tried in order, or a function of the metadata returning the group (None: no group).
GroupKey = str | Sequence[str] | Callable[[Mapping[str, Any]], Hashable | None]


def group_of(metadata: Mapping[str, Any], key: GroupKey = DEFAULT_GROUP_KEYS) -> Hashable | None:
    """The group a sample belongs to, from its metadata; None when it names none."""
    if callable(key):
        return key(metadata)
    names = (key,) if isinstance(key, str) else key
    for name in names:
        value = metadata.get(name)
        if value is not None:
            # Lists (JSON arrays) cannot be dict keys; a tuple of the same items names the same group.
            return tuple(value) if isinstance(value, list) else value
    return None


def payload_group(payload: bytes, key: GroupKey | None) -> Hashable | None:
    """The group of an encoded sample under `key` (None without a key or a group)."""
    if key is None:
        return None
    data = orjson.loads(payload)
    metadata = data.get("metadata") if isinstance(data, dict) else None
    return group_of(metadata, key) if isinstance(metadata, dict) else None


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """The groups seen in one step: how many, how many with zero reward spread, the mean spread.

    Spread is the population standard deviation of a group's rewards (what GRPO divides the
    advantage by): a group whose samples all got the same reward has spread 0 and teaches the
    policy nothing.
    """

    groups: int
    zero_spread: int
    mean_spread: float

    @classmethod
    def of(cls, spreads: Sequence[float]) -> GroupSummary:
        """The summary of a step whose groups have these spreads."""
        zero = sum(1 for s in spreads if s == 0.0)
        return cls(len(spreads), zero, sum(spreads) / len(spreads) if spreads else 0.0)


def population_spread(values: Sequence[float]) -> float:
    """The population standard deviation of a group's rewards (0.0 for none), summed exactly."""
    if not values:
        return 0.0
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((x - mean) ** 2 for x in values) / len(values))

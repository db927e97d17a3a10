"""Prompt groups: the samples of one prompt that were scored against each other (GRPO-style).

One place decides which group a sample belongs to, so the group sampler, the group metrics and
the watch list agree: by default the sample's metadata `group_uid`, else `prompt_index`. It also
decides which values can name a group: a value that cannot be a dict key (a dict, a list holding
one) raises `GroupKeyError`, which validation turns into a `RecordError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from .._security import describe
from .coerce import json_form

__all__ = [
    "DEFAULT_GROUP_KEYS",
    "GroupKey",
    "GroupKeyError",
    "GroupSummary",
    "group_of",
    "payload_group",
    "population_spread",
]

DEFAULT_GROUP_KEYS: tuple[str, ...] = ("group_uid", "prompt_index")

# Metadata key names tried in order, or a function of the metadata returning the group (None: no group).
GroupKey = str | Sequence[str] | Callable[[Mapping[str, Any]], Hashable | None]


class GroupKeyError(TypeError):
    """A sample's group value cannot name a group; `path` is the metadata field it was read from."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


def _frozen(value: Any) -> Any:
    # Lists (JSON arrays) cannot be dict keys; a tuple of the same items names the same group,
    # at any depth, so a key reads the same before encoding and back from the payload.
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def group_value(value: Any, path: str) -> Hashable:
    """`value` as a group name; `GroupKeyError` naming `path` when it cannot be one."""
    if type(value) is str or type(value) is int:
        return value
    kind = type(value).__name__
    try:
        # The name as the payload will hold it: a 0-d tensor is hashed by its identity, an enum
        # member differs from its value, so read as they are, every sample of a group given
        # `batch["index"][i]` would be a group of its own here and one group read back.
        value = _frozen(json_form(value))
        hash(value)
    except TypeError:
        raise GroupKeyError(
            f"a {kind} cannot name a prompt group; give a str, an int or a list of them", path
        ) from None
    return value  # type: ignore[no-any-return]


def group_of(metadata: Mapping[str, Any], key: GroupKey = DEFAULT_GROUP_KEYS) -> Hashable | None:
    """The group a sample belongs to, from its metadata; None when it names none.

    Raises `GroupKeyError` (a `TypeError`) when the value found cannot name a group, or when a
    key function fails.
    """
    if callable(key):
        try:
            value = key(metadata)
        except Exception as exc:
            raise GroupKeyError(f"the group key function failed: {describe(exc)}", "metadata") from exc
        return None if value is None else group_value(value, "metadata")
    names = (key,) if isinstance(key, str) else key
    for name in names:
        value = metadata.get(name)
        if value is not None:
            return group_value(value, f"metadata.{name}")
    return None


def payload_group(payload: bytes, key: GroupKey | None) -> Hashable | None:
    """The group of an encoded sample under `key` (None without a key or a group).

    The session refuses a sample whose group cannot be named before it is encoded; one that
    reaches a selection all the same (another process's payload) is a group of its own.
    """
    if key is None:
        return None
    data = orjson.loads(payload)
    metadata = data.get("metadata") if isinstance(data, dict) else None
    if not isinstance(metadata, dict):
        return None
    try:
        return group_of(metadata, key)
    except GroupKeyError:
        return None


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

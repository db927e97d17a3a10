"""The watch list: prompts whose samples are logged at every step they occur in, outside the cap."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._checks import check_int
from .._records.encode import sample_from
from .._records.groups import GroupKey, group_of, group_value
from .._records.types import Sample
from .._security import shown

__all__ = ["DEFAULT_WATCH_KEYS", "Watch", "WatchCounter"]

DEFAULT_WATCH_KEYS: tuple[str, ...] = ("prompt_id", "group_uid", "prompt_index")

# Steps a watch list keeps counting per split before the oldest is forgotten.
_WINDOW = 4096


@dataclass(frozen=True)
class Watch:
    """Prompts to follow across steps: their samples bypass the session's cap and sampler.

    A sample is watched when its prompt id (read from its metadata with `key`: by default
    ``prompt_id``, else ``group_uid``, else ``prompt_index``) is in `ids`, or when
    `predicate(sample)` is true. At most `max_per_step` watched samples per (split, step) take
    this way, the first to arrive; later ones go on to the cap like any other sample.
    """

    ids: Collection[Hashable] = ()
    key: GroupKey = DEFAULT_WATCH_KEYS
    predicate: Callable[[Sample], bool] | None = None
    max_per_step: int = 16
    _ids: frozenset[Hashable] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.ids, (str, bytes)) or not isinstance(self.ids, Collection):
            raise ValueError(f"Watch ids must be a collection of prompt ids, got {shown(self.ids)}")
        try:
            # Read as a sample's prompt id is read (`group_value`), so that an id given as an
            # enum member, a tensor or a list finds the samples that name it.
            ids = frozenset(group_value(i, "ids") for i in self.ids)
        except TypeError:
            raise ValueError(f"Watch ids must be hashable (str, int, tuple), got {shown(self.ids)}") from None
        if self.predicate is not None and not callable(self.predicate):
            raise ValueError(f"Watch predicate must be callable, got {shown(self.predicate)}")
        if not ids and self.predicate is None:
            raise ValueError("Watch needs ids, a predicate, or both")
        check_int("max_per_step", self.max_per_step, minimum=1)
        object.__setattr__(self, "_ids", ids)

    def matches(self, obj: Any) -> bool:
        """Whether a sample (a `Sample` or a mapping) is watched."""
        if self._ids:
            metadata = obj.metadata if isinstance(obj, Sample) else obj.get("metadata", obj)
            if isinstance(metadata, Mapping):
                try:
                    if group_of(metadata, self.key) in self._ids:
                        return True
                except TypeError:  # an unhashable id names no watched prompt
                    pass
        return self.predicate is not None and bool(self.predicate(sample_from(obj)))


class WatchCounter:
    """Splits a call's samples into the watched ones that still fit this step's watch cap and
    the rest; thread-safe."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = {}

    def split(self, items: Sequence[Any], split: str, step: int) -> tuple[list[int], list[int]]:
        """The positions in `items` of the watched samples within this step's watch cap, and of
        all the others, each in call order."""
        match = self.watch.matches
        hits = [i for i, obj in enumerate(items) if match(obj)]
        if not hits:
            return [], list(range(len(items)))
        take = hits[: self.take(split, step, len(hits))]
        chosen = set(take)
        return take, [i for i in range(len(items)) if i not in chosen]

    def take(self, split: str, step: int, n: int) -> int:
        """Take places of the step's watch cap for `n` watched samples, in order: how many of
        them (the first ones) still fit. Where several processes found watched samples of one
        step, whoever writes takes their places process after process."""
        if n <= 0:
            return 0
        with self._lock:
            key = (split, step)
            used = self._counts.get(key, 0)
            took = min(n, max(0, self.watch.max_per_step - used))
            if took:
                self._counts[key] = used + took
                if len(self._counts) > _WINDOW:
                    del self._counts[min(self._counts, key=lambda k: k[1])]
        return took

    def give_back(self, split: str, step: int, n: int) -> None:
        """Return `n` places of a step's watch cap that a call which then raised had taken."""
        if n:
            with self._lock:
                key = (split, step)
                if key in self._counts:
                    self._counts[key] = max(0, self._counts[key] - n)

"""The collector's side of local selection: each client's part of a step, merged when it closes.

A step closes by the session's own rules (docs/distributed.md, *Steps, stragglers and
lateness*); its parts are then merged with the sampler's `merge` (`_select/parts.py`), and a part for
a closed step is late. Watched samples (part `WATCHED`) spend the session's one watch budget here,
the first to arrive: those within it go on to the session at once, past every selection; the
rest are samples like any other, a part of the collector's own. Not thread-safe: the collector
holds its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .._fronts.selection import WATCHED
from .._records.groups import GroupKey, payload_group
from .._select.base import Entry, Sampler
from .._select.parts import PartSteps, Row, group_key_of, merge_parts
from .._select.watch import Watch, WatchCounter
from .._select.window import Step, StepWindow

__all__ = ["ClientPlan", "Merged", "StepMerge"]


class Merged(NamedTuple):
    """One step's samples for the session, encoded: a merged step, watched samples within the
    budget, or a plain client's; the wire format of `TraceCollector.ingest_encoded`."""

    split: str
    step: int
    payloads: list[bytes]


@dataclass(frozen=True, slots=True)
class ClientPlan:
    """What the collector tells a new client (`TraceCollector.selection`): the cap, sampler and
    watch list to select its part with (`k` None: ship every sample, the session selects), its
    part number, and the keys the session's group samplers read groups by (its cap's, its
    tiers'), which the client validates for."""

    k: int | None
    sampler: Sampler | None
    part: int
    watch: Watch | None
    group_keys: tuple[GroupKey, ...]


class _Parts:
    __slots__ = ("by_part", "n")

    def __init__(self) -> None:
        self.by_part: dict[int, list[tuple[Entry, bytes]]] = {}
        self.n = 0


class StepMerge:
    """Open steps' parts on the collector, with counts: `held` (waiting for their step to close),
    `capped` (merged away) and `late` (a part of a step already merged)."""

    def __init__(
        self,
        k: int,
        sampler: Sampler,
        *,
        max_open_steps: int,
        step_timeout: float | None,
        watch: Watch | None = None,
    ) -> None:
        self.k = k
        self.sampler = sampler
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        self._group_key = group_key_of(sampler)
        # Each open step's parts; which steps are open, closed or late is the window's.
        self._open: dict[Step, _Parts] = {}
        self._window = StepWindow(max_open_steps, step_timeout)
        # The one watch budget of the job's steps, and the watched samples past it: a part of
        # their own (part 0, the collector's), selected as a client selects its samples.
        self._watch = WatchCounter(watch) if watch is not None else None
        self._beyond = PartSteps(sampler, k, 0, reopen=True)
        self.held = 0
        self.capped = 0
        self.late = 0
        self.closed = False  # set by the collector once every step was handed on for good

    def add(
        self, split: str, step: int, part: int, payloads: Sequence[bytes], rows: Sequence[Row], now: float
    ) -> list[Merged]:
        """Take candidates of one part (or watched samples: `WATCHED`); returns the steps this
        closed, merged, then the watched samples within the step's watch budget, as they are."""
        if len(rows) != len(payloads):
            raise ValueError(f"a part needs one row per payload, got {len(rows)} for {len(payloads)}")
        watched: list[Merged] = []
        if part == WATCHED:
            n = self._watch.take(split, step, len(payloads)) if self._watch is not None else 0
            if n:
                # Past every selection, never late, opening and closing no step.
                watched.append(Merged(split, step, list(payloads[:n])))
                payloads, rows = payloads[n:], rows[n:]
                if not payloads:
                    return watched
        if self._window.is_late(split, step):
            self.late += len(payloads)
            return watched
        merged = self._merge(self._window.arrive(split, step, now))
        parts = self._open.get((split, step))
        if parts is None:
            parts = self._open[(split, step)] = _Parts()
        mine = parts.by_part.setdefault(part, [])
        if part == WATCHED:
            # Watched beyond the budget: selected in the collector's own part (its place in the
            # part order is where its first sample arrived; `_merge` fills it in).
            before = self._beyond.held
            scored = [(p, score) for p, (_, score, _) in zip(payloads, rows, strict=True)]
            self._beyond.offer(split, step, scored, now)
            self.held += self._beyond.held - before
            self.capped += len(payloads) - (self._beyond.held - before)
            return merged + watched
        for payload, (seq, score, key) in zip(payloads, rows, strict=True):
            group = payload_group(payload, self._group_key)
            mine.append((Entry(score, seq, key=key, group=group), payload))
        parts.n += len(payloads)
        self.held += len(payloads)
        return merged + watched

    def close_idle(self, now: float) -> list[Merged]:
        """Merge the steps that got no part for `step_timeout` seconds."""
        return self._merge(self._window.close_idle(now))

    def close_all(self) -> list[Merged]:
        """Merge every open step (flush, finish)."""
        return self._merge(self._window.close_all())

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to merge; None when no step is open."""
        return self._window.next_due(now)

    def _merge(self, keys: list[Step]) -> list[Merged]:
        """Merge the parts of the steps the window closed, oldest first."""
        out: list[Merged] = []
        for split, step in keys:
            parts = self._open.pop((split, step))
            beyond = self._beyond.end_keys([(split, step)]) if (split, step) in self._beyond.open else []
            if beyond:
                parts.by_part[WATCHED] = beyond[0][1].rows()
                parts.n += len(parts.by_part[WATCHED])
            # Parts in the order their first candidates arrived here (part numbers follow the
            # order clients started, which says nothing of the step): `first` keeps the first
            # arrivals, and ties of a score or key go to the earlier part, as in one process.
            ordered = list(parts.by_part.values())
            chosen = merge_parts(self.sampler, split, step, self.k, ordered)
            self.held -= parts.n
            self.capped += parts.n - len(chosen)
            out.append(Merged(split, step, chosen))
        return out

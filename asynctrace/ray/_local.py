"""Selection inside a `TraceClient`: keep a step's `O(k)` candidates, ship only those.

Each client is a part of every step (`_select/parts.py`), with the part number the collector gave it;
a step closed here and seen again is a new round, a part of its own, so closing early costs
bytes, never exactness (docs/distributed.md). Watched samples (the collector session's watch
list) pass this selection by and ship at once, marked `WATCHED`; the collector spends the one
watch budget. Not thread-safe: the client holds its lock (the watch counter has its own).
"""

from __future__ import annotations

from collections.abc import Sequence

from .._select.base import Entry, Sampler
from .._select.parts import PartStep, PartSteps, Row
from .._select.watch import Watch, WatchCounter
from .._select.window import Step, StepWindow

__all__ = ["PLAIN", "WATCHED", "LocalSelection", "Released"]


# (split, step, part, encoded candidates, their rows) in arrival order: what one part ships, and
# the wire format of `TraceCollector.ingest_parts`. Two part numbers are not parts:
PLAIN = -1  # a client that does not select: the collector's session takes them as they are
WATCHED = -2  # samples the client found watched, within its own watch budget, past its selection
Released = tuple[str, int, int, list[bytes], list[Row]]


class LocalSelection:
    """Per-(split, step) selections of one client, closed by a newer step, idle time, or on
    demand, by the rules of docs/distributed.md, *Selection on the actor*."""

    def __init__(
        self,
        k: int,
        sampler: Sampler,
        part: int,
        *,
        max_open_steps: int,
        step_timeout: float | None,
        watch: Watch | None = None,
    ) -> None:
        self.sampler = sampler
        # The collector session's watch list: a client never ships more than `max_per_step` of a
        # step as watched (more could never pass; they go to the selection instead).
        self.watch = WatchCounter(watch) if watch is not None else None
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        # The engine's selection of one part; a step closed here and seen again is a new round,
        # so the window that says when steps close never calls one late.
        self._steps = PartSteps(sampler, k, part, reopen=True)
        self._window = StepWindow(max_open_steps, step_timeout, reopen=True)

    @property
    def held(self) -> int:
        """Candidates kept for steps still open."""
        return self._steps.held

    @property
    def held_bytes(self) -> int:
        return self._steps.held_bytes

    def offer(
        self,
        split: str,
        step: int,
        encoded: Sequence[tuple[bytes, float | None]],
        now: float,
        watched: Sequence[tuple[bytes, float | None]] = (),
    ) -> tuple[int, int, list[Released]]:
        """Offer one call's candidates in order, and its `watched` samples (found by `watch`),
        which pass the selection by. Returns how many of them are kept for now, how many this
        call refused or evicted, and what to ship: the steps this offer closed, the watched
        samples, and the picks of a sampler that holds nothing, which it passes on at once."""
        released: list[Released] = []
        kept = capped = 0
        if watched:
            # Shipped at once: a watched sample never opens or closes a step of any selection.
            rows: list[Row] = [(i, score, None) for i, (_, score) in enumerate(watched)]
            released.append((split, step, WATCHED, [p for p, _ in watched], rows))
        if encoded:
            released[:0] = _released(self._steps.end_keys(self._window.arrive(split, step, now)))
            kept, capped, _ = self._steps.offer(split, step, encoded, now)
            passed = [] if self.sampler.holds else self._steps.take((split, step))
            if passed:
                part = self._steps.open[(split, step)].part
                released.append((split, step, part, *_unzip(passed)))
        return kept + len(watched), capped, released

    def end_step(self, step: int, split: str | None) -> list[Released]:
        """Close every open step up to `step` (of `split`, or of every split)."""
        ended = self._steps.end(step, split)
        self._window.close([key for key, _ in ended])
        return _released(ended)

    def close_idle(self, now: float) -> list[Released]:
        """Close steps that saw no sample for `step_timeout` seconds."""
        return _released(self._steps.end_keys(self._window.close_idle(now)))

    def close_all(self) -> list[Released]:
        """Close every open step (flush, close)."""
        self._window.close_all()
        return _released(self._steps.end(None, None))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when no step is open."""
        return self._window.next_due(now)

    def discard(self) -> int:
        """Forget every open step; returns how many held candidates that drops."""
        self._window.close_all()
        return sum(len(opened.kept) for _, opened in self._steps.end(None, None))


def _released(ended: list[tuple[Step, PartStep]]) -> list[Released]:
    """What closed steps ship: their kept candidates, with rows, from those that kept any."""
    return [(split, step, o.part, *_unzip(o.rows())) for (split, step), o in ended if o.kept]


def _unzip(rows: list[tuple[Entry, bytes]]) -> tuple[list[bytes], list[Row]]:
    return [p for _, p in rows], [(e.seq, e.score, e.key) for e, _ in rows]

"""Selection inside a `TraceClient`: keep a step's `O(k)` candidates, ship only those.

Each client is a part of every step (`_select/parts.py`), with the part number the collector gave it;
a step closed here and seen again is a new round, a part of its own, so closing early costs
bytes, never exactness (docs/distributed.md). Not thread-safe: the client holds its lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .._select.base import Entry, Sampler
from .._select.parts import PartStep, PartSteps, Row

__all__ = ["LocalSelection", "Released", "Step", "idle_steps", "next_due"]

Step = tuple[str, int]  # (split, step)

# (split, step, part, encoded candidates, their rows) in arrival order: what one part ships, and
# the wire format of `TraceCollector.ingest_parts`.
Released = tuple[str, int, int, list[bytes], list[Row]]


class LocalSelection:
    """Per-(split, step) selections of one client, closed by a newer step, idle time, or on
    demand, by the rules of docs/distributed.md, *Selection on the actor*."""

    def __init__(
        self, k: int, sampler: Sampler, part: int, *, max_open_steps: int, step_timeout: float | None
    ) -> None:
        self.sampler = sampler
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        # The engine's selection of one part; a step closed here and seen again is a new round.
        self._steps = PartSteps(sampler, k, part, reopen=True)

    @property
    def held(self) -> int:
        """Candidates kept for steps still open."""
        return self._steps.held

    @property
    def held_bytes(self) -> int:
        return self._steps.held_bytes

    def offer(
        self, split: str, step: int, encoded: Sequence[tuple[bytes, float | None]], now: float
    ) -> tuple[int, int, list[Released]]:
        """Offer one call's candidates in order. Returns how many of them are kept for now, how
        many this call refused or evicted, and what to ship: the steps this offer closed, and the
        picks of a sampler that holds nothing, which it passes on at once."""
        released = self._close_older(split, step)
        kept, capped, _ = self._steps.offer(split, step, encoded, now)
        passed = [] if self.sampler.holds else self._steps.take((split, step))
        if passed:
            part = self._steps.open[(split, step)].part
            released.append((split, step, part, *_unzip(passed)))
        return kept, capped, released

    def _close_older(self, split: str, step: int) -> list[Released]:
        upto = step - self.max_open_steps - 1
        if upto < 0:
            return []
        return _released(
            self._steps.end_keys([k for k in self._steps.open if k[0] == split and k[1] <= upto])
        )

    def end_step(self, step: int, split: str | None) -> list[Released]:
        """Close every open step up to `step` (of `split`, or of every split)."""
        return _released(self._steps.end(step, split))

    def close_idle(self, now: float) -> list[Released]:
        """Close steps that saw no sample for `step_timeout` seconds."""
        return _released(self._steps.end_keys(idle_steps(self._steps.open, now, self.step_timeout)))

    def close_all(self) -> list[Released]:
        """Close every open step (flush, close)."""
        return _released(self._steps.end(None, None))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when no step is open."""
        return next_due(self._steps.open, now, self.step_timeout)

    def discard(self) -> int:
        """Forget every open step; returns how many held candidates that drops."""
        return sum(len(opened.kept) for _, opened in self._steps.end(None, None))


class _Open(Protocol):
    last_seen: float  # when the step last got samples (or parts)


def idle_steps(opened: Mapping[Step, _Open], now: float, timeout: float | None) -> list[Step]:
    """The open steps that got nothing for `timeout` seconds (none without a timeout): the idle
    rule a client's selection and the collector's merge share."""
    if timeout is None:
        return []
    return [key for key, o in opened.items() if now - o.last_seen >= timeout]


def next_due(opened: Mapping[Step, _Open], now: float, timeout: float | None) -> float | None:
    """Seconds until `idle_steps` has a step; None when none is open or there is no timeout."""
    if timeout is None or not opened:
        return None
    return max(0.0, min(o.last_seen for o in opened.values()) + timeout - now)


def _released(ended: list[tuple[Step, PartStep]]) -> list[Released]:
    """What closed steps ship: their kept candidates, with rows, from those that kept any."""
    return [(split, step, o.part, *_unzip(o.rows())) for (split, step), o in ended if o.kept]


def _unzip(rows: list[tuple[Entry, bytes]]) -> tuple[list[bytes], list[Row]]:
    return [p for _, p in rows], [(e.seq, e.score, e.key) for e, _ in rows]

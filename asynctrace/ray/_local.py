"""Selection inside a `TraceClient`: keep a step's `O(k)` candidates, ship only those.

Each client is a part of every step (see `_parts.py`): it selects its own samples with the
collector's sampler (`Sampler.new_part_step`, with the part number the collector gave it) and
ships what its selection kept, with each entry's score, sequence number and key; the collector
merges the parts with `Sampler.merge`, which chooses exactly what one selection offered every
part's samples would keep. A step that a client closed and then sees again starts a new round,
a part of its own with its own random stream, so closing early costs bytes, never exactness.
Not thread-safe: the client holds its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._parts import PartStep, PartSteps, Row
from .._sampling import Entry, Sampler

__all__ = ["LocalSelection", "Released"]

# (split, step, part, encoded candidates, their rows) in arrival order: what one part ships, and
# the wire format of `TraceCollector.ingest_parts`.
Released = tuple[str, int, int, list[bytes], list[Row]]


class LocalSelection:
    """Per-(split, step) selections of one client, closed by step, idle time, or on demand.

    A step closes when the client offers a sample of a step more than `max_open_steps` newer
    (of the same split), after `step_timeout` seconds without samples for it, by `end_step`,
    and by `close_all` (flush and close).
    """

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
    ) -> tuple[Released | None, int, int, list[Released]]:
        """Offer one call's candidates in order.

        Returns (what to ship now: a sampler that holds nothing passes its picks on at once;
        how many this call refused or evicted; how many of this call's are kept for now;
        steps this offer closed).
        """
        released = self._close_older(split, step)
        kept, capped, _ = self._steps.offer(split, step, encoded, now)
        if self.sampler.holds:
            return None, capped, kept, released
        # What a sampler that holds nothing kept is this call's picks alone: ship them now.
        passed = self._steps.take((split, step))
        part = self._steps.open[(split, step)].part
        return (split, step, part, *_unzip(passed)) if passed else None, capped, kept, released

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
        if self.step_timeout is None:
            return []
        limit = self.step_timeout
        return _released(
            self._steps.end_keys([k for k, o in self._steps.open.items() if now - o.last_seen >= limit])
        )

    def close_all(self) -> list[Released]:
        """Close every open step (flush, close)."""
        return _released(self._steps.end(None, None))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when no step is open."""
        if self.step_timeout is None or not self._steps.open:
            return None
        oldest = min(o.last_seen for o in self._steps.open.values())
        return max(0.0, oldest + self.step_timeout - now)

    def discard(self) -> int:
        """Forget every open step; returns how many held candidates that drops."""
        return sum(len(opened.kept) for _, opened in self._steps.end(None, None))


def _released(ended: list[tuple[tuple[str, int], PartStep]]) -> list[Released]:
    """What closed steps ship: their kept candidates, with rows, from those that kept any."""
    return [(split, step, o.part, *_unzip(o.rows())) for (split, step), o in ended if o.kept]


def _unzip(rows: list[tuple[Entry, bytes]]) -> tuple[list[bytes], list[Row]]:
    return [p for _, p in rows], [(e.seq, e.score, e.key) for e, _ in rows]

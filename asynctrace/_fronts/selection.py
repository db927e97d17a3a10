"""This process's part of each step's selection: what a rank or a Ray actor keeps of a step and
hands on, so that whoever writes merges the parts into what one process would keep.

Each part keeps at most `k` candidates of every (split, step) with its own stream of the
sampler (`_select/parts.py`) and hands on only those, each with its row (sequence number, score,
key) for the merge. A rank and an actor differ only in when (docs/distributed.md):

- a rank holds everything until the job's collective `end_step` ends the step, and a sample for
  a step ended here is late; its watched samples stay with their step, for the writing rank to
  grant them places (`grant_watched`);
- an actor *streams*: its steps also close by the window's rules (a newer step, idle time), a
  step closed here and seen again is a new round, a part of its own (closing early costs bytes,
  never exactness), its watched samples go on at once, marked `WATCHED` (the collector spends
  the one watch budget), and a sampler that holds nothing passes its picks on at once.

Not thread-safe: the front's lock covers it (the watch counter has its own).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from .._select.base import Entry, Sampler
from .._select.parts import PartStep, PartSteps, Row
from .._select.watch import Watch, WatchCounter
from .._select.window import Step, StepWindow

__all__ = ["PLAIN", "WATCHED", "Encoded", "Ended", "Offered", "Part", "PartSelection", "parts_of"]

# Two part numbers are not parts of a selection:
PLAIN = -1  # a client that does not select: the collector's session takes them as they are
WATCHED = -2  # samples an actor found watched, within its own watch budget, past its selection

Encoded = tuple[bytes, float | None]  # a sample's payload and its ranking score
Ended = list[tuple[Step, PartStep]]  # steps ended here, each with this part's selection of it


class Part(NamedTuple):
    """One part's samples of one (split, step) going on, in arrival order, each with its row for
    the merge (none for `PLAIN`): what a client ships, `TraceCollector.ingest_parts`' wire format."""

    split: str
    step: int
    part: int
    payloads: list[bytes]
    rows: list[Row]


class Offered(NamedTuple):
    """What one call's offer did: samples kept for now (watched ones too), samples it refused or
    evicted, and what goes on at once (a streaming part's)."""

    kept: int
    capped: int
    released: list[Part]


class PartSelection:
    """Per-(split, step) selections of one part: a rank's (steps end by `end`), or with `window`
    an actor's, which streams (see the module's text)."""

    def __init__(
        self,
        k: int,
        sampler: Sampler,
        part: int,
        *,
        watch: Watch | None = None,
        window: StepWindow | None = None,
    ) -> None:
        self.sampler = sampler
        # The watch list's places in each step that this part may fill (where the parts meet,
        # whoever writes grants them over every part).
        self.watch = WatchCounter(watch) if watch is not None else None
        self._window = window
        self._steps = PartSteps(sampler, k, part, reopen=window is not None)

    @classmethod
    def streaming(
        cls,
        k: int,
        sampler: Sampler,
        part: int,
        *,
        max_open_steps: int,
        step_timeout: float | None,
        watch: Watch | None = None,
    ) -> PartSelection:
        """An actor's part: steps close by the window's rules too, and a closed one reopens."""
        window = StepWindow(max_open_steps, step_timeout, reopen=True)
        return cls(k, sampler, part, watch=watch, window=window)

    @property
    def k(self) -> int:
        return self._steps.k

    @property
    def held(self) -> int:
        """Samples kept for steps still open (watched ones a rank holds too)."""
        return self._steps.held

    @property
    def held_bytes(self) -> int:
        return self._steps.held_bytes

    @property
    def open_steps(self) -> int:
        return len(self._steps.open)

    def is_late(self, split: str, step: int) -> bool:
        """Whether `step` of `split` ended here for good (a rank's), so its samples are late."""
        return self._steps.is_ended(split, step)

    def offer(
        self,
        split: str,
        step: int,
        encoded: Sequence[Encoded],
        now: float = 0.0,
        watched: Collection[int] = (),
    ) -> Offered:
        """Offer one call's samples in order; those at the positions in `watched` (the watch list
        passed them by) skip the selection. A streaming part releases the steps this offer
        closed, the watched samples, and a sampler's picks that it does not hold."""
        window = self._window
        if window is None:
            kept, capped, _ = self._steps.offer(split, step, encoded, now, watched)
            return Offered(kept, capped, [])
        released: list[Part] = []
        marked: list[Encoded] = []
        if watched:
            marked = [e for i, e in enumerate(encoded) if i in watched]
            encoded = [e for i, e in enumerate(encoded) if i not in watched]
            # Shipped at once: a watched sample never opens or closes a step of any selection.
            rows: list[Row] = [(i, score, None) for i, (_, score) in enumerate(marked)]
            released.append(Part(split, step, WATCHED, [p for p, _ in marked], rows))
        kept = capped = 0
        if encoded:
            released[:0] = parts_of(self._steps.end_keys(window.arrive(split, step, now)))
            kept, capped, _ = self._steps.offer(split, step, encoded, now)
            passed = [] if self.sampler.holds else self._steps.take((split, step))
            if passed:
                part = self._steps.open[(split, step)].part
                released.append(Part(split, step, part, *_unzip(passed)))
        return Offered(kept + len(marked), capped, released)

    def end(self, step: int | None = None, split: str | None = None) -> Ended:
        """End the open steps up to `step` (every one when None) of `split` (or of every split)."""
        ended = self._steps.end(step, split)
        if self._window is not None:
            self._window.close([key for key, _ in ended])
        return ended

    def close_idle(self, now: float) -> list[Part]:
        """End a streaming part's steps that saw no sample for `step_timeout` seconds."""
        return [] if self._window is None else parts_of(self._steps.end_keys(self._window.close_idle(now)))

    def close_all(self) -> list[Part]:
        """End every open step (a flush, a close)."""
        return parts_of(self.end())

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to end; None when it has none to wait for."""
        return None if self._window is None else self._window.next_due(now)

    def discard(self) -> int:
        """Forget every open step; returns how many samples that drops."""
        return sum(opened.held for _, opened in self.end())


def parts_of(ended: Ended) -> list[Part]:
    """What ended steps hand on as parts: their kept candidates, with rows, from those that kept any."""
    return [Part(split, step, o.part, *_unzip(o.rows())) for (split, step), o in ended if o.kept]


def _unzip(rows: list[tuple[Entry, bytes]]) -> tuple[list[bytes], list[Row]]:
    return [p for _, p in rows], [(e.seq, e.score, e.key) for e, _ in rows]

"""Tiered capture: the selection one sink makes, on top of the session's cap, in its writer lane.

A `Selected` sink's lane offers each record it is handed to a `Gate` of its own (the session's
samplers, per (split, step)), so one session can archive everything and show a tracker the
top and bottom of each step. The selection runs on the lane's task only: no lock. It holds at
most a selection per open step (O(k)); steps close as the session's do: `max_open_steps`
behind the newest step of a split, after `step_timeout` without a record, and at every flush
(finish included), which the lane sees as its flush marker.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby

from .._records.types import TraceRecord
from .base import EVICTED, HELD, RELEASED, Entry, Sampler
from .gate import Gate

__all__ = ["LaneSelection", "Picked"]


@dataclass(slots=True)
class Picked:
    """What one offer decided, for the records of the batch offered and for earlier held ones.

    `write` (batch records to write now), `held` (batch records kept back for their open
    step) and `skipped` (batch records left out, by reason) partition the batch. `released`
    are earlier held records to write now; `evicted` earlier held records now left out
    ("capped"). `failed`: the records of `write` the sink failed to write (set by the lane).
    """

    write: list[TraceRecord] = field(default_factory=list)
    failed: list[TraceRecord] = field(default_factory=list)
    held: list[TraceRecord] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    released: list[TraceRecord] = field(default_factory=list)
    evicted: list[TraceRecord] = field(default_factory=list)


class LaneSelection:
    """The per-(split, step) selection of one `Selected` sink: at most `k` a step, by `sampler`."""

    def __init__(self, k: int, sampler: Sampler, *, max_open_steps: int, step_timeout: float | None) -> None:
        self.gate = Gate(k, sampler, max_open_steps=max_open_steps, step_timeout=step_timeout)
        self.step_timeout = step_timeout
        self._seq = 0
        self._held = 0  # entries kept back for open steps, this sink's records not yet decided

    @property
    def holding(self) -> bool:
        """True while records are kept back for open steps (the lane then watches step_timeout)."""
        return self._held > 0

    def offer(self, records: list[TraceRecord], now: float) -> Picked:
        """Offer a batch, in order; records of one (split, step) in a row go in one offer."""
        picked = Picked()
        mine: list[Entry] = []
        late: set[int] = set()
        for (split, step), run in groupby(records, key=lambda r: (r.split, r.step)):
            entries = []
            offered = False
            for r in run:
                if r.watched:
                    # The watch list passes every selection by, and never opens or closes a
                    # step of one: a watched record is no sign that older steps are complete.
                    picked.write.append(r)
                    continue
                offered = True
                self._seq += 1
                if r.score is None and self.gate.sampler.needs_score:
                    # Ranking needs a score: a record without one cannot be placed in the
                    # selection, so this sink leaves it out, counted as such.
                    picked.skipped["unscored"] += 1
                    continue
                entries.append(Entry(r.score, self._seq, r))
            if not offered:
                continue
            result = self.gate.offer(split, step, entries, now)
            if result.late:
                late.update(id(e) for e in entries)
            mine.extend(entries)
            self._settle(result.released, result.evicted, picked, mine)
        for e in mine:
            assert e.record is not None
            if e.state == RELEASED:
                picked.write.append(e.record)
            elif e.state == HELD:
                picked.held.append(e.record)
                self._held += 1
            else:
                picked.skipped["late" if id(e) in late else "capped"] += 1
        return picked

    def prime(self, written: dict[tuple[str, int], int], closed: dict[str, int]) -> None:
        """What this sink had done before a restart: `written` records of these steps take
        places of their selections, and the steps up to `closed` of each split are closed."""
        for split, upto in closed.items():
            self.gate.window.close_upto(split, upto)
        self.gate.spent.update(written)

    def closed(self) -> dict[str, int]:
        """Each split's last closed step."""
        return self.gate.window.closed()

    def close_all(self) -> Picked:
        """Close every open step (a flush or finish): what they hold is released."""
        picked = Picked()
        dropped: list[Entry] = []
        self._settle(self.gate.close_all(dropped=dropped), dropped, picked, [])
        return picked

    def close_idle(self, now: float) -> Picked:
        """Close the steps that saw no record for `step_timeout` seconds."""
        picked = Picked()
        dropped: list[Entry] = []
        self._settle(self.gate.close_idle(now, dropped), dropped, picked, [])
        return picked

    def _settle(self, released: list[Entry], evicted: list[Entry], picked: Picked, mine: list[Entry]) -> None:
        """Sort what an offer or a close did to entries held from earlier batches; the current
        batch's own entries (`mine`) are sorted by their final state in `offer`."""
        if not released and not evicted:
            return
        ours = {id(e) for e in mine}
        for e in released:
            if id(e) not in ours and e.record is not None:
                picked.released.append(e.record)
                self._held -= 1
        for e in evicted:
            if id(e) not in ours and e.record is not None:
                picked.evicted.append(e.record)
                self._held -= 1
        assert all(e.state != HELD for e in evicted) and all(e.state != EVICTED for e in released)

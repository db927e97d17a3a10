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

from collections import OrderedDict
from collections.abc import Sequence

from .._parts import PartStep, Row, group_key_of, payload_group
from .._record import TraceRecord
from .._sampling import Entry, Sampler

__all__ = ["ROUND_STRIDE", "LocalSelection", "Released"]

# (split, step, part, encoded candidates, their rows) in arrival order: what one part ships, and
# the wire format of `TraceCollector.ingest_parts`.
Released = tuple[str, int, int, list[bytes], list[Row]]

# Round r of client part p is part p + r * ROUND_STRIDE: a part number of its own, so a
# sampler that draws gives it its own stream, and the collector merges it after the earlier ones.
ROUND_STRIDE = 1 << 32
# How many closed steps remember their rounds (a step seen again after that starts at round 0).
_ROUNDS_KEPT = 4096


class _OpenStep:
    __slots__ = ("last_seen", "part", "selection")

    def __init__(self, selection: PartStep, part: int, now: float) -> None:
        self.selection = selection
        self.part = part
        self.last_seen = now


class LocalSelection:
    """Per-(split, step) selections of one client, closed by step, idle time, or on demand.

    A step closes when the client offers a sample of a step more than `max_open_steps` newer
    (of the same split), after `step_timeout` seconds without samples for it, by `end_step`,
    and by `close_all` (flush and close).
    """

    def __init__(
        self, k: int, sampler: Sampler, part: int, *, max_open_steps: int, step_timeout: float | None
    ) -> None:
        self.k = k
        self.sampler = sampler
        self.part = part
        self.holds = sampler.holds
        self.max_open_steps = max_open_steps
        self.step_timeout = step_timeout
        self._group_key = group_key_of(sampler)
        self._open: dict[tuple[str, int], _OpenStep] = {}
        self._rounds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._seq = 0
        self.held = 0
        self.held_bytes = 0

    def offer(
        self, split: str, step: int, encoded: Sequence[tuple[bytes, float | None]], now: float
    ) -> tuple[Released | None, int, int, list[Released]]:
        """Offer one call's candidates in order.

        Returns (what to ship now: a sampler that holds nothing passes its picks on at once;
        how many this call refused or evicted; how many of this call's are kept for now;
        steps this offer closed).
        """
        released = self._close_older(split, step)
        key = (split, step)
        opened = self._open.get(key)
        if opened is None:
            part = self.part + self._rounds.get(key, 0) * ROUND_STRIDE
            selection = self.sampler.new_part_step(split, step, self.k, part)
            opened = self._open[key] = _OpenStep(PartStep(selection), part, now)
        opened.last_seen = now
        cands = []
        for payload, score in encoded:
            self._seq += 1
            # The record lets a custom selection read the sample itself, as inside a session.
            record = TraceRecord("", step, split, "", payload, now, score)
            group = payload_group(payload, self._group_key)
            cands.append((Entry(score, self._seq, record, group=group), payload))
        part_step = opened.selection
        before, before_bytes = len(part_step.kept), part_step.nbytes
        capped = part_step.offer(cands)
        mine = [e.seq for e, _ in cands if e.seq in part_step.kept]
        if not self.holds:
            passed = part_step.take(mine)
            ship: Released | None = (split, step, opened.part, *_unzip(passed)) if passed else None
            return ship, capped, len(mine), released
        self.held += len(part_step.kept) - before
        self.held_bytes += part_step.nbytes - before_bytes
        return None, capped, len(mine), released

    def _close_older(self, split: str, step: int) -> list[Released]:
        upto = step - self.max_open_steps - 1
        if upto < 0:
            return []
        return self._close([key for key in self._open if key[0] == split and key[1] <= upto])

    def end_step(self, step: int, split: str | None) -> list[Released]:
        """Close every open step up to `step` (of `split`, or of every split)."""
        return self._close([k for k in self._open if k[1] <= step and (split is None or k[0] == split)])

    def close_idle(self, now: float) -> list[Released]:
        """Close steps that saw no sample for `step_timeout` seconds."""
        if self.step_timeout is None:
            return []
        limit = self.step_timeout
        return self._close([k for k, o in self._open.items() if now - o.last_seen >= limit])

    def close_all(self) -> list[Released]:
        """Close every open step (flush, close)."""
        return self._close(list(self._open))

    def next_due(self, now: float) -> float | None:
        """Seconds until `close_idle` has a step to close; None when no step is open."""
        if self.step_timeout is None or not self._open:
            return None
        oldest = min(o.last_seen for o in self._open.values())
        return max(0.0, oldest + self.step_timeout - now)

    def discard(self) -> int:
        """Forget every open step; returns how many held candidates that drops."""
        n = self.held
        self._open.clear()
        self.held = 0
        self.held_bytes = 0
        return n

    def _close(self, keys: list[tuple[str, int]]) -> list[Released]:
        out: list[Released] = []
        for key in sorted(keys):
            opened = self._open.pop(key)
            self._rounds[key] = self._rounds.get(key, 0) + 1
            self._rounds.move_to_end(key)
            if len(self._rounds) > _ROUNDS_KEPT:
                self._rounds.popitem(last=False)
            part_step = opened.selection
            if part_step.kept:
                self.held -= len(part_step.kept)
                self.held_bytes -= part_step.nbytes
                out.append((key[0], key[1], opened.part, *_unzip(part_step.rows())))
        return out


def _unzip(rows: list[tuple[Entry, bytes]]) -> tuple[list[bytes], list[Row]]:
    return [p for _, p in rows], [(e.seq, e.score, e.key) for e, _ in rows]

"""What a `TraceClient` has to ship: samples waiting in (split, step) groups, and calls in flight.

Each accepted sample gets a sequence number, so `watermark` tells a flush when everything logged
before it was delivered or dropped. Not thread-safe: the client holds its lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._fronts.selection import Encoded, Part
from .._select.parts import Row

__all__ = ["Call", "Outbox"]


@dataclass(slots=True)
class _Group:
    """Consecutive samples of one (split, step, part) from one call, waiting to be shipped, with
    each sample's row for the merge (part -1 and no rows without local selection)."""

    split: str
    step: int
    part: int
    payloads: list[bytes]
    rows: list[Row]
    first_seq: int
    since: float


@dataclass(slots=True)
class Call:
    """One ingest call: its parts, and while in flight the first sequence number and size it holds."""

    id: int
    first_seq: int
    n: int
    nbytes: int
    parts: list[Part]


class Outbox:
    """Batches of up to `batch_size` samples / `max_batch_bytes`, at most `max_in_flight` calls."""

    def __init__(
        self, batch_size: int, max_batch_bytes: int, flush_interval: float, max_in_flight: int
    ) -> None:
        self.batch_size = batch_size
        self.max_batch_bytes = max_batch_bytes
        self.flush_interval = flush_interval
        self.max_in_flight = max_in_flight
        self._groups: deque[_Group] = deque()
        self.buffered = 0
        self.buffered_bytes = 0
        self.calls: dict[int, Call] = {}
        self._call_ids = itertools.count()
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.next_seq = 0  # sequence number of the next accepted sample
        self.flush_target = 0  # ship everything with a sequence number below this now

    def append(self, released: Iterable[Part], now: float) -> bool:
        """Queue groups of one (split, step, part) each; True when the shipping thread should look now."""
        was_empty = not self._groups
        for split, step, part, payloads, rows in released:
            nbytes = sum([len(p) for p in payloads])
            self._groups.append(_Group(split, step, part, payloads, rows, self.next_seq, now))
            self.next_seq += len(payloads)
            self.buffered += len(payloads)
            self.buffered_bytes += nbytes
        return was_empty or self.buffered >= self.batch_size or self.buffered_bytes >= self.max_batch_bytes

    def fit(self, encoded: Sequence[Encoded], limit: int, limit_bytes: int) -> int:
        """How many of `encoded` fit the bound on what this process holds: the samples buffered
        and in flight count, as they are its memory until the collector answered."""
        room = limit - self.buffered - self.in_flight
        room_bytes = limit_bytes - self.buffered_bytes - self.in_flight_bytes
        if len(encoded) <= room and sum([len(p) for p, _ in encoded]) <= room_bytes:
            return len(encoded)
        keep = kept_bytes = 0
        for p, _ in encoded[: max(room, 0)]:
            if kept_bytes + len(p) > room_bytes:
                break
            keep += 1
            kept_bytes += len(p)
        return keep

    def clear(self) -> int:
        """Forget what waits to be shipped; returns how many samples that was."""
        n = self.buffered
        self._groups.clear()
        self.buffered = self.buffered_bytes = 0
        return n

    def __bool__(self) -> bool:
        return bool(self._groups)

    def watermark(self) -> int:
        """Every sample with a lower sequence number is delivered or dropped."""
        low = self._groups[0].first_seq if self._groups else self.next_seq
        return min([low, *(call.first_seq for call in self.calls.values())])

    def ship_due(self, now: float, stopping: bool) -> float | None:
        """Seconds until the next batch should go; 0 when one should go now, None when idle."""
        if not self._groups or len(self.calls) >= self.max_in_flight:
            return None
        if (
            stopping
            or self._groups[0].first_seq < self.flush_target
            or self.buffered >= self.batch_size
            or self.buffered_bytes >= self.max_batch_bytes
        ):
            return 0.0
        return max(0.0, self._groups[0].since + self.flush_interval - now)

    def take_batch(self) -> Call:
        """Pop up to `batch_size` samples / `max_batch_bytes` as one call in flight, keeping (split,
        step, part) groups together."""
        wire: list[Part] = []
        n = nbytes = 0
        first_seq = self._groups[0].first_seq
        while self._groups and n < self.batch_size:
            group = self._groups[0]
            take = took_bytes = 0
            for p in group.payloads[: self.batch_size - n]:
                # Always take at least one sample, so an oversized one still goes alone.
                if n + take and nbytes + took_bytes + len(p) > self.max_batch_bytes:
                    break
                take += 1
                took_bytes += len(p)
            if take == 0:
                break
            payloads, rows = group.payloads[:take], group.rows[:take]
            if take == len(group.payloads):
                self._groups.popleft()
            else:
                group.payloads, group.rows = group.payloads[take:], group.rows[take:]
                group.first_seq += take
            last = wire[-1] if wire else None
            if last is not None and (last.split, last.step, last.part) == (
                group.split,
                group.step,
                group.part,
            ):
                # Consecutive calls for the same step travel as one group: the collector
                # handles (and may wait for room for) each group once. The lists are slices,
                # this batch's alone, so extending them is safe.
                last.payloads.extend(payloads)
                last.rows.extend(rows)
            else:
                wire.append(Part(group.split, group.step, group.part, payloads, rows))
            n += take
            nbytes += took_bytes
            if nbytes >= self.max_batch_bytes:
                break
        self.buffered -= n
        self.buffered_bytes -= nbytes
        self.in_flight += n
        self.in_flight_bytes += nbytes
        call = Call(next(self._call_ids), first_seq, n, nbytes, wire)
        self.calls[call.id] = call
        return call

    def finish(self, call_id: int) -> Call | None:
        """The call that ended (None when it was already counted)."""
        call = self.calls.pop(call_id, None)
        if call is not None:
            self.in_flight -= call.n
            self.in_flight_bytes -= call.nbytes
        return call

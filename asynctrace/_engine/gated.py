"""Gated admission: samples offered to the cap and its sampler (`Gate`) on their way into the
queue, counted in the ledger as the gate decides them."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from .._records.types import TraceRecord
from .._select.base import EVICTED, Entry, entries_for
from .._select.gate import Gate, GateResult
from .queue import Admission, OnFull, Queue, Waiting

if TYPE_CHECKING:
    from .._durable.journal import Journal
    from .ledger import Ledger

__all__ = ["GatedAdmission"]


class GatedAdmission:
    """The gate in front of the queue. Not thread-safe: the buffer's lock guards it."""

    def __init__(self, gate: Gate, queue: Queue, ledger: Ledger, staging: Journal | None) -> None:
        self.gate = gate
        self.queue = queue
        self.ledger = ledger
        self.clock = queue.clock
        self.staging = staging  # set only with durability "enqueue": staged as they are admitted
        self.entry_seq = 0

    def release(self, entries: list[Entry]) -> bool:
        """Queue the entries of closed steps even past the bound, so that closing a step never
        blocks: they entered their selection only while there was room (see `room_needed`)."""
        wake = False
        for e in entries:
            if e.record is not None:
                wake |= self.queue.push(e.record)
        return wake

    def apply(self, result: GateResult) -> tuple[list[TraceRecord], bool]:
        """Count what an offer refused; returns the records it passed and whether to wake the writer."""
        drop = self.ledger.drop
        if result.capped:
            drop("capped", result.capped)
        if result.evicted:
            # Held samples a better one displaced: they had been accepted.
            evicted = [e.record for e in result.evicted if e.record is not None]
            drop("capped", len(result.evicted), evicted, displaced=True)
        if result.late:
            drop("late", result.late)
        wake = self.release(result.released) if result.released else False
        return [e.record for e in result.passed if e.record is not None], wake

    def room_needed(self, split: str, step: int, nbytes: int) -> tuple[int, int] | None:
        """What must fit in the queue before a holding sampler's selection of (split, step)
        takes samples: room for one more of `nbytes` bytes and for what the offer would release
        from the steps it closes, as (records, bytes); None when nothing need fit.

        Held samples take no room until their step closes. Without this check a producer
        faster than the sinks would never wait or drop, and the queue would grow by a
        selection per step; with it, only flush(), finish() and the idle timeout close steps
        past the bound, by at most a selection per open step.
        """
        gate = self.gate
        if not gate.sampler.holds or gate.window.is_late(split, step):
            return None
        # Usually the offer closes no step: nothing to count then.
        n, released = gate.releasing(split, step) if gate.window.behind(split, step) is not None else (0, 0)
        if n + 1 > self.queue.queue_size or released + nbytes > self.queue.max_bytes:
            # Selections larger than the whole bound: room for one sample, as for any other.
            n, released = 0, 0
        return n + 1, released + nbytes

    def room_for_held(self, split: str, step: int, nbytes: int, on_full: OnFull) -> bool:
        """Whether samples may enter a holding sampler's selection now; drop_oldest evicts to
        make that room."""
        need = self.room_needed(split, step, nbytes)
        if need is None or self.queue.fits(need[1], need[0]):
            return True
        return on_full == "drop_oldest" and self.queue.evict_for(need[1], need[0])

    def offer(
        self,
        records: Sequence[TraceRecord],
        start: int,
        split: str,
        step: int,
        out: Admission,
        on_full: OnFull,
        gaps: Sequence[int] | None = None,
        groups: Sequence[Hashable | None] | None = None,
    ) -> int:
        """Offer records from `start` on to the gate and queue what it passes; those the cap
        refuses (or the policy drops) are taken off `out.accepted` (and counted in
        `out.refused`). `gaps`: per record, how many samples the cap refused right before it
        (see `keeps`); `groups`: per record, its prompt group as the encoder read it. Returns
        where "block" stopped, before the gate; what it passed and the queue has no room for
        is left in `out.waiting`."""
        if start >= len(records):
            return start
        need = self.room_needed(split, step, records[start].nbytes)
        if (
            need is not None
            and not self.queue.fits(need[1], need[0])
            and not (on_full == "drop_oldest" and self.queue.evict_for(need[1], need[0]))
        ):  # `room_for_held`, inline on the caller's path
            if on_full == "block":
                return start
            rest = records[start:]
            self.ledger.drop("queue_full", len(rest), rest)
            out.accepted -= len(rest)
            return len(records)
        offered = records[start:] if start else records
        seq = self.entry_seq
        entries = entries_for(
            offered,
            seq + 1,
            gaps[start:] if gaps is not None and start else gaps,
            groups[start:] if groups is not None and start else groups,
        )
        self.entry_seq = seq + len(entries)
        result = self.gate.offer(split, step, entries, self.clock())
        if self.staging is not None:
            # Staged before anything is dropped below, so every drop finds it staged.
            self.staging.admitted([e.record for e in entries if e.state != EVICTED and e.record])
        if result.passed or result.capped or result.evicted or result.late or result.released:
            passed, wake = self.apply(result)
            out.wake |= wake
        else:
            passed = []  # the usual offer to a holding sampler: everything held, nothing to count
        refused = len(offered) - len(passed) - result.held
        out.accepted -= refused
        out.refused += refused
        if passed:
            stop = self.queue.enqueue(passed, out, on_full)
            if stop < len(passed):
                out.waiting = Waiting(passed, stop)
        return len(records)

    def reserve(
        self, scores: Sequence[float | None], split: str, step: int, invalid: int, on_full: OnFull
    ) -> tuple[list[Entry | None], bool] | None:
        """See `Buffer.reserve`."""
        n = len(scores)
        full = n and self.room_needed(split, step, 0) is not None
        if full and on_full == "block" and not self.room_for_held(split, step, 0, "block"):
            return None
        self.ledger.submit(n + invalid, invalid=invalid)
        if full and on_full != "block" and not self.room_for_held(split, step, 0, on_full):
            self.ledger.drop("queue_full", n)
            return [None] * n, False
        seq = self.entry_seq
        entries = [Entry(s, seq + i) for i, s in enumerate(scores, 1)]
        self.entry_seq = seq + n
        _, wake = self.apply(self.gate.offer(split, step, entries, self.clock()))
        return [e if e.state != EVICTED else None for e in entries], wake

"""The buffer: the bounded queue with gated admission in front of it, counted in the ledger."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

from .._records.types import TraceRecord
from .._select.base import Entry
from .._select.gate import Gate, GateResult
from .._stats import DropReason, SessionStats
from ..exceptions import SessionClosedError
from .gated import GatedAdmission
from .ledger import Batch, Ledger
from .queue import Admission, Marker, OnFull, Queue, Room, Waiting

if TYPE_CHECKING:
    from .._durable.journal import Journal

__all__ = ["Admission", "Batch", "Buffer", "Marker", "OnFull", "Room", "Waiting"]

_CLOSED = "the session is finished; it accepts no more samples"


class Buffer(Queue):
    """The one object every front submits to and the writer takes from. The queue's lock guards
    the gate and the ledger too: a stats snapshot is consistent and caps are exact whichever
    threads and tasks submit."""

    def __init__(
        self,
        *,
        queue_size: int,
        max_bytes: int,
        on_full: OnFull,
        batch_size: int,
        gate: Gate | None,
        sink_names: Sequence[str],
        clock: Callable[[], float],
        journal: Journal | None = None,
        degraded: Callable[[], Sequence[str | None]] | None = None,
    ) -> None:
        self.ledger = Ledger(sink_names, journal)
        # Per sink, why it runs in a fallback (`Sink.degraded`), for the stats snapshots.
        self.degraded = degraded
        super().__init__(queue_size, max_bytes, on_full, batch_size, clock, self.ledger)
        self.gate = gate
        self.room = Room()
        self.sinks = self.ledger.sinks
        self.closed = False
        # Submissions not queued yet (waiting for room, rows being decoded), numbered in order,
        # so that flush() can wait for those made before it.
        self._ticket = 0
        self.tickets: set[int] = set()
        self.waitings: set[Waiting] = set()  # given up by close() itself (see there)
        self.journal = journal
        # Records staged as they are admitted (durability "enqueue"); otherwise the writer
        # stages each batch as it takes it.
        self.staging = journal if journal is not None and journal.on_admit else None
        self.gated = GatedAdmission(gate, self, self.ledger, self.staging) if gate else None

    # -- submission (any thread) -------------------------------------------------------

    def admit(
        self,
        records: Sequence[TraceRecord],
        *,
        split: str,
        step: int,
        nowait: bool,
        invalid: int = 0,
        refused: int = 0,
        ticket: int | None = None,
        gaps: Sequence[int] | None = None,
        gated: bool = True,
        groups: Sequence[Hashable | None] | None = None,
    ) -> Admission:
        """Count and admit one submission (records of one split and step). `refused` counts
        samples the cap turned away before they were encoded (see `keeps`), `gaps` how many of
        them came right before each record, `groups` each record's prompt group where the
        encoder read it (a group sampler then parses no payload); `ticket` is the submission's
        flush ticket, given back should finish() give up its waiting records. `gated=False`
        passes the cap by (the watch list has its own)."""
        out = Admission()
        n = len(records)
        with self.lock:
            ledger = self.ledger
            if self.closed and not nowait:
                raise SessionClosedError(_CLOSED)
            if self.closed:
                ledger.submit(n + invalid + refused)
                ledger.drop("closed", n + invalid + refused)
                return out
            ledger.submit(n + invalid + refused, invalid=invalid)
            self._count_refused(split, step, refused)
            # log_samples_nowait never blocks: "block" behaves as drop_newest there.
            on_full: OnFull = "drop_newest" if nowait and self.on_full == "block" else self.on_full
            out.accepted = n
            if self.gated is None or not gated:
                if self.staging is not None:
                    self.staging.admitted(records)
                stop = self.enqueue(records, out, on_full)
                if stop < n:
                    out.waiting = Waiting(records, stop)
            else:
                stop = self.gated.offer(records, 0, split, step, out, on_full, gaps, groups)
                if gaps is not None and refused > sum(gaps):
                    # Refused after the last record: passed over now, so a positional sampler
                    # (the reservoir) counts them before any later submission's rows.
                    self.gated.gate.skip(split, step, refused - sum(gaps))
                if stop < n:
                    out.waiting = Waiting(
                        records, stop, gated=True, split=split, step=step, gaps=gaps, groups=groups
                    )
            if out.waiting is not None:
                out.waiting.ticket = ticket
                self.waitings.add(out.waiting)
        return out

    def _count_refused(self, split: str, step: int, refused: int) -> None:
        """Lock held: count a submission's samples the cap turned away before they were encoded."""
        if refused:
            assert self.gate is not None
            self.ledger.drop("late" if self.gate.window.is_late(split, step) else "capped", refused)

    def count_invalid(self, n: int) -> None:
        """`n` samples the caller could not build: counted as submitted and dropped ("invalid")."""
        with self.lock:
            self.ledger.submit(n, invalid=n)

    def count_closed(self, n: int, invalid: int = 0) -> None:
        """`n` samples (and `invalid` ones) a caller finished preparing after finish() began:
        counted as submitted and dropped ("closed", "invalid"), as a reservation then is."""
        with self.lock:
            self.ledger.submit(n + invalid, invalid=invalid)
            self.ledger.drop("closed", n)

    def take_ticket(self) -> int:
        with self.lock:
            self._ticket += 1
            self.tickets.add(self._ticket)
            return self._ticket

    def return_ticket(self, ticket: int) -> None:
        with self.lock:
            self.tickets.discard(ticket)
        self.room.notify()

    def last_ticket(self) -> int:
        with self.lock:
            return self._ticket

    def tickets_upto(self, ticket: int | None) -> bool:
        """True while a submission numbered `ticket` or earlier (None: any) is still on its way
        to the queue."""
        with self.lock:
            return any(ticket is None or t <= ticket for t in self.tickets)

    def keeps(
        self,
        scores: Sequence[float | None],
        *,
        split: str,
        step: int,
        groups: Sequence[Hashable | None] | None = None,
        refused_with: int | None = None,
    ) -> list[bool] | None:
        """Which of a submission's samples the cap would keep if offered now (None: cannot
        tell); a sample it would refuse need not be encoded. Counts nothing, except with
        `refused_with` (how many invalid samples the submission left out) when the cap
        would keep none: the submission is then counted whole, and [] returned."""
        gated = self.gated
        if gated is None:
            return None
        with self.lock:
            gate = gated.gate
            keeps = gate.keeps(split, step, scores, gated.entry_seq + 1, groups)
            if refused_with is None or keeps is None or True in keeps or self.closed:
                return keeps
            n = len(scores)
            self.ledger.submit(n + refused_with, invalid=refused_with)
            self._count_refused(split, step, n)
            if gate.sampler.counts_skipped:
                gate.skip(split, step, n)  # a positional sampler (the reservoir) counts them
            return []

    def admit_waiting(self, waiting: Waiting) -> Admission:
        """Retry records that were waiting for room (block policy); consumes `waiting` in place."""
        out = Admission()
        with self.lock:
            if not len(waiting):
                self.waitings.discard(waiting)
                return out
            if self.closed:
                # finish() has begun (and may have passed its flush marker): too late to queue.
                self._give_up(waiting, "closed")
                return out
            # Only the block policy (and replay, which never drops for room) leaves records waiting.
            if waiting.gated:
                assert self.gated is not None
                waiting.start = self.gated.offer(
                    waiting.records,
                    waiting.start,
                    waiting.split,
                    waiting.step,
                    out,
                    "block",
                    waiting.gaps,
                    waiting.groups,
                )
                waiting.lost += out.refused
                if out.waiting is not None:
                    # What a non-holding sampler passed waits on as plain records.
                    self.waitings.discard(waiting)
                    out.waiting.ticket, out.waiting.lost = waiting.ticket, waiting.lost
                    self.waitings.add(out.waiting)
                    return out
            else:
                waiting.start = self.enqueue(waiting.records, out, "block", waiting.start)
            if len(waiting):
                out.waiting = waiting
            else:
                self.waitings.discard(waiting)
        return out

    def wait(self, out: Admission, waiting: Waiting) -> None:
        """Lock held: `waiting` waits for room (block policy); finish() gives it up."""
        out.waiting = waiting
        self.waitings.add(waiting)

    def _give_up(self, waiting: Waiting, reason: DropReason) -> None:
        """Lock held: drop what `waiting` still holds."""
        rest = waiting.rest()
        self.ledger.drop(reason, len(rest), rest)
        waiting.lost += len(rest)
        waiting.start = len(waiting.records)
        self.waitings.discard(waiting)

    def give_up_waiting(self, waiting: Waiting, reason: DropReason) -> None:
        with self.lock:
            self._give_up(waiting, reason)

    def close(self) -> None:
        """finish() has begun: nothing waiting for room will be queued any more. Counted
        "closed" here, with the submissions' tickets given back, rather than by their callers:
        a caller's thread may be busy elsewhere (running the very signal handler that finishes
        the session) and would leave them pending."""
        with self.lock:
            self.closed = True
            for waiting in list(self.waitings):
                self._give_up(waiting, "closed")
                if waiting.ticket is not None:
                    self.tickets.discard(waiting.ticket)
        self.room.notify()

    def admit_replayed(self, records: Sequence[TraceRecord]) -> Admission:
        """Records replayed from a spool: counted as submitted (and replayed), past the gate
        (they passed it in the session that logged them), and never dropped for room."""
        out = Admission(accepted=len(records))
        with self.lock:
            if self.closed:
                raise SessionClosedError(_CLOSED)
            self.ledger.submit(len(records))
            self.ledger.replayed += len(records)
            stop = self.enqueue(records, out, "block")
            if stop < len(records):
                self.wait(out, Waiting(records, stop))
        return out

    def close_steps(self, *, idle_only: bool = False) -> bool:
        if self.gated is None:
            return False
        with self.lock:
            gate = self.gated.gate
            dropped: list[Entry] = []
            released = (
                gate.close_idle(self.clock(), dropped) if idle_only else gate.close_all(dropped=dropped)
            )
            # A selection that decides when its step closes drops what it held back only now.
            return self.gated.apply(GateResult(released=released, evicted=dropped))[1]

    # -- writer side (event-loop thread) -------------------------------------------------

    def resolve_held(
        self, lane: int, records: Sequence[TraceRecord], outcome: str, error: str | None
    ) -> None:
        """A selecting sink decided records its selection held: `outcome` is "written",
        "failed" (with `error`) or the reason it left them out."""
        if records:
            with self.lock:
                self.ledger.resolve_held(lane, records, outcome, error)

    def note_retries(self, lane: int, retries: int) -> None:
        with self.lock:
            self.sinks[lane].retries += retries

    def note_metrics_failure(self, lane: int, error: str) -> None:
        with self.lock:
            self.sinks[lane].metrics_failed += 1
            self.sinks[lane].last_error = error

    def snapshot(self) -> SessionStats:
        # Asked outside the lock: it is the sinks' own state, which they answer at once.
        degraded = self.degraded() if self.degraded is not None else ()
        with self.lock:
            return self.ledger.snapshot(self.depth, self.nbytes, self.metrics_dropped, degraded)

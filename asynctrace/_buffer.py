"""The bounded buffer and its ledger: every sample is counted from submission until it is resolved.

One `threading.Lock` guards the queue, the gate and every counter, so a stats snapshot is
consistent at every moment and caps are exact whichever threads and tasks submit.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import anyio

from ._record import TraceRecord
from ._sampling import EVICTED, HELD, RELEASED, Entry, Gate, GateResult
from ._stats import DropReason, SessionStats, SinkStats
from .exceptions import SessionClosedError

if TYPE_CHECKING:
    from ._spool import Spool
    from ._tiers import Picked

__all__ = ["Batch", "Buffer", "Marker", "MetricsItem", "Room", "Waiting"]

OnFull = Literal["block", "drop_newest", "drop_oldest"]


class Room:
    """Wakes whoever waits for the buffer to change (room freed, a submission queued or given
    up, the buffer closed): the one way every caller, on any thread, waits for it.

    A waiter subscribes first, then tries, then waits for its wake-up: a change between the
    try and the wait is never missed. Each subscription is woken once.
    """

    __slots__ = ("_lock", "_waiters")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], object]] = []

    def subscribe(self, wake: Callable[[], object]) -> None:
        with self._lock:
            self._waiters.append(wake)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()


class Batch:
    """Records dispatched together to every sink; resolved when every sink is done with them."""

    __slots__ = ("errors", "failed", "failed_ids", "lanes_left", "nbytes", "pinned", "records", "started")

    def __init__(self, records: list[TraceRecord], lanes: int) -> None:
        self.records = records
        self.nbytes = sum([len(r.payload) for r in records])
        self.lanes_left = lanes
        self.failed = False
        self.errors: list[tuple[str, str]] = []  # (sink, error) of the sinks that failed it
        # Records a selecting sink failed (it wrote only some): failed though the batch is not.
        self.failed_ids: set[int] | None = None
        # Until a sink starts on it, drop_oldest may still take records out of it.
        self.started = False
        # Counted in the buffer's `pinned_*`: out of drop_oldest's reach (see Buffer.take).
        self.pinned = False


class Marker:
    """A flush marker: set once every sink has handled everything queued before it."""

    __slots__ = ("done", "lanes_left")

    def __init__(self, lanes: int) -> None:
        self.lanes_left = lanes
        self.done = anyio.Event()

    def arrive(self) -> None:
        self.lanes_left -= 1
        if self.lanes_left <= 0:
            self.done.set()


@dataclass(slots=True)
class MetricsItem:
    step: int
    metrics: Mapping[str, float]


@dataclass(slots=True)
class _SinkCounters:
    written: int = 0
    failed: int = 0
    retries: int = 0
    metrics_failed: int = 0
    last_error: str | None = None
    skipped: Counter[str] = field(default_factory=Counter)
    held: int = 0


class _Hold:
    """A record a sink's selection kept back (see `_tiers`): it stays pending until every sink
    holding it has decided it and its batch is done with by every sink."""

    __slots__ = ("batch_done", "errors", "failed", "holders", "record")

    def __init__(self, record: TraceRecord) -> None:
        self.record = record
        self.holders = 0
        self.batch_done = False
        self.failed = False
        self.errors: list[tuple[str, str]] = []


class Waiting:
    """The records of one submission still waiting for room (block policy).

    Consumed from `start` on, in place: a huge submission that waits through many passes is
    never copied again on each one. `gated`: not offered to a holding sampler yet (admitting
    into a held selection asks for room too, see `Buffer._offer`). `lost` counts those that
    will not be queued after all (refused by the cap when offered, or given up), so that the
    caller can tell how many it got in.
    """

    __slots__ = ("gaps", "gated", "lost", "records", "split", "start", "step", "ticket")

    def __init__(
        self,
        records: Sequence[TraceRecord],
        start: int,
        *,
        gated: bool = False,
        split: str = "",
        step: int = 0,
        gaps: Sequence[int] | None = None,
    ) -> None:
        self.records = records
        self.gaps = gaps
        self.start = start
        self.gated = gated
        self.split = split
        self.step = step
        self.lost = 0
        # The submission's flush ticket, returned when finish() gives the records up for it.
        self.ticket: int | None = None

    def __len__(self) -> int:
        return len(self.records) - self.start

    def rest(self) -> Sequence[TraceRecord]:
        return self.records[self.start :] if self.start else self.records


@dataclass(slots=True)
class Admission:
    """What happened to one submission."""

    accepted: int = 0
    waiting: Waiting | None = None  # block policy: no room yet
    wake: bool = False
    refused: int = 0  # waiting records the cap refused when they were offered at last


QueueItem = TraceRecord | Marker | MetricsItem


class Buffer:
    """Bounded by records and encoded bytes; counts every sample by outcome."""

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
        spool: Spool | None = None,
        spool_on_admit: bool = False,
    ) -> None:
        self.queue_size = queue_size
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.batch_size = batch_size
        self.gate = gate
        self.clock = clock
        self.lock = threading.Lock()
        self.room = Room()
        self.sink_names = list(sink_names)
        self.sinks = [_SinkCounters() for _ in sink_names]
        self.submitted = 0
        self.accepted = 0
        self.written = 0
        self.failed = 0
        self.dropped: Counter[str] = Counter()
        # Unresolved records that hold buffer room: queued or dispatched, not yet resolved.
        self.depth = 0
        self.nbytes = 0
        self.queue: deque[QueueItem] = deque()
        self.undispatched = 0
        self.first_undispatched_at: float | None = None
        self.control_items = 0
        self.unstarted: deque[Batch] = deque()
        # Records and bytes held by batches drop_oldest cannot evict from: taken and not yet
        # offered for eviction, or started by a sink. What it could free is the rest.
        self.pinned_records = 0
        self.pinned_bytes = 0
        self.closed = False
        # Submissions not in the queue yet (waiting for room, rows being decoded), numbered in
        # order, so that flush() can wait for those made before it.
        self._ticket = 0
        self.tickets: set[int] = set()
        # Submissions waiting for room: finish() gives what they still hold up as "closed"
        # itself, so a caller stuck elsewhere (a signal handler running on its thread) cannot
        # leave them pending.
        self.waitings: set[Waiting] = set()
        self._entry_seq = 0
        self.on_drop: Callable[[DropReason, int], None] | None = None
        # The write-ahead spool, when the session has one. With `spool_on_admit` (durability
        # "enqueue") records are staged as they are admitted; otherwise the writer stages each
        # batch as it dispatches it. Either way every resolution is passed on.
        self.spool = spool
        self.spool_on_admit = spool is not None and spool_on_admit
        self.replayed = 0
        # Records selecting sinks hold for open steps, by id(record) (see `_tiers`).
        self.holds: dict[int, _Hold] = {}

    # -- submission (any thread) -------------------------------------------------------

    def _drop(self, reason: DropReason, n: int, records: Sequence[TraceRecord] = ()) -> None:
        if n:
            self.dropped[reason] += n
            if self.on_drop is not None:
                self.on_drop(reason, n)
            if records and self.spool is not None:
                # A record that reached the spool (staged on admission, or with durability
                # "writer" when its batch was dispatched, which drop_oldest may still evict
                # from) and was dropped since is done with. A replayed one is not: it stays in
                # the spool for the next replay.
                done = [r for r in records if r.spool_slot is not None and not r.replayed]
                if done:
                    self.spool.resolve(done)

    def _fits(self, nbytes: int, n: int = 1) -> bool:
        """Room for `n` more records of `nbytes` bytes in all."""
        return self.depth + n <= self.queue_size and self.nbytes + nbytes <= self.max_bytes

    @property
    def pressed(self) -> bool:
        """Half the bound is taken: queued records should go out now, not at batch_size or
        flush_interval (a bound smaller than a batch would otherwise only drain on the timer)."""
        return self.depth * 2 >= self.queue_size or self.nbytes * 2 >= self.max_bytes

    def _push(self, record: TraceRecord) -> bool:
        """Append one record; True when the writer should be woken."""
        self.queue.append(record)
        self.depth += 1
        self.nbytes += record.nbytes
        self.undispatched += 1
        if self.undispatched == 1:
            self.first_undispatched_at = self.clock()
            return True
        return self.undispatched == self.batch_size or self.pressed

    def _evict_one_dispatched(self) -> bool:
        """Take the oldest record out of a batch no sink has started on yet."""
        unstarted = self.unstarted
        while unstarted and (unstarted[0].started or not unstarted[0].records):
            unstarted.popleft()
        if not unstarted:
            return False
        batch = unstarted[0]
        record = batch.records.pop(0)
        batch.nbytes -= record.nbytes
        self.depth -= 1
        self.nbytes -= record.nbytes
        self._drop("queue_full", 1, (record,))
        return True

    def _evict_oldest_for(self, nbytes: int, n: int = 1) -> bool:
        """drop_oldest: remove the oldest records no sink has started on until `n` records of
        `nbytes` bytes in all fit.

        Batches already handed to a slow sink's inbox are older than anything still queued, so
        they are evicted first; without that, a slow sink would hold most of the bound out of
        reach and drop_oldest would mostly drop the newest. When even evicting everything it can
        reach would not make room, it evicts nothing: only the new record is lost.
        """
        if self.pinned_records + n > self.queue_size or self.pinned_bytes + nbytes > self.max_bytes:
            return False
        while not self._fits(nbytes, n):
            if self._evict_one_dispatched():
                continue
            for i, item in enumerate(self.queue):
                if isinstance(item, TraceRecord):
                    del self.queue[i]
                    self.depth -= 1
                    self.nbytes -= item.nbytes
                    self.undispatched -= 1
                    self._drop("queue_full", 1, (item,))
                    break
            else:
                return False
        return True

    def _enqueue(
        self, records: Sequence[TraceRecord], out: Admission, on_full: OnFull | None = None, start: int = 0
    ) -> int:
        """Admit records from `start` on, in order, under the bound and the on_full policy.
        Returns where "block" stopped for want of room (len(records) when nothing waits)."""
        n = len(records) - start
        if n and self.depth + n <= self.queue_size:
            # The usual case, everything fits: one extend and one update of each counter.
            rest = records[start:] if start else records
            total = sum([len(r.payload) for r in rest])
            if self.nbytes + total <= self.max_bytes:
                self.queue.extend(rest)
                self.depth += n
                self.nbytes += total
                before = self.undispatched
                self.undispatched = before + n
                if before == 0:
                    self.first_undispatched_at = self.clock()
                    out.wake = True
                elif before < self.batch_size <= before + n or self.pressed:
                    out.wake = True
                return len(records)
        on_full = on_full or self.on_full
        for i in range(start, len(records)):
            record = records[i]
            if not self._fits(record.nbytes):
                if on_full == "block":
                    return i
                if on_full == "drop_oldest" and self._evict_oldest_for(record.nbytes):
                    pass
                else:
                    self._drop("queue_full", 1, (record,))
                    out.accepted -= 1
                    self.accepted -= 1
                    continue
            out.wake |= self._push(record)
        return len(records)

    def _wait(self, out: Admission, waiting: Waiting) -> None:
        out.waiting = waiting
        self.waitings.add(waiting)

    def _release(self, entries: list[Entry]) -> bool:
        # Entries of a closed step go on even past the bound, so that closing a step never
        # blocks: they were admitted into their selection only while the queue had room (see
        # `_offer`), so what this adds past the bound is at most what the open steps held.
        wake = False
        for e in entries:
            if e.record is not None:
                wake |= self._push(e.record)
        return wake

    def _apply_gate(self, result: GateResult) -> tuple[list[TraceRecord], bool]:
        evicted = [e.record for e in result.evicted if e.record is not None]
        self._drop("capped", result.capped + len(result.evicted), evicted)
        self._drop("late", result.late)
        wake = self._release(result.released)
        return [e.record for e in result.passed if e.record is not None], wake

    def _room_needed(self, split: str, step: int, nbytes: int) -> tuple[int, int] | None:
        """What must fit in the queue before a holding sampler's selection of (split, step)
        takes samples: room for one more of `nbytes` bytes and for what the offer would release
        from the steps it closes, as (records, bytes); None when nothing need fit.

        Held samples take no room until their step closes, but then enter the queue even past
        the bound (so that closing a step never blocks). Without this check a producer faster
        than the sinks would never wait or drop and the queue would grow by a step's selection
        per step, without bound; with it, only flush(), finish() and the idle timeout close
        steps past the bound: by at most a selection per open step.
        """
        gate = self.gate
        assert gate is not None
        if not gate.sampler.holds or gate.is_closed(split, step):
            return None
        n, released = gate.releasing(split, step)
        if n + 1 > self.queue_size or released + nbytes > self.max_bytes:
            # Selections larger than the whole bound: room for one sample, as for any other.
            n, released = 0, 0
        return n + 1, released + nbytes

    def _room_for_held(self, split: str, step: int, nbytes: int, on_full: OnFull) -> bool:
        """Whether samples may enter a holding sampler's selection now (see `_room_needed`);
        drop_oldest evicts to make that room."""
        need = self._room_needed(split, step, nbytes)
        if need is None or self._fits(need[1], need[0]):
            return True
        return on_full == "drop_oldest" and self._evict_oldest_for(need[1], need[0])

    def _offer(
        self,
        records: Sequence[TraceRecord],
        start: int,
        split: str,
        step: int,
        out: Admission,
        on_full: OnFull,
        gaps: Sequence[int] | None = None,
    ) -> int:
        """Offer records from `start` on to the gate and queue what it passes. The records
        count as accepted already: those the cap refuses (or the policy drops) are taken off
        again (and counted in `out.refused`). `gaps`: per record, how many samples the cap
        refused right before it (see `keeps`). Returns where "block" stopped, as `_enqueue`."""
        if start >= len(records):
            return start
        if not self._room_for_held(split, step, records[start].nbytes, on_full):
            if on_full == "block":
                return start
            rest = records[start:]
            self._drop("queue_full", len(rest), rest)
            out.accepted -= len(rest)
            self.accepted -= len(rest)
            return len(records)
        offered = records[start:] if start else records
        entries = []
        for r in offered:
            self._entry_seq += 1
            entries.append(Entry(r.score, self._entry_seq, r))
        if gaps is not None:
            for e, gap in zip(entries, gaps[start:], strict=True):
                e.gap = gap
        assert self.gate is not None
        result = self.gate.offer(split, step, entries, self.clock())
        if self.spool_on_admit and self.spool is not None:
            # Staged before anything is dropped below, so every drop finds it staged.
            self.spool.stage([e.record for e in entries if e.state != EVICTED and e.record])
        passed, wake = self._apply_gate(result)
        out.wake |= wake
        refused = len(offered) - len(passed) - result.held
        out.accepted -= refused
        out.refused += refused
        self.accepted -= refused
        stop = self._enqueue(passed, out, on_full)
        if stop < len(passed):
            self._wait(out, Waiting(passed, stop))
        return len(records)

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
    ) -> Admission:
        """Count and admit one submission (records of one split and step). `refused` counts
        samples the cap turned away before they were encoded (see `keeps`), `gaps` how many of
        them came right before each record; `ticket` is the submission's flush ticket, given
        back should finish() give up its waiting records. `gated=False` passes the cap by (the
        watch list has its own)."""
        out = Admission()
        with self.lock:
            if self.closed:
                if not nowait:
                    raise SessionClosedError("the session is finished; it accepts no more samples")
                self.submitted += len(records) + invalid + refused
                self._drop("closed", len(records) + invalid + refused)
                return out
            n = len(records)
            self.submitted += n + invalid + refused
            if invalid:
                self._drop("invalid", invalid)
            if refused:
                assert self.gate is not None
                self._drop("late" if self.gate.is_closed(split, step) else "capped", refused)
            # log_samples_nowait never blocks: "block" behaves as drop_newest there.
            on_full: OnFull = "drop_newest" if nowait and self.on_full == "block" else self.on_full
            out.accepted = n
            self.accepted += n
            if self.gate is None or not gated:
                if self.spool_on_admit and self.spool is not None:
                    self.spool.stage(records)
                stop = self._enqueue(records, out, on_full)
                if stop < n:
                    self._wait(out, Waiting(records, stop))
            else:
                stop = self._offer(records, 0, split, step, out, on_full, gaps)
                if gaps is not None and refused > sum(gaps):
                    # Refused after the last record: passed over now, so a positional sampler
                    # (the reservoir) counts them before any later submission's rows.
                    self.gate.skip(split, step, refused - sum(gaps))
                if stop < n:
                    self._wait(out, Waiting(records, stop, gated=True, split=split, step=step, gaps=gaps))
            if out.waiting is not None:
                out.waiting.ticket = ticket
        return out

    def count_invalid(self, n: int) -> None:
        """`n` samples the caller could not build: counted as submitted and dropped ("invalid")."""
        with self.lock:
            self.submitted += n
            self._drop("invalid", n)

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
    ) -> list[bool] | None:
        """Which of a submission's samples the cap would keep if offered now (None: cannot
        tell); a sample it would refuse need not be encoded. Counts nothing."""
        if self.gate is None:
            return None
        with self.lock:
            return self.gate.keeps(split, step, scores, self._entry_seq + 1, groups)

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
                waiting.start = self._offer(
                    waiting.records, waiting.start, waiting.split, waiting.step, out, "block", waiting.gaps
                )
                waiting.lost += out.refused
                if out.waiting is not None:
                    # What a non-holding sampler passed waits on as plain records.
                    self.waitings.discard(waiting)
                    out.waiting.ticket, out.waiting.lost = waiting.ticket, waiting.lost
                    return out
            else:
                waiting.start = self._enqueue(waiting.records, out, "block", waiting.start)
            if len(waiting):
                out.waiting = waiting
            else:
                self.waitings.discard(waiting)
        return out

    def _give_up(self, waiting: Waiting, reason: DropReason) -> None:
        """Lock held: drop what `waiting` still holds."""
        rest = waiting.rest()
        self.accepted -= len(rest)
        self._drop(reason, len(rest), rest)
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
                raise SessionClosedError("the session is finished; it accepts no more samples")
            n = len(records)
            self.submitted += n
            self.accepted += n
            self.replayed += n
            stop = self._enqueue(records, out, "block")
            if stop < n:
                self._wait(out, Waiting(records, stop))
        return out

    def undispatched_records(self) -> list[TraceRecord]:
        """Records still queued (not handed to any sink); used to spill them to the spool at finish."""
        with self.lock:
            return [item for item in self.queue if isinstance(item, TraceRecord)]

    # -- reservations for log_rollouts ---------------------------------------------------

    def reserve(
        self, scores: Sequence[float | None], *, split: str, step: int, invalid: int = 0
    ) -> tuple[list[Entry | None], bool] | None:
        """Ask the gate which rows can be kept before they are decoded; counts the rest, and
        `invalid` rows that were left out (counted as submitted and dropped). Also returns
        whether the writer should be woken (this offer closed older steps, releasing them).
        None (nothing counted) when a holding sampler's selection has no room under "block"
        (see `_room_for_held`): the caller waits for room and asks again."""
        with self.lock:
            if self.closed:
                raise SessionClosedError("the session is finished; it accepts no more samples")
            n = len(scores)
            full = self.gate is not None and n and self._room_needed(split, step, 0) is not None
            if full and self.on_full == "block" and not self._room_for_held(split, step, 0, "block"):
                return None
            self.submitted += n + invalid
            if invalid:
                self._drop("invalid", invalid)
            if full and self.on_full != "block" and not self._room_for_held(split, step, 0, self.on_full):
                self._drop("queue_full", n)
                return [None] * n, False
            entries: list[Entry] = []
            for s in scores:
                self._entry_seq += 1
                entries.append(Entry(s, self._entry_seq))
            if self.gate is None:
                for e in entries:
                    e.state = RELEASED
                self.accepted += n
                return list(entries), False
            result = self.gate.offer(split, step, entries, self.clock())
            _, wake = self._apply_gate(result)
            self.accepted += len(result.passed) + result.held
            return [e if e.state != EVICTED else None for e in entries], wake

    def fill(self, entries: Sequence[Entry], records: Sequence[TraceRecord]) -> Admission:
        """Attach decoded records to reserved entries; released ones go to the queue now."""
        out = Admission()
        ready: list[TraceRecord] = []
        with self.lock:
            if self.closed:
                # finish() ran while these rows were decoded: nothing would deliver them now.
                n = sum(1 for e in entries if e.state != EVICTED)
                for e in entries:
                    e.state = EVICTED
                self.accepted -= n
                self._drop("closed", n)
                return out
            staged: list[TraceRecord] = []
            for e, r in zip(entries, records, strict=True):
                if e.state == HELD:
                    e.record = r
                    staged.append(r)
                elif e.state == RELEASED:
                    ready.append(r)
                    staged.append(r)
                # EVICTED: already counted as capped.
            if self.spool_on_admit and self.spool is not None:
                self.spool.stage(staged)
            # Held rows count as accepted, as they do in log_samples; drops below subtract.
            out.accepted = len(staged)
            stop = self._enqueue(ready, out)
            if stop < len(ready):
                self._wait(out, Waiting(ready, stop))
        return out

    def cancel(self, entries: Sequence[Entry], reason: DropReason, *, split: str, step: int) -> None:
        """Resolve reserved entries that could not be filled (their decoding failed); they
        give their places in the step's selection back."""
        with self.lock:
            live = [e for e in entries if e.state != EVICTED]
            if self.gate is not None:
                self.gate.withdraw(split, step, live)
            for e in live:
                e.state = EVICTED
            self.accepted -= len(live)
            self._drop(reason, len(live), [e.record for e in live if e.record is not None])

    # -- steps ---------------------------------------------------------------------------

    def close_steps(self, *, idle_only: bool = False) -> bool:
        if self.gate is None:
            return False
        with self.lock:
            entries = self.gate.close_idle(self.clock()) if idle_only else self.gate.close_all()
            return self._release(entries)

    # -- writer side (event-loop thread) -------------------------------------------------

    def push_item(self, item: Marker | MetricsItem) -> None:
        with self.lock:
            self.queue.append(item)
            self.control_items += 1

    def take(self) -> Batch | Marker | MetricsItem | None:
        """Pop the next batch (up to batch_size records) or control item."""
        with self.lock:
            if not self.queue:
                return None
            head = self.queue[0]
            if not isinstance(head, TraceRecord):
                self.queue.popleft()
                self.control_items -= 1
                return head
            queue = self.queue
            records: list[TraceRecord]
            if not self.control_items:
                # Only records are queued: take them in bulk, without a check per record.
                if len(queue) <= self.batch_size:
                    records = list(queue)  # type: ignore[arg-type]
                    queue.clear()
                else:
                    pop = queue.popleft
                    records = [pop() for _ in range(self.batch_size)]  # type: ignore[misc]
            else:
                records = []
                while queue and len(records) < self.batch_size and isinstance(queue[0], TraceRecord):
                    records.append(queue.popleft())  # type: ignore[arg-type]
            self.undispatched -= len(records)
            self.first_undispatched_at = self.clock() if self.undispatched else None
            batch = Batch(records, len(self.sinks))
            self._pin(batch)
            return batch

    def _pin(self, batch: Batch) -> None:
        batch.pinned = True
        self.pinned_records += len(batch.records)
        self.pinned_bytes += batch.nbytes

    def dispatched(self, batch: Batch) -> None:
        """The batch is in the sinks' inboxes (and spooled): drop_oldest may now evict from it."""
        if self.on_full == "drop_oldest":
            with self.lock:
                self.unstarted.append(batch)
                batch.pinned = False
                self.pinned_records -= len(batch.records)
                self.pinned_bytes -= batch.nbytes

    def start(self, batches: Sequence[Batch]) -> None:
        """A sink is about to write these batches: from now on they are out of eviction's reach."""
        with self.lock:
            for batch in batches:
                batch.started = True
                if not batch.pinned:
                    self._pin(batch)
            # Lanes start batches in order, so the started ones are at the front: forget them
            # here, or every batch ever written would stay referenced (with its payloads).
            unstarted = self.unstarted
            while unstarted and (unstarted[0].started or not unstarted[0].records):
                unstarted.popleft()

    def resolve(
        self,
        batch: Batch,
        lane: int,
        ok: bool,
        retries: int,
        error: str | None,
        picked: Picked | None = None,
    ) -> bool:
        """One sink is done with a batch; True when buffer room was freed. `picked`: what a
        selecting sink's selection made of the batch (it wrote `picked.write` only, and failed
        `picked.failed` of them; `ok` is then not used)."""
        n = len(batch.records)
        with self.lock:
            sink = self.sinks[lane]
            sink.retries += retries
            if picked is None:
                if ok:
                    sink.written += n
                else:
                    sink.failed += n
                    sink.last_error = error
                    batch.errors.append((self.sink_names[lane], error or "failed"))
                    batch.failed = True
            else:
                sink.written += len(picked.write) - len(picked.failed)
                if picked.failed:
                    sink.failed += len(picked.failed)
                    sink.last_error = error
                    batch.errors.append((self.sink_names[lane], error or "failed"))
                    ids = batch.failed_ids if batch.failed_ids is not None else set()
                    ids.update(id(r) for r in picked.failed)
                    batch.failed_ids = ids
                sink.skipped.update(picked.skipped)
                sink.held += len(picked.held)
                for r in picked.held:
                    hold = self.holds.get(id(r))
                    if hold is None:
                        hold = self.holds[id(r)] = _Hold(r)
                    hold.holders += 1
            batch.lanes_left -= 1
            if batch.lanes_left:
                return False
            self.depth -= n
            self.nbytes -= batch.nbytes
            if batch.pinned:
                self.pinned_records -= n
                self.pinned_bytes -= batch.nbytes
            if self.holds or batch.failed_ids:
                self._settle_batch(batch)
            else:
                if batch.failed:
                    self.failed += n
                else:
                    self.written += n
                if self.spool is not None:
                    if batch.failed:
                        self._spool_failed(batch.records, batch.errors)
                    else:
                        self.spool.resolve(batch.records)
            return True

    def _spool_failed(self, records: Sequence[TraceRecord], errors: list[tuple[str, str]]) -> None:
        assert self.spool is not None
        error_text = "; ".join(f"{name}: {e}" for name, e in errors)
        self.spool.resolve(records, error_text, [name for name, _ in errors])

    def _settle_batch(self, batch: Batch) -> None:
        """Lock held: every sink is done with a batch some selection took part in. Records no
        sink holds are resolved now; held ones once their holders decide them."""
        failed_ids = batch.failed_ids or set()
        ok: list[TraceRecord] = []
        bad: list[TraceRecord] = []
        errors = list(batch.errors)
        for r in batch.records:
            failed = batch.failed or id(r) in failed_ids
            hold = self.holds.get(id(r))
            if hold is not None:
                hold.batch_done = True
                if failed:
                    hold.failed = True
                    hold.errors.extend(batch.errors)
                if hold.holders:
                    continue
                del self.holds[id(r)]
                failed = hold.failed  # a holder may have failed it before the batch was done
                errors.extend(e for e in hold.errors if e not in errors)
            (bad if failed else ok).append(r)
        self._finalize(ok, bad, errors)

    def _finalize(self, ok: list[TraceRecord], bad: list[TraceRecord], errors: list[tuple[str, str]]) -> None:
        self.written += len(ok)
        self.failed += len(bad)
        if self.spool is not None:
            if ok:
                self.spool.resolve(ok)
            if bad:
                self._spool_failed(bad, errors)

    def resolve_held(
        self, lane: int, records: Sequence[TraceRecord], outcome: str, error: str | None
    ) -> None:
        """A selecting sink decided records its selection held: `outcome` is "written",
        "failed" (with `error`) or the reason it left them out."""
        if not records:
            return
        with self.lock:
            sink = self.sinks[lane]
            sink.held -= len(records)
            if outcome == "written":
                sink.written += len(records)
            elif outcome == "failed":
                sink.failed += len(records)
                sink.last_error = error
            else:
                sink.skipped[outcome] += len(records)
            ok: list[TraceRecord] = []
            bad: list[TraceRecord] = []
            errors: list[tuple[str, str]] = []
            for r in records:
                hold = self.holds[id(r)]
                hold.holders -= 1
                if outcome == "failed":
                    hold.failed = True
                    hold.errors.append((self.sink_names[lane], error or "failed"))
                if hold.holders or not hold.batch_done:
                    continue
                del self.holds[id(r)]
                (bad if hold.failed else ok).append(r)
                if hold.failed:
                    errors.extend(e for e in hold.errors if e not in errors)
            self._finalize(ok, bad, errors)

    def note_retries(self, lane: int, retries: int) -> None:
        with self.lock:
            self.sinks[lane].retries += retries

    def note_metrics_failure(self, lane: int, error: str) -> None:
        with self.lock:
            self.sinks[lane].metrics_failed += 1
            self.sinks[lane].last_error = error

    def snapshot(self) -> SessionStats:
        with self.lock:
            return SessionStats(
                submitted=self.submitted,
                accepted=self.accepted,
                written=self.written,
                dropped=dict(self.dropped),
                failed=self.failed,
                retries=sum(s.retries for s in self.sinks),
                pending=self.submitted - self.written - self.failed - sum(self.dropped.values()),
                queue_depth=self.depth,
                queue_bytes=self.nbytes,
                replayed=self.replayed,
                sinks={
                    name: SinkStats(
                        written=s.written,
                        failed=s.failed,
                        retries=s.retries,
                        metrics_failed=s.metrics_failed,
                        last_error=s.last_error,
                        skipped={k: v for k, v in s.skipped.items() if v},
                        held=s.held,
                    )
                    for name, s in zip(self.sink_names, self.sinks, strict=True)
                },
            )
